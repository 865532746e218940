//! The built-in experiments. Each compares Lumen, FixedRing and StopRestart on identical
//! seeds and arrivals (one workload per scenario, generated before any policy runs):
//!
//! - **a**: one failure; 4 workers of Qwen3-32B (TP 2) and 8 workers of Qwen3-14B.
//! - **b**: 1, 2, 3 and 4 simultaneous failures on 8 workers (14B).
//! - **c**: one failure on 8 workers (14B) at 50 %, 70 % and 85 % of measured saturation.
//! - **d**: 25 % of the workers failing at once, for 4, 8, 16, 32 and 64 workers (14B).
//! - **v**: one failure, for 4, 8, 16, 32 and 64 workers (14B): StopRestart's failure impact
//!   against the published measurements (docs/SIMULATION.md, "Validation").
//!
//! Load is a fraction of the *measured* saturation: a two-worker cluster of the same model is
//! overloaded (arrivals at several times its capacity) and its completion rate after warm-up is
//! the per-worker saturation throughput ([`measure_saturation`]). The failed workers of a
//! scenario are drawn from the seed (the same draw for every policy).

use std::collections::BTreeMap;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use super::cluster::{FailureSpec, RunConfig, RunOutput, run};
use super::config::{ClusterConfig, ModelConfig};
use super::metrics::{RunMetrics, Spread};
use super::trace::RecoveryTrace;
use super::workload::{self, WorkloadConfig};
use kvd_control::PolicyKind;

/// The policies every experiment compares by default, in table order (the baseline last):
/// Lumen with the per-server placement of docs/CONTROL.md, the first (mean) rule it replaced,
/// the fixed ring, and stop-and-restart.
pub const POLICIES: [PolicyKind; 4] = [
    PolicyKind::Lumen,
    PolicyKind::LumenMean,
    PolicyKind::FixedRing,
    PolicyKind::StopRestart,
];

/// The policy every table compares against.
pub const BASELINE: PolicyKind = PolicyKind::StopRestart;

/// Which experiment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum Experiment {
    /// One failure, two cluster shapes.
    A,
    /// 1 to 4 simultaneous failures.
    B,
    /// Load sweep.
    C,
    /// Scale sweep, 25 % failing.
    D,
    /// Validation: one failure, 4 to 64 workers (StopRestart's failure impact against the
    /// published measurements).
    V,
    /// The set-up of the experiment on real processes (benches/python/lumen_load.py): 4
    /// workers, one failure and two at once.
    L,
}

impl Experiment {
    /// All of them, in order.
    pub const ALL: [Experiment; 6] = [
        Experiment::A,
        Experiment::B,
        Experiment::C,
        Experiment::D,
        Experiment::V,
        Experiment::L,
    ];

    /// Its one-letter name.
    pub fn name(self) -> &'static str {
        match self {
            Experiment::A => "a",
            Experiment::B => "b",
            Experiment::C => "c",
            Experiment::D => "d",
            Experiment::V => "v",
            Experiment::L => "l",
        }
    }

    /// A one-line description.
    pub fn title(self) -> &'static str {
        match self {
            Experiment::A => "one failure: 4 workers (Qwen3-32B, TP 2) and 8 workers (Qwen3-14B)",
            Experiment::B => "1, 2, 3, 4 simultaneous failures on 8 workers (Qwen3-14B)",
            Experiment::C => "one failure on 8 workers (Qwen3-14B) at 50/70/85 % of saturation",
            Experiment::D => "25 % of workers failing, 4 to 64 workers (Qwen3-14B)",
            Experiment::V => "validation: one failure, 4 to 64 workers (Qwen3-14B)",
            Experiment::L => {
                "the set-up on real processes: one and two failures on 4 workers (Qwen3-14B)"
            }
        }
    }

    /// Parses `a`, `b`, `c`, `d`.
    ///
    /// # Errors
    /// [`crate::Error::InvalidArgument`] naming the choices.
    pub fn parse(s: &str) -> crate::Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "a" => Ok(Experiment::A),
            "b" => Ok(Experiment::B),
            "c" => Ok(Experiment::C),
            "d" => Ok(Experiment::D),
            "v" => Ok(Experiment::V),
            "l" => Ok(Experiment::L),
            _ => Err(crate::Error::InvalidArgument(format!(
                "unknown experiment {s:?}; choose a, b, c, d, v, l or all"
            ))),
        }
    }
}

