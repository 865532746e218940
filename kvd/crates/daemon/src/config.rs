//! `kvd serve`'s settings. Each is declared once, in [`ServeArgs`]: its doc line (the `--help`
//! text), its default and its bounds (clap's). The same names, with underscores, are the keys
//! of the `--config` TOML file: [`ServeArgs::from_cli`] turns the file's keys into the
//! flags they name and parses them with the command line's own (which win), so a value from
//! the file is defaulted, parsed and bounded exactly as the flag is. What depends on several
//! settings is checked in [`DaemonConfig::resolve`], which turns the settings into the
//! daemon's configuration.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use clap::{Args, FromArgMatches};
use kvd_core::batch::MAX_BATCH_CEILING;
use serde::Serialize;

use super::clients::ClientLimits;
use crate::pool::HugePages;
use crate::{Error, Result};

/// The embedded defaults: a laptop-sized single node.
pub const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:7460";
/// Where the data port listens by default (beside the admin port's 7460).
pub const DEFAULT_DATA_LISTEN: &str = "127.0.0.1:7461";
/// Block events kept for routers: at a few hundred events a second, minutes of history for a
/// router that falls behind, in about 5 MiB.
pub const DEFAULT_EVENT_LOG_CAPACITY: u32 = 65_536;
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

/// `kvd serve`'s settings: flags, and the keys of the `--config` file (flags win).
///
/// [`DaemonConfig`] holds them as given and adds what the daemon resolves from them; its
/// `--check-config` JSON shows the settings used as given here and, for those marked
/// `#[serde(skip)]`, their resolved form instead (`socket`, `pool_bytes`, `peers`, `data_port`…).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, clap::Args)]
pub struct ServeArgs {
    /// A TOML file with any of the settings below as keys, underscores for dashes (flags win
    /// over the file; an unknown key is an error).
    #[arg(long)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Resolve and check the settings (flags over the file over the defaults), print them and
    /// exit 0, or exit 2 with what is wrong: nothing is bound, created or locked.
    #[arg(long)]
    #[serde(skip)]
    pub check_config: bool,
    /// Where the node generation is persisted (created 0700; increased at every start).
    #[arg(long, default_value = "kvd-data")]
    pub data_dir: PathBuf,
    /// The local protocol's Unix socket (default: DATA_DIR/kvd.sock).
    #[arg(long)]
    #[serde(skip)]
    pub socket: Option<PathBuf>,
    /// Group (name or numeric id) given access to the socket (mode 0660); default: the
    /// daemon's own group.
    #[arg(long)]
    pub socket_group: Option<String>,
    /// The admin HTTP address (/healthz, /readyz, /metrics, /status, /drain); port 0 picks
    /// one.
    #[arg(long, default_value = DEFAULT_ADMIN_LISTEN)]
    pub admin_listen: SocketAddr,
    /// A listener of their own for /healthz and /readyz (liveness and readiness probes): they
    /// answer there within a second however many connections the admin port is refused, with
    /// bounds of its own (in all and per source address). May be any address: it serves no
    /// data [default: off, the probes answer on the admin port only].
    #[arg(long)]
    pub probe_listen: Option<SocketAddr>,
    /// Allow the admin HTTP to listen on a non-loopback address (read-only endpoints only;
    /// /drain stays loopback-only unless --allow-remote-drain).
    #[arg(long)]
    #[serde(skip)]
    pub allow_remote_admin: bool,
    /// Accept /drain from other hosts (needs --allow-remote-admin).
    #[arg(long)]
    pub allow_remote_drain: bool,
    /// Admin HTTP connections held at once; more are answered 503 with Retry-After: 1 and
    /// closed. Lowered at start if the open-file limit is short.
    #[arg(long, default_value_t = DEFAULT_ADMIN_MAX_CONNECTIONS,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_ADMIN_CONNECTIONS)))]
    pub admin_max_connections: u32,
    /// How long an admin connection may take to send a whole request head, from its accept or
    /// its previous answer (so it also bounds a connection that sends nothing), ms.
    #[arg(long, default_value_t = DEFAULT_ADMIN_HEADER_TIMEOUT_MS,
          value_parser = clap::value_parser!(u64).range(1..=MAX_ADMIN_TIMEOUT_MS))]
    pub admin_header_timeout_ms: u64,
    /// An admin connection on which no byte moves either way for this long is closed (a
    /// client that stops reading its answers), ms.
    #[arg(long, default_value_t = DEFAULT_ADMIN_IDLE_TIMEOUT_MS,
          value_parser = clap::value_parser!(u64).range(1..=MAX_ADMIN_TIMEOUT_MS))]
    pub admin_idle_timeout_ms: u64,
    /// The pool's size in MiB, rounded down to whole pages.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    #[serde(skip)]
    pub pool_mib: u64,
    /// Bytes per page in KiB: the largest KV block, a multiple of 4 (the default is 16 tokens
    /// of Qwen3-14B).
    #[arg(long, default_value_t = 2560, value_parser = clap::value_parser!(u64).range(4..=(1 << 30)))]
    #[serde(skip)]
    pub page_kib: u64,
    /// Huge pages for the pool: off, try (fall back to normal pages), require.
    #[arg(long, default_value = "try", value_parser = ["off", "try", "require"])]
    #[serde(skip)]
    pub huge_pages: String,
    /// Sessions (client connections) open at most.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_sessions: u32,
    /// Connections still in their handshake at most, beyond the sessions.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_pending_connections: u32,
    /// How long a new connection may take to finish its handshake, ms.
    #[arg(long, default_value_t = 2_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub handshake_timeout_ms: u64,
    /// Sessions one client process (by SO_PEERCRED pid) may hold [default: a quarter of
    /// --max-sessions].
    #[arg(long)]
    #[serde(skip)]
    pub max_sessions_per_process: Option<u32>,
    /// Sessions the processes of one uid may hold together [default: three quarters of
    /// --max-sessions].
    #[arg(long)]
    #[serde(skip)]
    pub max_sessions_per_uid: Option<u32>,
    /// Handshakes one process may have under way [default: a quarter of
    /// --max-pending-connections].
    #[arg(long)]
    #[serde(skip)]
    pub max_pending_per_process: Option<u32>,
    /// Handshakes the processes of one uid may have under way [default: three quarters of
    /// --max-pending-connections].
    #[arg(long)]
    #[serde(skip)]
    pub max_pending_per_uid: Option<u32>,
    /// Unanswered requests one session may have; more are answered Overloaded.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_inflight: u32,
    /// How long a session polls its socket for the next request after answering one, µs, before
    /// its thread waits in the event loop (0, the default: wait at once). Halves a quiet
    /// machine's metadata round trip, but a worker that polls serves no other session meanwhile:
    /// it slowed one-block puts between copies (see docs/PERFORMANCE.md), so it is opt-in.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=1000))]
    pub spin_us: u32,
    /// While clients call, ask the kernel to keep every CPU's wake-up within this many µs
    /// (PM QoS, /dev/cpu_dma_latency; 0 keeps idle CPUs polling), dropped once no call came
    /// for --cpu-wake-hold-ms. Brings a quiet machine's metadata round trip to its figure
    /// under load, at the cost of CPUs that poll rather than sleep while calls come. Needs
    /// write access to the device (root, or a udev rule); off when unset.
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    #[serde(skip)]
    pub cpu_wake_latency_us: Option<u32>,
    /// How long the wake-latency request outlives the last call, ms.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..=60_000))]
    #[serde(skip)]
    pub cpu_wake_hold_ms: u64,
    /// Items in one batched request at most (a batch's reply must fit one frame).
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_BATCH_CEILING)))]
    pub max_batch: u32,
    /// How long a drain lets in-flight work finish before aborting it, ms.
    #[arg(long, default_value_t = 30_000)]
    pub drain_deadline_ms: u64,
    /// When a stuck drain gives up and exits non-zero, ms after it began (after the drain
    /// deadline).
    #[arg(long, default_value_t = 45_000)]
    pub hard_deadline_ms: u64,
    /// The reaper's tick (expired leases, pins and manifests), ms.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..))]
    pub reap_interval_ms: u64,
    /// Recompute writer-supplied checksums at seal (one more pass over every block).
    #[arg(long)]
    pub verify_supplied_checksums: bool,
    /// Block events (stored / removed) kept for KV-aware routers; when the ring is full the
    /// oldest is dropped and a reader that had not read it is told to resync.
    #[arg(long, default_value_t = DEFAULT_EVENT_LOG_CAPACITY,
          value_parser = clap::value_parser!(u32)
              .range(1..=i64::from(crate::store::events::MAX_EVENT_LOG_CAPACITY)))]
    pub event_log_capacity: u32,
    /// Runtime worker threads.
    #[arg(long, default_value_t = 2,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1024))]
    pub threads: usize,
    /// This node's id among its peers (unique in the cluster).
    #[arg(long, default_value_t = 1)]
    pub node_id: u64,
    /// The cluster secret file (32 to 4096 bytes, readable by its owner only), the same on
    /// every node: turns the data port on. Make one with `head -c 32 /dev/urandom > FILE &&
    /// chmod 600 FILE`.
    #[arg(long)]
    #[serde(skip)]
    pub cluster_secret_file: Option<PathBuf>,
    /// This node's key file (Ed25519, PKCS#8, readable by its owner only): its data port
    /// connections prove the node id with it. `kvd key show` prints its public half, which
    /// peers list [default: DATA_DIR/node.key, made at first start; a file named here must
    /// exist].
    #[arg(long)]
    #[serde(skip)]
    pub node_key_file: Option<PathBuf>,
    /// Where the data port (peers' transfer connections) listens; needs
    /// --cluster-secret-file [default: 127.0.0.1:7461].
    #[arg(long)]
    #[serde(skip)]
    pub data_listen: Option<SocketAddr>,
    /// What peers' blocks move over: `auto` uses RDMA where this kvd was built with it
    /// (feature `rdma`), a device is usable and the peer serves RDMA too, and TCP otherwise;
    /// `rdma` refuses to start without a usable device; `tcp` never tries RDMA. Control
    /// messages always go over TCP.
    #[arg(long, default_value = "auto", value_parser = transport_choice())]
    #[serde(skip)]
    pub transport: TransportChoice,
    /// The RDMA device (`ibv_devices` lists them) [default: the one nearest --rdma-near-gpu,
    /// else the first].
    #[arg(long)]
    #[serde(skip)]
    pub rdma_device: Option<String>,
    /// Use the RDMA device nearest this GPU on the PCIe tree: its PCI bus id, as
    /// `nvidia-smi --query-gpu=pci.bus_id --format=csv` prints it (0000:3b:00.0).
    #[arg(long, value_name = "PCI_BUS_ID")]
    #[serde(skip)]
    pub rdma_near_gpu: Option<String>,
    /// The RDMA port's GID index (RoCE v2 is usually 1 or 3; `show_gids` lists them).
    #[arg(long, default_value_t = 0)]
    #[serde(skip)]
    pub rdma_gid_index: u32,
    /// A peer: its data port and its public key (`kvd key show` on it), as
    /// NODE_ID=ADDR,key=PUBLIC_KEY (repeat for each peer; a list in the file); needs
    /// --cluster-secret-file. Only listed nodes may connect. Cluster mode fills the same table
    /// from etcd.
    #[arg(long = "peer", value_name = "NODE_ID=ADDR,key=PUBLIC_KEY")]
    #[serde(skip)]
    pub peer: Vec<String>,
    /// A file of peers, one NODE_ID=ADDR,key=PUBLIC_KEY a line (`#` comments; this node's own
    /// line skipped, so every node may share one file), read again within a second of any
    /// change: deleting a node's line revokes it (its connections are closed). Its entries win
    /// over --peer's; needs --cluster-secret-file.
    #[arg(long)]
    #[serde(skip)]
    pub peers_file: Option<PathBuf>,
    /// Of the data port's 64 handshake slots, how many are kept for connections from the
    /// addresses of known peers (static peers, etcd members): strangers, from however many
    /// addresses, can fill the rest only.
    #[arg(long, default_value_t = transport::tcp::DEFAULT_MEMBER_HANDSHAKES as u32,
          value_parser = clap::value_parser!(u32)
              .range(0..transport::tcp::DEFAULT_MAX_HANDSHAKES as i64))]
    #[serde(skip)]
    pub data_handshake_reserve: u32,
    /// Put a MAC (blake3, keyed per connection from its handshake) on every payload this
    /// node's data connections carry, both ways, and check every one: an attacker on the path
    /// who rewrites a payload and keeps its CRC-32C is caught. Costs a keyed-hash pass per
    /// payload on each side (docs/PERFORMANCE.md, "Node identity and the payload MAC"); on for
    /// a connection when either end asks.
    #[arg(long)]
    #[serde(skip)]
    pub payload_mac: bool,
    /// Pushes and fetches this node runs at once with one peer; more are answered Overloaded
    /// (retryable).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1024))]
    #[serde(skip)]
    pub max_transfers_per_peer: u32,
    /// Pushes and fetches this node runs at once in all.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=1024))]
    #[serde(skip)]
    pub max_transfers: u32,
    /// Transfers peers may have under way into or out of this node at once, per peer; more
    /// are answered Overloaded.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1024))]
    #[serde(skip)]
    pub max_incoming_transfers_per_peer: u32,
    /// The same, in all.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=1024))]
    #[serde(skip)]
    pub max_incoming_transfers: u32,
    /// How long a peer's transfer may take from offer to commit (or want to release) before
    /// this node aborts it and frees its pages, ms.
    #[arg(long, default_value_t = 30_000,
          value_parser = clap::value_parser!(u64).range(1_000..=600_000))]
    #[serde(skip)]
    pub transfer_deadline_ms: u64,
    /// Ring threads of the data port's TCP engine (each its own io_uring): the connections to
    /// a peer, and peers' connections here, are spread over them so that their copies run on
    /// several cores. Two (the default) lift the engine's 256 KiB reads to about twice one's and a
    /// daemon's 256 KiB fetches by a quarter; one for a node short of cores (docs/PERFORMANCE.md,
    /// "Ring threads").
    #[arg(long, default_value_t = kvd_remote::DEFAULT_DATA_LANES as u32,
          value_parser = clap::value_parser!(u32).range(1..=transport::tcp::MAX_LANES as i64))]
    #[serde(skip)]
    pub data_lanes: u32,
    /// How to reach etcd (cluster mode), as for `kvd control`.
    #[command(flatten)]
    #[serde(skip)]
    pub etcd: kvd_cluster::EtcdArgs,
    /// The registration lease's TTL, ms (etcd leases count whole seconds): a node that dies
    /// is gone from every view this long after (plus the watch's delivery).
    #[arg(long, default_value_t = 5_000,
          value_parser = clap::value_parser!(u64).range(1_000..=600_000))]
    #[serde(skip)]
    pub etcd_lease_ttl_ms: u64,
}

