//! The local zero-copy data path through the real daemon: write, seal, publish and read back
//! through the mapped pool; sharing between clients; what a client may and may not touch.

mod support;

use kvd::Error;
use kvd::client::{Client, ClientOptions};
use kvd::protocol::SealItem;
use kvd::store::{BlockClass, BlockVersion, Handle};
use support::*;

const PAGE: usize = 256 * 1024;

#[test]
fn a_client_writes_seals_publishes_and_reads_back_byte_exact() {
    let d = Daemon::start(&[]);
    let mut c = d.client("writer", 10_000);
    assert_eq!(c.node_generation(), d.generation);
    assert_eq!(c.page_size(), PAGE as u64);
    let ns = c.register_namespace(&namespace()).unwrap();
    let keys = keys(ns, 1, 8);
    let allocs: Vec<_> = c
        .alloc(&keys, BlockClass::Cache, None)
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    let mut seals = Vec::new();
    for (i, a) in allocs.iter().enumerate() {
        let data = pattern(PAGE - i * 1000, i as u8);
        // In two pieces, the checksum carried from the first to the second.
        let (x, y) = data.split_at(data.len() / 3);
        let crc = c.write_with_crc(&a.handle, 0, x, 0).unwrap();
        let crc = c.write_with_crc(&a.handle, x.len() as u64, y, crc).unwrap();
        assert_eq!(crc, transport::local::crc32c(0, &data));
        seals.push(SealItem {
            handle: a.handle,
            len: data.len() as u64,
            checksum: Some(crc),
        });
    }
    // One block without a client checksum: the daemon computes it.
    seals[7].checksum = None;
    let sealed = c.seal(&seals).unwrap();
    for (i, r) in sealed.iter().enumerate() {
        let data = pattern(PAGE - i * 1000, i as u8);
        assert_eq!(*r.as_ref().unwrap(), transport::local::crc32c(0, &data));
    }
    let handles: Vec<Handle> = allocs.iter().map(|a| a.handle).collect();
    c.publish(&handles).unwrap();

    let tags: Vec<_> = keys.iter().map(|k| k.tag).collect();
    let hit = c.lookup_prefix(&ns, &tags, true, None).unwrap();
    assert_eq!(hit.blocks.len(), 8);
    assert!(hit.pinned);
    let mut buf = vec![0u8; PAGE];
    for (i, b) in hit.blocks.iter().enumerate() {
        let data = pattern(PAGE - i * 1000, i as u8);
        let n = c.read_verified(&b.handle, &mut buf).unwrap();
        assert_eq!(n as usize, data.len());
        assert!(buf[..data.len()] == data[..], "block {i} differs");
        assert!(c.block(&b.handle).unwrap().bytes() == &data[..]);
    }
    let released = c.release(&handles).unwrap();
    assert!(released.iter().all(|r| r.is_ok()));
    let st = d.status();
    assert_eq!(st.stats.accounting.published, 8);
    assert_eq!(st.stats.pins, 0);
    c.close().unwrap();
}

