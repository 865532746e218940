//! Cluster mode on a real etcd with three real daemons: registration, the membership view,
//! detection of a dead node, a restart coming back with a higher generation, the data port's
//! peer table fed by the view (with each node's key), a paused etcd, and a node's key revoked
//! with `kvd key revoke`.

mod support;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvd::daemon::transfer::wire::{Binding, Offered, PeerReply, PeerRequest};
use kvd::protocol::{TransferState, WireError};
use support::cluster::{Control, node_dirs, secret_file, view, wait_views};
use support::{Daemon, Etcd};
use transport::auth::ClusterSecret;
use transport::link::PeerAddr;
use transport::link::identity::NodeKey;
use transport::link::members::{Member, Members};
use transport::tcp::{TcpConfig, TcpTransport};

const TTL_MS: u64 = 2_000;

fn node(dir: &Path, secret: &Path, etcd: &Etcd, id: u64) -> Daemon {
    support::cluster::node(dir, secret, etcd, id, TTL_MS, &[])
}

/// Node `n`'s key, as its daemon made it in its data directory `dir` at its first start.
fn key_in(dir: &Path) -> NodeKey {
    NodeKey::from_file(&dir.join("node.key")).unwrap()
}

/// Offer one block to `d` as node `id` with `key`, in incarnation `generation` (an engine of
/// the test's own, with the cluster secret); the answer, or why the connection was refused.
fn raw_offer(
    secret: &Path,
    d: &Daemon,
    id: u64,
    key: NodeKey,
    generation: u64,
) -> transport::Result<PeerReply> {
    raw_offer_to(secret, d, id, key, generation, None)
}

/// As [`raw_offer`], bound to destination generation `to` (default: the one `d` introduces
/// itself with).
fn raw_offer_to(
    secret: &Path,
    d: &Daemon,
    id: u64,
    key: NodeKey,
    generation: u64,
    to: Option<u64>,
) -> transport::Result<PeerReply> {
    let s = ClusterSecret::from_file(secret).unwrap();
    let dp = d.status().data_port.unwrap();
    let mut c = TcpConfig::new(
        id,
        generation,
        "127.0.0.1:0".parse().unwrap(),
        s,
        Arc::new(key),
    );
    c.members = Members::of([(
        dp.node_id,
        Member {
            key: dp.node_key.parse().unwrap(),
            addr: None,
        },
    )]);
    let e = TcpTransport::start(c).unwrap();
    let (mut s, bind) = e.open_control(&PeerAddr {
        addr: dp.listen.parse().unwrap(),
        node_id: dp.node_id,
    })?;
    let desc = support::namespace();
    let key = support::keys(desc.id(), 1, 1)[0];
    let offer = PeerRequest::Offer {
        binding: Binding {
            request: 0,
            namespace: key.namespace,
            source_node: id,
            source_generation: generation,
            destination_node: dp.node_id,
            destination_generation: to.unwrap_or(bind.node_generation),
            epoch: 1,
        },
        namespace: Box::new(desc),
        blocks: vec![Offered {
            key,
            len: 4096,
            checksum: 0,
        }],
        checkpoint: None,
    };
    Ok(kvd::daemon::transfer::wire::ask(&mut s, &offer).unwrap())
}

