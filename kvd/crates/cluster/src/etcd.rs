//! The few etcd calls kvd makes, over `etcd-client`, so that no other crate names its types:
//! connect with the cluster's credentials, read and write one key, follow the nodes'
//! registrations and the revoked node keys (each one full read, then a watch from just after
//! its revision), and revoke a key.
//!
//! ```text
//!  <prefix>/nodes/<node id, 20 digits>   a node's registration (JSON), under its lease
//!  <prefix>/revoked/<public key, hex>    a revoked node key (JSON: the node, when); no lease
//! ```

use std::collections::BTreeSet;
use std::time::Duration;

use transport::link::identity::PublicKey;

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

/// The key under which `key` is revoked in the cluster under `prefix`.
pub(crate) fn revoked_key(prefix: &str, key: &PublicKey) -> String {
    format!("{prefix}/revoked/{key}")
}

/// A revocation as `kvd key revoke` writes it (for people reading etcd; the key is what
/// counts).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Revocation {
    /// The node whose key it was, where known.
    node_id: Option<u64>,
    /// When, seconds since the Unix epoch.
    revoked_at_s: u64,
}

/// A lease this process holds (see [`Etcd::lease`]).
pub struct Lease {
    id: i64,
    keeper: etcd_client::LeaseKeeper,
    answers: etcd_client::LeaseKeepAliveStream,
    ttl: Duration,
    answered: std::time::Instant,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl Lease {
    /// Its id, for [`Etcd::put_leased`] and [`Etcd::create_leased`].
    pub fn id(&self) -> i64 {
        self.id
    }

    /// Keep it alive once (call every third of its TTL): a keep-alive and its answer, waited
    /// for at most a third of the TTL.
    ///
    /// # Errors
    /// [`Error::Unavailable`] once etcd says it is gone, or nothing answered for a whole TTL
    /// (it may be gone: whatever it fenced is no longer this process's).
    pub async fn beat(&mut self) -> Result<()> {
        let wait = self.ttl / 3;
        let answer = tokio::time::timeout(wait, async {
            self.keeper
                .keep_alive()
                .await
                .map_err(|e| etcd_err("keep-alive", e))?;
            self.answers
                .message()
                .await
                .map_err(|e| etcd_err("keep-alive", e))
        })
        .await;
        match answer {
            Ok(Ok(Some(a))) if a.ttl() > 0 => {
                self.answered = std::time::Instant::now();
                Ok(())
            }
            Ok(Ok(Some(_))) => Err(Error::Unavailable("etcd says the lease is gone".into())),
            Ok(Ok(None)) => Err(Error::Unavailable("the keep-alive stream ended".into())),
            Ok(Err(e)) => Err(e),
            Err(_) if self.answered.elapsed() < self.ttl => Ok(()),
            Err(_) => Err(Error::Unavailable(format!(
                "no keep-alive answer from etcd for {} ms (the lease's TTL)",
                self.answered.elapsed().as_millis()
            ))),
        }
    }
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

    /// A lease of `ttl_ms` (rounded up to whole seconds), kept alive by [`Lease::beat`].
    ///
    /// # Errors
    /// [`Error::Unavailable`] when etcd does not answer.
    pub async fn lease(&mut self, ttl_ms: u64) -> Result<Lease> {
        let ttl_s = ttl_ms.div_ceil(1000).max(1) as i64;
        let id = self
            .client
            .lease_grant(ttl_s, None)
            .await
            .map_err(|e| etcd_err("lease grant", e))?
            .id();
        let (keeper, answers) = self
            .client
            .lease_keep_alive(id)
            .await
            .map_err(|e| etcd_err("keep-alive", e))?;
        Ok(Lease {
            id,
            keeper,
            answers,
            ttl: Duration::from_millis(ttl_ms),
            answered: std::time::Instant::now(),
        })
    }

    /// Write `value` at `key` under lease `lease` ([`Lease::id`]; it goes when the lease ends).
    ///
    /// # Errors
    /// [`Error::Unavailable`] when etcd does not answer.
    pub async fn put_leased(&mut self, key: &str, value: Vec<u8>, lease: i64) -> Result<()> {
        self.client
            .put(
                key,
                value,
                Some(etcd_client::PutOptions::new().with_lease(lease)),
            )
            .await
            .map_err(|e| etcd_err(&format!("write {key}"), e))?;
        Ok(())
    }

    /// Write `value` at `key` under `lease` only if nothing is there; whether it was written.
    ///
    /// # Errors
    /// [`Error::Unavailable`] when etcd does not answer.
    pub async fn create_leased(&mut self, key: &str, value: Vec<u8>, lease: i64) -> Result<bool> {
        use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
        let txn = Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key,
                value,
                Some(PutOptions::new().with_lease(lease)),
            )]);
        let r = self
            .client
            .txn(txn)
            .await
            .map_err(|e| etcd_err(&format!("create {key}"), e))?;
        Ok(r.succeeded())
    }

    /// The value at `key` and the revision it was last written at, if there is one.
    ///
    /// # Errors
    /// [`Error::Unavailable`] when etcd does not answer.
    pub async fn get_revised(&mut self, key: &str) -> Result<Option<(Vec<u8>, i64)>> {
        let r = self
            .client
            .get(key, None)
            .await
            .map_err(|e| etcd_err(&format!("read {key}"), e))?;
        Ok(r.kvs()
            .first()
            .map(|kv| (kv.value().to_vec(), kv.mod_revision())))
    }

    /// Write `value` at `key` (no lease) if it is still as written at `revision`; whether it
    /// was written. With `value` `None`, delete it under the same condition.
    ///
    /// # Errors
    /// [`Error::Unavailable`] when etcd does not answer.
    pub async fn swap(&mut self, key: &str, revision: i64, value: Option<Vec<u8>>) -> Result<bool> {
        use etcd_client::{Compare, CompareOp, Txn, TxnOp};
        let op = match value {
            Some(v) => TxnOp::put(key, v, None),
            None => TxnOp::delete(key, None),
        };
        let txn = Txn::new()
            .when([Compare::mod_revision(key, CompareOp::Equal, revision)])
            .and_then([op]);
        let r = self
            .client
            .txn(txn)
            .await
            .map_err(|e| etcd_err(&format!("swap {key}"), e))?;
        Ok(r.succeeded())
    }

    /// Delete `key` (nothing there is no error).
    ///
    /// # Errors
    /// [`Error::Unavailable`] when etcd does not answer.
    pub async fn delete(&mut self, key: &str) -> Result<()> {
        self.client
            .delete(key, None)
            .await
            .map_err(|e| etcd_err(&format!("delete {key}"), e))?;
        Ok(())
    }

    /// The keys under `prefix` with their values and revisions, at most `limit` of them.
    ///
    /// # Errors
    /// [`Error::Unavailable`] when etcd does not answer.
    pub async fn list(&mut self, prefix: &str, limit: i64) -> Result<Vec<(String, Vec<u8>, i64)>> {
        let r = self
            .client
            .get(
                prefix,
                Some(
                    etcd_client::GetOptions::new()
                        .with_prefix()
                        .with_limit(limit),
                ),
            )
            .await
            .map_err(|e| etcd_err(&format!("list {prefix}"), e))?;
        Ok(r.kvs()
            .iter()
            .map(|kv| {
                (
                    String::from_utf8_lossy(kv.key()).into_owned(),
                    kv.value().to_vec(),
                    kv.mod_revision(),
                )
            })
            .collect())
    }

    /// Node `node`'s registration under `prefix`, if it is registered.
    ///
    /// # Errors
    /// [`Error::Unavailable`] when etcd does not answer; [`Error::InvalidArgument`] for a
    /// value that is not a registration.
    pub async fn registration(&mut self, prefix: &str, node: u64) -> Result<Option<Registration>> {
        let key = node_key(prefix, node);
        match self.get(&key).await? {
            Some(v) => serde_json::from_slice(&v)
                .map(Some)
                .map_err(|e| Error::InvalidArgument(format!("{key}: not a registration: {e}"))),
            None => Ok(None),
        }
    }

    /// Revoke node key `key` in the cluster under `prefix` (once written, no node accepts the
    /// key: each drops it from its peer table and closes its connections).
    ///
    /// # Errors
    /// [`Error::Unavailable`] when etcd does not answer.
    pub async fn revoke_key(
        &mut self,
        prefix: &str,
        key: &PublicKey,
        node: Option<u64>,
    ) -> Result<()> {
        let revoked_at_s = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let value = serde_json::to_vec(&Revocation {
            node_id: node,
            revoked_at_s,
        })
        .expect("a revocation serializes");
        self.put(&revoked_key(prefix, key), value).await
    }

    /// The revoked keys under `prefix` as one read, and a watch of them from just after it.
    ///
    /// # Errors
    /// [`Error::Unavailable`] when etcd does not answer.
    pub async fn watch_revoked(&mut self, prefix: &str) -> Result<(BTreeSet<String>, KeyWatch)> {
        let (all, revision, watch) = self.read_and_watch(&format!("{prefix}/revoked/")).await?;
        let keys = all.iter().filter_map(|(k, _)| key_of(k)).collect();
        Ok((keys, KeyWatch(NodeWatchInner { revision, watch })))
    }

    /// Everything under `prefix` as one read (keys and values), its revision, and a watch of
    /// the prefix from just after it (so that no change falls between the two).
    async fn read_and_watch(
        &mut self,
        prefix: &str,
    ) -> Result<(Vec<(Vec<u8>, Vec<u8>)>, i64, Watch)> {
        use etcd_client::{GetOptions, WatchOptions};
        let all = self
            .client
            .get(prefix, Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| etcd_err(&format!("read {prefix}"), e))?;
        let revision = all.header().map_or(0, |h| h.revision());
        let kvs = all
            .kvs()
            .iter()
            .map(|kv| (kv.key().to_vec(), kv.value().to_vec()))
            .collect();
        let (watcher, events) = self
            .client
            .watch(
                prefix,
                Some(
                    WatchOptions::new()
                        .with_prefix()
                        .with_start_revision(revision + 1),
                ),
            )
            .await
            .map_err(|e| etcd_err("watch", e))?;
        Ok((
            kvs,
            revision,
            Watch {
                _watcher: watcher,
                events,
            },
        ))
    }

    /// The registrations under the cluster's `prefix` as one read, with its revision, and a
    /// watch of them from just after it (so that no change falls between the two).
    ///
    /// # Errors
    /// [`Error::Unavailable`] when etcd does not answer.
    pub async fn watch_nodes(&mut self, prefix: &str) -> Result<(Vec<Registration>, NodeWatch)> {
        let (all, revision, watch) = self.read_and_watch(&format!("{prefix}/nodes/")).await?;
        let nodes = all
            .iter()
            .filter_map(|(_, v)| serde_json::from_slice::<Registration>(v).ok())
            .collect();
        Ok((
            nodes,
            NodeWatch {
                revision,
                inner: NodeWatchInner { revision, watch },
            },
        ))
    }
}

