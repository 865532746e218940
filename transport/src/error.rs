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
    /// An operating-system call failed (memfd, mmap, seals).
    #[error("io: {0}")]
    Io(String),
}

/// Shorthand for results whose error is [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