/// `--cpu-wake-latency-us`: what is requested while clients call, and for how long after.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CpuWakeConfig {
    /// The wake-up latency requested, µs.
    pub latency_us: u32,
    /// How long the request outlives the last call, ms.
    pub hold_ms: u64,
}

/// `kvd serve`'s command, as [`ServeArgs::from_cli`] parses it (the arguments after `serve`).
fn serve_command() -> clap::Command {
    ServeArgs::augment_args(clap::Command::new("kvd serve").no_binary_name(true))
        .args_override_self(true)
}

/// The first line of a clap error, without its `error: ` prefix.
fn clap_error(e: &clap::Error, source: &str) -> Error {
    let text = e.to_string();
    let line = text.lines().next().unwrap_or_default();
    Error::InvalidArgument(format!(
        "{}{source}",
        line.strip_prefix("error: ").unwrap_or(line)
    ))
}

impl ServeArgs {
    /// The settings the arguments after `serve` give: the flags, over the `--config` file's
    /// keys, over the defaults; every value parsed and bounded as its flag's.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad flag, an unreadable or malformed file, a key that
    /// names no setting, or a value out of its bounds (saying where it came from).
    pub fn from_cli<I: IntoIterator<Item = OsString>>(cli: I) -> Result<ServeArgs> {
        let cli: Vec<OsString> = cli.into_iter().collect();
        let parse = |args: &[OsString], source: &str| {
            serve_command()
                .try_get_matches_from(args)
                .and_then(|m| ServeArgs::from_arg_matches(&m))
                .map_err(|e| clap_error(&e, source))
        };
        let flags = parse(&cli, "")?;
        let Some(path) = flags.config.clone() else {
            return Ok(flags);
        };
        let mut args = file_args(&path, &cli)?;
        args.extend(cli);
        parse(&args, &format!(" (in the flags or {})", path.display()))
    }
}

