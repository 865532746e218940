//! The block store: the block table with its lifecycle, pins, sessions and leases, checkpoint
//! manifests, reservations and eviction, integrity, and the reaper.
//!
//! One [`Store`] per node. Its metadata sits behind one lock; every operation holds it for a
//! bounded, small amount of work, and byte copies and checksums run outside it (see
//! [`lifecycle`] for how a page is kept safe meanwhile). Operations are batched: one call for N
//! blocks, each block with its own result where that makes sense, all-or-nothing where the
//! design asks for it (allocation space, group publish, manifest extension).
//!
//! Where a block changes state: [`lifecycle`]. Who may touch it: [`sessions`]. What readers see:
//! [`pins`]. Checkpoints: [`manifest`]. Space: [`capacity`]. Checksums: [`integrity`].
//! Cleanup: [`reaper`]. What routers learn of it: [`events`].

pub mod capacity;
pub mod events;
pub mod holds;
pub mod instances;
pub mod integrity;
pub mod lifecycle;
mod lru;
pub mod manifest;
pub mod pins;
pub mod pool;
pub mod reaper;
pub mod sessions;
mod state;
mod sync;

// The shared vocabulary, under the names the store's modules use for it.
use kvd_core::batch::{MAX_BATCH_CEILING, check_batch};
pub use kvd_core::types::{self, *};
pub use kvd_core::{Error, Result};
use kvd_core::{clock, error, keys};

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::clock::Clock;
use crate::keys::{BlockKey, BlockTag, NamespaceDescriptor, NamespaceId, block_tags};
use crate::lifecycle::SealStep;
use crate::pool::{Backing, PoolConfig};
use crate::state::Inner;
use crate::sync::{Mutex, MutexGuard};

/// The longest a soft pin holds (a day): past it a shared prefix is an ordinary cache block
/// again unless renewed.
pub const MAX_SOFT_PIN_MS: u64 = 24 * 3600 * 1000;
use transport::local::{PageGenerations, SharedRegion};

pub use crate::error::BlockState;

/// The store's limits and defaults. Every bound is explicit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreConfig {
    /// The pool's geometry.
    pub pool: PoolConfig,
    /// This node incarnation's generation (persisted and increased at every start by the daemon).
    pub node_generation: u64,
    /// Open sessions at most.
    pub max_sessions: u32,
    /// Keys or handles in one batched call at most.
    pub max_batch: u32,
    /// Unfinished blocks (ALLOCATED/WRITING/SEALED) one session may hold.
    pub max_blocks_in_flight_per_session: u32,
    /// Distinct blocks one session may pin.
    pub max_pins_per_session: u32,
    /// Registered namespaces at most.
    pub max_namespaces: u32,
    /// Live manifests at most.
    pub max_manifests: u32,
    /// Blocks in one manifest at most.
    pub max_manifest_blocks: u32,
    /// Open reservations at most.
    pub max_reservations: u32,
    /// Pin TTL when the caller gives none.
    pub default_pin_ttl_ms: u64,
    /// Longest pin TTL a caller may ask for.
    pub max_pin_ttl_ms: u64,
    /// Shortest session lease.
    pub min_lease_ttl_ms: u64,
    /// Longest session lease.
    pub max_lease_ttl_ms: u64,
    /// Longest manifest TTL.
    pub max_manifest_ttl_ms: u64,
    /// How long a quarantined page is held apart before it returns to the pool.
    pub quarantine_hold_ms: u64,
    /// Recompute a checksum the writer supplied at SEAL (costs a pass over the block).
    pub verify_supplied_checksums: bool,
    /// Block events the ring keeps for routers (1 to [`events::MAX_EVENT_LOG_CAPACITY`]);
    /// the oldest is dropped when it is full.
    pub event_log_capacity: u32,
}

impl StoreConfig {
    /// Defaults for a pool of the given geometry.
    pub fn new(pool: PoolConfig) -> StoreConfig {
        StoreConfig {
            pool,
            node_generation: 1,
            max_sessions: 1024,
            max_batch: MAX_BATCH_CEILING,
            max_blocks_in_flight_per_session: 65_536,
            max_pins_per_session: 262_144,
            max_namespaces: 1024,
            max_manifests: 65_536,
            max_manifest_blocks: 65_536,
            max_reservations: 65_536,
            default_pin_ttl_ms: 30_000,
            max_pin_ttl_ms: 600_000,
            min_lease_ttl_ms: 10,
            max_lease_ttl_ms: 600_000,
            max_manifest_ttl_ms: 3_600_000,
            quarantine_hold_ms: 60_000,
            verify_supplied_checksums: false,
            event_log_capacity: 65_536,
        }
    }
}

