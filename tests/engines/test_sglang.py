"""kvd as SGLang 0.5.23's HiCache L3 backend, inside SGLang's own code on CPU.

Nothing of SGLang is stood in for: the backend is built by SGLang's ``StorageBackendFactory``
from the launch line's JSON (the one in ``kvd.sglang``'s docstring, parsed by SGLang's own
``parse_storage_backend_extra_config``), inside SGLang's ``HybridCacheController`` (the
controller every HiCache stack of 0.5.23 uses) over SGLang's real MHA and MLA host pools in a
``HostPoolGroup``, as ``build_kv_only_stack`` assembles them. Pages go to kvd through the
controller's backup thread (``write_storage``) and come back through its prefetch threads (the
hit query, then ``_page_transfer``), as the tree cache drives them. The only departures from a
GPU server: host pools are built with ``pin_memory=False`` (pinning needs CUDA), and the
parallel widths are stated with ``get_parallel().override`` (a server publishes them).

Run with the engine venv (scripts/test.sh does):
    KVD_BIN=target/debug/kvd $(scripts/engine-venv.sh)/bin/python -m pytest -q tests/engines/test_sglang.py
"""

from __future__ import annotations

import itertools
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import pytest

# SGLang JIT-builds its page-hash extension with torch's cpp_extension, which runs `ninja`
# from PATH: the venv's bin, as an activated venv would have it.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")

import torch  # noqa: E402  (the engine venv has both: a missing one fails, never skips)

from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolName  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (  # noqa: E402
    _mha_host_inputs,
    build_pool_entry,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
from sglang.srt.observability.metrics_collector import (  # noqa: E402
    StorageMetrics,
    StorageMetricsCollector,
)
from sglang.srt.runtime_context import get_parallel  # noqa: E402

import kvd.sglang  # noqa: E402
from kvd.sglang import KvdHiCacheStorage  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvd_daemon import Daemon, peers_file, write_peers  # noqa: E402

PAGE, LAYERS, HEADS, HEAD_DIM = 4, 2, 2, 8  # MHA: 2 * 2 * 2 * 8 * 4 * 2 bytes = 512 B a page
LORA, ROPE = 16, 8  # MLA: 24 * 2 * 4 * 2 bytes = 384 B a page
DEVICE_TOKENS = 32
MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
TIMEOUT_S = 30

_tokens = itertools.count(1000)


def fresh_tokens(pages: int) -> list[int]:
    """Token ids no other test used: their page hashes are new to the daemon."""
    return [next(_tokens) for _ in range(pages * PAGE)]


def launch_json() -> dict:
    """The extra-config JSON of the launch line in kvd.sglang's docstring."""
    doc = kvd.sglang.__doc__ or ""
    m = re.search(r"--hicache-storage-backend-extra-config '(\{.*?\})'", doc, re.S)
    assert m, "the module docstring has no launch line"
    return json.loads(m.group(1))


@pytest.fixture(scope="module")
def daemon():
    d = Daemon(["--pool-mib", "64"])
    yield d
    d.stop()


@pytest.fixture(scope="module", autouse=True)
def parallel_widths():
    """One process, no TP/PP/DCP: what a server's published parallel config says."""
    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1):
        yield


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "tiny-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": LAYERS}))
    (d / "model.safetensors").write_bytes(b"\x01" * 4096)
    return d


def host_pool(kind: str, layout: str):
    """SGLang's real device pool and host pool on CPU, as _build_mha_mla_host_pool builds them
    (pin_memory off: pinning needs CUDA)."""
    if kind == "mha":
        dev = MHATokenToKVPool(
            size=DEVICE_TOKENS, page_size=PAGE, dtype=torch.bfloat16, head_num=HEADS, head_dim=HEAD_DIM,
            layer_num=LAYERS, device="cpu", enable_memory_saver=False,
        )
        cls, info, kw = _mha_host_inputs(dev)
        return dev, cls(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu", **kw)
    dev = MLATokenToKVPool(
        size=DEVICE_TOKENS, page_size=PAGE, dtype=torch.bfloat16, kv_lora_rank=LORA, qk_rope_head_dim=ROPE,
        layer_num=LAYERS, device="cpu", enable_memory_saver=False,
    )
    host = MLATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=dev.size, start_layer=dev.start_layer, end_layer=dev.end_layer,
        target_layer_num=dev.layer_num, override_kv_cache_dim=dev.kv_cache_dim,
    )
    return dev, host


