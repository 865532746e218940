//! The RDMA side channel's messages, on an authenticated TCP connection of purpose
//! [`crate::link::wire::Purpose::Rdma`] to the peer's data port.
//!
//! ```text
//!  initiator                                   target
//!  Connect { our QP }              ───────▶    create a QP, move it to RTR/RTS with ours
//!                                  ◀───────    Connected { its QP }   (we move to RTR/RTS)
//!  Resolve { (transfer, epoch, generation, segment, offset, len, direction) × n }
//!                                  ───────▶    each checked against a live grant; the range
//!                                              registered for exactly that access
//!                                  ◀───────    Keys { (code, addr, rkey) × n }
//! ```
//!
//! Every frame is `kind: u8, 0, 0, 0, len: u32 LE` and `len` bytes (at most
//! [`MAX_FRAME_BYTES`]); little-endian fields; it travels as one message of the connection's
//! [`Channel`], tagged with its key (a queue pair number or a key changed in flight fails the
//! tag). A malformed frame closes the connection.

use super::verbs::QpInfo;
use crate::channel::Channel;
use crate::error::{Error, Result};
use crate::grant::{Direction, SegmentId, TransferId};

/// The largest frame payload either side sends or accepts.
pub const MAX_FRAME_BYTES: usize = 64 << 10;
/// Ranges one `Resolve` may carry (a batch's ops; the engine's batch bound is larger, so a
/// batch is resolved in several frames).
pub const MAX_RESOLVE: usize = 1024;

const CONNECT: u8 = 1;
const CONNECTED: u8 = 2;
const RESOLVE: u8 = 3;
const KEYS: u8 = 4;
const REFUSED: u8 = 5;

const QP_BYTES: usize = 32;
const ENTRY_BYTES: usize = 48;
const KEY_BYTES: usize = 16;

/// One access whose key the initiator asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyRequest {
    /// The transfer whose grant covers it.
    pub transfer: TransferId,
    /// Its epoch.
    pub epoch: u64,
    /// The target's incarnation the initiator's descriptor names.
    pub node_generation: u64,
    /// The target's segment.
    pub segment: SegmentId,
    /// First byte within it.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// What the initiator will do to it.
    pub direction: Direction,
}

/// The answer for one [`KeyRequest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key {
    /// 0: granted; otherwise the refusal code ([`crate::engine::OpFailure::Refused`]'s).
    pub code: u8,
    /// The address to name in work requests.
    pub addr: u64,
    /// The key.
    pub rkey: u32,
}

/// A side-channel message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// The initiator's queue pair.
    Connect(QpInfo),
    /// The target's queue pair, connected to the initiator's.
    Connected(QpInfo),
    /// Keys wanted.
    Resolve(Vec<KeyRequest>),
    /// Keys, one per request, in order.
    Keys(Vec<Key>),
    /// The target will not serve this (no RDMA here, too many queue pairs): why.
    Refused(String),
}

/// A refusal's reason as it travels: at most [`MAX_REASON_BYTES`], cut at a character boundary
/// (so that what one side decodes, re-encoded, is the same text).
fn reason(why: &str) -> &str {
    let mut end = why.len().min(MAX_REASON_BYTES);
    while !why.is_char_boundary(end) {
        end -= 1;
    }
    &why[..end]
}

/// The longest refusal reason sent or kept.
pub const MAX_REASON_BYTES: usize = 1024;

/// A side channel's failure on `what`; one closed at once (however the close meets us) says
/// what it usually means: the peer does not serve RDMA.
fn closed_means_no_rdma(what: &str, e: Error) -> Error {
    match e {
        Error::PeerUnavailable(m) if m.contains("closed") => protocol(format!(
            "{what}: {m} (a peer without RDMA closes the side channel at once)"
        )),
        e => protocol(format!("{what}: {e}")),
    }
}

fn protocol(what: impl Into<String>) -> Error {
    Error::PeerUnavailable(format!("RDMA side channel: {}", what.into()))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn put_qp(out: &mut Vec<u8>, q: &QpInfo) {
    out.extend_from_slice(&q.qpn.to_le_bytes());
    out.extend_from_slice(&q.psn.to_le_bytes());
    out.extend_from_slice(&q.mtu.to_le_bytes());
    out.extend_from_slice(&q.lid.to_le_bytes());
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&q.gid);
}

fn qp_of(b: &[u8]) -> Result<QpInfo> {
    if b.len() != QP_BYTES {
        return Err(protocol(format!(
            "a queue pair is {QP_BYTES} bytes, not {}",
            b.len()
        )));
    }
    let mut gid = [0u8; 16];
    gid.copy_from_slice(&b[16..32]);
    Ok(QpInfo {
        qpn: u32_at(b, 0),
        psn: u32_at(b, 4),
        mtu: u32_at(b, 8),
        lid: u16::from_le_bytes([b[12], b[13]]),
        gid,
    })
}

