//! The `rdma` backend (feature `rdma`): the transfer interface over RC queue pairs, one-sided
//! RDMA WRITE and READ, written over the small [`verbs::Verbs`] layer (real calls through
//! sideway in [`sideway`]; a double of the fabric for tests).
//!
//! ```text
//!  initiator                                        target
//!  open(peer): side channel (TCP, authenticated, purpose Rdma) ──▶ serve_side()
//!              create QP ─ Connect ──────────────────────────────▶ create QP, RTR/RTS
//!              RTR/RTS ◀──────────────────────────── Connected ─┘
//!  submit(ops): Resolve(ranges of the batch) ────────────────────▶ each checked against a live
//!                                                                   grant (Target::begin), the
//!                                                                   range registered alone
//!               ◀──────────────────────────────── Keys(addr, rkey)
//!               chunks → work requests → send queue (bounded) → doorbells (one post each)
//!  progress thread: poll the CQ, account chunks, refill the send queue, stall and expiry checks
//!  revoke(transfer): grants dropped, then the transfer's regions deregistered (rkeys dead)
//! ```
//!
//! **Grants.** A peer gets an rkey only for the exact range of one access it asks for, and only
//! while a grant of its transfer covers it: a per-access registration (`ibv_reg_mr` of that
//! range with only the remote right the grant gives), deregistered when the grant ends (revoke,
//! or expiry found by the progress thread). Not memory windows: type-2 windows are bound by a
//! work request on the target's own queue pair and not every provider has them (rxe, siw,
//! older ConnectX), while a registration works everywhere; the cost is one `ibv_reg_mr` per
//! block (tens of µs for pinned pages, against milliseconds of transfer). An initiator's own
//! segments are registered with local access only, in chunks of at most
//! [`RdmaConfig::mr_chunk_bytes`] (and the device's largest region).
//!
//! **The grant table is shared** with the node's TCP engine ([`crate::tcp::TcpTransport::target`]):
//! one `grant` serves whichever backend the peer moves the bytes with, and segments the TCP
//! engine registered are only given local regions here.
//!
//! **Failure.** A work request that completes in error (a dead rkey, no acknowledgement, our
//! own fault) fails its op with the reason and takes the queue pair to the error state, so
//! what follows completes flushed and fails too; waiting work requests fail at once. The next
//! submit on the endpoint rebuilds it (a new queue pair over the same side channel, at most
//! [`RdmaConfig::rebuilds`] times). No completion for [`RdmaConfig::stall_timeout`] with work
//! posted fails the endpoint the same way; if the flushes do not come within another stall
//! timeout the queue pair is destroyed (the NIC lets go of its memory) and the rest fail.
//! Chunks are not checksummed on the wire (the NIC's ICRC covers the link); the daemon checks
//! each block's CRC-32C at commit.

pub mod device;
#[cfg(test)]
mod fabric_double;
pub mod qp;
pub mod sideway;
#[cfg(test)]
mod tests;
pub mod verbs;
pub mod wire;

mod gpu;
mod initiator;
mod target;

pub use self::gpu::DeviceMemory;
#[cfg(feature = "cuda")]
pub use self::gpu::GpuPath;

use self::target::RemoteRegions;

use crate::channel::Channel;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use self::qp::{SendQueue, Slot};
use self::verbs::{MrAccess, Verbs, WorkRequest, WrKind};
use self::wire::Message;
use crate::engine::batches::{Batches, ChunkOutcome};
use crate::engine::{
    BatchId, BatchStatus, EndpointId, Limits, Memory, Op, OpFailure, OpKind, OpStatus,
    Registration, Revoked, Target, Transport, chunk,
};
use crate::error::{Error, Result};
use crate::grant::{Grant, SegmentId, TransferId};
use crate::link::PeerAddr;
use crate::link::wire::Bind;
use crate::segment::SegmentDescriptor;

