//! Where a block changes state:
//!
//! ```text
//! ALLOCATED → WRITING → SEALED → PUBLISHED → (removed | evicted) → RETIRED while pinned → free
//!      ↘         ↘         ↘
//!               ABORTED (space returns to the pool)
//! ```
//!
//! Every function checks the handle's generations and the block's state first and changes
//! nothing when a check fails. Byte copies and checksums run outside the store's lock, with the
//! slot's `in_use` mark held so that the page cannot be freed or written concurrently.

use kvd_core::batch::check_batch;

use crate::error::{BlockState, Corruption};
use crate::keys::BlockKey;
use crate::state::{Class, Inner};
use crate::types::{
    Allocation, BlockClass, BlockEventKind, BlockVersion, Handle, ReservationId, SessionId,
};
use crate::{Error, Result};

/// What a write may do after [`Inner::write_prepare`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct WriteTicket {
    pub slot: u32,
    pub generation: u64,
    pub page_offset: u64,
    /// The running CRC to continue from when the write is sequential.
    pub running_crc: Option<u32>,
}

/// What a seal needs after [`Inner::seal_prepare`].
#[derive(Debug, Clone, Copy)]
pub(crate) enum SealStep {
    /// Sealed already with this checksum.
    Done(u32),
    /// Compute the checksum of `len` bytes at `page_offset` outside the lock, then finish.
    Checksum { slot: u32, page_offset: u64 },
}

impl Inner {
    pub(crate) fn check_batch(&mut self, n: usize) -> Result<()> {
        let checked = check_batch(n, self.config.max_batch);
        if checked.is_err() {
            self.counters.overload_rejects += 1;
        }
        checked
    }

    /// Allocate one block per key. Keys that exist already (published or being written) get
    /// [`Error::AlreadyExists`] in their place; the others are allocated all together or, when
    /// space runs out, none is.
    pub fn alloc(
        &mut self,
        sid: SessionId,
        keys: &[BlockKey],
        class: BlockClass,
        reservation: Option<ReservationId>,
    ) -> Result<Vec<Result<Allocation>>> {
        self.check_batch(keys.len())?;
        self.live_session(sid)?;
        for k in keys {
            if !self.namespaces.contains_key(&k.namespace) {
                return Err(Error::InvalidArgument(format!(
                    "unknown namespace {:?}; register its descriptor first",
                    k.namespace
                )));
            }
        }
        let (class, reservation) = match class {
            BlockClass::Cache => (Class::Cache, reservation),
            BlockClass::Checkpoint { request, epoch } => {
                let m = self.manifest_at(request, epoch)?;
                for k in keys {
                    if k.namespace != m.namespace {
                        return Err(Error::InvalidArgument(format!(
                            "checkpoint block {k} is not in the manifest's namespace"
                        )));
                    }
                }
                (
                    Class::Checkpoint { request, epoch },
                    reservation.or(m.reservation),
                )
            }
        };
        if let Some(r) = reservation {
            let request = match class {
                Class::Checkpoint { request, .. } => Some(request),
                Class::Cache => None,
            };
            self.check_reservation_owner(sid, r, request)?;
        }
        let pending = self.sessions.by_id[&sid].writing.len() + keys.len();
        if pending > self.config.max_blocks_in_flight_per_session as usize {
            self.counters.overload_rejects += 1;
            return Err(Error::Overloaded {
                what: format!(
                    "session would have {pending} unfinished blocks, the limit is {}",
                    self.config.max_blocks_in_flight_per_session
                ),
                retry_after_ms: 10,
            });
        }
        // Which keys are new (first occurrence in the batch, not in the index)?
        let mut seen = std::collections::HashSet::with_capacity(keys.len());
        let fresh: Vec<bool> = keys
            .iter()
            .map(|k| !self.index.contains_key(k) && seen.insert(*k))
            .collect();
        let n_new = fresh.iter().filter(|&&f| f).count() as u64;
        let mut from_reservation = self.plan_pages(n_new, reservation)?;
        let mut out = Vec::with_capacity(keys.len());
        for (k, is_new) in keys.iter().zip(fresh) {
            if !is_new {
                out.push(Err(Error::AlreadyExists(format!("block {k}"))));
                continue;
            }
            let i = self
                .take_slot(*k, class, sid)
                .expect("plan_pages guaranteed a free page");
            if from_reservation > 0 {
                let r = reservation.expect("planned from a reservation");
                self.draw_reservation(r);
                self.slots[i as usize].reservation = Some(r);
                from_reservation -= 1;
            }
            self.index.insert(*k, i);
            self.sessions
                .by_id
                .get_mut(&sid)
                .expect("live")
                .writing
                .insert(i);
            out.push(Ok(Allocation {
                handle: self.handle_of(i),
                offset: self.pool.page_offset(i),
                capacity: self.page_size(),
            }));
        }
        Ok(out)
    }

