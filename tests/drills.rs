//! Fault drills (issue "Fault drills in CI"): real etcd, real daemons, `kvd control`, engine
//! stand-ins (the Rust client, in this process or in helper processes); one fault each. Every
//! drill checks its outcome, its time bound, and that nothing leaked on any node (pool
//! accounting back to what is published, no pins or sessions of dead clients, no transfers or
//! grants in flight, no manifests of ended requests), and prints one line:
//!
//! ```text
//! DRILL  1 | kill -9 an idle node | detected 2.31 s | recovered 2.40 s | leaks 0
//! ```
//!
//! `scripts/drills.sh --runs 3` runs them several times and tabulates min / median / max.

mod support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvd::protocol::TransferState;
use kvd::store::BlockClass;
use support::cluster::{Control, node, node_dirs, secret_file, view, wait_views};
use support::drill::{Expect, Outcome, report, settle};
use support::raw::Net;
use support::{Daemon, Etcd, Helper};

/// The lease TTL of the drills' nodes.
const TTL_MS: u64 = 2_000;
/// What a 2-core machine under the rest of the suite may add to any bound.
const MARGIN: Duration = Duration::from_secs(8);
/// The lease of the engine stand-ins the drills kill.
const STAND_IN_LEASE_MS: u64 = 2_000;
/// Block size of the drills' blocks (the test daemons' page is 256 KiB).
const BLOCK: usize = 200 << 10;

struct Cluster {
    etcd: Etcd,
    _tmp: tempfile::TempDir,
    secret: PathBuf,
    dirs: Vec<PathBuf>,
    nodes: Vec<Option<Daemon>>,
}

impl Cluster {
    /// `n` nodes registered in a fresh etcd, every view complete.
    fn start(n: u64) -> Cluster {
        let etcd = Etcd::start();
        let tmp = tempfile::tempdir().unwrap();
        let secret = secret_file(tmp.path());
        let dirs = node_dirs(tmp.path(), n);
        let nodes: Vec<Option<Daemon>> = (1..=n)
            .map(|i| Some(node(&dirs[i as usize - 1], &secret, &etcd, i, TTL_MS, &[])))
            .collect();
        let c = Cluster {
            etcd,
            _tmp: tmp,
            secret,
            dirs,
            nodes,
        };
        let all = c.members();
        let refs: Vec<&Daemon> = c.up().collect();
        wait_views(
            &refs,
            &all,
            Duration::from_secs(30),
            "every node sees every node",
        );
        c
    }

    fn n(&self, id: u64) -> &Daemon {
        self.nodes[id as usize - 1]
            .as_ref()
            .expect("the node is up")
    }

    fn up(&self) -> impl Iterator<Item = &Daemon> {
        self.nodes.iter().flatten()
    }

    /// (id, generation) of the nodes that are up.
    fn members(&self) -> Vec<(u64, u64)> {
        self.nodes
            .iter()
            .enumerate()
            .filter_map(|(i, d)| d.as_ref().map(|d| (i as u64 + 1, d.generation)))
            .collect()
    }

    fn kill9(&mut self, id: u64) {
        let mut d = self.nodes[id as usize - 1].take().expect("up");
        support::signal(d.pid(), rustix::process::Signal::KILL);
        let _ = d.wait_exit(Duration::from_secs(10));
    }

    fn restart(&mut self, id: u64) {
        let d = node(
            &self.dirs[id as usize - 1],
            &self.secret,
            &self.etcd,
            id,
            TTL_MS,
            &[],
        );
        self.nodes[id as usize - 1] = Some(d);
    }

    /// Every node that is up, with no live client and no live request.
    fn quiet(&self) -> Vec<(&Daemon, Expect)> {
        self.up().map(|d| (d, Expect::default())).collect()
    }
}

/// Put `n` blocks of `BLOCK - i` bytes with pattern `seed + i` through `c`; their keys.
fn put_blocks(c: &mut kvd::client::Client, seed: u64, n: usize) -> Vec<kvd::keys::BlockKey> {
    let ns = c.register_namespace(&support::namespace()).unwrap();
    let keys = support::keys(ns, seed, n);
    for (i, k) in keys.iter().enumerate() {
        support::put_one(
            c,
            *k,
            &support::pattern(BLOCK - i, (seed as u8).wrapping_add(i as u8)),
        );
    }
    keys
}

/// Whether `c` reads exactly what [`put_blocks`] wrote for every key (published, byte-exact).
fn holds_exactly(c: &mut kvd::client::Client, seed: u64, keys: &[kvd::keys::BlockKey]) -> bool {
    let got = c.acquire(keys, None).unwrap();
    let mut ok = true;
    for (i, g) in got.into_iter().enumerate() {
        match g {
            Ok(info) => {
                let mut buf = vec![0u8; info.len as usize];
                let read = c.read_verified(&info.handle, &mut buf).is_ok();
                ok &=
                    read && buf == support::pattern(BLOCK - i, (seed as u8).wrapping_add(i as u8));
                c.release(&[info.handle]).unwrap();
            }
            Err(_) => ok = false,
        }
    }
    ok
}

/// An engine stand-in's client (a helper process): connected to `KVD_TEST_SOCKET` with the
/// stand-ins' short lease; None when run outside a drill.
fn stand_in_client(name: &str) -> Option<kvd::client::Client> {
    let socket = std::env::var("KVD_TEST_SOCKET").ok()?;
    let opts = support::options(name, STAND_IN_LEASE_MS);
    Some(kvd::client::Client::connect(&socket, &opts).unwrap())
}

/// `n` cache blocks of keys from `seed`, written and SEALED (not published); keys and handles.
fn sealed_blocks(
    c: &mut kvd::client::Client,
    ns: kvd::keys::NamespaceId,
    seed: u64,
    n: usize,
) -> (Vec<kvd::keys::BlockKey>, Vec<kvd::store::Handle>) {
    let keys = support::keys(ns, seed, n);
    let allocs: Vec<_> = c
        .alloc(&keys, BlockClass::Cache, None)
        .unwrap()
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let seals = support::write_all(c, &allocs, |i| support::pattern(BLOCK, i as u8));
    assert!(c.seal(&seals).unwrap().iter().all(Result::is_ok));
    (keys, allocs.iter().map(|a| a.handle).collect())
}

