"""One vLLM engine process for the engine tests: a real ``vllm.LLM`` (CPU build, in-process
engine core) that runs the steps of a JSON scenario and writes what it saw.

    python tests/engines/vllm_scenario.py SCENARIO.json OUT_DIR

The scenario names the model, the engine arguments, the connector (``null``: a plain engine)
and a list of steps; each step generates a list of prompts greedily and records, per prompt,
the output token ids, vLLM's own cached-token count and the time to its first token. With
``dump_kv`` the K and V of every full prompt block are read back through vLLM's own cache
indexing (the prefix cache's block for each of the request's block hashes, then the
``[block, head, slot, :]`` entries of each layer's standardized KV cache view) and saved, so the
test can compare engines token by token. The connector's scheduler-side time per step and its
figures are recorded too.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # scheduler and worker in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    scenario = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    import numpy as np
    from vllm import LLM, SamplingParams

    args = dict(
        model=scenario["model"], dtype=scenario.get("dtype", "float32"), seed=0,
        max_model_len=scenario.get("max_model_len", 2048), block_size=scenario.get("block_size", 32),
        enforce_eager=True, max_num_seqs=scenario.get("max_num_seqs", 8), enable_prefix_caching=True,
    )
    args.update(scenario.get("engine_args", {}))
    if scenario.get("connector") is not None:
        args["kv_transfer_config"] = scenario["connector"]
    t0 = time.perf_counter()
    llm = LLM(**args)
    load_s = time.perf_counter() - t0
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    timer = _StepTimer(sched.connector) if sched.connector is not None else None
    hashes = _Hashes(sched)
    preempted = _Preemptions(sched)
    results = {"load_s": load_s, "steps": []}
    for step in scenario["steps"]:
        extra = {"kv_transfer_params": step["kv_transfer_params"]} if step.get("kv_transfer_params") else None
        sp = SamplingParams(temperature=0.0, max_tokens=step.get("max_tokens", 8), ignore_eos=True,
                            extra_args=extra)
        if step.get("idle_s"):  # the engine idles (no requests, so no connector calls)
            time.sleep(float(step["idle_s"]))
        if step.get("reset_prefix_cache"):
            assert llm.reset_prefix_cache()
        before = _worker_stats()
        prompts = [_prompt(llm, results, p) for p in step["prompts"]]
        ttft = None
        if step.get("abort_after_steps"):  # submitted, stepped a few times, then aborted
            _aborted(llm, prompts[0], sp, int(step["abort_after_steps"]))
            results["steps"].append({"name": step["name"], "outputs": [], "preemptions": 0,
                                     "stats": _diff(_worker_stats(), before)})
            continue
        if step.get("timed"):  # one prompt, stepped by hand: the time to its first token
            (out1, ttft) = _timed(llm, prompts[0], sp)
            outs = [out1]
        else:
            outs = llm.generate(prompts, sp, use_tqdm=False)
        rec = {"name": step["name"], "outputs": [], "stats": _diff(_worker_stats(), before),
               "preemptions": preempted.count}
        preempted.count = 0
        for i, o in enumerate(outs):
            rec["outputs"].append(
                {"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0,
                 "prompt": list(o.prompt_token_ids),
                 "prompt_len": len(o.prompt_token_ids), "ttft_s": ttft}
            )
            if step.get("dump_kv"):
                kv = _prompt_kv(llm, sched, hashes, list(o.prompt_token_ids))
                np.savez(out / f"{step['name']}-{i}.npz", **kv)
        results["steps"].append(rec)
    if timer is not None:
        results["sched_step_us"] = timer.samples
        results["namespaces"] = _namespaces(sched.connector)
        c = sched.connector
        results["bookkeeping"] = {n: len(getattr(c, n)) for n in (
            "_lookups", "_ticket_req", "_loading_pins", "_loading_blocks", "_requests", "_save_cursor",
            "_ckpt_cursor", "_restore_tags", "restorer")}
        results["scheduler_totals"] = dict(c.totals.data)
        results["stats_log"] = _stats_log(llm)
        results["events"] = [type(e).__name__ for e in timer.events]
    (out / "results.json").write_text(json.dumps(results))
    os._exit(0)  # skip vLLM's slow interpreter teardown; everything is written


def _prompt(llm, results: dict, p):
    """A prompt: words, ``{"tokens": [...]}``, or ``{"turn_after": [step, i], "then": words}``
    (the earlier request's prompt and output, then more words: the conversation's next turn)."""
    if isinstance(p, str):
        return p
    if "tokens" in p:
        return {"prompt_token_ids": p["tokens"]}
    name, i = p["turn_after"]
    prev = next(s for s in results["steps"] if s["name"] == name)["outputs"][i]
    more = llm.get_tokenizer().encode(p["then"], add_special_tokens=False)
    return {"prompt_token_ids": prev["prompt"] + prev["tokens"] + more}


def _namespaces(conn) -> dict:
    """The namespace ids this engine would use for PP stages 0 and 1 of a two-stage run (a
    CPU engine here cannot run two stages; the ids show the stages cannot share blocks)."""
    own = conn.namespace.hex()
    pp_size, conn.pp_size = conn.pp_size, 2
    try:
        stages = [conn.namespace_descriptor(p, 0).id().hex() for p in (0, 1)]
    finally:
        conn.pp_size = pp_size
    return {"own": own, "pp2_stages": stages}


def _worker_stats() -> dict:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return {}
    return dict(get_kv_transfer_group().totals.data)


def _diff(a: dict, b: dict) -> dict:
    return {k: a.get(k, 0) - b.get(k, 0) for k in a}


class _StepTimer:
    """Times the connector's scheduler-side calls and sums them per scheduler step (a step ends
    with ``build_connector_meta``); also keeps the KV events vLLM took from it."""

    CALLS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
             "update_connector_output", "request_finished", "take_events")

    def __init__(self, conn) -> None:
        self.samples: list[dict] = []
        self.events: list = []
        self._acc, self._hit = 0.0, False
        for name in self.CALLS:
            self._wrap(conn, name)

    def _wrap(self, conn, name: str) -> None:
        inner = getattr(conn, name)

        def timed(*a, **kw):
            t = time.perf_counter()
            r = inner(*a, **kw)
            self._acc += time.perf_counter() - t
            if name == "take_events":
                r = list(r)
                self.events += r
            if name == "build_connector_meta":
                if r.loads:
                    self._hit = True
                if r.loads or r.saves or a[0].num_scheduled_tokens:
                    self.samples.append({"us": self._acc * 1e6, "hit": self._hit})
                self._acc, self._hit = 0.0, False
            return r

        setattr(conn, name, timed)


MAX_WAIT_FOR_A_LOAD_S = 10.0  # how long an aborted request may take for its kvd hit to load


def _aborted(llm, prompt, sp, steps: int) -> None:
    """Submit a request, run ``steps`` engine steps, abort it, and step until it is gone. With a
    connector, it runs until its kvd hit loaded (at most ``MAX_WAIT_FOR_A_LOAD_S`` more): the
    lookup is asynchronous, and while it is out the engine's steps schedule nothing and take
    microseconds, so a count of steps is no bound on the daemon's answer (CI's loaded machine
    outran 20 of them)."""
    eng = llm.llm_engine
    rid = f"aborted-{time.monotonic_ns()}"
    before = _worker_stats().get("loaded_blocks", 0)
    eng.add_request(rid, prompt, sp)
    for _ in range(steps):
        eng.step()
    deadline = time.monotonic() + MAX_WAIT_FOR_A_LOAD_S
    for _ in range(100_000):  # bounded in steps and in time
        if _worker_stats().get("loaded_blocks", 0) > before or not eng.has_unfinished_requests():
            break
        if time.monotonic() > deadline:
            break
        eng.step()
        time.sleep(0.001)
    eng.abort_request([rid])
    for _ in range(1000):  # bounded: the abort takes effect at the next step
        if not eng.has_unfinished_requests():
            return
        eng.step()
    raise RuntimeError("the aborted request did not go away")


def _stats_log(llm) -> str:
    """The connector's figures as vLLM's own connector-stats logging prints them."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    logging_ = KVConnectorLogging(llm.llm_engine.vllm_config.kv_transfer_config)
    logging_.observe(dict(get_kv_transfer_group().totals.data))
    lines: list[str] = []
    logging_.log(lambda fmt, *a: lines.append(fmt % a))
    return "\n".join(lines)


