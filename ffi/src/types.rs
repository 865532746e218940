//! The C mirrors of kvd-core's plain data, and their conversions. Fixed-size, no pointers owned
//! by libkvd, explicit padding, so that a C struct and its Rust mirror have one layout.

use std::ffi::c_char;

use kvd_core::keys::{BlockKey, BlockTag, KvDtype, NamespaceDescriptor, NamespaceId};
use kvd_core::protocol::SealItem;
use kvd_core::types::{
    Allocation, BlockClass, BlockEvent, BlockEventKind, BlockInfo, BlockVersion, EventBatch,
    Handle, ManifestInfo, ReservationId, StoreStats,
};
use kvd_core::{Error, Result};

use crate::args;

/// A namespace id: blake3 of the namespace descriptor's canonical encoding.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvdNamespaceId {
    /// The 32 bytes.
    pub bytes: [u8; 32],
}

/// A block tag within a namespace: chained from tokens (`kvd_block_tags`) or an engine's own
/// 32-byte block hash.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvdTag {
    /// The 32 bytes.
    pub bytes: [u8; 32],
}

/// A block's full key.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvdKey {
    /// The layout the block's bytes follow.
    pub namespace_id: KvdNamespaceId,
    /// The block's tag.
    pub tag: KvdTag,
}

/// One version of one block: node incarnation, page (slot), and the block's generation. Every
/// use is checked by the daemon; a stale handle gets `KVD_ERR_STALE_GENERATION`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvdHandle {
    /// The daemon incarnation that issued it.
    pub node_generation: u64,
    /// The block's generation.
    pub generation: u64,
    /// The page it lives in.
    pub slot: u32,
    /// Zero.
    pub reserved: u32,
}

/// A block version for compare-and-delete (`kvd_remove_if`); take it from the block's handle.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvdBlockVersion {
    /// The daemon incarnation that holds the block.
    pub node_generation: u64,
    /// The block's generation within it.
    pub generation: u64,
}

/// One item of `kvd_remove_if`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvdRemoveItem {
    /// The key.
    pub key: KvdKey,
    /// The version to remove; another version under the key stays.
    pub version: KvdBlockVersion,
}

/// A PUBLISHED block as a lookup or acquire sees it.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvdBlockInfo {
    /// The block's key.
    pub key: KvdKey,
    /// The block's handle.
    pub handle: KvdHandle,
    /// Byte offset of its page in the pool mapping (`KvdPoolInfo.base + offset`).
    pub offset: u64,
    /// Valid bytes.
    pub len: u64,
    /// CRC-32C recorded at seal.
    pub checksum: u32,
    /// Zero.
    pub reserved: u32,
    /// The pin's TTL in ms from when the daemon took it (0: not pinned). Do not trust the
    /// block's bytes in the mapping past it.
    pub pin_ttl_ms: u64,
}

/// A freshly allocated block: where to write it.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvdAllocation {
    /// The block's handle (WRITING, owned by this session until sealed or aborted).
    pub handle: KvdHandle,
    /// Byte offset of its page in the pool mapping.
    pub offset: u64,
    /// The page's size: the most the block can hold.
    pub capacity: u64,
}

/// One item of `kvd_seal`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvdSealItem {
    /// The block.
    pub handle: KvdHandle,
    /// Valid bytes written from the page's start.
    pub len: u64,
    /// CRC-32C of those bytes (from `kvd_write_crc`), used when `has_checksum`.
    pub checksum: u32,
    /// Whether `checksum` is supplied; if not, the daemon computes it (one more pass).
    pub has_checksum: bool,
}

/// `KvdBlockClass.kind`: a prefix-cache block (evictable, published with `kvd_publish`).
pub const KVD_CLASS_CACHE: u32 = 0;
/// `KvdBlockClass.kind`: a block of a request's checkpoint (published with
/// `kvd_manifest_extend`).
pub const KVD_CLASS_CHECKPOINT: u32 = 1;

