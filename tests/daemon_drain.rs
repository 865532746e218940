//! Graceful drain of the real daemon: not ready at once, new sessions and allocations refused,
//! in-flight work finishes, what remains at the deadline is aborted, exit code 0.

mod support;

use std::time::{Duration, Instant};

use kvd::Error;
use kvd::store::BlockClass;
use support::*;

#[test]
fn drain_lets_in_flight_work_finish_refuses_new_sessions_and_exits_0() {
    let mut d = Daemon::start(&[
        "--drain-deadline-ms",
        "30000",
        "--hard-deadline-ms",
        "50000",
    ]);
    let mut w = d.client("writer", 60_000);
    let mut r = d.client("reader", 60_000);
    let ns = w.register_namespace(&namespace()).unwrap();
    let k = keys(ns, 1, 3);
    // A published block the reader pins, and two blocks the writer is in the middle of.
    put_one(&mut w, k[0], &[1u8; 64]);
    let pinned = r.acquire(&k[..1], None).unwrap().remove(0).unwrap();
    let inflight: Vec<_> = w
        .alloc(&k[1..], BlockClass::Cache, None)
        .unwrap()
        .into_iter()
        .map(|x| x.unwrap())
        .collect();

    let t0 = Instant::now();
    assert_eq!(d.post("/drain").0, 202);
    assert_eq!(d.get("/readyz"), (503, "draining\n".into()));
    assert!(d.status().draining);
    // New sessions are refused with a clear, non-retryable-here error.
    let e = kvd::client::Client::connect(&d.socket, &options("late", 10_000)).unwrap_err();
    assert!(matches!(e, Error::Unavailable(_)), "{e}");
    // New allocations too.
    let e = w
        .alloc(&keys(ns, 2, 1), BlockClass::Cache, None)
        .unwrap_err();
    assert!(matches!(e, Error::Unavailable(_)), "{e}");
    // The work in flight finishes.
    let seals = support::write_all(&mut w, &inflight, |i| pattern(4096, i as u8));
    assert!(w.seal(&seals).unwrap().iter().all(|r| r.is_ok()));
    w.publish(&seals.iter().map(|s| s.handle).collect::<Vec<_>>())
        .unwrap();
    let mut got = vec![0u8; 64];
    r.read(&pinned.handle, 0, &mut got).unwrap();
    assert_eq!(got, vec![1u8; 64]);
    // Still draining, not exited: a pin is held.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(d.get("/readyz").0, 503);
    r.release(&[pinned.handle]).unwrap().remove(0).unwrap();
    let status = d
        .wait_exit(Duration::from_secs(25))
        .expect("the daemon exits once in-flight work is done");
    assert!(status.success(), "{status:?}\n{}", d.log());
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "exited before its drain deadline"
    );
    assert!(!d.socket.exists(), "the socket file is removed");
}

#[test]
fn sigterm_aborts_what_remains_at_the_drain_deadline_and_exits_0() {
    let mut d = Daemon::start(&["--drain-deadline-ms", "1500", "--hard-deadline-ms", "20000"]);
    let mut w = d.client("stuck-writer", 60_000);
    let ns = w.register_namespace(&namespace()).unwrap();
    w.alloc(&keys(ns, 3, 2), BlockClass::Cache, None).unwrap();
    let t0 = Instant::now();
    d.sigterm();
    let status = d
        .wait_exit(Duration::from_secs(20))
        .expect("the daemon exits by its hard deadline");
    let took = t0.elapsed();
    assert!(status.success(), "{status:?}\n{}", d.log());
    assert!(
        took >= Duration::from_millis(1400),
        "it waited for the drain deadline: {took:?}"
    );
    let log = d.log();
    assert!(log.contains("drain deadline reached"), "{log}");
    assert!(
        log.contains("blocks_aborted=2") || log.contains("blocks_aborted: 2"),
        "{log}"
    );
    // The stuck writer's connection was closed by the daemon.
    assert!(w.heartbeat().is_err());
}

#[test]
fn an_idle_daemon_drains_at_once_on_sigterm() {
    let mut d = Daemon::start(&[]);
    let _idle = d.client("idle", 60_000);
    let t0 = Instant::now();
    d.sigterm();
    let status = d.wait_exit(Duration::from_secs(20)).expect("exits");
    assert!(status.success(), "{status:?}; log:\n{}", d.log());
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
}
