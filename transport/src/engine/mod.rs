//! The transfer interface every backend implements, shaped after one-sided RDMA.
//!
//! ```text
//!  owner of memory (target)                     mover (initiator)
//!  register(segment, memory) ─▶ descriptor ──────────────▶ (learns it out of band)
//!  grant(transfer, epoch, segment, range, direction, expiry)
//!                                              open(peer) ─▶ endpoint
//!                                              submit(endpoint, [Op; n]) ─▶ batch   (unsafe)
//!  every chunk checked against a live grant ◀── chunks on the wire / memcpy
//!                                              poll / wait(batch) ─▶ per-op status
//!                                              cancel(batch), release(batch)
//!  revoke(transfer)  (waits for its chunks in flight to finish)
//! ```
//!
//! Setup calls (`register`, `open`, `grant`) may block and allocate. The data path (`submit`,
//! `poll`) is batched and bounded: operations and bytes in flight are limited per endpoint and
//! per engine ([`Limits`]); past a bound `submit` fails with the retryable
//! [`crate::Error::Overloaded`] and submits nothing.
//!
//! Each backend has its own registration type ([`Transport::Registration`]) and its own way to
//! name a peer ([`Transport::Peer`]); nothing here is a union of every backend's fields. One
//! folder per backend: `local/` (memcpy within a host), `tcp/` (io_uring), later `rdma/`.
//!
//! # The posting contract
//! [`Transport::submit`] is `unsafe`: from the call until the batch is *settled*
//! ([`BatchStatus::settled`]), the backend (or the kernel, or a NIC) may read the local range
//! of every write and write the local range of every read. The caller must not write either
//! range, nor read the range of a read, in that time. The memory itself stays mapped: the
//! engine holds the [`Memory`] of every segment a batch names until the batch is released.
//! [`Transport::grant`] is `unsafe` for the same reason on the other side: while a grant for a
//! remote write lives (and until `revoke` returns), a peer may write the range.

pub mod batches;
pub mod chunk;
pub mod memory;
pub mod target;

use std::time::Duration;

pub use batches::{BatchId, BatchStatus, OpFailure, OpStatus};
pub use memory::{HeapMemory, Memory};
pub use target::{Ledger, Revoked, Target};

use crate::error::Result;
use crate::grant::{Grant, SegmentId, TransferId};
use crate::segment::SegmentDescriptor;

/// An open connection (or set of connections) to one peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointId(pub u64);

/// Read the peer's bytes into ours, or write ours into the peer's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// Remote → local.
    Read,
    /// Local → remote.
    Write,
}

/// One operation of a batch: move `len` bytes between a local segment range and a remote one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Op {
    /// Read or write.
    pub kind: OpKind,
    /// The local segment (registered with this engine).
    pub local: SegmentId,
    /// Offset within the local segment.
    pub local_offset: u64,
    /// The remote segment, as its owner described it.
    pub remote: SegmentDescriptor,
    /// Offset within the remote segment.
    pub remote_offset: u64,
    /// Bytes to move (at least one).
    pub len: u64,
    /// The transfer whose grant on the remote side covers the remote range.
    pub transfer: TransferId,
    /// That transfer's epoch.
    pub epoch: u64,
}

/// The bounds of one engine. Every queue the engine keeps is bounded by one of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Operations in flight on one endpoint.
    pub max_ops_per_endpoint: usize,
    /// Bytes in flight on one endpoint.
    pub max_bytes_per_endpoint: u64,
    /// Operations in flight in the engine.
    pub max_ops: usize,
    /// Bytes in flight in the engine.
    pub max_bytes: u64,
    /// Operations in one batch.
    pub max_batch_ops: usize,
    /// Batches known to the engine (in flight or not yet released).
    pub max_batches: usize,
    /// Open endpoints.
    pub max_endpoints: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_ops_per_endpoint: 4096,
            max_bytes_per_endpoint: 1 << 30,
            max_ops: 16_384,
            max_bytes: 4 << 30,
            max_batch_ops: 1024,
            max_batches: 4096,
            max_endpoints: 256,
        }
    }
}

/// A registered segment, as each backend keeps it.
pub trait Registration {
    /// What a peer needs to name the segment (never an address).
    fn descriptor(&self) -> SegmentDescriptor;
}

/// One transfer backend. See the module docs for the shape and the posting contract.
pub trait Transport: Send + Sync {
    /// This backend's registration (an RDMA one holds its memory region; TCP's needs nothing
    /// beyond the descriptor).
    type Registration: Registration;
    /// How a peer is named when opening an endpoint (an address, another engine).
    type Peer: ?Sized;

    /// Register `len` bytes of `memory` from `offset` as segment `segment`.
    ///
    /// # Errors
    /// [`crate::Error::OutOfRange`] for a range outside `memory`,
    /// [`crate::Error::InvalidArgument`] for an id in use.
    fn register(
        &self,
        segment: SegmentId,
        memory: std::sync::Arc<dyn Memory>,
        offset: u64,
        len: u64,
    ) -> Result<Self::Registration>;

