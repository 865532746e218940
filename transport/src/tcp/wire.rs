//! The TCP backend's frames. Every connection starts with the handshake ([`crate::link`]: the
//! authentication, then one [`crate::link::wire::Bind`] each way), then requests (initiator → target) and
//! responses (target → initiator) in order. Little-endian, fixed size, versioned. Every frame
//! ends in a 16-byte tag of the connection's key over its bytes and its place in the stream
//! ([`crate::auth::Sealer`]): a frame changed, replayed or reordered in flight closes the
//! connection.
//!
//! ```text
//! Request (96 bytes)                          Response (64 bytes)
//! 0  2 "KQ"                                   0  2 "KR"
//! 2  1 version                                2  1 version
//! 3  1 kind (1 write, 2 read)                 3  1 status (0 ok, 1 refused, 2 corrupt,
//!                                                          3 bad request)
//! 4  4 flags (bit 0: checksummed)             4  4 payload bytes that follow
//! 8  8 tag (the initiator's)                  8  8 tag
//! 16 8 transfer                               16 4 CRC-32C of the payload
//! 24 8 transfer epoch                         20 1 refusal code
//! 32 8 target node generation                 21 11 reserved (zero)
//! 40 4 segment                                32 16 payload MAC (a read's, where on)
//! 44 4 payload bytes                          48 16 integrity tag
//! 48 8 offset within the segment
//! 56 4 CRC-32C of the payload (write)
//! 60 4 reserved (zero)
//! 64 16 payload MAC (a write's, where on)
//! 80 16 integrity tag
//! ```
//!
//! A write request is followed by its payload; a read response with status ok by its
//! payload. Payloads are checked by their CRC-32C and, on a connection whose binds asked for
//! it, by their MAC ([`crate::auth::PayloadKey`]: the connection's own key, so an on-path
//! attacker who rewrites a payload and its CRC still fails it); both travel in the tagged
//! header, so neither can be changed unseen. A MAC field is zero where MACs are off. A
//! chunk's payload is at most the target's chunk limit; anything larger, an unknown kind,
//! magic or version, or a wrong tag closes the connection (it is out of step or hostile). The
//! offset is a number within a segment, checked against a grant; never an address.
//!
//! The Bind, and the [`crate::link::wire::Refusal`] a responder sends in its place, are the
//! handshake's frames ([`crate::link::wire`]); this file lays them out beside the backend's own
//! so that the picture is whole.

use crate::auth::{MAC_BYTES, TAG_BYTES};
use crate::error::Result;
pub use crate::link::wire::WIRE_VERSION;
use crate::link::wire::{check_head, protocol, u32_at, u64_at};

/// Flag: the payload carries a CRC-32C (request: of the write's payload; read: wanted back).
pub const FLAG_CHECKSUM: u32 = 1;

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
    /// MAC of a write's payload, where the connection has payload MACs (zero otherwise).
    pub mac: [u8; MAC_BYTES],
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
    /// MAC of a read's payload, where the connection has payload MACs (zero otherwise).
    pub mac: [u8; MAC_BYTES],
}

impl Request {
    /// Bytes on the wire.
    pub const WIRE_BYTES: usize = 64 + MAC_BYTES + TAG_BYTES;

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
        b[64..80].copy_from_slice(&self.mac);
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
        if b[60..64] != [0; 4] {
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
            mac: b[64..80].try_into().expect("16 bytes"),
        })
    }
}

impl Response {
    /// A header-only answer with `status` to request `tag` (no payload, checksum or MAC).
    pub fn header(tag: u64, status: Status) -> Response {
        Response {
            status,
            len: 0,
            tag,
            crc: 0,
            refusal: 0,
            mac: [0; MAC_BYTES],
        }
    }

    /// Bytes on the wire.
    pub const WIRE_BYTES: usize = 32 + MAC_BYTES + TAG_BYTES;

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
        b[32..48].copy_from_slice(&self.mac);
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
            mac: b[32..48].try_into().expect("16 bytes"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::wire::{Bind, Purpose};
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn requests_round_trip(
            write in any::<bool>(), ck in any::<bool>(), tag in any::<u64>(), transfer in any::<u64>(),
            epoch in any::<u64>(), generation in any::<u64>(), segment in any::<u32>(),
            len in 1u32.., offset in any::<u64>(), crc in any::<u32>(), mac in any::<[u8; 16]>(),
        ) {
            let r = Request {
                kind: if write { Kind::Write } else { Kind::Read },
                flags: if ck { FLAG_CHECKSUM } else { 0 },
                tag, transfer, epoch, node_generation: generation, segment, len, offset, crc, mac,
            };
            prop_assert_eq!(Request::decode(&r.encode()).unwrap(), r);
        }

        #[test]
        fn responses_and_binds_round_trip(
            status in 0u8..4, len in any::<u32>(), tag in any::<u64>(), crc in any::<u32>(),
            refusal in any::<u8>(), node in any::<u64>(), generation in any::<u64>(),
            mac in any::<[u8; 16]>(), to in any::<u64>(),
        ) {
            let status = [Status::Ok, Status::Refused, Status::Corrupt, Status::BadRequest][status as usize];
            let r = Response { status, len: if status == Status::Ok { len } else { 0 }, tag, crc, refusal, mac };
            prop_assert_eq!(Response::decode(&r.encode()).unwrap(), r);
            let b = Bind {
                node_id: node, node_generation: generation,
                purpose: if node % 2 == 0 { Purpose::Data } else { Purpose::Control },
                payload_mac: generation % 2 == 0, to_node: to,
            };
            prop_assert_eq!(Bind::decode(&b.encode()).unwrap(), b);
        }

        #[test]
        fn a_request_with_any_byte_changed_is_refused_or_reads_back_as_exactly_those_bytes(
            at in 0usize..Request::WIRE_BYTES, value in any::<u8>(), len in 1u32..,
        ) {
            let r = Request {
                kind: Kind::Read, flags: FLAG_CHECKSUM, tag: 9, transfer: 8, epoch: 7,
                node_generation: 6, segment: 5, len, offset: 4, crc: 0, mac: [3; 16],
            };
            let mut b = r.encode();
            b[at] = value;
            if let Ok(parsed) = Request::decode(&b) {
                prop_assert_eq!(&parsed.encode()[..80], &b[..80], "the tag is not part of the value");
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
            mac: [0; 16],
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
}
