//! One request as a state machine: events in ([`Input`]), actions out ([`Action`]), time
//! passed in with every event. It does no I/O; the driver ([`crate::driver`]) carries the
//! actions out and turns what happens into events.
//!
//! ```text
//!  Admitted ──Start──▶ Prefilling ──first token──▶ Decoding ──last token──▶ Completed
//!                         │  ▲                        │
//!      broken, silent,    │  └── plan (epoch + 1): ───┤
//!      ended early        ▼      Resume on survivor   │
//!                      Migrating ◀────────────────────┘
//!                         │ health? → engine answers: Failed (not a worker failure)
//!                         │ gone → Recover (fail the worker) → plan → Prefilling
//!                         └ no plan, budget, deadline, no survivor → Failed
//!  Prefilling/Decoding ── no client for the grace ──▶ Cancelling ──▶ Cancelled
//! ```
//!
//! In P/D mode ([`Request::disaggregated`], `--prefill-engine`) an attempt with no token yet
//! prefills on a prefill worker first ([`pd`] has the failure table):
//!
//! ```text
//!  Admitted ──Start──▶ Prefilling ──answer──▶ Transferring ──first token──▶ Decoding ─▶ …
//!                      (PickPrefill,  │        (Forward/Resume with the      (EndHold)
//!                       Prefill)      │         answer's kv_transfer_params)
//!      broken: epoch + 1, next prefill worker (none left, or no hand-off in the answer:
//!      the decode worker prefills itself, a colocated attempt); refused: Failed
//!  Transferring ── broken ──▶ Migrating ──plan──▶ Transferring on the survivor (same params)
//!  Prefilling/Transferring ── no client for the grace ──▶ Cancelling (prefill dropped, EndHold)
//! ```
//!
//! Every transition is a compare-and-swap on the request epoch: an engine event, a health
//! answer or a failed recovery names the epoch of the attempt it belongs to, and one that
//! names another epoch (an older attempt's late event) changes nothing and is counted in
//! [`Request::stale_dropped`]. A plan moves the epoch forward only (a plan for an epoch not above
//! the current one is stale too). A prefill answer of another epoch is dropped the same way, and
//! the hold it names ends.

pub mod body;
mod events;
pub mod pd;
pub mod relay;
pub mod stops;

use kvd_control::{Decision, Epoch, Event, RequestId, RestorePlan, WorkerId};
use serde::Serialize;
use serde_json::{Map, Value, json};

use crate::openai::{Api, Kind, chat_chunk, error_body};
use crate::sse::frame;
use crate::stats::RecoveryRecord;
use body::{AttemptSpec, RestoreFrom, attempt_body};
use pd::{HandoffNote, Pd, Prefill};
use relay::{At, RelayContext, rewrite, stamp};
use stops::Stops;

pub use events::{Action, Attempt, Ending, Input};

/// A request's state: the controller's own ([`kvd_control::RequestState`], DESIGN §7b).
pub use kvd_control::RequestState as State;

/// Whether an attempt runs (its engine's events count; in P/D, or its prefill's answer).
fn attempt_runs(s: State) -> bool {
    matches!(s, State::Prefilling | State::Transferring | State::Decoding)
}

/// What the front knows of a running request (`/status`, and the checkpoint reports before a
/// failure).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Active {
    /// Its worker.
    pub serving: WorkerId,
    /// Prompt tokens.
    pub prompt: u32,
    /// Its checkpoint's holder.
    pub holder: Option<WorkerId>,
    /// Its epoch.
    pub epoch: Epoch,
    /// Tokens generated.
    pub generated: u32,
    /// P/D: the prefill worker whose prefill is in flight.
    pub prefill: Option<WorkerId>,
}

/// A request as admitted.
#[derive(Debug, Clone)]
pub struct Admitted {
    /// Its id.
    pub id: RequestId,
    /// The client's body, less what the front sets per attempt.
    pub body: Map<String, Value>,
    /// The prompt's ids.
    pub prompt: Vec<u32>,
    /// The client's `max_tokens`.
    pub max_tokens: u32,
    /// The client's `min_tokens`.
    pub min_tokens: u32,
    /// The client wants token ids.
    pub want_token_ids: bool,
    /// The API the client called.
    pub api: Api,
    /// Its stop strings (the front applies them).
    pub stops: Option<Stops>,
    /// The admission's epoch.
    pub epoch: Epoch,
    /// The worker placement chose.
    pub serving: WorkerId,
    /// The holder placement chose.
    pub holder: Option<WorkerId>,
    /// The request's deadline on the front's clock, ms.
    pub deadline_ms: u64,
    /// How long it waits without a client before it is cancelled, ms.
    pub grace_ms: u64,
    /// vLLM's `priority` for the attempts that resume it (`--resume-priority`).
    pub resume_priority: Option<i64>,
}

