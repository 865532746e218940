//! kvd-client: the Rust client of the local protocol: what engines (through the FFI), the benches and the
//! tests use to talk to `kvd serve` on the same node.
//!
//! ```no_run
//! # fn main() -> kvd_core::Result<()> {
//! use kvd_client::{Client, ClientOptions};
//! # let (desc, keys): (kvd_core::keys::NamespaceDescriptor, Vec<kvd_core::keys::BlockKey>) = todo!();
//! let mut c = Client::connect("/run/kvd/kvd.sock", &ClientOptions::named("engine-0"))?;
//! let ns = c.register_namespace(&desc)?;
//! // Write: allocate a batch, copy each page into the mapped pool, seal, publish the group.
//! let allocs = c.alloc(&keys, kvd_core::types::BlockClass::Cache, None)?;
//! let mut sealed = Vec::new();
//! for a in allocs.into_iter().flatten() {
//!     let crc = c.write_with_crc(&a.handle, 0, &[7u8; 4096], 0)?;
//!     sealed.push(kvd_core::protocol::SealItem { handle: a.handle, len: 4096, checksum: Some(crc) });
//! }
//! c.seal(&sealed)?;
//! c.publish(&sealed.iter().map(|s| s.handle).collect::<Vec<_>>())?;
//! # Ok(()) }
//! ```
//!
//! The client is synchronous and starts no thread: it lives inside the engine's process. Each
//! call is one round trip for a whole batch. The session's lease is renewed by
//! [`Client::heartbeat`], which the engine calls from its own loop more often than the lease.
//!
//! Safety of the mapped bytes: the client keeps a table of the blocks its session may touch
//! (allocated and not yet sealed: writable; pinned: readable) and checks every range it is asked
//! to copy against it, so a caller's bad offset or stale handle gets an error, not another
//! block's page.
//!
//! A connection that failed is never used again. When a call times out, the daemon's socket
//! closes (it died or restarted), or an answer arrives for another request than the one waited
//! for, the client marks itself broken and shuts the socket down (so the daemon releases the
//! session at once). From then on every call, and every read, write or view of the mapping,
//! fails fast with [`Error::Disconnected`] without touching the socket or the pool:
//! the session's pins and unfinished blocks are gone with it, so the bytes in the mapping are no
//! longer this client's to trust. [`Client::reconnect`] opens a fresh session; blocks must be
//! looked up again. Before touching the mapping the client also checks that the daemon's end of
//! the socket is still open (one `poll`, no wait) and that its lease still holds by its own
//! conservative reckoning (see [`Client::lease_left`]).
//!
//! Identities are per daemon incarnation: handles and [`BlockVersion`]s carry the node
//! generation and are refused by a restarted daemon; session and reservation ids are never
//! accepted from another session.
//!
//! Where things are: this file holds the connection (handshake, calls, failure) and the store's
//! block calls; `remote` the transfers between daemons; `manifests` reservations and checkpoint
//! manifests; `retry` the retry policy for `Overloaded`; `views` the checked reads and writes
//! of the mapped pool; `submit` the pipelined submitter; `health` the pool canary; `raw` what a
//! binding in another language needs (the mapping's address, the view check by handle); `cuda`
//! the copies between device memory and blocks (feature `cuda`).

mod cuda;
mod health;
mod manifests;
mod raw;
mod remote;
mod retry;
mod submit;
mod views;

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvd_core::keys::{BlockKey, BlockTag, NamespaceDescriptor, NamespaceId};
use kvd_core::protocol::frame::{self, FRAME_HEADER_BYTES, MAX_FRAME_BYTES};
use kvd_core::protocol::spin;
use kvd_core::protocol::{Hello, HelloReply, Op, Reply, Request, Response, SealItem, Welcome, bit};
use kvd_core::types::{
    Allocation, BlockClass, BlockInfo, BlockVersion, EventBatch, Handle, PrefixHit, ReservationId,
    StoreStats,
};
use kvd_core::{Error, Result};

pub use cuda::{CudaEvent, DeviceSlice, MAX_CUDA_LAYERS};
pub use health::{CANARY_BYTES, HealthReport};
pub use raw::PoolMapping;
pub use retry::{RetryPolicy, RetryStats};
pub use submit::{AsyncOp, AsyncReply, Completion, MAX_INFLIGHT, SharedClient, Submitter};
use transport::local::{PageGenerations, SharedRegion};
pub use views::BlockView;
use views::{Readable, Writable};

