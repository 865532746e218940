"""Checkpoints and restores of running requests, for the vLLM connector (docs/ENGINES.md).

A request that arrives with ``kv_transfer_params = {"kvd": {"checkpoint": {"holder": NODE,
"request": ID, "epoch": E}}}`` has each of its blocks, as a step completes it, streamed to the
checkpoint holder ``NODE`` (``push_checkpoint``): the holder's manifest of request ``ID`` grows
with the committed tokens, atomically per step, and an older epoch is refused there. Decode
never waits for it: the worker publishes the block locally and starts the push (one local call);
at most ``max_checkpoint_transfers`` pushes are in flight per worker, a step past that bound
waits for the next step's push (counted, ``checkpoint_deferred``; so the holder's manifest has no
gap), a request whose waiting blocks pass a bound loses its checkpoint (``checkpoint_dropped``),
and a push that fails costs only the checkpoint (``checkpoint_failed``).

A request resubmitted with ``{"kvd": {"restore": {"holder": NODE, "request": ID, "epoch": E}}}``
(its prompt being the original prompt and the tokens committed before the failure) gets its
prefix from the holder (``"local": true`` says the survivor is the holder itself: the blocks
are looked up here, nothing is fetched): the scheduler asks the local daemon for the recovery read
(``fetch_prefix``: the holder serves the longest verified prefix its manifest holds, which lands
here as published blocks), answers "ask again" until the read ends (at most
``restore_timeout_ms``), then looks the prefix up and loads it like any hit, so vLLM computes
only what the checkpoint lacks. A holder that is gone, holds less or does not answer in time
leaves a shorter hit or none: the rest is recomputed, with the same output.

Checkpoint blocks are keyed by kvd's own token chain (``block_tags``: the namespace, then each
block's tokens chained), which is what a holder rebuilds from the tokens at restore; cache blocks
stay keyed by vLLM's block hashes. So a checkpointed block is written twice on its worker (a
cache block and a checkpoint block). Both features need one shard (TP and PP size 1); with more
the parameters are ignored, and the start-up log says so.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from .client import Client, block_tags, key
from .errors import KvdError

log = logging.getLogger("kvd.vllm")
MAX_BACKLOG_BLOCKS = 4096  # blocks of one request waiting for room to be pushed


@dataclass(frozen=True)
class Binding:
    """Whose checkpoint: the holder node, the request id, its epoch."""

    holder: int
    request: int
    epoch: int
    local: bool = False  # a restore onto the holder itself

    @staticmethod
    def parse(v: Any) -> Optional["Binding"]:
        if not isinstance(v, dict):
            return None
        try:
            b = Binding(int(v["holder"]), int(v["request"]), int(v["epoch"]), bool(v.get("local", False)))
        except (KeyError, TypeError, ValueError):
            log.warning("kvd: ignoring malformed checkpoint parameters %r", v)
            return None
        return b if b.holder > 0 and b.request > 0 and b.epoch > 0 else None


def params(request: Any) -> tuple[Optional[Binding], Optional[Binding]]:
    """(checkpoint, restore) bindings a request carries in its ``kv_transfer_params``."""
    kv = getattr(request, "kv_transfer_params", None) or {}
    k = kv.get("kvd") if isinstance(kv, dict) else None
    if not isinstance(k, dict):
        return None, None
    return Binding.parse(k.get("checkpoint")), Binding.parse(k.get("restore"))


@dataclass
class CheckpointStep:
    """One step's completed blocks of a checkpointed request, as the worker streams them."""

    binding: Binding
    tags: list[bytes]  # kvd token-chain tags of the blocks in this step
    committed_tokens: int  # the prefix these blocks end


@dataclass
class _Restore:
    transfer: Optional[int] = None
    deadline: float = 0.0
    tags: list[bytes] = field(default_factory=list)
    done: bool = False


