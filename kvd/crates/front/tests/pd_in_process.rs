//! Prefill/decode disaggregation in one process: the real controller, the front's state machine
//! and tasks, scripted decode workers (1, 2, 3) and prefill workers (11, 12) whose prefills pin
//! the prompt's blocks under a hold, as kvd's producer connector does (`scripted/`). Each failure
//! window of the hand-off: the client gets the uninterrupted greedy run (or a clear error), the
//! holds end exactly once, and nothing is left running or pinned.

mod scripted;

use kvd_control::{Event, RequestState};
use kvd_front::machine::{Action, Input, Request, State};
use scripted::{Cluster, FIRST_PREFILL, Fault, PREFILL_MS, admitted, args, eventually, prompt};
use serde_json::json;

const P1: u32 = FIRST_PREFILL;
const P2: u32 = FIRST_PREFILL + 1;

/// The request ended, its holds and connections are gone, and its reservation is released.
async fn nothing_left(c: &Cluster, id: u64, state: RequestState) {
    eventually(2_000, "the request ends", || {
        c.hub().request(id).unwrap().state == state
    })
    .await;
    eventually(2_000, "nothing runs, nothing is pinned", || {
        c.engines.idle() && c.engines.holds().is_empty()
    })
    .await;
    assert!(c.hub().load().iter().all(|w| w.reserved_bytes == 0));
    assert_eq!(c.front.status()["active"], json!({}));
}

#[tokio::test(start_paused = true)]
async fn a_prefill_hands_off_to_the_decode_worker_which_ends_the_hold_at_its_first_token() {
    let c = Cluster::pd(3, 2, args());
    let (id, mut client) = c.start(&prompt(40), 12).await;
    client.read_tokens(1).await;
    eventually(100, "the hold ends at the first token", || {
        c.engines.hold_ends() == [(P1, id, 1)]
    })
    .await;
    client.read_to_end().await;
    client.assert_greedy(12);
    nothing_left(&c, id, RequestState::Completed).await;
    assert_eq!(c.engines.hold_ends(), [(P1, id, 1)], "exactly once");
    let pre = &c.engines.prefills()[0];
    assert_eq!(
        pre.worker, P1,
        "fewest prefills running, then the lowest id"
    );
    assert_eq!(
        (&pre.body["max_tokens"], &pre.body["stream"]),
        (&json!(1), &json!(false))
    );
    assert_eq!(pre.body["kv_transfer_params"]["do_remote_decode"], true);
    assert_eq!(
        pre.body["kv_transfer_params"]["kvd"],
        json!({"request": id, "epoch": 1})
    );
    let first = &client.got[0].data;
    assert_eq!(
        (
            first["kvd"]["worker"].as_u64(),
            first["kvd"]["seq"].as_u64()
        ),
        (Some(u64::from(P1)), Some(0)),
        "the first token is the prefill's, relayed at its answer"
    );
    let decode = &c.engines.calls()[0];
    let mut history = prompt(40);
    history.push(scripted::next_token(&history));
    assert_eq!(
        (&decode.body["prompt"], &decode.body["max_tokens"]),
        (&json!(history), &json!(11)),
        "the decode continues from prompt + the prefill's token"
    );
    let p = &decode.body["kv_transfer_params"];
    assert_eq!(
        p["do_remote_prefill"], true,
        "the answer's params, unchanged"
    );
    assert_eq!(p["remote_engine_id"], format!("scripted-{P1}"));
    assert_eq!(p["kvd"]["handoff"]["node"], P1);
    assert_eq!(
        p["kvd"]["checkpoint"]["epoch"], 1,
        "kvd's own entries added"
    );
    assert_eq!(
        c.engines.loads(),
        [(decode.worker, P1, 1, true)],
        "the decode loaded the held blocks"
    );
    let s = c.front.stats();
    assert_eq!(
        (
            s.prefills_started,
            s.handoffs_started,
            s.handoffs_done,
            s.holds_ended
        ),
        (1, 1, 1, 1)
    );
    assert_eq!(s.prefill_ms, PREFILL_MS);
    assert_eq!(s.first_tokens_from_prefill, 1);
    let h = &c.front.status()["handoffs"][0];
    assert_eq!(
        (h["prefill"].as_u64(), h["hold_node"].as_u64()),
        (Some(11), Some(11))
    );
    assert_eq!(c.hub().request(id).unwrap().epoch, 1);
}

