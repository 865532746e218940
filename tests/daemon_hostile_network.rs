//! Two real daemons with a relay between them that changes bytes on the way: a network that
//! corrupts, or an attacker on the path without the cluster secret. Every frame between
//! daemons is tagged with its connection's key, so nothing the relay changes is believed: a
//! key changed in a push's offer publishes nothing (it once published the pushed bytes under
//! a key nobody sent), and over a thousand pushes and fetches through a relay that flips
//! bytes at random no block is published under a key that was not sent and no published
//! byte differs from the source's.

mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvd::keys::BlockKey;
use kvd::protocol::TransferState;
use support::Daemon;
use support::raw::Net;

/// Bytes of each block these tests move.
const BLOCK: usize = 16 << 10;

/// A pool of 64 KiB pages large enough for every block of these tests.
const POOL: [&str; 4] = ["--pool-mib", "192", "--page-kib", "64"];

/// Node 2 of `net`, which every source pushes to and fetches from.
fn destination(net: &Net) -> Daemon {
    net.node(2, &POOL)
}

/// Node `node` of `net`, which reaches node 2 through `relay` (and knows no other node).
fn source(net: &Net, node: u64, relay: &Relay) -> Daemon {
    let to = net.entry(2, relay.addr);
    let mut args = POOL.to_vec();
    args.extend(["--peer", &to]);
    net.node_without_file(node, &args)
}

/// What a block under `key` holds: the key's own tag first (so no two keys' bytes agree),
/// then a pattern.
fn content(key: &BlockKey) -> Vec<u8> {
    let mut b = support::pattern(BLOCK, key.tag.0[0]);
    b[..32].copy_from_slice(&key.tag.0);
    b
}

/// What the relay does to the bytes it carries.
#[derive(Debug, Clone)]
enum Fault {
    /// Flip one bit of the first occurrence of these bytes going to the daemon, once.
    FlipFirst(Vec<u8>),
    /// In each read (either way), with probability 1/`one_in`, flip one random bit.
    Random { one_in: u64 },
}

#[derive(Debug, Default)]
struct RelayStats {
    connections: AtomicU64,
    reads: AtomicU64,
    flips: AtomicU64,
}

/// A relay on loopback in front of `to`: every connection to it is carried to `to` and back,
/// changed as `fault` says. Bounded: the connections are the daemons' own (their bounds
/// apply); it stops with the test.
struct Relay {
    addr: SocketAddr,
    stats: Arc<RelayStats>,
    stop: Arc<AtomicBool>,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

/// xorshift64*: enough randomness for where to flip, repeatable from its seed.
fn next(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_f491_4f6c_dd1d)
}

impl Relay {
    fn start(to: SocketAddr, fault: Fault, seed: u64) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let stats = Arc::new(RelayStats::default());
        let stop = Arc::new(AtomicBool::new(false));
        let once = Arc::new(Mutex::new(match &fault {
            Fault::FlipFirst(p) => Some(p.clone()),
            Fault::Random { .. } => None,
        }));
        let (st, sp) = (stats.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !sp.load(Ordering::Acquire) {
                let Ok((inbound, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                let Ok(outbound) = TcpStream::connect(to) else {
                    continue;
                };
                st.connections.fetch_add(1, Ordering::Relaxed);
                n += 1;
                let _ = inbound.set_nonblocking(false);
                let _ = inbound.set_nodelay(true);
                let _ = outbound.set_nodelay(true);
                let one_in = match &fault {
                    Fault::Random { one_in } => *one_in,
                    Fault::FlipFirst(_) => 0,
                };
                for (dir, (from, into)) in [
                    (inbound.try_clone().unwrap(), outbound.try_clone().unwrap()),
                    (outbound, inbound),
                ]
                .into_iter()
                .enumerate()
                {
                    let (st, sp, once) = (st.clone(), sp.clone(), once.clone());
                    let rng = seed ^ (n << 1 | dir as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
                    std::thread::spawn(move || {
                        pump(from, into, dir == 0, one_in, rng, &once, &st, &sp);
                    });
                }
            }
        });
        Relay { addr, stats, stop }
    }

    fn flips(&self) -> u64 {
        self.stats.flips.load(Ordering::Relaxed)
    }
}

/// Carry bytes one way until either end closes, changing them as the fault says.
#[allow(clippy::too_many_arguments)]
fn pump(
    mut from: TcpStream,
    mut into: TcpStream,
    to_daemon: bool,
    one_in: u64,
    mut rng: u64,
    once: &Mutex<Option<Vec<u8>>>,
    stats: &RelayStats,
    stop: &AtomicBool,
) {
    let mut buf = vec![0u8; 64 << 10];
    let _ = from.set_read_timeout(Some(Duration::from_millis(200)));
    while !stop.load(Ordering::Acquire) {
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue;
            }
            Err(_) => break,
        };
        stats.reads.fetch_add(1, Ordering::Relaxed);
        let got = &mut buf[..n];
        if one_in > 0 && next(&mut rng) % one_in == 0 {
            let bit = (next(&mut rng) % (8 * n as u64)) as usize;
            got[bit / 8] ^= 1 << (bit % 8);
            stats.flips.fetch_add(1, Ordering::Relaxed);
        }
        if to_daemon {
            let mut pattern = once.lock().unwrap();
            if let Some(p) = pattern.as_ref()
                && let Some(at) = got.windows(p.len()).position(|w| w == &p[..])
            {
                got[at + p.len() / 2] ^= 0x10;
                stats.flips.fetch_add(1, Ordering::Relaxed);
                *pattern = None;
            }
        }
        if into.write_all(got).is_err() {
            break;
        }
    }
    let _ = into.shutdown(std::net::Shutdown::Both);
    let _ = from.shutdown(std::net::Shutdown::Both);
}

