"""kvd: Python bindings of libkvd, the C ABI of the kvd KV-cache block daemon.

    import kvd
    with kvd.Client("kvd-data/kvd.sock", name="engine-0") as c:
        ns = c.register_namespace(kvd.Namespace("org/model", "rev", 65536, 16, 2, 2, 64))
        k = kvd.key(ns, b"\\x01" * 32)
        c.put([k], [b"\\x07" * 65536])                 # alloc, copy with CRC, seal, publish
        b = c.acquire([k])[0]                           # pinned
        with c.view(b.handle) as v:                     # zero-copy, read-only memoryview
            first = bytes(v.data[:16])
            v.still_valid()                             # raises StaleGeneration if the page moved
        c.release([b.handle])

Adapters: ``kvd.sglang`` (a HiCache L3 storage backend) and ``kvd.vllm`` (a KV connector).
"""

from ._lib import ABI_VERSION
from .client import (
    ANY_NODE,
    Allocation,
    Block,
    BlockView,
    Client,
    Event,
    EventBatch,
    Manifest,
    Namespace,
    Restore,
    Transfer,
    block_tags,
    key,
    version,
)
from .errors import (
    AlreadyExists,
    Corrupt,
    Deadline,
    Disconnected,
    Unsupported,
    IllegalTransition,
    InternalError,
    InvalidArgument,
    KvdError,
    KvdIOError,
    LeaseExpired,
    NoSpace,
    NotFound,
    Overloaded,
    ProtocolError,
    StaleEpoch,
    StaleGeneration,
    Unavailable,
    status_text,
)

__all__ = [
    "ABI_VERSION",
    "ANY_NODE",
    "AlreadyExists",
    "Allocation",
    "Block",
    "BlockView",
    "Client",
    "Corrupt",
    "Transfer",
    "Deadline",
    "Disconnected",
    "Unsupported",
    "Event",
    "EventBatch",
    "IllegalTransition",
    "InternalError",
    "InvalidArgument",
    "KvdError",
    "KvdIOError",
    "LeaseExpired",
    "Manifest",
    "Namespace",
    "NoSpace",
    "NotFound",
    "Overloaded",
    "ProtocolError",
    "Restore",
    "StaleEpoch",
    "StaleGeneration",
    "Unavailable",
    "block_tags",
    "key",
    "status_text",
    "version",
]
