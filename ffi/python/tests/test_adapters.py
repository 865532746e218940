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
