//! `kvd-bench transfer`: the TCP transfer backend between two processes on loopback, against
//! the bounds measured in the same run.
//!
//! - **engine**: this process opens an endpoint to a target process (`transfer-target`, this
//!   binary started as a child) and keeps two batches of B ops of one block size in flight,
//!   alternating between two halves of its segment (so no range is reused while a batch that
//!   names it is in flight), until at least `--gib-per-case` GiB moved. Writes push to the
//!   target's granted range, reads pull from it. Checksums off and on (CRC-32C per chunk,
//!   computed by the sender, checked by the receiver), and with `--payload-mac on` also with
//!   the payload MAC (a keyed blake3 of every payload, the connection's own key, beside the
//!   CRC-32C where that is on).
//! - **raw TCP**: as many plain blocking sockets as the engine's connections, one thread per
//!   socket on each side, `write_all` of 1 MiB slices in this process, `read_exact` into the
//!   target's memory in the child: what a plain program does over loopback with the same
//!   resources and no protocol at all. Two kinds, both reported: **cache-hot** (each stream
//!   reuses one 1 MiB buffer on each side) and **memory to memory** (each stream walks its
//!   share of a segment larger than the last-level cache on each side, as blocks do). Ratios
//!   are to the better of the two.
//! - **memcpy**: the better of one large glibc memcpy and kvd's own non-temporal copy (1 GiB),
//!   best of three.
//!
//! CPU per GB is user + system time of both processes (getrusage) over bytes moved, for the
//! engine and for raw TCP alike. Every case runs `--repeat` times; the table gives the median
//! and the spread (min–max). Raw TCP is sampled again before every case and the median of each
//! kind's samples is its bound. Progress goes to stderr, the table to stdout.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use transport::auth::ClusterSecret;
use transport::engine::{HeapMemory, Limits, Memory, Op, OpKind, Transport};
use transport::grant::{Direction, Grant, SegmentId, TransferId};
use transport::link::PeerAddr;
use transport::segment::SegmentDescriptor;
use transport::tcp::{TcpTransport, ZeroCopy};

const SEG: SegmentId = SegmentId(1);
const WRITE_TRANSFER: TransferId = TransferId(1);
const READ_TRANSFER: TransferId = TransferId(2);
const TARGET_NODE: u64 = 2;
const INITIATOR_NODE: u64 = 1;
/// No case runs longer than this, whatever it has moved.
const CASE_CAP: Duration = Duration::from_secs(60);

/// `kvd-bench transfer` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct TransferArgs {
    /// Block sizes in KiB, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = vec![64u64, 256, 1024, 4096])]
    pub block_kib: Vec<u64>,
    /// Ops per batch (two batches are kept in flight).
    #[arg(long, default_value_t = 128)]
    pub batch: usize,
    /// GiB moved per case (at least; a case also stops after 60 s).
    #[arg(long, default_value_t = 1.0)]
    pub gib_per_case: f64,
    /// Times each case runs (median and spread reported).
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Connections per endpoint (the raw TCP bounds use as many streams).
    #[arg(long, default_value_t = transport::tcp::DEFAULT_CONNECTIONS)]
    pub connections: usize,
    /// Ring threads of each engine (initiator and target): an endpoint's connections and
    /// peers' connections are spread over them.
    #[arg(long, default_value_t = transport::tcp::DEFAULT_LANES)]
    pub lanes: usize,
    /// Chunk size in KiB.
    #[arg(long, default_value_t = 1024)]
    pub chunk_kib: u32,
    /// Chunks in flight per connection.
    #[arg(long, default_value_t = 8)]
    pub window: usize,
    /// Zero-copy sends: off, on or auto (auto means off on loopback).
    #[arg(long, default_value = "auto")]
    pub zero_copy: String,
    /// Directions, comma-separated: write, read.
    #[arg(long, value_delimiter = ',', default_values_t = vec!["write".to_string(), "read".to_string()])]
    pub direction: Vec<String>,
    /// Checksum modes, comma-separated: off, on.
    #[arg(long, value_delimiter = ',', default_values_t = vec!["off".to_string(), "on".to_string()])]
    pub checksum: Vec<String>,
    /// Payload MAC modes, comma-separated: off, on (each checksum mode runs with each).
    #[arg(long, value_delimiter = ',', default_values_t = vec!["off".to_string()])]
    pub payload_mac: Vec<String>,
}

