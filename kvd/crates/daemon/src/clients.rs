//! Per-client bounds on the Unix socket: no single client process (or user) can take the
//! daemon's whole connection capacity. ("Peers" in this code base are other daemons; the
//! processes on the Unix socket are clients.)
//!
//! The kernel tells the daemon who is on the other end of every accepted connection
//! (`SO_PEERCRED`: pid and uid). Each connection is counted against its process and its uid,
//! first as *pending* (accepted, handshake not done) and then, once its session opens, as a
//! *session*. A connection that would take either count past its bound is refused with a framed,
//! retryable [`Error::Overloaded`] that names the bound, never with a bare reset.
//!
//! ```text
//! accept ── admit_pending(peer) ──▶ pending ── promote() ──▶ session ── drop ──▶ gone
//!               │ over a bound                  │ over a bound
//!               ▼                               ▼
//!        Refused(Overloaded)             Refused(Overloaded)
//! ```
//!
//! The table holds one entry per process and per uid that has a connection open, so its size is
//! bounded by the daemon's connection bound; an entry goes when its last connection does.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::Error;
use crate::store::SessionPeer;

/// The bounds, from the configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ClientLimits {
    /// Connections in their handshake, per process.
    pub pending_per_process: u32,
    /// Connections in their handshake, per uid.
    pub pending_per_uid: u32,
    /// Open sessions, per process.
    pub sessions_per_process: u32,
    /// Open sessions, per uid.
    pub sessions_per_uid: u32,
}

#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    pending: u32,
    sessions: u32,
}

impl Counts {
    fn is_empty(&self) -> bool {
        self.pending == 0 && self.sessions == 0
    }
}

#[derive(Debug, Default)]
struct Table {
    by_pid: HashMap<u32, Counts>,
    by_uid: HashMap<u32, Counts>,
}

/// The per-peer counts and their bounds.
#[derive(Debug)]
pub struct Clients {
    limits: ClientLimits,
    table: Mutex<Table>,
}

/// How soon a refused peer may try again, ms.
const RETRY_AFTER_MS: u64 = 200;

impl Clients {
    /// An empty table with these bounds.
    pub fn new(limits: ClientLimits) -> Arc<Clients> {
        Arc::new(Clients {
            limits,
            table: Mutex::new(Table::default()),
        })
    }

    /// The bounds in force.
    pub fn limits(&self) -> ClientLimits {
        self.limits
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        // The table holds plain counts; a panic elsewhere cannot leave them half-updated.
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Count a freshly accepted connection of `peer` as pending.
    ///
    /// # Errors
    /// [`Error::Overloaded`] when its process or uid has as many handshakes under way as its
    /// bound allows; nothing is counted then.
    pub fn admit_pending(self: &Arc<Self>, peer: SessionPeer) -> Result<ClientSlot, Error> {
        let mut t = self.table();
        let p = t.by_pid.get(&peer.pid).copied().unwrap_or_default();
        let u = t.by_uid.get(&peer.uid).copied().unwrap_or_default();
        let l = self.limits;
        if p.pending >= l.pending_per_process {
            return Err(over(format!(
                "process {} has {} connections in their handshake, the per-process limit \
                 (--max-pending-per-process); finish or close them",
                peer.pid, p.pending
            )));
        }
        if u.pending >= l.pending_per_uid {
            return Err(over(format!(
                "uid {} has {} connections in their handshake, the per-uid limit \
                 (--max-pending-per-uid)",
                peer.uid, u.pending
            )));
        }
        t.by_pid.entry(peer.pid).or_default().pending += 1;
        t.by_uid.entry(peer.uid).or_default().pending += 1;
        Ok(ClientSlot {
            peers: self.clone(),
            peer,
            session: false,
        })
    }

    fn promote(&self, peer: SessionPeer) -> Result<(), Error> {
        let mut t = self.table();
        let p = t.by_pid.get(&peer.pid).copied().unwrap_or_default();
        let u = t.by_uid.get(&peer.uid).copied().unwrap_or_default();
        let l = self.limits;
        if p.sessions >= l.sessions_per_process {
            return Err(over(format!(
                "process {} holds {} sessions, the per-process limit (--max-sessions-per-process); \
                 close idle sessions",
                peer.pid, p.sessions
            )));
        }
        if u.sessions >= l.sessions_per_uid {
            return Err(over(format!(
                "uid {} holds {} sessions, the per-uid limit (--max-sessions-per-uid)",
                peer.uid, u.sessions
            )));
        }
        let Table { by_pid, by_uid } = &mut *t;
        for (map, key) in [(by_pid, peer.pid), (by_uid, peer.uid)] {
            let c = map.get_mut(&key).expect("counted when admitted");
            c.pending -= 1;
            c.sessions += 1;
        }
        Ok(())
    }

    fn release(&self, peer: SessionPeer, session: bool) {
        let mut t = self.table();
        let Table { by_pid, by_uid } = &mut *t;
        for (map, key) in [(by_pid, peer.pid), (by_uid, peer.uid)] {
            let c = map.get_mut(&key).expect("counted when admitted");
            if session {
                c.sessions -= 1;
            } else {
                c.pending -= 1;
            }
            if c.is_empty() {
                map.remove(&key);
            }
        }
    }

    /// (pending, sessions) of a process, for tests and `/status`.
    pub fn of_process(&self, pid: u32) -> (u32, u32) {
        let c = self.table().by_pid.get(&pid).copied().unwrap_or_default();
        (c.pending, c.sessions)
    }

    /// How many processes and uids have a connection open.
    pub fn peers_open(&self) -> (usize, usize) {
        let t = self.table();
        (t.by_pid.len(), t.by_uid.len())
    }
}

fn over(what: String) -> Error {
    Error::Overloaded {
        what,
        retry_after_ms: RETRY_AFTER_MS,
    }
}

/// One connection's place in the counts; given back when dropped.
#[derive(Debug)]
pub struct ClientSlot {
    peers: Arc<Clients>,
    peer: SessionPeer,
    session: bool,
}

impl ClientSlot {
    /// The peer this connection belongs to.
    pub fn peer(&self) -> SessionPeer {
        self.peer
    }

