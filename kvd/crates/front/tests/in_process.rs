//! The streaming front in one process: the real controller, the front's state machine and
//! tasks, and scripted engines and holders (`scripted/`). Time is tokio's, paused: every
//! timeout (silence, health checks, a client's grace, the deadline) runs in no wall time, in
//! the same order every run.

mod scripted;

use kvd_control::{ControlConfig, Decision, Event, RequestState, RestorePlan};
use kvd_front::machine::{Action, Input, Request, State};
use scripted::{Cluster, Fault, admitted, args, eventually, greedy, prompt, resume};

const PROMPT: u32 = scripted::PROMPT_TOKENS;

#[tokio::test(start_paused = true)]
async fn an_uninterrupted_stream_relays_the_greedy_run_numbered_from_zero_and_ends_with_done() {
    let c = Cluster::new(3);
    let (id, mut client) = c.start(&prompt(PROMPT), 20).await;
    client.read_to_end().await;
    assert_eq!(client.tokens(), greedy(&prompt(PROMPT), 20));
    assert_eq!(
        client.seqs(),
        (0..=20).collect::<Vec<_>>(),
        "20 tokens, then [DONE]"
    );
    assert!(client.done() && client.error().is_none());
    assert_eq!(client.got[0].data["kvd"]["epoch"], 1);
    assert_eq!(
        client.got[0].data["prompt_token_ids"]
            .as_array()
            .unwrap()
            .len(),
        PROMPT as usize
    );
    eventually(100, "the request completes", || {
        c.hub().request(id).unwrap().state == RequestState::Completed
    })
    .await;
    let s = c.front.stats();
    assert_eq!(
        (s.streams_started, s.streams_finished, s.tokens_relayed),
        (1, 1, 20)
    );
    let holder = c.engines.calls()[0].body["kv_transfer_params"]["kvd"]["checkpoint"]["holder"]
        .as_u64()
        .unwrap() as u32;
    assert_ne!(holder, 1, "the holder is never the serving worker");
    eventually(100, "the checkpoint is ended", || {
        c.engines.ended().contains(&(holder, id, 1))
    })
    .await;
    assert!(c.engines.held(holder, id).is_none());
    assert!(
        s.checkpoint_tokens > 0,
        "what the holder held at the end is counted"
    );
}

#[tokio::test(start_paused = true)]
async fn a_progress_report_that_lands_after_the_request_ended_is_dropped_not_clamped() {
    // The front asks the holder what it holds as tokens arrive, each ask on its own task. A
    // slow holder answers after the stream ended and released the reservation: that answer is
    // stale, not a holder holding more than its reservation.
    let c = Cluster::new(3);
    c.engines
        .holders_answer_after(std::time::Duration::from_millis(900)); // within PROBE_TIMEOUT
    // 250 tokens at 10 ms: the front asks at 2 s (its progress tick) and hears at 2.9 s, after
    // the stream's end at about 2.5 s
    let (id, mut client) = c.start(&prompt(PROMPT), 250).await;
    client.read_to_end().await;
    assert_eq!(client.tokens(), greedy(&prompt(PROMPT), 250));
    eventually(100, "the request completes", || {
        c.hub().request(id).unwrap().state == RequestState::Completed
    })
    .await;
    assert_eq!(c.hub().request(id).unwrap().reserved_bytes, 0);
    tokio::time::sleep(std::time::Duration::from_secs(3)).await; // every ask answered
    let s = c.front.stats();
    assert!(
        s.checkpoint_tokens > 0,
        "the end measured the holder: {s:?}"
    );
    assert_eq!(s.checkpoint_reports_clamped, 0, "{s:?}");
}

#[tokio::test(start_paused = true)]
async fn with_a_resume_priority_only_the_attempt_that_resumes_carries_it() {
    let mut a = args();
    a.resume_priority = Some(-1);
    let c = Cluster::with(3, ControlConfig::default(), a);
    let (_, client) = c.run(&[Fault::KillAt(5)], 12).await;
    client.assert_greedy(12);
    let calls = c.engines.calls();
    assert_eq!(calls.len(), 2);
    assert_eq!(
        calls[0].body.get("priority"),
        None,
        "a first attempt queues as any"
    );
    assert_eq!(
        calls[1].body["priority"], -1,
        "the survivor takes the resumed one first"
    );
}

