//! Unit tests of the controller's rooms (the scenario and property tests are in kvd/tests).

use super::*;
use crate::Error;
use crate::request::RequestState;
use crate::{MAX_WORKERS, WorkerId};

fn cluster(n: u32, cap: u64) -> Controller {
    let mut c = Controller::new(ControlConfig::default()).unwrap();
    for w in 0..n {
        c.add_worker(w, cap, 0).unwrap();
    }
    c
}

fn req(id: RequestId, serving: WorkerId, reserve: u64) -> AdmitRequest {
    AdmitRequest {
        request_id: id,
        serving,
        prompt_tokens: 100,
        max_new_tokens: 100,
        reserve_bytes: reserve,
        deadline_ms: None,
    }
}

#[test]
fn admission_reserves_on_a_holder_and_finishing_releases_it() {
    let mut c = cluster(3, 1000);
    let a = c.admit(req(1, 0, 400), 0).unwrap();
    let h = a.holder.unwrap();
    assert_ne!(h, 0);
    assert_eq!(c.load().get(h).unwrap().reserved_bytes, 400);
    c.finished(1, a.epoch, 5).unwrap();
    assert_eq!(c.load().get(h).unwrap().reserved_bytes, 0);
    assert_eq!(c.request(1).unwrap().state, RequestState::Completed);
    c.check_invariants().unwrap();
}

#[test]
fn a_request_with_no_candidate_runs_without_a_checkpoint_and_is_counted() {
    let mut c = cluster(2, 100);
    let a = c.admit(req(1, 0, 400), 0).unwrap();
    assert_eq!(a.holder, None);
    assert_eq!(c.stats().no_holder, 1);
}

#[test]
fn prefill_start_feeds_the_serving_workers_queueing_delay() {
    let mut c = cluster(2, 1000);
    c.admit(req(1, 0, 0), 100).unwrap();
    c.prefill_started(1, 1, 130).unwrap();
    assert_eq!(c.load().get(0).unwrap().queue_delay_ms(), 30.0);
    // A replay adds no second sample.
    c.prefill_started(1, 1, 500).unwrap();
    assert_eq!(c.load().get(0).unwrap().delay_samples(), 1);
}

#[test]
fn a_recovery_goes_to_the_survivor_with_no_prefill_queued_and_the_queue_is_transient() {
    // Worker 1 was sent a request it has not started to prefill (the front tells the start at
    // the first token); worker 2 has nothing queued. Their `q_w` are equal (no samples), so
    // only the queued prefill tells them apart: worker 0's request, with no checkpoint, is
    // recomputed on worker 2, not on the lower id.
    let mut c = cluster(3, 1000);
    c.admit(req(1, 0, 0), 0).unwrap();
    c.prefill_started(1, 1, 5).unwrap();
    c.admit(req(2, 1, 0), 10).unwrap();
    let plan = c.fail_workers(&[0], 20).unwrap();
    assert_eq!(plan.restores.len(), 1);
    assert_eq!(
        (plan.restores[0].request_id, plan.restores[0].target),
        (1, 2)
    );
    assert!(
        c.load().iter().all(|w| w.queued_prefill_ms == 0.0),
        "set for the dispatch only"
    );
    // The plan says what the dispatch saw of each survivor: worker 1's queued prompt
    let seen: Vec<(u32, u32, bool)> = plan
        .survivors
        .iter()
        .map(|s| (s.worker, s.serving, s.queued_prefill_ms > 0))
        .collect();
    assert_eq!(seen, vec![(1, 1, true), (2, 0, false)]);
    c.check_invariants().unwrap();
}

#[test]
fn admission_beyond_the_in_flight_cap_is_overloaded_and_retryable() {
    let mut c = Controller::new(ControlConfig {
        max_in_flight: 2,
        ..ControlConfig::default()
    })
    .unwrap();
    c.add_worker(0, 0, 0).unwrap();
    c.admit(req(1, 0, 0), 0).unwrap();
    c.admit(req(2, 0, 0), 0).unwrap();
    let e = c.admit(req(3, 0, 0), 0).unwrap_err();
    assert!(e.is_retryable(), "{e}");
}

#[test]
fn a_handoff_to_the_holder_moves_the_checkpoint_elsewhere() {
    let mut c = cluster(3, 1000);
    let a = c.admit(req(1, 0, 100), 0).unwrap();
    let h = a.holder.unwrap();
    let d = c.transfer_started(1, 1, h, 1).unwrap();
    let r = c.request(1).unwrap();
    assert_eq!(r.serving, h);
    assert_ne!(r.holder, Some(h));
    assert!(matches!(d[..], [Decision::Checkpoint { .. }]));
    c.check_invariants().unwrap();
}

#[test]
fn a_retried_prefill_moves_the_epoch_on_and_drops_the_old_epochs_events() {
    let mut c = cluster(3, 1000);
    c.admit(req(1, 0, 100), 0).unwrap();
    c.prefill_started(1, 1, 1).unwrap();
    c.prefill_retried(1, 1, 2).unwrap();
    let r = c.request(1).unwrap();
    assert_eq!(
        (r.epoch, r.state, r.serving),
        (2, RequestState::Migrating, 0)
    );
    assert!(matches!(
        c.transfer_started(1, 1, 0, 3),
        Err(Error::StaleEpoch { .. })
    ));
    c.prefill_started(1, 2, 3).unwrap();
    c.transfer_started(1, 2, 0, 4).unwrap();
    assert!(
        matches!(c.prefill_retried(1, 2, 5), Err(Error::InvalidArgument(_))),
        "past the prefill, a retry is refused"
    );
    assert_eq!(c.request(1).unwrap().migrations, 0, "no budget spent");
    c.check_invariants().unwrap();
}

#[test]
fn an_epoch_never_issued_is_refused() {
    let mut c = cluster(2, 1000);
    c.admit(req(1, 0, 0), 0).unwrap();
    assert!(matches!(
        c.prefill_started(1, 7, 1),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(c.request(1).unwrap().state, RequestState::Admitted);
}

#[test]
fn a_config_out_of_bounds_is_refused() {
    for bad in [
        ControlConfig {
            lambda: f64::NAN,
            ..ControlConfig::default()
        },
        ControlConfig {
            max_workers: MAX_WORKERS + 1,
            ..ControlConfig::default()
        },
        ControlConfig {
            queue_delay_window: 0,
            ..ControlConfig::default()
        },
    ] {
        assert!(Controller::new(bad).is_err());
    }
}
