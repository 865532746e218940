//! `kvd serve`'s configuration: command-line flags over an optional TOML file over embedded
//! defaults. Every bound the daemon enforces is here, with its unit in its name.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::clients::ClientLimits;
use crate::pool::HugePages;
use crate::{Error, Result};

/// `kvd serve` flags. Each overrides the same key of the `--config` file.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ServeArgs {
    /// A TOML file with any of the keys below (flags win over the file).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Resolve and check the settings (flags over the file over the defaults), print them and
    /// exit 0, or exit 2 with what is wrong: nothing is bound, created or locked.
    #[arg(long)]
    pub check_config: bool,
    /// Where the node generation is persisted (created 0700; increased at every start)
    /// [default: kvd-data].
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// The local protocol's Unix socket (default: DATA_DIR/kvd.sock).
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Group (name or numeric id) given access to the socket (mode 0660); default: the
    /// daemon's own group.
    #[arg(long)]
    pub socket_group: Option<String>,
    /// The admin HTTP address (/healthz, /readyz, /metrics, /status, /drain); port 0 picks one
    /// [default: 127.0.0.1:7460].
    #[arg(long)]
    pub admin_listen: Option<SocketAddr>,
    /// A listener of their own for /healthz and /readyz (liveness and readiness probes): they
    /// answer there within a second however many connections the admin port is refused, with
    /// bounds of its own (in all and per source address). May be any address: it serves no
    /// data [default: off, the probes answer on the admin port only].
    #[arg(long)]
    pub probe_listen: Option<SocketAddr>,
    /// Allow the admin HTTP to listen on a non-loopback address (read-only endpoints only;
    /// /drain stays loopback-only unless --allow-remote-drain).
    #[arg(long)]
    pub allow_remote_admin: bool,
    /// Accept /drain from other hosts (needs --allow-remote-admin).
    #[arg(long)]
    pub allow_remote_drain: bool,
    /// Admin HTTP connections held at once; more are answered 503 with Retry-After: 1 and
    /// closed. Lowered at start if the open-file limit is short [default: 64].
    #[arg(long)]
    pub admin_max_connections: Option<u32>,
    /// How long an admin connection may take to send a whole request head, from its accept or
    /// its previous answer (so it also bounds a connection that sends nothing), ms
    /// [default: 5000].
    #[arg(long)]
    pub admin_header_timeout_ms: Option<u64>,
    /// An admin connection on which no byte moves either way for this long is closed (a
    /// client that stops reading its answers), ms [default: 30000].
    #[arg(long)]
    pub admin_idle_timeout_ms: Option<u64>,
    /// The pool's size in MiB, rounded down to whole pages [default: 256].
    #[arg(long)]
    pub pool_mib: Option<u64>,
    /// Bytes per page in KiB: the largest KV block, a multiple of 4 [default: 2560, i.e. 16
    /// tokens of Qwen3-14B].
    #[arg(long)]
    pub page_kib: Option<u64>,
    /// Huge pages for the pool: off, try (fall back to normal pages), require [default: try].
    #[arg(long)]
    pub huge_pages: Option<String>,
    /// Sessions (client connections) open at most [default: 256].
    #[arg(long)]
    pub max_sessions: Option<u32>,
    /// Connections still in their handshake at most, beyond the sessions [default: 32].
    #[arg(long)]
    pub max_pending_connections: Option<u32>,
    /// How long a new connection may take to finish its handshake, ms [default: 2000].
    #[arg(long)]
    pub handshake_timeout_ms: Option<u64>,
    /// Sessions one client process (by SO_PEERCRED pid) may hold [default: a quarter of
    /// --max-sessions].
    #[arg(long)]
    pub max_sessions_per_process: Option<u32>,
    /// Sessions the processes of one uid may hold together [default: three quarters of
    /// --max-sessions].
    #[arg(long)]
    pub max_sessions_per_uid: Option<u32>,
    /// Handshakes one process may have under way [default: a quarter of
    /// --max-pending-connections].
    #[arg(long)]
    pub max_pending_per_process: Option<u32>,
    /// Handshakes the processes of one uid may have under way [default: three quarters of
    /// --max-pending-connections].
    #[arg(long)]
    pub max_pending_per_uid: Option<u32>,
    /// Unanswered requests one session may have; more are answered Overloaded [default: 32].
    #[arg(long)]
    pub max_inflight: Option<u32>,
    /// Items in one batched request at most [default: 1024].
    #[arg(long)]
    pub max_batch: Option<u32>,
    /// How long a drain lets in-flight work finish before aborting it, ms [default: 30000].
    #[arg(long)]
    pub drain_deadline_ms: Option<u64>,
    /// When a stuck drain gives up and exits non-zero, ms after it began [default: 45000].
    #[arg(long)]
    pub hard_deadline_ms: Option<u64>,
    /// The reaper's tick (expired leases, pins and manifests), ms [default: 100].
    #[arg(long)]
    pub reap_interval_ms: Option<u64>,
    /// Recompute writer-supplied checksums at seal (one more pass over every block).
    #[arg(long)]
    pub verify_supplied_checksums: bool,
    /// Block events (stored / removed) kept for KV-aware routers, 1 to 1048576; when the ring
    /// is full the oldest is dropped and a reader that had not read it is told to resync
    /// [default: 65536].
    #[arg(long)]
    pub event_log_capacity: Option<u32>,
    /// Runtime worker threads [default: 2].
    #[arg(long)]
    pub threads: Option<usize>,
    /// This node's id among its peers (unique in the cluster) [default: 1].
    #[arg(long)]
    pub node_id: Option<u64>,
    /// The cluster secret file (32 to 4096 bytes, readable by its owner only), the same on
    /// every node: turns the data port on. Make one with `head -c 32 /dev/urandom > FILE &&
    /// chmod 600 FILE`.
    #[arg(long)]
    pub cluster_secret_file: Option<PathBuf>,
    /// Where the data port (peers' transfer connections) listens; needs
    /// --cluster-secret-file [default: 127.0.0.1:7461].
    #[arg(long)]
    pub data_listen: Option<SocketAddr>,
    /// What peers' blocks move over: `auto` uses RDMA where this kvd was built with it
    /// (feature `rdma`), a device is usable and the peer serves RDMA too, and TCP otherwise;
    /// `rdma` refuses to start without a usable device; `tcp` never tries RDMA. Control
    /// messages always go over TCP [default: auto].
    #[arg(long, value_enum)]
    pub transport: Option<TransportChoice>,
    /// The RDMA device (`ibv_devices` lists them) [default: the one nearest --rdma-near-gpu,
    /// else the first].
    #[arg(long)]
    pub rdma_device: Option<String>,
    /// Use the RDMA device nearest this GPU on the PCIe tree: its PCI bus id, as
    /// `nvidia-smi --query-gpu=pci.bus_id --format=csv` prints it (0000:3b:00.0).
    #[arg(long, value_name = "PCI_BUS_ID")]
    pub rdma_near_gpu: Option<String>,
    /// The RDMA port's GID index (RoCE v2 is usually 1 or 3; `show_gids` lists them)
    /// [default: 0].
    #[arg(long)]
    pub rdma_gid_index: Option<u32>,
    /// A peer's data port, as NODE_ID=ADDR (repeat for each peer); needs
    /// --cluster-secret-file. Cluster mode will fill the same table from etcd.
    #[arg(long = "peer", value_name = "NODE_ID=ADDR")]
    pub peer: Vec<String>,
    /// Pushes and fetches this node runs at once with one peer; more are answered Overloaded
    /// (retryable) [default: 8].
    #[arg(long)]
    pub max_transfers_per_peer: Option<u32>,
    /// Pushes and fetches this node runs at once in all [default: 16].
    #[arg(long)]
    pub max_transfers: Option<u32>,
    /// Transfers peers may have under way into or out of this node at once, per peer; more
    /// are answered Overloaded [default: 8].
    #[arg(long)]
    pub max_incoming_transfers_per_peer: Option<u32>,
    /// The same, in all [default: 32].
    #[arg(long)]
    pub max_incoming_transfers: Option<u32>,
    /// How long a peer's transfer may take from offer to commit (or want to release) before
    /// this node aborts it and frees its pages, ms [default: 30000].
    #[arg(long)]
    pub transfer_deadline_ms: Option<u64>,
    /// How to reach etcd (cluster mode), as for `kvd control`.
    #[command(flatten)]
    pub etcd: super::cluster::EtcdArgs,
    /// The registration lease's TTL, ms: a node that dies is gone from every view this long
    /// after (plus the watch's delivery) [default: 5000].
    #[arg(long)]
    pub etcd_lease_ttl_ms: Option<u64>,
}

