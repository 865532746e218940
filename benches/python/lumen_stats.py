"""The pure-Python half of the LUMEN load generator (``lumen_load.py``): the workload (length
distributions, Poisson arrivals, prompts), the per-stream correctness check, the figures of one
run, their mean and 95 % interval over repetitions, the summary table and the SVG plot.

Nothing here starts a process or opens a socket, so every function can be checked with any
Python 3.9+ (``python3 -c 'import lumen_stats'``) while the cluster half needs the engine venv.
``python3 lumen_stats.py steady LUMEN.json...`` pools the steady state (the time before each
run's first kill) of several runs: checkpointing on against off, paired by repetition.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

# vllm_server.py's --max-model-len: a request's prompt + max_tokens must fit in it.
CONTEXT = 2048
# The shortest output drawn (TPOT needs two tokens).
MIN_OUTPUT = 2
# The tiny model's vocabulary: 4 special tokens, then w0..w1999 (make_tiny_model.py). Prompts are
# token ids in [PROMPT_ID_LO, PROMPT_ID_HI): no special token (no </s> in a prompt).
PROMPT_ID_LO, PROMPT_ID_HI = 5, 2004

# The conversation-trace shape of ``kvd sim`` (kvd/crates/sim/src/workload.rs, PROMPT_QUANTILES
# and OUTPUT_QUANTILES; docs/SIMULATION.md, "Workload"): quantile anchors (probability, tokens),
# interpolated linearly in log space. Prompts: median 1,000, mean ~1,150, p99 4,100; outputs:
# median 130, mean ~210, p99 600. The seeds' LUMEN summary names a chat workload but gives no
# length distribution, so the simulator's (which its own issue fitted to those moments) is the
# shape used here, so that a run sits beside ``kvd sim``'s prediction for the same set-up.
CHAT_PROMPT_QUANTILES = ((0.0, 16.0), (0.05, 180.0), (0.25, 560.0), (0.5, 1000.0), (0.75, 1465.0),
                         (0.9, 2200.0), (0.97, 3150.0), (0.99, 4100.0), (1.0, 8000.0))
CHAT_OUTPUT_QUANTILES = ((0.0, 2.0), (0.05, 12.0), (0.25, 52.0), (0.5, 130.0), (0.75, 360.0),
                         (0.9, 560.0), (0.97, 590.0), (0.99, 600.0), (1.0, 1000.0))
# The default scale of that shape: halved, so that a prompt's p99 plus an output's p99 (2,050 +
# 300) is near the tiny model's 2,048-token context and few requests are clipped.
DEFAULT_CHAT_SCALE = 0.5

# Two-sided 95 % Student-t critical values for 1..30 degrees of freedom.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
         2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
         2.052, 2.048, 2.045, 2.042)


# ---- the workload --------------------------------------------------------------------------------

@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: ``fixed:N``, ``uniform:A:B`` (integers, both ends included),
    ``lognormal:MEAN:SIGMA`` (MEAN is the distribution's own mean in tokens, SIGMA the σ of its
    logarithm), ``chat[:SCALE]`` (kvd sim's conversation shape, every length × SCALE)."""

    spec: str
    kind: str
    a: float
    b: float
    table: tuple = ()

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            x = self.a
        elif self.kind == "uniform":
            x = rng.randint(int(self.a), int(self.b))
        elif self.kind == "lognormal":
            mu = math.log(self.a) - self.b * self.b / 2
            x = rng.lognormvariate(mu, self.b)
        else:  # chat: inverse transform of the quantile table, × scale
            x = quantile(self.table, rng.random()) * self.a
        return max(1, int(round(x)))


def parse_length(spec: str, which: str) -> LengthDist:
    """Read a ``--prompt-len`` / ``--output-len`` value (``which`` is "prompt" or "output")."""
    parts = spec.strip().split(":")
    kind = parts[0].lower()
    try:
        nums = [float(p) for p in parts[1:]]
    except ValueError:
        raise ValueError(f"{spec!r}: the numbers after the kind must be numbers") from None
    if kind == "fixed" and len(nums) == 1 and nums[0] >= 1:
        return LengthDist(spec, kind, nums[0], 0)
    if kind == "uniform" and len(nums) == 2 and 1 <= nums[0] <= nums[1]:
        return LengthDist(spec, kind, nums[0], nums[1])
    if kind == "lognormal" and len(nums) == 2 and nums[0] >= 1 and nums[1] >= 0:
        return LengthDist(spec, kind, nums[0], nums[1])
    if kind == "chat" and len(nums) <= 1 and (not nums or nums[0] > 0):
        table = CHAT_PROMPT_QUANTILES if which == "prompt" else CHAT_OUTPUT_QUANTILES
        return LengthDist(spec, kind, nums[0] if nums else 1.0, 0, table)
    raise ValueError(f"{spec!r} is not a length distribution: fixed:N, uniform:A:B (A <= B), "
                     "lognormal:MEAN:SIGMA or chat[:SCALE]")


