//! What a binding in another language needs beyond the borrow-checked API: where the pool is
//! mapped, and the view check by handle.
//!
//! A C or Python caller cannot hold a [`crate::BlockView`] (it borrows the client), so libkvd
//! hands out the view's address and length and keeps the handle; after the caller used the bytes
//! it asks [`Client::view_still_valid`], which is exactly [`crate::BlockView::still_valid`]. The
//! contract is the one in the `views` module docs; in addition, an address obtained here is
//! valid only while this client lives: closing it or [`Client::reconnect`] unmaps the pool.

use std::os::fd::{AsRawFd, RawFd};

use kvd_core::types::Handle;
use kvd_core::{Error, Result};

use crate::Client;

/// Where and how the daemon's pool is mapped in this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolMapping {
    /// The pool memfd's descriptor in this process (owned by the client: do not close it).
    pub fd: RawFd,
    /// The mapping's first byte. Block offsets in replies are relative to it.
    pub base: *const u8,
    /// The mapping's length in bytes.
    pub len: u64,
    /// Bytes per page.
    pub page_size: u64,
    /// Pages in the pool.
    pub page_count: u32,
}

impl Client {
    /// Where the pool is mapped (for registering it with a DMA engine, or for a binding that
    /// turns offsets into addresses). Valid until this client is closed or reconnects.
    pub fn pool_mapping(&self) -> PoolMapping {
        // SAFETY: a zero-length slice at offset 0 reads no byte, so no writer can race it; it
        // only gives the mapping's address.
        let base = unsafe { self.pool.bytes(0, 0) }
            .map(<[u8]>::as_ptr)
            .unwrap_or(std::ptr::null());
        PoolMapping {
            fd: self.pool.fd().as_raw_fd(),
            base,
            len: self.pool.len() as u64,
            page_size: self.welcome.page_size_bytes,
            page_count: self.welcome.page_count,
        }
    }

    /// After using the bytes of a view of `h` (taken with [`Client::block`]): whether the page
    /// held the block throughout, as [`crate::BlockView::still_valid`] answers it.
    ///
    /// # Errors
    /// [`Error::StaleGeneration`] when the page moved on (discard what was derived from the
    /// bytes); [`Error::Disconnected`] once the client is broken (its mapping is no longer its
    /// to trust).
    pub fn view_still_valid(&self, h: &Handle) -> Result<()> {
        if let Some(why) = self.broken() {
            return Err(Error::Disconnected(why.to_owned()));
        }
        self.held(h)
    }
}