#[tokio::test(start_paused = true)]
async fn a_kill_during_prefill_resumes_on_a_survivor_from_the_prompt() {
    let c = Cluster::new(3);
    let (id, client) = c.run(&[Fault::KillAt(0)], 12).await;
    client.assert_greedy(12);
    let rec = &c.front.status()["recoveries"][0];
    assert_eq!(rec["committed_tokens"], 0);
    assert_eq!(rec["from"], 1);
    assert_ne!(rec["to"], 1);
    assert_eq!(c.hub().request(id).unwrap().epoch, 2);
    let calls = c.engines.calls();
    assert_eq!(calls.len(), 2);
    assert_eq!(
        calls[1].body["prompt"], calls[0].body["prompt"],
        "nothing committed: the prompt alone"
    );
    let s = c.front.stats();
    assert_eq!(
        (s.recoveries, s.workers_failed),
        (1, 1),
        "one worker failed, one recovery"
    );
}

#[tokio::test(start_paused = true)]
async fn a_kill_at_token_k_resumes_on_the_holder_with_the_committed_prefix() {
    let c = Cluster::new(3);
    let (id, mut client) = c.start_with(&[Fault::KillAt(7)], 20).await;
    let holder = c.holder(id).unwrap();
    client.read_to_end().await;
    assert_eq!(
        client.tokens(),
        greedy(&prompt(PROMPT), 20),
        "greedy continuation is exact"
    );
    assert!(client.error().is_none());
    let seqs = client.seqs();
    assert_eq!(
        seqs,
        (0..seqs.len() as u64).collect::<Vec<_>>(),
        "no gap, no repeat"
    );
    let status = c.front.status();
    let rec = &status["recoveries"][0];
    assert_eq!(rec["committed_tokens"], 7);
    assert_eq!(rec["kv_source"], holder);
    assert_eq!(rec["to"], holder, "the holder has the KV: it resumes");
    assert!(
        rec["load_tokens"].as_u64().unwrap() >= u64::from(PROMPT) + 7 - 16,
        "{rec}"
    );
    let resumed = &c.engines.calls()[1];
    assert_eq!(resumed.worker, holder);
    let mut history = prompt(PROMPT);
    history.extend(greedy(&prompt(PROMPT), 7));
    assert_eq!(
        resumed.body["prompt"],
        serde_json::json!(history),
        "prompt + committed tokens"
    );
    assert_eq!(resumed.body["max_tokens"], 13, "the remaining budget");
    let restore = &resumed.body["kv_transfer_params"]["kvd"]["restore"];
    assert_eq!(
        (restore["holder"].as_u64(), restore["epoch"].as_u64()),
        (Some(u64::from(holder)), Some(1))
    );
    assert_eq!(restore["local"], true);
    assert_eq!(client.got.last().unwrap().data, "[DONE]");
    assert_eq!(
        client.got[10].data["kvd"]["epoch"], 2,
        "events after the break name the new epoch"
    );
    assert_eq!(
        c.front.stats().recoveries_from_checkpoint,
        1,
        "the one recovery loaded a checkpoint"
    );
}

#[tokio::test(start_paused = true)]
async fn a_second_failure_during_the_recovery_moves_the_request_again() {
    let c = Cluster::new(3);
    let (id, client) = c.run(&[Fault::KillAt(5), Fault::KillAt(0)], 15).await;
    client.assert_greedy(15);
    assert_eq!(c.hub().request(id).unwrap().epoch, 3);
    let workers: Vec<u32> = c.engines.calls().iter().map(|c| c.worker).collect();
    assert_eq!(workers.len(), 3);
    let mut distinct = workers.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        3,
        "each attempt on another worker: {workers:?}"
    );
    // a recovery is counted when a survivor streams its first token: the first one never did
    let s = c.front.stats();
    assert_eq!((s.recoveries, s.workers_failed), (1, 2));
}

