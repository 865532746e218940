//! One request's task: it feeds the request's state machine ([`crate::machine::Request`]) what
//! happens (the engine's stream, plans, clients, time) and carries out what it decides, through
//! the [`crate::engine`] traits and the [`crate::hub::Hub`]. Every wait is bounded: an engine's
//! answer and each event of its stream by `--engine-timeout-ms` (a silent stream is a broken
//! one), health checks by [`PROBE_TIMEOUT`], a P/D prefill's whole
//! answer by `--engine-timeout-ms` (it runs beside the other waits and answers as an input); a
//! follow-up of one action is fed back before the next wait.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use kvd_control::{Epoch, Event};
use tokio::time::{MissedTickBehavior, interval, sleep, timeout};

use crate::config::{PROBE_TIMEOUT, PROGRESS_EVERY};
use crate::engine::{EventStream, Opened, PrefillAnswer};
use crate::front::{Front, PrefillSlot};
use crate::log::{StreamLog, changed};
use crate::machine::{Action, Attempt, Ending, Input, Request};

/// Most follow-up inputs one input leads to (each action answers with at most one).
const FOLLOW_UPS_MAX: usize = 64;

/// A prefill in flight, as the machine's input it ends with; dropping it drops the connection.
struct PrefillCall(Pin<Box<dyn Future<Output = Input> + Send>>);

impl std::fmt::Debug for PrefillCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PrefillCall")
    }
}

/// Drives one request until it ends.
#[derive(Debug)]
pub struct Driver {
    front: Arc<Front>,
    m: Request,
    log: Arc<StreamLog>,
    /// The current attempt's stream, with its epoch.
    stream: Option<(Epoch, Box<dyn EventStream>)>,
    /// P/D: the prefill in flight, with its epoch.
    prefill: Option<(Epoch, PrefillCall)>,
    clients: u32,
    /// With replicas: the request's record, kept again whenever its epoch moves.
    record: Option<serde_json::Value>,
}

impl Driver {
    pub fn new(front: Arc<Front>, m: Request, log: Arc<StreamLog>) -> Driver {
        Driver {
            front,
            m,
            log,
            stream: None,
            prefill: None,
            clients: 1,
            record: None,
        }
    }

    /// Keep the request's record for the other replicas, now and whenever its epoch moves.
    pub fn keep_record(&mut self, record: serde_json::Value) {
        self.front.keep_record(self.m.id(), &record);
        self.record = Some(record);
    }

    /// Run the request to its end.
    pub async fn run(mut self) {
        let id = self.m.id();
        let hub = Arc::clone(self.front.hub());
        let mut plans = hub.plans_changed();
        let mut clients = self.log.subscribe();
        let mut progress = interval(PROGRESS_EVERY);
        progress.set_missed_tick_behavior(MissedTickBehavior::Delay);
        self.feed(Input::Start).await;
        while !self.m.state().is_terminal() {
            plans.borrow_and_update();
            clients.borrow_and_update();
            if let Some(d) = hub.take_plan(id) {
                self.feed(Input::Plan(d)).await;
                continue;
            }
            let n = self.log.clients();
            if n != self.clients {
                self.clients = n;
                self.feed(Input::Clients(n)).await;
                continue;
            }
            let wake = self
                .m
                .wake_at_ms()
                .map(|at| Duration::from_millis(at.saturating_sub(hub.now_ms())));
            let engine_timeout = self.front.args().engine_timeout();
            let next = tokio::select! {
                ev = next_event(&mut self.stream, engine_timeout) => Some(ev),
                ev = prefill_answer(&mut self.prefill) => Some(ev),
                () = changed(&mut plans) => None,
                () = changed(&mut clients) => None,
                _ = progress.tick() => Some(Input::ProgressDue),
                () = sleep_opt(wake) => Some(Input::Tick),
            };
            if let Some(input) = next {
                self.feed(input).await;
            }
        }
        self.stream = None;
        self.prefill = None;
        self.log.close();
        self.front.request_done(id);
    }

    /// Feed `input`, carry out the actions, and feed back their answers.
    async fn feed(&mut self, input: Input) {
        let mut queue = VecDeque::from([input]);
        while let Some(input) = queue.pop_front() {
            let actions = self.m.on(input, self.front.hub().now_ms());
            self.front.set_active(&self.m);
            self.record_epoch();
            for a in actions {
                if let Some(next) = self.act(a).await {
                    queue.push_back(next);
                }
            }
            assert!(queue.len() <= FOLLOW_UPS_MAX, "a bounded chain of answers");
        }
    }

    /// The epoch moved (a recovery's new attempt): the record names it and its holder, whose
    /// checkpoint another front would load.
    fn record_epoch(&mut self) {
        let (epoch, holder) = (self.m.epoch(), self.m.active().holder);
        let Some(r) = self.record.as_mut() else {
            return;
        };
        if r["epoch"].as_u64() == Some(epoch) || self.m.state().is_terminal() {
            return;
        }
        r["epoch"] = serde_json::json!(epoch);
        r["holder"] = serde_json::json!(holder);
        self.front.keep_record(self.m.id(), r);
    }

