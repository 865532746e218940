//! The control shim: load-aware checkpoint placement, recovery dispatch, request epochs.
//!
//! This is the part of kvd that decides, for every in-flight request, **where its KV checkpoint
//! lives** (the *holder*, never the worker serving it) and, when workers die, **where every
//! interrupted request resumes and how much of its KV it can reuse**. Only small metadata
//! reaches the controller: KV pages move worker to worker through the data plane.
//!
//! The rooms, by concept:
//!
//! - [`load`]: the load table, one row per worker (free checkpoint capacity, queueing delay
//!   `q_w`, reserved footprint, held checkpoints, lifecycle phase). Updated by events only.
//! - [`placement`]: the placement rule `h(r) = argmin_{w ≠ s, free(w) ≥ reserve(r)} q_w + λ·p_w`
//!   and the shared "least-loaded survivor" choice.
//! - [`policy`]: the [`Policy`] trait and its three implementations, [`Lumen`] (the design),
//!   [`FixedRing`] (DejaVu-style ring holder) and [`StopRestart`] (no checkpoints).
//! - [`recovery`]: recovery dispatch, bounded rebalancing, and per-request restore plans.
//! - [`dispatch`]: Lumen's dispatch, which keeps recomputations off the survivors that serve
//!   the cheap restores when a cost model says that shortens the stalls.
//! - [`admission`]: where a new request goes (a free batch slot first, then the fewest
//!   requests with those not yet started counted twice).
//! - [`request`]: the request state machine with epochs, and stream sequence numbers.
//! - [`controller`]: the [`Controller`] that owns the tables, applies [`Event`]s and returns
//!   [`Decision`]s; one file per concern (events, workers, requests, recovery, invariants).
//! - [`snapshot`]: the whole controller state as one serializable value.
//! - `kvd control` (in the `kvd` binary) serves the controller over HTTP/JSON.
//!
//! # Time
//!
//! The controller never reads a clock. Every event method takes `now_ms: u64` (milliseconds on
//! any monotonic origin the caller chooses): a discrete-event simulator passes its virtual time,
//! the service passes a [`kvd_core::clock::Clock`] reading. The same event sequence with the same
//! timestamps always yields the same decisions.
//!
//! # Driving it (a simulator, a router, the service)
//!
//! ```
//! use kvd_control::{AdmitRequest, ControlConfig, Controller};
//!
//! let mut c = Controller::new(ControlConfig::default()).unwrap();
//! for w in 0..4 {
//!     c.add_worker(w, 1 << 30, 0).unwrap();
//! }
//! let adm = c
//!     .admit(AdmitRequest { request_id: 7, serving: 0, prompt_tokens: 512,
//!         max_new_tokens: 256, reserve_bytes: 64 << 20, deadline_ms: None }, 10)
//!     .unwrap();
//! assert_ne!(adm.holder, Some(0));
//! c.prefill_started(7, adm.epoch, 15).unwrap();
//! c.decoding_started(7, adm.epoch, 40).unwrap();
//! c.checkpoint_stored(7, adm.epoch, 512, 32 << 20, 60).unwrap();
//! let plan = c.fail_workers(&[0], 100).unwrap();
//! assert_eq!(plan.restores.len(), 1);
//! assert_eq!(plan.restores[0].target, adm.holder.unwrap()); // KV reuse at the holder
//! ```

pub mod admission;
pub mod controller;
pub mod dispatch;
pub mod load;
pub mod placement;
pub mod policy;
pub mod recovery;
pub mod request;
pub mod snapshot;

pub use kvd_core::{Error, Result};

pub use controller::{Admission, AdmitRequest, ControlConfig, Controller, Decision, Event, Stats};
pub use load::{LoadTable, WorkerLoad, WorkerPhase};
pub use policy::{FixedRing, Lumen, Policy, PolicyKind, StopRestart};
pub use recovery::{
    Dispatch, Dispatched, Interrupted, RecoveryPlan, RestorePlan, SurvivorEstimate,
};
pub use request::{FrameVerdict, RequestRecord, RequestState, StreamCursor};
pub use snapshot::ControllerSnapshot;

/// A worker (one inference engine instance: a GPU or a TP group). Plain `u32` for the C ABI.
pub type WorkerId = u32;
/// A request, unique within a controller: kvd-core's one request-id type (the engine's number;
/// the store's manifests use the same).
pub use kvd_core::types::RequestId;
/// A request epoch: the incarnation of a request. Starts at 1 on admission; increases by one
/// at every migration and at a cancel. Events that name an older epoch are dropped.
pub type Epoch = u64;

/// Hard cap on workers per controller, whatever the configuration says.
pub const MAX_WORKERS: u32 = 4096;
/// Hard cap on in-flight (non-terminal) requests per controller.
pub const MAX_IN_FLIGHT: u32 = 1 << 22;
/// Hard cap on the queueing-delay window, in samples.
pub const MAX_QUEUE_DELAY_WINDOW: u32 = 4096;
/// Hard cap on terminal request records kept for idempotent replies.
pub const MAX_TERMINAL_RETAINED: u32 = 1 << 20;
/// Hard cap on workers named in one failure event.
pub const MAX_FAILED_PER_EVENT: usize = MAX_WORKERS as usize;
