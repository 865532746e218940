//! `kvd control --etcd` as one of several replicas: each registers itself, one is elected to
//! make the decisions that must have a single writer, and each keeps a record of every stream it
//! serves so that another replica can take the stream over when this one dies.
//!
//! ```text
//!  <prefix>/control/replicas/<id>  {"addr": "host:port"}, under the replica's lease
//!  <prefix>/control/leader         the leader's id, under its lease
//!  <prefix>/streams/<request>      a stream's record (no lease): its front's id, the client's
//!                                  body, the prompt's ids, the budget, its attempt's epoch and
//!                                  the holder of that attempt's checkpoint
//! ```
//!
//! - **Why etcd, and what is not there.** Ownership and epochs must survive the owner and be
//!   changed atomically (a claim is a compare-and-swap on the record's revision), which is what
//!   etcd is for; the replicas already use it for membership. Nothing per token goes there: a
//!   record is written when a stream is admitted and when its attempt's epoch moves (a
//!   recovery), and deleted at its end. What the client already has is in its
//!   `Last-Event-ID` (`R-S-T`: the request, its last event, the tokens with it); the KV of
//!   prompt and tokens is in the holder's checkpoint. A replica that takes a stream over
//!   generates those T tokens again (loading the prompt's blocks from the checkpoint) and
//!   continues from them as a recovery does (kvd-front, `Front::take_over`).
//! - **The leader** writes the controller's snapshot (membership.rs) and ends the streams whose
//!   front died and whose client did not come back within `--reconnect-grace-ms` (their
//!   checkpoints at the holders end, their records go). A replica that cannot keep its lease
//!   alive for a whole TTL stops leading; its registration goes with the lease, so the others
//!   can take its streams over.
//! - **Bounds.** Record writes go through one queue of [`MAX_QUEUED_WRITES`] (past it a write is
//!   dropped and counted: that stream cannot be taken over); a record is at most 1 MiB
//!   (kvd-front's `MAX_RECORD_BYTES`); the leader reads at most [`MAX_LISTED`] records a round.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use kvd_cluster::Etcd;
use kvd_front::Front;
use kvd_front::engine::{BoxFuture, Claim, Records};
use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::control::RequestId;
use crate::membership::Security;
use crate::{Error, Result};

/// Record writes queued at most.
pub const MAX_QUEUED_WRITES: usize = 4096;
/// Records the leader reads per round of its sweep.
pub const MAX_LISTED: i64 = 1024;
/// How often the leader sweeps for streams whose front died.
const SWEEP_EVERY: Duration = Duration::from_secs(2);
/// The bound on connecting to etcd and each call.
const ETCD_TIMEOUT: Duration = Duration::from_secs(5);

/// What the replicas count (`/status` → `replicas`).
#[derive(Debug, Default, Serialize)]
pub struct ReplicaStats {
    /// Records written (admissions and epoch moves).
    pub records_written: AtomicU64,
    /// Record writes or deletes etcd refused or did not answer.
    pub record_errors: AtomicU64,
    /// Record writes dropped because the queue was full.
    pub records_dropped: AtomicU64,
    /// Streams this replica took over.
    pub claims_won: AtomicU64,
    /// Resumes sent on to a live owner.
    pub claims_owner_alive: AtomicU64,
    /// Streams of dead fronts the leader ended (no client came back).
    pub orphans_ended: AtomicU64,
    /// Times this replica became the leader.
    pub elected: AtomicU64,
}

enum Write {
    Keep(RequestId, Vec<u8>),
    Forget(RequestId),
}

/// This replica.
#[derive(Debug)]
pub struct Replicas {
    me: String,
    addr: String,
    prefix: String,
    endpoints: Vec<String>,
    security: Security,
    ttl_ms: u64,
    orphan_ms: u64,
    leader: AtomicBool,
    writes: mpsc::Sender<Write>,
    front: OnceLock<Arc<Front>>,
    /// Its counters.
    pub stats: ReplicaStats,
}

impl std::fmt::Debug for Write {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Write::Keep(id, _) => write!(f, "Keep({id})"),
            Write::Forget(id) => write!(f, "Forget({id})"),
        }
    }
}

/// A replica's id: random per process (std's randomly keyed hasher over the pid and time).
fn random_id() -> String {
    use std::hash::BuildHasher;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let v = std::collections::hash_map::RandomState::new().hash_one((std::process::id(), now));
    format!("{v:016x}")
}

