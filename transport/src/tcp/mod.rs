//! The `tcp` backend: the transfer interface over TCP, driven by [`TcpConfig::lanes`] io_uring
//! event loops per engine (ring threads, "lanes").
//!
//! ```text
//!  caller threads                         the ring threads (ring/), one inbox each
//!  open()  connect N sockets, auth, bind ──▶ Attach ─┐ (an endpoint's sockets dealt to lanes)
//!  submit() check, admit, cut into chunks ─▶ Submit ─┤ commands (bounded by the in-flight
//!  cancel()/close()                        ─▶ ...   ─┘ limits), an eventfd wakes each ring
//!  poll()/wait() ◀── batch table (Mutex+Condvar) ◀── chunk completions (any lane)
//!  listener thread: accept, auth, bind ───▶ Serve (a target connection, lanes in turn)
//! ```
//!
//! An endpoint is [`TcpConfig::connections`] connections to one peer, dealt to the lanes in
//! turn (its part on each lane a queue of chunks; a batch's chunks are dealt to the parts in
//! turn). Each connection pulls the next chunk of its lane's queue whenever it has fewer than
//! [`TcpConfig::window`] unanswered, so large ops are pipelined across all of them, and the
//! streams' copies and TCP work run on as many cores as there are lanes (one thread doing all
//! of it held the engine to about half of what two plain blocking streams move on loopback).
//! A part that fails fails the endpoint's other parts with the same reason. A write
//! chunk goes as one `sendmsg` of header and payload straight from the segment (zero-copy
//! `SENDMSG_ZC` where enabled); the target checks the grant, receives the payload straight
//! into the granted range, checks the CRC-32C and answers. A read is the mirror image. The
//! CRC-32C of a payload is computed by the side that sends it in the pass just before the
//! kernel copies it (so the copy finds it in cache) and checked by the side that receives it
//! right after its bytes land (likewise): no extra copy exists to fuse it with.
//!
//! Failure: a connection that errors, closes, breaks the protocol or makes no progress for
//! [`TcpConfig::stall_timeout`] while work is outstanding fails its whole endpoint; the
//! endpoint's ops fail with the reason at once, its sockets are reset, and the batch settles
//! once the kernel has let go of every buffer. Other endpoints are untouched.

mod config;
pub mod forge;
mod listener;
mod ring;
pub mod wire;

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::channel::Channel;
use crate::engine::batches::Batches;
use crate::engine::chunk;
use crate::engine::{
    BatchId, BatchStatus, EndpointId, Memory, Op, OpKind, OpStatus, Registration, Target, Transport,
};
use crate::error::{Error, Result};
use crate::grant::{Grant, SegmentId, TransferId};
use crate::link::handshake::{self, Handshake};
use crate::link::members::Members;
use crate::link::wire::{Bind, Purpose};
use crate::link::{Handler, Opener, PeerAddr};
use crate::segment::{BackendKind, SegmentDescriptor};

pub use config::{
    DEFAULT_CONNECTIONS, DEFAULT_LANES, DEFAULT_MAX_HANDSHAKES, DEFAULT_MEMBER_HANDSHAKES,
    MAX_LANES, TcpConfig, ZeroCopy,
};

/// A segment registered with the TCP backend (TCP needs nothing beyond the descriptor: the
/// target resolves `(segment, offset)` itself).
#[derive(Debug)]
pub struct TcpRegistration {
    descriptor: SegmentDescriptor,
}

impl Registration for TcpRegistration {
    fn descriptor(&self) -> SegmentDescriptor {
        self.descriptor
    }
}

/// Counters of one engine (monotonic).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TcpStats {
    /// Chunks this engine sent as initiator and had answered ok.
    pub chunks_done: u64,
    /// Payload bytes moved as initiator (both directions).
    pub bytes_done: u64,
    /// Chunks served as target.
    pub chunks_served: u64,
    /// Chunks whose CRC-32C this engine found wrong (a write's payload as target, a read's
    /// as initiator).
    pub checksum_failures: u64,
    /// Accesses refused as target (no live grant, stale generation).
    pub refused: u64,
    /// Sends done zero-copy.
    pub zero_copy_sends: u64,
    /// Sends done by copy.
    pub copied_sends: u64,
    /// Connections failed (error, close, timeout, protocol).
    pub connections_failed: u64,
    /// Connections refused at the handshake (wrong secret, malformed, too many).
    pub handshakes_refused: u64,
    /// Frames (chunk headers, binds, control messages) whose integrity tag was wrong: changed
    /// in flight, replayed, or not from the authenticated peer (each closed its connection);
    /// and payloads whose MAC was wrong (each failed its chunk).
    pub integrity_failures: u64,
    /// Binds refused because they did not prove the node they claimed (no key for it here,
    /// a signature that does not verify, or addressed to another node).
    pub identity_refusals: u64,
    /// Stall checks that found a connection without a completion for the stall timeout but
    /// with bytes still moving under its socket (a slow link, kept; a stopped peer or a cut
    /// link moves none and fails).
    pub slow_progress: u64,
}

