//! The peer table: where each peer's data port is and the key its handshakes must prove. It
//! is made of three sources, later ones winning for the same node: the `--peer` entries, the
//! `--peers-file` (re-read when it changes), and cluster membership (etcd's registrations).
//! The data port pushes the merged table to the transfers it starts (addresses) and to the
//! transport's member table (keys, and the addresses the member reserve admits); a node that
//! is in none of them, or whose key is missing or revoked, can neither connect here nor be
//! connected to.
//!
//! An entry, on the command line or as a line of the peers file:
//!
//! ```text
//! NODE_ID=ADDR,key=PUBLIC_KEY        2=10.0.0.2:7461,key=3b6a27bc…(64 hex digits)
//! ```
//!
//! `kvd key show` prints a node's public key. The peers file holds one entry per line (blank
//! lines and lines starting with `#` are skipped) and may be the same file on every node: a
//! node skips its own line (and warns if its key there is not its own). Revoking a node in a
//! static cluster is deleting its line: every daemon sees the change within a second (or at
//! once, when a node it does not know tries to connect) and closes that node's connections.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use transport::link::identity::PublicKey;
use transport::link::members::{MAX_MEMBERS, Member};

use crate::{Error, Result};

/// Bytes a peers file holds at most (read whole at every change).
pub const MAX_PEERS_FILE_BYTES: u64 = 1 << 20;

/// A peer as the table knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    /// Its data port.
    pub addr: SocketAddr,
    /// The key its handshakes must prove; `None` where none is usable (a registration without
    /// one, or with a revoked one): then it cannot be authenticated.
    pub key: Option<PublicKey>,
}

/// Parse one entry, `NODE_ID=ADDR,key=PUBLIC_KEY`.
///
/// # Errors
/// [`Error::InvalidArgument`] saying what is wrong and how an entry reads.
pub fn parse_entry(entry: &str) -> Result<(u64, Peer)> {
    let bad = |why: &str| {
        Error::InvalidArgument(format!(
            "peer {entry:?}: {why}; write it as NODE_ID=ADDR,key=PUBLIC_KEY, for example \
             2=10.0.0.2:7461,key=<node 2's `kvd key show`>"
        ))
    };
    let (id, rest) = entry.split_once('=').ok_or_else(|| bad("no '='"))?;
    let id: u64 = id
        .trim()
        .parse()
        .map_err(|_| bad("the node id is not a number"))?;
    let (addr, key) = rest
        .split_once(',')
        .ok_or_else(|| bad("no key (every peer must be known by its public key)"))?;
    let addr: SocketAddr = addr
        .trim()
        .parse()
        .map_err(|_| bad("the address is not IP:PORT"))?;
    let key = key
        .trim()
        .strip_prefix("key=")
        .ok_or_else(|| bad("what follows the address is not key=..."))?;
    let key: PublicKey = key
        .parse()
        .map_err(|e: transport::Error| bad(&e.to_string()))?;
    Ok((
        id,
        Peer {
            addr,
            key: Some(key),
        },
    ))
}

/// Parse `--peer` entries into a table; `me` may not appear in it, nor any node twice.
///
/// # Errors
/// As [`parse_entry`], and for this node's own id or an id given twice.
pub fn parse_list(entries: &[String], me: u64) -> Result<BTreeMap<u64, Peer>> {
    let mut peers = BTreeMap::new();
    for e in entries {
        let (id, peer) = parse_entry(e)?;
        if id == me {
            return Err(Error::InvalidArgument(format!(
                "peer {e:?}: that is this node's own id (--node-id)"
            )));
        }
        if peers.insert(id, peer).is_some() {
            return Err(Error::InvalidArgument(format!(
                "peer {e:?}: node {id} given twice"
            )));
        }
    }
    if peers.len() > MAX_MEMBERS {
        return Err(Error::InvalidArgument(format!(
            "{} peers; at most {MAX_MEMBERS}",
            peers.len()
        )));
    }
    Ok(peers)
}

/// What identifies one version of a file: its inode, size and modification time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    inode: u64,
    len: u64,
    modified_ns: i128,
}

