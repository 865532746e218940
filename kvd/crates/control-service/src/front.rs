//! The streaming front's HTTP surface ([`kvd_front`] holds the front itself): `POST
//! /v1/completions` (OpenAI-compatible, streaming; with `Last-Event-ID` it resumes),
//! `GET /v1/streams/{id}` (resume) and `GET /status`. Each answer is an SSE body that reads the
//! request's log from a sequence number on, with a keep-alive comment while nothing comes.

use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kvd_front::Front;
use kvd_front::config::KEEPALIVE;
use kvd_front::log::{ClientGuard, Read, StreamLog, changed};
use kvd_front::sse::parse_event_id;
use serde_json::{Value, json};

use crate::Error;
use crate::control::RequestId;

/// The front's routes.
pub fn routes(front: Arc<Front>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/streams/{id}", get(resume))
        .route("/status", get(status))
        .layer(DefaultBodyLimit::max(crate::MAX_BODY_BYTES))
        .with_state(front)
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

/// A client reading a log.
struct Sub {
    log: Arc<StreamLog>,
    next: u64,
    rx: tokio::sync::watch::Receiver<u64>,
    _guard: ClientGuard,
    ended: bool,
}

/// The next bytes for the client: frames, an error for frames no longer kept, a keep-alive;
/// `None` at the end.
async fn next_chunk(mut s: Sub) -> Option<(Result<Bytes, std::convert::Infallible>, Sub)> {
    if s.ended {
        return None;
    }
    loop {
        s.rx.borrow_and_update();
        match s.log.read(s.next) {
            Read::Gone(first) => {
                s.ended = true;
                let data = json!({"error": {"message": format!("events before {first} are no longer kept; the stream cannot resume from {}", s.next), "type": "kvd_resume_gone"}});
                return Some((Ok(Bytes::from(format!("data: {data}\n\n"))), s));
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
}

/// An SSE answer that reads `log` from `from` on, holding `guard` while the client reads.
fn sse(id: RequestId, log: Arc<StreamLog>, from: u64, guard: ClientGuard) -> Response {
    let rx = log.subscribe();
    let sub = Sub {
        log,
        next: from,
        rx,
        _guard: guard,
        ended: false,
    };
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .header("x-kvd-request-id", id.to_string())
        .body(Body::from_stream(futures_util::stream::unfold(
            sub, next_chunk,
        )))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

fn resume_from(f: &Front, id: RequestId, from: u64) -> Response {
    match f.open(id) {
        Some((log, guard)) => sse(id, log, from, guard),
        None => error_json(
            StatusCode::NOT_FOUND,
            "kvd_front",
            &format!("no stream {id} (finished streams are kept for --retain-ms)"),
        ),
    }
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
            f.hub().count_front(|s| s.streams_refused += 1);
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
    axum::Json(f.status()).into_response()
}