/// A stream another front began (and died serving), taken over by this one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Takeover {
    /// The sequence number of the next event (the client has those before it).
    pub next_seq: u64,
    /// Tokens the client has.
    pub tokens: usize,
    /// The checkpoint the other front's attempt wrote, to load the prefix from.
    pub restore: Option<RestoreFrom>,
}

/// A recovery waiting for the survivor's first token.
#[derive(Debug, Clone)]
struct Pending {
    at_ms: u64,
    record: RecoveryRecord,
}

/// One request's state machine.
#[derive(Debug)]
pub struct Request {
    a: Admitted,
    state: State,
    epoch: Epoch,
    serving: WorkerId,
    holder: Option<WorkerId>,
    restore: Option<RestoreFrom>,
    generated: Vec<u32>,
    finish_reason: Option<String>,
    /// A token of this attempt was relayed.
    decoding: bool,
    pending: Option<Pending>,
    /// The break the current recovery answers: when, and why.
    broke: Option<(u64, String)>,
    next_seq: u64,
    clients: u32,
    alone_since_ms: Option<u64>,
    stale_dropped: u64,
    /// P/D mode: the hand-off (`None`: colocated).
    pd: Option<Pd>,
    /// A stop string of the front's ended the request (the engine still runs: cancel it).
    stopped: bool,
    /// Taken over: the tokens the client has, generated again before the stream continues.
    catch_up: usize,
    /// The first attempt's `PrefillStarted` waits for its first token (see `start_attempt`).
    prefill_untold: bool,
}

impl Request {
    /// A request as admitted, with its first client reading.
    pub fn new(a: Admitted) -> Request {
        Request {
            state: State::Admitted,
            epoch: a.epoch,
            serving: a.serving,
            holder: a.holder,
            restore: None,
            generated: Vec::new(),
            finish_reason: None,
            decoding: false,
            pending: None,
            broke: None,
            next_seq: 0,
            clients: 1,
            alone_since_ms: None,
            stale_dropped: 0,
            pd: None,
            stopped: false,
            catch_up: 0,
            prefill_untold: false,
            a,
        }
    }

    /// A request as admitted in P/D mode: its prompt is prefilled on a prefill worker, then
    /// decoded on its serving worker.
    pub fn disaggregated(a: Admitted) -> Request {
        let mut r = Request::new(a);
        r.pd = Some(Pd::default());
        r
    }

    /// A stream another front began, taken over: the tokens its client has are generated
    /// again (the same sampling gives the same tokens), then it continues as a recovery does,
    /// its events numbered on from the client's last.
    pub fn taken_over(a: Admitted, t: Takeover) -> Request {
        let mut r = Request::new(a);
        r.next_seq = t.next_seq;
        r.catch_up = t.tokens;
        r.restore = t.restore;
        r
    }

    /// Its id.
    pub fn id(&self) -> RequestId {
        self.a.id
    }

    /// Its state.
    pub fn state(&self) -> State {
        self.state
    }

    /// Its epoch.
    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    /// The tokens relayed so far.
    pub fn generated(&self) -> &[u32] {
        &self.generated
    }

    /// Events of another epoch dropped so far.
    pub fn stale_dropped(&self) -> u64 {
        self.stale_dropped
    }

    /// What `/status` shows of it.
    pub fn active(&self) -> Active {
        Active {
            serving: self.serving,
            prompt: self.a.prompt.len() as u32,
            holder: self.holder,
            epoch: self.epoch,
            generated: self.generated.len() as u32,
            prefill: self.prefill_in_flight().map(|p| p.worker),
        }
    }

    fn prefill_in_flight(&self) -> Option<Prefill> {
        self.pd.as_ref().and_then(|pd| pd.prefill)
    }

