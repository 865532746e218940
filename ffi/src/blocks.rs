//! Blocks: namespaces and keys, lookups, pins, the write lifecycle, and the copies in and out of
//! the pool. Every batched call takes at most `KvdPoolInfo.max_batch` items; where items can
//! fail apart, `statuses[i]` receives item i's status and the call returns `KVD_OK` when the
//! batch itself went through.

use kvd_core::Result;
use kvd_core::keys::{BlockKey, BlockTag, NamespaceId};
use kvd_core::protocol::SealItem;
use kvd_core::types::{BlockVersion, Handle};

use crate::args;
use crate::handles::{KvdClient, entry, with_client};
use crate::status::{KVD_OK, status_of};
use crate::types::{
    KvdAllocation, KvdBlockClass, KvdBlockInfo, KvdHandle, KvdKey, KvdNamespaceDescriptor,
    KvdNamespaceId, KvdRemoveItem, KvdSealItem, KvdTag, block_class, descriptor, reservation,
};

pub(crate) fn keys(p: *const KvdKey, n: usize) -> Result<Vec<BlockKey>> {
    Ok(args::slice(p, n, "keys")?
        .iter()
        .map(|k| BlockKey::from(*k))
        .collect())
}

pub(crate) fn namespace(p: *const KvdNamespaceId) -> Result<NamespaceId> {
    Ok(NamespaceId::from(*args::in_ref(p, "namespace_id")?))
}

pub(crate) fn tags(p: *const KvdTag, n: usize) -> Result<Vec<BlockTag>> {
    Ok(args::slice(p, n, "tags")?
        .iter()
        .map(|t| BlockTag::from(*t))
        .collect())
}

/// A TTL from its C form: 0 means the daemon's default.
pub(crate) fn ttl(ms: u64) -> Option<u64> {
    (ms != 0).then_some(ms)
}

pub(crate) fn handles(p: *const KvdHandle, n: usize) -> Result<Vec<Handle>> {
    Ok(args::slice(p, n, "handles")?
        .iter()
        .map(|h| Handle::from(*h))
        .collect())
}

pub(crate) fn handle(p: *const KvdHandle) -> Result<Handle> {
    Ok(Handle::from(*args::in_ref(p, "handle")?))
}

/// Write each item's status into `statuses` (checked to hold `n`).
fn put_statuses<T>(statuses: &mut [i32], results: &[Result<T>]) {
    for (s, r) in statuses.iter_mut().zip(results) {
        *s = r.as_ref().map_or_else(status_of, |_| KVD_OK);
    }
}

/// The namespace id of a descriptor, computed here (no daemon needed); the daemon computes the
/// same in `kvd_register_namespace`. Thread-safe.
#[unsafe(no_mangle)]
pub extern "C" fn kvd_namespace_id(
    desc: *const KvdNamespaceDescriptor,
    out: *mut KvdNamespaceId,
) -> i32 {
    entry("kvd_namespace_id", || {
        let d = descriptor(args::in_ref(desc, "desc")?)?;
        *args::out_ref(out, "out")? = d.id().into();
        Ok(())
    })
}

/// The chained tags of every full block of `tokens` (`tag_i = blake3(ns ‖ tag_{i-1} ‖
/// tokens of block i)`); a trailing partial block has none. `out` must hold
/// `n_tokens / tokens_per_block` tags; `*out_n` receives their count. Thread-safe.
#[unsafe(no_mangle)]
pub extern "C" fn kvd_block_tags(
    namespace_id: *const KvdNamespaceId,
    tokens_per_block: u32,
    tokens: *const u32,
    n_tokens: usize,
    out: *mut KvdTag,
    out_cap: usize,
    out_n: *mut usize,
) -> i32 {
    entry("kvd_block_tags", || {
        let ns = namespace(namespace_id)?;
        let tokens = args::slice(tokens, n_tokens, "tokens")?;
        let out_n = args::out_ref(out_n, "out_n")?;
        let tags = kvd_core::keys::block_tags(&ns, tokens_per_block, tokens)?;
        args::fits(out_cap, tags.len(), "out")?;
        let out = args::slice_mut(out, tags.len(), "out")?;
        for (o, t) in out.iter_mut().zip(&tags) {
            *o = (*t).into();
        }
        *out_n = tags.len();
        Ok(())
    })
}

/// Register a KV layout with the daemon (idempotent); `*out` receives its id. Thread-safe
/// (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_register_namespace(
    client: *mut KvdClient,
    desc: *const KvdNamespaceDescriptor,
    out: *mut KvdNamespaceId,
) -> i32 {
    with_client("kvd_register_namespace", client, |c| {
        let d = descriptor(args::in_ref(desc, "desc")?)?;
        let out = args::out_ref(out, "out")?;
        *out = c.register_namespace(&d)?.into();
        Ok(())
    })
}