#[test]
fn a_killed_node_leaves_every_view_within_the_ttl_and_comes_back_with_a_higher_generation() {
    let etcd = Etcd::start();
    let tmp = tempfile::tempdir().unwrap();
    let secret = secret_file(tmp.path());
    let dirs = node_dirs(tmp.path(), 3);
    let a = node(&dirs[0], &secret, &etcd, 1);
    let b = node(&dirs[1], &secret, &etcd, 2);
    let mut c = node(&dirs[2], &secret, &etcd, 3);
    let all = vec![(1, a.generation), (2, b.generation), (3, c.generation)];
    wait_views(
        &[&a, &b, &c],
        &all,
        Duration::from_secs(20),
        "every node sees all three",
    );
    // the data port's peers come from the view (no --peer was given)
    let peers = a.status().data_port.unwrap().peers;
    assert_eq!(peers.keys().copied().collect::<Vec<_>>(), vec![2, 3]);
    assert_eq!(a.get("/readyz").0, 200);

    // kill -9 node 3: gone from the others' views within the TTL plus a margin
    let killed = Instant::now();
    support::signal(c.pid(), rustix::process::Signal::KILL);
    let _ = c.wait_exit(Duration::from_secs(10));
    let two = vec![(1, a.generation), (2, b.generation)];
    wait_views(
        &[&a, &b],
        &two,
        Duration::from_millis(TTL_MS + 8_000),
        "node 3 leaves the views",
    );
    let detected = killed.elapsed();
    println!("kill -9: node 3 left every view {detected:?} after the kill (lease TTL {TTL_MS} ms)");
    assert!(detected < Duration::from_millis(TTL_MS + 8_000));
    assert!(!a.status().data_port.unwrap().peers.contains_key(&3));

    // restart it on its data dir: a higher generation, back in every view
    let c2 = node(&dirs[2], &secret, &etcd, 3);
    assert!(c2.generation > c.generation);
    let back = vec![(1, a.generation), (2, b.generation), (3, c2.generation)];
    let t = wait_views(
        &[&a, &b, &c2],
        &back,
        Duration::from_secs(20),
        "node 3 is back",
    );
    println!(
        "restart: node 3 back in every view with generation {} after {t:?}",
        c2.generation
    );

    // fencing: node 3's old incarnation cannot start a transfer, even holding the cluster
    // secret and node 3's key
    let r = raw_offer(&secret, &a, 3, key_in(&dirs[2]), c.generation).unwrap();
    assert!(
        matches!(r, PeerReply::Refused(WireError::StaleGeneration { .. })),
        "node 3 generation {}: {r:?}",
        c.generation
    );
    assert_eq!(a.status().data_port.unwrap().transfers.fenced, 1);
    // and an unregistered node is not even let in: no key is registered for it
    let (stranger, _) = NodeKey::generate().unwrap();
    let e = raw_offer(&secret, &a, 9, stranger, 1).unwrap_err();
    assert!(e.to_string().contains("has no key for node 9"), "{e}");

    // and the view's address works: node 1 pushes to node 3 with no --peer
    assert_eq!(push_fresh(&a, 5, 3).state, TransferState::Done);
    drop(c);
}

#[test]
fn a_paused_etcd_makes_nodes_not_ready_past_the_ttl_and_they_register_again_when_it_resumes() {
    let etcd = Etcd::start();
    let tmp = tempfile::tempdir().unwrap();
    let secret = secret_file(tmp.path());
    let dirs = node_dirs(tmp.path(), 2);
    let a = node(&dirs[0], &secret, &etcd, 1);
    let b = node(&dirs[1], &secret, &etcd, 2);
    let all = vec![(1, a.generation), (2, b.generation)];
    wait_views(&[&a, &b], &all, Duration::from_secs(20), "both see both");

    // an engine's session from before the outage, with blocks to move
    let mut ca = a.client("engine", 30_000);
    let moving = support::put_blocks(&mut ca, 42, 16, 256 << 10);
    let ns0 = moving[0].namespace;
    let paused = Instant::now();
    support::signal(etcd.pid(), rustix::process::Signal::STOP);
    // a transfer between the nodes does not need etcd: one started while etcd is paused (and
    // the lease not yet run out) completes on the last view
    let id = ca.push(2, &moving).unwrap();
    let last = support::wait_transfer(&mut ca, id, Duration::from_secs(30));
    assert_eq!(
        last.state,
        TransferState::Done,
        "completed with etcd paused"
    );
    support::wait_until(
        Duration::from_millis(TTL_MS + 8_000),
        "both go not ready",
        || a.get("/readyz").0 == 503 && b.get("/readyz").0 == 503,
    );
    let not_ready = paused.elapsed();
    let (_, why) = a.get("/readyz");
    assert!(why.contains("no registration lease"), "{why}");
    println!(
        "etcd paused: both nodes not ready {not_ready:?} after the pause: {}",
        why.trim()
    );
    // no new sessions and no new work on existing ones meanwhile, with a reason
    let e = kvd::client::Client::connect(&a.socket, &support::options("late", 30_000)).unwrap_err();
    assert!(e.to_string().contains("registration lease"), "{e}");
    let ns = ca.register_namespace(&support::namespace()).unwrap();
    let e = ca
        .alloc(
            &support::keys(ns, 1, 1),
            kvd::store::BlockClass::Cache,
            None,
        )
        .unwrap_err();
    assert!(e.to_string().contains("registration lease"), "{e}");
    // the view is kept as it was
    assert_eq!(view(&a), all);

    let resumed = Instant::now();
    support::signal(etcd.pid(), rustix::process::Signal::CONT);
    support::wait_until(Duration::from_secs(30), "both ready again", || {
        a.get("/readyz").0 == 200 && b.get("/readyz").0 == 200
    });
    // both registered again, each under a new generation, and every view has both new ones
    let newer = |d: &Daemon, id: u64, old: u64| view(d).iter().any(|&(n, g)| n == id && g > old);
    support::wait_until(
        Duration::from_secs(20),
        "views converge on the new generations",
        || {
            [&a, &b].iter().all(|d| {
                view(d).len() == 2 && newer(d, 1, a.generation) && newer(d, 2, b.generation)
            })
        },
    );
    println!(
        "etcd resumed: both ready again and views converged on new generations {:?} after \
         the resume: {:?}",
        resumed.elapsed(),
        view(&a)
    );
    assert!(
        a.status().cluster.unwrap().registrations >= 2,
        "registered again"
    );
    // a push between the re-registered nodes works at once (no connection of the old
    // generations is reused)
    let after = support::keys(ns0, 43, 1);
    support::put_one(&mut ca, after[0], &support::pattern(256 << 10, 9));
    let id = ca.push(2, &after).unwrap();
    let last = support::wait_transfer(&mut ca, id, Duration::from_secs(30));
    assert_eq!(last.state, TransferState::Done, "after the re-registration");
    // a transfer bound to a node's old generation is refused now
    let r = raw_offer_to(
        &secret,
        &a,
        2,
        key_in(&dirs[1]),
        b.generation,
        Some(a.generation),
    )
    .unwrap();
    assert!(
        matches!(r, PeerReply::Refused(WireError::StaleGeneration { .. })),
        "{r:?}"
    );
}

