"""kvd's vLLM connector inside a real vLLM (the CPU build), on a tiny Llama made here, against a
real daemon. Greedy decoding in float32; every case is compared token by token with a plain
engine (no connector) running the same prompts, and the K and V that kvd carried are compared
per token through vLLM's own cache indexing.

The engines run one after another (and two at once where the case is "two engines on one
daemon"), each a process of its own (``vllm_scenario.py``), so "a fresh process loads" is real.
Order matters and is kept in one module-scoped fixture: P (plain) -> S (stores) -> L (loads in a
fresh process) -> Q and R at once (preemption; blocks removed or the pool flooded between
lookup and load) -> N (lookup answers lost) -> misses (another model, another dtype, then other weights at the same path).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvd_daemon import Daemon

HERE = Path(__file__).resolve().parent
BLOCK = 32
ENGINE_TIMEOUT_S = 600


def words(start: int, n: int, step: int = 37) -> str:
    return " ".join(f"w{(start + i * step) % 2000}" for i in range(n))


A = words(1, 200)  # 6 full blocks
AB = A + " " + words(500, 150, 11)  # A's blocks, then 4 more full ones
LONG = words(7, 1100, 13)  # the TTFT figure's prompt (34 full blocks)
T1 = words(3, 60, 17)  # 60 prompt tokens + 4 generated = 64: ends on a block boundary
C = words(77, 300, 19)  # stored by S, loaded by an L request that is then aborted
PREEMPT = [words(100 + 7 * k, 250, 3 + 2 * k) for k in range(4)]
TURN2 = {"turn_after": ["base", 2], "then": words(9, 40, 7)}
IDLE = words(900, 100, 3)  # stored, then loaded after an idle spell longer than the lease


def connector(socket: str, module: str = "kvd.vllm", cls: str = "KvdConnector", **extra: Any) -> dict:
    return {
        "kv_connector": cls, "kv_connector_module_path": module, "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket": socket, **extra},
    }


def start_engine(tmp: Path, name: str, scenario: dict) -> tuple[subprocess.Popen, Path]:
    spec, out = tmp / f"{name}.json", tmp / name
    spec.write_text(json.dumps(scenario))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    log = open(tmp / f"{name}.log", "wb")
    proc = subprocess.Popen([sys.executable, str(HERE / "vllm_scenario.py"), str(spec), str(out)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp)
    return proc, out


def finish(tmp: Path, name: str, started: tuple[subprocess.Popen, Path]) -> "Run":
    proc, out = started
    try:
        rc = proc.wait(timeout=ENGINE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "timeout"
    if rc != 0:
        tail = (tmp / f"{name}.log").read_text(errors="replace")[-4000:]
        pytest.fail(f"engine {name} exited {rc}:\n{tail}")
    return Run(out)


def engine(tmp: Path, name: str, scenario: dict) -> "Run":
    return finish(tmp, name, start_engine(tmp, name, scenario))


class Run:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.r = json.loads((out / "results.json").read_text())
        self.steps = {s["name"]: s for s in self.r["steps"]}

    def tokens(self, step: str) -> list[list[int]]:
        return [o["tokens"] for o in self.steps[step]["outputs"]]

    def kv(self, step: str, i: int) -> dict[str, np.ndarray]:
        with np.load(self.out / f"{step}-{i}.npz") as d:
            return {k: d[k] for k in d.files}

    def stats(self, step: str) -> dict[str, int]:
        return self.steps[step]["stats"]


def other_kv_dtype() -> dict:
    """Engine settings whose KV cache has another dtype than the float32 engines': an fp8 KV
    cache where vLLM's CPU backend has one (x86 with AVX-512 or AMX), else the model in
    bfloat16 (its KV cache then is bfloat16). Either way the bytes mean something else."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    if flags & {"avx512f", "amx_tile"}:
        return {"engine_args": {"kv_cache_dtype": "fp8"}}
    return {"dtype": "bfloat16"}


def scenario(model: str, steps: list[dict], conn: dict | None = None, **kw: Any) -> dict:
    return {"model": model, "connector": conn, "steps": steps, "block_size": BLOCK, **kw}


