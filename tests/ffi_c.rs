//! libkvd from C: the programs under `tests/c/` and the example in `ffi/examples/`, compiled with
//! the system C compiler against `include/kvd.h` and libkvd (`-std=c11 -Wall -Wextra -Werror`,
//! and again under AddressSanitizer + UBSan where the compiler has them), run against a real
//! daemon.

mod support;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use support::*;

/// The repository root (the tests live in `../tests` of the kvd package).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

/// The folder libkvd is built into: the one the `kvd` binary is in (same profile).
fn lib_dir() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_kvd"))
        .parent()
        .unwrap()
        .to_owned()
}

/// Build libkvd (once per test process), so that the programs link the library of this tree.
fn libkvd() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        let dir = lib_dir();
        let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        cmd.args(["build", "--quiet", "-p", "kvd-ffi"])
            .current_dir(root());
        if dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let s = cmd.status().expect("running cargo build -p kvd-ffi");
        assert!(s.success(), "cargo build -p kvd-ffi failed");
        assert!(dir.join("libkvd.so").exists(), "no libkvd.so in {dir:?}");
        dir
    })
}

fn cc() -> String {
    std::env::var("CC").unwrap_or_else(|_| "cc".into())
}

const SANITIZERS: &[&str] = &["-fsanitize=address,undefined", "-fno-sanitize-recover=all"];

/// Whether the compiler can build and run a sanitized program here.
fn sanitizers_work(out: &Path) -> bool {
    let src = out.join("probe.c");
    std::fs::write(&src, "int main(void) { return 0; }\n").unwrap();
    let exe = out.join("probe");
    Command::new(cc())
        .args(SANITIZERS)
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .status()
        .is_ok_and(|s| s.success())
        && Command::new(&exe).status().is_ok_and(|s| s.success())
}

