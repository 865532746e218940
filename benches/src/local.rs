//! `kvd-bench local`: the local data path through a real daemon.
//!
//! What one case measures, for a page size P and a batch of B blocks:
//!
//! - **put**: `alloc(B)` (one round trip) → copy B pages into the mapped pool → `seal(B)` →
//!   `publish(B)`; bytes = B·P per iteration. The pool is smaller than the data written, so
//!   allocations evict older blocks (LRU), as a steady-state cache does. Checksum modes:
//!   - `off`: plain non-temporal copy; the seal carries the source's CRC-32C computed once
//!     before timing (a producer that checksums upstream). No CRC work on the data path.
//!   - `client`: the copy is fused with the CRC-32C (`copy_with_crc32c`), supplied at seal:
//!     the production path. The daemon records it without another pass.
//!   - `daemon`: plain copy, no checksum supplied: the daemon computes it at seal (a second
//!     pass over the block, for comparison).
//! - **get**: `acquire(B)` → copy B pages out of the mapped pool → `release(B)`; with
//!   `verify`, the copy checks each block's CRC-32C in the same pass.
//! - **lookup**: p50/p99 of one batched `exists` of 128 keys and of one `lookup_prefix` of 128
//!   tags (hits, no pin).
//!
//! Sources and destinations rotate over buffers larger than the last-level cache, so every
//! copy goes memory to memory. The bound is the better of one `memcpy` of 1 GiB (glibc uses
//! non-temporal stores at that size) and one call of kvd's own non-temporal copy over the
//! same bytes, best of three each at the start and at the end of the run.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvd::client::{Client, ClientOptions};
use kvd::keys::{BlockKey, BlockTag, NamespaceDescriptor, NamespaceId};
use kvd::protocol::SealItem;
use kvd::store::{BlockClass, Handle};

/// `kvd-bench local` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct LocalArgs {
    /// Measure the daemon on this socket (at its page size) instead of starting one.
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// The `kvd` binary to start (default: the one beside this binary).
    #[arg(long)]
    pub kvd: Option<PathBuf>,
    /// Page sizes in KiB, comma-separated (ignored with --socket).
    #[arg(long, value_delimiter = ',', default_values_t = vec![160u64, 2560, 10240])]
    pub page_kib: Vec<u64>,
    /// Batch sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1usize, 64])]
    pub batch: Vec<usize>,
    /// Time budget of one case, seconds (each case also stops at 16 GiB moved).
    #[arg(long, default_value_t = 1.5)]
    pub seconds_per_case: f64,
    /// Size of the memcpy bound's copy, MiB.
    #[arg(long, default_value_t = 1024)]
    pub bound_mib: usize,
    /// Lookups timed per latency measurement (bounded by 3 s too).
    #[arg(long, default_value_t = 2000)]
    pub lookup_iters: usize,
    /// Skip the `daemon` checksum mode (a second pass at seal).
    #[arg(long)]
    pub skip_daemon_crc: bool,
    /// Instead of the single-client table: N client processes at once (comma-separated list,
    /// e.g. 1,2,4,8), aggregate GB/s beside N parallel copies, at 2.5 MiB pages (or the first
    /// --page-kib).
    #[arg(long, value_delimiter = ',')]
    pub clients: Vec<usize>,
    /// The client's `spin_us` (how long a call polls for its answer before it blocks).
    #[arg(long, default_value_t = kvd::client::DEFAULT_SPIN_US)]
    pub client_spin_us: u32,
    /// Start the daemon with `--cpu-wake-latency-us N` (holds the CPUs' wake latency while
    /// clients call, so a round trip does not wait for an idle CPU to wake; needs root for
    /// /dev/cpu_dma_latency). Ignored with --socket.
    #[arg(long)]
    pub daemon_cpu_wake_us: Option<u32>,
    /// With --clients: runs per count and mode, alternating the bound and both modes (median
    /// and spread reported).
    #[arg(long, default_value_t = 3)]
    pub client_runs: usize,
    /// With --clients: write the curve (SVG) and its table (Markdown) into this directory.
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

const MOVED_CAP_BYTES: u64 = 16 << 30;
/// Source and destination sets are at least this large, so copies come from memory.
const WORKING_SET_BYTES: usize = 96 << 20;