    async fn act(&mut self, a: Action) -> Option<Input> {
        let f = Arc::clone(&self.front);
        match a {
            Action::Control(e) => {
                let cancel = matches!(e, Event::Cancel { .. });
                let ds = f.apply(&e);
                return cancel.then_some(Input::Decided(ds));
            }
            Action::Forward(at) => return self.open(at).await,
            Action::Resume(at) => {
                tracing::info!(
                    request = self.m.id(),
                    epoch = at.epoch,
                    to = at.worker,
                    "front: resubmitting to the survivor"
                );
                return self.open(at).await;
            }
            Action::Relay { seq, frame, tokens } => {
                let got = self.log.push(|_| frame);
                assert_eq!(got, seq, "the machine numbers the frames as the log does");
                if tokens > 0 {
                    f.count(|s| s.tokens_relayed += u64::from(tokens));
                }
            }
            Action::Cancel { epoch } => {
                if self.stream.as_ref().is_some_and(|(e, _)| *e == epoch) {
                    self.stream = None;
                }
                if self.prefill.as_ref().is_some_and(|(e, _)| *e == epoch) {
                    self.prefill = None;
                }
            }
            Action::PickPrefill { epoch, tried } => {
                let worker = f.pick_prefill(&tried);
                return Some(Input::PrefillWorker { epoch, worker });
            }
            Action::CatchUp(at) => {
                self.log.mark_open();
                let epoch = at.epoch;
                self.prefill = Some((epoch, PrefillCall(Box::pin(catch_up(f, at)))));
            }
            Action::Prefill(at) => {
                self.log.mark_open();
                // counted in its worker's load from now, so the next pick sees it
                let slot = f.prefill_slot(at.worker);
                self.prefill = Some((at.epoch, PrefillCall(Box::pin(prefill(f, at, slot)))));
            }
            Action::EndHold {
                node,
                request,
                epoch,
            } => {
                let end = async move { f.end_hold(node, request, epoch).await };
                if self.m.state().is_terminal() {
                    end.await;
                } else {
                    tokio::spawn(end);
                }
            }
            Action::Handoff(note) => f.handoff_noted(self.m.id(), self.m.epoch(), note),
            Action::CheckHealth { epoch, worker } => {
                let alive = timeout(PROBE_TIMEOUT, f.engines().health(worker))
                    .await
                    .unwrap_or(false);
                return Some(Input::Health { epoch, alive });
            }
            Action::Recover { epoch, worker } => {
                return Some(f.recover_worker(worker, self.m.id(), epoch).await);
            }
            Action::HolderLost { new_holder } => {
                tracing::warn!(request = self.m.id(), new_holder = ?new_holder, "front: the holder died; this attempt runs without a checkpoint");
                f.count(|s| s.checkpoint_moves_unfollowed += 1);
            }
            Action::Recovered(rec) => f.recovered(rec),
            Action::ReportProgress {
                holder,
                epoch,
                history,
            } => {
                let id = self.m.id();
                tokio::spawn(async move { f.report_progress(holder, id, epoch, history).await });
            }
            Action::EndCheckpoint {
                holder,
                epoch,
                measure,
                wait,
            } => {
                let id = self.m.id();
                let end = async move { f.end_checkpoint(holder, id, epoch, measure).await };
                if wait {
                    end.await;
                } else {
                    tokio::spawn(end);
                }
            }
            Action::End(how) => self.ended(&how),
        }
        None
    }

    /// Start an attempt; what went wrong, as the machine's input.
    async fn open(&mut self, at: Attempt) -> Option<Input> {
        let f = &self.front;
        let epoch = at.epoch;
        let name = f.engines().name(at.worker);
        let t = f.args().engine_timeout();
        match timeout(t, f.engines().complete(at.worker, at.body)).await {
            Ok(Ok(Opened::Stream(s))) => {
                self.stream = Some((epoch, s));
                self.log.mark_open();
                None
            }
            Ok(Ok(Opened::Refused { status, text })) if status >= 500 => {
                Some(Input::EngineBroken {
                    epoch,
                    reason: format!("{name} answered {status}: {text}"),
                })
            }
            Ok(Ok(Opened::Refused { status, text })) => Some(Input::EngineFailed {
                epoch,
                reason: refusal_message(status, &text),
                status: Some(status),
            }),
            Ok(Err(kvd_core::Error::NotFound(reason))) => Some(Input::EngineFailed {
                epoch,
                reason,
                status: None,
            }),
            Ok(Err(e)) => Some(Input::EngineBroken {
                epoch,
                reason: e.to_string(),
            }),
            Err(_) => Some(Input::EngineBroken {
                epoch,
                reason: format!("{name}: no answer within {} ms", t.as_millis()),
            }),
        }
    }

