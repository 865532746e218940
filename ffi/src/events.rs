//! Block events for KV-aware routers: which blocks the node holds (stored / removed), drained
//! in batches instead of polling lookups.

use crate::args;
use crate::handles::{KvdClient, with_client};
use crate::types::{KvdBlockEvent, KvdEventBatch};

/// Drain the node's block events: those with `seq >= since` (0: the oldest the daemon still
/// holds), at most `out_cap` (0 to `KvdPoolInfo.max_batch`; 0 asks only where the log stands),
/// in order, into `out`. `*batch` receives how many were written, the `since` to pass next
/// (`next_seq`) and `lost`: events the daemon's bounded log dropped before this caller read
/// them. When `lost` is not 0 the caller's picture of the node has a hole: resync with lookups,
/// then go on from `next_seq`. Sequence numbers restart at 1 when the daemon restarts (a new
/// `KvdPoolInfo.node_generation` after `kvd_reconnect`): start again from 0 then; a `since`
/// past the end of the log is `KVD_ERR_INVALID_ARGUMENT`. Reading removes nothing from the
/// log: each reader keeps its own `since`. Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_events(
    client: *mut KvdClient,
    since: u64,
    out: *mut KvdBlockEvent,
    out_cap: usize,
    batch: *mut KvdEventBatch,
) -> i32 {
    with_client("kvd_events", client, |c| {
        let batch = args::out_ref(batch, "batch")?;
        let out = args::slice_mut(out, out_cap, "out")?;
        let max = u32::try_from(out_cap).map_err(|_| {
            kvd_core::Error::InvalidArgument(format!("out_cap {out_cap} is out of range"))
        })?;
        let b = c.events(since, max)?;
        // The daemon answers at most `max` events; check it rather than trust it.
        args::fits(out_cap, b.events.len(), "out")?;
        for (o, e) in out.iter_mut().zip(&b.events) {
            *o = (*e).into();
        }
        *batch = KvdEventBatch::from(&b);
        Ok(())
    })
}
