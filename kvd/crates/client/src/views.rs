//! What the client may touch in the mapped pool, and how it knows the bytes are still its own.
//!
//! The client keeps a table of the blocks its session holds: allocated and not yet sealed
//! (writable, up to the page's capacity) and pinned (readable, up to the block's length, until
//! the pin's deadline). Every copy names a handle and an offset and is checked against that
//! table and the mapping's bounds first; anything else is `InvalidArgument` before a byte moves.
//!
//! A pin is the daemon's promise that the block's page is not reused, and the daemon keeps it
//! only until the pin's TTL or the session's lease runs out. A reader can hold bytes of the
//! mapping longer than that (a zero-copy view kept across a layer load, a thread that stalls),
//! and then the page may hold another block. The daemon's page-generation table tells: one word
//! per page that names the page's occupant, changed by the daemon before the page changes hands,
//! mapped read-only here. So every read is bracketed by it, seqlock-style:
//!
//! - [`Client::read`] and [`Client::read_verified`] check that the page holds the block before
//!   the copy and still held it after; otherwise `StaleGeneration`, and the bytes copied are not
//!   the block's (`read_verified` also keeps its checksum).
//! - [`Client::block`] returns a [`BlockView`] guard: use [`BlockView::bytes`], then ask
//!   [`BlockView::still_valid`]; only when it answers `Ok` were the bytes the block's
//!   throughout. [`Client::with_block`] does both around a closure.
//! - A pin past its deadline (the TTL the daemon granted, counted from before the request was
//!   sent) is refused outright (`LeaseExpired`): acquire the block again.
//!
//! ## The contract, for every caller (mirrored in `kvd.h`)
//!
//! 1. Take a view only of a block you pinned, and use it before the pin's TTL.
//! 2. After using the bytes (copying them to a GPU, hashing them, comparing them), ask whether
//!    the view is still valid. If it is not, discard whatever you derived from the bytes: treat
//!    the block as a miss and look it up again. Bytes seen through a stale view may be torn or
//!    another block's.
//! 3. Never write through a read view; write only blocks you allocated, before sealing them.
//!
//! The check costs two loads of one shared word per view, no system call.

use std::time::{Duration, Instant};

use kvd_core::error::Corruption;
use kvd_core::protocol::Op;
use kvd_core::types::{BlockInfo, Handle};
use kvd_core::{Error, Result};
use transport::local::PageGenerations;

use crate::{Client, each};

/// A block this session is writing.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Writable {
    pub(crate) offset: u64,
    pub(crate) capacity: u64,
}

/// A block this session pins.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Readable {
    offset: u64,
    len: u64,
    checksum: u32,
    pins: u32,
    /// The latest deadline of this session's pins on the block.
    deadline: Instant,
}

/// A zero-copy view of a pinned block's bytes in the pool. Its bytes are the block's only if
/// [`BlockView::still_valid`] answers `Ok` after they were used; see the module docs.
#[derive(Debug)]
pub struct BlockView<'a> {
    bytes: &'a [u8],
    pages: &'a PageGenerations,
    handle: Handle,
    node_generation: u64,
}

impl<'a> BlockView<'a> {
    /// The block's bytes, in place in the pool.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// The block this view shows.
    pub fn handle(&self) -> Handle {
        self.handle
    }

    /// Whether the page held the block from when the view was taken until now.
    ///
    /// # Errors
    /// [`Error::StaleGeneration`] when the page moved on (the pin expired and the page was
    /// reused, or the block was freed): whatever was derived from [`BlockView::bytes`] must be
    /// discarded.
    pub fn still_valid(&self) -> Result<()> {
        check_held(self.pages, &self.handle, self.node_generation)
    }
}