#[tokio::test(start_paused = true)]
async fn prefills_go_to_the_prefill_worker_with_the_fewest_running() {
    let c = Cluster::pd(3, 2, args());
    let (_, mut a) = c.start(&prompt(40), 4).await;
    let (_, mut b) = c.start(&prompt(41), 4).await;
    a.read_to_end().await;
    b.read_to_end().await;
    let workers: Vec<u32> = c.engines.prefills().iter().map(|p| p.worker).collect();
    assert_eq!(workers, [P1, P2]);
}

#[tokio::test(start_paused = true)]
async fn a_prefill_that_dies_is_redone_on_another_prefill_worker() {
    let c = Cluster::pd(3, 2, args());
    c.engines.script(P1, &[Fault::KillAt(0)]);
    let (id, client) = c.run(&[], 12).await;
    client.assert_greedy(12);
    nothing_left(&c, id, RequestState::Completed).await;
    let pre = c.engines.prefills();
    let tried: Vec<(u32, u64)> = pre
        .iter()
        .map(|p| {
            (
                p.worker,
                p.body["kv_transfer_params"]["kvd"]["epoch"]
                    .as_u64()
                    .unwrap(),
            )
        })
        .collect();
    assert_eq!(tried, [(P1, 1), (P2, 2)], "epoch + 1 on the other worker");
    assert_eq!(
        c.engines.hold_ends(),
        [(P1, id, 1), (P2, id, 2)],
        "the broken prefill's epoch (it may have held), then the hold that exists, once each"
    );
    assert_eq!(
        c.engines.calls()[0].body["kv_transfer_params"]["kvd"]["checkpoint"]["epoch"],
        2
    );
    assert_eq!(
        c.hub().request(id).unwrap().epoch,
        2,
        "the controller follows"
    );
    let s = c.front.stats();
    assert_eq!(
        (s.prefill_retries, s.handoffs_done, s.self_prefills),
        (1, 1, 0)
    );
}

#[tokio::test(start_paused = true)]
async fn a_silent_prefill_is_given_up_after_the_engine_timeout_and_its_connection_dropped() {
    let c = Cluster::pd(3, 2, args());
    c.engines.script(P1, &[Fault::StallAt(0)]);
    let t0 = tokio::time::Instant::now();
    let (id, client) = c.run(&[], 8).await;
    client.assert_greedy(8);
    assert!(t0.elapsed().as_millis() >= 300, "--engine-timeout-ms");
    assert_eq!(
        c.engines.open_prefills(P1),
        0,
        "the silent prefill's connection is dropped"
    );
    nothing_left(&c, id, RequestState::Completed).await;
    assert_eq!(c.engines.hold_ends(), [(P1, id, 1), (P2, id, 2)]);
}

#[tokio::test(start_paused = true)]
async fn when_no_prefill_worker_is_left_the_decode_worker_prefills_the_prompt_itself() {
    let c = Cluster::pd(3, 2, args());
    c.engines.script(P1, &[Fault::DropAt(0)]); // 500: the worker is in trouble
    c.engines.script(P2, &[Fault::KillAt(0)]);
    let (id, client) = c.run(&[], 12).await;
    client.assert_greedy(12);
    nothing_left(&c, id, RequestState::Completed).await;
    assert_eq!(
        c.engines.prefills().len(),
        2,
        "once per prefill worker, no more"
    );
    let decode = &c.engines.calls()[0].body;
    assert!(
        decode["kv_transfer_params"]
            .get("do_remote_prefill")
            .is_none(),
        "a colocated attempt: {decode}"
    );
    assert_eq!(
        decode["kv_transfer_params"]["kvd"]["checkpoint"]["epoch"],
        3
    );
    assert_eq!(
        c.engines.hold_ends(),
        [(P1, id, 1), (P2, id, 2)],
        "each broken prefill's epoch ends (a late hold there is refused), nothing more"
    );
    let s = c.front.stats();
    assert_eq!(
        (s.prefill_retries, s.self_prefills, s.handoffs_started),
        (2, 1, 0)
    );
}

