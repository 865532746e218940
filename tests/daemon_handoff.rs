//! Prefill/decode hand-off holds between two real daemons (DESIGN §7b): a prefill's node holds
//! its prompt's run for the decode, owned by the daemon (it outlives the engine's session),
//! bound to (request, epoch); the decode's node fetches it bound to the same pair. A read of
//! another epoch, another request or a block outside the run is refused and moves nothing; the
//! run ends when the decode has it, when its owner ends it over HTTP, or when its TTL passes
//! (counted).

mod support;

use std::time::Duration;

use kvd::protocol::{TransferState, WireError};
use support::Daemon;
use support::raw::Net;

/// Node 1 (the prefill's) and node 2 (the decode's), both with data ports, each knowing the
/// other.
fn pair(net: &Net) -> (Daemon, Daemon) {
    (net.node(1, &[]), net.node(2, &[]))
}

/// A hand-off read of `keys` from node 1's hold of (`request`, `epoch`), waited for.
fn fetch_held(
    c: &mut kvd::client::Client,
    request: u64,
    epoch: u64,
    keys: &[kvd::keys::BlockKey],
    end_hold: bool,
) -> kvd::protocol::TransferInfo {
    let id = start_held(c, request, epoch, keys, end_hold);
    support::wait_transfer(c, id, Duration::from_secs(60))
}

/// Start a hand-off read, waiting out the short avoidance of a peer that just failed one.
fn start_held(
    c: &mut kvd::client::Client,
    request: u64,
    epoch: u64,
    keys: &[kvd::keys::BlockKey],
    end_hold: bool,
) -> u64 {
    let mut id = None;
    support::wait_until(Duration::from_secs(10), "the read starts", || {
        match c.fetch_held(1, request, epoch, keys, end_hold) {
            Ok(i) => id = Some(i),
            Err(kvd::Error::Unavailable(_)) => std::thread::sleep(Duration::from_millis(200)),
            Err(e) => panic!("{e}"),
        }
        id.is_some()
    });
    id.unwrap()
}

fn refused(t: &kvd::protocol::TransferInfo) -> String {
    match &t.state {
        TransferState::Failed(e) => format!("{e:?}"),
        s => panic!("the fetch was served: {s:?} ({t:?})"),
    }
}

fn metric(d: &Daemon, name: &str) -> u64 {
    let (_, m) = d.get("/metrics");
    m.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics"))
}

#[test]
fn a_hand_off_is_served_only_to_its_epoch_and_run_and_ends_when_the_decode_has_it() {
    let net = Net::new();
    let (a, b) = pair(&net);
    let mut ca = a.client("prefill", 30_000);
    let ns = ca.register_namespace(&support::namespace()).unwrap();
    let keys = support::keys(ns, 3, 8);
    for (i, k) in keys.iter().enumerate() {
        support::put_one(&mut ca, *k, &support::pattern(64 << 10, i as u8));
    }
    let h = ca.hold_begin(9, 2, &keys[..6], 30_000).unwrap();
    assert_eq!((h.keys.len(), h.epoch), (6, 2));
    // the prefill engine leaves: the run stays, held by the daemon and no session
    drop(ca);
    support::wait_until(
        Duration::from_secs(10),
        "the engine's session closes",
        || a.status().sessions.is_empty(),
    );
    let s = a.status();
    assert_eq!(
        (s.holds.holds, s.holds.blocks, s.stats.pins),
        (1, 6, 0),
        "{:?}",
        s.holds
    );

    let mut cb = b.client("decode", 30_000);
    cb.register_namespace(&support::namespace()).unwrap();
    // an older attempt's read, another request's, a block outside the run: refused, nothing moves
    for (request, epoch, ks, why) in [
        (9, 1, &keys[..6], "epoch 1"),
        (8, 2, &keys[..6], "request 8"),
        (9, 2, &keys[..8], "not in the hand-off run"),
    ] {
        let t = fetch_held(&mut cb, request, epoch, ks, true);
        let e = refused(&t);
        assert!(e.contains(why), "{why}: {e}");
    }
    assert!(
        cb.exists(&keys).unwrap().iter().all(|b| !b),
        "nothing of the run arrived"
    );
    assert_eq!(a.get("/holds/9").0, 200, "refusals end nothing");

    // the decode's read, kept for another decode (the front ends it)
    let t = fetch_held(&mut cb, 9, 2, &keys[..6], false);
    assert_eq!(
        (t.state.clone(), t.blocks),
        (TransferState::Done, 6),
        "{t:?}"
    );
    let info = cb.acquire(&keys[5..6], None).unwrap().remove(0).unwrap();
    let mut buf = vec![0u8; 64 << 10];
    cb.read_verified(&info.handle, &mut buf).unwrap();
    assert!(buf == support::pattern(64 << 10, 5), "byte-exact");
    cb.release(&[info.handle]).unwrap();
    let (code, body) = a.get("/holds/9");
    assert_eq!(code, 200, "{body}");
    let r: kvd::daemon::admin::HoldReport = serde_json::from_str(&body).unwrap();
    assert_eq!((r.epoch, r.blocks), (2, 6), "{r:?}");

    // a read that ends the hold once the run is here (it is already: nothing moves)
    let t = fetch_held(&mut cb, 9, 2, &keys[..6], true);
    assert_eq!(
        (t.state.clone(), t.blocks),
        (TransferState::Done, 0),
        "{t:?}"
    );
    support::wait_until(Duration::from_secs(5), "the hold ends", || {
        a.get("/holds/9").0 == 404
    });
    assert_eq!(metric(&a, "kvd_handoff_holds_taken_total"), 1);
    assert_eq!(metric(&a, "kvd_handoff_holds"), 0);
    // a late read of the ended hold is refused
    let t = fetch_held(&mut cb, 9, 2, &keys[..1], false);
    assert!(
        matches!(t.state, TransferState::Failed(WireError::NotFound(_))),
        "{t:?}"
    );
    let s = a.status();
    assert_eq!((s.holds.holds, s.stats.pins), (0, 0));
}

