//! Workers joining, recovering and walking LOADING_DRAFT → ASSIST → HOTSWAP → FULL_SERVICE, and
//! the assist pairing of a recovering worker with a busy survivor.

use super::{Controller, Decision};
use crate::WorkerId;
use crate::load::{WorkerLoad, WorkerPhase};
use crate::{Error, Result};

impl Controller {
    /// A worker joins in full service with `capacity_bytes` of checkpoint capacity, or a known
    /// live worker reports a new capacity.
    ///
    /// # Errors
    /// [`Error::Overloaded`] beyond `max_workers`; [`Error::NoSpace`] when a new capacity is
    /// below what is already reserved; [`Error::Unavailable`] for a failed worker (report
    /// [`Controller::worker_recovered`] instead).
    pub fn add_worker(
        &mut self,
        worker: WorkerId,
        capacity_bytes: u64,
        _now_ms: u64,
    ) -> Result<Vec<Decision>> {
        match self.load.get_mut(worker) {
            Some(w) if !w.alive() => Err(Error::Unavailable(format!(
                "worker {worker} is failed; report its recovery"
            ))),
            Some(w) => {
                if w.capacity_bytes == capacity_bytes {
                    self.stats.duplicate_events += 1;
                } else if capacity_bytes < w.reserved_bytes {
                    return Err(Error::NoSpace {
                        requested_bytes: w.reserved_bytes,
                        free_bytes: capacity_bytes,
                    });
                } else {
                    w.capacity_bytes = capacity_bytes;
                }
                Ok(vec![])
            }
            None => {
                if self.load.len() >= self.config.max_workers as usize {
                    return Err(Error::Overloaded {
                        what: format!("worker table full ({} workers)", self.config.max_workers),
                        retry_after_ms: 0,
                    });
                }
                self.load.insert(WorkerLoad::new(worker, capacity_bytes));
                Ok(vec![])
            }
        }
    }

    /// A failed worker is back up: it enters `LOADING_DRAFT`.
    ///
    /// # Errors
    /// [`Error::NotFound`] for an unknown worker. A worker already up changes nothing.
    pub fn worker_recovered(&mut self, worker: WorkerId, _now_ms: u64) -> Result<Vec<Decision>> {
        let w = self
            .load
            .get_mut(worker)
            .ok_or_else(|| Error::NotFound(format!("worker {worker}")))?;
        if w.alive() {
            self.stats.duplicate_events += 1;
            return Ok(vec![]);
        }
        w.phase = WorkerPhase::LoadingDraft;
        Ok(vec![Decision::WorkerPhase {
            worker,
            phase: WorkerPhase::LoadingDraft,
            assisting: None,
        }])
    }

    /// A recovering worker finished `phase`: `LOADING_DRAFT → ASSIST` (paired one-to-one with the
    /// free survivor of highest queueing delay), `ASSIST → HOTSWAP` (unpaired),
    /// `HOTSWAP → FULL_SERVICE` (a placement candidate again).
    ///
    /// # Errors
    /// [`Error::NotFound`] for an unknown worker; [`Error::Unavailable`] for a failed one;
    /// [`Error::InvalidArgument`] for a phase the worker has not reached. A phase already left
    /// behind changes nothing.
    pub fn worker_phase_done(
        &mut self,
        worker: WorkerId,
        phase: WorkerPhase,
        _now_ms: u64,
    ) -> Result<Vec<Decision>> {
        let cur = self
            .load
            .get(worker)
            .ok_or_else(|| Error::NotFound(format!("worker {worker}")))?
            .phase;
        if cur == WorkerPhase::Failed {
            return Err(Error::Unavailable(format!("worker {worker} is failed")));
        }
        let order = |p: WorkerPhase| p as u8;
        if order(phase) < order(cur) || phase == WorkerPhase::FullService {
            self.stats.duplicate_events += 1;
            return Ok(vec![]);
        }
        if phase != cur {
            return Err(Error::InvalidArgument(format!(
                "worker {worker} is in {cur}, not {phase}"
            )));
        }
        let next = phase.next().expect("FullService handled above");
        let mut assisting = None;
        match next {
            WorkerPhase::Assist => assisting = self.pair_assistant(worker),
            WorkerPhase::HotSwap => {
                if let Some(s) = self.load.get(worker).and_then(|w| w.assisting)
                    && let Some(s) = self.load.get_mut(s)
                {
                    s.assisted_by = None;
                }
            }
            _ => {}
        }
        let w = self.load.get_mut(worker).expect("checked");
        w.phase = next;
        w.assisting = assisting;
        Ok(vec![Decision::WorkerPhase {
            worker,
            phase: next,
            assisting,
        }])
    }

    /// Pair `worker` (entering or staying in ASSIST) with the busiest survivor nobody assists yet
    /// (highest queueing delay; ties: lowest id). Returns the partner, `None` when all are taken.
    pub(super) fn pair_assistant(&mut self, worker: WorkerId) -> Option<WorkerId> {
        let mut best: Option<(f64, WorkerId)> = None;
        for s in self.load.in_service().filter(|s| s.assisted_by.is_none()) {
            let q = s.queue_delay_ms();
            if best.is_none_or(|(bq, _)| q > bq) {
                best = Some((q, s.id));
            }
        }
        let (_, s) = best?;
        self.load.get_mut(s).expect("in service").assisted_by = Some(worker);
        Some(s)
    }
}
