//! Opening and accepting connections, for every backend: connect, authenticate both ways over
//! the cluster secret ([`crate::auth`]), exchange [`Bind`]s, and set the socket options the
//! backends rely on. All of it blocking with timeouts, in the caller's thread (opening) or a
//! bounded handshake thread (accepting): setup may block; the data path never does.
//!
//! Admission of unauthenticated connections, like the Unix socket's (the bounds are checked by
//! the listener that owns the data port socket, `tcp/listener.rs`; the frames are here):
//!
//! ```text
//! accept ─┬─ handshakes ≥ max_handshakes, or ≥ max_handshakes_per_source from this address,
//!         │  or served connections ≥ max_target_connections
//!         │      ──▶ a refusal frame (which bound, retry after) in one non-blocking write; close
//!         └─ handshake thread: hello, challenge, proof, bind, all within ONE deadline
//!            (connect_timeout from the accept: a peer that trickles bytes cannot stretch it)
//! ```
//!
//! The initiator reads the refusal frame where the challenge would be and reports a retryable
//! [`Error::Overloaded`] naming the bound, so a lockout never reads as a wrong secret (which
//! shows as a failed proof, later in the handshake).
//!
//! Once authenticated, a peer has a bound of its own per purpose
//! (`max_connections_per_peer` data connections, as many control and RDMA side
//! connections): a node holding the secret that opens and idles connections takes its own
//! share, never another peer's. Past it the responder sends a tagged [`Refusal`] where its
//! bind would be, which the initiator reports as a retryable [`Error::Overloaded`].
//!
//! The binds are the first tagged frames of the connection ([`crate::auth::Sealer`]); the
//! [`Channel`] returned carries the key on.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::PeerAddr;
use super::wire::{Bind, Purpose, Refusal};
use crate::admission::Admission;
use crate::auth::{Challenge, ClusterSecret, Hello, Initiator, Proof, Responder, Role};
use crate::channel::{Channel, PeerPurpose};
use crate::error::{Error, Result};

/// What one side of a handshake needs to know about its own node (the backend that owns the
/// listener builds it from its settings).
#[derive(Debug, Clone, Copy)]
pub struct Handshake<'a> {
    /// This node's id, as its binds say.
    pub node_id: u64,
    /// This node's incarnation, as its binds say.
    pub node_generation: u64,
    /// The cluster secret both ends prove they hold.
    pub secret: &'a ClusterSecret,
    /// The deadline for connecting, and for the whole handshake when accepting.
    pub connect_timeout: Duration,
    /// The kernel's user timeout and keep-alive give up on a silent peer after this.
    pub stall_timeout: Duration,
    /// Connections of one purpose one peer may hold here (named in the refusal).
    pub max_connections_per_peer: usize,
    /// Frames whose integrity tag was wrong (counted here and on every channel made).
    pub integrity_failures: &'a Arc<AtomicU64>,
}

fn io(what: &str, e: std::io::Error) -> Error {
    Error::PeerUnavailable(format!("{what}: {e}"))
}

/// The first bytes of a refusal, where a challenge would start (a random nonce matches them
/// with probability 2^-128).
const REFUSAL_MAGIC: &[u8; 16] = b"kvd-refused\0\0\0\0\0";

/// How long a refused initiator should wait before it tries again, ms.
const REFUSAL_RETRY_MS: u64 = 200;

/// The kernel's own give-up time (`TCP_USER_TIMEOUT`) on a data connection, in stall
/// timeouts. The ring's stall check is the authority on a stalled data connection (and
/// aborts it, see the ring's `begin_close`); the kernel's is a backstop and must not be the
/// tighter of the two: on a starved receiver (many peers on few cores) the receive queue
/// fills, the segment at its head is dropped on every retransmission until the queue is read,
/// and the retransmit backoff (0.2, 0.4, 0.8, 1.6, 3.2 s) passes 5 s while the connection
/// still completes work. At one stall timeout the kernel aborted such connections in a
/// 16-daemon mesh on 2 cores (`TCPAbortOnTimeout`) where plain TCP sockets, without a user
/// timeout, carried the same load to the end.
///
/// Control (and RDMA side-channel) connections keep one stall timeout: they carry small
/// messages, so a starved receiver does not drop their segments, and nothing but the kernel
/// watches them: a destination learns that a push's source is cut off when its control
/// connection dies, and frees the push's pages then.
const KERNEL_TIMEOUT_FACTOR: u32 = 4;

