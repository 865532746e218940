//! Blocks between kvd daemons: the data port (this node's transfer engines on its pool, the
//! peers' control connections), pushes and fetches of published blocks, checkpoint streaming
//! to a holder and the recovery read back, and their wire ([`transfer::wire`]). Over the block
//! store (`kvd-store`) and the transfer engines (`kvd-transport`); the daemon binary wires it
//! up ([`port::DataPort::start`]) and feeds it cluster membership through [`Membership`].
//! [`port::DataPort::over`] runs the same port over any backends the transport's registry
//! makes, the in-process ones included, so the protocol is tested between nodes of one
//! process (`tests/in_process.rs`).
//!
//! ```text
//!  port.rs       DataPort: the transport's backends (`transport::registry`: TCP always, RDMA
//!                where usable, chosen per peer), the pool registered as one segment, the
//!                control handler, the reaper; starts transfers, reports, follows membership
//!  peers.rs      the peer table: `--peer` entries, the peers file, membership; each peer's
//!                address and the key its handshakes must prove
//!  transfer/     outgoing.rs (pushes and fetches started here; outgoing/cluster.rs, the
//!                cluster fetch: locate, plan, fetch by piece), incoming.rs (peers'
//!                transfers into and out of here), wire.rs (their messages), mod.rs (counters)
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Serialize;

pub mod peers;
pub mod port;
pub mod transfer;

pub use peers::Peer;

pub use kvd_core::{Error, Result};
pub(crate) use kvd_core::{error, keys, protocol};
pub(crate) use kvd_store as store;

/// The segment id the pool is registered under.
pub const POOL_SEGMENT: transport::grant::SegmentId = transport::grant::SegmentId(1);

/// The data port's chunk size (sent and accepted).
pub const CHUNK_BYTES: u32 = 4 << 20;

/// What this crate needs of cluster membership: whether this node holds its lease, who the
/// peers are at which generation, and a feed of the peer table as it changes. The daemon's
/// embedded registry and its etcd membership both answer it.
pub trait Membership: Send + Sync + std::fmt::Debug {
    /// Whether this node holds its registration lease (no new transfers while it does not).
    fn lease_held(&self) -> bool;
    /// Why not, in words.
    fn problem(&self) -> String;
    /// Whether peers are fenced by the generation the membership gives them (cluster mode).
    fn fences(&self) -> bool;
    /// A peer's generation as the membership knows it.
    fn generation_of(&self, node: u64) -> Option<u64>;
    /// Call `sink` with the peer table (node id → data address and key) now and at every
    /// change.
    fn on_change(&self, sink: PeerSink);
}

/// Receives the peer table (node id → data address and key) from a [`Membership`].
pub type PeerSink = Box<dyn Fn(BTreeMap<u64, Peer>) + Send + Sync>;

/// What the data port moves peers' blocks over, and how the RDMA device is chosen (the
/// transport's backend registry reads both).
pub use transport::registry::{RdmaSettings, TransportChoice};

/// Ring threads of the data port's TCP engine unless configured otherwise: two, the TCP
/// engine's own default. One ring thread per daemon does every send copy or every receive copy
/// and CRC of the node's data connections (73 % of a 256 KiB fetch's CPU samples were the two
/// daemons' ring threads, `perf`); with two, a pair of daemons on this 2-core machine fetched
/// 256 KiB blocks at 1.91 / 1.91 GB/s against 1.51 / 1.53 with one (`kvd-bench remote
/// --repeat 3 --data-lanes L`, L = 1, 2, 1, 2 in one sitting, 2026-12-04), 2 MiB at 2.10 /
/// 2.02 against 1.80 / 1.88, pushes 1.85 / 1.86 against 1.69 / 1.70. An earlier sitting (one
/// run each) had them level. Where one lane is better: 16 daemons on the same 2 cores, all to
/// all (32 ring threads), 2.22 GB/s with one against 2.01 with two, a shape no deployment has
/// (one daemon per GPU node, which has the cores). `--data-lanes 1` for a node short of cores.
pub const DEFAULT_DATA_LANES: usize = 2;

/// The data port's settings (present only with a cluster secret).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DataPortConfig {
    /// Where it listens.
    pub listen: std::net::SocketAddr,
    /// The cluster secret file (read at start; its bytes are not kept here).
    pub cluster_secret_file: PathBuf,
    /// This node's key file (read at start).
    pub node_key_file: PathBuf,
    /// Whether to make the key file when there is none (the default path in the data
    /// directory: a node's first start).
    pub create_node_key: bool,
    /// The static peer table from `--peer`: node id → data address and key.
    #[serde(serialize_with = "peers::serialize_table")]
    pub peers: std::collections::BTreeMap<u64, Peer>,
    /// The peers file, re-read when it changes (its entries win over `peers`).
    pub peers_file: Option<PathBuf>,
    /// Handshake slots of the data port kept for connections from members' addresses.
    pub member_handshakes: usize,
    /// Payload MACs on this node's connections.
    pub payload_mac: bool,
    /// Transfers started here at once, per peer.
    pub max_transfers_per_peer: u32,
    /// Transfers started here at once, in all.
    pub max_transfers: u32,
    /// Peers' transfers under way here at once, per peer.
    pub max_incoming_per_peer: u32,
    /// Peers' transfers under way here at once, in all.
    pub max_incoming: u32,
    /// A peer's transfer is aborted this long after its offer or want, ms.
    pub transfer_deadline_ms: u64,
    /// Ring threads of the TCP engine.
    pub lanes: usize,
    /// What blocks move over.
    pub transport: TransportChoice,
    /// How the RDMA device is chosen.
    pub rdma: RdmaSettings,
}