#[tokio::test(start_paused = true)]
async fn a_hung_engine_is_detected_by_silence_and_the_request_resumes_elsewhere() {
    let c = Cluster::new(3);
    let t0 = tokio::time::Instant::now();
    let (_, mut client) = c.start_with(&[Fault::StallAt(4)], 10).await;
    client.read_to_end().await;
    assert_eq!(client.tokens(), greedy(&prompt(PROMPT), 10));
    let rec = &c.front.status()["recoveries"][0];
    assert!(
        rec["reason"].as_str().unwrap().contains("no event"),
        "{rec}"
    );
    assert_eq!(
        c.engines.open_streams(1),
        0,
        "the silent connection was dropped"
    );
    // silence (300 ms) + an unanswered health check (1 s) + the rest of the run
    assert!(t0.elapsed().as_millis() >= 1300);
}

#[tokio::test(start_paused = true)]
async fn a_client_that_leaves_cancels_the_request_drops_the_engine_connection_ends_the_checkpoint_and_releases_the_reservation()
 {
    let c = Cluster::new(3);
    let (id, mut client) = c.start(&prompt(PROMPT), 10_000).await;
    let (serving, holder) = (c.serving(id), c.holder(id).unwrap());
    client.read_tokens(5).await;
    assert_eq!(c.engines.open_streams(serving), 1);
    client.leave();
    eventually(2_000, "the request is cancelled", || {
        c.hub().request(id).unwrap().state == RequestState::Cancelled
    })
    .await;
    eventually(100, "the stream ends", || {
        c.front.stats().streams_cancelled == 1
    })
    .await;
    assert_eq!(
        c.engines.open_streams(serving),
        0,
        "the engine's connection is dropped"
    );
    eventually(100, "the checkpoint is ended", || {
        c.engines.ended().contains(&(holder, id, 1))
    })
    .await;
    assert!(
        c.hub().load().iter().all(|w| w.reserved_bytes == 0),
        "the reservation is released"
    );
}

#[tokio::test(start_paused = true)]
async fn a_client_that_comes_back_within_the_grace_keeps_the_request_and_gets_exactly_what_follows_its_last_event_id()
 {
    let c = Cluster::new(3);
    let (id, mut first) = c.start(&prompt(PROMPT), 30).await;
    first.read_tokens(5).await;
    first.leave();
    let last = first.got.last().unwrap().seq;
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let mut second = resume(&c.front, id, last);
    second.read_to_end().await;
    assert_eq!(
        second.seqs().first(),
        Some(&(last + 1)),
        "exactly what follows"
    );
    let mut tokens = first.tokens();
    tokens.extend(second.tokens());
    assert_eq!(
        tokens,
        greedy(&prompt(PROMPT), 30),
        "nothing lost, nothing repeated"
    );
    assert!(second.done());
    assert_eq!(c.front.stats().clients_resumed, 1);
    assert_eq!(c.front.stats().streams_cancelled, 0);
}

#[tokio::test(start_paused = true)]
async fn a_plan_that_arrives_while_an_attempt_runs_ends_it_and_resumes_on_the_survivor() {
    let c = Cluster::new(3);
    let (id, mut client) = c.start(&prompt(PROMPT), 25).await;
    let serving = c.serving(id);
    client.read_tokens(6).await;
    // membership (etcd) says the node is gone while its engine still streams
    c.hub().fail(&[serving]).unwrap();
    client.read_to_end().await;
    assert_eq!(client.tokens(), greedy(&prompt(PROMPT), 25));
    assert_eq!(
        c.engines.open_streams(serving),
        0,
        "the old attempt's connection is dropped"
    );
    let rec = &c.front.status()["recoveries"][0];
    assert_eq!(rec["reason"], "a failure event planned it");
    assert!(
        client
            .got
            .iter()
            .filter(|g| g.data["kvd"]["epoch"] == 1)
            .count()
            >= 6
    );
    assert!(
        client
            .got
            .iter()
            .filter(|g| g.data["kvd"]["worker"] == serving)
            .all(|g| g.data["kvd"]["epoch"] == 1),
        "nothing of the old attempt is relayed after the plan"
    );
    assert_eq!(
        c.front.stats().workers_failed,
        0,
        "the front failed nobody: the plan came from outside"
    );
}

