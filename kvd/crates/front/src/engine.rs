//! The seams to the outside: the workers' engines ([`Engines`]) and the checkpoint holders'
//! admin calls ([`Holders`]). The front names the calls it makes (tokenize, stream a
//! completion, prefill, health; what a holder holds, end a checkpoint, end a hand-off's hold),
//! never an engine's URLs: vLLM's OpenAI server ([`crate::http::HttpEngines`]) is one
//! implementation, the tests' scripted engine another. Every wait on these calls is
//! bounded by the caller (the front), so an implementation that hangs is a silent engine.

use std::fmt::Debug;
use std::future::Future;
use std::pin::Pin;

use kvd_control::{Epoch, RequestId, WorkerId};
use kvd_core::Result;
use serde::Deserialize;
use serde_json::Value;

/// A boxed, sendable future (the traits are used as objects).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// How an engine answered a completion request.
#[derive(Debug)]
pub enum Opened {
    /// It streams; read the events off this. Dropping it drops the connection, which aborts
    /// the request in the engine.
    Stream(Box<dyn EventStream>),
    /// It answered with an error status before streaming: 5xx is the engine's trouble (the
    /// stream counts as broken), anything else a refusal of the request itself.
    Refused {
        /// The HTTP status.
        status: u16,
        /// What it said.
        text: String,
    },
}

/// How a prefill worker answered a prefill request (P/D).
#[derive(Debug, Clone, PartialEq)]
pub enum PrefillAnswer {
    /// The engine's JSON response (vLLM's completion, with the producer connector's
    /// `kv_transfer_params`).
    Done(Value),
    /// It answered with an error status: 4xx is a refusal of the request itself, 5xx the
    /// worker's trouble (a broken prefill).
    Refused {
        /// The HTTP status.
        status: u16,
        /// What it said.
        text: String,
    },
}

/// An engine's answer to a forwarded body: its head, and its body as it comes.
#[derive(Debug)]
pub struct Forwarded {
    /// The HTTP status.
    pub status: u16,
    /// Its `Content-Type`.
    pub content_type: Option<String>,
    /// The body.
    pub body: Box<dyn ByteStream>,
}

/// A body read as it comes.
pub trait ByteStream: Send + Debug {
    /// The next bytes; `Ok(None)` at the end.
    ///
    /// # Errors
    /// The connection broke.
    fn next(&mut self) -> BoxFuture<'_, Result<Option<Vec<u8>>>>;
}

/// One completion's event stream (OpenAI's `data:` events, `[DONE]` last).
pub trait EventStream: Send + Debug {
    /// The next event's data; `Ok(None)` when the engine closed the stream cleanly.
    ///
    /// # Errors
    /// The connection broke, or the stream is malformed.
    fn next(&mut self) -> BoxFuture<'_, Result<Option<String>>>;
}

/// The workers' engines, by worker id.
pub trait Engines: Send + Sync + Debug {
    /// The workers that have an engine, in id order.
    fn workers(&self) -> Vec<WorkerId>;

    /// How to name `worker`'s engine in messages (its address).
    fn name(&self, worker: WorkerId) -> String;

    /// The prompt's token ids, as `worker`'s engine tokenizes `body` (vLLM's `/tokenize` body:
    /// `model` with a `prompt`, or a chat's `messages` and the fields that shape their
    /// rendering, which the engine's chat template renders).
    ///
    /// # Errors
    /// The engine is unreachable, or refuses (a bad model name or messages:
    /// [`kvd_core::Error::InvalidArgument`]).
    fn tokenize(&self, worker: WorkerId, body: Value) -> BoxFuture<'_, Result<Vec<u32>>>;

