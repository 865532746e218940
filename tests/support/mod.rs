//! Shared helpers for the daemon integration tests: start the real `kvd` binary on a temporary
//! data dir, socket and free loopback port; talk to it; wait with a deadline; stop it on drop.
//!
//! Every wait is bounded, with margins meant for a loaded 2-core machine.

#![allow(dead_code)]

pub mod cluster;
pub mod drill;
pub mod raw;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use kvd::client::{Client, ClientOptions};
use kvd::daemon::admin::StatusReport;
use kvd::keys::{BlockKey, BlockTag, KvDtype, NamespaceDescriptor, NamespaceId};

/// Whether this kvd can use RDMA on this host (built with the `rdma` feature, and the kernel
/// lists an RDMA device): the tests that expect TCP because there is none check that instead.
pub fn rdma_here() -> bool {
    cfg!(feature = "rdma")
        && std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some())
}

/// How long a daemon may take to start on a loaded machine.
pub const START_TIMEOUT: Duration = Duration::from_secs(60);

/// A running `kvd serve`, killed on drop.
#[derive(Debug)]
pub struct Daemon {
    child: Option<Child>,
    /// The data dir (kept alive by `_tmp` when the daemon made it).
    pub dir: PathBuf,
    _tmp: Option<tempfile::TempDir>,
    /// The local protocol's socket.
    pub socket: PathBuf,
    /// The admin HTTP address.
    pub admin: SocketAddr,
    /// The probe listener's address, when started with `--probe-listen`.
    pub probes: Option<SocketAddr>,
    /// The node generation the daemon announced.
    pub generation: u64,
}

