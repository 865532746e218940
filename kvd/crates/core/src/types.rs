//! The store's plain data types: identifiers, handles, and what operations return.
//!
//! Everything here is plain data (integers, fixed arrays, vectors of them) so that each type
//! maps to a C struct without extra logic.

use serde::{Deserialize, Serialize};

pub use crate::counters::Counters;
use crate::error::BlockState;
use crate::keys::{BlockKey, BlockTag};

/// A client session (holder of a lease, of in-progress blocks, of pins).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SessionId(pub u64);

/// An inference request, as the engine or gateway numbers it: the one request-id type of the
/// store (manifests, checkpoint blocks), the control shim and the C ABI. A plain number because
/// it is the engine's own, not an identity kvd hands out (those are newtypes: sessions,
/// reservations, handles).
pub type RequestId = u64;

/// A space reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ReservationId(pub u64);

/// A reference to one version of one block: which node incarnation, which slot, which
/// occupant of the slot. Every use checks both generations; a stale handle gets
/// [`crate::Error::StaleGeneration`], never another block's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Handle {
    /// The generation of the node (daemon start) that issued the handle.
    pub node_generation: u64,
    /// The slot (page index) the block lives in.
    pub slot: u32,
    /// The block's generation: unique per store, strictly increasing per slot.
    pub generation: u64,
}

impl Handle {
    /// The version of the block this handle names, for compare-and-delete.
    pub fn version(&self) -> BlockVersion {
        BlockVersion {
            node_generation: self.node_generation,
            generation: self.generation,
        }
    }
}

/// One version of a block under its key, as compare-and-delete names it: the node incarnation
/// that published it and the block's generation within that incarnation.
///
/// Block generations restart in every incarnation, so a generation alone is not a version: a
/// `remove_if(K, 1)` remembered from incarnation 1 must not remove the block published under K
/// in incarnation 2. Carrying the node generation makes every version unique across restarts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BlockVersion {
    /// The generation of the node incarnation that holds the block.
    pub node_generation: u64,
    /// The block's generation within that incarnation.
    pub generation: u64,
}

/// Which class of block to allocate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum BlockClass {
    /// A prefix-cache block: published with `Store::publish` (kvd-store), evictable (LRU)
    /// when unpinned.
    Cache,
    /// A block of a request's checkpoint: published with
    /// `Store::manifest_extend` (kvd-store) into that request's manifest at that epoch,
    /// never evicted, freed when the manifest ends.
    Checkpoint {
        /// The request whose manifest the block will join.
        request: RequestId,
        /// The manifest's epoch.
        epoch: u64,
    },
}

/// A freshly allocated block: where to write it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    /// The block's handle.
    pub handle: Handle,
    /// Byte offset of the block's page in the pool region.
    pub offset: u64,
    /// The page's size in bytes (the most the block can hold).
    pub capacity: u64,
}

/// A PUBLISHED block as a lookup sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockInfo {
    /// The block's key.
    pub key: BlockKey,
    /// The block's handle.
    pub handle: Handle,
    /// Byte offset of the block's page in the pool region.
    pub offset: u64,
    /// Valid bytes in the block.
    pub len: u64,
    /// CRC-32C of those bytes, recorded at SEAL.
    pub checksum: u32,
    /// The TTL of the pin this answer took, in ms from when the daemon took it (0: not
    /// pinned). A reader must not trust the block's bytes in the mapping past it.
    pub pin_ttl_ms: u64,
}

/// The longest prefix of a chain of tags that is PUBLISHED here.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefixHit {
    /// The blocks of the prefix, in chain order (pinned if the lookup asked to pin).
    pub blocks: Vec<BlockInfo>,
    /// Whether the blocks were pinned for the caller's session.
    pub pinned: bool,
}

/// What a checkpoint holder can restore for a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestorePrefix {
    /// The manifest's epoch.
    pub epoch: u64,
    /// The verified blocks of the prefix, in order.
    pub blocks: Vec<BlockInfo>,
    /// Tokens those blocks cover (never more than the manifest's committed count).
    pub tokens: u64,
    /// The manifest's committed token count.
    pub committed_tokens: u64,
}

/// What happened to a block, as a KV-aware router needs to know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BlockEventKind {
    /// The block became PUBLISHED: lookups under its key hit from now on.
    Stored,
    /// The PUBLISHED block left the index (removed, evicted, quarantined, or its checkpoint
    /// ended, expired or was superseded): lookups under its key miss from now on.
    Removed,
}

/// One entry of a node's block event log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockEvent {
    /// The event's sequence number: 1 for the first event of a node incarnation, then strictly
    /// increasing by one. A restart starts again at 1; the node generation tells incarnations
    /// apart.
    pub seq: u64,
    /// Stored or removed.
    pub kind: BlockEventKind,
    /// The block's key.
    pub key: BlockKey,
}

/// A batch drained from a node's block event log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventBatch {
    /// The events, in sequence order, without gaps.
    pub events: Vec<BlockEvent>,
    /// The sequence number to ask from next (one past the last event returned, or where the
    /// log stands when there was none).
    pub next_seq: u64,
    /// Events the reader asked for that the bounded log had already dropped (0: none). When
    /// not 0 the reader's picture of the node has a hole it cannot fill from the log: it must
    /// resynchronise with a full lookup.
    pub lost: u64,
}

/// A request's checkpoint manifest as published.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestInfo {
    /// The request.
    pub request: RequestId,
    /// Its epoch.
    pub epoch: u64,
    /// The layout of its blocks.
    pub namespace: crate::keys::NamespaceId,
    /// The tags of its blocks, in order.
    pub tags: Vec<BlockTag>,
    /// Tokens committed (covered by the blocks).
    pub committed_tokens: u64,
    /// When the manifest expires unless renewed (store clock, ms).
    pub expires_at_ms: u64,
    /// The reservation that backs it, if one was asked for.
    pub reservation: Option<ReservationId>,
}

