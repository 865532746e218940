//! The handshake's frames: a connection's introduction ([`Bind`], one each way after the
//! authentication) and the [`Refusal`] a responder sends in its place; and the frame helpers
//! every backend's wire shares (the version, the head check). Layout in [`crate::tcp::wire`]'s
//! picture (a Bind is 40 bytes: "KB", version, purpose, reserved, node id, node generation,
//! integrity tag; a Refusal is Bind-sized: "KN", version, purpose, limit, retry hint, tag).

use crate::auth::TAG_BYTES;
use crate::error::{Error, Result};

/// The frame layout this build speaks (2: every frame tagged).
pub const WIRE_VERSION: u8 = 2;

/// What a connection is for, as its initiator's [`Bind`] says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(u8)]
pub enum Purpose {
    /// Chunks, for the ring.
    #[default]
    Data = 0,
    /// The owner's own messages (handed to its control handler, authenticated).
    Control = 1,
    /// The RDMA backend's side channel (queue-pair exchange, keys), handed to its handler;
    /// closed at once by an engine without one.
    Rdma = 2,
}

/// A connection's introduction, after authentication.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bind {
    /// The sender's node id.
    pub node_id: u64,
    /// The sender's incarnation.
    pub node_generation: u64,
    /// What the connection is for (the responder answers with the same).
    pub purpose: Purpose,
}

impl Bind {
    /// The node and incarnation this bind introduces.
    pub fn peer_node(&self) -> crate::grant::PeerNode {
        crate::grant::PeerNode {
            node: self.node_id,
            generation: self.node_generation,
        }
    }
}

impl Purpose {
    /// The purpose a bind's purpose byte names, if it names one.
    pub fn from_wire(b: u8) -> Option<Purpose> {
        match b {
            0 => Some(Purpose::Data),
            1 => Some(Purpose::Control),
            2 => Some(Purpose::Rdma),
            _ => None,
        }
    }
}

pub(crate) fn protocol(what: String) -> Error {
    Error::InvalidArgument(format!("transfer protocol: {what}"))
}

#[inline]
pub(crate) fn check_head(b: &[u8], magic: &[u8; 2]) -> Result<()> {
    if &b[0..2] != magic {
        return Err(protocol(format!(
            "expected a {:?} frame",
            std::str::from_utf8(magic)
        )));
    }
    if b[2] != WIRE_VERSION {
        return Err(protocol(format!(
            "the peer speaks frame version {}, this node {WIRE_VERSION}",
            b[2]
        )));
    }
    Ok(())
}

#[inline]
pub(crate) fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

#[inline]
pub(crate) fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

impl Bind {
    /// Bytes on the wire.
    pub const WIRE_BYTES: usize = 24 + TAG_BYTES;

    /// The wire form.
    pub fn encode(&self) -> [u8; Self::WIRE_BYTES] {
        let mut b = [0u8; Self::WIRE_BYTES];
        b[0..2].copy_from_slice(b"KB");
        b[2] = WIRE_VERSION;
        b[3] = self.purpose as u8;
        b[8..16].copy_from_slice(&self.node_id.to_le_bytes());
        b[16..24].copy_from_slice(&self.node_generation.to_le_bytes());
        b
    }

    /// Parse the wire form.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for another magic or version.
    pub fn decode(b: &[u8; Self::WIRE_BYTES]) -> Result<Bind> {
        check_head(b, b"KB")?;
        let purpose = Purpose::from_wire(b[3])
            .ok_or_else(|| protocol(format!("unknown connection purpose {}", b[3])))?;
        Ok(Bind {
            node_id: u64_at(b, 8),
            node_generation: u64_at(b, 16),
            purpose,
        })
    }
}

/// A responder's "no more connections of this purpose from you", in its bind's place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    /// The purpose refused.
    pub purpose: Purpose,
    /// The bound reached (connections of the purpose per peer).
    pub limit: u32,
    /// How long to wait before trying again, ms.
    pub retry_after_ms: u32,
}

impl Refusal {
    /// The wire form: as long as a [`Bind`] (its place), tag last.
    pub fn encode(&self) -> [u8; Bind::WIRE_BYTES] {
        let mut b = [0u8; Bind::WIRE_BYTES];
        b[0..2].copy_from_slice(b"KN");
        b[2] = WIRE_VERSION;
        b[3] = self.purpose as u8;
        b[4..8].copy_from_slice(&self.limit.to_le_bytes());
        b[8..12].copy_from_slice(&self.retry_after_ms.to_le_bytes());
        b
    }

    /// The refusal a bind-sized frame holds, if it is one.
    pub fn decode(b: &[u8; Bind::WIRE_BYTES]) -> Option<Refusal> {
        if &b[0..2] != b"KN" || b[2] != WIRE_VERSION {
            return None;
        }
        // a refusal is read leniently: any purpose byte past the known ones reads as the last
        let purpose = Purpose::from_wire(b[3]).unwrap_or(Purpose::Rdma);
        Some(Refusal {
            purpose,
            limit: u32_at(b, 4),
            retry_after_ms: u32_at(b, 8),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_reads_back_and_a_bind_is_not_one() {
        let r = Refusal {
            purpose: Purpose::Control,
            limit: 16,
            retry_after_ms: 200,
        };
        assert_eq!(Refusal::decode(&r.encode()), Some(r));
        let b = Bind {
            node_id: 1,
            node_generation: 2,
            purpose: Purpose::Data,
        };
        assert_eq!(Refusal::decode(&b.encode()), None);
        assert!(Bind::decode(&r.encode()).is_err(), "a refusal is no bind");
    }
}
