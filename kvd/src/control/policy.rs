//! Placement and recovery policies behind one trait.
//!
//! - [`Lumen`]: the design (load-aware holder, holders-first dispatch, rebalancing).
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
use super::load::LoadTable;
use super::placement::{self, ScoreParams};
use super::recovery::{self, Dispatched, Interrupted};

/// The policies kvd ships, by name (what a snapshot and the CLI record).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    /// [`Lumen`].
    #[default]
    Lumen,
    /// [`FixedRing`].
    FixedRing,
    /// [`StopRestart`].
    StopRestart,
}

impl PolicyKind {
    /// The policy object for this kind.
    pub fn build(self, params: ScoreParams) -> Box<dyn Policy> {
        match self {
            PolicyKind::Lumen => Box::new(Lumen { params }),
            PolicyKind::FixedRing => Box::new(FixedRing),
            PolicyKind::StopRestart => Box::new(StopRestart),
        }
    }
}

impl std::str::FromStr for PolicyKind {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::Result<Self> {
        match s {
            "lumen" => Ok(PolicyKind::Lumen),
            "fixed_ring" | "fixed-ring" => Ok(PolicyKind::FixedRing),
            "stop_restart" | "stop-restart" => Ok(PolicyKind::StopRestart),
            _ => Err(crate::Error::InvalidArgument(format!(
                "unknown policy {s:?}; expected lumen, fixed_ring or stop_restart"
            ))),
        }
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
}

impl Policy for Lumen {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Lumen
    }

    fn place(&self, load: &LoadTable, serving: WorkerId, reserve_bytes: u64) -> Option<WorkerId> {
        placement::load_aware_holder(load, serving, reserve_bytes, self.params)
    }

    fn dispatch(&self, load: &LoadTable, interrupted: &[Interrupted]) -> Dispatched {
        let mut dispatches = recovery::dispatch_holders_first(load, interrupted, true);
        let checkpointed: Vec<u32> = dispatches
            .iter()
            .map(|d| {
                interrupted
                    .binary_search_by_key(&d.request_id, |r| r.request_id)
                    .map_or(0, |i| {
                        if d.kv_source.is_some() {
                            interrupted[i].checkpointed_tokens
                        } else {
                            0
                        }
                    })
            })
            .collect();
        let rebalance_moves = recovery::rebalance(load, &mut dispatches, &checkpointed);
        Dispatched {
            dispatches,
            rebalance_moves,
        }
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
