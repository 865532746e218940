//! The crate's one error enum.
//!
//! Each variant is a situation a caller can act on, and maps 1:1 to a C status code in `ffi`
//! (see [`Error::code`]). Every error leaves the store unchanged: an operation that fails does
//! nothing.

use serde::{Deserialize, Serialize};

/// Shorthand for results whose error is [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The lifecycle states a block can be in, as named in errors and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BlockState {
    /// Space taken, no byte written yet.
    Allocated,
    /// The writer has started writing bytes.
    Writing,
    /// Every byte written, checksum recorded; the bytes are immutable from here on.
    Sealed,
    /// Visible to lookups and reads by others.
    Published,
    /// Removed from the index while readers still pin it; the page returns when the last pin goes.
    Retired,
    /// Failed its checksum; never read again, held apart from the pool for a while.
    Quarantined,
}

impl std::fmt::Display for BlockState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            BlockState::Allocated => "ALLOCATED",
            BlockState::Writing => "WRITING",
            BlockState::Sealed => "SEALED",
            BlockState::Published => "PUBLISHED",
            BlockState::Retired => "RETIRED",
            BlockState::Quarantined => "QUARANTINED",
        };
        f.write_str(s)
    }
}

/// Everything that can go wrong in kvd.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum Error {
    /// The handle names a block that no longer exists (its slot was reused, or the node
    /// restarted). Look the key up again.
    #[error(
        "stale generation: handle names node generation {handle_node}/slot generation {handle_slot}, \
         current is {current_node}/{current_slot}; look the key up again"
    )]
    StaleGeneration {
        /// Node generation in the handle.
        handle_node: u64,
        /// Slot generation in the handle.
        handle_slot: u64,
        /// This node's generation.
        current_node: u64,
        /// The slot's current generation (0 when the slot is free).
        current_slot: u64,
    },
    /// The block is not in a state that allows this operation; nothing changed.
    #[error("illegal transition: cannot {op} a block in state {from}")]
    IllegalTransition {
        /// The state the block is in.
        from: BlockState,
        /// The operation that was refused.
        op: &'static str,
    },
    /// Not enough free space (after reservations and eviction). Retryable: space frees as
    /// requests finish and pins drop.
    #[error(
        "no space: {requested_bytes} bytes requested, {free_bytes} free and unreserved; retry later or free blocks"
    )]
    NoSpace {
        /// What the operation needed.
        requested_bytes: u64,
        /// What was free and not reserved by others.
        free_bytes: u64,
    },
    /// A bound was reached (sessions, pins, in-flight operations, queue). Retryable.
    #[error("overloaded: {what}; retry after {retry_after_ms} ms")]
    Overloaded {
        /// Which bound was reached.
        what: String,
        /// A hint for when to try again.
        retry_after_ms: u64,
    },
    /// No such key, session, request, reservation or worker.
    #[error("not found: {0}")]
    NotFound(String),
    /// The key exists already (published or being written by someone).
    #[error("already exists: {0}")]
    AlreadyExists(String),
    /// The block's bytes did not match their checksum. Treat as a miss. `outcome` says what
    /// was found and done about it.
    #[error(
        "corrupt: block failed its checksum (expected {expected:#010x}, found {found:#010x}); {outcome}"
    )]
    Corrupt {
        /// The checksum recorded at SEAL.
        expected: u32,
        /// The checksum of the bytes read.
        found: u32,
        /// Where the mismatch was and what the daemon did.
        outcome: Corruption,
    },
    /// An argument was malformed or out of range; nothing changed.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The session's lease (or the manifest's TTL) expired; its work was released. Open a new
    /// session.
    #[error("lease expired: {0}")]
    LeaseExpired(String),
    /// The caller acted on an older epoch than the current one; the event was dropped.
    #[error("stale epoch: event for epoch {got}, current epoch is {current}")]
    StaleEpoch {
        /// The epoch the caller named.
        got: u64,
        /// The current epoch.
        current: u64,
    },
    /// The operation cannot finish before its deadline or within its budget; it failed fast.
    #[error("deadline: {0}")]
    Deadline(String),
    /// The node is draining or shutting down and takes no new work. Go to another node.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// The peer speaks another protocol version or sent a malformed message.
    #[error("protocol: {0}")]
    Protocol(String),
    /// An operating-system call failed (mapping memory, sockets).
    #[error("io: {0}")]
    Io(String),
    /// The client's connection to its daemon failed (a timeout, the daemon died or restarted,
    /// the stream fell out of step). The session and its pins are gone: every later call and
    /// every read of the mapping fails with this until the client reconnects. Retryable after
    /// a reconnect.
    #[error("disconnected: {0}; reconnect (Client::reconnect) and look the blocks up again")]
    Disconnected(String),
    /// The operation needs something this build or host lacks (a library built without the
    /// `cuda` feature, no CUDA driver, a driver that refuses it). Nothing changed; retrying here
    /// cannot succeed.
    #[error("unsupported: {0}")]
    Unsupported(String),
}

