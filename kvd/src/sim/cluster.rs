//! The cluster: workers, a router, checkpoint streaming, failures and recovery, driven by one
//! event loop. Every decision about checkpoints and recovery comes from the real control shim
//! ([`crate::control::Controller`]) through [`super::shim::Shim`]; this file only carries them
//! out and keeps time.
//!
//! What happens, in order:
//!
//! 1. **Arrival.** The router sends the request to the serving worker with the fewest requests
//!    (waiting or running; lowest index on ties). The controller admits it and names its
//!    checkpoint holder (or none).
//! 2. **Iterations.** Each worker runs iterations back to back while it has work
//!    ([`super::worker`]). After a request's prefill, and then every `k` decoded tokens, the
//!    new KV goes to its holder through the serving worker's network queue (one chunk per
//!    iteration, FIFO, at the network bandwidth). A chunk counts at the holder only when its
//!    transfer is done; chunks in flight when the sender dies are lost.
//! 3. **Failure.** The failed workers' requests are interrupted and the controller plans their
//!    recovery. Each plan is carried out: the checkpointed prefix is read from its holder
//!    (over the holder's network queue when the holder is not the target), copied host-to-GPU
//!    over the target's PCIe queue, and the request rejoins the target's batch (ahead of new
//!    work) to prefill the missing suffix; that prefill yields its next token.
//! 4. **Restart.** A failed worker reloads: without phases it is down for `init + weights /
//!    reload bw`; with Lumen's phases it loads a draft model (LOADING_DRAFT), assists the
//!    survivor the controller pairs it with (ASSIST: that survivor's iterations speed up),
//!    swaps the full model in (HOTSWAP) and serves again (FULL_SERVICE).
//!
//! Every loop is bounded: the event queue has a cap, and simulated time past the last arrival
//! has a cap after which unfinished requests are reported failed.

use serde::Serialize;

use super::config::ClusterConfig;
use super::contenders::SimPolicy;
use super::events::{Event, EventQueue, ReqIdx, SimTime, WorkerIdx, secs_to_us, us_to_secs};
use super::metrics::{Latencies, RequestRecord, RunMetrics, SeriesPoint};
use super::shim::{Shim, ShimRestore};
use super::worker::{Admitted, SlotOutcome, Waiting, Worker, WorkerPhase};
use super::workload::RequestSpec;
use crate::control::PolicyKind;

/// A set of workers failing at one moment.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FailureSpec {
    /// When, in simulated seconds.
    pub at_s: f64,
    /// Which workers (indices).
    pub workers: Vec<usize>,
}

/// One run: a cluster, a policy, failures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunConfig {
    /// The cluster.
    pub cluster: ClusterConfig,
    /// The policy the control shim runs.
    pub policy: SimPolicy,
    /// Failures, in any order.
    pub failures: Vec<FailureSpec>,
    /// Non-interrupted requests in the system during `[failure, failure + window]` are the
    /// bystanders.
    pub bystander_window_s: f64,
    /// Simulated seconds after the last arrival before unfinished requests are failed.
    pub drain_cap_s: f64,
    /// Events a run may take at most.
    pub max_events: u64,
    /// Seconds between samples of the cluster (queue depth, host memory).
    pub sample_every_s: f64,
}

impl RunConfig {
    /// A run of `policy` on `cluster` with `failures` and default limits.
    pub fn new(
        cluster: ClusterConfig,
        policy: impl Into<SimPolicy>,
        failures: Vec<FailureSpec>,
    ) -> Self {
        RunConfig {
            cluster,
            policy: policy.into(),
            failures,
            bystander_window_s: 60.0,
            drain_cap_s: 600.0,
            max_events: 200_000_000,
            sample_every_s: 1.0,
        }
    }
}

/// What a run produced.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunOutput {
    /// The summary.
    pub metrics: RunMetrics,
    /// One record per request, in arrival order.
    pub records: Vec<RequestRecord>,
    /// Samples, one per `sample_every_s`.
    pub series: Vec<SeriesPoint>,
}

