//! One frame on the Unix socket:
//!
//! ```text
//! offset  size  field
//! 0       2     magic  b"KV"
//! 2       2     protocol version, little-endian (2)
//! 4       4     body length in bytes, little-endian, at most MAX_FRAME_BYTES
//! 8       len   body: one message, postcard-encoded (serde)
//! ```
//!
//! The header is checked before any body byte is read: bad magic (random bytes, another
//! protocol), another version, or a length over the bound is a [`Error::Protocol`] and the
//! connection closes; nothing is allocated for the announced length. A body that does not decode
//! as exactly one message (truncated, trailing bytes, unknown variant) is a `Protocol` error too.
//!
//! Why postcard: a serde format with a documented, stable wire specification, varint integers
//! (small frames for handles and counts), no schema compiler, and decoding that never trusts a
//! length it has not got the bytes for.

use std::io::{Read, Write};

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::{Error, Result};

/// The first two bytes of every frame.
pub const MAGIC: [u8; 2] = *b"KV";
/// The version this build speaks. A peer with another version is refused at the handshake.
/// 2: compare-and-delete names a [`crate::types::BlockVersion`] (node generation included);
/// `ReportCorrupt`.
pub const PROTOCOL_VERSION: u16 = 2;
/// Header bytes before the body.
pub const FRAME_HEADER_BYTES: usize = 8;
/// The largest body either side accepts (1 MiB): a batch of 1024 keys or handles, with per-item
/// results, fits many times over.
pub const MAX_FRAME_BYTES: u32 = 1 << 20;

/// A decoded header: the body length that follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// The version the peer wrote.
    pub version: u16,
    /// Body bytes that follow.
    pub body_len: u32,
}

/// Check a header.
///
/// # Errors
/// [`Error::Protocol`] for bad magic, another version, or a body longer than `max_body`.
pub fn decode_header(h: &[u8; FRAME_HEADER_BYTES], max_body: u32) -> Result<FrameHeader> {
    if h[0..2] != MAGIC {
        return Err(Error::Protocol(format!(
            "bad magic {:02x}{:02x}: not a kvd frame",
            h[0], h[1]
        )));
    }
    let version = u16::from_le_bytes([h[2], h[3]]);
    if version != PROTOCOL_VERSION {
        return Err(Error::Protocol(format!(
            "peer speaks protocol version {version}, this side speaks {PROTOCOL_VERSION}"
        )));
    }
    let body_len = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
    if body_len > max_body {
        return Err(Error::Protocol(format!(
            "frame of {body_len} bytes exceeds the limit of {max_body}"
        )));
    }
    Ok(FrameHeader { version, body_len })
}

/// Encode one message as a whole frame (header and body).
///
/// # Errors
/// [`Error::InvalidArgument`] if the encoded body is over [`MAX_FRAME_BYTES`] (split the batch).
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(64);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    let mut out = postcard::to_extend(msg, out)
        .map_err(|e| Error::InvalidArgument(format!("encoding a message: {e}")))?;
    let body = out.len() - FRAME_HEADER_BYTES;
    if body > MAX_FRAME_BYTES as usize {
        return Err(Error::InvalidArgument(format!(
            "message of {body} bytes exceeds the {MAX_FRAME_BYTES}-byte frame limit; split the batch"
        )));
    }
    out[4..8].copy_from_slice(&(body as u32).to_le_bytes());
    Ok(out)
}

/// Decode a body as exactly one message.
///
/// # Errors
/// [`Error::Protocol`] if the bytes are not one whole message of type `T`.
pub fn decode_body<T: DeserializeOwned>(body: &[u8]) -> Result<T> {
    let (msg, rest) = postcard::take_from_bytes::<T>(body)
        .map_err(|e| Error::Protocol(format!("malformed message: {e}")))?;
    if !rest.is_empty() {
        return Err(Error::Protocol(format!(
            "{} trailing bytes after the message",
            rest.len()
        )));
    }
    Ok(msg)
}

/// Decode a whole frame held in memory (header and body, nothing else).
///
/// # Errors
/// As [`decode_header`] and [`decode_body`]; a length that disagrees with the bytes given is a
/// `Protocol` error.
pub fn decode_frame<T: DeserializeOwned>(bytes: &[u8]) -> Result<T> {
    let Some(h) = bytes.first_chunk::<FRAME_HEADER_BYTES>() else {
        return Err(Error::Protocol("truncated frame header".into()));
    };
    let h = decode_header(h, MAX_FRAME_BYTES)?;
    let body = &bytes[FRAME_HEADER_BYTES..];
    if body.len() != h.body_len as usize {
        return Err(Error::Protocol(format!(
            "frame announces {} body bytes, {} present",
            h.body_len,
            body.len()
        )));
    }
    decode_body(body)
}

