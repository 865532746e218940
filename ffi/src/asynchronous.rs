//! Asynchronous lookups for event loops (kvd-client's `Submitter`): submit, then poll or wait
//! for completions, with an eventfd for the engine's own `epoll`. A scheduler that calls only
//! these never blocks on kvd.

use std::os::fd::AsRawFd;
use std::time::Duration;

use crate::args;
use crate::blocks;
use crate::handles::{self, KvdClient, entry, with_submitter};
use crate::status::{KVD_OK, status_of};
use crate::types::{KvdBlockInfo, KvdHandle, KvdNamespaceId, KvdTag};
use kvd_client::{AsyncOp, AsyncReply};

/// One finished asynchronous call.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvdCompletion {
    /// The tag given at submit.
    pub user_tag: u64,
    /// The call's status (`KVD_OK`, or its error's code).
    pub status: i32,
    /// Lookup: whether the blocks were pinned.
    pub pinned: bool,
    /// Lookup: blocks of the prefix, written to the `out` array given at submit.
    pub block_count: u64,
}

/// Start client `client`'s asynchronous queue: one worker thread that runs submitted calls on
/// this client (its session, its pins), at most `max_inflight` (1..4096) submitted and not yet
/// polled. Once per client; it stops at `kvd_close`. Thread-safe.
#[unsafe(no_mangle)]
pub extern "C" fn kvd_async_start(client: *mut KvdClient, max_inflight: u32) -> i32 {
    entry("kvd_async_start", || {
        Ok(handles::start_submitter(client, max_inflight as usize)?)
    })
}

/// The queue's eventfd (owned by libkvd: do not close it): readable while completions wait to
/// be polled. Thread-safe; never waits.
#[unsafe(no_mangle)]
pub extern "C" fn kvd_async_fd(client: *mut KvdClient, fd: *mut i32) -> i32 {
    with_submitter("kvd_async_fd", client, |s| {
        *args::out_ref(fd, "fd")? = s.fd().as_raw_fd();
        Ok(())
    })
}

/// Submit a `kvd_lookup_prefix` of `tags[0..n]` (copied now). Its blocks are written to `out`
/// (which must hold `n` infos and stay valid and untouched until this call's completion has
/// been polled) by the `kvd_async_poll` that returns the completion. `KVD_ERR_OVERLOADED` when
/// `max_inflight` calls are submitted and not yet polled. Thread-safe; never waits for a call
/// in flight.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn kvd_async_lookup_prefix(
    client: *mut KvdClient,
    namespace_id: *const KvdNamespaceId,
    tags: *const KvdTag,
    n: usize,
    pin: bool,
    pin_ttl_ms: u64,
    user_tag: u64,
    out: *mut KvdBlockInfo,
    out_cap: usize,
) -> i32 {
    with_submitter("kvd_async_lookup_prefix", client, |s| {
        let ns = blocks::namespace(namespace_id)?;
        let tags = blocks::tags(tags, n)?;
        args::fits(out_cap, n, "out")?;
        // Checked now (NULL, alignment), written at poll.
        let out = args::slice_mut(out, n, "out")?;
        let op = AsyncOp::LookupPrefix {
            namespace: ns,
            tags,
            pin,
            pin_ttl_ms: blocks::ttl(pin_ttl_ms),
        };
        Ok(s.submit(user_tag, out.as_mut_ptr() as u64, op)?)
    })
}

/// Submit a `kvd_release` of `handles[0..n]` (copied now): the pins are handed back on the
/// queue's worker thread, and the completion's `block_count` says how many were released (a
/// stale or already released handle is not counted; pins end with their TTL anyway). For a
/// scheduler that must not wait for the daemon even to let go of what it pinned.
/// `KVD_ERR_OVERLOADED` as `kvd_async_lookup_prefix`. Thread-safe; never waits.
#[unsafe(no_mangle)]
pub extern "C" fn kvd_async_release(
    client: *mut KvdClient,
    handles: *const KvdHandle,
    n: usize,
    user_tag: u64,
) -> i32 {
    with_submitter("kvd_async_release", client, |s| {
        let handles = blocks::handles(handles, n)?;
        Ok(s.submit(user_tag, 0, AsyncOp::Release { handles })?)
    })
}

/// Take up to `cap` completions into `out`, waiting at most `timeout_ms` for the first (0: do
/// not wait); `*n` receives their count. Each lookup's blocks are written to its submit's `out`
/// array here, on the calling thread. Thread-safe.
#[unsafe(no_mangle)]
pub extern "C" fn kvd_async_poll(
    client: *mut KvdClient,
    timeout_ms: u64,
    out: *mut KvdCompletion,
    cap: usize,
    n: *mut usize,
) -> i32 {
    with_submitter("kvd_async_poll", client, |s| {
        let out = args::slice_mut(out, cap, "out")?;
        let n = args::out_ref(n, "n")?;
        let done = s.poll(cap, Duration::from_millis(timeout_ms));
        for (o, c) in out.iter_mut().zip(&done) {
            *o = KvdCompletion {
                user_tag: c.user_tag,
                ..KvdCompletion::default()
            };
            match &c.result {
                Ok(AsyncReply::Prefix(hit)) => {
                    // The submit checked this array for the tags' count, and a prefix has at
                    // most that many blocks.
                    let blocks = args::slice_mut(
                        c.context as usize as *mut KvdBlockInfo,
                        hit.blocks.len(),
                        "out",
                    )?;
                    for (b, info) in blocks.iter_mut().zip(&hit.blocks) {
                        *b = (*info).into();
                    }
                    o.status = KVD_OK;
                    o.pinned = hit.pinned;
                    o.block_count = hit.blocks.len() as u64;
                }
                Ok(AsyncReply::Released(n)) => {
                    o.status = KVD_OK;
                    o.block_count = *n as u64;
                }
                Err(e) => o.status = status_of(e),
            }
        }
        *n = done.len();
        Ok(())
    })
}
