//! Instance groups: the ranks of one tensor- or pipeline-parallel engine instance, each its
//! own session, registered as one group `(instance id, instance generation, rank count)`.
//!
//! A checkpoint step of the instance is a group publish across sessions: each rank commits its
//! SEALED blocks of the step ([`Inner::instance_commit`]), and the step's blocks of every rank
//! become PUBLISHED together when the last rank commits, or none do. When a rank's session ends
//! (closed, or its lease expired), the instance fails as a whole: every unfinished step is
//! aborted on every rank (their committed blocks freed), later calls of its ranks are refused
//! with the reason, and the failure is reported ([`InstanceReport`]). A new generation of the
//! instance (the engine restarted it) replaces a failed or older one.

use std::collections::{BTreeMap, HashMap};

use kvd_core::error::{Error, Result};
use kvd_core::types::{Handle, SessionId};
use serde::{Deserialize, Serialize};

use crate::state::Inner;

/// Ranks one instance may have.
pub const MAX_RANKS: u32 = 64;
/// Instances known at once.
pub const MAX_INSTANCES: usize = 1024;
/// Steps of one instance committed by some ranks and not yet by all.
pub const MAX_OPEN_STEPS: usize = 64;
/// Failed instances remembered (for reports and to refuse their late calls).
const MAX_FAILED: usize = 256;

/// What `/status` shows of an instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceReport {
    /// Its id.
    pub instance: u64,
    /// Its generation.
    pub generation: u64,
    /// Ranks it has.
    pub rank_count: u32,
    /// Ranks registered so far.
    pub ranks_joined: u32,
    /// Steps committed by some ranks, not yet by all.
    pub open_steps: u32,
    /// Steps published (by every rank).
    pub steps_published: u64,
    /// Why it failed, if it did.
    pub failed: Option<String>,
}

#[derive(Debug)]
struct Instance {
    generation: u64,
    ranks: Vec<Option<SessionId>>,
    /// step → per rank, the handles it committed (None: not yet).
    steps: BTreeMap<u64, Vec<Option<Vec<Handle>>>>,
    published: u64,
    failed: Option<String>,
}

/// The instances of a store.
#[derive(Debug, Default)]
pub struct Instances {
    by_id: HashMap<u64, Instance>,
    /// session → (instance, rank).
    by_session: HashMap<SessionId, (u64, u32)>,
    failed_order: Vec<u64>,
}

fn failed(id: u64, why: &str) -> Error {
    Error::Unavailable(format!(
        "instance {id} has failed ({why}); restart it with a new generation"
    ))
}

