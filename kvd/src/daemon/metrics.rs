//! The daemon's own measurements, and the Prometheus text rendering of them together with the
//! store's [`StoreStats`].
//!
//! Rendered by hand rather than through a metrics crate: the store already keeps exact counts
//! behind its lock ([`crate::store::Store::stats`]), so a registry would only mirror them; the
//! daemon's own additions are a few counters and one fixed-bucket latency histogram per
//! operation, all lock-free atomics. The exposition format (text 0.0.4) is small and stable.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::protocol::Op;
use crate::store::StoreStats;

/// Upper bounds of the latency buckets, microseconds.
pub const LATENCY_BUCKETS_US: [u64; 14] = [
    5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000,
];

/// A latency histogram with fixed buckets.
#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; LATENCY_BUCKETS_US.len()],
    count: AtomicU64,
    sum_us: AtomicU64,
    errors: AtomicU64,
}

impl Histogram {
    /// Record one observation.
    pub fn observe(&self, us: u64, ok: bool) {
        if let Some(i) = LATENCY_BUCKETS_US.iter().position(|&b| us <= b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
        if !ok {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
}

/// The daemon's counters (the store keeps its own).
#[derive(Debug)]
pub struct Metrics {
    ops: Vec<Histogram>,
    /// Connections accepted.
    pub connections_accepted: AtomicU64,
    /// Connections dropped at accept because the connection bound was reached.
    pub connections_refused: AtomicU64,
    /// Sessions refused (draining, session bound, bad hello).
    pub sessions_refused: AtomicU64,
    /// Requests answered `Overloaded` because the session had too many in flight.
    pub inflight_rejects: AtomicU64,
    /// Frames that failed to decode (the connection was closed).
    pub protocol_errors: AtomicU64,
    /// Sessions open now (connections past the handshake).
    pub sessions_open: AtomicU64,
    /// Result of the last accounting audit (1 balanced, 0 not).
    pub accounting_balanced: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            ops: Op::NAMES.iter().map(|_| Histogram::default()).collect(),
            connections_accepted: AtomicU64::new(0),
            connections_refused: AtomicU64::new(0),
            sessions_refused: AtomicU64::new(0),
            inflight_rejects: AtomicU64::new(0),
            protocol_errors: AtomicU64::new(0),
            sessions_open: AtomicU64::new(0),
            accounting_balanced: AtomicU64::new(1),
        }
    }
}

impl Metrics {
    /// The histogram of an operation.
    pub fn op(&self, name: &str) -> &Histogram {
        let i = Op::NAMES
            .iter()
            .position(|n| *n == name)
            .expect("every op name is in Op::NAMES");
        &self.ops[i]
    }

    /// Operations served, by name.
    pub fn op_counts(&self) -> Vec<(&'static str, u64)> {
        Op::NAMES
            .iter()
            .zip(&self.ops)
            .map(|(n, h)| (*n, h.count()))
            .collect()
    }

