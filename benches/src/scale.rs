//! `kvd-bench scale`: the block store's costs against the number of resident blocks.
//!
//! For each N of `--blocks` (default 10^3 to 10^6), and each of `--runs` runs (default 3), a
//! fresh in-process [`Store`] gets a pool of exactly N pages of `--page-kib` (default 4 KiB,
//! huge pages off) and is filled with N PUBLISHED cache blocks (batches of 1,024:
//! `alloc_for_write` → `seal` with a supplied checksum → `publish`). After the metadata reading
//! (below), `--warmup` untimed delete+alloc+publish cycles (default 40,000) bring the store to
//! its steady state: the store's event ring (65,536 events, allocated but not touched when the
//! store is built) has wrapped, so no timed sample pays a page fault for its first touch
//! (without it, about one publish in 50 does, which is most of a young store's p99). Then, at N
//! resident blocks, each of these is timed one operation at a time, up to `--ops` (default
//! 20,000) per operation and run, and at most `--phase-seconds` per operation:
//!
//! - **lookup**: `Store::lookup` of one resident key drawn at random (no pin; it touches the
//!   LRU, as every hit does).
//! - **alloc**: `Store::alloc_for_write` of one new key with a free page (alloc + begin_write:
//!   what makes a writable block). The free page is made, untimed, by a compare-and-delete
//!   (`lookup` + `remove_if`) of the oldest block written, so N stays resident.
//! - **publish**: `Store::publish` of that one block, SEALED untimed in between.
//! - **evict**: `Store::alloc_for_write` of one new key into the full pool: the store has no
//!   explicit evict call; an allocation that finds no free page evicts the least recently used
//!   unpinned cache block itself (`ensure_unreserved`), so this is the cost of making room,
//!   the allocation included. `evict − alloc` is the eviction's own share (printed). Each
//!   sample is sealed and published untimed so that the pool stays full.
//!
//! Each operation is timed alone with [`Instant`] (its cost is well above the timer's, which is
//! measured and printed; it is included in every sample). p50 and p99 are taken per run; a
//! point is the median of the runs' p50s (p99s) with their min and max.
//!
//! **Metadata bytes per block**: `VmRSS` (`/proc/self/status`) just before the store is built
//! and after the fill, minus the pool's bytes, divided by N. The pool is mapped populated when
//! the store is built (every page touched once), and the fill never writes a page's bytes (the
//! checksum is supplied at seal, with no data pass), so the pool contributes exactly its size
//! and the rest is the store's metadata: slot table, key index, page-generation table, LRU
//! links, event ring, session sets. The store sizes its slot table and index to the pool's page
//! count when it is built, so most of it is there before the first block; the growth during
//! the fill alone is printed beside it. Freed heap is handed back (`malloc_trim`) before each
//! baseline, so earlier runs do not hide later growth.
//!
//! Pools above `--max-pool-gib` (default 6) are refused; a fill slower than `--fill-seconds`
//! (default 120) fails the bench. Every loop is bounded in count and time.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvd::clock::MonotonicClock;
use kvd::keys::{BlockKey, BlockTag, NamespaceDescriptor, NamespaceId};
use kvd::pool::{HugePages, PoolConfig};
use kvd::store::{BlockClass, Handle, SessionId, Store, StoreConfig};

use crate::curve::{Curve, Point, Series, fmt_num};

/// `kvd-bench scale` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct ScaleArgs {
    /// Write the plot (SVG) and table (Markdown) into this directory.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Resident block counts N, comma-separated (the pool has exactly N pages).
    #[arg(long, value_delimiter = ',', default_values_t = vec![1_000u32, 10_000, 100_000, 1_000_000])]
    pub blocks: Vec<u32>,
    /// Page (block) size in KiB, a multiple of 4.
    #[arg(long, default_value_t = 4)]
    pub page_kib: u64,
    /// Operations timed per operation kind, run and N.
    #[arg(long, default_value_t = 20_000)]
    pub ops: usize,
    /// Time limit of one operation kind's sampling (and of the warm-up), seconds (fewer samples
    /// past it).
    #[arg(long, default_value_t = 5.0)]
    pub phase_seconds: f64,
    /// Untimed delete+alloc+publish cycles after the fill and before timing (2 events each):
    /// enough to wrap the store's 65,536-event ring from any N, so that no sample pays for the
    /// first touch of its pages. 0: none.
    #[arg(long, default_value_t = 40_000)]
    pub warmup: usize,
    /// Runs per N (a fresh store each).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Fail when filling one store takes longer than this, seconds.
    #[arg(long, default_value_t = 120.0)]
    pub fill_seconds: f64,
    /// Refuse a pool larger than this, GiB.
    #[arg(long, default_value_t = 6)]
    pub max_pool_gib: u64,
}

