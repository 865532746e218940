//! The store's behaviour, one specification per test.

use std::sync::Arc;

use super::*;
use crate::clock::ManualClock;

use crate::pool::HugePages;

const PAGE: u64 = 4096;

struct Fixture {
    store: Store,
    clock: Arc<ManualClock>,
    ns: NamespaceId,
}

fn fixture(pages: u32) -> Fixture {
    fixture_with(pages, |_| {})
}

fn fixture_with(pages: u32, tweak: impl FnOnce(&mut StoreConfig)) -> Fixture {
    let mut cfg = StoreConfig::new(PoolConfig {
        page_size_bytes: PAGE,
        page_count: pages,
        huge_pages: HugePages::Off,
    });
    cfg.quarantine_hold_ms = 1_000;
    tweak(&mut cfg);
    let clock = ManualClock::new(0);
    let store = Store::new(cfg, clock.clone()).unwrap();
    let mut d = crate::keys::NamespaceDescriptor::example_qwen3_14b();
    d.tokens_per_block = 4;
    d.bytes_per_block = PAGE;
    let ns = store.register_namespace(&d).unwrap();
    Fixture { store, clock, ns }
}

fn key(ns: NamespaceId, n: u8) -> BlockKey {
    BlockKey {
        namespace: ns,
        tag: BlockTag([n; 32]),
    }
}

fn bytes(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(7) ^ seed).collect()
}

impl Fixture {
    fn session(&self) -> SessionId {
        self.store.open_session("test", 10_000).unwrap()
    }

    /// Allocate, write, seal and publish one cache block; returns its handle.
    fn put(&self, sid: SessionId, k: BlockKey, data: &[u8]) -> Handle {
        let a = self
            .store
            .alloc(sid, &[k], BlockClass::Cache, None)
            .unwrap();
        let h = a[0].as_ref().unwrap().handle;
        self.store.write(sid, &h, 0, data).unwrap();
        self.store.seal(sid, &h, data.len() as u64, None).unwrap();
        self.store.publish(sid, &[h]).unwrap();
        h
    }

    /// Allocate cache blocks for tags `ns`; every one must succeed.
    fn alloc(&self, sid: SessionId, tags: &[u8]) -> Vec<Handle> {
        let keys: Vec<BlockKey> = tags.iter().map(|&n| key(self.ns, n)).collect();
        self.store
            .alloc(sid, &keys, BlockClass::Cache, None)
            .unwrap()
            .into_iter()
            .map(|a| a.unwrap().handle)
            .collect()
    }

    /// Allocate one checkpoint block of `req` at `epoch`.
    fn alloc_checkpoint(&self, sid: SessionId, req: RequestId, epoch: u64, k: BlockKey) -> Handle {
        let class = BlockClass::Checkpoint {
            request: req,
            epoch,
        };
        self.store.alloc(sid, &[k], class, None).unwrap()[0]
            .as_ref()
            .unwrap()
            .handle
    }

    fn invariants(&self) {
        self.store.check_invariants().unwrap();
    }

    fn corrupt(&self, h: &Handle) {
        let g = self.store.lock();
        let off = g.pool.page_offset(h.slot);
        // SAFETY: test-only: simulates a bit flip in a block nobody is copying right now.
        let b = unsafe { g.pool.region().bytes_mut(off, 1).unwrap() };
        b[0] ^= 0xff;
    }
}

#[test]
fn a_block_goes_through_its_lifecycle_and_reads_back_byte_exact() {
    let f = fixture(4);
    let w = f.session();
    let data = bytes(1, 3000);
    let a = f
        .store
        .alloc(w, &[key(f.ns, 1)], BlockClass::Cache, None)
        .unwrap();
    let h = a[0].as_ref().unwrap().handle;
    assert_eq!(f.store.stats().accounting.allocated, 1);
    f.store.write(w, &h, 0, &data[..1000]).unwrap();
    f.store.write(w, &h, 1000, &data[1000..]).unwrap();
    assert_eq!(f.store.stats().accounting.writing, 1);
    let crc = f.store.seal(w, &h, 3000, None).unwrap();
    assert_eq!(
        crc,
        transport::local::crc32c(0, &data),
        "running CRC equals a full pass"
    );
    assert_eq!(
        f.store.lookup(&[key(f.ns, 1)]).unwrap()[0],
        None,
        "SEALED is not visible"
    );
    f.store.publish(w, &[h]).unwrap();

    let r = f.session();
    let got = f.store.acquire(r, &[key(f.ns, 1)], None).unwrap();
    let info = got[0].as_ref().unwrap();
    assert_eq!((info.len, info.checksum), (3000, crc));
    let mut out = vec![0u8; 4096];
    let n = f.store.read(r, &info.handle, &mut out, true).unwrap();
    assert_eq!(&out[..n as usize], &data[..]);
    f.invariants();
}

#[test]
fn a_stale_handle_never_reads_another_blocks_bytes() {
    let f = fixture(1);
    let s = f.session();
    let old = f.put(s, key(f.ns, 1), &bytes(1, 100));
    f.store.remove_if(&key(f.ns, 1), old.version()).unwrap();
    let new = f.put(s, key(f.ns, 2), &bytes(2, 100));
    assert_eq!(old.slot, new.slot, "the single page was reused");
    f.store.acquire(s, &[key(f.ns, 2)], None).unwrap();
    let mut out = vec![0u8; 100];
    let e = f.store.read(s, &old, &mut out, false).unwrap_err();
    assert!(matches!(e, Error::StaleGeneration { .. }), "{e}");
    assert!(
        out.iter().all(|&b| b == 0),
        "no byte of the new block leaked"
    );
    assert_eq!(f.store.stats().counters.stale_generation_rejects, 1);
}

