//! Admission: a client's body read (OpenAI's APIs), checked against what the engines serve,
//! tokenized, budgeted and started as a request the front runs, or sent to one engine as it is;
//! and a stream another front began, taken over from its record ([`Front::take_over`]).

use std::sync::Arc;

use kvd_control::{AdmitRequest, Epoch, RequestId, WorkerId};
use kvd_core::{Error, Result};
use serde_json::{Value, json};
use tokio::time::timeout;

use super::{Front, Opened, lock};
use crate::config::PROBE_TIMEOUT;
use crate::driver::Driver;
use crate::engine::{Claim, Records};
use crate::log::StreamLog;
use crate::machine::body::{Asked, Parsed, Prompt, RestoreFrom, parse_body};
use crate::machine::{Admitted, Request, Takeover};
use crate::openai::{Api, Kind, Models};
use crate::sse::{EventId, token_ids};

/// Largest record of a stream kept for the other replicas, bytes (etcd takes 1.5 MiB a value).
pub const MAX_RECORD_BYTES: usize = 1 << 20;

/// A stream taken over from another front.
#[derive(Debug, Clone, Copy)]
struct Taken {
    id: RequestId,
    next_seq: u64,
    tokens: usize,
    lost_epoch: Epoch,
    holder: Option<WorkerId>,
}

/// What [`Front::start`] starts.
#[derive(Debug)]
struct Start {
    prompt: Vec<u32>,
    max_tokens: u32,
    first: WorkerId,
    /// The client's body as it came, for the record (with replicas).
    original: Option<Value>,
    taken: Option<Taken>,
}

/// Where a resumed stream lives now.
#[derive(Debug)]
pub enum Resumed {
    /// Here: this front took it over.
    Here(Opened),
    /// At the front at this address, which still serves it.
    At(String),
}

/// Admissions of one request, each on another worker, while the workers it was sent to leave
/// service in between (a failure that struck between the pick and the admission).
const REPICKS: usize = 3;

/// How often the front asks an engine what it serves, ms.
const MODELS_REFRESH_MS: u64 = 10_000;

/// What [`Front::admit`] made of a body.
#[derive(Debug)]
pub enum Admission {
    /// The front runs the request: its stream.
    Front(Opened),
    /// `worker`'s engine serves `body` as it is, without recovery, for `reason`.
    Direct {
        /// The worker.
        worker: WorkerId,
        /// The client's body.
        body: Vec<u8>,
        /// Why recovery is off.
        reason: String,
    },
}

fn no_worker() -> Error {
    Error::Unavailable(
        "no worker with an engine is in service (see --engine and GET /workers)".into(),
    )
}

fn non_empty(ids: Vec<u32>) -> Result<Vec<u32>> {
    if ids.is_empty() {
        return Err(Error::InvalidArgument("an empty prompt".into()));
    }
    Ok(ids)
}

/// The request's token budget, as vLLM's server sets it: what the client gave (OpenAI's
/// default of 16 for a completion, none for a chat), no more than the context leaves after
/// the prompt (a prompt that fills it is refused, or, with `refuse_past_context` off, left to
/// the engines).
///
/// # Errors
/// [`Error::InvalidArgument`] for a prompt that fills the context;
/// [`Error::Unavailable`] for a chat without `max_tokens` when the context length is unknown.
fn budget(
    api: Api,
    given: Option<u32>,
    context: Option<u32>,
    prompt: usize,
    refuse_past_context: bool,
) -> Result<u32> {
    let room = match context {
        Some(ctx) if prompt >= ctx as usize && !refuse_past_context => None,
        Some(ctx) if prompt >= ctx as usize => {
            return Err(Error::InvalidArgument(format!(
                "This model's maximum context length is {ctx} tokens. However, your request has {prompt} input tokens. Please reduce the length of the input."
            )));
        }
        Some(ctx) => Some(ctx - prompt as u32),
        None => None,
    };
    let asked = given.or(match api.kind {
        Kind::Completion => Some(16),
        Kind::Chat => None,
    });
    match (asked, room) {
        (Some(a), Some(r)) => Ok(a.min(r)),
        (Some(a), None) => Ok(a),
        (None, Some(r)) => Ok(r),
        (None, None) => Err(Error::Unavailable(
            "the engines do not say their context length (GET /v1/models): give max_tokens".into(),
        )),
    }
}

