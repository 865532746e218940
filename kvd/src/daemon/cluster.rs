//! Cluster membership: which nodes are alive, and this node's registration among them.
//!
//! Two registries. **Embedded** (the default): this node alone, peers only from `--peer`; it
//! needs nothing but itself. **etcd** (`--etcd URL[,URL...]`): the node registers
//! `(node_id, generation, data address, admin address, capacity, free)` under
//! `<prefix>/nodes/<node_id>` with a TTL lease it keeps alive itself, and keeps a view of every
//! registered node, rebuilt from a full read (with its revision) on every (re)connect and then
//! fed by a watch from that revision; the data port's peer table comes from the view.
//!
//! ```text
//!  connect ─▶ grant lease (TTL) ─▶ put registration ─▶ full read (rev R) ─▶ watch from R+1
//!     ▲                                                                        │
//!     └──── backoff ◀── any error (etcd down, partition, lease gone) ◀─────────┘
//!           keep-alive every TTL/3; no answer for a whole TTL: the lease is lost
//! ```
//!
//! **Lease lost** (no keep-alive answer for a whole TTL): the node is not ready (`/readyz` 503
//! says why), takes no new work from engines or peers, and keeps finishing what it has; it
//! registers again (a new lease) when etcd answers again. The view is kept as it was (routing
//! continues on the last view); a reconnect replaces it from a full read, not from deltas.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// How a node finds its peers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ClusterConfig {
    /// etcd endpoints (`http://HOST:PORT`).
    pub etcd: Vec<String>,
    /// The registration lease's TTL, ms.
    pub lease_ttl_ms: u64,
    /// The key prefix (one cluster per prefix).
    pub prefix: String,
    /// etcd user and password, if etcd has authentication on.
    #[serde(skip)]
    pub auth: Option<(String, String)>,
    /// TLS to etcd: the CA's PEM, and this node's certificate and key PEMs if etcd wants a
    /// client certificate.
    #[serde(skip)]
    pub tls: Option<EtcdTls>,
}

/// etcd user and password, and TLS material, as [`etcd_security`] reads them.
pub type EtcdSecurity = (Option<(String, String)>, Option<EtcdTls>);

/// TLS material for etcd (read at start; the endpoints are then `https://`).
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdTls {
    /// The CA certificate(s) that sign etcd's certificate, PEM.
    pub ca_pem: Vec<u8>,
    /// This node's client certificate and key, PEM.
    pub identity_pem: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdTls")
            .field("client_certificate", &self.identity_pem.is_some())
            .finish_non_exhaustive()
    }
}

/// A file that must be readable by its owner only (a password, a key); its bytes.
fn owner_only(p: &std::path::Path, what: &str) -> Result<Vec<u8>> {
    use std::os::unix::fs::PermissionsExt;
    let shown = p.display();
    let meta =
        std::fs::metadata(p).map_err(|e| Error::InvalidArgument(format!("{what} {shown}: {e}")))?;
    if meta.permissions().mode() & 0o077 != 0 {
        return Err(Error::InvalidArgument(format!(
            "{what} {shown} is readable by others; `chmod 600 {shown}`"
        )));
    }
    std::fs::read(p).map_err(|e| Error::InvalidArgument(format!("{what} {shown}: {e}")))
}

/// How to reach etcd: one flag group for `kvd serve` and `kvd control` (the same names, the
/// same checks). `kvd serve`'s config file has the same keys.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct EtcdArgs {
    /// Cluster mode: etcd endpoints, comma-separated (`http://10.0.0.9:2379,...`). `kvd serve`
    /// registers the node there under a TTL lease and takes its peers from what is registered
    /// (needs --cluster-secret-file; without --etcd the node is on its own, peers only from
    /// --peer); `kvd control` follows the nodes' registrations as worker events and keeps its
    /// snapshot there (`<prefix>/control/snapshot`), from which a restarted one resumes.
    #[arg(long, value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// The key prefix of this cluster in etcd [default: /kvd].
    #[arg(long)]
    pub etcd_prefix: Option<String>,
    /// etcd user, when etcd has authentication on (with --etcd-password-file).
    #[arg(long)]
    pub etcd_user: Option<String>,
    /// A file holding the etcd user's password (readable by its owner only).
    #[arg(long)]
    pub etcd_password_file: Option<std::path::PathBuf>,
    /// TLS to etcd: the CA certificate (PEM) that signs etcd's (use https:// endpoints).
    #[arg(long)]
    pub etcd_ca_file: Option<std::path::PathBuf>,
    /// TLS to etcd: this node's client certificate (PEM), when etcd asks for one.
    #[arg(long)]
    pub etcd_cert_file: Option<std::path::PathBuf>,
    /// TLS to etcd: the client certificate's key (PEM, readable by its owner only).
    #[arg(long)]
    pub etcd_key_file: Option<std::path::PathBuf>,
}

