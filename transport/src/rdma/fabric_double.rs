//! A test double of the verbs layer: an in-process fabric of "NICs" that executes RDMA
//! WRITE and READ as memcpy between real memory, with the checks a real RC fabric makes
//! (keys, ranges, access rights, queue-pair states, send-queue depth) and the failures it
//! shows (remote access errors that take both queue pairs to the error state, flushed work
//! requests, retry-exceeded for a dead or unreachable peer). Work requests run when the
//! completion queue is polled, so a fault injected between post and poll hits them in
//! flight. Tests only: the real calls go to sideway.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use super::verbs::*;
use crate::error::{Error, Result};

#[derive(Debug)]
struct MrDouble {
    node: u32,
    addr: u64,
    len: u64,
    access: MrAccess,
}

#[derive(Debug)]
struct QpDouble {
    node: u32,
    cq: u64,
    state: QpState,
    depth: usize,
    remote: Option<u32>,
    queue: VecDeque<WorkRequest>,
}

#[derive(Debug, Default)]
struct State {
    next: u32,
    mrs: HashMap<u32, MrDouble>,
    qps: HashMap<u32, QpDouble>,
    cqs: HashMap<u64, VecDeque<Completion>>,
    /// Nodes whose link is cut: their queue pairs' work requests do not run.
    cut: HashSet<u32>,
    /// Registrations that fail from now on (per node).
    refuse_reg: HashSet<u32>,
    /// Work requests executed, and doorbells rung.
    executed: u64,
    doorbells: u64,
    dmabuf_regs: u64,
}

/// The fabric every simulated NIC of a test is on.
#[derive(Debug, Default)]
pub struct Fabric {
    state: Mutex<State>,
}

impl Fabric {
    /// A new fabric.
    pub fn new() -> Arc<Fabric> {
        Arc::new(Fabric::default())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A NIC of node `node` on this fabric.
    pub fn nic(self: &Arc<Fabric>, node: u32) -> VerbsDouble {
        VerbsDouble {
            fabric: Arc::clone(self),
            node,
            info: DeviceInfo {
                name: format!("sim{node}"),
                port: 1,
                lid: node as u16,
                gid: [node as u8; 16],
                mtu: 4096,
                max_mr_bytes: 1 << 40,
                max_qp_wr: 1024,
            },
        }
    }

    /// Cut (or mend) node `node`'s link: its work requests stop running.
    pub fn cut(&self, node: u32, cut: bool) {
        let mut s = self.lock();
        if cut {
            s.cut.insert(node);
        } else {
            s.cut.remove(&node);
        }
    }

    /// Every queue pair of `node` fails (as a NIC reset would).
    pub fn break_qps(&self, node: u32) {
        for q in self.lock().qps.values_mut().filter(|q| q.node == node) {
            q.state = QpState::Error;
        }
    }

    /// Make `node`'s registrations fail (or work again).
    pub fn refuse_registrations(&self, node: u32, refuse: bool) {
        let mut s = self.lock();
        if refuse {
            s.refuse_reg.insert(node);
        } else {
            s.refuse_reg.remove(&node);
        }
    }

    /// Remote-accessible regions of `node` alive now.
    pub fn remote_regions(&self, node: u32) -> usize {
        self.lock()
            .mrs
            .values()
            .filter(|m| m.node == node && m.access != MrAccess::Local)
            .count()
    }

    /// Queue pairs of `node`, by state.
    pub fn qp_states(&self, node: u32) -> Vec<QpState> {
        self.lock()
            .qps
            .values()
            .filter(|q| q.node == node)
            .map(|q| q.state)
            .collect()
    }

    /// dma-buf registrations so far.
    pub fn dmabuf_registrations(&self) -> u64 {
        self.lock().dmabuf_regs
    }

    /// Work requests executed and doorbells rung so far.
    pub fn counts(&self) -> (u64, u64) {
        let s = self.lock();
        (s.executed, s.doorbells)
    }
}

fn covers(m: &MrDouble, addr: u64, len: u32) -> bool {
    addr >= m.addr
        && addr
            .checked_add(u64::from(len))
            .is_some_and(|e| e <= m.addr + m.len)
}

impl State {
    /// Run what `qpn` has queued; completions to its CQ.
    fn run(&mut self, qpn: u32) {
        loop {
            let Some(q) = self.qps.get(&qpn) else { return };
            let (node, cq, state, remote) = (q.node, q.cq, q.state, q.remote);
            // a cut link runs nothing (an error-state queue pair still flushes: that is local)
            let remote_cut = remote
                .and_then(|r| self.qps.get(&r))
                .is_some_and(|r| self.cut.contains(&r.node));
            if state != QpState::Error && (self.cut.contains(&node) || remote_cut) {
                return;
            }
            let Some(wr) = self.qps.get_mut(&qpn).and_then(|q| q.queue.pop_front()) else {
                return;
            };
            let status = if state == QpState::Error {
                WcStatus::Flushed
            } else {
                self.execute(node, remote, &wr)
            };
            if !matches!(status, WcStatus::Success | WcStatus::Flushed) {
                if let Some(q) = self.qps.get_mut(&qpn) {
                    q.state = QpState::Error;
                }
                // a remote access violation takes the responder's queue pair down too
                if status == WcStatus::RemoteAccess
                    && let Some(r) = remote.and_then(|r| self.qps.get_mut(&r))
                {
                    r.state = QpState::Error;
                }
            }
            self.cqs.entry(cq).or_default().push_back(Completion {
                wr_id: wr.wr_id,
                status,
            });
        }
    }