def quantile(table: Sequence[tuple[float, float]], u: float) -> float:
    """The quantile at probability ``u`` of an anchor table, linear in log space between anchors
    (as kvd sim's ``QuantileTable::quantile``)."""
    u = min(1.0, max(0.0, u))
    for (p0, v0), (p1, v1) in zip(table, table[1:]):
        if u <= p1:
            t = (u - p0) / (p1 - p0)
            return math.exp(math.log(v0) + t * (math.log(v1) - math.log(v0)))
    return table[-1][1]


def clip_lengths(prompt: int, output: int, context: int = CONTEXT) -> tuple[int, int]:
    """Fit a drawn (prompt, output) pair into the context: the prompt to [1, context −
    MIN_OUTPUT], then the output to [MIN_OUTPUT, context − prompt]. vLLM refuses a request whose
    prompt + max_tokens passes max-model-len, and the front's resubmission after a break keeps
    that sum, so every drawn request fits as it is sent."""
    p = min(max(1, prompt), context - MIN_OUTPUT)
    o = min(max(MIN_OUTPUT, output), context - p)
    return p, o


def poisson_arrivals(rate: float, duration: float, rng: random.Random, cap: int) -> list[float]:
    """Arrival offsets (s) of a Poisson process of ``rate`` per second over ``[0, duration)``, at
    most ``cap`` of them (the loop is bounded by the cap; reaching it is an error the caller
    reports, never a silent truncation)."""
    if rate <= 0 or duration <= 0:
        return []
    out: list[float] = []
    t = 0.0
    for _ in range(cap + 1):
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append(t)
    raise ValueError(f"more than {cap} arrivals at {rate}/s over {duration} s (raise --max-requests)")


def prompt_ids(seed: int, i: int, length: int) -> list[int]:
    """Request ``i``'s prompt: ``length`` token ids from its own seeded generator, so no two
    requests share a first block (no prefix-cache hit between requests anywhere)."""
    rng = random.Random(f"lumen-prompt-{seed}-{i}")
    return [rng.randrange(PROMPT_ID_LO, PROMPT_ID_HI) for _ in range(length)]


def make_workload(seed: int, rate: float, duration: float, prompt_dist: LengthDist,
                  output_dist: LengthDist, context: int = CONTEXT, cap: int = 10_000) -> list[dict]:
    """The whole request list, from the seed alone: arrivals, lengths (clipped to the context)
    and prompts. Every policy and repetition with the same seed gets exactly this list."""
    arrivals = poisson_arrivals(rate, duration, random.Random(f"lumen-arrivals-{seed}"), cap)
    lengths = random.Random(f"lumen-lengths-{seed}")
    out = []
    for i, at in enumerate(arrivals):
        p, o = clip_lengths(prompt_dist.sample(lengths), output_dist.sample(lengths), context)
        out.append({"i": i, "at": at, "prompt_len": p, "max_tokens": o, "prompt": prompt_ids(seed, i, p)})
    return out


def ref_key(prompt: Sequence[int], max_tokens: int) -> str:
    """The key of a request's uninterrupted greedy output: its prompt and its length."""
    h = hashlib.sha256(json.dumps([list(prompt), max_tokens]).encode()).hexdigest()
    return h[:32]


# ---- kills ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Kill:
    """``AT:WHAT:NODE``: at AT seconds after the first arrival, kill -9 NODE's vLLM (``vllm``) or
    its vLLM and its kvd daemon (``node``). NODE is a node id (1..workers) or ``busiest`` (the
    worker serving the most requests at that instant, by the front's /status)."""

    at: float
    what: str
    node: str

    @property
    def spec(self) -> str:
        return f"{self.at:g}:{self.what}:{self.node}"