#[test]
fn two_clients_share_a_published_block() {
    let d = Daemon::start(&[]);
    let mut w = d.client("writer", 10_000);
    let mut r = d.client("reader", 10_000);
    let ns = w.register_namespace(&namespace()).unwrap();
    assert_eq!(r.register_namespace(&namespace()).unwrap(), ns);
    let k = keys(ns, 2, 1);
    let a = w
        .alloc(&k, BlockClass::Cache, None)
        .unwrap()
        .remove(0)
        .unwrap();
    let data = pattern(100_000, 7);
    let crc = w.write_with_crc(&a.handle, 0, &data, 0).unwrap();
    // Not visible before publish.
    assert_eq!(r.exists(&k).unwrap(), vec![false]);
    w.seal(&[SealItem {
        handle: a.handle,
        len: data.len() as u64,
        checksum: Some(crc),
    }])
    .unwrap();
    assert_eq!(r.exists(&k).unwrap(), vec![false]);
    w.publish(&[a.handle]).unwrap();
    assert_eq!(r.exists(&k).unwrap(), vec![true]);

    let rb = r.acquire(&k, Some(5_000)).unwrap().remove(0).unwrap();
    let wb = w.acquire(&k, Some(5_000)).unwrap().remove(0).unwrap();
    assert_eq!(rb.handle, wb.handle);
    assert_eq!(rb.offset, a.offset, "both map the same page");
    let mut got = vec![0u8; data.len()];
    r.read(&rb.handle, 0, &mut got).unwrap();
    assert_eq!(got, data);
    assert!(w.block(&wb.handle).unwrap().bytes() == &data[..]);
    assert_eq!(d.status().stats.pins, 2);
    // The writer leaving does not disturb the reader's pin.
    w.close().unwrap();
    let mut again = vec![0u8; data.len()];
    r.read_verified(&rb.handle, &mut again).unwrap();
    assert_eq!(again, data);
    r.release(&[rb.handle]).unwrap().remove(0).unwrap();
}

