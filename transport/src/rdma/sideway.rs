//! The verbs layer on a real device, through sideway (which loads libibverbs when first used,
//! so a binary built with `rdma` starts on hosts without rdma-core and says so here instead).
//!
//! Not exercised on this project's CI or development machines (no RDMA-capable kernel
//! there); everything above it is tested against the fabric double.

use std::sync::Arc;

use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::BasicCompletionQueue;
use sideway::ibverbs::device::{DeviceInfo as _, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, Mtu};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState,
    SetScatterGatherEntry, WorkRequestFlags,
};

use super::device::{self, DeviceChoice, Found};
use super::verbs::{
    Completion, DeviceInfo, MrAccess, MrKeys, QpInfo, QpState, Verbs, WcStatus, WorkRequest, WrKind,
};
use crate::error::{Error, Result};

fn io(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Io(format!("{what}: {e}"))
}

/// The RDMA devices this host has, with their PCIe paths.
///
/// # Errors
/// [`Error::Io`] when libibverbs cannot be loaded or listed.
pub fn devices() -> Result<Vec<Found>> {
    // libibverbs answers "no device list" without saying why; the kernel's view says it
    let sys = std::path::Path::new("/sys/class/infiniband");
    let listed = std::fs::read_dir(sys).map(|d| d.count()).unwrap_or(0);
    if listed == 0 {
        return Err(Error::NotFound(format!(
            "no RDMA devices: {} is {} (no RDMA NIC driver is loaded on this host; `ibv_devices` lists devices, `rdma link` their ports)",
            sys.display(),
            if sys.exists() { "empty" } else { "absent" }
        )));
    }
    let list = DeviceList::new().map_err(|e| {
        io(
            "list RDMA devices (is rdma-core's libibverbs installed?)",
            e,
        )
    })?;
    Ok(list
        .iter()
        .map(|d| {
            let name = d.name();
            Found {
                pci_path: device::sysfs_path_of_device(&name),
                name,
            }
        })
        .collect())
}

/// Which device to open and how.
#[derive(Debug, Clone, Default)]
pub struct DeviceConfig {
    /// How it is picked.
    pub choice: DeviceChoice,
    /// The port (1-based).
    pub port: u8,
    /// The GID index (RoCE v2 is usually 1 or 3; `show_gids` lists them).
    pub gid_index: u32,
}

/// One opened device with its protection domain.
pub struct SidewayVerbs {
    _context: Arc<DeviceContext>,
    pd: Arc<ProtectionDomain>,
    context: Arc<DeviceContext>,
    info: DeviceInfo,
}

impl std::fmt::Debug for SidewayVerbs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SidewayVerbs")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

fn mtu_bytes(m: Mtu) -> u32 {
    match m {
        Mtu::Mtu256 => 256,
        Mtu::Mtu512 => 512,
        Mtu::Mtu1024 => 1024,
        Mtu::Mtu2048 => 2048,
        Mtu::Mtu4096 => 4096,
    }
}

fn mtu_of(bytes: u32) -> Mtu {
    match bytes {
        0..=256 => Mtu::Mtu256,
        257..=512 => Mtu::Mtu512,
        513..=1024 => Mtu::Mtu1024,
        1025..=2048 => Mtu::Mtu2048,
        _ => Mtu::Mtu4096,
    }
}

impl SidewayVerbs {
    /// Open the device `config` picks (`gpu_path`: the resolved sysfs path of the GPU for
    /// [`DeviceChoice::NearGpu`]).
    ///
    /// # Errors
    /// [`Error::NotFound`] when no device fits, [`Error::Io`] when it cannot be opened or
    /// queried.
    pub fn open(config: &DeviceConfig) -> Result<SidewayVerbs> {
        let found = devices()?;
        let gpu = match &config.choice {
            DeviceChoice::NearGpu(bus) => device::sysfs_path_of_pci(bus),
            _ => None,
        };
        let pick = device::choose(&found, &config.choice, gpu.as_deref())?
            .name
            .clone();
        let list = DeviceList::new().map_err(|e| io("list RDMA devices", e))?;
        let dev = list
            .iter()
            .find(|d| d.name() == pick)
            .ok_or_else(|| Error::NotFound(format!("RDMA device {pick} went away")))?;
        let context = dev.open().map_err(|e| io(&format!("open {pick}"), e))?;
        let attr = context
            .query_device()
            .map_err(|e| io(&format!("query {pick}"), e))?;
        let port = config.port.max(1);
        let pattr = context
            .query_port(port)
            .map_err(|e| io(&format!("query {pick} port {port}"), e))?;
        let gid = context
            .query_gid(port, config.gid_index)
            .map_err(|e| io(&format!("{pick} port {port} GID {}", config.gid_index), e))?;
        let pd = context
            .alloc_pd()
            .map_err(|e| io(&format!("protection domain on {pick}"), e))?;
        Ok(SidewayVerbs {
            _context: Arc::clone(&context),
            pd,
            info: DeviceInfo {
                name: pick,
                port,
                lid: pattr.lid(),
                gid: gid.raw,
                mtu: mtu_bytes(pattr.active_mtu()),
                max_mr_bytes: attr.max_mr_size(),
                max_qp_wr: attr.max_qp_wr().max(1) as u32,
            },
            context,
        })
    }
}

