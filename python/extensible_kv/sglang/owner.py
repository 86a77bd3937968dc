"""SGLang's post-capture KV arena (`sglang.srt.mem_cache.kv_vmm_backing.KvVmmBufferOwner`) on
extensible-kv's core.

Same keyword constructor and API as SGLang's (0.5.16 to 0.5.23): `tensors`, `ensure_prefix`,
`finalize`, `backed_bytes`, `close`, plus `device`, `device_id`, `store_dtype`, `page_size`.
The pools (`MHATokenToKVPool` and the hybrid-linear, SWA and unified pools built on it) use it
unchanged.

Approach: the pool's buffers (`k0..k{L-1}, v0..v{L-1}`, or the unified pool's one byte buffer)
are the segments of ONE `ExtensibleTensor`, back to back (each rounded up to 512 bytes, torch's
allocation alignment), and every tensor SGLang gets is a view of its segment. A prefix request
becomes one byte target per segment (from the buffer's `KvBufferDesc`, so K and V rows may
differ) and one all-or-nothing grow of every segment together. Where SGLang's arena maps one new
handle per buffer per extension, the core plans the missing granules of all the buffers at
once: a granule two neighbouring buffers share is mapped once, and at a near-full finalize the
buffers' prefixes run into each other and are backed by a few large handles. Nothing is compiled
at run time.

Beyond SGLang's arena:
- `finalize` (or `resize`) to fewer tokens than are backed shrinks in place: the kept tokens keep
  their bytes and addresses, and the memory past them goes back to the device (exactly:
  `backed_bytes` is then the granule-rounded footprint).
- `suspend()` gives every byte back and keeps the addresses; `resume()` recommits the same
  prefixes there, so CUDA graphs captured earlier stay valid. `suspend_all` / `resume_all` do it
  for every open owner of the process: the plugin calls them for the memory saver's `kv_cache`
  tag. (`release()`, `released`, `release_all` and `KvReleasedError` are their deprecated
  names: "release" is the driver's word, for memory that goes for good.)

Zeroing (`zero_new`, default from `EXTENSIBLE_KV_SGLANG_ZERO`, off): SGLang's arena does not
zero (every slot is written before it is read; slot 0's page absorbs the padded writes of
captured graphs), and neither does this owner by default. What holds then: new bytes hold
unspecified values on CUDA (the driver scrubs memory other processes freed; memory this process
gave back and takes again may hold its old bytes), zeros on the host backend (fresh memfd
pages), and bytes in granules that were already backed (a granule shared with a neighbour)
keep what they held. After `suspend`/`resume` the contents are lost, as with torch_memory_saver.
With zeroing on, every new byte (grow or resume) reads zero.

Errors are typed and leave the owner unchanged: `ValueError` for a span or count out of range (as
SGLang's), `extensible_kv.OutOfMemoryError` (a `MemoryError`) when the device cannot commit,
`extensible_kv.DriverError` for a driver failure, `KvSuspendedError` for backing while suspended.
"""

from __future__ import annotations

import logging
import math
import warnings
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from extensible_kv import _args
from extensible_kv._plugins import env_flag
from extensible_kv.tensor import ExtensibleTensor, HandleSizing, deprecated_alias

if TYPE_CHECKING:
    import torch

__all__ = [
    "ZERO_ENV_VAR",
    "KvBufferDescLike",
    "KvSuspendedError",
    "KvVmmBufferOwner",
    "resume_all",
    "suspend_all",
]

