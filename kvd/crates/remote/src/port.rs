//! The data port: this daemon's transfer backends (`transport::tcp`, and `transport::rdma`
//! where built in and usable, chosen per peer by `transport::registry::Backends`), on which
//! peers' transfer connections are accepted and from which this daemon opens its own. It is on
//! only with a cluster secret (`--cluster-secret-file`): a single node needs nothing but
//! itself. (In tests, [`DataPort::over`] runs it on in-process backends.)
//!
//! The whole pool is registered as one segment ([`POOL_SEGMENT`]); nothing of it is granted
//! but the pages of a transfer in progress (`crate::transfer`), so every other access a peer
//! tries is refused and counted. Control connections (authenticated the same way) carry the
//! daemons' own messages ([`crate::transfer::wire`]). Peers are named, with the key each must
//! prove, by the static list (`--peer NODE_ID=ADDR,key=…`, `--peers-file`) and in cluster mode
//! by etcd ([`crate::peers`]); this node proves its own id with its key
//! (`transport::link::identity`, `--node-key-file`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use transport::auth::ClusterSecret;
use transport::engine::Memory;
use transport::link::identity::{NodeKey, PublicKey};
use transport::link::members::Members;
use transport::segment::SegmentDescriptor;
use transport::tcp::{TcpConfig, TcpStats, TcpTransport};

use crate::DataPortConfig;
use crate::peers::{Peer, PeersFile, members_of};
use transport::registry::{Backends, BackendsReport};

use crate::keys::BlockKey;
use crate::protocol::TransferInfo;
use crate::store::Store;
use crate::transfer::incoming::{Incoming, IncomingLimits};
use crate::transfer::outgoing::{Kind, Outgoing, OutgoingLimits};
use crate::transfer::{Counters, TransferCounters};
use crate::{Error, Result};

pub use crate::{CHUNK_BYTES, POOL_SEGMENT};

/// Where the peer table comes from (later sources win for the same node).
#[derive(Debug)]
struct PeerSources {
    /// `--peer` entries.
    flags: BTreeMap<u64, Peer>,
    /// The peers file, as last read.
    file: Option<PeersFile>,
    /// Cluster membership's view.
    view: BTreeMap<u64, Peer>,
}

impl PeerSources {
    fn merged(&self) -> BTreeMap<u64, Peer> {
        let mut all = self.flags.clone();
        if let Some(f) = &self.file {
            all.extend(f.entries());
        }
        all.extend(&self.view);
        all
    }
}

/// The running data port.
#[derive(Debug)]
pub struct DataPort {
    backends: Backends,
    pool: SegmentDescriptor,
    node_id: u64,
    peers: Mutex<PeerSources>,
    incoming: Arc<Incoming>,
    outgoing: Arc<Outgoing>,
    counters: Arc<Counters>,
    stop: Arc<AtomicBool>,
}

impl Drop for DataPort {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

/// What `/status` shows of the data port.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct DataPortReport {
    /// The address peers connect to.
    pub listen: String,
    /// This node's id.
    pub node_id: u64,
    /// This node's public key, as peers list it (64 hex digits; empty in process).
    pub node_key: String,
    /// Nodes that may connect here now (peers with a usable key).
    pub members: u64,
    /// The pool's segment descriptor as peers name it (hex of its 32-byte wire form).
    pub pool_segment: String,
    /// The peer table (node id → data address): `--peer`, the peers file and membership.
    pub peers: BTreeMap<u64, String>,
    /// Ops and bytes in flight as initiator.
    pub ops_in_flight: u64,
    /// Bytes in flight as initiator.
    pub bytes_in_flight: u64,
    /// Grants live on this node's pool.
    pub live_grants: u64,
    /// The engine's counters.
    pub engine: EngineCounters,
    /// Pushes from here in flight.
    pub pushes_in_flight: u64,
    /// Transfers into here in flight.
    pub incoming_in_flight: u64,
    /// The transfers' counters.
    pub transfers: TransferCounters,
    /// What blocks move over (TCP or RDMA), and why; per peer.
    pub transport: BackendsReport,
}

/// The engine's counters, as `/status` and `/metrics` show them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct EngineCounters {
    /// Chunks moved as initiator.
    pub chunks_done: u64,
    /// Payload bytes moved as initiator.
    pub bytes_done: u64,
    /// Chunks served to peers.
    pub chunks_served: u64,
    /// Chunks whose CRC-32C this node found wrong.
    pub checksum_failures: u64,
    /// Peer accesses refused (no live grant, stale generation).
    pub refused: u64,
    /// Connections failed (error, close, stall, protocol).
    pub connections_failed: u64,
    /// Connections refused at the handshake (no secret, malformed, too many).
    pub handshakes_refused: u64,
    /// Frames that failed their integrity tag (changed in flight, replayed, forged), each
    /// closing its connection; and payloads that failed their MAC, each failing its chunk.
    pub integrity_failures: u64,
    /// Binds refused because they did not prove the node they claimed (no key for it here:
    /// not a member or revoked; a signature that does not verify; addressed elsewhere).
    pub identity_refusals: u64,
    /// Stall checks that kept a connection without a completion for the stall timeout
    /// because bytes were still moving under it (a slow link, not a stalled one).
    pub slow_progress: u64,
}

