//! `kvd control`'s streaming front: an OpenAI-compatible `/v1/completions` (streaming) that an
//! application or gateway points at instead of one engine, and that keeps a request's stream
//! going when the worker serving it dies (DESIGN §7b).
//!
//! ```text
//! client ──POST /v1/completions──▶ front ── admit (placement: worker, holder, epoch 1)
//!    ▲                               │
//!    │ id: R-0, R-1, …               ├─▶ worker's vLLM  /v1/completions  (prompt ids,
//!    │ (Last-Event-ID resumes)       │     kv_transfer_params.kvd.checkpoint {holder, R, epoch})
//!    │                               │      └─ its connector streams each block to the holder
//!    └──── numbered event log ◀──────┤
//!                                    │  the stream breaks (or etcd says the node is gone):
//!                                    ├─▶ holders' admin GET /checkpoints/R → CheckpointStored
//!                                    ├─▶ controller: fail the worker → RestorePlan (epoch + 1)
//!                                    └─▶ survivor's vLLM: prompt + committed tokens, remaining
//!                                          budget, kvd.restore {holder, R} + a new checkpoint
//! ```
//!
//! - **One task per request** drives it: admits, forwards, relays, recovers, ends. Every event
//!   it relays goes into the request's [`stream::StreamLog`] with a sequence number (SSE
//!   `id: R-S`); client connections read the log, so a client that reconnects with
//!   `Last-Event-ID: R-S` (on `GET /v1/streams/R`, or the same POST) gets exactly what follows.
//! - **Recovery** happens when the worker's stream breaks and its engine no longer answers
//!   `/health`, or when a failure event from elsewhere (etcd membership, the health watch, the
//!   admin API) already planned this request. Before failing a worker the front asks each
//!   holder what it really holds for that worker's requests (the daemon's admin
//!   `GET /checkpoints/{request}`), so the plan loads what is there. The request keeps its
//!   original deadline; the controller's migration budget bounds the retries; a plan that
//!   fails the request ends the stream with an error event.
//! - **A client that disconnects** and does not come back within `--reconnect-grace-ms`
//!   cancels the request: the engine's connection is dropped (vLLM aborts the request), the
//!   holder's checkpoint is ended (`DELETE /checkpoints/{request}`), and the controller
//!   releases the reservation.
//! - **Events of an older epoch are dropped**: only the current attempt's connection is read,
//!   and a plan that arrives while it runs ends it before anything more is relayed.
//! - **Workers come back** when their engine answers `/health` again and their node is
//!   registered (`WorkerRecovered`, then each recovery phase done: an engine that answers is
//!   whole, there is no draft model to load); an in-service worker whose engine stops
//!   answering twice in a row is failed (its requests are planned at once).
//!
//! What continues exactly after a recovery (docs/CONTROL.md): greedy decoding, token for
//! token. Not exactly: seeded sampling (vLLM seeds a fresh generator for the resubmitted
//! request, so the continuation is a valid sample with the same seed, not the uninterrupted
//! run's tokens), frequency and presence penalties (the committed tokens become prompt, which
//! those penalties do not count), stop strings that span the break.

pub mod stream;
pub mod upstream;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use hyper::Method;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::control::{AdmitRequest, Decision, Epoch, Event, RequestId, WorkerId, WorkerPhase};
use crate::control_service::Shared;
use crate::{Error, Result};
use stream::{ClientGuard, Read, StreamLog};
use upstream::{Endpoint, EventReader, Next};

/// The streaming front's arguments (part of `kvd control`).
#[derive(Debug, Clone, clap::Args)]
pub struct FrontArgs {
    /// A worker's engine, as ID=URL: the OpenAI-compatible server (vLLM's) of the node whose
    /// kvd daemon has node id ID, e.g. 1=http://10.0.0.1:8000. Repeat per worker. With at
    /// least one, `kvd control` serves the streaming front (`POST /v1/completions`); it needs
    /// --etcd (the holders' admin addresses and the workers' capacities come from the nodes'
    /// registrations).
    #[arg(long = "engine", value_name = "ID=URL")]
    pub engines: Vec<String>,
    /// KV bytes per token of the served model (layers × 2 × KV heads × head dim × dtype
    /// bytes): a request's checkpoint reservation is (prompt + max_tokens) × this.
    #[arg(long, default_value_t = 131072)]
    pub kv_bytes_per_token: u64,
    /// How long a request whose client disconnected waits for it to reconnect
    /// (Last-Event-ID) before it is cancelled, ms.
    #[arg(long, default_value_t = 10_000)]
    pub reconnect_grace_ms: u64,
    /// How long a finished stream stays readable for a client that reconnects late, ms.
    #[arg(long, default_value_t = 60_000)]
    pub retain_ms: u64,
    /// Longest wait for an engine: to connect and answer, and between two events of its
    /// stream (a silent stream is a broken one), ms.
    #[arg(long, default_value_t = 30_000)]
    pub engine_timeout_ms: u64,
    /// A request's deadline from its arrival, ms; recovery never runs past it.
    #[arg(long, default_value_t = 600_000)]
    pub request_deadline_ms: u64,
    /// Streams at once (requests in flight plus finished ones still retained); past it new
    /// requests get 429.
    #[arg(long, default_value_t = 256)]
    pub max_streams: usize,
    /// Bytes of events kept per stream for clients that reconnect; past it the oldest go.
    #[arg(long, default_value_t = 4 << 20)]
    pub max_stream_bytes: usize,
}

/// Parse the `--engine ID=URL` list.
///
/// # Errors
/// [`Error::InvalidArgument`] for a malformed entry or a repeated id.
pub fn parse_engines(list: &[String]) -> Result<BTreeMap<WorkerId, Endpoint>> {
    let mut out = BTreeMap::new();
    for e in list {
        let (id, url) = e.split_once('=').ok_or_else(|| {
            Error::InvalidArgument(format!(
                "--engine {e:?}: expected ID=URL, e.g. 1=http://127.0.0.1:8000"
            ))
        })?;
        let id: WorkerId = id.trim().parse().map_err(|_| {
            Error::InvalidArgument(format!("--engine {e:?}: {id:?} is not a node id"))
        })?;
        if out.insert(id, url.trim().parse()?).is_some() {
            return Err(Error::InvalidArgument(format!(
                "--engine: worker {id} given twice"
            )));
        }
    }
    Ok(out)
}

