"""The LUMEN experiment on real processes (issue 46): a seeded Poisson load streamed through
``kvd control``'s front over N nodes, workers killed at set times, and the recovery policies
side by side, each run checked stream by stream against the uninterrupted greedy output.

    scripts/bench-lumen.sh [OPTIONS]          (builds kvd, finds the engine venv, runs this)
    KVD_BIN=target/debug/kvd $(scripts/engine-venv.sh)/bin/python benches/python/lumen_load.py --smoke

The full experiment (4 workers, one and two failures, the three policies, 4 repetitions, a
16-layer model 256 wide so that a 1,000-token prefill costs well over a restore, a step's prefill
capped at 256 tokens for every policy; about 50 minutes):

    scripts/bench-lumen.sh --workers 4 --layers 16 --hidden 256 --rate 1.25 --duration 40 --output-len chat:1 \\
        --window 10 --max-num-batched-tokens 256 \\
        --scenario 20:node:2 --scenario 20:node:2,20:node:3 \\
        --policies lumen,fixed_ring,stop_restart --repeat 4 --seed 1 \\
        --out lumen.json --svg lumen.svg

Choose ``--rate`` first with a run without ``--scenario`` (steady state): the survivors should be
busy but not saturated before the kill (TTFT p50 near the idle TTFT, no queue growing over the
run). Nodes 2 and 3 are ring neighbours, so the two-failure scenario kills a fixed-ring holder
with its server.

**A run** (one policy, one scenario, one repetition) starts everything fresh, since kills consume
engines and every policy must start from the same state: a real etcd, N nodes (a ``kvd serve``
in cluster mode and vLLM's OpenAI server with kvd's connector and the tiny model, ``--layers``
deep, each engine pinned to one core round-robin), then ``kvd control --policy P`` with the
front over the N engines (routing by load: ``--cache-routing false``; the prompts share no
prefix anyway). One short request straight to each engine warms it. Then the load: request i is
sent at its arrival offset, each on its own thread, streamed (``POST /v1/completions``, greedy
``temperature 0``, ``ignore_eos`` so the output is exactly as long as drawn,
``return_token_ids``, ``Accept: text/event-stream`` so every event carries ``id: R-S-T``), every
event's arrival time recorded. The kills run on their own thread at their times; a kill of
``vllm`` is ``kill -9`` of that node's vLLM process group (server and engine core), of ``node``
also its kvd daemon; several kills at one time are signalled together, then reaped. Killed
processes are not restarted during the run. Every loop is bounded: the arrivals by
``--max-requests``, each stream by ``--request-timeout`` and by its token count, the drain by
``--request-timeout`` after the last arrival.

**The workload** comes from ``--seed`` alone (``lumen_stats.make_workload``): Poisson arrivals
at ``--rate`` requests/s over ``--duration`` s; prompt and output lengths drawn from
``--prompt-len`` and ``--output-len`` (``fixed:N``, ``uniform:A:B``, ``lognormal:MEAN:SIGMA``
with MEAN the mean in tokens and SIGMA the σ of the log, ``chat[:SCALE]``), clipped to the tiny
model's 2,048-token context (prompt ≤ 2,046, then output ≤ 2,048 − prompt, at least 2 tokens);
prompts are random token ids, none sharing a first block with another. The default,
``chat:0.5`` for both, is ``kvd sim``'s conversation-trace shape (kvd/crates/sim/src/workload.rs:
prompts median 1,000, p99 4,100; outputs median 130, p99 600 tokens; docs/SIMULATION.md,
"Workload") at half scale, so that prompt p99 + output p99 is about the context. The seeds'
LUMEN summary speaks of a chat workload but gives no lengths; the simulator's shape is used so
that a run sits beside ``kvd sim``'s prediction for the same set-up. Every policy and repetition
gets the same requests at the same offsets (``--vary-seed`` draws seed + repetition instead).

**Correctness, for every stream**: every event numbered ``R-0, R-1, ...`` once each (no gap, no
duplicate), no error event, ``[DONE]`` at the end, and exactly the tokens of the uninterrupted
greedy output of the same prompt. The uninterrupted outputs come from a *reference pass*: after
a run's load, each distinct (prompt, length) not yet known is sent straight to a surviving
engine's vLLM (no front, no kill; up to 8 at a time), and kept for the later runs. Greedy output
of the same engine build is the same whatever the batch (the recovery tests rely on it), so the
reference is the uninterrupted output. A request the front refused (503) or that broke on the
client's side counts as wrong.

**Figures per run** (``lumen_stats.run_figures``), then per (scenario, policy) the mean over
the repetitions with its 95 % Student-t interval:

- TTFT (sent → first token) and TPOT ((last − first token) / (tokens − 1)), mean, p50, p90, p99
  (linear between order statistics), over every completed request and over the *recovery
  window*: the requests in flight at a kill (sent before it, last event after it) or sent within
  ``--window`` seconds after it. The killed workers never come back here, so the paper's and
  ``kvd sim``'s window (until the failed workers serve again) does not exist; W is fixed instead,
  the same for every policy so that the window holds the same arrivals (default 10 s: more than
  a stop-and-restart recovery of a full-context request on this machine, and the queue it leaves
  on the survivors; set it to your recovery's tail). Also the *arrivals' TTFT*: only the requests
  sent within ``--arrival-window`` seconds after a kill (default 3), the ones that meet the
  recovery itself; half the window's requests are in flight at the kill and most of them had
  their first token before it.
- Recovery time per interrupted request (its *stall*): the kill → the first token of its new
  attempt at the client (an attempt whose epoch, in the events' ``kvd`` field, is above 1); mean
  ("recovery mean"), p50, and the largest ("recovery max": the last interrupted request's, what
  ``kvd sim`` calls the recovery time).
- Tokens restored against recomputed: the plans' counts from the front's ``GET /status``
  (``restored_tokens``, ``recomputed_tokens``, ``recoveries``, ``recoveries_from_checkpoint``,
  ``recoveries_recomputed``), and beside them what the survivors' vLLM really loaded through
  kvd (``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}``, summed over the
  survivors, measured before the reference pass).
- Goodput: the output tokens of the requests whose stream was exact, divided by the span from
  the first request sent to the last event of any request (tokens/s). With ``--slo-ttft`` and/or
  ``--slo-tpot`` also ``slo_goodput``: the same over the exact requests within both SLOs.

**Output**: progress lines on stderr, the summary table on stdout; ``--out FILE`` the JSON (the
settings, every run's per-request records: offsets, lengths, TTFT, TPOT, token arrival times,
attempts with epoch and worker, stalls, problems; its figures, the front's counters, the kills
as carried out; the aggregated table), ``--svg FILE`` the plot of TTFT over arrival time per
policy with the kills marked (one panel per scenario, every repetition's points).

**--smoke**: 2 workers, 4 s of load at 2 requests/s (seed 7: 9 requests; prompts 100-400
tokens, 200 tokens out), the vLLM of the busiest worker killed at 2.5 s, the ``lumen`` policy
once (these settings replace the command line's); it fails (exit 1) if
any stream is not exact or nothing was recovered. Its figures are printed, never asserted
(tests/engines/test_lumen_smoke.py runs it in the engine tests).

Not done here: restarting killed workers (the front's recovery phases and Lumen's ASSIST need a
draft model; no restart means no capacity-restore time), prefill/decode disaggregation, several
front replicas, and the steady-state comparison of checkpointing on against off beyond running
``lumen`` and ``stop_restart`` (which places no checkpoint) without kills.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
ENGINES = HERE.parent.parent / "tests" / "engines"
for p in (str(HERE), str(ENGINES)):
    if p not in sys.path:
        sys.path.insert(0, p)

import lumen_stats as ls  # noqa: E402

POLICIES = ("lumen", "lumen_mean", "lumen_total", "fixed_ring", "stop_restart")
BLOCK = 32  # vllm_server.py's --block-size
VLLM_MAX_NUM_SEQS = 8  # vllm_server.py's --max-num-seqs: kvd control --engine-max-seqs
# --smoke: seed 7 puts 9 arrivals in the 4 s, three of them in the second before the kill
SMOKE = {"workers": 2, "duration": 4.0, "rate": 2.0, "seed": 7, "vary_seed": False, "prompt_len": "uniform:100:400",
         "output_len": "fixed:200", "kill": ["2.5:vllm:busiest"], "policies": "lumen", "repeat": 1, "window": 5.0,
         "layers": 2}


def log(msg: str) -> None:
    print(f"[lumen {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- the command line ----------------------------------------------------------------------------

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="lumen_load.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help="2 workers, 4 s at 2/s, the busiest vLLM killed at 2.5 s, lumen once; "
                         "fails unless every stream is exact")
    ap.add_argument("--workers", type=int, default=4, help="nodes (daemon + vLLM) per run (default 4)")
    ap.add_argument("--layers", type=int, default=2,
                    help="decoder layers of the tiny model (default 2; the experiment wants a prefill "
                         "well over a restore)")
    ap.add_argument("--hidden", type=int, default=128,
                    help="hidden size of the tiny model (default 128): wider costs prefill compute about as "
                         "hidden^2 and leaves the KV a restore loads as it is (make_tiny_model.py --hidden)")
    ap.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second (default 2)")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals (default 60)")
    ap.add_argument("--prompt-len", default=f"chat:{ls.DEFAULT_CHAT_SCALE}",
                    help="fixed:N | uniform:A:B | lognormal:MEAN:SIGMA | chat[:SCALE] (default chat:0.5)")
    ap.add_argument("--output-len", default=f"chat:{ls.DEFAULT_CHAT_SCALE}",
                    help="the same, for the output (default chat:0.5)")
    ap.add_argument("--seed", type=int, default=1, help="the workload's seed (default 1)")
    ap.add_argument("--vary-seed", action="store_true", help="repetition r uses seed + r (default: the same seed)")
    ap.add_argument("--kill", action="append", default=[], metavar="AT:vllm|node:NODE",
                    help="a kill of the (single) scenario, e.g. 20:vllm:2; repeat (or comma-separate) for more; "
                         "the same AT = at once; NODE may be 'busiest'")
    ap.add_argument("--scenario", action="append", default=[], metavar="KILLS",
                    help="a scenario: comma-separated kills, e.g. 30:node:2,30:node:3; repeat for several "
                         "(instead of --kill; neither: one run without kills, the steady state)")
    ap.add_argument("--policies", default="lumen,fixed_ring,stop_restart",
                    help=f"comma-separated, of {', '.join(POLICIES)} (default lumen,fixed_ring,stop_restart)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="repetitions per policy, alternating p1 p2 p3 p1 ... (default 1)")
    ap.add_argument("--window", type=float, default=10.0,
                    help="seconds after a kill whose arrivals join the recovery window (default 10)")
    ap.add_argument("--arrival-window", type=float, default=3.0,
                    help="seconds after a kill whose new arrivals make the 'arrivals' TTFT' (default 3: the "
                         "recovery itself, where the policies differ; the 10-s window's TTFT mostly averages "
                         "what none of them changes)")
    ap.add_argument("--slo-ttft", type=float, help="TTFT SLO, s: adds slo_goodput")
    ap.add_argument("--slo-tpot", type=float, help="TPOT SLO, s: adds slo_goodput")
    ap.add_argument("--max-requests", type=int, default=5000, help="bound on the arrivals of one run (default 5000)")
    ap.add_argument("--request-timeout", type=float, default=600.0,
                    help="longest a stream may take, and the drain after the last arrival, s (default 600)")
    ap.add_argument("--pool-mib", type=int, default=512, help="each daemon's pool (default 512)")
    ap.add_argument("--max-num-seqs", type=int, help="vLLM's --max-num-seqs (vllm_server.py: 8), told to kvd control as --engine-max-seqs")
    ap.add_argument("--max-num-batched-tokens", type=int,
                    help="vLLM's --max-num-batched-tokens: the most tokens one engine step computes (its CPU "
                         "server's default, 2,048, takes a whole prompt, or two, in one step; a smaller cap "
                         "chunks prefills, so a resumed request waits at most one chunk)")
    ap.add_argument("--cluster-lookup", action=argparse.BooleanOptionalAction, default=False,
                    help="the connector's cluster lookup (default off: with it, a request recomputed after a "
                         "vLLM-only kill fetches its blocks from the dead engine's live daemon and is no "
                         "recomputation)")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="each engine on one core, round-robin (default on)")
    ap.add_argument("--restore-mb-per-s", type=int, default=450,
                    help="kvd control --restore-mb-per-s: the restore rate lumen's p_w assumes (default 450, the "
                         "CPU build's measured load rate; kvd control's own default is a GPU's 25,000)")
    ap.add_argument("--prefill-tokens-per-ms", type=int, default=2,
                    help="kvd control --prefill-tokens-per-ms: the prefill rate recovery planning assumes "
                         "(default 2, the CPU build's: a 1,000-token prefill of the 16-layer, 256-wide model "
                         "takes 446 ms on one core; kvd control's own default is 10)")
    ap.add_argument("--resume-priority", type=int, default=-1,
                    help="kvd control --resume-priority: vLLM's priority for an attempt that resumes an "
                         "interrupted request, with the engines on --scheduling-policy priority, so a "
                         "survivor takes it before its queued prompts (default -1; 0: off, the engines "
                         "schedule first come, first served)")
    ap.add_argument("--front-arg", action="append", default=[], metavar="ARG",
                    help="an extra argument for kvd control (repeat), e.g. --front-arg=--lambda --front-arg=2")
    ap.add_argument("--out", help="write the settings, raw records, figures and table as JSON here")
    ap.add_argument("--svg", help="write the TTFT-over-arrival plot here")
    args = ap.parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
        args.scenario = []
    pols = [p.strip().replace("-", "_") for p in args.policies.split(",") if p.strip()]
    bad = [p for p in pols if p not in POLICIES]
    if bad or not pols:
        ap.error(f"unknown policies {bad}; of {', '.join(POLICIES)}")
    args.policy_list = pols
    if args.kill and args.scenario:
        ap.error("--kill or --scenario, not both")
    if args.workers < 2:
        ap.error("at least 2 workers (a survivor and a holder)")
    if args.repeat < 1:
        ap.error("--repeat at least 1")
    try:
        args.prompt_dist = ls.parse_length(args.prompt_len, "prompt")
        args.output_dist = ls.parse_length(args.output_len, "output")
        texts = args.scenario or ([",".join(args.kill)] if args.kill else [""])
        args.scenarios = [(t or "no-kill", ls.parse_kills(t, args.workers)) for t in texts]
    except ValueError as e:
        ap.error(str(e))
    for name, kills in args.scenarios:
        late = [k.spec for k in kills if k.at >= args.duration]
        if late:
            log(f"warning: scenario {name}: kills {late} come after the last arrival ({args.duration} s)")
    return args


# ---- the cluster ---------------------------------------------------------------------------------

def cluster_parts():
    """The engine tests' harness (imported late: it needs the engine venv's pytest and vLLM)."""
    import test_stream_recovery as tsr
    from pd_handoff import Engine, nice_daemon
    from kvd_daemon import Daemon, wait_until
    from test_vllm import connector
    from vllm_server import SERVED_NAME, VllmServer
    return tsr, Engine, nice_daemon, Daemon, wait_until, connector, SERVED_NAME, VllmServer


def page_kib(layers: int) -> int:
    """A daemon page that holds one 32-token block of the tiny model (2 KV heads × 32 dims ×
    float32 × K and V = 512 bytes per token per layer), at least 64 KiB as the tests use."""
    return max(64, BLOCK * layers * 512 // 1024)


class Cluster:
    """etcd, N nodes, and ``kvd control --policy P`` with the front, for one run."""

    def __init__(self, folder: Path, model: Path, secret: Path, args: argparse.Namespace, policy: str) -> None:
        tsr, Engine, nice_daemon, Daemon, wait_until, connector, _, VllmServer = cluster_parts()
        self.folder, self.args, self.policy = folder, args, policy
        self.page_kib = page_kib(args.layers)
        ncpu = os.cpu_count() or 1
        outer = self

        class LumenNode(tsr.Node):
            """A node with the run's pool, page, connector settings and core."""

            def start_daemon(self) -> None:
                self.daemon = Daemon([
                    "--cluster-secret-file", str(self.secret), "--data-listen", f"127.0.0.1:{self.data_port}",
                    "--node-id", str(self.i), "--etcd", self.etcd.url, "--etcd-lease-ttl-ms", str(tsr.LEASE_TTL_MS),
                    "--pool-mib", str(args.pool_mib), "--page-kib", str(outer.page_kib)])
                try:  # the daemons get the CPU the engines' spinning threads would take (needs root)
                    nice_daemon(self.daemon)
                except OSError:
                    pass

            def connector(self) -> dict:
                assert self.daemon is not None
                return connector(self.daemon.socket, cluster_lookup=args.cluster_lookup)

            def vllm_args(self) -> list[str]:
                out = ["--max-num-seqs", str(args.max_num_seqs)] if args.max_num_seqs else []
                if args.max_num_batched_tokens:
                    out += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
                return out + (["--scheduling-policy", "priority"] if args.resume_priority else [])

            def start_vllm(self) -> None:
                assert self.daemon is not None
                self.starts += 1
                logf = self.tmp / f"vllm{self.i}.{self.starts}.log"
                if args.pin:
                    self.vllm = Engine((self.i - 1) % ncpu, self.model, self.vllm_port, logf, self.connector(),
                                       extra_args=self.vllm_args())
                else:
                    self.vllm = VllmServer(self.model, self.vllm_port, logf, self.connector(),
                                           extra_args=self.vllm_args())
                self.vllm.start()

        self.tsr, self.wait_until = tsr, wait_until
        self.etcd = tsr.Etcd(folder)
        self.nodes = {i: LumenNode(i, folder, self.etcd, secret, str(model)) for i in range(1, args.workers + 1)}
        self.front: Optional[Any] = None
        self.killed: set[int] = set()

    def start(self) -> None:
        t0 = time.monotonic()
        log(f"starting {len(self.nodes)} nodes (daemons, then the vLLM servers side by side)")
        self.tsr.start_nodes(self.nodes)
        log(f"engines up in {time.monotonic() - t0:.0f} s; warming each")
        for n in self.nodes.values():
            warm(n.url, 900_000 + n.i)
        self.front = start_front(self.folder, self.etcd, self.nodes, self.policy, self.page_kib * 1024 // BLOCK,
                                 ["--restore-mb-per-s", str(self.args.restore_mb_per_s),
                                  "--prefill-tokens-per-ms", str(self.args.prefill_tokens_per_ms),
                                  "--engine-max-seqs", str(self.args.max_num_seqs or VLLM_MAX_NUM_SEQS),
                                  *([f"--resume-priority={self.args.resume_priority}"]
                                    if self.args.resume_priority else []),
                                  *self.args.front_arg])
        ids = set(self.nodes)
        self.wait_until("every worker in service", lambda: self.front.in_service() == ids, timeout_s=60)
        log(f"kvd control --policy {self.policy} at {self.front.addr}, {len(ids)} workers in service")

    def alive(self) -> list[int]:
        return [i for i, n in self.nodes.items() if i not in self.killed and n.vllm is not None and n.vllm.alive()]

    def kill(self, targets: list[tuple[str, int]]) -> tuple[float, float]:
        """Signal every target at once (SIGKILL to vLLM's process group, and to the daemon for a
        ``node``), then reap them; the time of the first signal, and when the last vLLM server
        was reaped (its sockets close as the kernel tears the process down, and only then does
        the front see the break)."""
        t = time.monotonic()
        for what, i in targets:
            n = self.nodes[i]
            try:
                os.killpg(n.vllm.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, AttributeError):
                pass
            if what == "node" and n.daemon is not None:
                n.daemon.proc.kill()
            self.killed.add(i)
        for _, i in targets:
            self.nodes[i].vllm.kill9()  # reaps (the group is gone already); stop() sweeps
        gone = time.monotonic()
        for what, i in targets:
            n = self.nodes[i]
            if what == "node" and n.daemon is not None:
                n.daemon.proc.wait(timeout=30)
                self.save_daemon_log(n)
                n.daemon.stop()
        return t, gone

    def save_daemon_log(self, n) -> None:
        """The daemon's log lives in its own temporary folder, removed when it stops: keep a copy."""
        try:
            shutil.copyfile(Path(n.daemon.dir.name) / "daemon.log", self.folder / f"daemon{n.i}.log")
        except (OSError, AttributeError):
            pass

    def stop(self, keep: bool) -> None:
        if self.front is not None:
            self.front.stop()
        if keep:
            for n in self.nodes.values():
                if n.daemon is not None and n.daemon.proc.poll() is None:
                    self.save_daemon_log(n)
        stoppers = [threading.Thread(target=n.stop, daemon=True) for n in self.nodes.values()]
        for s in stoppers:
            s.start()
        for s in stoppers:
            s.join(120)
        self.etcd.stop()
        if keep or os.environ.get("KVD_KEEP_LOGS"):
            log(f"logs kept in {self.folder}")
        else:
            shutil.rmtree(self.folder, ignore_errors=True)