/// The refusal code a key request gets when the target could not register the range (out of
/// regions, or the device refused): retry later.
pub const REFUSED_NO_KEYS: u8 = 8;
/// The refusal code of an op whose rkey the target revoked while it ran (remote access error).
pub const REFUSED_REVOKED: u8 = 9;

/// How an RDMA engine runs.
#[derive(Debug, Clone)]
pub struct RdmaConfig {
    /// Largest work request, in bytes (an op is cut into chunks of this).
    pub chunk_bytes: u32,
    /// Work requests posted per queue pair at most.
    pub send_depth: u32,
    /// Work requests per doorbell (one `ibv_post_send`) at most.
    pub doorbell_batch: usize,
    /// Largest local registration of a segment (capped by the device's).
    pub mr_chunk_bytes: u64,
    /// Remote-accessible regions live at once (past it, key requests are refused with
    /// [`REFUSED_NO_KEYS`]).
    pub max_remote_regions: usize,
    /// Side connections served at once.
    pub max_side_connections: usize,
    /// No completion for this long with work posted fails the endpoint.
    pub stall_timeout: Duration,
    /// A side-channel round trip (connect, resolve) at most.
    pub side_timeout: Duration,
    /// Times an endpoint is rebuilt after failures before it must be reopened.
    pub rebuilds: u32,
    /// Bounds on work in flight.
    pub limits: Limits,
}

impl Default for RdmaConfig {
    fn default() -> RdmaConfig {
        RdmaConfig {
            chunk_bytes: 4 << 20,
            send_depth: 256,
            doorbell_batch: 32,
            mr_chunk_bytes: 1 << 30,
            max_remote_regions: 4096,
            max_side_connections: 64,
            stall_timeout: Duration::from_secs(5),
            side_timeout: Duration::from_secs(2),
            rebuilds: 3,
            limits: Limits::default(),
        }
    }
}

impl RdmaConfig {
    fn check(&self) -> Result<()> {
        let bad = |what: &str| Err(Error::InvalidArgument(what.to_string()));
        if self.chunk_bytes < 4096 || self.chunk_bytes > (1 << 30) {
            return bad("RDMA chunk bytes: 4 KiB to 1 GiB");
        }
        if self.send_depth == 0 || self.send_depth > 16_384 {
            return bad("RDMA send queue depth: 1 to 16384");
        }
        if self.doorbell_batch == 0 || self.doorbell_batch > 1024 {
            return bad("work requests per doorbell: 1 to 1024");
        }
        if self.mr_chunk_bytes < (1 << 20) {
            return bad("RDMA registration chunk: at least 1 MiB");
        }
        if self.max_remote_regions == 0 || self.max_side_connections == 0 {
            return bad("remote regions and side connections: at least 1");
        }
        if self.stall_timeout < Duration::from_millis(10) {
            return bad("stall timeout: at least 10 ms");
        }
        Ok(())
    }
}

/// How an [`RdmaTransport::open`] error begins when the peer has no RDMA engine (it took the
/// authenticated side connection and closed it at once: built without RDMA, or no device).
/// See [`peer_lacks_rdma`].
pub const NO_RDMA: &str = "the peer serves no RDMA";

/// Whether an [`RdmaTransport::open`] error means the peer has no RDMA engine, so that its
/// blocks should go over TCP (rather than a failure to report).
pub fn peer_lacks_rdma(e: &Error) -> bool {
    matches!(e, Error::PeerUnavailable(m) if m.starts_with(NO_RDMA))
}

/// Opens an authenticated side connection to a peer (the TCP engine's handshake).
pub type SideOpener = crate::link::Opener;

/// One work request of an op: local address, bytes, lkey, and the region that must outlive it.
type Piece<M> = (u64, u32, u32, Arc<M>);

/// A segment's local regions, in address order, with their lkeys.
type Regions<M> = Vec<(Arc<M>, u32)>;

