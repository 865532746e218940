//! What peers do to this node: pushes into it (what they offered, the pages allocated and
//! granted for it, and how each ends: committed, i.e. verified and published as one group;
//! or aborted, its connection gone, or past its deadline: freed, nothing published) and
//! fetches from it (the blocks pinned and granted for reading until released, the connection
//! closes, or the deadline passes).
//!
//! Either way a transfer here is an internal store session that holds its pages (WRITING
//! blocks, or pins) and a set of grants; ending it revokes the grants (waiting for chunks in
//! flight) and closes the session, which frees whatever it held.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvd_core::batch::check_batch;
use transport::channel::Channel;
use transport::grant::{Direction, Grant, TransferId};
use transport::link::wire::Bind;
use transport::registry::Backends;

use super::Counters;
use super::wire::{Binding, CheckpointStep, Offered, PeerReply, PeerRequest, Served};
use crate::POOL_SEGMENT;
use crate::keys::{BlockKey, NamespaceDescriptor};
use crate::protocol::WireError;
use crate::store::holds::HoldEnd;
use crate::store::{BlockClass, Handle, SessionId, Store};
use crate::{Error, Result};

/// Bounds on what peers may have under way here.
#[derive(Debug, Clone, Copy)]
pub struct IncomingLimits {
    /// Transfers in flight from one peer.
    pub per_peer: usize,
    /// Transfers in flight in all.
    pub total: usize,
    /// How long a transfer may take from offer to commit before it is aborted.
    pub deadline: Duration,
    /// Control connections peers may hold open.
    pub connections: usize,
}

impl Default for IncomingLimits {
    fn default() -> IncomingLimits {
        IncomingLimits {
            per_peer: 8,
            total: 32,
            deadline: Duration::from_secs(30),
            connections: 64,
        }
    }
}

/// Which end of a transfer's binding this node is.
#[derive(Debug, Clone, Copy)]
enum End {
    /// An offer: the blocks come here.
    Destination,
    /// A fetch: the blocks are read from here.
    Source,
}

#[derive(Debug)]
struct InFlight {
    source_node: u64,
    connection: u64,
    session: SessionId,
    handles: Vec<Handle>,
    /// Page offsets, lengths and offered CRC-32Cs of a push's blocks (empty for a fetch).
    offsets: Vec<u64>,
    lens: Vec<u64>,
    checksums: Vec<u32>,
    /// A checkpoint step's (request, epoch, step): committed into the manifest, not published.
    checkpoint: Option<(u64, u64, CheckpointStep)>,
    deadline: Instant,
}

#[derive(Debug, Default)]
struct State {
    transfers: HashMap<u64, InFlight>,
    /// The newest epoch seen per (source node, request).
    epochs: HashMap<(u64, u64), u64>,
    /// The control connections being served: the peer's node, and a handle to shut it down.
    connections: HashMap<u64, (u64, transport::channel::Stream)>,
}

/// The destination side of every push into this node.
#[derive(Debug)]
pub struct Incoming {
    store: Arc<Store>,
    limits: IncomingLimits,
    node_id: u64,
    state: Mutex<State>,
    next_transfer: AtomicU64,
    next_connection: AtomicU64,
    connections: AtomicU64,
    counters: Arc<Counters>,
    /// The membership this node follows: no new transfers while it holds no lease.
    membership: std::sync::OnceLock<Arc<dyn crate::Membership>>,
}

impl Incoming {
    /// Nothing under way yet.
    pub fn new(
        store: Arc<Store>,
        node_id: u64,
        limits: IncomingLimits,
        counters: Arc<Counters>,
    ) -> Incoming {
        Incoming {
            store,
            limits,
            node_id,
            state: Mutex::new(State::default()),
            next_transfer: AtomicU64::new(1),
            next_connection: AtomicU64::new(1),
            connections: AtomicU64::new(0),
            counters,
            membership: std::sync::OnceLock::new(),
        }
    }

