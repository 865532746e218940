//! Copies between an engine's device memory and blocks of the mapped pool, by the GPU's copy
//! engines (feature `cuda`; without it every call answers [`Error::Unsupported`]).
//!
//! [`Client::cuda_register_pool`] registers this client's mapping of the pool as pinned memory
//! (once; again after [`Client::reconnect`], which maps a fresh pool). Then a block this session
//! is writing is filled from device memory with [`Client::cuda_copy_to_block`], and a block it
//! pins is copied to device memory with [`Client::cuda_copy_from_block`], as one device slice
//! per layer (a whole block is a list of one), enqueued on the engine's stream. Each returns a
//! [`CudaEvent`]: ask [`Client::cuda_event_query`] (never blocks) or
//! [`Client::cuda_event_wait`], then [`Client::cuda_event_release`].
//!
//! Which block bytes a copy may touch is decided exactly as for the host copies (`views`): a
//! block being written by this session up to its page's capacity, a pinned block up to its
//! length, its page still holding it. A copy out of a block is a read like any other: when its
//! event is done, the query or wait also checks that the page held the block throughout, and
//! answers [`Error::StaleGeneration`] if it did not (discard what was copied).

use std::time::Duration;

use kvd_core::types::Handle;
use kvd_core::{Error, Result};

use crate::Client;

/// The most layers (device slices) one copy names.
pub const MAX_CUDA_LAYERS: usize = 1024;

#[cfg(feature = "cuda")]
const _: () = assert!(MAX_CUDA_LAYERS == transport::cuda::MAX_LAYERS);

/// One layer's slice of a block in device memory. A copy's slices map, in order, onto
/// consecutive ranges of the block, from its first byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSlice {
    /// Its first byte on the device (`CUdeviceptr`).
    pub ptr: u64,
    /// Its length in bytes.
    pub len: u64,
}

/// A CUDA copy's completion, as [`Client::cuda_copy_to_block`] and
/// [`Client::cuda_copy_from_block`] hand it out. Valid until released, in this session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CudaEvent(pub u64);

/// A client's CUDA state: its pool registration, and the reads whose page must still be checked.
#[derive(Debug, Default)]
pub(crate) struct CudaState {
    #[cfg(feature = "cuda")]
    registration: Option<transport::cuda::PinnedRegistration>,
    /// Copies out of blocks, not yet released: the block each read.
    #[cfg(feature = "cuda")]
    reads: std::collections::HashMap<CudaEvent, Handle>,
}

#[cfg(not(feature = "cuda"))]
fn not_built() -> Error {
    Error::Unsupported("this kvd-client was built without CUDA (feature `cuda`)".into())
}

fn check_list(layers: &[DeviceSlice]) -> Result<()> {
    if layers.is_empty() {
        return Err(Error::InvalidArgument(
            "a CUDA copy needs at least one device slice".into(),
        ));
    }
    if layers.len() > MAX_CUDA_LAYERS {
        return Err(Error::InvalidArgument(format!(
            "{} device slices is more than the {MAX_CUDA_LAYERS} one copy takes",
            layers.len()
        )));
    }
    Ok(())
}

#[cfg(feature = "cuda")]
mod enabled {
    use std::sync::{Arc, OnceLock};

    use kvd_core::{Error, Result};
    use transport::cuda::{CudaDriver, Driver, EventId, Layer, PinnedRegistration};

    use super::{CudaEvent, DeviceSlice};

    /// The process's driver (loaded once; device 0's primary context is the fallback for
    /// threads that have no current context of their own).
    pub(super) fn driver() -> Result<Arc<dyn Driver>> {
        static DRIVER: OnceLock<Result<Arc<CudaDriver>, transport::Error>> = OnceLock::new();
        let d = DRIVER.get_or_init(|| CudaDriver::open(0).map(Arc::new));
        match d {
            Ok(d) => Ok(d.clone() as Arc<dyn Driver>),
            Err(e) => Err(Error::from(e.clone())),
        }
    }

    pub(super) fn registered(r: &Option<PinnedRegistration>) -> Result<&PinnedRegistration> {
        r.as_ref().ok_or_else(|| {
            Error::InvalidArgument(
                "the pool is not registered for CUDA in this session: call cuda_register_pool \
                 first"
                    .into(),
            )
        })
    }

    pub(super) fn layers(s: &[DeviceSlice]) -> Vec<Layer> {
        s.iter()
            .map(|d| Layer {
                device_ptr: d.ptr,
                len: d.len,
            })
            .collect()
    }

    pub(super) fn id(e: CudaEvent) -> EventId {
        EventId(e.0)
    }
}