/// A registered region.
#[derive(Debug)]
pub struct SidewayMr(Arc<MemoryRegion>);

/// A completion queue.
#[derive(Debug)]
pub struct SidewayCq(Arc<BasicCompletionQueue>);

/// An RC queue pair with its first PSN.
#[derive(Debug)]
pub struct SidewayQp {
    qp: BasicQueuePair,
    psn: u32,
}

fn access_flags(a: MrAccess) -> AccessFlags {
    match a {
        MrAccess::Local => AccessFlags::LocalWrite,
        MrAccess::RemoteWrite => AccessFlags::LocalWrite | AccessFlags::RemoteWrite,
        MrAccess::RemoteRead => AccessFlags::RemoteRead,
    }
}

impl Verbs for SidewayVerbs {
    type Mr = SidewayMr;
    type Cq = SidewayCq;
    type Qp = SidewayQp;

    fn device(&self) -> &DeviceInfo {
        &self.info
    }

    unsafe fn reg_mr(&self, addr: *mut u8, len: usize, access: MrAccess) -> Result<SidewayMr> {
        // SAFETY: the caller's contract (the range stays mapped while the region lives).
        let mr = unsafe { self.pd.reg_mr(addr as usize, len, access_flags(access)) }
            .map_err(|e| io("ibv_reg_mr", e))?;
        Ok(SidewayMr(mr))
    }

    unsafe fn reg_dmabuf_mr(
        &self,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
        access: MrAccess,
    ) -> Result<SidewayMr> {
        use std::os::fd::AsRawFd;
        // SAFETY: the caller's contract (the exported memory stays allocated while the region
        // lives); the fd is borrowed for the call, the kernel takes its own reference.
        let mr = unsafe {
            self.pd
                .reg_dmabuf_mr(offset, len, iova, fd.as_raw_fd(), access_flags(access))
        }
        .map_err(|e| {
            io(
                "ibv_reg_dmabuf_mr (does the NIC driver support dma-buf?)",
                e,
            )
        })?;
        Ok(SidewayMr(mr))
    }

    fn keys(&self, mr: &SidewayMr) -> MrKeys {
        MrKeys {
            lkey: mr.0.lkey(),
            rkey: mr.0.rkey(),
        }
    }

    fn create_cq(&self, depth: u32) -> Result<SidewayCq> {
        let mut b = self.context.create_cq_builder();
        b.setup_cqe(depth);
        let cq = b.build().map_err(|e| io("ibv_create_cq", e))?;
        Ok(SidewayCq(cq))
    }

