//! A failure: the failed workers' requests are interrupted, the controller plans their
//! recovery, and each restore is carried out (network read, host-to-GPU copy, rejoin a batch).

use super::super::events::{ReqIdx, SimEvent, WorkerIdx, secs_to_us};
use super::super::shim::{ShimFailure, ShimRestore};
use super::super::trace::{Marks, RecoveryKind, RecoveryTrace};
use super::super::worker::{EngineState, Waiting};
use super::Sim;

impl Sim<'_> {
    pub(super) fn on_failure(&mut self, ws: &[WorkerIdx]) -> crate::Result<()> {
        let now = self.now();
        let ws: Vec<WorkerIdx> = ws
            .iter()
            .copied()
            .filter(|&w| self.workers[w].phase == EngineState::Serving)
            .collect();
        if ws.is_empty() {
            return Ok(());
        }
        self.progress.first_failure_us.get_or_insert(now);
        self.progress.capacity_restored_us = None;
        self.take_down(&ws);
        let interrupted = self.interrupt(&ws);
        // Tell the controller what each interrupted request had committed (the sim reports
        // tokens at checkpoints, not every token).
        for &r in &interrupted {
            let (epoch, generated) = (self.reqs[r].epoch, self.reqs[r].generated);
            self.shim.tokens_committed(r, epoch, generated, now)?;
        }
        let plan = self.shim.fail_workers(&ws, now)?;
        for &r in &interrupted {
            let st = &mut self.reqs[r];
            st.incarnation += 1;
            st.worker = None;
            st.decoding = false;
            self.records[r].interrupted = true;
            self.m.interrupted += 1;
        }
        self.carry_out(plan)?;
        // Every interrupted request got a plan or failed.
        for &r in &interrupted {
            assert!(
                self.reqs[r].done || self.reqs[r].worker.is_some(),
                "request {r} was interrupted and got neither a restore nor a failure"
            );
        }
        for &w in &ws {
            self.restart(w);
        }
        Ok(())
    }

    /// The failed workers stop: iterations in flight are dropped (new incarnation), assist
    /// pairs they were part of end, the checkpoints they held are gone.
    fn take_down(&mut self, ws: &[WorkerIdx]) {
        for &w in ws {
            self.workers[w].fail();
            self.progress.down += 1;
            for a in &mut self.assisting {
                if *a == Some(w) {
                    *a = None;
                }
            }
            self.ckpt.host_bytes[w] = 0;
        }
    }

    /// The live requests on a failed worker (queued, running, or restoring), in index order.
    /// Requests whose holder failed lose their checkpoint (its host memory died with it).
    fn interrupt(&mut self, ws: &[WorkerIdx]) -> Vec<ReqIdx> {
        let now = self.now();
        let failed = |w: Option<WorkerIdx>| w.is_some_and(|w| ws.contains(&w));
        let mut interrupted = Vec::new();
        for (r, st) in self.reqs.iter_mut().enumerate() {
            if st.done {
                continue;
            }
            if let Some(server) = st.worker.filter(|&w| ws.contains(&w)) {
                st.trace_row = Some(self.trace.len());
                self.trace.push(RecoveryTrace {
                    req: r,
                    failure_s: 0.0,
                    server,
                    holder: st.holder,
                    holder_failed: failed(st.holder),
                    checkpointed_tokens: st.ckpt_tokens,
                    computed_tokens: st.context_tokens,
                    history_tokens: self.workload[r].prompt_tokens + st.generated,
                    target: None,
                    load_tokens: 0,
                    prefill_tokens: 0,
                    kind: RecoveryKind::Failed,
                    restore_s: 0.0,
                    queue_s: 0.0,
                    prefill_s: 0.0,
                    stall_s: 0.0,
                    marks: Marks {
                        failure_us: now,
                        ..Marks::default()
                    },
                });
            }
            if failed(st.holder) {
                st.holder = None;
                st.ckpt_bytes = 0;
                st.ckpt_tokens = 0;
                st.ckpt_sent_tokens = 0;
                st.holder_gen += 1;
            }
            if failed(st.worker) {
                interrupted.push(r);
            }
        }
        interrupted
    }

    /// Carries out the controller's plan: failed requests, checkpoint moves, restores.
    fn carry_out(&mut self, plan: ShimFailure) -> crate::Result<()> {
        for (r, reason) in plan.failed {
            self.fail_request(r, reason);
        }
        for (r, epoch, holder) in plan.checkpoint_moves {
            if self.reqs[r].done {
                continue;
            }
            self.drop_checkpoint(r);
            let st = &mut self.reqs[r];
            st.epoch = epoch;
            st.holder = holder;
        }
        for p in plan.restores {
            self.start_restore(p)?;
        }
        Ok(())
    }

    /// Schedules the way back of failed worker `w`: the draft first when the policy walks the
    /// recovery phases, the full model otherwise.
    fn restart(&mut self, w: WorkerIdx) {
        let now = self.now();
        let inc = self.workers[w].incarnation;
        let c = &self.cfg.cluster;
        if self.shim.uses_recovery_phases() {
            self.workers[w].phase = EngineState::LoadingDraft;
            let t = c.hardware.reload_init_s
                + c.model.draft_weights_bytes as f64 / c.hardware.reload_bytes_per_s;
            self.q.push(
                now + secs_to_us(t),
                SimEvent::DraftReady {
                    worker: w,
                    incarnation: inc,
                },
            );
        } else {
            self.q.push(
                now + secs_to_us(c.reload_s()),
                SimEvent::ReloadDone {
                    worker: w,
                    incarnation: inc,
                },
            );
        }
    }

    pub(super) fn start_restore(&mut self, p: ShimRestore) -> crate::Result<()> {
        let now = self.now();
        let r = p.req;
        let spec = self.workload[r];
        let hw = &self.cfg.cluster.hardware;
        let st = &mut self.reqs[r];
        let history = spec.prompt_tokens + st.generated;
        // Never load more than the holder has, nor more than the history.
        let load = p.load_tokens.min(st.ckpt_tokens).min(history);
        let computed_before = st.context_tokens;
        self.m.recomputed_tokens += u64::from(computed_before.saturating_sub(load));
        if let Some(row) = st.trace_row {
            let t = &mut self.trace[row];
            t.target = Some(p.target);
            t.load_tokens = load;
            t.prefill_tokens = history - load;
            t.kind = match (load > 0, p.kv_source) {
                (true, Some(src)) if src == p.target => RecoveryKind::LocalRestore,
                (true, _) => RecoveryKind::RemoteRestore,
                _ if t.holder_failed => RecoveryKind::HolderFailed,
                _ if t.holder.is_none() => RecoveryKind::NoHolder,
                _ => RecoveryKind::NoCheckpointYet,
            };
        }
        st.epoch = p.epoch;
        st.worker = Some(p.target);
        st.context_tokens = load;
        let bytes = u64::from(load) * self.kv_bytes;
        let mut ready = now;
        if load > 0 {
            let src = p.kv_source.expect("a load names its source");
            if src != p.target {
                let net = &mut self.workers[src].net_free_at_us;
                let start = ready.max(*net);
                ready = start + secs_to_us(bytes as f64 / hw.network_bytes_per_s);
                *net = ready;
                self.m.restore_network_bytes += bytes;
            }
            let pcie = &mut self.workers[p.target].pcie_free_at_us;
            let start = ready.max(*pcie);
            ready = start + secs_to_us(bytes as f64 / hw.pcie_h2d_bytes_per_s);
            *pcie = ready;
            self.m.restore_h2d_bytes += bytes;
        }
        let st = &mut self.reqs[r];
        if st.holder.is_some() && p.new_holder == st.holder && p.new_holder != Some(p.target) {
            // The holder keeps the checkpoint (the request resumed elsewhere): streaming
            // continues from what it has; chunks lost with the sender are sent again.
            st.ckpt_sent_tokens = st.ckpt_tokens;
        } else {
            // The checkpoint was consumed (or lost); checkpointing starts over at the new
            // holder.
            self.drop_checkpoint(r);
            self.reqs[r].holder = p.new_holder;
        }
        let st = &mut self.reqs[r];
        if let Some(row) = st.trace_row {
            self.trace[row].marks.ready_us = Some(ready);
        }
        let (incarnation, epoch) = (self.workers[p.target].incarnation, st.incarnation);
        self.q.push(
            ready,
            SimEvent::RestoreDone {
                req: r,
                worker: p.target,
                incarnation,
                epoch,
            },
        );
        Ok(())
    }

    pub(super) fn on_restore_done(
        &mut self,
        r: ReqIdx,
        w: WorkerIdx,
        incarnation: u32,
        epoch: u64,
    ) -> crate::Result<()> {
        let st = &self.reqs[r];
        if st.done
            || st.incarnation != epoch
            || self.workers[w].incarnation != incarnation
            || st.worker != Some(w)
        {
            return Ok(());
        }
        let spec = self.workload[r];
        let history = spec.prompt_tokens + st.generated;
        let load = st.context_tokens;
        let now = self.now();
        self.workers[w].resumed.push_back(Waiting {
            req: r,
            prefill_tokens: history - load,
            context_tokens: load,
            to_generate: spec.output_tokens - st.generated,
            kv_need_tokens: spec.prompt_tokens + spec.output_tokens,
            enqueued_us: now,
        });
        // A restore whose whole history was loaded produces its next token by a decode step.
        self.reqs[r].decoding = history == load;
        self.kick(w)
    }
}
