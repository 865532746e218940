"""kvd under a real vLLM (CPU build, the tiny model): time to first token of a long prompt in
a fresh engine, recomputed against loaded from kvd, and the connector's own time per scheduler
step, with and without hits. Rounds alternate the order of the plain and the loading engine.

    scripts/bench-vllm.sh [ROUNDS]      (builds, starts a daemon, runs this with the engine venv)

Each round: a plain engine (no connector) runs the prompt; an engine with the connector stores
it (a miss: its steps are the "without hits" sample); a fresh engine with the connector loads it
(the "with hits" sample). Only the first request of each fresh engine is timed.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENGINES = HERE.parent.parent / "tests" / "engines"


def run(tmp: Path, name: str, model: str, prompt: str, conn: dict | None) -> dict:
    spec = {"model": model, "connector": conn, "block_size": 32,
            "steps": [{"name": "long", "prompts": [prompt], "max_tokens": 8, "timed": True}]}
    (tmp / f"{name}.json").write_text(json.dumps(spec))
    with open(tmp / f"{name}.log", "wb") as log:
        subprocess.run([sys.executable, str(ENGINES / "vllm_scenario.py"), str(tmp / f"{name}.json"),
                        str(tmp / name)], check=True, stdout=log, stderr=subprocess.STDOUT, timeout=900)
    return json.loads((tmp / name / "results.json").read_text())


def pct(xs: list[float], q: int) -> float:
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1]


def main() -> None:
    socket, rounds, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tmp = Path(tempfile.mkdtemp(prefix="kvd-bench-vllm-"))
    model = str(tmp / "model")
    subprocess.run([sys.executable, str(ENGINES / "make_tiny_model.py"), model], check=True, capture_output=True)
    conn = {"kv_connector": "KvdConnector", "kv_connector_module_path": "kvd.vllm", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"socket": socket}}
    plain, hit, loaded, miss_steps, hit_steps, load_us = [], [], [], [], [], []
    for r in range(rounds):
        prompt = " ".join(f"w{(r * 101 + i * 13) % 2000}" for i in range(tokens))  # new each round
        print(f"round {r + 1}/{rounds}: plain, storing and loading engines ...", file=sys.stderr, flush=True)
        order = ["plain", "store"] if r % 2 == 0 else ["store", "plain"]
        got = {n: run(tmp, f"{n}-{r}", model, prompt, None if n == "plain" else conn) for n in order}
        got["load"] = run(tmp, f"load-{r}", model, prompt, conn)
        plain.append(got["plain"]["steps"][0]["outputs"][0]["ttft_s"])
        out = got["load"]["steps"][0]["outputs"][0]
        assert out["tokens"] == got["plain"]["steps"][0]["outputs"][0]["tokens"], "outputs differ"
        hit.append(out["ttft_s"])
        loaded.append(out["cached"])
        miss_steps += [s["us"] for s in got["store"]["sched_step_us"]]
        hit_steps += [s["us"] for s in got["load"]["sched_step_us"] if s["hit"]]
        load_us.append(got["load"]["steps"][0]["stats"]["load_us"])
    rows = [
        ("prompt tokens", f"{tokens}", ""),
        ("TTFT, fresh engine, recomputed (median)", f"{statistics.median(plain) * 1e3:.1f} ms", f"{rounds} runs"),
        ("TTFT, fresh engine, kvd hit (median)", f"{statistics.median(hit) * 1e3:.1f} ms",
         f"{statistics.median(plain) / statistics.median(hit):.2f}x faster"),
        ("tokens loaded from kvd", f"{min(loaded)}", "every full prompt block"),
        ("worker: loading them (median)", f"{statistics.median(load_us) / 1e3:.2f} ms", "start_load_kv"),
        ("scheduler: connector per step, no hits", f"p50 {pct(miss_steps, 50):.0f} us  p99 {pct(miss_steps, 99):.0f} us",
         f"{len(miss_steps)} steps"),
        ("scheduler: connector per step with a load", f"p50 {pct(hit_steps, 50):.0f} us  p99 {pct(hit_steps, 99):.0f} us",
         f"{len(hit_steps)} steps"),
    ]
    w = max(len(r[0]) for r in rows)
    print(f"\n{'what':<{w}}  {'figure':<26}  note")
    for a, b, c in rows:
        print(f"{a:<{w}}  {b:<26}  {c}")


if __name__ == "__main__":
    main()