    /// When, on the front's clock, it wants a [`Input::Tick`] (the end of a client's grace).
    pub fn wake_at_ms(&self) -> Option<u64> {
        if !attempt_runs(self.state) {
            return None;
        }
        self.alone_since_ms.map(|t| t + self.a.grace_ms)
    }

    /// Take `input` at `now_ms`; what to do.
    pub fn on(&mut self, input: Input, now_ms: u64) -> Vec<Action> {
        let mut out = Vec::new();
        if self.state.is_terminal() {
            return out;
        }
        let runs = |e: Epoch, s: &Self| e == s.epoch && attempt_runs(s.state);
        match input {
            Input::Start if self.state == State::Admitted => self.start_attempt(&mut out),
            Input::EngineEvent { epoch, data } if runs(epoch, self) => {
                self.on_engine_event(&data, now_ms, &mut out);
            }
            Input::EngineEnded { epoch } if runs(epoch, self) => {
                if self.finish_reason.is_some() {
                    self.finish(&mut out);
                } else {
                    let why = format!(
                        "worker {}'s engine ended the stream before its last token",
                        self.serving
                    );
                    self.broken(why, now_ms, &mut out);
                }
            }
            Input::EngineBroken { epoch, reason } if runs(epoch, self) => {
                self.broken(reason, now_ms, &mut out);
            }
            Input::EngineSilent { epoch, waited_ms } if runs(epoch, self) => {
                let why = format!("no event from worker {} for {waited_ms} ms", self.serving);
                self.broken(why, now_ms, &mut out);
            }
            Input::EngineFailed {
                epoch,
                reason,
                status,
            } if runs(epoch, self) => {
                self.engine_failed(reason, status, &mut out);
            }
            Input::Health { epoch, alive } if self.migrating(epoch) => {
                self.on_health(alive, epoch, &mut out);
            }
            Input::Unplanned { epoch, reason } if self.migrating(epoch) => {
                self.fail(&reason, &mut out);
            }
            Input::Plan(d) => self.on_plan(d, now_ms, &mut out),
            Input::Decided(ds) => self.on_decided(&ds, &mut out),
            Input::Clients(n) => {
                self.clients = n;
                self.alone_since_ms = if n > 0 {
                    None
                } else {
                    Some(self.alone_since_ms.unwrap_or(now_ms))
                };
            }
            Input::Tick => {}
            Input::ProgressDue => self.progress(&mut out),
            Input::PrefillWorker { epoch, worker } if self.picking(epoch) => {
                self.on_prefill_worker(worker, now_ms, &mut out);
            }
            Input::CaughtUp { epoch, answer } if runs(epoch, self) => {
                self.caught_up(&answer, &mut out);
            }
            Input::PrefillDone { epoch, answer } if self.prefilling(epoch) => {
                self.on_prefill_done(&answer, now_ms, &mut out);
            }
            Input::PrefillDone { epoch, answer } => self.stale_answer(epoch, &answer, &mut out),
            Input::PrefillBroken { epoch, reason } if self.prefilling(epoch) => {
                self.on_prefill_broken(reason, now_ms, &mut out);
            }
            Input::PrefillRefused {
                epoch,
                status,
                text,
            } if self.prefilling(epoch) => {
                self.take_prefill();
                out.push(Action::Handoff(HandoffNote::PrefillRefused { status }));
                let why = format!("the prefill worker refused the request ({status}): {text}");
                self.engine_failed(why, None, &mut out);
            }
            _ => self.stale_dropped += 1,
        }
        self.check_grace(now_ms, &mut out);
        out
    }

    fn migrating(&self, epoch: Epoch) -> bool {
        epoch == self.epoch && self.state == State::Migrating
    }

    /// Its last token came (a finish reason, or `max_tokens` of them).
    fn complete(&self) -> bool {
        self.finish_reason.is_some() || self.generated.len() as u32 >= self.a.max_tokens
    }

    /// Where the next event stands, generated on `worker`.
    fn at(&self, worker: WorkerId) -> At {
        At {
            id: self.a.id,
            seq: self.next_seq,
            tokens: self.generated.len(),
            epoch: self.epoch,
            worker,
        }
    }

