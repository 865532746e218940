//! Blocks between two real daemons over their data ports: a push of many blocks lands
//! byte-exact and published as one group; and the destination refuses what is not bound to it
//! (another incarnation, an older epoch), publishes nothing of a transfer that took a corrupted
//! chunk, and frees its pages.

mod support;

use std::time::Duration;

use kvd::daemon::transfer::wire::{PeerReply, PeerRequest};
use kvd::keys::BlockKey;
use kvd::protocol::{TransferState, WireError};
use support::Daemon;
use support::raw::{BLOCK, Net, RawSource, accepted, ask, commit_is_refused_as_corrupt};
use transport::engine::{OpFailure, Transport};

/// Transfers of these tests end within a minute.
fn wait_done(c: &mut kvd::client::Client, id: u64) -> kvd::protocol::TransferInfo {
    support::wait_transfer(c, id, Duration::from_secs(60))
}

#[test]
fn a_push_of_many_blocks_lands_byte_exact_and_published_on_the_peer() {
    let net = Net::new();
    let b = net.node(2, &[]);
    let a = net.node(1, &[]);

    let mut ca = a.client("engine-a", 30_000);
    let ns = ca.register_namespace(&support::namespace()).unwrap();
    let keys = support::keys(ns, 7, 48);
    for (i, k) in keys.iter().enumerate() {
        support::put_one(&mut ca, *k, &support::pattern(BLOCK - i, i as u8));
    }
    let id = ca.push(2, &keys).unwrap();
    let t = wait_done(&mut ca, id);
    assert_eq!(t.state, TransferState::Done, "{t:?}");
    assert_eq!(t.blocks, 48);
    println!("push of 48 blocks: {} ms", t.elapsed_ms);

    let mut cb = b.client("engine-b", 30_000);
    for (i, got) in cb.acquire(&keys, None).unwrap().into_iter().enumerate() {
        let info = got.expect("published on the peer");
        let mut buf = vec![0u8; BLOCK - i];
        assert_eq!(info.len as usize, buf.len());
        cb.read_verified(&info.handle, &mut buf).unwrap();
        assert!(
            buf == support::pattern(BLOCK - i, i as u8),
            "block {i} byte-exact"
        );
        cb.release(&[info.handle]).unwrap();
    }
    let sb = b.status();
    let tb = sb.data_port.unwrap().transfers;
    assert_eq!(tb.blocks_received, 48, "{tb:?}");
    let sa = a.status();
    assert_eq!(sa.stats.pins, 0, "the source's pins were released");
    // which engine moved the blocks, and why, per peer: TCP where this build or host has no
    // RDMA (every machine this project has run on), RDMA otherwise
    let tr = sa.data_port.as_ref().unwrap().transport.clone();
    let (want, backend) = if support::rdma_here() {
        ("rdma", transport::registry::Backend::Rdma)
    } else {
        ("tcp", transport::registry::Backend::Tcp)
    };
    assert_eq!(
        (tr.requested.as_str(), tr.preferred.as_str()),
        ("auto", want),
        "{tr:?}"
    );
    assert!(tr.reason.contains("RDMA"), "says why: {tr:?}");
    assert_eq!(tr.peers.get(&2), Some(&backend), "{tr:?}");
    let (_, ma) = a.get("/metrics");
    assert!(ma.contains("kvd_transfer_blocks_pushed_total 48"), "{ma}");
    assert!(
        ma.contains("kvd_transfer_duration_seconds_count{kind=\"push\"} 1"),
        "{ma}"
    );
    let (_, mb) = b.get("/metrics");
    assert!(mb.contains("kvd_transfer_blocks_received_total 48"), "{mb}");
    assert_eq!(sa.data_port.unwrap().transfers.transfers_done, 1);
    // a second push of the same keys moves nothing: the peer has them
    let id = ca.push(2, &keys).unwrap();
    let t = wait_done(&mut ca, id);
    assert_eq!(
        (t.state.clone(), t.blocks, t.bytes),
        (TransferState::Done, 0, 0),
        "{t:?}"
    );
    // a push to a node not in the table is refused at once
    let e = ca.push(9, &keys[..1]).unwrap_err();
    assert!(e.to_string().contains("peer table"), "{e}");

    // a third node fetches them from A (one key A lacks is skipped)
    let c = net.node(3, &[]);
    let mut cc = c.client("engine-c", 30_000);
    let mut wanted = keys.clone();
    wanted.push(support::keys(ns, 99, 1)[0]);
    let id = cc.fetch(1, &wanted).unwrap();
    let t = wait_done(&mut cc, id);
    assert_eq!(
        (t.state.clone(), t.blocks),
        (TransferState::Done, 48),
        "{t:?}"
    );
    println!("fetch of 48 blocks: {} ms", t.elapsed_ms);
    for (i, got) in cc.acquire(&keys, None).unwrap().into_iter().enumerate() {
        let info = got.expect("published on the fetching node");
        let mut buf = vec![0u8; BLOCK - i];
        cc.read_verified(&info.handle, &mut buf).unwrap();
        assert!(
            buf == support::pattern(BLOCK - i, i as u8),
            "fetched block {i} byte-exact"
        );
        cc.release(&[info.handle]).unwrap();
    }
    assert_eq!(cc.exists(&wanted[48..]).unwrap(), vec![false]);
    support::wait_until(
        Duration::from_secs(10),
        "the source's pins are released",
        || a.status().stats.pins == 0,
    );
    assert_eq!(a.status().data_port.unwrap().incoming_in_flight, 0);
}

