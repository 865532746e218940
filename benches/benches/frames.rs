//! What a frame's integrity tag costs, against the chunk it travels with, in the same run:
//!
//! - `frames/tag request header`: tagging one 96-byte chunk request header (blake3 keyed hash
//!   over the header, its direction and sequence number), as the ring does for every chunk.
//! - `frames/check request header`: checking one, as the receiving side does.
//! - `frames/CRC-32C 1 MiB chunk`: the CRC-32C pass every checksummed 1 MiB chunk already
//!   costs on each side (the payload's own check), for scale; the chunk itself takes about
//!   250-350 µs on the wire at this machine's 3-4 GB/s.
//! - `frames/payload MAC 1 MiB chunk`: the keyed blake3 pass the optional payload MAC adds on
//!   each side (`--payload-mac`).
//! - `frames/sign a bind`, `frames/verify a bind`: the Ed25519 signature each end of a
//!   connection makes and checks once, at its handshake (node identity).
//!
//! Run: `cargo bench -p kvd-bench --bench frames`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use transport::auth::{ClusterSecret, Initiator, Responder, Role};
use transport::tcp::wire::{FLAG_CHECKSUM, Kind, Request};

fn frames(c: &mut Criterion) {
    let secret = ClusterSecret::from_bytes(&[7; 32]).unwrap();
    let (i, hello) = Initiator::start(&secret).unwrap();
    let (r, challenge) = Responder::answer(&secret, &hello).unwrap();
    let (proof, session) = i.respond(&challenge).unwrap();
    let key_i = session.key.clone();
    let key_r = r.verify(&proof).unwrap().key;
    let (mut seal, _) = key_i.split(Role::Initiator);
    let request = Request {
        kind: Kind::Write,
        flags: FLAG_CHECKSUM,
        tag: 1,
        transfer: 2,
        epoch: 3,
        node_generation: 4,
        segment: 1,
        len: 1 << 20,
        offset: 5 << 20,
        crc: 0x1234_5678,
        mac: [0; 16],
    };
    let mut g = c.benchmark_group("frames");
    g.measurement_time(Duration::from_secs(3));
    g.bench_function("tag request header", |b| {
        let mut h = request.encode();
        b.iter(|| {
            seal.seal(black_box(&mut h));
            black_box(&h);
        });
    });
    // a stream of headers tagged in order, checked in order (the check moves its sequence on)
    let (mut seal2, _) = key_i.split(Role::Initiator);
    let tagged: Vec<[u8; Request::WIRE_BYTES]> = (0..1 << 16)
        .map(|_| {
            let mut h = request.encode();
            seal2.seal(&mut h);
            h
        })
        .collect();
    g.bench_function("check request header", |b| {
        // criterion calls this more than once: each call checks the stream from its start
        let mut unseal = key_r.split(Role::Responder).1;
        let mut n = 0usize;
        let mut ok = true;
        b.iter(|| {
            ok &= unseal.open(black_box(&tagged[n])).is_ok();
            n += 1;
            if n == tagged.len() {
                // the stream starts over: a fresh receiver for it (once per 65,536 checks)
                n = 0;
                unseal = key_r.split(Role::Responder).1;
            }
        });
        assert!(ok, "every header of the stream checked");
    });
    let chunk = vec![0x5au8; 1 << 20];
    g.throughput(Throughput::Bytes(chunk.len() as u64));
    g.bench_function("CRC-32C 1 MiB chunk", |b| {
        b.iter(|| black_box(transport::local::crc32c(0, black_box(&chunk))));
    });
    let mac = key_i.payload_key();
    g.bench_function("payload MAC 1 MiB chunk", |b| {
        b.iter(|| black_box(mac.mac(black_box(&chunk))));
    });
    g.throughput(Throughput::Elements(1));
    let node = transport::link::testing::node_key(1);
    let body = [7u8; 32];
    g.bench_function("sign a bind", |b| {
        b.iter(|| black_box(node.sign_bind(Role::Initiator, &session.transcript, &body)));
    });
    let sig = node.sign_bind(Role::Initiator, &session.transcript, &body);
    let public = node.public();
    g.bench_function("verify a bind", |b| {
        b.iter(|| {
            black_box(transport::link::identity::verify_bind(
                &public,
                Role::Initiator,
                &session.transcript,
                &body,
                black_box(&sig),
            ))
        });
    });
    g.finish();
}

criterion_group!(benches, frames);
criterion_main!(benches);
