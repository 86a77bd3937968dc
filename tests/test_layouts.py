"""Layouts → segments (docs/design.md §4): block-dim probing, segment counts of every preset and
standard layout, the strides they give, and their agreement with `ExtensibleTensor` segments."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from extensible_kv import ExtensibleTensor
from extensible_kv.layouts import (
    ATTENTION_BACKEND_PRESETS,
    STANDARD_LAYOUTS,
    BlockLayout,
    FlashAttentionHNDLayout,
    FlashAttentionLayout,
    FlashMLASparseLayout,
    attention_backend_layout,
    find_block_dim,
    resolve_attention_backend,
    standard_layout,
    stride_order,
)
from support.kv_helpers import cache_kwargs, pattern

B, N, H, D = 6, 16, 4, 32

# docs/design.md's table: preset → (logical shape for B blocks, block dim, segments)
PRESET_TABLE = {
    "FLASH_ATTN": ((2, B, N, H, D), 1, 2),
    "FLASH_ATTN_HND": ((2, B, N, H, D), 1, 2),
    "FLEX_ATTENTION": ((2, B, N, H, D), 1, 2),
    "FLASHINFER": ((B, 2, N, H, D), 0, 1),
    "FLASHINFER_HND": ((B, 2, N, H, D), 0, 1),
    "TRITON_ATTN": ((B, 2, N, H, D), 0, 1),
    "TRITON_ATTN_HND": ((B, 2, N, H, D), 0, 1),
    "MLA": ((B, N, 576), 0, 1),
    "FLASHMLA_SPARSE": ((B, N, 576), 0, 1),
    "KV_SPLIT_BLOCK_MAJOR": ((2, B, N, H, D), 1, 1),
}
L = 3
STANDARD_TABLE = {"LBHNC": L, "LBNHC": L, "LHBNC": L * H, "BLHNC": 1, "BLNHC": 1, "BHLNC": 1}


def preset_layout(name: str, dtype: torch.dtype = torch.bfloat16) -> BlockLayout:
    mla = "MLA" in name
    head_size, heads = (576, 1) if mla else (D, H)
    return attention_backend_layout(ATTENTION_BACKEND_PRESETS[name], N, heads, head_size, dtype)


def test_tables_cover_every_preset_and_standard_layout() -> None:
    assert set(PRESET_TABLE) == set(ATTENTION_BACKEND_PRESETS)
    assert set(STANDARD_TABLE) == set(STANDARD_LAYOUTS)


@pytest.mark.parametrize("name", PRESET_TABLE)
def test_preset_block_dim_and_segments(name: str) -> None:
    shape, block_dim, segments = PRESET_TABLE[name]
    layout = preset_layout(name)
    assert layout.shape(B) == shape
    assert layout.block_dim == block_dim
    assert layout.num_segments == segments
    assert layout.block_bytes == math.prod(shape) // B * 2
    assert layout.segment_block_bytes * segments == layout.block_bytes


@pytest.mark.parametrize("name", STANDARD_TABLE)
def test_standard_layout_segments(name: str) -> None:
    layout = standard_layout(name, L, 1, N, H, D, torch.bfloat16)
    assert layout.num_segments == STANDARD_TABLE[name]
    assert layout.block_bytes == L * H * N * 2 * D * 2
    view = layout.layer_view(B)
    # Every layer is indexed [B, H, N, C] whatever the physical order.
    assert view.shape == (B, H, N, 2 * D)
    assert view.block_dim == 0
    assert view.segment_dims == ((1,) if name == "LHBNC" else ())


def test_fp8_ds_mla_is_656_bytes_per_token() -> None:
    layout = attention_backend_layout(FlashMLASparseLayout, N, 1, 576, torch.uint8, "fp8_ds_mla")
    assert layout.shape(B) == (B, N, 656)
    assert (layout.num_segments, layout.block_bytes) == (1, N * 656)


def test_hnd_presets_swap_tokens_and_heads_of_their_nhd_preset() -> None:
    """vLLM's HND backends: the NHD shape, stored with heads outside tokens: (0, 1, 3, 2, 4)."""
    for name in ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"):
        nhd, hnd = ATTENTION_BACKEND_PRESETS[name], ATTENTION_BACKEND_PRESETS[f"{name}_HND"]
        assert hnd.get_kv_cache_shape(B, N, H, D) == nhd.get_kv_cache_shape(B, N, H, D)
        assert hnd.get_kv_cache_stride_order() == (0, 1, 3, 2, 4)
        assert hnd.__name__.endswith("HNDLayout") and hnd.__doc__


def test_strides_follow_the_physical_order() -> None:
    nhd = attention_backend_layout(FlashAttentionLayout, N, H, D, torch.float16)
    hnd = attention_backend_layout(FlashAttentionHNDLayout, N, H, D, torch.float16)
    page = N * H * D  # one block of K, in elements
    assert nhd.strides(B) == (B * page, page, H * D, D, 1)
    assert hnd.strides(B) == (B * page, page, D, N * D, 1)


def test_block_major_puts_k_and_v_of_a_block_side_by_side() -> None:
    hidden = N * H * D
    nhd = attention_backend_layout(FlashAttentionLayout, N, H, D, torch.float16).block_major()
    hnd = attention_backend_layout(FlashAttentionHNDLayout, N, H, D, torch.float16).block_major()
    assert nhd.strides(B) == (hidden, 2 * hidden, H * D, D, 1)
    assert hnd.strides(B) == (hidden, 2 * hidden, D, N * D, 1)
    assert nhd.num_segments == hnd.num_segments == 1


# ---------------------------------------------------------------------------------------------
# probing


