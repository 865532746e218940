//! The RDMA engine's target side: peers' side connections (queue pairs made for them, key
//! requests answered against the grant table with per-access registrations) and the sweep that
//! deregisters the regions of grants that ended without a revoke.

use std::collections::HashMap;

use crate::channel::Channel;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::verbs::{self, MrAccess, QpState, Verbs};
use super::wire::{Key, KeyRequest, Message};
use super::{REFUSED_NO_KEYS, Shared, bump, lock};
use crate::error::Result;
use crate::grant::{Access, TransferId};
use crate::link::wire::Bind;

/// A remote-accessible region given out for one access.
#[derive(Debug)]
pub(super) struct RemoteRegion<M> {
    access: Access,
    addr: u64,
    rkey: u32,
    _mr: M,
}

#[derive(Debug)]
pub(super) struct RemoteRegions<M> {
    pub(super) by_transfer: HashMap<TransferId, Vec<RemoteRegion<M>>>,
    pub(super) live: usize,
}

impl<M> RemoteRegions<M> {
    pub(super) fn take(&mut self, transfer: TransferId) -> Vec<RemoteRegion<M>> {
        let v = self.by_transfer.remove(&transfer).unwrap_or_default();
        self.live -= v.len();
        v
    }
}

fn wait_readable(s: &impl std::os::fd::AsFd, timeout: Duration) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    let t = Timespec {
        tv_sec: timeout.as_secs() as i64,
        tv_nsec: i64::from(timeout.subsec_nanos()),
    };
    let mut fds = [PollFd::new(s, PollFlags::IN)];
    poll(&mut fds, Some(&t)).unwrap_or(0) > 0
}

impl<V: Verbs> Shared<V> {
    /// The target's side: answer one peer's side connection until it closes.
    pub(super) fn serve_side(&self, mut s: Channel, peer: Bind) {
        let mut qp: Option<V::Qp> = None;
        while !self.stop.load(Ordering::Acquire) {
            if !wait_readable(s.stream(), Duration::from_millis(100)) {
                continue;
            }
            let _ = s.stream().set_read_timeout(Some(self.config.side_timeout));
            let reply = match Message::recv(&mut s) {
                Ok(Message::Connect(theirs)) => match self.accept_qp(&theirs) {
                    Ok((q, mine)) => {
                        // a rebuilt endpoint replaces the queue pair it had
                        qp = Some(q);
                        Message::Connected(mine)
                    }
                    Err(e) => Message::Refused(e.to_string()),
                },
                Ok(Message::Resolve(rs)) => Message::Keys(
                    rs.iter()
                        .map(|r| self.resolve(r, peer.peer_node()))
                        .collect(),
                ),
                Ok(m) => {
                    tracing::debug!(node = peer.node_id, "RDMA side channel: unexpected {m:?}");
                    break;
                }
                Err(_) => break,
            };
            if reply.send(&mut s).is_err() {
                break;
            }
        }
        drop(qp);
    }

    pub(super) fn accept_qp(&self, theirs: &verbs::QpInfo) -> Result<(V::Qp, verbs::QpInfo)> {
        let v = &self.verbs;
        // the responder posts nothing: a send queue of one
        let mut qp = v.create_qp(&self.cq, 1)?;
        v.modify_qp(&mut qp, QpState::Init, None)?;
        v.modify_qp(&mut qp, QpState::ReadyToReceive, Some(theirs))?;
        v.modify_qp(&mut qp, QpState::ReadyToSend, Some(theirs))?;
        let mine = v.qp_info(&qp);
        Ok((qp, mine))
    }

    /// One key request: checked against a live grant (counted as the TCP target counts its
    /// refusals), then the exact range registered with only the right asked for.
    pub(super) fn resolve(&self, r: &KeyRequest, peer: crate::grant::PeerNode) -> Key {
        let refused = |code: u8| {
            bump(&self.counters.keys_refused, 1);
            Key {
                code,
                addr: 0,
                rkey: 0,
            }
        };
        let access = Access {
            segment: r.segment,
            offset: r.offset,
            len: r.len,
            direction: r.direction,
            transfer: r.transfer,
            epoch: r.epoch,
            peer,
        };
        let w = match self.target.begin(&access, r.node_generation) {
            Ok(w) => w,
            Err(code) => return refused(code),
        };
        let key =
            {
                let mut regions = lock(&self.remote);
                let known = regions
                    .by_transfer
                    .get(&r.transfer)
                    .and_then(|v| v.iter().find(|x| x.access == access))
                    .map(|x| (x.addr, x.rkey));
                match known {
                    Some((addr, rkey)) => Some(Key {
                        code: 0,
                        addr,
                        rkey,
                    }),
                    None if regions.live >= self.config.max_remote_regions => None,
                    None => {
                        let right = match r.direction {
                            crate::grant::Direction::RemoteRead => MrAccess::RemoteRead,
                            crate::grant::Direction::RemoteWrite => MrAccess::RemoteWrite,
                        };
                        // SAFETY: the window lies inside a live grant of a registered segment,
                        // whose memory the target keeps mapped; the grant's owner promised (by
                        // Transport::grant's contract) that a peer may touch the range until the
                        // transfer is revoked, and revoke deregisters this region before it
                        // returns.
                        match unsafe { self.verbs.reg_mr(w.ptr, w.len, right) } {
                            Ok(mr) => {
                                let rkey = self.verbs.keys(&mr).rkey;
                                let addr = w.ptr as u64;
                                regions.live += 1;
                                regions.by_transfer.entry(r.transfer).or_default().push(
                                    RemoteRegion {
                                        access,
                                        addr,
                                        rkey,
                                        _mr: mr,
                                    },
                                );
                                Some(Key {
                                    code: 0,
                                    addr,
                                    rkey,
                                })
                            }
                            Err(e) => {
                                tracing::warn!(error = %e, "could not register a granted range");
                                None
                            }
                        }
                    }
                }
            };
        self.target.end(w);
        match key {
            Some(k) => {
                bump(&self.counters.keys_granted, 1);
                k
            }
            None => refused(REFUSED_NO_KEYS),
        }
    }

    /// Regions of transfers whose grants expired (or were revoked through another engine)
    /// are deregistered.
    pub(super) fn sweep_regions(&self) {
        self.target.expire(64);
        let dead: Vec<TransferId> = lock(&self.remote)
            .by_transfer
            .keys()
            .copied()
            .filter(|t| self.target.grants_of(*t) == 0)
            .collect();
        for t in dead {
            let regions = lock(&self.remote).take(t);
            drop(regions);
        }
    }
}
