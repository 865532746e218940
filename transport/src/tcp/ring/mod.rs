//! The TCP backend's event loop: one thread, one io_uring, every connection of its lane
//! (endpoints' connections as initiator, peers' connections as target) as a small state
//! machine; an engine runs one per lane, sharing the batch table, the grants and the counters. All of the backend's `unsafe` lives in this module: pointers handed to the kernel.
//!
//! This file holds the state, the loop, commands, failure and closing; `io` posts sends and
//! receives and handles their completions; `initiator` and `target` are the two sides' protocol.
//!
//! Each connection has at most one send and one receive in the kernel at a time (plus, for
//! zero-copy sends, the notifications still due). A buffer handed to the kernel is accounted
//! for until its completion says the kernel let go of it: a batch's memory by its wire
//! references ([`Batches::wire_taken`]), a grant's window by [`Target::end`], a connection's
//! own buffers by the connection staying allocated (`outstanding`).
//!
//! Initiator: pull a chunk from the endpoint's queue while fewer than `window` are unanswered;
//! send header + payload (write) or header (read); read the responses in order; a read's
//! payload goes straight into the local range, then its CRC is checked.
//! Target: read a request header; check the grant (nothing is touched before that); receive a
//! write's payload straight into the window (or drain it when refused), check its CRC; send
//! a read's payload straight from the window; answer in order.
//!
//! Every header is tagged with the connection's key as it is queued for sending (the order
//! it goes on the wire) and its tag checked as it is parsed (the order it arrived); a wrong
//! tag fails the connection like any other protocol error.

use std::collections::{HashMap, VecDeque};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

mod initiator;
mod io;
mod stall;
mod target;

use io_uring::{IoUring, cqueue, opcode, squeue, types};

use super::wire::{Request, Response};
use super::{Command, Shared, ZeroCopy};
use crate::admission::Admitted;
use crate::auth::{Sealer, Unsealer};
use crate::channel::{Channel, PeerPurpose};
use crate::engine::batches::ChunkOutcome;
use crate::engine::target::Window;
use crate::engine::{BatchId, EndpointId, OpFailure};
use crate::error::{Error, Result};
use stall::{TcpBytes, stall_report};

/// One chunk on its way: where its local bytes are and the request that names the remote ones.
#[derive(Debug)]
pub(super) struct Chunk {
    pub batch: BatchId,
    pub op: u32,
    /// The payload's CRC-32C as the caller knows it (a sealed block that is one chunk): sent
    /// instead of computed.
    pub known_crc: Option<u32>,
    pub local: *mut u8,
    pub request: Request,
}

// SAFETY: the pointer is into a batch's memory, kept alive by the batch table; who may touch
// it when is the posting contract's business, not the thread's.
unsafe impl Send for Chunk {}

const UD_WAKE: u64 = u64::MAX;
const SQE_SEND: u64 = 1;
const SQE_SEND_HEADER: u64 = 2;
const SQE_RECV: u64 = 3;
/// Replies a target connection queues before it stops reading requests (TCP then pushes back).
const MAX_REPLIES: usize = 64;
/// A refused write's payload is drained through this much scratch at a time.
const DRAIN_BYTES: usize = 64 << 10;
/// Zero-copy only pays for payloads at least this large.
const ZERO_COPY_MIN_BYTES: usize = 16 << 10;
/// Chunks (initiator) or header-only replies (target) one `sendmsg` carries at most: small
/// chunks then cost one send per few of them, not one each.
const MAX_GATHER: usize = 8;
/// Answers to writes (header only) one receive takes at most.
const MAX_ANSWERS: usize = 16;
/// The receive buffer for headers: one request, or up to `MAX_ANSWERS` answers.
const HEADER_BUF: usize = MAX_ANSWERS * Response::WIRE_BYTES;

fn user_data(slot: usize, kind: u64, seq: u64) -> u64 {
    ((slot as u64) << 44) | (kind << 40) | (seq & ((1 << 40) - 1))
}

