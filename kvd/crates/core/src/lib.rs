//! kvd-core: what every side of kvd speaks.
//!
//! - [`error`]: the one error enum, with stable C codes.
//! - [`keys`]: namespaces (the identity of a KV layout) and chained block tags.
//! - [`clock`]: the injected clock the store and the control shim take.
//! - [`batch`]: the batch limit (`max_batch`) and its one check.
//! - [`counters`]: the store's event counters, declared once for metrics, C and Python.
//! - [`types`]: the plain data the store returns and the protocol carries (handles, versions,
//!   block infos, counts).
//! - [`protocol`]: the local protocol's frames and messages (engine ↔ daemon, Unix socket) and
//!   file-descriptor passing.
//!
//! This crate has no runtime, no threads and no daemon dependencies: it is linked into engines
//! through `kvd-client` and libkvd.

pub mod batch;
pub mod clock;
pub mod counters;
pub mod error;
pub mod keys;
pub mod protocol;
pub mod types;

pub use error::{Error, Result};