/// The `--config` file's keys as the flags they name, leaving out those the command line
/// gives itself (flags win, lists included).
fn file_args(path: &Path, cli: &[OsString]) -> Result<Vec<OsString>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::InvalidArgument(format!("reading {}: {e}", path.display())))?;
    let table: toml::Table = toml::from_str(&text)
        .map_err(|e| Error::InvalidArgument(format!("{}: {e}", path.display())))?;
    let command = serve_command();
    let mut args = Vec::new();
    for (key, value) in &table {
        let long = key.replace('_', "-");
        let arg = command
            .get_arguments()
            .find(|a| a.get_long() == Some(long.as_str()))
            .filter(|_| !matches!(long.as_str(), "config" | "check-config"))
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{}: {key:?} is not a setting of kvd serve (the keys are its flags' names \
                     with underscores: kvd serve --help, docs/DAEMON.md)",
                    path.display()
                ))
            })?;
        let flag = format!("--{long}");
        let given = cli.iter().any(|a| {
            a.to_str()
                .is_some_and(|a| a == flag || a.starts_with(&format!("{flag}=")))
        });
        if given {
            continue;
        }
        let takes_value = arg.get_action().takes_values();
        let items = match value {
            toml::Value::Array(items) => items.iter().collect(),
            v => vec![v],
        };
        for v in items {
            let text = match v {
                toml::Value::Boolean(b) if !takes_value => {
                    if *b {
                        args.push(OsString::from(&flag));
                    }
                    continue;
                }
                toml::Value::String(s) => s.clone(),
                toml::Value::Integer(_) | toml::Value::Float(_) | toml::Value::Boolean(_) => {
                    v.to_string()
                }
                other => {
                    return Err(Error::InvalidArgument(format!(
                        "{}: {key} = {other}: a setting is a string, a number, a boolean or a \
                         list of them",
                        path.display()
                    )));
                }
            };
            args.push(OsString::from(format!("{flag}={text}")));
        }
    }
    Ok(args)
}

