//! `kvd-bench bindings`: the Rust client's side of the bindings' overhead measurement.
//!
//! `scripts/bench-bindings.sh` runs the same three measurements through the Rust client (this),
//! libkvd from C (`benches/c/bindings.c`) and the Python package (`benches/python/bindings.py`)
//! against one daemon, one after the other, and prints them side by side. Each measures, on a
//! daemon with 2.5 MiB pages:
//!
//! - **lookup**: one `lookup_prefix` of 128 published tags (all hits, no pin): p50/p99.
//! - **put**: 64 pages of 2.5 MiB: `alloc(64)` → 64 copies into the pool with the CRC-32C
//!   computed in the copy → `seal(64)` → `publish(64)`; fresh keys every iteration.
//! - **get**: those 64 blocks: `acquire(64)` → 64 copies out with the CRC checked in the copy →
//!   `release(64)`.
//!
//! Output: one line per measurement, `BENCH <binding> <what> p50_us=.. p99_us=.. gbps=..`.
//! Every loop is bounded by a count.

use std::path::PathBuf;
use std::time::Instant;

use kvd::client::{Client, ClientOptions};
use kvd::keys::{BlockKey, BlockTag, NamespaceDescriptor};
use kvd::protocol::SealItem;
use kvd::store::BlockClass;

/// `kvd-bench bindings` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct BindingsArgs {
    /// The daemon's socket (its pages must be at least 2.5 MiB).
    #[arg(long)]
    pub socket: PathBuf,
    /// Seed of the keys (each binding uses its own, so their blocks do not collide).
    #[arg(long, default_value_t = 1)]
    pub seed: u8,
    /// Timed iterations of put and get.
    #[arg(long, default_value_t = 20)]
    pub iters: usize,
    /// Timed lookups.
    #[arg(long, default_value_t = 300)]
    pub lookups: usize,
}

/// Bytes of one page: 2.5 MiB.
pub const PAGE_BYTES: usize = 2560 * 1024;
/// Pages per put/get batch.
pub const BATCH: usize = 64;
/// Tags per lookup.
pub const LOOKUP_TAGS: usize = 128;
const WARMUP: usize = 3;

/// The measurements' layout (the same descriptor in C and Python).
pub fn layout() -> NamespaceDescriptor {
    NamespaceDescriptor::minimal("bench/bindings", "1", 16, PAGE_BYTES as u64)
}

/// Tag bytes: `[seed, family, i (u32 LE), 0...]`, as the C and Python sides build them.
fn tag(seed: u8, family: u32, i: u32) -> BlockTag {
    let mut t = [0u8; 32];
    t[0] = seed;
    t[1..5].copy_from_slice(&family.to_le_bytes());
    t[5..9].copy_from_slice(&i.to_le_bytes());
    BlockTag(t)
}

/// p50 and p99 of microsecond samples.
fn percentiles(mut us: Vec<f64>) -> (f64, f64) {
    us.sort_by(f64::total_cmp);
    let at = |q: f64| us[((us.len() - 1) as f64 * q).round() as usize];
    (at(0.50), at(0.99))
}

fn report(what: &str, us: Vec<f64>, bytes_per_iter: usize) {
    let total_s: f64 = us.iter().sum::<f64>() / 1e6;
    let n = us.len();
    let (p50, p99) = percentiles(us);
    let gbps = if bytes_per_iter > 0 {
        (bytes_per_iter * n) as f64 / total_s / 1e9
    } else {
        0.0
    };
    println!("BENCH rust {what} p50_us={p50:.1} p99_us={p99:.1} gbps={gbps:.2}");
}

fn timed(iters: usize, mut f: impl FnMut(usize) -> kvd::Result<()>) -> kvd::Result<Vec<f64>> {
    let mut us = Vec::with_capacity(iters);
    for i in 0..WARMUP + iters {
        let t = Instant::now();
        f(i)?;
        if i >= WARMUP {
            us.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok(us)
}

/// Run the three measurements through the Rust client.
pub fn run(args: &BindingsArgs) -> Result<(), String> {
    let e = |e: kvd::Error| e.to_string();
    let mut c = Client::connect(&args.socket, &ClientOptions::named("bench-rust")).map_err(e)?;
    let ns = c.register_namespace(&layout()).map_err(e)?;
    let key = |family: u32, i: u32| BlockKey {
        namespace: ns,
        tag: tag(args.seed, family, i),
    };

    // lookup: publish 128 small blocks, then time lookup_prefix over their tags.
    let tags: Vec<BlockTag> = (0..LOOKUP_TAGS as u32)
        .map(|i| tag(args.seed, 0, i))
        .collect();
    let keys: Vec<BlockKey> = (0..LOOKUP_TAGS as u32).map(|i| key(0, i)).collect();
    put_batch(&mut c, &keys, &vec![vec![7u8; 4096]; LOOKUP_TAGS]).map_err(e)?;
    let us = timed(args.lookups, |_| {
        let hit = c.lookup_prefix(&ns, &tags, false, None)?;
        assert_eq!(hit.blocks.len(), LOOKUP_TAGS, "every tag is published");
        Ok(())
    })
    .map_err(e)?;
    report("lookup128", us, 0);

    // put and get: 64 distinct 2.5 MiB sources and destinations (160 MiB each).
    let srcs: Vec<Vec<u8>> = (0..BATCH)
        .map(|b| (0..PAGE_BYTES).map(|i| (i as u8) ^ (b as u8)).collect())
        .collect();
    let mut last = Vec::new();
    let us = timed(args.iters, |it| {
        last = (0..BATCH as u32).map(|i| key(1 + it as u32, i)).collect();
        put_batch(&mut c, &last, &srcs)
    })
    .map_err(e)?;
    report("put64x2.5MiB", us, BATCH * PAGE_BYTES);

    let mut dsts = vec![vec![0u8; PAGE_BYTES]; BATCH];
    let us = timed(args.iters, |_| {
        let got = c.acquire(&last, None)?;
        let mut handles = Vec::with_capacity(BATCH);
        for (b, dst) in got.into_iter().zip(dsts.iter_mut()) {
            let b = b?;
            c.read_verified(&b.handle, dst)?;
            handles.push(b.handle);
        }
        c.release(&handles)?;
        Ok(())
    })
    .map_err(e)?;
    assert_eq!(dsts[3], srcs[3], "the bytes came back");
    report("get64x2.5MiB", us, BATCH * PAGE_BYTES);
    c.close().map_err(e)
}

/// alloc → copy with CRC → seal → publish, one batch; keys that exist already are skipped.
fn put_batch(c: &mut Client, keys: &[BlockKey], pages: &[Vec<u8>]) -> kvd::Result<()> {
    let allocs = c.alloc(keys, BlockClass::Cache, None)?;
    let mut items = Vec::with_capacity(keys.len());
    for (a, page) in allocs.into_iter().zip(pages) {
        let Ok(a) = a else { continue };
        let crc = c.write_with_crc(&a.handle, 0, page, 0)?;
        items.push(SealItem {
            handle: a.handle,
            len: page.len() as u64,
            checksum: Some(crc),
        });
    }
    for s in c.seal(&items)? {
        s?;
    }
    if !items.is_empty() {
        c.publish(&items.iter().map(|s| s.handle).collect::<Vec<_>>())?;
    }
    Ok(())
}
