//! Backend choice per peer: the TCP engine, always (control connections, the grant table, the
//! fallback), and the RDMA engine where this build has it (feature `rdma`) and a device is
//! usable. Both serve one grant table, so a grant made for a transfer works whichever engine the
//! peer moves the bytes with. A peer's batches go over RDMA when both ends have it, over TCP
//! otherwise: a peer whose side connection says it serves no RDMA gets TCP for [`REPROBE`], then
//! is asked again (it may have been restarted with RDMA). Keyed by the peer's node id; endpoints
//! are opened on first use, cached, and reopened once when they failed.
//!
//! A new backend is a change here and in its own module: the data port above calls
//! [`Backends::run_batch`], [`Backends::grant`], [`Backends::revoke`] and
//! [`Backends::open_control`], never a backend.
//!
//! [`Backends::in_process`] puts the in-process backend in TCP's place (its batches a grant
//! check and a copy, its control channels in-process pairs, peers found in an
//! [`InProcNet`]), so that the transfer protocol above runs between nodes in one process,
//! without sockets or privileges.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::channel::Channel;
use crate::engine::{EndpointId, Memory, Op, OpFailure, Revoked, Target, Transport};
use crate::error::{Error, Result};
use crate::grant::{Grant, SegmentId, TransferId};
use crate::inproc::{InProcNet, InProcTransport};
use crate::link::wire::Bind;
use crate::link::{Handler, PeerAddr};
use crate::segment::SegmentDescriptor;
use crate::tcp::TcpTransport;

/// The engine a peer's blocks go over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// TCP on io_uring.
    Tcp,
    /// RDMA verbs.
    Rdma,
    /// The in-process backend (nodes of one process).
    #[serde(rename = "in_process")]
    InProc,
}

/// What the choice is and was, per peer (the data port's `/status` shows it).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct BackendsReport {
    /// What was asked: `tcp`, `auto` (RDMA where usable) or `rdma`.
    pub requested: String,
    /// The engine used for peers that have it too: `tcp` or `rdma`.
    pub preferred: String,
    /// Why (the device in use, or why not RDMA).
    pub reason: String,
    /// Per peer (node id), the engine its last transfer used.
    pub peers: BTreeMap<u64, Backend>,
}

#[cfg(feature = "rdma")]
type Rdma = crate::rdma::RdmaTransport<crate::rdma::sideway::SidewayVerbs>;

/// How the RDMA device is chosen.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct RdmaSettings {
    /// By name.
    pub device: Option<String>,
    /// Nearest this GPU (PCI bus id).
    pub near_gpu: Option<String>,
    /// The port's GID index.
    pub gid_index: u32,
}

/// What a node's blocks may move over: the one name for the transport choice, from the
/// daemon's `--transport` flag (and config key) to [`Backends::start`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportChoice {
    /// RDMA where it can be used (built in, a device here, a peer that serves it), TCP
    /// otherwise.
    #[default]
    Auto,
    /// TCP only.
    Tcp,
    /// RDMA, or no start at all without a usable device here.
    Rdma,
}

impl TransportChoice {
    /// The names, as flags and config files spell them.
    pub const NAMES: [&'static str; 3] = ["auto", "tcp", "rdma"];

    /// This choice's name.
    pub fn as_str(self) -> &'static str {
        match self {
            TransportChoice::Auto => "auto",
            TransportChoice::Tcp => "tcp",
            TransportChoice::Rdma => "rdma",
        }
    }
}

impl std::fmt::Display for TransportChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for TransportChoice {
    type Err = Error;
    fn from_str(s: &str) -> Result<TransportChoice> {
        match s {
            "auto" => Ok(TransportChoice::Auto),
            "tcp" => Ok(TransportChoice::Tcp),
            "rdma" => Ok(TransportChoice::Rdma),
            _ => Err(Error::InvalidArgument(format!(
                "transport {s:?}: expected one of auto, tcp, rdma"
            ))),
        }
    }
}

/// The backend every node has: it carries control channels and holds the grant table.
#[derive(Debug)]
enum Base {
    /// The data port's TCP engine.
    Tcp(TcpTransport),
    /// The in-process backend.
    InProc(Box<InProc>),
}

/// The in-process backend, its memory side and the nodes it reaches.
#[derive(Debug)]
struct InProc {
    engine: InProcTransport,
    target: std::sync::Arc<Target>,
    net: std::sync::Arc<InProcNet>,
}

