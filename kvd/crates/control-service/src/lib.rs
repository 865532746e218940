//! `kvd control`: the controller as an HTTP/JSON service.
//!
//! Gateways and engines report events and read decisions over plain HTTP/1.1 with JSON bodies.
//! Every event call answers with the decisions it caused, so nothing is polled. State changes
//! go through one mutex around one [`Controller`]; every critical section is a bounded,
//! in-memory computation (a recovery plan for 10,000 requests takes well under 10 ms).
//!
//! | Method | Path                 | Body → Answer                                              |
//! |--------|----------------------|------------------------------------------------------------|
//! | GET    | `/healthz`           | → `ok`                                                     |
//! | POST   | `/events`            | `{"events":[Event…]}` (≤ 1024) → `{"results":[…]}`         |
//! | POST   | `/admit`             | `AdmitRequest` → `Admission`                               |
//! | POST   | `/workers/failed`    | `{"workers":[id…]}` → `RecoveryPlan`                       |
//! | GET    | `/workers`           | → the load table                                           |
//! | GET    | `/requests/{id}`     | → the request's record                                     |
//! | GET    | `/stats`             | → counters                                                 |
//! | GET    | `/metrics`           | → the counters and load in OpenMetrics text (Prometheus)   |
//! | GET    | `/snapshot`          | → the whole state ([`crate::control::ControllerSnapshot`])          |
//!
//! With `--engine ID=URL` it also serves the streaming front ([`kvd_front`], its routes in
//! [`crate::front`]): OpenAI's `POST /v1/completions`, `POST /v1/chat/completions` (streaming or
//! not) and `GET /v1/models`; `GET /v1/streams/{id}` (resume with `Last-Event-ID`) and
//! `GET /status`. With `--etcd`, several such services are replicas of one another
//! ([`crate::replicas`]).
//!
//! Errors answer with an HTTP status and `{"code": <kvd status code>, "error": "<message>"}`;
//! inside a batch each event has its own `{"ok": …}` entry. Request bodies are capped at
//! [`MAX_BODY_BYTES`]. The service listens on loopback unless `--allow-remote` is given (the
//! admin surface changes state; see the trust model in docs/DAEMON.md).

//!
//! A service crate: the `kvd` binary wires it up as `kvd control`. It is made of the library
//! crates (the controller `kvd-control`, the streaming front `kvd-front`, cluster mode
//! `kvd-cluster`) and imports no other service.
//!
//! ```text
//!  lib.rs         the controller's HTTP/JSON API, start-up (run), the snapshot
//!  membership.rs  the nodes' registrations in etcd as worker events; the snapshot kept there
//!  replicas.rs    several `kvd control`s: registration, the elected leader, the streams' records
//!  front.rs       the streaming front's routes and SSE bodies over kvd-front
//! ```

pub mod front;
pub mod membership;
pub mod replicas;

pub(crate) use kvd_control as control;
pub(crate) use kvd_core::clock;
pub use kvd_core::{Error, Result};

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};

use crate::clock::MonotonicClock;
use crate::control::{
    AdmitRequest, ControlConfig, Controller, ControllerSnapshot, Decision, Event, PolicyKind,
    RequestId, WorkerId,
};
use kvd_front::Hub;

/// Largest request body accepted, bytes.
pub const MAX_BODY_BYTES: usize = 1 << 20;
/// Most events in one `/events` batch.
pub const MAX_EVENTS_PER_BATCH: usize = 1024;