    fn push(&mut self, data: &str, tokens: u32, out: &mut Vec<Action>) {
        let seq = self.next_seq;
        self.next_seq += 1;
        out.push(Action::Relay {
            seq,
            frame: frame(self.a.id, seq, self.generated.len(), data),
            tokens,
        });
    }

    fn control(&self, e: Event, out: &mut Vec<Action>) {
        out.push(Action::Control(e));
    }

    fn start_attempt(&mut self, out: &mut Vec<Action>) {
        if self.complete() {
            self.finish(out);
            return;
        }
        self.state = State::Prefilling;
        self.decoding = false;
        self.prefill_untold = false;
        let n = self.generated.len();
        if n < self.catch_up {
            let body = self.catch_up_body();
            out.push(Action::CatchUp(Attempt {
                epoch: self.epoch,
                worker: self.serving,
                body,
            }));
            return;
        }
        if self.pd.as_ref().is_some_and(|pd| pd.wants_prefill(n)) {
            let tried = self
                .pd
                .as_ref()
                .map(|pd| pd.tried.clone())
                .unwrap_or_default();
            out.push(Action::PickPrefill {
                epoch: self.epoch,
                tried,
            });
            return;
        }
        // until the decode's first token (the prefill's own may have gone to the client)
        let handoff = self.pd.as_ref().is_some_and(|pd| pd.handoff.is_some());
        let (request_id, epoch) = (self.a.id, self.epoch);
        if handoff {
            self.state = State::Transferring;
            let to = self.serving;
            self.control(
                Event::TransferStarted {
                    request_id,
                    epoch,
                    to,
                },
                out,
            );
            if self.pending.is_some() {
                out.push(Action::Handoff(HandoffNote::Resumed { to }));
            }
        } else if self.generated.is_empty() && self.pending.is_none() {
            // A request's first prefill is told at its first token: the engine's own queue is
            // invisible from here, and the controller's queue delay `q_w` (admission → prefill
            // start) would read 0 on every worker if told at the send. From the first token,
            // `q_w` is the wait in the engine's queue plus the prefill itself (docs/CONTROL.md).
            self.prefill_untold = true;
        } else {
            self.control(Event::PrefillStarted { request_id, epoch }, out);
        }
        self.decode_attempt(handoff, out);
    }

    /// The catch-up's body: the prompt, `catch_up` tokens, no stream, the prefix loaded from
    /// the other front's checkpoint.
    fn catch_up_body(&self) -> Value {
        let mut b = attempt_body(&AttemptSpec {
            id: self.a.id,
            body: &self.a.body,
            prompt: &self.a.prompt,
            generated: &[],
            max_tokens: self.catch_up as u32,
            min_tokens: self.a.min_tokens.min(self.catch_up as u32),
            epoch: self.epoch,
            holder: None,
            restore: self.restore,
            handoff: None,
            priority: self.a.resume_priority,
        });
        b["stream"] = json!(false);
        if let Some(o) = b.as_object_mut() {
            o.remove("stream_options");
        }
        b
    }

    /// The catch-up answered: its tokens are the ones the client has; the stream continues
    /// after them.
    fn caught_up(&mut self, answer: &Value, out: &mut Vec<Action>) {
        let choice = &answer["choices"][0];
        let ids = crate::sse::token_ids(&choice["token_ids"]).unwrap_or_default();
        if ids.len() != self.catch_up {
            let msg = format!(
                "the catch-up generated {} tokens where the client has {}",
                ids.len(),
                self.catch_up
            );
            return self.engine_failed(msg, None, out);
        }
        self.generated = ids;
        if let Some(stops) = self.a.stops.as_mut() {
            // the client has this text, less what the other front held back
            let text = choice["text"].as_str().unwrap_or("");
            stops.feed(text, self.catch_up, false);
        }
        self.start_attempt(out);
    }

