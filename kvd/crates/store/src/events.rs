//! Block events for KV-aware routers: which blocks this node holds, without polling lookups.
//!
//! The store appends one [`BlockEvent`] per visibility change of a key, under the same lock as
//! the change itself, so the log's order is the order in which lookups began to hit or miss:
//!
//! - `Stored` when a block becomes PUBLISHED (`Inner::publish_slot`, the one step that both
//!   group publish and `manifest_extend` go through);
//! - `Removed` when a PUBLISHED block leaves the key index (`Inner::unlink`, the one step that
//!   compare-and-delete, LRU eviction, quarantine and a manifest's end, expiry or supersession
//!   all go through). Unfinished blocks (aborted, or dropped with their session) were never
//!   visible and log nothing.
//!
//! The log is a ring of `event_log_capacity` entries, allocated when the store starts: when
//! it is full the oldest event is dropped. A reader drains it in batches with
//! [`crate::Store::events`], passing the `next_seq` of its previous batch; if the ring dropped
//! events it had not read yet, the batch says how many in `lost`, and the reader must resync
//! with a full lookup (its picture of the node has a hole the log cannot fill).
//!
//! Sequence numbers start at 1 and increase by one per event, per node incarnation: a restart
//! starts again at 1, with an empty index. The node generation (in every handle and in the
//! client's welcome) tells incarnations apart, so a router that sees it change starts over
//! from 0 with a full resync.

use std::collections::VecDeque;

use crate::keys::BlockKey;
use crate::types::{BlockEvent, BlockEventKind, EventBatch};
use crate::{Error, Result};

/// The largest `event_log_capacity` accepted (about 80 MiB of events).
pub const MAX_EVENT_LOG_CAPACITY: u32 = 1 << 20;

/// The bounded ring of block events.
///
/// Invariant: the ring holds at most `capacity` events, with consecutive sequence numbers
/// ending at `next_seq - 1`.
#[derive(Debug)]
pub(crate) struct EventLog {
    ring: VecDeque<BlockEvent>,
    capacity: usize,
    /// The sequence number the next event gets (1 before the first).
    next_seq: u64,
}

impl EventLog {
    /// An empty log of `capacity` events, allocated now (not on the hot path).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a capacity of 0 or above [`MAX_EVENT_LOG_CAPACITY`].
    pub fn new(capacity: u32) -> Result<EventLog> {
        if capacity == 0 || capacity > MAX_EVENT_LOG_CAPACITY {
            return Err(Error::InvalidArgument(format!(
                "event_log_capacity must be 1 to {MAX_EVENT_LOG_CAPACITY}, not {capacity}"
            )));
        }
        Ok(EventLog {
            ring: VecDeque::with_capacity(capacity as usize),
            capacity: capacity as usize,
            next_seq: 1,
        })
    }

    /// Append an event, dropping the oldest when the ring is full.
    pub fn push(&mut self, kind: BlockEventKind, key: BlockKey) {
        if self.ring.len() == self.capacity {
            self.ring.pop_front();
        }
        self.ring.push_back(BlockEvent {
            seq: self.next_seq,
            kind,
            key,
        });
        self.next_seq += 1;
    }

    /// The sequence number of the oldest event still held (`next_seq` when none is).
    fn oldest_seq(&self) -> u64 {
        self.ring.front().map_or(self.next_seq, |e| e.seq)
    }

    /// Events with `seq >= since`, at most `max`; `since` 0 reads from the start.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a `since` past the end of the log: a sequence number from
    /// another incarnation (the reader must resync and start again from 0).
    pub fn read(&self, since: u64, max: usize) -> Result<EventBatch> {
        let since = since.max(1);
        if since > self.next_seq {
            return Err(Error::InvalidArgument(format!(
                "event sequence {since} is past this incarnation's log (next is {}); a \
                 sequence number from before a restart: resync and start from 0",
                self.next_seq
            )));
        }
        let oldest = self.oldest_seq();
        let start = since.max(oldest);
        let lost = start - since;
        // O(1) to the first wanted event, then at most `max` copied: bounded work under the lock.
        let first = (start - oldest) as usize;
        let events: Vec<BlockEvent> = self.ring.range(first..).take(max).copied().collect();
        let next_seq = start + events.len() as u64;
        debug_assert!(events.first().is_none_or(|e| e.seq == start));
        Ok(EventBatch {
            events,
            next_seq,
            lost,
        })
    }

    /// The room's invariant.
    pub fn check(&self) -> std::result::Result<(), String> {
        if self.ring.len() > self.capacity {
            return Err(format!(
                "the event log holds {} events, its capacity is {}",
                self.ring.len(),
                self.capacity
            ));
        }
        let first = self.next_seq - self.ring.len() as u64;
        if let Some((k, e)) = self
            .ring
            .iter()
            .enumerate()
            .find(|(k, e)| e.seq != first + *k as u64)
        {
            return Err(format!(
                "event {k} of the log has sequence {}, expected {}",
                e.seq,
                first + k as u64
            ));
        }
        Ok(())
    }
}
