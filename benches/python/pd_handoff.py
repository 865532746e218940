"""Prefill on one vLLM server, decode on another, through kvd, beside colocated serving and
beside vLLM's own NixlConnector: the same tiny model, prompts and engines, in one sitting.

    scripts/bench-pd.sh [ROUNDS] [LENGTHS] [NIXL_ROUNDS]      (defaults 20, 256,1024,2000, 5)

Engines (vLLM's CPU build, the tiny model, float32, one core each: prefill and colocated
engines on core 0, decode engines on core 1): a plain server (colocated: no connector), a kvd
pair (``kv_producer`` on node 1's daemon, ``kv_consumer`` on node 2's; the daemons in cluster
mode on a real etcd, each the other's peer through it, at nice -10 so that the engines' spinning
workers do not starve them on two cores) and, when ``nixl`` is importable, a NIXL pair
(``NixlConnector``, ``kv_buffer_device: cpu``, UCX over TCP on loopback).

The kvd pair is driven two ways, each with its own fresh prompts: ``kvd``, by the proxy of
vLLM's toy P/D proxy's contract (the prefill request carries ``do_remote_decode`` and
``max_tokens`` 1, its response's ``kv_transfer_params`` go unchanged into the streamed decode
request; the client's first token is the decode's), and ``kvd-front``, through ``kvd control``'s
front in P/D mode (``--prefill-engine 1=... --engine 2=...``, checkpoints off: the figure is the
hand-off's), which relays the prefill's token to the client at once and has the decode continue
from prompt + that token. The NIXL pair is driven by the proxy.

Two phases, one per pair, each beside the colocated engine (the other pair is stopped: an idle
NIXL engine keeps a core busy here, which the figures report). Per prompt length, round and
mode, one fresh prompt (no engine has seen it) goes to the colocated engine and to the mode, in
an order that alternates with the round, each request starting ``SETTLE_S`` after the last
ended: time to the first and second tokens at the client; for P/D also the prefill's answer time
and the hand-off (prefill's answer to the decode's first token), and the decode engine's floor
(the same prompt again, its KV now in the engine's own prefix cache). For kvd the decode node's
daemon's fetch bytes and fetch timer give the hand-off's transfer rate. Every P/D output must
equal the colocated output of the same prompt.

The bound, per length: colocated TTFT + bytes ÷ (0.9 × R) + 5 ms, with R the fetch rate of
``kvd-bench remote`` for the same block size and blocks per transfer, one in flight, each
fetch after 1 s idle (as a hand-off comes), by the fetching daemon's own timer, measured in the
same sitting (``--remote-gbps``, passed in by the script; back to back: ``--remote-warm-gbps``,
reported beside).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
ENGINES = HERE.parent.parent / "tests" / "engines"
sys.path.insert(0, str(ENGINES))

from kvd_daemon import Daemon, wait_until  # noqa: E402
from test_stream_recovery import (Etcd, Front, cluster_folder, free_port, get_text, metric,  # noqa: E402
                                  stop_cluster)
from test_vllm import connector  # noqa: E402
from vllm_server import SERVED_NAME, VllmServer  # noqa: E402

BLOCK = 32  # tokens per block (vllm_server.py's --block-size)
# vLLM's workers busy-loop on their input queue for 1 s after their last step
# (shm_broadcast.SpinCondition's busy_loop_s): on two cores, a request started within that
# second of another engine's shares the CPU with it. Every timed request starts this long after
# the last one ended, whatever its configuration.
SETTLE_S = 1.3


def cpu(core: int) -> dict[str, str]:
    """An engine computes on one core (prefill and colocated engines on core 0, decode engines on
    core 1; vLLM's CPU backend binds its OpenMP threads to one core by default, the same one
    for every engine), and no engine's threads spin after their work (OpenMP's active wait
    would take the core from the next engine to compute)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": str(core), "OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}


