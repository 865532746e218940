//! kvd's byte movers. This crate knows nothing about blocks; it moves and checksums bytes.
//!
//! - [`local`]: same-node movement: the shared region (one memfd, mapped by the daemon and by
//!   every engine), the page-generation table, a non-temporal copy for large transfers and a
//!   copy fused with a CRC-32C, so a block's checksum costs no second pass over cold memory.
//! - [`auth`]: peer authentication by challenge-response over the cluster secret (blake3's
//!   keyed hash over both ends' nonces and ephemeral X25519 keys; the secret never crosses the
//!   wire), and the per-connection key (known to the two ends only) that tags every frame after
//!   it and keys the optional payload MACs.
//! - [`link`]: who a peer is ([`link::PeerAddr`]; each node's Ed25519 key and the members'
//!   public keys) and how every connection to it starts (the handshake, in which each end
//!   signs with its node key, and its frames), shared by the backends so that none depends on
//!   another.
//! - [`channel`]: an authenticated connection, its key and its place under the per-peer
//!   bound; tagged, length-framed messages for the daemons' control traffic.
//! - [`engine`]: the transfer interface every backend implements ([`engine::Transport`]),
//!   with the bookkeeping they share; backends: [`inproc::InProcTransport`], [`tcp::TcpTransport`],
//!   and with the `rdma` feature `rdma::RdmaTransport` (RC queue pairs over sideway).
//! - [`registry`]: the backend each peer's batches go over (RDMA where both ends have it, TCP
//!   otherwise, asked again later), keyed by peer node id; the data port talks only to it.
//! - [`grant`]: the ranges of local memory a remote peer may touch, per transfer, checked
//!   before any byte moves (the first piece of the one-sided transfer engine).
//! - [`segment`]: segment descriptors, the small versioned wire form by which a node tells a
//!   peer about memory it may name (never an address).
//! - `cuda` (feature `cuda`): the pool mapping registered as pinned memory in chunks, copies
//!   between device memory and pool blocks (whole or one slice per layer) on the engine's
//!   stream with completion events, and dma-buf export of device memory for GPUDirect RDMA;
//!   the driver is loaded at run time (an error, not a crash, where there is none).

pub mod admission;
pub mod auth;
pub mod channel;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod engine;
pub mod error;
pub mod grant;
pub mod inproc;
pub mod link;
pub mod local;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod registry;
pub mod segment;
pub mod tcp;

pub use error::{Error, Result};
