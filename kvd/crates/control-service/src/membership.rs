//! `kvd control --etcd`: the control shim fed by cluster membership.
//!
//! The nodes' registrations (`<prefix>/nodes/`, written by `kvd serve --etcd`) become worker
//! events: a node that appears is `WorkerJoined` (with its pool as capacity); one whose
//! registration disappears (its lease expired, or it withdrew) is `WorkersFailed`, logged with
//! how long it had been silent; one that comes back with a higher generation than the one seen
//! is `WorkerRecovered` (a restart). Generations fence the events: a registration of a lower
//! generation than the one seen is ignored (counted). The view is rebuilt from a full read on
//! every (re)connect and reconciled against what the controller knows (workers it has that are
//! not registered fail; registered ones it lacks join), never from missed deltas.
//!
//! The controller's snapshot is written to `<prefix>/control/snapshot` after every change
//! (at most once a second) by the elected leader among the replicas (replicas.rs), so a
//! restarted `kvd control` resumes from it; the requests it restores keep their epochs, so
//! none is planned twice. (A `kvd control` with a front starts fresh instead: its requests are
//! taken over from their streams' records.)

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::control::{ControllerSnapshot, Event, WorkerId};
use crate::{Error, Result};
use kvd_cluster::{Etcd, NodeChange, Registration};
use kvd_front::Hub;

use crate::replicas::Replicas;

/// etcd authentication and TLS, as [`kvd_cluster::EtcdArgs::security`] reads them.
pub type Security = Arc<kvd_cluster::EtcdSecurity>;

/// The bound on connecting to etcd and on each call.
const ETCD_TIMEOUT: Duration = Duration::from_secs(5);

fn snapshot_key(prefix: &str) -> String {
    format!("{prefix}/control/snapshot")
}

/// The last snapshot kept in etcd, if any.
///
/// # Errors
/// [`Error::Unavailable`] when etcd cannot be reached (within 5 s); [`Error::Protocol`] for a
/// snapshot that does not parse.
pub async fn load_snapshot(
    endpoints: &[String],
    prefix: &str,
    security: &Security,
) -> Result<Option<ControllerSnapshot>> {
    let mut etcd = Etcd::connect(endpoints, security, ETCD_TIMEOUT).await?;
    match etcd.get(&snapshot_key(prefix)).await? {
        None => Ok(None),
        Some(v) => serde_json::from_slice(&v)
            .map(Some)
            .map_err(|e| Error::Protocol(format!("the snapshot in etcd: {e}"))),
    }
}

/// What this service has seen of each node.
#[derive(Debug, Default)]
struct Seen {
    /// node → (generation, when its registration was last written or seen)
    nodes: BTreeMap<u64, (u64, Instant)>,
    /// Events ignored because they named an older generation than the one seen.
    fenced: u64,
}