pub use kvd_remote::{DataPortConfig, RdmaSettings, TransportChoice};

/// `--transport`'s parser: the names [`TransportChoice`] knows (listed in `--help`).
fn transport_choice() -> impl clap::builder::TypedValueParser<Value = TransportChoice> {
    use clap::builder::TypedValueParser as _;
    clap::builder::PossibleValuesParser::new(TransportChoice::NAMES)
        .try_map(|s| s.parse::<TransportChoice>())
}

/// The resolved configuration: the settings as given, and what the daemon derives from them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DaemonConfig {
    /// The settings (flags over the file over the defaults), each declared once in
    /// [`ServeArgs`].
    #[serde(flatten)]
    pub settings: ServeArgs,
    /// The Unix socket.
    pub socket: PathBuf,
    /// Pool bytes.
    pub pool_bytes: u64,
    /// Page bytes.
    pub page_bytes: u64,
    /// Huge-page policy.
    pub huge_pages: HugePages,
    /// Per-process and per-uid bounds on handshakes and sessions.
    pub peers: ClientLimits,
    /// The wake-latency request held while clients call (`None`: off).
    pub cpu_wake: Option<CpuWakeConfig>,
    /// Body bytes per frame.
    pub max_frame_bytes: u32,
    /// How long the rest of a frame may take once its header arrived, ms.
    pub frame_timeout_ms: u64,
    /// Items the reaper handles per tick at most.
    pub reap_budget: u32,
    /// The data port, when a cluster secret is configured.
    pub data_port: Option<DataPortConfig>,
    /// Cluster mode, when etcd endpoints are configured.
    pub cluster: Option<kvd_cluster::ClusterConfig>,
}