    /// Forget a segment; its grants go with it, after its chunks in flight finish.
    ///
    /// # Errors
    /// [`crate::Error::NotFound`].
    fn unregister(&self, registration: Self::Registration) -> Result<()>;

    /// Let a peer touch a range of a registered segment for one transfer.
    ///
    /// # Safety
    /// For a [`crate::grant::Direction::RemoteWrite`] grant, nobody else may read or write the
    /// range until [`Transport::revoke`] of its transfer has returned (a peer may be writing
    /// it); for a `RemoteRead` grant, nobody may write it in that time.
    ///
    /// # Errors
    /// As [`crate::grant::Grants::grant`], as [`crate::Error::InvalidArgument`] or
    /// [`crate::Error::Overloaded`].
    unsafe fn grant(&self, grant: Grant) -> Result<()>;

    /// End a transfer's grants. Returns once none of its chunks is in flight any more (bounded
    /// by the backend's stall timeout), with what the transfer left: the grants dropped, and
    /// how many of its chunks arrived here failing their checksum (a receiver must not trust
    /// the granted range's bytes then, whatever the sender says next).
    fn revoke(&self, transfer: TransferId) -> Revoked;

    /// The engine's clock (ms), on which grants' `expires_at_ms` are read.
    fn now_ms(&self) -> u64;

    /// Open an endpoint to a peer (connect and authenticate; may block).
    ///
    /// # Errors
    /// [`crate::Error::PeerUnavailable`], [`crate::Error::Overloaded`] (too many endpoints).
    fn open(&self, peer: &Self::Peer) -> Result<EndpointId>;

    /// Close an endpoint; its operations in flight fail.
    fn close(&self, endpoint: EndpointId);

    /// Submit a batch. All or nothing: on error nothing was submitted.
    ///
    /// # Safety
    /// The posting contract of the module docs: until the batch is settled, the caller does not
    /// write the local range of any op, nor read the local range of a read.
    ///
    /// # Errors
    /// [`crate::Error::Overloaded`] past a bound (retryable), [`crate::Error::NotFound`] for an
    /// unknown endpoint or local segment, [`crate::Error::OutOfRange`] for a local range
    /// outside its segment, [`crate::Error::InvalidArgument`] for an empty batch, an empty op
    /// or a remote segment of another node than the endpoint's,
    /// [`crate::Error::PeerUnavailable`] when the endpoint has failed.
    unsafe fn submit(&self, endpoint: EndpointId, ops: &[Op]) -> Result<BatchId>;

    /// As [`Transport::submit`], with the CRC-32C of each write's local range where the
    /// caller knows it (`checksums[i]` for `ops[i]`; shorter slices mean "unknown" for the
    /// rest): a sealed block's. A backend that checksums chunks may send it instead of
    /// computing one for a write that travels as one chunk, which saves the sender a pass and
    /// makes the receiver's check end to end (it then compares the bytes that arrived with the
    /// checksum the block was sealed with). The default ignores them.
    ///
    /// # Safety
    /// As [`Transport::submit`]; and each given checksum must be what the caller believes the
    /// range holds (a wrong one fails the op with `Corrupt`, which is its purpose).
    ///
    /// # Errors
    /// As [`Transport::submit`].
    unsafe fn submit_with_checksums(
        &self,
        endpoint: EndpointId,
        ops: &[Op],
        checksums: &[Option<u32>],
    ) -> Result<BatchId> {
        let _ = checksums;
        // SAFETY: the caller's contract, passed on.
        unsafe { self.submit(endpoint, ops) }
    }

    /// The batch's status, and each op's into `ops` (as many as fit).
    ///
    /// # Errors
    /// [`crate::Error::NotFound`].
    fn poll(&self, batch: BatchId, ops: &mut [OpStatus]) -> Result<BatchStatus>;

    /// Each done op's CRC-32C, as known from the chunks this side verified on arrival (reads
    /// with checksums on), into `ops`; `None` where it is not known. Lets a reader check a
    /// block's recorded checksum without another pass over its bytes. The default knows none.
    ///
    /// # Errors
    /// [`crate::Error::NotFound`].
    fn checksums(&self, batch: BatchId, ops: &mut [Option<u32>]) -> Result<()> {
        self.poll(batch, &mut [])?;
        ops.fill(None);
        Ok(())
    }

    /// Wait until the batch is settled or `timeout` passes; its status then.
    ///
    /// # Errors
    /// [`crate::Error::NotFound`].
    fn wait(&self, batch: BatchId, timeout: Duration) -> Result<BatchStatus>;

    /// Cancel what of the batch has not started; what is on the wire finishes or fails.
    ///
    /// # Errors
    /// [`crate::Error::NotFound`].
    fn cancel(&self, batch: BatchId) -> Result<()>;

    /// Forget a settled batch (its statuses go; its segments' memory is let go).
    ///
    /// # Errors
    /// [`crate::Error::NotFound`]; [`crate::Error::InvalidArgument`] for a batch not settled.
    fn release(&self, batch: BatchId) -> Result<()>;
}
