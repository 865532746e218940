//! What the frames carry.
//!
//! The first frame each way is the handshake ([`Hello`] → [`HelloReply`], the latter sent with
//! the pool's file descriptor). After it, the client sends [`Request`]s and the daemon answers
//! each with one [`Response`] carrying the same `id`, in order. Every data operation takes a
//! batch (at most [`Welcome::max_batch`] items) and answers per item where items can fail apart.
//!
//! No message carries a raw address: blocks are named by [`Handle`]s (both generations checked
//! on every use) or keys; offsets in replies are offsets into the pool mapping, valid for the
//! handle they came with.

use serde::{Deserialize, Serialize};

use crate::Error;
use crate::error::{BlockState, Corruption};
use crate::keys::{BlockKey, BlockTag, NamespaceDescriptor, NamespaceId};
use crate::types::{
    Allocation, BlockClass, BlockInfo, BlockVersion, EventBatch, Handle, HoldInfo, ManifestInfo,
    PrefixHit, RequestId, ReservationId, RestorePrefix, SessionId, StoreStats,
};

use super::frame::PROTOCOL_VERSION;

/// The client's first frame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// The version the client speaks (also in every frame header).
    pub protocol_version: u16,
    /// A name for logs and `/status` (at most 128 bytes).
    pub client_name: String,
    /// The session's heartbeat lease: without a heartbeat (or any request) for this long, the
    /// daemon aborts the session's unfinished blocks and drops its pins.
    pub lease_ttl_ms: u64,
}

impl Hello {
    /// A hello in this build's protocol version.
    pub fn new(client_name: &str, lease_ttl_ms: u64) -> Hello {
        Hello {
            protocol_version: PROTOCOL_VERSION,
            client_name: client_name.to_owned(),
            lease_ttl_ms,
        }
    }
}

/// The daemon's answer to [`Hello`]. `Welcome` comes with the pool's memfd attached.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum HelloReply {
    /// The session is open; the pool's fd is attached to this frame.
    Welcome(Welcome),
    /// No session (draining, too many sessions, bad version or lease); the connection closes.
    Refused(WireError),
}

/// What a client needs to know about the node and its session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    /// The version the daemon speaks.
    pub protocol_version: u16,
    /// The session opened for this connection.
    pub session: SessionId,
    /// This daemon incarnation's generation; every handle carries it.
    pub node_generation: u64,
    /// Bytes per page (the largest block).
    pub page_size_bytes: u64,
    /// Pages in the pool.
    pub page_count: u32,
    /// The pool mapping's length in bytes.
    pub pool_bytes: u64,
    /// The lease granted.
    pub lease_ttl_ms: u64,
    /// Items in one batched request at most.
    pub max_batch: u32,
    /// Body bytes in one frame at most.
    pub max_frame_bytes: u32,
    /// Requests the client may have unanswered at once; more are answered `Overloaded`.
    pub max_inflight: u32,
}

/// One request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Request {
    /// Chosen by the client; the response carries it back.
    pub id: u64,
    /// The engine's request id, when the operation serves one (for tracing only).
    pub request: Option<u64>,
    /// What to do.
    pub op: Op,
}

/// One item of a [`Op::Seal`] batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SealItem {
    /// The block.
    pub handle: Handle,
    /// Valid bytes written from the page's start.
    pub len: u64,
    /// CRC-32C of those bytes, computed by the writer during its copy; `None` makes the daemon
    /// compute it (one pass over the block).
    pub checksum: Option<u32>,
}

