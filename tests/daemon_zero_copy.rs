//! Zero-copy reads across processes: a view held past its pin never passes for the block's
//! bytes once its page holds another block, and the page-generation table that tells it is
//! read-only for every client.

mod support;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use kvd::Error;
use kvd::protocol::{Hello, HelloReply, fdpass, frame};
use kvd::store::BlockClass;
use support::*;

#[test]
fn a_view_held_past_its_pin_reports_stale_and_never_passes_for_another_blocks_bytes() {
    // Four pages: a writer filling the pool must evict the reader's block once its pin is gone.
    let d = Daemon::start(&["--pool-mib", "1"]);
    let mut w = d.client("writer", 30_000);
    let mut r = d.client("reader", 30_000);
    let ns = w.register_namespace(&namespace()).unwrap();
    let first = pattern(65_536, 1);
    let k = keys(ns, 1, 1)[0];
    put_one(&mut w, k, &first);
    let b = r.acquire(&[k], Some(300)).unwrap().remove(0).unwrap();
    assert_eq!(b.pin_ttl_ms, 300);
    let view = r.block(&b.handle).unwrap();
    assert_eq!(view.bytes(), &first[..]);
    view.still_valid().unwrap();

    // The pin expires; the writer fills the pool, which evicts the block and reuses its page.
    wait_until(Duration::from_secs(20), "the pin expires", || {
        d.status().stats.pins == 0
    });
    let second = pattern(65_536, 2);
    let fresh = keys(ns, 2, 4);
    let allocs: Vec<_> = w
        .alloc(&fresh, BlockClass::Cache, None)
        .unwrap()
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert!(
        allocs.iter().any(|a| a.handle.slot == b.handle.slot),
        "the evicted block's page went to the writer"
    );
    for a in &allocs {
        w.write(&a.handle, 0, &second).unwrap();
    }
    assert_eq!(w.exists(&[k]).unwrap(), vec![false], "evicted");

    // The view's bytes are now the other block's; the guard says so.
    assert_eq!(view.bytes(), &second[..], "the page really was reused");
    let e = view.still_valid().unwrap_err();
    assert!(
        matches!(e, Error::StaleGeneration { handle_slot, current_slot, .. }
            if handle_slot == b.handle.generation && current_slot > handle_slot),
        "{e}"
    );
    // Neither a copy nor a new view hands out the other block's bytes.
    let mut buf = vec![0u8; first.len()];
    assert!(r.read(&b.handle, 0, &mut buf).is_err());
    assert!(r.read_verified(&b.handle, &mut buf).is_err());
    assert!(r.with_block(&b.handle, |bytes| bytes.to_vec()).is_err());
    assert!(r.block(&b.handle).is_err());
}

#[test]
fn a_view_taken_and_checked_within_its_pin_is_valid() {
    let d = Daemon::start(&[]);
    let mut c = d.client("reader", 30_000);
    let ns = c.register_namespace(&namespace()).unwrap();
    let data = pattern(100_000, 3);
    let k = keys(ns, 3, 1)[0];
    put_one(&mut c, k, &data);
    let b = c.acquire(&[k], None).unwrap().remove(0).unwrap();
    let sum = c
        .with_block(&b.handle, |bytes| {
            bytes.iter().map(|&x| x as u64).sum::<u64>()
        })
        .unwrap();
    assert_eq!(sum, data.iter().map(|&x| x as u64).sum::<u64>());
    let mut buf = vec![0u8; data.len()];
    c.read(&b.handle, 0, &mut buf).unwrap();
    assert_eq!(buf, data);
}

#[test]
fn the_page_table_cannot_be_mapped_writable_or_written_by_a_client() {
    let d = Daemon::start(&[]);
    let mut c = d.client("writer", 30_000);
    let ns = c.register_namespace(&namespace()).unwrap();
    let a = put_one(&mut c, keys(ns, 4, 1)[0], &pattern(4096, 4));

    // A raw handshake, as any process admitted by the socket can do it.
    let mut s = UnixStream::connect(&d.socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(&frame::encode(&Hello::new("prober", 10_000)).unwrap())
        .unwrap();
    let mut buf = [0u8; 4096];
    let (n, fds) = fdpass::recv_with_fds(std::os::fd::AsFd::as_fd(&s), &mut buf).unwrap();
    let welcome = match frame::decode_frame::<HelloReply>(&buf[..n]).unwrap() {
        HelloReply::Welcome(w) => w,
        r => panic!("unexpected {r:?}"),
    };
    assert_eq!(fds.len(), 2, "the pool's fd and the page table's");
    let table = std::fs::File::from(fds.into_iter().nth(1).unwrap());
    let len = welcome.page_count as usize * 8;

    let writable = unsafe_free_mmap(&table, len, true);
    assert_eq!(
        writable,
        Err(rustix::io::Errno::PERM),
        "a writable mapping is refused"
    );
    assert_eq!(
        rustix::io::pwrite(&table, &[0xff; 8], 0),
        Err(rustix::io::Errno::PERM)
    );
    assert_eq!(
        rustix::fs::ftruncate(&table, 0),
        Err(rustix::io::Errno::PERM)
    );
    // Read-only works, and says who holds the page.
    let words = unsafe_free_mmap(&table, len, false).expect("a read-only mapping");
    let at = a.handle.slot as usize * 8;
    let word = u64::from_le_bytes(words[at..at + 8].try_into().unwrap());
    assert_eq!(word, a.handle.generation << 1);
}

/// Map `len` bytes of `f` shared (writable or not) through memmap2 and copy them out.
fn unsafe_free_mmap(
    f: &std::fs::File,
    len: usize,
    writable: bool,
) -> Result<Vec<u8>, rustix::io::Errno> {
    let mut o = memmap2::MmapOptions::new();
    o.len(len);
    let m = if writable {
        o.map_raw(f)
    } else {
        o.map_raw_read_only(f)
    };
    let m = m.map_err(|e| rustix::io::Errno::from_raw_os_error(e.raw_os_error().unwrap_or(0)))?;
    // SAFETY: the mapping is `len` bytes long and lives until the end of this function; the
    // daemon writes its words atomically, and a torn word would only fail the assertion.
    Ok(unsafe { std::slice::from_raw_parts(m.as_ptr(), len) }.to_vec())
}