def step(name: str, prompts: list, max_tokens: int = 8, dump_kv: bool = True, timed: bool = False) -> dict:
    return {"name": name, "prompts": prompts, "max_tokens": max_tokens, "dump_kv": dump_kv, "timed": timed}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Every engine run of this module, in order, and the daemon they share."""
    tmp = tmp_path_factory.mktemp("vllm")
    model, other = tmp / "model", tmp / "other-model"
    for path, seed in ((model, 0), (other, 1)):
        subprocess.run([sys.executable, str(HERE / "make_tiny_model.py"), str(path), "--seed", str(seed)],
                       check=True, capture_output=True)
    d = Daemon(["--pool-mib", "64", "--page-kib", "64"])
    try:
        sock = d.socket
        base_steps = [step("long", [LONG], 4, timed=True), step("base", [A, AB, T1, C], 4)]
        w: dict[str, Any] = {"tmp": tmp, "model": str(model), "daemon": d}
        w["P"] = engine(tmp, "P", scenario(str(model), base_steps + [
            step("turn2", [TURN2], 8), step("preempt", PREEMPT, 120, False)]))
        turn2 = {"tokens": w["P"].steps["turn2"]["outputs"][0]["prompt"]}
        w["S"] = engine(tmp, "S", scenario(str(model), base_steps, connector(sock)))
        w["L"] = engine(tmp, "L", scenario(str(model), [
            step("long", [LONG], 4, timed=True), step("A", [A], 4), step("AB", [AB], 4),
            step("turn2", [turn2], 8),
            {"name": "abort", "prompts": [C + " w5 w6"], "max_tokens": 50, "abort_after_steps": 2},
        ], connector(sock)))
        w["kvd_after_L"] = kvd_blocks(sock, w["L"], [("AB", 0), ("turn2", 0)])
        # Two engines on the daemon at once: Q (a KV cache small enough to preempt) and R
        # (another client removes a block, then floods the pool, between lookup and load).
        q = start_engine(tmp, "Q", scenario(str(model), [step("preempt", PREEMPT, 120, False)],
                                            connector(sock), max_model_len=512,
                                            engine_args={"num_gpu_blocks_override": 24,
                                                         "scheduler_reserve_full_isl": False}))
        r = start_engine(tmp, "R", scenario(str(model), [
            step("removed", [AB], 4), step("long", [LONG], 4)],
            connector(sock, "kvd_test_hooks", "RacingConnector", test_race="remove")))
        w["Q"], w["R"] = finish(tmp, "Q", q), finish(tmp, "R", r)
        w["F"] = engine(tmp, "F", scenario(str(model), [step("flooded", [AB], 4)],
                                           connector(sock, "kvd_test_hooks", "RacingConnector", test_race="flood")))
        # The first three lookup answers are lost: asked again then a miss, then asked again and loaded.
        w["N"] = engine(tmp, "N", scenario(str(model), [
            step("lost", [AB], 4), {**step("lost_once", [AB], 4), "reset_prefix_cache": True}],
            connector(sock, "kvd_test_hooks", "LosingConnector", test_lose_answers=3, lookup_timeout_ms=1000)))
        # Idle past the session's lease (10 s): nothing renews it while there are no requests.
        w["I"] = engine(tmp, "I", scenario(str(model), [
            step("first", [IDLE], 4, False),
            {**step("after_idle", [IDLE], 4, False), "idle_s": 12, "reset_prefix_cache": True}], connector(sock)))
        # Misses: another model, another KV cache dtype, then other weights at the same path.
        w["S2"] = engine(tmp, "S2", scenario(str(model), [step("A", [A, AB], 4, False)], connector(sock)))
        m1 = start_engine(tmp, "M1", scenario(str(other), [step("A", [A], 4, False)], connector(sock)))
        m2 = start_engine(tmp, "M2", scenario(str(model), [step("A", [A], 4, False)], connector(sock),
                                              **other_kv_dtype()))
        w["M1"], w["M2"] = finish(tmp, "M1", m1), finish(tmp, "M2", m2)
        shutil.rmtree(model)
        subprocess.run([sys.executable, str(HERE / "make_tiny_model.py"), str(model), "--seed", "2"],
                       check=True, capture_output=True)
        w["M3"] = engine(tmp, "M3", scenario(str(model), [step("A", [A], 4, False)], connector(sock)))
        yield w
    finally:
        d.stop()


def kvd_blocks(socket: str, run: "Run", dumps: list[tuple[str, int]]) -> dict[str, bytes]:
    """What kvd holds under the engine's namespace for every block in its dumps: the bytes a
    storing engine published (kvd's block is vLLM's [layers, heads, slots, 2*head] in order)."""
    import kvd

    ns = bytes.fromhex(run.r["namespaces"]["own"])
    hashes = sorted({h for name, i in dumps for h in run.kv(name, i)})
    out = {}
    with kvd.Client(socket, name="test-reader") as c:
        got = c.acquire([kvd.key(ns, bytes.fromhex(h)) for h in hashes])
        for h, b in zip(hashes, got):
            if isinstance(b, kvd.KvdError):
                continue
            buf = bytearray(b.len)
            c.read_verified(b.handle, buf)
            c.release([b.handle])
            out[h] = bytes(buf)
    return out


def full_blocks(prompt_len: int) -> int:
    return prompt_len // BLOCK


def assert_kv_equal(a: dict, b: dict, hashes: list[str] | None = None) -> int:
    """Every block present in both dumps has equal K and V for every token; how many."""
    common = [h for h in (hashes or a) if h in a and h in b]
    for h in common:
        assert a[h].shape == b[h].shape
        np.testing.assert_array_equal(a[h], b[h], err_msg=f"block {h[:12]} differs")
    return len(common)


def test_a_fresh_process_loads_every_full_prompt_block_from_kvd_and_generates_the_same_tokens(world):
    P, S, L = world["P"], world["S"], world["L"]
    assert S.tokens("base") == P.tokens("base"), "a storing engine generates as a plain one"
    assert S.stats("base")["saved_blocks"] > 0
    assert L.tokens("long") == P.tokens("long")
    out = L.steps["long"]["outputs"][0]
    assert out["cached"] == full_blocks(out["prompt_len"]) * BLOCK, "every full prompt block was a hit"
    assert L.stats("long")["loaded_blocks"] == full_blocks(out["prompt_len"])
    assert L.stats("long")["load_errors"] == 0
    # The bytes vLLM's cache holds after the load are the bytes the storing engine computed.
    n = assert_kv_equal(S.kv("long", 0), L.kv("long", 0))
    assert n == full_blocks(out["prompt_len"])
    # And those match a plain engine's, token for token (same kernels, same inputs).
    plain, loaded = P.kv("long", 0), L.kv("long", 0)
    for h in loaded:
        np.testing.assert_allclose(loaded[h], plain[h], rtol=1e-4, atol=1e-5)


def test_a_local_prefix_hit_and_a_kvd_hit_in_one_request_load_the_blocks_after_the_local_ones(world):
    P, L = world["P"], world["L"]
    ab = L.steps["AB"]["outputs"][0]
    assert L.tokens("AB") == [P.tokens("base")[1]], "output equals the plain run"
    assert ab["cached"] == full_blocks(ab["prompt_len"]) * BLOCK
    # A's 6 blocks were local (L ran A first), so kvd loaded only AB's blocks after them.
    assert L.stats("AB")["loaded_blocks"] == full_blocks(ab["prompt_len"]) - full_blocks(200)
    # Per token, the K and V vLLM holds for every block of AB are the bytes kvd holds: the
    # local blocks where they were, the loaded ones where vLLM put them.
    # (The dump is in the request's block order; blocks past the prompt's full ones hold
    # generated tokens, computed here, and are left out.)
    dump, stored = L.kv("AB", 0), world["kvd_after_L"]
    prompt_blocks = list(dump)[: full_blocks(ab["prompt_len"])]
    assert len(prompt_blocks) == full_blocks(ab["prompt_len"])
    for h in prompt_blocks:
        assert dump[h].tobytes() == stored[h], f"block {h[:12]}: vLLM's cache differs from kvd's block"
    plain = P.kv("base", 1)
    for h in dump:
        np.testing.assert_allclose(dump[h], plain[h], rtol=1e-4, atol=1e-5)


def test_a_request_ending_on_a_block_boundary_saves_only_its_computed_blocks_and_the_next_turn_is_right(world):
    P, S, L = world["P"], world["S"], world["L"]
    t1 = S.steps["base"]["outputs"][2]
    assert t1["prompt_len"] + len(t1["tokens"]) == 2 * BLOCK, "the case needs a boundary finish"
    assert L.tokens("turn2") == P.tokens("turn2")
    # Only T1's first block was complete when it finished: its second block holds the last
    # sampled token, whose KV was never computed, so it was not saved and L recomputed it.
    assert L.stats("turn2")["loaded_blocks"] == 1
    assert L.steps["turn2"]["outputs"][0]["cached"] == BLOCK


def test_a_block_removed_between_lookup_and_load_is_recomputed_and_the_output_is_unchanged(world):
    P, R = world["P"], world["R"]
    assert R.tokens("removed") == [P.tokens("base")[1]]
    st = R.stats("removed")
    assert st["load_errors"] == 1, "the removed block failed its load and was reported"
    assert st["loaded_blocks"] >= 1
    # What R stored meanwhile is right: the block that failed its load was stored again only
    # once recomputed, never with the bytes its failed load left (F loads it below).
    assert world["F"].tokens("flooded") == [P.tokens("base")[1]]


def test_a_lookup_whose_answer_is_lost_is_asked_again_then_missed_never_left_waiting(world):
    """``lookup_timeout_ms``: the scheduler's asynchronous lookup has a deadline. In "lost" both
    answers (the lookup and its second ask) are lost: the request is computed as a miss. In
    "lost_once" only the first is: the second ask finds the hit and the request loads it."""
    P, N = world["P"], world["N"]
    assert N.tokens("lost") == [P.tokens("base")[1]]
    assert N.tokens("lost_once") == [P.tokens("base")[1]]
    assert N.stats("lost")["loaded_blocks"] == 0
    ab = N.steps["lost_once"]["outputs"][0]
    assert N.stats("lost_once")["loaded_blocks"] == full_blocks(ab["prompt_len"])
    totals = N.r["scheduler_totals"]
    assert (totals["lookup_reasks"], totals["lookup_timeouts"]) == (2, 1), totals


def test_lookups_pin_their_hit_so_a_pool_flood_before_the_load_evicts_none_of_it(world):
    P, F = world["P"], world["F"]
    assert F.tokens("flooded") == [P.tokens("base")[1]]
    st = F.stats("flooded")
    ab = F.steps["flooded"]["outputs"][0]
    assert st["load_errors"] == 0, "the pinned hit survived a whole turn of the pool"
    assert st["loaded_blocks"] == full_blocks(ab["prompt_len"])


def test_preemption_with_a_small_kv_cache_gives_the_plain_engines_tokens(world):
    P, Q = world["P"], world["Q"]
    assert Q.steps["preempt"]["preemptions"] > 0, "the KV cache was small enough to preempt"
    assert Q.tokens("preempt") == P.tokens("preempt")
    assert Q.stats("preempt")["saved_blocks"] > 0


def test_two_engines_on_one_daemon_each_get_the_plain_output(world):
    # Q and R ran at the same time against one daemon; S2 ran after the flood evicted S's data.
    assert world["R"].tokens("long") == world["P"].tokens("long")
    assert world["S2"].tokens("A") == [world["P"].tokens("base")[0], world["P"].tokens("base")[1]]


def test_another_model_another_kv_dtype_and_new_weights_at_the_same_path_are_misses(world):
    for name in ("M1", "M2", "M3"):
        st = world[name].stats("A")
        out = world[name].steps["A"]["outputs"][0]
        assert st["loaded_blocks"] == 0 and out["cached"] == 0, f"{name} hit another model's KV"
    # S2 stored A under the first weights; M3 is the same path with new weights: a miss above.
    assert world["S2"].stats("A")["saved_blocks"] + world["S2"].stats("A")["save_skipped"] > 0


def test_an_engine_idle_past_its_session_lease_still_hits_and_saves_on_its_next_request(world):
    run = world["I"]
    assert run.tokens("after_idle") == run.tokens("first")
    st = run.stats("after_idle")
    assert st["loaded_blocks"] == full_blocks(100), "the blocks stored before the idle spell load"
    assert st.get("save_errors", 0) == 0 and run.stats("first").get("save_errors", 0) == 0


def test_pipeline_stages_have_their_own_namespaces(world):
    ns = world["L"].r["namespaces"]
    assert ns["pp2_stages"][0] != ns["pp2_stages"][1]
    assert ns["own"] not in ns["pp2_stages"], "a two-stage run is another namespace than one stage"


def test_kvd_block_events_reach_vllms_kv_event_hook(world):
    events = world["L"].r["events"]
    assert "BlockStored" in events


def test_the_connectors_figures_go_through_vllms_connector_stats_logging(world):
    log = world["L"].r["stats_log"]
    assert log.startswith("KV Transfer metrics:") and "loaded_blocks=" in log


def test_finished_and_aborted_requests_leave_no_bookkeeping_behind(world):
    # L's last request was aborted as its kvd hit loaded (two steps in, or later when the daemon
    # answered the asynchronous lookup late: up to 10 s), with the hit pinned.
    L = world["L"]
    assert L.steps["abort"]["stats"]["loaded_blocks"] > 0, (L.steps["abort"], L.r["scheduler_totals"])
    for name in ("S", "L", "Q", "R", "F", "N"):
        assert all(n == 0 for n in world[name].r["bookkeeping"].values()), (name, world[name].r["bookkeeping"])


def test_the_connectors_scheduler_time_per_step(world):
    """Not a speed assertion: the figures docs/PERFORMANCE.md quotes, printed from this run."""
    for name in ("S", "L"):
        us = [s["us"] for s in world[name].r["sched_step_us"]]
        hit = [s["us"] for s in world[name].r["sched_step_us"] if s["hit"]]
        assert us, f"{name} timed no scheduler step"
        q = statistics.quantiles(us, n=100) if len(us) > 1 else us * 99
        print(f"\n{name}: scheduler-side connector time per step p50 {q[49]:.0f} us p99 {q[98]:.0f} us "
              f"over {len(us)} steps; steps with a load: {len(hit)}")
    p, ll = world["P"].steps["long"]["outputs"][0], world["L"].steps["long"]["outputs"][0]
    print(f"TTFT of a {p['prompt_len']}-token prompt in a fresh engine: recomputed {p['ttft_s']} s, "
          f"kvd hit {ll['ttft_s']} s ({ll['cached']} tokens loaded)")


def test_a_soft_pinned_system_prompt_outlives_a_flood_that_evicts_everything_else(tmp_path):
    """``soft_pin_blocks``: each request's first blocks (a system prompt the requests share) are
    soft-pinned as they are saved; a flood of other prompts through a pool of 32 pages evicts
    everything else, and the next request with the same system prompt loads its two blocks from
    kvd. Without soft pins the flood evicts them too."""
    model = tmp_path / "model"
    subprocess.run([sys.executable, str(HERE / "make_tiny_model.py"), str(model)], check=True, capture_output=True)
    system = words(1201, 70, 7)  # with the BOS token, its first two blocks are the system prompt's
    flood = [words(1300 + 11 * k, 330, 3) for k in range(4)]  # 10 blocks each: 40 through 32 pages
    runs = {}
    for pin in (2, 0):
        d = Daemon(["--pool-mib", "2", "--page-kib", "64"])
        try:
            runs[pin] = engine(tmp_path, f"soft{pin}", scenario(str(model), [
                step("system", [system + " " + words(1250, 70, 5)], 4, False),
                step("flood", flood, 4, False),
                {**step("again", [system + " " + words(1260, 70, 5)], 4, False), "reset_prefix_cache": True},
            ], connector(d.socket, soft_pin_blocks=pin)))
        finally:
            d.stop()
    assert runs[2].stats("again")["loaded_blocks"] == 2, "the soft-pinned system prompt survived the flood"
    assert runs[0].stats("again")["loaded_blocks"] == 0, "without soft pins the flood evicted it"
    assert runs[2].tokens("again") == runs[0].tokens("again")
