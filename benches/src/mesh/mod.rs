//! `kvd-bench mesh`: N daemons pushing blocks to each other all to all, each daemon in a
//! network namespace of its own, beside raw TCP of the same shape measured in the same run.
//!
//! The mesh: a "hub" namespace holds a bridge; every daemon's namespace has one veth into it
//! (`eth0`, 10.79.0.<i+1>/24) and loopback up. Namespaces are named `kvdmesh-<pid>-<i>` and
//! `kvdmesh-<pid>-hub`, so the root namespace is left alone; they, and the daemons in them,
//! go on every way out of the bench (a drop guard), and leftovers of a bench that was killed
//! (a pid that is no longer a `kvd-bench`) are removed at the start. Needs root and iproute2.
//!
//! For each daemon count N (`--daemons`) it starts N `kvd serve` (`ip netns exec NS kvd
//! serve`, data port on the namespace's address, every other daemon a static peer) and, per
//! run (`--repeat`, kvd and raw TCP alternating):
//!
//! - **kvd**: rounds. In a round every daemon first gets, through its client (the bench
//!   reaches each daemon's Unix socket from the root namespace), a fresh set of blocks for
//!   every other daemon (untimed), then every daemon pushes each of its sets to its
//!   destination in batches (`--batch`), one push in flight per (source, destination) pair,
//!   all pairs at once: one thread per source, polling its pushes' states every millisecond.
//!   Timed: from the start of a round's pushes to the end of its last push (every block
//!   verified and published at its destination), summed over the rounds. Rounds exist only so
//!   that the pools stay bounded (`--pool-gib`): a round's sets and what arrives in it fit,
//!   and what earlier rounds left is evicted. A run stops at `--mib-per-pair` per pair,
//!   `--gib-per-run` in all or `--seconds` of pushing, whichever comes first.
//!   Per-transfer latency: one batch push, from its request to the poll that sees it done.
//! - **raw TCP**: the same N namespaces, as many streams per (source, destination) pair as a
//!   daemon opens to a peer (`transport::tcp::DEFAULT_CONNECTIONS`), the same bytes per pair
//!   as the kvd run before it, memory to memory (1 MiB writes from a 256 MiB source, reads
//!   into a share of their own of a buffer larger than the last-level cache), all streams at
//!   once; sockets opened by threads of this process that enter the namespaces (setns(2)),
//!   once per daemon count and kept across its runs, as a daemon keeps its data connections.
//!
//! Before its runs each daemon count has one untimed warm-up of each (a batch per pair), so
//! the first timed run does not pay for the daemons' first connections to their peers.
//!
//! Aggregate GB/s counts block bytes over all pairs. All the namespaces share this machine's
//! cores (and the bench's own threads run beside them), so past a few daemons the curve falls
//! with the CPU, not with kvd's design: the ratio to raw TCP on the same cores is the figure
//! to read. Every loop is bounded in count and time.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use kvd::client::Client;
use kvd::keys::{BlockKey, BlockTag, NamespaceId};
use kvd::protocol::TransferState;

use crate::curve::{Curve, Point, Series};
use crate::local::{Crc, buffers, connect, descriptor, kvd_beside, put_batch};
use crate::transfer::{node_key, write_secret};

mod netns;
mod raw;

use netns::*;
use raw::*;

/// Streams per (source, destination) pair: the data connections a daemon opens to a peer.
const STREAMS: usize = transport::tcp::DEFAULT_CONNECTIONS;
/// Every namespace this bench makes starts so (then the pid, then the index or `hub`).
const PREFIX: &str = "kvdmesh-";
/// The data port, the same in every namespace.
const DATA_PORT: u16 = 7461;
/// How often a source polls its pushes.
const POLL: Duration = Duration::from_millis(1);
/// No round of pushes may take longer.
const ROUND_CAP: Duration = Duration::from_secs(120);
/// No raw socket read or write may wait longer; nor a gated thread for its start.
const IO_TIMEOUT: Duration = Duration::from_secs(60);
/// The raw streams' write and read size.
const PIECE: usize = 1 << 20;
/// The raw senders' source buffer (larger than the last-level cache).
const RAW_SOURCE: usize = 256 << 20;
/// The raw receivers' buffer, at least (each stream gets a share of its own, >= 1 MiB).
const RAW_SINK_MIN: usize = 256 << 20;
/// A raw stream thread's stack.
const RAW_STACK: usize = 256 << 10;
/// At most this many daemons (addresses, threads and the raw sink's size).
const MAX_DAEMONS: usize = 32;

