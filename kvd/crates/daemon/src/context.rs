//! What every task of the daemon shares: the store, the settings, the counters, the drain
//! state, the client bounds, the data port and the membership view. Built once by
//! `serve` (in `lib.rs`), handed to the Unix-socket server, the admin HTTP, the probes, the drain
//! and the reaper as an `Arc<Daemon>`.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::watch;

use crate::clock::MonotonicClock;
use crate::store::Store;

use super::clients::Clients;
use super::config::DaemonConfig;
use super::drain::DrainState;
use super::metrics::Metrics;

/// Everything the daemon's tasks share.
#[derive(Debug)]
pub struct Daemon {
    /// The block store.
    pub store: Arc<Store>,
    /// The store's clock.
    pub clock: Arc<MonotonicClock>,
    /// The resolved configuration.
    pub config: DaemonConfig,
    /// The daemon's counters and histograms.
    pub metrics: Metrics,
    /// Drain state.
    pub drain: DrainState,
    /// Set to true to close every connection.
    pub shutdown: watch::Sender<bool>,
    /// When the daemon started.
    pub started: Instant,
    /// The admin address actually bound.
    pub admin_addr: std::net::SocketAddr,
    /// Per-process and per-uid connection counts.
    pub clients: Arc<Clients>,
    /// The data port (the transfer engine), when a cluster secret is configured.
    pub data_port: Option<Arc<super::data_port::DataPort>>,
    /// Cluster membership (embedded: this node alone).
    pub cluster: Arc<kvd_cluster::Membership>,
    /// The CPU wake-latency request held while clients call (`--cpu-wake-latency-us`).
    pub wake: Option<Arc<super::wake::WakeHold>>,
}
