//! A test's own nodes of a static cluster on loopback ([`Net`]: the secret, the nodes' keys,
//! the peers file), and a test acting as a node itself ([`RawSource`]: a transfer engine with
//! the cluster secret and a node's key, speaking the daemons' messages directly), as a peer or
//! as an insider would.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kvd::daemon::transfer::wire::{Binding, Offered, PeerReply, PeerRequest};
use kvd::keys::BlockKey;
use kvd::protocol::WireError;
use transport::auth::ClusterSecret;
use transport::channel::Channel;
use transport::engine::{HeapMemory, Memory, Op, OpKind, Transport};
use transport::grant::{SegmentId, TransferId};
use transport::link::PeerAddr;
use transport::link::identity::NodeKey;
use transport::link::members::{Member, Members};
use transport::segment::SegmentDescriptor;
use transport::tcp::{TcpConfig, TcpTransport};

use super::{Daemon, StaticCluster};

/// Bytes of each block a raw source offers and writes.
pub const BLOCK: usize = 256 << 10;

/// One test's static cluster on loopback: a secret, each node's key, the peers file.
#[derive(Debug)]
pub struct Net {
    /// The cluster secret file.
    pub secret: PathBuf,
    /// The nodes' keys and the peers file.
    pub cluster: StaticCluster,
    _dir: tempfile::TempDir,
}

impl Net {
    /// A fresh one in a temporary directory.
    pub fn new() -> Net {
        let dir = tempfile::tempdir().unwrap();
        let secret = super::cluster::secret_file(dir.path());
        Net {
            secret,
            cluster: StaticCluster::new(dir.path()),
            _dir: dir,
        }
    }

    /// The flags of node `node` on loopback (any port) and `extra`.
    pub fn args(&self, node: u64, extra: &[&str]) -> Vec<String> {
        self.args_at(node, "127.0.0.1:0", extra)
    }

    /// The flags of node `node` with its data port on `listen`, and `extra`; where `listen`
    /// names a port, the node is in the peers file from now on (it may not be started yet).
    pub fn args_at(&self, node: u64, listen: &str, extra: &[&str]) -> Vec<String> {
        if !listen.ends_with(":0") {
            self.cluster.join_at(node, listen);
        }
        let mut args: Vec<String> = [
            "--cluster-secret-file",
            self.secret.to_str().unwrap(),
            "--data-listen",
            listen,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(self.cluster.args(node));
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    }

    /// Start node `node` with `extra` flags; it joins the peers file once started.
    pub fn node(&self, node: u64, extra: &[&str]) -> Daemon {
        let args = self.args(node, extra);
        let d = Daemon::start(&super::strs(&args));
        self.cluster.join(node, &d);
        d
    }

    /// Start node `node` with `extra` flags but without the peers file: it knows only the
    /// `--peer`s `extra` names (a peer behind a relay, say); it joins the peers file once
    /// started, so the others know it.
    pub fn node_without_file(&self, node: u64, extra: &[&str]) -> Daemon {
        let mut args = self.args(node, extra);
        let at = args.iter().position(|a| a == "--peers-file").unwrap();
        args.drain(at..at + 2);
        let d = Daemon::start(&super::strs(&args));
        self.cluster.join(node, &d);
        d
    }

    /// A `--peer` entry for node `node` reached at `addr` (a relay in front of it), with its
    /// key.
    pub fn entry(&self, node: u64, addr: SocketAddr) -> String {
        self.cluster.entry(node, &addr.to_string())
    }

    /// Start node `node` again on `dir` (its data directory) with `extra` flags; it joins the
    /// peers file at its new address.
    pub fn restart(&self, node: u64, dir: &Path, extra: &[&str]) -> Daemon {
        let args = self.args(node, extra);
        let d = Daemon::start_in(dir, &super::strs(&args));
        self.cluster.join(node, &d);
        d
    }
}

/// A test's own transfer engine with the cluster secret, acting as node `me` towards one
/// daemon: what a peer does, or an insider that holds the secret (and maybe not the key of
/// the node it claims to be).
#[derive(Debug)]
pub struct RawSource {
    /// The engine.
    pub engine: TcpTransport,
    /// Its memory: four blocks of a pattern, registered as segment 1.
    pub mem: Arc<HeapMemory>,
    /// The daemon it talks to.
    pub peer: PeerAddr,
    /// The node id it claims.
    pub me: u64,
}

impl RawSource {
    /// Node 1 of `net` (with node 1's key), towards `d`, node `node`.
    pub fn new(net: &Net, d: &Daemon, node: u64) -> RawSource {
        RawSource::build(net, d, node, 1, 5, |_| {})
    }

    /// Node `me` of `net`, with its key (in the peers file from now on, if no daemon of that
    /// id is), memory of pattern `seed` and its engine `tune`d.
    pub fn build(
        net: &Net,
        d: &Daemon,
        node: u64,
        me: u64,
        seed: u8,
        tune: impl FnOnce(&mut TcpConfig),
    ) -> RawSource {
        if !net.cluster.has(me) {
            net.cluster.join_at(me, "127.0.0.1:9");
        }
        let key = NodeKey::from_file(&net.cluster.key_file(me)).unwrap();
        RawSource::with_key(net, d, node, me, key, seed, tune)
    }

