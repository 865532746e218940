//! An existing mapping (the memfd pool) registered as pinned host memory, in chunks.
//!
//! The GPU's copy engines DMA only to and from pinned, device-mapped host pages; pageable
//! memory makes the driver stage every copy through a bounce buffer of its own (one more copy,
//! and no asynchrony). So the pool's mapping is registered with `cuMemHostRegister`
//! (`PORTABLE | DEVICEMAP`: usable from every context, mapped into the device's address space),
//! in place: the bytes stay in the memfd the daemon and every engine share, and stay cached
//! memory (a write-combined `cuMemHostAlloc` buffer would make every CPU read of the pool,
//! checksums and network sends included, an uncached read).
//!
//! One call per huge range is fragile (drivers have refused, or taken very long over, single
//! registrations of hundreds of GiB), so [`plan`] splits the range into page-aligned chunks of
//! at most [`MAX_CHUNK_BYTES`], registered one after the other. All or nothing: when chunk
//! *k* fails, chunks *k − 1* … 0 are unregistered before the error returns. Dropping the
//! registration waits for its copies in flight, then unregisters every chunk.

use std::sync::{Arc, Mutex};

use crate::cuda::copy::EventTable;
use crate::cuda::driver::Driver;
use crate::{Error, Result};

/// The largest chunk one `cuMemHostRegister` call covers: 64 GiB.
pub const MAX_CHUNK_BYTES: usize = 64 << 30;

/// The most chunks one registration is split into (with [`MAX_CHUNK_BYTES`]: 256 TiB).
pub const MAX_CHUNKS: usize = 4096;

/// One registered piece of the mapping: `len` bytes at `offset` from its base.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// Where the chunk starts, from the mapping's base (a multiple of the page size).
    pub offset: usize,
    /// Its length (a multiple of the page size).
    pub len: usize,
}

/// Split `[base, base + len)` into chunks of at most `max_chunk_bytes`, each starting on a page
/// boundary; the last ends at `base + len` rounded up to a page (a mapping covers whole pages).
///
/// # Errors
/// [`Error::InvalidArgument`] when `base` is not page-aligned, `len` is 0, `page_bytes` is not
/// a power of two, `max_chunk_bytes` is not a positive multiple of the page, the range wraps,
/// or it would take more than [`MAX_CHUNKS`] chunks.
pub fn plan(
    base: usize,
    len: usize,
    max_chunk_bytes: usize,
    page_bytes: usize,
) -> Result<Vec<Chunk>> {
    let bad = |why: String| Err(Error::InvalidArgument(why));
    if !page_bytes.is_power_of_two() {
        return bad(format!("a page size of {page_bytes} is not a power of two"));
    }
    if max_chunk_bytes == 0 || max_chunk_bytes % page_bytes != 0 {
        return bad(format!(
            "a chunk bound of {max_chunk_bytes} bytes is not a positive multiple of the \
             {page_bytes}-byte page"
        ));
    }
    if base % page_bytes != 0 {
        return bad(format!(
            "the mapping at {base:#x} does not start on a {page_bytes}-byte page"
        ));
    }
    if len == 0 {
        return bad("an empty mapping cannot be registered".into());
    }
    let end = len
        .checked_next_multiple_of(page_bytes)
        .filter(|e| base.checked_add(*e).is_some())
        .ok_or_else(|| Error::InvalidArgument(format!("{len} bytes at {base:#x} wrap around")))?;
    let n = end.div_ceil(max_chunk_bytes);
    if n > MAX_CHUNKS {
        return bad(format!(
            "{len} bytes in chunks of {max_chunk_bytes} would take {n} chunks, more than \
             {MAX_CHUNKS}"
        ));
    }
    Ok((0..n)
        .map(|i| {
            let offset = i * max_chunk_bytes;
            Chunk {
                offset,
                len: max_chunk_bytes.min(end - offset),
            }
        })
        .collect())
}

/// The host's page size.
pub(crate) fn page_bytes() -> usize {
    // SAFETY: sysconf reads a constant of the system; no memory is involved.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).unwrap_or(4096)
}

/// A mapping registered as pinned host memory, with the bookkeeping of the copies on it.
///
/// Copies into and out of it are in [`crate::cuda::copy`].
#[derive(Debug)]
pub struct PinnedRegistration {
    pub(super) driver: Arc<dyn Driver>,
    pub(super) base: *mut u8,
    pub(super) len: usize,
    chunks: Vec<Chunk>,
    pub(super) events: Mutex<EventTable>,
}

