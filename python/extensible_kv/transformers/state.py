"""The extensible side of one transformers cache: `CacheState` (the cache's `_ekv`), what sizes
it while it serves (its `sizer`), and its data sectors as the flow drives them
(`SectorView`).

A cache has one sizer, set by the extension and fixed for its life:

- `FixedSizer` (`FIXED`): the cache keeps the extension's size until `resize`;
- `auto.AutoSizer`: the automatic policy (`enable(auto_resize=...)`) grows on demand and
  shrinks when idle;
- `pooled.PooledSizer`: a node pool sizes it (`enable(pool=...)`), and `resize` and
  `suspend` refuse.

transformers' scheduler calls the cache's two hooks (`can_store_request_tokens`,
`compute_free_capacity`), which hand over to `state.sizer` whatever it is: nothing dispatches
on the mode. Suspension is not a sizer: a fixed or automatic cache is suspended and resumes
with the same sizer (`state.suspension`, `extensible_kv.transformers.suspension`).

Units: the sectors are transformers' `CachePool` sectors past the two trash sectors (the data
sectors); `blocks` / `sectors` convert to and from transformers' whole-model blocks.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from extensible_kv import flow
from extensible_kv.flow import ExtendReport
from extensible_kv.footprint import BufferFootprint, CacheFootprint
from extensible_kv.tensor import ExtensibleTensor
from extensible_kv.transformers.options import Options

if TYPE_CHECKING:
    import torch

__all__ = [
    "FIXED",
    "GIB",
    "GROW_BELOW_FREE",
    "TRASH_SECTORS",
    "CacheState",
    "FixedSizer",
    "SectorView",
    "Sizer",
    "is_extensible",
    "state_of",
]

GIB = 1 << 30
TRASH_SECTORS = 2
# Under the policy or in a pool, the free share of the cache below which it grows before the
# scheduler asks: above the FIFO scheduler's default safety margin (0.15), under which it
# admits no new request while others decode (`compute_free_capacity`).
GROW_BELOW_FREE = 0.2
logger = logging.getLogger("extensible_kv")


class Sizer(Protocol):
    """What sizes a cache while it serves. Both hooks run on the generation loop's thread,
    inside transformers' scheduler, and return whether the cache grew."""

    kind: ClassVar[str]  # "fixed", "auto" or "pool"

    def grow_on_demand(self, cache: Any, request: Any, request_len: int) -> bool:
        """The scheduler found too few free sectors for `request_len` more tokens of
        `request` (`can_store_request_tokens`)."""
        ...

    def grow_to_margin(self, cache: Any) -> bool:
        """The scheduler's margin check found under `GROW_BELOW_FREE` of the cache free."""
        ...

    def refuse(self, what: str) -> None:
        """Raises where this sizer alone may change the size (`what`: "resize", "suspend")."""
        ...

    def watch(self, manager: Any, cache: Any) -> None:
        """After each extension: starts what the sizer watches while `manager` serves (the
        policy's idle shrink; a pool's cache joins as the loop starts, `pooled.join`)."""
        ...


class FixedSizer:
    """The cache keeps the extension's size until `resize` changes it."""

    kind: ClassVar[str] = "fixed"

    def grow_on_demand(self, cache: Any, request: Any, request_len: int) -> bool:
        return False

    def grow_to_margin(self, cache: Any) -> bool:
        return False

    def refuse(self, what: str) -> None:
        return None

    def watch(self, manager: Any, cache: Any) -> None:
        return None


FIXED = FixedSizer()


