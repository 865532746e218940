//! The recovery trace: one row per interrupted request, saying where it went, what it loaded
//! and recomputed and why, and where its stall (failure → next token) went.
//!
//! The stall splits into three consecutive parts, each measured, not estimated:
//!
//! - **restore**: failure → the request can rejoin a batch (reading the checkpoint from a remote
//!   holder over its network queue, then the host-to-GPU copy over the target's PCIe queue; 0
//!   for a recompute);
//! - **queue**: → the request is admitted into a batch on the target (waiting behind other
//!   restored requests, and for GPU KV room);
//! - **prefill**: → its next token (prefilling the part not loaded, in chunks shared with the
//!   other restored requests and new prompts).
//!
//! `kvd sim run --trace` writes these rows to `<exp>_trace.csv`.

use serde::Serialize;

use super::events::{ReqIdx, SimTime, WorkerIdx, us_to_secs};

/// Why an interrupted request loads what it loads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RecoveryKind {
    /// It loads a checkpointed prefix from its holder, which is the target (local).
    LocalRestore,
    /// It loads a checkpointed prefix from its holder over the network (rebalanced away).
    RemoteRestore,
    /// Recomputed: its holder failed too.
    HolderFailed,
    /// Recomputed: its holder had nothing yet (the request had not produced a token, or its
    /// first chunk was in flight).
    NoCheckpointYet,
    /// Recomputed: it had no holder (no room, or the policy checkpoints nothing).
    NoHolder,
    /// It could not resume (the controller failed it).
    Failed,
}

/// One interruption of one request.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RecoveryTrace {
    /// The request.
    pub req: ReqIdx,
    /// The failure's time, seconds.
    pub failure_s: f64,
    /// The failed worker that served it.
    pub server: WorkerIdx,
    /// Its holder at the failure, if any.
    pub holder: Option<WorkerIdx>,
    /// Whether that holder failed in the same event.
    pub holder_failed: bool,
    /// Tokens its holder had at the failure.
    pub checkpointed_tokens: u32,
    /// Tokens whose KV had been computed before the failure.
    pub computed_tokens: u32,
    /// Prompt plus generated tokens at the failure.
    pub history_tokens: u32,
    /// Where it resumes (`None` when it failed).
    pub target: Option<WorkerIdx>,
    /// What it loads, tokens.
    pub load_tokens: u32,
    /// What it prefills, tokens (history − load).
    pub prefill_tokens: u32,
    /// Why.
    pub kind: RecoveryKind,
    /// Failure → ready to rejoin a batch, seconds.
    pub restore_s: f64,
    /// Ready → admitted to a batch, seconds.
    pub queue_s: f64,
    /// Admitted → next token, seconds.
    pub prefill_s: f64,
    /// Failure → next token, seconds (the sum of the three; 0 when it never resumed).
    pub stall_s: f64,
    /// Timestamps the three parts are taken from (µs; internal).
    #[serde(skip)]
    pub(crate) marks: Marks,
}

/// The moments a trace row's parts are measured between.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Marks {
    pub(crate) failure_us: SimTime,
    pub(crate) ready_us: Option<SimTime>,
    pub(crate) batch_us: Option<SimTime>,
    pub(crate) next_token_us: Option<SimTime>,
}

impl RecoveryTrace {
    /// Turns the marks into the three parts of the stall (call once the run is over).
    pub(crate) fn settle(&mut self) {
        let m = self.marks;
        let since =
            |a: SimTime, b: Option<SimTime>| b.map_or(0.0, |b| us_to_secs(b.saturating_sub(a)));
        self.failure_s = us_to_secs(m.failure_us);
        if let (Some(ready), Some(batch), Some(next)) = (m.ready_us, m.batch_us, m.next_token_us) {
            self.restore_s = since(m.failure_us, Some(ready));
            self.queue_s = since(ready, Some(batch));
            self.prefill_s = since(batch, Some(next));
            self.stall_s = since(m.failure_us, Some(next));
        }
    }
}

/// The trace rows as CSV, one line per row, prefixed by `prefix` columns (scenario, policy,
/// seed) and their `header`.
pub fn trace_csv(header: &str, rows: &[(String, Vec<RecoveryTrace>)]) -> String {
    let mut out = format!(
        "{header},req,failure_s,server,holder,holder_failed,checkpointed_tokens,computed_tokens,\
         history_tokens,target,load_tokens,prefill_tokens,kind,restore_s,queue_s,prefill_s,stall_s\n"
    );
    let opt = |w: Option<WorkerIdx>| w.map_or(String::new(), |w| w.to_string());
    for (prefix, trace) in rows {
        for t in trace {
            let kind = serde_json::to_value(t.kind)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default();
            out.push_str(&format!(
                "{prefix},{},{:.6},{},{},{},{},{},{},{},{},{},{kind},{:.6},{:.6},{:.6},{:.6}\n",
                t.req,
                t.failure_s,
                t.server,
                opt(t.holder),
                t.holder_failed,
                t.checkpointed_tokens,
                t.computed_tokens,
                t.history_tokens,
                opt(t.target),
                t.load_tokens,
                t.prefill_tokens,
                t.restore_s,
                t.queue_s,
                t.prefill_s,
                t.stall_s
            ));
        }
    }
    out
}
