"""A prefix computed on one node, served on another: time to the first token on a remote hit
(the prefix fetched from the other node's daemon), a local hit (the prefix in this node's
daemon) and a recompute, per prompt length, in one sitting.

    scripts/bench-cluster-cache.sh [ROUNDS] [LENGTHS] [LAYERS]      (defaults 5, 512,1024,2000, 8)

Engines (vLLM's CPU build, the tiny model made ``LAYERS`` deep so that a prefill costs well over
a fetch of its KV, float32, each pinned to one core): a plain server with no connector (the
recompute), engine A on node 1's daemon (core 0), and engines B1 and B2 on node 2's daemon
(core 1). The daemons run in cluster mode on a real etcd, each the other's peer through it, at
nice -10 (``pd_handoff.nice_daemon``).

Per length and round, a fresh prompt P (no engine has seen it) and a one-block suffix s:
P goes to A (untimed: node 1's daemon now holds P's blocks); then, each request starting
``SETTLE_S`` after the last ended, P+s streams to the plain engine (recompute), to B1 (a remote
hit: node 2's daemon fetches P's blocks from node 1, then B1 loads them) and to B2 (a local hit:
node 2's daemon holds them now, B2's own prefix cache does not). Every output must equal the
plain engine's. The fetch's own time comes from node 2's daemon
(``kvd_transfer_duration_seconds{kind="cluster_fetch"}``), its bytes from its received-bytes
counter.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from pd_handoff import (ENGINES, SETTLE_S, Engine, body, cluster_daemons, pct, post,  # noqa: E402
                        prompt_of, stream)
from test_stream_recovery import Etcd, cluster_folder, free_port, get_text, metric, stop_cluster  # noqa: E402
from test_vllm import connector  # noqa: E402

BLOCK = 32


def fetch_figures(d: Any) -> tuple[float, float, float]:
    """Node ``d``'s cluster fetches so far: (seconds, bytes received, blocks fetched)."""
    text = get_text(f"http://{d.admin}/metrics")
    return (metric(text, "kvd_transfer_duration_seconds_sum", kind="cluster_fetch"),
            metric(text, "kvd_transfer_bytes_received_total"),
            metric(text, "kvd_cluster_fetched_blocks_total"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lengths", default="512,1024,2000")
    ap.add_argument("--layers", type=int, default=8, help="the model's depth (the tests' is 2)")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    tmp, _, secret = cluster_folder("kvd-bench-cluster-cache-")
    model = tmp / "model-deep"
    subprocess.run([sys.executable, str(ENGINES / "make_tiny_model.py"), str(model), "--layers", str(args.layers)],
                   check=True, capture_output=True)
    # a block is 32 tokens x layers x 512 B (2 KV heads of 32 floats, K and V)
    page_kib = max(64, BLOCK * args.layers * 512 // 1024)
    etcd = Etcd(tmp)
    nodes = cluster_daemons(secret, etcd, pool_mib=1024, page_kib=page_kib)
    plain = Engine(0, model, free_port(), tmp / "plain.log", None)
    a = Engine(0, model, free_port(), tmp / "a.log", connector(nodes[1].socket))
    b1 = Engine(1, model, free_port(), tmp / "b1.log", connector(nodes[2].socket))
    b2 = Engine(1, model, free_port(), tmp / "b2.log", connector(nodes[2].socket))
    engines = (plain, a, b1, b2)
    figures: dict[str, Any] = {"layers": args.layers, "block_kib": BLOCK * args.layers * 512 // 1024}
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_ready(900)
        print(f"engines up; logs in {tmp}", file=sys.stderr, flush=True)
        for k, e in enumerate(engines):  # first-request costs are not the figure
            stream(e.url, body(prompt_of(300, 999_000 + k)))
        for length in lengths:
            figures[str(length)] = run_length(length, args.rounds, plain, a, b1, b2, nodes[2])
    finally:
        for e in engines:
            if e.alive():
                e.stop()
        stop_cluster(tmp, None, nodes, etcd)  # type: ignore[arg-type]
    report(figures)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))


def run_length(length: int, rounds: int, plain: Engine, a: Engine, b1: Engine, b2: Engine, node2: Any) -> dict:
    ttft: dict[str, list[float]] = {"recompute": [], "remote hit": [], "local hit": []}
    fetch_s, fetch_bytes, fetched = [], [], []
    for r in range(rounds):
        prompt = prompt_of(length, length * 1000 + r)
        full = prompt + prompt_of(BLOCK, 7_000_000 + length * 1000 + r)
        post(a.url, dict(body(prompt), max_tokens=1))
        time.sleep(SETTLE_S)
        t, ref, _ = stream(plain.url, body(full))
        ttft["recompute"].append(t)
        time.sleep(SETTLE_S)
        before = fetch_figures(node2)
        t, got, _ = stream(b1.url, body(full))
        after = fetch_figures(node2)
        assert got == ref, f"a remote hit's output differs ({length} tokens, round {r})"
        ttft["remote hit"].append(t)
        fetch_s.append(after[0] - before[0])
        fetch_bytes.append(after[1] - before[1])
        fetched.append(after[2] - before[2])
        time.sleep(SETTLE_S)
        t, got, _ = stream(b2.url, body(full))
        assert got == ref, f"a local hit's output differs ({length} tokens, round {r})"
        ttft["local hit"].append(t)
        time.sleep(SETTLE_S)
    out: dict[str, Any] = {k: {"p50_ms": round(pct(v, 50) * 1000, 1), "p90_ms": round(pct(v, 90) * 1000, 1)}
                           for k, v in ttft.items()}
    out["fetch"] = {"p50_ms": round(pct(fetch_s, 50) * 1000, 2),
                    "blocks": min(fetched), "mib": round(sum(fetch_bytes) / len(fetch_bytes) / 2**20, 2),
                    "gb_s": round(sum(fetch_bytes) / sum(fetch_s) / 1e9, 2) if sum(fetch_s) else None}
    out["recompute_over_fetch"] = round(pct(ttft["recompute"], 50) / pct(fetch_s, 50), 1) if pct(fetch_s, 50) else None
    print(f"{length}: {json.dumps(out)}", file=sys.stderr, flush=True)
    return out


def report(figures: dict[str, Any]) -> None:
    print(f"\nTTFT, ms (p50 / p90), the tiny model {figures['layers']} layers deep, "
          f"{figures['block_kib']} KiB blocks")
    print(f"{'prompt':>7} {'recompute':>15} {'remote hit':>15} {'local hit':>15} {'fetch ms':>9} "
          f"{'fetch GB/s':>10} {'recompute/fetch':>15}")
    for length, f in figures.items():
        if not length.isdigit():
            continue
        cells = [f"{f[k]['p50_ms']:.1f} / {f[k]['p90_ms']:.1f}" for k in ("recompute", "remote hit", "local hit")]
        print(f"{length:>7} {cells[0]:>15} {cells[1]:>15} {cells[2]:>15} {f['fetch']['p50_ms']:>9} "
              f"{str(f['fetch']['gb_s']):>10} {str(f['recompute_over_fetch']):>15}")


if __name__ == "__main__":
    main()
