//! One failure event: which requests it interrupts, where each resumes, what it loads and
//! recomputes, and which live requests need a new checkpoint holder.
//!
//! [`Controller::fail_workers`] is the sequence; each step is a function below:
//!
//! 1. [`Controller::newly_failed`]: the named workers that are alive (a replay names none);
//! 2. [`Controller::take_down`]: their rows are cleared, assist pairs released, and a recovering
//!    worker whose assisted survivor died pairs again;
//! 3. [`Controller::sort_affected`]: requests served by a dead worker are interrupted (or,
//!    when cancelling, cancelled); requests whose holder died lose their checkpoint;
//! 4. [`Controller::resume_interrupted`]: the policy dispatches, and each request gets a
//!    [`RestorePlan`] or fails (no survivor, migration budget, deadline);
//! 5. [`Controller::replace_lost_checkpoints`]: survivors whose holder died get a new holder.

use std::collections::BTreeMap;

use super::Controller;
use crate::load::WorkerLoad;
use crate::recovery::{
    Dispatch, Interrupted, RecoveryPlan, RestorePlan, SurvivorEstimate, loadable_prefix,
};
use crate::request::RequestState;
use crate::{Error, Result};
use crate::{MAX_FAILED_PER_EVENT, RequestId, WorkerId};

/// The requests a failure touches, by what happens to them.
#[derive(Debug, Default)]
struct Affected {
    /// Served by a dead worker: they resume elsewhere or fail. Sorted by request id.
    interrupted: Vec<Interrupted>,
    /// Alive, but their holder died: they need a new holder.
    orphaned: Vec<RequestId>,
    /// Cancelling on a dead worker: the cancel is complete.
    cancelled: Vec<RequestId>,
}

impl Controller {
    /// Workers died (simultaneous failures in one call). Interrupted requests are dispatched,
    /// rebalanced and planned; requests whose holder died get a new holder.
    ///
    /// Already-failed workers are ignored (a replay changes nothing).
    ///
    /// # Errors
    /// [`Error::NotFound`] for an unknown worker; [`Error::InvalidArgument`] for more than
    /// [`MAX_FAILED_PER_EVENT`] workers. Nothing changes on error.
    pub fn fail_workers(&mut self, workers: &[WorkerId], now_ms: u64) -> Result<RecoveryPlan> {
        let failed = self.newly_failed(workers)?;
        let mut plan = RecoveryPlan {
            failed_workers: failed.clone(),
            ..RecoveryPlan::default()
        };
        if failed.is_empty() {
            self.stats.duplicate_events += 1;
            return Ok(plan);
        }
        self.stats.worker_failures += failed.len() as u64;
        self.take_down(&failed, &mut plan);
        let affected = self.sort_affected(&failed);
        for id in affected.cancelled {
            self.retire(id, RequestState::Cancelled, None);
            plan.cancelled_requests.push(id);
        }
        self.resume_interrupted(&affected.interrupted, now_ms, &mut plan);
        // Cheap, so on in release: every interrupted request got exactly one outcome.
        assert_eq!(
            plan.restores.len() + plan.failed_requests.len(),
            affected.interrupted.len(),
            "every interrupted request resumes or fails, once"
        );
        self.replace_lost_checkpoints(&affected.orphaned, &mut plan);
        self.debug_check();
        Ok(plan)
    }

    /// The workers of `workers` that are alive, sorted and deduplicated.
    fn newly_failed(&self, workers: &[WorkerId]) -> Result<Vec<WorkerId>> {
        if workers.len() > MAX_FAILED_PER_EVENT {
            return Err(Error::InvalidArgument(format!(
                "{} workers in one failure event",
                workers.len()
            )));
        }
        let mut failed: Vec<WorkerId> = Vec::with_capacity(workers.len());
        for &w in workers {
            let row = self
                .load
                .get(w)
                .ok_or_else(|| Error::NotFound(format!("worker {w}")))?;
            if row.alive() {
                failed.push(w);
            }
        }
        failed.sort_unstable();
        failed.dedup();
        Ok(failed)
    }