/// Which class of block to allocate.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvdBlockClass {
    /// `KVD_CLASS_CACHE` or `KVD_CLASS_CHECKPOINT`.
    pub kind: u32,
    /// Zero.
    pub reserved: u32,
    /// Checkpoint: the request whose manifest the block joins.
    pub request: u64,
    /// Checkpoint: the manifest's epoch.
    pub epoch: u64,
}

/// `KvdNamespaceDescriptor.dtype`: bfloat16.
pub const KVD_DTYPE_BF16: u32 = 1;
/// IEEE half.
pub const KVD_DTYPE_F16: u32 = 2;
/// float32.
pub const KVD_DTYPE_F32: u32 = 3;
/// FP8 E4M3.
pub const KVD_DTYPE_FP8_E4M3: u32 = 4;
/// FP8 E5M2.
pub const KVD_DTYPE_FP8_E5M2: u32 = 5;

/// Everything that determines a KV block's bytes (see kvd's `NamespaceDescriptor`). Strings are
/// NUL-terminated UTF-8 (at most 256 bytes each); NULL reads as "".
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct KvdNamespaceDescriptor {
    /// Model name, e.g. "Qwen/Qwen3-14B".
    pub model_name: *const c_char,
    /// Exact model revision.
    pub model_revision: *const c_char,
    /// Tokenizer identity.
    pub tokenizer: *const c_char,
    /// Adapter id and revision ("" for none).
    pub adapter: *const c_char,
    /// Cache salt ("" for none).
    pub cache_salt: *const c_char,
    /// RoPE / position parameters, canonicalised by the engine.
    pub rope: *const c_char,
    /// One of `KVD_DTYPE_*`.
    pub dtype: u32,
    /// Layers in one block.
    pub num_layers: u32,
    /// KV heads in one block (after TP sharding).
    pub num_kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Tokens per block.
    pub tokens_per_block: u32,
    /// Tensor-parallel rank.
    pub tp_rank: u32,
    /// Tensor-parallel size.
    pub tp_size: u32,
    /// Pipeline-parallel rank.
    pub pp_rank: u32,
    /// Pipeline-parallel size.
    pub pp_size: u32,
    /// Zero.
    pub reserved: u32,
    /// Bytes of one block.
    pub bytes_per_block: u64,
}

/// Where the daemon's pool is mapped in this process.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct KvdPoolInfo {
    /// The pool memfd (owned by the client: do not close it).
    pub fd: i32,
    /// Pages in the pool.
    pub page_count: u32,
    /// The mapping's first byte; block offsets are relative to it. Valid until `kvd_close` or
    /// `kvd_reconnect` of this client.
    pub base: *mut u8,
    /// The mapping's length in bytes.
    pub size_bytes: u64,
    /// Bytes per page (the largest block).
    pub page_size_bytes: u64,
    /// The daemon incarnation's generation.
    pub node_generation: u64,
    /// The session's id.
    pub session: u64,
    /// The lease the daemon granted, ms.
    pub lease_ttl_ms: u64,
    /// Items in one batched call at most.
    pub max_batch: u32,
    /// Zero.
    pub reserved: u32,
}

