//! Scenarios of the control shim: failures of one and of many workers, races between a cancel
//! and a migration, deadlines, budgets, recovering workers, the baseline policies, snapshots.

use kvd_control::{
    AdmitRequest, ControlConfig, Controller, Decision, PolicyKind, RequestState, WorkerId,
    WorkerPhase,
};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn cluster(policy: PolicyKind, workers: u32) -> Controller {
    let mut c = Controller::new(ControlConfig {
        policy,
        ..ControlConfig::default()
    })
    .unwrap();
    for w in 0..workers {
        c.add_worker(w, 64 * GIB, 0).unwrap();
    }
    c
}

/// Give workers queueing delays: each `(request, worker, wait_ms)` is admitted at 0 and starts
/// prefill after `wait_ms`.
fn queue_delays(c: &mut Controller, waits: &[(u64, WorkerId, u64)]) {
    for &(id, w, wait) in waits {
        c.admit(
            AdmitRequest {
                request_id: id,
                serving: w,
                prompt_tokens: 1,
                max_new_tokens: 1,
                reserve_bytes: 0,
                deadline_ms: None,
            },
            0,
        )
        .unwrap();
        c.prefill_started(id, 1, wait).unwrap();
    }
}

/// Admit `id` on `serving`, run it to decoding with `generated` tokens and a checkpoint of the
/// whole history on its holder. Returns the holder.
fn decoding(c: &mut Controller, id: u64, serving: WorkerId, generated: u32) -> Option<WorkerId> {
    let a = c
        .admit(
            AdmitRequest {
                request_id: id,
                serving,
                prompt_tokens: 1024,
                max_new_tokens: 512,
                reserve_bytes: 256 * MIB,
                deadline_ms: None,
            },
            0,
        )
        .unwrap();
    c.prefill_started(id, a.epoch, 5).unwrap();
    c.decoding_started(id, a.epoch, 50).unwrap();
    c.tokens_committed(id, a.epoch, generated, 60).unwrap();
    if a.holder.is_some() {
        c.checkpoint_stored(id, a.epoch, 1024 + generated, 200 * MIB, 70)
            .unwrap();
    }
    a.holder
}

#[test]
fn eight_workers_one_fails_every_interrupted_request_is_planned_holders_first() {
    let mut c = cluster(PolicyKind::Lumen, 8);
    let mut holders = std::collections::BTreeMap::new();
    for id in 0..80u64 {
        let h = decoding(&mut c, id, (id % 8) as u32, 37);
        holders.insert(id, h.expect("room everywhere"));
    }
    let plan = c.fail_workers(&[3], 1000).unwrap();
    let interrupted: Vec<u64> = (0..80).filter(|id| id % 8 == 3).collect();
    let planned: Vec<u64> = plan.restores.iter().map(|r| r.request_id).collect();
    assert_eq!(
        planned, interrupted,
        "every interrupted request planned once, in id order"
    );
    assert!(plan.failed_requests.is_empty());
    let at_holder = plan
        .restores
        .iter()
        .filter(|r| r.target == holders[&r.request_id])
        .count();
    assert_eq!(
        at_holder,
        interrupted.len() - plan.rebalance_moves as usize,
        "holders first"
    );
    for r in &plan.restores {
        assert_eq!(
            r.kv_source,
            Some(holders[&r.request_id]),
            "the checkpoint is reused"
        );
        assert_eq!(r.history_tokens, 1024 + 37);
        assert_eq!(r.load_tokens, 1056, "whole 16-token blocks only");
        assert_eq!(r.prefill_tokens, r.history_tokens - r.load_tokens);
        assert_ne!(r.target, 3);
        assert_ne!(r.new_holder, Some(r.target));
        assert_eq!(r.epoch, 2);
        assert_eq!(
            c.request(r.request_id).unwrap().state,
            RequestState::Migrating
        );
    }
    assert_eq!(c.stats().kv_reuse_restores, 10);
    c.check_invariants().unwrap();
}