/// Knobs shared by all experiments.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SweepConfig {
    /// The seed of every workload and every failure draw.
    pub seed: u64,
    /// Arrivals run from 0 to this many simulated seconds.
    pub duration_s: f64,
    /// The failure happens at this simulated second.
    pub failure_at_s: f64,
    /// Load as a fraction of measured saturation (experiments a, b, d).
    pub load: f64,
    /// Largest cluster in experiment d.
    pub max_workers_d: u32,
    /// Events one run may take.
    pub max_events: u64,
    /// Requests one workload may hold.
    pub max_requests: usize,
    /// Each scenario runs with this many seeds (`seed`, `seed + 1`, ...; each seed draws its own
    /// arrivals and its own failed workers), and reports the mean of each metric over them.
    pub repeats: u32,
    /// Overrides the hardware's assist speed-up (Lumen's ASSIST phase), for sensitivity runs.
    pub assist_speedup: Option<f64>,
    /// The policies to run, in table order (must include [`BASELINE`]).
    pub policies: Vec<PolicyKind>,
    /// Keep every run's recovery trace (one row per interrupted request) for `<exp>_trace.csv`.
    pub trace: bool,
}

impl SweepConfig {
    /// The policies this sweep runs, in table order.
    pub fn policies(&self) -> Vec<PolicyKind> {
        self.policies.clone()
    }
}

impl Default for SweepConfig {
    fn default() -> Self {
        SweepConfig {
            seed: 1,
            duration_s: 160.0,
            failure_at_s: 40.0,
            load: 0.7,
            max_workers_d: 64,
            max_events: 200_000_000,
            max_requests: 2_000_000,
            repeats: 10,
            assist_speedup: None,
            policies: POLICIES.to_vec(),
            trace: false,
        }
    }
}

/// One scenario: a cluster, a load, a failure; run once per policy.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Scenario {
    /// The experiment it belongs to.
    pub experiment: Experiment,
    /// A short label (`8w-14b`, `fail-3`, `load-85`).
    pub label: String,
    /// The cluster.
    pub cluster: ClusterConfig,
    /// Load as a fraction of measured saturation.
    pub load: f64,
    /// The failure(s).
    pub failures: Vec<FailureSpec>,
}

/// A scenario's results: one run per policy, in [`SweepConfig::policies`] order.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScenarioResult {
    /// The scenario.
    pub scenario: Scenario,
    /// Measured saturation of the whole cluster, requests per second.
    pub saturation_per_s: f64,
    /// The arrival rate used.
    pub rate_per_s: f64,
    /// Requests in one workload (the mean over the seeds).
    pub requests: usize,
    /// Seeds the metrics are averaged over.
    pub repeats: u32,
    /// One run per policy.
    pub runs: Vec<(PolicyKind, RunOutput)>,
    /// With [`SweepConfig::trace`]: each run's recovery trace, `(policy, seed, rows)`.
    pub traces: Vec<(PolicyKind, u64, Vec<RecoveryTrace>)>,
    /// Each policy's metrics per seed (what the spreads are computed from), in `runs` order.
    pub per_seed: Vec<(PolicyKind, Vec<RunMetrics>)>,
}

impl ScenarioResult {
    /// The metrics of `policy`.
    pub fn metrics(&self, policy: PolicyKind) -> Option<&RunMetrics> {
        self.runs
            .iter()
            .find(|(p, _)| *p == policy)
            .map(|(_, o)| &o.metrics)
    }

    /// The mean and 95 % interval over the seeds of `metric` for `policy` (default when the
    /// policy did not run).
    pub fn spread(&self, policy: PolicyKind, metric: impl Fn(&RunMetrics) -> f64) -> Spread {
        self.per_seed
            .iter()
            .find(|(p, _)| *p == policy)
            .map_or(Spread::default(), |(_, ms)| {
                Spread::of(&ms.iter().map(metric).collect::<Vec<_>>())
            })
    }
}

/// `k` distinct workers of `n`, drawn from the seed and the scenario label (sorted).
pub fn pick_failed(n: u32, k: u32, seed: u64, label: &str) -> Vec<usize> {
    let salt = blake3::hash(label.as_bytes());
    let salt = u64::from_le_bytes(salt.as_bytes()[..8].try_into().expect("8 bytes"));
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ salt);
    let mut v = rand::seq::index::sample(&mut rng, n as usize, k as usize).into_vec();
    v.sort_unstable();
    v
}