/// `kvd-bench mesh` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct MeshArgs {
    /// Daemon counts, comma-separated (2 to 32).
    #[arg(long, value_delimiter = ',', default_values_t = vec![2usize, 4, 8, 16])]
    pub daemons: Vec<usize>,
    /// Block (and page) size in KiB.
    #[arg(long, default_value_t = 2048)]
    pub block_kib: u64,
    /// Blocks per push (one push in flight per pair).
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// MiB one pair moves per run, at most.
    #[arg(long, default_value_t = 256)]
    pub mib_per_pair: u64,
    /// GiB all pairs together move per run, at most (lowers the per-pair figure at large N).
    #[arg(long, default_value_t = 8.0)]
    pub gib_per_run: f64,
    /// Seconds of pushing per run, at most (a run ends with the round that passes it).
    #[arg(long, default_value_t = 5.0)]
    pub seconds: f64,
    /// Runs per daemon count, kvd and raw TCP alternating (median and spread reported).
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// GiB of pool of all daemons together: bounds the blocks per pair of one round.
    #[arg(long, default_value_t = 8.0)]
    pub pool_gib: f64,
    /// The `kvd` binary to start (default: the one beside this binary).
    #[arg(long)]
    pub kvd: Option<PathBuf>,
    /// Write the plot (SVG) and table (Markdown) into this directory.
    #[arg(long)]
    pub plot: Option<std::path::PathBuf>,
    /// Each daemon's `--data-lanes` (ring threads of its TCP engine).
    #[arg(long, default_value_t = kvd::daemon::DEFAULT_DATA_LANES)]
    pub data_lanes: usize,
}

/// What one daemon count's runs do.
#[derive(Debug, Clone, Copy)]
struct Plan {
    n: usize,
    block: usize,
    batch: usize,
    /// Blocks per pair per run, at most.
    per_pair: usize,
    /// Blocks per pair per round, at most.
    round: usize,
    /// Pages of each daemon's pool.
    pool_pages: usize,
    seconds: f64,
    /// Each daemon's ring threads.
    lanes: usize,
}

impl Plan {
    fn new(args: &MeshArgs, n: usize) -> Result<Plan, String> {
        let block = (args.block_kib << 10) as usize;
        let pairs = n * (n - 1);
        let (batch, peers) = (args.batch, n - 1);
        let run_bytes = (args.gib_per_run * (1u64 << 30) as f64) as usize;
        let pair_bytes = ((args.mib_per_pair << 20) as usize).min(run_bytes / pairs);
        let per_pair = (pair_bytes / block / batch).max(1) * batch;
        let budget = (args.pool_gib * (1u64 << 30) as f64) as usize / n / block;
        // a round's own sets and what arrives in it, plus a batch of slack
        let round = (budget.saturating_sub(batch) / (2 * peers) / batch * batch).min(per_pair);
        if round < batch {
            return Err(format!(
                "{n} daemons with batches of {batch} x {} KiB need at least {:.1} GiB of pools; \
                 raise --pool-gib or lower --batch",
                args.block_kib,
                (n * (2 * peers * batch + batch) * block) as f64 / (1u64 << 30) as f64
            ));
        }
        Ok(Plan {
            n,
            block,
            batch,
            per_pair,
            round,
            pool_pages: 2 * peers * round + batch,
            seconds: args.seconds,
            lanes: args.data_lanes,
        })
    }
}