fn admit(ctl: &Control, request: u64, serving: u64) -> serde_json::Value {
    let body = format!(
        r#"{{"request_id": {request}, "serving": {serving}, "prompt_tokens": 100, "max_new_tokens": 10, "reserve_bytes": 65536, "deadline_ms": null}}"#
    );
    let (code, text) =
        kvd::daemon::status::http_with_body(ctl.addr, "POST", "/admit", body.as_bytes()).unwrap();
    assert_eq!(code, 200, "{text}");
    serde_json::from_str(&text).unwrap()
}

fn full_service(ids: &[u64]) -> Vec<(u64, String)> {
    ids.iter()
        .map(|&i| (i, "FullService".to_string()))
        .collect()
}

// ---- 1. kill -9 an idle node ------------------------------------------------------------------

#[test]
fn drill_01_a_killed_idle_node_leaves_every_view_and_placement_within_the_ttl() {
    let mut c = Cluster::start(3);
    let ctl = Control::start(&c.etcd);
    support::wait_until(
        Duration::from_secs(30),
        "the controller has three workers",
        || ctl.workers() == full_service(&[1, 2, 3]),
    );
    let killed = Instant::now();
    c.kill9(3);
    let survivors = c.members();
    let refs: Vec<&Daemon> = c.up().collect();
    wait_views(
        &refs,
        &survivors,
        Duration::from_millis(TTL_MS) + MARGIN,
        "node 3 leaves the views",
    );
    let detected = killed.elapsed();
    support::wait_until(
        Duration::from_millis(TTL_MS) + MARGIN,
        "the controller fails worker 3",
        || ctl.workers().iter().any(|(i, p)| *i == 3 && p == "Failed"),
    );
    let recovered = killed.elapsed();
    // no new checkpoint is placed on it: ten admissions served by node 1 all go to node 2
    for r in 0..10 {
        let a = admit(&ctl, 1000 + r, 1);
        assert_eq!(a["holder"], 2, "request {r} placed on a live holder: {a}");
    }
    for d in c.up() {
        assert!(
            !d.status().data_port.unwrap().peers.contains_key(&3),
            "no peer entry for 3"
        );
    }
    report(Outcome {
        drill: 1,
        fault: "kill -9 an idle node",
        detected: Some(detected),
        recovered: Some(recovered),
        leaks: settle(&c.quiet(), Duration::from_secs(5)),
    });
}

// ---- 3. kill -9 a writer mid-write ------------------------------------------------------------

/// An engine stand-in that writes blocks and dies mid-way: three WRITING (one half-written),
/// two SEALED but not published, and a pin on a block another client published.
#[test]
#[ignore = "a helper process, started by a drill"]
fn stand_in_writer_that_dies_mid_write() {
    let Some(mut c) = stand_in_client("doomed-writer") else {
        return;
    };
    let ns = c.register_namespace(&support::namespace()).unwrap();
    let keys = support::keys(ns, 31, 5);
    let allocs: Vec<_> = c
        .alloc(&keys, BlockClass::Cache, None)
        .unwrap()
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let sealed = support::write_all(&mut c, &allocs[3..], |i| support::pattern(BLOCK, i as u8));
    for r in c.seal(&sealed).unwrap() {
        r.unwrap();
    }
    c.write(&allocs[0].handle, 0, &support::pattern(BLOCK / 2, 7))
        .unwrap();
    // a pin on someone else's published block
    let other = support::keys(ns, 30, 1);
    let pinned = c.acquire(&other, Some(60_000)).unwrap();
    assert!(pinned[0].is_ok());
    println!("READY");
    std::thread::sleep(Duration::from_secs(600));
}

#[test]
fn drill_03_a_writer_killed_mid_write_leaves_nothing_visible_and_its_pages_back_within_its_lease() {
    let d = Daemon::start(&[]);
    let mut other = d.client("publisher", 30_000);
    let ns = other.register_namespace(&support::namespace()).unwrap();
    let published = support::keys(ns, 30, 1)[0];
    support::put_one(&mut other, published, &support::pattern(BLOCK, 1));
    let mut w = Helper::start(&d, "stand_in_writer_that_dies_mid_write");
    w.wait_for("READY", Duration::from_secs(30));
    let st = d.status().stats;
    assert_eq!(
        (st.accounting.writing, st.accounting.sealed, st.pins),
        (3, 2, 1),
        "{st:?}"
    );
    w.kill9();
    let killed = Instant::now();
    // nothing of its blocks is visible to anyone, at once and later
    let theirs = support::keys(ns, 31, 5);
    assert!(
        other.exists(&theirs).unwrap().iter().all(|e| !e),
        "none visible"
    );
    support::wait_until(
        Duration::from_millis(STAND_IN_LEASE_MS) + MARGIN,
        "the dead writer's session ends",
        || d.status().stats.sessions == 1,
    );
    let detected = killed.elapsed();
    let left = settle(
        &[(
            &d,
            Expect {
                sessions: 1,
                ..Expect::default()
            },
        )],
        Duration::from_millis(STAND_IN_LEASE_MS) + MARGIN,
    );
    let recovered = killed.elapsed();
    assert!(
        other.exists(&theirs).unwrap().iter().all(|e| !e),
        "still none visible"
    );
    let a = d.status().stats.accounting;
    assert_eq!(a.published, 1, "only the other client's block: {a:?}");
    assert!(recovered <= Duration::from_millis(STAND_IN_LEASE_MS) + MARGIN);
    report(Outcome {
        drill: 3,
        fault: "kill -9 a writer mid-write",
        detected: Some(detected),
        recovered: Some(recovered),
        leaks: left,
    });
}

// ---- 7. pause etcd ----------------------------------------------------------------------------

