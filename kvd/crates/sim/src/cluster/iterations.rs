//! The end of an iteration: tokens delivered, completions, and checkpoint chunks streamed to
//! holders through the serving worker's network queue.

use super::super::events::{ReqIdx, SimEvent, WorkerIdx, secs_to_us};
use super::super::worker::EngineState;
use super::Sim;
use super::state::Piece;

impl Sim<'_> {
    pub(super) fn on_iteration_end(&mut self, w: WorkerIdx) -> crate::Result<()> {
        let mut outcomes = std::mem::take(&mut self.scratch.outcomes);
        outcomes.clear();
        self.workers[w].end_iteration(&mut outcomes);
        let mut pieces = Vec::new();
        for o in &outcomes {
            let r = o.req;
            self.reqs[r].context_tokens = o.context_tokens;
            if o.produced_token {
                self.deliver_token(r)?;
            }
            if o.finished {
                self.complete(r)?;
                continue;
            }
            pieces.extend(self.checkpoint_piece(r));
        }
        self.scratch.outcomes = outcomes;
        if !pieces.is_empty() {
            self.send_chunk(w, pieces);
        }
        self.kick(w)
    }

    /// Request `r` produced a token: delivered, and, when it is the first of this
    /// incarnation, reported to the controller as decoding.
    fn deliver_token(&mut self, r: ReqIdx) -> crate::Result<()> {
        let now = self.now();
        let st = &mut self.reqs[r];
        st.generated += 1;
        let first_of_incarnation = !st.decoding;
        st.decoding = true;
        let rec = &mut self.records[r];
        rec.delivered_tokens += 1;
        rec.first_token_us.get_or_insert(now);
        if rec.interrupted && rec.resumed_us.is_none() {
            rec.resumed_us = Some(now);
        }
        if let Some(row) = st.trace_row.take() {
            self.trace[row].marks.next_token_us = Some(now);
        }
        if first_of_incarnation {
            let epoch = self.reqs[r].epoch;
            self.shim.decoding_started(r, epoch, now)?;
        }
        Ok(())
    }

    /// The part of `r`'s KV to stream to its holder after this iteration: the whole context
    /// once decoding starts, then every `checkpoint_every_tokens` tokens.
    fn checkpoint_piece(&mut self, r: ReqIdx) -> Option<Piece> {
        let every = self.cfg.cluster.engine.checkpoint_every_tokens;
        let st = &mut self.reqs[r];
        let h = st.holder.filter(|_| st.decoding)?;
        let new = st.context_tokens.saturating_sub(st.ckpt_sent_tokens);
        if new == 0 || (st.ckpt_sent_tokens > 0 && new < every) {
            return None;
        }
        st.ckpt_sent_tokens = st.context_tokens;
        Some(Piece {
            req: r,
            holder: h,
            holder_gen: st.holder_gen,
            upto_tokens: st.context_tokens,
            bytes: u64::from(new) * self.kv_bytes,
        })
    }

    /// One chunk leaves `w` through its network queue (FIFO); the iteration that produced it
    /// pays the modelled share of its device-to-host copy.
    fn send_chunk(&mut self, w: WorkerIdx, pieces: Vec<Piece>) {
        let now = self.now();
        let bytes: u64 = pieces.iter().map(|p| p.bytes).sum();
        let hw = &self.cfg.cluster.hardware;
        let worker = &mut self.workers[w];
        let start = now.max(worker.net_free_at_us);
        let done = start + secs_to_us(bytes as f64 / hw.network_bytes_per_s);
        worker.net_free_at_us = done;
        worker.pending_stall_s +=
            hw.checkpoint_stall_fraction * bytes as f64 / hw.pcie_h2d_bytes_per_s;
        let incarnation = worker.incarnation;
        self.m.checkpoint_bytes += bytes;
        let chunk = self.ckpt.send(pieces);
        self.q.push(
            done,
            SimEvent::CheckpointDone {
                worker: w,
                incarnation,
                chunk,
            },
        );
    }

    pub(super) fn on_checkpoint_done(
        &mut self,
        w: WorkerIdx,
        incarnation: u32,
        chunk: usize,
    ) -> crate::Result<()> {
        let pieces = std::mem::take(&mut self.ckpt.chunks[chunk]);
        if self.workers[w].incarnation != incarnation {
            return Ok(()); // the sender died: chunks in flight are lost
        }
        let now = self.now();
        for p in pieces {
            let st = &self.reqs[p.req];
            if st.done || st.holder != Some(p.holder) || st.holder_gen != p.holder_gen {
                continue;
            }
            if self.workers[p.holder].phase == EngineState::Down {
                continue;
            }
            let epoch = st.epoch;
            let st = &mut self.reqs[p.req];
            st.ckpt_tokens = p.upto_tokens;
            st.ckpt_bytes += p.bytes;
            self.ckpt.store(p.holder, p.bytes);
            let (total, generated) = (st.ckpt_bytes, st.generated);
            self.shim
                .checkpoint_stored(p.req, epoch, generated, p.upto_tokens, total, now)?;
        }
        Ok(())
    }

    pub(super) fn drop_checkpoint(&mut self, r: ReqIdx) {
        let st = &mut self.reqs[r];
        if let Some(h) = st.holder {
            self.ckpt.release(h, st.ckpt_bytes);
        }
        st.ckpt_bytes = 0;
        st.ckpt_tokens = 0;
        st.ckpt_sent_tokens = 0;
        st.holder_gen += 1;
    }

    pub(super) fn complete(&mut self, r: ReqIdx) -> crate::Result<()> {
        let now = self.now();
        let spec = self.workload[r];
        assert_eq!(
            self.reqs[r].generated, spec.output_tokens,
            "request {r} completes with all its tokens"
        );
        self.drop_checkpoint(r);
        let st = &mut self.reqs[r];
        st.done = true;
        st.holder = None;
        st.worker = None;
        self.records[r].finish_us = Some(now);
        self.progress.outstanding -= 1;
        let epoch = self.reqs[r].epoch;
        self.shim.finished(r, epoch, spec.output_tokens, now)
    }

    pub(super) fn fail_request(&mut self, r: ReqIdx, why: String) {
        if self.reqs[r].done {
            return;
        }
        self.drop_checkpoint(r);
        let st = &mut self.reqs[r];
        st.done = true;
        st.holder = None;
        st.worker = None;
        self.records[r].failed = Some(why);
        // A request that never arrived (time cap) was never outstanding.
        if r < self.progress.arrived {
            self.progress.outstanding -= 1;
        }
    }
}