/// The operations. Batches hold at most `max_batch` items.
///
/// [`OpKind`] is the same list without the payloads, derived from it (so a new operation has
/// its name, its metrics and its place in every per-operation table with nothing else to
/// write): `OpKind::from(&op)`, its snake_case name (`<&str>::from(kind)`, as in
/// `kvd_op_duration_seconds{op="register_namespace"}`), `OpKind::iter()` and `OpKind::COUNT`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, strum::EnumDiscriminants)]
#[strum_discriminants(
    name(OpKind),
    derive(Hash, strum::EnumIter, strum::IntoStaticStr, strum::EnumCount),
    strum(serialize_all = "snake_case"),
    doc = "An operation's kind: [`Op`] without its payload (see there)."
)]
pub enum Op {
    /// Register a KV layout → [`Reply::Namespace`].
    RegisterNamespace(NamespaceDescriptor),
    /// The longest PUBLISHED prefix of a tag chain, optionally pinned → [`Reply::Prefix`].
    LookupPrefix {
        /// The layout.
        namespace: NamespaceId,
        /// The chain, first block first.
        tags: Vec<BlockTag>,
        /// Pin the blocks found for this session.
        pin: bool,
        /// The pins' TTL (the daemon's default when `None`).
        pin_ttl_ms: Option<u64>,
    },
    /// Which keys are PUBLISHED → [`Reply::Exists`] (a bitmap, bit i = key i).
    Exists {
        /// The keys.
        keys: Vec<BlockKey>,
    },
    /// Soft-pin PUBLISHED cache blocks until `ttl_ms` from now (0 ends it): eviction takes them
    /// only when nothing else can go → [`Reply::Exists`] (bit i: key i was soft-pinned).
    SoftPin {
        /// The keys (a shared prefix: a system prompt's blocks).
        keys: Vec<BlockKey>,
        /// How long, ms (capped at a day).
        ttl_ms: u64,
    },
    /// Pin PUBLISHED blocks → [`Reply::Acquired`], one result per key.
    Acquire {
        /// The keys.
        keys: Vec<BlockKey>,
        /// The pins' TTL (the daemon's default when `None`).
        ttl_ms: Option<u64>,
    },
    /// Release pins → [`Reply::Each`]; a stale or unpinned handle gets its error in place.
    Release {
        /// The handles acquired.
        handles: Vec<Handle>,
    },
    /// Allocate blocks to write through the mapping (they start WRITING) →
    /// [`Reply::Allocated`], one result per key; existing keys get `AlreadyExists`.
    Alloc {
        /// The keys.
        keys: Vec<BlockKey>,
        /// Cache or checkpoint.
        class: BlockClass,
        /// Draw from this reservation.
        reservation: Option<ReservationId>,
    },
    /// Seal written blocks → [`Reply::Sealed`], the recorded checksum per block.
    Seal {
        /// The blocks.
        blocks: Vec<SealItem>,
    },
    /// Publish SEALED cache blocks as one group, all or none → [`Reply::Done`].
    Publish {
        /// The group.
        handles: Vec<Handle>,
    },
    /// Abort unfinished blocks → [`Reply::Each`].
    Abort {
        /// The blocks.
        handles: Vec<Handle>,
    },
    /// Compare-and-delete each `(key, version)` → [`Reply::Each`]; a version from another node
    /// incarnation never matches.
    RemoveIf {
        /// The versions to remove.
        items: Vec<(BlockKey, BlockVersion)>,
    },
    /// Mark blocks recently used → [`Reply::Done`].
    Touch {
        /// The keys.
        keys: Vec<BlockKey>,
    },
    /// Renew the lease → [`Reply::Lease`].
    Heartbeat,
    /// The store's counts → [`Reply::Stats`].
    Stats,
    /// Close the session cleanly (the daemon answers [`Reply::Done`] and closes).
    Goodbye,
    /// Reserve space for this session's future allocations → [`Reply::Reservation`]; refused
    /// while draining.
    Reserve {
        /// Bytes to set aside.
        bytes: u64,
    },
    /// Give a reservation's unused space back → [`Reply::Done`].
    ReleaseReservation {
        /// The reservation.
        reservation: ReservationId,
    },
    /// Begin (or supersede with a newer epoch) a request's checkpoint manifest →
    /// [`Reply::Manifest`]; refused while draining.
    ManifestBegin {
        /// The request.
        request: RequestId,
        /// Its epoch.
        epoch: u64,
        /// The layout of its blocks.
        namespace: NamespaceId,
        /// Space to reserve for its blocks (0 for none).
        reserve_bytes: u64,
        /// The manifest's TTL.
        ttl_ms: u64,
    },
    /// Publish SEALED checkpoint blocks into the manifest with the new committed token count,
    /// atomically → [`Reply::Manifest`].
    ManifestExtend {
        /// The request.
        request: RequestId,
        /// Its epoch (an older one gets `StaleEpoch`).
        epoch: u64,
        /// The blocks, in order.
        handles: Vec<Handle>,
        /// Tokens now covered.
        committed_tokens: u64,
    },
    /// Renew a manifest's TTL → [`Reply::Lease`].
    ManifestRenew {
        /// The request.
        request: RequestId,
        /// Its epoch.
        epoch: u64,
        /// The new TTL.
        ttl_ms: u64,
    },
    /// The request ended: release its checkpoint → [`Reply::Done`].
    ManifestEnd {
        /// The request.
        request: RequestId,
        /// Its epoch.
        epoch: u64,
    },
    /// A request's manifest → [`Reply::Manifest`].
    ManifestGet {
        /// The request.
        request: RequestId,
    },
    /// A reader's copy of these pinned blocks failed its checksum: the daemon checks its own
    /// copy of each and quarantines those that fail too → [`Reply::Each`]: `Ok` when the
    /// daemon's copy is intact, `Corrupt` (quarantined) when it was not.
    ReportCorrupt {
        /// The blocks, pinned by this session.
        handles: Vec<Handle>,
    },
    /// Recovery's question: the longest verified checkpoint prefix of `tokens` held here →
    /// [`Reply::Restore`] (every block's checksum checked just now; not pinned: acquire them).
    RestorePrefix {
        /// The request.
        request: RequestId,
        /// Its token history.
        tokens: Vec<u32>,
    },
    /// Drain the node's block event log (stored / removed, for KV-aware routers) →
    /// [`Reply::Events`]: the events with `seq >= since`, at most `max` (a batch, so at most
    /// `max_batch`). Pass the reply's `next_seq` as the next `since`; `lost > 0` means the
    /// bounded log dropped events the reader had not read, and it must resync with lookups.
    Events {
        /// The first sequence number wanted (0: the oldest held).
        since: u64,
        /// Events at most.
        max: u32,
    },
    /// Push PUBLISHED blocks (one namespace) to a peer daemon over the data port → [`Reply::Transfer`]
    /// at once (the push runs in the background; poll it with [`Op::Transfers`]). The blocks
    /// stay pinned here until it ends; the peer publishes them as one group only when every
    /// byte arrived intact. Needs the data port (`--cluster-secret-file`).
    Push {
        /// The peer's node id (in the daemon's peer table).
        peer: u64,
        /// The blocks.
        keys: Vec<BlockKey>,
    },
    /// Fetch PUBLISHED blocks (one namespace) from a peer daemon over the data port →
    /// [`Reply::Transfer`] at once (poll it with [`Op::Transfers`]). The peer pins them while
    /// they are read; this node publishes them as one group only when every byte arrived
    /// intact (keys the peer lacks, or this node holds already, are skipped).
    ///
    /// With `peer` [`ANY_NODE`], a cluster lookup's fetch: the daemon asks its live peers
    /// which of `keys` they hold and fetches the longest run from the first key that they
    /// hold between them, each piece from its holder (the transfer's `peer` is then the first
    /// piece's holder, 0 when none held the first key).
    Fetch {
        /// The peer's node id (in the daemon's peer table), or [`ANY_NODE`].
        peer: u64,
        /// The blocks.
        keys: Vec<BlockKey>,
    },
    /// Stream one step of a request's checkpoint to its holder: push these PUBLISHED
    /// checkpoint blocks of `request` (at `epoch`) to `peer`, which extends its own manifest of
    /// the request with them and `committed_tokens`, atomically (beginning it at `epoch` if it
    /// has none; an older epoch is refused) → [`Reply::Transfer`].
    PushCheckpoint {
        /// The holder's node id.
        peer: u64,
        /// The request.
        request: RequestId,
        /// Its epoch (the holder refuses steps of an older one).
        epoch: u64,
        /// The step's blocks, in token order.
        keys: Vec<BlockKey>,
        /// The request's committed token count after this step.
        committed_tokens: u64,
        /// The holder's manifest TTL, ms.
        ttl_ms: u64,
    },
    /// The recovery read: fetch from `peer` (the request's checkpoint holder) the longest
    /// verified prefix of `request`'s checkpoint that `tokens` continues → [`Reply::Transfer`];
    /// the blocks land here as PUBLISHED cache blocks, and the transfer's `tokens` says how
    /// many tokens they cover.
    FetchPrefix {
        /// The holder's node id.
        peer: u64,
        /// The request.
        request: RequestId,
        /// Its token history.
        tokens: Vec<u32>,
    },
    /// The state of transfers started here → [`Reply::Transfers`] (unknown ids are left out).
    Transfers {
        /// Their ids.
        ids: Vec<u64>,
    },
    /// Register this session as rank `rank` of engine instance `(instance, generation)` of
    /// `rank_count` ranks (a tensor- or pipeline-parallel instance).
    InstanceJoin {
        /// The instance.
        instance: u64,
        /// Its generation (a restarted instance has a higher one).
        generation: u64,
        /// This session's rank.
        rank: u32,
        /// Ranks the instance has.
        rank_count: u32,
    },
    /// Commit this rank's SEALED blocks of step `step`: published with every other rank's
    /// when the last rank commits.
    InstanceCommit {
        /// The instance.
        instance: u64,
        /// Its generation.
        generation: u64,
        /// The step (a checkpoint step of the instance).
        step: u64,
        /// This rank's blocks of it.
        handles: Vec<Handle>,
    },
    /// A prefill hands its prompt's run off: hold the leading PUBLISHED run of `keys` for
    /// `request` at `epoch`, owned by the daemon (it outlives this session), until it is ended,
    /// taken by the decode that fetched it, or its TTL passes → [`Reply::Hold`]. The same epoch
    /// again renews it; a newer one supersedes it; an older or ended one is `StaleEpoch`.
    /// Refused while draining.
    HoldBegin {
        /// The request (the front's id, or one the connector derives).
        request: RequestId,
        /// The epoch of the attempt.
        epoch: u64,
        /// The run's keys, first block first (one namespace).
        keys: Vec<BlockKey>,
        /// How long it is kept unless ended, ms.
        ttl_ms: u64,
    },
    /// End `request`'s hand-off hold if its epoch is at most `epoch` → [`Reply::Ended`].
    HoldEnd {
        /// The request.
        request: RequestId,
        /// The newest epoch to end.
        epoch: u64,
    },
    /// A decode's hand-off read: fetch `keys` from `peer`'s hold of `request` at `epoch`
    /// (the peer refuses unless that hold lives and holds every key) → [`Reply::Transfer`];
    /// like [`Op::Fetch`] otherwise. With `end_hold`, the peer's hold ends once every block
    /// is published here.
    FetchHeld {
        /// The prefill's node id.
        peer: u64,
        /// The request the run is held for.
        request: RequestId,
        /// The epoch it was held at.
        epoch: u64,
        /// The blocks.
        keys: Vec<BlockKey>,
        /// End the hold once the run is here.
        end_hold: bool,
    },
}

