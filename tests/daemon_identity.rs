//! Each node proves who it is on the data port, and known peers are never locked out (issue
//! 47), between real daemons on loopback:
//!
//! - an insider holding the cluster secret but not node 1's key binds as node 1 (with a key of
//!   its own, with node 1's genuine signature replayed from a wire capture, with no signature):
//!   refused before any grant, its writes, replays and offers change nothing, and node 1's own
//!   pushes go on meanwhile;
//! - a flood of half-open and trickling connections from 200 source addresses leaves the
//!   handshake slots kept for members free: a member restarted into it connects and pushes at
//!   its first try, and the daemon's file descriptors stay bounded;
//! - a node whose line is deleted from the peers file (a static cluster's revocation) is cut
//!   off and cannot come back; the others go on;
//! - with the payload MAC on, pushes and fetches land byte-exact.
//!
//! (Revocation in etcd, `kvd key revoke`, is in `cluster_etcd.rs`.)

mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvd::keys::BlockKey;
use kvd::protocol::TransferState;
use support::Daemon;
use support::raw::{BLOCK, Net, RawSource, connect_from};
use transport::auth::{ClusterSecret, Hello};
use transport::engine::Transport;
use transport::link::identity::NodeKey;
use transport::link::testing;
use transport::link::wire::{Bind, Refusal, RefusalReason};

fn wait_done(c: &mut kvd::client::Client, id: u64) -> kvd::protocol::TransferInfo {
    support::wait_transfer(c, id, Duration::from_secs(60))
}

/// Put `n` blocks of seed `seed` on `c`'s daemon; their keys.
fn blocks(c: &mut kvd::client::Client, seed: u64, n: usize) -> Vec<BlockKey> {
    support::put_blocks(c, seed, n, BLOCK)
}

/// Push `keys` from `c`'s daemon to node `to`; the transfer's end.
fn push(c: &mut kvd::client::Client, to: u64, keys: &[BlockKey]) -> kvd::protocol::TransferInfo {
    let id = c.push(to, keys).unwrap();
    wait_done(c, id)
}

/// A relay on loopback to `to` that keeps the first `keep` bytes each connection's client
/// sends (what an insider on the path sees of a handshake).
struct Capture {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Vec<u8>>>>,
}

impl Capture {
    fn start(to: SocketAddr, keep: usize) -> Capture {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        std::thread::spawn(move || {
            for c in l.incoming() {
                let Ok(client) = c else { break };
                let Ok(server) = TcpStream::connect(to) else {
                    continue;
                };
                let at = {
                    let mut v = s.lock().unwrap();
                    v.push(Vec::new());
                    v.len() - 1
                };
                let (mut c2, mut s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                let s = s.clone();
                std::thread::spawn(move || {
                    let mut buf = [0u8; 65536];
                    while let Ok(n) = c2.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        {
                            let mut v = s.lock().unwrap();
                            let room = keep.saturating_sub(v[at].len()).min(n);
                            v[at].extend_from_slice(&buf[..room]);
                        }
                        if s2.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = s2.shutdown(std::net::Shutdown::Write);
                });
                let (mut server, mut client) = (server, client);
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut server, &mut client);
                    let _ = client.shutdown(std::net::Shutdown::Write);
                });
            }
        });
        Capture { addr, seen }
    }
}

/// An insider with the cluster secret binds by hand to node 2 at `to`, claiming node `claims`
/// in incarnation `generation`, with `signature`; the daemon's refusal, if any.
fn insider_bind(
    secret: &ClusterSecret,
    to: SocketAddr,
    claims: u64,
    generation: u64,
    signature: [u8; 64],
) -> Option<Refusal> {
    let frame = testing::claim(claims, 2, generation, move |_, _| signature);
    testing::bind_by_hand(secret, to, frame).unwrap()
}

/// What the insider's attempts must leave unchanged on `d`: published blocks, free pages,
/// transfers under way, live grants.
fn footprint(d: &Daemon) -> (u32, u32, u64, u64) {
    let s = d.status();
    let dp = s.data_port.unwrap();
    (
        s.stats.accounting.published,
        s.stats.accounting.free,
        dp.incoming_in_flight,
        dp.live_grants,
    )
}

