//! The shared memory region: one memfd, mapped shared by the daemon that creates it and by every
//! engine process that receives its file descriptor.
//!
//! memfd rather than anonymous memory because the region is handed to engine processes on the
//! node (SCM_RIGHTS), which map the same pages and copy KV bytes into and out of them directly.
//! The creator populates the whole region at start-up, so the hot path never faults or calls
//! into the kernel.
//!
//! One type serves both sides: [`SharedRegion::create`] (the daemon) and
//! [`SharedRegion::map_fd`] (a client). Every access names an offset and a length and is checked
//! against the region's bounds ([`Error::OutOfRange`], nothing touched); *which* bytes a process
//! may touch when is the caller's to decide (the block store's state machine), and is the
//! contract of the `unsafe` accessors. All of the region's `unsafe` lives in this file.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use memmap2::{MmapOptions, MmapRaw};
use rustix::fs::MemfdFlags;

use crate::error::{Error, Result};

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
    /// Normal pages (with a transparent-huge-page hint where the creator asked for huge pages).
    Normal,
}

/// A memfd-backed shared mapping.
#[derive(Debug)]
pub struct SharedRegion {
    file: File,
    map: MmapRaw,
    len: usize,
    backing: Backing,
}

const HUGE_PAGE_BYTES: usize = 2 * 1024 * 1024;

impl SharedRegion {
    /// Create and populate a region of `len` bytes, named `name` (as `/proc/PID/fd` shows it).
    ///
    /// # Errors
    /// [`Error::Io`] if the memfd cannot be created, sized or mapped (for example when the
    /// memory limit is lower than `len`), or when huge pages are required and unavailable;
    /// [`Error::InvalidArgument`] for a zero length.
    pub fn create(name: &str, len: usize, huge: HugePages) -> Result<SharedRegion> {
        if len == 0 {
            return Err(Error::InvalidArgument("a region needs > 0 bytes".into()));
        }
        if huge != HugePages::Off && len % HUGE_PAGE_BYTES == 0 {
            match Self::create_backed(name, len, true) {
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
                "huge pages required, but the size {len} is not a multiple of 2 MiB"
            )));
        }
        Self::create_backed(name, len, false)
    }

    fn create_backed(name: &str, len: usize, hugetlb: bool) -> Result<SharedRegion> {
        let mut flags = MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING;
        if hugetlb {
            flags |= MemfdFlags::HUGETLB;
        }
        let (file, map) = memfd_mapped(name, len, flags)?;
        let backing = if hugetlb {
            Backing::HugeTlb
        } else {
            // A hint only: shmem THP depends on the system's setting. Failure is harmless.
            let _ = map.advise(memmap2::Advice::HugePage);
            Backing::Normal
        };
        // Touch every page so that the first write on the hot path does not fault.
        let step = if hugetlb { HUGE_PAGE_BYTES } else { 4096 };
        let base = map.as_mut_ptr();
        let mut off = 0;
        while off < len {
            // SAFETY: `off < len` and the mapping is `len` bytes long, writable and ours alone
            // (nobody else has the fd yet).
            unsafe { base.add(off).write_volatile(0) };
            off += step;
        }
        Ok(SharedRegion {
            file,
            map,
            len,
            backing,
        })
    }

    /// Map `len` bytes of a region another process created, shared and read-write.
    /// `populate` pre-faults the page tables so the first copy into a page does not fault
    /// (costs time proportional to the region at connect).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the fd holds fewer than `len` bytes; [`Error::Io`] when
    /// it cannot be mapped.
    pub fn map_fd(fd: OwnedFd, len: u64, populate: bool) -> Result<SharedRegion> {
        let file = File::from(fd);
        let actual = file
            .metadata()
            .map_err(|e| Error::Io(format!("fstat of the region's fd: {e}")))?
            .len();
        if actual < len || len == 0 {
            return Err(Error::InvalidArgument(format!(
                "the region's fd holds {actual} bytes, {len} were announced"
            )));
        }
        let len = usize::try_from(len)
            .map_err(|_| Error::InvalidArgument("region larger than this address space".into()))?;
        let mut opts = MmapOptions::new();
        opts.len(len);
        if populate {
            opts.populate();
        }
        let map = opts
            .map_raw(&file)
            .map_err(|e| Error::Io(format!("mapping the region ({len} bytes): {e}")))?;
        Ok(SharedRegion {
            file,
            map,
            len,
            backing: Backing::Normal,
        })
    }

    /// The first byte of the mapping (for the transfer engine, which checks every range
    /// against [`SharedRegion::len`] before it forms a pointer into it).
    pub fn base_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// The region's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a region has at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// What backs the region (as created; a mapping of a received fd says `Normal`).
    pub fn backing(&self) -> Backing {
        self.backing
    }

    /// The memfd, to pass to another process or to seal.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// Check that `offset..offset+len` lies in the region; the start as an index.
    ///
    /// # Errors
    /// [`Error::OutOfRange`].
    pub fn check(&self, offset: u64, len: usize) -> Result<usize> {
        let out = || Error::OutOfRange {
            offset,
            len: len as u64,
            region_len: self.len as u64,
        };
        let off = usize::try_from(offset).map_err(|_| out())?;
        match off.checked_add(len) {
            Some(end) if end <= self.len => Ok(off),
            _ => Err(out()),
        }
    }

    /// A shared view of `len` bytes at `offset`.
    ///
    /// # Safety
    /// Nobody may write these bytes while the slice lives, in this process or another (the
    /// block store guarantees it for a SEALED or later block that is pinned or marked in use;
    /// a view held past its pin must be checked against the page-generation table before its
    /// bytes are trusted, see [`super::PageGenerations`]).
    ///
    /// # Errors
    /// [`Error::OutOfRange`].
    pub unsafe fn bytes(&self, offset: u64, len: usize) -> Result<&[u8]> {
        let off = self.check(offset, len)?;
        // SAFETY: in bounds (checked) and mapped for the region's lifetime; no writer (the
        // caller's contract).
        Ok(unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(off), len) })
    }

    /// An exclusive view of `len` bytes at `offset`.
    ///
    /// # Safety
    /// The caller must be the only one to access these bytes while the slice lives, in this
    /// process or another (the block store guarantees it for a block in ALLOCATED/WRITING owned
    /// by the caller's session).
    ///
    /// # Errors
    /// [`Error::OutOfRange`].
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, offset: u64, len: usize) -> Result<&mut [u8]> {
        let off = self.check(offset, len)?;
        // SAFETY: in bounds (checked) and mapped writable for the region's lifetime; exclusive
        // (the caller's contract).
        Ok(unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(off), len) })
    }

    /// Copy `data` into the region at `offset` (non-temporal stores for large copies). With
    /// `crc = Some(c)`, the CRC-32C of `data` is computed in the same pass, continuing from `c`,
    /// and returned.
    ///
    /// # Safety
    /// As [`SharedRegion::bytes_mut`] for the range written.
    ///
    /// # Errors
    /// [`Error::OutOfRange`]; nothing is written then.
    pub unsafe fn copy_in(
        &self,
        offset: u64,
        data: &[u8],
        crc: Option<u32>,
    ) -> Result<Option<u32>> {
        // SAFETY: the caller's contract, passed on.
        let dst = unsafe { self.bytes_mut(offset, data.len())? };
        Ok(match crc {
            Some(c) => Some(super::copy_with_crc32c(dst, data, c)),
            None => {
                super::copy(dst, data);
                None
            }
        })
    }

    /// Copy `dst.len()` bytes at `offset` out of the region into `dst`. With `verify`, the
    /// CRC-32C of the bytes is computed in the same pass and returned, for the caller to compare
    /// with the one it expects.
    ///
    /// # Safety
    /// As [`SharedRegion::bytes`] for the range read.
    ///
    /// # Errors
    /// [`Error::OutOfRange`]; nothing is read then.
    pub unsafe fn copy_out(
        &self,
        offset: u64,
        dst: &mut [u8],
        verify: bool,
    ) -> Result<Option<u32>> {
        // SAFETY: the caller's contract, passed on.
        let src = unsafe { self.bytes(offset, dst.len())? };
        Ok(if verify {
            Some(super::copy_with_crc32c(dst, src, 0))
        } else {
            super::copy(dst, src);
            None
        })
    }

    /// The CRC-32C of `len` bytes at `offset`, in place.
    ///
    /// # Safety
    /// As [`SharedRegion::bytes`] for the range read.
    ///
    /// # Errors
    /// [`Error::OutOfRange`].
    pub unsafe fn crc32c(&self, offset: u64, len: usize) -> Result<u32> {
        // SAFETY: the caller's contract, passed on.
        Ok(super::crc32c(0, unsafe { self.bytes(offset, len)? }))
    }
}

