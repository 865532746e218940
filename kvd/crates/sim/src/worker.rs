//! One serving worker: a waiting queue, a running batch, a GPU KV budget, and the iteration
//! time model.
//!
//! The engine batches at iteration level (Orca/vLLM style) with chunked prefill (Sarathi
//! style): every iteration carries one decode token for each decoding request, plus up to
//! `prefill_chunk_tokens` prompt tokens shared first-come-first-served among prefilling
//! requests. The last prefill chunk of a request also produces its first output token.
//!
//! An iteration takes
//!
//! ```text
//! max(floor, base + per_token x tokens_in_batch)                 (weights, GEMMs)
//!   + sum of decoding contexts x KV bytes per token / HBM bw       (decode attention)
//! ```
//!
//! divided by the assist speed-up while a recovering worker drafts for this one, plus the part of
//! the last iteration's checkpoint copy that did not overlap with compute.
//!
//! Admission reserves a request's whole final context in GPU KV (prompt + output), so the
//! model has no preemption; a request waits in the queue (head of line) until it fits and the
//! batch has room.

use std::collections::VecDeque;

use super::config::{ClusterConfig, ModelConfig};
use super::events::{ReqIdx, SimTime};

/// The time of one iteration, in seconds, before assist and checkpoint stalls.
///
/// `batch_tokens` are all tokens the iteration computes (prefill chunk + one per decoding
/// request); `decode_context_tokens` the sum of the decoding requests' context lengths.
pub fn iteration_time_s(
    model: &ModelConfig,
    hbm_bytes_per_s: f64,
    batch_tokens: u64,
    decode_context_tokens: u64,
) -> f64 {
    let compute = model
        .iter_floor_s
        .max(model.iter_base_s + model.iter_per_token_s * batch_tokens as f64);
    let attention =
        decode_context_tokens as f64 * model.kv_bytes_per_token() as f64 / hbm_bytes_per_s;
    compute + attention
}

/// Where a worker is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum EngineState {
    /// Serving with the full model.
    Serving,
    /// Dead, or restarting without a draft (reloading the full model).
    Down,
    /// Restarted, loading a small draft model first (Lumen).
    LoadingDraft,
    /// Drafting for a survivor while the full model loads (Lumen).
    Assist,
    /// Swapping the draft for the full model (Lumen).
    Hotswap,
}

/// A request waiting for a place in the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Waiting {
    /// The request.
    pub req: ReqIdx,
    /// Tokens still to prefill (the prompt, or the missing suffix after a restore).
    pub prefill_tokens: u32,
    /// Tokens whose KV is already present (restored from a checkpoint).
    pub context_tokens: u32,
    /// Output tokens still to generate.
    pub to_generate: u32,
    /// GPU KV tokens to reserve on admission (the request's final context).
    pub kv_need_tokens: u32,
    /// When it joined this worker's queue (for the queueing delay q_w).
    pub enqueued_us: SimTime,
}

/// A request in the running batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    /// The request.
    pub req: ReqIdx,
    /// Tokens still to prefill; 0 once decoding.
    pub prefill_remaining: u32,
    /// Tokens whose KV is on the GPU.
    pub context_tokens: u32,
    /// Output tokens still to generate.
    pub to_generate: u32,
    /// GPU KV tokens reserved.
    pub kv_reserved_tokens: u32,
    /// Prefill tokens this slot computes in the iteration in flight.
    pub prefill_in_flight: u32,
    /// A restored request: its suffix prefill goes before new prompts.
    pub resumed: bool,
}

/// What one request got from an iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotOutcome {
    /// The request.
    pub req: ReqIdx,
    /// Prefill tokens computed in this iteration.
    pub prefilled: u32,
    /// Whether this iteration produced an output token (a decode step, or the last prefill
    /// chunk).
    pub produced_token: bool,
    /// Whether the request is done (it produced its last token); its KV is freed.
    pub finished: bool,
    /// Tokens whose KV is on the GPU after the iteration.
    pub context_tokens: u32,
}

/// A request admitted into the batch at the start of an iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admitted {
    /// The request.
    pub req: ReqIdx,
    /// How long it waited in this worker's queue.
    pub waited_us: SimTime,
}

