//! Daemon-to-daemon messages, on a control connection of the data port (authenticated by the
//! transfer engine's handshake, which also told each side the other's node id and generation).
//! Framed as the local protocol frames its messages (`kvd_core::protocol::frame`, postcard
//! bodies, at most [`crate::protocol::MAX_FRAME_BYTES`]), each frame one message of the
//! connection's [`Channel`], tagged with the key its handshake agreed: a key, a checksum or a
//! binding changed in flight fails the tag and closes the connection (the transfer it carried
//! aborts, nothing of it is published). One request, one reply, in order.
//!
//! A push from A to B:
//!
//! ```text
//! A                                                   B
//! Offer { binding, namespaces, blocks } ────────────▶ check the binding, allocate WRITING
//!                                                     pages (NoSpace before any byte moves),
//!                                                     grant each page for this transfer
//!   ◀──────────── Accepted { transfer, segment, offsets }  (None: B has that block already)
//! one batch of writes over the transfer engine ─────▶ every chunk's CRC-32C checked
//! Commit { transfer } ──────────────────────────────▶ revoke the grants, seal each block
//!                                                     (its CRC-32C computed and compared with
//!                                                     the offered one), publish the group
//!   ◀──────────────────────────── Committed { blocks }
//! (Abort { transfer }, a closed connection, or B's deadline: B aborts and frees the pages)
//! ```
//!
//! A fetch by B from A (B asks, A serves):
//!
//! ```text
//! B                                                   A
//! Want { binding, keys } ───────────────────────────▶ check the binding, pin the blocks,
//!                                                     grant each page for reading
//!   ◀──────────── Offering { transfer, segment, namespace, blocks }  (None: A lacks it)
//! allocate WRITING pages (NoSpace: Release at once), one batch of reads ◀── chunks, each
//! CRC-32C checked here; seal each block, compare its CRC-32C with A's, publish the group
//! Release { transfer } ─────────────────────────────▶ revoke the grants, unpin
//!   ◀──────────────────────────── Released
//! ```
//!
//! A hand-off fetch is the same with the binding naming the run's request and epoch: A serves
//! it only while its hold of that request lives at exactly that epoch and only for keys inside
//! the held run (`kvd_store::holds`). When B asked for it, it ends the hold once everything
//! was published: `EndHold { binding }` ─▶ A ends the hold (if still of that epoch) ◀─
//! `HoldEnded`.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use transport::channel::Channel;

use crate::keys::{BlockKey, NamespaceDescriptor, NamespaceId};
use crate::protocol::WireError;
use crate::protocol::frame::{FRAME_HEADER_BYTES, MAX_FRAME_BYTES, decode_frame, encode};
use crate::{Error, Result};

/// Send one message on a control connection.
///
/// # Errors
/// [`Error::InvalidArgument`] for a message over the frame bound; [`Error::Disconnected`]
/// when the connection fails.
pub fn send<T: Serialize>(ch: &mut Channel, msg: &T) -> Result<()> {
    ch.send(&encode(msg)?)
        .map_err(|e| Error::Disconnected(format!("the peer's control connection: {e}")))
}

/// Receive one message from a control connection, its tag checked.
///
/// # Errors
/// [`Error::Disconnected`] when the connection fails, closes, or a frame fails its tag or
/// the bound; [`Error::Protocol`] for a frame that is not one message of type `T`.
pub fn recv<T: DeserializeOwned>(ch: &mut Channel) -> Result<T> {
    let f = ch
        .recv(FRAME_HEADER_BYTES + MAX_FRAME_BYTES as usize)
        .map_err(|e| Error::Disconnected(format!("the peer's control connection: {e}")))?;
    decode_frame(&f)
}

/// One request, its reply.
///
/// # Errors
/// As [`send`] and [`recv`].
pub fn ask(ch: &mut Channel, req: &PeerRequest) -> Result<PeerReply> {
    send(ch, req)?;
    recv(ch)
}

/// What a transfer is bound to (invariant 6 of docs/ARCHITECTURE.md). The receiver checks every field it can
/// against what it knows and drops the transfer, counted, on a mismatch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Binding {
    /// The request the blocks belong to (0: none, plain cache blocks).
    pub request: u64,
    /// The blocks' namespace.
    pub namespace: NamespaceId,
    /// The source node and its incarnation.
    pub source_node: u64,
    /// The source's node generation.
    pub source_generation: u64,
    /// The destination node.
    pub destination_node: u64,
    /// The destination's node generation, as the source learnt it at the handshake.
    pub destination_generation: u64,
    /// The transfer epoch: a newer one for the same (source, request) supersedes older ones.
    pub epoch: u64,
}

/// One block offered in a push.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Offered {
    /// Its key.
    pub key: BlockKey,
    /// Valid bytes.
    pub len: u64,
    /// Its CRC-32C, as sealed on the source.
    pub checksum: u32,
}

/// What makes a push a checkpoint step: the destination extends its manifest of the
/// binding's request (at the binding's epoch) with the blocks instead of publishing them as
/// cache blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointStep {
    /// The request's committed token count after this step.
    pub committed_tokens: u64,
    /// The destination manifest's TTL, ms (used when the step begins it).
    pub ttl_ms: u64,
}

/// One block a fetch's source serves: where it is in its pool, and what it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Served {
    /// Its page's offset in the source's pool segment.
    pub offset: u64,
    /// Valid bytes.
    pub len: u64,
    /// Its CRC-32C, as sealed on the source.
    pub checksum: u32,
}