/// `args` as the `&str`s [`Daemon::start`] and its kin take.
pub fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// The flags every test daemon gets: a small pool of 256 KiB pages, no huge pages, a fast
/// reaper.
pub fn base_args(dir: &Path) -> Vec<String> {
    [
        "serve",
        "--data-dir",
        dir.to_str().unwrap(),
        "--socket",
        dir.join("kvd.sock").to_str().unwrap(),
        "--admin-listen",
        "127.0.0.1:0",
        "--pool-mib",
        "16",
        "--page-kib",
        "256",
        "--huge-pages",
        "off",
        "--reap-interval-ms",
        "20",
        "--threads",
        "2",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

impl Daemon {
    /// Start a daemon on a fresh temporary data dir.
    pub fn start(extra: &[&str]) -> Daemon {
        let tmp = tempfile::tempdir().expect("a temp dir");
        let mut d = Daemon::start_in(tmp.path(), extra);
        d._tmp = Some(tmp);
        d
    }

    /// Start a daemon on `dir` (which may hold a previous run's generation).
    pub fn start_in(dir: &Path, extra: &[&str]) -> Daemon {
        Daemon::spawn(dir, command(dir, extra))
    }

    /// Start a daemon on a fresh temporary data dir inside network namespace `ns` (its Unix
    /// socket stays reachable from here: sockets on the file system are not namespaced; its
    /// admin HTTP is not).
    pub fn start_in_netns(ns: &str, extra: &[&str]) -> Daemon {
        let tmp = tempfile::tempdir().expect("a temp dir");
        let mut d = Daemon::spawn(
            tmp.path(),
            command_in(&["ip", "netns", "exec", ns], tmp.path(), extra),
        );
        d._tmp = Some(tmp);
        d
    }

    /// Start a daemon on a fresh temporary data dir whose open-file limit (RLIMIT_NOFILE) is
    /// `soft` and `hard` from its first instruction, as `ulimit -n` or systemd's `LimitNOFILE=`
    /// would set it.
    pub fn start_with_nofile(extra: &[&str], soft: u64, hard: u64) -> Daemon {
        let tmp = tempfile::tempdir().expect("a temp dir");
        let mut cmd = command(tmp.path(), extra);
        limit_nofile(&mut cmd, soft, hard);
        let mut d = Daemon::spawn(tmp.path(), cmd);
        d._tmp = Some(tmp);
        d
    }

    fn spawn(dir: &Path, mut cmd: Command) -> Daemon {
        let mut child = cmd.spawn().expect("starting kvd");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + START_TIMEOUT;
        let ready = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(l) if l.starts_with("kvd ready") => break l,
                Ok(_) => continue,
                Err(_) => {
                    let _ = child.kill();
                    panic!(
                        "kvd did not start within {START_TIMEOUT:?}; log:\n{}",
                        std::fs::read_to_string(dir.join("daemon.log")).unwrap_or_default()
                    );
                }
            }
        };
        let field = |k: &str| {
            ready
                .split_whitespace()
                .find_map(|w| w.strip_prefix(k))
                .unwrap_or_else(|| panic!("no {k} in {ready:?}"))
                .to_owned()
        };
        Daemon {
            child: Some(child),
            dir: dir.to_owned(),
            _tmp: None,
            socket: PathBuf::from(field("socket=")),
            admin: field("admin=").parse().unwrap(),
            probes: ready
                .split_whitespace()
                .find_map(|w| w.strip_prefix("probes="))
                .map(|a| a.parse().unwrap()),
            generation: field("generation=").parse().unwrap(),
        }
    }

    /// A client session with a lease of `lease_ttl_ms`.
    pub fn client(&self, name: &str, lease_ttl_ms: u64) -> Client {
        Client::connect(&self.socket, &options(name, lease_ttl_ms)).expect("connecting")
    }

    /// `/status`.
    pub fn status(&self) -> StatusReport {
        kvd::daemon::status::fetch(self.admin).expect("/status")
    }

    /// The data port's address (the daemon must have one).
    pub fn data_addr(&self) -> std::net::SocketAddr {
        self.status()
            .data_port
            .expect("the data port is on")
            .listen
            .parse()
            .expect("a socket address")
    }

    /// `GET path` on the admin port: (status code, body).
    pub fn get(&self, path: &str) -> (u16, String) {
        kvd::daemon::status::http(self.admin, "GET", path).expect("admin GET")
    }

    /// `POST path` on the admin port.
    pub fn post(&self, path: &str) -> (u16, String) {
        kvd::daemon::status::http(self.admin, "POST", path).expect("admin POST")
    }

    /// The daemon's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// Send SIGTERM.
    pub fn sigterm(&self) {
        signal(self.pid(), rustix::process::Signal::TERM);
    }

    /// Wait for the process to exit, at most `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let child = self.child.as_mut().unwrap();
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = child.try_wait().unwrap() {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM and wait (bounded) for a clean exit; returns the exit status.
    pub fn stop(&mut self) -> ExitStatus {
        self.sigterm();
        self.wait_exit(Duration::from_secs(60))
            .expect("kvd did not exit within 60 s of SIGTERM")
    }

    /// The daemon's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("daemon.log")).unwrap_or_default()
    }
}

/// `kvd serve` on `dir` with [`base_args`] and `extra`, its stdout piped (for the ready line)
/// and its stderr appended to `dir/daemon.log`.
pub fn command(dir: &Path, extra: &[&str]) -> Command {
    command_in(&[], dir, extra)
}

/// As [`command`], behind the command `prefix` (for example `ip netns exec NS`).
pub fn command_in(prefix: &[&str], dir: &Path, extra: &[&str]) -> Command {
    let mut args = base_args(dir);
    args.extend(extra.iter().map(|s| s.to_string()));
    let stderr = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("daemon.log"))
        .expect("a log file");
    let mut cmd = prefixed(prefix, env!("CARGO_BIN_EXE_kvd"));
    cmd.args(&args)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr);
    cmd
}

/// `program` behind the command `prefix` (for example `ip netns exec NS`), or alone.
pub fn prefixed(prefix: &[&str], program: impl AsRef<std::ffi::OsStr>) -> Command {
    match prefix.split_first() {
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(program);
            c
        }
        None => Command::new(program),
    }
}