/// Where a transfer is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum TransferState {
    /// Under way.
    InFlight,
    /// Every block published at the destination.
    Done,
    /// Failed; nothing of it was published at the destination.
    Failed(WireError),
}

/// A transfer started here, as [`Op::Transfers`] reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferInfo {
    /// Its id.
    pub id: u64,
    /// The peer node.
    pub peer: u64,
    /// Where it is.
    pub state: TransferState,
    /// Blocks published at the destination (those it held already are not counted).
    pub blocks: u32,
    /// Their bytes.
    pub bytes: u64,
    /// A prefix fetch's tokens covered by the blocks it brought (0 otherwise).
    pub tokens: u64,
    /// Milliseconds from the request to its end (0 while in flight).
    pub elapsed_ms: u64,
}

impl Op {
    /// The operation's name, for metrics and logs (its kind's snake_case name).
    pub fn name(&self) -> &'static str {
        OpKind::from(self).into()
    }

    /// Items in the batch (1 for single operations).
    pub fn batch_len(&self) -> usize {
        match self {
            Op::LookupPrefix { tags, .. } => tags.len(),
            Op::Exists { keys }
            | Op::Acquire { keys, .. }
            | Op::Touch { keys }
            | Op::SoftPin { keys, .. } => keys.len(),
            Op::Alloc { keys, .. } => keys.len(),
            Op::Release { handles }
            | Op::Publish { handles }
            | Op::Abort { handles }
            | Op::ManifestExtend { handles, .. }
            | Op::ReportCorrupt { handles } => handles.len(),
            Op::Seal { blocks } => blocks.len(),
            Op::RemoveIf { items } => items.len(),
            Op::Events { max, .. } => *max as usize,
            // A token history is bounded by the frame size; its blocks are not a batch.
            Op::RegisterNamespace(_)
            | Op::Heartbeat
            | Op::Stats
            | Op::Goodbye
            | Op::Reserve { .. }
            | Op::ReleaseReservation { .. }
            | Op::ManifestBegin { .. }
            | Op::ManifestRenew { .. }
            | Op::ManifestEnd { .. }
            | Op::ManifestGet { .. }
            | Op::RestorePrefix { .. } => 1,
            Op::Push { keys, .. } | Op::Fetch { keys, .. } | Op::PushCheckpoint { keys, .. } => {
                keys.len()
            }
            Op::FetchPrefix { .. } => 1,
            Op::Transfers { ids } => ids.len(),
            Op::InstanceJoin { .. } => 1,
            Op::InstanceCommit { handles, .. } => handles.len(),
            Op::HoldBegin { keys, .. } | Op::FetchHeld { keys, .. } => keys.len(),
            Op::HoldEnd { .. } => 1,
        }
    }
}

