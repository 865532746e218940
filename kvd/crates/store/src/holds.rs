//! Hand-off holds: a prefill's run of published blocks, kept for the decode that fetches it.
//!
//! A hold is `(request id, epoch, ordered block keys, TTL)`, owned by the daemon rather than
//! by a session, so the prefill engine can give its memory back (or die) while the decode
//! still reads the run. It pins the leading run of its keys that is PUBLISHED when it begins;
//! a fetch bound to `(request, epoch)` is served only while the hold lives and only for keys
//! inside it (`Inner::hold_check`), so a late fetch of an older attempt, or one naming another
//! request's run, is refused and never sees another request's blocks.
//!
//! A hold ends when its owner says so (the front, at the decode's first token or the
//! request's end; the producer's engine), when the decode that fetched it says so (`taken`),
//! or when its TTL passes (the reaper; counted as `holds_expired`). A newer epoch supersedes
//! an older one, and an ended epoch cannot be held again (a late begin is stale), even when
//! the end came before the begin (a cancel that overtook the prefill's answer). Holds are
//! bounded in number (`max_manifests`) and in length (`max_manifest_blocks`), with a TTL within
//! `max_manifest_ttl_ms`, like checkpoint manifests.

use std::collections::{BTreeSet, HashMap};

use crate::keys::BlockKey;
use crate::manifest::Ended;
use crate::state::Inner;
use crate::types::{HoldInfo, HoldsSummary, RequestId};
use crate::{Error, Result};

#[derive(Debug, Clone)]
pub(crate) struct Hold {
    pub epoch: u64,
    /// The keys held, in order (the leading run of the keys asked for that was PUBLISHED).
    pub keys: Vec<BlockKey>,
    /// Their slots: (slot, generation), each pinned once by this hold.
    pub blocks: Vec<(u32, u64)>,
    pub bytes: u64,
    pub begun_at_ms: u64,
    pub expires_at_ms: u64,
}

/// How a hold ended (which counter it adds to).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldEnd {
    /// Its owner ended it (the request is over, or the decode has what it needs).
    Ended,
    /// The decode that fetched the whole run ended it.
    Taken,
}

/// The holds room: each request's hold, the deadlines in expiry order, and the epochs of
/// recently ended holds (so a late begin of an ended epoch is stale).
///
/// Invariant: `expiry` holds exactly one entry per hold, and each hold's blocks are pinned
/// once by it (`Inner::check_invariants` counts hold pins with the sessions' pins).
#[derive(Debug, Default)]
pub(crate) struct Holds {
    pub by_request: HashMap<RequestId, Hold>,
    pub expiry: BTreeSet<(u64, RequestId)>,
    pub ended: Ended,
}

impl Holds {
    /// The room's invariant.
    pub fn check(&self) -> Result<(), String> {
        if self.expiry.len() != self.by_request.len() {
            return Err(format!(
                "{} hold deadlines for {} holds",
                self.expiry.len(),
                self.by_request.len()
            ));
        }
        for (r, h) in &self.by_request {
            if !self.expiry.contains(&(h.expires_at_ms, *r)) || h.keys.len() != h.blocks.len() {
                return Err(format!("hold of request {r} is inconsistent"));
            }
        }
        Ok(())
    }

    /// Pins the holds keep on each slot (for the pin-count invariant).
    pub fn pins(&self) -> impl Iterator<Item = (u32, u64)> + '_ {
        self.by_request
            .values()
            .flat_map(|h| h.blocks.iter().copied())
    }
}