    /// The failed rows go: assist pairs are released, checkpoints and requests forgotten. A
    /// recovering worker whose assisted survivor died pairs again with the busiest survivor
    /// left unassisted (recorded in `plan.assist_pairs`).
    fn take_down(&mut self, failed: &[WorkerId], plan: &mut RecoveryPlan) {
        let is_failed = |w: WorkerId| failed.binary_search(&w).is_ok();
        let mut lost_partner: Vec<WorkerId> = Vec::new();
        for &f in failed {
            let row = self.load.get(f).expect("a failed worker is known");
            let (assisting, assisted_by) = (row.assisting, row.assisted_by);
            if let Some(s) = assisting.and_then(|s| self.load.get_mut(s)) {
                s.assisted_by = None;
            }
            if let Some(r) = assisted_by {
                if let Some(rw) = self.load.get_mut(r) {
                    rw.assisting = None;
                }
                if !is_failed(r) {
                    lost_partner.push(r);
                }
            }
            let row = self.load.get_mut(f).expect("a failed worker is known");
            row.clear_on_failure();
            assert!(
                row.reserved_bytes == 0 && row.held_checkpoints == 0 && !row.alive(),
                "a failed worker holds nothing"
            );
        }
        lost_partner.sort_unstable();
        for r in lost_partner {
            let partner = self.pair_assistant(r);
            self.load.get_mut(r).expect("alive").assisting = partner;
            plan.assist_pairs.push((r, partner));
        }
    }

    /// Which live requests the failure interrupts, orphans (holder died) or cancels. A request
    /// whose holder died loses its checkpoint here (the reservation went with the holder's row).
    fn sort_affected(&mut self, failed: &[WorkerId]) -> Affected {
        let is_failed = |w: WorkerId| failed.binary_search(&w).is_ok();
        let mut out = Affected::default();
        for r in self.requests.values_mut() {
            let holder_died = r.holder.is_some_and(is_failed);
            if holder_died {
                r.holder = None;
                r.reserved_bytes = 0;
                r.checkpointed_tokens = 0;
                r.checkpoint_bytes = 0;
            }
            if is_failed(r.serving) {
                if r.state == RequestState::Cancelling {
                    out.cancelled.push(r.id);
                } else {
                    out.interrupted.push(Interrupted {
                        request_id: r.id,
                        live_holder: r.holder,
                        checkpointed_tokens: r.checkpointed_tokens,
                        history_tokens: r.history_tokens(),
                        bytes_per_token: r.bytes_per_token(),
                    });
                }
            } else if holder_died {
                out.orphaned.push(r.id);
            }
        }
        out
    }

    /// The policy dispatches the interrupted requests; each one gets a restore plan or fails.
    fn resume_interrupted(
        &mut self,
        interrupted: &[Interrupted],
        now_ms: u64,
        plan: &mut RecoveryPlan,
    ) {
        self.set_queued_prefill(true);
        if !interrupted.is_empty() {
            plan.survivors = self
                .load
                .in_service()
                .map(|w| SurvivorEstimate {
                    worker: w.id,
                    serving: w.serving_requests,
                    queue_delay_ms: w.queue_delay_ms().round() as u64,
                    queued_prefill_ms: w.queued_prefill_ms.round() as u64,
                })
                .collect();
        }
        let dispatched = self.policy.dispatch(&self.load, interrupted);
        self.set_queued_prefill(false);
        plan.rebalance_moves = dispatched.rebalance_moves;
        self.stats.rebalance_moves += u64::from(dispatched.rebalance_moves);
        // Both lists are in request-id order; a request the policy left out has no survivor.
        let mut next = dispatched.dispatches.iter().peekable();
        for it in interrupted {
            match next.next_if(|d| d.request_id == it.request_id) {
                Some(d) => self.resume_one(it, *d, now_ms, plan),
                None => self.fail_request(
                    it.request_id,
                    "no surviving worker to resume on".into(),
                    plan,
                ),
            }
        }
        assert!(
            next.next().is_none(),
            "policy {:?} dispatched unknown requests",
            self.policy.kind()
        );
    }

    /// Each worker's queued prefill for a dispatch ([`WorkerLoad::queued_prefill_ms`]), or 0.
    /// The front tells a prefill started at its first token, so `ADMITTED` there is a request
    /// sent to the engine and not yet prefilled: the survivor's queue, which the LUMEN runs
    /// traced restores waiting 1-2 s behind (docs/PERFORMANCE.md).
    fn set_queued_prefill(&mut self, on: bool) {
        let mut tokens: BTreeMap<WorkerId, u64> = BTreeMap::new();
        if on {
            for r in self.requests.values() {
                if r.state.awaits_start() {
                    *tokens.entry(r.serving).or_default() += u64::from(r.history_tokens());
                }
            }
        }
        let rate = f64::from(self.config.prefill_tokens_per_ms.max(1));
        let ids: Vec<WorkerId> = self.load.iter().map(|w| w.id).collect();
        for id in ids {
            let row = self.load.get_mut(id).expect("listed");
            row.queued_prefill_ms = tokens.get(&id).map_or(0.0, |&t| t as f64 / rate);
        }
    }