/// The answer to one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Response {
    /// The request's id (0 for an error about a frame that could not be decoded).
    pub id: u64,
    /// The outcome of the whole call; per-item outcomes are inside the reply.
    pub result: Result<Reply, WireError>,
}

/// Replies, by operation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    /// Nothing to report.
    Done,
    /// A namespace's id.
    Namespace(NamespaceId),
    /// A prefix lookup's hit.
    Prefix(PrefixHit),
    /// Bit i (of byte i / 8, least significant first) is set when key i is PUBLISHED.
    Exists(Vec<u8>),
    /// Per key: the pinned block or why not.
    Acquired(Vec<Result<BlockInfo, WireError>>),
    /// Per key: where to write, or why not.
    Allocated(Vec<Result<Allocation, WireError>>),
    /// Per block: the checksum recorded, or why not.
    Sealed(Vec<Result<u32, WireError>>),
    /// Per item: done or why not.
    Each(Vec<Result<(), WireError>>),
    /// The lease's new expiry, in ms from now.
    Lease {
        /// Milliseconds until the lease expires without another heartbeat.
        expires_in_ms: u64,
    },
    /// The store's counts.
    Stats(StoreStats),
    /// A reservation.
    Reservation(ReservationId),
    /// A manifest as published.
    Manifest(ManifestInfo),
    /// What a checkpoint holder can restore.
    Restore(RestorePrefix),
    /// A batch of block events.
    Events(EventBatch),
    /// A transfer was started; its id.
    Transfer(u64),
    /// Transfers' states.
    Transfers(Vec<TransferInfo>),
    /// An instance step commit: whether it published the step.
    InstanceStep {
        /// Every rank had committed: the step's blocks are PUBLISHED.
        published: bool,
    },
    /// A hand-off hold as it stands.
    Hold(HoldInfo),
    /// Whether something ended.
    Ended(bool),
}

