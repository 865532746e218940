//! Reservations and checkpoint manifests: the calls with which an engine reserves space for
//! a request's checkpoint, publishes its steps atomically with the committed token count,
//! keeps it alive and ends it, and finds the verified prefix a recovery can restore.

use kvd_core::Result;
use kvd_core::keys::NamespaceId;
use kvd_core::protocol::{Op, Reply};
use kvd_core::types::{Handle, ManifestInfo, RequestId, ReservationId, RestorePrefix};

use crate::{Client, unexpected};

impl Client {
    /// Reserve `bytes` for this session's future allocations (fails fast with the retryable
    /// `NoSpace` when they do not fit).
    pub fn reserve(&mut self, bytes: u64) -> Result<ReservationId> {
        match self.call(Op::Reserve { bytes })? {
            Reply::Reservation(r) => Ok(r),
            r => Err(unexpected(&r)),
        }
    }

    /// Give a reservation's unused space back.
    pub fn release_reservation(&mut self, reservation: ReservationId) -> Result<()> {
        match self.call(Op::ReleaseReservation { reservation })? {
            Reply::Done => Ok(()),
            r => Err(unexpected(&r)),
        }
    }

    /// Begin (or supersede with a newer epoch) a request's checkpoint manifest; allocate its
    /// blocks with `BlockClass::Checkpoint { request, epoch }`.
    pub fn manifest_begin(
        &mut self,
        request: RequestId,
        epoch: u64,
        namespace: &NamespaceId,
        reserve_bytes: u64,
        ttl_ms: u64,
    ) -> Result<ManifestInfo> {
        match self.call(Op::ManifestBegin {
            request,
            epoch,
            namespace: *namespace,
            reserve_bytes,
            ttl_ms,
        })? {
            Reply::Manifest(m) => Ok(m),
            r => Err(unexpected(&r)),
        }
    }

    /// Publish SEALED checkpoint blocks into the manifest with the new committed token count,
    /// atomically.
    pub fn manifest_extend(
        &mut self,
        request: RequestId,
        epoch: u64,
        handles: &[Handle],
        committed_tokens: u64,
    ) -> Result<ManifestInfo> {
        self.check_batch(handles.len())?;
        match self.call(Op::ManifestExtend {
            request,
            epoch,
            handles: handles.to_vec(),
            committed_tokens,
        })? {
            Reply::Manifest(m) => Ok(m),
            r => Err(unexpected(&r)),
        }
    }

    /// Renew a manifest's TTL; returns the milliseconds until it expires.
    pub fn manifest_renew(&mut self, request: RequestId, epoch: u64, ttl_ms: u64) -> Result<u64> {
        match self.call(Op::ManifestRenew {
            request,
            epoch,
            ttl_ms,
        })? {
            Reply::Lease { expires_in_ms } => Ok(expires_in_ms),
            r => Err(unexpected(&r)),
        }
    }

    /// The request ended or was cancelled: release its checkpoint and reservation.
    pub fn manifest_end(&mut self, request: RequestId, epoch: u64) -> Result<()> {
        match self.call(Op::ManifestEnd { request, epoch })? {
            Reply::Done => Ok(()),
            r => Err(unexpected(&r)),
        }
    }

    /// A request's manifest as published.
    pub fn manifest(&mut self, request: RequestId) -> Result<ManifestInfo> {
        match self.call(Op::ManifestGet { request })? {
            Reply::Manifest(m) => Ok(m),
            r => Err(unexpected(&r)),
        }
    }

    /// The longest verified checkpoint prefix of `tokens` held here for `request` (the blocks
    /// are not pinned: acquire their keys to read them).
    pub fn restore_prefix(&mut self, request: RequestId, tokens: &[u32]) -> Result<RestorePrefix> {
        match self.call(Op::RestorePrefix {
            request,
            tokens: tokens.to_vec(),
        })? {
            Reply::Restore(r) => Ok(r),
            r => Err(unexpected(&r)),
        }
    }
}
