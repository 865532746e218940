//! Every request is accounted for, whatever the policy and however many workers fail.

use kvd_control::PolicyKind;
use kvd_sim::workload::{WorkloadConfig, generate};
use kvd_sim::{ClusterConfig, FailureSpec, ModelConfig, RunConfig, run};

fn small_cluster() -> ClusterConfig {
    let mut c = ClusterConfig::new(4, ModelConfig::qwen3_14b());
    // A short restart keeps the test fast; the model is the same.
    c.hardware.reload_init_s = 2.0;
    c.hardware.reload_bytes_per_s = 29.5e9;
    c
}

fn workload(rate: f64, seconds: f64, seed: u64) -> Vec<kvd_sim::workload::RequestSpec> {
    generate(
        &WorkloadConfig {
            rate_per_s: rate,
            duration_s: seconds,
            seed,
        },
        100_000,
    )
    .unwrap()
}

#[test]
fn every_request_completes_or_is_reported_failed_and_tokens_delivered_equal_tokens_requested() {
    let wl = workload(20.0, 20.0, 5);
    for policy in PolicyKind::ALL {
        for failed in [vec![1], vec![0, 1], vec![0, 1, 2]] {
            let cfg = RunConfig::new(
                small_cluster(),
                policy,
                vec![FailureSpec {
                    at_s: 8.0,
                    workers: failed.clone(),
                }],
            );
            let out = run(&cfg, &wl).unwrap();
            let m = &out.metrics;
            assert_eq!(m.requests, wl.len());
            assert_eq!(
                m.completed + m.failed,
                m.requests,
                "{policy:?} failing {failed:?}: every request completes or fails"
            );
            assert_eq!(
                m.tokens_delivered, m.tokens_requested,
                "{policy:?} {failed:?}"
            );
            for (r, spec) in out.records.iter().zip(&wl) {
                match (&r.finish_us, &r.failed) {
                    (Some(_), None) => assert_eq!(r.delivered_tokens, spec.output_tokens),
                    (None, Some(_)) => assert!(r.delivered_tokens <= spec.output_tokens),
                    other => panic!("request {} is both or neither: {other:?}", spec.id),
                }
            }
            assert!(
                m.interrupted > 0,
                "{policy:?} {failed:?}: a failure interrupts someone"
            );
            assert!(m.recovery_s > 0.0);
        }
    }
}
