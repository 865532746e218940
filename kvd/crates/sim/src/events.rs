//! The event heap: every change in the simulated cluster happens at an event, and events are
//! taken in `(time, sequence)` order, so two events at the same microsecond run in the order
//! they were scheduled. That order, and nothing else, makes a run deterministic.
//!
//! The heap has a hard cap on the events it will ever hand out; a run that reaches it stops
//! with an error that says which knob to turn, instead of running on.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Simulated time in microseconds since the start of a run.
pub type SimTime = u64;

/// Microseconds per second.
pub const US_PER_S: f64 = 1e6;

/// Seconds (a model's output) to simulated microseconds, rounded up, at least 1 when positive.
pub fn secs_to_us(s: f64) -> SimTime {
    debug_assert!(
        s.is_finite() && s >= 0.0,
        "a duration is finite and non-negative: {s}"
    );
    if s <= 0.0 {
        return 0;
    }
    // The epsilon keeps float noise (0.0108 s = 10800.000000000002 us) from adding a microsecond.
    ((s * US_PER_S - 1e-6).ceil() as SimTime).max(1)
}

/// Simulated microseconds to seconds.
pub fn us_to_secs(t: SimTime) -> f64 {
    t as f64 / US_PER_S
}

/// Index of a worker in the cluster (0-based).
pub type WorkerIdx = usize;
/// Index of a request in the run's workload (0-based, in arrival order).
pub type ReqIdx = usize;

/// What can happen in the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SimEvent {
    /// A request arrives at the router.
    Arrival(ReqIdx),
    /// A worker's iteration ends. `incarnation` drops events of a worker that failed since.
    IterationEnd {
        /// The worker.
        worker: WorkerIdx,
        /// The worker's incarnation when the iteration started.
        incarnation: u32,
    },
    /// A checkpoint chunk finished its trip through the serving worker's network queue.
    CheckpointDone {
        /// The serving worker that sent it.
        worker: WorkerIdx,
        /// Its incarnation when it sent it (a failed sender's chunks are lost).
        incarnation: u32,
        /// Index of the chunk in the cluster's chunk table.
        chunk: usize,
    },
    /// A set of workers fails at once.
    Failure(Vec<WorkerIdx>),
    /// A restore's copies (network and host-to-GPU) are done; the request can rejoin a batch.
    RestoreDone {
        /// The request.
        req: ReqIdx,
        /// The worker it resumes on.
        worker: WorkerIdx,
        /// That worker's incarnation when the restore was planned.
        incarnation: u32,
        /// The request's recovery epoch when the restore was planned.
        epoch: u64,
    },
    /// A recovering worker has loaded its draft model (LOADING_DRAFT is over, ASSIST begins).
    DraftReady {
        /// The worker.
        worker: WorkerIdx,
        /// Its incarnation.
        incarnation: u32,
    },
    /// A recovering worker has its full model again.
    ReloadDone {
        /// The worker.
        worker: WorkerIdx,
        /// Its incarnation.
        incarnation: u32,
    },
    /// A recovering worker finished swapping the draft for the full model.
    HotswapDone {
        /// The worker.
        worker: WorkerIdx,
        /// Its incarnation.
        incarnation: u32,
    },
    /// Take a periodic sample of the cluster (queue depth, host memory).
    Sample,
}

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Key {
    time: SimTime,
    seq: u64,
}

#[derive(Debug)]
struct Entry {
    key: Key,
    event: SimEvent,
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Entry {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.key.cmp(&other.key)
    }
}

/// A min-heap of events by `(time, sequence)` with a cap on how many it hands out.
#[derive(Debug)]
pub struct EventQueue {
    heap: BinaryHeap<Reverse<Entry>>,
    next_seq: u64,
    now: SimTime,
    popped: u64,
    max_events: u64,
}

impl EventQueue {
    /// An empty queue at time 0 that hands out at most `max_events` events.
    pub fn new(max_events: u64) -> Self {
        EventQueue {
            heap: BinaryHeap::new(),
            next_seq: 0,
            now: 0,
            popped: 0,
            max_events,
        }
    }

    /// The time of the last event handed out.
    pub fn now(&self) -> SimTime {
        self.now
    }

    /// Events handed out so far.
    pub fn popped(&self) -> u64 {
        self.popped
    }

    /// Events waiting.
    pub fn len(&self) -> usize {
        self.heap.len()
    }

    /// Whether no event waits.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    /// Schedules `event` at `time`.
    ///
    /// # Panics
    /// If `time` is in the past: an event never changes what already happened.
    pub fn push(&mut self, time: SimTime, event: SimEvent) {
        assert!(
            time >= self.now,
            "event {event:?} scheduled at {time} us, before now ({} us)",
            self.now
        );
        let seq = self.next_seq;
        self.next_seq += 1;
        self.heap.push(Reverse(Entry {
            key: Key { time, seq },
            event,
        }));
    }

    /// Takes the earliest event, or `None` when none waits.
    ///
    /// # Errors
    /// [`crate::Error::Deadline`] once `max_events` events were handed out.
    pub fn pop(&mut self) -> crate::Result<Option<(SimTime, SimEvent)>> {
        let Some(Reverse(entry)) = self.heap.pop() else {
            return Ok(None);
        };
        if self.popped >= self.max_events {
            return Err(crate::Error::Deadline(format!(
                "the simulation reached its cap of {} events at t = {:.3} s; \
                 shorten the simulated duration, use fewer workers, or raise --max-events",
                self.max_events,
                us_to_secs(entry.key.time)
            )));
        }
        debug_assert!(entry.key.time >= self.now, "time never goes backwards");
        self.now = entry.key.time;
        self.popped += 1;
        Ok(Some((entry.key.time, entry.event)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_come_out_by_time_then_by_the_order_they_were_scheduled() {
        let mut q = EventQueue::new(100);
        q.push(5, SimEvent::Sample);
        q.push(3, SimEvent::Arrival(1));
        q.push(5, SimEvent::Arrival(2));
        q.push(3, SimEvent::Arrival(0));
        let order: Vec<_> = std::iter::from_fn(|| q.pop().unwrap()).collect();
        assert_eq!(
            order,
            vec![
                (3, SimEvent::Arrival(1)),
                (3, SimEvent::Arrival(0)),
                (5, SimEvent::Sample),
                (5, SimEvent::Arrival(2)),
            ]
        );
    }

    #[test]
    fn the_event_cap_stops_a_run_with_an_error_that_says_what_to_do() {
        let mut q = EventQueue::new(2);
        for i in 0..3 {
            q.push(i, SimEvent::Sample);
        }
        assert!(q.pop().unwrap().is_some());
        assert!(q.pop().unwrap().is_some());
        let err = q.pop().unwrap_err();
        assert!(matches!(err, crate::Error::Deadline(ref m) if m.contains("--max-events")));
    }

    #[test]
    fn seconds_round_up_to_whole_microseconds() {
        assert_eq!(secs_to_us(0.0), 0);
        assert_eq!(secs_to_us(1e-9), 1);
        assert_eq!(secs_to_us(0.0108), 10_800);
        assert_eq!(secs_to_us(1.0000001), 1_000_001);
    }
}
