//! The batch limit: how many items one batched call may carry.
//!
//! One number per daemon, `max_batch`: set by `kvd serve --max-batch` (at most
//! [`MAX_BATCH_CEILING`]), carried into the store's `StoreConfig`, and told to each client in its
//! `Welcome`. One check, [`check_batch`], applied by the client before it sends, by the daemon's
//! server on every request, by the store on every batched call, and by the remote protocol on
//! every fetch and offer, so that each refusal reads the same and says what to do: split the
//! batch.

use crate::{Error, Result};

/// The largest `max_batch` a daemon takes: a reply to a full batch must fit one frame
/// (`protocol::frame::MAX_FRAME_BYTES`). Also the store's default.
pub const MAX_BATCH_CEILING: u32 = 4096;

/// Check that a batch of `n` items is within `max_batch`.
///
/// # Errors
/// [`Error::InvalidArgument`] when `n > max_batch`: split the batch.
pub fn check_batch(n: usize, max_batch: u32) -> Result<()> {
    if n > max_batch as usize {
        return Err(Error::InvalidArgument(format!(
            "batch of {n} exceeds the limit of {max_batch}; split it"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_of_max_batch_items_passes_and_one_more_says_split_it() {
        assert!(check_batch(0, 3).is_ok());
        assert!(check_batch(3, 3).is_ok());
        let e = check_batch(4, 3).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        assert!(
            e.to_string()
                .contains("batch of 4 exceeds the limit of 3; split it")
        );
    }
}