/// A segment registered with the RDMA backend.
#[derive(Debug)]
pub struct RdmaRegistration {
    descriptor: SegmentDescriptor,
}

impl Registration for RdmaRegistration {
    fn descriptor(&self) -> SegmentDescriptor {
        self.descriptor
    }
}

/// Counters of one engine (monotonic, but for `remote_regions`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RdmaStats {
    /// Doorbells rung (posts).
    pub doorbells: u64,
    /// Work requests posted.
    pub work_requests: u64,
    /// Work requests completed ok.
    pub completions_ok: u64,
    /// Work requests completed in error (flushed ones included).
    pub completions_failed: u64,
    /// Payload bytes moved as initiator.
    pub bytes_done: u64,
    /// Endpoints failed (error completion, stall, failed post).
    pub endpoints_failed: u64,
    /// Endpoints rebuilt.
    pub rebuilds: u64,
    /// Keys given to peers.
    pub keys_granted: u64,
    /// Key requests refused (no grant, stale generation, out of regions).
    pub keys_refused: u64,
    /// Remote-accessible regions live now.
    pub remote_regions: u64,
}

#[derive(Debug, Default)]
struct Counters {
    doorbells: AtomicU64,
    work_requests: AtomicU64,
    completions_ok: AtomicU64,
    completions_failed: AtomicU64,
    bytes_done: AtomicU64,
    endpoints_failed: AtomicU64,
    rebuilds: AtomicU64,
    keys_granted: AtomicU64,
    keys_refused: AtomicU64,
}

fn bump(a: &AtomicU64, n: u64) {
    a.fetch_add(n, Ordering::Relaxed);
}

/// A segment's local regions.
#[derive(Debug)]
struct LocalSegment<M> {
    addr: u64,
    len: u64,
    chunk: u64,
    regions: Regions<M>,
    owned: bool,
    /// Device memory: only the NIC reaches it (no CPU mapping, not in the grant table).
    device: bool,
}

impl<M> LocalSegment<M> {
    /// The region holding `addr` and where it ends.
    fn region_at(&self, addr: u64) -> Option<(&Arc<M>, u32, u64)> {
        let i = addr.checked_sub(self.addr)? / self.chunk;
        let end = (self.addr + (i + 1) * self.chunk).min(self.addr + self.len);
        self.regions
            .get(i as usize)
            .map(|(m, lkey)| (m, *lkey, end))
    }
}

struct EndpointIo<V: Verbs> {
    qp: Option<V::Qp>,
    sq: SendQueue<V::Mr>,
    failed: Option<(String, OpFailure)>,
    failed_at: Option<Instant>,
    rebuilds: u32,
    closed: bool,
}

struct Endpoint<V: Verbs> {
    node_id: u64,
    side: Mutex<Channel>,
    io: Mutex<EndpointIo<V>>,
}

impl<V: Verbs> std::fmt::Debug for Endpoint<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("node_id", &self.node_id)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

struct Shared<V: Verbs> {
    verbs: V,
    config: RdmaConfig,
    target: Arc<Target>,
    open_side: SideOpener,
    cq: V::Cq,
    batches: Mutex<Batches>,
    settled: Condvar,
    endpoints: Mutex<HashMap<EndpointId, Arc<Endpoint<V>>>>,
    next_endpoint: AtomicU64,
    locals: Mutex<HashMap<SegmentId, LocalSegment<V::Mr>>>,
    remote: Mutex<RemoteRegions<V::Mr>>,
    side_connections: AtomicUsize,
    counters: Counters,
    stop: AtomicBool,
}

impl<V: Verbs> std::fmt::Debug for Shared<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("device", self.verbs.device())
            .finish_non_exhaustive()
    }
}

/// The RDMA backend over verbs `V`. Dropping it stops its progress thread and destroys its
/// queue pairs (the NIC lets go of every buffer).
#[derive(Debug)]
pub struct RdmaTransport<V: Verbs> {
    shared: Arc<Shared<V>>,
    progress: Option<JoinHandle<()>>,
}

