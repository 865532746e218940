//! Turning the caller's pointers and lengths into Rust references, after checking what can be
//! checked: null, alignment, a length whose byte size overflows, strings without a NUL within
//! their bound. Every failure is `InvalidArgument` naming the argument, and nothing is touched.
//!
//! What cannot be checked is the C caller's side of the contract, stated once in `kvd.h`: a
//! non-null pointer with a count `n` points to `n` valid, initialized elements that nothing
//! else writes during the call (for outputs: `n` writable elements). All of libkvd's raw-pointer
//! dereferences are in this file.

use std::ffi::c_char;

use kvd_core::{Error, Result};

/// The longest string libkvd reads from a caller (socket paths, names, descriptor fields).
pub const KVD_MAX_STRING_BYTES: usize = 4096;

fn check_ptr<T>(p: *const T, what: &str) -> Result<()> {
    if p.is_null() {
        return Err(Error::InvalidArgument(format!("{what} is NULL")));
    }
    if (p as usize) % std::mem::align_of::<T>() != 0 {
        return Err(Error::InvalidArgument(format!(
            "{what} ({p:p}) is not aligned to {} bytes",
            std::mem::align_of::<T>()
        )));
    }
    Ok(())
}

fn check_len<T>(n: usize, what: &str) -> Result<()> {
    match n.checked_mul(std::mem::size_of::<T>()) {
        Some(b) if b <= isize::MAX as usize => Ok(()),
        _ => Err(Error::InvalidArgument(format!(
            "{what}: a count of {n} is out of range"
        ))),
    }
}

/// `n` elements at `p` to read; `p` may be NULL only when `n` is 0.
pub(crate) fn slice<'a, T>(p: *const T, n: usize, what: &str) -> Result<&'a [T]> {
    if n == 0 {
        return Ok(&[]);
    }
    check_ptr(p, what)?;
    check_len::<T>(n, what)?;
    // SAFETY: non-null, aligned, a size that fits isize (checked above); that it points to `n`
    // initialized elements nobody writes during the call is the caller's contract (kvd.h).
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// `n` elements at `p` to write; `p` may be NULL only when `n` is 0.
pub(crate) fn slice_mut<'a, T>(p: *mut T, n: usize, what: &str) -> Result<&'a mut [T]> {
    if n == 0 {
        return Ok(&mut []);
    }
    check_ptr(p.cast_const(), what)?;
    check_len::<T>(n, what)?;
    // SAFETY: as in `slice`, for `n` writable elements that nothing else accesses during the
    // call (the caller's contract).
    Ok(unsafe { std::slice::from_raw_parts_mut(p, n) })
}

/// An output slot of the caller's.
pub(crate) fn out_ref<'a, T>(p: *mut T, what: &str) -> Result<&'a mut T> {
    check_ptr(p.cast_const(), what)?;
    // SAFETY: non-null and aligned (checked); valid and writable is the caller's contract.
    Ok(unsafe { &mut *p })
}

/// An input struct of the caller's.
pub(crate) fn in_ref<'a, T>(p: *const T, what: &str) -> Result<&'a T> {
    check_ptr(p, what)?;
    // SAFETY: non-null and aligned (checked); valid and initialized is the caller's contract.
    Ok(unsafe { &*p })
}

/// Where to write an optional output: NULL means "not wanted".
pub(crate) fn opt_out<'a, T>(p: *mut T, what: &str) -> Result<Option<&'a mut T>> {
    if p.is_null() {
        Ok(None)
    } else {
        out_ref(p, what).map(Some)
    }
}

/// A NUL-terminated UTF-8 string of at most [`KVD_MAX_STRING_BYTES`] bytes; reads no byte past
/// the first NUL or past the bound.
pub(crate) fn string<'a>(p: *const c_char, what: &str) -> Result<&'a str> {
    check_ptr(p, what)?;
    let mut n = 0usize;
    loop {
        if n > KVD_MAX_STRING_BYTES {
            return Err(Error::InvalidArgument(format!(
                "{what} has no NUL within {KVD_MAX_STRING_BYTES} bytes"
            )));
        }
        // SAFETY: bytes 0..n were not NUL, so the caller's string (NUL-terminated by contract)
        // extends at least to byte n.
        if unsafe { *p.add(n) } == 0 {
            break;
        }
        n += 1;
    }
    // SAFETY: the `n` bytes before the NUL were just read.
    let bytes = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), n) };
    std::str::from_utf8(bytes)
        .map_err(|e| Error::InvalidArgument(format!("{what} is not UTF-8: {e}")))
}

/// Check that an output array of `cap` elements holds the `need` the call produces.
pub(crate) fn fits(cap: usize, need: usize, what: &str) -> Result<()> {
    if cap < need {
        return Err(Error::InvalidArgument(format!(
            "{what} holds {cap} elements, the call needs {need}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn null_misaligned_and_oversized_arguments_are_refused() {
        assert!(slice::<u64>(std::ptr::null(), 1, "p").is_err());
        assert!(slice::<u64>(std::ptr::null(), 0, "p").unwrap().is_empty());
        let words = [0u64; 2];
        let odd = (words.as_ptr() as usize + 1) as *const u64;
        let e = slice(odd, 1, "keys").unwrap_err();
        assert!(e.to_string().contains("aligned"), "{e}");
        assert!(slice(words.as_ptr(), usize::MAX / 4, "keys").is_err());
        assert_eq!(slice(words.as_ptr(), 2, "keys").unwrap(), &[0, 0]);
        assert!(out_ref::<u32>(std::ptr::null_mut(), "out").is_err());
        assert!(fits(3, 4, "out").is_err());
        assert!(fits(4, 4, "out").is_ok());
    }

    #[test]
    fn strings_must_end_within_their_bound_and_be_utf8() {
        assert_eq!(string(c"kvd.sock".as_ptr(), "path").unwrap(), "kvd.sock");
        assert!(string(std::ptr::null(), "path").is_err());
        let long = vec![b'a' as c_char; KVD_MAX_STRING_BYTES + 8];
        assert!(string(long.as_ptr(), "path").is_err(), "no NUL in bound");
        let bad = [0xffu8 as c_char, 0];
        assert!(string(bad.as_ptr(), "path").is_err());
    }
}
