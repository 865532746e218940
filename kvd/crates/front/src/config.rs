//! The front's settings (`kvd control`'s flags) and its fixed bounds.

use std::time::Duration;

/// The streaming front's arguments (part of `kvd control`).
#[derive(Debug, Clone, clap::Args)]
pub struct FrontArgs {
    /// A worker's engine, as ID=URL: the OpenAI-compatible server (vLLM's) of the node whose
    /// kvd daemon has node id ID, e.g. 1=http://10.0.0.1:8000. Repeat per worker. With at
    /// least one, `kvd control` serves the front (OpenAI's `/v1/completions`,
    /// `/v1/chat/completions` and `/v1/models`); it needs --etcd (the holders' admin addresses
    /// and the workers' capacities come from the nodes' registrations).
    #[arg(long = "engine", value_name = "ID=URL")]
    pub engines: Vec<String>,
    /// A prefill worker's engine, as ID=URL (prefill/decode disaggregation): the
    /// OpenAI-compatible server of a vLLM started with kvd's connector as `kv_producer`, on the
    /// node whose kvd daemon has node id ID. Repeat per prefill worker. With at least one, the
    /// front runs in P/D mode: each request's prompt is prefilled on the prefill worker with the
    /// fewest prefills running (ties: the lowest id), then decoded on the --engine worker the
    /// controller placed, which loads the prompt's blocks from the prefill node's daemon. An id
    /// may not be in both pools.
    #[arg(long = "prefill-engine", value_name = "ID=URL")]
    pub prefill_engines: Vec<String>,
    /// KV bytes per token of the served model (layers × 2 × KV heads × head dim × dtype
    /// bytes): a request's checkpoint reservation is (prompt + max_tokens), rounded up to whole
    /// blocks of --kv-tokens-per-block, × this.
    #[arg(long, default_value_t = 131072)]
    pub kv_bytes_per_token: u64,
    /// Tokens per KV block of the engines (vLLM's --block-size; its default is 16): holders
    /// store whole blocks, so a checkpoint's last, partly filled block takes a whole page.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=65_536))]
    pub kv_tokens_per_block: u64,
    /// How long a request whose client disconnected waits for it to reconnect
    /// (Last-Event-ID) before it is cancelled, ms.
    #[arg(long, default_value_t = 10_000)]
    pub reconnect_grace_ms: u64,
    /// How long a finished stream stays readable for a client that reconnects late, ms.
    #[arg(long, default_value_t = 60_000)]
    pub retain_ms: u64,
    /// Longest wait for an engine: to connect and answer, and between two events of its
    /// stream (a silent stream is a broken one), ms.
    #[arg(long, default_value_t = 30_000)]
    pub engine_timeout_ms: u64,
    /// A request's deadline from its arrival, ms; recovery never runs past it.
    #[arg(long, default_value_t = 600_000)]
    pub request_deadline_ms: u64,
    /// Requests streaming at once; past it new requests get 503 with Retry-After. As many finished streams
    /// are kept for clients that reconnect late (each at most --retain-ms; past that bound the
    /// oldest goes first).
    #[arg(long, default_value_t = 256)]
    pub max_streams: usize,
    /// Bytes of events kept per stream for clients that reconnect; past it the oldest go.
    #[arg(long, default_value_t = 4 << 20)]
    pub max_stream_bytes: usize,
    /// Largest request body, bytes; a larger one gets 413 and admits nothing.
    #[arg(long, default_value_t = 16 << 20)]
    pub max_body_bytes: usize,
    /// vLLM's request `priority` for an attempt that resumes an interrupted request (lower
    /// runs first; new requests have 0), so its survivor takes it before the prompts queued
    /// there, e.g. -1. The engines must run with `--scheduling-policy priority`: vLLM refuses a
    /// priority otherwise. A client's own lower priority is kept. Unset: no priority is sent.
    #[arg(long, allow_negative_numbers = true)]
    pub resume_priority: Option<i64>,
    /// Cache-aware routing.
    #[command(flatten)]
    pub route: RouteArgs,
}

