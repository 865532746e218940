//! Segment descriptors: how a node tells a peer about a range of its memory the peer may name
//! in one-sided operations (always together with a [`crate::grant::Grant`], which decides what
//! the peer may actually touch).
//!
//! The wire form is fixed, little-endian, 32 bytes, versioned:
//!
//! ```text
//! offset  bytes  field
//! 0       2      magic "KS"
//! 2       1      version (1)
//! 3       1      backend (1 local, 2 tcp, 3 rdma)
//! 4       4      segment id
//! 8       8      length in bytes
//! 16      8      node id
//! 24      8      node generation (an incarnation's descriptors never match the next one's)
//! ```
//!
//! No address is in it: a peer names `(segment, offset)`, never a pointer. Backend-specific
//! keys (an RDMA rkey, say) travel with a grant, for its range only, not here.

use crate::error::{Error, Result};
use crate::grant::SegmentId;

/// The first two bytes of every descriptor.
pub const SEGMENT_MAGIC: [u8; 2] = *b"KS";
/// The descriptor layout this build writes and reads.
pub const SEGMENT_VERSION: u8 = 1;

/// Which backend registered the segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum BackendKind {
    /// Same host, memcpy between segments.
    Local = 1,
    /// TCP between hosts.
    Tcp = 2,
    /// RDMA verbs.
    Rdma = 3,
}

impl BackendKind {
    fn from_byte(b: u8) -> Option<BackendKind> {
        match b {
            1 => Some(BackendKind::Local),
            2 => Some(BackendKind::Tcp),
            3 => Some(BackendKind::Rdma),
            _ => None,
        }
    }
}

/// A registered segment, as a peer learns of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SegmentDescriptor {
    /// The backend that registered it.
    pub backend: BackendKind,
    /// The segment, as the peer will name it.
    pub segment: SegmentId,
    /// Its length in bytes.
    pub len: u64,
    /// The node that holds it.
    pub node_id: u64,
    /// That node's incarnation.
    pub node_generation: u64,
}

impl SegmentDescriptor {
    /// Bytes on the wire.
    pub const WIRE_BYTES: usize = 32;

    /// The wire form.
    pub fn encode(&self) -> [u8; Self::WIRE_BYTES] {
        let mut b = [0u8; Self::WIRE_BYTES];
        b[0..2].copy_from_slice(&SEGMENT_MAGIC);
        b[2] = SEGMENT_VERSION;
        b[3] = self.backend as u8;
        b[4..8].copy_from_slice(&self.segment.0.to_le_bytes());
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b[16..24].copy_from_slice(&self.node_id.to_le_bytes());
        b[24..32].copy_from_slice(&self.node_generation.to_le_bytes());
        b
    }

    /// Parse the wire form.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a short buffer, bad magic, another version, an unknown
    /// backend or a zero length; nothing is guessed.
    pub fn decode(b: &[u8]) -> Result<SegmentDescriptor> {
        let b: &[u8; Self::WIRE_BYTES] = b
            .get(..Self::WIRE_BYTES)
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "a segment descriptor is {} bytes, {} given",
                    Self::WIRE_BYTES,
                    b.len()
                ))
            })?;
        if b[0..2] != SEGMENT_MAGIC {
            return Err(Error::InvalidArgument(
                "not a segment descriptor (magic)".into(),
            ));
        }
        if b[2] != SEGMENT_VERSION {
            return Err(Error::InvalidArgument(format!(
                "segment descriptor version {}, this build reads {SEGMENT_VERSION}",
                b[2]
            )));
        }
        let backend = BackendKind::from_byte(b[3]).ok_or_else(|| {
            Error::InvalidArgument(format!("unknown backend {} in a segment descriptor", b[3]))
        })?;
        let word = |r: std::ops::Range<usize>| {
            u64::from_le_bytes(b[r].try_into().expect("an 8-byte field"))
        };
        let len = word(8..16);
        if len == 0 {
            return Err(Error::InvalidArgument("a segment of zero bytes".into()));
        }
        Ok(SegmentDescriptor {
            backend,
            segment: SegmentId(u32::from_le_bytes(b[4..8].try_into().expect("4 bytes"))),
            len,
            node_id: word(16..24),
            node_generation: word(24..32),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_layout_is_the_documented_one() {
        let d = SegmentDescriptor {
            backend: BackendKind::Tcp,
            segment: SegmentId(0x0403_0201),
            len: 0x1122,
            node_id: 7,
            node_generation: 9,
        };
        let b = d.encode();
        assert_eq!(&b[0..4], &[b'K', b'S', 1, 2]);
        assert_eq!(&b[4..8], &[1, 2, 3, 4]);
        assert_eq!(&b[8..10], &[0x22, 0x11]);
        assert_eq!(b[16], 7);
        assert_eq!(b[24], 9);
    }

    #[test]
    fn malformed_descriptors_are_refused_with_the_reason() {
        let good = SegmentDescriptor {
            backend: BackendKind::Local,
            segment: SegmentId(1),
            len: 4096,
            node_id: 1,
            node_generation: 1,
        }
        .encode();
        for (i, v, why) in [(0, b'X', "magic"), (2, 9, "version"), (3, 0, "backend")] {
            let mut b = good;
            b[i] = v;
            let e = SegmentDescriptor::decode(&b).unwrap_err();
            assert!(e.to_string().contains(why), "{e}");
        }
        let mut zero = good;
        zero[8..16].fill(0);
        assert!(SegmentDescriptor::decode(&zero).is_err());
        assert!(SegmentDescriptor::decode(&good[..31]).is_err());
    }

    proptest! {
        #[test]
        fn every_descriptor_survives_the_wire(
            backend in 1u8..=3, segment: u32, len in 1u64.., node_id: u64, node_generation: u64,
        ) {
            let d = SegmentDescriptor {
                backend: BackendKind::from_byte(backend).unwrap(),
                segment: SegmentId(segment),
                len,
                node_id,
                node_generation,
            };
            prop_assert_eq!(SegmentDescriptor::decode(&d.encode()).unwrap(), d);
        }
    }
}