/// `kvd-bench transfer-target` arguments (the child process).
#[derive(Debug, Clone, clap::Args)]
pub struct TargetArgs {
    /// The cluster secret file.
    #[arg(long)]
    pub secret_file: PathBuf,
    /// Segment bytes.
    #[arg(long)]
    pub segment_bytes: u64,
    /// Largest chunk accepted, KiB.
    #[arg(long)]
    pub chunk_kib: u32,
    /// Zero-copy sends of read replies: off, on, auto.
    #[arg(long)]
    pub zero_copy: String,
    /// Ring threads.
    #[arg(long, default_value_t = transport::tcp::DEFAULT_LANES)]
    pub lanes: usize,
}

fn zero_copy(s: &str) -> Result<ZeroCopy, String> {
    match s {
        "off" => Ok(ZeroCopy::Off),
        "on" => Ok(ZeroCopy::On),
        "auto" => Ok(ZeroCopy::Auto),
        _ => Err(format!("--zero-copy takes off, on or auto, not {s:?}")),
    }
}

/// User + system CPU seconds of this process so far (all threads).
fn cpu_seconds() -> f64 {
    // SAFETY: rusage is plain old data, and getrusage only writes the struct it is given.
    let u = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut u);
        u
    };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

fn big_limits() -> Limits {
    Limits {
        max_ops_per_endpoint: 1 << 16,
        max_bytes_per_endpoint: 8 << 30,
        max_ops: 1 << 16,
        max_bytes: 8 << 30,
        max_batch_ops: 4096,
        max_batches: 64,
        max_endpoints: 8,
    }
}

/// Touch every page of `mem` (so that no case pays its first faults).
pub(crate) fn fill(mem: &HeapMemory) {
    touch(mem);
}

fn touch(mem: &HeapMemory) {
    // SAFETY: no transfer runs yet.
    let b = unsafe { mem.bytes_mut() };
    for (i, x) in b.iter_mut().enumerate().step_by(512) {
        *x = i as u8 | 1;
    }
}

