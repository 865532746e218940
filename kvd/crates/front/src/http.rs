//! The traits over plain HTTP/1.1 (hyper): [`HttpEngines`] speaks to vLLM's OpenAI-compatible
//! server (`POST /tokenize`, `POST /v1/completions` streaming, and not streaming for a P/D
//! prefill, `GET /health`), [`HttpHolders`] to the daemons' admin port (`GET`/`DELETE
//! /checkpoints/{request}`, `DELETE /holds/{request}`). One connection per call; every wait
//! bounded.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::client::conn::http1;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use kvd_control::{Epoch, RequestId, WorkerId};
use kvd_core::{Error, Result};
use serde_json::Value;
use tokio::net::TcpStream;

use crate::config::PROBE_TIMEOUT;
use crate::engine::{
    BoxFuture, ByteStream, Engines, EventStream, Forwarded, Held, Holders, Opened, PrefillAnswer,
};
use crate::hub::Hub;
use crate::sse::{EventBuffer, token_ids};

/// Largest body read whole (a JSON answer), bytes.
pub const MAX_JSON_BYTES: usize = 1 << 20;

/// An `http://host:port` address, kept as its authority.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// `host:port`.
    pub authority: String,
}

impl std::str::FromStr for Endpoint {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let rest = s.strip_prefix("http://").unwrap_or(s);
        let authority = rest.trim_end_matches('/');
        if authority.is_empty() || authority.contains('/') || !authority.contains(':') {
            return Err(Error::InvalidArgument(format!(
                "{s:?}: expected http://HOST:PORT (no path; https is not spoken here)"
            )));
        }
        Ok(Endpoint {
            authority: authority.to_string(),
        })
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "http://{}", self.authority)
    }
}

/// Parse the `--engine ID=URL` list.
///
/// # Errors
/// [`Error::InvalidArgument`] for a malformed entry or a repeated id.
pub fn parse_engines(list: &[String]) -> Result<BTreeMap<WorkerId, Endpoint>> {
    parse_pool("--engine", list)
}

/// Parse the decode pool (`--engine`) and the prefill pool (`--prefill-engine`).
///
/// # Errors
/// [`Error::InvalidArgument`] for a malformed entry, a repeated id, an id in both pools, or a
/// prefill pool without a decode pool.
pub fn parse_pools(
    engines: &[String],
    prefill: &[String],
) -> Result<(BTreeMap<WorkerId, Endpoint>, BTreeMap<WorkerId, Endpoint>)> {
    let decode = parse_engines(engines)?;
    let prefill = parse_pool("--prefill-engine", prefill)?;
    if !prefill.is_empty() && decode.is_empty() {
        return Err(Error::InvalidArgument(
            "--prefill-engine needs --engine: the prefill workers hand their prompts to decode workers".into(),
        ));
    }
    if let Some(id) = prefill.keys().find(|id| decode.contains_key(id)) {
        return Err(Error::InvalidArgument(format!(
            "worker {id} is in both --engine and --prefill-engine: a worker is either a decode worker (placed by the controller) or a prefill worker, not both"
        )));
    }
    Ok((decode, prefill))
}

fn parse_pool(flag: &str, list: &[String]) -> Result<BTreeMap<WorkerId, Endpoint>> {
    let mut out = BTreeMap::new();
    for e in list {
        let (id, url) = e.split_once('=').ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{flag} {e:?}: expected ID=URL, e.g. 1=http://127.0.0.1:8000"
            ))
        })?;
        let id: WorkerId = id.trim().parse().map_err(|_| {
            Error::InvalidArgument(format!("{flag} {e:?}: {id:?} is not a node id"))
        })?;
        if out.insert(id, url.trim().parse()?).is_some() {
            return Err(Error::InvalidArgument(format!(
                "{flag}: worker {id} given twice"
            )));
        }
    }
    Ok(out)
}

fn unavailable(ep: &Endpoint, what: &str, e: impl std::fmt::Display) -> Error {
    Error::Unavailable(format!("{ep}: {what}: {e}"))
}

/// Send one request and wait for the answer's head (connect and head within `timeout`).
///
/// # Errors
/// [`Error::Unavailable`] when the address does not answer in time or the connection fails.
pub async fn send(
    ep: &Endpoint,
    method: Method,
    path: &str,
    body: Option<Vec<u8>>,
    timeout: Duration,
) -> Result<(StatusCode, Incoming)> {
    let resp = send_for_response(ep, method, path, body, timeout).await?;
    Ok((resp.status(), resp.into_body()))
}

