//! The policies a simulation compares: the control shim's three ([`PolicyKind`]) and one
//! what-if variant of Lumen's placement that the simulator can run on request.
//!
//! The what-if, [`SumOfHeldPlacement`], answers a question the default sweep raised: Lumen's
//! score `q_w + λ·p_w` uses the *mean* footprint of the checkpoints `w` holds, which does not
//! grow as `w` takes more, so checkpoints herd onto the worker with the lowest queueing delay.
//! The variant scores `q_w + λ·(total footprint held by w + this request's) / bandwidth` (the
//! time to restore everything `w` would hold), and otherwise *is* Lumen: its dispatch and
//! rebalancing are [`Lumen::dispatch`] itself, and the controller around it is the real one.
//! It is not part of the default comparison; `kvd sim run --what-if-sum-placement` adds it.

use serde::Serialize;

use crate::control::placement::{ScoreParams, eligible};
use crate::control::recovery::{Dispatched, Interrupted};
use crate::control::{ControlConfig, Controller, LoadTable, Lumen, Policy, PolicyKind, WorkerId};

/// A policy the simulator runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum SimPolicy {
    /// The control shim's [`Lumen`].
    Lumen,
    /// The control shim's `FixedRing`.
    FixedRing,
    /// The control shim's `StopRestart` (the baseline of every comparison).
    StopRestart,
    /// Lumen with [`SumOfHeldPlacement`] (a what-if; not a policy the shim ships).
    LumenSumPlacement,
}

impl SimPolicy {
    /// The baseline every table compares against.
    pub const BASELINE: SimPolicy = SimPolicy::StopRestart;

    /// The shim policy it is, or builds on.
    pub fn kind(self) -> PolicyKind {
        match self {
            SimPolicy::Lumen | SimPolicy::LumenSumPlacement => PolicyKind::Lumen,
            SimPolicy::FixedRing => PolicyKind::FixedRing,
            SimPolicy::StopRestart => PolicyKind::StopRestart,
        }
    }

    /// Its name in tables, files and plots.
    pub fn name(self) -> &'static str {
        match self {
            SimPolicy::Lumen => "lumen",
            SimPolicy::FixedRing => "fixed_ring",
            SimPolicy::StopRestart => "stop_restart",
            SimPolicy::LumenSumPlacement => "lumen_sum_placement",
        }
    }

    /// A controller running this policy with `config` (whose `policy` field is overwritten).
    ///
    /// # Errors
    /// What [`Controller::new`] returns for a bad configuration.
    pub fn controller(self, mut config: ControlConfig) -> crate::Result<Controller> {
        config.policy = self.kind();
        match self {
            SimPolicy::LumenSumPlacement => {
                let params = config.score_params();
                Controller::with_policy(config, Box::new(SumOfHeldPlacement { params }))
            }
            _ => Controller::new(config),
        }
    }
}

impl From<PolicyKind> for SimPolicy {
    fn from(k: PolicyKind) -> Self {
        match k {
            PolicyKind::Lumen => SimPolicy::Lumen,
            PolicyKind::FixedRing => SimPolicy::FixedRing,
            PolicyKind::StopRestart => SimPolicy::StopRestart,
        }
    }
}

/// Lumen with a placement score that grows with what a worker already holds:
/// `q_w + λ · (reserved_w + reserve) / host-to-GPU bandwidth`. Ties: fewer held checkpoints,
/// then the lower id. Dispatch is [`Lumen`]'s.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SumOfHeldPlacement {
    /// λ and the bandwidth, as Lumen's.
    pub params: ScoreParams,
}

impl Policy for SumOfHeldPlacement {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Lumen
    }

    fn place(&self, load: &LoadTable, serving: WorkerId, reserve_bytes: u64) -> Option<WorkerId> {
        let bw = self.params.host_to_gpu_bytes_per_ms.max(1) as f64;
        let mut best: Option<(f64, u32, WorkerId)> = None;
        for w in load.in_service() {
            if !eligible(w, serving, reserve_bytes) {
                continue;
            }
            let restore_all_ms = (w.reserved_bytes + reserve_bytes) as f64 / bw;
            let key = (
                w.queue_delay_ms() + self.params.lambda * restore_all_ms,
                w.held_checkpoints,
                w.id,
            );
            let better =
                best.is_none_or(|b| key.0 < b.0 || (key.0 == b.0 && (key.1, key.2) < (b.1, b.2)));
            if better {
                best = Some(key);
            }
        }
        best.map(|b| b.2)
    }

    fn dispatch(&self, load: &LoadTable, interrupted: &[Interrupted]) -> Dispatched {
        Lumen {
            params: self.params,
        }
        .dispatch(load, interrupted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admit(
        c: &mut Controller,
        id: u64,
        serving: WorkerId,
        reserve_bytes: u64,
    ) -> Option<WorkerId> {
        c.admit(
            crate::control::AdmitRequest {
                request_id: id,
                serving,
                prompt_tokens: 1000,
                max_new_tokens: 100,
                reserve_bytes,
                deadline_ms: None,
            },
            0,
        )
        .unwrap()
        .holder
    }

    #[test]
    fn the_sum_placement_spreads_checkpoints_that_lumen_herds() {
        // Workers 1, 2, 3 have queueing delays of 30, 20 and 10 ms; worker 0 serves 12
        // requests of 256 MiB reservations (10.7 ms of restore each at 25 GB/s). Lumen's score
        // q_w + mean held footprint stops growing once a worker holds one checkpoint, so
        // worker 3 takes nearly all; the sum grows with each one held, so all three share.
        let mut counts = Vec::new();
        for policy in [SimPolicy::Lumen, SimPolicy::LumenSumPlacement] {
            let mut c = policy.controller(ControlConfig::default()).unwrap();
            for w in 0..4 {
                c.add_worker(w, 100 << 30, 0).unwrap();
            }
            for (w, q_ms) in [(1u32, 30u64), (2, 20), (3, 10)] {
                let id = 100 + u64::from(w);
                assert_eq!(admit(&mut c, id, w, 0), None, "no reservation, no holder");
                c.prefill_started(id, 1, q_ms).unwrap();
            }
            let mut per_holder = [0u32; 4];
            for r in 0..12 {
                per_holder[admit(&mut c, r, 0, 1 << 28).unwrap() as usize] += 1;
            }
            counts.push(per_holder);
        }
        assert!(
            counts[0][3] >= 10,
            "Lumen herds onto worker 3: {:?}",
            counts[0]
        );
        assert!(
            counts[1][1..].iter().all(|&n| (2..=6).contains(&n)),
            "the sum spreads: {:?}",
            counts[1]
        );
    }
}
