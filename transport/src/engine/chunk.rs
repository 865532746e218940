//! Chunking: a large op is cut into chunks of at most `chunk_bytes` that travel independently
//! (pipelined over an endpoint's connections, each checksummed on its own) and land at their
//! own offsets, so reassembly is placement: a chunk names its op and its offset within it, and
//! the op is complete when every chunk is accounted for ([`super::batches`]).

/// One chunk of an op: `len` bytes at `offset` within the op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Offset within the op.
    pub offset: u64,
    /// Bytes (at least one, at most the chunk size).
    pub len: u32,
}

/// How many chunks an op of `len` bytes becomes.
///
/// # Panics
/// When `chunk_bytes` is zero.
pub fn count(len: u64, chunk_bytes: u32) -> u32 {
    assert!(chunk_bytes > 0, "a chunk holds at least one byte");
    u32::try_from(len.div_ceil(u64::from(chunk_bytes))).unwrap_or(u32::MAX)
}

/// The chunks of an op of `len` bytes, in order.
///
/// # Panics
/// When `chunk_bytes` is zero.
pub fn split(len: u64, chunk_bytes: u32) -> impl Iterator<Item = Piece> {
    assert!(chunk_bytes > 0, "a chunk holds at least one byte");
    let step = u64::from(chunk_bytes);
    (0..len.div_ceil(step)).map(move |i| {
        let offset = i * step;
        Piece {
            offset,
            len: (len - offset).min(step) as u32,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn chunks_tile_the_op_exactly_in_any_arrival_order(
            len in 1u64..(8 << 20),
            chunk in 1u32..(2 << 20),
            seed in any::<u64>(),
        ) {
            let mut pieces: Vec<Piece> = split(len, chunk).collect();
            prop_assert_eq!(pieces.len() as u32, count(len, chunk));
            // arrival in a shuffled order (as across several connections): placement by offset
            // rebuilds the op with no gap and no overlap
            let n = pieces.len();
            let mut s = seed;
            for i in (1..n).rev() {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                pieces.swap(i, (s >> 33) as usize % (i + 1));
            }
            let mut covered: Vec<(u64, u64)> =
                pieces.iter().map(|p| (p.offset, p.offset + u64::from(p.len))).collect();
            covered.sort_unstable();
            let mut at = 0;
            for (start, end) in covered {
                prop_assert_eq!(start, at);
                prop_assert!(end > start && end - start <= u64::from(chunk));
                at = end;
            }
            prop_assert_eq!(at, len);
        }
    }
}
