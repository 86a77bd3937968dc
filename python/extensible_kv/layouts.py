"""KV cache layouts → segments (docs/design.md §4).

An attention backend (vLLM's word for an attention implementation: FlashAttention, FlashInfer,
...) describes one layer's cache by its logical shape, `get_kv_cache_shape(num_blocks,
block_size, num_kv_heads, head_size, cache_dtype_str)`, and optionally its physical order,
`get_kv_cache_stride_order()` (vLLM's convention: `order[i]` is the logical dim stored i-th,
outermost first). Memory is contiguous in physical order, so the dims stored before the block
dim cut the buffer into segments that each grow by a slice of every block: committing `n`
blocks is committing `n * block_bytes / num_segments` bytes of every segment. Because a
segment's capacity is `capacity_blocks` such slices, segment boundaries are exactly where the
outer dims step.

`BlockLayout` is that description, independent of the block count; `StridedView` is one torch
view of it (shape, strides in elements, byte offset) for a given count. Both are pure
arithmetic: `kv_cache` turns strided views into tensors. The standard `[L, B, H, N, C]`
vocabulary (vLLM #51718, C = 2 * head_size elements: K and V packed) and presets for the usual
attention backends are built here too; real vLLM attention backend classes plug in exactly like
the presets. ("Backend" alone, elsewhere, is the device backend: host or CUDA.)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar, Protocol

from extensible_kv import _native

if TYPE_CHECKING:
    import torch

__all__ = [
    "ATTENTION_BACKEND_PRESETS",
    "KV_LAYOUTS",
    "STANDARD_LAYOUTS",
    "AttentionBackend",
    "BlockLayout",
    "FlashAttentionHNDLayout",
    "FlashAttentionLayout",
    "FlashInferHNDLayout",
    "FlashInferLayout",
    "FlashMLASparseLayout",
    "FlexAttentionLayout",
    "KVSplitBlockMajorLayout",
    "MLALayout",
    "StridedView",
    "TritonAttentionHNDLayout",
    "TritonAttentionLayout",
    "attention_backend_layout",
    "find_block_dim",
    "resolve_attention_backend",
    "standard_layout",
    "stride_order",
]

# Two block counts no real dim equals by accident; the dim that follows them is the block dim.
_PROBE_BLOCKS = (7919, 7927)
STANDARD_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
_STANDARD_DIMS = "LBHNC"


class AttentionBackend(Protocol):
    """Anything with vLLM's `get_kv_cache_shape`; `get_kv_cache_stride_order` is optional."""

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]: ...


def round_up(value: int, multiple: int) -> int:
    """`value` rounded up to a multiple of `multiple` (positive)."""
    return -(-value // multiple) * multiple


def itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides in elements; an empty dim counts as 1, as torch counts it."""
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class StridedView:
    """One strided view of a buffer: `shape` and `strides` in elements, `offset_bytes` from the
    buffer's start. `segment_dims` are the dims whose indices pick a segment (the view spans
    several segments when any is larger than 1)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset_bytes: int
    block_dim: int
    segment_dims: tuple[int, ...] = ()

    @property
    def num_bytes(self) -> int:
        """Bytes from the first addressable element through the last one (what the export
        checks against the capacity: `dlpack::extent_bytes`)."""
        return _native.extent_bytes(self.shape, self.strides, itemsize(self.dtype))

    @property
    def block_stride_bytes(self) -> int:
        return self.strides[self.block_dim] * itemsize(self.dtype)

    def with_blocks(self, num_blocks: int) -> StridedView:
        """The same view cut to the first `num_blocks` blocks (strides, offset unchanged)."""
        shape = list(self.shape)
        shape[self.block_dim] = num_blocks
        return replace(self, shape=tuple(shape))

    def per_segment(self) -> list[StridedView]:
        """One view per segment this view spans, the segment dims dropped: each addresses
        only its own segment, so a view of committed blocks stays inside committed bytes."""
        if not self.segment_dims:
            return [self]
        kept = [d for d in range(len(self.shape)) if d not in self.segment_dims]
        block_dim = kept.index(self.block_dim)
        views = []
        for index in itertools.product(*(range(self.shape[d]) for d in self.segment_dims)):
            skip = sum(i * self.strides[d] for i, d in zip(index, self.segment_dims, strict=True))
            views.append(
                StridedView(
                    self.dtype,
                    tuple(self.shape[d] for d in kept),
                    tuple(self.strides[d] for d in kept),
                    self.offset_bytes + skip * itemsize(self.dtype),
                    block_dim,
                )
            )
        return views


