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