#[test]
fn the_destination_refuses_other_incarnations_and_older_epochs_and_publishes_nothing_corrupt() {
    let net = Net::new();
    let mut b = net.node(2, &[]);
    let ns = support::namespace().id();
    let keys = support::keys(ns, 3, 2);
    let src = RawSource::new(&net, &b, 2);
    let free_pages = |d: &Daemon| d.status().stats.accounting.free;
    let free_before = free_pages(&b);

    // bound to another incarnation of the destination: refused, counted, nothing allocated
    let (mut s, generation) = src.control();
    let r = ask(&mut s, &src.offer(&keys, generation - 1, 0, 1));
    assert!(
        matches!(r, PeerReply::Refused(WireError::StaleGeneration { .. })),
        "{r:?}"
    );
    assert_eq!(free_pages(&b), free_before);

    // an older epoch of the same (source, request) after a newer one: refused
    let r = ask(&mut s, &src.offer(&keys[..1], generation, 9, 5));
    let PeerReply::Accepted { transfer, .. } = r else {
        panic!("{r:?}")
    };
    let r = ask(&mut s, &src.offer(&keys[1..], generation, 9, 4));
    assert!(
        matches!(r, PeerReply::Refused(WireError::StaleEpoch { .. })),
        "{r:?}"
    );
    assert_eq!(
        ask(&mut s, &PeerRequest::Abort { transfer }),
        PeerReply::Aborted
    );
    assert_eq!(
        free_pages(&b),
        free_before,
        "the aborted transfer's page is back"
    );

    // a transfer that took a corrupted chunk is not published, even when committed
    let r = ask(&mut s, &src.offer(&keys, generation, 0, 1));
    let (transfer, segment, offsets) = accepted(r);
    let ops = src.writes(transfer, &segment, &offsets);
    src.engine.inject_corrupt_chunk(1);
    let st = src.run(&ops);
    assert_eq!(st.first_failure, Some(OpFailure::Corrupt), "{st:?}");
    // a commit of it from another connection (as a replay would come) is refused, counted
    let (mut other, _) = src.control();
    let r = ask(&mut other, &PeerRequest::Commit { transfer });
    assert!(
        matches!(r, PeerReply::Refused(WireError::NotFound(_))),
        "{r:?}"
    );
    let cb = commit_is_refused_as_corrupt(&mut s, transfer, &b, &keys);
    assert_eq!(free_pages(&b), free_before, "its pages are back");
    let t = b.status().data_port.unwrap().transfers;
    assert!(
        t.binding_mismatches >= 3 && t.checksum_failures >= 1,
        "{t:?}"
    );

    // after a restart the destination is a new incarnation: an offer bound to the old one is
    // refused; one bound to the new one goes through
    drop(cb);
    drop(s);
    b.stop();
    let b2 = net.restart(2, &b.dir, &[]);
    assert!(b2.generation > generation);
    let src = RawSource::new(&net, &b2, 2);
    let (mut s, new_generation) = src.control();
    assert_eq!(new_generation, b2.generation);
    let r = ask(&mut s, &src.offer(&keys, generation, 0, 1));
    assert!(
        matches!(r, PeerReply::Refused(WireError::StaleGeneration { .. })),
        "{r:?}"
    );
    let r = ask(&mut s, &src.offer(&keys, new_generation, 0, 1));
    let PeerReply::Accepted { transfer, .. } = r else {
        panic!("{r:?}")
    };
    // the source goes away without a word: the destination aborts and frees the pages
    drop(s);
    support::wait_until(
        Duration::from_secs(10),
        "the orphaned transfer is aborted",
        || b2.status().data_port.unwrap().incoming_in_flight == 0,
    );
    let _ = transfer;
    assert_eq!(
        b2.status().stats.accounting.free,
        b2.status().stats.accounting.total
    );
}

