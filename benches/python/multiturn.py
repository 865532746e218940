"""Multi-turn conversations over three nodes through ``kvd control``'s front: the prefix-cache
hit rate, TTFT and the tokens recomputed, with the local cache only, the cluster cache routed by
load, and the cluster cache routed by cached prefix, in one sitting.

    scripts/bench-multiturn.sh [CONVERSATIONS] [TURNS] [LAYERS]     (defaults 32, 8, 8)

Three nodes (a kvd daemon in cluster mode on a real etcd and a vLLM server with the tiny model
made ``LAYERS`` deep, ``--prefix-caching-hash-algo sha256_cbor``, an own KV cache of
``ENGINE_BLOCKS`` blocks, fewer than the conversations in flight need), the front over the three
engines. Each conversation's turn t sends its whole history (every earlier prompt and answer)
plus a fresh user message of ``USER_TOKENS`` token ids, greedy, ``ANSWER_TOKENS`` tokens; the
conversations take turns: every conversation's turn t (``CONCURRENCY`` at a time), then every
one's turn t + 1, so that all of them stay open at once, as users with think time between their
turns keep them. The three
set-ups, each on freshly started engines and daemons (nothing cached), with the same
conversations:

- ``local``: the connector's cluster lookup off, the front routing by load (``--cache-routing
  false``): a turn is a hit only where its conversation was served before;
- ``cluster+load``: the cluster lookup on, routing by load: a turn elsewhere fetches its history
  from the node that holds it;
- ``cluster+cache``: the cluster lookup on, cache-aware routing (the default weights).

Per set-up: the hit rate (prompt tokens vLLM did not compute ÷ prompt tokens, from its own
``prompt_tokens_by_source`` counters over the three engines), the tokens computed, TTFT mean and
p90 at the client, and where the front routed the turns (its routing counters).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from pd_handoff import ENGINES, Engine, cluster_daemons, pct, prompt_of, stream  # noqa: E402
from test_stream_recovery import Etcd, Front, cluster_folder, free_port, get_text, metric, stop_cluster  # noqa: E402
from test_vllm import connector  # noqa: E402
from kvd_daemon import wait_until  # noqa: E402
from vllm_server import SERVED_NAME  # noqa: E402

USER_TOKENS = 96
ANSWER_TOKENS = 24
CONCURRENCY = 6  # twice the workers: turns queue
ENGINE_BLOCKS = 160  # each engine's own KV cache (5,120 tokens): far less than the open conversations
BLOCK = 32
SETUPS = {"local": (False, False), "cluster+load": (True, False), "cluster+cache": (True, True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()
    tmp, _, secret = cluster_folder("kvd-bench-multiturn-")
    model = tmp / "model-deep"
    subprocess.run([sys.executable, str(ENGINES / "make_tiny_model.py"), str(model), "--layers", str(args.layers)],
                   check=True, capture_output=True)
    page_kib = max(64, BLOCK * args.layers * 512 // 1024)
    figures: dict[str, Any] = {"conversations": args.conversations, "turns": args.turns, "layers": args.layers}
    try:
        for name, (cluster, routing) in SETUPS.items():
            figures[name] = run_setup(tmp, model, secret, page_kib, cluster, routing, args)
            print(f"{name}: {json.dumps(figures[name])}", file=sys.stderr, flush=True)
    finally:
        if "KVD_KEEP_LOGS" not in __import__("os").environ:
            __import__("shutil").rmtree(tmp, ignore_errors=True)
    report(figures)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))


def run_setup(tmp: Path, model: Path, secret: Path, page_kib: int, cluster: bool, routing: bool, args) -> dict:
    setup = tmp / f"{'c' if cluster else 'l'}{'r' if routing else 'n'}"
    setup.mkdir()
    etcd = Etcd(setup)
    nodes = cluster_daemons(secret, etcd, pool_mib=2048, page_kib=page_kib, ids=(1, 2, 3))
    engines = {i: Engine(i % 2, model, free_port(), setup / f"vllm{i}.log",
                         connector(nodes[i].socket, cluster_lookup=cluster),
                         extra_args=["--prefix-caching-hash-algo", "sha256_cbor",
                                     "--num-gpu-blocks-override", str(ENGINE_BLOCKS)]) for i in nodes}
    front = None
    try:
        for e in engines.values():
            e.start()
        for e in engines.values():
            e.wait_ready(900)
        front = Front(setup, etcd, {i: SimpleNamespace(i=i, url=e.url) for i, e in engines.items()},
                      extra=["--cache-routing", "true" if routing else "false"])
        wait_until("three workers in service", lambda: front.in_service() == {1, 2, 3}, timeout_s=60)
        before = {i: sources(e) for i, e in engines.items()}
        ttfts = converse(f"http://{front.addr}", args.conversations, args.turns)
        after = {i: sources(e) for i, e in engines.items()}
        spent = {k: sum(after[i][k] - before[i][k] for i in engines) for k in after[1]}
        total = sum(spent.values())
        st = front.get("/status")["front"]
        return {
            "hit_rate": round(1 - spent["local_compute"] / total, 3) if total else None,
            "prompt_tokens": int(total), "computed_tokens": int(spent["local_compute"]),
            "from_kvd_tokens": int(spent["external_kv_transfer"]),
            "engine_cache_tokens": int(spent["local_cache_hit"]),
            "ttft_mean_ms": round(statistics.fmean(ttfts) * 1000, 1),
            "ttft_p90_ms": round(pct(ttfts, 90) * 1000, 1),
            "routed": {k: st[k] for k in ("routed_by_load", "routed_by_cache", "routed_load_over_cache")},
        }
    finally:
        for e in engines.values():
            if e.alive():
                e.stop()
        stop_cluster(setup, front, nodes, etcd)  # type: ignore[arg-type]


def sources(e: Engine) -> dict[str, float]:
    text = get_text(e.url + "/metrics")
    return {k: metric(text, "vllm:prompt_tokens_by_source_total", source=k)
            for k in ("local_compute", "local_cache_hit", "external_kv_transfer")}


def converse(url: str, conversations: int, turns: int) -> list[float]:
    """Turn by turn: every conversation's turn t (``CONCURRENCY`` at a time), then every one's
    turn t + 1, as many users with think time between their turns would send them: all the
    conversations stay open at once. Each turn's TTFT."""
    ttfts: list[float] = []
    histories: list[list[int]] = [[] for _ in range(conversations)]
    lock = threading.Lock()

    def one(c: int, t: int) -> None:
        history = histories[c]
        history += prompt_of(USER_TOKENS, 10_000 * c + t)
        ttft, tokens, _ = stream(url, {"model": SERVED_NAME, "prompt": history, "max_tokens": ANSWER_TOKENS,
                                       "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                                       "kvd": {"checkpoint": False}})
        history += tokens
        with lock:
            ttfts.append(ttft)

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        for t in range(turns):
            list(pool.map(lambda c: one(c, t), range(conversations)))
    return ttfts


def report(figures: dict[str, Any]) -> None:
    print(f"\n{figures['conversations']} conversations x {figures['turns']} turns over 3 nodes, "
          f"the tiny model {figures['layers']} layers deep")
    print(f"{'set-up':>14} {'hit rate':>9} {'computed':>9} {'from kvd':>9} {'TTFT mean':>10} {'TTFT p90':>9}  routed")
    for name in SETUPS:
        f = figures[name]
        print(f"{name:>14} {f['hit_rate']:>9} {f['computed_tokens']:>9} {f['from_kvd_tokens']:>9} "
              f"{f['ttft_mean_ms']:>10} {f['ttft_p90_ms']:>9}  {f['routed']}")


if __name__ == "__main__":
    main()