/// How to open a session.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// A name for the daemon's logs and `/status`.
    pub name: String,
    /// The session's lease: heartbeat more often than this.
    pub lease_ttl_ms: u64,
    /// How long one round trip may take before the call fails with `Io`.
    pub io_timeout_ms: u64,
    /// Pre-fault the pool mapping at connect (faster first writes; costs time at connect).
    pub populate: bool,
    /// Retry calls the daemon refused as `Overloaded` (nothing was done), with backoff and
    /// jitter; `None` (the default) returns the refusal at once.
    pub retry: Option<RetryPolicy>,
    /// How long a call polls its socket for the answer before it blocks in `read`, in
    /// microseconds (0, the default: block at once). A thread that blocks at once lets its CPU
    /// go idle, and waking an idle CPU costs more than a metadata call's whole work on a
    /// virtual machine; the poll spends at most this much CPU per call and nothing while no
    /// call waits.
    pub spin_us: u32,
}

/// The default [`ClientOptions::spin_us`]: 0, block at once. A 50 µs poll halves a quiet
/// machine's metadata round trip (p50) but raised its p99 in the measurements so far
/// (docs/PERFORMANCE.md, "The metadata round trip and the waiting strategy"), so it is opt-in.
pub const DEFAULT_SPIN_US: u32 = 0;

impl ClientOptions {
    /// Defaults with a name: a 10 s lease, a 30 s I/O timeout, a populated mapping, no
    /// retries.
    pub fn named(name: &str) -> ClientOptions {
        ClientOptions {
            name: name.to_owned(),
            lease_ttl_ms: 10_000,
            io_timeout_ms: 30_000,
            populate: true,
            retry: None,
            spin_us: DEFAULT_SPIN_US,
        }
    }
}

/// A session with the local daemon and its mapped pool.
#[derive(Debug)]
pub struct Client {
    stream: UnixStream,
    /// The same socket, buffered for reading: one `read` per answer, not two.
    reader: std::io::BufReader<UnixStream>,
    welcome: Welcome,
    /// The pool's CUDA registration, once made: declared before `pool`, so it is dropped (its
    /// copies waited for, its chunks unregistered) before the mapping goes.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    cuda: cuda::CudaState,
    pool: SharedRegion,
    /// The daemon's page-generation table, mapped read-only.
    pages: PageGenerations,
    next_id: u64,
    request: Option<u64>,
    writable: HashMap<Handle, Writable>,
    readable: HashMap<Handle, Readable>,
    /// Where and how this session was opened, for [`Client::reconnect`].
    path: PathBuf,
    opts: ClientOptions,
    /// The bounded poll before blocking for an answer ([`ClientOptions::spin_us`]).
    spin: spin::Spinner,
    /// Why the connection can no longer be used, once it cannot (set once, from `&self` too:
    /// a read of the mapping may be what finds the daemon gone).
    broken: std::cell::OnceCell<String>,
    /// The session's lease holds at least until then, by this client's reckoning.
    lease_until: Instant,
    /// What retries cost so far.
    retries: RetryStats,
}

