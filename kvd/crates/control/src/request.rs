//! The request state machine with epochs, and stream sequence numbers.
//!
//! ```text
//!            ┌──────────────────────── running ─────────────────────────┐
//!  ADMITTED ─┴→ PREFILLING ─→ TRANSFERRING ─→ DECODING ─→ COMPLETED     │
//!      │             ↑             │              │                      │
//!      └─────────────┼─────────────┴──────────────┴─→ MIGRATING ─────────┘
//!                    └──────────────────────────────────┘ (epoch + 1)
//!  any running state ─→ CANCELLING (epoch + 1) ─→ CANCELLED
//!  any running state ─→ FAILED
//! ```
//!
//! - The **epoch** names one incarnation of a request: 1 at admission, +1 at every migration
//!   and at a cancel. Every event names the epoch it belongs to; the transition is a
//!   compare-and-swap on it: an event for an older epoch is dropped (and counted), an event for a
//!   newer epoch than the controller knows is refused as invalid.
//! - Within one epoch the running states only move forward (`ADMITTED`/`MIGRATING` <
//!   `PREFILLING` < `TRANSFERRING` < `DECODING`); an event that would move a request back (a
//!   replay) changes nothing. Skipping forward is allowed (colocated serving never transfers).
//! - Terminal states (`COMPLETED`, `CANCELLED`, `FAILED`) are idempotent: a replayed terminal
//!   event changes nothing.
//! - Stream frames carry `(request_id, sequence_no)`; the gateway acknowledges them. After a
//!   migration the new worker resumes the stream at `last acknowledged + 1`, and a
//!   [`StreamCursor`] at the gateway delivers each sequence number exactly once.

use serde::{Deserialize, Serialize};

use super::{Epoch, RequestId, WorkerId};
use crate::{Error, Result};

/// Where a request is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RequestState {
    /// Accepted and placed; waiting for prefill.
    Admitted,
    /// Prefill running on the serving worker.
    Prefilling,
    /// KV moving from a prefill worker to a decode worker (P/D disaggregation).
    Transferring,
    /// Generating tokens.
    Decoding,
    /// Its worker died (or it was moved); a restore plan was issued under a new epoch.
    Migrating,
    /// A cancel was issued under a new epoch; waiting for the worker to confirm.
    Cancelling,
    /// Finished normally. Terminal.
    Completed,
    /// Cancelled. Terminal.
    Cancelled,
    /// Failed (engine error, migration budget, deadline, no survivor). Terminal.
    Failed,
}

impl RequestState {
    /// Whether no event can change this state any more.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            RequestState::Completed | RequestState::Cancelled | RequestState::Failed
        )
    }

    /// Whether the request is executing (or waiting to execute) on a worker.
    pub fn is_running(self) -> bool {
        matches!(
            self,
            RequestState::Admitted
                | RequestState::Prefilling
                | RequestState::Transferring
                | RequestState::Decoding
                | RequestState::Migrating
        )
    }

    /// Whether its engine has not started this epoch yet: admitted and not at its first token,
    /// or migrating and not at its next. Work queued on its worker ahead of a new prompt.
    pub fn awaits_start(self) -> bool {
        self.progress_rank() == Some(0)
    }

    /// Order of the running states within one epoch (forward only).
    pub(crate) fn progress_rank(self) -> Option<u8> {
        match self {
            RequestState::Admitted | RequestState::Migrating => Some(0),
            RequestState::Prefilling => Some(1),
            RequestState::Transferring => Some(2),
            RequestState::Decoding => Some(3),
            _ => None,
        }
    }
}

impl std::fmt::Display for RequestState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RequestState::Admitted => "ADMITTED",
            RequestState::Prefilling => "PREFILLING",
            RequestState::Transferring => "TRANSFERRING",
            RequestState::Decoding => "DECODING",
            RequestState::Migrating => "MIGRATING",
            RequestState::Cancelling => "CANCELLING",
            RequestState::Completed => "COMPLETED",
            RequestState::Cancelled => "CANCELLED",
            RequestState::Failed => "FAILED",
        })
    }
}

/// Everything the controller knows about one request (a row of the placement table).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// The request.
    pub id: RequestId,
    /// Current state.
    pub state: RequestState,
    /// Current epoch (see the module docs).
    pub epoch: Epoch,
    /// The worker executing it (for a migrating request: the restore target).
    pub serving: WorkerId,
    /// The worker holding its checkpoint, if it has one. Never `serving`.
    pub holder: Option<WorkerId>,
    /// Bytes reserved on `holder` (0 without a holder).
    pub reserved_bytes: u64,
    /// Conservative footprint asked for at admission.
    pub reserve_bytes: u64,
    /// Tokens covered by the verified, published checkpoint on `holder`.
    pub checkpointed_tokens: u32,
    /// Bytes of that checkpoint.
    pub checkpoint_bytes: u64,
    /// Prompt length.
    pub prompt_tokens: u32,
    /// Generation limit.
    pub max_new_tokens: u32,
    /// Generated tokens committed so far (the engine's report).
    pub generated_tokens: u32,
    /// Highest stream sequence number the gateway acknowledged.
    pub acked_seq: Option<u64>,
    /// Arrival time, ms.
    pub arrival_ms: u64,
    /// Absolute deadline, ms, if any.
    pub deadline_ms: Option<u64>,
    /// Migrations still allowed.
    pub migrations_left: u32,
    /// Migrations done so far.
    pub migrations: u32,
    /// Why the request failed, once `FAILED`.
    pub failure: Option<String>,
}