/// `kvd control` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct ControlArgs {
    /// Address to listen on (port 0 picks a free port; the bound address is printed).
    #[arg(long, default_value = "127.0.0.1:7450")]
    pub listen: SocketAddr,
    /// Placement and recovery policy. lumen: the holder minimises q_w + λ·p_w with p_w = (what
    /// w already holds for the same serving worker + this request) / host-to-GPU bandwidth, so
    /// one worker's checkpoints spread over many holders (docs/CONTROL.md). lumen_mean: the
    /// first rule, p_w = the mean footprint w holds (herds onto the shortest queue; kept to
    /// compare). lumen_total: p_w = (everything w holds + this request) / bandwidth.
    /// fixed_ring: the next worker in id order (DejaVu). stop_restart: no checkpoints,
    /// recompute on failure. Dashes or underscores.
    #[arg(long, default_value = "lumen")]
    pub policy: String,
    /// λ, the weight of the restore delay in the placement score.
    #[arg(long, default_value_t = 1.0)]
    pub lambda: f64,
    /// The restore rate the placement score assumes, MB/s: p_w turns bytes into milliseconds
    /// with it. The default is a GPU's host-to-device copy (25 GB/s); where a restore goes
    /// through something slower (vLLM's CPU build loaded the tests' tiny model from kvd at
    /// about 450 MB/s: 1.1 MiB in 2.5 ms, docs/PERFORMANCE.md), give the measured rate, or p_w
    /// is near 0 and the queue term alone decides.
    #[arg(long, default_value_t = 25_000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    pub restore_mb_per_s: u64,
    /// The prefill rate recovery planning assumes, tokens/ms (what recomputing a request's
    /// history would cost against loading it).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub prefill_tokens_per_ms: u32,
    /// The engines' sequence cap (vLLM's `--max-num-seqs`; 0: not known). With it, Lumen's
    /// recovery hands no survivor more requests than its free batch slots while another
    /// survivor has room: a request past an engine's batch waits for a running one to finish.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    pub engine_max_seqs: u32,
    /// Migrations allowed per request.
    #[arg(long, default_value_t = 3)]
    pub migration_budget: u32,
    /// Restore the controller from this snapshot file (JSON from `GET /snapshot`) at start.
    #[arg(long)]
    pub snapshot: Option<PathBuf>,
    /// Allow listening on a non-loopback address.
    #[arg(long)]
    pub allow_remote: bool,
    /// How to reach etcd (cluster mode), as for `kvd serve`.
    #[command(flatten)]
    pub etcd: kvd_cluster::EtcdArgs,
    /// With --etcd: the lease of this replica's registration and of its lead, ms. Another
    /// replica takes over this one's streams (and the lead) once it has been gone this long.
    #[arg(long, default_value_t = 3000, value_parser = clap::value_parser!(u64).range(1000..=60_000))]
    pub replica_lease_ttl_ms: u64,
    /// The streaming front (`--engine` turns it on; `--prefill-engine` adds P/D).
    #[command(flatten)]
    pub front: kvd_front::FrontArgs,
}

/// An error as the service answers it.
#[derive(Debug)]
struct ApiError(Error);

#[derive(Debug, Serialize, Deserialize)]
struct ErrorBody {
    code: i32,
    error: String,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = match &self.0 {
            Error::NotFound(_) => StatusCode::NOT_FOUND,
            Error::StaleEpoch { .. } | Error::AlreadyExists(_) => StatusCode::CONFLICT,
            Error::NoSpace { .. } | Error::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
            Error::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Error::Deadline(_) => StatusCode::GATEWAY_TIMEOUT,
            Error::Io(_) => StatusCode::INTERNAL_SERVER_ERROR,
            _ => StatusCode::BAD_REQUEST,
        };
        (
            status,
            Json(ErrorBody {
                code: self.0.code(),
                error: self.0.to_string(),
            }),
        )
            .into_response()
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        ApiError(e)
    }
}

/// A batch of events.
#[derive(Debug, Serialize, Deserialize)]
pub struct EventBatch {
    /// The events, applied in order.
    pub events: Vec<Event>,
}

/// The outcome of one event of a batch.
#[derive(Debug, Serialize, Deserialize)]
pub struct EventResult {
    /// Whether it applied.
    pub ok: bool,
    /// The decisions it caused.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub decisions: Vec<Decision>,
    /// The kvd status code on error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<i32>,
    /// The error on error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The answer to a batch.
#[derive(Debug, Serialize, Deserialize)]
pub struct BatchResults {
    /// One entry per event, in order.
    pub results: Vec<EventResult>,
}

/// Body of `/workers/failed`.
#[derive(Debug, Serialize, Deserialize)]
pub struct FailedWorkers {
    /// The dead workers.
    pub workers: Vec<WorkerId>,
}

type Api<T> = Result<Json<T>, ApiError>;

async fn healthz() -> &'static str {
    "ok"
}

async fn events(State(s): State<Arc<Hub>>, Json(batch): Json<EventBatch>) -> Api<BatchResults> {
    if batch.events.len() > MAX_EVENTS_PER_BATCH {
        return Err(Error::InvalidArgument(format!(
            "{} events in one batch (at most {MAX_EVENTS_PER_BATCH})",
            batch.events.len()
        ))
        .into());
    }
    let results = s
        .apply_all(&batch.events)
        .into_iter()
        .map(|r| match r {
            Ok(decisions) => EventResult {
                ok: true,
                decisions,
                code: None,
                error: None,
            },
            Err(e) => EventResult {
                ok: false,
                decisions: vec![],
                code: Some(e.code()),
                error: Some(e.to_string()),
            },
        })
        .collect();
    Ok(Json(BatchResults { results }))
}

