//! Reservations and request checkpoints (manifests, recovery's restore-prefix).

use kvd_core::types::{ManifestInfo, ReservationId};

use crate::args;
use crate::blocks::{self, handles};
use crate::handles::{KvdClient, with_client};
use crate::types::{
    KvdBlockInfo, KvdHandle, KvdManifestInfo, KvdNamespaceId, KvdRestoreInfo, KvdTag,
};

/// Reserve `bytes` for this session's future allocations (pass the id to `kvd_alloc`); fails
/// fast with the retryable `KVD_ERR_NO_SPACE` when they do not fit. Thread-safe (serialized per
/// client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_reserve(client: *mut KvdClient, bytes: u64, out: *mut u64) -> i32 {
    with_client("kvd_reserve", client, |c| {
        let out = args::out_ref(out, "out")?;
        *out = c.reserve(bytes)?.0;
        Ok(())
    })
}

/// Give a reservation's unused space back (`KVD_ERR_NOT_FOUND` for an id this session does not
/// hold). Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_release_reservation(client: *mut KvdClient, reservation: u64) -> i32 {
    with_client("kvd_release_reservation", client, |c| {
        Ok(c.release_reservation(ReservationId(reservation))?)
    })
}

/// Copy a manifest into `*out` and, when `tags` is not NULL, its tags into `tags` (which must
/// hold `out.tag_count`; `*out` is filled first, so a caller can size a second try).
fn put_manifest(
    m: &ManifestInfo,
    out: &mut KvdManifestInfo,
    tags: *mut KvdTag,
    tags_cap: usize,
) -> kvd_core::Result<()> {
    *out = KvdManifestInfo::from(m);
    if !tags.is_null() {
        args::fits(tags_cap, m.tags.len(), "tags")?;
        let t = args::slice_mut(tags, m.tags.len(), "tags")?;
        for (o, tag) in t.iter_mut().zip(&m.tags) {
            *o = (*tag).into();
        }
    }
    Ok(())
}

/// Begin (or supersede with a newer epoch) request `request`'s checkpoint manifest, reserving
/// `reserve_bytes` (0: none) for `ttl_ms`. Allocate its blocks with `KVD_CLASS_CHECKPOINT`.
/// Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_manifest_begin(
    client: *mut KvdClient,
    request: u64,
    epoch: u64,
    namespace_id: *const KvdNamespaceId,
    reserve_bytes: u64,
    ttl_ms: u64,
    out: *mut KvdManifestInfo,
) -> i32 {
    with_client("kvd_manifest_begin", client, |c| {
        let ns = blocks::namespace(namespace_id)?;
        let out = args::out_ref(out, "out")?;
        let m = c.manifest_begin(request, epoch, &ns, reserve_bytes, ttl_ms)?;
        put_manifest(&m, out, std::ptr::null_mut(), 0).map_err(Into::into)
    })
}

/// Publish SEALED checkpoint blocks `handles[0..n]` into the manifest with the new committed
/// token count, atomically (`KVD_ERR_STALE_EPOCH` for an older epoch). Thread-safe (serialized
/// per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_manifest_extend(
    client: *mut KvdClient,
    request: u64,
    epoch: u64,
    handles: *const KvdHandle,
    n: usize,
    committed_tokens: u64,
    out: *mut KvdManifestInfo,
) -> i32 {
    with_client("kvd_manifest_extend", client, |c| {
        let hs = self::handles(handles, n)?;
        let out = args::out_ref(out, "out")?;
        let m = c.manifest_extend(request, epoch, &hs, committed_tokens)?;
        put_manifest(&m, out, std::ptr::null_mut(), 0).map_err(Into::into)
    })
}

/// Renew a manifest's TTL; `*expires_in_ms` (may be NULL) receives the ms until it expires.
/// Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_manifest_renew(
    client: *mut KvdClient,
    request: u64,
    epoch: u64,
    ttl_ms: u64,
    expires_in_ms: *mut u64,
) -> i32 {
    with_client("kvd_manifest_renew", client, |c| {
        let out = args::opt_out(expires_in_ms, "expires_in_ms")?;
        let ms = c.manifest_renew(request, epoch, ttl_ms)?;
        if let Some(o) = out {
            *o = ms;
        }
        Ok(())
    })
}

/// The request ended or was cancelled: release its checkpoint and reservation. Thread-safe
/// (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_manifest_end(client: *mut KvdClient, request: u64, epoch: u64) -> i32 {
    with_client("kvd_manifest_end", client, |c| {
        Ok(c.manifest_end(request, epoch)?)
    })
}

/// A request's manifest as published. `tags` may be NULL; otherwise it must hold
/// `out->tag_count` tags (`KVD_ERR_INVALID_ARGUMENT` when too short, with `*out` filled so that
/// the caller can size a second try). Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_manifest_get(
    client: *mut KvdClient,
    request: u64,
    out: *mut KvdManifestInfo,
    tags: *mut KvdTag,
    tags_cap: usize,
) -> i32 {
    with_client("kvd_manifest_get", client, |c| {
        let out = args::out_ref(out, "out")?;
        let m = c.manifest(request)?;
        put_manifest(&m, out, tags, tags_cap).map_err(Into::into)
    })
}

/// Recovery: the longest verified checkpoint prefix of `tokens[0..n_tokens]` held here for
/// `request` (checksums checked now). `*out` receives the summary; `blocks` must hold
/// `out->block_count` infos (`KVD_ERR_INVALID_ARGUMENT` when too short, `*out` filled). The
/// blocks are not pinned: acquire their keys to read them. Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_restore_prefix(
    client: *mut KvdClient,
    request: u64,
    tokens: *const u32,
    n_tokens: usize,
    out: *mut KvdRestoreInfo,
    blocks: *mut KvdBlockInfo,
    blocks_cap: usize,
) -> i32 {
    with_client("kvd_restore_prefix", client, |c| {
        let tokens = args::slice(tokens, n_tokens, "tokens")?;
        let out = args::out_ref(out, "out")?;
        let r = c.restore_prefix(request, tokens)?;
        *out = KvdRestoreInfo {
            epoch: r.epoch,
            tokens: r.tokens,
            committed_tokens: r.committed_tokens,
            block_count: r.blocks.len() as u64,
        };
        args::fits(blocks_cap, r.blocks.len(), "blocks")?;
        let b = args::slice_mut(blocks, r.blocks.len(), "blocks")?;
        for (o, info) in b.iter_mut().zip(&r.blocks) {
            *o = (*info).into();
        }
        Ok(())
    })
}
