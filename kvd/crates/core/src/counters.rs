//! The store's event counters, each declared once.
//!
//! [`Counters`] is written by one [`declare_counters!`] list: each counter's field name (also its
//! name in libkvd's `kvd_counter_name` and the Python package's `stats()`), its doc line, and
//! its Prometheus metric (name and help text; every entry is a monotonic count since start,
//! encoded as an OpenMetrics `counter`, so `_total` is appended when scraped). The daemon's
//! `/metrics`, libkvd's `kvd_counters` and Python's `stats()` all walk [`Counters::DECLARED`]
//! and [`Counters::values`]; none of them lists the counters again.
//!
//! Adding a counter is one entry at the end of the list below (and the code that increments
//! it); entries are never reordered or removed, since C callers may keep an index.
//! `KvdStats`, the C struct fixed at ABI 1, keeps the first thirteen as fields (a C struct cannot
//! grow without breaking its callers); libkvd's tests check that they are this list's prefix.

use serde::{Deserialize, Serialize};

/// One declared counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CounterDecl {
    /// The field of [`Counters`], and the name C and Python show.
    pub name: &'static str,
    /// The Prometheus metric family (without the `_total` a scrape appends).
    pub metric: &'static str,
    /// The metric's help text.
    pub help: &'static str,
}

/// Declare a struct of `u64` counters once: the struct, its field docs, [`CounterDecl`]s in
/// field order (`DECLARED`) and the values in the same order (`values`).
macro_rules! declare_counters {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident {
            $(
                #[doc = $doc:literal]
                $field:ident => $metric:literal, $help:literal;
            )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
        $vis struct $name {
            $(
                #[doc = $doc]
                pub $field: u64,
            )+
        }

        impl $name {
            /// Every counter, in field order.
            pub const DECLARED: &'static [CounterDecl] = &[$(
                CounterDecl {
                    name: stringify!($field),
                    metric: $metric,
                    help: $help,
                },
            )+];

            /// The values, in [`Self::DECLARED`]'s order.
            pub fn values(&self) -> [u64; $name::DECLARED.len()] {
                [$(self.$field),+]
            }

            /// Each declared counter with its value.
            pub fn iter(
                &self,
            ) -> impl Iterator<Item = (&'static CounterDecl, u64)> + use<> {
                Self::DECLARED.iter().zip(self.values())
            }
        }
    };
}

declare_counters! {
    /// Event counters since start.
    pub struct Counters {
        /// Keys looked up (every key of every lookup, prefix lookups included).
        lookups => "kvd_lookups", "Keys looked up";
        /// Of those, found PUBLISHED.
        hits => "kvd_lookup_hits", "Keys found published";
        /// Handles refused because a generation did not match.
        stale_generation_rejects => "kvd_stale_generation_rejects",
            "Handles refused for a generation mismatch";
        /// Blocks whose bytes failed their checksum.
        checksum_failures => "kvd_checksum_failures", "Blocks that failed their checksum";
        /// Cache blocks evicted to make room.
        evictions => "kvd_evictions", "Cache blocks evicted";
        /// Operations refused because a bound was reached.
        overload_rejects => "kvd_store_overload_rejects", "Store operations refused at a bound";
        /// Allocations refused for lack of space.
        no_space_rejects => "kvd_no_space_rejects", "Allocations refused for lack of space";
        /// Sessions closed because their lease expired.
        sessions_expired => "kvd_sessions_expired", "Sessions closed by lease expiry";
        /// Pins dropped because their TTL passed.
        pins_expired => "kvd_pins_expired", "Pins dropped by TTL";
        /// Manifests released because their TTL passed.
        manifests_expired => "kvd_manifests_expired", "Manifests released by TTL";
        /// Blocks published (cache and checkpoint).
        blocks_published => "kvd_blocks_published", "Blocks published";
        /// Blocks aborted (explicitly or by session end).
        blocks_aborted => "kvd_blocks_aborted", "Blocks aborted";
        /// Blocks removed by compare-and-delete.
        blocks_removed => "kvd_blocks_removed", "Blocks removed by compare-and-delete";
        /// Hand-off holds begun (a prefill's run kept for its decode).
        holds_begun => "kvd_handoff_holds_begun", "Hand-off holds begun";
        /// Hand-off holds ended by their owner (the front or the producer).
        holds_ended => "kvd_handoff_holds_ended", "Hand-off holds ended by their owner";
        /// Hand-off holds ended by the decode that fetched their whole run.
        holds_taken => "kvd_handoff_holds_taken", "Hand-off holds ended by the decode that fetched them";
        /// Hand-off holds released because their TTL passed (the decode never came).
        holds_expired => "kvd_handoff_holds_expired", "Hand-off holds released by TTL, unread";
        /// Soft pins set or renewed (a shared prefix kept from eviction until a deadline).
        soft_pins => "kvd_soft_pins", "Soft pins set or renewed";
        /// Soft-pinned blocks evicted before their deadline because nothing else could go.
        soft_pins_given_way => "kvd_soft_pins_given_way",
            "Soft-pinned blocks evicted before their deadline, nothing else being evictable";
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn declared_follows_the_fields_in_order_with_one_metric_each() {
        // Debug prints `Counters { name: value, ... }` in field order.
        let c = Counters {
            lookups: 1,
            blocks_removed: 13,
            ..Counters::default()
        };
        let shown = format!("{c:?}");
        let fields: Vec<&str> = shown
            .strip_prefix("Counters { ")
            .and_then(|s| s.strip_suffix(" }"))
            .unwrap()
            .split(", ")
            .map(|f| f.split_once(": ").unwrap().0)
            .collect();
        let declared: Vec<&str> = Counters::DECLARED.iter().map(|d| d.name).collect();
        assert_eq!(declared, fields);
        let at = |name: &str| declared.iter().position(|n| *n == name).unwrap();
        let values = c.values();
        assert_eq!(
            (values[at("lookups")], values[at("blocks_removed")]),
            (1, 13)
        );
        let mut metrics: Vec<&str> = Counters::DECLARED.iter().map(|d| d.metric).collect();
        metrics.sort_unstable();
        metrics.dedup();
        assert_eq!(metrics.len(), Counters::DECLARED.len(), "one metric each");
        for d in Counters::DECLARED {
            assert!(d.metric.starts_with("kvd_") && !d.metric.ends_with("_total"));
            assert!(!d.help.is_empty());
        }
    }
}