/// Make `cmd`'s process start with RLIMIT_NOFILE = `soft`, `hard`.
pub fn limit_nofile(cmd: &mut Command, soft: u64, hard: u64) {
    use std::os::unix::process::CommandExt as _;
    let limit = rustix::process::Rlimit {
        current: Some(soft),
        maximum: Some(hard),
    };
    // SAFETY: the closure runs in the forked child before exec; it makes one raw system call
    // (rustix's setrlimit, no allocation, no lock) and builds its error from an errno, both
    // async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            rustix::process::setrlimit(rustix::process::Resource::Nofile, limit)
                .map_err(|e| std::io::Error::from_raw_os_error(e.raw_os_error()))
        });
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Client options with a name and lease.
pub fn options(name: &str, lease_ttl_ms: u64) -> ClientOptions {
    ClientOptions {
        lease_ttl_ms,
        io_timeout_ms: 30_000,
        ..ClientOptions::named(name)
    }
}

/// Send a signal to a process.
pub fn signal(pid: u32, sig: rustix::process::Signal) {
    let pid = rustix::process::Pid::from_raw(pid as i32).expect("a positive pid");
    rustix::process::kill_process(pid, sig).expect("kill");
}

/// Poll `f` until it holds or `timeout` passes; panic with `what` then.
pub fn wait_until(timeout: Duration, what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return;
        }
        if Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting until {what}");
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// Poll transfer `id` (started by `c`'s daemon) until it is no longer in flight, within
/// `timeout`; its last state.
pub fn wait_transfer(c: &mut Client, id: u64, timeout: Duration) -> kvd::protocol::TransferInfo {
    let mut last = None;
    wait_until(timeout, &format!("transfer {id} ends"), || {
        let t = c.transfers(&[id]).unwrap().remove(0);
        let done = t.state != kvd::protocol::TransferState::InFlight;
        last = Some(t);
        done
    });
    last.expect("polled at least once")
}

/// A small test layout: blocks of 64 KiB (the test daemon's pages are 256 KiB).
pub fn namespace() -> NamespaceDescriptor {
    NamespaceDescriptor {
        model_name: "test/tiny".into(),
        model_revision: "r1".into(),
        tokenizer: "tok-1".into(),
        adapter: String::new(),
        cache_salt: String::new(),
        dtype: KvDtype::Bf16,
        num_layers: 2,
        num_kv_heads: 2,
        head_dim: 64,
        tokens_per_block: 16,
        bytes_per_block: 64 * 1024,
        tp_rank: 0,
        tp_size: 1,
        pp_rank: 0,
        pp_size: 1,
        rope: "theta=1e6".into(),
    }
}

/// `n` distinct keys in `ns`, derived from `seed`.
pub fn keys(ns: NamespaceId, seed: u64, n: usize) -> Vec<BlockKey> {
    (0..n)
        .map(|i| {
            let mut h = blake3::Hasher::new();
            h.update(&seed.to_le_bytes());
            h.update(&(i as u64).to_le_bytes());
            BlockKey {
                namespace: ns,
                tag: BlockTag(*h.finalize().as_bytes()),
            }
        })
        .collect()
}

/// Deterministic page bytes.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(151).wrapping_add(seed) ^ (i >> 9) as u8)
        .collect()
}

/// Write `data(i)` into the `i`th of `allocs` from offset 0, its CRC-32C computed on the way;
/// the seal items that carry those checksums.
pub fn write_all(
    c: &mut Client,
    allocs: &[kvd::store::Allocation],
    data: impl Fn(usize) -> Vec<u8>,
) -> Vec<kvd::protocol::SealItem> {
    allocs
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let bytes = data(i);
            let crc = c.write_with_crc(&a.handle, 0, &bytes, 0).unwrap();
            kvd::protocol::SealItem {
                handle: a.handle,
                len: bytes.len() as u64,
                checksum: Some(crc),
            }
        })
        .collect()
}

/// Allocate, write, seal (the daemon computes the checksum) and publish one cache block.
pub fn put_one(c: &mut Client, key: BlockKey, data: &[u8]) -> kvd::store::Allocation {
    let a = c
        .alloc(&[key], kvd::store::BlockClass::Cache, None)
        .unwrap()
        .remove(0)
        .unwrap();
    c.write(&a.handle, 0, data).unwrap();
    c.seal(&[kvd::protocol::SealItem {
        handle: a.handle,
        len: data.len() as u64,
        checksum: None,
    }])
    .unwrap()
    .remove(0)
    .unwrap();
    c.publish(&[a.handle]).unwrap();
    a
}

