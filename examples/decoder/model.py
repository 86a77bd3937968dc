"""A small decoder-only transformer with paged attention in plain torch: the demo's model.

Seeded random weights, RMSNorm, rotary positions, grouped-query attention and a SiLU-gated MLP.
The decode step takes one token per sequence and only fixed-shape tensors (`DecodeInputs`), so
it can be captured once in a CUDA graph and replayed: the new token's K and V go into its slot
(`slot_mapping`: block * block_size + offset) through the cache's backend-shaped views, then
each sequence's K and V are gathered through its block table and attended to under a mask of
its length. Unused block-table entries point at block 0, the null block: committed from the
start and masked out.

`hybrid=True` makes every odd layer a Mamba-like recurrent layer (a causal depthwise conv and
a gated linear state-space recurrence, Mamba2's recurrent form) whose conv window and state
live in a Mamba block of the KV cache: each sequence owns one block as its state slot. Each
buffer then holds one attention layer and one recurrent layer, whose blocks come from one
pool and never overlap (vLLM's hybrid allocator), and the attention block size is raised
until its block holds the recurrent state, as vLLM does.

Every computation reads the cache only through gathers (copies into fresh tensors), so the
same inputs give the same bits over any cache with the same contents: what the demo checks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from extensible_kv.kv_cache import (
    AttentionLayerSpec,
    KVCacheTensorSpec,
    LayerSpec,
    MambaLayerSpec,
    StandardLayerSpec,
)
from extensible_kv.layouts import KV_LAYOUTS, STANDARD_LAYOUTS, itemsize
from extensible_kv.mamba import MambaStateSpec, mamba2_state_spec

from decoder.config import ModelConfig

if TYPE_CHECKING:
    from extensible_kv.kv_cache import ExtensibleKVCache

__all__ = [
    "AttentionCache",
    "DecodeInputs",
    "DecoderModel",
    "MambaCache",
    "ModelConfig",
]

_NORM_EPS = 1e-6


@dataclass(frozen=True)
class DecodeInputs:
    """The decode step's inputs and output, one row per sequence; fixed shapes, so a captured
    graph reads them where they are. Zeros but `seq_lens` (1) address only block 0."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    block_tables: torch.Tensor  # (num_seqs, max_blocks_per_seq) block ids, 0 where unused
    slot_mapping: torch.Tensor  # block * block_size + offset of the token being decoded
    seq_lens: torch.Tensor  # tokens in the cache after this step's write
    state_slots: torch.Tensor  # the block holding each sequence's recurrent state
    next_tokens: torch.Tensor  # out: greedy choice

    @classmethod
    def warm_up(cls, num_seqs: int, max_blocks_per_seq: int, device: torch.device) -> DecodeInputs:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        return cls(
            token_ids=zeros(num_seqs),
            positions=zeros(num_seqs),
            block_tables=zeros(num_seqs, max_blocks_per_seq),
            slot_mapping=zeros(num_seqs),
            seq_lens=torch.ones(num_seqs, dtype=torch.int64, device=device),
            state_slots=zeros(num_seqs),
            next_tokens=zeros(num_seqs),
        )

    def load(
        self,
        token_ids: list[int],
        positions: list[int],
        block_tables: list[list[int]],
        state_slots: list[int],
        block_size: int,
    ) -> None:
        """Fills the inputs in place for one step (block tables padded with the null block)."""
        width = self.block_tables.shape[1]
        slots = [
            t[p // block_size] * block_size + p % block_size
            for t, p in zip(block_tables, positions, strict=True)
        ]
        rows = [t + [0] * (width - len(t)) for t in block_tables]
        for tensor, values in (
            (self.token_ids, token_ids),
            (self.positions, positions),
            (self.block_tables, rows),
            (self.slot_mapping, slots),
            (self.seq_lens, [p + 1 for p in positions]),
            (self.state_slots, state_slots),
        ):
            tensor.copy_(torch.tensor(values, dtype=torch.int64))


@dataclass(frozen=True)
class AttentionCache:
    """One attention layer's K and V as `(blocks, block_size, kv_heads, head_size)` views of
    the cache, strided as its layout stores them."""

    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True)
