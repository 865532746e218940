#!/usr/bin/env python3
"""Fail when what engines link (libkvd, kvd-client) or what a router links (kvd-control) pulls in a
daemon dependency, when the streaming front (kvd-front) pulls in more than its HTTP, or when a
service (kvd-daemon, kvd-control-service) or a library links another service: the services are
wired together only by the `kvd` binary.

The check reads the dependency graph cargo resolves for a whole-workspace build (`cargo metadata`,
features unified across the workspace, as a real build sees them), not `cargo tree -p`, which
resolves one package alone and hides what other members switch on.
"""
import json
import subprocess
import sys

SERVICES = {"kvd-daemon", "kvd-control-service"}
LIBRARIES = ["kvd-core", "kvd-client", "kvd-store", "kvd-control", "kvd-sim", "kvd-remote",
             "kvd-cluster", "kvd-front", "kvd-metrics", "kvd-transport"]
ROOTS = sys.argv[1:] or list(dict.fromkeys(
    ["kvd-ffi", "kvd-client", "kvd-control", "kvd-front", *sorted(SERVICES), *LIBRARIES]))
FORBIDDEN = {
    "tokio", "axum", "hyper", "clap", "plotters", "rand", "prometheus-client",
    "tracing-subscriber", "etcd-client",
}
# What one root must not link beyond that: a router needs no byte movers (kvd-core knows nothing
# of the transport; the error conversion lives in kvd-transport behind its `core-errors` feature).
FORBIDDEN_FOR = {"kvd-control": {"kvd-transport", "io-uring"},
                 "kvd-front": {"kvd-transport", "io-uring"}}
# What one root may link although the others must not: the front speaks HTTP to the engines and
# the holders and takes its flags from clap; it needs no etcd client, server or metrics registry.
ALLOWED_FOR = {"kvd-front": {"tokio", "hyper", "clap"}}
# A service links the libraries and its own dependencies, never another service; a library
# links no service. (Only the engine-facing roots above are held to FORBIDDEN.)
ENGINE_FACING = {"kvd-ffi", "kvd-client", "kvd-control", "kvd-front"}
for root in SERVICES:
    FORBIDDEN_FOR[root] = SERVICES - {root}
for root in LIBRARIES:
    FORBIDDEN_FOR.setdefault(root, set())
    FORBIDDEN_FOR[root] = FORBIDDEN_FOR[root] | SERVICES

host = next(line.split()[1] for line in subprocess.check_output(["rustc", "-vV"], text=True)
            .splitlines() if line.startswith("host:"))
meta = json.loads(subprocess.check_output(
    ["cargo", "metadata", "--format-version", "1", "--locked", "--filter-platform", host]))
names = {p["id"]: p["name"] for p in meta["packages"]}
nodes = {n["id"]: n for n in meta["resolve"]["nodes"]}


def normal_deps(node):
    # Dev- and build-dependencies are not linked into the library.
    for d in node["deps"]:
        if any(k["kind"] is None for k in d["dep_kinds"]):
            yield d["pkg"]


failed = False
for root in ROOTS:
    start = [i for i, n in names.items() if n == root]
    if not start:
        sys.exit(f"check-deps: no package {root} in the workspace")
    seen, stack, parent = set(), list(start), {}
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        for d in normal_deps(nodes[i]):
            parent.setdefault(d, i)
            stack.append(d)
    base = FORBIDDEN - ALLOWED_FOR.get(root, set()) if root in ENGINE_FACING else set()
    forbidden = base | FORBIDDEN_FOR.get(root, set())
    bad = sorted(names[i] for i in seen if names[i] in forbidden)
    if bad:
        failed = True
        for b in bad:
            chain, i = [], next(i for i in seen if names[i] == b)
            while i in parent:
                chain.append(names[i])
                i = parent[i]
            chain.append(names[i])
            print(f"check-deps: {root} links {b}: {' <- '.join(chain)}")
    else:
        print(f"check-deps: {root}: {len(seen)} crates, none of {', '.join(sorted(forbidden))}")
sys.exit(1 if failed else 0)
