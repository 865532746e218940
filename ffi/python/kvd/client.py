"""``kvd.Client``: one session with the local kvd daemon, over libkvd.

Keys are 64-byte ``bytes`` (a 32-byte namespace id followed by a 32-byte tag: see ``key``).
Handles are libkvd's ``Handle`` structs. Batched calls answer per item where items can fail
apart: each item is its value or the ``KvdError`` it met; whole-call failures raise.

Zero-copy views (``Client.view``) follow libkvd's contract: take a view only of a block you
pinned, use its bytes (``view.data`` is a read-only ``memoryview`` in the mapped pool), then call
``view.still_valid()``; if it raises ``StaleGeneration`` the page moved on and whatever you
derived from the bytes must be discarded. ``close`` and ``reconnect`` unmap the pool: they
release every view's memoryview first, so Python code gets ``ValueError`` instead of a crash
(an export taken from a view, such as a numpy array over it, must not outlive the client).
"""

from __future__ import annotations

import array
import ctypes
import struct
import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence, Union

from . import _lib
from .errors import OK, Disconnected, KvdError, check, for_status, last_error

MANIFEST_TRIES = 8  # reads of a manifest that grows while it is read

L = _lib.lib

ANY_NODE = _lib.ANY_NODE  # fetch's peer for "whichever peers hold them" (a cluster fetch)
DTYPES = {"bf16": 1, "f16": 2, "f32": 3, "fp8_e4m3": 4, "fp8_e5m2": 5}

Buffer = Any  # anything with the buffer protocol (bytes, bytearray, memoryview, numpy arrays)


@dataclass(frozen=True)
class Namespace:
    """Everything that determines a KV block's bytes; every field takes part in its id."""

    model_name: str
    model_revision: str
    bytes_per_block: int
    tokens_per_block: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bf16"
    tokenizer: str = ""
    adapter: str = ""
    cache_salt: str = ""
    rope: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def _c(self) -> _lib.NamespaceDescriptor:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is none of {sorted(DTYPES)}")
        return _lib.NamespaceDescriptor(
            model_name=self.model_name.encode(),
            model_revision=self.model_revision.encode(),
            tokenizer=self.tokenizer.encode(),
            adapter=self.adapter.encode(),
            cache_salt=self.cache_salt.encode(),
            rope=self.rope.encode(),
            dtype=DTYPES[self.dtype],
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            tokens_per_block=self.tokens_per_block,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
            bytes_per_block=self.bytes_per_block,
        )

    def id(self) -> bytes:
        """The namespace id, computed locally (the daemon computes the same)."""
        out = _lib.NamespaceId()
        check(L.kvd_namespace_id(self._c(), out))
        return bytes(out.bytes)


@dataclass(frozen=True)
class Block:
    """A PUBLISHED block as a lookup or acquire sees it."""

    key: bytes
    handle: _lib.Handle
    offset: int
    len: int
    checksum: int
    pin_ttl_ms: int


@dataclass(frozen=True)
class Allocation:
    """A block allocated for writing."""

    key: bytes
    handle: _lib.Handle
    offset: int
    capacity: int


@dataclass(frozen=True)
class Manifest:
    """A request's checkpoint manifest."""

    request: int
    epoch: int
    namespace: bytes
    committed_tokens: int
    expires_at_ms: int
    reservation: int
    tags: list[bytes]


@dataclass(frozen=True)
class Restore:
    """What a checkpoint holder can restore for a request."""

    epoch: int
    tokens: int
    committed_tokens: int
    blocks: list[Block]


@dataclass(frozen=True)
class Transfer:
    """A transfer this node's daemon started: ``state`` is ``"in_flight"``, ``"done"`` (every
    block published at the destination) or ``"failed"`` (nothing of it published; ``error``
    says why)."""

    id: int
    peer: int
    state: str
    error: Optional[KvdError]
    blocks: int
    bytes: int
    tokens: int
    elapsed_ms: int


@dataclass(frozen=True)
class Event:
    """One entry of the node's block event log: ``kind`` is ``"stored"`` (the block became
    PUBLISHED) or ``"removed"`` (it left the index: removed, evicted, quarantined, or its
    checkpoint ended)."""

    seq: int
    kind: str
    key: bytes


@dataclass(frozen=True)
class EventBatch:
    """A batch drained from the event log: pass ``next_seq`` as the next ``since``; ``lost``
    counts events the daemon's bounded log dropped before this reader read them (resync with
    lookups when it is not 0)."""

    events: list[Event]
    next_seq: int
    lost: int


_EVENT_KINDS = {_lib.EVENT_STORED: "stored", _lib.EVENT_REMOVED: "removed"}


def key(namespace: bytes, tag: bytes) -> bytes:
    """A block key: the 32-byte namespace id followed by the 32-byte tag."""
    if len(namespace) != 32 or len(tag) != 32:
        raise ValueError("a namespace id and a tag are 32 bytes each")
    return namespace + tag


def version() -> str:
    """The kvd release libkvd was built from."""
    return L.kvd_version().decode()