#[test]
fn drill_07_a_paused_etcd_stops_nothing_in_flight_and_views_reconcile_on_resume() {
    let c = Cluster::start(3);
    let before = c.members();
    let mut e1 = c.n(1).client("engine", 30_000);
    let keys = put_blocks(&mut e1, 70, 12);
    // pause etcd for less than the lease: work goes on, nothing churns
    let paused = Instant::now();
    support::signal(c.etcd.pid(), rustix::process::Signal::STOP);
    let id = e1.push(2, &keys).unwrap();
    let t = support::wait_transfer(&mut e1, id, Duration::from_secs(30));
    assert_eq!(
        t.state,
        TransferState::Done,
        "a push with etcd paused: {t:?}"
    );
    let mut e2 = c.n(2).client("reader", 30_000);
    assert!(
        holds_exactly(&mut e2, 70, &keys),
        "the pushed blocks are published on node 2"
    );
    let during = paused.elapsed();
    support::signal(c.etcd.pid(), rustix::process::Signal::CONT);
    let resumed = Instant::now();
    for d in c.up() {
        assert_eq!(view(d), before, "no churn while etcd was paused {during:?}");
        assert_eq!(d.get("/readyz").0, 200);
    }
    // on resume every view is rebuilt from a full read: still the same three, same generations
    let refs: Vec<&Daemon> = c.up().collect();
    wait_views(
        &refs,
        &before,
        Duration::from_secs(10),
        "views after the resume",
    );
    let reconciled = resumed.elapsed();
    for d in c.up() {
        let cl = d.status().cluster.unwrap();
        assert_eq!(cl.registrations, 1, "no re-registration: {cl:?}");
    }
    drop((e1, e2));
    report(Outcome {
        drill: 7,
        fault: "pause etcd (within the lease)",
        detected: None,
        recovered: Some(reconciled),
        leaks: settle(&c.quiet(), Duration::from_secs(5)),
    });
}

// ---- 8. pause kvd control ---------------------------------------------------------------------

#[test]
fn drill_08_a_paused_planner_stops_no_data_path_and_plans_nothing_twice_on_resume() {
    let mut c = Cluster::start(3);
    let ctl = Control::start(&c.etcd);
    support::wait_until(
        Duration::from_secs(30),
        "the controller has three workers",
        || ctl.workers() == full_service(&[1, 2, 3]),
    );
    let first = admit(&ctl, 77, 1);
    let mut e1 = c.n(1).client("engine", 30_000);
    let keys = put_blocks(&mut e1, 80, 8);
    support::signal(ctl.child.id(), rustix::process::Signal::STOP);
    // data paths go on without the planner
    let id = e1.push(2, &keys).unwrap();
    let t = support::wait_transfer(&mut e1, id, Duration::from_secs(30));
    assert_eq!(t.state, TransferState::Done, "{t:?}");
    // and a node dies while nobody plans
    c.kill9(3);
    let refs: Vec<&Daemon> = c.up().collect();
    wait_views(
        &refs,
        &c.members(),
        Duration::from_millis(TTL_MS) + MARGIN,
        "node 3 gone",
    );
    support::signal(ctl.child.id(), rustix::process::Signal::CONT);
    let resumed = Instant::now();
    // the planner catches up from its watch (a full read on reconnect) ...
    support::wait_until(
        Duration::from_millis(TTL_MS) + MARGIN,
        "the controller fails worker 3",
        || ctl.workers().iter().any(|(i, p)| *i == 3 && p == "Failed"),
    );
    let reconciled = resumed.elapsed();
    // ... and plans no request twice: the same admission comes back, at the same epoch
    let again = admit(&ctl, 77, 1);
    assert_eq!(again, first, "the same admission, not a second plan");
    let (_, r) = kvd::daemon::status::http(ctl.addr, "GET", "/requests/77").unwrap();
    assert!(r.contains("\"epoch\":1"), "{r}");
    drop(e1);
    report(Outcome {
        drill: 8,
        fault: "pause kvd control (and a node dies meanwhile)",
        detected: None,
        recovered: Some(reconciled),
        leaks: settle(&c.quiet(), Duration::from_secs(5)),
    });
}

// ---- static-peer helpers (drills that need no etcd) ------------------------------------------

/// Node `id` of `net` with a data port on `listen` (a fixed address: it is in the peers file,
/// which every node of the drill reads, from now on), with `extra`.
fn data_node(net: &Net, id: u64, listen: &str, extra: &[&str]) -> Vec<String> {
    net.args_at(id, listen, extra)
}

fn start_in(ns: &str, args: &[String]) -> Daemon {
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    Daemon::start_in_netns(ns, &a)
}

// ---- 2. kill -9 a node mid-way through streaming a checkpoint ---------------------------------

