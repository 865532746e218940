//! The daemon and its client against a hostile or buggy process on the node: promises that held
//! in the happy path and broke under adversarial testing, each pinned by a test against the real
//! binary.
//!
//! - a compare-and-delete remembered from an earlier incarnation never removes a newer block;
//! - reservations are their session's alone;
//! - a client whose connection failed (a stopped daemon, a dead one) says "reconnect", never
//!   reads an answer meant for another request, and never trusts a dead daemon's pool;
//! - one process holding every connection it may cannot lock another out;
//! - a reader's checksum failure is checked by the daemon, and the error says what it found.

mod support;

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use kvd::Error;
use kvd::error::Corruption;
use kvd::protocol::{HelloReply, WireError, frame};
use kvd::store::{BlockClass, BlockVersion};
use support::*;

#[test]
fn a_compare_and_delete_remembered_from_before_a_restart_never_removes_the_new_block() {
    let dir = tempfile::tempdir().unwrap();
    let mut d1 = Daemon::start_in(dir.path(), &[]);
    let mut c = d1.client("deleter", 10_000);
    let ns = c.register_namespace(&namespace()).unwrap();
    let k = keys(ns, 1, 1)[0];
    let old = put_one(&mut c, k, &pattern(4096, 1)).handle.version();
    drop(c);
    assert!(d1.stop().success());

    let d2 = Daemon::start_in(dir.path(), &[]);
    assert!(d2.generation > d1.generation);
    let mut c = d2.client("writer", 10_000);
    let ns = c.register_namespace(&namespace()).unwrap();
    let new = put_one(&mut c, k, &pattern(4096, 2)).handle.version();
    assert_eq!(
        new.generation, old.generation,
        "block generations restart with each incarnation: only the node generation tells the \
         two versions apart"
    );
    // The delete remembered from incarnation 1 arrives late.
    let r = c.remove_if(&[(k, old)]).unwrap().remove(0);
    assert!(
        matches!(
            r,
            Err(Error::StaleGeneration { handle_node, current_node, .. })
                if handle_node == old.node_generation && current_node == new.node_generation
        ),
        "{r:?}"
    );
    assert_eq!(
        c.exists(&[k]).unwrap(),
        vec![true],
        "the new block survives"
    );
    // A version of this incarnation with the right generation is still removable.
    c.remove_if(&[(k, new)]).unwrap().remove(0).unwrap();
    assert_eq!(c.exists(&[k]).unwrap(), vec![false]);
    let forged = BlockVersion {
        node_generation: new.node_generation + 1,
        ..new
    };
    let _ = put_one(&mut c, k, &pattern(4096, 3));
    assert!(matches!(
        c.remove_if(&[(k, forged)]).unwrap().remove(0),
        Err(Error::StaleGeneration { .. })
    ));
    let _ = ns;
}

#[test]
fn a_reservation_is_its_sessions_alone() {
    let d = Daemon::start(&[]);
    let mut a = d.client("owner", 10_000);
    let mut b = d.client("other", 10_000);
    let ns = b.register_namespace(&namespace()).unwrap();
    let page = a.page_size();
    let r = a.reserve(4 * page).unwrap();
    let reserved = d.status().stats.reserved_unused_pages;
    assert_eq!(reserved, 4);
    // Another session can neither free nor draw from it.
    let e = b.release_reservation(r).unwrap_err();
    assert!(matches!(e, Error::NotFound(_)), "{e}");
    let e = b
        .alloc(&keys(ns, 2, 1), BlockClass::Cache, Some(r))
        .unwrap_err();
    assert!(matches!(e, Error::NotFound(_)), "{e}");
    assert_eq!(d.status().stats.reserved_unused_pages, reserved);
    // Its owner can.
    a.release_reservation(r).unwrap();
    assert_eq!(d.status().stats.reserved_unused_pages, 0);
}

