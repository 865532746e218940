//! `kvd control`'s streaming front as a library: an OpenAI-compatible `/v1/completions`
//! (streaming) that an application or gateway points at instead of one engine, and that keeps
//! a request's stream going when the worker serving it dies (docs/CONTROL.md, "The streaming
//! front").
//!
//! ```text
//! client ──POST /v1/completions──▶ front ── admit (placement: worker, holder, epoch 1)
//!    ▲                               │
//!    │ id: R-0, R-1, …               ├─▶ worker's engine: Engines::complete (prompt ids,
//!    │ (Last-Event-ID resumes)       │     kv_transfer_params.kvd.checkpoint {holder, R, epoch})
//!    │                               │      └─ its connector streams each block to the holder
//!    └──── numbered event log ◀──────┤
//!                                    │  the stream breaks (or etcd says the node is gone):
//!                                    ├─▶ Holders::held (admin GET /checkpoints/R)
//!                                    ├─▶ controller: fail the worker → RestorePlan (epoch + 1)
//!                                    └─▶ survivor's engine: prompt + committed tokens, the
//!                                          remaining budget, kvd.restore {holder, R} + a new
//!                                          checkpoint
//! ```
//!
//! Shaped like `kvd-control`: the decisions are a state machine that takes events and time in
//! and gives actions out; the I/O is behind traits; the binary only wires HTTP and clocks.
//!
//! | Module       | What lives there                                                          |
//! |--------------|---------------------------------------------------------------------------|
//! | [`machine`]  | one request's state machine ([`machine::Request`]): [`machine::Input`] in, [`machine::Action`] out; the client's body ([`machine::body`]), an engine event rewritten for the client ([`machine::relay`]), the P/D hand-off's state and failure table ([`machine::pd`]) |
//! | [`driver`]   | one request's task: feeds the machine, carries out its actions            |
//! | [`front`]    | the [`Front`]: admission, the streams, recovery of a failed worker's requests, the health watch |
//! | [`engine`]   | the seams: [`Engines`] (tokenize, stream a completion, P/D prefill, health) and [`Holders`] (what a holder holds, end a checkpoint, end a hand-off's hold) |
//! | [`http`]     | the seams over HTTP: vLLM's OpenAI server, the daemons' admin port         |
//! | [`hub`]      | the [`Hub`]: the controller under its lock, its clock, the plans for the front's requests, the nodes' admin addresses |
//! | [`log`]      | one request's numbered, bounded event log and the clients reading it     |
//! | [`sse`]      | the wire: `id: R-S` frames, `Last-Event-ID`, engine events, token-id lists |
//! | [`config`]   | the flags (`FrontArgs`) and the fixed bounds                              |
//! | [`stats`]    | the counters (`kvd_control_front_<name>`) and the recovery records        |
//!
//! - **One task per request** drives it: admits, forwards, relays, recovers, ends. Every event
//!   it relays goes into the request's [`log::StreamLog`] with a sequence number (SSE
//!   `id: R-S`); client connections read the log, so a client that reconnects with
//!   `Last-Event-ID: R-S` gets exactly what follows.
//! - **Recovery** happens when the worker's stream breaks (or goes silent for
//!   `--engine-timeout-ms`) and its engine no longer answers its health check, or when a
//!   failure event from elsewhere (etcd membership, the health watch, the admin API) already
//!   planned this request. Before failing a worker the front asks each holder what it really
//!   holds for that worker's requests, so the plan loads what is there. The request keeps its
//!   original deadline; the controller's migration budget bounds the retries; a plan that
//!   fails the request ends the stream with an error event.
//! - **A client that disconnects** and does not come back within `--reconnect-grace-ms`
//!   cancels the request: the engine's connection is dropped (vLLM aborts the request), the
//!   holder's checkpoint is ended, and the controller releases the reservation.
//! - **P/D** (`--prefill-engine`): a prompt is prefilled on a prefill worker the front picks,
//!   and its answer's `kv_transfer_params` hand the blocks to the decode worker the controller
//!   placed; a broken prefill is redone (epoch + 1) elsewhere, the hold at the prefill node ends
//!   exactly once ([`machine::pd`]; docs/CONTROL.md, "Prefill/decode disaggregation").
//! - **Events of an older epoch are dropped**: every transition is a compare-and-swap on the
//!   request epoch, and a plan that arrives while an attempt runs ends it before anything more
//!   is relayed.
//! - **Workers come back** when their engine answers its health check again and their node is
//!   registered (`WorkerRecovered`, then each recovery phase done: an engine that answers is
//!   whole, there is no draft model to load); an in-service worker whose engine stops
//!   answering twice in a row is failed (its requests are planned at once).
//!
//! What continues exactly after a recovery (docs/CONTROL.md): greedy decoding, token for
//! token. Not exactly: seeded sampling (vLLM seeds a fresh generator for the resubmitted
//! request, so the continuation is a valid sample with the same seed, not the uninterrupted
//! run's tokens), frequency and presence penalties (the committed tokens become prompt, which
//! those penalties do not count), stop strings that span the break.
//!
//! Time: the [`Hub`] reads an injected [`kvd_core::clock::Clock`]; the tasks wait with tokio's
//! timers. [`TokioClock`] reads tokio's time, so a test on a paused runtime runs every timeout
//! deterministically and in no wall time (`tests/in_process.rs`).

pub mod cache;
pub mod config;
pub mod driver;
pub mod engine;
pub mod front;
pub mod http;
pub mod hub;
pub mod log;
pub mod machine;
pub mod sse;
pub mod stats;

pub use config::FrontArgs;
pub use engine::{Engines, Holders};
pub use front::Front;
pub use hub::Hub;
pub use stats::{FrontStats, RecoveryRecord};

/// A [`kvd_core::clock::Clock`] over tokio's time: paused in tests, real otherwise.
#[derive(Debug)]
pub struct TokioClock {
    origin: tokio::time::Instant,
}

impl TokioClock {
    /// A clock at 0 now.
    pub fn new() -> Self {
        TokioClock {
            origin: tokio::time::Instant::now(),
        }
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        Self::new()
    }
}

impl kvd_core::clock::Clock for TokioClock {
    fn now_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }
}