/// A hand-off hold as it stands (the prefill's run kept for its decode).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HoldInfo {
    /// The request.
    pub request: RequestId,
    /// The epoch of the attempt that made it.
    pub epoch: u64,
    /// The keys held, in order (the leading published run of those asked for).
    pub keys: Vec<crate::keys::BlockKey>,
    /// Their bytes.
    pub bytes: u64,
    /// How long it has been held, ms.
    pub age_ms: u64,
    /// How long until it expires unless renewed or ended, ms.
    pub expires_in_ms: u64,
}

/// The hand-off holds of a node, in all.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HoldsSummary {
    /// Holds live.
    pub holds: u64,
    /// Blocks they pin.
    pub blocks: u64,
    /// Their bytes.
    pub bytes: u64,
    /// The oldest hold's age, ms.
    pub oldest_age_ms: u64,
}

/// What closing (or expiring) a session released.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionCleanup {
    /// Unfinished blocks (ALLOCATED, WRITING, SEALED) aborted.
    pub blocks_aborted: u32,
    /// Pins dropped.
    pub pins_dropped: u32,
    /// Reservations released.
    pub reservations_released: u32,
}

/// What one reaper tick did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReapReport {
    /// Sessions whose lease had expired, closed.
    pub sessions_expired: u32,
    /// Pins whose TTL had passed, dropped.
    pub pins_expired: u32,
    /// Manifests whose TTL had passed, released.
    pub manifests_expired: u32,
    /// Hand-off holds whose TTL had passed, released (their decode never came).
    #[serde(default)]
    pub holds_expired: u32,
    /// Quarantined pages returned to the pool after their hold.
    pub quarantine_released: u32,
    /// True if the budget ran out before everything due was done (the next tick continues).
    pub budget_exhausted: bool,
    /// The running page counts add up to the total and agree with the free list (an O(1) check
    /// every tick; `Store::audit` (kvd-store) recounts every slot).
    pub accounting_balanced: bool,
}

/// Page counts per state. `free + allocated + writing + sealed + published + retired +
/// quarantined == total` always (invariant 3, docs/ARCHITECTURE.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Accounting {
    /// Pages in the pool.
    pub total: u32,
    /// Pages on the free list.
    pub free: u32,
    /// ALLOCATED blocks.
    pub allocated: u32,
    /// WRITING blocks.
    pub writing: u32,
    /// SEALED blocks.
    pub sealed: u32,
    /// PUBLISHED blocks.
    pub published: u32,
    /// Unlinked blocks waiting for their last pin or copy to finish.
    pub retired: u32,
    /// Blocks that failed their checksum, held apart.
    pub quarantined: u32,
}

impl Accounting {
    /// Whether the parts add up to the total.
    pub fn balanced(&self) -> bool {
        self.free as u64
            + self.allocated as u64
            + self.writing as u64
            + self.sealed as u64
            + self.published as u64
            + self.retired as u64
            + self.quarantined as u64
            == self.total as u64
    }

    /// Pages per state, free first, with the names metrics and `kvd status` show.
    pub fn by_state(&self) -> [(&'static str, u32); 7] {
        [
            ("free", self.free),
            ("allocated", self.allocated),
            ("writing", self.writing),
            ("sealed", self.sealed),
            ("published", self.published),
            ("retired", self.retired),
            ("quarantined", self.quarantined),
        ]
    }

    /// The count of pages in `state` (the store keeps these exact on every transition).
    pub fn slot_count(&mut self, state: BlockState) -> &mut u32 {
        match state {
            BlockState::Allocated => &mut self.allocated,
            BlockState::Writing => &mut self.writing,
            BlockState::Sealed => &mut self.sealed,
            BlockState::Published => &mut self.published,
            BlockState::Retired => &mut self.retired,
            BlockState::Quarantined => &mut self.quarantined,
        }
    }
}

/// A point-in-time view of the store for metrics and `/status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreStats {
    /// This node's generation.
    pub node_generation: u64,
    /// Bytes per page.
    pub page_size_bytes: u64,
    /// Pages by state.
    pub accounting: Accounting,
    /// Pages reserved and not yet used.
    pub reserved_unused_pages: u64,
    /// Pin entries (session × block).
    pub pins: u64,
    /// Open sessions.
    pub sessions: u32,
    /// Live manifests.
    pub manifests: u32,
    /// Registered namespaces.
    pub namespaces: u32,
    /// Cache blocks that eviction could take now.
    pub evictable: u32,
    /// Counters since start.
    pub counters: Counters,
}

/// One open session, for `/status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionSummary {
    /// The session.
    pub id: SessionId,
    /// The name the client gave.
    pub name: String,
    /// When its lease expires (store clock, ms).
    pub expires_at_ms: u64,
    /// Its unfinished blocks.
    pub blocks_in_flight: u32,
    /// Blocks it pins.
    pub pins: u32,
    /// The process on the other end, as the kernel reported it (`SO_PEERCRED`).
    #[serde(default)]
    pub peer: Option<SessionPeer>,
    /// Milliseconds since it opened.
    #[serde(default)]
    pub age_ms: u64,
    /// Milliseconds since its last request.
    #[serde(default)]
    pub idle_ms: u64,
}

/// Who holds a session: the peer process's credentials, as the kernel saw them at connect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SessionPeer {
    /// Process id.
    pub pid: u32,
    /// User id.
    pub uid: u32,
}
