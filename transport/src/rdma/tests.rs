//! The RDMA engine above the hardware: two nodes, each a real TCP engine (side channel,
//! authentication, the shared grant table) and an RDMA engine on the fabric double.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::fabric_double::{Fabric, VerbsDouble};
use super::*;
use crate::auth::ClusterSecret;
use crate::engine::HeapMemory;
use crate::grant::Direction;
use crate::link::wire::Purpose;
use crate::tcp::TcpTransport;

const SEG: SegmentId = SegmentId(1);
const MIB: u64 = 1 << 20;

struct Node {
    tcp: TcpTransport,
    rdma: Arc<RdmaTransport<VerbsDouble>>,
    mem: Arc<HeapMemory>,
    desc: SegmentDescriptor,
}

fn node(fabric: &Arc<Fabric>, id: u64, len: u64, tune: impl Fn(&mut RdmaConfig)) -> Node {
    let secret = ClusterSecret::from_bytes(&[5; 32]).unwrap();
    let tcp =
        TcpTransport::start(crate::link::testing::tcp_config(id, 1, secret, &[1, 2, 3])).unwrap();
    let mut c = RdmaConfig {
        chunk_bytes: 256 << 10,
        stall_timeout: Duration::from_millis(300),
        ..RdmaConfig::default()
    };
    tune(&mut c);
    let rdma = Arc::new(
        RdmaTransport::start(
            fabric.nic(id as u32),
            c,
            tcp.target_arc(),
            tcp.opener(Purpose::Rdma),
        )
        .unwrap(),
    );
    let weak = Arc::downgrade(&rdma);
    tcp.set_rdma_handler(Arc::new(move |s, b| {
        if let Some(r) = weak.upgrade() {
            r.serve_side(s, b);
        }
    }));
    let mem = Arc::new(HeapMemory::zeroed(len as usize));
    // the TCP engine registers the segment, as the daemon does; the RDMA engine adds its
    // local regions to the same one
    tcp.register(SEG, mem.clone() as Arc<dyn Memory>, 0, len)
        .unwrap();
    let desc = rdma
        .register(SEG, mem.clone() as Arc<dyn Memory>, 0, len)
        .unwrap()
        .descriptor();
    Node {
        tcp,
        rdma,
        mem,
        desc,
    }
}

fn peer(n: &Node, id: u64) -> PeerAddr {
    PeerAddr {
        addr: n.tcp.local_addr(),
        node_id: id,
    }
}

fn fill(mem: &HeapMemory, seed: u8) {
    // SAFETY: nothing moves this memory while the test writes it.
    for (i, b) in unsafe { mem.bytes_mut() }.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(13).wrapping_add(seed) ^ (i >> 11) as u8;
    }
}

fn bytes(mem: &HeapMemory) -> Vec<u8> {
    // SAFETY: read after the batches settled.
    unsafe { mem.bytes_mut() }.to_vec()
}

fn grant(n: &Node, t: u64, epoch: u64, off: u64, len: u64, d: Direction, ttl_ms: u64) {
    let g = Grant {
        transfer: TransferId(t),
        epoch,
        segment: SEG,
        offset: off,
        len,
        direction: d,
        expires_at_ms: n.rdma.now_ms() + ttl_ms,
        peer: None,
    };
    // SAFETY: the tests look at granted ranges only after batches settled.
    unsafe { n.tcp.grant(g).unwrap() };
}

fn op(kind: OpKind, remote: SegmentDescriptor, off: u64, len: u64, t: u64) -> Op {
    Op {
        kind,
        local: SEG,
        local_offset: off,
        remote,
        remote_offset: off,
        len,
        transfer: TransferId(t),
        epoch: 1,
    }
}

/// 1 MiB writes of transfer `t` into `b`'s segment, op `i` at offset `i` MiB on both sides.
fn writes(b: &Node, range: std::ops::Range<u64>, t: u64) -> Vec<Op> {
    range
        .map(|i| op(OpKind::Write, b.desc, i * MIB, MIB, t))
        .collect()
}