#[test]
fn kvd_control_turns_registrations_into_worker_events_and_resumes_from_its_snapshot_in_etcd() {
    let etcd = Etcd::start();
    let tmp = tempfile::tempdir().unwrap();
    let secret = secret_file(tmp.path());
    let dirs = node_dirs(tmp.path(), 3);
    let a = node(&dirs[0], &secret, &etcd, 1);
    let b = node(&dirs[1], &secret, &etcd, 2);
    let mut c = node(&dirs[2], &secret, &etcd, 3);
    let ctl = Control::start(&etcd);
    assert!(!ctl.resumed, "nothing to resume from yet");
    let full = |ids: &[u64]| -> Vec<(u64, String)> {
        ids.iter()
            .map(|&i| (i, "FullService".to_string()))
            .collect()
    };
    support::wait_until(
        Duration::from_secs(20),
        "the controller has the three workers",
        || ctl.workers() == full(&[1, 2, 3]),
    );

    // kill -9 node 3: its lease expires, the controller gets the failure
    let killed = Instant::now();
    support::signal(c.pid(), rustix::process::Signal::KILL);
    let _ = c.wait_exit(Duration::from_secs(10));
    support::wait_until(
        Duration::from_millis(TTL_MS + 8_000),
        "worker 3 failed",
        || ctl.workers().iter().any(|(i, p)| *i == 3 && p == "Failed"),
    );
    println!(
        "kvd control: worker 3 failed {:?} after kill -9 (TTL {TTL_MS} ms)",
        killed.elapsed()
    );

    // it restarts with a higher generation: a recovery (LoadingDraft)
    let c2 = node(&dirs[2], &secret, &etcd, 3);
    support::wait_until(Duration::from_secs(20), "worker 3 recovers", || {
        ctl.workers()
            .iter()
            .any(|(i, p)| *i == 3 && p == "LoadingDraft")
    });

    // a request admitted before the restart
    let admit = br#"{"request_id": 77, "serving": 1, "prompt_tokens": 100, "max_new_tokens": 10, "reserve_bytes": 0, "deadline_ms": null}"#;
    let (code, first) =
        kvd::daemon::status::http_with_body(ctl.addr, "POST", "/admit", admit).unwrap();
    assert_eq!(code, 200, "{first}");
    assert!(first.contains("\"epoch\":1"), "{first}");

    // restart kvd control: it resumes from its snapshot in etcd, workers and phases intact
    let before = ctl.workers();
    std::thread::sleep(Duration::from_millis(1_500)); // the snapshot is written once a second
    drop(ctl);
    let ctl = Control::start(&etcd);
    assert!(ctl.resumed, "resumed from the snapshot in etcd");
    support::wait_until(
        Duration::from_secs(10),
        "the same workers after the restart",
        || ctl.workers() == before,
    );
    // the request is still known at its epoch, and admitting it again gives back the same
    // admission (same epoch, same holder), not a second plan
    let (code, body) = kvd::daemon::status::http(ctl.addr, "GET", "/requests/77").unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("\"epoch\":1"), "{body}");
    let (code, again) =
        kvd::daemon::status::http_with_body(ctl.addr, "POST", "/admit", admit).unwrap();
    assert_eq!(
        (code, again),
        (200, first),
        "the same admission, not a second plan"
    );
    drop((a, b, c2));
}

