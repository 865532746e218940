//! The daemon's data port (its transfer engine): on only with a cluster secret, a clear
//! start-up error for a bad one (or a bad node key or peer entry), and closed to anyone
//! without the secret, without a known node key, or without a grant.

mod support;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use support::{Daemon, command};
use transport::auth::ClusterSecret;
use transport::engine::{HeapMemory, Memory, Op, OpFailure, OpKind, OpStatus, Transport};
use transport::grant::{SegmentId, TransferId};
use transport::link::PeerAddr;
use transport::link::members::{Member, Members};
use transport::link::testing;
use transport::segment::SegmentDescriptor;
use transport::tcp::TcpTransport;

fn secret_file(dir: &Path, name: &str, byte: u8, mode: u32) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join(name);
    std::fs::write(&p, [byte; 32]).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
    p
}

/// Run `kvd serve` with `extra`, expecting it to refuse to start; its log.
fn refused_start(extra: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = command(dir.path(), extra);
    cmd.stdout(std::process::Stdio::null());
    let out = cmd.output().unwrap();
    assert!(!out.status.success(), "kvd started with {extra:?}");
    std::fs::read_to_string(dir.path().join("daemon.log")).unwrap()
}

#[test]
fn a_missing_or_world_readable_secret_or_a_data_port_without_one_is_a_clear_startup_error() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-secret");
    let log = refused_start(&["--cluster-secret-file", missing.to_str().unwrap()]);
    assert!(log.contains("no-such-secret"), "names the file: {log}");

    let open = secret_file(dir.path(), "open", 1, 0o644);
    let log = refused_start(&["--cluster-secret-file", open.to_str().unwrap()]);
    assert!(
        log.contains("readable by others") && log.contains("chmod 600"),
        "{log}"
    );

    let short = dir.path().join("short");
    std::fs::write(&short, b"too short").unwrap();
    std::fs::set_permissions(&short, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let log = refused_start(&["--cluster-secret-file", short.to_str().unwrap()]);
    assert!(
        log.contains("head -c 32 /dev/urandom"),
        "says how to make one: {log}"
    );

    let log = refused_start(&["--data-listen", "127.0.0.1:0"]);
    assert!(log.contains("need --cluster-secret-file"), "{log}");

    let good = secret_file(dir.path(), "good", 1, 0o600);
    let log = refused_start(&[
        "--cluster-secret-file",
        good.to_str().unwrap(),
        "--peer",
        "2-127.0.0.1:1",
    ]);
    assert!(log.contains("NODE_ID=ADDR,key=PUBLIC_KEY"), "{log}");
    // a peer without its key: it could never be authenticated
    let log = refused_start(&[
        "--cluster-secret-file",
        good.to_str().unwrap(),
        "--peer",
        "2=127.0.0.1:1",
    ]);
    assert!(log.contains("no key"), "{log}");
    // a node key named but missing, or readable by others
    let log = refused_start(&[
        "--cluster-secret-file",
        good.to_str().unwrap(),
        "--node-key-file",
        missing.to_str().unwrap(),
    ]);
    assert!(
        log.contains("node key") && log.contains("no-such-secret"),
        "{log}"
    );
    let key = dir.path().join("node.key");
    transport::link::identity::NodeKey::create(&key).unwrap();
    std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let log = refused_start(&[
        "--cluster-secret-file",
        good.to_str().unwrap(),
        "--node-key-file",
        key.to_str().unwrap(),
    ]);
    assert!(log.contains("chmod 600"), "{log}");

    // RDMA asked for where it cannot be had (no device here; or a build without it)
    if support::rdma_here() {
        return;
    }
    let log = refused_start(&[
        "--cluster-secret-file",
        good.to_str().unwrap(),
        "--transport",
        "rdma",
    ]);
    assert!(
        log.contains("--transport rdma:") && log.contains("use --transport auto"),
        "says why and what to do: {log}"
    );
}

/// Node 7 with the secret in `secret`, whose peers are nodes 1 (a test engine with its test
/// key) and 8.
fn node_7(secret: &Path) -> Daemon {
    let peer = |n: u64| format!("{n}=127.0.0.1:9,key={}", testing::public_key(n));
    let (p1, p8) = (peer(1), peer(8));
    Daemon::start(&[
        "--cluster-secret-file",
        secret.to_str().unwrap(),
        "--data-listen",
        "127.0.0.1:0",
        "--node-id",
        "7",
        "--peer",
        &p1,
        "--peer",
        &p8,
    ])
}