fn parse_user_data(ud: u64) -> (usize, u64, u64) {
    ((ud >> 44) as usize, (ud >> 40) & 0xf, ud & ((1 << 40) - 1))
}

#[derive(Debug)]
enum Role {
    Initiator {
        endpoint: EndpointId,
    },
    /// Serving a peer: the node it authenticated as at the handshake.
    Target {
        peer: crate::grant::PeerNode,
    },
}

/// What a send holds until the kernel lets go of its payload.
#[derive(Debug, Default)]
struct Held {
    /// A batch's payload (a write chunk): one wire reference.
    batch: Option<BatchId>,
    /// A grant's window (a read reply).
    window: Option<Window>,
}

/// A zero-copy send's holdings, until its notifications have all come.
#[derive(Debug)]
struct ZcPending {
    seq: u64,
    notifs: u32,
    finished: bool,
    held: Held,
}

/// One send: up to `MAX_GATHER` parts, each a header and an optional payload, in one
/// `sendmsg` (a zero-copy send has exactly one part).
#[derive(Debug)]
struct SendState {
    busy: bool,
    seq: u64,
    zero_copy: bool,
    parts: usize,
    hdrs: [[u8; Request::WIRE_BYTES]; MAX_GATHER],
    hdr_lens: [usize; MAX_GATHER],
    payloads: [(*const u8, usize); MAX_GATHER],
    /// Bytes of all parts sent so far.
    done: usize,
    total: usize,
    iov: [libc::iovec; 2 * MAX_GATHER],
    msg: libc::msghdr,
    held: [Held; MAX_GATHER],
}

impl SendState {
    /// Add one part: `hdr` (a whole frame, its tag's place last, tagged here by `seal` so
    /// that tags follow wire order) and its payload.
    fn add(&mut self, seal: &mut Sealer, hdr: &[u8], payload: *const u8, len: usize, held: Held) {
        let i = self.parts;
        self.hdrs[i][..hdr.len()].copy_from_slice(hdr);
        seal.seal(&mut self.hdrs[i][..hdr.len()]);
        self.hdr_lens[i] = hdr.len();
        self.payloads[i] = (payload, len);
        self.held[i] = held;
        self.parts += 1;
    }

