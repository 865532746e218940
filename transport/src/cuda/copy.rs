//! Copies between device memory and blocks of a registered mapping, on the caller's stream,
//! and the events that tell when they are done.
//!
//! An engine's KV block is one device slice per layer; in the pool it is one contiguous range.
//! A copy names the block's range in the mapping and a list of [`Layer`]s (device address,
//! length), which map in order onto consecutive ranges of the block: layer 0 on the block's
//! first bytes, layer 1 right after it, and so on. A whole-block copy is a list of one.
//!
//! Every check happens before anything is enqueued, so a bad argument changes nothing: at most
//! [`MAX_LAYERS`] layers, none empty, no null device address, layer lengths summing to at most
//! the block's length (exactly, with [`Fill::Exact`]), the block inside the registered mapping,
//! and an event free (at most [`MAX_EVENTS_IN_FLIGHT`] unreleased per registration; past it a
//! retryable [`Error::Overloaded`]).
//!
//! After the copies an event is recorded on the stream. [`PinnedRegistration::event_done`]
//! asks without blocking, [`PinnedRegistration::event_wait`] waits (bounded by a timeout, or
//! until done), and [`PinnedRegistration::event_release`] hands the event back (waiting for
//! its copies first: the pages must not change hands under a DMA). Events are created once and
//! reused, so the copy path makes no `cuEventCreate` after warm-up.
//!
//! When the driver fails part-way through enqueueing, the stream is synchronized before the
//! error returns (so no DMA into or out of the pool is left in flight), and the block's bytes
//! (device → pool) or the device slices (pool → device) are undefined.

use std::time::{Duration, Instant};

use crate::cuda::driver::{DevicePtr, Driver, EventHandle, StreamHandle};
use crate::cuda::registration::PinnedRegistration;
use crate::{Error, Result};

/// The most layers one copy names.
pub const MAX_LAYERS: usize = 1024;

/// The most events (copies not yet released) one registration has at once.
pub const MAX_EVENTS_IN_FLIGHT: usize = 256;

/// The retry hint when every event is in flight.
const RETRY_AFTER_MS: u64 = 1;

/// One layer's slice of a block in device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layer {
    /// Its first byte on the device.
    pub device_ptr: DevicePtr,
    /// Its length in bytes.
    pub len: u64,
}

/// How the layers must cover the block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fill {
    /// The layers' lengths sum to the block's length exactly.
    Exact,
    /// They sum to at most the block's length (the rest of the block is not touched).
    AtMost,
}

/// A copy's completion event, as handed out by this registration (slot and generation: a
/// released event's id never names its slot's next use).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EventId(pub u64);

impl EventId {
    fn new(slot: usize, generation: u32) -> EventId {
        EventId((u64::from(generation) << 32) | slot as u64)
    }

    fn slot(self) -> usize {
        (self.0 & 0xffff_ffff) as usize
    }

    fn generation(self) -> u32 {
        (self.0 >> 32) as u32
    }
}

#[derive(Debug, Default)]
struct Slot {
    /// Bumped at every release; 0 is never handed out.
    generation: u32,
    /// The driver's event, created at the slot's first use and kept for the next.
    event: Option<EventHandle>,
    busy: bool,
}

/// The events of one registration.
#[derive(Debug, Default)]
pub(crate) struct EventTable {
    slots: Vec<Slot>,
    free: Vec<usize>,
    busy: usize,
}

