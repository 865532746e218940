//! The admin HTTP endpoint (loopback by default).
//!
//! | Method | Path       | Answer                                                              |
//! |--------|------------|---------------------------------------------------------------------|
//! | GET    | `/healthz` | `200 ok` while the process serves (liveness)                        |
//! | GET    | `/readyz`  | `200 ready`, or `503 draining` from the moment a drain begins       |
//! | GET    | `/metrics` | Prometheus text (see [`super::metrics`])                            |
//! | GET    | `/status`  | JSON [`StatusReport`]                                               |
//! | POST   | `/drain`   | `202` and a drain begins; `403` from a non-loopback peer by default |
//!
//! `/drain` is the only endpoint that changes state. Even when the admin address is opened to
//! other hosts (`--allow-remote-admin`), it answers only loopback peers unless
//! `--allow-remote-drain` is also given (DESIGN §5a).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::{ConnectInfo, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};

use crate::store::{SessionSummary, StoreStats};

use super::server::Daemon;

/// Sessions listed in `/status` at most.
pub const STATUS_MAX_SESSIONS: usize = 100;

/// What `/status` answers.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StatusReport {
    /// kvd's version.
    pub version: String,
    /// This incarnation's generation.
    pub node_generation: u64,
    /// Milliseconds since start.
    pub uptime_ms: u64,
    /// Ready for new work.
    pub ready: bool,
    /// A drain has begun.
    pub draining: bool,
    /// The local protocol's socket.
    pub socket: String,
    /// Bytes in the pool.
    pub pool_bytes: u64,
    /// Huge pages or not.
    pub backing: String,
    /// The store's counts and counters.
    pub stats: StoreStats,
    /// Open sessions (at most [`STATUS_MAX_SESSIONS`]).
    pub sessions: Vec<SessionSummary>,
    /// The daemon's own counters.
    pub daemon: DaemonCounters,
}

/// The daemon's counters in `/status`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DaemonCounters {
    /// Connections accepted.
    pub connections_accepted: u64,
    /// Connections closed at accept (bound reached).
    pub connections_refused: u64,
    /// Connections with an open session now.
    pub sessions_open: u64,
    /// Handshakes refused.
    pub sessions_refused: u64,
    /// Requests answered Overloaded for the in-flight bound.
    pub inflight_rejects: u64,
    /// Malformed frames.
    pub protocol_errors: u64,
    /// Requests served, by operation.
    pub ops: Vec<(String, u64)>,
}

/// The router.
pub fn router(d: Arc<Daemon>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/status", get(status))
        .route("/drain", post(drain))
        .with_state(d)
}

/// Serve the router on `listener` until the process ends.
pub async fn serve(d: Arc<Daemon>, listener: tokio::net::TcpListener) {
    let app = router(d).into_make_service_with_connect_info::<SocketAddr>();
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!(error = %e, "admin HTTP stopped");
    }
}

async fn readyz(State(d): State<Arc<Daemon>>) -> Response {
    if d.drain.is_draining() {
        (StatusCode::SERVICE_UNAVAILABLE, "draining\n").into_response()
    } else {
        (StatusCode::OK, "ready\n").into_response()
    }
}

async fn metrics(State(d): State<Arc<Daemon>>) -> Response {
    let text = d
        .metrics
        .render(!d.drain.is_draining(), d.started.elapsed().as_secs_f64());
    ([(header::CONTENT_TYPE, super::metrics::CONTENT_TYPE)], text).into_response()
}

/// Build the `/status` report.
pub fn report(d: &Daemon) -> StatusReport {
    let m = &d.metrics;
    StatusReport {
        version: env!("CARGO_PKG_VERSION").into(),
        node_generation: d.store.node_generation(),
        uptime_ms: d.started.elapsed().as_millis() as u64,
        ready: !d.drain.is_draining(),
        draining: d.drain.is_draining(),
        socket: d.config.socket.display().to_string(),
        pool_bytes: d.store.pool_bytes(),
        backing: format!("{:?}", d.store.backing()),
        stats: d.store.stats(),
        sessions: d.store.sessions(STATUS_MAX_SESSIONS),
        daemon: DaemonCounters {
            connections_accepted: m.connections_accepted.get(),
            connections_refused: m.connections_refused.get(),
            sessions_open: m.sessions_open.get().max(0) as u64,
            sessions_refused: m.sessions_refused.get(),
            inflight_rejects: m.inflight_rejects.get(),
            protocol_errors: m.protocol_errors.get(),
            ops: m
                .op_counts()
                .into_iter()
                .map(|(n, c)| (n.to_owned(), c))
                .collect(),
        },
    }
}

async fn status(State(d): State<Arc<Daemon>>) -> Json<StatusReport> {
    Json(report(&d))
}

async fn drain(
    State(d): State<Arc<Daemon>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
) -> Response {
    if !peer.ip().is_loopback() && !d.config.allow_remote_drain {
        tracing::warn!(%peer, "refused /drain from a remote peer");
        return (
            StatusCode::FORBIDDEN,
            "drain is accepted from loopback only (see --allow-remote-drain)\n",
        )
            .into_response();
    }
    tracing::info!(%peer, "drain requested over HTTP");
    d.drain.request();
    (StatusCode::ACCEPTED, "draining\n").into_response()
}