    /// Send the attempt that streams the tokens (with the hand-off's params, in P/D).
    fn decode_attempt(&mut self, handoff: bool, out: &mut Vec<Action>) {
        let id = self.a.id;
        let params = self
            .pd
            .as_ref()
            .and_then(|pd| pd.handoff.as_ref())
            .filter(|_| handoff)
            .map(|h| &h.params);
        let attempt = Attempt {
            epoch: self.epoch,
            worker: self.serving,
            body: attempt_body(&AttemptSpec {
                id,
                body: &self.a.body,
                prompt: &self.a.prompt,
                generated: &self.generated,
                max_tokens: self.a.max_tokens,
                min_tokens: self.a.min_tokens,
                epoch: self.epoch,
                holder: self.holder,
                restore: self.restore,
                handoff: params,
                // a recovery's attempt goes before the prompts queued at its survivor
                priority: self.pending.as_ref().and(self.a.resume_priority),
            }),
        };
        out.push(if self.pending.is_some() {
            Action::Resume(attempt)
        } else {
            Action::Forward(attempt)
        });
    }

    fn on_engine_event(&mut self, data: &str, now_ms: u64, out: &mut Vec<Action>) {
        if data.trim() == "[DONE]" {
            if self.complete() {
                self.finish(out);
            } else {
                let why = format!(
                    "worker {}'s engine sent [DONE] before the last token",
                    self.serving
                );
                self.broken(why, now_ms, out);
            }
            return;
        }
        let (value, n) = match self.take_tokens(data) {
            Ok(r) => r,
            Err(msg) => return self.engine_failed(msg, None, out),
        };
        if n > 0 {
            self.committed(now_ms, out);
        }
        let usage = self.stopped.then(|| self.usage_event(&value));
        let data = stamp(value, self.at(self.serving));
        self.push(&data, n, out);
        if self.stopped {
            // the front's stop string ended it: the engine, still generating, is dropped
            out.push(Action::Cancel { epoch: self.epoch });
            if let Some(Some(u)) = usage {
                let u = stamp(u, self.at(self.serving));
                self.push(&u, 0, out);
            }
            self.finish(out);
        }
    }

    /// The usage event the engine would have sent last, when the client asked for it
    /// (`stream_options.include_usage`): the request ended at a stop string of the front's.
    fn usage_event(&self, last: &Value) -> Option<Value> {
        let wanted = self
            .a
            .body
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            == Some(true);
        let (p, c) = (self.a.prompt.len(), self.generated.len());
        wanted.then(|| {
            json!({
                "id": last.get("id"), "object": last.get("object"), "created": last.get("created"),
                "model": last.get("model"), "choices": [],
                "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c},
            })
        })
    }

    /// An engine event's tokens become the request's (committed): the event as the client
    /// gets it (less its stamp), and how many tokens it carried.
    fn take_tokens(&mut self, data: &str) -> Result<(Value, u32), String> {
        let cx = RelayContext {
            id: self.a.id,
            want_token_ids: self.a.want_token_ids,
            first_event: self.next_seq == 0,
            prompt: &self.a.prompt,
            generated_before: self.generated.len(),
        };
        let mut r = rewrite(data, &cx)?;
        self.generated.extend_from_slice(&r.tokens);
        if r.finish_reason.is_some() {
            self.finish_reason = r.finish_reason;
        }
        let first_event = cx.first_event;
        self.stop_strings(&mut r.value, !r.tokens.is_empty());
        if self.a.api.kind == Kind::Chat {
            chat_chunk(&mut r.value, self.a.id, first_event);
        }
        Ok((r.value, r.tokens.len() as u32))
    }

    /// The front's stop strings over the event's text (`tokens`: it carries some): the text
    /// held back or cut, and a stop string found ends the request.
    fn stop_strings(&mut self, v: &mut Value, tokens: bool) {
        let Some(stops) = self.a.stops.as_mut() else {
            return;
        };
        let Some(choice) = v.get_mut("choices").and_then(|c| c.get_mut(0)) else {
            return;
        };
        let text = choice.get("text").and_then(Value::as_str).unwrap_or("");
        if !tokens && text.is_empty() && self.finish_reason.is_none() {
            return;
        }
        let last = self.finish_reason.is_some() || self.generated.len() as u32 >= self.a.max_tokens;
        let f = stops.feed(text, self.generated.len(), last);
        choice["text"] = json!(f.text);
        if let Some(s) = f.stop {
            choice["finish_reason"] = json!("stop");
            choice["stop_reason"] = json!(s);
            self.finish_reason = Some("stop".into());
            self.stopped = true;
        }
    }

