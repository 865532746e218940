//! Sessions and leases.
//!
//! Every writer and reader acts within a session that holds a heartbeat lease. The session owns
//! its unfinished blocks (ALLOCATED, WRITING, SEALED), its pins and its reservations; when it
//! closes or its lease expires, all of them are released (invariant 4, docs/ARCHITECTURE.md). An operation on
//! an expired session releases it at once and fails with [`Error::LeaseExpired`]; the reaper
//! catches the sessions nobody touches.

use std::collections::{BTreeSet, HashMap, HashSet};

use crate::error::BlockState;
use crate::state::{Class, Inner, ReservationOwner};
use crate::types::{ReservationId, SessionCleanup, SessionId, SessionPeer};
use crate::{Error, Result};

/// One pin of one block by one session.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Pin {
    pub generation: u64,
    /// Times pinned (each acquire adds one, each release takes one).
    pub count: u32,
    pub expires_at_ms: u64,
}

#[derive(Debug)]
pub(crate) struct Session {
    pub name: String,
    pub lease_ttl_ms: u64,
    pub expires_at_ms: u64,
    /// Slots this session is writing (ALLOCATED, WRITING, SEALED).
    pub writing: HashSet<u32>,
    pub pins: HashMap<u32, Pin>,
    pub reservations: HashSet<ReservationId>,
    pub peer: Option<SessionPeer>,
    pub opened_at_ms: u64,
    /// The last operation on the session (store clock).
    pub active_at_ms: u64,
}

/// The sessions room: every open session, and their lease deadlines in expiry order.
///
/// Invariant ([`Sessions::check`]): `expiry` holds exactly one `(expires_at_ms, id)` per open
/// session, matching the session's own deadline; ids are never reused within an incarnation.
#[derive(Debug)]
pub(crate) struct Sessions {
    pub by_id: HashMap<SessionId, Session>,
    pub expiry: BTreeSet<(u64, SessionId)>,
    next: u64,
}

impl Default for Sessions {
    fn default() -> Sessions {
        Sessions {
            by_id: HashMap::new(),
            expiry: BTreeSet::new(),
            next: 1,
        }
    }
}

impl Sessions {
    fn next_id(&mut self) -> SessionId {
        let id = SessionId(self.next);
        self.next += 1;
        id
    }

    /// The room's invariant.
    pub fn check(&self) -> Result<(), String> {
        if self.expiry.len() != self.by_id.len() {
            return Err(format!(
                "{} session deadlines for {} sessions",
                self.expiry.len(),
                self.by_id.len()
            ));
        }
        for (id, s) in &self.by_id {
            if !self.expiry.contains(&(s.expires_at_ms, *id)) {
                return Err(format!("session {} has no deadline entry", id.0));
            }
        }
        Ok(())
    }
}

impl Inner {
    pub fn open_session(
        &mut self,
        name: &str,
        lease_ttl_ms: u64,
        peer: Option<SessionPeer>,
    ) -> Result<SessionId> {
        let c = &self.config;
        if lease_ttl_ms < c.min_lease_ttl_ms || lease_ttl_ms > c.max_lease_ttl_ms {
            return Err(Error::InvalidArgument(format!(
                "lease TTL {lease_ttl_ms} ms outside {}..={} ms",
                c.min_lease_ttl_ms, c.max_lease_ttl_ms
            )));
        }
        if name.len() > 128 {
            return Err(Error::InvalidArgument(
                "session name longer than 128 bytes".into(),
            ));
        }
        if self.sessions.by_id.len() >= c.max_sessions as usize {
            self.counters.overload_rejects += 1;
            return Err(Error::Overloaded {
                what: format!("{} sessions open (the limit)", c.max_sessions),
                retry_after_ms: 100,
            });
        }
        let id = self.sessions.next_id();
        let now = self.now();
        let expires_at_ms = now + lease_ttl_ms;
        self.sessions.by_id.insert(
            id,
            Session {
                name: name.to_owned(),
                lease_ttl_ms,
                expires_at_ms,
                writing: HashSet::new(),
                pins: HashMap::new(),
                reservations: HashSet::new(),
                peer,
                opened_at_ms: now,
                active_at_ms: now,
            },
        );
        self.sessions.expiry.insert((expires_at_ms, id));
        Ok(id)
    }

    /// Check that a session exists and its lease holds; release it if the lease has expired.
    pub fn live_session(&mut self, sid: SessionId) -> Result<&mut Session> {
        let now = self.now();
        let expired = match self.sessions.by_id.get(&sid) {
            // Sessions are only ever named by the daemon on behalf of their own connection, so
            // an unknown one was released (its lease ran out and the reaper took it, or a drain
            // closed it): say so, in the error that tells the client to open a new session.
            None => {
                return Err(Error::LeaseExpired(format!(
                    "session {} is closed (its lease ran out or the daemon released it); its \
                     blocks were aborted and pins dropped",
                    sid.0
                )));
            }
            Some(s) => s.expires_at_ms <= now,
        };
        if expired {
            self.counters.sessions_expired += 1;
            self.close_session(sid);
            return Err(Error::LeaseExpired(format!(
                "session {}'s lease expired; its blocks were aborted and pins dropped",
                sid.0
            )));
        }
        let s = self.sessions.by_id.get_mut(&sid).expect("checked above");
        s.active_at_ms = now;
        Ok(s)
    }

