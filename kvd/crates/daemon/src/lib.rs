//! `kvd serve`: the daemon that runs on every GPU node beside the serving engine.
//!
//! Start-up, in order: resolve the [`config`], raise the open-file limit and share it out
//! ([`limits`]: the Unix socket first, then the admin HTTP), open the [`datadir`] (lock it,
//! increase the node generation), create the store and its pool, seal the pool's memfd against resizing (a client
//! that truncates it could otherwise make the daemon fault), bind the Unix socket (0660) and the
//! admin HTTP (loopback), then serve: the [`server`] (local protocol), the reaper, and [`admin`].
//! A signal or `/drain` runs the [`drain`], after which the process exits 0.
//!
//! Read `docs/DAEMON.md` for the protocol, the limits and the reasons behind them.
//!
//! A service crate: the `kvd` binary wires it up as `kvd serve`, `kvd status` and
//! `kvd drain` use its admin API's client ([`status`]), and `kvd key` its node keys ([`keys`]). It is made of the library crates
//! (the store, blocks between daemons, cluster mode) and imports no other service.
//!
//! ```text
//!  lib.rs       start-up and shutdown (run → serve), the listeners, registration in etcd
//!  config.rs    every setting declared once (flag, file key, default, bound, docs row)
//!  server.rs    the local protocol: a session per connection, the store calls
//!  clients.rs   per-client bounds on the Unix socket
//!  admin.rs     the admin HTTP (/healthz, /readyz, /metrics, /status, /drain, ...)
//!  probes.rs    liveness and readiness on a bounded listener of their own
//!  metrics.rs   /metrics: the store's declared counters, the data port, the sessions
//!  drain.rs     graceful drain
//!  datadir.rs   the data directory and the node generation
//!  limits.rs    the open-file budget
//!  wake.rs      the CPU wake-latency hold
//!  context.rs   what every task shares
//!  status.rs    the admin API's client: `kvd status`, `kvd drain`
//!  keys.rs      `kvd key`: show a node's public key, revoke one in etcd
//! ```

pub use kvd_core::{Error, Result};
pub(crate) use kvd_core::{clock, protocol};
pub(crate) use kvd_store as store;
pub(crate) use kvd_store::pool;

pub mod admin;
pub mod clients;
pub mod config;
pub mod context;
pub mod datadir;
pub mod drain;
pub mod keys;
pub mod limits;
pub mod metrics;
pub mod probes;
pub mod server;
pub mod status;
pub mod wake;

use std::io::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use config::{DaemonConfig, ServeArgs};
/// Blocks between daemons live in their own crate (`kvd-remote`); the daemon wires them up.
pub use kvd_remote::{DEFAULT_DATA_LANES, port as data_port, transfer};

use crate::clock::MonotonicClock;
use crate::pool::PoolConfig;
use crate::store::{Store, StoreConfig};

/// Run `kvd serve` to its end.
pub fn run(args: ServeArgs) -> std::process::ExitCode {
    // with a config file, the settings are the file's keys under the command line's flags
    let settings = match &args.config {
        None => Ok(args),
        Some(_) => ServeArgs::from_cli(
            std::env::args_os()
                .skip(1)
                .skip_while(|a| a != "serve")
                .skip(1),
        ),
    };
    let config = match settings.and_then(|s| DaemonConfig::resolve(&s)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvd serve: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    if config.settings.check_config {
        match serde_json::to_string_pretty(&config) {
            Ok(text) => println!("{text}"),
            Err(e) => {
                eprintln!("kvd serve --check-config: {e}");
                return std::process::ExitCode::from(1);
            }
        }
        eprintln!("kvd serve --check-config: the settings are valid (nothing was started)");
        return std::process::ExitCode::SUCCESS;
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.settings.threads)
        .thread_name("kvd")
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvd serve: starting the runtime: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    let result = rt.block_on(serve(config));
    // Connection tasks may still be parked on sockets; do not wait for them.
    rt.shutdown_background();
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvd serve: {e}");
            std::process::ExitCode::from(1)
        }
    }
}

