"""Prefill on one vLLM server, decode on another, through kvd, beside colocated serving and
beside vLLM's own NixlConnector: the same tiny model, prompts and proxy, in one sitting.

    scripts/bench-pd.sh [ROUNDS] [LENGTHS]      (defaults 20 and 256,1024,2000)

Engines (vLLM's CPU build, the tiny model, float32): a plain server (colocated: no connector),
a kvd pair (``kv_producer`` on node 1's daemon, ``kv_consumer`` on node 2's; the daemons are
each other's peers) and, when ``nixl`` is importable, a NIXL pair (``NixlConnector``,
``kv_buffer_device: cpu``, UCX over TCP on loopback). The proxy is vLLM's toy P/D proxy's
contract: the prefill request carries ``do_remote_decode`` and ``max_tokens`` 1, its response's
``kv_transfer_params`` go unchanged into the streamed decode request.

Per prompt length and round, one fresh prompt (no engine has seen it) goes to every
configuration, in an order that rotates with the round: time to first token at the client
(TTFT), for P/D also the prefill's answer time and the hand-off (prefill's answer to the
decode's first token). For kvd the decode node's daemon's fetch bytes and fetch seconds give the
hand-off's transfer rate. Every P/D output must equal the colocated output of the same prompt.

The bound, per length: colocated TTFT + bytes ÷ (0.9 × R) + 5 ms, with R the fetch rate of
``kvd-bench remote`` for the same block size and blocks per transfer, one in flight, measured
in the same sitting (``--remote-gbps``, passed in by the script).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
ENGINES = HERE.parent.parent / "tests" / "engines"
sys.path.insert(0, str(ENGINES))

from test_stream_recovery import free_port, get_text, metric  # noqa: E402
from test_vllm import connector  # noqa: E402
from test_vllm_checkpoint import peer_daemons, tiny_model  # noqa: E402
from vllm_server import SERVED_NAME, VllmServer  # noqa: E402

BLOCK = 32  # tokens per block (vllm_server.py's --block-size)


def cpu(core: int) -> dict[str, str]:
    """Each engine computes on one core of its own kind (prefill and colocated engines on core 0,
    decode engines on core 1; vLLM's CPU backend binds its OpenMP threads to one core by
    default, the same one for every engine), and no engine's threads spin after their work
    (OpenMP's active wait would take the core from the next engine to compute)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": str(core), "OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
MAX_TOKENS = 4


def prompt_of(length: int, seed: int) -> list[int]:
    """A fresh prompt of ``length`` token ids (ids below the tiny model's vocabulary)."""
    return [(seed * 7919 + i * 104_729) % 1000 + 5 for i in range(length)]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def stream(url: str, body: dict) -> tuple[float, list[int]]:
    """Stream ``body``; (seconds to the first token, every token id)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(dict(body, stream=True)),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    first: Optional[float] = None
    tokens: list[int] = []
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        ids = json.loads(line[5:])["choices"][0].get("token_ids") or []
        if ids and first is None:
            first = time.perf_counter() - t0
        tokens += ids
    conn.close()
    assert first is not None, "no token"
    return first, tokens


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
    first, tokens = stream(decode.url, dec)
    return {"ttft": t1 - t0 + first, "prefill": t1 - t0, "handoff": first, "tokens": tokens,
            "handed": bool(params)}


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
        env = {**cpu(core), "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo",
               "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
        out.append(VllmServer(model, free_port(), tmp / f"{name}.log", conf, extra_env=env))
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--lengths", default="256,1024,2000")
    ap.add_argument("--remote-gbps", type=json.loads, default={},
                    help='kvd-bench remote fetch GB/s per length, e.g. {"256": 0.5}')
    ap.add_argument("--nixl", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="kvd-bench-pd-"))
    nodes = peer_daemons(tmp, 2)
    model = tiny_model(tmp)
    servers: dict[str, VllmServer] = {
        "colocated": VllmServer(model, free_port(), tmp / "plain.log", None, extra_env=cpu(0)),
        "kvd-prefill": VllmServer(model, free_port(), tmp / "kvd-prefill.log",
                                  dict(connector(nodes[1].socket, node_id=1), kv_role="kv_producer"),
                                  extra_env=cpu(0)),
        "kvd-decode": VllmServer(model, free_port(), tmp / "kvd-decode.log",
                                 dict(connector(nodes[2].socket, node_id=2), kv_role="kv_consumer"),
                                 extra_env=cpu(1)),
    }
    pair = nixl_pair(tmp, model) if args.nixl else None
    if pair:
        servers["nixl-prefill"], servers["nixl-decode"] = pair
    figures: dict[str, Any] = {"lengths": {}}
    try:
        for s in servers.values():
            s.start()
        for s in servers.values():
            s.wait_ready(900)
        print(f"{len(servers)} engines up; logs in {tmp}", file=sys.stderr, flush=True)
        # one warm-up request per configuration (first-request costs are not the figure)
        warm = prompt_of(300, 999_999)
        stream(servers["colocated"].url, body(warm))
        pd(servers["kvd-prefill"], servers["kvd-decode"], warm)
        if pair:
            pd(*pair, warm)
        for length in lengths:
            figures["lengths"][str(length)] = run_length(args, length, servers, nodes, pair)
    finally:
        for s in servers.values():
            s.stop()
        for d in nodes.values():
            d.stop()
        if os.environ.get("KVD_KEEP_LOGS") is None:
            shutil.rmtree(tmp, ignore_errors=True)
    report(figures, args)


def run_length(args, length: int, servers: dict[str, VllmServer], nodes, pair) -> dict[str, Any]:
    modes = ["colocated", "kvd"] + (["nixl"] if pair else [])
    got: dict[str, dict[str, list[float]]] = {m: {"ttft": [], "prefill": [], "handoff": []} for m in modes}
    rates, bytes_per, wrong = [], [], {m: 0 for m in modes}
    for r in range(args.rounds):
        prompt = prompt_of(length, length * 1000 + r)
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        out: dict[str, Any] = {}
        for m in order:
            if m == "colocated":
                t, tokens = stream(servers["colocated"].url, body(prompt))
                out[m] = {"ttft": t, "tokens": tokens}
            elif m == "kvd":
                b0, s0 = fetch_figures(nodes[2])
                out[m] = pd(servers["kvd-prefill"], servers["kvd-decode"], prompt)
                b1, s1 = fetch_figures(nodes[2])
                if b1 > b0 and s1 > s0:
                    rates.append((b1 - b0) / (s1 - s0) / 1e9)
                    bytes_per.append(b1 - b0)
            else:
                out[m] = pd(pair[0], pair[1], prompt)
        for m in modes:
            for k in ("ttft", "prefill", "handoff"):
                if k in out[m]:
                    got[m][k].append(out[m][k])
            if out[m]["tokens"] != out["colocated"]["tokens"]:
                wrong[m] += 1
        print(f"{length} tokens, round {r + 1}/{args.rounds}: " + ", ".join(
            f"{m} {out[m]['ttft'] * 1000:.1f} ms" for m in modes), file=sys.stderr, flush=True)
    res: dict[str, Any] = {"wrong_outputs": wrong}
    for m in modes:
        for k, xs in got[m].items():
            if xs:
                res[f"{m}_{k}_p50_ms"] = round(pct(xs, 50) * 1000, 2)
                res[f"{m}_{k}_p99_ms"] = round(pct(xs, 99) * 1000, 2)
    if rates:
        res["kvd_handoff_gbps_p50"] = round(pct(rates, 50), 3)
        res["kvd_handoff_bytes"] = int(statistics.median(bytes_per))
    remote = args.remote_gbps.get(str(length))
    if remote and bytes_per:
        res["remote_gbps"] = remote
        res["handoff_vs_remote"] = round(res["kvd_handoff_gbps_p50"] / remote, 3)
        slack_ms = statistics.median(bytes_per) / (0.9 * remote * 1e9) * 1000 + 5
        for q in (50, 99):
            bound = res[f"colocated_ttft_p{q}_ms"] + slack_ms
            res[f"bound_p{q}_ms"] = round(bound, 2)
            res[f"kvd_within_bound_p{q}"] = res[f"kvd_ttft_p{q}_ms"] <= bound
    res["kvd_handoff_share_p50"] = round(res["kvd_handoff_p50_ms"] / res["kvd_ttft_p50_ms"], 3)
    return res


def report(figures: dict[str, Any], args) -> None:
    print(json.dumps(figures, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))
    rows = []
    for length, r in figures["lengths"].items():
        rows.append((length, r.get("colocated_ttft_p50_ms"), r.get("kvd_ttft_p50_ms"), r.get("kvd_ttft_p99_ms"),
                     r.get("bound_p50_ms"), r.get("kvd_handoff_p50_ms"), r.get("nixl_ttft_p50_ms"),
                     r.get("handoff_vs_remote")))
    print("\nprompt | colocated p50 | kvd P/D p50 | kvd P/D p99 | bound p50 | hand-off p50 | NIXL P/D p50 | rate ÷ remote")
    for row in rows:
        print(" | ".join("-" if v is None else str(v) for v in row))


if __name__ == "__main__":
    main()
