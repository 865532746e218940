//! A scripted engine and scripted holders for the front's in-process tests.
//!
//! The engine is a tiny greedy "model": the next token is a function of the two before it, so
//! a run resumed from prompt + committed tokens continues exactly as the uninterrupted run
//! would. Each worker's engine takes a queue of [`Fault`]s, one per completion it is asked
//! for (none: it streams to the end). Killing an engine makes it fail its health checks and
//! refuse connections until it comes back; a stalled engine goes silent, health included.
//! While it streams, the engine checkpoints to the holder the body names (one token at a time,
//! as kvd's connector does per block), and [`Cluster`] keeps what each holder holds.
//!
//! P/D ([`Cluster::pd`]): prefill workers answer a prefill after [`PREFILL_MS`] and pin the
//! prompt's blocks under a hold bound to (request, epoch) at their node, as kvd's producer
//! connector does; a decode attempt with the hand-off's params loads from that hold (recorded,
//! hit or miss). Their faults: `KillAt(_)` dies, `StallAt(_)` hangs, `DropAt(_)` answers 500,
//! `Refuse` 400, `NoHandoff` answers without `kv_transfer_params`.

#![allow(dead_code)]

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use kvd_control::{ControlConfig, Controller, Epoch, Event, RequestId, WorkerId};
use kvd_core::{Error, Result};
use kvd_front::engine::{
    BoxFuture, ByteStream, Claim, Engines, EventStream, Forwarded, Held, Holders, Opened,
    PrefillAnswer, Records,
};
use kvd_front::front::{Admission, Opened as FrontStream};
use kvd_front::log::{ClientGuard, Read, StreamLog, changed};
use kvd_front::machine::Admitted;
use kvd_front::openai::{Api, Kind};
use kvd_front::{Front, FrontArgs, Hub, TokioClock};
use serde_json::{Value, json};

/// The prompt's length in [`Cluster::run`].
pub const PROMPT_TOKENS: u32 = 40;
/// Time between two tokens of a scripted engine.
pub const TOKEN_MS: u64 = 10;
/// Pool bytes a checkpoint takes per token.
pub const BYTES_PER_TOKEN: u64 = 1024;
/// Time a scripted prefill takes.
pub const PREFILL_MS: u64 = 20;
/// The first prefill worker's id in [`Cluster::pd`] (the others follow).
pub const FIRST_PREFILL: WorkerId = 11;

/// What one completion on an engine does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The engine dies after streaming this many tokens (0: during prefill).
    KillAt(usize),
    /// The connection breaks after this many tokens; the engine lives on.
    DropAt(usize),
    /// The engine hangs after this many tokens: silent stream, silent health check.
    StallAt(usize),
    /// The engine answers 400: it refuses the request itself.
    Refuse,
    /// A prefill worker answers without `kv_transfer_params` (it hands nothing over).
    NoHandoff,
}

/// The greedy model: the token after `history`.
pub fn next_token(history: &[u32]) -> u32 {
    let n = history.len();
    let a = history.get(n.wrapping_sub(1)).copied().unwrap_or(0);
    let b = history.get(n.wrapping_sub(2)).copied().unwrap_or(0);
    (a.wrapping_mul(31) ^ b.wrapping_mul(17)).wrapping_add(7) % 50_000
}

/// The tokens an uninterrupted run generates.
pub fn greedy(prompt: &[u32], n: usize) -> Vec<u32> {
    let mut h = prompt.to_vec();
    for _ in 0..n {
        h.push(next_token(&h));
    }
    h.split_off(prompt.len())
}

#[derive(Debug, Default)]
struct EngineState {
    dead: bool,
    stalled: bool,
    faults: VecDeque<Fault>,
    /// Streams whose connection is open.
    open: usize,
}

/// One completion the engines were asked for.
#[derive(Debug, Clone)]
pub struct Call {
    /// The worker asked.
    pub worker: WorkerId,
    /// The body.
    pub body: Value,
}

