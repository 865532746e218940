//! Recovery: what the holders hold, failing a worker, following the plan, ending checkpoints,
//! and the health watch that fails and brings back workers by their engines' `/health`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use hyper::{Method, StatusCode};

use super::upstream::{self, Endpoint};
use super::{
    Active, Front, HEALTH_EVERY, HEALTH_MISSES, Held, PROBE_TIMEOUT, Pending, RecoveryRecord,
    RestoreFrom, Run,
};
use crate::control::{Decision, Epoch, Event, RequestId, WorkerId, WorkerPhase};
use crate::control_service::Shared;
use crate::{Error, Result};

impl Front {
    /// Before failing `workers`: report what the holders of their requests hold now (`this`
    /// run's state is refreshed first), so the plan loads what is there. The holders that do
    /// not answer are returned: they are gone too.
    pub(super) async fn report_checkpoints(
        &self,
        workers: &[WorkerId],
        this: Option<&Run>,
    ) -> Vec<WorkerId> {
        if let Some(run) = this {
            self.set_active(run);
        }
        let runs: Vec<(RequestId, Active)> = self
            .active
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(_, a)| workers.contains(&a.serving))
            .map(|(id, a)| (*id, *a))
            .collect();
        let mut gone = Vec::new();
        let mut tasks = tokio::task::JoinSet::new();
        for (id, a) in runs {
            let Some(h) = a.holder else { continue };
            let Some(admin) = self.shared.node_admin(u64::from(h)) else {
                gone.push(h);
                continue;
            };
            tasks.spawn(async move { (id, a, h, held_at(&admin, id).await) });
        }
        while let Some(Ok((id, a, h, held))) = tasks.join_next().await {
            match held {
                Ok(Some(held)) => {
                    let history = a.prompt as usize + a.generated as usize;
                    report_held(&self.shared, id, a.epoch, history, &held);
                    self.count(|s| {
                        s.checkpoint_bytes += held.bytes;
                        s.checkpoint_tokens += held.committed_tokens;
                    });
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(request = id, holder = h, error = %e, "front: the holder does not answer; treated as gone");
                    self.count(|s| s.holder_calls_failed += 1);
                    gone.push(h);
                }
            }
        }
        gone.sort_unstable();
        gone.dedup();
        gone
    }

    /// The stream broke: fail the worker (if its engine is gone) and follow the plan.
    pub(super) async fn recover(
        &self,
        run: &mut Run,
        reason: String,
    ) -> std::result::Result<(), String> {
        let at = Instant::now();
        if at >= run.deadline {
            return Err(format!(
                "the stream broke ({reason}) past the request's deadline"
            ));
        }
        if let Some(d) = self.shared.take_plan(run.id) {
            return self.follow(run, d, at, reason);
        }
        let ep = &self.engines[&run.serving];
        if engine_alive(ep).await {
            return Err(format!(
                "the stream from worker {} broke ({reason}) but its engine still answers: not a worker failure, so no recovery",
                run.serving
            ));
        }
        let mut failed = vec![run.serving];
        failed.extend(self.report_checkpoints(&[run.serving], Some(run)).await);
        failed.sort_unstable();
        failed.dedup();
        tracing::warn!(request = run.id, workers = ?failed, %reason, "front: the stream broke; failing the worker");
        match self.shared.fail(&failed) {
            Ok(plan) => self.count(|s| s.workers_failed += plan.failed_workers.len() as u64),
            Err(e) => return Err(format!("the controller refused the failure: {e}")),
        }
        let d = self.shared.take_plan(run.id).ok_or_else(|| {
            format!(
                "worker {} failed, but no plan names request {}",
                run.serving, run.id
            )
        })?;
        self.follow(run, d, at, reason)
    }

    /// Carry out a plan for this run.
    pub(super) fn follow(
        &self,
        run: &mut Run,
        d: Decision,
        at: Instant,
        reason: String,
    ) -> std::result::Result<(), String> {
        match d {
            Decision::Restore(p) => {
                if Instant::now() >= run.deadline {
                    return Err("the request's deadline passed during recovery".into());
                }
                let from = run.serving;
                run.restore = p.kv_source.map(|h| RestoreFrom {
                    holder: h,
                    epoch: run.epoch,
                    local: h == p.target,
                });
                run.epoch = p.epoch;
                run.serving = p.target;
                run.holder = p.new_holder;
                run.pending = Some(Pending {
                    at,
                    record: RecoveryRecord {
                        request: run.id,
                        epoch: p.epoch,
                        from,
                        to: p.target,
                        kv_source: p.kv_source,
                        load_tokens: p.load_tokens,
                        recompute_tokens: p.prefill_tokens,
                        committed_tokens: run.generated.len() as u32,
                        recovery_ms: 0,
                        reason,
                    },
                });
                tracing::info!(request = run.id, epoch = p.epoch, to = p.target, kv_source = ?p.kv_source, load_tokens = p.load_tokens, "front: resubmitting to the survivor");
                Ok(())
            }
            Decision::RequestFailed { reason: why, .. } => {
                Err(format!("recovery is impossible: {why}"))
            }
            other => Err(format!(
                "an unexpected decision for this request: {other:?}"
            )),
        }
    }

    /// The request is over: report and end its checkpoints (the holder's, and a restore
    /// source not ended yet).
    pub(super) async fn end_checkpoints(&self, run: &Run) {
        let mut ends = Vec::new();
        if let Some(h) = run.holder {
            ends.push((h, run.epoch, true));
        }
        if let Some(r) = run.restore {
            ends.push((r.holder, r.epoch, false));
        }
        for (h, epoch, measure) in ends {
            let Some(admin) = self.shared.node_admin(u64::from(h)) else {
                continue;
            };
            if measure {
                if let Ok(Some(held)) = held_at(&admin, run.id).await {
                    if held.epoch == epoch {
                        self.count(|s| {
                            s.checkpoint_bytes += held.bytes;
                            s.checkpoint_tokens += held.committed_tokens;
                        });
                    }
                }
            }
            if let Err(e) = end_at(&admin, run.id, epoch).await {
                tracing::debug!(request = run.id, holder = h, error = %e, "front: ending the checkpoint");
            }
        }
    }

    pub(super) async fn health_watch(self: Arc<Self>) {
        let mut misses: BTreeMap<WorkerId, u32> = BTreeMap::new();
        let mut tick = tokio::time::interval(HEALTH_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            for (&w, ep) in &self.engines {
                let Some(phase) = self.shared.load().get(w).map(|l| l.phase) else {
                    continue;
                };
                let ok = engine_alive(ep).await;
                let m = misses.entry(w).or_insert(0);
                *m = if ok { 0 } else { *m + 1 };
                match phase {
                    WorkerPhase::FullService if *m >= HEALTH_MISSES => {
                        tracing::warn!(worker = w, engine = %ep, "front: the engine stopped answering; failing the worker");
                        let mut failed = vec![w];
                        failed.extend(self.report_checkpoints(&[w], None).await);
                        if let Ok(plan) = self.shared.fail(&failed) {
                            self.count(|s| s.workers_failed += plan.failed_workers.len() as u64);
                        }
                    }
                    WorkerPhase::Failed if ok && self.shared.node_admin(u64::from(w)).is_some() => {
                        self.apply(Event::WorkerRecovered { worker: w });
                        self.promote(w);
                        self.count(|s| s.workers_recovered += 1);
                        tracing::info!(
                            worker = w,
                            "front: the engine answers again; the worker is back"
                        );
                    }
                    WorkerPhase::LoadingDraft | WorkerPhase::Assist | WorkerPhase::HotSwap
                        if ok =>
                    {
                        self.promote(w)
                    }
                    _ => {}
                }
            }
        }
    }

    /// A recovering worker whose engine answers is whole: every recovery phase is done.
    pub(super) fn promote(&self, w: WorkerId) {
        for phase in [
            WorkerPhase::LoadingDraft,
            WorkerPhase::Assist,
            WorkerPhase::HotSwap,
        ] {
            if self.shared.load().get(w).map(|l| l.phase) == Some(phase) {
                self.apply(Event::WorkerPhaseDone { worker: w, phase });
            }
        }
    }
}