/// The block store of one node.
#[derive(Debug)]
pub struct Store {
    inner: Mutex<Inner>,
    /// The pool's mapping, shared so that copies run without the lock.
    region: Arc<SharedRegion>,
    /// The page-generation table, shared read-only with clients.
    generations: Arc<PageGenerations>,
    page_size: u64,
    node_generation: u64,
    backing: Backing,
}

impl Store {
    /// Create a store and its pool.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad geometry, [`Error::Io`] when the memory cannot be had.
    pub fn new(config: StoreConfig, clock: Arc<dyn Clock>) -> Result<Store> {
        let inner = Inner::new(config, clock)?;
        let backing = inner.pool.region().backing();
        let region = inner.pool.shared_region();
        let generations = inner.pool.generations();
        Ok(Store {
            inner: Mutex::new(inner),
            region,
            generations,
            page_size: config.pool.page_size_bytes,
            node_generation: config.node_generation,
            backing,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock is a bug that already aborted an operation; the
        // metadata is checked by the reaper's audit, so keep serving.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn region(&self) -> &SharedRegion {
        &self.region
    }

    /// The pool's shared region, for the transfer engine to register (peers reach it only
    /// through grants).
    pub fn pool_region(&self) -> Arc<SharedRegion> {
        Arc::clone(&self.region)
    }

    /// This node incarnation's generation.
    pub fn node_generation(&self) -> u64 {
        self.node_generation
    }

    /// Bytes per page (the largest block).
    pub fn page_size(&self) -> u64 {
        self.page_size
    }

    /// What backs the pool (huge pages or not).
    pub fn backing(&self) -> Backing {
        self.backing
    }

    /// The pool's memfd, to pass to a client process.
    pub fn pool_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.region().fd()
    }

    /// The page-generation table's memfd (sealed: clients can map it read-only only), to pass
    /// to a client process beside the pool's.
    pub fn page_table_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.generations.fd()
    }

    /// The pool region's size in bytes.
    pub fn pool_bytes(&self) -> u64 {
        self.region().len() as u64
    }

    // ----- namespaces -----

    /// Register a KV layout; returns its id. Idempotent.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad descriptor or a block larger than a page;
    /// [`Error::Overloaded`] past `max_namespaces`.
    pub fn register_namespace(&self, d: &NamespaceDescriptor) -> Result<NamespaceId> {
        d.validate()?;
        if d.bytes_per_block > self.page_size {
            return Err(Error::InvalidArgument(format!(
                "blocks of {} bytes do not fit the pool's {}-byte pages; start the pool with \
                 larger pages",
                d.bytes_per_block, self.page_size
            )));
        }
        let id = d.id();
        let mut g = self.lock();
        if !g.namespaces.contains_key(&id) {
            if g.namespaces.len() >= g.config.max_namespaces as usize {
                return Err(Error::Overloaded {
                    what: "namespace table full".into(),
                    retry_after_ms: 1000,
                });
            }
            g.namespaces.insert(id, d.clone());
        }
        Ok(id)
    }

    /// The descriptor of a registered namespace.
    pub fn namespace(&self, id: &NamespaceId) -> Option<NamespaceDescriptor> {
        self.lock().namespaces.get(id).cloned()
    }

    // ----- sessions -----

    /// Open a session with a heartbeat lease of `lease_ttl_ms`.
    ///
    /// # Errors
    /// [`Error::Overloaded`] past `max_sessions`; [`Error::InvalidArgument`] for a TTL out of
    /// range.
    pub fn open_session(&self, name: &str, lease_ttl_ms: u64) -> Result<SessionId> {
        self.lock().open_session(name, lease_ttl_ms, None)
    }

    /// As [`Store::open_session`], recording the peer process that holds the session (shown in
    /// [`Store::sessions`]).
    ///
    /// # Errors
    /// As [`Store::open_session`].
    pub fn open_session_for(
        &self,
        name: &str,
        lease_ttl_ms: u64,
        peer: SessionPeer,
    ) -> Result<SessionId> {
        self.lock().open_session(name, lease_ttl_ms, Some(peer))
    }

