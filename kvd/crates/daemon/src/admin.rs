//! The admin HTTP endpoint (loopback by default).
//!
//! | Method | Path       | Answer                                                              |
//! |--------|------------|---------------------------------------------------------------------|
//! | GET    | `/healthz` | `200 ok` while the process serves (liveness)                        |
//! | GET    | `/readyz`  | `200 ready`, or `503 draining` from the moment a drain begins       |
//! | GET    | `/metrics` | Prometheus text (see [`super::metrics`])                            |
//! | GET    | `/status`  | JSON [`StatusReport`], with the [`LimitsReport`] in force           |
//! | POST   | `/drain`   | `202` and a drain begins; `403` from a non-loopback peer by default |
//! | GET    | `/checkpoints/{request}` | JSON [`CheckpointReport`]: the manifest this node holds   |
//! | DELETE | `/checkpoints/{request}?epoch=E` | `204`: the manifest of epoch `E` ends (its blocks  |
//! |        |            | and reservation are released); `409` for another epoch            |
//! | GET    | `/holds/{request}` | JSON [`HoldReport`]: the hand-off hold this node keeps       |
//! | DELETE | `/holds/{request}?epoch=E` | `204`: the hold ends if its epoch is at most `E`     |
//! |        |            | (nothing there is no error: the decode may have taken it)          |
//! | GET    | `/events?since=S&max=M` | JSON [`EventsReport`]: the block event log from `S` (at  |
//! |        |            | most `M`, at most the batch bound), for cache-aware routers        |
//!
//! At the cap the probes get the `503` too; a liveness probe that must answer under any
//! admin flood points at the probe listener instead (`--probe-listen`, [`super::probes`]).
//!
//! `/drain`, `DELETE /checkpoints/…` and `DELETE /holds/…` are the endpoints that change state. Even when the admin
//! address is opened to other hosts (`--allow-remote-admin`), they answer only loopback peers
//! unless `--allow-remote-drain` is also given (the trust model, docs/DAEMON.md). The
//! checkpoint endpoints are how `kvd control`'s streaming front learns what a holder really
//! holds before it plans a restore, and ends a checkpoint when its request is over; the hold
//! endpoints are how it ends a prefill's hand-off hold at the decode's first token, on a
//! refusal or a cancel.
//!
//! # Bounds
//!
//! Admin connections share the process's file descriptors with the Unix socket, so none of them
//! may wait unboundedly or take the socket's share (invariant 5, docs/ARCHITECTURE.md). The router is
//! served by hyper's HTTP/1 connection directly, not `axum::serve`, to set them:
//!
//! ```text
//! accept ─┬─ slot free (≤ admin_max_connections) ──▶ hyper http1, keep-alive
//!         │     request head within admin_header_timeout_ms   (hyper's header_read_timeout)
//!         │     no byte moves for admin_idle_timeout_ms: drop  (the watch in `connection`)
//!         └─ at the cap ──▶ `503`, Retry-After: 1, Connection: close, in one non-blocking
//!                           write; close (after ≤ REFUSAL_LINGER_MS if a refusal fd is free)
//! ```
//!
//! - **Header timeout.** hyper starts its header timer whenever a connection waits for a
//!   request head: at the accept, and again after each answer on a kept-alive connection. So it
//!   also closes a connection that sends nothing and a kept-alive one whose next request does
//!   not come; there is no separate keep-alive timer to set. It sends no answer, it closes.
//! - **Idle timeout.** The one wait the header timer leaves open is an answer the client stops
//!   reading: the write blocks on a full socket, forever. A connection on which no byte moves
//!   either way for `admin_idle_timeout_ms` is dropped, whatever it waits for. (Request bodies
//!   are not a wait: no handler reads one, and hyper stops reading a body nobody wants.) hyper
//!   has no such timer, so the connection's socket is wrapped in `Metered`, which notes when
//!   a byte last moved.
//! - **Connection cap.** A semaphore around accept, one permit held by each connection for its
//!   whole life. A connection over the cap is not left to wait: it is answered at once with a
//!   minimal `503` in one non-blocking write (a fresh socket's send buffer is empty, so the
//!   write cannot block) and closed, so a liveness probe at the cap gets an answer, never a
//!   hang. To keep a late request from turning that close into a reset under the answer, the
//!   refused connection lingers half-closed for at most [`REFUSAL_LINGER_MS`] when one of
//!   [`super::limits::ADMIN_REFUSAL_FDS`] is free, and is closed at once otherwise.
//! - **File descriptors.** The cap is sized at start from the open-file limit, after the Unix
//!   socket's share ([`super::limits`]): admin traffic can hold at most `admin_max_connections
//!   + ADMIN_REFUSAL_FDS` descriptors, so it can never take the ones engines need.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::extract::{ConnectInfo, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use prometheus_client::metrics::gauge::Gauge;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::store::{SessionSummary, StoreStats};