impl Replicas {
    /// This replica (serving at `addr`), its tasks started: the registration and election
    /// (`ttl_ms`: its lease), the record writer. Streams whose front died are ended by the leader
    /// after `orphan_ms` without a claim.
    pub fn start(
        endpoints: Vec<String>,
        prefix: String,
        security: Security,
        addr: String,
        ttl_ms: u64,
        orphan_ms: u64,
    ) -> Arc<Replicas> {
        let (tx, rx) = mpsc::channel(MAX_QUEUED_WRITES);
        let r = Arc::new(Replicas {
            me: random_id(),
            addr,
            prefix,
            endpoints,
            security,
            ttl_ms: ttl_ms.max(1000),
            orphan_ms,
            leader: AtomicBool::new(false),
            writes: tx,
            front: OnceLock::new(),
            stats: ReplicaStats::default(),
        });
        tokio::spawn(Arc::clone(&r).writer(rx));
        tokio::spawn(Arc::clone(&r).run());
        r
    }

    /// The front whose streams these are (for the leader's ending of orphans).
    pub fn set_front(&self, front: Arc<Front>) {
        let _ = self.front.set(front);
    }

    /// Whether this replica leads now.
    pub fn is_leader(&self) -> bool {
        self.leader.load(Ordering::Relaxed)
    }

    /// Its id.
    pub fn id(&self) -> &str {
        &self.me
    }

    /// `/status`'s view.
    pub fn status(&self) -> Value {
        json!({"id": self.me, "addr": self.addr, "leader": self.is_leader(), "counters": &self.stats})
    }

    fn replica_key(&self, id: &str) -> String {
        format!("{}/control/replicas/{id}", self.prefix)
    }

    fn leader_key(&self) -> String {
        format!("{}/control/leader", self.prefix)
    }

    fn stream_key(&self, id: RequestId) -> String {
        format!("{}/streams/{id:020}", self.prefix)
    }

    async fn connect(&self) -> Result<Etcd> {
        Etcd::connect(&self.endpoints, &self.security, ETCD_TIMEOUT).await
    }

