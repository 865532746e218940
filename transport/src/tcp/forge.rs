//! What an attacker on the path can do to a payload that only a CRC-32C protects: change its
//! bytes and keep its CRC. CRC-32C is linear over GF(2), so after any change, four bytes can be
//! chosen that bring the checksum back. The test hook `TcpTransport::inject_rewritten_payload`
//! uses it to show what the payload MAC is for (docs/TRANSFER.md, "Who can do what").

use crate::local::crc32c;

/// Bytes at the end of a payload this changes.
pub const CHANGED_BYTES: usize = 5;

/// What a change `t` of the last [`CHANGED_BYTES`] bytes does to a CRC-32C: linear in `t`, and
/// the same whatever comes before it.
fn effect(t: &[u8; CHANGED_BYTES]) -> u32 {
    crc32c(0, t) ^ crc32c(0, &[0; CHANGED_BYTES])
}

/// Change the last [`CHANGED_BYTES`] bytes of `buf` so that its CRC-32C stays what it was:
/// flip the first of them, then solve for the four after it. A buffer shorter than that is
/// left alone.
pub fn keep_crc_change_bytes(buf: &mut [u8]) {
    let Some(at) = buf.len().checked_sub(CHANGED_BYTES) else {
        return;
    };
    let mut t = [0u8; CHANGED_BYTES];
    t[0] = 0xa5;
    let want = effect(&t);
    // Gaussian elimination over GF(2): each of the 32 bits of bytes 1..5 is a column (its
    // effect); find the bits whose effects add up to `want`.
    let mut rows: Vec<(u32, u32)> = (0..32u32)
        .map(|bit| {
            let mut b = [0u8; CHANGED_BYTES];
            b[1 + (bit / 8) as usize] = 1 << (bit % 8);
            (effect(&b), 1u32 << bit)
        })
        .collect();
    let mut basis: Vec<(u32, u32)> = Vec::with_capacity(32);
    for (mut v, mut bits) in rows.drain(..) {
        for &(bv, bb) in &basis {
            if v ^ bv < v {
                v ^= bv;
                bits ^= bb;
            }
        }
        if v != 0 {
            basis.push((v, bits));
            basis.sort_unstable_by_key(|b| std::cmp::Reverse(b.0));
        }
    }
    let (mut rest, mut chosen) = (want, 0u32);
    for &(bv, bb) in &basis {
        if rest ^ bv < rest {
            rest ^= bv;
            chosen ^= bb;
        }
    }
    debug_assert_eq!(rest, 0, "the last four bytes reach every CRC");
    t[1..].copy_from_slice(&chosen.to_le_bytes());
    for (b, x) in buf[at..].iter_mut().zip(t) {
        *b ^= x;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forged_payload_differs_and_keeps_its_crc() {
        for len in [5usize, 6, 64, 4096, 1 << 20] {
            let original: Vec<u8> = (0..len).map(|i| (i * 31 + 7) as u8).collect();
            let mut forged = original.clone();
            keep_crc_change_bytes(&mut forged);
            assert_ne!(forged, original, "len {len}");
            assert_eq!(crc32c(0, &forged), crc32c(0, &original), "len {len}");
        }
        let mut short = vec![1u8; 4];
        keep_crc_change_bytes(&mut short);
        assert_eq!(short, vec![1u8; 4]);
    }
}
