"""The Python package's half of the bindings' overhead measurement: the same three measurements
as ``kvd-bench bindings`` (benches/src/bindings.rs), through ``kvd.Client``. Run by
scripts/bench-bindings.sh. Usage: bindings.py SOCKET SEED ITERS LOOKUPS"""

import sys
import time

import numpy as np

import kvd

PAGE_BYTES = 2560 * 1024
BATCH = 64
LOOKUP_TAGS = 128
WARMUP = 3


def tag(seed: int, family: int, i: int) -> bytes:
    return bytes([seed]) + family.to_bytes(4, "little") + i.to_bytes(4, "little") + bytes(23)


def report(what: str, us: list, bytes_per_iter: int) -> None:
    total_s = sum(us) / 1e6
    s = sorted(us)
    p50, p99 = s[round((len(s) - 1) * 0.50)], s[round((len(s) - 1) * 0.99)]
    gbps = bytes_per_iter * len(us) / total_s / 1e9 if bytes_per_iter else 0.0
    print(f"BENCH python {what} p50_us={p50:.1f} p99_us={p99:.1f} gbps={gbps:.2f}", flush=True)


def timed(iters: int, f) -> list:
    us = []
    for i in range(WARMUP + iters):
        t = time.perf_counter()
        f(i)
        if i >= WARMUP:
            us.append((time.perf_counter() - t) * 1e6)
    return us


def main() -> None:
    socket, seed, iters, lookups = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    c = kvd.Client(socket, name="bench-python")
    ns = c.register_namespace(kvd.Namespace("bench/bindings", "1", PAGE_BYTES, 16, 1, 1, 64))

    tags = [tag(seed, 0, i) for i in range(LOOKUP_TAGS)]
    c.put([kvd.key(ns, t) for t in tags], [b"\x07" * 4096] * LOOKUP_TAGS)

    def lookup(_: int) -> None:
        assert len(c.lookup_prefix(ns, tags)) == LOOKUP_TAGS

    report("lookup128", timed(lookups, lookup), 0)

    base = np.arange(PAGE_BYTES, dtype=np.uint64).astype(np.uint8)
    srcs = [base ^ np.uint8(b) for b in range(BATCH)]
    dsts = [np.zeros(PAGE_BYTES, dtype=np.uint8) for _ in range(BATCH)]
    last: list = []

    def put(it: int) -> None:
        last[:] = [kvd.key(ns, tag(seed, 1 + it, i)) for i in range(BATCH)]
        assert c.put(last, srcs) == [None] * BATCH

    report("put64x2.5MiB", timed(iters, put), BATCH * PAGE_BYTES)

    def get(_: int) -> None:
        assert c.get(last, dsts) == [PAGE_BYTES] * BATCH

    report("get64x2.5MiB", timed(iters, get), BATCH * PAGE_BYTES)
    assert (dsts[3] == srcs[3]).all()
    c.close()


if __name__ == "__main__":
    main()