/// The failures of `scenario` in its run with `seed`: the same times and sizes, the workers
/// drawn again from `seed` (the first seed's draw is the scenario's own), so the repeats vary
/// which workers fail as well as the arrivals. Whether a failed worker's checkpoint holder
/// failed too depends on that draw (for a fixed ring: whether two failed workers are
/// neighbours), so one draw for every seed would make the comparison turn on it.
pub fn failures_for_seed(scenario: &Scenario, seed: u64) -> Vec<FailureSpec> {
    scenario
        .failures
        .iter()
        .map(|f| FailureSpec {
            at_s: f.at_s,
            workers: pick_failed(
                scenario.cluster.workers,
                f.workers.len() as u32,
                seed,
                &scenario.label,
            ),
        })
        .collect()
}

/// The scenarios of `exp`.
pub fn scenarios(exp: Experiment, sweep: &SweepConfig) -> Vec<Scenario> {
    let one = |label: &str, mut cluster: ClusterConfig, load: f64, k: u32| {
        if let Some(a) = sweep.assist_speedup {
            cluster.hardware.assist_speedup = a;
        }
        let workers = pick_failed(cluster.workers, k, sweep.seed, label);
        Scenario {
            experiment: exp,
            label: label.to_string(),
            cluster,
            load,
            failures: vec![FailureSpec {
                at_s: sweep.failure_at_s,
                workers,
            }],
        }
    };
    let c14 = |n| ClusterConfig::new(n, ModelConfig::qwen3_14b());
    match exp {
        Experiment::A => vec![
            one(
                "4w-32b",
                ClusterConfig::new(4, ModelConfig::qwen3_32b()),
                sweep.load,
                1,
            ),
            one("8w-14b", c14(8), sweep.load, 1),
        ],
        Experiment::B => (1..=4)
            .map(|k| one(&format!("fail-{k}"), c14(8), sweep.load, k))
            .collect(),
        Experiment::C => [0.5, 0.7, 0.85]
            .iter()
            .map(|&l| one(&format!("load-{:.0}", l * 100.0), c14(8), l, 1))
            .collect(),
        Experiment::D => [4u32, 8, 16, 32, 64]
            .iter()
            .filter(|&&n| n <= sweep.max_workers_d)
            .map(|&n| one(&format!("{n}w"), c14(n), sweep.load, (n / 4).max(1)))
            .collect(),
        Experiment::V => [4u32, 8, 16, 32, 64]
            .iter()
            .filter(|&&n| n <= sweep.max_workers_d)
            .map(|&n| one(&format!("{n}w-1f"), c14(n), sweep.load, 1))
            .collect(),
        Experiment::L => (1..=2)
            .map(|k| one(&format!("4w-{k}f"), c14(4), sweep.load, k))
            .collect(),
    }
}

/// Saturation throughput of one worker of `model`, requests per second: a two-worker cluster
/// under arrivals at several times its capacity, completions per second after a warm-up.
///
/// # Errors
/// Those of [`run`].
pub fn measure_saturation(model: &ModelConfig, seed: u64) -> crate::Result<f64> {
    let (warmup_s, window_s) = (20.0, 60.0);
    let cluster = ClusterConfig::new(2, model.clone());
    // Far above what one worker can do (about 10-20 requests/s for these models).
    let rate = 2.0 * 60.0;
    let wl = workload::generate(
        &WorkloadConfig {
            rate_per_s: rate,
            duration_s: window_s,
            seed: seed ^ 0x5a7,
        },
        1_000_000,
    )?;
    let mut cfg = RunConfig::new(cluster, PolicyKind::StopRestart, vec![]);
    cfg.drain_cap_s = 0.0;
    let out = run(&cfg, &wl)?;
    let lo = (warmup_s * 1e6) as u64;
    let hi = (window_s * 1e6) as u64;
    let done = out
        .records
        .iter()
        .filter(|r| r.finish_us.is_some_and(|t| t >= lo && t < hi))
        .count();
    Ok(done as f64 / (window_s - warmup_s) / 2.0)
}

