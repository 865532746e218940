//! The page pool: a [`SharedRegion`] carved into `page_count` pages of `page_size_bytes`, with
//! an O(1) free list, and the [`PageGenerations`] table beside it (one word per page, shared
//! read-only with clients). Allocation and free are a `Vec` pop and push; nothing touches the OS
//! after start-up.
//!
//! The pool knows nothing about blocks; the store decides which page holds what, and records it
//! in the page-generation table before a page changes hands.

use std::sync::Arc;

pub use transport::local::{Backing, HugePages, PageGenerations, SharedRegion};

use crate::{Error, Result};

/// The smallest page the pool accepts.
pub const MIN_PAGE_BYTES: u64 = 4096;

/// Geometry of a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PoolConfig {
    /// Bytes per page: one KV block (for example 16 tokens × 160 KiB = 2.5 MiB for Qwen3-14B).
    pub page_size_bytes: u64,
    /// Number of pages.
    pub page_count: u32,
    /// Huge-page backing.
    pub huge_pages: HugePages,
}

impl PoolConfig {
    /// A pool of `total_bytes` (rounded down to whole pages) in pages of `page_size_bytes`.
    pub fn with_total(page_size_bytes: u64, total_bytes: u64) -> PoolConfig {
        PoolConfig {
            page_size_bytes,
            page_count: (total_bytes / page_size_bytes.max(1)).min(u32::MAX as u64) as u32,
            huge_pages: HugePages::Try,
        }
    }

    /// The region's size.
    pub fn total_bytes(&self) -> u64 {
        self.page_size_bytes * self.page_count as u64
    }
}

/// Pages and their free list.
#[derive(Debug)]
pub struct Pool {
    region: Arc<SharedRegion>,
    generations: Arc<PageGenerations>,
    config: PoolConfig,
    free: Vec<u32>,
}

impl Pool {
    /// Map and populate the pool.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a page smaller than 4 KiB or not a multiple of 4 KiB, or
    /// zero pages; [`Error::Io`] if the memory cannot be had.
    pub fn new(config: PoolConfig) -> Result<Pool> {
        if config.page_size_bytes < MIN_PAGE_BYTES || config.page_size_bytes % MIN_PAGE_BYTES != 0 {
            return Err(Error::InvalidArgument(format!(
                "page size {} must be a multiple of {MIN_PAGE_BYTES} bytes",
                config.page_size_bytes
            )));
        }
        if config.page_count == 0 {
            return Err(Error::InvalidArgument(
                "the pool needs at least one page; raise the pool size".into(),
            ));
        }
        let total = usize::try_from(config.total_bytes())
            .map_err(|_| Error::InvalidArgument("pool too large for this machine".into()))?;
        let region = Arc::new(SharedRegion::create("kvd-pool", total, config.huge_pages)?);
        let generations = Arc::new(PageGenerations::create("kvd-pages", config.page_count)?);
        // Pop from the end: hand out low pages first.
        let free = (0..config.page_count).rev().collect();
        Ok(Pool {
            region,
            generations,
            config,
            free,
        })
    }

    /// The pool's geometry.
    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// The shared region.
    pub fn region(&self) -> &SharedRegion {
        &self.region
    }

    /// A shared reference to the region, for copies that run without the store's lock.
    pub fn shared_region(&self) -> Arc<SharedRegion> {
        self.region.clone()
    }

    /// The page-generation table.
    pub fn page_table(&self) -> &PageGenerations {
        &self.generations
    }

    /// A shared reference to the page-generation table.
    pub fn generations(&self) -> Arc<PageGenerations> {
        self.generations.clone()
    }

    /// Free pages.
    pub fn free_pages(&self) -> u32 {
        self.free.len() as u32
    }

    /// Take a free page, or `None` when the pool is full. O(1).
    pub fn alloc(&mut self) -> Option<u32> {
        self.free.pop()
    }

    /// Return a page. O(1).
    ///
    /// # Panics
    /// If `page` is out of range (a store bug; a double free is caught by the store's
    /// accounting, not here).
    pub fn free(&mut self, page: u32) {
        assert!(page < self.config.page_count, "page {page} out of range");
        debug_assert!(self.free.len() < self.config.page_count as usize);
        self.free.push(page);
    }

    /// The byte offset of `page` in the region.
    pub fn page_offset(&self, page: u32) -> u64 {
        page as u64 * self.config.page_size_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small(pages: u32) -> Pool {
        Pool::new(PoolConfig {
            page_size_bytes: 4096,
            page_count: pages,
            huge_pages: HugePages::Off,
        })
        .unwrap()
    }

    #[test]
    fn every_page_is_handed_out_once_until_freed() {
        let mut p = small(8);
        let mut got: Vec<u32> = (0..8).map(|_| p.alloc().unwrap()).collect();
        assert!(p.alloc().is_none());
        got.sort();
        assert_eq!(got, (0..8).collect::<Vec<_>>());
        p.free(3);
        assert_eq!(p.alloc(), Some(3));
    }

    #[test]
    fn a_bad_geometry_is_refused_with_a_clear_error() {
        for (size, count) in [(100u64, 4u32), (4096 + 1, 4), (4096, 0)] {
            let e = Pool::new(PoolConfig {
                page_size_bytes: size,
                page_count: count,
                huge_pages: HugePages::Off,
            })
            .unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        }
    }

    #[test]
    fn huge_pages_fall_back_cleanly_when_not_reserved() {
        // With `Try`, the pool works whether or not the machine has huge pages reserved.
        let p = Pool::new(PoolConfig {
            page_size_bytes: 2 * 1024 * 1024,
            page_count: 2,
            huge_pages: HugePages::Try,
        })
        .unwrap();
        assert_eq!(p.region().len(), 4 * 1024 * 1024);
    }

    #[test]
    fn the_region_is_a_shareable_memfd() {
        let p = small(2);
        let path = format!(
            "/proc/self/fd/{}",
            std::os::fd::AsRawFd::as_raw_fd(&p.region().fd())
        );
        let target = std::fs::read_link(path).unwrap();
        assert!(
            target.to_string_lossy().contains("memfd:kvd-pool"),
            "{target:?}"
        );
    }
}
