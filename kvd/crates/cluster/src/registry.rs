//! A node's registration in etcd, kept under a lease, and the membership view fed from etcd.
//!
//! ```text
//!  connect ─▶ grant lease (TTL) ─▶ put registration ─▶ full reads (revoked keys, nodes)
//!                                                      ─▶ watches from just after each
//!     ▲                                                                        │
//!     └──── backoff ◀── any error (etcd down, partition, lease gone) ◀─────────┘
//!           keep-alive every TTL/3; no answer for a whole TTL: the lease is lost
//! ```

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::KeyChange;
use crate::etcd::{Etcd, etcd_err, node_key};
use crate::view::{Membership, Registration};
use crate::{ClusterConfig, Error, Result};

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
        use etcd_client::PutOptions;
        let ttl = Duration::from_millis(self.config.lease_ttl_ms);
        let mut etcd = Etcd::connect(
            &self.config.etcd,
            &self.config.security,
            ttl.min(Duration::from_secs(5)),
        )
        .await?;
        let client = &mut etcd.client;
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

        // the view: full reads of the revoked keys and the nodes, then watches from just after
        // their revisions
        let (revoked, mut revocations) = etcd.watch_revoked(&self.config.prefix).await?;
        self.membership.revoke(KeyChange::All(revoked));
        let (nodes, mut watch) = etcd.watch_nodes(&self.config.prefix).await?;
        self.membership.replace(
            nodes.into_iter().map(|r| (r.node_id, r)).collect(),
            watch.revision,
        );
        let client = &mut etcd.client;

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
                changes = watch.next() => {
                    for c in changes? {
                        self.membership.apply(c, watch.revision);
                    }
                }
                changes = revocations.next() => {
                    for c in changes? {
                        self.membership.revoke(c);
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
