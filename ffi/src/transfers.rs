//! Blocks between daemons: push, fetch, checkpoint streaming and the recovery read through
//! this node's daemon (its data port), started without waiting and polled with
//! `kvd_transfers`, so that an event loop can drive them.

use kvd_client::Client;
use kvd_core::keys::BlockKey;
use kvd_core::protocol::{TransferInfo, TransferState};

use crate::args;
use crate::blocks::keys;
use crate::handles::{KvdClient, with_client};
use crate::types::KvdKey;

/// A transfer is under way.
pub const KVD_TRANSFER_IN_FLIGHT: u32 = 0;
/// Every block was published at the destination.
pub const KVD_TRANSFER_DONE: u32 = 1;
/// It failed; nothing of it was published at the destination (`status` says why).
pub const KVD_TRANSFER_FAILED: u32 = 2;

/// A transfer started by this node's daemon, as `kvd_transfers` reports it.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvdTransferInfo {
    /// Its id.
    pub id: u64,
    /// The peer node.
    pub peer: u64,
    /// `KVD_TRANSFER_IN_FLIGHT`, `KVD_TRANSFER_DONE` or `KVD_TRANSFER_FAILED`.
    pub state: u32,
    /// When failed: the `KVD_ERR_*` status of the failure (0 otherwise).
    pub status: i32,
    /// Blocks published at the destination.
    pub blocks: u64,
    /// Their bytes.
    pub bytes: u64,
    /// A prefix fetch's tokens covered (0 otherwise).
    pub tokens: u64,
    /// Milliseconds from the request to its end (0 while in flight).
    pub elapsed_ms: u64,
}

impl From<&TransferInfo> for KvdTransferInfo {
    fn from(t: &TransferInfo) -> Self {
        let (state, status) = match &t.state {
            TransferState::InFlight => (KVD_TRANSFER_IN_FLIGHT, 0),
            TransferState::Done => (KVD_TRANSFER_DONE, 0),
            TransferState::Failed(e) => {
                (KVD_TRANSFER_FAILED, kvd_core::Error::from(e.clone()).code())
            }
        };
        KvdTransferInfo {
            id: t.id,
            peer: t.peer,
            state,
            status,
            blocks: u64::from(t.blocks),
            bytes: t.bytes,
            tokens: t.tokens,
            elapsed_ms: t.elapsed_ms,
        }
    }
}

/// Push PUBLISHED blocks `keys[0..n]` (one namespace) to peer node `peer`; `*id` receives the
/// transfer's id at once (poll it with `kvd_transfers`). The blocks stay pinned here until it
/// ends; the peer publishes them as one group only when every byte arrived intact.
/// `KVD_ERR_UNAVAILABLE` without a data port, `KVD_ERR_OVERLOADED` (retryable) past the
/// bound on transfers in flight. Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_push(
    client: *mut KvdClient,
    peer: u64,
    keys_in: *const KvdKey,
    n: usize,
    id: *mut u64,
) -> i32 {
    start_keyed("kvd_push", client, keys_in, n, id, |c, ks| c.push(peer, ks))
}

/// `kvd_fetch`'s peer for "whichever peers hold them": a cluster fetch.
pub const KVD_ANY_NODE: u64 = 0;
const _: () = assert!(KVD_ANY_NODE == kvd_core::protocol::ANY_NODE);

/// Fetch PUBLISHED blocks `keys[0..n]` (one namespace) from peer node `peer`, published here
/// as one group when every byte arrived intact (keys the peer lacks are skipped); `*id`
/// receives the transfer's id at once. With `peer` `KVD_ANY_NODE`, a cluster fetch: the
/// daemon asks its live peers which of the keys they hold and fetches the longest run from
/// the first key that they hold between them, each piece from its holder (the transfer's
/// `blocks` says how many arrived, its `peer` the first piece's holder). Thread-safe
/// (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_fetch(
    client: *mut KvdClient,
    peer: u64,
    keys_in: *const KvdKey,
    n: usize,
    id: *mut u64,
) -> i32 {
    start_keyed("kvd_fetch", client, keys_in, n, id, |c, ks| {
        c.fetch(peer, ks)
    })
}

/// Stream one checkpoint step of `request` (its PUBLISHED checkpoint blocks `keys[0..n]` at
/// `epoch`) to its holder `peer`, which extends its manifest with them and
/// `committed_tokens` atomically (an older epoch is refused there); `*id` receives the
/// transfer's id at once. Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_push_checkpoint(
    client: *mut KvdClient,
    peer: u64,
    request: u64,
    epoch: u64,
    keys_in: *const KvdKey,
    n: usize,
    committed_tokens: u64,
    ttl_ms: u64,
    id: *mut u64,
) -> i32 {
    start_keyed("kvd_push_checkpoint", client, keys_in, n, id, |c, ks| {
        c.push_checkpoint(peer, request, epoch, ks, committed_tokens, ttl_ms)
    })
}

