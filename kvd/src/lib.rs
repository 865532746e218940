//! kvd: the command line of a per-node KV-cache block store for distributed LLM serving. Every
//! part of it is a crate of its own (see `docs/ARCHITECTURE.md`); this crate wires them into
//! the `kvd` binary (`src/main.rs`) and re-exports them under the names the tests and the
//! benches use:
//!
//! - [`keys`], [`error`], [`clock`], [`protocol`]: `kvd-core`, the shared vocabulary.
//! - [`store`] (with [`pool`]): `kvd-store`, the page pool and the block store.
//! - [`client`]: `kvd-client`, the Rust client of the local protocol (what libkvd links).
//! - [`control`]: `kvd-control`, the control shim: placement, recovery, request epochs.
//! - [`sim`] (feature `sim`): `kvd-sim`, the cluster simulator driving [`control`].
//! - [`daemon`] (feature `server`): `kvd-daemon`, the service `kvd serve`, with `kvd status`
//!   and `kvd drain` (its admin API's client).
//! - [`control_service`] (feature `server`): `kvd-control-service`, the service `kvd control`
//!   (the controller over HTTP/JSON, fed by etcd, and the streaming front of `kvd-front`).

pub use kvd_client as client;
pub use kvd_control as control;
#[cfg(feature = "server")]
pub use kvd_control_service as control_service;
pub use kvd_core::{Error, Result, clock, error, keys, protocol};
#[cfg(feature = "server")]
pub use kvd_daemon as daemon;
#[cfg(feature = "sim")]
pub use kvd_sim as sim;
pub use kvd_store as store;
pub use kvd_store::pool;