/// A request from one daemon to another.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum PeerRequest {
    /// Please receive these blocks → [`PeerReply::Accepted`].
    Offer {
        /// What the transfer is bound to.
        binding: Binding,
        /// The layout of the blocks' namespace (registered on the destination if new).
        namespace: Box<NamespaceDescriptor>,
        /// The blocks (at most the destination's batch bound).
        blocks: Vec<Offered>,
        /// Set for a checkpoint step.
        checkpoint: Option<CheckpointStep>,
    },
    /// Every byte was written: verify and publish → [`PeerReply::Committed`].
    Commit {
        /// The destination's transfer number.
        transfer: u64,
    },
    /// Give up: free the pages → [`PeerReply::Aborted`].
    Abort {
        /// The destination's transfer number.
        transfer: u64,
    },
    /// Please let me read these blocks (a fetch) → [`PeerReply::Offering`]. The binding names
    /// the asker as destination and the asked as source.
    Want {
        /// What the transfer is bound to.
        binding: Binding,
        /// The blocks (one namespace, at most the source's batch bound).
        keys: Vec<BlockKey>,
    },
    /// Please let me read the longest verified prefix of the binding's request's checkpoint
    /// that `tokens` continues (the recovery read) → [`PeerReply::Offering`].
    WantPrefix {
        /// What the transfer is bound to (its request is the one asked for).
        binding: Binding,
        /// The request's token history.
        tokens: Vec<u32>,
    },
    /// The fetch is over (done or not): unpin → [`PeerReply::Released`].
    Release {
        /// The source's transfer number.
        transfer: u64,
    },
    /// A hand-off fetch published its whole run here: end the hold it was bound to (the
    /// binding's request and epoch) → [`PeerReply::HoldEnded`].
    EndHold {
        /// The fetch's binding.
        binding: Binding,
    },
    /// Which of these keys are PUBLISHED here (a cluster lookup's locate: nothing is pinned,
    /// so the answer may be stale by the fetch) → [`PeerReply::Have`].
    Have {
        /// The keys (at most the asked node's batch bound).
        keys: Vec<BlockKey>,
    },
}

/// A reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum PeerReply {
    /// Pages allocated and granted.
    Accepted {
        /// The destination's transfer number (the grants' transfer id).
        transfer: u64,
        /// The destination pool's segment descriptor (its 32-byte wire form).
        segment: Vec<u8>,
        /// Per offered block: the page offset to write it to, or `None` when the destination
        /// holds that key already (nothing to send).
        offsets: Vec<Option<u64>>,
    },
    /// Verified and published as one group.
    Committed {
        /// Blocks published.
        blocks: u32,
    },
    /// Aborted; nothing of it was published.
    Aborted,
    /// The wanted blocks, pinned and granted for reading.
    Offering {
        /// The source's transfer number (the grants' transfer id).
        transfer: u64,
        /// The source pool's segment descriptor (its 32-byte wire form).
        segment: Vec<u8>,
        /// The blocks' layout.
        namespace: Box<NamespaceDescriptor>,
        /// Per wanted key: where it is, or `None` when the source does not hold it.
        blocks: Vec<Option<Served>>,
        /// For a prefix: the keys, in order (empty for a fetch by key).
        keys: Vec<BlockKey>,
        /// For a prefix: the tokens its blocks cover.
        tokens: u64,
    },
    /// Unpinned.
    Released,
    /// The hold ended (`true`), or there was none of that epoch (`false`).
    HoldEnded(bool),
    /// Per asked key, whether it is PUBLISHED here (bit i of byte i / 8, least significant
    /// first).
    Have(Vec<u8>),
    /// Refused; nothing changed (or everything was undone).
    Refused(WireError),
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use transport::auth::{ClusterSecret, Initiator, Responder, Role};

    /// Two ends of a loopback control connection, keyed by a real handshake, in one process.
    fn pair() -> (Channel, Channel) {
        let s = ClusterSecret::from_bytes(&[9; 32]).unwrap();
        let (i, hello) = Initiator::start(&s).unwrap();
        let (r, c) = Responder::answer(&s, &hello).unwrap();
        let (p, ki) = i.respond(&c).unwrap();
        let kr = r.verify(&p).unwrap();
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        let (si, ui) = ki.key.split(Role::Initiator);
        let (sr, ur) = kr.key.split(Role::Responder);
        (Channel::new(a, si, ui, None), Channel::new(b, sr, ur, None))
    }

    #[test]
    fn a_request_and_its_reply_cross_a_control_connection_and_a_changed_frame_does_not() {
        let (mut src, mut dst) = pair();
        let server = std::thread::spawn(move || {
            let req: PeerRequest = recv(&mut dst).unwrap();
            let PeerRequest::Commit { transfer } = req else {
                panic!("{req:?}")
            };
            send(
                &mut dst,
                &PeerReply::Committed {
                    blocks: transfer as u32,
                },
            )
            .unwrap();
            // the next frame arrives changed on the way: refused, the connection unusable
            let e = recv::<PeerRequest>(&mut dst).unwrap_err();
            assert!(e.to_string().contains("integrity"), "{e}");
        });
        let r = ask(&mut src, &PeerRequest::Commit { transfer: 7 }).unwrap();
        assert_eq!(r, PeerReply::Committed { blocks: 7 });
        // a frame with a forged tag (what a changed one looks like to the receiver)
        let frame = crate::protocol::frame::encode(&PeerRequest::Abort { transfer: 7 }).unwrap();
        let mut raw = (frame.len() as u32).to_le_bytes().to_vec();
        raw.extend_from_slice(&frame);
        raw.extend_from_slice(&[0u8; transport::auth::TAG_BYTES]);
        src.stream().write_all(&raw).unwrap();
        server.join().unwrap();
    }
}
