//! The TCP backend between two engines in one process, on loopback: byte-exact batches both
//! ways, grants enforced, the fault hook, cancel, bounds.

use std::sync::Arc;
use std::time::Duration;

use transport::auth::{ClusterSecret, Hello};
use transport::engine::{
    HeapMemory, Memory, Op, OpFailure, OpKind, OpStatus, Registration, Transport,
};
use transport::grant::{Direction, Grant, PeerNode, SegmentId, TransferId};
use transport::link::{PeerAddr, testing};
use transport::segment::SegmentDescriptor;
use transport::tcp::{TcpConfig, TcpStats, TcpTransport, ZeroCopy};

const SEG: SegmentId = SegmentId(1);
const MIB: u64 = 1 << 20;
/// The nodes of these tests: each engine knows every one's (test) key.
const NODES: &[u64] = &[1, 2, 3, 4, 5];

fn secret(b: u8) -> ClusterSecret {
    ClusterSecret::from_bytes(&[b; 32]).unwrap()
}

fn engine(node: u64, tune: impl FnOnce(&mut TcpConfig)) -> TcpTransport {
    let mut c = testing::tcp_config(node, 1, secret(7), NODES);
    c.stall_timeout = Duration::from_secs(2);
    // small chunks, so that 1 MiB ops are cut into four
    c.chunk_bytes = 256 << 10;
    tune(&mut c);
    TcpTransport::start(c).unwrap()
}