/// The child: a target engine with one segment granted for writes and for reads, and a raw
/// socket receiver. Commands on stdin: `cpu` (answers `cpu SECONDS`), `raw BYTES STREAMS MODE`
/// (accepts STREAMS raw connections, reads that many bytes over them in all, into memory as
/// MODE says, answers `raw-done`); EOF ends it.
pub fn target(args: &TargetArgs) -> Result<(), String> {
    let secret = ClusterSecret::from_file(&args.secret_file).map_err(|e| e.to_string())?;
    let mut c = transport::link::testing::tcp_config(TARGET_NODE, 1, secret, &[INITIATOR_NODE]);
    c.chunk_bytes = args.chunk_kib << 10;
    c.lanes = args.lanes;
    c.zero_copy = zero_copy(&args.zero_copy)?;
    c.limits = big_limits();
    c.stall_timeout = Duration::from_secs(10);
    let engine = TcpTransport::start(c).map_err(|e| e.to_string())?;
    let mem = Arc::new(HeapMemory::zeroed(args.segment_bytes as usize));
    touch(&mem);
    let reg = engine
        .register(SEG, mem.clone() as Arc<dyn Memory>, 0, args.segment_bytes)
        .map_err(|e| e.to_string())?;
    for (t, d) in [
        (WRITE_TRANSFER, Direction::RemoteWrite),
        (READ_TRANSFER, Direction::RemoteRead),
    ] {
        let g = Grant {
            transfer: t,
            epoch: 1,
            segment: SEG,
            offset: 0,
            len: args.segment_bytes,
            direction: d,
            expires_at_ms: engine.now_ms() + 3_600_000,
            peer: None,
        };
        // SAFETY: this process never touches the segment while the engine runs (the raw
        // receiver below writes it only between engine cases, which the parent serialises).
        unsafe { engine.grant(g).map_err(|e| e.to_string())? };
    }
    let raw = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let d = transport::engine::Registration::descriptor(&reg).encode();
    let hex: String = d.iter().map(|b| format!("{b:02x}")).collect();
    println!(
        "ready {} {} {hex}",
        engine.local_addr().port(),
        raw.local_addr().map_err(|e| e.to_string())?.port()
    );
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|e| e.to_string())?;
        let mut words = line.split_whitespace();
        match (words.next(), words.next()) {
            (Some("cpu"), _) => println!("cpu {}", cpu_seconds()),
            (Some("raw"), Some(n)) => {
                let total: u64 = n
                    .parse()
                    .map_err(|_| format!("raw takes a byte count: {n}"))?;
                let streams: usize = words.next().and_then(|w| w.parse().ok()).unwrap_or(1);
                let mode = RawMode::parse(words.next().unwrap_or("mem"))?;
                // SAFETY: the engine is idle between cases (the parent runs raw cases alone).
                let dst = unsafe { mem.bytes_mut() };
                raw_receive(&raw, dst, total, streams, mode)?;
                println!("raw-done");
            }
            _ => return Err(format!("unknown command {line:?}")),
        }
        std::io::stdout().flush().map_err(|e| e.to_string())?;
    }
    Ok(())
}

struct Child_ {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Child_ {
    fn ask(&mut self, line: &str) -> Result<String, String> {
        writeln!(self.stdin, "{line}").map_err(|e| e.to_string())?;
        let mut answer = String::new();
        self.stdout
            .read_line(&mut answer)
            .map_err(|e| e.to_string())?;
        if answer.is_empty() {
            return Err("the target process exited; see its error above".into());
        }
        Ok(answer.trim().to_string())
    }

    fn cpu(&mut self) -> Result<f64, String> {
        let a = self.ask("cpu")?;
        a.strip_prefix("cpu ")
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("unexpected answer {a:?}"))
    }
}

impl Drop for Child_ {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One measurement: GB/s and CPU seconds per GB (both processes).
#[derive(Debug, Clone, Copy)]
struct Sample {
    gbps: f64,
    cpu_per_gb: f64,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[derive(Debug)]
struct Row {
    case: String,
    samples: Vec<Sample>,
}

impl Row {
    fn gbps(&self) -> f64 {
        median(&mut self.samples.iter().map(|s| s.gbps).collect::<Vec<_>>())
    }
    fn cpu(&self) -> f64 {
        median(
            &mut self
                .samples
                .iter()
                .map(|s| s.cpu_per_gb)
                .collect::<Vec<_>>(),
        )
    }
    fn spread(&self) -> (f64, f64) {
        let g = self.samples.iter().map(|s| s.gbps);
        (g.clone().fold(f64::MAX, f64::min), g.fold(0.0, f64::max))
    }
}

/// The two raw TCP bounds, sampled side by side before the first case and between cases.
struct Bounds {
    hot: Row,
    mem: Row,
    streams: usize,
}

impl Bounds {
    fn new(streams: usize) -> Bounds {
        let row = |m: RawMode| Row {
            case: format!("raw TCP, {streams} streams, {}", m.label()),
            samples: vec![],
        };
        Bounds {
            hot: row(RawMode::CacheHot),
            mem: row(RawMode::MemoryToMemory),
            streams,
        }
    }

