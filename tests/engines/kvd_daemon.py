"""The real ``kvd serve`` for the engine tests: the same ``Daemon`` the Python package's tests
use (ffi/python/tests/conftest.py), loaded from there so there is one harness."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_path = Path(__file__).resolve().parents[2] / "ffi" / "python" / "tests" / "conftest.py"
_spec = importlib.util.spec_from_file_location("kvd_python_test_harness", _path)
assert _spec is not None and _spec.loader is not None
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)

Daemon = _mod.Daemon
wait_until = _mod.wait_until
peers_file = _mod.peers_file
write_peers = _mod.write_peers
