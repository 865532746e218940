//! The data port's byte movers: the TCP engine, always (control connections, the grant table,
//! the fallback), and the RDMA engine where this kvd was built with it (feature `rdma`), a
//! device is usable and `--transport` allows it. Both serve one grant table, so a grant made
//! for a transfer works whichever engine the peer moves the bytes with; a peer's blocks go
//! over RDMA when both ends have it, over TCP otherwise, and `/status` says which per peer.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use transport::engine::{EndpointId, Op, OpFailure, Revoked, Target, Transport};
use transport::grant::{Grant, TransferId};
use transport::tcp::{TcpPeer, TcpTransport};

use crate::{Error, Result};
use crate::{RdmaSettings, TransportChoice};

/// The engine a peer's blocks go over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// TCP on io_uring.
    Tcp,
    /// RDMA verbs.
    Rdma,
}

/// What `/status` shows of the choice.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct TransportReport {
    /// `--transport` as given.
    pub requested: String,
    /// The engine used for peers that have it too: `tcp` or `rdma`.
    pub preferred: String,
    /// Why (the device in use, or why not RDMA).
    pub reason: String,
    /// Per peer (node id), the engine its last transfer used.
    pub peers: BTreeMap<u64, Backend>,
}

#[cfg(feature = "rdma")]
type Rdma = transport::rdma::RdmaTransport<transport::rdma::sideway::SidewayVerbs>;

/// The engines of one data port.
#[derive(Debug)]
pub struct Engines {
    tcp: TcpTransport,
    #[cfg(feature = "rdma")]
    rdma: Option<std::sync::Arc<Rdma>>,
    requested: TransportChoice,
    reason: String,
    /// Endpoints per (engine, peer).
    endpoints: Mutex<HashMap<(Backend, u64), EndpointId>>,
    /// What each peer's last transfer used.
    used: Mutex<BTreeMap<u64, Backend>>,
    /// Peers found not to serve RDMA, and when (asked again after [`REPROBE`]).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    no_rdma: Mutex<HashMap<u64, std::time::Instant>>,
}

/// How long a peer found without RDMA gets TCP before it is asked again (it may have been
/// restarted with RDMA).
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
const REPROBE: Duration = Duration::from_secs(60);

impl Engines {
    /// Add the RDMA engine to `tcp` as `choice` says.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `--transport rdma` where RDMA cannot be used (the
    /// message says why and what to do).
    pub fn start(
        tcp: TcpTransport,
        choice: TransportChoice,
        rdma: &RdmaSettings,
    ) -> Result<Engines> {
        let mut e = Engines {
            tcp,
            #[cfg(feature = "rdma")]
            rdma: None,
            requested: choice,
            reason: String::new(),
            endpoints: Mutex::new(HashMap::new()),
            used: Mutex::new(BTreeMap::new()),
            no_rdma: Mutex::new(HashMap::new()),
        };
        if choice == TransportChoice::Tcp {
            e.reason = "--transport tcp".into();
            return Ok(e);
        }
        match e.start_rdma(rdma) {
            Ok(device) => e.reason = format!("RDMA device {device}"),
            Err(why) if choice == TransportChoice::Rdma => {
                return Err(Error::InvalidArgument(format!(
                    "--transport rdma: {why}; use --transport auto (TCP where RDMA cannot be used) or tcp"
                )));
            }
            Err(why) => e.reason = why,
        }
        Ok(e)
    }

    #[cfg(not(feature = "rdma"))]
    fn start_rdma(&mut self, _: &RdmaSettings) -> std::result::Result<String, String> {
        Err("this kvd was built without RDMA (cargo feature `rdma`)".into())
    }

    #[cfg(feature = "rdma")]
    fn start_rdma(&mut self, s: &RdmaSettings) -> std::result::Result<String, String> {
        use transport::rdma::device::DeviceChoice;
        use transport::rdma::sideway::{DeviceConfig, SidewayVerbs};
        use transport::rdma::{RdmaConfig, RdmaTransport};
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
        let device = transport::rdma::verbs::Verbs::device(&verbs).name.clone();
        let config = RdmaConfig {
            chunk_bytes: crate::CHUNK_BYTES,
            ..RdmaConfig::default()
        };
        let rdma = RdmaTransport::start(
            verbs,
            config,
            self.tcp.target_arc(),
            self.tcp.opener(transport::tcp::wire::Purpose::Rdma),
        )
        .map_err(|e| format!("the RDMA engine on {device}: {e}"))?;
        let rdma = std::sync::Arc::new(rdma);
        let weak = std::sync::Arc::downgrade(&rdma);
        self.tcp
            .set_rdma_handler(std::sync::Arc::new(move |stream, bind| {
                if let Some(r) = weak.upgrade() {
                    r.serve_side(stream, bind);
                }
            }));
        self.rdma = Some(rdma);
        Ok(device)
    }

    /// Register the pool with the RDMA engine too (the TCP engine registered it in the shared
    /// table; RDMA adds its local regions).
    ///
    /// # Errors
    /// As [`Transport::register`].
    pub fn register_pool(
        &self,
        pool: std::sync::Arc<dyn transport::engine::Memory>,
        len: u64,
    ) -> Result<()> {
        let _ = (&pool, len);
        #[cfg(feature = "rdma")]
        if let Some(r) = &self.rdma {
            r.register(crate::POOL_SEGMENT, pool, 0, len)?;
        }
        Ok(())
    }

    /// Ops and bytes in flight as initiator, both engines.
    pub fn in_flight(&self) -> (usize, u64) {
        let (o, b) = self.tcp.in_flight();
        #[cfg(feature = "rdma")]
        if let Some(r) = &self.rdma {
            let (ro, rb) = r.in_flight();
            return (o + ro, b + rb);
        }
        (o, b)
    }

