//! The controller: owns the load table and the placement table, applies events, returns
//! decisions.
//!
//! Every event method takes `now_ms` (the caller's clock, see the module docs of
//! [`crate::control`]) and either changes state and returns the decisions that follow, or fails
//! and changes nothing. The same calls are also reachable as data: [`Event`] in,
//! `Vec<`[`Decision`]`>` out, through [`Controller::apply`] — the form the HTTP service, a
//! simulator's event queue and the C ABI use.
//!
//! Events are idempotent: replaying one changes nothing (counted in
//! [`Stats::duplicate_events`]); an event naming an older epoch than the request's is dropped
//! with [`Error::StaleEpoch`] (counted in [`Stats::stale_events`]).

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

use super::load::{LoadTable, WorkerLoad, WorkerPhase};
use super::placement::ScoreParams;
use super::policy::{Policy, PolicyKind};
use super::recovery::{Interrupted, RecoveryPlan, RestorePlan, loadable_prefix};
use super::request::{RequestRecord, RequestState};
use super::snapshot::{ControllerSnapshot, SNAPSHOT_FORMAT_VERSION};
use super::{
    Epoch, MAX_FAILED_PER_EVENT, MAX_IN_FLIGHT, MAX_QUEUE_DELAY_WINDOW, MAX_TERMINAL_RETAINED,
    MAX_WORKERS, RequestId, WorkerId,
};
use crate::{Error, Result};

/// The controller's knobs. Every limit has a hard cap (see the constants in [`crate::control`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ControlConfig {
    /// Which policy places checkpoints and dispatches recovery.
    pub policy: PolicyKind,
    /// λ, the weight of the restore delay in the placement score (default 1).
    pub lambda: f64,
    /// Host-to-GPU bandwidth used for restore-delay estimates, bytes per ms (default 25 GB/s).
    pub host_to_gpu_bytes_per_ms: u64,
    /// Prefill throughput used for deadline estimates, tokens per ms (default 10).
    pub prefill_tokens_per_ms: u32,
    /// KV block size in tokens: a restore loads whole blocks only (default 16).
    pub tokens_per_block: u32,
    /// Workers at most (≤ [`MAX_WORKERS`]).
    pub max_workers: u32,
    /// In-flight requests at most (≤ [`MAX_IN_FLIGHT`]); admission beyond is `Overloaded`.
    pub max_in_flight: u32,
    /// Terminal request records kept for idempotent replies (≤ [`MAX_TERMINAL_RETAINED`]).
    pub max_terminal_retained: u32,
    /// Queueing-delay samples kept per worker (≤ [`MAX_QUEUE_DELAY_WINDOW`]).
    pub queue_delay_window: u32,
    /// Migrations allowed per request; one more interruption fails it.
    pub migration_budget: u32,
}

impl Default for ControlConfig {
    fn default() -> Self {
        ControlConfig {
            policy: PolicyKind::Lumen,
            lambda: 1.0,
            host_to_gpu_bytes_per_ms: 25_000_000,
            prefill_tokens_per_ms: 10,
            tokens_per_block: 16,
            max_workers: 1024,
            max_in_flight: 1 << 20,
            max_terminal_retained: 1 << 16,
            queue_delay_window: 64,
            migration_budget: 3,
        }
    }
}

impl ControlConfig {
    /// The placement score's parameters.
    pub fn score_params(&self) -> ScoreParams {
        ScoreParams {
            lambda: self.lambda,
            host_to_gpu_bytes_per_ms: self.host_to_gpu_bytes_per_ms,
        }
    }

    /// Check every field against its bound.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the first bad field.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(Error::InvalidArgument(format!("control config: {m}")));
        if !self.lambda.is_finite() || self.lambda < 0.0 {
            return bad("lambda must be finite and >= 0");
        }
        if self.host_to_gpu_bytes_per_ms == 0
            || self.prefill_tokens_per_ms == 0
            || self.tokens_per_block == 0
        {
            return bad("bandwidth, prefill rate and tokens_per_block must be > 0");
        }
        if self.max_workers == 0 || self.max_workers > MAX_WORKERS {
            return bad("max_workers must be in 1..=4096");
        }
        if self.max_in_flight == 0 || self.max_in_flight > MAX_IN_FLIGHT {
            return bad("max_in_flight must be in 1..=4194304");
        }
        if self.max_terminal_retained > MAX_TERMINAL_RETAINED {
            return bad("max_terminal_retained must be <= 1048576");
        }
        if self.queue_delay_window == 0 || self.queue_delay_window > MAX_QUEUE_DELAY_WINDOW {
            return bad("queue_delay_window must be in 1..=4096");
        }
        Ok(())
    }
}

/// A request as a gateway admits it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdmitRequest {
    /// Unique id.
    pub request_id: RequestId,
    /// The worker the router chose to serve it (must be in service).
    pub serving: WorkerId,
    /// Prompt length.
    pub prompt_tokens: u32,
    /// Generation limit.
    pub max_new_tokens: u32,
    /// Conservative checkpoint footprint (max context × bytes per token); 0 = no checkpoint.
    pub reserve_bytes: u64,
    /// Absolute deadline, ms on the caller's clock, if any.
    pub deadline_ms: Option<u64>,
}