    /// Tokens of this attempt were committed: decoding (the first time: the recovery is done).
    fn committed(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        let (request_id, epoch) = (self.a.id, self.epoch);
        if !self.decoding {
            self.decoding = true;
            self.state = State::Decoding;
            if std::mem::take(&mut self.prefill_untold) {
                self.control(Event::PrefillStarted { request_id, epoch }, out);
            }
            self.control(Event::DecodingStarted { request_id, epoch }, out);
            self.handoff_done(now_ms, out);
            if let Some(p) = self.pending.take() {
                let mut record = p.record;
                record.recovery_ms = now_ms.saturating_sub(p.at_ms);
                out.push(Action::Recovered(record));
                // the restore has read what it needed: the old checkpoint goes
                self.end_restore(false, out);
            }
        }
        let generated_tokens = self.generated.len() as u32;
        self.control(
            Event::TokensCommitted {
                request_id,
                epoch,
                generated_tokens,
            },
            out,
        );
    }

    fn broken(&mut self, reason: String, now_ms: u64, out: &mut Vec<Action>) {
        out.push(Action::Cancel { epoch: self.epoch });
        if now_ms >= self.a.deadline_ms {
            let msg = format!("the stream broke ({reason}) past the request's deadline");
            return self.fail(&msg, out);
        }
        self.state = State::Migrating;
        self.broke = Some((now_ms, reason));
        out.push(Action::CheckHealth {
            epoch: self.epoch,
            worker: self.serving,
        });
    }

    fn on_health(&mut self, alive: bool, epoch: Epoch, out: &mut Vec<Action>) {
        if alive {
            let reason = self.broke.as_ref().map_or("", |b| b.1.as_str());
            let msg = format!(
                "the stream from worker {} broke ({reason}) but its engine still answers: not a worker failure, so no recovery",
                self.serving
            );
            return self.fail(&msg, out);
        }
        out.push(Action::Recover {
            epoch,
            worker: self.serving,
        });
    }

    fn on_plan(&mut self, d: Decision, now_ms: u64, out: &mut Vec<Action>) {
        match d {
            Decision::Checkpoint {
                request_id,
                epoch,
                holder,
            } if request_id == self.a.id && epoch == self.epoch && self.holder.is_some() => {
                // the engine cannot be re-pointed mid-request: it keeps pushing to the old
                // holder (which is gone); the new one holds nothing yet
                self.holder = None;
                out.push(Action::HolderLost { new_holder: holder });
            }
            Decision::Restore(p)
                if p.request_id == self.a.id
                    && p.epoch > self.epoch
                    && self.state != State::Cancelling =>
            {
                self.restore_on(&p, now_ms, out);
            }
            Decision::RequestFailed {
                request_id, reason, ..
            } if request_id == self.a.id && self.state != State::Cancelling => {
                if attempt_runs(self.state) {
                    out.push(Action::Cancel { epoch: self.epoch });
                }
                self.drop_prefill(out);
                self.fail(&format!("recovery is impossible: {reason}"), out);
            }
            _ => self.stale_dropped += 1,
        }
    }

    /// Resume on the plan's survivor under its epoch (ending the attempt that runs, if any).
    fn restore_on(&mut self, p: &RestorePlan, now_ms: u64, out: &mut Vec<Action>) {
        if attempt_runs(self.state) {
            out.push(Action::Cancel { epoch: self.epoch });
        }
        self.drop_prefill(out);
        if now_ms >= self.a.deadline_ms {
            return self.fail("the request's deadline passed during recovery", out);
        }
        let (at_ms, reason) = self
            .broke
            .take()
            .unwrap_or((now_ms, "a failure event planned it".into()));
        let from = self.serving;
        self.restore = p.kv_source.map(|h| RestoreFrom {
            holder: h,
            epoch: self.epoch,
            local: h == p.target,
        });
        self.epoch = p.epoch;
        self.serving = p.target;
        self.holder = p.new_holder;
        self.pending = Some(Pending {
            at_ms,
            record: RecoveryRecord {
                request: self.a.id,
                epoch: p.epoch,
                from,
                to: p.target,
                kv_source: p.kv_source,
                load_tokens: p.load_tokens,
                recompute_tokens: p.prefill_tokens,
                committed_tokens: self.generated.len() as u32,
                recovery_ms: 0,
                reason,
            },
        });
        self.start_attempt(out);
    }

