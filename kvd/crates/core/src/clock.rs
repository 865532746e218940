//! Injected time. The store and the control shim never read the wall clock themselves: they
//! take a [`Clock`], so leases, TTLs and the reaper are tested deterministically with a
//! [`ManualClock`], and run on [`MonotonicClock`] in the daemon.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// A source of monotonic milliseconds.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Milliseconds since an arbitrary, fixed origin. Never goes backwards.
    fn now_ms(&self) -> u64;
}

/// The real clock: milliseconds since the clock was created, from [`Instant`].
#[derive(Debug)]
pub struct MonotonicClock {
    origin: Instant,
}

impl MonotonicClock {
    /// A clock starting at 0 now.
    pub fn new() -> Self {
        MonotonicClock {
            origin: Instant::now(),
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }
}

/// A clock that moves only when told to: for tests and the simulator.
#[derive(Debug, Default)]
pub struct ManualClock {
    now_ms: AtomicU64,
}

impl ManualClock {
    /// A manual clock at `start_ms`, shared.
    pub fn new(start_ms: u64) -> Arc<Self> {
        Arc::new(ManualClock {
            now_ms: AtomicU64::new(start_ms),
        })
    }

    /// Move the clock forward by `ms`.
    pub fn advance(&self, ms: u64) {
        self.now_ms.fetch_add(ms, Ordering::SeqCst);
    }

    /// Set the clock to `ms` (never backwards).
    pub fn set(&self, ms: u64) {
        self.now_ms.fetch_max(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.now_ms.load(Ordering::SeqCst)
    }
}
