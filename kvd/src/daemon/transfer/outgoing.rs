//! Transfers this node starts: a push (pin the blocks, offer them to the peer, write them into
//! the pages it granted in one batch over the transfer engine, commit, unpin) and a fetch (ask
//! the peer for blocks, allocate pages here, read them from the pages it granted, verify and
//! publish them, release the peer's pins). Each runs on its own thread (a bounded number at
//! once); its outcome is kept, a bounded number of them, for
//! [`crate::protocol::Op::Transfers`].

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use transport::engine::{EndpointId, Op as TransferOp, OpKind, Transport};
use transport::grant::TransferId;
use transport::segment::SegmentDescriptor;
use transport::tcp::{TcpPeer, TcpTransport};

use super::Counters;
use super::wire::{Binding, Offered, PeerReply, PeerRequest, Served};
use crate::daemon::data_port::POOL_SEGMENT;
use crate::keys::BlockKey;
use crate::protocol::{TransferInfo, TransferState, WireError};
use crate::store::{BlockClass, BlockInfo, Store};
use crate::{Error, Result};

/// Which way a transfer this node starts goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Our blocks to the peer.
    Push,
    /// The peer's blocks to us.
    Fetch,
}

/// Bounds on transfers this node starts.
#[derive(Debug, Clone, Copy)]
pub struct OutgoingLimits {
    /// Pushes in flight to one peer.
    pub per_peer: usize,
    /// Pushes in flight in all.
    pub total: usize,
    /// Finished pushes whose outcome is kept (the oldest is forgotten first).
    pub kept: usize,
    /// How long one push may take, end to end.
    pub timeout: Duration,
}

impl Default for OutgoingLimits {
    fn default() -> OutgoingLimits {
        OutgoingLimits {
            per_peer: 8,
            total: 16,
            kept: 1024,
            timeout: Duration::from_secs(60),
        }
    }
}

#[derive(Debug, Default)]
struct Table {
    next: u64,
    pushes: BTreeMap<u64, TransferInfo>,
    running: HashMap<u64, usize>,
}

/// Pushes from this node.
#[derive(Debug)]
pub struct Outgoing {
    store: Arc<Store>,
    node_id: u64,
    peers: BTreeMap<u64, SocketAddr>,
    limits: OutgoingLimits,
    table: Mutex<Table>,
    endpoints: Mutex<HashMap<u64, EndpointId>>,
    counters: Arc<Counters>,
}

