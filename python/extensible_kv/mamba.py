"""Mamba / linear-attention state blocks (docs/design.md §4).

A recurrent layer keeps a few state arrays per sequence (Mamba2: a conv window and an SSM
state). Each block of the layer's buffer (vLLM's page) holds every state back to back, each
start aligned to its dtype, the block optionally padded (`page_size_padded`, vLLM's name for
it) so it matches the attention block of a hybrid model and both can share one buffer. A
state's view is `(num_blocks, *shape)` with the block as block stride and its inner dims
contiguous. Blocks are outermost, so a layer's buffer is one segment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from extensible_kv import _args, _torch
from extensible_kv.layouts import StridedView, contiguous_strides, itemsize, round_up

if TYPE_CHECKING:
    import torch

__all__ = ["MambaStateSpec", "gated_delta_net_state_spec", "mamba2_state_spec"]


@dataclass(frozen=True)
class MambaStateSpec:
    """The states of one layer, `((shape, dtype), ...)`, and an optional padded block size.

    `block_bytes` is the larger of the packed states and `page_size_padded`; it must be a
    multiple of every state's item size, since it is each view's block stride in elements.
    """

    states: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    page_size_padded: int | None = None

    def __post_init__(self) -> None:
        # Integers as the core takes them: any `__index__` int; a float is a TypeError.
        states = tuple(
            (_args.sizes(shape, f"states[{index}] shape", minimum=None), dtype)
            for index, (shape, dtype) in enumerate(self.states)
        )
        object.__setattr__(self, "states", states)
        if self.page_size_padded is not None:
            padded = _args.integer(self.page_size_padded, "page_size_padded")
            object.__setattr__(self, "page_size_padded", padded)
        if not states:
            raise ValueError("a Mamba state spec needs at least one state")
        for index, (shape, _) in enumerate(states):
            if any(n <= 0 for n in shape):
                raise ValueError(f"Mamba state {index} has shape {shape}: dims must be positive")
        if self.page_size_padded is not None and self.page_size_padded <= 0:
            raise ValueError(f"page_size_padded {self.page_size_padded} must be positive")
        for index, (_, dtype) in enumerate(states):
            if self.block_bytes % itemsize(dtype):
                raise ValueError(
                    f"Mamba page of {self.block_bytes} bytes is not a multiple of state {index}'s "
                    f"{dtype} items ({itemsize(dtype)} bytes)"
                )

    @property
    def state_offsets(self) -> tuple[int, ...]:
        """Byte offset of each state in the block."""
        offsets, end = [], 0
        for shape, dtype in self.states:
            start = round_up(end, itemsize(dtype))
            offsets.append(start)
            end = start + math.prod(shape) * itemsize(dtype)
        return tuple(offsets)

    @property
    def packed_bytes(self) -> int:
        """Bytes the states take, alignment included, before padding."""
        shape, dtype = self.states[-1]
        return self.state_offsets[-1] + math.prod(shape) * itemsize(dtype)

    @property
    def block_bytes(self) -> int:
        """The bytes one block of state takes: the packed state, or the padded page size
        where that is larger."""
        return max(self.packed_bytes, self.page_size_padded or 0)

    def state_views(self, num_blocks: int) -> list[StridedView]:
        """Each state as `(num_blocks, *shape)`, in a buffer of `num_blocks` blocks."""
        views = []
        for (shape, dtype), offset in zip(self.states, self.state_offsets, strict=True):
            block_stride = self.block_bytes // itemsize(dtype)
            views.append(
                StridedView(
                    dtype,
                    (num_blocks, *shape),
                    (block_stride, *contiguous_strides(shape)),
                    offset,
                    block_dim=0,
                )
            )
        return views


def mamba2_state_spec(
    *,
    conv_kernel: int,
    conv_dim: int,
    num_heads: int,
    head_dim: int,
    d_state: int,
    conv_dtype: torch.dtype,
    ssm_dtype: torch.dtype,
    page_size_padded: int | None = None,
) -> MambaStateSpec:
    """Mamba2: conv window `(conv_kernel - 1, conv_dim)`, SSM state
    `(num_heads, head_dim, d_state)`."""
    return MambaStateSpec(
        (((conv_kernel - 1, conv_dim), conv_dtype), ((num_heads, head_dim, d_state), ssm_dtype)),
        page_size_padded,
    )


def gated_delta_net_state_spec(
    *,
    conv_kernel: int = 4,
    conv_dim: int = 6144,
    num_heads: int = 16,
    head_k_dim: int = 128,
    head_v_dim: int = 128,
    conv_dtype: torch.dtype | None = None,
    ssm_dtype: torch.dtype | None = None,
    page_size_padded: int | None = None,
) -> MambaStateSpec:
    """GatedDeltaNet (Qwen3-Next): conv `(3, 6144)` bf16 and SSM `(16, 128, 128)` fp32 by
    default."""
    _torch.require("gated_delta_net_state_spec")
    import torch

    return MambaStateSpec(
        (
            ((conv_kernel - 1, conv_dim), conv_dtype or torch.bfloat16),
            ((num_heads, head_k_dim, head_v_dim), ssm_dtype or torch.float32),
        ),
        page_size_padded,
    )