/// Put `n` cache blocks of `len` bytes on `c`'s daemon (block `i` of `pattern(len, i)`), in
/// the test namespace, keyed from `seed`; their keys.
pub fn put_blocks(c: &mut Client, seed: u64, n: usize, len: usize) -> Vec<BlockKey> {
    let ns = c.register_namespace(&namespace()).unwrap();
    let keys = keys(ns, seed, n);
    for (i, k) in keys.iter().enumerate() {
        put_one(c, *k, &pattern(len, i as u8));
    }
    keys
}

/// Poll until the kernel reports process `pid` stopped (state `T`), at most 10 s.
pub fn wait_stopped(pid: u32) {
    wait_until(Duration::from_secs(10), "the process is stopped", || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit(')')
                    .next()
                    .map(|r| r.trim_start().starts_with('T'))
            })
            .unwrap_or(false)
    });
}

/// A helper process: this test binary started again to run one ignored test (which acts out a
/// client: a writer that hangs, a hog; or a transfer engine), with lines to its stdin and from
/// its stdout. Killed on drop.
#[derive(Debug)]
pub struct Helper {
    /// The child process.
    pub child: Child,
    stdin: Option<std::process::ChildStdin>,
    lines: std::sync::mpsc::Receiver<String>,
    log: PathBuf,
}

impl Helper {
    /// Start the ignored test `name` as a helper of `d` (its socket as `KVD_TEST_SOCKET`); its
    /// stderr goes to `<d.dir>/<name>.log`.
    pub fn start(d: &Daemon, name: &str) -> Helper {
        let socket = d.socket.to_string_lossy().into_owned();
        Helper::spawn(
            &[],
            name,
            &[("KVD_TEST_SOCKET", &socket)],
            d.dir.join(format!("{name}.log")),
        )
    }

    /// Start the ignored test `name` as a helper, behind the command `prefix` (for example
    /// `ip netns exec NS`), with `envs`; its stderr goes to `log`.
    pub fn spawn(prefix: &[&str], name: &str, envs: &[(&str, &str)], log: PathBuf) -> Helper {
        let me = std::env::current_exe().unwrap();
        let mut cmd = prefixed(prefix, &me);
        cmd.args([
            "--exact",
            name,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .envs(envs.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap());
        let mut child = cmd.spawn().unwrap();
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Helper {
            child,
            stdin,
            lines,
            log,
        }
    }

    /// Send the helper one line on its stdin.
    pub fn send(&mut self, line: &str) {
        use std::io::Write;
        let w = self.stdin.as_mut().expect("the helper's stdin");
        writeln!(w, "{line}").unwrap();
        w.flush().unwrap();
    }

    /// Send a line and wait (at most `timeout`) for the answer starting with `marker`.
    pub fn ask(&mut self, line: &str, marker: &str, timeout: Duration) -> String {
        self.send(line);
        self.wait_for(marker, timeout)
    }

    /// Wait (at most `timeout`) for the helper to print a line containing `marker`; returns
    /// the line from the marker on (libtest prints the test's name before it on the same line).
    /// Panics with the helper's stderr when it does not.
    pub fn wait_for(&mut self, marker: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    if let Some(at) = l.find(marker) {
                        return l[at..].to_owned();
                    }
                }
                Err(_) => {
                    let _ = self.child.kill();
                    panic!(
                        "the helper never printed {marker:?} within {timeout:?}; its stderr:\n{}",
                        std::fs::read_to_string(&self.log).unwrap_or_default()
                    );
                }
            }
        }
    }

    /// The helper's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// kill -9 and reap it.
    pub fn kill9(&mut self) {
        signal(self.child.id(), rustix::process::Signal::KILL);
        let _ = self.child.wait();
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The pool's memfd as the daemon holds it: a buggy process on the node scribbling over a
/// published page.
pub fn scribble_on_the_pool(daemon_pid: u32, offset: u64) {
    let dir = format!("/proc/{daemon_pid}/fd");
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        let Ok(target) = std::fs::read_link(&p) else {
            continue;
        };
        if target.to_string_lossy().starts_with("/memfd:kvd-pool") {
            let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
            std::os::unix::fs::FileExt::write_all_at(&f, b"scribbled over", offset + 100).unwrap();
            return;
        }
    }
    panic!("no kvd-pool memfd among {dir}");
}