/// Run the benchmark.
pub fn run(args: &MeshArgs) -> Result<(), String> {
    if args.batch == 0 || args.repeat == 0 || args.block_kib == 0 || args.daemons.is_empty() {
        return Err("--batch, --repeat, --block-kib and --daemons need at least one".into());
    }
    if let Some(&n) = args
        .daemons
        .iter()
        .find(|&&n| !(2..=MAX_DAEMONS).contains(&n))
    {
        return Err(format!("--daemons takes 2 to {MAX_DAEMONS}, not {n}"));
    }
    if !rustix::process::geteuid().is_root() {
        return Err("the mesh needs root (network namespaces, veths, a bridge)".into());
    }
    let plans = args
        .daemons
        .iter()
        .map(|&n| Plan::new(args, n))
        .collect::<Result<Vec<_>, _>>()?;
    let kvd = kvd_beside(args.kvd.as_deref())?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let secret = write_secret(dir.path())?;
    let most = args.daemons.iter().copied().max().unwrap_or(2);
    eprintln!("kvd-bench mesh: {most} network namespaces and a bridge");
    let mesh = Mesh::new(most)?;
    let block = (args.block_kib << 10) as usize;
    let src = buffers(block, 8, 1, 64 << 20);
    let crcs: Vec<u32> = src.iter().map(|b| crc32c::crc32c(b)).collect();
    let raw_src: Vec<u8> = (0..RAW_SOURCE)
        .map(|i| (i as u8).wrapping_mul(31) ^ (i >> 12) as u8)
        .collect();
    let mut raw_dst = vec![1u8; RAW_SINK_MIN.max(most * (most - 1) * STREAMS * PIECE)];
    let bench = Bench {
        mesh: &mesh,
        kvd: &kvd,
        secret: &secret,
        repeat: args.repeat,
        src: &src,
        crcs: &crcs,
    };
    let mut rows = Vec::new();
    for plan in &plans {
        let bufs = RawBuffers {
            src: &raw_src,
            dst: &mut raw_dst,
        };
        rows.push(point(&bench, plan, bufs)?);
    }
    drop(mesh);
    report(args, &rows)
}

/// The raw bound's buffers.
struct RawBuffers<'a> {
    src: &'a [u8],
    dst: &'a mut [u8],
}

/// One daemon count's runs.
#[derive(Debug)]
struct Row {
    plan: Plan,
    kvd: Vec<f64>,
    raw: Vec<f64>,
    p50: Vec<f64>,
    p99: Vec<f64>,
    mib_per_pair: Vec<f64>,
    rounds: Vec<usize>,
    pushes: usize,
}

/// What every daemon count's runs share.
struct Bench<'a> {
    mesh: &'a Mesh,
    kvd: &'a Path,
    secret: &'a Path,
    repeat: usize,
    /// The blocks' source buffers and their CRC-32C.
    src: &'a [Vec<u8>],
    crcs: &'a [u32],
}

/// Start the daemons of `plan` and run kvd and raw TCP in turn, `repeat` times each.
fn point(b: &Bench<'_>, plan: &Plan, raw: RawBuffers<'_>) -> Result<Row, String> {
    let (mesh, repeat) = (b.mesh, b.repeat);
    let n = plan.n;
    eprintln!(
        "kvd-bench mesh: {n} daemons, pools of {} MiB each ({:.1} GiB in all), rounds of up to \
         {} blocks per pair, up to {} MiB per pair per run",
        (plan.pool_pages * plan.block) >> 20,
        (n * plan.pool_pages * plan.block) as f64 / (1u64 << 30) as f64,
        plan.round,
        (plan.per_pair * plan.block) >> 20
    );
    let daemons = start_daemons(mesh, b.kvd, b.secret, plan)?;
    let mut nodes = daemons
        .iter()
        .enumerate()
        .map(|(i, d)| Node::new(i, &d.socket, plan.block))
        .collect::<Result<Vec<_>, _>>()?;
    if nodes.iter().any(|nd| nd.keys.ns != nodes[0].keys.ns) {
        return Err("the daemons gave the namespace different ids".into());
    }
    let raw_mesh = RawMesh::connect(mesh, n)?;
    eprintln!("kvd-bench mesh: {n} daemons: warming up (one batch per pair, untimed)");
    let warm = Plan {
        per_pair: plan.batch,
        ..*plan
    };
    kvd_run(&mut nodes, &warm, b.src, b.crcs)?;
    raw_mesh.run(
        (plan.batch * plan.block / STREAMS) as u64,
        raw.src,
        &mut *raw.dst,
    )?;
    let mut row = Row {
        plan: *plan,
        kvd: vec![],
        raw: vec![],
        p50: vec![],
        p99: vec![],
        mib_per_pair: vec![],
        rounds: vec![],
        pushes: 0,
    };
    for r in 0..repeat {
        eprintln!(
            "kvd-bench mesh: {n} daemons, run {} of {repeat}: kvd",
            r + 1
        );
        let k = kvd_run(&mut nodes, plan, b.src, b.crcs)?;
        let per_pair = (k.blocks_per_pair * plan.block) as u64;
        eprintln!("kvd-bench mesh:   raw TCP");
        let raw_gbps = raw_mesh.run(per_pair / STREAMS as u64, raw.src, &mut *raw.dst)?;
        let mut lat = k.lat_ms;
        lat.sort_by(f64::total_cmp);
        let gbps = (per_pair * (n * (n - 1)) as u64) as f64 / 1e9 / k.secs;
        eprintln!(
            "kvd-bench mesh:   kvd {gbps:.2} GB/s, raw TCP {raw_gbps:.2} GB/s, p50 {:.1} ms, \
             p99 {:.1} ms ({} pushes, {} rounds)",
            quantile(&lat, 0.5),
            quantile(&lat, 0.99),
            lat.len(),
            k.rounds
        );
        row.kvd.push(gbps);
        row.raw.push(raw_gbps);
        row.p50.push(quantile(&lat, 0.5));
        row.p99.push(quantile(&lat, 0.99));
        row.mib_per_pair.push(per_pair as f64 / (1 << 20) as f64);
        row.rounds.push(k.rounds);
        row.pushes += lat.len();
    }
    drop(raw_mesh);
    drop(nodes);
    for d in &daemons {
        d.term();
    }
    drop(daemons);
    Ok(row)
}

