//! The recovery trace accounts for every interruption: one row per interrupted request, whose
//! three parts add up to the stall the metrics measure, and whose kind says why it loaded what
//! it loaded.

use kvd::control::PolicyKind;
use kvd::sim::trace::RecoveryKind;
use kvd::sim::workload::{WorkloadConfig, generate};
use kvd::sim::{ClusterConfig, FailureSpec, ModelConfig, RunConfig, RunOutput, run};

const SEED: u64 = 11;

fn failure_run(policy: PolicyKind, failed: Vec<usize>) -> RunOutput {
    let mut cluster = ClusterConfig::new(4, ModelConfig::qwen3_14b());
    // A short restart keeps the test fast; the recovery is the same.
    cluster.hardware.reload_init_s = 2.0;
    cluster.hardware.reload_bytes_per_s = 29.5e9;
    let wl = generate(
        &WorkloadConfig {
            rate_per_s: 30.0,
            duration_s: 12.0,
            seed: SEED,
        },
        100_000,
    )
    .unwrap();
    let failures = vec![FailureSpec {
        at_s: 6.0,
        workers: failed,
    }];
    run(&RunConfig::new(cluster, policy, failures), &wl).unwrap()
}

#[test]
fn every_interrupted_request_has_one_row_whose_parts_add_up_to_its_stall() {
    for policy in PolicyKind::ALL {
        for failed in [vec![1], vec![0, 1]] {
            let out = failure_run(policy, failed.clone());
            let interrupted: Vec<usize> = (0..out.records.len())
                .filter(|&r| out.records[r].interrupted)
                .collect();
            assert!(!interrupted.is_empty(), "{policy} {failed:?} (seed {SEED})");
            let mut rows: Vec<usize> = out.trace.iter().map(|t| t.req).collect();
            rows.sort_unstable();
            assert_eq!(
                rows, interrupted,
                "{policy} {failed:?}: one row each (seed {SEED})"
            );
            for t in &out.trace {
                let rec = &out.records[t.req];
                assert!(
                    failed.contains(&t.server),
                    "{policy}: served by a failed worker"
                );
                let Some(resumed_us) = rec.resumed_us else {
                    continue; // failed, or never produced a token after the failure
                };
                let stall = (resumed_us as f64 / 1e6) - t.failure_s;
                assert!(
                    (t.stall_s - stall).abs() < 2e-6,
                    "{policy} req {}: trace stall {} vs measured {stall} (seed {SEED})",
                    t.req,
                    t.stall_s
                );
                let parts = t.restore_s + t.queue_s + t.prefill_s;
                assert!(
                    (parts - t.stall_s).abs() < 3e-6,
                    "{policy} req {}: restore + queue + prefill = {parts}, stall {}",
                    t.req,
                    t.stall_s
                );
                assert_eq!(t.load_tokens + t.prefill_tokens, t.history_tokens);
            }
        }
    }
}

#[test]
fn the_kind_of_each_row_says_why_it_loaded_what_it_loaded() {
    // StopRestart checkpoints nothing: every row is a recomputation without a holder.
    let out = failure_run(PolicyKind::StopRestart, vec![1]);
    assert!(
        out.trace
            .iter()
            .all(|t| t.kind == RecoveryKind::NoHolder && t.load_tokens == 0 && t.holder.is_none())
    );
    // With checkpoints and one failure no holder failed: rows that load KV are restores, and
    // the rest had no checkpoint yet.
    let out = failure_run(PolicyKind::FixedRing, vec![1]);
    for t in &out.trace {
        assert!(!t.holder_failed);
        match t.kind {
            RecoveryKind::LocalRestore => assert_eq!(t.target, t.holder),
            RecoveryKind::RemoteRestore => assert_ne!(t.target, t.holder),
            RecoveryKind::NoCheckpointYet => assert_eq!(t.load_tokens, 0),
            k => panic!("unexpected kind {k:?} with one failure (seed {SEED})"),
        }
    }
    assert!(
        out.trace
            .iter()
            .any(|t| t.kind == RecoveryKind::LocalRestore)
    );
    // Two adjacent failures on a ring: worker 0's holder is worker 1, so its requests recompute
    // because their holder failed too.
    let out = failure_run(PolicyKind::FixedRing, vec![0, 1]);
    assert!(
        out.trace
            .iter()
            .any(|t| t.server == 0 && t.holder == Some(1) && t.kind == RecoveryKind::HolderFailed)
    );
}
