"""kvd as a vLLM v1 KV connector (``KVConnectorBase_V1``).

Load it through vLLM's own plug-in hook (``kv_connector`` names the class,
``kv_connector_module_path`` the module)::

    vllm serve Qwen/Qwen3-8B --kv-transfer-config '{"kv_connector": "KvdConnector",
        "kv_connector_module_path": "kvd.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"socket": "/run/kvd/kvd.sock", "pin_ttl_ms": 5000}}'

Settings come from ``kv_connector_extra_config``: ``socket`` (else ``$KVD_SOCKET``, else
``kvd-data/kvd.sock``), ``pin_ttl_ms``, ``cache_salt``, ``async_lookup`` (look prefixes up on libkvd's worker thread: the
scheduler's first question about a request answers ``None`` and a later one the hit, so the
scheduler never waits for the daemon), ``kv_layout`` (``"2_first"``: a layer's
cache is ``[2, num_blocks, ...]`` as FlashAttention lays it out; ``"blocks_first"``:
``[num_blocks, ...]``), ``bytes_per_block`` (to override the computed size).

Keys: vLLM's block hashes (32-byte ``bytes`` are used as tags as they are; anything else is
hashed with SHA-256) inside a kvd namespace built from the model config: model and revision,
tokenizer, dtype, layers, KV heads, head size, block size, TP and PP size and rank. One kvd block
holds one vLLM block, every layer's K and V back to back.

Scheduler side: ``get_num_new_matched_tokens`` asks kvd for the longest stored prefix of the
request's block hashes (answering ``None``, "ask again", while the daemon is overloaded or being
reconnected); ``update_state_after_alloc`` records which blocks to load; ``request_finished``
hands the request's full blocks that kvd does not hold yet to the workers and delays their free
until the workers report the save done; ``build_connector_meta`` carries both.

Worker side: ``start_load_kv`` loads each block from a pinned zero-copy view and keeps it only
if the view was still valid after the copy (otherwise the block id is reported by
``get_block_ids_with_load_errors``); ``wait_for_save`` writes and publishes the blocks to save;
``get_finished`` reports the saved requests. Copies between kvd's pool and CPU tensors are one
``memmove``; with CUDA tensors they are one ``copy_`` between the GPU and the pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from .client import Client, Namespace, key
from .errors import AlreadyExists, Disconnected, KvdError, Overloaded

try:  # Subclass vLLM's own classes when vLLM is importable.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1 as _Base,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata as _MetaBase,
    )
except Exception:  # pragma: no cover - vLLM is not installed where the tests run
    _Base = object  # type: ignore[assignment,misc]
    _MetaBase = object  # type: ignore[assignment,misc]

_DTYPES = {"bfloat16": ("bf16", 2), "float16": ("f16", 2), "float32": ("f32", 4)}


def block_tag(block_hash: Any) -> bytes:
    """The 32-byte kvd tag of a vLLM block hash."""
    if isinstance(block_hash, (bytes, bytearray)):
        b = bytes(block_hash)
        return b if len(b) == 32 else hashlib.sha256(b).digest()
    value = getattr(block_hash, "hash_value", block_hash)
    return hashlib.sha256(repr(value).encode()).digest()


@dataclass
class BlockTransfer:
    """Blocks of one request to move: vLLM block ids and the kvd tags they hold."""

    req_id: str
    block_ids: list[int]
    tags: list[bytes]


@dataclass
class KvdConnectorMetadata(_MetaBase):  # type: ignore[misc,valid-type]
    """What the scheduler tells the workers for one step."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


