//! The simulator's side of the control shim: it owns a real [`Controller`] (the same code a
//! router or `kvd control` runs) and translates the simulator's events into its calls.
//!
//! Nothing here decides anything: placement, recovery dispatch, rebalancing, restore plans and
//! assist pairing all come from [`kvd_control`]. This file converts units (simulated
//! microseconds to the controller's milliseconds, indices to ids) and unpacks the decisions.

use super::config::ClusterConfig;
use super::events::{ReqIdx, SimTime, WorkerIdx};
use super::workload::RequestSpec;
use kvd_control::{
    AdmitRequest, ControlConfig, Controller, Decision, PolicyKind, RequestId, WorkerId, WorkerPhase,
};

/// An admission as the simulator uses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShimAdmission {
    /// The request's epoch.
    pub epoch: u64,
    /// Its checkpoint holder, if any.
    pub holder: Option<WorkerIdx>,
}

/// One restore the controller planned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShimRestore {
    /// The request.
    pub req: ReqIdx,
    /// Its new epoch.
    pub epoch: u64,
    /// Where it resumes.
    pub target: WorkerIdx,
    /// Where its checkpoint is read from (`None`: recompute).
    pub kv_source: Option<WorkerIdx>,
    /// Tokens to load from the checkpoint.
    pub load_tokens: u32,
    /// Its checkpoint holder from now on.
    pub new_holder: Option<WorkerIdx>,
}

/// What a failure event decided.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShimFailure {
    /// One per resumed request.
    pub restores: Vec<ShimRestore>,
    /// Requests that could not resume, with the controller's reason.
    pub failed: Vec<(ReqIdx, String)>,
    /// Live requests whose holder died: `(request, epoch, new holder)`.
    pub checkpoint_moves: Vec<(ReqIdx, u64, Option<WorkerIdx>)>,
}

/// The controller and the unit conversions around it.
#[derive(Debug)]
pub struct Shim {
    ctl: Controller,
    policy: PolicyKind,
    max_output_tokens: u32,
}

fn ms(t: SimTime) -> u64 {
    t / 1000
}

fn wid(w: WorkerIdx) -> WorkerId {
    WorkerId::try_from(w).expect("the cluster has at most 4096 workers")
}

fn rid(r: ReqIdx) -> RequestId {
    r as RequestId
}

fn widx(w: WorkerId) -> WorkerIdx {
    w as WorkerIdx
}

impl Shim {
    /// A controller running `policy` over the workers of `cluster`, each offering its host
    /// checkpoint budget, with the cluster's bandwidth and prefill rate as its estimates.
    ///
    /// # Errors
    /// What [`Controller::new`] and [`Controller::add_worker`] return for a bad configuration.
    pub fn new(policy: PolicyKind, cluster: &ClusterConfig) -> crate::Result<Self> {
        let cfg = ControlConfig {
            policy,
            host_to_gpu_bytes_per_ms: (cluster.hardware.pcie_h2d_bytes_per_s / 1000.0) as u64,
            prefill_tokens_per_ms: ((1e-3 / cluster.model.iter_per_token_s) as u32).max(1),
            engine_max_seqs: 0, // the simulated engines batch without a sequence cap
            max_workers: cluster.workers.max(1),
            ..ControlConfig::default()
        };
        let mut ctl = Controller::new(cfg)?;
        for w in 0..cluster.workers as usize {
            ctl.add_worker(wid(w), cluster.hardware.host_checkpoint_bytes, 0)?;
        }
        Ok(Shim {
            ctl,
            policy,
            max_output_tokens: cluster.engine.max_output_tokens,
        })
    }

    /// The controller (for tests and statistics).
    pub fn controller(&self) -> &Controller {
        &self.ctl
    }

    /// Whether a restarted worker walks LOADING_DRAFT → ASSIST → HOTSWAP with real durations
    /// (Lumen) or reloads the full model directly (the baselines). The control API has no
    /// such question; the simulator answers it from the policy kind.
    pub fn uses_recovery_phases(&self) -> bool {
        self.policy.is_lumen()
    }

    /// Admits `spec` on worker `w`, reserving `reserve_bytes` for its checkpoint.
    ///
    /// # Errors
    /// What [`Controller::admit`] returns (a driver bug: the router only picks serving workers).
    pub fn admit(
        &mut self,
        r: ReqIdx,
        w: WorkerIdx,
        spec: &RequestSpec,
        reserve_bytes: u64,
        now: SimTime,
    ) -> crate::Result<ShimAdmission> {
        let adm = self.ctl.admit(
            AdmitRequest {
                request_id: rid(r),
                serving: wid(w),
                prompt_tokens: spec.prompt_tokens,
                max_new_tokens: self.max_output_tokens.max(spec.output_tokens),
                reserve_bytes,
                deadline_ms: None,
            },
            ms(now),
        )?;
        Ok(ShimAdmission {
            epoch: adm.epoch,
            holder: adm.holder.map(widx),
        })
    }

    /// The request entered a batch (prefill starts, or a restored request resumes).
    ///
    /// # Errors
    /// The controller's (a driver bug).
    pub fn prefill_started(&mut self, r: ReqIdx, epoch: u64, now: SimTime) -> crate::Result<()> {
        self.ctl.prefill_started(rid(r), epoch, ms(now)).map(drop)
    }

