//! Cluster fetches ([`super::Kind::FetchCluster`]): a lookup's miss asked of the peers. Locate (which
//! of the keys each live peer holds), plan the pieces ([`plan_pieces`]), fetch each piece from
//! its holder with the ordinary fetch, keeping the verified prefix of a piece that fails.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use transport::link::PeerAddr;
use transport::registry::Backends;

use super::{Moved, Outgoing, Wanted, peer_gone, refusal};
use crate::keys::BlockKey;
use crate::protocol::WireError;
use crate::transfer::wire::{PeerReply, PeerRequest, ask};
use crate::{Error, Result};

/// Peers a cluster fetch asks at most (the first ones of the peer table not suppressed): a
/// locate costs one round trip to each, in parallel.
pub const MAX_LOCATE_PEERS: usize = 16;

/// How long a peer may take to answer a locate before it counts as holding nothing.
pub const LOCATE_TIMEOUT: Duration = Duration::from_millis(500);

/// The pieces of a cluster fetch: from key 0, the longest run any peer holds, then from its
/// end the longest run any peer holds, and so on until no peer holds the next key. `have` is
/// each peer's bitmap over the `n` keys ([`crate::protocol::pack_bits`]). Ties go to the lower
/// node id.
pub fn plan_pieces(n: usize, have: &[(u64, Vec<u8>)]) -> Vec<(u64, std::ops::Range<usize>)> {
    let run = |bits: &[u8], from: usize| {
        (from..n)
            .take_while(|&i| crate::protocol::bit(bits, i))
            .count()
    };
    let mut pieces = Vec::new();
    let mut pos = 0;
    while pos < n {
        let best = have
            .iter()
            .map(|(node, bits)| (run(bits, pos), std::cmp::Reverse(*node)))
            .filter(|(r, _)| *r > 0)
            .max();
        let Some((r, std::cmp::Reverse(node))) = best else {
            break;
        };
        pieces.push((node, pos..pos + r));
        pos += r;
    }
    pieces
}

impl Outgoing {
    /// Which of `keys` `peer` holds (a bitmap), asked within [`LOCATE_TIMEOUT`].
    fn have(
        &self,
        backends: &Backends,
        peer: u64,
        addr: SocketAddr,
        keys: &[BlockKey],
    ) -> Result<Vec<u8>> {
        let tcp_peer = PeerAddr {
            addr,
            node_id: peer,
        };
        let request = PeerRequest::Have {
            keys: keys.to_vec(),
        };
        let idle = self
            .idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(&peer)
            .and_then(Vec::pop);
        let started = Instant::now();
        let (s, bind, answer) = match idle {
            Some((mut s, bind)) => {
                let _ = s.stream().set_read_timeout(Some(LOCATE_TIMEOUT));
                match ask(&mut s, &request) {
                    Ok(answer) => (s, bind, answer),
                    // a connection that failed at once was stale (the peer restarted): a fresh
                    // one; one that timed out met a hung peer: not waited for twice
                    Err(_) if started.elapsed() < LOCATE_TIMEOUT / 2 => {
                        self.first_ask_within(backends, &tcp_peer, LOCATE_TIMEOUT, |_| {
                            request.clone()
                        })?
                    }
                    Err(e) => return Err(e),
                }
            }
            None => {
                self.first_ask_within(backends, &tcp_peer, LOCATE_TIMEOUT, |_| request.clone())?
            }
        };
        match answer {
            PeerReply::Have(bits) => {
                self.park(peer, s, bind);
                Ok(bits)
            }
            r => Err(refusal(r)),
        }
    }

    /// Which of `keys` each live peer holds (its bitmap), asked of all in parallel; a peer
    /// that does not answer within [`LOCATE_TIMEOUT`] is left out, counted and avoided.
    fn locate(&self, backends: &Backends, id: u64, keys: &[BlockKey]) -> Vec<(u64, Vec<u8>)> {
        let c = &self.counters;
        let now = Instant::now();
        let peers: Vec<(u64, SocketAddr)> = {
            let suppressed = self.table().suppressed.clone();
            self.peers()
                .into_iter()
                .filter(|(n, _)| *n != self.node_id)
                .filter(|(n, _)| suppressed.get(n).is_none_or(|until| *until <= now))
                .take(MAX_LOCATE_PEERS)
                .collect()
        };
        std::thread::scope(|scope| {
            let asks: Vec<_> = peers
                .iter()
                .map(|&(node, addr)| {
                    (
                        node,
                        scope.spawn(move || self.have(backends, node, addr, keys)),
                    )
                })
                .collect();
            asks.into_iter()
                .filter_map(|(node, h)| match h.join() {
                    Ok(Ok(bits)) => Some((node, bits)),
                    Ok(Err(e)) => {
                        c.cluster_locate_unanswered.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(transfer = id, peer = node, error = %e,
                            "a peer did not answer a locate: avoided for a while");
                        // a hung or gone peer would cost every lookup its timeout until its
                        // lease runs out: the next locates skip it meanwhile
                        self.avoid(node);
                        None
                    }
                    Err(_) => None,
                })
                .collect()
        })
    }

