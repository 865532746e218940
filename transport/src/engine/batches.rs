//! Completion bookkeeping, shared by every backend: which batches exist, what each op's state
//! is, how many chunks of it are still out, and what is in flight per endpoint and in all.
//!
//! An op moves `Pending → Done | Failed | Cancelled` once, when its last chunk is accounted
//! for (the first failure of any chunk decides a failed op). A batch is *terminal* when every
//! op is, and *settled* when, in addition, no chunk of it is still referenced by the backend
//! (a send the kernel has not finished, a receive into its memory): only then may the caller
//! touch its memory again, and only then can it be released. In-flight accounting is given
//! back per op, when the op becomes terminal, so the bounds count work that is really out.

use std::collections::HashMap;
use std::sync::Arc;

use super::{EndpointId, Limits, Memory};
use crate::error::{Error, Result};

/// Wait until `batch` is settled or `timeout` passes; its status then. For backends that keep
/// their table behind a mutex and announce settling on `settled` (their `Transport::wait`).
///
/// # Errors
/// [`Error::NotFound`].
pub fn wait_settled(
    batches: &std::sync::Mutex<Batches>,
    settled: &std::sync::Condvar,
    batch: BatchId,
    timeout: std::time::Duration,
) -> Result<BatchStatus> {
    let deadline = std::time::Instant::now() + timeout;
    let mut b = batches.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let st = b.status(batch, &mut [])?;
        let now = std::time::Instant::now();
        if st.settled || now >= deadline {
            return Ok(st);
        }
        b = settled
            .wait_timeout(b, deadline - now)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

/// One batch, as `submit` numbered it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BatchId(pub u64);

/// Why an op failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpFailure {
    /// The peer closed the connection or reset it (it died, or closed the endpoint).
    PeerClosed,
    /// The peer made no progress within the stall timeout (a cut link, a stopped process).
    Timeout,
    /// The peer refused the access: no live grant covers it (the reason's code, as
    /// [`crate::grant::Grants::refusals`] orders them, 7 for a stale node generation).
    Refused(u8),
    /// A chunk's CRC-32C did not match its bytes.
    Corrupt,
    /// The peer answered outside the protocol (the endpoint was closed).
    Protocol,
    /// A frame failed its integrity tag: changed in flight, replayed, or not from the
    /// authenticated peer (the endpoint was closed).
    Tampered,
    /// This side closed the endpoint (or the engine) with the op in flight.
    Closed,
}

impl std::fmt::Display for OpFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OpFailure::PeerClosed => f.write_str("the peer closed the connection"),
            OpFailure::Timeout => f.write_str("the peer stalled past the timeout"),
            OpFailure::Refused(r) => write!(f, "the peer refused the access (reason {r})"),
            OpFailure::Corrupt => f.write_str("a chunk failed its CRC-32C"),
            OpFailure::Protocol => f.write_str("the peer broke the protocol"),
            OpFailure::Tampered => f.write_str("a frame failed its integrity check"),
            OpFailure::Closed => f.write_str("the endpoint was closed here"),
        }
    }
}

/// One op's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpStatus {
    /// Chunks are still out.
    Pending,
    /// Every byte moved (and every checksum, where on, matched).
    Done,
    /// At least one chunk failed; what the op's destination range holds is undefined.
    Failed(OpFailure),
    /// Cancelled before all its chunks were sent; its destination range is undefined.
    Cancelled,
}

/// A batch's status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BatchStatus {
    /// Ops in the batch.
    pub ops: usize,
    /// Ops done.
    pub done: usize,
    /// Ops failed.
    pub failed: usize,
    /// Ops cancelled.
    pub cancelled: usize,
    /// Bytes of chunks that arrived intact.
    pub bytes_done: u64,
    /// The first failure, if any.
    pub first_failure: Option<OpFailure>,
    /// Every op is done, failed or cancelled.
    pub terminal: bool,
    /// Terminal, and the backend no longer touches the batch's memory.
    pub settled: bool,
}

impl BatchStatus {
    /// Settled with every op done.
    pub fn succeeded(&self) -> bool {
        self.settled && self.done == self.ops
    }
}

/// How one chunk ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkOutcome {
    /// It arrived intact.
    Delivered,
    /// It failed.
    Failed(OpFailure),
    /// It was dropped before it was sent.
    Cancelled,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct InFlight {
    ops: usize,
    bytes: u64,
}