class Restorer:
    """Scheduler side: the recovery read of each restoring request, then its tags."""

    def __init__(self, client: Client, namespace: bytes, block_size: int, timeout_ms: int) -> None:
        self.client, self.namespace, self.block_size = client, namespace, block_size
        self.timeout_s = timeout_ms / 1000
        self._by_req: dict[str, _Restore] = {}
        self.figures = collections.Counter()

    def tags(self, request: Any) -> Optional[list[bytes]]:
        """The token-chain tags to look up for a restoring request: ``None`` while its
        recovery read runs (ask again), else the tags (a shorter hit or none if it failed)."""
        rid = request.request_id
        st = self._by_req.get(rid)
        if st is None:
            _, restore = params(request)
            tokens = list(request.prompt_token_ids or [])
            st = self._by_req[rid] = _Restore(tags=block_tags(self.namespace, self.block_size, tokens))
            st.deadline = time.monotonic() + self.timeout_s
            local = len(self.client.lookup_prefix(self.namespace, st.tags))
            if restore is None or restore.local or local == len(st.tags):
                st.done = True  # all of it is here already (a restore onto the holder itself)
                self.figures["restores_local"] += 1
            else:
                try:
                    st.transfer = self.client.fetch_prefix(restore.holder, restore.request, tokens)
                    self.figures["restores_started"] += 1
                except KvdError as e:
                    log.warning("kvd: restore of request %d from node %d not started (%s): recomputing",
                                restore.request, restore.holder, e)
                    self.figures["restores_failed"] += 1
                    st.done = True
        if not st.done:
            t = self.client.transfers([st.transfer])[0] if st.transfer is not None else None
            if t is not None and t.state == "in_flight" and time.monotonic() < st.deadline:
                return None
            st.done = True
            if t is not None and t.state == "done":
                self.figures["restores_done"] += 1
                self.figures["restored_tokens"] += t.tokens
            else:
                self.figures["restores_failed"] += 1
                log.warning("kvd: restore of %s ended %s: the rest is recomputed", rid,
                            t.error if t is not None else "past its deadline")
        return st.tags

    def forget(self, rid: str) -> None:
        self._by_req.pop(rid, None)

    def __len__(self) -> int:
        return len(self._by_req)


class Streamer:
    """Worker side: start one checkpoint push per step and request, within a bound."""

    def __init__(self, client: Client, namespace: bytes, max_inflight: int, ttl_ms: int) -> None:
        self.client, self.namespace = client, namespace
        self.max_inflight, self.ttl_ms = max_inflight, ttl_ms
        self._inflight: collections.deque[int] = collections.deque()
        self._backlog: dict[Binding, list[bytes]] = {}  # keys published here, not pushed yet
        self._backlog_bytes: dict[Binding, int] = {}
        self.figures = collections.Counter()

    def keys(self, step: CheckpointStep) -> list[bytes]:
        return [key(self.namespace, t) for t in step.tags]

    def offer(self, step: CheckpointStep, nbytes: int) -> None:
        """Push this step's blocks (published here already), with any earlier ones of the same
        request that waited for room: one push, so the holder's manifest has no gap."""
        b = step.binding
        waiting = self._backlog.setdefault(b, [])
        waiting += self.keys(step)
        self._backlog_bytes[b] = self._backlog_bytes.get(b, 0) + nbytes
        if len(waiting) > MAX_BACKLOG_BLOCKS:  # the holder is too slow: this checkpoint is lost
            self.figures["checkpoint_dropped"] += len(waiting)
            self.forget(b)
            return
        if len(self._inflight) >= self.max_inflight:
            self._reap()
        if len(self._inflight) >= self.max_inflight:
            self.figures["checkpoint_deferred"] += 1
            return
        tid = self.client.push_checkpoint(b.holder, b.request, b.epoch, waiting,
                                          step.committed_tokens, self.ttl_ms)
        self._inflight.append(tid)
        self.figures["checkpoint_blocks"] += len(waiting)
        self.figures["checkpoint_bytes"] += self._backlog_bytes.get(b, 0)
        self.forget(b)

    def forget(self, b: Binding) -> None:
        self._backlog.pop(b, None)
        self._backlog_bytes.pop(b, None)

    def _reap(self) -> None:
        ids = list(self._inflight)
        states = {t.id: t for t in self.client.transfers(ids)}
        self._inflight = collections.deque(i for i in ids if i in states and states[i].state == "in_flight")
        for i in ids:
            t = states.get(i)
            if t is not None and t.state == "failed":
                self.figures["checkpoint_failed"] += 1
                log.debug("kvd: checkpoint push %d failed: %s", i, t.error)