#[derive(Debug, Default)]
struct World {
    engines: BTreeMap<WorkerId, EngineState>,
    calls: Vec<Call>,
    /// holder → request → what it holds.
    held: BTreeMap<WorkerId, BTreeMap<RequestId, Held>>,
    /// Checkpoints ended: (holder, request, epoch).
    ended: Vec<(WorkerId, RequestId, Epoch)>,
    /// Holders that no longer answer.
    holders_down: Vec<WorkerId>,
    /// How long a holder takes to say what it holds (its answer is what it held when asked).
    held_delay: std::time::Duration,
    /// How long an engine takes to tokenize a text prompt.
    tokenize_delay: std::time::Duration,
    /// Faults for the next completions, whichever engine is asked (before its own).
    any: VecDeque<Fault>,
    /// P/D: the prefill workers.
    prefill: Vec<WorkerId>,
    /// P/D: the prefills asked for.
    prefills: Vec<Call>,
    /// P/D: prefills whose connection is open, per worker.
    prefills_open: BTreeMap<WorkerId, usize>,
    /// P/D: holds pinned: (node, request) → epoch.
    holds: BTreeMap<(WorkerId, RequestId), Epoch>,
    /// P/D: holds ended: (node, request, epoch) as asked.
    hold_ends: Vec<(WorkerId, RequestId, Epoch)>,
    /// P/D: decode attempts that loaded a hand-off: (decode worker, node, epoch, the hold was
    /// there).
    loads: Vec<(WorkerId, WorkerId, Epoch, bool)>,
}

/// The scripted engines and holders, shared.
#[derive(Debug, Clone, Default)]
pub struct Scripted(Arc<Mutex<World>>);

impl Scripted {
    fn w(&self) -> MutexGuard<'_, World> {
        self.0.lock().unwrap()
    }
}

/// A prefill's open connection (closed when its future is dropped or done).
#[derive(Debug)]
struct OpenPrefill {
    world: Scripted,
    worker: WorkerId,
}

impl Drop for OpenPrefill {
    fn drop(&mut self) {
        *self.world.w().prefills_open.get_mut(&self.worker).unwrap() -= 1;
    }
}

#[derive(Debug)]
struct Stream {
    world: Scripted,
    worker: WorkerId,
    history: Vec<u32>,
    left: usize,
    sent: usize,
    fault: Option<Fault>,
    checkpoint: Option<(WorkerId, RequestId, Epoch)>,
    done: bool,
}

impl Drop for Stream {
    fn drop(&mut self) {
        let mut w = self.world.w();
        let e = w.engines.get_mut(&self.worker).unwrap();
        e.open -= 1;
    }
}

impl Stream {
    async fn next_data(&mut self) -> Result<Option<String>> {
        if self.done {
            return Ok(None);
        }
        if self.left == 0 {
            self.done = true;
            return Ok(Some("[DONE]".into()));
        }
        tokio::time::sleep(Duration::from_millis(TOKEN_MS)).await;
        match self.fault {
            Some(Fault::KillAt(k)) if self.sent == k => {
                self.world.w().engines.get_mut(&self.worker).unwrap().dead = true;
                return Err(Error::Unavailable(
                    "the stream broke: connection reset".into(),
                ));
            }
            Some(Fault::DropAt(k)) if self.sent == k => {
                return Err(Error::Unavailable(
                    "the stream broke: connection reset".into(),
                ));
            }
            Some(Fault::StallAt(k)) if self.sent == k => {
                self.world
                    .w()
                    .engines
                    .get_mut(&self.worker)
                    .unwrap()
                    .stalled = true;
                return std::future::pending().await;
            }
            _ => {}
        }
        if self.world.w().engines[&self.worker].dead {
            return Err(Error::Unavailable("the stream broke: killed".into()));
        }
        let t = next_token(&self.history);
        self.history.push(t);
        self.sent += 1;
        self.left -= 1;
        if let Some((holder, request, epoch)) = self.checkpoint {
            let mut w = self.world.w();
            if !w.holders_down.contains(&holder) {
                let tokens = self.history.len() as u64;
                w.held.entry(holder).or_default().insert(
                    request,
                    Held {
                        epoch,
                        committed_tokens: tokens,
                        bytes: tokens * BYTES_PER_TOKEN,
                    },
                );
            }
        }
        let finish = (self.left == 0).then_some("length");
        let ev = json!({"id": "cmpl-x", "object": "text_completion",
            "choices": [{"index": 0, "text": format!(" t{t}"), "token_ids": [t], "finish_reason": finish}]});
        Ok(Some(ev.to_string()))
    }
}

