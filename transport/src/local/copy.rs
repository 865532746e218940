//! Copy routines for moving page bytes on one node.
//!
//! Two facts about this hardware class shape them:
//!
//! - glibc's `memcpy` in block-sized calls (160 KiB – 10 MiB) runs at about half the memory
//!   bandwidth, because it writes through the cache: every destination line is first read
//!   (read-for-ownership), then evicted. A copy with non-temporal (streaming) stores writes
//!   full lines straight to memory and approaches the bound a single large copy reaches.
//! - A checksum computed in a second pass after the copy reads the data from memory again.
//!   [`copy_with_crc32c`] instead walks the source in chunks small enough to stay in the L1/L2
//!   cache: it checksums a chunk (pulling it into cache) and then streams the same, now hot,
//!   chunk to the destination. Memory is read once and written once.
//!
//! All `unsafe` in this crate lives in this file.

/// Copies at or above this length use non-temporal stores (when the CPU has AVX2); smaller ones
/// use `copy_from_slice`, whose cached stores are cheaper when the data is reread soon.
pub const NONTEMPORAL_THRESHOLD_BYTES: usize = 64 * 1024;

/// The chunk the fused copy checksums and then copies while it is still in cache. Measured on a
/// 2-core x86 host: 4 KiB chunks reach 4.6 GB/s, 16 KiB 5.4, 64 KiB 8.3, 256 KiB 8.2, 1 MiB
/// 7.8 (a separate copy-then-checksum pass: 6.5).
pub const FUSED_CHUNK_BYTES: usize = 64 * 1024;

/// Copy `src` into `dst`, with non-temporal stores for large copies.
///
/// # Panics
/// If the slices differ in length.
pub fn copy(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy: length mismatch");
    if src.len() >= NONTEMPORAL_THRESHOLD_BYTES && nontemporal_available() {
        copy_streaming(dst, src);
        store_fence();
    } else {
        dst.copy_from_slice(src);
    }
}

/// Copy `src` into `dst` and return the CRC-32C (Castagnoli) of the bytes, continuing from
/// `crc` (pass 0 to start). The data is read from memory once.
///
/// # Panics
/// If the slices differ in length.
pub fn copy_with_crc32c(dst: &mut [u8], src: &[u8], crc: u32) -> u32 {
    assert_eq!(dst.len(), src.len(), "copy_with_crc32c: length mismatch");
    let streaming = src.len() >= NONTEMPORAL_THRESHOLD_BYTES && nontemporal_available();
    let mut crc = crc;
    for (d, s) in dst
        .chunks_mut(FUSED_CHUNK_BYTES)
        .zip(src.chunks(FUSED_CHUNK_BYTES))
    {
        crc = crc32c::crc32c_append(crc, s);
        if streaming {
            copy_streaming(d, s);
        } else {
            d.copy_from_slice(s);
        }
    }
    if streaming {
        store_fence();
    }
    crc
}

/// The CRC-32C of `data`, continuing from `crc` (0 to start); hardware-accelerated where the
/// CPU has it.
pub fn crc32c(crc: u32, data: &[u8]) -> u32 {
    crc32c::crc32c_append(crc, data)
}

/// Whether [`copy`] can use non-temporal stores on this CPU.
pub fn nontemporal_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Non-temporal copy without the closing fence (callers fence once after a run of copies).
fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 is present (checked just above), and the slices are valid and of
            // equal length (checked by every caller).
            unsafe { x86::copy_streaming_avx2(dst, src) };
            return;
        }
    }
    dst.copy_from_slice(src);
}

/// Order earlier non-temporal stores before any later store (makes them visible to other
/// threads and processes that synchronise with us afterwards).
fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `sfence` has no preconditions; SSE is part of the x86_64 baseline.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256};

    /// Copy with 32-byte streaming stores to a 32-byte-aligned destination; the unaligned head
    /// and the tail are copied normally.
    ///
    /// # Safety
    /// The CPU must support AVX2, and `dst.len() == src.len()`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn copy_streaming_avx2(dst: &mut [u8], src: &[u8]) {
        debug_assert_eq!(dst.len(), src.len());
        let len = dst.len();
        let head = dst.as_ptr().align_offset(32).min(len);
        dst[..head].copy_from_slice(&src[..head]);
        let body = (len - head) / 128 * 128;
        let d = dst[head..].as_mut_ptr();
        let s = src[head..].as_ptr();
        let mut i = 0;
        while i < body {
            // SAFETY: i + 128 <= body <= len - head, so all four 32-byte loads and stores are
            // inside the slices; `d + i` is 32-byte aligned (head aligned it, i is a multiple
            // of 128); loads are unaligned loads.
            unsafe {
                let a = _mm256_loadu_si256(s.add(i) as *const __m256i);
                let b = _mm256_loadu_si256(s.add(i + 32) as *const __m256i);
                let c = _mm256_loadu_si256(s.add(i + 64) as *const __m256i);
                let e = _mm256_loadu_si256(s.add(i + 96) as *const __m256i);
                _mm256_stream_si256(d.add(i) as *mut __m256i, a);
                _mm256_stream_si256(d.add(i + 32) as *mut __m256i, b);
                _mm256_stream_si256(d.add(i + 64) as *mut __m256i, c);
                _mm256_stream_si256(d.add(i + 96) as *mut __m256i, e);
            }
            i += 128;
        }
        let done = head + body;
        dst[done..].copy_from_slice(&src[done..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    #[test]
    fn a_large_copy_is_byte_exact_at_every_alignment() {
        let src = pattern(300 * 1024 + 77, 3);
        for offset in [0usize, 1, 7, 31, 33] {
            let mut dst = vec![0u8; src.len() + 64];
            copy(&mut dst[offset..offset + src.len()], &src);
            assert_eq!(&dst[offset..offset + src.len()], &src[..]);
            assert!(dst[..offset].iter().all(|&b| b == 0), "wrote before dst");
            assert!(
                dst[offset + src.len()..].iter().all(|&b| b == 0),
                "wrote past dst"
            );
        }
    }

    #[test]
    fn the_fused_copy_gives_the_same_crc_as_a_separate_pass() {
        for len in [0usize, 1, 100, FUSED_CHUNK_BYTES + 5, 3 * 1024 * 1024 + 13] {
            let src = pattern(len, 9);
            let mut dst = vec![0u8; len];
            let fused = copy_with_crc32c(&mut dst, &src, 0);
            assert_eq!(dst, src);
            assert_eq!(fused, crc32c(0, &src), "len {len}");
        }
    }

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        // The CRC-32C check value of "123456789" (RFC 3720 / iSCSI).
        assert_eq!(crc32c(0, b"123456789"), 0xE306_9283);
    }

    proptest! {
        #[test]
        fn fused_copies_in_pieces_equal_one_crc(data in proptest::collection::vec(any::<u8>(), 0..70_000), cut in 0usize..70_000) {
            let cut = cut.min(data.len());
            let mut dst = vec![0u8; data.len()];
            let (d1, d2) = dst.split_at_mut(cut);
            let c = copy_with_crc32c(d1, &data[..cut], 0);
            let c = copy_with_crc32c(d2, &data[cut..], c);
            prop_assert_eq!(&dst, &data);
            prop_assert_eq!(c, crc32c(0, &data));
        }
    }
}