/// What a checksum mismatch meant, in [`Error::Corrupt`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Corruption {
    /// The daemon's own copy failed its check: the block is quarantined (never read again).
    Quarantined,
    /// A reader's copy failed, the daemon re-checked its own and found it intact: nothing was
    /// quarantined; read again.
    ReaderCopy,
    /// At seal, the checksum the writer supplied does not match the bytes written; the block
    /// stays unsealed.
    AtSeal,
}

impl std::fmt::Display for Corruption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Corruption::Quarantined => "the daemon quarantined the block; treat it as a miss",
            Corruption::ReaderCopy => {
                "the daemon re-checked its own copy and found it intact, so nothing was \
                 quarantined; the bytes changed in this reader's copy: read again"
            }
            Corruption::AtSeal => {
                "the checksum supplied at seal does not match the bytes written; the block stays \
                 unsealed: rewrite it or abort it"
            }
        })
    }
}

impl Error {
    /// The stable numeric status code of this error, as the C ABI returns it (0 is success).
    pub fn code(&self) -> i32 {
        match self {
            Error::StaleGeneration { .. } => 1,
            Error::IllegalTransition { .. } => 2,
            Error::NoSpace { .. } => 3,
            Error::Overloaded { .. } => 4,
            Error::NotFound(_) => 5,
            Error::AlreadyExists(_) => 6,
            Error::Corrupt { .. } => 7,
            Error::InvalidArgument(_) => 8,
            Error::LeaseExpired(_) => 9,
            Error::StaleEpoch { .. } => 10,
            Error::Deadline(_) => 11,
            Error::Unavailable(_) => 12,
            Error::Protocol(_) => 13,
            Error::Io(_) => 14,
            Error::Disconnected(_) => 15,
            Error::Unsupported(_) => 16,
        }
    }

    /// Whether trying the same call again later can succeed (for [`Error::Disconnected`], after
    /// reconnecting).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Error::NoSpace { .. } | Error::Overloaded { .. } | Error::Disconnected(_)
        )
    }
}

impl Error {
    /// One value of every variant, with every [`Corruption`] outcome: for the tests that walk
    /// them all (the wire round trip here, the C status codes in libkvd). The exhaustive match
    /// below makes a new variant a compile error until it is listed.
    #[doc(hidden)]
    pub fn one_of_each() -> Vec<Error> {
        let mut v = vec![
            Error::StaleGeneration {
                handle_node: 1,
                handle_slot: 2,
                current_node: 3,
                current_slot: 4,
            },
            Error::IllegalTransition {
                from: BlockState::Sealed,
                op: "publish",
            },
            Error::NoSpace {
                requested_bytes: 1,
                free_bytes: 0,
            },
            Error::Overloaded {
                what: "x".into(),
                retry_after_ms: 5,
            },
            Error::NotFound("k".into()),
            Error::AlreadyExists("k".into()),
            Error::InvalidArgument("a".into()),
            Error::LeaseExpired("l".into()),
            Error::StaleEpoch { got: 1, current: 2 },
            Error::Deadline("d".into()),
            Error::Unavailable("u".into()),
            Error::Protocol("p".into()),
            Error::Io("i".into()),
            Error::Disconnected("c".into()),
            Error::Unsupported("u".into()),
        ];
        for outcome in [
            Corruption::Quarantined,
            Corruption::ReaderCopy,
            Corruption::AtSeal,
        ] {
            v.push(Error::Corrupt {
                expected: 1,
                found: 2,
                outcome,
            });
        }
        for e in &v {
            // Exhaustive: a variant missing from the list above stops the build here.
            match e {
                Error::StaleGeneration { .. }
                | Error::IllegalTransition { .. }
                | Error::NoSpace { .. }
                | Error::Overloaded { .. }
                | Error::NotFound(_)
                | Error::AlreadyExists(_)
                | Error::Corrupt { .. }
                | Error::InvalidArgument(_)
                | Error::LeaseExpired(_)
                | Error::StaleEpoch { .. }
                | Error::Deadline(_)
                | Error::Unavailable(_)
                | Error::Protocol(_)
                | Error::Io(_)
                | Error::Disconnected(_)
                | Error::Unsupported(_) => {}
            }
        }
        v
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io(e.to_string())
    }
}