/// The same keys as a TOML file.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)]
pub struct FileConfig {
    pub data_dir: Option<PathBuf>,
    pub socket: Option<PathBuf>,
    pub socket_group: Option<String>,
    pub admin_listen: Option<SocketAddr>,
    pub probe_listen: Option<SocketAddr>,
    pub allow_remote_admin: Option<bool>,
    pub allow_remote_drain: Option<bool>,
    pub admin_max_connections: Option<u32>,
    pub admin_header_timeout_ms: Option<u64>,
    pub admin_idle_timeout_ms: Option<u64>,
    pub pool_mib: Option<u64>,
    pub page_kib: Option<u64>,
    pub huge_pages: Option<String>,
    pub max_sessions: Option<u32>,
    pub max_pending_connections: Option<u32>,
    pub handshake_timeout_ms: Option<u64>,
    pub max_sessions_per_process: Option<u32>,
    pub max_sessions_per_uid: Option<u32>,
    pub max_pending_per_process: Option<u32>,
    pub max_pending_per_uid: Option<u32>,
    pub max_inflight: Option<u32>,
    pub max_batch: Option<u32>,
    pub drain_deadline_ms: Option<u64>,
    pub hard_deadline_ms: Option<u64>,
    pub reap_interval_ms: Option<u64>,
    pub verify_supplied_checksums: Option<bool>,
    pub event_log_capacity: Option<u32>,
    pub threads: Option<usize>,
    pub node_id: Option<u64>,
    pub cluster_secret_file: Option<PathBuf>,
    pub data_listen: Option<SocketAddr>,
    pub transport: Option<TransportChoice>,
    pub rdma_device: Option<String>,
    pub rdma_near_gpu: Option<String>,
    pub rdma_gid_index: Option<u32>,
    pub peer: Option<Vec<String>>,
    pub max_transfers_per_peer: Option<u32>,
    pub max_transfers: Option<u32>,
    pub max_incoming_transfers_per_peer: Option<u32>,
    pub max_incoming_transfers: Option<u32>,
    pub transfer_deadline_ms: Option<u64>,
    pub etcd: Option<Vec<String>>,
    pub etcd_lease_ttl_ms: Option<u64>,
    pub etcd_prefix: Option<String>,
    pub etcd_user: Option<String>,
    pub etcd_password_file: Option<PathBuf>,
    pub etcd_ca_file: Option<PathBuf>,
    pub etcd_cert_file: Option<PathBuf>,
    pub etcd_key_file: Option<PathBuf>,
}

