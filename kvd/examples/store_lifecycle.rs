//! The block store in one page: a writer caches a prompt's KV blocks, a reader finds the longest
//! cached prefix of its own prompt, a request checkpoints its KV, and recovery asks what it can
//! restore. Runs on an in-process pool; no daemon needed.
//!
//! `cargo run --release -p kvd --example store_lifecycle`

use std::sync::Arc;

use kvd::clock::MonotonicClock;
use kvd::keys::{BlockKey, NamespaceDescriptor, block_tags};
use kvd::pool::{HugePages, PoolConfig};
use kvd::store::{BlockClass, Store, StoreConfig};

fn main() -> kvd::Result<()> {
    // A Qwen3-14B-shaped layout with small blocks so the example runs anywhere: 16 tokens per
    // block of 16 KiB (a real deployment uses 16 × 160 KiB = 2.5 MiB pages).
    let layout = NamespaceDescriptor {
        model_revision: "example".into(),
        bytes_per_block: 16 * 1024,
        ..NamespaceDescriptor::example_qwen3_14b()
    };
    let store = Store::new(
        StoreConfig::new(PoolConfig {
            page_size_bytes: 16 * 1024,
            page_count: 256,
            huge_pages: HugePages::Off,
        }),
        Arc::new(MonotonicClock::new()),
    )?;
    let ns = store.register_namespace(&layout)?;

    // 1. A writer caches the KV of a 100-token prompt: 6 full blocks.
    let prompt: Vec<u32> = (0..100).map(|i| 1000 + i).collect();
    let tags = block_tags(&ns, 16, &prompt)?;
    let keys: Vec<BlockKey> = tags
        .iter()
        .map(|t| BlockKey {
            namespace: ns,
            tag: *t,
        })
        .collect();
    let writer = store.open_session("writer", 30_000)?;
    let allocs = store.alloc(writer, &keys, BlockClass::Cache, None)?;
    let mut handles = Vec::new();
    for (i, a) in allocs.into_iter().enumerate() {
        let a = a?;
        let kv = vec![i as u8; 16 * 1024]; // stands in for the engine's K/V bytes
        store.write(writer, &a.handle, 0, &kv)?;
        store.seal(writer, &a.handle, kv.len() as u64, None)?;
        handles.push(a.handle);
    }
    store.publish(writer, &handles)?; // all six become visible at once
    println!("cached {} blocks of prompt A", handles.len());

    // 2. A reader with a prompt that shares the first 70 tokens finds 4 reusable blocks.
    let mut prompt_b = prompt[..70].to_vec();
    prompt_b.extend(5000..5050);
    let reader = store.open_session("reader", 30_000)?;
    let hit = store.longest_prefix(&ns, &prompt_b, Some((reader, Some(10_000))))?;
    println!(
        "prompt B reuses {} blocks ({} tokens); prefill only the other {}",
        hit.blocks.len(),
        hit.blocks.len() * 16,
        prompt_b.len() - hit.blocks.len() * 16
    );
    let mut buf = vec![0u8; 16 * 1024];
    for b in &hit.blocks {
        store.read(reader, &b.handle, &mut buf, true)?; // verified against its CRC-32C
    }
    store.release(
        reader,
        &hit.blocks.iter().map(|b| b.handle).collect::<Vec<_>>(),
    )?;

    // 3. A request checkpoints its KV as it decodes; a newer epoch would supersede it.
    let request = 7;
    let history: Vec<u32> = (0..64).map(|i| 7000 + i).collect();
    let ck_tags = block_tags(&ns, 16, &history)?;
    store.manifest_begin(writer, request, 1, ns, 4 * 16 * 1024, 60_000)?;
    for (step, t) in ck_tags.chunks(2).enumerate() {
        let keys: Vec<BlockKey> = t
            .iter()
            .map(|t| BlockKey {
                namespace: ns,
                tag: *t,
            })
            .collect();
        let class = BlockClass::Checkpoint { request, epoch: 1 };
        let mut hs = Vec::new();
        for a in store.alloc(writer, &keys, class, None)? {
            let a = a?;
            store.write(writer, &a.handle, 0, &[step as u8; 1024])?;
            store.seal(writer, &a.handle, 1024, None)?;
            hs.push(a.handle);
        }
        let committed = (step as u64 + 1) * 32;
        store.manifest_extend(writer, request, 1, &hs, committed)?;
    }

    // 4. The serving worker dies; recovery asks the holder what it can restore.
    let plan = store.restore_prefix(request, &history)?;
    println!(
        "request 7 epoch {}: restore {} verified blocks ({} tokens), prefill {} more",
        plan.epoch,
        plan.blocks.len(),
        plan.tokens,
        history.len() as u64 - plan.tokens
    );
    store.manifest_end(request, 1)?;

    let st = store.stats();
    let a = st.accounting;
    println!(
        "pool: {} pages: {} free, {} published, {} in flight; accounting balanced: {}",
        a.total,
        a.free,
        a.published,
        a.allocated + a.writing + a.sealed,
        store.audit().1
    );
    Ok(())
}
