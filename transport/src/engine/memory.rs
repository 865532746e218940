//! Memory a segment can be registered on: the pool's shared mapping, or (tests, benches, a
//! staging area) an owned page-aligned buffer.

use std::alloc::Layout;

use crate::local::SharedRegion;

/// A mapped range the engine may read and write through raw pointers.
///
/// # Safety
/// `as_ptr()..as_ptr() + len()` is valid for reads and writes for as long as the value lives,
/// and both calls answer the same every time.
pub unsafe trait Memory: Send + Sync + std::fmt::Debug + 'static {
    /// The first byte.
    fn as_ptr(&self) -> *mut u8;
    /// Bytes mapped.
    fn len(&self) -> usize;
    /// Whether no byte is mapped.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

// SAFETY: a SharedRegion's mapping lives exactly as long as the value and never moves.
unsafe impl Memory for SharedRegion {
    fn as_ptr(&self) -> *mut u8 {
        self.base_ptr()
    }
    fn len(&self) -> usize {
        SharedRegion::len(self)
    }
}

/// An owned, zeroed, page-aligned buffer.
#[derive(Debug)]
pub struct HeapMemory {
    ptr: std::ptr::NonNull<u8>,
    layout: Layout,
}

// SAFETY: the buffer is plain memory owned by the value; access is governed by the posting
// contract, as for any other Memory.
unsafe impl Send for HeapMemory {}
// SAFETY: as above.
unsafe impl Sync for HeapMemory {}

impl HeapMemory {
    /// A zeroed buffer of `len` bytes (at least one).
    ///
    /// # Panics
    /// When `len` is zero or the allocation fails.
    pub fn zeroed(len: usize) -> HeapMemory {
        assert!(len > 0, "a buffer holds at least one byte");
        let layout = Layout::from_size_align(len, 4096).expect("a sane buffer size");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr =
            std::ptr::NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        HeapMemory { ptr, layout }
    }

    /// The bytes, to fill or check them.
    ///
    /// # Safety
    /// No transfer may be writing them (no read op naming them unsettled, no live remote-write
    /// grant on them).
    pub unsafe fn bytes(&self) -> &[u8] {
        // SAFETY: allocated for the value's life; no concurrent writer (the caller's contract).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }

    /// The bytes, to fill them.
    ///
    /// # Safety
    /// Nobody else may touch them meanwhile (no unsettled op, no live grant on them).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self) -> &mut [u8] {
        // SAFETY: allocated for the value's life; exclusive (the caller's contract).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for HeapMemory {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout in `zeroed`.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

// SAFETY: the allocation lives exactly as long as the value.
unsafe impl Memory for HeapMemory {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    fn len(&self) -> usize {
        self.layout.size()
    }
}
