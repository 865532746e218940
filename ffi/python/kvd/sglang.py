"""kvd as SGLang's HiCache L3 storage backend (``HiCacheStorage``).

Load it through SGLang's dynamic backend (``StorageBackendFactory`` imports ``module_path`` and
builds ``class_name(storage_config, kwargs)``)::

    python -m sglang.launch_server --model-path Qwen/Qwen3-8B --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvd", "module_path": "kvd.sglang",
            "class_name": "KvdHiCacheStorage", "socket": "/run/kvd/kvd.sock",
            "model_revision": "main", "pin_ttl_ms": 5000}'

Settings come from ``storage_config.extra_config`` (the JSON above): ``socket`` (else
``$KVD_SOCKET``, else ``kvd-data/kvd.sock``), ``model_revision``, ``pin_ttl_ms``,
``cache_salt``, ``bytes_per_page`` (only when no host pool is registered).

Keys: SGLang's page hashes (strings) become 32-byte tags (SHA-256 of the string) inside a kvd
namespace built from the model name and revision, TP rank and size (not for MLA models, whose
pages every rank shares), PP rank and size, the context-parallel rank, the host pool's dtype and
geometry and the page's byte size: another model, rank or layout is a different namespace, so
a miss, never a wrong hit. One kvd block holds one SGLang page: its segments from
``get_page_buffer_meta`` (K and V, per layer where the layout splits them) back to back.

Reads copy from a zero-copy view of the pinned block into the host pool and keep the copy only
if the view is still valid afterwards; writes copy with the CRC computed in the same pass and
publish each batch as one group.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from typing import Any, List, Optional, Sequence

from .client import Client, Namespace, key
from .errors import AlreadyExists, KvdError

try:  # Subclass SGLang's own base class when SGLang is importable.
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
except Exception:  # pragma: no cover - SGLang is not installed where the tests run
    _Base = object  # type: ignore[assignment,misc]

_TORCH_DTYPES = {
    "torch.bfloat16": "bf16",
    "torch.float16": "f16",
    "torch.float32": "f32",
    "torch.float8_e4m3fn": "fp8_e4m3",
    "torch.float8_e5m2": "fp8_e5m2",
}


def page_tag(page_hash: str) -> bytes:
    """The 32-byte kvd tag of an SGLang page hash."""
    return hashlib.sha256(page_hash.encode()).digest()


def _address(buf: Any) -> tuple[int, int]:
    """(address, bytes) of a tensor, numpy array or writable buffer."""
    if hasattr(buf, "data_ptr"):
        return int(buf.data_ptr()), int(buf.numel() * buf.element_size())
    iface = getattr(buf, "__array_interface__", None)
    if iface is not None:
        return int(iface["data"][0]), int(buf.nbytes)
    mv = memoryview(buf)
    c = (ctypes.c_char * mv.nbytes).from_buffer(mv.cast("B"))
    return ctypes.addressof(c), mv.nbytes


class KvdHiCacheStorage(_Base):  # type: ignore[misc,valid-type]
    """HiCache storage over the node's kvd daemon."""

    def __init__(self, storage_config: Any, kwargs: Optional[dict] = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.config = storage_config
        self.extra = extra
        self.pin_ttl_ms = int(extra.get("pin_ttl_ms", 5000))
        socket = extra.get("socket") or os.environ.get("KVD_SOCKET", "kvd-data/kvd.sock")
        rank = getattr(storage_config, "tp_rank", 0)
        self.client = Client(socket, name=f"sglang-tp{rank}")
        self.mem_pool_host: Any = None
        self._namespace: Optional[bytes] = None

    # -- the namespace: every field that shapes a page's bytes -----------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host
        self._namespace = None

    def namespace_descriptor(self) -> Namespace:
        cfg, pool = self.config, self.mem_pool_host
        mla = bool(getattr(cfg, "is_mla_model", False))
        if pool is not None and hasattr(pool, "get_size_per_token"):
            page_bytes = int(pool.get_size_per_token()) * int(pool.page_size)
        else:
            page_bytes = int(self.extra.get("bytes_per_page", 0))
        if page_bytes <= 0:
            raise ValueError("no host pool registered and no bytes_per_page in extra_config")
        cp_size = int(getattr(cfg, "attn_cp_size", 1) or 1)
        salt = str(self.extra.get("cache_salt", ""))
        if cp_size > 1:
            salt += f";cp={getattr(cfg, 'attn_cp_rank', 0)}/{cp_size}"
        return Namespace(
            model_name=str(getattr(cfg, "model_name", None) or "unknown"),
            model_revision=str(self.extra.get("model_revision", "unknown")),
            bytes_per_block=page_bytes,
            tokens_per_block=int(getattr(pool, "page_size", self.extra.get("page_size", 1))),
            num_layers=int(getattr(pool, "layer_num", 1)),
            num_kv_heads=int(getattr(pool, "head_num", 1)),
            head_dim=int(getattr(pool, "head_dim", 1)),
            dtype=_TORCH_DTYPES.get(str(getattr(pool, "dtype", "")), "bf16"),
            tokenizer="sglang",
            adapter="mla" if mla else "",
            cache_salt=salt,
            tp_rank=0 if mla else int(getattr(cfg, "tp_rank", 0)),
            tp_size=1 if mla else int(getattr(cfg, "tp_size", 1)),
            pp_rank=int(getattr(cfg, "pp_rank", 0)),
            pp_size=int(getattr(cfg, "pp_size", 1)),
        )

    def namespace(self) -> bytes:
        if self._namespace is None:
            self._namespace = self.client.register_namespace(self.namespace_descriptor())
        return self._namespace

    def _keys(self, page_hashes: Sequence[str]) -> list[bytes]:
        ns = self.namespace()
        return [key(ns, page_tag(h)) for h in page_hashes]

    # -- the method set of HiCacheStorage --------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.client.exists(self._keys([key]))[0]

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """How many keys from the start are stored (SGLang's leading-hit count)."""
        found = self.client.exists(self._keys(keys)) if keys else []
        return next((i for i, f in enumerate(found) if not f), len(found))

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: List[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store whole pages given as tensors or buffers; True if every key is stored."""
        if values is None:
            return False
        segments = [[_address(v)] for v in values]
        return all(self._put(keys, segments))

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """Fill ``target_location`` (a flat page tensor or buffer) and return it; None on a
        miss. Without a target, the page's bytes."""
        if target_location is None:
            got = self.client.acquire(self._keys([key]), self.pin_ttl_ms)[0]
            if isinstance(got, KvdError):
                return None
            out = bytearray(got.len)
            try:
                self.client.read_verified(got.handle, out)
            except KvdError:
                return None
            finally:
                self.client.release([got.handle])
            return bytes(out)
        ok = self._get([key], [[_address(target_location)]])[0]
        return target_location if ok else None

    def batch_get(self, keys: List[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        if target_locations is None:
            return [self.get(k) for k in keys]
        oks = self._get(keys, [[_address(t)] for t in target_locations])
        return [t if ok else None for t, ok in zip(target_locations, oks)]

    def batch_set_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        """Zero-copy from the host pool: each page's segments straight into its kvd block."""
        return self._put(keys, self._page_segments(keys, host_indices))

    def batch_get_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        """Zero-copy into the host pool: each block's view copied into the page's segments."""
        return self._get(keys, self._page_segments(keys, host_indices))

    def clear(self) -> None:
        """Nothing to do: kvd's pool evicts cache blocks by LRU, shared with other engines."""

    def get_stats(self) -> Any:
        return self.client.stats()

    # -- the copies ------------------------------------------------------------------------

    def _page_segments(self, keys: Sequence[str], host_indices: Any) -> list[list[tuple[int, int]]]:
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if not isinstance(sizes, (list, tuple)):
            sizes = [sizes] * len(ptrs)
        per_page = len(ptrs) // max(len(keys), 1)
        if per_page * len(keys) != len(ptrs):
            raise ValueError(f"{len(ptrs)} segments do not split into {len(keys)} pages")
        return [
            [(int(ptrs[i * per_page + j]), int(sizes[i * per_page + j])) for j in range(per_page)]
            for i in range(len(keys))
        ]

    def _put(self, page_hashes: Sequence[str], segments: Sequence[Sequence[tuple[int, int]]]) -> List[bool]:
        keys = self._keys(page_hashes)
        ok = [False] * len(keys)
        try:
            allocs = self.client.alloc(keys)
        except KvdError:
            return ok
        items, where = [], []
        for i, a in enumerate(allocs):
            if isinstance(a, AlreadyExists):
                ok[i] = True  # stored already (by us or another rank of the same layout)
                continue
            if isinstance(a, KvdError):
                continue
            crc, at = 0, 0
            try:
                for addr, size in segments[i]:
                    crc = self.client.write_from(a.handle, addr, size, at, crc) or 0
                    at += size
            except KvdError:
                self.client.abort([a.handle])
                continue
            items.append((a.handle, at, crc))
            where.append(i)
        if not items:
            return ok
        sealed = self.client.seal(items)
        good = [(items[j][0], where[j]) for j, s in enumerate(sealed) if not isinstance(s, KvdError)]
        bad = [items[j][0] for j, s in enumerate(sealed) if isinstance(s, KvdError)]
        if bad:
            self.client.abort(bad)
        if good:
            try:
                self.client.publish([h for h, _ in good])
                for _, i in good:
                    ok[i] = True
            except KvdError:
                self.client.abort([h for h, _ in good])
        return ok

    def _get(self, page_hashes: Sequence[str], segments: Sequence[Sequence[tuple[int, int]]]) -> List[bool]:
        keys = self._keys(page_hashes)
        ok = [False] * len(keys)
        try:
            got = self.client.acquire(keys, self.pin_ttl_ms)
        except KvdError:
            return ok
        pinned = [b.handle for b in got if not isinstance(b, KvdError)]
        try:
            for i, b in enumerate(got):
                if isinstance(b, KvdError):
                    continue
                need = sum(size for _, size in segments[i])
                if need != b.len:
                    continue  # another layout under the same key would be a bug: a miss
                try:
                    with self.client.view(b.handle) as v:
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
                self.client.release(pinned)
        return ok