/// Two network namespaces joined by a veth pair, deleted on drop (tests across hosts).
pub struct TwoHosts {
    /// The first host's namespace (10.77.0.1).
    pub a: String,
    /// The second host's namespace (10.77.0.2).
    pub b: String,
    /// What names this pair's namespaces and veth devices apart from other pairs'.
    tag: String,
}

/// Run `ip` with `args`; panic with its error when it fails.
pub fn ip(args: &[&str]) {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "ip {}: {} (the netns test needs root and iproute2)",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Delete namespaces an earlier run of this test left behind when it was killed (their name
/// carries the pid of a process that no longer exists).
fn remove_stale_namespaces() {
    let Ok(out) = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
    else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(pid) = name
            .strip_prefix("kvdt")
            .and_then(|r| r.strip_suffix(['a', 'b']))
            .and_then(|r| r.split('x').next())
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::process::Command::new("ip")
                .args(["netns", "del", name])
                .status();
        }
    }
}

impl TwoHosts {
    /// Two fresh namespaces, a veth pair between them (10.77.0.1/30 in `a`, 10.77.0.2/30 in
    /// `b`), loopback up in both.
    pub fn new() -> TwoHosts {
        remove_stale_namespaces();
        // the process and a count within it: tests of one binary may run at once (cargo test
        // runs them as threads of one process; nextest as processes of their own)
        static PAIRS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = PAIRS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 100;
        let tag = format!("{}x{n}", std::process::id());
        let h = TwoHosts {
            a: format!("kvdt{tag}a"),
            b: format!("kvdt{tag}b"),
            tag: tag.clone(),
        };
        ip(&["netns", "add", &h.a]);
        ip(&["netns", "add", &h.b]);
        let (va, vb) = (format!("kv{tag}a"), format!("kv{tag}b"));
        ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb]);
        ip(&["link", "set", &va, "netns", &h.a]);
        ip(&["link", "set", &vb, "netns", &h.b]);
        for (ns, dev, addr) in [(&h.a, &va, "10.77.0.1/30"), (&h.b, &vb, "10.77.0.2/30")] {
            ip(&["-n", ns, "addr", "add", addr, "dev", dev]);
            ip(&["-n", ns, "link", "set", dev, "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        h
    }

    /// The veth device in `a`.
    pub fn dev_a(&self) -> String {
        format!("kv{}a", self.tag)
    }

    /// The veth device in `b`.
    pub fn dev_b(&self) -> String {
        format!("kv{}b", self.tag)
    }

    /// Shape what `a` sends over the veth with a token bucket (`tc qdisc add ... tbf`).
    /// `queue` is the bucket's queue in tbf's words: `latency 100ms`, or `limit 8mb` for a
    /// queue that holds a whole test's bytes, so that nothing is ever dropped at it.
    pub fn shape_a(&self, rate: &str, burst: &str, queue: &str) {
        tbf(&self.a, &self.dev_a(), rate, burst, queue);
    }

    /// Shape `ns`'s egress on `dev` to `rate` (tc tbf), so that a transfer surely is in the
    /// middle when the link is cut.
    pub fn slow(&self, ns: &str, dev: &str, rate: &str) {
        tbf(ns, dev, rate, "32kb", "latency 100ms");
    }
}

/// A token bucket on `ns`'s egress on `dev` (`tc qdisc add ... tbf`), its queue in tbf's words.
fn tbf(ns: &str, dev: &str, rate: &str, burst: &str, queue: &str) {
    let ok = std::process::Command::new("ip")
        .args([
            "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
        ])
        .args(["tbf", "rate", rate, "burst", burst])
        .args(queue.split_whitespace())
        .status()
        .unwrap()
        .success();
    assert!(ok, "tc tbf on {dev} in {ns}");
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for ns in [&self.a, &self.b] {
            let _ = std::process::Command::new("ip")
                .args(["netns", "del", ns])
                .status();
        }
    }
}

