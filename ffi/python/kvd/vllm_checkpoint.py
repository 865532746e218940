"""Checkpoints and restores of running requests, for the vLLM connector (docs/ENGINES.md).

A request that arrives with ``kv_transfer_params = {"kvd": {"checkpoint": {"holder": NODE,
"request": ID, "epoch": E}}}`` has each of its blocks, as a step completes it, streamed to the
checkpoint holder ``NODE`` (``push_checkpoint``): the holder's manifest of request ``ID`` grows
with the committed tokens, atomically per step, and an older epoch is refused there. Decode
never waits for it: the worker publishes the block locally and starts the push (one local call);
at most ``max_checkpoint_transfers`` pushes are in flight per worker, a step past that bound
waits for the next step's push (counted, ``checkpoint_deferred``; so the holder's manifest has no
gap). The holder takes a push only where it continues its manifest, so a push that fails
(``checkpoint_failed``: the holder was out of room, its lease lapsed, the push arrived before an
earlier one) goes out again, with every push of the request after it, as one push once none of
them is under way. The worker asks after its pushes at most once a step and a second
(``SETTLE_POLL_S``; every ``POLL_INTERVAL_S`` while a failed one waits), one local call. A
request loses its checkpoint (``checkpoint_dropped``; the holder keeps the prefix it has) when
its pushes fail ``MAX_PUSH_FAILURES`` times in a row, when a newer attempt of it holds the
manifest (``StaleEpoch``), when its waiting blocks pass a bound, or when a block of it could not
be stored on the worker.

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
cache block and a checkpoint block), in one alloc, one seal and one publish for both. Both features need one shard (TP and PP size 1); with more
the parameters are ignored, and the start-up log says so.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from .client import Client, block_tags, key
from .errors import KvdError, StaleEpoch

log = logging.getLogger("kvd.vllm")
MAX_BACKLOG_BLOCKS = 4096  # blocks of one request waiting for room to be pushed
MAX_PUSH_FAILURES = 4  # failures of a request's pushes in a row before its checkpoint is given up
RETRY_AFTER_S = 0.25  # times the failures in a row: when a failed push may go out again
POLL_INTERVAL_S = 0.05  # how often a worker asks after its pushes while a failed one waits
SETTLE_POLL_S = 1.0  # how often it asks after pushes under way otherwise
MAX_LOST_REMEMBERED = 4096  # given-up checkpoints remembered, so their later steps are ignored


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


@dataclass
class _Push:
    seq: int  # its place among the request's pushes
    id: int
    keys: list[bytes]
    nbytes: int


@dataclass
class _Chain:
    """One request's checkpoint on its way to its holder. Pushes go out as steps complete blocks,
    several under way at once; the holder's manifest takes each only where it continues it (one
    that arrives before an earlier one, or after one that failed, is refused there). The failed
    ones go out again, in order and with what waits behind them, as one push once no earlier one
    is under way."""

    waiting: list[bytes] = field(default_factory=list)  # published here, not pushed, in order
    waiting_bytes: int = 0
    committed: int = 0  # the committed tokens the last waiting block ends
    under_way: list[_Push] = field(default_factory=list)
    failed: list[_Push] = field(default_factory=list)  # to go out again, before ``waiting``
    pushes: int = 0
    failures: int = 0  # in a row
    retry_at: float = 0.0

    def ready(self, now: float) -> bool:
        if self.failed:
            return not self.under_way and now >= self.retry_at
        return bool(self.waiting)

    def blocks_left(self) -> int:
        return len(self.waiting) + sum(len(p.keys) for p in self.failed)


class Streamer:
    """Worker side: each checkpointed request's blocks, pushed to its holder in order, within a
    bound of pushes under way per worker."""

    def __init__(self, client: Client, namespace: bytes, max_inflight: int, ttl_ms: int) -> None:
        self.client, self.namespace = client, namespace
        self.max_inflight, self.ttl_ms = max(1, max_inflight), ttl_ms
        self._chains: dict[Binding, _Chain] = {}
        self._lost: collections.OrderedDict[Binding, None] = collections.OrderedDict()
        self._polled = 0.0
        self.figures = collections.Counter()

    def keys(self, step: CheckpointStep) -> list[bytes]:
        return [key(self.namespace, t) for t in step.tags]

    def offer(self, step: CheckpointStep, nbytes: int) -> None:
        """Push this step's blocks (published here already), with any earlier ones of the same
        request still waiting: one push, so the holder's manifest has no gap."""
        b = step.binding
        if b in self._lost:  # behind a gap the holder can never fill: of no use
            return
        c = self._chains.setdefault(b, _Chain())
        c.waiting += self.keys(step)
        c.waiting_bytes += nbytes
        c.committed = step.committed_tokens
        if c.blocks_left() > MAX_BACKLOG_BLOCKS:  # the holder is too slow: this checkpoint is lost
            self.lose(b)
            return
        self.pump()

    def lose(self, b: Binding) -> None:
        """Give up ``b``'s checkpoint (a block of it could not be stored here, or pushed): the
        holder keeps the prefix it has, and a restore recomputes the rest."""
        c = self._chains.pop(b, None)
        self.figures["checkpoint_dropped"] += 1 + (c.blocks_left() if c else 0)
        self._lost[b] = None
        while len(self._lost) > MAX_LOST_REMEMBERED:
            self._lost.popitem(last=False)

    def pump(self) -> None:
        """Start the pushes that may go. Once per step: also learn how the pushes under way
        went (a local call), at most every ``POLL_INTERVAL_S`` while a failed push waits to go
        out again, else every ``SETTLE_POLL_S`` (a request's last pushes, which no later block
        asks after)."""
        now = time.monotonic()
        since = now - self._polled
        if since >= POLL_INTERVAL_S and any(c.failed for c in self._chains.values()) or \
                since >= SETTLE_POLL_S and self._under_way():
            self._reap(now)
        for b, c in list(self._chains.items()):
            if self._chains.get(b) is not c or not c.ready(now):
                continue
            if self._under_way() >= self.max_inflight:
                self._reap(now)
                if self._under_way() >= self.max_inflight:
                    self.figures["checkpoint_deferred"] += 1
                    return
            self._send(b, c, now)

    def _under_way(self) -> int:
        return sum(len(c.under_way) for c in self._chains.values())

    def _send(self, b: Binding, c: _Chain, now: float) -> None:
        c.failed.sort(key=lambda p: p.seq)
        keys = [k for p in c.failed for k in p.keys] + c.waiting
        nbytes = sum(p.nbytes for p in c.failed) + c.waiting_bytes
        c.pushes += 1
        try:
            tid = self.client.push_checkpoint(b.holder, b.request, b.epoch, keys, c.committed, self.ttl_ms)
        except KvdError as e:  # refused here (overload, a lapsed lease): tried again later
            c.failed, c.waiting, c.waiting_bytes = [_Push(c.pushes, 0, keys, nbytes)], [], 0
            self._failed(b, c, now, e)
            return
        c.under_way.append(_Push(c.pushes, tid, keys, nbytes))
        self.figures["checkpoint_blocks"] += len(keys)
        self.figures["checkpoint_bytes"] += nbytes
        c.failed, c.waiting, c.waiting_bytes = [], [], 0

    def _failed(self, b: Binding, c: _Chain, now: float, error: Any) -> None:
        self.figures["checkpoint_failed"] += 1
        c.failures += 1
        log.debug("kvd: a checkpoint push of request %d to node %d failed (%d in a row): %s",
                  b.request, b.holder, c.failures, error)
        if c.failures >= MAX_PUSH_FAILURES:
            self.lose(b)
        else:
            c.retry_at = now + RETRY_AFTER_S * c.failures

    def _reap(self, now: float) -> None:
        self._polled = now
        ids = [p.id for c in self._chains.values() for p in c.under_way]
        if not ids:
            return
        states = {t.id: t for t in self.client.transfers(ids)}
        for b, c in list(self._chains.items()):
            error: Any = None
            failing = bool(c.failed)  # pushes behind a failed one fail with it: one failure
            for p in list(c.under_way):
                t = states.get(p.id)
                if t is not None and t.state == "in_flight":
                    continue
                c.under_way.remove(p)
                if t is not None and t.state == "done":
                    continue
                # failed (nothing of it published at the holder) or forgotten by the daemon
                c.failed.append(p)
                error = error or (t.error if t is not None else "the daemon no longer knows it")
            if isinstance(error, StaleEpoch):  # a newer attempt of the request holds it now
                self.lose(b)
            elif error is not None and not failing:
                self._failed(b, c, now, error)
            elif not (c.failed or c.under_way or c.waiting):
                del self._chains[b]
            elif not c.failed:
                c.failures = 0

    def __len__(self) -> int:
        return len(self._chains)
