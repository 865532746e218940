//! Readers: lookups, pins with a TTL, and reads of pinned blocks.
//!
//! Only PUBLISHED blocks are visible (invariant 1, docs/ARCHITECTURE.md). A pin keeps a block's page from being
//! reused: a block removed or evicted while pinned is RETIRED and its page returns to the pool
//! when the last pin is released or expires. Every pin belongs to a session and has a TTL.

use kvd_core::batch::check_batch;

use crate::error::{BlockState, Corruption};
use crate::keys::{BlockKey, BlockTag, NamespaceId};
use crate::sessions::Pin;
use crate::types::{BlockInfo, Handle, PrefixHit, SessionId};
use crate::{Error, Result};

use crate::state::Inner;

/// The pins room: every pin's deadline across sessions (each session keeps its own pins), and
/// how many (session, slot) pins there are.
///
/// Invariant (checked by `Store::check_invariants`): `count` equals the number of entries in
/// `expiry` and the sum of the sessions' pin maps' sizes.
#[derive(Debug, Default)]
pub(crate) struct PinIndex {
    pub expiry: std::collections::BTreeSet<(u64, SessionId, u32)>,
    pub count: u64,
}

/// A read the caller may do outside the lock after [`Inner::read_prepare`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReadTicket {
    pub slot: u32,
    pub page_offset: u64,
    pub len: u64,
    pub checksum: u32,
}

impl Inner {
    /// The published block under `key`, if any.
    pub fn find_published(&mut self, key: &BlockKey) -> Option<u32> {
        self.counters.lookups += 1;
        let &i = self.index.get(key)?;
        if self.slots[i as usize].state != Some(BlockState::Published) {
            return None;
        }
        self.counters.hits += 1;
        Some(i)
    }

    /// Look keys up without pinning; touches the LRU.
    pub fn lookup(&mut self, keys: &[BlockKey]) -> Vec<Option<BlockInfo>> {
        keys.iter()
            .map(|k| {
                let i = self.find_published(k)?;
                self.lru_touch(i);
                Some(self.info_of(i))
            })
            .collect()
    }

    fn pin_ttl(&self, ttl_ms: Option<u64>) -> Result<u64> {
        let ttl = ttl_ms.unwrap_or(self.config.default_pin_ttl_ms);
        if ttl == 0 || ttl > self.config.max_pin_ttl_ms {
            return Err(Error::InvalidArgument(format!(
                "pin TTL {ttl} ms outside 1..={} ms",
                self.config.max_pin_ttl_ms
            )));
        }
        Ok(ttl)
    }

    /// Pin slot `i` (PUBLISHED) for `sid` until `now + ttl`.
    fn pin(&mut self, sid: SessionId, i: u32, ttl_ms: u64) -> Result<()> {
        let now = self.now();
        let generation = self.slots[i as usize].generation;
        let max = self.config.max_pins_per_session as usize;
        let sess = self
            .sessions
            .by_id
            .get_mut(&sid)
            .expect("caller checked the session");
        let expires_at_ms = now + ttl_ms;
        match sess.pins.get_mut(&i) {
            Some(p) => {
                let old = p.expires_at_ms;
                p.count = p.count.saturating_add(1);
                p.expires_at_ms = p.expires_at_ms.max(expires_at_ms);
                let new = p.expires_at_ms;
                self.pins.expiry.remove(&(old, sid, i));
                self.pins.expiry.insert((new, sid, i));
            }
            None => {
                if sess.pins.len() >= max {
                    self.counters.overload_rejects += 1;
                    return Err(Error::Overloaded {
                        what: format!("session holds {max} pins (the limit); release some"),
                        retry_after_ms: 10,
                    });
                }
                sess.pins.insert(
                    i,
                    Pin {
                        generation,
                        count: 1,
                        expires_at_ms,
                    },
                );
                self.pins.expiry.insert((expires_at_ms, sid, i));
                self.slots[i as usize].pins += 1;
                self.pins.count += 1;
                self.lru_remove(i);
            }
        }
        Ok(())
    }

