//! The local protocol between an engine (through `kvd-client`) and the daemon, over a Unix
//! socket. Only metadata crosses the socket; page bytes move through the pool mapping.
//!
//! ```text
//! client                                   daemon
//!   ── Hello{version, name, lease_ttl_ms} ──▶
//!   ◀── Welcome{session, node generation, page geometry, limits} + pool memfd (SCM_RIGHTS)
//!   ── Request{id, request?, Op} ──────────▶   (pipelined, at most `max_inflight` unanswered)
//!   ◀── Response{id, Result<Reply, WireError>}
//! ```
//!
//! - [`frame`]: the byte layout of one frame (magic, version, length, postcard body), its
//!   bounds, and the one encoder/decoder the daemon and the client share.
//! - [`messages`]: what the frames carry. Every data operation is batched.
//! - [`fdpass`]: sending and receiving the pool's file descriptor (SCM_RIGHTS).

pub mod fdpass;
pub mod frame;
pub mod messages;
pub mod spin;

pub use frame::{FRAME_HEADER_BYTES, MAGIC, MAX_FRAME_BYTES, PROTOCOL_VERSION};
pub use messages::*;
