//! Checkpoint manifests: what a holder node keeps of an in-flight request.
//!
//! A manifest is `(request id, request epoch, namespace, ordered block tags, committed token
//! count)`. The writer streams checkpoint blocks and, at each step, publishes a group of them
//! and the new committed count atomically (`Inner::manifest_extend`). A newer epoch supersedes
//! an older one (the older one's blocks are released) and writes from an older epoch are
//! refused. Finishing, cancelling or expiring the request (manifests carry a TTL the writer
//! renews) releases its blocks and its reservation.
//!
//! Recovery asks one question (`Inner::restore_prepare`): for this request and token history,
//! what is the longest contiguous verified prefix held here?

use std::collections::VecDeque;

use crate::error::BlockState;
use crate::keys::{BlockTag, NamespaceId, block_tags};
use crate::pins::ReadTicket;
use crate::state::{Class, Inner, ReservationOwner};
use crate::types::{Handle, ManifestInfo, RequestId, ReservationId, SessionId};
use crate::{Error, Result};

#[derive(Debug, Clone)]
pub(crate) struct Manifest {
    pub epoch: u64,
    pub namespace: NamespaceId,
    pub tokens_per_block: u32,
    /// The published checkpoint blocks, in order: (slot, generation).
    pub blocks: Vec<(u32, u64)>,
    pub tags: Vec<BlockTag>,
    pub committed_tokens: u64,
    pub ttl_ms: u64,
    pub expires_at_ms: u64,
    pub reservation: Option<ReservationId>,
}

/// Recently ended manifests, so that a late message cannot resurrect one. Bounded.
/// The manifests room: each request's checkpoint manifest, the manifests' deadlines in expiry
/// order, and the epochs of recently ended requests (so a late event for an ended request is
/// recognised as stale).
///
/// Invariant: `expiry` holds exactly one entry per manifest.
#[derive(Debug, Default)]
pub(crate) struct Manifests {
    pub by_request: std::collections::HashMap<RequestId, Manifest>,
    pub expiry: std::collections::BTreeSet<(u64, RequestId)>,
    pub ended: Ended,
}