async fn admit(
    State(s): State<Arc<Hub>>,
    Json(req): Json<AdmitRequest>,
) -> Api<crate::control::Admission> {
    Ok(Json(s.admit(req)?))
}

async fn workers_failed(
    State(s): State<Arc<Hub>>,
    Json(body): Json<FailedWorkers>,
) -> Api<crate::control::RecoveryPlan> {
    Ok(Json(s.fail(&body.workers)?))
}

async fn workers(State(s): State<Arc<Hub>>) -> Api<crate::control::LoadTable> {
    Ok(Json(s.load()))
}

async fn request(
    State(s): State<Arc<Hub>>,
    Path(id): Path<RequestId>,
) -> Api<crate::control::RequestRecord> {
    let r = s
        .request(id)
        .ok_or_else(|| Error::NotFound(format!("request {id}")))?;
    Ok(Json(r))
}

async fn stats(State(s): State<Arc<Hub>>) -> Api<crate::control::Stats> {
    Ok(Json(s.stats()))
}

async fn metrics(State(s): State<Arc<Hub>>) -> Response {
    let mut m = s.with(|c| ControllerMetrics::read(c));
    if let Ok(serde_json::Value::Object(map)) = serde_json::to_value(s.front_stats()) {
        m.stats.extend(
            map.into_iter()
                .filter_map(|(k, v)| v.as_u64().map(|v| (format!("front_{k}"), v))),
        );
    }
    m.handoff_times = Some(s.handoff_times());
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register_collector(Box::new(m));
    let mut text = String::with_capacity(4096);
    prometheus_client::encoding::text::encode(&mut text, &registry)
        .expect("writing to a String cannot fail");
    (
        [(axum::http::header::CONTENT_TYPE, kvd_metrics::CONTENT_TYPE)],
        text,
    )
        .into_response()
}