impl EventTable {
    /// A free slot with its event (created if the slot is new), marked busy.
    fn take(&mut self, driver: &dyn Driver) -> Result<(usize, EventHandle)> {
        if self.busy >= MAX_EVENTS_IN_FLIGHT {
            return Err(Error::Overloaded {
                what: format!(
                    "{MAX_EVENTS_IN_FLIGHT} CUDA copy events are in flight on this registration \
                     (release completed ones)"
                ),
                retry_after_ms: RETRY_AFTER_MS,
            });
        }
        let i = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push(Slot {
                    generation: 1,
                    ..Slot::default()
                });
                self.slots.len() - 1
            }
        };
        let s = &mut self.slots[i];
        let ev = match s.event {
            Some(ev) => ev,
            None => match driver.event_create() {
                Ok(ev) => *s.event.insert(ev),
                Err(e) => {
                    self.free.push(i);
                    return Err(e);
                }
            },
        };
        s.busy = true;
        self.busy += 1;
        Ok((i, ev))
    }

    /// Hand slot `i` back (its id dies).
    fn put(&mut self, i: usize) {
        let s = &mut self.slots[i];
        debug_assert!(s.busy);
        s.busy = false;
        s.generation = s.generation.wrapping_add(1).max(1);
        self.busy -= 1;
        self.free.push(i);
    }

    fn lookup(&self, id: EventId) -> Result<(usize, EventHandle)> {
        match self.slots.get(id.slot()) {
            Some(Slot {
                generation,
                event: Some(ev),
                busy: true,
            }) if *generation == id.generation() => Ok((id.slot(), *ev)),
            _ => Err(Error::NotFound(format!(
                "CUDA event {:#x} (released already, or not from this registration)",
                id.0
            ))),
        }
    }

    /// Wait for every event in flight, then destroy all events (the registration is going).
    pub(crate) fn drain(&mut self, driver: &dyn Driver) {
        for s in self.slots.drain(..) {
            if let Some(ev) = s.event {
                if s.busy {
                    // SAFETY: a live event of this table.
                    let _ = unsafe { driver.event_synchronize(ev) };
                }
                // SAFETY: a live event of this table, not used again.
                unsafe { driver.event_destroy(ev) };
            }
        }
        self.free.clear();
        self.busy = 0;
    }
}

/// Check a layer list against a block of `block_len` bytes: at most [`MAX_LAYERS`], none
/// empty, none at device address 0, the lengths summing to at most `block_len` (exactly, with
/// [`Fill::Exact`]).
///
/// # Errors
/// [`Error::InvalidArgument`] naming the first rule broken.
pub fn check_layers(layers: &[Layer], block_len: u64, fill: Fill) -> Result<()> {
    let bad = |why: String| Err(Error::InvalidArgument(why));
    if layers.is_empty() {
        return bad("a copy needs at least one layer".into());
    }
    if layers.len() > MAX_LAYERS {
        return bad(format!(
            "{} layers is more than the {MAX_LAYERS} one copy takes",
            layers.len()
        ));
    }
    let mut total = 0u64;
    for (i, l) in layers.iter().enumerate() {
        if l.len == 0 {
            return bad(format!("layer {i} has length 0"));
        }
        if l.device_ptr == 0 {
            return bad(format!("layer {i} has a null device pointer"));
        }
        if l.device_ptr.checked_add(l.len).is_none() {
            return bad(format!(
                "layer {i} ({} bytes at {:#x}) wraps the device address space",
                l.len, l.device_ptr
            ));
        }
        total = match total.checked_add(l.len) {
            Some(t) if t <= block_len => t,
            _ => {
                return bad(format!(
                    "the layers up to {i} add up to more than the block's {block_len} bytes"
                ));
            }
        };
    }
    if fill == Fill::Exact && total != block_len {
        return bad(format!(
            "the layers add up to {total} bytes, the block has {block_len}"
        ));
    }
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    /// Device → pool.
    ToPool,
    /// Pool → device.
    FromPool,
}

