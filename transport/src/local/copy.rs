//! Copy routines for moving page bytes on one node.
//!
//! Two facts about this hardware class shape them:
//!
//! - glibc's `memcpy` in block-sized calls (160 KiB – 10 MiB) runs at about half the memory
//!   bandwidth, because it writes through the cache: every destination line is first read
//!   (read-for-ownership), then evicted. A copy with non-temporal (streaming) stores writes
//!   full lines straight to memory and approaches the bound a single large copy reaches.
//! - A checksum computed in a second pass after the copy reads the data from memory again.
//!   [`copy_with_crc32c`] instead checksums the very 32-byte loads it streams out, in three
//!   independent lanes (the `crc32` instruction has a 3-cycle latency and a throughput of one
//!   per cycle), and joins the lane checksums with [`crc32c_combine`]. Memory is read once and
//!   written once; measured on the development VM: 12.4–15.5 GB/s against 12.7–17.5 GB/s for
//!   the plain non-temporal copy and 6.5–8.1 GB/s for copy-then-checksum.
//! - Three interleaved streams also move more bytes than one: the plain copy streams in the
//!   same three lanes (one loop, `three_lanes!`, serves both), so it never loses to the
//!   checksumming copy, as it did when it was a single stream (`docs/PERFORMANCE.md`).
//!
//! All `unsafe` in this crate lives in this file.

/// Copies at or above this length use non-temporal stores (when the CPU has AVX2); smaller ones
/// use `copy_from_slice`, whose cached stores are cheaper when the data is reread soon.
pub const NONTEMPORAL_THRESHOLD_BYTES: usize = 64 * 1024;

/// Without AVX2 and SSE4.2 the fused copy checksums a chunk of this size and then copies it
/// while it is still in cache. Measured on the development VM (chunked, streaming): 4 KiB chunks
/// 4.6 GB/s, 16 KiB 5.4, 64 KiB 8.3, 256 KiB 8.2, 1 MiB 7.8.
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
/// On x86-64 with AVX2 and SSE4.2, large copies run in one pass: the body is split in three
/// lanes whose CRCs are computed with the `crc32` instruction on the same 32 bytes that are
/// being streamed out (three independent chains hide the instruction's latency), and the lane
/// CRCs are combined at the end. Elsewhere the copy works in [`FUSED_CHUNK_BYTES`] chunks:
/// checksum a chunk (pulling it into cache), then copy it while it is hot.
///
/// # Panics
/// If the slices differ in length.
pub fn copy_with_crc32c(dst: &mut [u8], src: &[u8], crc: u32) -> u32 {
    assert_eq!(dst.len(), src.len(), "copy_with_crc32c: length mismatch");
    let streaming = src.len() >= NONTEMPORAL_THRESHOLD_BYTES && nontemporal_available();
    #[cfg(target_arch = "x86_64")]
    {
        if streaming && std::arch::is_x86_feature_detected!("sse4.2") {
            // SAFETY: AVX2 (via `nontemporal_available`) and SSE4.2 are present, and the slices
            // have equal lengths (asserted above).
            let crc = unsafe { x86::copy_crc32c_lanes(dst, src, crc) };
            store_fence();
            return crc;
        }
    }
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

/// The CRC-32C of `A ‖ B` from the CRC-32C of `A` (`crc1`), of `B` (`crc2`) and the length of
/// `B`: a multiplication by `x^(8·len2)` in GF(2)\[x\] modulo the Castagnoli polynomial, with
/// `x^(2^k)` precomputed, so it costs at most one product per set bit of `len2` (well under a
/// microsecond; the matrix method of the `crc32c` crate takes 10-17 µs).
pub fn crc32c_combine(crc1: u32, crc2: u32, len2: usize) -> u32 {
    multmodp(x8nmodp(len2), crc1) ^ crc2
}

/// The Castagnoli polynomial, bit-reflected.
const CASTAGNOLI_REFLECTED: u32 = 0x82F6_3B78;

/// `a · b mod P` in the reflected representation (bit 31 is x^0).
fn multmodp(a: u32, mut b: u32) -> u32 {
    let mut m = 1u32 << 31;
    let mut p = 0u32;
    while m != 0 {
        if a & m != 0 {
            p ^= b;
        }
        m >>= 1;
        b = if b & 1 != 0 {
            (b >> 1) ^ CASTAGNOLI_REFLECTED
        } else {
            b >> 1
        };
    }
    p
}

/// `x^(2^k) mod P` for k = 0..67 (enough for `x^(8·n)` with any 64-bit n).
fn x2n_table() -> &'static [u32; 68] {
    static TABLE: std::sync::OnceLock<[u32; 68]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = [0u32; 68];
        let mut p = 1u32 << 30; // x^1
        for e in t.iter_mut() {
            *e = p;
            p = multmodp(p, p);
        }
        t
    })
}

