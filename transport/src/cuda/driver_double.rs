//! A test double of the driver: records every call, keeps "device memory" as host buffers
//! keyed by fake device addresses, copies synchronously, and fails a chosen call on demand.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::OwnedFd;
use std::sync::{Mutex, MutexGuard};

use crate::cuda::driver::{DevicePtr, Driver, EventHandle, StreamHandle};
use crate::{Error, Result};

/// One call the code under test made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Call {
    Register { ptr: usize, len: usize },
    Unregister { ptr: usize },
    HtoD { dst: u64, len: usize, stream: u64 },
    DtoH { src: u64, len: usize, stream: u64 },
    StreamSync(u64),
    EventCreate,
    EventRecord { stream: u64 },
    EventQuery,
    EventSync,
    EventDestroy,
    Dmabuf { ptr: u64, len: usize },
}

/// The calls a failure can be injected into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Op {
    Register,
    HtoD,
    EventCreate,
    EventRecord,
    Dmabuf,
}

#[derive(Debug, Default)]
struct State {
    calls: Vec<Call>,
    registered: BTreeMap<usize, usize>,
    device: BTreeMap<u64, Vec<u8>>,
    next_device: u64,
    /// Per recorded event: how many more queries answer "not ready".
    events: HashMap<u64, u32>,
    next_event: u64,
    pending_queries: u32,
    /// Fail the call of `Op` once its count reaches the value.
    fail: HashMap<Op, usize>,
    seen: HashMap<Op, usize>,
}

impl State {
    fn maybe_fail(&mut self, op: Op) -> Result<()> {
        let n = self.seen.entry(op).or_insert(0);
        let this = *n;
        *n += 1;
        if self.fail.get(&op) == Some(&this) {
            self.fail.remove(&op);
            return Err(match op {
                Op::Dmabuf => Error::Unsupported(format!("injected refusal of {op:?}")),
                _ => Error::Io(format!("injected failure of {op:?}")),
            });
        }
        Ok(())
    }

    /// The allocation holding `[p, p + len)`, and `p`'s offset in it.
    fn device_at(&mut self, p: u64, len: usize) -> Result<(&mut Vec<u8>, usize)> {
        let (base, buf) =
            self.device.range_mut(..=p).next_back().ok_or_else(|| {
                Error::Io(format!("CUDA_ERROR_INVALID_VALUE: no memory at {p:#x}"))
            })?;
        let off = (p - *base) as usize;
        if off + len > buf.len() {
            return Err(Error::Io(format!(
                "CUDA_ERROR_INVALID_VALUE: {len} bytes at {p:#x} leave the allocation"
            )));
        }
        Ok((buf, off))
    }

    fn host_registered(&self, p: usize, len: usize) -> bool {
        self.registered
            .range(..=p)
            .next_back()
            .is_some_and(|(b, l)| p + len <= b + l)
    }
}

#[derive(Debug, Default)]
pub(crate) struct DriverDouble {
    state: Mutex<State>,
}

impl DriverDouble {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap()
    }

    pub(crate) fn calls(&self) -> Vec<Call> {
        self.state().calls.clone()
    }

    pub(crate) fn clear_calls(&self) {
        self.state().calls.clear();
    }

    pub(crate) fn registered(&self) -> Vec<(usize, usize)> {
        self.state()
            .registered
            .iter()
            .map(|(a, b)| (*a, *b))
            .collect()
    }

    /// Fail the `nth` call of `op` from now on (0-based: 0 is the next one).
    pub(crate) fn fail_nth(&self, op: Op, nth: usize) {
        let mut s = self.state();
        let seen = s.seen.get(&op).copied().unwrap_or(0);
        s.fail.insert(op, seen + nth);
    }

    pub(crate) fn set_pending_queries(&self, n: u32) {
        self.state().pending_queries = n;
    }

    pub(crate) fn device_write(&self, p: DevicePtr, data: &[u8]) {
        let mut s = self.state();
        let (buf, off) = s.device_at(p, data.len()).unwrap();
        buf[off..off + data.len()].copy_from_slice(data);
    }

    pub(crate) fn device_read(&self, p: DevicePtr, len: usize) -> Vec<u8> {
        let mut s = self.state();
        let (buf, off) = s.device_at(p, len).unwrap();
        buf[off..off + len].to_vec()
    }
}

