//! The page-generation table: one 64-bit word per page of a [`super::SharedRegion`], in a memfd
//! of its own that its creator can write and everyone else can only read.
//!
//! The creator (the daemon) records in each page's word who occupies the page: the occupant's
//! generation `g` (a number that never repeats for that page) while it holds the page, and a
//! different word once it has left. Readers in other processes that copy bytes out of the page
//! without asking the creator (zero-copy views) use the word seqlock-style: read it before, copy
//! or look at the bytes, read it again after; if it no longer names the occupant they expected,
//! the page moved on while they looked and the bytes are not theirs to trust.
//!
//! ```text
//! word = 2g      page held by occupant g
//! word = 2g + 1  occupant g has left (the page is free or about to be handed on)
//! ```
//!
//! The creator changes a page's word (release ordering) *before* it hands the page to anyone
//! else, so a reader that still sees `2g` after its copy (acquire fence, then the load) copied
//! bytes that occupant `g` owned. Words only grow for a page (generations increase).
//!
//! The table's memfd is sealed with `F_SEAL_FUTURE_WRITE` (plus no grow, no shrink, no further
//! seals) right after the creator mapped it writable: its own mapping stays writable, and any
//! later attempt to map it writable or `write(2)` it fails, in every process. A reader's mapping
//! is `PROT_READ`. So a buggy or hostile client cannot forge a page's word.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering, fence};

use memmap2::{MmapOptions, MmapRaw};
use rustix::fs::{MemfdFlags, SealFlags};

use crate::error::{Error, Result};

/// Bytes per page word.
pub const WORD_BYTES: usize = 8;

/// A page-generation table, as its creator (writable) or a reader (read-only) maps it.
#[derive(Debug)]
pub struct PageGenerations {
    file: File,
    map: MmapRaw,
    pages: u32,
    writable: bool,
}

impl PageGenerations {
    /// Create a table of `pages` words (all 0: no occupant yet), map it writable, then seal it
    /// so that nobody else ever can.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for zero pages; [`Error::Io`] if the memfd cannot be created,
    /// mapped or sealed (sealing needs Linux 5.1 for `F_SEAL_FUTURE_WRITE`).
    pub fn create(name: &str, pages: u32) -> Result<PageGenerations> {
        if pages == 0 {
            return Err(Error::InvalidArgument("a table of zero pages".into()));
        }
        let len = pages as usize * WORD_BYTES;
        let (file, map) = super::region::memfd_mapped(
            name,
            len,
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )?;
        rustix::fs::fcntl_add_seals(
            &file,
            SealFlags::FUTURE_WRITE | SealFlags::GROW | SealFlags::SHRINK | SealFlags::SEAL,
        )
        .map_err(|e| {
            Error::Io(format!(
                "sealing the page table (F_SEAL_FUTURE_WRITE needs Linux 5.1): {e}"
            ))
        })?;
        Ok(PageGenerations {
            file,
            map,
            pages,
            writable: true,
        })
    }

    /// Map a table another process created, read-only.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the fd holds fewer than `pages` words; [`Error::Io`] when
    /// it cannot be mapped.
    pub fn map_read_only(fd: OwnedFd, pages: u32) -> Result<PageGenerations> {
        let file = File::from(fd);
        let len = pages as usize * WORD_BYTES;
        let actual = file
            .metadata()
            .map_err(|e| Error::Io(format!("fstat of the page table's fd: {e}")))?
            .len();
        if pages == 0 || actual < len as u64 {
            return Err(Error::InvalidArgument(format!(
                "the page table's fd holds {actual} bytes, {pages} pages need {len}"
            )));
        }
        let map = MmapOptions::new()
            .len(len)
            .map_raw_read_only(&file)
            .map_err(|e| Error::Io(format!("mapping the page table: {e}")))?;
        Ok(PageGenerations {
            file,
            map,
            pages,
            writable: false,
        })
    }

    /// The table's memfd, to pass to readers.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// Pages in the table.
    pub fn pages(&self) -> u32 {
        self.pages
    }

