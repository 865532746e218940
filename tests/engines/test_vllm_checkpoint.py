"""Checkpoint streaming from a real vLLM engine and restore on another node (kvd.vllm_checkpoint).

Three kvd daemons with data ports, each in the others' peer table: node 1 runs the worker
engine, node 2 holds the checkpoints, node 3 runs the survivor. The worker generates part of a
greedy request with checkpoint parameters, so every block it completes is streamed to node 2's
manifest; then a fresh engine on node 3 gets the request resubmitted (prompt plus the tokens
generated so far) with restore parameters, reads the prefix from node 2 and generates the rest.
Its tokens must be the plain engine's, token for token, and it must have loaded the checkpoint
rather than recomputed it. With the holder gone, the same resubmission recomputes and still
gives the same tokens. (The streaming front that does the resubmitting is `kvd control`'s, a
later step; here the test plays its part.)
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

import kvd
from kvd_daemon import Daemon, peers_file, wait_until, write_peers
from test_vllm import BLOCK, HERE, connector, engine, scenario, step, words

PROMPT = words(11, 300, 23)
MORE = words(13, 260, 29)
SPLIT = 60  # tokens generated before the "crash"
TOTAL = 120


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def peer_daemons(tmp: Path, n: int) -> dict[int, Daemon]:
    """Daemons 1..n with data ports, sharing a cluster secret, each in the others' peer table:
    one peers file with every node's data port and public key (each skips its own line)."""
    secret = tmp / "secret"
    secret.write_bytes(bytes(range(32)))
    secret.chmod(0o600)
    peers = peers_file(tmp / "peers")
    ports = free_ports(n)
    nodes = {}
    for i in range(1, n + 1):
        nodes[i] = Daemon(["--cluster-secret-file", str(secret), "--data-listen", f"127.0.0.1:{ports[i - 1]}",
                           "--node-id", str(i), "--pool-mib", "64", "--page-kib", "64", "--peers-file", str(peers)])
    write_peers(peers, nodes)
    return nodes


def tiny_model(tmp: Path) -> Path:
    model = tmp / "model"
    subprocess.run([sys.executable, str(HERE / "make_tiny_model.py"), str(model)], check=True, capture_output=True)
    return model


@contextlib.contextmanager
def peer_cluster(tmp_path_factory, name: str, n: int) -> Iterator[tuple[Path, Path, dict[int, Daemon]]]:
    """A fresh folder, the tiny model in it and ``n`` peer daemons, stopped at the end."""
    tmp = tmp_path_factory.mktemp(name)
    nodes = peer_daemons(tmp, n)
    try:
        yield tmp, tiny_model(tmp), nodes
    finally:
        for d in nodes.values():
            if d.proc.poll() is None:
                d.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with peer_cluster(tmp_path_factory, "ckpt", 3) as (tmp, model, nodes):
        yield tmp, str(model), nodes


def committed(c: "kvd.Client", request: int) -> int:
    try:
        return c.manifest(request).committed_tokens
    except kvd.NotFound:
        return 0


def kvd_params(kind: str, holder: int, request: int, epoch: int, **more) -> dict:
    return {"kvd": {kind: {"holder": holder, "request": request, "epoch": epoch, **more}}}


