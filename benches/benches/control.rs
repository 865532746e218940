//! The control shim's costs: placement decisions per second and recovery planning time, on
//! 64 workers with 10,000 requests in flight (target: a recovery plan in under 10 ms).

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kvd::control::{AdmitRequest, ControlConfig, Controller, ControllerSnapshot, PolicyKind};

const WORKERS: u32 = 64;
const IN_FLIGHT: u64 = 10_000;

/// 64 workers with varied queueing delays and 10,000 decoding requests with checkpoints.
fn loaded(policy: PolicyKind) -> Controller {
    let mut c = Controller::new(ControlConfig {
        policy,
        ..ControlConfig::default()
    })
    .unwrap();
    for w in 0..WORKERS {
        c.add_worker(w, 1 << 40, 0).unwrap();
    }
    for id in 0..IN_FLIGHT {
        let serving = (id % WORKERS as u64) as u32;
        let a = c
            .admit(
                AdmitRequest {
                    request_id: id,
                    serving,
                    prompt_tokens: 512 + (id % 1024) as u32,
                    max_new_tokens: 512,
                    reserve_bytes: (1 << 26) + (id % 97) * (1 << 20),
                    deadline_ms: None,
                },
                id / 10,
            )
            .unwrap();
        c.prefill_started(id, a.epoch, id / 10 + (id * 7919) % 50)
            .unwrap();
        c.decoding_started(id, a.epoch, id / 10 + 60).unwrap();
        if a.holder.is_some() {
            c.checkpoint_stored(id, a.epoch, 256 + (id % 256) as u32, 1 << 20, id / 10 + 70)
                .unwrap();
        }
    }
    c
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