    /// Claiming to be node `me` with `key`, whatever key `net` has for that node: an insider
    /// who holds the secret but not the node's key, where they differ.
    pub fn with_key(
        net: &Net,
        d: &Daemon,
        node: u64,
        me: u64,
        key: NodeKey,
        seed: u8,
        tune: impl FnOnce(&mut TcpConfig),
    ) -> RawSource {
        let s = ClusterSecret::from_file(&net.secret).unwrap();
        let mut config = TcpConfig::new(me, 1, "127.0.0.1:0".parse().unwrap(), s, Arc::new(key));
        let theirs = d.status().data_port.expect("the data port is on");
        config.members = Members::of([(
            node,
            Member {
                key: theirs.node_key.parse().unwrap(),
                addr: None,
            },
        )]);
        tune(&mut config);
        let engine = TcpTransport::start(config).unwrap();
        let mem = Arc::new(HeapMemory::zeroed(4 * BLOCK));
        // SAFETY: no transfer runs yet.
        unsafe { mem.bytes_mut() }.copy_from_slice(&super::pattern(4 * BLOCK, seed));
        engine
            .register(
                SegmentId(1),
                mem.clone() as Arc<dyn Memory>,
                0,
                4 * BLOCK as u64,
            )
            .unwrap();
        RawSource {
            engine,
            mem,
            peer: PeerAddr {
                addr: theirs.listen.parse().unwrap(),
                node_id: node,
            },
            me,
        }
    }

    /// One write op per granted block of an accepted offer, from this source's memory.
    pub fn writes(&self, transfer: u64, segment: &[u8], offsets: &[Option<u64>]) -> Vec<Op> {
        let remote = SegmentDescriptor::decode(segment).unwrap();
        offsets
            .iter()
            .enumerate()
            .map(|(i, off)| Op {
                kind: OpKind::Write,
                local: SegmentId(1),
                local_offset: (i * BLOCK) as u64,
                remote,
                remote_offset: off.unwrap(),
                len: BLOCK as u64,
                transfer: TransferId(transfer),
                epoch: 1,
            })
            .collect()
    }

    /// Run `ops` on a fresh endpoint to the daemon; how the batch settled.
    pub fn run(&self, ops: &[Op]) -> transport::engine::BatchStatus {
        let ep = self.engine.open(&self.peer).unwrap();
        // SAFETY: the source memory is only read.
        let batch = unsafe { self.engine.submit(ep, ops).unwrap() };
        self.engine.wait(batch, Duration::from_secs(20)).unwrap()
    }

    /// A control connection to the daemon, and the generation it introduced itself with.
    pub fn control(&self) -> (Channel, u64) {
        let (s, bind) = self.engine.open_control(&self.peer).unwrap();
        (s, bind.node_generation)
    }

    /// An offer of `keys` (this source's first blocks), bound to the daemon in incarnation
    /// `dest_generation`, for `request` at `epoch`.
    pub fn offer(
        &self,
        keys: &[BlockKey],
        dest_generation: u64,
        request: u64,
        epoch: u64,
    ) -> PeerRequest {
        // SAFETY: no transfer writes this memory (it is only ever sent from).
        let bytes = unsafe { self.mem.bytes() };
        PeerRequest::Offer {
            binding: Binding {
                request,
                namespace: keys[0].namespace,
                source_node: self.me,
                source_generation: 1,
                destination_node: self.peer.node_id,
                destination_generation: dest_generation,
                epoch,
            },
            namespace: Box::new(super::namespace()),
            blocks: keys
                .iter()
                .enumerate()
                .map(|(i, k)| Offered {
                    key: *k,
                    len: BLOCK as u64,
                    checksum: transport::local::crc32c(0, &bytes[i * BLOCK..(i + 1) * BLOCK]),
                })
                .collect(),
            checkpoint: None,
        }
    }
}

/// Ask `r` on a control connection; the answer.
pub fn ask(s: &mut Channel, r: &PeerRequest) -> PeerReply {
    kvd::daemon::transfer::wire::ask(s, r).unwrap()
}

/// An accepted offer's transfer id, segment descriptor and block offsets.
pub fn accepted(r: PeerReply) -> (u64, Vec<u8>, Vec<Option<u64>>) {
    let PeerReply::Accepted {
        transfer,
        segment,
        offsets,
    } = r
    else {
        panic!("the offer was not accepted: {r:?}")
    };
    (transfer, segment, offsets)
}

/// A commit of `transfer` is refused as corrupt and none of `keys` became visible on `d`; the
/// reader's client.
pub fn commit_is_refused_as_corrupt(
    s: &mut Channel,
    transfer: u64,
    d: &Daemon,
    keys: &[BlockKey],
) -> kvd::client::Client {
    let r = ask(s, &PeerRequest::Commit { transfer });
    assert!(
        matches!(r, PeerReply::Refused(WireError::Corrupt { .. })),
        "{r:?}"
    );
    let mut cb = d.client("reader", 30_000);
    assert_eq!(
        cb.exists(keys).unwrap(),
        vec![false; keys.len()],
        "nothing published"
    );
    cb
}

/// A connection to `to` from the loopback address `source`.
pub fn connect_from(
    source: &str,
    to: std::net::SocketAddr,
) -> std::io::Result<std::net::TcpStream> {
    use rustix::net::{AddressFamily, SocketType, bind, connect, socket};
    let fd = socket(AddressFamily::INET, SocketType::STREAM, None)?;
    let from: std::net::SocketAddr = format!("{source}:0").parse().unwrap();
    bind(&fd, &from)?;
    connect(&fd, &to)?;
    Ok(std::net::TcpStream::from(fd))
}