#[test]
#[expect(
    clippy::too_many_lines,
    reason = "over the 120-line ratchet (163 lines) when it came in: shorten it, then drop this"
)]
fn drill_02_a_node_killed_mid_checkpoint_stream_leaves_the_last_complete_step_and_the_stream_resumes_without_gap_or_duplicate()
 {
    use kvd::control::StreamCursor;
    use kvd::keys::{BlockKey, block_tags};
    use kvd::store::Handle;
    let net = Net::new();
    let hosts = support::TwoHosts::new();
    // the worker on host a; the holder and the successor on host b
    let holder_args = data_node(
        &net,
        2,
        "10.77.0.2:7461",
        &["--transfer-deadline-ms", "3000"],
    );
    let worker_args = data_node(&net, 1, "10.77.0.1:7461", &[]);
    let successor_args = data_node(&net, 3, "10.77.0.2:7462", &[]);
    let h = start_in(&hosts.b, &holder_args);
    let w = start_in(&hosts.a, &worker_args);
    let s = start_in(&hosts.b, &successor_args);
    let desc = support::namespace();
    let tpb = desc.tokens_per_block;
    let (req, epoch) = (9001, 1);
    let tokens: Vec<u32> = (0..30 * tpb).map(|t| t * 3 + 5).collect();
    let mut ew = w.client("worker", 60_000);
    let ns = ew.register_namespace(&desc).unwrap();
    let keys: Vec<BlockKey> = block_tags(&ns, tpb, &tokens)
        .unwrap()
        .into_iter()
        .map(|tag| BlockKey { namespace: ns, tag })
        .collect();
    let data = |i: usize| support::pattern(BLOCK, 40 + i as u8);
    // the gateway delivers the request's token stream; the worker acks a frame per token
    let mut gateway = StreamCursor::new();
    ew.manifest_begin(req, epoch, &ns, 0, 120_000).unwrap();
    // one step: write blocks [from, to) as checkpoint blocks, extend here, stream to the holder
    let step = |c: &mut kvd::client::Client, from: usize, to: usize| -> u64 {
        let class = BlockClass::Checkpoint {
            request: req,
            epoch,
        };
        let allocs: Vec<_> = c
            .alloc(&keys[from..to], class, None)
            .unwrap()
            .into_iter()
            .map(Result::unwrap)
            .collect();
        let seals = support::write_all(c, &allocs, |i| data(from + i));
        assert!(c.seal(&seals).unwrap().iter().all(Result::is_ok));
        let handles: Vec<Handle> = allocs.iter().map(|a| a.handle).collect();
        let committed = (to as u32 * tpb) as u64;
        c.manifest_extend(req, epoch, &handles, committed).unwrap();
        c.push_checkpoint(2, req, epoch, &keys[from..to], committed, 120_000)
            .unwrap()
    };
    for (from, to) in [(0, 2), (2, 4), (4, 6)] {
        let id = step(&mut ew, from, to);
        let t = support::wait_transfer(&mut ew, id, Duration::from_secs(30));
        assert_eq!(t.state, TransferState::Done, "{t:?}");
        for seq in (from as u32 * tpb)..(to as u32 * tpb) {
            gateway.accept(u64::from(seq)).unwrap();
        }
    }
    // a few more tokens delivered (and acked) past the last checkpoint
    for seq in (6 * tpb)..(6 * tpb + 5) {
        gateway.accept(u64::from(seq)).unwrap();
    }
    let acked = gateway.last_acked().unwrap();
    // the next step is big and the link slow: kill -9 the worker's node while it streams
    hosts.slow(&hosts.a, &hosts.dev_a(), "40mbit");
    let mut eh = h.client("holder-view", 60_000);
    let free = eh.stats().unwrap().accounting.free;
    let _ = step(&mut ew, 6, 30);
    support::wait_until(
        Duration::from_secs(20),
        "the step has pages on the holder",
        || eh.stats().unwrap().accounting.free < free,
    );
    let killed = Instant::now();
    let mut w = w;
    support::signal(w.pid(), rustix::process::Signal::KILL);
    let _ = w.wait_exit(Duration::from_secs(10));
    drop(ew);
    // the holder aborts the half-streamed step: its pages come back, nothing of it is visible
    support::wait_until(
        Duration::from_secs(15),
        "the holder aborts the step",
        || {
            let a = eh.stats().unwrap().accounting;
            a.writing == 0 && a.allocated == 0 && a.free == free
        },
    );
    let detected = killed.elapsed();
    // the holder keeps the last complete step
    let m = eh.manifest(req).unwrap();
    assert_eq!(
        (m.epoch, m.tags.len(), m.committed_tokens),
        (epoch, 6, 6 * tpb as u64)
    );
    let r = eh.restore_prefix(req, &tokens).unwrap();
    assert_eq!(
        (r.blocks.len(), r.tokens),
        (6, 6 * tpb as u64),
        "exactly that prefix"
    );
    for b in &r.blocks {
        eh.release(&[b.handle]).unwrap();
    }
    // a successor reads the prefix back (the recovery read), byte-exact ...
    let mut es = s.client("successor", 60_000);
    es.register_namespace(&desc).unwrap();
    let id = es.fetch_prefix(2, req, &tokens).unwrap();
    let t = support::wait_transfer(&mut es, id, Duration::from_secs(30));
    assert_eq!(
        (t.state.clone(), t.blocks, t.tokens),
        (TransferState::Done, 6, 6 * tpb as u64),
        "{t:?}"
    );
    for (i, got) in es
        .acquire(&keys[..6], None)
        .unwrap()
        .into_iter()
        .enumerate()
    {
        let info = got.unwrap();
        let mut buf = vec![0u8; info.len as usize];
        es.read_verified(&info.handle, &mut buf).unwrap();
        assert!(buf == data(i), "block {i} byte-exact");
        es.release(&[info.handle]).unwrap();
    }
    // ... recomputes from the restored prefix and resumes the stream after the last
    // acknowledged frame: everything it sends is delivered, nothing twice, no gap
    let (mut delivered, mut duplicates) = (0, 0);
    for seq in (6 * u64::from(tpb))..(30 * u64::from(tpb)) {
        if seq <= acked {
            continue; // the gateway has these: a resumed stream starts at acked + 1
        }
        match gateway.accept(seq).expect("no gap") {
            kvd::control::FrameVerdict::Deliver => delivered += 1,
            kvd::control::FrameVerdict::Duplicate => duplicates += 1,
        }
    }
    assert_eq!(duplicates, 0);
    assert_eq!(
        gateway.next_seq(),
        30 * u64::from(tpb),
        "every token delivered once"
    );
    let recovered = killed.elapsed();
    println!("drill 2: {delivered} frames resumed after frame {acked}");
    drop((es, eh));
    let held = Expect {
        manifests: 1,
        ..Expect::default()
    };
    let mut left = settle_ns(&hosts.b, &h, held, Duration::from_secs(10));
    left.extend(settle_ns(
        &hosts.b,
        &s,
        Expect::default(),
        Duration::from_secs(10),
    ));
    report(Outcome {
        drill: 2,
        fault: "kill -9 a node mid-way through a checkpoint step",
        detected: Some(detected),
        recovered: Some(recovered),
        leaks: left,
    });
}

// ---- 4. cut the link in the middle of a fetch -------------------------------------------------