/// Whether `key` is published on `d` (read by `c`) with exactly the bytes its source put;
/// panics on a block that is there with other bytes.
fn holds_exactly(c: &mut kvd::client::Client, key: &BlockKey) -> bool {
    let Ok(info) = c.acquire(&[*key], None).unwrap().remove(0) else {
        return false;
    };
    let mut buf = vec![0u8; BLOCK];
    assert_eq!(
        info.len as usize, BLOCK,
        "{key:?}: a block of another length"
    );
    c.read_verified(&info.handle, &mut buf)
        .unwrap_or_else(|e| panic!("{key:?}: published but its read fails: {e}"));
    assert!(
        buf == content(key),
        "{key:?}: published with bytes the source never had"
    );
    c.release(&[info.handle]).unwrap();
    true
}

/// Published blocks on `d`.
fn published(d: &Daemon) -> u32 {
    d.status().stats.accounting.published
}

/// A push to node 2 of `keys`, retried while A avoids the node after a failure (bounded).
fn push_when_allowed(c: &mut kvd::client::Client, keys: &[BlockKey]) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match c.push(2, keys) {
            Ok(id) => return id,
            Err(kvd::Error::Unavailable(why)) if Instant::now() < deadline => {
                assert!(why.contains("retry"), "{why}");
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => panic!("the push was refused: {e}"),
        }
    }
}

#[test]
fn a_key_changed_in_flight_in_a_pushs_offer_is_refused_and_nothing_is_published_under_any_key() {
    let net = Net::new();
    let b = destination(&net);
    let ns = support::namespace().id();
    let key = support::keys(ns, 31, 1)[0];
    // the relay flips one bit inside the key's 32 bytes where they first go to B: in the
    // offer that names the block
    let relay = Relay::start(b.data_addr(), Fault::FlipFirst(key.tag.0.to_vec()), 1);
    let a = source(&net, 1, &relay);
    let mut ca = a.client("engine-a", 30_000);
    ca.register_namespace(&support::namespace()).unwrap();
    support::put_one(&mut ca, key, &content(&key));

    let id = ca.push(2, &[key]).unwrap();
    let t = support::wait_transfer(&mut ca, id, Duration::from_secs(60));
    assert_eq!(relay.flips(), 1, "the relay changed the offer's key");
    assert!(matches!(t.state, TransferState::Failed(_)), "{t:?}");
    assert_eq!(published(&b), 0, "nothing is published on B, under any key");
    let mut cb = b.client("reader", 30_000);
    assert_eq!(cb.exists(&[key]).unwrap(), vec![false]);
    let e = b.status().data_port.unwrap().engine;
    assert!(e.integrity_failures >= 1, "counted where found: {e:?}");
    let (_, metrics) = b.get("/metrics");
    assert!(
        metrics.contains("kvd_transfer_integrity_failures_total 1"),
        "{metrics}"
    );
    // the relay changes nothing more: the same push goes through, byte-exact, once A's
    // back-off from the failed node has passed (it says how long)
    let id = push_when_allowed(&mut ca, &[key]);
    let t = support::wait_transfer(&mut ca, id, Duration::from_secs(60));
    assert_eq!(t.state, TransferState::Done, "{t:?}");
    assert!(holds_exactly(&mut cb, &key));
    assert_eq!(published(&b), 1);
}

