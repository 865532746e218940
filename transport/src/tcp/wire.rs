//! The TCP backend's frames. Every connection starts with the authentication handshake
//! ([`crate::auth`]), then one [`Bind`] each way, then requests (initiator → target) and
//! responses (target → initiator) in order. Little-endian, fixed size, versioned. Every frame
//! ends in a 16-byte tag of the connection's key over its bytes and its place in the stream
//! ([`crate::auth::Sealer`]): a frame changed, replayed or reordered in flight closes the
//! connection.
//!
//! ```text
//! Bind (40 bytes)          Request (80 bytes)                 Response (48 bytes)
//! 0  2 "KB"                0  2 "KQ"                          0  2 "KR"
//! 2  1 version             2  1 version                       2  1 version
//! 3  1 purpose (0 data,    3  1 kind (1 write, 2 read)        3  1 status (0 ok, 1 refused,
//!        1 control,                                                 2 corrupt, 3 bad request)
//!        2 rdma)
//! 4  4 reserved            4  4 flags (bit 0: checksummed)    4  4 payload bytes that follow
//! 8  8 node id             8  8 tag (the initiator's)         8  8 tag
//! 16 8 node generation     16 8 transfer                      16 4 CRC-32C of the payload
//! 24 16 integrity tag      24 8 transfer epoch                20 1 refusal code
//!                          32 8 target node generation        21 11 reserved (zero)
//!                          40 4 segment                       32 16 integrity tag
//!                          44 4 payload bytes
//!                          48 8 offset within the segment
//!                          56 4 CRC-32C of the payload (write)
//!                          60 4 reserved (zero)
//!                          64 16 integrity tag
//! ```
//!
//! A write request is followed by its payload; a read response with status ok by its
//! payload (payloads are checked by their CRC-32C, not tagged: see docs/TRANSFER.md). A
//! chunk's payload is at most the target's chunk limit; anything larger, an unknown kind,
//! magic or version, or a wrong tag closes the connection (it is out of step or hostile). The
//! offset is a number within a segment, checked against a grant; never an address.
//!
//! Where the responder's [`Bind`] would be, a responder that will not serve this peer any
//! more connections of the purpose sends a [`Refusal`] (magic "KN", the bound and a retry
//! hint), tagged the same way.

use crate::auth::TAG_BYTES;
use crate::error::{Error, Result};

/// The frame layout this build speaks (2: every frame tagged).
pub const WIRE_VERSION: u8 = 2;

/// Where a frame's integrity tag starts in each frame (its last [`TAG_BYTES`]).
const fn tag_at(wire_bytes: usize) -> usize {
    wire_bytes - TAG_BYTES
}

/// Flag: the payload carries a CRC-32C (request: of the write's payload; read: wanted back).
pub const FLAG_CHECKSUM: u32 = 1;

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

/// Request kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Payload follows; the target writes it into the granted range.
    Write = 1,
    /// The target answers with the granted range's bytes.
    Read = 2,
}

/// One chunk's request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Write or read.
    pub kind: Kind,
    /// [`FLAG_CHECKSUM`] or nothing.
    pub flags: u32,
    /// The initiator's tag, echoed in the response.
    pub tag: u64,
    /// The transfer whose grant must cover the range.
    pub transfer: u64,
    /// Its epoch.
    pub epoch: u64,
    /// The target's incarnation, as the initiator's segment descriptor names it.
    pub node_generation: u64,
    /// The segment.
    pub segment: u32,
    /// Payload bytes.
    pub len: u32,
    /// Offset within the segment.
    pub offset: u64,
    /// CRC-32C of a write's payload (zero otherwise).
    pub crc: u32,
}

/// Response statuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Status {
    /// Done (a read's payload follows).
    Ok = 0,
    /// No live grant covers the access; `refusal` says why.
    Refused = 1,
    /// The write's payload did not match its CRC-32C.
    Corrupt = 2,
    /// The request was well-formed but not servable (a payload past the chunk limit).
    BadRequest = 3,
}

