//! Who a peer is and how a connection to it starts, for every backend: a peer's address and
//! the node id it must prove ([`PeerAddr`]), each node's key pair ([`identity`]) and the
//! member nodes' public keys and addresses ([`members`]), the handshake (authentication over
//! the cluster secret, then one [`wire::Bind`] each way, signed with the sender's node key:
//! [`handshake`]), and the handler and opener types by which backends and the data port hand
//! authenticated connections around. No backend
//! depends on another: TCP owns the data port socket and its listener, RDMA opens its side
//! channel through an [`Opener`], and both name peers by [`PeerAddr`].

pub mod handshake;
pub mod identity;
pub mod members;
pub mod testing;
pub mod wire;

use std::net::SocketAddr;
use std::sync::Arc;

use crate::channel::Channel;
use crate::error::Result;

/// A peer to open an endpoint or a connection to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerAddr {
    /// Its data address.
    pub addr: SocketAddr,
    /// The node id it must prove (by its bind's signature, against that node's key among the
    /// members) it is.
    pub node_id: u64,
}

/// What takes the connections of one purpose peers open to this node (already
/// authenticated; the [`wire::Bind`] says who the peer is). It runs on the connection's
/// handshake thread and should hand the channel on quickly.
pub type Handler = Arc<dyn Fn(Channel, wire::Bind) + Send + Sync>;

/// Opens authenticated connections of one purpose to peers.
pub type Opener = Arc<dyn Fn(&PeerAddr) -> Result<(Channel, wire::Bind)> + Send + Sync>;
