"""kvd.vllm_layout on torch tensors laid out as vLLM lays them out: for every physical layout the
connector accepts (and kernel blocks smaller than vLLM's blocks), the byte runs of a block,
read back to back, are the block's K and V in kvd's canonical order, [layer][kernel block][H][N][C]
in logical order. A CPU engine here always gets LBHNC and one kernel block per block, so the
other layouts are shown here, on the same code the connector runs."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvd.vllm_layout import BlockLayout, LayoutError

BLOCKS, H, N, C = 6, 3, 8, 10  # logical blocks, KV heads, slots of a kernel block, 2 * head size

# physical axis order of a per-layer [B, H, N, C] view (vLLM's KVCacheLayout.layer_view_order)
LAYOUTS = {"LBHNC": (0, 1, 2, 3), "LHBNC": (1, 0, 2, 3)}


def layer(order: tuple[int, ...], ratio: int, seed: int) -> torch.Tensor:
    """A [BLOCKS * ratio, H, N, C] logical view whose memory is in ``order``."""
    shape = (BLOCKS * ratio, H, N, C)
    phys = torch.empty([shape[d] for d in order], dtype=torch.float32)
    phys.copy_(torch.randn(phys.shape, generator=torch.Generator().manual_seed(seed)))
    inverse = [order.index(d) for d in range(4)]
    return phys.permute(*inverse)  # logical axes, physical strides


def gather(segs: list[tuple[int, int]]) -> bytes:
    return b"".join(ctypes.string_at(addr, n) for addr, n in segs)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("ratio", [1, 2])
def test_a_blocks_runs_are_its_kv_in_canonical_order(name, ratio):
    caches = {f"l{i}": layer(LAYOUTS[name], ratio, i) for i in range(2)}
    lay = BlockLayout(caches, BLOCKS, ["l0", "l1"])
    assert lay.block_bytes == 2 * ratio * H * N * C * 4
    for b in range(BLOCKS):
        want = b"".join(
            caches[n][b * ratio:(b + 1) * ratio].contiguous().numpy().tobytes() for n in ("l0", "l1")
        )
        assert gather(lay.segments(b)) == want


def test_an_lbhnc_block_is_one_run_per_layer_even_split_into_kernel_blocks():
    caches = {"l0": layer(LAYOUTS["LBHNC"], 2, 0)}
    assert len(BlockLayout(caches, BLOCKS, ["l0"]).segments(3)) == 1


def test_a_layout_that_reorders_a_blocks_dims_is_refused_with_the_layout_named():
    caches = {"l0": layer((0, 2, 1, 3), 1, 0)}  # LBNHC: slots outside heads inside a block
    with pytest.raises(LayoutError, match="LBHNC"):
        BlockLayout(caches, BLOCKS, ["l0"])


def test_missing_layers_and_foreign_block_ids_are_errors():
    caches = {"l0": layer(LAYOUTS["LBHNC"], 1, 0)}
    with pytest.raises(LayoutError, match="no KV cache tensor"):
        BlockLayout(caches, BLOCKS, ["l0", "l1"])
    with pytest.raises(LayoutError, match="outside"):
        BlockLayout(caches, BLOCKS, ["l0"]).segments(BLOCKS)
    with pytest.raises(LayoutError, match="multiple"):
        BlockLayout(caches, BLOCKS + 1, ["l0"])