/// [`Error`] as it travels: the same variants and fields, with owned strings (so that a reply
/// decodes from any buffer). Converts both ways.
#[allow(missing_docs)]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireError {
    StaleGeneration {
        handle_node: u64,
        handle_slot: u64,
        current_node: u64,
        current_slot: u64,
    },
    IllegalTransition {
        from: BlockState,
        op: String,
    },
    NoSpace {
        requested_bytes: u64,
        free_bytes: u64,
    },
    Overloaded {
        what: String,
        retry_after_ms: u64,
    },
    NotFound(String),
    AlreadyExists(String),
    Corrupt {
        expected: u32,
        found: u32,
        outcome: Corruption,
    },
    InvalidArgument(String),
    LeaseExpired(String),
    StaleEpoch {
        got: u64,
        current: u64,
    },
    Deadline(String),
    Unavailable(String),
    Protocol(String),
    Io(String),
    Disconnected(String),
    /// Appended last, so the earlier variants keep their encoding.
    Unsupported(String),
}

impl From<Error> for WireError {
    fn from(e: Error) -> WireError {
        match e {
            Error::StaleGeneration {
                handle_node,
                handle_slot,
                current_node,
                current_slot,
            } => WireError::StaleGeneration {
                handle_node,
                handle_slot,
                current_node,
                current_slot,
            },
            Error::IllegalTransition { from, op } => WireError::IllegalTransition {
                from,
                op: op.to_owned(),
            },
            Error::NoSpace {
                requested_bytes,
                free_bytes,
            } => WireError::NoSpace {
                requested_bytes,
                free_bytes,
            },
            Error::Overloaded {
                what,
                retry_after_ms,
            } => WireError::Overloaded {
                what,
                retry_after_ms,
            },
            Error::NotFound(s) => WireError::NotFound(s),
            Error::AlreadyExists(s) => WireError::AlreadyExists(s),
            Error::Corrupt {
                expected,
                found,
                outcome,
            } => WireError::Corrupt {
                expected,
                found,
                outcome,
            },
            Error::InvalidArgument(s) => WireError::InvalidArgument(s),
            Error::LeaseExpired(s) => WireError::LeaseExpired(s),
            Error::StaleEpoch { got, current } => WireError::StaleEpoch { got, current },
            Error::Deadline(s) => WireError::Deadline(s),
            Error::Unavailable(s) => WireError::Unavailable(s),
            Error::Protocol(s) => WireError::Protocol(s),
            Error::Io(s) => WireError::Io(s),
            Error::Disconnected(s) => WireError::Disconnected(s),
            Error::Unsupported(s) => WireError::Unsupported(s),
        }
    }
}

