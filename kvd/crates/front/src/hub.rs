//! The [`Hub`]: one [`Controller`] behind one mutex, the clock that stamps its events, and
//! what the streaming front needs beside it (the decisions about the requests it drives, the
//! nodes' admin addresses, its counters). `kvd control`'s HTTP routes, its membership watch and
//! the front all share one hub; every critical section is a bounded in-memory computation.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

use kvd_control::{
    Admission, AdmitRequest, Controller, ControllerSnapshot, Decision, Epoch, Event, LoadTable,
    RecoveryPlan, RequestId, RequestRecord, Stats, WorkerId,
};
use kvd_core::Result;
use kvd_core::clock::Clock;
use tokio::sync::watch;

use crate::stats::{Buckets, FrontStats, HANDOFF_BUCKETS_MS};

/// The controller and what the front keeps beside it.
#[derive(Debug)]
pub struct Hub {
    controller: Mutex<Controller>,
    clock: Arc<dyn Clock>,
    /// Added to the clock so time continues past a restored snapshot's timestamps.
    clock_offset_ms: u64,
    plans: Mutex<Plans>,
    plans_tx: watch::Sender<u64>,
    /// node → its admin address, from its registration in etcd.
    nodes: Mutex<BTreeMap<u64, String>>,
    /// Nodes kept out of the controller's pool (P/D's prefill nodes): their admin addresses
    /// are known, but they neither serve a placed request nor hold a checkpoint, so recovery
    /// never lands a decode on them.
    outside: Mutex<std::collections::BTreeSet<u64>>,
    front_stats: Mutex<FrontStats>,
    /// P/D: the hand-offs' times (the prefill's answer to the decode's first token).
    handoff_times: Mutex<Buckets>,
}