/// The front's counters (`/status`, and `/metrics` as `kvd_control_front_<name>`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FrontStats {
    /// Streams admitted.
    pub streams_started: u64,
    /// Requests refused before their stream began (bad request, no worker, overload).
    pub streams_refused: u64,
    /// Streams that ended with the engine's last token.
    pub streams_finished: u64,
    /// Streams that ended with an error event.
    pub streams_failed: u64,
    /// Streams cancelled because their client left.
    pub streams_cancelled: u64,
    /// Client connections that resumed a stream with Last-Event-ID.
    pub clients_resumed: u64,
    /// Tokens relayed to clients.
    pub tokens_relayed: u64,
    /// Requests resumed on a survivor.
    pub recoveries: u64,
    /// ... of which with a checkpoint to load (the plan named a KV source).
    pub recoveries_from_checkpoint: u64,
    /// ... of which recomputed from the tokens alone.
    pub recoveries_recomputed: u64,
    /// Tokens the plans loaded from checkpoints.
    pub restored_tokens: u64,
    /// Tokens the plans recomputed.
    pub recomputed_tokens: u64,
    /// Sum over recoveries of the time from the break to the survivor's first token, ms.
    pub recovery_ms_total: u64,
    /// Workers failed by this front (broken streams, failed health checks).
    pub workers_failed: u64,
    /// Workers brought back when their engine answered again.
    pub workers_recovered: u64,
    /// Checkpoint bytes the holders held when their request ended or broke.
    pub checkpoint_bytes: u64,
    /// Tokens those checkpoints covered.
    pub checkpoint_tokens: u64,
    /// Checkpoint moves the engine could not follow (its holder died mid-request).
    pub checkpoint_moves_unfollowed: u64,
    /// Holder admin calls that failed (the holder was then treated as gone).
    pub holder_calls_failed: u64,
}

/// One recovery, as `/status` lists it and the log line carries it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RecoveryRecord {
    /// The request.
    pub request: RequestId,
    /// The epoch it resumed in.
    pub epoch: Epoch,
    /// The worker that broke.
    pub from: WorkerId,
    /// The survivor.
    pub to: WorkerId,
    /// Where its KV came from (`None`: recomputed).
    pub kv_source: Option<WorkerId>,
    /// Tokens the plan loaded from the checkpoint.
    pub load_tokens: u32,
    /// Tokens the plan recomputed.
    pub recompute_tokens: u32,
    /// Tokens generated before the break.
    pub committed_tokens: u32,
    /// Break (as the front saw it) to the survivor's first token, ms.
    pub recovery_ms: u64,
    /// Why it broke.
    pub reason: String,
}

/// Most recoveries `/status` lists.
const RECOVERIES_KEPT: usize = 64;
/// How often the health watch asks each engine.
const HEALTH_EVERY: Duration = Duration::from_secs(1);
/// Longest wait for one health check or holder call.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// Misses in a row after which an in-service worker's engine counts as gone.
const HEALTH_MISSES: u32 = 2;
/// How often a running request's checkpoint progress is read from its holder.
const PROGRESS_EVERY: Duration = Duration::from_secs(2);
/// A keep-alive comment to clients this often while nothing else is sent (so a client that
/// left is noticed even while its request waits for a survivor).
const KEEPALIVE: Duration = Duration::from_secs(1);

/// The streaming front.
#[derive(Debug)]
pub struct Front {
    shared: Arc<Shared>,
    args: FrontArgs,
    engines: BTreeMap<WorkerId, Endpoint>,
    streams: Mutex<HashMap<RequestId, Arc<StreamLog>>>,
    active: Mutex<HashMap<RequestId, Active>>,
    recoveries: Mutex<VecDeque<RecoveryRecord>>,
}

/// What the front knows of a running request (for reporting its checkpoint before a failure).
#[derive(Debug, Clone, Copy, Serialize)]
struct Active {
    serving: WorkerId,
    holder: Option<WorkerId>,
    epoch: Epoch,
    generated: u32,
}

/// A holder's answer about one checkpoint (the daemon's `CheckpointReport`).
#[derive(Debug, Clone, Deserialize)]
struct Held {
    epoch: u64,
    committed_tokens: u64,
    bytes: u64,
}

/// Where a restoring attempt loads its prefix from.
#[derive(Debug, Clone, Copy)]
struct RestoreFrom {
    holder: WorkerId,
    /// The epoch whose checkpoint it loads.
    epoch: Epoch,
    /// The survivor is the holder: the blocks are on its own node.
    local: bool,
}

/// A recovery waiting for the survivor's first token to be recorded.
#[derive(Debug, Clone)]
struct Pending {
    at: Instant,
    record: RecoveryRecord,
}

/// One request, as its task drives it.
#[derive(Debug)]
struct Run {
    id: RequestId,
    /// The client's body, less what the front sets per attempt.
    body: serde_json::Map<String, Value>,
    prompt: Vec<u32>,
    generated: Vec<u32>,
    max_tokens: u32,
    min_tokens: u32,
    epoch: Epoch,
    serving: WorkerId,
    holder: Option<WorkerId>,
    restore: Option<RestoreFrom>,
    deadline: Instant,
    log: Arc<StreamLog>,
    want_token_ids: bool,
    finish_reason: Option<String>,
    pending: Option<Pending>,
}

/// How one attempt on one worker ended.
#[derive(Debug)]
enum Outcome {
    Finished,
    ClientGone,
    /// The engine refused or failed the request itself (it still answers): no recovery.
    Failed(String),
    /// The stream broke.
    Broken(String),
    /// A plan for this request arrived while the attempt ran.
    Planned(Decision),
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

fn error_json(status: StatusCode, kind: &str, message: &str) -> Response {
    (
        status,
        axum::Json(json!({"error": {"message": message, "type": kind, "code": status.as_u16()}})),
    )
        .into_response()
}

fn refusal(e: &Error) -> Response {
    let status = match e {
        Error::InvalidArgument(_) | Error::Protocol(_) => StatusCode::BAD_REQUEST,
        Error::NotFound(_) => StatusCode::NOT_FOUND,
        Error::NoSpace { .. } | Error::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
        _ => StatusCode::SERVICE_UNAVAILABLE,
    };
    error_json(status, "kvd_front", &e.to_string())
}

/// `Last-Event-ID: R-S` → (R, S).
fn parse_event_id(v: &str) -> Option<(RequestId, u64)> {
    let (r, s) = v.trim().split_once('-')?;
    Some((r.parse().ok()?, s.parse().ok()?))
}

fn frame(id: RequestId, seq: u64, data: &str) -> String {
    format!("id: {id}-{seq}\ndata: {data}\n\n")
}

impl Front {
    /// A front over `shared` for the engines `args` names.
    ///
    /// # Errors
    /// Malformed `--engine` entries.
    pub fn new(shared: Arc<Shared>, args: FrontArgs) -> Result<Arc<Front>> {
        let engines = parse_engines(&args.engines)?;
        Ok(Arc::new(Front {
            shared,
            args,
            engines,
            streams: Mutex::default(),
            active: Mutex::default(),
            recoveries: Mutex::default(),
        }))
    }

