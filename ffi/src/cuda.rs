//! CUDA copies between an engine's device memory and pool blocks, by the GPU's copy engines.
//!
//! These functions are in every libkvd (the header is one for all builds); a libkvd built
//! without the `cuda` feature answers each valid call with `KVD_ERR_UNSUPPORTED` (and so does
//! one on a host without a CUDA driver). Arguments are checked first either way.
//!
//! Use: `kvd_cuda_register_pool` once per client (again after `kvd_reconnect`); then
//! `kvd_cuda_copy_to_block` fills a block this session allocated (before `kvd_seal`), and
//! `kvd_cuda_copy_from_block` copies a block it pins into device memory. Both take one device
//! slice per layer (`dev_ptrs[i]`, `lens[i]`, in order onto consecutive ranges of the block from
//! its first byte; a whole block is one slice), enqueue on the caller's `CUstream` (as an
//! integer; 0 is the legacy default stream) and hand out an event: poll it with
//! `kvd_cuda_event_query`, or `kvd_cuda_event_wait`, then `kvd_cuda_event_release`.
//!
//! The caller's contract (the driver cannot check it): until the event is done, the device
//! slices stay allocated and nothing else touches them, and a block being filled is not sealed,
//! aborted or written otherwise; the stream is a live stream of the calling thread's current
//! context. A copy out of a block is checked like a view: when its event is done, query and wait
//! answer `KVD_ERR_STALE_GENERATION` if the page moved on meanwhile (discard the bytes).

use std::time::Duration;

use kvd_client::{CudaEvent, DeviceSlice, MAX_CUDA_LAYERS};
use kvd_core::{Error, Result};

use crate::args;
use crate::blocks::handle;
use crate::handles::{KvdClient, with_client};
use crate::types::KvdHandle;

/// The most layers (device slices) one CUDA copy takes.
pub const KVD_CUDA_MAX_LAYERS: usize = 1024;

/// `kvd_cuda_event_wait`'s timeout meaning "as long as it takes".
pub const KVD_CUDA_WAIT_FOREVER: u64 = u64::MAX;

const _: () = assert!(KVD_CUDA_MAX_LAYERS == MAX_CUDA_LAYERS);

/// The layer list of a copy, checked: at most `KVD_CUDA_MAX_LAYERS` (before any element is
/// read), both arrays non-null for a non-zero count.
fn slices(dev_ptrs: *const u64, lens: *const u64, n_layers: usize) -> Result<Vec<DeviceSlice>> {
    if n_layers > KVD_CUDA_MAX_LAYERS {
        return Err(Error::InvalidArgument(format!(
            "n_layers = {n_layers} is more than KVD_CUDA_MAX_LAYERS ({KVD_CUDA_MAX_LAYERS})"
        )));
    }
    let ptrs = args::slice(dev_ptrs, n_layers, "dev_ptrs")?;
    let lens = args::slice(lens, n_layers, "lens")?;
    Ok(ptrs
        .iter()
        .zip(lens)
        .map(|(&ptr, &len)| DeviceSlice { ptr, len })
        .collect())
}

/// A copy call's pointer arguments, as C passed them.
struct CopyArgs {
    handle: *const KvdHandle,
    dev_ptrs: *const u64,
    lens: *const u64,
    n_layers: usize,
    event_out: *mut u64,
}

/// Both copy directions: check the arguments, run `f`, hand out its event.
fn copy(
    name: &'static str,
    client: *mut KvdClient,
    a: CopyArgs,
    f: impl FnOnce(
        &mut kvd_client::Client,
        &kvd_core::types::Handle,
        &[DeviceSlice],
    ) -> Result<CudaEvent>,
) -> i32 {
    with_client(name, client, |c| {
        let h = self::handle(a.handle)?;
        let layers = slices(a.dev_ptrs, a.lens, a.n_layers)?;
        let out = args::out_ref(a.event_out, "event_out")?;
        *out = f(c, &h, &layers)?.0;
        Ok(())
    })
}

/// Register this client's mapping of the pool as pinned memory for CUDA copies (in chunks of
/// at most 64 GiB; all or nothing). Idempotent per session. `KVD_ERR_UNSUPPORTED` without CUDA
/// in this libkvd or a driver on the host; `KVD_ERR_IO` when the driver fails. Thread-safe
/// (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_cuda_register_pool(client: *mut KvdClient) -> i32 {
    with_client("kvd_cuda_register_pool", client, |c| {
        c.cuda_register_pool()?;
        Ok(())
    })
}

