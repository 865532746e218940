"""What a prefill engine's prefix lookup costs its time to answer: one plain vLLM server beside
two ``kv_producer`` servers over one daemon, one answering vLLM "ask again" while its lookup is
under way (``lookup_wait_ms`` 0: the lookup costs a whole engine step) and one waiting up to
1 ms for it (the producer's default), all on core 0, prefills of fresh prompts (``max_tokens``
1, not streamed) in an order that alternates with the round.

    KVD_BIN=target/release/kvd <engine venv>/bin/python benches/python/producer_lookup_wait.py [ROUNDS] [LENGTH]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pd_handoff import (SETTLE_S, Engine, Etcd, body, cluster_daemons, cluster_folder, connector,  # noqa: E402
                        free_port, post, prompt_of, stop_cluster)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    length = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    tmp, model, secret = cluster_folder("kvd-bench-lookup-")
    etcd = Etcd(tmp)
    nodes = cluster_daemons(secret, etcd)
    producer = dict(connector(nodes[1].socket, node_id=1), kv_role="kv_producer")
    engines = {
        "plain": Engine(0, model, free_port(), tmp / "plain.log", None),
        "ask again": Engine(0, model, free_port(), tmp / "ask.log",
                            {**producer, "kv_connector_extra_config": {
                                **producer["kv_connector_extra_config"], "lookup_wait_ms": 0}}),
        "wait 1 ms": Engine(0, model, free_port(), tmp / "wait.log", producer),
    }
    times: dict[str, list[float]] = {k: [] for k in engines}
    try:
        for e in engines.values():
            e.start()
        for e in engines.values():
            e.wait_ready(900)
        order = list(engines.items())
        for r in range(rounds):
            for k, e in (order if r % 2 == 0 else order[::-1]):
                b = dict(body(prompt_of(length, 77_000 + r * 10 + len(k))), max_tokens=1, stream=False)
                if k != "plain":
                    b["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
                time.sleep(SETTLE_S)
                t0 = time.perf_counter()
                post(e.url, b)
                times[k].append((time.perf_counter() - t0) * 1000)
            print(f"round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    finally:
        for e in engines.values():
            if e.alive():
                e.stop()
        stop_cluster(tmp, None, nodes, etcd)  # type: ignore[arg-type]
    plain = statistics.median(times["plain"])
    print(f"\n{length}-token prefills, {rounds} each | p50 ms | min ms | p50 over plain")
    for k, xs in times.items():
        print(f"{k} | {statistics.median(xs):.2f} | {min(xs):.2f} | {statistics.median(xs) - plain:+.2f}")


if __name__ == "__main__":
    main()
