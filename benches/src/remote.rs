//! `kvd-bench remote`: blocks between two real daemons on loopback, end to end through their
//! clients, against the bounds measured in the same run.
//!
//! For each block size it starts two `kvd serve` (nodes 1 and 2, pages of that size, data
//! ports on loopback, each the other's peer) and, per run:
//!
//! - **push**: an engine on node 1 writes a fresh set of blocks (at least `--gib-per-case`
//!   GiB, untimed) into node 1's pool, then pushes them to node 2 in batches, `--in-flight`
//!   pushes (2) under way; timed from the first push request to the last push's end (every block verified
//!   and published on node 2).
//! - **fetch**: the engine writes another fresh set into node 1 (untimed); an engine on node 2
//!   fetches it from node 1 in batches, as many under way; timed likewise (every block verified
//!   and published on node 2).
//!
//! Bounds in the same run: raw loopback TCP over as many streams as a daemon's data
//! connections to a peer, cache-hot and memory to memory (`kvd-bench transfer`'s, both sampled
//! before every run; ratios are to the better), and one 1 GiB memcpy. GB/s counts block bytes moved. Every loop is
//! bounded in count and time.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvd::client::Client;
use kvd::keys::BlockKey;
use kvd::protocol::TransferState;
use transport::engine::HeapMemory;

use crate::local::{ChildDaemon, Crc, Keys, buffers, connect, descriptor, kvd_beside, put_batch};
use crate::transfer::{RawMode, Target, node_key, write_secret};

/// The data connections a daemon opens to a peer (the TCP backend's default, which the daemon
/// keeps): the raw bound uses as many streams.
const DATA_CONNECTIONS: usize = transport::tcp::DEFAULT_CONNECTIONS;
/// The raw bound's segment on each side: each stream's share exceeds the last-level cache.
const RAW_SEGMENT: u64 = 512 << 20;

/// `kvd-bench remote` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct RemoteArgs {
    /// Block sizes in KiB, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = vec![256u64, 2048, 2560])]
    pub block_kib: Vec<u64>,
    /// Blocks per push or fetch.
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    /// Pushes or fetches kept in flight (each is polled; a finished one is replaced at once);
    /// at most the daemon's `--max-transfers-per-peer` (8).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=8))]
    pub in_flight: u32,
    /// GiB moved per run and direction (at least).
    #[arg(long, default_value_t = 1.0)]
    pub gib_per_case: f64,
    /// Runs per size (median and spread reported).
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// The `kvd` binary to start (default: the one beside this binary).
    #[arg(long)]
    pub kvd: Option<PathBuf>,
    /// Idle time before each push or fetch, ms (needs `--in-flight 1`; not counted in the
    /// rate): an isolated transfer after a pause, as a P/D hand-off is (each request comes
    /// after the last one ended), wakes the threads that a back-to-back run keeps busy.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=10_000))]
    pub idle_ms: u64,
    /// Each daemon's `--data-lanes` (ring threads of its TCP engine).
    #[arg(long, default_value_t = kvd::daemon::DEFAULT_DATA_LANES)]
    pub data_lanes: usize,
    /// Start both daemons with `--payload-mac` (a keyed MAC on every payload between them).
    #[arg(long)]
    pub payload_mac: bool,
}

/// The fetching daemon's received bytes and its fetch timer, as `/metrics` names them.
const FETCHED_BYTES: &str = "kvd_transfer_bytes_received_total";
const FETCH_SECONDS: &str = "kvd_transfer_duration_seconds_sum{kind=\"fetch\"}";

/// No single transfer may take longer than this.
const TRANSFER_CAP: Duration = Duration::from_secs(120);

#[derive(Debug, Default)]
struct Samples {
    push: Vec<f64>,
    fetch: Vec<f64>,
    /// Fetch GB/s by the fetching daemon's own timer (`kvd_transfer_duration_seconds`, request
    /// to end of each fetch, summed): the span a hand-off's rate is measured over.
    fetch_daemon: Vec<f64>,
    raw_hot: Vec<f64>,
    raw_mem: Vec<f64>,
}

impl Samples {
    /// The better raw bound's median and its name.
    fn raw(&self) -> (f64, &'static str) {
        let (h, m) = (median(&self.raw_hot), median(&self.raw_mem));
        if h >= m {
            (h, RawMode::CacheHot.label())
        } else {
            (m, RawMode::MemoryToMemory.label())
        }
    }
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn spread(v: &[f64]) -> (f64, f64) {
    (
        v.iter().copied().fold(f64::MAX, f64::min),
        v.iter().copied().fold(0.0, f64::max),
    )
}

fn free_port() -> Result<u16, String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    Ok(l.local_addr().map_err(|e| e.to_string())?.port())
}