pub use kvd_remote::{DataPortConfig, RdmaSettings, TransportChoice};

/// The resolved configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DaemonConfig {
    /// Where the generation file lives.
    pub data_dir: PathBuf,
    /// The Unix socket.
    pub socket: PathBuf,
    /// The socket's group, if given.
    pub socket_group: Option<String>,
    /// The admin HTTP address.
    pub admin_listen: SocketAddr,
    /// The probes' own address, if any.
    pub probe_listen: Option<SocketAddr>,
    /// Whether /drain is accepted from other hosts.
    pub allow_remote_drain: bool,
    /// Admin HTTP connections held at once, as configured (the fd budget may lower it).
    pub admin_max_connections: u32,
    /// How long an admin request head may take to arrive, ms.
    pub admin_header_timeout_ms: u64,
    /// How long an admin connection may move no byte, ms.
    pub admin_idle_timeout_ms: u64,
    /// Pool bytes.
    pub pool_bytes: u64,
    /// Page bytes.
    pub page_bytes: u64,
    /// Huge-page policy.
    pub huge_pages: HugePages,
    /// Sessions at most.
    pub max_sessions: u32,
    /// Connections being set up (handshake) at most, beyond the sessions.
    pub max_pending_connections: u32,
    /// How long a handshake may take, ms.
    pub handshake_timeout_ms: u64,
    /// Per-process and per-uid bounds on handshakes and sessions.
    pub peers: ClientLimits,
    /// Unanswered requests per session.
    pub max_inflight: u32,
    /// Items per batch.
    pub max_batch: u32,
    /// Body bytes per frame.
    pub max_frame_bytes: u32,
    /// How long the rest of a frame may take once its header arrived, ms.
    pub frame_timeout_ms: u64,
    /// Drain deadline, ms.
    pub drain_deadline_ms: u64,
    /// Hard deadline, ms.
    pub hard_deadline_ms: u64,
    /// Reaper tick, ms.
    pub reap_interval_ms: u64,
    /// Items the reaper handles per tick at most.
    pub reap_budget: u32,
    /// Recompute supplied checksums at seal.
    pub verify_supplied_checksums: bool,
    /// Block events the store's ring keeps for routers.
    pub event_log_capacity: u32,
    /// Runtime threads.
    pub threads: usize,
    /// This node's id among its peers.
    pub node_id: u64,
    /// The data port, when a cluster secret is configured.
    pub data_port: Option<DataPortConfig>,
    /// Cluster mode, when etcd endpoints are configured.
    pub cluster: Option<super::cluster::ClusterConfig>,
}