def test_a_request_checkpointed_to_a_holder_resumes_on_a_third_node_with_the_plain_tokens(cluster):
    tmp, model, nodes = cluster
    plain = engine(tmp, "plain", scenario(model, [step("full", [PROMPT], TOTAL, False)]))
    full = plain.tokens("full")[0]
    worker = engine(tmp, "worker", scenario(model, [
        dict(step("part", [PROMPT], SPLIT, False), kv_transfer_params=kvd_params("checkpoint", 2, 4242, 1))],
        connector(nodes[1].socket)))
    assert worker.tokens("part")[0] == full[:SPLIT], "checkpointing changes nothing for the worker"
    st = worker.stats("part")
    computed = 300 + SPLIT - 1  # the last sampled token's KV is never computed
    assert st["checkpoint_blocks"] == computed // BLOCK, "every completed block was streamed"
    assert st["checkpoint_bytes"] == st["checkpoint_blocks"] * 32 * 1024
    with kvd.Client(nodes[2].socket, name="test") as c:
        # The pushes run on node 1's daemon: the last may land just after the engine is gone.
        wait_until("the holder's manifest has every step",
                   lambda: committed(c, 4242) == computed // BLOCK * BLOCK)
        m = c.manifest(4242)
        assert m.epoch == 1 and len(m.tags) == computed // BLOCK

    resumed = {"tokens": plain.steps["full"]["outputs"][0]["prompt"] + full[:SPLIT]}
    survivor = engine(tmp, "survivor", scenario(model, [
        dict(step("rest", [resumed], TOTAL - SPLIT, False), kv_transfer_params=kvd_params("restore", 2, 4242, 1))],
        connector(nodes[3].socket)))
    assert survivor.tokens("rest")[0] == full[SPLIT:], "the stream continues exactly"
    out = survivor.steps["rest"]["outputs"][0]
    assert out["cached"] == computed // BLOCK * BLOCK, "the checkpointed prefix was restored, not recomputed"
    assert survivor.stats("rest")["loaded_blocks"] == computed // BLOCK
    assert survivor.r["scheduler_totals"].get("restores_done") == 1
    assert all(n == 0 for n in survivor.r["bookkeeping"].values())


def test_with_the_holder_gone_the_resubmitted_request_recomputes_and_gives_the_same_tokens(cluster):
    tmp, model, nodes = cluster
    plain = engine(tmp, "plain2", scenario(model, [step("full", [MORE], TOTAL, False)]))
    full = plain.tokens("full")[0]
    engine(tmp, "worker2", scenario(model, [
        dict(step("part", [MORE], SPLIT, False), kv_transfer_params=kvd_params("checkpoint", 2, 4343, 1))],
        connector(nodes[1].socket)))
    nodes[2].stop()  # the holder's node is gone, its checkpoint with it
    resumed = {"tokens": plain.steps["full"]["outputs"][0]["prompt"] + full[:SPLIT]}
    survivor = engine(tmp, "survivor2", scenario(model, [
        dict(step("rest", [resumed], TOTAL - SPLIT, False), kv_transfer_params=kvd_params("restore", 2, 4343, 1))],
        connector(nodes[3].socket, restore_timeout_ms=5000)))
    assert survivor.tokens("rest")[0] == full[SPLIT:]
    assert survivor.steps["rest"]["outputs"][0]["cached"] == 0, "nothing to restore: all recomputed"
    assert survivor.r["scheduler_totals"].get("restores_failed") == 1


def test_a_request_resumed_on_its_holder_loads_the_checkpoint_from_its_own_daemon(cluster):
    tmp, model, nodes = cluster
    prompt = words(17, 300, 31)
    plain = engine(tmp, "plain3", scenario(model, [step("full", [prompt], TOTAL, False)]))
    full = plain.tokens("full")[0]
    engine(tmp, "worker3", scenario(model, [
        dict(step("part", [prompt], SPLIT, False), kv_transfer_params=kvd_params("checkpoint", 3, 4444, 1))],
        connector(nodes[1].socket)))
    computed = 300 + SPLIT - 1
    with kvd.Client(nodes[3].socket, name="test") as c:
        wait_until("the holder's manifest has every step",
                   lambda: committed(c, 4444) == computed // BLOCK * BLOCK)
    resumed = {"tokens": plain.steps["full"]["outputs"][0]["prompt"] + full[:SPLIT]}
    survivor = engine(tmp, "on-holder", scenario(model, [
        dict(step("rest", [resumed], TOTAL - SPLIT, False),
             kv_transfer_params=kvd_params("restore", 3, 4444, 1, local=True))],
        connector(nodes[3].socket)))
    assert survivor.tokens("rest")[0] == full[SPLIT:]
    assert survivor.steps["rest"]["outputs"][0]["cached"] == computed // BLOCK * BLOCK
    assert survivor.stats("rest")["loaded_blocks"] == computed // BLOCK
    assert survivor.r["scheduler_totals"].get("restores_local") == 1
    assert "restores_started" not in survivor.r["scheduler_totals"], "nothing fetched"
