//! The load table: what the controller knows about each worker.
//!
//! One row per worker: checkpoint capacity and the part of it reserved for the checkpoints the
//! worker holds, its queueing delay `q_w` (mean arrival → prefill-start over the last samples),
//! how many checkpoints it holds, how many requests it serves, and its lifecycle phase. Rows
//! change only when an event arrives (request admitted, prefill started, request finished,
//! checkpoint stored, worker failed / recovered); the controller never polls.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

use super::WorkerId;

/// Where a worker is in its life, as the controller sees it.
///
/// A worker that joins starts in [`WorkerPhase::FullService`]. A failed worker that comes back
/// walks `LoadingDraft → Assist → HotSwap → FullService`; only `FullService` workers serve
/// new or recovering requests and hold checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum WorkerPhase {
    /// Dead: serves nothing, holds nothing.
    Failed,
    /// Back up, loading a small draft model.
    LoadingDraft,
    /// Runs the draft model as a speculative-decoding assistant for one paired survivor
    /// (the engine does the speculation; the controller only pairs).
    Assist,
    /// Swapping the full model in.
    HotSwap,
    /// Serving and holding checkpoints.
    FullService,
}

impl WorkerPhase {
    /// The phase that follows this one in a recovering worker's life, if any.
    pub fn next(self) -> Option<WorkerPhase> {
        match self {
            WorkerPhase::Failed => Some(WorkerPhase::LoadingDraft),
            WorkerPhase::LoadingDraft => Some(WorkerPhase::Assist),
            WorkerPhase::Assist => Some(WorkerPhase::HotSwap),
            WorkerPhase::HotSwap => Some(WorkerPhase::FullService),
            WorkerPhase::FullService => None,
        }
    }
}

impl std::fmt::Display for WorkerPhase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WorkerPhase::Failed => "FAILED",
            WorkerPhase::LoadingDraft => "LOADING_DRAFT",
            WorkerPhase::Assist => "ASSIST",
            WorkerPhase::HotSwap => "HOTSWAP",
            WorkerPhase::FullService => "FULL_SERVICE",
        })
    }
}

/// One worker's row in the load table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerLoad {
    /// The worker.
    pub id: WorkerId,
    /// Host memory this worker offers for checkpoints of other workers' requests, in bytes.
    pub capacity_bytes: u64,
    /// Sum of the reservations of the checkpoints this worker holds. Never above capacity.
    pub reserved_bytes: u64,
    /// Checkpoints this worker holds (requests whose holder it is).
    pub held_checkpoints: u32,
    /// Live requests this worker serves.
    pub serving_requests: u32,
    /// Lifecycle phase.
    pub phase: WorkerPhase,
    /// While in [`WorkerPhase::Assist`]: the survivor this worker assists.
    pub assisting: Option<WorkerId>,
    /// While a survivor is assisted: the recovering worker assisting it.
    pub assisted_by: Option<WorkerId>,
    /// Per serving worker: the part of `reserved_bytes` held for requests that worker serves
    /// (sums to `reserved_bytes`). What one server's failure would make this worker restore.
    #[serde(default)]
    held_for_server: BTreeMap<WorkerId, u64>,
    /// Last queueing-delay samples (arrival → prefill start), ms, oldest first; bounded.
    delay_samples_ms: VecDeque<u64>,
    /// Sum of `delay_samples_ms`.
    delay_sum_ms: u64,
    /// The prefill queued on this worker while a failure is dispatched, ms: the history of the
    /// requests it serves whose prefill has not started (`ADMITTED`, or `MIGRATING` to it), at
    /// the configured prefill rate. What recovery work handed to it now lands behind, which
    /// `q_w` (a mean over past requests) does not show. Set for the dispatch, 0 otherwise.
    #[serde(default)]
    pub queued_prefill_ms: f64,
}

impl WorkerLoad {
    /// A fresh row in full service with no load.
    pub fn new(id: WorkerId, capacity_bytes: u64) -> Self {
        WorkerLoad {
            id,
            capacity_bytes,
            reserved_bytes: 0,
            held_checkpoints: 0,
            serving_requests: 0,
            phase: WorkerPhase::FullService,
            assisting: None,
            assisted_by: None,
            held_for_server: BTreeMap::new(),
            delay_samples_ms: VecDeque::new(),
            delay_sum_ms: 0,
            queued_prefill_ms: 0.0,
        }
    }