def parse_kills(text: str, workers: int) -> list[Kill]:
    """A comma-separated list of kills (one scenario)."""
    kills = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        bits = part.split(":")
        if len(bits) != 3:
            raise ValueError(f"{part!r}: a kill is AT:vllm|node:NODE, e.g. 20:vllm:2")
        try:
            at = float(bits[0])
        except ValueError:
            raise ValueError(f"{part!r}: AT must be seconds") from None
        what, node = bits[1].lower(), bits[2].lower()
        if what not in ("vllm", "node") or at < 0:
            raise ValueError(f"{part!r}: AT must be >= 0 and WHAT vllm or node")
        if node != "busiest" and not (node.isdigit() and 1 <= int(node) <= workers):
            raise ValueError(f"{part!r}: NODE must be 1..{workers} or busiest")
        kills.append(Kill(at, what, node))
    named = [k.node for k in kills if k.node != "busiest"]
    if len(named) != len(set(named)):
        raise ValueError(f"{text!r}: a node is killed twice")
    if len(kills) >= workers:
        raise ValueError(f"{text!r}: {len(kills)} kills leave no survivor of {workers} workers")
    return sorted(kills, key=lambda k: k.at)


# ---- one stream ----------------------------------------------------------------------------------

def parse_event_id(eid: str) -> Optional[tuple[int, int, int]]:
    """``R-S-T`` → (request, sequence number, tokens so far), or None."""
    bits = eid.split("-")
    if len(bits) != 3 or not all(b.isdigit() for b in bits):
        return None
    return int(bits[0]), int(bits[1]), int(bits[2])