/// The backends of one node's data port.
#[derive(Debug)]
pub struct Backends {
    base: Base,
    #[cfg(feature = "rdma")]
    rdma: Option<std::sync::Arc<Rdma>>,
    requested: &'static str,
    reason: String,
    /// Endpoints per (engine, peer).
    endpoints: Mutex<HashMap<(Backend, u64), EndpointId>>,
    /// What each peer's last transfer used.
    used: Mutex<BTreeMap<u64, Backend>>,
    /// Peers found not to serve RDMA, and when (asked again after [`REPROBE`]).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    no_rdma: Mutex<HashMap<u64, std::time::Instant>>,
}

/// One engine's try at a batch.
enum Attempt {
    /// Its outcome.
    Done(Result<Vec<Option<u32>>>),
    /// The peer serves no RDMA (why): try TCP.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    NoRdma(String),
}

/// How long a peer found without RDMA gets TCP before it is asked again (it may have been
/// restarted with RDMA).
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
const REPROBE: Duration = Duration::from_secs(60);

impl Backends {
    /// Add the RDMA engine to `tcp` as `choice` says, its device chosen by `rdma`;
    /// `chunk_bytes` is the RDMA engine's chunk (the TCP engine's, so that a block travels as
    /// one chunk on either).
    ///
    /// # Errors
    /// [`Error::Unsupported`] for [`TransportChoice::Rdma`] where RDMA cannot be used (the
    /// message says why).
    pub fn start(
        tcp: TcpTransport,
        choice: TransportChoice,
        rdma: &RdmaSettings,
        chunk_bytes: u32,
    ) -> Result<Backends> {
        let mut e = Backends {
            base: Base::Tcp(tcp),
            #[cfg(feature = "rdma")]
            rdma: None,
            requested: choice.as_str(),
            reason: String::new(),
            endpoints: Mutex::new(HashMap::new()),
            used: Mutex::new(BTreeMap::new()),
            no_rdma: Mutex::new(HashMap::new()),
        };
        let required = match choice {
            TransportChoice::Tcp => {
                e.reason = "TCP only, as asked".into();
                return Ok(e);
            }
            TransportChoice::Auto => false,
            TransportChoice::Rdma => true,
        };
        match e.start_rdma(rdma, chunk_bytes) {
            Ok(device) => e.reason = format!("RDMA device {device}"),
            Err(why) if required => return Err(Error::Unsupported(why)),
            Err(why) => e.reason = why,
        }
        Ok(e)
    }

    /// A node of `net` with node id `node_id` in incarnation `node_generation`: the in-process
    /// backend in TCP's place, no RDMA.
    ///
    /// # Errors
    /// As [`InProcNet::join`].
    pub fn in_process(
        net: &std::sync::Arc<InProcNet>,
        node_id: u64,
        node_generation: u64,
    ) -> Result<Backends> {
        let engine =
            InProcTransport::new(node_id, node_generation, crate::engine::Limits::default());
        let target = engine.target();
        net.join(&target)?;
        Ok(Backends {
            base: Base::InProc(Box::new(InProc {
                engine,
                target,
                net: std::sync::Arc::clone(net),
            })),
            #[cfg(feature = "rdma")]
            rdma: None,
            requested: "in_process",
            reason: "in-process nodes".into(),
            endpoints: Mutex::new(HashMap::new()),
            used: Mutex::new(BTreeMap::new()),
            no_rdma: Mutex::new(HashMap::new()),
        })
    }

    #[cfg(not(feature = "rdma"))]
    fn start_rdma(&mut self, _: &RdmaSettings, _: u32) -> std::result::Result<String, String> {
        Err("this kvd was built without RDMA (cargo feature `rdma`)".into())
    }