    /// The TCP engine (control connections, counters).
    pub fn tcp(&self) -> &TcpTransport {
        &self.tcp
    }

    /// The grant table and segments both engines serve.
    pub fn target(&self) -> &Target {
        self.tcp.target()
    }

    /// The engines' clock.
    pub fn now_ms(&self) -> u64 {
        self.tcp.now_ms()
    }

    /// Add a grant (it serves both engines).
    ///
    /// # Safety
    /// As [`Transport::grant`].
    ///
    /// # Errors
    /// As [`Transport::grant`].
    pub unsafe fn grant(&self, g: Grant) -> transport::Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.tcp.grant(g) }
    }

    /// End a transfer's grants on both engines: once this returns no TCP chunk of it is in
    /// flight and no RDMA key of it works.
    pub fn revoke(&self, transfer: TransferId) -> Revoked {
        #[cfg(feature = "rdma")]
        if let Some(r) = &self.rdma {
            return r.revoke(transfer);
        }
        self.tcp.revoke(transfer)
    }

    /// What `/status` shows.
    pub fn report(&self) -> TransportReport {
        let preferred = if self.rdma_on() { "rdma" } else { "tcp" };
        TransportReport {
            requested: format!("{:?}", self.requested).to_lowercase(),
            preferred: preferred.into(),
            reason: self.reason.clone(),
            peers: self.used.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        }
    }

    /// The choice, for the start-up log line.
    pub fn describe(&self) -> String {
        let r = self.report();
        format!("{} ({})", r.preferred, r.reason)
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
    /// [`Error::Disconnected`] when ops failed, as the engines' errors otherwise.
    pub unsafe fn run_batch(
        &self,
        peer: u64,
        tcp_peer: TcpPeer,
        ops: &[Op],
        checksums: &[Option<u32>],
        timeout: Duration,
    ) -> Result<Vec<Option<u32>>> {
        #[cfg(feature = "rdma")]
        if let Some(r) = &self.rdma {
            let tcp_only = self
                .no_rdma
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&peer)
                .is_some_and(|t| t.elapsed() < REPROBE);
            if !tcp_only {
                // SAFETY: the caller's contract, passed on.
                match unsafe {
                    self.on(&**r, Backend::Rdma, peer, tcp_peer, ops, checksums, timeout)
                } {
                    Err(Error::Unavailable(why)) => {
                        tracing::info!(peer, reason = %why, "the peer serves no RDMA; using TCP");
                        let mut no = self.no_rdma.lock().unwrap_or_else(|p| p.into_inner());
                        if no.len() >= 4096 {
                            no.retain(|_, t| t.elapsed() < REPROBE);
                        }
                        no.insert(peer, std::time::Instant::now());
                    }
                    other => return other,
                }
            }
        }
        // SAFETY: the caller's contract, passed on.
        unsafe {
            self.on(
                &self.tcp,
                Backend::Tcp,
                peer,
                tcp_peer,
                ops,
                checksums,
                timeout,
            )
        }
    }

    /// [`Engines::run_batch`] on one engine. An RDMA endpoint the peer will not open is
    /// answered [`Error::Unavailable`] (the caller falls back to TCP).
    #[allow(clippy::too_many_arguments)]
    unsafe fn on<T: Transport<Peer = TcpPeer>>(
        &self,
        engine: &T,
        backend: Backend,
        peer: u64,
        tcp_peer: TcpPeer,
        ops: &[Op],
        checksums: &[Option<u32>],
        timeout: Duration,
    ) -> Result<Vec<Option<u32>>> {
        let mut reopened = false;
        loop {
            let ep = {
                let mut eps = self.endpoints.lock().unwrap_or_else(|p| p.into_inner());
                match eps.get(&(backend, peer)) {
                    Some(&ep) => ep,
                    None => {
                        let ep = match engine.open(&tcp_peer) {
                            Ok(ep) => ep,
                            #[cfg(feature = "rdma")]
                            Err(e)
                                if backend == Backend::Rdma
                                    && transport::rdma::peer_lacks_rdma(&e) =>
                            {
                                return Err(Error::Unavailable(e.to_string()));
                            }
                            Err(e) => return Err(e.into()),
                        };
                        eps.insert((backend, peer), ep);
                        ep
                    }
                }
            };
            self.note(peer, backend);
            // SAFETY: the caller's contract (run_batch's), passed on; this waits for the batch
            // to settle before returning.
            let submitted = unsafe { engine.submit_with_checksums(ep, ops, checksums) };
            let batch = match submitted {
                Ok(b) => b,
                Err(transport::Error::PeerUnavailable(_)) if !reopened => {
                    self.forget(engine, backend, peer, ep);
                    reopened = true;
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            let mut st = engine.wait(batch, timeout)?;
            if !st.settled {
                // The engine's stall timeout is far shorter; this is only a backstop. Closing
                // the endpoint fails what is left, and the batch settles once the kernel (or
                // the NIC) lets go of its buffers: until then its pages must not be freed.
                self.forget(engine, backend, peer, ep);
                while !st.settled {
                    tracing::warn!(peer, "a transfer batch has not settled; waiting for it");
                    st = engine.wait(batch, timeout)?;
                }
            }
            let mut crcs = vec![None; ops.len()];
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
                self.forget(engine, backend, peer, ep);
            }
            return Err(Error::Disconnected(format!(
                "the transfer with node {peer} failed: {} of {} blocks not delivered ({})",
                st.ops - st.done,
                st.ops,
                st.first_failure
                    .map_or_else(|| "cancelled".to_string(), |f| f.to_string())
            )));
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