impl From<TcpStats> for EngineCounters {
    fn from(s: TcpStats) -> EngineCounters {
        EngineCounters {
            chunks_done: s.chunks_done,
            bytes_done: s.bytes_done,
            chunks_served: s.chunks_served,
            checksum_failures: s.checksum_failures,
            refused: s.refused,
            connections_failed: s.connections_failed,
            handshakes_refused: s.handshakes_refused,
            integrity_failures: s.integrity_failures,
            identity_refusals: s.identity_refusals,
            slow_progress: s.slow_progress,
        }
    }
}

impl DataPort {
    /// Read the secret and this node's key (making the key first where there is none and
    /// that is allowed), start the TCP engine on `config.listen` (and RDMA as configured), and
    /// the port over them ([`DataPort::over`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a missing, unreadable, group- or world-readable secret
    /// or key file, or one that holds no secret or key; [`Error::Io`] when the address cannot
    /// be bound or the key cannot be made.
    pub fn start(
        config: &DataPortConfig,
        node_id: u64,
        store: &Arc<Store>,
    ) -> Result<Arc<DataPort>> {
        let secret = ClusterSecret::from_file(&config.cluster_secret_file)?;
        let (identity, made) = NodeKey::open(&config.node_key_file, config.create_node_key)?;
        if made {
            tracing::info!(
                path = %config.node_key_file.display(),
                public_key = %identity.public(),
                "made this node's key (peers list its public half: `kvd key show`)"
            );
        }
        let mut tcp = TcpConfig::new(
            node_id,
            store.node_generation(),
            config.listen,
            secret,
            Arc::new(identity),
        );
        tcp.member_handshakes = config.member_handshakes;
        tcp.payload_mac = config.payload_mac;
        // A block of up to 4 MiB travels as one chunk, so a push sends its sealed CRC-32C
        // instead of computing one (and the receiver's check is end to end). Every daemon uses
        // the same size: it is also the largest chunk one accepts.
        tcp.chunk_bytes = CHUNK_BYTES;
        tcp.lanes = config.lanes;
        // A peer's own share of connections per purpose: its transfers into here (one control
        // connection each, and as many idle ones kept), with room to spare.
        tcp.max_connections_per_peer = (2 * config.max_incoming_per_peer as usize).max(16);
        let tcp = TcpTransport::start(tcp)
            .map_err(|e| Error::Io(format!("the data port {}: {e}", config.listen)))?;
        let backends = Backends::start(tcp, config.transport, &config.rdma, CHUNK_BYTES).map_err(|e| match e {
            transport::Error::Unsupported(why) => Error::InvalidArgument(format!(
                "--transport rdma: {why}; use --transport auto (TCP where RDMA cannot be used) or tcp"
            )),
            e => e.into(),
        })?;
        DataPort::over(backends, config, node_id, store)
    }

