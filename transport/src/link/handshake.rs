//! Opening and accepting connections, for every backend: connect, authenticate both ways over
//! the cluster secret ([`crate::auth`]), exchange [`Bind`]s signed with each node's key
//! ([`super::identity`]), and set the socket options the backends rely on. All of it blocking with timeouts, in the caller's thread (opening) or a
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
//! shows as a failed proof, later in the handshake). Part of `max_handshakes` is kept for
//! connections from members' addresses (`member_handshakes`, [`super::members`]): strangers
//! alone cannot fill it, however many addresses they come from.
//!
//! **Identity.** The secret proves a peer is one of the cluster; its bind says which node it
//! is, signed with that node's key over the connection's transcript. The responder looks the
//! claimed node's key up among the [`Members`] and checks the signature, and that the bind is
//! addressed to this node, before anything else: a bind that fails gets a tagged
//! [`Refusal`] naming why (no key for that node: not a member or revoked; a bad signature;
//! addressed elsewhere), is counted (`identity_refusals`) and closed, and nothing of the
//! connection reaches a grant, a transfer or a handler. The initiator checks the responder's
//! bind the same way against the key it has for the node it meant to reach. A node whose key
//! is not among the members can neither connect here nor be connected to from here.
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
use super::identity::{NodeKey, PublicKey, verify_bind};
use super::members::Members;
use super::wire::{Bind, Purpose, Refusal, RefusalReason};
use crate::admission::Admission;
use crate::auth::{
    Challenge, ClusterSecret, Hello, Initiator, Proof, Responder, Role, Sealer, Session, Unsealer,
};
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
    /// This node's key: its binds are signed with it.
    pub identity: &'a NodeKey,
    /// The member nodes' keys: a peer's bind must be signed with its node's.
    pub members: &'a Members,
    /// Whether this end wants payload MACs on its connections.
    pub payload_mac: bool,
    /// The deadline for connecting, and for the whole handshake when accepting.
    pub connect_timeout: Duration,
    /// The kernel's user timeout and keep-alive give up on a silent peer after this.
    pub stall_timeout: Duration,
    /// Connections of one purpose one peer may hold here (named in the refusal).
    pub max_connections_per_peer: usize,
    /// Frames whose integrity tag was wrong (counted here and on every channel made).
    pub integrity_failures: &'a Arc<AtomicU64>,
    /// Binds refused here because their node identity was not proven.
    pub identity_refusals: &'a AtomicU64,
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

/// This end's bind for `purpose`, addressed to `to_node`, signed as `role` over `session`'s
/// transcript (its tag's place still zero).
fn signed_bind(
    config: &Handshake<'_>,
    session: &Session,
    role: Role,
    purpose: Purpose,
    to_node: u64,
) -> [u8; Bind::WIRE_BYTES] {
    let mut b = Bind {
        node_id: config.node_id,
        node_generation: config.node_generation,
        purpose,
        payload_mac: config.payload_mac,
        to_node,
    }
    .encode();
    let sig = config
        .identity
        .sign_bind(role, &session.transcript, &b[..Bind::BODY_BYTES]);
    b[Bind::SIGNATURE].copy_from_slice(&sig);
    b
}

/// Whether the bind in `b` was signed by `key` as `role` on `session`.
fn proves(key: &PublicKey, role: Role, session: &Session, b: &[u8; Bind::WIRE_BYTES]) -> bool {
    verify_bind(
        key,
        role,
        &session.transcript,
        &b[..Bind::BODY_BYTES],
        &b[Bind::SIGNATURE],
    )
}

/// The channel of a finished handshake (its tags past the binds): payload MACs on where
/// either end asked for them.
fn channel_of(
    s: TcpStream,
    (seal, unseal): (Sealer, Unsealer),
    session: &Session,
    macs: bool,
    place: Option<crate::admission::Admitted<PeerPurpose>>,
    failures: &Arc<AtomicU64>,
) -> Channel {
    let mut channel = Channel::new(s, seal, unseal, place).counting(failures.clone());
    if macs {
        channel = channel.with_payload_mac(session.key.payload_key());
    }
    channel
}