#[test]
fn four_of_eight_fail_at_once_including_holders() {
    let mut c = cluster(PolicyKind::Lumen, 8);
    let mut holders = std::collections::BTreeMap::new();
    for id in 0..160u64 {
        holders.insert(id, decoding(&mut c, id, (id % 8) as u32, 16).unwrap());
    }
    let dead = [0u32, 1, 2, 3];
    let plan = c.fail_workers(&[3, 1, 2, 0, 1], 1000).unwrap();
    assert_eq!(plan.failed_workers, dead);
    let interrupted: Vec<u64> = (0..160).filter(|id| id % 8 < 4).collect();
    assert_eq!(
        plan.restores
            .iter()
            .map(|r| r.request_id)
            .collect::<Vec<_>>(),
        interrupted
    );
    for r in &plan.restores {
        assert!(!dead.contains(&r.target));
        let h = holders[&r.request_id];
        if dead.contains(&h) {
            assert_eq!(
                (r.kv_source, r.load_tokens),
                (None, 0),
                "holder died too: recompute"
            );
            assert_eq!(r.prefill_tokens, 1024 + 16);
        } else {
            assert_eq!(r.kv_source, Some(h), "holder survived: reuse");
        }
    }
    // Survivors whose holder died restart their checkpoint on another survivor.
    let orphaned: Vec<u64> = (0..160)
        .filter(|id| id % 8 >= 4 && dead.contains(&holders[id]))
        .collect();
    assert_eq!(
        plan.checkpoint_moves
            .iter()
            .map(|m| m.0)
            .collect::<Vec<_>>(),
        orphaned
    );
    for (id, _, h) in &plan.checkpoint_moves {
        let h = h.expect("room on survivors");
        assert!(!dead.contains(&h));
        assert_ne!(h, c.request(*id).unwrap().serving);
    }
    // No survivor ends with more than ⌈mean⌉ recovering requests.
    let mut counts = [0usize; 8];
    for r in &plan.restores {
        counts[r.target as usize] += 1;
    }
    let ceil = plan.restores.len().div_ceil(4);
    assert!(counts.iter().all(|&n| n <= ceil), "{counts:?}");
    for w in dead {
        assert_eq!(c.load().get(w).unwrap().reserved_bytes, 0);
    }
    c.check_invariants().unwrap();
}

#[test]
fn a_cancel_racing_a_migration_the_higher_epoch_wins() {
    let mut c = cluster(PolicyKind::Lumen, 4);
    let h = decoding(&mut c, 1, 0, 10).unwrap();
    let plan = c.fail_workers(&[0], 100).unwrap();
    let restore = plan.restores[0].clone();
    assert_eq!((restore.target, restore.epoch), (h, 2));
    // The client cancels while the restore runs: a newer epoch.
    let d = c.cancel(1, 110).unwrap();
    assert_eq!(
        d,
        vec![Decision::Cancel {
            request_id: 1,
            epoch: 3,
            worker: h
        }]
    );
    // The migrated incarnation's late completion loses.
    let late = c.finished(1, restore.epoch, 120);
    assert!(
        matches!(
            late,
            Err(kvd_core::Error::StaleEpoch { got: 2, current: 3 })
        ),
        "{late:?}"
    );
    assert_eq!(c.request(1).unwrap().state, RequestState::Cancelling);
    assert_eq!(c.stats().stale_events, 1);
    c.cancelled(1, 3, 130).unwrap();
    assert_eq!(c.request(1).unwrap().state, RequestState::Cancelled);
    // Terminal states are idempotent; the loser stays dropped.
    assert!(c.cancelled(1, 3, 140).unwrap().is_empty());
    assert!(c.finished(1, 2, 150).is_err());
    assert_eq!(c.request(1).unwrap().state, RequestState::Cancelled);
    assert_eq!(c.stats().completed, 0);
    c.check_invariants().unwrap();
}

#[test]
fn a_cancel_before_the_failure_is_not_migrated() {
    let mut c = cluster(PolicyKind::Lumen, 4);
    decoding(&mut c, 1, 0, 10).unwrap();
    c.cancel(1, 90).unwrap();
    let plan = c.fail_workers(&[0], 100).unwrap();
    assert!(plan.restores.is_empty());
    assert_eq!(plan.cancelled_requests, vec![1]);
    assert!(
        c.finished(1, 1, 110).is_err(),
        "the old incarnation's completion is dropped"
    );
    assert_eq!(c.request(1).unwrap().state, RequestState::Cancelled);
}

