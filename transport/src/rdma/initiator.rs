//! The RDMA engine's initiator side: connecting queue pairs over the side channel, asking for
//! keys, the send queue's doorbells, completions, endpoint failure and rebuild, and the
//! progress thread that drives them.

use crate::channel::Channel;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::qp::SendQueue;
use super::verbs::{Completion, QpState, Verbs, WcStatus};
use super::wire::{self, Key, KeyRequest, Message};
use super::{Endpoint, EndpointIo, NO_RDMA, REFUSED_REVOKED, Regions, Shared, bump, lock};
use crate::engine::batches::ChunkOutcome;
use crate::engine::target::remote_direction;
use crate::engine::{BatchId, EndpointId, Op, OpFailure};
use crate::error::{Error, Result};

impl<V: Verbs> Shared<V> {
    pub(super) fn endpoint(&self, ep: EndpointId) -> Result<Arc<Endpoint<V>>> {
        lock(&self.endpoints)
            .get(&ep)
            .filter(|e| !lock(&e.io).closed)
            .cloned()
            .ok_or_else(|| Error::NotFound(format!("endpoint {}", ep.0)))
    }

    /// A queue pair connected to the peer at the other end of `side`.
    pub(super) fn connect_qp(&self, side: &mut Channel) -> Result<V::Qp> {
        let v = &self.verbs;
        let mut qp = v.create_qp(&self.cq, self.config.send_depth)?;
        v.modify_qp(&mut qp, QpState::Init, None)?;
        side.stream()
            .set_read_timeout(Some(self.config.side_timeout))
            .map_err(|e| Error::PeerUnavailable(e.to_string()))?;
        // the connection was taken and closed unanswered (our frame may meet the close on
        // the way out or the answer's place): nobody serves RDMA there
        let no_rdma = |e| match e {
            Error::PeerUnavailable(m) if m.contains("without RDMA") => {
                Error::PeerUnavailable(format!("{NO_RDMA} ({m})"))
            }
            e => e,
        };
        Message::Connect(v.qp_info(&qp))
            .send(side)
            .map_err(no_rdma)?;
        let answer = Message::recv(side).map_err(no_rdma)?;
        let theirs = match answer {
            Message::Connected(q) => q,
            Message::Refused(why) => {
                return Err(Error::PeerUnavailable(format!(
                    "the peer refused an RDMA queue pair: {why}"
                )));
            }
            m => {
                return Err(Error::PeerUnavailable(format!(
                    "RDMA side channel: {m:?} where Connected was due"
                )));
            }
        };
        v.modify_qp(&mut qp, QpState::ReadyToReceive, Some(&theirs))?;
        v.modify_qp(&mut qp, QpState::ReadyToSend, Some(&theirs))?;
        Ok(qp)
    }

    /// Local regions for `len` bytes, in chunks of at most the configured size (and the
    /// device's largest region), each made by `reg(offset, bytes)`; all or nothing. The chunk
    /// size with them.
    pub(super) fn register_chunks(
        &self,
        len: u64,
        mut reg: impl FnMut(u64, usize) -> Result<V::Mr>,
    ) -> Result<(u64, Regions<V::Mr>)> {
        let chunk = self
            .config
            .mr_chunk_bytes
            .min(self.verbs.device().max_mr_bytes)
            .max(1 << 20);
        let mut regions = Vec::new();
        let mut at = 0u64;
        while at < len {
            let n = chunk.min(len - at);
            // what was registered goes with `regions` when this fails
            let mr = reg(at, n as usize)?;
            let lkey = self.verbs.keys(&mr).lkey;
            regions.push((Arc::new(mr), lkey));
            at += n;
        }
        Ok((chunk, regions))
    }

    /// Keys for every op of a batch, over the endpoint's side channel.
    pub(super) fn resolve_remote(&self, e: &Endpoint<V>, ops: &[Op]) -> Result<Vec<Key>> {
        let mut side = lock(&e.side);
        let _ = side
            .stream()
            .set_read_timeout(Some(self.config.side_timeout));
        let mut keys = Vec::with_capacity(ops.len());
        for part in ops.chunks(wire::MAX_RESOLVE) {
            let rs = part
                .iter()
                .map(|op| KeyRequest {
                    transfer: op.transfer,
                    epoch: op.epoch,
                    node_generation: op.remote.node_generation,
                    segment: op.remote.segment,
                    offset: op.remote_offset,
                    len: op.len,
                    direction: remote_direction(op.kind),
                })
                .collect();
            Message::Resolve(rs).send(&mut side)?;
            match Message::recv(&mut side)? {
                Message::Keys(ks) if ks.len() == part.len() => keys.extend(ks),
                m => {
                    return Err(Error::PeerUnavailable(format!(
                        "RDMA side channel: {m:?} where {} keys were due",
                        part.len()
                    )));
                }
            }
        }
        Ok(keys)
    }

