//! The streaming front's HTTP surface ([`kvd_front`] holds the front itself), OpenAI's:
//! `POST /v1/completions` and `POST /v1/chat/completions` (streaming or not; with
//! `Last-Event-ID` a stream resumes), `GET /v1/models`; vLLM's `POST /tokenize` and
//! `POST /detokenize` (an engine's answer, as it is); and kvd's: `GET /v1/streams/{id}`
//! (resume) and `GET /status`.
//!
//! - A stream is an SSE body that reads the request's log from a sequence number on; a client
//!   that reads SSE (`Accept: text/event-stream`) also gets `id:` lines and a keep-alive comment
//!   each second nothing comes, any other gets OpenAI's shape, `data:` lines only. Its head waits for the log's first event, so a
//!   request the engine refuses gets the engine's status and error, as from the engine itself.
//! - Without a stream, the handler reads the log to its end and answers once
//!   ([`kvd_front::openai::Collector`]); the request recovers as a stream does meanwhile.
//! - A request the front cannot recover exactly goes to one engine as it is: the answer is
//!   the engine's, with `x-kvd-recovery: off` and `x-kvd-recovery-reason`.
//! - Refusals are OpenAI's error body; overload and no worker in service are 503 with
//!   `Retry-After`; a body over `--max-body-bytes` is 413. None of them admits anything.

use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kvd_front::Front;
use kvd_front::config::KEEPALIVE;
use kvd_front::engine::ByteStream;
use kvd_front::front::{Admission, Resumed};
use kvd_front::log::{ClientGuard, Read, StreamLog, changed};
use kvd_front::openai::{Api, Collector, Kind, error_body, status_of};
use kvd_front::sse::{frame_data, parse_event_id};
use serde_json::{Value, json};

use crate::Error;
use crate::control::RequestId;

/// The front's routes.
pub fn routes(front: Arc<Front>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/v1/streams/{id}", get(resume))
        .route("/status", get(status))
        // the handlers read the body themselves, up to --max-body-bytes
        .layer(DefaultBodyLimit::disable())
        .with_state(front)
}

fn error_json(status: StatusCode, message: &str) -> Response {
    (status, axum::Json(error_body(status.as_u16(), message))).into_response()
}

fn refusal(e: &Error) -> Response {
    let (code, retry) = status_of(e);
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut r = error_json(status, &e.to_string());
    if let Some(s) = retry {
        r.headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from(s));
    }
    r
}

/// A client reading a log.
struct Sub {
    log: Arc<StreamLog>,
    next: u64,
    rx: tokio::sync::watch::Receiver<u64>,
    _guard: ClientGuard,
    ended: bool,
    /// The client reads SSE: `id:` lines, and a keep-alive comment each second nothing comes
    /// (otherwise neither, as OpenAI's stream has none: the `kvd` field of each event carries
    /// the id).
    ids: bool,
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
                    match f.split_once('\n') {
                        Some((first, rest)) if !s.ids && first.starts_with("id: ") => {
                            out.push_str(rest);
                        }
                        _ => out.push_str(f),
                    }
                }
                return Some((Ok(Bytes::from(out)), s));
            }
            Read::Frames(_, true) => return None,
            Read::Frames(_, false) if s.ids => {
                if tokio::time::timeout(KEEPALIVE, changed(&mut s.rx))
                    .await
                    .is_err()
                {
                    return Some((Ok(Bytes::from_static(b": keep-alive\n\n")), s));
                }
            }
            // no comments to a client that reads OpenAI's stream shape: one `data:` line per
            // event, nothing else (vLLM's benchmark client glues a comment to the next event)
            Read::Frames(_, false) => changed(&mut s.rx).await,
        }
    }
}

