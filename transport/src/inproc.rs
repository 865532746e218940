//! The in-process backend: the transfer interface within one process. A peer is another engine's
//! [`Target`] in this process (or this engine's own); an op is a grant check and a memcpy, done
//! inside `submit`, so its batch is settled when `submit` returns. It exists so that the
//! interface is exercised without a network and kvd has one code path for same-node and remote
//! moves. (No checksum here: nothing crosses a wire; the store checksums blocks at seal.)
//!
//! [`InProcNet`] lets several such engines find each other by node id and open control
//! channels to one another ([`Channel::pair`]: the same framing and tags, no socket address),
//! so that a whole transfer protocol between nodes (offers, grants, batches, commits) runs in
//! one process: the backend registry's in-process mode (`Backends::in_process`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use crate::auth::SessionKey;
use crate::channel::Channel;
use crate::link::Handler;
use crate::link::wire::{Bind, Purpose};

use crate::engine::batches::{Batches, ChunkOutcome};
use crate::engine::target::remote_direction;
use crate::engine::{
    BatchId, BatchStatus, EndpointId, Limits, Memory, Op, OpFailure, OpKind, OpStatus,
    Registration, Target, Transport,
};
use crate::error::{Error, Result};
use crate::grant::{Access, Grant, GrantLimits, SegmentId, TransferId};
use crate::segment::{BackendKind, SegmentDescriptor};

/// A segment registered with the in-process backend.
#[derive(Debug)]
pub struct InProcRegistration {
    descriptor: SegmentDescriptor,
}

impl Registration for InProcRegistration {
    fn descriptor(&self) -> SegmentDescriptor {
        self.descriptor
    }
}

#[derive(Debug)]
struct State {
    endpoints: HashMap<EndpointId, Arc<Target>>,
    next_endpoint: u64,
    batches: Batches,
}

/// The in-process backend.
#[derive(Debug)]
pub struct InProcTransport {
    target: Arc<Target>,
    limits: Limits,
    state: Mutex<State>,
}

impl InProcTransport {
    /// An engine for node `node_id` in incarnation `node_generation`.
    pub fn new(node_id: u64, node_generation: u64, limits: Limits) -> InProcTransport {
        InProcTransport {
            target: Arc::new(Target::new(
                node_id,
                node_generation,
                BackendKind::Local,
                GrantLimits::default(),
            )),
            limits,
            state: Mutex::new(State {
                endpoints: HashMap::new(),
                next_endpoint: 1,
                batches: Batches::new(limits),
            }),
        }
    }

    /// This engine's memory side, for other local engines to open endpoints to.
    pub fn target(&self) -> Arc<Target> {
        Arc::clone(&self.target)
    }

    /// Ops and bytes in flight (an op settles inside `submit`, so only batches not yet
    /// released count).
    pub fn in_flight(&self) -> (usize, u64) {
        self.lock().batches.in_flight()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Move one op's bytes; the grant is checked on the peer before a byte is touched.
    ///
    /// # Safety
    /// The posting contract for `local` (len bytes), as `submit`'s caller promised.
    unsafe fn run(&self, peer: &Target, op: &Op, local: *mut u8) -> ChunkOutcome {
        let access = Access {
            segment: op.remote.segment,
            offset: op.remote_offset,
            len: op.len,
            direction: remote_direction(op.kind),
            transfer: op.transfer,
            epoch: op.epoch,
            // In-process, the caller is this engine's own node: nothing to authenticate.
            peer: crate::grant::PeerNode {
                node: self.target.node_id(),
                generation: self.target.node_generation(),
            },
        };
        let w = match peer.begin(&access, op.remote.node_generation) {
            Ok(w) => w,
            Err(code) => return ChunkOutcome::Failed(OpFailure::Refused(code)),
        };
        let len = op.len as usize;
        // SAFETY: `local` holds len bytes (checked by Target::local at submit) and the window
        // holds len bytes inside a live grant; the two do not overlap unless the caller named
        // one range twice, which the posting contract forbids; nobody else touches either
        // (the posting contract here, the grant's contract there).
        unsafe {
            let (src, dst) = match op.kind {
                OpKind::Write => (local.cast_const(), w.ptr),
                OpKind::Read => (w.ptr.cast_const(), local),
            };
            crate::local::copy(
                std::slice::from_raw_parts_mut(dst, len),
                std::slice::from_raw_parts(src, len),
            );
        }
        peer.end(w);
        ChunkOutcome::Delivered
    }
}

impl Transport for InProcTransport {
    type Registration = InProcRegistration;
    type Peer = Arc<Target>;

    fn register(
        &self,
        segment: SegmentId,
        memory: Arc<dyn Memory>,
        offset: u64,
        len: u64,
    ) -> Result<InProcRegistration> {
        let descriptor = self.target.register(segment, memory, offset, len)?;
        Ok(InProcRegistration { descriptor })
    }

    fn unregister(&self, registration: InProcRegistration) -> Result<()> {
        self.target.unregister(registration.descriptor.segment)
    }

    unsafe fn grant(&self, grant: Grant) -> Result<()> {
        self.target.grant(grant)
    }

