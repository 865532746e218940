"""Where one vLLM block's bytes live in the per-layer KV cache tensors vLLM hands a connector.

vLLM (0.32 and later, RFC #42082) gives ``register_kv_caches`` one tensor per attention layer, a
*logical* view ``[kernel_blocks, H, N, C]`` (KV heads, tokens of a kernel block, K and V side by
side) whose *physical* order vLLM chose from the backend's supported layouts (``LBHNC``,
``LHBNC``, ``BLHNC``, ...: the strides say which). A scheduler block may be split into
``ratio`` kernel blocks when the attention kernel supports only smaller blocks (vLLM's
"virtual block splitting"): logical block ``b`` is kernel blocks ``b*ratio .. b*ratio+ratio-1``.

kvd stores one vLLM block as one kvd block, in a canonical byte order that does not depend on
the physical layout: layer by layer (in the KV cache config's order), kernel block by kernel
block, and inside a kernel block ``[H, N, C]`` in logical order. On the layout the connector
asks for (``LBHNC``: every kernel block's ``[H, N, C]`` is one run) a layer of a block is one
contiguous run of bytes; on a head-outer layout (``LHBNC``) it is one run per head; both are
copied as runs, never element by element. A layout whose runs would not come out in the
canonical order is refused at start-up with the layout named, not copied wrongly.

``BlockLayout.segments(block_id)`` gives the ``(address, bytes)`` runs of one block in that
order: the same list serves the CPU copy (``memmove`` from or into a kvd page) and the GPU copy
(libkvd's CUDA calls take exactly such slices).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


class LayoutError(ValueError):
    """The KV cache tensors cannot be copied as kvd blocks (the message says what to change)."""


@dataclass(frozen=True)
class LayerLayout:
    """One layer's tensor: where kernel block 0 starts and how runs repeat."""

    name: str
    base: int  # address of element [0, 0, 0, 0]
    block_stride: int  # bytes between kernel blocks
    outer: tuple[tuple[int, int], ...]  # (count, stride bytes) of dims outside a block's run
    run_bytes: int  # one contiguous run inside a kernel block
    ratio: int  # kernel blocks per vLLM block
    device: str

    @property
    def block_bytes(self) -> int:
        n = self.run_bytes * self.ratio
        for count, _ in self.outer:
            n *= count
        return n

    def segments(self, block_id: int, out: list[tuple[int, int]]) -> None:
        first = block_id * self.ratio
        if not self.outer and self.run_bytes == self.block_stride:
            # The ratio kernel blocks are adjacent: one run for the whole block.
            out.append((self.base + first * self.block_stride, self.run_bytes * self.ratio))
            return
        for k in range(first, first + self.ratio):
            start = self.base + k * self.block_stride
            if not self.outer:
                out.append((start, self.run_bytes))
                continue
            (count, stride), *rest = self.outer
            if rest:
                raise LayoutError(f"layer {self.name}: more than one dim outside the block run")
            for i in range(count):
                out.append((start + i * stride, self.run_bytes))


def layer_layout(name: str, kv: Any, num_blocks: int) -> LayerLayout:
    """Read a layer's physical layout off its tensor's shape and strides."""
    if not hasattr(kv, "stride") or kv.dim() < 2:
        raise LayoutError(f"layer {name}: a {type(kv).__name__} is not a per-layer KV cache tensor")
    shape, el = list(kv.shape), kv.element_size()
    strides = [s * el for s in kv.stride()]
    if num_blocks <= 0 or shape[0] % num_blocks:
        raise LayoutError(f"layer {name}: {shape[0]} kernel blocks is not a multiple of {num_blocks} blocks")
    ratio = shape[0] // num_blocks
    block_stride = strides[0]
    inner = [d for d in range(1, len(shape)) if strides[d] < block_stride or shape[d] == 1]
    outer = [d for d in range(1, len(shape)) if d not in inner]
    # Inside a run the dims must be in logical order and dense: C innermost, then N, then H.
    expect = el
    for d in reversed(inner):
        if shape[d] != 1 and strides[d] != expect:
            raise LayoutError(
                f"layer {name}: shape {shape} strides {strides} (bytes) put a block's dims out of "
                "their logical order; the connector needs vLLM's LBHNC or LHBNC KV cache layout "
                "(it asks for LBHNC; unset VLLM_KV_CACHE_LAYOUT or choose a backend that supports it)"
            )
        expect *= shape[d]
    if any(d > min(inner, default=len(shape)) for d in outer):
        raise LayoutError(f"layer {name}: a dim outside the block run sits inside it ({shape}, {strides})")
    return LayerLayout(
        name=name,
        base=int(kv.data_ptr()),
        block_stride=block_stride,
        outer=tuple((shape[d], strides[d]) for d in outer),
        run_bytes=expect,
        ratio=ratio,
        device=str(kv.device.type),
    )


class BlockLayout:
    """Every layer of one worker: a vLLM block id to its byte runs, in kvd's canonical order."""

    def __init__(self, kv_caches: dict[str, Any], num_blocks: int, order: Sequence[str]) -> None:
        missing = [n for n in order if n not in kv_caches]
        if missing:
            raise LayoutError(f"layers {missing} of the KV cache config have no KV cache tensor")
        self.layers = [layer_layout(n, kv_caches[n], num_blocks) for n in order]
        devices = {layer.device for layer in self.layers}
        if len(devices) != 1:
            raise LayoutError(f"KV cache layers on several devices: {sorted(devices)}")
        self.device = devices.pop()
        self.block_bytes = sum(layer.block_bytes for layer in self.layers)
        self.num_blocks = num_blocks

    @property
    def on_gpu(self) -> bool:
        return self.device != "cpu"

    def segments(self, block_id: int) -> list[tuple[int, int]]:
        if not 0 <= block_id < self.num_blocks:
            raise LayoutError(f"block id {block_id} outside the {self.num_blocks} blocks")
        out: list[tuple[int, int]] = []
        for layer in self.layers:
            layer.segments(block_id, out)
        return out