/// Runs every policy of `scenario` on the same workloads (one per seed) at `load` x
/// saturation, and averages each policy's metrics and series over the seeds.
///
/// # Errors
/// Those of [`workload::generate`] and [`run`].
pub fn run_scenario(
    scenario: &Scenario,
    sweep: &SweepConfig,
    per_worker_saturation: f64,
) -> crate::Result<ScenarioResult> {
    let saturation = per_worker_saturation * f64::from(scenario.cluster.workers);
    let rate = saturation * scenario.load;
    let repeats = sweep.repeats.max(1);
    let workloads = (0..repeats)
        .map(|i| {
            workload::generate(
                &WorkloadConfig {
                    rate_per_s: rate,
                    duration_s: sweep.duration_s,
                    seed: sweep.seed.wrapping_add(u64::from(i)),
                },
                sweep.max_requests,
            )
        })
        .collect::<crate::Result<Vec<_>>>()?;
    let policies = sweep.policies();
    let mut jobs: Vec<(PolicyKind, usize, RunConfig)> = Vec::new();
    for &p in &policies {
        for w in 0..workloads.len() {
            let failures = failures_for_seed(scenario, sweep.seed.wrapping_add(w as u64));
            let mut c = RunConfig::new(scenario.cluster.clone(), p, failures);
            c.max_events = sweep.max_events;
            jobs.push((p, w, c));
        }
    }
    let mut results = run_jobs(&jobs, &workloads)?;
    let mut traces = Vec::new();
    for ((p, w, _), out) in jobs.iter().zip(&mut results) {
        let rows = std::mem::take(&mut out.trace);
        if sweep.trace {
            traces.push((*p, sweep.seed.wrapping_add(*w as u64), rows));
        }
    }
    let (runs, per_seed) = mean_by_policy(&policies, &jobs, results)?;
    let requests = workloads.iter().map(Vec::len).sum::<usize>() / workloads.len();
    Ok(ScenarioResult {
        scenario: scenario.clone(),
        saturation_per_s: saturation,
        rate_per_s: rate,
        requests,
        repeats,
        runs,
        traces,
        per_seed,
    })
}

/// Runs `f` on every job on a few threads. Each run is independent and deterministic on its
/// own; the results are in the order of `jobs`, whatever the threads do.
fn parallel<J: Sync, R: Send>(jobs: &[J], f: impl Fn(&J) -> R + Sync) -> Vec<R> {
    let threads = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .clamp(1, 8);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut results: Vec<Option<R>> = Vec::new();
    results.resize_with(jobs.len(), || None);
    let slots = std::sync::Mutex::new(&mut results);
    std::thread::scope(|s| {
        for _ in 0..threads.min(jobs.len()) {
            s.spawn(|| {
                // Bounded: each thread takes jobs until none is left.
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(job) = jobs.get(i) else {
                        break;
                    };
                    let r = f(job);
                    slots.lock().expect("no thread panics holding the lock")[i] = Some(r);
                }
            });
        }
    });
    results
        .into_iter()
        .map(|r| r.expect("every job ran"))
        .collect()
}

/// Runs every `(policy, workload index, config)` job. Each run with failures is measured
/// against the twin of its workload: the same arrivals without failures and without
/// checkpoints (StopRestart: a plain engine), run once per workload, so every policy's
/// failure impact has the same denominator (and includes what its checkpointing costs).
fn run_jobs(
    jobs: &[(PolicyKind, usize, RunConfig)],
    workloads: &[Vec<workload::RequestSpec>],
) -> crate::Result<Vec<RunOutput>> {
    let twin_jobs: Vec<usize> = (0..workloads.len()).collect();
    let twins = parallel(&twin_jobs, |&w| {
        let Some((_, _, cfg)) = jobs.iter().find(|(_, jw, _)| *jw == w) else {
            return Ok(None);
        };
        let twin = RunConfig {
            max_events: cfg.max_events,
            ..RunConfig::new(cfg.cluster.clone(), PolicyKind::StopRestart, Vec::new())
        };
        run(&twin, &workloads[w]).map(Some)
    })
    .into_iter()
    .collect::<crate::Result<Vec<Option<RunOutput>>>>()?;
    parallel(jobs, |(_, w, cfg)| {
        let mut out = run(cfg, &workloads[*w])?;
        if let (Some(twin), Some(from_s)) = (
            &twins[*w],
            cfg.failures.iter().map(|f| f.at_s).reduce(f64::min),
        ) {
            let from_us = super::events::secs_to_us(from_s);
            let last_arrival_us = workloads[*w].last().map_or(from_us, |r| r.arrival_us);
            let to_us = if out.metrics.capacity_restore_s > 0.0 {
                from_us + super::events::secs_to_us(out.metrics.capacity_restore_s)
            } else {
                last_arrival_us.max(from_us)
            };
            out.metrics.window =
                super::metrics::window_metrics(&out.records, &twin.records, from_us, to_us);
        }
        out.records = Vec::new(); // reports use the metrics and the series
        Ok(out)
    })
    .into_iter()
    .collect()
}