/// Enqueue copies from device memory into a block this session allocated and has not sealed:
/// `n_layers` slices (`dev_ptrs[i]`, `lens[i]` bytes), in order from the block's first byte,
/// on `stream`; `*event_out` receives the completion event. The slices may cover less than the
/// page (seal with the length written). Wait for the event before `kvd_seal`.
///
/// Errors, all before anything is enqueued: `KVD_ERR_INVALID_ARGUMENT` for NULL arguments,
/// `n_layers` 0 or above `KVD_CUDA_MAX_LAYERS`, an empty slice, a null device address, more
/// bytes than the page, a block this session is not writing, or an unregistered pool;
/// `KVD_ERR_STALE_GENERATION` if its page moved on; `KVD_ERR_OVERLOADED` when too many events
/// are unreleased (retry after releasing some). `KVD_ERR_IO` when the driver fails (the block's
/// bytes are undefined; the stream was synchronized). `KVD_ERR_UNSUPPORTED` without CUDA.
/// The caller's contract: until the event is done, the device slices stay allocated and nothing
/// else touches them, the block is not sealed, aborted or written otherwise, and `stream` is a
/// live stream of the calling thread's current context. Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_cuda_copy_to_block(
    client: *mut KvdClient,
    handle: *const KvdHandle,
    dev_ptrs: *const u64,
    lens: *const u64,
    n_layers: usize,
    stream: u64,
    event_out: *mut u64,
) -> i32 {
    let a = CopyArgs {
        handle,
        dev_ptrs,
        lens,
        n_layers,
        event_out,
    };
    copy("kvd_cuda_copy_to_block", client, a, |c, h, layers| {
        // SAFETY: the device slices, the stream and not touching the block until the event is
        // done are the C caller's contract (kvd.h); the block range is checked by the client.
        unsafe { c.cuda_copy_to_block(h, layers, stream) }
    })
}

/// Enqueue copies of a block this session pins into device memory: `n_layers` slices
/// (`dev_ptrs[i]`, `lens[i]` bytes) from the block's first byte, on `stream`; `*event_out`
/// receives the completion event. Keep the pin until the event is released; until the event is
/// done nothing else touches the device slices and `stream` is live. Errors as
/// `kvd_cuda_copy_to_block`, for a pinned block (more bytes than the block's length is
/// `KVD_ERR_INVALID_ARGUMENT`, past the pin's TTL `KVD_ERR_LEASE_EXPIRED`). Thread-safe
/// (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_cuda_copy_from_block(
    client: *mut KvdClient,
    handle: *const KvdHandle,
    dev_ptrs: *const u64,
    lens: *const u64,
    n_layers: usize,
    stream: u64,
    event_out: *mut u64,
) -> i32 {
    let a = CopyArgs {
        handle,
        dev_ptrs,
        lens,
        n_layers,
        event_out,
    };
    copy("kvd_cuda_copy_from_block", client, a, |c, h, layers| {
        // SAFETY: as in `kvd_cuda_copy_to_block`; a copy that outlived the pin is reported when
        // its event is done.
        unsafe { c.cuda_copy_from_block(h, layers, stream) }
    })
}

/// Whether the copies of `event` are done, without blocking: `*done_out` is true once they
/// are. `KVD_ERR_NOT_FOUND` for a released or unknown event; `KVD_ERR_STALE_GENERATION` when a
/// copy out of a block is done but its page moved on meanwhile (discard the bytes);
/// `KVD_ERR_IO` when a copy failed on the device. Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_cuda_event_query(
    client: *mut KvdClient,
    event: u64,
    done_out: *mut bool,
) -> i32 {
    with_client("kvd_cuda_event_query", client, |c| {
        let out = args::out_ref(done_out, "done_out")?;
        *out = c.cuda_event_query(CudaEvent(event))?;
        Ok(())
    })
}

/// Wait up to `timeout_ms` (`KVD_CUDA_WAIT_FOREVER`: as long as it takes) for the copies of
/// `event`: `KVD_OK` once done, `KVD_ERR_DEADLINE` if they are still running at the timeout
/// (wait again). Otherwise errors as `kvd_cuda_event_query`. Blocks the calling thread and the
/// client. Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_cuda_event_wait(client: *mut KvdClient, event: u64, timeout_ms: u64) -> i32 {
    with_client("kvd_cuda_event_wait", client, |c| {
        let timeout =
            (timeout_ms != KVD_CUDA_WAIT_FOREVER).then(|| Duration::from_millis(timeout_ms));
        if c.cuda_event_wait(CudaEvent(event), timeout)? {
            Ok(())
        } else {
            Err(Error::Deadline(format!(
                "the copies of CUDA event {event:#x} are still running after {timeout_ms} ms; \
                 wait again"
            ))
            .into())
        }
    })
}

/// Hand `event` back (waiting for its copies first if they are still running); its value is
/// dead from here on. `KVD_ERR_NOT_FOUND` for a released or unknown event. Thread-safe
/// (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_cuda_event_release(client: *mut KvdClient, event: u64) -> i32 {
    with_client("kvd_cuda_event_release", client, |c| {
        c.cuda_event_release(CudaEvent(event))?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layer_list_is_checked_before_any_element_is_read() {
        let ptrs = [0x1000u64, 0x2000];
        let lens = [8u64, 8];
        assert_eq!(slices(ptrs.as_ptr(), lens.as_ptr(), 2).unwrap().len(), 2);
        assert!(slices(std::ptr::null(), lens.as_ptr(), 2).is_err());
        assert!(slices(ptrs.as_ptr(), std::ptr::null(), 2).is_err());
        // Far more than the arrays hold: refused on the count alone.
        let e = slices(ptrs.as_ptr(), lens.as_ptr(), KVD_CUDA_MAX_LAYERS + 1).unwrap_err();
        assert!(e.to_string().contains("KVD_CUDA_MAX_LAYERS"), "{e}");
    }
}