/// A refusal in the challenge's place: the magic, the retry hint (u64 LE), the bound (ASCII).
fn refusal_frame(bound: &str) -> [u8; Challenge::WIRE_BYTES] {
    let mut b = [0u8; Challenge::WIRE_BYTES];
    b[..16].copy_from_slice(REFUSAL_MAGIC);
    b[16..24].copy_from_slice(&REFUSAL_RETRY_MS.to_le_bytes());
    let text = bound.as_bytes();
    let n = text.len().min(Challenge::WIRE_BYTES - 24);
    b[24..24 + n].copy_from_slice(&text[..n]);
    b
}

/// The refusal a challenge-sized frame holds, if it is one.
fn refusal_of(b: &[u8; Challenge::WIRE_BYTES]) -> Option<Error> {
    if &b[..16] != REFUSAL_MAGIC {
        return None;
    }
    let mut retry = [0u8; 8];
    retry.copy_from_slice(&b[16..24]);
    let text = String::from_utf8_lossy(&b[24..]);
    Some(Error::Overloaded {
        what: format!(
            "the peer refused the handshake: {}",
            text.trim_end_matches('\0')
        ),
        retry_after_ms: u64::from_le_bytes(retry),
    })
}

/// Read exactly `buf.len()` bytes by `deadline` (one deadline for many reads: a peer that
/// trickles a byte at a time cannot stretch it).
fn read_by(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the handshake's deadline passed",
            ));
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut buf[got..])? {
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            n => got += n,
        }
    }
    Ok(())
}

/// Options every connection gets: no Nagle (headers go at once), keep-alive probes and a
/// user timeout at the stall timeout (so the kernel itself gives up on a peer that stopped
/// acknowledging; a data connection's is widened once its purpose is known, see
/// [`set_user_timeout`]), and a bounded wait for the handshake.
fn tune(s: &TcpStream, config: &Handshake<'_>) -> std::io::Result<()> {
    use rustix::net::sockopt;
    s.set_nodelay(true)?;
    sockopt::set_socket_keepalive(s, true)?;
    sockopt::set_tcp_keepidle(s, Duration::from_secs(5))?;
    sockopt::set_tcp_keepintvl(s, Duration::from_secs(1))?;
    sockopt::set_tcp_keepcnt(s, 3)?;
    set_user_timeout(s, config, Purpose::Control)?;
    s.set_read_timeout(Some(config.connect_timeout))?;
    s.set_write_timeout(Some(config.connect_timeout))?;
    Ok(())
}

/// The kernel's give-up time for a connection of `purpose`: [`KERNEL_TIMEOUT_FACTOR`] stall
/// timeouts for data, one for the rest.
fn set_user_timeout(
    s: &TcpStream,
    config: &Handshake<'_>,
    purpose: Purpose,
) -> std::io::Result<()> {
    let factor = match purpose {
        Purpose::Data => KERNEL_TIMEOUT_FACTOR,
        Purpose::Control | Purpose::Rdma => 1,
    };
    let ms = (config.stall_timeout * factor)
        .as_millis()
        .min(u128::from(u32::MAX)) as u32;
    rustix::net::sockopt::set_tcp_user_timeout(s, ms)?;
    Ok(())
}

fn bind_of(config: &Handshake<'_>, generation: u64, purpose: Purpose) -> Bind {
    Bind {
        node_id: config.node_id,
        node_generation: generation,
        purpose,
    }
}

