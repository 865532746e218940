//! The store against a small reference model.
//!
//! Random sequences of operations from three sessions (alloc, write, seal, group publish, pin,
//! unpin, lookup, compare-and-delete with current and stale generations, abort, checkpoint
//! manifest begin/extend/end, heartbeats, clock advances with reaper ticks that expire leases,
//! pins and manifests, and allocations that force eviction) run against both the store and a
//! plain model that predicts every outcome, including which block eviction takes. After every
//! step the invariants 1-4 of docs/ARCHITECTURE.md are checked: only PUBLISHED blocks are visible, every stale
//! handle is refused, the accounting balances and matches the model, and a dead session leaves
//! nothing behind.

use std::collections::{BTreeMap, HashMap, HashSet};

use kvd_core::Error;
use kvd_core::clock::ManualClock;
use kvd_core::keys::{BlockKey, BlockTag, NamespaceId};
use kvd_store::{BlockClass, BlockEventKind, BlockVersion, Handle, RequestId, SessionId, Store};

mod common;
use proptest::prelude::*;

const PAGES: u32 = 6;
const PAGE: u64 = 4096;
const LEASE_MS: u64 = 10_000;
const PIN_TTL_MS: u64 = 3_000;
const MANIFEST_TTL_MS: u64 = 20_000;
const SESSIONS: usize = 3;
const KEYS: u8 = 8;
const REQ: RequestId = 1;

#[derive(Debug, Clone)]
enum Op {
    Alloc {
        s: usize,
        k: u8,
    },
    Put {
        s: usize,
        k: u8,
    },
    Write {
        s: usize,
        b: usize,
    },
    Seal {
        s: usize,
        b: usize,
    },
    Publish {
        s: usize,
        b1: usize,
        b2: Option<usize>,
    },
    Pin {
        s: usize,
        k: u8,
    },
    Unpin {
        s: usize,
        b: usize,
    },
    Lookup {
        k: u8,
    },
    RemoveIf {
        k: u8,
        stale: bool,
    },
    Abort {
        s: usize,
        b: usize,
    },
    Heartbeat {
        s: usize,
    },
    Advance {
        ms: u64,
    },
    ManifestBegin {
        s: usize,
    },
    CheckpointPut {
        s: usize,
    },
    ManifestEnd,
}

