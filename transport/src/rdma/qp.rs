//! Queue-pair bookkeeping above the verbs: which state changes are legal, and an endpoint's
//! send queue (work requests waiting for room, posted ones by id, doorbell batches).
//!
//! A work request's memory belongs to the NIC from its post until its completion is polled,
//! so a chunk is accounted finished only then (a flushed completion included); waiting work
//! requests were never posted and can be dropped at once.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use super::verbs::{QpState, WorkRequest};
use crate::engine::BatchId;
use crate::error::{Error, Result};

/// Whether an RC queue pair may go from `from` to `to` (the order `ibv_modify_qp` enforces,
/// plus `Error` from anywhere).
pub fn may_move(from: QpState, to: QpState) -> bool {
    use QpState::*;
    matches!(
        (from, to),
        (Reset, Init) | (Init, ReadyToReceive) | (ReadyToReceive, ReadyToSend) | (_, Error)
    )
}

/// Check a state change.
///
/// # Errors
/// [`Error::InvalidArgument`] for an illegal one.
pub fn check_move(from: QpState, to: QpState) -> Result<()> {
    if may_move(from, to) {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "a queue pair cannot go from {from:?} to {to:?}"
        )))
    }
}

/// What a work request is for: a chunk of op `op` of `batch`.
#[derive(Debug)]
pub struct Slot<K> {
    /// The batch.
    pub batch: BatchId,
    /// The op within it.
    pub op: u32,
    /// Bytes of the chunk.
    pub bytes: u32,
    /// What must live until the completion (the local region).
    pub keep: Arc<K>,
}

/// One endpoint's send queue.
#[derive(Debug)]
pub struct SendQueue<K> {
    depth: usize,
    prefix: u64,
    next: u32,
    waiting: VecDeque<(Slot<K>, WorkRequest)>,
    posted: HashMap<u64, Slot<K>>,
    /// The last post or completion (for the stall check).
    pub last_progress: Instant,
}

impl<K> SendQueue<K> {
    /// A queue of at most `depth` posted work requests whose ids start with `prefix` in their
    /// upper 32 bits (the endpoint, so that one completion queue serves every endpoint).
    pub fn new(depth: usize, prefix: u32) -> SendQueue<K> {
        SendQueue {
            depth: depth.max(1),
            prefix: u64::from(prefix) << 32,
            next: 0,
            waiting: VecDeque::new(),
            posted: HashMap::new(),
            last_progress: Instant::now(),
        }
    }

    /// The endpoint prefix of a work request id.
    pub fn prefix_of(wr_id: u64) -> u32 {
        (wr_id >> 32) as u32
    }

    /// Queue a work request (its id is assigned here).
    pub fn push(&mut self, slot: Slot<K>, mut wr: WorkRequest) {
        wr.wr_id = self.prefix | u64::from(self.next);
        self.next = self.next.wrapping_add(1);
        self.waiting.push_back((slot, wr));
    }

    /// The next doorbell: up to `max` waiting work requests that fit the send queue, moved to
    /// posted. The caller posts them; if that fails it hands them to [`SendQueue::unpost`].
    pub fn doorbell(&mut self, max: usize) -> Vec<WorkRequest> {
        let room = self.depth.saturating_sub(self.posted.len()).min(max);
        let mut wrs = Vec::with_capacity(room.min(self.waiting.len()));
        for _ in 0..room {
            let Some((slot, wr)) = self.waiting.pop_front() else {
                break;
            };
            self.posted.insert(wr.wr_id, slot);
            wrs.push(wr);
        }
        if !wrs.is_empty() {
            self.last_progress = Instant::now();
        }
        wrs
    }

    /// A post of these failed: they were never handed to the NIC; their slots.
    pub fn unpost(&mut self, wrs: &[WorkRequest]) -> Vec<Slot<K>> {
        wrs.iter()
            .filter_map(|w| self.posted.remove(&w.wr_id))
            .collect()
    }

    /// A completion came for `wr_id`: its slot (None for an unknown id).
    pub fn complete(&mut self, wr_id: u64) -> Option<Slot<K>> {
        let s = self.posted.remove(&wr_id);
        if s.is_some() {
            self.last_progress = Instant::now();
        }
        s
    }