/// The last path element of an etcd key, as text.
fn last_of(key: &[u8]) -> Option<&str> {
    std::str::from_utf8(key)
        .ok()
        .and_then(|k| k.rsplit('/').next())
}

/// The revoked key an etcd key under `<prefix>/revoked/` names (lowercase hex), if it names
/// one.
fn key_of(key: &[u8]) -> Option<String> {
    last_of(key)
        .and_then(|k| k.parse::<PublicKey>().ok())
        .map(|k| k.to_string())
}

/// A watch of one prefix.
struct Watch {
    _watcher: etcd_client::Watcher,
    events: etcd_client::WatchStream,
}

/// A watch and the revision of its last message.
struct NodeWatchInner {
    revision: i64,
    watch: Watch,
}

impl NodeWatchInner {
    /// The next message's events (the revision moves on).
    async fn next(&mut self) -> Result<Vec<etcd_client::Event>> {
        let w = match self.watch.events.message().await {
            Ok(Some(w)) => w,
            Ok(None) => return Err(Error::Unavailable("the watch ended".into())),
            Err(e) => return Err(etcd_err("watch", e)),
        };
        if w.canceled() {
            return Err(Error::Unavailable("etcd cancelled the watch".into()));
        }
        self.revision = w.header().map_or(self.revision, |h| h.revision());
        Ok(w.events().to_vec())
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
    inner: NodeWatchInner,
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
        let events = self.inner.next().await?;
        self.revision = self.inner.revision;
        Ok(events
            .iter()
            .filter_map(|e| {
                let kv = e.kv()?;
                match e.event_type() {
                    etcd_client::EventType::Put => serde_json::from_slice(kv.value())
                        .ok()
                        .map(NodeChange::Registered),
                    etcd_client::EventType::Delete => last_of(kv.key())
                        .and_then(|n| n.parse::<u64>().ok())
                        .map(NodeChange::Withdrawn),
                }
            })
            .collect())
    }
}

