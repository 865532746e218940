"""kvd from Python in about ten lines: connect, put a page, get it back verified."""

import sys

import kvd

with kvd.Client(sys.argv[1] if len(sys.argv) > 1 else "kvd-data/kvd.sock", name="example") as c:
    ns = c.register_namespace(kvd.Namespace("example/tiny", "r1", 4096, 16, 1, 1, 64))
    k = kvd.key(ns, bytes(range(32)))
    assert c.put([k], [b"hello, kvd".ljust(4096, b"\0")]) == [None]  # alloc, copy+CRC, seal, publish
    page = bytearray(4096)
    assert c.get([k], [page]) == [4096]  # acquire, copy out with the CRC checked, release
    print("got back:", bytes(page[:10]).decode())