impl EtcdArgs {
    /// Whether cluster mode is on (endpoints given).
    pub fn is_on(&self) -> bool {
        !self.etcd.is_empty()
    }

    /// The cluster's key prefix, without a trailing slash.
    pub fn prefix(&self) -> String {
        self.etcd_prefix
            .as_deref()
            .unwrap_or("/kvd")
            .trim_end_matches('/')
            .to_string()
    }

    /// Authentication and TLS from the files named ([`etcd_security`]).
    ///
    /// # Errors
    /// As [`etcd_security`].
    pub fn security(&self) -> Result<EtcdSecurity> {
        etcd_security(
            &self.etcd,
            self.etcd_user.clone(),
            self.etcd_password_file.clone(),
            self.etcd_ca_file.clone(),
            self.etcd_cert_file.clone(),
            self.etcd_key_file.clone(),
        )
    }
}

/// Authentication and TLS for etcd from the files named (all optional; user with password
/// file, certificate with key, and a client certificate only with a CA; with a CA every
/// endpoint must be `https://`).
///
/// # Errors
/// [`Error::InvalidArgument`] for an incomplete pair, an unreadable file, a password or key
/// file readable by others, or a plain endpoint with TLS.
pub fn etcd_security(
    endpoints: &[String],
    user: Option<String>,
    password_file: Option<std::path::PathBuf>,
    ca_file: Option<std::path::PathBuf>,
    cert_file: Option<std::path::PathBuf>,
    key_file: Option<std::path::PathBuf>,
) -> Result<EtcdSecurity> {
    let auth = match (user, password_file) {
        (Some(u), Some(p)) => {
            let pw = String::from_utf8_lossy(&owner_only(&p, "etcd password file")?)
                .trim_end_matches(['\n', '\r'])
                .to_string();
            Some((u, pw))
        }
        (None, None) => None,
        _ => {
            return Err(Error::InvalidArgument(
                "--etcd-user and --etcd-password-file go together".into(),
            ));
        }
    };
    let read = |p: &std::path::Path| {
        std::fs::read(p).map_err(|e| Error::InvalidArgument(format!("{}: {e}", p.display())))
    };
    let tls = match (ca_file, cert_file, key_file) {
        (None, None, None) => None,
        (Some(ca), cert, key) => {
            let identity_pem = match (cert, key) {
                (Some(c), Some(k)) => Some((read(&c)?, owner_only(&k, "etcd client key")?)),
                (None, None) => None,
                _ => {
                    return Err(Error::InvalidArgument(
                        "--etcd-cert-file and --etcd-key-file go together".into(),
                    ));
                }
            };
            if endpoints.iter().any(|u| !u.starts_with("https://")) {
                return Err(Error::InvalidArgument(
                    "with --etcd-ca-file every --etcd endpoint is https://".into(),
                ));
            }
            Some(EtcdTls {
                ca_pem: read(&ca)?,
                identity_pem,
            })
        }
        _ => {
            return Err(Error::InvalidArgument(
                "a client certificate for etcd needs --etcd-ca-file too".into(),
            ));
        }
    };
    Ok((auth, tls))
}

