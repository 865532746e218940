//! The reaper: bounded work per tick.
//!
//! Each tick closes sessions whose lease expired, drops pins whose TTL passed, releases
//! manifests and hand-off holds whose TTL passed, and returns quarantined pages after their hold, at most `budget`
//! items in all; what is left waits for the next tick. `Inner::audit` recounts every slot and
//! checks the accounting invariant (free + each state + quarantined = total).

use crate::error::BlockState;
use crate::state::Inner;
use crate::types::{Accounting, ReapReport};

impl Inner {
    pub fn reap(&mut self, budget: u32) -> ReapReport {
        let now = self.now();
        let mut r = ReapReport::default();
        let mut left = budget;
        while left > 0 {
            let Some(&(t, sid)) = self.sessions.expiry.first() else {
                break;
            };
            if t > now {
                break;
            }
            self.close_session(sid);
            self.counters.sessions_expired += 1;
            r.sessions_expired += 1;
            left -= 1;
        }
        while left > 0 {
            let Some(&(t, sid, i)) = self.pins.expiry.first() else {
                break;
            };
            if t > now {
                break;
            }
            self.pins.expiry.remove(&(t, sid, i));
            if let Some(p) = self
                .sessions
                .by_id
                .get_mut(&sid)
                .and_then(|s| s.pins.remove(&i))
            {
                self.drop_pin_entry(i, p.generation);
            }
            self.counters.pins_expired += 1;
            r.pins_expired += 1;
            left -= 1;
        }
        while left > 0 {
            let Some(&(t, req)) = self.manifests.expiry.first() else {
                break;
            };
            if t > now {
                break;
            }
            self.manifest_release(req);
            self.counters.manifests_expired += 1;
            r.manifests_expired += 1;
            left -= 1;
        }
        let n = self.reap_holds(left);
        r.holds_expired = n;
        left -= n;
        let hold = self.config.quarantine_hold_ms;
        let mut rounds = self.quarantine.len();
        while left > 0 && rounds > 0 {
            rounds -= 1;
            let Some(i) = self.quarantine.pop_front() else {
                break;
            };
            let s = &self.slots[i as usize];
            if s.quarantined_at_ms + hold <= now && s.pins == 0 && s.in_use == 0 {
                self.free_slot(i);
                r.quarantine_released += 1;
                left -= 1;
            } else {
                self.quarantine.push_back(i);
            }
        }
        r.budget_exhausted = left == 0;
        r.accounting_balanced =
            self.counts.balanced() && self.counts.free == self.pool.free_pages();
        if !r.accounting_balanced {
            tracing::error!(counts = ?self.counts, free_list = self.pool.free_pages(), "pool accounting does not balance");
        }
        r
    }

    /// Recount every slot. Returns the recount and whether it matches the running counts and the
    /// pool's free list, and adds up to the total.
    pub fn audit(&self) -> (Accounting, bool) {
        let mut a = Accounting {
            total: self.counts.total,
            ..Accounting::default()
        };
        for s in &self.slots {
            match s.state {
                None => a.free += 1,
                Some(st) => *a.slot_count(st) += 1,
            }
        }
        let ok = a == self.counts && a.free == self.pool.free_pages() && a.balanced();
        (a, ok)
    }

    /// Check every structural invariant (for tests and the periodic sweep): accounting, index
    /// points only at live blocks, LRU holds exactly the unpinned published cache blocks, pin
    /// counts match the sessions' pins.
    pub fn check_invariants(&self) -> Result<(), String> {
        let (a, ok) = self.audit();
        if !ok {
            return Err(format!(
                "accounting off: recount {a:?}, running {:?}",
                self.counts
            ));
        }
        for (k, &i) in &self.index {
            let s = &self.slots[i as usize];
            if s.key != *k || s.state.is_none() {
                return Err(format!(
                    "index entry {k} points at a free or foreign slot {i}"
                ));
            }
            if matches!(s.state, Some(BlockState::Retired | BlockState::Quarantined)) {
                return Err(format!("index entry {k} points at a {:?} block", s.state));
            }
        }
        let mut pins = vec![0u32; self.slots.len()];
        for sess in self.sessions.by_id.values() {
            for (&i, p) in &sess.pins {
                if self.slots[i as usize].generation != p.generation {
                    return Err(format!("a pin on slot {i} outlived its block"));
                }
                pins[i as usize] += 1;
            }
            for &i in &sess.writing {
                if !matches!(
                    self.slots[i as usize].state,
                    Some(BlockState::Allocated | BlockState::Writing | BlockState::Sealed)
                ) {
                    return Err(format!("session lists slot {i} as writing but it is not"));
                }
            }
        }
        for (i, g) in self.holds.pins() {
            if self.slots[i as usize].generation != g {
                return Err(format!("a hold on slot {i} outlived its block"));
            }
            pins[i as usize] += 1;
        }
        let mut lru = 0;
        for (i, s) in self.slots.iter().enumerate() {
            if s.pins != pins[i] {
                return Err(format!("slot {i} pin count {} != {}", s.pins, pins[i]));
            }
            let evictable = s.state == Some(BlockState::Published)
                && s.class == crate::state::Class::Cache
                && s.pins == 0
                && s.in_use == 0;
            if evictable != s.in_lru && s.in_use == 0 {
                return Err(format!(
                    "slot {i} LRU membership {} but evictable {evictable}",
                    s.in_lru
                ));
            }
            if s.state.is_some()
                && matches!(s.state, Some(BlockState::Retired))
                && s.pins == 0
                && s.in_use == 0
            {
                return Err(format!("slot {i} is RETIRED with no pin: its page leaked"));
            }
            lru += s.in_lru as u32;
        }
        if lru != self.lru.len() {
            return Err(format!(
                "LRU length {} but {lru} slots on it",
                self.lru.len()
            ));
        }
        // Each room's own invariant.
        self.lru.check(&self.slots)?;
        self.sessions.check()?;
        self.manifests.check()?;
        self.holds.check()?;
        self.reservations.check()?;
        self.events.check()?;
        let pinned: u64 = self
            .sessions
            .by_id
            .values()
            .map(|s| s.pins.len() as u64)
            .sum();
        if pinned != self.pins.count || self.pins.expiry.len() as u64 != self.pins.count {
            return Err(format!(
                "{pinned} pins held by sessions, {} deadlines, the count says {}",
                self.pins.expiry.len(),
                self.pins.count
            ));
        }
        if self.reservations.unused_pages > self.pool.free_pages() as u64 {
            return Err("reservations promise more pages than are free".into());
        }
        Ok(())
    }
}
