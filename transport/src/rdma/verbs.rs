//! The verbs layer the RDMA backend is written over: the few calls it makes, as a trait, so
//! that everything above the hardware (queue-pair states, batching, completions, keys, error
//! paths) runs the same against the real device ([`super::sideway::SidewayVerbs`]) and, in
//! tests, against a double of the fabric (`super::sim`).
//!
//! Dropping a [`Verbs::Mr`] deregisters it (a peer's later access with its rkey fails); dropping
//! a [`Verbs::Qp`] destroys it.

use crate::error::Result;

/// What a memory region lets the NIC do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MrAccess {
    /// Local reads and writes only (an initiator's own segments: the NIC reads what a WRITE
    /// sends and writes what a READ brings back; no peer can name it).
    Local,
    /// A peer may RDMA WRITE into it (a granted destination range).
    RemoteWrite,
    /// A peer may RDMA READ it (a granted source range).
    RemoteRead,
}

/// The keys of a registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MrKeys {
    /// For our own work requests.
    pub lkey: u32,
    /// For a peer's (meaningless for [`MrAccess::Local`]).
    pub rkey: u32,
}

/// What the device and port are, as far as the backend cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device's name (`mlx5_0`).
    pub name: String,
    /// The port used (1-based).
    pub port: u8,
    /// The port's LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// The GID at the configured index (RoCE and routed InfiniBand).
    pub gid: [u8; 16],
    /// The port's active MTU, in bytes.
    pub mtu: u32,
    /// The largest region one registration may cover.
    pub max_mr_bytes: u64,
    /// Work requests a queue pair's send queue can hold.
    pub max_qp_wr: u32,
}

/// How a peer's queue pair is reached (exchanged over the side channel).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpInfo {
    /// Queue pair number.
    pub qpn: u32,
    /// First packet sequence number it sends with.
    pub psn: u32,
    /// Its port's LID.
    pub lid: u16,
    /// Its port's GID.
    pub gid: [u8; 16],
    /// Its port's active MTU, in bytes.
    pub mtu: u32,
}

/// Queue-pair states, in the order an RC queue pair passes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpState {
    /// Created.
    Reset,
    /// Port and access set.
    Init,
    /// Ready to receive: knows its peer.
    ReadyToReceive,
    /// Ready to send.
    ReadyToSend,
    /// Failed: every outstanding work request completes flushed.
    Error,
}

/// One-sided operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WrKind {
    /// Our bytes into the peer's region.
    Write,
    /// The peer's bytes into ours.
    Read,
}

/// One work request: one contiguous local range and one remote range of the same length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkRequest {
    /// Comes back in the completion.
    pub wr_id: u64,
    /// Write or read.
    pub kind: WrKind,
    /// Local address.
    pub local_addr: u64,
    /// The local region's key.
    pub lkey: u32,
    /// Bytes.
    pub len: u32,
    /// The peer's address (as its registration names it).
    pub remote_addr: u64,
    /// The peer's key for the range.
    pub rkey: u32,
}

/// How a work request ended (the `ibv_wc_status` values the backend tells apart).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcStatus {
    /// Done.
    Success,
    /// The queue pair failed before this one ran (`IBV_WC_WR_FLUSH_ERR`).
    Flushed,
    /// The peer refused the rkey or range (`IBV_WC_REM_ACCESS_ERR`): the grant is gone.
    RemoteAccess,
    /// No acknowledgement after the transport's retries (`IBV_WC_RETRY_EXC_ERR`): the link or
    /// the peer is gone.
    RetryExceeded,
    /// Our own key or range was wrong (`IBV_WC_LOC_PROT_ERR`, `IBV_WC_LOC_LEN_ERR`).
    LocalProtection,
    /// Anything else (the raw status).
    Other(u32),
}

/// One completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The work request's id.
    pub wr_id: u64,
    /// How it ended.
    pub status: WcStatus,
}

/// The verbs the backend uses. One value is one opened device with one protection domain.
pub trait Verbs: Send + Sync + 'static {
    /// A registered memory region (deregistered on drop).
    type Mr: Send + Sync + std::fmt::Debug;
    /// A completion queue.
    type Cq: Send + Sync + std::fmt::Debug;
    /// An RC queue pair (destroyed on drop).
    type Qp: Send + std::fmt::Debug;

    /// The device and port in use.
    fn device(&self) -> &DeviceInfo;

    /// Register `len` bytes at `addr`.
    ///
    /// # Safety
    /// The range must stay mapped until the region is dropped; with a remote access, a peer
    /// holding the rkey may read or write it until then.
    unsafe fn reg_mr(&self, addr: *mut u8, len: usize, access: MrAccess) -> Result<Self::Mr>;

    /// Register `len` bytes of a dma-buf (`fd`, from `offset`), which work requests name at
    /// addresses from `iova`: device memory exported by its driver (GPUDirect RDMA without
    /// nvidia-peermem).
    ///
    /// # Safety
    /// As [`Verbs::reg_mr`], for the exported memory.
    unsafe fn reg_dmabuf_mr(
        &self,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
        access: MrAccess,
    ) -> Result<Self::Mr>;

    /// A region's keys.
    fn keys(&self, mr: &Self::Mr) -> MrKeys;

    /// A completion queue of `depth` entries.
    fn create_cq(&self, depth: u32) -> Result<Self::Cq>;

    /// An RC queue pair on `cq` with a send queue of `send_depth` work requests, in
    /// [`QpState::Reset`].
    fn create_qp(&self, cq: &Self::Cq, send_depth: u32) -> Result<Self::Qp>;

    /// How a peer reaches `qp` (its number, our port's address, the first PSN it sends).
    fn qp_info(&self, qp: &Self::Qp) -> QpInfo;

    /// Move `qp` to `to` (the next state in order, or `Error`); `remote` is needed for
    /// [`QpState::ReadyToReceive`] and [`QpState::ReadyToSend`].
    fn modify_qp(&self, qp: &mut Self::Qp, to: QpState, remote: Option<&QpInfo>) -> Result<()>;

    /// Post `wrs` with one doorbell, each signaled. All or nothing.
    ///
    /// # Safety
    /// Every local range lies in a live region of ours with its lkey, and stays untouched by
    /// us (and mapped) until its completion is polled.
    unsafe fn post(&self, qp: &mut Self::Qp, wrs: &[WorkRequest]) -> Result<()>;

    /// Up to `max` completions of `cq`, appended to `out`; how many.
    fn poll(&self, cq: &Self::Cq, max: usize, out: &mut Vec<Completion>) -> Result<usize>;
}