#[test]
fn a_hold_nobody_reads_expires_counted_and_its_owner_ends_one_over_http() {
    let net = Net::new();
    let (a, _b) = pair(&net);
    let mut ca = a.client("prefill", 30_000);
    let ns = ca.register_namespace(&support::namespace()).unwrap();
    let keys = support::keys(ns, 5, 4);
    for (i, k) in keys.iter().enumerate() {
        support::put_one(&mut ca, *k, &support::pattern(64 << 10, i as u8));
    }
    ca.hold_begin(11, 1, &keys, 300).unwrap();
    support::wait_until(Duration::from_secs(10), "the unread hold expires", || {
        a.status().holds.holds == 0
    });
    assert_eq!(metric(&a, "kvd_handoff_holds_expired_total"), 1);
    assert!(a.log().contains("expired unread"), "one log line says so");

    ca.hold_begin(12, 3, &keys, 30_000).unwrap();
    assert!(metric(&a, "kvd_handoff_held_bytes") >= 4 * (64 << 10));
    assert_eq!(a.get("/holds/12").0, 200);
    let summary = kvd::daemon::status::summary(&a.status(), None);
    assert!(
        summary.contains("hand-off holds: 1 holding 4 blocks"),
        "`kvd status` shows it: {summary}"
    );
    // an older epoch's end changes nothing; the hold's own epoch ends it; again is no error
    assert_eq!(
        kvd::daemon::status::http(a.admin, "DELETE", "/holds/12?epoch=2")
            .unwrap()
            .0,
        204
    );
    assert_eq!(a.get("/holds/12").0, 200);
    for _ in 0..2 {
        let (code, _) = kvd::daemon::status::http(a.admin, "DELETE", "/holds/12?epoch=3").unwrap();
        assert_eq!(code, 204);
    }
    assert_eq!(a.get("/holds/12").0, 404);
    assert_eq!(metric(&a, "kvd_handoff_holds_ended_total"), 1);
    // an ended epoch cannot be held again; a newer one can, and the owner's client ends it
    let e = ca.hold_begin(12, 3, &keys, 30_000).unwrap_err();
    assert!(e.to_string().contains("epoch"), "{e}");
    ca.hold_begin(12, 4, &keys, 30_000).unwrap();
    assert!(!ca.hold_end(12, 3).unwrap(), "an older epoch ends nothing");
    assert!(ca.hold_end(12, 4).unwrap());
    assert_eq!(metric(&a, "kvd_handoff_holds_begun_total"), 3);
    let s = a.status();
    assert_eq!((s.holds.holds, s.stats.pins), (0, 0));
}

