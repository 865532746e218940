//! The daemon's `/metrics`, through `prometheus-client` (the official Rust client).
//!
//! Two sources feed one registry:
//!
//! - the daemon's own counters, gauges and per-operation latency histograms, which the server
//!   updates as it works (lock-free atomics inside the client's metric types);
//! - the block store's counts, read once per scrape by `StoreCollector` from
//!   [`Store::stats`], which already keeps them exact behind its lock: mirroring them into
//!   registered metrics would only add a second copy that could drift. Its event counters are
//!   encoded from their one declaration (`kvd_core::counters`: metric name and help each).
//!
//! The output is the OpenMetrics text format, which Prometheus scrapes natively; counters carry
//! the `_total` suffix.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::protocol::OpKind;
use crate::store::{Store, StoreStats};
use strum::IntoEnumIterator;

/// Upper bounds of the latency buckets, seconds (5 µs … 100 ms).
pub const LATENCY_BUCKETS_S: [f64; 14] = [
    5e-6, 10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
    100e-3,
];

pub use kvd_metrics::CONTENT_TYPE;
use kvd_metrics::{counter, gauge};

type OpLabel = [(&'static str, &'static str); 1];

fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS_S)
}

/// Register the per-operation families; their metrics, one of each per operation kind in
/// `OpKind`'s order (indexed by `kind as usize`).
fn register_op_families(r: &mut Registry) -> (Vec<Histogram>, Vec<Counter>, Vec<Counter>) {
    let durations_family =
        Family::<OpLabel, Histogram, fn() -> Histogram>::new_with_constructor(latency_histogram);
    let served_family = Family::<OpLabel, Counter>::default();
    let errors_family = Family::<OpLabel, Counter>::default();
    let labels = |n: &'static str| [("op", n)];
    let durations = OpKind::iter()
        .map(|k| durations_family.get_or_create_owned(&labels(k.into())))
        .collect();
    let served = OpKind::iter()
        .map(|k| served_family.get_or_create_owned(&labels(k.into())))
        .collect();
    let errors = OpKind::iter()
        .map(|k| errors_family.get_or_create_owned(&labels(k.into())))
        .collect();
    r.register(
        "kvd_op_duration_seconds",
        "Time to serve one request, by operation",
        durations_family,
    );
    r.register("kvd_ops", "Requests served, by operation", served_family);
    r.register(
        "kvd_op_errors",
        "Requests answered with an error, by operation",
        errors_family,
    );
    (durations, served, errors)
}

/// The measurements of one operation.
#[derive(Debug)]
pub struct OpMetrics<'a> {
    duration: &'a Histogram,
    served: &'a Counter,
    errors: &'a Counter,
}

impl OpMetrics<'_> {
    /// Record one request that took `us` microseconds.
    pub fn observe(&self, us: u64, ok: bool) {
        self.duration.observe(us as f64 / 1e6);
        self.served.inc();
        if !ok {
            self.errors.inc();
        }
    }
}

/// The daemon's metrics and their registry.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    durations: Vec<Histogram>,
    served: Vec<Counter>,
    errors: Vec<Counter>,
    /// Connections accepted.
    pub connections_accepted: Counter,
    /// Connections dropped at accept because the connection bound was reached.
    pub connections_refused: Counter,
    /// Sessions refused (draining, session bound, bad hello).
    pub sessions_refused: Counter,
    /// Requests answered `Overloaded` because the session had too many in flight.
    pub inflight_rejects: Counter,
    /// Frames that failed to decode (the connection was closed).
    pub protocol_errors: Counter,
    /// Connections refused because one peer process or uid reached its bound.
    pub peer_refusals: Counter,
    /// Blocks whose reader reported a checksum mismatch in its copy.
    pub corrupt_reports: Counter,
    /// Of those, blocks whose daemon-side copy failed too (quarantined).
    pub corrupt_reports_confirmed: Counter,
    /// Sessions open now (connections past the handshake).
    pub sessions_open: Gauge,
    /// Admin HTTP connections given a slot.
    pub admin_connections_accepted: Counter,
    /// Admin HTTP connections refused at the cap (answered `503`, then closed).
    pub admin_connections_refused: Counter,
    /// Admin HTTP connections closed because a request head did not arrive in time.
    pub admin_header_timeouts: Counter,
    /// Admin HTTP connections closed because no byte moved for the idle timeout.
    pub admin_idle_timeouts: Counter,
    /// Admin HTTP connections holding a slot now.
    pub admin_connections_open: Gauge,
    /// Probe-listener connections closed at a bound (in all or per source).
    pub probe_connections_refused: Counter,
    /// Probes answered on the probe listener.
    pub probes_answered: Counter,
    /// Result of the last accounting audit (1 balanced, 0 not).
    pub accounting_balanced: Gauge,
    ready: Gauge,
    draining: Gauge,
    drain_s: Gauge<f64, AtomicU64>,
    cluster_mode: Gauge,
    lease_held: Gauge,
    uptime_s: Gauge<f64, AtomicU64>,
    /// The CPU wake-latency request's figures (`--cpu-wake-latency-us`; 0 while it is off).
    pub cpu_wake: super::wake::WakeMetrics,
}