    /// Resolve a handle to a block `sid` is writing, in one of `states`.
    fn writer_slot(
        &mut self,
        sid: SessionId,
        h: &Handle,
        op: &'static str,
        states: &[BlockState],
    ) -> Result<u32> {
        self.live_session(sid)?;
        let i = self.resolve(h)?;
        self.owned_unfinished(sid, i)?;
        let st = self.state_of(i);
        if !states.contains(&st) {
            return Err(Error::IllegalTransition { from: st, op });
        }
        if self.slots[i as usize].in_use != 0 {
            self.counters.overload_rejects += 1;
            return Err(Error::Overloaded {
                what: format!("another copy into slot {i} is in progress"),
                retry_after_ms: 1,
            });
        }
        Ok(i)
    }

    /// Mark blocks WRITING for a writer that writes through its own mapping of the pool.
    pub fn begin_write(&mut self, sid: SessionId, h: &Handle) -> Result<Allocation> {
        let i = self.writer_slot(
            sid,
            h,
            "begin writing",
            &[BlockState::Allocated, BlockState::Writing],
        )?;
        if self.state_of(i) == BlockState::Allocated {
            self.set_state(i, BlockState::Writing);
        }
        // Bytes written through a mapping are not seen here: the checksum must come from the
        // writer or a pass at SEAL.
        self.slots[i as usize].running_crc = None;
        self.slots[i as usize].len = self.page_size();
        Ok(Allocation {
            handle: *h,
            offset: self.pool.page_offset(i),
            capacity: self.page_size(),
        })
    }

    pub fn write_prepare(
        &mut self,
        sid: SessionId,
        h: &Handle,
        offset: u64,
        len: u64,
    ) -> Result<WriteTicket> {
        let i = self.writer_slot(
            sid,
            h,
            "write",
            &[BlockState::Allocated, BlockState::Writing],
        )?;
        if offset
            .checked_add(len)
            .is_none_or(|end| end > self.page_size())
        {
            return Err(Error::InvalidArgument(format!(
                "write of {len} bytes at offset {offset} exceeds the {}-byte page",
                self.page_size()
            )));
        }
        if self.state_of(i) == BlockState::Allocated {
            self.set_state(i, BlockState::Writing);
        }
        let s = &mut self.slots[i as usize];
        s.in_use += 1;
        let running_crc = match s.running_crc {
            Some((covered, crc)) if covered == offset => Some(crc),
            _ => None,
        };
        Ok(WriteTicket {
            slot: i,
            generation: s.generation,
            page_offset: self.pool.page_offset(i) + offset,
            running_crc,
        })
    }

    pub fn write_finish(
        &mut self,
        t: &WriteTicket,
        offset: u64,
        len: u64,
        crc: Option<u32>,
    ) -> Result<()> {
        let s = &mut self.slots[t.slot as usize];
        debug_assert_eq!(s.generation, t.generation, "a busy slot is never reused");
        s.in_use -= 1;
        if s.state != Some(BlockState::Writing) {
            // The session expired (or the block was aborted) during the copy.
            self.settle(t.slot);
            return Err(Error::LeaseExpired(
                "the block was aborted while it was being written".into(),
            ));
        }
        s.len = s.len.max(offset + len);
        s.running_crc = match (s.running_crc, crc) {
            (Some((covered, _)), Some(c)) if covered == offset => Some((offset + len, c)),
            _ => None,
        };
        Ok(())
    }

    pub fn seal_prepare(
        &mut self,
        sid: SessionId,
        h: &Handle,
        len: u64,
        supplied: Option<u32>,
    ) -> Result<SealStep> {
        let i = self.writer_slot(sid, h, "seal", &[BlockState::Writing])?;
        if len > self.page_size() {
            return Err(Error::InvalidArgument(format!(
                "sealed length {len} exceeds the {}-byte page",
                self.page_size()
            )));
        }
        let s = &self.slots[i as usize];
        let known = match s.running_crc {
            Some((covered, crc)) if covered == len => Some(crc),
            _ => None,
        };
        let checksum = match (supplied, known) {
            (Some(c), Some(k)) if c != k => {
                return Err(Error::Corrupt {
                    expected: c,
                    found: k,
                    outcome: Corruption::AtSeal,
                });
            }
            (Some(c), _) if !self.config.verify_supplied_checksums => Some(c),
            (None, Some(k)) | (Some(_), Some(k)) => Some(k),
            _ => None,
        };
        if let Some(c) = checksum {
            self.seal_commit(sid, i, len, c);
            return Ok(SealStep::Done(c));
        }
        self.slots[i as usize].in_use += 1;
        Ok(SealStep::Checksum {
            slot: i,
            page_offset: self.pool.page_offset(i),
        })
    }

    pub fn seal_finish(
        &mut self,
        sid: SessionId,
        slot: u32,
        len: u64,
        computed: u32,
        supplied: Option<u32>,
    ) -> Result<u32> {
        let s = &mut self.slots[slot as usize];
        s.in_use -= 1;
        if s.state != Some(BlockState::Writing) {
            self.settle(slot);
            return Err(Error::LeaseExpired(
                "the block was aborted while it was being sealed".into(),
            ));
        }
        if let Some(c) = supplied
            && c != computed
        {
            self.counters.checksum_failures += 1;
            return Err(Error::Corrupt {
                expected: c,
                found: computed,
                outcome: Corruption::AtSeal,
            });
        }
        self.seal_commit(sid, slot, len, computed);
        Ok(computed)
    }