    fn take_held(&mut self) -> Vec<Held> {
        let n = self.parts;
        self.held[..n].iter_mut().map(std::mem::take).collect()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Header,
    Payload,
    Drain,
}

#[derive(Debug)]
struct RecvState {
    busy: bool,
    stage: Stage,
    hdr: [u8; HEADER_BUF],
    want: usize,
    filled: usize,
    ptr: *mut u8,
    /// A batch whose memory the posted receive writes (a read's payload).
    batch: Option<BatchId>,
}

/// A write request whose payload is being received (target side).
#[derive(Debug)]
struct Serving {
    request: Request,
    window: Option<Window>,
    refusal: u8,
    /// Payload bytes of a refused write still to drain.
    left: usize,
}

/// A reply waiting to be sent (target side).
#[derive(Debug)]
struct Reply {
    response: Response,
    window: Option<Window>,
}

#[derive(Debug)]
struct Conn {
    stream: TcpStream,
    fd: RawFd,
    role: Role,
    /// Tags the headers this end sends, in wire order (at `SendState::add`).
    seal: Sealer,
    /// Checks the headers this end receives, in the order they arrive.
    unseal: Unsealer,
    /// The connection's place under the per-peer bound (target side), given back with it.
    _place: Option<Admitted<PeerPurpose>>,
    /// The key of its payload MACs, where its binds turned them on: every payload it sends
    /// carries one in its header, every one it receives is checked.
    payload_mac: Option<crate::auth::PayloadKey>,
    zero_copy: bool,
    send: SendState,
    recv: RecvState,
    /// SQEs (and zero-copy notifications) the kernel still has.
    outstanding: u32,
    closing: Option<OpFailure>,
    last_progress: Instant,
    /// The socket's byte counts when the connection had gone half the stall timeout without
    /// a completion (see [`Ring::check_stalls`]).
    tcp_seen: Option<TcpBytes>,
    next_seq: u64,
    /// Initiator: chunks sent (or being sent) and not yet answered, in order.
    inflight: VecDeque<Chunk>,
    /// Target: the write whose payload is arriving.
    serving: Option<Serving>,
    /// Target: replies in order.
    replies: VecDeque<Reply>,
    zc: VecDeque<ZcPending>,
    scratch: Vec<u8>,
}

impl Conn {
    /// Whether the connection has work under way: a send, chunks awaiting answers, a write
    /// arriving, or replies to send.
    fn has_work_out(&self) -> bool {
        self.send.busy
            || !self.inflight.is_empty()
            || self.serving.is_some()
            || !self.replies.is_empty()
    }
}

// SAFETY: a connection's raw pointers (its msghdr's iovecs, a payload, a window) point into
// its own boxed buffers or into memory kept alive by the batch table or a grant's window; the
// connection moves with the ring thread as a whole and is only ever touched there.
unsafe impl Send for Conn {}

#[derive(Debug, Default)]
struct Ep {
    conns: Vec<usize>,
    queue: VecDeque<Chunk>,
    failed: bool,
    /// Every lane holding a part of the endpoint (this one included): a failure here fails
    /// the other parts too.
    lanes: Vec<usize>,
}

pub(super) struct Ring {
    ring: IoUring,
    shared: Arc<Shared>,
    /// Which of the engine's lanes this ring is (its inbox in `shared.lanes`).
    lane: usize,
    conns: Vec<Option<Box<Conn>>>,
    free: Vec<usize>,
    endpoints: HashMap<EndpointId, Ep>,
    wake_buf: Box<[u8; 8]>,
    zero_copy_supported: bool,
    next_tag: u64,
    /// Whether a chunk finished or memory was let go since the last notify.
    notify: bool,
    /// Completions taken from the ring, reused every turn.
    cq_buf: Vec<(u64, i32, u32)>,
    last_expire: Instant,
    /// When [`Ring::check_stalls`] last ran, and the time between its last two runs (for a
    /// failing connection's warning: a long gap means this thread was starved).
    last_check: Instant,
    last_gap: Duration,
    /// The error of the completion that is failing a connection, for its warning.
    errno: Option<i32>,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("connections", &self.conns.iter().flatten().count())
            .finish_non_exhaustive()
    }
}

fn failure_of(errno: i32) -> OpFailure {
    if errno == libc::ETIMEDOUT {
        OpFailure::Timeout
    } else {
        OpFailure::PeerClosed
    }
}

impl Ring {
    /// A ring for `shared`. Build it on the thread that will run it: it is set up for a
    /// single issuer with task work deferred to that thread's waits (fewer interrupts and
    /// wake-ups per completion), where the kernel allows; plainly otherwise.
    pub(super) fn new(shared: Arc<Shared>, lane: usize) -> Result<Ring> {
        let tuned = IoUring::builder()
            .setup_cqsize(16_384)
            .setup_single_issuer()
            .setup_defer_taskrun()
            .build(4096);
        let ring = match tuned {
            Ok(r) => r,
            Err(_) => IoUring::builder()
                .setup_cqsize(16_384)
                .build(4096)
                .map_err(|e| {
                    Error::Io(format!("io_uring setup (is io_uring disabled here?): {e}"))
                })?,
        };
        let mut probe = io_uring::Probe::new();
        let zero_copy_supported = ring.submitter().register_probe(&mut probe).is_ok()
            && probe.is_supported(opcode::SendZc::CODE);
        Ok(Ring {
            ring,
            shared,
            lane,
            conns: Vec::new(),
            free: Vec::new(),
            endpoints: HashMap::new(),
            wake_buf: Box::new([0; 8]),
            zero_copy_supported,
            next_tag: 1,
            notify: false,
            cq_buf: Vec::with_capacity(1024),
            last_expire: Instant::now(),
            last_check: Instant::now(),
            last_gap: Duration::ZERO,
            errno: None,
        })
    }