    /// Capacity not reserved by held checkpoints, in bytes.
    pub fn free_bytes(&self) -> u64 {
        self.capacity_bytes.saturating_sub(self.reserved_bytes)
    }

    /// Whether this worker may serve requests and hold checkpoints.
    pub fn in_service(&self) -> bool {
        self.phase == WorkerPhase::FullService
    }

    /// Whether the worker is up at all (any phase but `Failed`).
    pub fn alive(&self) -> bool {
        self.phase != WorkerPhase::Failed
    }

    /// `q_w`: mean queueing delay over the window, ms (0 with no samples).
    pub fn queue_delay_ms(&self) -> f64 {
        if self.delay_samples_ms.is_empty() {
            0.0
        } else {
            self.delay_sum_ms as f64 / self.delay_samples_ms.len() as f64
        }
    }

    /// How long recovery work handed to this worker now waits to start, ms: `q_w` plus the
    /// queued prefill (recovery's dispatch ranks survivors by it).
    pub fn busy_ms(&self) -> f64 {
        self.queue_delay_ms() + self.queued_prefill_ms
    }

    /// Mean reservation of the checkpoints held here, in bytes (0 when none is held).
    pub fn mean_held_reservation_bytes(&self) -> f64 {
        if self.held_checkpoints == 0 {
            0.0
        } else {
            self.reserved_bytes as f64 / self.held_checkpoints as f64
        }
    }

    /// Bytes this worker holds for checkpoints of requests served by `serving`: what it would
    /// have to restore if `serving` failed.
    pub fn held_for(&self, serving: WorkerId) -> u64 {
        self.held_for_server.get(&serving).copied().unwrap_or(0)
    }

    /// Every `(serving worker, bytes held for its requests)`, by serving worker.
    pub fn held_by_server(&self) -> impl Iterator<Item = (WorkerId, u64)> + '_ {
        self.held_for_server.iter().map(|(&s, &b)| (s, b))
    }

    /// Record one queueing-delay sample, keeping at most `window` samples.
    pub(crate) fn record_delay(&mut self, delay_ms: u64, window: u32) {
        let window = window.max(1) as usize;
        while self.delay_samples_ms.len() >= window {
            let old = self.delay_samples_ms.pop_front().unwrap_or(0);
            self.delay_sum_ms -= old;
        }
        self.delay_samples_ms.push_back(delay_ms);
        self.delay_sum_ms += delay_ms;
    }

    /// Number of queueing-delay samples held.
    pub fn delay_samples(&self) -> usize {
        self.delay_samples_ms.len()
    }

    /// Reserve `bytes` for a checkpoint this worker will hold for a request served by
    /// `serving`.
    ///
    /// # Panics
    /// If the reservation does not fit (callers check [`WorkerLoad::free_bytes`] first), or
    /// `serving` is this worker (a holder never holds its own requests).
    pub(crate) fn reserve(&mut self, bytes: u64, serving: WorkerId) {
        assert!(
            bytes <= self.free_bytes(),
            "reservation over capacity on worker {}",
            self.id
        );
        assert_ne!(serving, self.id, "a worker never holds its own checkpoint");
        self.reserved_bytes += bytes;
        self.held_checkpoints += 1;
        *self.held_for_server.entry(serving).or_default() += bytes;
    }

    /// Release a reservation made by [`WorkerLoad::reserve`] for a request served by `serving`.
    pub(crate) fn release(&mut self, bytes: u64, serving: WorkerId) {
        assert!(
            self.held_checkpoints > 0 && self.reserved_bytes >= bytes,
            "release without reserve"
        );
        self.reserved_bytes -= bytes;
        self.held_checkpoints -= 1;
        self.take_from_server(serving, bytes);
    }

    /// A request whose checkpoint this worker holds is now served by `to` instead of `from`
    /// (a hand-off or a migration): its bytes count for `to`.
    pub(crate) fn reattribute(&mut self, from: WorkerId, to: WorkerId, bytes: u64) {
        if from == to {
            return;
        }
        self.take_from_server(from, bytes);
        *self.held_for_server.entry(to).or_default() += bytes;
    }

    fn take_from_server(&mut self, serving: WorkerId, bytes: u64) {
        let held = self
            .held_for_server
            .get_mut(&serving)
            .filter(|b| **b >= bytes)
            .unwrap_or_else(|| {
                panic!(
                    "worker {} releases bytes it never held for {serving}",
                    self.id
                )
            });
        *held -= bytes;
        if *held == 0 {
            self.held_for_server.remove(&serving);
        }
    }

    /// Rebuild the per-server attribution from `(serving worker, bytes)` pairs, one per held
    /// checkpoint (a snapshot from before the attribution existed).
    pub(crate) fn rebuild_attribution(&mut self, held: impl Iterator<Item = (WorkerId, u64)>) {
        self.held_for_server.clear();
        for (s, b) in held {
            *self.held_for_server.entry(s).or_default() += b;
        }
    }

    /// Forget every checkpoint and request: the worker died.
    pub(crate) fn clear_on_failure(&mut self) {
        self.reserved_bytes = 0;
        self.held_checkpoints = 0;
        self.serving_requests = 0;
        self.phase = WorkerPhase::Failed;
        self.assisting = None;
        self.assisted_by = None;
        self.held_for_server.clear();
        self.delay_samples_ms.clear();
        self.delay_sum_ms = 0;
    }
}