/// Whether `h`'s page holds `h`'s block now (after an acquire fence, so that reads of its bytes
/// before this call are ordered before the check).
fn check_held(pages: &PageGenerations, h: &Handle, node_generation: u64) -> Result<()> {
    // Block generations restart with every daemon incarnation: a handle from another one names
    // nothing in this page table, whatever its word says.
    if h.node_generation == node_generation && pages.still_held(h.slot, h.generation) {
        Ok(())
    } else {
        Err(Error::StaleGeneration {
            handle_node: h.node_generation,
            handle_slot: h.generation,
            current_node: node_generation,
            current_slot: pages.occupant(h.slot).unwrap_or(0),
        })
    }
}

impl Client {
    pub(crate) fn note_pin(&mut self, b: &BlockInfo, sent_at: Instant) {
        let deadline = sent_at + Duration::from_millis(b.pin_ttl_ms);
        let e = self.readable.entry(b.handle).or_insert(Readable {
            offset: b.offset,
            len: b.len,
            checksum: b.checksum,
            pins: 0,
            deadline,
        });
        e.pins += 1;
        e.deadline = e.deadline.max(deadline);
    }

    /// One pin of `h` is gone (released, or refused as stale).
    pub(crate) fn forget_pin(&mut self, h: &Handle) {
        if let Some(e) = self.readable.get_mut(h) {
            e.pins -= 1;
            if e.pins == 0 {
                self.readable.remove(h);
            }
        }
    }