impl RequestRecord {
    /// Token history a restore must rebuild: prompt plus committed generated tokens.
    pub fn history_tokens(&self) -> u32 {
        self.prompt_tokens.saturating_add(self.generated_tokens)
    }

    /// The first stream sequence number a resumed stream sends: last acknowledged + 1.
    pub fn resume_seq(&self) -> u64 {
        self.acked_seq.map_or(0, |s| s + 1)
    }

    /// Bytes per token of this request's KV, estimated from its reservation.
    pub fn bytes_per_token(&self) -> u64 {
        let ctx = (self.prompt_tokens as u64 + self.max_new_tokens as u64).max(1);
        self.reserve_bytes / ctx
    }

    /// The compare half of every transition: `epoch` must be the current one.
    ///
    /// # Errors
    /// [`Error::StaleEpoch`] for an older epoch (the event is dropped);
    /// [`Error::InvalidArgument`] for an epoch the controller never issued.
    pub fn check_epoch(&self, epoch: Epoch) -> Result<()> {
        if epoch < self.epoch {
            Err(Error::StaleEpoch {
                got: epoch,
                current: self.epoch,
            })
        } else if epoch > self.epoch {
            Err(Error::InvalidArgument(format!(
                "request {}: epoch {epoch} was never issued (current {})",
                self.id, self.epoch
            )))
        } else {
            Ok(())
        }
    }
}

/// What a gateway does with an incoming stream frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FrameVerdict {
    /// The next frame: deliver it (and acknowledge it).
    Deliver,
    /// Already delivered (a resumed stream re-sent it): drop it.
    Duplicate,
}

/// A gateway's view of one output stream: delivers every sequence number exactly once, in order.
///
/// After a migration the new worker starts at the controller's `resume_seq`, the last
/// acknowledged number plus one: frames at or below what was delivered are duplicates and
/// dropped; a frame beyond the next one is a gap, refused (a worker that skips would lose
/// tokens).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamCursor {
    next_seq: u64,
}

impl StreamCursor {
    /// A cursor expecting sequence number 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// The next sequence number this cursor will deliver.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// The last delivered sequence number (what the gateway acknowledges), if any.
    pub fn last_acked(&self) -> Option<u64> {
        self.next_seq.checked_sub(1)
    }

    /// Judge frame `seq`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `seq` skips past the next expected number.
    pub fn accept(&mut self, seq: u64) -> Result<FrameVerdict> {
        if seq < self.next_seq {
            Ok(FrameVerdict::Duplicate)
        } else if seq == self.next_seq {
            self.next_seq += 1;
            Ok(FrameVerdict::Deliver)
        } else {
            Err(Error::InvalidArgument(format!(
                "stream gap: frame {seq} arrived, {} expected",
                self.next_seq
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resumed_stream_never_duplicates_or_skips_a_frame() {
        let mut gw = StreamCursor::new();
        for s in 0..5 {
            assert_eq!(gw.accept(s), Ok(FrameVerdict::Deliver));
        }
        // Worker dies; the controller saw ack 3 (frame 4 was delivered but its ack was lost).
        let resume = 3 + 1;
        let mut delivered = vec![];
        for s in resume..8 {
            if gw.accept(s).unwrap() == FrameVerdict::Deliver {
                delivered.push(s);
            }
        }
        assert_eq!(delivered, [5, 6, 7]);
        assert!(gw.accept(9).is_err(), "a gap is refused");
        assert_eq!(gw.last_acked(), Some(7));
    }

    #[test]
    fn only_the_current_epoch_passes_the_compare() {
        let r = RequestRecord {
            id: 1,
            state: RequestState::Decoding,
            epoch: 3,
            serving: 0,
            holder: None,
            reserved_bytes: 0,
            reserve_bytes: 0,
            checkpointed_tokens: 0,
            checkpoint_bytes: 0,
            prompt_tokens: 1,
            max_new_tokens: 1,
            generated_tokens: 0,
            acked_seq: None,
            arrival_ms: 0,
            deadline_ms: None,
            migrations_left: 1,
            migrations: 0,
            failure: None,
        };
        assert_eq!(
            r.check_epoch(2),
            Err(Error::StaleEpoch { got: 2, current: 3 })
        );
        assert!(matches!(r.check_epoch(4), Err(Error::InvalidArgument(_))));
        assert_eq!(r.check_epoch(3), Ok(()));
    }

    #[test]
    fn terminal_and_running_states_do_not_overlap() {
        use RequestState::*;
        for s in [
            Admitted,
            Prefilling,
            Transferring,
            Decoding,
            Migrating,
            Cancelling,
            Completed,
            Cancelled,
            Failed,
        ] {
            assert!(!(s.is_terminal() && s.is_running()), "{s}");
        }
    }
}