def start_front(folder: Path, etcd, nodes: dict, policy: str, kv_bytes_per_token: int, extra: list[str]):
    """``kvd control --policy P`` with the front over the engines: the engine tests' harness
    (test_stream_recovery.Front) with the run's policy and KV bytes per token, routing by load."""
    from test_stream_recovery import Front

    return Front(folder, etcd, nodes, extra=["--policy", policy, "--cache-routing", "false", "--max-streams", "1024",
                                             *extra], kv_bytes_per_token=kv_bytes_per_token)


def warm(url: str, seed: int) -> None:
    """One short request straight to an engine: its first-request costs are not the figures."""
    from vllm_server import SERVED_NAME
    body = {"model": SERVED_NAME, "prompt": ls.prompt_ids(seed, 0, 64), "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()


# ---- the clients ---------------------------------------------------------------------------------

def stream_one(addr: str, item: dict, t0: float, timeout_s: float, served: str) -> dict:
    """One request through the front: every event with its arrival time (s from ``t0``)."""
    rec: dict[str, Any] = {"i": item["i"], "at": item["at"], "prompt_len": item["prompt_len"],
                           "max_tokens": item["max_tokens"], "status": None, "request": None, "error": None,
                           "done": False}
    events: list[dict] = []
    tokens: list[int] = []
    body = {"model": served, "prompt": item["prompt"], "max_tokens": item["max_tokens"], "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    sent = time.monotonic()
    rec["sent"] = sent - t0
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
        resp = conn.getresponse()
        rec["status"] = resp.status
        if resp.status != 200:
            rec["error"] = f"HTTP {resp.status}: {resp.read(2000).decode(errors='replace')}"
            return finish(rec, events, tokens)
        rid = resp.getheader("x-kvd-request-id")
        rec["request"] = int(rid) if rid and rid.isdigit() else None
        deadline = sent + timeout_s
        max_events = 2 * item["max_tokens"] + 64
        eid, data = "", []
        for _ in range(64 * max_events):  # lines: bounded
            if time.monotonic() > deadline or len(events) >= max_events:
                rec["error"] = "stream timed out" if time.monotonic() > deadline else "too many events"
                break
            raw = resp.readline(1 << 20)
            if not raw:
                break
            line = raw.decode(errors="replace").rstrip("\r\n")
            if line:
                if line.startswith("id:"):
                    eid = line[3:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].strip())
                continue  # comments (keep-alives) and other fields
            if not data:
                continue
            text, t = "\n".join(data), time.monotonic() - t0
            ev: dict[str, Any] = {"id": eid, "t": t}
            if text == "[DONE]":
                ev["kind"] = "done"
            else:
                try:
                    d = json.loads(text)
                except ValueError:
                    d = {"error": f"not JSON: {text[:200]}"}
                if not isinstance(d, dict) or "error" in d:
                    ev["kind"], ev["error"] = "error", d.get("error") if isinstance(d, dict) else d
                else:
                    ids = [x for c in d.get("choices") or [] for x in (c.get("token_ids") or [])]
                    k = d.get("kvd") or {}
                    ev.update(kind="data", ntok=len(ids), epoch=k.get("epoch"), worker=k.get("worker"))
                    tokens += ids
            events.append(ev)
            eid, data = "", []
            if ev["kind"] == "done":
                rec["done"] = True
                break
    except (OSError, http.client.HTTPException) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return finish(rec, events, tokens)


def finish(rec: dict, events: list[dict], tokens: list[int]) -> dict:
    times = [e["t"] for e in events if e.get("kind") == "data" for _ in range(e.get("ntok") or 0)]
    rec["end"] = events[-1]["t"] if events else None
    rec["ttft"] = (times[0] - rec["sent"]) if times else None
    rec["tpot"] = ((times[-1] - times[0]) / (len(times) - 1)) if len(times) > 1 else None
    rec["token_times"] = [round(t, 4) for t in times]
    rec["attempts"] = ls.segments(events)
    rec["ids_agree"] = ls.id_token_counts_agree(events)
    rec["_events"], rec["_tokens"] = events, tokens
    return rec


def drive(cluster: Cluster, workload: list[dict], kills: list[ls.Kill],
          args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """Send the workload at its offsets and carry out the kills; every request's record and the
    kills as done."""
    from vllm_server import SERVED_NAME
    addr = cluster.front.addr
    results: list[Optional[dict]] = [None] * len(workload)
    kill_log: list[dict] = []
    t0 = time.monotonic() + 0.5

    def client(k: int) -> None:
        try:
            results[k] = stream_one(addr, workload[k], t0, args.request_timeout, SERVED_NAME)
        except Exception as e:  # a bug here must not hang the run: the request counts as wrong
            results[k] = finish({"i": workload[k]["i"], "at": workload[k]["at"], "sent": None, "status": None,
                                 "request": None, "prompt_len": workload[k]["prompt_len"], "done": False,
                                 "max_tokens": workload[k]["max_tokens"], "error": f"client: {e!r}"}, [], [])

    def killer() -> None:
        groups: dict[float, list[ls.Kill]] = {}
        for k in kills:
            groups.setdefault(k.at, []).append(k)
        for at in sorted(groups):
            delay = t0 + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            try:
                active = cluster.front.get("/status").get("active") or {}
            except Exception as e:  # the kill goes ahead; only "busiest" needs the list
                log(f"kill at {at:g} s: /status failed ({e!r})")
                active = {}
            load = {i: 0 for i in cluster.alive()}
            for a in active.values():
                if a.get("serving") in load:
                    load[a["serving"]] += 1
            targets: list[tuple[str, int]] = []
            for k in groups[at]:
                if k.node == "busiest":
                    left = [i for i in load if i not in [t for _, t in targets]]
                    if not left:
                        log(f"kill at {at:g} s: no live worker left for {k.spec}")
                        continue
                    i = max(left, key=lambda w: (load[w], -w))
                else:
                    i = int(k.node)
                targets.append((k.what, i))
            t, gone = cluster.kill(targets)
            hit = sorted(int(r) for r, a in active.items() if a.get("serving") in [i for _, i in targets])
            entry = {"planned": at, "at": t - t0, "reaped_ms": (gone - t) * 1000,
                     "targets": [f"{w}:{i}" for w, i in targets],
                     "serving_on_killed": sum(load.get(i, 0) for _, i in targets), "active": len(active),
                     "requests_on_killed": hit}
            kill_log.append(entry)
            log(f"killed {', '.join(entry['targets'])} at {entry['at']:.2f} s, reaped after "
                f"{entry['reaped_ms']:.0f} ms ({entry['serving_on_killed']} of {len(active)} running requests on them)")

    kt = threading.Thread(target=killer, daemon=True)
    kt.start()
    threads = []
    last = time.monotonic()
    for k, item in enumerate(workload):
        delay = t0 + item["at"] - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=client, args=(k,), daemon=True)
        th.start()
        threads.append(th)
        if time.monotonic() - last >= 5:
            last = time.monotonic()
            log(f"t={last - t0:.0f} s: {k + 1}/{len(workload)} sent, {sum(t.is_alive() for t in threads)} streaming")
    deadline = time.monotonic() + args.request_timeout + 5
    for _ in range(int(args.request_timeout) + 10):  # the drain, one progress line per 5 s
        live = [t for t in threads if t.is_alive()]
        if not live or time.monotonic() > deadline:
            break
        live[0].join(5)
        if time.monotonic() - last >= 5:
            last = time.monotonic()
            log(f"draining: {sum(t.is_alive() for t in threads)} streaming")
    kt.join(max(0.0, max((k.at for k in kills), default=0) + t0 - time.monotonic()) + 120)
    records = []
    for k, r in enumerate(results):
        if r is None:  # still streaming past the deadline (its thread is a daemon and dies with us)
            r = finish({"i": workload[k]["i"], "at": workload[k]["at"], "sent": None, "status": None, "request": None,
                        "prompt_len": workload[k]["prompt_len"], "max_tokens": workload[k]["max_tokens"],
                        "done": False, "error": "still streaming at the deadline"}, [], [])
        records.append(r)
    return records, kill_log


# ---- the reference pass --------------------------------------------------------------------------

def reference(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    """The uninterrupted greedy output, straight from one engine's vLLM (no front)."""
    from vllm_server import SERVED_NAME
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"reference: HTTP {resp.status}: {resp.read(2000)!r}")
        out: list[int] = []
        for _ in range(4 * max_tokens + 64):
            raw = resp.readline(1 << 20)
            if not raw:
                break
            line = raw.decode().strip()
            if line.startswith("data: {"):
                for c in json.loads(line[6:]).get("choices") or []:
                    out += c.get("token_ids") or []
        return out
    finally:
        conn.close()


def reference_pass(cluster: Cluster, workload: list[dict], refs: dict[str, list[int]]) -> None:
    missing = [w for w in workload if ls.ref_key(w["prompt"], w["max_tokens"]) not in refs]
    if not missing:
        return
    alive = cluster.alive()
    if not alive:
        raise RuntimeError("no engine left for the reference pass")
    url = cluster.nodes[alive[0]].url
    log(f"reference pass: {len(missing)} prompts straight to node {alive[0]}'s vLLM")
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda w: reference(url, w["prompt"], w["max_tokens"]), missing))
    for w, o in zip(missing, outs):
        refs[ls.ref_key(w["prompt"], w["max_tokens"])] = o