/// One row of the summary.
#[derive(Debug, Clone)]
struct Row {
    what: String,
    gbps: Option<f64>,
    note: String,
}

/// Run the benchmark.
pub fn run(args: &LocalArgs) -> Result<(), String> {
    let mut rows = Vec::new();
    eprintln!(
        "measuring the memcpy bound ({} MiB, best of 3)...",
        args.bound_mib
    );
    let (glibc_start, nt_start) = memcpy_bounds(args.bound_mib << 20);
    let bound_start = glibc_start.max(nt_start);
    eprintln!("  bound: {bound_start:.2} GB/s (glibc {glibc_start:.2}, kvd's copy {nt_start:.2})");
    let blocky = blocky_copy_rates();
    for (name, gbps) in blocky {
        rows.push(Row {
            what: name,
            gbps: Some(gbps),
            note: String::new(),
        });
    }
    let mut lat_rows = Vec::new();
    if !args.clients.is_empty() {
        if args.clients.iter().any(|&n| n == 0 || n > 64) {
            return Err("--clients takes counts from 1 to 64".into());
        }
        return crate::clients::run(args, &kvd_binary(args)?, &args.clients);
    }
    match &args.socket {
        Some(sock) => {
            let c = connect(sock)?;
            let page = c.page_size() as usize;
            drop(c);
            run_page_size(args, sock, page, &mut rows, &mut lat_rows)?;
        }
        None => {
            let kvd = kvd_binary(args)?;
            for &kib in &args.page_kib {
                let page = (kib << 10) as usize;
                let d =
                    ChildDaemon::start_with(&kvd, page, pool_pages(page), &args.daemon_flags())?;
                run_page_size(args, &d.socket, page, &mut rows, &mut lat_rows)?;
                d.stop();
            }
        }
    }
    // On a shared machine memory bandwidth drifts during the run: measure the bound again at
    // the end and take the best, so that no ratio flatters the daemon.
    eprintln!("measuring the memcpy bound again...");
    let (glibc_end, nt_end) = memcpy_bounds(args.bound_mib << 20);
    let bound = bound_start.max(glibc_end).max(nt_end);
    rows.insert(
        0,
        Row {
            what: format!("copy bound ({} MiB, one call)", args.bound_mib),
            gbps: Some(bound),
            note: format!(
                "best of glibc memcpy ({glibc_start:.2}, {glibc_end:.2}) and kvd's non-temporal \
                 copy ({nt_start:.2}, {nt_end:.2}), 3 each at the start and at the end"
            ),
        },
    );
    println!();
    println!("kvd-bench local — single client thread, ratio = GB/s ÷ memcpy bound");
    println!("{:<46} {:>8} {:>7}  note", "case", "GB/s", "ratio");
    println!("{}", "-".repeat(80));
    for r in &rows {
        match r.gbps {
            Some(g) => println!("{:<46} {:>8.2} {:>7.2}  {}", r.what, g, g / bound, r.note),
            None => println!("{:<46} {:>8} {:>7}  {}", r.what, "-", "-", r.note),
        }
    }
    println!();
    println!(
        "{:<46} {:>10} {:>10}",
        "batched lookup (128 keys)", "p50 µs", "p99 µs"
    );
    for (name, p50, p99) in &lat_rows {
        println!("{name:<46} {p50:>10.1} {p99:>10.1}");
    }
    Ok(())
}

/// The `kvd` binary to start: `--kvd`, or the one beside this binary.
fn kvd_binary(args: &LocalArgs) -> Result<PathBuf, String> {
    kvd_beside(args.kvd.as_deref())
}

/// The `kvd` binary to start: `given`, or the one beside this binary.
pub(crate) fn kvd_beside(given: Option<&Path>) -> Result<PathBuf, String> {
    let kvd = match given {
        Some(p) => p.to_path_buf(),
        None => std::env::current_exe()
            .map_err(|e| e.to_string())?
            .with_file_name("kvd"),
    };
    if !kvd.exists() {
        return Err(format!(
            "no kvd binary at {}; build it with `cargo build --release -p kvd` or pass --kvd or \
             --socket",
            kvd.display()
        ));
    }
    Ok(kvd)
}