/// Run the benchmark.
pub fn run(args: &RemoteArgs) -> Result<(), String> {
    if args.batch == 0 || args.repeat == 0 || args.block_kib.is_empty() {
        return Err("--batch, --repeat and --block-kib need at least one".into());
    }
    if args.idle_ms > 0 && args.in_flight != 1 {
        return Err("--idle-ms pauses before each transfer: use it with --in-flight 1".into());
    }
    let kvd = kvd_beside(args.kvd.as_deref())?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let secret = write_secret(dir.path())?;
    let total = (args.gib_per_case * (1u64 << 30) as f64) as u64;
    eprintln!("kvd-bench remote: memcpy bound (1 GiB, best of 3)");
    let memcpy = crate::local::memcpy_bound(1 << 30);
    let raw_mem = HeapMemory::zeroed(RAW_SEGMENT as usize);
    crate::transfer::fill(&raw_mem);
    let mut raw = Target::spawn(
        &secret,
        RAW_SEGMENT,
        1024,
        "auto",
        transport::tcp::DEFAULT_LANES,
    )?;
    let mut rows = Vec::new();
    for &kib in &args.block_kib {
        let block = (kib << 10) as usize;
        let n = (total as usize).div_ceil(block);
        let mut s = Samples::default();
        let (port1, port2) = (free_port()?, free_port()?);
        let keys = [node_key(dir.path(), 1)?, node_key(dir.path(), 2)?];
        let node = |id: u32, port: u16, peer: u32, peer_port: u16| -> Vec<String> {
            let (mine, theirs) = (&keys[id as usize - 1], &keys[peer as usize - 1]);
            vec![
                "--cluster-secret-file".into(),
                secret.to_string_lossy().into_owned(),
                "--node-id".into(),
                id.to_string(),
                "--node-key-file".into(),
                mine.0.to_string_lossy().into_owned(),
                "--data-listen".into(),
                format!("127.0.0.1:{port}"),
                "--peer".into(),
                format!("{peer}=127.0.0.1:{peer_port},key={}", theirs.1),
                "--max-batch".into(),
                "1024".into(),
                "--data-lanes".into(),
                args.data_lanes.to_string(),
            ]
            .into_iter()
            .chain(args.payload_mac.then(|| "--payload-mac".to_string()))
            .collect::<Vec<String>>()
        };
        // room for one set plus the batches in flight
        let pages = n + 2 * (args.in_flight as usize + 1) * args.batch;
        let a = ChildDaemon::start_with(&kvd, block, pages, &node(1, port1, 2, port2))?;
        let b = ChildDaemon::start_with(&kvd, block, pages, &node(2, port2, 1, port1))?;
        let mut ca = connect(&a.socket)?;
        let mut cb = connect(&b.socket)?;
        let ns = ca
            .register_namespace(&descriptor(block))
            .map_err(|e| e.to_string())?;
        cb.register_namespace(&descriptor(block))
            .map_err(|e| e.to_string())?;
        let src = buffers(block, 8, 1, 64 << 20);
        let crcs: Vec<u32> = src.iter().map(|b| crc32c::crc32c(b)).collect();
        let mut keys = Keys::new(ns);
        for r in 0..args.repeat {
            for (v, mode) in [
                (&mut s.raw_mem, RawMode::MemoryToMemory),
                (&mut s.raw_hot, RawMode::CacheHot),
            ] {
                v.push(raw.raw_sample(&raw_mem, 1 << 30, DATA_CONNECTIONS, mode)?.0);
            }
            eprintln!(
                "kvd-bench remote: {} KiB blocks, run {} of {}: writing {n} blocks into node 1",
                kib,
                r + 1,
                args.repeat
            );
            let set = write_set(&mut ca, &mut keys, n, args.batch, &src, &crcs)?;
            eprintln!("kvd-bench remote:   pushing them to node 2");
            s.push
                .push(moved(&mut ca, &set, args, block, |c, k| c.push(2, k))?);
            let set = write_set(&mut ca, &mut keys, n, args.batch, &src, &crcs)?;
            eprintln!("kvd-bench remote:   node 2 fetching another {n} from node 1");
            let timer = |d: &ChildDaemon| -> Result<(f64, f64), String> {
                Ok((d.metric(FETCHED_BYTES)?, d.metric(FETCH_SECONDS)?))
            };
            let before = timer(&b)?;
            s.fetch
                .push(moved(&mut cb, &set, args, block, |c, k| c.fetch(1, k))?);
            let after = timer(&b)?;
            s.fetch_daemon
                .push((after.0 - before.0) / (after.1 - before.1).max(1e-9) / 1e9);
        }
        drop((ca, cb));
        a.stop();
        b.stop();
        rows.push((kib, s));
    }
    print_table(args, &rows, memcpy);
    Ok(())
}

