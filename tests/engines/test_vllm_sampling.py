"""A request resumed after a break continues exactly (``kvd.vllm_sampling``), inside vLLM's own
OpenAI server (the CPU build) on the tiny model, through ``/v1/completions``: the resubmission
the front makes (prompt = the original prompt's token ids + the first k generated tokens,
``max_tokens`` lowered by k, ``kv_transfer_params: {"kvd": {"continues": {"generated": k}}}``)
gives the uninterrupted run's remaining tokens, for seeded sampling (temperature 1, top_p 0.9,
seed 1234) and for frequency and presence penalties (greedy, so only the penalties matter).

Two servers on one daemon, started side by side: one with the connector's default
``exact_sampling`` (on), one with it off. The cases are not vacuous: the same resubmission
without ``continues``, or on the server with the patch off, gives other tokens. A request
without ``continues`` gives the same tokens on both servers. Resumed requests that vLLM
preempts (a KV cache of 24 blocks) and adds to its batch again are fast-forwarded once. The
patch's counters reach vLLM's "KV Transfer metrics" log lines (logged every second here) and
count each continuing request once.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import pytest

from kvd_daemon import Daemon
from test_stream_recovery import START_TIMEOUT_S, free_port, get_text, metric
from test_vllm import HERE, connector
from vllm_server import SERVED_NAME, VllmServer

MAX_TOKENS = 200
BREAKS = (1, 17, 100)  # where the uninterrupted run is cut: its first token, mid-block, later on
PROMPT = [4 + (3 + 17 * i) % 2000 for i in range(48)]  # token ids of w3 w20 w37 ... (1.5 blocks)
SEEDED = {"temperature": 1.0, "top_p": 0.9, "seed": 1234}
PENALTIES = {"temperature": 0, "frequency_penalty": 1.0, "presence_penalty": 0.5}
KV_BLOCKS = 24  # each server's KV cache: 768 tokens, so PREEMPT_SEEDS at once preempt
PREEMPT_SEEDS = (7, 8, 9, 10)  # four seeded requests of 48 + 300 tokens (11 blocks each)


def continues(k: int) -> dict:
    return {"kv_transfer_params": {"kvd": {"continues": {"generated": k}}}}


def complete(srv: VllmServer, prompt: list[int], max_tokens: int, **params: Any) -> list[int]:
    """The generated token ids of one non-streamed completion (EOS ignored: always max_tokens)."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "return_token_ids": True, **params}
    req = urllib.request.Request(srv.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        out = json.loads(r.read())
    tokens = out["choices"][0]["token_ids"]
    assert len(tokens) == max_tokens, out
    return tokens


def logged(srv: VllmServer, counter: str) -> int:
    """The sum of ``counter`` over the server's "KV Transfer metrics" lines (each line is one
    interval's figures)."""
    text = srv.log_path.read_text(errors="replace")
    return sum(int(n) for n in re.findall(rf"KV Transfer metrics:.*?\b{counter}=(\d+)", text))


COUNTED: dict[str, int] = {}  # what the cases run so far made the patch count on the "on" server


def check_counted(on: VllmServer, off: VllmServer, **more: int) -> None:
    """The patch's counters, as vLLM logs them, add up to every continuing request sent to the
    server with the patch on; the other server counts none."""
    for c, n in more.items():
        COUNTED[c] = COUNTED.get(c, 0) + n
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(logged(on, c) < n for c, n in COUNTED.items()):
        time.sleep(0.5)
    assert {c: logged(on, c) for c in COUNTED} == COUNTED, on.log_tail()
    assert not any(logged(off, c) for c in COUNTED)
    assert "exact_sampling not installed" not in on.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[tuple[VllmServer, VllmServer]]:
    """(exact_sampling on, exact_sampling off): two vLLM servers on one daemon."""
    tmp = tmp_path_factory.mktemp("sampling")
    model = tmp / "model"
    subprocess.run([sys.executable, str(HERE / "make_tiny_model.py"), str(model)], check=True, capture_output=True)
    d = Daemon(["--pool-mib", "64", "--page-kib", "64"])
    env = {"VLLM_LOG_STATS_INTERVAL": "1"}
    args = ["--num-gpu-blocks-override", str(KV_BLOCKS), "--max-model-len", "512"]
    on = VllmServer(str(model), free_port(), tmp / "on.log", connector(d.socket), extra_env=env, extra_args=args)
    off = VllmServer(str(model), free_port(), tmp / "off.log", connector(d.socket, exact_sampling=False),
                     extra_env=env, extra_args=args)
    try:
        on.start()
        off.start()
        on.wait_ready(START_TIMEOUT_S)
        off.wait_ready(START_TIMEOUT_S)
        yield on, off
    finally:
        on.stop()
        off.stop()
        d.stop()


def test_seeded_sampling_resumes_exactly(servers: tuple[VllmServer, VllmServer]) -> None:
    on, off = servers
    whole = complete(on, PROMPT, MAX_TOKENS, **SEEDED)
    for k in BREAKS:
        rest = complete(on, PROMPT + whole[:k], MAX_TOKENS - k, **SEEDED, **continues(k))
        assert rest == whole[k:], f"resumed after {k} tokens: first difference at " \
                                  f"{next(i for i, (a, b) in enumerate(zip(rest, whole[k:])) if a != b)}"
    k = BREAKS[-1]
    plain = complete(on, PROMPT + whole[:k], MAX_TOKENS - k, **SEEDED)
    assert plain != whole[k:], "without continues the resubmission should draw afresh"
    # a malformed continues (more tokens than the prompt has) is ignored: a plain resubmission
    bad = {"kv_transfer_params": {"kvd": {"continues": {"generated": 10_000}}}}
    assert complete(on, PROMPT + whole[:k], MAX_TOKENS - k, **SEEDED, **bad) == plain
    # a request without continues: the patch changes nothing
    assert complete(off, PROMPT, MAX_TOKENS, **SEEDED) == whole
    # the patch off: continues is not acted on
    assert complete(off, PROMPT + whole[:k], MAX_TOKENS - k, **SEEDED, **continues(k)) != whole[k:]
    check_counted(on, off, continued_requests=len(BREAKS), fast_forwarded_requests=len(BREAKS),
                  fast_forward_draws=sum(BREAKS), invalid_continues=1)


def test_penalties_resume_exactly(servers: tuple[VllmServer, VllmServer]) -> None:
    on, off = servers
    whole = complete(on, PROMPT, MAX_TOKENS, **PENALTIES)
    for k in BREAKS:
        rest = complete(on, PROMPT + whole[:k], MAX_TOKENS - k, **PENALTIES, **continues(k))
        assert rest == whole[k:], f"resumed after {k} tokens"
    k = BREAKS[-1]
    assert complete(on, PROMPT + whole[:k], MAX_TOKENS - k, **PENALTIES) != whole[k:], \
        "without continues the committed tokens are prompt, which these penalties do not count"
    assert complete(off, PROMPT, MAX_TOKENS, **PENALTIES) == whole
    assert complete(off, PROMPT + whole[:k], MAX_TOKENS - k, **PENALTIES, **continues(k)) != whole[k:]
    # both at once: the penalties change what the seeded sampler draws from
    both = {**SEEDED, **PENALTIES, "temperature": 1.0}
    whole = complete(on, PROMPT, MAX_TOKENS, **both)
    assert complete(on, PROMPT + whole[:k], MAX_TOKENS - k, **both, **continues(k)) == whole[k:]
    check_counted(on, off, continued_requests=len(BREAKS) + 1, penalized_requests=len(BREAKS) + 1,
                  fast_forwarded_requests=1, fast_forward_draws=k)


def test_preempted_request_fast_forwards_once(servers: tuple[VllmServer, VllmServer]) -> None:
    """Four requests resumed at once outgrow the KV cache: vLLM preempts some and adds them to
    the batch again later, with the same generator, which must not be fast-forwarded again."""
    on, off = servers
    long, k = 300, 100
    whole = {s: complete(on, PROMPT, long, **{**SEEDED, "seed": s}) for s in PREEMPT_SEEDS}
    before = metric(get_text(on.url + "/metrics"), "vllm:num_preemptions_total")
    with ThreadPoolExecutor(len(PREEMPT_SEEDS)) as pool:
        rest = dict(zip(PREEMPT_SEEDS, pool.map(
            lambda s: complete(on, PROMPT + whole[s][:k], long - k, **{**SEEDED, "seed": s}, **continues(k)),
            PREEMPT_SEEDS)))
    assert metric(get_text(on.url + "/metrics"), "vllm:num_preemptions_total") > before, "nothing was preempted"
    for s in PREEMPT_SEEDS:
        assert rest[s] == whole[s][k:], f"seed {s}"
    n = len(PREEMPT_SEEDS)
    check_counted(on, off, continued_requests=n, fast_forwarded_requests=n, fast_forward_draws=n * k)
