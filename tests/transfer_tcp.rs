//! The TCP transfer backend between real processes: on loopback (this test process as the
//! initiator, targets as helper processes) and across a veth link between two network
//! namespaces the test creates (both ends as helpers). Every wait is bounded.
//!
//! Helpers are this binary started again on one ignored test (`transfer_target_helper`,
//! `transfer_initiator_helper`), driven by lines on stdin, answering with lines that start
//! with `@`.

mod support;

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::{Helper, TwoHosts, ip};
use transport::auth::ClusterSecret;
use transport::engine::{
    EndpointId, HeapMemory, Memory, Op, OpFailure, OpKind, OpStatus, Registration, Transport,
};
use transport::grant::{Direction, Grant, SegmentId, TransferId};
use transport::link::PeerAddr;
use transport::segment::SegmentDescriptor;
use transport::tcp::{TcpConfig, TcpTransport};

const SEG: SegmentId = SegmentId(1);
const MIB: u64 = 1 << 20;
const ANSWER: Duration = Duration::from_secs(30);

fn byte_at(seed: u8, i: usize) -> u8 {
    (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8
}

fn fill(mem: &HeapMemory, seed: u8) {
    // SAFETY: called before any transfer names the memory.
    let b = unsafe { mem.bytes_mut() };
    for (i, x) in b.iter_mut().enumerate() {
        *x = byte_at(seed, i);
    }
}

fn crc_of(mem: &HeapMemory, off: u64, len: u64) -> u32 {
    // SAFETY: callers ask only once the batches naming the range settled and grants on it
    // were revoked (or never existed).
    let b = unsafe { mem.bytes() };
    transport::local::crc32c(0, &b[off as usize..(off + len) as usize])
}

fn hex(d: &SegmentDescriptor) -> String {
    d.encode().iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> SegmentDescriptor {
    let bytes: Vec<u8> = (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    SegmentDescriptor::decode(&bytes).unwrap()
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"))
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

/// A secret file readable by its owner only.
fn secret_file(dir: &Path, name: &str, byte: u8) -> PathBuf {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let p = dir.join(name);
    let mut f = std::fs::OpenOptions::new()
        .create_new(true)
        .write(true)
        .mode(0o600)
        .open(&p)
        .unwrap();
    f.write_all(&[byte; 32]).unwrap();
    p
}

/// Node `node`'s engine settings: its test key, and every node of these tests (1 to 9) a
/// member with its test key.
fn config(node: u64, listen: &str, secret: &Path, stall_ms: u64) -> TcpConfig {
    let secret = ClusterSecret::from_file(secret).unwrap();
    let mut c = transport::link::testing::tcp_config(node, 1, secret, &[1, 2, 3, 4, 5, 6, 7, 8, 9]);
    c.listen = listen.parse().unwrap();
    c.stall_timeout = Duration::from_millis(stall_ms);
    c
}

fn grant(e: &TcpTransport, t: u64, d: Direction, off: u64, len: u64) {
    let g = Grant {
        transfer: TransferId(t),
        epoch: 1,
        segment: SEG,
        offset: off,
        len,
        direction: d,
        expires_at_ms: e.now_ms() + 600_000,
        peer: None,
    };
    // SAFETY: the helpers read their memory only for `crc`, which the tests ask for once the
    // transfers naming it are over.
    unsafe { e.grant(g).unwrap() };
}

fn ops(kind: OpKind, remote: SegmentDescriptor, t: u64, off: u64, n: u64, size: u64) -> Vec<Op> {
    (0..n)
        .map(|i| Op {
            kind,
            local: SEG,
            local_offset: off + i * size,
            remote,
            remote_offset: off + i * size,
            len: size,
            transfer: TransferId(t),
            epoch: 1,
        })
        .collect()
}

/// The target helper: an engine with one segment of `KVD_TEST_SEGMENT_MIB` MiB filled from
/// `KVD_TEST_SEED`, listening on `KVD_TEST_LISTEN`, as node `KVD_TEST_NODE`.
#[test]
#[ignore = "a helper process of the tests in this file"]
fn transfer_target_helper() {
    helper_log();
    let len = env("KVD_TEST_SEGMENT_MIB").parse::<u64>().unwrap() * MIB;
    let node = env("KVD_TEST_NODE").parse().unwrap();
    let c = config(
        node,
        &env("KVD_TEST_LISTEN"),
        Path::new(&env("KVD_TEST_SECRET")),
        2000,
    );
    let e = TcpTransport::start(c).unwrap();
    let mem = Arc::new(HeapMemory::zeroed(len as usize));
    fill(&mem, env("KVD_TEST_SEED").parse().unwrap());
    let d = e
        .register(SEG, mem.clone() as Arc<dyn Memory>, 0, len)
        .unwrap()
        .descriptor();
    println!("@ready {} {}", e.local_addr(), hex(&d));
    for line in std::io::stdin().lock().lines().map_while(Result::ok) {
        let w: Vec<&str> = line.split_whitespace().collect();
        let n = |i: usize| w[i].parse::<u64>().unwrap();
        match w[0] {
            "grant" => {
                let d = if w[2] == "w" {
                    Direction::RemoteWrite
                } else {
                    Direction::RemoteRead
                };
                grant(&e, n(1), d, n(3), n(4));
                println!("@granted");
            }
            "revoke" => println!("@revoked {}", e.revoke(TransferId(n(1))).grants),
            "crc" => println!("@crc {:08x}", crc_of(&mem, n(1), n(2))),
            "corrupt" => {
                e.inject_corrupt_chunk(n(1));
                println!("@ok");
            }
            "stats" => {
                let s = e.stats();
                println!(
                    "@stats served={} checksum_failures={} refused={}",
                    s.chunks_served, s.checksum_failures, s.refused
                );
            }
            other => panic!("unknown command {other}"),
        }
    }
}

/// The initiator helper: an engine with one segment filled from `KVD_TEST_SEED`, an endpoint
/// to `KVD_TEST_PEER` (node `KVD_TEST_PEER_NODE`, segment `KVD_TEST_DESC`).
/// `write T OFF N SIZE` submits N writes and answers `@submitted`; `progress` answers
/// `@progress DONE`; `wait` answers `@batch done=D failed=F first=WHY ms=ELAPSED` once the
/// batch settles (at most 60 s); `crc OFF LEN` answers `@crc X`; `stats` answers
/// `@stats slow_progress=N`.
#[test]
#[ignore = "a helper process of the tests in this file"]
fn transfer_initiator_helper() {
    helper_log();
    let len = env("KVD_TEST_SEGMENT_MIB").parse::<u64>().unwrap() * MIB;
    let stall_ms = env_or("KVD_TEST_STALL_MS", "2000").parse().unwrap();
    let c = config(1, "0.0.0.0:0", Path::new(&env("KVD_TEST_SECRET")), stall_ms);
    let e = TcpTransport::start(c).unwrap();
    let mem = Arc::new(HeapMemory::zeroed(len as usize));
    fill(&mem, env("KVD_TEST_SEED").parse().unwrap());
    e.register(SEG, mem.clone() as Arc<dyn Memory>, 0, len)
        .unwrap();
    let remote = unhex(&env("KVD_TEST_DESC"));
    let ep = e
        .open(&PeerAddr {
            addr: env("KVD_TEST_PEER").parse().unwrap(),
            node_id: env("KVD_TEST_PEER_NODE").parse().unwrap(),
        })
        .unwrap();
    println!("@ready");
    let mut batch = None;
    let mut started = Instant::now();
    for line in std::io::stdin().lock().lines().map_while(Result::ok) {
        let w: Vec<&str> = line.split_whitespace().collect();
        let n = |i: usize| w[i].parse::<u64>().unwrap();
        match w[0] {
            "write" => {
                let o = ops(OpKind::Write, remote, n(1), n(2), n(3), n(4));
                started = Instant::now();
                // SAFETY: this process never touches its memory while the batch runs.
                batch = Some(unsafe { e.submit(ep, &o).unwrap() });
                println!("@submitted");
            }
            "progress" => {
                let s = e.poll(batch.unwrap(), &mut []).unwrap();
                println!("@progress {}", s.done);
            }
            "wait" => {
                let s = e.wait(batch.unwrap(), Duration::from_secs(60)).unwrap();
                println!(
                    "@batch done={} failed={} first={:?} settled={} ms={}",
                    s.done,
                    s.failed,
                    s.first_failure,
                    s.settled,
                    started.elapsed().as_millis()
                );
            }
            "crc" => println!("@crc {:08x}", crc_of(&mem, n(1), n(2))),
            "stats" => println!("@stats slow_progress={}", e.stats().slow_progress),
            other => panic!("unknown command {other}"),
        }
    }
}

struct Target {
    helper: Helper,
    addr: std::net::SocketAddr,
    desc: SegmentDescriptor,
}

fn start_target(
    dir: &Path,
    prefix: &[&str],
    node: u64,
    listen: &str,
    secret: &Path,
    mib: u64,
    seed: u8,
) -> Target {
    let (node_s, mib_s, seed_s) = (node.to_string(), mib.to_string(), seed.to_string());
    let mut helper = Helper::spawn(
        prefix,
        "transfer_target_helper",
        &[
            ("KVD_TEST_SECRET", secret.to_str().unwrap()),
            ("KVD_TEST_LISTEN", listen),
            ("KVD_TEST_NODE", &node_s),
            ("KVD_TEST_SEGMENT_MIB", &mib_s),
            ("KVD_TEST_SEED", &seed_s),
        ],
        dir.join(format!("target-{node}.log")),
    );
    let ready = helper.wait_for("@ready", ANSWER);
    let w: Vec<&str> = ready.split_whitespace().collect();
    Target {
        helper,
        addr: w[1].parse().unwrap(),
        desc: unhex(w[2]),
    }
}

impl Target {
    fn grant(&mut self, t: u64, dir: &str, off: u64, len: u64) {
        self.helper
            .ask(&format!("grant {t} {dir} {off} {len}"), "@granted", ANSWER);
    }

    fn crc(&mut self, off: u64, len: u64) -> String {
        self.helper.ask(&format!("crc {off} {len}"), "@crc", ANSWER)
    }

    fn stats(&mut self) -> String {
        self.helper.ask("stats", "@stats", ANSWER)
    }

    fn peer(&self) -> PeerAddr {
        PeerAddr {
            addr: self.addr,
            node_id: self.desc.node_id,
        }
    }
}

fn local_engine(secret: &Path, mib: u64, seed: u8) -> (TcpTransport, Arc<HeapMemory>) {
    local_engine_with(secret, mib, seed, |_| {})
}

/// As [`local_engine`], its config changed by `tune` first.
fn local_engine_with(
    secret: &Path,
    mib: u64,
    seed: u8,
    tune: impl FnOnce(&mut TcpConfig),
) -> (TcpTransport, Arc<HeapMemory>) {
    let mut c = config(1, "127.0.0.1:0", secret, 2000);
    tune(&mut c);
    let e = TcpTransport::start(c).unwrap();
    let mem = Arc::new(HeapMemory::zeroed((mib * MIB) as usize));
    fill(&mem, seed);
    e.register(SEG, mem.clone() as Arc<dyn Memory>, 0, mib * MIB)
        .unwrap();
    (e, mem)
}

fn run(
    e: &TcpTransport,
    ep: EndpointId,
    ops: &[Op],
) -> (transport::engine::BatchStatus, Vec<OpStatus>) {
    // SAFETY: the tests touch the ranges only after the batch settles.
    let b = unsafe { e.submit(ep, ops).unwrap() };
    let s = e.wait(b, ANSWER).unwrap();
    assert!(s.settled, "the batch settles within {ANSWER:?}: {s:?}");
    let mut st = vec![OpStatus::Pending; ops.len()];
    e.poll(b, &mut st).unwrap();
    e.release(b).unwrap();
    (s, st)
}

#[test]
fn two_processes_move_batches_of_many_ops_byte_exact_with_every_chunk_checksummed() {
    let dir = tempfile::tempdir().unwrap();
    let secret = secret_file(dir.path(), "secret", 1);
    let mut t = start_target(dir.path(), &[], 2, "127.0.0.1:0", &secret, 128, 20);
    t.grant(1, "w", 0, 64 * MIB);
    t.grant(2, "r", 64 * MIB, 64 * MIB);
    let (e, mem) = local_engine(&secret, 128, 10);
    let ep = e.open(&t.peer()).unwrap();
    // 192 writes of 256 KiB plus 4 of 4 MiB (chunked), then 64 reads of 1 MiB
    let mut w = ops(OpKind::Write, t.desc, 1, 0, 192, 256 << 10);
    w.extend(ops(OpKind::Write, t.desc, 1, 48 * MIB, 4, 4 * MIB));
    let (s, _) = run(&e, ep, &w);
    assert!(s.succeeded(), "{s:?}");
    let (s, _) = run(&e, ep, &ops(OpKind::Read, t.desc, 2, 64 * MIB, 64, MIB));
    assert!(s.succeeded(), "{s:?}");
    assert_eq!(
        t.crc(0, 64 * MIB),
        format!("@crc {:08x}", crc_of(&mem, 0, 64 * MIB)),
        "the writes landed byte-exact"
    );
    // SAFETY: the read batch settled.
    let got = unsafe { mem.bytes() };
    let want = (64 * MIB as usize..128 * MIB as usize).map(|i| byte_at(20, i));
    assert!(
        got[64 * MIB as usize..].iter().copied().eq(want),
        "the reads landed byte-exact"
    );
    let st = e.stats();
    assert_eq!(st.checksum_failures, 0);
    assert_eq!(
        st.chunks_done,
        192 + 16 + 64,
        "every chunk answered ok: {st:?}"
    );
    assert!(t.stats().contains("checksum_failures=0"));
}

#[test]
fn a_chunk_corrupted_in_flight_fails_its_op_and_never_completes_it() {
    let dir = tempfile::tempdir().unwrap();
    let secret = secret_file(dir.path(), "secret", 1);
    let mut t = start_target(dir.path(), &[], 2, "127.0.0.1:0", &secret, 16, 20);
    t.grant(1, "w", 0, 8 * MIB);
    t.grant(2, "r", 8 * MIB, 8 * MIB);
    let (e, _mem) = local_engine(&secret, 16, 10);
    let ep = e.open(&t.peer()).unwrap();
    // the third payload this engine sends is corrupted on the way: the target refuses it (which
    // op that is depends on how the chunks spread over the two connections)
    e.inject_corrupt_chunk(3);
    let (s, st) = run(&e, ep, &ops(OpKind::Write, t.desc, 1, 0, 8, MIB));
    assert_eq!((s.done, s.failed), (7, 1), "{st:?}");
    assert_eq!(s.first_failure, Some(OpFailure::Corrupt), "{st:?}");
    assert!(t.stats().contains("checksum_failures=1"));
    // the target's second read reply is corrupted: this side refuses it
    t.helper.ask("corrupt 2", "@ok", ANSWER);
    let (s, st) = run(&e, ep, &ops(OpKind::Read, t.desc, 2, 8 * MIB, 8, MIB));
    assert_eq!((s.done, s.failed), (7, 1), "{st:?}");
    assert_eq!(s.first_failure, Some(OpFailure::Corrupt), "{st:?}");
    assert_eq!(e.stats().checksum_failures, 1);
}

#[test]
fn a_peer_without_the_secret_cannot_open_an_endpoint_and_one_with_it_cannot_touch_bytes_outside_its_grant()
 {
    let dir = tempfile::tempdir().unwrap();
    let secret = secret_file(dir.path(), "secret", 1);
    let other = secret_file(dir.path(), "other", 2);
    let mut t = start_target(dir.path(), &[], 2, "127.0.0.1:0", &secret, 16, 20);
    t.grant(1, "w", 0, 4 * MIB);
    let before = t.crc(4 * MIB, 12 * MIB);

    let (stranger, _) = local_engine(&other, 16, 10);
    let e = stranger.open(&t.peer()).unwrap_err();
    assert!(e.to_string().contains("secret"), "{e}");

    let (e, _mem) = local_engine(&secret, 16, 10);
    let ep = e.open(&t.peer()).unwrap();
    let mut bad = ops(OpKind::Write, t.desc, 1, 4 * MIB, 4, MIB); // past the grant
    bad.extend(ops(OpKind::Write, t.desc, 9, 0, 1, MIB)); // another transfer
    bad.extend(ops(OpKind::Read, t.desc, 1, 0, 1, MIB)); // the wrong direction
    bad.push(Op {
        epoch: 2,
        ..ops(OpKind::Write, t.desc, 1, 0, 1, MIB)[0]
    }); // the wrong epoch
    let (s, st) = run(&e, ep, &bad);
    assert_eq!(s.failed, bad.len(), "{st:?}");
    assert!(
        st.iter()
            .all(|s| matches!(s, OpStatus::Failed(OpFailure::Refused(_))))
    );
    assert_eq!(
        t.crc(4 * MIB, 12 * MIB),
        before,
        "not a byte outside the grant changed"
    );
    assert!(t.stats().contains(&format!("refused={}", bad.len())));
    // and inside the grant the same endpoint works
    let (s, _) = run(&e, ep, &ops(OpKind::Write, t.desc, 1, 0, 4, MIB));
    assert!(s.succeeded(), "{s:?}");
}

#[test]
fn a_peer_killed_mid_batch_fails_that_endpoints_ops_within_the_timeout_while_another_endpoint_continues()
 {
    let dir = tempfile::tempdir().unwrap();
    let secret = secret_file(dir.path(), "secret", 1);
    let mut victim = start_target(dir.path(), &[], 2, "127.0.0.1:0", &secret, 256, 20);
    let mut survivor = start_target(dir.path(), &[], 3, "127.0.0.1:0", &secret, 256, 30);
    victim.grant(1, "w", 0, 256 * MIB);
    survivor.grant(1, "w", 0, 256 * MIB);
    // a small window, so the batches take long enough to be killed in the middle of
    let (e, mem) = local_engine_with(&secret, 256, 10, |c| {
        c.connections = 1;
        c.window = 1;
        c.chunk_bytes = 64 << 10;
    });
    let to_victim = e.open(&victim.peer()).unwrap();
    let to_survivor = e.open(&survivor.peer()).unwrap();
    let w = |t: &Target| ops(OpKind::Write, t.desc, 1, 0, 256, MIB);
    // SAFETY: the memory is only read by both batches (two writes of the same source).
    let (bv, bs) = unsafe {
        (
            e.submit(to_victim, &w(&victim)).unwrap(),
            e.submit(to_survivor, &w(&survivor)).unwrap(),
        )
    };
    support::wait_until(
        Duration::from_secs(30),
        "the first ops to the victim land",
        || e.poll(bv, &mut []).unwrap().done > 0,
    );
    let mid = e.poll(bv, &mut []).unwrap();
    assert!(
        !mid.terminal,
        "the batch is still in flight when the peer dies: {mid:?}"
    );
    let killed = Instant::now();
    victim.helper.kill9();
    let s = e.wait(bv, Duration::from_secs(10)).unwrap();
    let detected = killed.elapsed();
    println!("kill -9 mid-batch: the victim's batch settled {detected:?} after the kill: {s:?}");
    assert!(s.settled && s.failed > 0, "{s:?}");
    assert!(matches!(
        s.first_failure,
        Some(OpFailure::PeerClosed | OpFailure::Timeout)
    ));
    assert!(
        detected < Duration::from_millis(2000 + 3000),
        "within the stall timeout + margin"
    );
    // the endpoint is failed for good; submitting again says so
    // SAFETY: as above.
    let again = unsafe { e.submit(to_victim, &w(&victim)[..1]) }.unwrap_err();
    assert!(
        again.is_retryable() && again.to_string().contains("open a new one"),
        "{again}"
    );
    // the other endpoint carried on to the end
    let s = e.wait(bs, ANSWER).unwrap();
    assert!(s.succeeded(), "{s:?}");
    assert_eq!(
        survivor.crc(0, 256 * MIB),
        format!("@crc {:08x}", crc_of(&mem, 0, 256 * MIB))
    );
}

#[test]
fn a_stalled_peer_fails_the_batch_with_a_timeout_within_the_stall_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let secret = secret_file(dir.path(), "secret", 1);
    let mut t = start_target(dir.path(), &[], 2, "127.0.0.1:0", &secret, 256, 20);
    t.grant(1, "w", 0, 256 * MIB);
    let stall = Duration::from_millis(1000);
    let e = {
        let mut c = config(1, "127.0.0.1:0", &secret, stall.as_millis() as u64);
        c.connections = 1;
        c.window = 1;
        c.chunk_bytes = 64 << 10;
        TcpTransport::start(c).unwrap()
    };
    let mem = Arc::new(HeapMemory::zeroed((256 * MIB) as usize));
    e.register(SEG, mem.clone() as Arc<dyn Memory>, 0, 256 * MIB)
        .unwrap();
    let ep = e.open(&t.peer()).unwrap();
    // SAFETY: the memory is not touched while the batch runs.
    let b = unsafe {
        e.submit(ep, &ops(OpKind::Write, t.desc, 1, 0, 256, MIB))
            .unwrap()
    };
    support::wait_until(Duration::from_secs(30), "the first ops land", || {
        e.poll(b, &mut []).unwrap().done > 0
    });
    let stopped = Instant::now();
    support::signal(t.helper.pid(), rustix::process::Signal::STOP);
    let s = e.wait(b, Duration::from_secs(20)).unwrap();
    let detected = stopped.elapsed();
    support::signal(t.helper.pid(), rustix::process::Signal::CONT);
    println!("SIGSTOP mid-batch: the batch settled {detected:?} after the stop: {s:?}");
    assert!(s.settled && s.failed > 0, "{s:?}");
    assert_eq!(s.first_failure, Some(OpFailure::Timeout), "{s:?}");
    assert!(
        detected >= stall.mul_f32(0.5),
        "not before the peer could have stalled"
    );
    assert!(
        detected < stall + Duration::from_secs(3),
        "within the stall timeout + margin"
    );
    assert_eq!(e.in_flight(), (0, 0), "nothing left in flight");
}

/// A target helper in `hosts.b` with a segment of `mib` MiB, all of it granted for writes to
/// node 1, and an initiator helper in `hosts.a` (segment seeded with `seed`, stall timeout
/// `stall_ms`) with an endpoint to it across the veth, ready.
fn across_the_veth(
    hosts: &TwoHosts,
    dir: &Path,
    secret: &Path,
    mib: u64,
    seed: u64,
    stall_ms: u64,
) -> (Target, Helper) {
    let exec_b = ["ip", "netns", "exec", hosts.b.as_str()];
    let exec_a = ["ip", "netns", "exec", hosts.a.as_str()];
    let mut t = start_target(dir, &exec_b, 2, "10.77.0.2:0", secret, mib, 20);
    t.grant(1, "w", 0, mib * MIB);
    let peer = format!("10.77.0.2:{}", t.addr.port());
    let desc = hex(&t.desc);
    let (mib, seed, stall_ms) = (mib.to_string(), seed.to_string(), stall_ms.to_string());
    let mut a = Helper::spawn(
        &exec_a,
        "transfer_initiator_helper",
        &[
            ("KVD_TEST_SECRET", secret.to_str().unwrap()),
            ("KVD_TEST_PEER", &peer),
            ("KVD_TEST_PEER_NODE", "2"),
            ("KVD_TEST_DESC", &desc),
            ("KVD_TEST_SEGMENT_MIB", &mib),
            ("KVD_TEST_SEED", &seed),
            ("KVD_TEST_STALL_MS", &stall_ms),
        ],
        dir.join("initiator.log"),
    );
    a.wait_for("@ready", ANSWER);
    (t, a)
}

#[test]
fn across_a_veth_link_a_batch_arrives_and_cutting_the_link_fails_the_batch_within_the_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let secret = secret_file(dir.path(), "secret", 1);
    let hosts = TwoHosts::new();
    let (mut t, mut a) = across_the_veth(&hosts, dir.path(), &secret, 128, 10, 1500);

    // a batch across the link, byte-exact
    a.ask("write 1 0 64 1048576", "@submitted", ANSWER);
    let done = a.ask("wait", "@batch", Duration::from_secs(90));
    assert!(done.contains("done=64 failed=0"), "{done}");
    assert_eq!(t.crc(0, 64 * MIB), a.ask("crc 0 67108864", "@crc", ANSWER));

    // slow the link (so the next batch is surely in the middle when it is cut), then cut it
    hosts.shape_a("200mbit", "64kb", "latency 100ms");
    let dev = hosts.dev_a();
    a.ask("write 1 64 64 1048576", "@submitted", ANSWER);
    support::wait_until(
        Duration::from_secs(30),
        "the first ops cross the slow link",
        || {
            let p = a.ask("progress", "@progress", ANSWER);
            p.trim_start_matches("@progress ")
                .trim()
                .parse::<u64>()
                .unwrap()
                > 0
        },
    );
    let cut = Instant::now();
    ip(&["-n", &hosts.a, "link", "set", &dev, "down"]);
    let failed = a.ask("wait", "@batch", Duration::from_secs(60));
    let detected = cut.elapsed();
    println!("link cut mid-batch: the batch settled {detected:?} after the cut: {failed}");
    assert!(failed.contains("settled=true"), "{failed}");
    assert!(!failed.contains("failed=0"), "{failed}");
    assert!(
        failed.contains("Timeout") || failed.contains("PeerClosed"),
        "{failed}"
    );
    assert!(
        detected < Duration::from_millis(1500 + 5000),
        "failed within the stall timeout plus a margin: {detected:?}"
    );
}

/// A helper's warnings (a failed connection's state, say) go to its stderr, the log file the
/// test names.
fn helper_log() {
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
}

/// A link slower than one chunk per stall timeout is slow, not stalled: across a veth shaped
/// to 4 Mbit/s, chunks of 1 MiB take about 4 s each (two connections share the link) against
/// a stall timeout of 2 s, and
/// the batch still arrives byte-exact, kept alive by the bytes moving under its sockets
/// (`slow_progress` counts the checks that kept it). The stopped peer and the cut link of the
/// tests above move nothing and still fail within the timeout.
#[test]
fn a_link_slower_than_a_chunk_per_stall_timeout_delivers_its_batch_instead_of_timing_out() {
    let dir = tempfile::tempdir().unwrap();
    let secret = secret_file(dir.path(), "secret", 1);
    let hosts = TwoHosts::new();
    // The shaper's queue holds every byte of the batch (4 MiB), so nothing is ever dropped
    // at it. With tbf's usual short queue (200 ms, 100 KB) the initiator's sockets, being
    // local, had segments refused by the full queue (TCP small queues let a socket put up
    // to 4 MiB into a qdisc); a refused segment stays unsent, and with nothing of its flow
    // in flight it waits for a probe timer (500 ms for a local drop), so a flow whose
    // retries kept meeting the queue the other flow had filled moved 1.4 KB in the
    // timeout's second half (CI, under load; here 2 of 12 runs under a CPU hog, against 0
    // of 10 with this queue): a stall by the check's own rule, not a slow link. A queue
    // that cannot overflow keeps both flows moving at the link's pace, the case this test
    // is about.
    let (mut t, mut a) = across_the_veth(&hosts, dir.path(), &secret, 16, 12, 2000);
    hosts.shape_a("4mbit", "32kb", "limit 8mb");
    a.ask("write 1 0 4 1048576", "@submitted", ANSWER);
    let done = a.ask("wait", "@batch", Duration::from_secs(60));
    println!("4 x 1 MiB over 4 Mbit/s, stall timeout 2 s: {done}");
    assert!(
        done.contains("done=4 failed=0"),
        "{done}; the initiator's log:\n{}",
        std::fs::read_to_string(dir.path().join("initiator.log")).unwrap_or_default()
    );
    let ms: u64 = done
        .rsplit("ms=")
        .next()
        .and_then(|m| m.trim().parse().ok())
        .unwrap();
    assert!(
        ms >= 4_000,
        "the batch took {ms} ms: the link was not slower than the stall timeout"
    );
    assert_eq!(t.crc(0, 4 * MIB), a.ask("crc 0 4194304", "@crc", ANSWER));
    let stats = a.ask("stats", "@stats", ANSWER);
    let kept: u64 = stats
        .trim_start_matches("@stats slow_progress=")
        .trim()
        .parse()
        .unwrap();
    assert!(
        kept > 0,
        "no stall check had to look under the sockets: {stats}"
    );
}

#[test]
fn an_endpoint_spread_over_three_ring_threads_moves_bytes_exactly_and_fails_as_one_when_its_peer_dies()
 {
    let dir = tempfile::tempdir().unwrap();
    let secret = secret_file(dir.path(), "secret", 1);
    let mut t = start_target(dir.path(), &[], 2, "127.0.0.1:0", &secret, 256, 20);
    t.grant(1, "w", 0, 128 * MIB);
    t.grant(2, "r", 128 * MIB, 128 * MIB);
    let (e, mem) = local_engine_with(&secret, 256, 10, |c| {
        // four streams dealt to three lanes: one lane holds two
        c.connections = 4;
        c.lanes = 3;
        c.window = 2;
        c.chunk_bytes = 64 << 10;
    });
    let ep = e.open(&t.peer()).unwrap();
    // ops of several chunks each, so one op's chunks travel on several lanes
    let (s, _) = run(&e, ep, &ops(OpKind::Write, t.desc, 1, 0, 24, 1 << 20));
    assert!(s.succeeded(), "{s:?}");
    let (s, _) = run(
        &e,
        ep,
        &ops(OpKind::Read, t.desc, 2, 128 * MIB, 24, 1 << 20),
    );
    assert!(s.succeeded(), "{s:?}");
    assert_eq!(
        t.crc(0, 24 * MIB),
        format!("@crc {:08x}", crc_of(&mem, 0, 24 * MIB)),
        "the writes landed byte-exact"
    );
    // SAFETY: the read batch settled.
    let got = unsafe { mem.bytes() };
    let at = 128 * MIB as usize;
    let want = (at..at + 24 * MIB as usize).map(|i| byte_at(20, i));
    assert!(
        got[at..at + 24 * MIB as usize].iter().copied().eq(want),
        "the reads landed byte-exact"
    );
    // a long batch, then the peer dies: every lane's part fails, nothing stays pending
    let w = ops(OpKind::Write, t.desc, 1, 0, 128, MIB);
    // SAFETY: this memory is only read while the batch runs.
    let b = unsafe { e.submit(ep, &w).unwrap() };
    support::wait_until(
        Duration::from_secs(30),
        "the first ops of the long batch land",
        || e.poll(b, &mut []).unwrap().done > 0,
    );
    let killed = Instant::now();
    t.helper.kill9();
    let s = e.wait(b, Duration::from_secs(10)).unwrap();
    println!(
        "kill -9 with the endpoint on three lanes: settled {:?} after: {s:?}",
        killed.elapsed()
    );
    assert!(s.settled && s.failed > 0, "{s:?}");
    assert_eq!(
        s.done + s.failed + s.cancelled,
        w.len(),
        "no op left pending"
    );
    assert!(killed.elapsed() < Duration::from_millis(2000 + 3000));
    // SAFETY: as above.
    let again = unsafe { e.submit(ep, &w[..1]) }.unwrap_err();
    assert!(again.to_string().contains("open a new one"), "{again}");
}