/// A fresh request id: random, below 2^53 so that JSON readers keep it exact.
fn new_request_id() -> RequestId {
    let mut r = [0u8; 8];
    let n = rustix::rand::getrandom(&mut r, rustix::rand::GetRandomFlags::empty()).unwrap_or(0);
    let v = if n == 8 {
        u64::from_le_bytes(r)
    } else {
        // no randomness: time-based, still unique per process
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    };
    (v & ((1 << 53) - 1)).max(1)
}

impl Front {
    async fn prompt_ids(&self, asked: &mut Asked, worker: WorkerId) -> Result<Vec<u32>> {
        let model = asked.body.get("model").cloned().unwrap_or(Value::Null);
        let body = match std::mem::replace(&mut asked.prompt, Prompt::Ids(vec![])) {
            Prompt::Ids(ids) => return non_empty(ids),
            Prompt::Text(text) => json!({"model": model, "prompt": text}),
            Prompt::Chat(mut chat) => {
                chat.insert("model".into(), model);
                Value::Object(chat)
            }
        };
        let name = self.engines.name(worker);
        let ids = timeout(
            self.args.engine_timeout(),
            self.engines.tokenize(worker, body),
        )
        .await
        .map_err(|_| Error::Unavailable(format!("{name}/tokenize: no answer")))??;
        non_empty(ids)
    }

    /// What the engines serve, asked of `worker`'s engine at most every
    /// `MODELS_REFRESH_MS` (10 s) (`None`: it does not say, and none was learnt before).
    pub async fn models(&self, worker: WorkerId) -> Option<Models> {
        let now = self.hub.now_ms();
        if let Some((at, m)) = lock(&self.models).as_ref()
            && now.saturating_sub(*at) < MODELS_REFRESH_MS
        {
            return Some(m.clone());
        }
        let fresh = timeout(PROBE_TIMEOUT, self.engines.models(worker))
            .await
            .ok()
            .and_then(Result::ok)
            .and_then(|v| Models::parse(v).ok());
        let mut cached = lock(&self.models);
        match fresh {
            Some(m) => {
                *cached = Some((now, m.clone()));
                Some(m)
            }
            None => cached.as_ref().map(|(_, m)| m.clone()),
        }
    }

    /// What the engines serve, asked of a worker in service.
    pub async fn any_models(&self) -> Option<Models> {
        let w = self.pick_worker()?;
        self.models(w).await
    }

    /// Send a body to an engine in service as it is (vLLM's `/tokenize` and `/detokenize`,
    /// which a drop-in for vLLM's server answers too).
    ///
    /// # Errors
    /// No worker in service; the engine is unreachable.
    pub async fn engines_forward_any(
        &self,
        path: &'static str,
        body: Vec<u8>,
    ) -> Result<crate::engine::Forwarded> {
        let worker = self.pick_worker().ok_or_else(no_worker)?;
        self.engines_forward(worker, path, body).await
    }

    /// Send a body to `worker`'s engine as it is (a request served without recovery), the
    /// answer's head within the request deadline.
    ///
    /// # Errors
    /// The engine is unreachable or does not answer in time.
    pub async fn engines_forward(
        &self,
        worker: WorkerId,
        path: &'static str,
        body: Vec<u8>,
    ) -> Result<crate::engine::Forwarded> {
        let t = std::time::Duration::from_millis(self.args.request_deadline_ms);
        let name = self.engines.name(worker);
        timeout(t, self.engines.forward(worker, path, body))
            .await
            .map_err(|_| Error::Unavailable(format!("{name}{path}: no answer")))?
    }

