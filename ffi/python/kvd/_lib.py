"""libkvd through ctypes: the library, its structs (mirrors of kvd.h) and its prototypes.

Nothing here adds logic: the structs have kvd.h's fields in kvd.h's order, and each function
gets its argument and result types so ctypes checks what Python passes.
"""

from __future__ import annotations

import ctypes
import os
from ctypes import (
    POINTER,
    Structure,
    c_bool,
    c_char_p,
    c_int32,
    c_size_t,
    c_uint8,
    c_uint32,
    c_uint64,
    c_void_p,
)
from pathlib import Path

ABI_VERSION = 1


def _load() -> ctypes.CDLL:
    here = Path(__file__).resolve().parent / "libkvd.so"
    path = os.environ.get("KVD_LIBRARY") or str(here)
    return ctypes.CDLL(path)


lib = _load()


class NamespaceId(Structure):
    _fields_ = [("bytes", c_uint8 * 32)]


class Tag(Structure):
    _fields_ = [("bytes", c_uint8 * 32)]


class Key(Structure):
    _fields_ = [("namespace_id", NamespaceId), ("tag", Tag)]


class Handle(Structure):
    _fields_ = [
        ("node_generation", c_uint64),
        ("generation", c_uint64),
        ("slot", c_uint32),
        ("reserved", c_uint32),
    ]

    def __repr__(self) -> str:
        return f"Handle(node={self.node_generation}, slot={self.slot}, gen={self.generation})"

    def ident(self) -> tuple[int, int, int]:
        return (self.node_generation, self.slot, self.generation)


class BlockVersion(Structure):
    _fields_ = [("node_generation", c_uint64), ("generation", c_uint64)]


class RemoveItem(Structure):
    _fields_ = [("key", Key), ("version", BlockVersion)]


class BlockInfo(Structure):
    _fields_ = [
        ("key", Key),
        ("handle", Handle),
        ("offset", c_uint64),
        ("len", c_uint64),
        ("checksum", c_uint32),
        ("reserved", c_uint32),
        ("pin_ttl_ms", c_uint64),
    ]


class Allocation(Structure):
    _fields_ = [("handle", Handle), ("offset", c_uint64), ("capacity", c_uint64)]


class SealItem(Structure):
    _fields_ = [
        ("handle", Handle),
        ("len", c_uint64),
        ("checksum", c_uint32),
        ("has_checksum", c_bool),
    ]


class BlockClass(Structure):
    _fields_ = [
        ("kind", c_uint32),
        ("reserved", c_uint32),
        ("request", c_uint64),
        ("epoch", c_uint64),
    ]


class NamespaceDescriptor(Structure):
    _fields_ = [
        ("model_name", c_char_p),
        ("model_revision", c_char_p),
        ("tokenizer", c_char_p),
        ("adapter", c_char_p),
        ("cache_salt", c_char_p),
        ("rope", c_char_p),
        ("dtype", c_uint32),
        ("num_layers", c_uint32),
        ("num_kv_heads", c_uint32),
        ("head_dim", c_uint32),
        ("tokens_per_block", c_uint32),
        ("tp_rank", c_uint32),
        ("tp_size", c_uint32),
        ("pp_rank", c_uint32),
        ("pp_size", c_uint32),
        ("reserved", c_uint32),
        ("bytes_per_block", c_uint64),
    ]


class PoolInfo(Structure):
    _fields_ = [
        ("fd", c_int32),
        ("page_count", c_uint32),
        ("base", c_void_p),
        ("size_bytes", c_uint64),
        ("page_size_bytes", c_uint64),
        ("node_generation", c_uint64),
        ("session", c_uint64),
        ("lease_ttl_ms", c_uint64),
        ("max_batch", c_uint32),
        ("reserved", c_uint32),
    ]