/// Where this node's key is: `--node-key-file`, or `node.key` in the data directory (made
/// there at first start); and whether it may be made.
pub fn node_key_path(s: &ServeArgs) -> (PathBuf, bool) {
    match &s.node_key_file {
        Some(p) => (p.clone(), false),
        None => (s.data_dir.join(NODE_KEY_FILE), true),
    }
}

/// The key file's name in the data directory.
pub const NODE_KEY_FILE: &str = "node.key";

impl DaemonConfig {
    /// The daemon's configuration from its settings, with what depends on several of them
    /// filled in (derived defaults) and checked.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for settings that do not fit together (a non-loopback admin
    /// address without `--allow-remote-admin`, bounds out of order, a data port without its
    /// secret, cluster mode without a data port).
    pub fn resolve(s: &ServeArgs) -> Result<DaemonConfig> {
        if !s.admin_listen.ip().is_loopback() && !s.allow_remote_admin {
            return Err(Error::InvalidArgument(format!(
                "admin address {} is not loopback; pass --allow-remote-admin to expose the \
                 read-only endpoints",
                s.admin_listen
            )));
        }
        if s.allow_remote_drain && !s.allow_remote_admin {
            return Err(Error::InvalidArgument(
                "--allow-remote-drain needs --allow-remote-admin".into(),
            ));
        }
        let huge_pages = match s.huge_pages.as_str() {
            "off" => HugePages::Off,
            "require" => HugePages::Require,
            _ => HugePages::Try,
        };
        let quarter = |n: u32| (n / 4).max(1);
        let three_quarters = |n: u32| (n - n / 4).max(1);
        let (sessions, pending) = (s.max_sessions, s.max_pending_connections);
        let peers = ClientLimits {
            pending_per_process: s.max_pending_per_process.unwrap_or(quarter(pending)),
            pending_per_uid: s.max_pending_per_uid.unwrap_or(three_quarters(pending)),
            sessions_per_process: s.max_sessions_per_process.unwrap_or(quarter(sessions)),
            sessions_per_uid: s.max_sessions_per_uid.unwrap_or(three_quarters(sessions)),
        };
        let data_port = DaemonConfig::data_port(s)?;
        let cluster = DaemonConfig::cluster(s, data_port.is_some())?;
        let c = DaemonConfig {
            socket: s
                .socket
                .clone()
                .unwrap_or_else(|| s.data_dir.join("kvd.sock")),
            pool_bytes: s.pool_mib.saturating_mul(1 << 20),
            page_bytes: s.page_kib.saturating_mul(1024),
            huge_pages,
            peers,
            cpu_wake: s.cpu_wake_latency_us.map(|latency_us| CpuWakeConfig {
                latency_us,
                hold_ms: s.cpu_wake_hold_ms,
            }),
            max_frame_bytes: crate::protocol::MAX_FRAME_BYTES,
            frame_timeout_ms: 10_000,
            reap_budget: 4096,
            data_port,
            cluster,
            settings: s.clone(),
        };
        c.check()?;
        Ok(c)
    }

