//! The store's whole state ([`Inner`]): one [`Slot`] per pool page, the key index, the LRU list of evictable blocks,
//! and the per-state page counts. Every state change of a slot goes through [`Inner::set_state`]
//! or [`Inner::free_slot`], which keep the counts exact.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::StoreConfig;
use crate::capacity::Reservations;
use crate::clock::Clock;
use crate::error::BlockState;
use crate::events::EventLog;
use crate::keys::{BlockKey, BlockTag, NamespaceDescriptor, NamespaceId};
use crate::lru::Lru;
use crate::manifest::Manifests;
use crate::pins::PinIndex;
use crate::pool::Pool;
use crate::sessions::Sessions;
use crate::types::{
    Accounting, BlockEventKind, BlockInfo, Counters, Handle, RequestId, ReservationId, SessionId,
};
use crate::{Error, Result};

pub(crate) const NIL: u32 = u32::MAX;

/// Which class a live block belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    Cache,
    Checkpoint { request: RequestId, epoch: u64 },
}

/// One page's metadata.
#[derive(Debug, Clone)]
pub(crate) struct Slot {
    /// The occupant's generation; 0 while free.
    pub generation: u64,
    /// `None` while free.
    pub state: Option<BlockState>,
    pub key: BlockKey,
    pub class: Class,
    /// The writing session, while ALLOCATED/WRITING/SEALED.
    pub owner: Option<SessionId>,
    /// The reservation the page was drawn from, if any.
    pub reservation: Option<ReservationId>,
    /// Valid bytes (the highest written end while WRITING; fixed at SEAL).
    pub len: u64,
    /// CRC-32C recorded at SEAL.
    pub checksum: u32,
    /// Running CRC of bytes `0..covered` while the writer writes sequentially.
    pub running_crc: Option<(u64, u32)>,
    /// Sessions pinning this block.
    pub pins: u32,
    /// Copies into or out of the page in progress outside the lock.
    pub in_use: u32,
    pub lru_prev: u32,
    pub lru_next: u32,
    pub in_lru: bool,
    /// When the block entered quarantine (store clock).
    pub quarantined_at_ms: u64,
    /// A soft pin's deadline (store clock; 0: none): until then eviction passes the block over
    /// while anything else on the LRU can go.
    pub soft_until_ms: u64,
}

impl Slot {
    fn empty() -> Slot {
        Slot {
            generation: 0,
            state: None,
            key: BlockKey {
                namespace: NamespaceId([0; 32]),
                tag: BlockTag([0; 32]),
            },
            class: Class::Cache,
            owner: None,
            reservation: None,
            len: 0,
            checksum: 0,
            running_crc: None,
            pins: 0,
            in_use: 0,
            lru_prev: NIL,
            lru_next: NIL,
            in_lru: false,
            quarantined_at_ms: 0,
            soft_until_ms: 0,
        }
    }
}

/// A space reservation.
#[derive(Debug, Clone)]
pub(crate) struct Reservation {
    pub pages_total: u64,
    pub pages_used: u64,
    pub owner: ReservationOwner,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReservationOwner {
    Session(SessionId),
    Manifest(RequestId),
}

/// Everything behind the store's lock.
#[derive(Debug)]
pub(crate) struct Inner {
    pub config: StoreConfig,
    pub clock: Arc<dyn Clock>,
    pub pool: Pool,
    pub slots: Vec<Slot>,
    pub index: HashMap<BlockKey, u32>,
    pub next_generation: u64,
    pub counts: Accounting,
    /// The evictable blocks, least recently used last ([`Lru`]).
    pub lru: Lru,
    /// The open sessions and their lease deadlines.
    pub sessions: Sessions,
    /// Pin deadlines across sessions.
    pub pins: PinIndex,
    pub namespaces: HashMap<NamespaceId, NamespaceDescriptor>,
    /// Checkpoint manifests, their deadlines, and the recently ended ones.
    pub manifests: Manifests,
    /// Hand-off holds ([`crate::holds`]).
    pub holds: crate::holds::Holds,
    /// Space reservations and the pages they hold back.
    pub reservations: Reservations,
    pub quarantine: VecDeque<u32>,
    pub counters: Counters,
    /// What became visible or invisible, for routers ([`EventLog`]).
    pub events: EventLog,
    /// Engine instances whose ranks publish steps together ([`crate::instances`]).
    pub instances: crate::instances::Instances,
}

impl Inner {
    pub fn new(config: StoreConfig, clock: Arc<dyn Clock>) -> Result<Inner> {
        let pool = Pool::new(config.pool)?;
        let events = EventLog::new(config.event_log_capacity)?;
        let n = config.pool.page_count;
        Ok(Inner {
            counts: Accounting {
                total: n,
                free: n,
                ..Accounting::default()
            },
            slots: vec![Slot::empty(); n as usize],
            index: HashMap::with_capacity(n as usize),
            config,
            clock,
            pool,
            next_generation: 1,
            lru: Lru::default(),
            sessions: Sessions::default(),
            pins: PinIndex::default(),
            namespaces: HashMap::new(),
            manifests: Manifests::default(),
            holds: crate::holds::Holds::default(),
            reservations: Reservations::default(),
            quarantine: VecDeque::new(),
            counters: Counters::default(),
            events,
            instances: crate::instances::Instances::default(),
        })
    }

    pub fn now(&self) -> u64 {
        self.clock.now_ms()
    }

    pub fn page_size(&self) -> u64 {
        self.config.pool.page_size_bytes
    }