/// An SSE answer that reads `log` from `from` on, holding `guard` while the client reads.
fn sse(id: RequestId, log: Arc<StreamLog>, from: u64, guard: ClientGuard, ids: bool) -> Response {
    let rx = log.subscribe();
    let sub = Sub {
        log,
        next: from,
        rx,
        _guard: guard,
        ended: false,
        ids,
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

/// Whether the client reads SSE `id:` lines: it accepts `text/event-stream` (as EventSource
/// and SSE libraries say), or asks with `x-kvd-event-ids: on`. OpenAI's streams have no `id:`
/// lines, and clients that read one `data:` line per event (vLLM's benchmark) would choke on
/// them; such clients resume from the `kvd` field every event carries.
fn wants_ids(headers: &HeaderMap) -> bool {
    let has = |h: &str, v: &str| {
        headers
            .get(h)
            .and_then(|x| x.to_str().ok())
            .is_some_and(|x| x.to_ascii_lowercase().contains(v))
    };
    has("accept", "text/event-stream") || has("x-kvd-event-ids", "on")
}

/// A client resumes stream `id` from event `from` (`tokens`: what it has, from its
/// `Last-Event-ID`): here if this front serves it, taken over if its front died, relayed from
/// its front if that one lives.
async fn resume_from(
    f: &Arc<Front>,
    id: RequestId,
    from: u64,
    tokens: Option<usize>,
    ids: bool,
) -> Response {
    if let Some((log, guard)) = f.open(id) {
        return sse(id, log, from, guard, ids);
    }
    match f.take_over(id, from, tokens).await {
        Ok(Resumed::Here((id, log, guard))) => first_event(id, log, guard, ids, from).await,
        Ok(Resumed::At(addr)) => relay_from(&addr, id, from, tokens, ids).await,
        Err(e) => refusal(&e),
    }
}

/// The stream as the front that serves it answers a resume (the client came here instead).
async fn relay_from(
    addr: &str,
    id: RequestId,
    from: u64,
    tokens: Option<usize>,
    ids: bool,
) -> Response {
    let ep: kvd_front::http::Endpoint = match format!("http://{addr}").parse() {
        Ok(ep) => ep,
        Err(e) => return refusal(&e),
    };
    let mut headers = vec![(
        "x-kvd-event-ids",
        if ids { "on" } else { "off" }.to_string(),
    )];
    if from > 0 {
        let last = match tokens {
            Some(t) => format!("{id}-{}-{t}", from - 1),
            None => format!("{id}-{}", from - 1),
        };
        headers.push(("last-event-id", last));
    }
    let path = format!("/v1/streams/{id}");
    let (status, body) =
        match kvd_front::http::get_stream(&ep, &path, &headers, std::time::Duration::from_secs(10))
            .await
        {
            Ok(r) => r,
            Err(e) => return refusal(&e),
        };
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    let stream = bytes_stream(body);
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header("x-kvd-request-id", id.to_string())
        .header("x-kvd-relayed-from", addr)
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

fn last_event_id(headers: &HeaderMap) -> Option<&str> {
    headers.get("last-event-id").and_then(|v| v.to_str().ok())
}

async fn completions(State(f): State<Arc<Front>>, headers: HeaderMap, body: Body) -> Response {
    serve(f, headers, body, Kind::Completion).await
}

async fn chat_completions(State(f): State<Arc<Front>>, headers: HeaderMap, body: Body) -> Response {
    serve(f, headers, body, Kind::Chat).await
}

/// A client's request: resumed (`Last-Event-ID`), run by the front (a stream, or one answer
/// at the end), or served by one engine as it is.
async fn serve(f: Arc<Front>, headers: HeaderMap, body: Body, kind: Kind) -> Response {
    let ids = wants_ids(&headers);
    if let Some(v) = last_event_id(&headers) {
        return match parse_event_id(v) {
            Some(ev) => resume_from(&f, ev.request, ev.seq + 1, ev.tokens, ids).await,
            None => error_json(
                StatusCode::BAD_REQUEST,
                &format!("Last-Event-ID {v:?}: expected REQUEST-SEQ-TOKENS as this front sends"),
            ),
        };
    }
    let refused = |f: &Front, r: Response| {
        f.hub().count_front(|s| s.streams_refused += 1);
        r
    };
    let body = match read_body(&f, body).await {
        Ok(b) => b,
        Err(r) => return refused(&f, r),
    };
    let body: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            let msg = format!("the body is not JSON: {e}");
            return refused(&f, error_json(StatusCode::BAD_REQUEST, &msg));
        }
    };
    let stream = body.get("stream").and_then(Value::as_bool) == Some(true);
    match f.admit(body, Api { kind, stream }).await {
        Ok(Admission::Front((id, log, guard))) if stream => {
            first_event(id, log, guard, ids, 0).await
        }
        Ok(Admission::Front((id, log, guard))) => whole(&f, kind, id, log, guard).await,
        Ok(Admission::Direct {
            worker,
            body,
            reason,
        }) => direct(&f, worker, kind, body, &reason).await,
        Err(e) => refused(&f, refusal(&e)),
    }
}

/// The frames of `log` from `from` on, waiting for more while the stream runs (`None`: it
/// ended; `Err`: frames were dropped before `from`).
async fn frames_from(
    log: &StreamLog,
    from: u64,
    rx: &mut tokio::sync::watch::Receiver<u64>,
) -> Result<Option<Vec<Arc<str>>>, u64> {
    loop {
        rx.borrow_and_update();
        match log.read(from) {
            Read::Gone(first) => return Err(first),
            Read::Frames(frames, _) if !frames.is_empty() => return Ok(Some(frames)),
            Read::Frames(_, true) => return Ok(None),
            Read::Frames(_, false) => {
                let _ = tokio::time::timeout(KEEPALIVE, changed(rx)).await;
            }
        }
    }
}

/// A stream's answer once an engine took the request or the log has a first event: an
/// engine's refusal (an error event with a 4xx code first) is answered with its status, as the
/// engine itself would. (vLLM's server sends a stream's head once it accepted the request, not
/// at the first token; so does the front. In P/D the prefill going out counts as taken: a
/// decode's refusal after it comes as an error event.)
async fn first_event(
    id: RequestId,
    log: Arc<StreamLog>,
    guard: ClientGuard,
    ids: bool,
    from: u64,
) -> Response {
    let mut rx = log.subscribe();
    loop {
        rx.borrow_and_update();
        let waiting = matches!(log.read(from), Read::Frames(ref f, false) if f.is_empty());
        if !waiting || log.is_open() {
            break;
        }
        let _ = tokio::time::timeout(KEEPALIVE, changed(&mut rx)).await;
    }
    if !log.is_open()
        && let Read::Frames(frames, _) = log.read(from)
        && let Some(data) = frames.first().and_then(|fr| frame_data(fr))
        && let Ok(v) = serde_json::from_str::<Value>(data)
        && let Some(code) = v["error"]["code"].as_u64()
        && (400..500).contains(&code)
    {
        let status = StatusCode::from_u16(code as u16).unwrap_or(StatusCode::BAD_REQUEST);
        return (status, axum::Json(json!({"error": v["error"]}))).into_response();
    }
    sse(id, log, from, guard, ids)
}

/// One answer at the end: the log read to its end and collected.
async fn whole(
    f: &Front,
    kind: Kind,
    id: RequestId,
    log: Arc<StreamLog>,
    _guard: ClientGuard,
) -> Response {
    let mut rx = log.subscribe();
    let mut c = Collector::new(kind, id);
    let mut next = 0;
    loop {
        match frames_from(&log, next, &mut rx).await {
            Ok(Some(frames)) => {
                next += frames.len() as u64;
                for fr in &frames {
                    if let Some(d) = frame_data(fr) {
                        c.add(d);
                    }
                }
            }
            Ok(None) => break,
            Err(first) => {
                let msg =
                    format!("the answer's events before {first} were dropped (--max-stream-bytes)");
                return error_json(StatusCode::INTERNAL_SERVER_ERROR, &msg);
            }
        }
    }
    f.hub().count_front(|s| s.answered_whole += 1);
    let mut r = match c.answer() {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => {
            let code = e["code"]
                .as_u64()
                .and_then(|c| u16::try_from(c).ok())
                .unwrap_or(500);
            let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            (status, axum::Json(json!({ "error": e }))).into_response()
        }
    };
    if let Ok(v) = header::HeaderValue::from_str(&id.to_string()) {
        r.headers_mut().insert("x-kvd-request-id", v);
    }
    r
}

/// A body one engine serves as it is: its answer, relayed as it comes.
async fn direct(f: &Front, worker: u32, kind: Kind, body: Vec<u8>, reason: &str) -> Response {
    let reason = header::HeaderValue::from_str(reason)
        .unwrap_or(header::HeaderValue::from_static("see the front's log"));
    let headers = [
        ("x-kvd-recovery", header::HeaderValue::from_static("off")),
        ("x-kvd-recovery-reason", reason),
    ];
    match f.engines_forward(worker, kind.path(), body).await {
        Ok(fw) => as_answered(fw, headers),
        Err(e) => refusal(&e),
    }
}

/// An engine's answer relayed as it comes: its status, its `Content-Type`, these headers.
fn as_answered<const N: usize>(
    fw: kvd_front::engine::Forwarded,
    headers: [(&'static str, header::HeaderValue); N],
) -> Response {
    let status = StatusCode::from_u16(fw.status).unwrap_or(StatusCode::BAD_GATEWAY);
    let mut b = Response::builder().status(status);
    for (k, v) in headers {
        b = b.header(k, v);
    }
    if let Some(ct) = &fw.content_type {
        b = b.header(header::CONTENT_TYPE, ct.as_str());
    }
    b.body(Body::from_stream(bytes_stream(fw.body)))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// A client's body, at most `--max-body-bytes` of it (past it: 413, OpenAI's shape).
async fn read_body(f: &Front, body: Body) -> Result<Bytes, Response> {
    let limit = f.args().max_body_bytes;
    axum::body::to_bytes(body, limit).await.map_err(|e| {
        let msg = format!("the body is over --max-body-bytes ({limit}) or broke: {e}");
        error_json(StatusCode::PAYLOAD_TOO_LARGE, &msg)
    })
}

async fn tokenize(State(f): State<Arc<Front>>, body: Body) -> Response {
    engine_as_is(&f, "/tokenize", body).await
}

async fn detokenize(State(f): State<Arc<Front>>, body: Body) -> Response {
    engine_as_is(&f, "/detokenize", body).await
}

/// vLLM's `/tokenize` and `/detokenize`, answered by an engine in service as it answers them.
async fn engine_as_is(f: &Front, path: &'static str, body: Body) -> Response {
    let body = match read_body(f, body).await {
        Ok(b) => b.to_vec(),
        Err(r) => return r,
    };
    match f.engines_forward_any(path, body).await {
        Ok(fw) => as_answered(fw, []),
        Err(e) => refusal(&e),
    }
}

/// A body read as it comes, as a stream for axum.
fn bytes_stream(
    body: Box<dyn ByteStream>,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> + Send {
    futures_util::stream::unfold(body, |mut body| async move {
        match body.next().await {
            Ok(Some(bytes)) => Some((Ok(Bytes::from(bytes)), body)),
            Ok(None) => None,
            Err(e) => Some((Err(std::io::Error::other(e.to_string())), body)),
        }
    })
}

/// `GET /v1/models`: what the engines serve, as one of them says.
async fn models(State(f): State<Arc<Front>>) -> Response {
    match f.any_models().await {
        Some(m) => axum::Json(m.list).into_response(),
        None => refusal(&Error::Unavailable(
            "no engine in service says what it serves (GET /v1/models)".into(),
        )),
    }
}

async fn resume(
    State(f): State<Arc<Front>>,
    Path(id): Path<RequestId>,
    headers: HeaderMap,
) -> Response {
    let (from, tokens) = match last_event_id(&headers) {
        None => (0, Some(0)),
        Some(v) => match parse_event_id(v) {
            Some(ev) if ev.request == id => (ev.seq + 1, ev.tokens),
            _ => {
                return error_json(
                    StatusCode::BAD_REQUEST,
                    &format!("Last-Event-ID {v:?} is not an event of stream {id}"),
                );
            }
        },
    };
    resume_from(&f, id, from, tokens, wants_ids(&headers)).await
}

/// `GET /status`: the controller's counters, the front's, its running streams and its last
/// recoveries.
async fn status(State(f): State<Arc<Front>>) -> Response {
    axum::Json(f.status()).into_response()
}