/// Decisions about the requests the front drives, until their task takes them.
#[derive(Debug, Default)]
struct Plans {
    watched: HashSet<RequestId>,
    plans: HashMap<RequestId, Decision>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic inside a critical section is a bug; the state it left is still the best we have.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Hub {
    /// A hub over `controller`, stamping events with `clock` + `clock_offset_ms`.
    pub fn new(controller: Controller, clock: Arc<dyn Clock>, clock_offset_ms: u64) -> Arc<Hub> {
        Arc::new(Hub {
            controller: Mutex::new(controller),
            clock,
            clock_offset_ms,
            plans: Mutex::default(),
            plans_tx: watch::channel(0).0,
            nodes: Mutex::default(),
            outside: Mutex::default(),
            front_stats: Mutex::default(),
            handoff_times: Mutex::new(Buckets::new(&HANDOFF_BUCKETS_MS)),
        })
    }

    /// P/D: count one hand-off's time, ms.
    pub fn observe_handoff(&self, ms: u64) {
        lock(&self.handoff_times).observe(ms);
    }

    /// P/D: the hand-offs' times so far (`/metrics`: `kvd_control_front_handoff_seconds`).
    pub fn handoff_times(&self) -> Buckets {
        lock(&self.handoff_times).clone()
    }

    /// Now, on the controller's clock, ms.
    pub fn now_ms(&self) -> u64 {
        self.clock_offset_ms + self.clock.now_ms()
    }

    /// Run `f` on the controller (under its lock: keep it short).
    pub fn with<R>(&self, f: impl FnOnce(&mut Controller) -> R) -> R {
        f(&mut lock(&self.controller))
    }

    /// Apply `events` in order under one lock, now; each one's decisions or error (those about
    /// the front's requests reach them too).
    pub fn apply_all(&self, events: &[Event]) -> Vec<Result<Vec<Decision>>> {
        let now = self.now_ms();
        let mut c = lock(&self.controller);
        let results: Vec<_> = events.iter().map(|e| c.apply(e, now)).collect();
        let noted: Vec<Decision> = results
            .iter()
            .filter_map(|r| r.as_ref().ok())
            .flatten()
            .cloned()
            .collect();
        // published before the controller is let go (see [`Hub::fail`])
        self.note(&noted);
        drop(c);
        results
    }

    /// Apply `event` now; its decisions (those about the front's requests reach them too).
    ///
    /// # Errors
    /// Those of [`Controller::apply`].
    pub fn apply(&self, event: &Event) -> Result<Vec<Decision>> {
        let now = self.now_ms();
        let mut c = lock(&self.controller);
        let d = c.apply(event, now)?;
        // published before the controller is let go (see [`Hub::fail`])
        self.note(&d);
        drop(c);
        Ok(d)
    }

    /// Admit a request now.
    ///
    /// # Errors
    /// Those of [`Controller::admit`].
    pub fn admit(&self, req: AdmitRequest) -> Result<Admission> {
        let now = self.now_ms();
        lock(&self.controller).admit(req, now)
    }

    /// Admit a request another front lost at `lost_epoch` (see
    /// [`Controller::admit_taken_over`]).
    ///
    /// # Errors
    /// Those of [`Controller::admit_taken_over`].
    pub fn admit_taken_over(&self, req: AdmitRequest, lost_epoch: Epoch) -> Result<Admission> {
        let now = self.now_ms();
        lock(&self.controller).admit_taken_over(req, lost_epoch, now)
    }

    /// Fail `workers` now; the plan (its decisions also reach the front's requests).
    ///
    /// # Errors
    /// Those of [`Controller::fail_workers`].
    pub fn fail(&self, workers: &[WorkerId]) -> Result<RecoveryPlan> {
        let now = self.now_ms();
        let mut c = lock(&self.controller);
        let plan = c.fail_workers(workers, now)?;
        if !plan.survivors.is_empty() {
            let seen: Vec<String> = plan
                .survivors
                .iter()
                .map(|s| {
                    format!(
                        "{}: {} serving, q_w {} ms, queued prefill {} ms",
                        s.worker, s.serving, s.queue_delay_ms, s.queued_prefill_ms
                    )
                })
                .collect();
            tracing::info!(target: "kvd::recovery", failed = ?plan.failed_workers,
                restores = plan.restores.len(), survivors = %seen.join("; "),
                "the dispatch placed a failure's requests");
        }
        // the plans are published before the controller is let go: another request of the
        // same worker that fails it too (a no-op now) finds its plan waiting, instead of
        // asking between the failure and the publishing and getting none (lock order:
        // controller, then plans; nothing takes them the other way round)
        self.note(&plan.clone().into_decisions());
        drop(c);
        Ok(plan)
    }

    /// A request's record (live or retained terminal).
    pub fn request(&self, id: RequestId) -> Option<RequestRecord> {
        lock(&self.controller).request(id).cloned()
    }

    /// The controller's counters.
    pub fn stats(&self) -> Stats {
        lock(&self.controller).stats().clone()
    }

    /// The worker table.
    pub fn load(&self) -> LoadTable {
        lock(&self.controller).load().clone()
    }

    /// The controller's snapshot.
    pub fn snapshot(&self) -> ControllerSnapshot {
        lock(&self.controller).snapshot()
    }

    /// Keep the decisions that name requests the front drives, and wake their tasks.
    fn note(&self, decisions: &[Decision]) {
        let mut woke = false;
        {
            let mut p = lock(&self.plans);
            if p.watched.is_empty() {
                return;
            }
            for d in decisions {
                let id = match d {
                    Decision::Restore(r) => r.request_id,
                    Decision::RequestFailed { request_id, .. }
                    | Decision::Checkpoint { request_id, .. } => *request_id,
                    _ => continue,
                };
                if p.watched.contains(&id) {
                    // a restore or a failure supersedes a checkpoint move
                    let keep_old = matches!(d, Decision::Checkpoint { .. })
                        && p.plans
                            .get(&id)
                            .is_some_and(|o| !matches!(o, Decision::Checkpoint { .. }));
                    if !keep_old {
                        p.plans.insert(id, d.clone());
                        woke = true;
                    }
                }
            }
        }
        if woke {
            self.plans_tx.send_modify(|v| *v = v.wrapping_add(1));
        }
    }

    /// The front drives `id`: keep the decisions about it.
    pub fn watch_request(&self, id: RequestId) {
        lock(&self.plans).watched.insert(id);
    }

    /// The front is done with `id`.
    pub fn unwatch_request(&self, id: RequestId) {
        let mut p = lock(&self.plans);
        p.watched.remove(&id);
        p.plans.remove(&id);
    }

    /// The decision waiting for `id`, if any.
    pub fn take_plan(&self, id: RequestId) -> Option<Decision> {
        lock(&self.plans).plans.remove(&id)
    }

    /// A receiver that changes whenever a decision for a watched request arrives.
    pub fn plans_changed(&self) -> watch::Receiver<u64> {
        self.plans_tx.subscribe()
    }

    /// A node registered (or re-registered) with this admin address.
    pub fn node_registered(&self, node: u64, admin_addr: &str) {
        lock(&self.nodes).insert(node, admin_addr.to_string());
    }

    /// A node's registration is gone.
    pub fn node_gone(&self, node: u64) {
        lock(&self.nodes).remove(&node);
    }

    /// Keep `nodes` out of the controller's pool (P/D's prefill nodes): the membership watch
    /// records their admin addresses and nothing else.
    pub fn keep_outside_the_pool(&self, nodes: impl IntoIterator<Item = u64>) {
        lock(&self.outside).extend(nodes);
    }

    /// Whether `node` belongs in the controller's pool (serves and holds checkpoints).
    pub fn in_pool(&self, node: u64) -> bool {
        !lock(&self.outside).contains(&node)
    }

    /// A registered node's admin address.
    pub fn node_admin(&self, node: u64) -> Option<String> {
        lock(&self.nodes).get(&node).cloned()
    }

    /// Update the front's counters.
    pub fn count_front(&self, f: impl FnOnce(&mut FrontStats)) {
        f(&mut lock(&self.front_stats));
    }

    /// The front's counters.
    pub fn front_stats(&self) -> FrontStats {
        lock(&self.front_stats).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvd_control::ControlConfig;
    use kvd_core::clock::ManualClock;

    /// Every request of a failed worker finds its plan right after its own failure call, however
    /// the calls of its siblings interleave (each thread: fail the worker, then take its plan, as
    /// `Front::recover_worker` does when its stream breaks).
    #[test]
    fn each_request_of_a_failed_worker_finds_its_plan_after_its_own_failure_call() {
        for round in 0..50 {
            let hub = Hub::new(
                Controller::new(ControlConfig::default()).unwrap(),
                ManualClock::new(0),
                0,
            );
            for w in 1..=3 {
                hub.apply(&Event::WorkerJoined {
                    worker: w,
                    capacity_bytes: 1 << 30,
                })
                .unwrap();
            }
            let ids: Vec<RequestId> = (1..=8).collect();
            for &id in &ids {
                hub.admit(AdmitRequest {
                    request_id: id,
                    serving: 1,
                    prompt_tokens: 100,
                    max_new_tokens: 10,
                    reserve_bytes: 1 << 20,
                    deadline_ms: None,
                })
                .unwrap();
                hub.watch_request(id);
            }
            let found: Vec<bool> = std::thread::scope(|s| {
                let handles: Vec<_> = ids
                    .iter()
                    .map(|&id| {
                        let hub = &hub;
                        s.spawn(move || {
                            hub.fail(&[1]).unwrap();
                            hub.take_plan(id).is_some()
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            assert!(found.iter().all(|f| *f), "round {round}: {found:?}");
        }
    }
}
