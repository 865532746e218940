//! `kvd-bench local --clients N[,N...]`: N client processes putting and getting at once through
//! one daemon, as an engine's tensor-parallel ranks do.
//!
//! For each N: first the bound, N threads each copying its own buffers with the same
//! non-temporal copy the client uses, timed together (aggregate GB/s); then N worker processes
//! (this binary, `kvd-bench local-worker`), started together at one instant, each looping for the
//! case's time budget over: `alloc(B)` → B copies fused with CRC-32C → `seal(B)` →
//! `publish(B)`, then `acquire(B)` of the batch it wrote one iteration earlier → B verified
//! copies out → `release(B)`. Bytes moved (in and out) and round trips are summed over the
//! workers and divided by the longest worker's time. The daemon serializes the clients if the
//! aggregate stays at one client's rate while the bound grows with N.
//!
//! Each count runs `--client-runs` times (the bound re-measured before each run); the table
//! gives medians, and `--plot DIR` draws the curve (`clients.svg`, `clients.md`): the bound,
//! the crc-off puts' copies into the pool and the gets' copies out of it (each timed alone
//! inside the workers), and put+get with checksums off and on.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvd::keys::BlockKey;

use crate::local::{
    ChildDaemon, Crc, Keys, LocalArgs, buffers, connect, descriptor, get_batch, put_batch, touch,
};

/// Buffers each worker (and each bound thread) copies from and into, at least: larger than any
/// cache the host may have behind the VM's reported 32 MiB L3, so every copy goes to memory.
const WORKER_SET_BYTES: usize = 256 << 20;
/// Blocks per batch in the multi-client case.
const BATCH: usize = 32;

/// `kvd-bench local-worker` arguments (started by `--clients`; not for hand use).
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerArgs {
    /// The daemon's socket.
    #[arg(long)]
    pub socket: PathBuf,
    /// Start at this instant (ms since the Unix epoch), so that all workers run together.
    #[arg(long)]
    pub start_at_ms: u64,
    /// Seconds to run.
    #[arg(long)]
    pub seconds: f64,
    /// Checksum in the copies (CRC-32C fused with the copy in, verified in the copy out);
    /// without it, the seal carries each source buffer's CRC computed before timing.
    #[arg(long)]
    pub checksums: bool,
}

/// One count's runs.
#[derive(Debug, Default)]
struct Row {
    n: usize,
    bound: Vec<f64>,
    gbps: Vec<f64>,
    ops: Vec<f64>,
    copy_in: Vec<f64>,
    copy_out: Vec<f64>,
    /// Share of the crc-off workers' time spent outside their copies (the calls, the loop).
    calls: Vec<f64>,
    crc_gbps: Vec<f64>,
    crc_ops: Vec<f64>,
}

/// One worker's totals.
#[derive(Debug, Default, Clone, Copy)]
struct Totals {
    round_trips: u64,
    secs: f64,
    /// Bytes the puts copied into the pool, and the time those copies took (summed over the
    /// workers).
    put_bytes: u64,
    put_copy_secs: f64,
    /// The same for the gets' copies out of the pool.
    get_bytes: u64,
    get_copy_secs: f64,
    /// Every worker's whole time, summed (`secs` is the longest one's).
    worker_secs: f64,
}

impl Totals {
    /// Bytes moved, in and out.
    fn bytes(&self) -> u64 {
        self.put_bytes + self.get_bytes
    }
}

fn median(v: &[f64]) -> f64 {
    crate::curve::Point::of_runs(0.0, v).y
}

