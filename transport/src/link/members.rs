//! Who the members are: each member node's public key (what its handshake must prove), and
//! the addresses members connect from (what the handshake slots' member reserve admits). The
//! owner fills it from where membership lives (the daemon: the static peer list, and etcd's
//! registrations in cluster mode) and replaces it whole at every change; the handshake and the
//! listener read it. A node that is not in it cannot connect here, and this node does not
//! connect to it: removing a node's key is revoking it.
//!
//! Bounded: at most [`MAX_MEMBERS`] nodes; a larger table is refused whole and changes
//! nothing.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::IpAddr;
use std::sync::{Arc, PoisonError, RwLock};

use super::identity::PublicKey;
use crate::error::{Error, Result};

/// The most member nodes a table holds.
pub const MAX_MEMBERS: usize = 4096;

/// One member as the table knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    /// The key its handshakes must be signed with.
    pub key: PublicKey,
    /// The address it connects from (its data address's IP), where known.
    pub addr: Option<IpAddr>,
}

#[derive(Debug, Default)]
struct Table {
    keys: HashMap<u64, PublicKey>,
    addrs: HashSet<IpAddr>,
}

/// Called when a bind names a node the table does not know, before it is refused: the owner
/// may look again where membership lives (a peer list file that just changed).
pub type OnMiss = Box<dyn Fn() + Send + Sync>;

/// The member table, shared by the owner (who replaces it) and the TCP engine (which reads it
/// at every handshake).
#[derive(Default)]
pub struct Members {
    table: RwLock<Table>,
    on_miss: RwLock<Option<OnMiss>>,
}

impl std::fmt::Debug for Members {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = self.table.read().unwrap_or_else(PoisonError::into_inner);
        f.debug_struct("Members")
            .field("nodes", &t.keys.len())
            .field("addrs", &t.addrs.len())
            .finish_non_exhaustive()
    }
}

impl Members {
    /// An empty table (nobody may connect until it is filled).
    pub fn new() -> Arc<Members> {
        Arc::new(Members::default())
    }

    /// A table of `members` (node id → member), for tests and tools.
    ///
    /// # Panics
    /// Past [`MAX_MEMBERS`].
    pub fn of(members: impl IntoIterator<Item = (u64, Member)>) -> Arc<Members> {
        let m = Members::new();
        m.replace(&members.into_iter().collect())
            .expect("within the bound");
        m
    }

    /// Replace the table with `members`; the nodes whose key went away or changed (their
    /// open connections speak for a key no longer trusted).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] past [`MAX_MEMBERS`] (nothing changes).
    pub fn replace(&self, members: &BTreeMap<u64, Member>) -> Result<Vec<u64>> {
        if members.len() > MAX_MEMBERS {
            return Err(Error::InvalidArgument(format!(
                "{} member nodes; at most {MAX_MEMBERS}",
                members.len()
            )));
        }
        let next = Table {
            keys: members.iter().map(|(n, m)| (*n, m.key)).collect(),
            addrs: members.values().filter_map(|m| m.addr).collect(),
        };
        let mut t = self.table.write().unwrap_or_else(PoisonError::into_inner);
        let mut gone: Vec<u64> = t
            .keys
            .iter()
            .filter(|(n, k)| next.keys.get(n) != Some(k))
            .map(|(n, _)| *n)
            .collect();
        gone.sort_unstable();
        *t = next;
        Ok(gone)
    }

    /// Look again where membership lives before a node is refused as unknown.
    pub fn set_on_miss(&self, f: OnMiss) {
        *self.on_miss.write().unwrap_or_else(PoisonError::into_inner) = Some(f);
    }

    /// Node `node`'s key, if it is a member.
    pub fn key_of(&self, node: u64) -> Option<PublicKey> {
        let known = |m: &Members| {
            m.table
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .keys
                .get(&node)
                .copied()
        };
        known(self).or_else(|| {
            if let Some(f) = self
                .on_miss
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .as_ref()
            {
                f();
            }
            known(self)
        })
    }

    /// Whether `addr` is an address members connect from.
    pub fn is_member_addr(&self, addr: IpAddr) -> bool {
        self.table
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .addrs
            .contains(&addr)
    }

    /// Member nodes now.
    pub fn len(&self) -> usize {
        self.table
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .keys
            .len()
    }

    /// Whether no node is a member.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> PublicKey {
        PublicKey([b; 32])
    }

    #[test]
    fn a_replaced_table_names_the_nodes_whose_key_went_or_changed() {
        let m = Members::new();
        let ip = |s: &str| Some(s.parse::<IpAddr>().unwrap());
        let first: BTreeMap<u64, Member> = [
            (
                1,
                Member {
                    key: key(1),
                    addr: ip("10.0.0.1"),
                },
            ),
            (
                2,
                Member {
                    key: key(2),
                    addr: ip("10.0.0.2"),
                },
            ),
            (
                3,
                Member {
                    key: key(3),
                    addr: None,
                },
            ),
        ]
        .into();
        assert!(m.replace(&first).unwrap().is_empty());
        assert_eq!(m.key_of(2), Some(key(2)));
        assert!(m.is_member_addr("10.0.0.1".parse().unwrap()));
        assert!(!m.is_member_addr("10.0.0.3".parse().unwrap()));
        let mut second = first.clone();
        second.remove(&1);
        second.get_mut(&2).unwrap().key = key(9);
        second.insert(
            4,
            Member {
                key: key(4),
                addr: None,
            },
        );
        assert_eq!(m.replace(&second).unwrap(), vec![1, 2]);
        assert_eq!((m.key_of(1), m.key_of(2)), (None, Some(key(9))));
        assert!(!m.is_member_addr("10.0.0.1".parse().unwrap()));
        assert_eq!(m.len(), 3);
    }

    #[test]
    fn a_table_past_the_bound_is_refused_and_changes_nothing() {
        let m = Members::of([(
            1,
            Member {
                key: key(1),
                addr: None,
            },
        )]);
        let big: BTreeMap<u64, Member> = (0..=MAX_MEMBERS as u64)
            .map(|n| {
                (
                    n,
                    Member {
                        key: key(2),
                        addr: None,
                    },
                )
            })
            .collect();
        assert!(m.replace(&big).is_err());
        assert_eq!((m.len(), m.key_of(1)), (1, Some(key(1))));
    }

    #[test]
    fn an_unknown_node_makes_the_owner_look_again_once() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let m = Members::new();
        let looked = Arc::new(AtomicUsize::new(0));
        let (l, weak) = (looked.clone(), Arc::downgrade(&m));
        m.set_on_miss(Box::new(move || {
            l.fetch_add(1, Ordering::Relaxed);
            if let Some(m) = weak.upgrade() {
                let _ = m.replace(
                    &[(
                        5,
                        Member {
                            key: key(5),
                            addr: None,
                        },
                    )]
                    .into(),
                );
            }
        }));
        assert_eq!(m.key_of(5), Some(key(5)), "found on the second look");
        assert_eq!(m.key_of(5), Some(key(5)));
        assert_eq!(m.key_of(6), None);
        assert_eq!(looked.load(Ordering::Relaxed), 2, "only misses look again");
    }
}