impl Client {
    /// Connect to the daemon's socket, open a session and map the pool.
    ///
    /// # Errors
    /// [`Error::Io`] if the socket cannot be reached; the daemon's refusal as its error
    /// ([`Error::Unavailable`] while draining, [`Error::Overloaded`] with a retry hint when the
    /// session limit is reached, [`Error::Protocol`] for another protocol version).
    pub fn connect(path: impl AsRef<Path>, opts: &ClientOptions) -> Result<Client> {
        let path = path.as_ref();
        let started = Instant::now();
        let stream = UnixStream::connect(path)
            .map_err(|e| Error::Io(format!("connecting to {}: {e}", path.display())))?;
        let timeout = Some(Duration::from_millis(opts.io_timeout_ms.max(1)));
        stream.set_read_timeout(timeout)?;
        stream.set_write_timeout(timeout)?;
        // A daemon at one of its bounds answers with a framed refusal and closes, possibly
        // before it has read the hello: then the write fails, but the refusal is there to read.
        let sent = frame::write_frame(&mut &stream, &Hello::new(&opts.name, opts.lease_ttl_ms));
        let (reply, fds) = match (read_handshake(&stream), sent) {
            (Ok(r), _) => r,
            (Err(e), Ok(())) => return Err(e),
            (Err(_), Err(e)) => return Err(Error::Io(format!("sending the hello: {e}"))),
        };
        let welcome = match reply {
            HelloReply::Welcome(w) => w,
            HelloReply::Refused(e) => return Err(e.into()),
        };
        // The pool's memfd, then the page-generation table's (sealed: read-only for us).
        let [pool_fd, pages_fd]: [OwnedFd; 2] = fds.try_into().map_err(|fds: Vec<OwnedFd>| {
            Error::Protocol(format!(
                "the daemon's welcome came with {} file descriptors, not the pool's and the \
                 page table's",
                fds.len()
            ))
        })?;
        let pool = SharedRegion::map_fd(pool_fd, welcome.pool_bytes, opts.populate)?;
        let pages = PageGenerations::map_read_only(pages_fd, welcome.page_count)?;
        tracing::debug!(
            session = welcome.session.0,
            node_generation = welcome.node_generation,
            pool_bytes = pool.len(),
            "connected to kvd"
        );
        let reader = std::io::BufReader::with_capacity(64 * 1024, stream.try_clone()?);
        Ok(Client {
            stream,
            reader,
            lease_until: started + lease_margin(welcome.lease_ttl_ms),
            welcome,
            cuda: cuda::CudaState::default(),
            pool,
            pages,
            next_id: 1,
            request: None,
            writable: HashMap::new(),
            readable: HashMap::new(),
            path: path.to_owned(),
            opts: opts.clone(),
            spin: spin::Spinner::new(Duration::from_micros(u64::from(opts.spin_us))),
            broken: std::cell::OnceCell::new(),
            retries: RetryStats::default(),
        })
    }

    /// Open a fresh session on the same socket with the same options, replacing this one (which
    /// is closed first if it still works). Every handle and pin of the old session is gone: look
    /// the blocks up again.
    ///
    /// # Errors
    /// As [`Client::connect`]; on error this client stays broken (or as it was) and can try
    /// again.
    pub fn reconnect(&mut self) -> Result<()> {
        let fresh = Client::connect(&self.path, &self.opts)?;
        let old = std::mem::replace(self, fresh);
        self.retries = old.retries;
        if old.broken.get().is_none() {
            let _ = old.close();
        }
        Ok(())
    }

    /// Why this client can no longer be used, once a connection failure made it so.
    pub fn broken(&self) -> Option<&str> {
        self.broken.get().map(String::as_str)
    }

    /// How long the session's lease holds at least, by this client's own reckoning: the lease
    /// the daemon last reported at a heartbeat, or three quarters of the lease after any answered
    /// request (the daemon renews it on requests at most every quarter lease). Zero once it may
    /// have run out: heartbeat or reconnect.
    pub fn lease_left(&self) -> Duration {
        self.lease_until.saturating_duration_since(Instant::now())
    }

    /// Mark the connection unusable for good and shut the socket down, so the daemon releases
    /// the session now rather than at its lease. Returns the error every later call gets.
    fn fail(&self, why: String) -> Error {
        if self.broken.get().is_none() {
            tracing::warn!(session = self.welcome.session.0, reason = %why, "kvd connection lost");
            let _ = self.stream.shutdown(std::net::Shutdown::Both);
            let _ = self.broken.set(why);
        }
        self.disconnected()
    }

    fn disconnected(&self) -> Error {
        Error::Disconnected(self.broken.get().cloned().unwrap_or_default())
    }

    /// Before a call: fail fast once broken.
    fn ensure_connected(&self) -> Result<()> {
        match self.broken.get() {
            Some(_) => Err(self.disconnected()),
            None => Ok(()),
        }
    }