fn token(t: u32) -> String {
    serde_json::json!({"choices": [{"text": "x", "token_ids": [t]}]}).to_string()
}

fn relayed(actions: &[Action]) -> usize {
    actions
        .iter()
        .filter(|a| matches!(a, Action::Relay { .. }))
        .count()
}

/// A restore of epoch 2 on worker 3, loading 4 tokens from holder 2, resuming at `resume_seq`.
fn restore_on_3(resume_seq: u64) -> RestorePlan {
    RestorePlan {
        request_id: 9,
        epoch: 2,
        target: 3,
        kv_source: Some(2),
        load_tokens: 4,
        prefill_tokens: 0,
        history_tokens: 4,
        resume_seq,
        new_holder: Some(1),
    }
}

#[test]
fn an_older_epochs_late_events_are_dropped() {
    let mut m = Request::new(admitted(10));
    m.on(Input::Start, 0);
    assert_eq!(
        relayed(&m.on(
            Input::EngineEvent {
                epoch: 1,
                data: token(5)
            },
            1
        )),
        1
    );
    let plan = restore_on_3(1);
    let a = m.on(Input::Plan(Decision::Restore(plan.clone())), 2);
    assert!(
        a.contains(&Action::Cancel { epoch: 1 }),
        "the running attempt ends: {a:?}"
    );
    assert!(
        a.iter()
            .any(|a| matches!(a, Action::Resume(at) if at.epoch == 2 && at.worker == 3))
    );
    assert!(
        m.on(
            Input::EngineEvent {
                epoch: 1,
                data: token(6)
            },
            3
        )
        .is_empty()
    );
    assert!(
        m.on(
            Input::EngineBroken {
                epoch: 1,
                reason: "late".into()
            },
            3
        )
        .is_empty()
    );
    assert!(
        m.on(
            Input::Health {
                epoch: 1,
                alive: false
            },
            3
        )
        .is_empty()
    );
    assert!(
        m.on(Input::Plan(Decision::Restore(plan)), 3).is_empty(),
        "a plan for the epoch it is in is stale"
    );
    assert_eq!(m.stale_dropped(), 4);
    assert_eq!(
        (m.epoch(), m.state(), m.generated()),
        (2, State::Prefilling, &[5][..])
    );
    let a = m.on(
        Input::EngineEvent {
            epoch: 2,
            data: token(7),
        },
        4,
    );
    assert_eq!(relayed(&a), 1);
    assert!(a.iter().any(
        |a| matches!(a, Action::Recovered(r) if r.recovery_ms == 2 && r.committed_tokens == 1)
    ));
    assert_eq!(m.state(), State::Decoding);
}

fn controls(actions: &[Action]) -> Vec<&'static str> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Control(Event::PrefillStarted { .. }) => Some("prefill"),
            Action::Control(Event::DecodingStarted { .. }) => Some("decoding"),
            _ => None,
        })
        .collect()
}

#[test]
fn a_first_prefill_is_told_at_its_first_token_and_a_recoverys_at_its_send() {
    // the controller's q_w is admission → PrefillStarted: told at the send it would read 0
    let mut m = Request::new(admitted(10));
    assert!(controls(&m.on(Input::Start, 0)).is_empty());
    let first = m.on(
        Input::EngineEvent {
            epoch: 1,
            data: token(5),
        },
        40,
    );
    assert_eq!(controls(&first), ["prefill", "decoding"]);
    let more = m.on(
        Input::EngineEvent {
            epoch: 1,
            data: token(6),
        },
        41,
    );
    assert!(controls(&more).is_empty(), "told once: {more:?}");
    let plan = restore_on_3(2);
    let resumed = m.on(Input::Plan(Decision::Restore(plan)), 50);
    assert_eq!(
        controls(&resumed),
        ["prefill"],
        "a recovery's restore is told as it goes out"
    );
    let next = m.on(
        Input::EngineEvent {
            epoch: 2,
            data: token(7),
        },
        60,
    );
    assert_eq!(controls(&next), ["decoding"]);
}