/// The store's counts (pages by state, and counters since the daemon started). Its counters
/// are the ones kvd had at ABI 1, fixed so that the struct keeps its size; every counter,
/// those added since included, comes by name from `kvd_counter_name` and `kvd_counters`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvdStats {
    /// The daemon incarnation's generation.
    pub node_generation: u64,
    /// Bytes per page.
    pub page_size_bytes: u64,
    /// Pages in the pool.
    pub pages_total: u32,
    /// Free pages.
    pub pages_free: u32,
    /// ALLOCATED pages.
    pub pages_allocated: u32,
    /// WRITING pages.
    pub pages_writing: u32,
    /// SEALED pages.
    pub pages_sealed: u32,
    /// PUBLISHED pages.
    pub pages_published: u32,
    /// RETIRED pages.
    pub pages_retired: u32,
    /// QUARANTINED pages.
    pub pages_quarantined: u32,
    /// Pages reserved and not yet used.
    pub reserved_unused_pages: u64,
    /// Pin entries.
    pub pins: u64,
    /// Open sessions.
    pub sessions: u32,
    /// Live manifests.
    pub manifests: u32,
    /// Registered namespaces.
    pub namespaces: u32,
    /// Cache blocks eviction could take now.
    pub evictable: u32,
    /// Keys looked up.
    pub lookups: u64,
    /// Of those, found.
    pub hits: u64,
    /// Handles refused for a generation mismatch.
    pub stale_generation_rejects: u64,
    /// Blocks that failed their checksum.
    pub checksum_failures: u64,
    /// Cache blocks evicted.
    pub evictions: u64,
    /// Operations refused at a bound.
    pub overload_rejects: u64,
    /// Allocations refused for lack of space.
    pub no_space_rejects: u64,
    /// Sessions closed at their lease.
    pub sessions_expired: u64,
    /// Pins dropped at their TTL.
    pub pins_expired: u64,
    /// Manifests released at their TTL.
    pub manifests_expired: u64,
    /// Blocks published.
    pub blocks_published: u64,
    /// Blocks aborted.
    pub blocks_aborted: u64,
    /// Blocks removed by compare-and-delete.
    pub blocks_removed: u64,
}

/// A request's checkpoint manifest. Its tags are copied separately (see `kvd_manifest_get`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvdManifestInfo {
    /// The request.
    pub request: u64,
    /// Its epoch.
    pub epoch: u64,
    /// The layout of its blocks.
    pub namespace_id: KvdNamespaceId,
    /// Tokens committed.
    pub committed_tokens: u64,
    /// When it expires unless renewed (daemon clock, ms).
    pub expires_at_ms: u64,
    /// The reservation backing it (0: none).
    pub reservation: u64,
    /// Tags in the manifest.
    pub tag_count: u64,
}

/// What a checkpoint holder can restore (`kvd_restore_prefix`); the blocks are copied
/// separately.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvdRestoreInfo {
    /// The manifest's epoch.
    pub epoch: u64,
    /// Tokens the verified blocks cover.
    pub tokens: u64,
    /// The manifest's committed token count.
    pub committed_tokens: u64,
    /// Blocks in the verified prefix.
    pub block_count: u64,
}

/// `KvdBlockEvent.kind`: the block became PUBLISHED; lookups under its key hit from now on.
pub const KVD_EVENT_STORED: u32 = 1;
/// `KvdBlockEvent.kind`: the PUBLISHED block left the index (removed, evicted, quarantined, or
/// its checkpoint ended, expired or was superseded); lookups under its key miss from now on.
pub const KVD_EVENT_REMOVED: u32 = 2;

/// One entry of a node's block event log (`kvd_events`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvdBlockEvent {
    /// The event's sequence number: 1 for the first of a daemon incarnation, then one more
    /// per event (a restart starts again at 1; `KvdPoolInfo.node_generation` tells
    /// incarnations apart).
    pub seq: u64,
    /// The block's key.
    pub key: KvdKey,
    /// `KVD_EVENT_STORED` or `KVD_EVENT_REMOVED`.
    pub kind: u32,
    /// Zero.
    pub reserved: u32,
}

/// What a `kvd_events` batch says beside its events.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvdEventBatch {
    /// Events written to the caller's array.
    pub count: u64,
    /// The `since` to pass next.
    pub next_seq: u64,
    /// Events the caller asked for that the daemon's bounded log had dropped already (0:
    /// none). When not 0, resync with lookups, then go on from `next_seq`.
    pub lost: u64,
}

