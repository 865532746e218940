//! The transport's one error enum. With the `core-errors` feature it converts into kvd-core's
//! error (the crates above enable it; kvd-core itself knows nothing of the transport).

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

#[cfg(feature = "core-errors")]
impl From<Error> for kvd_core::Error {
    fn from(e: Error) -> Self {
        use kvd_core::Error as Core;
        match e {
            Error::OutOfRange { .. } | Error::InvalidArgument(_) => {
                Core::InvalidArgument(e.to_string())
            }
            Error::Io(s) => Core::Io(s),
            Error::Overloaded {
                what,
                retry_after_ms,
            } => Core::Overloaded {
                what,
                retry_after_ms,
            },
            Error::NotFound(s) => Core::NotFound(s),
            Error::PeerUnavailable(s) => Core::Disconnected(s),
            Error::Unsupported(s) => Core::Unsupported(s),
        }
    }
}

#[cfg(all(test, feature = "core-errors"))]
mod tests {
    use super::Error;

    #[test]
    fn every_transport_error_keeps_its_retryability_in_core() {
        let all = [
            Error::OutOfRange {
                offset: 1,
                len: 2,
                region_len: 3,
            },
            Error::InvalidArgument("x".into()),
            Error::Io("x".into()),
            Error::Overloaded {
                what: "grants".into(),
                retry_after_ms: 7,
            },
            Error::NotFound("x".into()),
            Error::PeerUnavailable("x".into()),
            Error::Unsupported("x".into()),
        ];
        for e in all {
            let core = kvd_core::Error::from(e.clone());
            assert_eq!(core.is_retryable(), e.is_retryable(), "{e} became {core}");
        }
        let hint = kvd_core::Error::from(Error::Overloaded {
            what: "grants".into(),
            retry_after_ms: 7,
        });
        assert!(
            matches!(hint, kvd_core::Error::Overloaded { retry_after_ms: 7, ref what } if what == "grants"),
            "{hint}"
        );
    }
}