    /// One sample of each, memory to memory first.
    fn sample(&mut self, t: &mut Target, mem: &HeapMemory, total: u64) -> Result<(), String> {
        for (row, mode) in [
            (&mut self.mem, RawMode::MemoryToMemory),
            (&mut self.hot, RawMode::CacheHot),
        ] {
            let s = raw_tcp(&mut t.child, &t.raw_addr, mem, total, self.streams, mode)?;
            row.samples.push(s);
        }
        Ok(())
    }

    /// The better of the two (by median GB/s): what every ratio is to.
    fn best(&self) -> &Row {
        if self.hot.gbps() >= self.mem.gbps() {
            &self.hot
        } else {
            &self.mem
        }
    }
}

/// The initiator's engine for one checksum and payload MAC mode, with `mem` registered, and
/// its endpoint to the target (the MAC is on for the connection when this end asks for it).
fn initiator(
    args: &TransferArgs,
    secret: &ClusterSecret,
    (checksum, payload_mac): (bool, bool),
    mem: &Arc<HeapMemory>,
    target: &Target,
) -> Result<(TcpTransport, transport::engine::EndpointId), String> {
    let mut c =
        transport::link::testing::tcp_config(INITIATOR_NODE, 1, secret.clone(), &[TARGET_NODE]);
    c.payload_mac = payload_mac;
    c.connections = args.connections;
    c.lanes = args.lanes;
    c.chunk_bytes = args.chunk_kib << 10;
    c.window = args.window;
    c.checksum = checksum;
    c.zero_copy = zero_copy(&args.zero_copy)?;
    c.limits = big_limits();
    c.stall_timeout = Duration::from_secs(10);
    let engine = TcpTransport::start(c).map_err(|e| e.to_string())?;
    engine
        .register(SEG, mem.clone() as Arc<dyn Memory>, 0, mem.len() as u64)
        .map_err(|e| e.to_string())?;
    let ep = engine
        .open(&PeerAddr {
            addr: target.data_addr,
            node_id: TARGET_NODE,
        })
        .map_err(|e| e.to_string())?;
    Ok((engine, ep))
}

/// The smallest segment on each side: large enough that the memory-to-memory bound's streams
/// each walk more than the last-level cache.
const MIN_SEGMENT: u64 = 512 << 20;

/// Run the benchmark.
pub fn run(args: &TransferArgs) -> Result<(), String> {
    if args.batch == 0 || args.repeat == 0 || args.block_kib.is_empty() || args.connections == 0 {
        return Err("--batch, --repeat, --connections and --block-kib need at least one".into());
    }
    zero_copy(&args.zero_copy)?;
    let largest = args.block_kib.iter().max().copied().unwrap_or(1024) << 10;
    // two halves, each one batch of the largest block
    let segment = (2 * args.batch as u64 * largest).max(MIN_SEGMENT);
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let secret_path = write_secret(dir.path())?;
    let secret = ClusterSecret::from_file(&secret_path).map_err(|e| e.to_string())?;
    eprintln!(
        "kvd-bench transfer: starting the target process ({} MiB segment on each side)",
        segment >> 20
    );
    let mut target = Target::spawn(
        &secret_path,
        segment,
        args.chunk_kib,
        &args.zero_copy,
        args.lanes,
    )?;
    let mem = Arc::new(HeapMemory::zeroed(segment as usize));
    touch(&mem);
    let total = (args.gib_per_case * (1u64 << 30) as f64) as u64;
    eprintln!("kvd-bench transfer: memcpy bound (1 GiB, best of 3)");
    let memcpy = crate::local::memcpy_bound(1 << 30);
    // The raw bounds are sampled before the first case and again before every case, and each
    // bound is the median of its samples: loopback throughput drifts with what else the two
    // cores do, and interleaving spreads that drift over both sides of the ratio.
    let mut bounds = Bounds::new(args.connections);
    for i in 0..args.repeat {
        eprintln!("kvd-bench transfer: raw TCP {} of {}", i + 1, args.repeat);
        bounds.sample(&mut target, &mem, total)?;
    }
    let mut rows: Vec<Row> = Vec::new();
    let on_off = |flag: &str, v: &str| match v {
        "off" => Ok(false),
        "on" => Ok(true),
        _ => Err(format!("--{flag} takes off or on, not {v:?}")),
    };
    let modes: Vec<(&String, &String)> = args
        .payload_mac
        .iter()
        .flat_map(|m| args.checksum.iter().map(move |ck| (ck, m)))
        .collect();
    for (ck, mac) in modes {
        let mode = (on_off("checksum", ck)?, on_off("payload-mac", mac)?);
        let (engine, ep) = initiator(args, &secret, mode, &mem, &target)?;
        for d in &args.direction {
            let kind = match d.as_str() {
                "write" => OpKind::Write,
                "read" => OpKind::Read,
                _ => return Err(format!("--direction takes write or read, not {d:?}")),
            };
            for &kib in &args.block_kib {
                eprintln!("kvd-bench transfer: raw TCP (samples between cases)");
                bounds.sample(&mut target, &mem, total)?;
                let mac_label = if mode.1 { ", MAC on" } else { "" };
                let mut row = Row {
                    case: format!("{d:<5} {kib:>5} KiB blocks, checksum {ck}{mac_label}"),
                    samples: vec![],
                };
                for i in 0..args.repeat {
                    eprintln!(
                        "kvd-bench transfer: {} ({} of {})",
                        row.case,
                        i + 1,
                        args.repeat
                    );
                    let case = Case {
                        kind,
                        block: kib << 10,
                        batch: args.batch,
                        total,
                    };
                    row.samples
                        .push(engine_case(&engine, ep, &mut target, case)?);
                }
                rows.push(row);
            }
        }
    }
    print_table(args, memcpy, &bounds, &rows);
    Ok(())
}

fn print_table(args: &TransferArgs, memcpy: f64, bounds: &Bounds, rows: &[Row]) {
    let best = bounds.best();
    let (raw_gbps, raw_cpu) = (best.gbps(), best.cpu());
    println!();
    println!(
        "{:<44} {:>7} {:>13} {:>7} {:>7} {:>8} {:>7}",
        "case", "GB/s", "spread", "xTCP", "xmemcpy", "CPU s/GB", "CPU/TCP"
    );
    let print = |r: &Row| {
        let (lo, hi) = r.spread();
        println!(
            "{:<44} {:>7.2} {:>5.2}..{:<6.2} {:>7.2} {:>7.2} {:>8.3} {:>7.2}",
            r.case,
            r.gbps(),
            lo,
            hi,
            r.gbps() / raw_gbps,
            r.gbps() / memcpy,
            r.cpu(),
            r.cpu() / raw_cpu
        );
    };
    println!("{:<44} {:>7.2}", "memcpy, 1 GiB (best of 3)", memcpy);
    print(&bounds.mem);
    print(&bounds.hot);
    for r in rows {
        print(r);
    }
    println!(
        "\n{} runs per case, >= {:.2} GiB each; batches of {}, two in flight; {} connections over {} ring threads per engine, {} KiB chunks, window {}, zero-copy {}.",
        args.repeat,
        args.gib_per_case,
        args.batch,
        args.connections,
        args.lanes,
        args.chunk_kib,
        args.window,
        args.zero_copy
    );
    println!(
        "raw TCP: {} streams (as many as kvd's connections), 1 MiB writes, one thread per stream on \
         each side; the median of {} samples of each kind taken before and between the cases. \
         Ratios (xTCP, CPU/TCP) are to the better of the two: {}.",
        bounds.streams,
        bounds.mem.samples.len(),
        best.case
    );
}

/// A fresh 32-byte cluster secret file (mode 0600) in `dir`.
pub(crate) fn write_secret(dir: &std::path::Path) -> Result<PathBuf, String> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join("secret");
    let mut f = std::fs::OpenOptions::new()
        .create_new(true)
        .write(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| e.to_string())?;
    let mut bytes = [0u8; 32];
    rustix::rand::getrandom(&mut bytes, rustix::rand::GetRandomFlags::empty())
        .map_err(|e| e.to_string())?;
    f.write_all(&bytes).map_err(|e| e.to_string())?;
    Ok(path)
}

/// Node `node`'s key file in `dir` (made there, mode 0600, if there is none) and its public
/// key: what a daemon a bench starts proves its id with, and its peers list.
pub(crate) fn node_key(dir: &std::path::Path, node: u64) -> Result<(PathBuf, String), String> {
    let path = dir.join(format!("node{node}.key"));
    let (key, _) =
        transport::link::identity::NodeKey::open(&path, true).map_err(|e| e.to_string())?;
    Ok((path, key.public().to_string()))
}

/// The target process (`kvd-bench transfer-target`), its data and raw TCP addresses and its
/// segment.
pub(crate) struct Target {
    child: Child_,
    data_addr: std::net::SocketAddr,
    raw_addr: String,
    remote: SegmentDescriptor,
}

impl Target {
    pub(crate) fn spawn(
        secret_path: &std::path::Path,
        segment: u64,
        chunk_kib: u32,
        zero_copy: &str,
        lanes: usize,
    ) -> Result<Target, String> {
        let me = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut child = Command::new(me)
            .args(["transfer-target", "--secret-file"])
            .arg(secret_path)
            .args(["--segment-bytes", &segment.to_string()])
            .args(["--chunk-kib", &chunk_kib.to_string()])
            .args(["--zero-copy", zero_copy])
            .args(["--lanes", &lanes.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("start the target process: {e}"))?;
        let mut child = Child_ {
            stdin: child.stdin.take().expect("piped"),
            stdout: BufReader::new(child.stdout.take().expect("piped")),
            child,
        };
        let mut ready = String::new();
        child
            .stdout
            .read_line(&mut ready)
            .map_err(|e| e.to_string())?;
        let w: Vec<&str> = ready.split_whitespace().collect();
        let [_, data_port, raw_port, hex] = w[..] else {
            return Err(format!("the target process did not start: {ready:?}"));
        };
        let bytes: Vec<u8> = (0..hex.len() / 2)
            .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap_or(0))
            .collect();
        Ok(Target {
            child,
            data_addr: format!("127.0.0.1:{data_port}")
                .parse()
                .map_err(|e| format!("{e}"))?,
            raw_addr: format!("127.0.0.1:{raw_port}"),
            remote: SegmentDescriptor::decode(&bytes).map_err(|e| e.to_string())?,
        })
    }