impl<V: Verbs> RdmaTransport<V> {
    /// Start an engine on an opened device, sharing `target` (the node's grant table and
    /// segments) and opening side connections with `open_side`. Peers' side connections are
    /// handed to [`RdmaTransport::serve_side`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad config, [`Error::Io`] when the completion queue
    /// cannot be made.
    pub fn start(
        verbs: V,
        config: RdmaConfig,
        target: Arc<Target>,
        open_side: SideOpener,
    ) -> Result<RdmaTransport<V>> {
        config.check()?;
        let depth = (config.send_depth as u64 * config.limits.max_endpoints as u64)
            .clamp(1024, 65_536) as u32;
        let cq = verbs.create_cq(depth)?;
        let shared = Arc::new(Shared {
            batches: Mutex::new(Batches::new(config.limits)),
            settled: Condvar::new(),
            endpoints: Mutex::new(HashMap::new()),
            next_endpoint: AtomicU64::new(1),
            locals: Mutex::new(HashMap::new()),
            remote: Mutex::new(RemoteRegions {
                by_transfer: HashMap::new(),
                live: 0,
            }),
            side_connections: AtomicUsize::new(0),
            counters: Counters::default(),
            stop: AtomicBool::new(false),
            verbs,
            config,
            target,
            open_side,
            cq,
        });
        let s = Arc::clone(&shared);
        let progress = std::thread::Builder::new()
            .name("kvd-rdma-progress".into())
            .spawn(move || s.progress_loop())
            .map_err(|e| Error::Io(e.to_string()))?;
        Ok(RdmaTransport {
            shared,
            progress: Some(progress),
        })
    }

    /// The device in use.
    pub fn device(&self) -> &verbs::DeviceInfo {
        self.shared.verbs.device()
    }

    /// The shared grant table and segments.
    pub fn target(&self) -> &Target {
        &self.shared.target
    }

    /// Counters.
    pub fn stats(&self) -> RdmaStats {
        let c = &self.shared.counters;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RdmaStats {
            doorbells: r(&c.doorbells),
            work_requests: r(&c.work_requests),
            completions_ok: r(&c.completions_ok),
            completions_failed: r(&c.completions_failed),
            bytes_done: r(&c.bytes_done),
            endpoints_failed: r(&c.endpoints_failed),
            rebuilds: r(&c.rebuilds),
            keys_granted: r(&c.keys_granted),
            keys_refused: r(&c.keys_refused),
            remote_regions: lock(&self.shared.remote).live as u64,
        }
    }

    /// Ops and bytes in flight.
    pub fn in_flight(&self) -> (usize, u64) {
        lock(&self.shared.batches).in_flight()
    }