use super::context::Daemon;
use super::limits::FdBudget;

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
    /// The bounds in force (absent from the reports of older daemons).
    #[serde(default)]
    pub limits: LimitsReport,
    /// The data port, when on (absent from the reports of older daemons).
    #[serde(default)]
    pub data_port: Option<super::data_port::DataPortReport>,
    /// Cluster membership (absent from the reports of older daemons).
    #[serde(default)]
    pub cluster: Option<kvd_cluster::ClusterReport>,
    /// Engine instances (tensor/pipeline-parallel rank groups), failed ones with why (at most
    /// [`STATUS_MAX_SESSIONS`]).
    #[serde(default)]
    pub instances: Vec<crate::store::instances::InstanceReport>,
    /// Prefill hand-off runs held here for their decodes, in all (absent from the reports of
    /// older daemons).
    #[serde(default)]
    pub holds: crate::store::HoldsSummary,
}

/// The bounds in force, as `/status` reports them: the file-descriptor budget and what it
/// was spent on ([`super::limits`]), and the timeouts of both listeners.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct LimitsReport {
    /// The open-file limit in force (raised to the hard limit at start).
    pub nofile_soft: u64,
    /// The hard open-file limit.
    pub nofile_hard: u64,
    /// Descriptors kept for the Unix socket's connections (sessions + pending).
    pub data_socket_fds_reserved: u64,
    /// Descriptors kept back for everything that is not a connection.
    pub other_fds_reserved: u64,
    /// Sessions at most.
    pub max_sessions: u32,
    /// Unix-socket connections in their handshake at most, beyond the sessions.
    pub max_pending_connections: u32,
    /// How long a Unix-socket handshake may take, ms.
    pub handshake_timeout_ms: u64,
    /// Per-process and per-uid shares of the Unix socket's sessions and handshakes.
    pub peers: Option<super::clients::ClientLimits>,
    /// Admin HTTP connections held at most (the configured cap, or less if the limit is
    /// short).
    pub admin_max_connections: u32,
    /// The admin cap as configured.
    pub admin_max_connections_configured: u32,
    /// Refused admin connections open at most while their `503` lingers.
    pub admin_refusal_fds: u32,
    /// How long an admin request head may take to arrive, ms.
    pub admin_header_timeout_ms: u64,
    /// How long an admin connection may move no byte, ms.
    pub admin_idle_timeout_ms: u64,
    /// Admin HTTP connections holding a slot now.
    pub admin_connections_open: u64,
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
    /// Admin HTTP connections given a slot.
    #[serde(default)]
    pub admin_connections_accepted: u64,
    /// Admin HTTP connections refused at the cap (answered `503`).
    #[serde(default)]
    pub admin_connections_refused: u64,
    /// Admin HTTP connections closed by the header timeout.
    #[serde(default)]
    pub admin_header_timeouts: u64,
    /// Admin HTTP connections closed by the idle timeout.
    #[serde(default)]
    pub admin_idle_timeouts: u64,
}

/// What the admin handlers share: the daemon and the file-descriptor budget it started with.
#[derive(Debug)]
pub struct Admin {
    /// The daemon.
    pub d: Arc<Daemon>,
    /// The budget in force.
    pub budget: FdBudget,
}

