//! The shared memory region: one memfd, mapped once, carved into fixed-size pages.
//!
//! memfd rather than anonymous memory because the daemon hands the region's file descriptor to
//! engine processes on the node (SCM_RIGHTS), which map the same pages and write KV bytes into
//! them directly. The whole region is populated at start-up, so the hot path never faults or
//! calls into the kernel.
//!
//! All of the pool's `unsafe` lives in this file: creating the mapping, and handing out page
//! slices whose exclusivity the block store's state machine guarantees.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd};

use memmap2::{MmapOptions, MmapRaw};
use rustix::fs::MemfdFlags;

use crate::{Error, Result};

/// Whether to back the region with huge pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum HugePages {
    /// Normal 4 KiB pages.
    Off,
    /// Try explicit huge pages (MFD_HUGETLB), then transparent huge pages, then normal pages.
    #[default]
    Try,
    /// Explicit huge pages or fail.
    Require,
}

/// What backs the region, as it turned out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Backing {
    /// Explicit 2 MiB huge pages (hugetlbfs).
    HugeTlb,
    /// Normal pages with a transparent-huge-page hint.
    Normal,
}

/// A memfd-backed, populated, shared mapping.
#[derive(Debug)]
pub struct Region {
    file: File,
    map: MmapRaw,
    len: usize,
    backing: Backing,
}

const HUGE_PAGE_BYTES: usize = 2 * 1024 * 1024;

impl Region {
    /// Create and populate a region of `len` bytes.
    ///
    /// # Errors
    /// [`Error::Io`] if the memfd cannot be created, sized or mapped (for example when the
    /// memory limit is lower than `len`), or [`Error::InvalidArgument`] for a zero length.
    pub fn new(len: usize, huge: HugePages) -> Result<Region> {
        if len == 0 {
            return Err(Error::InvalidArgument("pool size must be > 0".into()));
        }
        if huge != HugePages::Off && len % HUGE_PAGE_BYTES == 0 {
            match Self::create(len, true) {
                Ok(r) => return Ok(r),
                Err(e) if huge == HugePages::Require => {
                    return Err(Error::Io(format!(
                        "huge pages required but unavailable ({e}); reserve them with \
                         `sysctl vm.nr_hugepages=N` or start with huge pages off"
                    )));
                }
                Err(_) => {}
            }
        } else if huge == HugePages::Require {
            return Err(Error::InvalidArgument(format!(
                "huge pages required, but the pool size {len} is not a multiple of 2 MiB"
            )));
        }
        Self::create(len, false)
    }

    fn create(len: usize, hugetlb: bool) -> Result<Region> {
        let mut flags = MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING;
        if hugetlb {
            flags |= MemfdFlags::HUGETLB;
        }
        let fd = rustix::fs::memfd_create("kvd-pool", flags)
            .map_err(|e| Error::Io(format!("memfd_create: {e}")))?;
        rustix::fs::ftruncate(&fd, len as u64)
            .map_err(|e| Error::Io(format!("sizing the pool to {len} bytes: {e}")))?;
        let file = File::from(fd);
        let map = MmapOptions::new()
            .len(len)
            .populate()
            .map_raw(&file)
            .map_err(|e| Error::Io(format!("mapping the pool ({len} bytes): {e}")))?;
        let backing = if hugetlb {
            Backing::HugeTlb
        } else {
            // A hint only: shmem THP depends on the system's setting. Failure is harmless.
            let _ = map.advise(memmap2::Advice::HugePage);
            Backing::Normal
        };
        // Touch every page so that the first write on the hot path does not fault.
        let page = 4096;
        let base = map.as_mut_ptr();
        let mut off = 0;
        while off < len {
            // SAFETY: `off < len` and the mapping is `len` bytes long, writable and ours alone
            // (nobody else has the fd yet).
            unsafe { base.add(off).write_volatile(0) };
            off += if hugetlb { HUGE_PAGE_BYTES } else { page };
        }
        Ok(Region {
            file,
            map,
            len,
            backing,
        })
    }

    /// The region's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a region has at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// What backs the region.
    pub fn backing(&self) -> Backing {
        self.backing
    }

    /// The memfd, to pass to another process.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    fn check(&self, offset: usize, len: usize) {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            "range {offset}+{len} outside the {}-byte region",
            self.len
        );
    }

    /// A shared view of `len` bytes at `offset`.
    ///
    /// # Safety
    /// Nobody may write these bytes while the slice lives. The block store guarantees this for
    /// SEALED and later blocks (immutable) that are pinned or marked in-use by the caller.
    ///
    /// # Panics
    /// If the range is outside the region.
    pub(crate) unsafe fn bytes(&self, offset: usize, len: usize) -> &[u8] {
        self.check(offset, len);
        // SAFETY: in bounds (checked), mapped for the region's lifetime; no writer (caller's
        // contract).
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(offset), len) }
    }

    /// An exclusive view of `len` bytes at `offset`.
    ///
    /// # Safety
    /// The caller must be the only one to access these bytes while the slice lives. The block
    /// store guarantees this for a block in ALLOCATED/WRITING owned by the caller's session,
    /// with the store's in-use mark held.
    ///
    /// # Panics
    /// If the range is outside the region.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn bytes_mut(&self, offset: usize, len: usize) -> &mut [u8] {
        self.check(offset, len);
        // SAFETY: in bounds (checked), mapped for the region's lifetime; exclusive (caller's
        // contract).
        unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(offset), len) }
    }
}