    /// One raw loopback TCP sample of `total` bytes from `mem` over `streams` connections, in
    /// `mode`: (GB/s, CPU seconds per GB of both processes).
    pub(crate) fn raw_sample(
        &mut self,
        mem: &HeapMemory,
        total: u64,
        streams: usize,
        mode: RawMode,
    ) -> Result<(f64, f64), String> {
        let s = raw_tcp(&mut self.child, &self.raw_addr, mem, total, streams, mode)?;
        Ok((s.gbps, s.cpu_per_gb))
    }
}

/// Where the raw TCP bound's bytes come from and go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RawMode {
    /// Each stream sends from and receives into one 1 MiB buffer of its own, again and again:
    /// the buffers stay in the caches, the best a plain program does when the copy into and
    /// out of the socket is all it pays.
    CacheHot,
    /// Each stream walks its own share of a segment larger than the last-level cache (on
    /// both sides), as kvd's blocks do: every byte comes from memory and goes to memory.
    MemoryToMemory,
}

impl RawMode {
    fn parse(s: &str) -> Result<RawMode, String> {
        match s {
            "hot" => Ok(RawMode::CacheHot),
            "mem" => Ok(RawMode::MemoryToMemory),
            _ => Err(format!("raw mode takes hot or mem, not {s:?}")),
        }
    }
    fn word(self) -> &'static str {
        match self {
            RawMode::CacheHot => "hot",
            RawMode::MemoryToMemory => "mem",
        }
    }
    /// Its name in a table.
    pub(crate) fn label(self) -> &'static str {
        match self {
            RawMode::CacheHot => "cache-hot",
            RawMode::MemoryToMemory => "memory to memory",
        }
    }
}

