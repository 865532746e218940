//! `kvd-bench plan`: the control shim's recovery-planning time against the number of workers
//! and of requests in flight.
//!
//! For each point (W workers of `--workers`, R requests of `--requests`), a
//! [`Controller`] (policy Lumen, the default configuration) is loaded as
//! `benches/benches/control.rs` loads it (not timed): W workers, then R requests admitted
//! round-robin over the servers, each taken through prefill and decoding and, when it got a
//! holder, given a stored checkpoint. Workers get 16 TiB of checkpoint capacity each, so every
//! request finds a holder even at 8 workers × 100,000 requests (capacity only filters holders,
//! it does not enter the placement score; the count of requests without one is printed).
//!
//! Then, `--runs` times (default 5), a fresh copy of that controller is restored from its
//! snapshot (not timed) and [`Controller::fail_workers`] is timed with [`Instant`], for:
//!
//! - **one failed worker** (worker 5 mod W): the main curve;
//! - **W/8 failed at once** (at least 2; spread evenly, from worker 5): a second curve.
//!
//! The time is the whole failure event: finding the affected requests, dispatching and
//! rebalancing them, a restore plan per interrupted request, and new holders for the requests
//! whose holder died. A point is the median of the runs with their min and max.
//!
//! Building a point is bounded by `--build-seconds` (default 60): past it the point is skipped
//! with a message. Every loop is bounded in count and time.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvd::control::{Controller, ControllerSnapshot, PolicyKind};

use crate::control_load::loaded;
use crate::curve::{Curve, Point, Series, fmt_num};

/// `kvd-bench plan` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct PlanArgs {
    /// Write the plot (SVG) and table (Markdown) into this directory.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Worker counts, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = vec![8u32, 16, 32, 64, 128, 256])]
    pub workers: Vec<u32>,
    /// Requests in flight, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1_000u64, 10_000, 100_000])]
    pub requests: Vec<u64>,
    /// Timed plans per point and failure size (a fresh controller each).
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Skip a point whose loaded controller takes longer than this to build, seconds.
    #[arg(long, default_value_t = 60.0)]
    pub build_seconds: f64,
}

/// Checkpoint capacity per worker: enough that no request goes without a holder.
const CAPACITY: u64 = 1 << 44;
/// The target for one worker's failure at 64 workers and 10,000 requests.
const TARGET_MS: f64 = 10.0;

/// One measured point.
#[derive(Debug, Clone)]
struct Measured {
    workers: u32,
    requests: u64,
    /// Planning times for one failed worker, ms.
    one: Vec<f64>,
    /// Planning times for W/8 failed at once, ms.
    eighth: Vec<f64>,
}

/// Run the benchmark.
///
/// # Errors
/// A bad flag, a controller call failing, or an unwritable plot.
pub fn run(args: &PlanArgs) -> Result<(), String> {
    if args.workers.is_empty() || args.requests.is_empty() || args.runs == 0 {
        return Err("--workers, --requests and --runs need values above 0".into());
    }
    if let Some(w) = args.workers.iter().find(|&&w| w < 4) {
        return Err(format!(
            "--workers {w}: at least 4 workers (some must survive)"
        ));
    }
    if cfg!(debug_assertions) {
        eprintln!("kvd-bench plan: warning: a debug build; build with --release for real figures");
    }
    let limit = Duration::from_secs_f64(args.build_seconds);
    let mut measured = Vec::new();
    let mut skipped = Vec::new();
    for &requests in &args.requests {
        for &workers in &args.workers {
            match point(workers, requests, args.runs, limit)? {
                Some(m) => measured.push(m),
                None => skipped.push((workers, requests)),
            }
        }
    }
    emit(args, &measured)?;
    summary(&measured, &skipped);
    Ok(())
}