    fn writable_range(&self, h: &Handle, offset: u64, len: usize) -> Result<u64> {
        let w = self.writable.get(h).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "block {h:?} is not being written by this session (allocate it first; sealed \
                 blocks are immutable)"
            ))
        })?;
        if offset
            .checked_add(len as u64)
            .is_none_or(|end| end > w.capacity)
        {
            return Err(Error::InvalidArgument(format!(
                "write of {len} bytes at offset {offset} exceeds the {}-byte page",
                w.capacity
            )));
        }
        // The page must still be this block's (it is not when the session's lease ran out and
        // the daemon gave the page to someone else).
        self.held(h)?;
        Ok(w.offset + offset)
    }

    /// Check a read of `len` bytes at `offset` of pinned `h`: pinned, in range, before the pin's
    /// deadline, and the page holds the block now.
    fn readable_range(&self, h: &Handle, offset: u64, len: usize) -> Result<(u64, Readable)> {
        let r = self.readable.get(h).copied().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "block {h:?} is not pinned by this session: acquire it first"
            ))
        })?;
        if offset.checked_add(len as u64).is_none_or(|end| end > r.len) {
            return Err(Error::InvalidArgument(format!(
                "read of {len} bytes at offset {offset} exceeds the block's {} bytes",
                r.len
            )));
        }
        if Instant::now() >= r.deadline {
            return Err(Error::LeaseExpired(format!(
                "the pin on block {h:?} is past its TTL, so the daemon may have reused its page: \
                 acquire it again"
            )));
        }
        self.held(h)?;
        Ok((r.offset + offset, r))
    }

    pub(crate) fn held(&self, h: &Handle) -> Result<()> {
        check_held(&self.pages, h, self.welcome.node_generation)
    }

    /// Copy `data` into a block this session is writing, at `offset` within it (non-temporal
    /// stores for large copies).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the block is not being written by this session or the range
    /// leaves its page; [`Error::StaleGeneration`] if its page no longer holds it.
    pub fn write(&mut self, h: &Handle, offset: u64, data: &[u8]) -> Result<()> {
        self.ensure_mapping_usable()?;
        let at = self.writable_range(h, offset, data.len())?;
        // SAFETY: the block is WRITING and owned by this session (it is in `writable`, and its
        // page still holds it), so no other process touches its page; `&mut self` keeps other
        // slices of it out of this process.
        unsafe { self.pool.copy_in(at, data, None)? };
        Ok(())
    }

    /// As [`Client::write`], computing the CRC-32C of `data` in the same pass, continuing from
    /// `crc` (0 to start). Write a block front to back and pass the result to
    /// [`Client::seal`].
    pub fn write_with_crc(
        &mut self,
        h: &Handle,
        offset: u64,
        data: &[u8],
        crc: u32,
    ) -> Result<u32> {
        self.ensure_mapping_usable()?;
        let at = self.writable_range(h, offset, data.len())?;
        // SAFETY: as in `write`.
        let c = unsafe { self.pool.copy_in(at, data, Some(crc))? };
        Ok(c.expect("asked for a checksum"))
    }

    /// Copy bytes of a block this session pins, from `offset` within it, into `dst`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the block is not pinned by this session or the range leaves
    /// the block; [`Error::LeaseExpired`] past the pin's TTL; [`Error::StaleGeneration`] when
    /// the page did not hold the block throughout the copy (`dst` then holds no bytes of it).
    pub fn read(&self, h: &Handle, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.ensure_mapping_usable()?;
        let (at, _) = self.readable_range(h, offset, dst.len())?;
        // SAFETY: pinned by this session and SEALED or later: immutable while the pin holds; a
        // copy that outlived the pin is caught by the check below and its bytes disowned.
        unsafe { self.pool.copy_out(at, dst, false)? };
        self.held(h)
    }

    /// Copy a whole pinned block into `dst` (which must be at least its length) and check its
    /// checksum in the same pass. Returns the block's length.
    ///
    /// When the copy does not match the checksum recorded at SEAL (and the page held the block
    /// throughout), the client asks the daemon to check its own copy of the block (one more
    /// round trip, only then): the daemon quarantines the block if its copy fails too, and
    /// counts the report either way.
    ///
    /// # Errors
    /// [`Error::Corrupt`] on a mismatch (treat as a miss), whose `outcome` says whether the
    /// daemon quarantined the block ([`Corruption::Quarantined`]) or found its copy intact
    /// ([`Corruption::ReaderCopy`]); [`Error::StaleGeneration`], [`Error::LeaseExpired`] and
    /// [`Error::InvalidArgument`] as [`Client::read`].
    pub fn read_verified(&mut self, h: &Handle, dst: &mut [u8]) -> Result<u64> {
        self.ensure_mapping_usable()?;
        let len = self
            .readable
            .get(h)
            .map(|r| r.len)
            .ok_or_else(|| Error::InvalidArgument(format!("block {h:?} is not pinned")))?;
        let n = usize::try_from(len).map_err(|_| Error::InvalidArgument("block too big".into()))?;
        if dst.len() < n {
            return Err(Error::InvalidArgument(format!(
                "destination of {} bytes is smaller than the {n}-byte block",
                dst.len()
            )));
        }
        let (at, r) = self.readable_range(h, 0, n)?;
        // SAFETY: as in `read`.
        let found = unsafe { self.pool.copy_out(at, &mut dst[..n], true)? };
        self.held(h)?;
        let found = found.expect("asked for a checksum");
        if found != r.checksum {
            return Err(self.report_corrupt(h, r.checksum, found));
        }
        Ok(len)
    }

    /// Tell the daemon that this client's copy of `h` failed its checksum; the error to return.
    fn report_corrupt(&mut self, h: &Handle, expected: u32, found: u32) -> Error {
        let answer = self.call(Op::ReportCorrupt { handles: vec![*h] });
        let outcome = match answer.and_then(each).map(|mut v| v.pop()) {
            Ok(Some(Ok(()))) => Corruption::ReaderCopy,
            Ok(Some(Err(Error::Corrupt { .. }))) => Corruption::Quarantined,
            // The daemon could not check (the pin is gone, the connection failed): say that.
            Ok(Some(Err(e))) | Err(e) => return e,
            Ok(None) => return Error::Protocol("no answer item for the corrupt report".into()),
        };
        Error::Corrupt {
            expected,
            found,
            outcome,
        }
    }

    /// A zero-copy view of a pinned block's bytes, in place in the pool. Use its bytes, then
    /// ask [`BlockView::still_valid`] before trusting anything derived from them.
    ///
    /// # Errors
    /// As [`Client::read`] (checked when the view is taken).
    pub fn block(&self, h: &Handle) -> Result<BlockView<'_>> {
        self.ensure_mapping_usable()?;
        let len = self.readable.get(h).map_or(0, |r| r.len) as usize;
        let (at, _) = self.readable_range(h, 0, len)?;
        // SAFETY: pinned by this session and SEALED or later: immutable while the pin holds. The
        // view outliving the pin is the guard's to report (`still_valid`); the slice borrows
        // `self`, so the mapping outlives it.
        let bytes = unsafe { self.pool.bytes(at, len)? };
        Ok(BlockView {
            bytes,
            pages: &self.pages,
            handle: *h,
            node_generation: self.welcome.node_generation,
        })
    }

    /// Run `f` over a pinned block's bytes in place, and return its result only if the page
    /// held the block throughout.
    ///
    /// # Errors
    /// As [`Client::block`]; [`Error::StaleGeneration`] when the page moved on while `f` ran
    /// (its result is dropped).
    pub fn with_block<T>(&self, h: &Handle, f: impl FnOnce(&[u8]) -> T) -> Result<T> {
        let v = self.block(h)?;
        let out = f(v.bytes());
        v.still_valid()?;
        Ok(out)
    }

    /// A writable block's whole page, in place in the pool (no copy): for producers that fill
    /// it themselves (for example a DMA engine through a registered mapping).
    ///
    /// # Errors
    /// As [`Client::write`].
    pub fn block_mut(&mut self, h: &Handle) -> Result<&mut [u8]> {
        self.ensure_mapping_usable()?;
        let cap = self.writable.get(h).map_or(0, |w| w.capacity) as usize;
        let at = self.writable_range(h, 0, cap)?;
        // SAFETY: as in `write`; the slice borrows `self` mutably, so it is the only one.
        Ok(unsafe { self.pool.bytes_mut(at, cap)? })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle(slot: u32, generation: u64) -> Handle {
        Handle {
            node_generation: 7,
            slot,
            generation,
        }
    }

    #[test]
    fn a_page_that_moved_on_reports_the_stale_generation_and_its_new_occupant() {
        let daemon = PageGenerations::create("test-pages", 4).unwrap();
        let mine =
            PageGenerations::map_read_only(daemon.fd().try_clone_to_owned().unwrap(), 4).unwrap();
        daemon.mark_occupied(1, 10);
        check_held(&mine, &handle(1, 10), 7).unwrap();
        daemon.mark_vacated(1, 10);
        daemon.mark_occupied(1, 12);
        let e = check_held(&mine, &handle(1, 10), 7).unwrap_err();
        assert_eq!(
            e,
            Error::StaleGeneration {
                handle_node: 7,
                handle_slot: 10,
                current_node: 7,
                current_slot: 12,
            }
        );
        // A freed page has no occupant at all.
        daemon.mark_vacated(1, 12);
        assert!(matches!(
            check_held(&mine, &handle(1, 12), 7),
            Err(Error::StaleGeneration {
                current_slot: 0,
                ..
            })
        ));
    }

    #[test]
    fn a_handle_of_another_daemon_incarnation_is_never_held() {
        let daemon = PageGenerations::create("test-pages", 2).unwrap();
        daemon.mark_occupied(0, 1);
        check_held(&daemon, &handle(0, 1), 7).unwrap();
        assert!(matches!(
            check_held(&daemon, &handle(0, 1), 8),
            Err(Error::StaleGeneration {
                handle_node: 7,
                current_node: 8,
                ..
            })
        ));
    }

    #[test]
    fn a_handle_outside_the_table_is_never_held() {
        let daemon = PageGenerations::create("test-pages", 2).unwrap();
        assert!(check_held(&daemon, &handle(5, 1), 7).is_err());
    }
}
