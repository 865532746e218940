//! Blocks between daemons: the calls that ask this node's daemon to push blocks to a peer,
//! fetch them from one, stream a checkpoint step to its holder and read a checkpoint prefix
//! back, and the states of those transfers. Each returns at once with a transfer id; the
//! daemon's data port does the moving (see `docs/DAEMON.md`).

use kvd_core::Result;
use kvd_core::keys::BlockKey;
use kvd_core::protocol::{Op, Reply, TransferInfo};
use kvd_core::types::RequestId;

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