#[derive(Debug, Default)]
struct Counters {
    chunks_done: AtomicU64,
    bytes_done: AtomicU64,
    chunks_served: AtomicU64,
    checksum_failures: AtomicU64,
    refused: AtomicU64,
    zero_copy_sends: AtomicU64,
    copied_sends: AtomicU64,
    connections_failed: AtomicU64,
    handshakes_refused: AtomicU64,
    slow_progress: AtomicU64,
    /// Shared with every [`Channel`] this engine hands out (control messages count too).
    integrity_failures: Arc<AtomicU64>,
    identity_refusals: AtomicU64,
    /// Test hook: the Nth payload this engine sends from now (1-based) carries a wrong CRC.
    corrupt_nth: AtomicU64,
    /// Test hook: the Nth payload this engine receives from now (1-based) is rewritten, its
    /// CRC-32C kept, before it is checked.
    rewrite_nth: AtomicU64,
}

/// What the ring thread is asked to do.
#[derive(Debug)]
enum Command {
    /// New endpoint connections (initiator side).
    Attach {
        endpoint: EndpointId,
        streams: Vec<Channel>,
        /// Every lane holding connections of the endpoint (this one included).
        lanes: Vec<usize>,
    },
    /// A peer's authenticated connection (target side).
    Serve {
        channel: Channel,
        peer: crate::grant::PeerNode,
    },
    /// Chunks of a batch for an endpoint.
    Submit {
        endpoint: EndpointId,
        chunks: Vec<ring::Chunk>,
    },
    /// Drop a batch's unsent chunks.
    Cancel { batch: BatchId },
    /// Close an endpoint.
    Close { endpoint: EndpointId },
    /// Another lane's part of the endpoint failed: fail this part for the same reason.
    Fail {
        endpoint: EndpointId,
        why: crate::engine::OpFailure,
    },
    /// Close every connection node `node` opened here (its key is no longer trusted).
    Evict { node: u64 },
}

#[derive(Debug)]
struct EndpointInfo {
    node_id: u64,
    failed: Option<String>,
    /// The lanes holding its connections, in the order chunks are dealt to them.
    lanes: Vec<usize>,
    /// The lane the next submitted batch's first chunk goes to.
    next: usize,
}

/// One ring thread's inbox: commands, and the eventfd that wakes it.
#[derive(Debug)]
struct Lane {
    commands: Mutex<Vec<Command>>,
    wake: rustix::fd::OwnedFd,
}

struct ControlSlot(Mutex<Option<Handler>>);

impl std::fmt::Debug for ControlSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ControlSlot(..)")
    }
}

impl std::ops::Deref for ControlSlot {
    type Target = Mutex<Option<Handler>>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

/// State shared by caller threads, the ring thread and the listener.
#[derive(Debug)]
struct Shared {
    config: TcpConfig,
    target: Arc<Target>,
    batches: Mutex<Batches>,
    settled: Condvar,
    lanes: Vec<Lane>,
    /// The lane the next peer connection to this target is served on.
    next_serve: AtomicUsize,
    endpoints: Mutex<HashMap<EndpointId, EndpointInfo>>,
    next_endpoint: AtomicU64,
    counters: Counters,
    target_connections: AtomicUsize,
    stop: AtomicBool,
    control: ControlSlot,
    rdma: ControlSlot,
}

impl Shared {
    /// This node's side of a handshake.
    fn handshake(&self) -> Handshake<'_> {
        Handshake {
            node_id: self.config.node_id,
            node_generation: self.target.node_generation(),
            secret: &self.config.secret,
            identity: &self.config.identity,
            members: &self.config.members,
            payload_mac: self.config.payload_mac,
            connect_timeout: self.config.connect_timeout,
            stall_timeout: self.config.stall_timeout,
            max_connections_per_peer: self.config.max_connections_per_peer,
            integrity_failures: &self.counters.integrity_failures,
            identity_refusals: &self.counters.identity_refusals,
        }
    }