/// Simulator-side state of a request.
#[derive(Debug, Clone, Default)]
struct ReqSim {
    /// The controller's epoch for it.
    epoch: u64,
    /// Bumped at every interruption: restore events of an older one are dropped.
    incarnation: u64,
    /// Where it runs (or is being restored to).
    worker: Option<WorkerIdx>,
    /// Its checkpoint holder.
    holder: Option<WorkerIdx>,
    /// Bumped when the holder changes: chunks for an older holder are dropped.
    holder_gen: u64,
    /// Tokens the holder has (transfer done).
    ckpt_tokens: u32,
    /// Tokens sent or being sent to the holder.
    ckpt_sent_tokens: u32,
    /// Host bytes it occupies at its holder.
    ckpt_bytes: u64,
    /// Output tokens generated (delivered) so far.
    generated: u32,
    /// Tokens whose KV is on its current worker's GPU.
    context_tokens: u32,
    /// Whether its current incarnation has produced a token (decoding started).
    decoding: bool,
    /// Completed or failed.
    done: bool,
}

/// One request's part of a checkpoint chunk.
#[derive(Debug, Clone, Copy)]
struct Piece {
    req: ReqIdx,
    holder: WorkerIdx,
    holder_gen: u64,
    upto_tokens: u32,
    bytes: u64,
}

/// Runs one policy over `workload`.
///
/// # Errors
/// [`crate::Error::InvalidArgument`] for a bad configuration, [`crate::Error::Deadline`] when
/// the event cap is reached, and any error the control shim returns (a bug in the driver).
pub fn run(cfg: &RunConfig, workload: &[RequestSpec]) -> crate::Result<RunOutput> {
    cfg.cluster.validate()?;
    if !(cfg.sample_every_s.is_finite() && cfg.sample_every_s >= 0.001) {
        return Err(crate::Error::InvalidArgument(format!(
            "sample_every_s {} must be at least 0.001 s",
            cfg.sample_every_s
        )));
    }
    for f in &cfg.failures {
        if f.workers.iter().any(|&w| w >= cfg.cluster.workers as usize) {
            return Err(crate::Error::InvalidArgument(format!(
                "failure at {} s names a worker outside 0..{}",
                f.at_s, cfg.cluster.workers
            )));
        }
        if !(f.at_s.is_finite() && f.at_s >= 0.0) {
            return Err(crate::Error::InvalidArgument(format!(
                "failure time {} s must be a non-negative number",
                f.at_s
            )));
        }
    }
    let mut sim = Sim::new(cfg, workload)?;
    sim.run()?;
    Ok(sim.finish())
}

struct Sim<'a> {
    cfg: &'a RunConfig,
    workload: &'a [RequestSpec],
    kv_bytes: u64,
    q: EventQueue,
    workers: Vec<Worker>,
    reqs: Vec<ReqSim>,
    records: Vec<RequestRecord>,
    shim: Shim,
    chunks: Vec<Vec<Piece>>,
    host_bytes: Vec<u64>,
    peak_host_bytes: Vec<u64>,
    /// Requests that arrived while no worker served, in arrival order.
    backlog: std::collections::VecDeque<ReqIdx>,
    /// Assist pairs: recovering worker -> survivor it drafts for.
    assisting: Vec<Option<WorkerIdx>>,
    outstanding: usize,
    arrived: usize,
    first_failure_us: Option<SimTime>,
    capacity_restored_us: Option<SimTime>,
    down: usize,
    series: Vec<SeriesPoint>,
    m: RunMetrics,
    // Scratch buffers, reused across iterations.
    admitted: Vec<Admitted>,
    outcomes: Vec<SlotOutcome>,
}