#[test]
fn an_insider_with_the_secret_but_not_node_1s_key_is_refused_before_any_grant_while_node_1_pushes_on()
 {
    let net = Net::new();
    let b = net.node(2, &[]);
    // node 1 reaches node 2 through a relay that keeps what it sends first: its hello,
    // proof and signed bind, as an insider on the path would see them
    let capture = Capture::start(b.data_addr(), Hello::WIRE_BYTES + 32 + Bind::WIRE_BYTES);
    let a = net.node_without_file(1, &["--peer", &net.entry(2, capture.addr)]);
    let mut ca = a.client("engine-a", 60_000);
    let first = blocks(&mut ca, 1, 2);
    let t = push(&mut ca, 2, &first);
    assert_eq!(t.state, TransferState::Done, "{t:?}");
    let before = footprint(&b);

    // node 1's genuine bind from the wire: its signature and its generation
    let wire = capture.seen.lock().unwrap()[0].clone();
    let bind_at = Hello::WIRE_BYTES + 32;
    let genuine: [u8; Bind::WIRE_BYTES] = wire[bind_at..bind_at + Bind::WIRE_BYTES]
        .try_into()
        .unwrap();
    let a_generation = u64::from_le_bytes(genuine[16..24].try_into().unwrap());
    let signature: [u8; 64] = genuine[Bind::SIGNATURE].try_into().unwrap();

    // node 1 pushes all along while the insider tries
    let stop = Arc::new(AtomicBool::new(false));
    let pusher = {
        let stop = stop.clone();
        let mut c = a.client("engine-a2", 60_000);
        std::thread::spawn(move || {
            let mut outcomes = Vec::new();
            let mut seed = 100;
            while !stop.load(Ordering::Acquire) && outcomes.len() < 40 {
                let keys = blocks(&mut c, seed, 2);
                outcomes.push(push(&mut c, 2, &keys).state);
                seed += 1;
            }
            outcomes
        })
    };

    let secret = ClusterSecret::from_file(&net.secret).unwrap();
    let to = b.data_addr();
    // 1. node 1's signature replayed on a connection of the insider's own: it covers another
    //    connection's transcript
    let r = insider_bind(&secret, to, 1, a_generation, signature);
    assert_eq!(r.map(|r| r.reason), Some(RefusalReason::BadSignature));
    // 2. no signature at all
    let r = insider_bind(&secret, to, 1, a_generation, [0; 64]);
    assert_eq!(r.map(|r| r.reason), Some(RefusalReason::BadSignature));
    // 3. a key of its own, through the engine as a daemon would: no control connection, no
    //    endpoint, so no offer, no write, no commit can even be sent
    let (own, _) = NodeKey::generate().unwrap();
    let insider = RawSource::with_key(&net, &b, 2, 1, own, 9, |_| {});
    for _ in 0..5 {
        let e = insider.engine.open_control(&insider.peer).unwrap_err();
        assert!(
            e.to_string().contains("refused this node's identity"),
            "{e}"
        );
        let e = insider.engine.open(&insider.peer).unwrap_err();
        assert!(
            e.to_string().contains("refused this node's identity"),
            "{e}"
        );
    }
    // 4. the genuine bind frame replayed verbatim into a connection of its own: its tag is
    //    another connection's, so it fails before its signature is looked at, unanswered
    let replayed = testing::bind_by_hand(&secret, to, |_, _| genuine);
    assert!(replayed.is_err(), "closed without an answer: {replayed:?}");
    stop.store(true, Ordering::Release);
    let outcomes = pusher.join().unwrap();
    assert!(!outcomes.is_empty());
    assert!(
        outcomes.iter().all(|s| *s == TransferState::Done),
        "node 1's pushes went on: {outcomes:?}"
    );

    // nothing of the insider's reached node 2: no grant, transfer, page or block, beyond
    // node 1's own pushes
    let dp = b.status().data_port.unwrap();
    assert!(
        dp.engine.identity_refusals >= 2 + 10,
        "every bind of the insider's was refused and counted: {:?}",
        dp.engine
    );
    assert!(dp.engine.integrity_failures >= 1, "the replayed frame");
    let after = footprint(&b);
    assert_eq!(
        after.0,
        before.0 + 2 * outcomes.len() as u32,
        "only node 1's own blocks were published"
    );
    assert_eq!((after.2, after.3), (0, 0), "no transfer or grant left");
    let (_, m) = b.get("/metrics");
    assert!(m.contains("kvd_transfer_identity_refusals_total"), "{m}");
    // and node 1, holding its key, still pushes
    let keys = blocks(&mut ca, 7, 2);
    assert_eq!(push(&mut ca, 2, &keys).state, TransferState::Done);
}

