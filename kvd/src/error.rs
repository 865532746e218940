//! The crate's one error enum.

/// Shorthand for results whose error is [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in kvd, each variant a situation the caller can act on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// An argument was malformed or out of range; nothing changed.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}