def block_tags(namespace: bytes, tokens_per_block: int, tokens: Sequence[int]) -> list[bytes]:
    """The chained tags of every full block of ``tokens`` (no tag for a partial tail)."""
    ns = _ns(namespace)
    n = len(tokens)
    arr = _u32(tokens)
    cap = n // tokens_per_block if tokens_per_block else 0
    out = (_lib.Tag * max(cap, 1))()
    got = ctypes.c_size_t()
    check(L.kvd_block_tags(ns, tokens_per_block, arr, n, out, cap, got))
    return [bytes(out[i].bytes) for i in range(got.value)]


def _u32(tokens: Sequence[int]) -> Any:
    """Token ids as a C ``uint32_t`` array (at least one element): through ``array``, which
    converts a list of ints many times faster than ctypes' own constructor."""
    a = array.array("I", tokens)
    if a.itemsize != 4:  # pragma: no cover - no such platform among kvd's
        return (ctypes.c_uint32 * max(len(a), 1))(*tokens)
    if not a:
        return (ctypes.c_uint32 * 1)()
    return (ctypes.c_uint32 * len(a)).from_buffer(a)


def _ns(namespace: bytes) -> _lib.NamespaceId:
    if len(namespace) != 32:
        raise ValueError("a namespace id is 32 bytes")
    return _lib.NamespaceId.from_buffer_copy(namespace)


def _keys(keys: Sequence[bytes]) -> Any:
    arr = (_lib.Key * max(len(keys), 1))()
    raw = b"".join(keys)
    if len(raw) != 64 * len(keys):
        raise ValueError("every key is 64 bytes (namespace id + tag)")
    ctypes.memmove(arr, raw, len(raw))
    return arr


def _tags(tags: Sequence[bytes]) -> Any:
    arr = (_lib.Tag * max(len(tags), 1))()
    raw = b"".join(tags)
    if len(raw) != 32 * len(tags):
        raise ValueError("every tag is 32 bytes")
    ctypes.memmove(arr, raw, len(raw))
    return arr


def _handles(handles: Sequence[_lib.Handle]) -> Any:
    return (_lib.Handle * max(len(handles), 1))(*handles)


def _statuses(n: int) -> Any:
    return (ctypes.c_int32 * max(n, 1))()


_INFO_BYTES = ctypes.sizeof(_lib.BlockInfo)
_HANDLE_AT = _lib.BlockInfo.handle.offset
_REST = struct.Struct("<QQIIQ")  # offset, len, checksum, reserved, pin_ttl_ms
_REST_AT = _lib.BlockInfo.offset.offset


def _blocks(arr: Any, n: int) -> list[Block]:
    """The first ``n`` infos of a ``BlockInfo`` array, read from its bytes in one pass."""
    raw = ctypes.string_at(ctypes.addressof(arr), n * _INFO_BYTES)
    out = []
    for i in range(n):
        at = i * _INFO_BYTES
        off, length, crc, _, ttl = _REST.unpack_from(raw, at + _REST_AT)
        h = _lib.Handle.from_buffer_copy(raw, at + _HANDLE_AT)
        out.append(Block(raw[at : at + 64], h, off, length, crc, ttl))
    return out


def _readable(data: Buffer) -> tuple[int, int, Any]:
    """(address, length, keep-alive) of a contiguous buffer, without a copy where possible."""
    if isinstance(data, bytes):
        p = ctypes.c_char_p(data)
        return ctypes.cast(p, ctypes.c_void_p).value or 0, len(data), (data, p)
    mv = memoryview(data)
    if not mv.c_contiguous:
        raise ValueError("the buffer must be C-contiguous")
    if not mv.readonly:
        c = (ctypes.c_char * mv.nbytes).from_buffer(mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv)
        return ctypes.addressof(c), mv.nbytes, (mv, c)
    iface = getattr(data, "__array_interface__", None)
    if iface is not None:
        return int(iface["data"][0]), mv.nbytes, data
    copy = mv.tobytes()  # a read-only buffer without an address: one copy
    return _readable(copy)


def _writable(dst: Buffer) -> tuple[int, int, Any]:
    iface = getattr(dst, "__array_interface__", None)
    if iface is not None and not iface["data"][1] and getattr(dst, "flags", None) is not None:
        if dst.flags["C_CONTIGUOUS"]:  # numpy: its address, no buffer export
            return int(iface["data"][0]), int(dst.nbytes), dst
    mv = memoryview(dst)
    if mv.readonly or not mv.c_contiguous:
        raise ValueError("the destination must be a writable, C-contiguous buffer")
    flat = mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv
    c = (ctypes.c_char * mv.nbytes).from_buffer(flat)
    return ctypes.addressof(c), mv.nbytes, (mv, c)