/// Open files of process `pid`.
fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

/// A flood of connections that never finish their handshake, from `sources` loopback
/// addresses (up to two each: one silent, one trickling its hello a byte at a time), topped
/// up as the daemon cuts them at its handshake deadline; until `stop`, and at most `cap`.
fn flood(
    to: SocketAddr,
    sources: usize,
    stop: Arc<AtomicBool>,
    cap: Duration,
) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let started = Instant::now();
        let addr = |i: usize| format!("127.0.{}.{}", 20 + i / 200, 1 + i % 200);
        let mut held: Vec<Option<TcpStream>> = (0..2 * sources).map(|_| None).collect();
        let mut opened = 0;
        while !stop.load(Ordering::Acquire) && started.elapsed() < cap {
            for (slot, c) in held.iter_mut().enumerate() {
                let alive = c.as_mut().is_some_and(|s| {
                    let mut b = [0u8; 128];
                    match s.read(&mut b) {
                        Ok(0) => false,
                        Ok(_) => false, // a refusal frame: the daemon closes it next
                        Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
                    }
                });
                if !alive {
                    *c = connect_from(&addr(slot / 2), to).ok().inspect(|s| {
                        s.set_nonblocking(true).unwrap();
                    });
                    opened += 1;
                }
                if slot % 2 == 1
                    && let Some(s) = c
                {
                    let _ = s.write(&[1]);
                }
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        opened
    })
}

#[test]
fn a_flood_from_two_hundred_addresses_never_takes_the_members_handshakes_a_restarted_member_pushes_at_once()
 {
    let net = Net::new();
    let b = net.node(2, &[]);
    let mut a = net.node(1, &[]);
    let mut ca = a.client("engine-a", 60_000);
    let keys = blocks(&mut ca, 1, 4);
    assert_eq!(push(&mut ca, 2, &keys).state, TransferState::Done);
    drop(ca);
    a.stop();
    let idle = fds(b.pid());

    // the flood starts while node 1 is down, from 200 addresses none of which is a member's
    let stop = Arc::new(AtomicBool::new(false));
    let flooder = flood(b.data_addr(), 200, stop.clone(), Duration::from_secs(30));
    support::wait_until(
        Duration::from_secs(20),
        "the flood meets the bounds",
        || b.status().data_port.unwrap().engine.handshakes_refused > 200,
    );
    // past one handshake deadline (2 s): the first wave is cut and the flood tops it up
    std::thread::sleep(Duration::from_millis(2500));
    let under_flood = fds(b.pid());

    // node 1 restarts into it (same key, same address, a new incarnation) and pushes: the
    // first try lands
    let a = net.restart(1, &a.dir, &[]);
    let mut ca = a.client("engine-a", 60_000);
    let keys = blocks(&mut ca, 2, 4);
    let t = push(&mut ca, 2, &keys);
    let refused = b.status().data_port.unwrap().engine.handshakes_refused;
    let most = fds(b.pid()).max(under_flood);
    stop.store(true, Ordering::Release);
    let opened = flooder.join().unwrap();
    assert_eq!(
        t.state,
        TransferState::Done,
        "the restarted member's first push: {t:?}"
    );
    assert_eq!(t.blocks, 4);
    println!(
        "flood: {opened} connections from 200 addresses, {refused} refused; node 2's open \
         files {idle} idle, {most} at most under the flood"
    );
    // the daemon holds at most its 64 handshakes, the member's connections and a few more,
    // however many connections the flood opens
    assert!(opened > 400, "the flood kept coming: {opened}");
    assert!(
        most <= idle + 64 + 16,
        "open files bounded: {idle} idle, {most} under the flood"
    );
}