impl Inner {
    /// Register `sid` as rank `rank` of instance `(id, generation)` of `rank_count` ranks.
    /// Idempotent for the same session.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad rank or count, a count that disagrees with the
    /// instance's, a rank taken by another session, or a session that is a rank already;
    /// [`Error::StaleEpoch`] for an older generation than the instance's; [`Error::Unavailable`]
    /// for a failed instance of this generation; [`Error::Overloaded`] past the bound.
    pub fn instance_join(
        &mut self,
        sid: SessionId,
        id: u64,
        generation: u64,
        rank: u32,
        rank_count: u32,
    ) -> Result<()> {
        self.live_session(sid)?;
        if rank_count == 0 || rank_count > MAX_RANKS || rank >= rank_count {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} of {rank_count}: 1 to {MAX_RANKS} ranks, rank below the count"
            )));
        }
        let inst = &mut self.instances;
        if let Some(&(other, r)) = inst.by_session.get(&sid)
            && (other, r) != (id, rank)
        {
            return Err(Error::InvalidArgument(format!(
                "this session is rank {r} of instance {other} already"
            )));
        }
        match inst.by_id.get(&id) {
            Some(i) if i.generation > generation => {
                return Err(Error::StaleEpoch {
                    got: generation,
                    current: i.generation,
                });
            }
            Some(i) if i.generation == generation => {
                if let Some(why) = &i.failed {
                    return Err(failed(id, why));
                }
                if i.ranks.len() != rank_count as usize {
                    return Err(Error::InvalidArgument(format!(
                        "instance {id} generation {generation} has {} ranks, not {rank_count}",
                        i.ranks.len()
                    )));
                }
                match i.ranks[rank as usize] {
                    Some(s) if s == sid => return Ok(()),
                    Some(_) => {
                        return Err(Error::InvalidArgument(format!(
                            "rank {rank} of instance {id} is another session's"
                        )));
                    }
                    None => {}
                }
            }
            // an older generation (or none): this one replaces it
            _ => {
                if !inst.by_id.contains_key(&id) && inst.by_id.len() >= MAX_INSTANCES {
                    return Err(Error::Overloaded {
                        what: format!("{MAX_INSTANCES} instances registered (the limit)"),
                        retry_after_ms: 1000,
                    });
                }
                let old = inst.by_id.insert(
                    id,
                    Instance {
                        generation,
                        ranks: vec![None; rank_count as usize],
                        steps: BTreeMap::new(),
                        published: 0,
                        failed: None,
                    },
                );
                if let Some(old) = old {
                    for s in old.ranks.into_iter().flatten() {
                        inst.by_session.remove(&s);
                    }
                    inst.failed_order.retain(|&f| f != id);
                    self.abort_steps(old.steps);
                }
            }
        }
        let inst = &mut self.instances;
        inst.by_id.get_mut(&id).expect("present").ranks[rank as usize] = Some(sid);
        inst.by_session.insert(sid, (id, rank));
        Ok(())
    }

    /// Rank `sid` commits its SEALED blocks `handles` (cache class) of step `step` of instance
    /// `(id, generation)`. Returns whether this commit completed the step: then every rank's
    /// blocks of it are PUBLISHED, together.
    ///
    /// # Errors
    /// As [`Inner::instance_join`]'s checks; [`Error::InvalidArgument`] for a session that is no
    /// rank of the instance, a step committed twice by a rank, or a step past the bound; the
    /// group checks of a publish for `handles` (changing nothing). A completing commit whose
    /// group fails its checks (a block aborted meanwhile) aborts the whole step and fails.
    pub fn instance_commit(
        &mut self,
        sid: SessionId,
        id: u64,
        generation: u64,
        step: u64,
        handles: &[Handle],
    ) -> Result<bool> {
        self.check_batch(handles.len())?;
        let rank = self.rank_of(sid, id, generation)?;
        // the rank's own blocks must be publishable now (checked, not changed)
        self.sealed_group(sid, handles, |c| {
            (c == crate::state::Class::Cache)
                .then_some(())
                .ok_or_else(|| Error::InvalidArgument("instance steps publish cache blocks".into()))
        })?;
        let i = self
            .instances
            .by_id
            .get_mut(&id)
            .expect("a rank's instance");
        let n = i.ranks.len();
        if !i.steps.contains_key(&step) && i.steps.len() >= MAX_OPEN_STEPS {
            return Err(Error::Overloaded {
                what: format!("{MAX_OPEN_STEPS} steps of instance {id} are open"),
                retry_after_ms: 10,
            });
        }
        let entry = i.steps.entry(step).or_insert_with(|| vec![None; n]);
        if entry[rank as usize].is_some() {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} committed step {step} of instance {id} already"
            )));
        }
        entry[rank as usize] = Some(handles.to_vec());
        if entry.iter().any(Option::is_none) {
            return Ok(false);
        }
        // the last rank: publish every rank's blocks of the step, all or none
        let parts = i.steps.remove(&step).expect("present");
        let ranks = i.ranks.clone();
        let mut groups = Vec::with_capacity(n);
        for (r, hs) in parts.iter().enumerate() {
            let owner = ranks[r].expect("every rank joined before committing");
            let hs = hs.as_ref().expect("complete");
            match self.sealed_group(owner, hs, |_| Ok(())) {
                Ok(slots) => groups.push((owner, slots)),
                Err(e) => {
                    self.abort_steps(BTreeMap::from([(step, parts)]));
                    return Err(Error::InvalidArgument(format!(
                        "step {step} of instance {id} cannot be published (rank {r}: {e}); it was aborted on every rank"
                    )));
                }
            }
        }
        for (owner, slots) in groups {
            for s in slots {
                self.publish_slot(owner, s);
            }
        }
        self.instances
            .by_id
            .get_mut(&id)
            .expect("present")
            .published += 1;
        Ok(true)
    }

    /// The rank `sid` is of instance `(id, generation)`.
    fn rank_of(&mut self, sid: SessionId, id: u64, generation: u64) -> Result<u32> {
        self.live_session(sid)?;
        let i = self
            .instances
            .by_id
            .get(&id)
            .ok_or_else(|| Error::NotFound(format!("instance {id}")))?;
        if i.generation != generation {
            return Err(Error::StaleEpoch {
                got: generation,
                current: i.generation,
            });
        }
        if let Some(why) = &i.failed {
            return Err(failed(id, why));
        }
        match self.instances.by_session.get(&sid) {
            Some(&(iid, r)) if iid == id => Ok(r),
            _ => Err(Error::InvalidArgument(format!(
                "this session is no rank of instance {id}"
            ))),
        }
    }

    /// A session ended: if it was a rank, its instance fails as a whole and every unfinished
    /// step is aborted on every rank. Called by `close_session` before the session's own
    /// blocks go.
    pub fn instance_session_ended(&mut self, sid: SessionId, why: &str) {
        let Some((id, rank)) = self.instances.by_session.remove(&sid) else {
            return;
        };
        let Some(i) = self.instances.by_id.get_mut(&id) else {
            return;
        };
        let steps = std::mem::take(&mut i.steps);
        i.failed
            .get_or_insert_with(|| format!("rank {rank}'s session {why}"));
        for s in i.ranks.iter_mut() {
            if let Some(s) = s.take() {
                self.instances.by_session.remove(&s);
            }
        }
        self.instances.failed_order.push(id);
        if self.instances.failed_order.len() > MAX_FAILED {
            let oldest = self.instances.failed_order.remove(0);
            self.instances.by_id.remove(&oldest);
        }
        self.abort_steps(steps);
    }

    /// Abort the committed, unpublished blocks of `steps` (each still owned by its rank's
    /// session, if that session still holds it).
    fn abort_steps(&mut self, steps: BTreeMap<u64, Vec<Option<Vec<Handle>>>>) {
        for hs in steps.into_values().flatten().flatten() {
            for h in hs {
                if let Ok(i) = self.resolve(&h)
                    && matches!(self.state_of(i), kvd_core::error::BlockState::Sealed)
                {
                    self.abort_slot(i);
                }
            }
        }
    }

    /// Every known instance, for `/status` (at most `max`).
    pub fn instance_reports(&self, max: usize) -> Vec<InstanceReport> {
        let mut v: Vec<InstanceReport> = self
            .instances
            .by_id
            .iter()
            .map(|(&id, i)| InstanceReport {
                instance: id,
                generation: i.generation,
                rank_count: i.ranks.len() as u32,
                ranks_joined: i.ranks.iter().flatten().count() as u32,
                open_steps: i.steps.len() as u32,
                steps_published: i.published,
                failed: i.failed.clone(),
            })
            .collect();
        v.sort_by_key(|r| r.instance);
        v.truncate(max);
        v
    }
}