/// Publish `n` blocks of 64 KiB on `d` (block i's bytes are `pattern(64 KiB, i)`); their keys.
fn run_on(c: &mut kvd::client::Client, seed: u64, n: usize) -> Vec<kvd::keys::BlockKey> {
    let ns = c.register_namespace(&support::namespace()).unwrap();
    let keys = support::keys(ns, seed, n);
    for (i, k) in keys.iter().enumerate() {
        support::put_one(c, *k, &support::pattern(64 << 10, i as u8));
    }
    keys
}

/// Flip bits at rest in `key`'s page on `d` (found through a pin, released again).
fn corrupt_at_rest(c: &mut kvd::client::Client, d: &Daemon, key: kvd::keys::BlockKey) {
    let info = c.acquire(&[key], None).unwrap().remove(0).unwrap();
    support::scribble_on_the_pool(d.pid(), info.offset);
    c.release(&[info.handle]).unwrap();
}

#[test]
fn a_run_corrupted_at_rest_at_the_source_fails_its_checksum_and_is_never_served() {
    let net = Net::new();
    let (a, b) = pair(&net);
    let mut ca = a.client("prefill", 30_000);
    let keys = run_on(&mut ca, 21, 6);
    ca.hold_begin(31, 1, &keys, 30_000).unwrap();
    // a bit flip at rest in the fourth block of the held run
    corrupt_at_rest(&mut ca, &a, keys[3]);

    let mut cb = b.client("decode", 30_000);
    cb.register_namespace(&support::namespace()).unwrap();
    for attempt in 0..2 {
        let t = fetch_held(&mut cb, 31, 1, &keys, true);
        let e = refused(&t);
        assert!(e.contains("CRC-32C"), "{attempt}: {e}");
        assert!(
            cb.exists(&keys).unwrap().iter().all(|b| !b),
            "no block of a run with a corrupt block is published"
        );
    }
    let sb = b.status();
    assert!(sb.data_port.unwrap().transfers.transfers_failed >= 2);
    assert_eq!(
        sb.stats.accounting.writing + sb.stats.accounting.allocated,
        0
    );
    // the decode's node did not take the hold: it is still the source's to end or expire
    assert_eq!(a.get("/holds/31").0, 200);
}

#[test]
fn a_prefill_node_killed_before_the_decode_reads_fails_the_read_and_its_successor_holds_nothing() {
    let net = Net::new();
    let (mut a, b) = pair(&net);
    let mut ca = a.client("prefill", 30_000);
    let keys = run_on(&mut ca, 23, 4);
    ca.hold_begin(41, 1, &keys, 30_000).unwrap();
    drop(ca);
    let addr = a.data_addr();
    support::signal(a.pid(), rustix::process::Signal::KILL);
    a.wait_exit(Duration::from_secs(10)).expect("node 1 died");
    let mut cb = b.client("decode", 30_000);
    cb.register_namespace(&support::namespace()).unwrap();
    let t = fetch_held(&mut cb, 41, 1, &keys, true);
    refused(&t);
    assert!(cb.exists(&keys).unwrap().iter().all(|b| !b));
    // node 1 back at the same data address: a new incarnation, which holds nothing of the old
    let a2 = Daemon::start(&support::strs(&net.args_at(1, &addr.to_string(), &[])));
    let mut c2 = a2.client("prefill-again", 30_000);
    let again = run_on(&mut c2, 23, 4);
    assert_eq!(again, keys, "the same prompt's blocks, prefilled again");
    let t = fetch_held(&mut cb, 41, 1, &keys, true);
    assert!(
        matches!(t.state, TransferState::Failed(WireError::NotFound(_))),
        "the old hold died with its node: {t:?}"
    );
    assert!(cb.exists(&keys).unwrap().iter().all(|b| !b));
}