    fn revoke(&self, transfer: TransferId) -> crate::engine::Revoked {
        self.target.revoke(transfer)
    }

    fn now_ms(&self) -> u64 {
        self.target.now_ms()
    }

    fn open(&self, peer: &Arc<Target>) -> Result<EndpointId> {
        let mut s = self.lock();
        if s.endpoints.len() >= self.limits.max_endpoints {
            return Err(Error::Overloaded {
                what: format!("{} endpoints open (the limit)", s.endpoints.len()),
                retry_after_ms: 100,
            });
        }
        let id = EndpointId(s.next_endpoint);
        s.next_endpoint += 1;
        s.endpoints.insert(id, Arc::clone(peer));
        Ok(id)
    }

    fn close(&self, endpoint: EndpointId) {
        self.lock().endpoints.remove(&endpoint);
    }

    unsafe fn submit(&self, endpoint: EndpointId, ops: &[Op]) -> Result<BatchId> {
        let mut s = self.lock();
        let peer = s
            .endpoints
            .get(&endpoint)
            .cloned()
            .ok_or_else(|| Error::NotFound(format!("endpoint {}", endpoint.0)))?;
        let mut locals = Vec::with_capacity(ops.len());
        for op in ops {
            if op.remote.node_id != peer.node_id() {
                return Err(Error::InvalidArgument(format!(
                    "op names a segment of node {}, the endpoint leads to node {}",
                    op.remote.node_id,
                    peer.node_id()
                )));
            }
            locals.push(self.target.local(op.local, op.local_offset, op.len)?);
        }
        let sizes: Vec<(u64, u32)> = ops.iter().map(|o| (o.len, 1)).collect();
        let keep: Vec<Arc<dyn Memory>> = locals.iter().map(|l| Arc::clone(&l.memory)).collect();
        let batch = s.batches.admit(endpoint, &sizes, keep)?;
        for (i, (op, local)) in ops.iter().zip(&locals).enumerate() {
            let outcome = if s.batches.is_cancelled(batch) {
                ChunkOutcome::Cancelled
            } else {
                // SAFETY: the caller's posting contract covers the local range; the peer's
                // grant contract covers the remote one.
                unsafe { self.run(&peer, op, local.ptr) }
            };
            s.batches.chunk_finished(batch, i as u32, op.len, outcome);
        }
        Ok(batch)
    }

    fn poll(&self, batch: BatchId, ops: &mut [OpStatus]) -> Result<BatchStatus> {
        self.lock().batches.status(batch, ops)
    }

    fn wait(&self, batch: BatchId, _timeout: Duration) -> Result<BatchStatus> {
        self.lock().batches.status(batch, &mut [])
    }

    fn cancel(&self, batch: BatchId) -> Result<()> {
        if self.lock().batches.cancel(batch) {
            Ok(())
        } else {
            Err(Error::NotFound(format!("batch {}", batch.0)))
        }
    }

