//! Session lifetime, restart and observation through the real daemon: a dead client leaves
//! nothing behind, a silent one loses its work at its lease, a restart makes old handles stale,
//! and the admin endpoints tell the truth.

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use kvd::Error;
use kvd::protocol::SealItem;
use kvd::store::BlockClass;
use support::*;

/// The lease the doomed writer holds.
const HELPER_LEASE_MS: u64 = 2_000;

/// Run by `kill_9_of_a_writer_leaves_no_orphan_block_after_its_lease` as a child process: open a
/// session, allocate three blocks, write half of one, say so, and hang.
#[test]
#[ignore = "a helper process, started by another test"]
fn helper_writer_that_hangs_mid_write() {
    let Ok(socket) = std::env::var("KVD_TEST_SOCKET") else {
        return;
    };
    let mut c = kvd::client::Client::connect(&socket, &options("doomed-writer", HELPER_LEASE_MS))
        .expect("connect");
    let ns = c.register_namespace(&namespace()).unwrap();
    let k = keys(ns, 99, 3);
    let allocs = c.alloc(&k, BlockClass::Cache, None).unwrap();
    let h = allocs[0].as_ref().unwrap().handle;
    c.write(&h, 0, &pattern(50_000, 1)).unwrap();
    println!("WRITING 3");
    std::thread::sleep(Duration::from_secs(600));
}

#[test]
fn kill_9_of_a_writer_leaves_no_orphan_block_after_its_lease() {
    let d = Daemon::start(&[]);
    // A survivor with a block of its own in WRITING, which must not be disturbed.
    let mut survivor = d.client("survivor", 30_000);
    let ns = survivor.register_namespace(&namespace()).unwrap();
    let mine = survivor
        .alloc(&keys(ns, 7, 1), BlockClass::Cache, None)
        .unwrap()
        .remove(0)
        .unwrap();
    survivor.write(&mine.handle, 0, &pattern(1000, 3)).unwrap();

    let mut helper = Helper::start(&d, "helper_writer_that_hangs_mid_write");
    helper.wait_for("WRITING", Duration::from_secs(30));
    let st = d.status();
    assert_eq!(st.stats.sessions, 2);
    assert_eq!(
        st.stats.accounting.writing, 4,
        "three of the helper's, one of ours"
    );

    helper.kill9();
    let killed_at = Instant::now();
    wait_until(
        Duration::from_millis(HELPER_LEASE_MS) + Duration::from_secs(30),
        "the killed writer's blocks are gone",
        || {
            let s = d.status().stats;
            s.sessions == 1 && s.accounting.writing == 1 && s.accounting.allocated == 0
        },
    );
    eprintln!("cleaned up {:?} after kill -9", killed_at.elapsed());
    let st = d.status();
    assert!(st.stats.accounting.balanced());
    assert_eq!(st.stats.pins, 0);
    let metrics = d.get("/metrics").1;
    assert!(
        metrics.contains("kvd_blocks{state=\"writing\"} 1"),
        "{metrics}"
    );
    // The survivor finishes its block as if nothing happened.
    survivor
        .write(&mine.handle, 1000, &pattern(1000, 4))
        .unwrap();
    survivor
        .seal(&[SealItem {
            handle: mine.handle,
            len: 2000,
            checksum: None,
        }])
        .unwrap()
        .remove(0)
        .unwrap();
    survivor.publish(&[mine.handle]).unwrap();
}

#[test]
fn a_silent_client_loses_its_blocks_and_pins_when_its_lease_expires() {
    let d = Daemon::start(&[]);
    let mut w = d.client("publisher", 30_000);
    let ns = w.register_namespace(&namespace()).unwrap();
    let k = keys(ns, 8, 2);
    put_one(&mut w, k[0], &[1u8; 100]);

    let mut silent = d.client("silent", 600);
    silent
        .acquire(&k[..1], Some(60_000))
        .unwrap()
        .remove(0)
        .unwrap();
    silent
        .alloc(&k[1..], BlockClass::Cache, None)
        .unwrap()
        .remove(0)
        .unwrap();
    assert_eq!(d.status().stats.pins, 1);
    wait_until(
        Duration::from_secs(30),
        "the silent session's lease expires",
        || {
            let s = d.status().stats;
            s.pins == 0 && s.accounting.writing == 0 && s.sessions == 1
        },
    );
    // Its next call learns why.
    let e = silent.heartbeat().unwrap_err();
    assert!(
        matches!(
            e,
            Error::LeaseExpired(_) | Error::NotFound(_) | Error::Io(_)
        ),
        "{e}"
    );
    // ...and the daemon closes the connection of a session that no longer exists.
    let e = silent.heartbeat().unwrap_err();
    assert!(matches!(e, Error::Disconnected(_)), "{e}");
    wait_until(
        Duration::from_secs(10),
        "the connection is released",
        || d.status().daemon.sessions_open == 1,
    );
    // The published block was never the silent client's to lose.
    assert_eq!(w.exists(&k).unwrap(), vec![true, false]);
}

