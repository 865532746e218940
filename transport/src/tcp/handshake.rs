//! Opening and accepting connections: connect, authenticate both ways over the cluster secret
//! ([`crate::auth`]), exchange [`Bind`]s, and set the socket options the ring relies on. All
//! of it blocking with timeouts, in the caller's thread (opening) or a bounded handshake thread
//! (accepting): setup may block; the data path never does.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::wire::{Bind, Purpose};
use super::{Command, Shared, TcpConfig, TcpPeer};
use crate::auth::{Challenge, Hello, Initiator, Proof, Responder};
use crate::error::{Error, Result};

fn io(what: &str, e: std::io::Error) -> Error {
    Error::PeerUnavailable(format!("{what}: {e}"))
}

/// Options every data connection gets: no Nagle (headers go at once), keep-alive probes and a
/// user timeout at the stall timeout (so the kernel itself gives up on a peer that stopped
/// acknowledging), and a bounded wait for the handshake.
fn tune(s: &TcpStream, config: &TcpConfig) -> std::io::Result<()> {
    use rustix::net::sockopt;
    s.set_nodelay(true)?;
    sockopt::set_socket_keepalive(s, true)?;
    sockopt::set_tcp_keepidle(s, Duration::from_secs(5))?;
    sockopt::set_tcp_keepintvl(s, Duration::from_secs(1))?;
    sockopt::set_tcp_keepcnt(s, 3)?;
    let user_timeout_ms = config.stall_timeout.as_millis().min(u128::from(u32::MAX)) as u32;
    sockopt::set_tcp_user_timeout(s, user_timeout_ms)?;
    s.set_read_timeout(Some(config.connect_timeout))?;
    s.set_write_timeout(Some(config.connect_timeout))?;
    Ok(())
}

fn bind_of(config: &TcpConfig, generation: u64, purpose: Purpose) -> Bind {
    Bind {
        node_id: config.node_id,
        node_generation: generation,
        purpose,
    }
}

/// Connect one connection for `purpose` to `peer` and authenticate it (the initiator's
/// side); the peer's introduction with it.
pub(super) fn connect(
    config: &TcpConfig,
    generation: u64,
    peer: &TcpPeer,
    purpose: Purpose,
) -> Result<(TcpStream, Bind)> {
    let shown = peer.addr;
    let mut s = TcpStream::connect_timeout(&peer.addr, config.connect_timeout)
        .map_err(|e| io(&format!("connect to {shown}"), e))?;
    tune(&s, config).map_err(|e| io("socket options", e))?;
    let (me, hello) = Initiator::start(&config.secret)?;
    s.write_all(&hello.encode())
        .map_err(|e| io(&format!("handshake with {shown}"), e))?;
    let mut c = [0u8; Challenge::WIRE_BYTES];
    s.read_exact(&mut c).map_err(|e| {
        io(
            &format!("handshake with {shown} (the peer closed it: a wrong cluster secret or too many connections?)"),
            e,
        )
    })?;
    let proof = me
        .respond(&Challenge::decode(&c))
        .map_err(|e| Error::PeerUnavailable(format!("{shown}: {e}")))?;
    s.write_all(&proof.0)
        .map_err(|e| io(&format!("handshake with {shown}"), e))?;
    s.write_all(&bind_of(config, generation, purpose).encode())
        .map_err(|e| io(&format!("bind with {shown}"), e))?;
    let mut b = [0u8; Bind::WIRE_BYTES];
    s.read_exact(&mut b).map_err(|e| {
        io(
            &format!("bind with {shown} (the peer refused our proof: do both ends hold the same cluster secret?)"),
            e,
        )
    })?;
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
    Ok((s, theirs))
}

/// The responder's side of one connection; the initiator's introduction with it.
fn accept_one(config: &TcpConfig, generation: u64, mut s: TcpStream) -> Result<(TcpStream, Bind)> {
    tune(&s, config).map_err(|e| io("socket options", e))?;
    let mut h = [0u8; Hello::WIRE_BYTES];
    s.read_exact(&mut h).map_err(|e| io("handshake", e))?;
    let (me, challenge) = Responder::answer(&config.secret, &Hello::decode(&h)?)?;
    s.write_all(&challenge.encode())
        .map_err(|e| io("handshake", e))?;
    let mut p = [0u8; 32];
    s.read_exact(&mut p).map_err(|e| io("handshake", e))?;
    me.verify(&Proof(p))?;
    let mut b = [0u8; Bind::WIRE_BYTES];
    s.read_exact(&mut b).map_err(|e| io("bind", e))?;
    let theirs = Bind::decode(&b)?;
    s.write_all(&bind_of(config, generation, theirs.purpose).encode())
        .map_err(|e| io("bind", e))?;
    Ok((s, theirs))
}

/// Accept peers until the engine stops. Each connection gets a handshake thread, at most
/// `max_handshakes` at once, and only `max_target_connections` may be served; past either it
/// is closed at once (counted).
pub(super) fn accept_loop(shared: &Arc<Shared>, listener: &TcpListener) {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    let handshakes = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let tick = Timespec {
        tv_sec: 0,
        tv_nsec: 50_000_000,
    };
    while !shared.stop.load(Ordering::Acquire) {
        let mut fds = [PollFd::new(listener, PollFlags::IN)];
        if poll(&mut fds, Some(&tick)).unwrap_or(0) == 0 {
            continue;
        }
        let Ok((stream, _)) = listener.accept() else {
            continue;
        };
        let busy = handshakes.load(Ordering::Acquire) >= shared.config.max_handshakes
            || shared.target_connections.load(Ordering::Acquire)
                >= shared.config.max_target_connections;
        if busy {
            shared
                .counters
                .handshakes_refused
                .fetch_add(1, Ordering::Relaxed);
            continue;
        }
        handshakes.fetch_add(1, Ordering::AcqRel);
        let (s, h) = (Arc::clone(shared), Arc::clone(&handshakes));
        let spawned = std::thread::Builder::new()
            .name("kvd-tcp-handshake".into())
            .spawn(move || {
                match accept_one(&s.config, s.target.node_generation(), stream) {
                    Ok((stream, bind)) if bind.purpose == Purpose::Data => {
                        s.target_connections.fetch_add(1, Ordering::AcqRel);
                        s.send(Command::Serve { stream });
                    }
                    Ok((stream, bind)) => {
                        let slot = match bind.purpose {
                            Purpose::Rdma => &s.rdma,
                            _ => &s.control,
                        };
                        let handler = slot.lock().unwrap_or_else(|p| p.into_inner()).clone();
                        match handler {
                            Some(h) => h(stream, bind),
                            // nobody takes control connections here: close it
                            None => {
                                s.counters
                                    .handshakes_refused
                                    .fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    Err(_) => {
                        s.counters
                            .handshakes_refused
                            .fetch_add(1, Ordering::Relaxed);
                    }
                }
                h.fetch_sub(1, Ordering::AcqRel);
            });
        if spawned.is_err() {
            handshakes.fetch_sub(1, Ordering::AcqRel);
        }
    }
}