/// Where the data port listens by default (beside the admin port's 7460).
pub const DEFAULT_DATA_LISTEN: &str = "127.0.0.1:7461";

/// Parse `--peer NODE_ID=ADDR` entries into a table; `me` may not appear in it.
fn parse_peers(entries: &[String], me: u64) -> Result<std::collections::BTreeMap<u64, SocketAddr>> {
    let mut peers = std::collections::BTreeMap::new();
    for e in entries {
        let bad = |why: &str| {
            Error::InvalidArgument(format!(
                "--peer {e:?}: {why}; write it as NODE_ID=ADDR, for example 2=10.0.0.2:7461"
            ))
        };
        let (id, addr) = e.split_once('=').ok_or_else(|| bad("no '='"))?;
        let id: u64 = id
            .trim()
            .parse()
            .map_err(|_| bad("the node id is not a number"))?;
        let addr: SocketAddr = addr
            .trim()
            .parse()
            .map_err(|_| bad("the address is not IP:PORT"))?;
        if id == me {
            return Err(bad("that is this node's own id (--node-id)"));
        }
        if peers.insert(id, addr).is_some() {
            return Err(bad("node id given twice"));
        }
    }
    Ok(peers)
}

/// Block events kept for routers: at a few hundred events a second, minutes of history for a
/// router that falls behind, in about 5 MiB.
pub const DEFAULT_EVENT_LOG_CAPACITY: u32 = 65_536;

/// The embedded defaults: a laptop-sized single node.
pub const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:7460";
/// Admin HTTP connections held at once: probes, a scrape and operators, with room to spare.
pub const DEFAULT_ADMIN_MAX_CONNECTIONS: u32 = 64;
/// A request head has this long to arrive on an admin connection, ms.
pub const DEFAULT_ADMIN_HEADER_TIMEOUT_MS: u64 = 5_000;
/// An admin connection that moves no byte for this long is closed, ms.
pub const DEFAULT_ADMIN_IDLE_TIMEOUT_MS: u64 = 30_000;
/// The longest admin timeout accepted, ms: beyond it a stuck client holds its slot for longer
/// than any operator would wait.
pub const MAX_ADMIN_TIMEOUT_MS: u64 = 600_000;
/// The most admin connections accepted as a setting (each is a file descriptor).
pub const MAX_ADMIN_CONNECTIONS: u32 = 65_536;

