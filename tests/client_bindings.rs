//! What kvd-client offers bindings in other languages (libkvd, the Python package) beyond the
//! borrow-checked API: the pool's address, the view check by handle, and the health canary.

mod support;

use kvd::Error;
use support::*;

#[test]
fn a_health_check_writes_reads_back_and_removes_its_canary() {
    let d = Daemon::start(&[]);
    let mut c = d.client("canary", 30_000);
    let before = c.stats().unwrap();
    let r = c.health_check().unwrap();
    assert_eq!(r.bytes, kvd::client::CANARY_BYTES as u64);
    assert!(r.elapsed_us > 0);
    let after = c.stats().unwrap();
    assert_eq!(
        after.counters.blocks_published,
        before.counters.blocks_published + 1
    );
    assert_eq!(
        after.counters.blocks_removed,
        before.counters.blocks_removed + 1
    );
    assert_eq!(after.accounting.published, 0, "nothing left behind");
    assert_eq!(after.pins, 0);
    // Twice in a row: each canary has its own key.
    c.health_check().unwrap();
}

#[test]
fn the_pool_mapping_shows_a_pinned_blocks_bytes_at_its_offset_until_the_page_moves() {
    let d = Daemon::start(&[]);
    let mut c = d.client("mapper", 30_000);
    let ns = c.register_namespace(&namespace()).unwrap();
    let data = pattern(8192, 5);
    let k = keys(ns, 5, 1)[0];
    put_one(&mut c, k, &data);
    let m = c.pool_mapping();
    assert_eq!(m.page_size, 256 * 1024);
    assert_eq!(m.len, m.page_size * m.page_count as u64);
    assert!(m.fd >= 0 && !m.base.is_null());
    let b = c.acquire(&[k], None).unwrap().remove(0).unwrap();
    // SAFETY: the block is pinned and sealed (immutable), and lies inside the mapping, which
    // lives as long as `c`.
    let bytes = unsafe { std::slice::from_raw_parts(m.base.add(b.offset as usize), data.len()) };
    assert_eq!(bytes, &data[..]);
    c.view_still_valid(&b.handle).unwrap();

    // Unpinned and removed: the page is freed and its word says so.
    c.release(&[b.handle]).unwrap();
    c.remove_if(&[(k, b.handle.version())])
        .unwrap()
        .remove(0)
        .unwrap();
    let e = c.view_still_valid(&b.handle).unwrap_err();
    assert!(matches!(e, Error::StaleGeneration { .. }), "{e}");
}

#[test]
fn a_submitter_runs_lookups_off_the_callers_thread_within_its_bound() {
    use kvd::client::{AsyncOp, AsyncReply, Submitter};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    let d = Daemon::start(&[]);
    let mut c = d.client("async", 30_000);
    let ns = c.register_namespace(&namespace()).unwrap();
    let ks = keys(ns, 6, 2);
    for k in &ks {
        put_one(&mut c, *k, &pattern(4096, 6));
    }
    let tags: Vec<_> = ks.iter().map(|k| k.tag).collect();
    let shared = Arc::new(Mutex::new(Some(c)));
    let s = Submitter::start(Arc::clone(&shared), 1).unwrap();
    let op = AsyncOp::LookupPrefix {
        namespace: ns,
        tags,
        pin: false,
        pin_ttl_ms: None,
    };
    s.submit(7, 70, op.clone()).unwrap();
    let e = s.submit(8, 80, op.clone()).unwrap_err();
    assert!(matches!(e, Error::Overloaded { .. }), "{e}");
    let done = s.poll(4, Duration::from_secs(30));
    assert_eq!(done.len(), 1);
    assert_eq!((done[0].user_tag, done[0].context), (7, 70));
    match &done[0].result {
        Ok(AsyncReply::Prefix(hit)) => assert_eq!(hit.blocks.len(), 2),
        r => panic!("unexpected {r:?}"),
    }
    assert!(s.poll(4, Duration::ZERO).is_empty());
    s.submit(9, 90, op).unwrap(); // the bound frees as completions are polled
    assert_eq!(s.poll(1, Duration::from_secs(30))[0].user_tag, 9);
    assert!(Submitter::start(shared, 0).is_err());
}