/// What an initiator reports for a responder's refusal of its bind.
fn refused_bind(shown: std::net::SocketAddr, me: u64, expected: u64, r: &Refusal) -> Error {
    match r.reason {
        RefusalReason::PerPeerBound => Error::Overloaded {
            what: format!(
                "{shown} refused the connection: it serves this node {} {:?} connections at most",
                r.limit, r.purpose
            ),
            retry_after_ms: u64::from(r.retry_after_ms),
        },
        RefusalReason::UnknownNode => Error::PeerUnavailable(format!(
            "{shown} refused this node's identity: it has no key for node {me} (not in its \
             peer list or etcd, or revoked)"
        )),
        RefusalReason::BadSignature => Error::PeerUnavailable(format!(
            "{shown} refused this node's identity: the bind's signature does not verify against \
             the key it has for node {me} (a different node key than the one published?)"
        )),
        RefusalReason::NotAddressedHere => Error::PeerUnavailable(format!(
            "{shown} is not node {expected}: it refused a bind addressed to node {expected}"
        )),
    }
}

/// Connect one connection for `purpose` to `peer` and authenticate it (the initiator's
/// side); the peer's introduction with it.
///
/// # Errors
/// [`Error::PeerUnavailable`] when no key is known for the peer, it cannot be reached, does not
/// hold the secret, does not prove it is the node expected, or refuses this node's identity;
/// [`Error::Overloaded`] when it refuses at a bound.
pub fn connect(
    config: &Handshake<'_>,
    peer: &PeerAddr,
    purpose: Purpose,
) -> Result<(Channel, Bind)> {
    let failures = config.integrity_failures;
    let shown = peer.addr;
    let expected = config.members.key_of(peer.node_id).ok_or_else(|| {
        Error::PeerUnavailable(format!(
            "no key is known here for node {} (not in the peer list or etcd, or revoked): it \
             cannot be authenticated",
            peer.node_id
        ))
    })?;
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
    let (proof, session) = me
        .respond(&Challenge::decode(&c))
        .map_err(|e| Error::PeerUnavailable(format!("{shown}: {e}")))?;
    let (mut seal, mut unseal) = session.key.split(Role::Initiator);
    s.write_all(&proof.0)
        .map_err(|e| io(&format!("handshake with {shown}"), e))?;
    let mut ours = signed_bind(config, &session, Role::Initiator, purpose, peer.node_id);
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
        return Err(refused_bind(shown, config.node_id, peer.node_id, &r));
    }
    let theirs = Bind::decode(&b).map_err(|e| Error::PeerUnavailable(e.to_string()))?;
    if theirs.node_id != peer.node_id || theirs.to_node != config.node_id {
        return Err(Error::PeerUnavailable(format!(
            "{shown} is node {} (speaking to node {}), not node {} as expected",
            theirs.node_id, theirs.to_node, peer.node_id
        )));
    }
    if !proves(&expected, Role::Responder, &session, &b) {
        return Err(Error::PeerUnavailable(format!(
            "{shown} does not prove it is node {}: its bind's signature does not verify \
             against that node's key",
            peer.node_id
        )));
    }
    if theirs.purpose != purpose {
        return Err(Error::PeerUnavailable(format!(
            "{shown} took the connection for another purpose"
        )));
    }
    set_user_timeout(&s, config, purpose).map_err(|e| io("socket options", e))?;
    let macs = config.payload_mac || theirs.payload_mac;
    Ok((
        channel_of(s, (seal, unseal), &session, macs, None, failures),
        theirs,
    ))
}

/// Why the initiator's bind in `b` does not prove who it claims to be, if it does not.
fn identity_refusal(
    config: &Handshake<'_>,
    session: &Session,
    theirs: &Bind,
    b: &[u8; Bind::WIRE_BYTES],
) -> Option<RefusalReason> {
    if theirs.to_node != config.node_id {
        return Some(RefusalReason::NotAddressedHere);
    }
    match config.members.key_of(theirs.node_id) {
        None => Some(RefusalReason::UnknownNode),
        Some(key) if !proves(&key, Role::Initiator, session, b) => {
            Some(RefusalReason::BadSignature)
        }
        Some(_) => None,
    }
}