#[tokio::test(start_paused = true)]
async fn an_exhausted_migration_budget_ends_the_stream_with_an_error_event() {
    let config = ControlConfig {
        migration_budget: 1,
        ..ControlConfig::default()
    };
    let c = Cluster::with(3, config, args());
    let (id, client) = c.run(&[Fault::KillAt(3), Fault::KillAt(2)], 20).await;
    let err = client.error().expect("an error event");
    assert!(err.contains("recovery is impossible"), "{err}");
    assert!(client.done());
    assert_eq!(
        client.tokens(),
        greedy(&prompt(PROMPT), 5),
        "what came before the error is exact"
    );
    assert_eq!(c.hub().request(id).unwrap().state, RequestState::Failed);
    assert_eq!(c.front.stats().streams_failed, 1);
}

#[tokio::test(start_paused = true)]
async fn a_break_past_the_deadline_ends_the_stream_with_an_error_event() {
    let mut a = args();
    a.request_deadline_ms = 100;
    let c = Cluster::with(3, ControlConfig::default(), a);
    let (_, client) = c.run(&[Fault::KillAt(15)], 30).await;
    let err = client.error().expect("an error event");
    assert!(err.contains("deadline"), "{err}");
    assert_eq!(client.tokens().len(), 15);
    assert_eq!(c.engines.calls().len(), 1, "no attempt past the deadline");
}

#[tokio::test(start_paused = true)]
async fn a_failure_with_no_survivor_ends_the_stream_with_an_error_event() {
    let c = Cluster::new(2);
    c.hub().fail(&[2]).unwrap();
    c.engines.kill(2);
    let (id, client) = c.run(&[Fault::KillAt(3)], 20).await;
    let err = client.error().expect("an error event");
    assert!(err.contains("recovery is impossible"), "{err}");
    assert_eq!(c.hub().request(id).unwrap().state, RequestState::Failed);
    assert!(c.hub().load().iter().all(|w| w.reserved_bytes == 0));
}

#[tokio::test(start_paused = true)]
async fn a_broken_stream_from_an_engine_that_still_answers_is_not_a_worker_failure() {
    let c = Cluster::new(3);
    let (_, client) = c.run(&[Fault::DropAt(4)], 20).await;
    let err = client.error().expect("an error event");
    assert!(err.contains("still answers"), "{err}");
    assert_eq!(c.front.stats().workers_failed, 0);
}