_STATS_FIELDS = (
    ["node_generation", "page_size_bytes"]
    + [
        "pages_total",
        "pages_free",
        "pages_allocated",
        "pages_writing",
        "pages_sealed",
        "pages_published",
        "pages_retired",
        "pages_quarantined",
    ]
    + ["reserved_unused_pages", "pins"]
    + ["sessions", "manifests", "namespaces", "evictable"]
    + [
        "lookups",
        "hits",
        "stale_generation_rejects",
        "checksum_failures",
        "evictions",
        "overload_rejects",
        "no_space_rejects",
        "sessions_expired",
        "pins_expired",
        "manifests_expired",
        "blocks_published",
        "blocks_aborted",
        "blocks_removed",
    ]
)
_STATS_U32 = {
    "pages_total",
    "pages_free",
    "pages_allocated",
    "pages_writing",
    "pages_sealed",
    "pages_published",
    "pages_retired",
    "pages_quarantined",
    "sessions",
    "manifests",
    "namespaces",
    "evictable",
}


class Stats(Structure):
    _fields_ = [(f, c_uint32 if f in _STATS_U32 else c_uint64) for f in _STATS_FIELDS]


class ManifestInfo(Structure):
    _fields_ = [
        ("request", c_uint64),
        ("epoch", c_uint64),
        ("namespace_id", NamespaceId),
        ("committed_tokens", c_uint64),
        ("expires_at_ms", c_uint64),
        ("reservation", c_uint64),
        ("tag_count", c_uint64),
    ]


class RestoreInfo(Structure):
    _fields_ = [
        ("epoch", c_uint64),
        ("tokens", c_uint64),
        ("committed_tokens", c_uint64),
        ("block_count", c_uint64),
    ]


class BlockEvent(Structure):
    _fields_ = [("seq", c_uint64), ("key", Key), ("kind", c_uint32), ("reserved", c_uint32)]


class EventBatch(Structure):
    _fields_ = [("count", c_uint64), ("next_seq", c_uint64), ("lost", c_uint64)]


EVENT_STORED = 1
EVENT_REMOVED = 2
ANY_NODE = 0  # KVD_ANY_NODE: kvd_fetch's peer for a cluster fetch


class TransferInfo(Structure):
    _fields_ = [
        ("id", c_uint64),
        ("peer", c_uint64),
        ("state", c_uint32),
        ("status", c_int32),
        ("blocks", c_uint64),
        ("bytes", c_uint64),
        ("tokens", c_uint64),
        ("elapsed_ms", c_uint64),
    ]


TRANSFER_IN_FLIGHT = 0
TRANSFER_DONE = 1
TRANSFER_FAILED = 2


class HealthReport(Structure):
    _fields_ = [("elapsed_us", c_uint64), ("bytes", c_uint64)]


class ErrorInfo(Structure):
    _fields_ = [
        ("status", c_int32),
        ("retryable", c_bool),
        ("retry_after_ms", c_uint64),
        ("corruption", c_uint32),
        ("expected_checksum", c_uint32),
        ("found_checksum", c_uint32),
        ("requested_bytes", c_uint64),
        ("free_bytes", c_uint64),
    ]


class ClientOptions(Structure):
    _fields_ = [
        ("abi_version", c_uint32),
        ("populate", c_bool),
        ("name", c_char_p),
        ("lease_ttl_ms", c_uint64),
        ("io_timeout_ms", c_uint64),
    ]


class View(Structure):
    _fields_ = [
        ("data", c_void_p),
        ("len", c_uint64),
        ("handle", Handle),
        ("session", c_uint64),
    ]


class Completion(Structure):
    _fields_ = [
        ("user_tag", c_uint64),
        ("status", c_int32),
        ("pinned", c_bool),
        ("block_count", c_uint64),
    ]


P = POINTER
C = c_void_p  # KvdClient * (an opaque handle, never dereferenced here)
I32 = c_int32