/// A real etcd (Debian's `etcd-server`) on free loopback ports with a temporary data dir,
/// killed on drop.
#[derive(Debug)]
pub struct Etcd {
    child: Child,
    dir: tempfile::TempDir,
    /// Its client URL.
    pub url: String,
    prefix: Vec<String>,
    args: Vec<std::ffi::OsString>,
    probe: String,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Etcd {
    /// Start one and wait (at most 30 s) until it accepts clients.
    pub fn start() -> Etcd {
        Etcd::start_on(&[], "127.0.0.1")
    }

    /// Start one behind the command `prefix` (for example `ip netns exec NS`), listening on
    /// `host`, and wait (at most 30 s) until it accepts clients there.
    pub fn start_on(prefix: &[&str], host: &str) -> Etcd {
        Etcd::start_with(prefix, host, None)
    }

    /// Start one on loopback that speaks TLS to its clients and wants client certificates
    /// signed by the CA in `certs` (`ca.pem`, `server.pem`, `server.key`).
    pub fn start_tls(certs: &Path) -> Etcd {
        Etcd::start_with(&[], "127.0.0.1", Some(certs))
    }

    fn start_with(prefix: &[&str], host: &str, tls: Option<&Path>) -> Etcd {
        // On tmpfs where there is one: its WAL's fsync on this VM's disk took over a second
        // under load, and every 2 s lease lapsed behind it (etcd's leader applies its committed
        // log before it renews a lease). The tests are of kvd, not of etcd's durability.
        let dir = tempfile::Builder::new()
            .prefix("kvd-etcd-")
            .tempdir_in("/dev/shm")
            .or_else(|_| tempfile::tempdir())
            .unwrap();
        let (client, peer) = (free_port(), free_port());
        let scheme = if tls.is_some() { "https" } else { "http" };
        let url = format!("{scheme}://{host}:{client}");
        let peer_url = format!("http://{host}:{peer}");
        let mut args: Vec<std::ffi::OsString> = ["--name", "kvd-test", "--data-dir"]
            .iter()
            .map(Into::into)
            .collect();
        args.push(dir.path().join("data").into());
        for a in [
            "--listen-client-urls",
            &url,
            "--advertise-client-urls",
            &url,
            "--listen-peer-urls",
            &peer_url,
            "--initial-advertise-peer-urls",
            &peer_url,
            "--initial-cluster",
            &format!("kvd-test={peer_url}"),
        ] {
            args.push(a.into());
        }
        if let Some(c) = tls {
            for (flag, file) in [
                ("--cert-file", "server.pem"),
                ("--key-file", "server.key"),
                ("--trusted-ca-file", "ca.pem"),
            ] {
                args.push(flag.into());
                args.push(c.join(file).into());
            }
            args.push("--client-cert-auth".into());
        }
        let prefix: Vec<String> = prefix.iter().map(|s| s.to_string()).collect();
        let child = Etcd::spawn(&prefix, &args, dir.path());
        let e = Etcd {
            child,
            dir,
            url,
            prefix,
            args,
            probe: format!("echo > /dev/tcp/{host}/{client}"),
        };
        e.wait_ready();
        e
    }

    fn spawn(prefix: &[String], args: &[std::ffi::OsString], dir: &Path) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("etcd.log"))
            .unwrap();
        let prefix: Vec<&str> = prefix.iter().map(String::as_str).collect();
        prefixed(&prefix, "etcd")
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("etcd (Debian's etcd-server; the test command installs it)")
    }

    fn wait_ready(&self) {
        let prefix: Vec<&str> = self.prefix.iter().map(String::as_str).collect();
        wait_until(Duration::from_secs(30), "etcd accepts clients", || {
            prefixed(&prefix, "bash")
                .args(["-c", &self.probe])
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        });
    }

    /// Kill it and start it again on the same ports and data (a brief outage); waits until it
    /// accepts clients again.
    pub fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = Etcd::spawn(&self.prefix, &self.args, self.dir.path());
        self.wait_ready();
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The static cluster of one test: each node's key made in advance in the test's directory
/// (`--node-key-file`), and one peers file every daemon of the test reads (`--peers-file`), to
/// which each node's line is added as it starts (or before, where its address is fixed). A
/// daemon looks at the file again as soon as a node it does not know connects or is pushed
/// to, so a node is accepted the moment its line is there.
#[derive(Debug)]
pub struct StaticCluster {
    dir: PathBuf,
    /// The peers file.
    pub peers: PathBuf,
}