/// Write one message as a frame (blocking).
///
/// # Errors
/// Encoding errors as [`encode`]; [`Error::Io`] when the socket fails.
pub fn write_frame<W: Write, T: Serialize>(w: &mut W, msg: &T) -> Result<()> {
    let bytes = encode(msg)?;
    w.write_all(&bytes)?;
    Ok(())
}

/// Read one frame and decode it (blocking).
///
/// # Errors
/// [`Error::Io`] when the stream fails or ends (a closed connection reads as
/// `Io("connection closed")`); `Protocol` errors as [`decode_header`] and [`decode_body`].
pub fn read_frame<R: Read, T: DeserializeOwned>(r: &mut R) -> Result<T> {
    let mut h = [0u8; FRAME_HEADER_BYTES];
    read_exact(r, &mut h)?;
    let h = decode_header(&h, MAX_FRAME_BYTES)?;
    let mut body = vec![0u8; h.body_len as usize];
    read_exact(r, &mut body)?;
    decode_body(&body)
}

fn read_exact<R: Read>(r: &mut R, buf: &mut [u8]) -> Result<()> {
    r.read_exact(buf).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            Error::Io("connection closed by the peer".into())
        } else {
            Error::Io(e.to_string())
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::messages::{Hello, Op, Request, Response};
    use proptest::prelude::*;

    #[test]
    fn a_request_round_trips_through_a_frame() {
        let r = Request {
            id: 7,
            request: Some(42),
            op: Op::Heartbeat,
        };
        let bytes = encode(&r).unwrap();
        assert_eq!(&bytes[0..2], b"KV");
        assert_eq!(u16::from_le_bytes([bytes[2], bytes[3]]), PROTOCOL_VERSION);
        let back: Request = decode_frame(&bytes).unwrap();
        assert_eq!(back, r);
        let mut cursor = std::io::Cursor::new(bytes);
        let back: Request = read_frame(&mut cursor).unwrap();
        assert_eq!(back, r);
    }

    #[test]
    fn a_wrong_version_is_a_protocol_error_naming_both_versions() {
        let mut bytes = encode(&Hello::new("x", 1000)).unwrap();
        bytes[2] = 9;
        let e = decode_frame::<Hello>(&bytes).unwrap_err();
        assert!(
            matches!(&e, Error::Protocol(m) if m.contains("version 9")),
            "{e}"
        );
    }

    #[test]
    fn an_oversize_length_is_refused_before_reading_the_body() {
        let mut h = [0u8; FRAME_HEADER_BYTES];
        h[0..2].copy_from_slice(&MAGIC);
        h[2..4].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        h[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        let e = decode_header(&h, MAX_FRAME_BYTES).unwrap_err();
        assert!(matches!(e, Error::Protocol(_)));
    }

    #[test]
    fn a_truncated_frame_is_a_clean_error() {
        let bytes = encode(&Request {
            id: 1,
            request: None,
            op: Op::Stats,
        })
        .unwrap();
        for cut in 0..bytes.len() {
            assert!(decode_frame::<Request>(&bytes[..cut]).is_err(), "cut {cut}");
            let mut c = std::io::Cursor::new(&bytes[..cut]);
            assert!(read_frame::<_, Request>(&mut c).is_err(), "cut {cut}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// The decoder never panics and never allocates past the bound, whatever it is fed.
        #[test]
        fn random_bytes_never_panic_the_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_frame::<Request>(&bytes);
            let _ = decode_frame::<Response>(&bytes);
            let _ = decode_frame::<Hello>(&bytes);
            let _ = decode_body::<Request>(&bytes);
        }

        /// Random bodies behind a valid header: errors, never panics.
        #[test]
        fn random_bodies_behind_a_valid_header_never_panic(body in proptest::collection::vec(any::<u8>(), 0..512)) {
            let mut bytes = Vec::new();
            bytes.extend_from_slice(&MAGIC);
            bytes.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
            bytes.extend_from_slice(&(body.len() as u32).to_le_bytes());
            bytes.extend_from_slice(&body);
            let _ = decode_frame::<Request>(&bytes);
            let mut c = std::io::Cursor::new(bytes);
            let _ = read_frame::<_, Request>(&mut c);
        }

        /// Flipping any byte of a valid frame gives an error or a (different) valid message,
        /// never a panic.
        #[test]
        fn a_corrupted_valid_frame_never_panics(pos in 0usize..200, val in any::<u8>(), n in 0usize..64) {
            let keys = vec![crate::keys::BlockKey {
                namespace: crate::keys::NamespaceId([1; 32]),
                tag: crate::keys::BlockTag([2; 32]),
            }; n];
            let mut bytes = encode(&Request { id: 3, request: None, op: Op::Exists { keys } }).unwrap();
            let p = pos % bytes.len();
            bytes[p] = val;
            let _ = decode_frame::<Request>(&bytes);
        }
    }
}