pub(super) async fn engine_alive(ep: &Endpoint) -> bool {
    matches!(upstream::call(ep, Method::GET, "/health", None, PROBE_TIMEOUT).await, Ok((s, _)) if s.is_success())
}

pub(super) fn admin_endpoint(admin: &str) -> Result<Endpoint> {
    admin.parse()
}

/// What a node holds for `id` (`None`: nothing).
pub(super) async fn held_at(admin: &str, id: RequestId) -> Result<Option<Held>> {
    let ep = admin_endpoint(admin)?;
    let (status, body) = upstream::call(
        &ep,
        Method::GET,
        &format!("/checkpoints/{id}"),
        None,
        PROBE_TIMEOUT,
    )
    .await?;
    match status {
        StatusCode::NOT_FOUND => Ok(None),
        s if s.is_success() => serde_json::from_slice(&body)
            .map(Some)
            .map_err(|e| Error::Protocol(format!("{ep}/checkpoints/{id}: {e}"))),
        s => Err(Error::Unavailable(format!("{ep}/checkpoints/{id}: {s}"))),
    }
}

/// End `id`'s checkpoint of `epoch` on a node.
pub(super) async fn end_at(admin: &str, id: RequestId, epoch: Epoch) -> Result<()> {
    let ep = admin_endpoint(admin)?;
    let (status, body) = upstream::call(
        &ep,
        Method::DELETE,
        &format!("/checkpoints/{id}?epoch={epoch}"),
        None,
        PROBE_TIMEOUT,
    )
    .await?;
    if status.is_success() || status == StatusCode::NOT_FOUND {
        Ok(())
    } else {
        Err(Error::Unavailable(format!(
            "{ep}: {status}: {}",
            String::from_utf8_lossy(&body)
        )))
    }
}

pub(super) fn report_held(
    shared: &Shared,
    id: RequestId,
    epoch: Epoch,
    history: usize,
    held: &Held,
) {
    if held.epoch != epoch {
        return;
    }
    let tokens = held
        .committed_tokens
        .min(history as u64)
        .min(u64::from(u32::MAX)) as u32;
    // The reservation was sized from --kv-bytes-per-token in whole --kv-tokens-per-block
    // blocks; a holder that needs more pool for the same tokens means those figures are too
    // small. The tokens are what a plan needs: say so loudly and report the bytes at the
    // reservation rather than lose the checkpoint.
    let reserved = shared.request(id).map_or(u64::MAX, |r| r.reserved_bytes);
    let bytes = if held.bytes > reserved {
        shared.count_front(|s| s.checkpoint_reports_clamped += 1);
        tracing::warn!(
            request = id,
            held = held.bytes,
            reserved,
            tokens,
            "front: the holder holds more bytes than the request reserved: --kv-bytes-per-token × --kv-tokens-per-block is below the pool's page size, or the engines' blocks hold more tokens than --kv-tokens-per-block"
        );
        reserved
    } else {
        held.bytes
    };
    if let Err(e) = shared.apply(&Event::CheckpointStored {
        request_id: id,
        epoch,
        tokens,
        bytes,
    }) {
        tracing::warn!(request = id, error = %e, "front: checkpoint report refused");
    }
}
