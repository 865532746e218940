//! How a TCP engine runs ([`TcpConfig`]): its node's identity and the members it accepts,
//! its connections, chunks and ring threads, its timeouts and every bound, each with its
//! default, checked once at start.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::auth::ClusterSecret;
use crate::engine::Limits;
use crate::error::{Error, Result};
use crate::grant::GrantLimits;
use crate::link::identity::NodeKey;
use crate::link::members::Members;

/// When to send payloads with `SENDMSG_ZC` (the kernel sends from the segment's pages instead
/// of copying them into socket buffers, and says when it has let go of them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZeroCopy {
    /// Never.
    Off,
    /// Always (where the kernel supports it; otherwise copied sends).
    On,
    /// To peers that are not on loopback: on loopback the kernel copies a zero-copy payload on
    /// delivery anyway, so it costs the notification and saves nothing.
    Auto,
}

/// How a TCP engine runs.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// This node's id (peers check it against what they expect).
    pub node_id: u64,
    /// This node's incarnation (stale descriptors name an older one and are refused).
    pub node_generation: u64,
    /// Where the target side listens (port 0: any).
    pub listen: SocketAddr,
    /// The cluster secret both sides prove they hold.
    pub secret: ClusterSecret,
    /// This node's key pair: its binds are signed with it, so peers know which node it is.
    pub identity: Arc<NodeKey>,
    /// The member nodes' public keys (a peer must prove it is the node it claims) and the
    /// addresses they connect from (the member reserve). The owner keeps it current; empty,
    /// nobody can connect.
    pub members: Arc<Members>,
    /// Put a MAC (the connection's own key, blake3) on every payload this engine's
    /// connections carry, both ways, and check every one that arrives; on any connection whose
    /// other end asks for it too.
    pub payload_mac: bool,
    /// Connections per endpoint.
    pub connections: usize,
    /// Ring threads (each its own io_uring): an endpoint's connections are spread over them,
    /// and so are peers' connections to this target, so that one stream's copies and TCP
    /// work do not wait for another's on the same thread.
    pub lanes: usize,
    /// Largest chunk, in bytes (also the largest a target accepts).
    pub chunk_bytes: u32,
    /// Chunks in flight per connection.
    pub window: usize,
    /// Checksum every chunk (CRC-32C, checked by the receiver).
    pub checksum: bool,
    /// Zero-copy sends.
    pub zero_copy: ZeroCopy,
    /// No progress for this long with work outstanding fails the connection's endpoint.
    pub stall_timeout: Duration,
    /// Connecting plus the handshake, per connection.
    pub connect_timeout: Duration,
    /// Bounds on work in flight.
    pub limits: Limits,
    /// Bounds on grants.
    pub grant_limits: GrantLimits,
    /// Connections peers may hold open to this engine (past it, new ones are closed at once).
    pub max_target_connections: usize,
    /// Handshakes in progress at once, in all (past it, new connections are refused at once).
    pub max_handshakes: usize,
    /// Handshakes in progress at once from one source address: connections that never finish
    /// their handshake cannot take the slots of peers connecting from elsewhere.
    pub max_handshakes_per_source: usize,
    /// Of `max_handshakes`, the slots kept for connections from members' addresses
    /// ([`Members::is_member_addr`]): strangers, from however many addresses, fill the rest
    /// only, so a (re)starting member always finds a slot.
    pub member_handshakes: usize,
    /// Connections of one purpose (data, control, RDMA side) one authenticated peer may hold
    /// open here: a node with the secret that idles connections cannot take another's slots.
    pub max_connections_per_peer: usize,
}

/// Data connections an endpoint opens to a peer unless configured otherwise.
pub const DEFAULT_CONNECTIONS: usize = 2;

/// Ring threads an engine runs unless configured otherwise: one per default connection, so
/// that the two streams of an endpoint (and two peers' streams into this target) copy on two
/// cores, as two plain blocking senders would.
pub const DEFAULT_LANES: usize = DEFAULT_CONNECTIONS;

/// The most ring threads an engine runs.
pub const MAX_LANES: usize = 16;

/// Handshakes in progress at once unless configured otherwise.
pub const DEFAULT_MAX_HANDSHAKES: usize = 64;

/// Of them, the slots kept for members' addresses unless configured otherwise: a quarter,
/// room for four restarting members' endpoints and control connections at once.
pub const DEFAULT_MEMBER_HANDSHAKES: usize = 16;

impl TcpConfig {
    /// Defaults for node `node_id` with key pair `identity`, listening on `listen`; no member
    /// is known yet (fill [`TcpConfig::members`]).
    pub fn new(
        node_id: u64,
        node_generation: u64,
        listen: SocketAddr,
        secret: ClusterSecret,
        identity: Arc<NodeKey>,
    ) -> TcpConfig {
        TcpConfig {
            node_id,
            node_generation,
            listen,
            secret,
            identity,
            members: Members::new(),
            payload_mac: false,
            connections: DEFAULT_CONNECTIONS,
            lanes: DEFAULT_LANES,
            chunk_bytes: 1 << 20,
            window: 8,
            checksum: true,
            zero_copy: ZeroCopy::Auto,
            stall_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(2),
            limits: Limits::default(),
            grant_limits: GrantLimits::default(),
            max_target_connections: 256,
            max_handshakes: DEFAULT_MAX_HANDSHAKES,
            max_handshakes_per_source: 4,
            member_handshakes: DEFAULT_MEMBER_HANDSHAKES,
            max_connections_per_peer: 16,
        }
    }

    pub(super) fn check(&self) -> Result<()> {
        let bad = |what: &str| Err(Error::InvalidArgument(what.to_string()));
        if self.connections == 0 || self.connections > 16 {
            return bad("connections per endpoint: 1 to 16");
        }
        if self.lanes == 0 || self.lanes > MAX_LANES {
            return bad("ring threads (lanes): 1 to 16");
        }
        if self.chunk_bytes < 4096 || self.chunk_bytes > (16 << 20) {
            return bad("chunk bytes: 4 KiB to 16 MiB");
        }
        if self.window == 0 || self.window > 64 {
            return bad("chunks in flight per connection: 1 to 64");
        }
        if self.stall_timeout < Duration::from_millis(10) {
            return bad("stall timeout: at least 10 ms");
        }
        if self.max_handshakes == 0 || self.max_handshakes_per_source == 0 {
            return bad("handshakes at once, in all and per source: at least 1");
        }
        if self.member_handshakes >= self.max_handshakes {
            return bad("handshake slots kept for members: fewer than the handshakes in all");
        }
        if self.max_connections_per_peer < self.connections {
            return bad("connections per peer: at least the connections of one endpoint");
        }
        Ok(())
    }
}