class Engine(VllmServer):
    """A vLLM server whose every process runs on one core, as if the engine had a machine of
    its own: vLLM's worker busy-polls its input queue for a second after each step, and on a
    shared core that would slow whichever engine computes next (the decode, in P/D)."""

    def __init__(self, core: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.core = core
        self.extra_env.update(cpu(core))

    def command(self) -> list[str]:
        return ["taskset", "-c", str(self.core), *super().command()]
MAX_TOKENS = 4


def prompt_of(length: int, seed: int) -> list[int]:
    """A fresh prompt of ``length`` token ids (ids below the tiny model's vocabulary): no two
    seeds share a first block, so no prompt is a prefix hit of another anywhere."""
    rng = random.Random(seed)
    return [rng.randrange(5, 1005) for _ in range(length)]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def stream(url: str, body: dict) -> tuple[float, list[int], float]:
    """Stream ``body``; (seconds to the first token, every token id, seconds to the second)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(dict(body, stream=True)),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    arrivals: list[float] = []
    tokens: list[int] = []
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        event = json.loads(line[5:])
        assert "error" not in event, event
        ids = event["choices"][0].get("token_ids") or []
        arrivals += [time.perf_counter() - t0] * len(ids)
        tokens += ids
    conn.close()
    assert len(arrivals) >= 2, "fewer than two tokens"
    return arrivals[0], tokens, arrivals[1]


def body(prompt: list[int]) -> dict:
    return {"model": SERVED_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}


def pd(prefill: VllmServer, decode: VllmServer, prompt: list[int]) -> dict:
    """The toy proxy: (TTFT, prefill answer, hand-off, tokens), seconds."""
    t0 = time.perf_counter()
    pre = dict(body(prompt), max_tokens=1, stream=False, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None})
    params = post(prefill.url, pre).get("kv_transfer_params")
    t1 = time.perf_counter()
    dec = body(prompt)
    if params:
        dec["kv_transfer_params"] = params
    first, tokens, second = stream(decode.url, dec)
    return {"ttft": t1 - t0 + first, "prefill": t1 - t0, "handoff": first, "tokens": tokens,
            "second": t1 - t0 + second, "handed": bool(params)}


def through_front(front: Front, prompt: list[int]) -> dict:
    """The same request through ``kvd control``'s front in P/D mode (no checkpoint: the figure is
    the hand-off's): TTFT, time to the second token (the decode's first), and the hand-off as
    the front measured it (the prefill's answer to the decode's first token)."""
    ttft, tokens, second = stream(f"http://{front.addr}", dict(body(prompt), kvd={"checkpoint": False}))
    h = front.get("/status")["handoffs"][-1]
    return {"ttft": ttft, "second": second, "prefill": h["prefill_ms"] / 1000,
            "handoff": h["handoff_ms"] / 1000, "tokens": tokens}


def nice_daemon(d: Daemon, niceness: int = -10) -> None:
    """Every thread of a daemon gets ``niceness``: on two cores whose engines busy-poll (vLLM's
    worker spins a second after each step), the daemon gets the CPU as it would on a node where
    it is not squeezed between two engines' spinning threads."""
    for task in Path(f"/proc/{d.proc.pid}/task").iterdir():
        os.setpriority(os.PRIO_PROCESS, int(task.name), niceness)


def cluster_daemons(secret: Path, etcd: Etcd, pool_mib: int = 64, page_kib: int = 64,
                    ids: tuple[int, ...] = (1, 2)) -> dict[int, Daemon]:
    """Daemons 1 (the prefill node's) and 2 (the decode node's), or ``ids``, in cluster mode:
    registered in etcd, each the others' peer through it, as ``kvd control``'s front needs them."""
    nodes = {i: Daemon(["--cluster-secret-file", str(secret), "--data-listen", f"127.0.0.1:{free_port()}",
                        "--node-id", str(i), "--etcd", etcd.url, "--pool-mib", str(pool_mib),
                        "--page-kib", str(page_kib)])
             for i in ids}
    for d in nodes.values():
        nice_daemon(d)
    return nodes


def pct(xs: list[float], q: int) -> float:
    return xs[0] if len(xs) == 1 else statistics.quantiles(xs, n=100, method="inclusive")[q - 1]


def fetch_figures(d) -> tuple[float, float]:
    text = get_text(f"http://{d.admin}/metrics")
    return (metric(text, "kvd_transfer_bytes_received_total"),
            metric(text, "kvd_transfer_duration_seconds_sum", kind="fetch"))


