//! Hand-off holds ([`crate::holds`]), one specification per test.

use super::*;
use crate::holds::HoldEnd;

/// Publish blocks `tags` (one session, which then closes: the hold alone keeps them).
fn published(f: &Fixture, tags: &[u8]) -> Vec<BlockKey> {
    let s = f.session();
    let keys: Vec<BlockKey> = tags.iter().map(|&n| key(f.ns, n)).collect();
    for k in &keys {
        f.put(s, *k, &bytes(k.tag.0[0], 100));
    }
    f.store.close_session(s);
    keys
}

#[test]
fn a_hold_keeps_its_run_after_the_writer_leaves_and_pins_only_the_leading_published_run() {
    let f = fixture(4);
    let keys = published(&f, &[1, 2, 4]);
    // 3 was never published: the run is 1, 2
    let asked = [keys[0], keys[1], key(f.ns, 3), keys[2]];
    let h = f.store.hold_begin(7, 1, &asked, 5_000).unwrap();
    assert_eq!(h.keys, keys[..2]);
    assert_eq!((h.epoch, h.bytes, h.expires_in_ms), (1, 200, 5_000));
    // held blocks are not evictable: filling the pool evicts 4 and nothing held
    let s = f.session();
    for n in 10..12 {
        f.put(s, key(f.ns, n), b"x");
    }
    let seen: Vec<bool> = f
        .store
        .lookup(&keys)
        .unwrap()
        .iter()
        .map(Option::is_some)
        .collect();
    assert_eq!(seen, [true, true, false]);
    let sum = f.store.holds_summary();
    assert_eq!((sum.holds, sum.blocks, sum.bytes), (1, 2, 200));
    f.invariants();
    assert!(f.store.hold_end(7, 1, HoldEnd::Ended));
    assert!(!f.store.hold_end(7, 1, HoldEnd::Ended), "ended once");
    assert_eq!(f.store.stats().counters.holds_ended, 1);
    assert_eq!(f.store.holds_summary(), HoldsSummary::default());
    f.invariants();
}

#[test]
fn a_fetch_is_served_only_for_the_live_epoch_and_the_keys_of_its_run() {
    let f = fixture(4);
    let keys = published(&f, &[1, 2, 3]);
    f.store.hold_begin(7, 2, &keys[..2], 5_000).unwrap();
    f.store.hold_check(7, 2, &keys[..2]).unwrap();
    f.store.hold_check(7, 2, &keys[1..2]).unwrap();
    let e = f.store.hold_check(7, 1, &keys[..1]).unwrap_err();
    assert!(
        matches!(e, Error::NotFound(_)) && e.to_string().contains("epoch 1"),
        "{e}"
    );
    let e = f.store.hold_check(8, 2, &keys[..1]).unwrap_err();
    assert!(
        matches!(e, Error::NotFound(_)),
        "another request's run: {e}"
    );
    let e = f.store.hold_check(7, 2, &keys[1..]).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(_)),
        "a block outside the run: {e}"
    );
    f.store.hold_end(7, 2, HoldEnd::Taken);
    assert!(f.store.hold_check(7, 2, &keys[..1]).is_err(), "ended");
    assert_eq!(f.store.stats().counters.holds_taken, 1);
    f.invariants();
}

#[test]
fn a_newer_epoch_supersedes_a_hold_and_an_older_or_ended_one_is_stale() {
    let f = fixture(4);
    let keys = published(&f, &[1, 2, 3]);
    f.store.hold_begin(7, 2, &keys[..1], 5_000).unwrap();
    let e = f.store.hold_begin(7, 1, &keys, 5_000).unwrap_err();
    assert!(matches!(e, Error::StaleEpoch { got: 1, current: 2 }), "{e}");
    f.clock.advance(1_000);
    // the same epoch again renews (idempotent), the run unchanged
    let h = f.store.hold_begin(7, 2, &keys, 5_000).unwrap();
    assert_eq!((h.keys.len(), h.age_ms, h.expires_in_ms), (1, 1_000, 5_000));
    let h = f.store.hold_begin(7, 3, &keys, 5_000).unwrap();
    assert_eq!((h.epoch, h.keys.len()), (3, 3));
    assert!(
        !f.store.hold_end(7, 2, HoldEnd::Ended),
        "an older epoch's end changes nothing"
    );
    assert!(
        f.store.hold_end(7, 9, HoldEnd::Ended),
        "a newer epoch's end ends it"
    );
    let e = f.store.hold_begin(7, 3, &keys, 5_000).unwrap_err();
    assert!(
        matches!(e, Error::StaleEpoch { .. }),
        "an ended epoch cannot come back: {e}"
    );
    f.store.hold_begin(7, 10, &keys, 5_000).unwrap();
    f.invariants();
}

