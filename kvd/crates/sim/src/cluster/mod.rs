//! The cluster: workers, a router, checkpoint streaming, failures and recovery, driven by one
//! event loop. Every decision about checkpoints and recovery comes from the real control shim
//! ([`kvd_control::Controller`]) through [`super::shim::Shim`]; this file only carries them
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

//!
//! The rooms: `state.rs` (what the simulator keeps per request, per checkpoint and about the
//! run's progress), `arrivals.rs` (routing, admission, starting iterations), `iterations.rs`
//! (tokens, completions, checkpoint streaming), `failures.rs` (interruptions and restores),
//! `restarts.rs` (a failed worker's way back), `summary.rs` (samples and the run's metrics).

use serde::Serialize;

use super::config::ClusterConfig;
use super::events::{EventQueue, ReqIdx, SimEvent, SimTime, WorkerIdx, secs_to_us};
use super::metrics::{RequestOutcome, RunMetrics, SeriesPoint};
use super::shim::Shim;
use super::trace::RecoveryTrace;
use super::worker::Worker;
use super::workload::RequestSpec;
use kvd_control::PolicyKind;

mod arrivals;
mod failures;
mod iterations;
mod restarts;
mod state;
mod summary;

use state::{Checkpoints, Progress, ReqSim, Scratch};

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
    pub policy: PolicyKind,
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
    pub fn new(cluster: ClusterConfig, policy: PolicyKind, failures: Vec<FailureSpec>) -> Self {
        RunConfig {
            cluster,
            policy,
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
    pub records: Vec<RequestOutcome>,
    /// Samples, one per `sample_every_s`.
    pub series: Vec<SeriesPoint>,
    /// One row per interruption of a request, in the order they happened.
    pub trace: Vec<RecoveryTrace>,
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
    records: Vec<RequestOutcome>,
    shim: Shim,
    ckpt: Checkpoints,
    /// Requests that arrived while no worker served, in arrival order.
    backlog: std::collections::VecDeque<ReqIdx>,
    /// Assist pairs: recovering worker -> survivor it drafts for.
    assisting: Vec<Option<WorkerIdx>>,
    progress: Progress,
    series: Vec<SeriesPoint>,
    m: RunMetrics,
    scratch: Scratch,
    trace: Vec<RecoveryTrace>,
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
            q.push(first.arrival_us, SimEvent::Arrival(0));
        }
        let mut failures = cfg.failures.clone();
        failures.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
        for f in failures {
            let mut ws = f.workers.clone();
            ws.sort_unstable();
            ws.dedup();
            q.push(secs_to_us(f.at_s), SimEvent::Failure(ws));
        }
        q.push(0, SimEvent::Sample);
        Ok(Sim {
            cfg,
            workload,
            kv_bytes: cfg.cluster.model.kv_bytes_per_token(),
            q,
            workers: (0..n).map(|i| Worker::new(i, kv_budget)).collect(),
            reqs: vec![ReqSim::default(); workload.len()],
            records: workload
                .iter()
                .map(|r| RequestOutcome {
                    arrival_us: r.arrival_us,
                    output_tokens: r.output_tokens,
                    ..Default::default()
                })
                .collect(),
            shim,
            ckpt: Checkpoints::new(n),
            backlog: Default::default(),
            assisting: vec![None; n],
            progress: Progress::default(),
            series: Vec::new(),
            m: RunMetrics::default(),
            scratch: Scratch::default(),
            trace: Vec::new(),
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
                SimEvent::Arrival(r) => self.on_arrival(r)?,
                SimEvent::IterationEnd {
                    worker,
                    incarnation,
                } => {
                    if self.workers[worker].incarnation == incarnation {
                        self.on_iteration_end(worker)?;
                    }
                }
                SimEvent::CheckpointDone {
                    worker,
                    incarnation,
                    chunk,
                } => self.on_checkpoint_done(worker, incarnation, chunk)?,
                SimEvent::Failure(ws) => self.on_failure(&ws)?,
                SimEvent::RestoreDone {
                    req,
                    worker,
                    incarnation,
                    epoch,
                } => self.on_restore_done(req, worker, incarnation, epoch)?,
                SimEvent::DraftReady {
                    worker,
                    incarnation,
                } if self.workers[worker].incarnation == incarnation => {
                    self.on_draft_ready(worker)?
                }
                SimEvent::ReloadDone {
                    worker,
                    incarnation,
                } if self.workers[worker].incarnation == incarnation => {
                    self.on_reload_done(worker)?
                }
                SimEvent::HotswapDone {
                    worker,
                    incarnation,
                } if self.workers[worker].incarnation == incarnation => {
                    self.on_hotswap_done(worker)?
                }
                // A phase event of an earlier incarnation (the worker failed again): stale.
                SimEvent::DraftReady { .. }
                | SimEvent::ReloadDone { .. }
                | SimEvent::HotswapDone { .. } => {}
                SimEvent::Sample => self.on_sample(),
            }
            if self.progress.all_done(self.workload.len()) {
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
}