/// Blocks per call while filling.
const FILL_BATCH: u32 = 1024;
/// Bytes in a KiB.
const KIB: u64 = 1024;

/// p50 and p99 of one operation kind in one run, ns.
#[derive(Debug, Clone, Copy)]
struct Pct {
    p50: f64,
    p99: f64,
    samples: usize,
}

/// One run at one N.
#[derive(Debug, Clone, Copy)]
struct RunResult {
    lookup: Pct,
    alloc: Pct,
    publish: Pct,
    evict: Pct,
    /// (RSS after fill − RSS before the store − pool bytes) / N.
    meta_total: f64,
    /// (RSS after fill − RSS after the store was built) / N.
    meta_fill: f64,
    fill: Duration,
}

/// A store, its namespace and its session.
struct Fixture {
    st: Store,
    ns: NamespaceId,
    sid: SessionId,
}

/// Run the benchmark.
///
/// # Errors
/// A bad flag, a store call failing, a fill past its time limit, or an unwritable plot.
pub fn run(args: &ScaleArgs) -> Result<(), String> {
    check_args(args)?;
    if cfg!(debug_assertions) {
        eprintln!("kvd-bench scale: warning: a debug build; build with --release for real figures");
    }
    let timer = timer_overhead_ns();
    eprintln!("kvd-bench scale: Instant::now() pair costs {timer:.0} ns (in every sample)");
    let mut results: Vec<(u32, Vec<RunResult>)> = Vec::new();
    for &n in &args.blocks {
        let mut runs = Vec::with_capacity(args.runs);
        for r in 0..args.runs {
            let res = one_run(n, args)?;
            eprintln!(
                "kvd-bench scale: N={n} run {}/{}: fill {:.2} s, lookup p50 {:.0} ns, alloc p50 \
                 {:.0} ns, publish p50 {:.0} ns, evict p50 {:.0} ns ({} samples each), {:.0} \
                 metadata bytes/block",
                r + 1,
                args.runs,
                res.fill.as_secs_f64(),
                res.lookup.p50,
                res.alloc.p50,
                res.publish.p50,
                res.evict.p50,
                res.lookup.samples,
                res.meta_total
            );
            runs.push(res);
        }
        results.push((n, runs));
    }
    emit(args, &results)?;
    summary(&results, timer);
    Ok(())
}

fn check_args(args: &ScaleArgs) -> Result<(), String> {
    if args.page_kib == 0 || args.page_kib % 4 != 0 {
        return Err(format!(
            "--page-kib {} must be a multiple of 4",
            args.page_kib
        ));
    }
    if args.blocks.is_empty() || args.blocks.contains(&0) {
        return Err("--blocks needs one or more counts above 0".into());
    }
    if args.runs == 0 || args.ops == 0 {
        return Err("--runs and --ops must be above 0".into());
    }
    let biggest = u64::from(*args.blocks.iter().max().unwrap_or(&1)) * args.page_kib * KIB;
    if biggest > args.max_pool_gib << 30 {
        return Err(format!(
            "a pool of {:.1} GiB is over --max-pool-gib {}; lower --blocks or --page-kib",
            biggest as f64 / (1u64 << 30) as f64,
            args.max_pool_gib
        ));
    }
    Ok(())
}

