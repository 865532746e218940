//! Micro-benchmarks of the block store's core paths, each beside the raw bound it builds on,
//! measured in the same run:
//!
//! - `lifecycle`: alloc → begin_write → seal (writer-supplied checksum) → publish → lookup →
//!   remove_if, one block and 64 blocks per call (ops/s).
//! - `prefix`: tags of a 2,048-token history and its longest-prefix lookup.
//! - `hash`: chained tag hashing vs raw blake3 over the same bytes (GB/s).
//! - `checksum`: crc32c (hardware) vs crc32fast, and copy+checksum fused vs separate passes, on
//!   2.5 MiB blocks cycled through a 256 MiB working set so that the data comes from memory.
//!
//! Run: `cargo bench -p kvd-bench --bench store`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kvd::clock::MonotonicClock;
use kvd::keys::{BlockKey, BlockTag, NamespaceDescriptor, NamespaceId, block_tags};
use kvd::pool::{HugePages, PoolConfig};
use kvd::store::{BlockClass, SessionId, Store, StoreConfig};

const BLOCK: usize = 2560 * 1024;
const WORKING_SET: usize = 256 * 1024 * 1024;

fn descriptor(tokens_per_block: u32, bytes: u64) -> NamespaceDescriptor {
    NamespaceDescriptor {
        model_revision: "bench".into(),
        tokens_per_block,
        bytes_per_block: bytes,
        rope: String::new(),
        ..NamespaceDescriptor::example_qwen3_14b()
    }
}

fn store(pages: u32) -> (Store, NamespaceId) {
    let s = Store::new(
        StoreConfig::new(PoolConfig {
            page_size_bytes: 4096,
            page_count: pages,
            huge_pages: HugePages::Off,
        }),
        std::sync::Arc::new(MonotonicClock::new()),
    )
    .unwrap();
    let ns = s.register_namespace(&descriptor(16, 4096)).unwrap();
    (s, ns)
}

/// Allocate, seal (with a supplied checksum: no data pass) and publish one block per key.
fn publish_empty(st: &Store, sid: SessionId, keys: &[BlockKey]) {
    let hs: Vec<_> = st
        .alloc(sid, keys, BlockClass::Cache, None)
        .unwrap()
        .into_iter()
        .map(|a| a.unwrap().handle)
        .collect();
    st.begin_write(sid, &hs).unwrap();
    for h in &hs {
        st.seal(sid, h, 4096, Some(0)).unwrap();
    }
    st.publish(sid, &hs).unwrap();
}

fn lifecycle(c: &mut Criterion) {
    let mut g = c.benchmark_group("lifecycle");
    for batch in [1usize, 64] {
        let (st, ns) = store(1024);
        let sid = st.open_session("bench", 600_000).unwrap();
        let mut n = 0u64;
        g.throughput(Throughput::Elements(batch as u64));
        g.bench_function(
            format!("alloc_seal_publish_lookup_remove/batch{batch}"),
            |b| {
                b.iter(|| {
                    let keys: Vec<BlockKey> = (0..batch)
                        .map(|_| {
                            n += 1;
                            let mut t = [0u8; 32];
                            t[..8].copy_from_slice(&n.to_le_bytes());
                            BlockKey {
                                namespace: ns,
                                tag: BlockTag(t),
                            }
                        })
                        .collect();
                    publish_empty(&st, sid, &keys);
                    let found = st.lookup(&keys).unwrap();
                    for (k, f) in keys.iter().zip(found) {
                        st.remove_if(k, f.unwrap().handle.version()).unwrap();
                    }
                })
            },
        );
    }
    g.finish();
}

fn prefix(c: &mut Criterion) {
    let mut g = c.benchmark_group("prefix");
    let (st, ns) = store(256);
    let sid = st.open_session("bench", 600_000).unwrap();
    let tokens: Vec<u32> = (0..2048u32)
        .map(|i| i.wrapping_mul(2_654_435_761))
        .collect();
    let tags = block_tags(&ns, 16, &tokens).unwrap();
    let keys: Vec<BlockKey> = tags
        .iter()
        .map(|t| BlockKey {
            namespace: ns,
            tag: *t,
        })
        .collect();
    publish_empty(&st, sid, &keys);
    g.throughput(Throughput::Elements(1));
    g.bench_function("tags_of_2048_tokens", |b| {
        b.iter(|| block_tags(&ns, 16, black_box(&tokens)).unwrap())
    });
    g.bench_function("lookup_prefix_128_blocks", |b| {
        b.iter(|| {
            let hit = st.lookup_prefix(&ns, black_box(&tags), None).unwrap();
            assert_eq!(hit.blocks.len(), 128);
        })
    });
    g.bench_function("longest_prefix_of_2048_tokens", |b| {
        b.iter(|| st.longest_prefix(&ns, black_box(&tokens), None).unwrap())
    });
    g.finish();
}

