//! Without a failure the policies differ only by what checkpointing costs: the same requests
//! arrive, run on the same workers, and see the same latencies within that overhead.

use kvd_control::PolicyKind;
use kvd_sim::workload::{RequestSpec, WorkloadConfig, generate};
use kvd_sim::{ClusterConfig, ModelConfig, RunConfig, RunMetrics, run};

const POLICIES: [PolicyKind; 5] = PolicyKind::ALL;
/// Where StopRestart, the policy that never checkpoints, is in [`POLICIES`].
const STOP_RESTART: usize = 4;

#[test]
fn the_baseline_index_names_stop_restart() {
    assert_eq!(POLICIES[STOP_RESTART], PolicyKind::StopRestart);
}

fn workload(seed: u64) -> Vec<RequestSpec> {
    generate(
        &WorkloadConfig {
            rate_per_s: 40.0,
            duration_s: 30.0,
            seed,
        },
        100_000,
    )
    .unwrap()
}

fn runs(cluster: &ClusterConfig, wl: &[RequestSpec]) -> Vec<RunMetrics> {
    POLICIES
        .iter()
        .map(|&p| {
            run(&RunConfig::new(cluster.clone(), p, vec![]), wl)
                .unwrap()
                .metrics
        })
        .collect()
}

#[test]
fn with_a_free_checkpoint_copy_and_no_failure_every_policy_gives_identical_latencies() {
    let mut cluster = ClusterConfig::new(4, ModelConfig::qwen3_14b());
    cluster.hardware.checkpoint_stall_fraction = 0.0;
    let wl = workload(9);
    let m = runs(&cluster, &wl);
    for (p, x) in POLICIES.iter().zip(&m) {
        assert_eq!(x.completed, wl.len(), "{p:?}");
        assert_eq!(
            x.overall, m[STOP_RESTART].overall,
            "{p:?}: the same latencies as StopRestart"
        );
    }
    for (p, x) in POLICIES.iter().zip(&m) {
        if *p != PolicyKind::StopRestart {
            assert!(x.checkpoint_bytes > 0, "{p:?} checkpoints");
        }
    }
    assert_eq!(
        m[STOP_RESTART].checkpoint_bytes, 0,
        "StopRestart never checkpoints"
    );
}

#[test]
fn without_a_failure_every_policy_gives_the_same_latencies_within_checkpoint_overhead() {
    // The default model: 10 % of each checkpoint's device-to-host copy stalls the next
    // iteration. TPOT and end-to-end latency grow by that overhead only. TTFT depends on where
    // arrivals fall against iteration boundaries, and any change of timing reshuffles that: it
    // is compared with a wider band.
    let cluster = ClusterConfig::new(4, ModelConfig::qwen3_14b());
    for seed in [9, 10] {
        let wl = workload(seed);
        let m = runs(&cluster, &wl);
        let base = &m[STOP_RESTART];
        for (p, x) in POLICIES.iter().zip(&m).take(2) {
            assert_eq!(x.completed, wl.len(), "{p:?}");
            assert_eq!((x.interrupted, x.recomputed_tokens), (0, 0));
            for (what, a, b, lo, hi) in [
                (
                    "TPOT mean",
                    x.overall.tpot.mean,
                    base.overall.tpot.mean,
                    0.999,
                    1.03,
                ),
                (
                    "E2E mean",
                    x.overall.e2e.mean,
                    base.overall.e2e.mean,
                    0.999,
                    1.03,
                ),
                (
                    "TTFT mean",
                    x.overall.ttft.mean,
                    base.overall.ttft.mean,
                    0.9,
                    1.1,
                ),
            ] {
                assert!(
                    a >= b * lo && a <= b * hi,
                    "seed {seed} {p:?} {what}: {a} against StopRestart's {b}"
                );
            }
        }
    }
}