#[test]
fn a_handle_from_a_previous_node_generation_is_stale_after_restart() {
    let f = fixture(2);
    let s = f.session();
    let h = f.put(s, key(f.ns, 1), &bytes(1, 10));
    drop(f.store);
    let g = fixture_with(2, |c| c.node_generation = 2);
    let s2 = g.session();
    g.put(s2, key(g.ns, 1), &bytes(1, 10));
    let e = g.store.release(s2, &[h]).unwrap().remove(0).unwrap_err();
    assert!(
        matches!(
            e,
            Error::StaleGeneration {
                handle_node: 1,
                current_node: 2,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn every_illegal_transition_is_refused_and_changes_nothing() {
    let f = fixture(4);
    let s = f.session();
    let a = f
        .store
        .alloc(s, &[key(f.ns, 1)], BlockClass::Cache, None)
        .unwrap();
    let h = a[0].as_ref().unwrap().handle;
    let before = f.store.stats();
    // ALLOCATED: cannot seal or publish.
    assert!(matches!(
        f.store.seal(s, &h, 0, None),
        Err(Error::IllegalTransition {
            from: BlockState::Allocated,
            ..
        })
    ));
    assert!(matches!(
        f.store.publish(s, &[h]),
        Err(Error::IllegalTransition {
            from: BlockState::Allocated,
            ..
        })
    ));
    assert_eq!(f.store.stats().accounting, before.accounting);
    // SEALED: cannot be written.
    f.store.write(s, &h, 0, b"abc").unwrap();
    f.store.seal(s, &h, 3, None).unwrap();
    assert!(matches!(
        f.store.write(s, &h, 0, b"x"),
        Err(Error::IllegalTransition {
            from: BlockState::Sealed,
            ..
        })
    ));
    // PUBLISHED: cannot be aborted, sealed or published again.
    f.store.publish(s, &[h]).unwrap();
    let r = f.store.abort(s, &[h]).unwrap().remove(0);
    assert!(
        matches!(
            r,
            Err(Error::IllegalTransition {
                from: BlockState::Published,
                ..
            })
        ),
        "{r:?}"
    );
    assert!(f.store.publish(s, &[h]).is_err());
    assert_eq!(f.store.stats().accounting.published, 1);
    f.invariants();
}

#[test]
fn bad_offsets_and_sizes_are_refused_with_a_clear_error() {
    let f = fixture(2);
    let s = f.session();
    let h = f.alloc(s, &[1])[0];
    let e = f.store.write(s, &h, PAGE - 1, b"ab").unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let e = f.store.write(s, &h, u64::MAX, b"ab").unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    f.store.write(s, &h, 0, b"ok").unwrap();
    let e = f.store.seal(s, &h, PAGE + 1, None).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let bogus = Handle { slot: 999, ..h };
    assert!(matches!(
        f.store.seal(s, &bogus, 1, None),
        Err(Error::InvalidArgument(_))
    ));
    let other_ns = BlockKey {
        namespace: NamespaceId([9; 32]),
        tag: BlockTag([1; 32]),
    };
    let e = f
        .store
        .alloc(s, &[other_ns], BlockClass::Cache, None)
        .unwrap_err();
    assert!(e.to_string().contains("unknown namespace"), "{e}");
    f.invariants();
}

#[test]
fn another_session_cannot_write_or_publish_my_block() {
    let f = fixture(2);
    let a = f.session();
    let b = f.session();
    let h = f.alloc(a, &[1])[0];
    assert!(f.store.write(b, &h, 0, b"x").is_err());
    f.store.write(a, &h, 0, b"x").unwrap();
    f.store.seal(a, &h, 1, None).unwrap();
    assert!(f.store.publish(b, &[h]).is_err());
    assert!(f.store.abort(b, &[h]).unwrap()[0].is_err());
    f.store.publish(a, &[h]).unwrap();
}

#[test]
fn a_group_publishes_all_or_nothing() {
    let f = fixture(4);
    let s = f.session();
    let hs = f.alloc(s, &[1, 2, 3]);
    for h in &hs[..2] {
        f.store.write(s, h, 0, b"data").unwrap();
        f.store.seal(s, h, 4, None).unwrap();
    }
    // The third is still ALLOCATED: the whole group is refused.
    assert!(f.store.publish(s, &hs).is_err());
    let visible = f.store.lookup(&[key(f.ns, 1), key(f.ns, 2)]).unwrap();
    assert!(
        visible.iter().all(Option::is_none),
        "no part of the group became visible"
    );
    f.store.write(s, &hs[2], 0, b"data").unwrap();
    f.store.seal(s, &hs[2], 4, None).unwrap();
    f.store.publish(s, &hs).unwrap();
    assert!(
        f.store
            .lookup(&[key(f.ns, 1), key(f.ns, 2), key(f.ns, 3)])
            .unwrap()
            .iter()
            .all(Option::is_some)
    );
    f.invariants();
}

#[test]
fn a_late_delete_never_removes_the_newer_generation() {
    let f = fixture(2);
    let s = f.session();
    let k = key(f.ns, 1);
    let h1 = f.put(s, k, b"v1");
    let g1 = h1.generation;
    f.store.remove_if(&k, h1.version()).unwrap();
    let h2 = f.put(s, k, b"v2");
    let g2 = h2.generation;
    assert!(g2 > g1);
    // A delete for generation g1 arrives late: it must not touch g2.
    let e = f.store.remove_if(&k, h1.version()).unwrap_err();
    assert!(
        matches!(e, Error::StaleGeneration { handle_slot, current_slot, .. } if handle_slot == g1 && current_slot == g2)
    );
    assert_eq!(
        f.store.lookup(&[k]).unwrap()[0].unwrap().handle.generation,
        g2
    );
    f.store.remove_if(&k, h2.version()).unwrap();
    assert_eq!(f.store.lookup(&[k]).unwrap()[0], None);
    f.invariants();
}

#[test]
fn an_existing_key_cannot_be_allocated_again_but_the_rest_of_the_batch_can() {
    let f = fixture(4);
    let s = f.session();
    f.put(s, key(f.ns, 1), b"x");
    let r = f
        .store
        .alloc(
            s,
            &[key(f.ns, 1), key(f.ns, 2), key(f.ns, 2)],
            BlockClass::Cache,
            None,
        )
        .unwrap();
    assert!(matches!(r[0], Err(Error::AlreadyExists(_))));
    assert!(r[1].is_ok());
    assert!(
        matches!(r[2], Err(Error::AlreadyExists(_))),
        "a key twice in one batch"
    );
    f.invariants();
}

#[test]
fn a_pinned_block_keeps_its_page_until_the_last_pin_is_released() {
    let f = fixture(1);
    let w = f.session();
    let r = f.session();
    let k = key(f.ns, 1);
    let h = f.put(w, k, &bytes(5, 64));
    f.store.acquire(r, &[k], None).unwrap();
    f.store.remove_if(&k, h.version()).unwrap();
    assert_eq!(
        f.store.lookup(&[k]).unwrap()[0],
        None,
        "removed blocks are invisible at once"
    );
    assert_eq!(f.store.stats().accounting.retired, 1);
    // The only page is still pinned: a new allocation finds no space.
    let e = f
        .store
        .alloc(w, &[key(f.ns, 2)], BlockClass::Cache, None)
        .unwrap_err();
    assert!(matches!(e, Error::NoSpace { .. }), "{e}");
    // The reader can still read the bytes it pinned.
    let mut out = vec![0u8; 64];
    f.store.read(r, &h, &mut out, true).unwrap();
    assert_eq!(out, bytes(5, 64));
    f.store.release(r, &[h]).unwrap()[0].as_ref().unwrap();
    assert_eq!(f.store.stats().accounting.free, 1);
    assert!(
        f.store
            .alloc(w, &[key(f.ns, 2)], BlockClass::Cache, None)
            .is_ok()
    );
    f.invariants();
}

#[test]
fn an_expired_pin_is_dropped_by_the_reaper() {
    let f = fixture(1);
    let s = f.session();
    let k = key(f.ns, 1);
    let h = f.put(s, k, b"x");
    let r = f.store.open_session("reader", 100_000).unwrap();
    f.store.acquire(r, &[k], Some(500)).unwrap();
    f.store.remove_if(&k, h.version()).unwrap();
    f.clock.advance(499);
    assert_eq!(f.store.reap(100).pins_expired, 0);
    f.clock.advance(1);
    assert_eq!(f.store.reap(100).pins_expired, 1);
    assert_eq!(
        f.store.stats().accounting.free,
        1,
        "the retired page came back"
    );
    assert!(
        f.store.release(r, &[h]).unwrap()[0].is_err(),
        "nothing left to release"
    );
    f.invariants();
}

#[test]
fn a_dead_session_leaves_nothing_behind_within_its_lease_ttl() {
    let f = fixture(8);
    let w = f.store.open_session("writer", 1_000).unwrap();
    let keep = f.session();
    let published = f.put(keep, key(f.ns, 9), b"shared");
    let hs = f.alloc(w, &[1, 2, 3]);
    f.store.write(w, &hs[1], 0, b"half").unwrap();
    f.store.write(w, &hs[2], 0, b"done").unwrap();
    f.store.seal(w, &hs[2], 4, None).unwrap();
    f.store.acquire(w, &[key(f.ns, 9)], None).unwrap();
    f.store.reserve(w, 2 * PAGE).unwrap();
    f.clock.advance(1_000);
    let rep = f.store.reap(100);
    assert_eq!(rep.sessions_expired, 1);
    let st = f.store.stats();
    assert_eq!(
        (
            st.accounting.allocated,
            st.accounting.writing,
            st.accounting.sealed
        ),
        (0, 0, 0),
        "no orphan block"
    );
    assert_eq!(st.pins, 0, "no pin");
    assert_eq!(st.reserved_unused_pages, 0, "no reservation");
    assert_eq!(
        st.accounting.published, 1,
        "another session's block is untouched"
    );
    assert_eq!(
        f.store.lookup(&[key(f.ns, 9)]).unwrap()[0].unwrap().handle,
        published
    );
    // Its next call learns why: the lease, not an unknown name.
    assert!(matches!(f.store.heartbeat(w), Err(Error::LeaseExpired(_))));
    f.invariants();
}

#[test]
fn an_operation_on_an_expired_lease_fails_and_releases_the_session_at_once() {
    let f = fixture(4);
    let w = f.store.open_session("writer", 1_000).unwrap();
    f.store
        .alloc(w, &[key(f.ns, 1)], BlockClass::Cache, None)
        .unwrap();
    f.clock.advance(999);
    f.store.heartbeat(w).unwrap();
    f.clock.advance(999);
    assert_eq!(
        f.store.stats().accounting.allocated,
        1,
        "heartbeats keep it alive"
    );
    f.clock.advance(1);
    let e = f
        .store
        .alloc(w, &[key(f.ns, 2)], BlockClass::Cache, None)
        .unwrap_err();
    assert!(matches!(e, Error::LeaseExpired(_)), "{e}");
    assert_eq!(f.store.stats().accounting.allocated, 0);
    f.invariants();
}

#[test]
fn allocation_beyond_reservations_fails_fast_and_says_how_much_is_free() {
    let f = fixture(4);
    let a = f.session();
    let b = f.session();
    let r = f.store.reserve(a, 3 * PAGE).unwrap();
    let e = f
        .store
        .alloc(b, &[key(f.ns, 1), key(f.ns, 2)], BlockClass::Cache, None)
        .unwrap_err();
    match e {
        Error::NoSpace {
            requested_bytes,
            free_bytes,
        } => {
            assert_eq!((requested_bytes, free_bytes), (2 * PAGE, PAGE));
        }
        other => panic!("{other}"),
    }
    assert!(e.is_retryable());
    assert_eq!(f.store.stats().accounting.allocated, 0, "all or nothing");
    // The reservation's owner gets its pages.
    let got = f
        .store
        .alloc(
            a,
            &[key(f.ns, 3), key(f.ns, 4), key(f.ns, 5)],
            BlockClass::Cache,
            Some(r),
        )
        .unwrap();
    assert!(got.iter().all(Result::is_ok));
    assert_eq!(f.store.stats().reserved_unused_pages, 0);
    f.invariants();
}

#[test]
fn eviction_takes_the_least_recently_used_unpinned_cache_block() {
    let f = fixture(3);
    let s = f.session();
    let r = f.session();
    f.put(s, key(f.ns, 1), b"1");
    f.put(s, key(f.ns, 2), b"2");
    f.put(s, key(f.ns, 3), b"3");
    f.store.lookup(&[key(f.ns, 1)]).unwrap(); // 1 is now the most recent; 2 the oldest
    f.store.acquire(r, &[key(f.ns, 2)], None).unwrap(); // pinned: not evictable
    f.put(s, key(f.ns, 4), b"4");
    let seen: Vec<bool> = f
        .store
        .lookup(&[key(f.ns, 1), key(f.ns, 2), key(f.ns, 3), key(f.ns, 4)])
        .unwrap()
        .iter()
        .map(Option::is_some)
        .collect();
    assert_eq!(seen, [true, true, false, true], "3 was the oldest unpinned");
    assert_eq!(f.store.stats().counters.evictions, 1);
    f.invariants();
}

#[test]
fn a_soft_pinned_prefix_outlives_eviction_until_nothing_else_can_go_or_its_deadline_passes() {
    let f = fixture(3);
    let s = f.session();
    let evicted = |f: &Fixture| f.store.stats().counters.evictions;
    let held = |f: &Fixture, ks: &[u8]| -> Vec<bool> {
        let keys: Vec<BlockKey> = ks.iter().map(|&k| key(f.ns, k)).collect();
        // (not `lookup`, which would count as a use and reorder the LRU)
        let g = f.store.lock();
        keys.iter().map(|k| g.index.contains_key(k)).collect()
    };
    f.put(s, key(f.ns, 1), b"system prompt, block 1");
    f.put(s, key(f.ns, 2), b"system prompt, block 2");
    // 1 and 2 are the oldest; soft-pinned for 10 s (a miss is not pinned)
    assert_eq!(
        f.store
            .soft_pin(&[key(f.ns, 1), key(f.ns, 2), key(f.ns, 9)], 10_000)
            .unwrap(),
        [true, true, false]
    );
    f.put(s, key(f.ns, 3), b"3");
    f.put(s, key(f.ns, 4), b"4"); // room for one more: 3 goes, the older 1 and 2 stay
    assert_eq!(held(&f, &[1, 2, 3, 4]), [true, true, false, true]);
    f.put(s, key(f.ns, 5), b"5");
    assert_eq!(held(&f, &[1, 2, 4, 5]), [true, true, false, true]);
    assert_eq!((evicted(&f), f.store.stats().counters.soft_pins), (2, 2));
    // when nothing else can go, the soft pins give way (the oldest first), counted
    f.store.soft_pin(&[key(f.ns, 5)], 10_000).unwrap();
    f.put(s, key(f.ns, 6), b"6");
    assert_eq!(held(&f, &[6]), [true]);
    assert_eq!(f.store.stats().counters.soft_pins_given_way, 1);
    // past the deadline a soft-pinned block is an ordinary cache block again
    f.clock.advance(10_001);
    let s = f.session(); // (the first one's lease ran out meanwhile)
    f.put(s, key(f.ns, 7), b"7");
    assert_eq!(f.store.stats().counters.soft_pins_given_way, 1);
    // a checkpoint block is never soft-pinned (eviction never takes it anyway), nor a batch
    // past the bound
    let too_many: Vec<BlockKey> = (0..=f.store.config().max_batch)
        .map(|i| key(f.ns, i as u8))
        .collect();
    assert!(f.store.soft_pin(&too_many, 1).is_err());
    f.invariants();
}

#[test]
fn checkpoint_blocks_are_never_evicted() {
    let f = fixture(2);
    let s = f.session();
    let req = 7;
    f.store.manifest_begin(s, req, 1, f.ns, 0, 60_000).unwrap();
    let h = f.alloc_checkpoint(s, req, 1, key(f.ns, 1));
    f.store.write(s, &h, 0, b"kv").unwrap();
    f.store.seal(s, &h, 2, None).unwrap();
    f.store.manifest_extend(s, req, 1, &[h], 4).unwrap();
    f.put(s, key(f.ns, 2), b"c");
    let e = f
        .store
        .alloc(s, &[key(f.ns, 3), key(f.ns, 4)], BlockClass::Cache, None)
        .unwrap_err();
    assert!(matches!(e, Error::NoSpace { .. }));
    assert!(
        f.store
            .alloc(s, &[key(f.ns, 3)], BlockClass::Cache, None)
            .is_ok(),
        "the cache block went"
    );
    assert!(
        f.store.lookup(&[key(f.ns, 1)]).unwrap()[0].is_some(),
        "the checkpoint block stayed"
    );
    f.invariants();
}

#[test]
fn a_checksum_mismatch_quarantines_the_block_and_reads_as_a_miss() {
    let f = fixture(2);
    let s = f.session();
    let k = key(f.ns, 1);
    let h = f.put(s, k, &bytes(3, 500));
    f.store.acquire(s, &[k], None).unwrap();
    f.corrupt(&h);
    let mut out = vec![0u8; 500];
    assert!(
        f.store.read(s, &h, &mut out, false).is_ok(),
        "unverified reads do not check"
    );
    let e = f.store.read(s, &h, &mut out, true).unwrap_err();
    assert!(matches!(e, Error::Corrupt { .. }), "{e}");
    assert_eq!(
        f.store.lookup(&[k]).unwrap()[0],
        None,
        "quarantined blocks are a miss"
    );
    let st = f.store.stats();
    assert_eq!(
        (st.accounting.quarantined, st.counters.checksum_failures),
        (1, 1)
    );
    // Held apart while pinned and during the hold, then returned.
    f.store.release(s, &[h]).unwrap();
    f.clock.advance(999);
    assert_eq!(f.store.reap(10).quarantine_released, 0);
    f.clock.advance(1);
    assert_eq!(f.store.reap(10).quarantine_released, 1);
    assert_eq!(f.store.stats().accounting.free, 2);
    f.invariants();
}

#[test]
fn a_supplied_checksum_that_disagrees_with_the_bytes_is_refused() {
    let f = fixture_with(2, |c| c.verify_supplied_checksums = true);
    let s = f.session();
    let h = f.alloc(s, &[1])[0];
    f.store.begin_write(s, &[h]).unwrap();
    f.store.write(s, &h, 0, b"hello").unwrap();
    let good = transport::local::crc32c(0, b"hello");
    let e = f.store.seal(s, &h, 5, Some(good ^ 1)).unwrap_err();
    assert!(matches!(e, Error::Corrupt { .. }), "{e}");
    assert_eq!(f.store.stats().accounting.writing, 1, "nothing changed");
    assert_eq!(f.store.seal(s, &h, 5, Some(good)).unwrap(), good);
}

#[test]
fn a_token_history_finds_its_longest_published_prefix() {
    let f = fixture(8);
    let s = f.session();
    let tokens: Vec<u32> = (100..120).collect(); // 5 blocks of 4
    let tags = block_tags(&f.ns, 4, &tokens).unwrap();
    for t in &tags[..3] {
        f.put(
            s,
            BlockKey {
                namespace: f.ns,
                tag: *t,
            },
            b"kv",
        );
    }
    f.put(
        s,
        BlockKey {
            namespace: f.ns,
            tag: tags[4],
        },
        b"kv",
    ); // a gap at block 3
    let hit = f.store.longest_prefix(&f.ns, &tokens, None).unwrap();
    assert_eq!(hit.blocks.len(), 3);
    let pinned = f
        .store
        .longest_prefix(&f.ns, &tokens[..9], Some((s, None)))
        .unwrap();
    assert_eq!(pinned.blocks.len(), 2);
    assert_eq!(f.store.stats().pins, 2);
    let mut other = tokens.clone();
    other[0] = 1;
    assert!(
        f.store
            .longest_prefix(&f.ns, &other, None)
            .unwrap()
            .blocks
            .is_empty()
    );
}

fn checkpoint_step(
    f: &Fixture,
    s: SessionId,
    req: RequestId,
    epoch: u64,
    tags: &[BlockTag],
    committed: u64,
) -> Result<ManifestInfo> {
    let keys: Vec<BlockKey> = tags
        .iter()
        .map(|t| BlockKey {
            namespace: f.ns,
            tag: *t,
        })
        .collect();
    let hs: Vec<Handle> = f
        .store
        .alloc(
            s,
            &keys,
            BlockClass::Checkpoint {
                request: req,
                epoch,
            },
            None,
        )?
        .into_iter()
        .map(|a| a.map(|a| a.handle))
        .collect::<Result<_>>()?;
    for h in &hs {
        f.store.write(s, h, 0, &bytes(h.slot as u8, 256))?;
        f.store.seal(s, h, 256, None)?;
    }
    f.store.manifest_extend(s, req, epoch, &hs, committed)
}

#[test]
fn a_checkpoint_grows_atomically_and_restores_its_longest_verified_prefix() {
    let f = fixture(16);
    let s = f.session();
    let req = 42;
    let tokens: Vec<u32> = (0..24).collect(); // 6 blocks of 4
    let tags = block_tags(&f.ns, 4, &tokens).unwrap();
    let m = f
        .store
        .manifest_begin(s, req, 1, f.ns, 6 * PAGE, 60_000)
        .unwrap();
    assert!(m.reservation.is_some());
    checkpoint_step(&f, s, req, 1, &tags[..2], 8).unwrap();
    let m = checkpoint_step(&f, s, req, 1, &tags[2..4], 14).unwrap();
    assert_eq!((m.tags.len(), m.committed_tokens), (4, 14));

    let r = f.store.restore_prefix(req, &tokens).unwrap();
    assert_eq!((r.blocks.len(), r.tokens, r.committed_tokens), (4, 14, 14));
    // A history that diverges in block 2 can use only blocks 0 and 1.
    let mut diverged = tokens.clone();
    diverged[9] = 7777;
    assert_eq!(
        f.store.restore_prefix(req, &diverged).unwrap().blocks.len(),
        2
    );
    // A corrupt block ends the verified prefix and is quarantined.
    f.corrupt(&r.blocks[1].handle);
    let r2 = f.store.restore_prefix(req, &tokens).unwrap();
    assert_eq!((r2.blocks.len(), r2.tokens), (1, 4));
    assert_eq!(f.store.stats().accounting.quarantined, 1);
    f.invariants();
}

#[test]
fn a_newer_epoch_supersedes_the_checkpoint_and_older_writes_are_refused() {
    let f = fixture(16);
    let s = f.session();
    let req = 1;
    let tags = block_tags(&f.ns, 4, &(0..16).collect::<Vec<u32>>()).unwrap();
    f.store.manifest_begin(s, req, 1, f.ns, 0, 60_000).unwrap();
    checkpoint_step(&f, s, req, 1, &tags[..2], 8).unwrap();
    // Epoch 1's writer still has a block in flight when epoch 2 begins.
    let late = f.alloc_checkpoint(
        s,
        req,
        1,
        BlockKey {
            namespace: f.ns,
            tag: tags[2],
        },
    );
    f.store.write(s, &late, 0, b"late").unwrap();
    f.store.seal(s, &late, 4, None).unwrap();
    f.store.manifest_begin(s, req, 2, f.ns, 0, 60_000).unwrap();
    assert_eq!(
        f.store.stats().accounting.published,
        0,
        "epoch 1's blocks were released"
    );
    let e = f.store.manifest_extend(s, req, 1, &[late], 12).unwrap_err();
    assert!(matches!(e, Error::StaleEpoch { got: 1, current: 2 }), "{e}");
    let e = f
        .store
        .manifest_begin(s, req, 1, f.ns, 0, 60_000)
        .unwrap_err();
    assert!(matches!(e, Error::StaleEpoch { .. }));
    f.store.abort(s, &[late]).unwrap();
    checkpoint_step(&f, s, req, 2, &tags[..3], 12).unwrap();
    assert_eq!(f.store.manifest(req).unwrap().epoch, 2);
    f.invariants();
}

#[test]
fn finishing_or_expiring_a_request_releases_its_blocks_and_reservation() {
    let f = fixture(16);
    let s = f.session();
    let tags = block_tags(&f.ns, 4, &(0..8).collect::<Vec<u32>>()).unwrap();
    for (req, finish) in [(1, true), (2, false)] {
        f.store
            .manifest_begin(s, req, 1, f.ns, 4 * PAGE, 5_000)
            .unwrap();
        let t: Vec<BlockTag> = tags
            .iter()
            .map(|t| {
                let mut t = *t;
                t.0[0] ^= req as u8;
                t
            })
            .collect();
        checkpoint_step(&f, s, req, 1, &t, 8).unwrap();
        if finish {
            f.store.manifest_end(req, 1).unwrap();
            // Ending twice is harmless but says so.
            assert!(f.store.manifest_end(req, 1).is_err());
        }
    }
    assert_eq!(f.store.stats().manifests, 1);
    f.clock.advance(5_000);
    assert_eq!(f.store.reap(10).manifests_expired, 1);
    let st = f.store.stats();
    assert_eq!(
        (
            st.accounting.published,
            st.reserved_unused_pages,
            st.manifests
        ),
        (0, 0, 0)
    );
    assert_eq!(st.accounting.free, 16);
    f.invariants();
}

#[test]
fn committed_tokens_never_go_backwards_or_past_the_blocks() {
    let f = fixture(8);
    let s = f.session();
    let req = 3;
    let tags = block_tags(&f.ns, 4, &(0..12).collect::<Vec<u32>>()).unwrap();
    f.store.manifest_begin(s, req, 1, f.ns, 0, 60_000).unwrap();
    checkpoint_step(&f, s, req, 1, &tags[..1], 4).unwrap();
    let e = checkpoint_step(&f, s, req, 1, &tags[1..2], 9).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let e = checkpoint_step(&f, s, req, 1, &tags[2..3], 3).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert_eq!(
        f.store.manifest(req).unwrap().tags.len(),
        1,
        "refused steps published nothing"
    );
}

#[test]
fn bounds_give_explicit_errors() {
    let f = fixture_with(4, |c| {
        c.max_sessions = 2;
        c.max_batch = 2;
        c.max_pins_per_session = 1;
    });
    let a = f.session();
    f.session();
    assert!(matches!(
        f.store.open_session("x", 1000),
        Err(Error::Overloaded { .. })
    ));
    let e = f
        .store
        .alloc(
            a,
            &[key(f.ns, 1), key(f.ns, 2), key(f.ns, 3)],
            BlockClass::Cache,
            None,
        )
        .unwrap_err();
    assert!(e.to_string().contains("split"), "{e}");
    f.put(a, key(f.ns, 1), b"1");
    f.put(a, key(f.ns, 2), b"2");
    let r = f
        .store
        .acquire(a, &[key(f.ns, 1), key(f.ns, 2)], None)
        .unwrap();
    assert!(r[0].is_ok());
    assert!(matches!(r[1], Err(Error::Overloaded { .. })));
    assert!(
        matches!(f.store.open_session("x", 1), Err(Error::InvalidArgument(_))),
        "lease too short"
    );
}

#[test]
fn the_reaper_does_bounded_work_per_tick() {
    let f = fixture(4);
    for _ in 0..10 {
        f.store.open_session("s", 100).unwrap();
    }
    f.clock.advance(100);
    let r = f.store.reap(4);
    assert_eq!(r.sessions_expired, 4);
    assert!(r.budget_exhausted);
    assert!(r.accounting_balanced);
    assert_eq!(f.store.stats().sessions, 6);
    assert_eq!(f.store.reap(100).sessions_expired, 6);
}

#[test]
fn a_write_racing_an_abort_never_frees_a_page_being_copied() {
    let f = fixture(2);
    let s = f.session();
    let h = f.alloc(s, &[1])[0];
    // Simulate the window between write_prepare and write_finish.
    let t = f.store.lock().write_prepare(s, &h, 0, 4).unwrap();
    f.store.close_session(s);
    assert_eq!(
        f.store.stats().accounting.retired,
        1,
        "held while the copy runs"
    );
    assert!(f.store.lock().write_finish(&t, 0, 4, None).is_err());
    assert_eq!(f.store.stats().accounting.free, 2);
    f.invariants();
}

// ----- block events for routers -----

use crate::types::BlockEventKind::{Removed, Stored};

impl Fixture {
    /// Every event held, as (kind, tag byte), after checking that sequence numbers run on
    /// without a gap from `first`.
    fn events_from(&self, first: u64) -> Vec<(BlockEventKind, u8)> {
        let b = self.store.events(first, u32::MAX).unwrap();
        assert_eq!(b.lost, 0, "no event lost");
        for (k, e) in b.events.iter().enumerate() {
            assert_eq!(
                e.seq,
                first.max(1) + k as u64,
                "consecutive sequence numbers"
            );
            assert_eq!(e.key.namespace, self.ns);
        }
        assert_eq!(b.next_seq, first.max(1) + b.events.len() as u64);
        b.events.iter().map(|e| (e.kind, e.key.tag.0[0])).collect()
    }
}

#[test]
fn every_way_a_cache_block_becomes_visible_or_invisible_logs_one_event_in_order() {
    let f = fixture(2);
    let s = f.session();
    let r = f.session();
    let h1 = f.put(s, key(f.ns, 1), b"1");
    f.put(s, key(f.ns, 2), b"2");
    // Compare-and-delete of a pinned block: logged when it leaves the index (RETIRED), not when
    // its page is freed later.
    f.store.acquire(r, &[key(f.ns, 1)], None).unwrap();
    f.store.remove_if(&key(f.ns, 1), h1.version()).unwrap();
    f.store.release(r, &[h1]).unwrap();
    // A failed compare-and-delete logs nothing.
    assert!(f.store.remove_if(&key(f.ns, 2), h1.version()).is_err());
    // LRU eviction: the fourth block takes the oldest unpinned one's page.
    let h3 = f.put(s, key(f.ns, 3), b"3");
    f.put(s, key(f.ns, 4), &bytes(4, 100));
    assert_eq!(f.store.stats().counters.evictions, 1);
    // Quarantine after a failed verified read.
    f.store.acquire(s, &[key(f.ns, 3)], None).unwrap();
    f.corrupt(&h3);
    let mut out = [0u8; 1];
    assert!(f.store.read(s, &h3, &mut out, true).is_err());
    // Touching, looking up and reading log nothing.
    f.store.touch(&[key(f.ns, 4)]);
    f.store.lookup(&[key(f.ns, 4), key(f.ns, 9)]).unwrap();
    assert_eq!(
        f.events_from(0),
        [
            (Stored, 1),
            (Stored, 2),
            (Removed, 1),
            (Stored, 3),
            (Removed, 2), // evicted to make room for 4, before 4 was published
            (Stored, 4),
            (Removed, 3),
        ]
    );
    // The quarantined page returning to the pool later is no new event.
    f.store.release(s, &[h3]).unwrap();
    f.clock.advance(1_000);
    assert_eq!(f.store.reap(10).quarantine_released, 1);
    assert_eq!(f.events_from(8), []);
    f.invariants();
}

#[test]
fn unfinished_blocks_were_never_visible_and_log_nothing() {
    let f = fixture(4);
    let s = f.session();
    let dying = f.store.open_session("dying", 100).unwrap();
    let hs = f.alloc(s, &[1, 2]);
    f.store.write(s, &hs[1], 0, b"x").unwrap();
    f.store.seal(s, &hs[1], 1, None).unwrap();
    f.store.abort(s, &hs).unwrap();
    let a = f
        .store
        .alloc(dying, &[key(f.ns, 3)], BlockClass::Cache, None)
        .unwrap();
    assert!(a[0].is_ok());
    f.clock.advance(100);
    assert_eq!(f.store.reap(10).sessions_expired, 1);
    assert_eq!(f.store.stats().accounting.free, 4);
    let b = f.store.events(0, 16).unwrap();
    assert_eq!((b.events.len(), b.next_seq, b.lost), (0, 1, 0));
    f.invariants();
}

#[test]
fn a_checkpoint_logs_stored_at_extend_and_removed_at_supersede_end_and_expiry() {
    let f = fixture(16);
    let s = f.session();
    let chain = |req: u8| {
        let mut t = block_tags(&f.ns, 4, &(0..8).collect::<Vec<u32>>()).unwrap();
        for (k, t) in t.iter_mut().enumerate() {
            t.0[0] = req * 10 + k as u8;
        }
        t
    };
    // Request 1: two blocks at epoch 1, superseded by epoch 2, which ends.
    let req = 1;
    f.store.manifest_begin(s, req, 1, f.ns, 0, 5_000).unwrap();
    checkpoint_step(&f, s, req, 1, &chain(1), 8).unwrap();
    f.store.manifest_begin(s, req, 2, f.ns, 0, 5_000).unwrap();
    checkpoint_step(&f, s, req, 2, &chain(2)[..1], 4).unwrap();
    f.store.manifest_end(req, 2).unwrap();
    // Request 3: one block, left to expire.
    let req = 3;
    f.store.manifest_begin(s, req, 1, f.ns, 0, 1_000).unwrap();
    checkpoint_step(&f, s, req, 1, &chain(3)[..1], 4).unwrap();
    f.clock.advance(1_000);
    assert_eq!(f.store.reap(10).manifests_expired, 1);
    assert_eq!(
        f.events_from(0),
        [
            (Stored, 10),
            (Stored, 11),
            (Removed, 10), // superseded
            (Removed, 11),
            (Stored, 20),
            (Removed, 20), // ended
            (Stored, 30),
            (Removed, 30), // expired
        ]
    );
    f.invariants();
}

#[test]
fn a_full_ring_drops_the_oldest_events_and_says_how_many_a_reader_lost() {
    let f = fixture_with(8, |c| c.event_log_capacity = 4);
    let s = f.session();
    for n in 1..=6 {
        f.put(s, key(f.ns, n), b"x");
    }
    // A reader from the start missed events 1 and 2.
    let b = f.store.events(0, 100).unwrap();
    assert_eq!(b.lost, 2);
    let seqs: Vec<u64> = b.events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, [3, 4, 5, 6]);
    assert_eq!(b.events[0].key, key(f.ns, 3));
    assert_eq!(b.next_seq, 7);
    // A reader at 2 missed one; a reader at 3 missed none.
    assert_eq!(f.store.events(2, 100).unwrap().lost, 1);
    assert_eq!(f.store.events(3, 100).unwrap().lost, 0);
    // Caught up: nothing, and no loss.
    let b = f.store.events(7, 100).unwrap();
    assert_eq!((b.events.len(), b.next_seq, b.lost), (0, 7, 0));
    // A sequence number past the end comes from another incarnation.
    let e = f.store.events(8, 100).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    f.invariants();
}

#[test]
fn events_drain_in_batches_of_at_most_max_and_max_batch() {
    let f = fixture_with(8, |c| c.max_batch = 3);
    let s = f.session();
    for n in 1..=7 {
        f.put(s, key(f.ns, n), b"x");
    }
    let mut since = 0;
    let mut sizes = Vec::new();
    let mut tags = Vec::new();
    // Bounded: seven events need at most seven batches.
    for _ in 0..7 {
        let b = f.store.events(since, 100).unwrap();
        if b.events.is_empty() {
            break;
        }
        sizes.push(b.events.len());
        tags.extend(b.events.iter().map(|e| e.key.tag.0[0]));
        since = b.next_seq;
    }
    assert_eq!(sizes, [3, 3, 1], "max_batch bounds a batch");
    assert_eq!(tags, [1, 2, 3, 4, 5, 6, 7]);
    let b = f.store.events(1, 2).unwrap();
    assert_eq!((b.events.len(), b.next_seq), (2, 3), "max bounds it too");
    let b = f.store.events(1, 0).unwrap();
    assert_eq!((b.events.len(), b.next_seq, b.lost), (0, 1, 0));
}

#[test]
fn the_event_log_capacity_is_bounded() {
    for bad in [0, events::MAX_EVENT_LOG_CAPACITY + 1] {
        let mut cfg = StoreConfig::new(PoolConfig {
            page_size_bytes: PAGE,
            page_count: 2,
            huge_pages: HugePages::Off,
        });
        cfg.event_log_capacity = bad;
        let e = Store::new(cfg, ManualClock::new(0)).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{bad}: {e}");
    }
}

// ----- instance groups -----

impl Fixture {
    /// Allocate, write and seal cache blocks for `tags` (not published); their handles.
    fn sealed(&self, sid: SessionId, tags: &[u8]) -> Vec<Handle> {
        let hs = self.alloc(sid, tags);
        for (h, t) in hs.iter().zip(tags) {
            self.store.write(sid, h, 0, &bytes(*t, 100)).unwrap();
            self.store.seal(sid, h, 100, None).unwrap();
        }
        hs
    }

    fn visible(&self, tags: &[u8]) -> Vec<bool> {
        let keys: Vec<BlockKey> = tags.iter().map(|&n| key(self.ns, n)).collect();
        self.store
            .lookup(&keys)
            .unwrap()
            .iter()
            .map(Option::is_some)
            .collect()
    }
}

#[test]
fn an_instance_step_is_published_only_when_every_rank_committed_it() {
    let f = fixture(16);
    let (r0, r1) = (f.session(), f.session());
    f.store.instance_join(r0, 7, 1, 0, 2).unwrap();
    f.store.instance_join(r1, 7, 1, 1, 2).unwrap();
    f.store.instance_join(r1, 7, 1, 1, 2).unwrap(); // idempotent
    let a = f.sealed(r0, &[1, 2]);
    let b = f.sealed(r1, &[3, 4]);
    assert!(
        !f.store.instance_commit(r0, 7, 1, 0, &a).unwrap(),
        "rank 1 has not committed"
    );
    assert_eq!(
        f.visible(&[1, 2, 3, 4]),
        vec![false; 4],
        "nothing visible yet"
    );
    assert!(
        f.store.instance_commit(r1, 7, 1, 0, &b).unwrap(),
        "the last rank publishes"
    );
    assert_eq!(
        f.visible(&[1, 2, 3, 4]),
        vec![true; 4],
        "every rank's blocks at once"
    );
    let r = &f.store.instances(10)[0];
    assert_eq!(
        (
            r.ranks_joined,
            r.open_steps,
            r.steps_published,
            r.failed.clone()
        ),
        (2, 0, 1, None)
    );
    f.invariants();
}

#[test]
fn a_dead_rank_fails_the_instance_and_aborts_its_open_steps_on_every_rank() {
    let f = fixture(16);
    let (r0, r1) = (f.session(), f.session());
    f.store.instance_join(r0, 7, 1, 0, 2).unwrap();
    f.store.instance_join(r1, 7, 1, 1, 2).unwrap();
    let a = f.sealed(r0, &[1, 2]);
    let _b = f.sealed(r1, &[3, 4]);
    assert!(!f.store.instance_commit(r0, 7, 1, 0, &a).unwrap());
    let free_before = f.store.stats().accounting.free;
    // rank 1's session ends before it commits
    f.store.close_session(r1);
    let st = f.store.stats().accounting;
    assert_eq!(
        st.free,
        free_before + 4,
        "both ranks' blocks of the step are freed"
    );
    assert_eq!((st.sealed, st.published), (0, 0));
    assert_eq!(f.visible(&[1, 2, 3, 4]), vec![false; 4]);
    // the instance is failed as a whole: its other rank is told so
    let e = f.store.instance_commit(r0, 7, 1, 1, &[]).unwrap_err();
    assert!(
        matches!(e, Error::Unavailable(_)) && e.to_string().contains("rank 1"),
        "{e}"
    );
    let e = f.store.instance_join(f.session(), 7, 1, 1, 2).unwrap_err();
    assert!(matches!(e, Error::Unavailable(_)), "{e}");
    assert!(f.store.instances(10)[0].failed.is_some());
    // a new generation of the instance replaces it
    let (n0, n1) = (f.session(), f.session());
    f.store.instance_join(n0, 7, 2, 0, 2).unwrap();
    f.store.instance_join(n1, 7, 2, 1, 2).unwrap();
    assert!(matches!(
        f.store.instance_join(r0, 7, 1, 0, 2),
        Err(Error::StaleEpoch { .. })
    ));
    f.invariants();
}

#[test]
fn instance_calls_with_bad_arguments_change_nothing() {
    let f = fixture(16);
    let (r0, r1, other) = (f.session(), f.session(), f.session());
    for (rank, count) in [(0, 0), (2, 2), (0, MAX_RANKS_PLUS_ONE)] {
        assert!(
            f.store.instance_join(r0, 1, 1, rank, count).is_err(),
            "rank {rank} of {count}"
        );
    }
    f.store.instance_join(r0, 1, 1, 0, 2).unwrap();
    assert!(
        f.store.instance_join(r1, 1, 1, 0, 2).is_err(),
        "rank 0 is taken"
    );
    assert!(
        f.store.instance_join(r1, 1, 1, 1, 3).is_err(),
        "another rank count"
    );
    assert!(
        f.store.instance_join(r0, 2, 1, 0, 2).is_err(),
        "a rank of another instance"
    );
    f.store.instance_join(r1, 1, 1, 1, 2).unwrap();
    let mine = f.sealed(r0, &[1]);
    let theirs = f.sealed(other, &[2]);
    // not a rank; another session's block; an unsealed block; a step twice
    assert!(f.store.instance_commit(other, 1, 1, 0, &theirs).is_err());
    assert!(f.store.instance_commit(r0, 1, 1, 0, &theirs).is_err());
    let unsealed = f.alloc(r0, &[3]);
    assert!(f.store.instance_commit(r0, 1, 1, 0, &unsealed).is_err());
    assert!(!f.store.instance_commit(r0, 1, 1, 0, &mine).unwrap());
    assert!(
        f.store.instance_commit(r0, 1, 1, 0, &mine).is_err(),
        "committed twice"
    );
    assert!(matches!(
        f.store.instance_commit(r0, 1, 9, 1, &[]),
        Err(Error::StaleEpoch { .. })
    ));
    assert_eq!(f.visible(&[1, 2, 3]), vec![false; 3]);
    f.invariants();
}

const MAX_RANKS_PLUS_ONE: u32 = crate::instances::MAX_RANKS + 1;

#[test]
fn alloc_for_write_marks_every_new_block_writing_and_says_which_keys_were_held_already() {
    let f = fixture(4);
    let s = f.session();
    f.put(s, key(f.ns, 1), b"held");
    let keys = [key(f.ns, 1), key(f.ns, 2), key(f.ns, 3)];
    let got = f
        .store
        .alloc_for_write(s, &keys, BlockClass::Cache, None)
        .unwrap();
    assert!(
        matches!(got[0], Err(Error::AlreadyExists(_))),
        "{:?}",
        got[0]
    );
    assert!(got[1..].iter().all(Result::is_ok), "{got:?}");
    let a = f.store.stats().accounting;
    assert_eq!(
        (a.writing, a.allocated),
        (2, 0),
        "both new blocks WRITING: {a:?}"
    );
    // a writer that dies leaves nothing behind
    f.store.close_session(s);
    assert_eq!(f.store.stats().accounting.writing, 0);
    f.invariants();
    // a whole call that cannot proceed (a dead session) allocates nothing
    let e = f
        .store
        .alloc_for_write(s, &keys[1..], BlockClass::Cache, None)
        .unwrap_err();
    assert!(e.to_string().contains("session"), "{e}");
    assert_eq!(f.store.stats().accounting.free, 3);
}

#[path = "holds_tests.rs"]
mod holds;
