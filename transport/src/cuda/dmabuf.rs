//! GPUDirect RDMA's first half: a dma-buf file descriptor for a range of device memory, which
//! the RDMA backend registers with the NIC (`ibv_reg_dmabuf_mr`), so the NIC reads and writes
//! the GPU's memory without a host copy.
//!
//! `cuMemGetHandleForAddressRange` exports the range; it needs the open GPU kernel modules and a
//! kernel with dma-buf (Linux 5.12+), and ranges aligned to the host page. Where the driver
//! refuses, the answer is [`Error::Unsupported`], and the RDMA side falls back to
//! `nvidia-peermem` (or to staging through the pinned pool).

use std::os::fd::OwnedFd;

use crate::cuda::driver::{DevicePtr, Driver};
use crate::cuda::registration::page_bytes;
use crate::{Error, Result};

/// A dma-buf fd for `len` bytes of device memory at `dptr` (both multiples of the host page).
///
/// # Errors
/// [`Error::InvalidArgument`] for a null address, a zero or unaligned range; the driver's
/// refusal as [`Error::Unsupported`] (no dma-buf support for this memory, driver or kernel),
/// other driver failures as [`Error::Io`].
pub fn dmabuf_of(driver: &dyn Driver, dptr: DevicePtr, len: usize) -> Result<OwnedFd> {
    let page = page_bytes() as u64;
    if dptr == 0 || len == 0 {
        return Err(Error::InvalidArgument(format!(
            "a dma-buf needs a non-null device address and a length ({len} bytes at {dptr:#x})"
        )));
    }
    if dptr % page != 0 || len as u64 % page != 0 {
        return Err(Error::InvalidArgument(format!(
            "a dma-buf range must start and end on a {page}-byte page ({len} bytes at {dptr:#x})"
        )));
    }
    if dptr.checked_add(len as u64).is_none() {
        return Err(Error::InvalidArgument(format!(
            "{len} bytes at {dptr:#x} wrap the device address space"
        )));
    }
    driver.dmabuf_fd(dptr, len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::driver_double::{Call, DriverDouble, Op};

    #[test]
    fn a_dma_buf_is_exported_for_an_aligned_range_and_bad_ranges_never_reach_the_driver() {
        let fake = DriverDouble::default();
        let p = page_bytes();
        let d = fake.mem_alloc(4 * p).unwrap();
        let _fd = dmabuf_of(&fake, d, 4 * p).unwrap();
        for (ptr, len) in [
            (0, p),
            (d, 0),
            (d + 1, p),
            (d, p + 1),
            (u64::MAX - p as u64 + 1, 2 * p),
        ] {
            let e = dmabuf_of(&fake, ptr, len).unwrap_err();
            assert!(
                matches!(e, Error::InvalidArgument(_)),
                "{ptr:#x} {len}: {e}"
            );
        }
        assert_eq!(fake.calls(), vec![Call::Dmabuf { ptr: d, len: 4 * p }]);
    }

    #[test]
    fn a_driver_that_refuses_the_export_is_an_unsupported_error() {
        let fake = DriverDouble::default();
        let p = page_bytes();
        let d = fake.mem_alloc(p).unwrap();
        fake.fail_nth(Op::Dmabuf, 0);
        let e = dmabuf_of(&fake, d, p).unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)), "{e}");
        assert!(!e.is_retryable());
    }
}
