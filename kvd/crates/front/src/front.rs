//! The [`Front`]: admission, the streams' logs, the running requests' tasks, recovery of a
//! failed worker's requests, and the health watch over the engines.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use kvd_control::{Decision, Epoch, Event, RequestId, WorkerId, WorkerPhase};
use kvd_core::{Error, Result};
use serde_json::{Value, json};
use tokio::time::{MissedTickBehavior, interval, timeout};

use crate::cache::{CacheIndex, RouteReason, RouteWeights, choose, vllm_block_tags};
use crate::config::{
    FrontArgs, HANDOFFS_KEPT, HEALTH_EVERY, HEALTH_MISSES, PROBE_TIMEOUT, RECOVERIES_KEPT,
};
use crate::engine::{Engines, Held, Holders, Records};
use crate::hub::Hub;
use crate::log::{ClientGuard, StreamLog};
use crate::machine::pd::HandoffNote;
use crate::machine::{Active, Input, Request};
use crate::openai::Models;
use crate::stats::{FrontStats, HandoffRecord, RecoveryRecord};

mod admission;

pub use admission::{Admission, MAX_RECORD_BYTES, Resumed};

/// A stream the front serves: its id, its log, and the client counted in.
pub type Opened = (RequestId, Arc<StreamLog>, ClientGuard);

/// The streaming front.
#[derive(Debug)]
pub struct Front {
    hub: Arc<Hub>,
    args: FrontArgs,
    engines: Arc<dyn Engines>,
    holders: Arc<dyn Holders>,
    streams: Mutex<HashMap<RequestId, Arc<StreamLog>>>,
    /// Finished streams still readable, oldest first (when each finished, on the hub's clock).
    finished: Mutex<VecDeque<(u64, RequestId)>>,
    active: Mutex<HashMap<RequestId, Active>>,
    recoveries: Mutex<VecDeque<RecoveryRecord>>,
    /// P/D: prefills running per prefill worker (each worker of the pool is in it).
    prefill_load: Mutex<BTreeMap<WorkerId, u32>>,
    /// P/D: the last hand-offs.
    handoffs: Mutex<VecDeque<HandoffRecord>>,
    /// Cache-aware routing: which worker's node holds which blocks.
    cache: Mutex<CacheIndex>,
    /// What the engines serve, and when it was learnt (the hub's clock).
    models: Mutex<Option<(u64, Models)>>,
    /// Front replicas: where this front keeps what another needs to take its streams over.
    records: std::sync::OnceLock<Arc<dyn Records>>,
}

/// Events one read of a daemon's log asks for.
const FEED_PAGE: u32 = 4096;
/// Reads of one daemon's log per round of the feed (a backlog is read over several rounds).
const FEED_PAGES_PER_ROUND: usize = 8;

/// A prefill counted in its worker's load while it lives.
#[derive(Debug)]
pub(crate) struct PrefillSlot {
    front: Arc<Front>,
    worker: WorkerId,
}