/// The range stream `i` of `streams` uses for piece number `k` (1 MiB pieces): its own share
/// of `len` bytes, walked piece by piece (memory to memory) or always its first piece
/// (cache-hot).
fn raw_piece(len: usize, streams: usize, i: usize, k: u64, mode: RawMode) -> usize {
    let share = len / streams;
    let pieces = (share >> 20).max(1) as u64;
    let at = match mode {
        RawMode::CacheHot => 0,
        RawMode::MemoryToMemory => ((k % pieces) << 20) as usize,
    };
    i * share + at.min(share.saturating_sub(1 << 20))
}

/// The bytes stream `i` of `streams` carries of `total`.
fn raw_share(total: u64, streams: usize, i: usize) -> u64 {
    total / streams as u64 + u64::from((i as u64) < total % streams as u64)
}

/// The target's half of a raw sample: accept `streams` connections and read `total` bytes
/// over them into `dst`, one thread per stream.
fn raw_receive(
    l: &TcpListener,
    dst: &mut [u8],
    total: u64,
    streams: usize,
    mode: RawMode,
) -> Result<(), String> {
    if streams == 0 || dst.len() < streams << 20 {
        return Err(format!("raw: {streams} streams do not fit the segment"));
    }
    let len = dst.len();
    let conns = (0..streams)
        .map(|_| l.accept().map(|(s, _)| s).map_err(|e| e.to_string()))
        .collect::<Result<Vec<_>, _>>()?;
    let base = dst.as_mut_ptr() as usize;
    per_stream(conns, total, len, mode, "reader", |c, at, n| {
        // SAFETY: stream i only touches its own share of the segment (`raw_piece` stays inside
        // it), so the threads' ranges are disjoint, and nothing else uses the segment while a
        // raw sample runs.
        let d = unsafe { std::slice::from_raw_parts_mut((base + at) as *mut u8, n) };
        c.read_exact(d)
    })
}

