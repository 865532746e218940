"""kvd as SGLang's HiCache L3 storage backend (``HiCacheStorage``), for SGLang 0.5.23.

SGLang builds it through its dynamic backend: ``StorageBackendFactory`` imports ``module_path``
and calls ``class_name(storage_config, kwargs)``; the cache controller then hands it the host
KV pool (``register_mem_pool_host``, and ``register_mem_host_pool_v2`` per pool of the host
pool group). Launch::

    python -m sglang.launch_server --model-path /models/Qwen3-8B \\
        --enable-hierarchical-cache --hicache-mem-layout page_first \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvd",
            "module_path": "kvd.sglang", "class_name": "KvdHiCacheStorage",
            "interface_v1": 1, "socket": "/run/kvd/kvd.sock", "pin_ttl_ms": 5000}'

``"interface_v1": 1`` makes the controller call the zero-copy ``batch_get_v1``/``batch_set_v1``
(host pool pages straight to and from kvd blocks); without it SGLang uses the generic
``batch_get``/``batch_set`` with one flat tensor per page, an extra copy each way. SGLang pops
``prefetch_threshold``, ``prefetch_timeout_base``, ``prefetch_timeout_per_ki_token``,
``hicache_storage_pass_prefix_keys`` and ``tp_lcm_size`` from the JSON; everything else reaches
``storage_config.extra_config``. This backend reads:

- ``socket``: the daemon's socket (else ``$KVD_SOCKET``, else ``kvd-data/kvd.sock``);
- ``model_identity``: what identifies the weights (a registry digest); replaces the stamp;
- ``model_path``: where the weights are, when ``--served-model-name`` hides the path;
- ``model_revision``: the exact revision, required when the model is not a local directory
  (a hub id) and no ``model_identity`` is given: a name alone could be any revision;
- ``kv_cache_dtype``: ``fp8_e4m3`` or ``fp8_e5m2`` for FP8 KV caches (SGLang stores them as
  ``uint8``, so the pool does not say which);
- ``cache_salt``, ``pin_ttl_ms``;
- ``cluster_lookup`` (default true), ``cluster_timeout_ms`` (1000), ``cluster_min_pages`` (1):
  a hit query that falls short here asks the other nodes' daemons for the rest and waits for
  the fetch up to the timeout (``kvd.cluster``; needs the daemon's data port).

What can be a hit: keys are SGLang's page hashes (SHA-256 of the hash string
gives the 32-byte tag) inside a kvd namespace that holds every field that gives a page's bytes
their meaning: the weights (``identity.weights_identity`` of the model directory: weight files'
names, sizes and sampled contents, and config.json), the host pool's class, memory layout, dtype and geometry,
the I/O path (generic and zero-copy pages are laid out differently: ``io=generic``/``io=v1``),
SGLang's storage format tag, TP rank and size (not for MLA, whose pages every rank shares), PP
rank and size and the layers of the stage, context- and decode-context-parallel ranks. A page
saved under any other value of any of them is a miss, never a hit with other bytes. One kvd
block holds one SGLang page: generic pages as SGLang flattens them, zero-copy pages as the
segments of ``get_page_buffer_meta`` back to back.

Hybrid pool groups (Mamba, SWA, DSA indexer, draft sidecars) are refused at start-up, in
``register_mem_host_pool_v2``: the ``batch_*_v2`` interface is not implemented (see
docs/ENGINES.md).

Reads copy from a zero-copy view of the pinned block into the host pool and keep the copy only
if the view is still valid afterwards; writes copy with the CRC computed in the same pass and
publish each batch as one group.
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import logging
import os
import threading
import time
from typing import Any, List, Optional, Sequence

from .client import Client, Namespace, key
from .cluster import fetch_and_wait, no_cluster
from .errors import AlreadyExists, KvdError
from .identity import weights_identity

try:  # SGLang's own base class and metrics type: without SGLang this is no backend.
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
    from sglang.srt.mem_cache.hicache_storage import PoolTransferResult
    from sglang.srt.observability.metrics_collector import StorageMetrics
except ImportError as e:  # pragma: no cover - exercised by test_adapters without SGLang
    raise ImportError(
        f"kvd.sglang is an SGLang HiCache storage backend and needs SGLang importable ({e}); "
        "install SGLang (tested: sglang 0.5.23) in this environment"
    ) from e

__all__ = ["KvdHiCacheStorage", "page_tag", "weights_identity"]

log = logging.getLogger(__name__)

_TORCH_DTYPES = {
    "torch.bfloat16": "bf16",
    "torch.float16": "f16",
    "torch.float32": "f32",
    "torch.float8_e4m3fn": "fp8_e4m3",
    "torch.float8_e5m2": "fp8_e5m2",
}
_FP8 = ("fp8_e4m3", "fp8_e5m2")

# Host pools whose page bytes this backend knows, and the layouts it can move for each: the
# ones whose get_data_page/set_from_flat_data_page and get_page_buffer_meta SGLang implements.
# page_unified has neither; page_first_kv_split is Ascend's split MLA pool.
_POOL_LAYOUTS = {
    "MHATokenToKVPoolHost": ("layer_first", "page_first", "page_first_direct", "page_head"),
    "MLATokenToKVPoolHost": ("layer_first", "page_first", "page_first_direct"),
}
_KV_POOL = "kv"  # PoolName.KV
Segments = Sequence[tuple[int, int]]  # one page: (address, bytes) pieces, back to back in its block
_METRICS_KEPT = 4096  # a bound on the per-batch figures kept between two get_stats calls


def page_tag(page_hash: str) -> bytes:
    """The 32-byte kvd tag of an SGLang page hash."""
    return hashlib.sha256(page_hash.encode()).digest()


def _address(buf: Any, writable: bool) -> tuple[int, int, Any]:
    """(address, bytes, keep-alive) of a contiguous CPU tensor or a writable buffer. A
    non-contiguous source tensor is copied; a destination must be contiguous."""
    if hasattr(buf, "data_ptr"):
        if buf.device.type != "cpu":
            raise ValueError(f"kvd moves host pages only; got a tensor on {buf.device}")
        if not buf.is_contiguous():
            if writable:
                raise ValueError("the destination page tensor is not contiguous")
            buf = buf.contiguous()
        return int(buf.data_ptr()), int(buf.numel() * buf.element_size()), buf
    mv = memoryview(buf)
    c = (ctypes.c_char * mv.nbytes).from_buffer(mv.cast("B"))
    return ctypes.addressof(c), mv.nbytes, (mv, c)


def _model(cfg: Any, extra: dict, format_tag: Optional[str]) -> tuple[str, str]:
    """(model name, revision) for the namespace: the weights' identity where it can be known."""
    if extra.get("model_identity"):
        return "weights", str(extra["model_identity"])
    name = str(getattr(cfg, "model_name", None) or "")
    if format_tag and name.endswith(f"-{format_tag}"):
        name = name[: -len(format_tag) - 1]  # storage_model_name() appended the pool's tag
    path = str(extra.get("model_path") or name)
    stamp = weights_identity(path) if path else ""
    if stamp:
        return "weights", stamp
    revision = extra.get("model_revision")
    if not name or not revision:
        raise ValueError(
            f"kvd: the model {path or '(unnamed)'!r} is not a local directory, so its weights "
            "cannot be stamped; set \"model_revision\" (the exact revision) or "
            "\"model_identity\" in --hicache-storage-backend-extra-config"
        )
    return name, str(revision)


