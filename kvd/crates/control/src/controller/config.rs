//! The controller's knobs and their bounds.

use serde::{Deserialize, Serialize};

use crate::placement::ScoreParams;
use crate::policy::PolicyKind;
use crate::{Error, Result};
use crate::{MAX_IN_FLIGHT, MAX_QUEUE_DELAY_WINDOW, MAX_TERMINAL_RETAINED, MAX_WORKERS};

/// The controller's knobs. Every limit has a hard cap (see the constants in [`crate`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ControlConfig {
    /// Which policy places checkpoints and dispatches recovery.
    pub policy: PolicyKind,
    /// λ, the weight of the restore delay in the placement score (default 1).
    pub lambda: f64,
    /// Host-to-GPU bandwidth used for restore-delay estimates, bytes per ms (default 25 GB/s).
    pub host_to_gpu_bytes_per_ms: u64,
    /// Prefill throughput used for deadline estimates, tokens per ms (default 10).
    pub prefill_tokens_per_ms: u32,
    /// The engines' sequence cap (vLLM's `--max-num-seqs`), 0 when not known (default): with
    /// it, recovery dispatch hands no survivor requests past its free batch slots while
    /// another has room.
    pub engine_max_seqs: u32,
    /// KV block size in tokens: a restore loads whole blocks only (default 16).
    pub tokens_per_block: u32,
    /// Workers at most (≤ [`MAX_WORKERS`]).
    pub max_workers: u32,
    /// In-flight requests at most (≤ [`MAX_IN_FLIGHT`]); admission beyond is `Overloaded`.
    pub max_in_flight: u32,
    /// Terminal request records kept for idempotent replies (≤ [`MAX_TERMINAL_RETAINED`]).
    pub max_terminal_retained: u32,
    /// Queueing-delay samples kept per worker (≤ [`MAX_QUEUE_DELAY_WINDOW`]).
    pub queue_delay_window: u32,
    /// Migrations allowed per request; one more interruption fails it.
    pub migration_budget: u32,
}

impl Default for ControlConfig {
    fn default() -> Self {
        ControlConfig {
            policy: PolicyKind::Lumen,
            lambda: 1.0,
            host_to_gpu_bytes_per_ms: 25_000_000,
            prefill_tokens_per_ms: 10,
            engine_max_seqs: 0,
            tokens_per_block: 16,
            max_workers: 1024,
            max_in_flight: 1 << 20,
            max_terminal_retained: 1 << 16,
            queue_delay_window: 64,
            migration_budget: 3,
        }
    }
}

impl ControlConfig {
    /// The placement score's parameters.
    pub fn score_params(&self) -> ScoreParams {
        ScoreParams {
            lambda: self.lambda,
            host_to_gpu_bytes_per_ms: self.host_to_gpu_bytes_per_ms,
            prefill_tokens_per_ms: self.prefill_tokens_per_ms,
            engine_max_seqs: self.engine_max_seqs,
        }
    }

    /// Check every field against its bound.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the first bad field.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(Error::InvalidArgument(format!("control config: {m}")));
        if !self.lambda.is_finite() || self.lambda < 0.0 {
            return bad("lambda must be finite and >= 0");
        }
        if self.host_to_gpu_bytes_per_ms == 0
            || self.prefill_tokens_per_ms == 0
            || self.tokens_per_block == 0
        {
            return bad("bandwidth, prefill rate and tokens_per_block must be > 0");
        }
        if self.max_workers == 0 || self.max_workers > MAX_WORKERS {
            return bad("max_workers must be in 1..=4096");
        }
        if self.max_in_flight == 0 || self.max_in_flight > MAX_IN_FLIGHT {
            return bad("max_in_flight must be in 1..=4194304");
        }
        if self.max_terminal_retained > MAX_TERMINAL_RETAINED {
            return bad("max_terminal_retained must be <= 1048576");
        }
        if self.queue_delay_window == 0 || self.queue_delay_window > MAX_QUEUE_DELAY_WINDOW {
            return bad("queue_delay_window must be in 1..=4096");
        }
        Ok(())
    }
}