/// The operation names the store uses in `IllegalTransition`, so that the error keeps its
/// `&'static str` on the client side.
fn static_op(op: &str) -> &'static str {
    const KNOWN: [&str; 10] = [
        "write",
        "write to",
        "begin writing",
        "seal",
        "publish",
        "abort",
        "remove",
        "read",
        "extend",
        "restore",
    ];
    KNOWN
        .iter()
        .find(|k| **k == op)
        .copied()
        .unwrap_or("operate on")
}

impl From<WireError> for Error {
    fn from(e: WireError) -> Error {
        match e {
            WireError::StaleGeneration {
                handle_node,
                handle_slot,
                current_node,
                current_slot,
            } => Error::StaleGeneration {
                handle_node,
                handle_slot,
                current_node,
                current_slot,
            },
            WireError::IllegalTransition { from, op } => Error::IllegalTransition {
                from,
                op: static_op(&op),
            },
            WireError::NoSpace {
                requested_bytes,
                free_bytes,
            } => Error::NoSpace {
                requested_bytes,
                free_bytes,
            },
            WireError::Overloaded {
                what,
                retry_after_ms,
            } => Error::Overloaded {
                what,
                retry_after_ms,
            },
            WireError::NotFound(s) => Error::NotFound(s),
            WireError::AlreadyExists(s) => Error::AlreadyExists(s),
            WireError::Corrupt {
                expected,
                found,
                outcome,
            } => Error::Corrupt {
                expected,
                found,
                outcome,
            },
            WireError::InvalidArgument(s) => Error::InvalidArgument(s),
            WireError::LeaseExpired(s) => Error::LeaseExpired(s),
            WireError::StaleEpoch { got, current } => Error::StaleEpoch { got, current },
            WireError::Deadline(s) => Error::Deadline(s),
            WireError::Unavailable(s) => Error::Unavailable(s),
            WireError::Protocol(s) => Error::Protocol(s),
            WireError::Io(s) => Error::Io(s),
            WireError::Disconnected(s) => Error::Disconnected(s),
            WireError::Unsupported(s) => Error::Unsupported(s),
        }
    }
}

