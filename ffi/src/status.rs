//! Status codes, their text, and the thread-local last error.
//!
//! Every `kvd_*` function that can fail returns a status: `KVD_OK` (0), or the code of the
//! `kvd_core::Error` it met ([`kvd_core::Error::code`], one code per variant), or
//! `KVD_ERR_INTERNAL` for a bug inside libkvd (a caught panic), which no `Error` maps to. On a
//! failure the calling thread's last error holds the detail: `kvd_last_error_message` and
//! `kvd_last_error_info`. A success leaves it as it was.

use std::cell::RefCell;
use std::ffi::{CString, c_char};

use kvd_core::Error;
use kvd_core::error::Corruption;

/// Success.
pub const KVD_OK: i32 = 0;
/// The handle names a block that no longer exists (its page was reused, or the daemon
/// restarted), or a view's page moved on: look the key up again.
pub const KVD_ERR_STALE_GENERATION: i32 = 1;
/// The block is not in a state that allows the operation; nothing changed.
pub const KVD_ERR_ILLEGAL_TRANSITION: i32 = 2;
/// Not enough free space (after reservations and eviction). Retryable.
pub const KVD_ERR_NO_SPACE: i32 = 3;
/// A bound was reached; retry after `KvdErrorInfo.retry_after_ms`. Retryable.
pub const KVD_ERR_OVERLOADED: i32 = 4;
/// No such key, request, reservation.
pub const KVD_ERR_NOT_FOUND: i32 = 5;
/// The key exists already (published, or being written by someone: busy).
pub const KVD_ERR_ALREADY_EXISTS: i32 = 6;
/// A checksum did not match; `KvdErrorInfo.corruption` says where and what was done. Treat
/// the block as a miss.
pub const KVD_ERR_CORRUPT: i32 = 7;
/// An argument was malformed, out of range, a null/misaligned/too-short pointer, a closed
/// client, or a block this session does not hold; nothing changed.
pub const KVD_ERR_INVALID_ARGUMENT: i32 = 8;
/// The session's lease, a pin's TTL or a manifest's TTL ran out.
pub const KVD_ERR_LEASE_EXPIRED: i32 = 9;
/// An older epoch than the current one; the call was dropped.
pub const KVD_ERR_STALE_EPOCH: i32 = 10;
/// The operation could not finish before its deadline.
pub const KVD_ERR_DEADLINE: i32 = 11;
/// The daemon is draining or shutting down: go to another node.
pub const KVD_ERR_UNAVAILABLE: i32 = 12;
/// The peer speaks another protocol (or the caller another ABI version), or sent a malformed
/// message.
pub const KVD_ERR_PROTOCOL: i32 = 13;
/// An operating-system call failed (the socket cannot be reached, mapping memory).
pub const KVD_ERR_IO: i32 = 14;
/// The connection failed (timeout, the daemon died or restarted); every later call fails with
/// this until `kvd_reconnect`. Retryable after reconnecting.
pub const KVD_ERR_DISCONNECTED: i32 = 15;
/// This libkvd or host cannot do it: a library built without CUDA (the `cuda` feature), no CUDA
/// driver on the host, or a driver that refuses the operation. Nothing changed; not retryable.
pub const KVD_ERR_UNSUPPORTED: i32 = 16;
/// A bug inside libkvd (a caught panic). The client it happened on refuses further calls:
/// close it.
pub const KVD_ERR_INTERNAL: i32 = 100;

/// `KvdErrorInfo.corruption`: not a checksum error.
pub const KVD_CORRUPTION_NONE: u32 = 0;
/// The daemon's own copy failed too: the block is quarantined.
pub const KVD_CORRUPTION_QUARANTINED: u32 = 1;
/// Only this reader's copy failed; the daemon's is intact and nothing was quarantined: read
/// again.
pub const KVD_CORRUPTION_READER_COPY: u32 = 2;
/// At seal, the supplied checksum does not match the bytes written; the block stays unsealed.
pub const KVD_CORRUPTION_AT_SEAL: u32 = 3;