@dataclass(frozen=True)
class BlockLayout:
    """A buffer's layout for any block count.

    `block_shape` is the logical shape with the block dim of size 1; `order` the physical
    order (vLLM's stride order). A buffer holding several layers (the `[L, B, H, N, C]`
    vocabulary) names the dim that picks the layer in `layer_dim`; each layer's view drops it.
    """

    dtype: torch.dtype
    block_shape: tuple[int, ...]
    block_dim: int
    order: tuple[int, ...]
    layer_dim: int | None = None
    layer_index: int = 0

    def __post_init__(self) -> None:
        ndim = len(self.block_shape)
        if sorted(self.order) != list(range(ndim)):
            raise ValueError(f"stride order {self.order} is not a permutation of {ndim} dims")
        if not 0 <= self.block_dim < ndim or self.block_shape[self.block_dim] != 1:
            raise ValueError(f"block dim {self.block_dim} of {self.block_shape} must have size 1")
        if any(n <= 0 for n in self.block_shape):
            raise ValueError(f"shape {self.block_shape} must have positive dims")
        if self.layer_dim is not None:
            if not 0 <= self.layer_dim < ndim:
                raise ValueError(f"layer dim {self.layer_dim} out of range for {ndim} dims")
            num_layers = self.block_shape[self.layer_dim]
            if self.layer_dim == self.block_dim or not 0 <= self.layer_index < num_layers:
                raise ValueError(
                    f"layer index {self.layer_index} out of range for {num_layers} layers "
                    f"(layer dim {self.layer_dim}, block dim {self.block_dim})"
                )

    @property
    def num_segments(self) -> int:
        """The product of the dims stored before the block dim."""
        outer = self.order[: self.order.index(self.block_dim)]
        return math.prod(self.block_shape[d] for d in outer)

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes in the buffer, over all segments (vLLM's page size)."""
        return math.prod(self.block_shape) * itemsize(self.dtype)

    @property
    def segment_block_bytes(self) -> int:
        return self.block_bytes // self.num_segments

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        shape = list(self.block_shape)
        shape[self.block_dim] = num_blocks
        return tuple(shape)

    def strides(self, num_blocks: int) -> tuple[int, ...]:
        """Logical strides in elements: contiguous in physical order."""
        shape = self.shape(num_blocks)
        physical = contiguous_strides([shape[d] for d in self.order])
        strides = [0] * len(shape)
        for position, dim in enumerate(self.order):
            strides[dim] = physical[position]
        return tuple(strides)

    def block_major(self) -> BlockLayout:
        """The block dim stored outermost, the other dims in their physical order: one
        segment. For a K/V split `(2, B, ...)` this gives strides `(hidden, 2 * hidden, ...)`
        and a block's K and V pages adjacent, as hybrid models need."""
        rest = tuple(d for d in self.order if d != self.block_dim)
        return replace(self, order=(self.block_dim, *rest))

    def layer_view(self, num_blocks: int) -> StridedView:
        """This layer's view over `num_blocks` blocks of the buffer."""
        shape, strides = self.shape(num_blocks), self.strides(num_blocks)
        outer = set(self.order[: self.order.index(self.block_dim)])
        if self.layer_dim is None:
            return StridedView(self.dtype, shape, strides, 0, self.block_dim, tuple(sorted(outer)))
        drop = self.layer_dim
        kept = [d for d in range(len(shape)) if d != drop]
        return StridedView(
            self.dtype,
            tuple(shape[d] for d in kept),
            tuple(strides[d] for d in kept),
            self.layer_index * strides[drop] * itemsize(self.dtype),
            kept.index(self.block_dim),
            tuple(kept.index(d) for d in sorted(outer - {drop})),
        )


# ---------------------------------------------------------------------------------------------
# vLLM-style attention backends


def _shape(
    attention_backend: AttentionBackend,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    cache_dtype_str: str,
) -> tuple[int, ...]:
    # By keyword: some attention backends take cache_dtype_str keyword-only.
    shape = attention_backend.get_kv_cache_shape(
        num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str=cache_dtype_str
    )
    return tuple(int(n) for n in shape)


def find_block_dim(
    attention_backend: AttentionBackend,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    cache_dtype_str: str = "auto",
) -> int:
    """The dim of `get_kv_cache_shape` that follows the block count, found by probing with two
    sentinel counts: position alone would mistake a K/V dim of 2 or a layer dim for it."""
    shapes = [
        _shape(attention_backend, n, block_size, num_kv_heads, head_size, cache_dtype_str)
        for n in _PROBE_BLOCKS
    ]
    if len(shapes[0]) != len(shapes[1]):
        raise ValueError(f"shape rank changes with the block count: {shapes[0]} vs {shapes[1]}")
    changed = [d for d, (a, b) in enumerate(zip(*shapes, strict=True)) if a != b]
    if len(changed) != 1:
        raise ValueError(
            f"expected exactly one dim to follow the block count, got dims {changed} "
            f"({shapes[0]} for {_PROBE_BLOCKS[0]} blocks, {shapes[1]} for {_PROBE_BLOCKS[1]})"
        )
    dim = changed[0]
    if (shapes[0][dim], shapes[1][dim]) != _PROBE_BLOCKS:
        raise ValueError(
            f"dim {dim} scales with the block count but is not it: {shapes[0][dim]} for "
            f"{_PROBE_BLOCKS[0]} blocks, {shapes[1][dim]} for {_PROBE_BLOCKS[1]}"
        )
    return dim


def stride_order(attention_backend: object, ndim: int) -> tuple[int, ...]:
    """The attention backend's physical order; identity when it has none (missing, or raising
    NotImplementedError, as vLLM's base class does)."""
    method = getattr(attention_backend, "get_kv_cache_stride_order", None)
    if method is None:
        return tuple(range(ndim))
    try:
        order = tuple(int(d) for d in method())
    except NotImplementedError:
        return tuple(range(ndim))
    if sorted(order) != list(range(ndim)):
        raise ValueError(f"stride order {order} is not a permutation of {ndim} dims")
    return order


def attention_backend_layout(
    attention_backend: AttentionBackend,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    cache_dtype_str: str = "auto",
) -> BlockLayout:
    """One layer's `BlockLayout` as the attention backend lays it out."""
    block_dim = find_block_dim(
        attention_backend, block_size, num_kv_heads, head_size, cache_dtype_str
    )
    shape = list(_shape(attention_backend, 1, block_size, num_kv_heads, head_size, cache_dtype_str))
    shape[block_dim] = 1
    order = stride_order(attention_backend, len(shape))
    return BlockLayout(dtype, tuple(shape), block_dim, order)


def standard_layout(
    name: str,
    num_layers: int,
    layer_index: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
) -> BlockLayout:
    """Layer `layer_index` of a buffer of `num_layers` layers in the `[L, B, H, N, C]`
    vocabulary, `name` its physical order (e.g. `"LHBNC"`); C = 2 * head_size (K and V)."""
    if name not in STANDARD_LAYOUTS:
        raise ValueError(f"unknown layout name {name!r}; known: {', '.join(STANDARD_LAYOUTS)}")
    block_shape = (num_layers, 1, num_kv_heads, block_size, 2 * head_size)
    order = tuple(_STANDARD_DIMS.index(letter) for letter in name)
    return BlockLayout(dtype, block_shape, 1, order, layer_dim=0, layer_index=layer_index)


# ---------------------------------------------------------------------------------------------
# Presets: the shapes and orders of vLLM's attention backends, as classes with the same two
# methods.


class _Preset:
    """A preset's two methods from class attributes: `DIMS`, the logical shape's dims (`"2"`
    for K/V, `B` blocks, `N` tokens per block, `H` KV heads, `D` head size), `ORDER`, the
    stride order (None: the backend defines none, and the order is the logical one), and
    `D_BY_CACHE_DTYPE`, a record size that replaces `D` for some `cache_dtype_str`s."""

    DIMS: ClassVar[tuple[str, ...]] = ()
    ORDER: ClassVar[tuple[int, ...] | None] = None
    # `D` for these `cache_dtype_str`s: a packed record per token in place of the head.
    D_BY_CACHE_DTYPE: ClassVar[Mapping[str, int]] = MappingProxyType({})

    @classmethod
    def get_kv_cache_shape(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        head = cls.D_BY_CACHE_DTYPE.get(cache_dtype_str, head_size)
        sizes = {"2": 2, "B": num_blocks, "N": block_size, "H": num_kv_heads, "D": head}
        return tuple(sizes[dim] for dim in cls.DIMS)

    @classmethod
    def get_kv_cache_stride_order(cls) -> tuple[int, ...]:
        if cls.ORDER is None:
            raise NotImplementedError  # as vLLM's base class: the logical order
        return cls.ORDER


class FlashAttentionLayout(_Preset):
    """FlashAttention, NHD: K/V split `(2, B, N, H, D)` stored as is: 2 segments (K and V)."""

    DIMS = ("2", "B", "N", "H", "D")
    ORDER: ClassVar[tuple[int, ...] | None] = (0, 1, 2, 3, 4)


class KVSplitBlockMajorLayout(FlashAttentionLayout):
    """A K/V split `(2, B, N, H, D)` stored block-major: 1 segment."""

    ORDER = (1, 0, 2, 3, 4)


class FlexAttentionLayout(FlashAttentionLayout):
    """FlexAttention: `(2, B, N, H, D)` in logical order (vLLM defines no stride order)."""

    ORDER = None


class FlashInferLayout(_Preset):
    """FlashInfer, NHD: `(B, 2, N, H, D)`, block-major: 1 segment."""

    DIMS = ("B", "2", "N", "H", "D")
    ORDER: ClassVar[tuple[int, ...] | None] = (0, 1, 2, 3, 4)


class TritonAttentionLayout(FlashInferLayout):
    """Triton attention, NHD: `(B, 2, N, H, D)` in logical order."""

    ORDER = None


def _hnd(nhd: type[_Preset], doc: str) -> type[_Preset]:
    """The HND variant of the preset `nhd`, named after it: heads stored outside tokens within a
    block, its stride order `nhd`'s with `H` and `N` swapped."""
    order = list(nhd.ORDER or range(len(nhd.DIMS)))
    n, h = order.index(nhd.DIMS.index("N")), order.index(nhd.DIMS.index("H"))
    order[n], order[h] = order[h], order[n]
    name = nhd.__name__.removesuffix("Layout") + "HNDLayout"
    attrs = {"__doc__": doc, "__module__": __name__, "__qualname__": name, "ORDER": tuple(order)}
    return type(name, (nhd,), attrs)


FlashAttentionHNDLayout = _hnd(FlashAttentionLayout, "FlashAttention, HND: 2 segments.")
FlashInferHNDLayout = _hnd(FlashInferLayout, "FlashInfer, HND: stored as `(B, 2, H, N, D)`.")
TritonAttentionHNDLayout = _hnd(
    TritonAttentionLayout, "Triton attention, HND: stored as `(B, 2, H, N, D)`."
)


class MLALayout(_Preset):
    """MLA (FlashMLA, Triton-MLA, CUTLASS-MLA): one latent per token, `(B, N, head_size)`
    with head_size 576 (512 + 64 rope) and one KV head."""

    DIMS = ("B", "N", "D")


class FlashMLASparseLayout(MLALayout):
    """FlashMLA sparse: with `cache_dtype_str="fp8_ds_mla"` a 656-byte record per token (512
    fp8 NoPE + 16 fp32 scales + 128 bf16 RoPE), viewed as uint8."""

    D_BY_CACHE_DTYPE: ClassVar[Mapping[str, int]] = MappingProxyType({"fp8_ds_mla": 656})


ATTENTION_BACKEND_PRESETS: Mapping[str, AttentionBackend] = {
    "FLASH_ATTN": FlashAttentionLayout,
    "FLASH_ATTN_HND": FlashAttentionHNDLayout,
    "FLEX_ATTENTION": FlexAttentionLayout,
    "FLASHINFER": FlashInferLayout,
    "FLASHINFER_HND": FlashInferHNDLayout,
    "TRITON_ATTN": TritonAttentionLayout,
    "TRITON_ATTN_HND": TritonAttentionHNDLayout,
    "MLA": MLALayout,
    "FLASHMLA_SPARSE": FlashMLASparseLayout,
    "KV_SPLIT_BLOCK_MAJOR": KVSplitBlockMajorLayout,
}


# Layouts that store a K and a V for every token: the presets but MLA's, and the standard orders.
KV_LAYOUTS = (
    *(name for name in ATTENTION_BACKEND_PRESETS if "MLA" not in name),
    *STANDARD_LAYOUTS,
)


def resolve_attention_backend(attention_backend: AttentionBackend | str) -> AttentionBackend:
    """A preset by name (`ATTENTION_BACKEND_PRESETS`), or the attention backend itself."""
    if not isinstance(attention_backend, str):
        return attention_backend
    try:
        return ATTENTION_BACKEND_PRESETS[attention_backend]
    except KeyError:
        known = ", ".join(ATTENTION_BACKEND_PRESETS)
        raise ValueError(
            f"unknown attention backend {attention_backend!r}; known: {known}"
        ) from None
