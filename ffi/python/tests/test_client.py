"""kvd.Client against a real daemon: round trips, prefix hits, views, errors mirroring the
status codes, checkpoints, and what a dead session leaves behind."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvd
from conftest import wait_until

LAYOUT = kvd.Namespace("test/py-tiny", "r1", 65536, 16, 2, 2, 64, tokenizer="tok-1")


def page(n: int, seed: int) -> bytes:
    return bytes((i * 151 + seed) & 0xFF for i in range(n))


def keys(ns: bytes, seed: int, n: int) -> list[bytes]:
    return [kvd.key(ns, seed.to_bytes(4, "little") + i.to_bytes(4, "little") + bytes(24)) for i in range(n)]


def test_a_page_put_from_bytes_comes_back_verified_into_a_bytearray(daemon):
    with kvd.Client(daemon.socket, name="py") as c:
        ns = c.register_namespace(LAYOUT)
        assert ns == LAYOUT.id()
        ks = keys(ns, 1, 3)
        pages = [page(65536, i) for i in range(3)]
        assert c.put(ks, pages) == [None, None, None]
        dsts = [bytearray(65536) for _ in ks]
        assert c.get(ks, dsts) == [65536] * 3
        assert [bytes(d) for d in dsts] == pages
        assert c.exists(ks + keys(ns, 2, 1)) == [True, True, True, False]
        # a shared prefix soft-pinned (a miss is not), renewed, then ended
        assert c.soft_pin(ks[:2] + keys(ns, 2, 1), 60_000) == [True, True, False]
        assert c.soft_pin(ks[:1], 0) == [True]
        assert c.stats()["soft_pins"] == 2


def test_numpy_arrays_go_in_and_out_without_a_copy_of_their_own(daemon):
    np = pytest.importorskip("numpy")
    with kvd.Client(daemon.socket) as c:
        ns = c.register_namespace(LAYOUT)
        k = keys(ns, 3, 1)
        src = np.arange(16384, dtype=np.float32)  # 64 KiB
        assert c.put(k, [src]) == [None]
        dst = np.zeros_like(src)
        assert c.get(k, [dst]) == [65536]
        assert (dst == src).all()
        b = c.acquire(k)[0]
        with c.view(b.handle) as v:
            assert (v.numpy().view(np.float32) == src).all()
            v.still_valid()
        c.release([b.handle])


def test_a_lookup_finds_the_longest_published_prefix_of_a_token_chain(daemon):
    with kvd.Client(daemon.socket) as c:
        ns = c.register_namespace(LAYOUT)
        tokens = list(range(1000, 1000 + 16 * 5))
        tags = kvd.block_tags(ns, 16, tokens)
        assert len(tags) == 5
        first3 = [kvd.key(ns, t) for t in tags[:3]]
        assert c.put(first3, [page(65536, i) for i in range(3)]) == [None] * 3
        hit = c.lookup_prefix(ns, tags)
        assert [b.key for b in hit] == first3
        assert all(b.pin_ttl_ms == 0 for b in hit)
        pinned = c.lookup_prefix(ns, tags, pin=True, pin_ttl_ms=4000)
        assert len(pinned) == 3 and all(b.pin_ttl_ms == 4000 for b in pinned)
        assert c.stats()["pins"] == 3
        assert c.release([b.handle for b in pinned]) == [None] * 3


def test_stats_has_every_counter_the_library_names_with_the_structs_values(daemon):
    with kvd.Client(daemon.socket) as c:
        ns = c.register_namespace(LAYOUT)
        assert c.put(keys(ns, 9, 2), [page(65536, i) for i in range(2)]) == [None] * 2
        s = c.stats()
        names = kvd._lib.COUNTER_NAMES
        assert names and set(names) <= set(s), "every counter by the library's name"
        assert s["blocks_published"] == 2
        kept = [f for f, _ in kvd._lib.Stats._fields_ if f in names]
        assert kept == list(names[: len(kept)]), "the struct keeps a prefix of them, in order"


def test_a_view_is_a_read_only_memoryview_of_the_pool_and_refuses_a_moved_page(daemon):
    with kvd.Client(daemon.socket) as c:
        ns = c.register_namespace(LAYOUT)
        k = keys(ns, 4, 1)
        data = page(65536, 4)
        c.put(k, [data])
        b = c.acquire(k)[0]
        v = c.view(b.handle)
        assert v.data.readonly and bytes(v.data) == data
        v.still_valid()
        with pytest.raises(TypeError):
            v.data[0] = 1  # type: ignore[index]
        # Unpinned and removed: the page moves on, the view says so.
        assert c.release([b.handle]) == [None]
        assert c.remove_if([(k[0], b.handle)]) == [None]
        with pytest.raises(kvd.StaleGeneration):
            v.still_valid()
        assert not v.valid()
        # A view of an unpinned block is refused outright.
        with pytest.raises(kvd.InvalidArgument):
            c.view(b.handle)


def test_a_view_held_past_its_pin_is_stale_once_another_writer_reuses_the_page(small_pool_daemon):
    w = kvd.Client(small_pool_daemon.socket, name="writer")
    r = kvd.Client(small_pool_daemon.socket, name="reader")
    ns = w.register_namespace(LAYOUT)
    k = keys(ns, 5, 1)
    first = page(65536, 1)
    w.put(k, [first])
    b = r.acquire(k, ttl_ms=200)[0]
    v = r.view(b.handle)
    assert bytes(v.data) == first
    wait_until("the pin expires", lambda: w.stats()["pins"] == 0)
    fresh = keys(ns, 6, 4)
    assert w.put(fresh, [page(65536, 2)] * 4) == [None] * 4  # fills the pool: evicts k
    with pytest.raises(kvd.StaleGeneration):
        v.still_valid()
    with pytest.raises((kvd.LeaseExpired, kvd.InvalidArgument, kvd.StaleGeneration)):
        r.read_verified(b.handle, bytearray(65536))
    r.close()
    w.close()


def test_errors_mirror_the_status_codes_with_their_detail(daemon):
    with kvd.Client(daemon.socket) as c:
        ns = c.register_namespace(LAYOUT)
        k = keys(ns, 7, 1)
        c.put(k, [page(4096, 7)])
        again = c.put(k, [page(4096, 7)])[0]
        assert isinstance(again, kvd.AlreadyExists) and again.status == 6
        missing = c.acquire(keys(ns, 8, 1))[0]
        assert isinstance(missing, kvd.NotFound)
        with pytest.raises(kvd.NoSpace) as e:
            c.reserve(1 << 40)
        assert e.value.retryable and e.value.status == 3
        with pytest.raises(kvd.NotFound):
            c.manifest(424242)
        # A stray write into a sealed block through the mapping: the reader's verified copy
        # fails, the daemon's copy fails too, the block is quarantined.
        b = c.acquire(k)[0]
        base = c.pool_info().base
        ctypes.memset(base + b.offset + 5, 0xEE, 1)
        with pytest.raises(kvd.Corrupt) as e:
            c.read_verified(b.handle, bytearray(4096))
        assert e.value.corruption == kvd.errors.CORRUPTION_QUARANTINED
        assert c.exists(k) == [False]
        c.release([b.handle])
    with pytest.raises(kvd.KvdIOError):
        kvd.Client("/nonexistent/kvd.sock")
    closed = kvd.Client(daemon.socket)
    closed.close()
    with pytest.raises(ValueError):
        closed.heartbeat()
    assert kvd.status_text(15) == "disconnected"


def test_a_checkpoint_is_extended_restored_and_ended(daemon):
    with kvd.Client(daemon.socket) as c:
        ns = c.register_namespace(LAYOUT)
        m = c.manifest_begin(9, 1, ns, reserve_bytes=1 << 20)
        assert m.reservation != 0
        tokens = list(range(32))
        tags = kvd.block_tags(ns, 16, tokens)
        ks = [kvd.key(ns, t) for t in tags]
        allocs = c.alloc(ks, checkpoint=(9, 1), reservation=m.reservation)
        items = []
        for a in allocs:
            assert isinstance(a, kvd.Allocation)
            crc = c.write(a.handle, page(65536, 9), 0, 0)
            items.append((a.handle, 65536, crc))
        assert all(isinstance(s, int) for s in c.seal(items))
        m = c.manifest_extend(9, 1, [a.handle for a in allocs], 32)
        assert m.committed_tokens == 32
        assert c.manifest(9).tags == tags
        r = c.restore_prefix(9, tokens)
        assert (r.tokens, len(r.blocks)) == (32, 2)
        with pytest.raises(kvd.StaleEpoch):
            c.manifest_extend(9, 0, [], 32)
        c.manifest_end(9, 1)
        assert c.health_check() > 0


def test_the_admin_port_reports_a_checkpoint_and_ends_it_for_its_epoch_only(daemon):
    import json
    import urllib.error
    import urllib.request

    def call(method: str, path: str) -> tuple[int, bytes]:
        req = urllib.request.Request(f"http://{daemon.admin}{path}", method=method)
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    assert call("GET", "/checkpoints/12")[0] == 404
    with kvd.Client(daemon.socket) as c:
        ns = c.register_namespace(LAYOUT)
        m = c.manifest_begin(12, 3, ns, reserve_bytes=1 << 20)
        tokens = list(range(48))
        ks = [kvd.key(ns, t) for t in kvd.block_tags(ns, 16, tokens)]
        allocs = c.alloc(ks, checkpoint=(12, 3), reservation=m.reservation)
        items = [(a.handle, 65536, c.write(a.handle, page(65536, 3), 0, 0)) for a in allocs]
        c.seal(items)
        c.manifest_extend(12, 3, [a.handle for a in allocs], 48)
        status, body = call("GET", "/checkpoints/12")
        assert status == 200
        held = json.loads(body)
        assert held == {"request": 12, "epoch": 3, "committed_tokens": 48, "blocks": 3,
                        "bytes": 3 * c.pool_info().page_size_bytes}
        assert call("DELETE", "/checkpoints/12?epoch=2")[0] == 409, "another epoch's end changes nothing"
        assert call("GET", "/checkpoints/12")[0] == 200
        assert call("DELETE", "/checkpoints/12")[0] == 400, "the epoch is required"
        assert call("DELETE", "/checkpoints/12?epoch=3")[0] == 204
        assert call("GET", "/checkpoints/12")[0] == 404
        assert c.stats()["manifests"] == 0
        with pytest.raises(kvd.KvdError):
            c.manifest(12)


def test_a_killed_session_leaves_nothing_pinned(daemon):
    with kvd.Client(daemon.socket) as c:
        ns = c.register_namespace(LAYOUT)
        ks = keys(ns, 10, 2)
        c.put(ks, [page(4096, 1)] * 2)
        script = (
            "import kvd, os, sys\n"
            "c = kvd.Client(sys.argv[1], name='doomed', lease_ttl_ms=500)\n"
            "ks = [bytes.fromhex(h) for h in sys.argv[2:]]\n"
            "assert all(isinstance(b, kvd.Block) for b in c.acquire(ks, ttl_ms=60000))\n"
            "c.alloc([ks[0][:32] + bytes(32)])\n"
            "print('pinned', flush=True)\n"
            "os.kill(os.getpid(), 9)\n"
        )
        p = subprocess.run(
            [sys.executable, "-c", script, daemon.socket, *[k.hex() for k in ks]],
            capture_output=True, text=True, timeout=60,
        )
        assert "pinned" in p.stdout, p.stderr
        assert p.returncode == -9
        wait_until("the dead session's pins and blocks are gone", lambda: (lambda s: s["pins"] == 0 and s["pages_writing"] + s["pages_allocated"] == 0)(c.stats()))
        assert c.stats()["sessions"] == 1


def test_the_python_example_runs(daemon):
    example = Path(__file__).resolve().parent.parent / "examples" / "put_get.py"
    p = subprocess.run([sys.executable, str(example), daemon.socket], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "got back: hello, kvd"


def test_the_installed_package_carries_libkvd_and_its_type_marker():
    pkg = Path(kvd.__file__).resolve().parent
    assert (pkg / "py.typed").exists()
    if "KVD_LIBRARY" not in os.environ:
        assert (pkg / "libkvd.so").exists()
    assert kvd.version() and kvd.ABI_VERSION == 1


def test_asynchronous_lookups_complete_through_the_eventfd(daemon):
    import select

    with kvd.Client(daemon.socket) as c:
        ns = c.register_namespace(LAYOUT)
        tags = kvd.block_tags(ns, 16, list(range(48)))
        c.put([kvd.key(ns, t) for t in tags[:2]], [page(4096, 1)] * 2)
        c.async_start(2)
        fd = c.async_fd()
        t1 = c.submit_lookup_prefix(ns, tags, pin=True, pin_ttl_ms=5000)
        t2 = c.submit_lookup_prefix(ns, tags)
        with pytest.raises(kvd.Overloaded):
            c.submit_lookup_prefix(ns, tags)
        assert select.select([fd], [], [], 30)[0] == [fd]
        done: dict = {}
        for _ in range(100):
            done.update(c.poll(1000))
            if len(done) == 2:
                break
        assert sorted(done) == [t1, t2]
        assert [len(done[t]) for t in (t1, t2)] == [2, 2]
        assert [b.pin_ttl_ms for b in done[t1]] == [5000, 5000]
        with c.view(done[t1][0].handle) as v:  # the async pins are this client's
            v.still_valid()
        c.release([b.handle for b in done[t1]])
        assert c.poll(0) == []


def test_an_asynchronous_release_hands_pins_back_without_waiting(daemon):
    with kvd.Client(daemon.socket) as c:
        ns = c.register_namespace(LAYOUT)
        tags = kvd.block_tags(ns, 16, list(range(48)))
        c.put([kvd.key(ns, t) for t in tags[:3]], [page(4096, 2)] * 3)
        c.async_start(4)
        pinned = c.lookup_prefix(ns, tags, pin=True, pin_ttl_ms=60_000)
        assert len(pinned) == 3 and c.stats()["pins"] == 3
        assert polled(c, c.submit_release([b.handle for b in pinned])) == []
        assert c.stats()["pins"] == 0, "every pin handed back"
        # Releasing them again is no error at submit: the stale handles are simply not counted.
        assert polled(c, c.submit_release([b.handle for b in pinned])) == []


def test_the_asynchronous_queue_carries_on_over_a_reconnect(daemon):
    with kvd.Client(daemon.socket) as c:
        ns = c.register_namespace(LAYOUT)
        tags = kvd.block_tags(ns, 16, list(range(32)))
        c.put([kvd.key(ns, t) for t in tags], [page(4096, 3)] * 2)
        c.async_start(4)
        assert len(polled(c, c.submit_lookup_prefix(ns, tags))) == 2
        c.reconnect()  # a lapsed lease, a restarted daemon: the queue runs on the new session
        with pytest.raises(kvd.InvalidArgument):
            c.async_start(4)  # started already
        c.register_namespace(LAYOUT)
        assert len(polled(c, c.submit_lookup_prefix(ns, tags, pin=True, pin_ttl_ms=5000))) == 2
        assert c.stats()["pins"] == 2, "the pins belong to the new session"


def polled(c, ticket: int):
    """The completion of one asynchronous call (bounded: 100 polls of at most 1 s)."""
    for _ in range(100):
        for t, result in c.poll(1000):
            if t == ticket:
                return result
    raise AssertionError(f"ticket {ticket} never completed")


def test_a_router_drains_stored_and_removed_events_and_learns_what_it_lost():
    from conftest import Daemon

    d = Daemon(["--event-log-capacity", "4"])
    try:
        with kvd.Client(d.socket, name="writer") as w, kvd.Client(d.socket, name="router") as r:
            ns = w.register_namespace(LAYOUT)
            ks = keys(ns, 21, 6)
            assert r.events() == kvd.EventBatch([], 1, 0)
            assert w.put(ks[:2], [page(4096, 1)] * 2) == [None, None]
            b = w.acquire(ks[:1])[0]
            w.release([b.handle])
            assert w.remove_if([(ks[0], b.handle)]) == [None]
            # Two at a time, in order, until nothing is left (bounded: three events).
            seen, since = [], 0
            for _ in range(3):
                batch = r.events(since, 2)
                assert batch.lost == 0
                if not batch.events:
                    break
                seen += batch.events
                since = batch.next_seq
            assert [(e.seq, e.kind, e.key) for e in seen] == [
                (1, "stored", ks[0]),
                (2, "stored", ks[1]),
                (3, "removed", ks[0]),
            ]
            assert r.events(since).events == []
            # Four more (4..7) and one (8) into a ring of four: a router at 4 lost one.
            assert w.put(ks[2:], [page(4096, 2)] * 4) == [None] * 4
            w.put([kvd.key(ns, bytes([9]) * 32)], [page(4096, 3)])
            late = r.events(since)
            assert late.lost == 1
            assert [e.seq for e in late.events] == [5, 6, 7, 8]
            assert late.next_seq == 9
            with pytest.raises(kvd.InvalidArgument):
                r.events(late.next_seq + 1)
    finally:
        d.stop()


def _ended(c: kvd.Client, tid: int) -> kvd.Transfer:
    out: list[kvd.Transfer] = []

    def done() -> bool:
        out[:] = c.transfers([tid])
        return bool(out) and out[0].state != "in_flight"

    wait_until("the transfer ends", done, timeout_s=30)
    return out[0]


def test_blocks_are_pushed_to_a_peer_and_fetched_back_between_two_daemons(two_nodes):
    a, b = two_nodes
    with kvd.Client(a.socket, name="py-node-1") as ca, kvd.Client(b.socket, name="py-node-2") as cb:
        ns = ca.register_namespace(LAYOUT)
        cb.register_namespace(LAYOUT)
        pushed, fetched = keys(ns, 40, 4), keys(ns, 41, 2)
        pages = [page(65536, 50 + i) for i in range(6)]
        assert ca.put(pushed, pages[:4]) == [None] * 4
        assert cb.put(fetched, pages[4:]) == [None] * 2

        t = _ended(ca, ca.push(2, pushed))
        assert (t.state, t.error, t.blocks, t.peer) == ("done", None, 4, 2)
        dsts = [bytearray(65536) for _ in pushed]
        assert cb.get(pushed, dsts) == [65536] * 4
        assert [bytes(d) for d in dsts] == pages[:4]

        t = _ended(ca, ca.fetch(2, fetched))
        assert (t.state, t.blocks) == ("done", 2)
        dsts = [bytearray(65536) for _ in fetched]
        assert ca.get(fetched, dsts) == [65536] * 2
        assert [bytes(d) for d in dsts] == pages[4:]

        with pytest.raises(kvd.NotFound):
            ca.push(9, pushed[:1])
        assert ca.transfers([123456]) == []

        # a cluster fetch: node 1 names no peer; node 2 holds the first two of a chain of three
        chain = keys(ns, 42, 3)
        chained = [page(65536, 60 + i) for i in range(3)]
        assert cb.put(chain[:2], chained[:2]) == [None] * 2
        t = _ended(ca, ca.fetch(kvd.ANY_NODE, chain))
        assert (t.state, t.blocks, t.peer) == ("done", 2, 2), t
        assert ca.exists(chain) == [True, True, False]
        dsts = [bytearray(65536) for _ in chain[:2]]
        assert ca.get(chain[:2], dsts) == [65536] * 2
        assert [bytes(d) for d in dsts] == chained[:2]

        # a hand-off: node 2 holds the pushed run for request 5 at epoch 3, beyond its session;
        # node 1 reads it bound to that pair (an older epoch's read is refused), which ends it
        assert cb.hold(5, 3, pushed, 30_000) == (4, 4 * 65536)
        with pytest.raises(kvd.StaleEpoch):
            cb.hold(5, 2, pushed, 30_000)
        t = _ended(ca, ca.fetch_held(2, 5, 2, pushed))
        assert t.state == "failed" and isinstance(t.error, kvd.NotFound), t
        t = _ended(ca, ca.fetch_held(2, 5, 3, pushed, end_hold=True))
        assert (t.state, t.blocks) == ("done", 0)  # node 1 has them already; the hold ends
        assert not cb.end_hold(5, 3)
        assert cb.stats()["holds_taken"] == 1


def test_the_ranks_of_an_instance_publish_a_step_together_and_fail_together(daemon):
    def sealed(c: kvd.Client, k: bytes) -> object:
        a = c.alloc([k])[0]
        c.write(a.handle, page(65536, 3))
        assert not isinstance(c.seal([(a.handle, 65536, None)])[0], kvd.KvdError)
        return a.handle

    r0 = kvd.Client(daemon.socket, name="rank-0")
    r1 = kvd.Client(daemon.socket, name="rank-1")
    ns = r0.register_namespace(LAYOUT)
    r1.register_namespace(LAYOUT)
    r0.instance_join(9, 1, 0, 2)
    r1.instance_join(9, 1, 1, 2)
    k = keys(ns, 90, 4)
    assert not r0.instance_commit(9, 1, 0, [sealed(r0, k[0])])
    assert r0.exists(k[:1]) == [False]
    assert r1.instance_commit(9, 1, 0, [sealed(r1, k[1])])
    assert r0.exists(k[:2]) == [True, True]
    # a rank goes away mid-step: the step is aborted on both, the instance failed as a whole
    assert not r0.instance_commit(9, 1, 1, [sealed(r0, k[2])])
    r1.close()
    assert r0.exists(k[2:3]) == [False]
    with pytest.raises(kvd.Unavailable, match="instance 9 has failed"):
        r0.instance_commit(9, 1, 2, [])
    r0.close()