fn run(n: &Node, ep: EndpointId, ops: &[Op]) -> (BatchStatus, Vec<OpStatus>) {
    // SAFETY: the tests do not touch the ranges until the batch settles.
    let b = unsafe { n.rdma.submit(ep, ops) }.unwrap();
    let st = n.rdma.wait(b, Duration::from_secs(10)).unwrap();
    assert!(st.settled, "the batch settles: {st:?}");
    let mut out = vec![OpStatus::Pending; ops.len()];
    n.rdma.poll(b, &mut out).unwrap();
    n.rdma.release(b).unwrap();
    (st, out)
}

fn pair(len: u64, tune: impl Fn(&mut RdmaConfig) + Copy) -> (Arc<Fabric>, Node, Node, EndpointId) {
    let f = Fabric::new();
    let a = node(&f, 1, len, tune);
    let b = node(&f, 2, len, tune);
    let ep = a.rdma.open(&peer(&b, 2)).unwrap();
    (f, a, b, ep)
}

#[test]
fn writes_and_reads_are_byte_exact_and_go_in_doorbell_batches_within_the_send_queue() {
    // a send queue of 8 for 64 work requests: what does not fit waits for completions
    let (f, a, b, ep) = pair(32 * MIB, |c| c.send_depth = 8);
    fill(&a.mem, 1);
    grant(&b, 1, 1, 0, 16 * MIB, Direction::RemoteWrite, 60_000);
    let ops = writes(&b, 0..16, 1);
    let (st, _) = run(&a, ep, &ops);
    assert!(st.succeeded(), "{st:?}");
    assert_eq!(st.bytes_done, 16 * MIB);
    assert_eq!(
        bytes(&a.mem)[..16 * MIB as usize],
        bytes(&b.mem)[..16 * MIB as usize]
    );
    // reads back into the other half
    fill(&b.mem, 9);
    grant(&b, 2, 1, 0, 16 * MIB, Direction::RemoteRead, 60_000);
    let reads: Vec<Op> = (0..16)
        .map(|i| Op {
            local_offset: 16 * MIB + i * MIB,
            ..op(OpKind::Read, b.desc, i * MIB, MIB, 2)
        })
        .collect();
    let (st, _) = run(&a, ep, &reads);
    assert!(st.succeeded(), "{st:?}");
    assert_eq!(
        bytes(&a.mem)[16 * MIB as usize..],
        bytes(&b.mem)[..16 * MIB as usize]
    );
    let s = a.rdma.stats();
    assert_eq!(s.work_requests, 128, "1 MiB ops in 256 KiB work requests");
    assert!(
        s.doorbells < s.work_requests,
        "doorbells carry several: {s:?}"
    );
    assert_eq!(s.completions_ok, 128);
    assert_eq!((s.endpoints_failed, s.rebuilds), (0, 0));
    let (executed, doorbells) = f.counts();
    assert_eq!(executed, 128);
    assert_eq!(doorbells, s.doorbells);
    assert_eq!(a.rdma.in_flight(), (0, 0));
}

#[test]
fn keys_go_only_to_granted_ranges_and_die_with_the_grant() {
    let (f, a, b, ep) = pair(8 * MIB, |_| {});
    fill(&a.mem, 3);
    grant(&b, 7, 1, 0, 2 * MIB, Direction::RemoteWrite, 60_000);
    let ops = [
        // inside the grant
        op(OpKind::Write, b.desc, 0, MIB, 7),
        // past its end
        op(OpKind::Write, b.desc, 2 * MIB, MIB, 7),
        // the right range, the wrong direction
        op(OpKind::Read, b.desc, MIB, MIB, 7),
        // another epoch of the same transfer
        Op {
            epoch: 2,
            ..op(OpKind::Write, b.desc, MIB, MIB, 7)
        },
        // an older incarnation of the target
        Op {
            remote: SegmentDescriptor {
                node_generation: 0,
                ..b.desc
            },
            ..op(OpKind::Write, b.desc, MIB, MIB, 7)
        },
    ];
    let (st, out) = run(&a, ep, &ops);
    assert_eq!((st.done, st.failed), (1, 4), "{out:?}");
    assert_eq!(out[0], OpStatus::Done);
    for (i, o) in out.iter().enumerate().skip(1) {
        assert!(
            matches!(o, OpStatus::Failed(OpFailure::Refused(_))),
            "op {i}: {o:?}"
        );
    }
    assert_eq!(
        out[4],
        OpStatus::Failed(OpFailure::Refused(
            crate::engine::target::REFUSED_STALE_GENERATION
        ))
    );
    // nothing outside the granted op's range was written
    assert!(bytes(&b.mem)[MIB as usize..].iter().all(|&x| x == 0));
    assert_eq!(f.remote_regions(2), 1, "exactly one range was given a key");
    assert_eq!(b.rdma.stats().keys_refused, 4);
    // the grant ends: the key dies with it, and asking again is refused
    let r = b.rdma.revoke(TransferId(7));
    assert_eq!(r.grants, 1);
    assert_eq!(f.remote_regions(2), 0);
    let (_, out) = run(&a, ep, &[op(OpKind::Write, b.desc, 0, MIB, 7)]);
    assert!(
        matches!(out[0], OpStatus::Failed(OpFailure::Refused(_))),
        "{out:?}"
    );
}