#[tokio::test(start_paused = true)]
async fn an_engine_that_refuses_the_request_fails_it_without_recovery() {
    let c = Cluster::new(3);
    let (id, client) = c.run(&[Fault::Refuse], 20).await;
    let err = client.error().expect("an error event");
    assert!(err.contains("refused the request (400)"), "{err}");
    assert_eq!(c.hub().request(id).unwrap().state, RequestState::Failed);
    assert_eq!(c.engines.calls().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_holder_that_does_not_answer_is_failed_with_the_worker_and_the_request_is_recomputed() {
    let c = Cluster::new(3);
    let (id, mut client) = c.start_with(&[Fault::KillAt(6)], 12).await;
    let holder = c.holder(id).unwrap();
    c.engines.holder_down(holder);
    c.engines.kill(holder);
    client.read_to_end().await;
    assert_eq!(client.tokens(), greedy(&prompt(PROMPT), 12));
    let rec = &c.front.status()["recoveries"][0];
    assert!(rec["kv_source"].is_null(), "{rec}");
    let s = c.front.stats();
    assert_eq!(
        (
            s.holder_calls_failed,
            s.workers_failed,
            s.recoveries_recomputed
        ),
        (1, 2, 1)
    );
}

#[tokio::test(start_paused = true)]
async fn the_health_watch_fails_a_silent_engine_and_brings_it_back_when_it_answers() {
    let c = Cluster::new(3);
    c.front.spawn_health_watch();
    c.engines.kill(2);
    eventually(5_000, "worker 2 is failed", || {
        c.hub().load().get(2).unwrap().phase == kvd_control::WorkerPhase::Failed
    })
    .await;
    c.engines.revive(2);
    eventually(5_000, "worker 2 is back", || {
        c.hub().load().get(2).unwrap().phase == kvd_control::WorkerPhase::FullService
    })
    .await;
    let s = c.front.stats();
    assert_eq!((s.workers_failed, s.workers_recovered), (1, 1));
}

#[tokio::test(start_paused = true)]
async fn a_worker_that_fails_between_the_pick_and_the_admission_is_routed_around() {
    // routing by load alone (`--cache-routing false`, as in the LUMEN runs): the worker picked
    // before the tokenizer is the one admitted
    let mut a = args();
    a.route.cache_routing = false;
    let c = Cluster::with(3, ControlConfig::default(), a);
    c.engines
        .tokenize_after(std::time::Duration::from_millis(50));
    let front = std::sync::Arc::clone(&c.front);
    let admitting = tokio::spawn(async move {
        scripted::admit_stream(
            &front,
            serde_json::json!({"model": "m", "prompt": "hello", "max_tokens": 8, "stream": true,
                "temperature": 0, "return_token_ids": true}),
        )
        .await
    });
    // every worker idle: the pick is worker 1, whose engine is tokenizing the prompt when
    // another stream's break fails it
    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    c.hub().fail(&[1]).unwrap();
    c.engines.kill(1);
    let (id, log, guard) = admitting
        .await
        .unwrap()
        .expect("admitted on a worker in service");
    assert_eq!(c.serving(id), 2, "the least loaded worker still in service");
    let mut client = scripted::Client::new(log, guard, 0);
    client.read_to_end().await;
    let hello: Vec<u32> = "hello".bytes().map(u32::from).collect();
    assert_eq!(client.tokens(), greedy(&hello, 8));
    assert!(c.engines.calls().iter().all(|call| call.worker != 1));
    assert_eq!(c.front.stats().admissions_repicked, 1);
}

#[tokio::test(start_paused = true)]
async fn requests_past_max_streams_are_refused_and_finished_streams_stay_readable_for_a_while() {
    let mut a = args();
    a.max_streams = 1;
    a.retain_ms = 1_000;
    let c = Cluster::with(3, ControlConfig::default(), a);
    let (id, mut client) = c.start(&prompt(PROMPT), 50).await;
    let refused =
        scripted::admit_stream(&c.front, serde_json::json!({"prompt": [1], "stream": true}))
            .await
            .unwrap_err();
    assert!(
        matches!(refused, kvd_core::Error::Overloaded { .. }),
        "{refused}"
    );
    client.read_to_end().await;
    let late = resume(&c.front, id, 9);
    assert_eq!(late.seqs(), Vec::<u64>::new());
    drop(late);
    tokio::time::sleep(std::time::Duration::from_millis(1_100)).await;
    assert!(c.front.open(id).is_none(), "past --retain-ms it is gone");
    assert_eq!(c.front.retire_finished(), 0);
}

/// The client's text: each event's choice text, in order.
fn text_of(client: &scripted::Client) -> String {
    client
        .got
        .iter()
        .filter_map(|g| g.data["choices"][0]["text"].as_str())
        .collect()
}

/// The last choice's finish and stop reasons.
fn ending_of(client: &scripted::Client) -> (serde_json::Value, serde_json::Value) {
    let last = client
        .got
        .iter()
        .rfind(|g| g.data["choices"][0].is_object())
        .expect("a choice");
    let c = &last.data["choices"][0];
    (c["finish_reason"].clone(), c["stop_reason"].clone())
}

#[tokio::test(start_paused = true)]
async fn a_stop_string_that_spans_the_break_stops_the_request_where_the_uninterrupted_run_stops() {
    // the greedy run's text from token 5 to 9 (" tA tB tC tD"): the kill at token 7 falls inside
    let g = greedy(&prompt(PROMPT), 20);
    let stop: String = g[5..9]
        .iter()
        .map(|t| format!(" t{t}"))
        .collect::<String>()
        .trim()
        .to_string();
    let body = serde_json::json!({"model": "m", "prompt": prompt(PROMPT), "max_tokens": 20,
        "stream": true, "temperature": 0, "return_token_ids": true, "stop": [stop]});
    let run = |c: &Cluster| {
        let body = body.clone();
        let front = std::sync::Arc::clone(&c.front);
        async move {
            let (_, log, guard) = scripted::admit_stream(&front, body).await.unwrap();
            let mut client = scripted::Client::new(log, guard, 0);
            client.read_to_end().await;
            client
        }
    };
    let whole = Cluster::new(3);
    let reference = run(&whole).await;
    let c = Cluster::new(3);
    c.engines.script_any(&[Fault::KillAt(7)]);
    let broken = run(&c).await;
    let want: String = g[..5].iter().map(|t| format!(" t{t}")).collect::<String>() + " ";
    assert_eq!(text_of(&reference), want, "cut before the stop string");
    assert_eq!(
        ending_of(&reference),
        (serde_json::json!("stop"), serde_json::json!(stop))
    );
    assert_eq!(text_of(&broken), text_of(&reference));
    assert_eq!(ending_of(&broken), ending_of(&reference));
    assert!(broken.error().is_none());
    let calls = c.engines.calls();
    assert_eq!(calls.len(), 2, "one recovery");
    assert!(
        calls.iter().all(|a| a.body.get("stop").is_none()),
        "the front applies the stop strings, the engine never sees them"
    );
    assert_eq!(
        calls[1].body["kv_transfer_params"]["kvd"]["continues"],
        serde_json::json!({"generated": 7}),
        "the resubmission says which prompt tokens were generated"
    );
}

#[tokio::test(start_paused = true)]
async fn a_stream_whose_front_died_is_taken_over_caught_up_and_continued_from_the_clients_last_event()
 {
    let records = std::sync::Arc::new(scripted::MemRecords::default());
    let a = Cluster::new(3);
    a.front.set_records(records.clone());
    let (id, mut client) = a.start(&prompt(PROMPT), 20).await;
    client.read_tokens(7).await;
    let (seen, had) = (client.seqs(), client.tokens());
    let last = *seen.last().unwrap();
    let record = records.get(id).expect("the stream's record is kept");
    assert_eq!(
        (record["epoch"].as_u64(), record["max_tokens"].as_u64()),
        (Some(1), Some(20))
    );
    // front a is gone (its engine attempt with it); b takes the stream over
    a.engines.kill(
        a.front.status()["active"][id.to_string()]["serving"]
            .as_u64()
            .unwrap() as u32,
    );
    let b = a.replica(3);
    b.front.set_records(records.clone());
    let resumed = b
        .front
        .take_over(id, last + 1, Some(had.len()))
        .await
        .unwrap();
    let kvd_front::front::Resumed::Here((same, log, guard)) = resumed else {
        panic!("taken over here")
    };
    assert_eq!(same, id, "the same stream");
    let mut rest = scripted::Client::new(log, guard, last + 1);
    rest.read_to_end().await;
    assert!(rest.error().is_none(), "{:?}", rest.error());
    let mut all = had.clone();
    all.extend(rest.tokens());
    assert_eq!(all, greedy(&prompt(PROMPT), 20), "exactly the rest");
    let seqs: Vec<u64> = seen.iter().chain(rest.seqs().iter()).copied().collect();
    assert_eq!(
        seqs,
        (0..seqs.len() as u64).collect::<Vec<_>>(),
        "numbered on from the client's last"
    );
    let calls = b.engines.calls();
    let catch_up = calls
        .iter()
        .find(|c| c.body["stream"] == serde_json::json!(false))
        .expect("a catch-up");
    assert_eq!(catch_up.body["prompt"], serde_json::json!(prompt(PROMPT)));
    assert_eq!(catch_up.body["max_tokens"], had.len());
    let resumed = calls.last().unwrap();
    let kvd = &resumed.body["kv_transfer_params"]["kvd"];
    assert_eq!(kvd["continues"]["generated"], had.len());
    assert_eq!(
        kvd["checkpoint"]["epoch"], 2,
        "the epoch after the lost one"
    );
    assert_eq!(
        kvd["restore"]["epoch"], 1,
        "the lost attempt's checkpoint is loaded"
    );
    assert_eq!(b.front.stats().streams_taken_over, 1);
    assert!(
        records.get(id).is_none(),
        "the record goes when the stream ends"
    );
}