    #[cfg(feature = "rdma")]
    fn start_rdma(
        &mut self,
        s: &RdmaSettings,
        chunk_bytes: u32,
    ) -> std::result::Result<String, String> {
        use crate::rdma::device::DeviceChoice;
        use crate::rdma::sideway::{DeviceConfig, SidewayVerbs};
        use crate::rdma::{RdmaConfig, RdmaTransport};
        let Base::Tcp(tcp) = &self.base else {
            return Err("RDMA runs beside the TCP engine only".into());
        };
        let choice = match (&s.device, &s.near_gpu) {
            (Some(n), _) => DeviceChoice::Named(n.clone()),
            (None, Some(g)) => DeviceChoice::NearGpu(g.clone()),
            (None, None) => DeviceChoice::First,
        };
        let verbs = SidewayVerbs::open(&DeviceConfig {
            choice,
            port: 1,
            gid_index: s.gid_index,
        })
        .map_err(|e| format!("no usable RDMA device: {e}"))?;
        let device = crate::rdma::verbs::Verbs::device(&verbs).name.clone();
        let config = RdmaConfig {
            chunk_bytes,
            ..RdmaConfig::default()
        };
        let rdma = RdmaTransport::start(
            verbs,
            config,
            tcp.target_arc(),
            tcp.opener(crate::link::wire::Purpose::Rdma),
        )
        .map_err(|e| format!("the RDMA engine on {device}: {e}"))?;
        let rdma = std::sync::Arc::new(rdma);
        let weak = std::sync::Arc::downgrade(&rdma);
        tcp.set_rdma_handler(std::sync::Arc::new(move |stream, bind| {
            if let Some(r) = weak.upgrade() {
                r.serve_side(stream, bind);
            }
        }));
        self.rdma = Some(rdma);
        Ok(device)
    }

    /// Register `len` bytes of `memory` as `segment` with every backend (one grant table
    /// serves them all; RDMA adds its local regions); the descriptor peers name it by.
    ///
    /// # Errors
    /// As [`Transport::register`].
    pub fn register(
        &self,
        segment: SegmentId,
        memory: std::sync::Arc<dyn Memory>,
        len: u64,
    ) -> Result<SegmentDescriptor> {
        use crate::engine::Registration;
        let descriptor = match &self.base {
            Base::Tcp(tcp) => tcp.register(segment, memory.clone(), 0, len)?.descriptor(),
            Base::InProc(p) => p
                .engine
                .register(segment, memory.clone(), 0, len)?
                .descriptor(),
        };
        #[cfg(feature = "rdma")]
        if let Some(r) = &self.rdma {
            r.register(segment, memory, 0, len)?;
        }
        #[cfg(not(feature = "rdma"))]
        drop(memory);
        Ok(descriptor)
    }

    /// Ops and bytes in flight as initiator, both engines.
    pub fn in_flight(&self) -> (usize, u64) {
        let (o, b) = match &self.base {
            Base::Tcp(tcp) => tcp.in_flight(),
            Base::InProc(p) => p.engine.in_flight(),
        };
        #[cfg(feature = "rdma")]
        if let Some(r) = &self.rdma {
            let (ro, rb) = r.in_flight();
            return (o + ro, b + rb);
        }
        (o, b)
    }

    /// The TCP engine (its address, its counters); `None` in process.
    pub fn tcp(&self) -> Option<&TcpTransport> {
        match &self.base {
            Base::Tcp(tcp) => Some(tcp),
            Base::InProc(_) => None,
        }
    }

    /// The grant table and segments both engines serve.
    pub fn target(&self) -> &Target {
        match &self.base {
            Base::Tcp(tcp) => tcp.target(),
            Base::InProc(p) => &p.target,
        }
    }

    /// The engines' clock.
    pub fn now_ms(&self) -> u64 {
        self.target().now_ms()
    }

    /// Open an authenticated control channel to `peer` for the owner's own messages, and
    /// the peer's introduction (see `TcpTransport::open_control`).
    ///
    /// # Errors
    /// [`Error::PeerUnavailable`] when the peer cannot be reached or authenticated.
    pub fn open_control(&self, peer: &PeerAddr) -> Result<(Channel, Bind)> {
        match &self.base {
            Base::Tcp(tcp) => tcp.open_control(peer),
            Base::InProc(p) => p.net.open_control(&p.target, peer.node_id),
        }
    }

    /// Take the control channels peers open to this node.
    pub fn set_control_handler(&self, handler: Handler) {
        match &self.base {
            Base::Tcp(tcp) => tcp.set_control_handler(handler),
            Base::InProc(p) => p.net.set_control_handler(p.target.node_id(), handler),
        }
    }