    /// Register, campaign and lead, until the process ends (reconnecting with a backoff).
    async fn run(self: Arc<Self>) {
        let mut backoff = Duration::from_millis(100);
        loop {
            if let Err(e) = self.session().await {
                if self.leader.swap(false, Ordering::Relaxed) {
                    tracing::warn!(error = %e, "control: lost the lead");
                }
                tracing::warn!(error = %e, "control: replica session ended; registering again");
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }

    async fn session(&self) -> Result<()> {
        let mut etcd = self.connect().await?;
        let mut lease = etcd.lease(self.ttl_ms).await?;
        let me = json!({"addr": self.addr}).to_string().into_bytes();
        let lease_id = lease.id();
        etcd.put_leased(&self.replica_key(&self.me), me, lease_id)
            .await?;
        tracing::info!(replica = %self.me, addr = %self.addr, "control: registered as a replica");
        let mut beat = tokio::time::interval(Duration::from_millis(self.ttl_ms / 3));
        beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut sweep = tokio::time::interval(SWEEP_EVERY);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut orphans: HashMap<String, Instant> = HashMap::new();
        loop {
            tokio::select! {
                _ = beat.tick() => {
                    lease.beat().await?;
                    if !self.is_leader()
                        && etcd.create_leased(&self.leader_key(), self.me.clone().into_bytes(), lease_id).await?
                    {
                        self.leader.store(true, Ordering::Relaxed);
                        self.stats.elected.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(replica = %self.me, "control: elected leader");
                    }
                }
                _ = sweep.tick(), if self.is_leader() => {
                    self.sweep(&mut etcd, &mut orphans).await?;
                }
            }
        }
    }

    /// The leader's sweep: streams whose front is gone and which nobody claimed within
    /// `orphan_ms` end (their checkpoints at the holders, their records).
    async fn sweep(&self, etcd: &mut Etcd, orphans: &mut HashMap<String, Instant>) -> Result<()> {
        let live: Vec<String> = etcd
            .list(&format!("{}/control/replicas/", self.prefix), 4096)
            .await?
            .into_iter()
            .filter_map(|(k, _, _)| k.rsplit('/').next().map(str::to_string))
            .collect();
        let records = etcd
            .list(&format!("{}/streams/", self.prefix), MAX_LISTED)
            .await?;
        let mut seen = Vec::new();
        for (key, value, rev) in records {
            let Ok(rec) = serde_json::from_slice::<Value>(&value) else {
                continue;
            };
            let owner = rec["front"].as_str().unwrap_or_default();
            if live.iter().any(|l| l == owner) {
                continue;
            }
            seen.push(key.clone());
            let since = *orphans.entry(key.clone()).or_insert_with(Instant::now);
            if since.elapsed() < Duration::from_millis(self.orphan_ms) {
                continue;
            }
            if etcd.swap(&key, rev, None).await? {
                orphans.remove(&key);
                self.stats.orphans_ended.fetch_add(1, Ordering::Relaxed);
                let id = key
                    .rsplit('/')
                    .next()
                    .and_then(|s| s.parse::<RequestId>().ok());
                tracing::info!(stream = %key, front = owner, "control: ended a stream whose front died and whose client did not come back");
                if let (Some(f), Some(id)) = (self.front.get(), id) {
                    f.end_orphan(id, &rec).await;
                }
            }
        }
        orphans.retain(|k, _| seen.contains(k));
        Ok(())
    }

    /// The record writer: one connection, the writes in order.
    async fn writer(self: Arc<Self>, mut rx: mpsc::Receiver<Write>) {
        let mut etcd: Option<Etcd> = None;
        while let Some(w) = rx.recv().await {
            if etcd.is_none() {
                etcd = self.connect().await.ok();
            }
            let Some(e) = etcd.as_mut() else {
                self.stats.record_errors.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            let done = match &w {
                Write::Keep(id, v) => e.put(&self.stream_key(*id), v.clone()).await,
                Write::Forget(id) => e.delete(&self.stream_key(*id)).await,
            };
            match done {
                Ok(()) => {
                    if matches!(w, Write::Keep(..)) {
                        self.stats.records_written.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Err(err) => {
                    tracing::warn!(error = %err, write = ?w, "control: a stream record was not written");
                    self.stats.record_errors.fetch_add(1, Ordering::Relaxed);
                    etcd = None;
                }
            }
        }
    }

    fn queue(&self, w: Write) {
        if self.writes.try_send(w).is_err() {
            self.stats.records_dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    async fn claim_at(&self, id: RequestId) -> Result<Claim> {
        let mut etcd = self.connect().await?;
        let key = self.stream_key(id);
        // a few rounds at most: another replica may claim it between our read and our swap
        for _ in 0..3 {
            let Some((value, rev)) = etcd.get_revised(&key).await? else {
                return Ok(Claim::Unknown);
            };
            let mut rec: Value = serde_json::from_slice(&value)
                .map_err(|e| Error::Protocol(format!("{key}: {e}")))?;
            let owner = rec["front"].as_str().unwrap_or_default().to_string();
            if owner != self.me
                && let Some(reg) = etcd.get(&self.replica_key(&owner)).await?
            {
                let addr = serde_json::from_slice::<Value>(&reg)
                    .ok()
                    .and_then(|v| v["addr"].as_str().map(str::to_string))
                    .unwrap_or_default();
                self.stats
                    .claims_owner_alive
                    .fetch_add(1, Ordering::Relaxed);
                return Ok(Claim::Owner(addr));
            }
            rec["front"] = json!(self.me);
            if etcd
                .swap(&key, rev, Some(rec.to_string().into_bytes()))
                .await?
            {
                self.stats.claims_won.fetch_add(1, Ordering::Relaxed);
                return Ok(Claim::Taken(rec));
            }
        }
        Err(Error::Unavailable(format!(
            "stream {id}: claimed by others while this front claimed it; retry"
        )))
    }
}

impl Records for Replicas {
    fn keep(&self, request: RequestId, mut record: Value) {
        record["front"] = json!(self.me);
        self.queue(Write::Keep(request, record.to_string().into_bytes()));
    }

    fn forget(&self, request: RequestId) {
        self.queue(Write::Forget(request));
    }

    fn claim(&self, request: RequestId) -> BoxFuture<'_, Result<Claim>> {
        Box::pin(self.claim_at(request))
    }

    fn status(&self) -> Value {
        Replicas::status(self)
    }
}
