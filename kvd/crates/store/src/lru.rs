//! The eviction list: PUBLISHED, unpinned cache blocks, most recently used first.
//!
//! An intrusive doubly-linked list threaded through the slots' `lru_prev`/`lru_next`, so every
//! operation is O(1) and allocates nothing. The list's own fields are its head, tail and length;
//! its invariant ([`Lru::check`]): walking from the head reaches exactly `len` slots, each marked
//! `in_lru`, each linked back to its predecessor, ending at the tail.

use crate::state::{NIL, Slot};

/// The list's ends and length.
#[derive(Debug)]
pub(crate) struct Lru {
    head: u32,
    tail: u32,
    len: u32,
}

impl Default for Lru {
    fn default() -> Lru {
        Lru {
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }
}

impl Lru {
    /// Blocks on the list.
    pub fn len(&self) -> u32 {
        self.len
    }

    /// The most recently used block, `NIL` when empty.
    pub fn head(&self) -> u32 {
        self.head
    }

    /// Put slot `i` (not on the list) at the front.
    pub fn push_front(&mut self, slots: &mut [Slot], i: u32) {
        debug_assert!(!slots[i as usize].in_lru);
        let old = self.head;
        {
            let s = &mut slots[i as usize];
            s.lru_prev = NIL;
            s.lru_next = old;
            s.in_lru = true;
        }
        if old != NIL {
            slots[old as usize].lru_prev = i;
        } else {
            self.tail = i;
        }
        self.head = i;
        self.len += 1;
    }

    /// Take slot `i` off the list (nothing if it is not on it).
    pub fn remove(&mut self, slots: &mut [Slot], i: u32) {
        if !slots[i as usize].in_lru {
            return;
        }
        let (prev, next) = {
            let s = &mut slots[i as usize];
            s.in_lru = false;
            (s.lru_prev, s.lru_next)
        };
        if prev != NIL {
            slots[prev as usize].lru_next = next;
        } else {
            self.head = next;
        }
        if next != NIL {
            slots[next as usize].lru_prev = prev;
        } else {
            self.tail = prev;
        }
        debug_assert!(self.len > 0, "removing from an empty list");
        self.len -= 1;
    }

    /// Mark slot `i` as just used (moves it to the front if it is on the list).
    pub fn touch(&mut self, slots: &mut [Slot], i: u32) {
        if slots[i as usize].in_lru && self.head != i {
            self.remove(slots, i);
            self.push_front(slots, i);
        }
    }

    /// The least recently used block.
    pub fn oldest(&self) -> Option<u32> {
        (self.tail != NIL).then_some(self.tail)
    }

    /// The list's invariant (a walk of at most `len + 1` steps).
    pub fn check(&self, slots: &[Slot]) -> Result<(), String> {
        let mut prev = NIL;
        let mut i = self.head;
        let mut n = 0u32;
        while i != NIL {
            if n > self.len {
                return Err(format!(
                    "the LRU list is longer than its length {}",
                    self.len
                ));
            }
            let s = &slots[i as usize];
            if !s.in_lru || s.lru_prev != prev {
                return Err(format!("LRU slot {i} is not linked back to {prev}"));
            }
            prev = i;
            i = s.lru_next;
            n += 1;
        }
        if n != self.len || prev != self.tail {
            return Err(format!(
                "the LRU list walks {n} slots to {prev}, its length is {} and tail {}",
                self.len, self.tail
            ));
        }
        let marked = slots.iter().filter(|s| s.in_lru).count() as u32;
        if marked != self.len {
            return Err(format!(
                "{marked} slots marked in_lru, the list holds {}",
                self.len
            ));
        }
        Ok(())
    }
}