/// One fresh store at N: fill, measure, check, drop.
fn one_run(n: u32, args: &ScaleArgs) -> Result<RunResult, String> {
    let page = args.page_kib * KIB;
    trim_heap();
    let before = rss_bytes()?;
    let fx = fixture(n, page)?;
    let built = rss_bytes()?;
    let fill = fill(&fx, n, Duration::from_secs_f64(args.fill_seconds))?;
    let filled = rss_bytes()?;
    let pool = fx.st.pool_bytes() as f64;
    let meta_total = (filled as f64 - before as f64 - pool) / f64::from(n);
    let meta_fill = (filled as f64 - built as f64) / f64::from(n);
    let limit = Duration::from_secs_f64(args.phase_seconds);
    let mut win = Window {
        lo: 0,
        hi: u64::from(n),
    };
    churn(&fx, &mut win, args.warmup, limit)?;
    let lookup = lookups(&fx, win, args.ops, limit)?;
    let (mut allocs, mut publishes) = churn(&fx, &mut win, args.ops, limit)?;
    let (alloc, publish) = (pct(&mut allocs), pct(&mut publishes));
    let evict = evictions(&fx, n, args.ops, limit)?;
    let stats = fx.st.stats();
    if stats.accounting.published != n || stats.counters.evictions != evict.samples as u64 {
        return Err(format!(
            "after the run: {} published (expected {n}), {} evictions (expected {})",
            stats.accounting.published, stats.counters.evictions, evict.samples
        ));
    }
    fx.st
        .check_invariants()
        .map_err(|e| format!("store invariant broken after the run: {e}"))?;
    Ok(RunResult {
        lookup,
        alloc,
        publish,
        evict,
        meta_total,
        meta_fill,
        fill,
    })
}

fn fixture(n: u32, page: u64) -> Result<Fixture, String> {
    let st = Store::new(
        StoreConfig::new(PoolConfig {
            page_size_bytes: page,
            page_count: n,
            huge_pages: HugePages::Off,
        }),
        Arc::new(MonotonicClock::new()),
    )
    .map_err(|e| format!("store of {n} pages of {page} bytes: {e}"))?;
    let ns = st
        .register_namespace(&NamespaceDescriptor {
            model_revision: "kvd-bench-scale".into(),
            tokens_per_block: 16,
            bytes_per_block: page,
            rope: String::new(),
            ..NamespaceDescriptor::example_qwen3_14b()
        })
        .map_err(|e| format!("register namespace: {e}"))?;
    let sid = st
        .open_session("kvd-bench-scale", 600_000)
        .map_err(|e| format!("open session: {e}"))?;
    Ok(Fixture { st, ns, sid })
}

/// The key of block number `i` (keys are made, not kept, so the bench holds no per-block
/// memory of its own).
fn key(ns: NamespaceId, i: u64) -> BlockKey {
    let mut t = [0u8; 32];
    t[..8].copy_from_slice(&i.to_le_bytes());
    t[8..16].copy_from_slice(&i.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes());
    BlockKey {
        namespace: ns,
        tag: BlockTag(t),
    }
}

/// Publish blocks 0..N in batches, within `limit`.
fn fill(fx: &Fixture, n: u32, limit: Duration) -> Result<Duration, String> {
    let t0 = Instant::now();
    let mut keys = Vec::with_capacity(FILL_BATCH as usize);
    let mut next = 0u32;
    while next < n {
        let end = n.min(next + FILL_BATCH);
        keys.clear();
        keys.extend((next..end).map(|i| key(fx.ns, u64::from(i))));
        let allocs = fx
            .st
            .alloc_for_write(fx.sid, &keys, BlockClass::Cache, None)
            .map_err(|e| format!("fill: alloc at block {next}: {e}"))?;
        let mut hs = Vec::with_capacity(allocs.len());
        for a in allocs {
            hs.push(a.map_err(|e| format!("fill: alloc: {e}"))?.handle);
        }
        for h in &hs {
            seal(fx, h)?;
        }
        fx.st
            .publish(fx.sid, &hs)
            .map_err(|e| format!("fill: publish: {e}"))?;
        next = end;
        if t0.elapsed() > limit {
            return Err(format!(
                "filling {n} blocks took over {:.0} s (at {next}); raise --fill-seconds or lower \
                 --blocks",
                limit.as_secs_f64()
            ));
        }
    }
    Ok(t0.elapsed())
}

fn seal(fx: &Fixture, h: &Handle) -> Result<(), String> {
    fx.st
        .seal(fx.sid, h, fx.st.page_size(), Some(0))
        .map(|_| ())
        .map_err(|e| format!("seal: {e}"))
}

/// `alloc_for_write` of one key: its handle.
fn alloc_one(fx: &Fixture, k: BlockKey) -> Result<Handle, String> {
    let mut a = fx
        .st
        .alloc_for_write(fx.sid, &[k], BlockClass::Cache, None)
        .map_err(|e| format!("alloc: {e}"))?;
    match a.pop() {
        Some(Ok(a)) => Ok(a.handle),
        Some(Err(e)) => Err(format!("alloc: {e}")),
        None => Err("alloc: no result".into()),
    }
}