    fn batches(&self) -> MutexGuard<'_, Batches> {
        self.batches.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn endpoints(&self) -> MutexGuard<'_, HashMap<EndpointId, EndpointInfo>> {
        self.endpoints.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn send(&self, lane: usize, c: Command) {
        let l = &self.lanes[lane];
        l.commands.lock().unwrap_or_else(|p| p.into_inner()).push(c);
        Self::wake(l);
    }

    /// Serve a peer's authenticated connection, on the lanes in turn.
    fn serve(&self, channel: Channel, peer: crate::grant::PeerNode) {
        let lane = self.next_serve.fetch_add(1, Ordering::Relaxed) % self.lanes.len();
        self.send(lane, Command::Serve { channel, peer });
    }

    fn wake(lane: &Lane) {
        // An eventfd write only fails when the counter would overflow, which a pending wake-up
        // already covers.
        let _ = rustix::io::write(&lane.wake, &1u64.to_ne_bytes());
    }

    fn wake_all(&self) {
        for l in &self.lanes {
            Self::wake(l);
        }
    }

    fn endpoint_failed(&self, endpoint: EndpointId, why: String) {
        if let Some(e) = self.endpoints().get_mut(&endpoint) {
            e.failed.get_or_insert(why);
        }
    }
}

/// The TCP backend. Dropping it fails what is in flight, waits for the kernel to let go of
/// every buffer, and stops its threads.
#[derive(Debug)]
pub struct TcpTransport {
    shared: Arc<Shared>,
    local_addr: SocketAddr,
    rings: Vec<JoinHandle<()>>,
    listener: Option<JoinHandle<()>>,
}

