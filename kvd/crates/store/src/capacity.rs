//! Capacity: reservations and eviction.
//!
//! A request that will write reserves its footprint up front; the pages it reserved stay free
//! for it, and nobody else's allocation may dig into them. Unreserved allocations take free
//! pages beyond the reservations, evicting the least recently used unpinned PUBLISHED cache
//! blocks when needed. Checkpoint blocks are never evicted. When even eviction cannot make room,
//! the call fails at once with a retryable [`Error::NoSpace`] that says how much is free.

use std::collections::HashMap;

use crate::state::{Inner, Reservation, ReservationOwner};
use crate::types::{ReservationId, SessionId};
use crate::{Error, Result};

/// The reservations room: each reservation, and how many pages they hold back in all.
///
/// Invariant ([`Reservations::check`]): `unused_pages` is the sum over reservations of the pages
/// reserved and not yet drawn; ids are never reused within an incarnation.
#[derive(Debug)]
pub(crate) struct Reservations {
    pub by_id: HashMap<ReservationId, Reservation>,
    pub unused_pages: u64,
    next: u64,
}

impl Default for Reservations {
    fn default() -> Reservations {
        Reservations {
            by_id: HashMap::new(),
            unused_pages: 0,
            next: 1,
        }
    }
}

impl Reservations {
    fn next_id(&mut self) -> ReservationId {
        let id = ReservationId(self.next);
        self.next += 1;
        id
    }

    /// The room's invariant.
    pub fn check(&self) -> Result<(), String> {
        let sum: u64 = self
            .by_id
            .values()
            .map(|r| r.pages_total - r.pages_used)
            .sum();
        if sum != self.unused_pages {
            return Err(format!(
                "reservations hold back {sum} unused pages, the count says {}",
                self.unused_pages
            ));
        }
        Ok(())
    }
}

impl Inner {
    /// Pages free and not promised to a reservation.
    pub fn unreserved_free(&self) -> u64 {
        (self.pool.free_pages() as u64).saturating_sub(self.reservations.unused_pages)
    }

    fn pages_for(&self, bytes: u64) -> u64 {
        bytes.div_ceil(self.page_size())
    }

    fn no_space(&mut self, pages: u64) -> Error {
        self.counters.no_space_rejects += 1;
        Error::NoSpace {
            requested_bytes: pages * self.page_size(),
            free_bytes: (self.unreserved_free() + u64::from(self.lru.len())) * self.page_size(),
        }
    }

    /// Make `pages` unreserved free pages available, evicting LRU cache blocks if that is enough.
    /// Evicts nothing if it would not be enough.
    pub fn ensure_unreserved(&mut self, pages: u64) -> Result<()> {
        let have = self.unreserved_free();
        if have >= pages {
            return Ok(());
        }
        if have + u64::from(self.lru.len()) < pages {
            return Err(self.no_space(pages));
        }
        // Bounded: each step either takes one block off the LRU (which has at least `pages -
        // have`), or passes over a soft-pinned block, moving it to the front, at most once per
        // block on the list: once every block was passed over, soft pins give way.
        let now = self.clock.now_ms();
        let mut passed = 0u32;
        while self.unreserved_free() < pages {
            let Some(victim) = self.lru_oldest() else {
                return Err(self.no_space(pages));
            };
            let soft = self.slots[victim as usize].soft_until_ms > now;
            if soft && passed < self.lru.len() {
                passed += 1;
                self.lru_touch(victim);
                continue;
            }
            if soft {
                self.counters.soft_pins_given_way += 1;
            }
            self.counters.evictions += 1;
            self.retire_or_free(victim);
        }
        Ok(())
    }

    /// Reserve `bytes` (rounded up to whole pages).
    pub fn reserve(&mut self, bytes: u64, owner: ReservationOwner) -> Result<ReservationId> {
        if bytes == 0 {
            return Err(Error::InvalidArgument(
                "a reservation needs > 0 bytes".into(),
            ));
        }
        if self.reservations.by_id.len() >= self.config.max_reservations as usize {
            self.counters.overload_rejects += 1;
            return Err(Error::Overloaded {
                what: format!(
                    "{} reservations open (the limit)",
                    self.config.max_reservations
                ),
                retry_after_ms: 100,
            });
        }
        let pages = self.pages_for(bytes);
        self.ensure_unreserved(pages)?;
        let id = self.reservations.next_id();
        self.reservations.by_id.insert(
            id,
            Reservation {
                pages_total: pages,
                pages_used: 0,
                owner,
            },
        );
        self.reservations.unused_pages += pages;
        Ok(id)
    }

    /// Give a reservation's unused pages back. Idempotent.
    pub fn release_reservation(&mut self, id: ReservationId) {
        if let Some(r) = self.reservations.by_id.remove(&id) {
            self.reservations.unused_pages -= r.pages_total - r.pages_used;
            if let ReservationOwner::Session(sid) = r.owner
                && let Some(s) = self.sessions.by_id.get_mut(&sid)
            {
                s.reservations.remove(&id);
            }
        }
    }

    /// Give back a reservation `sid` made. Only its owner may: a reservation id is a number a
    /// client holds, and another session's (or an earlier incarnation's) number must not free
    /// space that someone else counts on. Releasing one twice is a no-op.
    ///
    /// # Errors
    /// [`Error::NotFound`] when the reservation exists but belongs to another session or to a
    /// checkpoint manifest (end the manifest instead).
    pub fn release_session_reservation(&mut self, sid: SessionId, id: ReservationId) -> Result<()> {
        match self.reservations.by_id.get(&id) {
            None => Ok(()),
            Some(r) if r.owner == ReservationOwner::Session(sid) => {
                self.release_reservation(id);
                Ok(())
            }
            Some(_) => Err(Error::NotFound(format!(
                "reservation {} is not this session's",
                id.0
            ))),
        }
    }

    /// Check that `sid` may allocate from reservation `id`: its own, or the manifest's of the
    /// checkpoint it writes (`request`).
    pub fn check_reservation_owner(
        &self,
        sid: SessionId,
        id: ReservationId,
        request: Option<crate::types::RequestId>,
    ) -> Result<()> {
        let r = self
            .reservations
            .by_id
            .get(&id)
            .ok_or_else(|| Error::NotFound(format!("reservation {}", id.0)))?;
        let ok = match r.owner {
            ReservationOwner::Session(owner) => owner == sid,
            ReservationOwner::Manifest(req) => Some(req) == request,
        };
        if ok {
            Ok(())
        } else {
            Err(Error::NotFound(format!(
                "reservation {} is not this session's",
                id.0
            )))
        }
    }

    /// Plan `n` pages for an allocation: how many come from `reservation` (the rest from
    /// unreserved space, made available now). Changes nothing but eviction on failure-free paths.
    pub fn plan_pages(&mut self, n: u64, reservation: Option<ReservationId>) -> Result<u64> {
        let from_reservation = match reservation {
            None => 0,
            Some(r) => {
                let res = self
                    .reservations
                    .by_id
                    .get(&r)
                    .ok_or_else(|| Error::NotFound(format!("reservation {}", r.0)))?;
                n.min(res.pages_total - res.pages_used)
            }
        };
        self.ensure_unreserved(n - from_reservation)?;
        Ok(from_reservation)
    }

    /// Record that one page of `r` was used.
    pub fn draw_reservation(&mut self, r: ReservationId) {
        let res = self.reservations.by_id.get_mut(&r).expect("planned");
        res.pages_used += 1;
        debug_assert!(res.pages_used <= res.pages_total);
        self.reservations.unused_pages -= 1;
    }
}