/// One chunk's response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Response {
    /// The outcome.
    pub status: Status,
    /// Payload bytes that follow (a read's, when ok).
    pub len: u32,
    /// The request's tag.
    pub tag: u64,
    /// CRC-32C of the payload (a checksummed read).
    pub crc: u32,
    /// Why it was refused ([`crate::engine::target::Target::begin`]'s codes).
    pub refusal: u8,
}

fn protocol(what: String) -> Error {
    Error::InvalidArgument(format!("transfer protocol: {what}"))
}

fn check_head(b: &[u8], magic: &[u8; 2]) -> Result<()> {
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

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
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
        let purpose = match b[3] {
            0 => Purpose::Data,
            1 => Purpose::Control,
            2 => Purpose::Rdma,
            p => return Err(protocol(format!("unknown connection purpose {p}"))),
        };
        Ok(Bind {
            node_id: u64_at(b, 8),
            node_generation: u64_at(b, 16),
            purpose,
        })
    }
}

impl Request {
    /// Bytes on the wire.
    pub const WIRE_BYTES: usize = 64 + TAG_BYTES;

    /// The wire form.
    pub fn encode(&self) -> [u8; Self::WIRE_BYTES] {
        let mut b = [0u8; Self::WIRE_BYTES];
        b[0..2].copy_from_slice(b"KQ");
        b[2] = WIRE_VERSION;
        b[3] = self.kind as u8;
        b[4..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..16].copy_from_slice(&self.tag.to_le_bytes());
        b[16..24].copy_from_slice(&self.transfer.to_le_bytes());
        b[24..32].copy_from_slice(&self.epoch.to_le_bytes());
        b[32..40].copy_from_slice(&self.node_generation.to_le_bytes());
        b[40..44].copy_from_slice(&self.segment.to_le_bytes());
        b[44..48].copy_from_slice(&self.len.to_le_bytes());
        b[48..56].copy_from_slice(&self.offset.to_le_bytes());
        b[56..60].copy_from_slice(&self.crc.to_le_bytes());
        b
    }

    /// Parse the wire form.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for another magic, version or kind, unknown flags, an empty
    /// payload or nonzero reserved bytes.
    pub fn decode(b: &[u8; Self::WIRE_BYTES]) -> Result<Request> {
        check_head(b, b"KQ")?;
        let kind = match b[3] {
            1 => Kind::Write,
            2 => Kind::Read,
            k => return Err(protocol(format!("unknown request kind {k}"))),
        };
        let flags = u32_at(b, 4);
        if flags & !FLAG_CHECKSUM != 0 {
            return Err(protocol(format!("unknown request flags {flags:#x}")));
        }
        if b[60..tag_at(Self::WIRE_BYTES)] != [0; 4] {
            return Err(protocol("reserved request bytes are not zero".into()));
        }
        let len = u32_at(b, 44);
        if len == 0 {
            return Err(protocol("a chunk of no bytes".into()));
        }
        Ok(Request {
            kind,
            flags,
            tag: u64_at(b, 8),
            transfer: u64_at(b, 16),
            epoch: u64_at(b, 24),
            node_generation: u64_at(b, 32),
            segment: u32_at(b, 40),
            len,
            offset: u64_at(b, 48),
            crc: u32_at(b, 56),
        })
    }
}

impl Response {
    /// Bytes on the wire.
    pub const WIRE_BYTES: usize = 32 + TAG_BYTES;

    /// The wire form.
    pub fn encode(&self) -> [u8; Self::WIRE_BYTES] {
        let mut b = [0u8; Self::WIRE_BYTES];
        b[0..2].copy_from_slice(b"KR");
        b[2] = WIRE_VERSION;
        b[3] = self.status as u8;
        b[4..8].copy_from_slice(&self.len.to_le_bytes());
        b[8..16].copy_from_slice(&self.tag.to_le_bytes());
        b[16..20].copy_from_slice(&self.crc.to_le_bytes());
        b[20] = self.refusal;
        b
    }