impl LocalArgs {
    /// The `kvd serve` flags these arguments ask for, beyond the pool's.
    pub(crate) fn daemon_flags(&self) -> Vec<String> {
        match self.daemon_cpu_wake_us {
            Some(us) => vec!["--cpu-wake-latency-us".into(), us.to_string()],
            None => Vec::new(),
        }
    }
}

pub(crate) fn pool_pages(page: usize) -> usize {
    // Enough for a batch of 64 in flight plus a get set larger than the cache; at most ~1 GiB.
    ((1usize << 30) / page).clamp(160, 640)
}

pub(crate) fn connect(sock: &Path) -> Result<Client, String> {
    connect_spinning(sock, kvd::client::DEFAULT_SPIN_US)
}

/// As [`connect`], the client polling up to `spin_us` for each answer before it blocks.
pub(crate) fn connect_spinning(sock: &Path, spin_us: u32) -> Result<Client, String> {
    let opts = ClientOptions {
        lease_ttl_ms: 60_000,
        spin_us,
        ..ClientOptions::named("kvd-bench")
    };
    Client::connect(sock, &opts).map_err(|e| format!("connecting to {}: {e}", sock.display()))
}

pub(crate) fn descriptor(page: usize) -> NamespaceDescriptor {
    NamespaceDescriptor {
        tokenizer: "bench".into(),
        cache_salt: format!("kvd-bench-{}", std::process::id()),
        head_dim: 128,
        ..NamespaceDescriptor::minimal("bench/model", "1", 16, page as u64)
    }
}

pub(crate) struct Keys {
    ns: NamespaceId,
    next: u64,
}

impl Keys {
    pub(crate) fn new(ns: NamespaceId) -> Keys {
        Keys { ns, next: 0 }
    }

    pub(crate) fn take(&mut self, n: usize) -> Vec<BlockKey> {
        (0..n)
            .map(|_| {
                self.next += 1;
                let mut tag = [0u8; 32];
                tag[..8].copy_from_slice(&self.next.to_le_bytes());
                tag[8..16].copy_from_slice(&std::process::id().to_le_bytes().repeat(2));
                BlockKey {
                    namespace: self.ns,
                    tag: BlockTag(tag),
                }
            })
            .collect()
    }
}

