//! The controller: owns the load table and the placement table, applies events, returns
//! decisions.
//!
//! Every event method takes `now_ms` (the caller's clock, see the module docs of
//! [`crate`]) and either changes state and returns the decisions that follow, or fails
//! and changes nothing. The same calls are also reachable as data: [`Event`] in,
//! `Vec<`[`Decision`]`>` out, through [`Controller::apply`] — the form the HTTP service, a
//! simulator's event queue and the C ABI use.
//!
//! Events are idempotent: replaying one changes nothing (counted in
//! [`Stats::duplicate_events`]); an event naming an older epoch than the request's is dropped
//! with [`crate::Error::StaleEpoch`] (counted in [`Stats::stale_events`]).
//!
//! The rooms, by concern (each adds methods to the one [`Controller`]):
//!
//! - `config.rs`: [`ControlConfig`], the knobs and their bounds.
//! - `events.rs`: [`Event`] and [`Decision`] (the controller as data) and [`Controller::apply`].
//! - `workers.rs`: workers joining, recovering, walking their phases; assist pairing.
//! - `requests.rs`: admission and every per-request event; the epoch CAS; holders; retiring.
//! - `recovery.rs`: [`Controller::fail_workers`], one failure event as a sequence of named steps.
//! - `snapshot.rs`: the whole state out and back in.
//! - `invariants.rs`: [`Controller::check_invariants`], run after every mutating event in debug
//!   builds and on every snapshot restore.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

use super::RequestId;
use super::load::LoadTable;
use super::policy::Policy;
use super::request::RequestRecord;
use crate::Result;

mod config;
mod events;
mod invariants;
mod recovery;
mod requests;
mod snapshot;
#[cfg(test)]
mod tests;
mod workers;

pub use config::ControlConfig;
pub use events::{Decision, Event};
pub use requests::{Admission, AdmitRequest};

/// Counters, all monotonic.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// Requests admitted.
    pub admitted: u64,
    /// Admissions that wanted a checkpoint and found no holder (ran without one).
    pub no_holder: u64,
    /// Events dropped for naming an older epoch.
    pub stale_events: u64,
    /// Events that changed nothing (replays).
    pub duplicate_events: u64,
    /// Requests completed.
    pub completed: u64,
    /// Requests cancelled.
    pub cancelled: u64,
    /// Requests failed (any reason).
    pub failed: u64,
    /// Of those, failed because a migration could not meet the deadline.
    pub deadline_failures: u64,
    /// Of those, failed because the migration budget was spent.
    pub budget_failures: u64,
    /// Worker failures processed.
    pub worker_failures: u64,
    /// Restores planned.
    pub migrations: u64,
    /// Restores that load a checkpointed prefix.
    pub kv_reuse_restores: u64,
    /// Restores that recompute everything.
    pub recomputations: u64,
    /// Rebalancing moves.
    pub rebalance_moves: u64,
    /// Checkpoints re-placed because their holder died or began serving the request.
    pub checkpoint_moves: u64,
}

/// The control shim. Not internally synchronized: the service wraps it in a mutex, a simulator
/// owns it.
#[derive(Debug)]
pub struct Controller {
    config: ControlConfig,
    policy: Box<dyn Policy>,
    load: LoadTable,
    requests: BTreeMap<RequestId, RequestRecord>,
    terminal: BTreeMap<RequestId, RequestRecord>,
    terminal_order: VecDeque<RequestId>,
    stats: Stats,
}

/// A live request or the terminal record an idempotent reply is made from.
enum Found {
    Live,
    Terminal,
}

impl Controller {
    /// A controller with the configured policy and no workers.
    ///
    /// # Errors
    /// [`crate::Error::InvalidArgument`] when the configuration is out of bounds.
    pub fn new(config: ControlConfig) -> Result<Self> {
        let policy = config.policy.build(config.score_params());
        Self::with_policy(config, policy)
    }

    /// A controller with a custom policy (`config.policy` is ignored; snapshots record the
    /// policy's [`Policy::kind`]).
    ///
    /// # Errors
    /// [`crate::Error::InvalidArgument`] when the configuration is out of bounds.
    pub fn with_policy(mut config: ControlConfig, policy: Box<dyn Policy>) -> Result<Self> {
        config.validate()?;
        config.policy = policy.kind();
        Ok(Controller {
            config,
            policy,
            load: LoadTable::new(),
            requests: BTreeMap::new(),
            terminal: BTreeMap::new(),
            terminal_order: VecDeque::new(),
            stats: Stats::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ControlConfig {
        &self.config
    }

    /// The load table.
    pub fn load(&self) -> &LoadTable {
        &self.load
    }

    /// The counters.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// A request's record, live or (recently) terminal.
    pub fn request(&self, id: RequestId) -> Option<&RequestRecord> {
        self.requests.get(&id).or_else(|| self.terminal.get(&id))
    }

    /// Live (non-terminal) requests, by id.
    pub fn live_requests(&self) -> impl Iterator<Item = &RequestRecord> {
        self.requests.values()
    }

    /// Number of live requests.
    pub fn in_flight(&self) -> usize {
        self.requests.len()
    }
}
