"""The SGLang and vLLM adapters' core logic against a real daemon, without the engines (their
classes fall back to ``object``) and without a GPU: host pools and KV caches are numpy arrays
laid out as the engines lay them out."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

import kvd
from kvd.sglang import KvdHiCacheStorage, page_tag
from kvd.vllm import KvdConnector, KvdConnectorMetadata, block_tag


# -- SGLang -------------------------------------------------------------------------------


class HostPool:
    """An MHA host pool in SGLang's page_first layout: per page a K and a V segment."""

    def __init__(self, pages: int = 8, page_size: int = 4, seg_bytes: int = 4096) -> None:
        self.page_size, self.layer_num, self.head_num, self.head_dim = page_size, 2, 2, 64
        self.dtype = "torch.bfloat16"
        self.seg_bytes = seg_bytes
        self.kv = np.zeros((pages, 2, seg_bytes), dtype=np.uint8)

    def get_size_per_token(self) -> int:
        return 2 * self.seg_bytes // self.page_size

    def get_page_buffer_meta(self, indices):
        ptrs = []
        for i in range(0, len(indices), self.page_size):
            page = int(indices[i]) // self.page_size
            ptrs += [self.kv[page, 0].ctypes.data, self.kv[page, 1].ctypes.data]
        return ptrs, [self.seg_bytes] * len(ptrs)


def sglang_config(socket: str, tp_rank: int = 0, mla: bool = False):
    return SimpleNamespace(
        tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, model_name="Qwen/Qwen3-8B",
        extra_config={"socket": socket, "model_revision": "abc123", "pin_ttl_ms": 3000},
    )


def indices(pages, page_size=4):
    return np.array([p * page_size + t for p in pages for t in range(page_size)])


def test_sglang_pages_go_to_kvd_and_back_zero_copy_and_count_leading_hits(daemon):
    store = KvdHiCacheStorage(sglang_config(daemon.socket), {})
    pool = HostPool()
    store.register_mem_pool_host(pool)
    rng = np.random.default_rng(1)
    pool.kv[:3] = rng.integers(0, 255, size=pool.kv[:3].shape, dtype=np.uint8)
    written = pool.kv[:3].copy()
    hashes = ["h0", "h1", "h2"]
    assert store.batch_set_v1(hashes, indices([0, 1, 2])) == [True, True, True]
    assert store.batch_set_v1(hashes[:1], indices([0])) == [True], "already stored is stored"
    assert store.batch_exists(hashes + ["h3"]) == 3
    assert store.batch_exists(["h3"] + hashes) == 0
    assert store.exists("h1") and not store.exists("nope")
    pool.kv[:] = 0
    assert store.batch_get_v1(["h2", "h0", "nope"], indices([5, 6, 7])) == [True, True, False]
    assert (pool.kv[5] == written[2]).all() and (pool.kv[6] == written[0]).all()
    assert (pool.kv[7] == 0).all()
    assert store.get_stats()["pins"] == 0, "every pin released"


def test_sglang_namespaces_keep_tp_ranks_apart_but_share_mla_pages(daemon):
    pool = HostPool()
    r0 = KvdHiCacheStorage(sglang_config(daemon.socket, 0), {})
    r1 = KvdHiCacheStorage(sglang_config(daemon.socket, 1), {})
    for s in (r0, r1):
        s.register_mem_pool_host(pool)
    assert r0.namespace() != r1.namespace()
    assert r0.batch_set_v1(["p"], indices([0])) == [True]
    assert r1.batch_exists(["p"]) == 0, "another rank's shard is a miss"
    m0 = KvdHiCacheStorage(sglang_config(daemon.socket, 0, mla=True), {})
    m1 = KvdHiCacheStorage(sglang_config(daemon.socket, 1, mla=True), {})
    m0.register_mem_pool_host(pool)
    m1.register_mem_pool_host(pool)
    assert m0.namespace() == m1.namespace()
    assert page_tag("p") == page_tag("p") and len(page_tag("p")) == 32


