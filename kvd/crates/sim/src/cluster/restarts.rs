//! A failed worker's way back: a full reload, or Lumen's LOADING_DRAFT → ASSIST → HOTSWAP.

use super::super::events::{SimEvent, WorkerIdx, secs_to_us};
use super::super::worker::EngineState;
use super::Sim;

impl Sim<'_> {
    pub(super) fn on_draft_ready(&mut self, w: WorkerIdx) -> crate::Result<()> {
        let now = self.now();
        self.workers[w].phase = EngineState::Assist;
        if let Some(partner) = self.shim.worker_draft_ready(w, now)? {
            if self.workers[partner].is_serving() {
                self.assisting[w] = Some(partner);
                self.workers[partner].speedup = self.cfg.cluster.hardware.assist_speedup;
            }
        }
        let c = &self.cfg.cluster;
        let t = c.model.weights_bytes as f64 / c.hardware.reload_bytes_per_s;
        let inc = self.workers[w].incarnation;
        self.q.push(
            now + secs_to_us(t),
            SimEvent::ReloadDone {
                worker: w,
                incarnation: inc,
            },
        );
        Ok(())
    }

    pub(super) fn on_reload_done(&mut self, w: WorkerIdx) -> crate::Result<()> {
        let now = self.now();
        if self.shim.uses_recovery_phases() {
            self.workers[w].phase = EngineState::Hotswap;
            self.shim.worker_hotswap(w, now)?;
            let inc = self.workers[w].incarnation;
            self.q.push(
                now + secs_to_us(self.cfg.cluster.hardware.hotswap_s),
                SimEvent::HotswapDone {
                    worker: w,
                    incarnation: inc,
                },
            );
            return Ok(());
        }
        self.back_in_service(w)
    }

    pub(super) fn on_hotswap_done(&mut self, w: WorkerIdx) -> crate::Result<()> {
        if let Some(partner) = self.assisting[w].take() {
            self.workers[partner].speedup = 1.0;
        }
        self.back_in_service(w)
    }

    pub(super) fn back_in_service(&mut self, w: WorkerIdx) -> crate::Result<()> {
        let now = self.now();
        self.workers[w].phase = EngineState::Serving;
        self.shim.worker_recovered(w, now)?;
        self.progress.down -= 1;
        if self.progress.down == 0 {
            self.progress.capacity_restored_us = Some(now);
        }
        // Bounded by the backlog's length.
        while let Some(r) = self.backlog.pop_front() {
            let target = self.route().expect("a worker serves now");
            self.admit(r, target)?;
        }
        Ok(())
    }
}