_PROTOTYPES: dict[str, tuple[object, list[object]]] = {
    "kvd_version": (c_char_p, []),
    "kvd_abi_version": (c_uint32, []),
    "kvd_status_str": (c_char_p, [I32]),
    "kvd_last_error_message": (c_char_p, []),
    "kvd_last_error_info": (I32, [P(ErrorInfo)]),
    "kvd_options_init": (I32, [P(ClientOptions), c_uint32]),
    "kvd_connect": (I32, [c_char_p, P(ClientOptions), P(C)]),
    "kvd_close": (I32, [C]),
    "kvd_reconnect": (I32, [C]),
    "kvd_heartbeat": (I32, [C, P(c_uint64)]),
    "kvd_lease_left": (I32, [C, P(c_uint64), P(c_bool)]),
    "kvd_set_request": (I32, [C, c_uint64]),
    "kvd_pool_info": (I32, [C, P(PoolInfo)]),
    "kvd_stats": (I32, [C, P(Stats)]),
    "kvd_counter_count": (c_size_t, []),
    "kvd_counter_name": (c_char_p, [c_size_t]),
    "kvd_counters": (I32, [C, P(c_uint64), c_size_t]),
    "kvd_health_check": (I32, [C, P(HealthReport)]),
    "kvd_namespace_id": (I32, [P(NamespaceDescriptor), P(NamespaceId)]),
    "kvd_block_tags": (
        I32,
        [P(NamespaceId), c_uint32, P(c_uint32), c_size_t, P(Tag), c_size_t, P(c_size_t)],
    ),
    "kvd_register_namespace": (I32, [C, P(NamespaceDescriptor), P(NamespaceId)]),
    "kvd_lookup_prefix": (
        I32,
        [
            C,
            P(NamespaceId),
            P(Tag),
            c_size_t,
            c_bool,
            c_uint64,
            P(BlockInfo),
            c_size_t,
            P(c_size_t),
            P(c_bool),
        ],
    ),
    "kvd_exists": (I32, [C, P(Key), c_size_t, P(c_uint8), c_size_t]),
    "kvd_acquire": (I32, [C, P(Key), c_size_t, c_uint64, P(BlockInfo), P(I32)]),
    "kvd_release": (I32, [C, P(Handle), c_size_t, P(I32)]),
    "kvd_alloc": (
        I32,
        [C, P(Key), c_size_t, P(BlockClass), c_uint64, P(Allocation), P(I32)],
    ),
    "kvd_write": (I32, [C, P(Handle), c_uint64, c_void_p, c_size_t]),
    "kvd_write_crc": (
        I32,
        [C, P(Handle), c_uint64, c_void_p, c_size_t, c_uint32, P(c_uint32)],
    ),
    "kvd_seal": (I32, [C, P(SealItem), c_size_t, P(c_uint32), P(I32)]),
    "kvd_publish": (I32, [C, P(Handle), c_size_t]),
    "kvd_instance_join": (I32, [C, c_uint64, c_uint64, c_uint32, c_uint32]),
    "kvd_instance_commit": (I32, [C, c_uint64, c_uint64, c_uint64, P(Handle), c_size_t, P(c_bool)]),
    "kvd_abort": (I32, [C, P(Handle), c_size_t, P(I32)]),
    "kvd_remove_if": (I32, [C, P(RemoveItem), c_size_t, P(I32)]),
    "kvd_touch": (I32, [C, P(Key), c_size_t]),
    "kvd_soft_pin": (I32, [C, P(Key), c_size_t, c_uint64, P(c_uint8), c_size_t]),
    "kvd_read": (I32, [C, P(Handle), c_uint64, c_void_p, c_size_t]),
    "kvd_read_verified": (I32, [C, P(Handle), c_void_p, c_size_t, P(c_uint64)]),
    "kvd_handle_version": (I32, [P(Handle), P(BlockVersion)]),
    "kvd_view_acquire": (I32, [C, P(Handle), P(View)]),
    "kvd_view_still_valid": (I32, [C, P(View)]),
    "kvd_block_mut": (I32, [C, P(Handle), P(c_void_p), P(c_uint64)]),
    "kvd_reserve": (I32, [C, c_uint64, P(c_uint64)]),
    "kvd_release_reservation": (I32, [C, c_uint64]),
    "kvd_manifest_begin": (
        I32,
        [C, c_uint64, c_uint64, P(NamespaceId), c_uint64, c_uint64, P(ManifestInfo)],
    ),
    "kvd_manifest_extend": (
        I32,
        [C, c_uint64, c_uint64, P(Handle), c_size_t, c_uint64, P(ManifestInfo)],
    ),
    "kvd_manifest_renew": (I32, [C, c_uint64, c_uint64, c_uint64, P(c_uint64)]),
    "kvd_manifest_end": (I32, [C, c_uint64, c_uint64]),
    "kvd_manifest_get": (I32, [C, c_uint64, P(ManifestInfo), P(Tag), c_size_t]),
    "kvd_restore_prefix": (
        I32,
        [C, c_uint64, P(c_uint32), c_size_t, P(RestoreInfo), P(BlockInfo), c_size_t],
    ),
    "kvd_events": (I32, [C, c_uint64, P(BlockEvent), c_size_t, P(EventBatch)]),
    "kvd_push": (I32, [C, c_uint64, P(Key), c_size_t, P(c_uint64)]),
    "kvd_fetch": (I32, [C, c_uint64, P(Key), c_size_t, P(c_uint64)]),
    "kvd_push_checkpoint": (
        I32,
        [C, c_uint64, c_uint64, c_uint64, P(Key), c_size_t, c_uint64, c_uint64, P(c_uint64)],
    ),
    "kvd_fetch_prefix": (I32, [C, c_uint64, c_uint64, P(c_uint32), c_size_t, P(c_uint64)]),
    "kvd_fetch_held": (
        I32,
        [C, c_uint64, c_uint64, c_uint64, P(Key), c_size_t, c_int32, P(c_uint64)],
    ),
    "kvd_hold_begin": (
        I32,
        [C, c_uint64, c_uint64, P(Key), c_size_t, c_uint64, P(c_size_t), P(c_uint64)],
    ),
    "kvd_hold_end": (I32, [C, c_uint64, c_uint64, P(c_int32)]),
    "kvd_transfers": (
        I32,
        [C, P(c_uint64), c_size_t, P(TransferInfo), c_size_t, P(c_size_t)],
    ),
    "kvd_async_start": (I32, [C, c_uint32]),
    "kvd_async_fd": (I32, [C, P(c_int32)]),
    "kvd_async_lookup_prefix": (
        I32,
        [C, P(NamespaceId), P(Tag), c_size_t, c_bool, c_uint64, c_uint64, P(BlockInfo), c_size_t],
    ),
    "kvd_async_poll": (I32, [C, c_uint64, P(Completion), c_size_t, P(c_size_t)]),
    "kvd_async_release": (I32, [C, P(Handle), c_size_t, c_uint64]),
    "kvd_cuda_register_pool": (I32, [C]),
    "kvd_cuda_copy_to_block": (
        I32,
        [C, P(Handle), P(c_uint64), P(c_uint64), c_size_t, c_uint64, P(c_uint64)],
    ),
    "kvd_cuda_copy_from_block": (
        I32,
        [C, P(Handle), P(c_uint64), P(c_uint64), c_size_t, c_uint64, P(c_uint64)],
    ),
    "kvd_cuda_event_wait": (I32, [C, c_uint64, c_uint64]),
    "kvd_cuda_event_release": (I32, [C, c_uint64]),
}

for _name, (_res, _args) in _PROTOTYPES.items():
    _f = getattr(lib, _name)
    _f.restype = _res
    _f.argtypes = _args

if lib.kvd_abi_version() != ABI_VERSION:
    raise ImportError(
        f"libkvd speaks ABI version {lib.kvd_abi_version()}, this package {ABI_VERSION}: "
        "reinstall the package"
    )

# The store's counters, named by the library (kvd-core declares each once), in the order
# kvd_counters writes them. `Stats` keeps those of ABI 1 as fields; this names every one.
COUNTER_NAMES: tuple[str, ...] = tuple(
    lib.kvd_counter_name(i).decode() for i in range(lib.kvd_counter_count())
)