impl Message {
    /// The frame (header and payload).
    pub fn encode(&self) -> Vec<u8> {
        let mut p = Vec::new();
        let kind = match self {
            Message::Connect(q) => {
                put_qp(&mut p, q);
                CONNECT
            }
            Message::Connected(q) => {
                put_qp(&mut p, q);
                CONNECTED
            }
            Message::Resolve(rs) => {
                for r in rs {
                    p.extend_from_slice(&r.transfer.0.to_le_bytes());
                    p.extend_from_slice(&r.epoch.to_le_bytes());
                    p.extend_from_slice(&r.node_generation.to_le_bytes());
                    p.extend_from_slice(&r.offset.to_le_bytes());
                    p.extend_from_slice(&r.len.to_le_bytes());
                    p.extend_from_slice(&r.segment.0.to_le_bytes());
                    p.push(match r.direction {
                        Direction::RemoteRead => 1,
                        Direction::RemoteWrite => 2,
                    });
                    p.extend_from_slice(&[0, 0, 0]);
                }
                RESOLVE
            }
            Message::Keys(ks) => {
                for k in ks {
                    p.push(k.code);
                    p.extend_from_slice(&[0, 0, 0]);
                    p.extend_from_slice(&k.rkey.to_le_bytes());
                    p.extend_from_slice(&k.addr.to_le_bytes());
                }
                KEYS
            }
            Message::Refused(why) => {
                p.extend_from_slice(reason(why).as_bytes());
                REFUSED
            }
        };
        let mut f = Vec::with_capacity(8 + p.len());
        f.extend_from_slice(&[kind, 0, 0, 0]);
        f.extend_from_slice(&(p.len() as u32).to_le_bytes());
        f.extend_from_slice(&p);
        f
    }

    /// A frame's message from its kind and payload.
    ///
    /// # Errors
    /// [`Error::PeerUnavailable`] for anything malformed.
    pub fn decode(kind: u8, p: &[u8]) -> Result<Message> {
        let entries = |size: usize, max: usize| -> Result<usize> {
            if p.len() % size != 0 || p.len() / size > max {
                return Err(protocol(format!(
                    "a list of {size}-byte entries (at most {max}), not {} bytes",
                    p.len()
                )));
            }
            Ok(p.len() / size)
        };
        Ok(match kind {
            CONNECT => Message::Connect(qp_of(p)?),
            CONNECTED => Message::Connected(qp_of(p)?),
            RESOLVE => {
                let n = entries(ENTRY_BYTES, MAX_RESOLVE)?;
                let mut rs = Vec::with_capacity(n);
                for e in p.chunks_exact(ENTRY_BYTES) {
                    let direction = match e[44] {
                        1 => Direction::RemoteRead,
                        2 => Direction::RemoteWrite,
                        d => return Err(protocol(format!("unknown direction {d}"))),
                    };
                    rs.push(KeyRequest {
                        transfer: TransferId(u64_at(e, 0)),
                        epoch: u64_at(e, 8),
                        node_generation: u64_at(e, 16),
                        offset: u64_at(e, 24),
                        len: u64_at(e, 32),
                        segment: SegmentId(u32_at(e, 40)),
                        direction,
                    });
                }
                Message::Resolve(rs)
            }
            KEYS => {
                let n = entries(KEY_BYTES, MAX_RESOLVE)?;
                let mut ks = Vec::with_capacity(n);
                for e in p.chunks_exact(KEY_BYTES) {
                    ks.push(Key {
                        code: e[0],
                        rkey: u32_at(e, 4),
                        addr: u64_at(e, 8),
                    });
                }
                Message::Keys(ks)
            }
            REFUSED => Message::Refused(reason(&String::from_utf8_lossy(p)).to_string()),
            k => return Err(protocol(format!("unknown message kind {k}"))),
        })
    }

    /// Send the frame on the side channel (tagged by the channel).
    ///
    /// # Errors
    /// [`Error::PeerUnavailable`] when the connection fails.
    pub fn send(&self, ch: &mut Channel) -> Result<()> {
        ch.send(&self.encode())
            .map_err(|e| closed_means_no_rdma("send", e))
    }

    /// Receive one frame from the side channel, its tag checked.
    ///
    /// # Errors
    /// [`Error::PeerUnavailable`] when the connection fails or the frame is malformed or
    /// fails its tag.
    pub fn recv(ch: &mut Channel) -> Result<Message> {
        let f = ch
            .recv(8 + MAX_FRAME_BYTES)
            .map_err(|e| closed_means_no_rdma("receive", e))?;
        Message::parse(&f)
    }

