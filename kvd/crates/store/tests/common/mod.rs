//! Shared fixtures of the store's integration tests.
#![allow(dead_code)] // each test binary uses its own subset

use std::sync::Arc;

use kvd_core::clock::Clock;
use kvd_core::keys::{KvDtype, NamespaceDescriptor, NamespaceId};
use kvd_store::pool::{HugePages, PoolConfig};
use kvd_store::{Store, StoreConfig};

/// A minimal layout: 4 tokens per block of `bytes_per_block`.
pub fn descriptor(bytes_per_block: u64) -> NamespaceDescriptor {
    NamespaceDescriptor {
        model_name: "m".into(),
        model_revision: "r".into(),
        tokenizer: "t".into(),
        adapter: String::new(),
        cache_salt: String::new(),
        dtype: KvDtype::Bf16,
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 8,
        tokens_per_block: 4,
        bytes_per_block,
        tp_rank: 0,
        tp_size: 1,
        pp_rank: 0,
        pp_size: 1,
        rope: String::new(),
    }
}

/// The configuration of a store of `pages` pages of `page` bytes, without huge pages.
pub fn config(page: u64, pages: u32) -> StoreConfig {
    StoreConfig::new(PoolConfig {
        page_size_bytes: page,
        page_count: pages,
        huge_pages: HugePages::Off,
    })
}

/// A store from `cfg` with the minimal layout registered.
pub fn store(cfg: StoreConfig, clock: Arc<dyn Clock>) -> (Store, NamespaceId) {
    let store = Store::new(cfg, clock).unwrap();
    let ns = store
        .register_namespace(&descriptor(cfg.pool.page_size_bytes))
        .unwrap();
    (store, ns)
}