/// Run the multi-client cases and print their table (and, with `--plot`, draw the curve).
pub fn run(args: &LocalArgs, kvd: &Path, counts: &[usize]) -> Result<(), String> {
    let page = (args
        .page_kib
        .iter()
        .copied()
        .find(|&k| k == 2560)
        .unwrap_or(args.page_kib[0])
        << 10) as usize;
    let max_n = counts.iter().copied().max().unwrap_or(1);
    // Two batches in flight per worker, plus room for eviction to work.
    let pages = (max_n * BATCH * 4).max(crate::local::pool_pages(page));
    let d = ChildDaemon::start_with(kvd, page, pages, &args.daemon_flags())?;
    let budget = args.seconds_per_case.max(1.0);
    let runs = args.client_runs.clamp(1, 20);
    let mut rows = Vec::new();
    for &n in counts {
        let mut row = Row {
            n,
            ..Row::default()
        };
        for r in 0..runs {
            eprintln!(
                "{n} client(s), run {} of {runs}: measuring {n} parallel copies...",
                r + 1
            );
            let bound = parallel_copy_bound(n, page);
            row.bound.push(bound);
            for checksums in [false, true] {
                eprintln!(
                    "  bound: {bound:.2} GB/s; {n} worker process(es), checksums {}, {budget:.1} s...",
                    if checksums { "on" } else { "off" }
                );
                let t = run_workers(&d.socket, n, budget, checksums)?;
                let gbps = t.bytes() as f64 / t.secs / 1e9;
                let ops = t.round_trips as f64 / t.secs;
                eprintln!(
                    "  {gbps:.2} GB/s ({:.2} of the bound), {ops:.0} round trips/s",
                    gbps / bound
                );
                if checksums {
                    row.crc_gbps.push(gbps);
                    row.crc_ops.push(ops);
                } else {
                    row.gbps.push(gbps);
                    row.ops.push(ops);
                    // each worker's copies ran side by side: the aggregate rate of the copies
                    // into the pool is n times one worker's average
                    row.copy_in
                        .push(t.put_bytes as f64 / (t.put_copy_secs / n as f64) / 1e9);
                    row.copy_out
                        .push(t.get_bytes as f64 / (t.get_copy_secs / n as f64) / 1e9);
                    row.calls
                        .push(1.0 - (t.put_copy_secs + t.get_copy_secs) / t.worker_secs);
                }
            }
        }
        rows.push(row);
    }
    d.stop();
    print_table(page, runs, &rows);
    let series = |name: &str, f: &dyn Fn(&Row) -> &Vec<f64>| crate::curve::Series {
        name: name.into(),
        points: rows
            .iter()
            .map(|r| crate::curve::Point::of_runs(r.n as f64, f(r)))
            .collect(),
    };
    crate::curve::Curve {
        title: format!(
            "kvd-bench local --clients: {} pages, batch {BATCH}, put+get",
            crate::local::human(page)
        ),
        x_label: "clients".into(),
        y_label: "GB/s".into(),
        log_x: false,
        log_y: false,
        series: vec![
            series("bound (N parallel copies)", &|r| &r.bound),
            series("copies into the pool (crc off)", &|r| &r.copy_in),
            series("copies out of the pool (crc off)", &|r| &r.copy_out),
            series("put+get, crc off", &|r| &r.gbps),
            series("put+get, crc on", &|r| &r.crc_gbps),
        ],
    }
    .emit(args.plot.as_deref(), "clients")
}

fn print_table(page: usize, runs: usize, rows: &[Row]) {
    println!();
    println!(
        "kvd-bench local --clients — {} pages, batch {BATCH}, put+get per iteration, median of {runs}",
        crate::local::human(page)
    );
    println!(
        "{:>7} {:>8} {:>8} {:>6} {:>8} {:>6} {:>8} {:>6} {:>6} {:>8} {:>8} {:>6} {:>8}",
        "clients",
        "bound",
        "crc off",
        "ratio",
        "copy in",
        "ratio",
        "copy out",
        "ratio",
        "calls",
        "ops/s",
        "crc on",
        "ratio",
        "ops/s"
    );
    println!("{}", "-".repeat(107));
    for r in rows {
        let b = median(&r.bound);
        let (off, cin, on) = (median(&r.gbps), median(&r.copy_in), median(&r.crc_gbps));
        let cout = median(&r.copy_out);
        println!(
            "{:>7} {:>8.2} {:>8.2} {:>6.2} {:>8.2} {:>6.2} {:>8.2} {:>6.2} {:>5.1}% {:>8.0} {:>8.2} {:>6.2} {:>8.0}",
            r.n,
            b,
            off,
            off / b,
            cin,
            cin / b,
            cout,
            cout / b,
            median(&r.calls) * 100.0,
            median(&r.ops),
            on,
            on / b,
            median(&r.crc_ops)
        );
    }
    println!("GB/s. bound: N threads of the same non-temporal copy, each on its own buffers,");
    println!("timed together (best of 3), before each run. crc off: plain copies (the seal");
    println!("carries a CRC computed before timing); crc on: CRC-32C fused with the copy in,");
    println!("verified in the copy out. copy in / copy out: the crc-off puts' copies into the");
    println!("pool and the gets' copies out of it, each timed alone; calls: the share of the");
    println!("crc-off workers' time outside those copies (round trips, the loop). ops/s:");
    println!("metadata round trips (alloc, seal, publish, acquire, release) per second.");
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if rows.iter().any(|r| r.n > cpus) {
        println!("With more workers than this machine's {cpus} CPUs, a worker's copies are timed");
        println!("while others wait for a CPU, so copy in / copy out (per-worker rates summed)");
        println!("overstate those rows; read put+get there.");
    }
}

/// How long one trial of the bound copies, so that it sees the same background load as the
/// workers' runs do (a few milliseconds of copying would catch only a moment of it).
const BOUND_TRIAL: Duration = Duration::from_millis(1_000);