    /// Parse the wire form.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for another magic, version or status, or a payload on
    /// anything but an ok answer.
    pub fn decode(b: &[u8; Self::WIRE_BYTES]) -> Result<Response> {
        check_head(b, b"KR")?;
        let status = match b[3] {
            0 => Status::Ok,
            1 => Status::Refused,
            2 => Status::Corrupt,
            3 => Status::BadRequest,
            s => return Err(protocol(format!("unknown response status {s}"))),
        };
        let len = u32_at(b, 4);
        if status != Status::Ok && len != 0 {
            return Err(protocol("a refusal with a payload".into()));
        }
        Ok(Response {
            status,
            len,
            tag: u64_at(b, 8),
            crc: u32_at(b, 16),
            refusal: b[20],
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
        let purpose = match b[3] {
            0 => Purpose::Data,
            1 => Purpose::Control,
            _ => Purpose::Rdma,
        };
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
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn requests_round_trip(
            write in any::<bool>(), ck in any::<bool>(), tag in any::<u64>(), transfer in any::<u64>(),
            epoch in any::<u64>(), generation in any::<u64>(), segment in any::<u32>(),
            len in 1u32.., offset in any::<u64>(), crc in any::<u32>(),
        ) {
            let r = Request {
                kind: if write { Kind::Write } else { Kind::Read },
                flags: if ck { FLAG_CHECKSUM } else { 0 },
                tag, transfer, epoch, node_generation: generation, segment, len, offset, crc,
            };
            prop_assert_eq!(Request::decode(&r.encode()).unwrap(), r);
        }

        #[test]
        fn responses_and_binds_round_trip(
            status in 0u8..4, len in any::<u32>(), tag in any::<u64>(), crc in any::<u32>(),
            refusal in any::<u8>(), node in any::<u64>(), generation in any::<u64>(),
        ) {
            let status = [Status::Ok, Status::Refused, Status::Corrupt, Status::BadRequest][status as usize];
            let r = Response { status, len: if status == Status::Ok { len } else { 0 }, tag, crc, refusal };
            prop_assert_eq!(Response::decode(&r.encode()).unwrap(), r);
            let b = Bind { node_id: node, node_generation: generation, purpose: if node % 2 == 0 { Purpose::Data } else { Purpose::Control } };
            prop_assert_eq!(Bind::decode(&b.encode()).unwrap(), b);
        }

        #[test]
        fn a_request_with_any_byte_changed_is_refused_or_reads_back_as_exactly_those_bytes(
            at in 0usize..Request::WIRE_BYTES, value in any::<u8>(), len in 1u32..,
        ) {
            let r = Request {
                kind: Kind::Read, flags: FLAG_CHECKSUM, tag: 9, transfer: 8, epoch: 7,
                node_generation: 6, segment: 5, len, offset: 4, crc: 0,
            };
            let mut b = r.encode();
            b[at] = value;
            if let Ok(parsed) = Request::decode(&b) {
                prop_assert_eq!(&parsed.encode()[..64], &b[..64], "the tag is not part of the value");
            }
        }
    }

    #[test]
    fn a_frame_of_another_version_or_kind_is_refused_with_the_reason() {
        let r = Request {
            kind: Kind::Write,
            flags: 0,
            tag: 1,
            transfer: 2,
            epoch: 3,
            node_generation: 4,
            segment: 5,
            len: 6,
            offset: 7,
            crc: 8,
        };
        let mut b = r.encode();
        b[2] = 9;
        assert!(
            Request::decode(&b)
                .unwrap_err()
                .to_string()
                .contains("version 9")
        );
        let mut b = r.encode();
        b[3] = 7;
        assert!(
            Request::decode(&b)
                .unwrap_err()
                .to_string()
                .contains("kind 7")
        );
        let mut b = r.encode();
        b[44..48].copy_from_slice(&0u32.to_le_bytes());
        assert!(Request::decode(&b).is_err(), "an empty chunk");
    }

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