#[test]
fn drill_04_a_fetch_whose_link_is_cut_publishes_nothing_fails_in_time_and_is_retried_from_another_source()
 {
    let net = Net::new();
    let hosts = support::TwoHosts::new();
    // A and C on host a (C a second source of the same blocks), B across the link
    let (a_addr, b_addr, c_addr) = ("10.77.0.1:7461", "10.77.0.2:7461", "10.77.0.1:7462");
    let b_args = data_node(&net, 2, b_addr, &["--transfer-deadline-ms", "3000"]);
    let (a_args, c_args) = (
        data_node(&net, 1, a_addr, &[]),
        data_node(&net, 3, c_addr, &[]),
    );
    let b = start_in(&hosts.b, &b_args);
    let a = start_in(&hosts.a, &a_args);
    let c = start_in(&hosts.a, &c_args);
    // B has 40 blocks; it gives C a copy (across the link, before the fault)
    let mut eb = b.client("engine-b", 60_000);
    let keys = put_blocks(&mut eb, 90, 40);
    let id = eb.push(3, &keys).unwrap();
    assert_eq!(
        support::wait_transfer(&mut eb, id, Duration::from_secs(60)).state,
        TransferState::Done
    );
    // A fetches them from B over a slowed link, which is cut mid-way
    hosts.slow(&hosts.b, &hosts.dev_b(), "40mbit");
    let mut ea = a.client("engine-a", 60_000);
    ea.register_namespace(&support::namespace()).unwrap();
    let free = ea.stats().unwrap().accounting.free;
    let id = ea.fetch(2, &keys).unwrap();
    support::wait_until(Duration::from_secs(20), "the fetch has pages on A", || {
        ea.stats().unwrap().accounting.free < free
    });
    let cut = Instant::now();
    support::ip(&["-n", &hosts.a, "link", "set", &hosts.dev_a(), "down"]);
    let t = support::wait_transfer(&mut ea, id, Duration::from_secs(60));
    let detected = cut.elapsed();
    assert!(matches!(t.state, TransferState::Failed(_)), "{t:?}");
    assert!(
        detected < Duration::from_secs(5) + MARGIN,
        "within the stall timeout: {detected:?}"
    );
    // nothing partial is published, and A's pages are back
    assert!(
        ea.exists(&keys).unwrap().iter().all(|e| !e),
        "nothing published on A"
    );
    let st = ea.stats().unwrap().accounting;
    assert_eq!((st.writing, st.allocated, st.free), (0, 0, free), "{st:?}");
    // the retry goes to the other source and lands whole
    let id = ea.fetch(3, &keys).unwrap();
    let t = support::wait_transfer(&mut ea, id, Duration::from_secs(60));
    assert_eq!(
        (t.state.clone(), t.blocks),
        (TransferState::Done, 40),
        "{t:?}"
    );
    assert!(
        holds_exactly(&mut ea, 90, &keys),
        "byte-exact from the second source"
    );
    let recovered = cut.elapsed();
    drop((ea, eb));
    // B (across the cut) is reached through its namespace
    let mut left = Vec::new();
    for (ns, d) in [(&hosts.a, &a), (&hosts.b, &b), (&hosts.a, &c)] {
        left.extend(settle_ns(ns, d, Expect::default(), Duration::from_secs(10)));
    }
    report(Outcome {
        drill: 4,
        fault: "cut the link mid-fetch; retry from another source",
        detected: Some(detected),
        recovered: Some(recovered),
        leaks: left,
    });
}

/// [`settle`] for a daemon in network namespace `ns` (its admin port is reachable only there).
fn settle_ns(ns: &str, d: &Daemon, e: Expect, timeout: Duration) -> Vec<String> {
    support::drill::settle_with(timeout, || {
        support::drill::leaks_of(&support::cluster::status_in(ns, d), e)
    })
}

// ---- 6. isolate a node from etcd --------------------------------------------------------------

#[test]
fn drill_06_a_node_cut_off_from_etcd_goes_not_ready_takes_no_work_and_comes_back_with_a_new_generation()
 {
    use support::cluster::{status_in, view_in};
    let hosts = support::TwoHosts::new();
    let exec_a = ["ip", "netns", "exec", hosts.a.as_str()];
    let etcd = Etcd::start_on(&exec_a, "10.77.0.1");
    let tmp = tempfile::tempdir().unwrap();
    let secret = secret_file(tmp.path());
    let (s, ttl) = (secret.to_str().unwrap().to_string(), TTL_MS.to_string());
    let args = |id: &str, listen: &str| -> Vec<String> {
        [
            "--cluster-secret-file",
            &s,
            "--node-id",
            id,
            "--data-listen",
            listen,
            "--etcd",
            &etcd.url,
            "--etcd-lease-ttl-ms",
            &ttl,
        ]
        .iter()
        .map(|x| x.to_string())
        .collect()
    };
    // nodes 1 and 2 beside etcd; node 3 on the other host, reaching etcd over the veth
    let n1 = start_in(&hosts.a, &args("1", "10.77.0.1:0"));
    let n2 = start_in(&hosts.a, &args("2", "10.77.0.1:0"));
    let n3 = start_in(&hosts.b, &args("3", "10.77.0.2:0"));
    support::wait_until(Duration::from_secs(30), "all three see all three", || {
        view_in(&hosts.a, &n1) == [1, 2, 3]
            && view_in(&hosts.a, &n2) == [1, 2, 3]
            && view_in(&hosts.b, &n3) == [1, 2, 3]
    });
    let gen3 = |ns: &str, d: &Daemon| -> Option<u64> {
        status_in(ns, d)
            .cluster?
            .nodes
            .iter()
            .find(|n| n.node_id == 3)
            .map(|n| n.generation)
    };
    let old = gen3(&hosts.a, &n1).expect("node 3 in node 1's view");
    let mut c3 = n3.client("engine-3", 60_000);
    let cut = Instant::now();
    support::ip(&["-n", &hosts.a, "link", "set", &hosts.dev_a(), "down"]);
    support::wait_until(
        Duration::from_millis(TTL_MS) + MARGIN,
        "node 3 refuses new work",
        || match c3.reserve(4096) {
            Ok(r) => {
                let _ = c3.release_reservation(r);
                false
            }
            Err(e) => e.to_string().contains("registration lease"),
        },
    );
    let detected = cut.elapsed();
    assert!(!status_in(&hosts.b, &n3).ready, "node 3 is not ready");
    support::wait_until(
        Duration::from_millis(TTL_MS) + MARGIN,
        "the others drop node 3",
        || view_in(&hosts.a, &n1) == [1, 2] && view_in(&hosts.a, &n2) == [1, 2],
    );
    // reconnected: it registers again under a new generation and takes work again
    support::ip(&["-n", &hosts.a, "link", "set", &hosts.dev_a(), "up"]);
    let back = Instant::now();
    support::wait_until(
        Duration::from_secs(30),
        "node 3 is back, newer, in every view",
        || {
            status_in(&hosts.b, &n3).ready
                && gen3(&hosts.a, &n1).is_some_and(|g| g > old)
                && view_in(&hosts.b, &n3) == [1, 2, 3]
        },
    );
    let recovered = back.elapsed();
    let r = c3
        .reserve(4096)
        .expect("work again after the re-registration");
    c3.release_reservation(r).unwrap();
    drop(c3);
    let mut left = Vec::new();
    for (ns, d) in [(&hosts.a, &n1), (&hosts.a, &n2), (&hosts.b, &n3)] {
        left.extend(settle_ns(ns, d, Expect::default(), Duration::from_secs(10)));
    }
    report(Outcome {
        drill: 6,
        fault: "isolate a node from etcd, then reconnect it",
        detected: Some(detected),
        recovered: Some(recovered),
        leaks: left,
    });
    drop((n1, n2, n3, etcd));
}