def token_kv(pool, t: int):
    """Token ``t``'s K and V (MHA: [2, layer, head, dim]) or latent row (MLA: [layer, 1, dim])
    in the host pool, read by the layout's own axes (init_kv_buffer's dims)."""
    kv, p, o = pool.kv_buffer, t // pool.page_size, t % pool.page_size
    mla = isinstance(pool, MLATokenToKVPoolHost)
    if pool.layout == "layer_first":
        return (kv[:, t] if mla else kv[:, :, t]).clone()
    if pool.layout == "page_first":
        return (kv[t] if mla else kv[:, t]).clone()
    if pool.layout == "page_first_direct":
        return (kv[p, :, o] if mla else kv[:, p, :, o]).clone()
    if pool.layout == "page_head":
        return kv[:, p, :, o].transpose(1, 2).clone()  # [2, head, layer, dim] -> [2, layer, head, dim]
    raise AssertionError(pool.layout)


class Stack:
    """SGLang's KV-only HiCache stack (build_kv_only_stack's group and controller) with the
    kvd backend attached from the launch JSON."""

    def __init__(self, socket: str, kind: str, layout: str, v1: bool, model: Path, **extra) -> None:
        self.dev, self.host = host_pool(kind, layout)
        allocator = PagedTokenToKVPoolAllocator(DEVICE_TOKENS, PAGE, torch.bfloat16, "cpu", self.dev, False)
        self.group = HostPoolGroup([self.entry(PoolName.KV, self.host, is_anchor=True)])
        metrics = extra.pop("metrics", False)
        sidecars = extra.pop("sidecars", [])
        for name, pool in sidecars:
            self.group.add_entry(self.entry(name, pool))
        cfg = {**launch_json(), "socket": socket, "interface_v1": int(v1), **extra}
        extra_config, threshold, *_ = HybridCacheController.parse_storage_backend_extra_config(json.dumps(cfg))
        self.cc = HybridCacheController(
            allocator, self.group, PAGE, None, threading.Event(), io_backend="direct",
            storage_backend=None, prefetch_threshold=threshold, model_name=str(model),
            transfer_layer_id_max=LAYERS, enable_storage_metrics=metrics,
        )
        # What the constructor does with storage_backend set, and what the runtime attach of
        # unified_cache/storage_attachment.py calls: the same function, here so that a refused
        # attach can be cleaned up (detach) in the test.
        try:
            self.cc.attach_storage_backend(
                storage_backend="dynamic", prefetch_threshold=threshold, model_name=str(model),
                storage_backend_extra_config=extra_config, host_pools=self.group.entries,
            )
        except Exception:
            self.cc.detach_storage_backend()  # stops the storage threads, closes the backend
            raise
        self.backend = self.cc.storage_backend

    def entry(self, name, pool, is_anchor: bool = False):
        return build_pool_entry(
            name=name, host_pool=pool, device_pool=self.dev, layer_mapping={i: i for i in range(LAYERS)},
            transfer_layer_id_max=LAYERS, is_anchor=is_anchor,
        )

    def close(self) -> None:
        self.cc.detach_storage_backend()

    def write(self, tokens: list[int]) -> tuple[int, list]:
        """Random KV into fresh host pages, backed up through the controller's backup thread:
        (tokens it reports stored, each token's KV as written)."""
        idx = self.group.alloc(len(tokens))
        assert idx is not None
        self.host.kv_buffer.copy_(torch.randn(self.host.kv_buffer.shape).to(self.host.kv_buffer.dtype))
        written = [token_kv(self.host, int(t)) for t in idx]
        hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
        self.cc.write_storage(idx, tokens, hash_value=hashes)
        op = self.cc.ack_backup_queue.get(timeout=TIMEOUT_S)
        self.group.free(idx)
        return op.completed_tokens, written

    def read(self, tokens: list[int]) -> tuple[int, int, list]:
        """A prefetch as the tree cache drives it, into a zeroed host pool: the hit query, then
        host pages for the hit and the transfer. (hit tokens, loaded tokens, each loaded
        token's KV)."""
        self.host.kv_buffer.zero_()
        op = self.cc.prefetch(CacheRequestHandle(rid=f"r{next(_tokens)}", attempt_id=0), tokens)
        got = self.cc.prefetch_hit_queue.get(timeout=TIMEOUT_S)
        assert got is op
        hit = op.storage_hit_count
        if hit == 0:
            return 0, 0, []
        idx, n = self.cc.allocate_storage_hit(op, hit, allow_partial=False, min_tokens=PAGE, evict_host=lambda _: 0)
        assert idx is not None and n == hit
        op.host_indices = idx
        self.cc.prefetch_buffer.put(op)
        loaded = 0
        while True:
            ack = self.cc.ack_prefetch_queue.get(timeout=TIMEOUT_S)
            if ack.completed_tokens is not None:
                loaded = max(loaded, ack.completed_tokens)
            if ack.completed_req:
                break
        kv = [token_kv(self.host, int(t)) for t in idx[:loaded]]
        self.group.free(idx)
        return hit, loaded, kv


