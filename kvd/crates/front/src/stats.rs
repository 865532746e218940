//! What the front counts (`/status`, and `/metrics` as `kvd_control_front_<name>`), the
//! recoveries and the P/D hand-offs it lists.

use kvd_control::{Epoch, RequestId, WorkerId};
use serde::{Deserialize, Serialize};

/// The front's counters (`/status`, and `/metrics` as `kvd_control_front_<name>`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FrontStats {
    /// Streams admitted.
    pub streams_started: u64,
    /// Requests refused before their stream began (bad request, no worker, overload).
    pub streams_refused: u64,
    /// Admissions sent to another worker because the one picked left service before the
    /// request was admitted.
    #[serde(default)]
    pub admissions_repicked: u64,
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
    /// P/D: prefills sent to a prefill worker.
    pub prefills_started: u64,
    /// P/D: prefill answers that handed the prompt over (a decode attempt with their params).
    pub handoffs_started: u64,
    /// P/D: hand-offs whose prefill's token went to the client as the request's first.
    pub first_tokens_from_prefill: u64,
    /// P/D: hand-offs done (the decode's first token came).
    pub handoffs_done: u64,
    /// P/D: decode attempts resumed on a survivor with the hand-off params (the decode broke
    /// before its first token).
    pub handoffs_resumed: u64,
    /// P/D: prefills redone on another prefill worker (or the decode worker) after one broke.
    pub prefill_retries: u64,
    /// P/D: requests whose decode worker prefilled the prompt itself (no prefill worker left,
    /// or an answer that handed nothing over).
    pub self_prefills: u64,
    /// P/D: requests a prefill worker refused.
    pub prefills_refused: u64,
    /// P/D: hand-offs the decode worker refused.
    pub handoffs_refused: u64,
    /// P/D: requests cancelled during their prefill or transfer.
    pub handoffs_cancelled: u64,
    /// P/D: prefill answers of an older epoch, dropped.
    pub prefill_answers_stale: u64,
    /// P/D: hand-off holds ended at the prefill nodes.
    pub holds_ended: u64,
    /// P/D: hold ends the prefill node did not confirm (its lease ends the hold).
    pub hold_ends_failed: u64,
    /// P/D: sum over hand-offs of the prefill's time (sent to answered), ms.
    pub prefill_ms: u64,
    /// P/D: sum over hand-offs of the prefill's answer to the decode's first token, ms.
    pub handoff_ms: u64,
    /// Routing: requests sent to the least loaded worker (no node held any of the prompt).
    pub routed_by_load: u64,
    /// Routing: requests sent where the longest cached prefix lives.
    pub routed_by_cache: u64,
    /// Routing: requests whose longest cached prefix lived on a worker whose queue outweighed
    /// it (sent elsewhere: the engine's cluster lookup may still fetch the prefix).
    pub routed_load_over_cache: u64,
    /// Routing: prompt blocks the chosen workers' nodes held (summed over requests).
    pub routed_cached_blocks: u64,
    /// Routing: event feed reads that failed (the index keeps what it had), timeouts apart.
    pub route_feed_errors: u64,
    /// Routing: event feed reads that got no answer in time (a loaded or hung daemon).
    #[serde(default)]
    pub route_feed_timeouts: u64,
    /// Requests one engine served as they were, without recovery (`n` > 1, logprobs,
    /// structured output, tools: the answer says why).
    pub served_without_recovery: u64,
    /// Answers given whole at the end (the client asked for no stream).
    pub answered_whole: u64,
    /// Streams taken over from a front that died (its client resumed here).
    pub streams_taken_over: u64,
    /// Records of streams too large to keep for the other replicas (those streams cannot be
    /// taken over).
    pub records_too_large: u64,
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

/// Upper bounds of the hand-off time buckets, ms (1 ms … 10 s; beyond: the last, open one).
pub const HANDOFF_BUCKETS_MS: [u64; 13] = [
    1, 3, 5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000,
];

/// A histogram's counts (a fixed, small set of buckets: bounded), kept as plain data so the
/// front needs no metrics crate; `kvd control`'s `/metrics` encodes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Buckets {
    /// Upper bounds, ms, ascending.
    pub bounds_ms: Vec<u64>,
    /// Observations per bucket (one more than the bounds: the last is above them all).
    pub counts: Vec<u64>,
    /// Sum of the observations, ms.
    pub sum_ms: u64,
}

impl Buckets {
    /// Empty buckets with these upper bounds (ms, ascending).
    pub fn new(bounds_ms: &[u64]) -> Buckets {
        Buckets {
            bounds_ms: bounds_ms.to_vec(),
            counts: vec![0; bounds_ms.len() + 1],
            sum_ms: 0,
        }
    }

    /// Count one observation of `ms`.
    pub fn observe(&mut self, ms: u64) {
        let i = self.bounds_ms.partition_point(|b| *b < ms);
        self.counts[i] += 1;
        self.sum_ms = self.sum_ms.saturating_add(ms);
    }

    /// Observations in all.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
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

/// One P/D hand-off, as `/status` lists it (the last ones).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandoffRecord {
    /// The request.
    pub request: RequestId,
    /// The epoch of the decode attempt whose first token ended it.
    pub epoch: Epoch,
    /// The prefill worker.
    pub prefill: WorkerId,
    /// The decode worker.
    pub decode: WorkerId,
    /// The node whose daemon held the prompt's blocks (`None`: the answer named no hold).
    pub hold_node: Option<WorkerId>,
    /// The prefill's time, sent to answered, ms.
    pub prefill_ms: u64,
    /// The prefill's answer to the decode's first token, ms.
    pub handoff_ms: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_observation_lands_in_the_first_bucket_whose_bound_it_does_not_pass() {
        let mut b = Buckets::new(&[1, 10]);
        for ms in [0, 1, 2, 10, 11, 500] {
            b.observe(ms);
        }
        assert_eq!(b.counts, [2, 2, 2]);
        assert_eq!((b.count(), b.sum_ms), (6, 524));
    }
}