    /// Drop the waiting work requests of `batch` (cancel); their slots.
    pub fn cancel(&mut self, batch: BatchId) -> Vec<Slot<K>> {
        let mut out = Vec::new();
        let mut keep = VecDeque::with_capacity(self.waiting.len());
        for (s, w) in self.waiting.drain(..) {
            if s.batch == batch {
                out.push(s);
            } else {
                keep.push_back((s, w));
            }
        }
        self.waiting = keep;
        out
    }

    /// Drop every waiting work request (the endpoint failed); their slots.
    pub fn drain_waiting(&mut self) -> Vec<Slot<K>> {
        self.waiting.drain(..).map(|(s, _)| s).collect()
    }

    /// Forget every posted work request (the queue pair was destroyed, so the NIC no longer
    /// touches their memory); their slots.
    pub fn drain_posted(&mut self) -> Vec<Slot<K>> {
        self.posted.drain().map(|(_, s)| s).collect()
    }

    /// Work requests posted and not yet completed.
    pub fn posted(&self) -> usize {
        self.posted.len()
    }

    /// Work requests waiting for room.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }
}

#[cfg(test)]
mod tests {
    use super::super::verbs::WrKind;
    use super::*;

    fn wr() -> WorkRequest {
        WorkRequest {
            wr_id: 0,
            kind: WrKind::Write,
            local_addr: 0,
            lkey: 1,
            len: 8,
            remote_addr: 0,
            rkey: 2,
        }
    }

    fn slot(batch: u64, op: u32) -> Slot<()> {
        Slot {
            batch: BatchId(batch),
            op,
            bytes: 8,
            keep: Arc::new(()),
        }
    }

    #[test]
    fn a_queue_pair_moves_only_in_order_and_to_error_from_anywhere() {
        use QpState::*;
        let order = [Reset, Init, ReadyToReceive, ReadyToSend];
        for w in order.windows(2) {
            assert!(may_move(w[0], w[1]));
            assert!(!may_move(w[1], w[0]), "{:?} back to {:?}", w[1], w[0]);
        }
        for s in order {
            assert!(may_move(s, Error));
        }
        assert!(!may_move(Reset, ReadyToSend));
        assert!(!may_move(Init, ReadyToSend));
        assert!(!may_move(Error, ReadyToSend));
        assert!(check_move(Reset, ReadyToReceive).is_err());
    }

    #[test]
    fn doorbells_fill_the_send_queue_and_no_more() {
        let mut q = SendQueue::new(4, 7);
        for i in 0..10 {
            q.push(slot(1, i), wr());
        }
        let first = q.doorbell(3);
        assert_eq!(first.len(), 3, "a doorbell carries at most its batch");
        let second = q.doorbell(32);
        assert_eq!(
            second.len(),
            1,
            "then only what the send queue has room for"
        );
        assert!(q.doorbell(32).is_empty());
        assert_eq!((q.posted(), q.waiting()), (4, 6));
        // ids carry the endpoint and are unique
        let mut ids: Vec<u64> = first.iter().chain(&second).map(|w| w.wr_id).collect();
        assert!(ids.iter().all(|&id| SendQueue::<()>::prefix_of(id) == 7));
        ids.dedup();
        assert_eq!(ids.len(), 4);
        // a completion makes room for one more
        assert_eq!(q.complete(first[0].wr_id).unwrap().op, 0);
        assert!(
            q.complete(first[0].wr_id).is_none(),
            "a completion counts once"
        );
        assert_eq!(q.doorbell(32).len(), 1);
    }

    #[test]
    fn a_failed_post_cancel_and_failure_hand_back_exactly_their_slots() {
        let mut q = SendQueue::new(8, 1);
        for i in 0..3 {
            q.push(slot(1, i), wr());
        }
        for i in 0..3 {
            q.push(slot(2, i), wr());
        }
        let posted = q.doorbell(2);
        assert_eq!(
            q.unpost(&posted).len(),
            2,
            "a failed post gives its slots back"
        );
        assert_eq!(q.posted(), 0);
        assert_eq!(
            q.cancel(BatchId(2)).len(),
            3,
            "cancel drops only that batch's waiting"
        );
        assert_eq!(q.waiting(), 1);
        let _ = q.doorbell(8);
        assert_eq!(q.drain_waiting().len(), 0);
        assert_eq!(q.drain_posted().len(), 1);
    }
}