/// The longest PUBLISHED prefix of the chain `tags[0..n]`. `out` must hold `n` infos; the first
/// `*out_n` are the prefix's blocks in order. With `pin`, they are pinned for this session for
/// `pin_ttl_ms` (0: the daemon's default): release them with `kvd_release`. `*out_pinned` (may
/// be NULL) receives whether they were pinned. Thread-safe (serialized per client).
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn kvd_lookup_prefix(
    client: *mut KvdClient,
    namespace_id: *const KvdNamespaceId,
    tags: *const KvdTag,
    n: usize,
    pin: bool,
    pin_ttl_ms: u64,
    out: *mut KvdBlockInfo,
    out_cap: usize,
    out_n: *mut usize,
    out_pinned: *mut bool,
) -> i32 {
    with_client("kvd_lookup_prefix", client, |c| {
        let ns = namespace(namespace_id)?;
        let tags = self::tags(tags, n)?;
        args::fits(out_cap, n, "out")?;
        let out = args::slice_mut(out, n, "out")?;
        let out_n = args::out_ref(out_n, "out_n")?;
        let out_pinned = args::opt_out(out_pinned, "out_pinned")?;
        let hit = c.lookup_prefix(&ns, &tags, pin, ttl(pin_ttl_ms))?;
        for (o, b) in out.iter_mut().zip(&hit.blocks) {
            *o = (*b).into();
        }
        *out_n = hit.blocks.len();
        if let Some(p) = out_pinned {
            *p = hit.pinned;
        }
        Ok(())
    })
}

/// Which of `keys[0..n]` are PUBLISHED: bit i of `bitmap` (byte i / 8, least significant bit
/// first) is set for key i. `bitmap` must hold `(n + 7) / 8` bytes. Thread-safe (serialized
/// per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_exists(
    client: *mut KvdClient,
    keys: *const KvdKey,
    n: usize,
    bitmap: *mut u8,
    bitmap_len: usize,
) -> i32 {
    with_client("kvd_exists", client, |c| {
        let ks = self::keys(keys, n)?;
        let need = n.div_ceil(8);
        args::fits(bitmap_len, need, "bitmap")?;
        let out = args::slice_mut(bitmap, need, "bitmap")?;
        let found = c.exists(&ks)?;
        out.copy_from_slice(&kvd_core::protocol::pack_bits(found));
        Ok(())
    })
}

/// Pin PUBLISHED blocks for reading, for `ttl_ms` (0: the daemon's default). `out` and
/// `statuses` must hold `n`; item i gets its block in `out[i]` when `statuses[i]` is `KVD_OK`
/// (`KVD_ERR_NOT_FOUND` for a key that is not published). Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_acquire(
    client: *mut KvdClient,
    keys: *const KvdKey,
    n: usize,
    ttl_ms: u64,
    out: *mut KvdBlockInfo,
    statuses: *mut i32,
) -> i32 {
    with_client("kvd_acquire", client, |c| {
        let ks = self::keys(keys, n)?;
        let out = args::slice_mut(out, n, "out")?;
        let st = args::slice_mut(statuses, n, "statuses")?;
        let got = c.acquire(&ks, ttl(ttl_ms))?;
        put_statuses(st, &got);
        for (o, r) in out.iter_mut().zip(got) {
            *o = r.map(KvdBlockInfo::from).unwrap_or_default();
        }
        Ok(())
    })
}

/// Release pins. `statuses` must hold `n`: an entry that went stale (its pin expired, the
/// daemon restarted) or was released already gets its error there; the pin is gone either way.
/// Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_release(
    client: *mut KvdClient,
    handles: *const KvdHandle,
    n: usize,
    statuses: *mut i32,
) -> i32 {
    with_client("kvd_release", client, |c| {
        let hs = self::handles(handles, n)?;
        let st = args::slice_mut(statuses, n, "statuses")?;
        put_statuses(st, &c.release(&hs)?);
        Ok(())
    })
}