#[derive(Debug)]
struct OpState {
    len: u64,
    chunks_left: u32,
    status: OpStatus,
    failure: Option<OpFailure>,
    cancelled: bool,
    /// (offset, len, CRC-32C) of the chunks verified on arrival, when the backend reports
    /// them (reads with checksums on).
    crcs: Vec<(u64, u32, u32)>,
}

#[derive(Debug)]
struct Batch {
    endpoint: EndpointId,
    ops: Vec<OpState>,
    unresolved: usize,
    wire_refs: u64,
    bytes_done: u64,
    cancelled: bool,
    _keep: Vec<Arc<dyn Memory>>,
}

impl Batch {
    fn terminal(&self) -> bool {
        self.unresolved == 0
    }
    fn settled(&self) -> bool {
        self.unresolved == 0 && self.wire_refs == 0
    }
}

/// The batches of one engine.
#[derive(Debug)]
pub struct Batches {
    limits: Limits,
    next: u64,
    batches: HashMap<BatchId, Batch>,
    endpoints: HashMap<EndpointId, InFlight>,
    total: InFlight,
}

fn overloaded(what: String) -> Error {
    Error::Overloaded {
        what,
        retry_after_ms: 1,
    }
}

impl Batches {
    /// An empty table.
    pub fn new(limits: Limits) -> Batches {
        Batches {
            limits,
            next: 1,
            batches: HashMap::new(),
            endpoints: HashMap::new(),
            total: InFlight::default(),
        }
    }

    /// The bounds in force.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Admit a batch on `endpoint` of ops `(len, chunks)`, keeping `keep` alive until it is
    /// released. All or nothing.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty batch, an op of no bytes or no chunks, a batch
    /// past [`Limits::max_batch_ops`]; [`Error::Overloaded`] past any in-flight bound.
    pub fn admit(
        &mut self,
        endpoint: EndpointId,
        ops: &[(u64, u32)],
        keep: Vec<Arc<dyn Memory>>,
    ) -> Result<BatchId> {
        let l = self.limits;
        if ops.is_empty() || ops.len() > l.max_batch_ops {
            return Err(Error::InvalidArgument(format!(
                "a batch holds 1 to {} ops, not {}",
                l.max_batch_ops,
                ops.len()
            )));
        }
        if ops.iter().any(|&(len, chunks)| len == 0 || chunks == 0) {
            return Err(Error::InvalidArgument(
                "an op moves at least one byte".into(),
            ));
        }
        if self.batches.len() >= l.max_batches {
            return Err(overloaded(format!(
                "{} batches not yet released (the limit)",
                self.batches.len()
            )));
        }
        let bytes: u64 = ops.iter().map(|&(len, _)| len).sum();
        let ep = self.endpoints.get(&endpoint).copied().unwrap_or_default();
        if ep.ops + ops.len() > l.max_ops_per_endpoint
            || ep.bytes + bytes > l.max_bytes_per_endpoint
        {
            return Err(overloaded(format!(
                "endpoint {} has {} ops / {} bytes in flight (limits {} / {})",
                endpoint.0, ep.ops, ep.bytes, l.max_ops_per_endpoint, l.max_bytes_per_endpoint
            )));
        }
        if self.total.ops + ops.len() > l.max_ops || self.total.bytes + bytes > l.max_bytes {
            return Err(overloaded(format!(
                "the engine has {} ops / {} bytes in flight (limits {} / {})",
                self.total.ops, self.total.bytes, l.max_ops, l.max_bytes
            )));
        }
        let id = BatchId(self.next);
        self.next += 1;
        let e = self.endpoints.entry(endpoint).or_default();
        e.ops += ops.len();
        e.bytes += bytes;
        self.total.ops += ops.len();
        self.total.bytes += bytes;
        let ops: Vec<OpState> = ops
            .iter()
            .map(|&(len, chunks)| OpState {
                len,
                chunks_left: chunks,
                status: OpStatus::Pending,
                failure: None,
                cancelled: false,
                crcs: Vec::new(),
            })
            .collect();
        self.batches.insert(
            id,
            Batch {
                endpoint,
                unresolved: ops.len(),
                ops,
                wire_refs: 0,
                bytes_done: 0,
                cancelled: false,
                _keep: keep,
            },
        );
        Ok(id)
    }