impl DaemonConfig {
    /// Resolve flags over the file over the defaults, and check the result.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unreadable or malformed file, a bad value, or a
    /// non-loopback admin address without `--allow-remote-admin`.
    #[expect(
        clippy::too_many_lines,
        reason = "over the 120-line ratchet (253 lines) when it came in: shorten it, then drop this"
    )]
    pub fn resolve(args: &ServeArgs) -> Result<DaemonConfig> {
        let file = match &args.config {
            Some(p) => load_file(p)?,
            None => FileConfig::default(),
        };
        let data_dir = args
            .data_dir
            .clone()
            .or(file.data_dir)
            .unwrap_or_else(|| PathBuf::from("kvd-data"));
        let socket = args
            .socket
            .clone()
            .or(file.socket)
            .unwrap_or_else(|| data_dir.join("kvd.sock"));
        let admin_listen = args
            .admin_listen
            .or(file.admin_listen)
            .unwrap_or_else(|| DEFAULT_ADMIN_LISTEN.parse().expect("a valid literal"));
        let allow_remote_admin = args.allow_remote_admin || file.allow_remote_admin == Some(true);
        let allow_remote_drain = args.allow_remote_drain || file.allow_remote_drain == Some(true);
        if !admin_listen.ip().is_loopback() && !allow_remote_admin {
            return Err(Error::InvalidArgument(format!(
                "admin address {admin_listen} is not loopback; pass --allow-remote-admin to \
                 expose the read-only endpoints"
            )));
        }
        if allow_remote_drain && !allow_remote_admin {
            return Err(Error::InvalidArgument(
                "--allow-remote-drain needs --allow-remote-admin".into(),
            ));
        }
        let huge = args
            .huge_pages
            .clone()
            .or(file.huge_pages)
            .unwrap_or_else(|| "try".into());
        let huge_pages = match huge.as_str() {
            "off" => HugePages::Off,
            "try" => HugePages::Try,
            "require" => HugePages::Require,
            h => {
                return Err(Error::InvalidArgument(format!(
                    "huge_pages must be off, try or require, not {h:?}"
                )));
            }
        };
        let page_kib = args.page_kib.or(file.page_kib).unwrap_or(2560);
        let pool_mib = args.pool_mib.or(file.pool_mib).unwrap_or(256);
        let max_sessions = args.max_sessions.or(file.max_sessions).unwrap_or(256);
        let max_pending = args
            .max_pending_connections
            .or(file.max_pending_connections)
            .unwrap_or(32);
        let quarter = |n: u32| (n / 4).max(1);
        let three_quarters = |n: u32| (n - n / 4).max(1);
        let peers = ClientLimits {
            pending_per_process: args
                .max_pending_per_process
                .or(file.max_pending_per_process)
                .unwrap_or(quarter(max_pending)),
            pending_per_uid: args
                .max_pending_per_uid
                .or(file.max_pending_per_uid)
                .unwrap_or(three_quarters(max_pending)),
            sessions_per_process: args
                .max_sessions_per_process
                .or(file.max_sessions_per_process)
                .unwrap_or(quarter(max_sessions)),
            sessions_per_uid: args
                .max_sessions_per_uid
                .or(file.max_sessions_per_uid)
                .unwrap_or(three_quarters(max_sessions)),
        };
        let node_id = args.node_id.or(file.node_id).unwrap_or(1);
        let secret = args
            .cluster_secret_file
            .clone()
            .or(file.cluster_secret_file);
        let data_listen = args.data_listen.or(file.data_listen);
        let peer_entries = if args.peer.is_empty() {
            file.peer.unwrap_or_default()
        } else {
            args.peer.clone()
        };
        let data_port = match secret {
            Some(cluster_secret_file) => {
                let per_peer = args
                    .max_transfers_per_peer
                    .or(file.max_transfers_per_peer)
                    .unwrap_or(8);
                let total = args.max_transfers.or(file.max_transfers).unwrap_or(16);
                if per_peer == 0 || per_peer > total || total > 1024 {
                    return Err(Error::InvalidArgument(format!(
                        "transfer bounds must satisfy 1 <= per peer ({per_peer}) <= in all \
                         ({total}) <= 1024"
                    )));
                }
                let in_peer = args
                    .max_incoming_transfers_per_peer
                    .or(file.max_incoming_transfers_per_peer)
                    .unwrap_or(8);
                let in_total = args
                    .max_incoming_transfers
                    .or(file.max_incoming_transfers)
                    .unwrap_or(32);
                if in_peer == 0 || in_peer > in_total || in_total > 1024 {
                    return Err(Error::InvalidArgument(format!(
                        "incoming transfer bounds must satisfy 1 <= per peer ({in_peer}) <= in \
                         all ({in_total}) <= 1024"
                    )));
                }
                let deadline = args
                    .transfer_deadline_ms
                    .or(file.transfer_deadline_ms)
                    .unwrap_or(30_000);
                if !(1_000..=600_000).contains(&deadline) {
                    return Err(Error::InvalidArgument(format!(
                        "transfer_deadline_ms must be 1000 to 600000, not {deadline}"
                    )));
                }
                Some(DataPortConfig {
                    listen: data_listen
                        .unwrap_or_else(|| DEFAULT_DATA_LISTEN.parse().expect("a valid literal")),
                    cluster_secret_file,
                    peers: parse_peers(&peer_entries, node_id)?,
                    max_transfers_per_peer: per_peer,
                    max_transfers: total,
                    max_incoming_per_peer: in_peer,
                    max_incoming: in_total,
                    transfer_deadline_ms: deadline,
                    transport: args.transport.or(file.transport).unwrap_or_default(),
                    rdma: RdmaSettings {
                        device: args.rdma_device.clone().or(file.rdma_device),
                        near_gpu: args.rdma_near_gpu.clone().or(file.rdma_near_gpu),
                        gid_index: args.rdma_gid_index.or(file.rdma_gid_index).unwrap_or(0),
                    },
                })
            }
            None if data_listen.is_some() || !peer_entries.is_empty() => {
                return Err(Error::InvalidArgument(
                    "--data-listen and --peer need --cluster-secret-file (the data port only \
                     runs authenticated)"
                        .into(),
                ));
            }
            None => None,
        };
        let etcd = args.etcd.or(super::cluster::EtcdArgs {
            etcd: file.etcd.unwrap_or_default(),
            etcd_prefix: file.etcd_prefix,
            etcd_user: file.etcd_user,
            etcd_password_file: file.etcd_password_file,
            etcd_ca_file: file.etcd_ca_file,
            etcd_cert_file: file.etcd_cert_file,
            etcd_key_file: file.etcd_key_file,
        });
        let cluster = if !etcd.is_on() {
            None
        } else {
            if data_port.is_none() {
                return Err(Error::InvalidArgument(
                    "--etcd needs --cluster-secret-file (cluster mode moves blocks between \
                     nodes over the authenticated data port)"
                        .into(),
                ));
            }
            let lease_ttl_ms = args
                .etcd_lease_ttl_ms
                .or(file.etcd_lease_ttl_ms)
                .unwrap_or(5_000);
            if !(1_000..=600_000).contains(&lease_ttl_ms) {
                return Err(Error::InvalidArgument(format!(
                    "etcd_lease_ttl_ms must be 1000 to 600000 (etcd leases count whole seconds), \
                     not {lease_ttl_ms}"
                )));
            }
            let (auth, tls) = etcd.security()?;
            Some(super::cluster::ClusterConfig {
                prefix: etcd.prefix(),
                etcd: etcd.etcd,
                tls,
                lease_ttl_ms,
                auth,
            })
        };
        let c = DaemonConfig {
            data_dir,
            socket,
            socket_group: args.socket_group.clone().or(file.socket_group),
            admin_listen,
            probe_listen: args.probe_listen.or(file.probe_listen),
            allow_remote_drain,
            admin_max_connections: args
                .admin_max_connections
                .or(file.admin_max_connections)
                .unwrap_or(DEFAULT_ADMIN_MAX_CONNECTIONS),
            admin_header_timeout_ms: args
                .admin_header_timeout_ms
                .or(file.admin_header_timeout_ms)
                .unwrap_or(DEFAULT_ADMIN_HEADER_TIMEOUT_MS),
            admin_idle_timeout_ms: args
                .admin_idle_timeout_ms
                .or(file.admin_idle_timeout_ms)
                .unwrap_or(DEFAULT_ADMIN_IDLE_TIMEOUT_MS),
            pool_bytes: pool_mib.saturating_mul(1 << 20),
            page_bytes: page_kib.saturating_mul(1024),
            huge_pages,
            max_sessions,
            max_pending_connections: max_pending,
            handshake_timeout_ms: args
                .handshake_timeout_ms
                .or(file.handshake_timeout_ms)
                .unwrap_or(2_000),
            peers,
            max_inflight: args.max_inflight.or(file.max_inflight).unwrap_or(32),
            max_batch: args.max_batch.or(file.max_batch).unwrap_or(1024),
            max_frame_bytes: crate::protocol::MAX_FRAME_BYTES,
            frame_timeout_ms: 10_000,
            drain_deadline_ms: args
                .drain_deadline_ms
                .or(file.drain_deadline_ms)
                .unwrap_or(30_000),
            hard_deadline_ms: args
                .hard_deadline_ms
                .or(file.hard_deadline_ms)
                .unwrap_or(45_000),
            reap_interval_ms: args
                .reap_interval_ms
                .or(file.reap_interval_ms)
                .unwrap_or(100),
            reap_budget: 4096,
            verify_supplied_checksums: args.verify_supplied_checksums
                || file.verify_supplied_checksums == Some(true),
            event_log_capacity: args
                .event_log_capacity
                .or(file.event_log_capacity)
                .unwrap_or(DEFAULT_EVENT_LOG_CAPACITY),
            threads: args.threads.or(file.threads).unwrap_or(2),
            node_id,
            data_port,
            cluster,
        };
        c.check()?;
        Ok(c)
    }

    fn check(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(m));
        if self.page_bytes == 0 || self.pool_bytes < self.page_bytes {
            return bad(format!(
                "the pool ({} bytes) must hold at least one page ({} bytes)",
                self.pool_bytes, self.page_bytes
            ));
        }
        if self.max_sessions == 0 || self.max_inflight == 0 || self.max_batch == 0 {
            return bad("max_sessions, max_inflight and max_batch must be at least 1".into());
        }
        let p = &self.peers;
        if self.max_pending_connections == 0 || self.handshake_timeout_ms == 0 {
            return bad(
                "max_pending_connections and handshake_timeout_ms must be at least 1".into(),
            );
        }
        if p.sessions_per_process == 0
            || p.sessions_per_process > p.sessions_per_uid
            || p.sessions_per_uid > self.max_sessions
        {
            return bad(format!(
                "session bounds must satisfy 1 <= per process ({}) <= per uid ({}) <= \
                 max_sessions ({})",
                p.sessions_per_process, p.sessions_per_uid, self.max_sessions
            ));
        }
        if p.pending_per_process == 0
            || p.pending_per_process > p.pending_per_uid
            || p.pending_per_uid > self.max_pending_connections
        {
            return bad(format!(
                "handshake bounds must satisfy 1 <= per process ({}) <= per uid ({}) <= \
                 max_pending_connections ({})",
                p.pending_per_process, p.pending_per_uid, self.max_pending_connections
            ));
        }
        if self.max_batch > 4096 {
            return bad(format!(
                "max_batch {} exceeds 4096 (a batch's reply must fit one frame)",
                self.max_batch
            ));
        }
        if self.hard_deadline_ms <= self.drain_deadline_ms {
            return bad(format!(
                "the hard deadline ({} ms) must come after the drain deadline ({} ms)",
                self.hard_deadline_ms, self.drain_deadline_ms
            ));
        }
        let max_events = crate::store::events::MAX_EVENT_LOG_CAPACITY;
        if self.event_log_capacity == 0 || self.event_log_capacity > max_events {
            return bad(format!(
                "event_log_capacity must be 1 to {max_events}, not {}",
                self.event_log_capacity
            ));
        }
        if self.reap_interval_ms == 0 || self.threads == 0 {
            return bad("reap_interval_ms and threads must be at least 1".into());
        }
        if self.admin_max_connections == 0 || self.admin_max_connections > MAX_ADMIN_CONNECTIONS {
            return bad(format!(
                "admin_max_connections must be 1 to {MAX_ADMIN_CONNECTIONS}, not {}",
                self.admin_max_connections
            ));
        }
        for (name, ms) in [
            ("admin_header_timeout_ms", self.admin_header_timeout_ms),
            ("admin_idle_timeout_ms", self.admin_idle_timeout_ms),
        ] {
            if ms == 0 || ms > MAX_ADMIN_TIMEOUT_MS {
                return bad(format!(
                    "{name} must be 1 to {MAX_ADMIN_TIMEOUT_MS}, not {ms}"
                ));
            }
        }
        Ok(())
    }
}