@dataclass
class CacheState:
    """The extensible side of one cache (its `_ekv` attribute): the reservation, the sector
    geometry, the sizes, and what sizes it."""

    tensor: ExtensibleTensor
    device: torch.device
    options: Options
    handler: Any
    bytes_per_sector: int
    bytes_per_block: int
    capacity_sectors: int
    read_sectors: int
    free_at_init_bytes: int | None
    committed_sectors: int = 0  # data sectors, past the trash
    final_sectors: int | None = None  # set by `extend`
    sizer: Sizer = FIXED  # set by `extend`
    # While suspended: the pause held and the guarded manager (`suspend.Suspension`).
    suspension: Any = None
    # Held by every resize (`resize`, the policy's, `suspend`, `resume`): one at a time.
    resizing: threading.Lock = field(default_factory=threading.Lock, repr=False)
    report: ExtendReport | None = field(default=None, repr=False)

    @property
    def pooled(self) -> Any:
        """The pool membership while the loop runs in a node pool (`pooled.Joined`: its
        `member`), else None. Kept for readers written before the sizer; it is
        `sizer.joined` (`pooled.member_of(cache)` gives the member)."""
        return getattr(self.sizer, "joined", None)

    @property
    def suspended(self) -> bool:
        """Whether `suspend` gave the memory back (the tensor remembers the size to resume)."""
        return self.tensor.suspended

    def blocks(self, sectors: int) -> int:
        """Sectors in transformers' whole-model blocks."""
        return sectors * self.bytes_per_sector // self.bytes_per_block

    def sectors(self, blocks: int) -> int:
        """The sectors that hold `blocks` of transformers' whole-model blocks (rounded up)."""
        return math.ceil(blocks * self.bytes_per_block / self.bytes_per_sector)

    @property
    def granule_sectors(self) -> int:
        """The fewest sectors that are whole granules: counts whose committed end, past the
        trash, is a granule boundary are the ones a borrow maps at and a loan is made of."""
        granularity = self.tensor.granularity
        return granularity // math.gcd(self.bytes_per_sector, granularity)

    def aligned_up(self, sectors: int) -> int:
        """The least count from `sectors` up whose end is a granule boundary (the capacity
        at most)."""
        align = self.granule_sectors
        return min(sectors + (-(TRASH_SECTORS + sectors)) % align, self.capacity_sectors)

    def aligned_down(self, sectors: int) -> int:
        """The most count up to `sectors` whose end is a granule boundary."""
        return sectors - (TRASH_SECTORS + sectors) % self.granule_sectors

    def commit(self, data_sectors: int) -> None:
        """Grows the tensor to the trash plus `data_sectors` (zeroed), finished on the device
        before any other stream can use it (transformers computes on its own stream)."""
        num_bytes = (TRASH_SECTORS + data_sectors) * self.bytes_per_sector
        if num_bytes <= self.tensor.bytes_per_segment:
            return
        flow.refuse_while_capturing(self.device, "committing KV cache memory")
        self.tensor.resize_(num_bytes)
        self.committed_sectors = data_sectors
        self.synchronize()

    def grow_to_hold(self, sector_id: int) -> None:
        """Commits up to sector `sector_id` (a tensor index) before the pool hands it out:
        at least doubling what is committed (within transformers' own size), so that a
        warm-up touching n sectors costs O(log n) commits, not n."""
        needed = sector_id + 1 - TRASH_SECTORS
        if needed > self.committed_sectors:
            doubled = min(2 * self.committed_sectors, self.read_sectors)
            self.commit(max(needed, doubled))

    def synchronize(self) -> None:
        """Waits for the device's work (a no-op on the host)."""
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    def capturing(self) -> bool:
        """Whether a stream of the device captures a graph now (no resize then)."""
        try:
            flow.refuse_while_capturing(self.device, "resize")
        except RuntimeError:
            return True
        return False


def is_extensible(cache: Any) -> bool:
    """Whether `cache` is extensible_kv's (built while `enable` was on)."""
    return isinstance(getattr(cache, "_ekv", None), CacheState)


def state_of(cache: Any) -> CacheState:
    """The extensible side of `cache` (a manager's `batch_processor.cache`): its tensor, sizes
    and sizer. A `ValueError` for transformers' own cache."""
    state = getattr(cache, "_ekv", None)
    if not isinstance(state, CacheState):
        raise ValueError(
            "this manager's KV cache is not extensible: create the manager while "
            "extensible_kv.transformers is enabled"
        )
    return state


class SectorView:
    """The cache's data sectors as the flow drives them (a `flow.ExtendableCache`): its blocks
    are the sectors past the trash, which every footprint counts below them."""

    def __init__(self, state: CacheState) -> None:
        self._state = state

    @property
    def capacity_blocks(self) -> int:
        return self._state.capacity_sectors

    @property
    def committed_blocks(self) -> int:
        return self._state.committed_sectors

    @property
    def physical_bytes(self) -> int:
        return self._state.tensor.physical_bytes

    @property
    def num_handles(self) -> int:
        return self._state.tensor.num_handles

    @property
    def legacy(self) -> bool:
        return False

    def footprint(self) -> CacheFootprint:
        state = self._state
        buffer = BufferFootprint((0,), state.bytes_per_sector, state.tensor.granularity)
        return CacheFootprint(
            (buffer,), state.capacity_sectors, state.committed_sectors, TRASH_SECTORS
        )

    def commit(self, num_blocks: int) -> None:
        self._state.commit(num_blocks)

    def close(self) -> None:
        self._state.tensor.close()