fn op() -> impl Strategy<Value = Op> {
    let s = 0..SESSIONS;
    let k = 0..KEYS;
    let b = 0usize..64;
    prop_oneof![
        4 => (s.clone(), k.clone()).prop_map(|(s, k)| Op::Alloc { s, k }),
        4 => (s.clone(), k.clone()).prop_map(|(s, k)| Op::Put { s, k }),
        3 => (s.clone(), b.clone()).prop_map(|(s, b)| Op::Write { s, b }),
        3 => (s.clone(), b.clone()).prop_map(|(s, b)| Op::Seal { s, b }),
        3 => (s.clone(), b.clone(), proptest::option::of(b.clone()))
            .prop_map(|(s, b1, b2)| Op::Publish { s, b1, b2 }),
        3 => (s.clone(), k.clone()).prop_map(|(s, k)| Op::Pin { s, k }),
        2 => (s.clone(), b.clone()).prop_map(|(s, b)| Op::Unpin { s, b }),
        2 => k.clone().prop_map(|k| Op::Lookup { k }),
        2 => (k.clone(), any::<bool>()).prop_map(|(k, stale)| Op::RemoveIf { k, stale }),
        1 => (s.clone(), b.clone()).prop_map(|(s, b)| Op::Abort { s, b }),
        1 => s.clone().prop_map(|s| Op::Heartbeat { s }),
        1 => (0u64..6_000).prop_map(|ms| Op::Advance { ms }),
        1 => s.clone().prop_map(|s| Op::ManifestBegin { s }),
        2 => s.clone().prop_map(|s| Op::CheckpointPut { s }),
        1 => Just(Op::ManifestEnd),
    ]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MState {
    Allocated,
    Writing,
    Sealed,
    Published,
    Retired,
    Freed,
}

#[derive(Debug, Clone)]
struct MBlock {
    key: BlockKey,
    handle: Handle,
    state: MState,
    owner: Option<usize>,
    checkpoint: Option<u64>,
    /// Pins by session index: (count, expiry).
    pins: BTreeMap<usize, (u32, u64)>,
}

struct Model {
    now: u64,
    sids: [SessionId; SESSIONS],
    lease: [u64; SESSIONS],
    blocks: Vec<MBlock>,
    index: HashMap<BlockKey, usize>,
    /// Evictable blocks, most recent first.
    lru: Vec<usize>,
    free: u32,
    manifest: Option<(u64, Vec<usize>, u64)>,
    manifest_expiry: u64,
    last_epoch: u64,
    ns: NamespaceId,
    ckpt_tag: u8,
}

struct World {
    store: Store,
    clock: std::sync::Arc<ManualClock>,
    m: Model,
    /// What a router that follows the store's event log believes is held: the sequence number
    /// to drain from next, and the keys.
    router: (u64, HashSet<BlockKey>),
}

impl World {
    fn new() -> World {
        let clock = ManualClock::new(0);
        let mut cfg = common::config(PAGE, PAGES);
        cfg.default_pin_ttl_ms = PIN_TTL_MS;
        let (store, ns) = common::store(cfg, clock.clone());
        let sids = [0, 1, 2].map(|_| store.open_session("model", LEASE_MS).unwrap());
        World {
            store,
            clock,
            m: Model {
                now: 0,
                sids,
                lease: [LEASE_MS; SESSIONS],
                blocks: Vec::new(),
                index: HashMap::new(),
                lru: Vec::new(),
                free: PAGES,
                manifest: None,
                manifest_expiry: 0,
                last_epoch: 0,
                ns,
                ckpt_tag: 100,
            },
            router: (0, HashSet::new()),
        }
    }

    fn key(&self, k: u8) -> BlockKey {
        BlockKey {
            namespace: self.m.ns,
            tag: BlockTag([k; 32]),
        }
    }

    /// One of the most recent blocks (ops on recent blocks make longer lifecycles likely); `b`
    /// beyond the window reaches back to any block, freed ones included (stale handles).
    fn block(&self, b: usize) -> Option<usize> {
        let n = self.m.blocks.len();
        if n == 0 {
            return None;
        }
        Some(if b < 48 {
            n - 1 - (b % n.min(4))
        } else {
            b % n
        })
    }

    // ----- model mechanics, mirroring the store's documented rules -----

    fn lru_remove(&mut self, b: usize) {
        self.m.lru.retain(|&x| x != b);
    }

    fn settle(&mut self, b: usize) {
        let blk = &self.m.blocks[b];
        if !blk.pins.is_empty() {
            return;
        }
        match blk.state {
            MState::Retired => {
                self.m.blocks[b].state = MState::Freed;
                self.m.free += 1;
            }
            MState::Published if blk.checkpoint.is_none() && !self.m.lru.contains(&b) => {
                self.m.lru.insert(0, b)
            }
            _ => {}
        }
    }

    fn unlink_and_free_or_retire(&mut self, b: usize) {
        let key = self.m.blocks[b].key;
        if self.m.index.get(&key) == Some(&b) {
            self.m.index.remove(&key);
        }
        self.lru_remove(b);
        if self.m.blocks[b].pins.is_empty() {
            self.m.blocks[b].state = MState::Freed;
            self.m.free += 1;
        } else {
            self.m.blocks[b].state = MState::Retired;
        }
    }

    fn close_session(&mut self, s: usize) {
        let mut writing: Vec<usize> = (0..self.m.blocks.len())
            .filter(|&b| {
                self.m.blocks[b].owner == Some(s)
                    && matches!(
                        self.m.blocks[b].state,
                        MState::Allocated | MState::Writing | MState::Sealed
                    )
            })
            .collect();
        writing.sort_by_key(|&b| self.m.blocks[b].handle.slot);
        for b in writing {
            self.m.blocks[b].owner = None;
            self.unlink_and_free_or_retire(b);
        }
        let mut pinned: Vec<usize> = (0..self.m.blocks.len())
            .filter(|&b| self.m.blocks[b].pins.contains_key(&s))
            .collect();
        pinned.sort_by_key(|&b| self.m.blocks[b].handle.slot);
        for b in pinned {
            self.m.blocks[b].pins.remove(&s);
            self.settle(b);
        }
    }

    /// Both sides: an expired session is released and reopened; returns true if it was expired.
    fn expire_if_due(&mut self, s: usize, result_was_lease_expired: bool) -> bool {
        let due = self.m.lease[s] <= self.m.now;
        assert_eq!(
            due, result_was_lease_expired,
            "session {s}: lease due {due}, store said expired {result_was_lease_expired}"
        );
        if due {
            self.close_session(s);
            self.reopen(s);
        }
        due
    }

    fn reopen(&mut self, s: usize) {
        self.m.sids[s] = self.store.open_session("model", LEASE_MS).unwrap();
        self.m.lease[s] = self.m.now + LEASE_MS;
    }

    /// Make one free page, evicting the oldest evictable block if needed.
    fn take_page(&mut self) -> bool {
        if self.m.free == 0 {
            let Some(&victim) = self.m.lru.last() else {
                return false;
            };
            self.unlink_and_free_or_retire(victim);
        }
        self.m.free -= 1;
        true
    }

    fn alloc(&mut self, s: usize, key: BlockKey, checkpoint: Option<u64>) -> Result<usize, Error> {
        let class = match checkpoint {
            None => BlockClass::Cache,
            Some(epoch) => BlockClass::Checkpoint {
                request: REQ,
                epoch,
            },
        };
        let r = self.store.alloc(self.m.sids[s], &[key], class, None);
        if self.expire_if_due(s, matches!(r, Err(Error::LeaseExpired(_)))) {
            return Err(r.unwrap_err());
        }
        if self.m.index.contains_key(&key) {
            assert!(matches!(r.unwrap()[0], Err(Error::AlreadyExists(_))));
            return Err(Error::AlreadyExists(String::new()));
        }
        if !self.take_page() {
            assert!(
                matches!(r, Err(Error::NoSpace { .. })),
                "model predicted no space: {r:?}"
            );
            return Err(r.unwrap_err());
        }
        let a = r
            .expect("model predicted space")
            .remove(0)
            .expect("fresh key");
        self.m.blocks.push(MBlock {
            key,
            handle: a.handle,
            state: MState::Allocated,
            owner: Some(s),
            checkpoint,
            pins: BTreeMap::new(),
        });
        let b = self.m.blocks.len() - 1;
        self.m.index.insert(key, b);
        Ok(b)
    }

    fn writer_ok(&self, s: usize, b: usize, states: &[MState]) -> bool {
        let blk = &self.m.blocks[b];
        blk.owner == Some(s) && states.contains(&blk.state)
    }

    fn expect_stale_if_freed(&self, b: usize, r: &Result<impl std::fmt::Debug, Error>) {
        if self.m.blocks[b].state == MState::Freed {
            assert!(
                matches!(r, Err(Error::StaleGeneration { .. })),
                "invariant 2: a freed block's handle must be stale, got {r:?}"
            );
        }
    }

    #[expect(
        clippy::too_many_lines,
        reason = "over the 120-line ratchet (232 lines) when it came in: shorten it, then drop this"
    )]
    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Alloc { s, k } => {
                let key = self.key(k);
                let _ = self.alloc(s, key, None);
            }
            Op::Put { s, k } => {
                let key = self.key(k);
                if self.alloc(s, key, None).is_ok() {
                    let b = self.m.blocks.len() - 1;
                    self.apply(&Op::Write { s, b: 0 });
                    self.apply(&Op::Seal { s, b: 0 });
                    self.apply(&Op::Publish { s, b1: 0, b2: None });
                    debug_assert_eq!(self.m.blocks[b].state, MState::Published);
                }
            }
            Op::Write { s, b } => {
                let Some(b) = self.block(b) else { return };
                let h = self.m.blocks[b].handle;
                let r = self.store.write(self.m.sids[s], &h, 0, &[b as u8; 64]);
                if self.expire_if_due(s, matches!(r, Err(Error::LeaseExpired(_)))) {
                    return;
                }
                self.expect_stale_if_freed(b, &r);
                let ok = self.writer_ok(s, b, &[MState::Allocated, MState::Writing]);
                assert_eq!(r.is_ok(), ok, "write {r:?}");
                if ok {
                    self.m.blocks[b].state = MState::Writing;
                }
            }
            Op::Seal { s, b } => {
                let Some(b) = self.block(b) else { return };
                let h = self.m.blocks[b].handle;
                let r = self.store.seal(self.m.sids[s], &h, 64, None);
                if self.expire_if_due(s, matches!(r, Err(Error::LeaseExpired(_)))) {
                    return;
                }
                self.expect_stale_if_freed(b, &r);
                let ok = self.writer_ok(s, b, &[MState::Writing]);
                assert_eq!(r.is_ok(), ok, "seal {r:?}");
                if ok {
                    self.m.blocks[b].state = MState::Sealed;
                }
            }
            Op::Publish { s, b1, b2 } => {
                let Some(b1) = self.block(b1) else { return };
                let group: Vec<usize> = match b2.and_then(|b| self.block(b)) {
                    Some(b2) => vec![b1, b2],
                    None => vec![b1],
                };
                let hs: Vec<Handle> = group.iter().map(|&b| self.m.blocks[b].handle).collect();
                let r = self.store.publish(self.m.sids[s], &hs);
                if self.expire_if_due(s, matches!(r, Err(Error::LeaseExpired(_)))) {
                    return;
                }
                let distinct = group.len() == 1 || group[0] != group[1];
                let ok = distinct
                    && group.iter().all(|&b| {
                        self.writer_ok(s, b, &[MState::Sealed])
                            && self.m.blocks[b].checkpoint.is_none()
                    });
                assert_eq!(r.is_ok(), ok, "publish {group:?}: {r:?}");
                if ok {
                    for b in group {
                        self.m.blocks[b].state = MState::Published;
                        self.m.blocks[b].owner = None;
                        self.settle(b);
                    }
                }
            }
            Op::Pin { s, k } => {
                let key = self.key(k);
                let r = self.store.acquire(self.m.sids[s], &[key], None);
                if self.expire_if_due(s, matches!(r, Err(Error::LeaseExpired(_)))) {
                    return;
                }
                let r = r.unwrap().remove(0);
                match self.m.index.get(&key).copied() {
                    Some(b) if self.m.blocks[b].state == MState::Published => {
                        let info = r.expect("model: published");
                        assert_eq!(info.handle, self.m.blocks[b].handle);
                        let exp = self.m.now + PIN_TTL_MS;
                        let e = self.m.blocks[b].pins.entry(s).or_insert((0, 0));
                        e.0 += 1;
                        e.1 = e.1.max(exp);
                        self.lru_remove(b);
                    }
                    _ => assert!(r.is_err(), "invariant 1: acquired a non-published block"),
                }
            }
            Op::Unpin { s, b } => {
                let Some(b) = self.block(b) else { return };
                let h = self.m.blocks[b].handle;
                let r = self.store.release(self.m.sids[s], &[h]);
                if self.expire_if_due(s, matches!(r, Err(Error::LeaseExpired(_)))) {
                    return;
                }
                let r = r.unwrap().remove(0);
                self.expect_stale_if_freed(b, &r);
                let pinned = self.m.blocks[b].pins.contains_key(&s);
                assert_eq!(r.is_ok(), pinned, "release {r:?}");
                if pinned {
                    let e = self.m.blocks[b].pins.get_mut(&s).unwrap();
                    e.0 -= 1;
                    if e.0 == 0 {
                        self.m.blocks[b].pins.remove(&s);
                        self.settle(b);
                    }
                }
            }
            Op::Lookup { k } => {
                let key = self.key(k);
                let got = self.store.lookup(&[key]).unwrap().remove(0);
                match self.m.index.get(&key).copied() {
                    Some(b) if self.m.blocks[b].state == MState::Published => {
                        let info = got.expect("model: published");
                        assert_eq!(info.handle, self.m.blocks[b].handle);
                        if let Some(pos) = self.m.lru.iter().position(|&x| x == b) {
                            self.m.lru.remove(pos);
                            self.m.lru.insert(0, b);
                        }
                    }
                    _ => assert!(got.is_none(), "invariant 1: saw a non-published block"),
                }
            }
            Op::RemoveIf { k, stale } => {
                let key = self.key(k);
                let current = self.m.index.get(&key).copied();
                let version = match (current, stale) {
                    (Some(b), false) => self.m.blocks[b].handle.version(),
                    (Some(b), true) => BlockVersion {
                        generation: self.m.blocks[b].handle.generation - 1,
                        ..self.m.blocks[b].handle.version()
                    },
                    (None, _) => BlockVersion {
                        node_generation: self.store.node_generation(),
                        generation: 1,
                    },
                };
                let r = self.store.remove_if(&key, version);
                match current {
                    None => assert!(matches!(r, Err(Error::NotFound(_))), "{r:?}"),
                    Some(_) if stale => assert!(
                        matches!(r, Err(Error::StaleGeneration { .. })),
                        "ABA: {r:?}"
                    ),
                    Some(b) => {
                        let ok = self.m.blocks[b].state == MState::Published
                            && self.m.blocks[b].checkpoint.is_none();
                        assert_eq!(r.is_ok(), ok, "remove_if {r:?}");
                        if ok {
                            self.unlink_and_free_or_retire(b);
                        }
                    }
                }
            }
            Op::Abort { s, b } => {
                let Some(b) = self.block(b) else { return };
                let h = self.m.blocks[b].handle;
                let r = self.store.abort(self.m.sids[s], &[h]);
                if self.expire_if_due(s, matches!(r, Err(Error::LeaseExpired(_)))) {
                    return;
                }
                let r = r.unwrap().remove(0);
                self.expect_stale_if_freed(b, &r);
                let ok =
                    self.writer_ok(s, b, &[MState::Allocated, MState::Writing, MState::Sealed]);
                assert_eq!(r.is_ok(), ok, "abort {r:?}");
                if ok {
                    self.m.blocks[b].owner = None;
                    self.unlink_and_free_or_retire(b);
                }
            }
            Op::Heartbeat { s } => {
                let r = self.store.heartbeat(self.m.sids[s]);
                if !self.expire_if_due(s, matches!(r, Err(Error::LeaseExpired(_)))) {
                    r.unwrap();
                    self.m.lease[s] = self.m.now + LEASE_MS;
                }
            }
            Op::Advance { ms } => {
                self.clock.advance(ms);
                self.m.now += ms;
                let rep = self.store.reap(10_000);
                self.model_reap();
                assert!(!rep.budget_exhausted);
            }
            Op::ManifestBegin { s } => {
                let epoch = self.m.last_epoch + 1;
                let r = self.store.manifest_begin(
                    self.m.sids[s],
                    REQ,
                    epoch,
                    self.m.ns,
                    0,
                    MANIFEST_TTL_MS,
                );
                if self.expire_if_due(s, matches!(r, Err(Error::LeaseExpired(_)))) {
                    return;
                }
                r.unwrap();
                self.release_manifest();
                self.m.last_epoch = epoch;
                self.m.manifest = Some((epoch, Vec::new(), 0));
                self.m.manifest_expiry = self.m.now + MANIFEST_TTL_MS;
            }
            Op::CheckpointPut { s } => {
                let Some((epoch, _, committed)) = self.m.manifest.clone() else {
                    return;
                };
                self.m.ckpt_tag = self.m.ckpt_tag.wrapping_add(1).max(100);
                let key = self.key(self.m.ckpt_tag);
                let Ok(b) = self.alloc(s, key, Some(epoch)) else {
                    return;
                };
                let (sid, h) = (self.m.sids[s], self.m.blocks[b].handle);
                self.store.write(sid, &h, 0, &[7; 32]).unwrap();
                self.store.seal(sid, &h, 32, None).unwrap();
                self.store
                    .manifest_extend(sid, REQ, epoch, &[h], committed + 4)
                    .unwrap();
                self.m.blocks[b].state = MState::Published;
                self.m.blocks[b].owner = None;
                let m = self.m.manifest.as_mut().unwrap();
                m.1.push(b);
                m.2 += 4;
            }
            Op::ManifestEnd => {
                let r = self.store.manifest_end(REQ, self.m.last_epoch);
                assert_eq!(r.is_ok(), self.m.manifest.is_some(), "{r:?}");
                self.release_manifest();
            }
        }
    }

    fn release_manifest(&mut self) {
        if let Some((_, blocks, _)) = self.m.manifest.take() {
            for b in blocks {
                if self.m.blocks[b].state == MState::Published {
                    self.unlink_and_free_or_retire(b);
                }
            }
        }
    }

    fn model_reap(&mut self) {
        // Sessions in (expiry, store id) order, then pins in (expiry, store id, slot) order, then
        // the manifest: the order the store's reaper documents.
        let mut due: Vec<(u64, SessionId, usize)> = (0..SESSIONS)
            .filter(|&s| self.m.lease[s] <= self.m.now)
            .map(|s| (self.m.lease[s], self.m.sids[s], s))
            .collect();
        due.sort();
        for (_, _, s) in &due {
            self.close_session(*s);
        }
        let mut pins: Vec<(u64, SessionId, u32, usize, usize)> = Vec::new();
        for (b, blk) in self.m.blocks.iter().enumerate() {
            for (&s, &(_, exp)) in &blk.pins {
                if exp <= self.m.now {
                    pins.push((exp, self.m.sids[s], blk.handle.slot, b, s));
                }
            }
        }
        pins.sort();
        for (_, _, _, b, s) in pins {
            self.m.blocks[b].pins.remove(&s);
            self.settle(b);
        }
        if self.m.manifest.is_some() && self.m.manifest_expiry <= self.m.now {
            self.release_manifest();
        }
        for (_, _, s) in due {
            self.reopen(s);
        }
    }

    /// Drain the event log into the router's picture of the node (bounded: the ring holds
    /// more events than a sequence makes, so nothing is lost and one batch per op suffices).
    fn follow_events(&mut self) {
        let b = self.store.events(self.router.0, u32::MAX).unwrap();
        assert_eq!(b.lost, 0, "the ring outgrew a whole sequence");
        for e in &b.events {
            let fresh = match e.kind {
                BlockEventKind::Stored => self.router.1.insert(e.key),
                BlockEventKind::Removed => self.router.1.remove(&e.key),
            };
            assert!(fresh, "event {e:?} repeats what the router knew");
        }
        self.router.0 = b.next_seq;
    }

    fn check(&mut self) {
        self.follow_events();
        let visible: HashSet<BlockKey> = self
            .m
            .index
            .iter()
            .filter(|(_, b)| self.m.blocks[**b].state == MState::Published)
            .map(|(k, _)| *k)
            .collect();
        assert_eq!(
            self.router.1, visible,
            "the event log replays to what lookups see"
        );
        self.store.check_invariants().unwrap();
        let st = self.store.stats();
        let a = st.accounting;
        assert!(a.balanced(), "invariant 3: {a:?}");
        let count = |want: MState| self.m.blocks.iter().filter(|b| b.state == want).count() as u32;
        assert_eq!(a.free, self.m.free, "free pages");
        assert_eq!(
            (a.allocated, a.writing, a.sealed, a.published, a.retired),
            (
                count(MState::Allocated),
                count(MState::Writing),
                count(MState::Sealed),
                count(MState::Published),
                count(MState::Retired)
            ),
            "pages by state"
        );
        let lru: Vec<u32> = self
            .m
            .lru
            .iter()
            .map(|&b| self.m.blocks[b].handle.slot)
            .collect();
        assert_eq!(self.store.debug_lru_slots(), lru, "eviction order");
        // Invariant 4: only live sessions hold pins, and exactly the model's.
        let pins: u64 = self.m.blocks.iter().map(|b| b.pins.len() as u64).sum();
        assert_eq!(st.pins, pins);
        assert_eq!(st.sessions as usize, SESSIONS);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn the_store_behaves_like_its_reference_model(ops in proptest::collection::vec(op(), 1..120)) {
        let mut w = World::new();
        for op in &ops {
            w.apply(op);
            w.check();
        }
        // Finally every session dies: nothing may remain but published blocks.
        w.clock.advance(LEASE_MS + MANIFEST_TTL_MS + PIN_TTL_MS);
        w.store.reap(10_000);
        let st = w.store.stats();
        prop_assert_eq!(st.accounting.allocated + st.accounting.writing + st.accounting.sealed, 0);
        prop_assert_eq!(st.pins, 0);
        prop_assert_eq!(st.accounting.retired, 0);
        prop_assert_eq!(st.manifests, 0);
        w.store.check_invariants().unwrap();
    }
}