// ---- 9. a burst of load -----------------------------------------------------------------------

#[test]
fn drill_09_a_burst_past_the_bound_is_answered_retryably_and_the_retries_do_not_amplify_it() {
    let net = Net::new();
    let b = net.node(2, &[]);
    let a = net.node(1, &["--max-transfers-per-peer", "1", "--pool-mib", "64"]);
    let retrying = kvd::client::ClientOptions {
        retry: Some(kvd::client::RetryPolicy {
            max_attempts: 16,
            base_delay_ms: 2,
            max_delay_ms: 50,
            budget_ms: 10_000,
        }),
        ..support::options("burst", 30_000)
    };
    let mut ca = kvd::client::Client::connect(&a.socket, &retrying).unwrap();
    // a burst of 12 pushes of 4 blocks each, one allowed in flight at a time
    let sets: Vec<Vec<kvd::keys::BlockKey>> =
        (0..12).map(|i| put_blocks(&mut ca, 100 + i, 4)).collect();
    let before = ca.retry_stats();
    let burst = Instant::now();
    let ids: Vec<u64> = sets
        .iter()
        .map(|set| ca.push(2, set).expect("admitted after bounded retries"))
        .collect();
    let s = ca.retry_stats();
    let (calls, sends) = (s.calls - before.calls, s.sends - before.sends);
    let amplification = sends as f64 / calls as f64;
    assert_eq!(s.gave_up, 0);
    assert!(sends > calls, "the bound was reached and retried");
    assert!(sends <= calls * 16, "never more than the attempt bound");
    for id in ids {
        let t = support::wait_transfer(&mut ca, id, Duration::from_secs(60));
        assert_eq!(t.state, TransferState::Done);
    }
    let done = burst.elapsed();
    // without retries the same burst is refused at once, with a hint
    let mut plain = a.client("plain", 30_000);
    let fresh = put_blocks(&mut plain, 200, 16);
    let first = plain.push(2, &fresh).unwrap();
    let e = plain.push(2, &sets[1]).unwrap_err();
    assert!(matches!(e, kvd::Error::Overloaded { retry_after_ms, .. } if retry_after_ms > 0));
    support::wait_transfer(&mut plain, first, Duration::from_secs(60));
    // queues stayed bounded: never more than the one transfer in flight to B
    let st = a.status().data_port.unwrap();
    assert!(st.transfers.transfers_done >= 13, "{:?}", st.transfers);
    drop((ca, plain));
    let fault = format!(
        "a burst of {calls} pushes against 1 in flight (retry amplification {amplification:.2})"
    );
    report(Outcome {
        drill: 9,
        fault: &fault,
        detected: None,
        recovered: Some(done),
        leaks: settle(
            &[(&a, Expect::default()), (&b, Expect::default())],
            Duration::from_secs(10),
        ),
    });
}

// ---- 10. a client cancels a request -----------------------------------------------------------

fn events(ctl: &Control, body: &str) -> serde_json::Value {
    let (code, text) =
        kvd::daemon::status::http_with_body(ctl.addr, "POST", "/events", body.as_bytes()).unwrap();
    assert_eq!(code, 200, "{text}");
    serde_json::from_str(&text).unwrap()
}

/// The engine's checkpoint step `step` (blocks 4·step .. 4·step + 4 of `keys`): written,
/// sealed, added to its manifest and pushed to `holder`, which takes it whole.
fn checkpoint_step(
    e: &mut kvd::client::Client,
    (holder, req, epoch): (u64, u64, u64),
    keys: &[kvd::keys::BlockKey],
    step: usize,
    tokens_per_block: u32,
) {
    let ks = &keys[4 * step..4 * step + 4];
    let class = BlockClass::Checkpoint {
        request: req,
        epoch,
    };
    let allocs: Vec<_> = e
        .alloc(ks, class, None)
        .unwrap()
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let seals = support::write_all(e, &allocs, |i| {
        support::pattern(BLOCK, (4 * step + i) as u8)
    });
    assert!(e.seal(&seals).unwrap().iter().all(Result::is_ok));
    let handles: Vec<kvd::store::Handle> = allocs.iter().map(|a| a.handle).collect();
    let committed = ((4 * step + 4) as u32 * tokens_per_block) as u64;
    e.manifest_extend(req, epoch, &handles, committed).unwrap();
    let id = e
        .push_checkpoint(holder, req, epoch, ks, committed, 120_000)
        .unwrap();
    assert_eq!(
        support::wait_transfer(e, id, Duration::from_secs(30)).state,
        TransferState::Done
    );
}

