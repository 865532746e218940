//! The backend registry between two nodes in one process, on loopback: a peer's batches go over
//! the backend both ends have (TCP in every build and host this runs on without an RDMA
//! device), its endpoint is opened once and reused, the report says what each peer used and
//! why, and a peer that is not who it should be gets a clear error and no byte.

use std::sync::Arc;
use std::time::Duration;

use transport::auth::ClusterSecret;
use transport::engine::{HeapMemory, Memory, Op, OpKind};
use transport::grant::{Direction, Grant, SegmentId, TransferId};
use transport::link::PeerAddr;
use transport::registry::{Backend, Backends, RdmaSettings, TransportChoice};
use transport::segment::SegmentDescriptor;
use transport::tcp::TcpTransport;

const SEG: SegmentId = SegmentId(1);
const LEN: u64 = 8 << 20;
const BLOCK: u64 = 256 << 10;

fn node(
    id: u64,
    choice: TransportChoice,
) -> (Backends, Arc<HeapMemory>, SegmentDescriptor, PeerAddr) {
    let secret = ClusterSecret::from_bytes(&[7; 32]).unwrap();
    let mut c = transport::link::testing::tcp_config(id, 1, secret, &[1, 2, 3, 4, 9]);
    c.stall_timeout = Duration::from_secs(2);
    let tcp = TcpTransport::start(c).unwrap();
    let addr = tcp.local_addr();
    let b = Backends::start(tcp, choice, &RdmaSettings::default(), 4 << 20).unwrap();
    let mem = Arc::new(HeapMemory::zeroed(LEN as usize));
    let d = b
        .register(SEG, mem.clone() as Arc<dyn Memory>, LEN)
        .unwrap();
    (b, mem, d, PeerAddr { addr, node_id: id })
}

fn writes(remote: SegmentDescriptor, n: u64) -> Vec<Op> {
    (0..n)
        .map(|i| Op {
            kind: OpKind::Write,
            local: SEG,
            local_offset: i * BLOCK,
            remote,
            remote_offset: i * BLOCK,
            len: BLOCK,
            transfer: TransferId(5),
            epoch: 1,
        })
        .collect()
}

fn grant_all(b: &Backends) {
    let g = Grant {
        transfer: TransferId(5),
        epoch: 1,
        segment: SEG,
        offset: 0,
        len: LEN,
        direction: Direction::RemoteWrite,
        expires_at_ms: b.now_ms() + 60_000,
        peer: None,
    };
    // SAFETY: the test reads the destination only after the batches settled.
    unsafe { b.grant(g).unwrap() };
}

#[test]
fn a_peers_batches_go_over_the_backend_both_ends_have_and_the_report_says_which_and_why() {
    // RDMA where usable: no device on this host (or no rdma feature), so TCP, and the reason
    let auto = TransportChoice::Auto;
    let (a, ma, _, _) = node(1, auto);
    let (b, mb, remote, to_b) = node(2, TransportChoice::Tcp);
    // SAFETY: nothing else touches the source yet.
    for (i, x) in unsafe { ma.bytes_mut() }.iter_mut().enumerate() {
        *x = (i as u8).wrapping_mul(13) ^ (i >> 10) as u8;
    }
    grant_all(&b);
    for round in 0..2 {
        let ops = writes(remote, 16);
        // SAFETY: the source stays untouched until run_batch returns (it returns settled).
        let crcs = unsafe { a.run_batch(to_b, &ops, &[], Duration::from_secs(10)) }.unwrap();
        assert_eq!(crcs.len(), 16, "round {round}");
    }
    let sent = (16 * BLOCK) as usize;
    // SAFETY: the batches settled; nothing writes either memory now.
    let same = unsafe { ma.bytes()[..sent] == mb.bytes()[..sent] };
    assert!(same, "the bytes arrived exactly");
    let r = a.report();
    assert_eq!(
        (r.requested.as_str(), r.preferred.as_str()),
        ("auto", "tcp"),
        "{r:?}"
    );
    assert!(r.reason.contains("RDMA"), "says why not RDMA: {r:?}");
    assert_eq!(r.peers.get(&2), Some(&Backend::Tcp), "{r:?}");
    assert_eq!(b.report().requested, "tcp");
    let st = a.tcp().expect("the TCP engine").stats();
    assert_eq!((st.chunks_done, st.connections_failed), (32, 0), "{st:?}");
}

#[test]
fn a_peer_that_is_not_the_node_named_gets_a_clear_error_and_no_byte() {
    let (a, ma, _, _) = node(1, TransportChoice::Tcp);
    let (b, mb, remote, to_b) = node(2, TransportChoice::Tcp);
    // SAFETY: nothing else touches the source yet.
    unsafe { ma.bytes_mut() }.fill(0xab);
    grant_all(&b);
    let wrong = PeerAddr { node_id: 9, ..to_b };
    // SAFETY: as above.
    let e = unsafe { a.run_batch(wrong, &writes(remote, 4), &[], Duration::from_secs(10)) }
        .unwrap_err();
    assert!(e.to_string().contains("not node 9"), "{e}");
    // SAFETY: the batch was refused before any byte moved; nothing writes the memory now.
    let untouched = unsafe { mb.bytes() }.iter().all(|&x| x == 0);
    assert!(untouched, "no byte moved");
    assert!(a.report().peers.is_empty(), "{:?}", a.report());
}