    /// Take no new transfers while `membership` says this node holds no lease.
    pub fn follow(&self, membership: Arc<dyn crate::Membership>) {
        let _ = self.membership.set(membership);
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Transfers in flight into this node.
    pub fn in_flight(&self) -> usize {
        self.lock().transfers.len()
    }

    /// Serve one peer's control connection until it closes; whatever it left unfinished is
    /// aborted then. Runs on its own thread.
    pub fn serve(self: &Arc<Self>, backends: &Backends, mut s: Channel, peer: Bind) {
        if self.connections.fetch_add(1, Ordering::AcqRel) >= self.limits.connections as u64 {
            self.connections.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!(
                peer = peer.node_id,
                "too many control connections; closed one"
            );
            return;
        }
        let connection = self.next_connection.fetch_add(1, Ordering::Relaxed);
        if let Ok(h) = s.stream().try_clone() {
            self.lock()
                .connections
                .insert(connection, (peer.node_id, h));
        }
        // an idle control connection may stay; a half-sent frame may not stall a thread long
        let _ = s.stream().set_read_timeout(None);
        let _ = s.stream().set_write_timeout(Some(Duration::from_secs(10)));
        // a frame that fails its tag ends the loop like a closed connection: the transfers it
        // carried are aborted below
        while let Ok(req) = super::wire::recv::<PeerRequest>(&mut s) {
            let reply = match self.handle(backends, connection, &peer, req) {
                Ok(r) => r,
                Err(e) => PeerReply::Refused(WireError::from(e)),
            };
            if super::wire::send(&mut s, &reply).is_err() {
                break;
            }
        }
        let left: Vec<u64> = {
            let mut st = self.lock();
            st.connections.remove(&connection);
            st.transfers
                .iter()
                .filter(|(_, t)| t.connection == connection)
                .map(|(id, _)| *id)
                .collect()
        };
        for id in left {
            self.counters
                .aborted_incoming
                .fetch_add(1, Ordering::Relaxed);
            self.abort(backends, id);
        }
        self.connections.fetch_sub(1, Ordering::AcqRel);
    }

    /// Close every control connection node `node` holds here (its key is no longer trusted):
    /// each one's serving thread then aborts the transfers it carried, freeing their pages
    /// and revoking their grants.
    pub fn evict(&self, node: u64) {
        for (n, h) in self.lock().connections.values() {
            if *n == node {
                let _ = h.shutdown();
            }
        }
    }

    /// A transfer id no peer can guess (the grants of a transfer are named by it): random,
    /// with this node's counter in its low bits so that two of them never meet.
    fn new_transfer_id(&self) -> u64 {
        let mut r = [0u8; 8];
        let n = rustix::rand::getrandom(&mut r, rustix::rand::GetRandomFlags::empty()).unwrap_or(0);
        let count = self.next_transfer.fetch_add(1, Ordering::Relaxed) & 0xffff;
        let random = if n == 8 { u64::from_le_bytes(r) } else { 0 };
        (random & !0xffff) | count | 1 << 63
    }

    fn handle(
        &self,
        backends: &Backends,
        connection: u64,
        peer: &Bind,
        req: PeerRequest,
    ) -> Result<PeerReply> {
        match req {
            PeerRequest::Offer {
                binding,
                namespace,
                blocks,
                checkpoint,
            } => self.offer(
                backends, connection, peer, binding, &namespace, &blocks, checkpoint,
            ),
            PeerRequest::Commit { transfer } => self.commit(backends, connection, peer, transfer),
            PeerRequest::Abort { transfer } => {
                self.owned_by(connection, peer, transfer)?;
                self.abort(backends, transfer);
                Ok(PeerReply::Aborted)
            }
            PeerRequest::Want { binding, keys } => {
                self.want(backends, connection, peer, binding, &keys)
            }
            PeerRequest::WantPrefix { binding, tokens } => {
                self.check_binding(backends, peer, &binding, End::Source)?;
                // every block of the answer had its checksum checked just now
                let prefix = self.store.restore_prefix(binding.request, &tokens)?;
                let keys: Vec<BlockKey> = prefix.blocks.iter().map(|b| b.key).collect();
                let Some(first) = keys.first() else {
                    return Err(Error::NotFound(format!(
                        "no verified checkpoint prefix of request {} here",
                        binding.request
                    )));
                };
                // the asker cannot know the manifest's namespace; it is the blocks'
                let binding = Binding {
                    namespace: first.namespace,
                    ..binding
                };
                let reply = self.serve_keys(backends, connection, peer, binding, &keys)?;
                Ok(match reply {
                    PeerReply::Offering {
                        transfer,
                        segment,
                        namespace,
                        blocks,
                        ..
                    } => PeerReply::Offering {
                        transfer,
                        segment,
                        namespace,
                        blocks,
                        keys,
                        tokens: prefix.tokens,
                    },
                    other => other,
                })
            }
            PeerRequest::Release { transfer } => {
                self.owned_by(connection, peer, transfer)?;
                self.abort(backends, transfer);
                Ok(PeerReply::Released)
            }
            PeerRequest::EndHold { binding } => {
                self.check_binding(backends, peer, &binding, End::Source)?;
                let ended = self
                    .store
                    .hold_end(binding.request, binding.epoch, HoldEnd::Taken);
                if ended {
                    tracing::debug!(
                        request = binding.request,
                        epoch = binding.epoch,
                        node = peer.node_id,
                        "hand-off hold taken by the decode's node"
                    );
                }
                Ok(PeerReply::HoldEnded(ended))
            }
            PeerRequest::Have { keys } => {
                check_batch(keys.len(), self.store.config().max_batch)?;
                self.counters.locates_served.fetch_add(1, Ordering::Relaxed);
                let found = self.store.lookup(&keys)?;
                Ok(PeerReply::Have(crate::protocol::pack_bits(
                    found.iter().map(Option::is_some),
                )))
            }
        }
    }

    /// A commit, abort or release must come from the peer that started the transfer, on the
    /// connection it started it on (a transfer is bound to both incarnations, and a control
    /// connection lives within one incarnation of each end).
    fn owned_by(&self, connection: u64, peer: &Bind, transfer: u64) -> Result<()> {
        match self.lock().transfers.get(&transfer) {
            Some(t) if t.source_node == peer.node_id && t.connection == connection => Ok(()),
            _ => {
                self.counters
                    .binding_mismatches
                    .fetch_add(1, Ordering::Relaxed);
                Err(Error::NotFound(format!(
                    "transfer {transfer} of node {} on this connection (an earlier \
                     incarnation's, another connection's or another node's)",
                    peer.node_id
                )))
            }
        }
    }

    /// Check what a transfer is bound to against what this node knows: this node's end (the
    /// destination of an offer, the source of a fetch) must name this node in this
    /// incarnation, the other end the peer on this connection in its own.
    fn check_binding(
        &self,
        backends: &Backends,
        peer: &Bind,
        b: &Binding,
        here: End,
    ) -> Result<()> {
        let ((node, generation), (their_node, their_generation), asks) = match here {
            End::Destination => (
                (b.destination_node, b.destination_generation),
                (b.source_node, b.source_generation),
                "the transfer is for node",
            ),
            End::Source => (
                (b.source_node, b.source_generation),
                (b.destination_node, b.destination_generation),
                "the fetch asks node",
            ),
        };
        let stale = |had: u64, current: u64| Error::StaleGeneration {
            handle_node: had,
            handle_slot: 0,
            current_node: current,
            current_slot: 0,
        };
        // the node's generation as its peers know it (cluster mode advances it at every
        // re-registration; the store's own handles keep theirs)
        let mine = backends.target().node_generation();
        let refused = if generation != mine {
            // an earlier incarnation's transfer (this node restarted since)
            Some(stale(generation, mine))
        } else if node != self.node_id {
            Some(Error::InvalidArgument(format!(
                "{asks} {node}, this is node {}",
                self.node_id
            )))
        } else if (their_node, their_generation) != (peer.node_id, peer.node_generation) {
            Some(stale(their_generation, peer.node_generation))
        } else {
            None
        };
        match refused {
            Some(e) => {
                self.counters
                    .binding_mismatches
                    .fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
            None => Ok(()),
        }
    }

    /// Admit one more transfer with `peer` under `binding`'s epoch, within the bounds.
    fn admit(&self, peer: &Bind, binding: &Binding) -> Result<()> {
        if let Some(m) = self.membership.get()
            && !m.lease_held()
        {
            return Err(Error::Unavailable(format!(
                "node {} holds no registration lease ({}); go to another node",
                self.node_id,
                m.problem()
            )));
        }
        // fencing: in cluster mode a peer is only who etcd says it is, at that generation
        if let Some(m) = self.membership.get()
            && m.fences()
            && m.generation_of(peer.node_id) != Some(peer.node_generation)
        {
            self.counters.fenced.fetch_add(1, Ordering::Relaxed);
            return Err(Error::StaleGeneration {
                handle_node: peer.node_generation,
                handle_slot: 0,
                current_node: m.generation_of(peer.node_id).unwrap_or(0),
                current_slot: 0,
            });
        }
        let mut st = self.lock();
        let key = (peer.node_id, binding.request);
        let newest = st.epochs.get(&key).copied().unwrap_or(0);
        if binding.epoch < newest {
            self.counters
                .binding_mismatches
                .fetch_add(1, Ordering::Relaxed);
            return Err(Error::StaleEpoch {
                current: newest,
                got: binding.epoch,
            });
        }
        let with_peer = st
            .transfers
            .values()
            .filter(|t| t.source_node == peer.node_id)
            .count();
        if with_peer >= self.limits.per_peer || st.transfers.len() >= self.limits.total {
            self.counters.overloaded.fetch_add(1, Ordering::Relaxed);
            return Err(Error::Overloaded {
                what: format!(
                    "{with_peer} transfers with node {} and {} in all are in flight here \
                     (limits {} / {})",
                    peer.node_id,
                    st.transfers.len(),
                    self.limits.per_peer,
                    self.limits.total
                ),
                retry_after_ms: 100,
            });
        }
        st.epochs.insert(key, binding.epoch);
        Ok(())
    }

    /// A fetch: pin the wanted blocks and grant their pages for reading.
    fn want(
        &self,
        backends: &Backends,
        connection: u64,
        peer: &Bind,
        binding: Binding,
        keys: &[BlockKey],
    ) -> Result<PeerReply> {
        self.check_binding(backends, peer, &binding, End::Source)?;
        if binding.request != 0 {
            // a hand-off fetch: only the live hold of that request and epoch, only its run
            self.store
                .hold_check(binding.request, binding.epoch, keys)
                .inspect_err(|_| {
                    self.counters
                        .binding_mismatches
                        .fetch_add(1, Ordering::Relaxed);
                })?;
        }
        self.serve_keys(backends, connection, peer, binding, keys)
    }

    /// Pin `keys` and grant their pages for reading by `peer`.
    fn serve_keys(
        &self,
        backends: &Backends,
        connection: u64,
        peer: &Bind,
        binding: Binding,
        keys: &[BlockKey],
    ) -> Result<PeerReply> {
        if keys.is_empty() {
            return Err(Error::InvalidArgument(
                "a fetch asks for at least one block".into(),
            ));
        }
        check_batch(keys.len(), self.store.config().max_batch)?;
        if keys.iter().any(|k| k.namespace != binding.namespace) {
            return Err(Error::InvalidArgument(
                "every wanted block must be of the binding's namespace".into(),
            ));
        }
        let namespace = self
            .store
            .namespace(&binding.namespace)
            .ok_or_else(|| Error::NotFound("the wanted blocks' namespace".into()))?;
        self.admit(peer, &binding)?;
        let transfer = self.new_transfer_id();
        let ttl_ms = self.limits.deadline.as_millis() as u64;
        let sid = self.store.open_session(
            &format!("transfer {transfer} to node {}", peer.node_id),
            ttl_ms + 5_000,
        )?;
        let pins = match self.store.acquire(sid, keys, Some(ttl_ms)) {
            Ok(p) => p,
            Err(e) => {
                self.store.close_session(sid);
                return Err(e);
            }
        };
        let expires_at_ms = backends.now_ms() + ttl_ms;
        let (mut blocks, mut handles) = (Vec::with_capacity(keys.len()), Vec::new());
        for p in pins {
            let Ok(info) = p else {
                blocks.push(None);
                continue;
            };
            let g = Grant {
                transfer: TransferId(transfer),
                epoch: binding.epoch,
                segment: POOL_SEGMENT,
                offset: info.offset,
                len: info.len,
                direction: Direction::RemoteRead,
                expires_at_ms,
                peer: Some(peer.peer_node()),
            };
            // SAFETY: the page holds a PUBLISHED block pinned by this transfer's session:
            // its bytes are immutable and the page is not reused until the pin goes, which
            // happens only after the grant is revoked.
            if let Err(e) = unsafe { backends.grant(g) } {
                backends.revoke(TransferId(transfer));
                self.store.close_session(sid);
                return Err(e.into());
            }
            // its sealed CRC-32C goes with a read of it (the reader's check is end to end)
            backends.target().note_checksum(
                TransferId(transfer),
                POOL_SEGMENT,
                info.offset,
                info.len,
                info.checksum,
            );
            handles.push(info.handle);
            blocks.push(Some(Served {
                offset: info.offset,
                len: info.len,
                checksum: info.checksum,
            }));
        }
        self.lock().transfers.insert(
            transfer,
            InFlight {
                source_node: peer.node_id,
                connection,
                session: sid,
                handles,
                offsets: vec![],
                lens: vec![],
                checksums: vec![],
                checkpoint: None,
                deadline: Instant::now() + self.limits.deadline,
            },
        );
        Ok(PeerReply::Offering {
            transfer,
            segment: engine_segment(backends),
            namespace: Box::new(namespace),
            blocks,
            keys: vec![],
            tokens: 0,
        })
    }

    #[allow(clippy::too_many_arguments)]
    #[expect(
        clippy::too_many_lines,
        reason = "over the 120-line ratchet (135 lines) when it came in: shorten it, then drop this"
    )]
    fn offer(
        &self,
        backends: &Backends,
        connection: u64,
        peer: &Bind,
        binding: Binding,
        namespace: &NamespaceDescriptor,
        blocks: &[Offered],
        checkpoint: Option<CheckpointStep>,
    ) -> Result<PeerReply> {
        self.check_binding(backends, peer, &binding, End::Destination)?;
        if checkpoint.is_some() && binding.request == 0 {
            return Err(Error::InvalidArgument(
                "a checkpoint step names its request (0 is none)".into(),
            ));
        }
        if blocks.is_empty() {
            return Err(Error::InvalidArgument(
                "an offer holds at least one block".into(),
            ));
        }
        check_batch(blocks.len(), self.store.config().max_batch)?;
        let page = self.store.page_size();
        if let Some(b) = blocks.iter().find(|b| b.len == 0 || b.len > page) {
            return Err(Error::InvalidArgument(format!(
                "a block of {} bytes does not fit this node's {page}-byte pages",
                b.len
            )));
        }
        if blocks.iter().any(|b| b.key.namespace != binding.namespace) {
            return Err(Error::InvalidArgument(
                "every offered block must be of the binding's namespace".into(),
            ));
        }
        self.admit(peer, &binding)?;
        let ns = self.store.register_namespace(namespace)?;
        if ns != binding.namespace {
            return Err(Error::InvalidArgument(
                "the offered layout does not hash to the binding's namespace".into(),
            ));
        }
        let transfer = self.new_transfer_id();
        let lease_ms = self.limits.deadline.as_millis() as u64 + 5_000;
        let sid = self.store.open_session(
            &format!("transfer {transfer} from node {}", peer.node_id),
            lease_ms,
        )?;
        let undo = |handles: &[Handle]| {
            let _ = self.store.abort(sid, handles);
            self.store.close_session(sid);
        };
        let class = match checkpoint {
            Some(step) => {
                // the holder's manifest of the request, at this epoch (begun by the first
                // step; an older epoch is refused here, a newer one supersedes)
                if let Err(e) = self.store.manifest_begin(
                    sid,
                    binding.request,
                    binding.epoch,
                    binding.namespace,
                    0,
                    step.ttl_ms,
                ) {
                    undo(&[]);
                    if matches!(e, Error::StaleEpoch { .. }) {
                        self.counters
                            .binding_mismatches
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    return Err(e);
                }
                BlockClass::Checkpoint {
                    request: binding.request,
                    epoch: binding.epoch,
                }
            }
            None => BlockClass::Cache,
        };
        let keys: Vec<_> = blocks.iter().map(|b| b.key).collect();
        let allocs = match self.store.alloc_for_write(sid, &keys, class, None) {
            Ok(a) => a,
            Err(e) => {
                undo(&[]);
                return Err(e);
            }
        };
        let mut offsets = Vec::with_capacity(blocks.len());
        let (mut handles, mut pages, mut lens, mut checksums) = (vec![], vec![], vec![], vec![]);
        for (a, b) in allocs.into_iter().zip(blocks) {
            match a {
                Ok(a) => {
                    offsets.push(Some(a.offset));
                    pages.push(a.offset);
                    handles.push(a.handle);
                    lens.push(b.len);
                    checksums.push(b.checksum);
                }
                Err(Error::AlreadyExists(_)) => offsets.push(None),
                Err(e) => {
                    undo(&handles);
                    return Err(e);
                }
            }
        }
        let expires_at_ms = backends.now_ms() + self.limits.deadline.as_millis() as u64;
        for (off, len) in offsets.iter().flatten().zip(&lens) {
            let g = Grant {
                transfer: TransferId(transfer),
                epoch: binding.epoch,
                segment: POOL_SEGMENT,
                offset: *off,
                len: *len,
                direction: Direction::RemoteWrite,
                expires_at_ms,
                peer: Some(peer.peer_node()),
            };
            // SAFETY: the page belongs to a WRITING block of this transfer's own session:
            // no client writes or reads it, and it is not reused before the transfer ends,
            // which revokes the grant (waiting for chunks in flight) before it frees or
            // publishes the page.
            if let Err(e) = unsafe { backends.grant(g) } {
                backends.revoke(TransferId(transfer));
                undo(&handles);
                return Err(e.into());
            }
        }
        let segment = engine_segment(backends);
        self.lock().transfers.insert(
            transfer,
            InFlight {
                source_node: peer.node_id,
                connection,
                session: sid,
                handles,
                offsets: pages,
                lens,
                checksums,
                checkpoint: checkpoint.map(|c| (binding.request, binding.epoch, c)),
                deadline: Instant::now() + self.limits.deadline,
            },
        );
        Ok(PeerReply::Accepted {
            transfer,
            segment,
            offsets,
        })
    }

    fn commit(
        &self,
        backends: &Backends,
        connection: u64,
        peer: &Bind,
        transfer: u64,
    ) -> Result<PeerReply> {
        self.owned_by(connection, peer, transfer)?;
        let Some(t) = self.lock().transfers.remove(&transfer) else {
            return Err(Error::NotFound(format!("transfer {transfer}")));
        };
        // no peer may touch the pages from here on
        let revoked = backends.revoke(TransferId(transfer));
        let verdict = (|| {
            if revoked.corrupt_chunks > 0 {
                // the engine refused those chunks already; whatever the source says now, the
                // pages' bytes are not what it sent
                self.counters
                    .checksum_failures
                    .fetch_add(u64::from(revoked.corrupt_chunks), Ordering::Relaxed);
                return Err(Error::Corrupt {
                    expected: 0,
                    found: 0,
                    outcome: crate::error::Corruption::AtSeal,
                });
            }
            for (i, h) in t.handles.iter().enumerate() {
                // The block's CRC-32C from the chunks the engine verified on arrival (no pass
                // over the page), or, where they do not tile it, from the page itself.
                let found = match revoked.ledger.crc_of(POOL_SEGMENT, t.offsets[i], t.lens[i]) {
                    Some(crc) if crc == t.checksums[i] => {
                        self.store.seal(t.session, h, t.lens[i], Some(crc))?
                    }
                    Some(crc) => crc,
                    None => self.store.seal(t.session, h, t.lens[i], None)?,
                };
                if found != t.checksums[i] {
                    self.counters
                        .checksum_failures
                        .fetch_add(1, Ordering::Relaxed);
                    return Err(Error::Corrupt {
                        expected: t.checksums[i],
                        found,
                        outcome: crate::error::Corruption::AtSeal,
                    });
                }
            }
            match t.checkpoint {
                // one atomic step of the manifest: the blocks and the committed count
                Some((request, epoch, step)) => {
                    self.store.manifest_extend(
                        t.session,
                        request,
                        epoch,
                        &t.handles,
                        step.committed_tokens,
                    )?;
                }
                None if !t.handles.is_empty() => self.store.publish(t.session, &t.handles)?,
                None => {}
            }
            Ok(())
        })();
        match verdict {
            Ok(()) => {
                self.store.close_session(t.session);
                self.counters
                    .blocks_received
                    .fetch_add(t.handles.len() as u64, Ordering::Relaxed);
                self.counters
                    .bytes_received
                    .fetch_add(t.lens.iter().sum::<u64>(), Ordering::Relaxed);
                Ok(PeerReply::Committed {
                    blocks: t.handles.len() as u32,
                })
            }
            Err(e) => {
                let _ = self.store.abort(t.session, &t.handles);
                self.store.close_session(t.session);
                self.counters
                    .aborted_incoming
                    .fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    /// Abort a transfer: revoke its grants (waiting for chunks in flight), free its pages.
    pub fn abort(&self, backends: &Backends, transfer: u64) {
        let Some(t) = self.lock().transfers.remove(&transfer) else {
            return;
        };
        backends.revoke(TransferId(transfer));
        let _ = self.store.abort(t.session, &t.handles);
        self.store.close_session(t.session);
    }

    /// Abort transfers past their deadline (at most `budget`); how many.
    pub fn reap(&self, backends: &Backends, budget: usize) -> usize {
        let now = Instant::now();
        let late: Vec<u64> = self
            .lock()
            .transfers
            .iter()
            .filter(|(_, t)| t.deadline <= now)
            .map(|(id, _)| *id)
            .take(budget)
            .collect();
        for id in &late {
            self.counters
                .aborted_incoming
                .fetch_add(1, Ordering::Relaxed);
            self.abort(backends, *id);
        }
        late.len()
    }
}

fn engine_segment(backends: &Backends) -> Vec<u8> {
    backends
        .target()
        .descriptor(POOL_SEGMENT)
        .map(|d| d.encode().to_vec())
        .unwrap_or_default()
}
