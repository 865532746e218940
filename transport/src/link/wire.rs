//! The handshake's frames: a connection's introduction ([`Bind`], one each way after the
//! authentication, signed with the sender's node key) and the [`Refusal`] a responder sends in
//! its place; and the frame helpers every backend's wire shares (the version, the head check).
//!
//! ```text
//! Bind (112 bytes)                               Refusal (Bind-sized)
//! 0  2 "KB"                                      0  2 "KN"
//! 2  1 version                                   2  1 version
//! 3  1 purpose (0 data, 1 control, 2 rdma)       3  1 purpose
//! 4  1 flags (bit 0: payload MAC wanted)         4  1 reason (0 per-peer bound, 1 no key,
//! 5  3 reserved (zero)                                  2 bad signature, 3 not addressed here)
//! 8  8 node id (the sender's)                    8  4 limit (the per-peer bound)
//! 16 8 node generation (the sender's)            12 4 retry after, ms
//! 24 8 the node it is addressed to               16 80 zero
//! 32 64 Ed25519 signature (link::identity)
//! 96 16 integrity tag                            96 16 integrity tag
//! ```
//!
//! The signature covers bytes 0..32 (the body), the signer's role and the connection's
//! transcript ([`super::identity`]).

use crate::auth::TAG_BYTES;
use crate::error::{Error, Result};
use crate::link::identity::SIGNATURE_BYTES;

/// The frame layout this build speaks (3: binds signed by the node's key, payload MACs in
/// chunk headers).
pub const WIRE_VERSION: u8 = 3;

/// Bind flag: the sender wants payload MACs on this connection (either end wanting them turns
/// them on).
pub const BIND_PAYLOAD_MAC: u8 = 1;

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
    /// The sender's node id (proven by the bind's signature).
    pub node_id: u64,
    /// The sender's incarnation.
    pub node_generation: u64,
    /// What the connection is for (the responder answers with the same).
    pub purpose: Purpose,
    /// Whether the sender wants payload MACs on the connection.
    pub payload_mac: bool,
    /// The node the sender means to speak to (the initiator: the node it expects; the
    /// responder: the node the initiator proved it is).
    pub to_node: u64,
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
    pub const WIRE_BYTES: usize = 32 + SIGNATURE_BYTES + TAG_BYTES;

    /// Bytes the signature covers (from the start).
    pub const BODY_BYTES: usize = 32;

    /// Where the signature lies.
    pub const SIGNATURE: std::ops::Range<usize> =
        Self::BODY_BYTES..Self::BODY_BYTES + SIGNATURE_BYTES;

    /// The wire form, its signature and tag zero (the handshake fills both).
    pub fn encode(&self) -> [u8; Self::WIRE_BYTES] {
        let mut b = [0u8; Self::WIRE_BYTES];
        b[0..2].copy_from_slice(b"KB");
        b[2] = WIRE_VERSION;
        b[3] = self.purpose as u8;
        b[4] = if self.payload_mac {
            BIND_PAYLOAD_MAC
        } else {
            0
        };
        b[8..16].copy_from_slice(&self.node_id.to_le_bytes());
        b[16..24].copy_from_slice(&self.node_generation.to_le_bytes());
        b[24..32].copy_from_slice(&self.to_node.to_le_bytes());
        b
    }

    /// Parse the wire form (the signature is the handshake's to check).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for another magic or version, unknown flags or nonzero
    /// reserved bytes.
    pub fn decode(b: &[u8; Self::WIRE_BYTES]) -> Result<Bind> {
        check_head(b, b"KB")?;
        let purpose = Purpose::from_wire(b[3])
            .ok_or_else(|| protocol(format!("unknown connection purpose {}", b[3])))?;
        if b[4] & !BIND_PAYLOAD_MAC != 0 || b[5..8] != [0; 3] {
            return Err(protocol(
                "unknown bind flags or nonzero reserved bytes".into(),
            ));
        }
        Ok(Bind {
            node_id: u64_at(b, 8),
            node_generation: u64_at(b, 16),
            purpose,
            payload_mac: b[4] & BIND_PAYLOAD_MAC != 0,
            to_node: u64_at(b, 24),
        })
    }
}

/// Why a responder refused a bind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RefusalReason {
    /// The peer holds its share of connections of this purpose (retry later).
    PerPeerBound = 0,
    /// No key is known here for the node the bind claims (not a member, or revoked).
    UnknownNode = 1,
    /// The bind's signature does not verify against the claimed node's key.
    BadSignature = 2,
    /// The bind is addressed to another node.
    NotAddressedHere = 3,
}

impl RefusalReason {
    fn from_wire(b: u8) -> Option<RefusalReason> {
        match b {
            0 => Some(RefusalReason::PerPeerBound),
            1 => Some(RefusalReason::UnknownNode),
            2 => Some(RefusalReason::BadSignature),
            3 => Some(RefusalReason::NotAddressedHere),
            _ => None,
        }
    }
}

/// A responder's "no" to a bind, in its bind's place: too many connections of this purpose
/// from that peer (retryable), or an identity it could not prove (not retryable).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    /// The purpose refused.
    pub purpose: Purpose,
    /// Why.
    pub reason: RefusalReason,
    /// The bound reached (connections of the purpose per peer; 0 for an identity refusal).
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
        b[4] = self.reason as u8;
        b[8..12].copy_from_slice(&self.limit.to_le_bytes());
        b[12..16].copy_from_slice(&self.retry_after_ms.to_le_bytes());
        b
    }

    /// The refusal a bind-sized frame holds, if it is one.
    pub fn decode(b: &[u8; Bind::WIRE_BYTES]) -> Option<Refusal> {
        if &b[0..2] != b"KN" || b[2] != WIRE_VERSION {
            return None;
        }
        // a refusal is read leniently: any purpose byte past the known ones reads as the last,
        // any reason past the known ones as a bad signature (not retryable)
        let purpose = Purpose::from_wire(b[3]).unwrap_or(Purpose::Rdma);
        let reason = RefusalReason::from_wire(b[4]).unwrap_or(RefusalReason::BadSignature);
        Some(Refusal {
            purpose,
            reason,
            limit: u32_at(b, 8),
            retry_after_ms: u32_at(b, 12),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_reads_back_and_a_bind_is_not_one() {
        for reason in [
            RefusalReason::PerPeerBound,
            RefusalReason::UnknownNode,
            RefusalReason::BadSignature,
            RefusalReason::NotAddressedHere,
        ] {
            let r = Refusal {
                purpose: Purpose::Control,
                reason,
                limit: 16,
                retry_after_ms: 200,
            };
            assert_eq!(Refusal::decode(&r.encode()), Some(r));
            assert!(Bind::decode(&r.encode()).is_err(), "a refusal is no bind");
        }
        let b = Bind {
            node_id: 1,
            node_generation: 2,
            purpose: Purpose::Data,
            payload_mac: true,
            to_node: 3,
        };
        assert_eq!(Refusal::decode(&b.encode()), None);
        assert_eq!(Bind::decode(&b.encode()).unwrap(), b);
        let mut flagged = b.encode();
        flagged[4] |= 0x80;
        assert!(Bind::decode(&flagged).is_err(), "an unknown flag");
    }
}