#[test]
fn a_daemon_with_the_secret_serves_its_data_port_and_refuses_strangers_and_ungranted_ranges() {
    let dir = tempfile::tempdir().unwrap();
    let secret = secret_file(dir.path(), "secret", 5, 0o600);
    let stranger = secret_file(dir.path(), "stranger", 6, 0o600);
    let d = node_7(&secret);
    let report = d.status();
    let dp = report.data_port.expect("the data port is on");
    assert_eq!(dp.node_id, 7);
    assert_eq!(dp.peers.get(&8).map(String::as_str), Some("127.0.0.1:9"));
    assert_eq!(dp.members, 2);
    // the key it made in its data directory at its first start
    let made = transport::link::identity::NodeKey::from_file(&d.dir.join("node.key")).unwrap();
    assert_eq!(dp.node_key, made.public().to_string());
    let theirs = Members::of([(
        7,
        Member {
            key: made.public(),
            addr: None,
        },
    )]);
    let addr = dp.listen.parse().unwrap();
    let bytes: Vec<u8> = (0..dp.pool_segment.len() / 2)
        .map(|i| u8::from_str_radix(&dp.pool_segment[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    let pool = SegmentDescriptor::decode(&bytes).unwrap();
    assert_eq!((pool.node_id, pool.node_generation), (7, d.generation));
    assert_eq!(pool.len, 16 << 20, "the whole pool is the segment");

    // a published block whose page a peer will try to overwrite
    let mut c = d.client("owner", 30_000);
    let ns = c.register_namespace(&support::namespace()).unwrap();
    let key = support::keys(ns, 1, 1)[0];
    let data = support::pattern(256 << 10, 3);
    let a = support::put_one(&mut c, key, &data);

    let engine = |secret: &Path| {
        let s = ClusterSecret::from_file(secret).unwrap();
        let mut c = testing::tcp_config(1, 1, s, &[]);
        c.members = theirs.clone();
        let e = TcpTransport::start(c).unwrap();
        let mem = Arc::new(HeapMemory::zeroed(256 << 10));
        e.register(SegmentId(1), mem as Arc<dyn Memory>, 0, 256 << 10)
            .unwrap();
        e
    };
    let peer = PeerAddr { addr, node_id: 7 };

    let e = engine(&stranger).open(&peer).unwrap_err();
    assert!(e.to_string().contains("secret"), "{e}");

    let friend = engine(&secret);
    let ep = friend.open(&peer).unwrap();
    let op = Op {
        kind: OpKind::Write,
        local: SegmentId(1),
        local_offset: 0,
        remote: pool,
        remote_offset: a.offset,
        len: 256 << 10,
        transfer: TransferId(1),
        epoch: 1,
    };
    // SAFETY: the local buffer is not touched until the batch settles.
    let b = unsafe {
        friend
            .submit(
                ep,
                &[
                    op,
                    Op {
                        kind: OpKind::Read,
                        ..op
                    },
                ],
            )
            .unwrap()
    };
    let s = friend.wait(b, Duration::from_secs(10)).unwrap();
    let mut st = [OpStatus::Pending; 2];
    friend.poll(b, &mut st).unwrap();
    assert!(s.settled && s.failed == 2, "{st:?}");
    assert!(
        st.iter()
            .all(|s| matches!(s, OpStatus::Failed(OpFailure::Refused(_))))
    );

    let mut got = vec![0u8; data.len()];
    let info = c
        .acquire(&[key], None)
        .unwrap()
        .remove(0)
        .expect("still published");
    c.read_verified(&info.handle, &mut got).unwrap();
    assert!(got == data, "the block's bytes are untouched");
    c.release(&[info.handle]).unwrap();

    let e = d.status().data_port.unwrap().engine;
    assert_eq!(e.refused, 2, "{e:?}");
    assert!(e.handshakes_refused >= 1, "{e:?}");
    let (_, metrics) = d.get("/metrics");
    assert!(
        metrics.contains("kvd_transfer_refused_total 2"),
        "{metrics}"
    );
}
