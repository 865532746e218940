//! `kvd sim`: the command line of the simulator.

use std::path::PathBuf;

use clap::{Args, Subcommand};

use super::experiments::{self, BASELINE, Experiment, SweepConfig};
use super::report;
use kvd_control::PolicyKind;

const SIM_HELP: &str = "\
A deterministic discrete-event model of an LLM serving cluster (iteration-level batching,
chunked prefill, GPU KV budget, checkpoint streaming, restores, worker restarts) that drives
kvd's real control shim. Each experiment runs the chosen policies (default: lumen,
lumen_mean, fixed_ring, stop_restart) on identical arrivals and writes CSV, a Markdown summary
and PNG plots. The model, its defaults and their
sources are in docs/SIMULATION.md.

Examples:
  kvd sim list                                  what each experiment runs
  kvd sim run --experiment a --out sim-out      one experiment (seconds)
  kvd sim run --experiment all --out docs/sim   the default sweep (1-2 minutes on 2 cores)
  kvd sim run -e b --trace --out /tmp/b         also b_trace.csv: where each interrupted
                                                request went and where its stall went
  kvd sim run -e b,c --seed 7 --load 0.85 --out /tmp/bc
  kvd sim run -e b --policies lumen,lumen_total,fixed_ring --out /tmp/b   placement variants
  kvd sim saturation                            measured requests/s of one worker per model

Same seed, same numbers: the CSV and Markdown are byte-identical across runs.";

/// Simulate a serving cluster whose workers fail, and compare recovery policies.
#[derive(Debug, Args)]
#[command(after_help = SIM_HELP)]
pub struct SimArgs {
    #[command(subcommand)]
    command: SimCommand,
}

#[derive(Debug, Subcommand)]
enum SimCommand {
    /// Run one experiment (a, b, c, d, v, l) or all of them and write the results.
    Run(RunArgs),
    /// List the built-in experiments and their scenarios.
    List,
    /// Measure the saturation throughput of one worker of each model.
    Saturation {
        /// Seed of the workload.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
}

#[derive(Debug, Args)]
struct RunArgs {
    /// Which experiment: a (one failure, 32B x4 and 14B x8), b (1-4 simultaneous failures),
    /// c (load 50/70/85 %), d (25 % failing at 4-64 workers), v (validation: one failure at
    /// 4-64 workers, StopRestart's failure impact against published measurements), l (the
    /// set-up of the experiment on real processes: 1 and 2 failures on 4 workers), or all.
    #[arg(short, long, default_value = "all")]
    experiment: String,
    /// Directory for the CSV, Markdown and PNG files (created if missing).
    #[arg(short, long, default_value = "sim-out")]
    out: PathBuf,
    /// Seed of every workload and failure draw: the same seed gives the same numbers.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Arrivals run for this many simulated seconds.
    #[arg(long, default_value_t = 160.0)]
    duration_s: f64,
    /// The failure happens at this simulated second.
    #[arg(long, default_value_t = 40.0)]
    failure_at_s: f64,
    /// Load as a fraction of measured saturation (experiments a, b, d).
    #[arg(long, default_value_t = 0.7)]
    load: f64,
    /// Largest cluster in experiment d (4, 8, 16, 32, 64).
    #[arg(long, default_value_t = 64)]
    max_workers_d: u32,
    /// Events one run may process before it stops with an error.
    #[arg(long, default_value_t = 200_000_000)]
    max_events: u64,
    /// Run each scenario with this many seeds (seed, seed+1, ...; each draws its arrivals and
    /// its failed workers) and report the means with their 95 % intervals.
    #[arg(long, default_value_t = 10)]
    repeats: u32,
    /// Divisor of a survivor's iteration time while a recovering worker drafts for it
    /// (Lumen's ASSIST phase; default 1.3). 1.0 turns the assist's effect off.
    #[arg(long)]
    assist_speedup: Option<f64>,
    /// The policies to compare, comma-separated, in table order; stop_restart (the baseline of
    /// every comparison) is added when missing. lumen: the per-server placement (docs/CONTROL.md;
    /// p_w = what w holds for this server + this request, over host-to-GPU
    /// bandwidth); lumen_mean: the first rule (the mean footprint w holds; herds);
    /// lumen_total: everything w holds + this request; fixed_ring: DejaVu's next worker;
    /// stop_restart: no checkpoints.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "lumen,lumen_mean,fixed_ring,stop_restart"
    )]
    policies: Vec<String>,
    /// Old name for adding lumen_total to --policies.
    #[arg(long, hide = true)]
    what_if_sum_placement: bool,
    /// Also write <exp>_trace.csv: one row per interrupted request of every run (policy, seed):
    /// where it resumed, what it loaded and recomputed and why, and its stall split into
    /// restore (copies), queue (waiting for a batch) and prefill (until its next token).
    #[arg(long)]
    trace: bool,
    /// Skip the PNG plots (CSV and Markdown only).
    #[arg(long)]
    no_plots: bool,
}