/// The router.
pub fn router(a: Arc<Admin>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/status", get(status))
        .route("/drain", post(drain))
        .route(
            "/checkpoints/{request}",
            get(checkpoint).delete(end_checkpoint),
        )
        .route("/holds/{request}", get(hold).delete(end_hold))
        .route("/events", get(events))
        .with_state(a)
}

/// The whole answer to a connection over the cap.
pub const REFUSAL: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\n\
content-type: text/plain; charset=utf-8\r\n\
retry-after: 1\r\n\
connection: close\r\n\
content-length: 47\r\n\
\r\n\
admin connections at their bound; retry in 1 s\n";

/// How long a refused connection may stay open half-closed after its `503`, ms.
pub const REFUSAL_LINGER_MS: u64 = 250;

/// Bytes a refused connection's request is read of, at most, before it is closed.
const REFUSAL_READ_BYTES: usize = 4096;

/// The largest read buffer of one admin connection, bytes: a request head is far smaller
/// (hyper answers `431` past it), and 64 connections of it stay well under a MiB.
const ADMIN_MAX_BUF_BYTES: usize = 16 * 1024;

/// Back-off after a failed accept (for example `EMFILE`), so the loop does not spin.
const ACCEPT_RETRY_MS: u64 = 50;

/// Serve the router on `listener`, within `budget`, until the process ends.
pub async fn serve(d: Arc<Daemon>, listener: TcpListener, budget: FdBudget) {
    let header_timeout = Duration::from_millis(d.config.settings.admin_header_timeout_ms);
    let idle_timeout = Duration::from_millis(d.config.settings.admin_idle_timeout_ms);
    let admin = Arc::new(Admin {
        d: d.clone(),
        budget,
    });
    let mut make = router(admin).into_make_service_with_connect_info::<SocketAddr>();
    let slots = Arc::new(Semaphore::new(budget.admin_max_connections as usize));
    let lingering = Arc::new(Semaphore::new(budget.admin_refusal_fds as usize));
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .keep_alive(true)
        .max_buf_size(ADMIN_MAX_BUF_BYTES);
    let http = Arc::new(http);
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "admin accept failed");
                tokio::time::sleep(Duration::from_millis(ACCEPT_RETRY_MS)).await;
                continue;
            }
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            d.metrics.admin_connections_refused.inc();
            refuse(stream, &lingering);
            continue;
        };
        d.metrics.admin_connections_accepted.inc();
        let slot = Slot::new(permit, &d.metrics.admin_connections_open);
        // The make-service is always ready (axum's `poll_ready` is `Ready(Ok)`), and it cannot
        // fail: it only attaches the peer's address for `ConnectInfo`.
        let svc = match tower::Service::call(&mut make, peer).await {
            Ok(svc) => svc,
            Err(never) => match never {},
        };
        tokio::spawn(connection(
            d.clone(),
            http.clone(),
            stream,
            TowerToHyperService::new(svc),
            slot,
            (header_timeout, idle_timeout),
        ));
    }
}

/// One admin connection's permit; the open-connections gauge counts the live ones.
#[derive(Debug)]
struct Slot {
    _permit: OwnedSemaphorePermit,
    open: Gauge,
}

