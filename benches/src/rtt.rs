//! `kvd-bench rtt`: what a metadata round trip over the local socket costs, against the
//! waiting strategy, on a quiet machine and with its CPUs kept busy.
//!
//! A metadata call is a few microseconds of work, but a thread that blocks at once lets its
//! CPU go idle, and waking it again (on a virtual machine, an interrupt to a halted vCPU) can
//! cost more than the work. Both ends of the socket therefore poll a moment before they block
//! (`protocol::spin`; the client's `spin_us`, the daemon's `--spin-us`). This bench measures,
//! for each budget in `--spin-us` (0 is "block at once"):
//!
//! - p50 / p99 of a heartbeat (an empty round trip), `exists` of 1 key and of 128 keys (misses:
//!   the lookup is the same walk), and from the two `exists` the batch cost per key;
//! - CPU per call of the daemon (all its threads, from `/proc/<pid>/task/*/schedstat`) and of
//!   the calling thread (`/proc/thread-self/schedstat`);
//! - the daemon's CPU over one idle second after the calls (the strategy must spend nothing
//!   when nobody calls);
//! - the same calls with every CPU kept busy by niced spinning threads ("under load": no CPU
//!   is ever idle, so no wake-up is paid), the figure a quiet p50 is held against.
//!
//! Each case is `--repeat` runs, alternating the budgets, medians with their spread.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvd::client::{Client, ClientOptions};
use kvd::keys::BlockKey;

use crate::curve::{Point, fmt_num};
use crate::local::{ChildDaemon, Keys, descriptor, kvd_beside, latency};

/// `kvd-bench rtt` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct RttArgs {
    /// The `kvd` binary (default: the one beside this binary).
    #[arg(long)]
    pub kvd: Option<PathBuf>,
    /// Spin budgets to compare, µs, for both the client and the daemon (0: block at once).
    #[arg(long, value_delimiter = ',', default_values_t = vec![0u32, 50])]
    pub spin_us: Vec<u32>,
    /// The daemon's budget in every case (default: the same as the client's in each case).
    #[arg(long)]
    pub daemon_spin_us: Option<u32>,
    /// Calls per measurement (each also bounded to 3 s).
    #[arg(long, default_value_t = 5000)]
    pub iters: usize,
    /// Runs per case, alternating the budgets.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
}

/// One run's figures for one budget and one machine state.
#[derive(Debug, Clone, Copy, Default)]
struct Run {
    heartbeat: (f64, f64),
    exists1: (f64, f64),
    exists128: (f64, f64),
    daemon_cpu_us_per_call: f64,
    client_cpu_us_per_call: f64,
    daemon_idle_cpu_ms: f64,
}

/// Run the benchmark.
///
/// # Errors
/// When the daemon cannot be started or a call fails.
pub fn run(args: &RttArgs) -> Result<(), String> {
    let kvd = kvd_beside(args.kvd.as_deref())?;
    let repeat = args.repeat.clamp(1, 20);
    let mut quiet: Vec<Vec<Run>> = vec![Vec::new(); args.spin_us.len()];
    let mut busy: Vec<Vec<Run>> = vec![Vec::new(); args.spin_us.len()];
    for round in 0..repeat {
        for (i, &spin) in args.spin_us.iter().enumerate() {
            eprintln!(
                "kvd-bench rtt: round {}/{repeat}, spin {spin} µs, quiet...",
                round + 1
            );
            quiet[i].push(one_run(
                &kvd,
                spin,
                args.daemon_spin_us.unwrap_or(spin),
                args.iters,
                false,
            )?);
            eprintln!(
                "kvd-bench rtt: round {}/{repeat}, spin {spin} µs, CPUs busy...",
                round + 1
            );
            busy[i].push(one_run(
                &kvd,
                spin,
                args.daemon_spin_us.unwrap_or(spin),
                args.iters,
                true,
            )?);
        }
    }
    print_table(args, &quiet, &busy);
    Ok(())
}

fn print_table(args: &RttArgs, quiet: &[Vec<Run>], busy: &[Vec<Run>]) {
    let med = |runs: &[Run], f: fn(&Run) -> f64| {
        let v: Vec<f64> = runs.iter().map(f).collect();
        let p = Point::of_runs(0.0, &v);
        if runs.len() > 1 {
            format!("{} ({}..{})", fmt_num(p.y), fmt_num(p.lo), fmt_num(p.hi))
        } else {
            fmt_num(p.y)
        }
    };
    println!(
        "\nmetadata round trip over the local socket (µs; medians of the runs, min..max); spin µs is the client's, the daemon's is {}\n",
        args.daemon_spin_us
            .map_or("the same".to_string(), |d| format!("{d} µs"))
    );
    println!(
        "| spin µs | CPUs | heartbeat p50 | p99 | exists 1 p50 | exists 128 p50 | p99 | µs per key | daemon CPU µs/call | client CPU µs/call | daemon CPU idle ms/s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for (i, spin) in args.spin_us.iter().enumerate() {
        for (state, runs) in [("quiet", &quiet[i]), ("busy", &busy[i])] {
            println!(
                "| {spin} | {state} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                med(runs, |r| r.heartbeat.0),
                med(runs, |r| r.heartbeat.1),
                med(runs, |r| r.exists1.0),
                med(runs, |r| r.exists128.0),
                med(runs, |r| r.exists128.1),
                med(runs, |r| (r.exists128.0 - r.exists1.0) / 127.0),
                med(runs, |r| r.daemon_cpu_us_per_call),
                med(runs, |r| r.client_cpu_us_per_call),
                med(runs, |r| r.daemon_idle_cpu_ms),
            );
        }
    }
    for (i, spin) in args.spin_us.iter().enumerate() {
        let q: Vec<f64> = quiet[i].iter().map(|r| r.heartbeat.0).collect();
        let b: Vec<f64> = busy[i].iter().map(|r| r.heartbeat.0).collect();
        let (q, b) = (Point::of_runs(0.0, &q).y, Point::of_runs(0.0, &b).y);
        println!(
            "spin {spin} µs: quiet heartbeat p50 is {:.2}x the busy one (target: within 2x)",
            q / b
        );
    }
}