/// Each policy's metrics and series averaged over its runs (one per seed), in `policies` order.
fn mean_by_policy(
    policies: &[PolicyKind],
    jobs: &[(PolicyKind, usize, RunConfig)],
    results: Vec<RunOutput>,
) -> crate::Result<PolicyRuns> {
    let mut by_policy: BTreeMap<usize, (Vec<RunMetrics>, Vec<Vec<super::metrics::SeriesPoint>>)> =
        BTreeMap::new();
    for ((p, _, _), out) in jobs.iter().zip(results) {
        let idx = policies
            .iter()
            .position(|q| q == p)
            .expect("a known policy");
        let e = by_policy.entry(idx).or_default();
        e.0.push(out.metrics);
        e.1.push(out.series);
    }
    let mut runs = Vec::new();
    let mut per_seed = Vec::new();
    for (idx, (metrics, series)) in by_policy {
        runs.push((
            policies[idx],
            RunOutput {
                metrics: super::metrics::mean_metrics(&metrics),
                records: Vec::new(),
                series: super::metrics::mean_series(&series),
                trace: Vec::new(),
            },
        ));
        per_seed.push((policies[idx], metrics));
    }
    Ok((runs, per_seed))
}

/// Each policy's mean run, and its metrics per seed.
type PolicyRuns = (
    Vec<(PolicyKind, RunOutput)>,
    Vec<(PolicyKind, Vec<RunMetrics>)>,
);

/// Runs `exps` in order, calling `progress` with a line before each scenario. Saturation is
/// measured once per model.
///
/// # Errors
/// The first error of any run.
pub fn run_experiments(
    exps: &[Experiment],
    sweep: &SweepConfig,
    mut progress: impl FnMut(&str),
) -> crate::Result<BTreeMap<Experiment, Vec<ScenarioResult>>> {
    let mut saturation: BTreeMap<&'static str, f64> = BTreeMap::new();
    let mut out = BTreeMap::new();
    for &exp in exps {
        let mut results = Vec::new();
        for sc in scenarios(exp, sweep) {
            let name = sc.cluster.model.name;
            let sat = match saturation.get(name) {
                Some(s) => *s,
                None => {
                    progress(&format!("measuring saturation of one {name} worker"));
                    let s = measure_saturation(&sc.cluster.model, sweep.seed)?;
                    progress(&format!("  {name}: {s:.2} requests/s per worker"));
                    saturation.insert(name, s);
                    s
                }
            };
            progress(&format!(
                "experiment {} / {}: {} workers, load {:.0} %, failing {:?}",
                exp.name(),
                sc.label,
                sc.cluster.workers,
                sc.load * 100.0,
                sc.failures.iter().map(|f| &f.workers).collect::<Vec<_>>()
            ));
            let started = std::time::Instant::now();
            let r = run_scenario(&sc, sweep, sat)?;
            progress(&format!(
                "  {} requests x {} policies x {} seeds in {:.1} s",
                r.requests,
                r.runs.len(),
                r.repeats,
                started.elapsed().as_secs_f64()
            ));
            results.push(r);
        }
        out.insert(exp, results);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_workers_are_drawn_from_the_seed_and_are_distinct() {
        let a = pick_failed(64, 16, 3, "64w");
        assert_eq!(a, pick_failed(64, 16, 3, "64w"));
        assert_eq!(a.len(), 16);
        assert!(a.windows(2).all(|w| w[0] < w[1]));
        assert_ne!(a, pick_failed(64, 16, 4, "64w"));
    }

    #[test]
    fn experiment_d_fails_a_quarter_of_the_workers() {
        let s = scenarios(Experiment::D, &SweepConfig::default());
        let shape: Vec<(u32, usize)> = s
            .iter()
            .map(|s| (s.cluster.workers, s.failures[0].workers.len()))
            .collect();
        assert_eq!(shape, vec![(4, 1), (8, 2), (16, 4), (32, 8), (64, 16)]);
    }
}
