"""A real `kvd serve` for the tests: the binary from KVD_BIN (scripts/test.sh passes the one it
built), on a temporary data dir with small pages and a fast reaper; stopped after the test."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

START_TIMEOUT_S = 60


class Daemon:
    def __init__(self, extra: list[str]) -> None:
        binary = os.environ.get("KVD_BIN")
        if not binary:
            pytest.fail("KVD_BIN must name the kvd binary (scripts/test.sh sets it)")
        self.dir = tempfile.TemporaryDirectory()
        d = Path(self.dir.name)
        self.socket = str(d / "kvd.sock")
        args = [
            binary, "serve", "--data-dir", str(d), "--socket", self.socket,
            "--admin-listen", "127.0.0.1:0", "--pool-mib", "16", "--page-kib", "256",
            "--huge-pages", "off", "--reap-interval-ms", "20", "--threads", "2", *extra,
        ]
        self.log = open(d / "daemon.log", "wb")
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self.log)
        deadline = time.monotonic() + START_TIMEOUT_S
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline().decode()
            if line.startswith("kvd ready"):
                fields = dict(w.split("=", 1) for w in line.split() if "=" in w)
                self.data = fields.get("data")
                self.admin = fields.get("admin")
                return
            if not line and self.proc.poll() is not None:
                break
        self.stop()
        pytest.fail(f"kvd did not start: {(d / 'daemon.log').read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.log.close()
        self.dir.cleanup()


def peer_entry(d: Daemon, node_id: int) -> str:
    """``d``'s line of a peers file: ``NODE_ID=ADDR,key=PUBLIC_KEY`` (``kvd key show``)."""
    out = subprocess.run([os.environ["KVD_BIN"], "key", "show", "--data-dir", d.dir.name,
                          "--as-peer", f"{node_id}={d.data}"], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def peers_file(path: Path) -> Path:
    """An empty peers file for daemons to start with (``--peers-file``); fill it with
    ``write_peers`` once they are up: each reads it again within a second of a change."""
    path.write_text("# NODE_ID=ADDR,key=PUBLIC_KEY\n")
    return path


def write_peers(path: Path, nodes: dict[int, Daemon]) -> None:
    """Every node's entry (each skips its own), written at once."""
    tmp = path.with_suffix(".new")
    tmp.write_text("".join(peer_entry(d, i) + "\n" for i, d in nodes.items()))
    tmp.replace(path)


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    d = Daemon([])
    yield d
    d.stop()


@pytest.fixture
def small_pool_daemon() -> Iterator[Daemon]:
    """Four 256 KiB pages: a writer filling the pool evicts what is unpinned."""
    d = Daemon(["--pool-mib", "1"])
    yield d
    d.stop()


@pytest.fixture
def two_nodes(tmp_path) -> Iterator[tuple[Daemon, Daemon]]:
    """Node 1 and node 2 with data ports, each in the other's peer table (a peers file with
    both keys)."""
    secret = tmp_path / "secret"
    secret.write_bytes(bytes([5]) * 32)
    secret.chmod(0o600)
    peers = peers_file(tmp_path / "peers")
    port = ["--cluster-secret-file", str(secret), "--data-listen", "127.0.0.1:0", "--peers-file", str(peers)]
    b = Daemon([*port, "--node-id", "2"])
    a = Daemon([*port, "--node-id", "1"])
    write_peers(peers, {1: a, 2: b})
    yield a, b
    a.stop()
    b.stop()


def wait_until(what: str, cond, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.025)
    raise AssertionError(f"timed out after {timeout_s} s waiting until {what}")