    /// The handshake is done: count the connection as a session instead of pending.
    ///
    /// # Errors
    /// [`Error::Overloaded`] when the process or uid holds as many sessions as its bound allows
    /// (the connection stays counted as pending until it is dropped).
    pub fn promote(&mut self) -> Result<(), Error> {
        debug_assert!(!self.session, "promoted twice");
        self.peers.promote(self.peer)?;
        self.session = true;
        Ok(())
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        self.peers.release(self.peer, self.session);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> ClientLimits {
        ClientLimits {
            pending_per_process: 2,
            pending_per_uid: 3,
            sessions_per_process: 2,
            sessions_per_uid: 3,
        }
    }

    const A: SessionPeer = SessionPeer { pid: 10, uid: 1 };
    const B: SessionPeer = SessionPeer { pid: 11, uid: 1 };
    const C: SessionPeer = SessionPeer { pid: 12, uid: 2 };

    #[test]
    fn one_process_cannot_take_more_than_its_share_and_others_still_get_in() {
        let p = Clients::new(limits());
        let a1 = p.admit_pending(A).unwrap();
        let _a2 = p.admit_pending(A).unwrap();
        let e = p.admit_pending(A).unwrap_err();
        assert!(e.is_retryable(), "{e}");
        assert!(e.to_string().contains("process 10"), "{e}");
        // Another process of the same uid gets the uid's last pending place, a third uid more.
        let _b1 = p.admit_pending(B).unwrap();
        assert!(
            p.admit_pending(B)
                .unwrap_err()
                .to_string()
                .contains("uid 1")
        );
        let _c1 = p.admit_pending(C).unwrap();
        drop(a1);
        assert_eq!(p.of_process(10), (1, 0));
        let _a3 = p.admit_pending(A).unwrap();
    }

    #[test]
    fn sessions_are_bounded_per_process_and_counted_back_when_closed() {
        let p = Clients::new(limits());
        let mut held = Vec::new();
        for _ in 0..2 {
            let mut s = p.admit_pending(A).unwrap();
            s.promote().unwrap();
            held.push(s);
        }
        let mut third = p.admit_pending(A).unwrap();
        let e = third.promote().unwrap_err();
        assert!(e.to_string().contains("holds 2 sessions"), "{e}");
        assert_eq!(p.of_process(10), (1, 2));
        drop(third);
        drop(held);
        assert_eq!(p.of_process(10), (0, 0));
        assert_eq!(p.peers_open(), (0, 0), "no entry outlives its connections");
    }
}