/// The answer to an admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Admission {
    /// The request.
    pub request_id: RequestId,
    /// Its epoch (1 for a fresh admission); name it in every later event.
    pub epoch: Epoch,
    /// Where to stream its checkpoint (`None`: it runs without one).
    pub holder: Option<WorkerId>,
    /// Bytes reserved on the holder.
    pub reserved_bytes: u64,
}

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

/// Counters, all monotonic.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// Requests admitted.
    pub admitted: u64,
    /// Admissions that wanted a checkpoint and found no holder (ran without one).
    pub no_holder: u64,
    /// Events dropped for naming an older epoch.
    pub stale_events: u64,
    /// Events that changed nothing (replays).
    pub duplicate_events: u64,
    /// Requests completed.
    pub completed: u64,
    /// Requests cancelled.
    pub cancelled: u64,
    /// Requests failed (any reason).
    pub failed: u64,
    /// Of those, failed because a migration could not meet the deadline.
    pub deadline_failures: u64,
    /// Of those, failed because the migration budget was spent.
    pub budget_failures: u64,
    /// Worker failures processed.
    pub worker_failures: u64,
    /// Restores planned.
    pub migrations: u64,
    /// Restores that load a checkpointed prefix.
    pub kv_reuse_restores: u64,
    /// Restores that recompute everything.
    pub recomputations: u64,
    /// Rebalancing moves.
    pub rebalance_moves: u64,
    /// Checkpoints re-placed because their holder died or began serving the request.
    pub checkpoint_moves: u64,
}

/// The control shim. Not internally synchronized: the service wraps it in a mutex, a simulator
/// owns it.
#[derive(Debug)]
pub struct Controller {
    config: ControlConfig,
    policy: Box<dyn Policy>,
    load: LoadTable,
    requests: BTreeMap<RequestId, RequestRecord>,
    terminal: BTreeMap<RequestId, RequestRecord>,
    terminal_order: VecDeque<RequestId>,
    stats: Stats,
}

/// A live request or the terminal record an idempotent reply is made from.
enum Found {
    Live,
    Terminal,
}

impl Controller {
    /// A controller with the configured policy and no workers.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the configuration is out of bounds.
    pub fn new(config: ControlConfig) -> Result<Self> {
        let policy = config.policy.build(config.score_params());
        Self::with_policy(config, policy)
    }

