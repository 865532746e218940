//! The invariants of the tables, checked after every mutating event in debug builds and on
//! every snapshot restore.

use std::collections::BTreeMap;

use super::Controller;
use crate::WorkerId;
use crate::load::WorkerLoad;

impl Controller {
    /// Check every invariant of the tables; the first broken one is described.
    ///
    /// - a holder is never the serving worker, and is in service;
    /// - every live request's serving worker is in service;
    /// - per worker, reservations and held counts equal the sums over the requests, and
    ///   reservations never exceed capacity;
    /// - per worker, the serving count equals the live requests it serves;
    /// - assist pairs are mutual.
    ///
    /// # Errors
    /// A description of the first broken invariant.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let sums = self.check_requests()?;
        self.check_workers(&sums)?;
        self.check_attribution()
    }

    /// Per holder, the bytes it holds for each serving worker equal the reservations of the
    /// requests that worker serves and it holds (what the per-server placement rule reads).
    fn check_attribution(&self) -> std::result::Result<(), String> {
        let mut want: BTreeMap<(WorkerId, WorkerId), u64> = BTreeMap::new();
        for r in self.requests.values() {
            if let Some(h) = r.holder {
                *want.entry((h, r.serving)).or_default() += r.reserved_bytes;
            }
        }
        let mut have: BTreeMap<(WorkerId, WorkerId), u64> = BTreeMap::new();
        for w in self.load.iter() {
            for (s, b) in w.held_by_server() {
                have.insert((w.id, s), b);
            }
        }
        if want != have {
            let diff = want
                .iter()
                .find(|(k, v)| have.get(k) != Some(v))
                .map(|(k, v)| (*k, *v, have.get(k).copied().unwrap_or(0)))
                .or_else(|| {
                    have.iter()
                        .find(|(k, _)| !want.contains_key(k))
                        .map(|(k, v)| (*k, 0, *v))
                });
            return Err(format!(
                "holder/server attribution (holder, server), want bytes, have bytes: {diff:?}"
            ));
        }
        Ok(())
    }

    /// The per-request invariants; returns, per worker, what the requests say it holds and
    /// serves: `(reserved bytes, held checkpoints, served requests)`.
    fn check_requests(&self) -> std::result::Result<BTreeMap<WorkerId, (u64, u32, u32)>, String> {
        let mut sums: BTreeMap<WorkerId, (u64, u32, u32)> = BTreeMap::new();
        for r in self.requests.values() {
            if r.state.is_terminal() {
                return Err(format!("request {} is terminal but live", r.id));
            }
            if r.holder == Some(r.serving) {
                return Err(format!(
                    "request {}: holder {} is its serving worker",
                    r.id, r.serving
                ));
            }
            if !self.load.get(r.serving).is_some_and(WorkerLoad::in_service) {
                return Err(format!(
                    "request {}: serving worker {} not in service",
                    r.id, r.serving
                ));
            }
            match r.holder {
                Some(h) => {
                    if !self.load.get(h).is_some_and(WorkerLoad::in_service) {
                        return Err(format!("request {}: holder {h} not in service", r.id));
                    }
                    if r.reserved_bytes != r.reserve_bytes {
                        return Err(format!(
                            "request {}: reserved {} != asked {}",
                            r.id, r.reserved_bytes, r.reserve_bytes
                        ));
                    }
                    let e = sums.entry(h).or_default();
                    e.0 += r.reserved_bytes;
                    e.1 += 1;
                }
                None if r.reserved_bytes != 0 || r.checkpointed_tokens != 0 => {
                    return Err(format!("request {}: reservation without holder", r.id));
                }
                None => {}
            }
            sums.entry(r.serving).or_default().2 += 1;
        }
        Ok(sums)
    }

    /// The per-worker invariants, against the sums the requests give.
    fn check_workers(
        &self,
        sums: &BTreeMap<WorkerId, (u64, u32, u32)>,
    ) -> std::result::Result<(), String> {
        for w in self.load.iter() {
            let (bytes, held, serving) = sums.get(&w.id).copied().unwrap_or_default();
            if w.reserved_bytes != bytes || w.held_checkpoints != held {
                return Err(format!(
                    "worker {}: reserved {}/{} held, requests say {bytes}/{held}",
                    w.id, w.reserved_bytes, w.held_checkpoints
                ));
            }
            if w.reserved_bytes > w.capacity_bytes {
                return Err(format!(
                    "worker {}: reserved {} > capacity {}",
                    w.id, w.reserved_bytes, w.capacity_bytes
                ));
            }
            if w.serving_requests != serving {
                return Err(format!(
                    "worker {}: serving {} != {serving}",
                    w.id, w.serving_requests
                ));
            }
            if let Some(s) = w.assisting
                && self.load.get(s).and_then(|s| s.assisted_by) != Some(w.id)
            {
                return Err(format!("worker {}: assist pair with {s} not mutual", w.id));
            }
        }
        Ok(())
    }

    pub(super) fn debug_check(&self) {
        #[cfg(debug_assertions)]
        if self.requests.len() <= 4096
            && let Err(e) = self.check_invariants()
        {
            panic!("control invariant broken: {e}");
        }
    }
}