impl EventStream for Stream {
    fn next(&mut self) -> BoxFuture<'_, Result<Option<String>>> {
        Box::pin(self.next_data())
    }
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .map(|a| a.iter().map(|t| t.as_u64().unwrap() as u32).collect())
        .unwrap_or_default()
}

impl Scripted {
    /// Engines for workers `1..=n`.
    pub fn new(n: u32) -> Scripted {
        let s = Scripted::default();
        for w in 1..=n {
            s.w().engines.insert(w, EngineState::default());
        }
        s
    }

    /// The next completions on `worker` do these (one each, in order).
    pub fn script(&self, worker: WorkerId, faults: &[Fault]) {
        self.w()
            .engines
            .get_mut(&worker)
            .unwrap()
            .faults
            .extend(faults);
    }

    /// The next completions, on whichever engine, do these (one each, in order).
    pub fn script_any(&self, faults: &[Fault]) {
        self.w().any.extend(faults);
    }

    /// Kill `worker`'s engine now.
    pub fn kill(&self, worker: WorkerId) {
        self.w().engines.get_mut(&worker).unwrap().dead = true;
    }

    /// `worker`'s engine comes back.
    pub fn revive(&self, worker: WorkerId) {
        let mut w = self.w();
        let e = w.engines.get_mut(&worker).unwrap();
        e.dead = false;
        e.stalled = false;
    }

    /// Streams open on `worker`'s engine.
    pub fn open_streams(&self, worker: WorkerId) -> usize {
        self.w().engines[&worker].open
    }

    /// The completions asked for so far.
    pub fn calls(&self) -> Vec<Call> {
        self.w().calls.clone()
    }

    /// What `holder` holds for `request`.
    pub fn held(&self, holder: WorkerId, request: RequestId) -> Option<Held> {
        self.w().held.get(&holder)?.get(&request).copied()
    }

    /// The checkpoints ended so far.
    pub fn ended(&self) -> Vec<(WorkerId, RequestId, Epoch)> {
        self.w().ended.clone()
    }

    /// Holders answer what they hold `d` after they are asked.
    pub fn holders_answer_after(&self, d: std::time::Duration) {
        self.w().held_delay = d;
    }

    /// Engines tokenize a text prompt `d` after they are asked.
    pub fn tokenize_after(&self, d: std::time::Duration) {
        self.w().tokenize_delay = d;
    }

    /// `holder` stops answering admin calls.
    pub fn holder_down(&self, holder: WorkerId) {
        self.w().holders_down.push(holder);
    }

    fn open(&self, worker: WorkerId, body: Value) -> Result<Opened> {
        let mut w = self.w();
        w.calls.push(Call {
            worker,
            body: body.clone(),
        });
        let e = &w.engines[&worker];
        if e.dead || e.stalled {
            return Err(Error::Unavailable(format!(
                "worker {worker}: connect: refused"
            )));
        }
        let own = w.engines.get_mut(&worker).unwrap().faults.pop_front();
        let fault = w.any.pop_front().or(own);
        if fault == Some(Fault::Refuse) {
            return Ok(Opened::Refused {
                status: 400,
                text: "no such model".into(),
            });
        }
        w.engines.get_mut(&worker).unwrap().open += 1;
        let kvd = &body["kv_transfer_params"]["kvd"];
        if body["kv_transfer_params"]["do_remote_prefill"] == json!(true) {
            let h = &kvd["handoff"];
            let (node, epoch) = (
                h["node"].as_u64().unwrap() as WorkerId,
                h["epoch"].as_u64().unwrap(),
            );
            let there = w.holds.get(&(node, h["request"].as_u64().unwrap())) == Some(&epoch);
            w.loads.push((worker, node, epoch, there));
        }
        let cp = &kvd["checkpoint"];
        let checkpoint = cp.get("holder").map(|h| {
            (
                h.as_u64().unwrap() as WorkerId,
                cp["request"].as_u64().unwrap(),
                cp["epoch"].as_u64().unwrap(),
            )
        });
        drop(w);
        Ok(Opened::Stream(Box::new(Stream {
            world: self.clone(),
            worker,
            history: ids(&body["prompt"]),
            left: body["max_tokens"].as_u64().unwrap() as usize,
            sent: 0,
            fault,
            checkpoint,
            done: false,
        })))
    }

