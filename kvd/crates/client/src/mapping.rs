//! The client's mapping of the daemon's pool: the received memfd mapped shared, read-write.
//!
//! All of the client's `unsafe` lives here. The mapping is shared with the daemon and other
//! engine processes; which bytes a process may touch when is the block store's state machine:
//! a block in WRITING belongs to the session that allocated it, and SEALED or PUBLISHED bytes
//! are immutable and stay in place while pinned. [`super::Client`] checks every range against
//! the handles its session holds before it asks for a slice here.

use std::fs::File;
use std::os::fd::OwnedFd;

use memmap2::{MmapOptions, MmapRaw};

use kvd_core::{Error, Result};

/// The pool, mapped into this process.
#[derive(Debug)]
pub(crate) struct PoolMapping {
    map: MmapRaw,
    len: usize,
}

impl PoolMapping {
    /// Map `len` bytes of the pool's memfd. `populate` pre-faults the page tables so the first
    /// copy into a page does not fault (costs time proportional to the pool at connect).
    pub(crate) fn new(fd: OwnedFd, len: u64, populate: bool) -> Result<PoolMapping> {
        let file = File::from(fd);
        let actual = file
            .metadata()
            .map_err(|e| Error::Io(format!("fstat of the pool fd: {e}")))?
            .len();
        if actual < len {
            return Err(Error::Protocol(format!(
                "the pool fd holds {actual} bytes, the daemon announced {len}"
            )));
        }
        let len = usize::try_from(len)
            .map_err(|_| Error::Io("pool larger than this address space".into()))?;
        let mut opts = MmapOptions::new();
        opts.len(len);
        if populate {
            opts.populate();
        }
        let map = opts
            .map_raw(&file)
            .map_err(|e| Error::Io(format!("mapping the pool ({len} bytes): {e}")))?;
        Ok(PoolMapping { map, len })
    }

    /// The mapping's length.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn check(&self, offset: u64, len: usize) -> Result<usize> {
        let off = usize::try_from(offset).map_err(|_| out_of_pool(offset, len, self.len))?;
        match off.checked_add(len) {
            Some(end) if end <= self.len => Ok(off),
            _ => Err(out_of_pool(offset, len, self.len)),
        }
    }

    /// Shared view of `len` bytes at `offset`.
    ///
    /// # Safety
    /// Nobody may write the range while the slice lives: the caller holds a pin on a SEALED or
    /// PUBLISHED block whose page contains it.
    pub(crate) unsafe fn bytes(&self, offset: u64, len: usize) -> Result<&[u8]> {
        let off = self.check(offset, len)?;
        // SAFETY: in bounds (checked), mapped while `self` lives; immutable while pinned
        // (caller's contract).
        Ok(unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(off), len) })
    }

    /// Exclusive view of `len` bytes at `offset`.
    ///
    /// # Safety
    /// The caller's session must own the block whose page contains the range, in WRITING, and
    /// no other slice of the range may be alive in this process.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn bytes_mut(&self, offset: u64, len: usize) -> Result<&mut [u8]> {
        let off = self.check(offset, len)?;
        // SAFETY: in bounds (checked), mapped writable while `self` lives; exclusive (caller's
        // contract, enforced by the store's ownership of WRITING blocks).
        Ok(unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(off), len) })
    }
}

fn out_of_pool(offset: u64, len: usize, pool: usize) -> Error {
    Error::InvalidArgument(format!(
        "range {offset}+{len} lies outside the {pool}-byte pool"
    ))
}
