//! Blocks between daemons: the calls that ask this node's daemon to push blocks to a peer,
//! fetch them from one, stream a checkpoint step to its holder and read a checkpoint prefix
//! back, and the states of those transfers. Each returns at once with a transfer id; the
//! daemon's data port does the moving (see `docs/DAEMON.md`).

use kvd_core::Result;
use kvd_core::keys::BlockKey;
use kvd_core::protocol::{Op, Reply, TransferInfo};
use kvd_core::types::{HoldInfo, RequestId};

use crate::{Client, unexpected};

impl Client {
    /// Ask the daemon to push PUBLISHED blocks (of one namespace) to peer node `peer` over its
    /// data port; returns at once with the transfer's id (poll it with
    /// [`Client::transfers`]). The blocks stay pinned on this node until the push ends; the
    /// peer publishes them as one group only when every byte arrived intact.
    ///
    /// # Errors
    /// `Unavailable` without a data port; `Overloaded` (retryable, with a hint) past the
    /// daemon's bound on pushes in flight; `InvalidArgument` for an empty or oversized batch.
    pub fn push(&mut self, peer: u64, keys: &[BlockKey]) -> Result<u64> {
        self.check_batch(keys.len())?;
        self.transfer(Op::Push {
            peer,
            keys: keys.to_vec(),
        })
    }

    /// Ask the daemon to fetch PUBLISHED blocks (of one namespace) from peer node `peer` over
    /// its data port; returns at once with the transfer's id (poll it with
    /// [`Client::transfers`]). The blocks are published here as one group only when every
    /// byte arrived intact; keys the peer lacks are skipped (the transfer's `blocks` says how
    /// many arrived).
    ///
    /// With `peer` [`kvd_core::protocol::ANY_NODE`], a cluster fetch: the daemon asks its live
    /// peers which of `keys` they hold and fetches the longest run from the first key that
    /// they hold between them, each piece from its holder.
    ///
    /// # Errors
    /// As [`Client::push`].
    pub fn fetch(&mut self, peer: u64, keys: &[BlockKey]) -> Result<u64> {
        self.check_batch(keys.len())?;
        self.transfer(Op::Fetch {
            peer,
            keys: keys.to_vec(),
        })
    }

    /// Stream one checkpoint step of `request` (its PUBLISHED checkpoint blocks `keys`, at
    /// `epoch`) to its holder `peer`, which extends its manifest with them and
    /// `committed_tokens` atomically; returns at once with the transfer's id.
    ///
    /// # Errors
    /// As [`Client::push`].
    pub fn push_checkpoint(
        &mut self,
        peer: u64,
        request: RequestId,
        epoch: u64,
        keys: &[BlockKey],
        committed_tokens: u64,
        ttl_ms: u64,
    ) -> Result<u64> {
        self.check_batch(keys.len())?;
        self.transfer(Op::PushCheckpoint {
            peer,
            request,
            epoch,
            keys: keys.to_vec(),
            committed_tokens,
            ttl_ms,
        })
    }

    /// The recovery read: fetch from holder `peer` the longest verified prefix of `request`'s
    /// checkpoint that `tokens` continues; the blocks land here as PUBLISHED cache blocks (the
    /// transfer's `tokens` says how many tokens they cover). Returns at once with the
    /// transfer's id.
    ///
    /// # Errors
    /// As [`Client::push`].
    pub fn fetch_prefix(&mut self, peer: u64, request: RequestId, tokens: &[u32]) -> Result<u64> {
        self.transfer(Op::FetchPrefix {
            peer,
            request,
            tokens: tokens.to_vec(),
        })
    }

    /// A decode's hand-off read: fetch `keys` from peer `peer`'s hold of `request` at
    /// `epoch` (the peer refuses unless that hold lives at exactly that epoch and holds every
    /// key: a late read of an older attempt is refused, never served). With `end_hold`, the
    /// peer's hold ends once every block is published here. Returns at once with the
    /// transfer's id, as [`Client::fetch`].
    ///
    /// # Errors
    /// As [`Client::push`].
    pub fn fetch_held(
        &mut self,
        peer: u64,
        request: RequestId,
        epoch: u64,
        keys: &[BlockKey],
        end_hold: bool,
    ) -> Result<u64> {
        self.check_batch(keys.len())?;
        self.transfer(Op::FetchHeld {
            peer,
            request,
            epoch,
            keys: keys.to_vec(),
            end_hold,
        })
    }

    /// A prefill hands its prompt's run off: the daemon holds the leading PUBLISHED run of
    /// `keys` for `request` at `epoch` (beyond this session's life) until it is ended, taken
    /// by the decode that fetched it, or `ttl_ms` passes. The same epoch again renews it; a
    /// newer one supersedes it.
    ///
    /// # Errors
    /// `StaleEpoch` for an older or ended epoch; `NotFound` when the first key is not
    /// published; `InvalidArgument` for bad arguments; `Overloaded` at the bound on holds;
    /// `Draining`.
    pub fn hold_begin(
        &mut self,
        request: RequestId,
        epoch: u64,
        keys: &[BlockKey],
        ttl_ms: u64,
    ) -> Result<HoldInfo> {
        self.check_batch(keys.len())?;
        match self.call(Op::HoldBegin {
            request,
            epoch,
            keys: keys.to_vec(),
            ttl_ms,
        })? {
            Reply::Hold(h) => Ok(h),
            r => Err(unexpected(&r)),
        }
    }

    /// End `request`'s hand-off hold here if its epoch is at most `epoch`; whether one ended.
    pub fn hold_end(&mut self, request: RequestId, epoch: u64) -> Result<bool> {
        match self.call(Op::HoldEnd { request, epoch })? {
            Reply::Ended(e) => Ok(e),
            r => Err(unexpected(&r)),
        }
    }

    /// The states of transfers this daemon started (any session's); unknown or forgotten ids
    /// are left out.
    pub fn transfers(&mut self, ids: &[u64]) -> Result<Vec<TransferInfo>> {
        self.check_batch(ids.len())?;
        match self.call(Op::Transfers { ids: ids.to_vec() })? {
            Reply::Transfers(v) => Ok(v),
            r => Err(unexpected(&r)),
        }
    }

    /// Send a call that starts a transfer; its answer is the transfer's id.
    fn transfer(&mut self, op: Op) -> Result<u64> {
        match self.call(op)? {
            Reply::Transfer(id) => Ok(id),
            r => Err(unexpected(&r)),
        }
    }
}