    /// A controller with a custom policy (`config.policy` is ignored; snapshots record the
    /// policy's [`Policy::kind`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the configuration is out of bounds.
    pub fn with_policy(mut config: ControlConfig, policy: Box<dyn Policy>) -> Result<Self> {
        config.validate()?;
        config.policy = policy.kind();
        Ok(Controller {
            config,
            policy,
            load: LoadTable::new(),
            requests: BTreeMap::new(),
            terminal: BTreeMap::new(),
            terminal_order: VecDeque::new(),
            stats: Stats::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ControlConfig {
        &self.config
    }

    /// The load table.
    pub fn load(&self) -> &LoadTable {
        &self.load
    }

    /// The counters.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// A request's record, live or (recently) terminal.
    pub fn request(&self, id: RequestId) -> Option<&RequestRecord> {
        self.requests.get(&id).or_else(|| self.terminal.get(&id))
    }

    /// Live (non-terminal) requests, by id.
    pub fn live_requests(&self) -> impl Iterator<Item = &RequestRecord> {
        self.requests.values()
    }

    /// Number of live requests.
    pub fn in_flight(&self) -> usize {
        self.requests.len()
    }

    // ---------------------------------------------------------------- workers

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

    /// Workers died (simultaneous failures in one call). Interrupted requests are dispatched,
    /// rebalanced and planned; requests whose holder died get a new holder.
    ///
    /// Already-failed workers are ignored (a replay changes nothing).
    ///
    /// # Errors
    /// [`Error::NotFound`] for an unknown worker; [`Error::InvalidArgument`] for more than
    /// [`MAX_FAILED_PER_EVENT`] workers. Nothing changes on error.
    pub fn fail_workers(&mut self, workers: &[WorkerId], now_ms: u64) -> Result<RecoveryPlan> {
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
            if row.alive() && !failed.contains(&w) {
                failed.push(w);
            }
        }
        failed.sort_unstable();
        let mut plan = RecoveryPlan {
            failed_workers: failed.clone(),
            ..RecoveryPlan::default()
        };
        if failed.is_empty() {
            self.stats.duplicate_events += 1;
            return Ok(plan);
        }
        self.stats.worker_failures += failed.len() as u64;
        let is_failed = |w: WorkerId| failed.binary_search(&w).is_ok();

        // The workers go: unpair assistants, forget their checkpoints and requests.
        let mut lost_partner: Vec<WorkerId> = Vec::new();
        for &f in &failed {
            let row = self.load.get(f).expect("checked above").clone();
            if let Some(s) = row.assisting
                && let Some(s) = self.load.get_mut(s)
            {
                s.assisted_by = None;
            }
            if let Some(r) = row.assisted_by
                && let Some(rw) = self.load.get_mut(r)
            {
                rw.assisting = None;
                if !is_failed(r) {
                    lost_partner.push(r);
                }
            }
            self.load
                .get_mut(f)
                .expect("checked above")
                .clear_on_failure();
        }
        // A recovering worker whose assisted survivor died pairs again, with the busiest
        // survivor left unassisted.
        lost_partner.sort_unstable();
        for r in lost_partner {
            let partner = self.pair_assistant(r);
            self.load.get_mut(r).expect("alive").assisting = partner;
            plan.assist_pairs.push((r, partner));
        }

        // Who is interrupted, who lost a checkpoint, who was cancelling.
        let mut interrupted: Vec<Interrupted> = Vec::new();
        let mut orphaned: Vec<RequestId> = Vec::new();
        let mut cancelled: Vec<RequestId> = Vec::new();
        for r in self.requests.values_mut() {
            let holder_died = r.holder.is_some_and(is_failed);
            if holder_died {
                // Its reservation went with the holder's row.
                r.holder = None;
                r.reserved_bytes = 0;
                r.checkpointed_tokens = 0;
                r.checkpoint_bytes = 0;
            }
            if is_failed(r.serving) {
                if r.state == RequestState::Cancelling {
                    cancelled.push(r.id);
                } else {
                    interrupted.push(Interrupted {
                        request_id: r.id,
                        live_holder: r.holder,
                        checkpointed_tokens: if r.holder.is_some() {
                            r.checkpointed_tokens
                        } else {
                            0
                        },
                    });
                }
            } else if holder_died {
                orphaned.push(r.id);
            }
        }
        for id in cancelled {
            self.retire(id, RequestState::Cancelled, None);
            plan.cancelled_requests.push(id);
        }

        // Dispatch (policy), then per-request plans.
        let dispatched = self.policy.dispatch(&self.load, &interrupted);
        plan.rebalance_moves = dispatched.rebalance_moves;
        self.stats.rebalance_moves += dispatched.rebalance_moves as u64;
        let mut next = 0usize;
        for it in &interrupted {
            let d = dispatched
                .dispatches
                .get(next)
                .filter(|d| d.request_id == it.request_id)
                .copied();
            if d.is_some() {
                next += 1;
            }
            let rec = self
                .requests
                .get(&it.request_id)
                .expect("interrupted requests are live");
            let epoch = rec.epoch;
            let Some(d) = d else {
                self.fail_request(
                    it.request_id,
                    "no surviving worker to resume on".into(),
                    &mut plan,
                );
                continue;
            };
            assert!(
                self.load.get(d.target).is_some_and(WorkerLoad::in_service),
                "policy chose a dead target"
            );
            if rec.migrations_left == 0 {
                self.stats.budget_failures += 1;
                let reason = format!(
                    "migration budget exhausted after {} migrations",
                    rec.migrations
                );
                self.fail_request(it.request_id, reason, &mut plan);
                continue;
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
            let prefill_tokens = history - load_tokens;
            let target_row = self.load.get(d.target).expect("asserted above");
            let load_ms =
                (load_tokens as u64 * rec.bytes_per_token()) / self.config.host_to_gpu_bytes_per_ms;
            let prefill_ms = prefill_tokens as u64 / self.config.prefill_tokens_per_ms as u64;
            let ready_ms = now_ms + target_row.queue_delay_ms() as u64 + load_ms + prefill_ms;
            if let Some(deadline) = rec.deadline_ms
                && ready_ms > deadline
            {
                self.stats.deadline_failures += 1;
                let reason = Error::Deadline(format!(
                    "request {}: resuming on worker {} is ready at {ready_ms} ms (queue {:.0} ms, load {load_ms} ms, \
                     prefill {prefill_ms} ms), after its deadline {deadline} ms",
                    it.request_id,
                    d.target,
                    target_row.queue_delay_ms()
                ))
                .to_string();
                self.fail_request(it.request_id, reason, &mut plan);
                continue;
            }
            let _ = epoch;
            // The CAS: a new incarnation on the target.
            let rec = self.requests.get_mut(&it.request_id).expect("live");
            rec.epoch += 1;
            rec.state = RequestState::Migrating;
            rec.serving = d.target;
            rec.migrations_left -= 1;
            rec.migrations += 1;
            self.load
                .get_mut(d.target)
                .expect("in service")
                .serving_requests += 1;
            if rec.holder == Some(d.target) {
                // The checkpoint is consumed by the local restore; the next one goes elsewhere.
                Self::release_holder(&mut self.load, rec);
                Self::place(&*self.policy, &mut self.load, rec, &mut self.stats, false);
            }
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
                prefill_tokens,
                history_tokens: history,
                resume_seq: rec.resume_seq(),
                new_holder: rec.holder,
            });
        }
        debug_assert_eq!(
            next,
            dispatched.dispatches.len(),
            "policy dispatched unknown requests"
        );

        // Live requests whose holder died start a checkpoint elsewhere.
        for id in orphaned {
            let rec = self.requests.get_mut(&id).expect("live");
            Self::place(&*self.policy, &mut self.load, rec, &mut self.stats, false);
            self.stats.checkpoint_moves += 1;
            plan.checkpoint_moves.push((id, rec.epoch, rec.holder));
        }
        self.debug_check();
        Ok(plan)
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
    fn pair_assistant(&mut self, worker: WorkerId) -> Option<WorkerId> {
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

    // ---------------------------------------------------------------- requests

    /// Admit a request arriving at `now_ms` on `req.serving` and place its checkpoint.
    ///
    /// Replaying the same admission returns the same answer and changes nothing.
    ///
    /// # Errors
    /// [`Error::Unavailable`] when the serving worker is not in service; [`Error::NotFound`] for
    /// an unknown worker; [`Error::Overloaded`] beyond `max_in_flight`; [`Error::AlreadyExists`]
    /// when the id is taken by another request.
    pub fn admit(&mut self, req: AdmitRequest, now_ms: u64) -> Result<Admission> {
        if let Some(rec) = self.request(req.request_id) {
            let same = rec.prompt_tokens == req.prompt_tokens
                && rec.max_new_tokens == req.max_new_tokens
                && rec.reserve_bytes == req.reserve_bytes
                && rec.epoch == 1
                && rec.migrations == 0;
            if !same {
                return Err(Error::AlreadyExists(format!("request {}", req.request_id)));
            }
            let adm = Admission {
                request_id: rec.id,
                epoch: rec.epoch,
                holder: rec.holder,
                reserved_bytes: rec.reserved_bytes,
            };
            self.stats.duplicate_events += 1;
            return Ok(adm);
        }
        let w = self
            .load
            .get(req.serving)
            .ok_or_else(|| Error::NotFound(format!("worker {}", req.serving)))?;
        if !w.in_service() {
            return Err(Error::Unavailable(format!(
                "worker {} is {}",
                req.serving, w.phase
            )));
        }
        if self.requests.len() >= self.config.max_in_flight as usize {
            return Err(Error::Overloaded {
                what: format!("{} requests in flight", self.requests.len()),
                retry_after_ms: 10,
            });
        }
        let mut rec = RequestRecord {
            id: req.request_id,
            state: RequestState::Admitted,
            epoch: 1,
            serving: req.serving,
            holder: None,
            reserved_bytes: 0,
            reserve_bytes: req.reserve_bytes,
            checkpointed_tokens: 0,
            checkpoint_bytes: 0,
            prompt_tokens: req.prompt_tokens,
            max_new_tokens: req.max_new_tokens,
            generated_tokens: 0,
            acked_seq: None,
            arrival_ms: now_ms,
            deadline_ms: req.deadline_ms,
            migrations_left: self.config.migration_budget,
            migrations: 0,
            failure: None,
        };
        Self::place(
            &*self.policy,
            &mut self.load,
            &mut rec,
            &mut self.stats,
            true,
        );
        self.load
            .get_mut(req.serving)
            .expect("checked")
            .serving_requests += 1;
        self.stats.admitted += 1;
        let adm = Admission {
            request_id: rec.id,
            epoch: 1,
            holder: rec.holder,
            reserved_bytes: rec.reserved_bytes,
        };
        self.requests.insert(rec.id, rec);
        Ok(adm)
    }

    /// Prefill started. From `ADMITTED` this records a queueing-delay sample
    /// (`now − arrival`) on the serving worker.
    ///
    /// # Errors
    /// As [`Controller::checked`]: unknown request, stale or future epoch, cancelled request.
    pub fn prefill_started(
        &mut self,
        id: RequestId,
        epoch: Epoch,
        now_ms: u64,
    ) -> Result<Vec<Decision>> {
        let window = self.config.queue_delay_window;
        let Some(rec) = self.advance(id, epoch, RequestState::Prefilling)? else {
            return Ok(vec![]);
        };
        if rec.0 == RequestState::Admitted {
            let (serving, arrival) = (rec.1, rec.2);
            if let Some(w) = self.load.get_mut(serving) {
                w.record_delay(now_ms.saturating_sub(arrival), window);
            }
        }
        Ok(vec![])
    }

    /// KV hand-off to decode worker `to` started; `to` serves the request from now on. When `to`
    /// was its holder, the checkpoint moves elsewhere ([`Decision::Checkpoint`]).
    ///
    /// # Errors
    /// As [`Controller::checked`]; [`Error::Unavailable`] when `to` is not in service.
    pub fn transfer_started(
        &mut self,
        id: RequestId,
        epoch: Epoch,
        to: WorkerId,
        _now_ms: u64,
    ) -> Result<Vec<Decision>> {
        if !self.load.get(to).is_some_and(WorkerLoad::in_service) {
            // Validate the request first so stale events are still counted as stale.
            self.checked(id, epoch)?;
            return Err(Error::Unavailable(format!("worker {to} is not in service")));
        }
        let Some(_) = self.advance(id, epoch, RequestState::Transferring)? else {
            return Ok(vec![]);
        };
        let rec = self.requests.get_mut(&id).expect("advanced");
        let mut out = vec![];
        if rec.serving != to {
            if let Some(w) = self.load.get_mut(rec.serving) {
                w.serving_requests = w.serving_requests.saturating_sub(1);
            }
            rec.serving = to;
            self.load.get_mut(to).expect("in service").serving_requests += 1;
            if rec.holder == Some(to) {
                Self::release_holder(&mut self.load, rec);
                Self::place(&*self.policy, &mut self.load, rec, &mut self.stats, false);
                self.stats.checkpoint_moves += 1;
                out.push(Decision::Checkpoint {
                    request_id: id,
                    epoch,
                    holder: rec.holder,
                });
            }
        }
        self.debug_check();
        Ok(out)
    }

    /// Decoding started.
    ///
    /// # Errors
    /// As [`Controller::checked`].
    pub fn decoding_started(
        &mut self,
        id: RequestId,
        epoch: Epoch,
        _now_ms: u64,
    ) -> Result<Vec<Decision>> {
        self.advance(id, epoch, RequestState::Decoding)?;
        Ok(vec![])
    }

    /// The engine committed `generated_tokens` generated tokens in all (monotonic; a smaller
    /// number is a replay).
    ///
    /// # Errors
    /// As [`Controller::checked`]; [`Error::InvalidArgument`] beyond `max_new_tokens`.
    pub fn tokens_committed(
        &mut self,
        id: RequestId,
        epoch: Epoch,
        generated_tokens: u32,
        _now_ms: u64,
    ) -> Result<Vec<Decision>> {
        let Found::Live = self.checked(id, epoch)? else {
            return Ok(vec![]);
        };
        let rec = self.requests.get_mut(&id).expect("live");
        if generated_tokens > rec.max_new_tokens {
            return Err(Error::InvalidArgument(format!(
                "request {id}: {generated_tokens} tokens committed, limit {}",
                rec.max_new_tokens
            )));
        }
        if generated_tokens <= rec.generated_tokens || !rec.state.is_running() {
            self.stats.duplicate_events += 1;
        } else {
            rec.generated_tokens = generated_tokens;
        }
        Ok(vec![])
    }

    /// The holder published a verified checkpoint of `tokens` tokens in `bytes` bytes
    /// (monotonic).
    ///
    /// # Errors
    /// As [`Controller::checked`]; [`Error::InvalidArgument`] without a holder, or beyond the
    /// history or the reservation.
    pub fn checkpoint_stored(
        &mut self,
        id: RequestId,
        epoch: Epoch,
        tokens: u32,
        bytes: u64,
        _now_ms: u64,
    ) -> Result<Vec<Decision>> {
        let Found::Live = self.checked(id, epoch)? else {
            return Ok(vec![]);
        };
        let rec = self.requests.get_mut(&id).expect("live");
        if rec.holder.is_none() {
            return Err(Error::InvalidArgument(format!(
                "request {id} has no checkpoint holder"
            )));
        }
        if tokens > rec.history_tokens() || bytes > rec.reserved_bytes {
            return Err(Error::InvalidArgument(format!(
                "request {id}: checkpoint of {tokens} tokens / {bytes} bytes exceeds history {} / reservation {}",
                rec.history_tokens(),
                rec.reserved_bytes
            )));
        }
        if tokens <= rec.checkpointed_tokens {
            self.stats.duplicate_events += 1;
        } else {
            rec.checkpointed_tokens = tokens;
            rec.checkpoint_bytes = bytes;
        }
        Ok(vec![])
    }

    /// The gateway acknowledged stream frame `sequence_no` (monotonic).
    ///
    /// # Errors
    /// As [`Controller::checked`].
    pub fn frame_acked(
        &mut self,
        id: RequestId,
        epoch: Epoch,
        sequence_no: u64,
        _now_ms: u64,
    ) -> Result<Vec<Decision>> {
        let Found::Live = self.checked(id, epoch)? else {
            return Ok(vec![]);
        };
        let rec = self.requests.get_mut(&id).expect("live");
        if rec.acked_seq.is_some_and(|a| a >= sequence_no) {
            self.stats.duplicate_events += 1;
        } else {
            rec.acked_seq = Some(sequence_no);
        }
        Ok(vec![])
    }

    /// The request finished: `COMPLETED`, its reservation released.
    ///
    /// # Errors
    /// As [`Controller::checked`]; [`Error::InvalidArgument`] while cancelling.
    pub fn finished(&mut self, id: RequestId, epoch: Epoch, _now_ms: u64) -> Result<Vec<Decision>> {
        let Found::Live = self.checked(id, epoch)? else {
            return Ok(vec![]);
        };
        if !self.requests[&id].state.is_running() {
            return Err(Error::InvalidArgument(format!(
                "request {id} is {}",
                self.requests[&id].state
            )));
        }
        self.retire(id, RequestState::Completed, None);
        Ok(vec![])
    }

    /// The client cancels: `CANCELLING` under a new epoch (so every late event of the running
    /// incarnation is dropped), and a [`Decision::Cancel`] for the worker. A request that is
    /// cancelling or terminal is left alone.
    ///
    /// # Errors
    /// [`Error::NotFound`] for an unknown request.
    pub fn cancel(&mut self, id: RequestId, _now_ms: u64) -> Result<Vec<Decision>> {
        if self.terminal.contains_key(&id) {
            self.stats.duplicate_events += 1;
            return Ok(vec![]);
        }
        let rec = self
            .requests
            .get_mut(&id)
            .ok_or_else(|| Error::NotFound(format!("request {id}")))?;
        if rec.state == RequestState::Cancelling {
            self.stats.duplicate_events += 1;
            return Ok(vec![]);
        }
        rec.epoch += 1;
        rec.state = RequestState::Cancelling;
        Ok(vec![Decision::Cancel {
            request_id: id,
            epoch: rec.epoch,
            worker: rec.serving,
        }])
    }

    /// The worker confirms the cancel: `CANCELLED`, reservation released.
    ///
    /// # Errors
    /// As [`Controller::checked`]; [`Error::InvalidArgument`] when no cancel is pending.
    pub fn cancelled(
        &mut self,
        id: RequestId,
        epoch: Epoch,
        _now_ms: u64,
    ) -> Result<Vec<Decision>> {
        let Found::Live = self.checked(id, epoch)? else {
            return Ok(vec![]);
        };
        if self.requests[&id].state != RequestState::Cancelling {
            return Err(Error::InvalidArgument(format!(
                "request {id} has no pending cancel"
            )));
        }
        self.retire(id, RequestState::Cancelled, None);
        Ok(vec![])
    }

    /// The engine failed the request: `FAILED`, reservation released.
    ///
    /// # Errors
    /// As [`Controller::checked`].
    pub fn request_failed(
        &mut self,
        id: RequestId,
        epoch: Epoch,
        reason: &str,
        _now_ms: u64,
    ) -> Result<Vec<Decision>> {
        let Found::Live = self.checked(id, epoch)? else {
            return Ok(vec![]);
        };
        let reason: String = reason.chars().take(512).collect();
        self.retire(id, RequestState::Failed, Some(reason));
        Ok(vec![])
    }

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

    // ---------------------------------------------------------------- snapshot

    /// The whole state as one serializable value.
    pub fn snapshot(&self) -> ControllerSnapshot {
        ControllerSnapshot {
            format_version: SNAPSHOT_FORMAT_VERSION,
            config: self.config.clone(),
            workers: self.load.clone(),
            requests: self.requests.values().cloned().collect(),
            terminal: self
                .terminal_order
                .iter()
                .filter_map(|id| self.terminal.get(id).cloned())
                .collect(),
            stats: self.stats.clone(),
        }
    }

    /// A controller rebuilt from a snapshot (the policy from `snapshot.config.policy`).
    ///
    /// # Errors
    /// [`Error::Protocol`] for another format version; [`Error::InvalidArgument`] when the
    /// configuration or the tables break an invariant (the snapshot is refused, not repaired).
    pub fn from_snapshot(snapshot: ControllerSnapshot) -> Result<Self> {
        if snapshot.format_version != SNAPSHOT_FORMAT_VERSION {
            return Err(Error::Protocol(format!(
                "control snapshot format {} (this build reads {SNAPSHOT_FORMAT_VERSION})",
                snapshot.format_version
            )));
        }
        let mut c = Controller::new(snapshot.config)?;
        if snapshot.workers.len() > c.config.max_workers as usize
            || snapshot.requests.len() > c.config.max_in_flight as usize
        {
            return Err(Error::InvalidArgument(
                "snapshot exceeds the configured limits".into(),
            ));
        }
        c.load = snapshot.workers;
        for r in snapshot.requests {
            if r.state.is_terminal() || c.requests.insert(r.id, r).is_some() {
                return Err(Error::InvalidArgument(
                    "snapshot: terminal or duplicate live request".into(),
                ));
            }
        }
        for r in snapshot.terminal {
            if !r.state.is_terminal() || c.requests.contains_key(&r.id) {
                return Err(Error::InvalidArgument(
                    "snapshot: bad terminal record".into(),
                ));
            }
            c.terminal_order.push_back(r.id);
            c.terminal.insert(r.id, r);
        }
        c.stats = snapshot.stats;
        c.check_invariants()
            .map_err(|e| Error::InvalidArgument(format!("snapshot: {e}")))?;
        Ok(c)
    }

    // ---------------------------------------------------------------- invariants

    /// Check every invariant of the tables; the first broken one is described.
    ///
    /// - a holder is never the serving worker, and is in service;
    /// - every live request's serving worker is in service;
    /// - per worker, reservations and held counts equal the sums over the requests, and
    ///   reservations never exceed capacity;
    /// - per worker, the serving count equals the live requests it serves;
    /// - assist pairs are mutual.
    ///
    /// # Errors
    /// A description of the first broken invariant.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut reserved: BTreeMap<WorkerId, (u64, u32, u32)> = BTreeMap::new();
        for r in self.requests.values() {
            if r.state.is_terminal() {
                return Err(format!("request {} is terminal but live", r.id));
            }
            if r.holder == Some(r.serving) {
                return Err(format!(
                    "request {}: holder {} is its serving worker",
                    r.id, r.serving
                ));
            }
            if !self.load.get(r.serving).is_some_and(WorkerLoad::in_service) {
                return Err(format!(
                    "request {}: serving worker {} not in service",
                    r.id, r.serving
                ));
            }
            match r.holder {
                Some(h) => {
                    if !self.load.get(h).is_some_and(WorkerLoad::in_service) {
                        return Err(format!("request {}: holder {h} not in service", r.id));
                    }
                    if r.reserved_bytes != r.reserve_bytes {
                        return Err(format!(
                            "request {}: reserved {} != asked {}",
                            r.id, r.reserved_bytes, r.reserve_bytes
                        ));
                    }
                    let e = reserved.entry(h).or_default();
                    e.0 += r.reserved_bytes;
                    e.1 += 1;
                }
                None if r.reserved_bytes != 0 || r.checkpointed_tokens != 0 => {
                    return Err(format!("request {}: reservation without holder", r.id));
                }
                None => {}
            }
            reserved.entry(r.serving).or_default().2 += 1;
        }
        for w in self.load.iter() {
            let (bytes, held, serving) = reserved.get(&w.id).copied().unwrap_or_default();
            if w.reserved_bytes != bytes || w.held_checkpoints != held {
                return Err(format!(
                    "worker {}: reserved {}/{} held, requests say {bytes}/{held}",
                    w.id, w.reserved_bytes, w.held_checkpoints
                ));
            }
            if w.reserved_bytes > w.capacity_bytes {
                return Err(format!(
                    "worker {}: reserved {} > capacity {}",
                    w.id, w.reserved_bytes, w.capacity_bytes
                ));
            }
            if w.serving_requests != serving {
                return Err(format!(
                    "worker {}: serving {} != {serving}",
                    w.id, w.serving_requests
                ));
            }
            if let Some(s) = w.assisting
                && self.load.get(s).and_then(|s| s.assisted_by) != Some(w.id)
            {
                return Err(format!("worker {}: assist pair with {s} not mutual", w.id));
            }
        }
        Ok(())
    }

    fn debug_check(&self) {
        #[cfg(debug_assertions)]
        if self.requests.len() <= 4096
            && let Err(e) = self.check_invariants()
        {
            panic!("control invariant broken: {e}");
        }
    }

    // ---------------------------------------------------------------- internals

    /// The compare half of the CAS: the request exists and `epoch` is its current epoch.
    /// Stale epochs are counted and refused; a terminal request's own epoch is a duplicate.
    fn checked(&mut self, id: RequestId, epoch: Epoch) -> Result<Found> {
        let (rec, found) = match self.requests.get(&id) {
            Some(r) => (r, Found::Live),
            None => match self.terminal.get(&id) {
                Some(r) => (r, Found::Terminal),
                None => return Err(Error::NotFound(format!("request {id}"))),
            },
        };
        if let Err(e) = rec.check_epoch(epoch) {
            if matches!(e, Error::StaleEpoch { .. }) {
                self.stats.stale_events += 1;
            }
            return Err(e);
        }
        if let Found::Terminal = found {
            self.stats.duplicate_events += 1;
        }
        Ok(found)
    }

    /// Move a running request forward to `to` within its epoch. Returns the previous state,
    /// serving worker and arrival time when something changed, `None` for a replay.
    fn advance(
        &mut self,
        id: RequestId,
        epoch: Epoch,
        to: RequestState,
    ) -> Result<Option<(RequestState, WorkerId, u64)>> {
        let Found::Live = self.checked(id, epoch)? else {
            return Ok(None);
        };
        let rec = self.requests.get_mut(&id).expect("live");
        let (Some(from), Some(target)) = (rec.state.progress_rank(), to.progress_rank()) else {
            return Err(Error::InvalidArgument(format!(
                "request {id} is {}, cannot become {to}",
                rec.state
            )));
        };
        if from >= target && rec.state != RequestState::Migrating {
            self.stats.duplicate_events += 1;
            return Ok(None);
        }
        let prev = rec.state;
        rec.state = to;
        Ok(Some((prev, rec.serving, rec.arrival_ms)))
    }

    fn release_holder(load: &mut LoadTable, rec: &mut RequestRecord) {
        if let Some(h) = rec.holder.take() {
            load.get_mut(h)
                .expect("a holder is in service")
                .release(rec.reserved_bytes);
        }
        rec.reserved_bytes = 0;
        rec.checkpointed_tokens = 0;
        rec.checkpoint_bytes = 0;
    }

    /// Place `rec`'s checkpoint (it has none now) with the policy, and reserve.
    fn place(
        policy: &dyn Policy,
        load: &mut LoadTable,
        rec: &mut RequestRecord,
        stats: &mut Stats,
        count_miss: bool,
    ) {
        debug_assert!(rec.holder.is_none());
        if rec.reserve_bytes == 0 {
            return;
        }
        match policy.place(load, rec.serving, rec.reserve_bytes) {
            Some(h) => {
                let row = load.get_mut(h).expect("policy chose a known worker");
                assert!(
                    h != rec.serving && row.in_service() && row.free_bytes() >= rec.reserve_bytes,
                    "policy {:?} chose an ineligible holder {h} for request {}",
                    policy.kind(),
                    rec.id
                );
                row.reserve(rec.reserve_bytes);
                rec.holder = Some(h);
                rec.reserved_bytes = rec.reserve_bytes;
            }
            None => {
                if count_miss && policy.kind() != PolicyKind::StopRestart {
                    stats.no_holder += 1;
                }
            }
        }
    }

    fn fail_request(&mut self, id: RequestId, reason: String, plan: &mut RecoveryPlan) {
        let epoch = self.requests[&id].epoch;
        self.retire(id, RequestState::Failed, Some(reason.clone()));
        plan.failed_requests.push((id, epoch, reason));
    }

    /// Move a live request to a terminal state and release what it holds.
    fn retire(&mut self, id: RequestId, state: RequestState, failure: Option<String>) {
        debug_assert!(state.is_terminal());
        let mut rec = self.requests.remove(&id).expect("retire a live request");
        Self::release_holder(&mut self.load, &mut rec);
        if let Some(w) = self.load.get_mut(rec.serving) {
            w.serving_requests = w.serving_requests.saturating_sub(1);
        }
        rec.state = state;
        rec.failure = failure;
        match state {
            RequestState::Completed => self.stats.completed += 1,
            RequestState::Cancelled => self.stats.cancelled += 1,
            _ => self.stats.failed += 1,
        }
        if self.config.max_terminal_retained == 0 {
            return;
        }
        while self.terminal_order.len() >= self.config.max_terminal_retained as usize {
            if let Some(old) = self.terminal_order.pop_front() {
                self.terminal.remove(&old);
            }
        }
        self.terminal_order.push_back(id);
        self.terminal.insert(id, rec);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster(n: u32, cap: u64) -> Controller {
        let mut c = Controller::new(ControlConfig::default()).unwrap();
        for w in 0..n {
            c.add_worker(w, cap, 0).unwrap();
        }
        c
    }

    fn req(id: RequestId, serving: WorkerId, reserve: u64) -> AdmitRequest {
        AdmitRequest {
            request_id: id,
            serving,
            prompt_tokens: 100,
            max_new_tokens: 100,
            reserve_bytes: reserve,
            deadline_ms: None,
        }
    }

    #[test]
    fn admission_reserves_on_a_holder_and_finishing_releases_it() {
        let mut c = cluster(3, 1000);
        let a = c.admit(req(1, 0, 400), 0).unwrap();
        let h = a.holder.unwrap();
        assert_ne!(h, 0);
        assert_eq!(c.load().get(h).unwrap().reserved_bytes, 400);
        c.finished(1, a.epoch, 5).unwrap();
        assert_eq!(c.load().get(h).unwrap().reserved_bytes, 0);
        assert_eq!(c.request(1).unwrap().state, RequestState::Completed);
        c.check_invariants().unwrap();
    }

    #[test]
    fn a_request_with_no_candidate_runs_without_a_checkpoint_and_is_counted() {
        let mut c = cluster(2, 100);
        let a = c.admit(req(1, 0, 400), 0).unwrap();
        assert_eq!(a.holder, None);
        assert_eq!(c.stats().no_holder, 1);
    }

    #[test]
    fn prefill_start_feeds_the_serving_workers_queueing_delay() {
        let mut c = cluster(2, 1000);
        c.admit(req(1, 0, 0), 100).unwrap();
        c.prefill_started(1, 1, 130).unwrap();
        assert_eq!(c.load().get(0).unwrap().queue_delay_ms(), 30.0);
        // A replay adds no second sample.
        c.prefill_started(1, 1, 500).unwrap();
        assert_eq!(c.load().get(0).unwrap().delay_samples(), 1);
    }

    #[test]
    fn admission_beyond_the_in_flight_cap_is_overloaded_and_retryable() {
        let mut c = Controller::new(ControlConfig {
            max_in_flight: 2,
            ..ControlConfig::default()
        })
        .unwrap();
        c.add_worker(0, 0, 0).unwrap();
        c.admit(req(1, 0, 0), 0).unwrap();
        c.admit(req(2, 0, 0), 0).unwrap();
        let e = c.admit(req(3, 0, 0), 0).unwrap_err();
        assert!(e.is_retryable(), "{e}");
    }

    #[test]
    fn a_handoff_to_the_holder_moves_the_checkpoint_elsewhere() {
        let mut c = cluster(3, 1000);
        let a = c.admit(req(1, 0, 100), 0).unwrap();
        let h = a.holder.unwrap();
        let d = c.transfer_started(1, 1, h, 1).unwrap();
        let r = c.request(1).unwrap();
        assert_eq!(r.serving, h);
        assert_ne!(r.holder, Some(h));
        assert!(matches!(d[..], [Decision::Checkpoint { .. }]));
        c.check_invariants().unwrap();
    }

    #[test]
    fn an_epoch_never_issued_is_refused() {
        let mut c = cluster(2, 1000);
        c.admit(req(1, 0, 0), 0).unwrap();
        assert!(matches!(
            c.prefill_started(1, 7, 1),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!(c.request(1).unwrap().state, RequestState::Admitted);
    }

    #[test]
    fn a_config_out_of_bounds_is_refused() {
        for bad in [
            ControlConfig {
                lambda: f64::NAN,
                ..ControlConfig::default()
            },
            ControlConfig {
                max_workers: MAX_WORKERS + 1,
                ..ControlConfig::default()
            },
            ControlConfig {
                queue_delay_window: 0,
                ..ControlConfig::default()
            },
        ] {
            assert!(Controller::new(bad).is_err());
        }
    }
}