    /// P/D: make workers `ids` the prefill pool.
    pub fn set_prefill_pool(&self, ids: &[WorkerId]) {
        let mut w = self.w();
        for id in ids {
            w.engines.insert(*id, EngineState::default());
        }
        w.prefill = ids.to_vec();
    }

    /// P/D: the prefills asked for so far.
    pub fn prefills(&self) -> Vec<Call> {
        self.w().prefills.clone()
    }

    /// P/D: prefills whose connection is open on `worker`.
    pub fn open_prefills(&self, worker: WorkerId) -> usize {
        self.w().prefills_open.get(&worker).copied().unwrap_or(0)
    }

    /// P/D: the holds pinned now: (node, request, epoch).
    pub fn holds(&self) -> Vec<(WorkerId, RequestId, Epoch)> {
        self.w()
            .holds
            .iter()
            .map(|(&(n, r), &e)| (n, r, e))
            .collect()
    }

    /// P/D: the hold ends asked for: (node, request, epoch).
    pub fn hold_ends(&self) -> Vec<(WorkerId, RequestId, Epoch)> {
        self.w().hold_ends.clone()
    }

    /// P/D: the decode attempts that loaded a hand-off: (decode worker, node, epoch, hit).
    pub fn loads(&self) -> Vec<(WorkerId, WorkerId, Epoch, bool)> {
        self.w().loads.clone()
    }

    /// Nothing runs on any engine: no stream, no prefill open.
    pub fn idle(&self) -> bool {
        let w = self.w();
        w.engines.values().all(|e| e.open == 0) && w.prefills_open.values().all(|n| *n == 0)
    }

    /// A prefill: the call recorded, its fault taken, its connection counted open.
    fn prefill_call(&self, worker: WorkerId, body: &Value) -> (Option<Fault>, Option<OpenPrefill>) {
        let mut w = self.w();
        w.prefills.push(Call {
            worker,
            body: body.clone(),
        });
        let e = w.engines.get_mut(&worker).unwrap();
        if e.dead || e.stalled {
            return (None, None);
        }
        let fault = e.faults.pop_front();
        *w.prefills_open.entry(worker).or_default() += 1;
        let open = OpenPrefill {
            world: self.clone(),
            worker,
        };
        (fault, Some(open))
    }

    async fn prefill_at(&self, worker: WorkerId, body: Value) -> Result<PrefillAnswer> {
        let (fault, open) = self.prefill_call(worker, &body);
        let Some(_open) = open else {
            return Err(Error::Unavailable(format!(
                "worker {worker}: connect: refused"
            )));
        };
        tokio::time::sleep(Duration::from_millis(PREFILL_MS)).await;
        let refused = |status: u16| {
            Ok(PrefillAnswer::Refused {
                status,
                text: format!("scripted {status}"),
            })
        };
        match fault {
            Some(Fault::KillAt(_)) => {
                self.kill(worker);
                return Err(Error::Unavailable("connection reset".into()));
            }
            Some(Fault::StallAt(_)) => {
                self.w().engines.get_mut(&worker).unwrap().stalled = true;
                return std::future::pending().await;
            }
            Some(Fault::DropAt(_)) => return refused(500),
            Some(Fault::Refuse) => return refused(400),
            Some(Fault::NoHandoff) => {
                return Ok(PrefillAnswer::Done(json!({"choices": [{"text": " x"}]})));
            }
            None => {}
        }
        if self.w().engines[&worker].dead {
            return Err(Error::Unavailable("connection reset".into()));
        }
        let kvd = &body["kv_transfer_params"]["kvd"];
        let (request, epoch) = (
            kvd["request"].as_u64().unwrap(),
            kvd["epoch"].as_u64().unwrap(),
        );
        let prompt = ids(&body["prompt"]);
        let blocks = prompt.len().div_ceil(16);
        self.w().holds.insert((worker, request), epoch);
        // vLLM answers the token's id when asked (`return_token_ids`), as the front does
        let token = next_token(&prompt);
        let token_ids = (body["return_token_ids"] == json!(true)).then_some(vec![token]);
        Ok(PrefillAnswer::Done(
            json!({"id": "cmpl-scripted", "object": "text_completion", "model": "scripted",
            "choices": [{"index": 0, "text": format!(" t{token}"), "finish_reason": "length",
                "token_ids": token_ids}],
            "kv_transfer_params": {"do_remote_prefill": true, "do_remote_decode": false,
                "remote_engine_id": format!("scripted-{worker}"), "remote_block_ids": (0..blocks).collect::<Vec<_>>(),
                "remote_host": "127.0.0.1", "remote_port": 5600,
                "kvd": {"handoff": {"node": worker, "namespace": "00ab", "blocks": blocks,
                    "request": request, "epoch": epoch}}}}),
        ))
    }

