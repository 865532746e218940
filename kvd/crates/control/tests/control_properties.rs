//! Properties of the control shim under random event sequences (proptest shrinks a failure to
//! a minimal sequence and records its seed in `proptest-regressions/`).

use std::collections::BTreeMap;

use kvd_control::{
    AdmitRequest, ControlConfig, Controller, ControllerSnapshot, Event, PolicyKind, RequestState,
    WorkerPhase,
};
use proptest::prelude::*;

const WORKERS: u32 = 6;
const REQUESTS: u64 = 24;

/// A step of a random run, resolved against the controller's state when applied.
#[derive(Debug, Clone)]
enum Op {
    Admit {
        r: u64,
        serving: u32,
        prompt: u32,
        reserve: u64,
    },
    Prefill {
        r: u64,
    },
    Transfer {
        r: u64,
        to: u32,
    },
    Decode {
        r: u64,
    },
    Tokens {
        r: u64,
        n: u32,
    },
    Checkpoint {
        r: u64,
        permille: u32,
    },
    Ack {
        r: u64,
        seq: u64,
    },
    Finish {
        r: u64,
    },
    Cancel {
        r: u64,
    },
    Cancelled {
        r: u64,
    },
    EngineFailed {
        r: u64,
    },
    Fail {
        workers: Vec<u32>,
    },
    Recover {
        w: u32,
    },
    PhaseDone {
        w: u32,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let r = 0..REQUESTS;
    let w = 0..WORKERS;
    prop_oneof![
        6 => (r.clone(), w.clone(), 1u32..2000, 0u64..400).prop_map(|(r, serving, prompt, reserve)| Op::Admit { r, serving, prompt, reserve }),
        3 => r.clone().prop_map(|r| Op::Prefill { r }),
        1 => (r.clone(), w.clone()).prop_map(|(r, to)| Op::Transfer { r, to }),
        3 => r.clone().prop_map(|r| Op::Decode { r }),
        3 => (r.clone(), 0u32..64).prop_map(|(r, n)| Op::Tokens { r, n }),
        3 => (r.clone(), 0u32..=1000).prop_map(|(r, permille)| Op::Checkpoint { r, permille }),
        2 => (r.clone(), 0u64..64).prop_map(|(r, seq)| Op::Ack { r, seq }),
        2 => r.clone().prop_map(|r| Op::Finish { r }),
        1 => r.clone().prop_map(|r| Op::Cancel { r }),
        1 => r.clone().prop_map(|r| Op::Cancelled { r }),
        1 => r.clone().prop_map(|r| Op::EngineFailed { r }),
        1 => prop::collection::vec(w.clone(), 1..4).prop_map(|workers| Op::Fail { workers }),
        1 => w.clone().prop_map(|w| Op::Recover { w }),
        2 => w.prop_map(|w| Op::PhaseDone { w }),
    ]
}

/// Every policy kvd ships (the Lumen placement variants and both baselines).
fn policy() -> impl Strategy<Value = PolicyKind> {
    prop::sample::select(PolicyKind::ALL.to_vec())
}

fn cluster(policy: PolicyKind) -> Controller {
    let mut c = Controller::new(ControlConfig {
        policy,
        ..ControlConfig::default()
    })
    .unwrap();
    for w in 0..WORKERS {
        c.add_worker(w, 1000 + 100 * w as u64, 0).unwrap();
    }
    c
}

/// The event `op` stands for now (current epochs), if it names anything.
fn event(c: &Controller, op: &Op) -> Option<Event> {
    let epoch = |r: u64| c.request(r).map(|x| x.epoch);
    Some(match *op {
        Op::Admit {
            r,
            serving,
            prompt,
            reserve,
        } => Event::Admit(AdmitRequest {
            request_id: r,
            serving,
            prompt_tokens: prompt,
            max_new_tokens: 64,
            reserve_bytes: reserve,
            deadline_ms: None,
        }),
        Op::Prefill { r } => Event::PrefillStarted {
            request_id: r,
            epoch: epoch(r)?,
        },
        Op::Transfer { r, to } => Event::TransferStarted {
            request_id: r,
            epoch: epoch(r)?,
            to,
        },
        Op::Decode { r } => Event::DecodingStarted {
            request_id: r,
            epoch: epoch(r)?,
        },
        Op::Tokens { r, n } => Event::TokensCommitted {
            request_id: r,
            epoch: epoch(r)?,
            generated_tokens: n,
        },
        Op::Checkpoint { r, permille } => {
            let rec = c.request(r)?;
            Event::CheckpointStored {
                request_id: r,
                epoch: rec.epoch,
                tokens: (rec.history_tokens() as u64 * permille as u64 / 1000) as u32,
                bytes: rec.reserved_bytes * permille as u64 / 1000,
            }
        }
        Op::Ack { r, seq } => Event::FrameAcked {
            request_id: r,
            epoch: epoch(r)?,
            sequence_no: seq,
        },
        Op::Finish { r } => Event::Finished {
            request_id: r,
            epoch: epoch(r)?,
        },
        Op::Cancel { r } => Event::Cancel { request_id: r },
        Op::Cancelled { r } => Event::Cancelled {
            request_id: r,
            epoch: epoch(r)?,
        },
        Op::EngineFailed { r } => Event::RequestFailed {
            request_id: r,
            epoch: epoch(r)?,
            reason: "oom".into(),
        },
        Op::Fail { ref workers } => Event::WorkersFailed {
            workers: workers.clone(),
        },
        Op::Recover { w } => Event::WorkerRecovered { worker: w },
        Op::PhaseDone { w } => Event::WorkerPhaseDone {
            worker: w,
            phase: c.load().get(w)?.phase,
        },
    })
}

/// The state without the counters (which replays and stale events are allowed to bump).
fn state(c: &Controller) -> ControllerSnapshot {
    let mut s = c.snapshot();
    s.stats = Default::default();
    s
}

fn run(c: &mut Controller, ops: &[Op], mut after_each: impl FnMut(&mut Controller, &Event, u64)) {
    for (i, op) in ops.iter().enumerate() {
        let now = i as u64 * 10;
        if let Some(e) = event(c, op) {
            let _ = c.apply(&e, now);
            after_each(c, &e, now);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn the_holder_is_never_the_serving_worker(p in policy(), ops in prop::collection::vec(op(), 1..120)) {
        let mut c = cluster(p);
        run(&mut c, &ops, |c, e, _| {
            for r in c.live_requests() {
                assert_ne!(r.holder, Some(r.serving), "after {e:?}: {r:?}");
            }
        });
    }

    #[test]
    fn reservations_never_exceed_a_workers_capacity(p in policy(), ops in prop::collection::vec(op(), 1..120)) {
        let mut c = cluster(p);
        run(&mut c, &ops, |c, e, _| {
            for w in c.load().iter() {
                assert!(w.reserved_bytes <= w.capacity_bytes, "after {e:?}: {w:?}");
            }
            if let Err(broken) = c.check_invariants() {
                panic!("after {e:?}: {broken}");
            }
        });
    }

    #[test]
    fn replaying_any_event_twice_changes_nothing(p in policy(), ops in prop::collection::vec(op(), 1..120)) {
        let mut c = cluster(p);
        run(&mut c, &ops, |c, e, now| {
            let once = state(c);
            let _ = c.apply(e, now);
            assert_eq!(state(c), once, "replaying {e:?} changed the state");
        });
    }

    #[test]
    fn stale_epoch_events_never_change_state(
        p in policy(),
        ops in prop::collection::vec(op(), 1..120),
        stale in prop::collection::vec((0..REQUESTS, 0u8..8), 1..20),
    ) {
        let mut c = cluster(p);
        run(&mut c, &ops, |_, _, _| {});
        for (r, kind) in stale {
            let Some(rec) = c.request(r) else { continue };
            if rec.epoch < 2 {
                continue;
            }
            let epoch = rec.epoch - 1;
            let e = match kind {
                0 => Event::PrefillStarted { request_id: r, epoch },
                1 => Event::DecodingStarted { request_id: r, epoch },
                2 => Event::TokensCommitted { request_id: r, epoch, generated_tokens: 63 },
                3 => Event::CheckpointStored { request_id: r, epoch, tokens: 1, bytes: 0 },
                4 => Event::FrameAcked { request_id: r, epoch, sequence_no: 1000 },
                5 => Event::Finished { request_id: r, epoch },
                6 => Event::Cancelled { request_id: r, epoch },
                _ => Event::RequestFailed { request_id: r, epoch, reason: "late".into() },
            };
            let before = state(&c);
            let stale_before = c.stats().stale_events;
            let res = c.apply(&e, 1_000_000);
            prop_assert!(matches!(res, Err(kvd_core::Error::StaleEpoch { .. })), "{e:?} gave {res:?}");
            prop_assert_eq!(state(&c), before);
            prop_assert_eq!(c.stats().stale_events, stale_before + 1);
        }
    }

    #[test]
    fn every_interrupted_request_gets_exactly_one_plan(
        p in policy(),
        ops in prop::collection::vec(op(), 1..120),
        failing in prop::collection::btree_set(0..WORKERS, 1..WORKERS as usize + 1),
    ) {
        let mut c = cluster(p);
        run(&mut c, &ops, |_, _, _| {});
        let failing: Vec<u32> = failing.into_iter().collect();
        let interrupted: Vec<(u64, RequestState)> = c
            .live_requests()
            .filter(|r| failing.contains(&r.serving))
            .map(|r| (r.id, r.state))
            .collect();
        let plan = c.fail_workers(&failing, 100_000).unwrap();
        let mut seen = BTreeMap::<u64, u32>::new();
        for id in plan.restores.iter().map(|r| r.request_id)
            .chain(plan.failed_requests.iter().map(|f| f.0))
            .chain(plan.cancelled_requests.iter().copied())
        {
            *seen.entry(id).or_default() += 1;
        }
        let expected: BTreeMap<u64, u32> = interrupted.iter().map(|(id, _)| (*id, 1)).collect();
        prop_assert_eq!(seen, expected);
        for r in &plan.restores {
            prop_assert!(!failing.contains(&r.target));
            prop_assert_eq!(r.load_tokens + r.prefill_tokens, r.history_tokens);
            prop_assert_eq!(c.request(r.request_id).unwrap().state, RequestState::Migrating);
        }
        if let Err(broken) = c.check_invariants() {
            panic!("{broken}");
        }
    }

    /// Lumen's dispatch may keep recomputations on a few survivors (docs/CONTROL.md,
    /// "Recovery"); what it promises of the checkpoint restores is the paper's average-based
    /// request-count rule: where every interrupted request restores (no recomputation, so the
    /// rebalancing ran over every survivor), no survivor that was handed a restore serves more
    /// than the mean over the survivors plus one, counting the requests it already ran. And the
    /// rebalancing terminates within one move per restore.
    #[test]
    fn rebalancing_terminates_and_no_survivor_handed_a_restore_serves_more_than_the_mean_plus_one(
        workers in 2u32..16,
        requests in prop::collection::vec((0u32..16, 0u32..16, 0u32..2000), 1..200),
        failing in prop::collection::btree_set(0u32..16, 1..4),
    ) {
        let mut c = Controller::new(ControlConfig { tokens_per_block: 1, ..ControlConfig::default() }).unwrap();
        for w in 0..workers {
            c.add_worker(w, u64::MAX / 4, 0).unwrap();
        }
        for (i, (s, _, prompt)) in requests.iter().enumerate() {
            let a = c.admit(AdmitRequest {
                request_id: i as u64, serving: s % workers, prompt_tokens: prompt + 1,
                max_new_tokens: 1, reserve_bytes: 1, deadline_ms: None }, 0).unwrap();
            // Every checkpoint covers the whole prompt (at least one token, so a restore
            // always loads something and shows as one in the plan).
            c.checkpoint_stored(i as u64, a.epoch, prompt + 1, 0, 0).unwrap();
        }
        let failing: Vec<u32> = failing.into_iter().filter(|w| *w < workers).collect();
        prop_assume!(!failing.is_empty() && failing.len() < workers as usize);
        let plan = c.fail_workers(&failing, 1).unwrap();
        prop_assert!(plan.rebalance_moves as usize <= plan.restores.len());
        if plan.restores.iter().all(|r| r.kv_source.is_some()) {
            let serving: BTreeMap<u32, u32> =
                c.load().in_service().map(|w| (w.id, w.serving_requests)).collect();
            let mean = serving.values().sum::<u32>() as f64 / serving.len() as f64;
            for r in &plan.restores {
                let n = serving[&r.target];
                prop_assert!(n as f64 <= mean + 1.0, "worker {} serves {}, mean {}", r.target, n, mean);
            }
        }
    }
}

#[test]
fn a_phase_done_for_a_phase_not_reached_is_refused() {
    let mut c = cluster(PolicyKind::Lumen);
    c.fail_workers(&[1], 0).unwrap();
    c.worker_recovered(1, 1).unwrap();
    assert!(c.worker_phase_done(1, WorkerPhase::HotSwap, 2).is_err());
    assert_eq!(c.load().get(1).unwrap().phase, WorkerPhase::LoadingDraft);
}