    /// Before the mapping is touched: the connection must work, the daemon's end must be open
    /// (a dead daemon's pool is nobody's to trust) and the lease must hold.
    pub(crate) fn ensure_mapping_usable(&self) -> Result<()> {
        self.ensure_connected()?;
        if daemon_hung_up(&self.stream) {
            return Err(
                self.fail("the daemon closed the connection (it stopped or restarted)".into())
            );
        }
        if self.lease_until <= Instant::now() {
            return Err(Error::LeaseExpired(format!(
                "this client has not heard from the daemon within its {} ms lease, so its pins \
                 may be gone; heartbeat first",
                self.welcome.lease_ttl_ms
            )));
        }
        Ok(())
    }

    /// What the daemon told us at the handshake.
    pub fn welcome(&self) -> &Welcome {
        &self.welcome
    }

    /// The daemon incarnation's generation.
    pub fn node_generation(&self) -> u64 {
        self.welcome.node_generation
    }

    /// Bytes per page.
    pub fn page_size(&self) -> u64 {
        self.welcome.page_size_bytes
    }

    /// The engine request the next calls serve (for the daemon's traces), or `None`.
    pub fn set_request(&mut self, request: Option<u64>) {
        self.request = request;
    }

    /// Send one operation and wait for its answer, retrying an `Overloaded` refusal as the
    /// client's [`RetryPolicy`] says (if it has one). The typed methods below are built on
    /// this; it is public for tools and tests.
    ///
    /// # Errors
    /// The daemon's error for the call, or [`Error::Io`] / [`Error::Protocol`] when the
    /// connection fails.
    ///
    /// A failed connection (timeout, closed socket, an answer to another request) makes the
    /// client broken: this and every later call return [`Error::Disconnected`].
    pub fn call(&mut self, op: Op) -> Result<Reply> {
        let policy = self.opts.retry;
        let mut stats = self.retries;
        let r = retry::with_retries(policy.as_ref(), &mut stats, || self.call_once(op.clone()));
        self.retries = stats;
        r
    }

    /// What this client's retries cost so far.
    pub fn retry_stats(&self) -> RetryStats {
        self.retries
    }

    /// One send and its answer.
    fn call_once(&mut self, op: Op) -> Result<Reply> {
        self.ensure_connected()?;
        let id = self.next_id;
        self.next_id += 1;
        let sent_at = Instant::now();
        let req = Request {
            id,
            request: self.request,
            op,
        };
        if let Err(e) = frame::write_frame(&mut &self.stream, &req) {
            return Err(self.fail(format!("sending request {id}: {e}")));
        }
        let waited = self.reader.buffer().is_empty();
        if waited {
            self.spin.before_wait(&self.stream);
        }
        let resp: Response = match frame::read_frame(&mut self.reader) {
            Ok(r) => r,
            Err(e) => return Err(self.fail(format!("waiting for the answer to request {id}: {e}"))),
        };
        if waited {
            self.spin.after_wait();
        }
        if resp.id != id {
            let what = match resp.result {
                Err(e) => format!(
                    "the daemon answered request {} with: {}",
                    resp.id,
                    Error::from(e)
                ),
                Ok(_) => format!("the daemon answered request {}", resp.id),
            };
            return Err(self.fail(format!("{what}, while this client waited for {id}")));
        }
        self.lease_until = self
            .lease_until
            .max(sent_at + lease_margin(self.welcome.lease_ttl_ms));
        match resp.result {
            Ok(r) => Ok(r),
            Err(e) => {
                let e = Error::from(e);
                // The daemon closes the connection of a session it released.
                if let Error::LeaseExpired(why) = &e {
                    self.fail(format!("the session's lease is gone: {why}"));
                }
                Err(e)
            }
        }
    }

    fn check_batch(&self, n: usize) -> Result<()> {
        kvd_core::batch::check_batch(n, self.welcome.max_batch)
    }

    /// Register a KV layout; returns its id. Idempotent.
    pub fn register_namespace(&mut self, d: &NamespaceDescriptor) -> Result<NamespaceId> {
        match self.call(Op::RegisterNamespace(d.clone()))? {
            Reply::Namespace(id) => Ok(id),
            r => Err(unexpected(&r)),
        }
    }

