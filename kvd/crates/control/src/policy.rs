//! Placement and recovery policies behind one trait.
//!
//! - [`Lumen`]: the design (load-aware holder, holders-first dispatch, rebalancing), with one
//!   of three restore-delay estimates in its placement score ([`RestoreEstimate`]): per server
//!   (docs/CONTROL.md, [`PolicyKind::Lumen`]), the first rule's mean held footprint
//!   ([`PolicyKind::LumenMean`]) or the total held ([`PolicyKind::LumenTotal`]).
//! - [`FixedRing`]: DejaVu's design: the holder is the next worker in a ring; recovery always at
//!   the holder; no rebalancing.
//! - [`StopRestart`]: no checkpoints; every interrupted request recomputes its prompt plus its
//!   generated tokens on the least-loaded survivor.
//!
//! The controller owns the tables and the state machine; a policy only answers two questions
//! from a read-only [`LoadTable`]: *who holds this request's checkpoint* and *where does each
//! interrupted request resume*. The simulator and the daemon use the same code.

use serde::{Deserialize, Serialize};

use super::WorkerId;
use super::dispatch;
use super::load::LoadTable;
use super::placement::{self, RestoreEstimate, ScoreParams};
use super::recovery::{self, Dispatched, Interrupted};

/// The policies kvd ships, by name (what a snapshot and the CLI record).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    /// [`Lumen`] with the per-server restore estimate of docs/CONTROL.md (the default).
    #[default]
    Lumen,
    /// [`Lumen`] with the first rule's estimate, the mean footprint a holder holds (kept to
    /// compare: it herds checkpoints onto the worker with the lowest queueing delay).
    LumenMean,
    /// [`Lumen`] with the total footprint a holder holds plus this request's.
    LumenTotal,
    /// [`FixedRing`].
    FixedRing,
    /// [`StopRestart`].
    StopRestart,
}

impl PolicyKind {
    /// Every policy kvd ships, the default first.
    pub const ALL: [PolicyKind; 5] = [
        PolicyKind::Lumen,
        PolicyKind::LumenMean,
        PolicyKind::LumenTotal,
        PolicyKind::FixedRing,
        PolicyKind::StopRestart,
    ];

    /// The policy object for this kind.
    pub fn build(self, params: ScoreParams) -> Box<dyn Policy> {
        match self {
            PolicyKind::Lumen | PolicyKind::LumenMean | PolicyKind::LumenTotal => {
                let estimate = self.restore_estimate().expect("a Lumen kind");
                Box::new(Lumen { params, estimate })
            }
            PolicyKind::FixedRing => Box::new(FixedRing),
            PolicyKind::StopRestart => Box::new(StopRestart),
        }
    }

    /// The restore estimate of a Lumen kind's placement score (`None` for the baselines).
    pub fn restore_estimate(self) -> Option<RestoreEstimate> {
        match self {
            PolicyKind::Lumen => Some(RestoreEstimate::PerServer),
            PolicyKind::LumenMean => Some(RestoreEstimate::MeanHeld),
            PolicyKind::LumenTotal => Some(RestoreEstimate::TotalHeld),
            PolicyKind::FixedRing | PolicyKind::StopRestart => None,
        }
    }

    /// Whether this is one of the Lumen placements (load-aware holder, rebalancing, and the
    /// LOADING_DRAFT → ASSIST → HOTSWAP restart).
    pub fn is_lumen(self) -> bool {
        self.restore_estimate().is_some()
    }

    /// Its name in the CLI, snapshots, files and tables.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Lumen => "lumen",
            PolicyKind::LumenMean => "lumen_mean",
            PolicyKind::LumenTotal => "lumen_total",
            PolicyKind::FixedRing => "fixed_ring",
            PolicyKind::StopRestart => "stop_restart",
        }
    }
}

impl std::fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for PolicyKind {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::Result<Self> {
        let norm = s.trim().replace('-', "_");
        PolicyKind::ALL
            .into_iter()
            .find(|k| k.name() == norm)
            .ok_or_else(|| {
                let names: Vec<&str> = PolicyKind::ALL.iter().map(|k| k.name()).collect();
                crate::Error::InvalidArgument(format!(
                    "unknown policy {s:?}; expected one of {} (dashes or underscores)",
                    names.join(", ")
                ))
            })
    }
}

/// A checkpoint placement and recovery dispatch policy.
pub trait Policy: std::fmt::Debug + Send + Sync {
    /// Which policy this is.
    fn kind(&self) -> PolicyKind;

    /// The holder of the checkpoint of a request served by `serving` that reserves
    /// `reserve_bytes`, or `None` (no checkpoint). Must never return `serving`, a worker out of
    /// service, or one whose free capacity is below `reserve_bytes` (the controller asserts it).
    fn place(&self, load: &LoadTable, serving: WorkerId, reserve_bytes: u64) -> Option<WorkerId>;

    /// Where each interrupted request resumes. `load` already shows the failed workers as
    /// failed; `interrupted` is sorted by request id. Every returned target must be in service;
    /// a request left out has no survivor to go to and fails.
    fn dispatch(&self, load: &LoadTable, interrupted: &[Interrupted]) -> Dispatched;
}

/// The design: load-aware placement, holders-first dispatch, bounded rebalancing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Lumen {
    /// λ and the bandwidth of the placement score.
    pub params: ScoreParams,
    /// How the score estimates the restore delay on a candidate holder.
    pub estimate: RestoreEstimate,
}

impl Policy for Lumen {
    fn kind(&self) -> PolicyKind {
        match self.estimate {
            RestoreEstimate::PerServer => PolicyKind::Lumen,
            RestoreEstimate::MeanHeld => PolicyKind::LumenMean,
            RestoreEstimate::TotalHeld => PolicyKind::LumenTotal,
        }
    }

    fn place(&self, load: &LoadTable, serving: WorkerId, reserve_bytes: u64) -> Option<WorkerId> {
        placement::load_aware_holder(load, serving, reserve_bytes, self.estimate, self.params)
    }

    fn dispatch(&self, load: &LoadTable, interrupted: &[Interrupted]) -> Dispatched {
        dispatch::dispatch_by_cost(load, interrupted, self.params)
    }
}

/// DejaVu's fixed ring: holder = next worker; recovery always at the holder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FixedRing;

impl Policy for FixedRing {
    fn kind(&self) -> PolicyKind {
        PolicyKind::FixedRing
    }

    fn place(&self, load: &LoadTable, serving: WorkerId, reserve_bytes: u64) -> Option<WorkerId> {
        placement::ring_holder(load, serving, reserve_bytes)
    }

    fn dispatch(&self, load: &LoadTable, interrupted: &[Interrupted]) -> Dispatched {
        Dispatched {
            dispatches: recovery::dispatch_holders_first(load, interrupted, true),
            rebalance_moves: 0,
        }
    }
}

/// No checkpoints; recompute everything on the least-loaded survivor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StopRestart;

impl Policy for StopRestart {
    fn kind(&self) -> PolicyKind {
        PolicyKind::StopRestart
    }

    fn place(
        &self,
        _load: &LoadTable,
        _serving: WorkerId,
        _reserve_bytes: u64,
    ) -> Option<WorkerId> {
        None
    }

    fn dispatch(&self, load: &LoadTable, interrupted: &[Interrupted]) -> Dispatched {
        Dispatched {
            dispatches: recovery::dispatch_holders_first(load, interrupted, false),
            rebalance_moves: 0,
        }
    }
}
