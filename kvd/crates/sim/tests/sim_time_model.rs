//! The time model against cases computed by hand: one request alone on a small cluster, with
//! figures chosen so every step is a round number of microseconds.

use kvd_control::PolicyKind;
use kvd_sim::workload::RequestSpec;
use kvd_sim::{ClusterConfig, FailureSpec, ModelConfig, RunConfig, run};

/// Qwen3-14B on two workers, with HBM bandwidth set so that one token of decode context costs
/// exactly 1 us of attention (163,840 B / 163.84 GB/s), and no checkpoint stall.
fn cluster() -> ClusterConfig {
    let mut c = ClusterConfig::new(2, ModelConfig::qwen3_14b());
    c.hardware.hbm_bytes_per_s = 163_840.0 * 1e6;
    c.hardware.checkpoint_stall_fraction = 0.0;
    c
}

fn one_request(prompt: u32, output: u32) -> Vec<RequestSpec> {
    vec![RequestSpec {
        id: 0,
        arrival_us: 0,
        prompt_tokens: prompt,
        output_tokens: output,
    }]
}

#[test]
fn a_lone_request_takes_its_prefill_chunks_then_one_decode_step_per_token() {
    // Prefill 1,200 tokens in chunks of 512, 512, 176:
    //   max(10.8, 0.042 x 512) = 21.504 ms, 21.504 ms, max(10.8, 7.392) = 10.8 ms.
    // TTFT = 53,808 us.
    // Then 39 decode steps at contexts 1,200 .. 1,238: 10,800 us + context x 1 us each:
    //   39 x 10,800 + (1,200 + 1,238) x 39 / 2 = 421,200 + 47,541 = 468,741 us.
    // E2E = 522,549 us; TPOT = 468,741 / 39 us.
    let out = run(
        &RunConfig::new(cluster(), PolicyKind::StopRestart, vec![]),
        &one_request(1200, 40),
    )
    .unwrap();
    let r = &out.records[0];
    assert_eq!(r.first_token_us, Some(53_808));
    assert_eq!(r.finish_us, Some(53_808 + 468_741));
    let tpot = out.metrics.overall.tpot.mean;
    assert!((tpot - 0.468_741 / 39.0).abs() < 1e-12, "{tpot}");
}

/// Prompt 512, failure of its worker at 100 ms. By hand:
///   prefill 512 tokens: 21,504 us (first token); checkpoint of 512 tokens
///   (83,886,080 B at 25 GB/s = 3,356 us) lands at 24,860 us.
///   decode steps k = 1.. take 10,800 + 511 + k us: they end at 32,816, 44,129, 55,443,
///   66,758, 78,074, 89,391, 100,709 us. At 100 ms the request has 7 tokens, 518 tokens of KV on
///   the dead GPU, and a 512-token checkpoint on worker 1.
fn failure_at_100_ms(policy: PolicyKind) -> kvd_sim::RunOutput {
    let cfg = RunConfig::new(
        cluster(),
        policy,
        vec![FailureSpec {
            at_s: 0.1,
            workers: vec![0],
        }],
    );
    run(&cfg, &one_request(512, 200)).unwrap()
}

#[test]
fn a_restore_from_the_holder_costs_the_host_to_gpu_copy_plus_the_missing_suffix() {
    // Lumen: resume on the holder (worker 1). Load 512 tokens (whole blocks of 16):
    // 83,886,080 B at 35 GB/s = 2,397 us; then prefill the 7-token suffix (history 519):
    // one iteration at the 10.8 ms floor. Next token at 100,000 + 2,397 + 10,800.
    for policy in [PolicyKind::Lumen, PolicyKind::FixedRing] {
        let out = failure_at_100_ms(policy);
        let m = &out.metrics;
        assert_eq!(out.records[0].resumed_us, Some(113_197), "{policy:?}");
        assert!((m.recovery_s - 0.013_197).abs() < 1e-9, "{policy:?}");
        assert_eq!(
            m.recomputed_tokens, 6,
            "{policy:?}: tokens 512..517 had KV already"
        );
        assert_eq!(m.restore_h2d_bytes, 83_886_080, "{policy:?}");
        assert_eq!(
            m.restore_network_bytes, 0,
            "{policy:?}: the holder is the target"
        );
        assert_eq!(m.completed, 1);
    }
}

#[test]
fn stop_restart_recomputes_the_prompt_and_the_generated_tokens() {
    // StopRestart: recompute 519 tokens on worker 1: chunks of 512 (21,504 us) and 7
    // (10,800 us). Next token at 100,000 + 32,304.
    let out = failure_at_100_ms(PolicyKind::StopRestart);
    let m = &out.metrics;
    assert_eq!(out.records[0].resumed_us, Some(132_304));
    assert_eq!(m.recomputed_tokens, 518);
    assert_eq!(m.restore_h2d_bytes, 0);
    assert_eq!(m.checkpoint_bytes, 0);
    assert_eq!(m.completed, 1);
}