    /// A cluster fetch ([`super::Kind::FetchCluster`]): locate, then fetch piece by piece.
    pub(super) fn fetch_cluster(
        &self,
        backends: &Backends,
        id: u64,
        keys: &[BlockKey],
    ) -> Result<Moved> {
        let Some(first) = keys.first() else {
            return Err(Error::InvalidArgument("a fetch of no blocks".into()));
        };
        if keys.iter().any(|k| k.namespace != first.namespace) {
            return Err(Error::InvalidArgument(
                "a fetch holds blocks of one namespace".into(),
            ));
        }
        let c = &self.counters;
        c.cluster_fetches.fetch_add(1, Ordering::Relaxed);
        let have = self.locate(backends, id, keys);
        let pieces = plan_pieces(keys.len(), &have);
        let located: usize = pieces.iter().map(|(_, r)| r.len()).sum();
        c.cluster_located_blocks
            .fetch_add(located as u64, Ordering::Relaxed);
        let (mut blocks, mut bytes, mut covered) = (0u32, 0u64, 0usize);
        let mut source = None;
        for (node, range) in pieces {
            let want = range.len();
            match self.fetch(backends, node, &keys[range.clone()], Wanted::Keys(None)) {
                Ok((b, n, _)) => {
                    blocks += b;
                    bytes += n;
                    source.get_or_insert(node);
                }
                Err(e) => {
                    // a block that failed its checksum fails its piece's whole group; a gone
                    // holder fails it too. Keep the verified prefix: the piece again, one block
                    // at a time, up to the first that fails (bounded by the piece's length; a
                    // gone holder fails the first at once)
                    tracing::warn!(transfer = id, peer = node, error = %e,
                        "a cluster fetch's piece failed: its verified prefix only");
                    self.counters.failed(&WireError::from(e));
                    for k in &keys[range.clone()] {
                        let one = std::slice::from_ref(k);
                        match self.fetch(backends, node, one, Wanted::Keys(None)) {
                            Ok((b, n, _)) => {
                                blocks += b;
                                bytes += n;
                                source.get_or_insert(node);
                            }
                            Err(e) => {
                                if peer_gone(&e) {
                                    self.avoid(node);
                                }
                                break;
                            }
                        }
                    }
                }
            }
            // what the lookup after this will find: the piece's keys held here now, in order
            // (keys held here before the fetch were skipped by it, and count)
            let here = self
                .store
                .lookup(&keys[range])?
                .iter()
                .take_while(|b| b.is_some())
                .count();
            covered += here;
            if here < want {
                tracing::info!(
                    transfer = id,
                    peer = node,
                    located = want,
                    here,
                    "a cluster fetch's piece came back short (evicted at the holder since the \
                     locate, or the piece failed): the hit ends there"
                );
                break;
            }
        }
        c.cluster_fetched_blocks
            .fetch_add(u64::from(blocks), Ordering::Relaxed);
        c.cluster_shortfall_blocks
            .fetch_add((located - covered) as u64, Ordering::Relaxed);
        if let Some(node) = source
            && let Some(p) = self.table().pushes.get_mut(&id)
        {
            p.peer = node;
        }
        Ok((blocks, bytes, 0))
    }
}

#[cfg(test)]
mod tests {
    use super::plan_pieces;
    use crate::protocol::pack_bits;

    fn bits(s: &str) -> Vec<u8> {
        pack_bits(s.chars().map(|c| c == '1'))
    }

    #[test]
    fn a_cluster_fetch_plans_the_longest_run_each_time_and_stops_at_the_first_key_no_one_holds() {
        // node 1 holds 0-2 and 5, node 2 holds 1-4, node 3 holds 0-1
        let have = [
            (1, bits("111001")),
            (2, bits("011110")),
            (3, bits("110000")),
        ];
        assert_eq!(plan_pieces(6, &have), vec![(1, 0..3), (2, 3..5), (1, 5..6)]);
        // a tie goes to the lower node id
        assert_eq!(
            plan_pieces(2, &[(7, bits("11")), (4, bits("11"))]),
            vec![(4, 0..2)]
        );
        // no one holds the first key: nothing, though later keys are held
        assert_eq!(plan_pieces(3, &[(1, bits("011"))]), vec![]);
        // a gap ends the run
        assert_eq!(plan_pieces(4, &[(1, bits("1101"))]), vec![(1, 0..2)]);
        assert_eq!(plan_pieces(0, &have), vec![]);
        assert_eq!(plan_pieces(3, &[]), vec![]);
    }
}