/// Build, snapshot, then time the plans of one point; `None` when the build ran past `limit`.
fn point(
    workers: u32,
    requests: u64,
    runs: usize,
    limit: Duration,
) -> Result<Option<Measured>, String> {
    let t0 = Instant::now();
    let Some(c) = loaded(PolicyKind::Lumen, workers, requests, CAPACITY, limit)? else {
        eprintln!(
            "kvd-bench plan: {workers} workers x {requests} requests: building took over {} s; \
             skipped (raise --build-seconds)",
            fmt_num(limit.as_secs_f64())
        );
        return Ok(None);
    };
    let no_holder = c.stats().no_holder;
    let snap = c.snapshot();
    drop(c);
    let built = t0.elapsed();
    let victims_one = vec![5 % workers];
    let k = (workers / 8).max(2);
    let victims_eighth: Vec<u32> = (0..k).map(|i| (5 + i * (workers / k)) % workers).collect();
    let now = requests / 10 + 1_000;
    let mut one = Vec::with_capacity(runs);
    let mut eighth = Vec::with_capacity(runs);
    let mut restores = (0, 0);
    for _ in 0..runs {
        let (ms, n) = timed_plan(&snap, &victims_one, now)?;
        one.push(ms);
        let (ms8, n8) = timed_plan(&snap, &victims_eighth, now)?;
        eighth.push(ms8);
        restores = (n, n8);
    }
    eprintln!(
        "kvd-bench plan: {workers} workers x {requests} requests (built in {:.2} s, {no_holder} \
         without a holder): 1 failed: {:.3} ms median ({} restores); {k} failed: {:.3} ms median \
         ({} restores)",
        built.as_secs_f64(),
        Point::of_runs(0.0, &one).y,
        restores.0,
        Point::of_runs(0.0, &eighth).y,
        restores.1
    );
    Ok(Some(Measured {
        workers,
        requests,
        one,
        eighth,
    }))
}

/// A fresh controller from `snap` (not timed), then one timed `fail_workers`: the time in ms
/// and the number of restores planned.
fn timed_plan(
    snap: &ControllerSnapshot,
    victims: &[u32],
    now: u64,
) -> Result<(f64, usize), String> {
    let mut c =
        Controller::from_snapshot(snap.clone()).map_err(|e| format!("from_snapshot: {e}"))?;
    let t = Instant::now();
    let plan = c.fail_workers(victims, now);
    let dt = t.elapsed();
    let plan = plan.map_err(|e| format!("fail_workers({victims:?}): {e}"))?;
    if plan.failed_workers.len() != victims.len() {
        return Err(format!(
            "fail_workers({victims:?}) failed {:?}",
            plan.failed_workers
        ));
    }
    let restores = plan.restores.len();
    // Dropping the plan and the controller is not part of planning.
    drop(std::hint::black_box(plan));
    Ok((dt.as_secs_f64() * 1e3, restores))
}

/// One series per request count: the medians over the runs of `f`'s times, against workers.
fn series_by_requests(
    measured: &[Measured],
    requests: &[u64],
    f: impl Fn(&Measured) -> &[f64],
) -> Vec<Series> {
    requests
        .iter()
        .map(|&r| Series {
            name: format!("{} requests", fmt_num(r as f64)),
            points: measured
                .iter()
                .filter(|m| m.requests == r)
                .map(|m| Point::of_runs(f64::from(m.workers), f(m)))
                .collect(),
        })
        .collect()
}

fn emit(args: &PlanArgs, measured: &[Measured]) -> Result<(), String> {
    let one = Curve {
        title: format!(
            "recovery planning time vs workers, one worker failing (median of {} runs)",
            args.runs
        ),
        x_label: "workers".into(),
        y_label: "ms".into(),
        log_x: true,
        log_y: true,
        series: series_by_requests(measured, &args.requests, |m| &m.one),
    };
    one.emit(args.plot.as_deref(), "plan")?;
    let eighth = Curve {
        title: format!(
            "recovery planning time vs workers, an eighth of them (at least 2) failing at once \
             (median of {} runs)",
            args.runs
        ),
        x_label: "workers".into(),
        y_label: "ms".into(),
        log_x: true,
        log_y: true,
        series: series_by_requests(measured, &args.requests, |m| &m.eighth),
    };
    eighth.emit(args.plot.as_deref(), "plan-eighth")
}

fn summary(measured: &[Measured], skipped: &[(u32, u64)]) {
    println!();
    match measured
        .iter()
        .find(|m| m.workers == 64 && m.requests == 10_000)
    {
        Some(m) => {
            let p = Point::of_runs(64.0, &m.one);
            let verdict = if p.hi < TARGET_MS {
                "under"
            } else if p.y < TARGET_MS {
                "median under, but not every run,"
            } else {
                "OVER"
            };
            println!(
                "64 workers x 10,000 requests, one worker failing: {} ms median ({}..{} over {} \
                 runs), {verdict} the {TARGET_MS} ms target ({:.0}x headroom)",
                fmt_num(p.y),
                fmt_num(p.lo),
                fmt_num(p.hi),
                m.one.len(),
                TARGET_MS / p.y
            );
        }
        None => println!(
            "64 workers x 10,000 requests was not measured (not in --workers / --requests, or \
             skipped): no figure against the {TARGET_MS} ms target"
        ),
    }
    for (w, r) in skipped {
        println!(
            "skipped: {w} workers x {} requests (the build ran past --build-seconds)",
            fmt_num(*r as f64)
        );
    }
}