class BlockView:
    """A zero-copy, read-only view of a pinned block in the pool: use ``data``, then
    ``still_valid()``. A context manager that releases the memoryview on exit."""

    def __init__(self, client: "Client", v: _lib.View) -> None:
        self._client = client
        self._v = v
        arr = (ctypes.c_ubyte * v.len).from_address(v.data) if v.len else (ctypes.c_ubyte * 0)()
        self.data: memoryview = memoryview(arr).cast("B").toreadonly()
        self.handle = v.handle
        self.address: int = int(v.data or 0)
        """The block's first byte in the pool (for copies to raw addresses, ``ctypes.memmove``)."""

    def still_valid(self) -> None:
        """Raise ``StaleGeneration`` (or ``Disconnected``) if the page did not hold the block
        from when the view was taken until now; return if the bytes were the block's."""
        check(L.kvd_view_still_valid(self._client._c(), self._v))

    def valid(self) -> bool:
        """``still_valid`` as a boolean (False for any error)."""
        try:
            self.still_valid()
            return True
        except KvdError:
            return False

    def numpy(self) -> Any:
        """The bytes as a read-only numpy uint8 array (needs numpy)."""
        import numpy as np

        return np.frombuffer(self.data, dtype=np.uint8)

    def release(self) -> None:
        """Release the memoryview (afterwards ``data`` raises ``ValueError``)."""
        try:
            self.data.release()
        except BufferError:
            pass  # an export (numpy array) still holds it; the caller's to drop

    def __enter__(self) -> "BlockView":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Client:
    """One session with the local kvd daemon. Safe to share between threads (libkvd serializes
    calls on one client); open one per thread to move bytes in parallel."""

    def __init__(
        self,
        socket: str,
        *,
        name: str = "python",
        lease_ttl_ms: int = 10_000,
        io_timeout_ms: int = 30_000,
        populate: bool = True,
    ) -> None:
        o = _lib.ClientOptions()
        check(L.kvd_options_init(o, _lib.ABI_VERSION))
        self._name = name.encode()
        o.name = self._name
        o.lease_ttl_ms = lease_ttl_ms
        o.io_timeout_ms = io_timeout_ms
        o.populate = populate
        h = ctypes.c_void_p()
        check(L.kvd_connect(str(socket).encode(), o, h))
        self._h: Optional[int] = h.value
        self._views: "weakref.WeakSet[BlockView]" = weakref.WeakSet()
        # Asynchronous lookups in flight: ticket -> the output array libkvd fills at poll.
        self._pending: dict[int, Any] = {}
        self._next_ticket = 1

    # -- session ---------------------------------------------------------------------------

    def _c(self) -> int:
        if self._h is None:
            raise ValueError("the client is closed")
        return self._h

    def _release_views(self) -> None:
        for v in list(self._views):
            v.release()
        self._views = weakref.WeakSet()

    def close(self) -> None:
        """Close the session (the daemon aborts unfinished blocks and drops pins). Idempotent
        from Python's side; every view is released first."""
        if self._h is None:
            return
        self._release_views()
        h, self._h = self._h, None
        s = L.kvd_close(h)
        if s not in (OK, Disconnected.status):
            raise last_error(s)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def reconnect(self) -> None:
        """A fresh session replacing this one: every handle, pin and view is gone. An
        asynchronous queue (``async_start``) carries on over the new session; it is not
        started again."""
        self._release_views()
        check(L.kvd_reconnect(self._c()))

    def keep_alive(self, renew_below_ms: int = 5_000) -> bool:
        """Make the session usable now: renew a lease that an idle spell left shorter than
        ``renew_below_ms`` (one round trip, only then), reopen one that lapsed or broke. True
        when a new session was opened: the caller registers its namespaces again (pins and
        handles do not carry over). An engine adapter calls this before its work, because an
        engine with no requests makes no calls, and nothing else renews the lease. Raises what
        ``reconnect`` raises when the daemon cannot be reached."""
        try:
            left_ms, broken = self.lease_left()
            if not broken and left_ms > 0:
                if left_ms < renew_below_ms:
                    self.heartbeat()
                return False
        except KvdError:
            pass
        self.reconnect()
        return True

    def heartbeat(self) -> int:
        """Renew the lease; the ms until it expires."""
        ms = ctypes.c_uint64()
        check(L.kvd_heartbeat(self._c(), ms))
        return ms.value

    def lease_left(self) -> tuple[int, bool]:
        """(ms the lease holds at least, whether the connection failed)."""
        ms, broken = ctypes.c_uint64(), ctypes.c_bool()
        check(L.kvd_lease_left(self._c(), ms, broken))
        return ms.value, broken.value

    def set_request(self, request: int) -> None:
        """The engine request the next calls serve (0: none), for the daemon's traces."""
        check(L.kvd_set_request(self._c(), request))

    def pool_info(self) -> _lib.PoolInfo:
        """Where the pool is mapped, the page size, the session, the batch bound."""
        p = _lib.PoolInfo()
        check(L.kvd_pool_info(self._c(), p))
        return p

    def stats(self) -> dict[str, int]:
        """The store's counts: ``Stats``' fields, and every counter by the library's names
        (``kvd_counters``, read after the struct, so the counters agree among themselves)."""
        s = _lib.Stats()
        check(L.kvd_stats(self._c(), s))
        out = {f: getattr(s, f) for f, _ in _lib.Stats._fields_}
        values = (ctypes.c_uint64 * len(_lib.COUNTER_NAMES))()
        check(L.kvd_counters(self._c(), values, len(values)))
        out.update(zip(_lib.COUNTER_NAMES, values))
        return out

    def health_check(self) -> int:
        """Run the write-read-verify canary through the daemon; the microseconds it took."""
        r = _lib.HealthReport()
        check(L.kvd_health_check(self._c(), r))
        return r.elapsed_us

    # -- blocks ----------------------------------------------------------------------------

    def register_namespace(self, ns: Namespace) -> bytes:
        """Register a layout with the daemon (idempotent); its id."""
        out = _lib.NamespaceId()
        check(L.kvd_register_namespace(self._c(), ns._c(), out))
        return bytes(out.bytes)

    def lookup_prefix(
        self, namespace: bytes, tags: Sequence[bytes], pin: bool = False, pin_ttl_ms: int = 0
    ) -> list[Block]:
        """The longest PUBLISHED prefix of the chain ``tags`` (pinned with ``pin``)."""
        n = len(tags)
        ts = _tags(tags)
        out = (_lib.BlockInfo * max(n, 1))()
        got, pinned = ctypes.c_size_t(), ctypes.c_bool()
        check(L.kvd_lookup_prefix(self._c(), _ns(namespace), ts, n, pin, pin_ttl_ms, out, n, got, pinned))
        return _blocks(out, got.value)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys are PUBLISHED."""
        return self._bitmap_call(L.kvd_exists, keys)

    def soft_pin(self, keys: Sequence[bytes], ttl_ms: int) -> list[bool]:
        """Soft-pin PUBLISHED cache blocks (a shared prefix: a system prompt's blocks) until
        ``ttl_ms`` from now (capped at a day; 0 ends it): eviction takes them only when nothing
        else can go. Which keys were soft-pinned."""
        return self._bitmap_call(L.kvd_soft_pin, keys, ttl_ms)

    def _bitmap_call(self, fn: Any, keys: Sequence[bytes], *args: int) -> list[bool]:
        n = len(keys)
        bits = (ctypes.c_uint8 * max((n + 7) // 8, 1))()
        check(fn(self._c(), _keys(keys), n, *args, bits, (n + 7) // 8))
        return [bool(bits[i // 8] >> (i % 8) & 1) for i in range(n)]

    def acquire(self, keys: Sequence[bytes], ttl_ms: int = 0) -> list[Union[Block, KvdError]]:
        """Pin PUBLISHED blocks for reading (``ttl_ms`` 0: the daemon's default)."""
        n = len(keys)
        out, st = (_lib.BlockInfo * max(n, 1))(), _statuses(n)
        check(L.kvd_acquire(self._c(), _keys(keys), n, ttl_ms, out, st))
        blocks = _blocks(out, n)
        return [blocks[i] if st[i] == OK else for_status(st[i]) for i in range(n)]

    def release(self, handles: Sequence[_lib.Handle]) -> list[Optional[KvdError]]:
        """Release pins; a stale or already released entry gets its error in its place."""
        n = len(handles)
        st = _statuses(n)
        check(L.kvd_release(self._c(), _handles(handles), n, st))
        return [None if st[i] == OK else for_status(st[i]) for i in range(n)]

    def alloc(
        self,
        keys: Sequence[bytes],
        *,
        checkpoint: Optional[tuple[int, int]] = None,
        reservation: int = 0,
    ) -> list[Union[Allocation, KvdError]]:
        """Allocate blocks to write; ``checkpoint=(request, epoch)`` for a checkpoint block."""
        n = len(keys)
        cls = None
        if checkpoint is not None:
            cls = _lib.BlockClass(kind=1, request=checkpoint[0], epoch=checkpoint[1])
        out, st = (_lib.Allocation * max(n, 1))(), _statuses(n)
        check(L.kvd_alloc(self._c(), _keys(keys), n, cls, reservation, out, st))
        return [
            Allocation(keys[i], _lib.Handle.from_buffer_copy(out[i].handle), out[i].offset, out[i].capacity)
            if st[i] == OK
            else for_status(st[i])
            for i in range(n)
        ]

    def write(self, handle: _lib.Handle, data: Buffer, offset: int = 0, crc: Optional[int] = None) -> Optional[int]:
        """Copy ``data`` into a block being written, at ``offset``. With ``crc`` (0 to start),
        the CRC-32C is computed in the same pass, continued from it, and returned."""
        addr, n, keep = _readable(data)
        return self.write_from(handle, addr, n, offset, crc, keep)

    def write_from(
        self,
        handle: _lib.Handle,
        address: int,
        size: int,
        offset: int = 0,
        crc: Optional[int] = None,
        _keep: Any = None,
    ) -> Optional[int]:
        """``write`` from a raw address (a pinned host buffer, ``tensor.data_ptr()``)."""
        if crc is None:
            check(L.kvd_write(self._c(), handle, offset, address, size))
            return None
        out = ctypes.c_uint32()
        check(L.kvd_write_crc(self._c(), handle, offset, address, size, crc, out))
        return out.value

    def seal(self, items: Sequence[tuple[_lib.Handle, int, Optional[int]]]) -> list[Union[int, KvdError]]:
        """Seal ``(handle, length, crc or None)`` items; each gets its recorded CRC or error."""
        n = len(items)
        arr = (_lib.SealItem * max(n, 1))()
        for i, (h, length, crc) in enumerate(items):
            arr[i].handle = h
            arr[i].len = length
            arr[i].checksum = crc or 0
            arr[i].has_checksum = crc is not None
        sums, st = (ctypes.c_uint32 * max(n, 1))(), _statuses(n)
        check(L.kvd_seal(self._c(), arr, n, sums, st))
        return [sums[i] if st[i] == OK else for_status(st[i]) for i in range(n)]

    def publish(self, handles: Sequence[_lib.Handle]) -> None:
        """Publish SEALED cache blocks as one group: all or none."""
        check(L.kvd_publish(self._c(), _handles(handles), len(handles)))

    def instance_join(self, instance: int, generation: int, rank: int, rank_count: int) -> None:
        """Make this session rank ``rank`` of engine instance ``(instance, generation)`` of
        ``rank_count`` ranks: its steps publish together, and it fails as a whole when a rank's
        session ends (``Unavailable`` for its other ranks)."""
        check(L.kvd_instance_join(self._c(), instance, generation, rank, rank_count))

    def instance_commit(self, instance: int, generation: int, step: int, handles: Sequence[_lib.Handle]) -> bool:
        """Commit this rank's SEALED blocks of ``step``; True when that published the step
        (every rank's blocks of it, together)."""
        published = ctypes.c_bool(False)
        check(
            L.kvd_instance_commit(
                self._c(), instance, generation, step, _handles(handles), len(handles), ctypes.byref(published)
            )
        )
        return published.value

    def abort(self, handles: Sequence[_lib.Handle]) -> list[Optional[KvdError]]:
        """Abort unfinished blocks."""
        n = len(handles)
        st = _statuses(n)
        check(L.kvd_abort(self._c(), _handles(handles), n, st))
        return [None if st[i] == OK else for_status(st[i]) for i in range(n)]

    def remove_if(self, items: Sequence[tuple[bytes, _lib.Handle]]) -> list[Optional[KvdError]]:
        """Compare-and-delete each ``(key, handle)``: only that version of the key goes."""
        n = len(items)
        arr = (_lib.RemoveItem * max(n, 1))()
        for i, (k, h) in enumerate(items):
            ctypes.memmove(ctypes.addressof(arr[i].key), k, 64)
            check(L.kvd_handle_version(h, arr[i].version))
        st = _statuses(n)
        check(L.kvd_remove_if(self._c(), arr, n, st))
        return [None if st[i] == OK else for_status(st[i]) for i in range(n)]

    # -- events for KV-aware routers --------------------------------------------------------

    def events(self, since: int = 0, max_events: int = 256) -> EventBatch:
        """The node's block events with ``seq >= since`` (0: the oldest held), at most
        ``max_events`` (at most ``pool_info().max_batch``), in order. Sequence numbers restart
        at 1 when the daemon restarts (``pool_info().node_generation`` changes): start again
        from 0 then."""
        out = (_lib.BlockEvent * max(max_events, 1))()
        b = _lib.EventBatch()
        check(L.kvd_events(self._c(), since, out, max_events, b))
        events = []
        for i in range(b.count):
            e = out[i]
            k = bytes(e.key.namespace_id.bytes) + bytes(e.key.tag.bytes)
            events.append(Event(e.seq, _EVENT_KINDS[e.kind], k))
        return EventBatch(events, b.next_seq, b.lost)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark blocks recently used."""
        check(L.kvd_touch(self._c(), _keys(keys), len(keys)))

    def read(self, handle: _lib.Handle, dst: Buffer, offset: int = 0) -> None:
        """Copy ``len(dst)`` bytes of a pinned block from ``offset`` into ``dst``."""
        addr, n, _keep = _writable(dst)
        check(L.kvd_read(self._c(), handle, offset, addr, n))

    def read_verified(self, handle: _lib.Handle, dst: Buffer) -> int:
        """Copy a whole pinned block into ``dst`` with its checksum checked in the same pass;
        the block's length. ``Corrupt`` on a mismatch (``corruption`` says what was done)."""
        addr, n, _keep = _writable(dst)
        return self.read_into(handle, addr, n)

    def read_into(self, handle: _lib.Handle, address: int, size: int) -> int:
        """``read_verified`` into a raw address of ``size`` bytes."""
        got = ctypes.c_uint64()
        check(L.kvd_read_verified(self._c(), handle, address, size, got))
        return got.value

    def view(self, handle: _lib.Handle) -> BlockView:
        """A zero-copy view of a pinned block (see the module docs for the contract)."""
        v = _lib.View()
        check(L.kvd_view_acquire(self._c(), handle, v))
        bv = BlockView(self, v)
        self._views.add(bv)
        return bv

    def block_mut(self, handle: _lib.Handle) -> memoryview:
        """A writable block's whole page in place (valid until it is sealed or aborted)."""
        p, cap = ctypes.c_void_p(), ctypes.c_uint64()
        check(L.kvd_block_mut(self._c(), handle, p, cap))
        return memoryview((ctypes.c_ubyte * cap.value).from_address(p.value or 0)).cast("B")

    # -- asynchronous lookups (an event loop submits and polls, never blocks on kvd) -------

    def async_start(self, max_inflight: int = 64) -> None:
        """Start this client's asynchronous queue (a worker thread of libkvd's, once)."""
        check(L.kvd_async_start(self._c(), max_inflight))

    def async_fd(self) -> int:
        """An eventfd, readable while completions wait (for ``select``/``asyncio`` loops)."""
        fd = ctypes.c_int32()
        check(L.kvd_async_fd(self._c(), fd))
        return fd.value

    def submit_lookup_prefix(
        self, namespace: bytes, tags: Sequence[bytes], pin: bool = False, pin_ttl_ms: int = 0
    ) -> int:
        """Submit a ``lookup_prefix``; returns a ticket that ``poll`` answers. ``Overloaded``
        when the queue's bound of unpolled calls is reached."""
        n = len(tags)
        ts = _tags(tags)
        out = (_lib.BlockInfo * max(n, 1))()
        ticket = self._next_ticket
        check(L.kvd_async_lookup_prefix(self._c(), _ns(namespace), ts, n, pin, pin_ttl_ms, ticket, out, n))
        self._next_ticket += 1
        self._pending[ticket] = out
        return ticket

    def submit_release(self, handles: Sequence[_lib.Handle]) -> int:
        """Submit a ``release`` of pins; returns a ticket that ``poll`` answers with an empty
        list (the pins are handed back on libkvd's worker thread, never waited for here)."""
        n = len(handles)
        ticket = self._next_ticket
        check(L.kvd_async_release(self._c(), _handles(handles), n, ticket))
        self._next_ticket += 1
        self._pending[ticket] = None
        return ticket

    def poll(self, timeout_ms: int = 0, max_completions: int = 64) -> list[tuple[int, Union[list[Block], KvdError]]]:
        """Finished asynchronous calls: ``(ticket, blocks or error)``, waiting at most
        ``timeout_ms`` for the first (0: not at all)."""
        comps = (_lib.Completion * max_completions)()
        n = ctypes.c_size_t()
        check(L.kvd_async_poll(self._c(), timeout_ms, comps, max_completions, n))
        done: list[tuple[int, Union[list[Block], KvdError]]] = []
        for i in range(n.value):
            c = comps[i]
            out = self._pending.pop(c.user_tag)
            if c.status != OK:
                done.append((c.user_tag, for_status(c.status)))
            else:
                done.append((c.user_tag, [] if out is None else _blocks(out, c.block_count)))
        return done

    # -- CUDA copies between device memory and blocks (libkvd built with its cuda feature) --

    def cuda_register_pool(self) -> None:
        """Register this client's mapping of the pool as pinned memory for CUDA copies
        (idempotent). ``Unsupported`` where libkvd has no CUDA or the host no driver."""
        check(L.kvd_cuda_register_pool(self._c()))

    def _cuda_copy(self, fn: Any, handle: _lib.Handle, slices: Sequence[tuple[int, int]], stream: int) -> int:
        n = len(slices)
        ptrs = (ctypes.c_uint64 * max(n, 1))(*[int(p) for p, _ in slices])
        lens = (ctypes.c_uint64 * max(n, 1))(*[int(s) for _, s in slices])
        event = ctypes.c_uint64()
        check(fn(self._c(), handle, ptrs, lens, n, int(stream), event))
        return event.value

    def cuda_copy_to_block(self, handle: _lib.Handle, slices: Sequence[tuple[int, int]], stream: int = 0) -> int:
        """Enqueue copies of device ``slices`` ``(address, bytes)`` into a block being written,
        back to back from its first byte, on ``stream``; the completion event (wait for it,
        then release it, before sealing)."""
        return self._cuda_copy(L.kvd_cuda_copy_to_block, handle, slices, stream)

    def cuda_copy_from_block(self, handle: _lib.Handle, slices: Sequence[tuple[int, int]], stream: int = 0) -> int:
        """Enqueue copies of a pinned block into device ``slices``, from its first byte; the
        completion event (keep the pin until it is released)."""
        return self._cuda_copy(L.kvd_cuda_copy_from_block, handle, slices, stream)

    def cuda_event_wait(self, event: int, timeout_ms: int) -> None:
        """Wait for an event's copies; ``DeadlineExceeded`` if they still run at the timeout,
        ``StaleGeneration`` when a copy out of a block finished after its page moved on."""
        check(L.kvd_cuda_event_wait(self._c(), event, timeout_ms))

    def cuda_event_release(self, event: int) -> None:
        """Hand an event back (waits for its copies first)."""
        check(L.kvd_cuda_event_release(self._c(), event))

    # -- batched convenience over the calls above ------------------------------------------

    def put(self, keys: Sequence[bytes], pages: Sequence[Buffer]) -> list[Optional[KvdError]]:
        """Write and publish one cache block per key: alloc the batch, copy each page with its
        CRC, seal, publish the sealed ones as one group. Per key: None, or why not (an
        existing key is ``AlreadyExists``)."""
        if len(keys) != len(pages):
            raise ValueError("one page per key")
        allocs = self.alloc(keys)
        result: list[Optional[KvdError]] = [a if isinstance(a, KvdError) else None for a in allocs]
        items, idx = [], []
        for i, a in enumerate(allocs):
            if isinstance(a, KvdError):
                continue
            data = pages[i]
            crc = self.write(a.handle, data, 0, 0)
            items.append((a.handle, memoryview(data).nbytes, crc))
            idx.append(i)
        sealed = self.seal(items) if items else []
        good = []
        for j, s in enumerate(sealed):
            if isinstance(s, KvdError):
                result[idx[j]] = s
            else:
                good.append(items[j][0])
        if good:
            self.publish(good)
        return result

    def get(self, keys: Sequence[bytes], dsts: Sequence[Buffer]) -> list[Union[int, KvdError]]:
        """Acquire, copy out verified into ``dsts``, release. Per key: its length or why not.
        Works on libkvd's arrays directly (no per-block Python objects on the way)."""
        n = len(keys)
        if len(dsts) != n:
            raise ValueError("one destination per key")
        c = self._c()
        infos, st = (_lib.BlockInfo * max(n, 1))(), _statuses(n)
        check(L.kvd_acquire(c, _keys(keys), n, 0, infos, st))
        pinned = (_lib.Handle * max(n, 1))()
        m = 0
        out: list[Union[int, KvdError]] = []
        got = ctypes.c_uint64()
        for i in range(n):
            if st[i] != OK:
                out.append(for_status(st[i]))
                continue
            h = infos[i].handle
            pinned[m] = h
            m += 1
            addr, size, _keep = _writable(dsts[i])
            s = L.kvd_read_verified(c, h, addr, size, got)
            out.append(got.value if s == OK else last_error(s))
        if m:
            rs = _statuses(m)
            check(L.kvd_release(c, pinned, m, rs))
        return out

    # -- reservations and checkpoints ------------------------------------------------------

    def reserve(self, nbytes: int) -> int:
        """Reserve space for this session's allocations; the reservation id."""
        r = ctypes.c_uint64()
        check(L.kvd_reserve(self._c(), nbytes, r))
        return r.value

    def release_reservation(self, reservation: int) -> None:
        """Give a reservation's unused space back."""
        check(L.kvd_release_reservation(self._c(), reservation))

    def _manifest(self, m: _lib.ManifestInfo, tags: Iterable[bytes] = ()) -> Manifest:
        return Manifest(
            m.request,
            m.epoch,
            bytes(m.namespace_id.bytes),
            m.committed_tokens,
            m.expires_at_ms,
            m.reservation,
            list(tags),
        )

    def manifest_begin(
        self, request: int, epoch: int, namespace: bytes, reserve_bytes: int = 0, ttl_ms: int = 60_000
    ) -> Manifest:
        """Begin (or supersede with a newer epoch) a request's checkpoint."""
        m = _lib.ManifestInfo()
        check(L.kvd_manifest_begin(self._c(), request, epoch, _ns(namespace), reserve_bytes, ttl_ms, m))
        return self._manifest(m)

    def manifest_extend(
        self, request: int, epoch: int, handles: Sequence[_lib.Handle], committed_tokens: int
    ) -> Manifest:
        """Publish SEALED checkpoint blocks into the manifest, atomically."""
        m = _lib.ManifestInfo()
        check(L.kvd_manifest_extend(self._c(), request, epoch, _handles(handles), len(handles), committed_tokens, m))
        return self._manifest(m)

    def manifest_renew(self, request: int, epoch: int, ttl_ms: int) -> int:
        """Renew a manifest's TTL; the ms until it expires."""
        ms = ctypes.c_uint64()
        check(L.kvd_manifest_renew(self._c(), request, epoch, ttl_ms, ms))
        return ms.value

    def manifest_end(self, request: int, epoch: int) -> None:
        """The request ended: release its checkpoint."""
        check(L.kvd_manifest_end(self._c(), request, epoch))

    def manifest(self, request: int) -> Manifest:
        """A request's manifest, with its tags."""
        cap = 0
        for _ in range(MANIFEST_TRIES):  # asked again while it grows between the calls
            m = _lib.ManifestInfo()
            tags = (_lib.Tag * max(cap, 1))()
            status = L.kvd_manifest_get(self._c(), request, m, tags if cap else None, cap)
            if m.tag_count <= cap or (status != OK and not m.tag_count):
                check(status)
                return self._manifest(m, (bytes(tags[i].bytes) for i in range(m.tag_count)))
            cap = m.tag_count
        if status != OK:
            raise last_error(status)
        raise KvdError(f"request {request}'s manifest kept growing while read", retryable=True)

    def push(self, peer: int, keys: Sequence[bytes]) -> int:
        """Push PUBLISHED blocks (one namespace) to peer node ``peer`` over the daemon's data
        port; returns the transfer's id at once (poll it with :meth:`transfers`)."""
        out = ctypes.c_uint64()
        check(L.kvd_push(self._c(), peer, _keys(keys), len(keys), ctypes.byref(out)))
        return out.value

    def fetch(self, peer: int, keys: Sequence[bytes]) -> int:
        """Fetch PUBLISHED blocks (one namespace) from peer node ``peer``; they are published
        here as one group when every byte arrived intact. Returns the transfer's id at once.

        With ``peer`` ``ANY_NODE``, a cluster fetch: the daemon asks its live peers which of
        ``keys`` they hold and fetches the longest run from the first key that they hold
        between them, each piece from its holder (the transfer's ``blocks`` says how many
        arrived, its ``peer`` the first piece's holder)."""
        out = ctypes.c_uint64()
        check(L.kvd_fetch(self._c(), peer, _keys(keys), len(keys), ctypes.byref(out)))
        return out.value

    def push_checkpoint(
        self,
        peer: int,
        request: int,
        epoch: int,
        keys: Sequence[bytes],
        committed_tokens: int,
        ttl_ms: int,
    ) -> int:
        """Stream one checkpoint step of ``request`` to its holder ``peer`` (which extends its
        manifest with the blocks and ``committed_tokens`` atomically); the transfer's id."""
        out = ctypes.c_uint64()
        check(
            L.kvd_push_checkpoint(
                self._c(), peer, request, epoch, _keys(keys), len(keys), committed_tokens,
                ttl_ms, ctypes.byref(out),
            )
        )
        return out.value

    def fetch_prefix(self, peer: int, request: int, tokens: Sequence[int]) -> int:
        """The recovery read: fetch from holder ``peer`` the longest verified checkpoint
        prefix of ``request`` that ``tokens`` continues; the transfer's id."""
        n = len(tokens)
        arr = _u32(tokens)
        out = ctypes.c_uint64()
        check(L.kvd_fetch_prefix(self._c(), peer, request, arr, n, ctypes.byref(out)))
        return out.value

    def fetch_held(self, peer: int, request: int, epoch: int, keys: Sequence[bytes],
                   end_hold: bool = False) -> int:
        """A decode's hand-off read: fetch ``keys`` from peer ``peer``'s hold of ``request`` at
        ``epoch`` (refused there unless that hold lives at exactly that epoch and holds every
        key); with ``end_hold`` the peer's hold ends once every block is here. The transfer's
        id, at once."""
        out = ctypes.c_uint64()
        check(L.kvd_fetch_held(self._c(), peer, request, epoch, _keys(keys), len(keys),
                               int(end_hold), ctypes.byref(out)))
        return out.value

    def hold(self, request: int, epoch: int, keys: Sequence[bytes], ttl_ms: int) -> tuple[int, int]:
        """A prefill hands its run off: the daemon holds the leading PUBLISHED run of ``keys``
        for ``request`` at ``epoch`` (beyond this client's life) until it is ended, taken by
        the decode that fetched it, or ``ttl_ms`` passes. ``(blocks held, their bytes)``."""
        held, nbytes = ctypes.c_size_t(), ctypes.c_uint64()
        check(L.kvd_hold_begin(self._c(), request, epoch, _keys(keys), len(keys), ttl_ms,
                               ctypes.byref(held), ctypes.byref(nbytes)))
        return held.value, nbytes.value

    def end_hold(self, request: int, epoch: int) -> bool:
        """End ``request``'s hand-off hold here if its epoch is at most ``epoch``; whether one
        ended."""
        ended = ctypes.c_int32()
        check(L.kvd_hold_end(self._c(), request, epoch, ctypes.byref(ended)))
        return bool(ended.value)

    def transfers(self, ids: Sequence[int]) -> list[Transfer]:
        """The states of transfers started by this node's daemon (unknown ids left out)."""
        n = len(ids)
        arr = (ctypes.c_uint64 * max(n, 1))(*ids)
        out = (_lib.TransferInfo * max(n, 1))()
        found = ctypes.c_size_t()
        check(L.kvd_transfers(self._c(), arr, n, out, max(n, 1), ctypes.byref(found)))
        names = {
            _lib.TRANSFER_IN_FLIGHT: "in_flight",
            _lib.TRANSFER_DONE: "done",
            _lib.TRANSFER_FAILED: "failed",
        }
        return [
            Transfer(
                t.id, t.peer, names.get(t.state, "unknown"),
                for_status(t.status) if t.status != OK else None,
                t.blocks, t.bytes, t.tokens, t.elapsed_ms,
            )
            for t in out[: found.value]
        ]

    def restore_prefix(self, request: int, tokens: Sequence[int]) -> Restore:
        """The longest verified checkpoint prefix of ``tokens`` held here (not pinned)."""
        n = len(tokens)
        arr = _u32(tokens)
        info = _lib.RestoreInfo()
        cap = max(n, 1)
        blocks = (_lib.BlockInfo * cap)()
        check(L.kvd_restore_prefix(self._c(), request, arr, n, info, blocks, cap))
        return Restore(
            info.epoch,
            info.tokens,
            info.committed_tokens,
            _blocks(blocks, info.block_count),
        )