#[test]
fn a_hand_off_read_cut_halfway_publishes_nothing_keeps_the_hold_and_the_retry_lands_whole() {
    let net = Net::new();
    let hosts = support::TwoHosts::new();
    let (a_args, b_args) = (
        net.args_at(1, "10.77.0.1:7471", &[]),
        net.args_at(2, "10.77.0.2:7471", &[]),
    );
    let a = Daemon::start_in_netns(&hosts.a, &support::strs(&a_args));
    let b = Daemon::start_in_netns(&hosts.b, &support::strs(&b_args));
    let mut ca = a.client("prefill", 60_000);
    let keys = run_on(&mut ca, 25, 40);
    ca.hold_begin(51, 2, &keys, 60_000).unwrap();
    // the decode reads the run over a slowed link, cut mid-way
    hosts.slow(&hosts.a, &hosts.dev_a(), "40mbit");
    let mut cb = b.client("decode", 60_000);
    cb.register_namespace(&support::namespace()).unwrap();
    let free = cb.stats().unwrap().accounting.free;
    let id = cb.fetch_held(1, 51, 2, &keys, true).unwrap();
    support::wait_until(Duration::from_secs(20), "the read has pages on B", || {
        cb.stats().unwrap().accounting.free < free
    });
    support::ip(&["-n", &hosts.a, "link", "set", &hosts.dev_a(), "down"]);
    let t = support::wait_transfer(&mut cb, id, Duration::from_secs(60));
    refused(&t);
    assert!(
        cb.exists(&keys).unwrap().iter().all(|b| !b),
        "nothing partial is published on B"
    );
    let st = cb.stats().unwrap().accounting;
    assert_eq!((st.writing, st.allocated, st.free), (0, 0, free), "{st:?}");
    let held = support::cluster::status_in(&hosts.a, &a).holds;
    assert_eq!(held.blocks, 40, "the source still holds the run: {held:?}");
    // the link comes back; the retry from the source lands whole and takes the hold
    support::ip(&["-n", &hosts.a, "link", "set", &hosts.dev_a(), "up"]);
    let id = start_held(&mut cb, 51, 2, &keys, true);
    let t = support::wait_transfer(&mut cb, id, Duration::from_secs(120));
    assert_eq!(
        (t.state.clone(), t.blocks),
        (TransferState::Done, 40),
        "{t:?}"
    );
    for (i, got) in cb.acquire(&keys, None).unwrap().into_iter().enumerate() {
        let info = got.unwrap();
        let mut buf = vec![0u8; 64 << 10];
        cb.read_verified(&info.handle, &mut buf).unwrap();
        assert!(buf == support::pattern(64 << 10, i as u8), "block {i}");
        cb.release(&[info.handle]).unwrap();
    }
    support::wait_until(Duration::from_secs(10), "the hold is taken", || {
        support::cluster::status_in(&hosts.a, &a).holds.holds == 0
    });
}

#[test]
fn a_cluster_fetch_keeps_the_verified_prefix_of_a_run_with_a_block_corrupted_at_rest() {
    let net = Net::new();
    let (a, b) = pair(&net);
    let mut ca = a.client("holder", 30_000);
    let keys = run_on(&mut ca, 41, 6);
    // a bit flip at rest in the fourth block
    corrupt_at_rest(&mut ca, &a, keys[3]);

    let mut cb = b.client("asker", 30_000);
    cb.register_namespace(&support::namespace()).unwrap();
    let id = cb.fetch(kvd::protocol::ANY_NODE, &keys).unwrap();
    let t = support::wait_transfer(&mut cb, id, Duration::from_secs(60));
    assert_eq!(
        (t.state.clone(), t.blocks, t.peer),
        (TransferState::Done, 3, 1),
        "{t:?}"
    );
    assert_eq!(
        cb.exists(&keys).unwrap(),
        [true, true, true, false, false, false],
        "the verified prefix, nothing of or after the bad block"
    );
    // byte-exact
    for (i, got) in cb
        .acquire(&keys[..3], None)
        .unwrap()
        .into_iter()
        .enumerate()
    {
        let info = got.unwrap();
        let mut buf = vec![0u8; 64 << 10];
        cb.read_verified(&info.handle, &mut buf).unwrap();
        assert!(
            buf == support::pattern(64 << 10, i as u8),
            "block {i} byte-exact"
        );
        cb.release(&[info.handle]).unwrap();
    }
    assert_eq!(metric(&b, "kvd_cluster_located_blocks_total"), 6);
    assert_eq!(metric(&b, "kvd_cluster_fetched_blocks_total"), 3);
    assert_eq!(metric(&b, "kvd_cluster_shortfall_blocks_total"), 3);
    assert!(
        metric(&b, "kvd_transfer_checksum_failures_total") >= 1,
        "the bad block was caught on arrival"
    );
    assert_eq!(metric(&a, "kvd_cluster_locates_served_total"), 1);
    let sb = b.status();
    assert_eq!(
        sb.stats.accounting.writing + sb.stats.accounting.allocated,
        0
    );
    assert_eq!((a.status().stats.pins, sb.stats.pins), (0, 0));
}