/// Allocate blocks to write (they start WRITING, owned by this session until sealed or
/// aborted). `class` may be NULL (a cache block); `reservation` 0 for none. `out` and
/// `statuses` must hold `n`; per key: `KVD_OK` (new), `KVD_ERR_ALREADY_EXISTS` (published, or
/// being written by another session: busy), `KVD_ERR_NO_SPACE`. Thread-safe (serialized per
/// client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_alloc(
    client: *mut KvdClient,
    keys: *const KvdKey,
    n: usize,
    class: *const KvdBlockClass,
    reservation_id: u64,
    out: *mut KvdAllocation,
    statuses: *mut i32,
) -> i32 {
    with_client("kvd_alloc", client, |c| {
        let ks = self::keys(keys, n)?;
        let class = if class.is_null() {
            block_class(None)?
        } else {
            block_class(Some(args::in_ref(class, "class")?))?
        };
        let out = args::slice_mut(out, n, "out")?;
        let st = args::slice_mut(statuses, n, "statuses")?;
        let got = c.alloc(&ks, class, reservation(reservation_id))?;
        put_statuses(st, &got);
        for (o, r) in out.iter_mut().zip(got) {
            *o = r.map(KvdAllocation::from).unwrap_or_default();
        }
        Ok(())
    })
}

/// Copy `len` bytes into a block this session is writing, at `offset` within its page.
/// Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_write(
    client: *mut KvdClient,
    handle: *const KvdHandle,
    offset: u64,
    data: *const u8,
    len: usize,
) -> i32 {
    with_client("kvd_write", client, |c| {
        let h = self::handle(handle)?;
        Ok(c.write(&h, offset, args::slice(data, len, "data")?)?)
    })
}

/// As `kvd_write`, computing the CRC-32C of the bytes in the same pass, continuing from `crc`
/// (0 to start); `*crc_out` receives it. Write a block front to back and pass the final value
/// to `kvd_seal`. Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_write_crc(
    client: *mut KvdClient,
    handle: *const KvdHandle,
    offset: u64,
    data: *const u8,
    len: usize,
    crc: u32,
    crc_out: *mut u32,
) -> i32 {
    with_client("kvd_write_crc", client, |c| {
        let h = self::handle(handle)?;
        let data = args::slice(data, len, "data")?;
        let out = args::out_ref(crc_out, "crc_out")?;
        *out = c.write_with_crc(&h, offset, data, crc)?;
        Ok(())
    })
}

/// Seal written blocks: from here their bytes are immutable. `checksums` and `statuses` must
/// hold `n`; item i's recorded CRC goes to `checksums[i]`. A supplied checksum that does not
/// match the bytes (when the daemon verifies them) is `KVD_ERR_CORRUPT`. Thread-safe
/// (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_seal(
    client: *mut KvdClient,
    items: *const KvdSealItem,
    n: usize,
    checksums: *mut u32,
    statuses: *mut i32,
) -> i32 {
    with_client("kvd_seal", client, |c| {
        let items: Vec<SealItem> = args::slice(items, n, "items")?
            .iter()
            .map(|s| SealItem::from(*s))
            .collect();
        let sums = args::slice_mut(checksums, n, "checksums")?;
        let st = args::slice_mut(statuses, n, "statuses")?;
        let got = c.seal(&items)?;
        put_statuses(st, &got);
        for (o, r) in sums.iter_mut().zip(got) {
            *o = r.unwrap_or(0);
        }
        Ok(())
    })
}

/// Publish SEALED cache blocks as one group: all become visible, or none does (the call's
/// error says why). Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_publish(client: *mut KvdClient, handles: *const KvdHandle, n: usize) -> i32 {
    with_client("kvd_publish", client, |c| {
        Ok(c.publish(&self::handles(handles, n)?)?)
    })
}

/// Register this client's session as rank `rank` of engine instance `(instance, generation)`
/// of `rank_count` ranks (a tensor- or pipeline-parallel instance, one session per rank). From
/// then on a step of the instance is published only when every rank committed its blocks of
/// it (`kvd_instance_commit`); when any rank's session ends, the instance fails as a whole:
/// every rank's open steps are aborted and later calls of its ranks answer
/// `KVD_ERR_UNAVAILABLE` (restart the instance with a higher generation). Idempotent.
/// `KVD_ERR_INVALID_ARGUMENT` for a bad rank or count or a rank taken, `KVD_ERR_STALE_EPOCH`
/// for an older generation. Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_instance_join(
    client: *mut KvdClient,
    instance: u64,
    generation: u64,
    rank: u32,
    rank_count: u32,
) -> i32 {
    with_client("kvd_instance_join", client, |c| {
        Ok(c.instance_join(instance, generation, rank, rank_count)?)
    })
}

/// Commit this rank's SEALED cache blocks of step `step` of its instance. `*published` (may be
/// NULL) receives whether this commit completed the step, so that every rank's blocks of it
/// are PUBLISHED now, together; until then none is visible. Errors as `kvd_publish` for the
/// blocks, and as `kvd_instance_join`. Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_instance_commit(
    client: *mut KvdClient,
    instance: u64,
    generation: u64,
    step: u64,
    handles: *const KvdHandle,
    n: usize,
    published: *mut bool,
) -> i32 {
    with_client("kvd_instance_commit", client, |c| {
        let hs = self::handles(handles, n)?;
        let out = args::opt_out(published, "published")?;
        let done = c.instance_commit(instance, generation, step, &hs)?;
        if let Some(p) = out {
            *p = done;
        }
        Ok(())
    })
}

