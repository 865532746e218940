//! `kvd control`'s streaming front: an OpenAI-compatible `/v1/completions` (streaming) that an
//! application or gateway points at instead of one engine, and that keeps a request's stream
//! going when the worker serving it dies (docs/CONTROL.md, "The streaming front").
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

mod drive;
mod recover;
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

use crate::control::{AdmitRequest, Decision, Epoch, Event, RequestId, WorkerId};
use crate::control_service::Shared;
use crate::{Error, Result};
use drive::changed;
use stream::{ClientGuard, Read, StreamLog};
use upstream::Endpoint;

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
    /// bytes): a request's checkpoint reservation is (prompt + max_tokens), rounded up to whole
    /// blocks of --kv-tokens-per-block, × this.
    #[arg(long, default_value_t = 131072)]
    pub kv_bytes_per_token: u64,
    /// Tokens per KV block of the engines (vLLM's --block-size; its default is 16): holders
    /// store whole blocks, so a checkpoint's last, partly filled block takes a whole page.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=65_536))]
    pub kv_tokens_per_block: u64,
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
    /// Requests streaming at once; past it new requests get 429. As many finished streams
    /// are kept for clients that reconnect late (each at most --retain-ms; past that bound the
    /// oldest goes first).
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
    pub recovery_ms: u64,
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
    /// Checkpoint reports whose bytes passed the reservation (--kv-bytes-per-token too small).
    pub checkpoint_reports_clamped: u64,
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
    /// Finished streams still readable, oldest first (when each finished).
    finished: Mutex<VecDeque<(Instant, RequestId)>>,
    active: Mutex<HashMap<RequestId, Active>>,
    recoveries: Mutex<VecDeque<RecoveryRecord>>,
}

/// What the front knows of a running request (for reporting its checkpoint before a failure).
#[derive(Debug, Clone, Copy, Serialize)]
struct Active {
    serving: WorkerId,
    prompt: u32,
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
            finished: Mutex::default(),
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
        let running = self.retire_finished();
        if running >= self.args.max_streams {
            return Err(Error::Overloaded {
                what: format!("{running} requests streaming (--max-streams)"),
                retry_after_ms: 1000,
            });
        }
        let id = new_request_id();
        let reserve = if checkpoint {
            reservation_bytes(prompt.len() as u64 + u64::from(max_tokens), &self.args)
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
                    prompt: run.prompt.len() as u32,
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
    /// A stream finished: readable a while longer (see [`Front::retire_finished`]).
    fn finished(&self, id: RequestId) {
        self.finished
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back((Instant::now(), id));
        self.retire_finished();
    }

    /// Drop the finished streams past `--retain-ms` or past `--max-streams` of them (oldest
    /// first); how many requests are streaming.
    fn retire_finished(&self) -> usize {
        let retain = Duration::from_millis(self.args.retain_ms);
        let mut finished = self.finished.lock().unwrap_or_else(|p| p.into_inner());
        let mut streams = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        while let Some(&(at, id)) = finished.front() {
            if at.elapsed() < retain && finished.len() <= self.args.max_streams {
                break;
            }
            finished.pop_front();
            streams.remove(&id);
        }
        streams.len().saturating_sub(finished.len())
    }

    fn log_of(&self, id: RequestId) -> Option<Arc<StreamLog>> {
        self.retire_finished();
        self.streams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .cloned()
    }
}

/// The pool bytes a request of `tokens` tokens reserves for its checkpoint: whole blocks, since a
/// holder stores a partly filled last block in a whole page.
fn reservation_bytes(tokens: u64, args: &FrontArgs) -> u64 {
    let tpb = args.kv_tokens_per_block.max(1);
    tokens
        .div_ceil(tpb)
        .saturating_mul(tpb)
        .saturating_mul(args.kv_bytes_per_token)
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
    fn a_reservation_covers_whole_blocks() {
        let mut args = front(1, 1000).args.clone();
        args.kv_bytes_per_token = 2048;
        args.kv_tokens_per_block = 32;
        // 1,300 tokens take 41 blocks of 32: the last one, 20 tokens, in a whole 64 KiB page
        assert_eq!(reservation_bytes(1300, &args), 41 * 65_536);
        assert_eq!(reservation_bytes(1280, &args), 40 * 65_536);
        assert_eq!(reservation_bytes(1, &args), 65_536);
        args.kv_bytes_per_token = u64::MAX;
        assert_eq!(reservation_bytes(1300, &args), u64::MAX);
    }

    fn front(max_streams: usize, retain_ms: u64) -> Arc<Front> {
        let c = crate::control::Controller::new(crate::control::ControlConfig::default()).unwrap();
        let args = FrontArgs {
            engines: vec![],
            kv_bytes_per_token: 1024,
            kv_tokens_per_block: 16,
            reconnect_grace_ms: 1000,
            retain_ms,
            engine_timeout_ms: 1000,
            request_deadline_ms: 1000,
            max_streams,
            max_stream_bytes: 1 << 20,
        };
        Front::new(crate::control_service::shared(c, 0), args).unwrap()
    }

    #[test]
    fn finished_streams_stay_readable_within_their_bounds_and_do_not_count_as_running() {
        let f = front(2, 60_000);
        for id in 1..=4 {
            f.streams.lock().unwrap().insert(id, StreamLog::new(1024));
        }
        assert_eq!(f.retire_finished(), 4, "four running");
        f.finished(1);
        f.finished(2);
        assert_eq!(
            f.retire_finished(),
            2,
            "finished streams are not running ones"
        );
        assert!(f.log_of(1).is_some() && f.log_of(2).is_some());
        f.finished(3);
        assert!(
            f.log_of(1).is_none(),
            "past --max-streams finished ones, the oldest goes"
        );
        assert!(f.log_of(2).is_some() && f.log_of(3).is_some());
        assert_eq!(f.retire_finished(), 1);
        let g = front(8, 0);
        g.streams.lock().unwrap().insert(9, StreamLog::new(1024));
        g.finished(9);
        assert!(g.log_of(9).is_none(), "past --retain-ms it is gone");
    }

    #[test]
    fn request_ids_stay_exact_in_json_numbers() {
        for _ in 0..100 {
            let id = new_request_id();
            assert!(id > 0 && id < 1 << 53);
        }
    }
}