    /// Admit a new request: one the front runs and recovers (its task started, its log with
    /// the first client counted in), or one that an engine serves as it is.
    ///
    /// # Errors
    /// A body this front cannot read, an unknown model, a prompt past the context, no worker,
    /// an engine that cannot tokenize the prompt, `--max-streams` reached
    /// ([`Error::Overloaded`]), a refused admission.
    pub async fn admit(self: &Arc<Self>, body: Value, api: Api) -> Result<Admission> {
        let original = self.records.get().map(|_| body.clone());
        let mut asked = match parse_body(body, api)? {
            Parsed::Front(a) => *a,
            Parsed::Direct { body, reason } => {
                let worker = self.pick_worker().ok_or_else(no_worker)?;
                self.count(|s| s.served_without_recovery += 1);
                tracing::info!(worker, reason, "front: served without recovery");
                return Ok(Admission::Direct {
                    worker,
                    body: body.to_string().into_bytes(),
                    reason,
                });
            }
        };
        let first = self.pick_worker().ok_or_else(no_worker)?;
        let model = asked.body.get("model").and_then(Value::as_str);
        let context = match self.models(first).await {
            Some(m) => m.context_of(model)?,
            None => None,
        };
        let prompt = self.prompt_ids(&mut asked, first).await?;
        // in P/D the prefill pool takes the prompt first, and may be sized for another
        // context: the engines judge it (a decode's refusal is a window the front handles)
        let refuse_past_context = !self.disaggregated();
        let max_tokens = budget(
            api,
            asked.max_tokens,
            context,
            prompt.len(),
            refuse_past_context,
        )?;
        if !api.stream {
            // the one answer at the end counts the tokens as a stream's last event does
            asked
                .body
                .insert("stream_options".into(), json!({"include_usage": true}));
        }
        let start = Start {
            prompt,
            max_tokens,
            first,
            original,
            taken: None,
        };
        self.start(asked, start).await.map(Admission::Front)
    }

    /// Set where this front keeps its streams' records for the other replicas (once).
    pub fn set_records(&self, records: Arc<dyn Records>) {
        let _ = self.records.set(records);
    }

    /// A client resumes stream `request` from event `next_seq` (it has `tokens` tokens), a
    /// stream this front does not serve: take it over from its front if that one is gone, or
    /// say where it lives.
    ///
    /// # Errors
    /// [`Error::NotFound`] for a stream no front keeps; [`Error::InvalidArgument`] for a
    /// `Last-Event-ID` without the token count; those of [`Front::admit`].
    pub async fn take_over(
        self: &Arc<Self>,
        request: RequestId,
        next_seq: u64,
        tokens: Option<usize>,
    ) -> Result<Resumed> {
        let ev = EventId {
            request,
            seq: next_seq.wrapping_sub(1),
            tokens: if next_seq == 0 { Some(0) } else { tokens },
        };
        let gone = || {
            Error::NotFound(format!(
                "no stream {} here or at another front (finished streams are kept for --retain-ms)",
                ev.request
            ))
        };
        let records = self.records.get().ok_or_else(gone)?;
        let tokens = ev.tokens.ok_or_else(|| {
            Error::InvalidArgument(
                "Last-Event-ID: REQUEST-SEQ-TOKENS as the front sends, to take a stream over"
                    .into(),
            )
        })?;
        let rec = match records.claim(ev.request).await? {
            Claim::Unknown => return Err(gone()),
            Claim::Owner(addr) => return Ok(Resumed::At(addr)),
            Claim::Taken(rec) => rec,
        };
        let bad =
            |what: &str| Error::Protocol(format!("the record of stream {}: {what}", ev.request));
        let api = Api {
            kind: if rec["api"]["chat"].as_bool() == Some(true) {
                Kind::Chat
            } else {
                Kind::Completion
            },
            stream: true,
        };
        let Parsed::Front(asked) = parse_body(rec["body"].clone(), api)? else {
            return Err(bad("a body the front does not run"));
        };
        let prompt = token_ids(&rec["prompt"]).ok_or_else(|| bad("no prompt"))?;
        let max_tokens = rec["max_tokens"]
            .as_u64()
            .and_then(|v| u32::try_from(v).ok())
            .ok_or_else(|| bad("no max_tokens"))?;
        let first = self.pick_worker().ok_or_else(no_worker)?;
        let start = Start {
            prompt,
            max_tokens,
            first,
            original: Some(rec["body"].clone()),
            taken: Some(Taken {
                id: ev.request,
                next_seq,
                tokens,
                lost_epoch: rec["epoch"].as_u64().unwrap_or(0),
                holder: rec["holder"]
                    .as_u64()
                    .and_then(|h| WorkerId::try_from(h).ok()),
            }),
        };
        self.count(|s| s.streams_taken_over += 1);
        tracing::info!(
            request = ev.request,
            seq = ev.seq,
            tokens,
            "front: taking the stream over from a front that is gone"
        );
        let opened = self.start(*asked, start).await?;
        Ok(Resumed::Here(opened))
    }