/// The daemon's state at a scrape, beside its counters.
#[derive(Debug, Clone, Copy, Default)]
pub struct Health {
    /// Ready for new work (not draining, lease held).
    pub ready: bool,
    /// A drain has begun.
    pub draining: bool,
    /// Seconds since the drain began (0 before).
    pub drain_s: f64,
    /// Registered in etcd (not on its own).
    pub cluster_mode: bool,
    /// Holding the registration lease (always when on its own).
    pub lease_held: bool,
    /// Seconds since start.
    pub uptime_s: f64,
}

impl Metrics {
    /// Metrics for a daemon serving `store`.
    pub fn new(store: Arc<Store>) -> Metrics {
        let mut registry = Registry::default();
        let (durations, served, errors) = register_op_families(&mut registry);
        let m = Metrics {
            durations,
            served,
            errors,
            connections_accepted: Counter::default(),
            connections_refused: Counter::default(),
            sessions_refused: Counter::default(),
            inflight_rejects: Counter::default(),
            protocol_errors: Counter::default(),
            peer_refusals: Counter::default(),
            corrupt_reports: Counter::default(),
            corrupt_reports_confirmed: Counter::default(),
            sessions_open: Gauge::default(),
            admin_connections_accepted: Counter::default(),
            admin_connections_refused: Counter::default(),
            admin_header_timeouts: Counter::default(),
            admin_idle_timeouts: Counter::default(),
            admin_connections_open: Gauge::default(),
            probe_connections_refused: Counter::default(),
            probes_answered: Counter::default(),
            accounting_balanced: Gauge::default(),
            ready: Gauge::default(),
            draining: Gauge::default(),
            drain_s: Gauge::default(),
            cluster_mode: Gauge::default(),
            lease_held: Gauge::default(),
            uptime_s: Gauge::default(),
            cpu_wake: super::wake::WakeMetrics::default(),
            registry: Registry::default(),
        };
        m.accounting_balanced.set(1);
        m.register_counters(&mut registry);
        m.register_gauges(&mut registry);
        registry.register_collector(Box::new(StoreCollector {
            store,
            inflight_rejects: m.inflight_rejects.clone(),
            connections_refused: m.connections_refused.clone(),
        }));
        Metrics { registry, ..m }
    }

    /// Register the daemon's own counters.
    fn register_counters(&self, r: &mut Registry) {
        for (name, help, c) in [
            (
                "kvd_connections_accepted",
                "Connections accepted",
                &self.connections_accepted,
            ),
            (
                "kvd_connections_refused",
                "Connections closed at accept (connection bound)",
                &self.connections_refused,
            ),
            (
                "kvd_sessions_refused",
                "Handshakes refused (draining, bounds, bad hello)",
                &self.sessions_refused,
            ),
            (
                "kvd_inflight_rejects",
                "Requests answered Overloaded (in-flight bound)",
                &self.inflight_rejects,
            ),
            (
                "kvd_protocol_errors",
                "Malformed frames (connection closed)",
                &self.protocol_errors,
            ),
            (
                "kvd_peer_refusals",
                "Connections refused at a per-process or per-uid bound",
                &self.peer_refusals,
            ),
            (
                "kvd_corrupt_reports",
                "Blocks a reader reported failing the checksum in its own copy",
                &self.corrupt_reports,
            ),
            (
                "kvd_corrupt_reports_confirmed",
                "Reported blocks whose daemon-side copy failed too (quarantined)",
                &self.corrupt_reports_confirmed,
            ),
            (
                "kvd_admin_connections_accepted",
                "Admin HTTP connections given a slot",
                &self.admin_connections_accepted,
            ),
            (
                "kvd_admin_connections_refused",
                "Admin HTTP connections refused at the cap (503, closed)",
                &self.admin_connections_refused,
            ),
            (
                "kvd_admin_header_timeouts",
                "Admin HTTP connections closed: no whole request head within the header timeout",
                &self.admin_header_timeouts,
            ),
            (
                "kvd_admin_idle_timeouts",
                "Admin HTTP connections closed: no byte moved within the idle timeout",
                &self.admin_idle_timeouts,
            ),
            (
                "kvd_probe_connections_refused",
                "Probe-listener connections closed at a bound (in all or per source address)",
                &self.probe_connections_refused,
            ),
            (
                "kvd_probes_answered",
                "Liveness and readiness probes answered on the probe listener",
                &self.probes_answered,
            ),
        ] {
            r.register(name, help, c.clone());
        }
    }

