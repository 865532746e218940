"""What checkpoint streaming costs a vLLM engine in steady state: the same requests with the
connector's checkpointing on and off, no kill. Two kvd daemons with data ports, each in the
other's peer table (node 1 serves the engine, node 2 holds the checkpoints), and one vLLM engine
(``vllm.LLM``, CPU build, the tests' tiny model in float32, scheduler and worker in one process)
stepped by hand, so every connector call is on the decode path and each token's arrival is seen.

    KVD_BIN=target/debug/kvd <engine venv>/bin/python benches/python/checkpoint_steady.py \
        [ROUNDS] [CONCURRENCY] [PROMPT_TOKENS] [OUTPUT_TOKENS]     (defaults 4, 1, 1000, 300)
        [--layers N] [--hidden H]   the model (defaults: the tests' tiny model, 2 layers, hidden
                                    128; the LUMEN experiment's is --layers 16 --hidden 256)

Each round runs a batch of CONCURRENCY requests with checkpoints on and one with them off (fresh
prompts each batch, so no prefix hits; the order alternates with the round). Per mode: TTFT,
TPOT (a request's mean gap between its tokens after the first) and the decode rate (tokens per
second of a batch from its first token to its last), medians over the rounds with their spread;
and the connector's own time per engine step, scheduler side (``get_num_new_matched_tokens`` ..
``update_connector_output``) and worker side (``start_load_kv`` .. ``get_finished``), p50 and
p99 over every step of the mode; the connector's share of the engine's step time (both sides, summed
over the mode's steps: what checkpointing adds to the decode thread, free of the rounds' spread);
and the per-round TPOT ratios' mean with its 95 % t interval. Set ``KVD_LIBKVD``/``PYTHONPATH`` to test another copy of the
package (the engine logs the ``kvd`` it imported).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from lumen_stats import mean_ci  # noqa: E402 (the experiment's intervals, one implementation)
ENGINES = HERE.parent.parent / "tests" / "engines"
BLOCK = 32
SCHED_CALLS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
               "update_connector_output", "request_finished")
WORKER_CALLS = ("start_load_kv", "wait_for_save", "get_finished", "get_transfer_results",
                "build_connector_worker_meta")


def words(start: int, n: int, step: int) -> str:
    return " ".join(f"w{(start + i * step) % 2000}" for i in range(n))


def pct(xs: list[float], q: int) -> float:
    if len(xs) < 2:
        return xs[0] if xs else float("nan")
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1]


class _Timer:
    """Sums the time of a connector's calls per engine step."""

    def __init__(self, conn, names: tuple[str, ...]) -> None:
        self.acc, self.loads, self.by = 0.0, False, {}
        for name in names:
            inner = getattr(conn, name, None)
            if inner is not None:
                setattr(conn, name, self._wrap(inner))

    def _wrap(self, inner):
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                r = inner(*a, **kw)
                if getattr(r, "loads", None):
                    self.loads = True
                return r
            finally:
                d = time.perf_counter() - t
                self.acc += d
                self.by[inner.__name__] = self.by.get(inner.__name__, 0.0) + d * 1e6
        return timed

    def take(self) -> float:
        v, self.acc, self.by = self.acc, 0.0, {}
        return v


class _Calls:
    """Counts and times a kvd client's calls (which are daemon round trips, which local)."""

    def __init__(self, client, prefix: str) -> None:
        self.calls: dict[str, list[float]] = {}
        for name in dir(client):
            if name.startswith("_") or name in ("close", "view"):
                continue
            inner = getattr(client, name)
            if callable(inner):
                setattr(client, name, self._wrap(f"{prefix}.{name}", inner))

    def _wrap(self, name: str, inner):
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                c = self.calls.setdefault(name, [0, 0.0])
                c[0] += 1
                c[1] += (time.perf_counter() - t) * 1e6
        return timed

    def take(self) -> dict[str, list[float]]:
        v, self.calls = self.calls, {}
        return v