impl Inner {
    /// Hold the leading PUBLISHED run of `keys` for `request` at `epoch`, for `ttl_ms`.
    /// The same epoch again renews the TTL (idempotent); a newer one supersedes the older
    /// hold; an older or ended one is refused as stale.
    ///
    /// # Errors
    /// `InvalidArgument` for no keys, too many, keys of two namespaces or a TTL out of range;
    /// `StaleEpoch`; `NotFound` when the first key is not published here (nothing is held);
    /// `Overloaded` at the bound on holds.
    pub fn hold_begin(
        &mut self,
        request: RequestId,
        epoch: u64,
        keys: &[BlockKey],
        ttl_ms: u64,
    ) -> Result<HoldInfo> {
        self.check_hold_args(request, epoch, keys, ttl_ms)?;
        if let Some(ended) = self.holds.ended.epoch(request)
            && epoch <= ended
        {
            return Err(Error::StaleEpoch {
                got: epoch,
                current: ended,
            });
        }
        let now = self.now();
        match self.holds.by_request.get(&request) {
            Some(h) if h.epoch > epoch => {
                return Err(Error::StaleEpoch {
                    got: epoch,
                    current: h.epoch,
                });
            }
            Some(h) if h.epoch == epoch => {
                let old = h.expires_at_ms;
                self.holds.expiry.remove(&(old, request));
                let h = self.holds.by_request.get_mut(&request).expect("present");
                h.expires_at_ms = now + ttl_ms;
                self.holds.expiry.insert((now + ttl_ms, request));
                return Ok(self.hold_info_of(request, now));
            }
            Some(_) => self.hold_release(request),
            None if self.holds.by_request.len() >= self.config.max_manifests as usize => {
                self.counters.overload_rejects += 1;
                return Err(Error::Overloaded {
                    what: format!(
                        "{} hand-off holds live (the limit)",
                        self.config.max_manifests
                    ),
                    retry_after_ms: 100,
                });
            }
            None => {}
        }
        let mut hold = Hold {
            epoch,
            keys: Vec::new(),
            blocks: Vec::new(),
            bytes: 0,
            begun_at_ms: now,
            expires_at_ms: now + ttl_ms,
        };
        for k in keys {
            let Some(i) = self.find_published(k) else {
                break; // the run is the leading published prefix
            };
            let s = &mut self.slots[i as usize];
            s.pins += 1;
            hold.keys.push(*k);
            hold.blocks.push((i, s.generation));
            hold.bytes += s.len;
            self.lru_remove(i);
        }
        if hold.blocks.is_empty() {
            return Err(Error::NotFound(format!(
                "the hand-off run of request {request} starts with block {}, which is not \
                 published here",
                keys[0]
            )));
        }
        self.holds.expiry.insert((hold.expires_at_ms, request));
        self.holds.by_request.insert(request, hold);
        self.counters.holds_begun += 1;
        Ok(self.hold_info_of(request, now))
    }

    fn check_hold_args(
        &self,
        request: RequestId,
        epoch: u64,
        keys: &[BlockKey],
        ttl_ms: u64,
    ) -> Result<()> {
        let max = self.config.max_manifest_blocks as usize;
        let why = if request == 0 || epoch == 0 {
            Some("a hold names its request and epoch (0 is none)".to_string())
        } else if keys.is_empty() || keys.len() > max {
            Some(format!(
                "a hold covers 1..={max} blocks, not {}",
                keys.len()
            ))
        } else if keys.iter().any(|k| k.namespace != keys[0].namespace) {
            Some("a hold's blocks are of one namespace".into())
        } else if ttl_ms == 0 || ttl_ms > self.config.max_manifest_ttl_ms {
            Some(format!(
                "hold TTL {ttl_ms} ms outside 1..={} ms",
                self.config.max_manifest_ttl_ms
            ))
        } else {
            None
        };
        why.map_or(Ok(()), |w| Err(Error::InvalidArgument(w)))
    }

    /// End `request`'s hold if its epoch is at most `epoch`; whether one ended. With no hold
    /// of that request, `epoch` is remembered as ended all the same: a prefill that answers
    /// after its request was cancelled cannot hold its run at that epoch any more (a late
    /// begin is stale), so a cancel that comes first still releases everything.
    pub fn hold_end(&mut self, request: RequestId, epoch: u64, how: HoldEnd) -> bool {
        match self.holds.by_request.get(&request) {
            Some(h) if h.epoch <= epoch => {
                self.hold_release(request);
                match how {
                    HoldEnd::Ended => self.counters.holds_ended += 1,
                    HoldEnd::Taken => self.counters.holds_taken += 1,
                }
                true
            }
            Some(_) => false,
            None => {
                if self.holds.ended.epoch(request).is_none_or(|e| e < epoch) {
                    let cap = self.config.max_manifests as usize;
                    self.holds.ended.record(request, epoch, cap);
                }
                false
            }
        }
    }