    /// The data port's settings, when a cluster secret turns it on.
    fn data_port(s: &ServeArgs) -> Result<Option<DataPortConfig>> {
        let Some(cluster_secret_file) = s.cluster_secret_file.clone() else {
            if s.data_listen.is_some() || !s.peer.is_empty() || s.peers_file.is_some() {
                return Err(Error::InvalidArgument(
                    "--data-listen, --peer and --peers-file need --cluster-secret-file (the \
                     data port only runs authenticated)"
                        .into(),
                ));
            }
            return Ok(None);
        };
        let (per_peer, total) = (s.max_transfers_per_peer, s.max_transfers);
        if per_peer > total {
            return Err(Error::InvalidArgument(format!(
                "transfer bounds must satisfy per peer ({per_peer}) <= in all ({total})"
            )));
        }
        let (in_peer, in_total) = (s.max_incoming_transfers_per_peer, s.max_incoming_transfers);
        if in_peer > in_total {
            return Err(Error::InvalidArgument(format!(
                "incoming transfer bounds must satisfy per peer ({in_peer}) <= in all \
                 ({in_total})"
            )));
        }
        Ok(Some(DataPortConfig {
            listen: s
                .data_listen
                .unwrap_or_else(|| DEFAULT_DATA_LISTEN.parse().expect("a valid literal")),
            cluster_secret_file,
            node_key_file: node_key_path(s).0,
            create_node_key: node_key_path(s).1,
            peers: kvd_remote::peers::parse_list(&s.peer, s.node_id)?,
            peers_file: s.peers_file.clone(),
            member_handshakes: s.data_handshake_reserve as usize,
            payload_mac: s.payload_mac,
            max_transfers_per_peer: per_peer,
            max_transfers: total,
            max_incoming_per_peer: in_peer,
            max_incoming: in_total,
            transfer_deadline_ms: s.transfer_deadline_ms,
            lanes: s.data_lanes as usize,
            transport: s.transport,
            rdma: RdmaSettings {
                device: s.rdma_device.clone(),
                near_gpu: s.rdma_near_gpu.clone(),
                gid_index: s.rdma_gid_index,
            },
        }))
    }