    async fn start(self: &Arc<Self>, mut asked: Asked, st: Start) -> Result<Opened> {
        let Start {
            prompt,
            max_tokens,
            first,
            original,
            taken,
        } = st;
        let (serving, cluster_blocks) = self.route(first, &prompt);
        if let Some(n) = cluster_blocks {
            // the connector asks the cluster for no more of the prompt than some node holds:
            // a prompt's new tail (every request has one) then costs no locate
            asked.body.insert(
                "kv_transfer_params".into(),
                json!({"kvd": {"cluster_blocks": n}}),
            );
        }
        let running = self.retire_finished();
        if running >= self.args.max_streams {
            return Err(Error::Overloaded {
                what: format!("{running} requests streaming (--max-streams)"),
                retry_after_ms: 1000,
            });
        }
        let id = taken.map_or_else(new_request_id, |t| t.id);
        let tokens = prompt.len() as u64 + u64::from(max_tokens);
        let reserve = if asked.checkpoint {
            self.args.reservation_bytes(tokens)
        } else {
            0
        };
        let deadline_ms = self.hub.now_ms() + self.args.request_deadline_ms;
        let req = AdmitRequest {
            request_id: id,
            serving,
            prompt_tokens: prompt.len() as u32,
            max_new_tokens: max_tokens,
            reserve_bytes: reserve,
            deadline_ms: Some(deadline_ms),
        };
        let (adm, serving) = self.admit_in_service(req, taken)?;
        let log =
            StreamLog::starting_at(self.args.max_stream_bytes, taken.map_or(0, |t| t.next_seq));
        let guard = log.client();
        lock(&self.streams).insert(id, Arc::clone(&log));
        self.hub.watch_request(id);
        tracing::info!(request = id, worker = serving, holder = ?adm.holder, prompt = prompt.len(), max_tokens, "front: admitted");
        let record = original.map(|body| {
            json!({
                "api": {"chat": asked.api.kind == Kind::Chat},
                "body": body,
                "prompt": &prompt,
                "max_tokens": max_tokens,
                "epoch": adm.epoch,
                "holder": adm.holder,
            })
        });
        let m = Admitted {
            id,
            body: asked.body,
            prompt,
            max_tokens,
            min_tokens: asked.min_tokens,
            want_token_ids: asked.want_token_ids,
            api: asked.api,
            stops: asked.stops,
            epoch: adm.epoch,
            serving,
            holder: adm.holder,
            deadline_ms,
            grace_ms: self.args.reconnect_grace_ms,
            resume_priority: self.args.resume_priority,
        };
        let m = match taken {
            Some(t) => Request::taken_over(
                m,
                Takeover {
                    next_seq: t.next_seq,
                    tokens: t.tokens,
                    restore: t.holder.map(|holder| RestoreFrom {
                        holder,
                        epoch: t.lost_epoch,
                        local: holder == serving,
                    }),
                },
            ),
            None if self.disaggregated() => Request::disaggregated(m),
            None => Request::new(m),
        };
        self.set_active(&m);
        self.count(|s| s.streams_started += 1);
        let mut driver = Driver::new(Arc::clone(self), m, Arc::clone(&log));
        if let Some(r) = record {
            driver.keep_record(r);
        }
        tokio::spawn(driver.run());
        Ok((id, log, guard))
    }