def test_sglang_whole_page_get_and_set_without_a_host_pool(daemon):
    cfg = sglang_config(daemon.socket)
    cfg.extra_config["bytes_per_page"] = 8192
    store = KvdHiCacheStorage(cfg, {})
    page = np.arange(8192, dtype=np.uint8)
    assert store.set("k", page)
    assert store.batch_set(["k2", "k3"], [page, page])
    out = np.zeros(8192, dtype=np.uint8)
    assert store.get("k", out) is out and (out == page).all()
    assert store.get("missing", np.zeros(8192, dtype=np.uint8)) is None
    assert store.get("k") == page.tobytes()
    got = store.batch_get(["k2", "missing"], [np.zeros(8192, np.uint8), np.zeros(8192, np.uint8)])
    assert got[1] is None and (got[0] == page).all()


# -- vLLM ---------------------------------------------------------------------------------

BLOCK = 4
LAYERS, HEADS, HEAD = 2, 2, 16
SEG = BLOCK * HEADS * HEAD * 2  # bytes of K (or V) of one layer of one block (bf16)


class ModelConfig:
    model, revision, tokenizer, dtype = "meta-llama/Llama-3.1-8B", "main", "llama3", "bfloat16"

    def get_num_layers(self, pc):
        return LAYERS

    def get_num_kv_heads(self, pc):
        return HEADS

    def get_head_size(self):
        return HEAD


def vllm_config(socket: str):
    return SimpleNamespace(
        model_config=ModelConfig(),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(block_size=BLOCK),
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"socket": socket, "pin_ttl_ms": 3000}
        ),
    )


class Blocks:
    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (self.ids,)


def request(rid: str, hashes, num_tokens: int, computed: int = 0):
    return SimpleNamespace(
        request_id=rid, block_hashes=hashes, num_tokens=num_tokens, num_computed_tokens=computed
    )


def kv_caches(num_blocks: int, seed: int):
    rng = np.random.default_rng(seed)
    # FlashAttention's layout per layer: [2, num_blocks, block, heads, head] (bf16 as bytes).
    return {
        f"layer.{i}": rng.integers(0, 255, size=(2, num_blocks, SEG), dtype=np.uint8)
        for i in range(LAYERS)
    }


def save_through(conn: KvdConnector, req, block_ids, caches) -> None:
    """One request's life on the producing side: finished -> save -> reported."""
    delayed, _ = conn.request_finished(req, block_ids)
    assert delayed, "the blocks are freed only after the save"
    meta = conn.build_connector_meta(None)
    conn.register_kv_caches(caches)
    conn.bind_connector_metadata(meta)
    conn.wait_for_save()
    conn.clear_connector_metadata()
    assert conn.get_finished(set()) == (None, None), "not reported before vLLM names it finished"
    assert conn.get_finished({req.request_id}) == ({req.request_id}, None)


def test_vllm_blocks_saved_by_one_engine_load_into_another(daemon):
    hashes = [bytes([i]) * 32 for i in range(3)]
    producer = KvdConnector(vllm_config(daemon.socket), "WORKER")
    src = kv_caches(8, 1)
    save_through(producer, request("a", hashes, 12), [5, 6, 7], src)

    consumer = KvdConnector(vllm_config(daemon.socket), "SCHEDULER")
    req = request("b", hashes + [b"\x09" * 32], 17)
    n, is_async = consumer.get_num_new_matched_tokens(req, 0)
    assert (n, is_async) == (12, False)
    # Everything cached: the last token is still computed, so one block fewer.
    assert consumer.get_num_new_matched_tokens(request("c", hashes, 12), 0) == (8, False)
    assert consumer.get_num_new_matched_tokens(req, 4) == (8, False)
    consumer.update_state_after_alloc(req, Blocks([0, 1, 2, 3]), 12)
    meta = consumer.build_connector_meta(None)
    assert isinstance(meta, KvdConnectorMetadata) and meta.loads[0].block_ids == [0, 1, 2]
    dst = kv_caches(4, 2)
    consumer.register_kv_caches(dst)
    consumer.bind_connector_metadata(meta)
    consumer.start_load_kv(None)
    consumer.wait_for_layer_load("layer.0")
    assert consumer.get_block_ids_with_load_errors() == set()
    for name in src:
        for kv in (0, 1):
            assert (dst[name][kv][:3] == src[name][kv][5:8]).all()
    assert consumer.client.stats()["pins"] == 0