/// A change to the revoked keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyChange {
    /// Every revoked key, from a full read.
    All(BTreeSet<String>),
    /// A key revoked.
    Revoked(String),
    /// A revocation deleted (by hand, in etcd).
    Unrevoked(String),
}

/// The watch of the revoked keys that [`Etcd::watch_revoked`] started.
pub struct KeyWatch(NodeWatchInner);

impl std::fmt::Debug for KeyWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyWatch")
            .field("revision", &self.0.revision)
            .finish_non_exhaustive()
    }
}

impl KeyWatch {
    /// The next message's changes (keys that name no node key are skipped).
    ///
    /// # Errors
    /// As [`NodeWatch::next`].
    pub async fn next(&mut self) -> Result<Vec<KeyChange>> {
        let events = self.0.next().await?;
        Ok(events
            .iter()
            .filter_map(|e| {
                let k = key_of(e.kv()?.key())?;
                Some(match e.event_type() {
                    etcd_client::EventType::Put => KeyChange::Revoked(k),
                    etcd_client::EventType::Delete => KeyChange::Unrevoked(k),
                })
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_revocation_key_names_the_public_key_and_reads_back() {
        let k = transport::link::testing::public_key(3);
        let at = revoked_key("/kvd", &k);
        assert_eq!(at, format!("/kvd/revoked/{k}"));
        assert_eq!(key_of(at.as_bytes()), Some(k.to_string()));
        assert_eq!(key_of(b"/kvd/revoked/zz"), None);
    }

    #[test]
    fn node_keys_sort_by_id() {
        assert!(node_key("/kvd", 9) < node_key("/kvd", 10));
        assert_eq!(node_key("/kvd", 7), "/kvd/nodes/00000000000000000007");
    }
}
