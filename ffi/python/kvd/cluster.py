"""Cluster-wide hits: a lookup's miss asked of the other nodes' daemons (docs/ENGINES.md).

``Client.fetch(ANY_NODE, keys)`` starts a cluster fetch: the daemon asks its live peers
(cluster membership, or the static peers) which of the keys they hold, and fetches the longest
run from the first key that they hold between them, each piece from its holder, which pins it
while it is read; every block is checked against its sealed CRC-32C on arrival and published
here before anyone can look it up. A holder that evicted blocks since the locate, died or sent
bad bytes gives a shorter run, never other bytes. Two ways to wait for it:

- ``ClusterLookups`` (the vLLM connector's scheduler, which must never wait): when the local
  lookup finds fewer of a request's blocks than vLLM could load, and at least
  ``cluster_min_blocks`` fewer, it starts the fetch of the rest and the scheduler answers vLLM
  "ask again" (the request waits; the others are scheduled), polling at most once a
  millisecond. When the fetch ends (or after ``cluster_timeout_ms``) the lookup runs again,
  locally, and finds what arrived. Each request is asked of the cluster once.
- ``fetch_and_wait`` (SGLang's hit query, which runs on the cache controller's prefetch thread
  and may wait on the network, as its other backends do): the fetch, waited for within a
  deadline.

Keys are the engine's own block or page hashes within the namespace, so two engines share blocks
when they serve the same weights, dtype and block size with the same hash function: vLLM's
default ``sha256`` is reproducible across processes; a non-cryptographic hash needs one
``PYTHONHASHSEED`` on every node.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

from .client import ANY_NODE, Client, Transfer, key
from .errors import KvdError, Overloaded, Unavailable

log = logging.getLogger("kvd.cluster")

POLL_EVERY_S = 0.001  # the scheduler polls its cluster fetches at most this often
MAX_REMEMBERED = 65_536  # requests remembered as asked (each is asked once); oldest forgotten
_COUNTED = -1  # a request whose lookup is counted (local, remote, missed) already


@dataclass
class _Fetch:
    transfer: int
    deadline: float  # monotonic


def no_cluster(e: KvdError) -> bool:
    """Whether ``e`` says the daemon has no data port (a single node): no cluster to ask."""
    return isinstance(e, Unavailable) and "no data port" in str(e)


def fetch_and_wait(client: Client, keys: list[bytes], timeout_s: float) -> Optional[Transfer]:
    """A cluster fetch of ``keys``, waited for up to ``timeout_s`` (polled every ms): the ended
    transfer, or ``None`` if it was still under way at the deadline (its blocks may land
    later). Raises what starting it raises."""
    tid = client.fetch(ANY_NODE, keys)
    deadline = time.monotonic() + timeout_s
    while True:  # bounded by the deadline
        t = client.transfers([tid])
        if not t or t[0].state != "in_flight":
            return t[0] if t else None
        if time.monotonic() >= deadline:
            return None
        time.sleep(POLL_EVERY_S)


class ClusterLookups:
    """Scheduler side: the cluster fetches of requests whose local hit fell short."""

    def __init__(self, client: Client, namespace: bytes, extra: dict[str, Any], enabled: bool) -> None:
        self.client, self.namespace = client, namespace
        self.enabled = enabled and bool(extra.get("cluster_lookup", True))
        self.min_blocks = max(1, int(extra.get("cluster_min_blocks", 1)))
        self.timeout_s = int(extra.get("cluster_timeout_ms", 2_000)) / 1000
        self.max_pending = int(extra.get("max_cluster_fetches", 16))
        self.pending: dict[str, _Fetch] = {}
        # rid -> blocks found here before its cluster fetch, or _COUNTED once its answer is counted
        self._asked: collections.OrderedDict = collections.OrderedDict()
        self._last_poll = 0.0
        self.figures: collections.Counter = collections.Counter()

    def waiting(self, rid: str) -> bool:
        """Whether ``rid``'s cluster fetch is still under way (polled at most once a ms)."""
        if rid not in self.pending:
            return False
        now = time.monotonic()
        if now - self._last_poll >= POLL_EVERY_S:
            self._last_poll = now
            self.poll()
        return rid in self.pending

    def poll(self) -> None:
        """End the fetches that are over (done, failed, lost or past their deadline)."""
        if not self.pending:
            return
        states = {t.id: t for t in self.client.transfers([f.transfer for f in self.pending.values()])}
        now = time.monotonic()
        for rid, f in list(self.pending.items()):
            t = states.get(f.transfer)
            if t is not None and t.state == "in_flight" and now < f.deadline:
                continue
            del self.pending[rid]
            if t is not None and t.state == "done":
                self.figures["cluster_fetched_blocks"] += t.blocks
                self.figures["cluster_fetched_bytes"] += t.bytes
                if t.blocks == 0:
                    self.figures["cluster_misses"] += 1
            elif t is not None and t.state == "failed":
                self.figures["cluster_errors"] += 1
                log.info("kvd: cluster fetch for %s failed (%s): a local hit only", rid, t.error)
            else:
                self.figures["cluster_timeouts"] += 1
                log.info("kvd: cluster fetch for %s %s: a local hit only", rid,
                         "lost" if t is None else "past cluster_timeout_ms")

    def start(self, rid: str, tags: list[bytes], found: int, want: int, hint: Optional[int] = None) -> bool:
        """Ask the cluster for blocks ``found``..``want`` of ``rid`` (``tags`` are its chain)
        when that is worth it and not asked before; ``True``: the lookup waits for it. ``hint``:
        the most of the request's leading blocks any node holds, as ``kvd control``'s router
        saw it (``kv_transfer_params.kvd.cluster_blocks``): nothing past it is asked for, so a
        prompt's new tail costs no locate."""
        if hint is not None and hint < want and self.enabled and rid not in self._asked:
            if want - found >= self.min_blocks and hint - found < self.min_blocks:
                self.figures["cluster_skipped_by_hint"] += 1
            want = hint
        if not self.enabled or rid in self._asked or want - found < self.min_blocks:
            return False
        self._remember(rid, found)
        if len(self.pending) >= self.max_pending:
            self.figures["cluster_over_bound"] += 1
            return False
        try:
            transfer = self.client.fetch(ANY_NODE, [key(self.namespace, t) for t in tags[found:want]])
        except Overloaded:
            self.figures["cluster_over_bound"] += 1
            return False
        except KvdError as e:
            # a daemon without a data port (a single node) has no cluster: stop asking
            if no_cluster(e):
                log.info("kvd: no cluster fetches from this daemon (%s): lookups stay local", e)
                self.enabled = False
            else:
                log.warning("kvd: cluster fetch for %s not started (%s): a local hit only", rid, e)
                self.figures["cluster_errors"] += 1
            return False
        self.figures["cluster_fetches"] += 1
        self.pending[rid] = _Fetch(transfer, time.monotonic() + self.timeout_s)
        return True

    def _remember(self, rid: str, state: int) -> None:
        self._asked[rid] = state
        if len(self._asked) > MAX_REMEMBERED:
            self._asked.popitem(last=False)

    def account(self, rid: str, found: int, want: int) -> None:
        """Count a lookup's answer once per request: blocks found here before any cluster
        fetch (local), added by it (remote), and short of what vLLM could load (missed)."""
        before = self._asked.get(rid)
        if before == _COUNTED:
            return
        local = found if before is None else min(before, found)
        self.figures["lookup_local_blocks"] += local
        self.figures["lookup_remote_blocks"] += found - local
        self.figures["lookup_missed_blocks"] += max(0, want - found)
        self._remember(rid, _COUNTED)

    def forget(self, rid: str) -> None:
        """The request finished or was aborted (its fetch, if any, ends in the daemon)."""
        self.pending.pop(rid, None)
        self._asked.pop(rid, None)
