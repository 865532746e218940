//! `kvd control`'s streaming front as a library: OpenAI's `/v1/completions` and
//! `/v1/chat/completions` (streaming or not) that an application or gateway points at instead
//! of one engine, and that keep a request going when the worker serving it dies, or when the
//! front serving it dies and another replica takes it over (docs/CONTROL.md, "The streaming
//! front").
//!
//! ```text
//! client ──POST /v1/completions──▶ front ── admit (placement: worker, holder, epoch 1)
//!    ▲                               │
//!    │ id: R-0-1, R-1-2, …           ├─▶ worker's engine: Engines::complete (prompt ids,
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
//! | [`machine`]  | one request's state machine ([`machine::Request`]): [`machine::Input`] in, [`machine::Action`] out; the client's body ([`machine::body`]), an engine event rewritten for the client ([`machine::relay`]), the front's stop strings ([`machine::stops`]), the P/D hand-off's state and failure table ([`machine::pd`]) |
//! | [`openai`]   | the OpenAI surface: chat or completion, with or without a stream ([`openai::Api`]); what cannot be recovered exactly and goes to one engine as it is; chat chunks; the whole answer ([`openai::Collector`]); the error shape; the model list |
//! | [`driver`]   | one request's task: feeds the machine, carries out its actions            |
//! | [`front`]    | the [`Front`]: admission, the streams, recovery of a failed worker's requests, the health watch |
//! | [`engine`]   | the seams: [`Engines`] (tokenize, stream a completion, P/D prefill, health, the model list, a body forwarded as it is), [`Holders`] (what a holder holds, end a checkpoint, end a hand-off's hold) and [`engine::Records`] (the streams' records other replicas take over from) |
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
//! What continues exactly after a recovery or a takeover (docs/CONTROL.md has the table):
//! greedy decoding; seeded sampling and frequency/presence penalties, through
//! `kvd.continues` and the connector's `kvd.vllm_sampling`; stop strings, which the front
//! applies itself. What cannot (`n` > 1, logprobs, structured output, tools, …) is served by
//! one engine as it is, and the answer says recovery is off, and why.
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
pub mod openai;
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