impl Driver for DriverDouble {
    unsafe fn host_register(&self, ptr: *mut u8, len: usize) -> Result<()> {
        let mut s = self.state();
        s.calls.push(Call::Register {
            ptr: ptr as usize,
            len,
        });
        s.maybe_fail(Op::Register)?;
        if s.registered.insert(ptr as usize, len).is_some() {
            return Err(Error::Io(
                "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED".into(),
            ));
        }
        Ok(())
    }

    unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<()> {
        let mut s = self.state();
        s.calls.push(Call::Unregister { ptr: ptr as usize });
        s.registered
            .remove(&(ptr as usize))
            .map(|_| ())
            .ok_or_else(|| Error::Io("CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED".into()))
    }

    unsafe fn copy_htod_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        len: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        let mut s = self.state();
        s.calls.push(Call::HtoD { dst, len, stream });
        s.maybe_fail(Op::HtoD)?;
        assert!(
            s.host_registered(src as usize, len),
            "copy from unregistered host memory"
        );
        let (buf, off) = s.device_at(dst, len)?;
        // SAFETY: the trait's contract: `src..src + len` is valid host memory.
        let from = unsafe { std::slice::from_raw_parts(src, len) };
        buf[off..off + len].copy_from_slice(from);
        Ok(())
    }

    unsafe fn copy_dtoh_async(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        len: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        let mut s = self.state();
        s.calls.push(Call::DtoH { src, len, stream });
        assert!(
            s.host_registered(dst as usize, len),
            "copy to unregistered host memory"
        );
        let (buf, off) = s.device_at(src, len)?;
        // SAFETY: the trait's contract: `dst..dst + len` is valid host memory nothing else
        // touches during the copy.
        let to = unsafe { std::slice::from_raw_parts_mut(dst, len) };
        to.copy_from_slice(&buf[off..off + len]);
        Ok(())
    }

    unsafe fn stream_synchronize(&self, stream: StreamHandle) -> Result<()> {
        self.state().calls.push(Call::StreamSync(stream));
        Ok(())
    }

    fn event_create(&self) -> Result<EventHandle> {
        let mut s = self.state();
        s.calls.push(Call::EventCreate);
        s.maybe_fail(Op::EventCreate)?;
        s.next_event += 1;
        let ev = 0xe000 + s.next_event;
        s.events.insert(ev, 0);
        Ok(ev)
    }

    unsafe fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        let mut s = self.state();
        s.calls.push(Call::EventRecord { stream });
        s.maybe_fail(Op::EventRecord)?;
        let pending = s.pending_queries;
        *s.events.get_mut(&event).expect("a live event") = pending;
        Ok(())
    }

    unsafe fn event_query(&self, event: EventHandle) -> Result<bool> {
        let mut s = self.state();
        s.calls.push(Call::EventQuery);
        let left = s.events.get_mut(&event).expect("a live event");
        if *left > 0 {
            *left -= 1;
            return Ok(false);
        }
        Ok(true)
    }

    unsafe fn event_synchronize(&self, event: EventHandle) -> Result<()> {
        let mut s = self.state();
        s.calls.push(Call::EventSync);
        *s.events.get_mut(&event).expect("a live event") = 0;
        Ok(())
    }

    unsafe fn event_destroy(&self, event: EventHandle) {
        let mut s = self.state();
        s.calls.push(Call::EventDestroy);
        assert!(s.events.remove(&event).is_some(), "destroyed twice");
    }

    fn mem_alloc(&self, len: usize) -> Result<DevicePtr> {
        let mut s = self.state();
        // Fake addresses, 64 KiB apart at least, never 0.
        let p = 0x7000_0000_0000 + s.next_device;
        s.next_device += (len as u64).next_multiple_of(1 << 16).max(1 << 16);
        s.device.insert(p, vec![0; len]);
        Ok(p)
    }

    unsafe fn mem_free(&self, ptr: DevicePtr) {
        self.state().device.remove(&ptr);
    }

    fn dmabuf_fd(&self, ptr: DevicePtr, len: usize) -> Result<OwnedFd> {
        let mut s = self.state();
        s.calls.push(Call::Dmabuf { ptr, len });
        s.maybe_fail(Op::Dmabuf)?;
        s.device_at(ptr, len)?;
        rustix::fs::memfd_create("fake-dmabuf", rustix::fs::MemfdFlags::CLOEXEC)
            .map_err(|e| Error::Io(e.to_string()))
    }
}
