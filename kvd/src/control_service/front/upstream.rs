//! The front's HTTP client: one HTTP/1.1 connection per call to an engine's OpenAI-compatible
//! server or a node's admin port, every wait bounded, and a reader for the engine's event
//! stream (`text/event-stream`, one `data:` payload per event).

use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::client::conn::http1;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::{Error, Result};

/// Largest body read whole (a JSON answer), bytes.
pub const MAX_JSON_BYTES: usize = 1 << 20;
/// Largest single event of an engine's stream, bytes.
pub const MAX_EVENT_BYTES: usize = 1 << 20;

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
        let req = req
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let resp = sender
            .send_request(req)
            .await
            .map_err(|e| unavailable(ep, "request", e))?;
        Ok((resp.status(), resp.into_body()))
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

/// What the next read of an event stream gave.
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    /// One event's `data` (its `data:` lines joined by `\n`).
    Data(String),
    /// The stream ended cleanly (the server closed it).
    End,
}

/// Reads `data:` events off a `text/event-stream` body.
#[derive(Debug)]
pub struct EventReader {
    body: Incoming,
    buf: Vec<u8>,
}

impl EventReader {
    /// A reader over `body`.
    pub fn new(body: Incoming) -> Self {
        EventReader {
            body,
            buf: Vec::new(),
        }
    }

    /// The next event (comments and events without data are skipped).
    ///
    /// # Errors
    /// [`Error::Unavailable`] when the connection breaks; [`Error::Protocol`] for an event over
    /// [`MAX_EVENT_BYTES`] or one that is not UTF-8.
    pub async fn next(&mut self) -> Result<Next> {
        loop {
            if let Some(ev) = take_event(&mut self.buf)? {
                if let Some(data) = ev {
                    return Ok(Next::Data(data));
                }
                continue;
            }
            match self.body.frame().await {
                None => return Ok(Next::End),
                Some(Err(e)) => return Err(Error::Unavailable(format!("the stream broke: {e}"))),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buf.extend_from_slice(&data);
                        if self.buf.len() > MAX_EVENT_BYTES {
                            return Err(Error::Protocol(format!(
                                "an event over {MAX_EVENT_BYTES} bytes"
                            )));
                        }
                    }
                }
            }
        }
    }
}

/// Take one whole event off the front of `buf`: `None` when no whole event is there yet;
/// `Some(None)` for an event without data (a comment, a keep-alive).
fn take_event(buf: &mut Vec<u8>) -> Result<Option<Option<String>>> {
    let Some((end, sep)) = find_blank_line(buf) else {
        return Ok(None);
    };
    let raw: Vec<u8> = buf.drain(..end + sep).collect();
    let text = std::str::from_utf8(&raw[..end])
        .map_err(|_| Error::Protocol("an event that is not UTF-8".into()))?;
    let mut data: Option<String> = None;
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("data:") {
            let v = v.strip_prefix(' ').unwrap_or(v);
            match &mut data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(v);
                }
                None => data = Some(v.to_string()),
            }
        }
    }
    Ok(Some(data))
}

/// Where the first blank line is: (index of the event's end, length of the separator).
fn find_blank_line(buf: &[u8]) -> Option<(usize, usize)> {
    let mut i = 0;
    while i + 1 < buf.len() {
        if buf[i] == b'\n' && buf[i + 1] == b'\n' {
            return Some((i, 2));
        }
        if buf[i..].starts_with(b"\r\n\r\n") {
            return Some((i, 4));
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_on_blank_lines_whatever_the_line_ends() {
        let mut b =
            b"data: {\"a\":1}\n\n: keep-alive\n\ndata: x\r\ndata: y\r\n\r\ndata: [DO".to_vec();
        assert_eq!(
            take_event(&mut b).unwrap(),
            Some(Some("{\"a\":1}".to_string()))
        );
        assert_eq!(take_event(&mut b).unwrap(), Some(None));
        assert_eq!(take_event(&mut b).unwrap(), Some(Some("x\ny".to_string())));
        assert_eq!(take_event(&mut b).unwrap(), None, "a partial event waits");
        b.extend_from_slice(b"NE]\n\n");
        assert_eq!(
            take_event(&mut b).unwrap(),
            Some(Some("[DONE]".to_string()))
        );
        assert!(b.is_empty());
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