impl Slot {
    fn new(permit: OwnedSemaphorePermit, open: &Gauge) -> Slot {
        open.inc();
        Slot {
            _permit: permit,
            open: open.clone(),
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.open.dec();
    }
}

/// Why an admin connection ended.
#[derive(Debug, PartialEq, Eq)]
enum Ended {
    /// The client closed it, or hyper did after an answer (`Connection: close`).
    Done,
    /// hyper's header timer: no whole request head in time.
    HeaderTimeout,
    /// No byte moved for the idle timeout.
    Idle,
    /// Something else went wrong (a reset, a malformed request).
    Failed(String),
}

/// Serve one connection until it ends, or drop it when it has moved no byte for `idle`.
async fn connection<S>(
    d: Arc<Daemon>,
    http: Arc<http1::Builder>,
    stream: TcpStream,
    svc: TowerToHyperService<S>,
    _slot: Slot,
    (header_timeout, idle): (Duration, Duration),
) where
    S: tower::Service<
            axum::http::Request<hyper::body::Incoming>,
            Response = Response,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    let _ = stream.set_nodelay(true);
    let io = Metered::new(stream);
    let traffic = io.traffic.clone();
    let conn = http.serve_connection(TokioIo::new(io), svc);
    tokio::pin!(conn);
    let ended = loop {
        tokio::select! {
            r = conn.as_mut() => break match r {
                // A silent connection's header timeout ends it as quietly as a client's close
                // (hyper treats a timeout before any byte of a head like an end of input): tell
                // them apart by who closed, and by the silence that only the timer waits out.
                Ok(()) if !traffic.peer_closed() && traffic.quiet_for() >= header_timeout => {
                    Ended::HeaderTimeout
                }
                Ok(()) => Ended::Done,
                Err(e) if e.is_timeout() => Ended::HeaderTimeout,
                Err(e) => Ended::Failed(e.to_string()),
            },
            _ = tokio::time::sleep_until(traffic.last_moved() + idle) => {
                if traffic.quiet_for() >= idle {
                    break Ended::Idle;
                }
            }
        }
    };
    match &ended {
        Ended::HeaderTimeout => {
            d.metrics.admin_header_timeouts.inc();
        }
        Ended::Idle => {
            d.metrics.admin_idle_timeouts.inc();
        }
        Ended::Done => {}
        Ended::Failed(e) => tracing::debug!(error = %e, "admin connection failed"),
    }
    // Returning drops the connection (closing the socket), then `_slot` (a parameter, so it
    // outlives the locals): the permit is released only once the descriptor is closed.
}

/// Answer a connection over the cap and close it, without waiting for anything.
///
/// The read and the write are plain non-blocking system calls on the socket, not tokio's
/// `try_read`/`try_write`: those answer `WouldBlock` without trying until the reactor has seen
/// the socket's first readiness event, which a connection accepted a moment ago may not have had.
fn refuse(stream: TcpStream, lingering: &Arc<Semaphore>) {
    use rustix::net::{RecvFlags, SendFlags, recv, send};
    // Read off what the client already sent: a close with unread bytes would be a reset,
    // which can destroy the answer before the client reads it.
    let mut sink = [0u8; REFUSAL_READ_BYTES];
    let _ = recv(&stream, &mut sink[..], RecvFlags::DONTWAIT);
    // One non-blocking write: a fresh connection's send buffer is empty and the answer is far
    // smaller than it, so this never waits and never comes out short in practice (if it did,
    // the client would see a truncated answer and a close: still no hang).
    let _ = send(&stream, REFUSAL, SendFlags::DONTWAIT | SendFlags::NOSIGNAL);
    match lingering.clone().try_acquire_owned() {
        Ok(permit) => {
            tokio::spawn(linger(stream, permit));
        }
        Err(_) => drop(stream),
    }
}

/// Half-close a refused connection and wait (bounded) for the client to close its side, so a
/// request that arrives after the answer does not reset it.
async fn linger(mut stream: TcpStream, _permit: OwnedSemaphorePermit) {
    let _ = tokio::time::timeout(Duration::from_millis(REFUSAL_LINGER_MS), async {
        stream.shutdown().await?;
        let mut sink = [0u8; REFUSAL_READ_BYTES];
        // At most a few reads: enough for any request a probe sends.
        for _ in 0..4 {
            if stream.read(&mut sink).await? == 0 {
                break;
            }
        }
        std::io::Result::Ok(())
    })
    .await;
}

/// When bytes last moved on a connection, and whether its peer closed its side.
#[derive(Debug)]
struct Traffic {
    since: Instant,
    last_ms: AtomicU64,
    peer_closed: AtomicBool,
}