impl Client {
    /// Register this client's mapping of the pool as pinned memory for CUDA copies (in chunks
    /// of at most 64 GiB). Idempotent: a second call in the same session does nothing.
    ///
    /// # Errors
    /// [`Error::Unsupported`] without the `cuda` feature, without a CUDA driver on the host, or
    /// when the driver refuses; [`Error::Io`] when registering fails (nothing stays
    /// registered); [`Error::Disconnected`] once the connection failed.
    pub fn cuda_register_pool(&mut self) -> Result<()> {
        self.ensure_mapping_usable()?;
        #[cfg(not(feature = "cuda"))]
        {
            Err(not_built())
        }
        #[cfg(feature = "cuda")]
        {
            if self.cuda.registration.is_some() {
                return Ok(());
            }
            let driver = enabled::driver()?;
            // SAFETY: the registration is kept in `self.cuda`, declared before `self.pool` in
            // `Client`, so it is dropped (copies waited for, chunks unregistered) before the
            // mapping is unmapped; nothing else unmaps it.
            let reg = unsafe {
                transport::cuda::PinnedRegistration::new(
                    driver,
                    self.pool.base_ptr(),
                    self.pool.len(),
                )
            }?;
            self.cuda.registration = Some(reg);
            Ok(())
        }
    }

