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

use transport::channel::Channel;
use transport::engine::{Op as TransferOp, OpKind};
use transport::grant::TransferId;
use transport::link::PeerAddr;
use transport::link::wire::Bind;
use transport::segment::SegmentDescriptor;

use transport::registry::Backends;

mod cluster;
pub use cluster::{LOCATE_TIMEOUT, MAX_LOCATE_PEERS, plan_pieces};

use super::Counters;
use super::wire::{Binding, CheckpointStep, Offered, PeerReply, PeerRequest, Served, ask};
use crate::POOL_SEGMENT;
use crate::keys::BlockKey;
use crate::protocol::{TransferInfo, TransferState, WireError};
use crate::store::{BlockClass, BlockInfo, Store};
use crate::{Error, Result};

/// What a transfer this node starts does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// Our blocks to the peer (cache blocks there).
    Push,
    /// The peer's blocks to us, by key.
    Fetch,
    /// A cluster lookup's fetch: the longest run of these keys (from the first) that the
    /// peers hold between them, located by asking each live peer which it holds, then
    /// fetched from each holder of a piece in turn. Keys the peers lack end the run; a piece
    /// that comes back short (its blocks evicted since the locate) or fails ends it too, and
    /// what arrived before it stays published: a shorter hit, never other bytes.
    FetchCluster,
    /// One checkpoint step of a request to its holder.
    PushCheckpoint {
        /// The request.
        request: u64,
        /// Its epoch.
        epoch: u64,
        /// Its committed token count after the step.
        committed_tokens: u64,
        /// The holder's manifest TTL, ms.
        ttl_ms: u64,
    },
    /// The recovery read: the longest verified checkpoint prefix of a request from its holder.
    FetchPrefix {
        /// The request.
        request: u64,
        /// Its token history.
        tokens: Vec<u32>,
    },
    /// A hand-off: the peer's blocks to us, by key, from its hold of `request` at `epoch`
    /// (refused unless that hold lives and holds every key).
    FetchHeld {
        /// The request the run was held for.
        request: u64,
        /// The epoch of the attempt that held it.
        epoch: u64,
        /// End the hold once every block is published here (no one else will read it).
        end_hold: bool,
    },
}

/// What a fetch asks the peer for.
#[derive(Debug)]
enum Wanted {
    /// These keys (a hand-off's when bound to a hold: request, epoch, end it after).
    Keys(Option<(u64, u64, bool)>),
    /// The longest verified checkpoint prefix of a request that these tokens continue.
    Prefix(u64, Vec<u32>),
}

/// Blocks, bytes and (for a prefix) tokens a transfer moved.
type Moved = (u32, u64, u64);

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
    /// Peers avoided until then (at most one entry per peer).
    suppressed: HashMap<u64, Instant>,
}

/// How long a peer that failed a transfer (its connection broke or stalled) is avoided.
pub const SUPPRESS_FOR: Duration = Duration::from_secs(2);

/// Pushes from this node.
#[derive(Debug)]
pub struct Outgoing {
    store: Arc<Store>,
    node_id: u64,
    peers: std::sync::RwLock<BTreeMap<u64, SocketAddr>>,
    limits: OutgoingLimits,
    table: Mutex<Table>,
    /// Control connections whose transfer ended cleanly, per peer, for the next transfer.
    idle: Mutex<HashMap<u64, Vec<(Channel, Bind)>>>,
    counters: Arc<Counters>,
}

/// Idle control connections kept per peer.
const IDLE_CONTROL_PER_PEER: usize = 4;