    /// Cluster mode's settings, when etcd endpoints are given.
    fn cluster(s: &ServeArgs, data_port: bool) -> Result<Option<kvd_cluster::ClusterConfig>> {
        if !s.etcd.is_on() {
            return Ok(None);
        }
        if !data_port {
            return Err(Error::InvalidArgument(
                "--etcd needs --cluster-secret-file (cluster mode moves blocks between nodes \
                 over the authenticated data port)"
                    .into(),
            ));
        }
        Ok(Some(kvd_cluster::ClusterConfig::from_args(
            &s.etcd,
            s.etcd_lease_ttl_ms,
        )?))
    }

    /// What single settings' bounds cannot say.
    fn check(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(m));
        if self.pool_bytes < self.page_bytes {
            return bad(format!(
                "the pool ({} bytes) must hold at least one page ({} bytes)",
                self.pool_bytes, self.page_bytes
            ));
        }
        let p = &self.peers;
        if p.sessions_per_process == 0
            || p.sessions_per_process > p.sessions_per_uid
            || p.sessions_per_uid > self.settings.max_sessions
        {
            return bad(format!(
                "session bounds must satisfy 1 <= per process ({}) <= per uid ({}) <= \
                 max_sessions ({})",
                p.sessions_per_process, p.sessions_per_uid, self.settings.max_sessions
            ));
        }
        if p.pending_per_process == 0
            || p.pending_per_process > p.pending_per_uid
            || p.pending_per_uid > self.settings.max_pending_connections
        {
            return bad(format!(
                "handshake bounds must satisfy 1 <= per process ({}) <= per uid ({}) <= \
                 max_pending_connections ({})",
                p.pending_per_process, p.pending_per_uid, self.settings.max_pending_connections
            ));
        }
        if self.settings.hard_deadline_ms <= self.settings.drain_deadline_ms {
            return bad(format!(
                "the hard deadline ({} ms) must come after the drain deadline ({} ms)",
                self.settings.hard_deadline_ms, self.settings.drain_deadline_ms
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
