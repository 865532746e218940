//! The CUDA driver calls kvd makes, as one trait, and its implementation over cudarc.
//!
//! Handles cross the trait as plain integers (a `CUstream`, a `CUevent` and a `CUdeviceptr` are
//! all one word), which is what an engine hands kvd from Python or C anyway, and what lets a
//! test double stand in for the driver.
//!
//! Context: every call runs in the calling thread's current context when it has one (the
//! engine's, which owns its streams), and otherwise in the primary context of the device
//! [`CudaDriver::open`] was given, made current first.

use std::ffi::{CStr, c_void};
use std::os::fd::{FromRawFd, OwnedFd};

use cudarc::driver::sys;

use crate::{Error, Result};

/// A device address (`CUdeviceptr`).
pub type DevicePtr = u64;
/// A stream (`CUstream` as an integer; 0 is the legacy default stream).
pub type StreamHandle = u64;
/// An event (`CUevent` as an integer), created by [`Driver::event_create`].
pub type EventHandle = u64;

/// The driver calls above which the registration, the copies and the events are written.
///
/// The unsafe methods are the driver's own contracts, stated on each: host memory named by
/// address must stay mapped (and, for copies, untouched by others) until the work that uses it
/// has completed.
pub trait Driver: Send + Sync + std::fmt::Debug {
    /// Register `len` bytes at `ptr` as pinned, device-mapped, portable host memory.
    ///
    /// # Safety
    /// `ptr..ptr + len` is mapped and stays mapped until [`Driver::host_unregister`].
    unsafe fn host_register(&self, ptr: *mut u8, len: usize) -> Result<()>;

    /// Undo [`Driver::host_register`] of the range starting at `ptr`.
    ///
    /// # Safety
    /// `ptr` starts a range registered by `host_register` and no copy on it is in flight.
    unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<()>;

    /// Enqueue a copy of `len` bytes from host `src` to device `dst` on `stream`.
    ///
    /// # Safety
    /// `src..src + len` is registered host memory that stays valid and unwritten until the copy
    /// has completed; `dst..dst + len` is device memory; `stream` is a live stream (or 0).
    unsafe fn copy_htod_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        len: usize,
        stream: StreamHandle,
    ) -> Result<()>;

    /// Enqueue a copy of `len` bytes from device `src` to host `dst` on `stream`.
    ///
    /// # Safety
    /// `dst..dst + len` is registered host memory that nothing else touches until the copy has
    /// completed; otherwise as [`Driver::copy_htod_async`].
    unsafe fn copy_dtoh_async(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        len: usize,
        stream: StreamHandle,
    ) -> Result<()>;

    /// Wait until all work enqueued on `stream` has completed.
    ///
    /// # Safety
    /// `stream` is a live stream (or 0).
    unsafe fn stream_synchronize(&self, stream: StreamHandle) -> Result<()>;

    /// Create an event (timing disabled: it only marks completion).
    fn event_create(&self) -> Result<EventHandle>;

    /// Record `event` on `stream`: it completes when the work enqueued before it has.
    ///
    /// # Safety
    /// `event` came from [`Driver::event_create`] and is not destroyed; `stream` is live.
    unsafe fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()>;

    /// Whether the work before `event` has completed (`Ok(false)`: not yet), without blocking.
    ///
    /// # Safety
    /// As [`Driver::event_record`].
    unsafe fn event_query(&self, event: EventHandle) -> Result<bool>;

    /// Block until the work before `event` has completed.
    ///
    /// # Safety
    /// As [`Driver::event_record`].
    unsafe fn event_synchronize(&self, event: EventHandle) -> Result<()>;

    /// Destroy `event`.
    ///
    /// # Safety
    /// `event` came from [`Driver::event_create`] and is not used again.
    unsafe fn event_destroy(&self, event: EventHandle);

    /// Allocate `len` bytes of device memory (for the check program and tests).
    fn mem_alloc(&self, len: usize) -> Result<DevicePtr>;

    /// Free device memory from [`Driver::mem_alloc`].
    ///
    /// # Safety
    /// `ptr` came from `mem_alloc`, is not freed yet and no work on it is in flight.
    unsafe fn mem_free(&self, ptr: DevicePtr);

    /// A dma-buf file descriptor for `len` bytes of device memory at `ptr`
    /// (`cuMemGetHandleForAddressRange`, `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`).
    fn dmabuf_fd(&self, ptr: DevicePtr, len: usize) -> Result<OwnedFd>;
}