/// Every worker's row, ordered by worker id (iteration order is deterministic).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LoadTable {
    workers: BTreeMap<WorkerId, WorkerLoad>,
}

impl LoadTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// The row of worker `id`.
    pub fn get(&self, id: WorkerId) -> Option<&WorkerLoad> {
        self.workers.get(&id)
    }

    pub(crate) fn get_mut(&mut self, id: WorkerId) -> Option<&mut WorkerLoad> {
        self.workers.get_mut(&id)
    }

    pub(crate) fn insert(&mut self, row: WorkerLoad) {
        self.workers.insert(row.id, row);
    }

    /// Every row, by worker id.
    pub fn iter(&self) -> impl Iterator<Item = &WorkerLoad> {
        self.workers.values()
    }

    /// Worker `id`'s [`WorkerLoad::busy_ms`] (0 for a worker not in the table).
    pub fn busy_ms(&self, id: WorkerId) -> f64 {
        self.get(id).map_or(0.0, WorkerLoad::busy_ms)
    }

    /// Rows of workers in full service, by worker id.
    pub fn in_service(&self) -> impl Iterator<Item = &WorkerLoad> {
        self.workers.values().filter(|w| w.in_service())
    }

    /// Number of workers known (any phase).
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// Whether no worker is known.
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_delay_is_the_mean_of_the_last_window_samples() {
        let mut w = WorkerLoad::new(1, 100);
        for d in [10, 20, 30, 40] {
            w.record_delay(d, 2);
        }
        assert_eq!(w.delay_samples(), 2);
        assert_eq!(w.queue_delay_ms(), 35.0);
    }

    #[test]
    fn free_capacity_is_capacity_minus_reservations() {
        let mut w = WorkerLoad::new(1, 100);
        w.reserve(60, 2);
        assert_eq!(w.free_bytes(), 40);
        assert_eq!(w.mean_held_reservation_bytes(), 60.0);
        assert_eq!((w.held_for(2), w.held_for(3)), (60, 0));
        w.reattribute(2, 3, 60);
        assert_eq!((w.held_for(2), w.held_for(3)), (0, 60));
        w.release(60, 3);
        assert_eq!(w.free_bytes(), 100);
        assert_eq!(w.held_by_server().count(), 0);
    }

    #[test]
    #[should_panic(expected = "over capacity")]
    fn a_reservation_over_capacity_is_a_bug() {
        let mut w = WorkerLoad::new(1, 100);
        w.reserve(101, 2);
    }

    #[test]
    fn a_recovering_worker_walks_the_four_phases_in_order() {
        let mut p = WorkerPhase::Failed;
        let mut seen = vec![p];
        while let Some(n) = p.next() {
            p = n;
            seen.push(p);
        }
        assert_eq!(
            seen,
            [
                WorkerPhase::Failed,
                WorkerPhase::LoadingDraft,
                WorkerPhase::Assist,
                WorkerPhase::HotSwap,
                WorkerPhase::FullService
            ]
        );
    }
}