    /// Make a failed endpoint usable again with a new queue pair, if its old one has no work
    /// left and rebuilds remain.
    pub(super) fn ensure_ready(&self, e: &Endpoint<V>, ep: EndpointId) -> Result<()> {
        {
            let io = lock(&e.io);
            let Some((why, _)) = &io.failed else {
                return Ok(());
            };
            if io.sq.posted() > 0 {
                return Err(Error::PeerUnavailable(format!(
                    "endpoint {} failed ({why}); its work requests are still flushing: retry shortly",
                    ep.0
                )));
            }
            if io.rebuilds >= self.config.rebuilds {
                return Err(Error::PeerUnavailable(format!(
                    "endpoint {} failed ({why}) and was rebuilt {} times; open a new one",
                    ep.0, io.rebuilds
                )));
            }
        }
        let qp = self.connect_qp(&mut lock(&e.side))?;
        let mut io = lock(&e.io);
        io.qp = Some(qp);
        io.failed = None;
        io.failed_at = None;
        io.rebuilds += 1;
        bump(&self.counters.rebuilds, 1);
        tracing::info!(
            endpoint = ep.0,
            "RDMA endpoint rebuilt with a new queue pair"
        );
        Ok(())
    }

    /// Chunks ended: account them, wake waiters if a batch settled.
    pub(super) fn finish(
        &self,
        ended: impl IntoIterator<Item = (BatchId, u32, u64, ChunkOutcome)>,
    ) {
        let mut settled = false;
        {
            let mut b = lock(&self.batches);
            for (batch, op, bytes, outcome) in ended {
                settled |= b.chunk_finished(batch, op, bytes, outcome);
            }
        }
        if settled {
            self.settled.notify_all();
        }
    }

    /// Fail an endpoint: its queue pair to the error state (posted work then completes
    /// flushed), its waiting work failed at once.
    pub(super) fn fail_endpoint(&self, io: &mut EndpointIo<V>, why: String, failure: OpFailure) {
        if io.failed.is_none() {
            bump(&self.counters.endpoints_failed, 1);
            tracing::warn!(reason = %why, "RDMA endpoint failed");
            io.failed = Some((why, failure));
            io.failed_at = Some(Instant::now());
            if let Some(qp) = io.qp.as_mut() {
                let _ = self.verbs.modify_qp(qp, QpState::Error, None);
            }
        }
        let waiting = io.sq.drain_waiting();
        self.finish(
            waiting
                .into_iter()
                .map(|s| (s.batch, s.op, 0, ChunkOutcome::Failed(failure))),
        );
    }

    /// Post what fits, a doorbell at a time.
    pub(super) fn pump(&self, io: &mut EndpointIo<V>) {
        while io.failed.is_none() {
            let wrs = io.sq.doorbell(self.config.doorbell_batch);
            if wrs.is_empty() {
                return;
            }
            let Some(qp) = io.qp.as_mut() else { return };
            // SAFETY: every local range was checked to lie in a live local region of ours
            // (whose Arc the slot holds until the completion), and the posting contract of
            // Transport::submit keeps the caller off it until the batch settles.
            match unsafe { self.verbs.post(qp, &wrs) } {
                Ok(()) => {
                    bump(&self.counters.doorbells, 1);
                    bump(&self.counters.work_requests, wrs.len() as u64);
                }
                Err(e) => {
                    let slots = io.sq.unpost(&wrs);
                    self.finish(
                        slots
                            .into_iter()
                            .map(|s| (s.batch, s.op, 0, ChunkOutcome::Failed(OpFailure::Protocol))),
                    );
                    self.fail_endpoint(io, format!("ibv_post_send: {e}"), OpFailure::Protocol);
                }
            }
        }
    }