    fn ended(&self, how: &Ending) {
        let id = self.m.id();
        let f = &self.front;
        match how {
            Ending::Finished => f.count(|s| s.streams_finished += 1),
            Ending::Cancelled => {
                f.count(|s| s.streams_cancelled += 1);
                tracing::info!(
                    request = id,
                    generated = self.m.generated().len(),
                    "front: the client left; cancelled"
                );
            }
            Ending::Failed(msg) => {
                f.count(|s| s.streams_failed += 1);
                tracing::warn!(
                    request = id,
                    error = msg.as_str(),
                    "front: the stream ends with an error"
                );
            }
        }
    }
}

/// The next event of the attempt's stream as the machine's input (never, without one).
async fn next_event(stream: &mut Option<(Epoch, Box<dyn EventStream>)>, wait: Duration) -> Input {
    let Some((epoch, s)) = stream else {
        return std::future::pending().await;
    };
    let epoch = *epoch;
    match timeout(wait, s.next()).await {
        Err(_) => Input::EngineSilent {
            epoch,
            waited_ms: wait.as_millis() as u64,
        },
        Ok(Err(e)) => Input::EngineBroken {
            epoch,
            reason: e.to_string(),
        },
        Ok(Ok(None)) => Input::EngineEnded { epoch },
        Ok(Ok(Some(data))) => Input::EngineEvent { epoch, data },
    }
}

/// Prefill `at` on its prefill worker (counted in its load while it runs), within
/// `--engine-timeout-ms`; the answer as the machine's input.
async fn prefill(front: Arc<Front>, at: Attempt, _running: PrefillSlot) -> Input {
    let epoch = at.epoch;
    let name = front.engines().name(at.worker);
    let t = front.args().engine_timeout();
    match timeout(t, front.engines().prefill(at.worker, at.body)).await {
        Ok(Ok(PrefillAnswer::Done(answer))) => Input::PrefillDone { epoch, answer },
        Ok(Ok(PrefillAnswer::Refused { status, text })) if status >= 500 => Input::PrefillBroken {
            epoch,
            reason: format!("{name} answered {status}: {text}"),
        },
        Ok(Ok(PrefillAnswer::Refused { status, text })) => Input::PrefillRefused {
            epoch,
            status,
            text,
        },
        Ok(Err(e)) => Input::PrefillBroken {
            epoch,
            reason: e.to_string(),
        },
        Err(_) => Input::PrefillBroken {
            epoch,
            reason: format!("{name}: no prefill answer within {} ms", t.as_millis()),
        },
    }
}

/// The prefill's answer (never, without one); the prefill is done with then.
/// A taken-over stream's catch-up: a completion without a stream, as the machine's input.
async fn catch_up(front: Arc<Front>, at: Attempt) -> Input {
    let epoch = at.epoch;
    let name = front.engines().name(at.worker);
    let t = front.args().engine_timeout();
    let body = at.body.to_string().into_bytes();
    let call = async {
        let mut fw = front
            .engines()
            .forward(at.worker, "/v1/completions", body)
            .await?;
        let mut bytes = Vec::new();
        while let Some(b) = fw.body.next().await? {
            if bytes.len() + b.len() > crate::http::MAX_JSON_BYTES {
                return Err(kvd_core::Error::Protocol(
                    "a catch-up answer past its bound".into(),
                ));
            }
            bytes.extend_from_slice(&b);
        }
        Ok((fw.status, bytes))
    };
    match timeout(t, call).await {
        Ok(Ok((status, b))) if (200..300).contains(&status) => match serde_json::from_slice(&b) {
            Ok(answer) => Input::CaughtUp { epoch, answer },
            Err(e) => Input::EngineBroken {
                epoch,
                reason: format!("{name}: the catch-up's answer is not JSON: {e}"),
            },
        },
        Ok(Ok((status, b))) if status < 500 => Input::EngineFailed {
            epoch,
            reason: refusal_message(status, &String::from_utf8_lossy(&b)),
            status: Some(status),
        },
        Ok(Ok((status, _))) => Input::EngineBroken {
            epoch,
            reason: format!("{name} answered the catch-up {status}"),
        },
        Ok(Err(e)) => Input::EngineBroken {
            epoch,
            reason: e.to_string(),
        },
        Err(_) => Input::EngineBroken {
            epoch,
            reason: format!("{name}: no catch-up answer within {} ms", t.as_millis()),
        },
    }
}

async fn prefill_answer(p: &mut Option<(Epoch, PrefillCall)>) -> Input {
    let Some((_, call)) = p.as_mut() else {
        return std::future::pending().await;
    };
    let input = (&mut call.0).await;
    *p = None;
    input
}

async fn sleep_opt(d: Option<Duration>) {
    match d {
        Some(d) => sleep(d).await,
        None => std::future::pending::<()>().await,
    }
}

/// What an engine said when it refused a request: its error's message (vLLM answers in
/// OpenAI's error shape), else its text.
fn refusal_message(status: u16, text: &str) -> String {
    serde_json::from_str::<serde_json::Value>(text)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| format!("the engine refused the request ({status}): {text}"))
}