/// Runs `kvd sim ...`; progress goes to stderr, the summary table to stdout.
pub fn run(args: SimArgs) -> std::process::ExitCode {
    match dispatch(args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvd sim: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn dispatch(args: SimArgs) -> crate::Result<()> {
    match args.command {
        SimCommand::List => {
            let sweep = SweepConfig::default();
            for exp in Experiment::ALL {
                println!("{}: {}", exp.name(), exp.title());
                for s in experiments::scenarios(exp, &sweep) {
                    println!(
                        "    {:<8} {:>3} x {:<10} load {:>3.0} %  failing {:?} at {} s",
                        s.label,
                        s.cluster.workers,
                        s.cluster.model.name,
                        s.load * 100.0,
                        s.failures
                            .first()
                            .map(|f| f.workers.clone())
                            .unwrap_or_default(),
                        s.failures.first().map_or(0.0, |f| f.at_s)
                    );
                }
            }
            Ok(())
        }
        SimCommand::Saturation { seed } => {
            for m in [
                super::ModelConfig::qwen3_14b(),
                super::ModelConfig::qwen3_32b(),
            ] {
                let s = experiments::measure_saturation(&m, seed)?;
                println!("{}: {s:.2} requests/s per worker", m.name);
            }
            Ok(())
        }
        SimCommand::Run(a) => run_sweep(a),
    }
}

/// Refuses out-of-range knobs, naming the flag and what to give.
fn check_ranges(a: &RunArgs) -> crate::Result<()> {
    if !(1..=20).contains(&a.repeats) {
        return Err(crate::Error::InvalidArgument(format!(
            "--repeats {} is out of range; give 1 to 20 seeds per scenario",
            a.repeats
        )));
    }
    if let Some(x) = a.assist_speedup
        && !(1.0..=4.0).contains(&x)
    {
        return Err(crate::Error::InvalidArgument(format!(
            "--assist-speedup {x} is out of range; give 1.0 (no effect) to 4.0"
        )));
    }
    if !(a.load > 0.0 && a.load <= 1.5) {
        return Err(crate::Error::InvalidArgument(format!(
            "--load {} is out of range; give a fraction of saturation such as 0.7",
            a.load
        )));
    }
    if !(a.failure_at_s >= 0.0 && a.failure_at_s < a.duration_s) {
        return Err(crate::Error::InvalidArgument(format!(
            "--failure-at-s {} must fall within the arrivals (0 to --duration-s {})",
            a.failure_at_s, a.duration_s
        )));
    }
    Ok(())
}

/// The policies to run: those named, each once in the order first named, `lumen_total` added by
/// the old `--what-if-sum-placement`, and the baseline added when missing.
fn policies_of(a: &RunArgs) -> crate::Result<Vec<PolicyKind>> {
    let mut policies: Vec<PolicyKind> = a
        .policies
        .iter()
        .map(|p| p.parse::<PolicyKind>())
        .collect::<crate::Result<_>>()?;
    if a.what_if_sum_placement && !policies.contains(&PolicyKind::LumenTotal) {
        policies.insert(policies.len().saturating_sub(2), PolicyKind::LumenTotal);
    }
    // Each policy once, in the order first named.
    let mut seen = Vec::new();
    policies.retain(|p| {
        let first = !seen.contains(p);
        seen.push(*p);
        first
    });
    if !policies.contains(&BASELINE) {
        policies.push(BASELINE);
    }
    Ok(policies)
}

fn run_sweep(a: RunArgs) -> crate::Result<()> {
    let exps: Vec<Experiment> = if a.experiment.eq_ignore_ascii_case("all") {
        Experiment::ALL.to_vec()
    } else {
        a.experiment
            .split(',')
            .map(|s| Experiment::parse(s.trim()))
            .collect::<crate::Result<_>>()?
    };
    check_ranges(&a)?;
    let policies = policies_of(&a)?;
    let sweep = SweepConfig {
        seed: a.seed,
        duration_s: a.duration_s,
        failure_at_s: a.failure_at_s,
        load: a.load,
        max_workers_d: a.max_workers_d,
        max_events: a.max_events,
        repeats: a.repeats,
        assist_speedup: a.assist_speedup,
        policies,
        trace: a.trace,
        ..SweepConfig::default()
    };
    let started = std::time::Instant::now();
    eprintln!(
        "kvd sim: experiments {} with seed {}, writing to {}",
        exps.iter().map(|e| e.name()).collect::<Vec<_>>().join(","),
        a.seed,
        a.out.display()
    );
    let all = experiments::run_experiments(&exps, &sweep, |line| eprintln!("[sim] {line}"))?;
    let (files, notes) = report::write_all(&a.out, &all, !a.no_plots)?;
    for n in notes {
        eprintln!("kvd sim: note: {n}");
    }
    eprintln!(
        "kvd sim: done in {:.1} s; wrote {} files to {}",
        started.elapsed().as_secs_f64(),
        files.len(),
        a.out.display()
    );
    println!("{}", report::terminal_table(&all));
    println!(
        "(change against stop_restart in parentheses; full table in {})",
        a.out.join("summary.md").display()
    );
    Ok(())
}