fn pattern(mem: &HeapMemory, seed: u8) {
    // SAFETY: no transfer touches the memory yet.
    let b = unsafe { mem.bytes_mut() };
    for (i, x) in b.iter_mut().enumerate() {
        *x = (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8;
    }
}

struct Pair {
    a: TcpTransport,
    b: TcpTransport,
    ma: Arc<HeapMemory>,
    mb: Arc<HeapMemory>,
    remote: SegmentDescriptor,
}

fn pair(len: u64, tune: impl Fn(&mut TcpConfig)) -> Pair {
    let a = engine(1, &tune);
    let b = engine(2, &tune);
    let ma = Arc::new(HeapMemory::zeroed(len as usize));
    let mb = Arc::new(HeapMemory::zeroed(len as usize));
    a.register(SEG, ma.clone() as Arc<dyn Memory>, 0, len)
        .unwrap();
    let remote = b
        .register(SEG, mb.clone() as Arc<dyn Memory>, 0, len)
        .unwrap()
        .descriptor();
    Pair {
        a,
        b,
        ma,
        mb,
        remote,
    }
}

fn grant(e: &TcpTransport, t: u64, off: u64, len: u64, d: Direction) {
    let g = Grant {
        transfer: TransferId(t),
        epoch: 1,
        segment: SEG,
        offset: off,
        len,
        direction: d,
        expires_at_ms: e.now_ms() + 60_000,
        peer: None,
    };
    // SAFETY: the tests touch granted ranges only after the batch settled and revoke returned.
    unsafe { e.grant(g).unwrap() };
}

fn ops(kind: OpKind, remote: SegmentDescriptor, t: u64, n: u64, size: u64) -> Vec<Op> {
    (0..n)
        .map(|i| Op {
            kind,
            local: SEG,
            local_offset: i * size,
            remote,
            remote_offset: i * size,
            len: size,
            transfer: TransferId(t),
            epoch: 1,
        })
        .collect()
}

fn peer(e: &TcpTransport, node: u64) -> PeerAddr {
    PeerAddr {
        addr: e.local_addr(),
        node_id: node,
    }
}

#[test]
fn batches_of_many_writes_and_reads_arrive_byte_exact_with_every_chunk_checksummed() {
    byte_exact(|_| {});
}

#[test]
fn zero_copy_sends_arrive_byte_exact_and_settle_only_after_the_kernel_lets_go() {
    let st = byte_exact(|c| c.zero_copy = ZeroCopy::On);
    assert!(st.zero_copy_sends > 0, "{st:?}");
}

fn byte_exact(tune: impl Fn(&mut TcpConfig)) -> TcpStats {
    let p = pair(64 * MIB, tune);
    pattern(&p.ma, 1);
    pattern(&p.mb, 2);
    grant(&p.b, 1, 0, 32 * MIB, Direction::RemoteWrite);
    grant(&p.b, 2, 32 * MIB, 32 * MIB, Direction::RemoteRead);
    let ep = p.a.open(&peer(&p.b, 2)).unwrap();
    // 64 writes of 256 KiB (one chunk each) and 16 of 1 MiB (four chunks each)
    let mut w = ops(OpKind::Write, p.remote, 1, 64, 256 << 10);
    w.extend(
        ops(OpKind::Write, p.remote, 1, 16, MIB)
            .into_iter()
            .map(|mut o| {
                o.local_offset += 16 * MIB;
                o.remote_offset += 16 * MIB;
                o
            }),
    );
    // SAFETY: the ranges are left alone until the batch settles.
    let bw = unsafe { p.a.submit(ep, &w).unwrap() };
    let r: Vec<Op> = ops(OpKind::Read, p.remote, 2, 32, MIB)
        .into_iter()
        .map(|mut o| {
            o.local_offset += 32 * MIB;
            o.remote_offset += 32 * MIB;
            o
        })
        .collect();
    // SAFETY: as above.
    let br = unsafe { p.a.submit(ep, &r).unwrap() };
    let mut read_crcs = vec![None; r.len()];
    for b in [bw, br] {
        let s = p.a.wait(b, Duration::from_secs(20)).unwrap();
        assert!(s.succeeded(), "{s:?}");
        if b == br {
            p.a.checksums(b, &mut read_crcs).unwrap();
        }
        p.a.release(b).unwrap();
    }
    let ledger = p.b.revoke(TransferId(1)).ledger;
    p.b.revoke(TransferId(2));
    // SAFETY: settled and revoked: nothing touches the memory any more.
    let (a, b) = unsafe { (p.ma.bytes(), p.mb.bytes()) };
    // the receiver knows each op's CRC-32C from the chunks it verified, without a pass
    for o in &w {
        let range = o.remote_offset as usize..(o.remote_offset + o.len) as usize;
        let want = transport::local::crc32c(0, &b[range]);
        assert_eq!(ledger.crc_of(SEG, o.remote_offset, o.len), Some(want));
    }
    assert_eq!(
        ledger.crc_of(SEG, 3, 4096),
        None,
        "not a range the chunks tile"
    );
    // and the reader knows each read's CRC-32C from the chunks it verified
    for (o, crc) in r.iter().zip(&read_crcs) {
        let range = o.local_offset as usize..(o.local_offset + o.len) as usize;
        assert_eq!(*crc, Some(transport::local::crc32c(0, &a[range])));
    }
    assert!(
        a[..32 * MIB as usize] == b[..32 * MIB as usize],
        "writes landed byte-exact"
    );
    assert!(
        a[32 * MIB as usize..] == b[32 * MIB as usize..],
        "reads landed byte-exact"
    );
    let st = p.a.stats();
    assert_eq!(st.chunks_done, 64 + 16 * 4 + 32 * 4);
    assert_eq!(st.checksum_failures, 0);
    assert_eq!(p.a.in_flight(), (0, 0));
    st
}

#[test]
fn a_corrupted_chunk_fails_its_op_and_only_its_op() {
    let p = pair(8 * MIB, |_| {});
    pattern(&p.ma, 3);
    grant(&p.b, 1, 0, 8 * MIB, Direction::RemoteWrite);
    let ep = p.a.open(&peer(&p.b, 2)).unwrap();
    p.a.inject_corrupt_chunk(5);
    // SAFETY: left alone until settled.
    let b = unsafe {
        p.a.submit(ep, &ops(OpKind::Write, p.remote, 1, 8, MIB))
            .unwrap()
    };
    let s = p.a.wait(b, Duration::from_secs(20)).unwrap();
    let mut st = [OpStatus::Pending; 8];
    p.a.poll(b, &mut st).unwrap();
    assert!(s.settled);
    assert_eq!(s.failed, 1, "{st:?}");
    assert_eq!(s.done, 7);
    assert_eq!(s.first_failure, Some(OpFailure::Corrupt), "{st:?}");
    assert_eq!(p.b.stats().checksum_failures, 1);
    let r = p.b.revoke(TransferId(1));
    assert_eq!(
        r.corrupt_chunks, 1,
        "the receiver remembers the transfer took a bad chunk"
    );
    assert_eq!(
        p.b.revoke(TransferId(1)).corrupt_chunks,
        0,
        "until it is revoked"
    );
}

/// Four 1 MiB ops of `kind` from `p.a` into (or out of) `p.b`'s granted range, on an endpoint
/// opened before `fault` is done to the pair; how the batch settled.
fn four_ops(p: &Pair, kind: OpKind, fault: impl FnOnce(&Pair)) -> transport::engine::BatchStatus {
    let d = match kind {
        OpKind::Write => Direction::RemoteWrite,
        OpKind::Read => Direction::RemoteRead,
    };
    grant(&p.b, 1, 0, 4 * MIB, d);
    let ep = p.a.open(&peer(&p.b, 2)).unwrap();
    fault(p);
    // SAFETY: left alone until settled.
    let b = unsafe { p.a.submit(ep, &ops(kind, p.remote, 1, 4, MIB)).unwrap() };
    p.a.wait(b, Duration::from_secs(20)).unwrap()
}

#[test]
fn a_read_whose_reply_is_corrupted_fails_with_corrupt() {
    let p = pair(4 * MIB, |_| {});
    pattern(&p.mb, 9);
    let s = four_ops(&p, OpKind::Read, |p| p.b.inject_corrupt_chunk(1));
    assert_eq!((s.failed, s.done), (1, 3), "{s:?}");
    assert_eq!(s.first_failure, Some(OpFailure::Corrupt));
}

#[test]
fn accesses_outside_the_grant_are_refused_and_touch_nothing() {
    let p = pair(4 * MIB, |_| {});
    pattern(&p.ma, 4);
    grant(&p.b, 1, 0, MIB, Direction::RemoteWrite);
    grant(&p.b, 2, 2 * MIB, MIB, Direction::RemoteRead);
    let ep = p.a.open(&peer(&p.b, 2)).unwrap();
    let mk = |kind, t: u64, off: u64, len: u64, epoch: u64| Op {
        kind,
        local: SEG,
        local_offset: 0,
        remote: p.remote,
        remote_offset: off,
        len,
        transfer: TransferId(t),
        epoch,
    };
    let bad = [
        mk(OpKind::Write, 1, MIB - 4096, 8192, 1), // straddles the end of the grant
        mk(OpKind::Write, 1, 2 * MIB, 4096, 1),    // inside transfer 2's range
        mk(OpKind::Write, 2, 2 * MIB, 4096, 1),    // wrong direction
        mk(OpKind::Write, 1, 0, 4096, 2),          // wrong epoch
        mk(OpKind::Write, 3, 0, 4096, 1),          // never granted
    ];
    // SAFETY: left alone until settled.
    let b = unsafe { p.a.submit(ep, &bad).unwrap() };
    let s = p.a.wait(b, Duration::from_secs(10)).unwrap();
    let mut st = [OpStatus::Pending; 5];
    p.a.poll(b, &mut st).unwrap();
    assert_eq!(s.failed, 5, "{st:?}");
    assert!(
        st.iter()
            .all(|s| matches!(s, OpStatus::Failed(OpFailure::Refused(_))))
    );
    p.b.revoke(TransferId(1));
    p.b.revoke(TransferId(2));
    // SAFETY: nothing is granted any more.
    let landed = unsafe { p.mb.bytes() };
    assert!(landed.iter().all(|&x| x == 0), "no refused byte landed");
    assert_eq!(p.b.stats().refused, 5);
    // the endpoint still works after refusals (payloads were drained, the stream is in step)
    grant(&p.b, 4, 0, MIB, Direction::RemoteWrite);
    // SAFETY: left alone until settled.
    let b = unsafe {
        p.a.submit(ep, &ops(OpKind::Write, p.remote, 4, 1, MIB))
            .unwrap()
    };
    assert!(p.a.wait(b, Duration::from_secs(10)).unwrap().succeeded());
}

#[test]
fn a_grant_bound_to_a_peer_takes_writes_from_that_incarnation_only() {
    let p = pair(2 * MIB, |_| {});
    pattern(&p.ma, 9);
    // Transfer 1 is granted to node 1 in incarnation 1 only (as a daemon grants an offer's
    // pages to the node that offered it).
    let bound = Grant {
        transfer: TransferId(1),
        epoch: 1,
        segment: SEG,
        offset: 0,
        len: MIB,
        direction: Direction::RemoteWrite,
        expires_at_ms: p.b.now_ms() + 60_000,
        peer: Some(PeerNode {
            node: 1,
            generation: 1,
        }),
    };
    // SAFETY: the test reads the granted range only after every batch settled and revoke.
    unsafe { p.b.grant(bound).unwrap() };
    let write_from = |e: &TcpTransport, mem: &Arc<HeapMemory>| {
        e.register(SEG, mem.clone() as Arc<dyn Memory>, 0, 2 * MIB)
            .ok();
        let ep = e.open(&peer(&p.b, 2)).unwrap();
        // SAFETY: left alone until settled.
        let b = unsafe {
            e.submit(ep, &ops(OpKind::Write, p.remote, 1, 1, MIB))
                .unwrap()
        };
        let s = e.wait(b, Duration::from_secs(10)).unwrap();
        let mut st = [OpStatus::Pending; 1];
        e.poll(b, &mut st).unwrap();
        (s.succeeded(), st[0])
    };
    // the same node restarted (incarnation 2), and a third node: refused, nothing lands
    let restarted = {
        let mut c = testing::tcp_config(1, 2, secret(7), NODES);
        c.chunk_bytes = 256 << 10;
        TcpTransport::start(c).unwrap()
    };
    let other = Arc::new(HeapMemory::zeroed(2 * MIB as usize));
    pattern(&other, 3);
    let (ok, st) = write_from(&restarted, &other);
    assert!(
        !ok && matches!(st, OpStatus::Failed(OpFailure::Refused(_))),
        "{st:?}"
    );
    let stranger = engine(3, |_| {});
    let (ok, st) = write_from(&stranger, &other);
    assert!(
        !ok && matches!(st, OpStatus::Failed(OpFailure::Refused(_))),
        "{st:?}"
    );
    // SAFETY: nothing of transfer 1 is in flight (both batches settled refused).
    let landed = unsafe { p.mb.bytes() };
    assert!(landed[..MIB as usize].iter().all(|&x| x == 0));
    assert_eq!(p.b.stats().refused, 8, "four chunks of each refused write");
    // the incarnation it was granted to writes it
    let (ok, st) = write_from(&p.a, &p.ma);
    assert!(ok, "{st:?}");
    p.b.revoke(TransferId(1));
    // SAFETY: revoked: no peer touches the range any more.
    let (landed, sent) = unsafe { (p.mb.bytes(), p.ma.bytes()) };
    assert_eq!(landed[..MIB as usize], sent[..MIB as usize]);
}

#[test]
fn a_peer_without_the_secret_cannot_open_an_endpoint() {
    let b = engine(2, |_| {});
    let mut c = testing::tcp_config(1, 1, secret(8), NODES);
    c.connect_timeout = Duration::from_secs(2);
    let a = TcpTransport::start(c).unwrap();
    let e = a.open(&peer(&b, 2)).unwrap_err();
    assert!(e.to_string().contains("secret"), "{e}");
    // a raw connection that sends garbage gets nothing back but a close
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(b.local_addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut hello = [1u8; Hello::WIRE_BYTES];
    hello[0] = transport::auth::AUTH_VERSION;
    s.write_all(&hello).unwrap();
    let mut chal = [0u8; transport::auth::Challenge::WIRE_BYTES];
    s.read_exact(&mut chal).unwrap(); // a challenge, which proves nothing to us
    s.write_all(&[0u8; 32 + transport::link::wire::Bind::WIRE_BYTES])
        .unwrap(); // a wrong proof
    let mut rest = [0u8; 1];
    assert!(
        matches!(s.read(&mut rest), Ok(0) | Err(_)),
        "closed after a wrong proof"
    );
    std::thread::sleep(Duration::from_millis(100));
    assert!(b.stats().handshakes_refused >= 2);
}

#[test]
fn an_endpoint_to_the_wrong_node_id_is_refused() {
    let b = engine(2, |_| {});
    let a = engine(1, |_| {});
    let e = a.open(&peer(&b, 3)).unwrap_err();
    assert!(e.to_string().contains("not node 3"), "{e}");
}

#[test]
fn past_the_in_flight_bound_submit_fails_retryably_and_submits_nothing() {
    let p = pair(8 * MIB, |c| {
        c.limits.max_bytes_per_endpoint = 4 * MIB;
    });
    grant(&p.b, 1, 0, 8 * MIB, Direction::RemoteWrite);
    let ep = p.a.open(&peer(&p.b, 2)).unwrap();
    // SAFETY: left alone until settled.
    let e = unsafe { p.a.submit(ep, &ops(OpKind::Write, p.remote, 1, 5, MIB)) }.unwrap_err();
    assert!(e.is_retryable(), "{e}");
    assert_eq!(p.a.in_flight(), (0, 0));
    // SAFETY: as above.
    let b = unsafe {
        p.a.submit(ep, &ops(OpKind::Write, p.remote, 1, 4, MIB))
            .unwrap()
    };
    assert!(p.a.wait(b, Duration::from_secs(10)).unwrap().succeeded());
}

#[test]
fn cancel_drops_what_has_not_been_sent_and_the_batch_settles() {
    let p = pair(64 * MIB, |c| {
        c.connections = 1;
        c.window = 1;
        c.checksum = false;
    });
    grant(&p.b, 1, 0, 64 * MIB, Direction::RemoteWrite);
    let ep = p.a.open(&peer(&p.b, 2)).unwrap();
    // SAFETY: left alone until settled.
    let b = unsafe {
        p.a.submit(ep, &ops(OpKind::Write, p.remote, 1, 256, 256 << 10))
            .unwrap()
    };
    p.a.cancel(b).unwrap();
    let s = p.a.wait(b, Duration::from_secs(10)).unwrap();
    assert!(s.settled, "{s:?}");
    assert_eq!(s.done + s.cancelled, 256, "{s:?}");
    assert!(s.cancelled > 0, "{s:?}");
    p.a.release(b).unwrap();
    assert_eq!(p.a.in_flight(), (0, 0));
}

#[test]
fn a_descriptor_of_an_earlier_incarnation_is_refused_as_stale() {
    let p = pair(4 * MIB, |_| {});
    grant(&p.b, 1, 0, 4 * MIB, Direction::RemoteWrite);
    let ep = p.a.open(&peer(&p.b, 2)).unwrap();
    let old = SegmentDescriptor {
        node_generation: p.remote.node_generation - 1,
        ..p.remote
    };
    // SAFETY: left alone until settled.
    let b = unsafe { p.a.submit(ep, &ops(OpKind::Write, old, 1, 1, MIB)).unwrap() };
    let s = p.a.wait(b, Duration::from_secs(10)).unwrap();
    assert_eq!(
        s.first_failure,
        Some(OpFailure::Refused(
            transport::engine::target::REFUSED_STALE_GENERATION
        ))
    );
    assert_eq!(
        p.b.target().refusals()[7],
        4,
        "each of its four chunks counted as stale"
    );
}

#[test]
fn control_connections_reach_the_handler_authenticated_and_only_with_the_secret() {
    use std::io::Read;
    let b = engine(2, |_| {});
    let a = engine(1, |_| {});
    // without a handler a control connection is closed after the handshake
    let (s, bind) = a.open_control(&peer(&b, 2)).unwrap();
    assert_eq!(bind.node_id, 2);
    let mut byte = [0u8; 1];
    assert!(matches!(s.stream().read(&mut byte), Ok(0) | Err(_)));
    // with one, the handler gets the channel and who is on the other end
    b.set_control_handler(Arc::new(|mut s: transport::channel::Channel, who| {
        std::thread::spawn(move || {
            let got = s.recv(64).unwrap();
            s.send(format!("{}:{}", who.node_id, std::str::from_utf8(&got).unwrap()).as_bytes())
                .unwrap();
        });
    }));
    let (mut s, _) = a.open_control(&peer(&b, 2)).unwrap();
    s.send(b"hello").unwrap();
    assert_eq!(s.recv(64).unwrap(), b"1:hello");
    // a peer without the secret gets no control connection either
    let mut c = testing::tcp_config(3, 1, secret(9), NODES);
    c.connect_timeout = Duration::from_secs(2);
    let stranger = TcpTransport::start(c).unwrap();
    assert!(stranger.open_control(&peer(&b, 2)).is_err());
}

#[test]
fn a_known_checksum_travels_instead_of_a_computed_one_and_a_wrong_one_fails_its_op() {
    let p = pair(8 * MIB, |_| {});
    pattern(&p.ma, 6);
    grant(&p.b, 1, 0, 8 * MIB, Direction::RemoteWrite);
    let ep = p.a.open(&peer(&p.b, 2)).unwrap();
    let w = ops(OpKind::Write, p.remote, 1, 4, 256 << 10);
    // SAFETY: no transfer writes a's memory.
    let src = unsafe { p.ma.bytes() };
    let mut crcs: Vec<Option<u32>> = w
        .iter()
        .map(|o| {
            Some(transport::local::crc32c(
                0,
                &src[o.local_offset as usize..(o.local_offset + o.len) as usize],
            ))
        })
        .collect();
    crcs[2] = crcs[2].map(|c| c ^ 1); // what a block whose bytes changed since its seal looks like
    // SAFETY: left alone until settled.
    let b = unsafe { p.a.submit_with_checksums(ep, &w, &crcs).unwrap() };
    let s = p.a.wait(b, Duration::from_secs(10)).unwrap();
    let mut st = [OpStatus::Pending; 4];
    p.a.poll(b, &mut st).unwrap();
    assert_eq!(
        st,
        [
            OpStatus::Done,
            OpStatus::Done,
            OpStatus::Failed(OpFailure::Corrupt),
            OpStatus::Done
        ],
        "{s:?}"
    );
}

#[test]
fn a_known_checksum_of_a_granted_range_answers_a_read_of_it_and_a_wrong_one_fails_it() {
    let p = pair(4 * MIB, |_| {});
    pattern(&p.mb, 8);
    let chunk = 256 << 10;
    // one grant per block, as the daemon grants them
    grant(&p.b, 1, 0, chunk, Direction::RemoteRead);
    grant(&p.b, 1, chunk, chunk, Direction::RemoteRead);
    // SAFETY: no transfer writes b's memory.
    let src = unsafe { p.mb.bytes() };
    let right = transport::local::crc32c(0, &src[..chunk as usize]);
    let t = p.b.target();
    t.note_checksum(TransferId(1), SEG, 0, chunk, right);
    t.note_checksum(TransferId(1), SEG, chunk, chunk, 0xdead_beef); // a page changed since its seal
    t.note_checksum(TransferId(1), SEG, 2 * chunk, chunk, 0); // past one note per grant: ignored
    assert_eq!(t.known_checksum(TransferId(1), SEG, 0, chunk), Some(right));
    assert_eq!(t.known_checksum(TransferId(1), SEG, 2 * chunk, chunk), None);
    let ep = p.a.open(&peer(&p.b, 2)).unwrap();
    // SAFETY: left alone until settled.
    let b = unsafe {
        p.a.submit(ep, &ops(OpKind::Read, p.remote, 1, 2, chunk))
            .unwrap()
    };
    p.a.wait(b, Duration::from_secs(10)).unwrap();
    let mut st = [OpStatus::Pending; 2];
    p.a.poll(b, &mut st).unwrap();
    assert_eq!(st, [OpStatus::Done, OpStatus::Failed(OpFailure::Corrupt)]);
    p.b.revoke(TransferId(1));
    assert_eq!(
        t.known_checksum(TransferId(1), SEG, 0, chunk),
        None,
        "gone with the grants"
    );
}

/// A raw connection to `to` from the loopback address `source`, which says nothing.
fn silent_from(source: &str, to: std::net::SocketAddr) -> std::net::TcpStream {
    use rustix::net::{AddressFamily, SocketType, bind, connect, socket};
    let fd = socket(AddressFamily::INET, SocketType::STREAM, None).unwrap();
    let from: std::net::SocketAddr = format!("{source}:0").parse().unwrap();
    bind(&fd, &from).unwrap();
    connect(&fd, &to).unwrap();
    std::net::TcpStream::from(fd)
}

#[test]
fn a_handshake_refused_at_a_bound_is_a_retryable_overload_naming_it_not_a_wrong_secret() {
    let b = engine(2, |c| {
        c.max_handshakes_per_source = 2;
        c.connect_timeout = Duration::from_millis(800);
    });
    let a = engine(1, |_| {});
    // Two silent connections from 127.0.0.1 hold its share of the handshakes.
    let silent: Vec<_> = (0..2)
        .map(|_| silent_from("127.0.0.1", b.local_addr()))
        .collect();
    std::thread::sleep(Duration::from_millis(50));
    match a.open(&peer(&b, 2)) {
        Err(transport::error::Error::Overloaded {
            what,
            retry_after_ms,
        }) => {
            assert!(what.contains("from 127.0.0.1"), "{what}");
            assert!(!what.contains("secret"), "{what}");
            assert!(retry_after_ms > 0);
        }
        other => panic!("expected a framed refusal, got {other:?}"),
    }
    // The silent ones are cut at the one handshake deadline; then the peer gets in.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let ep = loop {
        match a.open(&peer(&b, 2)) {
            Ok(ep) => break ep,
            Err(e) if std::time::Instant::now() < deadline => {
                assert!(
                    matches!(e, transport::error::Error::Overloaded { .. }),
                    "{e}"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => panic!("never admitted after the silent connections' deadline: {e}"),
        }
    };
    drop((ep, silent));
}

#[test]
fn a_hello_trickled_a_byte_at_a_time_is_cut_at_the_handshake_deadline() {
    use std::io::{ErrorKind, Read, Write};
    let b = engine(2, |c| c.connect_timeout = Duration::from_millis(600));
    let mut s = std::net::TcpStream::connect(b.local_addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(150)))
        .unwrap();
    let start = std::time::Instant::now();
    let mut closed = false;
    // 33 bytes at one per 150 ms would take 5 s; the deadline is 0.6 s from the accept.
    for _ in 0..Hello::WIRE_BYTES {
        let _ = s.write_all(&[1]);
        let mut buf = [0u8; 64];
        match s.read(&mut buf) {
            Ok(0) => closed = true,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => closed = true,
            Ok(_) => panic!("a trickled hello got an answer"),
        }
        if closed {
            break;
        }
    }
    assert!(closed, "the trickling connection was never closed");
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "closed after {:?}",
        start.elapsed()
    );
}

#[test]
fn with_payload_macs_batches_arrive_byte_exact_both_ways() {
    // one end asking for them turns them on for the connection, both ways
    let p = pair(8 * MIB, |_| {});
    let mac = engine(3, |c| c.payload_mac = true);
    let ma = Arc::new(HeapMemory::zeroed(8 * MIB as usize));
    mac.register(SEG, ma.clone() as Arc<dyn Memory>, 0, 8 * MIB)
        .unwrap();
    pattern(&ma, 4);
    pattern(&p.mb, 5);
    grant(&p.b, 1, 0, 4 * MIB, Direction::RemoteWrite);
    grant(&p.b, 2, 4 * MIB, 4 * MIB, Direction::RemoteRead);
    let ep = mac.open(&peer(&p.b, 2)).unwrap();
    let w = ops(OpKind::Write, p.remote, 1, 4, MIB);
    let r: Vec<Op> = ops(OpKind::Read, p.remote, 2, 4, MIB)
        .into_iter()
        .map(|mut o| {
            o.local_offset += 4 * MIB;
            o.remote_offset += 4 * MIB;
            o
        })
        .collect();
    for batch in [w, r] {
        // SAFETY: the ranges are left alone until the batch settles.
        let b = unsafe { mac.submit(ep, &batch).unwrap() };
        let s = mac.wait(b, Duration::from_secs(20)).unwrap();
        assert!(s.succeeded(), "{s:?}");
    }
    p.b.revoke(TransferId(1));
    p.b.revoke(TransferId(2));
    // SAFETY: settled and revoked.
    let (a, b) = unsafe { (ma.bytes(), p.mb.bytes()) };
    assert!(a == b, "writes and reads landed byte-exact");
    assert_eq!(
        (
            mac.stats().integrity_failures,
            p.b.stats().integrity_failures
        ),
        (0, 0)
    );
}

/// A write of 4 MiB to `p.b` whose first payload is rewritten on arrival as an on-path
/// attacker would (its CRC-32C kept): how the batch settled, and whether the bytes that landed
/// are the ones sent.
fn rewritten_write(payload_mac: bool) -> (transport::engine::BatchStatus, bool) {
    let p = pair(4 * MIB, |c| c.payload_mac = payload_mac);
    pattern(&p.ma, 6);
    let s = four_ops(&p, OpKind::Write, |p| p.b.inject_rewritten_payload(1));
    p.b.revoke(TransferId(1));
    // SAFETY: settled and revoked.
    let same = unsafe { p.ma.bytes() == p.mb.bytes() };
    (s, same)
}

#[test]
fn a_payload_rewritten_in_flight_with_its_crc_kept_passes_the_crc_and_fails_the_mac() {
    // without the MAC, the CRC-32C cannot tell: the write is accepted, the bytes differ
    let (s, same) = rewritten_write(false);
    assert!(s.succeeded(), "{s:?}");
    assert!(!same, "the rewritten bytes landed unseen");
    // with it, the rewritten chunk fails its op
    let (s, _) = rewritten_write(true);
    assert_eq!((s.failed, s.done), (1, 3), "{s:?}");
    assert_eq!(s.first_failure, Some(OpFailure::Corrupt));
    // and a read's reply rewritten on its way back likewise
    let p = pair(4 * MIB, |c| c.payload_mac = true);
    pattern(&p.mb, 7);
    let s = four_ops(&p, OpKind::Read, |p| p.a.inject_rewritten_payload(2));
    assert_eq!((s.failed, s.done), (1, 3), "{s:?}");
    assert_eq!(s.first_failure, Some(OpFailure::Corrupt));
    assert_eq!(p.a.stats().integrity_failures, 1);
}

#[test]
fn a_node_whose_key_is_removed_is_cut_off_and_cannot_come_back() {
    let p = pair(4 * MIB, |_| {});
    pattern(&p.ma, 8);
    let (_control, _) = p.a.open_control(&peer(&p.b, 2)).unwrap();
    // node 1's key leaves node 2's members (revoked), with an endpoint open: its
    // connections there are closed
    let s = four_ops(&p, OpKind::Write, |p| {
        let gone = p.b.members().replace(&testing::member_table(&[2, 3]));
        assert_eq!(gone.unwrap(), vec![1, 4, 5]);
        p.b.evict(1);
    });
    assert!(!s.succeeded(), "{s:?}");
    let e = p.a.open(&peer(&p.b, 2)).unwrap_err();
    assert!(e.to_string().contains("has no key for node 1"), "{e}");
    // another member goes on
    let c = engine(3, |_| {});
    assert!(c.open(&peer(&p.b, 2)).is_ok());
}

#[test]
fn strangers_from_many_addresses_cannot_take_the_handshakes_kept_for_members() {
    use transport::link::members::{Member, Members};
    let member = |n: u64, ip: &str| {
        (
            n,
            Member {
                key: testing::public_key(n),
                addr: Some(ip.parse().unwrap()),
            },
        )
    };
    let b = engine(2, |c| {
        c.max_handshakes = 8;
        c.member_handshakes = 4;
        c.max_handshakes_per_source = 2;
        c.connect_timeout = Duration::from_secs(5);
        c.members = Members::of([member(1, "127.0.0.1"), member(2, "127.0.0.2")]);
    });
    // 40 silent connections from 20 other addresses: four get a slot, the rest are refused
    let silent: Vec<_> = (0..40)
        .map(|i| silent_from(&format!("127.0.4.{}", 1 + i % 20), b.local_addr()))
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(b.stats().handshakes_refused, 36, "{:?}", b.stats());
    // a member from its own address gets in at once, whatever the strangers hold
    let a = engine(1, |_| {});
    let ep = a.open(&peer(&b, 2)).unwrap();
    // a stranger's handshake is refused naming the share it met
    use std::io::Read;
    let mut s = silent_from("127.0.5.1", b.local_addr());
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut frame = [0u8; transport::auth::Challenge::WIRE_BYTES];
    s.read_exact(&mut frame).unwrap();
    let text = String::from_utf8_lossy(&frame[24..]);
    assert!(text.contains("non-members"), "{text}");
    drop((ep, silent));
}