/// A CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl in
/// `dir` (keys mode 0600).
fn make_certs(dir: &Path) {
    let run = |args: &[&str]| {
        let out = std::process::Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl (the test command installs it)");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=kvd-test-ca",
    ]);
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    std::fs::write(dir.join("client.ext"), "extendedKeyUsage=clientAuth\n").unwrap();
    for (name, cn) in [("server", "127.0.0.1"), ("client", "kvd-node")] {
        run(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
            "-subj",
            &format!("/CN={cn}"),
        ]);
        run(&[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &format!("{name}.pem"),
            "-days",
            "2",
            "-extfile",
            &format!("{name}.ext"),
        ]);
    }
    use std::os::unix::fs::PermissionsExt;
    for k in ["ca.key", "server.key", "client.key"] {
        std::fs::set_permissions(dir.join(k), std::fs::Permissions::from_mode(0o600)).unwrap();
    }
}

#[test]
fn over_tls_a_node_with_a_client_certificate_registers_and_one_without_cannot() {
    let tmp = tempfile::tempdir().unwrap();
    let certs = tmp.path().join("certs");
    std::fs::create_dir(&certs).unwrap();
    make_certs(&certs);
    let etcd = Etcd::start_tls(&certs);
    assert!(etcd.url.starts_with("https://"));
    let secret = secret_file(tmp.path());
    let path = |f: &str| certs.join(f).to_str().unwrap().to_string();
    let (s, ttl) = (secret.to_str().unwrap().to_string(), TTL_MS.to_string());
    let mut args = vec![
        "--cluster-secret-file",
        &s,
        "--data-listen",
        "127.0.0.1:0",
        "--etcd",
        &etcd.url,
        "--etcd-lease-ttl-ms",
        &ttl,
    ];
    let (ca, cert, key) = (path("ca.pem"), path("client.pem"), path("client.key"));
    let mut with_cert = args.clone();
    with_cert.extend([
        "--node-id",
        "1",
        "--etcd-ca-file",
        &ca,
        "--etcd-cert-file",
        &cert,
        "--etcd-key-file",
        &key,
    ]);
    let n1 = Daemon::start(&with_cert);
    support::wait_until(Duration::from_secs(20), "node 1 registers over TLS", || {
        view(&n1) == [(1, n1.generation)]
    });
    assert_eq!(n1.get("/readyz").0, 200);
    // the CA but no client certificate: etcd refuses it, so it never holds a lease
    args.extend(["--node-id", "2", "--etcd-ca-file", &ca]);
    let n2 = Daemon::start(&args);
    std::thread::sleep(Duration::from_millis(TTL_MS + 1_000));
    let (code, why) = n2.get("/readyz");
    assert_eq!(code, 503, "{why}");
    assert_eq!(view(&n1), [(1, n1.generation)], "node 2 never registered");
    // plain http endpoints with a CA are refused at start
    let e = support::command(
        tmp.path(),
        &[
            "--cluster-secret-file",
            &s,
            "--etcd",
            "http://127.0.0.1:1",
            "--etcd-ca-file",
            &ca,
        ],
    )
    .stdout(std::process::Stdio::null())
    .status()
    .unwrap();
    assert!(!e.success());
}

#[test]
fn a_brief_etcd_restart_within_the_ttl_causes_no_churn() {
    let mut etcd = Etcd::start();
    let tmp = tempfile::tempdir().unwrap();
    let secret = secret_file(tmp.path());
    let d = node_dirs(tmp.path(), 1).remove(0);
    // a long TTL, so that the restart surely fits in it
    let (s, url) = (secret.to_str().unwrap(), etcd.url.clone());
    let a = Daemon::start_in(
        &d,
        &[
            "--cluster-secret-file",
            s,
            "--data-listen",
            "127.0.0.1:0",
            "--node-id",
            "1",
            "--etcd",
            &url,
            "--etcd-lease-ttl-ms",
            "8000",
        ],
    );
    support::wait_until(Duration::from_secs(20), "registered", || {
        view(&a) == [(1, a.generation)]
    });
    let t = Instant::now();
    etcd.restart();
    let restarted = t.elapsed();
    // it registers again (a new lease) under the same generation, and never went not ready
    support::wait_until(Duration::from_secs(20), "registered again", || {
        a.status().cluster.is_some_and(|c| c.registrations >= 2)
    });
    println!("etcd restarted in {restarted:?}; the node registered again without churn");
    assert_eq!(view(&a), [(1, a.generation)], "the same generation");
    assert_eq!(a.get("/readyz").0, 200);
}