/// What `/metrics` reports, read from the controller under its lock and encoded after it.
#[derive(Debug)]
struct ControllerMetrics {
    /// Every field of [`crate::control::Stats`], by name (so a new counter is exported without edits).
    stats: Vec<(String, u64)>,
    phases: Vec<(&'static str, i64)>,
    in_flight: i64,
    free_checkpoint_bytes: i64,
    reserved_checkpoint_bytes: i64,
    held_checkpoints: i64,
    /// P/D: the front's hand-off times.
    handoff_times: Option<kvd_front::stats::Buckets>,
}

impl ControllerMetrics {
    fn read(c: &Controller) -> ControllerMetrics {
        let stats = match serde_json::to_value(c.stats()) {
            Ok(serde_json::Value::Object(map)) => map
                .into_iter()
                .filter_map(|(k, v)| v.as_u64().map(|v| (k, v)))
                .collect(),
            _ => Vec::new(),
        };
        let phases = [
            ("failed", crate::control::WorkerPhase::Failed),
            ("loading_draft", crate::control::WorkerPhase::LoadingDraft),
            ("assist", crate::control::WorkerPhase::Assist),
            ("hotswap", crate::control::WorkerPhase::HotSwap),
            ("full_service", crate::control::WorkerPhase::FullService),
        ]
        .map(|(name, p)| {
            (
                name,
                c.load().iter().filter(|w| w.phase == p).count() as i64,
            )
        })
        .to_vec();
        let load = c.load();
        ControllerMetrics {
            stats,
            phases,
            in_flight: c.in_flight() as i64,
            free_checkpoint_bytes: load.in_service().map(|w| w.free_bytes() as i64).sum(),
            reserved_checkpoint_bytes: load.iter().map(|w| w.reserved_bytes as i64).sum(),
            held_checkpoints: load.iter().map(|w| i64::from(w.held_checkpoints)).sum(),
            handoff_times: None,
        }
    }
}

impl prometheus_client::collector::Collector for ControllerMetrics {
    fn encode(
        &self,
        mut e: prometheus_client::encoding::DescriptorEncoder<'_>,
    ) -> std::fmt::Result {
        use kvd_metrics::{counter, gauge};
        use prometheus_client::encoding::EncodeMetric;
        for (name, v) in &self.stats {
            let help = format!("kvd::control::Stats::{name}");
            counter(&mut e, &format!("kvd_control_{name}"), &help, *v)?;
        }
        let mut family = e.encode_descriptor(
            "kvd_control_workers",
            "Workers by phase",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (phase, n) in &self.phases {
            let labels = [("phase", *phase)];
            prometheus_client::metrics::gauge::ConstGauge::new(*n)
                .encode(family.encode_family(&labels)?)?;
        }
        gauge(
            &mut e,
            "kvd_control_in_flight_requests",
            "Requests not yet terminal",
            self.in_flight,
        )?;
        gauge(
            &mut e,
            "kvd_control_free_checkpoint_bytes",
            "Checkpoint capacity free on in-service workers",
            self.free_checkpoint_bytes,
        )?;
        gauge(
            &mut e,
            "kvd_control_reserved_checkpoint_bytes",
            "Checkpoint bytes reserved on holders",
            self.reserved_checkpoint_bytes,
        )?;
        gauge(
            &mut e,
            "kvd_control_held_checkpoints",
            "Checkpoints held across workers",
            self.held_checkpoints,
        )?;
        if let Some(h) = &self.handoff_times {
            let mut family = e.encode_descriptor(
                "kvd_control_front_handoff_seconds",
                "P/D hand-offs: the prefill's answer to the decode's first token",
                None,
                prometheus_client::metrics::MetricType::Histogram,
            )?;
            let buckets: Vec<(f64, u64)> = h
                .bounds_ms
                .iter()
                .map(|b| *b as f64 / 1000.0)
                .chain([f64::INFINITY])
                .zip(h.counts.iter().copied())
                .collect();
            family.encode_histogram::<prometheus_client::encoding::NoLabelSet>(
                h.sum_ms as f64 / 1000.0,
                h.count(),
                &buckets,
                None,
            )?;
        }
        Ok(())
    }
}

async fn snapshot(State(s): State<Arc<Hub>>) -> Api<ControllerSnapshot> {
    Ok(Json(s.snapshot()))
}

/// The service's routes over `controller` (exposed for embedding the service in another axum
/// application).
pub fn router(controller: Controller, clock_offset_ms: u64) -> Router {
    routes(hub(controller, clock_offset_ms))
}

/// The service's shared state over `controller`: the controller under its lock, the clock that
/// stamps its events, and what the streaming front keeps beside it.
pub(crate) fn hub(controller: Controller, clock_offset_ms: u64) -> Arc<Hub> {
    Hub::new(controller, Arc::new(MonotonicClock::new()), clock_offset_ms)
}

fn routes(shared: Arc<Hub>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/events", post(events))
        .route("/admit", post(admit))
        .route("/workers/failed", post(workers_failed))
        .route("/workers", get(workers))
        .route("/requests/{id}", get(request))
        .route("/stats", get(stats))
        .route("/metrics", get(metrics))
        .route("/snapshot", get(snapshot))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(shared)
}

/// The clock offset a restored controller continues from (its latest arrival).
fn snapshot_offset(snap: &ControllerSnapshot) -> u64 {
    snap.requests
        .iter()
        .chain(snap.terminal.iter())
        .map(|r| r.arrival_ms)
        .max()
        .unwrap_or(0)
}

/// Build the controller `args` describe (fresh, or from the snapshot file).
///
/// # Errors
/// Bad arguments, an unreadable or invalid snapshot.
pub fn controller_from_args(args: &ControlArgs) -> crate::Result<(Controller, u64)> {
    if !args.front.engines.is_empty() && !args.etcd.is_on() {
        return Err(Error::InvalidArgument(
            "--engine needs --etcd: the front learns the workers, their capacities and the holders' admin addresses from the nodes' registrations".into(),
        ));
    }
    kvd_front::http::parse_pools(&args.front.engines, &args.front.prefill_engines)?;
    if !args.listen.ip().is_loopback() && !args.allow_remote {
        return Err(Error::InvalidArgument(format!(
            "{} is not a loopback address; pass --allow-remote to listen there",
            args.listen
        )));
    }
    match &args.snapshot {
        Some(path) => {
            let bytes =
                std::fs::read(path).map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
            let snap: ControllerSnapshot = serde_json::from_slice(&bytes)
                .map_err(|e| Error::Protocol(format!("snapshot {}: {e}", path.display())))?;
            let offset = snapshot_offset(&snap);
            Ok((Controller::from_snapshot(snap)?, offset))
        }
        None => {
            let config = ControlConfig {
                policy: args.policy.parse::<PolicyKind>()?,
                lambda: args.lambda,
                host_to_gpu_bytes_per_ms: args.restore_mb_per_s * 1_000,
                prefill_tokens_per_ms: args.prefill_tokens_per_ms,
                engine_max_seqs: args.engine_max_seqs,
                migration_budget: args.migration_budget,
                ..ControlConfig::default()
            };
            Ok((Controller::new(config)?, 0))
        }
    }
}

/// The controller to start with, and etcd's credentials in cluster mode: without a front, the
/// last snapshot in etcd, if any, wins over a fresh controller; a front's requests live in
/// their streams' records instead (taken over one by one when a client resumes), so a
/// `kvd control` with a front starts fresh.
async fn starting_state(
    args: &ControlArgs,
    controller: Controller,
    offset: u64,
) -> Result<(Controller, u64, Option<crate::membership::Security>)> {
    if !args.etcd.is_on() {
        return Ok((controller, offset, None));
    }
    let security = Arc::new(args.etcd.security()?);
    if !args.front.engines.is_empty() {
        return Ok((controller, offset, Some(security)));
    }
    let snap =
        crate::membership::load_snapshot(&args.etcd.etcd, &args.etcd.prefix(), &security).await?;
    let Some(snap) = snap else {
        return Ok((controller, offset, Some(security)));
    };
    let snap_offset = snapshot_offset(&snap);
    match Controller::from_snapshot(snap) {
        Ok(c) => {
            println!("kvd control resumed from the snapshot in etcd");
            Ok((c, snap_offset, Some(security)))
        }
        Err(e) => {
            eprintln!("kvd control: the snapshot in etcd is unusable ({e}); starting fresh");
            Ok((controller, snap_offset, Some(security)))
        }
    }
}

/// The streaming front over `--engine`'s engines, its tasks started, its streams' records
/// kept with the replicas.
fn start_front(
    args: &ControlArgs,
    shared: &Arc<Hub>,
    replicas: Option<&Arc<crate::replicas::Replicas>>,
) -> Result<Arc<kvd_front::Front>> {
    use kvd_front::engine::Engines as _;
    let engines = Arc::new(kvd_front::http::HttpEngines::with_prefill(
        &args.front.engines,
        &args.front.prefill_engines,
        args.front.engine_timeout(),
    )?);
    // P/D's prefill nodes stay out of the controller's pool: no decode is placed or
    // recovered on them, and they hold no checkpoint
    shared.keep_outside_the_pool(engines.prefill_workers().into_iter().map(u64::from));
    let holders = Arc::new(kvd_front::http::HttpHolders::new(Arc::clone(shared)));
    let front = kvd_front::Front::new(Arc::clone(shared), args.front.clone(), engines, holders);
    front.spawn_health_watch();
    front.spawn_cache_feed();
    if let Some(r) = replicas {
        front.set_records(Arc::clone(r) as Arc<dyn kvd_front::engine::Records>);
        r.set_front(Arc::clone(&front));
    }
    println!(
        "kvd control: the front serves /v1/completions, /v1/chat/completions and /v1/models for {} engines",
        args.front.engines.len()
    );
    if args.front.pd() {
        println!(
            "kvd control: P/D: {} prefill engines prefill, the {} engines decode",
            args.front.prefill_engines.len(),
            args.front.engines.len()
        );
    }
    Ok(front)
}

/// Run `kvd control` until Ctrl-C. Prints `kvd control listening on ADDR` once bound.
pub fn run(args: ControlArgs) -> std::process::ExitCode {
    let (controller, offset) = match controller_from_args(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvd control: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvd control: runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result: std::io::Result<()> = rt.block_on(async move {
        let (controller, offset, etcd_security) =
            match starting_state(&args, controller, offset).await {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("kvd control: {e}");
                    return Err(std::io::Error::other(e.to_string()));
                }
            };
        let shared = hub(controller, offset);
        let listener = tokio::net::TcpListener::bind(args.listen).await?;
        let addr = listener.local_addr()?;
        let replicas = args.etcd.is_on().then(|| {
            crate::replicas::Replicas::start(
                args.etcd.etcd.clone(),
                args.etcd.prefix(),
                etcd_security.clone().unwrap_or_default(),
                addr.to_string(),
                args.replica_lease_ttl_ms,
                args.front.reconnect_grace_ms + args.replica_lease_ttl_ms,
            )
        });
        let mut app = routes(Arc::clone(&shared));
        if !args.front.engines.is_empty() {
            let front = match start_front(&args, &shared, replicas.as_ref()) {
                Ok(f) => f,
                Err(e) => {
                    eprintln!("kvd control: {e}");
                    return Err(std::io::Error::other(e.to_string()));
                }
            };
            app = app.merge(crate::front::routes(front));
        }
        if args.etcd.is_on() {
            tokio::spawn(crate::membership::run(
                args.etcd.etcd.clone(),
                args.etcd.prefix(),
                etcd_security.unwrap_or_default(),
                Arc::clone(&shared),
                replicas,
            ));
        }
        println!("kvd control listening on {addr}");
        use std::io::Write;
        std::io::stdout().flush()?;
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvd control: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
