//! The controller as data: [`Event`]s in, [`Decision`]s out, through [`Controller::apply`].

use serde::{Deserialize, Serialize};

use super::{Admission, AdmitRequest, Controller};
use crate::Result;
use crate::load::WorkerPhase;
use crate::recovery::{RecoveryPlan, RestorePlan};
use crate::{Epoch, RequestId, WorkerId};

/// An event reported to the controller, as data (the form the service and the C ABI carry).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Event {
    /// A worker joins (in full service) or reports a new checkpoint capacity.
    WorkerJoined {
        /// The worker.
        worker: WorkerId,
        /// Checkpoint capacity it offers, bytes.
        capacity_bytes: u64,
    },
    /// Workers died (one event for simultaneous failures).
    WorkersFailed {
        /// The dead workers.
        workers: Vec<WorkerId>,
    },
    /// A failed worker is back; it starts `LOADING_DRAFT`.
    WorkerRecovered {
        /// The worker.
        worker: WorkerId,
    },
    /// A recovering worker finished a phase.
    WorkerPhaseDone {
        /// The worker.
        worker: WorkerId,
        /// The phase it finished.
        phase: WorkerPhase,
    },
    /// A gateway admits a request.
    Admit(AdmitRequest),
    /// Prefill started (after admission, or after a migration's restore began).
    PrefillStarted {
        /// The request.
        request_id: RequestId,
        /// Its epoch.
        epoch: Epoch,
    },
    /// A prefill worker outside the controller's pool (P/D: the front's own prefill pool) failed
    /// the prefill of `epoch`: the request starts again under epoch + 1 (`MIGRATING`, then
    /// `PREFILLING` with the next `PrefillStarted`), served by the same worker; every late event
    /// of the old epoch is dropped. It spends no migration budget (the front bounds its retries
    /// by its prefill pool).
    PrefillRetried {
        /// The request.
        request_id: RequestId,
        /// The epoch whose prefill failed.
        epoch: Epoch,
    },
    /// KV hand-off from the prefill worker to the decode worker `to` started.
    TransferStarted {
        /// The request.
        request_id: RequestId,
        /// Its epoch.
        epoch: Epoch,
        /// The decode worker, which serves the request from now on.
        to: WorkerId,
    },
    /// Decoding started.
    DecodingStarted {
        /// The request.
        request_id: RequestId,
        /// Its epoch.
        epoch: Epoch,
    },
    /// The engine committed generated tokens (a running total).
    TokensCommitted {
        /// The request.
        request_id: RequestId,
        /// Its epoch.
        epoch: Epoch,
        /// Generated tokens committed so far.
        generated_tokens: u32,
    },
    /// The holder published a verified checkpoint covering `tokens` tokens in `bytes` bytes.
    CheckpointStored {
        /// The request.
        request_id: RequestId,
        /// Its epoch.
        epoch: Epoch,
        /// Tokens covered (a running total).
        tokens: u32,
        /// Bytes stored (≤ the reservation).
        bytes: u64,
    },
    /// The gateway acknowledged stream frame `sequence_no`.
    FrameAcked {
        /// The request.
        request_id: RequestId,
        /// Its epoch.
        epoch: Epoch,
        /// The acknowledged frame.
        sequence_no: u64,
    },
    /// The request finished normally.
    Finished {
        /// The request.
        request_id: RequestId,
        /// Its epoch.
        epoch: Epoch,
    },
    /// The client cancels the request (needs no epoch: a cancel supersedes every incarnation).
    Cancel {
        /// The request.
        request_id: RequestId,
    },
    /// The worker confirms a cancel (names the cancel's epoch).
    Cancelled {
        /// The request.
        request_id: RequestId,
        /// The epoch the cancel decision carried.
        epoch: Epoch,
    },
    /// The engine failed the request.
    RequestFailed {
        /// The request.
        request_id: RequestId,
        /// Its epoch.
        epoch: Epoch,
        /// Why.
        reason: String,
    },
}