    /// Pin the PUBLISHED blocks under `keys`; each key gets its own result.
    pub fn acquire(
        &mut self,
        sid: SessionId,
        keys: &[BlockKey],
        ttl_ms: Option<u64>,
    ) -> Result<Vec<Result<BlockInfo>>> {
        check_batch(keys.len(), self.config.max_batch)?;
        let ttl = self.pin_ttl(ttl_ms)?;
        self.live_session(sid)?;
        Ok(keys
            .iter()
            .map(|k| {
                let i = self
                    .find_published(k)
                    .ok_or_else(|| Error::NotFound(format!("block {k}")))?;
                self.pin(sid, i, ttl)?;
                Ok(BlockInfo {
                    pin_ttl_ms: ttl,
                    ..self.info_of(i)
                })
            })
            .collect())
    }

    /// Release one pin per handle. A handle the session does not pin (or a stale one) gets an
    /// error in its place.
    pub fn release(&mut self, sid: SessionId, handles: &[Handle]) -> Result<Vec<Result<()>>> {
        self.live_session(sid)?;
        Ok(handles.iter().map(|h| self.release_one(sid, h)).collect())
    }

    fn release_one(&mut self, sid: SessionId, h: &Handle) -> Result<()> {
        let i = self.resolve(h)?;
        let sess = self.sessions.by_id.get_mut(&sid).expect("live");
        let Some(p) = sess.pins.get_mut(&i) else {
            return Err(Error::NotFound(format!(
                "session {} holds no pin on slot {i}",
                sid.0
            )));
        };
        p.count -= 1;
        if p.count == 0 {
            let p = sess.pins.remove(&i).expect("present");
            self.pins.expiry.remove(&(p.expires_at_ms, sid, i));
            self.drop_pin_entry(i, p.generation);
        }
        Ok(())
    }

    /// The longest run of `tags` (from the first) that is PUBLISHED in `namespace`, pinned for
    /// `pin_for` when given.
    pub fn lookup_prefix(
        &mut self,
        namespace: &NamespaceId,
        tags: &[BlockTag],
        pin_for: Option<(SessionId, Option<u64>)>,
    ) -> Result<PrefixHit> {
        let ttl = match pin_for {
            Some((sid, ttl)) => {
                let ttl = self.pin_ttl(ttl)?;
                self.live_session(sid)?;
                Some((sid, ttl))
            }
            None => None,
        };
        let mut blocks = Vec::new();
        for tag in tags {
            let key = BlockKey {
                namespace: *namespace,
                tag: *tag,
            };
            let Some(i) = self.find_published(&key) else {
                break;
            };
            if let Some((sid, ttl)) = ttl
                && self.pin(sid, i, ttl).is_err()
            {
                break; // out of pins: the prefix ends here, the caller still gets what it pinned
            }
            self.lru_touch(i);
            blocks.push(BlockInfo {
                pin_ttl_ms: ttl.map_or(0, |(_, t)| t),
                ..self.info_of(i)
            });
        }
        Ok(PrefixHit {
            blocks,
            pinned: ttl.is_some(),
        })
    }

    /// Start a read of a block the session has pinned.
    pub fn read_prepare(&mut self, sid: SessionId, h: &Handle) -> Result<ReadTicket> {
        self.live_session(sid)?;
        let i = self.resolve(h)?;
        if !self.sessions.by_id[&sid].pins.contains_key(&i) {
            return Err(Error::InvalidArgument(format!(
                "read of slot {i} without a pin: acquire the block first"
            )));
        }
        let st = self.state_of(i);
        if st != BlockState::Published && st != BlockState::Retired {
            return Err(Error::IllegalTransition {
                from: st,
                op: "read",
            });
        }
        let s = &mut self.slots[i as usize];
        s.in_use += 1;
        Ok(ReadTicket {
            slot: i,
            page_offset: self.pool.page_offset(i),
            len: s.len,
            checksum: s.checksum,
        })
    }

    /// End a read; `computed` is the checksum of the bytes read when the caller verified them.
    pub fn read_finish(&mut self, t: &ReadTicket, computed: Option<u32>) -> Result<()> {
        self.slots[t.slot as usize].in_use -= 1;
        let result = match computed {
            Some(c) if c != t.checksum => {
                self.quarantine(t.slot);
                Err(Error::Corrupt {
                    expected: t.checksum,
                    found: c,
                    outcome: Corruption::Quarantined,
                })
            }
            _ => Ok(()),
        };
        self.settle(t.slot);
        result
    }
}