/// One worker's state.
#[derive(Debug)]
pub struct Worker {
    /// Its index.
    pub idx: usize,
    /// Its phase.
    pub phase: EngineState,
    /// Bumped at every failure: events from an earlier incarnation are dropped.
    pub incarnation: u32,
    /// Requests waiting for the batch, in order.
    pub waiting: VecDeque<Waiting>,
    /// Restored requests waiting for the batch; admitted before [`Worker::waiting`].
    pub resumed: VecDeque<Waiting>,
    /// The running batch.
    pub batch: Vec<Slot>,
    /// GPU KV tokens reserved by the batch.
    pub kv_used_tokens: u64,
    /// GPU KV tokens available.
    pub kv_budget_tokens: u64,
    /// Whether an iteration is in flight.
    pub busy: bool,
    /// When the network queue is free again (checkpoint chunks go out in order).
    pub net_free_at_us: SimTime,
    /// When the host-to-GPU copy engine is free again (restores go in in order).
    pub pcie_free_at_us: SimTime,
    /// Seconds of checkpoint copy that stall the next iteration.
    pub pending_stall_s: f64,
    /// Divisor of the iteration time (> 1 while a recovering worker assists this one).
    pub speedup: f64,
    /// Iterations run.
    pub iterations: u64,
}

impl Worker {
    /// A serving worker with an empty queue.
    pub fn new(idx: usize, kv_budget_tokens: u64) -> Self {
        Worker {
            idx,
            phase: EngineState::Serving,
            incarnation: 0,
            waiting: VecDeque::new(),
            resumed: VecDeque::new(),
            batch: Vec::new(),
            kv_used_tokens: 0,
            kv_budget_tokens,
            busy: false,
            net_free_at_us: 0,
            pcie_free_at_us: 0,
            pending_stall_s: 0.0,
            speedup: 1.0,
            iterations: 0,
        }
    }

    /// Requests on this worker (waiting or running).
    pub fn load_requests(&self) -> usize {
        self.waiting.len() + self.resumed.len() + self.batch.len()
    }

    /// Whether it takes work.
    pub fn is_serving(&self) -> bool {
        self.phase == EngineState::Serving
    }

    /// Kills the worker: every request on it is returned (batch first, then the queue), its KV is
    /// gone, and its incarnation moves on so in-flight events are dropped.
    pub fn fail(&mut self) -> Vec<ReqIdx> {
        let mut lost: Vec<ReqIdx> = self.batch.iter().map(|s| s.req).collect();
        lost.extend(self.resumed.iter().map(|w| w.req));
        lost.extend(self.waiting.iter().map(|w| w.req));
        self.batch.clear();
        self.resumed.clear();
        self.waiting.clear();
        self.kv_used_tokens = 0;
        self.busy = false;
        self.pending_stall_s = 0.0;
        self.speedup = 1.0;
        self.incarnation += 1;
        self.phase = EngineState::Down;
        lost
    }

    /// Admits waiting requests (in order, stopping at the first that does not fit) and plans
    /// the next iteration. Returns its duration in seconds and who was admitted, or `None` when
    /// there is nothing to compute.
    pub fn begin_iteration(
        &mut self,
        cfg: &ClusterConfig,
        now_us: SimTime,
        admitted: &mut Vec<Admitted>,
    ) -> Option<f64> {
        debug_assert!(!self.busy, "one iteration at a time");
        if !self.is_serving() {
            return None;
        }
        self.admit_from_queues(cfg.engine.max_batch_requests as usize, now_us, admitted);
        let (tokens, decode_context) = self.schedule_tokens(cfg.engine.prefill_chunk_tokens);
        if tokens == 0 {
            return None;
        }
        let t = iteration_time_s(
            &cfg.model,
            cfg.worker_hbm_bytes_per_s(),
            tokens,
            decode_context,
        ) / self.speedup
            + self.pending_stall_s;
        self.pending_stall_s = 0.0;
        self.busy = true;
        self.iterations += 1;
        Some(t)
    }

