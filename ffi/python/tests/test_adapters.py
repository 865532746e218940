"""The engine adapters without their engines. kvd.vllm and kvd.sglang are tested inside the
real engines (tests/engines: vLLM's CPU build running a tiny model, SGLang's factory, cache
controller and host pools); here, in the package's own venv where no engine is installed, each
says so at import instead of quietly becoming a class that subclasses nothing."""

from __future__ import annotations

import importlib
import sys

import pytest


@pytest.mark.parametrize("module,engine", [("kvd.vllm", "vLLM"), ("kvd.sglang", "SGLang")])
def test_an_adapter_without_its_engine_fails_at_import_and_names_the_engine(module, engine):
    sys.modules.pop(module, None)
    with pytest.raises(ImportError, match=f"needs {engine} importable"):
        importlib.import_module(module)


def test_the_package_itself_imports_without_any_engine():
    import kvd

    assert kvd.Client and kvd.Namespace and kvd.key
    from kvd.identity import weights_identity

    assert weights_identity("/nonexistent/model") == ""


def test_the_weights_stamp_follows_the_bytes_not_the_path_or_the_file_times(tmp_path):
    import os

    from kvd.identity import SAMPLE_BYTES, SAMPLES, weights_identity

    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "config.json").write_text('{"hidden_size": 8}')
    big = bytearray(os.urandom(SAMPLES * SAMPLE_BYTES * 4))
    (a / "model.safetensors").write_bytes(big)
    (b / "model.safetensors").write_bytes(big)
    os.utime(b / "model.safetensors", (1_000_000_000, 1_000_000_000))
    assert weights_identity(str(a)) == weights_identity(str(b)), "the same weights elsewhere: one namespace"
    (b / "model.safetensors").write_bytes(os.urandom(len(big)))
    assert weights_identity(str(a)) != weights_identity(str(b)), "new weights at the same path"
    (b / "model.safetensors").write_bytes(big[:-1])
    assert weights_identity(str(a)) != weights_identity(str(b)), "another size"
