//! `/healthz` and `/readyz` on a listener of their own (`--probe-listen`), so that a liveness
//! or readiness probe answers within its deadline however the admin port is flooded.
//!
//! The admin port bounds its connections and answers `503` past the bound (`admin.rs`); a
//! kubelet whose liveness probe met that `503` would restart a healthy daemon and drop its cache.
//! Here every connection is bounded too, but apart from the admin traffic, and in two ways:
//! at most [`PROBE_MAX_CONNECTIONS`] at once, and at most [`PROBE_MAX_PER_SOURCE`] from one
//! source address, so a flood from elsewhere cannot take the prober's share. A connection past a
//! bound is closed at once; one that has not sent its request line within
//! [`PROBE_DEADLINE_MS`] is closed. The answer is one request's: the two paths, `GET` only,
//! `Connection: close`; anything else is `404` or `405`.
//!
//! ```text
//! accept ─┬─ over a bound ──▶ close
//!         └─ slot ──▶ read the request line (≤ 1 s, ≤ PROBE_MAX_REQUEST_BYTES) ──▶ answer, close
//! ```

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::context::Daemon;
use transport::admission::Admission;

/// Probe connections served at once.
pub const PROBE_MAX_CONNECTIONS: usize = 32;
/// Probe connections from one source address at once.
pub const PROBE_MAX_PER_SOURCE: usize = 4;
/// How long a probe connection may take to send its request line and get its answer, ms.
pub const PROBE_DEADLINE_MS: u64 = 1000;
/// The most bytes of a request read.
pub const PROBE_MAX_REQUEST_BYTES: usize = 2048;

/// Serve the probes on `listener` until the process ends.
pub async fn serve(d: Arc<Daemon>, listener: TcpListener) {
    let admission = Admission::new(PROBE_MAX_CONNECTIONS, PROBE_MAX_PER_SOURCE);
    loop {
        let (stream, peer): (TcpStream, SocketAddr) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "probe accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(admitted) = admission.admit(peer.ip()) else {
            d.metrics.probe_connections_refused.inc();
            drop(stream);
            continue;
        };
        let d = d.clone();
        tokio::spawn(async move {
            let _admitted = admitted;
            let deadline = Duration::from_millis(PROBE_DEADLINE_MS);
            let _ = tokio::time::timeout(deadline, answer(&d, stream)).await;
        });
    }
}

async fn answer(d: &Daemon, mut stream: TcpStream) -> std::io::Result<()> {
    let mut buf = [0u8; PROBE_MAX_REQUEST_BYTES];
    let mut len = 0;
    // The request line is all that is needed; read until its end (bounded by the buffer).
    while !buf[..len].contains(&b'\n') && len < buf.len() {
        let n = stream.read(&mut buf[len..]).await?;
        if n == 0 {
            return Ok(());
        }
        len += n;
    }
    let line = String::from_utf8_lossy(&buf[..len]);
    let mut words = line.split_whitespace();
    let (code, body) = match (words.next(), words.next()) {
        (Some("GET"), Some("/healthz")) => (200, "ok\n".to_owned()),
        (Some("GET"), Some("/readyz")) => super::admin::readiness(d),
        (Some(_), Some("/healthz" | "/readyz")) => (405, "GET only\n".to_owned()),
        _ => (
            404,
            "this port answers GET /healthz and GET /readyz only\n".to_owned(),
        ),
    };
    let reason = match code {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        _ => "Service Unavailable",
    };
    let head = format!(
        "HTTP/1.1 {code} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    d.metrics.probes_answered.inc();
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await
}