    /// Render everything in the Prometheus text format.
    pub fn render(&self, s: &StoreStats, ready: bool, uptime_s: f64) -> String {
        let mut o = String::with_capacity(8192);
        let a = &s.accounting;
        let page = s.page_size_bytes;
        gauge(&mut o, "kvd_up", "1 while the daemon runs", 1);
        gauge(
            &mut o,
            "kvd_ready",
            "1 while ready (0 while draining)",
            ready as u64,
        );
        let _ = writeln!(o, "# HELP kvd_uptime_seconds Seconds since start");
        let _ = writeln!(o, "# TYPE kvd_uptime_seconds gauge");
        let _ = writeln!(o, "kvd_uptime_seconds {uptime_s:.3}");
        gauge(
            &mut o,
            "kvd_node_generation",
            "This incarnation's generation",
            s.node_generation,
        );
        gauge(&mut o, "kvd_page_size_bytes", "Bytes per page", page);
        let states = [
            ("free", a.free),
            ("allocated", a.allocated),
            ("writing", a.writing),
            ("sealed", a.sealed),
            ("published", a.published),
            ("retired", a.retired),
            ("quarantined", a.quarantined),
        ];
        let _ = writeln!(o, "# HELP kvd_blocks Pages by block state");
        let _ = writeln!(o, "# TYPE kvd_blocks gauge");
        for (st, n) in states {
            let _ = writeln!(o, "kvd_blocks{{state=\"{st}\"}} {n}");
        }
        let _ = writeln!(o, "# HELP kvd_bytes Pool bytes by block state");
        let _ = writeln!(o, "# TYPE kvd_bytes gauge");
        for (st, n) in states {
            let _ = writeln!(o, "kvd_bytes{{state=\"{st}\"}} {}", n as u64 * page);
        }
        gauge(
            &mut o,
            "kvd_blocks_total",
            "Pages in the pool",
            a.total as u64,
        );
        gauge(
            &mut o,
            "kvd_accounting_balanced",
            "1 if the last audit found free + every state = total",
            self.accounting_balanced.load(Ordering::Relaxed),
        );
        gauge(
            &mut o,
            "kvd_reserved_unused_pages",
            "Pages reserved, not yet used",
            s.reserved_unused_pages,
        );
        gauge(&mut o, "kvd_pins", "Pin entries (session x block)", s.pins);
        gauge(&mut o, "kvd_sessions", "Open sessions", s.sessions as u64);
        gauge(
            &mut o,
            "kvd_manifests",
            "Live checkpoint manifests",
            s.manifests as u64,
        );
        gauge(
            &mut o,
            "kvd_namespaces",
            "Registered namespaces",
            s.namespaces as u64,
        );
        gauge(
            &mut o,
            "kvd_evictable_blocks",
            "Cache blocks eviction could take now",
            s.evictable as u64,
        );
        let c = &s.counters;
        let ratio = if c.lookups == 0 {
            0.0
        } else {
            c.hits as f64 / c.lookups as f64
        };
        let _ = writeln!(o, "# HELP kvd_lookup_hit_ratio Hits / lookups since start");
        let _ = writeln!(o, "# TYPE kvd_lookup_hit_ratio gauge");
        let _ = writeln!(o, "kvd_lookup_hit_ratio {ratio:.6}");
        for (name, help, v) in [
            ("kvd_lookups_total", "Keys looked up", c.lookups),
            ("kvd_lookup_hits_total", "Keys found published", c.hits),
            (
                "kvd_stale_generation_rejects_total",
                "Handles refused for a generation mismatch",
                c.stale_generation_rejects,
            ),
            (
                "kvd_checksum_failures_total",
                "Blocks that failed their checksum",
                c.checksum_failures,
            ),
            ("kvd_evictions_total", "Cache blocks evicted", c.evictions),
            (
                "kvd_store_overload_rejects_total",
                "Store operations refused at a bound",
                c.overload_rejects,
            ),
            (
                "kvd_no_space_rejects_total",
                "Allocations refused for lack of space",
                c.no_space_rejects,
            ),
            (
                "kvd_sessions_expired_total",
                "Sessions closed by lease expiry",
                c.sessions_expired,
            ),
            (
                "kvd_pins_expired_total",
                "Pins dropped by TTL",
                c.pins_expired,
            ),
            (
                "kvd_manifests_expired_total",
                "Manifests released by TTL",
                c.manifests_expired,
            ),
            (
                "kvd_blocks_published_total",
                "Blocks published",
                c.blocks_published,
            ),
            (
                "kvd_blocks_aborted_total",
                "Blocks aborted",
                c.blocks_aborted,
            ),
            (
                "kvd_blocks_removed_total",
                "Blocks removed by compare-and-delete",
                c.blocks_removed,
            ),
            (
                "kvd_connections_accepted_total",
                "Connections accepted",
                self.connections_accepted.load(Ordering::Relaxed),
            ),
            (
                "kvd_connections_refused_total",
                "Connections closed at accept (connection bound)",
                self.connections_refused.load(Ordering::Relaxed),
            ),
            (
                "kvd_sessions_refused_total",
                "Handshakes refused (draining, bounds, bad hello)",
                self.sessions_refused.load(Ordering::Relaxed),
            ),
            (
                "kvd_inflight_rejects_total",
                "Requests answered Overloaded (in-flight bound)",
                self.inflight_rejects.load(Ordering::Relaxed),
            ),
            (
                "kvd_protocol_errors_total",
                "Malformed frames (connection closed)",
                self.protocol_errors.load(Ordering::Relaxed),
            ),
        ] {
            counter(&mut o, name, help, v);
        }
        let overload = c.overload_rejects
            + self.inflight_rejects.load(Ordering::Relaxed)
            + self.connections_refused.load(Ordering::Relaxed);
        counter(
            &mut o,
            "kvd_overload_rejections_total",
            "All refusals at a bound (store, in-flight, connections)",
            overload,
        );
        let _ = writeln!(
            o,
            "# HELP kvd_op_duration_seconds Time to serve one request, by operation"
        );
        let _ = writeln!(o, "# TYPE kvd_op_duration_seconds histogram");
        for (name, h) in Op::NAMES.iter().zip(&self.ops) {
            let mut cum = 0;
            for (b, n) in LATENCY_BUCKETS_US.iter().zip(&h.buckets) {
                cum += n.load(Ordering::Relaxed);
                let _ = writeln!(
                    o,
                    "kvd_op_duration_seconds_bucket{{op=\"{name}\",le=\"{}\"}} {cum}",
                    *b as f64 / 1e6
                );
            }
            let count = h.count.load(Ordering::Relaxed);
            let _ = writeln!(
                o,
                "kvd_op_duration_seconds_bucket{{op=\"{name}\",le=\"+Inf\"}} {count}"
            );
            let _ = writeln!(
                o,
                "kvd_op_duration_seconds_sum{{op=\"{name}\"}} {}",
                h.sum_us.load(Ordering::Relaxed) as f64 / 1e6
            );
            let _ = writeln!(o, "kvd_op_duration_seconds_count{{op=\"{name}\"}} {count}");
        }
        let _ = writeln!(
            o,
            "# HELP kvd_op_errors_total Requests answered with an error, by operation"
        );
        let _ = writeln!(o, "# TYPE kvd_op_errors_total counter");
        for (name, h) in Op::NAMES.iter().zip(&self.ops) {
            let _ = writeln!(
                o,
                "kvd_op_errors_total{{op=\"{name}\"}} {}",
                h.errors.load(Ordering::Relaxed)
            );
        }
        o
    }
}

fn gauge(o: &mut String, name: &str, help: &str, v: u64) {
    let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
}

fn counter(o: &mut String, name: &str, help: &str, v: u64) {
    let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_histogram_buckets_are_cumulative_and_end_at_the_count() {
        let m = Metrics::default();
        m.op("alloc").observe(3, true);
        m.op("alloc").observe(700, false);
        m.op("alloc").observe(10_000_000, true);
        let s = StoreStats {
            node_generation: 3,
            page_size_bytes: 4096,
            accounting: Default::default(),
            reserved_unused_pages: 0,
            pins: 0,
            sessions: 0,
            manifests: 0,
            namespaces: 0,
            evictable: 0,
            counters: Default::default(),
        };
        let text = m.render(&s, true, 1.0);
        assert!(text.contains("kvd_op_duration_seconds_bucket{op=\"alloc\",le=\"0.000005\"} 1"));
        assert!(text.contains("kvd_op_duration_seconds_bucket{op=\"alloc\",le=\"0.001\"} 2"));
        assert!(text.contains("kvd_op_duration_seconds_bucket{op=\"alloc\",le=\"+Inf\"} 3"));
        assert!(text.contains("kvd_op_errors_total{op=\"alloc\"} 1"));
        assert!(text.contains("kvd_node_generation 3"));
        // Every sample line is `name{labels} value` or `name value`.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let v = line.rsplit(' ').next().unwrap();
            assert!(v.parse::<f64>().is_ok(), "bad sample line {line:?}");
        }
    }
}