#[test]
fn a_key_revoked_while_its_work_is_on_the_wire_fails_the_op_and_the_endpoint_is_rebuilt() {
    let (f, a, b, ep) = pair(8 * MIB, |_| {});
    fill(&a.mem, 4);
    grant(&b, 1, 1, 0, 4 * MIB, Direction::RemoteWrite, 60_000);
    // the link is cut: the work requests are posted but do not run
    f.cut(1, true);
    let ops = writes(&b, 0..4, 1);
    // SAFETY: untouched until settled.
    let batch = unsafe { a.rdma.submit(ep, &ops) }.unwrap();
    assert_eq!(f.remote_regions(2), 4);
    b.rdma.revoke(TransferId(1));
    assert_eq!(
        f.remote_regions(2),
        0,
        "revoke deregistered the ranges before returning"
    );
    f.cut(1, false);
    let st = a.rdma.wait(batch, Duration::from_secs(5)).unwrap();
    assert!(st.settled && st.failed == 4, "{st:?}");
    assert_eq!(st.first_failure, Some(OpFailure::Refused(REFUSED_REVOKED)));
    a.rdma.release(batch).unwrap();
    assert!(
        bytes(&b.mem).iter().all(|&x| x == 0),
        "no byte landed after the revoke"
    );
    // the next batch rebuilds the queue pair and goes through
    grant(&b, 2, 1, 0, 4 * MIB, Direction::RemoteWrite, 60_000);
    let ops = writes(&b, 0..4, 2);
    let (st, _) = run(&a, ep, &ops);
    assert!(st.succeeded(), "{st:?}");
    assert_eq!(a.rdma.stats().rebuilds, 1);
    assert_eq!(
        bytes(&a.mem)[..4 * MIB as usize],
        bytes(&b.mem)[..4 * MIB as usize]
    );
}

#[test]
fn a_cut_link_fails_the_batch_within_the_stall_timeout_and_nothing_is_left_posted() {
    let (f, a, b, ep) = pair(8 * MIB, |_| {});
    grant(&b, 1, 1, 0, 8 * MIB, Direction::RemoteWrite, 60_000);
    f.cut(2, true);
    let ops = writes(&b, 0..8, 1);
    let t = Instant::now();
    // SAFETY: untouched until settled.
    let batch = unsafe { a.rdma.submit(ep, &ops) }.unwrap();
    let st = a.rdma.wait(batch, Duration::from_secs(5)).unwrap();
    let took = t.elapsed();
    assert!(st.settled && st.failed == 8, "{st:?}");
    assert_eq!(st.first_failure, Some(OpFailure::Timeout));
    assert!(
        took >= Duration::from_millis(300),
        "not before the stall timeout: {took:?}"
    );
    assert_eq!(a.rdma.in_flight(), (0, 0));
    a.rdma.release(batch).unwrap();
    // submitting while it cannot be rebuilt fails cleanly; once mended it works again
    f.cut(2, false);
    let (st, _) = run(&a, ep, &ops);
    assert!(st.succeeded(), "{st:?}");
    assert_eq!(a.rdma.stats().endpoints_failed, 1);
}