ZERO_ENV_VAR = "EXTENSIBLE_KV_SGLANG_ZERO"
# Where each buffer starts inside the reservation: torch's caching allocator hands out 512-byte
# aligned blocks, and kernels may assume as much of a KV buffer.
SEGMENT_ALIGN_BYTES = 512
# A grow maps one handle per buffer run, up to this size (then pieces of it), as SGLang's arena
# maps one handle per buffer per extension. A pool's buffers grow a few times (slot 0, the
# warm-up, the finalize), each run one buffer's prefix. On the H200 (docs/benchmarks.md,
# medians of 3, one run), finalize to 120 GiB took: 8B pool, SGLang's arena 9.4 ms, ours in
# 1 GiB handles cut at multiples of the cap (the core's default) 13.4 ms, at multiples of 8 GiB
# 10.1 ms, a handle per run 7.5 ms; 70B TP8 pool, 15.8 / 20.4 / 17.0 / 15.3 ms. The cap keeps a
# unified pool (one buffer) from one giant handle (a 64 GiB cuMemCreate once took 343 ms).
HANDLE_BYTES = 8 << 30

logger = logging.getLogger("sglang.extensible_kv")

# Every open owner of the process, for the memory saver's `kv_cache` tag.
_open_owners: weakref.WeakSet[KvVmmBufferOwner] = weakref.WeakSet()


class KvBufferDescLike(Protocol):
    """What the owner reads of SGLang's `memory_pool.KvBufferDesc`."""

    name: str
    shape: tuple[int, ...]

    def reserved_span_bytes(self, itemsize: int) -> int: ...
    def prefix_span_bytes(self, num_tokens: int, page_size: int) -> int: ...
    def final_span_bytes(self, num_tokens: int, page_size: int) -> int: ...


class KvSuspendedError(RuntimeError):
    """The owner's memory is suspended (`suspend`): `resume` it before backing more."""


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _backing_device(device: str, device_id: int) -> str:
    """The core's name for where SGLang asked the buffers to live: the host backend for a CPU
    device, else the CUDA device `device_id` (what SGLang's arena uses, whatever the index in
    `device`)."""
    kind = str(device).split(":", 1)[0]
    if kind == "cpu":
        return "cpu"
    if kind != "cuda":
        raise ValueError(f"device {device!r}: extensible-kv backs CUDA and CPU devices only")
    return f"cuda:{_args.size(device_id, 'device_id')}"