def test_vllm_a_block_removed_before_the_load_is_reported_as_a_load_error(daemon):
    hashes = [bytes([10 + i]) * 32 for i in range(3)]
    producer = KvdConnector(vllm_config(daemon.socket), "WORKER")
    save_through(producer, request("a", hashes, 12), [0, 1, 2], kv_caches(4, 3))
    consumer = KvdConnector(vllm_config(daemon.socket), "SCHEDULER")
    req = request("b", hashes, 13)
    assert consumer.get_num_new_matched_tokens(req, 0) == (12, False)
    consumer.update_state_after_alloc(req, Blocks([4, 5, 6, 7]), 12)
    meta = consumer.build_connector_meta(None)
    # Between the lookup and the load, block 1's entry is removed.
    k = kvd.key(consumer.namespace, block_tag(hashes[1]))
    b = consumer.client.acquire([k])[0]
    consumer.client.release([b.handle])
    assert consumer.client.remove_if([(k, b.handle)]) == [None]
    consumer.register_kv_caches(kv_caches(8, 4))
    consumer.bind_connector_metadata(meta)
    consumer.start_load_kv(None)
    assert consumer.get_block_ids_with_load_errors() == {5}
    assert consumer.get_block_ids_with_load_errors() == set(), "reported once"


def test_vllm_asks_again_while_the_daemon_is_unreachable_and_saves_only_what_is_missing(daemon):
    conn = KvdConnector(vllm_config(daemon.socket), "SCHEDULER")
    hashes = [b"\x21" * 32, b"\x22" * 32]
    save_through(conn, request("a", hashes, 8), [0, 1], kv_caches(2, 5))
    assert conn.request_finished(request("b", hashes, 8), [3, 4]) == (False, None), "stored already"
    daemon.stop()
    assert conn.get_num_new_matched_tokens(request("c", hashes, 9), 0) == (None, False)
    assert conn.get_num_new_matched_tokens(request("c", [], 9), 0)[0] in (None, 0)


def test_vllm_block_hashes_become_tags():
    assert block_tag(b"\x01" * 32) == b"\x01" * 32
    assert len(block_tag(b"short")) == 32
    assert block_tag(SimpleNamespace(hash_value=7)) == block_tag(SimpleNamespace(hash_value=7))
    with pytest.raises(ValueError):
        kvd.key(b"x", b"y")


def test_vllm_asynchronous_lookups_answer_ask_again_then_the_hit(daemon):
    hashes = [bytes([40 + i]) * 32 for i in range(2)]
    producer = KvdConnector(vllm_config(daemon.socket), "WORKER")
    save_through(producer, request("a", hashes, 8), [0, 1], kv_caches(2, 6))
    cfg = vllm_config(daemon.socket)
    cfg.kv_transfer_config.kv_connector_extra_config["async_lookup"] = True
    sched = KvdConnector(cfg, "SCHEDULER")
    req = request("b", hashes, 9)
    answers = []
    for _ in range(200):  # a scheduler step is ~ms; each call here is one step
        n, _ = sched.get_num_new_matched_tokens(req, 0)
        answers.append(n)
        if n is not None:
            break
        time.sleep(0.005)
    assert answers[-1] == 8
    assert all(a is None for a in answers[:-1])
