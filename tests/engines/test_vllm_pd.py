"""Prefill on one node, decode on another, through kvd, in vLLM's own P/D contract
(``kvd.vllm_handoff``, docs/ENGINES.md "Prefill/decode").

Two kvd daemons that fetch from each other (nodes 1 and 2), a prefill vLLM server on node 1
(``kv_producer``) and a decode vLLM server on node 2 (``kv_consumer``, ``kv_load_failure_policy:
recompute``), and a proxy written here that speaks only the contract of vLLM's toy P/D proxy:
the prefill request carries ``do_remote_decode`` and ``max_tokens`` 1, and the prefill
response's ``kv_transfer_params`` go unchanged into the decode request. The engines start once.
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from typing import Any, Callable, Optional

import pytest

from kvd_daemon import Daemon, wait_until
from test_stream_recovery import free_port, get_json, get_text, metric
from test_vllm import BLOCK, connector, words
from test_vllm_checkpoint import peer_cluster
from vllm_server import SERVED_NAME, VllmServer

PROMPT = words(5, 300, 31)  # several blocks
OTHER = words(41, 200, 7)
NOBODY = words(77, 250, 13)  # never prefilled anywhere
MAX_TOKENS = 24
TTL_MS = 5000
START_TIMEOUT_S = 900


def post(url: str, body: dict, request_id: str) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "X-Request-Id": request_id})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def body(prompt: str) -> dict:
    return {"model": SERVED_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True}


def proxy(prefill: str, decode: str, prompt: str, edit: Optional[Callable[[dict], dict]] = None,
          binding: Optional[dict] = None) -> tuple[dict, dict]:
    """vLLM's toy P/D proxy (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py), as
    small as it gets: the prefill, then the decode with the prefill's parameters unchanged
    (``edit`` only for the cases that forge them; ``binding``: the (request, epoch) a front
    names in the prefill's ``kv_transfer_params.kvd``)."""
    rid = str(uuid.uuid4())
    pre = dict(body(prompt), stream=False, max_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None})
    if binding is not None:
        pre["kv_transfer_params"]["kvd"] = binding
    params = post(prefill, pre, rid).get("kv_transfer_params") or {}
    if edit is not None:
        params = edit(params)
    dec = body(prompt)
    if params:
        dec["kv_transfer_params"] = params
    return post(decode, dec, rid), params


def tokens(out: dict) -> tuple[str, Any]:
    c = out["choices"][0]
    return c["text"], c.get("token_ids")


def pd_connector(socket: str, role: str, node: int) -> dict:
    # The cluster lookup off: these cases test the hand-off alone. With it on, a decode whose
    # hand-off is refused still finds the prompt's blocks at the prefill node (its own
    # prompt's keys, so the right bytes) and loads them: test_cluster_cache.py shows that.
    c = connector(socket, node_id=node, handoff_ttl_ms=TTL_MS, handoff_timeout_ms=20_000,
                  cluster_lookup=False)
    c["kv_role"] = role
    return c


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    with peer_cluster(tmp_path_factory, "pd", 2) as (tmp, model, nodes):
        servers = {
            "prefill": VllmServer(model, free_port(), tmp / "prefill.log",
                                  pd_connector(nodes[1].socket, "kv_producer", 1)),
            "decode": VllmServer(model, free_port(), tmp / "decode.log",
                                 pd_connector(nodes[2].socket, "kv_consumer", 2)),
        }
        try:
            for s in servers.values():
                s.start()
            for s in servers.values():
                s.wait_ready(START_TIMEOUT_S)
            yield nodes, servers
        finally:
            for s in servers.values():
                s.stop()


def loaded_tokens(srv: VllmServer, source: str = "external_kv_transfer") -> float:
    return metric(get_text(srv.url + "/metrics"), "vllm:prompt_tokens_by_source_total", source=source)


def computed_tokens(srv: VllmServer) -> float:
    return loaded_tokens(srv, "local_compute")


def daemon_metric(d: Daemon, name: str) -> float:
    return metric(get_text(f"http://{d.admin}/metrics"), name)


def held(d: Daemon) -> int:
    """Blocks the daemon holds for hand-offs (its holds, owned by no session)."""
    return int(get_json(f"http://{d.admin}/status")["holds"]["blocks"])