impl<'a> Sim<'a> {
    fn new(cfg: &'a RunConfig, workload: &'a [RequestSpec]) -> crate::Result<Self> {
        let n = cfg.cluster.workers as usize;
        let kv_budget = cfg.cluster.gpu_kv_budget_tokens();
        let shim = Shim::new(cfg.policy, &cfg.cluster)?;
        let mut q = EventQueue::new(cfg.max_events);
        for (i, r) in workload.iter().enumerate() {
            debug_assert_eq!(r.id, i, "the workload is indexed in arrival order");
        }
        // Arrivals are scheduled lazily (one at a time) to keep the heap small.
        if let Some(first) = workload.first() {
            q.push(first.arrival_us, Event::Arrival(0));
        }
        let mut failures = cfg.failures.clone();
        failures.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
        for f in failures {
            let mut ws = f.workers.clone();
            ws.sort_unstable();
            ws.dedup();
            q.push(secs_to_us(f.at_s), Event::Failure(ws));
        }
        q.push(0, Event::Sample);
        Ok(Sim {
            cfg,
            workload,
            kv_bytes: cfg.cluster.model.kv_bytes_per_token(),
            q,
            workers: (0..n).map(|i| Worker::new(i, kv_budget)).collect(),
            reqs: vec![ReqSim::default(); workload.len()],
            records: workload
                .iter()
                .map(|r| RequestRecord {
                    arrival_us: r.arrival_us,
                    output_tokens: r.output_tokens,
                    ..Default::default()
                })
                .collect(),
            shim,
            chunks: Vec::new(),
            host_bytes: vec![0; n],
            peak_host_bytes: vec![0; n],
            backlog: Default::default(),
            assisting: vec![None; n],
            outstanding: 0,
            arrived: 0,
            first_failure_us: None,
            capacity_restored_us: None,
            down: 0,
            series: Vec::new(),
            m: RunMetrics::default(),
            admitted: Vec::new(),
            outcomes: Vec::new(),
        })
    }

    fn now(&self) -> SimTime {
        self.q.now()
    }

    fn run(&mut self) -> crate::Result<()> {
        let last_arrival = self.workload.last().map_or(0, |r| r.arrival_us);
        let cap_us = last_arrival + secs_to_us(self.cfg.drain_cap_s);
        // Bounded by the event cap (EventQueue::pop) and the simulated-time cap.
        while let Some((t, ev)) = self.q.pop()? {
            if t > cap_us {
                break;
            }
            match ev {
                Event::Arrival(r) => self.on_arrival(r)?,
                Event::IterationEnd {
                    worker,
                    incarnation,
                } => {
                    if self.workers[worker].incarnation == incarnation {
                        self.on_iteration_end(worker)?;
                    }
                }
                Event::CheckpointDone {
                    worker,
                    incarnation,
                    chunk,
                } => self.on_checkpoint_done(worker, incarnation, chunk)?,
                Event::Failure(ws) => self.on_failure(&ws)?,
                Event::RestoreDone {
                    req,
                    worker,
                    incarnation,
                    epoch,
                } => self.on_restore_done(req, worker, incarnation, epoch)?,
                Event::DraftReady {
                    worker,
                    incarnation,
                } if self.workers[worker].incarnation == incarnation => {
                    self.on_draft_ready(worker)?
                }
                Event::ReloadDone {
                    worker,
                    incarnation,
                } if self.workers[worker].incarnation == incarnation => {
                    self.on_reload_done(worker)?
                }
                Event::HotswapDone {
                    worker,
                    incarnation,
                } if self.workers[worker].incarnation == incarnation => {
                    self.on_hotswap_done(worker)?
                }
                // A phase event of an earlier incarnation (the worker failed again): stale.
                Event::DraftReady { .. } | Event::ReloadDone { .. } | Event::HotswapDone { .. } => {
                }
                Event::Sample => self.on_sample(),
            }
            if self.outstanding == 0 && self.arrived == self.workload.len() && self.down == 0 {
                break;
            }
        }
        // Whatever is left did not finish within the cap.
        for r in 0..self.reqs.len() {
            if !self.reqs[r].done {
                self.fail_request(r, "not finished by the simulated-time cap".into());
            }
        }
        Ok(())
    }

    // ---- arrivals and routing -------------------------------------------------------------

    fn on_arrival(&mut self, r: ReqIdx) -> crate::Result<()> {
        self.arrived += 1;
        self.outstanding += 1;
        if let Some(next) = self.workload.get(r + 1) {
            self.q.push(next.arrival_us, Event::Arrival(r + 1));
        }
        match self.route() {
            Some(w) => self.admit(r, w),
            None => {
                self.backlog.push_back(r);
                Ok(())
            }
        }
    }

    /// The serving worker with the fewest requests, lowest index on ties.
    fn route(&self) -> Option<WorkerIdx> {
        self.workers
            .iter()
            .filter(|w| w.is_serving())
            .min_by_key(|w| (w.load_requests(), w.idx))
            .map(|w| w.idx)
    }