impl TcpTransport {
    /// Start an engine: bind its listener, start its ring and listener threads.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad config, [`Error::Io`] when the address cannot be
    /// bound or io_uring is unavailable.
    pub fn start(config: TcpConfig) -> Result<TcpTransport> {
        config.check()?;
        let listener = TcpListener::bind(config.listen)
            .map_err(|e| Error::Io(format!("bind the data port {}: {e}", config.listen)))?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| Error::Io(e.to_string()))?;
        let mut lanes = Vec::with_capacity(config.lanes);
        for _ in 0..config.lanes {
            let wake = rustix::event::eventfd(
                0,
                rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
            )
            .map_err(|e| Error::Io(format!("eventfd: {e}")))?;
            lanes.push(Lane {
                commands: Mutex::new(Vec::new()),
                wake,
            });
        }
        let shared = Arc::new(Shared {
            target: Arc::new(Target::new(
                config.node_id,
                config.node_generation,
                BackendKind::Tcp,
                config.grant_limits,
            )),
            batches: Mutex::new(Batches::new(config.limits)),
            settled: Condvar::new(),
            lanes,
            next_serve: AtomicUsize::new(0),
            endpoints: Mutex::new(HashMap::new()),
            next_endpoint: AtomicU64::new(1),
            counters: Counters::default(),
            target_connections: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            control: ControlSlot(Mutex::new(None)),
            rdma: ControlSlot(Mutex::new(None)),
            config,
        });
        let mut rings = Vec::with_capacity(shared.lanes.len());
        let stop_rings = |rings: Vec<JoinHandle<()>>| {
            shared.stop.store(true, Ordering::Release);
            shared.wake_all();
            for r in rings {
                let _ = r.join();
            }
        };
        for lane in 0..shared.lanes.len() {
            match Self::start_ring(&shared, lane) {
                Ok(r) => rings.push(r),
                Err(e) => {
                    stop_rings(rings);
                    return Err(e);
                }
            }
        }
        let s = Arc::clone(&shared);
        let listener = match std::thread::Builder::new()
            .name("kvd-tcp-accept".into())
            .spawn(move || listener::accept_loop(&s, &listener))
        {
            Ok(l) => l,
            Err(e) => {
                stop_rings(rings);
                return Err(Error::Io(e.to_string()));
            }
        };
        Ok(TcpTransport {
            shared,
            local_addr,
            rings,
            listener: Some(listener),
        })
    }

    /// Start lane `lane`'s ring thread; returns once its ring is set up (or failed to be).
    fn start_ring(shared: &Arc<Shared>, lane: usize) -> Result<JoinHandle<()>> {
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        let s = Arc::clone(shared);
        let ring = std::thread::Builder::new()
            .name(format!("kvd-tcp-ring{lane}"))
            .spawn(move || match ring::Ring::new(s, lane) {
                Ok(r) => {
                    let _ = ready_tx.send(Ok(()));
                    r.run();
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            })
            .map_err(|e| Error::Io(e.to_string()))?;
        let started = ready_rx
            .recv()
            .unwrap_or_else(|_| Err(Error::Io("the ring thread died at start".into())));
        match started {
            Ok(()) => Ok(ring),
            Err(e) => {
                let _ = ring.join();
                Err(e)
            }
        }
    }

    /// The address the target side listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// This engine's memory side (segments, grants, refusal counts).
    pub fn target(&self) -> &Target {
        &self.shared.target
    }

    /// Counters.
    pub fn stats(&self) -> TcpStats {
        let c = &self.shared.counters;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        TcpStats {
            chunks_done: r(&c.chunks_done),
            bytes_done: r(&c.bytes_done),
            chunks_served: r(&c.chunks_served),
            checksum_failures: r(&c.checksum_failures),
            refused: r(&c.refused),
            zero_copy_sends: r(&c.zero_copy_sends),
            copied_sends: r(&c.copied_sends),
            connections_failed: r(&c.connections_failed),
            handshakes_refused: r(&c.handshakes_refused),
            integrity_failures: r(&c.integrity_failures),
            identity_refusals: r(&c.identity_refusals),
            slow_progress: r(&c.slow_progress),
        }
    }

    /// The member table this engine's handshakes read (the owner keeps it current).
    pub fn members(&self) -> &Arc<Members> {
        &self.shared.config.members
    }

    /// This node's public key, as peers must know it.
    pub fn public_key(&self) -> crate::link::identity::PublicKey {
        self.shared.config.identity.public()
    }

    /// Close every connection that involves node `node`: those it opened here (its transfers'
    /// accesses end with them) and this engine's endpoints to it. For a node whose key was
    /// revoked: its new connections are already refused at the handshake.
    pub fn evict(&self, node: u64) {
        let gone: Vec<EndpointId> = self
            .shared
            .endpoints()
            .iter()
            .filter(|(_, e)| e.node_id == node)
            .map(|(id, _)| *id)
            .collect();
        for ep in gone {
            self.close(ep);
        }
        for lane in 0..self.shared.lanes.len() {
            self.shared.send(lane, Command::Evict { node });
        }
    }

    /// Take the control connections peers open to this engine (see [`Handler`]);
    /// without a handler they are closed after the handshake.
    pub fn set_control_handler(&self, handler: Handler) {
        *self
            .shared
            .control
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(handler);
    }

    /// The memory side, to share with another backend of the same node (the RDMA engine
    /// serves the same grants and segments).
    pub fn target_arc(&self) -> Arc<Target> {
        Arc::clone(&self.shared.target)
    }

    /// Take the RDMA side connections peers open to this engine (see
    /// [`crate::tcp::Purpose::Rdma`]); without a handler they are closed after the
    /// handshake, which a peer reads as "no RDMA here".
    pub fn set_rdma_handler(&self, handler: Handler) {
        *self.shared.rdma.lock().unwrap_or_else(|p| p.into_inner()) = Some(handler);
    }

    /// Something that opens authenticated connections of `purpose` to peers, as
    /// [`TcpTransport::open_control`] does (for the RDMA backend's side channel). It holds the
    /// engine's state, not the engine: it works while the engine runs.
    pub fn opener(&self, purpose: Purpose) -> Opener {
        let shared = Arc::downgrade(&self.shared);
        Arc::new(move |peer: &PeerAddr| {
            let s = shared
                .upgrade()
                .ok_or_else(|| Error::PeerUnavailable("the TCP engine stopped".into()))?;
            handshake::connect(&s.handshake(), peer, purpose)
        })
    }

    /// Open an authenticated control connection to `peer` (blocking, with the connect
    /// timeout), for the owner's own messages; the peer's introduction (its node generation)
    /// with it. The stream has read and write timeouts of the connect timeout; set others as
    /// needed.
    ///
    /// # Errors
    /// [`Error::PeerUnavailable`] as for [`Transport::open`].
    pub fn open_control(&self, peer: &PeerAddr) -> Result<(Channel, Bind)> {
        handshake::connect(&self.shared.handshake(), peer, Purpose::Control)
    }

    /// Ops and bytes in flight.
    pub fn in_flight(&self) -> (usize, u64) {
        self.shared.batches().in_flight()
    }

    /// Test-only fault: the `n`th payload this engine sends from now on (1-based; 0 turns it
    /// off) carries a CRC-32C that does not match its bytes, as a chunk corrupted in flight
    /// would. Only checksummed chunks can show it.
    #[doc(hidden)]
    pub fn inject_corrupt_chunk(&self, n: u64) {
        self.shared.counters.corrupt_nth.store(n, Ordering::Relaxed);
    }

    /// Test-only fault: the `n`th payload this engine receives from now on (1-based; 0 turns
    /// it off) is changed before it is checked the way an attacker on the path would change
    /// it: other bytes, the same CRC-32C ([`forge`]). Only a payload MAC can show it.
    #[doc(hidden)]
    pub fn inject_rewritten_payload(&self, n: u64) {
        self.shared.counters.rewrite_nth.store(n, Ordering::Relaxed);
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.wake_all();
        if let Some(h) = self.listener.take() {
            let _ = h.join();
        }
        for h in self.rings.drain(..) {
            let _ = h.join();
        }
    }
}

