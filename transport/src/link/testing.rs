//! Node keys and member tables for tests, tools and benchmarks that run engines of their own
//! (two nodes in one process, a bench's target process, a test posing as a node), and a
//! handshake done by hand as an insider would ([`bind_by_hand`]). Never for a deployment: these
//! keys are derived from the node id, so anyone can make them; a daemon's key is random and
//! lives in its data directory.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use super::identity::{NodeKey, PublicKey, SIGNATURE_BYTES};
use super::members::{Member, Members};
use super::wire::{Bind, Purpose, Refusal};
use crate::auth::{Challenge, ClusterSecret, Initiator, Role, Sealer, Session};
use crate::tcp::TcpConfig;

/// Node `node`'s test key: the same in every process, different for every node id.
pub fn node_key(node: u64) -> Arc<NodeKey> {
    let mut h = blake3::Hasher::new();
    h.update(b"kvd test node key v1");
    h.update(&node.to_le_bytes());
    Arc::new(NodeKey::from_seed(h.finalize().as_bytes()).expect("a 32-byte seed"))
}

/// Node `node`'s test key's public half.
pub fn public_key(node: u64) -> PublicKey {
    node_key(node).public()
}

/// The members `nodes` with their test keys (no member addresses), as a table is replaced.
pub fn member_table(nodes: &[u64]) -> BTreeMap<u64, Member> {
    nodes
        .iter()
        .map(|&n| {
            (
                n,
                Member {
                    key: public_key(n),
                    addr: None,
                },
            )
        })
        .collect()
}

/// A member table of `nodes` with their test keys (no member addresses).
pub fn members(nodes: &[u64]) -> Arc<Members> {
    Members::of(member_table(nodes))
}

/// A TCP engine's settings for node `node` in incarnation `generation`, on any loopback
/// port, with its test key and a member table of `nodes` (their test keys).
pub fn tcp_config(node: u64, generation: u64, secret: ClusterSecret, nodes: &[u64]) -> TcpConfig {
    let listen: SocketAddr = ([127, 0, 0, 1], 0).into();
    let mut c = TcpConfig::new(node, generation, listen, secret, node_key(node));
    c.members = members(nodes);
    c
}

/// What an insider holding the cluster secret can do by hand at the data port `to`: a real
/// handshake, then, in the bind's place, whatever `frame` makes of the session and this end's
/// sealer. The responder's answer: `Some` refusal, or `None` for a bind (it took the
/// connection).
///
/// # Errors
/// When the connection fails, or the responder closes it without an answer (an answer whose
/// tag does not check is `InvalidData`).
pub fn bind_by_hand(
    secret: &ClusterSecret,
    to: SocketAddr,
    frame: impl FnOnce(&Session, &mut Sealer) -> [u8; Bind::WIRE_BYTES],
) -> std::io::Result<Option<Refusal>> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(to)?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
    let bad = |e: crate::Error| std::io::Error::new(std::io::ErrorKind::InvalidData, e);
    let (me, hello) = Initiator::start(secret).map_err(bad)?;
    s.write_all(&hello.encode())?;
    let mut c = [0u8; Challenge::WIRE_BYTES];
    s.read_exact(&mut c)?;
    let (proof, session) = me.respond(&Challenge::decode(&c)).map_err(bad)?;
    let (mut seal, mut unseal) = session.key.split(Role::Initiator);
    s.write_all(&proof.0)?;
    s.write_all(&frame(&session, &mut seal))?;
    let mut answer = [0u8; Bind::WIRE_BYTES];
    s.read_exact(&mut answer)?;
    unseal.open(&answer).map_err(bad)?;
    Ok(Refusal::decode(&answer))
}

/// For [`bind_by_hand`]: a control bind claiming node `claims` in incarnation `generation`,
/// addressed to node `to_node`, carrying the signature `sign` makes of the session and the
/// bind's body, tagged with the connection's own key: an insider posing as a node.
pub fn claim(
    claims: u64,
    to_node: u64,
    generation: u64,
    sign: impl FnOnce(&Session, &[u8]) -> [u8; SIGNATURE_BYTES],
) -> impl FnOnce(&Session, &mut Sealer) -> [u8; Bind::WIRE_BYTES] {
    move |session, seal| {
        let mut b = Bind {
            node_id: claims,
            node_generation: generation,
            purpose: Purpose::Control,
            payload_mac: false,
            to_node,
        }
        .encode();
        let sig = sign(session, &b[..Bind::BODY_BYTES]);
        b[Bind::SIGNATURE].copy_from_slice(&sig);
        seal.seal(&mut b);
        b
    }
}