    async fn health_of(&self, worker: WorkerId) -> bool {
        let (dead, stalled) = {
            let w = self.w();
            (w.engines[&worker].dead, w.engines[&worker].stalled)
        };
        if stalled {
            std::future::pending::<()>().await;
        }
        !dead
    }
}

/// A forwarded answer's body: its bytes at once.
#[derive(Debug)]
struct Once(Option<Vec<u8>>);

impl ByteStream for Once {
    fn next(&mut self) -> BoxFuture<'_, Result<Option<Vec<u8>>>> {
        let b = self.0.take();
        Box::pin(async move { Ok(b) })
    }
}

impl Scripted {
    /// A completion without a stream (a taken-over stream's catch-up): the greedy tokens
    /// after the body's prompt, at once.
    fn forwarded(&self, worker: WorkerId, body: Value) -> Result<Forwarded> {
        let mut w = self.w();
        w.calls.push(Call {
            worker,
            body: body.clone(),
        });
        if w.engines[&worker].dead {
            return Err(Error::Unavailable(format!(
                "worker {worker}: connect: refused"
            )));
        }
        let mut history = ids(&body["prompt"]);
        let n = body["max_tokens"].as_u64().unwrap_or(16) as usize;
        let mut tokens = Vec::with_capacity(n);
        for _ in 0..n {
            let t = next_token(&history);
            history.push(t);
            tokens.push(t);
        }
        let text: String = tokens.iter().map(|t| format!(" t{t}")).collect();
        let answer = json!({"choices": [{"index": 0, "text": text, "token_ids": tokens,
            "finish_reason": "length"}]});
        Ok(Forwarded {
            status: 200,
            content_type: Some("application/json".into()),
            body: Box::new(Once(Some(answer.to_string().into_bytes()))),
        })
    }
}

/// The streams' records, in memory: what a replica keeps, another takes over (its owner is
/// taken to be gone).
#[derive(Debug, Default)]
pub struct MemRecords(Mutex<BTreeMap<RequestId, Value>>);

impl MemRecords {
    /// The record kept for `request`.
    pub fn get(&self, request: RequestId) -> Option<Value> {
        self.0.lock().unwrap().get(&request).cloned()
    }
}

impl Records for MemRecords {
    fn keep(&self, request: RequestId, record: Value) {
        self.0.lock().unwrap().insert(request, record);
    }

    fn forget(&self, request: RequestId) {
        self.0.lock().unwrap().remove(&request);
    }

    fn claim(&self, request: RequestId) -> BoxFuture<'_, Result<Claim>> {
        let r = self.get(request).map_or(Claim::Unknown, Claim::Taken);
        Box::pin(async move { Ok(r) })
    }
}