/// Start a transfer from `c` (a push to node 2, or a fetch from it), retried while the source
/// avoids node 2 after a failure (bounded); `None` if it never started.
fn start_transfer(c: &mut kvd::client::Client, push: bool, keys: &[BlockKey]) -> Option<u64> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = if push {
            c.push(2, keys)
        } else {
            c.fetch(2, keys)
        };
        match r {
            Ok(id) => return Some(id),
            Err(kvd::Error::Unavailable(_) | kvd::Error::Overloaded { .. })
                if Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(_) => return None,
        }
    }
}

/// Run every transfer of `groups`, the `i`th from source `i % clients.len()`, each source its
/// share in turn on a thread of its own (bounded: 10 minutes in all); whether each ended done.
fn run_all(
    clients: &mut [kvd::client::Client],
    groups: &[(bool, Vec<BlockKey>)],
    relays: &[Relay],
) -> Vec<bool> {
    let sources = clients.len();
    let started = Instant::now();
    let deadline = started + Duration::from_secs(600);
    let progress = AtomicU64::new(0);
    let ended: Vec<Vec<(usize, bool)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = clients
            .iter_mut()
            .enumerate()
            .map(|(s, c)| {
                let progress = &progress;
                scope.spawn(move || {
                    let mut out = Vec::new();
                    for (i, (push, keys)) in groups.iter().enumerate().skip(s).step_by(sources) {
                        assert!(Instant::now() < deadline, "transfers past 10 minutes");
                        let done = start_transfer(c, *push, keys).is_some_and(|id| {
                            let t = support::wait_transfer(c, id, Duration::from_secs(90));
                            t.state == TransferState::Done
                        });
                        out.push((i, done));
                        let n = progress.fetch_add(1, Ordering::Relaxed) + 1;
                        if n % 100 == 0 {
                            let flips: u64 = relays.iter().map(Relay::flips).sum();
                            println!(
                                "{n:>5} transfers, {flips} flips, {:.0} s",
                                started.elapsed().as_secs_f64()
                            );
                        }
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut done_at = vec![false; groups.len()];
    for (i, d) in ended.iter().flatten() {
        done_at[*i] = *d;
    }
    done_at
}

/// Wait until no node has a transfer open or a page WRITING (bounded).
fn wait_settled(nodes: &[&Daemon]) {
    support::wait_until(
        Duration::from_secs(60),
        "every node settles (no transfer left open, no page left WRITING)",
        || {
            nodes.iter().all(|d| {
                let s = d.status();
                let dp = s.data_port.unwrap();
                s.stats.accounting.writing == 0 && dp.incoming_in_flight == 0
            })
        },
    );
}

/// Every block anywhere is one that was sent, with the source's bytes: the pushed ones on B
/// and the fetched ones on their source each absent or exact (and present where the transfer
/// said done), and the counts of published blocks leave no room for one under a key nobody
/// sent. `groups[i]` went between source `i % sources` and B; `on_b` and `own[s]` count the
/// blocks each held before.
fn every_block_was_sent_with_its_bytes(
    (b, cb): (&Daemon, &mut kvd::client::Client),
    (sources, clients): (&[Daemon], &mut [kvd::client::Client]),
    (groups, done_at): (&[(bool, Vec<BlockKey>)], &[bool]),
    (on_b, own): (u32, &[u32]),
) {
    let n = sources.len();
    let mut pushed_there = 0u32;
    let mut fetched_here = vec![0u32; n];
    for (i, ((push, keys), done)) in groups.iter().zip(done_at).enumerate() {
        let s = i % n;
        for k in keys {
            let there = if *push {
                holds_exactly(cb, k)
            } else {
                holds_exactly(&mut clients[s], k)
            };
            assert!(
                there || !done,
                "{k:?}: its transfer was done, the block is missing"
            );
            if *push {
                pushed_there += u32::from(there);
            } else {
                fetched_here[s] += u32::from(there);
            }
        }
    }
    assert_eq!(
        published(b),
        on_b + pushed_there,
        "B holds only blocks sent to it"
    );
    for (s, d) in sources.iter().enumerate() {
        assert_eq!(
            published(d),
            own[s] + fetched_here[s],
            "source {s} holds only its own blocks and those it fetched"
        );
    }
}

#[test]
fn a_relay_flipping_bytes_at_random_over_a_thousand_transfers_gets_no_wrong_key_or_byte_published()
{
    const TRANSFERS: usize = 1000;
    const PER_TRANSFER: usize = 2;
    /// Source nodes, each through a relay of its own, each running its share in turn: a
    /// source that saw a failure avoids node 2 for a while, the others go on meanwhile.
    const SOURCES: usize = 4;
    let net = Net::new();
    let b = destination(&net);
    let ns = support::namespace().id();
    let mut cb = b.client("engine-b", 60_000);
    cb.register_namespace(&support::namespace()).unwrap();
    let relays: Vec<Relay> = (0..SOURCES)
        .map(|i| {
            Relay::start(
                b.data_addr(),
                Fault::Random { one_in: 120 },
                0x5eed + i as u64,
            )
        })
        .collect();
    let sources: Vec<Daemon> = relays
        .iter()
        .enumerate()
        .map(|(i, r)| source(&net, 10 + i as u64, r))
        .collect();
    // seven in ten transfers push a source's blocks to B, the rest fetch B's blocks to it
    let groups: Vec<(bool, Vec<BlockKey>)> = (0..TRANSFERS)
        .map(|i| (i % 10 < 7, support::keys(ns, 1000 + i as u64, PER_TRANSFER)))
        .collect();
    let mut own = [0u32; SOURCES];
    let mut on_b = 0u32;
    let mut clients: Vec<kvd::client::Client> = sources
        .iter()
        .map(|d| {
            let mut c = d.client("engine", 60_000);
            c.register_namespace(&support::namespace()).unwrap();
            c
        })
        .collect();
    for (i, (push, keys)) in groups.iter().enumerate() {
        let s = i % SOURCES;
        for k in keys {
            if *push {
                support::put_one(&mut clients[s], *k, &content(k));
                own[s] += 1;
            } else {
                support::put_one(&mut cb, *k, &content(k));
                on_b += 1;
            }
        }
    }
    let started = Instant::now();
    let done_at = run_all(&mut clients, &groups, &relays);
    let done = done_at.iter().filter(|d| **d).count();
    let failed = TRANSFERS - done;
    let everyone: Vec<&Daemon> = sources.iter().chain([&b]).collect();
    wait_settled(&everyone);
    every_block_was_sent_with_its_bytes(
        (&b, &mut cb),
        (&sources, &mut clients),
        (&groups, &done_at),
        (on_b, &own),
    );
    let engines: Vec<_> = everyone
        .iter()
        .map(|d| d.status().data_port.unwrap().engine)
        .collect();
    let integrity: u64 = engines.iter().map(|e| e.integrity_failures).sum();
    let crc: u64 = engines.iter().map(|e| e.checksum_failures).sum();
    let flips: u64 = relays.iter().map(Relay::flips).sum();
    println!(
        "| transfers | done | failed | relay flips | tags failed | CRC failures | seconds |\n\
         |---|---|---|---|---|---|---|\n\
         | {TRANSFERS} | {done} | {failed} | {flips} | {integrity} | {crc} | {:.0} |",
        started.elapsed().as_secs_f64()
    );
    assert!(flips >= 50, "the relays flipped {flips} bits");
    assert!(
        integrity > 0,
        "some flips hit tagged frames and were caught there: {engines:?}"
    );
    assert!(
        done >= TRANSFERS / 2,
        "most transfers still go through a lossy link: {done} of {TRANSFERS}"
    );
    assert!(failed > 0, "the flips failed some transfers");
}