// SAFETY: `base` names a mapping the registration does not own and only hands to the driver;
// the event table is behind a mutex; the driver is `Send + Sync`.
unsafe impl Send for PinnedRegistration {}
// SAFETY: as for `Send`: every method takes the table's lock before touching events.
unsafe impl Sync for PinnedRegistration {}

impl PinnedRegistration {
    /// Register `len` bytes at `base` in chunks of at most [`MAX_CHUNK_BYTES`].
    ///
    /// # Safety
    /// `base..base + len` is a mapping that stays mapped until this registration is dropped.
    ///
    /// # Errors
    /// As [`plan`]; the driver's refusal ([`Error::Io`], [`Error::Unsupported`]), after the
    /// chunks registered before the failing one were unregistered again.
    pub unsafe fn new(driver: Arc<dyn Driver>, base: *mut u8, len: usize) -> Result<Self> {
        // SAFETY: the caller's contract, passed on.
        unsafe { Self::with_max_chunk(driver, base, len, MAX_CHUNK_BYTES) }
    }

    /// As [`PinnedRegistration::new`], with another chunk bound (tests, drivers that need
    /// smaller pieces).
    ///
    /// # Safety
    /// As [`PinnedRegistration::new`].
    ///
    /// # Errors
    /// As [`PinnedRegistration::new`].
    pub unsafe fn with_max_chunk(
        driver: Arc<dyn Driver>,
        base: *mut u8,
        len: usize,
        max_chunk_bytes: usize,
    ) -> Result<Self> {
        let chunks = plan(base as usize, len, max_chunk_bytes, page_bytes())?;
        for (i, c) in chunks.iter().enumerate() {
            // SAFETY: the chunk lies inside the caller's mapping (the plan keeps it there, up
            // to the last page), which stays mapped while registered.
            let r = unsafe { driver.host_register(base.add(c.offset), c.len) };
            if let Err(e) = r {
                let mut undone = 0usize;
                let mut undo_errors = Vec::new();
                for done in chunks[..i].iter().rev() {
                    // SAFETY: registered just above; no copy can be in flight yet.
                    match unsafe { driver.host_unregister(base.add(done.offset)) } {
                        Ok(()) => undone += 1,
                        Err(u) => undo_errors.push(u.to_string()),
                    }
                }
                let what = format!(
                    "registering chunk {i} ({} bytes at offset {}) of {} failed: {e}; the {undone} \
                     chunks registered before it were unregistered{}",
                    c.len,
                    c.offset,
                    chunks.len(),
                    if undo_errors.is_empty() {
                        String::new()
                    } else {
                        format!(" (unregistering others failed: {})", undo_errors.join("; "))
                    }
                );
                return Err(match e {
                    Error::Unsupported(_) => Error::Unsupported(what),
                    _ => Error::Io(what),
                });
            }
        }
        Ok(PinnedRegistration {
            driver,
            base,
            len,
            chunks,
            events: Mutex::new(EventTable::default()),
        })
    }

    /// The registered mapping's first byte.
    pub fn base(&self) -> *mut u8 {
        self.base
    }

    /// The registered mapping's length (as given; the last chunk covers up to its page end).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true (an empty mapping is refused); for symmetry with `len`.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The chunks, in registration order.
    pub fn chunks(&self) -> &[Chunk] {
        &self.chunks
    }

    /// The driver this registration calls.
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }
}