fn stamp(path: &Path) -> std::io::Result<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path)?;
    Ok(Stamp {
        inode: m.ino(),
        len: m.len(),
        modified_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
    })
}

/// The peers file, as last read.
#[derive(Debug)]
pub struct PeersFile {
    path: PathBuf,
    /// The version last read.
    seen: Option<Stamp>,
    /// The version last found broken (not read again until it changes).
    broken: Option<Stamp>,
    entries: BTreeMap<u64, Peer>,
}

impl PeersFile {
    /// Read the file at `path` for node `me`, whose own key is `own` where it has one (its
    /// line is skipped, and checked against it).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a missing, unreadable, oversized or malformed file.
    pub fn load(path: &Path, me: u64, own: Option<&PublicKey>) -> Result<PeersFile> {
        let mut f = PeersFile {
            path: path.to_owned(),
            seen: None,
            broken: None,
            entries: BTreeMap::new(),
        };
        f.reload(me, own)?;
        Ok(f)
    }

    /// The entries as last read.
    pub fn entries(&self) -> &BTreeMap<u64, Peer> {
        &self.entries
    }

    /// Read the file again if it changed since it was last read; whether it did. A file that
    /// fails to parse changes nothing (the entries last read stay).
    ///
    /// # Errors
    /// As [`PeersFile::load`].
    pub fn reload(&mut self, me: u64, own: Option<&PublicKey>) -> Result<bool> {
        let shown = self.path.display();
        let now = stamp(&self.path)
            .map_err(|e| Error::InvalidArgument(format!("peers file {shown}: {e}")))?;
        if self.seen == Some(now) || self.broken == Some(now) {
            return Ok(false);
        }
        let read = || {
            if now.len > MAX_PEERS_FILE_BYTES {
                return Err(Error::InvalidArgument(format!(
                    "{} bytes; at most {MAX_PEERS_FILE_BYTES}",
                    now.len
                )));
            }
            let text = std::fs::read_to_string(&self.path)
                .map_err(|e| Error::InvalidArgument(e.to_string()))?;
            parse_file(&text, me, own)
        };
        match read() {
            Ok(entries) => {
                self.entries = entries;
                self.seen = Some(now);
                self.broken = None;
                Ok(true)
            }
            Err(e) => {
                self.broken = Some(now);
                Err(Error::InvalidArgument(format!("peers file {shown}: {e}")))
            }
        }
    }
}

/// The entries of a peers file's text (this node's own line skipped).
fn parse_file(text: &str, me: u64, own: Option<&PublicKey>) -> Result<BTreeMap<u64, Peer>> {
    let mut peers = BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let at = |e: Error| Error::InvalidArgument(format!("line {}: {e}", n + 1));
        let (id, peer) = parse_entry(line).map_err(at)?;
        if id == me {
            if own.is_some_and(|k| peer.key != Some(*k)) {
                tracing::warn!(
                    line = n + 1,
                    "the peers file's line for this node does not hold this node's key: \
                     the other nodes will refuse it (`kvd key show` prints the right one)"
                );
            }
            continue;
        }
        if peers.insert(id, peer).is_some() {
            return Err(at(Error::InvalidArgument(format!("node {id} given twice"))));
        }
        if peers.len() > MAX_MEMBERS {
            return Err(Error::InvalidArgument(format!(
                "more than {MAX_MEMBERS} peers"
            )));
        }
    }
    Ok(peers)
}

/// A peer table as `--check-config` shows it: node id → `ADDR,key=PUBLIC_KEY`.
///
/// # Errors
/// As the serializer's.
pub fn serialize_table<S: serde::Serializer>(
    peers: &BTreeMap<u64, Peer>,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let mut m = s.serialize_map(Some(peers.len()))?;
    for (id, p) in peers {
        let key = p.key.map_or_else(|| "none".to_string(), |k| k.to_string());
        m.serialize_entry(id, &format!("{},key={key}", p.addr))?;
    }
    m.end()
}