/// How long a failed transfer waits for the peer to acknowledge its abort or release.
const ABORT_TIMEOUT: Duration = Duration::from_secs(1);

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
            peers: std::sync::RwLock::new(peers),
            limits,
            table: Mutex::new(Table {
                next: 1,
                ..Table::default()
            }),
            idle: Mutex::new(HashMap::new()),
            counters,
        }
    }

    /// Replace the peer table (from `--peer`, or from the membership view).
    pub fn set_peers(&self, peers: BTreeMap<u64, SocketAddr>) {
        *self.peers.write().unwrap_or_else(|p| p.into_inner()) = peers;
    }

    /// The peer table.
    pub fn peers(&self) -> BTreeMap<u64, SocketAddr> {
        self.peers.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn addr_of(&self, peer: u64) -> Option<SocketAddr> {
        self.peers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&peer)
            .copied()
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
        if peer != crate::protocol::ANY_NODE && self.addr_of(peer).is_none() {
            return Err(Error::NotFound(format!(
                "node {peer} is not in this daemon's peer table (--peer {peer}=ADDR)"
            )));
        }
        let mut t = self.table();
        // local suppression: a peer that just failed a transfer is avoided for a while, even
        // before its lease runs out
        if let Some(&until) = t.suppressed.get(&peer) {
            let now = Instant::now();
            if now < until {
                self.counters.suppressed.fetch_add(1, Ordering::Relaxed);
                return Err(Error::Unavailable(format!(
                    "node {peer} failed a transfer moments ago; avoided here for another {} ms \
                     (try another node, or retry then)",
                    (until - now).as_millis()
                )));
            }
            t.suppressed.remove(&peer);
        }
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
                tokens: 0,
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
        self.counters
            .transfers_started
            .fetch_add(1, Ordering::Relaxed);
        Ok(id)
    }

    /// Run admitted transfer `id` to its end (blocking) and record the outcome.
    pub fn run(&self, backends: &Backends, id: u64, kind: Kind, peer: u64, keys: &[BlockKey]) {
        let started = Instant::now();
        let kind_label = match kind {
            Kind::Fetch | Kind::FetchPrefix { .. } | Kind::FetchHeld { .. } => "fetch",
            Kind::FetchCluster => "cluster fetch",
            Kind::Push | Kind::PushCheckpoint { .. } => "push",
        };
        let outcome = match kind {
            Kind::Push => self.push(backends, peer, keys, None),
            Kind::PushCheckpoint {
                request,
                epoch,
                committed_tokens,
                ttl_ms,
            } => {
                let step = CheckpointStep {
                    committed_tokens,
                    ttl_ms,
                };
                self.push(backends, peer, keys, Some((request, epoch, step)))
            }
            Kind::Fetch => self.fetch(backends, peer, keys, Wanted::Keys(None)),
            Kind::FetchCluster => self.fetch_cluster(backends, id, keys),
            Kind::FetchHeld {
                request,
                epoch,
                end_hold,
            } => {
                let held = Some((request, epoch, end_hold));
                self.fetch(backends, peer, keys, Wanted::Keys(held))
            }
            Kind::FetchPrefix { request, tokens } => {
                self.fetch(backends, peer, &[], Wanted::Prefix(request, tokens))
            }
        };
        let mut t = self.table();
        if let Some(n) = t.running.get_mut(&peer) {
            *n -= 1;
            if *n == 0 {
                t.running.remove(&peer);
            }
        }
        let fetch = kind_label != "push";
        let latency = match kind_label {
            "push" => &self.counters.push_seconds,
            "fetch" => &self.counters.fetch_seconds,
            _ => &self.counters.cluster_fetch_seconds,
        };
        latency.observe(started.elapsed().as_secs_f64());
        if outcome.as_ref().is_err_and(peer_gone) {
            t.suppressed.insert(peer, Instant::now() + SUPPRESS_FOR);
        }
        let Some(p) = t.pushes.get_mut(&id) else {
            return;
        };
        p.elapsed_ms = started.elapsed().as_millis() as u64;
        match outcome {
            Ok((blocks, bytes, tokens)) => {
                p.state = TransferState::Done;
                p.blocks = blocks;
                p.bytes = bytes;
                p.tokens = tokens;
                self.counters.transfers_done.fetch_add(1, Ordering::Relaxed);
                // a fetch's blocks were received here (counted as they were published)
                if !fetch {
                    self.counters
                        .blocks_sent
                        .fetch_add(u64::from(blocks), Ordering::Relaxed);
                    self.counters.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
                }
            }
            Err(e) => {
                tracing::warn!(transfer = id, kind = kind_label, peer, error = %e, "transfer failed");
                let e = WireError::from(e);
                self.counters.failed(&e);
                p.state = TransferState::Failed(e);
                self.counters
                    .transfers_failed
                    .fetch_add(1, Ordering::Relaxed);
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
    fn push(
        &self,
        backends: &Backends,
        peer: u64,
        keys: &[BlockKey],
        checkpoint: Option<(u64, u64, CheckpointStep)>,
    ) -> Result<Moved> {
        let ttl_ms = self.limits.timeout.as_millis() as u64;
        let sid = self
            .store
            .open_session(&format!("push to node {peer}"), ttl_ms + 5_000)?;
        let mut pinned = Vec::new();
        let r = (|| {
            for r in self.store.acquire(sid, keys, Some(ttl_ms))? {
                pinned.push(r?);
            }
            self.offer_and_send(backends, peer, &pinned, checkpoint)
        })();
        let handles: Vec<_> = pinned.iter().map(|b| b.handle).collect();
        let _ = self.store.release(sid, &handles);
        self.store.close_session(sid);
        r
    }

    fn offer_and_send(
        &self,
        backends: &Backends,
        peer: u64,
        blocks: &[BlockInfo],
        checkpoint: Option<(u64, u64, CheckpointStep)>,
    ) -> Result<Moved> {
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
        let addr = self
            .addr_of(peer)
            .ok_or_else(|| Error::NotFound(format!("node {peer} left the peer table")))?;
        let tcp_peer = PeerAddr {
            addr,
            node_id: peer,
        };
        let (request, epoch) = checkpoint.map_or((0, 1), |(r, e, _)| (r, e));
        let binding_for = |bind: &Bind| Binding {
            request,
            namespace: ns,
            source_node: self.node_id,
            source_generation: backends.target().node_generation(),
            destination_node: peer,
            destination_generation: bind.node_generation,
            epoch,
        };
        let offer = |bind: &Bind| PeerRequest::Offer {
            binding: binding_for(bind),
            namespace: Box::new(namespace.clone()),
            blocks: blocks
                .iter()
                .map(|b| Offered {
                    key: b.key,
                    len: b.len,
                    checksum: b.checksum,
                })
                .collect(),
            checkpoint: checkpoint.map(|(_, _, step)| step),
        };
        let (mut s, bind, first) = self.first_ask(backends, &tcp_peer, offer)?;
        let binding = binding_for(&bind);
        let (transfer, segment, offsets) = match first {
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
        // the blocks' sealed checksums travel with them (checked end to end by the peer)
        let sealed: Vec<Option<u32>> = blocks
            .iter()
            .zip(&offsets)
            .filter(|(_, off)| off.is_some())
            .map(|(b, _)| Some(b.checksum))
            .collect();
        if !ops.is_empty()
            && let Err(e) = self.send(backends, tcp_peer, &ops, &sealed)
        {
            // Tell the peer, briefly: if the link is gone it aborts anyway when the
            // connection dies (or at its deadline), and the caller should hear of the failure
            // now, not after another timeout.
            let _ = s.stream().set_read_timeout(Some(ABORT_TIMEOUT));
            let _ = s.stream().set_write_timeout(Some(ABORT_TIMEOUT));
            let _ = ask(&mut s, &PeerRequest::Abort { transfer });
            return Err(e);
        }
        match ask(&mut s, &PeerRequest::Commit { transfer })? {
            PeerReply::Committed { blocks } => {
                self.park(peer, s, bind);
                Ok((blocks, bytes, 0))
            }
            r => Err(refusal(r)),
        }
    }

    /// Send the first request of a transfer on a control connection to `peer`: an idle one
    /// kept from an earlier transfer if there is one (and, should that one turn out dead, a
    /// fresh one, once), else a fresh one. `request` is built from the peer's introduction
    /// (its node generation). The connection, the introduction and the answer.
    fn first_ask(
        &self,
        backends: &Backends,
        peer: &PeerAddr,
        request: impl Fn(&Bind) -> PeerRequest,
    ) -> Result<(Channel, Bind, PeerReply)> {
        self.first_ask_within(backends, peer, self.limits.timeout, request)
    }

    /// [`Outgoing::first_ask`], waiting at most `timeout` for each answer on the connection.
    fn first_ask_within(
        &self,
        backends: &Backends,
        peer: &PeerAddr,
        timeout: Duration,
        request: impl Fn(&Bind) -> PeerRequest,
    ) -> Result<(Channel, Bind, PeerReply)> {
        let idle = self
            .idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(&peer.node_id)
            .and_then(Vec::pop);
        if let Some((mut s, bind)) = idle {
            let _ = s.stream().set_read_timeout(Some(timeout));
            if let Ok(answer) = ask(&mut s, &request(&bind)) {
                return Ok((s, bind, answer));
            }
        }
        let (mut s, bind) = backends.open_control(peer)?;
        let _ = s.stream().set_read_timeout(Some(timeout));
        let answer = ask(&mut s, &request(&bind))?;
        Ok((s, bind, answer))
    }

    /// Avoid `peer` for [`SUPPRESS_FOR`] (it failed a transfer or did not answer a locate).
    fn avoid(&self, peer: u64) {
        self.table()
            .suppressed
            .insert(peer, Instant::now() + SUPPRESS_FOR);
    }

    /// Keep only the idle control connections `keep(peer node, its generation at the
    /// handshake)` approves of.
    pub fn retain_idle(&self, keep: impl Fn(u64, u64) -> bool) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        for (node, v) in idle.iter_mut() {
            v.retain(|(_, bind)| keep(*node, bind.node_generation));
        }
        idle.retain(|_, v| !v.is_empty());
    }

    /// Keep a control connection whose transfer ended cleanly for the next one (at most
    /// [`IDLE_CONTROL_PER_PEER`] per peer; more are closed).
    fn park(&self, peer: u64, s: Channel, bind: Bind) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let v = idle.entry(peer).or_default();
        if v.len() < IDLE_CONTROL_PER_PEER {
            v.push((s, bind));
        }
    }

    /// The fetch itself: the peer pins and grants, we allocate, read, verify, publish; the
    /// peer's pins go whatever happens, and so do our pages unless published.
    fn fetch(
        &self,
        backends: &Backends,
        peer: u64,
        keys: &[BlockKey],
        wanted: Wanted,
    ) -> Result<Moved> {
        // a prefix's namespace is the holder's manifest's; it names it in its answer
        let ns = match (keys.first(), &wanted) {
            (Some(first), Wanted::Keys(_)) => first.namespace,
            (None, Wanted::Prefix(..)) => crate::keys::NamespaceId([0; 32]),
            _ => return Err(Error::InvalidArgument("a fetch of no blocks".into())),
        };
        if keys.iter().any(|k| k.namespace != ns) {
            return Err(Error::InvalidArgument(
                "a fetch holds blocks of one namespace".into(),
            ));
        }
        // what the transfer is bound to: a prefix's or a hand-off's request and epoch
        let (request, epoch) = match &wanted {
            Wanted::Keys(None) => (0, 1),
            Wanted::Keys(Some((r, e, _))) => (*r, *e),
            Wanted::Prefix(r, _) => (*r, 1),
        };
        let tcp_peer = PeerAddr {
            addr: self
                .addr_of(peer)
                .ok_or_else(|| Error::NotFound(format!("node {peer} left the peer table")))?,
            node_id: peer,
        };
        let binding_for = |bind: &Bind| Binding {
            request,
            namespace: ns,
            source_node: peer,
            source_generation: bind.node_generation,
            destination_node: self.node_id,
            destination_generation: backends.target().node_generation(),
            epoch,
        };
        let want = |bind: &Bind| match &wanted {
            Wanted::Prefix(_, tokens) => PeerRequest::WantPrefix {
                binding: binding_for(bind),
                tokens: tokens.clone(),
            },
            Wanted::Keys(_) => PeerRequest::Want {
                binding: binding_for(bind),
                keys: keys.to_vec(),
            },
        };
        let prefix = matches!(wanted, Wanted::Prefix(..));
        let (mut s, bind, first) = self.first_ask(backends, &tcp_peer, want)?;
        let binding = binding_for(&bind);
        let (transfer, segment, namespace, served, prefix_keys, tokens) = match first {
            PeerReply::Offering {
                transfer,
                segment,
                namespace,
                blocks,
                keys,
                tokens,
            } => (transfer, segment, namespace, blocks, keys, tokens),
            // nothing of the request to restore there
            PeerReply::Refused(WireError::NotFound(_)) if prefix => {
                self.park(peer, s, bind);
                return Ok((0, 0, 0));
            }
            r => return Err(refusal(r)),
        };
        let (keys, expected_ns) = if prefix {
            (&prefix_keys[..], None)
        } else {
            (keys, Some(binding.namespace))
        };
        let r = self
            .receive(
                backends,
                peer,
                tcp_peer,
                &binding,
                expected_ns,
                transfer,
                &segment,
                &namespace,
                keys,
                &served,
            )
            .map(|(blocks, bytes)| (blocks, bytes, tokens));
        // the peer's pins go in any case (it also releases them when the connection dies or
        // at its deadline, so after a failure the answer is not waited for long)
        if r.is_err() {
            let _ = s.stream().set_read_timeout(Some(ABORT_TIMEOUT));
            let _ = s.stream().set_write_timeout(Some(ABORT_TIMEOUT));
        }
        let released = matches!(
            ask(&mut s, &PeerRequest::Release { transfer }),
            Ok(PeerReply::Released)
        );
        // a hand-off whose whole run is here now: its hold at the source ends (a failure to
        // say so leaves it to the hold's TTL)
        let whole = served.iter().all(Option::is_some);
        let ended = match (&r, &wanted) {
            (Ok(_), Wanted::Keys(Some((_, _, true)))) if released && whole => {
                matches!(
                    ask(&mut s, &PeerRequest::EndHold { binding }),
                    Ok(PeerReply::HoldEnded(_))
                )
            }
            _ => true,
        };
        if released && ended && r.is_ok() {
            self.park(peer, s, bind);
        }
        r
    }

    /// Receive a fetch's blocks into freshly allocated pages, verify and publish them.
    #[allow(clippy::too_many_arguments)]
    fn receive(
        &self,
        backends: &Backends,
        peer: u64,
        tcp_peer: PeerAddr,
        binding: &Binding,
        expected_ns: Option<crate::keys::NamespaceId>,
        transfer: u64,
        segment: &[u8],
        namespace: &crate::keys::NamespaceDescriptor,
        keys: &[BlockKey],
        served: &[Option<Served>],
    ) -> Result<(u32, u64)> {
        let ns = self.store.register_namespace(namespace)?;
        let other_blocks = served.len() != keys.len()
            || expected_ns.is_some_and(|e| e != ns)
            || keys.iter().any(|k| k.namespace != ns);
        if other_blocks {
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
                .alloc_for_write(sid, &ks, BlockClass::Cache, None)?
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
            let crcs = if ops.is_empty() {
                vec![]
            } else {
                // SAFETY (inside send): the local ranges are WRITING pages of this fetch's own
                // session, which no client touches and which are not reused before it ends.
                self.send(backends, tcp_peer, &ops, &[])?
            };
            for (i, (a, s)) in got.iter().enumerate() {
                // the block's CRC-32C from the chunks verified on arrival (no pass over the
                // page), or, where they are not known, from the page itself
                let found = match crcs.get(i).copied().flatten() {
                    Some(crc) if crc == s.checksum => {
                        self.store.seal(sid, &a.handle, s.len, Some(crc))?
                    }
                    Some(crc) => crc,
                    None => self.store.seal(sid, &a.handle, s.len, None)?,
                };
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

    /// One batch of reads or writes with `peer` (over RDMA where both ends have it, else
    /// TCP; see [`Backends::run_batch`]).
    fn send(
        &self,
        backends: &Backends,
        tcp_peer: PeerAddr,
        ops: &[TransferOp],
        checksums: &[Option<u32>],
    ) -> Result<Vec<Option<u32>>> {
        // SAFETY: every local range is either a PUBLISHED block pinned by this push's session
        // (immutable, its page not reused while pinned), read only; or a WRITING page of this
        // fetch's own session, which nothing else touches and which is not reused before the
        // session ends, after the batch settles (run_batch returns only then).
        Ok(unsafe { backends.run_batch(tcp_peer, ops, checksums, self.limits.timeout) }?)
    }
}

/// Whether `e` says the peer is gone or unreachable (it is then avoided a while).
fn peer_gone(e: &Error) -> bool {
    matches!(
        e,
        Error::Disconnected(_) | Error::Unavailable(_) | Error::Io(_)
    )
}

fn refusal(r: PeerReply) -> Error {
    match r {
        PeerReply::Refused(e) => e.into(),
        other => Error::Protocol(format!("the peer answered out of turn: {other:?}")),
    }
}
