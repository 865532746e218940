//! `kvd sim`: a deterministic discrete-event simulator of an LLM serving cluster that drives
//! the real control shim ([`kvd_control`]) and measures what each recovery policy does to
//! TTFT, TPOT and recovery time when workers fail.
//!
//! Read `docs/SIMULATION.md` for the model, its defaults and their sources, and the results.
//! The rooms, in the order a run flows through them:
//!
//! - [`config`]: the models (Qwen3-14B, Qwen3-32B), the H100-class hardware, the engine limits.
//! - [`workload`]: Poisson arrivals with conversation-trace prompt and output lengths.
//! - [`events`]: the `(time, sequence)` event heap with its cap.
//! - [`worker`]: one worker's batch, KV budget and iteration time model.
//! - [`shim`]: the simulator's adapter to the real [`kvd_control::Controller`].
//! - [`cluster`]: the event loop: routing, checkpoint streaming, failures, restores, restarts.
//! - [`trace`]: one row per interrupted request: where it went, what it recomputed and why,
//!   and where its stall went (restore, queue, prefill).
//! - [`metrics`]: latencies (overall, interrupted, bystanders) and recovery measures.
//! - [`experiments`]: the four built-in experiments and the saturation measurement.
//! - [`report`]: CSV, Markdown and PNG output.
//! - [`cli`]: `kvd sim ...`.
//!
//! Same seed, same numbers: all randomness comes from one seeded ChaCha8 stream that generates
//! the workload before any policy runs, nothing iterates a hash map, and every output is
//! written in a fixed order.

pub mod cli;
pub mod cluster;
pub mod config;
pub mod events;
pub mod experiments;
pub mod metrics;
pub mod report;
pub mod shim;
pub mod trace;
pub mod worker;
pub mod workload;

pub use kvd_core::{Error, Result};

pub use cluster::{FailureSpec, RunConfig, RunOutput, run};
pub use config::{ClusterConfig, EngineConfig, HardwareConfig, ModelConfig};
pub use metrics::RunMetrics;