def _cfg(obj: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        obj = getattr(obj, n, None)
        if obj is None:
            return default
    return obj


class KvdConnector(_Base):  # type: ignore[misc,valid-type]
    """A vLLM v1 KV connector over the node's kvd daemon."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        if _Base is not object:  # pragma: no cover - with vLLM installed
            try:
                super().__init__(vllm_config, role, kv_cache_config)
            except TypeError:
                super().__init__(vllm_config, role)
        self._connector_metadata: Any = None
        self.vllm_config = vllm_config
        self.role_name = str(getattr(role, "name", role))
        extra = dict(_cfg(vllm_config, "kv_transfer_config", "kv_connector_extra_config", default={}) or {})
        self.extra = extra
        self.block_size = int(_cfg(vllm_config, "cache_config", "block_size", default=16))
        self.pin_ttl_ms = int(extra.get("pin_ttl_ms", 5000))
        self.kv_layout = str(extra.get("kv_layout", "2_first"))
        self.async_lookup = bool(extra.get("async_lookup", False))
        socket = extra.get("socket") or os.environ.get("KVD_SOCKET", "kvd-data/kvd.sock")
        self.tp_rank = int(extra.get("tp_rank", _tp_rank()))
        self.client = Client(socket, name=f"vllm-{self.role_name.lower()}-tp{self.tp_rank}")
        self.namespace = self.client.register_namespace(self.namespace_descriptor())
        # Scheduler side.
        if self.async_lookup:
            self.client.async_start(int(extra.get("max_inflight_lookups", 256)))
        self._asking: dict[int, str] = {}  # ticket -> request id
        self._asked: dict[str, Optional[int]] = {}  # request id -> ticket, or None once answered
        self._answers: dict[str, int] = {}  # request id -> blocks found
        self._loads: dict[str, BlockTransfer] = {}
        self._saves: list[BlockTransfer] = []
        # Worker side.
        self.kv_caches: dict[str, Any] = {}
        self._load_errors: set[int] = set()
        self._saved: set[str] = set()
        self._finished: set[str] = set()

    # -- the namespace ---------------------------------------------------------------------

    def namespace_descriptor(self) -> Namespace:
        mc = getattr(self.vllm_config, "model_config", None)
        pc = getattr(self.vllm_config, "parallel_config", None)
        dtype_name = str(getattr(mc, "dtype", "bfloat16")).replace("torch.", "")
        dtype, itemsize = _DTYPES.get(dtype_name, ("bf16", 2))
        layers = int(mc.get_num_layers(pc)) if hasattr(mc, "get_num_layers") else 1
        heads = int(mc.get_num_kv_heads(pc)) if hasattr(mc, "get_num_kv_heads") else 1
        head = int(mc.get_head_size()) if hasattr(mc, "get_head_size") else 1
        size = int(extra_size) if (extra_size := self.extra.get("bytes_per_block")) else (
            2 * layers * self.block_size * heads * head * itemsize
        )
        return Namespace(
            model_name=str(getattr(mc, "model", "unknown")),
            model_revision=str(getattr(mc, "revision", None) or "main"),
            bytes_per_block=size,
            tokens_per_block=self.block_size,
            num_layers=layers,
            num_kv_heads=heads,
            head_dim=head,
            dtype=dtype,
            tokenizer=str(getattr(mc, "tokenizer", "") or ""),
            cache_salt=str(self.extra.get("cache_salt", "")),
            tp_rank=self.tp_rank,
            tp_size=int(getattr(pc, "tensor_parallel_size", 1) or 1),
            pp_rank=0,
            pp_size=int(getattr(pc, "pipeline_parallel_size", 1) or 1),
        )

    def _tags(self, request: Any) -> list[bytes]:
        return [block_tag(h) for h in getattr(request, "block_hashes", [])]

    # -- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        """Tokens beyond ``num_computed_tokens`` that kvd holds; ``None`` means ask again."""
        tags = self._tags(request)
        try:
            found = self._lookup(request.request_id, tags) if self.async_lookup else len(
                self.client.lookup_prefix(self.namespace, tags)
            )
        except (Overloaded, Disconnected):
            self._try_reconnect()
            return None, False
        if found is None:
            return None, False
        hit_tokens = found * self.block_size
        total = int(getattr(request, "num_tokens", hit_tokens + 1))
        if hit_tokens >= total:  # the last token is always computed (it yields the logits)
            hit_tokens = (total - 1) // self.block_size * self.block_size
        return max(0, hit_tokens - num_computed_tokens), False

    def _lookup(self, req_id: str, tags: list[bytes]) -> Optional[int]:
        """Asynchronous lookups: the answer once libkvd's worker has it, else None (vLLM asks
        again at a later step). The scheduler never waits for the daemon."""
        if req_id not in self._asked:
            ticket = self.client.submit_lookup_prefix(self.namespace, tags)
            self._asked[req_id] = ticket
            self._asking[ticket] = req_id
        for ticket, result in self.client.poll(0):
            rid = self._asking.pop(ticket)
            self._asked[rid] = None
            self._answers[rid] = 0 if isinstance(result, KvdError) else len(result)
        if req_id in self._answers:
            del self._asked[req_id]
            return self._answers.pop(req_id)
        return None

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        block_ids = list(blocks.get_block_ids()[0])
        first = int(getattr(request, "num_computed_tokens", 0)) // self.block_size
        n = num_external_tokens // self.block_size
        tags = self._tags(request)[first : first + n]
        self._loads[request.request_id] = BlockTransfer(request.request_id, block_ids[first : first + n], tags)

    def build_connector_meta(self, scheduler_output: Any) -> KvdConnectorMetadata:
        meta = KvdConnectorMetadata(loads=list(self._loads.values()), saves=self._saves)
        self._loads, self._saves = {}, []
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        """Hand the request's full blocks kvd lacks to the workers; delay their free until the
        workers report the save (``get_finished``)."""
        tags = self._tags(request)
        n = min(int(getattr(request, "num_publishable_block_hashes", len(tags))), len(tags), len(block_ids))
        if n == 0:
            return False, None
        try:
            have = self.client.exists([key(self.namespace, t) for t in tags[:n]])
        except KvdError:
            return False, None
        missing = [i for i in range(n) if not have[i]]
        if not missing:
            return False, None
        self._saves.append(
            BlockTransfer(request.request_id, [block_ids[i] for i in missing], [tags[i] for i in missing])
        )
        return True, None

    def _try_reconnect(self) -> None:
        try:
            self.client.reconnect()
        except KvdError:
            pass

    # -- worker side -----------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.kv_caches = dict(kv_caches)

    def _segments(self, block_id: int) -> list[Any]:
        """The block's pieces, layer by layer (K then V), as tensor/array views."""
        out = []
        for cache in self.kv_caches.values():
            if self.kv_layout == "2_first":
                out += [cache[0][block_id], cache[1][block_id]]
            else:
                out.append(cache[block_id])
        return out

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if meta is None:
            return
        for load in meta.loads:
            self._load(load)

    def _load(self, load: BlockTransfer) -> None:
        keys = [key(self.namespace, t) for t in load.tags]
        try:
            got = self.client.acquire(keys, self.pin_ttl_ms)
        except KvdError:
            self._load_errors.update(load.block_ids)
            return
        pinned = [b.handle for b in got if not isinstance(b, KvdError)]
        try:
            for block_id, b in zip(load.block_ids, got):
                if isinstance(b, KvdError) or not self._copy_in(block_id, b):
                    self._load_errors.add(block_id)
        finally:
            if pinned:
                self.client.release(pinned)

    def _copy_in(self, block_id: int, b: Any) -> bool:
        segs = self._segments(block_id)
        if sum(_nbytes(s) for s in segs) != b.len:
            return False
        try:
            with self.client.view(b.handle) as v:
                at = 0
                for s in segs:
                    n = _nbytes(s)
                    _copy_to(s, v, at, n)
                    at += n
                v.still_valid()
            return True
        except KvdError:
            return False

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish in ``start_load_kv`` (a block holds every layer)."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Saves happen whole-block in ``wait_for_save``, after every layer was computed."""

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if meta is None:
            return
        for save in meta.saves:
            self._save(save)
            self._saved.add(save.req_id)

    def _save(self, save: BlockTransfer) -> None:
        keys = [key(self.namespace, t) for t in save.tags]
        try:
            allocs = self.client.alloc(keys)
        except KvdError:
            return
        items = []
        for block_id, a in zip(save.block_ids, allocs):
            if isinstance(a, (AlreadyExists, KvdError)):
                continue
            at, crc = 0, 0
            for s in self._segments(block_id):
                n = _nbytes(s)
                crc = _copy_from(self.client, a.handle, s, at, n, crc)
                at += n
            items.append((a.handle, at, crc if crc >= 0 else None))
        if not items:
            return
        sealed = self.client.seal(items)
        good = [items[i][0] for i, s in enumerate(sealed) if not isinstance(s, KvdError)]
        if good:
            try:
                self.client.publish(good)
            except KvdError:
                self.client.abort(good)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        self._finished |= set(finished_req_ids)
        done = self._saved & self._finished
        self._saved -= done
        self._finished -= done
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self.client.close()