/// The CUDA driver, loaded at run time, bound to one device's primary context as the fallback
/// for threads without a current context.
#[derive(Debug)]
pub struct CudaDriver {
    device: sys::CUdevice,
    primary: sys::CUcontext,
}

// SAFETY: `primary` is a driver handle, not memory this type dereferences; the driver API is
// thread-safe, and a context may be made current on any thread.
unsafe impl Send for CudaDriver {}
// SAFETY: as for `Send`; `&CudaDriver` only passes the handle to thread-safe driver calls.
unsafe impl Sync for CudaDriver {}

/// The driver's name and text for a failed call.
fn describe(r: sys::CUresult) -> String {
    let e = cudarc::driver::result::DriverError(r);
    let name = e
        .error_name()
        .map(CStr::to_string_lossy)
        .unwrap_or_default();
    let text = e
        .error_string()
        .map(CStr::to_string_lossy)
        .unwrap_or_default();
    format!("{name} ({text})")
}

fn check(r: sys::CUresult, call: &str) -> Result<()> {
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        sys::CUresult::CUDA_ERROR_NOT_SUPPORTED => {
            Err(Error::Unsupported(format!("{call}: {}", describe(r))))
        }
        _ => Err(Error::Io(format!("{call}: {}", describe(r)))),
    }
}

impl CudaDriver {
    /// Load the driver, initialise it and retain device `ordinal`'s primary context.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when no `libcuda.so` can be loaded on this host (checked before
    /// any driver symbol is touched: cudarc would panic); [`Error::Io`] when the driver fails
    /// (`cuInit`, no such device).
    pub fn open(ordinal: i32) -> Result<CudaDriver> {
        // SAFETY: only tries to load the library by its usual names (no symbol is called).
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::Unsupported(
                "no CUDA driver (libcuda.so) on this host: install the NVIDIA driver, or use \
                 the host-memory paths"
                    .into(),
            ));
        }
        // SAFETY: the library is present (checked above); cuInit takes flags 0.
        check(unsafe { sys::cuInit(0) }, "cuInit")?;
        let mut device: sys::CUdevice = 0;
        // SAFETY: `device` is a valid out-pointer; the driver is initialised.
        let r = unsafe { sys::cuDeviceGet(&mut device, ordinal) };
        check(r, "cuDeviceGet")?;
        let mut primary: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `primary` is a valid out-pointer, `device` a device the driver returned.
        let r = unsafe { sys::cuDevicePrimaryCtxRetain(&mut primary, device) };
        check(r, "cuDevicePrimaryCtxRetain")?;
        Ok(CudaDriver { device, primary })
    }

    /// Make sure the calling thread has a current context: its own (the engine's), or else
    /// this device's primary context.
    fn bind(&self) -> Result<()> {
        let mut current: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `current` is a valid out-pointer.
        let r = unsafe { sys::cuCtxGetCurrent(&mut current) };
        check(r, "cuCtxGetCurrent")?;
        if current.is_null() {
            // SAFETY: `primary` is retained by this value until drop.
            let r = unsafe { sys::cuCtxSetCurrent(self.primary) };
            check(r, "cuCtxSetCurrent")?;
        }
        Ok(())
    }
}

impl Drop for CudaDriver {
    fn drop(&mut self) {
        // SAFETY: retained in `open`, released once here.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
    }
}

impl Driver for CudaDriver {
    unsafe fn host_register(&self, ptr: *mut u8, len: usize) -> Result<()> {
        self.bind()?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the caller keeps the range mapped until it is unregistered.
        let r = unsafe { sys::cuMemHostRegister_v2(ptr.cast::<c_void>(), len, flags) };
        check(r, "cuMemHostRegister")
    }

    unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller passes a registered range's start, with no copy in flight.
        let r = unsafe { sys::cuMemHostUnregister(ptr.cast::<c_void>()) };
        check(r, "cuMemHostUnregister")
    }

    unsafe fn copy_htod_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        len: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller's contract (registered source, device destination, live stream).
        let r = unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dst,
                src.cast::<c_void>(),
                len,
                stream as usize as sys::CUstream,
            )
        };
        check(r, "cuMemcpyHtoDAsync")
    }

    unsafe fn copy_dtoh_async(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        len: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller's contract (registered destination nobody touches, live stream).
        let r = unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                dst.cast::<c_void>(),
                src,
                len,
                stream as usize as sys::CUstream,
            )
        };
        check(r, "cuMemcpyDtoHAsync")
    }

    unsafe fn stream_synchronize(&self, stream: StreamHandle) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller passes a live stream (or 0).
        let r = unsafe { sys::cuStreamSynchronize(stream as usize as sys::CUstream) };
        check(r, "cuStreamSynchronize")
    }

    fn event_create(&self) -> Result<EventHandle> {
        self.bind()?;
        let mut ev: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags_enum::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: `ev` is a valid out-pointer; a context is current.
        let r = unsafe { sys::cuEventCreate(&mut ev, flags) };
        check(r, "cuEventCreate")?;
        Ok(ev as usize as EventHandle)
    }

    unsafe fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller passes a live event and stream.
        let r = unsafe {
            sys::cuEventRecord(
                event as usize as sys::CUevent,
                stream as usize as sys::CUstream,
            )
        };
        check(r, "cuEventRecord")
    }

    unsafe fn event_query(&self, event: EventHandle) -> Result<bool> {
        self.bind()?;
        // SAFETY: the caller passes a live event.
        match unsafe { sys::cuEventQuery(event as usize as sys::CUevent) } {
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => check(r, "cuEventQuery").map(|()| true),
        }
    }

    unsafe fn event_synchronize(&self, event: EventHandle) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller passes a live event.
        let r = unsafe { sys::cuEventSynchronize(event as usize as sys::CUevent) };
        check(r, "cuEventSynchronize")
    }

    unsafe fn event_destroy(&self, event: EventHandle) {
        if self.bind().is_ok() {
            // SAFETY: the caller passes a live event it does not use again.
            let _ = unsafe { sys::cuEventDestroy_v2(event as usize as sys::CUevent) };
        }
    }

    fn mem_alloc(&self, len: usize) -> Result<DevicePtr> {
        self.bind()?;
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: `p` is a valid out-pointer; a context is current.
        check(unsafe { sys::cuMemAlloc_v2(&mut p, len) }, "cuMemAlloc")?;
        Ok(p)
    }

    unsafe fn mem_free(&self, ptr: DevicePtr) {
        if self.bind().is_ok() {
            // SAFETY: the caller passes memory from `mem_alloc` with no work in flight.
            let _ = unsafe { sys::cuMemFree_v2(ptr) };
        }
    }

    fn dmabuf_fd(&self, ptr: DevicePtr, len: usize) -> Result<OwnedFd> {
        self.bind()?;
        let mut fd: i32 = -1;
        // SAFETY: for the dma-buf handle type the driver writes one `int` through `handle`,
        // which points at `fd`; the range is only read by the driver to export it.
        let r = unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut i32).cast::<c_void>(),
                ptr,
                len,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        };
        match r {
            sys::CUresult::CUDA_SUCCESS if fd >= 0 => {
                // SAFETY: the driver returned a fresh descriptor that nothing else owns.
                Ok(unsafe { OwnedFd::from_raw_fd(fd) })
            }
            sys::CUresult::CUDA_SUCCESS => Err(Error::Io(
                "cuMemGetHandleForAddressRange succeeded but returned no descriptor".into(),
            )),
            sys::CUresult::CUDA_ERROR_NOT_SUPPORTED
            | sys::CUresult::CUDA_ERROR_INVALID_VALUE
            | sys::CUresult::CUDA_ERROR_NOT_PERMITTED => Err(Error::Unsupported(format!(
                "the CUDA driver refuses a dma-buf for {len} bytes at {ptr:#x}: {} (dma-buf \
                 export needs the open GPU kernel modules, Linux 5.12+, and memory from \
                 cuMemAlloc or cuMemCreate; otherwise register through nvidia-peermem)",
                describe(r)
            ))),
            r => Err(Error::Io(format!(
                "cuMemGetHandleForAddressRange: {}",
                describe(r)
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opening_the_driver_where_there_is_none_is_a_clean_unsupported_error() {
        // SAFETY: only probes for the library.
        if unsafe { sys::is_culib_present() } {
            // a GPU host: opening works, or fails with the driver's error; never a panic
            match CudaDriver::open(0) {
                Ok(_) => {}
                Err(e) => assert!(matches!(e, Error::Io(_) | Error::Unsupported(_)), "{e}"),
            }
            return;
        }
        let e = CudaDriver::open(0).unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)), "{e}");
        assert!(e.to_string().contains("no CUDA driver (libcuda.so)"), "{e}");
        assert!(!e.is_retryable());
    }
}
