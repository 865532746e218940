//! Blocks between daemons over the data port: pushes out of this node (`outgoing`), pushes
//! into it (`incoming`), and the messages between the two daemons (`wire`).
//!
//! Every transfer is bound (invariant 6 of docs/ARCHITECTURE.md) to the request, the namespace, both nodes'
//! generations and a transfer epoch, checked by the destination before it allocates anything;
//! the source's blocks stay pinned until the transfer has ended either way, and the
//! destination's pages are granted to exactly this transfer and published only when every
//! block's checksum matched.

pub mod incoming;
pub mod outgoing;
pub mod wire;

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::metrics::histogram::Histogram;
use serde::{Deserialize, Serialize};

use crate::protocol::WireError;

/// Counters of the transfers of one node (monotonic), and their latencies.
#[derive(Debug)]
pub struct Counters {
    /// Failed transfers started here, by reason.
    pub failures: Mutex<BTreeMap<&'static str, u64>>,
    /// End-to-end latency of pushes started here (request to end), seconds.
    pub push_seconds: Histogram,
    /// End-to-end latency of fetches started here, seconds.
    pub fetch_seconds: Histogram,
    /// Transfers (pushes and fetches) started from here.
    pub transfers_started: AtomicU64,
    /// Of those, transfers that published everything at their destination.
    pub transfers_done: AtomicU64,
    /// Of those, transfers that failed (nothing of them published).
    pub transfers_failed: AtomicU64,
    /// Blocks pushed from here and published at the destination.
    pub blocks_sent: AtomicU64,
    /// Their bytes.
    pub bytes_sent: AtomicU64,
    /// Blocks received and published here.
    pub blocks_received: AtomicU64,
    /// Their bytes.
    pub bytes_received: AtomicU64,
    /// Offers, commits or aborts refused because their binding did not match (another
    /// incarnation of either node, an older epoch, another source's transfer).
    pub binding_mismatches: AtomicU64,
    /// Blocks received whose checksum did not match the offered one (the transfer aborted).
    pub checksum_failures: AtomicU64,
    /// Incoming transfers aborted (by the source, its connection closing, or the deadline).
    pub aborted_incoming: AtomicU64,
    /// Offers or pushes refused at a bound (retryable).
    pub overloaded: AtomicU64,
    /// Transfers refused because their peer is not registered at the generation it speaks
    /// with (cluster mode).
    pub fenced: AtomicU64,
    /// Transfers not started because their peer failed one recently (local suppression).
    pub suppressed: AtomicU64,
    /// End-to-end latency of cluster fetches started here (locate and every piece), seconds.
    pub cluster_fetch_seconds: Histogram,
    /// Cluster fetches started here (a lookup's miss asked of the peers).
    pub cluster_fetches: AtomicU64,
    /// Blocks their locates found at peers.
    pub cluster_located_blocks: AtomicU64,
    /// Of those, blocks fetched and published here.
    pub cluster_fetched_blocks: AtomicU64,
    /// Located blocks that did not arrive (evicted at the holder since the locate, the holder
    /// gone or its piece failed): a shorter hit.
    pub cluster_shortfall_blocks: AtomicU64,
    /// Peers that did not answer a locate in time (counted as holding nothing).
    pub cluster_locate_unanswered: AtomicU64,
    /// Locates this node answered for its peers.
    pub locates_served: AtomicU64,
}

/// A snapshot of [`Counters`], for `/status` and `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
#[allow(missing_docs)]
pub struct TransferCounters {
    pub transfers_started: u64,
    pub transfers_done: u64,
    pub transfers_failed: u64,
    pub blocks_sent: u64,
    pub bytes_sent: u64,
    pub blocks_received: u64,
    pub bytes_received: u64,
    pub binding_mismatches: u64,
    pub checksum_failures: u64,
    pub aborted_incoming: u64,
    pub overloaded: u64,
    pub fenced: u64,
    pub suppressed: u64,
    pub cluster_fetches: u64,
    pub cluster_located_blocks: u64,
    pub cluster_fetched_blocks: u64,
    pub cluster_shortfall_blocks: u64,
    pub cluster_locate_unanswered: u64,
    pub locates_served: u64,
}

impl Default for Counters {
    fn default() -> Counters {
        // 1 ms to 64 s: a batch of blocks over a fast link up to a stalled one
        let buckets = || Histogram::new([0.001, 0.004, 0.016, 0.064, 0.25, 1.0, 4.0, 16.0, 64.0]);
        Counters {
            failures: Mutex::new(BTreeMap::new()),
            push_seconds: buckets(),
            fetch_seconds: buckets(),
            transfers_started: AtomicU64::default(),
            transfers_done: AtomicU64::default(),
            transfers_failed: AtomicU64::default(),
            blocks_sent: AtomicU64::default(),
            bytes_sent: AtomicU64::default(),
            blocks_received: AtomicU64::default(),
            bytes_received: AtomicU64::default(),
            binding_mismatches: AtomicU64::default(),
            checksum_failures: AtomicU64::default(),
            aborted_incoming: AtomicU64::default(),
            overloaded: AtomicU64::default(),
            fenced: AtomicU64::default(),
            suppressed: AtomicU64::default(),
            cluster_fetch_seconds: buckets(),
            cluster_fetches: AtomicU64::default(),
            cluster_located_blocks: AtomicU64::default(),
            cluster_fetched_blocks: AtomicU64::default(),
            cluster_shortfall_blocks: AtomicU64::default(),
            cluster_locate_unanswered: AtomicU64::default(),
            locates_served: AtomicU64::default(),
        }
    }
}

/// The reason label of a failed transfer.
pub fn failure_reason(e: &WireError) -> &'static str {
    match e {
        WireError::Disconnected(_) | WireError::Io(_) | WireError::Unavailable(_) => "peer",
        WireError::StaleGeneration { .. } | WireError::StaleEpoch { .. } => "binding",
        WireError::Corrupt { .. } => "checksum",
        WireError::NoSpace { .. } => "no_space",
        WireError::Overloaded { .. } => "overloaded",
        WireError::NotFound(_) => "not_found",
        _ => "other",
    }
}

impl Counters {
    /// Count a failed transfer.
    pub fn failed(&self, e: &WireError) {
        *self
            .failures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(failure_reason(e))
            .or_default() += 1;
    }

    /// A snapshot.
    pub fn snapshot(&self) -> TransferCounters {
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        TransferCounters {
            transfers_started: r(&self.transfers_started),
            transfers_done: r(&self.transfers_done),
            transfers_failed: r(&self.transfers_failed),
            blocks_sent: r(&self.blocks_sent),
            bytes_sent: r(&self.bytes_sent),
            blocks_received: r(&self.blocks_received),
            bytes_received: r(&self.bytes_received),
            binding_mismatches: r(&self.binding_mismatches),
            checksum_failures: r(&self.checksum_failures),
            aborted_incoming: r(&self.aborted_incoming),
            overloaded: r(&self.overloaded),
            fenced: r(&self.fenced),
            suppressed: r(&self.suppressed),
            cluster_fetches: r(&self.cluster_fetches),
            cluster_located_blocks: r(&self.cluster_located_blocks),
            cluster_fetched_blocks: r(&self.cluster_fetched_blocks),
            cluster_shortfall_blocks: r(&self.cluster_shortfall_blocks),
            cluster_locate_unanswered: r(&self.cluster_locate_unanswered),
            locates_served: r(&self.locates_served),
        }
    }
}