/// The status code of an error. The match is exhaustive: a new `Error` variant does not compile
/// until it has its code here, and a test checks each against `Error::code`.
pub(crate) fn status_of(e: &Error) -> i32 {
    match e {
        Error::StaleGeneration { .. } => KVD_ERR_STALE_GENERATION,
        Error::IllegalTransition { .. } => KVD_ERR_ILLEGAL_TRANSITION,
        Error::NoSpace { .. } => KVD_ERR_NO_SPACE,
        Error::Overloaded { .. } => KVD_ERR_OVERLOADED,
        Error::NotFound(_) => KVD_ERR_NOT_FOUND,
        Error::AlreadyExists(_) => KVD_ERR_ALREADY_EXISTS,
        Error::Corrupt { .. } => KVD_ERR_CORRUPT,
        Error::InvalidArgument(_) => KVD_ERR_INVALID_ARGUMENT,
        Error::LeaseExpired(_) => KVD_ERR_LEASE_EXPIRED,
        Error::StaleEpoch { .. } => KVD_ERR_STALE_EPOCH,
        Error::Deadline(_) => KVD_ERR_DEADLINE,
        Error::Unavailable(_) => KVD_ERR_UNAVAILABLE,
        Error::Protocol(_) => KVD_ERR_PROTOCOL,
        Error::Io(_) => KVD_ERR_IO,
        Error::Disconnected(_) => KVD_ERR_DISCONNECTED,
        Error::Unsupported(_) => KVD_ERR_UNSUPPORTED,
    }
}

/// The detail of the last error on this thread, beyond its message.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvdErrorInfo {
    /// The status returned (`KVD_OK` when this thread has had no error yet).
    pub status: i32,
    /// Whether the same call can succeed later (after `kvd_reconnect` for
    /// `KVD_ERR_DISCONNECTED`).
    pub retryable: bool,
    /// `KVD_ERR_OVERLOADED`: when to try again, in ms (0 otherwise).
    pub retry_after_ms: u64,
    /// `KVD_ERR_CORRUPT`: one of `KVD_CORRUPTION_*` (`KVD_CORRUPTION_NONE` otherwise).
    pub corruption: u32,
    /// `KVD_ERR_CORRUPT`: the checksum recorded at seal (0 otherwise).
    pub expected_checksum: u32,
    /// `KVD_ERR_CORRUPT`: the checksum of the bytes read (0 otherwise).
    pub found_checksum: u32,
    /// `KVD_ERR_NO_SPACE`: bytes asked for (0 otherwise).
    pub requested_bytes: u64,
    /// `KVD_ERR_NO_SPACE`: bytes that were free and unreserved (0 otherwise).
    pub free_bytes: u64,
}

impl KvdErrorInfo {
    pub(crate) fn of(e: &Error) -> KvdErrorInfo {
        let mut i = KvdErrorInfo {
            status: status_of(e),
            retryable: e.is_retryable(),
            ..KvdErrorInfo::default()
        };
        match e {
            Error::Overloaded { retry_after_ms, .. } => i.retry_after_ms = *retry_after_ms,
            Error::Corrupt {
                expected,
                found,
                outcome,
            } => {
                i.corruption = match outcome {
                    Corruption::Quarantined => KVD_CORRUPTION_QUARANTINED,
                    Corruption::ReaderCopy => KVD_CORRUPTION_READER_COPY,
                    Corruption::AtSeal => KVD_CORRUPTION_AT_SEAL,
                };
                i.expected_checksum = *expected;
                i.found_checksum = *found;
            }
            Error::NoSpace {
                requested_bytes,
                free_bytes,
            } => {
                i.requested_bytes = *requested_bytes;
                i.free_bytes = *free_bytes;
            }
            _ => {}
        }
        i
    }
}

struct LastError {
    info: KvdErrorInfo,
    message: CString,
}

thread_local! {
    static LAST: RefCell<LastError> = RefCell::new(LastError {
        info: KvdErrorInfo::default(),
        message: CString::default(),
    });
}

/// Record a failure as this thread's last error; returns its status.
pub(crate) fn set_last(info: KvdErrorInfo, message: String) -> i32 {
    // An interior NUL cannot be represented; replace it rather than lose the message.
    let message = CString::new(message.replace('\0', "\u{FFFD}")).unwrap_or_default();
    LAST.with(|l| *l.borrow_mut() = LastError { info, message });
    info.status
}

/// The message of the last error on the calling thread ("" when there was none).
///
/// The pointer stays valid until the next `kvd_*` call that fails on this thread; copy the text
/// to keep it. Thread-safe: each thread has its own last error.
#[unsafe(no_mangle)]
pub extern "C" fn kvd_last_error_message() -> *const c_char {
    LAST.with(|l| l.borrow().message.as_ptr())
}

/// Copy the detail of the last error on the calling thread into `*out`.
///
/// Returns `KVD_ERR_INVALID_ARGUMENT` for a null or misaligned `out` (then the last error is
/// left as it was). Thread-safe.
#[unsafe(no_mangle)]
pub extern "C" fn kvd_last_error_info(out: *mut KvdErrorInfo) -> i32 {
    let info = LAST.with(|l| l.borrow().info);
    match crate::args::out_ref(out, "out") {
        Ok(o) => {
            *o = info;
            KVD_OK
        }
        Err(_) => KVD_ERR_INVALID_ARGUMENT,
    }
}