    /// Renew a session's lease; returns the new expiry (store clock, ms).
    ///
    /// # Errors
    /// [`Error::LeaseExpired`] if it had already expired (its work is released).
    pub fn heartbeat(&self, sid: SessionId) -> Result<u64> {
        self.lock().heartbeat(sid)
    }

    /// Whether the session is open (its lease may still have run out; the next operation on it
    /// or the reaper will tell).
    pub fn has_session(&self, sid: SessionId) -> bool {
        self.lock().sessions.by_id.contains_key(&sid)
    }

    /// Close a session: abort its unfinished blocks, drop its pins, release its reservations.
    pub fn close_session(&self, sid: SessionId) -> SessionCleanup {
        self.lock().close_session(sid)
    }

    // ----- capacity -----

    /// Reserve `bytes` for `sid`'s future allocations.
    ///
    /// # Errors
    /// [`Error::NoSpace`] (retryable) when the space is not there even after eviction.
    pub fn reserve(&self, sid: SessionId, bytes: u64) -> Result<ReservationId> {
        self.lock().reserve_for_session(sid, bytes)
    }

    /// Give back the unused space of a reservation `sid` made (idempotent).
    ///
    /// # Errors
    /// [`Error::NotFound`] when the reservation belongs to another session or to a manifest.
    pub fn release_reservation(&self, sid: SessionId, r: ReservationId) -> Result<()> {
        self.lock().release_session_reservation(sid, r)
    }

    // ----- writers -----

    /// Allocate blocks for `keys`. See [`lifecycle`] for the all-or-nothing rules.
    ///
    /// # Errors
    /// The whole call fails on [`Error::NoSpace`], an unknown namespace, a dead session or a
    /// bound; existing keys get [`Error::AlreadyExists`] in their place.
    pub fn alloc(
        &self,
        sid: SessionId,
        keys: &[BlockKey],
        class: BlockClass,
        reservation: Option<ReservationId>,
    ) -> Result<Vec<Result<Allocation>>> {
        self.lock().alloc(sid, keys, class, reservation)
    }

    /// Allocate blocks for `keys` and mark them WRITING at once, for a writer that fills the
    /// pages itself (an engine through its mapping, a peer through a grant): the one step
    /// every such writer takes. Per key, the allocation (its page, WRITING) or why not
    /// ([`Error::AlreadyExists`] for a key held already); if the blocks cannot be marked
    /// WRITING at all, those allocated are aborted and the call fails, leaving nothing behind.
    ///
    /// # Errors
    /// As [`Store::alloc`] and [`Store::begin_write`] for the whole call.
    pub fn alloc_for_write(
        &self,
        sid: SessionId,
        keys: &[BlockKey],
        class: BlockClass,
        reservation: Option<ReservationId>,
    ) -> Result<Vec<Result<Allocation>>> {
        let allocs = self.alloc(sid, keys, class, reservation)?;
        let handles: Vec<Handle> = allocs
            .iter()
            .filter_map(|r| r.as_ref().ok().map(|a| a.handle))
            .collect();
        let begun = match self.begin_write(sid, &handles) {
            Ok(b) => b,
            Err(e) => {
                let _ = self.abort(sid, &handles);
                return Err(e);
            }
        };
        let mut begun = begun.into_iter();
        Ok(allocs
            .into_iter()
            .map(|r| match r {
                Ok(_) => begun.next().expect("one begin_write result per allocation"),
                Err(e) => Err(e),
            })
            .collect())
    }

    /// Mark allocated blocks WRITING for a writer that fills them through its own mapping.
    pub fn begin_write(
        &self,
        sid: SessionId,
        handles: &[Handle],
    ) -> Result<Vec<Result<Allocation>>> {
        let mut g = self.lock();
        check_batch(handles.len(), g.config.max_batch)?;
        g.live_session(sid)?;
        Ok(handles.iter().map(|h| g.begin_write(sid, h)).collect())
    }

