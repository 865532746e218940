//! Graceful drain.
//!
//! SIGTERM, SIGINT or `POST /drain` start it. At once: `/readyz` answers 503, new sessions are
//! refused with `Unavailable`, and allocations are refused with `Unavailable` (readers and
//! writers already at work carry on: seal, publish, release). The drain then waits until no
//! block is unfinished (ALLOCATED, WRITING, SEALED) and no pin is held, or no session is left,
//! or the drain deadline passes; then it closes every connection, aborts what remains (closing
//! each session aborts its unfinished blocks and drops its pins), and the daemon exits 0.
//!
//! A watchdog thread, started with the drain, ends the process with exit code 3 at the hard
//! deadline if anything above hangs: the node never lingers half-drained.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use super::context::Daemon;

/// Exit code when the hard deadline ends a stuck drain.
pub const HARD_DEADLINE_EXIT_CODE: i32 = 3;

/// Whether the node is draining, and the signal that starts a drain.
#[derive(Debug, Default)]
pub struct DrainState {
    draining: AtomicBool,
    requested: Notify,
    since: std::sync::OnceLock<Instant>,
}

impl DrainState {
    /// Ask for a drain (idempotent). The node is not ready from this moment.
    pub fn request(&self) {
        if !self.draining.swap(true, Ordering::SeqCst) {
            let _ = self.since.set(Instant::now());
            self.requested.notify_one();
        }
    }

    /// How long the drain has run (zero before one begins): what an alert on a stuck drain reads.
    pub fn elapsed(&self) -> Duration {
        self.since.get().map_or(Duration::ZERO, Instant::elapsed)
    }

    /// Whether a drain has begun.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Wait until a drain is requested.
    pub async fn requested(&self) {
        if self.is_draining() {
            return;
        }
        self.requested.notified().await;
    }
}

/// What a drain did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainReport {
    /// Whether all work finished before the deadline.
    pub finished_in_time: bool,
    /// How long the drain took, ms.
    pub took_ms: u64,
    /// Unfinished blocks aborted at the end.
    pub blocks_aborted: u32,
    /// Pins dropped at the end.
    pub pins_dropped: u32,
    /// Sessions closed at the end.
    pub sessions_closed: u32,
}

/// Run a drain to its end (the caller then exits).
pub async fn run(d: &Daemon) -> DrainReport {
    d.drain.request();
    let start = Instant::now();
    let hard = Duration::from_millis(d.config.settings.hard_deadline_ms);
    std::thread::Builder::new()
        .name("kvd-drain-watchdog".into())
        .spawn(move || {
            std::thread::sleep(hard);
            eprintln!(
                "kvd: the drain passed its hard deadline of {} ms; exiting",
                hard.as_millis()
            );
            std::process::exit(HARD_DEADLINE_EXIT_CODE);
        })
        .expect("spawning the drain watchdog");
    let deadline = start + Duration::from_millis(d.config.settings.drain_deadline_ms);
    tracing::info!(
        deadline_ms = d.config.settings.drain_deadline_ms,
        hard_deadline_ms = d.config.settings.hard_deadline_ms,
        "draining: not ready, refusing new sessions and allocations"
    );
    let mut finished_in_time = false;
    loop {
        let s = d.store.stats();
        let a = s.accounting;
        let unfinished = a.allocated + a.writing + a.sealed;
        if s.sessions == 0 || (unfinished == 0 && s.pins == 0) {
            finished_in_time = true;
            break;
        }
        if Instant::now() >= deadline {
            tracing::warn!(
                unfinished,
                pins = s.pins,
                sessions = s.sessions,
                "drain deadline reached; aborting what remains"
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Close every connection, then abort whatever their sessions still hold.
    let _ = d.shutdown.send(true);
    let settle = Instant::now() + Duration::from_millis(1000);
    while d.metrics.sessions_open.get() > 0 && Instant::now() < settle {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut report = DrainReport {
        finished_in_time,
        ..DrainReport::default()
    };
    for s in d.store.sessions(usize::MAX) {
        let c = d.store.close_session(s.id);
        report.blocks_aborted += c.blocks_aborted;
        report.pins_dropped += c.pins_dropped;
        report.sessions_closed += 1;
    }
    report.took_ms = start.elapsed().as_millis() as u64;
    tracing::info!(?report, "drained");
    report
}