#[test]
fn a_client_whose_call_timed_out_says_reconnect_and_never_reads_another_answer() {
    let d = Daemon::start(&[]);
    let mut opts = options("impatient", 30_000);
    opts.io_timeout_ms = 1_000;
    let mut c = kvd::client::Client::connect(&d.socket, &opts).unwrap();
    let ns = c.register_namespace(&namespace()).unwrap();
    let k = keys(ns, 3, 4);
    let data = pattern(8192, 3);
    let a = put_one(&mut c, k[0], &data);
    let b = c.acquire(&k[..1], None).unwrap().remove(0).unwrap();

    signal(d.pid(), rustix::process::Signal::STOP);
    // The stop takes effect asynchronously; wait until the kernel reports it.
    wait_stopped(d.pid());
    let t0 = Instant::now();
    let e = c.heartbeat().unwrap_err();
    let reported = t0.elapsed();
    signal(d.pid(), rustix::process::Signal::CONT);
    assert!(matches!(e, Error::Disconnected(_)), "{e}");
    assert!(e.is_retryable());
    eprintln!("a call to a stopped daemon reported Disconnected after {reported:?}");

    // The late answer to the heartbeat is never matched to a later call: every call and every
    // read of the mapping now fails fast, without touching the socket.
    for _ in 0..3 {
        let e = c.exists(&k).unwrap_err();
        assert!(matches!(e, Error::Disconnected(_)), "{e}");
    }
    let mut buf = vec![0u8; data.len()];
    assert!(matches!(
        c.read(&b.handle, 0, &mut buf),
        Err(Error::Disconnected(_))
    ));
    assert!(matches!(c.block(&b.handle), Err(Error::Disconnected(_))));
    assert!(c.broken().is_some());

    // The daemon released the broken session (the client shut its socket down).
    wait_until(
        Duration::from_secs(20),
        "the old session is released",
        || d.status().stats.sessions == 0,
    );
    c.reconnect().unwrap();
    assert!(c.broken().is_none());
    c.register_namespace(&namespace()).unwrap();
    // The old handle is gone with the old session; the block itself is not.
    assert!(c.read(&a.handle, 0, &mut buf).is_err());
    assert_eq!(c.exists(&k).unwrap(), vec![true, false, false, false]);
    let got = c.acquire(&k[..1], None).unwrap().remove(0).unwrap();
    assert_eq!(
        c.read_verified(&got.handle, &mut buf).unwrap(),
        data.len() as u64
    );
    assert_eq!(buf, data);
    // Each answer matches its own request from here on.
    for i in 0..20 {
        assert_eq!(c.exists(&k[..(i % 4) + 1]).unwrap().len(), (i % 4) + 1);
        assert!(c.heartbeat().unwrap() > 0);
    }
}

#[test]
fn reads_of_a_dead_daemons_mapping_are_refused() {
    let d = Daemon::start(&[]);
    let mut c = d.client("survivor", 30_000);
    let ns = c.register_namespace(&namespace()).unwrap();
    let k = keys(ns, 4, 1);
    let data = pattern(4096, 4);
    put_one(&mut c, k[0], &data);
    let b = c.acquire(&k, None).unwrap().remove(0).unwrap();
    let mut buf = vec![0u8; data.len()];
    c.read_verified(&b.handle, &mut buf).unwrap();

    signal(d.pid(), rustix::process::Signal::KILL);
    let t0 = Instant::now();
    // The kernel closes the dead daemon's end of the socket; the next touch of the mapping
    // sees it (bounded wait: the process may take a moment to be reaped).
    let mut e = None;
    while t0.elapsed() < Duration::from_secs(20) {
        match c.read_verified(&b.handle, &mut buf) {
            Ok(_) => std::thread::sleep(Duration::from_millis(5)),
            Err(err) => {
                e = Some(err);
                break;
            }
        }
    }
    let e = e.expect("a read of a dead daemon's pool was still served after 20 s");
    eprintln!("reads refused {:?} after kill -9", t0.elapsed());
    assert!(matches!(e, Error::Disconnected(_)), "{e}");
    assert!(matches!(c.block(&b.handle), Err(Error::Disconnected(_))));
    assert!(matches!(
        c.read(&b.handle, 0, &mut buf),
        Err(Error::Disconnected(_))
    ));
    assert!(matches!(c.heartbeat(), Err(Error::Disconnected(_))));
}

/// The hog's bounds in `one_process_holding_every_connection_it_may_cannot_lock_out_another`.
const HOG_FLAGS: [&str; 8] = [
    "--max-sessions",
    "64",
    "--max-sessions-per-process",
    "16",
    "--max-pending-connections",
    "16",
    "--max-pending-per-process",
    "4",
];

/// How a refused connection ended, as the hog saw it: the daemon's framed answer, decoded.
fn refusal(mut s: UnixStream) -> String {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut buf = Vec::new();
    let _ = (&mut s).take(1 << 16).read_to_end(&mut buf);
    match frame::decode_frame::<HelloReply>(&buf) {
        Ok(HelloReply::Refused(WireError::Overloaded {
            what,
            retry_after_ms,
        })) => {
            format!("overloaded retry_after_ms={retry_after_ms} what={what:?}")
        }
        other => format!("unexpected {other:?} ({} bytes)", buf.len()),
    }
}

/// Whether the daemon has said something (or closed) on `s`, without waiting.
fn has_answer(s: &UnixStream) -> bool {
    use rustix::net::RecvFlags;
    let mut probe = [0u8; 1];
    rustix::net::recv(s, &mut probe, RecvFlags::PEEK | RecvFlags::DONTWAIT).is_ok()
}