    /// Copy `data` into the block at `offset`. Sequential writes (each starting where the last
    /// ended) fold the checksum into the copy, so SEAL needs no second pass.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] past the page's end; [`Error::IllegalTransition`] after SEAL;
    /// [`Error::StaleGeneration`] for an old handle.
    pub fn write(&self, sid: SessionId, h: &Handle, offset: u64, data: &[u8]) -> Result<()> {
        let t = self
            .lock()
            .write_prepare(sid, h, offset, data.len() as u64)?;
        // SAFETY: the slot is ALLOCATED/WRITING, owned by `sid`, and marked in use by
        // `write_prepare`: no other write, no read, and no reuse of the page until
        // `write_finish` clears the mark.
        let crc = unsafe {
            self.region()
                .copy_in(t.page_offset, data, t.running_crc)
                .expect("the store's pages lie in its region")
        };
        self.lock().write_finish(&t, offset, data.len() as u64, crc)
    }

    /// Seal a block at `len` valid bytes: from here its bytes are immutable. `checksum` is the
    /// writer's CRC-32C of those bytes, if it computed one during its copy; otherwise the store
    /// uses its running checksum or computes one.
    ///
    /// # Errors
    /// [`Error::Corrupt`] if a supplied checksum does not match what the store knows (nothing
    /// changes); [`Error::IllegalTransition`] unless the block is WRITING.
    pub fn seal(&self, sid: SessionId, h: &Handle, len: u64, checksum: Option<u32>) -> Result<u32> {
        let step = self.lock().seal_prepare(sid, h, len, checksum)?;
        match step {
            SealStep::Done(c) => Ok(c),
            SealStep::Checksum { slot, page_offset } => {
                // SAFETY: marked in use by `seal_prepare`; the owner cannot write while the mark
                // is held (writes are refused), and the page is not reused.
                let computed = unsafe { self.region().crc32c(page_offset, len as usize) }
                    .expect("the store's pages lie in its region");
                self.lock().seal_finish(sid, slot, len, computed, checksum)
            }
        }
    }

    /// Publish SEALED cache blocks as one group: all or none.
    pub fn publish(&self, sid: SessionId, handles: &[Handle]) -> Result<()> {
        self.lock().publish(sid, handles)
    }

    /// Register `sid` as rank `rank` of engine instance `(instance, generation)` of
    /// `rank_count` ranks ([`instances`]).
    ///
    /// # Errors
    /// As [`instances`].
    pub fn instance_join(
        &self,
        sid: SessionId,
        instance: u64,
        generation: u64,
        rank: u32,
        rank_count: u32,
    ) -> Result<()> {
        self.lock()
            .instance_join(sid, instance, generation, rank, rank_count)
    }

    /// Rank `sid` commits its SEALED blocks of step `step`; whether that published the step
    /// (every rank's blocks of it, together).
    ///
    /// # Errors
    /// As the group checks of a publish, per rank; see [`instances`].
    pub fn instance_commit(
        &self,
        sid: SessionId,
        instance: u64,
        generation: u64,
        step: u64,
        handles: &[Handle],
    ) -> Result<bool> {
        self.lock()
            .instance_commit(sid, instance, generation, step, handles)
    }

    /// The instances known (at most `max`), failed ones with why.
    pub fn instances(&self, max: usize) -> Vec<instances::InstanceReport> {
        self.lock().instance_reports(max)
    }

    /// Abort unfinished blocks; their space returns to the pool (or their reservation).
    pub fn abort(&self, sid: SessionId, handles: &[Handle]) -> Result<Vec<Result<()>>> {
        self.lock().abort(sid, handles)
    }

    /// Compare-and-delete: remove `key` only if its current version is exactly `expected`
    /// (node generation included, so a version from an earlier incarnation never matches).
    pub fn remove_if(&self, key: &BlockKey, expected: BlockVersion) -> Result<()> {
        self.lock().remove_if(key, expected)
    }

    // ----- readers -----

    /// Look keys up (no pin). Misses are `None`.
    pub fn lookup(&self, keys: &[BlockKey]) -> Result<Vec<Option<BlockInfo>>> {
        let mut g = self.lock();
        check_batch(keys.len(), g.config.max_batch)?;
        Ok(g.lookup(keys))
    }

