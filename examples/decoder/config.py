"""The demo model's configuration: without torch, so that the command line (`cli`) takes its
defaults from it before torch is imported."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelConfig"]


@dataclass(frozen=True)
class ModelConfig:
    """The demo model's shape and seed (its weights; the demo's prompts use `seed + 1`).
    `hybrid` makes every odd layer Mamba-like (see `model`); `intermediate_size` 0 is twice
    the hidden size."""

    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 0
    block_size: int = 16
    hybrid: bool = False
    conv_kernel: int = 4
    ssm_heads: int = 4
    d_state: int = 8
    max_positions: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"hidden size {self.hidden_size} must split into {self.num_heads} heads, "
                f"and those into groups of {self.num_kv_heads} KV heads"
            )
        if self.head_size % 2:
            raise ValueError(f"head size {self.head_size} must be even (rotary halves)")
        if self.hidden_size % self.ssm_heads:
            raise ValueError(f"hidden size {self.hidden_size} must split into {self.ssm_heads}")
        if min(self.num_layers, self.block_size, self.vocab_size, self.conv_kernel) < 1:
            raise ValueError("layers, block size, vocabulary and conv kernel must be positive")

    @property
    def ffn_size(self) -> int:
        """The MLP's inner width: `intermediate_size`, or twice the hidden size for 0 (kept 0,
        so that it follows `hidden_size` through `dataclasses.replace`)."""
        return self.intermediate_size or 2 * self.hidden_size

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def ssm_head_dim(self) -> int:
        return self.hidden_size // self.ssm_heads

    def is_mamba(self, layer: int) -> bool:
        return self.hybrid and layer % 2 == 1