#[test]
fn drill_10_a_cancel_ends_the_checkpoint_frees_its_pages_and_a_late_completion_revives_nothing() {
    use kvd::keys::BlockKey;
    let c = Cluster::start(3);
    let ctl = Control::start(&c.etcd);
    support::wait_until(
        Duration::from_secs(30),
        "the controller has three workers",
        || ctl.workers() == full_service(&[1, 2, 3]),
    );
    let req = 500;
    let a = admit(&ctl, req, 1);
    let (epoch, holder) = (a["epoch"].as_u64().unwrap(), a["holder"].as_u64().unwrap());
    assert_ne!(holder, 1);
    // the engine on node 1 streams two checkpoint steps to the holder
    let mut e1 = c.n(1).client("engine", 60_000);
    let desc = support::namespace();
    let ns = e1.register_namespace(&desc).unwrap();
    let keys: Vec<BlockKey> = support::keys(ns, 110, 8);
    e1.manifest_begin(req, epoch, &ns, 0, 120_000).unwrap();
    let mut eh = c.n(holder).client("holder-view", 60_000);
    let published_before = eh.stats().unwrap().accounting.published;
    for step in 0..2 {
        checkpoint_step(
            &mut e1,
            (holder, req, epoch),
            &keys,
            step,
            desc.tokens_per_block,
        );
    }
    assert_eq!(eh.manifest(req).unwrap().tags.len(), 8);
    assert_eq!(
        eh.stats().unwrap().accounting.published,
        published_before + 8
    );
    // the client cancels: the control shim decides, the engine stand-in carries it out
    let cancelled_at = Instant::now();
    let r = events(
        &ctl,
        &format!(r#"{{"events":[{{"type":"cancel","request_id":{req}}}]}}"#),
    );
    let d = &r["results"][0]["decisions"][0];
    assert_eq!(d["type"], "cancel", "{r}");
    let cancel_epoch = d["epoch"].as_u64().unwrap();
    assert!(cancel_epoch > epoch);
    // the engine ends the request's checkpoint here and at its holder
    e1.manifest_end(req, epoch).unwrap();
    eh.manifest_end(req, epoch).unwrap();
    support::wait_until(
        Duration::from_secs(10),
        "the holder frees the checkpoint's pages",
        || {
            let st = eh.stats().unwrap();
            st.manifests == 0 && st.accounting.published == published_before
        },
    );
    let detected = cancelled_at.elapsed();
    let r = events(
        &ctl,
        &format!(
            r#"{{"events":[{{"type":"cancelled","request_id":{req},"epoch":{cancel_epoch}}}]}}"#
        ),
    );
    assert_eq!(r["results"][0]["ok"], true, "{r}");
    // a late completion of the cancelled epoch revives nothing: the holder refuses its step,
    // the control shim drops its events
    let late = &keys[..4];
    let id = e1
        .push_checkpoint(holder, req, epoch, late, 64, 120_000)
        .unwrap();
    let t = support::wait_transfer(&mut e1, id, Duration::from_secs(30));
    assert!(
        matches!(t.state, TransferState::Failed(_)),
        "the late step is refused: {t:?}"
    );
    assert!(eh.manifest(req).is_err(), "no manifest revived");
    let r = events(
        &ctl,
        &format!(r#"{{"events":[{{"type":"finished","request_id":{req},"epoch":{epoch}}}]}}"#),
    );
    assert_eq!(
        r["results"][0]["ok"], false,
        "a late finish of the old epoch is dropped: {r}"
    );
    let (_, rec) = kvd::daemon::status::http(ctl.addr, "GET", &format!("/requests/{req}")).unwrap();
    assert!(rec.contains("Cancelled"), "{rec}");
    let recovered = cancelled_at.elapsed();
    drop((e1, eh));
    report(Outcome {
        drill: 10,
        fault: "client cancel of a request with a streamed checkpoint",
        detected: Some(detected),
        recovered: Some(recovered),
        leaks: settle(&c.quiet(), Duration::from_secs(10)),
    });
}

// ---- 11. rolling restart ----------------------------------------------------------------------

#[test]
fn drill_11_a_rolling_restart_drains_each_node_and_no_reader_sees_a_wrong_or_missing_block() {
    let mut c = Cluster::start(3);
    // every block on every node (a replica set of three)
    let mut e1 = c.n(1).client("engine", 60_000);
    let keys = put_blocks(&mut e1, 120, 16);
    for to in [2, 3] {
        let id = e1.push(to, &keys).unwrap();
        assert_eq!(
            support::wait_transfer(&mut e1, id, Duration::from_secs(30)).state,
            TransferState::Done
        );
    }
    drop(e1);
    let started = Instant::now();
    let mut slowest_drain = Duration::ZERO;
    for id in 1..=3u64 {
        let next = id % 3 + 1;
        // a transfer in flight as the drain begins: it finishes or is cancelled in time
        let mut e = c.n(id).client("engine", 60_000);
        let extra = put_blocks(&mut e, 130 + id, 8);
        let push = e.push(next, &extra).unwrap();
        let old_generation = c.n(id).generation;
        let drain = Instant::now();
        support::signal(c.n(id).pid(), rustix::process::Signal::TERM);
        let mut d = c.nodes[id as usize - 1].take().unwrap();
        let status = d
            .wait_exit(Duration::from_secs(30) + MARGIN)
            .expect("it exits");
        assert!(
            status.success(),
            "node {id} exits 0 after its drain: {status:?}"
        );
        slowest_drain = slowest_drain.max(drain.elapsed());
        drop((e, push));
        // the push in flight at the drain either landed whole or not at all
        let mut n = c.n(next).client("check", 30_000);
        let landed = n.exists(&extra).unwrap();
        assert!(
            landed.iter().all(|&x| x) || landed.iter().all(|&x| !x),
            "all or nothing of the drained node's push: {landed:?}"
        );
        drop(n);
        // the others dropped it from their views (it deregistered)
        let refs: Vec<&Daemon> = c.up().collect();
        wait_views(
            &refs,
            &c.members(),
            Duration::from_secs(10),
            "the drained node left the views",
        );
        // meanwhile the cluster serves every block, byte-exact, from the nodes still up
        for d in c.up() {
            let mut r = d.client("reader", 30_000);
            assert!(
                holds_exactly(&mut r, 120, &keys),
                "a node still up serves every block"
            );
        }
        // back with a new generation; it takes its replicas back from a peer
        c.restart(id);
        assert!(c.n(id).generation > old_generation);
        let refs: Vec<&Daemon> = c.up().collect();
        wait_views(
            &refs,
            &c.members(),
            Duration::from_secs(30),
            "the restarted node is back",
        );
        let mut r = c.n(id).client("refill", 60_000);
        r.register_namespace(&support::namespace()).unwrap();
        let f = r.fetch(next, &keys).unwrap();
        let t = support::wait_transfer(&mut r, f, Duration::from_secs(30));
        assert_eq!(
            (t.state.clone(), t.blocks),
            (TransferState::Done, 16),
            "{t:?}"
        );
        assert!(
            holds_exactly(&mut r, 120, &keys),
            "the restarted node serves every block"
        );
    }
    let rolled = started.elapsed();
    report(Outcome {
        drill: 11,
        fault: "rolling restart of every node (SIGTERM, drain, restart)",
        detected: Some(slowest_drain),
        recovered: Some(rolled),
        leaks: settle(&c.quiet(), Duration::from_secs(10)),
    });
}

// ---- 5. kill one rank of a tensor-parallel instance -------------------------------------------

/// Rank 1 of instance 7 (of 2 ranks): commits step 0, then on "step1" seals its blocks of step 1
/// without committing them yet, says READY, and waits (to be killed).
#[test]
#[ignore = "a helper process, started by a drill"]
fn stand_in_rank_one_of_a_two_rank_instance() {
    let Some(mut c) = stand_in_client("rank-1") else {
        return;
    };
    let ns = c.register_namespace(&support::namespace()).unwrap();
    c.instance_join(7, 1, 1, 2).unwrap();
    let (_, step0) = sealed_blocks(&mut c, ns, 51, 2);
    let published = c.instance_commit(7, 1, 0, &step0).unwrap();
    println!("COMMITTED 0 {published}");
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    let _step1 = sealed_blocks(&mut c, ns, 61, 2);
    println!("READY");
    std::thread::sleep(Duration::from_secs(600));
}

#[test]
fn drill_05_a_killed_rank_fails_its_instance_as_a_whole_and_its_open_step_on_every_rank() {
    let d = Daemon::start(&[]);
    let mut r0 = d.client("rank-0", 30_000);
    let ns = r0.register_namespace(&support::namespace()).unwrap();
    r0.instance_join(7, 1, 0, 2).unwrap();
    // step 0: rank 0 commits first, rank 1 (another process) completes it
    let (k0, h0) = sealed_blocks(&mut r0, ns, 50, 2);
    assert!(
        !r0.instance_commit(7, 1, 0, &h0).unwrap(),
        "not before rank 1"
    );
    assert!(
        r0.exists(&k0).unwrap().iter().all(|e| !e),
        "nothing visible before every rank"
    );
    let mut r1 = Helper::start(&d, "stand_in_rank_one_of_a_two_rank_instance");
    let line = r1.wait_for("COMMITTED 0", Duration::from_secs(30));
    assert!(
        line.ends_with("true"),
        "rank 1's commit published step 0: {line}"
    );
    let k1 = support::keys(ns, 51, 2);
    assert!(
        r0.exists(&k0)
            .unwrap()
            .iter()
            .chain(&r0.exists(&k1).unwrap())
            .all(|&e| e)
    );
    // step 1: rank 0 commits; rank 1 has sealed its blocks and dies before committing
    let (k2, h2) = sealed_blocks(&mut r0, ns, 60, 2);
    assert!(!r0.instance_commit(7, 1, 1, &h2).unwrap());
    r1.send("step1");
    r1.wait_for("READY", Duration::from_secs(30));
    let st = d.status();
    assert_eq!(
        st.stats.accounting.sealed, 4,
        "both ranks' step-1 blocks sealed: {:?}",
        st.stats.accounting
    );
    r1.kill9();
    let killed = Instant::now();
    support::wait_until(
        Duration::from_millis(STAND_IN_LEASE_MS) + MARGIN,
        "the instance fails",
        || {
            d.status()
                .instances
                .iter()
                .any(|i| i.instance == 7 && i.failed.is_some())
        },
    );
    let detected = killed.elapsed();
    // step 1 is aborted on every rank: rank 0's committed blocks too; step 0 stays published
    let st = d.status();
    assert_eq!(st.stats.accounting.sealed, 0, "{:?}", st.stats.accounting);
    assert!(
        r0.exists(&k2).unwrap().iter().all(|e| !e),
        "nothing of step 1 visible"
    );
    assert!(r0.exists(&k0).unwrap().iter().all(|&e| e), "step 0 stays");
    // the instance is failed as a whole: the surviving rank is told, with the reason
    let e = r0.instance_commit(7, 1, 2, &[]).unwrap_err();
    assert!(e.to_string().contains("instance 7 has failed"), "{e}");
    let inst = st
        .instances
        .iter()
        .find(|i| i.instance == 7)
        .unwrap()
        .clone();
    assert!(
        inst.failed.as_deref().unwrap_or("").contains("rank 1"),
        "{inst:?}"
    );
    assert_eq!(inst.steps_published, 1);
    let recovered = killed.elapsed();
    drop(r0);
    report(Outcome {
        drill: 5,
        fault: "kill -9 one rank of a two-rank instance mid-step",
        detected: Some(detected),
        recovered: Some(recovered),
        leaks: settle(&[(&d, Expect::default())], Duration::from_secs(10)),
    });
}