    fn execute(&mut self, node: u32, remote: Option<u32>, wr: &WorkRequest) -> WcStatus {
        let local_ok = self
            .mrs
            .get(&wr.lkey)
            .is_some_and(|m| m.node == node && covers(m, wr.local_addr, wr.len));
        if !local_ok {
            return WcStatus::LocalProtection;
        }
        let Some(r) = remote.and_then(|r| self.qps.get(&r)) else {
            return WcStatus::RetryExceeded;
        };
        if !matches!(r.state, QpState::ReadyToReceive | QpState::ReadyToSend)
            || self.cut.contains(&r.node)
        {
            return WcStatus::RetryExceeded;
        }
        let want = match wr.kind {
            WrKind::Write => MrAccess::RemoteWrite,
            WrKind::Read => MrAccess::RemoteRead,
        };
        let remote_ok = self.mrs.get(&wr.rkey).is_some_and(|m| {
            m.node == r.node && m.access == want && covers(m, wr.remote_addr, wr.len)
        });
        if !remote_ok {
            return WcStatus::RemoteAccess;
        }
        let (src, dst) = match wr.kind {
            WrKind::Write => (wr.local_addr, wr.remote_addr),
            WrKind::Read => (wr.remote_addr, wr.local_addr),
        };
        // SAFETY: both ranges lie inside live registrations, whose registrants promised they
        // stay mapped (Verbs::reg_mr's contract) and that nobody else touches them while a
        // work request or a grant names them; regions of one test never overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, wr.len as usize);
        }
        self.executed += 1;
        WcStatus::Success
    }
}

/// One simulated NIC (one node's opened device).
#[derive(Debug)]
pub struct VerbsDouble {
    fabric: Arc<Fabric>,
    node: u32,
    info: DeviceInfo,
}

/// A simulated region (deregistered on drop).
#[derive(Debug)]
pub struct MrHandleDouble {
    fabric: Arc<Fabric>,
    key: u32,
}

impl Drop for MrHandleDouble {
    fn drop(&mut self) {
        self.fabric.lock().mrs.remove(&self.key);
    }
}

/// A simulated completion queue.
#[derive(Debug)]
pub struct CqDouble {
    id: u64,
}

/// A simulated queue pair (destroyed on drop).
#[derive(Debug)]
pub struct QpHandleDouble {
    fabric: Arc<Fabric>,
    qpn: u32,
}

impl Drop for QpHandleDouble {
    fn drop(&mut self) {
        self.fabric.lock().qps.remove(&self.qpn);
    }
}

impl Verbs for VerbsDouble {
    type Mr = MrHandleDouble;
    type Cq = CqDouble;
    type Qp = QpHandleDouble;

    fn device(&self) -> &DeviceInfo {
        &self.info
    }