    /// One chunk of op `op` of `batch` (of `bytes` bytes) ended. Returns whether the batch
    /// became settled by it. Unknown batches or ops are ignored (false).
    pub fn chunk_finished(
        &mut self,
        batch: BatchId,
        op: u32,
        bytes: u64,
        outcome: ChunkOutcome,
    ) -> bool {
        let Some(b) = self.batches.get_mut(&batch) else {
            return false;
        };
        let Some(o) = b.ops.get_mut(op as usize) else {
            return false;
        };
        if o.chunks_left == 0 {
            return false;
        }
        o.chunks_left -= 1;
        match outcome {
            ChunkOutcome::Delivered => b.bytes_done += bytes,
            ChunkOutcome::Failed(f) => {
                o.failure.get_or_insert(f);
            }
            ChunkOutcome::Cancelled => o.cancelled = true,
        }
        if o.chunks_left > 0 {
            return false;
        }
        o.status = match (o.failure, o.cancelled) {
            (Some(f), _) => OpStatus::Failed(f),
            (None, true) => OpStatus::Cancelled,
            (None, false) => OpStatus::Done,
        };
        b.unresolved -= 1;
        let len = o.len;
        let endpoint = b.endpoint;
        let settled = b.settled();
        let e = self.endpoints.entry(endpoint).or_default();
        e.ops -= 1;
        e.bytes -= len;
        if *e == InFlight::default() {
            self.endpoints.remove(&endpoint);
        }
        self.total.ops -= 1;
        self.total.bytes -= len;
        settled
    }

    /// A chunk of op `op` of `batch`, `len` bytes at `offset` (any base, the same for all of
    /// the op's chunks), arrived and matched CRC-32C `crc`.
    pub fn record_crc(&mut self, batch: BatchId, op: u32, offset: u64, len: u32, crc: u32) {
        if let Some(o) = self
            .batches
            .get_mut(&batch)
            .and_then(|b| b.ops.get_mut(op as usize))
        {
            o.crcs.push((offset, len, crc));
        }
    }

    /// Each done op's CRC-32C, from the chunks verified on arrival, into `out` (as many as
    /// fit); `None` where they were not reported or do not cover the op exactly.
    ///
    /// # Errors
    /// [`Error::NotFound`].
    pub fn checksums(&self, batch: BatchId, out: &mut [Option<u32>]) -> Result<()> {
        let b = self
            .batches
            .get(&batch)
            .ok_or_else(|| Error::NotFound(format!("batch {}", batch.0)))?;
        for (o, slot) in b.ops.iter().zip(out.iter_mut()) {
            *slot = None;
            if o.status != OpStatus::Done || o.crcs.is_empty() {
                continue;
            }
            let mut chunks = o.crcs.clone();
            chunks.sort_unstable();
            let mut at = chunks[0].0;
            let mut crc: Option<u32> = None;
            let mut covered = 0u64;
            let mut tiles = true;
            for (off, len, c) in chunks {
                if off != at {
                    tiles = false;
                    break;
                }
                crc = Some(match crc {
                    None => c,
                    Some(acc) => crate::local::crc32c_combine(acc, c, len as usize),
                });
                at += u64::from(len);
                covered += u64::from(len);
            }
            if tiles && covered == o.len {
                *slot = crc;
            }
        }
        Ok(())
    }

    /// The backend now references `n` more chunks' memory of `batch` (sends or receives
    /// posted).
    pub fn wire_taken(&mut self, batch: BatchId, n: u64) {
        if let Some(b) = self.batches.get_mut(&batch) {
            b.wire_refs += n;
        }
    }

    /// The backend let go of `n` chunks' memory of `batch`. Returns whether the batch became
    /// settled by it.
    pub fn wire_released(&mut self, batch: BatchId, n: u64) -> bool {
        let Some(b) = self.batches.get_mut(&batch) else {
            return false;
        };
        b.wire_refs = b.wire_refs.saturating_sub(n);
        b.settled()
    }

    /// Mark `batch` cancelled (the backend then drops its unsent chunks as
    /// [`ChunkOutcome::Cancelled`]). Returns whether it was known.
    pub fn cancel(&mut self, batch: BatchId) -> bool {
        match self.batches.get_mut(&batch) {
            Some(b) => {
                b.cancelled = true;
                true
            }
            None => false,
        }
    }

    /// Whether `batch` is being cancelled.
    pub fn is_cancelled(&self, batch: BatchId) -> bool {
        self.batches.get(&batch).is_some_and(|b| b.cancelled)
    }

    /// Whether `batch` exists and is settled.
    pub fn is_settled(&self, batch: BatchId) -> Option<bool> {
        self.batches.get(&batch).map(Batch::settled)
    }

