//! What the front counts (`/status`, and `/metrics` as `kvd_control_front_<name>`) and the
//! recoveries it lists.

use kvd_control::{Epoch, RequestId, WorkerId};
use serde::{Deserialize, Serialize};

/// The front's counters (`/status`, and `/metrics` as `kvd_control_front_<name>`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FrontStats {
    /// Streams admitted.
    pub streams_started: u64,
    /// Requests refused before their stream began (bad request, no worker, overload).
    pub streams_refused: u64,
    /// Streams that ended with the engine's last token.
    pub streams_finished: u64,
    /// Streams that ended with an error event.
    pub streams_failed: u64,
    /// Streams cancelled because their client left.
    pub streams_cancelled: u64,
    /// Client connections that resumed a stream with Last-Event-ID.
    pub clients_resumed: u64,
    /// Tokens relayed to clients.
    pub tokens_relayed: u64,
    /// Requests resumed on a survivor.
    pub recoveries: u64,
    /// ... of which with a checkpoint to load (the plan named a KV source).
    pub recoveries_from_checkpoint: u64,
    /// ... of which recomputed from the tokens alone.
    pub recoveries_recomputed: u64,
    /// Tokens the plans loaded from checkpoints.
    pub restored_tokens: u64,
    /// Tokens the plans recomputed.
    pub recomputed_tokens: u64,
    /// Sum over recoveries of the time from the break to the survivor's first token, ms.
    pub recovery_ms: u64,
    /// Workers failed by this front (broken streams, failed health checks).
    pub workers_failed: u64,
    /// Workers brought back when their engine answered again.
    pub workers_recovered: u64,
    /// Checkpoint bytes the holders held when their request ended or broke.
    pub checkpoint_bytes: u64,
    /// Tokens those checkpoints covered.
    pub checkpoint_tokens: u64,
    /// Checkpoint moves the engine could not follow (its holder died mid-request).
    pub checkpoint_moves_unfollowed: u64,
    /// Holder admin calls that failed (the holder was then treated as gone).
    pub holder_calls_failed: u64,
    /// Checkpoint reports whose bytes passed the reservation (--kv-bytes-per-token too small).
    pub checkpoint_reports_clamped: u64,
}

impl FrontStats {
    /// Count one recovery.
    pub fn recovered(&mut self, rec: &RecoveryRecord) {
        self.recoveries += 1;
        if rec.kv_source.is_some() {
            self.recoveries_from_checkpoint += 1;
        } else {
            self.recoveries_recomputed += 1;
        }
        self.restored_tokens += u64::from(rec.load_tokens);
        self.recomputed_tokens += u64::from(rec.recompute_tokens);
        self.recovery_ms += rec.recovery_ms;
    }
}

/// One recovery, as `/status` lists it and the log line carries it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecoveryRecord {
    /// The request.
    pub request: RequestId,
    /// The epoch it resumed in.
    pub epoch: Epoch,
    /// The worker that broke.
    pub from: WorkerId,
    /// The survivor.
    pub to: WorkerId,
    /// Where its KV came from (`None`: recomputed).
    pub kv_source: Option<WorkerId>,
    /// Tokens the plan loaded from the checkpoint.
    pub load_tokens: u32,
    /// Tokens the plan recomputed.
    pub recompute_tokens: u32,
    /// Tokens generated before the break.
    pub committed_tokens: u32,
    /// Break (as the front saw it) to the survivor's first token, ms.
    pub recovery_ms: u64,
    /// Why it broke.
    pub reason: String,
}