/// As [`send`], the whole answer's head kept.
///
/// # Errors
/// As [`send`].
pub async fn send_for_response(
    ep: &Endpoint,
    method: Method,
    path: &str,
    body: Option<Vec<u8>>,
    timeout: Duration,
) -> Result<hyper::Response<Incoming>> {
    send_with_headers(ep, method, path, &[], body, timeout).await
}

/// As [`send_for_response`], with these headers too.
///
/// # Errors
/// As [`send`].
pub async fn send_with_headers(
    ep: &Endpoint,
    method: Method,
    path: &str,
    headers: &[(&str, String)],
    body: Option<Vec<u8>>,
    timeout: Duration,
) -> Result<hyper::Response<Incoming>> {
    let go = async {
        let tcp = TcpStream::connect(&ep.authority)
            .await
            .map_err(|e| unavailable(ep, "connect", e))?;
        let _ = tcp.set_nodelay(true);
        let (mut sender, conn) = http1::handshake(TokioIo::new(tcp))
            .await
            .map_err(|e| unavailable(ep, "handshake", e))?;
        // the connection runs until the answer's body is read or dropped
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header(hyper::header::HOST, ep.authority.as_str());
        if body.is_some() {
            req = req.header(hyper::header::CONTENT_TYPE, "application/json");
        }
        for (k, v) in headers {
            req = req.header(*k, v.as_str());
        }
        let req = req
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        sender
            .send_request(req)
            .await
            .map_err(|e| unavailable(ep, "request", e))
    };
    tokio::time::timeout(timeout, go).await.map_err(|_| {
        unavailable(
            ep,
            "no answer",
            format!("within {} ms", timeout.as_millis()),
        )
    })?
}

/// Read a whole body (at most [`MAX_JSON_BYTES`]) within `timeout`.
///
/// # Errors
/// [`Error::Unavailable`] when it breaks or takes too long; [`Error::Protocol`] when too large.
pub async fn read_all(ep: &Endpoint, mut body: Incoming, timeout: Duration) -> Result<Vec<u8>> {
    let go = async {
        let mut out = Vec::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| unavailable(ep, "body", e))?;
            if let Ok(data) = frame.into_data() {
                if out.len() + data.len() > MAX_JSON_BYTES {
                    return Err(Error::Protocol(format!(
                        "{ep}: an answer over {MAX_JSON_BYTES} bytes"
                    )));
                }
                out.extend_from_slice(&data);
            }
        }
        Ok(out)
    };
    tokio::time::timeout(timeout, go)
        .await
        .map_err(|_| unavailable(ep, "body", "too slow"))?
}

/// One call with a JSON (or empty) answer: `(status, body)`.
///
/// # Errors
/// As [`send`] and [`read_all`].
pub async fn call(
    ep: &Endpoint,
    method: Method,
    path: &str,
    body: Option<Vec<u8>>,
    timeout: Duration,
) -> Result<(StatusCode, Vec<u8>)> {
    let (status, b) = send(ep, method, path, body, timeout).await?;
    Ok((status, read_all(ep, b, timeout).await?))
}

/// A `GET` of `path` with `headers`: the answer's status, and its body as it comes (a stream
/// another front serves, relayed).
///
/// # Errors
/// As [`send`].
pub async fn get_stream(
    ep: &Endpoint,
    path: &str,
    headers: &[(&str, String)],
    timeout: Duration,
) -> Result<(u16, Box<dyn ByteStream>)> {
    let resp = send_with_headers(ep, Method::GET, path, headers, None, timeout).await?;
    let status = resp.status().as_u16();
    Ok((
        status,
        Box::new(HttpBytes {
            body: resp.into_body(),
        }),
    ))
}

/// The longest wait for a forwarded body's answer head (one without a stream comes whole).
const FORWARD_HEAD_TIMEOUT: Duration = Duration::from_secs(3600);

/// A forwarded answer's body, read as it comes.
#[derive(Debug)]
struct HttpBytes {
    body: Incoming,
}