/// The value at quantile `q` of sorted `v` (NaN when empty).
fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn median(v: &[f64]) -> f64 {
    Point::of_runs(0.0, v).y
}

/// Print the table and the curves.
fn report(args: &MeshArgs, rows: &[Row]) -> Result<(), String> {
    println!();
    println!(
        "{:>7} {:>6} {:>9} {:>7} {:>19} {:>19} {:>8} {:>8} {:>8} {:>7}",
        "daemons",
        "pairs",
        "MiB/pair",
        "rounds",
        "kvd GB/s (spread)",
        "raw TCP (spread)",
        "kvd/raw",
        "p50 ms",
        "p99 ms",
        "pushes"
    );
    for r in rows {
        let (k, w) = (Point::of_runs(0.0, &r.kvd), Point::of_runs(0.0, &r.raw));
        let rounds: Vec<f64> = r.rounds.iter().map(|&x| x as f64).collect();
        println!(
            "{:>7} {:>6} {:>9.0} {:>7.0} {:>7.2} ({:>4.2}..{:<4.2}) {:>7.2} ({:>4.2}..{:<4.2}) \
             {:>8.2} {:>8.1} {:>8.1} {:>7}",
            r.plan.n,
            r.plan.n * (r.plan.n - 1),
            median(&r.mib_per_pair),
            median(&rounds),
            k.y,
            k.lo,
            k.hi,
            w.y,
            w.lo,
            w.hi,
            k.y / w.y,
            median(&r.p50),
            median(&r.p99),
            r.pushes
        );
    }
    println!(
        "\n{} runs per point, kvd and raw TCP alternating; {} KiB blocks, pushes of {} blocks, \
         one in flight per pair, all pairs at once; kvd: each daemon in its own network \
         namespace, bridged; raw TCP: the same namespaces, {STREAMS} streams per pair (a \
         daemon's data connections to a peer), the same bytes per pair, memory to memory. \
         Latency: one push, request to the 1 ms poll that sees it done (median of the runs' \
         p50 and p99). All namespaces share this machine's {} cores with the bench itself: past \
         a few daemons both curves fall with the CPU; kvd/raw is the figure to read.",
        args.repeat,
        args.block_kib,
        args.batch,
        std::thread::available_parallelism().map_or(0, usize::from)
    );
    for (n, gbps) in rows.iter().map(|r| (r.plan.n, r)) {
        println!(
            "{n} daemons: kvd / raw TCP = {:.2}",
            median(&gbps.kvd) / median(&gbps.raw)
        );
    }
    let series = |name: &str, f: &dyn Fn(&Row) -> &Vec<f64>| Series {
        name: name.into(),
        points: rows
            .iter()
            .map(|r| Point::of_runs(r.plan.n as f64, f(r)))
            .collect(),
    };
    let title = format!(
        "kvd-bench mesh: {} KiB blocks pushed all to all, batches of {}",
        args.block_kib, args.batch
    );
    Curve {
        title: format!("{title}: aggregate throughput"),
        x_label: "daemons".into(),
        y_label: "GB/s".into(),
        log_x: false,
        log_y: false,
        series: vec![series("kvd", &|r| &r.kvd), series("raw TCP", &|r| &r.raw)],
    }
    .emit(args.plot.as_deref(), "mesh")?;
    Curve {
        title: format!("{title}: per-transfer latency"),
        x_label: "daemons".into(),
        y_label: "ms".into(),
        log_x: false,
        log_y: false,
        series: vec![series("p50", &|r| &r.p50), series("p99", &|r| &r.p99)],
    }
    .emit(args.plot.as_deref(), "mesh-latency")
}

