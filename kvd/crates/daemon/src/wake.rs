//! Holding the CPUs' wake-up latency low while clients are calling (`--cpu-wake-latency-us`).
//!
//! A metadata call is a few microseconds of work on each side, but on a quiet machine both
//! threads sleep between calls, and each wake lands on a CPU that went idle. On a virtual
//! machine an idle vCPU halts and waking it is an interrupt through the hypervisor; on bare
//! metal a deep C-state takes as long to leave. Either costs more than the call (docs/
//! PERFORMANCE.md, "The quiet round trip": exists of one key 86 µs p50 quiet against 13 µs
//! with every CPU kept awake).
//!
//! The kernel's PM QoS interface says how long a CPU may take to wake: while a process holds
//! `/dev/cpu_dma_latency` open with a value written, the idle governor picks no state slower
//! to leave than that (a request of 0 keeps idle CPUs polling, which any runnable thread ends
//! at once, so unlike a spinning client it takes no CPU from the daemon). Idle polling is not
//! free where the machine is shared (a polling vCPU is busy to its host), so the daemon holds
//! the request only while its clients call: the first call after a quiet spell sets it, and it
//! is dropped once no call came for the hold time. An idle daemon holds nothing.
//!
//! Off by default: the device is root's (a udev rule can give kvd's group write access), and
//! the cost, CPUs that poll instead of sleeping while calls come, is the operator's to accept.
//! `kvd_cpu_wake_held`, `kvd_cpu_wake_holds` and `kvd_cpu_wake_held_seconds` show it.

use std::fs::File;
use std::io::Write as _;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;

use crate::{Error, Result};

/// The kernel's PM QoS device for the CPUs' wake-up latency.
pub const DEVICE: &str = "/dev/cpu_dma_latency";

/// What the device takes to mean "no constraint" (the kernel's
/// `PM_QOS_CPU_LATENCY_DEFAULT_VALUE`, 2000 s in µs).
const NO_CONSTRAINT_US: i32 = 2_000_000_000;

/// The metrics a hold keeps.
#[derive(Debug, Clone, Default)]
pub struct WakeMetrics {
    /// 1 while the request is held.
    pub held: Gauge,
    /// Times the request was set after a quiet spell.
    pub holds: Counter,
    /// Seconds the request has been held, in all.
    pub held_seconds: Counter<f64, AtomicU64>,
}

/// The daemon's PM QoS request, held while clients call (see the module doc).
#[derive(Debug)]
pub struct WakeHold {
    /// The open device and when the current hold began (`None`: not held).
    device: Mutex<(File, Option<Instant>)>,
    request_us: i32,
    hold: Duration,
    /// Whether the request is held now (read without the lock on every call).
    held: AtomicBool,
    /// The last call, ms since `epoch`.
    last_call_ms: AtomicU64,
    epoch: Instant,
    metrics: WakeMetrics,
    /// Wakes [`release_when_quiet`] when a hold begins (it sleeps while nothing is held).
    began: tokio::sync::Notify,
}

impl WakeHold {
    /// Open `device` for writing; nothing is requested until the first call.
    ///
    /// # Errors
    /// [`Error::Io`] when the device cannot be opened for writing (no PM QoS, or no
    /// permission), saying what to do.
    pub fn open(
        device: &Path,
        request_us: u32,
        hold: Duration,
        metrics: WakeMetrics,
    ) -> Result<WakeHold> {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(device)
            .map_err(|e| {
                Error::Io(format!(
                    "--cpu-wake-latency-us needs {} open for writing ({e}): run kvd as root, or \
                     give its group write access with a udev rule (KERNEL==\"cpu_dma_latency\", \
                     GROUP=\"kvd\", MODE=\"0660\"), or leave the setting out",
                    device.display()
                ))
            })?;
        let request_us = i32::try_from(request_us)
            .map_err(|_| Error::InvalidArgument("a wake latency beyond i32 µs".into()))?;
        Ok(WakeHold {
            device: Mutex::new((file, None)),
            request_us,
            hold,
            held: AtomicBool::new(false),
            last_call_ms: AtomicU64::new(0),
            epoch: Instant::now(),
            metrics,
            began: tokio::sync::Notify::new(),
        })
    }

