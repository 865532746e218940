//! The whole controller state out ([`Controller::snapshot`]) and back in
//! ([`Controller::from_snapshot`]).

use std::collections::BTreeMap;

use super::Controller;
use crate::WorkerId;
use crate::snapshot::{ControllerSnapshot, SNAPSHOT_FORMAT_VERSION};
use crate::{Error, Result};

impl Controller {
    /// Derive every holder's per-server attribution from the live requests (a snapshot carries
    /// it, but it is derived data; one written before it existed has none).
    fn rebuild_attribution(&mut self) {
        let mut held: BTreeMap<WorkerId, Vec<(WorkerId, u64)>> = BTreeMap::new();
        for r in self.requests.values() {
            if let Some(h) = r.holder {
                held.entry(h)
                    .or_default()
                    .push((r.serving, r.reserved_bytes));
            }
        }
        let ids: Vec<WorkerId> = self.load.iter().map(|w| w.id).collect();
        for id in ids {
            let pairs = held.remove(&id).unwrap_or_default();
            if let Some(row) = self.load.get_mut(id) {
                row.rebuild_attribution(pairs.into_iter());
            }
        }
    }

    /// The whole state as one serializable value.
    pub fn snapshot(&self) -> ControllerSnapshot {
        ControllerSnapshot {
            format_version: SNAPSHOT_FORMAT_VERSION,
            config: self.config.clone(),
            workers: self.load.clone(),
            requests: self.requests.values().cloned().collect(),
            terminal: self
                .terminal_order
                .iter()
                .filter_map(|id| self.terminal.get(id).cloned())
                .collect(),
            stats: self.stats.clone(),
        }
    }

    /// A controller rebuilt from a snapshot (the policy from `snapshot.config.policy`).
    ///
    /// # Errors
    /// [`Error::Protocol`] for another format version; [`Error::InvalidArgument`] when the
    /// configuration or the tables break an invariant (the snapshot is refused, not repaired).
    pub fn from_snapshot(snapshot: ControllerSnapshot) -> Result<Self> {
        if snapshot.format_version != SNAPSHOT_FORMAT_VERSION {
            return Err(Error::Protocol(format!(
                "control snapshot format {} (this build reads {SNAPSHOT_FORMAT_VERSION})",
                snapshot.format_version
            )));
        }
        let mut c = Controller::new(snapshot.config)?;
        if snapshot.workers.len() > c.config.max_workers as usize
            || snapshot.requests.len() > c.config.max_in_flight as usize
        {
            return Err(Error::InvalidArgument(
                "snapshot exceeds the configured limits".into(),
            ));
        }
        c.load = snapshot.workers;
        for r in snapshot.requests {
            if r.state.is_terminal() || c.requests.insert(r.id, r).is_some() {
                return Err(Error::InvalidArgument(
                    "snapshot: terminal or duplicate live request".into(),
                ));
            }
        }
        for r in snapshot.terminal {
            if !r.state.is_terminal() || c.requests.contains_key(&r.id) {
                return Err(Error::InvalidArgument(
                    "snapshot: bad terminal record".into(),
                ));
            }
            c.terminal_order.push_back(r.id);
            c.terminal.insert(r.id, r);
        }
        c.stats = snapshot.stats;
        c.rebuild_attribution();
        c.check_invariants()
            .map_err(|e| Error::InvalidArgument(format!("snapshot: {e}")))?;
        Ok(c)
    }
}
