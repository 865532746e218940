//! The memory side of an engine, shared by every backend: the registered segments, the grants
//! on them, and the accesses peers have in progress.
//!
//! A peer's access goes `begin` (checked against a live grant and the node generation, before
//! a byte is touched) → the bytes move → `end`. [`Target::revoke`] of a transfer waits until
//! none of its accesses is in progress, so once it returns nobody writes the range any more.
//! The only pointers formed here are `segment base + checked offset`: nothing from the wire is
//! ever used as an address.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use super::Memory;
use crate::error::{Error, Result};
use crate::grant::{
    Access, Direction, Grant, GrantError, GrantLimits, Grants, SegmentId, TransferId,
};
use crate::segment::{BackendKind, SegmentDescriptor};

/// Refusal code for an access naming another incarnation of this node (after the seven of
/// [`Grants::refusals`]).
pub const REFUSED_STALE_GENERATION: u8 = 7;

#[derive(Debug)]
struct Segment {
    memory: Arc<dyn Memory>,
    /// Where the segment starts within `memory`.
    base: u64,
    len: u64,
}

#[derive(Debug)]
struct State {
    segments: HashMap<SegmentId, Segment>,
    grants: Grants,
    /// Accesses in progress, per transfer and per segment.
    active: HashMap<TransferId, u32>,
    active_segments: HashMap<SegmentId, u32>,
    stale_generation: u64,
    /// Chunks that arrived failing their checksum, per transfer (until it is revoked).
    tainted: HashMap<TransferId, u32>,
    /// Checksummed chunks that arrived intact, per transfer (until it is revoked; at most
    /// [`MAX_LEDGER_CHUNKS`] each).
    ledgers: HashMap<TransferId, Ledger>,
    /// CRC-32Cs the owner knows of granted ranges (a sealed block's), per transfer, sent with
    /// a read of exactly that range instead of computed (until the transfer is revoked).
    known: HashMap<TransferId, HashMap<(SegmentId, u64, u64), u32>>,
}

/// Chunks a transfer's ledger records at most; past it the ledger is marked incomplete (its
/// owner then checks the bytes itself).
pub const MAX_LEDGER_CHUNKS: usize = 65_536;

/// The checksummed chunks a transfer wrote here, each verified on arrival: enough to know a
/// range's CRC-32C without reading it again ([`Ledger::crc_of`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ledger {
    /// (segment, offset) → (len, CRC-32C), verified.
    chunks: std::collections::BTreeMap<(SegmentId, u64), (u32, u32)>,
    /// Chunks were left out (past the bound).
    incomplete: bool,
}

impl Ledger {
    /// The CRC-32C of `segment`'s `[offset, offset + len)`, when verified chunks tile it
    /// exactly; `None` otherwise (a gap, an overlap, a chunk left out).
    pub fn crc_of(&self, segment: SegmentId, offset: u64, len: u64) -> Option<u32> {
        if self.incomplete || len == 0 {
            return None;
        }
        let end = offset.checked_add(len)?;
        let mut at = offset;
        let mut crc = None;
        for (&(seg, off), &(clen, ccrc)) in self.chunks.range((segment, offset)..(segment, end)) {
            if seg != segment || off != at {
                return None;
            }
            crc = Some(match crc {
                None => ccrc,
                Some(c) => crate::local::crc32c_combine(c, ccrc, clen as usize),
            });
            at += u64::from(clen);
        }
        (at == end).then_some(crc).flatten()
    }
}

/// What [`Target::revoke`] found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Revoked {
    /// Grants dropped.
    pub grants: usize,
    /// Chunks of the transfer that arrived here failing their checksum.
    pub corrupt_chunks: u32,
    /// The checksummed chunks of it that arrived intact.
    pub ledger: Ledger,
}

/// A local range an op of ours names: where it is, and the memory that keeps it mapped.
#[derive(Debug, Clone)]
pub struct LocalRange {
    /// The first byte.
    pub ptr: *mut u8,
    /// Its memory (held by the batch until it is released).
    pub memory: Arc<dyn Memory>,
}

