//! What the simulator keeps beside the workers: per request, per checkpoint chunk and host
//! memory, and the run's progress counters.

use super::super::events::{ReqIdx, SimTime, WorkerIdx};
use super::super::worker::{Admitted, SlotOutcome};

/// Simulator-side state of a request.
#[derive(Debug, Clone, Default)]
pub(super) struct ReqSim {
    /// The controller's epoch for it.
    pub(super) epoch: u64,
    /// Bumped at every interruption: restore events of an older one are dropped.
    pub(super) incarnation: u64,
    /// Where it runs (or is being restored to).
    pub(super) worker: Option<WorkerIdx>,
    /// Its checkpoint holder.
    pub(super) holder: Option<WorkerIdx>,
    /// Bumped when the holder changes: chunks for an older holder are dropped.
    pub(super) holder_gen: u64,
    /// Tokens the holder has (transfer done).
    pub(super) ckpt_tokens: u32,
    /// Tokens sent or being sent to the holder.
    pub(super) ckpt_sent_tokens: u32,
    /// Host bytes it occupies at its holder.
    pub(super) ckpt_bytes: u64,
    /// Output tokens generated (delivered) so far.
    pub(super) generated: u32,
    /// Tokens whose KV is on its current worker's GPU.
    pub(super) context_tokens: u32,
    /// Whether its current incarnation has produced a token (decoding started).
    pub(super) decoding: bool,
    /// Completed or failed.
    pub(super) done: bool,
    /// The recovery-trace row of its current interruption, until its next token.
    pub(super) trace_row: Option<usize>,
}

/// One request's part of a checkpoint chunk.
#[derive(Debug, Clone, Copy)]
pub(super) struct Piece {
    pub(super) req: ReqIdx,
    pub(super) holder: WorkerIdx,
    pub(super) holder_gen: u64,
    pub(super) upto_tokens: u32,
    pub(super) bytes: u64,
}

/// Checkpoint chunks in flight and the host memory holders spend on checkpoints.
#[derive(Debug, Default)]
pub(super) struct Checkpoints {
    /// Chunks in flight, by the index their `CheckpointDone` event names (taken when done).
    pub(super) chunks: Vec<Vec<Piece>>,
    /// Host checkpoint bytes each worker holds now.
    pub(super) host_bytes: Vec<u64>,
    /// The most each worker ever held.
    pub(super) peak_host_bytes: Vec<u64>,
}

impl Checkpoints {
    /// No checkpoint anywhere, on `workers` workers.
    pub(super) fn new(workers: usize) -> Self {
        Checkpoints {
            chunks: Vec::new(),
            host_bytes: vec![0; workers],
            peak_host_bytes: vec![0; workers],
        }
    }

    /// `bytes` more land at `holder`.
    pub(super) fn store(&mut self, holder: WorkerIdx, bytes: u64) {
        self.host_bytes[holder] += bytes;
        self.peak_host_bytes[holder] = self.peak_host_bytes[holder].max(self.host_bytes[holder]);
    }

    /// `bytes` held at `holder` are dropped.
    pub(super) fn release(&mut self, holder: WorkerIdx, bytes: u64) {
        assert!(
            self.host_bytes[holder] >= bytes,
            "worker {holder} releases more checkpoint bytes than it holds"
        );
        self.host_bytes[holder] -= bytes;
    }

    /// A chunk leaves; returns the index its completion event names.
    pub(super) fn send(&mut self, pieces: Vec<Piece>) -> usize {
        self.chunks.push(pieces);
        self.chunks.len() - 1
    }
}

/// How far the run is: arrivals, requests outstanding, workers down, failure times.
#[derive(Debug, Default)]
pub(super) struct Progress {
    /// Requests arrived and neither completed nor failed.
    pub(super) outstanding: usize,
    /// Requests arrived so far.
    pub(super) arrived: usize,
    /// Workers down (failed and not yet back in full service).
    pub(super) down: usize,
    /// The first failure's time.
    pub(super) first_failure_us: Option<SimTime>,
    /// When the last failed worker came back into full service (reset by a new failure).
    pub(super) capacity_restored_us: Option<SimTime>,
}

impl Progress {
    /// Whether the run has nothing left to do: every request arrived and finished, every
    /// worker is back.
    pub(super) fn all_done(&self, requests: usize) -> bool {
        self.outstanding == 0 && self.arrived == requests && self.down == 0
    }
}

/// Buffers reused across iterations (no allocation per iteration).
#[derive(Debug, Default)]
pub(super) struct Scratch {
    /// Requests an iteration admitted.
    pub(super) admitted: Vec<Admitted>,
    /// What an iteration did to each request in its batch.
    pub(super) outcomes: Vec<SlotOutcome>,
}