/// The connection options for `config`'s etcd (timeouts, auth, TLS).
pub fn connect_options(
    auth: Option<&(String, String)>,
    tls: Option<&EtcdTls>,
    timeout: Duration,
) -> etcd_client::ConnectOptions {
    let mut opts = etcd_client::ConnectOptions::new()
        .with_connect_timeout(timeout)
        .with_timeout(timeout);
    if let Some((user, password)) = auth {
        opts = opts.with_user(user.clone(), password.clone());
    }
    if let Some(t) = tls {
        let mut tls = etcd_client::TlsOptions::new()
            .ca_certificate(etcd_client::Certificate::from_pem(&t.ca_pem));
        if let Some((cert, key)) = &t.identity_pem {
            tls = tls.identity(etcd_client::Identity::from_pem(cert, key));
        }
        opts = opts.with_tls(tls);
    }
    opts
}

/// One node's registration, as etcd holds it (JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    /// The node's id.
    pub node_id: u64,
    /// Its incarnation.
    pub generation: u64,
    /// Its data port.
    pub data_addr: String,
    /// Its admin HTTP.
    pub admin_addr: String,
    /// Pool bytes.
    pub capacity_bytes: u64,
    /// Free pool bytes when it last wrote its registration.
    pub free_bytes: u64,
}

/// What `/status` shows of membership.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ClusterReport {
    /// `embedded` or `etcd`.
    pub registry: String,
    /// Whether this node holds a live registration lease (always true when embedded).
    pub lease_held: bool,
    /// Why not, when it does not.
    pub lease_problem: String,
    /// The etcd revision the view is at.
    pub revision: i64,
    /// The registered nodes, this one included.
    pub nodes: Vec<Registration>,
    /// Times this node registered (1 + re-registrations after a lost lease or etcd outage).
    pub registrations: u64,
    /// Times the view was rebuilt from a full read.
    pub full_reads: u64,
}

/// The membership view, shared by the data port (its peer table), `/readyz` and `/status`.
pub struct Membership {
    registry: &'static str,
    me: u64,
    view: RwLock<BTreeMap<u64, Registration>>,
    revision: AtomicI64,
    lease_held: AtomicBool,
    problem: RwLock<String>,
    registrations: AtomicU64,
    full_reads: AtomicU64,
    /// Called with the peers (every node but this one) whenever the view changes.
    on_change: RwLock<Option<PeerSink>>,
}

impl std::fmt::Debug for Membership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Membership")
            .field("registry", &self.registry)
            .field("me", &self.me)
            .field("lease_held", &self.lease_held())
            .finish_non_exhaustive()
    }
}

/// What is told of the peers when the view changes.
pub use kvd_remote::PeerSink;

impl kvd_remote::Membership for Membership {
    fn lease_held(&self) -> bool {
        Membership::lease_held(self)
    }
    fn problem(&self) -> String {
        Membership::problem(self)
    }
    fn fences(&self) -> bool {
        Membership::fences(self)
    }
    fn generation_of(&self, node: u64) -> Option<u64> {
        Membership::generation_of(self, node)
    }
    fn on_change(&self, sink: PeerSink) {
        Membership::on_change(self, sink);
    }
}

impl Membership {
    /// The embedded registry: this node alone, always holding its "lease".
    pub fn embedded(me: u64) -> Membership {
        Membership::new("embedded", me, true)
    }

    fn new(registry: &'static str, me: u64, held: bool) -> Membership {
        Membership {
            registry,
            me,
            view: RwLock::new(BTreeMap::new()),
            revision: AtomicI64::new(0),
            lease_held: AtomicBool::new(held),
            problem: RwLock::new(if held {
                String::new()
            } else {
                "not registered yet".into()
            }),
            registrations: AtomicU64::new(0),
            full_reads: AtomicU64::new(0),
            on_change: RwLock::new(None),
        }
    }

    /// Whether the node is in cluster mode (registered in etcd), not on its own.
    pub fn is_cluster_mode(&self) -> bool {
        self.registry != "embedded"
    }

    /// Whether this node may take new work: it holds its registration lease (always true
    /// when embedded).
    pub fn lease_held(&self) -> bool {
        self.lease_held.load(Ordering::Acquire)
    }