def _timed(llm, prompt, sp):
    """Run one request through the engine's own step loop; (its output, seconds from
    submission to the first generated token)."""
    eng = llm.llm_engine
    rid = f"timed-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    eng.add_request(rid, prompt, sp)
    first = None
    for _ in range(100_000):  # bounded: a few hundred steps at most for these requests
        for o in eng.step():
            if o.request_id != rid:
                continue
            if first is None and o.outputs and o.outputs[0].token_ids:
                first = time.perf_counter() - t0
            if o.finished:
                return o, first
    raise RuntimeError("the timed request did not finish")


class _Preemptions:
    """How many times the scheduler preempted a request (a KV cache too small to hold all)."""

    def __init__(self, sched) -> None:
        self.count = 0
        inner = sched._preempt_request

        def preempt(*a, **kw):
            self.count += 1
            return inner(*a, **kw)

        sched._preempt_request = preempt


class _Hashes:
    """vLLM's own block hashes of every request, captured as the scheduler frees it."""

    def __init__(self, sched) -> None:
        self.by_prompt: dict[tuple, list] = {}
        inner = sched._free_request

        def free(request, *a, **kw):
            self.by_prompt[tuple(request.prompt_token_ids)] = list(request.block_hashes)
            return inner(request, *a, **kw)

        sched._free_request = free


def _prompt_kv(llm, sched, hashes: "_Hashes", prompt_ids: list[int]) -> dict:
    """K and V of every full block of the request that vLLM's prefix cache holds, by block
    hash: ``{hash_hex: [layers, heads, slots, 2 * head_size]}`` (the KV cache config's layer
    order), read through vLLM's own indexing of its standardized per-layer views."""
    import numpy as np

    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    names = sched.kv_cache_config.kv_cache_groups[0].layer_names
    caches = [runner.compilation_config.static_forward_context[n].kv_cache for n in names]
    pool = sched.kv_cache_manager.block_pool
    out = {}
    for h in hashes.by_prompt.get(tuple(prompt_ids), []):
        block = pool.get_cached_block(h, [0])
        if block:
            bid = block[0].block_id
            out[bytes(h).hex()] = np.stack([c[bid].detach().cpu().numpy() for c in caches])
    return out


if __name__ == "__main__":
    main()
