"""Mamba state pages (docs/design.md §4): states packed back to back in one page per block, one
segment per layer buffer, each layer growing on its own buffer."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from extensible_kv.kv_cache import KVCacheTensorSpec, MambaLayerSpec
from extensible_kv.mamba import (
    MambaStateSpec,
    gated_delta_net_state_spec,
    mamba2_state_spec,
)
from support.kv_helpers import (
    MakeCache,
    blocks,
    byte_sum,
    committed_byte_sum,
    layer_views,
    pattern,
)

SMALL = mamba2_state_spec(
    conv_kernel=4,
    conv_dim=24,
    num_heads=2,
    head_dim=4,
    d_state=8,
    conv_dtype=torch.bfloat16,
    ssm_dtype=torch.float32,
)


def test_states_are_packed_back_to_back_aligned_to_their_dtype() -> None:
    spec = MambaStateSpec((((3,), torch.uint8), ((2, 2), torch.float32), ((6,), torch.bfloat16)))
    # 3 bytes, aligned up to 4 for fp32, 16 bytes, then bf16 right after: 32 bytes.
    assert spec.state_offsets == (0, 4, 20)
    assert spec.packed_bytes == spec.block_bytes == 32
    padded = MambaStateSpec(spec.states, page_size_padded=64)
    assert (padded.packed_bytes, padded.block_bytes) == (32, 64)
    # Padding below the packed size does not shrink the page.
    assert MambaStateSpec(spec.states, page_size_padded=20).block_bytes == 32


def test_state_views_have_the_page_as_block_stride() -> None:
    spec = MambaStateSpec(SMALL.states, page_size_padded=1024)
    conv, ssm = spec.state_views(5)
    assert (conv.shape, conv.strides, conv.offset_bytes) == ((5, 3, 24), (512, 24, 1), 0)
    assert (ssm.shape, ssm.strides, ssm.offset_bytes) == ((5, 2, 4, 8), (256, 32, 8, 1), 144)
    assert conv.block_stride_bytes == ssm.block_stride_bytes == 1024


def test_presets() -> None:
    assert [shape for shape, _ in SMALL.states] == [(3, 24), (2, 4, 8)]
    gdn = gated_delta_net_state_spec()
    assert gdn.states == (((3, 6144), torch.bfloat16), ((16, 128, 128), torch.float32))
    assert gdn.state_offsets == (0, 3 * 6144 * 2)
    assert gdn.block_bytes == 3 * 6144 * 2 + 16 * 128 * 128 * 4
    small = gated_delta_net_state_spec(conv_dim=8, num_heads=2, head_k_dim=4, head_v_dim=4)
    assert small.states[1][0] == (2, 4, 4)


@pytest.mark.parametrize(
    ("states", "padded", "match"),
    [
        (SMALL.states, 1002, r"page of 1002 bytes is not a multiple of state 1's .* \(4 bytes\)"),
        ((), None, "at least one state"),
        ((((3, 0), torch.float16),), None, r"state 0 has shape \(3, 0\)"),
        (SMALL.states, 0, "page_size_padded 0 must be positive"),
    ],
)
def test_spec_errors(states: Any, padded: int | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MambaStateSpec(states, page_size_padded=padded)


@pytest.mark.parametrize(
    ("states", "padded", "match"),
    [
        ((((3, 2.5), torch.float16),), None, r"states\[0\] shape\[1\] must be an int"),
        ((((3, True), torch.float16),), None, r"states\[0\] shape\[1\] must be an int"),
        (SMALL.states, 4096.0, "page_size_padded must be an int"),
    ],
)
def test_spec_sizes_are_ints_as_the_core_takes_them(
    states: Any, padded: object, match: str
) -> None:
    """Not truncated by `int()` (a 2.5 dim became 2); numpy and torch integers are sizes."""
    with pytest.raises(TypeError, match=match):
        MambaStateSpec(states, page_size_padded=padded)  # type: ignore[arg-type]
    spec = MambaStateSpec(
        (((np.int64(3), torch.tensor(4)), torch.float16),), page_size_padded=np.int64(64)
    )
    assert spec.states[0][0] == (3, 4) and spec.page_size_padded == 64
    assert type(spec.page_size_padded) is int


def _mamba_model(num_layers: int, spec: MambaStateSpec) -> list[KVCacheTensorSpec]:
    layer = MambaLayerSpec(spec)
    return [KVCacheTensorSpec(spec.block_bytes, {f"mamba.{i}": layer}) for i in range(num_layers)]


def test_each_layer_grows_on_its_own_one_segment_buffer(make_cache: MakeCache) -> None:
    spec = MambaStateSpec(SMALL.states, page_size_padded=4096)
    cache = make_cache(_mamba_model(3, spec), 8)
    assert cache.num_segments == (1, 1, 1)
    assert [b.num_segments for b in cache.buffers] == [1, 1, 1]
    assert len({b.base_ptr for b in cache.buffers}) == 3
    cache.commit(3)
    assert [b.segment_bytes for b in cache.buffers] == [(3 * 4096,)] * 3
    written = 0
    for layer, states in cache.views.items():
        assert isinstance(states, list)
        for seed, state in enumerate(states):
            data = pattern(state[2].shape, state.dtype, seed + len(layer), state.device)
            state[2].copy_(data)
            written += byte_sum(data)
            assert torch.equal(state[2], data)
    # Every byte written is in a committed prefix; states in a page do not overlap.
    assert committed_byte_sum(cache) == written


def test_states_survive_growth_and_new_blocks_are_zero(make_cache: MakeCache) -> None:
    cache = make_cache(_mamba_model(2, SMALL), 16)
    cache.commit(2)
    states = [view for _, _, view in layer_views(cache)]
    ptrs = [s.data_ptr() for s in states]
    for seed, state in enumerate(states):
        blocks(state, 0, 0, 2).copy_(
            pattern((2, *state.shape[1:]), state.dtype, seed, state.device)
        )
    cache.commit(9)
    assert [s.data_ptr() for s in states] == ptrs
    for seed, state in enumerate(states):
        expected = pattern((2, *state.shape[1:]), state.dtype, seed, state.device)
        assert torch.equal(blocks(state, 0, 0, 2), expected)
        assert not blocks(state, 0, 2, 7).any()
        blocks(state, 0, 8).fill_(3)  # the last committed block is writable
        assert bool((blocks(state, 0, 8) == 3).all())
