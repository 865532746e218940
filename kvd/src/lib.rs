//! kvd: the daemon and the command line of a per-node KV-cache block store for distributed LLM
//! serving. The libraries it is made of are crates of their own (see `docs/ARCHITECTURE.md`);
//! this crate re-exports them under the names the daemon, the tests and the benches use:
//!
//! - [`keys`], [`error`], [`clock`], [`protocol`]: `kvd-core`, the shared vocabulary.
//! - [`store`] (with [`pool`]): `kvd-store`, the page pool and the block store.
//! - [`client`]: `kvd-client`, the Rust client of the local protocol (what libkvd links).
//! - [`control`]: `kvd-control`, the control shim: placement, recovery, request epochs.
//! - [`sim`] (feature `sim`): `kvd-sim`, the cluster simulator driving [`control`].
//!
//! and holds what only the daemon needs:
//!
//! - [`daemon`] (feature `server`): `kvd serve`, the admin HTTP, drain, and `kvd status`.
//! - [`control_service`] (feature `server`): `kvd control`, the control shim over HTTP/JSON;
//!   its `membership` feeds it from cluster membership in etcd, its `front` is the streaming
//!   front, which resumes a client's stream on a survivor when its worker dies.
//! - [`openmetrics`] (feature `server`): the metric-encoding helpers both of them use.

#[cfg(feature = "server")]
pub mod control_service;
#[cfg(feature = "server")]
pub mod daemon;
#[cfg(feature = "server")]
pub mod openmetrics;

pub use kvd_client as client;
pub use kvd_control as control;
pub use kvd_core::{Error, Result, clock, error, keys, protocol};
#[cfg(feature = "sim")]
pub use kvd_sim as sim;
pub use kvd_store as store;
pub use kvd_store::pool;