#[test]
fn a_target_nic_reset_fails_what_was_in_flight_and_a_new_queue_pair_serves_the_retry() {
    let (f, a, b, ep) = pair(4 * MIB, |_| {});
    fill(&a.mem, 6);
    grant(&b, 1, 1, 0, 4 * MIB, Direction::RemoteWrite, 60_000);
    f.cut(1, true);
    let ops = writes(&b, 0..4, 1);
    // SAFETY: untouched until settled.
    let batch = unsafe { a.rdma.submit(ep, &ops) }.unwrap();
    f.break_qps(2);
    f.cut(1, false);
    let st = a.rdma.wait(batch, Duration::from_secs(5)).unwrap();
    assert!(st.settled && st.failed == 4, "{st:?}");
    assert_eq!(
        st.first_failure,
        Some(OpFailure::Timeout),
        "no acknowledgement: retry exceeded"
    );
    a.rdma.release(batch).unwrap();
    let (st, _) = run(&a, ep, &ops);
    assert!(st.succeeded(), "{st:?}");
    assert_eq!(bytes(&a.mem), bytes(&b.mem));
}

#[test]
fn an_op_across_local_registration_chunks_is_cut_at_their_edge() {
    // local regions of 1 MiB: a 1.5 MiB op from offset 0.75 MiB spans three of them
    let (f, a, b, ep) = pair(4 * MIB, |c| {
        c.mr_chunk_bytes = MIB;
        c.chunk_bytes = 4 << 20;
    });
    fill(&a.mem, 8);
    grant(&b, 1, 1, 0, 4 * MIB, Direction::RemoteWrite, 60_000);
    let (off, len) = (3 * MIB / 4, 3 * MIB / 2);
    let (st, _) = run(&a, ep, &[op(OpKind::Write, b.desc, off, len, 1)]);
    assert!(st.succeeded(), "{st:?}");
    assert_eq!(a.rdma.stats().work_requests, 3);
    let (x, y) = (bytes(&a.mem), bytes(&b.mem));
    assert_eq!(
        x[off as usize..(off + len) as usize],
        y[off as usize..(off + len) as usize]
    );
    assert!(y[..off as usize].iter().all(|&v| v == 0));
    drop(f);
}

#[test]
fn expired_grants_lose_their_keys_without_a_revoke() {
    let (f, a, b, ep) = pair(2 * MIB, |_| {});
    grant(&b, 1, 1, 0, MIB, Direction::RemoteWrite, 150);
    let (st, _) = run(&a, ep, &[op(OpKind::Write, b.desc, 0, MIB, 1)]);
    assert!(st.succeeded());
    assert_eq!(f.remote_regions(2), 1);
    let t = Instant::now();
    while f.remote_regions(2) > 0 && t.elapsed() < Duration::from_secs(3) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        f.remote_regions(2),
        0,
        "the expired grant's region was deregistered"
    );
}

#[test]
fn cancel_drops_waiting_work_and_the_batch_still_settles() {
    let (f, a, b, ep) = pair(8 * MIB, |c| c.send_depth = 2);
    grant(&b, 1, 1, 0, 8 * MIB, Direction::RemoteWrite, 60_000);
    f.cut(1, true);
    let ops = writes(&b, 0..8, 1);
    // SAFETY: untouched until settled.
    let batch = unsafe { a.rdma.submit(ep, &ops) }.unwrap();
    a.rdma.cancel(batch).unwrap();
    f.cut(1, false);
    let st = a.rdma.wait(batch, Duration::from_secs(5)).unwrap();
    assert!(st.settled, "{st:?}");
    assert!(
        st.cancelled >= 7,
        "all but the op on the wire were cancelled: {st:?}"
    );
    a.rdma.release(batch).unwrap();
    assert_eq!(a.rdma.in_flight(), (0, 0));
}