    /// Why this node does not hold its lease ("" when it does).
    pub fn problem(&self) -> String {
        self.problem
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn set_lease(&self, held: bool, why: &str) {
        *self.problem.write().unwrap_or_else(|p| p.into_inner()) = why.to_string();
        let was = self.lease_held.swap(held, Ordering::AcqRel);
        if was != held {
            if held {
                tracing::info!("registration lease held: taking new work");
            } else {
                tracing::warn!(why, "registration lease lost: not ready, no new work");
            }
        }
    }

    /// Be told of the peers whenever the view changes (and once now).
    pub fn on_change(&self, sink: PeerSink) {
        sink(self.peers());
        *self.on_change.write().unwrap_or_else(|p| p.into_inner()) = Some(sink);
    }

    /// Every registered node but this one, by data address.
    pub fn peers(&self) -> BTreeMap<u64, SocketAddr> {
        self.view
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter(|r| r.node_id != self.me)
            .filter_map(|r| r.data_addr.parse().ok().map(|a| (r.node_id, a)))
            .collect()
    }

    /// Whether this view fences by registration (etcd): a peer must be registered, at the
    /// generation it speaks with, for its transfers to be taken.
    pub fn fences(&self) -> bool {
        self.registry == "etcd"
    }

    /// The registered generation of `node`, if it is registered.
    pub fn generation_of(&self, node: u64) -> Option<u64> {
        self.view
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&node)
            .map(|r| r.generation)
    }

    fn changed(&self) {
        let peers = self.peers();
        if let Some(sink) = self
            .on_change
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            sink(peers);
        }
    }

    fn replace(&self, nodes: BTreeMap<u64, Registration>, revision: i64) {
        *self.view.write().unwrap_or_else(|p| p.into_inner()) = nodes;
        self.revision.store(revision, Ordering::Release);
        self.full_reads.fetch_add(1, Ordering::Relaxed);
        self.changed();
    }

    fn apply(&self, put: Option<Registration>, deleted: Option<u64>, revision: i64) {
        {
            let mut v = self.view.write().unwrap_or_else(|p| p.into_inner());
            if let Some(r) = put {
                v.insert(r.node_id, r);
            }
            if let Some(id) = deleted {
                v.remove(&id);
            }
        }
        self.revision.store(revision, Ordering::Release);
        self.changed();
    }

    /// What `/status` shows.
    pub fn report(&self) -> ClusterReport {
        ClusterReport {
            registry: self.registry.to_string(),
            lease_held: self.lease_held(),
            lease_problem: self.problem(),
            revision: self.revision.load(Ordering::Acquire),
            nodes: self
                .view
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .values()
                .cloned()
                .collect(),
            registrations: self.registrations.load(Ordering::Relaxed),
            full_reads: self.full_reads.load(Ordering::Relaxed),
        }
    }
}

fn node_key(prefix: &str, id: u64) -> String {
    format!("{prefix}/nodes/{id:020}")
}

pub(crate) fn etcd_err(what: &str, e: etcd_client::Error) -> Error {
    Error::Unavailable(format!("etcd {what}: {e}"))
}

/// A change to the registrations, as a watch reports it.
pub(crate) enum NodeChange {
    /// A node registered or refreshed its registration.
    Registered(Registration),
    /// A node's registration is gone (withdrawn, or its lease ran out).
    Withdrawn(u64),
}

/// The registrations under `nodes_prefix` as one read, its revision, and a watch of them from
/// just after it (so that no change falls between the two).
pub(crate) async fn read_and_watch(
    client: &mut etcd_client::Client,
    nodes_prefix: &str,
) -> Result<(
    Vec<Registration>,
    i64,
    etcd_client::Watcher,
    etcd_client::WatchStream,
)> {
    use etcd_client::{GetOptions, WatchOptions};
    let all = client
        .get(nodes_prefix, Some(GetOptions::new().with_prefix()))
        .await
        .map_err(|e| etcd_err("read the nodes", e))?;
    let revision = all.header().map_or(0, |h| h.revision());
    let nodes = all
        .kvs()
        .iter()
        .filter_map(|kv| serde_json::from_slice::<Registration>(kv.value()).ok())
        .collect();
    let (watcher, events) = client
        .watch(
            nodes_prefix,
            Some(
                WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(revision + 1),
            ),
        )
        .await
        .map_err(|e| etcd_err("watch", e))?;
    Ok((nodes, revision, watcher, events))
}