/// A sealable memfd of `len` bytes named `name`, and its populated shared writable mapping.
pub(super) fn memfd_mapped(name: &str, len: usize, flags: MemfdFlags) -> Result<(File, MmapRaw)> {
    let fd = rustix::fs::memfd_create(name, flags)
        .map_err(|e| Error::Io(format!("memfd_create {name}: {e}")))?;
    rustix::fs::ftruncate(&fd, len as u64)
        .map_err(|e| Error::Io(format!("sizing {name} to {len} bytes: {e}")))?;
    let file = File::from(fd);
    let map = MmapOptions::new()
        .len(len)
        .populate()
        .map_raw(&file)
        .map_err(|e| Error::Io(format!("mapping {name} ({len} bytes): {e}")))?;
    Ok((file, map))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_mapping_of_the_fd_sees_the_same_bytes() {
        let r = SharedRegion::create("test-region", 1 << 20, HugePages::Off).unwrap();
        let other =
            SharedRegion::map_fd(r.fd().try_clone_to_owned().unwrap(), 1 << 20, false).unwrap();
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
        // SAFETY: the test is the only user of the region.
        let crc = unsafe { r.copy_in(4096, &data, Some(0)).unwrap().unwrap() };
        let mut back = vec![0u8; data.len()];
        // SAFETY: as above.
        let found = unsafe { other.copy_out(4096, &mut back, true).unwrap().unwrap() };
        assert_eq!(back, data);
        assert_eq!(found, crc);
        assert_eq!(crc, super::super::crc32c(0, &data));
    }

    #[test]
    fn a_range_outside_the_region_is_refused_and_touches_nothing() {
        let r = SharedRegion::create("test-region", 8192, HugePages::Off).unwrap();
        for (off, len) in [(8192, 1), (8000, 193), (u64::MAX, 2), (0, 8193)] {
            let e = r.check(off, len).unwrap_err();
            assert!(matches!(e, Error::OutOfRange { .. }), "{e}");
            // SAFETY: nothing else uses the region.
            assert!(unsafe { r.copy_in(off, &vec![1u8; len], None) }.is_err());
        }
        let mut all = vec![9u8; 8192];
        // SAFETY: as above.
        unsafe { r.copy_out(0, &mut all, false).unwrap() };
        assert!(all.iter().all(|&b| b == 0), "a refused copy wrote nothing");
    }

    #[test]
    fn a_fd_shorter_than_announced_is_refused() {
        let r = SharedRegion::create("test-region", 4096, HugePages::Off).unwrap();
        let e =
            SharedRegion::map_fd(r.fd().try_clone_to_owned().unwrap(), 8192, false).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    }
}