    /// Whether a fetch of `keys` bound to `(request, epoch)` may be served: the hold lives at
    /// exactly that epoch and holds every key.
    ///
    /// # Errors
    /// `NotFound` (no hold of that epoch: ended, expired, superseded or never made);
    /// `InvalidArgument` (a key outside the held run).
    pub fn hold_check(&self, request: RequestId, epoch: u64, keys: &[BlockKey]) -> Result<()> {
        let h = match self.holds.by_request.get(&request) {
            Some(h) if h.epoch == epoch => h,
            other => {
                let had = other.map_or("none".to_string(), |h| format!("epoch {}", h.epoch));
                return Err(Error::NotFound(format!(
                    "no hand-off hold of request {request} at epoch {epoch} here (it holds {had}: \
                     ended, expired or another attempt's)"
                )));
            }
        };
        if let Some(k) = keys.iter().find(|k| !h.keys.contains(k)) {
            return Err(Error::InvalidArgument(format!(
                "block {k} is not in the hand-off run of request {request}"
            )));
        }
        Ok(())
    }

    /// `request`'s hold as it stands.
    pub fn hold_info(&self, request: RequestId) -> Result<HoldInfo> {
        if !self.holds.by_request.contains_key(&request) {
            return Err(Error::NotFound(format!(
                "no hand-off hold of request {request} here"
            )));
        }
        Ok(self.hold_info_of(request, self.now()))
    }

    fn hold_info_of(&self, request: RequestId, now: u64) -> HoldInfo {
        let h = &self.holds.by_request[&request];
        HoldInfo {
            request,
            epoch: h.epoch,
            keys: h.keys.clone(),
            bytes: h.bytes,
            age_ms: now.saturating_sub(h.begun_at_ms),
            expires_in_ms: h.expires_at_ms.saturating_sub(now),
        }
    }

    /// The holds in all: how many, their blocks and bytes, the oldest one's age.
    pub fn holds_summary(&self) -> HoldsSummary {
        let now = self.now();
        let mut s = HoldsSummary::default();
        for h in self.holds.by_request.values() {
            s.holds += 1;
            s.blocks += h.blocks.len() as u64;
            s.bytes += h.bytes;
            s.oldest_age_ms = s.oldest_age_ms.max(now.saturating_sub(h.begun_at_ms));
        }
        s
    }

    /// Drop a hold: its pins go (a block removed meanwhile is freed now).
    pub fn hold_release(&mut self, request: RequestId) {
        let Some(h) = self.holds.by_request.remove(&request) else {
            return;
        };
        self.holds.expiry.remove(&(h.expires_at_ms, request));
        for (i, g) in h.blocks {
            let s = &mut self.slots[i as usize];
            if s.generation != g || s.state.is_none() {
                continue; // cannot happen: a pinned slot is never freed; kept defensive
            }
            debug_assert!(s.pins > 0);
            s.pins -= 1;
            self.settle(i);
        }
        let cap = self.config.max_manifests as usize;
        self.holds.ended.record(request, h.epoch, cap);
    }

    /// The reaper's part: holds past their TTL, at most `budget`; how many ended.
    pub fn reap_holds(&mut self, budget: u32) -> u32 {
        let now = self.now();
        let mut n = 0;
        while n < budget {
            let Some(&(t, request)) = self.holds.expiry.first() else {
                break;
            };
            if t > now {
                break;
            }
            let epoch = self.holds.by_request[&request].epoch;
            tracing::warn!(
                request,
                epoch,
                "hand-off hold expired unread: its blocks are released (the decode never came)"
            );
            self.hold_release(request);
            self.counters.holds_expired += 1;
            n += 1;
        }
        n
    }
}