def cases():
    for kind, layouts in (("mha", MHA_LAYOUTS), ("mla", MLA_LAYOUTS)):
        for layout in layouts:
            for v1 in (False, True):
                yield pytest.param(kind, layout, v1, id=f"{kind}-{layout}-{'v1' if v1 else 'generic'}")


# -- the factory, the launch line --------------------------------------------------------


def test_the_launch_json_builds_kvd_through_the_factory_with_zero_copy_io(daemon, model_dir):
    cfg = launch_json()
    assert cfg["interface_v1"] == 1 and cfg["module_path"] == "kvd.sglang"
    s = Stack(daemon.socket, "mha", "page_first", True, model_dir)
    try:
        assert type(s.backend) is KvdHiCacheStorage
        assert s.backend.io == "v1"
        # the controller chose the zero-copy page functions from "interface_v1"
        assert s.cc.page_get_func == s.cc._page_get_zero_copy
        assert s.cc.page_set_func == s.cc._page_set_zero_copy
    finally:
        s.close()


# -- round trips: every layout of SGLang's MHA and MLA host pools, both I/O paths ----------


def test_a_backend_idle_past_its_session_lease_still_stores_and_loads(daemon, model_dir):
    s = Stack(daemon.socket, "mha", "page_first", True, model_dir)
    try:
        time.sleep(11)  # the session's lease is 10 s; an idle SGLang makes no calls to renew it
        tokens = fresh_tokens(2)
        stored, _ = s.write(tokens)
        assert stored == len(tokens)
        hit, loaded, _ = s.read(tokens)
        assert hit == loaded == len(tokens)
    finally:
        s.close()


@pytest.mark.parametrize("kind,layout,v1", list(cases()))
def test_pages_written_by_the_controller_come_back_equal_per_token(daemon, model_dir, kind, layout, v1):
    s = Stack(daemon.socket, kind, layout, v1, model_dir)
    try:
        tokens = fresh_tokens(3)
        stored, written = s.write(tokens)
        assert stored == len(tokens)
        hit, loaded, kv = s.read(tokens)
        assert hit == loaded == len(tokens)
        for t, (want, got) in enumerate(zip(written, kv)):
            assert torch.equal(want, got), f"token {t} differs after the round trip"
        # a longer prompt hits only its stored prefix
        hit, loaded, _ = s.read(tokens + fresh_tokens(2))
        assert hit == loaded == len(tokens)
    finally:
        s.close()


# -- what must be a miss --------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,written_under,read_under",
    [
        ("mha", "page_first", "layer_first"),
        ("mha", "page_first", "page_head"),
        ("mha", "page_first_direct", "page_first"),
        ("mla", "layer_first", "page_first"),
    ],
)
@pytest.mark.parametrize("v1", [False, True], ids=["generic", "v1"])
def test_a_page_written_under_one_layout_is_a_miss_under_another(daemon, model_dir, kind, written_under, read_under, v1):
    w = Stack(daemon.socket, kind, written_under, v1, model_dir)
    tokens = fresh_tokens(2)
    try:
        assert w.write(tokens)[0] == len(tokens)
        assert w.read(tokens)[0] == len(tokens)  # the pages are there for their own layout
    finally:
        w.close()
    # same page size (so a namespace without the layout would hit), other bytes' meaning
    r = Stack(daemon.socket, kind, read_under, v1, model_dir)
    try:
        assert r.host.get_size_per_token() == w.host.get_size_per_token()
        assert r.read(tokens)[0] == 0
    finally:
        r.close()