    pub fn heartbeat(&mut self, sid: SessionId) -> Result<u64> {
        let now = self.now();
        let s = self.live_session(sid)?;
        let old = s.expires_at_ms;
        s.expires_at_ms = now + s.lease_ttl_ms;
        let new = s.expires_at_ms;
        self.sessions.expiry.remove(&(old, sid));
        self.sessions.expiry.insert((new, sid));
        Ok(new)
    }

    /// Release everything a session holds and forget it. Idempotent.
    pub fn close_session(&mut self, sid: SessionId) -> SessionCleanup {
        // a rank's end fails its instance (and aborts its open steps on every rank) first,
        // while the session still owns its blocks
        if self.sessions.by_id.contains_key(&sid) {
            self.instance_session_ended(sid, "ended (closed, or its lease expired)");
        }
        let Some(s) = self.sessions.by_id.remove(&sid) else {
            return SessionCleanup::default();
        };
        self.sessions.expiry.remove(&(s.expires_at_ms, sid));
        let mut out = SessionCleanup::default();
        let mut writing: Vec<u32> = s.writing.into_iter().collect();
        writing.sort_unstable();
        for i in writing {
            self.abort_slot(i);
            out.blocks_aborted += 1;
        }
        let mut pins: Vec<(u32, crate::sessions::Pin)> = s.pins.into_iter().collect();
        pins.sort_unstable_by_key(|(i, _)| *i);
        for (i, pin) in pins {
            self.pins.expiry.remove(&(pin.expires_at_ms, sid, i));
            self.drop_pin_entry(i, pin.generation);
            out.pins_dropped += 1;
        }
        let mut reservations: Vec<ReservationId> = s.reservations.into_iter().collect();
        reservations.sort_unstable();
        for r in reservations {
            self.release_reservation(r);
            out.reservations_released += 1;
        }
        out
    }

    /// Abort an unfinished block: unlink it, give its page back to its reservation, and free it
    /// (or retire it while a copy into it is still running).
    pub fn abort_slot(&mut self, i: u32) {
        let state = self.state_of(i);
        debug_assert!(matches!(
            state,
            BlockState::Allocated | BlockState::Writing | BlockState::Sealed
        ));
        let (owner, reservation) = {
            let s = &mut self.slots[i as usize];
            (s.owner.take(), s.reservation.take())
        };
        if let Some(owner) = owner
            && let Some(sess) = self.sessions.by_id.get_mut(&owner)
        {
            sess.writing.remove(&i);
        }
        if let Some(r) = reservation
            && let Some(res) = self.reservations.by_id.get_mut(&r)
        {
            res.pages_used -= 1;
            self.reservations.unused_pages += 1;
        }
        self.counters.blocks_aborted += 1;
        self.retire_or_free(i);
    }

    /// Drop one session's pin entry on a slot (the session's map is updated by the caller).
    pub fn drop_pin_entry(&mut self, i: u32, generation: u64) {
        let s = &mut self.slots[i as usize];
        if s.generation != generation || s.state.is_none() {
            return; // cannot happen: a pinned slot is never freed; kept defensive
        }
        debug_assert!(s.pins > 0);
        s.pins -= 1;
        self.pins.count -= 1;
        self.settle(i);
    }

    /// Open a session-owned reservation of `bytes`.
    pub fn reserve_for_session(&mut self, sid: SessionId, bytes: u64) -> Result<ReservationId> {
        self.live_session(sid)?;
        let r = self.reserve(bytes, ReservationOwner::Session(sid))?;
        self.sessions
            .by_id
            .get_mut(&sid)
            .expect("live")
            .reservations
            .insert(r);
        Ok(r)
    }

    /// Whether `sid` may write slot `i` (it allocated it and it is unfinished).
    pub fn owned_unfinished(&self, sid: SessionId, i: u32) -> Result<()> {
        let s = &self.slots[i as usize];
        if s.owner != Some(sid) {
            return match s.state {
                Some(
                    st @ (BlockState::Published | BlockState::Retired | BlockState::Quarantined),
                ) => Err(Error::IllegalTransition {
                    from: st,
                    op: "write to",
                }),
                _ => Err(Error::InvalidArgument(format!(
                    "block in slot {i} belongs to another session"
                ))),
            };
        }
        Ok(())
    }

    pub fn class_of(&self, i: u32) -> Class {
        self.slots[i as usize].class
    }
}