    /// The longest PUBLISHED prefix of `tags`; with `pin`, the blocks are pinned for this
    /// session (release them with [`Client::release`]).
    pub fn lookup_prefix(
        &mut self,
        namespace: &NamespaceId,
        tags: &[BlockTag],
        pin: bool,
        pin_ttl_ms: Option<u64>,
    ) -> Result<PrefixHit> {
        self.check_batch(tags.len())?;
        let sent_at = Instant::now();
        match self.call(Op::LookupPrefix {
            namespace: *namespace,
            tags: tags.to_vec(),
            pin,
            pin_ttl_ms,
        })? {
            Reply::Prefix(hit) => {
                if hit.pinned {
                    for b in &hit.blocks {
                        self.note_pin(b, sent_at);
                    }
                }
                Ok(hit)
            }
            r => Err(unexpected(&r)),
        }
    }

    /// Which keys are PUBLISHED.
    pub fn exists(&mut self, keys: &[BlockKey]) -> Result<Vec<bool>> {
        self.check_batch(keys.len())?;
        match self.call(Op::Exists {
            keys: keys.to_vec(),
        })? {
            Reply::Exists(bits) => Ok((0..keys.len()).map(|i| bit(&bits, i)).collect()),
            r => Err(unexpected(&r)),
        }
    }

    /// Pin PUBLISHED blocks for reading; each key gets its own result.
    pub fn acquire(
        &mut self,
        keys: &[BlockKey],
        ttl_ms: Option<u64>,
    ) -> Result<Vec<Result<BlockInfo>>> {
        self.check_batch(keys.len())?;
        let sent_at = Instant::now();
        match self.call(Op::Acquire {
            keys: keys.to_vec(),
            ttl_ms,
        })? {
            Reply::Acquired(v) => Ok(v
                .into_iter()
                .map(|r| {
                    let b = r.map_err(Error::from)?;
                    self.note_pin(&b, sent_at);
                    Ok(b)
                })
                .collect()),
            r => Err(unexpected(&r)),
        }
    }

    /// Release pins; a stale or unpinned handle gets its error in its place (the pin it named
    /// is gone either way).
    pub fn release(&mut self, handles: &[Handle]) -> Result<Vec<Result<()>>> {
        self.check_batch(handles.len())?;
        let r = self.call(Op::Release {
            handles: handles.to_vec(),
        })?;
        for h in handles {
            self.forget_pin(h);
        }
        each(r)
    }

    /// Allocate blocks to write through the mapping. Each allocated block is WRITING and owned
    /// by this session until it is sealed or aborted; existing keys get `AlreadyExists`.
    pub fn alloc(
        &mut self,
        keys: &[BlockKey],
        class: BlockClass,
        reservation: Option<ReservationId>,
    ) -> Result<Vec<Result<Allocation>>> {
        self.check_batch(keys.len())?;
        match self.call(Op::Alloc {
            keys: keys.to_vec(),
            class,
            reservation,
        })? {
            Reply::Allocated(v) => Ok(v
                .into_iter()
                .map(|r| {
                    let a = r.map_err(Error::from)?;
                    self.writable.insert(
                        a.handle,
                        Writable {
                            offset: a.offset,
                            capacity: a.capacity,
                        },
                    );
                    Ok(a)
                })
                .collect()),
            r => Err(unexpected(&r)),
        }
    }

    /// Seal written blocks: from here their bytes are immutable. Each gets the checksum recorded
    /// or its own error.
    pub fn seal(&mut self, items: &[SealItem]) -> Result<Vec<Result<u32>>> {
        self.check_batch(items.len())?;
        match self.call(Op::Seal {
            blocks: items.to_vec(),
        })? {
            Reply::Sealed(v) => Ok(v
                .into_iter()
                .zip(items)
                .map(|(r, it)| {
                    let c = r.map_err(Error::from)?;
                    self.writable.remove(&it.handle);
                    Ok(c)
                })
                .collect()),
            r => Err(unexpected(&r)),
        }
    }

    /// Publish SEALED cache blocks as one group: all or none.
    pub fn publish(&mut self, handles: &[Handle]) -> Result<()> {
        self.check_batch(handles.len())?;
        match self.call(Op::Publish {
            handles: handles.to_vec(),
        })? {
            Reply::Done => Ok(()),
            r => Err(unexpected(&r)),
        }
    }

