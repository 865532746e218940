//! What a request's state machine takes in ([`Input`]: the engine's events, plans, clients,
//! time, P/D's prefill answers, a takeover's catch-up) and gives out ([`Action`]: what the
//! driver carries out, each [`Attempt`] on a worker, and how the stream [`Ending`]s).

use kvd_control::{Decision, Epoch, Event, RequestId, WorkerId};
use serde_json::Value;

use super::pd::HandoffNote;
use crate::stats::RecoveryRecord;

/// What happens to a request.
#[derive(Debug, Clone)]
pub enum Input {
    /// Begin: the first attempt.
    Start,
    /// One event of attempt `epoch`'s stream (its `data`).
    EngineEvent {
        /// The attempt.
        epoch: Epoch,
        /// The event's data.
        data: String,
    },
    /// Attempt `epoch`'s engine closed the stream cleanly.
    EngineEnded {
        /// The attempt.
        epoch: Epoch,
    },
    /// Attempt `epoch`'s stream broke (or could not start): the worker may be gone.
    EngineBroken {
        /// The attempt.
        epoch: Epoch,
        /// Why.
        reason: String,
    },
    /// Attempt `epoch`'s engine sent nothing for `waited_ms`: a broken stream.
    EngineSilent {
        /// The attempt.
        epoch: Epoch,
        /// How long it was silent, ms.
        waited_ms: u64,
    },
    /// The engine refused or failed the request itself (it still answers): no recovery.
    EngineFailed {
        /// The attempt.
        epoch: Epoch,
        /// Why.
        reason: String,
        /// The engine's HTTP status, when it refused the request with one (a 4xx).
        status: Option<u16>,
    },
    /// The answer to [`Action::CheckHealth`].
    Health {
        /// The attempt that broke.
        epoch: Epoch,
        /// Whether the engine answers.
        alive: bool,
    },
    /// A decision of the controller about this request (a plan: restore, failure, checkpoint
    /// move), whenever it comes.
    Plan(Decision),
    /// [`Action::Recover`] gave no plan for this request.
    Unplanned {
        /// The attempt that broke.
        epoch: Epoch,
        /// Why.
        reason: String,
    },
    /// The decisions an [`Action::Control`] event caused (the cancel's epoch among them).
    Decided(Vec<Decision>),
    /// The number of clients reading the stream changed (arrived, left, resumed).
    Clients(u32),
    /// Time passed (the grace of a request without a client may be over).
    Tick,
    /// Time to read the checkpoint's progress from the holder.
    ProgressDue,
    /// A taken-over stream's catch-up answered (the engine's JSON response: the tokens the
    /// client already has).
    CaughtUp {
        /// The attempt.
        epoch: Epoch,
        /// The answer.
        answer: Value,
    },
    /// P/D: the answer to [`Action::PickPrefill`] (`None`: no prefill worker is left).
    PrefillWorker {
        /// The attempt.
        epoch: Epoch,
        /// The prefill worker to send it to.
        worker: Option<WorkerId>,
    },
    /// P/D: attempt `epoch`'s prefill answered (the engine's JSON response).
    PrefillDone {
        /// The attempt.
        epoch: Epoch,
        /// The answer.
        answer: Value,
    },
    /// P/D: attempt `epoch`'s prefill broke (5xx, no connection, no answer in time): the
    /// prefill worker is in trouble.
    PrefillBroken {
        /// The attempt.
        epoch: Epoch,
        /// Why.
        reason: String,
    },
    /// P/D: the prefill worker refused the request itself (4xx): no recovery.
    PrefillRefused {
        /// The attempt.
        epoch: Epoch,
        /// The HTTP status.
        status: u16,
        /// What it said.
        text: String,
    },
}

/// One attempt on a worker.
#[derive(Debug, Clone, PartialEq)]
pub struct Attempt {
    /// Its epoch.
    pub epoch: Epoch,
    /// The worker whose engine runs it.
    pub worker: WorkerId,
    /// The engine body.
    pub body: Value,
}

/// How a stream ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    /// With the engine's last token.
    Finished,
    /// Its client left.
    Cancelled,
    /// With an error event.
    Failed(String),
}

/// What the driver is to do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Tell the controller (answer with [`Input::Decided`]).
    Control(Event),
    /// Start the first attempt.
    Forward(Attempt),
    /// Start an attempt that resumes the request on a survivor.
    Resume(Attempt),
    /// P/D: choose a prefill worker not in `tried` (answer with [`Input::PrefillWorker`]).
    PickPrefill {
        /// The attempt.
        epoch: Epoch,
        /// The prefill workers whose prefill of this request broke.
        tried: Vec<WorkerId>,
    },
    /// A taken-over stream: generate the tokens the client already has, without a stream
    /// (answer with [`Input::CaughtUp`], [`Input::EngineBroken`] or [`Input::EngineFailed`]);
    /// [`Action::Cancel`] of its epoch drops it.
    CatchUp(Attempt),
    /// P/D: send the prefill (answer with [`Input::PrefillDone`], [`Input::PrefillBroken`] or
    /// [`Input::PrefillRefused`]); [`Action::Cancel`] of its epoch drops it.
    Prefill(Attempt),
    /// P/D: end the hand-off hold of `request` at `node`'s daemon (epochs up to `epoch`).
    EndHold {
        /// The prefill node.
        node: WorkerId,
        /// The request.
        request: RequestId,
        /// The hold's epoch.
        epoch: Epoch,
    },
    /// P/D: a hand-off window to log and count.
    Handoff(HandoffNote),
    /// Append a frame to the client's log.
    Relay {
        /// Its sequence number.
        seq: u64,
        /// The SSE frame.
        frame: String,
        /// Tokens it carries.
        tokens: u32,
    },
    /// Drop attempt `epoch`'s engine connection, stream or prefill (the engine aborts the
    /// request).
    Cancel {
        /// The attempt.
        epoch: Epoch,
    },
    /// Ask `worker`'s engine whether it answers (answer with [`Input::Health`]).
    CheckHealth {
        /// The attempt that broke.
        epoch: Epoch,
        /// Its worker.
        worker: WorkerId,
    },
    /// Fail `worker` with the controller, after asking the holders what they hold (answer with
    /// the [`Input::Plan`] for this request, or [`Input::Unplanned`]).
    Recover {
        /// The attempt that broke.
        epoch: Epoch,
        /// Its worker.
        worker: WorkerId,
    },
    /// The holder died mid-request: this attempt runs without a checkpoint.
    HolderLost {
        /// The holder the controller chose instead (the engine cannot follow).
        new_holder: Option<WorkerId>,
    },
    /// A recovery is done (the survivor's first token).
    Recovered(RecoveryRecord),
    /// Report what `holder` holds to the controller.
    ReportProgress {
        /// The holder.
        holder: WorkerId,
        /// The epoch of the checkpoint.
        epoch: Epoch,
        /// Prompt plus generated tokens.
        history: usize,
    },
    /// End a checkpoint at its holder.
    EndCheckpoint {
        /// The holder.
        holder: WorkerId,
        /// The checkpoint's epoch.
        epoch: Epoch,
        /// Count what it holds first (the request's own checkpoint, at its end).
        measure: bool,
        /// Wait for it (at the end) rather than let it run beside the stream.
        wait: bool,
    },
    /// The stream is over (the checkpoint ends that follow it come last; the driver closes
    /// the log after them).
    End(Ending),
}
