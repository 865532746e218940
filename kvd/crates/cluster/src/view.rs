//! The membership view: every registered node, this node's lease, the keys revoked, and the
//! peer table the data port follows (each registered node's data address, and its public key
//! unless that key is revoked). The embedded registry holds this node alone;
//! [`crate::EtcdRegistry`] feeds the view from etcd.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::RwLock;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::{KeyChange, NodeChange};

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
    /// Its public key (64 hex digits): what its handshakes must prove. Empty in a registration
    /// written by a kvd that had none, which no node then accepts.
    #[serde(default)]
    pub node_key: String,
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
    /// Node keys revoked in the cluster (`kvd key revoke`): no node accepts them.
    pub revoked_keys: Vec<String>,
}

/// The membership view, shared by the data port (its peer table), `/readyz` and `/status`.
pub struct Membership {
    registry: &'static str,
    pub(crate) me: u64,
    view: RwLock<BTreeMap<u64, Registration>>,
    /// Revoked node keys (hex, lowercase).
    revoked: RwLock<BTreeSet<String>>,
    revision: AtomicI64,
    lease_held: AtomicBool,
    problem: RwLock<String>,
    pub(crate) registrations: AtomicU64,
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
pub use kvd_remote::{Peer, PeerSink};

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

    pub(crate) fn new(registry: &'static str, me: u64, held: bool) -> Membership {
        Membership {
            registry,
            me,
            view: RwLock::new(BTreeMap::new()),
            revoked: RwLock::new(BTreeSet::new()),
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

    pub(crate) fn set_lease(&self, held: bool, why: &str) {
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

    /// Every registered node but this one: its data address, and its key unless it has
    /// none, a malformed one or a revoked one.
    pub fn peers(&self) -> BTreeMap<u64, Peer> {
        let revoked = self.revoked.read().unwrap_or_else(|p| p.into_inner());
        self.view
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter(|r| r.node_id != self.me)
            .filter_map(|r| {
                let addr = r.data_addr.parse().ok()?;
                let key = r
                    .node_key
                    .parse::<transport::link::identity::PublicKey>()
                    .ok()
                    .filter(|k| !revoked.contains(&k.to_string()));
                Some((r.node_id, Peer { addr, key }))
            })
            .collect()
    }

    /// Whether `key` (hex) is revoked.
    pub fn is_revoked(&self, key: &str) -> bool {
        self.revoked
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&key.to_ascii_lowercase())
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

    pub(crate) fn replace(&self, nodes: BTreeMap<u64, Registration>, revision: i64) {
        *self.view.write().unwrap_or_else(|p| p.into_inner()) = nodes;
        self.revision.store(revision, Ordering::Release);
        self.full_reads.fetch_add(1, Ordering::Relaxed);
        self.changed();
    }

    /// One change from the watch, at `revision`.
    pub(crate) fn apply(&self, change: NodeChange, revision: i64) {
        {
            let mut v = self.view.write().unwrap_or_else(|p| p.into_inner());
            match change {
                NodeChange::Registered(r) => {
                    v.insert(r.node_id, r);
                }
                NodeChange::Withdrawn(id) => {
                    v.remove(&id);
                }
            }
        }
        self.revision.store(revision, Ordering::Release);
        self.changed();
    }

    /// The revoked keys, from a full read (`replace`) or one watch message.
    pub(crate) fn revoke(&self, change: KeyChange) {
        {
            let mut r = self.revoked.write().unwrap_or_else(|p| p.into_inner());
            match change {
                KeyChange::All(keys) => *r = keys,
                KeyChange::Revoked(k) => {
                    r.insert(k);
                }
                KeyChange::Unrevoked(k) => {
                    r.remove(&k);
                }
            }
            if r.iter().any(|k| Some(k) == self.own_key().as_ref()) {
                tracing::error!(
                    "this node's own key is revoked: no node accepts its connections; make it a \
                     new key (docs/OPERATIONS.md, \"Revoking a node's key\")"
                );
            }
        }
        self.changed();
    }

    fn own_key(&self) -> Option<String> {
        self.view
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&self.me)
            .map(|r| r.node_key.to_ascii_lowercase())
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
            revoked_keys: self
                .revoked
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .cloned()
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    fn reg(node_id: u64, generation: u64, port: u16) -> Registration {
        Registration {
            node_id,
            generation,
            data_addr: format!("127.0.0.1:{port}"),
            admin_addr: format!("127.0.0.1:{}", port + 1),
            capacity_bytes: 1 << 30,
            free_bytes: 1 << 29,
            node_key: transport::link::testing::public_key(node_id).to_string(),
        }
    }

    #[test]
    fn the_peer_table_follows_every_change_and_leaves_this_node_out() {
        let m = Membership::new("etcd", 1, false);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = Arc::clone(&seen);
        m.on_change(Box::new(move |p| s.lock().unwrap().push(p)));
        m.replace([(1, reg(1, 5, 7000)), (2, reg(2, 3, 7100))].into(), 10);
        m.apply(NodeChange::Registered(reg(3, 1, 7200)), 11);
        m.apply(NodeChange::Withdrawn(2), 12);
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 4, "once at subscription, then per change");
        assert!(seen[0].is_empty());
        assert_eq!(seen[1].keys().copied().collect::<Vec<_>>(), [2]);
        assert_eq!(seen[2].keys().copied().collect::<Vec<_>>(), [2, 3]);
        assert_eq!(seen[3].keys().copied().collect::<Vec<_>>(), [3]);
        assert_eq!(m.generation_of(3), Some(1));
        assert_eq!(m.generation_of(2), None);
        let r = m.report();
        assert_eq!((r.revision, r.full_reads, r.nodes.len()), (12, 1, 2));
    }

    #[test]
    fn a_revoked_key_leaves_its_node_in_the_view_without_a_key() {
        let m = Membership::new("etcd", 1, false);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = Arc::clone(&seen);
        m.on_change(Box::new(move |p| s.lock().unwrap().push(p)));
        let mut bad = reg(4, 1, 7400);
        bad.node_key = "not a key".into();
        m.replace(
            [(2, reg(2, 1, 7100)), (3, reg(3, 1, 7200)), (4, bad)].into(),
            5,
        );
        let k3 = reg(3, 1, 0).node_key;
        m.revoke(KeyChange::Revoked(k3.clone()));
        {
            let seen = seen.lock().unwrap();
            let last = seen.last().unwrap();
            assert!(last[&2].key.is_some());
            assert_eq!(last[&3].key, None, "revoked");
            assert_eq!(last[&4].key, None, "malformed");
        }
        assert!(m.is_revoked(&k3.to_uppercase()));
        assert_eq!(m.report().revoked_keys, vec![k3.clone()]);
        m.revoke(KeyChange::Unrevoked(k3));
        assert!(m.peers()[&3].key.is_some());
        m.revoke(KeyChange::All(BTreeSet::new()));
        assert!(m.report().revoked_keys.is_empty());
    }

    #[test]
    fn only_etcd_fences_and_only_a_held_lease_takes_work() {
        let e = Membership::embedded(4);
        assert!(e.lease_held() && !e.fences() && !e.is_cluster_mode());
        let m = Membership::new("etcd", 4, false);
        assert!(!m.lease_held() && m.fences() && m.is_cluster_mode());
        assert_eq!(m.problem(), "not registered yet");
        m.set_lease(true, "");
        assert!(m.lease_held());
        m.set_lease(false, "no keep-alive answer");
        assert_eq!(m.problem(), "no keep-alive answer");
    }
}