/// The summary: one row per block size, its ratios to the better of the two raw bounds.
fn print_table(args: &RemoteArgs, rows: &[(u64, Samples)], memcpy: f64) {
    println!();
    println!(
        "{:<12} {:>9} {:>13} {:>6} {:>9} {:>9} {:>13} {:>6} {:>9} {:>9} {:>8} {:>8} {:>12}",
        "block",
        "push GB/s",
        "spread",
        "xTCP",
        "blocks/s",
        "fetch",
        "spread",
        "xTCP",
        "blocks/s",
        "raw TCP",
        "raw hot",
        "raw mem",
        "fetch(timer)"
    );
    let mut bound_names = Vec::new();
    for (kib, s) in rows {
        let (r, which) = s.raw();
        bound_names.push(format!("{kib} KiB: {which}"));
        let (p, f) = (median(&s.push), median(&s.fetch));
        let (plo, phi) = spread(&s.push);
        let (flo, fhi) = spread(&s.fetch);
        let per_s = |gbps: f64| gbps * 1e9 / (*kib as f64 * 1024.0);
        println!(
            "{:<12} {:>9.2} {:>5.2}..{:<6.2} {:>6.2} {:>9.0} {:>9.2} {:>5.2}..{:<6.2} {:>6.2} {:>9.0} {:>9.2} {:>8.2} {:>8.2} {:>12.3}",
            format!("{kib} KiB"),
            p,
            plo,
            phi,
            p / r,
            per_s(p),
            f,
            flo,
            fhi,
            f / r,
            per_s(f),
            r,
            median(&s.raw_hot),
            median(&s.raw_mem),
            median(&s.fetch_daemon)
        );
    }
    println!(
        "\nmemcpy (1 GiB, best of 3): {memcpy:.2} GB/s. {} runs per size, >= {:.2} GiB per run and \
         direction, batches of {}, {} in flight, {} ms idle before each, {} ring threads per daemon; raw TCP: {DATA_CONNECTIONS} streams (a daemon's \
         data connections to a peer), cache-hot and memory to memory, the median of the samples of \
         each taken before every run (1 GiB each); `raw TCP` and the ratios are the better of \
         the two ({}), `raw hot` and `raw mem` each; `fetch(timer)`: fetch GB/s by node 2's own \
         timer (request to end of each fetch), the span a P/D hand-off's rate is measured over.",
        args.repeat,
        args.gib_per_case,
        args.batch,
        args.in_flight,
        args.idle_ms,
        args.data_lanes,
        bound_names.join(", ")
    );
}

/// Write `n` fresh blocks into the daemon behind `c` (published, untimed); their keys.
fn write_set(
    c: &mut Client,
    keys: &mut Keys,
    n: usize,
    batch: usize,
    src: &[Vec<u8>],
    crcs: &[u32],
) -> Result<Vec<BlockKey>, String> {
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let k = keys.take(batch.min(n - out.len()));
        put_batch(c, &k, src, crcs, out.len(), Crc::Off).map_err(|e| e.to_string())?;
        out.extend(k);
    }
    Ok(out)
}

/// Move `set` in batches of `--batch` with `start` (push or fetch), `--in-flight` of them
/// under way: all pending transfers are polled together every millisecond and each finished
/// one is replaced at once, so no transfer waits behind an older one. GB/s of block bytes.
fn moved(
    c: &mut Client,
    set: &[BlockKey],
    args: &RemoteArgs,
    block: usize,
    start: impl Fn(&mut Client, &[BlockKey]) -> kvd::Result<u64>,
) -> Result<f64, String> {
    let t = Instant::now();
    let mut idle = Duration::ZERO;
    let mut pending: Vec<(u64, Instant)> = Vec::new();
    let mut batches = set.chunks(args.batch);
    let mut blocks = 0u64;
    loop {
        while pending.len() < args.in_flight as usize {
            let Some(k) = batches.next() else { break };
            if args.idle_ms > 0 {
                let pause = Duration::from_millis(args.idle_ms);
                std::thread::sleep(pause);
                idle += pause;
            }
            pending.push((start(c, k).map_err(|e| e.to_string())?, Instant::now()));
        }
        if pending.is_empty() {
            break;
        }
        let ids: Vec<u64> = pending.iter().map(|p| p.0).collect();
        let infos = c.transfers(&ids).map_err(|e| e.to_string())?;
        if infos.len() != ids.len() {
            return Err("the daemon forgot a transfer in flight".into());
        }
        let mut finished = 0;
        for info in infos {
            let Some(at) = pending.iter().position(|p| p.0 == info.id) else {
                continue;
            };
            match info.state {
                TransferState::InFlight if pending[at].1.elapsed() < TRANSFER_CAP => {}
                TransferState::InFlight => return Err("a transfer took over 120 s".into()),
                TransferState::Done => {
                    blocks += u64::from(info.blocks);
                    pending.swap_remove(at);
                    finished += 1;
                }
                TransferState::Failed(e) => return Err(format!("a transfer failed: {e:?}")),
            }
        }
        if finished == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    if blocks != set.len() as u64 {
        return Err(format!("{blocks} of {} blocks moved", set.len()));
    }
    let busy = t.elapsed().saturating_sub(idle).as_secs_f64().max(1e-9);
    Ok(blocks as f64 * block as f64 / 1e9 / busy)
}