impl Engines for Scripted {
    fn forward(
        &self,
        worker: WorkerId,
        _path: &'static str,
        body: Vec<u8>,
    ) -> BoxFuture<'_, Result<Forwarded>> {
        let r = serde_json::from_slice(&body)
            .map_err(|e| Error::Protocol(e.to_string()))
            .and_then(|b| self.forwarded(worker, b));
        Box::pin(async move { r })
    }

    fn workers(&self) -> Vec<WorkerId> {
        let w = self.w();
        w.engines
            .keys()
            .copied()
            .filter(|id| !w.prefill.contains(id))
            .collect()
    }

    fn prefill_workers(&self) -> Vec<WorkerId> {
        self.w().prefill.clone()
    }

    fn prefill(&self, worker: WorkerId, body: Value) -> BoxFuture<'_, Result<PrefillAnswer>> {
        Box::pin(self.prefill_at(worker, body))
    }

    fn name(&self, worker: WorkerId) -> String {
        format!("scripted engine {worker}")
    }

    fn tokenize(&self, _: WorkerId, body: Value) -> BoxFuture<'_, Result<Vec<u32>>> {
        let text = body["prompt"].as_str().unwrap_or_default();
        let ids = text.bytes().map(u32::from).collect();
        let delay = self.w().tokenize_delay;
        Box::pin(async move {
            tokio::time::sleep(delay).await;
            Ok(ids)
        })
    }

    fn complete(&self, worker: WorkerId, body: Value) -> BoxFuture<'_, Result<Opened>> {
        let r = self.open(worker, body);
        Box::pin(async move { r })
    }

    fn health(&self, worker: WorkerId) -> BoxFuture<'_, bool> {
        Box::pin(self.health_of(worker))
    }
}

impl Holders for Scripted {
    fn held(&self, holder: WorkerId, request: RequestId) -> BoxFuture<'_, Result<Option<Held>>> {
        let w = self.w();
        let r = if w.holders_down.contains(&holder) {
            Err(Error::Unavailable(format!("holder {holder}: refused")))
        } else {
            Ok(w.held.get(&holder).and_then(|m| m.get(&request)).copied())
        };
        let delay = w.held_delay;
        Box::pin(async move {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            r
        })
    }

    fn end(&self, holder: WorkerId, request: RequestId, epoch: Epoch) -> BoxFuture<'_, Result<()>> {
        let mut w = self.w();
        w.ended.push((holder, request, epoch));
        if let Some(m) = w.held.get_mut(&holder) {
            if m.get(&request).is_some_and(|h| h.epoch == epoch) {
                m.remove(&request);
            }
        }
        Box::pin(async { Ok(()) })
    }

    fn end_hold(
        &self,
        node: WorkerId,
        request: RequestId,
        epoch: Epoch,
    ) -> BoxFuture<'_, Result<()>> {
        let mut w = self.w();
        w.hold_ends.push((node, request, epoch));
        if w.holds.get(&(node, request)).is_some_and(|e| *e <= epoch) {
            w.holds.remove(&(node, request));
        }
        Box::pin(async { Ok(()) })
    }
}

/// A front over `n` scripted workers (each with 1 GiB of checkpoint capacity, registered).
#[derive(Debug)]
pub struct Cluster {
    /// The engines and holders.
    pub engines: Scripted,
    /// The front.
    pub front: Arc<Front>,
}

/// The front's settings in tests: short timeouts.
pub fn args() -> FrontArgs {
    FrontArgs {
        engines: vec![],
        prefill_engines: vec![],
        kv_bytes_per_token: BYTES_PER_TOKEN,
        kv_tokens_per_block: 1,
        reconnect_grace_ms: 500,
        retain_ms: 60_000,
        engine_timeout_ms: 300,
        request_deadline_ms: 60_000,
        max_streams: 8,
        max_stream_bytes: 1 << 20,
        max_body_bytes: 1 << 20,
        resume_priority: None,
        route: kvd_front::config::RouteArgs::default(),
    }
}

impl Cluster {
    /// `n` workers, the controller's defaults.
    pub fn new(n: u32) -> Cluster {
        Cluster::with(n, ControlConfig::default(), args())
    }

    /// P/D: `n` decode workers (placed by the controller) and `m` prefill workers
    /// ([`FIRST_PREFILL`] on; registered nodes, not the controller's workers).
    pub fn pd(n: u32, m: u32, args: FrontArgs) -> Cluster {
        Cluster::build(n, m, ControlConfig::default(), args)
    }

    /// `n` workers with this controller and these settings.
    pub fn with(n: u32, config: ControlConfig, args: FrontArgs) -> Cluster {
        Cluster::build(n, 0, config, args)
    }

    fn build(n: u32, m: u32, config: ControlConfig, args: FrontArgs) -> Cluster {
        Cluster::build_over(Scripted::new(n), n, m, config, args)
    }