# ---- one run, all runs ---------------------------------------------------------------------------

FRONT_COUNTERS = ("streams_started", "streams_refused", "admissions_repicked",
                  "streams_finished", "streams_failed", "recoveries",
                  "recoveries_from_checkpoint", "recoveries_recomputed", "restored_tokens", "recomputed_tokens",
                  "recovery_ms", "workers_failed", "checkpoint_moves_unfollowed", "holder_calls_failed",
                  "checkpoint_reports_clamped", "checkpoint_bytes", "checkpoint_tokens")


def engine_sources(cluster: Cluster, ids: list[int]) -> dict[int, dict[str, float]]:
    out = {}
    for i in ids:
        try:
            text = cluster.tsr.get_text(cluster.nodes[i].url + "/metrics")
        except OSError:
            continue
        out[i] = {k: cluster.tsr.metric(text, "vllm:prompt_tokens_by_source_total", source=k)
                  for k in ("local_compute", "local_cache_hit", "external_kv_transfer")}
    return out


def one_run(ctx: dict, scen: str, kills: list[ls.Kill], policy: str, rep: int, workload: list[dict]) -> dict:
    args = ctx["args"]
    folder = ctx["tmp"] / f"{len(ctx['runs']):02d}-{policy}-r{rep}"
    folder.mkdir()
    cluster = Cluster(folder, ctx["model"], ctx["secret"], args, policy)
    problems: Optional[list[dict]] = None  # None until the run is checked: its logs are kept
    try:
        cluster.start()
        before_src = engine_sources(cluster, list(cluster.nodes))
        before = cluster.front.get("/status")
        log(f"load: {len(workload)} requests over {args.duration:g} s; kills {[k.spec for k in kills] or 'none'}")
        records, kill_log = drive(cluster, workload, kills, args)
        after = cluster.front.get("/status")
        after_src = engine_sources(cluster, cluster.alive())
        reference_pass(cluster, workload, ctx["refs"])
        kill_times = sorted(k["at"] for k in kill_log)
        on_killed = {x for k in kill_log for x in k["requests_on_killed"]}
        found = []
        for w, r in zip(workload, records):
            r["on_killed_worker"] = r.get("request") in on_killed
            ref = ctx["refs"].get(ls.ref_key(w["prompt"], w["max_tokens"]))
            p = ([r["error"]] if r.get("error") else []) + \
                ls.check_stream(r["_events"], r.get("request"), r["_tokens"], w["max_tokens"], ref)
            r["problems"] = p
            r["exact"] = not p
            r["stalls"] = ls.stalls(r["attempts"], kill_times)
            if p:
                found.append({"i": w["i"], "request": r.get("request"), "problems": p})
        problems = found
    finally:
        cluster.stop(keep=problems is None or bool(problems))
    fig = ls.run_figures(records, kill_times, args.window, args.slo_ttft, args.slo_tpot, args.arrival_window)
    fb, fa = before.get("front") or {}, after.get("front") or {}
    front = {k: (fa.get(k) or 0) - (fb.get(k) or 0) for k in FRONT_COUNTERS}
    fig.update({k: front[k] for k in ("recoveries", "recoveries_from_checkpoint", "recoveries_recomputed",
                                      "restored_tokens", "recomputed_tokens")})
    fig["front_recovery_ms_mean"] = (front["recovery_ms"] / front["recoveries"]) if front["recoveries"] else None
    fig["engine_loaded_tokens"] = sum(a["external_kv_transfer"] - before_src.get(i, {}).get("external_kv_transfer", 0)
                                      for i, a in after_src.items())
    fig["engine_computed_tokens"] = sum(a["local_compute"] - before_src.get(i, {}).get("local_compute", 0)
                                        for i, a in after_src.items())
    fig["ids_disagree"] = sum(1 for r in records if not r["ids_agree"])
    for r in records:
        r.pop("_events", None)
        r.pop("_tokens", None)
    log(f"{scen} / {policy} / rep {rep + 1}: {fig['exact']}/{fig['requests']} exact, {fig['interrupted']} interrupted, "
        f"TTFT mean {num(fig['ttft_ms_mean'])} ms, window TTFT mean {num(fig['win_ttft_ms_mean'])} ms, "
        f"arrivals' TTFT mean {num(fig['arr_ttft_ms_mean'])} ms, "
        f"recovery time {num(fig['recovery_time_ms'])} ms, restored/recomputed {front['restored_tokens']}/"
        f"{front['recomputed_tokens']} tokens, goodput {num(fig['goodput_tok_s'])} tok/s")
    for p in problems[:10]:
        log(f"  WRONG request {p['i']} (front id {p['request']}): {'; '.join(p['problems'])}")
    return {"scenario": scen, "policy": policy, "rep": rep, "kills": kill_log, "figures": fig, "front": front,
            "controller": after.get("controller"), "recoveries": after.get("recoveries"),
            "problems": problems, "records": records}