/// The recovery read: fetch from holder `peer` the longest verified prefix of `request`'s
/// checkpoint that `tokens[0..n_tokens]` continues (as PUBLISHED cache blocks here; the
/// transfer's `tokens` says how many tokens they cover); `*id` receives the transfer's id at
/// once. Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_fetch_prefix(
    client: *mut KvdClient,
    peer: u64,
    request: u64,
    tokens: *const u32,
    n_tokens: usize,
    id: *mut u64,
) -> i32 {
    with_client("kvd_fetch_prefix", client, |c| {
        let t = args::slice(tokens, n_tokens, "tokens")?;
        let out = args::out_ref(id, "id")?;
        *out = c.fetch_prefix(peer, request, t)?;
        Ok(())
    })
}

/// A decode's hand-off read: fetch blocks `keys[0..n]` from peer `peer`'s hold of `request`
/// at `epoch` (the peer refuses unless that hold lives at exactly that epoch and holds every
/// key); with `end_hold` non-zero the peer's hold ends once every block is published here.
/// `*id` receives the transfer's id at once. Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_fetch_held(
    client: *mut KvdClient,
    peer: u64,
    request: u64,
    epoch: u64,
    keys_in: *const KvdKey,
    n: usize,
    end_hold: i32,
    id: *mut u64,
) -> i32 {
    start_keyed("kvd_fetch_held", client, keys_in, n, id, |c, ks| {
        c.fetch_held(peer, request, epoch, ks, end_hold != 0)
    })
}

/// A prefill hands its prompt's run off: the daemon holds the leading PUBLISHED run of
/// `keys[0..n]` for `request` at `epoch`, beyond this client's life, until it is ended
/// (`kvd_hold_end`, or the front over HTTP), taken by the decode that fetched it, or `ttl_ms`
/// passes. `*held` receives how many leading keys are held, `*bytes` their bytes (either may
/// be NULL). `KVD_ERR_STALE_EPOCH` for an older or ended epoch, `KVD_ERR_NOT_FOUND` when the
/// first key is not published. Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_hold_begin(
    client: *mut KvdClient,
    request: u64,
    epoch: u64,
    keys_in: *const KvdKey,
    n: usize,
    ttl_ms: u64,
    held: *mut usize,
    bytes: *mut u64,
) -> i32 {
    with_client("kvd_hold_begin", client, |c| {
        let ks = keys(keys_in, n)?;
        let h = c.hold_begin(request, epoch, &ks, ttl_ms)?;
        if let Some(out) = args::opt_out(held, "held")? {
            *out = h.keys.len();
        }
        if let Some(out) = args::opt_out(bytes, "bytes")? {
            *out = h.bytes;
        }
        Ok(())
    })
}

/// End `request`'s hand-off hold on this node if its epoch is at most `epoch`; `*ended`
/// (may be NULL) receives 1 if one ended, 0 if there was none. Thread-safe (serialized per
/// client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_hold_end(
    client: *mut KvdClient,
    request: u64,
    epoch: u64,
    ended: *mut i32,
) -> i32 {
    with_client("kvd_hold_end", client, |c| {
        let e = c.hold_end(request, epoch)?;
        if let Some(out) = args::opt_out(ended, "ended")? {
            *out = i32::from(e);
        }
        Ok(())
    })
}

/// The states of transfers `ids[0..n]` started by this node's daemon, into `out` (which must
/// hold `n`); `*found` receives how many were known (unknown or forgotten ids are left out;
/// the known ones come first, in the order asked). Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_transfers(
    client: *mut KvdClient,
    ids: *const u64,
    n: usize,
    out: *mut KvdTransferInfo,
    out_cap: usize,
    found: *mut usize,
) -> i32 {
    with_client("kvd_transfers", client, |c| {
        let ids = args::slice(ids, n, "ids")?;
        let found = args::out_ref(found, "found")?;
        args::fits(out_cap, ids.len(), "out")?;
        let got = c.transfers(ids)?;
        let o = args::slice_mut(out, got.len(), "out")?;
        for (slot, t) in o.iter_mut().zip(&got) {
            *slot = t.into();
        }
        *found = got.len();
        Ok(())
    })
}

/// The body of a call that starts a transfer of blocks `keys_in[0..n]` with `start`: the
/// keys and the out-pointer checked, the transfer's id into `*id`.
fn start_keyed(
    name: &str,
    client: *mut KvdClient,
    keys_in: *const KvdKey,
    n: usize,
    id: *mut u64,
    start: impl FnOnce(&mut Client, &[BlockKey]) -> kvd_core::Result<u64>,
) -> i32 {
    with_client(name, client, |c| {
        let ks = keys(keys_in, n)?;
        let out = args::out_ref(id, "id")?;
        *out = start(c, &ks)?;
        Ok(())
    })
}