/// The members a peer table gives the transport: every peer with a usable key, and the
/// address it connects from (its data address's, unless that is unspecified).
pub fn members_of(peers: &BTreeMap<u64, Peer>) -> BTreeMap<u64, Member> {
    peers
        .iter()
        .filter_map(|(id, p)| {
            p.key.map(|key| {
                let ip = p.addr.ip();
                (
                    *id,
                    Member {
                        key,
                        addr: (!ip.is_unspecified()).then_some(ip),
                    },
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u64) -> PublicKey {
        transport::link::testing::public_key(n)
    }

    #[test]
    fn an_entry_names_a_node_its_address_and_its_key() {
        let k = key(2);
        let (id, p) = parse_entry(&format!("2=10.0.0.2:7461,key={k}")).unwrap();
        assert_eq!(
            (id, p.addr.to_string(), p.key),
            (2, "10.0.0.2:7461".into(), Some(k))
        );
        for bad in [
            "2=10.0.0.2:7461".to_string(),
            format!("x=10.0.0.2:7461,key={k}"),
            format!("2=10.0.0.2,key={k}"),
            format!("2=10.0.0.2:7461,{k}"),
            "2=10.0.0.2:7461,key=abc".to_string(),
            "nothing".to_string(),
        ] {
            let e = parse_entry(&bad).unwrap_err().to_string();
            assert!(e.contains("NODE_ID=ADDR,key=PUBLIC_KEY"), "{bad}: {e}");
        }
    }

    #[test]
    fn a_list_refuses_this_node_and_a_node_twice() {
        let e = |id: u64| format!("{id}=10.0.0.{id}:7461,key={}", key(id));
        assert_eq!(parse_list(&[e(2), e(3)], 1).unwrap().len(), 2);
        assert!(
            parse_list(&[e(1)], 1)
                .unwrap_err()
                .to_string()
                .contains("own id")
        );
        assert!(
            parse_list(&[e(2), e(2)], 1)
                .unwrap_err()
                .to_string()
                .contains("twice")
        );
    }

    #[test]
    fn the_file_skips_comments_and_this_nodes_line_and_is_read_again_only_when_it_changes() {
        let dir = std::env::temp_dir().join(format!("kvd-peers-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("peers");
        let line = |id: u64| format!("{id}=127.0.0.{id}:7461,key={}\n", key(id));
        std::fs::write(
            &path,
            format!("# the cluster\n\n{}{}{}", line(1), line(2), line(3)),
        )
        .unwrap();
        let mut f = PeersFile::load(&path, 1, Some(&key(1))).unwrap();
        assert_eq!(f.entries().keys().copied().collect::<Vec<_>>(), [2, 3]);
        assert!(!f.reload(1, Some(&key(1))).unwrap(), "unchanged");
        // node 3 removed (revoked): the next look sees it
        std::fs::write(&path, format!("{}{}", line(1), line(2))).unwrap();
        assert!(f.reload(1, Some(&key(1))).unwrap());
        assert_eq!(f.entries().keys().copied().collect::<Vec<_>>(), [2]);
        // a broken file changes nothing, and is reported once
        std::fs::write(&path, "2=nonsense\n").unwrap();
        let e = f.reload(1, Some(&key(1))).unwrap_err();
        assert!(e.to_string().contains("line 1"), "{e}");
        assert_eq!(f.entries().keys().copied().collect::<Vec<_>>(), [2]);
        assert!(!f.reload(1, Some(&key(1))).unwrap());
        let members = members_of(f.entries());
        assert_eq!(members[&2].addr, Some("127.0.0.2".parse().unwrap()));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn only_peers_with_a_key_are_members_and_an_unspecified_address_is_none() {
        let peers: BTreeMap<u64, Peer> = [
            (
                2,
                Peer {
                    addr: "0.0.0.0:7461".parse().unwrap(),
                    key: Some(key(2)),
                },
            ),
            (
                3,
                Peer {
                    addr: "10.0.0.3:7461".parse().unwrap(),
                    key: None,
                },
            ),
        ]
        .into();
        let m = members_of(&peers);
        assert_eq!(m.len(), 1);
        assert_eq!(m[&2].addr, None);
    }
}
