//! GPUDirect RDMA: device memory registered as a local-only segment the NIC reaches directly,
//! so batches move GPU pages to or from a peer's pool with no host bounce.

use super::verbs::{MrAccess, Verbs};
use super::{LocalSegment, RdmaRegistration, RdmaTransport, lock};
use crate::error::{Error, Result};
use crate::grant::SegmentId;
use crate::segment::SegmentDescriptor;

/// How device (GPU) memory is made reachable by the NIC.
#[derive(Debug, Clone, Copy)]
pub enum DeviceMemory<'a> {
    /// A dma-buf its driver exported (`cuMemGetHandleForAddressRange`), from `offset`:
    /// `ibv_reg_dmabuf_mr`. Needs Linux 5.12+, a NIC driver with dma-buf (mlx5) and the
    /// open GPU kernel module.
    DmaBuf {
        /// The dma-buf.
        fd: std::os::fd::BorrowedFd<'a>,
        /// Where the range starts in it.
        offset: u64,
    },
    /// `ibv_reg_mr` of the device address itself, which works where the nvidia-peermem
    /// module is loaded.
    PeerMem,
}

impl<V: Verbs> RdmaTransport<V> {
    /// Register `len` bytes of device memory at device address `dptr` as local segment
    /// `segment`, so that a batch moves GPU pages to or from a peer's pool with no host
    /// bounce (GPUDirect RDMA). Local only: peers never name it, and the TCP engine cannot
    /// serve it. Registered in chunks as host segments are.
    ///
    /// # Safety
    /// `[dptr, dptr + len)` is device memory that stays allocated until the segment is
    /// unregistered and every batch naming it has settled; the posting contract applies to
    /// it as to host memory.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an id in use or an empty range, the device's error when
    /// it refuses the registration (nothing is left registered).
    pub unsafe fn register_device(
        &self,
        segment: SegmentId,
        dptr: u64,
        len: u64,
        how: DeviceMemory<'_>,
    ) -> Result<RdmaRegistration> {
        let s = &self.shared;
        if len == 0 || dptr == 0 || dptr.checked_add(len).is_none() {
            return Err(Error::InvalidArgument(
                "device memory: a non-null address and at least one byte".into(),
            ));
        }
        if lock(&s.locals).contains_key(&segment) || s.target.descriptor(segment).is_some() {
            return Err(Error::InvalidArgument(format!(
                "segment {} is registered already",
                segment.0
            )));
        }
        let (chunk, regions) = s.register_chunks(len, |at, n| {
            // SAFETY: the caller's contract: the device range stays allocated while the
            // segment is registered; the region is local-only.
            unsafe {
                match how {
                    DeviceMemory::DmaBuf { fd, offset } => {
                        s.verbs
                            .reg_dmabuf_mr(fd, offset + at, n, dptr + at, MrAccess::Local)
                    }
                    DeviceMemory::PeerMem => {
                        s.verbs.reg_mr((dptr + at) as *mut u8, n, MrAccess::Local)
                    }
                }
            }
        })?;
        lock(&s.locals).insert(
            segment,
            LocalSegment {
                addr: dptr,
                len,
                chunk,
                regions,
                owned: false,
                device: true,
            },
        );
        Ok(RdmaRegistration {
            descriptor: SegmentDescriptor {
                backend: crate::segment::BackendKind::Rdma,
                segment,
                len,
                node_id: s.target.node_id(),
                node_generation: s.target.node_generation(),
            },
        })
    }
}

/// How a GPU range was made reachable by the NIC ([`RdmaTransport::register_gpu`]).
#[cfg(feature = "cuda")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuPath {
    /// The driver's dma-buf export, `ibv_reg_dmabuf_mr`.
    DmaBuf,
    /// `ibv_reg_mr` of the device address (nvidia-peermem).
    PeerMem,
}

#[cfg(feature = "cuda")]
impl<V: Verbs> RdmaTransport<V> {
    /// Register `len` bytes of device memory at `dptr` (from the CUDA driver) for GPUDirect
    /// RDMA: the driver's dma-buf export first; where the driver will not export it or the
    /// NIC will not take the dma-buf, `ibv_reg_mr` of the device address, which works where
    /// nvidia-peermem is loaded. Which one worked comes back with the registration.
    ///
    /// # Safety
    /// As [`RdmaTransport::register_device`].
    ///
    /// # Errors
    /// [`Error::Unsupported`] when neither way works, with both reasons.
    pub unsafe fn register_gpu(
        &self,
        segment: SegmentId,
        driver: &dyn crate::cuda::Driver,
        dptr: u64,
        len: u64,
    ) -> Result<(RdmaRegistration, GpuPath)> {
        use std::os::fd::AsFd;
        let dmabuf_why = match crate::cuda::dmabuf_of(driver, dptr, len as usize) {
            Ok(fd) => {
                let how = DeviceMemory::DmaBuf {
                    fd: fd.as_fd(),
                    offset: 0,
                };
                // SAFETY: the caller's contract, passed on (the NIC keeps its own reference
                // to the dma-buf; the fd may close after the registration).
                match unsafe { self.register_device(segment, dptr, len, how) } {
                    Ok(r) => return Ok((r, GpuPath::DmaBuf)),
                    Err(e @ Error::InvalidArgument(_)) => return Err(e),
                    Err(e) => e.to_string(),
                }
            }
            Err(e) => e.to_string(),
        };
        // SAFETY: the caller's contract, passed on.
        match unsafe { self.register_device(segment, dptr, len, DeviceMemory::PeerMem) } {
            Ok(r) => {
                tracing::info!(reason = %dmabuf_why, "GPU memory registered through nvidia-peermem, not dma-buf");
                Ok((r, GpuPath::PeerMem))
            }
            Err(e) => Err(Error::Unsupported(format!(
                "GPU memory cannot be registered for RDMA: dma-buf: {dmabuf_why}; ibv_reg_mr of the device address (nvidia-peermem): {e}"
            ))),
        }
    }
}