def nixl_pair(tmp: Path, model: Path) -> Optional[tuple[VllmServer, VllmServer]]:
    try:
        import nixl  # noqa: F401
    except ImportError as e:
        print(f"NIXL not importable ({e}): its rows are left out", file=sys.stderr)
        return None
    conf = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    out = []
    for core, name in enumerate(("nixl-prefill", "nixl-decode")):
        env = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo",
               "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
        out.append(Engine(core, model, free_port(), tmp / f"{name}.log", conf, extra_env=env))
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--lengths", default="256,1024,2000")
    ap.add_argument("--remote-gbps", type=json.loads, default={},
                    help='kvd-bench remote fetch GB/s per length, e.g. {"256": 0.5}')
    ap.add_argument("--remote-warm-gbps", type=json.loads, default={},
                    help="the same, back to back (reported beside)")
    ap.add_argument("--nixl", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--nixl-rounds", type=int, default=5,
                    help="rounds per length of the NIXL phase (its hand-offs take long here)")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    tmp, model, secret = cluster_folder("kvd-bench-pd-")
    etcd = Etcd(tmp)
    nodes = cluster_daemons(secret, etcd)
    plain = Engine(0, model, free_port(), tmp / "plain.log", None)
    kvd = (Engine(0, model, free_port(), tmp / "kvd-prefill.log",
                  dict(connector(nodes[1].socket, node_id=1), kv_role="kv_producer")),
           Engine(1, model, free_port(), tmp / "kvd-decode.log",
                  dict(connector(nodes[2].socket, node_id=2), kv_role="kv_consumer")))
    nixl = nixl_pair(tmp, model) if args.nixl else None
    figures: dict[str, Any] = {"kvd": {}, "nixl": {}, "idle_cpu_percent": {}}
    every = [plain, *kvd, *(nixl or ())]
    front: Optional[Front] = None
    try:
        # one phase per P/D pair, each beside the colocated engine: the other pair is not
        # running (an idle NIXL engine keeps a core busy here: see idle_cpu_percent)
        for name, pair, rounds in (("kvd", kvd, args.rounds), ("nixl", nixl, args.nixl_rounds)):
            if pair is None or rounds == 0:
                continue
            for srv in (plain, *pair):
                if not srv.alive():
                    srv.start()
            for srv in (plain, *pair):
                srv.wait_ready(900)
            modes: dict[str, Any] = {name: lambda p, pair=pair: pd(pair[0], pair[1], p)}
            if name == "kvd":
                # the same engines behind kvd control's front in P/D mode
                front = Front(tmp, etcd, {2: SimpleNamespace(i=2, url=pair[1].url)},
                              prefill={1: SimpleNamespace(i=1, url=pair[0].url)})
                wait_until("the decode worker in service", lambda: 2 in front.in_service(), timeout_s=60)
                modes["kvd-front"] = lambda p, front=front: through_front(front, p)
            print(f"{name} phase: engines up; logs in {tmp}", file=sys.stderr, flush=True)
            figures["idle_cpu_percent"][name] = idle_cpu({"colocated": plain, "prefill": pair[0], "decode": pair[1]})
            for k, run in enumerate(modes.values()):  # first-request costs are not the figure
                warm = prompt_of(300, 999_999 + len(name) + k)
                stream(plain.url, body(warm))
                run(warm)
            for length in lengths:
                figures[name][str(length)] = run_length(args, length, rounds, plain, modes, pair[1],
                                                        nodes[2] if name == "kvd" else None)
            if name == "kvd":  # every hold ended by its decode: none released unread, none reused
                text = get_text(f"http://{nodes[1].admin}/metrics")
                figures["kvd_holds"] = {k: metric(text, f"kvd_handoff_holds_{k}_total")
                                        for k in ("begun", "taken", "ended", "expired")}
                figures["front"] = {k: v for k, v in front.get("/status")["front"].items()
                                    if k in ("handoffs_started", "handoffs_done", "first_tokens_from_prefill",
                                             "self_prefills", "prefill_retries")}
                front.stop()
                front = None
            for srv in pair:
                srv.stop()
    finally:
        for srv in every:
            if srv.alive():
                srv.stop()
        stop_cluster(tmp, front, nodes, etcd)  # type: ignore[arg-type]
    report(figures, args)


def idle_cpu(servers: dict[str, VllmServer], seconds: float = 3.0) -> dict[str, float]:
    """CPU each engine's processes take while no request runs, % of one core."""
    def ticks(pgid: int) -> int:
        total = 0
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                f = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(f[2]) == pgid:  # pgrp
                total += int(f[11]) + int(f[12])  # utime + stime
        return total
    time.sleep(SETTLE_S)
    pgids = {n: s.proc.pid for n, s in servers.items() if s.proc is not None}
    before = {n: ticks(g) for n, g in pgids.items()}
    time.sleep(seconds)
    hz = os.sysconf("SC_CLK_TCK")
    return {n: round((ticks(g) - before[n]) / hz / seconds * 100, 1) for n, g in pgids.items()}