@pytest.mark.parametrize("kind,layout", [("mha", "layer_first"), ("mha", "page_first"), ("mla", "page_first")])
@pytest.mark.parametrize("written_v1", [False, True], ids=["generic-then-v1", "v1-then-generic"])
def test_a_page_written_through_one_io_path_is_a_miss_through_the_other(daemon, model_dir, kind, layout, written_v1):
    w = Stack(daemon.socket, kind, layout, written_v1, model_dir)
    tokens = fresh_tokens(2)
    try:
        assert w.write(tokens)[0] == len(tokens)
    finally:
        w.close()
    r = Stack(daemon.socket, kind, layout, not written_v1, model_dir)
    try:
        assert r.read(tokens)[0] == 0
    finally:
        r.close()


def test_other_weights_at_the_same_model_path_are_a_miss(daemon, model_dir):
    w = Stack(daemon.socket, "mha", "page_first", True, model_dir)
    tokens = fresh_tokens(2)
    try:
        assert w.write(tokens)[0] == len(tokens)
    finally:
        w.close()
    (model_dir / "model.safetensors").write_bytes(b"\x02" * 8192)  # new weights, same path
    r = Stack(daemon.socket, "mha", "page_first", True, model_dir)
    try:
        assert r.read(tokens)[0] == 0
    finally:
        r.close()


def test_the_same_weights_in_another_directory_hit_whatever_their_file_times(daemon, model_dir, tmp_path):
    import shutil

    copy = tmp_path / "elsewhere" / "same-model"
    shutil.copytree(model_dir, copy, copy_function=shutil.copyfile)  # new mtimes: another node
    for p in copy.iterdir():
        os.utime(p, (1_000_000_000, 1_000_000_000))
    w = Stack(daemon.socket, "mla", "page_first", True, model_dir)
    tokens = fresh_tokens(1)
    try:
        assert w.write(tokens)[0] == len(tokens)
    finally:
        w.close()
    r = Stack(daemon.socket, "mla", "page_first", True, copy)
    try:
        assert r.read(tokens)[0] == len(tokens)
    finally:
        r.close()


def test_a_model_that_is_not_a_local_directory_needs_an_exact_revision(daemon):
    with pytest.raises(ValueError, match="model_revision"):
        Stack(daemon.socket, "mha", "page_first", True, Path("org/not-a-local-model"))
    s = Stack(daemon.socket, "mha", "page_first", True, Path("org/not-a-local-model"), model_revision="abc123")
    try:
        assert s.backend.namespace_descriptor().model_revision == "abc123"
    finally:
        s.close()


@pytest.mark.parametrize("kind,shared", [("mha", False), ("mla", True)])
def test_mha_pages_of_another_tp_rank_are_a_miss_but_mla_pages_are_shared(daemon, model_dir, kind, shared):
    tokens = fresh_tokens(1)
    with get_parallel().override(tp_rank=0, tp_size=2):
        w = Stack(daemon.socket, kind, "page_first", True, model_dir)
        try:
            assert w.backend.config.tp_rank == 0 and w.backend.config.tp_size == 2
            assert w.write(tokens)[0] == len(tokens)
        finally:
            w.close()
    with get_parallel().override(tp_rank=1, tp_size=2):
        r = Stack(daemon.socket, kind, "page_first", True, model_dir)
        try:
            assert r.backend.config.tp_rank == 1
            assert r.read(tokens)[0] == (len(tokens) if shared else 0)
        finally:
            r.close()


# -- start-up refusals ----------------------------------------------------------------------


def test_a_hybrid_pool_group_is_refused_at_start_up(daemon, model_dir):
    _, swa = host_pool("mha", "page_first")  # the SWA pool of a hybrid-SWA stack is an MHA host pool
    with pytest.raises(ValueError, match="hybrid pool groups .* batch_\\*_v2"):
        Stack(daemon.socket, "mha", "page_first", True, model_dir, sidecars=[(PoolName.SWA, swa)])


def test_a_page_unified_host_pool_is_refused_at_start_up(daemon, model_dir):
    with pytest.raises(ValueError, match="layout 'page_unified' is not supported"):
        Stack(daemon.socket, "mha", "page_unified", True, model_dir)


