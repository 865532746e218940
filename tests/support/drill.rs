//! The fault drills' harness: what every drill checks besides its outcome (that nothing leaked,
//! on every node) and the one line each prints (fault, detection, recovery, leaks), also
//! appended as JSON to a results file so that `scripts/drills.sh` can tabulate several runs.

use std::io::Write;
use std::time::{Duration, Instant};

use super::Daemon;

/// What a node may still hold once a drill's faults are over: the sessions, pins and
/// manifests of clients and requests that are still live. Everything else must be gone.
#[derive(Debug, Clone, Copy, Default)]
pub struct Expect {
    /// Open sessions of live clients.
    pub sessions: u32,
    /// Pins of live clients.
    pub pins: u64,
    /// Manifests of requests not yet ended.
    pub manifests: u32,
}

/// What `d` holds beyond `e`, one line per finding (empty: no leak): pool accounting that does
/// not balance, pages neither free nor published (allocated, writing, sealed, retired), pins,
/// sessions or manifests beyond the live ones, transfers, ops or grants in flight.
pub fn leaks(d: &Daemon, e: Expect) -> Vec<String> {
    leaks_of(&d.status(), e)
}

/// [`leaks`] of a `/status` report already read.
pub fn leaks_of(s: &kvd::daemon::admin::StatusReport, e: Expect) -> Vec<String> {
    let a = &s.stats.accounting;
    let mut v = Vec::new();
    let node = s.data_port.as_ref().map_or(0, |p| p.node_id);
    if !a.balanced() {
        v.push(format!(
            "node {node}: the pool's accounting does not balance: {a:?}"
        ));
    }
    for (what, n) in [
        ("allocated", a.allocated),
        ("writing", a.writing),
        ("sealed", a.sealed),
        ("retired", a.retired),
    ] {
        if n > 0 {
            v.push(format!("node {node}: {n} {what} pages"));
        }
    }
    if s.stats.pins != e.pins {
        v.push(format!(
            "node {node}: {} pins (expected {})",
            s.stats.pins, e.pins
        ));
    }
    if s.stats.sessions != e.sessions {
        v.push(format!(
            "node {node}: {} sessions (expected {})",
            s.stats.sessions, e.sessions
        ));
    }
    if s.stats.manifests != e.manifests {
        v.push(format!(
            "node {node}: {} manifests (expected {})",
            s.stats.manifests, e.manifests
        ));
    }
    if let Some(p) = &s.data_port {
        for (what, n) in [
            ("ops in flight", p.ops_in_flight),
            ("bytes in flight", p.bytes_in_flight),
            ("live grants", p.live_grants),
            ("transfers started here in flight", p.pushes_in_flight),
            ("peers' transfers in flight here", p.incoming_in_flight),
        ] {
            if n > 0 {
                v.push(format!("node {node}: {n} {what}"));
            }
        }
    }
    v
}

/// Wait (at most `timeout`) until none of `nodes` leaks beyond its expectation; what is left
/// then, over all of them.
pub fn settle(nodes: &[(&Daemon, Expect)], timeout: Duration) -> Vec<String> {
    settle_with(timeout, || {
        nodes.iter().flat_map(|(d, e)| leaks(d, *e)).collect()
    })
}

/// Call `find` until it finds nothing or `timeout` passes; what it found last.
pub fn settle_with(timeout: Duration, mut find: impl FnMut() -> Vec<String>) -> Vec<String> {
    let deadline = Instant::now() + timeout;
    loop {
        let found = find();
        if found.is_empty() || Instant::now() >= deadline {
            return found;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// One drill's result.
#[derive(Debug)]
pub struct Outcome<'a> {
    /// Its number in the list.
    pub drill: u32,
    /// The fault injected.
    pub fault: &'a str,
    /// From the fault to the moment it was noticed (by the views, the transfer, the reaper).
    pub detected: Option<Duration>,
    /// From the fault to the moment the cluster was whole again (the outcome checked).
    pub recovered: Option<Duration>,
    /// What leaked (must be empty).
    pub leaks: Vec<String>,
}

fn secs(d: Option<Duration>) -> String {
    d.map_or_else(|| "-".to_string(), |d| format!("{:.2} s", d.as_secs_f64()))
}

/// Print the drill's line, append it to the results file, and fail the test on any leak.
pub fn report(o: Outcome<'_>) {
    println!(
        "DRILL {:>2} | {} | detected {} | recovered {} | leaks {}",
        o.drill,
        o.fault,
        secs(o.detected),
        secs(o.recovered),
        o.leaks.len()
    );
    let path = std::env::var("KVD_DRILL_RESULTS")
        .unwrap_or_else(|_| format!("{}/drills.jsonl", env!("CARGO_TARGET_TMPDIR")));
    let line = serde_json::json!({
        "drill": o.drill,
        "fault": o.fault,
        "detected_s": o.detected.map(|d| d.as_secs_f64()),
        "recovered_s": o.recovered.map(|d| d.as_secs_f64()),
        "leaks": o.leaks.len(),
    });
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
    {
        let _ = writeln!(f, "{line}");
    }
    assert!(
        o.leaks.is_empty(),
        "drill {} leaked: {:#?}",
        o.drill,
        o.leaks
    );
}