#[test]
fn a_push_whose_link_is_cut_publishes_nothing_frees_the_destinations_pages_and_unpins_the_source() {
    let net = Net::new();
    let hosts = support::TwoHosts::new();
    let (args_b, args_a) = (
        net.args_at(2, "10.77.0.2:7461", &[]),
        net.args_at(1, "10.77.0.1:7461", &[]),
    );
    let b = Daemon::start_in_netns(&hosts.b, &support::strs(&args_b));
    let a = Daemon::start_in_netns(&hosts.a, &support::strs(&args_a));
    let mut ca = a.client("engine-a", 60_000);
    let mut cb = b.client("engine-b", 60_000);
    let ns = ca.register_namespace(&support::namespace()).unwrap();

    // across the link first: a push arrives whole
    let keys = support::keys(ns, 11, 8);
    for (i, k) in keys.iter().enumerate() {
        support::put_one(&mut ca, *k, &support::pattern(BLOCK, i as u8));
    }
    let id = ca.push(2, &keys).unwrap();
    assert_eq!(wait_done(&mut ca, id).state, TransferState::Done);
    assert_eq!(cb.exists(&keys).unwrap(), vec![true; 8]);

    // then slow the link so that the next push is surely in the middle, and cut it
    hosts.shape_a("40mbit", "32kb", "latency 100ms");
    let dev = hosts.dev_a();
    let keys = support::keys(ns, 12, 40);
    for (i, k) in keys.iter().enumerate() {
        support::put_one(&mut ca, *k, &support::pattern(BLOCK, i as u8));
    }
    let free_on_b = cb.stats().unwrap().accounting.free;
    let id = ca.push(2, &keys).unwrap();
    support::wait_until(
        Duration::from_secs(20),
        "the push has pages on the destination",
        || cb.stats().unwrap().accounting.free < free_on_b,
    );
    assert_eq!(
        ca.transfers(&[id]).unwrap()[0].state,
        TransferState::InFlight
    );
    let cut = std::time::Instant::now();
    support::ip(&["-n", &hosts.a, "link", "set", &dev, "down"]);

    let t = wait_done(&mut ca, id);
    let failed_after = cut.elapsed();
    println!(
        "link cut mid-push: the source reported {:?} after {failed_after:?}",
        t.state
    );
    assert!(matches!(t.state, TransferState::Failed(_)), "{t:?}");
    assert!(
        failed_after < Duration::from_secs(5 + 10),
        "within the stall timeout + margin; a's log:\n{}",
        a.log()
    );
    assert_eq!(
        ca.stats().unwrap().pins,
        0,
        "the source's pins are released"
    );
    // the failed peer is avoided locally for a short while
    let e = ca.push(2, &keys[..1]).unwrap_err();
    assert!(e.to_string().contains("avoided"), "{e}");

    support::wait_until(
        Duration::from_secs(30),
        "the destination frees the pages",
        || {
            let a = cb.stats().unwrap().accounting;
            a.free == free_on_b && a.writing == 0 && a.allocated == 0
        },
    );
    println!(
        "link cut mid-push: the destination freed its pages {:?} after the cut",
        cut.elapsed()
    );
    assert!(
        cut.elapsed() < Duration::from_secs(5 + 10),
        "the destination learns of the cut within the stall timeout + margin (its control \
         connection's kernel timeout), not at the data connections' wider backstop; b's log:\n{}",
        b.log()
    );
    assert_eq!(
        cb.exists(&keys).unwrap(),
        vec![false; 40],
        "nothing of the group is visible"
    );
}

