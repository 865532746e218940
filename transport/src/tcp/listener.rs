//! The TCP engine's listener: the node's data port socket. It admits connections (the bounds
//! of [`crate::admission`], with `member_handshakes` of the slots kept for connections from
//! members' addresses), runs each handshake ([`crate::link::handshake`]) on a bounded thread
//! within one deadline, and hands what it authenticated on by purpose: data connections to the
//! ring, control and RDMA side connections to their handlers.

use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::Shared;
use crate::admission::Admission;
use crate::channel::PeerPurpose;
use crate::link::handshake::{accept_one, refuse};
use crate::link::wire::Purpose;

/// Accept peers until the engine stops. Each connection gets a handshake thread within the
/// bounds of an [`Admission`] and one deadline, and only `max_target_connections` may be served;
/// past a bound it gets a refusal frame and is closed at once (counted).
pub(super) fn accept_loop(shared: &Arc<Shared>, listener: &TcpListener) {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    let admission = Admission::new(
        shared.config.max_handshakes,
        shared.config.max_handshakes_per_source,
    )
    .with_reserve(shared.config.member_handshakes);
    // after authentication: each peer's own share per purpose (the totals are bounded apart)
    let peers: Admission<PeerPurpose> =
        Admission::new(usize::MAX, shared.config.max_connections_per_peer);
    let tick = Timespec {
        tv_sec: 0,
        tv_nsec: 50_000_000,
    };
    while !shared.stop.load(Ordering::Acquire) {
        let mut fds = [PollFd::new(listener, PollFlags::IN)];
        if poll(&mut fds, Some(&tick)).unwrap_or(0) == 0 {
            continue;
        }
        let Ok((stream, from)) = listener.accept() else {
            continue;
        };
        let deadline = Instant::now() + shared.config.connect_timeout;
        let served = shared.target_connections.load(Ordering::Acquire);
        let place = if served >= shared.config.max_target_connections {
            Err(format!(
                "{} connections served",
                shared.config.max_target_connections
            ))
        } else {
            let member = shared.config.members.is_member_addr(from.ip());
            admission
                .admit_as(from.ip(), member)
                .map_err(|bound| format!("handshakes: {bound}"))
        };
        let place = match place {
            Ok(p) => p,
            Err(bound) => {
                shared
                    .counters
                    .handshakes_refused
                    .fetch_add(1, Ordering::Relaxed);
                refuse(stream, &bound);
                continue;
            }
        };
        let s = Arc::clone(shared);
        let peers = peers.clone();
        let _spawned = std::thread::Builder::new()
            .name("kvd-tcp-handshake".into())
            .spawn(move || {
                let _place = place;
                let accepted = accept_one(&s.handshake(), &peers, stream, deadline);
                match accepted {
                    Ok((channel, bind)) if bind.purpose == Purpose::Data => {
                        s.target_connections.fetch_add(1, Ordering::AcqRel);
                        s.serve(channel, bind.peer_node());
                    }
                    Ok((channel, bind)) => {
                        let slot = match bind.purpose {
                            Purpose::Rdma => &s.rdma,
                            _ => &s.control,
                        };
                        let handler = slot.lock().unwrap_or_else(|p| p.into_inner()).clone();
                        match handler {
                            Some(h) => h(channel, bind),
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
            });
    }
}