    /// The request produced its first token in this incarnation.
    ///
    /// # Errors
    /// The controller's (a driver bug).
    pub fn decoding_started(&mut self, r: ReqIdx, epoch: u64, now: SimTime) -> crate::Result<()> {
        self.ctl.decoding_started(rid(r), epoch, ms(now)).map(drop)
    }

    /// The request has committed `generated` output tokens.
    ///
    /// # Errors
    /// The controller's (a driver bug).
    pub fn tokens_committed(
        &mut self,
        r: ReqIdx,
        epoch: u64,
        generated: u32,
        now: SimTime,
    ) -> crate::Result<()> {
        self.ctl
            .tokens_committed(rid(r), epoch, generated, ms(now))
            .map(drop)
    }

    /// The holder has `tokens` tokens (`bytes` bytes) of the request's checkpoint; `generated`
    /// is what the request has committed (the controller checks the checkpoint against its
    /// history, so tokens go first).
    ///
    /// # Errors
    /// The controller's (a driver bug).
    pub fn checkpoint_stored(
        &mut self,
        r: ReqIdx,
        epoch: u64,
        generated: u32,
        tokens: u32,
        bytes: u64,
        now: SimTime,
    ) -> crate::Result<()> {
        self.ctl
            .tokens_committed(rid(r), epoch, generated, ms(now))?;
        self.ctl
            .checkpoint_stored(rid(r), epoch, tokens, bytes, ms(now))
            .map(drop)
    }

    /// The request completed with `generated` tokens.
    ///
    /// # Errors
    /// The controller's (a driver bug).
    pub fn finished(
        &mut self,
        r: ReqIdx,
        epoch: u64,
        generated: u32,
        now: SimTime,
    ) -> crate::Result<()> {
        self.ctl
            .tokens_committed(rid(r), epoch, generated, ms(now))?;
        self.ctl.finished(rid(r), epoch, ms(now)).map(drop)
    }

    /// Workers `ws` failed; returns the controller's recovery plan.
    ///
    /// # Errors
    /// The controller's (a driver bug).
    pub fn fail_workers(&mut self, ws: &[WorkerIdx], now: SimTime) -> crate::Result<ShimFailure> {
        let ids: Vec<WorkerId> = ws.iter().map(|&w| wid(w)).collect();
        let plan = self.ctl.fail_workers(&ids, ms(now))?;
        Ok(ShimFailure {
            restores: plan
                .restores
                .iter()
                .map(|p| ShimRestore {
                    req: p.request_id as ReqIdx,
                    epoch: p.epoch,
                    target: widx(p.target),
                    kv_source: p.kv_source.map(widx),
                    load_tokens: p.load_tokens,
                    new_holder: p.new_holder.map(widx),
                })
                .collect(),
            failed: plan
                .failed_requests
                .into_iter()
                .map(|(r, _, why)| (r as ReqIdx, why))
                .collect(),
            checkpoint_moves: plan
                .checkpoint_moves
                .into_iter()
                .map(|(r, e, h)| (r as ReqIdx, e, h.map(widx)))
                .collect(),
        })
    }

    /// A failed worker is up again and has loaded its draft model: it leaves LOADING_DRAFT and
    /// enters ASSIST. Returns the survivor the controller pairs it with.
    ///
    /// # Errors
    /// The controller's (a driver bug).
    pub fn worker_draft_ready(
        &mut self,
        w: WorkerIdx,
        now: SimTime,
    ) -> crate::Result<Option<WorkerIdx>> {
        self.ctl.worker_recovered(wid(w), ms(now))?;
        let ds = self
            .ctl
            .worker_phase_done(wid(w), WorkerPhase::LoadingDraft, ms(now))?;
        Ok(ds.iter().find_map(|d| match d {
            Decision::WorkerPhase {
                phase: WorkerPhase::Assist,
                assisting,
                ..
            } => assisting.map(widx),
            _ => None,
        }))
    }

    /// The full model is loaded: ASSIST is over, HOTSWAP begins.
    ///
    /// # Errors
    /// The controller's (a driver bug).
    pub fn worker_hotswap(&mut self, w: WorkerIdx, now: SimTime) -> crate::Result<()> {
        self.ctl
            .worker_phase_done(wid(w), WorkerPhase::Assist, ms(now))
            .map(drop)
    }

    /// The worker serves the full model again. A worker that did not walk the phases (the
    /// baselines reload the full model directly) walks them now, at one instant, since the
    /// controller only returns a worker to service through them.
    ///
    /// # Errors
    /// The controller's (a driver bug).
    pub fn worker_recovered(&mut self, w: WorkerIdx, now: SimTime) -> crate::Result<()> {
        let id = wid(w);
        if !self.uses_recovery_phases() {
            self.ctl.worker_recovered(id, ms(now))?;
            self.ctl
                .worker_phase_done(id, WorkerPhase::LoadingDraft, ms(now))?;
            self.ctl
                .worker_phase_done(id, WorkerPhase::Assist, ms(now))?;
        }
        self.ctl
            .worker_phase_done(id, WorkerPhase::HotSwap, ms(now))
            .map(drop)
    }
}