def check_stream(events: Sequence[dict], request: Optional[int], tokens: Sequence[int], max_tokens: int,
                 reference: Optional[Sequence[int]]) -> list[str]:
    """What is wrong with one stream (empty: it is exact). ``events`` are the client's parsed
    SSE events in arrival order, each ``{"id": "R-S-T" or "", "kind": "data"|"done"|"error", ...}``.
    Exact means: every event numbered ``R-0, R-1, ...`` once each, in order (no gap, no
    duplicate), all of request R, no error event, a ``[DONE]`` at the end, ``max_tokens``
    tokens (``ignore_eos``) equal to the uninterrupted greedy output ``reference``."""
    problems: list[str] = []
    if not events:
        return ["no events"]
    seqs = []
    for e in events:
        p = parse_event_id(e.get("id", ""))
        if p is None:
            problems.append(f"an event without an R-S-T id: {e.get('id')!r}")
            break
        if request is not None and p[0] != request:
            problems.append(f"an event of request {p[0]} in request {request}'s stream")
            break
        seqs.append(p[1])
    if not problems and seqs != list(range(len(seqs))):
        problems.append(sequence_fault(seqs))
    errors = [e for e in events if e.get("kind") == "error"]
    if errors:
        problems.append(f"{len(errors)} error event(s): {str(errors[0].get('error'))[:300]}")
    if events[-1].get("kind") != "done":
        problems.append("no [DONE] at the end")
    if len(tokens) != max_tokens:
        problems.append(f"{len(tokens)} tokens, {max_tokens} asked (ignore_eos)")
    if reference is None:
        problems.append("no reference output to compare with")
    elif list(tokens) != list(reference):
        k = next((j for j, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
        problems.append(f"tokens differ from the uninterrupted greedy output from token {k}")
    return problems


def sequence_fault(seqs: Sequence[int]) -> str:
    """Name the first gap or duplicate of a sequence that should be 0, 1, 2, ..."""
    seen: set[int] = set()
    for k, s in enumerate(seqs):
        if s in seen:
            return f"duplicate sequence number {s} (event {k})"
        if s != k:
            return f"gap: event {k} has sequence number {s}"
        seen.add(s)
    return "sequence out of order"


def id_token_counts_agree(events: Sequence[dict]) -> bool:
    """Whether each token-bearing event's id T equals the tokens received up to and with it (a
    side check, reported, not part of exactness)."""
    n = 0
    for e in events:
        if e.get("kind") != "data":
            continue
        n += e.get("ntok", 0)
        p = parse_event_id(e.get("id", ""))
        if p is not None and e.get("ntok", 0) and p[2] != n:
            return False
    return True


# ---- the figures of one run ----------------------------------------------------------------------

def pct(xs: Sequence[float], q: float) -> Optional[float]:
    """The q-th percentile, linear between order statistics (numpy's default, Python's
    ``statistics.quantiles(method="inclusive")``); None of nothing."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def describe(xs: Sequence[float], prefix: str, scale: float = 1000.0) -> dict[str, Optional[float]]:
    """mean, p50, p90, p99 of ``xs`` × ``scale`` (seconds → ms), keyed ``prefix_mean`` ..."""
    out: dict[str, Optional[float]] = {f"{prefix}_mean": (sum(xs) / len(xs) * scale) if xs else None}
    for q in (50, 90, 99):
        v = pct(xs, q)
        out[f"{prefix}_p{q}"] = None if v is None else v * scale
    return out


def segments(events: Sequence[dict]) -> list[dict]:
    """The stream's attempts as the client saw them: one entry per epoch of its token-bearing
    events, ``{"epoch", "worker", "t", "token"}`` (first event's time, tokens before it)."""
    out: list[dict] = []
    n = 0
    for e in events:
        if e.get("kind") != "data" or not e.get("ntok"):
            continue
        if not out or e.get("epoch") != out[-1]["epoch"]:
            out.append({"epoch": e.get("epoch"), "worker": e.get("worker"), "t": e["t"], "token": n})
        n += e["ntok"]
    return out


def stalls(segs: Sequence[dict], kill_times: Sequence[float]) -> list[float]:
    """Recovery time of each of a request's recoveries: the kill before it → the first token of
    the new attempt at the client. An attempt is a recovery when its epoch is above 1 (the front
    bumps the epoch only when it resumes a request on a survivor; a request broken before its
    first token shows a first attempt of epoch 2)."""
    out = []
    for s in segs:
        if (s.get("epoch") or 1) <= 1:
            continue
        before = [k for k in kill_times if k <= s["t"]]
        if before:
            out.append(s["t"] - before[-1])
    return out


def in_window(rec: dict, kill_times: Sequence[float], window_s: float) -> bool:
    """The recovery window: in flight at a kill (sent before it, its last event after it), or
    sent within ``window_s`` after it."""
    sent, end = rec.get("sent"), rec.get("end")
    if sent is None:
        return False
    return any(sent <= k and (end is None or end > k) for k in kill_times) or \
        arrived_after(rec, kill_times, window_s)


def arrived_after(rec: dict, kill_times: Sequence[float], window_s: float) -> bool:
    """Sent within ``window_s`` after a kill: a new arrival that meets the recovery (those in
    flight at the kill are left out; their first token mostly came before it)."""
    sent = rec.get("sent")
    return sent is not None and any(k <= sent <= k + window_s for k in kill_times)


def before_kill(records: Sequence[dict], kill_times: Sequence[float]) -> tuple[list[float], list[float]]:
    """The steady state a run holds before its first kill (the whole run without one): the TTFT
    of each request whose first token came before it, and the TPOT of each request over its
    tokens before it (the mean gap between them; three tokens at least), in seconds."""
    first = min(kill_times) if kill_times else math.inf
    ttft, tpot = [], []
    for r in records:
        if r.get("ttft") is not None and r.get("sent") is not None and r["sent"] + r["ttft"] < first:
            ttft.append(r["ttft"])
        ts = [t for t in (r.get("token_times") or []) if t < first]
        if len(ts) >= 3:
            tpot.append((ts[-1] - ts[0]) / (len(ts) - 1))
    return ttft, tpot


def run_figures(records: Sequence[dict], kill_times: Sequence[float], window_s: float,
                slo_ttft_s: Optional[float] = None, slo_tpot_s: Optional[float] = None,
                arrival_window_s: float = 3.0) -> dict[str, Any]:
    """One run's figures from its per-request records (``sent``, ``ttft``, ``tpot``, ``end``,
    ``exact``, ``max_tokens``, ``stalls``, ``status``; times in seconds from the run's start).

    TTFT and TPOT are over the requests that completed (their [DONE] came), exact or not; the
    window's are over those of them in the recovery window; the arrivals' (``arr_``) over those
    sent within ``arrival_window_s`` after a kill. Goodput is the output tokens of the
    exact requests over the span from the first request sent to the last event of any request
    (tokens/s); with SLOs, ``slo_goodput`` counts only the exact requests within both."""
    done = [r for r in records if r.get("ttft") is not None and r.get("done")]
    win = [r for r in done if in_window(r, kill_times, window_s)]
    arrived = [r for r in done if arrived_after(r, kill_times, arrival_window_s)]
    f: dict[str, Any] = {
        "requests": len(records),
        "completed": len(done),
        "exact": sum(1 for r in records if r.get("exact")),
        "wrong": sum(1 for r in records if not r.get("exact")),
        "refused": sum(1 for r in records if r.get("status") not in (None, 200)),
        "interrupted": sum(1 for r in records if r.get("stalls")),
        "window_requests": len(win),
        "arrival_requests": len(arrived),
    }
    f.update(describe([r["ttft"] for r in done], "ttft_ms"))
    f.update(describe([r["tpot"] for r in done if r.get("tpot") is not None], "tpot_ms"))
    f.update(describe([r["ttft"] for r in win], "win_ttft_ms"))
    f.update(describe([r["tpot"] for r in win if r.get("tpot") is not None], "win_tpot_ms"))
    f.update(describe([r["ttft"] for r in arrived], "arr_ttft_ms"))
    pre_ttft, pre_tpot = before_kill(records, kill_times)
    f.update(describe(pre_ttft, "pre_ttft_ms"))
    f["pre_tpot_ms_mean"] = (sum(pre_tpot) / len(pre_tpot) * 1000) if pre_tpot else None
    rates = [1.0 / r["tpot"] for r in done if r.get("tpot")]
    f["decode_tok_s_mean"] = (sum(rates) / len(rates)) if rates else None  # per request, after its first token
    st = [s for r in records for s in (r.get("stalls") or [])]
    f["stall_mean_ms"] = (sum(st) / len(st) * 1000) if st else None
    f["stall_p50_ms"] = None if not st else pct(st, 50) * 1000  # type: ignore[operator]
    f["recovery_time_ms"] = (max(st) * 1000) if st else None  # the last interrupted request's stall
    sent = [r["sent"] for r in records if r.get("sent") is not None]
    ends = [r["end"] for r in records if r.get("end") is not None]
    span = (max(ends) - min(sent)) if sent and ends and max(ends) > min(sent) else None
    good = sum(r["max_tokens"] for r in records if r.get("exact"))
    f["span_s"] = span
    f["goodput_tok_s"] = (good / span) if span else None
    if slo_ttft_s is not None or slo_tpot_s is not None:
        ok = [r for r in records if r.get("exact")
              and (slo_ttft_s is None or r["ttft"] <= slo_ttft_s)
              and (slo_tpot_s is None or (r.get("tpot") or 0) <= slo_tpot_s)]
        f["slo_goodput_tok_s"] = (sum(r["max_tokens"] for r in ok) / span) if span else None
    return f


# ---- over repetitions ----------------------------------------------------------------------------

def t975(df: int) -> float:
    """The two-sided 95 % Student-t critical value (a table to 30 degrees of freedom, then the
    Cornish-Fisher expansion, within 0.001 of the exact value)."""
    if df < 1:
        raise ValueError("no interval from one value")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df * df)


def mean_ci(xs: Iterable[Optional[float]]) -> tuple[Optional[float], Optional[float], int]:
    """(mean, half-width of its 95 % t interval or None with one value, n) of the non-None
    values."""
    v = [x for x in xs if x is not None]
    if not v:
        return None, None, 0
    m = sum(v) / len(v)
    if len(v) < 2:
        return m, None, 1
    sd = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1))
    return m, t975(len(v) - 1) * sd / math.sqrt(len(v)), len(v)