    /// What `worker`'s engine serves: its `GET /v1/models` answer.
    ///
    /// # Errors
    /// The engine is unreachable or does not say.
    fn models(&self, worker: WorkerId) -> BoxFuture<'_, Result<Value>> {
        let _ = worker;
        Box::pin(async { Err(kvd_core::Error::Unavailable("no model list".into())) })
    }

    /// Send a client's body to `worker`'s engine as it is (`path`: `/v1/completions` or
    /// `/v1/chat/completions`), for a request the front serves without recovery: the answer's
    /// head and its body as it comes.
    ///
    /// # Errors
    /// The engine is unreachable.
    fn forward(
        &self,
        worker: WorkerId,
        path: &'static str,
        body: Vec<u8>,
    ) -> BoxFuture<'_, Result<Forwarded>> {
        let _ = (worker, path, body);
        Box::pin(async { Err(kvd_core::Error::Unavailable("no forwarding".into())) })
    }

    /// Start a streaming completion of `body` (an OpenAI `/v1/completions` body with token-id
    /// prompt, `stream` and `return_token_ids` set, and kvd's `kv_transfer_params`).
    ///
    /// # Errors
    /// The engine is unreachable (the front treats it as a broken stream).
    fn complete(&self, worker: WorkerId, body: Value) -> BoxFuture<'_, Result<Opened>>;

    /// The prefill workers (P/D's prefill pool; none when the front runs colocated), in id
    /// order. Disjoint from [`Engines::workers`].
    fn prefill_workers(&self) -> Vec<WorkerId> {
        Vec::new()
    }

    /// Prefill `body` on prefill worker `worker`: a non-streaming `/v1/completions` (token-id
    /// prompt, `max_tokens` 1, `stream` false, the producer's `kv_transfer_params`), answered
    /// once the prompt's blocks are held for the decode worker. Dropping the future drops the
    /// connection (vLLM aborts the request).
    ///
    /// # Errors
    /// The engine is unreachable or its answer is not JSON (the front treats it as a broken
    /// prefill).
    fn prefill(&self, worker: WorkerId, body: Value) -> BoxFuture<'_, Result<PrefillAnswer>>;

    /// Whether `worker`'s engine answers its health check.
    fn health(&self, worker: WorkerId) -> BoxFuture<'_, bool>;
}

/// A holder's answer about one checkpoint (the daemon's `CheckpointReport`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct Held {
    /// The epoch the checkpoint was written in.
    pub epoch: u64,
    /// Tokens its blocks cover.
    pub committed_tokens: u64,
    /// Pool bytes they take.
    pub bytes: u64,
}

/// The checkpoint holders' admin calls (`GET` and `DELETE /checkpoints/{request}` on a
/// daemon's admin address), and the end of a P/D hand-off's hold (`DELETE /holds/{request}`).
pub trait Holders: Send + Sync + Debug {
    /// What `holder` holds for `request` (`None`: nothing).
    ///
    /// # Errors
    /// The holder does not answer (the front then treats it as gone).
    fn held(&self, holder: WorkerId, request: RequestId) -> BoxFuture<'_, Result<Option<Held>>>;

    /// End `request`'s checkpoint of `epoch` on `holder` (nothing there is no error).
    ///
    /// # Errors
    /// The holder does not answer.
    fn end(&self, holder: WorkerId, request: RequestId, epoch: Epoch) -> BoxFuture<'_, Result<()>>;

    /// End the hand-off hold of `request` at `node`'s daemon (P/D: the prefill node pinned the
    /// prompt's blocks for the decode worker), if the hold's epoch is at most `epoch`. Nothing
    /// there is no error.
    ///
    /// # Errors
    /// The node's daemon does not answer.
    fn end_hold(
        &self,
        node: WorkerId,
        request: RequestId,
        epoch: Epoch,
    ) -> BoxFuture<'_, Result<()>>;

    /// A page of `node`'s daemon's block event log from `since` (at most `max` events), for
    /// cache-aware routing (`GET /events`). Without it the front routes by load alone.
    ///
    /// # Errors
    /// The daemon does not answer; `InvalidArgument` for a `since` past its log (a restarted
    /// daemon: read again from 0).
    fn events(
        &self,
        node: WorkerId,
        since: u64,
        max: u32,
    ) -> BoxFuture<'_, Result<crate::cache::EventsPage>> {
        let _ = (node, since, max);
        Box::pin(async { Err(kvd_core::Error::Unsupported("no event feed".into())) })
    }
}

/// What another front answers about a stream it does not serve itself.
#[derive(Debug, Clone, PartialEq)]
pub enum Claim {
    /// Its front is gone and this one owns it now: the record that front kept.
    Taken(Value),
    /// Its front lives, at this address: the client's resume goes there.
    Owner(String),
    /// No front keeps such a stream.
    Unknown,
}

/// Where a front keeps, for each request it serves, what another front needs to take the stream
/// over if this one dies: one record per request, written at admission and when its attempt's
/// epoch moves, removed at its end (etcd, in `kvd control`). Nothing per token.
pub trait Records: Send + Sync + Debug {
    /// Keep `record` for `request`, owned by this front. Nothing waits for the write.
    fn keep(&self, request: RequestId, record: Value);

    /// `request` ended here: its record goes. Nothing waits for it.
    fn forget(&self, request: RequestId);

    /// Take `request` over, if the front that owns it is gone.
    ///
    /// # Errors
    /// The store does not answer.
    fn claim(&self, request: RequestId) -> BoxFuture<'_, Result<Claim>>;

    /// What `/status` shows of the store and this front's place in it.
    fn status(&self) -> Value {
        Value::Null
    }
}