/// Start everything, serve until a drain ends.
async fn serve(config: DaemonConfig) -> Result<()> {
    let signals = DrainSignals::install()?;
    let budget = fd_budget(&config)?;
    let datadir = datadir::DataDir::open(&config.settings.data_dir)?;
    let generation = datadir.generation();
    let clock = Arc::new(MonotonicClock::new());
    let store = open_store(&config, generation, clock.clone())?;
    // The data port before the socket: a bad secret file is a start-up error that leaves
    // nothing bound behind.
    let data_port = match &config.data_port {
        Some(dp) => Some(data_port::DataPort::start(
            dp,
            config.settings.node_id,
            &store,
        )?),
        None => None,
    };
    // Before the socket too: a device kvd may not write is a start-up error.
    let mut daemon_metrics = metrics::Metrics::new(store.clone());
    let wake = match config.cpu_wake {
        Some(w) => Some(Arc::new(wake::WakeHold::open(
            std::path::Path::new(wake::DEVICE),
            w.latency_us,
            Duration::from_millis(w.hold_ms),
            daemon_metrics.cpu_wake.clone(),
        )?)),
        None => None,
    };
    let listeners = Listeners::bind(&config).await?;
    let (shutdown, _) = tokio::sync::watch::channel(false);
    let config_peers = config.peers;
    if let Some(dp) = &data_port {
        daemon_metrics = daemon_metrics.with_data_port(dp.clone());
    }
    let registry = config
        .cluster
        .clone()
        .map(|c| Arc::new(kvd_cluster::EtcdRegistry::new(c, config.settings.node_id)));
    let membership = match &registry {
        Some(r) => r.membership(),
        None => Arc::new(kvd_cluster::Membership::embedded(config.settings.node_id)),
    };
    if let Some(dp) = &data_port {
        let m: Arc<dyn kvd_remote::Membership> = membership.clone();
        dp.follow(&m);
    }
    let d = Arc::new(context::Daemon {
        cluster: membership,
        metrics: daemon_metrics,
        data_port,
        store,
        clock,
        config,
        drain: drain::DrainState::default(),
        shutdown,
        started: Instant::now(),
        admin_addr: listeners.admin_addr,
        clients: clients::Clients::new(config_peers),
        wake,
    });
    if let Some(w) = &d.wake {
        tokio::spawn(wake::release_when_quiet(w.clone(), d.shutdown.subscribe()));
    }
    tokio::spawn(server::accept_loop(d.clone(), listeners.socket));
    tokio::spawn(server::reaper(d.clone()));
    tokio::spawn(admin::serve(d.clone(), listeners.admin, budget));
    let probe_addr = listeners.probe.as_ref().and_then(|p| p.local_addr().ok());
    if let Some(p) = listeners.probe {
        tokio::spawn(probes::serve(d.clone(), p));
    }
    let datadir = Arc::new(std::sync::Mutex::new(datadir));
    let registry_task = registry.map(|r| register(&d, r, Arc::clone(&datadir)));
    announce(&d, generation, probe_addr);
    wait_for_drain(&d, signals).await?;
    // withdraw from the cluster before the drain stops serving (bounded: etcd may be away)
    if let Some((stop, task)) = registry_task {
        let _ = stop.send(true);
        let _ = tokio::time::timeout(Duration::from_secs(3), task).await;
    }
    drain::run(&d).await;
    let _ = std::fs::remove_file(&d.config.socket);
    drop(datadir);
    Ok(())
}

/// The block store on a pool as `config` says, at this start's generation, on `clock`.
fn open_store(
    config: &DaemonConfig,
    generation: u64,
    clock: Arc<MonotonicClock>,
) -> Result<Arc<Store>> {
    let pool = PoolConfig {
        huge_pages: config.huge_pages,
        ..PoolConfig::with_total(config.page_bytes, config.pool_bytes)
    };
    let mut sc = StoreConfig::new(pool);
    sc.node_generation = generation;
    sc.max_sessions = config.settings.max_sessions;
    sc.max_batch = config.settings.max_batch;
    sc.verify_supplied_checksums = config.settings.verify_supplied_checksums;
    sc.event_log_capacity = config.settings.event_log_capacity;
    let store = Arc::new(Store::new(sc, clock)?);
    // Clients map the memfd read-write; sealing it stops any of them from shrinking it under
    // the daemon's own mapping (which would fault the daemon).
    if let Err(e) = rustix::fs::fcntl_add_seals(
        store.pool_fd(),
        rustix::fs::SealFlags::SHRINK | rustix::fs::SealFlags::GROW | rustix::fs::SealFlags::SEAL,
    ) {
        tracing::warn!(error = %e, "could not seal the pool memfd against resizing");
    }
    Ok(store)
}

/// The daemon's listeners: the local protocol's socket, the admin port, the probes' own.
struct Listeners {
    socket: tokio::net::UnixListener,
    admin: tokio::net::TcpListener,
    admin_addr: std::net::SocketAddr,
    probe: Option<tokio::net::TcpListener>,
}

impl Listeners {
    async fn bind(config: &DaemonConfig) -> Result<Listeners> {
        let socket = server::bind_socket(&config.socket, config.settings.socket_group.as_deref())?;
        let socket = tokio::net::UnixListener::from_std(socket)
            .map_err(|e| Error::Io(format!("registering the socket: {e}")))?;
        let addr = config.settings.admin_listen;
        let admin = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| Error::Io(format!("binding the admin address {addr}: {e}")))?;
        let admin_addr = admin.local_addr().map_err(|e| Error::Io(e.to_string()))?;
        let probe = match config.settings.probe_listen {
            Some(addr) => Some(
                tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(|e| Error::Io(format!("binding the probe address {addr}: {e}")))?,
            ),
            None => None,
        };
        Ok(Listeners {
            socket,
            admin,
            admin_addr,
            probe,
        })
    }
}