    /// Register the daemon's own gauges (set as it works, or from [`Health`] at each render).
    fn register_gauges(&self, r: &mut Registry) {
        for (name, help, g) in [
            (
                "kvd_sessions_open",
                "Connections past the handshake",
                &self.sessions_open,
            ),
            (
                "kvd_admin_connections_open",
                "Admin HTTP connections holding a slot",
                &self.admin_connections_open,
            ),
            (
                "kvd_accounting_balanced",
                "1 if the last audit found free + every state = total",
                &self.accounting_balanced,
            ),
            (
                "kvd_ready",
                "1 while ready (0 while draining or without the etcd lease)",
                &self.ready,
            ),
            (
                "kvd_draining",
                "1 from the moment a drain begins",
                &self.draining,
            ),
            (
                "kvd_cluster_mode",
                "1 when the node is registered in etcd, 0 on its own",
                &self.cluster_mode,
            ),
            (
                "kvd_etcd_lease_held",
                "1 while the node holds its etcd registration lease (always 1 on its own)",
                &self.lease_held,
            ),
        ] {
            r.register(name, help, g.clone());
        }
        r.register(
            "kvd_drain_seconds",
            "Seconds since the drain began (0 before one)",
            self.drain_s.clone(),
        );
        r.register(
            "kvd_uptime_seconds",
            "Seconds since start",
            self.uptime_s.clone(),
        );
        r.register(
            "kvd_cpu_wake_held",
            "1 while the CPU wake-latency request is held (clients calling; --cpu-wake-latency-us)",
            self.cpu_wake.held.clone(),
        );
        r.register(
            "kvd_cpu_wake_holds",
            "Times the CPU wake-latency request was set after a quiet spell",
            self.cpu_wake.holds.clone(),
        );
        r.register(
            "kvd_cpu_wake_held_seconds",
            "Seconds the CPU wake-latency request has been held, in all",
            self.cpu_wake.held_seconds.clone(),
        );
    }

    /// Add the data port's counters (read from its engine at each scrape).
    pub fn with_data_port(mut self, port: Arc<super::data_port::DataPort>) -> Metrics {
        self.registry
            .register_collector(Box::new(DataPortCollector { port }));
        self
    }