    /// Moves requests from the queues into the batch (restored ones first, then new ones,
    /// first come first served) while the batch has room and the head's final context fits
    /// the GPU KV budget (head of line: a request that does not fit waits).
    fn admit_from_queues(&mut self, cap: usize, now_us: SimTime, admitted: &mut Vec<Admitted>) {
        while self.batch.len() < cap {
            let from_resumed = !self.resumed.is_empty();
            let queue = if from_resumed {
                &self.resumed
            } else {
                &self.waiting
            };
            let Some(head) = queue.front() else {
                break;
            };
            if self.kv_used_tokens + u64::from(head.kv_need_tokens) > self.kv_budget_tokens {
                assert!(
                    !self.batch.is_empty(),
                    "request {} needs {} KV tokens, more than the whole GPU budget {}",
                    head.req,
                    head.kv_need_tokens,
                    self.kv_budget_tokens
                );
                break;
            }
            let w = if from_resumed {
                self.resumed.pop_front()
            } else {
                self.waiting.pop_front()
            }
            .expect("head exists");
            self.kv_used_tokens += u64::from(w.kv_need_tokens);
            admitted.push(Admitted {
                req: w.req,
                waited_us: now_us.saturating_sub(w.enqueued_us),
            });
            self.batch.push(Slot {
                req: w.req,
                prefill_remaining: w.prefill_tokens,
                context_tokens: w.context_tokens,
                to_generate: w.to_generate,
                kv_reserved_tokens: w.kv_need_tokens,
                prefill_in_flight: 0,
                resumed: from_resumed,
            });
        }
    }

    /// What the next iteration computes: one token per decoding request and up to `budget`
    /// prefill tokens, restored requests' suffixes first (they are running requests), then
    /// new prompts in batch order. Returns (tokens in the batch, decode context tokens).
    fn schedule_tokens(&mut self, mut budget: u32) -> (u64, u64) {
        let mut tokens = 0u64;
        let mut decode_context = 0u64;
        for pass_resumed in [true, false] {
            for s in self.batch.iter_mut().filter(|s| s.resumed == pass_resumed) {
                if s.prefill_remaining == 0 {
                    tokens += 1;
                    decode_context += u64::from(s.context_tokens);
                    s.prefill_in_flight = 0;
                } else {
                    let take = s.prefill_remaining.min(budget);
                    budget -= take;
                    tokens += u64::from(take);
                    s.prefill_in_flight = take;
                }
            }
        }
        (tokens, decode_context)
    }