    /// How often [`WakeHold::tick`] should run: a quarter of the hold time.
    pub fn tick_interval(&self) -> Duration {
        (self.hold / 4).max(Duration::from_millis(1))
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// A client's call came: hold the request (one write after a quiet spell, else two
    /// atomic operations).
    pub fn note_call(&self) {
        self.last_call_ms.store(self.now_ms(), Ordering::SeqCst);
        if self.held.load(Ordering::SeqCst) {
            return;
        }
        let mut dev = self.device.lock().unwrap_or_else(|p| p.into_inner());
        if self.held.load(Ordering::SeqCst) {
            return;
        }
        match write_request(&mut dev.0, self.request_us) {
            Ok(()) => {
                dev.1 = Some(Instant::now());
                self.held.store(true, Ordering::SeqCst);
                self.metrics.held.set(1);
                self.metrics.holds.inc();
                self.began.notify_one();
            }
            // Not fatal: calls are served, only woken for more slowly. A device that took the
            // open takes writes, so this is not expected; the next call tries again.
            Err(e) => tracing::warn!(error = %e, "setting the CPU wake latency request failed"),
        }
    }

    /// Drop the request if no call came for the hold time (run every
    /// [`WakeHold::tick_interval`]).
    pub fn tick(&self) {
        if !self.held.load(Ordering::SeqCst) {
            return;
        }
        let mut dev = self.device.lock().unwrap_or_else(|p| p.into_inner());
        let quiet = |s: &Self| {
            s.now_ms()
                .saturating_sub(s.last_call_ms.load(Ordering::SeqCst))
                >= u64::try_from(s.hold.as_millis()).unwrap_or(u64::MAX)
        };
        if !self.held.load(Ordering::SeqCst) || !quiet(self) {
            return;
        }
        // Clear the flag first, then look again: a call that stored its time before this
        // second look keeps the hold; one that stores it after sees the flag clear and sets
        // the request again once this lock is let go.
        self.held.store(false, Ordering::SeqCst);
        if !quiet(self) {
            self.held.store(true, Ordering::SeqCst);
            return;
        }
        if let Err(e) = write_request(&mut dev.0, NO_CONSTRAINT_US) {
            tracing::warn!(error = %e, "dropping the CPU wake latency request failed");
        }
        if let Some(began) = dev.1.take() {
            self.metrics
                .held_seconds
                .inc_by(began.elapsed().as_secs_f64());
        }
        self.metrics.held.set(0);
    }

    /// Whether the request is held now.
    pub fn held(&self) -> bool {
        self.held.load(Ordering::SeqCst)
    }
}

/// The device takes the request as one native-endian `s32` per write.
fn write_request(f: &mut File, us: i32) -> std::io::Result<()> {
    f.write_all(&us.to_ne_bytes())
}

/// Drop the request once the calls stop, until the daemon shuts down: while it is held, a
/// [`WakeHold::tick`] every [`WakeHold::tick_interval`]; while it is not, nothing (the task
/// sleeps until a hold begins, so an idle daemon is not woken for it).
pub async fn release_when_quiet(
    hold: std::sync::Arc<WakeHold>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        if !hold.held() {
            tokio::select! {
                // a permit stored by a hold that began before this wait is taken at once
                _ = hold.began.notified() => {}
                _ = shutdown.changed() => return,
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(hold.tick_interval()) => hold.tick(),
            _ = shutdown.changed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The requests written, in order (a regular file stands in for the device, which takes
    /// one `s32` per write; the real device is exercised by `tests/daemon_wake.rs`).
    fn written(path: &Path) -> Vec<i32> {
        std::fs::read(path)
            .unwrap()
            .chunks_exact(4)
            .map(|c| i32::from_ne_bytes(c.try_into().unwrap()))
            .collect()
    }

    #[test]
    fn a_call_holds_the_request_until_the_calls_stop_for_the_hold_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dev");
        std::fs::write(&path, b"").unwrap();
        let m = WakeMetrics::default();
        let w = WakeHold::open(&path, 0, Duration::from_millis(40), m.clone()).unwrap();
        assert!(!w.held());
        assert!(
            written(&path).is_empty(),
            "nothing is requested before a call"
        );
        w.tick();
        assert!(
            written(&path).is_empty(),
            "a tick while not held writes nothing"
        );
        // calls within the hold time: one write
        for _ in 0..5 {
            w.note_call();
            w.tick();
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(w.held());
        assert_eq!(written(&path), vec![0]);
        assert_eq!(m.held.get(), 1);
        // quiet for longer than the hold time: dropped
        std::thread::sleep(Duration::from_millis(50));
        w.tick();
        assert!(!w.held());
        assert_eq!(written(&path), vec![0, NO_CONSTRAINT_US]);
        assert_eq!(m.held.get(), 0);
        assert!(m.held_seconds.get() >= 0.05, "{}", m.held_seconds.get());
        // the next call holds it again
        w.note_call();
        assert_eq!(written(&path), vec![0, NO_CONSTRAINT_US, 0]);
        assert_eq!(m.holds.get(), 2);
    }

    #[test]
    fn a_device_that_cannot_be_opened_is_a_clear_error() {
        let e = WakeHold::open(
            Path::new("/nonexistent/cpu_dma_latency"),
            0,
            Duration::from_millis(100),
            WakeMetrics::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("--cpu-wake-latency-us") && e.contains("udev"),
            "{e}"
        );
    }

    #[test]
    fn calls_racing_the_release_never_leave_a_recent_call_unheld() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dev");
        std::fs::write(&path, b"").unwrap();
        let hold_ms = 5;
        let w = std::sync::Arc::new(
            WakeHold::open(
                &path,
                3,
                Duration::from_millis(hold_ms),
                WakeMetrics::default(),
            )
            .unwrap(),
        );
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let t = {
            let (w, stop) = (w.clone(), stop.clone());
            std::thread::spawn(move || {
                // bounded: the caller stops it within a second or so
                for _ in 0..100_000_000u64 {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    w.tick();
                }
            })
        };
        for i in 0..20_000 {
            w.note_call();
            let at = w.last_call_ms.load(Ordering::SeqCst);
            // Just after a call the request is held, unless the hold time has passed since
            // (less a millisecond: the two threads' clocks may sit either side of a tick).
            assert!(w.held() || w.now_ms() + 1 >= at + hold_ms, "released early");
            if i % 2_000 == 0 {
                // quiet spells, each until the request is dropped, so that releases race the
                // calls that follow them
                let until = Instant::now() + Duration::from_secs(5);
                while w.held() && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(1));
                }
                assert!(!w.held(), "not dropped within 5 s of quiet");
            }
        }
        stop.store(true, Ordering::Relaxed);
        t.join().unwrap();
        // writes alternate set, drop, set..., and the quiet spells did release it
        let s = written(&path);
        assert!(s.len() >= 20, "{} writes", s.len());
        for (i, v) in s.iter().enumerate() {
            assert_eq!(*v, if i % 2 == 0 { 3 } else { NO_CONSTRAINT_US });
        }
    }
}