impl HttpBytes {
    async fn next_bytes(&mut self) -> Result<Option<Vec<u8>>> {
        loop {
            match self.body.frame().await {
                None => return Ok(None),
                Some(Err(e)) => return Err(Error::Unavailable(format!("the answer broke: {e}"))),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        return Ok(Some(data.to_vec()));
                    }
                }
            }
        }
    }
}

impl ByteStream for HttpBytes {
    fn next(&mut self) -> BoxFuture<'_, Result<Option<Vec<u8>>>> {
        Box::pin(self.next_bytes())
    }
}

/// Reads `data:` events off a `text/event-stream` body.
#[derive(Debug)]
struct HttpEventStream {
    body: Incoming,
    buf: EventBuffer,
}

impl HttpEventStream {
    async fn next_data(&mut self) -> Result<Option<String>> {
        loop {
            if let Some(data) = self.buf.next_data()? {
                return Ok(Some(data));
            }
            match self.body.frame().await {
                None => return Ok(None),
                Some(Err(e)) => return Err(Error::Unavailable(format!("the stream broke: {e}"))),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buf.extend(&data)?;
                    }
                }
            }
        }
    }
}

impl EventStream for HttpEventStream {
    fn next(&mut self) -> BoxFuture<'_, Result<Option<String>>> {
        Box::pin(self.next_data())
    }
}

/// vLLM's OpenAI-compatible servers, one per worker (`--engine ID=URL`, and the prefill pool's
/// `--prefill-engine ID=URL`).
#[derive(Debug, Clone)]
pub struct HttpEngines {
    endpoints: BTreeMap<WorkerId, Endpoint>,
    prefill: BTreeMap<WorkerId, Endpoint>,
    timeout: Duration,
}

impl HttpEngines {
    /// The engines `--engine` names; `timeout` bounds a connect and an answer's head (and a
    /// prefill's whole answer).
    ///
    /// # Errors
    /// As [`parse_engines`].
    pub fn new(list: &[String], timeout: Duration) -> Result<HttpEngines> {
        Self::with_prefill(list, &[], timeout)
    }

    /// The decode pool `--engine` names and the prefill pool `--prefill-engine` names.
    ///
    /// # Errors
    /// As [`parse_pools`].
    pub fn with_prefill(
        list: &[String],
        prefill: &[String],
        timeout: Duration,
    ) -> Result<HttpEngines> {
        let (endpoints, prefill) = parse_pools(list, prefill)?;
        Ok(HttpEngines {
            endpoints,
            prefill,
            timeout,
        })
    }

    fn endpoint(&self, worker: WorkerId) -> Result<&Endpoint> {
        self.endpoints
            .get(&worker)
            .or_else(|| self.prefill.get(&worker))
            .ok_or_else(|| {
                Error::NotFound(format!(
                    "worker {worker} has no engine address (--engine, --prefill-engine)"
                ))
            })
    }

    /// A non-streaming completion on a prefill worker: its JSON answer, or its refusal. The
    /// whole answer within the timeout and [`MAX_JSON_BYTES`].
    async fn prefill_at(&self, worker: WorkerId, body: Value) -> Result<PrefillAnswer> {
        let ep = self.prefill.get(&worker).ok_or_else(|| {
            Error::NotFound(format!(
                "worker {worker} has no prefill engine address (--prefill-engine)"
            ))
        })?;
        let body = body.to_string().into_bytes();
        let go = call(
            ep,
            Method::POST,
            "/v1/completions",
            Some(body),
            self.timeout,
        );
        let (status, b) = tokio::time::timeout(self.timeout, go)
            .await
            .map_err(|_| unavailable(ep, "prefill", "no whole answer in time"))??;
        if !status.is_success() {
            return Ok(PrefillAnswer::Refused {
                status: status.as_u16(),
                text: String::from_utf8_lossy(&b).into_owned(),
            });
        }
        serde_json::from_slice(&b)
            .map(PrefillAnswer::Done)
            .map_err(|e| unavailable(ep, "prefill: the answer is not JSON", e))
    }