#[test]
fn a_node_deleted_from_the_peers_file_is_cut_off_and_cannot_come_back_while_the_others_go_on() {
    let net = Net::new();
    let b = net.node(2, &[]);
    let a = net.node(1, &[]);
    let c = net.node(3, &[]);
    let (mut ca, mut cc) = (a.client("engine-a", 60_000), c.client("engine-c", 60_000));
    let ka = blocks(&mut ca, 1, 2);
    let kc = blocks(&mut cc, 2, 2);
    assert_eq!(push(&mut ca, 2, &ka).state, TransferState::Done);
    assert_eq!(push(&mut cc, 2, &kc).state, TransferState::Done);
    let before = b.status().data_port.unwrap().engine.identity_refusals;

    // revoking node 1 in a static cluster: its line leaves the peers file
    net.cluster.remove(1);
    support::wait_until(Duration::from_secs(10), "nodes 2 and 3 drop node 1", || {
        [&b, &c]
            .iter()
            .all(|d| !d.status().data_port.unwrap().peers.contains_key(&1))
    });
    assert!(
        b.log().contains("closing its connections"),
        "node 2 cut node 1 off"
    );
    // node 1 still knows node 2 and still holds the secret: refused at the bind
    let ka2 = blocks(&mut ca, 3, 2);
    let t = push(&mut ca, 2, &ka2);
    assert!(
        matches!(&t.state, TransferState::Failed(e) if format!("{e:?}").contains("identity")),
        "{t:?}"
    );
    let dp = b.status().data_port.unwrap();
    assert!(dp.engine.identity_refusals > before, "{:?}", dp.engine);
    let mut cb = b.client("reader", 60_000);
    assert_eq!(cb.exists(&ka2).unwrap(), vec![false; 2]);
    // node 2 no longer reaches node 1 either
    let e = cb.fetch(1, &ka).unwrap_err();
    assert!(e.to_string().contains("peer table"), "{e}");
    // the others go on
    let kc2 = blocks(&mut cc, 4, 2);
    assert_eq!(push(&mut cc, 2, &kc2).state, TransferState::Done);
    let id = cc.fetch(2, &ka).unwrap();
    assert_eq!(wait_done(&mut cc, id).state, TransferState::Done);
}

#[test]
fn with_the_payload_mac_on_pushes_and_fetches_land_byte_exact() {
    let net = Net::new();
    let b = net.node(2, &["--payload-mac"]);
    let a = net.node(1, &[]);
    let mut ca = a.client("engine-a", 60_000);
    let keys = blocks(&mut ca, 5, 8);
    assert_eq!(push(&mut ca, 2, &keys).state, TransferState::Done);
    let mut cb = b.client("engine-b", 60_000);
    let theirs = blocks(&mut cb, 6, 8);
    let id = ca.fetch(2, &theirs).unwrap();
    assert_eq!(wait_done(&mut ca, id).state, TransferState::Done);
    for (c, keys) in [(&mut cb, &keys), (&mut ca, &theirs)] {
        for (i, got) in c.acquire(keys, None).unwrap().into_iter().enumerate() {
            let info = got.expect("published");
            let mut buf = vec![0u8; BLOCK];
            c.read_verified(&info.handle, &mut buf).unwrap();
            assert!(buf == support::pattern(BLOCK, i as u8), "block {i}");
            c.release(&[info.handle]).unwrap();
        }
    }
    for d in [&a, &b] {
        assert_eq!(d.status().data_port.unwrap().engine.integrity_failures, 0);
    }
}