/// Start a daemon with this budget, measure the calls (with the CPUs busy or not), stop it.
fn one_run(
    kvd: &std::path::Path,
    spin: u32,
    daemon_spin: u32,
    iters: usize,
    busy: bool,
) -> Result<Run, String> {
    let d = ChildDaemon::start_with(
        kvd,
        4096,
        1024,
        &["--spin-us".into(), daemon_spin.to_string()],
    )?;
    let pid = d.pid().ok_or("the daemon has no process")?;
    let opts = ClientOptions {
        lease_ttl_ms: 60_000,
        spin_us: spin,
        ..ClientOptions::named("kvd-bench-rtt")
    };
    let mut c = Client::connect(&d.socket, &opts).map_err(|e| e.to_string())?;
    let ns = c
        .register_namespace(&descriptor(4096))
        .map_err(|e| e.to_string())?;
    let mut keys = Keys::new(ns);
    let one: Vec<BlockKey> = keys.take(1);
    let many: Vec<BlockKey> = keys.take(128);
    let burners = busy.then(Burners::start);
    let (d0, c0) = (daemon_cpu_ns(pid), thread_cpu_ns());
    let mut calls = 0usize;
    let mut counted = |f: &mut dyn FnMut() -> Result<(), String>| {
        calls += 1;
        f()
    };
    let heartbeat = latency(iters, || {
        counted(&mut || c.heartbeat().map(|_| ()).map_err(|e| e.to_string()))
    })?;
    let exists1 = latency(iters, || {
        counted(&mut || c.exists(&one).map(|_| ()).map_err(|e| e.to_string()))
    })?;
    let exists128 = latency(iters, || {
        counted(&mut || c.exists(&many).map(|_| ()).map_err(|e| e.to_string()))
    })?;
    let (d1, c1) = (daemon_cpu_ns(pid), thread_cpu_ns());
    drop(burners);
    // one idle second: what the daemon spends while nobody calls
    std::thread::sleep(Duration::from_millis(1000));
    let d2 = daemon_cpu_ns(pid);
    c.close().map_err(|e| e.to_string())?;
    d.stop();
    let per_call = |a: u64, b: u64| (b.saturating_sub(a)) as f64 / 1e3 / calls.max(1) as f64;
    Ok(Run {
        heartbeat,
        exists1,
        exists128,
        daemon_cpu_us_per_call: per_call(d0, d1),
        client_cpu_us_per_call: per_call(c0, c1),
        daemon_idle_cpu_ms: d2.saturating_sub(d1) as f64 / 1e6,
    })
}

/// The first field of a schedstat file: nanoseconds on a CPU.
fn schedstat_ns(path: &std::path::Path) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// CPU time of all the daemon's threads, ns.
fn daemon_cpu_ns(pid: u32) -> u64 {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    dir.flatten()
        .take(4096)
        .map(|t| schedstat_ns(&t.path().join("schedstat")))
        .sum()
}

/// CPU time of the calling thread, ns.
fn thread_cpu_ns() -> u64 {
    schedstat_ns(std::path::Path::new("/proc/thread-self/schedstat"))
}

/// One niced spinning thread per CPU, so that no CPU goes idle while they run (the machine
/// "under load" without taking CPU from the daemon: nice 19 against 0 gets ~1.5 % of a CPU
/// that both want).
struct Burners {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Burners {
    fn start() -> Burners {
        let stop = Arc::new(AtomicBool::new(false));
        let n = std::thread::available_parallelism()
            .map_or(2, usize::from)
            .min(64);
        let deadline = Instant::now() + Duration::from_secs(60);
        let threads = (0..n)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    // SAFETY: gettid and setpriority on this thread's own id touch no memory of
                    // ours.
                    unsafe {
                        libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 19);
                    }
                    let mut x = 0u64;
                    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                        for _ in 0..1000 {
                            x = std::hint::black_box(
                                x.wrapping_mul(6364136223846793005).wrapping_add(1),
                            );
                        }
                    }
                })
            })
            .collect();
        Burners { stop, threads }
    }
}

impl Drop for Burners {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