/// Compile `src` against kvd.h and libkvd; the executable.
fn compile(src: &Path, out: &Path, sanitize: bool) -> PathBuf {
    let lib = libkvd();
    let name = src.file_stem().unwrap().to_str().unwrap();
    let exe = out.join(if sanitize {
        format!("{name}-san")
    } else {
        name.to_owned()
    });
    let mut cmd = Command::new(cc());
    cmd.args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-g", "-O1"])
        .arg("-D_POSIX_C_SOURCE=200809L")
        .arg("-I")
        .arg(root().join("include"))
        .arg(src)
        .arg("-o")
        .arg(&exe)
        .arg("-L")
        .arg(lib)
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-lkvd");
    if sanitize {
        cmd.args(SANITIZERS);
    }
    let o = cmd.output().expect("running the C compiler");
    assert!(
        o.status.success(),
        "compiling {src:?} failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    exe
}

/// Run a compiled test program against `socket`; its stdout.
fn run(exe: &Path, socket: &Path) -> String {
    let o = Command::new(exe)
        .arg(socket)
        .env("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0")
        .output()
        .expect("running a C test program");
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{exe:?} failed ({}):\nstdout:\n{stdout}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    stdout
}

/// Each program built plainly and, where possible, sanitized.
fn builds(name: &str) -> Vec<PathBuf> {
    let out = tempfile::tempdir().unwrap().keep();
    let src = root().join("tests/c").join(format!("{name}.c"));
    let mut exes = vec![compile(&src, &out, false)];
    if sanitizers_work(&out) {
        exes.push(compile(&src, &out, true));
    } else {
        eprintln!(
            "note: {} cannot build sanitized programs here; plain run only",
            cc()
        );
    }
    exes
}

fn passes(name: &str, extra: &[&str]) {
    for exe in builds(name) {
        let d = Daemon::start(extra);
        let out = run(&exe, &d.socket);
        assert!(out.contains("checks passed"), "{exe:?}: {out}");
    }
}

/// A store counter is declared once (kvd-core's `counters` list). This shows every declared
/// counter, by the declaration's names and in its order, reaching a C caller
/// (`kvd_counter_name`, `kvd_counters`), the daemon's `/metrics` (a `counter` family each) and
/// the Python package's `stats()`: a counter added to the list appears in all three.
#[test]
fn every_declared_counter_reaches_c_metrics_and_python_stats() {
    let declared: Vec<&str> = kvd::store::Counters::DECLARED
        .iter()
        .map(|d| d.name)
        .collect();
    for exe in builds("counters") {
        let d = Daemon::start(&[]);
        let out = run(&exe, &d.socket);
        assert!(out.contains("checks passed"), "{exe:?}: {out}");
        let from_c: Vec<&str> = out
            .lines()
            .filter_map(|l| l.strip_prefix("counter "))
            .map(|l| l.split(' ').next().unwrap())
            .collect();
        assert_eq!(from_c, declared, "kvd_counter_name, in order");
    }

    let d = Daemon::start(&[]);
    let (code, text) = d.get("/metrics");
    assert_eq!(code, 200);
    for c in kvd::store::Counters::DECLARED {
        let m = c.metric;
        assert!(
            text.contains(&format!("# TYPE {m} counter\n"))
                && text.contains(&format!("\n{m}_total ")),
            "no counter {m} in /metrics:\n{text}"
        );
    }

    let script = "import json, sys, kvd, kvd._lib as L\n\
                  with kvd.Client(sys.argv[1]) as c:\n    \
                  print(json.dumps([list(c.stats()), list(L.COUNTER_NAMES)]))\n";
    let o = Command::new("python3")
        .args(["-c", script])
        .arg(&d.socket)
        .env("PYTHONPATH", root().join("ffi/python"))
        .env("KVD_LIBRARY", libkvd().join("libkvd.so"))
        .output()
        .expect("running python3");
    assert!(
        o.status.success(),
        "python3 failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let (keys, names): (Vec<String>, Vec<String>) = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(names, declared, "the Python package's COUNTER_NAMES");
    for name in &declared {
        assert!(
            keys.iter().any(|k| k == name),
            "stats() has no {name}: {keys:?}"
        );
    }
}

#[test]
fn the_whole_lifecycle_runs_from_c() {
    passes("lifecycle", &[]);
}

#[test]
fn cuda_calls_without_cuda_say_so_and_bad_arguments_are_errors_from_c() {
    passes("cuda", &[]);
}

#[test]
fn the_ranks_of_an_instance_publish_a_step_together_and_fail_together_from_c() {
    passes("instances", &[]);
}

#[test]
fn every_status_code_c_can_provoke_comes_back_with_its_detail() {
    passes(
        "status_codes",
        &[
            "--verify-supplied-checksums",
            "--max-sessions-per-process",
            "3",
        ],
    );
}

#[test]
fn misuse_from_c_is_answered_with_errors_not_crashes() {
    passes("misuse", &[]);
}

#[test]
fn a_c_router_drains_block_events_in_batches_and_learns_what_it_lost() {
    passes("events", &["--event-log-capacity", "4"]);
}

#[test]
fn asynchronous_lookups_complete_through_the_eventfd_within_their_bound() {
    passes("async", &[]);
}

#[test]
fn a_c_client_sees_unavailable_while_its_daemon_drains_and_disconnected_once_it_died() {
    for exe in builds("drills") {
        let mut d = Daemon::start(&["--drain-deadline-ms", "30000"]);
        let mut child = Command::new(&exe)
            .arg(&d.socket)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting drills");
        let mut stdin = child.stdin.take().unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut expect = |word: &str| {
            let l = lines.next().expect("a line from drills").unwrap();
            assert_eq!(l, word);
        };
        expect("pinned");
        let (code, _) = d.post("/drain");
        assert_eq!(code, 202);
        writeln!(stdin, "drain").unwrap();
        expect("drained");
        signal(d.pid(), rustix::process::Signal::KILL);
        d.wait_exit(std::time::Duration::from_secs(30))
            .expect("the daemon died");
        writeln!(stdin, "killed").unwrap();
        let last = lines.next().expect("the closing line").unwrap();
        assert!(last.ends_with("checks passed"), "{last}");
        let s = child.wait().unwrap();
        assert!(s.success(), "drills failed: {s}");
    }
}

#[test]
fn the_c_example_publishes_a_block_the_rust_client_then_finds() {
    let out = tempfile::tempdir().unwrap();
    let exe = compile(&root().join("ffi/examples/put.c"), out.path(), false);
    let d = Daemon::start(&[]);
    let printed = run(&exe, &d.socket);
    assert!(printed.starts_with("published block"), "{printed}");
    let status = d.status();
    assert_eq!(status.stats.accounting.published, 1);
    assert_eq!(status.stats.counters.blocks_published, 1);
}

#[test]
fn the_bindings_benchmark_compiles_against_the_header() {
    // It runs in scripts/bench-bindings.sh against a release daemon; here it only must build.
    let out = tempfile::tempdir().unwrap();
    let exe = compile(&root().join("benches/c/bindings.c"), out.path(), false);
    assert!(exe.exists());
}

#[test]
fn a_c_client_pushes_and_fetches_blocks_between_two_daemons() {
    for exe in builds("transfers") {
        let net = support::raw::Net::new();
        let b = net.node(2, &[]);
        let a = net.node(1, &[]);
        let o = Command::new(&exe)
            .arg(&a.socket)
            .arg(&b.socket)
            .env("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0")
            .output()
            .expect("running transfers");
        let stdout = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success() && stdout.contains("checks passed"),
            "{exe:?} ({}):\n{stdout}\n{}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        );
    }
}