#[test]
fn a_checkpoint_streamed_step_by_step_to_its_holder_restores_there_and_by_a_recovery_read() {
    use kvd::keys::block_tags;
    use kvd::store::{BlockClass, Handle};
    let net = Net::new();
    let holder = net.node(2, &[]);
    let worker = net.node(1, &[]);
    let successor = net.node(3, &[]);

    let desc = support::namespace();
    let mut w = worker.client("worker", 30_000);
    let ns = w.register_namespace(&desc).unwrap();
    let (req, epoch) = (4242, 3);
    let tpb = desc.tokens_per_block;
    let tokens: Vec<u32> = (0..6 * tpb).map(|t| t * 7 + 1).collect();
    let keys: Vec<BlockKey> = block_tags(&ns, tpb, &tokens)
        .unwrap()
        .into_iter()
        .map(|tag| BlockKey { namespace: ns, tag })
        .collect();
    w.manifest_begin(req, epoch, &ns, 0, 60_000).unwrap();
    // three steps of two blocks each: written here, extended here, streamed to the holder
    for step in 0..3 {
        let ks = &keys[2 * step..2 * step + 2];
        let class = BlockClass::Checkpoint {
            request: req,
            epoch,
        };
        let allocs: Vec<_> = w
            .alloc(ks, class, None)
            .unwrap()
            .into_iter()
            .map(|r| r.unwrap())
            .collect();
        let seals = support::write_all(&mut w, &allocs, |i| {
            support::pattern(BLOCK, (2 * step + i) as u8)
        });
        assert!(w.seal(&seals).unwrap().iter().all(|r| r.is_ok()));
        let handles: Vec<Handle> = allocs.iter().map(|a| a.handle).collect();
        let committed = ((2 * step + 2) as u32 * tpb) as u64;
        w.manifest_extend(req, epoch, &handles, committed).unwrap();
        let id = w
            .push_checkpoint(2, req, epoch, ks, committed, 60_000)
            .unwrap();
        let t = wait_done(&mut w, id);
        assert_eq!(
            (t.state.clone(), t.blocks),
            (TransferState::Done, 2),
            "step {step}: {t:?}"
        );
    }
    // the holder's manifest grew step by step to all six blocks
    let mut h = holder.client("holder", 30_000);
    let m = h.manifest(req).unwrap();
    assert_eq!(
        (m.epoch, m.tags.len(), m.committed_tokens),
        (epoch, 6, 6 * tpb as u64)
    );
    // restore there by token history: a history that diverges in block 4 uses blocks 0..4
    let mut diverged = tokens.clone();
    diverged[4 * tpb as usize + 1] = 99_999;
    let r = h.restore_prefix(req, &diverged).unwrap();
    assert_eq!((r.blocks.len(), r.tokens), (4, 4 * tpb as u64));
    // a step of an older epoch is refused by the holder
    let id = w
        .push_checkpoint(2, req, epoch - 1, &keys[..2], 2 * tpb as u64, 60_000)
        .unwrap();
    let t = wait_done(&mut w, id);
    assert!(
        matches!(t.state, TransferState::Failed(WireError::StaleEpoch { .. })),
        "{t:?}"
    );
    let (_, m) = worker.get("/metrics");
    assert!(
        m.contains("kvd_transfers_failed_total{reason=\"binding\"} 1"),
        "{m}"
    );
    let (_, m) = holder.get("/metrics");
    assert!(m.contains("kvd_transfer_binding_mismatches_total 1"), "{m}");

    // the recovery read: a successor fetches the longest verified prefix from the holder
    let mut s = successor.client("successor", 30_000);
    let id = s.fetch_prefix(2, req, &diverged).unwrap();
    let t = wait_done(&mut s, id);
    assert_eq!(
        (t.state.clone(), t.blocks, t.tokens),
        (TransferState::Done, 4, 4 * tpb as u64)
    );
    for (i, got) in s.acquire(&keys[..4], None).unwrap().into_iter().enumerate() {
        let info = got.expect("restored on the successor");
        let mut buf = vec![0u8; BLOCK];
        s.read_verified(&info.handle, &mut buf).unwrap();
        assert!(
            buf == support::pattern(BLOCK, i as u8),
            "block {i} byte-exact"
        );
        s.release(&[info.handle]).unwrap();
    }
    // nothing to restore for an unknown request: done, no tokens
    let id = s.fetch_prefix(2, 9999, &tokens).unwrap();
    let t = wait_done(&mut s, id);
    assert_eq!((t.state, t.blocks, t.tokens), (TransferState::Done, 0, 0));
}