class KvVmmBufferOwner:
    """Owns one `ExtensibleTensor` whose segments are a pool's KV buffers, backed incrementally.

    `buffer_descs` is an ordered list of `KvBufferDesc`; `tensors` are the buffers in that order,
    each a view of its segment with the descriptor's shape. One page is backed at construction
    (slot 0 absorbs the padded writes of graph capture), as SGLang's arena does.
    """

    def __init__(
        self,
        *,
        device: str,
        device_id: int,
        store_dtype: torch.dtype,
        page_size: int,
        reserved_num_tokens: int,
        buffer_descs: Sequence[KvBufferDescLike],
        zero_new: bool | None = None,
    ) -> None:
        self.device = device
        # Integers as the core takes them (any `__index__` int; a float or bool is a TypeError).
        self.device_id = _args.integer(device_id, "device_id")
        self.store_dtype = store_dtype
        self.page_size = _args.integer(page_size, "page_size")
        self.tensors: list[torch.Tensor] = []
        self._reserved_num_tokens = _args.integer(reserved_num_tokens, "reserved_num_tokens")
        self._final_num_tokens: int | None = None
        self._zero_new = env_flag(ZERO_ENV_VAR, False) if zero_new is None else bool(zero_new)
        self._descs = list(buffer_descs)
        self._buffer: ExtensibleTensor | None = None
        self._closed = False
        if self.page_size < 1 or self._reserved_num_tokens < self.page_size:
            raise ValueError(
                f"page_size={self.page_size} and reserved_num_tokens="
                f"{self._reserved_num_tokens} must satisfy 1 <= page_size <= reserved"
            )
        itemsize = store_dtype.itemsize
        self._reserved_spans = tuple(d.reserved_span_bytes(itemsize) for d in self._descs)
        for desc, span in zip(self._descs, self._reserved_spans, strict=True):
            if span != math.prod(desc.shape) * itemsize:
                raise ValueError(
                    f"buffer {desc.name!r}: reserved span {span} is not the "
                    f"{math.prod(desc.shape) * itemsize} bytes of shape {desc.shape}"
                )
        if self._descs:
            # A pool with no buffer (a zero-layer sub-pool) needs no reservation.
            self._buffer = self._reserve(_backing_device(device, self.device_id))
        try:
            self.ensure_prefix(self.page_size)
        except BaseException:
            self.close()
            raise
        if self._buffer is not None:
            _open_owners.add(self)

    def _reserve(self, backing_device: str) -> ExtensibleTensor:
        capacities = [
            max(_round_up(span, SEGMENT_ALIGN_BYTES), SEGMENT_ALIGN_BYTES)
            for span in self._reserved_spans
        ]
        buffer = ExtensibleTensor(
            sum(capacities),
            device=backing_device,
            segment_capacities=capacities,
            handle_sizing=HandleSizing("per_run", HANDLE_BYTES),
        )
        try:
            self.tensors = [
                buffer.view(self.store_dtype, desc.shape, offset=offset)
                for desc, offset in zip(self._descs, buffer.segment_offsets, strict=True)
            ]
        except BaseException:
            self.tensors = []
            buffer.close()
            raise
        return buffer

    # -- backing -------------------------------------------------------------------------------

    def _checked(self, spans: Sequence[int]) -> list[int]:
        """`spans` as ints, each within its buffer; ValueError (SGLang's wording) otherwise."""
        checked = []
        for desc, reserved, span in zip(self._descs, self._reserved_spans, spans, strict=True):
            span = int(span)
            if not 0 <= span <= reserved:
                raise ValueError(
                    f"buffer {desc.name!r}: span {span} outside [0, {reserved}] (reserved "
                    "tensor bytes)"
                )
            checked.append(span)
        return checked

    def _open_buffer(self, what: str) -> ExtensibleTensor | None:
        if self._closed:
            raise RuntimeError(f"cannot {what}: the owner is closed")  # as SGLang's arena
        if self.suspended:
            raise KvSuspendedError(f"cannot {what}: the KV memory is suspended; resume() first")
        return self._buffer

    def _grow_to(self, spans: Sequence[int]) -> None:
        """Backs every buffer to at least `spans[i]` bytes, all or nothing."""
        buffer = self._open_buffer("back KV buffers")
        if buffer is None:
            return
        targets = [max(old, new) for old, new in zip(buffer.segment_bytes, spans, strict=True)]
        buffer.resize_per_segment_(targets, zero_new=self._zero_new)

    def _set_to(self, spans: Sequence[int]) -> None:
        """Backs every buffer to exactly `spans[i]` bytes: grows what is short (all or
        nothing), then shrinks what is over, keeping the bytes below and giving the rest back."""
        buffer = self._open_buffer("resize KV buffers")
        if buffer is None:
            return
        self._grow_to(spans)
        if any(new < old for old, new in zip(buffer.segment_bytes, spans, strict=True)):
            buffer.shrink_per_segment_(list(spans), exact=True)
            buffer.wait_released()  # SGLang reads the footprint a finalize leaves

    def ensure_prefix(self, num_tokens: int) -> None:
        """Backs (at least) the first `num_tokens` slots of every buffer (a negative count is a
        ValueError, before SGLang's span arithmetic sees it)."""
        n = _args.size(num_tokens, "num_tokens")
        self._grow_to(self._checked([d.prefix_span_bytes(n, self.page_size) for d in self._descs]))

    def finalize(self, final_num_tokens: int) -> None:
        """Backs each buffer's final span (the tokens plus the padded page) and sets the serving
        capacity. Fewer tokens than are backed shrink the buffers in place, keeping the tokens
        below `final_num_tokens` (SGLang's arena only grows)."""
        final = _args.integer(final_num_tokens, "final_num_tokens")
        if not self.page_size <= final <= self._reserved_num_tokens:
            raise ValueError(
                f"final_num_tokens={final} must satisfy page_size={self.page_size} <= final <= "
                f"reserved={self._reserved_num_tokens}"
            )
        self._set_to(
            self._checked([d.final_span_bytes(final, self.page_size) for d in self._descs])
        )
        self._final_num_tokens = final

    resize = finalize

    @property
    def final_num_tokens(self) -> int | None:
        """The serving capacity `finalize` set; None before."""
        return self._final_num_tokens

    @property
    def reserved_num_tokens(self) -> int:
        return self._reserved_num_tokens

    # -- suspend and resume (the memory saver's kv_cache tag) ----------------------------------

    @property
    def suspended(self) -> bool:
        return self._buffer is not None and self._buffer.suspended

    def suspend(self) -> None:
        """Gives all the KV memory back, keeping every address (graphs stay valid); the contents
        are lost. SGLang frees memory for another user: it is gone on return. Idempotent."""
        if self._buffer is not None:
            self._buffer.suspend()

    def resume(self) -> None:
        """Recommits what `suspend` gave back, at the same addresses (zeroed with `zero_new`).
        All or nothing: on `OutOfMemoryError` the owner stays suspended. Idempotent."""
        if self._buffer is not None:
            self._buffer.resume(zero_new=self._zero_new)

    @property
    @deprecated_alias("KvVmmBufferOwner.released", "KvVmmBufferOwner.suspended")
    def released(self) -> bool:
        """Deprecated: `suspended`."""
        return self.suspended

    @deprecated_alias("KvVmmBufferOwner.release()", "KvVmmBufferOwner.suspend()")
    def release(self) -> None:
        """Deprecated: `suspend` (the same call)."""
        self.suspend()

    # -- accessors / teardown ------------------------------------------------------------------

    @property
    def backed_bytes(self) -> int:
        """Physical bytes backing the buffers (granule-rounded; a shared granule counts once)."""
        return self._buffer.physical_bytes if self._buffer is not None else 0

    @property
    def buffer(self) -> ExtensibleTensor | None:
        """The `ExtensibleTensor` whose segments are the buffers; None once closed."""
        return self._buffer

    def close(self) -> None:
        """Gives the memory back now. The addresses go with the last view of them: a view the
        pool still holds faults if touched, instead of reading memory reused by someone else.
        Idempotent."""
        self.tensors = []
        self._closed = True
        _open_owners.discard(self)
        buffer, self._buffer = self._buffer, None
        if buffer is not None:
            buffer.free()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(device={self.device!r}, buffers={len(self._descs)}, "
            f"reserved_num_tokens={self._reserved_num_tokens}, backed_bytes={self.backed_bytes}, "
            f"suspended={self.suspended})"
        )


def suspend_all() -> int:
    """`suspend()` every open owner of the process; how many held memory."""
    owners = [o for o in list(_open_owners) if not o.suspended and o.backed_bytes]
    for owner in owners:
        owner.suspend()
    return len(owners)


def resume_all() -> int:
    """`resume()` every suspended owner of the process; how many. An `OutOfMemoryError` stops
    at the owner that cannot resume (it stays suspended, as do the ones after it)."""
    owners = [o for o in list(_open_owners) if o.suspended]
    for owner in owners:
        owner.resume()
    return len(owners)


# Deprecated names -> what they name now ("release" is the driver's word).
DEPRECATED = {"release_all": "suspend_all", "KvReleasedError": "KvSuspendedError"}


def __getattr__(name: str) -> Any:
    """The deprecated names of `DEPRECATED`, with a `DeprecationWarning`."""
    new = DEPRECATED.get(name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"extensible_kv.sglang.{name} is deprecated: use extensible_kv.sglang.{new}",
        DeprecationWarning,
        stacklevel=2,
    )
    return globals()[new]