impl Transport for TcpTransport {
    type Registration = TcpRegistration;
    type Peer = PeerAddr;

    fn register(
        &self,
        segment: SegmentId,
        memory: Arc<dyn Memory>,
        offset: u64,
        len: u64,
    ) -> Result<TcpRegistration> {
        let descriptor = self.shared.target.register(segment, memory, offset, len)?;
        Ok(TcpRegistration { descriptor })
    }

    fn unregister(&self, registration: TcpRegistration) -> Result<()> {
        self.shared
            .target
            .unregister(registration.descriptor.segment)
    }

    unsafe fn grant(&self, grant: Grant) -> Result<()> {
        self.shared.target.grant(grant)
    }

    fn revoke(&self, transfer: TransferId) -> crate::engine::Revoked {
        self.shared.target.revoke(transfer)
    }

    fn now_ms(&self) -> u64 {
        self.shared.target.now_ms()
    }

    fn open(&self, peer: &PeerAddr) -> Result<EndpointId> {
        let s = &self.shared;
        {
            let eps = s.endpoints();
            if eps.len() >= s.config.limits.max_endpoints {
                return Err(Error::Overloaded {
                    what: format!("{} endpoints open (the limit)", eps.len()),
                    retry_after_ms: 100,
                });
            }
        }
        let mut streams = Vec::with_capacity(s.config.connections);
        for _ in 0..s.config.connections {
            streams.push(handshake::connect(&s.handshake(), peer, Purpose::Data)?.0);
        }
        let endpoint = EndpointId(s.next_endpoint.fetch_add(1, Ordering::Relaxed));
        // the endpoint's streams are dealt to the lanes in turn, starting one further for
        // each endpoint so that one-stream endpoints spread too
        let n = s.lanes.len();
        let first = endpoint.0 as usize % n;
        let mut per_lane: Vec<(usize, Vec<Channel>)> = Vec::new();
        for (i, stream) in streams.into_iter().enumerate() {
            let lane = (first + i) % n;
            match per_lane.iter_mut().find(|(l, _)| *l == lane) {
                Some((_, v)) => v.push(stream),
                None => per_lane.push((lane, vec![stream])),
            }
        }
        let lanes: Vec<usize> = per_lane.iter().map(|(l, _)| *l).collect();
        s.endpoints().insert(
            endpoint,
            EndpointInfo {
                node_id: peer.node_id,
                failed: None,
                lanes: lanes.clone(),
                next: 0,
            },
        );
        for (lane, streams) in per_lane {
            let lanes = lanes.clone();
            s.send(
                lane,
                Command::Attach {
                    endpoint,
                    streams,
                    lanes,
                },
            );
        }
        Ok(endpoint)
    }

    fn close(&self, endpoint: EndpointId) {
        let gone = self.shared.endpoints().remove(&endpoint);
        for lane in gone.map(|e| e.lanes).unwrap_or_default() {
            self.shared.send(lane, Command::Close { endpoint });
        }
    }