#[test]
fn a_migration_that_cannot_meet_its_deadline_fails_fast_with_its_reason() {
    let mut c = Controller::new(ControlConfig {
        prefill_tokens_per_ms: 1,
        ..ControlConfig::default()
    })
    .unwrap();
    for w in 0..3 {
        c.add_worker(w, 0, 0).unwrap(); // no checkpoint room: recovery recomputes
    }
    let a = c
        .admit(
            AdmitRequest {
                request_id: 9,
                serving: 0,
                prompt_tokens: 4000,
                max_new_tokens: 10,
                reserve_bytes: 1,
                deadline_ms: Some(1_500),
            },
            0,
        )
        .unwrap();
    assert_eq!(a.holder, None);
    let plan = c.fail_workers(&[0], 1_000).unwrap();
    assert!(plan.restores.is_empty());
    let (id, _, reason) = &plan.failed_requests[0];
    assert_eq!(*id, 9);
    assert!(
        reason.contains("deadline") && reason.contains("prefill 4000 ms"),
        "{reason}"
    );
    assert_eq!(c.request(9).unwrap().state, RequestState::Failed);
    assert_eq!(c.stats().deadline_failures, 1);
}

#[test]
fn the_migration_budget_bounds_how_often_a_request_moves() {
    let mut c = Controller::new(ControlConfig {
        migration_budget: 1,
        ..ControlConfig::default()
    })
    .unwrap();
    for w in 0..4 {
        c.add_worker(w, GIB, 0).unwrap();
    }
    decoding(&mut c, 1, 0, 4);
    let first = c.fail_workers(&[0], 10).unwrap();
    let target = first.restores[0].target;
    let second = c.fail_workers(&[target], 20).unwrap();
    assert!(second.restores.is_empty());
    assert!(
        second.failed_requests[0]
            .2
            .contains("migration budget exhausted")
    );
    assert_eq!(c.stats().budget_failures, 1);
    c.check_invariants().unwrap();
}

#[test]
fn a_resumed_stream_starts_after_the_last_acknowledged_frame() {
    let mut c = cluster(PolicyKind::Lumen, 3);
    decoding(&mut c, 1, 0, 12);
    for seq in 0..10 {
        c.frame_acked(1, 1, seq, 80).unwrap();
    }
    c.frame_acked(1, 1, 4, 81).unwrap(); // a late, out-of-order ack changes nothing
    let plan = c.fail_workers(&[0], 100).unwrap();
    assert_eq!(plan.restores[0].resume_seq, 10);
}

#[test]
fn a_recovering_worker_whose_assisted_survivor_dies_pairs_with_the_next_busiest() {
    let mut c = cluster(PolicyKind::Lumen, 4);
    queue_delays(&mut c, &[(1u64, 1u32, 90u64), (2, 2, 50), (3, 3, 10)]);
    c.fail_workers(&[0], 100).unwrap();
    c.worker_recovered(0, 200).unwrap();
    c.worker_phase_done(0, WorkerPhase::LoadingDraft, 300)
        .unwrap();
    assert_eq!(c.load().get(0).unwrap().assisting, Some(1), "the busiest");
    let plan = c.fail_workers(&[1], 400).unwrap();
    assert_eq!(plan.assist_pairs, vec![(0, Some(2))], "the next busiest");
    assert_eq!(c.load().get(2).unwrap().assisted_by, Some(0));
    c.check_invariants().unwrap();
    // With every survivor taken or gone, it assists nobody, and says so.
    let plan = c.fail_workers(&[2, 3], 500).unwrap();
    assert_eq!(plan.assist_pairs, vec![(0, None)]);
    assert_eq!(c.load().get(0).unwrap().assisting, None);
    c.check_invariants().unwrap();
}