#[test]
fn pushes_past_the_bound_are_refused_retryably_and_a_destination_out_of_space_says_so_before_any_byte_moves()
 {
    let net = Net::new();
    let b = net.node(2, &[]);
    let a = net.node(1, &["--pool-mib", "64", "--max-transfers-per-peer", "1"]);
    let mut ca = a.client("engine-a", 30_000);
    let ns = ca.register_namespace(&support::namespace()).unwrap();

    // more blocks than the destination's whole pool (16 MiB of 256 KiB pages there)
    let keys = support::keys(ns, 21, 80);
    for (i, k) in keys.iter().enumerate() {
        support::put_one(&mut ca, *k, &support::pattern(BLOCK, i as u8));
    }
    let free_on_b = b.status().stats.accounting.free;
    let id = ca.push(2, &keys).unwrap();
    let t = wait_done(&mut ca, id);
    assert!(
        matches!(t.state, TransferState::Failed(WireError::NoSpace { .. })),
        "{t:?}"
    );
    assert_eq!(
        b.status().data_port.unwrap().engine.chunks_served,
        0,
        "no byte moved"
    );
    assert_eq!(b.status().stats.accounting.free, free_on_b);

    // a second push while one is in flight, past the bound of one per peer: a retryable refusal
    let first = ca.push(2, &keys[..40]).unwrap();
    let e = ca.push(2, &keys[40..]).unwrap_err();
    let admitted = vec![first];
    assert!(e.is_retryable(), "{e}");
    assert!(
        matches!(e, kvd::Error::Overloaded { retry_after_ms, .. } if retry_after_ms > 0),
        "{e}"
    );
    for id in admitted {
        let t = wait_done(&mut ca, id);
        assert!(!matches!(t.state, TransferState::InFlight), "{t:?}");
    }
    assert_eq!(a.status().stats.pins, 0);
}

#[test]
fn a_transfer_left_open_past_its_deadline_is_aborted_and_its_pages_freed() {
    let net = Net::new();
    let b = net.node(2, &["--transfer-deadline-ms", "1000"]);
    let ns = support::namespace().id();
    let keys = support::keys(ns, 8, 2);
    let src = RawSource::new(&net, &b, 2);
    let free = b.status().stats.accounting.free;
    let (mut s, generation) = src.control();
    let r = ask(&mut s, &src.offer(&keys, generation, 0, 1));
    assert!(matches!(r, PeerReply::Accepted { .. }), "{r:?}");
    assert_eq!(
        b.status().stats.accounting.free,
        free - 2,
        "two pages held for it"
    );
    // the source keeps its connection open and never commits
    let t = std::time::Instant::now();
    support::wait_until(
        Duration::from_secs(10),
        "the deadline frees the pages",
        || b.status().stats.accounting.free == free,
    );
    println!(
        "an uncommitted transfer was aborted {:?} after its offer (deadline 1 s)",
        t.elapsed()
    );
    assert!(
        t.elapsed() >= Duration::from_millis(800),
        "not before its deadline"
    );
    assert!(b.status().data_port.unwrap().transfers.aborted_incoming >= 1);
    drop(s);
}

#[test]
fn an_insider_cannot_write_into_another_pairs_transfer_and_an_unchecked_overwrite_fails_the_commit()
{
    let net = Net::new();
    let b = net.node(2, &[]);
    let ns = support::namespace().id();
    let keys = support::keys(ns, 11, 2);
    let src = RawSource::new(&net, &b, 2);
    let (mut s, generation) = src.control();
    let r = ask(&mut s, &src.offer(&keys, generation, 0, 1));
    let (transfer, segment, offsets) = accepted(r);
    assert!(
        transfer >> 32 != 0,
        "transfer ids are not a small counter: {transfer}"
    );
    // A third node holding the secret, aiming at that transfer's pages: refused.
    let intruder = RawSource::build(&net, &b, 2, 3, 9, |_| {});
    let st = intruder.run(&intruder.writes(transfer, &segment, &offsets));
    assert!(
        matches!(st.first_failure, Some(OpFailure::Refused(_))),
        "{st:?}"
    );
    // The rightful source writes its blocks, checked, then overwrites the first with other
    // bytes and no checksum (an engine with checksums off): accepted on the wire, but the
    // commit reads the pages and refuses them.
    assert!(
        src.run(&src.writes(transfer, &segment, &offsets))
            .succeeded()
    );
    let sloppy = RawSource::build(&net, &b, 2, 1, 6, |c| c.checksum = false);
    assert!(
        sloppy
            .run(&sloppy.writes(transfer, &segment, &offsets[..1]))
            .succeeded()
    );
    commit_is_refused_as_corrupt(&mut s, transfer, &b, &keys);
    let e = b.status().data_port.unwrap().engine;
    assert!(
        e.refused >= 1,
        "the intruder's writes were refused and counted: {e:?}"
    );
}