/// Start `plan.n` daemons, node ids 1..=n, each the others' static peer; wait until all are
/// ready.
fn start_daemons(
    mesh: &Mesh,
    kvd: &Path,
    secret: &Path,
    plan: &Plan,
) -> Result<Vec<NsDaemon>, String> {
    let n = plan.n;
    let bound = (4 * n).clamp(16, 1024).to_string();
    // each node's key beside the secret, made once
    let dir = secret.parent().unwrap_or(Path::new("."));
    let keys = (1..=n as u64)
        .map(|id| node_key(dir, id))
        .collect::<Result<Vec<_>, _>>()?;
    let mut daemons = Vec::with_capacity(n);
    for i in 0..n {
        let mut extra: Vec<String> = vec![
            "--cluster-secret-file".into(),
            secret.to_string_lossy().into_owned(),
            "--node-id".into(),
            (i + 1).to_string(),
            "--node-key-file".into(),
            keys[i].0.to_string_lossy().into_owned(),
            "--data-listen".into(),
            format!("{}:{DATA_PORT}", addr(i)),
            "--transport".into(),
            "tcp".into(),
            "--max-transfers".into(),
            bound.clone(),
            "--max-incoming-transfers".into(),
            bound.clone(),
            "--data-lanes".into(),
            plan.lanes.to_string(),
        ];
        for j in (0..n).filter(|&j| j != i) {
            extra.push("--peer".into());
            extra.push(format!(
                "{}={}:{DATA_PORT},key={}",
                j + 1,
                addr(j),
                keys[j].1
            ));
        }
        daemons.push(NsDaemon::spawn(kvd, &mesh.ns(i), plan, &extra)?);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    for d in &daemons {
        d.wait_ready(deadline)?;
    }
    Ok(daemons)
}

/// Fresh keys of one source daemon: unique across the daemons (the node is in the tag), so
/// no destination ever holds one already.
struct MeshKeys {
    ns: NamespaceId,
    node: u32,
    next: u64,
}

impl MeshKeys {
    fn take(&mut self, n: usize) -> Vec<BlockKey> {
        (0..n)
            .map(|_| {
                self.next += 1;
                let mut tag = [0u8; 32];
                tag[..8].copy_from_slice(&self.next.to_le_bytes());
                tag[8..12].copy_from_slice(&self.node.to_le_bytes());
                tag[12..16].copy_from_slice(&std::process::id().to_le_bytes());
                BlockKey {
                    namespace: self.ns,
                    tag: BlockTag(tag),
                }
            })
            .collect()
    }
}

/// The bench's side of one daemon: its client and its keys.
struct Node {
    client: Client,
    keys: MeshKeys,
    /// Where in the source buffers its next write starts.
    rot: usize,
}

impl Node {
    fn new(i: usize, socket: &Path, block: usize) -> Result<Node, String> {
        let mut client = connect(socket)?;
        let ns = client
            .register_namespace(&descriptor(block))
            .map_err(|e| e.to_string())?;
        Ok(Node {
            client,
            keys: MeshKeys {
                ns,
                node: (i + 1) as u32,
                next: 0,
            },
            rot: i,
        })
    }
}

/// One kvd run's result.
struct KvdRun {
    /// Seconds of pushing (the rounds' push phases).
    secs: f64,
    blocks_per_pair: usize,
    rounds: usize,
    /// Every push's latency, ms.
    lat_ms: Vec<f64>,
}

/// One kvd run: rounds of writing (untimed) and pushing all to all (timed) until the plan's
/// bytes or seconds are reached.
fn kvd_run(
    nodes: &mut [Node],
    plan: &Plan,
    src: &[Vec<u8>],
    crcs: &[u32],
) -> Result<KvdRun, String> {
    for nd in nodes.iter_mut() {
        nd.client.heartbeat().map_err(|e| e.to_string())?;
    }
    let mut run = KvdRun {
        secs: 0.0,
        blocks_per_pair: 0,
        rounds: 0,
        lat_ms: Vec::new(),
    };
    let max_rounds = plan.per_pair.div_ceil(plan.round);
    for _ in 0..max_rounds {
        if run.blocks_per_pair >= plan.per_pair || run.secs >= plan.seconds {
            break;
        }
        let r = plan.round.min(plan.per_pair - run.blocks_per_pair);
        let n = nodes.len();
        let (batch, block) = (plan.batch, plan.block);
        let writes = nodes.iter_mut().enumerate().map(|(i, nd)| {
            Box::new(move || write_sets(nd, i, n, r, batch, src, crcs)) as Task<'_, Sets>
        });
        let (_, sets) = gated(writes, None)?;
        let pushes = nodes.iter_mut().zip(&sets).map(|(nd, s)| {
            Box::new(move || push_round(&mut nd.client, s, batch, block)) as Task<'_, Vec<f64>>
        });
        let (secs, lat) = gated(pushes, None)?;
        run.secs += secs;
        run.lat_ms.extend(lat.into_iter().flatten());
        run.blocks_per_pair += r;
        run.rounds += 1;
    }
    Ok(run)
}

/// One source's sets of one round: (destination node, keys).
type Sets = Vec<(u64, Vec<BlockKey>)>;

/// Write `r` fresh blocks for each other daemon into node `me`'s pool (published).
fn write_sets(
    nd: &mut Node,
    me: usize,
    n: usize,
    r: usize,
    batch: usize,
    src: &[Vec<u8>],
    crcs: &[u32],
) -> Result<Sets, String> {
    let mut out = Vec::with_capacity(n - 1);
    for d in (0..n).filter(|&d| d != me) {
        let mut keys = Vec::with_capacity(r);
        while keys.len() < r {
            let k = nd.keys.take(batch.min(r - keys.len()));
            put_batch(&mut nd.client, &k, src, crcs, nd.rot, Crc::Off)
                .map_err(|e| format!("writing into node {}: {e}", me + 1))?;
            nd.rot = nd.rot.wrapping_add(k.len());
            keys.extend(k);
        }
        out.push(((d + 1) as u64, keys));
    }
    Ok(out)
}

/// A push in flight.
struct Live {
    id: u64,
    set: usize,
    began: Instant,
    blocks: usize,
}

/// Push every set to its destination in batches, one push in flight per destination; each
/// push's latency (ms, request to the poll that saw it done).
fn push_round(c: &mut Client, sets: &Sets, batch: usize, block: usize) -> Result<Vec<f64>, String> {
    let mut next = vec![0usize; sets.len()];
    let mut live: Vec<Live> = Vec::new();
    let mut lat = Vec::new();
    let deadline = Instant::now() + ROUND_CAP;
    let polls = ROUND_CAP.as_millis() as usize / POLL.as_millis().max(1) as usize;
    for _ in 0..polls {
        for (q, (dst, keys)) in sets.iter().enumerate() {
            if next[q] >= keys.len() || live.iter().any(|l| l.set == q) {
                continue;
            }
            let k = &keys[next[q]..(next[q] + batch).min(keys.len())];
            let began = Instant::now();
            match c.push(*dst, k) {
                Ok(id) => live.push(Live {
                    id,
                    set: q,
                    began,
                    blocks: k.len(),
                }),
                // the daemon's bound on pushes in flight: try again after the next poll
                Err(kvd::Error::Overloaded { .. }) => break,
                Err(e) => return Err(format!("push to node {dst}: {e}")),
            }
            next[q] += k.len();
        }
        if live.is_empty() && next.iter().zip(sets).all(|(&i, (_, k))| i >= k.len()) {
            return Ok(lat);
        }
        std::thread::sleep(POLL);
        if live.is_empty() {
            continue;
        }
        let ids: Vec<u64> = live.iter().map(|l| l.id).collect();
        let infos = c.transfers(&ids).map_err(|e| e.to_string())?;
        if infos.len() != ids.len() {
            return Err("a push was forgotten".into());
        }
        for info in infos {
            match info.state {
                TransferState::InFlight => {}
                TransferState::Done => {
                    let at = live
                        .iter()
                        .position(|l| l.id == info.id)
                        .ok_or("unknown push")?;
                    let l = live.swap_remove(at);
                    if info.blocks as usize != l.blocks || info.bytes != (l.blocks * block) as u64 {
                        return Err(format!("{} of {} blocks arrived", info.blocks, l.blocks));
                    }
                    lat.push(l.began.elapsed().as_secs_f64() * 1e3);
                }
                TransferState::Failed(e) => return Err(format!("a push failed: {e:?}")),
            }
        }
        if Instant::now() > deadline {
            break;
        }
    }
    Err(format!(
        "a round of pushes took over {} s",
        ROUND_CAP.as_secs()
    ))
}

/// A task of [`gated`].
type Task<'a, T> = Box<dyn FnOnce() -> Result<T, String> + Send + 'a>;

/// A start line for threads: closed (they wait), then open (go) or aborted.
struct Gate {
    state: Mutex<Option<bool>>,
    cv: Condvar,
}

impl Gate {
    fn open(&self, go: bool) {
        *self.state.lock().unwrap_or_else(|p| p.into_inner()) = Some(go);
        self.cv.notify_all();
    }

    /// Wait (at most [`IO_TIMEOUT`]) for the gate; whether to go.
    fn wait(&self) -> bool {
        let g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let (g, _) = self
            .cv
            .wait_timeout_while(g, IO_TIMEOUT, |s| s.is_none())
            .unwrap_or_else(|p| p.into_inner());
        g.unwrap_or(false)
    }
}

/// Run `tasks` on a thread each, all released at once; the seconds from their release to the
/// end of the last, and their results in order.
fn gated<'a, T: Send + 'a>(
    tasks: impl IntoIterator<Item = Task<'a, T>>,
    stack: Option<usize>,
) -> Result<(f64, Vec<T>), String> {
    let gate = Gate {
        state: Mutex::new(None),
        cv: Condvar::new(),
    };
    std::thread::scope(|sc| {
        let mut hs = Vec::new();
        let mut failed = None;
        for task in tasks {
            let g = &gate;
            let b = match stack {
                Some(s) => std::thread::Builder::new().stack_size(s),
                None => std::thread::Builder::new(),
            };
            let body = move || {
                if g.wait() {
                    task()
                } else {
                    Err("aborted".into())
                }
            };
            match b.spawn_scoped(sc, body) {
                Ok(h) => hs.push(h),
                Err(e) => {
                    failed = Some(format!("starting a thread: {e}"));
                    break;
                }
            }
        }
        gate.open(failed.is_none());
        let t0 = Instant::now();
        let results: Vec<Result<T, String>> = hs
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("a thread panicked".into())))
            .collect();
        let secs = t0.elapsed().as_secs_f64();
        if let Some(e) = failed {
            return Err(e);
        }
        Ok((
            secs,
            results.into_iter().collect::<Result<Vec<T>, String>>()?,
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> MeshArgs {
        MeshArgs {
            daemons: vec![2, 4, 8, 16],
            block_kib: 2048,
            batch: 8,
            mib_per_pair: 256,
            gib_per_run: 8.0,
            seconds: 5.0,
            repeat: 3,
            pool_gib: 8.0,
            kvd: None,
            plot: None,
            data_lanes: 1,
        }
    }

    #[test]
    fn a_plan_keeps_the_pools_within_the_budget_and_rounds_in_whole_batches() {
        for n in [2, 4, 8, 16] {
            let p = Plan::new(&args(), n).unwrap();
            assert!(n * p.pool_pages * p.block <= 8 << 30, "{p:?}");
            assert_eq!(p.round % p.batch, 0, "{p:?}");
            assert_eq!(p.per_pair % p.batch, 0, "{p:?}");
            assert!(p.round >= p.batch && p.round <= p.per_pair, "{p:?}");
            assert!(n * (n - 1) * p.per_pair * p.block <= 8 << 30, "{p:?}");
        }
        let p = Plan::new(&args(), 2).unwrap();
        assert_eq!((p.per_pair, p.round), (128, 128));
    }

    #[test]
    fn a_pool_budget_too_small_for_one_batch_per_pair_is_refused() {
        let a = MeshArgs {
            pool_gib: 1.0,
            ..args()
        };
        let e = Plan::new(&a, 16).unwrap_err();
        assert!(e.contains("--pool-gib"), "{e}");
    }

    #[test]
    fn quantiles_of_sorted_samples() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 51.0);
        assert_eq!(quantile(&v, 0.99), 99.0);
        assert!(quantile(&[], 0.5).is_nan());
    }
}
