"""Prefill on one node, decode on another, through ``kvd control``'s front in P/D mode: real
etcd, a prefill node (a kvd daemon in cluster mode and vLLM's own server with the tiny model,
``kv_producer``) and two decode nodes (the same, ``kv_consumer``), and ``kvd control
--prefill-engine 1=... --engine 2=... --engine 3=...``. The client streams greedy requests
through the front; the cases inject what really fails (``kill -9`` of a vLLM server's process
group, a stopped process, a request the decode engine refuses, a client that leaves) and compare
the client's tokens with the same request run colocated on one vLLM server.

The cases share one cluster and run in order (module fixture; the engines start once):

1. greedy requests: the colocated run's tokens; the decode loaded the prompt's blocks from
   outside (vLLM's own counter) and computed only the last block; the front ended the
   prefill node's hold at the decode's first token;
2. a request the decode engine refuses (prompt + max_tokens past its context): the source is
   told at once (its hold ends well before its TTL), the client gets a clear error;
3. a client that leaves while the prefill runs: the prefill is dropped, nothing is held or
   pinned anywhere afterwards, and no hold had to expire;
4. the decode worker killed before its first token: the other decode worker takes the
   hand-off (the source still holds the blocks), same tokens;
5. the prefill worker killed: with no prefill worker left the decode worker prefills the prompt
   itself, same tokens.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from typing import Any

import pytest

from kvd_daemon import wait_until
from test_stream_recovery import (Etcd, Front, Node, Stream, check_sequence, cluster_folder, get_text,
                                  metric, nothing_left, record, start_nodes, stop_cluster)
from test_vllm import BLOCK, connector, words
from vllm_server import SERVED_NAME

START_TIMEOUT_S = 900
HOLD_TTL_MS = 60_000  # far longer than any case: a hold released in a case was released by the front
PROMPT = words(61, 900, 7)
MAX_TOKENS = 40
DECODE_CONTEXT = 1024
FIGURES: dict[str, Any] = {}


class PdNode(Node):
    """A node whose vLLM hands off: ``kv_producer`` (prefill) or ``kv_consumer`` (decode)."""

    def __init__(self, role: str, *args: Any) -> None:
        super().__init__(*args)
        self.role = role

    def connector(self) -> dict:
        assert self.daemon is not None
        c = connector(self.daemon.socket, node_id=self.i, handoff_ttl_ms=HOLD_TTL_MS,
                      handoff_timeout_ms=30_000)
        c["kv_role"] = self.role
        return c

    def vllm_args(self) -> list[str]:
        # the decode engines take shorter contexts than the prefill engine: a long prompt is
        # prefilled, then refused by the decode (the refusal window)
        return [] if self.role == "kv_producer" else ["--max-model-len", str(DECODE_CONTEXT)]

    def signal_vllm(self, sig: int) -> None:
        assert self.vllm is not None and self.vllm.proc is not None
        os.killpg(self.vllm.proc.pid, sig)

    def holds(self) -> dict:
        return self.status()["holds"]

    def daemon_metric(self, name: str) -> float:
        assert self.daemon is not None
        return metric(get_text(f"http://{self.daemon.admin}/metrics"), name)


@pytest.fixture(scope="module")
def pd():
    tmp, model, secret = cluster_folder("kvd-front-pd-")
    etcd = Etcd(tmp)
    roles = {1: "kv_producer", 2: "kv_consumer", 3: "kv_consumer"}
    nodes = {i: PdNode(role, i, tmp, etcd, secret, str(model)) for i, role in roles.items()}
    front = None
    try:
        start_nodes(nodes)  # type: ignore[arg-type]
        front = Front(tmp, etcd, {2: nodes[2], 3: nodes[3]}, prefill={1: nodes[1]})
        wait_until("the decode workers in service", lambda: {2, 3} <= front.in_service(), timeout_s=60)
        yield tmp, nodes, front
    finally:
        print("\nP/D figures:", json.dumps(FIGURES, indent=1))
        stop_cluster(tmp, front, nodes, etcd)  # type: ignore[arg-type]


def body(prompt: Any, max_tokens: int = MAX_TOKENS) -> dict:
    return {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}


def colocated(n: PdNode, prompt: Any, max_tokens: int = MAX_TOKENS) -> list[int]:
    """The same request on one vLLM server, no hand-off: the reference tokens."""
    b = dict(body(prompt, max_tokens), stream=False)
    req = urllib.request.Request(n.url + "/v1/completions", data=json.dumps(b).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())["choices"][0]["token_ids"]


def tokenize(n: PdNode, prompt: str) -> list[int]:
    req = urllib.request.Request(n.url + "/tokenize", data=json.dumps({"model": SERVED_NAME, "prompt": prompt}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["tokens"]


def loaded(n: PdNode, source: str = "external_kv_transfer") -> float:
    return metric(n.metrics(), "vllm:prompt_tokens_by_source_total", source=source)


def front_stats(front: Front) -> dict:
    return front.get("/status")["front"]


def state_of(front: Front, request: int) -> str:
    return str(record(front, request).get("state", "")).upper()


def settled(nodes: dict[int, PdNode]) -> None:
    """Nothing held, pinned, reserved or in flight on any live node."""
    wait_until("no holds left", lambda: all(n.holds()["holds"] == 0 for n in live(nodes)), timeout_s=20)
    wait_until("nothing left", lambda: _nothing_left(nodes), timeout_s=20)


def _nothing_left(nodes: dict[int, PdNode]) -> bool:
    try:
        nothing_left(nodes)  # type: ignore[arg-type]
        return True
    except AssertionError:
        return False


def live(nodes: dict[int, PdNode]) -> list[PdNode]:
    return [n for n in nodes.values() if n.daemon is not None and n.daemon.proc.poll() is None]


def test_greedy_requests_through_the_front_match_a_colocated_run_and_the_decode_loaded_the_prompt(pd):
    _, nodes, front = pd
    ref = colocated(nodes[1], PROMPT)  # on the prefill node: the decode nodes must not have it
    before = {i: (loaded(nodes[i]), loaded(nodes[i], "local_compute")) for i in (2, 3)}
    ended0 = nodes[1].daemon_metric("kvd_handoff_holds_ended_total")
    t0 = time.monotonic()
    s = Stream(front.addr, body(PROMPT))
    s.read_until(1)
    FIGURES["ttft_ms_first_request"] = round((time.monotonic() - t0) * 1000)
    s.read_all()
    check_sequence(s.events, s.request)
    assert s.tokens() == ref, "P/D through the front gives the colocated run's greedy tokens"
    first = s.events[0][1]
    assert first["kvd"]["worker"] == 1, f"the first token is the prefill's, relayed at its answer: {first}"
    serving = record(front, s.request)["serving"]
    assert serving in (2, 3)
    d = nodes[serving]
    got, computed = loaded(d) - before[serving][0], loaded(d, "local_compute") - before[serving][1]
    assert got > 0 and got % BLOCK == 0, f"the prompt's blocks came from outside: {got}"
    # the decode's prompt is the prompt + the prefill's token: it computes the prompt's last,
    # partial block and that token
    assert computed <= BLOCK, f"only the last, partial block was computed: {computed}"
    st = front_stats(front)
    assert (st["prefills_started"], st["handoffs_started"], st["handoffs_done"]) >= (1, 1, 1), st
    assert st["first_tokens_from_prefill"] >= 1, st
    text = get_text(f"http://{front.addr}/metrics")
    assert metric(text, "kvd_control_front_handoff_seconds_count") >= 1, "the hand-off's time is in its histogram"
    # the front ended the hold at the decode's first token (not its TTL)
    assert nodes[1].daemon_metric("kvd_handoff_holds_ended_total") >= ended0 + 1
    settled(nodes)
    handoff = front.get("/status")["handoffs"][-1]
    FIGURES["handoff"] = handoff


def test_a_request_the_decode_refuses_tells_the_source_at_once_and_fails_clearly(pd):
    _, nodes, front = pd
    # 1,500 prompt tokens fit the prefill engine's context, not the decode engines'
    prompt = words(67, 1500, 3)
    ended0 = nodes[1].daemon_metric("kvd_handoff_holds_ended_total")
    s = Stream(front.addr, body(prompt))
    t0 = time.monotonic()
    s.read_all()
    errors = [d for _, d, _ in s.events if isinstance(d, dict) and "error" in d]
    # the client may have the prefill's token: it was relayed before the decode refused
    assert errors and len(s.tokens()) <= 1, s.events
    assert "400" in json.dumps(errors[0]) or "context" in json.dumps(errors[0]).lower(), errors
    wait_until("the source's hold ended", lambda: nodes[1].holds()["holds"] == 0, timeout_s=10)
    assert time.monotonic() - t0 < HOLD_TTL_MS / 1000 / 2, "told at once, not by the lease"
    assert nodes[1].daemon_metric("kvd_handoff_holds_ended_total") >= ended0 + 1
    assert front_stats(front)["handoffs_refused"] >= 1
    settled(nodes)


def test_a_client_that_leaves_during_the_prefill_releases_everything_on_every_node(pd):
    _, nodes, front = pd
    expired0 = nodes[1].daemon_metric("kvd_handoff_holds_expired_total")
    nodes[1].signal_vllm(signal.SIGSTOP)  # the prefill cannot answer yet
    try:
        s = Stream(front.addr, body(words(71, 800, 5)))
        wait_until("the prefill is sent", lambda: state_of(front, s.request) == "PREFILLING", timeout_s=10)
        s.close()
        # past the reconnect grace the front cancels: it drops the prefill and ends its epoch's hold
        wait_until("the front cancelled", lambda: front_stats(front)["handoffs_cancelled"] >= 1, timeout_s=20)
    finally:
        nodes[1].signal_vllm(signal.SIGCONT)
    # the prefill engine may still finish it; its late hold is refused (the epoch ended first)
    time.sleep(2)
    settled(nodes)
    assert nodes[1].daemon_metric("kvd_handoff_holds_expired_total") == expired0, "nothing left to expire"


def test_a_decode_worker_killed_before_its_first_token_hands_off_to_the_other(pd):
    _, nodes, front = pd
    # token ids: the front tokenizes text on a decode engine, and both are stopped below
    prompt = tokenize(nodes[1], words(73, 900, 11))
    ref = colocated(nodes[1], prompt)
    st0 = front_stats(front)
    loaded0 = {i: loaded(nodes[i]) for i in (2, 3)}
    for i in (2, 3):
        nodes[i].signal_vllm(signal.SIGSTOP)
    stopped = {2, 3}
    try:
        s = Stream(front.addr, body(prompt))
        wait_until("the hand-off is under way", lambda: state_of(front, s.request) == "TRANSFERRING", timeout_s=10)
        victim = record(front, s.request)["serving"]
        other = 5 - victim
        nodes[other].signal_vllm(signal.SIGCONT)
        stopped.discard(other)
        nodes[victim].kill_vllm()
        stopped.discard(victim)
    finally:
        for i in stopped:
            nodes[i].signal_vllm(signal.SIGCONT)
    s.read_all()
    check_sequence(s.events, s.request)
    assert s.tokens() == ref, "the survivor continued the hand-off with the same tokens"
    assert record(front, s.request)["serving"] == other
    assert loaded(nodes[other]) > loaded0[other], "the survivor loaded the held run, not recomputed it"
    st = front_stats(front)
    assert st["handoffs_resumed"] >= st0["handoffs_resumed"] + 1, st
    settled(nodes)


def test_with_its_prefill_worker_killed_the_decode_worker_prefills_itself(pd):
    _, nodes, front = pd
    prompt = words(79, 700, 13)
    survivor = next(i for i in (2, 3) if nodes[i].vllm is not None and nodes[i].vllm.alive())
    ref = colocated(nodes[survivor], prompt)
    st0 = front_stats(front)
    nodes[1].kill_vllm()
    s = Stream(front.addr, body(prompt))
    s.read_all()
    check_sequence(s.events, s.request)
    assert s.tokens() == ref, "the decode worker's own prefill gives the same tokens"
    st = front_stats(front)
    assert st["self_prefills"] >= st0["self_prefills"] + 1, st
    settled(nodes)