def engine(spec_path: str, out_path: str) -> None:
    """The engine process: runs the batches the spec lists and writes what it saw."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    spec = json.loads(Path(spec_path).read_text())
    import kvd
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    print(f"kvd package: {kvd.__file__}", flush=True)
    llm = LLM(model=spec["model"], dtype="float32", seed=0, max_model_len=2048, block_size=BLOCK,
              enforce_eager=True, max_num_seqs=16, enable_prefix_caching=True,
              kv_transfer_config=spec["connector"])
    eng = llm.llm_engine
    sched = eng.engine_core.engine_core.scheduler
    st, wt = _Timer(sched.connector, SCHED_CALLS), _Timer(get_kv_transfer_group(), WORKER_CALLS)
    worker = get_kv_transfer_group()
    calls = [_Calls(sched.connector.client, "sched"), _Calls(worker.client, "worker")]
    results = []
    for b in spec["batches"]:
        if b.get("reset_prefix_cache"):
            assert llm.reset_prefix_cache()
        before = dict(worker.totals.data)
        rids, t_add, times = [], {}, {}
        for i, prompt in enumerate(b["prompts"]):
            extra = None
            if b["checkpoint"]:
                extra = {"kv_transfer_params": {"kvd": {"checkpoint": {
                    "holder": 2, "request": b["request_base"] + i, "epoch": 1}}}}
            sp = SamplingParams(temperature=0.0, max_tokens=b.get("output", spec["output"]), ignore_eos=True,
                                extra_args=extra)
            rid = f"{b['name']}-{i}"
            rids.append(rid)
            t_add[rid] = time.perf_counter()
            times[rid] = []
            eng.add_request(rid, prompt, sp)
        steps, seen, tokens = [], {r: 0 for r in rids}, {}
        st.take(), wt.take()
        for c in calls:
            c.take()
        for _ in range(100_000):  # bounded: a few hundred steps per batch
            if not eng.has_unfinished_requests():
                break
            t0 = time.perf_counter()
            outs = eng.step()
            now = time.perf_counter()
            if st.loads:  # what the scheduler's connector did in a step with a load
                print("load step:", {k: round(v) for k, v in st.by.items()},
                      {k: [n, round(us)] for k, (n, us) in calls[0].calls.items()}, flush=True)
            steps.append({"step_us": (now - t0) * 1e6, "sched_us": st.take() * 1e6, "worker_us": wt.take() * 1e6,
                          "load": st.loads})
            st.loads = False
            for o in outs:
                n = len(o.outputs[0].token_ids) if o.outputs else 0
                times[o.request_id] += [now] * (n - seen[o.request_id])
                seen[o.request_id] = n
                if o.finished:
                    tokens[o.request_id] = list(o.outputs[0].token_ids)
        worker.flush() if hasattr(worker, "flush") else None
        after = dict(worker.totals.data)
        client_calls = {k: v for c in calls for k, v in c.take().items()}
        results.append({"name": b["name"], "checkpoint": b["checkpoint"], "steps": steps, "calls": client_calls,
                        "requests": [{"t_add": t_add[r], "times": times[r], "tokens": tokens.get(r, [])} for r in rids],
                        "stats": {k: after.get(k, 0) - before.get(k, 0) for k in after}})
    Path(out_path).write_text(json.dumps(results))
    os._exit(0)


def summarize(batches: list[dict]) -> dict:
    ttft, tpot, rate, sched, work, step = [], [], [], [], [], []
    per_round: dict[str, list[float]] = {"ttft": [], "tpot": [], "rate": []}
    for b in batches:
        reqs = b["requests"]
        t = [r["times"][0] - r["t_add"] for r in reqs]
        p = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in reqs]
        first = min(r["times"][0] for r in reqs)
        last = max(r["times"][-1] for r in reqs)
        n = sum(len(r["times"]) - 1 for r in reqs)
        per_round["ttft"].append(statistics.median(t))
        per_round["tpot"].append(statistics.median(p))
        per_round["rate"].append(n / (last - first))
        ttft += t
        tpot += p
        rate.append(n / (last - first))
        decode = [s for s in b["steps"]]
        sched += [s["sched_us"] for s in decode]
        work += [s["worker_us"] for s in decode]
        step += [s["step_us"] for s in decode]
    return {"per_round": per_round, "sched": sched, "worker": work, "step": step}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--engine":
        engine(sys.argv[2], sys.argv[3])
        return
    import argparse
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rounds", type=int, nargs="?", default=4, help="rounds, each one batch on and one off (4)")
    ap.add_argument("concurrency", type=int, nargs="?", default=1, help="requests per batch (1)")
    ap.add_argument("prompt_tokens", type=int, nargs="?", default=1000, help="prompt tokens (1000)")
    ap.add_argument("output", type=int, nargs="?", default=300, help="tokens out per request (300)")
    ap.add_argument("--layers", type=int, default=2, help="the model's decoder layers (2)")
    ap.add_argument("--hidden", type=int, default=128, help="the model's hidden size (128)")
    ap.add_argument("--cpu-wake-latency-us", type=int, default=None, metavar="US",
                    help="start the daemons with this --cpu-wake-latency-us (default: off, as kvd serve)")
    args = ap.parse_args()
    if not 1 <= args.rounds <= 64 or not 1 <= args.concurrency <= 16 or not 1 <= args.output <= 1500 \
            or not 32 <= args.prompt_tokens <= 1900:
        raise SystemExit("rounds 1-64, concurrency 1-16, prompt 32-1900 tokens, output 1-1500 tokens")
    rounds, conc, prompt_tokens, output = args.rounds, args.concurrency, args.prompt_tokens, args.output
    sys.path.insert(0, str(ENGINES))
    from kvd_daemon import Daemon, peers_file, write_peers  # noqa: E402 (needs KVD_BIN)

    tmp = Path(tempfile.mkdtemp(prefix="kvd-bench-ckpt-"))
    model = tmp / "model"
    subprocess.run([sys.executable, str(ENGINES / "make_tiny_model.py"), str(model), "--layers", str(args.layers),
                    "--hidden", str(args.hidden)], check=True, capture_output=True)
    secret = tmp / "secret"
    secret.write_bytes(bytes(range(32)))
    secret.chmod(0o600)
    peers = peers_file(tmp / "peers")
    import socket as so
    socks = [so.socket() for _ in range(2)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    block_kib = args.layers * 2 * 2 * 32 * 4 * BLOCK // 1024  # K and V, 2 KV heads of 32, float32
    page_kib = max(64, block_kib)
    pool_mib = max(256, 4 * page_kib)  # room for a thousand blocks
    nodes = {i: Daemon(["--cluster-secret-file", str(secret), "--data-listen", f"127.0.0.1:{ports[i - 1]}",
                        "--node-id", str(i), "--pool-mib", str(pool_mib), "--page-kib", str(page_kib), "--peers-file", str(peers)]
                        + (["--cpu-wake-latency-us", str(args.cpu_wake_latency_us)]
                           if args.cpu_wake_latency_us is not None else []))
             for i in (1, 2)}
    try:
        write_peers(peers, nodes)
        time.sleep(2)  # each daemon reads the peers file again within a second
        batches, k = [], 0
        for r in range(rounds):
            for mode in ((True, False) if r % 2 == 0 else (False, True)):
                prompts = [words(1 + 97 * k + 13 * i, prompt_tokens, 7 + 2 * ((k + i) % 40)) for i in range(conc)]
                batches.append({"name": f"r{r}-{'on' if mode else 'off'}", "checkpoint": mode, "prompts": prompts,
                                "request_base": 1000 * (k + 1)})
                k += 1
            # the same prompts again after vLLM's prefix cache is reset: a kvd hit, loaded
            batches.append({"name": f"r{r}-hit", "checkpoint": None, "prompts": batches[-1]["prompts"],
                            "reset_prefix_cache": True, "output": 8, "request_base": 0})
        conn = {"kv_connector": "KvdConnector", "kv_connector_module_path": "kvd.vllm", "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"socket": nodes[1].socket}}
        spec = {"model": str(model), "connector": conn, "output": output, "batches": batches}
        (tmp / "spec.json").write_text(json.dumps(spec))
        with open(tmp / "engine.log", "wb") as log:
            rc = subprocess.run([sys.executable, __file__, "--engine", str(tmp / "spec.json"), str(tmp / "out.json")],
                                stdout=log, stderr=subprocess.STDOUT, timeout=900).returncode
        if rc != 0:
            print((tmp / "engine.log").read_text(errors="replace")[-4000:])
            raise SystemExit(f"the engine exited {rc}")
        got = json.loads((tmp / "out.json").read_text())
    finally:
        for d in nodes.values():
            d.stop()
    for line in (tmp / "engine.log").read_text(errors="replace").splitlines():
        if line.startswith(("kvd package:", "load step:")):
            print(line)
    hits = [b for b in got if b["checkpoint"] is None]
    got = [b for b in got if b["checkpoint"] is not None]
    on = summarize([b for b in got if b["checkpoint"]])
    off = summarize([b for b in got if not b["checkpoint"]])
    ck = [b["stats"] for b in got if b["checkpoint"]]
    print(f"\n{rounds} rounds, {conc} concurrent request(s), {prompt_tokens}-token prompts, {output} tokens out,"
          f" {args.layers} layers, hidden {args.hidden}")
    print(f"{'what':<34} {'checkpoint on':>26} {'off':>26}  on/off")

    def row(name: str, a: list[float], b: list[float], scale: float, unit: str) -> None:
        ma, mb = statistics.median(a), statistics.median(b)
        fa = f"{ma * scale:.2f} ({min(a) * scale:.2f}-{max(a) * scale:.2f}) {unit}"
        fb = f"{mb * scale:.2f} ({min(b) * scale:.2f}-{max(b) * scale:.2f}) {unit}"
        print(f"{name:<34} {fa:>26} {fb:>26}  {ma / mb:.3f}")

    row("TTFT, median of rounds", on["per_round"]["ttft"], off["per_round"]["ttft"], 1e3, "ms")
    row("TPOT, median of rounds", on["per_round"]["tpot"], off["per_round"]["tpot"], 1e3, "ms")
    row("decode rate, median of rounds", on["per_round"]["rate"], off["per_round"]["rate"], 1, "tok/s")
    for what in ("sched", "worker", "step"):
        print(f"{what + ' us/step p50 / p99':<34} {pct(on[what], 50):>12.0f} / {pct(on[what], 99):<11.0f}"
              f" {pct(off[what], 50):>12.0f} / {pct(off[what], 99):<11.0f}")
    load_steps = [s["sched_us"] for b in hits for s in b["steps"] if s["load"]]
    other = [s["sched_us"] for b in hits for s in b["steps"] if not s["load"]]
    loaded = [b["stats"].get("loaded_blocks", 0) for b in hits]
    print(f"{'sched us/step with a load':<34} {pct(load_steps, 50):>12.0f} / {pct(load_steps, 99):<11.0f}"
          f" ({len(load_steps)} steps; blocks loaded per batch {loaded}; the other steps of those batches p50"
          f" {pct(other, 50):.0f})")
    pairs = [(a, b) for a, b in zip([b for b in got if b["checkpoint"]], [b for b in got if not b["checkpoint"]])]
    ratios = []
    for a, b in pairs:
        ra = summarize([a])["per_round"]["tpot"][0]
        rb = summarize([b])["per_round"]["tpot"][0]
        ratios.append(ra / rb)
    print("TPOT on/off per round:", " ".join(f"{x:.3f}" for x in ratios))
    m, half, n = mean_ci(ratios)
    if half is not None:
        print(f"TPOT on/off, mean of rounds: {m:.3f} ± {half:.3f} (95 % t interval over {n} rounds)")
    for mode, s_ in (("on", on), ("off", off)):
        sched, work, total = sum(s_["sched"]), sum(s_["worker"]), sum(s_["step"])
        print(f"connector's share of step time, checkpoint {mode}: {100 * (sched + work) / total:.2f} %"
              f" (scheduler {100 * sched / total:.2f} %, worker {100 * work / total:.2f} %)")
    tot = {k: sum(s.get(k, 0) for s in ck) for k in ("checkpoint_blocks", "checkpoint_deferred", "checkpoint_dropped",
                                                     "checkpoint_failed", "checkpoint_skipped", "saved_blocks", "save_us")}
    print("checkpoint figures (on batches):", json.dumps(tot))
    for mode in (True, False):
        agg: dict[str, list[float]] = {}
        nsteps = sum(len(b["steps"]) for b in got if b["checkpoint"] == mode)
        for b in got:
            if b["checkpoint"] == mode:
                for k, (n, us) in b["calls"].items():
                    a = agg.setdefault(k, [0, 0.0])
                    a[0] += n
                    a[1] += us
        print(f"client calls on the engine thread, checkpoint {'on' if mode else 'off'} ({nsteps} steps):",
              ", ".join(f"{k} {int(n)}x {us / max(n, 1):.0f}us" for k, (n, us) in sorted(agg.items())))
    (tmp / "summary.json").write_text(json.dumps({"on": on["per_round"], "off": off["per_round"], "ratios": ratios}))
    print(f"(raw: {tmp}/out.json)")


if __name__ == "__main__":
    main()
