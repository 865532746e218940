//! The control shim's costs: placement decisions per second and recovery planning time, on
//! 64 workers with 10,000 requests in flight (target: a recovery plan in under 10 ms).

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kvd::control::{AdmitRequest, Controller, ControllerSnapshot, PolicyKind};

const WORKERS: u32 = 64;
const IN_FLIGHT: u64 = 10_000;

#[path = "../src/control_load.rs"]
mod control_load;

/// 64 workers and 10,000 decoding requests with checkpoints (the state `kvd-bench plan`
/// measures too).
fn loaded(policy: PolicyKind) -> Controller {
    control_load::loaded(
        policy,
        WORKERS,
        IN_FLIGHT,
        1 << 40,
        std::time::Duration::from_secs(600),
    )
    .unwrap()
    .expect("built within the limit")
}

fn placement(cr: &mut Criterion) {
    let mut g = cr.benchmark_group("control/placement");
    g.throughput(Throughput::Elements(1));
    for policy in [
        PolicyKind::Lumen,
        PolicyKind::LumenMean,
        PolicyKind::FixedRing,
    ] {
        let c = loaded(policy);
        let p = policy.build(c.config().score_params());
        let mut s = 0u32;
        g.bench_function(format!("{policy:?}/decision/64w"), |b| {
            b.iter(|| {
                s = (s + 1) % WORKERS;
                std::hint::black_box(p.place(c.load(), s, 1 << 26))
            })
        });
    }
    // The whole admission path: place, reserve, record, then finish (release) to stay steady.
    let mut c = loaded(PolicyKind::Lumen);
    let mut id = IN_FLIGHT;
    g.bench_function("Lumen/admit+finish/64w-10k", |b| {
        b.iter(|| {
            id += 1;
            let a = c
                .admit(
                    AdmitRequest {
                        request_id: id,
                        serving: (id % WORKERS as u64) as u32,
                        prompt_tokens: 700,
                        max_new_tokens: 300,
                        reserve_bytes: 1 << 26,
                        deadline_ms: None,
                    },
                    2_000,
                )
                .unwrap();
            c.finished(id, a.epoch, 2_001).unwrap();
        })
    });
    g.finish();
}

fn recovery(cr: &mut Criterion) {
    let mut g = cr.benchmark_group("control/recovery");
    for policy in [
        PolicyKind::Lumen,
        PolicyKind::FixedRing,
        PolicyKind::StopRestart,
    ] {
        let snap: ControllerSnapshot = loaded(policy).snapshot();
        for failing in [vec![5u32], (0..8).collect::<Vec<u32>>()] {
            g.bench_function(format!("{policy:?}/plan/{}of64-10k", failing.len()), |b| {
                b.iter_batched(
                    || Controller::from_snapshot(snap.clone()).unwrap(),
                    |mut c| {
                        let plan = c.fail_workers(&failing, 5_000).unwrap();
                        assert!(!plan.restores.is_empty());
                        (plan, c)
                    },
                    BatchSize::LargeInput,
                )
            });
        }
    }
    g.finish();
}

criterion_group!(benches, placement, recovery);
criterion_main!(benches);