    /// Whether [`Client::cuda_register_pool`] succeeded in this session.
    pub fn cuda_pool_registered(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            self.cuda.registration.is_some()
        }
        #[cfg(not(feature = "cuda"))]
        {
            false
        }
    }

    /// Enqueue copies of `layers` (device memory, in order) into the block `h` that this
    /// session is writing, from its first byte, on `stream` (a `CUstream`; 0 is the legacy
    /// default stream), followed by an event. The slices may cover less than the page; seal
    /// with the length written.
    ///
    /// # Safety
    /// Until the event is done: the device slices stay allocated and unwritten, and the block
    /// is neither written otherwise, sealed nor aborted (its page must not change hands under
    /// the DMA). `stream` is a live stream of the current context, and the slices are memory
    /// of its device.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty or too long list ([`MAX_CUDA_LAYERS`]), a bad
    /// slice (empty, null, more bytes than the page), a block this session is not writing, or
    /// an unregistered pool; [`Error::StaleGeneration`] if the page no longer holds the block;
    /// [`Error::Overloaded`] when too many copies are unreleased; all before anything is
    /// enqueued. [`Error::Io`] when the driver fails (the block's bytes are then undefined).
    /// [`Error::Unsupported`] without the `cuda` feature.
    pub unsafe fn cuda_copy_to_block(
        &mut self,
        h: &Handle,
        layers: &[DeviceSlice],
        stream: u64,
    ) -> Result<CudaEvent> {
        check_list(layers)?;
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (h, stream);
            Err(not_built())
        }
        #[cfg(feature = "cuda")]
        {
            enabled::registered(&self.cuda.registration)?;
            let base = self.pool.base_ptr() as usize;
            let (offset, len) = {
                let page = self.block_mut(h)?;
                (page.as_ptr() as usize - base, page.len())
            };
            let reg = enabled::registered(&self.cuda.registration)?;
            // SAFETY: the range is this session's WRITING block (checked by `block_mut`); the
            // caller keeps it and the device slices untouched until the event is done.
            let id = unsafe {
                reg.copy_to_pool(
                    offset as u64,
                    len as u64,
                    &enabled::layers(layers),
                    transport::cuda::Fill::AtMost,
                    stream,
                )
            }?;
            Ok(CudaEvent(id.0))
        }
    }

    /// Enqueue copies of the pinned block `h`, from its first byte, into `layers` (device
    /// memory, in order) on `stream`, followed by an event. When the event is done,
    /// [`Client::cuda_event_query`] / [`Client::cuda_event_wait`] also check that the page held
    /// the block throughout.
    ///
    /// # Safety
    /// Until the event is done, nothing else touches the device slices; `stream` is a live
    /// stream of the current context and the slices are memory of its device. Keep the pin
    /// until the event is released.
    ///
    /// # Errors
    /// As [`Client::cuda_copy_to_block`], for a block this session pins (more bytes than the
    /// block's length is [`Error::InvalidArgument`]; past the pin's TTL
    /// [`Error::LeaseExpired`]).
    pub unsafe fn cuda_copy_from_block(
        &mut self,
        h: &Handle,
        layers: &[DeviceSlice],
        stream: u64,
    ) -> Result<CudaEvent> {
        check_list(layers)?;
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (h, stream);
            Err(not_built())
        }
        #[cfg(feature = "cuda")]
        {
            let reg = enabled::registered(&self.cuda.registration)?;
            let base = self.pool.base_ptr() as usize;
            let (offset, len) = {
                let view = self.block(h)?;
                (view.bytes().as_ptr() as usize - base, view.bytes().len())
            };
            // SAFETY: the range is a block this session pins (checked by `block`): immutable
            // while the pin holds, and a copy that outlived it is caught when the event is done
            // (the page check in `cuda_event_query`/`cuda_event_wait`); the caller keeps the
            // device slices untouched until then.
            let id = unsafe {
                reg.copy_from_pool(
                    offset as u64,
                    len as u64,
                    &enabled::layers(layers),
                    transport::cuda::Fill::AtMost,
                    stream,
                )
            }?;
            let ev = CudaEvent(id.0);
            self.cuda.reads.insert(ev, *h);
            Ok(ev)
        }
    }

    /// After a copy's event is done: for a copy out of a block, whether the page held it.
    #[cfg(feature = "cuda")]
    fn cuda_checked(&self, ev: CudaEvent, done: bool) -> Result<bool> {
        if done {
            if let Some(h) = self.cuda.reads.get(&ev) {
                self.held(h)?;
            }
        }
        Ok(done)
    }

    /// Whether the copies of `ev` are done (`Ok(false)`: not yet). Never blocks.
    ///
    /// # Errors
    /// [`Error::NotFound`] for a released or unknown event; [`Error::StaleGeneration`] when a
    /// copy out of a block is done but the page moved on meanwhile (discard the copied bytes);
    /// the driver's failure as [`Error::Io`]; [`Error::Unsupported`] without the `cuda`
    /// feature.
    pub fn cuda_event_query(&self, ev: CudaEvent) -> Result<bool> {
        #[cfg(not(feature = "cuda"))]
        {
            let _ = ev;
            Err(not_built())
        }
        #[cfg(feature = "cuda")]
        {
            let reg = enabled::registered(&self.cuda.registration)?;
            let done = reg.event_done(enabled::id(ev))?;
            self.cuda_checked(ev, done)
        }
    }

    /// Wait for the copies of `ev`: `Ok(true)` once done, `Ok(false)` when `timeout` passed
    /// first (`None`: as long as it takes).
    ///
    /// # Errors
    /// As [`Client::cuda_event_query`].
    pub fn cuda_event_wait(&self, ev: CudaEvent, timeout: Option<Duration>) -> Result<bool> {
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (ev, timeout);
            Err(not_built())
        }
        #[cfg(feature = "cuda")]
        {
            let reg = enabled::registered(&self.cuda.registration)?;
            let done = reg.event_wait(enabled::id(ev), timeout)?;
            self.cuda_checked(ev, done)
        }
    }

    /// Hand `ev` back (waiting for its copies first if they are still running).
    ///
    /// # Errors
    /// [`Error::NotFound`] for a released or unknown event; [`Error::Unsupported`] without the
    /// `cuda` feature.
    pub fn cuda_event_release(&mut self, ev: CudaEvent) -> Result<()> {
        #[cfg(not(feature = "cuda"))]
        {
            let _ = ev;
            Err(not_built())
        }
        #[cfg(feature = "cuda")]
        {
            let reg = enabled::registered(&self.cuda.registration)?;
            let r = reg.event_release(enabled::id(ev));
            self.cuda.reads.remove(&ev);
            Ok(r?)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_list_is_bounded_and_never_empty() {
        let s = DeviceSlice {
            ptr: 0x1000,
            len: 1,
        };
        assert!(check_list(&[s]).is_ok());
        assert!(check_list(&vec![s; MAX_CUDA_LAYERS]).is_ok());
        assert!(matches!(
            check_list(&vec![s; MAX_CUDA_LAYERS + 1]),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(check_list(&[]), Err(Error::InvalidArgument(_))));
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn without_the_feature_the_calls_say_so() {
        let e = not_built();
        assert_eq!(e.code(), 16);
        assert!(
            e.to_string()
                .contains("built without CUDA (feature `cuda`)"),
            "{e}"
        );
        assert!(!e.is_retryable());
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn where_there_is_no_driver_opening_it_is_an_unsupported_error() {
        match transport::cuda::CudaDriver::open(0) {
            // a GPU host: the process-wide driver opens too
            Ok(_) => assert!(enabled::driver().is_ok()),
            Err(direct) => {
                let e = enabled::driver().unwrap_err();
                assert!(matches!(e, Error::Unsupported(_) | Error::Io(_)), "{e}");
                if matches!(direct, transport::Error::Unsupported(_)) {
                    assert!(e.to_string().contains("no CUDA driver"), "{e}");
                }
            }
        }
    }
}
