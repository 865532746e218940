"""The vLLM worker's checkpoint streamer (kvd.vllm_checkpoint.Streamer) between two real
daemons: node 1 is the worker's, node 2 the holder. A push the holder refuses goes out again in
order with what follows it, so the holder's manifest keeps growing without a gap; one that keeps
failing gives the checkpoint up, and the holder keeps the prefix it has."""

from __future__ import annotations

import time

import pytest

import kvd
from conftest import wait_until
from kvd import vllm_checkpoint
from kvd.vllm_checkpoint import Binding, CheckpointStep, Streamer
from test_client import LAYOUT

BLOCK = 16  # tokens per block (LAYOUT's)
PAGE = 65536
HOLDER_PAGES = 64  # the fixture's 16 MiB pool of 256 KiB pages


def steps(c: kvd.Client, ns: bytes, binding: Binding, tokens: list[int], per_step: int) -> list[CheckpointStep]:
    """The blocks of ``tokens``, stored on node 1 as a worker stores them, in steps of
    ``per_step`` blocks."""
    tags = kvd.block_tags(ns, BLOCK, tokens)
    ks = [kvd.key(ns, t) for t in tags]
    assert c.put(ks, [bytes([i % 251]) * PAGE for i in range(len(ks))]) == [None] * len(ks)
    return [CheckpointStep(binding, tags[i:i + per_step], (i + len(tags[i:i + per_step])) * BLOCK)
            for i in range(0, len(tags), per_step)]


def manifest(c: kvd.Client, request: int):
    try:
        return c.manifest(request)
    except kvd.NotFound:
        return None


def fill(c: kvd.Client, ns: bytes) -> list:
    """Take every free page of node 2's pool with blocks being written (never evicted)."""
    held = []
    for i in range(HOLDER_PAGES + 1):
        try:
            a = c.alloc([kvd.key(ns, bytes([7]) * 4 + i.to_bytes(4, "little") + bytes(24))])[0]
        except kvd.NoSpace:
            return held
        if not isinstance(a, kvd.Allocation):
            return held
        held.append(a.handle)
    pytest.fail("the holder's pool did not fill")


def ended(c: kvd.Client, s: Streamer) -> None:
    """Wait until every push the streamer started has ended (it learns how when it next asks)."""
    ids = [p.id for ch in s._chains.values() for p in ch.under_way]
    wait_until("the pushes end", lambda: all(t.state != "in_flight" for t in c.transfers(ids)))


def pump_until(s: Streamer, what: str, cond, timeout_s: float = 20) -> None:
    def pumped() -> bool:
        s.pump()
        return cond()
    wait_until(what, pumped, timeout_s)


def test_a_push_the_holder_refuses_goes_out_again_with_what_follows_and_the_manifest_has_no_gap(two_nodes):
    a, b = two_nodes
    with kvd.Client(a.socket, name="worker") as ca, kvd.Client(b.socket, name="holder") as cb:
        ns = ca.register_namespace(LAYOUT)
        cb.register_namespace(LAYOUT)
        binding = Binding(2, 77, 1)
        tokens = list(range(6 * BLOCK))
        s1, s2, s3 = steps(ca, ns, binding, tokens, 2)
        streamer = Streamer(ca, ns, 16, 60_000)

        streamer.offer(s1, 2 * PAGE)
        pump_until(streamer, "the first step is in the holder's manifest",
                   lambda: (m := manifest(cb, 77)) is not None and m.committed_tokens == 2 * BLOCK)

        held = fill(cb, ns)  # the holder has no room: the next push fails there
        streamer.offer(s2, 2 * PAGE)
        ended(ca, streamer)
        assert manifest(cb, 77).committed_tokens == 2 * BLOCK, "a refused push changes nothing"
        pump_until(streamer, "the worker learns of it", lambda: streamer.figures["checkpoint_failed"] == 1)

        cb.abort(held)  # room again: the refused blocks go out again, before the next step's
        streamer.offer(s3, 2 * PAGE)
        pump_until(streamer, "the holder's manifest has every step",
                   lambda: manifest(cb, 77).committed_tokens == 6 * BLOCK)
        m = manifest(cb, 77)
        assert m.tags == kvd.block_tags(ns, BLOCK, tokens), "every block once, in order"
        assert m.epoch == 1
        r = cb.restore_prefix(77, tokens)
        assert (r.tokens, len(r.blocks)) == (6 * BLOCK, 6), "the whole chain verifies"
        assert streamer.figures["checkpoint_dropped"] == 0
        pump_until(streamer, "nothing is left under way", lambda: len(streamer) == 0)


def test_a_push_that_keeps_failing_gives_the_checkpoint_up_and_the_holder_keeps_its_prefix(two_nodes, monkeypatch):
    monkeypatch.setattr(vllm_checkpoint, "RETRY_AFTER_S", 0.05)
    a, b = two_nodes
    with kvd.Client(a.socket, name="worker") as ca, kvd.Client(b.socket, name="holder") as cb:
        ns = ca.register_namespace(LAYOUT)
        cb.register_namespace(LAYOUT)
        binding = Binding(2, 78, 3)
        tokens = list(range(100, 100 + 4 * BLOCK))
        s1, s2, s3, s4 = steps(ca, ns, binding, tokens, 1)
        streamer = Streamer(ca, ns, 16, 60_000)
        streamer.offer(s1, PAGE)
        pump_until(streamer, "the first block is held",
                   lambda: (m := manifest(cb, 78)) is not None and m.committed_tokens == BLOCK)

        held = fill(cb, ns)
        streamer.offer(s2, PAGE)
        ended(ca, streamer)
        pump_until(streamer, "the checkpoint is given up",
                   lambda: streamer.figures["checkpoint_dropped"] > 0, timeout_s=30)
        assert streamer.figures["checkpoint_failed"] == vllm_checkpoint.MAX_PUSH_FAILURES
        assert len(streamer) == 0, "nothing of it is kept"
        cb.abort(held)
        started = streamer.figures["checkpoint_blocks"]
        streamer.offer(s3, PAGE)  # steps after the gap go nowhere
        streamer.offer(s4, PAGE)
        time.sleep(0.2)
        streamer.pump()
        assert streamer.figures["checkpoint_blocks"] == started and len(streamer) == 0
        m = manifest(cb, 78)
        assert (m.committed_tokens, m.epoch, len(m.tags)) == (BLOCK, 3, 1), "the holder keeps its prefix"


def test_pushes_past_the_bound_wait_and_go_out_together(two_nodes):
    a, b = two_nodes
    with kvd.Client(a.socket, name="worker") as ca, kvd.Client(b.socket, name="holder") as cb:
        ns = ca.register_namespace(LAYOUT)
        cb.register_namespace(LAYOUT)
        tokens = list(range(200, 200 + 3 * BLOCK))
        chains = {r: steps(ca, ns, Binding(2, r, 1), [t + r for t in tokens], 1) for r in (81, 82, 83)}
        streamer = Streamer(ca, ns, 1, 60_000)  # one push under way per worker
        for i in range(3):
            for r in chains:
                streamer.offer(chains[r][i], PAGE)
        pump_until(streamer, "every request's manifest is whole",
                   lambda: all((m := manifest(cb, r)) is not None and m.committed_tokens == 3 * BLOCK
                               for r in chains))
        assert streamer.figures["checkpoint_deferred"] > 0
        assert streamer.figures["checkpoint_failed"] == 0
        for r in chains:
            assert manifest(cb, r).tags == kvd.block_tags(ns, BLOCK, [t + r for t in tokens])