impl Drop for PrefillSlot {
    fn drop(&mut self) {
        if let Some(n) = lock(&self.front.prefill_load).get_mut(&self.worker) {
            *n = n.saturating_sub(1);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What `holder` holds for `id`, asked within [`PROBE_TIMEOUT`].
async fn held_within(
    holders: &dyn Holders,
    holder: WorkerId,
    id: RequestId,
) -> Result<Option<Held>> {
    timeout(PROBE_TIMEOUT, holders.held(holder, id))
        .await
        .map_err(|_| Error::Unavailable(format!("node {holder}: no answer")))?
}

impl Front {
    /// A front over `hub` that reaches the engines and holders through these.
    pub fn new(
        hub: Arc<Hub>,
        args: FrontArgs,
        engines: Arc<dyn Engines>,
        holders: Arc<dyn Holders>,
    ) -> Arc<Front> {
        let prefill_load = engines
            .prefill_workers()
            .into_iter()
            .map(|w| (w, 0))
            .collect();
        let cache = Mutex::new(CacheIndex::new(args.route.route_max_blocks));
        Arc::new(Front {
            cache,
            models: Mutex::default(),
            records: std::sync::OnceLock::new(),
            prefill_load: Mutex::new(prefill_load),
            handoffs: Mutex::default(),
            hub,
            args,
            engines,
            holders,
            streams: Mutex::default(),
            finished: Mutex::default(),
            active: Mutex::default(),
            recoveries: Mutex::default(),
        })
    }

    /// The hub it shares with the service.
    pub fn hub(&self) -> &Arc<Hub> {
        &self.hub
    }

    /// Its settings.
    pub fn args(&self) -> &FrontArgs {
        &self.args
    }

    pub(crate) fn engines(&self) -> &dyn Engines {
        &*self.engines
    }

    pub(crate) fn count(&self, f: impl FnOnce(&mut FrontStats)) {
        self.hub.count_front(f);
    }

    /// The counters.
    pub fn stats(&self) -> FrontStats {
        self.hub.front_stats()
    }

    /// Apply `e`; its decisions (a refused event is logged and changes nothing).
    pub(crate) fn apply(&self, e: &Event) -> Vec<Decision> {
        self.hub.apply(e).unwrap_or_else(|err| {
            tracing::debug!(event = ?e, error = %err, "front: event refused");
            vec![]
        })
    }

    /// Where a new request of `prompt` goes: the least loaded worker (`first`) unless
    /// cache-aware routing finds a worker whose node holds enough of the prompt's prefix to
    /// outweigh its queue (`kvd_front::cache`); and, with routing on, the most of the prompt's
    /// leading blocks any node holds (the connector's cluster lookup asks for no more).
    fn route(&self, first: WorkerId, prompt: &[u32]) -> (WorkerId, Option<usize>) {
        let r = &self.args.route;
        if !r.cache_routing {
            return (first, None);
        }
        let block = usize::try_from(self.args.kv_tokens_per_block).unwrap_or(usize::MAX);
        let tags = vllm_block_tags(prompt, block, &r.route_hash_seed);
        let engines = self.engines.workers();
        let candidates: Vec<(WorkerId, u32, usize)> = {
            let load = self.hub.load();
            let index = lock(&self.cache);
            load.in_service()
                .filter(|w| engines.contains(&w.id))
                .map(|w| (w.id, w.serving_requests, index.overlap(w.id, &tags)))
                .collect()
        };
        let weights = RouteWeights {
            overlap: r.route_overlap_weight,
            load: r.route_load_weight,
        };
        let anywhere = candidates.iter().map(|c| c.2).max();
        let Some((to, reason)) = choose(&candidates, weights) else {
            return (first, None);
        };
        let cached = candidates.iter().find(|c| c.0 == to).map_or(0, |c| c.2) as u64;
        self.count(|s| {
            s.routed_cached_blocks += cached;
            match reason {
                RouteReason::Load => s.routed_by_load += 1,
                RouteReason::Cache => s.routed_by_cache += 1,
                RouteReason::LoadOverCache => s.routed_load_over_cache += 1,
            }
        });
        tracing::debug!(
            worker = to,
            ?reason,
            cached,
            blocks = tags.len(),
            "front: routed"
        );
        (to, anywhere)
    }

    /// Start the routing index's feed (until the process ends): every `--route-events-ms`,
    /// each worker's node's block events since the last read.
    pub fn spawn_cache_feed(self: &Arc<Self>) {
        if !self.args.route.cache_routing {
            return;
        }
        let f = Arc::clone(self);
        tokio::spawn(async move { f.cache_feed().await });
    }

    async fn cache_feed(&self) {
        let mut tick = interval(std::time::Duration::from_millis(
            self.args.route.route_events_ms,
        ));
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            for w in self.engines.workers() {
                if self.hub.node_admin(u64::from(w)).is_none() {
                    lock(&self.cache).forget(w); // its registration ended: so did its blocks
                    continue;
                }
                self.feed_from(w).await;
            }
        }
    }

    /// Read `w`'s node's event log into the index, a bounded number of pages.
    async fn feed_from(&self, w: WorkerId) {
        for _ in 0..FEED_PAGES_PER_ROUND {
            let since = lock(&self.cache).since(w);
            match timeout(PROBE_TIMEOUT, self.holders.events(w, since, FEED_PAGE)).await {
                Ok(Ok(page)) => {
                    let n = page.events.len();
                    let was = {
                        let mut cache = lock(&self.cache);
                        cache.apply(w, &page);
                        cache.read_again(w)
                    };
                    if let Some(why) = was {
                        tracing::info!(worker = w, last_error = %why, "front: a node's block events are read again");
                    }
                    if n < FEED_PAGE as usize {
                        return;
                    }
                }
                // a restarted daemon's log is shorter than where the feed stood: from 0
                Ok(Err(Error::InvalidArgument(_))) => {
                    lock(&self.cache).forget(w);
                    return;
                }
                Ok(Err(Error::Unsupported(_))) => return,
                Ok(Err(e)) => return self.feed_failed(w, false, e.to_string()),
                Err(_) => {
                    let why = format!("no answer in {} ms", PROBE_TIMEOUT.as_millis());
                    return self.feed_failed(w, true, why);
                }
            }
        }
    }

    /// A read of `w`'s node's log failed: counted (a timeout apart: a loaded daemon, or one
    /// that hangs), and logged once per run of failures. The index keeps what it had.
    fn feed_failed(&self, w: WorkerId, timed_out: bool, why: String) {
        self.count(|s| {
            if timed_out {
                s.route_feed_timeouts += 1;
            } else {
                s.route_feed_errors += 1;
            }
        });
        if lock(&self.cache).read_failed(w, why.clone()) {
            tracing::warn!(worker = w, error = %why, "front: reading a node's block events failed; routing uses what was read before until a read succeeds");
        }
    }

    /// What the routing index holds, for `/status`.
    pub fn cache_figures(&self) -> crate::cache::IndexFigures {
        lock(&self.cache).figures()
    }

    /// Whether `worker` is in service now.
    fn in_service(&self, worker: WorkerId) -> bool {
        self.hub.load().get(worker).is_some_and(|w| w.in_service())
    }

    /// The in-service worker with an engine that will start a new request soonest
    /// ([`kvd_control::admission`]: a free batch slot first, then the fewest requests, those
    /// not yet started, or resumed and not yet at their next token, counted twice).
    fn pick_worker(&self) -> Option<WorkerId> {
        let engines = self.engines.workers();
        let rows = self.hub.with(|c| c.admission_rows());
        kvd_control::admission::pick(rows.into_iter().filter(|r| engines.contains(&r.id)))
    }

    /// P/D: the prefill worker not in `tried` with the fewest prefills running (ties: the
    /// lowest id).
    pub(crate) fn pick_prefill(&self, tried: &[WorkerId]) -> Option<WorkerId> {
        lock(&self.prefill_load)
            .iter()
            .filter(|(w, _)| !tried.contains(w))
            .min_by_key(|(w, n)| (**n, **w))
            .map(|(w, _)| *w)
    }

    /// P/D: count a prefill on `worker` while the slot lives.
    pub(crate) fn prefill_slot(self: &Arc<Self>, worker: WorkerId) -> PrefillSlot {
        if let Some(n) = lock(&self.prefill_load).get_mut(&worker) {
            *n += 1;
        }
        self.count(|s| s.prefills_started += 1);
        PrefillSlot {
            front: Arc::clone(self),
            worker,
        }
    }

    /// Whether the front runs P/D (it has a prefill pool).
    fn disaggregated(&self) -> bool {
        !lock(&self.prefill_load).is_empty()
    }

    /// A client (re)connects to stream `id` (`Last-Event-ID`): its log, the client counted in.
    pub fn open(&self, id: RequestId) -> Option<(Arc<StreamLog>, ClientGuard)> {
        let log = self.log_of(id)?;
        self.count(|s| s.clients_resumed += 1);
        let guard = log.client();
        Some((log, guard))
    }

    pub(crate) fn set_active(&self, m: &Request) {
        if !m.state().is_terminal() {
            lock(&self.active).insert(m.id(), m.active());
        }
    }

    /// The request's task ended: its stream stays readable a while (see
    /// [`Front::retire_finished`]).
    pub(crate) fn request_done(&self, id: RequestId) {
        if let Some(r) = self.records.get() {
            r.forget(id);
        }
        self.hub.unwatch_request(id);
        lock(&self.active).remove(&id);
        lock(&self.finished).push_back((self.hub.now_ms(), id));
        self.retire_finished();
    }

    /// Drop the finished streams past `--retain-ms` or past `--max-streams` of them (oldest
    /// first); how many requests are streaming.
    pub fn retire_finished(&self) -> usize {
        let now = self.hub.now_ms();
        let mut finished = lock(&self.finished);
        let mut streams = lock(&self.streams);
        while let Some(&(at, id)) = finished.front() {
            if now.saturating_sub(at) < self.args.retain_ms
                && finished.len() <= self.args.max_streams
            {
                break;
            }
            finished.pop_front();
            streams.remove(&id);
        }
        streams.len().saturating_sub(finished.len())
    }

    fn log_of(&self, id: RequestId) -> Option<Arc<StreamLog>> {
        self.retire_finished();
        lock(&self.streams).get(&id).cloned()
    }

    /// `GET /status`: the controller's counters, the front's, its running streams and its last
    /// recoveries.
    pub fn status(&self) -> Value {
        let active: BTreeMap<String, Active> = lock(&self.active)
            .iter()
            .map(|(id, a)| (id.to_string(), *a))
            .collect();
        let recoveries: Vec<RecoveryRecord> = lock(&self.recoveries).iter().cloned().collect();
        let feed_failing = lock(&self.cache).failing().clone();
        let mut v = json!({
            "controller": self.hub.stats(),
            "front": self.stats(),
            "streams": lock(&self.streams).len(),
            "active": active,
            "recoveries": recoveries,
            "routing": {"cache_routing": self.args.route.cache_routing, "index": self.cache_figures(),
                "feed_failing": feed_failing},
            "replicas": self.records.get().map_or(Value::Null, |r| r.status()),
        });
        if self.disaggregated() {
            let handoffs: Vec<HandoffRecord> = lock(&self.handoffs).iter().cloned().collect();
            let load: BTreeMap<String, u32> = lock(&self.prefill_load)
                .iter()
                .map(|(w, n)| (w.to_string(), *n))
                .collect();
            v["handoffs"] = json!(handoffs);
            v["prefilling"] = json!(load);
        }
        v
    }

    /// A recovery is done: log, count and list it.
    pub(crate) fn recovered(&self, rec: RecoveryRecord) {
        tracing::info!(
            target: "kvd::recovery",
            request = rec.request,
            epoch = rec.epoch,
            from = rec.from,
            to = rec.to,
            kv_source = ?rec.kv_source,
            load_tokens = rec.load_tokens,
            recompute_tokens = rec.recompute_tokens,
            committed_tokens = rec.committed_tokens,
            recovery_ms = rec.recovery_ms,
            reason = %rec.reason,
            "request recovered"
        );
        self.count(|s| s.recovered(&rec));
        let mut r = lock(&self.recoveries);
        if r.len() >= RECOVERIES_KEPT {
            r.pop_front();
        }
        r.push_back(rec);
    }

    /// P/D: end `id`'s hand-off hold at `node`'s daemon (epochs up to `epoch`), within
    /// [`PROBE_TIMEOUT`]; counted either way (a hold not ended runs out with its lease).
    pub(crate) async fn end_hold(&self, node: WorkerId, id: RequestId, epoch: Epoch) {
        let end = async {
            if self.hub.node_admin(u64::from(node)).is_none() {
                return Err(Error::NotFound(format!("node {node} is not registered")));
            }
            timeout(PROBE_TIMEOUT, self.holders.end_hold(node, id, epoch))
                .await
                .map_err(|_| Error::Unavailable(format!("node {node}: no answer")))?
        };
        match end.await {
            Ok(()) => self.count(|s| s.holds_ended += 1),
            Err(e) => {
                self.count(|s| s.hold_ends_failed += 1);
                tracing::warn!(request = id, node, epoch, error = %e, "front: P/D: ending the hand-off hold failed; its lease ends it");
            }
        }
    }

    /// P/D: one line and one counter per hand-off window (and the hand-off list).
    pub(crate) fn handoff_noted(&self, id: RequestId, epoch: Epoch, note: HandoffNote) {
        match note {
            HandoffNote::Started {
                prefill,
                decode,
                prefill_ms,
                not_relayed,
            } => {
                self.count(|s| {
                    s.handoffs_started += 1;
                    s.prefill_ms += prefill_ms;
                    s.first_tokens_from_prefill += u64::from(not_relayed.is_none());
                });
                tracing::info!(
                    request = id,
                    epoch,
                    prefill,
                    decode,
                    prefill_ms,
                    first_token = not_relayed.as_deref().unwrap_or("from the prefill"),
                    "front: P/D: prefilled; the decode worker takes the hand-off"
                );
            }
            HandoffNote::Done(rec) => self.handoff_done(rec),
            HandoffNote::PrefillRetried {
                from,
                epoch,
                reason,
            } => {
                self.count(|s| s.prefill_retries += 1);
                tracing::warn!(request = id, epoch, from, reason = %reason, "front: P/D: the prefill broke; prefilling again under a new epoch on another prefill worker (or the decode worker)");
            }
            HandoffNote::SelfPrefill { reason } => {
                self.count(|s| s.self_prefills += 1);
                tracing::warn!(request = id, epoch, reason = %reason, "front: P/D: no hand-off; the decode worker prefills the prompt itself");
            }
            HandoffNote::PrefillRefused { status } => {
                self.count(|s| s.prefills_refused += 1);
                tracing::warn!(
                    request = id,
                    epoch,
                    status,
                    "front: P/D: the prefill worker refused the request; it fails"
                );
            }
            HandoffNote::DecodeRefused => {
                self.count(|s| s.handoffs_refused += 1);
                tracing::warn!(
                    request = id,
                    epoch,
                    "front: P/D: the decode worker failed the hand-off's request; the hold ends and the request fails"
                );
            }
            HandoffNote::Resumed { to } => {
                self.count(|s| s.handoffs_resumed += 1);
                tracing::warn!(
                    request = id,
                    epoch,
                    to,
                    "front: P/D: the decode broke before its first token; the survivor takes the hand-off (the source still holds the blocks)"
                );
            }
            HandoffNote::Cancelled { during } => {
                self.count(|s| s.handoffs_cancelled += 1);
                tracing::info!(request = id, epoch, during = %during, "front: P/D: the client left during the hand-off; the prefill is dropped and the hold ends");
            }
            HandoffNote::StaleAnswer { epoch: old } => {
                self.count(|s| s.prefill_answers_stale += 1);
                tracing::info!(
                    request = id,
                    epoch,
                    answer_epoch = old,
                    "front: P/D: an older epoch's prefill answer came late; dropped, its hold ends"
                );
            }
        }
    }

    fn handoff_done(&self, rec: HandoffRecord) {
        tracing::info!(
            request = rec.request,
            epoch = rec.epoch,
            prefill = rec.prefill,
            decode = rec.decode,
            hold_node = ?rec.hold_node,
            prefill_ms = rec.prefill_ms,
            handoff_ms = rec.handoff_ms,
            "front: P/D: the decode's first token; the hand-off is done and its hold ends"
        );
        self.count(|s| {
            s.handoffs_done += 1;
            s.handoff_ms += rec.handoff_ms;
        });
        self.hub.observe_handoff(rec.handoff_ms);
        let mut h = lock(&self.handoffs);
        if h.len() >= HANDOFFS_KEPT {
            h.pop_front();
        }
        h.push_back(rec);
    }

    /// `id`'s attempt on `worker` broke and its engine is gone: fail the worker (and the holders
    /// that do not answer); the plan for `id`, as its machine's input.
    pub(crate) async fn recover_worker(
        &self,
        worker: WorkerId,
        id: RequestId,
        epoch: Epoch,
    ) -> Input {
        let mut failed = vec![worker];
        failed.extend(self.report_checkpoints(&[worker]).await);
        failed.sort_unstable();
        failed.dedup();
        tracing::warn!(request = id, workers = ?failed, "front: the stream broke; failing the worker");
        if let Err(e) = self.fail_workers(&failed) {
            return Input::Unplanned {
                epoch,
                reason: format!("the controller refused the failure: {e}"),
            };
        }
        match self.hub.take_plan(id) {
            Some(d) => Input::Plan(d),
            None => Input::Unplanned {
                epoch,
                reason: format!("worker {worker} failed, but no plan names request {id}"),
            },
        }
    }

    fn fail_workers(&self, failed: &[WorkerId]) -> Result<()> {
        let plan = self.hub.fail(failed)?;
        self.count(|s| s.workers_failed += plan.failed_workers.len() as u64);
        Ok(())
    }

    /// Before failing `workers`: report what the holders of their requests hold now, so the
    /// plan loads what is there. The holders that do not answer are returned: they are gone too.
    async fn report_checkpoints(&self, workers: &[WorkerId]) -> Vec<WorkerId> {
        let runs: Vec<(RequestId, Active)> = lock(&self.active)
            .iter()
            .filter(|(_, a)| workers.contains(&a.serving))
            .map(|(id, a)| (*id, *a))
            .collect();
        let mut gone = Vec::new();
        let mut tasks = tokio::task::JoinSet::new();
        for (id, a) in runs {
            let Some(h) = a.holder else { continue };
            if self.hub.node_admin(u64::from(h)).is_none() {
                gone.push(h);
                continue;
            }
            let holders = Arc::clone(&self.holders);
            tasks.spawn(async move { (id, a, h, held_within(&*holders, h, id).await) });
        }
        while let Some(Ok((id, a, h, held))) = tasks.join_next().await {
            match held {
                Ok(Some(held)) => {
                    let history = a.prompt as usize + a.generated as usize;
                    self.report_held(id, a.epoch, history, &held);
                    self.count(|s| {
                        s.checkpoint_bytes += held.bytes;
                        s.checkpoint_tokens += held.committed_tokens;
                    });
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(request = id, holder = h, error = %e, "front: the holder does not answer; treated as gone");
                    self.count(|s| s.holder_calls_failed += 1);
                    gone.push(h);
                }
            }
        }
        gone.sort_unstable();
        gone.dedup();
        gone
    }

    /// What `holder` holds for `id` (a holder that is not registered: [`Error::NotFound`]).
    async fn held(&self, holder: WorkerId, id: RequestId) -> Result<Option<Held>> {
        if self.hub.node_admin(u64::from(holder)).is_none() {
            return Err(Error::NotFound(format!("node {holder} is not registered")));
        }
        held_within(&*self.holders, holder, id).await
    }

    /// Tell the controller what the holder holds for a running request.
    pub(crate) async fn report_progress(
        &self,
        holder: WorkerId,
        id: RequestId,
        epoch: Epoch,
        history: usize,
    ) {
        if let Ok(Some(held)) = self.held(holder, id).await {
            self.report_held(id, epoch, history, &held);
        }
    }

    /// End `id`'s checkpoint of `epoch` at `holder` (`measure`: count what it holds first).
    pub(crate) async fn end_checkpoint(
        &self,
        holder: WorkerId,
        id: RequestId,
        epoch: Epoch,
        measure: bool,
    ) {
        if self.hub.node_admin(u64::from(holder)).is_none() {
            return;
        }
        if measure {
            if let Ok(Some(held)) = self.held(holder, id).await {
                if held.epoch == epoch {
                    self.count(|s| {
                        s.checkpoint_bytes += held.bytes;
                        s.checkpoint_tokens += held.committed_tokens;
                    });
                }
            }
        }
        let end = timeout(PROBE_TIMEOUT, self.holders.end(holder, id, epoch)).await;
        if !matches!(end, Ok(Ok(()))) {
            tracing::debug!(request = id, holder, "front: ending the checkpoint failed");
        }
    }

    fn report_held(&self, id: RequestId, epoch: Epoch, history: usize, held: &Held) {
        if held.epoch != epoch {
            return;
        }
        // Each ask runs on its own task: an answer that arrives after the request ended, or
        // moved to another epoch or lost its holder, is stale (its reservation is gone), not
        // a holder holding more than it reserved.
        let Some(rec) = self.hub.request(id) else {
            return;
        };
        if rec.epoch != epoch || rec.holder.is_none() {
            return;
        }
        let tokens = held
            .committed_tokens
            .min(history as u64)
            .min(u64::from(u32::MAX)) as u32;
        // The reservation was sized from --kv-bytes-per-token in whole --kv-tokens-per-block
        // blocks; a holder that needs more pool for the same tokens means those figures are too
        // small. The tokens are what a plan needs: say so loudly and report the bytes at the
        // reservation rather than lose the checkpoint.
        let reserved = rec.reserved_bytes;
        let bytes = if held.bytes > reserved {
            self.count(|s| s.checkpoint_reports_clamped += 1);
            tracing::warn!(
                request = id,
                held = held.bytes,
                reserved,
                tokens,
                "front: the holder holds more bytes than the request reserved: --kv-bytes-per-token × --kv-tokens-per-block is below the pool's page size, or the engines' blocks hold more tokens than --kv-tokens-per-block"
            );
            reserved
        } else {
            held.bytes
        };
        if let Err(e) = self.hub.apply(&Event::CheckpointStored {
            request_id: id,
            epoch,
            tokens,
            bytes,
        }) {
            tracing::warn!(request = id, error = %e, "front: checkpoint report refused");
        }
    }

    /// Start the health watch (until the process ends).
    pub fn spawn_health_watch(self: &Arc<Self>) {
        let f = Arc::clone(self);
        tokio::spawn(async move { f.health_watch().await });
    }

    /// Every [`HEALTH_EVERY`]: fail an in-service worker whose engine stopped answering
    /// ([`HEALTH_MISSES`] in a row); bring back a failed one whose engine answers again and
    /// whose node is registered. A round probes every engine at once, so an engine that hangs
    /// (a probe that takes all of [`PROBE_TIMEOUT`]) does not delay noticing another.
    async fn health_watch(&self) {
        let mut misses: BTreeMap<WorkerId, u32> = BTreeMap::new();
        let mut tick = interval(HEALTH_EVERY);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let load = self.hub.load();
            let probes = self.engines.workers().into_iter().filter_map(|w| {
                let phase = load.get(w).map(|l| l.phase)?;
                Some(async move {
                    let ok = timeout(PROBE_TIMEOUT, self.engines.health(w))
                        .await
                        .unwrap_or(false);
                    (w, phase, ok)
                })
            });
            for (w, phase, ok) in futures_util::future::join_all(probes).await {
                let m = misses.entry(w).or_insert(0);
                *m = if ok { 0 } else { *m + 1 };
                self.health_seen(w, phase, ok, *m).await;
            }
        }
    }

    async fn health_seen(&self, w: WorkerId, phase: WorkerPhase, ok: bool, misses: u32) {
        match phase {
            WorkerPhase::FullService if misses >= HEALTH_MISSES => {
                tracing::warn!(
                    worker = w,
                    engine = %self.engines.name(w),
                    "front: the engine stopped answering; failing the worker"
                );
                let mut failed = vec![w];
                failed.extend(self.report_checkpoints(&[w]).await);
                let _ = self.fail_workers(&failed);
            }
            WorkerPhase::Failed if ok && self.hub.node_admin(u64::from(w)).is_some() => {
                self.apply(&Event::WorkerRecovered { worker: w });
                self.promote(w);
                self.count(|s| s.workers_recovered += 1);
                tracing::info!(
                    worker = w,
                    "front: the engine answers again; the worker is back"
                );
            }
            WorkerPhase::LoadingDraft | WorkerPhase::Assist | WorkerPhase::HotSwap if ok => {
                self.promote(w);
            }
            _ => {}
        }
    }

    /// A recovering worker whose engine answers is whole: every recovery phase is done.
    fn promote(&self, w: WorkerId) {
        for phase in [
            WorkerPhase::LoadingDraft,
            WorkerPhase::Assist,
            WorkerPhase::HotSwap,
        ] {
            if self.hub.load().get(w).map(|l| l.phase) == Some(phase) {
                self.apply(&Event::WorkerPhaseDone { worker: w, phase });
            }
        }
    }
}