    /// Applies the iteration in flight: prefill chunks land, decoding requests get a token,
    /// finished requests leave the batch and free their KV.
    pub fn end_iteration(&mut self, out: &mut Vec<SlotOutcome>) {
        debug_assert!(self.busy, "an iteration was in flight");
        self.busy = false;
        for s in &mut self.batch {
            let mut produced = false;
            let prefilled = s.prefill_in_flight;
            if s.prefill_remaining == 0 {
                // A decode step: one token, whose KV joins the context.
                produced = true;
                s.context_tokens += 1;
            } else if prefilled > 0 {
                s.prefill_remaining -= prefilled;
                s.context_tokens += prefilled;
                produced = s.prefill_remaining == 0;
            }
            s.prefill_in_flight = 0;
            if produced {
                debug_assert!(s.to_generate > 0, "a finished request is not in the batch");
                s.to_generate -= 1;
            }
            out.push(SlotOutcome {
                req: s.req,
                prefilled,
                produced_token: produced,
                finished: s.to_generate == 0,
                context_tokens: s.context_tokens,
            });
        }
        let mut freed = 0u64;
        self.batch.retain(|s| {
            if s.to_generate == 0 {
                freed += u64::from(s.kv_reserved_tokens);
                false
            } else {
                true
            }
        });
        self.kv_used_tokens -= freed;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    #[test]
    fn a_small_batch_costs_the_iteration_floor() {
        let m = ModelConfig::qwen3_14b();
        assert!(close(iteration_time_s(&m, 2.8e12, 1, 0), 10.8e-3));
        let m = ModelConfig::qwen3_32b();
        assert!(close(iteration_time_s(&m, 5.6e12, 100, 0), 13.1e-3));
    }

    #[test]
    fn a_large_batch_costs_its_tokens_plus_the_attention_reads() {
        let m = ModelConfig::qwen3_14b();
        // 512 prefill + 128 decode tokens: 640 x 0.042 ms = 26.88 ms.
        assert!(close(iteration_time_s(&m, 2.8e12, 640, 0), 26.88e-3));
        // 128 decoders at 1,000 tokens of context: 128,000 x 163,840 B / 2.8 TB/s = 7.4898 ms
        // on top of the 10.8 ms floor.
        let t = iteration_time_s(&m, 2.8e12, 128, 128_000);
        assert!(close(t, 10.8e-3 + 128_000.0 * 163_840.0 / 2.8e12), "{t}");
        // 32B: 5.0 ms + 0.048 ms x 300 = 19.4 ms.
        let m = ModelConfig::qwen3_32b();
        assert!(close(iteration_time_s(&m, 5.6e12, 300, 0), 19.4e-3));
    }

    fn waiting(req: ReqIdx, prompt: u32, output: u32) -> Waiting {
        Waiting {
            req,
            prefill_tokens: prompt,
            context_tokens: 0,
            to_generate: output,
            kv_need_tokens: prompt + output,
            enqueued_us: 0,
        }
    }

    #[test]
    fn chunked_prefill_splits_a_prompt_and_its_last_chunk_yields_the_first_token() {
        let cfg = ClusterConfig::new(2, ModelConfig::qwen3_14b());
        let mut w = Worker::new(0, cfg.gpu_kv_budget_tokens());
        w.waiting.push_back(waiting(0, 1200, 2));
        let mut adm = Vec::new();
        let mut out = Vec::new();
        let mut times = Vec::new();
        let mut produced = Vec::new();
        for _ in 0..5 {
            let Some(t) = w.begin_iteration(&cfg, 0, &mut adm) else {
                break;
            };
            times.push(t);
            out.clear();
            w.end_iteration(&mut out);
            produced.push(out[0].produced_token);
        }
        // 512 + 512 + 176 prompt tokens, then one decode step at 1,200 tokens of context.
        let decode = 10.8e-3 + 1200.0 * 163_840.0 / 2.8e12;
        let expected = [21.504e-3, 21.504e-3, 10.8e-3, decode];
        assert_eq!(times.len(), 4);
        for (t, e) in times.iter().zip(expected) {
            assert!(close(*t, e), "{t} vs {e}");
        }
        assert_eq!(produced, vec![false, false, true, true]);
        assert!(w.batch.is_empty());
        assert_eq!(w.kv_used_tokens, 0);
    }

    #[test]
    fn admission_stops_at_the_batch_cap_and_the_kv_budget() {
        let mut cfg = ClusterConfig::new(2, ModelConfig::qwen3_14b());
        cfg.engine.max_batch_requests = 3;
        let mut w = Worker::new(0, 10_000);
        for r in 0..5 {
            w.waiting.push_back(waiting(r, 1000, 100));
        }
        let mut adm = Vec::new();
        w.begin_iteration(&cfg, 0, &mut adm).unwrap();
        assert_eq!(adm.len(), 3, "the batch cap");
        let mut out = Vec::new();
        w.end_iteration(&mut out);
        let mut w = Worker::new(0, 2_500);
        for r in 0..5 {
            w.waiting.push_back(waiting(r, 1000, 100));
        }
        adm.clear();
        w.begin_iteration(&cfg, 0, &mut adm).unwrap();
        assert_eq!(adm.len(), 2, "the KV budget: 2 x 1,100 tokens fit in 2,500");
    }

    #[test]
    fn a_failed_worker_returns_all_its_requests_and_forgets_its_kv() {
        let cfg = ClusterConfig::new(2, ModelConfig::qwen3_14b());
        let mut w = Worker::new(0, cfg.gpu_kv_budget_tokens());
        for r in 0..3 {
            w.waiting.push_back(waiting(r, 100, 10));
        }
        let mut adm = Vec::new();
        w.begin_iteration(&cfg, 0, &mut adm).unwrap();
        w.waiting.push_back(waiting(9, 100, 10));
        w.resumed.push_back(waiting(8, 100, 10));
        let lost = w.fail();
        assert_eq!(lost, vec![0, 1, 2, 8, 9]);
        assert_eq!(w.kv_used_tokens, 0);
        assert_eq!(w.incarnation, 1);
        assert_eq!(w.phase, EngineState::Down);
    }
}
