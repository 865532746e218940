"""The engine harness cleans up after a server killed with SIGKILL: vLLM's processes talk over
``multiprocessing.shared_memory`` segments (``/dev/shm/psm_*``), which a killed
process cannot unlink. ``vllm_server.sweep_orphaned_shm`` removes those no live process maps,
and keeps every segment still mapped or too fresh to judge. No engine needed: the segments here
are made the same way vLLM makes them, by processes this test starts and kills."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import vllm_server

HOLD = """
import sys, time
from multiprocessing import shared_memory
m = shared_memory.SharedMemory(create=True, size=1 << 20)
m.buf[:5] = b"hello"
print(m.name, flush=True)
time.sleep(600)
"""


def hold_segment() -> tuple[subprocess.Popen, str]:
    """A process that creates a segment, maps it and waits: its name once it is mapped."""
    p = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True, start_new_session=True)
    name = p.stdout.readline().strip().lstrip("/")
    assert name.startswith(vllm_server.SHM_PREFIX), name
    return p, name


def kill9(p: subprocess.Popen) -> None:
    """SIGKILL the holder's whole group, as the harness kills a server: its resource tracker
    (which would unlink the segment when its creator's pipe closes) dies with it."""
    os.killpg(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    assert vllm_server._wait_group_gone(p.pid, 10)


def age(name: str) -> None:
    """Make a segment look older than the settle time (its creator mapped it long ago)."""
    t = time.time() - 10 * vllm_server.SHM_SETTLE_S
    os.utime(vllm_server.SHM / name, (t, t))


def test_a_killed_holders_segment_is_removed_and_a_live_ones_is_kept() -> None:
    before = vllm_server._shm_segments()
    dead, dead_name = hold_segment()
    live, live_name = hold_segment()
    try:
        kill9(dead)
        assert (vllm_server.SHM / dead_name).exists(), "SIGKILL left no segment to sweep"
        age(dead_name)
        age(live_name)
        gone = vllm_server.sweep_orphaned_shm(before)
        assert dead_name in gone
        assert not (vllm_server.SHM / dead_name).exists()
        assert live_name not in gone and (vllm_server.SHM / live_name).exists(), "a mapped segment was removed"
    finally:
        kill9(live)
        for n in (dead_name, live_name):
            Path(vllm_server.SHM / n).unlink(missing_ok=True)


def test_a_fresh_unmapped_segment_is_kept_until_it_settles() -> None:
    before = vllm_server._shm_segments()
    p, name = hold_segment()
    try:
        kill9(p)
        os.utime(vllm_server.SHM / name)  # just made: its creator may be about to map it
        assert name not in vllm_server.sweep_orphaned_shm(before)
        assert (vllm_server.SHM / name).exists()
        age(name)
        assert vllm_server.sweep_orphaned_shm(before) == [name]
    finally:
        Path(vllm_server.SHM / name).unlink(missing_ok=True)


def test_segments_there_before_are_never_touched() -> None:
    p, name = hold_segment()
    kill9(p)
    try:
        age(name)
        before = vllm_server._shm_segments()  # the orphan predates this "server"
        assert name not in vllm_server.sweep_orphaned_shm(before)
        assert (vllm_server.SHM / name).exists()
    finally:
        Path(vllm_server.SHM / name).unlink(missing_ok=True)