impl Traffic {
    fn moved(&self) {
        let ms = self.since.elapsed().as_millis() as u64;
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    fn last_moved(&self) -> Instant {
        self.since + Duration::from_millis(self.last_ms.load(Ordering::Relaxed))
    }

    fn quiet_for(&self) -> Duration {
        self.last_moved().elapsed()
    }

    fn peer_closed(&self) -> bool {
        self.peer_closed.load(Ordering::Relaxed)
    }
}

/// A socket that notes in [`Traffic`] every read or write that moved a byte. hyper's server
/// connection has a timer for request heads only; this is what the idle timeout watches.
#[derive(Debug)]
struct Metered {
    inner: TcpStream,
    traffic: Arc<Traffic>,
}

impl Metered {
    fn new(inner: TcpStream) -> Metered {
        Metered {
            inner,
            traffic: Arc::new(Traffic {
                since: Instant::now(),
                last_ms: AtomicU64::new(0),
                peer_closed: AtomicBool::new(false),
            }),
        }
    }
}

impl AsyncRead for Metered {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = r {
            if buf.filled().len() > before {
                this.traffic.moved();
            } else if buf.remaining() > 0 {
                this.traffic.peer_closed.store(true, Ordering::Relaxed);
            }
        }
        r
    }
}

impl AsyncWrite for Metered {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            this.traffic.moved();
        }
        r
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            this.traffic.moved();
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

async fn readyz(State(a): State<Arc<Admin>>) -> Response {
    let (code, body) = readiness(&a.d);
    let code = StatusCode::from_u16(code).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
    (code, body).into_response()
}

/// `/readyz`'s answer (status code and body), for the admin port and the probe listener.
pub fn readiness(d: &Daemon) -> (u16, String) {
    if d.drain.is_draining() {
        (503, "draining\n".into())
    } else if !d.cluster.lease_held() {
        (
            503,
            format!(
                "not ready: no registration lease ({})\n",
                d.cluster.problem()
            ),
        )
    } else {
        (200, "ready\n".into())
    }
}

async fn metrics(State(a): State<Arc<Admin>>) -> Response {
    let d = &a.d;
    let draining = d.drain.is_draining();
    let lease_held = d.cluster.lease_held();
    let text = d.metrics.render(super::metrics::Health {
        ready: !draining && lease_held,
        draining,
        drain_s: d.drain.elapsed().as_secs_f64(),
        cluster_mode: d.cluster.is_cluster_mode(),
        lease_held,
        uptime_s: d.started.elapsed().as_secs_f64(),
    });
    ([(header::CONTENT_TYPE, super::metrics::CONTENT_TYPE)], text).into_response()
}

/// Build the `/status` report of a daemon serving within `budget`.
pub fn report(d: &Daemon, budget: &FdBudget) -> StatusReport {
    let m = &d.metrics;
    let c = &d.config;
    StatusReport {
        version: env!("CARGO_PKG_VERSION").into(),
        node_generation: d.store.node_generation(),
        uptime_ms: d.started.elapsed().as_millis() as u64,
        ready: !d.drain.is_draining() && d.cluster.lease_held(),
        draining: d.drain.is_draining(),
        socket: d.config.socket.display().to_string(),
        pool_bytes: d.store.pool_bytes(),
        backing: format!("{:?}", d.store.backing()),
        stats: d.store.stats(),
        holds: d.store.holds_summary(),
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
            admin_connections_accepted: m.admin_connections_accepted.get(),
            admin_connections_refused: m.admin_connections_refused.get(),
            admin_header_timeouts: m.admin_header_timeouts.get(),
            admin_idle_timeouts: m.admin_idle_timeouts.get(),
        },
        limits: LimitsReport {
            nofile_soft: budget.nofile_soft,
            nofile_hard: budget.nofile_hard,
            data_socket_fds_reserved: budget.data_socket_fds,
            other_fds_reserved: budget.reserved_fds,
            max_sessions: c.settings.max_sessions,
            max_pending_connections: c.settings.max_pending_connections,
            handshake_timeout_ms: c.settings.handshake_timeout_ms,
            peers: Some(c.peers),
            admin_max_connections: budget.admin_max_connections,
            admin_max_connections_configured: c.settings.admin_max_connections,
            admin_refusal_fds: budget.admin_refusal_fds,
            admin_header_timeout_ms: c.settings.admin_header_timeout_ms,
            admin_idle_timeout_ms: c.settings.admin_idle_timeout_ms,
            admin_connections_open: m.admin_connections_open.get().max(0) as u64,
        },
        data_port: d
            .data_port
            .as_ref()
            .map(|dp| dp.report(d.config.settings.node_id)),
        cluster: Some(d.cluster.report()),
        instances: d.store.instances(STATUS_MAX_SESSIONS),
    }
}