    fn release(&self, batch: BatchId) -> Result<()> {
        self.lock().batches.release(batch)
    }
}

/// How many nodes one [`InProcNet`] holds.
pub const MAX_NODES: usize = 256;

/// How long a read or write on an in-process control channel may block (as a TCP control
/// connection's connect timeout; its owner sets others as it needs).
const CHANNEL_TIMEOUT: Duration = Duration::from_secs(2);

/// Nodes in this process that reach each other by node id: their memory sides (for the
/// in-process engine's endpoints) and their control handlers (for control channels). A node
/// leaves when its engine goes (only a weak reference is kept).
#[derive(Default)]
pub struct InProcNet {
    nodes: Mutex<HashMap<u64, NetNode>>,
}

struct NetNode {
    target: Weak<Target>,
    control: Option<Handler>,
}

impl std::fmt::Debug for InProcNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let nodes = self.lock();
        f.debug_struct("InProcNet")
            .field("nodes", &nodes.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl InProcNet {
    /// An empty network.
    pub fn new() -> Arc<InProcNet> {
        Arc::new(InProcNet::default())
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, NetNode>> {
        self.nodes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Add the node whose memory side is `target`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when a live node has its id; [`Error::Overloaded`] past
    /// [`MAX_NODES`].
    pub fn join(&self, target: &Arc<Target>) -> Result<()> {
        let mut nodes = self.lock();
        nodes.retain(|_, n| n.target.strong_count() > 0);
        let id = target.node_id();
        if nodes.contains_key(&id) {
            return Err(Error::InvalidArgument(format!(
                "node {id} is in this process already"
            )));
        }
        if nodes.len() >= MAX_NODES {
            return Err(Error::Overloaded {
                what: format!("{MAX_NODES} in-process nodes (the limit)"),
                retry_after_ms: 1_000,
            });
        }
        nodes.insert(
            id,
            NetNode {
                target: Arc::downgrade(target),
                control: None,
            },
        );
        Ok(())
    }

    /// Take the control channels other nodes open to `node` (as
    /// `TcpTransport::set_control_handler`).
    pub fn set_control_handler(&self, node: u64, handler: Handler) {
        if let Some(n) = self.lock().get_mut(&node) {
            n.control = Some(handler);
        }
    }

    /// The memory side of `node`, to open an endpoint to.
    ///
    /// # Errors
    /// [`Error::PeerUnavailable`] when no live node has that id.
    pub fn target_of(&self, node: u64) -> Result<Arc<Target>> {
        self.lock()
            .get(&node)
            .and_then(|n| n.target.upgrade())
            .ok_or_else(|| Error::PeerUnavailable(format!("node {node} is not in this process")))
    }

    /// A control channel from the node whose memory side is `from` to `node`: the other end
    /// goes to `node`'s handler with `from`'s introduction; this end comes back with `node`'s.
    ///
    /// # Errors
    /// [`Error::PeerUnavailable`] when `node` is not here or takes no control channels;
    /// [`Error::Io`] when no channel can be made.
    pub fn open_control(&self, from: &Target, node: u64) -> Result<(Channel, Bind)> {
        let (target, handler) = {
            let nodes = self.lock();
            let n = nodes.get(&node);
            let target = n.and_then(|n| n.target.upgrade()).ok_or_else(|| {
                Error::PeerUnavailable(format!("node {node} is not in this process"))
            })?;
            let handler = n.and_then(|n| n.control.clone()).ok_or_else(|| {
                Error::PeerUnavailable(format!("node {node} takes no control connections"))
            })?;
            (target, handler)
        };
        let (mine, theirs) = Channel::pair(&SessionKey::fresh()?)?;
        for c in [&mine, &theirs] {
            let _ = c.stream().set_read_timeout(Some(CHANNEL_TIMEOUT));
            let _ = c.stream().set_write_timeout(Some(CHANNEL_TIMEOUT));
        }
        handler(
            theirs,
            Bind {
                node_id: from.node_id(),
                node_generation: from.node_generation(),
                purpose: Purpose::Control,
                payload_mac: false,
                to_node: node,
            },
        );
        Ok((
            mine,
            Bind {
                node_id: node,
                node_generation: target.node_generation(),
                purpose: Purpose::Control,
                payload_mac: false,
                to_node: from.node_id(),
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::HeapMemory;
    use crate::grant::Direction;

    const SEG: SegmentId = SegmentId(1);
    const T: TransferId = TransferId(7);

    fn pair() -> (
        InProcTransport,
        InProcTransport,
        Arc<HeapMemory>,
        Arc<HeapMemory>,
    ) {
        let (a, b) = (
            InProcTransport::new(1, 1, Limits::default()),
            InProcTransport::new(2, 1, Limits::default()),
        );
        let (ma, mb) = (
            Arc::new(HeapMemory::zeroed(1 << 16)),
            Arc::new(HeapMemory::zeroed(1 << 16)),
        );
        a.register(SEG, ma.clone(), 0, 1 << 16).unwrap();
        b.register(SEG, mb.clone(), 0, 1 << 16).unwrap();
        (a, b, ma, mb)
    }

    fn op(kind: OpKind, remote: SegmentDescriptor, off: u64, len: u64) -> Op {
        Op {
            kind,
            local: SEG,
            local_offset: off,
            remote,
            remote_offset: off,
            len,
            transfer: T,
            epoch: 1,
        }
    }

    #[test]
    fn a_write_inside_a_grant_lands_byte_exact_and_one_outside_is_refused_and_touches_nothing() {
        let (a, b, ma, mb) = pair();
        // SAFETY: no transfer runs yet.
        unsafe { ma.bytes_mut()[..8192].fill(0xab) };
        let g = Grant {
            transfer: T,
            epoch: 1,
            segment: SEG,
            offset: 0,
            len: 4096,
            direction: Direction::RemoteWrite,
            expires_at_ms: b.now_ms() + 60_000,
            peer: None,
        };
        // SAFETY: nothing else touches b's memory in this test.
        unsafe { b.grant(g).unwrap() };
        let ep = a.open(&b.target()).unwrap();
        let remote = SegmentDescriptor {
            backend: BackendKind::Local,
            segment: SEG,
            len: 1 << 16,
            node_id: 2,
            node_generation: 1,
        };
        // SAFETY: the ranges are not touched until the batch is settled (it is at return).
        let batch = unsafe {
            a.submit(
                ep,
                &[
                    op(OpKind::Write, remote, 0, 4096),
                    op(OpKind::Write, remote, 4096, 4096),
                ],
            )
            .unwrap()
        };
        let mut st = [OpStatus::Pending; 2];
        let s = a.poll(batch, &mut st).unwrap();
        assert!(s.settled);
        assert_eq!(st[0], OpStatus::Done);
        assert_eq!(st[1], OpStatus::Failed(OpFailure::Refused(2)));
        b.revoke(T);
        // SAFETY: the grant is revoked; nothing writes b's memory.
        let got = unsafe { mb.bytes() };
        assert!(got[..4096].iter().all(|&x| x == 0xab));
        assert!(
            got[4096..8192].iter().all(|&x| x == 0),
            "the refused op touched nothing"
        );
        a.release(batch).unwrap();
        assert_eq!(b.target().refusals()[2], 1);
    }
}