    /// Resume one interrupted request on `d.target`, unless its budget or deadline forbids it.
    fn resume_one(&mut self, it: &Interrupted, d: Dispatch, now_ms: u64, plan: &mut RecoveryPlan) {
        assert!(
            self.load.get(d.target).is_some_and(WorkerLoad::in_service),
            "policy chose a dead target"
        );
        let rec = &self.requests[&it.request_id];
        if rec.migrations_left == 0 {
            self.stats.budget_failures += 1;
            let reason = format!(
                "migration budget exhausted after {} migrations",
                rec.migrations
            );
            self.fail_request(it.request_id, reason, plan);
            return;
        }
        let history = rec.history_tokens();
        let load_tokens = match d.kv_source {
            Some(_) => loadable_prefix(
                it.checkpointed_tokens,
                history,
                self.config.tokens_per_block,
            ),
            None => 0,
        };
        if let Some(reason) = self.misses_deadline(it.request_id, d.target, load_tokens, now_ms) {
            self.stats.deadline_failures += 1;
            self.fail_request(it.request_id, reason, plan);
            return;
        }
        self.migrate(it.request_id, d.target);
        let rec = &self.requests[&it.request_id];
        self.stats.migrations += 1;
        if load_tokens > 0 {
            self.stats.kv_reuse_restores += 1;
        } else {
            self.stats.recomputations += 1;
        }
        plan.restores.push(RestorePlan {
            request_id: rec.id,
            epoch: rec.epoch,
            target: d.target,
            kv_source: if load_tokens > 0 { d.kv_source } else { None },
            load_tokens,
            prefill_tokens: history - load_tokens,
            history_tokens: history,
            resume_seq: rec.resume_seq(),
            new_holder: rec.holder,
        });
    }

    /// Why resuming `id` on `target` (loading `load_tokens`, prefilling the rest) cannot meet
    /// its deadline: `now + q_target + load + prefill > deadline`, each term named. `None` when
    /// it can, or has no deadline.
    fn misses_deadline(
        &self,
        id: RequestId,
        target: WorkerId,
        load_tokens: u32,
        now_ms: u64,
    ) -> Option<String> {
        let rec = &self.requests[&id];
        let deadline = rec.deadline_ms?;
        let queue_ms = self
            .load
            .get(target)
            .map_or(0.0, WorkerLoad::queue_delay_ms);
        let prefill_tokens = rec.history_tokens() - load_tokens;
        let load_ms =
            (u64::from(load_tokens) * rec.bytes_per_token()) / self.config.host_to_gpu_bytes_per_ms;
        let prefill_ms = u64::from(prefill_tokens) / u64::from(self.config.prefill_tokens_per_ms);
        let ready_ms = now_ms + queue_ms as u64 + load_ms + prefill_ms;
        (ready_ms > deadline).then(|| {
            Error::Deadline(format!(
                "request {id}: resuming on worker {target} is ready at {ready_ms} ms (queue {queue_ms:.0} ms, load {load_ms} ms, \
                 prefill {prefill_ms} ms), after its deadline {deadline} ms"
            ))
            .to_string()
        })
    }

    /// The CAS of a migration: a new incarnation of `id` served by `target`. When `target` was
    /// its holder, the local restore consumes the checkpoint and the next one goes elsewhere.
    fn migrate(&mut self, id: RequestId, target: WorkerId) {
        let rec = self
            .requests
            .get_mut(&id)
            .expect("interrupted requests are live");
        debug_assert!(rec.migrations_left > 0, "the budget was checked");
        rec.epoch += 1;
        rec.state = RequestState::Migrating;
        Self::reattribute_holder(&mut self.load, rec, target);
        rec.serving = target;
        rec.migrations_left -= 1;
        rec.migrations += 1;
        self.load
            .get_mut(target)
            .expect("in service")
            .serving_requests += 1;
        if rec.holder == Some(target) {
            Self::release_holder(&mut self.load, rec);
            Self::place(&*self.policy, &mut self.load, rec, &mut self.stats, false);
        }
    }

    /// Live requests whose holder died start a checkpoint at a new holder (or run without).
    fn replace_lost_checkpoints(&mut self, orphaned: &[RequestId], plan: &mut RecoveryPlan) {
        for &id in orphaned {
            let rec = self.requests.get_mut(&id).expect("live");
            Self::place(&*self.policy, &mut self.load, rec, &mut self.stats, false);
            self.stats.checkpoint_moves += 1;
            plan.checkpoint_moves.push((id, rec.epoch, rec.holder));
        }
    }

    /// Retire `id` as failed and record it in the plan.
    fn fail_request(&mut self, id: RequestId, reason: String, plan: &mut RecoveryPlan) {
        let epoch = self.requests[&id].epoch;
        self.retire(id, RequestState::Failed, Some(reason.clone()));
        plan.failed_requests.push((id, epoch, reason));
    }
}