/// Feed `shared` from the membership in etcd and keep its snapshot there, until the process
/// ends (reconnecting with a bounded backoff).
pub async fn run(
    endpoints: Vec<String>,
    prefix: String,
    security: Security,
    shared: Arc<Hub>,
    replicas: Option<Arc<Replicas>>,
) {
    let mut seen = Seen::default();
    let mut backoff = Duration::from_millis(100);
    let leads = move || replicas.as_ref().is_none_or(|r| r.is_leader());
    loop {
        if let Err(e) = session(&endpoints, &prefix, &security, &shared, &mut seen, &leads).await {
            tracing::warn!(error = %e, "control: etcd session ended; reconnecting");
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

fn worker(node: u64) -> Option<WorkerId> {
    WorkerId::try_from(node).ok()
}

fn apply(shared: &Hub, e: &Event) {
    if let Err(err) = shared.apply(e) {
        tracing::warn!(event = ?e, error = %err, "control: a membership event was refused");
    } else {
        tracing::info!(event = ?e, "control: membership event");
    }
}

/// A registration was written: join, recover, or (same generation) nothing.
fn registered(shared: &Hub, seen: &mut Seen, r: &Registration) {
    let Some(w) = worker(r.node_id) else { return };
    shared.node_registered(r.node_id, &r.admin_addr);
    if !shared.in_pool(r.node_id) {
        return; // a P/D prefill node: its admin address only
    }
    match seen.nodes.get(&r.node_id).copied() {
        Some((g, _)) if r.generation < g => {
            seen.fenced += 1;
            tracing::warn!(
                node = r.node_id,
                generation = r.generation,
                seen = g,
                "control: an older generation's registration, ignored"
            );
            return;
        }
        Some((g, _)) if r.generation == g => {}
        Some(_) => apply(shared, &Event::WorkerRecovered { worker: w }),
        None => {
            let known = shared.load().get(w).map(|l| l.phase);
            match known {
                Some(crate::control::WorkerPhase::Failed) => {
                    apply(shared, &Event::WorkerRecovered { worker: w })
                }
                Some(_) => {}
                None => apply(
                    shared,
                    &Event::WorkerJoined {
                        worker: w,
                        capacity_bytes: r.capacity_bytes,
                    },
                ),
            }
        }
    }
    seen.nodes.insert(r.node_id, (r.generation, Instant::now()));
}

/// A registration disappeared: the node failed.
fn gone(shared: &Hub, seen: &mut Seen, node: u64) {
    let Some(w) = worker(node) else { return };
    shared.node_gone(node);
    if !shared.in_pool(node) {
        return;
    }
    let silent = seen.nodes.get(&node).map(|(_, at)| at.elapsed());
    tracing::info!(
        node,
        silent_ms = silent.map(|d| d.as_millis() as u64),
        "control: a node's registration is gone"
    );
    apply(shared, &Event::WorkersFailed { workers: vec![w] });
    // keep its generation: only a higher one is a recovery
    if let Some(e) = seen.nodes.get_mut(&node) {
        e.1 = Instant::now();
    }
}

async fn session(
    endpoints: &[String],
    prefix: &str,
    security: &Security,
    shared: &Arc<Hub>,
    seen: &mut Seen,
    leads: &(dyn Fn() -> bool + Send + Sync),
) -> Result<()> {
    let mut etcd = Etcd::connect(endpoints, security, ETCD_TIMEOUT).await?;
    let (registered_now, mut watch) = etcd.watch_nodes(prefix).await?;
    // reconcile from the full read: what the controller holds as live but etcd does not fails
    let live: Vec<WorkerId> = registered_now
        .iter()
        .filter_map(|r| worker(r.node_id))
        .collect();
    let lost: Vec<WorkerId> = shared
        .load()
        .iter()
        .filter(|l| l.phase != crate::control::WorkerPhase::Failed && !live.contains(&l.id))
        .map(|l| l.id)
        .collect();
    if !lost.is_empty() {
        apply(shared, &Event::WorkersFailed { workers: lost });
    }
    for r in &registered_now {
        registered(shared, seen, r);
    }
    let mut last_written = String::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            changes = watch.next() => {
                for c in changes? {
                    match c {
                        NodeChange::Registered(r) => registered(shared, seen, &r),
                        NodeChange::Withdrawn(node) => gone(shared, seen, node),
                    }
                }
            }
            _ = tick.tick(), if leads() => {
                // the snapshot, when it changed (one write a second at most), by the leader
                // alone: one writer however many replicas run
                let snap = serde_json::to_string(&shared.snapshot())
                    .map_err(|e| Error::Protocol(e.to_string()))?;
                if snap != last_written {
                    etcd.put(&snapshot_key(prefix), snap.clone().into_bytes()).await?;
                    last_written = snap;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::{ControlConfig, Controller, WorkerPhase};
    use kvd_core::clock::ManualClock;

    fn hub() -> Arc<Hub> {
        let controller = Controller::new(ControlConfig::default()).unwrap();
        Hub::new(controller, ManualClock::new(0), 0)
    }

    fn reg(node_id: u64, generation: u64) -> Registration {
        Registration {
            node_id,
            generation,
            data_addr: format!("127.0.0.1:{}", 7000 + node_id),
            admin_addr: format!("127.0.0.1:{}", 7100 + node_id),
            capacity_bytes: 1 << 30,
            free_bytes: 1 << 30,
            node_key: String::new(),
        }
    }

    fn phase(h: &Hub, w: u32) -> Option<WorkerPhase> {
        h.load().get(w).map(|l| l.phase)
    }

    #[test]
    fn a_new_node_joins_with_its_pool_as_capacity_and_its_admin_address() {
        let h = hub();
        let mut seen = Seen::default();
        registered(&h, &mut seen, &reg(1, 5));
        assert_eq!(phase(&h, 1), Some(WorkerPhase::FullService));
        assert_eq!(h.node_admin(1).as_deref(), Some("127.0.0.1:7101"));
        // the same generation again (a refreshed registration) changes nothing
        registered(&h, &mut seen, &reg(1, 5));
        assert_eq!(phase(&h, 1), Some(WorkerPhase::FullService));
        assert_eq!(seen.fenced, 0);
    }

    #[test]
    fn a_gone_node_fails_and_only_a_higher_generation_brings_it_back() {
        let h = hub();
        let mut seen = Seen::default();
        registered(&h, &mut seen, &reg(2, 7));
        gone(&h, &mut seen, 2);
        assert_eq!(phase(&h, 2), Some(WorkerPhase::Failed));
        assert_eq!(h.node_admin(2), None);
        // a late registration of an older incarnation is fenced: the worker stays failed
        registered(&h, &mut seen, &reg(2, 6));
        assert_eq!(phase(&h, 2), Some(WorkerPhase::Failed));
        assert_eq!(seen.fenced, 1);
        // the restarted node (a higher generation) recovers
        registered(&h, &mut seen, &reg(2, 8));
        assert_ne!(phase(&h, 2), Some(WorkerPhase::Failed));
    }

    #[test]
    fn a_node_outside_the_pool_is_reachable_but_never_a_worker() {
        let h = hub();
        h.keep_outside_the_pool([3]);
        let mut seen = Seen::default();
        registered(&h, &mut seen, &reg(3, 1));
        registered(&h, &mut seen, &reg(4, 1));
        assert_eq!(
            phase(&h, 3),
            None,
            "a prefill node neither serves nor holds"
        );
        assert_eq!(phase(&h, 4), Some(WorkerPhase::FullService));
        assert_eq!(h.node_admin(3).as_deref(), Some("127.0.0.1:7103"));
        gone(&h, &mut seen, 3);
        assert_eq!(h.node_admin(3), None);
        assert_eq!(phase(&h, 3), None);
    }

    #[test]
    fn node_ids_past_the_worker_id_range_are_ignored() {
        let h = hub();
        let mut seen = Seen::default();
        registered(&h, &mut seen, &reg(u64::from(u32::MAX) + 1, 1));
        assert!(h.load().iter().next().is_none());
        assert!(seen.nodes.is_empty());
    }
}