    /// Add a grant (it serves both engines).
    ///
    /// # Safety
    /// As [`Transport::grant`].
    ///
    /// # Errors
    /// As [`Transport::grant`].
    pub unsafe fn grant(&self, g: Grant) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            match &self.base {
                Base::Tcp(tcp) => tcp.grant(g),
                Base::InProc(p) => p.engine.grant(g),
            }
        }
    }

    /// End a transfer's grants on both engines: once this returns no TCP chunk of it is in
    /// flight and no RDMA key of it works.
    pub fn revoke(&self, transfer: TransferId) -> Revoked {
        #[cfg(feature = "rdma")]
        if let Some(r) = &self.rdma {
            return r.revoke(transfer);
        }
        match &self.base {
            Base::Tcp(tcp) => tcp.revoke(transfer),
            Base::InProc(p) => p.engine.revoke(transfer),
        }
    }

    /// The choice, and what each peer's last transfer used.
    pub fn report(&self) -> BackendsReport {
        BackendsReport {
            requested: self.requested.into(),
            preferred: self.preferred().into(),
            reason: self.reason.clone(),
            peers: self.used.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        }
    }

    /// The choice, for a start-up log line.
    pub fn describe(&self) -> String {
        format!("{} ({})", self.preferred(), self.reason)
    }

    /// The engine used for peers that have it too.
    fn preferred(&self) -> &'static str {
        match &self.base {
            Base::InProc(_) => "in_process",
            Base::Tcp(_) if self.rdma_on() => "rdma",
            Base::Tcp(_) => "tcp",
        }
    }

    fn rdma_on(&self) -> bool {
        #[cfg(feature = "rdma")]
        return self.rdma.is_some();
        #[cfg(not(feature = "rdma"))]
        false
    }

    fn note(&self, peer: u64, b: Backend) {
        let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        if used.len() < 4096 || used.contains_key(&peer) {
            used.insert(peer, b);
        }
    }

    /// One batch of reads or writes with `peer` on its cached endpoint (reopened once if it
    /// failed): over RDMA when both ends have it, else TCP. The CRC-32C each op's chunks were
    /// verified with, where the engine checksums them (TCP).
    ///
    /// # Safety
    /// As [`Transport::submit`]: the caller keeps off the ops' local ranges until this
    /// returns (it returns only once the batch settled).
    ///
    /// # Errors
    /// [`Error::PeerUnavailable`] when ops failed, as the engines' errors otherwise.
    pub unsafe fn run_batch(
        &self,
        peer: PeerAddr,
        ops: &[Op],
        checksums: &[Option<u32>],
        timeout: Duration,
    ) -> Result<Vec<Option<u32>>> {
        #[cfg(feature = "rdma")]
        if let Some(r) = &self.rdma {
            let node = peer.node_id;
            let tcp_only = self
                .no_rdma
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&node)
                .is_some_and(|t| t.elapsed() < REPROBE);
            if !tcp_only {
                // SAFETY: the caller's contract, passed on.
                match unsafe {
                    self.on(&**r, (Backend::Rdma, node), &peer, ops, checksums, timeout)
                } {
                    Attempt::NoRdma(why) => {
                        tracing::info!(peer = node, reason = %why, "the peer serves no RDMA; using TCP");
                        let mut no = self.no_rdma.lock().unwrap_or_else(|p| p.into_inner());
                        if no.len() >= 4096 {
                            no.retain(|_, t| t.elapsed() < REPROBE);
                        }
                        no.insert(node, std::time::Instant::now());
                    }
                    Attempt::Done(r) => return r,
                }
            }
        }
        let node = peer.node_id;
        let attempt = match &self.base {
            // SAFETY: the caller's contract, passed on.
            Base::Tcp(tcp) => unsafe {
                self.on(tcp, (Backend::Tcp, node), &peer, ops, checksums, timeout)
            },
            Base::InProc(p) => {
                let target = p.net.target_of(node)?;
                // SAFETY: the caller's contract, passed on.
                unsafe {
                    self.on(
                        &p.engine,
                        (Backend::InProc, node),
                        &target,
                        ops,
                        checksums,
                        timeout,
                    )
                }
            }
        };
        match attempt {
            Attempt::Done(r) => r,
            Attempt::NoRdma(why) => Err(Error::PeerUnavailable(why)),
        }
    }

    /// [`Backends::run_batch`] on one engine. An RDMA endpoint the peer will not open is
    /// answered [`Attempt::NoRdma`] (the caller falls back to TCP).
    unsafe fn on<T: Transport>(
        &self,
        engine: &T,
        (backend, node): (Backend, u64),
        peer: &T::Peer,
        ops: &[Op],
        checksums: &[Option<u32>],
        timeout: Duration,
    ) -> Attempt {
        let mut reopened = false;
        loop {
            let ep = {
                let mut eps = self.endpoints.lock().unwrap_or_else(|p| p.into_inner());
                match eps.get(&(backend, node)) {
                    Some(&ep) => ep,
                    None => {
                        let ep = match engine.open(peer) {
                            Ok(ep) => ep,
                            #[cfg(feature = "rdma")]
                            Err(e)
                                if backend == Backend::Rdma && crate::rdma::peer_lacks_rdma(&e) =>
                            {
                                return Attempt::NoRdma(e.to_string());
                            }
                            Err(e) => return Attempt::Done(Err(e)),
                        };
                        eps.insert((backend, node), ep);
                        ep
                    }
                }
            };
            self.note(node, backend);
            // SAFETY: the caller's contract (run_batch's), passed on; this waits for the batch
            // to settle before returning.
            let submitted = unsafe { engine.submit_with_checksums(ep, ops, checksums) };
            let batch = match submitted {
                Ok(b) => b,
                Err(Error::PeerUnavailable(_)) if !reopened => {
                    self.forget(engine, backend, node, ep);
                    reopened = true;
                    continue;
                }
                Err(e) => return Attempt::Done(Err(e)),
            };
            return Attempt::Done(self.settle(
                engine,
                (backend, node),
                ep,
                batch,
                ops.len(),
                timeout,
            ));
        }
    }

    /// Wait for a submitted batch to settle and release it; its checksums, or why it failed.
    fn settle<T: Transport>(
        &self,
        engine: &T,
        (backend, node): (Backend, u64),
        ep: EndpointId,
        batch: crate::engine::BatchId,
        ops: usize,
        timeout: Duration,
    ) -> Result<Vec<Option<u32>>> {
        let mut st = engine.wait(batch, timeout)?;
        if !st.settled {
            // The engine's stall timeout is far shorter; this is only a backstop. Closing the
            // endpoint fails what is left, and the batch settles once the kernel (or the NIC)
            // lets go of its buffers: until then its pages must not be freed.
            self.forget(engine, backend, node, ep);
            while !st.settled {
                tracing::warn!(
                    peer = node,
                    "a transfer batch has not settled; waiting for it"
                );
                st = engine.wait(batch, timeout)?;
            }
        }
        let mut crcs = vec![None; ops];
        let _ = engine.checksums(batch, &mut crcs);
        let _ = engine.release(batch);
        if st.succeeded() {
            return Ok(crcs);
        }
        if st.first_failure.is_some_and(|f| {
            matches!(
                f,
                OpFailure::PeerClosed | OpFailure::Timeout | OpFailure::Protocol
            )
        }) {
            self.forget(engine, backend, node, ep);
        }
        Err(Error::PeerUnavailable(format!(
            "the transfer with node {node} failed: {} of {} blocks not delivered ({})",
            st.ops - st.done,
            st.ops,
            st.first_failure
                .map_or_else(|| "cancelled".to_string(), |f| f.to_string())
        )))
    }

    /// Close every cached endpoint, so that the next batch to each peer opens new connections
    /// whose handshake introduces this node as it is now: after its generation changed, peers
    /// grant transfers to the new incarnation only, and refuse the old one's connections.
    pub fn reconnect_all(&self) {
        self.close_endpoints(|_| true);
    }

    /// Close every connection that involves node `node` (its key is no longer trusted): the
    /// cached endpoints to it, and on the TCP engine the connections it opened here.
    pub fn evict(&self, node: u64) {
        self.close_endpoints(|peer| peer == node);
        if let Base::Tcp(tcp) = &self.base {
            tcp.evict(node);
        }
    }

    /// Close the cached endpoints to the peers `which` names.
    fn close_endpoints(&self, which: impl Fn(u64) -> bool) {
        let eps: Vec<((Backend, u64), EndpointId)> = {
            let mut all = self.endpoints.lock().unwrap_or_else(|p| p.into_inner());
            let named: Vec<(Backend, u64)> = all.keys().filter(|k| which(k.1)).copied().collect();
            named
                .into_iter()
                .filter_map(|k| all.remove(&k).map(|ep| (k, ep)))
                .collect()
        };
        for ((backend, _), ep) in eps {
            match (backend, &self.base) {
                (Backend::Tcp, Base::Tcp(tcp)) => tcp.close(ep),
                (Backend::InProc, Base::InProc(p)) => p.engine.close(ep),
                #[cfg(feature = "rdma")]
                (Backend::Rdma, _) => {
                    if let Some(r) = &self.rdma {
                        r.close(ep);
                    }
                }
                _ => {}
            }
        }
    }

    fn forget<T: Transport>(&self, engine: &T, backend: Backend, peer: u64, ep: EndpointId) {
        let mut eps = self.endpoints.lock().unwrap_or_else(|p| p.into_inner());
        if eps.get(&(backend, peer)) == Some(&ep) {
            eps.remove(&(backend, peer));
            engine.close(ep);
        }
    }
}