/// Move each stream's share of `total` bytes, one thread per stream, in pieces of up to 1 MiB
/// at the offsets `raw_piece` gives in a region of `len` bytes: `io(stream, offset, bytes)`
/// sends or receives one piece.
fn per_stream(
    conns: Vec<TcpStream>,
    total: u64,
    len: usize,
    mode: RawMode,
    what: &str,
    io: impl Fn(&mut TcpStream, usize, usize) -> std::io::Result<()> + Sync,
) -> Result<(), String> {
    let streams = conns.len();
    let io = &io;
    std::thread::scope(|sc| {
        let hs: Vec<_> = conns
            .into_iter()
            .enumerate()
            .map(|(i, mut c)| {
                sc.spawn(move || -> Result<(), String> {
                    let want = raw_share(total, streams, i);
                    let (mut moved, mut k) = (0u64, 0u64);
                    while moved < want {
                        let at = raw_piece(len, streams, i, k, mode);
                        let n = ((want - moved) as usize).min(1 << 20);
                        io(&mut c, at, n).map_err(|e| e.to_string())?;
                        moved += n as u64;
                        k += 1;
                    }
                    Ok(())
                })
            })
            .collect();
        hs.into_iter().try_for_each(|h| {
            h.join()
                .unwrap_or_else(|_| Err(format!("a raw {what} panicked")))
        })
    })
}