def run_length(args, length: int, rounds: int, plain: VllmServer, modes: dict[str, Any],
               decode: VllmServer, daemon: Optional[Daemon]) -> dict[str, Any]:
    """``rounds`` rounds of one prompt length. Each P/D mode gets its own fresh prompt per round
    (an engine that saw a prompt would serve it from its own prefix cache), sent to the
    colocated engine and to the mode in an order that alternates with the round."""
    got: dict[str, dict[str, list[float]]] = {m: {"ttft": [], "second": [], "prefill": [], "handoff": []}
                                              for m in ("colocated", *modes)}
    rates: dict[str, list[float]] = {m: [] for m in modes}
    bytes_per: dict[str, list[float]] = {m: [] for m in modes}
    wrong = {m: 0 for m in modes}
    floor: list[float] = []
    for r in range(rounds):
        line = []
        for k, (m, run) in enumerate(modes.items()):
            prompt = prompt_of(length, length * 1000 + r + 500 * k + (5000 if m == "nixl" else 0))
            out: dict[str, Any] = {}
            for which in (("colocated", m) if r % 2 == 0 else (m, "colocated")):
                time.sleep(SETTLE_S)
                if which == "colocated":
                    t, tokens, second = stream(plain.url, body(prompt))
                    out[which] = {"ttft": t, "tokens": tokens, "second": second}
                    continue
                if daemon is not None:
                    b0, s0 = fetch_figures(daemon)
                out[which] = run(prompt)
                if daemon is not None:
                    b1, s1 = fetch_figures(daemon)
                    if b1 > b0 and s1 > s0:
                        rates[m].append((b1 - b0) / (s1 - s0) / 1e9)
                        bytes_per[m].append(b1 - b0)
            if k == 0:
                # the decode engine's own floor: the same prompt again, its blocks now in the
                # engine's prefix cache (the last block computed, the first token out): what a
                # hand-off would take if the KV were there already
                time.sleep(SETTLE_S)
                floor.append(stream(decode.url, body(prompt))[0])
            for which in ("colocated", m):
                for f in got[which]:
                    if f in out[which]:
                        got[which][f].append(out[which][f])
            wrong[m] += out[m]["tokens"] != out["colocated"]["tokens"]
            line.append(f"{m} {out[m]['ttft'] * 1000:.1f} ms (colocated {out['colocated']['ttft'] * 1000:.1f})")
        print(f"{length} tokens, round {r + 1}/{rounds}: " + ", ".join(line), file=sys.stderr, flush=True)
    res: dict[str, Any] = {"rounds": rounds, "decode_floor_p50_ms": round(pct(floor, 50) * 1000, 2)}
    for m, fs in got.items():
        row: dict[str, Any] = {}
        for f, xs in fs.items():
            if xs:
                row[f"{f}_p50_ms"] = round(pct(xs, 50) * 1000, 2)
                row[f"{f}_p99_ms"] = round(pct(xs, 99) * 1000, 2)
        res[m] = row
    remote = args.remote_gbps.get(str(length))
    for m in modes:
        row = res[m]
        row["wrong_outputs"] = wrong[m]
        row["handoff_over_floor_p50_ms"] = round(row["handoff_p50_ms"] - res["decode_floor_p50_ms"], 2)
        if rates[m]:
            row["handoff_gbps_p50"] = round(pct(rates[m], 50), 3)
            row["handoff_bytes"] = int(statistics.median(bytes_per[m]))
        if remote and bytes_per[m]:
            row["remote_gbps"] = remote
            row["handoff_vs_remote"] = round(row["handoff_gbps_p50"] / remote, 3)
            warm = args.remote_warm_gbps.get(str(length))
            if warm:
                row["remote_warm_gbps"] = warm
                row["handoff_vs_remote_warm"] = round(row["handoff_gbps_p50"] / warm, 3)
            slack_ms = statistics.median(bytes_per[m]) / (0.9 * remote * 1e9) * 1000 + 5
            for q in (50, 99):
                bound = res["colocated"][f"ttft_p{q}_ms"] + slack_ms
                row[f"bound_p{q}_ms"] = round(bound, 2)
                row[f"within_bound_p{q}"] = row[f"ttft_p{q}_ms"] <= bound
    return res


def report(figures: dict[str, Any], args) -> None:
    print(json.dumps(figures, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))
    print("\nP/D | prompt | colocated TTFT p50/p99 | P/D TTFT p50/p99 | bound p50/p99 | 2nd token p50"
          " (colocated) | prefill p50 | hand-off p50 | decode floor p50 | rate ÷ remote isolated (back to back)"
          " | wrong")
    for phase in ("kvd", "nixl"):
        for length, r in figures[phase].items():
            c = r["colocated"]
            for m, row in r.items():
                if not isinstance(row, dict) or m == "colocated":
                    continue

                def two(k: str, row: dict = row) -> str:
                    a, b = row.get(f"{k}_p50_ms"), row.get(f"{k}_p99_ms")
                    return "-" if a is None else f"{a}/{b}"
                print(" | ".join([m, length, two("ttft", c), two("ttft"), two("bound"),
                                  f"{row.get('second_p50_ms')} ({c.get('second_p50_ms')})",
                                  str(row.get("prefill_p50_ms")), str(row.get("handoff_p50_ms")),
                                  str(r["decode_floor_p50_ms"]),
                                  f"{row.get('handoff_vs_remote', '-')} ({row.get('handoff_vs_remote_warm', '-')})",
                                  str(row["wrong_outputs"])]))
    print("idle CPU, % of a core:", figures["idle_cpu_percent"])
    print("kvd's hand-off holds at the prefill node:", figures.get("kvd_holds"))


if __name__ == "__main__":
    main()