class MambaCache:
    """One recurrent layer's states: conv window `(blocks, kernel - 1, hidden)`, SSM state
    `(blocks, heads, head_dim, d_state)` in fp32."""

    conv: torch.Tensor
    ssm: torch.Tensor


LayerCache = AttentionCache | MambaCache


class DecoderModel:
    """The model on `device` in `dtype`, with its KV cache spec for a layout."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.config, self.device, self.dtype = config, device, dtype
        self.block_size = self._block_size()
        weights = _init_weights(config, torch.Generator().manual_seed(config.seed))
        self.params = {name: w.to(device, dtype) for name, w in weights.items()}
        self.cos, self.sin = _rotary_tables(config, device)
        self.token_index = torch.arange(config.max_positions, device=device)

    # -- the KV cache this model needs

    def attention_block_bytes(self, block_size: int | None = None) -> int:
        c = self.config
        return 2 * (block_size or self.block_size) * c.num_kv_heads * c.head_size * self._item

    def state_spec(self, block_bytes: int | None = None) -> MambaStateSpec:
        c = self.config
        return mamba2_state_spec(
            conv_kernel=c.conv_kernel,
            conv_dim=c.hidden_size,
            num_heads=c.ssm_heads,
            head_dim=c.ssm_head_dim,
            d_state=c.d_state,
            conv_dtype=self.dtype,
            ssm_dtype=torch.float32,
            page_size_padded=block_bytes,
        )

    def kv_cache_spec(self, layout: str) -> list[KVCacheTensorSpec]:
        """One buffer per attention layer (a standard layout: one for all of them); hybrid:
        one per attention layer, shared with the recurrent layer that follows it."""
        if layout not in KV_LAYOUTS:
            raise ValueError(f"layout {layout!r} holds no K and V; pick one of {KV_LAYOUTS}")
        c, block_bytes = self.config, self.attention_block_bytes()
        attention = [i for i in range(c.num_layers) if not c.is_mamba(i)]
        if layout in STANDARD_LAYOUTS:
            if c.hybrid:
                raise ValueError("the hybrid model takes a backend preset layout")
            layers: dict[str, LayerSpec] = {
                f"layers.{i}.attn": StandardLayerSpec(
                    layout,
                    len(attention),
                    j,
                    self.block_size,
                    c.num_kv_heads,
                    c.head_size,
                    self.dtype,
                )
                for j, i in enumerate(attention)
            }
            return [KVCacheTensorSpec(len(attention) * block_bytes, layers)]
        attn = AttentionLayerSpec(layout, self.block_size, c.num_kv_heads, c.head_size, self.dtype)
        state = MambaLayerSpec(self.state_spec(block_bytes))
        spec = []
        for i in attention:
            layers = {f"layers.{i}.attn": attn}
            if i + 1 < c.num_layers and c.is_mamba(i + 1):
                layers[f"layers.{i + 1}.mamba"] = state
            spec.append(KVCacheTensorSpec(block_bytes, layers))
        return spec

    def bind(self, cache: ExtensibleKVCache) -> list[LayerCache]:
        """Each layer's cache views, in layer order."""
        views, block_dims = cache.views, cache.block_dims
        out: list[LayerCache] = []
        for i in range(self.config.num_layers):
            if self.config.is_mamba(i):
                conv, ssm = views[f"layers.{i}.mamba"]
                out.append(MambaCache(conv, ssm))
                continue
            view = views[f"layers.{i}.attn"]
            if isinstance(view, list):
                raise ValueError(f"layer {i} has state views where K and V were expected")
            out.append(self._kv_pair(view, block_dims[f"layers.{i}.attn"]))
        return out

    def clear_null_block(self, kv: list[LayerCache]) -> None:
        """Zeroes block 0 of every layer, where the warm-up wrote: masked reads see zeros."""
        for layer in kv:
            views = (
                (layer.k, layer.v) if isinstance(layer, AttentionCache) else (layer.conv, layer.ssm)
            )
            for view in views:
                view[0].zero_()

    def clear_states(self, kv: list[LayerCache], slots: list[int]) -> None:
        """Zeroes the recurrent states in `slots`: a new sequence starts from nothing."""
        index = torch.tensor(slots, dtype=torch.int64, device=self.device)
        for layer in kv:
            if isinstance(layer, MambaCache):
                layer.conv.index_fill_(0, index, 0)
                layer.ssm.index_fill_(0, index, 0)

    # -- the decode step

    def decode_step(self, kv: list[LayerCache], inputs: DecodeInputs) -> None:
        """One token per sequence: writes its K/V (or state), writes the greedy next token."""
        p = self.params
        h = p["embed"][inputs.token_ids]
        cos, sin = self.cos[inputs.positions], self.sin[inputs.positions]
        for i, layer in enumerate(kv):
            x = _rms_norm(h, p[f"{i}.norm1"])
            if isinstance(layer, AttentionCache):
                h = h + self._attention(i, x, layer, inputs, cos, sin)
            else:
                h = h + self._recurrence(i, x, layer, inputs.state_slots)
            h = h + self._mlp(i, _rms_norm(h, p[f"{i}.norm2"]))
        logits = _rms_norm(h, p["final_norm"]) @ p["lm_head"].T
        inputs.next_tokens.copy_(logits.argmax(dim=-1))

    def _attention(
        self,
        i: int,
        x: torch.Tensor,
        cache: AttentionCache,
        inputs: DecodeInputs,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        c, p, num_seqs = self.config, self.params, x.shape[0]
        groups, d = c.num_heads // c.num_kv_heads, c.head_size
        q = _rotate((x @ p[f"{i}.wq"].T).view(num_seqs, c.num_heads, d), cos, sin)
        k = _rotate((x @ p[f"{i}.wk"].T).view(num_seqs, c.num_kv_heads, d), cos, sin)
        v = (x @ p[f"{i}.wv"].T).view(num_seqs, c.num_kv_heads, d)
        slot = (inputs.slot_mapping // self.block_size, inputs.slot_mapping % self.block_size)
        cache.k.index_put_(slot, k)
        cache.v.index_put_(slot, v)
        keys = cache.k[inputs.block_tables].reshape(num_seqs, -1, c.num_kv_heads, d).float()
        values = cache.v[inputs.block_tables].reshape(num_seqs, -1, c.num_kv_heads, d).float()
        q = q.view(num_seqs, c.num_kv_heads, groups, d).float()
        scores = torch.einsum("sgrd,stgd->sgrt", q, keys) / math.sqrt(d)
        valid = self.token_index[: keys.shape[1]] < inputs.seq_lens[:, None]
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        out = torch.einsum("sgrt,stgd->sgrd", scores.softmax(dim=-1), values)
        return out.reshape(num_seqs, c.hidden_size).to(x.dtype) @ p[f"{i}.wo"].T

    def _recurrence(
        self, i: int, x: torch.Tensor, cache: MambaCache, slots: torch.Tensor
    ) -> torch.Tensor:
        c, p, num_seqs = self.config, self.params, x.shape[0]
        u, z = (x @ p[f"{i}.w_in"].T).chunk(2, dim=-1)
        window = torch.cat([cache.conv[slots], u[:, None, :]], dim=1)  # the last `kernel` inputs
        cache.conv.index_put_((slots,), window[:, 1:])
        conv = (window.float() * p[f"{i}.conv_w"].float()).sum(dim=1) + p[f"{i}.conv_b"].float()
        u = F.silu(conv)
        b, cc = (u @ p[f"{i}.w_bc"].float().T).chunk(2, dim=-1)
        dt = F.softplus(u @ p[f"{i}.w_dt"].float().T + p[f"{i}.dt_bias"].float())
        decay = (-dt * p[f"{i}.a"].float()).exp()[:, :, None, None]
        u_heads = u.view(num_seqs, c.ssm_heads, c.ssm_head_dim)
        update = dt[:, :, None, None] * u_heads[..., None] * b[:, None, None, :]
        state = cache.ssm[slots] * decay + update
        cache.ssm.index_put_((slots,), state)
        y = (state @ cc[:, None, :, None]).squeeze(-1) + p[f"{i}.d_skip"].float()[:, None] * u_heads
        y = y.reshape(num_seqs, c.hidden_size) * F.silu(z.float())
        return y.to(x.dtype) @ p[f"{i}.w_out"].T

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        p = self.params
        return (F.silu(x @ p[f"{i}.w_gate"].T) * (x @ p[f"{i}.w_up"].T)) @ p[f"{i}.w_down"].T

    # -- helpers

    @property
    def _item(self) -> int:
        return itemsize(self.dtype)

    def _block_size(self) -> int:
        """The configured block size; hybrid: its smallest multiple whose attention block holds
        the recurrent state (vLLM raises the attention block size the same way)."""
        block_size = self.config.block_size
        if self.config.hybrid:
            state_bytes = self.state_spec().packed_bytes
            while self.attention_block_bytes(block_size) < state_bytes:
                block_size += self.config.block_size
        return block_size

    def _kv_pair(self, view: torch.Tensor, block_dim: int) -> AttentionCache:
        """K and V as `(blocks, block_size, kv_heads, head_size)` views of a layer's view:
        `(2, B, N, H, D)` split first, `(B, 2, N, H, D)` block first, or the standard
        vocabulary's `(B, H, N, 2 * D)`, K then V packed in the last dim."""
        c = self.config
        if view.dim() == 5:
            kv_dim = 0 if block_dim == 1 else 1
            k, v = view.select(kv_dim, 0), view.select(kv_dim, 1)
        else:
            d = c.head_size
            k, v = view[..., :d].transpose(1, 2), view[..., d:].transpose(1, 2)
        expected = (self.block_size, c.num_kv_heads, c.head_size)
        if tuple(k.shape[1:]) != expected:
            raise ValueError(f"layout gives K of shape {tuple(k.shape)}, expected (B, *{expected})")
        return AttentionCache(k, v)


# ---------------------------------------------------------------------------------------------
# weights and math


def _init_weights(config: ModelConfig, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Seeded, in fp32 on the host (the same numbers on every device), scaled by fan-in."""
    c, h = config, config.hidden_size

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator) / math.sqrt(shape[-1])

    w = {"embed": torch.randn((c.vocab_size, h), generator=generator)}
    for i in range(c.num_layers):
        w[f"{i}.norm1"], w[f"{i}.norm2"] = torch.ones(h), torch.ones(h)
        if c.is_mamba(i):
            w.update(_recurrence_weights(i, c, normal, generator))
        else:
            kv = c.num_kv_heads * c.head_size
            w[f"{i}.wq"], w[f"{i}.wk"], w[f"{i}.wv"] = normal(h, h), normal(kv, h), normal(kv, h)
            w[f"{i}.wo"] = normal(h, h)
        w[f"{i}.w_gate"], w[f"{i}.w_up"] = (
            normal(c.ffn_size, h),
            normal(c.ffn_size, h),
        )
        w[f"{i}.w_down"] = normal(h, c.ffn_size)
    w["final_norm"], w["lm_head"] = torch.ones(h), normal(c.vocab_size, h)
    return w


def _recurrence_weights(
    i: int, c: ModelConfig, normal: Callable[..., torch.Tensor], generator: torch.Generator
) -> dict[str, torch.Tensor]:
    h = c.hidden_size
    return {
        f"{i}.w_in": normal(2 * h, h),
        f"{i}.conv_w": torch.randn((c.conv_kernel, h), generator=generator) / c.conv_kernel,
        f"{i}.conv_b": torch.zeros(h),
        f"{i}.w_bc": normal(2 * c.d_state, h),
        f"{i}.w_dt": normal(c.ssm_heads, h),
        f"{i}.dt_bias": torch.full((c.ssm_heads,), -1.0),
        f"{i}.a": torch.rand((c.ssm_heads,), generator=generator) * 3 + 1,
        f"{i}.d_skip": torch.ones(c.ssm_heads),
        f"{i}.w_out": normal(h, h),
    }


def _rotary_tables(config: ModelConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    half = config.head_size // 2
    inv_freq = 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    angles = torch.arange(config.max_positions, dtype=torch.float64)[:, None] * inv_freq
    return angles.cos().float().to(device), angles.sin().float().to(device)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on `(seqs, heads, head_size)`, the halves rotated in fp32."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    scale = (xf.pow(2).mean(dim=-1, keepdim=True) + _NORM_EPS).rsqrt()
    return (xf * scale).to(x.dtype) * weight