async fn status(State(a): State<Arc<Admin>>) -> Json<StatusReport> {
    Json(report(&a.d, &a.budget))
}

/// The endpoints that change state answer loopback peers only, unless --allow-remote-drain:
/// `403` (and a warning) for anyone else; `what` says what is refused ("drain is accepted").
fn changes_refused(a: &Admin, peer: SocketAddr, what: &str) -> Option<Response> {
    if peer.ip().is_loopback() || a.d.config.settings.allow_remote_drain {
        return None;
    }
    tracing::warn!(%peer, "refused a state change from a remote peer: {what} from loopback only");
    let body = format!("{what} from loopback only (see --allow-remote-drain)\n");
    Some((StatusCode::FORBIDDEN, body).into_response())
}

async fn drain(
    State(a): State<Arc<Admin>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
) -> Response {
    let d = &a.d;
    if let Some(refused) = changes_refused(&a, peer, "drain is accepted") {
        return refused;
    }
    tracing::info!(%peer, "drain requested over HTTP");
    d.drain.request();
    (StatusCode::ACCEPTED, "draining\n").into_response()
}

/// What `GET /checkpoints/{request}` answers: the manifest of one request's checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointReport {
    /// The request.
    pub request: u64,
    /// The epoch that wrote it.
    pub epoch: u64,
    /// Tokens its blocks cover (whole blocks, each verified when it was written).
    pub committed_tokens: u64,
    /// Its blocks.
    pub blocks: u64,
    /// Bytes those blocks take in the pool (blocks × page size).
    pub bytes: u64,
}

fn store_error(e: &crate::Error) -> Response {
    let status = match e {
        crate::Error::NotFound(_) => StatusCode::NOT_FOUND,
        crate::Error::StaleEpoch { .. } => StatusCode::CONFLICT,
        _ => StatusCode::BAD_REQUEST,
    };
    (status, format!("{e}\n")).into_response()
}

async fn checkpoint(
    State(a): State<Arc<Admin>>,
    axum::extract::Path(request): axum::extract::Path<u64>,
) -> Response {
    match a.d.store.manifest(request) {
        Ok(m) => Json(CheckpointReport {
            request,
            epoch: m.epoch,
            committed_tokens: m.committed_tokens,
            blocks: m.tags.len() as u64,
            bytes: m.tags.len() as u64 * a.d.store.page_size(),
        })
        .into_response(),
        Err(e) => store_error(&e),
    }
}

/// The query of `DELETE /checkpoints/{request}`.
#[derive(Debug, Deserialize)]
struct EpochQuery {
    epoch: u64,
}

async fn end_checkpoint(
    State(a): State<Arc<Admin>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    axum::extract::Path(request): axum::extract::Path<u64>,
    axum::extract::Query(q): axum::extract::Query<EpochQuery>,
) -> Response {
    if let Some(refused) = changes_refused(&a, peer, "checkpoints are ended") {
        return refused;
    }
    match a.d.store.manifest_end(request, q.epoch) {
        Ok(()) => {
            tracing::info!(%peer, request, epoch = q.epoch, "checkpoint ended over HTTP");
            StatusCode::NO_CONTENT.into_response()
        }
        Err(e) => store_error(&e),
    }
}

/// What `GET /holds/{request}` answers: the hand-off hold of one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HoldReport {
    /// The request.
    pub request: u64,
    /// The epoch of the attempt that held it.
    pub epoch: u64,
    /// Its blocks.
    pub blocks: u64,
    /// Their bytes.
    pub bytes: u64,
    /// How long it has been held, ms.
    pub age_ms: u64,
    /// How long until it expires, ms.
    pub expires_in_ms: u64,
}

