//! The controller's whole state as one serializable value.
//!
//! A snapshot is self-contained: configuration (including the policy), the load table, every
//! live request, the retained terminal records and the counters. A controller restored from it
//! makes the same decisions as the one it was taken from. A later issue stores snapshots in
//! etcd; `kvd control --snapshot FILE` restores one at start.

use serde::{Deserialize, Serialize};

use super::controller::{ControlConfig, Stats};
use super::load::LoadTable;
use super::request::RequestRecord;

/// The snapshot format this build writes and reads.
pub const SNAPSHOT_FORMAT_VERSION: u32 = 1;

/// See the module docs. Build with [`super::Controller::snapshot`], restore with
/// [`super::Controller::from_snapshot`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ControllerSnapshot {
    /// [`SNAPSHOT_FORMAT_VERSION`] when written.
    pub format_version: u32,
    /// The configuration, with the policy.
    pub config: ControlConfig,
    /// The load table.
    pub workers: LoadTable,
    /// Live requests, by id.
    pub requests: Vec<RequestRecord>,
    /// Retained terminal records, oldest first.
    pub terminal: Vec<RequestRecord>,
    /// Counters.
    pub stats: Stats,
}