    /// Serve a peer's side connection (already authenticated; `peer` introduced it) on a
    /// thread of its own; past [`RdmaConfig::max_side_connections`] it is refused.
    pub fn serve_side(&self, stream: Channel, peer: Bind) {
        let s = &self.shared;
        let n = s.side_connections.fetch_add(1, Ordering::AcqRel);
        if n >= s.config.max_side_connections {
            s.side_connections.fetch_sub(1, Ordering::AcqRel);
            let mut stream = stream;
            let _ = Message::Refused(format!(
                "{n} RDMA side connections already (the limit); retry later"
            ))
            .send(&mut stream);
            return;
        }
        let s = Arc::clone(s);
        let spawned = std::thread::Builder::new()
            .name("kvd-rdma-side".into())
            .spawn(move || {
                s.serve_side(stream, peer);
                s.side_connections.fetch_sub(1, Ordering::AcqRel);
            });
        if spawned.is_err() {
            self.shared.side_connections.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl<V: Verbs> Drop for RdmaTransport<V> {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(h) = self.progress.take() {
            let _ = h.join();
        }
        // queue pairs go with their endpoints: the NIC no longer touches any buffer
        lock(&self.shared.endpoints).clear();
    }
}

impl<V: Verbs> Transport for RdmaTransport<V> {
    type Registration = RdmaRegistration;
    type Peer = PeerAddr;

    fn register(
        &self,
        segment: SegmentId,
        memory: Arc<dyn Memory>,
        offset: u64,
        len: u64,
    ) -> Result<RdmaRegistration> {
        let s = &self.shared;
        if lock(&s.locals).contains_key(&segment) {
            return Err(Error::InvalidArgument(format!(
                "segment {} is registered with this RDMA engine already",
                segment.0
            )));
        }
        // the TCP engine of the node may have registered it in the shared table already
        let (descriptor, owned) = match s.target.descriptor(segment) {
            Some(d) if d.len == len => (d, false),
            Some(d) => {
                return Err(Error::InvalidArgument(format!(
                    "segment {} is registered with {} bytes, not {len}",
                    segment.0, d.len
                )));
            }
            None => (
                s.target
                    .register(segment, Arc::clone(&memory), offset, len)?,
                true,
            ),
        };
        let local = s.target.local(segment, 0, len)?;
        let registered = s.register_chunks(len, |at, n| {
            // SAFETY: [at, at + n) lies inside the segment, whose memory the target keeps
            // mapped while it is registered; the region is local-only (no peer can name it)
            // and is dropped with the registration, after the work that holds it.
            unsafe {
                s.verbs
                    .reg_mr(local.ptr.add(at as usize), n, MrAccess::Local)
            }
        });
        let (chunk, regions) = match registered {
            Ok(r) => r,
            Err(e) => {
                if owned {
                    let _ = s.target.unregister(segment);
                }
                return Err(e);
            }
        };
        lock(&s.locals).insert(
            segment,
            LocalSegment {
                addr: local.ptr as u64,
                len,
                chunk,
                regions,
                owned,
                device: false,
            },
        );
        Ok(RdmaRegistration { descriptor })
    }

    fn unregister(&self, registration: RdmaRegistration) -> Result<()> {
        let s = &self.shared;
        let seg = registration.descriptor.segment;
        let l = lock(&s.locals)
            .remove(&seg)
            .ok_or_else(|| Error::NotFound(format!("segment {}", seg.0)))?;
        if l.owned {
            s.target.unregister(seg)?;
        }
        // the regions go when the last work request holding them completes
        drop(l);
        Ok(())
    }

    unsafe fn grant(&self, grant: Grant) -> Result<()> {
        self.shared.target.grant(grant)
    }

    fn revoke(&self, transfer: TransferId) -> Revoked {
        // the grants first (waiting for key requests in progress), then the regions: once this
        // returns no rkey of the transfer works any more
        let revoked = self.shared.target.revoke(transfer);
        let regions = lock(&self.shared.remote).take(transfer);
        drop(regions);
        revoked
    }

    fn now_ms(&self) -> u64 {
        self.shared.target.now_ms()
    }

    fn open(&self, peer: &PeerAddr) -> Result<EndpointId> {
        let s = &self.shared;
        let open = lock(&s.endpoints)
            .values()
            .filter(|e| !lock(&e.io).closed)
            .count();
        if open >= s.config.limits.max_endpoints {
            return Err(Error::Overloaded {
                what: format!("{open} RDMA endpoints open (the limit)"),
                retry_after_ms: 100,
            });
        }
        let (mut side, _) = (s.open_side)(peer)?;
        let qp = s.connect_qp(&mut side)?;
        let id = s.next_endpoint.fetch_add(1, Ordering::Relaxed);
        let prefix = u32::try_from(id).map_err(|_| Error::Overloaded {
            what: "endpoint ids exhausted; restart the engine".into(),
            retry_after_ms: 1000,
        })?;
        let endpoint = EndpointId(id);
        lock(&s.endpoints).insert(
            endpoint,
            Arc::new(Endpoint {
                node_id: peer.node_id,
                side: Mutex::new(side),
                io: Mutex::new(EndpointIo {
                    qp: Some(qp),
                    sq: SendQueue::new(s.config.send_depth as usize, prefix),
                    failed: None,
                    failed_at: None,
                    rebuilds: 0,
                    closed: false,
                }),
            }),
        );
        Ok(endpoint)
    }

    fn close(&self, endpoint: EndpointId) {
        let Some(e) = lock(&self.shared.endpoints).get(&endpoint).cloned() else {
            return;
        };
        let mut io = lock(&e.io);
        io.closed = true;
        self.shared
            .fail_endpoint(&mut io, "closed here".into(), OpFailure::Closed);
    }

    #[expect(
        clippy::too_many_lines,
        reason = "over the 120-line ratchet (164 lines) when it came in: shorten it, then drop this"
    )]
    unsafe fn submit(&self, endpoint: EndpointId, ops: &[Op]) -> Result<BatchId> {
        let s = &self.shared;
        let e = s.endpoint(endpoint)?;
        let limits = s.config.limits;
        if ops.is_empty() || ops.len() > limits.max_batch_ops {
            return Err(Error::InvalidArgument(format!(
                "a batch holds 1 to {} ops, not {}",
                limits.max_batch_ops,
                ops.len()
            )));
        }
        // everything checked before anything is asked of the peer
        let mut locals = Vec::with_capacity(ops.len());
        for op in ops {
            if op.remote.node_id != e.node_id {
                return Err(Error::InvalidArgument(format!(
                    "op names a segment of node {}, endpoint {} leads to node {}",
                    op.remote.node_id, endpoint.0, e.node_id
                )));
            }
            if op.len == 0 {
                return Err(Error::InvalidArgument(
                    "an op moves at least one byte".into(),
                ));
            }
            let past_remote = op
                .remote_offset
                .checked_add(op.len)
                .is_none_or(|end| end > op.remote.len);
            if past_remote {
                return Err(Error::OutOfRange {
                    offset: op.remote_offset,
                    len: op.len,
                    region_len: op.remote.len,
                });
            }
            let device = lock(&s.locals).get(&op.local).is_some_and(|l| l.device);
            locals.push(if device {
                None
            } else {
                Some(s.target.local(op.local, op.local_offset, op.len)?)
            });
        }
        // the work requests of each op: chunks, cut again where a local region ends
        let mut pieces: Vec<Vec<Piece<V::Mr>>> = Vec::with_capacity(ops.len());
        {
            let regs = lock(&s.locals);
            for (op, local) in ops.iter().zip(&locals) {
                let seg = regs.get(&op.local).ok_or_else(|| {
                    Error::NotFound(format!(
                        "local segment {} is not registered with the RDMA engine",
                        op.local.0
                    ))
                })?;
                let base = match local {
                    Some(l) => l.ptr as u64,
                    None => {
                        let inside = op
                            .local_offset
                            .checked_add(op.len)
                            .is_some_and(|end| end <= seg.len);
                        if !inside {
                            return Err(Error::OutOfRange {
                                offset: op.local_offset,
                                len: op.len,
                                region_len: seg.len,
                            });
                        }
                        seg.addr + op.local_offset
                    }
                };
                let mut v = Vec::new();
                for piece in chunk::split(op.len, s.config.chunk_bytes) {
                    let mut addr = base + piece.offset;
                    let mut left = u64::from(piece.len);
                    while left > 0 {
                        let (mr, lkey, end) = seg.region_at(addr).ok_or(Error::OutOfRange {
                            offset: op.local_offset,
                            len: op.len,
                            region_len: seg.len,
                        })?;
                        let n = left.min(end - addr) as u32;
                        v.push((addr, n, lkey, Arc::clone(mr)));
                        addr += u64::from(n);
                        left -= u64::from(n);
                    }
                }
                pieces.push(v);
            }
        }
        s.ensure_ready(&e, endpoint)?;
        // admitted first (the bounds refuse before the peer is asked for anything), then the
        // keys; a failed key exchange takes the batch back, so nothing was submitted
        let sizes: Vec<(u64, u32)> = ops
            .iter()
            .zip(&pieces)
            .map(|(op, p)| (op.len, p.len() as u32))
            .collect();
        let keep = locals
            .iter()
            .flatten()
            .map(|l| Arc::clone(&l.memory))
            .collect();
        let batch = lock(&s.batches).admit(endpoint, &sizes, keep)?;
        let keys = match s.resolve_remote(&e, ops) {
            Ok(k) => k,
            Err(err) => {
                s.finish(pieces.iter().enumerate().flat_map(|(i, p)| {
                    p.iter().map(move |_| {
                        (
                            batch,
                            i as u32,
                            0,
                            ChunkOutcome::Failed(OpFailure::PeerClosed),
                        )
                    })
                }));
                let _ = lock(&s.batches).release(batch);
                let mut io = lock(&e.io);
                s.fail_endpoint(&mut io, err.to_string(), OpFailure::PeerClosed);
                return Err(err);
            }
        };
        // refused ops fail at once (every chunk), as a TCP target's refusal fails them
        s.finish(
            keys.iter()
                .zip(&pieces)
                .enumerate()
                .filter(|(_, (k, _))| k.code != 0)
                .flat_map(|(i, (k, p))| {
                    let f = ChunkOutcome::Failed(OpFailure::Refused(k.code));
                    p.iter().map(move |_| (batch, i as u32, 0, f))
                }),
        );
        let mut io = lock(&e.io);
        for (i, ((op, k), p)) in ops.iter().zip(&keys).zip(pieces).enumerate() {
            if k.code != 0 {
                continue;
            }
            let mut remote = k.addr;
            for (addr, n, lkey, mr) in p {
                io.sq.push(
                    Slot {
                        batch,
                        op: i as u32,
                        bytes: n,
                        keep: mr,
                    },
                    WorkRequest {
                        wr_id: 0,
                        kind: match op.kind {
                            OpKind::Write => WrKind::Write,
                            OpKind::Read => WrKind::Read,
                        },
                        local_addr: addr,
                        lkey,
                        len: n,
                        remote_addr: remote,
                        rkey: k.rkey,
                    },
                );
                remote += u64::from(n);
            }
        }
        if let Some((why, f)) = io.failed.clone() {
            // failed between the resolve and now: what was queued fails with it
            s.fail_endpoint(&mut io, why, f);
        } else {
            s.pump(&mut io);
        }
        Ok(batch)
    }

    fn poll(&self, batch: BatchId, ops: &mut [OpStatus]) -> Result<BatchStatus> {
        lock(&self.shared.batches).status(batch, ops)
    }

    fn wait(&self, batch: BatchId, timeout: Duration) -> Result<BatchStatus> {
        crate::engine::batches::wait_settled(
            &self.shared.batches,
            &self.shared.settled,
            batch,
            timeout,
        )
    }

    fn cancel(&self, batch: BatchId) -> Result<()> {
        let s = &self.shared;
        if !lock(&s.batches).cancel(batch) {
            return Err(Error::NotFound(format!("batch {}", batch.0)));
        }
        let eps: Vec<Arc<Endpoint<V>>> = lock(&s.endpoints).values().cloned().collect();
        for e in eps {
            let dropped = lock(&e.io).sq.cancel(batch);
            s.finish(
                dropped
                    .into_iter()
                    .map(|sl| (sl.batch, sl.op, 0, ChunkOutcome::Cancelled)),
            );
        }
        Ok(())
    }

    fn release(&self, batch: BatchId) -> Result<()> {
        lock(&self.shared.batches).release(batch)
    }
}