// SAFETY: the pointer is into `memory`, which is Send + Sync; using it is governed by the
// posting contract.
unsafe impl Send for LocalRange {}

/// A peer's access in progress: `len` bytes at `ptr`, inside a live grant. Hand it back with
/// [`Target::end`].
#[derive(Debug)]
pub struct Window {
    /// The first byte.
    pub ptr: *mut u8,
    /// Bytes.
    pub len: usize,
    transfer: TransferId,
    segment: SegmentId,
    _memory: Arc<dyn Memory>,
}

// SAFETY: as for LocalRange.
unsafe impl Send for Window {}

/// Registered segments, grants and accesses in progress.
#[derive(Debug)]
pub struct Target {
    node_id: u64,
    node_generation: std::sync::atomic::AtomicU64,
    backend: BackendKind,
    start: Instant,
    state: Mutex<State>,
    quiet: Condvar,
}

impl Target {
    /// An empty target for node `node_id` in incarnation `node_generation`.
    pub fn new(
        node_id: u64,
        node_generation: u64,
        backend: BackendKind,
        limits: GrantLimits,
    ) -> Target {
        Target {
            node_id,
            node_generation: std::sync::atomic::AtomicU64::new(node_generation),
            backend,
            start: Instant::now(),
            state: Mutex::new(State {
                segments: HashMap::new(),
                grants: Grants::new(limits),
                active: HashMap::new(),
                active_segments: HashMap::new(),
                stale_generation: 0,
                tainted: HashMap::new(),
                ledgers: HashMap::new(),
                known: HashMap::new(),
            }),
            quiet: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// This node's id.
    pub fn node_id(&self) -> u64 {
        self.node_id
    }

    /// This node's incarnation.
    pub fn node_generation(&self) -> u64 {
        self.node_generation
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// Become incarnation `generation` (higher than the current one): from now on accesses
    /// naming an older one, and descriptors of it, are refused as stale, and new connections
    /// introduce this node with it. Returns the generation it had.
    pub fn set_node_generation(&self, generation: u64) -> u64 {
        self.node_generation
            .swap(generation, std::sync::atomic::Ordering::AcqRel)
    }

    /// The clock grants expire on (ms since the target was made).
    pub fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// Register `len` bytes of `memory` from `offset` as `segment`.
    ///
    /// # Errors
    /// [`Error::OutOfRange`], [`Error::InvalidArgument`] for an empty range or an id in use.
    pub fn register(
        &self,
        segment: SegmentId,
        memory: Arc<dyn Memory>,
        offset: u64,
        len: u64,
    ) -> Result<SegmentDescriptor> {
        let inside = offset
            .checked_add(len)
            .is_some_and(|end| end <= memory.len() as u64);
        if !inside {
            return Err(Error::OutOfRange {
                offset,
                len,
                region_len: memory.len() as u64,
            });
        }
        if len == 0 {
            return Err(Error::InvalidArgument(
                "a segment holds at least one byte".into(),
            ));
        }
        let mut s = self.lock();
        if s.segments.contains_key(&segment) {
            return Err(Error::InvalidArgument(format!(
                "segment {} is registered already",
                segment.0
            )));
        }
        s.segments.insert(
            segment,
            Segment {
                memory,
                base: offset,
                len,
            },
        );
        s.grants.register_segment(segment, len);
        Ok(SegmentDescriptor {
            backend: self.backend,
            segment,
            len,
            node_id: self.node_id,
            node_generation: self.node_generation(),
        })
    }

    /// The descriptor of a registered segment.
    pub fn descriptor(&self, segment: SegmentId) -> Option<SegmentDescriptor> {
        self.lock()
            .segments
            .get(&segment)
            .map(|seg| SegmentDescriptor {
                backend: self.backend,
                segment,
                len: seg.len,
                node_id: self.node_id,
                node_generation: self.node_generation(),
            })
    }

    /// Forget a segment and its grants, once no access to it is in progress.
    ///
    /// # Errors
    /// [`Error::NotFound`].
    pub fn unregister(&self, segment: SegmentId) -> Result<()> {
        let mut s = self.lock();
        if !s.segments.contains_key(&segment) {
            return Err(Error::NotFound(format!("segment {}", segment.0)));
        }
        s.grants.unregister_segment(segment);
        while s.active_segments.get(&segment).copied().unwrap_or(0) > 0 {
            s = self.quiet.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        s.segments.remove(&segment);
        Ok(())
    }

    /// Where `len` bytes at `offset` of our own segment are, for an op of ours.
    ///
    /// # Errors
    /// [`Error::NotFound`] for an unknown segment, [`Error::OutOfRange`] outside it.
    pub fn local(&self, segment: SegmentId, offset: u64, len: u64) -> Result<LocalRange> {
        let s = self.lock();
        let seg = s
            .segments
            .get(&segment)
            .ok_or_else(|| Error::NotFound(format!("local segment {}", segment.0)))?;
        let inside = len > 0 && offset.checked_add(len).is_some_and(|end| end <= seg.len);
        if !inside {
            return Err(Error::OutOfRange {
                offset,
                len,
                region_len: seg.len,
            });
        }
        // SAFETY: base + offset + len <= memory.len() (checked at registration and above), so
        // the pointer stays inside the mapping.
        let ptr = unsafe { seg.memory.as_ptr().add((seg.base + offset) as usize) };
        Ok(LocalRange {
            ptr,
            memory: Arc::clone(&seg.memory),
        })
    }

    /// Add a grant.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a refused grant, [`Error::Overloaded`] past the bound.
    pub fn grant(&self, g: Grant) -> Result<()> {
        let mut s = self.lock();
        s.grants.grant(g).map_err(|e| match e {
            GrantError::TooMany(_) => Error::Overloaded {
                what: e.to_string(),
                retry_after_ms: 10,
            },
            _ => Error::InvalidArgument(e.to_string()),
        })
    }

    /// End a transfer's grants; returns once none of its accesses is in progress, with the
    /// grants dropped and the chunks of it that failed their checksum here.
    pub fn revoke(&self, transfer: TransferId) -> Revoked {
        let mut s = self.lock();
        let grants = s.grants.revoke(transfer);
        while s.active.get(&transfer).copied().unwrap_or(0) > 0 {
            s = self.quiet.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        let corrupt_chunks = s.tainted.remove(&transfer).unwrap_or(0);
        let ledger = s.ledgers.remove(&transfer).unwrap_or_default();
        s.known.remove(&transfer);
        Revoked {
            grants,
            corrupt_chunks,
            ledger,
        }
    }

    /// The owner knows the CRC-32C of `[offset, offset + len)` of `segment`, which `transfer`
    /// may read (a sealed block's): a read of exactly that range sends it instead of computing
    /// one, so the reader's check is end to end. Kept while the transfer has grants (at most
    /// one per grant).
    pub fn note_checksum(
        &self,
        transfer: TransferId,
        segment: SegmentId,
        offset: u64,
        len: u64,
        crc: u32,
    ) {
        let mut s = self.lock();
        let grants = s.grants.grants_of(transfer);
        if grants == 0 {
            return;
        }
        let k = s.known.entry(transfer).or_default();
        if k.len() < grants {
            k.insert((segment, offset, len), crc);
        }
    }

    /// What [`Target::note_checksum`] recorded for exactly this range, if anything.
    pub fn known_checksum(
        &self,
        transfer: TransferId,
        segment: SegmentId,
        offset: u64,
        len: u64,
    ) -> Option<u32> {
        self.lock()
            .known
            .get(&transfer)
            .and_then(|k| k.get(&(segment, offset, len)).copied())
    }

    /// A checksummed chunk written into `w` arrived intact with CRC-32C `crc`: record it in
    /// its transfer's ledger (only while the transfer has grants), then end the access.
    pub fn end_verified(&self, w: Window, offset: u64, crc: u32) {
        {
            let mut s = self.lock();
            if s.grants.has_transfer(w.transfer) {
                let l = s.ledgers.entry(w.transfer).or_default();
                if l.chunks.len() < MAX_LEDGER_CHUNKS {
                    l.chunks.insert((w.segment, offset), (w.len as u32, crc));
                } else {
                    l.incomplete = true;
                }
            }
        }
        self.end(w);
    }

    /// A chunk written into `w` came without a checksum: its transfer's ledger can no longer
    /// vouch for the pages (an earlier verified chunk there may have been overwritten), so it
    /// is marked incomplete and the owner's commit checks the pages themselves.
    pub fn end_unverified(&self, w: Window) {
        {
            let mut s = self.lock();
            if s.grants.has_transfer(w.transfer) {
                s.ledgers.entry(w.transfer).or_default().incomplete = true;
            }
        }
        self.end(w);
    }

    /// A chunk written into `w` failed its checksum: remember it against its transfer (only
    /// while the transfer has grants, so the table stays bounded by them), then end the
    /// access.
    pub fn end_corrupt(&self, w: Window) {
        {
            let mut s = self.lock();
            if s.grants.has_transfer(w.transfer) {
                *s.tainted.entry(w.transfer).or_default() += 1;
            }
        }
        self.end(w);
    }

    /// Drop expired grants (at most `budget` transfers' worth).
    pub fn expire(&self, budget: usize) -> usize {
        let now = self.now_ms();
        self.lock().grants.expire(now, budget)
    }

    /// Begin a peer's access, naming this node's incarnation `node_generation`: checked
    /// against a live grant before anything is touched.
    ///
    /// # Errors
    /// The refusal code ([`Grants::refusals`]'s order, or [`REFUSED_STALE_GENERATION`]),
    /// counted.
    pub fn begin(&self, a: &Access, node_generation: u64) -> std::result::Result<Window, u8> {
        let now = self.now_ms();
        let mut s = self.lock();
        if node_generation != self.node_generation() {
            s.stale_generation += 1;
            return Err(REFUSED_STALE_GENERATION);
        }
        if let Err(e) = s.grants.check(a, now) {
            return Err(e.code());
        }
        let seg = &s.segments[&a.segment];
        // SAFETY: the grant check put offset + len inside the segment, and the segment inside
        // its memory, so the pointer stays inside the mapping.
        let ptr = unsafe { seg.memory.as_ptr().add((seg.base + a.offset) as usize) };
        let w = Window {
            ptr,
            len: a.len as usize,
            transfer: a.transfer,
            segment: a.segment,
            _memory: Arc::clone(&seg.memory),
        };
        *s.active.entry(a.transfer).or_default() += 1;
        *s.active_segments.entry(a.segment).or_default() += 1;
        Ok(w)
    }

    /// A peer's access ended.
    pub fn end(&self, w: Window) {
        let mut s = self.lock();
        if let Some(n) = s.active.get_mut(&w.transfer) {
            *n -= 1;
            if *n == 0 {
                s.active.remove(&w.transfer);
            }
        }
        if let Some(n) = s.active_segments.get_mut(&w.segment) {
            *n -= 1;
            if *n == 0 {
                s.active_segments.remove(&w.segment);
            }
        }
        drop(s);
        self.quiet.notify_all();
    }

    /// Refusals so far, by reason (the seven of [`Grants::refusals`], then stale generation).
    pub fn refusals(&self) -> [u64; 8] {
        let s = self.lock();
        let g = s.grants.refusals();
        [g[0], g[1], g[2], g[3], g[4], g[5], g[6], s.stale_generation]
    }

    /// Live grants of one transfer.
    pub fn grants_of(&self, transfer: TransferId) -> usize {
        self.lock().grants.grants_of(transfer)
    }

    /// Live grants.
    pub fn live_grants(&self) -> usize {
        self.lock().grants.live()
    }

    /// Accesses in progress.
    pub fn active(&self) -> u32 {
        self.lock().active.values().sum()
    }
}

/// The access a direction of op asks for on the remote side.
pub fn remote_direction(kind: super::OpKind) -> Direction {
    match kind {
        super::OpKind::Read => Direction::RemoteRead,
        super::OpKind::Write => Direction::RemoteWrite,
    }
}