    /// The batch's status, and its ops' into `out` (as many as fit).
    ///
    /// # Errors
    /// [`Error::NotFound`].
    pub fn status(&self, batch: BatchId, out: &mut [OpStatus]) -> Result<BatchStatus> {
        let b = self
            .batches
            .get(&batch)
            .ok_or_else(|| Error::NotFound(format!("batch {}", batch.0)))?;
        let mut s = BatchStatus {
            ops: b.ops.len(),
            bytes_done: b.bytes_done,
            terminal: b.terminal(),
            settled: b.settled(),
            ..BatchStatus::default()
        };
        for (i, o) in b.ops.iter().enumerate() {
            match o.status {
                OpStatus::Done => s.done += 1,
                OpStatus::Failed(f) => {
                    s.failed += 1;
                    s.first_failure.get_or_insert(f);
                }
                OpStatus::Cancelled => s.cancelled += 1,
                OpStatus::Pending => {}
            }
            if let Some(slot) = out.get_mut(i) {
                *slot = o.status;
            }
        }
        Ok(s)
    }

    /// Forget a settled batch.
    ///
    /// # Errors
    /// [`Error::NotFound`]; [`Error::InvalidArgument`] when it is not settled.
    pub fn release(&mut self, batch: BatchId) -> Result<()> {
        match self.batches.get(&batch) {
            None => Err(Error::NotFound(format!("batch {}", batch.0))),
            Some(b) if !b.settled() => Err(Error::InvalidArgument(format!(
                "batch {} is not settled yet; wait for it (or cancel it) first",
                batch.0
            ))),
            Some(_) => {
                self.batches.remove(&batch);
                Ok(())
            }
        }
    }

    /// Batches known (not released).
    pub fn len(&self) -> usize {
        self.batches.len()
    }