    /// The data port over backends already started: [`DataPort::start`]'s TCP (and RDMA), or
    /// [`Backends::in_process`] for nodes of one process (`config`'s address, secret and key
    /// files are then unused). Reads the peers file, registers the pool, takes the peers'
    /// control channels, starts the reaper (which also looks at the peers file every second).
    ///
    /// # Errors
    /// As [`Backends::register`] and [`PeersFile::load`], or [`Error::Io`] when a thread
    /// cannot be started.
    pub fn over(
        backends: Backends,
        config: &DataPortConfig,
        node_id: u64,
        store: &Arc<Store>,
    ) -> Result<Arc<DataPort>> {
        let own_key = backends.tcp().map(TcpTransport::public_key);
        let file = match &config.peers_file {
            Some(path) => Some(PeersFile::load(path, node_id, own_key.as_ref())?),
            None => None,
        };
        let region = store.pool_region();
        let len = region.len() as u64;
        let pool = backends.register(POOL_SEGMENT, region as Arc<dyn Memory>, len)?;
        tracing::info!(transport = %backends.describe(), "the data port's byte mover");
        let counters = Arc::new(Counters::default());
        let port = Arc::new(DataPort {
            backends,
            pool,
            node_id,
            peers: Mutex::new(PeerSources {
                flags: config.peers.clone(),
                file,
                view: BTreeMap::new(),
            }),
            incoming: Arc::new(Incoming::new(
                store.clone(),
                node_id,
                IncomingLimits {
                    per_peer: config.max_incoming_per_peer as usize,
                    total: config.max_incoming as usize,
                    deadline: Duration::from_millis(config.transfer_deadline_ms),
                    ..IncomingLimits::default()
                },
                counters.clone(),
            )),
            outgoing: Arc::new(Outgoing::new(
                store.clone(),
                node_id,
                BTreeMap::new(),
                OutgoingLimits {
                    per_peer: config.max_transfers_per_peer as usize,
                    total: config.max_transfers as usize,
                    ..OutgoingLimits::default()
                },
                counters.clone(),
            )),
            counters,
            stop: Arc::new(AtomicBool::new(false)),
        });
        port.apply_peers();
        // a node this one does not know is looked for in the peers file before it is refused
        if let Some(members) = port.members() {
            let weak = Arc::downgrade(&port);
            members.set_on_miss(Box::new(move || {
                if let Some(p) = weak.upgrade() {
                    p.reload_peers_file();
                }
            }));
        }
        // peers' control connections: one thread each (Incoming bounds how many)
        let weak: Weak<DataPort> = Arc::downgrade(&port);
        port.backends
            .set_control_handler(Arc::new(move |stream, bind| {
                let Some(port) = weak.upgrade() else { return };
                let spawned = std::thread::Builder::new()
                    .name("kvd-peer-control".into())
                    .spawn(move || port.incoming.serve(&port.backends, stream, bind));
                if let Err(e) = spawned {
                    tracing::warn!(error = %e, "could not start a control connection's thread");
                }
            }));
        // incoming transfers past their deadline are aborted (their pages freed); the peers
        // file is looked at every second
        let weak = Arc::downgrade(&port);
        let stop = port.stop.clone();
        std::thread::Builder::new()
            .name("kvd-transfer-reaper".into())
            .spawn(move || {
                let mut tick = 0u64;
                while !stop.load(Ordering::Acquire) {
                    std::thread::sleep(Duration::from_millis(100));
                    tick += 1;
                    match weak.upgrade() {
                        Some(p) => {
                            p.incoming.reap(&p.backends, 64);
                            if tick % 10 == 0 {
                                p.reload_peers_file();
                            }
                        }
                        None => break,
                    }
                }
            })
            .map_err(|e| Error::Io(e.to_string()))?;
        Ok(port)
    }

    fn sources(&self) -> MutexGuard<'_, PeerSources> {
        self.peers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The transport's member table (none in process).
    fn members(&self) -> Option<&Arc<Members>> {
        self.backends.tcp().map(TcpTransport::members)
    }

    /// Push the merged peer table to the transfers started here (addresses) and to the
    /// transport's members (keys, member addresses); evict every node whose key went away.
    fn apply_peers(&self) {
        let merged = self.sources().merged();
        self.outgoing
            .set_peers(merged.iter().map(|(id, p)| (*id, p.addr)).collect());
        let Some(members) = self.members() else {
            return;
        };
        match members.replace(&members_of(&merged)) {
            Ok(gone) => {
                for node in gone {
                    self.evict(node);
                }
            }
            Err(e) => tracing::warn!(error = %e, "the peer table was not applied"),
        }
    }

    /// Close every connection that involves `node`, whose key is no longer trusted (revoked,
    /// removed from the peer list, or changed): its control connections here (their
    /// transfers abort, their pages are freed and grants revoked), its data connections, and
    /// this node's connections to it.
    fn evict(&self, node: u64) {
        tracing::warn!(
            node,
            "node's key is no longer trusted (revoked, removed or changed): closing its connections"
        );
        self.backends.evict(node);
        self.incoming.evict(node);
        self.outgoing.retain_idle(|n, _| n != node);
    }