#[test]
fn heartbeats_keep_a_session_alive_past_its_lease() {
    let d = Daemon::start(&[]);
    let mut c = d.client("beating", 800);
    let ns = c.register_namespace(&namespace()).unwrap();
    c.alloc(&keys(ns, 9, 1), BlockClass::Cache, None)
        .unwrap()
        .remove(0)
        .unwrap();
    let until = Instant::now() + Duration::from_millis(2_500);
    while Instant::now() < until {
        let left = c.heartbeat().unwrap();
        assert!(left <= 800);
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(d.status().stats.accounting.writing, 1);
}

#[test]
fn a_restarted_daemon_rejects_handles_of_the_previous_generation() {
    let dir = tempfile::tempdir().unwrap();
    let mut d1 = Daemon::start_in(dir.path(), &[]);
    let g1 = d1.generation;
    let mut c = d1.client("before", 10_000);
    let ns = c.register_namespace(&namespace()).unwrap();
    let k = keys(ns, 10, 1);
    let a = put_one(&mut c, k[0], &[3u8; 512]);
    let pinned = c.acquire(&k, None).unwrap().remove(0).unwrap();
    assert_eq!(pinned.handle.node_generation, g1);
    drop(c);
    assert!(d1.stop().success());
    drop(d1);

    let d2 = Daemon::start_in(dir.path(), &[]);
    assert_eq!(
        d2.generation,
        g1 + 1,
        "the generation increases at every start"
    );
    let mut c = d2.client("after", 10_000);
    assert_eq!(c.node_generation(), g1 + 1);
    let ns2 = c.register_namespace(&namespace()).unwrap();
    assert_eq!(ns2, ns);
    // The old handle names the same slot and slot generation a new block may now have: it
    // must still be refused, by its node generation.
    let b = c
        .alloc(&k, BlockClass::Cache, None)
        .unwrap()
        .remove(0)
        .unwrap();
    assert_eq!(b.handle.slot, a.handle.slot);
    for r in [
        c.release(&[pinned.handle]).unwrap().remove(0),
        c.seal(&[SealItem {
            handle: a.handle,
            len: 1,
            checksum: None,
        }])
        .unwrap()
        .remove(0)
        .map(|_| ()),
        c.abort(&[a.handle]).unwrap().remove(0),
    ] {
        let e = r.unwrap_err();
        assert!(
            matches!(e, Error::StaleGeneration { handle_node, current_node, .. }
                if handle_node == g1 && current_node == g1 + 1),
            "{e}"
        );
    }
    // The publish of a group with an old handle fails whole.
    let e = c.publish(&[a.handle]).unwrap_err();
    assert!(matches!(e, Error::StaleGeneration { .. }), "{e}");
    let m = d2.get("/metrics").1;
    let rejects: u64 = m
        .lines()
        .find_map(|l| l.strip_prefix("kvd_stale_generation_rejects_total "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(rejects >= 4, "{rejects}");
}

#[test]
fn the_admin_endpoints_report_health_readiness_metrics_and_status() {
    let d = Daemon::start(&[]);
    assert_eq!(d.get("/healthz"), (200, "ok\n".into()));
    assert_eq!(d.get("/readyz"), (200, "ready\n".into()));
    let mut c = d.client("observed", 10_000);
    let ns = c.register_namespace(&namespace()).unwrap();
    let k = keys(ns, 11, 4);
    c.alloc(&k, BlockClass::Cache, None).unwrap();
    c.exists(&k).unwrap();
    let (code, m) = d.get("/metrics");
    assert_eq!(code, 200);
    for needle in [
        "kvd_blocks{state=\"writing\"} 4",
        "kvd_bytes{state=\"writing\"} 1048576",
        "kvd_sessions 1",
        "kvd_pins 0",
        "kvd_lookups_total 4",
        "kvd_lookup_hit_ratio 0.0",
        "kvd_checksum_failures_total 0",
        "kvd_evictions_total 0",
        "kvd_overload_rejections_total 0",
        "kvd_op_duration_seconds_count{op=\"alloc\"} 1",
        "kvd_op_duration_seconds_bucket{le=\"+Inf\",op=\"exists\"} 1",
        "kvd_accounting_balanced 1",
    ] {
        assert!(m.contains(needle), "no {needle:?} in\n{m}");
    }
    let st = d.status();
    assert_eq!(st.node_generation, d.generation);
    assert!(st.ready && !st.draining);
    assert_eq!(st.sessions.len(), 1);
    assert_eq!(st.sessions[0].name, "observed");
    assert_eq!(st.sessions[0].blocks_in_flight, 4);
    // `kvd status` prints the summary.
    let out = Command::new(env!("CARGO_BIN_EXE_kvd"))
        .args([
            "status",
            "--admin",
            &d.admin.to_string(),
            "--sample-ms",
            "200",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("ready"), "{text}");
    assert!(text.contains("writing"), "{text}");
    assert!(text.contains("sessions: 1 open"), "{text}");
    // Mutating admin endpoints want POST.
    assert_eq!(d.get("/drain").0, 405);
    assert_eq!(d.get("/readyz").0, 200);
}

/// One sample's value from `/metrics` (the first line that names it exactly).
fn metric(d: &Daemon, name: &str) -> f64 {
    let (code, body) = d.get("/metrics");
    assert_eq!(code, 200, "{body}");
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics:\n{body}"))
}

/// What the kernel's PM QoS device says the CPUs' wake-up latency target is now, µs (reading
/// it opens a request of "no constraint", which changes nothing).
fn cpu_wake_target() -> i32 {
    let mut b = [0u8; 4];
    std::io::Read::read_exact(
        &mut std::fs::File::open(kvd::daemon::wake::DEVICE).unwrap(),
        &mut b,
    )
    .unwrap();
    i32::from_ne_bytes(b)
}

/// `--cpu-wake-latency-us`: the first call sets the kernel's request (the device itself reads
/// it back), a quiet spell of the hold time drops it, the next call sets it again, and the
/// metrics say so. Where the device cannot be written (no root), the daemon refuses to start
/// and says what to do.
#[test]
fn the_cpu_wake_latency_request_is_held_while_clients_call_and_dropped_once_they_stop() {
    // a hold long enough that the checks after the burst land inside it on a loaded machine
    let flags = ["--cpu-wake-latency-us", "0", "--cpu-wake-hold-ms", "1000"];
    let writable = std::fs::OpenOptions::new()
        .write(true)
        .open(kvd::daemon::wake::DEVICE)
        .is_ok();
    if !writable {
        let dir = tempfile::tempdir().unwrap();
        let out = command(dir.path(), &flags).output().unwrap();
        assert!(!out.status.success(), "started without the device");
        let log = std::fs::read_to_string(dir.path().join("daemon.log")).unwrap();
        assert!(
            log.contains("cpu_dma_latency") && log.contains("udev"),
            "{log}"
        );
        return;
    }
    let before = cpu_wake_target();
    let d = Daemon::start(&flags);
    assert_eq!(
        metric(&d, "kvd_cpu_wake_held"),
        0.0,
        "nothing held before a call"
    );
    assert_eq!(cpu_wake_target(), before);
    let mut c = d.client("caller", 30_000);
    for _ in 0..20 {
        c.heartbeat().unwrap();
    }
    assert_eq!(metric(&d, "kvd_cpu_wake_held"), 1.0);
    assert_eq!(
        metric(&d, "kvd_cpu_wake_holds_total"),
        1.0,
        "one hold for the burst"
    );
    assert_eq!(cpu_wake_target(), 0, "the kernel holds the request");
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(&d, "kvd_cpu_wake_held") != 0.0 {
        assert!(
            Instant::now() < deadline,
            "still held 10 s after the last call"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(cpu_wake_target(), before, "dropped in the kernel too");
    assert!(metric(&d, "kvd_cpu_wake_held_seconds_total") >= 1.0);
    c.heartbeat().unwrap();
    assert_eq!(metric(&d, "kvd_cpu_wake_holds_total"), 2.0);
    assert_eq!(cpu_wake_target(), 0);
    drop(c);
}