    /// Another front (a replica) over this one's engines and holders, with its own controller.
    pub fn replica(&self, n: u32) -> Cluster {
        Cluster::build_over(self.engines.clone(), n, 0, ControlConfig::default(), args())
    }

    fn build_over(
        engines: Scripted,
        n: u32,
        m: u32,
        config: ControlConfig,
        args: FrontArgs,
    ) -> Cluster {
        let hub = Hub::new(
            Controller::new(config).unwrap(),
            Arc::new(TokioClock::new()),
            0,
        );
        for w in 1..=n {
            hub.apply(&Event::WorkerJoined {
                worker: w,
                capacity_bytes: 1 << 30,
            })
            .unwrap();
            hub.node_registered(u64::from(w), &format!("holder-{w}"));
        }
        let pool: Vec<WorkerId> = (FIRST_PREFILL..FIRST_PREFILL + m).collect();
        for p in &pool {
            hub.node_registered(u64::from(*p), &format!("prefill-{p}"));
        }
        engines.set_prefill_pool(&pool);
        let front = Front::new(
            hub,
            args,
            Arc::new(engines.clone()),
            Arc::new(engines.clone()),
        );
        Cluster { engines, front }
    }

    /// The hub.
    pub fn hub(&self) -> &Arc<Hub> {
        self.front.hub()
    }

    /// Start a greedy request for `max_tokens` after `prompt`.
    pub async fn start(&self, prompt: &[u32], max_tokens: u32) -> (RequestId, Client) {
        let (id, log, guard) = admit_stream(
            &self.front,
            json!({"model": "m", "prompt": prompt, "max_tokens": max_tokens,
            "stream": true, "temperature": 0, "return_token_ids": true}),
        )
        .await
        .unwrap();
        (id, Client::new(log, guard, 0))
    }

    /// Script the next completions and start a request of `max_tokens` after a prompt of
    /// `PROMPT_TOKENS`.
    pub async fn start_with(&self, faults: &[Fault], max_tokens: u32) -> (RequestId, Client) {
        self.engines.script_any(faults);
        self.start(&prompt(PROMPT_TOKENS), max_tokens).await
    }

    /// Script the next completions, start a request of `max_tokens` after a prompt of
    /// `PROMPT_TOKENS`, and read it to its end.
    pub async fn run(&self, faults: &[Fault], max_tokens: u32) -> (RequestId, Client) {
        let (id, mut client) = self.start_with(faults, max_tokens).await;
        client.read_to_end().await;
        (id, client)
    }

    /// The worker serving `id` now (its record in the controller).
    pub fn serving(&self, id: RequestId) -> WorkerId {
        self.hub().request(id).unwrap().serving
    }

    /// The holder of `id` now.
    pub fn holder(&self, id: RequestId) -> Option<WorkerId> {
        self.hub().request(id).unwrap().holder
    }
}

/// One event the client got.
#[derive(Debug, Clone)]
pub struct Got {
    /// Its sequence number.
    pub seq: u64,
    /// Its data (`[DONE]` as a string).
    pub data: Value,
}

/// A client reading a stream.
#[derive(Debug)]
pub struct Client {
    log: Arc<StreamLog>,
    guard: Option<ClientGuard>,
    next: u64,
    /// What it got so far.
    pub got: Vec<Got>,
}

impl Client {
    /// A client reading `log` from `from` on.
    pub fn new(log: Arc<StreamLog>, guard: ClientGuard, from: u64) -> Client {
        Client {
            log,
            guard: Some(guard),
            next: from,
            got: Vec::new(),
        }
    }

    /// Read until the stream ends.
    pub async fn read_to_end(&mut self) {
        while !self.read_some().await {}
    }

    /// Read until at least `n` tokens came (or the end).
    pub async fn read_tokens(&mut self, n: usize) {
        while self.tokens().len() < n {
            if self.read_some().await {
                return;
            }
        }
    }