#[test]
fn bounds_give_retryable_errors_and_bad_ops_change_nothing() {
    let (f, a, b, ep) = pair(4 * MIB, |c| c.limits.max_ops_per_endpoint = 2);
    grant(&b, 1, 1, 0, 4 * MIB, Direction::RemoteWrite, 60_000);
    let ops = writes(&b, 0..3, 1);
    // SAFETY: nothing is submitted.
    let e = unsafe { a.rdma.submit(ep, &ops) }.unwrap_err();
    assert!(matches!(e, Error::Overloaded { .. }), "{e}");
    let bad = [
        Op {
            remote_offset: 4 * MIB,
            ..op(OpKind::Write, b.desc, 0, MIB, 1)
        },
        Op {
            local_offset: 4 * MIB,
            ..op(OpKind::Write, b.desc, 0, MIB, 1)
        },
        Op {
            remote: SegmentDescriptor {
                node_id: 9,
                ..b.desc
            },
            ..op(OpKind::Write, b.desc, 0, MIB, 1)
        },
        Op {
            len: 0,
            ..op(OpKind::Write, b.desc, 0, MIB, 1)
        },
    ];
    for o in bad {
        // SAFETY: refused before anything is posted.
        assert!(unsafe { a.rdma.submit(ep, &[o]) }.is_err(), "{o:?}");
    }
    assert_eq!(f.counts(), (0, 0), "nothing was posted");
    assert_eq!(f.remote_regions(2), 0, "and no key was asked for");
    // the target refuses to register: the op is refused with a retryable code
    f.refuse_registrations(2, true);
    let (_, out) = run(&a, ep, &[op(OpKind::Write, b.desc, 0, MIB, 1)]);
    assert_eq!(
        out[0],
        OpStatus::Failed(OpFailure::Refused(REFUSED_NO_KEYS))
    );
    f.refuse_registrations(2, false);
    let (st, _) = run(&a, ep, &[op(OpKind::Write, b.desc, 0, MIB, 1)]);
    assert!(st.succeeded());
}

#[test]
fn a_peer_without_rdma_is_told_apart_so_the_caller_can_use_tcp() {
    let f = Fabric::new();
    let a = node(&f, 1, MIB, |_| {});
    // a node whose TCP engine has no RDMA handler (built without it, or no device)
    let secret = ClusterSecret::from_bytes(&[5; 32]).unwrap();
    let plain =
        TcpTransport::start(crate::link::testing::tcp_config(3, 1, secret, &[1, 2, 3])).unwrap();
    let e = a
        .rdma
        .open(&PeerAddr {
            addr: plain.local_addr(),
            node_id: 3,
        })
        .unwrap_err();
    assert!(peer_lacks_rdma(&e), "{e}");
    // a peer that is simply not there is a failure, not a reason to use TCP quietly
    let gone = a
        .rdma
        .open(&PeerAddr {
            addr: "127.0.0.1:1".parse().unwrap(),
            node_id: 3,
        })
        .unwrap_err();
    assert!(!peer_lacks_rdma(&gone), "{gone}");
    assert!(
        f.qp_states(1).is_empty(),
        "the half-made queue pair was destroyed"
    );
}

#[test]
fn closing_an_endpoint_fails_its_work_and_destroys_its_queue_pair() {
    let (f, a, b, ep) = pair(4 * MIB, |_| {});
    grant(&b, 1, 1, 0, 4 * MIB, Direction::RemoteWrite, 60_000);
    f.cut(1, true);
    let ops = writes(&b, 0..4, 1);
    // SAFETY: untouched until settled.
    let batch = unsafe { a.rdma.submit(ep, &ops) }.unwrap();
    a.rdma.close(ep);
    let st = a.rdma.wait(batch, Duration::from_secs(5)).unwrap();
    assert!(st.settled && st.failed == 4, "{st:?}");
    assert_eq!(st.first_failure, Some(OpFailure::Closed));
    // SAFETY: refused.
    assert!(unsafe { a.rdma.submit(ep, &ops) }.is_err());
    let t = Instant::now();
    while !f.qp_states(1).is_empty() && t.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(f.qp_states(1).is_empty(), "{:?}", f.qp_states(1));
}