fn ns_of(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Lookups of random resident keys (drawn from the window).
fn lookups(fx: &Fixture, win: Window, ops: usize, limit: Duration) -> Result<Pct, String> {
    let mut rng = SplitMix(0x5EED_0F10_0C00_0001);
    let mut samples = Vec::with_capacity(ops);
    let t0 = Instant::now();
    while samples.len() < ops && t0.elapsed() < limit {
        let k = key(fx.ns, win.lo + rng.next() % (win.hi - win.lo));
        let t = Instant::now();
        let found = fx.st.lookup(&[k]);
        let dt = t.elapsed();
        match found {
            Ok(v) if v.first().is_some_and(Option::is_some) => samples.push(ns_of(dt)),
            Ok(_) => return Err(format!("lookup: resident block {k} not found")),
            Err(e) => return Err(format!("lookup: {e}")),
        }
    }
    Ok(pct(&mut samples))
}

/// The resident blocks, by key number: exactly `lo..hi`, oldest written first (nothing has
/// been evicted while a window is in use).
#[derive(Debug, Clone, Copy)]
struct Window {
    lo: u64,
    hi: u64,
}

/// Delete+alloc+publish cycles, N kept resident: the oldest block written (`lo`) is deleted
/// (untimed: `lookup` for its version, `remove_if`), a new one (`hi`) is allocated with the
/// page that freed (timed), sealed (untimed) and published (timed). Returns (alloc, publish)
/// samples in ns; up to `ops` cycles, within `limit`.
fn churn(
    fx: &Fixture,
    win: &mut Window,
    ops: usize,
    limit: Duration,
) -> Result<(Vec<u64>, Vec<u64>), String> {
    let mut allocs = Vec::with_capacity(ops);
    let mut publishes = Vec::with_capacity(ops);
    let t0 = Instant::now();
    while allocs.len() < ops && t0.elapsed() < limit {
        let old = key(fx.ns, win.lo);
        let info = fx
            .st
            .lookup(&[old])
            .map_err(|e| format!("lookup before delete: {e}"))?
            .pop()
            .flatten()
            .ok_or_else(|| format!("block {old} to delete is not resident"))?;
        fx.st
            .remove_if(&old, info.handle.version())
            .map_err(|e| format!("remove_if: {e}"))?;
        win.lo += 1;
        let t = Instant::now();
        let h = alloc_one(fx, key(fx.ns, win.hi))?;
        allocs.push(ns_of(t.elapsed()));
        win.hi += 1;
        seal(fx, &h)?;
        let t = Instant::now();
        let published = fx.st.publish(fx.sid, &[h]);
        publishes.push(ns_of(t.elapsed()));
        published.map_err(|e| format!("publish: {e}"))?;
    }
    Ok((allocs, publishes))
}

/// Allocations into the full pool, each evicting the least recently used block; each sealed
/// and published untimed so that the next finds the pool full again. New keys start past any
/// key used before (`2^40`).
fn evictions(fx: &Fixture, n: u32, ops: usize, limit: Duration) -> Result<Pct, String> {
    let stats = fx.st.stats();
    if stats.accounting.free != 0 || stats.accounting.published != n {
        return Err(format!(
            "before evicting: {} free pages, {} published (expected 0 and {n})",
            stats.accounting.free, stats.accounting.published
        ));
    }
    let mut next = 1u64 << 40;
    let mut samples = Vec::with_capacity(ops);
    let t0 = Instant::now();
    while samples.len() < ops && t0.elapsed() < limit {
        let t = Instant::now();
        let h = alloc_one(fx, key(fx.ns, next))?;
        samples.push(ns_of(t.elapsed()));
        next += 1;
        seal(fx, &h)?;
        fx.st
            .publish(fx.sid, &[h])
            .map_err(|e| format!("publish after evict: {e}"))?;
    }
    Ok(pct(&mut samples))
}

/// p50 and p99 of samples in ns (sorts them).
fn pct(v: &mut [u64]) -> Pct {
    v.sort_unstable();
    let at = |q: f64| {
        if v.is_empty() {
            f64::NAN
        } else {
            let i = ((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1;
            v[i] as f64
        }
    };
    Pct {
        p50: at(0.50),
        p99: at(0.99),
        samples: v.len(),
    }
}

/// The median cost of two back-to-back `Instant::now()` calls, ns.
fn timer_overhead_ns() -> f64 {
    let mut v: Vec<u64> = (0..10_000)
        .map(|_| {
            let t = Instant::now();
            ns_of(t.elapsed())
        })
        .collect();
    pct(&mut v).p50
}

/// Hand freed heap back to the kernel, so that the next baseline is not inflated by an
/// earlier run's memory, nor the next growth hidden by its reuse.
fn trim_heap() {
    // SAFETY: `malloc_trim` only releases free memory of the allocator's own arenas; it takes
    // no pointer and is safe to call at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The process's resident set, bytes (`VmRSS` of `/proc/self/status`).
fn rss_bytes() -> Result<u64, String> {
    let s = std::fs::read_to_string("/proc/self/status")
        .map_err(|e| format!("read /proc/self/status: {e}"))?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kib| kib * KIB)
        .ok_or_else(|| "no VmRSS in /proc/self/status".into())
}

/// A small deterministic generator (splitmix64).
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

fn series(name: &str, results: &[(u32, Vec<RunResult>)], f: impl Fn(&RunResult) -> f64) -> Series {
    Series {
        name: name.into(),
        points: results
            .iter()
            .map(|(n, runs)| {
                let v: Vec<f64> = runs.iter().map(&f).collect();
                Point::of_runs(f64::from(*n), &v)
            })
            .collect(),
    }
}

fn emit(args: &ScaleArgs, results: &[(u32, Vec<RunResult>)]) -> Result<(), String> {
    let latency = Curve {
        title: format!(
            "store op latency vs resident blocks ({} KiB pages, {} ops per op and run, median of \
             {} runs)",
            args.page_kib, args.ops, args.runs
        ),
        x_label: "resident blocks".into(),
        y_label: "ns".into(),
        log_x: true,
        log_y: true,
        series: vec![
            series("lookup p50", results, |r| r.lookup.p50),
            series("lookup p99", results, |r| r.lookup.p99),
            series("alloc p50", results, |r| r.alloc.p50),
            series("alloc p99", results, |r| r.alloc.p99),
            series("publish p50", results, |r| r.publish.p50),
            series("publish p99", results, |r| r.publish.p99),
            series("evict p50", results, |r| r.evict.p50),
            series("evict p99", results, |r| r.evict.p99),
        ],
    };
    latency.emit(args.plot.as_deref(), "scale-latency")?;
    let meta = Curve {
        title: "metadata bytes per block (RSS growth minus the pool, over N)".into(),
        x_label: "resident blocks".into(),
        y_label: "bytes/block".into(),
        log_x: true,
        log_y: true,
        series: vec![
            series("store total", results, |r| r.meta_total),
            series("growth while filling", results, |r| r.meta_fill),
        ],
    };
    meta.emit(args.plot.as_deref(), "scale-metadata")
}

fn median(results: &[RunResult], f: impl Fn(&RunResult) -> f64) -> f64 {
    let v: Vec<f64> = results.iter().map(f).collect();
    Point::of_runs(0.0, &v).y
}

fn summary(results: &[(u32, Vec<RunResult>)], timer: f64) {
    println!(
        "\nSummary (medians of the runs; every sample includes ~{} ns of timer; `evict` is an \
         alloc into a full pool, which evicts one LRU block, so evict − alloc is the eviction's \
         own share):",
        fmt_num(timer)
    );
    let mut last: Option<(u32, f64)> = None;
    for (n, runs) in results {
        let m = |f: fn(&RunResult) -> f64| median(runs, f);
        let total = m(|r| r.meta_total);
        let marginal = last.map_or(String::new(), |(n0, t0)| {
            let extra = total * f64::from(*n) - t0 * f64::from(n0);
            format!(
                ", {} bytes per block added since N={}",
                fmt_num(extra / f64::from(n - n0)),
                fmt_num(f64::from(n0))
            )
        });
        println!(
            "- N={}: lookup {} ns, alloc {} ns, publish {} ns, evict {} ns (eviction's share {} \
             ns), p50s; metadata {} bytes/block ({} of it grown while filling){marginal}; fill \
             {} s",
            fmt_num(f64::from(*n)),
            fmt_num(m(|r| r.lookup.p50)),
            fmt_num(m(|r| r.alloc.p50)),
            fmt_num(m(|r| r.publish.p50)),
            fmt_num(m(|r| r.evict.p50)),
            fmt_num(m(|r| r.evict.p50) - m(|r| r.alloc.p50)),
            fmt_num(total),
            fmt_num(m(|r| r.meta_fill)),
            fmt_num(m(|r| r.fill.as_secs_f64())),
        );
        last = Some((*n, total));
    }
}