def test_greedy_tokens_through_the_proxy_match_a_colocated_run_and_the_prompt_was_loaded(pd):
    nodes, srv = pd
    p, d = srv["prefill"], srv["decode"]
    loaded0, received0 = loaded_tokens(d), daemon_metric(nodes[2], "kvd_transfer_bytes_received_total")
    computed0 = computed_tokens(d)
    out, params = proxy(p.url, d.url, PROMPT)
    h = params["kvd"]["handoff"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["transfer_mode"] == "kvd" and h["node"] == 1 and h["epoch"] == 1
    n_prompt = out["usage"]["prompt_tokens"]
    want = (n_prompt - 1) // BLOCK
    assert h["blocks"] == n_prompt // BLOCK and params["remote_num_tokens"] == h["blocks"] * BLOCK
    colocated = post(p.url, body(PROMPT), str(uuid.uuid4()))
    assert tokens(out) == tokens(colocated), "P/D gives the colocated run's greedy tokens"
    # The decode loaded the prompt's blocks from outside (fetched by its daemon), not recomputed.
    assert loaded_tokens(d) - loaded0 == want * BLOCK
    assert daemon_metric(nodes[2], "kvd_transfer_bytes_received_total") - received0 >= want * 32 * 1024
    assert computed_tokens(d) - computed0 == n_prompt - want * BLOCK, "only the last block was computed"
    # Without a front to end it, the decode's node ended the hold once it had the run.
    wait_until("the decode took the hold", lambda: held(nodes[1]) == 0, timeout_s=10)
    assert daemon_metric(nodes[1], "kvd_handoff_holds_taken_total") >= 1


FORGED = {"namespace": OTHER, "node_without_the_run": NOBODY, "unknown_node": words(123, 220, 17),
          "older_epoch": words(131, 230, 5), "newer_epoch": words(137, 230, 9),
          "another_request": words(139, 230, 11), "malformed": words(149, 230, 13)}


@pytest.mark.parametrize("forge", list(FORGED))
def test_parameters_naming_another_namespace_node_epoch_or_request_are_a_miss_with_the_same_tokens(pd, forge):
    nodes, srv = pd
    p, d = srv["prefill"], srv["decode"]
    prompt = FORGED[forge]

    def edit(params: dict) -> dict:
        params = json.loads(json.dumps(params))
        if forge == "namespace":
            params["kvd"]["handoff"]["namespace"] = "ab" * 32
        elif forge == "node_without_the_run":  # the consumer's own node, which never saw this prompt
            params["kvd"]["handoff"]["node"] = 2
        elif forge == "unknown_node":  # no such peer: the fetch fails, a failed receive that is recomputed
            params["kvd"]["handoff"]["node"] = 9
        elif forge == "malformed":  # not parameters kvd can read: a miss, logged
            params["kvd"]["handoff"] = {"node": "one", "blocks": -3}
        elif forge == "another_request":  # the source holds no run for it: refused, recomputed
            params["kvd"]["handoff"]["request"] += 2
        else:  # a stale (or not yet made) attempt's epoch: refused at the source, recomputed
            params["kvd"]["handoff"]["epoch"] += -1 if forge == "older_epoch" else 1
        return params

    loaded0, refused0 = loaded_tokens(d), daemon_metric(nodes[1], "kvd_transfer_binding_mismatches_total")
    # the epoch cases hold at epoch 3, as a front's third attempt would
    binding = {"request": 1000 + len(forge), "epoch": 3} if "epoch" in forge else None
    out, params = proxy(p.url, d.url, prompt, edit, binding)
    if binding is not None:
        assert params["kvd"]["handoff"]["keep"], "the front ends a hold it bound"
        assert params["kvd"]["handoff"]["request"] == binding["request"]
    colocated = post(p.url, body(prompt), str(uuid.uuid4()))
    assert tokens(out) == tokens(colocated), "a miss is recomputed, with the same tokens"
    if forge in ("namespace", "older_epoch", "newer_epoch", "another_request", "malformed"):
        assert loaded_tokens(d) == loaded0, "forged parameters load nothing"
    if forge in ("older_epoch", "newer_epoch", "another_request"):
        assert daemon_metric(nodes[1], "kvd_transfer_binding_mismatches_total") > refused0, \
            "the source refused the read, bound to what it does not hold"


def test_a_held_run_is_released_after_handoff_ttl(pd):
    nodes, srv = pd
    p = srv["prefill"]
    wait_until("no holds left from earlier cases", lambda: held(nodes[1]) == 0, timeout_s=TTL_MS / 1000 + 20)
    expired0 = daemon_metric(nodes[1], "kvd_handoff_holds_expired_total")
    prompt = words(300, 280, 3)
    pre = dict(body(prompt), max_tokens=1, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
    params = post(p.url, pre, str(uuid.uuid4()))["kv_transfer_params"]
    held_now = params["kvd"]["handoff"]["blocks"]
    assert held_now > 0 and held(nodes[1]) == held_now, "the prefill's daemon holds the run"
    wait_until("the hold ends with handoff_ttl_ms", lambda: held(nodes[1]) == 0, timeout_s=TTL_MS / 1000 + 20)
    assert daemon_metric(nodes[1], "kvd_handoff_holds_expired_total") == expired0 + 1, "counted"