/// What one message of a watch from [`read_and_watch`] says: its revision and the changes
/// (keys or values that are not a registration are skipped).
///
/// # Errors
/// `Unavailable` when the watch failed, ended or was cancelled (start a new session).
pub(crate) fn node_changes(
    message: std::result::Result<Option<etcd_client::WatchResponse>, etcd_client::Error>,
) -> Result<(i64, Vec<NodeChange>)> {
    let w = match message {
        Ok(Some(w)) => w,
        Ok(None) => return Err(Error::Unavailable("the watch ended".into())),
        Err(e) => return Err(etcd_err("watch", e)),
    };
    if w.canceled() {
        return Err(Error::Unavailable("etcd cancelled the watch".into()));
    }
    let revision = w.header().map_or(0, |h| h.revision());
    let changes = w
        .events()
        .iter()
        .filter_map(|e| {
            let kv = e.kv()?;
            match e.event_type() {
                etcd_client::EventType::Put => serde_json::from_slice(kv.value())
                    .ok()
                    .map(NodeChange::Registered),
                etcd_client::EventType::Delete => std::str::from_utf8(kv.key())
                    .ok()
                    .and_then(|k| k.rsplit('/').next())
                    .and_then(|n| n.parse::<u64>().ok())
                    .map(NodeChange::Withdrawn),
            }
        })
        .collect();
    Ok((revision, changes))
}

/// The etcd registry: a membership view fed by etcd, and the task that keeps this node
/// registered.
#[derive(Debug)]
pub struct EtcdRegistry {
    config: ClusterConfig,
    membership: Arc<Membership>,
}

impl EtcdRegistry {
    /// A registry for node `me` (not registered until [`EtcdRegistry::run`] gets through).
    pub fn new(config: ClusterConfig, me: u64) -> EtcdRegistry {
        EtcdRegistry {
            config,
            membership: Arc::new(Membership::new("etcd", me, false)),
        }
    }

    /// The view.
    pub fn membership(&self) -> Arc<Membership> {
        Arc::clone(&self.membership)
    }