#[tokio::test(start_paused = true)]
async fn a_prefill_that_refuses_the_request_fails_it_with_a_clear_error() {
    let c = Cluster::pd(3, 2, args());
    c.engines.script(P1, &[Fault::Refuse]);
    let (id, client) = c.run(&[], 12).await;
    let err = client.error().expect("an error event");
    assert!(
        err.contains("prefill worker refused the request (400)"),
        "{err}"
    );
    assert!(client.done() && client.tokens().is_empty());
    nothing_left(&c, id, RequestState::Failed).await;
    assert!(c.engines.calls().is_empty(), "no decode attempt");
    assert_eq!(c.engines.prefills().len(), 1, "no retry of a refusal");
    assert!(c.engines.hold_ends().is_empty());
    assert_eq!(c.front.stats().prefills_refused, 1);
}

#[tokio::test(start_paused = true)]
async fn an_answer_that_hands_nothing_over_leaves_the_prefill_to_the_decode_worker() {
    let c = Cluster::pd(3, 2, args());
    c.engines.script(P1, &[Fault::NoHandoff]);
    let (id, client) = c.run(&[], 10).await;
    client.assert_greedy(10);
    nothing_left(&c, id, RequestState::Completed).await;
    let decode = &c.engines.calls()[0].body;
    assert!(
        decode["kv_transfer_params"]
            .get("do_remote_prefill")
            .is_none()
    );
    assert!(c.engines.hold_ends().is_empty(), "the answer named no hold");
    assert_eq!(c.front.stats().self_prefills, 1);
}

#[tokio::test(start_paused = true)]
async fn a_decode_that_dies_before_its_first_token_resumes_on_a_survivor_with_the_hand_off() {
    let c = Cluster::pd(3, 2, args());
    let (id, client) = c.run(&[Fault::KillAt(0)], 12).await;
    client.assert_greedy(12);
    nothing_left(&c, id, RequestState::Completed).await;
    let calls = c.engines.calls();
    assert_eq!(calls.len(), 2);
    assert_ne!(calls[0].worker, calls[1].worker, "on a survivor");
    let (first, second) = (
        &calls[0].body["kv_transfer_params"],
        &calls[1].body["kv_transfer_params"],
    );
    assert_eq!(second["do_remote_prefill"], true, "{second}");
    assert_eq!(
        second["kvd"]["handoff"], first["kvd"]["handoff"],
        "the same hold"
    );
    assert_eq!(second["kvd"]["checkpoint"]["epoch"], 2);
    assert_eq!(
        calls[1].body["prompt"], calls[0].body["prompt"],
        "from prompt + the prefill's token, which the client already has"
    );
    assert_eq!(c.engines.prefills().len(), 1, "no second prefill");
    assert_eq!(
        c.engines.hold_ends(),
        [(P1, id, 1)],
        "once, after the survivor's first token"
    );
    assert!(
        c.engines.loads().iter().all(|l| l.3),
        "the source still held the blocks"
    );
    let s = c.front.stats();
    assert_eq!(
        (s.handoffs_resumed, s.recoveries, s.handoffs_done),
        (1, 1, 1)
    );
}

#[tokio::test(start_paused = true)]
async fn a_decode_that_dies_mid_stream_resumes_as_in_colocated_mode() {
    let c = Cluster::pd(3, 2, args());
    let (id, client) = c.run(&[Fault::KillAt(5)], 15).await;
    client.assert_greedy(15);
    nothing_left(&c, id, RequestState::Completed).await;
    let resumed = &c.engines.calls()[1].body["kv_transfer_params"];
    assert!(
        resumed.get("do_remote_prefill").is_none(),
        "tokens were generated: {resumed}"
    );
    assert!(
        resumed["kvd"]["restore"].is_object(),
        "the checkpoint restores it"
    );
    assert_eq!(
        c.engines.hold_ends(),
        [(P1, id, 1)],
        "ended at the first token, once"
    );
    assert_eq!(c.front.stats().handoffs_resumed, 0);
}