impl StaticCluster {
    /// A cluster with an empty peers file in `dir`.
    pub fn new(dir: &Path) -> StaticCluster {
        let peers = dir.join("peers");
        std::fs::write(&peers, "# node=data address,key=public key\n").unwrap();
        StaticCluster {
            dir: dir.to_owned(),
            peers,
        }
    }

    /// Node `node`'s key file (made now if there is none).
    pub fn key_file(&self, node: u64) -> PathBuf {
        let p = self.dir.join(format!("node{node}.key"));
        if !p.exists() {
            transport::link::identity::NodeKey::create(&p).unwrap();
        }
        p
    }

    /// Node `node`'s public key.
    pub fn key(&self, node: u64) -> String {
        transport::link::identity::NodeKey::from_file(&self.key_file(node))
            .unwrap()
            .public()
            .to_string()
    }

    /// The flags that make a daemon node `node` of this cluster: its id, its key and the
    /// peers file (the secret and the data port's address are the test's).
    pub fn args(&self, node: u64) -> Vec<String> {
        vec![
            "--node-id".into(),
            node.to_string(),
            "--node-key-file".into(),
            self.key_file(node).to_str().unwrap().into(),
            "--peers-file".into(),
            self.peers.to_str().unwrap().into(),
        ]
    }

    /// A `--peer` entry for node `node` at `addr`, with its key.
    pub fn entry(&self, node: u64, addr: &str) -> String {
        format!("{node}={addr},key={}", self.key(node))
    }

    /// Whether node `node` has a line in the peers file.
    pub fn has(&self, node: u64) -> bool {
        let prefix = format!("{node}=");
        std::fs::read_to_string(&self.peers)
            .unwrap()
            .lines()
            .any(|l| l.starts_with(&prefix))
    }

    /// Add (or move) node `node`, at `addr`, to the peers file.
    pub fn join_at(&self, node: u64, addr: &str) {
        self.set_line(node, Some(self.entry(node, addr)));
    }

    /// Add (or move) daemon `d`, node `node`, to the peers file at its data address.
    pub fn join(&self, node: u64, d: &Daemon) {
        self.join_at(node, &d.data_addr().to_string());
    }

    /// Add a node that is no daemon (a test's own engine) with key `key`.
    pub fn join_with_key(&self, node: u64, addr: &str, key: &str) {
        self.set_line(node, Some(format!("{node}={addr},key={key}")));
    }

    /// Delete node `node`'s line: the static cluster's way of revoking its key.
    pub fn remove(&self, node: u64) {
        self.set_line(node, None);
    }

    /// Replace node `node`'s line (atomically: a daemon reading the file sees the old one or
    /// the new one, never a part).
    fn set_line(&self, node: u64, line: Option<String>) {
        let text = std::fs::read_to_string(&self.peers).unwrap();
        let prefix = format!("{node}=");
        let mut lines: Vec<String> = text
            .lines()
            .filter(|l| !l.starts_with(&prefix))
            .map(str::to_owned)
            .collect();
        lines.extend(line);
        let tmp = self.peers.with_extension("tmp");
        std::fs::write(&tmp, lines.join("\n") + "\n").unwrap();
        std::fs::rename(&tmp, &self.peers).unwrap();
    }
}