    fn seal_commit(&mut self, _sid: SessionId, i: u32, len: u64, checksum: u32) {
        let s = &mut self.slots[i as usize];
        s.len = len;
        s.checksum = checksum;
        s.running_crc = None;
        self.set_state(i, BlockState::Sealed);
    }

    /// Publish a group of SEALED cache blocks: all of them, or none.
    pub fn publish(&mut self, sid: SessionId, handles: &[Handle]) -> Result<()> {
        self.check_batch(handles.len())?;
        let slots = self.sealed_group(sid, handles, |c| {
            (c == Class::Cache).then_some(()).ok_or_else(|| {
                Error::InvalidArgument(
                    "checkpoint blocks are published with manifest_extend".into(),
                )
            })
        })?;
        for i in slots {
            self.publish_slot(sid, i);
        }
        Ok(())
    }

    /// Check a group for publishing: every handle current, owned by `sid`, SEALED, no duplicate,
    /// and of an acceptable class. Returns the slots; changes nothing.
    pub fn sealed_group(
        &mut self,
        sid: SessionId,
        handles: &[Handle],
        class_ok: impl Fn(Class) -> Result<()>,
    ) -> Result<Vec<u32>> {
        self.live_session(sid)?;
        let mut slots = Vec::with_capacity(handles.len());
        for h in handles {
            let i = self.resolve(h)?;
            self.owned_unfinished(sid, i)?;
            let st = self.state_of(i);
            if st != BlockState::Sealed {
                return Err(Error::IllegalTransition {
                    from: st,
                    op: "publish",
                });
            }
            class_ok(self.class_of(i))?;
            slots.push(i);
        }
        let mut sorted = slots.clone();
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0] == w[1]) {
            return Err(Error::InvalidArgument(
                "the group names a block twice".into(),
            ));
        }
        Ok(slots)
    }

    /// Make a SEALED block PUBLISHED: the one step group publish and `manifest_extend` share,
    /// so it logs the `Stored` event.
    pub fn publish_slot(&mut self, sid: SessionId, i: u32) {
        self.set_state(i, BlockState::Published);
        let key = self.slots[i as usize].key;
        debug_assert_eq!(self.index.get(&key), Some(&i), "a sealed block is indexed");
        self.events.push(BlockEventKind::Stored, key);
        let s = &mut self.slots[i as usize];
        s.owner = None;
        s.reservation = None;
        self.sessions
            .by_id
            .get_mut(&sid)
            .expect("live")
            .writing
            .remove(&i);
        self.counters.blocks_published += 1;
        self.settle(i);
    }

    /// Abort unfinished blocks; each handle gets its own result.
    pub fn abort(&mut self, sid: SessionId, handles: &[Handle]) -> Result<Vec<Result<()>>> {
        self.check_batch(handles.len())?;
        self.live_session(sid)?;
        Ok(handles
            .iter()
            .map(|h| {
                let i = self.writer_slot(
                    sid,
                    h,
                    "abort",
                    &[
                        BlockState::Allocated,
                        BlockState::Writing,
                        BlockState::Sealed,
                    ],
                );
                match i {
                    // A copy in progress: abort anyway; the page is freed when the copy ends.
                    Err(Error::Overloaded { .. }) => {
                        let i = h.slot;
                        self.abort_slot(i);
                        Ok(())
                    }
                    Err(e) => Err(e),
                    Ok(i) => {
                        self.abort_slot(i);
                        Ok(())
                    }
                }
            })
            .collect())
    }

    /// Compare-and-delete: remove the PUBLISHED cache block under `key` only if it is exactly the
    /// version `expected` (this incarnation and this block generation). A late delete for an old
    /// version, from this incarnation or an earlier one, never removes a newer block.
    pub fn remove_if(&mut self, key: &BlockKey, expected: BlockVersion) -> Result<()> {
        let node = self.config.node_generation;
        let Some(&i) = self.index.get(key) else {
            return Err(Error::NotFound(format!("block {key}")));
        };
        let s = &self.slots[i as usize];
        if expected.node_generation != node || s.generation != expected.generation {
            self.counters.stale_generation_rejects += 1;
            return Err(Error::StaleGeneration {
                handle_node: expected.node_generation,
                handle_slot: expected.generation,
                current_node: node,
                current_slot: s.generation,
            });
        }
        let st = self.state_of(i);
        if st != BlockState::Published {
            return Err(Error::IllegalTransition {
                from: st,
                op: "remove",
            });
        }
        if let Class::Checkpoint { request, .. } = s.class {
            return Err(Error::InvalidArgument(format!(
                "block {key} belongs to request {}'s checkpoint; finish its manifest instead",
                request
            )));
        }
        self.counters.blocks_removed += 1;
        self.retire_or_free(i);
        Ok(())
    }
}