/// Cluster mode: register this node in etcd and keep it registered (a new generation at every
/// re-registration); the stop switch and the task.
fn register(
    d: &Arc<context::Daemon>,
    r: Arc<kvd_cluster::EtcdRegistry>,
    datadir: Arc<std::sync::Mutex<datadir::DataDir>>,
) -> (
    tokio::sync::watch::Sender<bool>,
    tokio::task::JoinHandle<()>,
) {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let dd = d.clone();
    let data_addr = d.data_port.as_ref().map(|dp| dp.local_addr());
    let registration = move || kvd_cluster::Registration {
        node_id: dd.config.settings.node_id,
        generation: dd
            .data_port
            .as_ref()
            .map_or(dd.store.node_generation(), |dp| dp.generation()),
        data_addr: data_addr.map_or_else(String::new, |a| a.to_string()),
        admin_addr: dd.admin_addr.to_string(),
        capacity_bytes: dd.store.pool_bytes(),
        free_bytes: u64::from(dd.store.stats().accounting.free) * dd.store.page_size(),
        node_key: dd
            .data_port
            .as_ref()
            .and_then(|dp| dp.public_key())
            .map_or_else(String::new, |k| k.to_string()),
    };
    let dd = d.clone();
    let advance = move || {
        let next = datadir.lock().unwrap_or_else(|p| p.into_inner()).advance();
        match (next, &dd.data_port) {
            (Ok(g), Some(dp)) => dp.set_generation(g),
            (Err(e), _) => tracing::error!(error = %e, "could not advance the node generation"),
            _ => {}
        }
    };
    let task = tokio::spawn(async move { r.run(registration, advance, stop_rx).await });
    (stop_tx, task)
}

/// The start-up log line, and one machine-readable line on stdout for scripts and tests (the
/// admin port may have been 0).
fn announce(d: &context::Daemon, generation: u64, probe_addr: Option<std::net::SocketAddr>) {
    let data_addr = d.data_port.as_ref().map(|dp| dp.local_addr());
    tracing::info!(
        node_generation = generation,
        socket = %d.config.socket.display(),
        admin = %d.admin_addr,
        pool_bytes = d.store.pool_bytes(),
        page_bytes = d.store.page_size(),
        backing = ?d.store.backing(),
        data_dir = %d.config.settings.data_dir.display(),
        node_id = d.config.settings.node_id,
        data_port = %data_addr.map_or_else(|| "off (no --cluster-secret-file)".to_string(), |a| a.to_string()),
        "kvd serving"
    );
    let mut out = std::io::stdout().lock();
    let data = data_addr.map_or_else(String::new, |a| format!(" data={a}"));
    let probes = probe_addr.map_or_else(String::new, |a| format!(" probes={a}"));
    let _ = writeln!(
        out,
        "kvd ready generation={generation} socket={} admin={}{data}{probes}",
        d.config.socket.display(),
        d.admin_addr
    );
    let _ = out.flush();
}

/// SIGTERM and SIGINT, caught from before the daemon says it is ready: a signal that arrives
/// right after the ready line must start a drain, not kill the process.
struct DrainSignals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl DrainSignals {
    fn install() -> Result<DrainSignals> {
        use tokio::signal::unix::{SignalKind, signal};
        let e = |e: std::io::Error| Error::Io(format!("installing signal handlers: {e}"));
        Ok(DrainSignals {
            term: signal(SignalKind::terminate()).map_err(e)?,
            int: signal(SignalKind::interrupt()).map_err(e)?,
        })
    }
}

/// Raise the open-file limit to the hard limit and share it out; log the limits in force.
fn fd_budget(config: &DaemonConfig) -> Result<limits::FdBudget> {
    let nofile = limits::raise_nofile();
    let b = limits::FdBudget::plan(
        nofile,
        config.settings.max_sessions,
        config.settings.max_pending_connections,
        config.settings.admin_max_connections,
    )?;
    if b.admin_max_connections < config.settings.admin_max_connections {
        tracing::warn!(
            configured = config.settings.admin_max_connections,
            in_force = b.admin_max_connections,
            nofile_soft = b.nofile_soft,
            "the open-file limit is short: fewer admin connections than configured (raise \
             `ulimit -Hn` / LimitNOFILE=)"
        );
    }
    tracing::info!(
        nofile_soft = b.nofile_soft,
        nofile_hard = b.nofile_hard,
        data_socket_fds = b.data_socket_fds,
        other_fds_reserved = b.reserved_fds,
        max_sessions = config.settings.max_sessions,
        max_pending_connections = config.settings.max_pending_connections,
        handshake_timeout_ms = config.settings.handshake_timeout_ms,
        admin_max_connections = b.admin_max_connections,
        admin_refusal_fds = b.admin_refusal_fds,
        admin_header_timeout_ms = config.settings.admin_header_timeout_ms,
        admin_idle_timeout_ms = config.settings.admin_idle_timeout_ms,
        "limits in force"
    );
    Ok(b)
}

async fn wait_for_drain(d: &context::Daemon, signals: DrainSignals) -> Result<()> {
    let DrainSignals { mut term, mut int } = signals;
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: draining"),
        _ = int.recv() => tracing::info!("SIGINT: draining"),
        _ = d.drain.requested() => {}
    }
    Ok(())
}