/// Open `what` connections with `open` and hold them until one is refused (at most 64 held:
/// more means no bound); those held and the refusal.
fn open_until_refused<T>(
    what: &str,
    mut open: impl FnMut() -> transport::Result<T>,
) -> (Vec<T>, transport::Error) {
    let mut held = Vec::new();
    loop {
        match open() {
            Ok(c) => held.push(c),
            Err(e) => return (held, e),
        }
        assert!(
            held.len() <= 64,
            "no bound on one peer's {what} connections"
        );
    }
}

#[test]
fn an_insider_holding_idle_connections_takes_only_its_own_share_and_replays_change_nothing() {
    let net = Net::new();
    let b = net.node(2, &[]);
    let ns = support::namespace().id();
    // An insider (node 3, holding the secret and its own key) opens control connections and
    // data endpoints and idles on them, past its share: the surplus is refused at the bind,
    // retryably and naming the bound, not as a wrong secret.
    let insider = RawSource::build(&net, &b, 2, 3, 7, |_| {});
    let (held, refused) =
        open_until_refused("control", || insider.engine.open_control(&insider.peer));
    assert!(
        matches!(&refused, transport::Error::Overloaded { what, .. } if what.contains("at most")),
        "{refused:?}"
    );
    let (endpoints, refused) = open_until_refused("data", || insider.engine.open(&insider.peer));
    assert!(
        matches!(&refused, transport::Error::Overloaded { .. }),
        "{refused:?}"
    );
    // Meanwhile another peer connects and pushes as ever.
    let a = net.node(1, &[]);
    let mut ca = a.client("engine-a", 30_000);
    ca.register_namespace(&support::namespace()).unwrap();
    let keys = support::keys(ns, 21, 2);
    for (i, k) in keys.iter().enumerate() {
        support::put_one(&mut ca, *k, &support::pattern(BLOCK, i as u8));
    }
    let id = ca.push(2, &keys).unwrap();
    let t = wait_done(&mut ca, id);
    assert_eq!(t.state, TransferState::Done, "{t:?}");
    // The insider's own transfer: a write past its grant is refused; a commit replayed after
    // it committed, and its offer replayed, change nothing.
    drop(held);
    let own = support::keys(ns, 22, 2);
    let src = RawSource::new(&net, &b, 2);
    let (mut s, generation) = src.control();
    let offer = src.offer(&own, generation, 0, 1);
    let (transfer, segment, offsets) = accepted(ask(&mut s, &offer));
    let mut past = src.writes(transfer, &segment, &offsets[..1]);
    let pool = 16u64 << 20;
    past[0].remote_offset = (0..pool / BLOCK as u64)
        .map(|p| p * BLOCK as u64)
        .find(|o| !offsets.contains(&Some(*o)))
        .expect("a page outside the grant");
    let st = src.run(&past);
    assert!(
        matches!(st.first_failure, Some(OpFailure::Refused(_))),
        "{st:?}"
    );
    assert!(
        src.run(&src.writes(transfer, &segment, &offsets))
            .succeeded()
    );
    let r = ask(&mut s, &PeerRequest::Commit { transfer });
    assert!(matches!(r, PeerReply::Committed { .. }), "{r:?}");
    let published = b.status().stats.accounting.published;
    let r = ask(&mut s, &PeerRequest::Commit { transfer });
    assert!(
        matches!(r, PeerReply::Refused(_)),
        "a replayed commit: {r:?}"
    );
    let r = ask(&mut s, &offer);
    assert!(
        matches!(&r, PeerReply::Refused(_) | PeerReply::Accepted { .. }),
        "{r:?}"
    );
    if let PeerReply::Accepted { offsets, .. } = r {
        assert!(
            offsets.iter().all(Option::is_none),
            "a replayed offer grants nothing new: {offsets:?}"
        );
    }
    assert_eq!(b.status().stats.accounting.published, published);
    drop(endpoints);
}