/// Something the engine or gateway must carry out, as data.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Decision {
    /// A request was admitted; stream its checkpoint to `holder`.
    Admitted(Admission),
    /// A live request's checkpoint moves (its holder died or became its server): restart
    /// checkpointing at `holder` (`None`: run without one).
    Checkpoint {
        /// The request.
        request_id: RequestId,
        /// Its epoch.
        epoch: Epoch,
        /// The new holder.
        holder: Option<WorkerId>,
    },
    /// Resume an interrupted request.
    Restore(RestorePlan),
    /// A request failed (migration budget, deadline, no survivor).
    RequestFailed {
        /// The request.
        request_id: RequestId,
        /// The epoch it failed in.
        epoch: Epoch,
        /// Why, for the client.
        reason: String,
    },
    /// Stop the request on `worker`, then report `Cancelled` with this epoch.
    Cancel {
        /// The request.
        request_id: RequestId,
        /// The cancel's epoch.
        epoch: Epoch,
        /// Where it runs.
        worker: WorkerId,
    },
    /// A recovering worker enters `phase`; in `ASSIST` it assists `assisting`.
    WorkerPhase {
        /// The recovering worker.
        worker: WorkerId,
        /// Its new phase.
        phase: WorkerPhase,
        /// The survivor it assists (in `ASSIST`, when one was free).
        assisting: Option<WorkerId>,
    },
}

impl Controller {
    /// Apply one event given as data. The decisions are what the typed method returned
    /// (an admission becomes [`Decision::Admitted`], a failure one decision per plan entry).
    ///
    /// # Errors
    /// Those of the typed method.
    pub fn apply(&mut self, event: &Event, now_ms: u64) -> Result<Vec<Decision>> {
        match event {
            Event::WorkerJoined {
                worker,
                capacity_bytes,
            } => self.add_worker(*worker, *capacity_bytes, now_ms),
            Event::WorkersFailed { workers } => {
                Ok(self.fail_workers(workers, now_ms)?.into_decisions())
            }
            Event::WorkerRecovered { worker } => self.worker_recovered(*worker, now_ms),
            Event::WorkerPhaseDone { worker, phase } => {
                self.worker_phase_done(*worker, *phase, now_ms)
            }
            Event::Admit(req) => Ok(vec![Decision::Admitted(self.admit(*req, now_ms)?)]),
            Event::PrefillStarted { request_id, epoch } => {
                self.prefill_started(*request_id, *epoch, now_ms)
            }
            Event::PrefillRetried { request_id, epoch } => {
                self.prefill_retried(*request_id, *epoch, now_ms)
            }
            Event::TransferStarted {
                request_id,
                epoch,
                to,
            } => self.transfer_started(*request_id, *epoch, *to, now_ms),
            Event::DecodingStarted { request_id, epoch } => {
                self.decoding_started(*request_id, *epoch, now_ms)
            }
            Event::TokensCommitted {
                request_id,
                epoch,
                generated_tokens,
            } => self.tokens_committed(*request_id, *epoch, *generated_tokens, now_ms),
            Event::CheckpointStored {
                request_id,
                epoch,
                tokens,
                bytes,
            } => self.checkpoint_stored(*request_id, *epoch, *tokens, *bytes, now_ms),
            Event::FrameAcked {
                request_id,
                epoch,
                sequence_no,
            } => self.frame_acked(*request_id, *epoch, *sequence_no, now_ms),
            Event::Finished { request_id, epoch } => self.finished(*request_id, *epoch, now_ms),
            Event::Cancel { request_id } => self.cancel(*request_id, now_ms),
            Event::Cancelled { request_id, epoch } => self.cancelled(*request_id, *epoch, now_ms),
            Event::RequestFailed {
                request_id,
                epoch,
                reason,
            } => self.request_failed(*request_id, *epoch, reason, now_ms),
        }
    }
}

impl RecoveryPlan {
    /// The plan as a list of decisions (restores, failures, checkpoint moves).
    pub fn into_decisions(self) -> Vec<Decision> {
        let mut out = Vec::with_capacity(
            self.restores.len() + self.failed_requests.len() + self.checkpoint_moves.len(),
        );
        out.extend(self.restores.into_iter().map(Decision::Restore));
        out.extend(
            self.failed_requests
                .into_iter()
                .map(|(request_id, epoch, reason)| Decision::RequestFailed {
                    request_id,
                    epoch,
                    reason,
                }),
        );
        out.extend(
            self.checkpoint_moves
                .into_iter()
                .map(|(request_id, epoch, holder)| Decision::Checkpoint {
                    request_id,
                    epoch,
                    holder,
                }),
        );
        out
    }
}