#[test]
fn a_hold_nobody_fetches_is_released_by_the_reaper_and_counted() {
    let f = fixture(4);
    let keys = published(&f, &[1, 2]);
    f.store.hold_begin(7, 1, &keys, 2_000).unwrap();
    f.clock.advance(1_999);
    assert_eq!(f.store.reap(10).holds_expired, 0);
    f.clock.advance(1);
    assert_eq!(f.store.reap(10).holds_expired, 1);
    assert_eq!(f.store.stats().counters.holds_expired, 1);
    assert!(f.store.hold(7).is_err());
    // its blocks are ordinary cache blocks again: evictable
    let s = f.session();
    for n in 10..14 {
        f.put(s, key(f.ns, n), b"x");
    }
    assert_eq!(f.store.lookup(&keys).unwrap(), [None, None]);
    f.invariants();
}

#[test]
fn a_held_block_deleted_meanwhile_keeps_its_page_until_the_hold_ends() {
    let f = fixture(2);
    let keys = published(&f, &[1]);
    f.store.hold_begin(7, 1, &keys, 5_000).unwrap();
    let v = f.store.lookup(&keys).unwrap()[0].unwrap().handle.version();
    f.store.remove_if(&keys[0], v).unwrap();
    assert_eq!(f.store.stats().accounting.retired, 1);
    f.invariants();
    f.store.hold_end(7, 1, HoldEnd::Ended);
    assert_eq!(f.store.stats().accounting.retired, 0);
    assert_eq!(f.store.stats().accounting.free, 2);
    f.invariants();
}

#[test]
fn bad_holds_are_refused_and_change_nothing() {
    let f = fixture_with(4, |c| {
        c.max_manifests = 1;
        c.max_manifest_blocks = 2;
    });
    let keys = published(&f, &[1, 2, 3]);
    let other = NamespaceId([9; 32]);
    let foreign = BlockKey {
        namespace: other,
        tag: BlockTag([1; 32]),
    };
    for (req, epoch, ks, ttl) in [
        (0, 1, &keys[..1], 1_000),
        (7, 0, &keys[..1], 1_000),
        (7, 1, &keys[..0], 1_000),
        (7, 1, &keys[..], 1_000),
        (7, 1, &[keys[0], foreign][..], 1_000),
        (7, 1, &keys[..1], 0),
        (7, 1, &keys[..1], u64::MAX),
    ] {
        let e = f.store.hold_begin(req, epoch, ks, ttl).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    }
    let e = f
        .store
        .hold_begin(7, 1, &[key(f.ns, 9)], 1_000)
        .unwrap_err();
    assert!(matches!(e, Error::NotFound(_)), "nothing published: {e}");
    f.store.hold_begin(7, 1, &keys[..1], 1_000).unwrap();
    let e = f.store.hold_begin(8, 1, &keys[..1], 1_000).unwrap_err();
    assert!(matches!(e, Error::Overloaded { .. }), "{e}");
    assert_eq!(f.store.holds_summary().holds, 1);
    assert_eq!(f.store.stats().counters.holds_begun, 1);
    f.invariants();
}

#[test]
fn an_end_that_overtakes_the_begin_makes_the_late_begin_stale() {
    let f = fixture(4);
    let keys = published(&f, &[1, 2]);
    // the front cancelled epoch 2 before the prefill held its run
    assert!(!f.store.hold_end(7, 2, HoldEnd::Ended));
    for epoch in [1, 2] {
        let e = f.store.hold_begin(7, epoch, &keys, 5_000).unwrap_err();
        assert!(matches!(e, Error::StaleEpoch { current: 2, .. }), "{e}");
    }
    assert_eq!(f.store.holds_summary().holds, 0, "nothing pinned");
    // an end of an older epoch does not lower the mark; a newer attempt may hold
    assert!(!f.store.hold_end(7, 1, HoldEnd::Ended));
    assert!(f.store.hold_begin(7, 2, &keys, 5_000).is_err());
    f.store.hold_begin(7, 3, &keys, 5_000).unwrap();
    f.invariants();
}