def num(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.0f}"


def run(args: argparse.Namespace) -> dict:
    """Every scenario × repetition × policy (policies alternating within a repetition); the
    result (also written to ``--out``)."""
    cluster_parts()  # fails here, before any process starts, outside the engine venv
    tmp, model, secret = make_folder(args.layers, args.hidden)
    ctx: dict[str, Any] = {"args": args, "tmp": tmp, "model": model, "secret": secret, "refs": {}, "runs": []}
    t_start = time.monotonic()
    finished = False
    try:
        plan = [(scen, kills, rep, pol) for scen, kills in args.scenarios
                for rep in range(args.repeat) for pol in args.policy_list]
        for n, (scen, kills, rep, pol) in enumerate(plan):
            seed = args.seed + (rep if args.vary_seed else 0)
            workload = ls.make_workload(seed, args.rate, args.duration, args.prompt_dist, args.output_dist,
                                        cap=args.max_requests)
            log(f"run {n + 1}/{len(plan)}: scenario {scen}, policy {pol}, "
                f"repetition {rep + 1}/{args.repeat}, seed {seed}")
            ctx["runs"].append(one_run(ctx, scen, kills, pol, rep, workload))
        finished = True
    finally:
        # a run's folder (under tmp) is kept when it failed or found a wrong stream
        if finished and not os.environ.get("KVD_KEEP_LOGS") and not any(r["problems"] for r in ctx["runs"]):
            shutil.rmtree(tmp, ignore_errors=True)
        elif not finished:
            log(f"stopped early; logs in {tmp}")
    result = summarise(ctx, args, time.monotonic() - t_start)
    print(result["table_text"])
    if args.out:
        Path(args.out).write_text(json.dumps({k: v for k, v in result.items() if k != "_svg"}, indent=1, default=str))
        log(f"figures and records in {args.out}")
    svg = result.pop("_svg")
    if args.svg:
        Path(args.svg).write_text(svg)
        log(f"plot in {args.svg}")
    return result