    /// The slot a handle names, if both generations match.
    ///
    /// # Errors
    /// [`Error::StaleGeneration`] for another node incarnation, a free slot or a reused slot;
    /// [`Error::InvalidArgument`] for a slot out of range.
    pub fn resolve(&mut self, h: &Handle) -> Result<u32> {
        if h.slot as usize >= self.slots.len() {
            return Err(Error::InvalidArgument(format!(
                "slot {} out of range (pool has {})",
                h.slot,
                self.slots.len()
            )));
        }
        let slot = &self.slots[h.slot as usize];
        if h.node_generation != self.config.node_generation
            || slot.generation != h.generation
            || slot.state.is_none()
        {
            self.counters.stale_generation_rejects += 1;
            return Err(Error::StaleGeneration {
                handle_node: h.node_generation,
                handle_slot: h.generation,
                current_node: self.config.node_generation,
                current_slot: slot.generation,
            });
        }
        Ok(h.slot)
    }

    pub fn handle_of(&self, i: u32) -> Handle {
        Handle {
            node_generation: self.config.node_generation,
            slot: i,
            generation: self.slots[i as usize].generation,
        }
    }

    pub fn info_of(&self, i: u32) -> BlockInfo {
        let s = &self.slots[i as usize];
        // Invariant 1: only PUBLISHED blocks are ever described to a reader.
        assert_eq!(
            s.state,
            Some(BlockState::Published),
            "describing a non-published block"
        );
        BlockInfo {
            key: s.key,
            handle: self.handle_of(i),
            offset: self.pool.page_offset(i),
            len: s.len,
            checksum: s.checksum,
            pin_ttl_ms: 0,
        }
    }

    pub fn state_of(&self, i: u32) -> BlockState {
        self.slots[i as usize].state.expect("state_of a free slot")
    }

    /// Move a live slot to `to`, keeping the counts exact.
    pub fn set_state(&mut self, i: u32, to: BlockState) {
        let from = self.state_of(i);
        *self.counts.slot_count(from) -= 1;
        *self.counts.slot_count(to) += 1;
        self.slots[i as usize].state = Some(to);
    }

    /// Take a page from the pool and make it an ALLOCATED slot.
    pub fn take_slot(&mut self, key: BlockKey, class: Class, owner: SessionId) -> Option<u32> {
        let i = self.pool.alloc()?;
        self.counts.free -= 1;
        self.counts.allocated += 1;
        let generation = self.next_generation;
        self.next_generation += 1;
        // Before anyone can write the page: a view a reader still holds on its last occupant
        // sees that the page moved on.
        self.pool.page_table().mark_occupied(i, generation);
        let s = &mut self.slots[i as usize];
        debug_assert!(s.state.is_none());
        *s = Slot {
            generation,
            state: Some(BlockState::Allocated),
            key,
            class,
            owner: Some(owner),
            running_crc: Some((0, 0)),
            ..Slot::empty()
        };
        Some(i)
    }

    /// Return a slot's page to the pool. The slot must be unlinked, unpinned and idle.
    pub fn free_slot(&mut self, i: u32) {
        let s = &self.slots[i as usize];
        assert!(
            s.pins == 0 && s.in_use == 0,
            "freeing a pinned or busy page"
        );
        assert!(!s.in_lru, "freeing a page still on the LRU");
        let state = self.state_of(i);
        *self.counts.slot_count(state) -= 1;
        self.counts.free += 1;
        let s = &mut self.slots[i as usize];
        // Before the page can be handed on (see `take_slot`).
        self.pool.page_table().mark_vacated(i, s.generation);
        s.state = None;
        s.generation = 0;
        s.owner = None;
        self.pool.free(i);
    }

    /// Remove a block from the key index if the index points at it.
    ///
    /// This is the one step every way out of PUBLISHED takes (compare-and-delete, eviction,
    /// quarantine, a manifest's release), so it logs the `Removed` event: for a PUBLISHED block
    /// only, as unfinished ones were never visible.
    pub fn unlink(&mut self, i: u32) {
        let s = &self.slots[i as usize];
        let (key, published) = (s.key, s.state == Some(BlockState::Published));
        if self.index.get(&key) == Some(&i) {
            self.index.remove(&key);
            if published {
                self.events.push(BlockEventKind::Removed, key);
            }
        }
        self.lru_remove(i);
    }

    /// Unlink a block and free its page now, or retire it until its pins and copies are gone.
    pub fn retire_or_free(&mut self, i: u32) {
        self.unlink(i);
        let s = &self.slots[i as usize];
        if s.pins == 0 && s.in_use == 0 {
            self.free_slot(i);
        } else if s.state != Some(BlockState::Retired) && s.state != Some(BlockState::Quarantined) {
            self.set_state(i, BlockState::Retired);
        }
    }

    /// Called when a slot's pins or copies drop: free a retired page with none left, and put an
    /// unpinned published cache block (back) on the LRU.
    pub fn settle(&mut self, i: u32) {
        let s = &self.slots[i as usize];
        if s.pins != 0 || s.in_use != 0 {
            return;
        }
        match s.state {
            Some(BlockState::Retired) => self.free_slot(i),
            Some(BlockState::Published) if s.class == Class::Cache && !s.in_lru => {
                self.lru_push_front(i)
            }
            _ => {}
        }
    }

    // ----- LRU of evictable blocks: PUBLISHED, cache class, unpinned. Front = most recent. -----

    pub fn lru_push_front(&mut self, i: u32) {
        self.lru.push_front(&mut self.slots, i);
    }

    pub fn lru_remove(&mut self, i: u32) {
        self.lru.remove(&mut self.slots, i);
    }

    /// Mark a block as just used.
    pub fn lru_touch(&mut self, i: u32) {
        self.lru.touch(&mut self.slots, i);
    }

    /// The least recently used evictable block.
    pub fn lru_oldest(&self) -> Option<u32> {
        self.lru.oldest()
    }
}
