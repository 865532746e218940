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
//! - with each `--cpu-wake-us` (the daemon's `--cpu-wake-latency-us`: a PM QoS request held
//!   while clients call, which keeps idle CPUs from sleeping deeper than that), the time the
//!   CPUs spent polling in the idle governor instead of sleeping, during the calls and in the
//!   idle second: that strategy's cost, which no process's CPU time shows.
//!
//! Each case is `--repeat` runs, alternating the cases, medians with their spread.

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
    /// The daemon's `--cpu-wake-latency-us` to compare ("off", or µs; each is crossed with
    /// every spin budget). Anything but "off" needs write access to /dev/cpu_dma_latency
    /// (root); pass `--cpu-wake-us off` where there is none.
    #[arg(long, value_delimiter = ',', default_values_t = vec!["off".to_string(), "0".to_string()])]
    pub cpu_wake_us: Vec<String>,
    /// Calls per measurement (each also bounded to 3 s).
    #[arg(long, default_value_t = 5000)]
    pub iters: usize,
    /// Runs per case, alternating the cases.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
}

/// One run's figures for one case and one machine state.
#[derive(Debug, Clone, Copy, Default)]
struct Run {
    heartbeat: (f64, f64),
    exists1: (f64, f64),
    exists128: (f64, f64),
    daemon_cpu_us_per_call: f64,
    client_cpu_us_per_call: f64,
    daemon_idle_cpu_ms: f64,
    /// ms per second that the CPUs (all together) sat in the idle governor's polling state
    /// during the calls and during the idle second after them.
    poll_ms_calls: f64,
    poll_ms_idle: f64,
}

/// One figure of a run.
type Field = fn(&Run) -> f64;

/// A case: the client's spin, the daemon's spin and the daemon's wake-latency request.
#[derive(Debug, Clone, Copy)]
struct Case {
    spin: u32,
    daemon_spin: u32,
    wake: Option<u32>,
}

impl Case {
    fn wake_label(&self) -> String {
        self.wake.map_or("off".into(), |w| w.to_string())
    }
}

/// Run the benchmark.
///
/// # Errors
/// When the daemon cannot be started or a call fails.
pub fn run(args: &RttArgs) -> Result<(), String> {
    let kvd = kvd_beside(args.kvd.as_deref())?;
    let repeat = args.repeat.clamp(1, 20);
    let mut wakes = Vec::new();
    for w in &args.cpu_wake_us {
        wakes.push(match w.as_str() {
            "off" => None,
            n => Some(
                n.parse::<u32>()
                    .map_err(|_| format!("--cpu-wake-us takes \"off\" or whole µs, not {n:?}"))?,
            ),
        });
    }
    let cases: Vec<Case> = wakes
        .iter()
        .flat_map(|&wake| {
            args.spin_us.iter().map(move |&spin| Case {
                spin,
                daemon_spin: args.daemon_spin_us.unwrap_or(spin),
                wake,
            })
        })
        .take(64)
        .collect();
    let mut quiet: Vec<Vec<Run>> = vec![Vec::new(); cases.len()];
    let mut busy: Vec<Vec<Run>> = vec![Vec::new(); cases.len()];
    for round in 0..repeat {
        for (i, case) in cases.iter().enumerate() {
            for (state, out) in [("quiet", &mut quiet), ("CPUs busy", &mut busy)] {
                eprintln!(
                    "kvd-bench rtt: round {}/{repeat}, spin {} µs, wake latency {}, {state}...",
                    round + 1,
                    case.spin,
                    case.wake_label()
                );
                out[i].push(one_run(&kvd, case, args.iters, state != "quiet")?);
            }
        }
    }
    print_table(args, &cases, &quiet, &busy);
    Ok(())
}