#[tokio::test(start_paused = true)]
async fn a_decode_that_refuses_the_hand_off_ends_the_hold_and_fails_the_request() {
    let c = Cluster::pd(3, 2, args());
    let (id, client) = c.run(&[Fault::Refuse], 12).await;
    let err = client.error().expect("an error event");
    assert!(err.contains("refused the request (400)"), "{err}");
    nothing_left(&c, id, RequestState::Failed).await;
    assert_eq!(c.engines.hold_ends(), [(P1, id, 1)]);
    assert_eq!(c.front.stats().handoffs_refused, 1);
}

fn patient() -> kvd_front::FrontArgs {
    let mut a = args();
    a.engine_timeout_ms = 10_000;
    a.reconnect_grace_ms = 100;
    a
}

#[tokio::test(start_paused = true)]
async fn a_client_that_leaves_during_the_prefill_drops_it_and_ends_the_hold_it_may_have_made() {
    let c = Cluster::pd(3, 2, patient());
    c.engines.script(P1, &[Fault::StallAt(0)]);
    let (id, mut client) = c.start(&prompt(40), 12).await;
    client.leave();
    nothing_left(&c, id, RequestState::Cancelled).await;
    assert_eq!(
        c.engines.open_prefills(P1),
        0,
        "the prefill's connection is dropped"
    );
    assert_eq!(c.engines.hold_ends(), [(P1, id, 1)]);
    assert!(c.engines.calls().is_empty());
    assert_eq!(c.front.stats().handoffs_cancelled, 1);
}

#[tokio::test(start_paused = true)]
async fn a_client_that_leaves_during_the_transfer_cancels_the_decode_and_ends_the_hold() {
    let c = Cluster::pd(3, 2, patient());
    let (id, mut client) = c.start_with(&[Fault::StallAt(0)], 12).await;
    client.leave();
    nothing_left(&c, id, RequestState::Cancelled).await;
    assert_eq!(c.engines.calls().len(), 1, "the decode attempt was sent");
    assert_eq!(c.engines.hold_ends(), [(P1, id, 1)]);
    assert_eq!(c.front.stats().handoffs_cancelled, 1);
}

fn answer(node: u32, epoch: u64) -> serde_json::Value {
    json!({"kv_transfer_params": {"do_remote_prefill": true,
        "kvd": {"handoff": {"node": node, "namespace": "00", "blocks": 1, "request": 9, "epoch": epoch}}}})
}

fn holds_ended(actions: &[Action]) -> Vec<(u32, u64)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::EndHold { node, epoch, .. } => Some((*node, *epoch)),
            _ => None,
        })
        .collect()
}

fn token(t: u32, last: bool) -> String {
    let finish = last.then_some("length");
    json!({"choices": [{"text": "x", "token_ids": [t], "finish_reason": finish}]}).to_string()
}

/// A P/D request whose prefill broke on 11 and was sent again to 12 under epoch 2.
fn retried_on_12() -> Request {
    let mut m = Request::disaggregated(admitted(2));
    let a = m.on(Input::Start, 0);
    assert!(
        a.contains(&Action::PickPrefill {
            epoch: 1,
            tried: vec![]
        }),
        "{a:?}"
    );
    let a = m.on(
        Input::PrefillWorker {
            epoch: 1,
            worker: Some(11),
        },
        0,
    );
    assert!(
        a.iter()
            .any(|a| matches!(a, Action::Prefill(at) if at.worker == 11))
    );
    let a = m.on(
        Input::PrefillBroken {
            epoch: 1,
            reason: "reset".into(),
        },
        5,
    );
    let retried = Event::PrefillRetried {
        request_id: 9,
        epoch: 1,
    };
    assert!(a.contains(&Action::Control(retried)));
    assert_eq!(
        holds_ended(&a),
        [(11, 1)],
        "the broken prefill's epoch ends"
    );
    assert!(
        a.contains(&Action::PickPrefill {
            epoch: 2,
            tried: vec![11]
        }),
        "{a:?}"
    );
    m.on(
        Input::PrefillWorker {
            epoch: 2,
            worker: Some(12),
        },
        5,
    );
    m
}