fn hash(c: &mut Criterion) {
    let mut g = c.benchmark_group("hash");
    let tokens: Vec<u32> = (0..262_144u32).collect(); // 1 MiB of token ids
    let raw: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    let ns = descriptor(16, 4096).id();
    g.throughput(Throughput::Bytes(raw.len() as u64));
    g.bench_function("raw_blake3", |b| b.iter(|| blake3::hash(black_box(&raw))));
    g.bench_function("chained_tags_16_tokens_per_block", |b| {
        b.iter(|| block_tags(&ns, 16, black_box(&tokens)).unwrap())
    });
    g.bench_function("chained_tags_256_tokens_per_block", |b| {
        b.iter(|| block_tags(&ns, 256, black_box(&tokens)).unwrap())
    });
    g.finish();
}

/// A working set of blocks, each visited in turn so that it is cold when visited again.
struct Blocks {
    src: Vec<u8>,
    dst: Vec<u8>,
    next: usize,
}

impl Blocks {
    fn new() -> Blocks {
        let mut src = vec![0u8; WORKING_SET];
        for (i, b) in src.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(31);
        }
        Blocks {
            src,
            dst: vec![1u8; WORKING_SET],
            next: 0,
        }
    }

    fn step(&mut self) -> (&mut [u8], &[u8]) {
        let o = self.next;
        self.next = (self.next + BLOCK) % (WORKING_SET - BLOCK);
        (&mut self.dst[o..o + BLOCK], &self.src[o..o + BLOCK])
    }
}

fn checksum(c: &mut Criterion) {
    let mut g = c.benchmark_group("checksum");
    g.throughput(Throughput::Bytes(BLOCK as u64));
    let mut blocks = Blocks::new();
    g.bench_function("crc32fast_2.5MiB", |b| {
        b.iter(|| crc32fast::hash(black_box(blocks.step().1)))
    });
    g.bench_function("crc32c_hw_2.5MiB", |b| {
        b.iter(|| crc32c::crc32c(black_box(blocks.step().1)))
    });
    g.bench_function("copy_libc_2.5MiB", |b| {
        b.iter(|| {
            let (d, s) = blocks.step();
            d.copy_from_slice(s);
        })
    });
    g.bench_function("copy_nontemporal_2.5MiB", |b| {
        b.iter(|| {
            let (d, s) = blocks.step();
            transport::local::copy(d, s);
        })
    });
    g.bench_function("copy_then_crc32c_2.5MiB", |b| {
        b.iter(|| {
            let (d, s) = blocks.step();
            transport::local::copy(d, s);
            crc32c::crc32c(d)
        })
    });
    g.bench_function("copy_fused_crc32c_2.5MiB", |b| {
        b.iter(|| {
            let (d, s) = blocks.step();
            transport::local::copy_with_crc32c(d, s, 0)
        })
    });
    g.bench_function("store_write_seal_2.5MiB", |b| {
        let st = Store::new(
            StoreConfig::new(PoolConfig {
                page_size_bytes: BLOCK as u64,
                page_count: 8,
                huge_pages: HugePages::Try,
            }),
            std::sync::Arc::new(MonotonicClock::new()),
        )
        .unwrap();
        let ns = st
            .register_namespace(&descriptor(16, BLOCK as u64))
            .unwrap();
        let sid = st.open_session("bench", 600_000).unwrap();
        let mut n = 0u64;
        b.iter_batched(
            || {
                n += 1;
                let mut t = [0u8; 32];
                t[..8].copy_from_slice(&n.to_le_bytes());
                BlockKey {
                    namespace: ns,
                    tag: BlockTag(t),
                }
            },
            |key| {
                let h = st.alloc(sid, &[key], BlockClass::Cache, None).unwrap()[0]
                    .as_ref()
                    .unwrap()
                    .handle;
                st.write(sid, &h, 0, blocks.step().1).unwrap();
                st.seal(sid, &h, BLOCK as u64, None).unwrap();
                st.abort(sid, &[h]).unwrap();
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20)
}

criterion_group! { name = benches; config = config(); targets = lifecycle, prefix, hash, checksum }
criterion_main!(benches);