impl Outgoing {
    /// No push yet.
    pub fn new(
        store: Arc<Store>,
        node_id: u64,
        peers: BTreeMap<u64, SocketAddr>,
        limits: OutgoingLimits,
        counters: Arc<Counters>,
    ) -> Outgoing {
        Outgoing {
            store,
            node_id,
            peers,
            limits,
            table: Mutex::new(Table {
                next: 1,
                ..Table::default()
            }),
            endpoints: Mutex::new(HashMap::new()),
            counters,
        }
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Pushes in flight.
    pub fn in_flight(&self) -> usize {
        self.table().running.values().sum()
    }

    /// Admit a push to `peer` (bounded) and give it an id; the caller runs it with
    /// [`Outgoing::run`].
    ///
    /// # Errors
    /// [`Error::NotFound`] for a peer not in the table, [`Error::Overloaded`] past a bound.
    pub fn admit(&self, peer: u64) -> Result<u64> {
        if !self.peers.contains_key(&peer) {
            return Err(Error::NotFound(format!(
                "node {peer} is not in this daemon's peer table (--peer {peer}=ADDR)"
            )));
        }
        let mut t = self.table();
        let to_peer = t.running.get(&peer).copied().unwrap_or(0);
        let total: usize = t.running.values().sum();
        if to_peer >= self.limits.per_peer || total >= self.limits.total {
            self.counters.overloaded.fetch_add(1, Ordering::Relaxed);
            return Err(Error::Overloaded {
                what: format!(
                    "{to_peer} pushes to node {peer} and {total} in all are in flight (limits {} / {})",
                    self.limits.per_peer, self.limits.total
                ),
                retry_after_ms: 50,
            });
        }
        let id = t.next;
        t.next += 1;
        *t.running.entry(peer).or_default() += 1;
        t.pushes.insert(
            id,
            TransferInfo {
                id,
                peer,
                state: TransferState::InFlight,
                blocks: 0,
                bytes: 0,
                elapsed_ms: 0,
            },
        );
        // forget the oldest finished pushes past the bound
        while t.pushes.len() > self.limits.kept {
            let oldest_done = t
                .pushes
                .iter()
                .find(|(_, p)| p.state != TransferState::InFlight)
                .map(|(id, _)| *id);
            match oldest_done {
                Some(old) => t.pushes.remove(&old),
                None => break,
            };
        }
        self.counters.pushes_started.fetch_add(1, Ordering::Relaxed);
        Ok(id)
    }

    /// Run admitted transfer `id` to its end (blocking) and record the outcome.
    pub fn run(&self, engine: &TcpTransport, id: u64, kind: Kind, peer: u64, keys: &[BlockKey]) {
        let started = Instant::now();
        let outcome = match kind {
            Kind::Push => self.push(engine, peer, keys),
            Kind::Fetch => self.fetch(engine, peer, keys),
        };
        let mut t = self.table();
        if let Some(n) = t.running.get_mut(&peer) {
            *n -= 1;
            if *n == 0 {
                t.running.remove(&peer);
            }
        }
        let Some(p) = t.pushes.get_mut(&id) else {
            return;
        };
        p.elapsed_ms = started.elapsed().as_millis() as u64;
        match outcome {
            Ok((blocks, bytes)) => {
                p.state = TransferState::Done;
                p.blocks = blocks;
                p.bytes = bytes;
                self.counters.pushes_done.fetch_add(1, Ordering::Relaxed);
                self.counters
                    .blocks_sent
                    .fetch_add(u64::from(blocks), Ordering::Relaxed);
                self.counters.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
            }
            Err(e) => {
                tracing::warn!(push = id, peer, error = %e, "push failed");
                p.state = TransferState::Failed(WireError::from(e));
                self.counters.pushes_failed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// The recorded states of `ids` (unknown ones left out).
    pub fn status(&self, ids: &[u64]) -> Vec<TransferInfo> {
        let t = self.table();
        ids.iter()
            .filter_map(|id| t.pushes.get(id).cloned())
            .collect()
    }

    /// The push itself: pinned, offered, written, committed; the pins go whatever happens.
    fn push(&self, engine: &TcpTransport, peer: u64, keys: &[BlockKey]) -> Result<(u32, u64)> {
        let ttl_ms = self.limits.timeout.as_millis() as u64;
        let sid = self
            .store
            .open_session(&format!("push to node {peer}"), ttl_ms + 5_000)?;
        let mut pinned = Vec::new();
        let r = (|| {
            for r in self.store.acquire(sid, keys, Some(ttl_ms))? {
                pinned.push(r?);
            }
            self.offer_and_send(engine, peer, &pinned)
        })();
        let handles: Vec<_> = pinned.iter().map(|b| b.handle).collect();
        let _ = self.store.release(sid, &handles);
        self.store.close_session(sid);
        r
    }

    fn offer_and_send(
        &self,
        engine: &TcpTransport,
        peer: u64,
        blocks: &[BlockInfo],
    ) -> Result<(u32, u64)> {
        let Some(first) = blocks.first() else {
            return Err(Error::InvalidArgument("a push of no blocks".into()));
        };
        let ns = first.key.namespace;
        if blocks.iter().any(|b| b.key.namespace != ns) {
            return Err(Error::InvalidArgument(
                "a push holds blocks of one namespace".into(),
            ));
        }
        let namespace = self
            .store
            .namespace(&ns)
            .ok_or_else(|| Error::NotFound("the blocks' namespace".into()))?;
        let addr = self.peers[&peer];
        let tcp_peer = TcpPeer {
            addr,
            node_id: peer,
        };
        let (mut s, bind) = engine.open_control(&tcp_peer)?;
        let _ = s.set_read_timeout(Some(self.limits.timeout));
        let binding = Binding {
            request: 0,
            namespace: ns,
            source_node: self.node_id,
            source_generation: self.store.node_generation(),
            destination_node: peer,
            destination_generation: bind.node_generation,
            epoch: 1,
        };
        let offer = PeerRequest::Offer {
            binding,
            namespace: Box::new(namespace),
            blocks: blocks
                .iter()
                .map(|b| Offered {
                    key: b.key,
                    len: b.len,
                    checksum: b.checksum,
                })
                .collect(),
        };
        let (transfer, segment, offsets) = match ask(&mut s, &offer)? {
            PeerReply::Accepted {
                transfer,
                segment,
                offsets,
            } => (transfer, segment, offsets),
            r => return Err(refusal(r)),
        };
        let remote = SegmentDescriptor::decode(&segment).map_err(Error::from)?;
        if offsets.len() != blocks.len() {
            return Err(Error::Protocol("the peer answered for other blocks".into()));
        }
        let ops: Vec<TransferOp> = blocks
            .iter()
            .zip(&offsets)
            .filter_map(|(b, off)| {
                off.map(|off| TransferOp {
                    kind: OpKind::Write,
                    local: POOL_SEGMENT,
                    local_offset: b.offset,
                    remote,
                    remote_offset: off,
                    len: b.len,
                    transfer: TransferId(transfer),
                    epoch: binding.epoch,
                })
            })
            .collect();
        let bytes: u64 = ops.iter().map(|o| o.len).sum();
        if !ops.is_empty()
            && let Err(e) = self.send(engine, peer, tcp_peer, &ops)
        {
            let _ = ask(&mut s, &PeerRequest::Abort { transfer });
            return Err(e);
        }
        match ask(&mut s, &PeerRequest::Commit { transfer })? {
            PeerReply::Committed { blocks } => Ok((blocks, bytes)),
            r => Err(refusal(r)),
        }
    }

    /// The fetch itself: the peer pins and grants, we allocate, read, verify, publish; the
    /// peer's pins go whatever happens, and so do our pages unless published.
    fn fetch(&self, engine: &TcpTransport, peer: u64, keys: &[BlockKey]) -> Result<(u32, u64)> {
        let Some(first) = keys.first() else {
            return Err(Error::InvalidArgument("a fetch of no blocks".into()));
        };
        let ns = first.namespace;
        if keys.iter().any(|k| k.namespace != ns) {
            return Err(Error::InvalidArgument(
                "a fetch holds blocks of one namespace".into(),
            ));
        }
        let tcp_peer = TcpPeer {
            addr: self.peers[&peer],
            node_id: peer,
        };
        let (mut s, bind) = engine.open_control(&tcp_peer)?;
        let _ = s.set_read_timeout(Some(self.limits.timeout));
        let binding = Binding {
            request: 0,
            namespace: ns,
            source_node: peer,
            source_generation: bind.node_generation,
            destination_node: self.node_id,
            destination_generation: self.store.node_generation(),
            epoch: 1,
        };
        let want = PeerRequest::Want {
            binding,
            keys: keys.to_vec(),
        };
        let (transfer, segment, namespace, served) = match ask(&mut s, &want)? {
            PeerReply::Offering {
                transfer,
                segment,
                namespace,
                blocks,
            } => (transfer, segment, namespace, blocks),
            r => return Err(refusal(r)),
        };
        let r = self.receive(
            engine, peer, tcp_peer, &binding, transfer, &segment, &namespace, keys, &served,
        );
        // the peer's pins go in any case
        let _ = ask(&mut s, &PeerRequest::Release { transfer });
        r
    }

    /// Receive a fetch's blocks into freshly allocated pages, verify and publish them.
    #[allow(clippy::too_many_arguments)]
    fn receive(
        &self,
        engine: &TcpTransport,
        peer: u64,
        tcp_peer: TcpPeer,
        binding: &Binding,
        transfer: u64,
        segment: &[u8],
        namespace: &crate::keys::NamespaceDescriptor,
        keys: &[BlockKey],
        served: &[Option<Served>],
    ) -> Result<(u32, u64)> {
        if served.len() != keys.len()
            || self.store.register_namespace(namespace)? != binding.namespace
        {
            return Err(Error::Protocol("the peer answered for other blocks".into()));
        }
        let remote = SegmentDescriptor::decode(segment).map_err(Error::from)?;
        let wanted: Vec<(BlockKey, Served)> = keys
            .iter()
            .zip(served)
            .filter_map(|(k, s)| s.map(|s| (*k, s)))
            .collect();
        if wanted.is_empty() {
            return Ok((0, 0));
        }
        let ttl_ms = self.limits.timeout.as_millis() as u64;
        let sid = self
            .store
            .open_session(&format!("fetch from node {peer}"), ttl_ms + 5_000)?;
        let r = (|| {
            let ks: Vec<BlockKey> = wanted.iter().map(|(k, _)| *k).collect();
            let mut got = Vec::new();
            for (a, (_, s)) in self
                .store
                .alloc(sid, &ks, BlockClass::Cache, None)?
                .into_iter()
                .zip(&wanted)
            {
                match a {
                    Ok(a) => got.push((a, *s)),
                    // held here already (someone else stored it meanwhile): nothing to read
                    Err(Error::AlreadyExists(_)) => {}
                    Err(e) => return Err(e),
                }
            }
            let handles: Vec<_> = got.iter().map(|(a, _)| a.handle).collect();
            for r in self.store.begin_write(sid, &handles)? {
                r?;
            }
            if got.iter().any(|(a, s)| s.len > a.capacity) {
                return Err(Error::InvalidArgument(
                    "a served block is larger than this node's pages".into(),
                ));
            }
            let ops: Vec<TransferOp> = got
                .iter()
                .map(|(a, s)| TransferOp {
                    kind: OpKind::Read,
                    local: POOL_SEGMENT,
                    local_offset: a.offset,
                    remote,
                    remote_offset: s.offset,
                    len: s.len,
                    transfer: TransferId(transfer),
                    epoch: binding.epoch,
                })
                .collect();
            if !ops.is_empty() {
                // SAFETY (inside send): the local ranges are WRITING pages of this fetch's own
                // session, which no client touches and which are not reused before it ends.
                self.send(engine, peer, tcp_peer, &ops)?;
            }
            for (a, s) in &got {
                let found = self.store.seal(sid, &a.handle, s.len, None)?;
                if found != s.checksum {
                    self.counters
                        .checksum_failures
                        .fetch_add(1, Ordering::Relaxed);
                    return Err(Error::Corrupt {
                        expected: s.checksum,
                        found,
                        outcome: crate::error::Corruption::AtSeal,
                    });
                }
            }
            if !handles.is_empty() {
                self.store.publish(sid, &handles)?;
            }
            let bytes = got.iter().map(|(_, s)| s.len).sum();
            Ok((got.len() as u32, bytes))
        })();
        // publishes stay; anything unfinished is freed with the session
        self.store.close_session(sid);
        if let Ok((blocks, bytes)) = r {
            self.counters
                .blocks_received
                .fetch_add(u64::from(blocks), Ordering::Relaxed);
            self.counters
                .bytes_received
                .fetch_add(bytes, Ordering::Relaxed);
        }
        r
    }

    /// One batch of reads or writes with `peer`, on its cached endpoint (reopened once if it failed).
    fn send(
        &self,
        engine: &TcpTransport,
        peer: u64,
        tcp_peer: TcpPeer,
        ops: &[TransferOp],
    ) -> Result<()> {
        let mut reopened = false;
        loop {
            let ep = {
                let mut eps = self.endpoints.lock().unwrap_or_else(|p| p.into_inner());
                match eps.get(&peer) {
                    Some(&ep) => ep,
                    None => {
                        let ep = engine.open(&tcp_peer)?;
                        eps.insert(peer, ep);
                        ep
                    }
                }
            };
            // SAFETY: every local range is either a PUBLISHED block pinned by this push's
            // session (immutable, its page not reused while pinned), read only; or a WRITING
            // page of this fetch's own session, which nothing else touches and which is not
            // reused before the session ends, after the batch settles (we wait for it below).
            let submitted = unsafe { engine.submit(ep, ops) };
            let batch = match submitted {
                Ok(b) => b,
                Err(transport::Error::PeerUnavailable(_)) if !reopened => {
                    self.forget_endpoint(engine, peer, ep);
                    reopened = true;
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            let mut st = engine.wait(batch, self.limits.timeout)?;
            if !st.settled {
                // The engine's stall timeout is far shorter; this is only a backstop. Closing
                // the endpoint fails what is left, and the batch settles once the kernel lets
                // go of its buffers: until then its pages must not be freed, so wait for it.
                self.forget_endpoint(engine, peer, ep);
                while !st.settled {
                    tracing::warn!(peer, "a transfer batch has not settled; waiting for it");
                    st = engine.wait(batch, self.limits.timeout)?;
                }
            }
            let _ = engine.release(batch);
            if st.succeeded() {
                return Ok(());
            }
            if st.first_failure.is_some_and(|f| {
                matches!(
                    f,
                    transport::engine::OpFailure::PeerClosed
                        | transport::engine::OpFailure::Timeout
                        | transport::engine::OpFailure::Protocol
                )
            }) {
                self.forget_endpoint(engine, peer, ep);
            }
            return Err(Error::Disconnected(format!(
                "the push to node {peer} failed: {} of {} blocks not delivered ({})",
                st.ops - st.done,
                st.ops,
                st.first_failure
                    .map_or_else(|| "cancelled".to_string(), |f| f.to_string())
            )));
        }
    }

    fn forget_endpoint(&self, engine: &TcpTransport, peer: u64, ep: EndpointId) {
        let mut eps = self.endpoints.lock().unwrap_or_else(|p| p.into_inner());
        if eps.get(&peer) == Some(&ep) {
            eps.remove(&peer);
            engine.close(ep);
        }
    }
}

fn ask(s: &mut std::net::TcpStream, req: &PeerRequest) -> Result<PeerReply> {
    crate::protocol::frame::write_frame(s, req)
        .map_err(|e| Error::Disconnected(format!("the peer's control connection: {e}")))?;
    crate::protocol::frame::read_frame(s)
        .map_err(|e| Error::Disconnected(format!("the peer's control connection: {e}")))
}

fn refusal(r: PeerReply) -> Error {
    match r {
        PeerReply::Refused(e) => e.into(),
        other => Error::Protocol(format!("the peer answered out of turn: {other:?}")),
    }
}