/// Connect one connection for `purpose` to `peer` and authenticate it (the initiator's
/// side); the peer's introduction with it.
pub fn connect(
    config: &Handshake<'_>,
    peer: &PeerAddr,
    purpose: Purpose,
) -> Result<(Channel, Bind)> {
    let generation = config.node_generation;
    let failures = config.integrity_failures;
    let shown = peer.addr;
    let mut s = TcpStream::connect_timeout(&peer.addr, config.connect_timeout)
        .map_err(|e| io(&format!("connect to {shown}"), e))?;
    tune(&s, config).map_err(|e| io("socket options", e))?;
    let (me, hello) = Initiator::start(config.secret)?;
    s.write_all(&hello.encode())
        .map_err(|e| io(&format!("handshake with {shown}"), e))?;
    let mut c = [0u8; Challenge::WIRE_BYTES];
    s.read_exact(&mut c).map_err(|e| {
        io(
            &format!("handshake with {shown} (closed before its challenge: not a kvd data port, or it is shutting down)"),
            e,
        )
    })?;
    if let Some(refused) = refusal_of(&c) {
        return Err(refused);
    }
    let (proof, key) = me
        .respond(&Challenge::decode(&c))
        .map_err(|e| Error::PeerUnavailable(format!("{shown}: {e}")))?;
    let (mut seal, mut unseal) = key.split(Role::Initiator);
    s.write_all(&proof.0)
        .map_err(|e| io(&format!("handshake with {shown}"), e))?;
    let mut ours = bind_of(config, generation, purpose).encode();
    seal.seal(&mut ours);
    s.write_all(&ours)
        .map_err(|e| io(&format!("bind with {shown}"), e))?;
    let mut b = [0u8; Bind::WIRE_BYTES];
    s.read_exact(&mut b).map_err(|e| {
        io(
            &format!("bind with {shown} (the peer refused our proof: do both ends hold the same cluster secret?)"),
            e,
        )
    })?;
    unseal.open(&b).map_err(|e| {
        failures.fetch_add(1, Ordering::Relaxed);
        Error::PeerUnavailable(format!("bind with {shown}: {e}"))
    })?;
    if let Some(r) = Refusal::decode(&b) {
        return Err(Error::Overloaded {
            what: format!(
                "{shown} refused the connection: it serves this node {} {:?} connections at most",
                r.limit, r.purpose
            ),
            retry_after_ms: u64::from(r.retry_after_ms),
        });
    }
    let theirs = Bind::decode(&b).map_err(|e| Error::PeerUnavailable(e.to_string()))?;
    if theirs.node_id != peer.node_id {
        return Err(Error::PeerUnavailable(format!(
            "{shown} is node {}, not node {} as expected",
            theirs.node_id, peer.node_id
        )));
    }
    if theirs.purpose != purpose {
        return Err(Error::PeerUnavailable(format!(
            "{shown} took the connection for another purpose"
        )));
    }
    set_user_timeout(&s, config, purpose).map_err(|e| io("socket options", e))?;
    let channel = Channel::new(s, seal, unseal, None).counting(failures.clone());
    Ok((channel, theirs))
}

/// The responder's side of one connection, all of it by `deadline`, within the per-peer
/// bounds of `peers`; the initiator's introduction with it.
pub fn accept_one(
    config: &Handshake<'_>,
    peers: &Admission<PeerPurpose>,
    mut s: TcpStream,
    deadline: Instant,
) -> Result<(Channel, Bind)> {
    let generation = config.node_generation;
    let failures = config.integrity_failures;
    tune(&s, config).map_err(|e| io("socket options", e))?;
    let mut h = [0u8; Hello::WIRE_BYTES];
    read_by(&mut s, &mut h, deadline).map_err(|e| io("handshake", e))?;
    let (me, challenge) = Responder::answer(config.secret, &Hello::decode(&h)?)?;
    s.write_all(&challenge.encode())
        .map_err(|e| io("handshake", e))?;
    let mut p = [0u8; 32];
    read_by(&mut s, &mut p, deadline).map_err(|e| io("handshake", e))?;
    let key = me.verify(&Proof(p))?;
    let (mut seal, mut unseal) = key.split(Role::Responder);
    let mut b = [0u8; Bind::WIRE_BYTES];
    read_by(&mut s, &mut b, deadline).map_err(|e| io("bind", e))?;
    s.set_read_timeout(Some(config.connect_timeout))
        .map_err(|e| io("socket options", e))?;
    unseal.open(&b).inspect_err(|_| {
        failures.fetch_add(1, Ordering::Relaxed);
    })?;
    let theirs = Bind::decode(&b)?;
    let place = peers.admit(PeerPurpose {
        node: theirs.node_id,
        purpose: theirs.purpose,
    });
    let mut answer = match &place {
        Ok(_) => bind_of(config, generation, theirs.purpose).encode(),
        Err(_) => Refusal {
            purpose: theirs.purpose,
            limit: u32::try_from(config.max_connections_per_peer).unwrap_or(u32::MAX),
            retry_after_ms: REFUSAL_RETRY_MS as u32,
        }
        .encode(),
    };
    seal.seal(&mut answer);
    s.write_all(&answer).map_err(|e| io("bind", e))?;
    let place = place.map_err(|bound| Error::Overloaded {
        what: format!("a peer's connections: {bound}"),
        retry_after_ms: REFUSAL_RETRY_MS,
    })?;
    set_user_timeout(&s, config, theirs.purpose).map_err(|e| io("socket options", e))?;
    let channel = Channel::new(s, seal, unseal, Some(place)).counting(failures.clone());
    Ok((channel, theirs))
}

/// Refuse a connection at a bound: read off what it sent, one non-blocking write of the
/// refusal frame, close. Never waits.
pub fn refuse(stream: TcpStream, bound: &str) {
    if stream.set_nonblocking(true).is_err() {
        return;
    }
    let mut sink = [0u8; Hello::WIRE_BYTES];
    let _ = (&stream).read(&mut sink);
    let _ = (&stream).write(&refusal_frame(bound));
    let _ = stream.shutdown(std::net::Shutdown::Write);
}