    /// Whether no batch is known.
    pub fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }

    /// Ops and bytes in flight, in all.
    pub fn in_flight(&self) -> (usize, u64) {
        (self.total.ops, self.total.bytes)
    }

    /// Check the accounting: the in-flight totals are exactly the sums over unresolved ops.
    ///
    /// # Errors
    /// A description of the first discrepancy.
    pub fn check(&self) -> std::result::Result<(), String> {
        let mut total = InFlight::default();
        let mut per: HashMap<EndpointId, InFlight> = HashMap::new();
        for b in self.batches.values() {
            let unresolved = b
                .ops
                .iter()
                .filter(|o| o.status == OpStatus::Pending)
                .count();
            if unresolved != b.unresolved {
                return Err(format!(
                    "unresolved {} vs counted {}",
                    unresolved, b.unresolved
                ));
            }
            for o in b.ops.iter().filter(|o| o.status == OpStatus::Pending) {
                total.ops += 1;
                total.bytes += o.len;
                let e = per.entry(b.endpoint).or_default();
                e.ops += 1;
                e.bytes += o.len;
            }
        }
        if total != self.total {
            return Err(format!("in flight {:?} vs counted {:?}", total, self.total));
        }
        if per != self.endpoints {
            return Err(format!(
                "per endpoint {per:?} vs counted {:?}",
                self.endpoints
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn limits() -> Limits {
        Limits {
            max_ops_per_endpoint: 8,
            max_bytes_per_endpoint: 1 << 20,
            max_ops: 12,
            max_bytes: 1 << 21,
            max_batch_ops: 6,
            max_batches: 5,
            max_endpoints: 4,
        }
    }

    const E: EndpointId = EndpointId(1);

    #[test]
    fn an_op_is_done_only_when_its_last_chunk_arrives_and_settled_only_when_off_the_wire() {
        let mut t = Batches::new(limits());
        let b = t.admit(E, &[(300, 3), (10, 1)], vec![]).unwrap();
        t.wire_taken(b, 4);
        let mut ops = [OpStatus::Pending; 2];
        assert!(!t.chunk_finished(b, 0, 100, ChunkOutcome::Delivered));
        assert!(!t.chunk_finished(b, 1, 10, ChunkOutcome::Delivered));
        let s = t.status(b, &mut ops).unwrap();
        assert_eq!(ops, [OpStatus::Pending, OpStatus::Done]);
        assert!(!s.terminal);
        t.chunk_finished(b, 0, 100, ChunkOutcome::Delivered);
        t.chunk_finished(b, 0, 100, ChunkOutcome::Delivered);
        let s = t.status(b, &mut ops).unwrap();
        assert!(s.terminal && !s.settled, "chunks still referenced");
        assert_eq!(s.bytes_done, 310);
        assert!(
            t.release(b).is_err(),
            "an unsettled batch cannot be released"
        );
        assert!(t.wire_released(b, 4));
        assert!(t.status(b, &mut ops).unwrap().succeeded());
        t.release(b).unwrap();
        assert!(t.is_empty());
    }

    #[test]
    fn the_first_failure_of_any_chunk_fails_the_op_and_later_successes_do_not_undo_it() {
        let mut t = Batches::new(limits());
        let b = t.admit(E, &[(300, 3)], vec![]).unwrap();
        t.chunk_finished(b, 0, 100, ChunkOutcome::Failed(OpFailure::Corrupt));
        t.chunk_finished(b, 0, 100, ChunkOutcome::Failed(OpFailure::Timeout));
        t.chunk_finished(b, 0, 100, ChunkOutcome::Delivered);
        let mut ops = [OpStatus::Pending];
        let s = t.status(b, &mut ops).unwrap();
        assert_eq!(ops[0], OpStatus::Failed(OpFailure::Corrupt));
        assert_eq!((s.failed, s.first_failure), (1, Some(OpFailure::Corrupt)));
    }

    #[test]
    fn bounds_refuse_a_whole_batch_with_a_retryable_error_and_admit_nothing_of_it() {
        let mut t = Batches::new(limits());
        let a = t.admit(E, &[(1, 1); 6], vec![]).unwrap();
        let e = t.admit(E, &[(1, 1); 3], vec![]).unwrap_err();
        assert!(e.is_retryable(), "{e}");
        assert_eq!(t.in_flight(), (6, 6));
        let e = t.admit(E, &[(1 << 20, 1)], vec![]).unwrap_err();
        assert!(e.is_retryable(), "{e}");
        assert!(
            t.admit(E, &[(1, 1); 7], vec![]).is_err(),
            "past max_batch_ops"
        );
        assert!(t.admit(E, &[], vec![]).is_err());
        assert!(t.admit(E, &[(0, 1)], vec![]).is_err());
        for _ in 0..6 {
            t.chunk_finished(a, 0, 1, ChunkOutcome::Delivered);
        }
        for i in 1..6 {
            t.chunk_finished(a, i, 1, ChunkOutcome::Delivered);
        }
        assert_eq!(t.in_flight(), (0, 0));
        t.admit(E, &[(1, 1); 3], vec![]).unwrap();
        t.check().unwrap();
    }

    #[test]
    fn cancelled_chunks_make_a_cancelled_op_unless_another_chunk_failed() {
        let mut t = Batches::new(limits());
        let b = t.admit(E, &[(2, 2), (2, 2)], vec![]).unwrap();
        assert!(t.cancel(b));
        t.chunk_finished(b, 0, 1, ChunkOutcome::Delivered);
        t.chunk_finished(b, 0, 1, ChunkOutcome::Cancelled);
        t.chunk_finished(b, 1, 1, ChunkOutcome::Cancelled);
        t.chunk_finished(b, 1, 1, ChunkOutcome::Failed(OpFailure::PeerClosed));
        let mut ops = [OpStatus::Pending; 2];
        let s = t.status(b, &mut ops).unwrap();
        assert_eq!(
            ops,
            [OpStatus::Cancelled, OpStatus::Failed(OpFailure::PeerClosed)]
        );
        assert!(s.settled);
    }

    proptest! {
        #[test]
        fn accounting_always_equals_the_sum_over_unresolved_ops(
            steps in proptest::collection::vec((0u8..4, 0usize..8, 1u64..5000, 1u32..4), 1..200)
        ) {
            let mut t = Batches::new(limits());
            let mut ids: Vec<BatchId> = vec![];
            for (what, pick, len, chunks) in steps {
                match what {
                    0 => {
                        let n = pick % 6 + 1;
                        let ep = EndpointId(pick as u64 % 2);
                        if let Ok(b) = t.admit(ep, &vec![(len, chunks); n], vec![]) {
                            ids.push(b);
                        }
                    }
                    1 | 2 if !ids.is_empty() => {
                        let b = ids[pick % ids.len()];
                        let outcome = if what == 1 {
                            ChunkOutcome::Delivered
                        } else {
                            ChunkOutcome::Failed(OpFailure::Timeout)
                        };
                        t.chunk_finished(b, (pick % 6) as u32, 1, outcome);
                    }
                    _ if !ids.is_empty() => {
                        let b = ids[pick % ids.len()];
                        if t.release(b).is_ok() {
                            ids.retain(|&x| x != b);
                        }
                    }
                    _ => {}
                }
                prop_assert!(t.check().is_ok(), "{:?}", t.check());
                let (ops, bytes) = t.in_flight();
                prop_assert!(ops <= 12 && bytes <= 1 << 21);
            }
        }
    }
}