    fn push(&mut self, e: squeue::Entry) {
        // SAFETY: every entry's buffers are kept alive (and untouched by us) until its
        // completion is reaped: see the module docs and each caller.
        unsafe {
            while self.ring.submission().push(&e).is_err() {
                let _ = self.ring.submit();
            }
        }
    }

    fn post_wake(&mut self) {
        let e = opcode::Read::new(
            types::Fd(self.shared.lanes[self.lane].wake.as_raw_fd()),
            self.wake_buf.as_mut_ptr(),
            8,
        )
        .build()
        .user_data(UD_WAKE);
        self.push(e);
    }

    pub(super) fn run(mut self) {
        self.post_wake();
        let mut stopping = false;
        loop {
            self.take_commands();
            if self.shared.stop.load(Ordering::Acquire) {
                stopping = true;
            }
            if stopping {
                self.close_everything();
            }
            self.pump_all();
            self.check_stalls();
            if self.notify {
                self.notify = false;
                self.shared.settled.notify_all();
            }
            if stopping && self.conns.iter().all(Option::is_none) {
                break;
            }
            let ts = types::Timespec::new().nsec(50_000_000);
            let args = types::SubmitArgs::new().timespec(&ts);
            match self.ring.submitter().submit_with_args(1, &args) {
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::ETIME | libc::EINTR | libc::EBUSY)
                    ) => {}
                Err(_) => std::thread::sleep(Duration::from_millis(1)),
            }
            self.reap();
        }
        self.shared.settled.notify_all();
    }

    fn take_commands(&mut self) {
        let cmds = std::mem::take(
            &mut *self.shared.lanes[self.lane]
                .commands
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        for c in cmds {
            match c {
                Command::Attach {
                    endpoint,
                    streams,
                    lanes,
                } => {
                    let mut ep = Ep {
                        lanes,
                        ..Ep::default()
                    };
                    for s in streams {
                        if let Some(slot) = self.add_conn(s, Role::Initiator { endpoint }) {
                            ep.conns.push(slot);
                        }
                    }
                    self.endpoints.insert(endpoint, ep);
                }
                Command::Serve { channel, peer } => {
                    if self.add_conn(channel, Role::Target { peer }).is_none() {
                        self.shared
                            .target_connections
                            .fetch_sub(1, Ordering::AcqRel);
                    }
                }
                Command::Submit { endpoint, chunks } => match self.endpoints.get_mut(&endpoint) {
                    Some(ep) if !ep.failed => ep.queue.extend(chunks),
                    _ => {
                        for c in chunks {
                            self.finish(&c, ChunkOutcome::Failed(OpFailure::Closed));
                        }
                    }
                },
                Command::Cancel { batch } => {
                    let mut dropped = Vec::new();
                    for ep in self.endpoints.values_mut() {
                        let (gone, kept): (VecDeque<Chunk>, VecDeque<Chunk>) =
                            ep.queue.drain(..).partition(|c| c.batch == batch);
                        ep.queue = kept;
                        dropped.extend(gone);
                    }
                    for c in dropped {
                        self.finish(&c, ChunkOutcome::Cancelled);
                    }
                }
                Command::Close { endpoint } => self.fail_endpoint(endpoint, OpFailure::Closed),
                Command::Fail { endpoint, why } => self.fail_endpoint(endpoint, why),
                Command::Evict { node } => self.evict(node),
            }
        }
    }

    fn add_conn(&mut self, channel: Channel, role: Role) -> Option<usize> {
        let crate::channel::Parts {
            stream,
            seal,
            unseal,
            place,
            payload_mac,
        } = channel.into_parts()?;
        if stream.set_nonblocking(true).is_err() {
            return None;
        }
        let loopback = stream
            .peer_addr()
            .map(|a| a.ip().is_loopback())
            .unwrap_or(true);
        let zero_copy = self.zero_copy_supported
            && match self.shared.config.zero_copy {
                ZeroCopy::Off => false,
                ZeroCopy::On => true,
                ZeroCopy::Auto => !loopback,
            };
        let fd = stream.as_raw_fd();
        // SAFETY: msghdr is plain old data; all-zero is its empty value.
        let msg: libc::msghdr = unsafe { std::mem::zeroed() };
        let empty = libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        };
        let conn = Box::new(Conn {
            stream,
            fd,
            role,
            seal,
            unseal,
            _place: place,
            payload_mac,
            zero_copy,
            send: SendState {
                busy: false,
                seq: 0,
                zero_copy: false,
                parts: 0,
                hdrs: [[0; Request::WIRE_BYTES]; MAX_GATHER],
                hdr_lens: [0; MAX_GATHER],
                payloads: [(std::ptr::null(), 0); MAX_GATHER],
                done: 0,
                total: 0,
                iov: [empty; 2 * MAX_GATHER],
                msg,
                held: std::array::from_fn(|_| Held::default()),
            },
            recv: RecvState {
                busy: false,
                stage: Stage::Header,
                hdr: [0; HEADER_BUF],
                want: 0,
                filled: 0,
                ptr: std::ptr::null_mut(),
                batch: None,
            },
            outstanding: 0,
            closing: None,
            last_progress: Instant::now(),
            tcp_seen: None,
            next_seq: 1,
            inflight: VecDeque::new(),
            serving: None,
            replies: VecDeque::new(),
            zc: VecDeque::new(),
            scratch: Vec::new(),
        });
        let slot = match self.free.pop() {
            Some(s) => {
                self.conns[s] = Some(conn);
                s
            }
            None => {
                self.conns.push(Some(conn));
                self.conns.len() - 1
            }
        };
        Some(slot)
    }

    /// Count a header whose integrity tag was wrong (its connection then fails).
    fn tampered(&self) {
        self.shared
            .counters
            .integrity_failures
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Account for one chunk's end. Waiters are woken only when a batch settles (a wake-up
    /// per chunk costs the waiting thread a futex round trip per MiB).
    fn finish(&mut self, c: &Chunk, outcome: ChunkOutcome) {
        let mut b = self.shared.batches();
        let settled = b.chunk_finished(c.batch, c.op, u64::from(c.request.len), outcome);
        drop(b);
        if outcome == ChunkOutcome::Delivered {
            let k = &self.shared.counters;
            k.chunks_done.fetch_add(1, Ordering::Relaxed);
            k.bytes_done
                .fetch_add(u64::from(c.request.len), Ordering::Relaxed);
        }
        self.notify |= settled;
    }

    /// The kernel let go of one buffer of `batch`.
    fn let_go(&mut self, batch: BatchId) {
        let settled = self.shared.batches().wire_released(batch, 1);
        self.notify |= settled;
    }

    fn release_held(&mut self, held: Held) {
        if let Some(b) = held.batch {
            self.let_go(b);
        }
        if let Some(w) = held.window {
            self.shared.target.end(w);
        }
    }

    /// Whether the next checksummed payload this engine sends is the one the test hook
    /// corrupts.
    fn corrupt_this_one(&self) -> bool {
        Self::nth_from_now(&self.shared.counters.corrupt_nth)
    }

    /// Whether the payload this engine just received is the one the test hook rewrites as an
    /// on-path attacker would (its CRC-32C kept).
    fn rewrite_this_one(&self) -> bool {
        Self::nth_from_now(&self.shared.counters.rewrite_nth)
    }

    /// Count a test hook's countdown down; whether this is the one it named.
    fn nth_from_now(n: &std::sync::atomic::AtomicU64) -> bool {
        n.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| match v {
            0 => None,
            v => Some(v - 1),
        }) == Ok(1)
    }

    // ---- failure ---------------------------------------------------------------------------

    fn fail_endpoint(&mut self, endpoint: EndpointId, why: OpFailure) {
        let Some(ep) = self.endpoints.get_mut(&endpoint) else {
            return;
        };
        let first = !ep.failed;
        ep.failed = true;
        let queued: Vec<Chunk> = ep.queue.drain(..).collect();
        let conns = ep.conns.clone();
        // the endpoint's parts on other lanes fail with it (a close reaches them all anyway)
        if first && why != OpFailure::Closed {
            for &lane in ep.lanes.iter().filter(|&&l| l != self.lane) {
                self.shared.send(lane, Command::Fail { endpoint, why });
            }
        }
        self.shared.endpoint_failed(endpoint, why.to_string());
        for c in queued {
            self.finish(&c, ChunkOutcome::Failed(why));
        }
        for slot in conns {
            self.begin_close(slot, why);
        }
        self.forget_endpoint_if_drained(endpoint);
    }

    fn forget_endpoint_if_drained(&mut self, endpoint: EndpointId) {
        let drained = self.endpoints.get(&endpoint).is_some_and(|ep| {
            ep.failed
                && ep
                    .conns
                    .iter()
                    .all(|&s| self.conns.get(s).is_none_or(Option::is_none))
        });
        if drained {
            self.endpoints.remove(&endpoint);
        }
    }

    /// Stop a connection: reset it (linger 0), fail what it had in flight, and free it once
    /// the kernel has returned every buffer.
    fn begin_close(&mut self, slot: usize, why: OpFailure) {
        let Some(conn) = self.conns.get_mut(slot).and_then(Option::as_mut) else {
            return;
        };
        if conn.closing.is_some() {
            return;
        }
        conn.closing = Some(why);
        if why != OpFailure::Closed {
            self.shared
                .counters
                .connections_failed
                .fetch_add(1, Ordering::Relaxed);
        }
        let _ = rustix::net::sockopt::set_socket_linger(&conn.stream, Some(Duration::ZERO));
        // A failed connection is aborted now (connect(AF_UNSPEC): a reset, and the kernel
        // drops its send and retransmit queues), not merely shut down: with the link cut, the
        // queued segments, and with them the zero-copy sends' notifications that free the
        // source's pages, would otherwise be held until the kernel's own user timeout
        // (several stall timeouts) gave up on the socket. An orderly close keeps the
        // shutdown, so that the peer sees an end rather than a reset.
        let aborted = why != OpFailure::Closed && rustix::net::connect_unspec(&conn.stream).is_ok();
        if !aborted {
            let _ = conn.stream.shutdown(std::net::Shutdown::Both);
        }
        let inflight: Vec<Chunk> = conn.inflight.drain(..).collect();
        let replies: Vec<Reply> = conn.replies.drain(..).collect();
        let serving_idle = !conn.recv.busy;
        let serving = if serving_idle {
            conn.serving.take()
        } else {
            None
        };
        for c in inflight {
            self.finish(&c, ChunkOutcome::Failed(why));
        }
        for r in replies {
            if let Some(w) = r.window {
                self.shared.target.end(w);
            }
        }
        if let Some(Serving {
            window: Some(w), ..
        }) = serving
        {
            self.shared.target.end(w);
        }
        self.free_if_drained(slot);
    }

    fn free_if_drained(&mut self, slot: usize) {
        let drained = self.conns[slot]
            .as_ref()
            .is_some_and(|c| c.closing.is_some() && c.outstanding == 0);
        if !drained {
            return;
        }
        let mut conn = self.conns[slot].take().expect("checked above");
        self.free.push(slot);
        if let Some(Serving {
            window: Some(w), ..
        }) = conn.serving.take()
        {
            self.shared.target.end(w);
        }
        for held in conn.send.take_held() {
            self.release_held(held);
        }
        if let Some(b) = conn.recv.batch.take() {
            self.let_go(b);
        }
        for z in std::mem::take(&mut conn.zc) {
            self.release_held(z.held);
        }
        self.notify = true;
        match conn.role {
            Role::Target { .. } => {
                self.shared
                    .target_connections
                    .fetch_sub(1, Ordering::AcqRel);
            }
            Role::Initiator { endpoint } => self.forget_endpoint_if_drained(endpoint),
        }
        // dropping `conn` closes the socket (a reset: linger 0)
    }

    fn fail_conn(&mut self, slot: usize, why: OpFailure) {
        let errno = self.errno.take();
        if let Some(c) = self.conns.get(slot).and_then(Option::as_deref) {
            if c.closing.is_none() && why != OpFailure::Closed {
                // an idle connection its peer closed (an endpoint closed, a daemon stopped)
                // is the ordinary end of one: a debug line, not a warning
                let busy = c.has_work_out();
                let errno = errno.map(|e| std::io::Error::from_raw_os_error(e).to_string());
                let gap = self.last_gap.as_millis() as u64;
                if busy || why != OpFailure::PeerClosed || errno.is_some() {
                    tracing::warn!(
                        lane = self.lane,
                        why = %why,
                        errno,
                        loop_gap_ms = gap,
                        state = %stall_report(c, Instant::now()),
                        "tcp: failing a connection"
                    );
                } else {
                    tracing::debug!(
                        lane = self.lane,
                        state = %stall_report(c, Instant::now()),
                        "tcp: an idle connection closed by its peer"
                    );
                }
            }
        }
        let endpoint = match self.conns.get(slot).and_then(Option::as_ref).map(|b| &**b) {
            Some(Conn {
                role: Role::Initiator { endpoint },
                ..
            }) => Some(*endpoint),
            Some(_) => None,
            None => return,
        };
        match endpoint {
            Some(e) => self.fail_endpoint(e, why),
            None => self.begin_close(slot, why),
        }
    }

    /// Close every connection node `node` opened here (its accesses in progress end; its
    /// key is no longer trusted).
    fn evict(&mut self, node: u64) {
        let theirs: Vec<usize> = self
            .conns
            .iter()
            .enumerate()
            .filter_map(|(slot, c)| match c.as_deref() {
                Some(Conn {
                    role: Role::Target { peer },
                    ..
                }) if peer.node == node => Some(slot),
                _ => None,
            })
            .collect();
        for slot in theirs {
            self.begin_close(slot, OpFailure::Closed);
        }
    }

    fn close_everything(&mut self) {
        let eps: Vec<EndpointId> = self.endpoints.keys().copied().collect();
        for e in eps {
            self.fail_endpoint(e, OpFailure::Closed);
        }
        for slot in 0..self.conns.len() {
            self.begin_close(slot, OpFailure::Closed);
        }
    }

    // ---- posting ---------------------------------------------------------------------------

    fn pump_all(&mut self) {
        for slot in 0..self.conns.len() {
            let Some(c) = self.conns[slot].as_ref() else {
                continue;
            };
            if c.closing.is_some() {
                continue;
            }
            match c.role {
                Role::Initiator { endpoint } => self.pump_initiator(slot, endpoint),
                Role::Target { .. } => self.pump_target(slot),
            }
        }
    }

    fn reap(&mut self) {
        let mut cqes = std::mem::take(&mut self.cq_buf);
        loop {
            cqes.clear();
            cqes.extend(
                self.ring
                    .completion()
                    .map(|c| (c.user_data(), c.result(), c.flags()))
                    .take(1024),
            );
            if cqes.is_empty() {
                self.cq_buf = cqes;
                return;
            }
            for &(ud, res, flags) in &cqes {
                if ud == UD_WAKE {
                    self.post_wake();
                    continue;
                }
                let (slot, kind, seq) = parse_user_data(ud);
                match kind {
                    SQE_SEND if cqueue::notif(flags) => self.on_notif(slot, seq),
                    SQE_SEND => self.on_send(slot, res, cqueue::more(flags)),
                    SQE_SEND_HEADER => self.on_send_header(slot, res),
                    SQE_RECV => self.on_recv(slot, res),
                    _ => {}
                }
            }
        }
    }

    fn conn_mut(&mut self, slot: usize) -> Option<&mut Conn> {
        self.conns
            .get_mut(slot)
            .and_then(Option::as_mut)
            .map(|b| &mut **b)
    }
}