    fn word(&self, page: u32) -> Option<&AtomicU64> {
        if page >= self.pages {
            return None;
        }
        // SAFETY: `page < pages`, the mapping holds `pages` 8-byte words and is page-aligned
        // (so every word is aligned for AtomicU64); it lives as long as `self`. Other processes
        // access the words only atomically (the creator's stores, readers' loads).
        Some(unsafe { &*(self.map.as_ptr() as *const AtomicU64).add(page as usize) })
    }

    fn store(&self, page: u32, word: u64) {
        assert!(self.writable, "only the table's creator writes it");
        self.word(page)
            .expect("the creator names only its own pages")
            .store(word, Ordering::Release);
    }

    /// Record that `page` is now held by occupant `generation`. Call before handing the page to
    /// it.
    ///
    /// # Panics
    /// On a read-only table, or a page out of range.
    pub fn mark_occupied(&self, page: u32, generation: u64) {
        self.store(page, generation << 1);
    }

    /// Record that occupant `generation` has left `page`. Call before the page can be handed to
    /// anyone else.
    ///
    /// # Panics
    /// On a read-only table, or a page out of range.
    pub fn mark_vacated(&self, page: u32, generation: u64) {
        self.store(page, (generation << 1) | 1);
    }

    /// The page's occupant now, `None` when it has none (or the page is out of range). Take it
    /// before looking at the page's bytes.
    pub fn occupant(&self, page: u32) -> Option<u64> {
        let w = self.word(page)?.load(Ordering::Acquire);
        (w & 1 == 0 && w != 0).then_some(w >> 1)
    }

    /// After looking at the page's bytes: whether occupant `generation` still held the page
    /// throughout (its word never changed, since words only grow).
    pub fn still_held(&self, page: u32, generation: u64) -> bool {
        // The bytes were read before this point; keep the word's load after them.
        fence(Ordering::Acquire);
        self.word(page)
            .is_some_and(|w| w.load(Ordering::Relaxed) == generation << 1)
    }

    /// The raw word of `page`, for diagnostics.
    pub fn raw(&self, page: u32) -> Option<u64> {
        self.word(page).map(|w| w.load(Ordering::Acquire))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reader_sees_the_creators_words_and_knows_when_a_page_moved_on() {
        let t = PageGenerations::create("test-pages", 4).unwrap();
        let r = PageGenerations::map_read_only(t.fd().try_clone_to_owned().unwrap(), 4).unwrap();
        assert_eq!(r.occupant(2), None, "no occupant yet");
        t.mark_occupied(2, 7);
        assert_eq!(r.occupant(2), Some(7));
        assert!(r.still_held(2, 7));
        t.mark_vacated(2, 7);
        assert_eq!(r.occupant(2), None);
        assert!(!r.still_held(2, 7));
        t.mark_occupied(2, 9);
        assert!(!r.still_held(2, 7), "a new occupant is not the old one");
        assert_eq!(r.occupant(9), None, "out of range");
    }

    #[test]
    fn nobody_but_the_creator_can_map_the_table_writable_or_write_it() {
        let t = PageGenerations::create("test-pages", 16).unwrap();
        let fd = t.fd().try_clone_to_owned().unwrap();
        let file = File::from(fd);
        let e = MmapOptions::new().len(128).map_raw(&file).unwrap_err();
        assert_eq!(
            e.raw_os_error(),
            Some(rustix::io::Errno::PERM.raw_os_error()),
            "{e}"
        );
        let e = rustix::io::pwrite(&file, &[1u8; 8], 0).unwrap_err();
        assert_eq!(e, rustix::io::Errno::PERM);
        let e = rustix::fs::ftruncate(&file, 0).unwrap_err();
        assert_eq!(e, rustix::io::Errno::PERM);
    }

    #[test]
    #[should_panic(expected = "only the table's creator writes it")]
    fn a_reader_cannot_store() {
        let t = PageGenerations::create("test-pages", 1).unwrap();
        let r = PageGenerations::map_read_only(t.fd().try_clone_to_owned().unwrap(), 1).unwrap();
        r.mark_occupied(0, 1);
    }
}