def _tp_rank() -> int:
    try:  # pragma: no cover - with vLLM installed
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return 0


def _nbytes(t: Any) -> int:
    if hasattr(t, "element_size"):
        return int(t.numel() * t.element_size())
    return int(t.nbytes)


def _address(t: Any) -> int:
    if hasattr(t, "data_ptr"):
        return int(t.data_ptr())
    return int(t.__array_interface__["data"][0])


def _is_cuda(t: Any) -> bool:
    return bool(getattr(t, "is_cuda", False))


def _copy_to(dst: Any, view: Any, at: int, n: int) -> None:
    """Copy ``n`` bytes of a view from ``at`` into tensor/array ``dst`` (contiguous)."""
    if _is_cuda(dst):  # pragma: no cover - needs a GPU
        import torch

        src = torch.frombuffer(view.data, dtype=torch.uint8, count=n, offset=at)
        dst.view(-1).view(torch.uint8).copy_(src, non_blocking=False)
        return
    ctypes.memmove(_address(dst), view.address + at, n)


def _copy_from(client: Client, handle: Any, src: Any, at: int, n: int, crc: int) -> int:
    """Copy tensor/array ``src`` into a block at ``at``; the CRC continued (or -1 once a GPU
    copy made the daemon's own checksum necessary)."""
    if _is_cuda(src):  # pragma: no cover - needs a GPU
        import torch

        page = client.block_mut(handle)
        dst = torch.frombuffer(page, dtype=torch.uint8, count=n, offset=at)
        dst.copy_(src.reshape(-1).view(torch.uint8))
        return -1
    if crc < 0:
        client.write_from(handle, _address(src), n, at)
        return -1
    return client.write_from(handle, _address(src), n, at, crc) or 0

