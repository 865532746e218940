"""The LUMEN load generator's smoke mode (benches/python/lumen_load.py --smoke): two nodes (a kvd
daemon in cluster mode and vLLM's OpenAI server each) on a real etcd, ``kvd control --policy
lumen`` with its front, 4 s of seeded Poisson load at 2 requests/s (9 requests of 200 tokens)
streamed through the front, the vLLM of the busiest worker killed (``kill -9``) at 2.5 s. Every
stream must be exact: numbered once each with no gap, no duplicate and no error event, ending in
``[DONE]``, and its tokens those of the same prompt's uninterrupted greedy run (straight from the
surviving vLLM); and the kill must have interrupted at least one request (else the recovery path
was not exercised).

The run's figures (TTFT, TPOT, recovery time, goodput) are printed, never asserted: they come
from the benchmark (scripts/bench-lumen.sh), not from a timed test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCHES = Path(__file__).resolve().parents[2] / "benches" / "python"
if str(BENCHES) not in sys.path:
    sys.path.insert(0, str(BENCHES))

import lumen_load  # noqa: E402


def test_the_smoke_load_streams_every_request_exactly_across_a_vllm_kill(tmp_path):
    out = tmp_path / "smoke.json"
    result = lumen_load.run(lumen_load.parse_args(["--smoke", "--out", str(out)]))
    (r,) = result["runs"]
    wrong = [p for p in r["problems"]]
    assert not wrong, f"{len(wrong)} stream(s) not exact: " + json.dumps(wrong[:5], indent=1)
    f = r["figures"]
    assert f["requests"] > 0 and f["exact"] == f["requests"], f
    assert r["kills"] and r["kills"][0]["targets"], r["kills"]
    assert r["front"]["recoveries"] >= 1, f"the kill interrupted nothing: {r['kills']}"
    assert f["interrupted"] >= 1, "a recovered request shows a new epoch to its client"
    assert json.loads(out.read_text())["ok"]
