//! Same seed, same numbers: the simulator's outputs are a function of its inputs only.

use kvd_sim::experiments::{Experiment, SweepConfig, run_experiments};
use kvd_sim::report::{metrics_csv, series_csv, summary_markdown};

fn short_sweep(seed: u64) -> SweepConfig {
    SweepConfig {
        seed,
        duration_s: 25.0,
        failure_at_s: 10.0,
        repeats: 2,
        ..SweepConfig::default()
    }
}

fn csv_of(seed: u64) -> (String, String, String) {
    let all = run_experiments(&[Experiment::A], &short_sweep(seed), |_| {}).unwrap();
    let a = &all[&Experiment::A];
    (
        metrics_csv(Experiment::A, a),
        series_csv(Experiment::A, a),
        summary_markdown(&all),
    )
}

#[test]
fn the_same_seed_gives_identical_csv() {
    let first = csv_of(3);
    let second = csv_of(3);
    assert_eq!(first.0, second.0, "metrics CSV");
    assert_eq!(first.1, second.1, "series CSV");
    assert_eq!(first.2, second.2, "Markdown summary");
    // One row per scenario and policy, plus the header.
    let sweep = short_sweep(3);
    let scenarios = kvd_sim::experiments::scenarios(Experiment::A, &sweep).len();
    assert_eq!(
        first.0.lines().count(),
        scenarios * sweep.policies().len() + 1
    );
}

#[test]
fn another_seed_gives_other_numbers() {
    assert_ne!(csv_of(3).0, csv_of(4).0);
}
