//! Block events through the real daemon, as a KV-aware router drains them: what a node holds
//! (stored / removed) learned without polling lookups, in batches, in order, and a plain count
//! of what a router that fell behind the bounded log has lost.

mod support;

use std::process::Command;

use kvd::Error;
use kvd::error::Corruption;
use kvd::keys::BlockKey;
use kvd::store::{BlockEventKind, BlockVersion, EventBatch};
use support::*;

/// Drain everything after `since` in batches of `max`, at most `batches` of them (a bound:
/// the test knows how many events to expect). Returns the events and the batch sizes.
fn drain(
    c: &mut kvd::client::Client,
    mut since: u64,
    max: u32,
    batches: usize,
) -> (Vec<(u64, BlockEventKind, BlockKey)>, Vec<usize>, u64) {
    let mut events = Vec::new();
    let mut sizes = Vec::new();
    for _ in 0..batches {
        let EventBatch {
            events: batch,
            next_seq,
            lost,
        } = c.events(since, max).unwrap();
        assert_eq!(lost, 0, "nothing lost from a roomy ring");
        if batch.is_empty() {
            assert_eq!(next_seq, since.max(1), "an empty batch stays where it was");
            break;
        }
        sizes.push(batch.len());
        events.extend(batch.iter().map(|e| (e.seq, e.kind, e.key)));
        since = next_seq;
    }
    (events, sizes, since)
}

#[test]
fn a_router_drains_stored_and_removed_events_in_order_in_batches() {
    // Four pages: the sixth block evicts.
    let d = Daemon::start(&["--pool-mib", "1"]);
    let mut w = d.client("writer", 10_000);
    let mut router = d.client("router", 10_000);
    let ns = w.register_namespace(&namespace()).unwrap();
    let k = keys(ns, 42, 6);
    let empty = router.events(0, 16).unwrap();
    assert_eq!((empty.events.len(), empty.next_seq, empty.lost), (0, 1, 0));

    let data = pattern(8192, 1);
    let a: Vec<_> = k[..4].iter().map(|k| put_one(&mut w, *k, &data)).collect();
    // Compare-and-delete: one stale version (nothing happens), then the right one.
    let stale = BlockVersion {
        node_generation: d.generation,
        generation: a[0].handle.generation + 100,
    };
    assert!(w.remove_if(&[(k[0], stale)]).unwrap()[0].is_err());
    assert!(w.remove_if(&[(k[0], a[0].handle.version())]).unwrap()[0].is_ok());
    // Fill the pool: k[4] takes the free page, k[5] evicts the least recently used, k[1].
    put_one(&mut w, k[4], &data);
    put_one(&mut w, k[5], &data);
    // A page scribbled over fails the reader's check and the daemon's: quarantined.
    let b = w.acquire(&k[2..3], None).unwrap().remove(0).unwrap();
    scribble_on_the_pool(d.pid(), b.offset);
    let mut buf = vec![0u8; data.len()];
    let e = w.read_verified(&b.handle, &mut buf).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Corrupt {
                outcome: Corruption::Quarantined,
                ..
            }
        ),
        "{e}"
    );
    let st = d.status();
    assert_eq!(st.stats.counters.evictions, 1);

    use BlockEventKind::{Removed, Stored};
    let want = [
        (Stored, k[0]),
        (Stored, k[1]),
        (Stored, k[2]),
        (Stored, k[3]),
        (Removed, k[0]), // compare-and-delete
        (Stored, k[4]),
        (Removed, k[1]), // evicted for k[5]
        (Stored, k[5]),
        (Removed, k[2]), // quarantined
    ];
    let (got, sizes, next) = drain(&mut router, 0, 4, 10);
    assert_eq!(sizes, [4, 4, 1]);
    assert_eq!(next, 10);
    for (n, ((seq, kind, key), (want_kind, want_key))) in got.iter().zip(&want).enumerate() {
        assert_eq!(*seq, n as u64 + 1, "event {n}'s sequence number");
        assert_eq!((kind, key), (want_kind, want_key), "event {n}");
    }
    assert_eq!(got.len(), want.len());
    // What the events say is what lookups see.
    assert_eq!(
        w.exists(&k).unwrap(),
        [false, false, false, true, true, true]
    );
    // Bad questions get clear errors and change nothing.
    let e = router.events(0, 100_000).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let e = router.events(next + 1, 4).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert!(e.to_string().contains("resync"), "{e}");
    // The op is counted by name like every other.
    let (_, metrics) = d.get("/metrics");
    assert!(metrics.contains("op=\"events\""), "{metrics}");
}

#[test]
fn a_router_behind_a_small_ring_is_told_how_many_events_it_lost() {
    let d = Daemon::start(&["--event-log-capacity", "4"]);
    let mut w = d.client("writer", 10_000);
    let mut router = d.client("router", 10_000);
    let ns = w.register_namespace(&namespace()).unwrap();
    let k = keys(ns, 7, 10);
    let data = pattern(4096, 2);
    put_one(&mut w, k[0], &data);
    let first = router.events(0, 1).unwrap();
    assert_eq!((first.events[0].seq, first.next_seq), (1, 2));
    for key in &k[1..] {
        put_one(&mut w, *key, &data);
    }
    // Ten events, four kept: the router read one, so it lost five.
    let b = router.events(first.next_seq, 16).unwrap();
    assert_eq!(b.lost, 5);
    let seqs: Vec<u64> = b.events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, [7, 8, 9, 10]);
    let keys: Vec<BlockKey> = b.events.iter().map(|e| e.key).collect();
    assert_eq!(keys, k[6..]);
    assert!(b.events.iter().all(|e| e.kind == BlockEventKind::Stored));
    // After its resync the router goes on from next_seq, with nothing more lost.
    let after = router.events(b.next_seq, 16).unwrap();
    assert_eq!((after.events.len(), after.next_seq, after.lost), (0, 11, 0));
}

#[test]
fn the_event_log_capacity_flag_is_validated_and_documented() {
    let dir = tempfile::tempdir().unwrap();
    for bad in ["0", "1048577"] {
        let out = command(dir.path(), &["--event-log-capacity", bad])
            .output()
            .unwrap();
        assert!(!out.status.success(), "--event-log-capacity {bad} started");
        let log = std::fs::read_to_string(dir.path().join("daemon.log")).unwrap();
        assert!(
            log.contains("'--event-log-capacity <EVENT_LOG_CAPACITY>': ")
                && log.contains("not in 1..=1048576"),
            "{log}"
        );
    }
    let help = Command::new(env!("CARGO_BIN_EXE_kvd"))
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("--event-log-capacity"), "{help}");
}