/// What a passed health canary measured.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvdHealthReport {
    /// Microseconds the write-read-verify-remove cycle took.
    pub elapsed_us: u64,
    /// Bytes written and read back.
    pub bytes: u64,
}

impl From<KvdNamespaceId> for NamespaceId {
    fn from(n: KvdNamespaceId) -> Self {
        NamespaceId(n.bytes)
    }
}
impl From<NamespaceId> for KvdNamespaceId {
    fn from(n: NamespaceId) -> Self {
        KvdNamespaceId { bytes: n.0 }
    }
}
impl From<KvdTag> for BlockTag {
    fn from(t: KvdTag) -> Self {
        BlockTag(t.bytes)
    }
}
impl From<BlockTag> for KvdTag {
    fn from(t: BlockTag) -> Self {
        KvdTag { bytes: t.0 }
    }
}
impl From<KvdKey> for BlockKey {
    fn from(k: KvdKey) -> Self {
        BlockKey {
            namespace: k.namespace_id.into(),
            tag: k.tag.into(),
        }
    }
}
impl From<BlockKey> for KvdKey {
    fn from(k: BlockKey) -> Self {
        KvdKey {
            namespace_id: k.namespace.into(),
            tag: k.tag.into(),
        }
    }
}
impl From<KvdHandle> for Handle {
    fn from(h: KvdHandle) -> Self {
        Handle {
            node_generation: h.node_generation,
            slot: h.slot,
            generation: h.generation,
        }
    }
}
impl From<Handle> for KvdHandle {
    fn from(h: Handle) -> Self {
        KvdHandle {
            node_generation: h.node_generation,
            generation: h.generation,
            slot: h.slot,
            reserved: 0,
        }
    }
}
impl From<KvdBlockVersion> for BlockVersion {
    fn from(v: KvdBlockVersion) -> Self {
        BlockVersion {
            node_generation: v.node_generation,
            generation: v.generation,
        }
    }
}
impl From<BlockInfo> for KvdBlockInfo {
    fn from(b: BlockInfo) -> Self {
        KvdBlockInfo {
            key: b.key.into(),
            handle: b.handle.into(),
            offset: b.offset,
            len: b.len,
            checksum: b.checksum,
            reserved: 0,
            pin_ttl_ms: b.pin_ttl_ms,
        }
    }
}
impl From<Allocation> for KvdAllocation {
    fn from(a: Allocation) -> Self {
        KvdAllocation {
            handle: a.handle.into(),
            offset: a.offset,
            capacity: a.capacity,
        }
    }
}
impl From<KvdSealItem> for SealItem {
    fn from(s: KvdSealItem) -> Self {
        SealItem {
            handle: s.handle.into(),
            len: s.len,
            checksum: s.has_checksum.then_some(s.checksum),
        }
    }
}
impl From<&ManifestInfo> for KvdManifestInfo {
    fn from(m: &ManifestInfo) -> Self {
        KvdManifestInfo {
            request: m.request,
            epoch: m.epoch,
            namespace_id: m.namespace.into(),
            committed_tokens: m.committed_tokens,
            expires_at_ms: m.expires_at_ms,
            reservation: m.reservation.map_or(0, |r| r.0),
            tag_count: m.tags.len() as u64,
        }
    }
}
impl From<BlockEvent> for KvdBlockEvent {
    fn from(e: BlockEvent) -> Self {
        KvdBlockEvent {
            seq: e.seq,
            key: e.key.into(),
            kind: match e.kind {
                BlockEventKind::Stored => KVD_EVENT_STORED,
                BlockEventKind::Removed => KVD_EVENT_REMOVED,
            },
            reserved: 0,
        }
    }
}
impl From<&EventBatch> for KvdEventBatch {
    fn from(b: &EventBatch) -> Self {
        KvdEventBatch {
            count: b.events.len() as u64,
            next_seq: b.next_seq,
            lost: b.lost,
        }
    }
}
impl From<&StoreStats> for KvdStats {
    fn from(s: &StoreStats) -> Self {
        let a = &s.accounting;
        let c = &s.counters;
        KvdStats {
            node_generation: s.node_generation,
            page_size_bytes: s.page_size_bytes,
            pages_total: a.total,
            pages_free: a.free,
            pages_allocated: a.allocated,
            pages_writing: a.writing,
            pages_sealed: a.sealed,
            pages_published: a.published,
            pages_retired: a.retired,
            pages_quarantined: a.quarantined,
            reserved_unused_pages: s.reserved_unused_pages,
            pins: s.pins,
            sessions: s.sessions,
            manifests: s.manifests,
            namespaces: s.namespaces,
            evictable: s.evictable,
            lookups: c.lookups,
            hits: c.hits,
            stale_generation_rejects: c.stale_generation_rejects,
            checksum_failures: c.checksum_failures,
            evictions: c.evictions,
            overload_rejects: c.overload_rejects,
            no_space_rejects: c.no_space_rejects,
            sessions_expired: c.sessions_expired,
            pins_expired: c.pins_expired,
            manifests_expired: c.manifests_expired,
            blocks_published: c.blocks_published,
            blocks_aborted: c.blocks_aborted,
            blocks_removed: c.blocks_removed,
        }
    }
}

