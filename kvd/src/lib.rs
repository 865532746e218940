//! kvd: a per-node KV-cache block store for distributed LLM serving.
//!
//! Read `docs/ARCHITECTURE.md` first. The modules, in the order data flows through them:
//!
//! - [`pool`]: the memfd-backed host-memory region, carved into fixed-size pages.
//! - [`keys`]: namespaces (the identity of a KV layout) and chained block tags.
//! - [`store`]: the block table and its lifecycle, pins, sessions and leases, manifests,
//!   reservations, eviction, integrity, and the reaper.
//! - [`control`]: the control shim: load-aware checkpoint placement and recovery planning.
//! - [`sim`] (feature `sim`): a deterministic cluster simulator driving [`control`].
//! - [`protocol`]: the local protocol's frames and messages (engine ↔ daemon, Unix socket).
//! - [`client`]: the Rust client of the local protocol, with the mapped pool.
//! - [`daemon`] (feature `server`): `kvd serve`, the admin HTTP, drain, and `kvd status`.

pub mod control;
#[cfg(feature = "server")]
pub mod daemon;
#[cfg(feature = "sim")]
pub mod sim;

// The library crates, under the names the daemon, the tests and the benches use.
pub use kvd_client as client;
pub use kvd_core::{Error, Result, clock, error, keys, protocol};
pub use kvd_store as store;
pub use kvd_store::pool;