/// The text of a status code (a static string; "unknown status" for a code libkvd never
/// returns). Thread-safe.
#[unsafe(no_mangle)]
pub extern "C" fn kvd_status_str(status: i32) -> *const c_char {
    let s: &'static [u8] = match status {
        KVD_OK => b"ok\0",
        KVD_ERR_STALE_GENERATION => b"stale generation\0",
        KVD_ERR_ILLEGAL_TRANSITION => b"illegal transition\0",
        KVD_ERR_NO_SPACE => b"no space\0",
        KVD_ERR_OVERLOADED => b"overloaded\0",
        KVD_ERR_NOT_FOUND => b"not found\0",
        KVD_ERR_ALREADY_EXISTS => b"already exists\0",
        KVD_ERR_CORRUPT => b"corrupt\0",
        KVD_ERR_INVALID_ARGUMENT => b"invalid argument\0",
        KVD_ERR_LEASE_EXPIRED => b"lease expired\0",
        KVD_ERR_STALE_EPOCH => b"stale epoch\0",
        KVD_ERR_DEADLINE => b"deadline\0",
        KVD_ERR_UNAVAILABLE => b"unavailable\0",
        KVD_ERR_PROTOCOL => b"protocol\0",
        KVD_ERR_IO => b"io\0",
        KVD_ERR_DISCONNECTED => b"disconnected\0",
        KVD_ERR_UNSUPPORTED => b"unsupported\0",
        KVD_ERR_INTERNAL => b"internal error in libkvd\0",
        _ => b"unknown status\0",
    };
    s.as_ptr().cast()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_error() -> Vec<Error> {
        Error::one_of_each()
    }

    #[test]
    fn every_error_variant_has_the_status_code_of_its_rust_code_and_its_own_text() {
        let mut texts = std::collections::HashSet::new();
        let mut codes = std::collections::HashSet::new();
        for e in every_error() {
            let s = status_of(&e);
            assert_eq!(s, e.code(), "{e}");
            assert_ne!(s, KVD_OK);
            codes.insert(s);
            // SAFETY: kvd_status_str returns a static NUL-terminated string.
            let text = unsafe { std::ffi::CStr::from_ptr(kvd_status_str(s)) };
            let text = text.to_str().unwrap().to_owned();
            assert_ne!(text, "unknown status", "{e}");
            texts.insert((s, text));
        }
        assert_eq!(codes.len(), 16, "sixteen variants, sixteen codes");
        assert_eq!(texts.len(), 16, "one text per code");
        assert_eq!(codes, (1..=16).collect());
    }

    #[test]
    fn the_corruption_outcome_travels_in_the_error_info() {
        let outcomes: Vec<_> = every_error()
            .iter()
            .filter(|e| matches!(e, Error::Corrupt { .. }))
            .map(|e| KvdErrorInfo::of(e).corruption)
            .collect();
        assert_eq!(
            outcomes,
            vec![
                KVD_CORRUPTION_QUARANTINED,
                KVD_CORRUPTION_READER_COPY,
                KVD_CORRUPTION_AT_SEAL
            ]
        );
        let i = KvdErrorInfo::of(&Error::Overloaded {
            what: "x".into(),
            retry_after_ms: 9,
        });
        assert_eq!((i.status, i.retryable, i.retry_after_ms), (4, true, 9));
        let i = KvdErrorInfo::of(&Error::NotFound("x".into()));
        assert_eq!((i.retryable, i.corruption), (false, KVD_CORRUPTION_NONE));
    }

    #[test]
    fn the_last_error_is_per_thread_and_keeps_its_message() {
        set_last(
            KvdErrorInfo::of(&Error::NotFound("x".into())),
            "not found: x".into(),
        );
        let other = std::thread::spawn(|| {
            let mut i = KvdErrorInfo::default();
            assert_eq!(kvd_last_error_info(&mut i), KVD_OK);
            i.status
        })
        .join()
        .unwrap();
        assert_eq!(other, KVD_OK, "another thread saw no error");
        let mut i = KvdErrorInfo::default();
        assert_eq!(kvd_last_error_info(&mut i), KVD_OK);
        assert_eq!(i.status, KVD_ERR_NOT_FOUND);
        // SAFETY: the message pointer is valid until the next failing call on this thread.
        let m = unsafe { std::ffi::CStr::from_ptr(kvd_last_error_message()) };
        assert_eq!(m.to_str().unwrap(), "not found: x");
        assert_eq!(
            kvd_last_error_info(std::ptr::null_mut()),
            KVD_ERR_INVALID_ARGUMENT
        );
    }
}