/// A block class from its C form.
pub(crate) fn block_class(c: Option<&KvdBlockClass>) -> Result<BlockClass> {
    match c {
        None => Ok(BlockClass::Cache),
        Some(c) if c.kind == KVD_CLASS_CACHE => Ok(BlockClass::Cache),
        Some(c) if c.kind == KVD_CLASS_CHECKPOINT => Ok(BlockClass::Checkpoint {
            request: c.request,
            epoch: c.epoch,
        }),
        Some(c) => Err(Error::InvalidArgument(format!(
            "block class kind {} is neither KVD_CLASS_CACHE nor KVD_CLASS_CHECKPOINT",
            c.kind
        ))),
    }
}

/// A reservation id from its C form (0: none).
pub(crate) fn reservation(r: u64) -> Option<ReservationId> {
    (r != 0).then_some(ReservationId(r))
}

fn opt_string(p: *const c_char, what: &str) -> Result<String> {
    if p.is_null() {
        Ok(String::new())
    } else {
        args::string(p, what).map(str::to_owned)
    }
}

/// A namespace descriptor from its C form, validated.
pub(crate) fn descriptor(d: &KvdNamespaceDescriptor) -> Result<NamespaceDescriptor> {
    let dtype = match d.dtype {
        KVD_DTYPE_BF16 => KvDtype::Bf16,
        KVD_DTYPE_F16 => KvDtype::F16,
        KVD_DTYPE_F32 => KvDtype::F32,
        KVD_DTYPE_FP8_E4M3 => KvDtype::Fp8E4m3,
        KVD_DTYPE_FP8_E5M2 => KvDtype::Fp8E5m2,
        other => {
            return Err(Error::InvalidArgument(format!(
                "dtype {other} is none of KVD_DTYPE_*"
            )));
        }
    };
    let out = NamespaceDescriptor {
        model_name: opt_string(d.model_name, "model_name")?,
        model_revision: opt_string(d.model_revision, "model_revision")?,
        tokenizer: opt_string(d.tokenizer, "tokenizer")?,
        adapter: opt_string(d.adapter, "adapter")?,
        cache_salt: opt_string(d.cache_salt, "cache_salt")?,
        dtype,
        num_layers: d.num_layers,
        num_kv_heads: d.num_kv_heads,
        head_dim: d.head_dim,
        tokens_per_block: d.tokens_per_block,
        bytes_per_block: d.bytes_per_block,
        tp_rank: d.tp_rank,
        tp_size: d.tp_size,
        pp_rank: d.pp_rank,
        pp_size: d.pp_size,
        rope: opt_string(d.rope, "rope")?,
    };
    out.validate()?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvd_core::counters::Counters;

    /// How many of the store's declared counters (`kvd_core::counters`, in order) `KvdStats`
    /// has as fields: those of ABI 1.
    const KVD_STATS_COUNTERS: usize = 13;

    #[test]
    fn kvd_counter_name_names_every_declared_counter_in_order_then_null() {
        use std::ffi::CStr;
        assert_eq!(crate::kvd_counter_count(), Counters::DECLARED.len());
        for (i, d) in Counters::DECLARED.iter().enumerate() {
            // SAFETY: a non-NULL result is a static NUL-terminated string.
            let name = unsafe { CStr::from_ptr(crate::kvd_counter_name(i)) };
            assert_eq!(name.to_str().unwrap(), d.name);
        }
        assert!(crate::kvd_counter_name(Counters::DECLARED.len()).is_null());
        assert!(crate::kvd_counter_name(usize::MAX).is_null());
    }

    /// The store's counts as every layer that shows them names them, in order: the core's
    /// `StoreStats` (accounting fields as `pages_*`, counters flattened, of the declared
    /// counters the ABI-1 prefix `KvdStats` keeps), this crate's `KvdStats`, `include/kvd.h`
    /// and the Python package's ctypes mirror of the struct. A count added to the store outside
    /// the declared counters and missed by a layer fails here; declared counters reach C and
    /// Python by name (`kvd_counters`; tests/ffi_c.rs shows one end to end).
    /// A `StoreStats` with a distinct value in every leaf that `KvdStats` keeps (1, 2, ... in
    /// declaration order), and the names those leaves have in `KvdStats`, in that order.
    fn distinct_store_stats() -> (StoreStats, Vec<String>) {
        let shape = serde_json::to_value(StoreStats {
            node_generation: 0,
            page_size_bytes: 0,
            accounting: Default::default(),
            reserved_unused_pages: 0,
            pins: 0,
            sessions: 0,
            manifests: 0,
            namespaces: 0,
            evictable: 0,
            counters: Default::default(),
        })
        .unwrap();
        let mut names = Vec::new();
        let mut filled = serde_json::Map::new();
        let mut n = 1u64;
        for (k, v) in shape.as_object().unwrap() {
            match v.as_object() {
                Some(inner) => {
                    let mut m = serde_json::Map::new();
                    let leaves: Vec<(String, String)> = if k == "accounting" {
                        inner
                            .keys()
                            .map(|leaf| (leaf.clone(), format!("pages_{leaf}")))
                            .collect()
                    } else {
                        assert_eq!(k, "counters");
                        // the ones KvdStats does not keep: no value to expect
                        for d in &Counters::DECLARED[KVD_STATS_COUNTERS..] {
                            m.insert(d.name.to_string(), 0.into());
                        }
                        Counters::DECLARED[..KVD_STATS_COUNTERS]
                            .iter()
                            .map(|d| (d.name.to_string(), d.name.to_string()))
                            .collect()
                    };
                    for (leaf, name) in leaves {
                        m.insert(leaf, n.into());
                        names.push(name);
                        n += 1;
                    }
                    filled.insert(k.clone(), m.into());
                }
                None => {
                    names.push(k.clone());
                    filled.insert(k.clone(), n.into());
                    n += 1;
                }
            }
        }
        (serde_json::from_value(filled.into()).unwrap(), names)
    }

    #[test]
    fn every_store_count_reaches_kvd_stats_the_header_and_the_python_mirror_in_order() {
        let (stats, names) = distinct_store_stats();
        // KvdStats: the same names, each with its own value (Debug shows `name: value, ...`)
        let shown = format!("{:?}", KvdStats::from(&stats));
        let inner = shown
            .strip_prefix("KvdStats { ")
            .and_then(|s| s.strip_suffix(" }"))
            .unwrap();
        let mirrored: Vec<(&str, u64)> = inner
            .split(", ")
            .map(|f| {
                let (k, v) = f.split_once(": ").unwrap();
                (k, v.parse().unwrap())
            })
            .collect();
        // (serde_json's map is sorted by name: compare by name; the order is the header's)
        let mut expected: Vec<(&str, u64)> = names.iter().map(String::as_str).zip(1..).collect();
        expected.sort_unstable();
        let mut by_name = mirrored.clone();
        by_name.sort_unstable();
        assert_eq!(
            by_name, expected,
            "KvdStats copies every count of StoreStats, each its own"
        );
        let names: Vec<&str> = mirrored.iter().map(|(k, _)| *k).collect();
        // the header's KvdStats, in order, with its field types
        let h = include_str!("../../include/kvd.h");
        let end = h.find("} KvdStats;").expect("KvdStats in kvd.h");
        let start = h[..end].rfind("typedef struct {").unwrap();
        let fields: Vec<(&str, &str)> = h[start..end]
            .lines()
            .map(str::trim)
            .filter(|l| l.ends_with(';'))
            .map(|l| l.trim_end_matches(';').split_once(' ').unwrap())
            .map(|(t, n)| (n, t))
            .collect();
        let header: Vec<&str> = fields.iter().map(|(n, _)| *n).collect();
        assert_eq!(header, names, "include/kvd.h's KvdStats");
        // the Python mirror: its field list in order, and which of them are 32-bit
        let py = include_str!("../python/kvd/_lib.py");
        let list = &py[py.find("_STATS_FIELDS = (").unwrap()..];
        let list = &list[..list.find("\n)\n").unwrap()];
        let quoted = |s: &str| -> Vec<String> {
            s.split('"')
                .skip(1)
                .step_by(2)
                .map(str::to_string)
                .collect()
        };
        assert_eq!(
            quoted(list),
            names,
            "ffi/python/kvd/_lib.py's _STATS_FIELDS"
        );
        let u32s = &py[py.find("_STATS_U32 = {").unwrap()..];
        let u32s = &u32s[..u32s.find('}').unwrap()];
        let mut py32 = quoted(u32s);
        py32.sort();
        let mut h32: Vec<String> = fields
            .iter()
            .filter(|(_, t)| *t == "uint32_t")
            .map(|(n, _)| n.to_string())
            .collect();
        h32.sort();
        assert_eq!(py32, h32, "_STATS_U32 is the header's uint32_t fields");
    }

    #[test]
    fn the_mirror_structs_have_the_sizes_the_header_promises() {
        // Fixed layouts, no implicit padding: what a C compiler computes for the same fields.
        assert_eq!(std::mem::size_of::<KvdKey>(), 64);
        assert_eq!(std::mem::size_of::<KvdHandle>(), 24);
        assert_eq!(std::mem::size_of::<KvdBlockInfo>(), 64 + 24 + 8 + 8 + 8 + 8);
        assert_eq!(std::mem::size_of::<KvdAllocation>(), 40);
        assert_eq!(std::mem::size_of::<KvdRemoveItem>(), 80);
        assert_eq!(std::mem::size_of::<KvdBlockClass>(), 24);
        assert_eq!(std::mem::size_of::<KvdBlockEvent>(), 8 + 64 + 4 + 4);
        assert_eq!(std::mem::size_of::<KvdEventBatch>(), 24);
    }

    #[test]
    fn handles_and_keys_round_trip_through_their_mirrors() {
        let h = Handle {
            node_generation: 3,
            slot: 9,
            generation: 77,
        };
        assert_eq!(Handle::from(KvdHandle::from(h)), h);
        let k = BlockKey {
            namespace: NamespaceId([1; 32]),
            tag: BlockTag([2; 32]),
        };
        assert_eq!(BlockKey::from(KvdKey::from(k)), k);
        assert!(
            block_class(Some(&KvdBlockClass {
                kind: 7,
                ..Default::default()
            }))
            .is_err()
        );
    }
}