/// Push four fresh blocks of seed `seed` from `d` to node `to`; the transfer's end.
fn push_fresh(d: &Daemon, seed: u64, to: u64) -> kvd::protocol::TransferInfo {
    let mut c = d.client("engine", 30_000);
    let keys = support::put_blocks(&mut c, seed, 4, 256 << 10);
    let id = c.push(to, &keys).unwrap();
    support::wait_transfer(&mut c, id, Duration::from_secs(30))
}

/// Nodes that may connect to `d` now.
fn members(d: &Daemon) -> u64 {
    d.status().data_port.unwrap().members
}

#[test]
fn a_node_whose_key_is_revoked_in_etcd_is_cut_off_and_comes_back_only_with_a_new_key() {
    let etcd = Etcd::start();
    let tmp = tempfile::tempdir().unwrap();
    let secret = secret_file(tmp.path());
    let dirs = node_dirs(tmp.path(), 3);
    let mut a = node(&dirs[0], &secret, &etcd, 1);
    let b = node(&dirs[1], &secret, &etcd, 2);
    let c = node(&dirs[2], &secret, &etcd, 3);
    let all = vec![(1, a.generation), (2, b.generation), (3, c.generation)];
    wait_views(&[&a, &b, &c], &all, Duration::from_secs(20), "all three");
    // each registration carries its node's key, as made in its data directory
    let old = key_in(&dirs[0]).public().to_string();
    let regs = b.status().cluster.unwrap().nodes;
    assert_eq!(regs.iter().find(|r| r.node_id == 1).unwrap().node_key, old);
    assert_eq!(push_fresh(&a, 1, 2).state, TransferState::Done);
    assert_eq!(push_fresh(&c, 2, 2).state, TransferState::Done);

    // one step: revoke node 1's registered key
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvd"))
        .args(["key", "revoke", "--etcd", &etcd.url, "--node", "1"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("revoked {old}")
    );
    support::wait_until(
        Duration::from_secs(10),
        "nodes 2 and 3 drop node 1's key",
        || members(&b) == 1 && members(&c) == 1,
    );
    assert!(b.status().cluster.unwrap().revoked_keys.contains(&old));
    assert!(
        b.log().contains("closing its connections"),
        "node 2 cut node 1 off"
    );
    support::wait_until(Duration::from_secs(10), "node 1 learns it", || {
        a.log().contains("own key is revoked")
    });
    // node 1 still holds the secret and its key: refused at the bind, whatever it asks
    let t = push_fresh(&a, 3, 2);
    assert!(
        matches!(&t.state, TransferState::Failed(e) if format!("{e:?}").contains("identity")),
        "{t:?}"
    );
    assert!(b.status().data_port.unwrap().engine.identity_refusals >= 1);
    // and node 2 no longer connects to it; the others go on
    let mut cb = b.client("reader", 30_000);
    let ns = cb.register_namespace(&support::namespace()).unwrap();
    let id = cb.fetch(1, &support::keys(ns, 1, 2)).unwrap();
    let t = support::wait_transfer(&mut cb, id, Duration::from_secs(30));
    assert!(matches!(t.state, TransferState::Failed(_)), "{t:?}");
    assert_eq!(push_fresh(&c, 4, 2).state, TransferState::Done);

    // node 1 comes back with a new key: stopped, its key file deleted, started again
    a.stop();
    std::fs::remove_file(dirs[0].join("node.key")).unwrap();
    let a2 = node(&dirs[0], &secret, &etcd, 1);
    assert_ne!(key_in(&dirs[0]).public().to_string(), old);
    support::wait_until(Duration::from_secs(20), "node 2 takes the new key", || {
        members(&b) == 2
    });
    assert_eq!(push_fresh(&a2, 5, 2).state, TransferState::Done);
}