    fn reserve_bytes(&self, r: ReqIdx) -> u64 {
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

    fn admit(&mut self, r: ReqIdx, w: WorkerIdx) -> crate::Result<()> {
        let spec = self.workload[r];
        let now = self.now();
        let adm = self.shim.admit(r, w, &spec, self.reserve_bytes(r), now)?;
        if adm.holder.is_none() && self.cfg.policy.kind() != PolicyKind::StopRestart {
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
    fn kick(&mut self, w: WorkerIdx) -> crate::Result<()> {
        if self.workers[w].busy {
            return Ok(());
        }
        let now = self.now();
        self.admitted.clear();
        let Some(t) = self.workers[w].begin_iteration(&self.cfg.cluster, now, &mut self.admitted)
        else {
            return Ok(());
        };
        for i in 0..self.admitted.len() {
            let a = self.admitted[i];
            self.shim
                .prefill_started(a.req, self.reqs[a.req].epoch, now)?;
        }
        let incarnation = self.workers[w].incarnation;
        self.q.push(
            now + secs_to_us(t),
            Event::IterationEnd {
                worker: w,
                incarnation,
            },
        );
        Ok(())
    }

    // ---- iterations and checkpoints -------------------------------------------------------

    fn on_iteration_end(&mut self, w: WorkerIdx) -> crate::Result<()> {
        let now = self.now();
        let mut outcomes = std::mem::take(&mut self.outcomes);
        outcomes.clear();
        self.workers[w].end_iteration(&mut outcomes);
        let every = self.cfg.cluster.engine.checkpoint_every_tokens;
        let mut pieces = Vec::new();
        for o in &outcomes {
            let r = o.req;
            self.reqs[r].context_tokens = o.context_tokens;
            if o.produced_token {
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
                if first_of_incarnation {
                    let epoch = self.reqs[r].epoch;
                    self.shim.decoding_started(r, epoch, now)?;
                }
            }
            if o.finished {
                self.complete(r)?;
                continue;
            }
            // Checkpoint: the whole context once decoding starts, then every `every` tokens.
            let st = &mut self.reqs[r];
            if let (Some(h), true) = (st.holder, st.decoding) {
                let new = st.context_tokens.saturating_sub(st.ckpt_sent_tokens);
                if new > 0 && (st.ckpt_sent_tokens == 0 || new >= every) {
                    st.ckpt_sent_tokens = st.context_tokens;
                    pieces.push(Piece {
                        req: r,
                        holder: h,
                        holder_gen: st.holder_gen,
                        upto_tokens: st.context_tokens,
                        bytes: u64::from(new) * self.kv_bytes,
                    });
                }
            }
        }
        self.outcomes = outcomes;
        if !pieces.is_empty() {
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
            self.chunks.push(pieces);
            self.q.push(
                done,
                Event::CheckpointDone {
                    worker: w,
                    incarnation,
                    chunk: self.chunks.len() - 1,
                },
            );
        }
        self.kick(w)
    }

    fn on_checkpoint_done(
        &mut self,
        w: WorkerIdx,
        incarnation: u32,
        chunk: usize,
    ) -> crate::Result<()> {
        let pieces = std::mem::take(&mut self.chunks[chunk]);
        if self.workers[w].incarnation != incarnation {
            return Ok(()); // the sender died: chunks in flight are lost
        }
        let now = self.now();
        for p in pieces {
            let st = &self.reqs[p.req];
            if st.done || st.holder != Some(p.holder) || st.holder_gen != p.holder_gen {
                continue;
            }
            if self.workers[p.holder].phase == WorkerPhase::Down {
                continue;
            }
            let epoch = st.epoch;
            let st = &mut self.reqs[p.req];
            st.ckpt_tokens = p.upto_tokens;
            st.ckpt_bytes += p.bytes;
            self.host_bytes[p.holder] += p.bytes;
            self.peak_host_bytes[p.holder] =
                self.peak_host_bytes[p.holder].max(self.host_bytes[p.holder]);
            let (total, generated) = (st.ckpt_bytes, st.generated);
            self.shim
                .checkpoint_stored(p.req, epoch, generated, p.upto_tokens, total, now)?;
        }
        Ok(())
    }

    fn drop_checkpoint(&mut self, r: ReqIdx) {
        let st = &mut self.reqs[r];
        if let Some(h) = st.holder {
            self.host_bytes[h] -= st.ckpt_bytes;
        }
        st.ckpt_bytes = 0;
        st.ckpt_tokens = 0;
        st.ckpt_sent_tokens = 0;
        st.holder_gen += 1;
    }

    fn complete(&mut self, r: ReqIdx) -> crate::Result<()> {
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
        self.outstanding -= 1;
        let epoch = self.reqs[r].epoch;
        self.shim.finished(r, epoch, spec.output_tokens, now)
    }

    fn fail_request(&mut self, r: ReqIdx, why: String) {
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
        if r < self.arrived {
            self.outstanding -= 1;
        }
    }

    // ---- failures and recovery ------------------------------------------------------------

    fn on_failure(&mut self, ws: &[WorkerIdx]) -> crate::Result<()> {
        let now = self.now();
        let ws: Vec<WorkerIdx> = ws
            .iter()
            .copied()
            .filter(|&w| self.workers[w].phase == WorkerPhase::Serving)
            .collect();
        if ws.is_empty() {
            return Ok(());
        }
        self.first_failure_us.get_or_insert(now);
        self.capacity_restored_us = None;
        for &w in &ws {
            self.workers[w].fail();
            self.down += 1;
            // An assist pair the failed worker was part of ends.
            for a in 0..self.assisting.len() {
                if self.assisting[a] == Some(w) {
                    self.assisting[a] = None;
                }
            }
            // Checkpoints it held are gone.
            self.host_bytes[w] = 0;
        }
        let failed = |w: Option<WorkerIdx>| w.is_some_and(|w| ws.contains(&w));
        // Interrupted: every live request on a failed worker (queued, running, or restoring).
        let mut interrupted = Vec::new();
        for r in 0..self.reqs.len() {
            let st = &mut self.reqs[r];
            if st.done {
                continue;
            }
            if failed(st.holder) {
                st.holder = None;
                st.ckpt_bytes = 0; // its host memory died with the holder
                st.ckpt_tokens = 0;
                st.ckpt_sent_tokens = 0;
                st.holder_gen += 1;
            }
            if failed(st.worker) {
                interrupted.push(r);
            }
        }
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
        // Every interrupted request got a plan or failed.
        for &r in &interrupted {
            assert!(
                self.reqs[r].done || self.reqs[r].worker.is_some(),
                "request {r} was interrupted and got neither a restore nor a failure"
            );
        }
        // Restart the failed workers.
        for &w in &ws {
            let inc = self.workers[w].incarnation;
            if self.shim.uses_recovery_phases() {
                self.workers[w].phase = WorkerPhase::LoadingDraft;
                let c = &self.cfg.cluster;
                let t = c.hardware.reload_init_s
                    + c.model.draft_weights_bytes as f64 / c.hardware.reload_bytes_per_s;
                self.q.push(
                    now + secs_to_us(t),
                    Event::DraftReady {
                        worker: w,
                        incarnation: inc,
                    },
                );
            } else {
                let t = self.cfg.cluster.reload_s();
                self.q.push(
                    now + secs_to_us(t),
                    Event::ReloadDone {
                        worker: w,
                        incarnation: inc,
                    },
                );
            }
        }
        Ok(())
    }

    fn start_restore(&mut self, p: ShimRestore) -> crate::Result<()> {
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
        let (incarnation, epoch) = (self.workers[p.target].incarnation, st.incarnation);
        self.q.push(
            ready,
            Event::RestoreDone {
                req: r,
                worker: p.target,
                incarnation,
                epoch,
            },
        );
        Ok(())
    }

    fn on_restore_done(
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

    // ---- restarting workers ---------------------------------------------------------------

    fn on_draft_ready(&mut self, w: WorkerIdx) -> crate::Result<()> {
        let now = self.now();
        self.workers[w].phase = WorkerPhase::Assist;
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
            Event::ReloadDone {
                worker: w,
                incarnation: inc,
            },
        );
        Ok(())
    }

    fn on_reload_done(&mut self, w: WorkerIdx) -> crate::Result<()> {
        let now = self.now();
        if self.shim.uses_recovery_phases() {
            self.workers[w].phase = WorkerPhase::Hotswap;
            self.shim.worker_hotswap(w, now)?;
            let inc = self.workers[w].incarnation;
            self.q.push(
                now + secs_to_us(self.cfg.cluster.hardware.hotswap_s),
                Event::HotswapDone {
                    worker: w,
                    incarnation: inc,
                },
            );
            return Ok(());
        }
        self.back_in_service(w)
    }

    fn on_hotswap_done(&mut self, w: WorkerIdx) -> crate::Result<()> {
        if let Some(partner) = self.assisting[w].take() {
            self.workers[partner].speedup = 1.0;
        }
        self.back_in_service(w)
    }

    fn back_in_service(&mut self, w: WorkerIdx) -> crate::Result<()> {
        let now = self.now();
        self.workers[w].phase = WorkerPhase::Serving;
        self.shim.worker_recovered(w, now)?;
        self.down -= 1;
        if self.down == 0 {
            self.capacity_restored_us = Some(now);
        }
        // Bounded by the backlog's length.
        while let Some(r) = self.backlog.pop_front() {
            let target = self.route().expect("a worker serves now");
            self.admit(r, target)?;
        }
        Ok(())
    }

    fn on_sample(&mut self) {
        let now = self.now();
        self.series.push(SeriesPoint {
            t_s: us_to_secs(now),
            ttft_mean_s: 0.0,
            queued: self
                .workers
                .iter()
                .map(|w| w.waiting.len() + w.resumed.len())
                .sum::<usize>()
                + self.backlog.len(),
            host_bytes: self.host_bytes.iter().sum(),
        });
        if self.outstanding > 0 || self.arrived < self.workload.len() || self.down > 0 {
            self.q
                .push(now + secs_to_us(self.cfg.sample_every_s), Event::Sample);
        }
    }

    // ---- the summary ----------------------------------------------------------------------

    fn finish(mut self) -> RunOutput {
        let recs = &self.records;
        let m = &mut self.m;
        m.requests = recs.len();
        m.completed = recs.iter().filter(|r| r.finish_us.is_some()).count();
        m.failed = recs.iter().filter(|r| r.failed.is_some()).count();
        m.interrupted = recs.iter().filter(|r| r.interrupted).count();
        for (r, spec) in recs.iter().zip(self.workload) {
            if r.finish_us.is_some() {
                m.tokens_requested += u64::from(spec.output_tokens);
                m.tokens_delivered += u64::from(r.delivered_tokens);
            }
        }
        m.overall = Latencies::of(recs.iter(), |r| r.finish_us.is_some());
        m.interrupted_lat = Latencies::of(recs.iter(), |r| r.interrupted && r.finish_us.is_some());
        if let Some(f) = self.first_failure_us {
            let end = f + secs_to_us(self.cfg.bystander_window_s);
            let bystander = |r: &RequestRecord| {
                !r.interrupted && r.arrival_us <= end && r.finish_us.is_some_and(|t| t >= f)
            };
            m.bystanders = recs.iter().filter(|r| bystander(r)).count();
            m.bystander_lat = Latencies::of(recs.iter(), bystander);
            let stalls: Vec<f64> = recs
                .iter()
                .filter_map(|r| r.resumed_us)
                .map(|t| us_to_secs(t.saturating_sub(f)))
                .collect();
            m.recovery_s = stalls.iter().copied().fold(0.0, f64::max);
            m.stall = super::metrics::Summary::of(stalls);
            m.capacity_restore_s = self.capacity_restored_us.map_or(0.0, |t| us_to_secs(t - f));
        }
        m.peak_host_bytes_max = self.peak_host_bytes.iter().copied().max().unwrap_or(0);
        m.peak_host_bytes_mean = self.peak_host_bytes.iter().sum::<u64>() as f64
            / self.peak_host_bytes.len().max(1) as f64;
        m.makespan_s = recs
            .iter()
            .filter_map(|r| r.finish_us)
            .max()
            .map_or(0.0, us_to_secs);
        m.events = self.q.popped();
        // TTFT by arrival period (one per sample) into the series.
        let seconds = self.series.len();
        let by_second = super::metrics::ttft_by_arrival_period(
            recs,
            secs_to_us(self.cfg.sample_every_s),
            seconds,
        );
        for (p, t) in self.series.iter_mut().zip(by_second) {
            p.ttft_mean_s = t;
        }
        RunOutput {
            metrics: self.m,
            records: self.records,
            series: self.series,
        }
    }
}
