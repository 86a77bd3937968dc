"""vLLM 0.34 KV cache layouts, built by vLLM's own planning code, for the tests and the bench.

Each case is what vLLM's engine hands `ExtensibleKVCache`: specs per layer and group,
`get_kv_cache_config_from_groups` for the placements, and `pad_kv_cache_segments` where the
worker applies it (layer-outermost layouts). vLLM must be importable (`vllm_env.load()`).
The engine config is reduced to the three fields planning reads; everything else is vLLM's.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Shape:
    """A model's KV cache, per GPU: attention layers, plus Mamba layers for a hybrid."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16
    # Head size of every other layer (two page sizes in one group), or None.
    alt_head_size: int | None = None
    # Mamba layers, in a second group aliasing the attention group's regions.
    num_mamba_layers: int = 0


@dataclass(frozen=True)
class Case:
    name: str
    layout: str  # a KVCacheLayout name
    padded: bool  # pad_kv_cache_segments applied: every layer's region starts on a granule
    shape: Shape

    @property
    def aligned(self) -> bool:
        """Every segment starts on a granule (the RDMA contract holds for these)."""
        return self.padded or self.layout.startswith("B")


SMALL = Shape(num_layers=3, num_kv_heads=2, head_size=64, dtype=torch.float16)
# The cases of the conformance tests: small, so that 2 MiB granules fit a CI machine.
CASES = [
    Case("LBNHC, one segment per layer, padded", "LBNHC", True, SMALL),
    Case("LBNHC, unpadded: boundary granules shared", "LBNHC", False, SMALL),
    Case("BLNHC, block-outermost: one segment", "BLNHC", False, SMALL),
    Case(
        "LBNHC, two head sizes: mixed block strides",
        "LBNHC",
        True,
        Shape(num_layers=4, num_kv_heads=2, head_size=64, dtype=torch.float16, alt_head_size=128),
    ),
    Case(
        "LBNHC, hybrid attention + Mamba",
        "LBNHC",
        True,
        Shape(num_layers=2, num_kv_heads=2, head_size=64, dtype=torch.float16, num_mamba_layers=2),
    ),
    Case(
        "BLNHC, hybrid attention + Mamba",
        "BLNHC",
        False,
        Shape(num_layers=2, num_kv_heads=2, head_size=64, dtype=torch.float16, num_mamba_layers=2),
    ),
]


def _engine_config(layout: str, num_blocks: int) -> Any:
    """What `get_kv_cache_config_from_groups` reads of a `VllmConfig`, as vLLM's own types."""
    from vllm.config import AttentionConfig, CacheConfig

    cache_config = CacheConfig(num_gpu_blocks_override=num_blocks)
    cache_config.kv_cache_layout = layout  # resolved by the engine core in a real run
    return types.SimpleNamespace(cache_config=cache_config, attention_config=AttentionConfig())


def _groups(shape: Shape) -> list[Any]:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheGroupSpec,
        MambaSpec,
        UniformTypeKVCacheSpecs,
    )

    def attention(head_size: int) -> Any:
        return FullAttentionSpec(
            block_size=shape.block_size,
            num_kv_heads=shape.num_kv_heads,
            head_size=head_size,
            dtype=shape.dtype,
        )

    names = [f"model.layers.{i}.attn" for i in range(shape.num_layers)]
    if shape.alt_head_size is not None:
        specs = {
            name: attention(shape.head_size if i % 2 == 0 else shape.alt_head_size)
            for i, name in enumerate(names)
        }
        uniform = UniformTypeKVCacheSpecs.from_specs(specs)
        assert uniform is not None
        return [KVCacheGroupSpec(names, uniform)]
    spec = attention(shape.head_size)
    groups = [KVCacheGroupSpec(names, spec)]
    if shape.num_mamba_layers:
        # A Mamba2-like state (conv + SSM) padded to the attention page, as vLLM's hybrid
        # allocator unifies page sizes.
        mamba = MambaSpec(
            block_size=shape.block_size,
            shapes=((3, 4 * shape.head_size), (shape.num_kv_heads, 16, shape.head_size // 2)),
            dtypes=(shape.dtype, torch.float32),
            page_size_padded=spec.page_size_bytes,
        )
        assert mamba.state_content_size_bytes <= spec.page_size_bytes
        mamba_names = [f"model.layers.{i}.mamba" for i in range(shape.num_mamba_layers)]
        groups.append(KVCacheGroupSpec(mamba_names, mamba))
    return groups


def kv_cache_config(case: Case, num_blocks: int, granule: int) -> Any:
    """vLLM's `KVCacheConfig` for `num_blocks` blocks of `case`, padded as the worker pads it."""
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.extensible_kv_cache import pad_kv_cache_segments

    groups = _groups(case.shape)
    config = get_kv_cache_config_from_groups(
        _engine_config(case.layout, num_blocks), groups, available_memory=1 << 62
    )
    assert config.num_blocks == num_blocks
    if case.padded:
        config = pad_kv_cache_segments(config, KVCacheLayout[case.layout], granule)
    return config


def layout(case: Case) -> Any:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    return KVCacheLayout[case.layout]