fn load_file(p: &Path) -> Result<FileConfig> {
    let text = std::fs::read_to_string(p)
        .map_err(|e| Error::InvalidArgument(format!("reading {}: {e}", p.display())))?;
    toml::from_str(&text).map_err(|e| Error::InvalidArgument(format!("{}: {e}", p.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_win_over_the_file_and_the_file_over_the_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("kvd.toml");
        std::fs::write(&f, "pool_mib = 64\nmax_sessions = 8\npage_kib = 160\n").unwrap();
        let args = ServeArgs {
            config: Some(f),
            max_sessions: Some(4),
            ..ServeArgs::default()
        };
        let c = DaemonConfig::resolve(&args).unwrap();
        assert_eq!(c.pool_bytes, 64 << 20);
        assert_eq!(c.page_bytes, 160 * 1024);
        assert_eq!(c.max_sessions, 4);
        assert_eq!(c.max_inflight, 32);
        assert_eq!(c.socket, PathBuf::from("kvd-data/kvd.sock"));
    }

    #[test]
    fn a_non_loopback_admin_address_needs_an_explicit_flag() {
        let args = ServeArgs {
            admin_listen: Some("0.0.0.0:7460".parse().unwrap()),
            ..ServeArgs::default()
        };
        assert!(DaemonConfig::resolve(&args).is_err());
        let args = ServeArgs {
            allow_remote_admin: true,
            ..args
        };
        let c = DaemonConfig::resolve(&args).unwrap();
        assert!(!c.allow_remote_drain);
    }

    #[test]
    fn admin_bounds_come_from_flags_or_the_file_and_zero_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("kvd.toml");
        std::fs::write(
            &f,
            "admin_max_connections = 8\nadmin_idle_timeout_ms = 900\n",
        )
        .unwrap();
        let args = ServeArgs {
            config: Some(f),
            admin_idle_timeout_ms: Some(700),
            ..ServeArgs::default()
        };
        let c = DaemonConfig::resolve(&args).unwrap();
        assert_eq!(c.admin_max_connections, 8);
        assert_eq!(c.admin_header_timeout_ms, DEFAULT_ADMIN_HEADER_TIMEOUT_MS);
        assert_eq!(c.admin_idle_timeout_ms, 700);
        for bad in [
            ServeArgs {
                admin_max_connections: Some(0),
                ..ServeArgs::default()
            },
            ServeArgs {
                admin_header_timeout_ms: Some(0),
                ..ServeArgs::default()
            },
            ServeArgs {
                admin_idle_timeout_ms: Some(MAX_ADMIN_TIMEOUT_MS + 1),
                ..ServeArgs::default()
            },
        ] {
            let e = DaemonConfig::resolve(&bad).unwrap_err();
            assert!(e.to_string().contains("admin_"), "{e}");
        }
    }

    #[test]
    fn the_event_log_capacity_comes_from_the_flag_or_the_file_within_its_bounds() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("kvd.toml");
        std::fs::write(&f, "event_log_capacity = 16\n").unwrap();
        let from_file = ServeArgs {
            config: Some(f),
            ..ServeArgs::default()
        };
        assert_eq!(
            DaemonConfig::resolve(&from_file)
                .unwrap()
                .event_log_capacity,
            16
        );
        let c = DaemonConfig::resolve(&ServeArgs::default()).unwrap();
        assert_eq!(c.event_log_capacity, DEFAULT_EVENT_LOG_CAPACITY);
        for bad in [0, crate::store::events::MAX_EVENT_LOG_CAPACITY + 1] {
            let args = ServeArgs {
                event_log_capacity: Some(bad),
                ..ServeArgs::default()
            };
            let e = DaemonConfig::resolve(&args).unwrap_err();
            assert!(e.to_string().contains("event_log_capacity"), "{e}");
        }
    }

    #[test]
    fn an_unknown_key_in_the_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("kvd.toml");
        std::fs::write(&f, "pool_gib = 1\n").unwrap();
        let args = ServeArgs {
            config: Some(f),
            ..ServeArgs::default()
        };
        assert!(DaemonConfig::resolve(&args).is_err());
    }
}