    /// Register this session as rank `rank` of engine instance `(instance, generation)` of
    /// `rank_count` ranks. From then on a checkpoint step of the instance is published only
    /// when every rank committed its blocks of it ([`Client::instance_commit`]), and if any
    /// rank's session ends, the instance fails as a whole (every rank's open steps aborted).
    pub fn instance_join(
        &mut self,
        instance: u64,
        generation: u64,
        rank: u32,
        rank_count: u32,
    ) -> Result<()> {
        match self.call(Op::InstanceJoin {
            instance,
            generation,
            rank,
            rank_count,
        })? {
            Reply::Done => Ok(()),
            r => Err(unexpected(&r)),
        }
    }

    /// Commit this rank's SEALED cache blocks of step `step` of its instance; whether that
    /// published the step (this was the last rank to commit it: every rank's blocks of it are
    /// PUBLISHED now, together).
    pub fn instance_commit(
        &mut self,
        instance: u64,
        generation: u64,
        step: u64,
        handles: &[Handle],
    ) -> Result<bool> {
        self.check_batch(handles.len())?;
        match self.call(Op::InstanceCommit {
            instance,
            generation,
            step,
            handles: handles.to_vec(),
        })? {
            Reply::InstanceStep { published } => Ok(published),
            r => Err(unexpected(&r)),
        }
    }

    /// Abort unfinished blocks; their pages return to the pool.
    pub fn abort(&mut self, handles: &[Handle]) -> Result<Vec<Result<()>>> {
        self.check_batch(handles.len())?;
        let r = self.call(Op::Abort {
            handles: handles.to_vec(),
        })?;
        for h in handles {
            self.writable.remove(h);
        }
        each(r)
    }

    /// Compare-and-delete each `(key, version)` (take the version from the block's handle:
    /// [`Handle::version`]); a version from an earlier daemon incarnation never matches.
    pub fn remove_if(&mut self, items: &[(BlockKey, BlockVersion)]) -> Result<Vec<Result<()>>> {
        self.check_batch(items.len())?;
        let r = self.call(Op::RemoveIf {
            items: items.to_vec(),
        })?;
        each(r)
    }

    /// Soft-pin PUBLISHED cache blocks (a shared prefix: a system prompt's blocks) until
    /// `ttl_ms` from now (capped at a day; 0 ends it): eviction takes them only when nothing
    /// else can go. Which keys were soft-pinned.
    pub fn soft_pin(&mut self, keys: &[BlockKey], ttl_ms: u64) -> Result<Vec<bool>> {
        self.check_batch(keys.len())?;
        match self.call(Op::SoftPin {
            keys: keys.to_vec(),
            ttl_ms,
        })? {
            Reply::Exists(bits) => Ok((0..keys.len()).map(|i| bit(&bits, i)).collect()),
            r => Err(unexpected(&r)),
        }
    }

    /// Mark blocks recently used.
    pub fn touch(&mut self, keys: &[BlockKey]) -> Result<()> {
        self.check_batch(keys.len())?;
        match self.call(Op::Touch {
            keys: keys.to_vec(),
        })? {
            Reply::Done => Ok(()),
            r => Err(unexpected(&r)),
        }
    }

    /// Renew the session's lease; returns the milliseconds until it expires.
    pub fn heartbeat(&mut self) -> Result<u64> {
        let sent_at = Instant::now();
        match self.call(Op::Heartbeat)? {
            Reply::Lease { expires_in_ms } => {
                self.lease_until = sent_at + Duration::from_millis(expires_in_ms);
                Ok(expires_in_ms)
            }
            r => Err(unexpected(&r)),
        }
    }

    /// The store's counts.
    pub fn stats(&mut self) -> Result<StoreStats> {
        match self.call(Op::Stats)? {
            Reply::Stats(s) => Ok(s),
            r => Err(unexpected(&r)),
        }
    }

    /// Drain the node's block events (stored / removed), for a KV-aware router: those with
    /// `seq >= since` (0: the oldest held), at most `max` (at most the welcome's `max_batch`).
    /// Pass the batch's `next_seq` as the next `since`. When `lost > 0` the daemon's bounded
    /// log dropped events this reader had not read: resync with lookups, then go on from
    /// `next_seq`. Sequence numbers restart at 1 when the daemon restarts; a changed
    /// [`Client::node_generation`] (after [`Client::reconnect`]) says so: start again from 0.
    ///
    /// # Errors
    /// `InvalidArgument` for `max` above the daemon's batch limit or a `since` past the end of
    /// the log (a sequence number from before a restart).
    pub fn events(&mut self, since: u64, max: u32) -> Result<EventBatch> {
        self.check_batch(max as usize)?;
        match self.call(Op::Events { since, max })? {
            Reply::Events(b) => Ok(b),
            r => Err(unexpected(&r)),
        }
    }