    /// The measurements of an operation.
    pub fn op(&self, kind: OpKind) -> OpMetrics<'_> {
        let i = kind as usize;
        OpMetrics {
            duration: &self.durations[i],
            served: &self.served[i],
            errors: &self.errors[i],
        }
    }

    /// Operations served, by name.
    pub fn op_counts(&self) -> Vec<(&'static str, u64)> {
        OpKind::iter()
            .zip(&self.served)
            .map(|(k, c)| (k.into(), c.get()))
            .collect()
    }

    /// Everything in the OpenMetrics text format ([`CONTENT_TYPE`]).
    pub fn render(&self, h: Health) -> String {
        self.ready.set(i64::from(h.ready));
        self.draining.set(i64::from(h.draining));
        self.drain_s.set(h.drain_s);
        self.cluster_mode.set(i64::from(h.cluster_mode));
        self.lease_held.set(i64::from(h.lease_held));
        self.uptime_s.set(h.uptime_s);
        let mut out = String::with_capacity(16 * 1024);
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

/// Reads the transfer engine's counters at each scrape.
#[derive(Debug)]
struct DataPortCollector {
    port: Arc<super::data_port::DataPort>,
}

impl Collector for DataPortCollector {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> std::fmt::Result {
        self.encode_transfers(&mut e)?;
        self.encode_cluster(&mut e)?;
        self.encode_engine(&mut e)
    }
}

impl DataPortCollector {
    /// The cluster lookups' fetches (a lookup's miss asked of the peers) and the locates
    /// answered for peers.
    fn encode_cluster(&self, e: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        let t = self.port.transfer_counters();
        for (name, help, v) in [
            (
                "kvd_cluster_fetches",
                "Cluster fetches started here (a lookup's miss asked of the peers)",
                t.cluster_fetches,
            ),
            (
                "kvd_cluster_located_blocks",
                "Blocks the cluster fetches' locates found at peers",
                t.cluster_located_blocks,
            ),
            (
                "kvd_cluster_fetched_blocks",
                "Of those, blocks fetched and published here",
                t.cluster_fetched_blocks,
            ),
            (
                "kvd_cluster_shortfall_blocks",
                "Located blocks that did not arrive (evicted since the locate, holder gone, piece failed): a shorter hit",
                t.cluster_shortfall_blocks,
            ),
            (
                "kvd_cluster_locate_unanswered",
                "Peers that did not answer a locate in time (counted as holding nothing)",
                t.cluster_locate_unanswered,
            ),
            (
                "kvd_cluster_locates_served",
                "Locates this node answered for its peers",
                t.locates_served,
            ),
        ] {
            counter(e, name, help, v)?;
        }
        Ok(())
    }

    /// The transfers this node started or served: counts, failures by reason, durations.
    fn encode_transfers(&self, e: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        let t = self.port.transfer_counters();
        for (name, help, v) in [
            (
                "kvd_transfers_started",
                "Pushes and fetches started from this node",
                t.transfers_started,
            ),
            (
                "kvd_transfers_done",
                "Transfers started here that published everything at their destination",
                t.transfers_done,
            ),
            (
                "kvd_transfer_blocks_pushed",
                "Blocks pushed from here and published at the peer",
                t.blocks_sent,
            ),
            (
                "kvd_transfer_bytes_pushed",
                "Bytes of those blocks",
                t.bytes_sent,
            ),
            (
                "kvd_transfer_blocks_received",
                "Blocks that arrived here (pushed to or fetched by this node) and were published",
                t.blocks_received,
            ),
            (
                "kvd_transfer_bytes_received",
                "Bytes of those blocks",
                t.bytes_received,
            ),
            (
                "kvd_transfer_binding_mismatches",
                "Transfers refused because their binding did not match (another incarnation, an older epoch)",
                t.binding_mismatches,
            ),
            (
                "kvd_transfer_block_checksum_failures",
                "Received blocks whose checksum did not match the source's (nothing published)",
                t.checksum_failures,
            ),
            (
                "kvd_transfer_incoming_aborted",
                "Transfers into or served by this node that ended without completing (abort, lost connection, deadline)",
                t.aborted_incoming,
            ),
        ] {
            counter(e, name, help, v)?;
        }
        {
            let failures = self.port.transfer_failures();
            let mut family = e.encode_descriptor(
                "kvd_transfers_failed",
                "Transfers started here that failed, by reason",
                None,
                MetricType::Counter,
            )?;
            for reason in [
                "peer",
                "binding",
                "checksum",
                "no_space",
                "overloaded",
                "not_found",
                "other",
            ] {
                let n = failures.get(reason).copied().unwrap_or(0);
                let labels = [("reason", reason)];
                prometheus_client::metrics::counter::ConstCounter::new(n)
                    .encode(family.encode_family(&labels)?)?;
            }
        }
        for (kind, h) in [
            ("push", self.port.push_seconds()),
            ("fetch", self.port.fetch_seconds()),
            ("cluster_fetch", self.port.cluster_fetch_seconds()),
        ] {
            let mut family = e.encode_descriptor(
                "kvd_transfer_duration_seconds",
                "End-to-end time of transfers started here (request to end), by kind",
                None,
                MetricType::Histogram,
            )?;
            let labels = [("kind", kind)];
            h.encode(family.encode_family(&labels)?)?;
        }
        gauge(
            e,
            "kvd_transfers_in_flight",
            "Transfers started here still under way",
            self.port.transfers_in_flight() as i64,
        )
    }

    /// The data engine's chunk and connection counts.
    fn encode_engine(&self, e: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        let c = self.port.counters();
        for (name, help, v) in [
            (
                "kvd_transfer_chunks",
                "Chunks this node moved as initiator, answered ok",
                c.chunks_done,
            ),
            (
                "kvd_transfer_bytes",
                "Payload bytes this node moved as initiator",
                c.bytes_done,
            ),
            (
                "kvd_transfer_chunks_served",
                "Chunks served to peers (into or out of this pool)",
                c.chunks_served,
            ),
            (
                "kvd_transfer_checksum_failures",
                "Chunks whose CRC-32C this node found wrong",
                c.checksum_failures,
            ),
            (
                "kvd_transfer_refused",
                "Peer accesses refused: no live grant covers them, or a stale generation",
                c.refused,
            ),
            (
                "kvd_transfer_connections_failed",
                "Data connections failed (error, close, stall, protocol)",
                c.connections_failed,
            ),
            (
                "kvd_transfer_handshakes_refused",
                "Data connections refused at the handshake (no secret, malformed, too many)",
                c.handshakes_refused,
            ),
            (
                "kvd_transfer_slow_progress",
                "Stall checks that kept a data connection: no operation completed for the stall \
                 timeout, but bytes still moved under its socket",
                c.slow_progress,
            ),
            (
                "kvd_transfer_integrity_failures",
                "Frames between daemons that failed their integrity tag (changed in flight, \
                 replayed, forged), each closing its connection; and payloads that failed their \
                 MAC (--payload-mac), each failing its chunk",
                c.integrity_failures,
            ),
            (
                "kvd_transfer_identity_refusals",
                "Data connections refused because their bind did not prove the node it claimed \
                 (no key for that node here: not a peer, or revoked; a bad signature; addressed \
                 to another node)",
                c.identity_refusals,
            ),
        ] {
            counter(e, name, help, v)?;
        }
        Ok(())
    }
}

/// Reads the store's counts at each scrape.
#[derive(Debug)]
struct StoreCollector {
    store: Arc<Store>,
    inflight_rejects: Counter,
    connections_refused: Counter,
}

impl Collector for StoreCollector {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> std::fmt::Result {
        let s = self.store.stats();
        self.encode_pages(&mut e, &s)?;
        encode_store_gauges(&mut e, &s)?;
        let h = self.store.holds_summary();
        for (name, help, v) in [
            (
                "kvd_handoff_holds",
                "Hand-off runs held for their decodes",
                h.holds,
            ),
            (
                "kvd_handoff_held_bytes",
                "Bytes of the hand-off runs held",
                h.bytes,
            ),
        ] {
            gauge(&mut e, name, help, v as i64)?;
        }
        let age = e.encode_descriptor(
            "kvd_handoff_oldest_hold_age_seconds",
            "Age of the oldest hand-off run held",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(h.oldest_age_ms as f64 / 1000.0).encode(age)?;
        // every declared counter, by its declared metric (kvd-core's `counters`)
        for (d, v) in s.counters.iter() {
            counter(&mut e, d.metric, d.help, v)?;
        }
        counter(
            &mut e,
            "kvd_overload_rejections",
            "All refusals at a bound (store, in-flight, connections)",
            s.counters.overload_rejects
                + self.inflight_rejects.get()
                + self.connections_refused.get(),
        )
    }
}

impl StoreCollector {
    /// Pages and bytes by block state, published bytes by class.
    fn encode_pages(&self, e: &mut DescriptorEncoder<'_>, s: &StoreStats) -> std::fmt::Result {
        let page = s.page_size_bytes as i64;
        let states = s.accounting.by_state();
        for (name, help, scale) in [
            ("kvd_blocks", "Pages by block state", 1),
            ("kvd_bytes", "Pool bytes by block state", page),
        ] {
            let mut family = e.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (state, n) in states {
                let labels = [("state", state)];
                ConstGauge::new(i64::from(n) * scale).encode(family.encode_family(&labels)?)?;
            }
        }
        // Published pages by class: checkpoint blocks (held by a live manifest until it ends)
        // and cache blocks (evictable when unpinned).
        let published = u64::from(s.accounting.published);
        let checkpoint = self.store.checkpoint_pages().min(published);
        let mut family = e.encode_descriptor(
            "kvd_class_bytes",
            "Published pool bytes by block class",
            None,
            MetricType::Gauge,
        )?;
        for (class, n) in [
            ("cache", published - checkpoint),
            ("checkpoint", checkpoint),
        ] {
            let labels = [("class", class)];
            ConstGauge::new(n as i64 * page).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

/// The store's counts of things held now, and the hit ratio.
fn encode_store_gauges(e: &mut DescriptorEncoder<'_>, s: &StoreStats) -> std::fmt::Result {
    for (name, help, v) in [
        (
            "kvd_blocks_total",
            "Pages in the pool",
            i64::from(s.accounting.total),
        ),
        (
            "kvd_node_generation",
            "This incarnation's generation",
            s.node_generation as i64,
        ),
        (
            "kvd_page_size_bytes",
            "Bytes per page",
            s.page_size_bytes as i64,
        ),
        (
            "kvd_reserved_unused_pages",
            "Pages reserved, not yet used",
            s.reserved_unused_pages as i64,
        ),
        ("kvd_pins", "Pin entries (session x block)", s.pins as i64),
        ("kvd_sessions", "Open sessions", i64::from(s.sessions)),
        (
            "kvd_manifests",
            "Live checkpoint manifests",
            i64::from(s.manifests),
        ),
        (
            "kvd_namespaces",
            "Registered namespaces",
            i64::from(s.namespaces),
        ),
        (
            "kvd_evictable_blocks",
            "Cache blocks eviction could take now",
            i64::from(s.evictable),
        ),
    ] {
        gauge(e, name, help, v)?;
    }
    let c = &s.counters;
    let ratio = if c.lookups == 0 {
        0.0
    } else {
        c.hits as f64 / c.lookups as f64
    };
    ConstGauge::new(ratio).encode(e.encode_descriptor(
        "kvd_lookup_hit_ratio",
        "Hits / lookups since start",
        None,
        MetricType::Gauge,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::MonotonicClock;
    use crate::pool::{HugePages, PoolConfig};
    use crate::store::StoreConfig;

    fn metrics() -> Metrics {
        let cfg = StoreConfig::new(PoolConfig {
            page_size_bytes: 4096,
            page_count: 4,
            huge_pages: HugePages::Off,
        });
        Metrics::new(Arc::new(
            Store::new(cfg, Arc::new(MonotonicClock::new())).unwrap(),
        ))
    }

    #[test]
    fn the_histogram_buckets_are_cumulative_and_end_at_the_count() {
        let m = metrics();
        m.op(OpKind::Alloc).observe(3, true);
        m.op(OpKind::Alloc).observe(700, false);
        m.op(OpKind::Alloc).observe(10_000_000, true);
        let text = m.render(Health {
            ready: true,
            lease_held: true,
            uptime_s: 1.0,
            ..Health::default()
        });
        for needle in [
            "kvd_op_duration_seconds_bucket{le=\"0.000005\",op=\"alloc\"} 1",
            "kvd_op_duration_seconds_bucket{le=\"0.001\",op=\"alloc\"} 2",
            "kvd_op_duration_seconds_bucket{le=\"+Inf\",op=\"alloc\"} 3",
            "kvd_op_duration_seconds_count{op=\"alloc\"} 3",
            "kvd_op_errors_total{op=\"alloc\"} 1",
            "kvd_ops_total{op=\"alloc\"} 3",
            "kvd_blocks{state=\"free\"} 4",
            "kvd_node_generation 1",
            "kvd_ready 1",
            "kvd_admin_connections_refused_total 0",
            "kvd_admin_connections_open 0",
        ] {
            assert!(text.contains(needle), "no {needle:?} in\n{text}");
        }
        assert!(text.ends_with("# EOF\n"));
        assert_eq!(
            m.op_counts().iter().find(|(n, _)| *n == "alloc").unwrap().1,
            3
        );
    }

    #[test]
    fn every_declared_store_counter_is_a_counter_family_with_its_help_and_value() {
        // a fresh store: every counter at 0
        let text = metrics().render(Health::default());
        for d in crate::store::Counters::DECLARED {
            let (name, help) = (d.metric, d.help);
            for needle in [
                format!("# HELP {name} {help}\n"),
                format!("# TYPE {name} counter\n"),
                format!("\n{name}_total 0\n"),
            ] {
                assert!(text.contains(&needle), "no {needle:?} in\n{text}");
            }
        }
    }

    #[test]
    fn every_sample_line_is_a_name_and_a_number() {
        let text = metrics().render(Health {
            uptime_s: 2.5,
            draining: true,
            drain_s: 0.5,
            ..Health::default()
        });
        assert!(text.contains("kvd_ready 0"));
        assert!(text.contains("kvd_draining 1"));
        assert!(text.contains("kvd_drain_seconds 0.5"));
        assert!(text.contains("kvd_cluster_mode 0"));
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let v = line.rsplit(' ').next().unwrap();
            assert!(v.parse::<f64>().is_ok(), "bad sample line {line:?}");
        }
    }
}