/// At least `at_least` page-sized buffers covering at least `set_bytes`.
pub(crate) fn buffers(page: usize, at_least: usize, seed: u8, set_bytes: usize) -> Vec<Vec<u8>> {
    let n = at_least.max(set_bytes.div_ceil(page));
    (0..n)
        .map(|i| {
            let s = seed.wrapping_add(i as u8);
            (0..page)
                .map(|j| (j as u8).wrapping_mul(31) ^ s ^ (j >> 12) as u8)
                .collect()
        })
        .collect()
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Crc {
    Off,
    Client,
    Daemon,
}

fn run_page_size(
    args: &LocalArgs,
    sock: &Path,
    page: usize,
    rows: &mut Vec<Row>,
    lat: &mut Vec<(String, f64, f64)>,
) -> Result<(), String> {
    let mut c = connect_spinning(sock, args.client_spin_us)?;
    let ns = c
        .register_namespace(&descriptor(page))
        .map_err(|e| e.to_string())?;
    let pool_pages = c.welcome().page_count as usize;
    let max_batch = *args.batch.iter().max().unwrap_or(&1);
    if pool_pages < max_batch + 1 {
        return Err(format!(
            "the pool has {pool_pages} pages; batches of {max_batch} need more"
        ));
    }
    let mut keys = Keys::new(ns);
    eprintln!("page {} KiB: preparing buffers...", page >> 10);
    let src = buffers(page, max_batch, 1, WORKING_SET_BYTES);
    let src_crc: Vec<u32> = src.iter().map(|b| transport::local::crc32c(0, b)).collect();
    let mut dst = buffers(page, max_batch, 2, WORKING_SET_BYTES);
    let label = human(page);
    let mut modes = vec![Crc::Off, Crc::Client];
    if !args.skip_daemon_crc {
        modes.push(Crc::Daemon);
    }
    let budget = Duration::from_secs_f64(args.seconds_per_case);
    let mut published: Vec<BlockKey> = Vec::new();
    for &batch in &args.batch {
        for &mode in &modes {
            let name = format!(
                "put {label} batch {batch} crc={}",
                match mode {
                    Crc::Off => "off",
                    Crc::Client => "client",
                    Crc::Daemon => "daemon",
                }
            );
            let (gbps, note) = put_case(&mut c, &mut keys, &src, &src_crc, batch, mode, budget)
                .map_err(|e| format!("{name}: {e}"))?;
            eprintln!("  {name}: {gbps:.2} GB/s {note}");
            rows.push(Row {
                what: name,
                gbps: Some(gbps),
                note,
            });
        }
        // Publish a get set (the latest blocks, at most half the pool).
        published = fill(
            &mut c,
            &mut keys,
            &src,
            &src_crc,
            (pool_pages / 2).max(batch),
        )?;
        for verify in [false, true] {
            let name = format!(
                "get {label} batch {batch} verify={}",
                if verify { "on" } else { "off" }
            );
            let (gbps, note) = get_case(&mut c, &published, &mut dst, batch, verify, budget)
                .map_err(|e| format!("{name}: {e}"))?;
            eprintln!("  {name}: {gbps:.2} GB/s {note}");
            rows.push(Row {
                what: name,
                gbps: Some(gbps),
                note,
            });
        }
    }
    // Lookup latency, on the published set (hits).
    if published.len() >= 128 || pool_pages >= 128 {
        if published.len() < 128 {
            published = fill(&mut c, &mut keys, &src, &src_crc, 128)?;
        }
        let probe: Vec<BlockKey> = published[published.len() - 128..].to_vec();
        let (p50, p99) = latency(args.lookup_iters, || {
            c.exists(&probe).map(|_| ()).map_err(|e| e.to_string())
        })?;
        lat.push((format!("exists, {label} pool"), p50, p99));
        let tags: Vec<BlockTag> = probe.iter().map(|k| k.tag).collect();
        let (p50, p99) = latency(args.lookup_iters, || {
            let hit = c
                .lookup_prefix(&ns, &tags, false, None)
                .map_err(|e| e.to_string())?;
            if hit.blocks.is_empty() {
                return Err("the prefix lookup found nothing".into());
            }
            Ok(())
        })?;
        lat.push((format!("lookup_prefix (hits), {label} pool"), p50, p99));
        let (p50, p99) = latency(args.lookup_iters, || {
            c.heartbeat().map(|_| ()).map_err(|e| e.to_string())
        })?;
        lat.push((
            format!("heartbeat (empty round trip), {label} pool"),
            p50,
            p99,
        ));
        eprintln!("  lookup latency measured");
    }
    c.close().map_err(|e| e.to_string())?;
    Ok(())
}

/// Publish `n` fresh blocks (untimed) and return their keys.
fn fill(
    c: &mut Client,
    keys: &mut Keys,
    src: &[Vec<u8>],
    crc: &[u32],
    n: usize,
) -> Result<Vec<BlockKey>, String> {
    let mut out = Vec::with_capacity(n);
    let step = c.welcome().max_batch.min(64) as usize;
    while out.len() < n {
        let k = keys.take(step.min(n - out.len()));
        put_batch(c, &k, src, crc, out.len(), Crc::Off).map_err(|e| e.to_string())?;
        out.extend(k);
    }
    Ok(out)
}

pub(crate) fn put_batch(
    c: &mut Client,
    k: &[BlockKey],
    src: &[Vec<u8>],
    crc: &[u32],
    rot: usize,
    mode: Crc,
) -> kvd::Result<Duration> {
    let allocs = c.alloc(k, BlockClass::Cache, None)?;
    let mut seals = Vec::with_capacity(k.len());
    let t_copy = Instant::now();
    for (i, a) in allocs.into_iter().enumerate() {
        let a = a?;
        let j = (rot + i) % src.len();
        let data = &src[j];
        let checksum = match mode {
            Crc::Off => {
                c.write(&a.handle, 0, data)?;
                Some(crc[j])
            }
            Crc::Client => Some(c.write_with_crc(&a.handle, 0, data, 0)?),
            Crc::Daemon => {
                c.write(&a.handle, 0, data)?;
                None
            }
        };
        seals.push(SealItem {
            handle: a.handle,
            len: data.len() as u64,
            checksum,
        });
    }
    let copying = t_copy.elapsed();
    for r in c.seal(&seals)? {
        r?;
    }
    let handles: Vec<Handle> = seals.iter().map(|s| s.handle).collect();
    c.publish(&handles)?;
    Ok(copying)
}

fn put_case(
    c: &mut Client,
    keys: &mut Keys,
    src: &[Vec<u8>],
    crc: &[u32],
    batch: usize,
    mode: Crc,
    budget: Duration,
) -> Result<(f64, String), String> {
    let page = src[0].len() as u64;
    // Warm-up: one batch, untimed.
    put_batch(c, &keys.take(batch), src, crc, 0, mode).map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let mut moved = 0u64;
    let mut rot = 0;
    let mut iters = 0u64;
    let mut copying = Duration::ZERO;
    while t0.elapsed() < budget && moved < MOVED_CAP_BYTES {
        let k = keys.take(batch);
        copying += put_batch(c, &k, src, crc, rot, mode).map_err(|e| e.to_string())?;
        rot = (rot + batch) % src.len();
        moved += page * batch as u64;
        iters += 1;
    }
    let secs = t0.elapsed().as_secs_f64();
    Ok((
        moved as f64 / secs / 1e9,
        format!(
            "{iters} x (alloc, copy, seal, publish), {:.0} MiB; copying {:.0}% of the time",
            moved as f64 / 1048576.0,
            100.0 * copying.as_secs_f64() / secs
        ),
    ))
}

fn get_case(
    c: &mut Client,
    set: &[BlockKey],
    dst: &mut [Vec<u8>],
    batch: usize,
    verify: bool,
    budget: Duration,
) -> Result<(f64, String), String> {
    let page = dst[0].len() as u64;
    let mut pos = 0usize;
    let mut rot = 0usize;
    let mut moved = 0u64;
    let mut iters = 0u64;
    let mut one = |c: &mut Client, pos: &mut usize, rot: &mut usize| -> kvd::Result<u64> {
        let k: Vec<BlockKey> = (0..batch).map(|i| set[(*pos + i) % set.len()]).collect();
        *pos = (*pos + batch) % set.len();
        get_batch(c, &k, dst, rot, verify, false).map(|(bytes, _)| bytes)
    };
    one(c, &mut pos, &mut rot).map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    while t0.elapsed() < budget && moved < MOVED_CAP_BYTES {
        moved += one(c, &mut pos, &mut rot).map_err(|e| e.to_string())?;
        iters += 1;
    }
    let secs = t0.elapsed().as_secs_f64();
    debug_assert!(moved % page == 0);
    Ok((
        moved as f64 / secs / 1e9,
        format!("{iters} acquire/release pairs, set of {} blocks", set.len()),
    ))
}

/// Acquire `k`, copy each block out into the next buffer of `dst` (CRC verified in the copy or
/// not), release; returns the bytes read and the time the copies out took alone. A key no
/// longer published (evicted since it was written) is skipped with `skip_missing`, an error
/// without.
pub(crate) fn get_batch(
    c: &mut Client,
    k: &[BlockKey],
    dst: &mut [Vec<u8>],
    rot: &mut usize,
    verify: bool,
    skip_missing: bool,
) -> kvd::Result<(u64, Duration)> {
    let got = c.acquire(k, Some(60_000))?;
    let mut handles = Vec::with_capacity(k.len());
    let mut bytes = 0;
    let t_copy = Instant::now();
    for b in got {
        let b = match b {
            Ok(b) => b,
            Err(_) if skip_missing => continue,
            Err(e) => return Err(e),
        };
        let n = dst.len();
        let d = &mut dst[*rot % n];
        *rot += 1;
        if verify {
            bytes += c.read_verified(&b.handle, d)?;
        } else {
            c.read(&b.handle, 0, &mut d[..b.len as usize])?;
            bytes += b.len;
        }
        handles.push(b.handle);
    }
    let copying = t_copy.elapsed();
    for r in c.release(&handles)? {
        r?;
    }
    Ok((bytes, copying))
}

pub(crate) fn latency(
    iters: usize,
    mut f: impl FnMut() -> Result<(), String>,
) -> Result<(f64, f64), String> {
    for _ in 0..50.min(iters) {
        f()?;
    }
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut us = Vec::with_capacity(iters);
    while us.len() < iters && Instant::now() < deadline {
        let t = Instant::now();
        f()?;
        us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    us.sort_by(f64::total_cmp);
    let at = |q: f64| us[((us.len() - 1) as f64 * q).round() as usize];
    Ok((at(0.50), at(0.99)))
}

pub(crate) fn touch(v: &mut [u8]) {
    for i in (0..v.len()).step_by(4096) {
        v[i] = i as u8;
    }
}

/// The copy bound: the better of one large `memcpy` (glibc picks non-temporal stores at this
/// size) and one call of kvd's own non-temporal copy (`transport::local::copy`, the copy the
/// data path uses) over the same bytes, best of 3 each.
pub(crate) fn memcpy_bound(bytes: usize) -> f64 {
    let (glibc, nt) = memcpy_bounds(bytes);
    glibc.max(nt)
}

/// One large glibc `memcpy` and one call of kvd's non-temporal copy of `bytes`: (glibc GB/s,
/// kvd's GB/s), best of 3 each, alternating.
pub(crate) fn memcpy_bounds(bytes: usize) -> (f64, f64) {
    let mut a = vec![0u8; bytes];
    let mut b = vec![0u8; bytes];
    touch(&mut a);
    touch(&mut b);
    let (mut glibc, mut nt) = (0.0f64, 0.0f64);
    for i in 0..6 {
        let (src, dst) = if i % 2 == 0 {
            (&a, &mut b)
        } else {
            (&b, &mut a)
        };
        let t = Instant::now();
        if i % 2 == 0 {
            dst.copy_from_slice(src);
        } else {
            transport::local::copy(dst, src);
        }
        std::hint::black_box(&dst[bytes / 2]);
        let gbps = bytes as f64 / t.elapsed().as_secs_f64() / 1e9;
        if i % 2 == 0 {
            glibc = glibc.max(gbps);
        } else {
            nt = nt.max(gbps);
        }
    }
    (glibc, nt)
}

/// Block-sized copies for context: glibc memcpy and the transport's non-temporal copy, 2.5 MiB
/// blocks over a 256 MiB working set.
fn blocky_copy_rates() -> Vec<(String, f64)> {
    const BLOCK: usize = 2560 << 10;
    const SET: usize = 256 << 20;
    let mut src = vec![0u8; SET];
    let mut dst = vec![0u8; SET];
    touch(&mut src);
    touch(&mut dst);
    let blocks = SET / BLOCK;
    let mut rate = |nt: bool| {
        let mut best = 0.0f64;
        for _ in 0..3 {
            let t = Instant::now();
            for i in 0..blocks {
                let r = i * BLOCK..(i + 1) * BLOCK;
                if nt {
                    transport::local::copy(&mut dst[r.clone()], &src[r]);
                } else {
                    dst[r.clone()].copy_from_slice(&src[r]);
                }
            }
            best = best.max((blocks * BLOCK) as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
        best
    };
    let glibc = rate(false);
    let nt = rate(true);
    let mut crc = 0.0f64;
    for _ in 0..3 {
        let t = Instant::now();
        for i in 0..blocks {
            let r = i * BLOCK..(i + 1) * BLOCK;
            std::hint::black_box(transport::local::copy_with_crc32c(
                &mut dst[r.clone()],
                &src[r],
                0,
            ));
        }
        crc = crc.max((blocks * BLOCK) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    vec![
        ("memcpy in 2.5 MiB calls (no daemon)".into(), glibc),
        ("non-temporal copy, 2.5 MiB (no daemon)".into(), nt),
        ("copy fused with CRC-32C, 2.5 MiB (no daemon)".into(), crc),
    ]
}

pub(crate) fn human(page: usize) -> String {
    if page >= 1 << 20 {
        let m = page as f64 / (1 << 20) as f64;
        if m.fract() == 0.0 {
            format!("{m:.0}MiB")
        } else {
            format!("{m:.1}MiB")
        }
    } else {
        format!("{}KiB", page >> 10)
    }
}

/// A child's stdout, line by line, read on a thread of its own (it ends with the child's
/// stdout), so that a wait for one line can be bounded in time.
pub(crate) fn stdout_lines(child: &mut Child) -> std::sync::mpsc::Receiver<String> {
    let out = child.stdout.take().expect("the child's stdout is piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    rx
}

/// A `kvd serve` started for one page size, stopped (SIGTERM, bounded wait, then kill) on drop.
pub(crate) struct ChildDaemon {
    child: Option<Child>,
    pub(crate) socket: PathBuf,
    /// Its admin HTTP address (from its ready line).
    pub(crate) admin: String,
    _dir: tempfile::TempDir,
}

impl ChildDaemon {
    /// The daemon's process id.
    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Start `kvd serve` with a pool of `pages` pages of `page` bytes and `extra` flags.
    pub(crate) fn start_with(
        kvd: &Path,
        page: usize,
        pages: usize,
        extra: &[String],
    ) -> Result<ChildDaemon, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let socket = dir.path().join("kvd.sock");
        let pool_mib = (page * pages).div_ceil(1 << 20);
        eprintln!(
            "starting kvd serve: pages of {} KiB, pool {pool_mib} MiB...",
            page >> 10
        );
        let mut child = Command::new(kvd)
            .args(["serve", "--data-dir"])
            .arg(dir.path())
            .arg("--socket")
            .arg(&socket)
            .args(["--admin-listen", "127.0.0.1:0", "--huge-pages", "try"])
            .args(["--pool-mib", &pool_mib.to_string()])
            .args(["--page-kib", &(page >> 10).to_string()])
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("starting {}: {e}", kvd.display()))?;
        let rx = stdout_lines(&mut child);
        let deadline = Instant::now() + Duration::from_secs(60);
        let admin = loop {
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(l) if l.starts_with("kvd ready") => {
                    let admin = l.split_whitespace().find_map(|w| w.strip_prefix("admin="));
                    break admin.unwrap_or_default().to_string();
                }
                Ok(_) => {}
                Err(_) => {
                    let _ = child.kill();
                    return Err("kvd serve did not become ready within 60 s".into());
                }
            }
        };
        Ok(ChildDaemon {
            child: Some(child),
            socket,
            admin,
            _dir: dir,
        })
    }

    /// The value of the sample `series` (name and labels as `/metrics` prints them, e.g.
    /// `kvd_transfer_duration_seconds_sum{kind="fetch"}`) on the daemon's admin port.
    pub(crate) fn metric(&self, series: &str) -> Result<f64, String> {
        use std::io::{Read, Write};
        let mut c = std::net::TcpStream::connect(&self.admin)
            .map_err(|e| format!("admin {}: {e}", self.admin))?;
        c.set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(|e| e.to_string())?;
        write!(c, "GET /metrics HTTP/1.0\r\nHost: {}\r\n\r\n", self.admin)
            .map_err(|e| e.to_string())?;
        let mut text = String::new();
        c.take(64 << 20)
            .read_to_string(&mut text)
            .map_err(|e| e.to_string())?;
        text.lines()
            .find_map(|l| {
                l.strip_prefix(series)?
                    .strip_prefix(' ')?
                    .trim()
                    .parse()
                    .ok()
            })
            .ok_or_else(|| format!("{series} not in {}'s /metrics", self.admin))
    }

    pub(crate) fn stop(mut self) {
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        if let Some(mut c) = self.child.take() {
            stop_child(&mut c);
        }
    }
}

/// Ask a child to stop (SIGTERM: a daemon drains), give it up to 20 s, then kill it.
pub(crate) fn stop_child(c: &mut Child) {
    if let Some(pid) = rustix::process::Pid::from_raw(c.id() as i32) {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = c.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = c.kill();
    let _ = c.wait();
}

impl Drop for ChildDaemon {
    fn drop(&mut self) {
        self.stop_inner();
    }
}