    /// Admit `req` with the controller. A worker picked in service can fail before its
    /// request is admitted: the front may be waiting on that very engine (its models, the
    /// tokenizer) when the break of another stream fails it. Such a request is admitted on the
    /// least loaded worker still in service instead, at most [`REPICKS`] times; a refusal for
    /// any other reason stands. The admission and the worker it names.
    fn admit_in_service(
        &self,
        mut req: AdmitRequest,
        taken: Option<Taken>,
    ) -> Result<(kvd_control::Admission, WorkerId)> {
        for _ in 0..REPICKS {
            let r = match taken {
                Some(t) => self.hub.admit_taken_over(req, t.lost_epoch),
                None => self.hub.admit(req),
            };
            match r {
                Err(Error::Unavailable(why)) if !self.in_service(req.serving) => {
                    let next = self.pick_worker().ok_or_else(no_worker)?;
                    tracing::info!(request = req.request_id, from = req.serving, to = next, %why,
                        "front: the worker left service before the admission; admitting on another");
                    self.count(|s| s.admissions_repicked += 1);
                    req.serving = next;
                }
                r => return r.map(|adm| (adm, req.serving)),
            }
        }
        Err(Error::Unavailable(format!(
            "workers kept leaving service while request {} was admitted ({REPICKS} tries); retry",
            req.request_id
        )))
    }

    /// End a stream whose front died and whose client did not come back: the checkpoint its
    /// record names ends at its holder (the leader's sweep).
    pub async fn end_orphan(&self, id: RequestId, record: &Value) {
        let holder = record["holder"]
            .as_u64()
            .and_then(|h| WorkerId::try_from(h).ok());
        let epoch = record["epoch"].as_u64().unwrap_or(0);
        if let Some(h) = holder
            && let Err(e) = timeout(PROBE_TIMEOUT, self.holders.end(h, id, epoch))
                .await
                .unwrap_or_else(|_| Err(Error::Unavailable("no answer".into())))
        {
            self.count(|s| s.holder_calls_failed += 1);
            tracing::warn!(request = id, holder = h, error = %e, "front: an orphan's checkpoint did not end (its holder's lease will)");
        }
    }

    /// Keep `record` for `id` where the other replicas find it (bounded: a record past
    /// [`MAX_RECORD_BYTES`] is not kept, and that stream cannot be taken over).
    pub(crate) fn keep_record(&self, id: RequestId, record: &Value) {
        let Some(records) = self.records.get() else {
            return;
        };
        if record.to_string().len() > MAX_RECORD_BYTES {
            self.count(|s| s.records_too_large += 1);
            return;
        }
        records.keep(id, record.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_is_vllms_within_the_context_and_a_prompt_past_it_is_refused() {
        let api = |kind| Api { kind, stream: true };
        let (c, chat) = (api(Kind::Completion), api(Kind::Chat));
        assert_eq!(budget(c, None, Some(100), 10, true).unwrap(), 16);
        assert_eq!(budget(chat, None, Some(100), 10, true).unwrap(), 90);
        assert_eq!(budget(c, Some(500), Some(100), 10, true).unwrap(), 90);
        assert_eq!(budget(c, Some(5), None, 10, true).unwrap(), 5);
        let past = budget(c, Some(5), Some(100), 100, true).unwrap_err();
        assert!(
            matches!(past, Error::InvalidArgument(ref m) if m.contains("maximum context length is 100"))
        );
        assert_eq!(
            budget(c, Some(5), Some(100), 150, false).unwrap(),
            5,
            "left to the engines"
        );
        assert!(matches!(
            budget(chat, None, None, 10, true),
            Err(Error::Unavailable(_))
        ));
    }

    #[test]
    fn request_ids_stay_exact_in_json_numbers() {
        for _ in 0..100 {
            let id = new_request_id();
            assert!(id > 0 && id < 1 << 53);
        }
    }
}
