"""Test-only subclasses of the vLLM connector that change the daemon's state between the
scheduler's lookup and the worker's load, as another client of the daemon would: loaded into
the real engine through vLLM's own ``kv_connector_module_path``."""

from __future__ import annotations

import os

from kvd import Client, KvdError, Namespace, key
from kvd.vllm import KvdConnector


class RacingConnector(KvdConnector):
    """``kv_connector_extra_config.test_race``: ``"remove"`` deletes the second block of the
    first load (compare-and-delete by its current handle); ``"flood"`` writes unrelated
    blocks until the pool has turned over, so everything unpinned is evicted."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.race = self.extra.get("test_race")
        self.raced = False

    def update_state_after_alloc(self, request, blocks, num_external_tokens) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if self.raced or not self._loads or not self.race:
            return
        self.raced = True
        other = Client(self.socket, name="race")
        try:
            if self.race == "remove":
                k = key(self.namespace, self._loads[-1].tags[1])
                b = other.acquire([k])[0]
                other.release([b.handle])
                assert other.remove_if([(k, b.handle)]) == [None]
            elif self.race == "flood":
                info = other.pool_info()
                ns = other.register_namespace(
                    Namespace("flood", "x", info.page_size_bytes, 1, 1, 1, 1)
                )
                page = os.urandom(info.page_size_bytes)
                batch = 32
                for start in range(0, 2 * info.page_count, batch):  # twice the pool: a full turn
                    keys = [key(ns, i.to_bytes(32, "little")) for i in range(start, start + batch)]
                    other.put(keys, [page] * len(keys))  # evicts the least recently used
        finally:
            other.close()


class LosingConnector(KvdConnector):
    """``kv_connector_extra_config.test_lose_answers``: N. The answers to the first N lookups are
    taken from libkvd's queue and dropped (their pins handed back), as an answer lost between the
    daemon and the scheduler would be: the scheduler must ask again, then take a miss, never
    leave the request waiting."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.to_lose = int(self.extra.get("test_lose_answers", 0))
        self.lost = 0
        poll = self.client.poll

        def losing(timeout_ms: int = 0, max_completions: int = 64):
            kept = []
            for ticket, result in poll(timeout_ms, max_completions):
                if self.lost < self.to_lose and ticket in self._ticket_req:
                    self.lost += 1
                    if not isinstance(result, KvdError):
                        self.client.release([b.handle for b in result])
                    continue
                kept.append((ticket, result))
            return kept

        self.client.poll = losing