/// [`Op::Fetch`]'s peer for "whichever peers hold them" (node ids start at 1).
pub const ANY_NODE: u64 = 0;

/// Pack booleans into a bitmap (bit i of byte i / 8, least significant first).
pub fn pack_bits(bits: impl IntoIterator<Item = bool>) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, b) in bits.into_iter().enumerate() {
        if i % 8 == 0 {
            out.push(0);
        }
        if b {
            *out.last_mut().expect("pushed above") |= 1 << (i % 8);
        }
    }
    out
}

/// Bit `i` of a bitmap from [`pack_bits`].
pub fn bit(bitmap: &[u8], i: usize) -> bool {
    bitmap.get(i / 8).is_some_and(|b| b & (1 << (i % 8)) != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The operations' names are metric labels (`kvd_op_duration_seconds{op=...}`) that
    /// dashboards and alerts select on: derived from the enum, and held here so that renaming
    /// a variant is seen as the label change it is (then update `deploy/` too).
    #[test]
    fn every_operation_has_its_snake_case_name_and_the_labels_stay_what_dashboards_select() {
        use strum::{EnumCount, IntoEnumIterator};
        let mut names: Vec<&str> = OpKind::iter().map(<&str>::from).collect();
        assert_eq!(names.len(), OpKind::COUNT);
        names.sort_unstable();
        let mut labels = [
            "register_namespace",
            "lookup_prefix",
            "exists",
            "acquire",
            "release",
            "alloc",
            "seal",
            "publish",
            "abort",
            "remove_if",
            "touch",
            "soft_pin",
            "heartbeat",
            "stats",
            "goodbye",
            "reserve",
            "release_reservation",
            "manifest_begin",
            "manifest_extend",
            "manifest_renew",
            "manifest_end",
            "manifest_get",
            "restore_prefix",
            "report_corrupt",
            "events",
            "push",
            "fetch",
            "push_checkpoint",
            "fetch_prefix",
            "transfers",
            "instance_join",
            "instance_commit",
            "hold_begin",
            "hold_end",
            "fetch_held",
        ];
        labels.sort_unstable();
        assert_eq!(names, labels);
        assert_eq!(Op::Heartbeat.name(), "heartbeat");
        assert_eq!(Op::Transfers { ids: vec![] }.name(), "transfers");
    }

    #[test]
    fn every_error_survives_the_wire_with_its_code() {
        let errors = Error::one_of_each();
        for e in errors {
            let w = WireError::from(e.clone());
            let bytes = crate::protocol::frame::encode(&w).unwrap();
            let back: WireError = crate::protocol::frame::decode_frame(&bytes).unwrap();
            let back = Error::from(back);
            assert_eq!(back, e);
            assert_eq!(back.code(), e.code());
        }
    }

    #[test]
    fn the_exists_bitmap_packs_least_significant_bit_first() {
        let bits = [true, false, false, true, false, false, false, false, true];
        let m = pack_bits(bits);
        assert_eq!(m, vec![0b0000_1001, 0b1]);
        for (i, b) in bits.iter().enumerate() {
            assert_eq!(bit(&m, i), *b);
        }
        assert!(!bit(&m, 100));
    }
}