/// One raw loopback TCP sample: `total` bytes from `mem` over `streams` connections (one
/// thread each, 1 MiB writes), into the target's segment; GB/s and CPU seconds per GB of both
/// processes.
fn raw_tcp(
    child: &mut Child_,
    addr: &str,
    mem: &HeapMemory,
    total: u64,
    streams: usize,
    mode: RawMode,
) -> Result<Sample, String> {
    let cpu0 = cpu_seconds() + child.cpu()?;
    writeln!(child.stdin, "raw {total} {streams} {}", mode.word()).map_err(|e| e.to_string())?;
    // SAFETY: no engine batch is in flight while the raw case runs.
    let src = unsafe { mem.bytes() };
    if streams == 0 || src.len() < streams << 20 {
        return Err(format!("raw: {streams} streams do not fit the segment"));
    }
    let conns = (0..streams)
        .map(|_| TcpStream::connect(addr).map_err(|e| e.to_string()))
        .collect::<Result<Vec<_>, _>>()?;
    let t = Instant::now();
    per_stream(conns, total, src.len(), mode, "sender", |c, at, n| {
        c.write_all(&src[at..at + n])
    })?;
    let mut done = String::new();
    child
        .stdout
        .read_line(&mut done)
        .map_err(|e| e.to_string())?;
    if done.trim() != "raw-done" {
        return Err(format!("raw receiver: {done:?}"));
    }
    let secs = t.elapsed().as_secs_f64();
    let cpu = cpu_seconds() + child.cpu()? - cpu0;
    let gb = total as f64 / 1e9;
    Ok(Sample {
        gbps: gb / secs,
        cpu_per_gb: cpu / gb,
    })
}

/// One engine case: what moves and how much.
#[derive(Debug, Clone, Copy)]
struct Case {
    kind: OpKind,
    block: u64,
    batch: usize,
    total: u64,
}

fn engine_case(
    engine: &TcpTransport,
    ep: transport::engine::EndpointId,
    target: &mut Target,
    Case {
        kind,
        block,
        batch,
        total,
    }: Case,
) -> Result<Sample, String> {
    let (child, remote) = (&mut target.child, target.remote);
    let half = batch as u64 * block;
    let transfer = match kind {
        OpKind::Write => WRITE_TRANSFER,
        OpKind::Read => READ_TRANSFER,
    };
    let make = |h: u64| -> Vec<Op> {
        (0..batch as u64)
            .map(|i| Op {
                kind,
                local: SEG,
                local_offset: h * half + i * block,
                remote,
                remote_offset: h * half + i * block,
                len: block,
                transfer,
                epoch: 1,
            })
            .collect()
    };
    let halves = [make(0), make(1)];
    // wait for a batch, check it moved everything, let it go
    let finish = |b| -> Result<(), String> {
        let s = engine
            .wait(b, Duration::from_secs(30))
            .map_err(|e| e.to_string())?;
        if !s.succeeded() {
            return Err(format!("a batch failed: {s:?}"));
        }
        engine.release(b).map_err(|e| e.to_string())
    };
    let cpu0 = cpu_seconds() + child.cpu()?;
    let t = Instant::now();
    let mut moved = 0u64;
    let mut in_flight = std::collections::VecDeque::new();
    let mut next = 0usize;
    while moved < total && t.elapsed() < CASE_CAP {
        while in_flight.len() < 2 {
            // SAFETY: a half's ranges are named by at most one batch in flight at a time, and
            // nothing else touches the memory while the case runs.
            let b = unsafe { engine.submit(ep, &halves[next % 2]) }.map_err(|e| e.to_string())?;
            in_flight.push_back(b);
            next += 1;
        }
        let b = in_flight.pop_front().expect("two in flight");
        finish(b)?;
        moved += half;
    }
    for b in in_flight {
        finish(b)?;
        moved += half;
    }
    let secs = t.elapsed().as_secs_f64();
    let cpu = cpu_seconds() + child.cpu()? - cpu0;
    let gb = moved as f64 / 1e9;
    Ok(Sample {
        gbps: gb / secs,
        cpu_per_gb: cpu / gb,
    })
}
