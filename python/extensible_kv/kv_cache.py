"""`ExtensibleKVCache`: a model's KV cache tensors, reserved for a capacity, grown in blocks.

The description mirrors what a serving stack knows (vLLM's `KVCacheTensor`s): a list of
buffers, each with the bytes of one block (`block_bytes`, vLLM's page size) and the layers
sharing it. Layers share a buffer when their blocks are handed out disjointly (one layer of
each KV cache group), so each views the whole buffer; the layers of an `[L, B, H, N, C]` buffer
each view their slice.

Every buffer is an `ExtensibleTensor` of `capacity_blocks` blocks in as many segments as its
layout has (docs/design.md §4); every layer gets one view in its attention backend's logical
shape with the physical strides, spanning the capacity, whose address never changes.
`commit(n)` grows every buffer to `n` blocks, zeroing the new ones. A model with any Mamba
layer is hybrid: its attention layouts are made block-major so that every buffer has one
segment and a block means the same bytes to every layer sharing it.

Invariants: the layers of a buffer agree on its segment count and per-segment block stride,
and their block takes the buffer's `block_bytes`; segment `s` holds bytes
`[s * capacity * stride, (s + 1) * capacity * stride)`, exactly where the layouts' outer dims
step. `legacy=True` builds the same views over a fully committed `torch.zeros` per buffer.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from extensible_kv import _args, _torch
from extensible_kv._native import ClosedError
from extensible_kv.footprint import CacheFootprint
from extensible_kv.ipc import Loan
from extensible_kv.layouts import (
    ATTENTION_BACKEND_PRESETS,
    STANDARD_LAYOUTS,
    AttentionBackend,
    BlockLayout,
    StridedView,
    attention_backend_layout,
    resolve_attention_backend,
    standard_layout,
)
from extensible_kv.mamba import MambaStateSpec
from extensible_kv.shape import BufferShape, CacheShape
from extensible_kv.tensor import ExtensibleTensor, borrow_dealt, close_on_exit, give_back_dealt

if TYPE_CHECKING:
    import torch


__all__ = [
    "AttentionLayerSpec",
    "ExtensibleKVCache",
    "KVCacheTensorSpec",
    "LayerSpec",
    "MambaLayerSpec",
    "StandardLayerSpec",
    "segment_layout",
]


@dataclass(frozen=True)
class AttentionLayerSpec:
    """An attention layer laid out by an attention backend: a class with vLLM's
    `get_kv_cache_shape` (and optionally `get_kv_cache_stride_order`), or a preset name from
    `ATTENTION_BACKEND_PRESETS`."""

    attention_backend: AttentionBackend | str
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    cache_dtype_str: str = "auto"

    def __post_init__(self) -> None:
        # Checked here, not at reserve: a typo in a model's config should fail where it is made.
        backend = self.attention_backend
        if isinstance(backend, str):
            resolve_attention_backend(backend)  # ValueError naming the known presets
        elif not callable(getattr(backend, "get_kv_cache_shape", None)):
            name = getattr(backend, "__name__", type(backend).__name__)
            raise ValueError(
                f"attention backend {name} has no get_kv_cache_shape: pass a preset name "
                f"({', '.join(ATTENTION_BACKEND_PRESETS)}) or a class with vLLM's method"
            )
        _check_positive(self, "block_size", "num_kv_heads", "head_size")


@dataclass(frozen=True)
class StandardLayerSpec:
    """Layer `layer_index` of a buffer holding `num_layers_in_buffer` layers in the standard
    `[L, B, H, N, C]` vocabulary; `layout` is the physical order, e.g. `"LHBNC"`."""

    layout: str
    num_layers_in_buffer: int
    layer_index: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.layout not in STANDARD_LAYOUTS:
            raise ValueError(
                f"unknown layout name {self.layout!r}; known: {', '.join(STANDARD_LAYOUTS)}"
            )
        _check_positive(self, "num_layers_in_buffer", "block_size", "num_kv_heads", "head_size")
        if not 0 <= self.layer_index < self.num_layers_in_buffer:
            raise ValueError(
                f"layer_index {self.layer_index} must be in [0, {self.num_layers_in_buffer})"
            )


def _check_positive(spec: object, *fields: str) -> None:
    """Each field a positive int (numpy and torch integers taken as ints): TypeError for other
    types, ValueError for 0 and below, each naming the field."""
    for field in fields:
        value = getattr(spec, field)
        try:
            number = _args.size(value, field, minimum=1)
        except ValueError:
            raise ValueError(f"{field} {value!r} must be a positive int") from None
        object.__setattr__(spec, field, number)  # frozen: set once, here


@dataclass(frozen=True)
class MambaLayerSpec:
    """A Mamba / linear-attention layer: its states packed in each block."""

    state: MambaStateSpec


LayerSpec = AttentionLayerSpec | StandardLayerSpec | MambaLayerSpec


@dataclass(frozen=True)
class KVCacheTensorSpec:
    """One KV cache buffer: the bytes of one block and the layers that view it, by name."""

    block_bytes: int
    layers: Mapping[str, LayerSpec]


# ---------------------------------------------------------------------------------------------
# planning: specs → strided views, checked per buffer


@dataclass(frozen=True)
class _LayerPlan:
    name: str
    views: tuple[StridedView, ...]  # one for attention, one per state for Mamba
    is_mamba: bool
    num_segments: int
    block_bytes: int  # one block over every segment of the buffer

    @property
    def block_stride_bytes(self) -> int:
        return self.views[0].block_stride_bytes


def _attention_layout(spec: AttentionLayerSpec | StandardLayerSpec, hybrid: bool) -> BlockLayout:
    if isinstance(spec, StandardLayerSpec):
        layout = standard_layout(
            spec.layout,
            spec.num_layers_in_buffer,
            spec.layer_index,
            spec.block_size,
            spec.num_kv_heads,
            spec.head_size,
            spec.dtype,
        )
        if hybrid and layout.num_segments > 1:
            raise ValueError(
                f"layout {spec.layout} has {layout.num_segments} segments, but a hybrid model "
                "needs one per buffer: use a block-major order (BLHNC, BLNHC, BHLNC)"
            )
        return layout
    layout = attention_backend_layout(
        resolve_attention_backend(spec.attention_backend),
        spec.block_size,
        spec.num_kv_heads,
        spec.head_size,
        spec.dtype,
        spec.cache_dtype_str,
    )
    # A block must mean the same bytes to an attention layer and a Mamba layer sharing it.
    return layout.block_major() if hybrid and layout.num_segments > 1 else layout


def _plan_layer(name: str, spec: LayerSpec, capacity_blocks: int, hybrid: bool) -> _LayerPlan:
    try:
        if isinstance(spec, MambaLayerSpec):
            views = tuple(spec.state.state_views(capacity_blocks))
            return _LayerPlan(name, views, True, 1, spec.state.block_bytes)
        layout = _attention_layout(spec, hybrid)
        view = layout.layer_view(capacity_blocks)
        return _LayerPlan(name, (view,), False, layout.num_segments, layout.block_bytes)
    except ValueError as error:
        raise ValueError(f"layer {name!r}: {error}") from error


def _check_buffer(index: int, block_bytes: int, plans: Sequence[_LayerPlan]) -> None:
    first = plans[0]
    for plan in plans[1:]:
        if plan.num_segments != first.num_segments:
            raise ValueError(
                f"KV cache tensor {index}: layers {first.name!r} ({first.num_segments} "
                f"segments) and {plan.name!r} ({plan.num_segments} segments) cannot share it"
            )
        if plan.block_stride_bytes != first.block_stride_bytes:
            raise ValueError(
                f"KV cache tensor {index}: layers {first.name!r} (block stride "
                f"{first.block_stride_bytes} bytes) and {plan.name!r} (block stride "
                f"{plan.block_stride_bytes} bytes) cannot share it"
            )
    for plan in plans:
        if plan.block_bytes != block_bytes:
            raise ValueError(
                f"layer {plan.name!r}: a block takes {plan.block_bytes} bytes, but KV cache "
                f"tensor {index} has {block_bytes} bytes per block"
            )


def _plan(specs: Sequence[KVCacheTensorSpec], capacity_blocks: int) -> list[list[_LayerPlan]]:
    capacity_blocks = _args.integer(capacity_blocks, "capacity_blocks")
    if capacity_blocks <= 0:
        raise ValueError(f"capacity_blocks {capacity_blocks} must be positive")
    if isinstance(specs, str | bytes | Mapping) or not isinstance(specs, Sequence):
        raise TypeError(f"spec must be a sequence of KVCacheTensorSpec, not {type(specs).__name__}")
    for index, tensor in enumerate(specs):
        if not isinstance(tensor, KVCacheTensorSpec):
            name = type(tensor).__name__
            raise TypeError(f"spec[{index}] must be a KVCacheTensorSpec, not {name}")
        _args.integer(tensor.block_bytes, f"spec[{index}].block_bytes")
    hybrid = any(isinstance(s, MambaLayerSpec) for t in specs for s in t.layers.values())
    plans, seen = [], set[str]()
    for index, tensor in enumerate(specs):
        if not tensor.layers or tensor.block_bytes <= 0:
            raise ValueError(
                f"KV cache tensor {index} needs layers and a positive block_bytes, got "
                f"{len(tensor.layers)} layers and {tensor.block_bytes} bytes"
            )
        if seen & tensor.layers.keys():
            raise ValueError(f"layers {sorted(seen & tensor.layers.keys())} appear twice")
        seen |= tensor.layers.keys()
        layer_plans = [
            _plan_layer(name, spec, capacity_blocks, hybrid) for name, spec in tensor.layers.items()
        ]
        _check_buffer(index, tensor.block_bytes, layer_plans)
        plans.append(layer_plans)
    return plans


def segment_layout(spec: Sequence[KVCacheTensorSpec]) -> tuple[tuple[int, int], ...]:
    """Per buffer, `(num_segments, bytes one block adds to each segment)` as a cache of this
    spec lays it out: what sizing needs to round a block count to granules before reserving."""
    return tuple((plans[0].num_segments, plans[0].block_stride_bytes) for plans in _plan(spec, 1))


# ---------------------------------------------------------------------------------------------
# buffers: where the views live


class _Buffer(Protocol):
    @property
    def physical_bytes(self) -> int: ...

    def view(self, strided: StridedView) -> torch.Tensor: ...
    def grow(self, bytes_per_segment: int) -> None: ...
    def shrink(self, bytes_per_segment: int, exact: bool) -> None: ...
    def wait_released(self, timeout: float | None) -> bool: ...
    def consolidate(self) -> None: ...
    def close(self) -> None: ...


class _ExtensibleBuffer:
    def __init__(self, tensor: ExtensibleTensor) -> None:
        self.tensor = tensor

    @property
    def physical_bytes(self) -> int:
        return self.tensor.physical_bytes

    def view(self, strided: StridedView) -> torch.Tensor:
        g = strided
        return self.tensor.view(g.dtype, g.shape, g.strides, g.offset_bytes)

    def grow(self, bytes_per_segment: int) -> None:
        self.tensor.resize_per_segment_(bytes_per_segment)

    def shrink(self, bytes_per_segment: int, exact: bool) -> None:
        self.tensor.shrink_per_segment_(bytes_per_segment, exact=exact)

    def wait_released(self, timeout: float | None) -> bool:
        return self.tensor.wait_released(timeout)

    def consolidate(self) -> None:
        self.tensor.consolidate()

    def close(self) -> None:
        self.tensor.close()


class _LegacyBuffer:
    """Everything committed up front, as engines allocate today: the reference to compare
    against, byte for byte."""

    def __init__(self, num_bytes: int, device: str | torch.device) -> None:
        import torch

        self.data: torch.Tensor | None = torch.zeros(num_bytes, dtype=torch.uint8, device=device)
        self.physical_bytes = num_bytes

    def view(self, strided: StridedView) -> torch.Tensor:
        g = strided
        if self.data is None:
            raise ClosedError("the KV cache is closed")
        flat = self.data[g.offset_bytes : g.offset_bytes + g.num_bytes].view(g.dtype)
        return flat.as_strided(g.shape, g.strides)

    def grow(self, bytes_per_segment: int) -> None:
        pass

    def shrink(self, bytes_per_segment: int, exact: bool) -> None:
        pass  # allocated in full: nothing to give back

    def wait_released(self, timeout: float | None) -> bool:
        return True  # nothing is ever given back

    def consolidate(self) -> None:
        pass  # one allocation already

    def close(self) -> None:
        self.data = None
        self.physical_bytes = 0


# ---------------------------------------------------------------------------------------------


class ExtensibleKVCache:
    """A model's KV cache buffers, reserved for `capacity_blocks` blocks each.

    `spec` lists the buffers (`KVCacheTensorSpec`); `device` is `"cpu"` (host backend) or
    `"cuda:N"`; `granularity` passes through to `ExtensibleTensor` (small on cpu in tests).
    `views` maps each layer to its capacity view (a list of state views for a Mamba layer);
    touch only blocks below `committed_blocks`. `export_handle_types` passes through too:
    `"posix_fd"` lets the cache be shared and lend its blocks (`lend`). Use as a context
    manager to `close()` on exit.
    """

    def __init__(
        self,
        spec: Sequence[KVCacheTensorSpec],
        capacity_blocks: int,
        device: str | torch.device = "cpu",
        *,
        legacy: bool = False,
        granularity: int | None = None,
        export_handle_types: int | str = 0,
    ) -> None:
        _torch.require("ExtensibleKVCache")
        capacity_blocks = _args.integer(capacity_blocks, "capacity_blocks")
        granularity = _args.optional_size(granularity, "granularity", minimum=1)
        legacy = _args.flag(legacy, "legacy")
        self._export_handle_types = export_handle_types
        self._plans = _plan(spec, capacity_blocks)
        self._capacity_blocks = capacity_blocks
        self._committed_blocks = 0
        self._legacy = legacy
        self._closed = False
        # (tensor_id, loan_id) of loans a `reclaim` took back before a later buffer's failed:
        # the next call with those loans takes back the rest only.
        self._reclaimed: set[tuple[int, int]] = set()
        # (tensor_id, loan_id) of loans borrowed here and not given back: one whose every
        # handle went back at once (this layout could use none of it) gives back nothing.
        self._borrowed: set[tuple[int, int]] = set()
        self._buffers: list[_Buffer] = []
        self._views: dict[str, list[torch.Tensor]] = {}
        try:
            for tensor_spec, plans in zip(spec, self._plans, strict=True):
                num_bytes = capacity_blocks * tensor_spec.block_bytes
                buffer = self._make_buffer(num_bytes, plans, device, granularity)
                self._buffers.append(buffer)
                for plan in plans:
                    self._views[plan.name] = [buffer.view(v) for v in plan.views]
        except BaseException:
            self.close()
            raise

    def _make_buffer(
        self,
        num_bytes: int,
        plans: Sequence[_LayerPlan],
        device: str | torch.device,
        granularity: int | None,
    ) -> _Buffer:
        if self._legacy:
            return _LegacyBuffer(num_bytes, device)
        tensor = ExtensibleTensor(
            num_bytes,
            plans[0].num_segments,
            device,
            granularity=granularity,
            export_handle_types=self._export_handle_types,
        )
        return _ExtensibleBuffer(tensor)

    @property
    def capacity_blocks(self) -> int:
        """The most blocks the reservation can ever hold."""
        return self._capacity_blocks

    @property
    def committed_blocks(self) -> int:
        """The blocks backed by physical memory now (block ids below it are usable)."""
        return self._committed_blocks

    @property
    def legacy(self) -> bool:
        """Whether this is the legacy cache: plain torch memory committed in full at creation."""
        return self._legacy

    @property
    def closed(self) -> bool:
        """Whether `close()` has run."""
        return self._closed

    @property
    def views(self) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        """Layer name → its capacity view (Mamba: one view per state); addresses never move."""
        plans = {plan.name: plan for plans in self._plans for plan in plans}
        return {
            name: list(views) if plans[name].is_mamba else views[0]
            for name, views in self._views.items()
        }

    @property
    def block_dims(self) -> dict[str, int]:
        """Layer name → the dim of its view(s) that indexes blocks."""
        return {p.name: p.views[0].block_dim for plans in self._plans for p in plans}

    @property
    def num_segments(self) -> tuple[int, ...]:
        """The segment count of each buffer."""
        return tuple(plans[0].num_segments for plans in self._plans)

    @property
    def segment_block_bytes(self) -> tuple[int, ...]:
        """The bytes one block adds to each segment of each buffer (`commit(n)` grows every
        segment of buffer `i` to `n * segment_block_bytes[i]` bytes)."""
        return tuple(plans[0].block_stride_bytes for plans in self._plans)

    @property
    def buffers(self) -> tuple[ExtensibleTensor, ...]:
        """The reservation of each buffer (empty in legacy mode, which has none)."""
        return tuple(b.tensor for b in self._buffers if isinstance(b, _ExtensibleBuffer))

    @property
    def buffer_physical_bytes(self) -> tuple[int, ...]:
        """Physical bytes committed to each buffer (whole granules)."""
        return tuple(b.physical_bytes for b in self._buffers)

    @property
    def physical_bytes(self) -> int:
        """The physical bytes every buffer maps now, summed."""
        return sum(self.buffer_physical_bytes)

    @property
    def num_handles(self) -> int:
        """The physical handles mapped now, summed over the buffers (legacy: one allocation
        per buffer)."""
        if self._legacy:
            return len(self._buffers)
        return sum(tensor.num_handles for tensor in self.buffers)

    def footprint(self) -> CacheFootprint:
        """The cache as sizing reads it: each buffer's geometry, the capacity and the committed
        blocks (`footprint.CacheFootprint`), what `KVCacheFlow` sizes an extension by."""
        return CacheFootprint.of(self)

    def commit(self, num_blocks: int) -> None:
        """Grows every buffer to `num_blocks` blocks, zeroing the new ones; a no-op at or
        below `committed_blocks`. If one buffer fails (out of memory), the ones before it keep
        their growth (growth is never undone), `committed_blocks` stays put, and a retry
        resumes."""
        num_blocks = _args.integer(num_blocks, "num_blocks")
        if self._closed:
            raise ClosedError("the KV cache is closed")
        if not 0 <= num_blocks <= self._capacity_blocks:
            raise ValueError(
                f"cannot commit {num_blocks} blocks: capacity is {self._capacity_blocks} blocks"
            )
        if num_blocks <= self._committed_blocks:
            return
        for buffer, plans in zip(self._buffers, self._plans, strict=True):
            buffer.grow(num_blocks * plans[0].block_stride_bytes)
        self._committed_blocks = num_blocks

    def shrink_to(self, num_blocks: int, *, exact: bool = False) -> None:
        """Shrinks every buffer to `num_blocks` blocks, keeping the contents of blocks below it
        (their addresses, views and CUDA graphs stay valid); a no-op at or above
        `committed_blocks`. Whole handles past the new last block are released; `exact` also
        trims the handles that straddle it (copying their live part), so the physical bytes are
        the granule-rounded footprint. Growing again with `commit` zeroes the blocks it adds.
        An `exact` shrink copies live bytes: writes racing it on another thread or stream may
        be lost.

        Each buffer shrinks all or nothing. If one fails, the error is raised with
        `committed_blocks` at `num_blocks` all the same (every buffer still holds at least
        that many blocks); the buffers that did not shrink keep their blocks past it, and a
        later `commit` does not zero those."""
        num_blocks = _args.integer(num_blocks, "num_blocks")
        exact = _args.flag(exact, "exact")
        if self._closed:
            raise ClosedError("the KV cache is closed")
        if num_blocks < 0:
            raise ValueError(f"cannot shrink to {num_blocks} blocks")
        if num_blocks >= self._committed_blocks:
            return
        try:
            for buffer, plans in zip(self._buffers, self._plans, strict=True):
                buffer.shrink(num_blocks * plans[0].block_stride_bytes, exact)
        finally:
            self._committed_blocks = num_blocks

    def wait_released(self, timeout: float | None = None) -> bool:
        """Waits until the memory shrinks gave back has been released on every buffer (each
        releases on its own thread once its stream has passed the shrink), or for `timeout`
        seconds in all: whether it has."""
        timeout = _args.seconds(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        for buffer in self._buffers:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not buffer.wait_released(left):
                return False
        return True

    def consolidate(self) -> None:
        """Backs each buffer's committed blocks by as few physical allocations as its layout
        allows (one per segment when segments share no granule), keeping every byte and
        address; registrations of the old pages (RDMA) must be renewed. Buffer by buffer,
        each as `ExtensibleTensor.consolidate`: a failure leaves the buffers (and steps) done
        before it consolidated, every byte kept; writes racing it on another thread or stream
        may be lost."""
        if self._closed:
            raise ClosedError("the KV cache is closed")
        for buffer in self._buffers:
            buffer.consolidate()

    # -----------------------------------------------------------------------------------------
    # lending memory to another cache (ExtensibleTensor.lend, per buffer), and borrowing
    # another's, of any model (docs/design.md §3.10)

    def lend(self, num_blocks: int, *, stream: int | None = None) -> tuple[Loan, ...]:
        """Keeps the first `num_blocks` blocks and lends the memory past them to another cache
        (in this process or another): one `Loan` per buffer, in buffer order, for `borrow`.
        `committed_blocks` becomes `num_blocks`; the addresses stay reserved, and `reclaim`
        takes the blocks back. Each buffer lends its whole handles past its last kept block
        (`ExtensibleTensor.lend`): one that straddles that block stays here. Needs
        `export_handle_types="posix_fd"`. All or nothing across buffers: if one cannot lend
        (nothing but a straddling handle past the kept blocks, say), the loans of the buffers
        before it are taken back and the error says which buffer."""
        num_blocks = self._check_lendable(num_blocks)
        loans: list[Loan] = []
        try:
            for index, (tensor, block_bytes) in enumerate(self._lending_buffers()):
                try:
                    loans.append(tensor.lend(num_blocks * block_bytes, stream=stream))
                except ValueError as error:
                    raise ValueError(f"buffer {index} cannot lend: {error}") from error
        except BaseException:
            for tensor, loan in zip(self.buffers, loans, strict=False):
                tensor.reclaim(loan, zero=False, timeout=0, stream=stream)
            raise
        self._committed_blocks = num_blocks
        return tuple(loans)

    def lend_sizes(self, num_blocks: int) -> list[int]:
        """The sizes, in granules, of the handles `lend(num_blocks)` would lend now, every
        buffer's in buffer order: what a donor weighs a cut by for a borrower of another model
        (`extensible_kv.shape.blocks_from(borrower_shape, sizes)`), to lend only memory the
        borrower can use. Changes nothing; raises what `lend(num_blocks)` would."""
        num_blocks = self._check_lendable(num_blocks)
        sizes: list[int] = []
        for index, (tensor, block_bytes) in enumerate(self._lending_buffers()):
            try:
                runs = tensor._lend_runs(num_blocks * block_bytes)
            except ValueError as error:
                raise ValueError(f"buffer {index} cannot lend: {error}") from error
            sizes.extend(granules for _, granules in runs)
        return sizes

    def shape(self) -> CacheShape:
        """This cache as a borrower (`extensible_kv.shape.CacheShape`): its device, granularity
        and, per buffer, its segments and the bytes a block adds to each."""
        buffers = self._lending_buffers()
        tensor = buffers[0][0]
        return CacheShape(
            tensor.device,
            tensor.granularity,
            tuple(BufferShape(t.num_segments, block_bytes) for t, block_bytes in buffers),
        )

    def borrow(self, loans: Sequence[Loan], *, zero: bool = True, stream: int | None = None) -> int:
        """Maps `loans` after this cache's committed blocks, which grow by the blocks that
        memory holds in this cache's own layout; returns that count. The loans may come from a
        cache of any model on the same device and granularity (any block bytes, segments or
        buffers): their whole handles are dealt over every segment of every buffer
        (`extensible_kv.shape.deal`), which all grow by the same number of blocks, each
        counting what it already maps past its committed end. Handles this layout cannot use
        go back to their lender at once, unmapped. A `ValueError` before anything is mapped
        for loans of another device or granularity, or that hold no block of this cache (or
        no room for one). `zero` as `ExtensibleTensor.borrow`. A failure after something was
        mapped gives every handle of the loans back (their lender reclaims them)."""
        if self._closed:
            raise ClosedError("the KV cache is closed")
        loans = tuple(loans)
        buffers = self._lending_buffers()
        tensors = [tensor for tensor, _ in buffers]
        blocks = borrow_dealt(
            tensors,
            [block_bytes for _, block_bytes in buffers],
            loans,
            zero=zero,
            stream=stream,
            max_blocks=self._capacity_blocks - self._committed_blocks,
        )
        self._borrowed.update(_key(loan) for loan in loans)
        self._committed_blocks += blocks
        return blocks

    def give_back(self, loans: Sequence[Loan], *, stream: int | None = None) -> None:
        """Returns borrowed `loans` to their lender, from every buffer that maps any of their
        handles: each segment shrinks to where the loans' memory begins in it (what this cache
        grew past it goes too), then every buffer to the blocks all of them still hold
        (`committed_blocks`), a handle that straddles that end staying mapped past it."""
        if self._closed:
            raise ClosedError("the KV cache is closed")
        loans = tuple(loans)
        buffers = self._lending_buffers()
        given, held = give_back_dealt(
            [tensor for tensor, _ in buffers],
            [block_bytes for _, block_bytes in buffers],
            loans,
            stream=stream,
        )
        keys = {_key(loan) for loan in loans if isinstance(loan, Loan)}
        if not given and not keys & self._borrowed:
            raise ValueError(
                "this cache holds no handle of those loans (never borrowed here, or given back "
                "already)"
            )
        self._borrowed -= keys
        self._committed_blocks = held

    def reclaim(
        self,
        loans: Sequence[Loan],
        *,
        zero: bool = True,
        timeout: float | None = None,
        stream: int | None = None,
    ) -> None:
        """Takes back what `lend` lent (`ExtensibleTensor.reclaim`, per buffer, each waiting
        up to `timeout`): `committed_blocks` grows back to where it was before the lend. A
        call that fails at one buffer (a timeout: its borrower has not given that buffer's
        loan back yet) keeps the buffers before it reclaimed, and the next call with the same
        loans takes back the rest: call it again until it succeeds."""
        if self._closed:
            raise ClosedError("the KV cache is closed")
        loans = tuple(loans)
        buffers = self._lending_buffers()
        if len(loans) != len(buffers):
            raise ValueError(f"{len(loans)} loans for a cache of {len(buffers)} buffers")
        keys = [
            (loan.tensor_id, loan.loan_id) if isinstance(loan, Loan) else None for loan in loans
        ]
        try:
            for (tensor, _), loan, key in zip(buffers, loans, keys, strict=True):
                if key in self._reclaimed:
                    continue  # back already, by a call that failed at a later buffer
                tensor.reclaim(loan, zero=zero, timeout=timeout, stream=stream)
                if key is not None:
                    self._reclaimed.add(key)
            self._reclaimed.difference_update(keys)
        finally:
            self._committed_blocks = self._blocks_held()

    def _check_lendable(self, num_blocks: int) -> int:
        num_blocks = _args.size(num_blocks, "num_blocks")
        if self._closed:
            raise ClosedError("the KV cache is closed")
        if self._legacy:
            raise ValueError("a legacy cache (plain torch memory) cannot lend its blocks")
        if num_blocks >= self._committed_blocks:
            raise ValueError(
                f"cannot keep {num_blocks} blocks and lend the rest: {self._committed_blocks} "
                "are committed"
            )
        return num_blocks

    def _lending_buffers(self) -> list[tuple[ExtensibleTensor, int]]:
        if self._legacy:
            raise ValueError("a legacy cache (plain torch memory) cannot lend or borrow blocks")
        return list(zip(self.buffers, self.segment_block_bytes, strict=True))

    def _blocks_held(self) -> int:
        """The blocks every buffer holds now (its smallest segment, in blocks)."""
        return min(
            min(tensor.segment_bytes) // block_bytes
            for tensor, block_bytes in self._lending_buffers()
        )

    def committed_views(self) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        """Views of exactly the committed blocks, each with storage of exactly the bytes it
        addresses (for consumers that register memory: RDMA, IPC).

        A layer whose view lies in one segment gets one tensor like its capacity view, cut to
        `committed_blocks`; a layer spanning several segments (K/V split, LHBNC) gets a list
        of one tensor per segment, the segment dims dropped (for a K/V split: `[K, V]`), since
        a single tensor would span the uncommitted tail between segments. Mamba: one tensor
        per state. In legacy mode the same shapes and strides, over the one allocation.
        """
        out: dict[str, torch.Tensor | list[torch.Tensor]] = {}
        n = self._committed_blocks
        for buffer, plans in zip(self._buffers, self._plans, strict=True):
            for plan in plans:
                parts = [p for v in plan.views for p in v.with_blocks(n).per_segment()]
                views = [buffer.view(p) for p in parts]
                out[plan.name] = views if plan.is_mamba or len(views) > 1 else views[0]
        return out

    def close(self) -> None:
        """Drops the cache's views and releases every buffer. Raises BufferError while views
        handed out (by `views` or `committed_views`) are still alive; the buffers without live
        views are released anyway: drop the views and call again."""
        self._views = {}
        error: BufferError | None = None
        for buffer in self._buffers:
            try:
                buffer.close()
            except BufferError as exc:
                error = error or exc
        if error is not None:
            raise error
        self._closed = True

    def __enter__(self) -> ExtensibleKVCache:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: object,
    ) -> None:
        """Closes; leaving on an exception never hides it (`tensor.close_on_exit`)."""
        close_on_exit(self.close, exc)


def _key(loan: Loan) -> tuple[int, int]:
    return (loan.tensor_id, loan.loan_id)