    /// Close the session cleanly: the daemon aborts unfinished blocks and drops pins.
    pub fn close(mut self) -> Result<()> {
        self.call(Op::Goodbye).map(|_| ())
    }
}

pub(crate) fn each(r: Reply) -> Result<Vec<Result<()>>> {
    match r {
        Reply::Each(v) => Ok(v.into_iter().map(|r| r.map_err(Error::from)).collect()),
        r => Err(unexpected(&r)),
    }
}

/// The least time the lease holds after an answered request: the daemon renews it on requests
/// at most every quarter lease, so it runs at least three quarters of a lease past any request.
fn lease_margin(lease_ttl_ms: u64) -> Duration {
    Duration::from_millis(lease_ttl_ms - lease_ttl_ms / 4)
}

/// Whether the daemon's end of the socket is closed (one non-blocking `poll`).
fn daemon_hung_up(stream: &UnixStream) -> bool {
    use rustix::event::{PollFd, PollFlags, poll};
    let mut fds = [PollFd::new(stream, PollFlags::RDHUP)];
    let zero = rustix::event::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    match poll(&mut fds, Some(&zero)) {
        Ok(0) => false,
        Ok(_) => fds[0]
            .revents()
            .intersects(PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR),
        Err(_) => false,
    }
}

fn unexpected(r: &Reply) -> Error {
    Error::Protocol(format!("unexpected reply {r:?}"))
}

/// Read the handshake reply, which carries the pool's and the page table's fds with its first
/// byte.
fn read_handshake(stream: &UnixStream) -> Result<(HelloReply, Vec<OwnedFd>)> {
    let mut buf = vec![0u8; 4096];
    let mut have = 0;
    let mut fds = Vec::new();
    loop {
        let (n, got) = kvd_core::protocol::fdpass::recv_with_fds(stream.as_fd(), &mut buf[have..])
            .map_err(|e| Error::Io(format!("reading the daemon's welcome: {e}")))?;
        if !got.is_empty() {
            fds = got;
        }
        if n == 0 {
            return Err(Error::Io(
                "the daemon closed the connection during the handshake".into(),
            ));
        }
        have += n;
        if have >= FRAME_HEADER_BYTES {
            let h: &[u8; FRAME_HEADER_BYTES] = buf[..FRAME_HEADER_BYTES]
                .try_into()
                .expect("length checked");
            let h = frame::decode_header(h, MAX_FRAME_BYTES)?;
            let total = FRAME_HEADER_BYTES + h.body_len as usize;
            if total > buf.len() {
                buf.resize(total, 0);
            }
            if have >= total {
                if have > total {
                    return Err(Error::Protocol(
                        "unexpected bytes after the daemon's welcome".into(),
                    ));
                }
                let reply = frame::decode_body(&buf[FRAME_HEADER_BYTES..total])?;
                return Ok((reply, fds));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_closed_peer_is_seen_without_waiting() {
        let (a, b) = UnixStream::pair().unwrap();
        assert!(!daemon_hung_up(&a), "an open peer");
        drop(b);
        assert!(daemon_hung_up(&a), "the peer's end closed");
    }

    #[test]
    fn the_lease_is_reckoned_to_hold_three_quarters_of_its_ttl_after_a_request() {
        assert_eq!(lease_margin(10_000), Duration::from_millis(7_500));
        assert_eq!(lease_margin(10), Duration::from_millis(8));
    }

    #[test]
    fn a_missing_daemon_is_an_io_error_that_names_the_socket() {
        let dir = std::env::temp_dir().join(format!("kvd-client-test-{}", std::process::id()));
        let e = Client::connect(dir.join("nothing.sock"), &ClientOptions::named("t")).unwrap_err();
        assert!(
            matches!(&e, Error::Io(m) if m.contains("nothing.sock")),
            "{e}"
        );
    }
}