impl Drop for PinnedRegistration {
    fn drop(&mut self) {
        let table = self
            .events
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Copies in flight still touch the pages: let them finish before unpinning.
        table.drain(self.driver.as_ref());
        for c in self.chunks.iter().rev() {
            // SAFETY: registered in `with_max_chunk`; no copy is in flight (drained above).
            let _ = unsafe { self.driver.host_unregister(self.base.add(c.offset)) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::driver_double::{Call, DriverDouble, Op};

    const GIB: usize = 1 << 30;

    #[test]
    fn a_200_gib_range_is_registered_as_three_64_gib_chunks_and_an_8_gib_one() {
        let chunks = plan(0x7f00_0000_0000, 200 * GIB, MAX_CHUNK_BYTES, 4096).unwrap();
        assert_eq!(
            chunks,
            vec![
                Chunk {
                    offset: 0,
                    len: 64 * GIB
                },
                Chunk {
                    offset: 64 * GIB,
                    len: 64 * GIB
                },
                Chunk {
                    offset: 128 * GIB,
                    len: 64 * GIB
                },
                Chunk {
                    offset: 192 * GIB,
                    len: 8 * GIB
                },
            ]
        );
        // Through the driver: four registrations of a fake range no byte of which is touched.
        let fake = Arc::new(DriverDouble::default());
        let base = 0x7f00_0000_0000usize as *mut u8;
        // SAFETY: the fake driver never dereferences registered ranges.
        let reg = unsafe { PinnedRegistration::new(fake.clone(), base, 200 * GIB) }.unwrap();
        assert_eq!(reg.chunks().len(), 4);
        assert_eq!(
            fake.calls(),
            chunks
                .iter()
                .map(|c| Call::Register {
                    ptr: base as usize + c.offset,
                    len: c.len
                })
                .collect::<Vec<_>>()
        );
        drop(reg);
        assert!(fake.registered().is_empty(), "unregistered on drop");
        let unregisters: Vec<_> = fake.calls().into_iter().skip(4).collect();
        assert_eq!(
            unregisters,
            chunks
                .iter()
                .rev()
                .map(|c| Call::Unregister {
                    ptr: base as usize + c.offset
                })
                .collect::<Vec<_>>(),
            "in reverse order"
        );
    }

    #[test]
    fn chunk_boundaries_are_page_aligned_and_the_last_one_ends_on_the_page_past_the_end() {
        let p = 4096;
        let chunks = plan(0x10000, 10 * p, 3 * p, p).unwrap();
        let lens: Vec<_> = chunks.iter().map(|c| c.len / p).collect();
        assert_eq!(lens, vec![3, 3, 3, 1]);
        assert!(chunks.iter().all(|c| c.offset % p == 0 && c.len % p == 0));
        assert!(
            chunks
                .windows(2)
                .all(|w| w[0].offset + w[0].len == w[1].offset),
            "contiguous"
        );
        // A length that is not a page multiple: the last page is covered whole.
        assert_eq!(
            plan(0x10000, p + 1, 64 * p, p).unwrap(),
            vec![Chunk {
                offset: 0,
                len: 2 * p
            }]
        );
        // Exactly one chunk's worth is one chunk.
        assert_eq!(plan(0, 3 * p, 3 * p, p).unwrap().len(), 1);
    }

    #[test]
    fn a_plan_refuses_what_cannot_be_registered() {
        let p = 4096;
        for (base, len, max, page) in [
            (0x10001, p, p, p),                // unaligned base
            (0x10000, 0, p, p),                // empty
            (0x10000, p, p + 1, p),            // chunk bound not a page multiple
            (0x10000, p, 0, p),                // no chunk bound
            (0x10000, p, p, 3000),             // page not a power of two
            (usize::MAX - p + 1, 2 * p, p, p), // wraps
            (0, (MAX_CHUNKS + 1) * p, p, p),   // too many chunks
        ] {
            assert!(
                matches!(plan(base, len, max, page), Err(Error::InvalidArgument(_))),
                "{base:#x} {len} {max} {page}"
            );
        }
    }

    #[test]
    fn a_failure_part_way_unregisters_the_chunks_already_registered() {
        let fake = Arc::new(DriverDouble::default());
        fake.fail_nth(Op::Register, 2);
        let p = page_bytes();
        let base = 0x7f00_0000_0000usize as *mut u8;
        // SAFETY: the fake driver never dereferences registered ranges.
        let e = unsafe { PinnedRegistration::with_max_chunk(fake.clone(), base, 5 * p, p) }
            .unwrap_err();
        assert!(matches!(e, Error::Io(_)), "{e}");
        assert!(e.to_string().contains("chunk 2"), "{e}");
        assert!(fake.registered().is_empty(), "nothing left half-registered");
        let b = base as usize;
        assert_eq!(
            fake.calls(),
            vec![
                Call::Register { ptr: b, len: p },
                Call::Register { ptr: b + p, len: p },
                Call::Register {
                    ptr: b + 2 * p,
                    len: p
                },
                Call::Unregister { ptr: b + p },
                Call::Unregister { ptr: b },
            ]
        );
    }

    #[test]
    fn a_driver_that_refuses_the_first_chunk_leaves_nothing_registered() {
        let fake = Arc::new(DriverDouble::default());
        fake.fail_nth(Op::Register, 0);
        let p = page_bytes();
        // SAFETY: the fake driver never dereferences registered ranges.
        let r = unsafe { PinnedRegistration::new(fake.clone(), (64 * p) as *mut u8, p) };
        assert!(r.is_err());
        assert_eq!(fake.calls().len(), 1);
        assert!(fake.registered().is_empty());
    }
}