/// Cache-aware routing (`kvd_front::cache`): a new request goes to the worker that scores best
/// by `--route-overlap-weight` × its node's cached blocks of the prompt − `--route-load-weight`
/// × the requests it serves. The cached blocks come from the daemons' block event logs; the
/// prompt's blocks are hashed as vLLM hashes them under `--prefix-caching-hash-algo
/// sha256_cbor`, which the engines must use for a prefix to be recognised (with any other
/// hash nothing matches, and routing is by load alone).
#[derive(Debug, Clone, clap::Args)]
pub struct RouteArgs {
    /// Route by cached prefix and load (false: by load alone, the fewest requests served).
    #[arg(long = "cache-routing", default_value_t = true, action = clap::ArgAction::Set)]
    pub cache_routing: bool,
    /// What one cached block of the prompt at a worker's node is worth.
    #[arg(long, default_value_t = 1.0)]
    pub route_overlap_weight: f64,
    /// What one request the worker already serves costs (in cached blocks, with the default
    /// overlap weight): 4 means a request's worth of queue outweighs 4 cached blocks.
    #[arg(long, default_value_t = 4.0)]
    pub route_load_weight: f64,
    /// How often the daemons' event logs are read, ms.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(10..=60_000))]
    pub route_events_ms: u64,
    /// Block tags the routing index holds at most (about 80 bytes each); stored events past it
    /// are dropped, counted.
    #[arg(long, default_value_t = 1_000_000)]
    pub route_max_blocks: usize,
    /// The seed of the engines' first block hash: their PYTHONHASHSEED if they set one, else
    /// vLLM's default.
    #[arg(long, default_value = crate::cache::VLLM_NONE_HASH_SEED)]
    pub route_hash_seed: String,
}

impl Default for RouteArgs {
    fn default() -> RouteArgs {
        RouteArgs {
            cache_routing: true,
            route_overlap_weight: 1.0,
            route_load_weight: 4.0,
            route_events_ms: 100,
            route_max_blocks: 1_000_000,
            route_hash_seed: crate::cache::VLLM_NONE_HASH_SEED.into(),
        }
    }
}

impl FrontArgs {
    /// The longest wait for an engine.
    pub fn engine_timeout(&self) -> Duration {
        Duration::from_millis(self.engine_timeout_ms)
    }

    /// Whether the front runs prefill/decode disaggregation (a prefill pool is given).
    pub fn pd(&self) -> bool {
        !self.prefill_engines.is_empty()
    }

    /// The pool bytes a request of `tokens` tokens reserves for its checkpoint: whole blocks,
    /// since a holder stores a partly filled last block in a whole page.
    pub fn reservation_bytes(&self, tokens: u64) -> u64 {
        let tpb = self.kv_tokens_per_block.max(1);
        tokens
            .div_ceil(tpb)
            .saturating_mul(tpb)
            .saturating_mul(self.kv_bytes_per_token)
    }
}

/// Most recoveries `/status` lists.
pub const RECOVERIES_KEPT: usize = 64;
/// Most hand-offs `/status` lists.
pub const HANDOFFS_KEPT: usize = 64;
/// How often the health watch asks each engine.
pub const HEALTH_EVERY: Duration = Duration::from_secs(1);
/// Longest wait for one health check or holder call.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// Misses in a row after which an in-service worker's engine counts as gone.
pub const HEALTH_MISSES: u32 = 2;
/// How often a running request's checkpoint progress is read from its holder.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(2);
/// A keep-alive comment to clients this often while nothing else is sent (so a client that
/// left is noticed even while its request waits for a survivor).
pub const KEEPALIVE: Duration = Duration::from_secs(1);

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        front: FrontArgs,
    }

    #[test]
    fn a_reservation_covers_whole_blocks() {
        let mut args = Cli::parse_from(["x"]).front;
        args.kv_bytes_per_token = 2048;
        args.kv_tokens_per_block = 32;
        // 1,300 tokens take 41 blocks of 32: the last one, 20 tokens, in a whole 64 KiB page
        assert_eq!(args.reservation_bytes(1300), 41 * 65_536);
        assert_eq!(args.reservation_bytes(1280), 40 * 65_536);
        assert_eq!(args.reservation_bytes(1), 65_536);
        args.kv_bytes_per_token = u64::MAX;
        assert_eq!(args.reservation_bytes(1300), u64::MAX);
    }
}