#[test]
fn a_recovering_worker_assists_the_busiest_free_survivor_one_to_one() {
    let mut c = cluster(PolicyKind::Lumen, 5);
    // Queueing delays: worker 2 waits 90 ms, worker 3 waits 50 ms, the rest less.
    queue_delays(&mut c, &[(1u64, 2u32, 90u64), (2, 3, 50), (3, 4, 10)]);
    c.fail_workers(&[0, 1], 100).unwrap();
    let d = c.worker_recovered(0, 200).unwrap();
    assert_eq!(
        d,
        vec![Decision::WorkerPhase {
            worker: 0,
            phase: WorkerPhase::LoadingDraft,
            assisting: None
        }]
    );
    c.worker_recovered(1, 200).unwrap();
    // Not a placement candidate while recovering.
    assert!(c.load().get(0).map(|w| !w.in_service()).unwrap());
    let d0 = c
        .worker_phase_done(0, WorkerPhase::LoadingDraft, 300)
        .unwrap();
    assert_eq!(
        d0,
        vec![Decision::WorkerPhase {
            worker: 0,
            phase: WorkerPhase::Assist,
            assisting: Some(2)
        }]
    );
    let d1 = c
        .worker_phase_done(1, WorkerPhase::LoadingDraft, 300)
        .unwrap();
    assert_eq!(
        d1,
        vec![Decision::WorkerPhase {
            worker: 1,
            phase: WorkerPhase::Assist,
            assisting: Some(3)
        }]
    );
    c.worker_phase_done(0, WorkerPhase::Assist, 400).unwrap();
    assert_eq!(
        c.load().get(2).unwrap().assisted_by,
        None,
        "HOTSWAP releases the pair"
    );
    let d = c.worker_phase_done(0, WorkerPhase::HotSwap, 500).unwrap();
    assert_eq!(
        d,
        vec![Decision::WorkerPhase {
            worker: 0,
            phase: WorkerPhase::FullService,
            assisting: None
        }]
    );
    assert!(c.load().get(0).unwrap().in_service());
    // Replays change nothing.
    assert!(
        c.worker_phase_done(0, WorkerPhase::HotSwap, 600)
            .unwrap()
            .is_empty()
    );
    c.check_invariants().unwrap();
}

#[test]
fn fixed_ring_places_at_the_next_worker_and_recovers_there_without_rebalancing() {
    let mut c = cluster(PolicyKind::FixedRing, 4);
    for id in 0..6 {
        assert_eq!(decoding(&mut c, id, 0, 8), Some(1));
    }
    assert_eq!(decoding(&mut c, 6, 3, 8), Some(0), "the ring wraps");
    let plan = c.fail_workers(&[0], 100).unwrap();
    assert_eq!(plan.rebalance_moves, 0);
    assert!(
        plan.restores
            .iter()
            .all(|r| r.target == 1 && r.kv_source == Some(1))
    );
    // Request 6 (served by 3) lost its holder 0; the ring's next worker after 3 is now 1.
    assert_eq!(plan.checkpoint_moves, vec![(6, 1, Some(1))]);
    c.check_invariants().unwrap();
}

#[test]
fn lumen_spreads_the_same_failure_that_fixed_ring_piles_on_one_worker() {
    let mut c = cluster(PolicyKind::Lumen, 4);
    for id in 0..6 {
        decoding(&mut c, id, 0, 8);
    }
    let plan = c.fail_workers(&[0], 100).unwrap();
    let mut counts = [0; 4];
    for r in &plan.restores {
        counts[r.target as usize] += 1;
    }
    assert_eq!(counts, [0, 2, 2, 2]);
}

#[test]
fn stop_restart_recomputes_prompt_plus_generated_tokens_on_the_least_loaded() {
    let mut c = cluster(PolicyKind::StopRestart, 4);
    for id in 0..6 {
        assert_eq!(decoding(&mut c, id, 0, 100), None, "no checkpoints");
    }
    assert_eq!(
        c.stats().no_holder,
        0,
        "not a missed placement: the policy wants none"
    );
    let plan = c.fail_workers(&[0], 100).unwrap();
    let mut counts = [0; 4];
    for r in &plan.restores {
        assert_eq!(
            (r.kv_source, r.load_tokens, r.prefill_tokens),
            (None, 0, 1124)
        );
        counts[r.target as usize] += 1;
    }
    assert_eq!(counts, [0, 2, 2, 2]);
    assert_eq!(c.stats().recomputations, 6);
}

#[test]
fn a_controller_restored_from_a_snapshot_decides_the_same() {
    let mut c = cluster(PolicyKind::Lumen, 8);
    for id in 0..50u64 {
        decoding(&mut c, id, (id % 8) as u32, (id % 7) as u32 * 10);
    }
    c.cancel(7, 80).unwrap();
    c.finished(8, 1, 90).unwrap();
    let json = serde_json::to_string(&c.snapshot()).unwrap();
    let mut restored = Controller::from_snapshot(serde_json::from_str(&json).unwrap()).unwrap();
    assert_eq!(restored.snapshot(), c.snapshot());
    let a = c.fail_workers(&[2, 5], 100).unwrap();
    let b = restored.fail_workers(&[2, 5], 100).unwrap();
    assert_eq!(a, b);
    assert_eq!(restored.snapshot(), c.snapshot());
}