impl Manifests {
    /// The room's invariant.
    pub fn check(&self) -> Result<(), String> {
        if self.expiry.len() != self.by_request.len() {
            return Err(format!(
                "{} manifest deadlines for {} manifests",
                self.expiry.len(),
                self.by_request.len()
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Default)]
pub(crate) struct Ended {
    order: VecDeque<RequestId>,
    epochs: std::collections::HashMap<RequestId, u64>,
}

impl Ended {
    pub fn record(&mut self, r: RequestId, epoch: u64, cap: usize) {
        if self.epochs.insert(r, epoch).is_none() {
            self.order.push_back(r);
        }
        while self.order.len() > cap {
            if let Some(old) = self.order.pop_front() {
                self.epochs.remove(&old);
            }
        }
    }

    pub fn epoch(&self, r: RequestId) -> Option<u64> {
        self.epochs.get(&r).copied()
    }
}

impl Inner {
    /// The manifest of `request` at exactly `epoch`.
    pub fn manifest_at(&self, request: RequestId, epoch: u64) -> Result<&Manifest> {
        match self.manifests.by_request.get(&request) {
            Some(m) if m.epoch == epoch => Ok(m),
            Some(m) if m.epoch > epoch => Err(Error::StaleEpoch {
                got: epoch,
                current: m.epoch,
            }),
            Some(m) => Err(Error::NotFound(format!(
                "request {} has a manifest at epoch {}, not {epoch}; begin the new epoch first",
                request, m.epoch
            ))),
            None => Err(Error::NotFound(format!(
                "no checkpoint manifest for request {}",
                request
            ))),
        }
    }

    fn manifest_info_of(&self, request: RequestId, m: &Manifest) -> ManifestInfo {
        ManifestInfo {
            request,
            epoch: m.epoch,
            namespace: m.namespace,
            tags: m.tags.clone(),
            committed_tokens: m.committed_tokens,
            expires_at_ms: m.expires_at_ms,
            reservation: m.reservation,
        }
    }

    pub fn manifest_info(&self, request: RequestId) -> Result<ManifestInfo> {
        let m = self.manifests.by_request.get(&request).ok_or_else(|| {
            Error::NotFound(format!("no checkpoint manifest for request {}", request))
        })?;
        Ok(self.manifest_info_of(request, m))
    }

    fn manifest_ttl(&self, ttl_ms: u64) -> Result<u64> {
        if ttl_ms == 0 || ttl_ms > self.config.max_manifest_ttl_ms {
            return Err(Error::InvalidArgument(format!(
                "manifest TTL {ttl_ms} ms outside 1..={} ms",
                self.config.max_manifest_ttl_ms
            )));
        }
        Ok(ttl_ms)
    }

    /// Start (or supersede with a newer epoch) a request's checkpoint, reserving `reserve_bytes`
    /// for its blocks (0 for none).
    pub fn manifest_begin(
        &mut self,
        sid: SessionId,
        request: RequestId,
        epoch: u64,
        namespace: NamespaceId,
        reserve_bytes: u64,
        ttl_ms: u64,
    ) -> Result<ManifestInfo> {
        self.live_session(sid)?;
        let ttl_ms = self.manifest_ttl(ttl_ms)?;
        let tokens_per_block = self
            .namespaces
            .get(&namespace)
            .map(|d| d.tokens_per_block)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "unknown namespace {namespace:?}; register its descriptor first"
                ))
            })?;
        if let Some(ended) = self.manifests.ended.epoch(request)
            && epoch <= ended
        {
            return Err(Error::StaleEpoch {
                got: epoch,
                current: ended,
            });
        }
        match self.manifests.by_request.get(&request) {
            Some(m) if m.epoch > epoch => {
                return Err(Error::StaleEpoch {
                    got: epoch,
                    current: m.epoch,
                });
            }
            Some(m) if m.epoch == epoch => {
                if m.namespace != namespace {
                    return Err(Error::InvalidArgument(format!(
                        "request {} epoch {epoch} exists with another namespace",
                        request
                    )));
                }
                return Ok(self.manifest_info_of(request, m)); // idempotent
            }
            Some(_) => {}
            None => {
                if self.manifests.by_request.len() >= self.config.max_manifests as usize {
                    self.counters.overload_rejects += 1;
                    return Err(Error::Overloaded {
                        what: format!("{} manifests live (the limit)", self.config.max_manifests),
                        retry_after_ms: 100,
                    });
                }
            }
        }
        // Reserve before superseding, so that a failure changes nothing... except that the
        // older epoch's space may be what the newer one needs: release first, then reserve, and
        // on failure the older epoch is gone (it was superseded either way).
        if self.manifests.by_request.contains_key(&request) {
            self.manifest_release(request);
        }
        let reservation = if reserve_bytes > 0 {
            Some(self.reserve(reserve_bytes, ReservationOwner::Manifest(request))?)
        } else {
            None
        };
        let expires_at_ms = self.now() + ttl_ms;
        let m = Manifest {
            epoch,
            namespace,
            tokens_per_block,
            blocks: Vec::new(),
            tags: Vec::new(),
            committed_tokens: 0,
            ttl_ms,
            expires_at_ms,
            reservation,
        };
        self.manifests.expiry.insert((expires_at_ms, request));
        let info = self.manifest_info_of(request, &m);
        self.manifests.by_request.insert(request, m);
        Ok(info)
    }

    /// Publish SEALED checkpoint blocks into the manifest and raise its committed token count,
    /// atomically.
    pub fn manifest_extend(
        &mut self,
        sid: SessionId,
        request: RequestId,
        epoch: u64,
        handles: &[Handle],
        committed_tokens: u64,
    ) -> Result<ManifestInfo> {
        let m = self.manifest_at(request, epoch)?;
        let (old_count, old_committed, tpb) = (
            m.blocks.len(),
            m.committed_tokens,
            m.tokens_per_block as u64,
        );
        let new_count = old_count + handles.len();
        if new_count > self.config.max_manifest_blocks as usize {
            return Err(Error::InvalidArgument(format!(
                "a manifest holds at most {} blocks",
                self.config.max_manifest_blocks
            )));
        }
        if committed_tokens < old_committed || committed_tokens > new_count as u64 * tpb {
            return Err(Error::InvalidArgument(format!(
                "committed tokens {committed_tokens} must be within {old_committed}..={} \
                 ({new_count} blocks of {tpb} tokens)",
                new_count as u64 * tpb
            )));
        }
        let slots = self.sealed_group(sid, handles, |c| match c {
            Class::Checkpoint {
                request: r,
                epoch: e,
            } if r == request && e == epoch => Ok(()),
            Class::Checkpoint { epoch: e, .. } if e < epoch => Err(Error::StaleEpoch {
                got: e,
                current: epoch,
            }),
            _ => Err(Error::InvalidArgument(format!(
                "block was not allocated for request {} epoch {epoch}",
                request
            ))),
        })?;
        let pairs: Vec<(u32, u64, BlockTag)> = slots
            .iter()
            .map(|&i| {
                let s = &self.slots[i as usize];
                (i, s.generation, s.key.tag)
            })
            .collect();
        for &(i, _, _) in &pairs {
            self.publish_slot(sid, i);
        }
        let m = self
            .manifests
            .by_request
            .get_mut(&request)
            .expect("checked");
        for (i, g, tag) in pairs {
            m.blocks.push((i, g));
            m.tags.push(tag);
        }
        m.committed_tokens = committed_tokens;
        let m = m.clone();
        Ok(self.manifest_info_of(request, &m))
    }

    /// Extend a manifest's TTL (the writer's heartbeat for it).
    pub fn manifest_renew(&mut self, request: RequestId, epoch: u64, ttl_ms: u64) -> Result<u64> {
        let ttl_ms = self.manifest_ttl(ttl_ms)?;
        self.manifest_at(request, epoch)?;
        let now = self.now();
        let m = self
            .manifests
            .by_request
            .get_mut(&request)
            .expect("checked");
        let old = m.expires_at_ms;
        m.ttl_ms = ttl_ms;
        m.expires_at_ms = now + ttl_ms;
        let new = m.expires_at_ms;
        self.manifests.expiry.remove(&(old, request));
        self.manifests.expiry.insert((new, request));
        Ok(new)
    }

    /// The request finished or was cancelled: release its checkpoint.
    pub fn manifest_end(&mut self, request: RequestId, epoch: u64) -> Result<()> {
        self.manifest_at(request, epoch)?;
        self.manifest_release(request);
        Ok(())
    }

    /// Drop a manifest: its blocks leave the index (freed when unpinned), its reservation ends.
    pub fn manifest_release(&mut self, request: RequestId) {
        let Some(m) = self.manifests.by_request.remove(&request) else {
            return;
        };
        self.manifests.expiry.remove(&(m.expires_at_ms, request));
        for (i, g) in m.blocks {
            let s = &self.slots[i as usize];
            if s.generation == g && s.state == Some(BlockState::Published) {
                self.retire_or_free(i);
            }
        }
        if let Some(r) = m.reservation {
            self.release_reservation(r);
        }
        let cap = self.config.max_manifests as usize;
        self.manifests.ended.record(request, m.epoch, cap);
    }

    /// Start restoring: the manifest's leading blocks that match `tokens`' tags and are still
    /// PUBLISHED, each marked in use for a checksum pass outside the lock.
    pub fn restore_prepare(
        &mut self,
        request: RequestId,
        tokens: &[u32],
    ) -> Result<(u64, u64, Vec<ReadTicket>)> {
        let m = self.manifests.by_request.get(&request).ok_or_else(|| {
            Error::NotFound(format!("no checkpoint manifest for request {}", request))
        })?;
        // Tags exist for full blocks only; the last checkpointed block may be committed in part.
        let usable = tokens
            .len()
            .min(m.blocks.len() * m.tokens_per_block as usize);
        let tags = block_tags(&m.namespace, m.tokens_per_block, &tokens[..usable])?;
        let mut run = Vec::new();
        for (pos, tag) in tags.iter().enumerate() {
            let Some(&(i, g)) = m.blocks.get(pos) else {
                break;
            };
            let s = &self.slots[i as usize];
            if m.tags[pos] != *tag || s.generation != g || s.state != Some(BlockState::Published) {
                break;
            }
            run.push(i);
        }
        let (epoch, committed) = (m.epoch, m.committed_tokens);
        let tickets = run.into_iter().map(|i| self.check_prepare(i)).collect();
        Ok((epoch, committed, tickets))
    }
}