/// N threads, each copying its own buffers block by block for [`BOUND_TRIAL`], started
/// together: aggregate GB/s, best of 3.
fn parallel_copy_bound(n: usize, page: usize) -> f64 {
    let per = WORKER_SET_BYTES.div_ceil(page) * page;
    let mut sets: Vec<(Vec<u8>, Vec<u8>)> = (0..n)
        .map(|_| {
            let (mut a, mut b) = (vec![0u8; per], vec![0u8; per]);
            touch(&mut a);
            touch(&mut b);
            (a, b)
        })
        .collect();
    let mut best = 0.0f64;
    for _ in 0..3 {
        let barrier = std::sync::Barrier::new(n);
        let t0 = Instant::now();
        let moved: u64 = std::thread::scope(|s| {
            let threads: Vec<_> = sets
                .iter_mut()
                .map(|(a, b)| {
                    let barrier = &barrier;
                    s.spawn(move || {
                        barrier.wait();
                        let start = Instant::now();
                        let mut moved = 0u64;
                        // Bounded by time, and by a pass count.
                        for _ in 0..100_000 {
                            if start.elapsed() >= BOUND_TRIAL {
                                break;
                            }
                            for (src, dst) in a.chunks(page).zip(b.chunks_mut(page)) {
                                transport::local::copy(dst, src);
                            }
                            std::hint::black_box(&b[per / 2]);
                            moved += per as u64;
                        }
                        moved
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|t| t.join().expect("a copy thread"))
                .sum()
        });
        let secs = t0.elapsed().as_secs_f64();
        best = best.max(moved as f64 / secs / 1e9);
    }
    best
}

fn run_workers(socket: &Path, n: usize, seconds: f64, checksums: bool) -> Result<Totals, String> {
    let me = std::env::current_exe().map_err(|e| e.to_string())?;
    // Far enough ahead for every worker to connect and prepare its buffers.
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_err(|e| e.to_string())?
        .as_millis() as u64;
    let start_at = now_ms + 3_000 + 800 * n as u64;
    let mut children = Vec::new();
    for _ in 0..n {
        let mut cmd = Command::new(&me);
        cmd.arg("local-worker");
        if checksums {
            cmd.arg("--checksums");
        }
        let child = cmd
            .arg("--socket")
            .arg(socket)
            .args(["--start-at-ms", &start_at.to_string()])
            .args(["--seconds", &seconds.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("starting a worker: {e}"))?;
        children.push(child);
    }
    let mut total = Totals::default();
    for mut c in children {
        let out = c.stdout.take().expect("piped");
        let line = BufReader::new(out)
            .lines()
            .map_while(Result::ok)
            .find(|l| l.starts_with("RESULT"));
        let status = c.wait().map_err(|e| e.to_string())?;
        let line = line.ok_or_else(|| format!("a worker reported nothing ({status})"))?;
        let field = |k: &str| -> Result<f64, String> {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(k))
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| format!("no {k} in {line:?}"))
        };
        total.round_trips += field("round_trips=")? as u64;
        let secs = field("secs=")?;
        total.secs = total.secs.max(secs);
        total.worker_secs += secs;
        total.put_bytes += field("put_bytes=")? as u64;
        total.put_copy_secs += field("put_copy_secs=")?;
        total.get_bytes += field("get_bytes=")? as u64;
        total.get_copy_secs += field("get_copy_secs=")?;
    }
    Ok(total)
}

/// The worker: put and get in a loop until the budget, then print `RESULT ...`.
pub fn worker(args: &WorkerArgs) -> Result<(), String> {
    let mut c = connect(&args.socket)?;
    let page = c.page_size() as usize;
    let ns = c
        .register_namespace(&descriptor(page))
        .map_err(|e| e.to_string())?;
    let mut keys = Keys::new(ns);
    let src = buffers(page, BATCH, 1, WORKER_SET_BYTES);
    let src_crc: Vec<u32> = src.iter().map(|b| transport::local::crc32c(0, b)).collect();
    let mut dst = buffers(page, BATCH, 2, WORKER_SET_BYTES);
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_err(|e| e.to_string())?
        .as_millis() as u64;
    std::thread::sleep(Duration::from_millis(
        args.start_at_ms.saturating_sub(now_ms),
    ));
    let budget = Duration::from_secs_f64(args.seconds);
    let t0 = Instant::now();
    let mut t = Totals::default();
    let mut previous: Vec<BlockKey> = Vec::new();
    let mut rot = 0usize;
    // Bounded by time and by a cap on iterations.
    for _ in 0..1_000_000 {
        if t0.elapsed() >= budget {
            break;
        }
        let k = keys.take(BATCH);
        let mode = if args.checksums {
            Crc::Client
        } else {
            Crc::Off
        };
        let copying =
            put_batch(&mut c, &k, &src, &src_crc, rot, mode).map_err(|e| e.to_string())?;
        t.put_copy_secs += copying.as_secs_f64();
        t.put_bytes += (k.len() * page) as u64;
        t.round_trips += 3;
        if !previous.is_empty() {
            let mut at = rot;
            let (bytes, copying) =
                get_batch(&mut c, &previous, &mut dst, &mut at, args.checksums, true)
                    .map_err(|e| e.to_string())?;
            t.get_bytes += bytes;
            t.get_copy_secs += copying.as_secs_f64();
            t.round_trips += 2;
        }
        previous = k;
        rot = (rot + BATCH) % src.len();
    }
    t.secs = t0.elapsed().as_secs_f64();
    c.close().map_err(|e| e.to_string())?;
    println!(
        "RESULT round_trips={} secs={:.6} put_bytes={} put_copy_secs={:.6} get_bytes={} \
         get_copy_secs={:.6}",
        t.round_trips, t.secs, t.put_bytes, t.put_copy_secs, t.get_bytes, t.get_copy_secs
    );
    Ok(())
}
