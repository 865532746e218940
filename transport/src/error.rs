//! The transport's one error enum. Callers above (kvd-core) map it into theirs.

/// What can go wrong moving bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A range that does not lie inside the region; nothing was touched.
    #[error("range {offset}+{len} lies outside the {region_len}-byte region")]
    OutOfRange {
        /// Where the range starts.
        offset: u64,
        /// Its length.
        len: u64,
        /// The region's length.
        region_len: u64,
    },
    /// An argument was malformed (a zero length, a table of no pages, a fd that is too short).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// An operating-system call failed (memfd, mmap, seals, sockets, io_uring).
    #[error("io: {0}")]
    Io(String),
    /// A bound on work in flight was reached (operations, bytes, batches, endpoints, grants).
    /// Nothing was submitted; retry after the hint.
    #[error("overloaded: {what}; retry after {retry_after_ms} ms")]
    Overloaded {
        /// Which bound was reached.
        what: String,
        /// A hint for when to try again.
        retry_after_ms: u64,
    },
    /// No such endpoint, batch or segment.
    #[error("not found: {0}")]
    NotFound(String),
    /// The peer is gone, stalled past the timeout, or refused the handshake; the endpoint is
    /// closed and its operations failed. Open a new endpoint to try again.
    #[error("peer unavailable: {0}")]
    PeerUnavailable(String),
    /// What was asked needs something this host or build does not have (no CUDA driver, a
    /// driver that refuses the operation, a feature compiled out). Nothing was done; retrying
    /// here cannot succeed.
    #[error("unsupported: {0}")]
    Unsupported(String),
}

impl Error {
    /// Whether trying again (later, or on a fresh endpoint) can succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::Overloaded { .. } | Error::PeerUnavailable(_))
    }
}

/// Shorthand for results whose error is [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