    /// Soft-pin PUBLISHED cache blocks until `ttl_ms` from now (at most [`MAX_SOFT_PIN_MS`]; 0
    /// ends a soft pin): eviction passes them over while anything else on the LRU can go, and
    /// takes them only when nothing else can (counted), as a shared prefix (a system prompt)
    /// should be kept. Renewing sets the deadline again. Which keys were soft-pinned (a
    /// miss, or a checkpoint block, which eviction never takes, is not).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a batch past the bound.
    pub fn soft_pin(&self, keys: &[BlockKey], ttl_ms: u64) -> Result<Vec<bool>> {
        let mut g = self.lock();
        check_batch(keys.len(), g.config.max_batch)?;
        let until = if ttl_ms == 0 {
            0
        } else {
            g.clock.now_ms() + ttl_ms.min(MAX_SOFT_PIN_MS)
        };
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            let slot = g.index.get(k).copied().filter(|&i| {
                let s = &g.slots[i as usize];
                s.state == Some(BlockState::Published) && s.class == crate::state::Class::Cache
            });
            if let Some(i) = slot {
                g.slots[i as usize].soft_until_ms = until;
                g.counters.soft_pins += u64::from(ttl_ms > 0);
            }
            out.push(slot.is_some());
        }
        Ok(out)
    }

    /// Mark blocks as recently used (LRU).
    pub fn touch(&self, keys: &[BlockKey]) {
        let mut g = self.lock();
        for k in keys.iter().take(g.config.max_batch as usize) {
            if let Some(&i) = g.index.get(k) {
                g.lru_touch(i);
            }
        }
    }

    /// Pin PUBLISHED blocks for `sid` for `ttl_ms` (default when `None`).
    pub fn acquire(
        &self,
        sid: SessionId,
        keys: &[BlockKey],
        ttl_ms: Option<u64>,
    ) -> Result<Vec<Result<BlockInfo>>> {
        self.lock().acquire(sid, keys, ttl_ms)
    }

    /// Release pins; stale or unpinned handles get an error in their place.
    pub fn release(&self, sid: SessionId, handles: &[Handle]) -> Result<Vec<Result<()>>> {
        self.lock().release(sid, handles)
    }

    /// The longest PUBLISHED prefix of a tag chain, optionally pinned for a session.
    pub fn lookup_prefix(
        &self,
        namespace: &NamespaceId,
        tags: &[BlockTag],
        pin_for: Option<(SessionId, Option<u64>)>,
    ) -> Result<PrefixHit> {
        self.lock().lookup_prefix(namespace, tags, pin_for)
    }

    /// The longest PUBLISHED prefix of a token history in a registered namespace.
    pub fn longest_prefix(
        &self,
        namespace: &NamespaceId,
        tokens: &[u32],
        pin_for: Option<(SessionId, Option<u64>)>,
    ) -> Result<PrefixHit> {
        let tpb = self
            .namespace(namespace)
            .ok_or_else(|| Error::InvalidArgument(format!("unknown namespace {namespace:?}")))?
            .tokens_per_block;
        let tags = block_tags(namespace, tpb, tokens)?;
        self.lookup_prefix(namespace, &tags, pin_for)
    }

    /// Copy a pinned block's bytes into `dst` (at most its length); with `verify`, check its
    /// checksum in the same pass. Returns the bytes copied.
    ///
    /// # Errors
    /// [`Error::Corrupt`] when verification fails (the block is quarantined: treat as a miss).
    pub fn read(&self, sid: SessionId, h: &Handle, dst: &mut [u8], verify: bool) -> Result<u64> {
        let t = self.lock().read_prepare(sid, h)?;
        let n = (t.len as usize).min(dst.len());
        let region = self.region();
        // SAFETY: the block is SEALED or later (immutable), pinned by `sid` and marked in use by
        // `read_prepare`, so its page is neither written nor reused until `read_finish`.
        let computed = unsafe {
            let whole = n as u64 == t.len;
            let c = region.copy_out(t.page_offset, &mut dst[..n], verify && whole);
            match c.expect("the store's pages lie in its region") {
                Some(c) => Some(c),
                None if verify => Some(
                    region
                        .crc32c(t.page_offset, t.len as usize)
                        .expect("the store's pages lie in its region"),
                ),
                None => None,
            }
        };
        self.lock().read_finish(&t, computed)?;
        Ok(n as u64)
    }

    /// Check a block `sid` pins against the checksum recorded at SEAL, in place (no copy): what
    /// the daemon does when a reader reports that its own copy failed the check.
    ///
    /// # Errors
    /// [`Error::Corrupt`] with [`crate::error::Corruption::Quarantined`] when the daemon's copy
    /// fails too (the block is quarantined); the handle's errors as for [`Store::read`].
    pub fn verify(&self, sid: SessionId, h: &Handle) -> Result<()> {
        let t = self.lock().read_prepare(sid, h)?;
        // SAFETY: as in `read`: SEALED or later, pinned by `sid`, marked in use until
        // `read_finish`.
        let computed = unsafe { self.region().crc32c(t.page_offset, t.len as usize) }
            .expect("the store's pages lie in its region");
        self.lock().read_finish(&t, Some(computed))
    }

    // ----- manifests -----

    /// Begin (or supersede with a newer epoch) a request's checkpoint manifest.
    pub fn manifest_begin(
        &self,
        sid: SessionId,
        request: RequestId,
        epoch: u64,
        namespace: NamespaceId,
        reserve_bytes: u64,
        ttl_ms: u64,
    ) -> Result<ManifestInfo> {
        self.lock()
            .manifest_begin(sid, request, epoch, namespace, reserve_bytes, ttl_ms)
    }

    /// Publish SEALED checkpoint blocks into the manifest with the new committed token count,
    /// atomically.
    pub fn manifest_extend(
        &self,
        sid: SessionId,
        request: RequestId,
        epoch: u64,
        handles: &[Handle],
        committed_tokens: u64,
    ) -> Result<ManifestInfo> {
        self.lock()
            .manifest_extend(sid, request, epoch, handles, committed_tokens)
    }

    /// Renew a manifest's TTL.
    pub fn manifest_renew(&self, request: RequestId, epoch: u64, ttl_ms: u64) -> Result<u64> {
        self.lock().manifest_renew(request, epoch, ttl_ms)
    }

    /// The request finished or was cancelled: release its checkpoint and reservation.
    pub fn manifest_end(&self, request: RequestId, epoch: u64) -> Result<()> {
        self.lock().manifest_end(request, epoch)
    }

    /// Hold the leading published run of `keys` for `request`'s hand-off at `epoch`
    /// ([`holds`]).
    ///
    /// # Errors
    /// See [`holds`]: bad arguments, a stale epoch, nothing published, the bound on holds.
    pub fn hold_begin(
        &self,
        request: RequestId,
        epoch: u64,
        keys: &[BlockKey],
        ttl_ms: u64,
    ) -> Result<HoldInfo> {
        self.lock().hold_begin(request, epoch, keys, ttl_ms)
    }

    /// End `request`'s hand-off hold if its epoch is at most `epoch`; whether one ended.
    pub fn hold_end(&self, request: RequestId, epoch: u64, how: holds::HoldEnd) -> bool {
        self.lock().hold_end(request, epoch, how)
    }

    /// Whether a fetch of `keys` bound to `(request, epoch)` may be served from a hold.
    ///
    /// # Errors
    /// `NotFound` (no hold at that epoch) or `InvalidArgument` (a key outside the run).
    pub fn hold_check(&self, request: RequestId, epoch: u64, keys: &[BlockKey]) -> Result<()> {
        self.lock().hold_check(request, epoch, keys)
    }

    /// `request`'s hand-off hold.
    ///
    /// # Errors
    /// `NotFound` when there is none.
    pub fn hold(&self, request: RequestId) -> Result<HoldInfo> {
        self.lock().hold_info(request)
    }

    /// The node's hand-off holds in all.
    pub fn holds_summary(&self) -> HoldsSummary {
        self.lock().holds_summary()
    }

    /// The manifest of a request, as published.
    pub fn manifest(&self, request: RequestId) -> Result<ManifestInfo> {
        self.lock().manifest_info(request)
    }

    /// Recovery's question: for `request` and its token history, the longest contiguous
    /// verified checkpoint prefix held here. Every block of the answer had its checksum checked
    /// just now; a block that fails is quarantined and ends the prefix.
    pub fn restore_prefix(&self, request: RequestId, tokens: &[u32]) -> Result<RestorePrefix> {
        let (epoch, committed, tickets) = self.lock().restore_prepare(request, tokens)?;
        let computed: Vec<u32> = tickets
            .iter()
            .map(|t| {
                // SAFETY: each block is PUBLISHED (immutable) and marked in use by
                // `restore_prepare`, so its page is not reused until `read_finish`.
                unsafe { self.region().crc32c(t.page_offset, t.len as usize) }
                    .expect("the store's pages lie in its region")
            })
            .collect();
        let mut g = self.lock();
        let mut blocks = Vec::new();
        let mut good = true;
        for (t, c) in tickets.iter().zip(computed) {
            let ok = g.read_finish(t, Some(c)).is_ok();
            good &= ok;
            if good {
                blocks.push(g.info_of(t.slot));
            }
        }
        let tpb = g
            .namespaces
            .get(&g.manifests.by_request[&request].namespace)
            .map_or(0, |d| d.tokens_per_block as u64);
        let tokens_covered = (blocks.len() as u64 * tpb)
            .min(committed)
            .min(tokens.len() as u64);
        Ok(RestorePrefix {
            epoch,
            blocks,
            tokens: tokens_covered,
            committed_tokens: committed,
        })
    }

    // ----- events for routers -----

    /// Drain block events: those with `seq >= since_seq` (0 reads from the oldest held), at
    /// most `max` (and at most `max_batch`), in order. Pass the batch's `next_seq` as the next
    /// `since_seq`. A batch with `lost > 0` means the ring dropped that many events the reader
    /// had not read: resync with a full lookup, then carry on from `next_seq`. Sequence numbers
    /// restart at 1 with every node incarnation ([`events`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a `since_seq` past the end of the log (one from another
    /// incarnation).
    pub fn events(&self, since_seq: u64, max: u32) -> Result<EventBatch> {
        let g = self.lock();
        let max = max.min(g.config.max_batch) as usize;
        g.events.read(since_seq, max)
    }

    // ----- maintenance and observation -----

    /// One reaper tick: at most `budget` expired sessions, pins, manifests and quarantined pages.
    pub fn reap(&self, budget: u32) -> ReapReport {
        self.lock().reap(budget)
    }

    /// Recount every page; `balanced` is false if the running counts drifted.
    pub fn audit(&self) -> (Accounting, bool) {
        self.lock().audit()
    }

    /// Check every structural invariant; the error says which one broke.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.lock().check_invariants()
    }

    /// Counts and counters for metrics and `/status`.
    pub fn stats(&self) -> StoreStats {
        let g = self.lock();
        StoreStats {
            node_generation: g.config.node_generation,
            page_size_bytes: g.page_size(),
            accounting: g.counts,
            reserved_unused_pages: g.reservations.unused_pages,
            pins: g.pins.count,
            sessions: g.sessions.by_id.len() as u32,
            manifests: g.manifests.by_request.len() as u32,
            namespaces: g.namespaces.len() as u32,
            evictable: g.lru.len(),
            counters: g.counters,
        }
    }

    /// Published pages held as checkpoint blocks by live manifests (the rest of the published
    /// pages are cache blocks). One pass over the manifests, for a scrape.
    pub fn checkpoint_pages(&self) -> u64 {
        let g = self.lock();
        g.manifests
            .by_request
            .values()
            .map(|m| m.blocks.len() as u64)
            .sum()
    }

    /// The open sessions, in id order, at most `limit`.
    pub fn sessions(&self, limit: usize) -> Vec<SessionSummary> {
        let g = self.lock();
        let now = g.now();
        let mut v: Vec<SessionSummary> = g
            .sessions
            .by_id
            .iter()
            .map(|(id, s)| SessionSummary {
                id: *id,
                name: s.name.clone(),
                expires_at_ms: s.expires_at_ms,
                blocks_in_flight: s.writing.len() as u32,
                pins: s.pins.len() as u32,
                peer: s.peer,
                age_ms: now.saturating_sub(s.opened_at_ms),
                idle_ms: now.saturating_sub(s.active_at_ms),
            })
            .collect();
        v.sort_unstable_by_key(|s| s.id);
        v.truncate(limit);
        v
    }

    /// The slots on the eviction list, most recently used first (for model-based tests).
    #[doc(hidden)]
    pub fn debug_lru_slots(&self) -> Vec<u32> {
        let g = self.lock();
        let mut out = Vec::with_capacity(g.lru.len() as usize);
        let mut i = g.lru.head();
        while i != state::NIL && out.len() <= g.lru.len() as usize {
            out.push(i);
            i = g.slots[i as usize].lru_next;
        }
        out
    }

    /// The store's configuration.
    pub fn config(&self) -> StoreConfig {
        self.lock().config
    }
}

#[cfg(test)]
mod tests;