    fn create_qp(&self, cq: &SidewayCq, send_depth: u32) -> Result<SidewayQp> {
        let mut b = self.pd.create_qp_builder();
        b.setup_send_cq(Arc::clone(&cq.0))
            .setup_recv_cq(Arc::clone(&cq.0))
            .setup_max_send_wr(send_depth.min(self.info.max_qp_wr))
            .setup_max_recv_wr(1)
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1);
        let qp = b.build().map_err(|e| io("ibv_create_qp", e))?;
        let psn = rand_psn();
        Ok(SidewayQp { qp, psn })
    }

    fn qp_info(&self, qp: &SidewayQp) -> QpInfo {
        QpInfo {
            qpn: qp.qp.qp_number(),
            psn: qp.psn,
            lid: self.info.lid,
            gid: self.info.gid,
            mtu: self.info.mtu,
        }
    }

    fn modify_qp(&self, qp: &mut SidewayQp, to: QpState, remote: Option<&QpInfo>) -> Result<()> {
        let mut attr = QueuePairAttribute::new();
        let need = || {
            remote.ok_or_else(|| Error::InvalidArgument("the peer's queue pair is needed".into()))
        };
        match to {
            QpState::Reset => {
                attr.setup_state(QueuePairState::Reset);
            }
            QpState::Init => {
                attr.setup_state(QueuePairState::Init)
                    .setup_pkey_index(0)
                    .setup_port(self.info.port)
                    .setup_access_flags(
                        AccessFlags::LocalWrite
                            | AccessFlags::RemoteWrite
                            | AccessFlags::RemoteRead,
                    );
            }
            QpState::ReadyToReceive => {
                let r = need()?;
                let mut ah = AddressHandleAttribute::new();
                ah.setup_dest_lid(r.lid)
                    .setup_port(self.info.port)
                    .setup_service_level(0)
                    .setup_grh_src_gid_index(0)
                    .setup_grh_dest_gid(&Gid { raw: r.gid })
                    .setup_grh_hop_limit(64);
                attr.setup_state(QueuePairState::ReadyToReceive)
                    .setup_path_mtu(mtu_of(r.mtu.min(self.info.mtu)))
                    .setup_dest_qp_num(r.qpn)
                    .setup_rq_psn(r.psn)
                    .setup_max_dest_read_atomic(16)
                    .setup_min_rnr_timer(12)
                    .setup_address_vector(&ah);
            }
            QpState::ReadyToSend => {
                attr.setup_state(QueuePairState::ReadyToSend)
                    .setup_sq_psn(qp.psn)
                    .setup_timeout(14)
                    .setup_retry_cnt(7)
                    .setup_rnr_retry(7)
                    .setup_max_read_atomic(16);
            }
            QpState::Error => {
                attr.setup_state(QueuePairState::Error);
            }
        }
        qp.qp
            .modify(&attr)
            .map_err(|e| io(&format!("ibv_modify_qp to {to:?}"), e))
    }

    unsafe fn post(&self, qp: &mut SidewayQp, wrs: &[WorkRequest]) -> Result<()> {
        let mut guard = qp.qp.start_post_send();
        for w in wrs {
            let h = guard.construct_wr(w.wr_id, WorkRequestFlags::Signaled);
            let h = match w.kind {
                WrKind::Write => h.setup_write(w.rkey, w.remote_addr),
                WrKind::Read => h.setup_read(w.rkey, w.remote_addr),
            };
            // SAFETY: the caller's contract: the local range lies in a live region of ours
            // with this lkey and stays mapped and untouched until its completion.
            unsafe { h.setup_sge(w.lkey, w.local_addr, w.len) };
        }
        // one ibv_post_send of the linked list: one doorbell
        guard.post().map_err(|e| io("ibv_post_send", e))
    }

    fn poll(&self, cq: &SidewayCq, max: usize, out: &mut Vec<Completion>) -> Result<usize> {
        let Ok(poller) = cq.0.start_poll() else {
            // nothing to poll (sideway reports an empty queue as an error)
            return Ok(0);
        };
        let mut n = 0;
        for wc in poller {
            out.push(Completion {
                wr_id: wc.wr_id(),
                status: status_of(wc.status()),
            });
            n += 1;
            if n >= max {
                break;
            }
        }
        Ok(n)
    }
}

fn status_of(raw: u32) -> WcStatus {
    use sideway::ibverbs::completion::WorkCompletionStatus as S;
    const SUCCESS: u32 = S::Success as u32;
    const FLUSH: u32 = S::WorkRequestFlushedError as u32;
    const REM_ACCESS: u32 = S::RemoteAccessError as u32;
    const RETRY: u32 = S::RetryCounterExceededError as u32;
    const LOC_PROT: u32 = S::LocalProtectionError as u32;
    const LOC_LEN: u32 = S::LocalLengthError as u32;
    match raw {
        SUCCESS => WcStatus::Success,
        FLUSH => WcStatus::Flushed,
        REM_ACCESS => WcStatus::RemoteAccess,
        RETRY => WcStatus::RetryExceeded,
        LOC_PROT | LOC_LEN => WcStatus::LocalProtection,
        s => WcStatus::Other(s),
    }
}

fn rand_psn() -> u32 {
    let mut b = [0u8; 4];
    rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty()).ok();
    u32::from_le_bytes(b) & 0x00ff_ffff
}