/// The responder's side of one connection, all of it by `deadline`, within the per-peer
/// bounds of `peers`; the initiator's introduction with it.
///
/// # Errors
/// [`Error::InvalidArgument`] for a peer without the secret, a malformed frame, or a bind
/// whose identity is not proven (refused with its reason); [`Error::Overloaded`] past the
/// per-peer bound; [`Error::PeerUnavailable`] when the connection fails or the deadline
/// passes.
pub fn accept_one(
    config: &Handshake<'_>,
    peers: &Admission<PeerPurpose>,
    mut s: TcpStream,
    deadline: Instant,
) -> Result<(Channel, Bind)> {
    let failures = config.integrity_failures;
    tune(&s, config).map_err(|e| io("socket options", e))?;
    let mut h = [0u8; Hello::WIRE_BYTES];
    read_by(&mut s, &mut h, deadline).map_err(|e| io("handshake", e))?;
    let (me, challenge) = Responder::answer(config.secret, &Hello::decode(&h)?)?;
    s.write_all(&challenge.encode())
        .map_err(|e| io("handshake", e))?;
    let mut p = [0u8; 32];
    read_by(&mut s, &mut p, deadline).map_err(|e| io("handshake", e))?;
    let session = me.verify(&Proof(p))?;
    let (mut seal, mut unseal) = session.key.split(Role::Responder);
    let mut b = [0u8; Bind::WIRE_BYTES];
    read_by(&mut s, &mut b, deadline).map_err(|e| io("bind", e))?;
    s.set_read_timeout(Some(config.connect_timeout))
        .map_err(|e| io("socket options", e))?;
    unseal.open(&b).inspect_err(|_| {
        failures.fetch_add(1, Ordering::Relaxed);
    })?;
    let theirs = Bind::decode(&b)?;
    let refuse_with = |reason: RefusalReason, limit: usize, seal: &mut Sealer| {
        let mut answer = Refusal {
            purpose: theirs.purpose,
            reason,
            limit: u32::try_from(limit).unwrap_or(u32::MAX),
            retry_after_ms: REFUSAL_RETRY_MS as u32,
        }
        .encode();
        seal.seal(&mut answer);
        answer
    };
    if let Some(reason) = identity_refusal(config, &session, &theirs, &b) {
        config.identity_refusals.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            claimed_node = theirs.node_id,
            from = %s.peer_addr().map_or_else(|_| "?".to_string(), |a| a.to_string()),
            ?reason,
            "refused a data-port connection that holds the cluster secret but did not prove \
             the node it claims (a revoked node, a wrong key file, or an insider)"
        );
        let answer = refuse_with(reason, 0, &mut seal);
        let _ = s.write_all(&answer);
        return Err(Error::InvalidArgument(format!(
            "a bind claiming node {} was refused: {reason:?}",
            theirs.node_id
        )));
    }
    let place = peers.admit(PeerPurpose {
        node: theirs.node_id,
        purpose: theirs.purpose,
    });
    let mut answer = match &place {
        Ok(_) => signed_bind(
            config,
            &session,
            Role::Responder,
            theirs.purpose,
            theirs.node_id,
        ),
        Err(_) => refuse_with(
            RefusalReason::PerPeerBound,
            config.max_connections_per_peer,
            &mut seal,
        ),
    };
    if place.is_ok() {
        seal.seal(&mut answer);
    }
    s.write_all(&answer).map_err(|e| io("bind", e))?;
    let place = place.map_err(|bound| Error::Overloaded {
        what: format!("a peer's connections: {bound}"),
        retry_after_ms: REFUSAL_RETRY_MS,
    })?;
    set_user_timeout(&s, config, theirs.purpose).map_err(|e| io("socket options", e))?;
    let macs = config.payload_mac || theirs.payload_mac;
    let channel = channel_of(s, (seal, unseal), &session, macs, Some(place), failures);
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

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::link::testing;
    use crate::tcp::TcpTransport;

    fn secret() -> ClusterSecret {
        ClusterSecret::from_bytes(&[4; 32]).unwrap()
    }

    /// Node 2 (members 1, 2, 3), whose control handler notes every connection it is given.
    fn responder() -> (TcpTransport, Arc<Mutex<Vec<Bind>>>) {
        let b = TcpTransport::start(testing::tcp_config(2, 1, secret(), &[1, 2, 3])).unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        b.set_control_handler(Arc::new(move |_, bind| s.lock().unwrap().push(bind)));
        (b, seen)
    }

    /// An insider's bind by hand to `to`, claiming `claims`, addressed to `to_node`, signed
    /// by `sign`; the responder's refusal, if any.
    fn insider_bind(
        to: &TcpTransport,
        claims: u64,
        to_node: u64,
        sign: impl FnOnce(&Session, &[u8]) -> [u8; 64],
    ) -> Option<Refusal> {
        let frame = testing::claim(claims, to_node, 1, sign);
        testing::bind_by_hand(&secret(), to.local_addr(), frame).unwrap()
    }

    fn reason(r: Option<Refusal>) -> Option<RefusalReason> {
        r.map(|r| r.reason)
    }

    #[test]
    fn a_bind_signed_with_the_claimed_nodes_key_is_taken() {
        let (b, seen) = responder();
        let key = testing::node_key(1);
        let r = insider_bind(&b, 1, 2, |s, body| {
            key.sign_bind(Role::Initiator, &s.transcript, body)
        });
        assert_eq!(reason(r), None);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(seen.lock().unwrap().len(), 1);
        assert_eq!(b.stats().identity_refusals, 0);
    }

    #[test]
    fn an_insider_posing_as_another_node_is_refused_before_any_handler_sees_it() {
        let (b, seen) = responder();
        // node 3's key, node 1's id: the secret is not enough
        let k3 = testing::node_key(3);
        let r = insider_bind(&b, 1, 2, |s, body| {
            k3.sign_bind(Role::Initiator, &s.transcript, body)
        });
        assert_eq!(reason(r), Some(RefusalReason::BadSignature));
        // no signature at all
        assert_eq!(
            reason(insider_bind(&b, 1, 2, |_, _| [0; 64])),
            Some(RefusalReason::BadSignature)
        );
        // node 1's genuine signature, seen on the wire on an earlier connection: replayed
        // into a new one, it covers the old transcript and proves nothing
        let k1 = testing::node_key(1);
        let old = Mutex::new(None);
        insider_bind(&b, 1, 2, |s, body| {
            let sig = k1.sign_bind(Role::Initiator, &s.transcript, body);
            *old.lock().unwrap() = Some(sig);
            sig
        });
        let captured = old.lock().unwrap().unwrap();
        assert_eq!(
            reason(insider_bind(&b, 1, 2, |_, _| captured)),
            Some(RefusalReason::BadSignature)
        );
        // node 1's signature as a responder would make it (reflection)
        let r = insider_bind(&b, 1, 2, |s, body| {
            k1.sign_bind(Role::Responder, &s.transcript, body)
        });
        assert_eq!(reason(r), Some(RefusalReason::BadSignature));
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            seen.lock().unwrap().len(),
            1,
            "only the genuine bind got through"
        );
        assert_eq!(b.stats().identity_refusals, 4);
    }

    #[test]
    fn a_node_without_a_key_here_or_a_bind_for_another_node_is_refused() {
        let (b, seen) = responder();
        let k4 = testing::node_key(4);
        let r = insider_bind(&b, 4, 2, |s, body| {
            k4.sign_bind(Role::Initiator, &s.transcript, body)
        });
        assert_eq!(reason(r), Some(RefusalReason::UnknownNode));
        // node 1's own valid signature, but on a bind addressed to node 3: relayed here by an
        // insider who was node 1's peer, it is refused
        let k1 = testing::node_key(1);
        let r = insider_bind(&b, 1, 3, |s, body| {
            k1.sign_bind(Role::Initiator, &s.transcript, body)
        });
        assert_eq!(reason(r), Some(RefusalReason::NotAddressedHere));
        std::thread::sleep(Duration::from_millis(50));
        assert!(seen.lock().unwrap().is_empty());
        assert_eq!(b.stats().identity_refusals, 2);
    }

    #[test]
    fn an_initiator_refuses_a_responder_that_cannot_prove_the_node_it_expected() {
        let (b, _) = responder();
        // node 1 believes node 2's key is node 7's: node 2's signature does not verify
        let mut c = testing::tcp_config(1, 1, secret(), &[1, 3]);
        c.members = crate::link::members::Members::of([(
            2,
            crate::link::members::Member {
                key: testing::public_key(7),
                addr: None,
            },
        )]);
        let a = TcpTransport::start(c).unwrap();
        let peer = PeerAddr {
            addr: b.local_addr(),
            node_id: 2,
        };
        let e = a.open_control(&peer).unwrap_err();
        assert!(e.to_string().contains("does not prove it is node 2"), "{e}");
        // and a node it has no key for is not even connected to
        let none = TcpTransport::start(testing::tcp_config(1, 1, secret(), &[1])).unwrap();
        let e = none.open_control(&peer).unwrap_err();
        assert!(
            e.to_string().contains("no key is known here for node 2"),
            "{e}"
        );
        assert_eq!(b.stats().handshakes_refused, 0, "it never knocked");
    }
}