#[test]
fn a_snapshot_that_breaks_an_invariant_is_refused() {
    let mut c = cluster(PolicyKind::Lumen, 3);
    decoding(&mut c, 1, 0, 1);
    let mut snap = c.snapshot();
    snap.requests[0].holder = Some(0); // holder == serving
    assert!(Controller::from_snapshot(snap).is_err());
    let mut snap = c.snapshot();
    snap.format_version = 99;
    assert!(matches!(
        Controller::from_snapshot(snap),
        Err(kvd_core::Error::Protocol(_))
    ));
}

#[test]
fn when_every_worker_dies_interrupted_requests_fail_with_a_reason() {
    let mut c = cluster(PolicyKind::Lumen, 2);
    decoding(&mut c, 1, 0, 1);
    let plan = c.fail_workers(&[0, 1], 10).unwrap();
    assert!(plan.failed_requests[0].2.contains("no surviving worker"));
    assert_eq!(c.in_flight(), 0);
}

#[test]
fn one_workers_checkpoints_spread_over_every_holder_so_its_failure_restores_locally_everywhere() {
    // Holders 1-7 wait 7..1 ms; each checkpoint is ~10.7 ms of restore at the default
    // bandwidth, more than the spread of the queues. The per-server rule (lumen) deals worker
    // 0's 28 checkpoints round-robin; the mean rule (lumen_mean) piles them on the fastest queue,
    // so the failure's restores queue there or are moved off it and pulled over the network.
    let mut outcome = Vec::new();
    for policy in [PolicyKind::Lumen, PolicyKind::LumenMean] {
        let mut c = cluster(policy, 8);
        let waits: Vec<(u64, WorkerId, u64)> = (1..8)
            .map(|w| (1000 + u64::from(w), w, u64::from(8 - w)))
            .collect();
        queue_delays(&mut c, &waits);
        let mut per_holder = [0u32; 8];
        for id in 0..28 {
            let h = decoding(&mut c, id, 0, 10).expect("room for every checkpoint");
            per_holder[h as usize] += 1;
        }
        let plan = c.fail_workers(&[0], 100).unwrap();
        assert_eq!(plan.restores.len(), 28, "{policy}");
        let remote = plan
            .restores
            .iter()
            .filter(|r| r.kv_source != Some(r.target))
            .count();
        outcome.push((per_holder, remote, plan.rebalance_moves));
        c.check_invariants().unwrap();
    }
    let (spread, remote, moves) = outcome[0];
    assert_eq!(spread, [0, 4, 4, 4, 4, 4, 4, 4], "lumen deals round-robin");
    assert_eq!(
        (remote, moves),
        (0, 0),
        "every restore is local, nothing moves"
    );
    let (herded, remote, moves) = outcome[1];
    assert!(
        herded[7] > 4,
        "lumen_mean herds onto the fastest queue: {herded:?}"
    );
    assert!(
        remote > 0 && moves > 0,
        "so rebalancing pulls KV over the network"
    );
}

#[test]
fn every_placement_variant_keeps_the_holder_off_the_serving_worker_across_a_handoff_and_a_failure()
{
    for policy in PolicyKind::ALL {
        let mut c = cluster(policy, 4);
        let a = c
            .admit(
                AdmitRequest {
                    request_id: 1,
                    serving: 0,
                    prompt_tokens: 1024,
                    max_new_tokens: 512,
                    reserve_bytes: 256 * MIB,
                    deadline_ms: None,
                },
                0,
            )
            .unwrap();
        c.prefill_started(1, a.epoch, 5).unwrap();
        // Prefill on 0, decode on the holder: the checkpoint must move elsewhere.
        let to = a.holder.unwrap_or(1);
        c.transfer_started(1, a.epoch, to, 40).unwrap();
        let r = c.request(1).unwrap();
        assert_eq!(r.serving, to, "{policy}");
        assert_ne!(r.holder, Some(to), "{policy}: never its own holder");
        assert_eq!(
            r.holder.is_some(),
            policy != PolicyKind::StopRestart,
            "{policy}"
        );
        let plan = c.fail_workers(&[to], 100).unwrap();
        assert_eq!(plan.restores.len(), 1, "{policy}");
        for r in &plan.restores {
            assert_ne!(r.new_holder, Some(r.target), "{policy}");
        }
        c.check_invariants().unwrap();
    }
}