    /// Read what is there, waiting for something; whether the stream ended.
    async fn read_some(&mut self) -> bool {
        let mut rx = self.log.subscribe();
        loop {
            rx.borrow_and_update();
            match self.log.read(self.next) {
                Read::Gone(first) => panic!("events before {first} are gone"),
                Read::Frames(frames, done) => {
                    for f in &frames {
                        self.got.push(parse(f));
                    }
                    self.next += frames.len() as u64;
                    if done || !frames.is_empty() {
                        return done;
                    }
                }
            }
            changed(&mut rx).await;
        }
    }

    /// The client leaves (its connection drops).
    pub fn leave(&mut self) {
        self.guard = None;
    }

    /// The tokens it got, in sequence order.
    pub fn tokens(&self) -> Vec<u32> {
        let mut got = self.got.clone();
        got.sort_by_key(|g| g.seq);
        got.iter()
            .flat_map(|g| {
                g.data["choices"][0]["token_ids"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            })
            .map(|t| t.as_u64().unwrap() as u32)
            .collect()
    }

    /// It got the uninterrupted greedy run of `n` tokens after [`Cluster::run`]'s prompt, in
    /// sequence order, and no error.
    pub fn assert_greedy(&self, n: usize) {
        assert_eq!(
            self.tokens(),
            greedy(&prompt(PROMPT_TOKENS), n),
            "greedy continuation is exact"
        );
        assert_eq!(self.error(), None);
    }

    /// The error event it got, if any.
    pub fn error(&self) -> Option<String> {
        self.got
            .iter()
            .find_map(|g| g.data["error"]["message"].as_str().map(ToString::to_string))
    }

    /// The sequence numbers it got.
    pub fn seqs(&self) -> Vec<u64> {
        self.got.iter().map(|g| g.seq).collect()
    }

    /// Whether the last event was `[DONE]`.
    pub fn done(&self) -> bool {
        self.got.last().is_some_and(|g| g.data == json!("[DONE]"))
    }
}

fn parse(frame: &str) -> Got {
    let (id, data) = frame
        .strip_prefix("id: ")
        .and_then(|f| f.split_once("\ndata: "))
        .expect("id: R-S-T then data:");
    let seq = id.split('-').nth(1).unwrap().parse().unwrap();
    let data = data.trim_end();
    let data = serde_json::from_str(data).unwrap_or_else(|_| json!(data));
    Got { seq, data }
}

/// A client that takes the stream over from `Last-Event-ID: id-last`.
pub fn resume(front: &Front, id: RequestId, last: u64) -> Client {
    let (log, guard) = front.open(id).expect("the stream is kept");
    Client::new(log, guard, last + 1)
}

/// Wait (on the paused clock) until `cond` holds, at most `ms`.
pub async fn eventually(ms: u64, what: &str, mut cond: impl FnMut() -> bool) {
    let end = tokio::time::Instant::now() + Duration::from_millis(ms);
    while !cond() {
        assert!(tokio::time::Instant::now() < end, "never: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A prompt of `n` tokens.
pub fn prompt(n: u32) -> Vec<u32> {
    (1..=n).collect()
}

/// Read whatever `log` holds now, without waiting.
pub fn now_in(log: &StreamLog) -> usize {
    match log.read(0) {
        Read::Frames(f, _) => f.len(),
        Read::Gone(_) => 0,
    }
}

/// A request as admitted for the state machine's own tests: request 9, prompt [1, 2, 3],
/// served by worker 1 with its checkpoint on worker 2.
pub fn admitted(max_tokens: u32) -> Admitted {
    Admitted {
        id: 9,
        body: serde_json::Map::new(),
        prompt: vec![1, 2, 3],
        max_tokens,
        min_tokens: 0,
        want_token_ids: true,
        api: Api {
            kind: Kind::Completion,
            stream: true,
        },
        stops: None,
        epoch: 1,
        serving: 1,
        holder: Some(2),
        deadline_ms: 10_000,
        grace_ms: 1_000,
        resume_priority: None,
    }
}

/// Admit a streaming completion (the front runs it).
pub async fn admit_stream(front: &Arc<Front>, body: Value) -> Result<FrontStream> {
    let api = Api {
        kind: Kind::Completion,
        stream: true,
    };
    match front.admit(body, api).await? {
        Admission::Front(o) => Ok(o),
        Admission::Direct { reason, .. } => panic!("served without recovery: {reason}"),
    }
}