    /// Read the peers file again if it changed, and apply it.
    fn reload_peers_file(&self) {
        let own = self.backends.tcp().map(TcpTransport::public_key);
        let changed = {
            let mut s = self.sources();
            match s
                .file
                .as_mut()
                .map(|f| f.reload(self.node_id, own.as_ref()))
            {
                Some(Ok(changed)) => changed,
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "the peers file was not read again; the entries last read stay");
                    false
                }
                None => false,
            }
        };
        if changed {
            tracing::info!("the peers file changed: the peer table follows");
            self.apply_peers();
        }
    }

    /// Start a push of `keys` to `peer`, or a fetch of them from it, in the background; its
    /// id.
    ///
    /// # Errors
    /// As [`Outgoing::admit`].
    pub fn start_transfer(
        self: &Arc<Self>,
        kind: Kind,
        peer: u64,
        keys: Vec<BlockKey>,
    ) -> Result<u64> {
        if peer != crate::protocol::ANY_NODE && !self.outgoing.peers().contains_key(&peer) {
            self.reload_peers_file();
        }
        let id = self.outgoing.admit(peer)?;
        let port = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name("kvd-transfer".into())
            .spawn(move || port.outgoing.run(&port.backends, id, kind, peer, &keys));
        if let Err(e) = spawned {
            return Err(Error::Io(format!(
                "could not start the transfer's thread: {e}"
            )));
        }
        Ok(id)
    }

    /// The states of pushes started here.
    pub fn transfers(&self, ids: &[u64]) -> Vec<TransferInfo> {
        self.outgoing.status(ids)
    }

    /// The transfers' counters.
    pub fn transfer_counters(&self) -> TransferCounters {
        self.counters.snapshot()
    }

    /// This node's generation as its peers know it.
    pub fn generation(&self) -> u64 {
        self.backends.target().node_generation()
    }

    /// This node's public key (none in process).
    pub fn public_key(&self) -> Option<PublicKey> {
        self.backends.tcp().map(TcpTransport::public_key)
    }

    /// Become generation `g` towards peers (cluster mode's re-registration): transfers bound
    /// to the old one are refused from now on.
    pub fn set_generation(&self, g: u64) {
        let old = self.backends.target().set_node_generation(g);
        // this node's idle control connections and its data connections introduced it with
        // the old generation (peers grant to the incarnation they negotiated with)
        self.outgoing.retain_idle(|_, _| false);
        self.backends.reconnect_all();
        tracing::info!(old, new = g, "the node generation advanced");
    }

    /// Transfers started here still under way.
    pub fn transfers_in_flight(&self) -> usize {
        self.outgoing.in_flight()
    }

    /// Failed transfers started here, by reason.
    pub fn transfer_failures(&self) -> BTreeMap<&'static str, u64> {
        self.counters
            .failures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Latencies of pushes started here.
    pub fn push_seconds(&self) -> &prometheus_client::metrics::histogram::Histogram {
        &self.counters.push_seconds
    }

    /// Latencies of fetches started here.
    pub fn fetch_seconds(&self) -> &prometheus_client::metrics::histogram::Histogram {
        &self.counters.fetch_seconds
    }

    /// Latencies of cluster fetches started here (locate and every piece).
    pub fn cluster_fetch_seconds(&self) -> &prometheus_client::metrics::histogram::Histogram {
        &self.counters.cluster_fetch_seconds
    }

    /// Feed the peer table from a membership view: `--peer` entries and the peers file,
    /// overridden by what the view says (addresses and keys); and refuse peers' new transfers
    /// while this node does not hold its lease.
    pub fn follow(self: &Arc<Self>, membership: &Arc<dyn crate::Membership>) {
        self.incoming.follow(Arc::clone(membership));
        let port = Arc::downgrade(self);
        let m = Arc::downgrade(membership);
        membership.on_change(Box::new(move |view| {
            let Some(port) = port.upgrade() else { return };
            port.sources().view = view;
            port.apply_peers();
            // idle control connections to a peer that re-registered under another generation
            // speak for its old incarnation: drop them
            if let Some(m) = m.upgrade() {
                port.outgoing.retain_idle(|node, generation| {
                    m.generation_of(node).is_none_or(|g| g == generation)
                });
            }
        }));
    }

    /// The address peers connect to (`0.0.0.0:0` for a node in process, which has none).
    pub fn local_addr(&self) -> SocketAddr {
        self.backends.tcp().map_or_else(
            || SocketAddr::from(([0, 0, 0, 0], 0)),
            TcpTransport::local_addr,
        )
    }

    /// The engine's counters (the TCP engine's; none in process).
    pub fn counters(&self) -> EngineCounters {
        self.backends
            .tcp()
            .map(|t| t.stats().into())
            .unwrap_or_default()
    }

    /// What `/status` shows.
    pub fn report(&self, node_id: u64) -> DataPortReport {
        let (ops, bytes) = self.backends.in_flight();
        DataPortReport {
            listen: self.local_addr().to_string(),
            node_id,
            node_key: self
                .backends
                .tcp()
                .map(|t| t.public_key().to_string())
                .unwrap_or_default(),
            members: self.members().map_or(0, |m| m.len() as u64),
            pool_segment: self
                .pool
                .encode()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect(),
            peers: self
                .outgoing
                .peers()
                .iter()
                .map(|(id, a)| (*id, a.to_string()))
                .collect(),
            ops_in_flight: ops as u64,
            bytes_in_flight: bytes,
            live_grants: self.backends.target().live_grants() as u64,
            engine: self.counters(),
            pushes_in_flight: self.outgoing.in_flight() as u64,
            incoming_in_flight: self.incoming.in_flight() as u64,
            transfers: self.counters.snapshot(),
            transport: self.backends.report(),
        }
    }
}