impl PinnedRegistration {
    /// Enqueue copies of `layers` (device memory) into the block of `block_len` bytes at
    /// `offset` in the registered mapping, in order, on `stream`, then record an event.
    ///
    /// # Safety
    /// Until the event completes, nothing else reads or writes the block's bytes and the device
    /// slices stay allocated; `stream` is a live stream of the current context (or 0); the
    /// device pointers name memory of that context's device (the driver rejects foreign ones
    /// only where it can tell).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] / [`Error::OutOfRange`] for a bad list or range, and
    /// [`Error::Overloaded`] when every event is in flight, all before anything is enqueued;
    /// the driver's failure as [`Error::Io`] (the stream was synchronized, the block's bytes
    /// are undefined).
    pub unsafe fn copy_to_pool(
        &self,
        offset: u64,
        block_len: u64,
        layers: &[Layer],
        fill: Fill,
        stream: StreamHandle,
    ) -> Result<EventId> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.copy(Direction::ToPool, offset, block_len, layers, fill, stream) }
    }

    /// Enqueue copies of the block of `block_len` bytes at `offset` in the registered mapping
    /// into `layers` (device memory), in order, on `stream`, then record an event.
    ///
    /// # Safety
    /// Until the event completes, nothing writes the block's bytes and nothing else touches the
    /// device slices; otherwise as [`PinnedRegistration::copy_to_pool`].
    ///
    /// # Errors
    /// As [`PinnedRegistration::copy_to_pool`] (on a driver failure the device slices are
    /// undefined).
    pub unsafe fn copy_from_pool(
        &self,
        offset: u64,
        block_len: u64,
        layers: &[Layer],
        fill: Fill,
        stream: StreamHandle,
    ) -> Result<EventId> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.copy(Direction::FromPool, offset, block_len, layers, fill, stream) }
    }

    /// # Safety
    /// As [`PinnedRegistration::copy_to_pool`] / [`PinnedRegistration::copy_from_pool`].
    unsafe fn copy(
        &self,
        dir: Direction,
        offset: u64,
        block_len: u64,
        layers: &[Layer],
        fill: Fill,
        stream: StreamHandle,
    ) -> Result<EventId> {
        if block_len == 0 {
            return Err(Error::InvalidArgument("a block of 0 bytes".into()));
        }
        if offset
            .checked_add(block_len)
            .is_none_or(|end| end > self.len as u64)
        {
            return Err(Error::OutOfRange {
                offset,
                len: block_len,
                region_len: self.len as u64,
            });
        }
        check_layers(layers, block_len, fill)?;
        let mut table = self.events.lock().unwrap_or_else(|p| p.into_inner());
        let driver = self.driver.as_ref();
        let (slot, ev) = table.take(driver)?;
        // The block lies in the mapping (checked), and every layer inside the block (checked).
        let mut at = offset as usize;
        let mut failed = None;
        for (i, l) in layers.iter().enumerate() {
            let len = l.len as usize;
            // SAFETY: `at..at + len` lies inside the registered mapping (block range and layer
            // sums checked above); the caller keeps it and the device slice untouched until the
            // event completes.
            let r = unsafe {
                let host = self.base.add(at);
                match dir {
                    Direction::ToPool => driver.copy_dtoh_async(host, l.device_ptr, len, stream),
                    Direction::FromPool => driver.copy_htod_async(l.device_ptr, host, len, stream),
                }
            };
            if let Err(e) = r {
                failed = Some(format!(
                    "enqueueing layer {i} of {} ({len} bytes, device {:#x}) failed: {e}",
                    layers.len(),
                    l.device_ptr
                ));
                break;
            }
            at += len;
        }
        if failed.is_none() {
            // SAFETY: `ev` is a live event of this table; the caller's stream is live.
            if let Err(e) = unsafe { driver.event_record(ev, stream) } {
                failed = Some(format!("recording the completion event failed: {e}"));
            }
        }
        if let Some(why) = failed {
            // Nothing may still be moving into or out of the pool once the error returns.
            // SAFETY: the caller's stream is live.
            let synced = unsafe { driver.stream_synchronize(stream) };
            table.put(slot);
            return Err(Error::Io(format!(
                "{why}; the stream was synchronized{}, the {} are undefined",
                synced
                    .err()
                    .map(|e| format!(" (and that failed too: {e})"))
                    .unwrap_or_default(),
                match dir {
                    Direction::ToPool => "block's bytes",
                    Direction::FromPool => "device slices",
                }
            )));
        }
        Ok(EventId::new(slot, table.slots[slot].generation))
    }

    /// Whether the copies before `id` have completed (`Ok(false)`: not yet). Never blocks.
    ///
    /// # Errors
    /// [`Error::NotFound`] for a released or foreign id; the driver's error (a failed copy
    /// poisons the context: [`Error::Io`]).
    pub fn event_done(&self, id: EventId) -> Result<bool> {
        let table = self.events.lock().unwrap_or_else(|p| p.into_inner());
        let (_, ev) = table.lookup(id)?;
        // SAFETY: a live event of this table (looked up under its lock, which is held).
        unsafe { self.driver.event_query(ev) }
    }

    /// Wait until the copies before `id` have completed: `Ok(true)` once they have,
    /// `Ok(false)` when `timeout` passed first (`None`: wait as long as it takes). Polls with
    /// a growing sleep (up to 1 ms) while waiting with a timeout.
    ///
    /// # Errors
    /// As [`PinnedRegistration::event_done`].
    pub fn event_wait(&self, id: EventId, timeout: Option<Duration>) -> Result<bool> {
        let table = self.events.lock().unwrap_or_else(|p| p.into_inner());
        let (_, ev) = table.lookup(id)?;
        let Some(timeout) = timeout else {
            // SAFETY: a live event of this table, under its lock.
            unsafe { self.driver.event_synchronize(ev)? };
            return Ok(true);
        };
        let started = Instant::now();
        let mut nap = Duration::from_micros(10);
        loop {
            // SAFETY: as above.
            if unsafe { self.driver.event_query(ev)? } {
                return Ok(true);
            }
            let elapsed = started.elapsed();
            if elapsed >= timeout {
                return Ok(false);
            }
            std::thread::sleep(nap.min(timeout - elapsed));
            nap = (nap * 2).min(Duration::from_millis(1));
        }
    }

    /// Hand the event back (its id dies), after waiting for its copies if they are still in
    /// flight (the block's page must not change hands under a DMA).
    ///
    /// # Errors
    /// [`Error::NotFound`] for a released or foreign id; a failure of the wait (the event is
    /// released anyway).
    pub fn event_release(&self, id: EventId) -> Result<()> {
        let mut table = self.events.lock().unwrap_or_else(|p| p.into_inner());
        let (slot, ev) = table.lookup(id)?;
        // SAFETY: a live event of this table, under its lock.
        let waited = unsafe { self.driver.event_synchronize(ev) };
        table.put(slot);
        waited
    }

    /// Events handed out and not yet released.
    pub fn events_in_flight(&self) -> usize {
        self.events.lock().unwrap_or_else(|p| p.into_inner()).busy
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::cuda::driver_double::{Call, DriverDouble, Op};

    const STREAM: StreamHandle = 0x5eed;

    /// A registered anonymous mapping of `pages` pages, and the fake driver under it.
    struct Rig {
        fake: Arc<DriverDouble>,
        reg: PinnedRegistration,
        _map: memmap2::MmapMut,
    }

    fn rig(len: usize) -> Rig {
        let mut map = memmap2::MmapMut::map_anon(len).unwrap();
        let fake = Arc::new(DriverDouble::default());
        // SAFETY: `map` lives in the rig, dropped after `reg` (field order).
        let reg = unsafe { PinnedRegistration::new(fake.clone(), map.as_mut_ptr(), len) }.unwrap();
        fake.clear_calls();
        Rig {
            fake,
            reg,
            _map: map,
        }
    }

    impl Rig {
        fn pool(&self) -> &[u8] {
            // SAFETY: the mapping is alive and no copy is in flight in these tests' checks
            // (the fake copies synchronously).
            unsafe { std::slice::from_raw_parts(self.reg.base(), self.reg.len()) }
        }

        fn enqueued(&self) -> usize {
            self.fake
                .calls()
                .iter()
                .filter(|c| {
                    matches!(
                        c,
                        Call::HtoD { .. }
                            | Call::DtoH { .. }
                            | Call::EventRecord { .. }
                            | Call::EventCreate
                    )
                })
                .count()
        }
    }

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect()
    }

    #[test]
    fn a_scatter_list_lands_on_consecutive_ranges_of_the_block_and_comes_back() {
        let r = rig(1 << 20);
        let (offset, layer_len, n) = (8192u64, 1000u64, 64usize);
        let layers: Vec<Layer> = (0..n)
            .map(|i| {
                let p = r.fake.mem_alloc(layer_len as usize).unwrap();
                r.fake
                    .device_write(p, &pattern(layer_len as usize, i as u8));
                Layer {
                    device_ptr: p,
                    len: layer_len,
                }
            })
            .collect();
        let block_len = layer_len * n as u64;
        // SAFETY: nothing else touches the block; the fake's device memory is alive.
        let ev = unsafe {
            r.reg
                .copy_to_pool(offset, block_len, &layers, Fill::Exact, STREAM)
        }
        .unwrap();
        assert!(r.reg.event_wait(ev, None).unwrap());
        for i in 0..n {
            let at = offset as usize + i * layer_len as usize;
            assert_eq!(
                &r.pool()[at..at + layer_len as usize],
                &pattern(layer_len as usize, i as u8)[..],
                "layer {i}"
            );
        }
        r.reg.event_release(ev).unwrap();
        for l in &layers {
            r.fake
                .device_write(l.device_ptr, &vec![0; layer_len as usize]);
        }
        // SAFETY: as above.
        let ev = unsafe {
            r.reg
                .copy_from_pool(offset, block_len, &layers, Fill::Exact, STREAM)
        }
        .unwrap();
        r.reg.event_release(ev).unwrap();
        for (i, l) in layers.iter().enumerate() {
            assert_eq!(
                r.fake.device_read(l.device_ptr, layer_len as usize),
                pattern(layer_len as usize, i as u8)
            );
        }
        let copies = r
            .fake
            .calls()
            .iter()
            .filter(|c| matches!(c, Call::DtoH { stream: STREAM, .. }))
            .count();
        assert_eq!(copies, n, "one copy per layer, on the caller's stream");
    }

    #[test]
    fn a_whole_block_is_one_copy_and_a_shorter_list_leaves_the_rest_alone() {
        let r = rig(1 << 16);
        let p = r.fake.mem_alloc(4096).unwrap();
        r.fake.device_write(p, &pattern(4096, 9));
        let whole = [Layer {
            device_ptr: p,
            len: 4096,
        }];
        // SAFETY: nothing else touches the block.
        let ev = unsafe { r.reg.copy_to_pool(4096, 4096, &whole, Fill::Exact, STREAM) }.unwrap();
        r.reg.event_release(ev).unwrap();
        assert_eq!(&r.pool()[4096..8192], &pattern(4096, 9)[..]);
        let half = [Layer {
            device_ptr: p,
            len: 2048,
        }];
        // SAFETY: as above.
        let ev = unsafe { r.reg.copy_to_pool(16384, 4096, &half, Fill::AtMost, STREAM) }.unwrap();
        r.reg.event_release(ev).unwrap();
        assert_eq!(&r.pool()[16384..16384 + 2048], &pattern(4096, 9)[..2048]);
        assert!(r.pool()[16384 + 2048..20480].iter().all(|b| *b == 0));
    }

    #[test]
    fn every_bad_scatter_list_is_refused_before_anything_is_enqueued() {
        let r = rig(1 << 16);
        let l = |device_ptr, len| Layer { device_ptr, len };
        let too_many = vec![l(0x1000, 1); MAX_LAYERS + 1];
        let cases: Vec<(&str, u64, u64, Vec<Layer>, Fill)> = vec![
            ("no layers", 0, 4096, vec![], Fill::AtMost),
            ("too many layers", 0, 1 << 12, too_many, Fill::AtMost),
            (
                "a zero-length layer",
                0,
                4096,
                vec![l(0x1000, 0)],
                Fill::AtMost,
            ),
            (
                "a null device pointer",
                0,
                4096,
                vec![l(0, 16)],
                Fill::AtMost,
            ),
            (
                "a wrapping layer",
                0,
                4096,
                vec![l(u64::MAX - 4, 16)],
                Fill::AtMost,
            ),
            (
                "layers longer than the block",
                0,
                4096,
                vec![l(0x1000, 4000), l(0x9000, 97)],
                Fill::AtMost,
            ),
            (
                "short of an exact fill",
                0,
                4096,
                vec![l(0x1000, 4095)],
                Fill::Exact,
            ),
            (
                "a block past the mapping",
                1 << 16,
                1,
                vec![l(0x1000, 1)],
                Fill::Exact,
            ),
            (
                "a block that wraps",
                u64::MAX,
                2,
                vec![l(0x1000, 1)],
                Fill::AtMost,
            ),
            ("an empty block", 0, 0, vec![l(0x1000, 1)], Fill::AtMost),
        ];
        for (what, offset, len, layers, fill) in cases {
            for to_pool in [true, false] {
                // SAFETY: refused before any copy (what the test checks).
                let e = unsafe {
                    if to_pool {
                        r.reg.copy_to_pool(offset, len, &layers, fill, STREAM)
                    } else {
                        r.reg.copy_from_pool(offset, len, &layers, fill, STREAM)
                    }
                }
                .unwrap_err();
                assert!(
                    matches!(e, Error::InvalidArgument(_) | Error::OutOfRange { .. }),
                    "{what}: {e}"
                );
                assert!(!e.is_retryable(), "{what}");
            }
            assert_eq!(r.enqueued(), 0, "{what}: nothing enqueued");
            assert_eq!(r.reg.events_in_flight(), 0, "{what}");
        }
        assert!(r.pool().iter().all(|b| *b == 0), "no byte changed");
    }

    #[test]
    fn events_in_flight_are_bounded_and_past_the_bound_nothing_is_enqueued() {
        let r = rig(1 << 16);
        let p = r.fake.mem_alloc(64).unwrap();
        let one = [Layer {
            device_ptr: p,
            len: 64,
        }];
        let mut ids = Vec::new();
        for _ in 0..MAX_EVENTS_IN_FLIGHT {
            // SAFETY: nothing else touches the block.
            ids.push(unsafe { r.reg.copy_to_pool(0, 64, &one, Fill::Exact, STREAM) }.unwrap());
        }
        let before = r.fake.calls().len();
        // SAFETY: refused (the test checks it).
        let e = unsafe { r.reg.copy_from_pool(0, 64, &one, Fill::Exact, STREAM) }.unwrap_err();
        assert!(
            matches!(e, Error::Overloaded { retry_after_ms, .. } if retry_after_ms > 0),
            "{e}"
        );
        assert!(e.is_retryable());
        assert_eq!(
            r.fake.calls().len(),
            before,
            "nothing enqueued past the bound"
        );
        r.reg.event_release(ids.pop().unwrap()).unwrap();
        // SAFETY: nothing else touches the block.
        let again = unsafe { r.reg.copy_to_pool(0, 64, &one, Fill::Exact, STREAM) }.unwrap();
        ids.push(again);
        let creates = r
            .fake
            .calls()
            .iter()
            .filter(|c| matches!(c, Call::EventCreate))
            .count();
        assert_eq!(creates, MAX_EVENTS_IN_FLIGHT, "a released event is reused");
        for id in ids {
            r.reg.event_release(id).unwrap();
        }
        assert_eq!(r.reg.events_in_flight(), 0);
    }

    #[test]
    fn an_event_reports_not_yet_then_done_and_dies_at_release() {
        let r = rig(1 << 16);
        r.fake.set_pending_queries(2);
        let p = r.fake.mem_alloc(64).unwrap();
        let one = [Layer {
            device_ptr: p,
            len: 64,
        }];
        // SAFETY: nothing else touches the block.
        let ev = unsafe { r.reg.copy_from_pool(0, 64, &one, Fill::Exact, STREAM) }.unwrap();
        assert!(!r.reg.event_done(ev).unwrap(), "not yet");
        assert!(!r.reg.event_done(ev).unwrap(), "not yet");
        assert!(r.reg.event_done(ev).unwrap(), "done");
        r.reg.event_release(ev).unwrap();
        assert!(matches!(r.reg.event_done(ev), Err(Error::NotFound(_))));
        assert!(matches!(r.reg.event_release(ev), Err(Error::NotFound(_))));
        // The slot's next use has another id: the old one still names nothing.
        // SAFETY: as above.
        let next = unsafe { r.reg.copy_from_pool(0, 64, &one, Fill::Exact, STREAM) }.unwrap();
        assert_ne!(next, ev);
        assert!(matches!(
            r.reg.event_wait(ev, None),
            Err(Error::NotFound(_))
        ));
        r.reg.event_release(next).unwrap();
        assert!(matches!(
            r.reg.event_done(EventId(0xdead_0000_0007)),
            Err(Error::NotFound(_))
        ));
    }

    #[test]
    fn a_wait_with_a_timeout_gives_up_in_time_and_release_waits_for_the_copies() {
        let r = rig(1 << 16);
        r.fake.set_pending_queries(u32::MAX);
        let p = r.fake.mem_alloc(64).unwrap();
        let one = [Layer {
            device_ptr: p,
            len: 64,
        }];
        // SAFETY: nothing else touches the block.
        let ev = unsafe { r.reg.copy_to_pool(0, 64, &one, Fill::Exact, STREAM) }.unwrap();
        let t = Instant::now();
        assert!(
            !r.reg
                .event_wait(ev, Some(Duration::from_millis(20)))
                .unwrap()
        );
        let waited = t.elapsed();
        assert!(waited >= Duration::from_millis(20) && waited < Duration::from_secs(2));
        r.reg.event_release(ev).unwrap();
        assert!(
            r.fake.calls().contains(&Call::EventSync),
            "release synchronized the event"
        );
    }

    #[test]
    fn a_driver_failure_part_way_synchronizes_the_stream_and_frees_the_event() {
        let r = rig(1 << 16);
        let layers: Vec<Layer> = (0..4)
            .map(|_| Layer {
                device_ptr: r.fake.mem_alloc(100).unwrap(),
                len: 100,
            })
            .collect();
        r.fake.fail_nth(Op::HtoD, 2);
        // SAFETY: nothing else touches the block.
        let e = unsafe { r.reg.copy_from_pool(0, 400, &layers, Fill::Exact, STREAM) }.unwrap_err();
        assert!(matches!(e, Error::Io(_)), "{e}");
        assert!(e.to_string().contains("layer 2 of 4"), "{e}");
        assert!(r.fake.calls().contains(&Call::StreamSync(STREAM)));
        assert_eq!(r.reg.events_in_flight(), 0);
        let records = r
            .fake
            .calls()
            .iter()
            .filter(|c| matches!(c, Call::EventRecord { .. }))
            .count();
        assert_eq!(records, 0, "no event for a failed copy");
        // The record failing is the same.
        r.fake.fail_nth(Op::EventRecord, 0);
        // SAFETY: as above.
        let e = unsafe { r.reg.copy_to_pool(0, 400, &layers, Fill::Exact, STREAM) }.unwrap_err();
        assert!(e.to_string().contains("recording"), "{e}");
        assert_eq!(r.reg.events_in_flight(), 0);
        // And so is an event that cannot be created: nothing enqueued at all.
        let r = rig(1 << 16);
        r.fake.fail_nth(Op::EventCreate, 0);
        // SAFETY: as above.
        let e = unsafe {
            r.reg
                .copy_to_pool(0, 100, &layers[..1], Fill::Exact, STREAM)
        };
        assert!(e.is_err());
        assert_eq!(r.enqueued(), 1, "only the failed create");
        assert_eq!(r.reg.events_in_flight(), 0);
    }

    #[test]
    fn dropping_the_registration_waits_for_copies_destroys_events_and_unregisters() {
        let r = rig(1 << 16);
        let p = r.fake.mem_alloc(64).unwrap();
        let one = [Layer {
            device_ptr: p,
            len: 64,
        }];
        // SAFETY: nothing else touches the block.
        let _ev = unsafe { r.reg.copy_to_pool(0, 64, &one, Fill::Exact, STREAM) }.unwrap();
        let fake = r.fake.clone();
        drop(r);
        let calls = fake.calls();
        let tail: Vec<_> = calls.iter().rev().take(3).rev().cloned().collect();
        assert!(
            matches!(
                tail.as_slice(),
                [Call::EventSync, Call::EventDestroy, Call::Unregister { .. }]
            ),
            "{tail:?}"
        );
        assert!(fake.registered().is_empty());
    }
}