    fn count(&self, f: impl FnOnce(&mut FrontStats)) {
        self.shared.count_front(f);
    }

    /// The counters.
    pub fn stats(&self) -> FrontStats {
        self.shared.front_stats()
    }

    fn engine_timeout(&self) -> Duration {
        Duration::from_millis(self.args.engine_timeout_ms)
    }

    /// The front's routes.
    pub fn routes(self: &Arc<Self>) -> Router {
        Router::new()
            .route("/v1/completions", post(completions))
            .route("/v1/streams/{id}", get(resume))
            .route("/status", get(status))
            .layer(DefaultBodyLimit::max(
                crate::control_service::MAX_BODY_BYTES,
            ))
            .with_state(Arc::clone(self))
    }

    /// Start the health watch (until the process ends).
    pub fn spawn_health_watch(self: &Arc<Self>) {
        let f = Arc::clone(self);
        tokio::spawn(async move { f.health_watch().await });
    }

    /// The in-service worker with an engine that serves the fewest requests.
    fn pick_worker(&self) -> Option<WorkerId> {
        let load = self.shared.load();
        load.in_service()
            .filter(|w| self.engines.contains_key(&w.id))
            .min_by_key(|w| (w.serving_requests, w.id))
            .map(|w| w.id)
    }

    async fn tokenize(&self, worker: WorkerId, model: &Value, text: &str) -> Result<Vec<u32>> {
        let ep = &self.engines[&worker];
        let body = json!({"model": model, "prompt": text});
        let (status, b) = upstream::call(
            ep,
            Method::POST,
            "/tokenize",
            Some(body.to_string().into_bytes()),
            self.engine_timeout(),
        )
        .await?;
        let v: Value = serde_json::from_slice(&b)
            .map_err(|e| Error::Protocol(format!("{ep}/tokenize: {e}")))?;
        if !status.is_success() {
            return Err(Error::InvalidArgument(format!(
                "{ep}/tokenize: {status}: {v}"
            )));
        }
        token_ids(&v["tokens"])
            .ok_or_else(|| Error::Protocol(format!("{ep}/tokenize: no tokens in {v}")))
    }

    /// Admit a new request; its log, with the first client counted in.
    async fn admit(
        self: &Arc<Self>,
        body: Value,
    ) -> Result<(RequestId, Arc<StreamLog>, ClientGuard)> {
        let Value::Object(mut body) = body else {
            return Err(Error::InvalidArgument(
                "the body is not a JSON object".into(),
            ));
        };
        if body.get("stream").and_then(Value::as_bool) != Some(true) {
            return Err(Error::InvalidArgument(
                "this front serves streams only: set \"stream\": true".into(),
            ));
        }
        for (k, ok) in [("n", 1), ("best_of", 1)] {
            if body.get(k).and_then(Value::as_u64).is_some_and(|v| v != ok) {
                return Err(Error::InvalidArgument(format!("{k} must be 1 here")));
            }
        }
        if body.get("echo").and_then(Value::as_bool) == Some(true) {
            return Err(Error::InvalidArgument("echo is not supported here".into()));
        }
        let checkpoint = body
            .remove("kvd")
            .and_then(|k| k.get("checkpoint").and_then(Value::as_bool))
            .unwrap_or(true);
        body.remove("kv_transfer_params");
        body.remove("stream");
        let want_token_ids = body
            .remove("return_token_ids")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        let max_tokens = match body.remove("max_tokens") {
            None | Some(Value::Null) => 16,
            Some(v) => v
                .as_u64()
                .and_then(|v| u32::try_from(v).ok())
                .filter(|v| *v > 0)
                .ok_or_else(|| Error::InvalidArgument(format!("max_tokens {v}")))?,
        };
        let min_tokens = body
            .remove("min_tokens")
            .and_then(|v| v.as_u64())
            .map_or(0, |v| v.min(u64::from(max_tokens)) as u32);
        let serving = self.pick_worker().ok_or_else(|| {
            Error::Unavailable(
                "no worker with an engine is in service (see --engine and GET /workers)".into(),
            )
        })?;
        let prompt = match body.remove("prompt") {
            Some(Value::String(s)) => {
                self.tokenize(serving, body.get("model").unwrap_or(&Value::Null), &s)
                    .await?
            }
            Some(v) => token_ids(&v).ok_or_else(|| {
                Error::InvalidArgument(
                    "prompt: a string or a list of token ids (one prompt)".into(),
                )
            })?,
            None => return Err(Error::InvalidArgument("no prompt".into())),
        };
        if prompt.is_empty() {
            return Err(Error::InvalidArgument("an empty prompt".into()));
        }
        {
            let streams = self.streams.lock().unwrap_or_else(|p| p.into_inner());
            if streams.len() >= self.args.max_streams {
                return Err(Error::Overloaded {
                    what: format!("{} streams (--max-streams)", streams.len()),
                    retry_after_ms: 1000,
                });
            }
        }
        let id = new_request_id();
        let reserve = if checkpoint {
            (prompt.len() as u64 + u64::from(max_tokens))
                .saturating_mul(self.args.kv_bytes_per_token)
        } else {
            0
        };
        let deadline_ms = self.shared.now_ms() + self.args.request_deadline_ms;
        let adm = self.shared.admit(AdmitRequest {
            request_id: id,
            serving,
            prompt_tokens: prompt.len() as u32,
            max_new_tokens: max_tokens,
            reserve_bytes: reserve,
            deadline_ms: Some(deadline_ms),
        })?;
        let log = StreamLog::new(self.args.max_stream_bytes);
        let guard = log.client();
        self.streams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, Arc::clone(&log));
        self.shared.watch_request(id);
        let run = Run {
            id,
            body,
            prompt,
            generated: Vec::new(),
            max_tokens,
            min_tokens,
            epoch: adm.epoch,
            serving,
            holder: adm.holder,
            restore: None,
            deadline: Instant::now() + Duration::from_millis(self.args.request_deadline_ms),
            log: Arc::clone(&log),
            want_token_ids,
            finish_reason: None,
            pending: None,
        };
        self.count(|s| s.streams_started += 1);
        tracing::info!(request = id, worker = serving, holder = ?adm.holder, prompt = run.prompt.len(), max_tokens, "front: admitted");
        let f = Arc::clone(self);
        tokio::spawn(async move { f.drive(run).await });
        Ok((id, log, guard))
    }