#[test]
fn an_older_epochs_prefill_answer_is_dropped_counted_and_its_hold_ended() {
    let mut m = retried_on_12();
    let a = m.on(
        Input::PrefillDone {
            epoch: 1,
            answer: answer(11, 1),
        },
        6,
    );
    assert!(
        holds_ended(&a).is_empty(),
        "the late answer's hold was ended at the break already (once)"
    );
    assert_eq!(
        (m.stale_dropped(), m.state(), m.epoch()),
        (1, State::Prefilling, 2)
    );
    let a = m.on(
        Input::PrefillDone {
            epoch: 1,
            answer: answer(11, 1),
        },
        6,
    );
    assert!(holds_ended(&a).is_empty(), "a hold is ended once");
    let a = m.on(
        Input::PrefillDone {
            epoch: 2,
            answer: answer(12, 2),
        },
        7,
    );
    let transfer = Event::TransferStarted {
        request_id: 9,
        epoch: 2,
        to: 1,
    };
    assert!(a.contains(&Action::Control(transfer)));
    assert!(a.iter().any(|a| matches!(a, Action::Forward(at)
        if at.body["kv_transfer_params"]["kvd"]["handoff"]["node"] == 12)));
    assert_eq!(m.state(), State::Transferring);
}

#[test]
fn the_first_token_ends_the_hold_and_no_later_state_ends_it_again() {
    let mut m = retried_on_12();
    m.on(
        Input::PrefillDone {
            epoch: 2,
            answer: answer(12, 2),
        },
        7,
    );
    let a = m.on(
        Input::EngineEvent {
            epoch: 2,
            data: token(5, false),
        },
        8,
    );
    assert_eq!(holds_ended(&a), [(12, 2)], "the first token ends the hold");
    assert_eq!(m.state(), State::Decoding);
    let mut rest = m.on(
        Input::EngineEvent {
            epoch: 2,
            data: token(6, true),
        },
        9,
    );
    rest.extend(m.on(
        Input::EngineEvent {
            epoch: 2,
            data: "[DONE]".into(),
        },
        9,
    ));
    assert!(holds_ended(&rest).is_empty(), "never twice");
    assert_eq!(m.state(), State::Completed);
    let late = m.on(
        Input::PrefillDone {
            epoch: 2,
            answer: answer(12, 2),
        },
        10,
    );
    assert!(late.is_empty(), "a terminal request takes nothing");
}

#[tokio::test(start_paused = true)]
async fn a_seeded_sampler_gets_its_first_token_from_the_decode_which_draws_every_token() {
    let c = Cluster::pd(3, 2, args());
    let (id, log, guard) = scripted::admit_stream(
        &c.front,
        json!({"model": "m", "prompt": prompt(40), "max_tokens": 6, "stream": true,
            "temperature": 0.8, "seed": 7, "return_token_ids": true}),
    )
    .await
    .unwrap();
    let mut client = scripted::Client::new(log, guard, 0);
    client.read_to_end().await;
    assert_eq!(client.tokens(), scripted::greedy(&prompt(40), 6));
    nothing_left(&c, id, RequestState::Completed).await;
    let decode = &c.engines.calls()[0];
    assert_eq!(
        (&decode.body["prompt"], &decode.body["max_tokens"]),
        (&json!(prompt(40)), &json!(6)),
        "a fresh generator would draw the second token: the decode draws the first"
    );
    assert_ne!(client.got[0].data["kvd"]["worker"], json!(P1));
    let s = c.front.stats();
    assert_eq!((s.handoffs_done, s.first_tokens_from_prefill), (1, 0));
}

#[tokio::test(start_paused = true)]
async fn a_request_for_one_token_ends_at_the_prefills_answer_and_its_hold_ends() {
    let c = Cluster::pd(3, 2, args());
    let (id, mut client) = c.start(&prompt(40), 1).await;
    client.read_to_end().await;
    assert_eq!(client.tokens(), scripted::greedy(&prompt(40), 1));
    assert_eq!(
        client.got[0].data["choices"][0]["finish_reason"], "length",
        "its one token was the last"
    );
    nothing_left(&c, id, RequestState::Completed).await;
    assert!(c.engines.calls().is_empty(), "no decode was sent");
    assert_eq!(c.engines.hold_ends(), [(P1, id, 1)], "the hold ends once");
}
