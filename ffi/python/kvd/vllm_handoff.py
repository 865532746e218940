"""Prefill/decode hand-offs in vLLM's own P/D contract, for the vLLM connector (docs/ENGINES.md).

A prefill engine (``kv_role`` ``kv_producer`` or ``kv_both``) that gets a request whose
``kv_transfer_params`` carry ``do_remote_decode: true`` saves its prompt blocks into its
node's kvd as always (content-addressed by vLLM's block hashes). When the request finishes
normally, ``request_finished`` asks its daemon to hold the run of saved full blocks for
``handoff_ttl_ms`` (a hold owned by the daemon and bound to (request, epoch): it outlives this
engine), gives vLLM its engine blocks back at once, and returns parameters shaped like vLLM's
``NixlConnector``'s (``do_remote_prefill: true``, ``remote_*``) plus ``{"kvd": {"handoff":
{"node", "namespace", "blocks", "request", "epoch", "keep"}}}``. The request and epoch are the
front's when its prefill body names them (``kv_transfer_params.kvd.request``/``epoch``; the
front then ends the hold itself, ``keep``), else derived from the engine and request id at
epoch 1 (the decode's node ends the hold once it has the whole run).

A decode engine (``kv_consumer`` or ``kv_both``) that gets those parameters back (a proxy
passes them on unchanged) answers vLLM's lookup with an asynchronous load of the run, block
aligned and short of the last prompt token; after allocation the scheduler starts the daemon's
``fetch_held(node, request, epoch, keys)`` of the blocks past the local hit (the source serves
it only while its hold of exactly that request and epoch lives, only for keys inside the run),
and the worker polls the transfer,
then copies the blocks in as any hit. A failed transfer, or one past ``handoff_timeout_ms``, is
reported as a failed receive with every block id in the load errors, so vLLM's
``kv_load_failure_policy`` decides (``recompute`` gives the same tokens). The keys are vLLM's
block hashes of the decode's *own* prompt, so parameters naming another run, node or
namespace can only be a miss, never another request's KV.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import socket
import time
from dataclasses import dataclass
from typing import Any, Optional

from .client import Client, key
from .errors import KvdError

log = logging.getLogger("kvd.vllm")
NORMAL_FINISH = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


@dataclass(frozen=True)
class Handoff:
    """The ``kvd.handoff`` parameters: the node holding the run, its namespace, its length in
    blocks, the request it was held for and the epoch; ``keep``: the front ends the hold (else
    the decode's node ends it once it has the run)."""

    node: int
    namespace: bytes
    blocks: int
    request: int
    epoch: int
    keep: bool = False

    @staticmethod
    def parse(kv: Any) -> Optional["Handoff"]:
        """The hand-off of a consumer's ``kv_transfer_params``: ``None`` if it carries none or
        does not ask for a remote prefill; malformed parameters are logged and ``None``."""
        if not isinstance(kv, dict) or not kv.get("do_remote_prefill"):
            return None
        k = kv.get("kvd")
        v = k.get("handoff") if isinstance(k, dict) else None
        try:
            h = Handoff(int(v["node"]), bytes.fromhex(v["namespace"]), int(v["blocks"]),
                        int(v["request"]), int(v["epoch"]), bool(v.get("keep", False)))
        except (KeyError, TypeError, ValueError):
            log.warning("kvd: malformed hand-off parameters %r: a miss", v)
            return None
        if h.node <= 0 or h.blocks < 0 or h.epoch <= 0 or h.request <= 0 or len(h.namespace) != 32:
            log.warning("kvd: invalid hand-off parameters %r: a miss", v)
            return None
        return h


def handoff_request_id(engine_id: str, rid: str) -> int:
    """A u64 naming the hand-off (odd, so never 0)."""
    return int.from_bytes(hashlib.sha256(f"{engine_id}/{rid}".encode()).digest()[:8], "little") | 1


@dataclass
class HandoffLoad:
    """Scheduler -> worker: the blocks of one request a hand-off brings in. ``transfer`` is
    the daemon's transfer id, ``None`` when the blocks are here already (the run's node is
    this one) and ``-1`` when the fetch could not start (a failed receive)."""

    req_id: str
    transfer: Optional[int]
    block_ids: list[int]
    tags: list[bytes]
    deadline: float  # wall-clock seconds: the worker is another process
    end: int = 0  # the run's end, in blocks of the request


class Handoffs:
    """Scheduler side: the producer's holds and the consumer's fetches, with their bound."""

    def __init__(self, client: Client, namespace: bytes, block_size: int, extra: dict[str, Any],
                 role: str, engine_id: str) -> None:
        self.client, self.namespace, self.block_size = client, namespace, block_size
        self.node_id = int(extra.get("node_id", 0))
        self.ttl_ms = int(extra.get("handoff_ttl_ms", 30_000))
        self.timeout_s = int(extra.get("handoff_timeout_ms", 30_000)) / 1000
        self.max_pending = int(extra.get("max_pending_handoffs", 64))
        self.producer = role in ("kv_producer", "kv_both")
        self.consumer = role in ("kv_consumer", "kv_both")
        self.engine_id = engine_id
        self.pending: set[str] = set()  # requests whose hand-off load is not reported yet
        self._warned: collections.OrderedDict = collections.OrderedDict()  # a miss is logged once
        self.figures: collections.Counter = collections.Counter()
        if (self.producer or self.consumer) and self.node_id <= 0:
            log.warning("kvd: kv_role %s without a node_id setting: hand-offs are off", role)
            self.producer = self.consumer = False

    # -- consumer ------------------------------------------------------------------------------

    def _usable(self, request: Any) -> Optional[Handoff]:
        if not self.consumer:
            return None
        h = Handoff.parse(getattr(request, "kv_transfer_params", None))
        if h is None:
            return None
        if h.namespace != self.namespace:
            if request.request_id in self._warned:
                return None
            self._warned[request.request_id] = None
            if len(self._warned) > 1024:
                self._warned.popitem(last=False)
            log.warning("kvd: hand-off of %s names namespace %s, this engine's is %s (model, dtype, "
                        "block size or salt differ): a miss", request.request_id, h.namespace.hex(),
                        self.namespace.hex())
            return None
        return h

    def _want(self, request: Any, h: Handoff) -> int:
        """Blocks of the run to load: never the block holding the last prompt token."""
        return max(0, min(h.blocks, (request.num_tokens - 1) // self.block_size, len(request.block_hashes)))

    def matched(self, request: Any, num_computed_tokens: int) -> Optional[int]:
        """Tokens an asynchronous hand-off load brings (side-effect free but for counting a
        refusal); ``None``: no hand-off here, look up the cache as usual."""
        h = self._usable(request)
        if h is None:
            return None
        n = self._want(request, h) * self.block_size - num_computed_tokens
        if n <= 0:
            return None
        if request.request_id not in self.pending and len(self.pending) >= self.max_pending:
            self.figures["handoff_over_bound"] += 1
            log.warning("kvd: %d hand-offs pending (max_pending_handoffs): %s recomputes its prompt",
                        len(self.pending), request.request_id)
            return None
        return n

    def start(self, request: Any, block_ids: list[int], num_external_tokens: int,
              tags: list[bytes]) -> Optional[HandoffLoad]:
        """After allocation: start the fetch of the run's blocks past the local hit."""
        h = self._usable(request)
        if h is None or num_external_tokens <= 0:
            return None
        rid = request.request_id
        want = self._want(request, h)
        first = want - num_external_tokens // self.block_size
        keys = [key(self.namespace, t) for t in tags[first:want]]
        transfer: Optional[int] = None
        if h.node != self.node_id:
            try:
                transfer = self.client.fetch_held(h.node, h.request, h.epoch, keys,
                                                  end_hold=not h.keep)
                self.figures["handoff_fetches"] += 1
            except KvdError as e:
                log.warning("kvd: hand-off fetch of %s from node %d not started (%s): a failed load",
                            rid, h.node, e)
                transfer = -1
        request.kv_transfer_params["do_remote_prefill"] = False  # one transfer per request
        self.pending.add(rid)
        return HandoffLoad(rid, transfer, list(block_ids[first:want]), list(tags[first:want]),
                           time.time() + self.timeout_s, want)

    def done(self, rid: str) -> None:
        self.pending.discard(rid)

    # -- producer ------------------------------------------------------------------------------

    def hold(self, request: Any, block_ids: list[int], tags: list[bytes],
             tp_size: int, pp_size: int) -> Optional[dict[str, Any]]:
        """A finished prefill asked to hand off: have the daemon hold its saved run for
        ``handoff_ttl_ms`` and return the decode's parameters (``None``: not a hand-off, or not
        a normal finish)."""
        kv = getattr(request, "kv_transfer_params", None)
        if not self.producer or not isinstance(kv, dict) or not kv.get("do_remote_decode"):
            return None
        status = getattr(getattr(request, "status", None), "name", "")
        if status not in NORMAL_FINISH:
            return None
        n = min(request.num_computed_tokens // self.block_size, len(tags))
        rid, epoch, keep = self._binding(kv, request.request_id)
        held = 0
        if n > 0:
            try:
                held, _ = self.client.hold(rid, epoch, [key(self.namespace, t) for t in tags[:n]],
                                           self.ttl_ms)
            except KvdError as e:
                log.warning("kvd: hand-off hold of %s failed (%s): decode recomputes",
                            request.request_id, e)
        self.figures["handoff_held_blocks"] += held
        return {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": self.engine_id, "remote_request_id": request.request_id,
            "remote_block_ids": list(block_ids[:held]), "remote_host": socket.gethostname(),
            "remote_port": None, "remote_num_tokens": held * self.block_size,
            "tp_size": tp_size, "pp_size": pp_size, "transfer_mode": "kvd",
            "kvd": {"handoff": {"node": self.node_id, "namespace": self.namespace.hex(), "blocks": held,
                                "request": rid, "epoch": epoch, "keep": keep}},
        }

    def _binding(self, kv: dict[str, Any], rid: str) -> tuple[int, int, bool]:
        """The (request, epoch) a hold is bound to and whether the front ends it: the front's
        when its prefill body names them, else derived from this engine and request."""
        k = kv.get("kvd")
        try:
            r, e = int(k["request"]), int(k["epoch"])  # type: ignore[index]
            if r > 0 and e > 0:
                return r, e, True
        except (KeyError, TypeError, ValueError):
            pass
        return handoff_request_id(self.engine_id, rid), 1, False


class Receiver:
    """Worker side: hand-off loads waiting for their transfers."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.waiting: dict[str, HandoffLoad] = {}

    def add(self, loads: list[HandoffLoad]) -> None:
        for load in loads:
            self.waiting[load.req_id] = load

    def take_all(self) -> list[HandoffLoad]:
        """Every waiting load, forgotten (vLLM keeps an aborted request's blocks until its
        receive is reported, so a lost daemon must end them all)."""
        taken, self.waiting = list(self.waiting.values()), {}
        if taken:
            log.warning("kvd: daemon unreachable: %d hand-off loads fail", len(taken))
        return taken

    def poll(self) -> tuple[list[tuple[HandoffLoad, Any]], list[HandoffLoad]]:
        """(loads whose blocks are here now, with their transfer or ``None``; loads that
        failed: a transfer that failed, was lost or passed its deadline)."""
        if not self.waiting:
            return [], []
        ids = [w.transfer for w in self.waiting.values() if w.transfer is not None and w.transfer >= 0]
        states = {t.id: t for t in self.client.transfers(ids)} if ids else {}
        ready, failed, now = [], [], time.time()
        for rid, w in list(self.waiting.items()):
            t = states.get(w.transfer) if w.transfer is not None else None
            if w.transfer is None or (t is not None and t.state == "done"):
                ready.append((w, t))
            elif t is not None and t.state == "in_flight" and now < w.deadline:
                continue
            else:
                why = "not started" if w.transfer == -1 else (
                    "lost" if t is None else (t.error if t.state == "failed" else "past handoff_timeout_ms"))
                log.warning("kvd: hand-off load of %s failed (%s): its blocks are load errors", rid, why)
                failed.append(w)
            del self.waiting[rid]
        return ready, failed