    fn set_active(&self, run: &Run) {
        self.active
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                run.id,
                Active {
                    serving: run.serving,
                    holder: run.holder,
                    epoch: run.epoch,
                    generated: run.generated.len() as u32,
                },
            );
    }

    fn apply(&self, e: Event) -> Vec<Decision> {
        match self.shared.apply(&e) {
            Ok(d) => d,
            Err(err) => {
                tracing::debug!(event = ?e, error = %err, "front: event refused");
                vec![]
            }
        }
    }

    /// The request's task: attempts until it finishes, fails, or its client leaves.
    async fn drive(self: Arc<Self>, mut run: Run) {
        let id = run.id;
        loop {
            self.set_active(&run);
            let outcome = self.attempt(&mut run).await;
            match outcome {
                Outcome::Finished => {
                    self.apply(Event::Finished {
                        request_id: id,
                        epoch: run.epoch,
                    });
                    run.log.push(|seq| frame(id, seq, "[DONE]"));
                    self.count(|s| s.streams_finished += 1);
                    break;
                }
                Outcome::ClientGone => {
                    let ds = self.apply(Event::Cancel { request_id: id });
                    for d in ds {
                        if let Decision::Cancel { epoch, .. } = d {
                            // the engine's connection went with the attempt: it aborted
                            self.apply(Event::Cancelled {
                                request_id: id,
                                epoch,
                            });
                        }
                    }
                    self.count(|s| s.streams_cancelled += 1);
                    tracing::info!(
                        request = id,
                        generated = run.generated.len(),
                        "front: the client left; cancelled"
                    );
                    break;
                }
                Outcome::Failed(msg) => {
                    self.apply(Event::RequestFailed {
                        request_id: id,
                        epoch: run.epoch,
                        reason: msg.clone(),
                    });
                    self.fail_stream(&run, &msg);
                    break;
                }
                Outcome::Broken(reason) => {
                    if let Err(msg) = self.recover(&mut run, reason).await {
                        self.fail_stream(&run, &msg);
                        break;
                    }
                }
                Outcome::Planned(d) => {
                    if let Err(msg) = self.follow(
                        &mut run,
                        d,
                        Instant::now(),
                        "a failure event planned it".into(),
                    ) {
                        self.fail_stream(&run, &msg);
                        break;
                    }
                }
            }
        }
        self.end_checkpoints(&run).await;
        run.log.close();
        self.shared.unwatch_request(id);
        self.active
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
        // readable for late clients a while, then gone
        let f = Arc::clone(&self);
        let retain = Duration::from_millis(self.args.retain_ms);
        tokio::spawn(async move {
            tokio::time::sleep(retain).await;
            f.streams
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&id);
        });
    }

    fn fail_stream(&self, run: &Run, msg: &str) {
        let id = run.id;
        let data = json!({"error": {"message": msg, "type": "kvd_recovery_failed"}, "kvd": {"request": id, "epoch": run.epoch}});
        run.log.push(|seq| frame(id, seq, &data.to_string()));
        run.log.push(|seq| frame(id, seq, "[DONE]"));
        self.count(|s| s.streams_failed += 1);
        tracing::warn!(
            request = id,
            error = msg,
            "front: the stream ends with an error"
        );
    }

    /// The body for the current attempt.
    fn upstream_body(&self, run: &Run) -> Value {
        let mut b = run.body.clone();
        let mut prompt = run.prompt.clone();
        prompt.extend_from_slice(&run.generated);
        let done = run.generated.len() as u32;
        b.insert("prompt".into(), json!(prompt));
        b.insert("max_tokens".into(), json!(run.max_tokens - done));
        if run.min_tokens > 0 {
            b.insert(
                "min_tokens".into(),
                json!(run.min_tokens.saturating_sub(done)),
            );
        }
        b.insert("stream".into(), json!(true));
        b.insert("return_token_ids".into(), json!(true));
        let mut kvd = serde_json::Map::new();
        if let Some(h) = run.holder {
            kvd.insert(
                "checkpoint".into(),
                json!({"holder": h, "request": run.id, "epoch": run.epoch}),
            );
        }
        if let Some(r) = run.restore {
            kvd.insert(
                "restore".into(),
                json!({"holder": r.holder, "request": run.id, "epoch": r.epoch, "local": r.local}),
            );
        }
        if !kvd.is_empty() {
            b.insert("kv_transfer_params".into(), json!({ "kvd": kvd }));
        }
        Value::Object(b)
    }

    /// One attempt on the serving worker.
    async fn attempt(&self, run: &mut Run) -> Outcome {
        if run.generated.len() as u32 >= run.max_tokens || run.finish_reason.is_some() {
            return Outcome::Finished;
        }
        let Some(ep) = self.engines.get(&run.serving).cloned() else {
            return Outcome::Failed(format!(
                "worker {} has no engine address (--engine)",
                run.serving
            ));
        };
        self.apply(Event::PrefillStarted {
            request_id: run.id,
            epoch: run.epoch,
        });
        let body = self.upstream_body(run).to_string().into_bytes();
        let (status, incoming) = match upstream::send(
            &ep,
            Method::POST,
            "/v1/completions",
            Some(body),
            self.engine_timeout(),
        )
        .await
        {
            Ok(r) => r,
            Err(e) => return Outcome::Broken(e.to_string()),
        };
        if !status.is_success() {
            let text = upstream::read_all(&ep, incoming, PROBE_TIMEOUT)
                .await
                .unwrap_or_default();
            let text = String::from_utf8_lossy(&text).into_owned();
            return if status.is_server_error() {
                Outcome::Broken(format!("{ep} answered {status}: {text}"))
            } else {
                Outcome::Failed(format!("the engine refused the request ({status}): {text}"))
            };
        }
        let mut reader = EventReader::new(incoming);
        let mut plans = self.shared.plans_changed();
        let mut clients = run.log.subscribe();
        let grace = Duration::from_millis(self.args.reconnect_grace_ms);
        let mut alone_since: Option<Instant> = None;
        let mut progress = tokio::time::interval(PROGRESS_EVERY);
        progress.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut first = true;
        loop {
            plans.borrow_and_update();
            clients.borrow_and_update();
            if let Some(d) = self.shared.take_plan(run.id) {
                match d {
                    Decision::Checkpoint { holder, .. } => {
                        // the engine cannot be re-pointed mid-request: it keeps pushing to
                        // the old holder (which is gone); the new one holds nothing yet
                        tracing::warn!(request = run.id, new_holder = ?holder, "front: the holder died; this attempt runs without a checkpoint");
                        run.holder = None;
                        self.set_active(run);
                        self.count(|s| s.checkpoint_moves_unfollowed += 1);
                    }
                    d => return Outcome::Planned(d),
                }
            }
            if run.log.clients() == 0 {
                let since = *alone_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= grace {
                    return Outcome::ClientGone;
                }
            } else {
                alone_since = None;
            }
            let alone_left = alone_since.map(|s| grace.saturating_sub(s.elapsed()));
            tokio::select! {
                ev = tokio::time::timeout(self.engine_timeout(), reader.next()) => match ev {
                    Err(_) => return Outcome::Broken(format!("no event from {ep} for {} ms", self.args.engine_timeout_ms)),
                    Ok(Err(e)) => return Outcome::Broken(e.to_string()),
                    Ok(Ok(Next::End)) => {
                        return if run.finish_reason.is_some() {
                            Outcome::Finished
                        } else {
                            Outcome::Broken(format!("{ep} ended the stream before its last token"))
                        };
                    }
                    Ok(Ok(Next::Data(d))) => {
                        if d.trim() == "[DONE]" {
                            return if run.finish_reason.is_some() || run.generated.len() as u32 >= run.max_tokens {
                                Outcome::Finished
                            } else {
                                Outcome::Broken(format!("{ep} sent [DONE] before the last token"))
                            };
                        }
                        if let Err(msg) = self.relay(run, &d, &mut first) {
                            return Outcome::Failed(msg);
                        }
                    }
                },
                _ = changed(&mut plans) => {}
                _ = changed(&mut clients) => {}
                _ = progress.tick() => self.report_progress(run),
                _ = sleep_opt(alone_left) => {}
            }
        }
    }

    /// Relay one event of the engine's stream.
    fn relay(
        &self,
        run: &mut Run,
        data: &str,
        first: &mut bool,
    ) -> std::result::Result<(), String> {
        let mut v: Value = serde_json::from_str(data)
            .map_err(|e| format!("the engine sent an event that is not JSON: {e}"))?;
        if let Some(err) = v.get("error") {
            return Err(format!("the engine failed the request: {err}"));
        }
        let mut new_tokens = 0u32;
        if let Some(choice) = v.get_mut("choices").and_then(|c| c.get_mut(0)) {
            let ids = token_ids(choice.get("token_ids").unwrap_or(&Value::Null));
            let text = choice.get("text").and_then(Value::as_str).unwrap_or("");
            match ids {
                Some(ids) => {
                    new_tokens = ids.len() as u32;
                    run.generated.extend_from_slice(&ids);
                }
                None if !text.is_empty() => {
                    return Err("the engine's stream carries no token_ids (the front needs return_token_ids: vLLM ≥ 0.10.2)".into());
                }
                None => {}
            }
            if let Some(r) = choice.get("finish_reason").and_then(Value::as_str) {
                run.finish_reason = Some(r.to_string());
            }
            if let Some(o) = choice.as_object_mut() {
                o.remove("prompt_token_ids");
                if !run.want_token_ids {
                    o.remove("token_ids");
                }
            }
        }
        if let Some(o) = v.as_object_mut() {
            o.insert("id".into(), json!(format!("cmpl-kvd-{}", run.id)));
            o.remove("prompt_token_ids");
            if run.want_token_ids && run.log.next_seq() == 0 {
                o.insert("prompt_token_ids".into(), json!(run.prompt));
            }
            if let Some(u) = o.get_mut("usage").and_then(Value::as_object_mut) {
                let (p, c) = (run.prompt.len(), run.generated.len());
                u.insert("prompt_tokens".into(), json!(p));
                u.insert("completion_tokens".into(), json!(c));
                u.insert("total_tokens".into(), json!(p + c));
            }
        }
        if new_tokens > 0 {
            if *first {
                *first = false;
                self.apply(Event::DecodingStarted {
                    request_id: run.id,
                    epoch: run.epoch,
                });
                self.recovered(run);
            }
            self.apply(Event::TokensCommitted {
                request_id: run.id,
                epoch: run.epoch,
                generated_tokens: run.generated.len() as u32,
            });
            self.count(|s| s.tokens_relayed += u64::from(new_tokens));
        }
        let (id, epoch, worker) = (run.id, run.epoch, run.serving);
        run.log.push(|seq| {
            if let Some(o) = v.as_object_mut() {
                o.insert(
                    "kvd".into(),
                    json!({"request": id, "seq": seq, "epoch": epoch, "worker": worker}),
                );
            }
            frame(id, seq, &v.to_string())
        });
        Ok(())
    }

    /// The survivor's first token: the recovery is done; record it, end the old checkpoint.
    fn recovered(&self, run: &mut Run) {
        let Some(p) = run.pending.take() else { return };
        let mut rec = p.record;
        rec.recovery_ms = p.at.elapsed().as_millis() as u64;
        tracing::info!(
            target: "kvd::recovery",
            request = rec.request,
            epoch = rec.epoch,
            from = rec.from,
            to = rec.to,
            kv_source = ?rec.kv_source,
            load_tokens = rec.load_tokens,
            recompute_tokens = rec.recompute_tokens,
            committed_tokens = rec.committed_tokens,
            recovery_ms = rec.recovery_ms,
            reason = %rec.reason,
            "request recovered"
        );
        self.count(|s| {
            s.recoveries += 1;
            if rec.kv_source.is_some() {
                s.recoveries_from_checkpoint += 1;
            } else {
                s.recoveries_recomputed += 1;
            }
            s.restored_tokens += u64::from(rec.load_tokens);
            s.recomputed_tokens += u64::from(rec.recompute_tokens);
            s.recovery_ms_total += rec.recovery_ms;
        });
        {
            let mut r = self.recoveries.lock().unwrap_or_else(|p| p.into_inner());
            if r.len() >= RECOVERIES_KEPT {
                r.pop_front();
            }
            r.push_back(rec);
        }
        // the restore has read what it needed: the old checkpoint goes
        if let Some(r) = run.restore.take() {
            if let Some(admin) = self.shared.node_admin(u64::from(r.holder)) {
                let id = run.id;
                tokio::spawn(async move {
                    let _ = end_at(&admin, id, r.epoch).await;
                });
            }
        }
    }

    /// Tell the controller what the holder holds for this run (in the background).
    fn report_progress(&self, run: &Run) {
        let (Some(h), false) = (run.holder, run.generated.is_empty()) else {
            return;
        };
        let Some(admin) = self.shared.node_admin(u64::from(h)) else {
            return;
        };
        let (shared, id, epoch, history) = (
            Arc::clone(&self.shared),
            run.id,
            run.epoch,
            run.prompt.len() + run.generated.len(),
        );
        tokio::spawn(async move {
            if let Ok(Some(held)) = held_at(&admin, id).await {
                report_held(&shared, id, epoch, history, &held);
            }
        });
    }

    /// Before failing `workers`: report every checkpoint their requests' holders hold now, so
    /// the plan loads what is there. Holders that do not answer are returned (gone too).
    async fn report_checkpoints(&self, workers: &[WorkerId], this: &Run) -> Vec<WorkerId> {
        let mut runs: Vec<(RequestId, Active)> = self
            .active
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(_, a)| workers.contains(&a.serving))
            .map(|(id, a)| (*id, *a))
            .collect();
        runs.retain(|(id, _)| *id != this.id);
        runs.push((
            this.id,
            Active {
                serving: this.serving,
                holder: this.holder,
                epoch: this.epoch,
                generated: this.generated.len() as u32,
            },
        ));
        let mut gone = Vec::new();
        let mut tasks = tokio::task::JoinSet::new();
        for (id, a) in runs {
            let Some(h) = a.holder else { continue };
            let Some(admin) = self.shared.node_admin(u64::from(h)) else {
                gone.push(h);
                continue;
            };
            let prompt = if id == this.id { this.prompt.len() } else { 0 };
            tasks.spawn(async move { (id, a, h, prompt, held_at(&admin, id).await) });
        }
        while let Some(Ok((id, a, h, prompt, held))) = tasks.join_next().await {
            match held {
                Ok(Some(held)) => {
                    let history = if prompt > 0 {
                        prompt + a.generated as usize
                    } else {
                        usize::MAX
                    };
                    report_held(&self.shared, id, a.epoch, history, &held);
                    self.count(|s| {
                        s.checkpoint_bytes += held.bytes;
                        s.checkpoint_tokens += held.committed_tokens;
                    });
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(request = id, holder = h, error = %e, "front: the holder does not answer; treated as gone");
                    self.count(|s| s.holder_calls_failed += 1);
                    gone.push(h);
                }
            }
        }
        gone.sort_unstable();
        gone.dedup();
        gone
    }

    /// The stream broke: fail the worker (if its engine is gone) and follow the plan.
    async fn recover(&self, run: &mut Run, reason: String) -> std::result::Result<(), String> {
        let at = Instant::now();
        if at >= run.deadline {
            return Err(format!(
                "the stream broke ({reason}) past the request's deadline"
            ));
        }
        if let Some(d) = self.shared.take_plan(run.id) {
            return self.follow(run, d, at, reason);
        }
        let ep = &self.engines[&run.serving];
        if engine_alive(ep).await {
            return Err(format!(
                "the stream from worker {} broke ({reason}) but its engine still answers: not a worker failure, so no recovery",
                run.serving
            ));
        }
        let mut failed = vec![run.serving];
        failed.extend(self.report_checkpoints(&[run.serving], run).await);
        failed.sort_unstable();
        failed.dedup();
        tracing::warn!(request = run.id, workers = ?failed, %reason, "front: the stream broke; failing the worker");
        match self.shared.fail(&failed) {
            Ok(plan) => self.count(|s| s.workers_failed += plan.failed_workers.len() as u64),
            Err(e) => return Err(format!("the controller refused the failure: {e}")),
        }
        let d = self.shared.take_plan(run.id).ok_or_else(|| {
            format!(
                "worker {} failed, but no plan names request {}",
                run.serving, run.id
            )
        })?;
        self.follow(run, d, at, reason)
    }

    /// Carry out a plan for this run.
    fn follow(
        &self,
        run: &mut Run,
        d: Decision,
        at: Instant,
        reason: String,
    ) -> std::result::Result<(), String> {
        match d {
            Decision::Restore(p) => {
                if Instant::now() >= run.deadline {
                    return Err("the request's deadline passed during recovery".into());
                }
                let from = run.serving;
                run.restore = p.kv_source.map(|h| RestoreFrom {
                    holder: h,
                    epoch: run.epoch,
                    local: h == p.target,
                });
                run.epoch = p.epoch;
                run.serving = p.target;
                run.holder = p.new_holder;
                run.pending = Some(Pending {
                    at,
                    record: RecoveryRecord {
                        request: run.id,
                        epoch: p.epoch,
                        from,
                        to: p.target,
                        kv_source: p.kv_source,
                        load_tokens: p.load_tokens,
                        recompute_tokens: p.prefill_tokens,
                        committed_tokens: run.generated.len() as u32,
                        recovery_ms: 0,
                        reason,
                    },
                });
                tracing::info!(request = run.id, epoch = p.epoch, to = p.target, kv_source = ?p.kv_source, load_tokens = p.load_tokens, "front: resubmitting to the survivor");
                Ok(())
            }
            Decision::RequestFailed { reason: why, .. } => {
                Err(format!("recovery is impossible: {why}"))
            }
            other => Err(format!(
                "an unexpected decision for this request: {other:?}"
            )),
        }
    }

    /// The request is over: report and end its checkpoints (the holder's, and a restore
    /// source not ended yet).
    async fn end_checkpoints(&self, run: &Run) {
        let mut ends = Vec::new();
        if let Some(h) = run.holder {
            ends.push((h, run.epoch, true));
        }
        if let Some(r) = run.restore {
            ends.push((r.holder, r.epoch, false));
        }
        for (h, epoch, measure) in ends {
            let Some(admin) = self.shared.node_admin(u64::from(h)) else {
                continue;
            };
            if measure {
                if let Ok(Some(held)) = held_at(&admin, run.id).await {
                    if held.epoch == epoch {
                        self.count(|s| {
                            s.checkpoint_bytes += held.bytes;
                            s.checkpoint_tokens += held.committed_tokens;
                        });
                    }
                }
            }
            if let Err(e) = end_at(&admin, run.id, epoch).await {
                tracing::debug!(request = run.id, holder = h, error = %e, "front: ending the checkpoint");
            }
        }
    }

    async fn health_watch(self: Arc<Self>) {
        let mut misses: BTreeMap<WorkerId, u32> = BTreeMap::new();
        let mut tick = tokio::time::interval(HEALTH_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            for (&w, ep) in &self.engines {
                let Some(phase) = self.shared.load().get(w).map(|l| l.phase) else {
                    continue;
                };
                let ok = engine_alive(ep).await;
                let m = misses.entry(w).or_insert(0);
                *m = if ok { 0 } else { *m + 1 };
                match phase {
                    WorkerPhase::FullService if *m >= HEALTH_MISSES => {
                        tracing::warn!(worker = w, engine = %ep, "front: the engine stopped answering; failing the worker");
                        let failed = self.report_checkpoints_for(w).await;
                        if let Ok(plan) = self.shared.fail(&failed) {
                            self.count(|s| s.workers_failed += plan.failed_workers.len() as u64);
                        }
                    }
                    WorkerPhase::Failed if ok && self.shared.node_admin(u64::from(w)).is_some() => {
                        self.apply(Event::WorkerRecovered { worker: w });
                        self.promote(w);
                        self.count(|s| s.workers_recovered += 1);
                        tracing::info!(
                            worker = w,
                            "front: the engine answers again; the worker is back"
                        );
                    }
                    WorkerPhase::LoadingDraft | WorkerPhase::Assist | WorkerPhase::HotSwap
                        if ok =>
                    {
                        self.promote(w)
                    }
                    _ => {}
                }
            }
        }
    }

    /// Report the checkpoints of `w`'s requests before failing it; `w` and holders gone.
    async fn report_checkpoints_for(&self, w: WorkerId) -> Vec<WorkerId> {
        let runs: Vec<(RequestId, Active)> = self
            .active
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(_, a)| a.serving == w)
            .map(|(id, a)| (*id, *a))
            .collect();
        let mut out = vec![w];
        for (id, a) in runs {
            let Some(h) = a.holder else { continue };
            match self.shared.node_admin(u64::from(h)) {
                Some(admin) => match held_at(&admin, id).await {
                    Ok(Some(held)) => report_held(&self.shared, id, a.epoch, usize::MAX, &held),
                    Ok(None) => {}
                    Err(_) => out.push(h),
                },
                None => out.push(h),
            }
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    /// A recovering worker whose engine answers is whole: every recovery phase is done.
    fn promote(&self, w: WorkerId) {
        for phase in [
            WorkerPhase::LoadingDraft,
            WorkerPhase::Assist,
            WorkerPhase::HotSwap,
        ] {
            if self.shared.load().get(w).map(|l| l.phase) == Some(phase) {
                self.apply(Event::WorkerPhaseDone { worker: w, phase });
            }
        }
    }

    fn log_of(&self, id: RequestId) -> Option<Arc<StreamLog>> {
        self.streams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .cloned()
    }
}