class KvdHiCacheStorage(_Base):  # type: ignore[misc,valid-type]
    """HiCache storage over the node's kvd daemon."""

    def __init__(self, storage_config: Any, kwargs: Optional[dict] = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.config = storage_config
        self.extra = extra
        self.pin_ttl_ms = int(extra.get("pin_ttl_ms", 5000))
        # The same test the cache controller makes to choose the zero-copy interface.
        self.io = "v1" if bool(extra.get("interface_v1", 0)) else "generic"
        if getattr(storage_config, "should_split_heads", False):
            raise ValueError("kvd: tp_lcm_size (split heads across heterogeneous TP) is not supported")
        self.socket = extra.get("socket") or os.environ.get("KVD_SOCKET", "kvd-data/kvd.sock")
        rank = getattr(storage_config, "tp_rank", 0)
        self.client: Optional[Client] = Client(self.socket, name=f"sglang-tp{rank}")
        self._max_batch = max(1, int(self.client.pool_info().max_batch))
        self.mem_pool_host: Any = None
        self._ns: dict[str, bytes] = {}
        self._page_bytes = 0
        self.metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
        self._figures = {
            f: collections.deque(maxlen=_METRICS_KEPT)
            for f in ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth")
        }
        self._lock = threading.Lock()
        self.cluster = bool(extra.get("cluster_lookup", True))
        self.cluster_timeout_s = int(extra.get("cluster_timeout_ms", 1000)) / 1000
        self.cluster_min_pages = max(1, int(extra.get("cluster_min_pages", 1)))
        self.cluster_figures: collections.Counter = collections.Counter()

    # -- host pools and the namespace: every field that shapes a page's bytes --------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take the host KV pool; refuse, at start-up, one whose pages cannot be moved
        faithfully; register the namespaces of both I/O paths."""
        kind = type(mem_pool_host).__name__
        layouts = _POOL_LAYOUTS.get(kind)
        if layouts is None:
            raise ValueError(
                f"kvd: host pool {kind} is not supported (supported: {sorted(_POOL_LAYOUTS)}); "
                "its page format is unknown to this backend"
            )
        layout = getattr(mem_pool_host, "layout", None)
        if layout not in layouts:
            raise ValueError(f"kvd: {kind} layout {layout!r} is not supported (supported: {layouts})")
        if getattr(mem_pool_host, "kv_buffer", None) is None:
            raise ValueError(f"kvd: {kind} has no host KV buffer (an allocator-only pool)")
        page_bytes = int(mem_pool_host.get_size_per_token()) * int(mem_pool_host.page_size)
        generic = int(mem_pool_host.get_dummy_flat_data_page().nbytes)
        _, sizes = mem_pool_host.get_page_buffer_meta(_first_page(mem_pool_host))
        if generic != page_bytes or sum(sizes) != page_bytes:
            raise ValueError(
                f"kvd: {kind}/{layout} pages do not add up: {page_bytes} bytes per page, "
                f"{generic} in a generic page, {sum(sizes)} in its zero-copy segments"
            )
        self.mem_pool_host = mem_pool_host
        self._page_bytes = page_bytes
        c = self._client()
        self._ns = {io: c.register_namespace(self.namespace_descriptor(io)) for io in ("generic", "v1")}

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """The host pool group's pools: the KV pool only. Any other pool (Mamba, SWA, DSA
        indexer, draft sidecar) would need the batch_*_v2 interface, which kvd does not
        implement: refuse it, so SGLang fails at start-up instead of serving without it."""
        name = str(getattr(host_pool_name, "value", host_pool_name))
        if name == _KV_POOL:
            if self.mem_pool_host is None:
                self.register_mem_pool_host(host_pool)
            elif host_pool is not self.mem_pool_host:
                raise ValueError("kvd: a second KV host pool was registered")
            return
        raise ValueError(
            f"kvd: SGLang registered a {name!r} host pool ({type(host_pool).__name__}): hybrid "
            "pool groups (Mamba, SWA, DSA indexer, draft sidecars) need HiCache's batch_*_v2 "
            "interface, which the kvd backend does not implement; serve this model without the "
            "kvd storage backend, or with a backend that supports v2"
        )

    def namespace_descriptor(self, io: Optional[str] = None) -> Namespace:
        """The namespace of pages moved by the ``io`` path (``"generic"`` or ``"v1"``; the
        configured one by default) from the registered host pool."""
        cfg, pool = self.config, self.mem_pool_host
        if pool is None:
            raise ValueError("kvd: no host pool registered")
        io = io or self.io
        kind = type(pool).__name__
        mla = kind.startswith("MLA")
        dtype = _TORCH_DTYPES.get(str(pool.dtype))
        if dtype is None and str(pool.dtype) == "torch.uint8":
            dtype = self.extra.get("kv_cache_dtype")
            if dtype not in _FP8:
                raise ValueError(
                    "kvd: the host pool stores an FP8 KV cache as uint8; set \"kv_cache_dtype\" "
                    f"to one of {_FP8} in the extra config"
                )
        if dtype is None:
            raise ValueError(f"kvd: host pool dtype {pool.dtype} is not supported")
        tag = getattr(pool, "storage_format_tag", None)
        model_name, revision = _model(cfg, self.extra, tag)
        if mla:
            heads, head_dim = 1, int(pool.kv_cache_dim)
            geometry = f"kv_lora_rank={pool.kv_lora_rank};rope={pool.qk_rope_head_dim}"
        else:
            heads, head_dim = int(pool.head_num), int(pool.head_dim)
            geometry = f"v_head_dim={pool.v_head_dim}"
        target_layers = getattr(pool, "target_layer_num", pool.layer_num)  # the rest: packed draft layers
        layers = f"{pool.start_layer}-{pool.end_layer};target_layers={target_layers}"
        adapter = (
            f"sglang;pool={kind};layout={pool.layout};io={io};mla={int(mla)};{geometry};"
            f"layers={layers};format={tag or ''}"
        )
        salt = str(self.extra.get("cache_salt", ""))
        cp_size = int(getattr(cfg, "attn_cp_size", 1) or 1)
        if cp_size > 1:
            salt += f";cp={getattr(cfg, 'attn_cp_rank', 0)}/{cp_size}"
        dcp_size = int(getattr(cfg, "dcp_size", 1) or 1)
        if dcp_size > 1:
            salt += f";dcp={getattr(cfg, 'dcp_rank', 0)}/{dcp_size}"
            salt += f";page={getattr(cfg, 'logical_page_size', 0)}"
        return Namespace(
            model_name=model_name,
            model_revision=revision,
            bytes_per_block=self._page_bytes,
            tokens_per_block=int(pool.page_size),
            num_layers=int(pool.layer_num),
            num_kv_heads=heads,
            head_dim=head_dim,
            dtype=dtype,
            tokenizer="sglang",
            adapter=adapter,
            cache_salt=salt,
            tp_rank=0 if mla else int(getattr(cfg, "tp_rank", 0)),
            tp_size=1 if mla else int(getattr(cfg, "tp_size", 1)),
            pp_rank=int(getattr(cfg, "pp_rank", 0)),
            pp_size=int(getattr(cfg, "pp_size", 1)),
        )

    def _keys(self, page_hashes: Sequence[str], io: str) -> list[bytes]:
        ns = self._ns.get(io)
        if ns is None:
            raise ValueError("kvd: no host pool registered")
        return [key(ns, page_tag(h)) for h in page_hashes]

    # -- the method set of HiCacheStorage --------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """How many keys from the start are stored for the configured I/O path (SGLang's
        leading-hit count)."""
        if not keys:
            return 0
        try:
            ks = self._keys(keys, self.io)
            n = _leading(self._client().exists(ks))
            if self.cluster and len(ks) - n >= self.cluster_min_pages:
                n = self._from_cluster(ks, n)
        except KvdError as e:
            log.warning("kvd: exists failed: %s", e)
            return 0
        return n

    def _from_cluster(self, ks: list[bytes], n: int) -> int:
        """The leading hit after asking the cluster for pages ``n``.. (``kvd.cluster``)."""
        try:
            t = fetch_and_wait(self._client(), ks[n:], self.cluster_timeout_s)
        except KvdError as e:
            if no_cluster(e):
                log.info("kvd: no cluster fetches from this daemon (%s): hit queries stay local", e)
                self.cluster = False
            else:
                self.cluster_figures["cluster_errors"] += 1
                log.warning("kvd: cluster fetch not started (%s): a local hit only", e)
            return n
        self.cluster_figures["cluster_fetches"] += 1
        if t is None:
            self.cluster_figures["cluster_timeouts"] += 1
            return n
        if t.state != "done":
            self.cluster_figures["cluster_errors"] += 1
            log.info("kvd: cluster fetch failed (%s): a local hit only", t.error)
            return n
        self.cluster_figures["cluster_fetched_pages"] += t.blocks
        return _leading(self._client().exists(ks)) if t.blocks else n

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: List[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """The generic path: store whole flat pages (``get_data_page`` tensors); True if every
        key is stored."""
        if values is None or len(values) != len(keys):
            return False
        sources = [_address(v, writable=False) for v in values]
        return all(self._put(keys, [[(a, n)] for a, n, _ in sources], "generic"))

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """Fill ``target_location`` (a flat page tensor or buffer) and return it; None on a
        miss."""
        if target_location is None:
            return None  # SGLang always passes a page to fill (get_dummy_flat_data_page)
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        """The generic path: fill one flat page per key; each its page or None on a miss."""
        if target_locations is None or len(target_locations) != len(keys):
            return [None] * len(keys)
        dsts = [_address(t, writable=True) for t in target_locations]
        oks = self._get(keys, [[(a, n)] for a, n, _ in dsts], "generic")
        return [t if ok else None for t, ok in zip(target_locations, oks)]

    def batch_set_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        """Zero-copy from the host pool: each page's segments straight into its kvd block."""
        return self._put(keys, self._page_segments(keys, host_indices), "v1")

    def batch_get_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        """Zero-copy into the host pool: each block's view copied into the page's segments."""
        return self._get(keys, self._page_segments(keys, host_indices), "v1")

    def batch_exists_v2(self, keys: List[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        """KV pages only (no other pool can be registered): the leading KV hits."""
        if pool_transfers:
            return PoolTransferResult.empty()
        hits = self.batch_exists(keys, extra_info)
        return PoolTransferResult(hits, {_KV_POOL: hits} if hits else {}, list(range(1, hits + 1)))

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict:
        """No pool but KV is registered, so every v2 transfer is a miss."""
        return {t.name: [False] * len(t.keys or []) for t in transfers}

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict:
        return {t.name: [False] * len(t.keys or []) for t in transfers}

    def clear(self) -> None:
        """Nothing to do: kvd's pool evicts cache blocks by LRU, shared with other engines."""

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` with the batches since the last call (pages per batch
        read and newly written, and their GB/s), when storage metrics are enabled."""
        m = StorageMetrics()
        for name, q in self._figures.items():
            out = getattr(m, name)
            while q:
                out.append(q.popleft())
        return m

    def close(self) -> None:
        """End the kvd session (its pins and unfinished blocks go with it). Idempotent."""
        with self._lock:
            client, self.client = self.client, None
        if client is not None:
            client.close()

    # -- the copies ------------------------------------------------------------------------

    def _client(self) -> Client:
        """The session, usable now: renewed after an idle spell, reopened when it lapsed or
        broke (``Client.keep_alive``; an idle SGLang makes no calls, so nothing else renews
        it, and a lapsed session used to fail every later call). When the daemon is gone the
        calls fail as they did, and the next one tries again."""
        c = self.client
        if c is None:
            raise ValueError("kvd: the storage backend is closed")
        try:
            if c.keep_alive() and self._ns:
                log.info("kvd: the daemon session lapsed or broke: reopened")
                for io in self._ns:
                    c.register_namespace(self.namespace_descriptor(io))
        except KvdError as e:
            log.warning("kvd: the daemon cannot be reached (%s): its calls fail until it is back", e)
        return c

    def _record(self, what: str, pages: int, seconds: float) -> None:
        if self.metrics and pages:
            self._figures[f"{what}_pgs"].append(pages)
            gbps = pages * self._page_bytes / max(seconds, 1e-9) / 1e9
            self._figures[f"{what}_bandwidth"].append(gbps)

    def _page_segments(self, keys: Sequence[str], host_indices: Any) -> list[Segments]:
        page = int(self.mem_pool_host.page_size)
        if len(host_indices) != len(keys) * page:
            raise ValueError(f"kvd: {len(host_indices)} host indices for {len(keys)} pages of {page}")
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        per_page = len(ptrs) // max(len(keys), 1)
        if per_page * len(keys) != len(ptrs):
            raise ValueError(f"kvd: {len(ptrs)} segments do not split into {len(keys)} pages")
        return [
            [(int(ptrs[i * per_page + j]), int(sizes[i * per_page + j])) for j in range(per_page)]
            for i in range(len(keys))
        ]

    def _put(self, page_hashes: Sequence[str], segments: Sequence[Segments], io: str) -> List[bool]:
        ok: List[bool] = []
        t0, written = time.perf_counter(), 0
        for at in range(0, len(page_hashes), self._max_batch):
            end = at + self._max_batch
            part, n = self._put_batch(page_hashes[at:end], segments[at:end], io)
            ok += part
            written += n
        self._record("backup", written, time.perf_counter() - t0)
        return ok

    def _put_batch(
        self, page_hashes: Sequence[str], segments: Sequence[Segments], io: str
    ) -> tuple[List[bool], int]:
        c = self._client()
        ok = [False] * len(page_hashes)
        try:
            allocs = c.alloc(self._keys(page_hashes, io))
        except KvdError as e:
            log.warning("kvd: alloc failed: %s", e)
            return ok, 0
        items, where = [], []
        for i, a in enumerate(allocs):
            if isinstance(a, AlreadyExists):
                ok[i] = True  # stored already (by us or another rank of the same layout)
                continue
            if isinstance(a, KvdError):
                continue
            crc, at = 0, 0
            try:
                if sum(size for _, size in segments[i]) != self._page_bytes:
                    raise ValueError("a page of the wrong size")
                for addr, size in segments[i]:
                    crc = c.write_from(a.handle, addr, size, at, crc) or 0
                    at += size
            except (KvdError, ValueError) as e:
                log.warning("kvd: write failed: %s", e)
                c.abort([a.handle])
                continue
            items.append((a.handle, at, crc))
            where.append(i)
        if not items:
            return ok, 0
        sealed = c.seal(items)
        good = [(items[j][0], where[j]) for j, s in enumerate(sealed) if not isinstance(s, KvdError)]
        bad = [items[j][0] for j, s in enumerate(sealed) if isinstance(s, KvdError)]
        if bad:
            c.abort(bad)
        if not good:
            return ok, 0
        try:
            c.publish([h for h, _ in good])
        except KvdError as e:
            log.warning("kvd: publish failed: %s", e)
            c.abort([h for h, _ in good])
            return ok, 0
        for _, i in good:
            ok[i] = True
        return ok, len(good)

    def _get(self, page_hashes: Sequence[str], segments: Sequence[Segments], io: str) -> List[bool]:
        ok: List[bool] = []
        t0 = time.perf_counter()
        for at in range(0, len(page_hashes), self._max_batch):
            end = at + self._max_batch
            ok += self._get_batch(page_hashes[at:end], segments[at:end], io)
        self._record("prefetch", sum(ok), time.perf_counter() - t0)
        return ok

    def _get_batch(self, page_hashes: Sequence[str], segments: Sequence[Segments], io: str) -> List[bool]:
        c = self._client()
        ok = [False] * len(page_hashes)
        try:
            got = c.acquire(self._keys(page_hashes, io), self.pin_ttl_ms)
        except KvdError as e:
            log.warning("kvd: acquire failed: %s", e)
            return ok
        pinned = [b.handle for b in got if not isinstance(b, KvdError)]
        try:
            for i, b in enumerate(got):
                if isinstance(b, KvdError):
                    continue
                if sum(size for _, size in segments[i]) != b.len:
                    continue  # the namespace fixes the page size: a bug, so a miss
                try:
                    with c.view(b.handle) as v:
                        at = 0
                        for addr, size in segments[i]:
                            ctypes.memmove(addr, v.address + at, size)
                            at += size
                        v.still_valid()
                    ok[i] = True
                except KvdError:
                    ok[i] = False
        finally:
            if pinned:
                c.release(pinned)
        return ok


def _leading(found: Sequence[bool]) -> int:
    """How many from the start are true."""
    return next((i for i, f in enumerate(found) if not f), len(found))


def _first_page(pool: Any) -> Any:
    """Host indices of one page (for checking the pool's page geometry)."""
    import torch

    return torch.arange(int(pool.page_size), dtype=torch.int64)