    fn on_decided(&mut self, ds: &[Decision], out: &mut Vec<Action>) {
        if self.state != State::Cancelling {
            return;
        }
        for d in ds {
            if let Decision::Cancel {
                request_id, epoch, ..
            } = d
            {
                if *request_id == self.a.id && *epoch > self.epoch {
                    // the engine's connection went with the attempt: it aborted (the
                    // checkpoints to end keep the attempt's epoch)
                    self.control(
                        Event::Cancelled {
                            request_id: *request_id,
                            epoch: *epoch,
                        },
                        out,
                    );
                }
            }
        }
        self.state = State::Cancelled;
        self.end(Ending::Cancelled, out);
    }

    fn check_grace(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        let Some(at) = self.wake_at_ms() else { return };
        if self.clients > 0 || now_ms < at {
            return;
        }
        out.push(Action::Cancel { epoch: self.epoch });
        let during = self.state;
        if self.pd.is_some() && matches!(during, State::Prefilling | State::Transferring) {
            out.push(Action::Handoff(HandoffNote::Cancelled { during }));
            self.drop_prefill(out);
            self.end_hold(out);
        }
        self.state = State::Cancelling;
        self.control(
            Event::Cancel {
                request_id: self.a.id,
            },
            out,
        );
    }

    fn progress(&self, out: &mut Vec<Action>) {
        if let (Some(holder), true) = (self.holder, attempt_runs(self.state)) {
            if !self.generated.is_empty() {
                out.push(Action::ReportProgress {
                    holder,
                    epoch: self.epoch,
                    history: self.a.prompt.len() + self.generated.len(),
                });
            }
        }
    }

    fn finish(&mut self, out: &mut Vec<Action>) {
        self.control(
            Event::Finished {
                request_id: self.a.id,
                epoch: self.epoch,
            },
            out,
        );
        self.push("[DONE]", 0, out);
        self.state = State::Completed;
        self.end(Ending::Finished, out);
    }

    /// The engine refused or failed the request: it fails, no recovery.
    fn engine_failed(&mut self, reason: String, status: Option<u16>, out: &mut Vec<Action>) {
        out.push(Action::Cancel { epoch: self.epoch });
        if self.state == State::Transferring {
            // the source holds the prompt's blocks for a decode that will not come
            out.push(Action::Handoff(HandoffNote::DecodeRefused));
            self.end_hold(out);
        }
        self.control(
            Event::RequestFailed {
                request_id: self.a.id,
                epoch: self.epoch,
                reason: reason.clone(),
            },
            out,
        );
        self.fail_with(&reason, status, out);
    }

    /// End the stream with an error event.
    fn fail(&mut self, msg: &str, out: &mut Vec<Action>) {
        self.fail_with(msg, None, out);
    }

    /// End the stream with an error event; `status`: the engine refused the request with it
    /// (the event then carries it as OpenAI's `code`, and a client that has no answer yet
    /// gets it as the HTTP status).
    fn fail_with(&mut self, msg: &str, status: Option<u16>, out: &mut Vec<Action>) {
        let error = match status {
            Some(code) => error_body(code, msg)["error"].clone(),
            None => json!({"message": msg, "type": "kvd_recovery_failed"}),
        };
        let data = json!({"error": error, "kvd": {"request": self.a.id, "epoch": self.epoch}});
        self.push(&data.to_string(), 0, out);
        self.push("[DONE]", 0, out);
        self.state = State::Failed;
        self.end(Ending::Failed(msg.to_string()), out);
    }

    /// The stream is over; its checkpoints end (the request's own, measured; a restore source
    /// not ended yet).
    fn end(&mut self, how: Ending, out: &mut Vec<Action>) {
        self.drop_prefill(out);
        out.push(Action::End(how));
        self.end_hold(out);
        if let Some(h) = self.holder {
            out.push(Action::EndCheckpoint {
                holder: h,
                epoch: self.epoch,
                measure: true,
                wait: true,
            });
        }
        self.end_restore(true, out);
    }

    /// End the checkpoint the attempt restored from, if not ended yet.
    fn end_restore(&mut self, wait: bool, out: &mut Vec<Action>) {
        if let Some(r) = self.restore.take() {
            out.push(Action::EndCheckpoint {
                holder: r.holder,
                epoch: r.epoch,
                measure: false,
                wait,
            });
        }
    }
}