    unsafe fn reg_mr(&self, addr: *mut u8, len: usize, access: MrAccess) -> Result<MrHandleDouble> {
        let mut s = self.fabric.lock();
        if s.refuse_reg.contains(&self.node) {
            return Err(Error::Io(
                "ibv_reg_mr: Cannot allocate memory (simulated)".into(),
            ));
        }
        s.next += 1;
        let key = s.next;
        s.mrs.insert(
            key,
            MrDouble {
                node: self.node,
                addr: addr as u64,
                len: len as u64,
                access,
            },
        );
        Ok(MrHandleDouble {
            fabric: Arc::clone(&self.fabric),
            key,
        })
    }

    unsafe fn reg_dmabuf_mr(
        &self,
        _fd: std::os::fd::BorrowedFd<'_>,
        _offset: u64,
        len: usize,
        iova: u64,
        access: MrAccess,
    ) -> Result<MrHandleDouble> {
        self.fabric.lock().dmabuf_regs += 1;
        // SAFETY: the caller's contract; in the double, "device memory" is host memory at iova.
        unsafe { self.reg_mr(iova as *mut u8, len, access) }
    }

    fn keys(&self, mr: &MrHandleDouble) -> MrKeys {
        MrKeys {
            lkey: mr.key,
            rkey: mr.key,
        }
    }

    fn create_cq(&self, _depth: u32) -> Result<CqDouble> {
        let mut s = self.fabric.lock();
        s.next += 1;
        let id = u64::from(s.next);
        s.cqs.insert(id, VecDeque::new());
        Ok(CqDouble { id })
    }

    fn create_qp(&self, cq: &CqDouble, send_depth: u32) -> Result<QpHandleDouble> {
        let mut s = self.fabric.lock();
        s.next += 1;
        let qpn = s.next;
        s.qps.insert(
            qpn,
            QpDouble {
                node: self.node,
                cq: cq.id,
                state: QpState::Reset,
                depth: send_depth as usize,
                remote: None,
                queue: VecDeque::new(),
            },
        );
        Ok(QpHandleDouble {
            fabric: Arc::clone(&self.fabric),
            qpn,
        })
    }

    fn qp_info(&self, qp: &QpHandleDouble) -> QpInfo {
        QpInfo {
            qpn: qp.qpn,
            psn: qp.qpn & 0xff_ffff,
            lid: self.info.lid,
            gid: self.info.gid,
            mtu: self.info.mtu,
        }
    }

    fn modify_qp(
        &self,
        qp: &mut QpHandleDouble,
        to: QpState,
        remote: Option<&QpInfo>,
    ) -> Result<()> {
        let mut s = self.fabric.lock();
        let q = s
            .qps
            .get_mut(&qp.qpn)
            .ok_or_else(|| Error::NotFound(format!("queue pair {}", qp.qpn)))?;
        super::qp::check_move(q.state, to)?;
        if to == QpState::ReadyToReceive {
            let r = remote.ok_or_else(|| {
                Error::InvalidArgument("ready-to-receive needs the peer's queue pair".into())
            })?;
            q.remote = Some(r.qpn);
        }
        q.state = to;
        Ok(())
    }

    unsafe fn post(&self, qp: &mut QpHandleDouble, wrs: &[WorkRequest]) -> Result<()> {
        let mut s = self.fabric.lock();
        let q = s
            .qps
            .get_mut(&qp.qpn)
            .ok_or_else(|| Error::NotFound(format!("queue pair {}", qp.qpn)))?;
        if q.state != QpState::ReadyToSend {
            return Err(Error::InvalidArgument(format!(
                "ibv_post_send on a queue pair in state {:?}",
                q.state
            )));
        }
        if q.queue.len() + wrs.len() > q.depth {
            return Err(Error::Io(
                "ibv_post_send: Cannot allocate memory (send queue full)".into(),
            ));
        }
        q.queue.extend(wrs.iter().copied());
        s.doorbells += 1;
        Ok(())
    }

    fn poll(&self, cq: &CqDouble, max: usize, out: &mut Vec<Completion>) -> Result<usize> {
        let mut s = self.fabric.lock();
        let qpns: Vec<u32> = s
            .qps
            .iter()
            .filter(|(_, q)| q.cq == cq.id)
            .map(|(n, _)| *n)
            .collect();
        for n in qpns {
            s.run(n);
        }
        let q = s.cqs.entry(cq.id).or_default();
        let n = q.len().min(max);
        out.extend(q.drain(..n));
        Ok(n)
    }
}