    unsafe fn submit(&self, endpoint: EndpointId, ops: &[Op]) -> Result<BatchId> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.submit_with_checksums(endpoint, ops, &[]) }
    }

    unsafe fn submit_with_checksums(
        &self,
        endpoint: EndpointId,
        ops: &[Op],
        checksums: &[Option<u32>],
    ) -> Result<BatchId> {
        let s = &self.shared;
        let (peer_node, lanes, first_lane) = {
            let mut eps = s.endpoints();
            let e = eps
                .get_mut(&endpoint)
                .ok_or_else(|| Error::NotFound(format!("endpoint {}", endpoint.0)))?;
            if let Some(why) = &e.failed {
                return Err(Error::PeerUnavailable(format!(
                    "endpoint {} failed ({why}); open a new one",
                    endpoint.0
                )));
            }
            // batches start on the lanes in turn, so that small batches spread too
            let first = e.next;
            e.next = (e.next + 1) % e.lanes.len().max(1);
            (e.node_id, e.lanes.clone(), first)
        };
        let chunk_bytes = s.config.chunk_bytes;
        let mut locals = Vec::with_capacity(ops.len());
        let mut sizes = Vec::with_capacity(ops.len());
        for op in ops {
            if op.remote.node_id != peer_node {
                return Err(Error::InvalidArgument(format!(
                    "op names a segment of node {}, endpoint {} leads to node {peer_node}",
                    op.remote.node_id, endpoint.0
                )));
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
            locals.push(s.target.local(op.local, op.local_offset, op.len)?);
            sizes.push((op.len, chunk::count(op.len, chunk_bytes)));
        }
        let keep = locals.iter().map(|l| Arc::clone(&l.memory)).collect();
        let batch = s.batches().admit(endpoint, &sizes, keep)?;
        let flags = if s.config.checksum {
            wire::FLAG_CHECKSUM
        } else {
            0
        };
        let mut chunks = Vec::with_capacity(sizes.iter().map(|&(_, n)| n as usize).sum());
        for (i, (op, local)) in ops.iter().zip(&locals).enumerate() {
            // a write that goes as one chunk carries the caller's checksum, if it has one
            let known = match (op.kind, checksums.get(i).copied().flatten()) {
                (OpKind::Write, Some(c)) if op.len <= u64::from(chunk_bytes) => Some(c),
                _ => None,
            };
            for piece in chunk::split(op.len, chunk_bytes) {
                chunks.push(ring::Chunk {
                    batch,
                    op: i as u32,
                    known_crc: known,
                    // SAFETY: piece.offset < op.len and the local range holds op.len bytes.
                    local: unsafe { local.ptr.add(piece.offset as usize) },
                    request: wire::Request {
                        kind: match op.kind {
                            OpKind::Write => wire::Kind::Write,
                            OpKind::Read => wire::Kind::Read,
                        },
                        flags,
                        tag: 0,
                        transfer: op.transfer.0,
                        epoch: op.epoch,
                        node_generation: op.remote.node_generation,
                        segment: op.remote.segment.0,
                        len: piece.len,
                        offset: op.remote_offset + piece.offset,
                        crc: 0,
                        mac: [0; crate::auth::MAC_BYTES],
                    },
                });
            }
        }
        // chunks are dealt to the endpoint's lanes in turn (each lane's connections pull from
        // its own queue)
        let mut dealt: Vec<Vec<ring::Chunk>> = lanes
            .iter()
            .map(|_| Vec::with_capacity(chunks.len() / lanes.len() + 1))
            .collect();
        for (i, c) in chunks.into_iter().enumerate() {
            dealt[(first_lane + i) % lanes.len()].push(c);
        }
        for (lane, chunks) in lanes.iter().zip(dealt) {
            if !chunks.is_empty() {
                s.send(*lane, Command::Submit { endpoint, chunks });
            }
        }
        Ok(batch)
    }

    fn poll(&self, batch: BatchId, ops: &mut [OpStatus]) -> Result<BatchStatus> {
        self.shared.batches().status(batch, ops)
    }

    fn checksums(&self, batch: BatchId, ops: &mut [Option<u32>]) -> Result<()> {
        self.shared.batches().checksums(batch, ops)
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
        if !self.shared.batches().cancel(batch) {
            return Err(Error::NotFound(format!("batch {}", batch.0)));
        }
        for lane in 0..self.shared.lanes.len() {
            self.shared.send(lane, Command::Cancel { batch });
        }
        Ok(())
    }

    fn release(&self, batch: BatchId) -> Result<()> {
        self.shared.batches().release(batch)
    }
}