    async fn tokenize_at(&self, worker: WorkerId, body: Value) -> Result<Vec<u32>> {
        let ep = self.endpoint(worker)?;
        let (status, b) = call(
            ep,
            Method::POST,
            "/tokenize",
            Some(body.to_string().into_bytes()),
            self.timeout,
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

    async fn models_at(&self, worker: WorkerId) -> Result<Value> {
        let ep = self.endpoint(worker)?;
        let (status, b) = call(ep, Method::GET, "/v1/models", None, self.timeout).await?;
        if !status.is_success() {
            return Err(Error::Unavailable(format!("{ep}/v1/models: {status}")));
        }
        serde_json::from_slice(&b).map_err(|e| Error::Protocol(format!("{ep}/v1/models: {e}")))
    }

    async fn forward_at(
        &self,
        worker: WorkerId,
        path: &'static str,
        body: Vec<u8>,
    ) -> Result<Forwarded> {
        let ep = self.endpoint(worker)?;
        // the caller bounds the wait for a whole answer (the request's deadline)
        let resp =
            send_for_response(ep, Method::POST, path, Some(body), FORWARD_HEAD_TIMEOUT).await?;
        let content_type = resp
            .headers()
            .get(hyper::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        Ok(Forwarded {
            status: resp.status().as_u16(),
            content_type,
            body: Box::new(HttpBytes {
                body: resp.into_body(),
            }),
        })
    }

    async fn complete_at(&self, worker: WorkerId, body: Value) -> Result<Opened> {
        let ep = self.endpoint(worker)?;
        let body = body.to_string().into_bytes();
        let (status, incoming) = send(
            ep,
            Method::POST,
            "/v1/completions",
            Some(body),
            self.timeout,
        )
        .await?;
        if !status.is_success() {
            let text = read_all(ep, incoming, PROBE_TIMEOUT)
                .await
                .unwrap_or_default();
            return Ok(Opened::Refused {
                status: status.as_u16(),
                text: String::from_utf8_lossy(&text).into_owned(),
            });
        }
        Ok(Opened::Stream(Box::new(HttpEventStream {
            body: incoming,
            buf: EventBuffer::default(),
        })))
    }

    async fn health_at(&self, worker: WorkerId) -> bool {
        let Ok(ep) = self.endpoint(worker) else {
            return false;
        };
        matches!(call(ep, Method::GET, "/health", None, PROBE_TIMEOUT).await, Ok((s, _)) if s.is_success())
    }
}

impl Engines for HttpEngines {
    fn workers(&self) -> Vec<WorkerId> {
        self.endpoints.keys().copied().collect()
    }

    fn name(&self, worker: WorkerId) -> String {
        self.endpoints
            .get(&worker)
            .or_else(|| self.prefill.get(&worker))
            .map_or_else(|| format!("worker {worker}"), ToString::to_string)
    }

    fn tokenize(&self, worker: WorkerId, body: Value) -> BoxFuture<'_, Result<Vec<u32>>> {
        Box::pin(self.tokenize_at(worker, body))
    }

    fn models(&self, worker: WorkerId) -> BoxFuture<'_, Result<Value>> {
        Box::pin(self.models_at(worker))
    }

    fn forward(
        &self,
        worker: WorkerId,
        path: &'static str,
        body: Vec<u8>,
    ) -> BoxFuture<'_, Result<Forwarded>> {
        Box::pin(self.forward_at(worker, path, body))
    }

    fn complete(&self, worker: WorkerId, body: Value) -> BoxFuture<'_, Result<Opened>> {
        Box::pin(self.complete_at(worker, body))
    }

    fn prefill_workers(&self) -> Vec<WorkerId> {
        self.prefill.keys().copied().collect()
    }

    fn prefill(&self, worker: WorkerId, body: Value) -> BoxFuture<'_, Result<PrefillAnswer>> {
        Box::pin(self.prefill_at(worker, body))
    }

    fn health(&self, worker: WorkerId) -> BoxFuture<'_, bool> {
        Box::pin(self.health_at(worker))
    }
}

/// The daemons' admin ports, at the addresses their registrations give (the [`Hub`]'s nodes).
#[derive(Debug, Clone)]
pub struct HttpHolders {
    hub: Arc<Hub>,
}

impl HttpHolders {
    /// Holders reached at the admin addresses `hub` knows.
    pub fn new(hub: Arc<Hub>) -> HttpHolders {
        HttpHolders { hub }
    }

    fn admin(&self, holder: WorkerId) -> Result<Endpoint> {
        self.hub
            .node_admin(u64::from(holder))
            .ok_or_else(|| Error::NotFound(format!("node {holder} is not registered")))?
            .parse()
    }