class _HeadsFirst:
    """A made-up backend with blocks in the middle: `(H, 2, B, N, D)`, no stride order."""

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        return (num_kv_heads, 2, num_blocks, block_size, head_size)


def _backend(shape_fn: Any, order: Any = None) -> Any:
    attrs = {"get_kv_cache_shape": staticmethod(shape_fn)}
    if order is not None:
        attrs["get_kv_cache_stride_order"] = staticmethod(order)
    return type("Backend", (), attrs)


def test_block_dim_is_probed_not_positional() -> None:
    # A token dim equal to the first sentinel does not fool the probe.
    assert find_block_dim(FlashAttentionLayout, 7919, H, D) == 1
    assert find_block_dim(_HeadsFirst, N, H, D) == 2
    layout = attention_backend_layout(_HeadsFirst, N, H, D, torch.float32)
    assert layout.order == (0, 1, 2, 3, 4)  # missing stride order: identity
    assert layout.num_segments == H * 2


class _KeywordOnly:
    """Some vLLM backends take `cache_dtype_str` keyword-only."""

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        *,
        cache_dtype_str: str | None = None,
    ) -> tuple[int, ...]:
        return (num_blocks, block_size, 656 if cache_dtype_str == "fp8_ds_mla" else head_size)


def test_cache_dtype_str_is_passed_by_keyword() -> None:
    layout = attention_backend_layout(_KeywordOnly, N, 1, 576, torch.uint8, "fp8_ds_mla")
    assert layout.shape(B) == (B, N, 656)


def test_stride_order_missing_or_not_implemented_is_identity() -> None:
    assert stride_order(_HeadsFirst, 5) == (0, 1, 2, 3, 4)
    assert stride_order(ATTENTION_BACKEND_PRESETS["FLEX_ATTENTION"], 5) == (0, 1, 2, 3, 4)
    assert stride_order(FlashAttentionHNDLayout, 5) == (0, 1, 3, 2, 4)


@pytest.mark.parametrize(
    ("shape_fn", "match"),
    [
        (
            lambda b, n, h, d, cache_dtype_str="auto": (2, n, h, d),
            r"exactly one dim .* got dims \[\]",
        ),
        (
            lambda b, n, h, d, cache_dtype_str="auto": (b, b, n),
            r"exactly one dim .* got dims \[0, 1\]",
        ),
        (
            lambda b, n, h, d, cache_dtype_str="auto": (b * n, h, d),
            r"dim 0 scales .* 126704 for 7919",
        ),
        (lambda b, n, h, d, cache_dtype_str="auto": (b,) * (b % 3), "rank changes"),
    ],
)
def test_probe_errors(shape_fn: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        find_block_dim(_backend(shape_fn), N, H, D)


def test_stride_order_must_be_a_permutation() -> None:
    backend = _backend(lambda b, n, h, d, cache_dtype_str="auto": (b, n, h), lambda: (0, 0, 1))
    with pytest.raises(ValueError, match=r"\(0, 0, 1\) is not a permutation of 3 dims"):
        attention_backend_layout(backend, N, H, D, torch.float16)


def test_unknown_names() -> None:
    with pytest.raises(ValueError, match=r"unknown layout name 'LBXNC'.*LBHNC"):
        standard_layout("LBXNC", L, 0, N, H, D, torch.float16)
    with pytest.raises(ValueError, match=r"unknown attention backend 'FLASH'.*FLASH_ATTN"):
        resolve_attention_backend("FLASH")
    with pytest.raises(ValueError, match="layer index 3 out of range for 3 layers"):
        standard_layout("LBHNC", L, 3, N, H, D, torch.float16)


# ---------------------------------------------------------------------------------------------
# agreement with ExtensibleTensor segments


def _reserve(layout: BlockLayout, device: str) -> ExtensibleTensor:
    num_bytes = B * layout.block_bytes
    return ExtensibleTensor(num_bytes, layout.num_segments, **cache_kwargs(device))


def _layout(name: str) -> BlockLayout:
    if name in STANDARD_TABLE:
        return standard_layout(name, L, L - 1, N, H, D, torch.bfloat16)
    return preset_layout(name)


@pytest.mark.parametrize("name", [*PRESET_TABLE, *STANDARD_TABLE])
def test_segment_boundaries_are_where_outer_dims_step(name: str, device: str) -> None:
    layout = _layout(name)
    itemsize = 2
    strides = layout.strides(B)
    position = layout.order.index(layout.block_dim)
    with _reserve(layout, device) as tensor:
        assert tensor.segment_capacity_bytes == B * layout.segment_block_bytes
        if position > 0:
            # The innermost dim stored before the block dim steps one segment.
            assert strides[layout.order[position - 1]] * itemsize == tensor.segment_capacity_bytes
        assert strides[layout.block_dim] * itemsize == layout.segment_block_bytes


def test_per_segment_views_stay_in_their_segment(device: str) -> None:
    layout = preset_layout("FLASH_ATTN")
    with _reserve(layout, device) as tensor:
        tensor.resize_per_segment_(2 * layout.segment_block_bytes)
        k, v = layout.layer_view(B).with_blocks(2).per_segment()
        assert (k.offset_bytes, v.offset_bytes) == tensor.segment_offsets
        for index, part in enumerate((k, v)):
            assert part.num_bytes == tensor.segment_bytes[index]
            data = tensor.view(part.dtype, part.shape, part.strides, part.offset_bytes)
            data.copy_(pattern(part.shape, part.dtype, index, device))
            expected = pattern(part.shape, part.dtype, index, device).view(torch.uint8).flatten()
            assert torch.equal(tensor.segment_view(index), expected)
            del data