def aggregate(figures: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every numeric figure of the repetitions: {"mean", "ci95", "n", "values"}."""
    keys: list[str] = []
    for f in figures:
        for k, v in f.items():
            if k not in keys and (v is None or isinstance(v, (int, float))) and not isinstance(v, bool):
                keys.append(k)
    out = {}
    for k in keys:
        vals = [f.get(k) for f in figures]
        m, hw, n = mean_ci(vals)
        out[k] = {"mean": m, "ci95": hw, "n": n, "values": vals}
    return out


def cell(a: Optional[dict[str, Any]], digits: int = 0) -> str:
    """``mean ±hw`` of an aggregated figure."""
    if not a or a.get("mean") is None:
        return "-"
    m = f"{a['mean']:.{digits}f}"
    return m if a.get("ci95") is None else f"{m} ±{a['ci95']:.{digits}f}"


TABLE_BLOCKS = (
    ("all requests (ms)", [("TTFT mean", "ttft_ms_mean"), ("p50", "ttft_ms_p50"), ("p90", "ttft_ms_p90"),
                           ("p99", "ttft_ms_p99"), ("TPOT mean", "tpot_ms_mean"), ("p50", "tpot_ms_p50"),
                           ("p90", "tpot_ms_p90"), ("p99", "tpot_ms_p99")], 1),
    ("recovery window (ms)", [("n", "window_requests"), ("TTFT mean", "win_ttft_ms_mean"), ("p50", "win_ttft_ms_p50"),
                              ("p90", "win_ttft_ms_p90"), ("p99", "win_ttft_ms_p99"), ("TPOT mean", "win_tpot_ms_mean"),
                              ("p50", "win_tpot_ms_p50"), ("p90", "win_tpot_ms_p90"), ("p99", "win_tpot_ms_p99")], 1),
    ("arrivals just after a kill (ms)", [("n", "arrival_requests"), ("TTFT mean", "arr_ttft_ms_mean"),
                                         ("p50", "arr_ttft_ms_p50"), ("p90", "arr_ttft_ms_p90")], 1),
    ("before the first kill, the steady state (ms)", [("TTFT mean", "pre_ttft_ms_mean"), ("p50", "pre_ttft_ms_p50"),
                                                     ("p90", "pre_ttft_ms_p90"), ("TPOT mean", "pre_tpot_ms_mean")], 1),
    ("recovery and goodput", [("exact/req", None), ("interrupted", "interrupted"), ("recovery mean ms", "stall_mean_ms"),
                              ("recovery max ms", "recovery_time_ms"), ("restored tok", "restored_tokens"),
                              ("recomputed tok", "recomputed_tokens"), ("engine loaded tok", "engine_loaded_tokens"),
                              ("decode tok/s", "decode_tok_s_mean"), ("goodput tok/s", "goodput_tok_s")], 1),
)


def table(rows: Sequence[tuple[str, str, dict[str, dict[str, Any]]]]) -> str:
    """The summary: one block per figure group, one row per (scenario, policy), each cell the
    mean over the repetitions ± the 95 % interval's half-width."""
    lines: list[str] = []
    for title, cols, digits in TABLE_BLOCKS:
        head = ["scenario", "policy", *[c for c, _ in cols]]
        body = []
        for scen, pol, agg in rows:
            cells = [scen, pol]
            for _, key in cols:
                if key is None:
                    ex, rq = agg.get("exact", {}).get("values") or [], agg.get("requests", {}).get("values") or []
                    cells.append(f"{sum(x or 0 for x in ex)}/{sum(x or 0 for x in rq)}")
                else:
                    cells.append(cell(agg.get(key), 0 if key in ("window_requests", "arrival_requests", "interrupted") else digits))
            body.append(cells)
        widths = [max(len(str(r[j])) for r in [head, *body]) for j in range(len(head))]
        lines.append(f"-- {title}: mean over repetitions ± 95 % interval (t)")
        for r in [head, *body]:
            lines.append("  ".join(str(c).rjust(w) if j >= 2 else str(c).ljust(w)
                                   for j, (c, w) in enumerate(zip(r, widths))))
        lines.append("")
    return "\n".join(lines)


# ---- policies against each other --------------------------------------------------------------

COMPARED = (("window TTFT mean", "win_ttft_ms_mean"), ("window TTFT p90", "win_ttft_ms_p90"),
            ("arrivals' TTFT mean", "arr_ttft_ms_mean"),
            ("TTFT mean", "ttft_ms_mean"), ("TPOT mean", "tpot_ms_mean"),
            ("TTFT before the kill", "pre_ttft_ms_mean"), ("TPOT before the kill", "pre_tpot_ms_mean"),
            ("recovery mean", "stall_mean_ms"),
            ("recovery p50", "stall_p50_ms"), ("recovery max", "recovery_time_ms"), ("decode tok/s", "decode_tok_s_mean"),
            ("goodput", "goodput_tok_s"))


def paired_change(a: Sequence[Optional[float]], b: Sequence[Optional[float]]) -> dict[str, Any]:
    """Policy A against policy B over repetitions that ran side by side (the same seed, in
    alternation): the mean of the per-repetition changes A/B − 1 with its 95 % t interval, in %.
    Pairing removes what a repetition shares (its workload draw, the machine's state then)."""
    ch = [x / y - 1.0 for x, y in zip(a, b) if x is not None and y]
    m, hw, n = mean_ci(ch)
    return {"change_pct": None if m is None else 100 * m, "ci95_pct": None if hw is None else 100 * hw, "n": n,
            "beats": bool(m is not None and hw is not None and m + hw < 0),
            "loses": bool(m is not None and hw is not None and m - hw > 0)}


def comparisons(table: dict[str, dict[str, dict[str, Any]]], baselines: Sequence[str]) -> dict[str, Any]:
    """Per scenario, every policy against each baseline present: ``paired_change`` of each
    figure in ``COMPARED`` (for all but decode rate and goodput, lower is better)."""
    out: dict[str, Any] = {}
    for scen, pols in table.items():
        for base in baselines:
            if base not in pols:
                continue
            for pol, agg in pols.items():
                if pol == base:
                    continue
                row = {}
                for _, key in COMPARED:
                    row[key] = paired_change(agg.get(key, {}).get("values") or [],
                                             pols[base].get(key, {}).get("values") or [])
                out.setdefault(scen, {})[f"{pol} vs {base}"] = row
    return out


def comparison_text(comp: dict[str, Any]) -> str:
    """The comparisons as a table: change in % ± the 95 % interval of the paired changes."""
    head = ["scenario", "comparison", *[c for c, _ in COMPARED]]
    body = []
    for scen, rows in comp.items():
        for name, row in rows.items():
            cells = [scen, name]
            for _, key in COMPARED:
                c = row[key]
                if c["change_pct"] is None:
                    cells.append("-")
                else:
                    hw = "" if c["ci95_pct"] is None else f" ±{c['ci95_pct']:.1f}"
                    cells.append(f"{c['change_pct']:+.1f}{hw} %")
            body.append(cells)
    if not body:
        return ""
    widths = [max(len(str(r[j])) for r in [head, *body]) for j in range(len(head))]
    lines = ["-- policies against each other: mean of the paired per-repetition changes ± 95 % interval (t)"]
    for r in [head, *body]:
        lines.append("  ".join(str(c).rjust(w) if j >= 2 else str(c).ljust(w) for j, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines) + "\n"


# ---- the plot ------------------------------------------------------------------------------------

COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def svg_plot(panels: Sequence[dict[str, Any]], width: int = 760, panel_h: int = 240) -> str:
    """TTFT over arrival time, one panel per scenario, one colour per policy (every repetition's
    points), the kills as dashed lines. ``panels``: ``{"title", "kills": [s], "series": {policy:
    [(sent s, ttft s)]}}``. A hand-written SVG (no plotting library in the engine venv); the y axis
    is logarithmic, since a recomputation's TTFT is orders above an idle one."""
    ml, mr, mt, mb = 60, 130, 26, 34
    h = panel_h * max(1, len(panels))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h}" '
           'font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{h}" fill="white"/>']
    for k, p in enumerate(panels):
        y0 = k * panel_h
        pts = [(x, y) for s in p["series"].values() for x, y in s if y and y > 0]
        xmax = max([x for x, _ in pts] + list(p.get("kills") or []) + [1.0]) * 1.02
        ylo = min([y for _, y in pts] + [0.01])
        yhi = max([y for _, y in pts] + [ylo * 10])
        lo, hi = math.floor(math.log10(ylo)), math.ceil(math.log10(yhi))
        hi = max(hi, lo + 1)
        pw, ph = width - ml - mr, panel_h - mt - mb

        def X(x: float) -> float:
            return ml + pw * x / xmax

        def Y(y: float) -> float:
            return y0 + mt + ph * (1 - (math.log10(y) - lo) / (hi - lo))

        out.append(f'<text x="{ml}" y="{y0 + 16}" font-size="13">{esc(p["title"])}</text>')
        out.append(f'<rect x="{ml}" y="{y0 + mt}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>')
        for e in range(lo, hi + 1):
            yy = Y(10.0 ** e)
            out.append(f'<line x1="{ml}" x2="{ml + pw}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#ddd"/>')
            out.append(f'<text x="{ml - 4}" y="{yy + 4:.1f}" text-anchor="end">{fmt_s(10.0 ** e)}</text>')
        step = nice_step(xmax)
        x = 0.0
        for _ in range(100):
            if x > xmax:
                break
            out.append(f'<text x="{X(x):.1f}" y="{y0 + mt + ph + 14}" text-anchor="middle">{x:g}</text>')
            x += step
        out.append(f'<text x="{ml + pw / 2}" y="{y0 + panel_h - 4}" text-anchor="middle">'
                   'arrival (s from the start of the load)</text>')
        out.append(f'<text x="14" y="{y0 + mt + ph / 2}" transform="rotate(-90 14 {y0 + mt + ph / 2})" '
                   f'text-anchor="middle">TTFT</text>')
        for t in p.get("kills") or []:
            out.append(f'<line x1="{X(t):.1f}" x2="{X(t):.1f}" y1="{y0 + mt}" y2="{y0 + mt + ph}" '
                       f'stroke="black" stroke-dasharray="4,3"/>')
            out.append(f'<text x="{X(t) + 3:.1f}" y="{y0 + mt + 10}">kill</text>')
        for j, (name, s) in enumerate(p["series"].items()):
            c = COLOURS[j % len(COLOURS)]
            for x, y in s:
                if y and y > 0:
                    out.append(f'<circle cx="{X(x):.1f}" cy="{Y(y):.1f}" r="2" fill="{c}" fill-opacity="0.6"/>')
            ly = y0 + mt + 14 + 16 * j
            out.append(f'<circle cx="{ml + pw + 14}" cy="{ly - 4}" r="4" fill="{c}"/>')
            out.append(f'<text x="{ml + pw + 22}" y="{ly}">{esc(name)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def esc(s: str) -> str:
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def fmt_s(v: float) -> str:
    return f"{v * 1000:g} ms" if v < 1 else f"{v:g} s"


def nice_step(span: float) -> float:
    raw = span / 8
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    for m in (1, 2, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


# ---- the steady state, pooled over runs ----------------------------------------------------------

def steady_pooled(results: Sequence[dict[str, Any]], baseline: str = "stop_restart") -> dict[str, dict[str, Any]]:
    """Checkpointing on against off in the steady state, pooled over several runs' records
    (``lumen.json`` files): every repetition's time before its first kill, each policy paired
    with ``baseline`` (which places no checkpoint) of the same file, scenario and repetition.
    Per policy: ``paired_change`` of the mean TTFT and of the mean TPOT before the kill."""
    means: dict[tuple[str, Any, Any], dict[str, tuple[float, float]]] = {}
    for i, res in enumerate(results):
        for run in res.get("runs", []):
            ttft, tpot = before_kill(run.get("records") or [], [k["at"] for k in run.get("kills") or []])
            if ttft and tpot:
                key = (str(i), run.get("scenario"), run.get("rep"))
                means.setdefault(key, {})[run["policy"]] = (sum(ttft) / len(ttft), sum(tpot) / len(tpot))
    out: dict[str, dict[str, Any]] = {}
    pols = sorted({p for m in means.values() for p in m} - {baseline})
    for pol in pols:
        pairs = [(m[pol], m[baseline]) for m in means.values() if pol in m and baseline in m]
        out[f"{pol} vs {baseline}"] = {
            "pairs": len(pairs),
            "ttft": paired_change([a[0] for a, _ in pairs], [b[0] for _, b in pairs]),
            "tpot": paired_change([a[1] for a, _ in pairs], [b[1] for _, b in pairs]),
        }
    return out


def main(argv: Sequence[str]) -> int:
    """``python3 lumen_stats.py steady LUMEN.json...``: the pooled steady state (``steady_pooled``)."""
    if len(argv) < 2 or argv[0] != "steady":
        print("usage: lumen_stats.py steady LUMEN.json [LUMEN.json ...]\n"
              "  checkpointing on against off before each run's first kill, paired by repetition,\n"
              "  pooled over the files (written by lumen_load.py --out)")
        return 2
    results = []
    for path in argv[1:]:
        with open(path) as fh:
            results.append(json.load(fh))
    for name, row in steady_pooled(results).items():
        cells = [f"{w} {row[w]['change_pct']:+.1f} ±{row[w]['ci95_pct'] or 0:.1f} %"
                 for w in ("ttft", "tpot") if row[w]["change_pct"] is not None]
        print(f"{name}: {row['pairs']} pairs; before the first kill: " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
