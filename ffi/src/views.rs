//! Zero-copy views of pinned blocks, and in-place writes.
//!
//! The contract (the same as kvd-client's `BlockView`, spelled out in kvd.h):
//!
//! 1. Take a view (`kvd_view_acquire`) only of a block this session pinned (`kvd_acquire`, or
//!    `kvd_lookup_prefix` with `pin`), and use it before the pin's TTL.
//! 2. After using the bytes (a DMA to the GPU, a hash, a compare) call `kvd_view_still_valid`.
//!    Only `KVD_OK` means the bytes were the block's throughout. `KVD_ERR_STALE_GENERATION`
//!    means the page moved on (the pin expired and the page went to another block): discard
//!    whatever was derived from the bytes and treat the block as a miss.
//! 3. Never write through a view. Write only blocks you allocated, before sealing them.
//! 4. A view's `data` is an address in this client's mapping of the pool: `kvd_close` and
//!    `kvd_reconnect` unmap it, and touching it afterwards is undefined behaviour (the one
//!    misuse libkvd cannot turn into an error). `kvd_view_still_valid` on such a view answers
//!    `KVD_ERR_DISCONNECTED`.
//!
//! The check costs two loads of one word of the daemon's read-only page table, no system call.

use crate::args;
use crate::blocks::handle;
use crate::handles::{KvdClient, with_client};
use crate::types::KvdHandle;
use kvd_core::Error;

/// A zero-copy view of a pinned block's bytes in the pool. Plain data owned by the caller:
/// there is nothing to free; the pin is released with `kvd_release`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct KvdView {
    /// The block's first byte, in place in the pool mapping. Read only.
    pub data: *const u8,
    /// The block's length in bytes.
    pub len: u64,
    /// The block this view shows.
    pub handle: KvdHandle,
    /// The session the view was taken in (a view from before a reconnect is refused).
    pub session: u64,
}

/// Take a view of a block this session pins (see the contract above). Errors as `kvd_read`:
/// `KVD_ERR_INVALID_ARGUMENT` if the block is not pinned by this session,
/// `KVD_ERR_LEASE_EXPIRED` past the pin's TTL, `KVD_ERR_STALE_GENERATION` if its page already
/// moved on. Thread-safe (serialized per client); the view may be read from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn kvd_view_acquire(
    client: *mut KvdClient,
    handle: *const KvdHandle,
    out: *mut KvdView,
) -> i32 {
    with_client("kvd_view_acquire", client, |c| {
        let h = self::handle(handle)?;
        let out = args::out_ref(out, "out")?;
        let v = c.block(&h)?;
        *out = KvdView {
            data: v.bytes().as_ptr(),
            len: v.bytes().len() as u64,
            handle: h.into(),
            session: c.welcome().session.0,
        };
        Ok(())
    })
}

/// After using a view's bytes: `KVD_OK` if the page held the block from when the view was
/// taken until now; `KVD_ERR_STALE_GENERATION` if it moved on (discard what you derived from
/// the bytes); `KVD_ERR_DISCONNECTED` for a view of an earlier session of this client or once
/// the connection failed. Thread-safe (serialized per client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_view_still_valid(client: *mut KvdClient, view: *const KvdView) -> i32 {
    with_client("kvd_view_still_valid", client, |c| {
        let v = args::in_ref(view, "view")?;
        if v.session != c.welcome().session.0 {
            return Err(Error::Disconnected(format!(
                "the view was taken in session {}, this client is now session {}: its address \
                 is no longer mapped",
                v.session,
                c.welcome().session.0
            ))
            .into());
        }
        Ok(c.view_still_valid(&v.handle.into())?)
    })
}

/// The whole page of a block this session is writing, in place (no copy): `*data` receives its
/// address and `*capacity` its size, for a producer that fills it itself (a DMA engine through
/// the registered mapping). The page is the caller's alone until `kvd_seal` or `kvd_abort`;
/// compute its checksum yourself or let the daemon do it at seal. Thread-safe (serialized per
/// client).
#[unsafe(no_mangle)]
pub extern "C" fn kvd_block_mut(
    client: *mut KvdClient,
    handle: *const KvdHandle,
    data: *mut *mut u8,
    capacity: *mut u64,
) -> i32 {
    with_client("kvd_block_mut", client, |c| {
        let h = self::handle(handle)?;
        let data = args::out_ref(data, "data")?;
        let capacity = args::out_ref(capacity, "capacity")?;
        let page = c.block_mut(&h)?;
        *capacity = page.len() as u64;
        *data = page.as_mut_ptr();
        Ok(())
    })
}
