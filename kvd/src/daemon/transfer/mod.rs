//! Blocks between daemons over the data port: pushes out of this node (`outgoing`), pushes
//! into it (`incoming`), and the messages between the two daemons (`wire`).
//!
//! Every transfer is bound (DESIGN invariant 6) to the request, the namespace, both nodes'
//! generations and a transfer epoch, checked by the destination before it allocates anything;
//! the source's blocks stay pinned until the transfer has ended either way, and the
//! destination's pages are granted to exactly this transfer and published only when every
//! block's checksum matched.

pub mod incoming;
pub mod outgoing;
pub mod wire;

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

/// Counters of the transfers of one node (monotonic).
#[derive(Debug, Default)]
pub struct Counters {
    /// Pushes started from here.
    pub pushes_started: AtomicU64,
    /// Pushes from here that published everything at the destination.
    pub pushes_done: AtomicU64,
    /// Pushes from here that failed.
    pub pushes_failed: AtomicU64,
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
}

/// A snapshot of [`Counters`], for `/status` and `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
#[allow(missing_docs)]
pub struct TransferCounters {
    pub pushes_started: u64,
    pub pushes_done: u64,
    pub pushes_failed: u64,
    pub blocks_sent: u64,
    pub bytes_sent: u64,
    pub blocks_received: u64,
    pub bytes_received: u64,
    pub binding_mismatches: u64,
    pub checksum_failures: u64,
    pub aborted_incoming: u64,
    pub overloaded: u64,
}

impl Counters {
    /// A snapshot.
    pub fn snapshot(&self) -> TransferCounters {
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        TransferCounters {
            pushes_started: r(&self.pushes_started),
            pushes_done: r(&self.pushes_done),
            pushes_failed: r(&self.pushes_failed),
            blocks_sent: r(&self.blocks_sent),
            bytes_sent: r(&self.bytes_sent),
            blocks_received: r(&self.blocks_received),
            bytes_received: r(&self.bytes_received),
            binding_mismatches: r(&self.binding_mismatches),
            checksum_failures: r(&self.checksum_failures),
            aborted_incoming: r(&self.aborted_incoming),
            overloaded: r(&self.overloaded),
        }
    }
}