    pub(super) fn on_completion(&self, c: Completion) {
        let prefix = SendQueue::<V::Mr>::prefix_of(c.wr_id);
        let Some(e) = lock(&self.endpoints)
            .get(&EndpointId(u64::from(prefix)))
            .cloned()
        else {
            return;
        };
        let mut io = lock(&e.io);
        let Some(slot) = io.sq.complete(c.wr_id) else {
            return;
        };
        let failure = match c.status {
            WcStatus::Success => None,
            WcStatus::Flushed => Some(
                io.failed
                    .as_ref()
                    .map(|f| f.1)
                    .unwrap_or(OpFailure::PeerClosed),
            ),
            WcStatus::RemoteAccess => Some(OpFailure::Refused(REFUSED_REVOKED)),
            WcStatus::RetryExceeded => Some(OpFailure::Timeout),
            WcStatus::LocalProtection => Some(OpFailure::Protocol),
            WcStatus::Other(_) => Some(OpFailure::PeerClosed),
        };
        match failure {
            None => {
                bump(&self.counters.completions_ok, 1);
                bump(&self.counters.bytes_done, u64::from(slot.bytes));
                self.finish([(
                    slot.batch,
                    slot.op,
                    u64::from(slot.bytes),
                    ChunkOutcome::Delivered,
                )]);
                self.pump(&mut io);
            }
            Some(f) => {
                bump(&self.counters.completions_failed, 1);
                self.finish([(slot.batch, slot.op, 0, ChunkOutcome::Failed(f))]);
                if c.status != WcStatus::Flushed {
                    self.fail_endpoint(
                        &mut io,
                        format!("a work request completed with {:?}", c.status),
                        f,
                    );
                }
            }
        }
    }

    /// Endpoints with work posted and no completion for the stall timeout fail; ones whose
    /// flushes do not come destroy their queue pair; closed ones with nothing left go.
    pub(super) fn check_endpoints(&self) {
        let stall = self.config.stall_timeout;
        let eps: Vec<(EndpointId, Arc<Endpoint<V>>)> = lock(&self.endpoints)
            .iter()
            .map(|(k, v)| (*k, Arc::clone(v)))
            .collect();
        let mut gone = Vec::new();
        for (id, e) in eps {
            let mut io = lock(&e.io);
            if io.sq.posted() > 0 && io.sq.last_progress.elapsed() > stall {
                if io.failed.is_none() {
                    self.fail_endpoint(
                        &mut io,
                        format!("no completion for {} ms", stall.as_millis()),
                        OpFailure::Timeout,
                    );
                } else if io.failed_at.is_some_and(|t| t.elapsed() > stall) {
                    // the flushes did not come: destroying the queue pair ends the NIC's
                    // hold on the memory
                    io.qp = None;
                    let f = io.failed.as_ref().map_or(OpFailure::Timeout, |f| f.1);
                    let posted = io.sq.drain_posted();
                    self.finish(
                        posted
                            .into_iter()
                            .map(|s| (s.batch, s.op, 0, ChunkOutcome::Failed(f))),
                    );
                }
            } else if io.failed.is_none() && io.sq.waiting() > 0 {
                self.pump(&mut io);
            }
            if io.closed && io.sq.posted() == 0 {
                gone.push(id);
            }
        }
        if !gone.is_empty() {
            let mut eps = lock(&self.endpoints);
            for id in gone {
                eps.remove(&id);
            }
        }
    }

    pub(super) fn progress_loop(&self) {
        let mut comps = Vec::with_capacity(64);
        let mut last_check = Instant::now();
        let mut idle = 0u32;
        while !self.stop.load(Ordering::Acquire) {
            comps.clear();
            match self.verbs.poll(&self.cq, 64, &mut comps) {
                Ok(_) => {}
                Err(e) => tracing::error!(error = %e, "ibv_poll_cq failed"),
            }
            for c in comps.drain(..) {
                self.on_completion(c);
                idle = 0;
            }
            if last_check.elapsed() >= Duration::from_millis(10) {
                self.check_endpoints();
                self.sweep_regions();
                last_check = Instant::now();
            }
            // busy-poll while work is out, then back off (bounded at 2 ms)
            idle = idle.saturating_add(1);
            let busy = lock(&self.batches).in_flight().0 > 0;
            let nap = if busy && idle < 64 {
                Duration::from_micros(20)
            } else if busy {
                Duration::from_micros(200)
            } else {
                Duration::from_millis(2)
            };
            std::thread::sleep(nap);
        }
    }
}