fn print_table(args: &RttArgs, cases: &[Case], quiet: &[Vec<Run>], busy: &[Vec<Run>]) {
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
        "\nmetadata round trip over the local socket (µs; medians of the runs, min..max); spin µs is the client's, the daemon's is {}; wake µs is the daemon's --cpu-wake-latency-us\n",
        args.daemon_spin_us
            .map_or("the same".to_string(), |d| format!("{d} µs"))
    );
    println!(
        "| spin µs | wake µs | CPUs | heartbeat p50 | p99 | exists 1 p50 | exists 128 p50 | p99 | µs per key | daemon CPU µs/call | client CPU µs/call | daemon CPU idle ms/s | CPUs polling ms/s, calls | CPUs polling ms/s, idle |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (i, case) in cases.iter().enumerate() {
        for (state, runs) in [("quiet", &quiet[i]), ("busy", &busy[i])] {
            println!(
                "| {} | {} | {state} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                case.spin,
                case.wake_label(),
                med(runs, |r| r.heartbeat.0),
                med(runs, |r| r.heartbeat.1),
                med(runs, |r| r.exists1.0),
                med(runs, |r| r.exists128.0),
                med(runs, |r| r.exists128.1),
                med(runs, |r| (r.exists128.0 - r.exists1.0) / 127.0),
                med(runs, |r| r.daemon_cpu_us_per_call),
                med(runs, |r| r.client_cpu_us_per_call),
                med(runs, |r| r.daemon_idle_cpu_ms),
                med(runs, |r| r.poll_ms_calls),
                med(runs, |r| r.poll_ms_idle),
            );
        }
    }
    println!(
        "\n(CPUs polling: time the idle CPUs spent in the idle governor's polling state rather than \
         asleep, summed over the CPUs, from /sys/devices/system/cpu/cpu*/cpuidle; a polling \
         vCPU is busy to its host.)"
    );
    for (i, case) in cases.iter().enumerate() {
        let p50 = |runs: &[Run], f: fn(&Run) -> f64| {
            let v: Vec<f64> = runs.iter().map(f).collect();
            Point::of_runs(0.0, &v).y
        };
        let calls: [(&str, Field); 3] = [
            ("heartbeat", |r| r.heartbeat.0),
            ("exists 1", |r| r.exists1.0),
            ("exists 128", |r| r.exists128.0),
        ];
        let (worst, ratio) = calls
            .iter()
            .map(|(name, f)| (*name, p50(&quiet[i], *f) / p50(&busy[i], *f)))
            .fold(("", 0.0f64), |a, b| if b.1 > a.1 { b } else { a });
        println!(
            "spin {} µs, wake latency {}: the worst quiet p50 against the busy one is {worst}'s, \
             {ratio:.2}x (target: within 2x)",
            case.spin,
            case.wake_label()
        );
    }
}

/// Start a daemon for this case, measure the calls (with the CPUs busy or not), stop it.
fn one_run(kvd: &std::path::Path, case: &Case, iters: usize, busy: bool) -> Result<Run, String> {
    let mut flags = vec!["--spin-us".to_string(), case.daemon_spin.to_string()];
    if let Some(w) = case.wake {
        flags.extend(["--cpu-wake-latency-us".to_string(), w.to_string()]);
    }
    let d = ChildDaemon::start_with(kvd, 4096, 1024, &flags).map_err(|e| {
        if case.wake.is_some() {
            format!("{e} (a wake-latency case needs root for /dev/cpu_dma_latency; pass --cpu-wake-us off)")
        } else {
            e
        }
    })?;
    let pid = d.pid().ok_or("the daemon has no process")?;
    let opts = ClientOptions {
        lease_ttl_ms: 60_000,
        spin_us: case.spin,
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
    let (d0, c0, p0, t0) = (
        daemon_cpu_ns(pid),
        thread_cpu_ns(),
        poll_us(),
        Instant::now(),
    );
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
    let (d1, c1, p1, t1) = (
        daemon_cpu_ns(pid),
        thread_cpu_ns(),
        poll_us(),
        Instant::now(),
    );
    drop(burners);
    // one idle second: what the daemon, and the CPUs' idle polling, spend while nobody calls
    std::thread::sleep(Duration::from_millis(1000));
    let (d2, p2, t2) = (daemon_cpu_ns(pid), poll_us(), Instant::now());
    c.close().map_err(|e| e.to_string())?;
    d.stop();
    let per_call = |a: u64, b: u64| (b.saturating_sub(a)) as f64 / 1e3 / calls.max(1) as f64;
    let ms_per_s = |a: u64, b: u64, secs: f64| b.saturating_sub(a) as f64 / 1e3 / secs.max(1e-9);
    Ok(Run {
        heartbeat,
        exists1,
        exists128,
        daemon_cpu_us_per_call: per_call(d0, d1),
        client_cpu_us_per_call: per_call(c0, c1),
        daemon_idle_cpu_ms: d2.saturating_sub(d1) as f64 / 1e6,
        poll_ms_calls: ms_per_s(p0, p1, (t1 - t0).as_secs_f64()),
        poll_ms_idle: ms_per_s(p1, p2, (t2 - t1).as_secs_f64()),
    })
}

/// µs all CPUs have spent in the idle governor's polling state (the cpuidle state named
/// "POLL"), 0 where cpuidle is not exposed.
fn poll_us() -> u64 {
    let Ok(cpus) = std::fs::read_dir("/sys/devices/system/cpu") else {
        return 0;
    };
    let mut total = 0;
    for cpu in cpus.flatten().take(4096) {
        let Ok(states) = std::fs::read_dir(cpu.path().join("cpuidle")) else {
            continue;
        };
        for st in states.flatten().take(64) {
            let name = std::fs::read_to_string(st.path().join("name")).unwrap_or_default();
            if name.trim() == "POLL" {
                total += std::fs::read_to_string(st.path().join("time"))
                    .ok()
                    .and_then(|t| t.trim().parse::<u64>().ok())
                    .unwrap_or(0);
            }
        }
    }
    total
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