    async fn held_at(&self, holder: WorkerId, id: RequestId) -> Result<Option<Held>> {
        let ep = self.admin(holder)?;
        let path = format!("/checkpoints/{id}");
        let (status, body) = call(&ep, Method::GET, &path, None, PROBE_TIMEOUT).await?;
        match status {
            StatusCode::NOT_FOUND => Ok(None),
            s if s.is_success() => serde_json::from_slice(&body)
                .map(Some)
                .map_err(|e| Error::Protocol(format!("{ep}{path}: {e}"))),
            s => Err(Error::Unavailable(format!("{ep}{path}: {s}"))),
        }
    }

    async fn end_at(&self, holder: WorkerId, id: RequestId, epoch: Epoch) -> Result<()> {
        self.delete(holder, &format!("/checkpoints/{id}?epoch={epoch}"))
            .await
    }

    /// `DELETE path` on `node`'s admin port: 2xx and 404 (nothing there) are success.
    async fn delete(&self, node: WorkerId, path: &str) -> Result<()> {
        let ep = self.admin(node)?;
        let (status, body) = call(&ep, Method::DELETE, path, None, PROBE_TIMEOUT).await?;
        if status.is_success() || status == StatusCode::NOT_FOUND {
            Ok(())
        } else {
            Err(Error::Unavailable(format!(
                "{ep}: {status}: {}",
                String::from_utf8_lossy(&body)
            )))
        }
    }
}

impl Holders for HttpHolders {
    fn held(&self, holder: WorkerId, request: RequestId) -> BoxFuture<'_, Result<Option<Held>>> {
        Box::pin(self.held_at(holder, request))
    }

    fn end(&self, holder: WorkerId, request: RequestId, epoch: Epoch) -> BoxFuture<'_, Result<()>> {
        Box::pin(self.end_at(holder, request, epoch))
    }

    fn end_hold(
        &self,
        node: WorkerId,
        request: RequestId,
        epoch: Epoch,
    ) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            self.delete(node, &format!("/holds/{request}?epoch={epoch}"))
                .await
        })
    }

    fn events(
        &self,
        node: WorkerId,
        since: u64,
        max: u32,
    ) -> BoxFuture<'_, Result<crate::cache::EventsPage>> {
        Box::pin(async move {
            let ep = self.admin(node)?;
            let path = format!("/events?since={since}&max={max}");
            let (status, body) = call(&ep, Method::GET, &path, None, PROBE_TIMEOUT).await?;
            match status {
                s if s.is_success() => serde_json::from_slice(&body)
                    .map_err(|e| Error::Protocol(format!("{ep}{path}: {e}"))),
                StatusCode::BAD_REQUEST => Err(Error::InvalidArgument(format!(
                    "{ep}{path}: {}",
                    String::from_utf8_lossy(&body)
                ))),
                s => Err(Error::Unavailable(format!("{ep}{path}: {s}"))),
            }
        })
    }
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
    fn a_worker_is_in_the_decode_pool_or_the_prefill_pool_never_both() {
        let (d, p) = parse_pools(&["1=http://a:1".into()], &["7=http://b:2".into()]).unwrap();
        assert_eq!((d.len(), p[&7].authority.as_str()), (1, "b:2"));
        let e = parse_pools(&["1=http://a:1".into()], &["1=http://b:2".into()]).unwrap_err();
        assert!(e.to_string().contains("worker 1 is in both"), "{e}");
        let e = parse_pools(&[], &["7=http://b:2".into()]).unwrap_err();
        assert!(e.to_string().contains("needs --engine"), "{e}");
        let e = parse_pools(&["1=http://a:1".into()], &["x=http://b:2".into()]).unwrap_err();
        assert!(e.to_string().contains("--prefill-engine"), "{e}");
    }

    #[test]
    fn an_endpoint_is_host_and_port_over_plain_http() {
        let e: Endpoint = "http://127.0.0.1:8000/".parse().unwrap();
        assert_eq!(e.authority, "127.0.0.1:8000");
        assert_eq!(e.to_string(), "http://127.0.0.1:8000");
        assert!("https://x:1/v1".parse::<Endpoint>().is_err());
        assert!("http://nohost".parse::<Endpoint>().is_err());
    }
}
