"""The README's launch lines are the ones the engine tests load: the vLLM connector config the
engine tests pass to vLLM, and the SGLang extra config the SGLang tests build the backend from
(kvd.sglang's docstring), so a reader copying them gets what was tested."""

from __future__ import annotations

import json
import re
from pathlib import Path

import kvd.sglang
from test_vllm import connector

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def flag_json(text: str, flag: str) -> dict:
    m = re.search(flag + r" '(\{.*?\})'", text, re.S)
    assert m, f"no {flag} line"
    return json.loads(m.group(1))


def test_the_readmes_vllm_line_is_the_connector_config_the_engine_tests_load():
    line = flag_json(README, "--kv-transfer-config")
    tested = connector(line["kv_connector_extra_config"]["socket"])
    assert line == tested


def test_the_readmes_sglang_line_is_the_backend_config_the_sglang_tests_build():
    doc = kvd.sglang.__doc__ or ""
    key = "--hicache-storage-backend-extra-config"
    assert flag_json(README, key) == flag_json(doc, key)