/// Run by `one_process_holding_every_connection_it_may_cannot_lock_out_another` as a child:
/// open sessions with 600 s leases until refused, then connections that never say hello until
/// refused; report, and keep re-opening the handshakes the daemon cuts, for at most 60 s.
#[test]
#[ignore = "a helper process, started by another test"]
fn helper_hog_that_holds_every_connection_it_can() {
    let Ok(socket) = std::env::var("KVD_TEST_SOCKET") else {
        return;
    };
    let mut sessions = Vec::new();
    let session_refusal = loop {
        assert!(sessions.len() < 1_000, "no session bound at 1,000");
        match kvd::client::Client::connect(&socket, &options("hog", 600_000)) {
            Ok(c) => sessions.push(c),
            Err(e) => break format!("{e}"),
        }
    };
    let mut pending = Vec::new();
    let pending_refusal = loop {
        assert!(pending.len() < 1_000, "no handshake bound at 1,000");
        let s = UnixStream::connect(&socket).unwrap();
        s.set_nonblocking(true).unwrap();
        // A refused connection has its answer waiting (bounded wait for it to arrive).
        std::thread::sleep(Duration::from_millis(50));
        if has_answer(&s) {
            s.set_nonblocking(false).unwrap();
            break refusal(s);
        }
        pending.push(s);
    };
    println!(
        "HOLDING sessions={} pending={} session_refusal={session_refusal:?} \
         pending_refusal={pending_refusal:?}",
        sessions.len(),
        pending.len()
    );
    // Keep the handshakes topped up as the daemon's deadline cuts them.
    let until = Instant::now() + Duration::from_secs(60);
    while Instant::now() < until {
        pending.retain(|s| !has_answer(s));
        while pending.len() < 16 {
            let Ok(s) = UnixStream::connect(&socket) else {
                break;
            };
            s.set_nonblocking(true).unwrap();
            pending.push(s);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn one_process_holding_every_connection_it_may_cannot_lock_out_another() {
    let d = Daemon::start(&HOG_FLAGS);
    let mut hog = Helper::start(&d, "helper_hog_that_holds_every_connection_it_can");
    let line = hog.wait_for("HOLDING", Duration::from_secs(60));
    eprintln!("{line}");
    let field = |k: &str| -> u32 {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {k} in {line}"))
    };
    // It got exactly its shares, and each refusal was a framed, retryable Overloaded.
    assert_eq!(field("sessions="), 16, "{line}");
    assert_eq!(field("pending="), 4, "{line}");
    assert!(
        line.contains("session_refusal=\"overloaded: process") && line.contains("retry after"),
        "{line}"
    );
    assert!(
        line.contains("pending_refusal=\"overloaded retry_after_ms="),
        "{line}"
    );

    // Another process (this one) still connects and works, while the hog holds on.
    let mut c = d.client("engine", 10_000);
    let ns = c.register_namespace(&namespace()).unwrap();
    let k = keys(ns, 5, 1);
    let data = pattern(65_536, 5);
    put_one(&mut c, k[0], &data);
    let b = c.acquire(&k, None).unwrap().remove(0).unwrap();
    let mut buf = vec![0u8; data.len()];
    c.read_verified(&b.handle, &mut buf).unwrap();
    assert_eq!(buf, data);

    // The hog's sessions are visible, with who holds them.
    let st = d.status();
    let hog_pid = hog.pid();
    let held: Vec<_> = st
        .sessions
        .iter()
        .filter(|s| s.peer.is_some_and(|p| p.pid == hog_pid))
        .collect();
    assert_eq!(held.len(), 16);
    assert!(held.iter().all(|s| s.name == "hog" && s.expires_at_ms > 0));
    assert!(
        st.sessions
            .iter()
            .any(|s| s.peer.is_some_and(|p| p.pid == std::process::id()))
    );
    hog.kill9();
    wait_until(Duration::from_secs(20), "the hog's sessions close", || {
        d.status().stats.sessions == 1
    });
}

#[test]
fn a_readers_checksum_failure_is_checked_by_the_daemon_and_the_error_says_what_it_found() {
    let d = Daemon::start(&[]);
    let mut c = d.client("reader", 10_000);
    let ns = c.register_namespace(&namespace()).unwrap();
    let k = keys(ns, 6, 1);
    let data = pattern(8192, 6);
    put_one(&mut c, k[0], &data);
    let b = c.acquire(&k, None).unwrap().remove(0).unwrap();
    scribble_on_the_pool(d.pid(), b.offset);
    let mut buf = vec![0u8; data.len()];
    let e = c.read_verified(&b.handle, &mut buf).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Corrupt {
                outcome: Corruption::Quarantined,
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string().contains("the daemon quarantined the block"),
        "{e}"
    );
    // What the message says is what happened: the daemon serves the block no more.
    assert_eq!(c.exists(&k).unwrap(), vec![false]);
    let st = d.status();
    assert_eq!(st.stats.counters.checksum_failures, 1);
    assert_eq!(st.stats.accounting.quarantined, 1);
    let (_, metrics) = d.get("/metrics");
    assert!(metrics.contains("kvd_corrupt_reports_total 1"), "{metrics}");
    assert!(metrics.contains("kvd_corrupt_reports_confirmed_total 1"));
    // The report is counted per block; an intact block reads fine beside it.
    let k2 = keys(ns, 7, 1);
    put_one(&mut c, k2[0], &data);
    let b2 = c.acquire(&k2, None).unwrap().remove(0).unwrap();
    assert_eq!(
        c.read_verified(&b2.handle, &mut buf).unwrap(),
        data.len() as u64
    );
}
