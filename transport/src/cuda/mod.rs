//! CUDA paths (feature `cuda`): the pool mapping registered as pinned host memory, copies
//! between an engine's device memory and blocks of the pool on the engine's stream, and the
//! dma-buf export of device memory for GPUDirect RDMA.
//!
//! The driver API is reached through one small trait, [`Driver`]: [`CudaDriver`] calls it
//! through cudarc, which loads `libcuda.so` at run time (so one binary starts on hosts with and
//! without a driver; [`CudaDriver::open`] answers [`crate::Error::Unsupported`] where there is
//! none), and a test double stands in for it in the unit tests, so everything above the
//! hardware (the registration plan and its rollback, the scatter-list checks, the event
//! bookkeeping) is tested on machines without a GPU.
//!
//! - [`registration`]: [`PinnedRegistration`], an existing mapping (the memfd pool) registered
//!   with `cuMemHostRegister` in chunks of at most [`MAX_CHUNK_BYTES`] ([`plan`]); all or
//!   nothing, unregistered on drop. Not a fresh `cuMemHostAlloc`: the pool must stay the memfd
//!   the daemon and every engine share, and cached (not write-combined), since the CPU reads it
//!   too (checksums, TCP and RDMA sends).
//! - [`copy`]: device → pool and pool → device copies of a block, whole or as one device slice
//!   per layer ([`Layer`], at most [`MAX_LAYERS`]), enqueued on the caller's stream and
//!   followed by an event ([`EventId`]; at most [`MAX_EVENTS_IN_FLIGHT`] per registration).
//! - [`dmabuf`]: [`dmabuf_of`], a dma-buf fd for a range of device memory
//!   (`cuMemGetHandleForAddressRange`), for `ibv_reg_dmabuf_mr`.

pub mod copy;
pub mod dmabuf;
pub mod driver;
pub mod registration;

#[cfg(test)]
pub(crate) mod driver_double;

pub use copy::{EventId, Fill, Layer, MAX_EVENTS_IN_FLIGHT, MAX_LAYERS};
pub use dmabuf::dmabuf_of;
pub use driver::{CudaDriver, DevicePtr, Driver, EventHandle, StreamHandle};
pub use registration::{Chunk, MAX_CHUNK_BYTES, PinnedRegistration, plan};