/// `x^(8·n) mod P`.
fn x8nmodp(mut n: usize) -> u32 {
    let table = x2n_table();
    let mut p = 1u32 << 31; // x^0
    let mut k = 3; // 8 = 2^3
    while n != 0 {
        if n & 1 != 0 {
            p = multmodp(table[k], p);
        }
        n >>= 1;
        k += 1;
    }
    p
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
    use std::arch::x86_64::{__m256i, _mm_crc32_u64, _mm256_loadu_si256, _mm256_stream_si256};

    /// Below this many bytes per lane the three-lane copies are not worth their set-up (and,
    /// for the checksumming one, its two CRC combines).
    const MIN_LANE_BYTES: usize = 4096;

    /// The loop both streaming copies share: the body of `3 * lane` bytes at `d` / `s` is
    /// streamed in three lanes of `lane` bytes, interleaved 32 bytes at a time, so that three
    /// independent read and write streams are in flight (one stream leaves memory bandwidth
    /// unused: measured on the development VM, 2.5 MiB blocks memory to memory, one stream
    /// 17.1–18.4 GB/s, three lanes 21.6–21.9). `|k, p| { … }` runs on every 32-byte piece
    /// after its store, with the lane number `k` and the piece's source address `p` (the
    /// checksum; nothing for the plain copy). A macro rather than a function so that each caller's
    /// target features reach every intrinsic in it.
    macro_rules! three_lanes {
        ($d:expr, $s:expr, $lane:expr, |$k:ident, $p:ident| $each:block) => {{
            let (d, s, lane): (*mut u8, *const u8, usize) = ($d, $s, $lane);
            let mut i = 0;
            while i < lane {
                for k in 0..3 {
                    let at = k * lane + i;
                    // SAFETY: `k * lane + i + 32 <= 3 * lane`, inside both slices (the
                    // callers' bound); `d + at` is 32-byte aligned (the callers aligned `d`;
                    // lane and i are multiples of 32); the load is an unaligned load.
                    unsafe {
                        let v = _mm256_loadu_si256(s.add(at) as *const __m256i);
                        _mm256_stream_si256(d.add(at) as *mut __m256i, v);
                    }
                    #[allow(unused_variables)]
                    let ($k, $p) = (k, s.wrapping_add(at));
                    $each
                }
                i += 32;
            }
        }};
    }

    /// One pass: stream `src` to `dst` and compute its CRC-32C in three interleaved lanes.
    ///
    /// # Safety
    /// The CPU must support AVX2 and SSE4.2, and `dst.len() == src.len()`.
    #[target_feature(enable = "avx2,sse4.2")]
    pub(super) unsafe fn copy_crc32c_lanes(dst: &mut [u8], src: &[u8], crc: u32) -> u32 {
        debug_assert_eq!(dst.len(), src.len());
        let len = dst.len();
        let head = dst.as_ptr().align_offset(32).min(len);
        dst[..head].copy_from_slice(&src[..head]);
        let crc = crc32c::crc32c_append(crc, &src[..head]);
        let lane = (len - head) / 3 / 32 * 32;
        if lane < MIN_LANE_BYTES {
            // SAFETY: same preconditions as ours.
            unsafe { copy_one_stream(&mut dst[head..], &src[head..]) };
            return crc32c::crc32c_append(crc, &src[head..]);
        }
        // Raw (uninverted) CRC state of each lane: lane 0 continues `crc`, lanes 1 and 2 start
        // fresh, as crc32c_append does internally.
        let mut c = [u64::from(!crc), u64::from(u32::MAX), u64::from(u32::MAX)];
        three_lanes!(
            dst[head..].as_mut_ptr(),
            src[head..].as_ptr(),
            lane,
            |k, p| {
                let p = p as *const u64;
                // SAFETY: the four u64 reads lie inside the 32 bytes just streamed, which are
                // inside `src` (unaligned reads).
                unsafe {
                    c[k] = _mm_crc32_u64(c[k], p.read_unaligned());
                    c[k] = _mm_crc32_u64(c[k], p.add(1).read_unaligned());
                    c[k] = _mm_crc32_u64(c[k], p.add(2).read_unaligned());
                    c[k] = _mm_crc32_u64(c[k], p.add(3).read_unaligned());
                }
            }
        );
        let [c0, c1, c2] = c.map(|x| !(x as u32));
        let crc = super::crc32c_combine(super::crc32c_combine(c0, c1, lane), c2, lane);
        let done = head + 3 * lane;
        dst[done..].copy_from_slice(&src[done..]);
        crc32c::crc32c_append(crc, &src[done..])
    }

    /// Stream `src` to `dst` (32-byte streaming stores to a 32-byte-aligned destination, in
    /// three lanes as the checksumming copy does, so the plain copy never loses to it); the
    /// unaligned head and the tail are copied normally.
    ///
    /// # Safety
    /// The CPU must support AVX2, and `dst.len() == src.len()`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn copy_streaming_avx2(dst: &mut [u8], src: &[u8]) {
        debug_assert_eq!(dst.len(), src.len());
        let len = dst.len();
        let head = dst.as_ptr().align_offset(32).min(len);
        let lane = (len - head) / 3 / 32 * 32;
        if lane < MIN_LANE_BYTES {
            // SAFETY: same preconditions as ours.
            unsafe { copy_one_stream(dst, src) };
            return;
        }
        dst[..head].copy_from_slice(&src[..head]);
        three_lanes!(
            dst[head..].as_mut_ptr(),
            src[head..].as_ptr(),
            lane,
            |_k, _p| {}
        );
        let done = head + 3 * lane;
        dst[done..].copy_from_slice(&src[done..]);
    }

    /// Copy with 32-byte streaming stores, one stream (for copies too short for three lanes);
    /// the unaligned head and the tail are copied normally.
    ///
    /// # Safety
    /// The CPU must support AVX2, and `dst.len() == src.len()`.
    #[target_feature(enable = "avx2")]
    unsafe fn copy_one_stream(dst: &mut [u8], src: &[u8]) {
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

    #[test]
    fn the_three_lane_copies_are_exact_for_every_alignment_and_length_near_their_edges() {
        let src = pattern(3 * 1024 * 1024 + 200, 5);
        let lanes = [64 * 1024, 3 * 4096 + 31, 3 * 4096 + 96, 2 * 1024 * 1024 + 7];
        for len in lanes {
            for (so, doff) in [(0usize, 0usize), (1, 0), (0, 5), (13, 31), (32, 1)] {
                let s = &src[so..so + len];
                let mut dst = vec![0u8; len + 64];
                for start in [0u32, 0xdead_beef] {
                    let c = copy_with_crc32c(&mut dst[doff..doff + len], s, start);
                    assert_eq!(&dst[doff..doff + len], s, "len {len} offsets {so}/{doff}");
                    assert_eq!(c, crc32c(start, s), "len {len} offsets {so}/{doff}");
                }
                let mut plain = vec![0u8; len + 64];
                copy(&mut plain[doff..doff + len], s);
                assert_eq!(
                    &plain[doff..doff + len],
                    s,
                    "plain, len {len} offsets {so}/{doff}"
                );
                assert!(
                    plain[..doff]
                        .iter()
                        .chain(&plain[doff + len..])
                        .all(|&b| b == 0)
                );
            }
        }
    }

    proptest! {
        #[test]
        fn the_fast_combine_agrees_with_the_crates(a in any::<u32>(), b in any::<u32>(), len in 0usize..(1 << 40)) {
            prop_assert_eq!(crc32c_combine(a, b, len), crc32c::crc32c_combine(a, b, len));
        }

        #[test]
        fn combining_two_halves_gives_the_crc_of_the_whole(data in proptest::collection::vec(any::<u8>(), 0..5000), cut in 0usize..5000) {
            let cut = cut.min(data.len());
            let whole = crc32c(0, &data);
            let parts = crc32c_combine(crc32c(0, &data[..cut]), crc32c(0, &data[cut..]), data.len() - cut);
            prop_assert_eq!(parts, whole);
        }

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