#[test]
fn gpu_pages_go_to_a_remote_pool_and_back_without_a_host_bounce() {
    use std::os::fd::AsFd;
    let (f, a, b, ep) = pair(8 * MIB, |c| c.mr_chunk_bytes = 2 * MIB);
    // "device memory": in the double, any memory at the registered address
    let gpu = HeapMemory::zeroed(4 * MIB as usize);
    fill(&gpu, 11);
    let dptr = gpu.as_ptr() as u64;
    let devnull = std::fs::File::open("/dev/null").unwrap();
    // SAFETY: gpu outlives the segment and every batch naming it.
    let reg = unsafe {
        a.rdma.register_device(
            SegmentId(9),
            dptr,
            4 * MIB,
            DeviceMemory::DmaBuf {
                fd: devnull.as_fd(),
                offset: 0,
            },
        )
    }
    .unwrap();
    assert_eq!(f.dmabuf_registrations(), 2, "4 MiB in 2 MiB registrations");
    grant(&b, 1, 1, 0, 4 * MIB, Direction::RemoteWrite, 60_000);
    let ops: Vec<Op> = (0..4)
        .map(|i| Op {
            local: SegmentId(9),
            ..op(OpKind::Write, b.desc, i * MIB, MIB, 1)
        })
        .collect();
    let (st, _) = run(&a, ep, &ops);
    assert!(st.succeeded(), "{st:?}");
    assert_eq!(bytes(&gpu), bytes(&b.mem)[..4 * MIB as usize]);
    // and back from the pool into a second device range, registered the peermem way
    let gpu2 = HeapMemory::zeroed(4 * MIB as usize);
    // SAFETY: as above.
    unsafe {
        a.rdma.register_device(
            SegmentId(10),
            gpu2.as_ptr() as u64,
            4 * MIB,
            DeviceMemory::PeerMem,
        )
    }
    .unwrap();
    grant(&b, 2, 1, 0, 4 * MIB, Direction::RemoteRead, 60_000);
    let ops: Vec<Op> = (0..4)
        .map(|i| Op {
            local: SegmentId(10),
            ..op(OpKind::Read, b.desc, i * MIB, MIB, 2)
        })
        .collect();
    let (st, _) = run(&a, ep, &ops);
    assert!(st.succeeded(), "{st:?}");
    assert_eq!(bytes(&gpu2), bytes(&gpu));
    // a device segment's range is checked like any other, and ids are not reused
    let past = Op {
        local: SegmentId(9),
        local_offset: 3 * MIB + 1,
        ..op(OpKind::Write, b.desc, 0, MIB, 1)
    };
    // SAFETY: refused before anything is posted.
    let r = unsafe { a.rdma.submit(ep, &[past]) };
    assert!(matches!(r, Err(Error::OutOfRange { .. })), "{r:?}");
    // SAFETY: refused (the id is in use).
    let r = unsafe {
        a.rdma
            .register_device(SegmentId(9), dptr, MIB, DeviceMemory::PeerMem)
    };
    assert!(r.is_err());
    // SAFETY: refused (a null address).
    let r = unsafe {
        a.rdma
            .register_device(SegmentId(11), 0, MIB, DeviceMemory::PeerMem)
    };
    assert!(r.is_err());
    a.rdma.unregister(reg).unwrap();
}

#[cfg(feature = "cuda")]
#[test]
fn gpu_memory_goes_by_dma_buf_where_the_driver_exports_it_and_by_peermem_where_it_does_not() {
    use crate::cuda::Driver;
    use crate::cuda::driver_double::{DriverDouble, Op as CudaOp};
    let f = Fabric::new();
    let a = node(&f, 1, MIB, |_| {});
    let driver = DriverDouble::default();
    let dptr = driver.mem_alloc(2 * MIB as usize).unwrap();
    // SAFETY: only registered; no batch names it.
    let (reg, path) =
        unsafe { a.rdma.register_gpu(SegmentId(20), &driver, dptr, 2 * MIB) }.unwrap();
    assert_eq!(path, GpuPath::DmaBuf);
    assert_eq!(f.dmabuf_registrations(), 1);
    a.rdma.unregister(reg).unwrap();
    // the driver refuses the export (proprietary kernel module, old kernel)
    driver.fail_nth(CudaOp::Dmabuf, 0);
    // SAFETY: as above.
    let (_, path) = unsafe { a.rdma.register_gpu(SegmentId(21), &driver, dptr, 2 * MIB) }.unwrap();
    assert_eq!(path, GpuPath::PeerMem);
    assert_eq!(
        f.dmabuf_registrations(),
        1,
        "no second dma-buf registration"
    );
    // neither works: one error with both reasons, nothing registered
    driver.fail_nth(CudaOp::Dmabuf, 0);
    f.refuse_registrations(1, true);
    // SAFETY: as above.
    let e = unsafe { a.rdma.register_gpu(SegmentId(22), &driver, dptr, 2 * MIB) }.unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)), "{e}");
    assert!(
        e.to_string().contains("dma-buf") && e.to_string().contains("nvidia-peermem"),
        "{e}"
    );
}