/// Abort unfinished blocks (their pages return to the pool). `statuses` must hold `n`.
/// Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_abort(
    client: *mut KvdClient,
    handles: *const KvdHandle,
    n: usize,
    statuses: *mut i32,
) -> i32 {
    with_client("kvd_abort", client, |c| {
        let hs = self::handles(handles, n)?;
        let st = args::slice_mut(statuses, n, "statuses")?;
        put_statuses(st, &c.abort(&hs)?);
        Ok(())
    })
}

/// Compare-and-delete: remove each key only if it still holds exactly that version (a late
/// delete never removes a newer block; a version from another daemon incarnation never
/// matches). `statuses` must hold `n`. Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_remove_if(
    client: *mut KvdClient,
    items: *const KvdRemoveItem,
    n: usize,
    statuses: *mut i32,
) -> i32 {
    with_client("kvd_remove_if", client, |c| {
        let items: Vec<(BlockKey, BlockVersion)> = args::slice(items, n, "items")?
            .iter()
            .map(|i| (BlockKey::from(i.key), BlockVersion::from(i.version)))
            .collect();
        let st = args::slice_mut(statuses, n, "statuses")?;
        put_statuses(st, &c.remove_if(&items)?);
        Ok(())
    })
}

/// Soft-pin PUBLISHED cache blocks `keys[0..n]` (a shared prefix: a system prompt's blocks)
/// until `ttl_ms` from now (capped at a day; 0 ends it): eviction takes them only when nothing
/// else can go. Bit i of `bitmap` (as `kvd_exists`) is set for a key that was soft-pinned.
/// Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_soft_pin(
    client: *mut KvdClient,
    keys: *const KvdKey,
    n: usize,
    ttl_ms: u64,
    bitmap: *mut u8,
    bitmap_len: usize,
) -> i32 {
    with_client("kvd_soft_pin", client, |c| {
        let ks = self::keys(keys, n)?;
        let need = n.div_ceil(8);
        args::fits(bitmap_len, need, "bitmap")?;
        let out = args::slice_mut(bitmap, need, "bitmap")?;
        out.copy_from_slice(&kvd_core::protocol::pack_bits(c.soft_pin(&ks, ttl_ms)?));
        Ok(())
    })
}

/// Mark blocks recently used (LRU). Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_touch(client: *mut KvdClient, keys: *const KvdKey, n: usize) -> i32 {
    with_client("kvd_touch", client, |c| Ok(c.touch(&self::keys(keys, n)?)?))
}

/// Copy `len` bytes of a block this session pins, from `offset` within it, into `dst`. The
/// page is checked to hold the block before and after the copy: `KVD_ERR_STALE_GENERATION`
/// means `dst` holds none of its bytes; `KVD_ERR_LEASE_EXPIRED` past the pin's TTL.
/// Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_read(
    client: *mut KvdClient,
    handle: *const KvdHandle,
    offset: u64,
    dst: *mut u8,
    len: usize,
) -> i32 {
    with_client("kvd_read", client, |c| {
        let h = self::handle(handle)?;
        Ok(c.read(&h, offset, args::slice_mut(dst, len, "dst")?)?)
    })
}

/// Copy a whole pinned block into `dst` (`dst_len` at least the block's length) and check its
/// checksum in the same pass; `*out_len` receives the block's length. A mismatch is
/// `KVD_ERR_CORRUPT` with `KvdErrorInfo.corruption` saying whether the daemon quarantined the
/// block or only this copy was bad. Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_read_verified(
    client: *mut KvdClient,
    handle: *const KvdHandle,
    dst: *mut u8,
    dst_len: usize,
    out_len: *mut u64,
) -> i32 {
    with_client("kvd_read_verified", client, |c| {
        let h = self::handle(handle)?;
        let dst = args::slice_mut(dst, dst_len, "dst")?;
        let out_len = args::out_ref(out_len, "out_len")?;
        *out_len = c.read_verified(&h, dst)?;
        Ok(())
    })
}

/// A block version from a handle (for `kvd_remove_if`). Thread-safe; no client needed.
#[unsafe(no_mangle)]
pub extern "C" fn kvd_handle_version(
    handle: *const KvdHandle,
    out: *mut crate::types::KvdBlockVersion,
) -> i32 {
    entry("kvd_handle_version", || {
        let v = self::handle(handle)?.version();
        *args::out_ref(out, "out")? = crate::types::KvdBlockVersion {
            node_generation: v.node_generation,
            generation: v.generation,
        };
        Ok(())
    })
}