# -- metrics and close ------------------------------------------------------------------------


def test_get_stats_passes_sglangs_storage_metrics_logging(daemon, model_dir):
    from prometheus_client import REGISTRY

    labels = {"kvd_test": "sglang"}
    collector = StorageMetricsCollector(labels)
    s = Stack(daemon.socket, "mha", "page_first", True, model_dir, metrics=True)
    try:
        tokens = fresh_tokens(2)
        s.write(tokens)
        s.read(tokens)
        # unified_radix_cache.UnifiedRadixCache.check_hicache_events, every scheduler step
        # with --enable-metrics (the lines after the storage queues drain):
        storage_metrics = s.cc.storage_backend.get_stats()
        if storage_metrics is None:
            storage_metrics = StorageMetrics()
        if not hasattr(storage_metrics, "prefetch_stats"):
            storage_metrics.prefetch_stats = {"requested_tokens": 0}
        collector.log_storage_metrics(storage_metrics)

        assert isinstance(storage_metrics, StorageMetrics)
        assert storage_metrics.backup_pgs == [2] and storage_metrics.prefetch_pgs == [2]
        assert all(bw > 0 for bw in storage_metrics.backup_bandwidth + storage_metrics.prefetch_bandwidth)
        for name in ("sglang:backup_pgs", "sglang:prefetch_pgs", "sglang:prefetch_bandwidth"):
            assert REGISTRY.get_sample_value(f"{name}_count", labels) == 1
        assert REGISTRY.get_sample_value("sglang:prefetch_pgs_sum", labels) == 2
        # drained: the next step logs nothing new
        again = s.cc.storage_backend.get_stats()
        assert again.prefetch_pgs == [] and again.backup_pgs == []
    finally:
        s.close()


def test_close_ends_the_session_and_is_idempotent(daemon, model_dir):
    s = Stack(daemon.socket, "mha", "page_first", True, model_dir)
    backend = s.backend
    s.close()  # detach_storage_backend calls close()
    assert backend.client is None
    backend.close()  # again: nothing happens
    with pytest.raises(ValueError, match="closed"):
        backend.batch_set_v1(["k"], torch.arange(PAGE))


# -- a page stored through another node's daemon -------------------------------------------


def test_pages_stored_on_another_node_are_a_hit_fetched_through_this_nodes_daemon(model_dir, tmp_path):
    """Two daemons with data ports, each in the other's peers file: a stack on node 1 writes,
    a stack on node 2 reads. Node 2's hit query finds nothing here, asks the cluster, and
    loads node 1's pages through its own daemon, equal per token; a longer prompt hits only
    the stored prefix."""
    secret = tmp_path / "secret"
    secret.write_bytes(bytes([7]) * 32)
    secret.chmod(0o600)
    peers = peers_file(tmp_path / "peers")
    port = ["--pool-mib", "64", "--cluster-secret-file", str(secret), "--data-listen", "127.0.0.1:0",
            "--peers-file", str(peers)]
    d1, d2 = Daemon([*port, "--node-id", "1"]), Daemon([*port, "--node-id", "2"])
    a = b = None
    try:
        write_peers(peers, {1: d1, 2: d2})
        time.sleep(1.5)  # each daemon reads the peers file again within a second
        a = Stack(d1.socket, "mha", "page_first", True, model_dir)
        b = Stack(d2.socket, "mha", "page_first", True, model_dir)
        tokens = fresh_tokens(3)
        stored, written = a.write(tokens)
        assert stored == len(tokens)
        hit, loaded, kv = b.read(tokens + fresh_tokens(2))
        assert hit == loaded == len(tokens), "the stored prefix, fetched from node 1"
        for t, (want, got) in enumerate(zip(written, kv)):
            assert torch.equal(want, got), f"token {t} differs after the fetch"
        assert b.backend.cluster_figures["cluster_fetched_pages"] == 3, b.backend.cluster_figures
        # a prompt nobody stored: a miss after asking, nothing fetched
        assert b.read(fresh_tokens(2))[0] == 0
        assert b.backend.cluster_figures["cluster_fetched_pages"] == 3
    finally:
        for s in (a, b):
            if s is not None:
                s.close()
        d1.stop()
        d2.stop()