#[test]
fn a_client_touches_only_pages_its_session_holds() {
    let d = Daemon::start(&[]);
    let mut a = d.client("a", 10_000);
    let mut b = d.client("b", 10_000);
    let ns = a.register_namespace(&namespace()).unwrap();
    let k = keys(ns, 3, 2);
    let mine = a
        .alloc(&k[..1], BlockClass::Cache, None)
        .unwrap()
        .remove(0)
        .unwrap();
    // b never allocated or pinned it: its accessors refuse, naming why.
    let e = b.write(&mine.handle, 0, &[1, 2, 3]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let e = b.read(&mine.handle, 0, &mut [0u8; 3]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    // The daemon refuses b's seal of a's block too (the client table is not the only check).
    let e = b
        .seal(&[SealItem {
            handle: mine.handle,
            len: 3,
            checksum: None,
        }])
        .unwrap()
        .remove(0)
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    // Past the page's end.
    let e = a
        .write(&mine.handle, PAGE as u64 - 2, &[0u8; 3])
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let e = a.write(&mine.handle, u64::MAX, &[0u8; 3]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    // A sealed block is immutable: no more writes through the client.
    a.write(&mine.handle, 0, &[9u8; 16]).unwrap();
    a.seal(&[SealItem {
        handle: mine.handle,
        len: 16,
        checksum: None,
    }])
    .unwrap()
    .remove(0)
    .unwrap();
    let e = a.write(&mine.handle, 0, &[1u8]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    // A forged handle outside the pool.
    let forged = Handle {
        node_generation: d.generation,
        slot: 1_000_000,
        generation: 1,
    };
    let e = a
        .seal(&[SealItem {
            handle: forged,
            len: 1,
            checksum: None,
        }])
        .unwrap()
        .remove(0)
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    // A sealed length past the page.
    let big = a
        .alloc(&k[1..], BlockClass::Cache, None)
        .unwrap()
        .remove(0)
        .unwrap();
    let e = a
        .seal(&[SealItem {
            handle: big.handle,
            len: PAGE as u64 + 1,
            checksum: None,
        }])
        .unwrap()
        .remove(0)
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert!(d.status().stats.accounting.balanced());
}

#[test]
fn release_reports_stale_and_unpinned_entries_in_place() {
    let d = Daemon::start(&[]);
    let mut c = d.client("c", 10_000);
    let ns = c.register_namespace(&namespace()).unwrap();
    let k = keys(ns, 4, 1);
    put_one(&mut c, k[0], &[5u8; 64]);
    let b = c.acquire(&k, None).unwrap().remove(0).unwrap();
    let stale = Handle {
        generation: b.handle.generation + 100,
        ..b.handle
    };
    let r = c.release(&[b.handle, stale, b.handle]).unwrap();
    assert!(r[0].is_ok());
    assert!(
        matches!(r[1], Err(Error::StaleGeneration { .. })),
        "{:?}",
        r[1]
    );
    assert!(matches!(r[2], Err(Error::NotFound(_))), "{:?}", r[2]);
    // Compare-and-delete of the wrong version fails, of the right one succeeds.
    let r = c
        .remove_if(&[(
            k[0],
            BlockVersion {
                generation: b.handle.generation + 1,
                ..b.handle.version()
            },
        )])
        .unwrap();
    assert!(matches!(r[0], Err(Error::StaleGeneration { .. })));
    let r = c.remove_if(&[(k[0], b.handle.version())]).unwrap();
    assert!(r[0].is_ok());
    assert_eq!(c.exists(&k).unwrap(), vec![false]);
}

#[test]
fn the_session_limit_answers_overloaded_with_a_retry_hint() {
    // One test process holds both sessions: lift the per-process share to the whole limit.
    let d = Daemon::start(&[
        "--max-sessions",
        "2",
        "--max-sessions-per-process",
        "2",
        "--max-sessions-per-uid",
        "2",
    ]);
    let _a = d.client("a", 10_000);
    let _b = d.client("b", 10_000);
    let e = kvd::client::Client::connect(&d.socket, &options("c", 10_000)).unwrap_err();
    assert!(e.is_retryable(), "{e}");
    assert!(
        matches!(e, Error::Overloaded { retry_after_ms, .. } if retry_after_ms > 0),
        "{e}"
    );
    drop(_a);
    // The freed place is usable again (the daemon noticed the close).
    wait_until(
        std::time::Duration::from_secs(20),
        "a session slot frees",
        || kvd::client::Client::connect(&d.socket, &options("c", 10_000)).is_ok(),
    );
}

#[test]
fn a_batch_over_the_limit_is_refused_whole() {
    let d = Daemon::start(&["--max-batch", "16"]);
    let mut c = d.client("c", 10_000);
    assert_eq!(c.welcome().max_batch, 16);
    let ns = c.register_namespace(&namespace()).unwrap();
    let k = keys(ns, 5, 17);
    let e = c.exists(&k).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    // Past the client's own check, the daemon refuses it as well.
    let e = c.call(kvd::protocol::Op::Exists { keys: k }).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert_eq!(c.exists(&keys(ns, 5, 16)).unwrap(), vec![false; 16]);
}

#[test]
fn a_checkpoint_is_published_into_its_manifest_and_restored_by_another_client() {
    use kvd::keys::{BlockKey, block_tags};
    let d = Daemon::start(&[]);
    let mut holder = d.client("checkpoint-writer", 10_000);
    let desc = namespace();
    let ns = holder.register_namespace(&desc).unwrap();
    let req = 77;
    let tokens: Vec<u32> = (0..3 * desc.tokens_per_block).collect();
    let tags = block_tags(&ns, desc.tokens_per_block, &tokens).unwrap();
    let keys: Vec<BlockKey> = tags
        .iter()
        .map(|t| BlockKey {
            namespace: ns,
            tag: *t,
        })
        .collect();
    let m = holder
        .manifest_begin(req, 1, &ns, 3 * PAGE as u64, 60_000)
        .unwrap();
    assert_eq!(m.committed_tokens, 0);
    // Two of the three blocks are checkpointed.
    let allocs: Vec<_> = holder
        .alloc(
            &keys[..2],
            BlockClass::Checkpoint {
                request: req,
                epoch: 1,
            },
            None,
        )
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    let seals = support::write_all(&mut holder, &allocs, |i| pattern(65_536, 40 + i as u8));
    assert!(holder.seal(&seals).unwrap().iter().all(|r| r.is_ok()));
    let handles: Vec<Handle> = allocs.iter().map(|a| a.handle).collect();
    let committed = 2 * desc.tokens_per_block as u64;
    let m = holder.manifest_extend(req, 1, &handles, committed).unwrap();
    assert_eq!(m.tags, tags[..2].to_vec());
    // An older epoch is dropped.
    let e = holder
        .manifest_extend(req, 0, &handles, committed)
        .unwrap_err();
    assert!(
        matches!(e, Error::StaleEpoch { .. } | Error::NotFound(_)),
        "{e}"
    );
    assert!(holder.manifest_renew(req, 1, 60_000).unwrap() > 0);

    // The recovering worker asks with the token history.
    let mut survivor = d.client("survivor", 10_000);
    let r = survivor.restore_prefix(req, &tokens).unwrap();
    assert_eq!(r.epoch, 1);
    assert_eq!(r.tokens, committed);
    assert_eq!(r.blocks.len(), 2);
    let got = survivor.acquire(&keys[..2], None).unwrap();
    let mut buf = vec![0u8; PAGE];
    for (i, b) in got.into_iter().enumerate() {
        let b = b.unwrap();
        let n = survivor.read_verified(&b.handle, &mut buf).unwrap() as usize;
        assert_eq!(&buf[..n], &pattern(65_536, 40 + i as u8)[..]);
        survivor.release(&[b.handle]).unwrap().remove(0).unwrap();
    }
    assert_eq!(survivor.manifest(req).unwrap().committed_tokens, committed);
    // The request ends: its checkpoint is released.
    holder.manifest_end(req, 1).unwrap();
    wait_until(
        std::time::Duration::from_secs(10),
        "the checkpoint's pages return",
        || d.status().stats.accounting.published == 0,
    );
    assert_eq!(survivor.exists(&keys).unwrap(), vec![false; 3]);
}

#[test]
fn a_reservation_fails_fast_when_it_does_not_fit() {
    let d = Daemon::start(&[]);
    let mut c = d.client("reserver", 10_000);
    let r = c.reserve(4 * PAGE as u64).unwrap();
    let e = c.reserve(1 << 40).unwrap_err();
    assert!(e.is_retryable(), "{e}");
    assert!(matches!(e, Error::NoSpace { .. }), "{e}");
    c.release_reservation(r).unwrap();
}

/// With both ends polling before they sleep (`--spin-us`, `ClientOptions::spin_us`), the
/// answers are the same: a write read back byte-exact, calls that outlast the budget (a sleep
/// between them disarms the poll, a quick call re-arms it), and a client that goes away while
/// its session polls for the next request ends that session at once.
#[test]
fn polling_ends_answer_as_blocking_ones_and_a_vanished_client_ends_its_session() {
    let d = Daemon::start(&["--spin-us", "200"]);
    let opts = ClientOptions {
        spin_us: 200,
        ..options("spinner", 10_000)
    };
    let mut c = Client::connect(&d.socket, &opts).unwrap();
    let ns = c.register_namespace(&namespace()).unwrap();
    let keys = keys(ns, 7, 4);
    for (i, k) in keys.iter().enumerate() {
        put_one(&mut c, *k, &pattern(PAGE - i, i as u8));
        // a pause longer than the budget on every other call
        if i % 2 == 0 {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        assert!(c.heartbeat().unwrap() > 0);
    }
    assert_eq!(c.exists(&keys).unwrap(), vec![true; 4]);
    let tags: Vec<_> = keys.iter().map(|k| k.tag).collect();
    let hit = c.lookup_prefix(&ns, &tags, true, None).unwrap();
    assert_eq!(hit.blocks.len(), 4);
    let mut buf = vec![0u8; PAGE];
    for (i, b) in hit.blocks.iter().enumerate() {
        let n = c.read_verified(&b.handle, &mut buf).unwrap() as usize;
        assert!(
            buf[..n] == pattern(PAGE - i, i as u8)[..],
            "block {i} differs"
        );
    }
    let before = d.status().stats.sessions;
    // dropped without a goodbye, while the daemon's session polls for its next request
    drop(c);
    wait_until(
        std::time::Duration::from_secs(10),
        "the vanished client's session to end",
        || d.status().stats.sessions < before,
    );
}