    /// Keep `registration()` registered and the view current until `stop` turns true; then
    /// withdraw the registration (delete it and revoke the lease) and return.
    /// A session that ends while the lease may still hold (no keep-alive answer missed for a
    /// whole TTL yet: etcd restarted, a stream broke) is retried at once and the node stays
    /// ready; once a whole TTL passed without an answer the lease counts as lost: the node is
    /// not ready, and its next registration calls `advance` first, so that it re-registers
    /// under a new node generation and no work of the old lease can be taken for the new
    /// one's.
    pub async fn run(
        &self,
        registration: impl Fn() -> Registration,
        advance: impl Fn(),
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) {
        let ttl = Duration::from_millis(self.config.lease_ttl_ms);
        let mut backoff = Duration::from_millis(100);
        let mut answered = Instant::now();
        let mut lost = false;
        while !*stop.borrow() {
            let started = Instant::now();
            if lost {
                advance();
                lost = false;
            }
            match self.session(&registration, &mut answered, &mut stop).await {
                Ok(()) => return,
                Err(e) => {
                    let why = e.to_string();
                    tracing::warn!(error = %why, "etcd session ended; registering again after a backoff");
                    let registered = self.membership.registrations.load(Ordering::Relaxed) > 0;
                    if !registered || answered.elapsed() >= ttl {
                        self.membership.set_lease(false, &why);
                        lost = registered;
                    }
                }
            }
            if started.elapsed() > Duration::from_secs(10) {
                backoff = Duration::from_millis(100);
            }
            // retry at once while the lease may still hold, with a backoff once it is lost
            let wait = if self.membership.lease_held() {
                Duration::from_millis(50)
            } else {
                backoff
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = stop.changed() => {}
            }
            if self.membership.lease_held() && answered.elapsed() >= ttl {
                self.membership.set_lease(
                    false,
                    &format!(
                        "no keep-alive answer from etcd for {} ms (the lease's TTL)",
                        answered.elapsed().as_millis()
                    ),
                );
                lost = true;
            }
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }

    /// One session: connect, register under a fresh lease, read everything, watch, keep the
    /// lease alive. Returns `Ok` when asked to stop (after withdrawing), `Err` on any failure.
    async fn session(
        &self,
        registration: &impl Fn() -> Registration,
        answered: &mut Instant,
        stop: &mut tokio::sync::watch::Receiver<bool>,
    ) -> Result<()> {
        use etcd_client::{Client, PutOptions};
        let ttl = Duration::from_millis(self.config.lease_ttl_ms);
        let opts = connect_options(
            self.config.auth.as_ref(),
            self.config.tls.as_ref(),
            ttl.min(Duration::from_secs(5)),
        );
        let mut client = Client::connect(&self.config.etcd, Some(opts))
            .await
            .map_err(|e| etcd_err("connect", e))?;
        let ttl_s = self.config.lease_ttl_ms.div_ceil(1000).max(1) as i64;
        let lease = client
            .lease_grant(ttl_s, None)
            .await
            .map_err(|e| etcd_err("lease grant", e))?
            .id();
        let key = node_key(&self.config.prefix, self.membership.me);
        let put = |r: Registration| serde_json::to_vec(&r).expect("a registration serializes");
        client
            .put(
                key.clone(),
                put(registration()),
                Some(PutOptions::new().with_lease(lease)),
            )
            .await
            .map_err(|e| etcd_err("register", e))?;
        let (mut keeper, mut answers) = client
            .lease_keep_alive(lease)
            .await
            .map_err(|e| etcd_err("keep-alive", e))?;
        self.membership
            .registrations
            .fetch_add(1, Ordering::Relaxed);
        self.membership.set_lease(true, "");
        *answered = Instant::now();

        // the view: a full read, then a watch from just after its revision
        let prefix = format!("{}/nodes/", self.config.prefix);
        let (nodes, revision, _watcher, mut events) = read_and_watch(&mut client, &prefix).await?;
        self.membership.replace(
            nodes.into_iter().map(|r| (r.node_id, r)).collect(),
            revision,
        );

        let mut beat = tokio::time::interval(ttl / 3);
        beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut refresh = tokio::time::interval(Duration::from_secs(5).max(ttl));
        refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        refresh.tick().await;
        loop {
            tokio::select! {
                _ = beat.tick() => {
                    if answered.elapsed() > ttl {
                        return Err(Error::Unavailable(format!(
                            "no keep-alive answer from etcd for {} ms (the lease's TTL)",
                            answered.elapsed().as_millis()
                        )));
                    }
                    // a keep-alive that cannot be sent is noticed by the TTL check above
                    let _ = tokio::time::timeout(ttl / 3, keeper.keep_alive()).await;
                }
                answer = answers.message() => match answer {
                    Ok(Some(a)) if a.ttl() > 0 => *answered = Instant::now(),
                    Ok(Some(_)) => {
                        return Err(Error::Unavailable("etcd says the lease is gone".into()));
                    }
                    Ok(None) => return Err(Error::Unavailable("the keep-alive stream ended".into())),
                    Err(e) => return Err(etcd_err("keep-alive", e)),
                },
                event = events.message() => {
                    let (rev, changes) = node_changes(event)?;
                    for c in changes {
                        match c {
                            NodeChange::Registered(r) => self.membership.apply(Some(r), None, rev),
                            NodeChange::Withdrawn(id) => self.membership.apply(None, Some(id), rev),
                        }
                    }
                }
                _ = refresh.tick() => {
                    // keep the load figures fresh (bounded: one write per refresh)
                    let _ = client
                        .put(key.clone(), put(registration()), Some(PutOptions::new().with_lease(lease)))
                        .await;
                }
                _ = stop.changed() => {
                    // withdraw before we stop serving
                    let _ = client.delete(key.clone(), None).await;
                    let _ = client.lease_revoke(lease).await;
                    self.membership.set_lease(false, "withdrawn (draining)");
                    return Ok(());
                }
            }
        }
    }
}