def make_folder(layers: int, hidden: int) -> tuple[Path, Path, Path]:
    """A fresh folder with the tiny model (``layers`` deep, ``hidden`` wide) and a cluster secret."""
    tmp = Path(tempfile.mkdtemp(prefix="kvd-bench-lumen-"))
    model = tmp / "model"
    subprocess.run([sys.executable, str(ENGINES / "make_tiny_model.py"), str(model), "--layers", str(layers),
                    "--hidden", str(hidden)], check=True, capture_output=True)
    secret = tmp / "secret"
    secret.write_bytes(bytes(range(32)))
    secret.chmod(0o600)
    return tmp, model, secret


def summarise(ctx: dict, args: argparse.Namespace, wall_s: float) -> dict:
    rows, table = [], {}
    for scen, _ in args.scenarios:
        for pol in args.policy_list:
            figs = [r["figures"] for r in ctx["runs"] if r["scenario"] == scen and r["policy"] == pol]
            if figs:
                agg = ls.aggregate(figs)
                rows.append((scen, pol, agg))
                table.setdefault(scen, {})[pol] = agg
    panels = []
    for scen, kills in args.scenarios:
        series: dict[str, list] = {}
        kt: list[float] = []
        for r in ctx["runs"]:
            if r["scenario"] != scen:
                continue
            series.setdefault(r["policy"], []).extend(
                (x["sent"], x["ttft"]) for x in r["records"] if x.get("sent") is not None and x.get("ttft"))
            kt = kt or [k["at"] for k in r["kills"]]
        panels.append({"title": f"TTFT over arrival time: {scen} ({args.workers} workers, {args.rate:g}/s)",
                       "kills": kt or [k.at for k in kills], "series": series})
    text = (f"\nLUMEN load: {args.workers} workers, tiny model {args.layers} layers hidden {args.hidden}, {args.rate:g} req/s for "
            f"{args.duration:g} s, prompts {args.prompt_len}, outputs {args.output_len}, seed {args.seed}, "
            f"{args.repeat} repetition(s), window {args.window:g} s; {wall_s / 60:.1f} min\n\n" + ls.table(rows))
    wrong = sum(len(r["problems"]) for r in ctx["runs"])
    recovered = sum(r["front"]["recoveries"] for r in ctx["runs"])
    exact = "yes" if not wrong else f"NO ({wrong} wrong)"
    comp = ls.comparisons(table, [b for b in ("stop_restart", "fixed_ring") if b in args.policy_list])
    text += ls.comparison_text(comp)
    text += f"every stream exact: {exact}; recoveries in all runs: {recovered}\n"
    settings = {k: v for k, v in vars(args).items() if k not in ("prompt_dist", "output_dist", "scenarios")}
    settings["scenarios"] = [[s, [k.spec for k in ks]] for s, ks in args.scenarios]
    return {"settings": settings, "wall_s": wall_s, "ok": wrong == 0, "wrong": wrong, "recoveries": recovered,
            "table": table, "comparisons": comp, "runs": ctx["runs"], "table_text": text, "_svg": ls.svg_plot(panels)}


def stop_on_signal(signum: int, _frame: Any) -> None:
    """SIGTERM or SIGHUP (a stop from outside, a closed terminal) unwinds like Ctrl-C, so the
    run's ``finally`` stops its engines: each vLLM server runs in its own session, out of reach of
    a signal to this process's group, and would otherwise outlive the run (2.5 GB per process)."""
    raise KeyboardInterrupt(f"stopped by signal {signum}")


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop_on_signal)
    if not os.environ.get("KVD_BIN"):
        print("lumen_load.py: KVD_BIN must name the kvd binary (scripts/bench-lumen.sh sets it)", file=sys.stderr)
        return 2
    result = run(args)
    if args.smoke:
        if not result["ok"]:
            print(f"smoke: {result['wrong']} stream(s) not exact", file=sys.stderr)
            return 1
        if result["recoveries"] < 1:
            print("smoke: the kill interrupted no request (nothing was recovered)", file=sys.stderr)
            return 1
        print("smoke: every stream exact across the kill", file=sys.stderr)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
