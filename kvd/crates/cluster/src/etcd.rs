//! The few etcd calls kvd makes, over `etcd-client`, so that no other crate names its types:
//! connect with the cluster's credentials, read and write one key, and follow the nodes'
//! registrations (one full read, then a watch from just after its revision).

use std::time::Duration;

use crate::view::Registration;
use crate::{Error, EtcdSecurity, Result};

/// An etcd error as kvd reports it: unavailable (retry), with what was being done.
pub(crate) fn etcd_err(what: &str, e: etcd_client::Error) -> Error {
    Error::Unavailable(format!("etcd {what}: {e}"))
}

/// The key of node `id`'s registration under the cluster's `prefix` (zero-padded so that
/// keys sort by id).
pub(crate) fn node_key(prefix: &str, id: u64) -> String {
    format!("{prefix}/nodes/{id:020}")
}

/// A connection to the cluster's etcd.
#[derive(Clone)]
pub struct Etcd {
    pub(crate) client: etcd_client::Client,
}

impl std::fmt::Debug for Etcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Etcd").finish_non_exhaustive()
    }
}

impl Etcd {
    /// Connect to `endpoints` with `security`; `timeout` bounds the connect and every call.
    ///
    /// # Errors
    /// [`Error::Unavailable`] when no endpoint answers in time.
    pub async fn connect(
        endpoints: &[String],
        security: &EtcdSecurity,
        timeout: Duration,
    ) -> Result<Etcd> {
        let client =
            etcd_client::Client::connect(endpoints, Some(security.connect_options(timeout)))
                .await
                .map_err(|e| etcd_err("connect", e))?;
        Ok(Etcd { client })
    }

    /// The value at `key`, if there is one.
    ///
    /// # Errors
    /// [`Error::Unavailable`] when etcd does not answer.
    pub async fn get(&mut self, key: &str) -> Result<Option<Vec<u8>>> {
        let r = self
            .client
            .get(key, None)
            .await
            .map_err(|e| etcd_err(&format!("read {key}"), e))?;
        Ok(r.kvs().first().map(|kv| kv.value().to_vec()))
    }

    /// Write `value` at `key` (no lease: it stays until overwritten).
    ///
    /// # Errors
    /// [`Error::Unavailable`] when etcd does not answer.
    pub async fn put(&mut self, key: &str, value: Vec<u8>) -> Result<()> {
        self.client
            .put(key, value, None)
            .await
            .map_err(|e| etcd_err(&format!("write {key}"), e))?;
        Ok(())
    }

    /// The registrations under the cluster's `prefix` as one read, with its revision, and a
    /// watch of them from just after it (so that no change falls between the two).
    ///
    /// # Errors
    /// [`Error::Unavailable`] when etcd does not answer.
    pub async fn watch_nodes(&mut self, prefix: &str) -> Result<(Vec<Registration>, NodeWatch)> {
        use etcd_client::{GetOptions, WatchOptions};
        let nodes_prefix = format!("{prefix}/nodes/");
        let all = self
            .client
            .get(nodes_prefix.as_str(), Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| etcd_err("read the nodes", e))?;
        let revision = all.header().map_or(0, |h| h.revision());
        let nodes = all
            .kvs()
            .iter()
            .filter_map(|kv| serde_json::from_slice::<Registration>(kv.value()).ok())
            .collect();
        let (watcher, events) = self
            .client
            .watch(
                nodes_prefix.as_str(),
                Some(
                    WatchOptions::new()
                        .with_prefix()
                        .with_start_revision(revision + 1),
                ),
            )
            .await
            .map_err(|e| etcd_err("watch", e))?;
        Ok((
            nodes,
            NodeWatch {
                revision,
                _watcher: watcher,
                events,
            },
        ))
    }
}

/// A change to the registrations, as a watch reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeChange {
    /// A node registered or refreshed its registration.
    Registered(Registration),
    /// A node's registration is gone (withdrawn, or its lease ran out).
    Withdrawn(u64),
}

/// The watch of the nodes' registrations that [`Etcd::watch_nodes`] started.
pub struct NodeWatch {
    /// The revision the read was at (then: of the last message).
    pub revision: i64,
    _watcher: etcd_client::Watcher,
    events: etcd_client::WatchStream,
}

impl std::fmt::Debug for NodeWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeWatch")
            .field("revision", &self.revision)
            .finish_non_exhaustive()
    }
}

impl NodeWatch {
    /// The next message's changes (keys or values that are not a registration are skipped);
    /// [`NodeWatch::revision`] is then the message's.
    ///
    /// # Errors
    /// [`Error::Unavailable`] when the watch failed, ended or was cancelled (start anew with
    /// a full read).
    pub async fn next(&mut self) -> Result<Vec<NodeChange>> {
        let w = match self.events.message().await {
            Ok(Some(w)) => w,
            Ok(None) => return Err(Error::Unavailable("the watch ended".into())),
            Err(e) => return Err(etcd_err("watch", e)),
        };
        if w.canceled() {
            return Err(Error::Unavailable("etcd cancelled the watch".into()));
        }
        self.revision = w.header().map_or(self.revision, |h| h.revision());
        Ok(w.events()
            .iter()
            .filter_map(|e| {
                let kv = e.kv()?;
                match e.event_type() {
                    etcd_client::EventType::Put => serde_json::from_slice(kv.value())
                        .ok()
                        .map(NodeChange::Registered),
                    etcd_client::EventType::Delete => std::str::from_utf8(kv.key())
                        .ok()
                        .and_then(|k| k.rsplit('/').next())
                        .and_then(|n| n.parse::<u64>().ok())
                        .map(NodeChange::Withdrawn),
                }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_keys_sort_by_id() {
        assert!(node_key("/kvd", 9) < node_key("/kvd", 10));
        assert_eq!(node_key("/kvd", 7), "/kvd/nodes/00000000000000000007");
    }
}