/// Token ids in a JSON value: a list of integers (or a list holding one such list).
fn token_ids(v: &Value) -> Option<Vec<u32>> {
    let a = v.as_array()?;
    if let [inner @ Value::Array(_)] = a.as_slice() {
        return token_ids(inner);
    }
    a.iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect()
}

async fn changed(rx: &mut tokio::sync::watch::Receiver<u64>) {
    if rx.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

async fn sleep_opt(d: Option<Duration>) {
    match d {
        Some(d) => tokio::time::sleep(d).await,
        None => std::future::pending::<()>().await,
    }
}

async fn engine_alive(ep: &Endpoint) -> bool {
    matches!(upstream::call(ep, Method::GET, "/health", None, PROBE_TIMEOUT).await, Ok((s, _)) if s.is_success())
}

fn admin_endpoint(admin: &str) -> Result<Endpoint> {
    admin.parse()
}

/// What a node holds for `id` (`None`: nothing).
async fn held_at(admin: &str, id: RequestId) -> Result<Option<Held>> {
    let ep = admin_endpoint(admin)?;
    let (status, body) = upstream::call(
        &ep,
        Method::GET,
        &format!("/checkpoints/{id}"),
        None,
        PROBE_TIMEOUT,
    )
    .await?;
    match status {
        StatusCode::NOT_FOUND => Ok(None),
        s if s.is_success() => serde_json::from_slice(&body)
            .map(Some)
            .map_err(|e| Error::Protocol(format!("{ep}/checkpoints/{id}: {e}"))),
        s => Err(Error::Unavailable(format!("{ep}/checkpoints/{id}: {s}"))),
    }
}

/// End `id`'s checkpoint of `epoch` on a node.
async fn end_at(admin: &str, id: RequestId, epoch: Epoch) -> Result<()> {
    let ep = admin_endpoint(admin)?;
    let (status, body) = upstream::call(
        &ep,
        Method::DELETE,
        &format!("/checkpoints/{id}?epoch={epoch}"),
        None,
        PROBE_TIMEOUT,
    )
    .await?;
    if status.is_success() || status == StatusCode::NOT_FOUND {
        Ok(())
    } else {
        Err(Error::Unavailable(format!(
            "{ep}: {status}: {}",
            String::from_utf8_lossy(&body)
        )))
    }
}

fn report_held(shared: &Shared, id: RequestId, epoch: Epoch, history: usize, held: &Held) {
    if held.epoch != epoch {
        return;
    }
    let tokens = held
        .committed_tokens
        .min(history as u64)
        .min(u64::from(u32::MAX)) as u32;
    if let Err(e) = shared.apply(&Event::CheckpointStored {
        request_id: id,
        epoch,
        tokens,
        bytes: held.bytes,
    }) {
        tracing::debug!(request = id, error = %e, "front: checkpoint report refused");
    }
}

/// An SSE answer that reads `log` from `from` on, holding `guard` while the client reads.
fn sse(id: RequestId, log: Arc<StreamLog>, from: u64, guard: ClientGuard) -> Response {
    struct Sub {
        log: Arc<StreamLog>,
        next: u64,
        rx: tokio::sync::watch::Receiver<u64>,
        _guard: ClientGuard,
        ended: bool,
    }
    let rx = log.subscribe();
    let sub = Sub {
        log,
        next: from,
        rx,
        _guard: guard,
        ended: false,
    };
    let body = futures_util::stream::unfold(sub, |mut s| async move {
        if s.ended {
            return None;
        }
        loop {
            s.rx.borrow_and_update();
            match s.log.read(s.next) {
                Read::Gone(first) => {
                    s.ended = true;
                    let data = json!({"error": {"message": format!("events before {first} are no longer kept; the stream cannot resume from {}", s.next), "type": "kvd_resume_gone"}});
                    let out = format!("data: {data}\n\n");
                    return Some((Ok::<Bytes, std::convert::Infallible>(Bytes::from(out)), s));
                }
                Read::Frames(frames, _) if !frames.is_empty() => {
                    s.next += frames.len() as u64;
                    let mut out = String::with_capacity(frames.iter().map(|f| f.len()).sum());
                    for f in &frames {
                        out.push_str(f);
                    }
                    return Some((Ok(Bytes::from(out)), s));
                }
                Read::Frames(_, true) => return None,
                Read::Frames(_, false) => {
                    if tokio::time::timeout(KEEPALIVE, changed(&mut s.rx))
                        .await
                        .is_err()
                    {
                        return Some((Ok(Bytes::from_static(b": keep-alive\n\n")), s));
                    }
                }
            }
        }
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .header("x-kvd-request-id", id.to_string())
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

fn resume_from(f: &Arc<Front>, id: RequestId, from: u64) -> Response {
    let Some(log) = f.log_of(id) else {
        return error_json(
            StatusCode::NOT_FOUND,
            "kvd_front",
            &format!("no stream {id} (finished streams are kept for --retain-ms)"),
        );
    };
    f.count(|s| s.clients_resumed += 1);
    let guard = log.client();
    sse(id, log, from, guard)
}

fn last_event_id(headers: &HeaderMap) -> Option<&str> {
    headers.get("last-event-id").and_then(|v| v.to_str().ok())
}

async fn completions(State(f): State<Arc<Front>>, headers: HeaderMap, body: Bytes) -> Response {
    if let Some(v) = last_event_id(&headers) {
        return match parse_event_id(v) {
            Some((id, seq)) => resume_from(&f, id, seq + 1),
            None => error_json(
                StatusCode::BAD_REQUEST,
                "kvd_front",
                &format!("Last-Event-ID {v:?}: expected REQUEST-SEQ as this front sends"),
            ),
        };
    }
    let body: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return error_json(
                StatusCode::BAD_REQUEST,
                "kvd_front",
                &format!("the body is not JSON: {e}"),
            );
        }
    };
    match f.admit(body).await {
        Ok((id, log, guard)) => sse(id, log, 0, guard),
        Err(e) => {
            f.count(|s| s.streams_refused += 1);
            refusal(&e)
        }
    }
}

async fn resume(
    State(f): State<Arc<Front>>,
    Path(id): Path<RequestId>,
    headers: HeaderMap,
) -> Response {
    let from = match last_event_id(&headers) {
        None => 0,
        Some(v) => match parse_event_id(v) {
            Some((rid, seq)) if rid == id => seq + 1,
            _ => {
                return error_json(
                    StatusCode::BAD_REQUEST,
                    "kvd_front",
                    &format!("Last-Event-ID {v:?} is not an event of stream {id}"),
                );
            }
        },
    };
    resume_from(&f, id, from)
}

/// `GET /status`: the controller's counters, the front's, its running streams and its last
/// recoveries.
async fn status(State(f): State<Arc<Front>>) -> Response {
    let active: BTreeMap<String, Active> = f
        .active
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .map(|(id, a)| (id.to_string(), *a))
        .collect();
    let recoveries: Vec<RecoveryRecord> = f
        .recoveries
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .cloned()
        .collect();
    axum::Json(json!({
        "controller": f.shared.stats(),
        "front": f.stats(),
        "streams": f.streams.lock().unwrap_or_else(|p| p.into_inner()).len(),
        "active": active,
        "recoveries": recoveries,
    }))
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engines_parse_as_id_equals_url_once_each() {
        let e = parse_engines(&[
            "1=http://127.0.0.1:8001".into(),
            " 2 = 127.0.0.1:8002".into(),
        ])
        .unwrap();
        assert_eq!(e[&1].authority, "127.0.0.1:8001");
        assert_eq!(e[&2].authority, "127.0.0.1:8002");
        assert!(parse_engines(&["1=http://a:1".into(), "1=http://b:2".into()]).is_err());
        assert!(parse_engines(&["x=http://a:1".into()]).is_err());
        assert!(parse_engines(&["http://a:1".into()]).is_err());
    }

    #[test]
    fn event_ids_name_the_request_and_the_sequence_number() {
        assert_eq!(parse_event_id("77-12"), Some((77, 12)));
        assert_eq!(parse_event_id(" 77-0 "), Some((77, 0)));
        assert_eq!(parse_event_id("77"), None);
        assert_eq!(parse_event_id("a-1"), None);
        assert_eq!(frame(5, 3, "x"), "id: 5-3\ndata: x\n\n");
    }

    #[test]
    fn token_ids_come_as_a_list_or_a_list_of_one_list() {
        assert_eq!(token_ids(&json!([1, 2, 3])), Some(vec![1, 2, 3]));
        assert_eq!(token_ids(&json!([[4, 5]])), Some(vec![4, 5]));
        assert_eq!(token_ids(&json!(["a"])), None);
        assert_eq!(token_ids(&json!([-1])), None);
        assert_eq!(token_ids(&json!("x")), None);
    }

    #[test]
    fn request_ids_stay_exact_in_json_numbers() {
        for _ in 0..100 {
            let id = new_request_id();
            assert!(id > 0 && id < 1 << 53);
        }
    }
}
