//! Arrivals: the router, admission through the controller, and starting a worker's iteration.

use super::super::events::{ReqIdx, SimEvent, WorkerIdx, secs_to_us};
use super::super::worker::Waiting;
use super::Sim;
use kvd_control::PolicyKind;

impl Sim<'_> {
    pub(super) fn on_arrival(&mut self, r: ReqIdx) -> crate::Result<()> {
        self.progress.arrived += 1;
        self.progress.outstanding += 1;
        if let Some(next) = self.workload.get(r + 1) {
            self.q.push(next.arrival_us, SimEvent::Arrival(r + 1));
        }
        match self.route() {
            Some(w) => self.admit(r, w),
            None => {
                self.backlog.push_back(r);
                Ok(())
            }
        }
    }

    /// The serving worker the front's rule picks ([`kvd_control::admission::pick`]), from
    /// the simulated engines' own queues: the fewest requests, those waiting to prefill or
    /// resume counted twice, lowest index on ties (the simulated engines have no sequence cap).
    pub(super) fn route(&self) -> Option<WorkerIdx> {
        let row = |w: &crate::worker::Worker| kvd_control::admission::AdmissionRow {
            id: u32::try_from(w.idx).unwrap_or(u32::MAX),
            serving: u32::try_from(w.load_requests()).unwrap_or(u32::MAX),
            starting: u32::try_from(w.waiting.len() + w.resumed.len()).unwrap_or(u32::MAX),
            slot_wait_tokens: 0,
        };
        let rows = self.workers.iter().filter(|w| w.is_serving()).map(row);
        kvd_control::admission::pick(rows).map(|id| id as WorkerIdx)
    }

    pub(super) fn reserve_bytes(&self, r: ReqIdx) -> u64 {
        let spec = &self.workload[r];
        u64::from(
            spec.prompt_tokens
                + self
                    .cfg
                    .cluster
                    .engine
                    .max_output_tokens
                    .max(spec.output_tokens),
        ) * self.kv_bytes
    }

    pub(super) fn admit(&mut self, r: ReqIdx, w: WorkerIdx) -> crate::Result<()> {
        let spec = self.workload[r];
        let now = self.now();
        let adm = self.shim.admit(r, w, &spec, self.reserve_bytes(r), now)?;
        if adm.holder.is_none() && self.cfg.policy != PolicyKind::StopRestart {
            self.m.unplaced += 1;
        }
        let st = &mut self.reqs[r];
        st.epoch = adm.epoch;
        st.worker = Some(w);
        st.holder = adm.holder;
        st.holder_gen += 1;
        self.workers[w].waiting.push_back(Waiting {
            req: r,
            prefill_tokens: spec.prompt_tokens,
            context_tokens: 0,
            to_generate: spec.output_tokens,
            kv_need_tokens: spec.prompt_tokens + spec.output_tokens,
            enqueued_us: now,
        });
        self.kick(w)
    }

    /// Starts an iteration on `w` if it is idle and has work.
    pub(super) fn kick(&mut self, w: WorkerIdx) -> crate::Result<()> {
        if self.workers[w].busy {
            return Ok(());
        }
        let now = self.now();
        self.scratch.admitted.clear();
        let Some(t) =
            self.workers[w].begin_iteration(&self.cfg.cluster, now, &mut self.scratch.admitted)
        else {
            return Ok(());
        };
        for i in 0..self.scratch.admitted.len() {
            let a = self.scratch.admitted[i];
            self.shim
                .prefill_started(a.req, self.reqs[a.req].epoch, now)?;
            if let Some(row) = self.reqs[a.req].trace_row {
                let m = &mut self.trace[row].marks;
                if m.ready_us.is_some() {
                    m.batch_us.get_or_insert(now);
                }
            }
        }
        let incarnation = self.workers[w].incarnation;
        self.q.push(
            now + secs_to_us(t),
            SimEvent::IterationEnd {
                worker: w,
                incarnation,
            },
        );
        Ok(())
    }
}