    /// Parse one whole frame (header and payload, nothing else).
    ///
    /// # Errors
    /// [`Error::PeerUnavailable`] for a frame that is malformed or whose length disagrees
    /// with its bytes.
    pub fn parse(f: &[u8]) -> Result<Message> {
        let Some(h) = f.first_chunk::<8>() else {
            return Err(protocol("a frame shorter than its header"));
        };
        let len = u32_at(h, 4) as usize;
        if len > MAX_FRAME_BYTES || f.len() - 8 != len {
            return Err(protocol(format!(
                "a frame announcing {len} bytes with {} (at most {MAX_FRAME_BYTES})",
                f.len() - 8
            )));
        }
        Message::decode(h[0], &f[8..])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn roundtrip(m: &Message) -> Message {
        let f = m.encode();
        Message::parse(&f).unwrap()
    }

    proptest! {
        #[test]
        fn every_message_reads_back_as_itself(
            qpn in any::<u32>(), psn in any::<u32>(), lid in any::<u16>(), gid in any::<[u8; 16]>(),
            reqs in proptest::collection::vec((any::<u64>(), any::<u64>(), any::<u32>(), any::<bool>()), 0..40),
        ) {
            let q = QpInfo { qpn, psn, lid, gid, mtu: 4096 };
            prop_assert_eq!(roundtrip(&Message::Connect(q)), Message::Connect(q));
            prop_assert_eq!(roundtrip(&Message::Connected(q)), Message::Connected(q));
            let rs: Vec<KeyRequest> = reqs.iter().map(|&(a, b, c, w)| KeyRequest {
                transfer: TransferId(a), epoch: b, node_generation: a ^ b, segment: SegmentId(c),
                offset: b / 2, len: a / 3,
                direction: if w { Direction::RemoteWrite } else { Direction::RemoteRead },
            }).collect();
            prop_assert_eq!(roundtrip(&Message::Resolve(rs.clone())), Message::Resolve(rs));
            let ks: Vec<Key> = reqs.iter().map(|&(a, _, c, w)| Key { code: u8::from(w), addr: a, rkey: c }).collect();
            prop_assert_eq!(roundtrip(&Message::Keys(ks.clone())), Message::Keys(ks));
        }

        #[test]
        fn any_bytes_decode_to_a_message_or_an_error_never_a_panic(
            kind in any::<u8>(), p in proptest::collection::vec(any::<u8>(), 0..200),
        ) {
            let _ = Message::decode(kind, &p);
        }
    }

    #[test]
    fn a_long_refusal_with_broken_utf8_decodes_to_text_that_re_encodes_to_itself() {
        // found by the transport_wire fuzz target: a reason cut inside a character, or one
        // whose replacement characters grew it past the bound, changed on a second trip
        let mut p = vec![0xe2u8; 700];
        p.extend(std::iter::repeat_n(b'a', 600));
        let m = Message::decode(REFUSED, &p).unwrap();
        let Message::Refused(why) = &m else { panic!() };
        assert!(why.len() <= MAX_REASON_BYTES);
        assert_eq!(roundtrip(&m), m);
        let long = Message::Refused("é".repeat(700));
        let Message::Refused(cut) = roundtrip(&long) else {
            panic!()
        };
        assert!(cut.len() <= MAX_REASON_BYTES && cut.chars().all(|c| c == 'é'));
    }

    #[test]
    fn frames_past_the_bound_and_unknown_fields_are_refused() {
        let mut f = vec![RESOLVE, 0, 0, 0];
        f.extend_from_slice(&((MAX_FRAME_BYTES as u32) + 1).to_le_bytes());
        assert!(Message::parse(&f).is_err());
        assert!(Message::parse(&f[..3]).is_err(), "shorter than a header");
        // more entries than one Resolve may carry
        let too_many = vec![0u8; ENTRY_BYTES * (MAX_RESOLVE + 1)];
        assert!(Message::decode(RESOLVE, &too_many).is_err());
        // a ragged list
        assert!(Message::decode(KEYS, &[0u8; KEY_BYTES + 1]).is_err());
        // a direction that is neither
        let mut e = vec![0u8; ENTRY_BYTES];
        e[44] = 9;
        assert!(Message::decode(RESOLVE, &e).is_err());
        assert!(Message::decode(CONNECT, &[0u8; QP_BYTES - 1]).is_err());
        assert!(Message::decode(77, &[]).is_err());
    }
}