async fn hold(
    State(a): State<Arc<Admin>>,
    axum::extract::Path(request): axum::extract::Path<u64>,
) -> Response {
    match a.d.store.hold(request) {
        Ok(h) => Json(HoldReport {
            request,
            epoch: h.epoch,
            blocks: h.keys.len() as u64,
            bytes: h.bytes,
            age_ms: h.age_ms,
            expires_in_ms: h.expires_in_ms,
        })
        .into_response(),
        Err(e) => store_error(&e),
    }
}

async fn end_hold(
    State(a): State<Arc<Admin>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    axum::extract::Path(request): axum::extract::Path<u64>,
    axum::extract::Query(q): axum::extract::Query<EpochQuery>,
) -> Response {
    if let Some(refused) = changes_refused(&a, peer, "hand-off holds are ended") {
        return refused;
    }
    let how = crate::store::holds::HoldEnd::Ended;
    if a.d.store.hold_end(request, q.epoch, how) {
        tracing::info!(%peer, request, epoch = q.epoch, "hand-off hold ended over HTTP");
    }
    StatusCode::NO_CONTENT.into_response()
}

/// The query of `GET /events`.
#[derive(Debug, Deserialize)]
struct EventsQuery {
    /// The first sequence number wanted (0: the oldest held).
    #[serde(default)]
    since: u64,
    /// Events at most (clamped to the daemon's batch bound).
    max: Option<u32>,
}

/// `GET /events`: the node's block events (published blocks stored and removed), in order,
/// for a cache-aware router (the same log as the local protocol's `Events`).
#[derive(Debug, Serialize)]
pub struct EventsReport {
    /// The node's incarnation: sequence numbers restart at 1 when it changes.
    pub node_generation: u64,
    /// Where to read from next.
    pub next_seq: u64,
    /// Events asked for that the bounded log had dropped (the reader's picture has a hole).
    pub lost: u64,
    /// The events.
    pub events: Vec<EventEntry>,
}

/// One block event of [`EventsReport`].
#[derive(Debug, Serialize)]
pub struct EventEntry {
    /// Its sequence number.
    pub seq: u64,
    /// Stored (`true`) or removed.
    pub stored: bool,
    /// The block's tag, 64 hex digits (its namespace is left out: a router matches tags).
    pub tag: String,
}

async fn events(
    State(a): State<Arc<Admin>>,
    axum::extract::Query(q): axum::extract::Query<EventsQuery>,
) -> Response {
    let s = &a.d.store;
    let max = q.max.unwrap_or(u32::MAX).min(s.config().max_batch).max(1);
    match s.events(q.since, max) {
        Ok(b) => Json(EventsReport {
            node_generation: s.node_generation(),
            next_seq: b.next_seq,
            lost: b.lost,
            events: b
                .events
                .iter()
                .map(|e| EventEntry {
                    seq: e.seq,
                    stored: e.kind == kvd_core::types::BlockEventKind::Stored,
                    tag: e.key.tag.to_hex(),
                })
                .collect(),
        })
        .into_response(),
        Err(e) => store_error(&e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_refusal_is_a_whole_http_answer_with_a_retry_hint() {
        let text = std::str::from_utf8(REFUSAL).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 503 "), "{head}");
        let header = |name: &str| {
            head.lines()
                .find_map(|l| l.strip_prefix(name))
                .map(str::trim)
                .unwrap_or_else(|| panic!("no {name} in {head}"))
        };
        assert_eq!(header("retry-after:"), "1");
        assert_eq!(header("connection:"), "close");
        assert_eq!(
            header("content-length:").parse::<usize>().unwrap(),
            body.len()
        );
    }

    #[test]
    fn an_old_status_report_without_limits_still_parses() {
        let d = DaemonCounters::default();
        let mut v = serde_json::to_value(&d).unwrap();
        let o = v.as_object_mut().unwrap();
        o.retain(|k, _| !k.starts_with("admin_"));
        let back: DaemonCounters = serde_json::from_value(v).unwrap();
        assert_eq!(back.admin_connections_refused, 0);
        let l: LimitsReport = serde_json::from_str("{}").unwrap();
        assert_eq!(l, LimitsReport::default());
    }
}