#[cfg(test)]
mod documented {
    use super::ServeArgs;

    /// `docs/DAEMON.md`'s settings: the first cell of every table row that names one.
    fn documented() -> std::collections::BTreeSet<String> {
        include_str!("../../../docs/DAEMON.md")
            .lines()
            .filter_map(|l| l.strip_prefix("| `"))
            .filter_map(|l| l.split_once('`').map(|(k, _)| k.to_string()))
            .collect()
    }

    #[test]
    fn every_setting_of_kvd_serve_has_its_row_in_docs_daemon_md_and_every_row_is_a_setting() {
        use clap::Args;
        let cmd = ServeArgs::augment_args(clap::Command::new("serve"));
        let flags: std::collections::BTreeSet<String> = cmd
            .get_arguments()
            .filter_map(|a| a.get_long())
            .filter(|l| !matches!(*l, "config" | "check-config"))
            .map(|l| l.replace('-', "_"))
            .collect();
        let docs = documented();
        let missing: Vec<&String> = flags.iter().filter(|f| !docs.contains(*f)).collect();
        assert!(
            missing.is_empty(),
            "settings of `kvd serve` without a row in docs/DAEMON.md's tables: {missing:?}"
        );
        // rows that name a setting key (snake_case, no spaces) must be one
        let stale: Vec<&String> = docs
            .iter()
            .filter(|d| d.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
            .filter(|d| d.contains('_') && !flags.contains(*d))
            .collect();
        assert!(
            stale.is_empty(),
            "docs/DAEMON.md rows for no setting: {stale:?}"
        );
    }
}
