"""What `extensible_kv.transformers.enable` takes, checked as it is given (`Options`,
`AutoResize`), and the options in force (`current`, `put`, `clear`): the one place the rest of
the integration reads them from.

Every option is checked at `enable`, as the core checks sizes (any integer `operator.index`
takes; a `TypeError` or `ValueError` naming the option), before anything is patched: a wrong
option never surfaces later inside transformers' generation loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from extensible_kv import _args
from extensible_kv.pool.ledger import ENGINE_NAME
from extensible_kv.pool.member import VIAS
from extensible_kv.pool.store import Pool

__all__ = ["AutoResize", "Options", "clear", "current", "put"]


@dataclass(frozen=True)
class AutoResize:
    """The automatic resize policy, `enable(auto_resize=AutoResize(...))` (or `True` for these
    defaults). The extension measures free memory as usual, but commits only `min_blocks`;
    then, while the manager serves:

    - **grow on demand**: when the scheduler finds too few free sectors for a request, the
      cache grows first, by what that request lacks, at least `step_blocks` (default: an
      eighth of the most) and at least its current size (it doubles: a burst that starts from
      the least grows in a few commits, each of which pauses the generation loop), up to
      `max_blocks` (default: what the extension measured as fitting), so no request waits or
      is preempted while memory is there; it grows the same way when the scheduler's margin
      check finds under `GROW_BELOW_FREE` of the cache free (under its margin the scheduler
      would admit no new request); a commit the device refuses (out of memory: another
      engine took it) leaves the size as it is;
    - **shrink when idle**: once no request has held a block for `idle_s` seconds, the cache
      shrinks back to `min_blocks` (sectors that are all free, as `resize` does).

    Every change is logged on `extensible_kv`."""

    min_blocks: int = 1
    max_blocks: int | None = None
    step_blocks: int | None = None
    idle_s: float = 10.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "min_blocks", _args.size(self.min_blocks, "min_blocks", minimum=1))
        for name in ("max_blocks", "step_blocks"):
            object.__setattr__(
                self, name, _args.optional_size(getattr(self, name), name, minimum=1)
            )
        if self.max_blocks is not None and self.max_blocks < self.min_blocks:
            raise ValueError(f"max_blocks {self.max_blocks} is below min_blocks {self.min_blocks}")
        object.__setattr__(self, "idle_s", _args.seconds(self.idle_s, "idle_s", optional=False))


# The options that size a cache in a node pool: refused without `pool`.
_POOL_ONLY = (
    "min_blocks",
    "max_blocks",
    "min_bytes",
    "max_bytes",
    "engine",
    "pool_step_blocks",
)


@dataclass(frozen=True)
class Options:
    """What `enable(**options)` takes, checked at `enable` as the core checks sizes (any
    integer `operator.index` takes; `TypeError` or `ValueError` naming the option).

    - `budget_bytes`: the physical bytes the KV cache may hold in all once it is extended: its
      two trash sectors, what the warm-up committed and the blocks the extension adds, in whole
      granules. It replaces the measurement (no margin is kept from it). Required on the host
      backend unless `host_free`. A budget that cannot hold one block, or that is more than
      the free memory when the cache is built, is refused then (`OutOfMemoryError`), before the
      warm-up. `last_report()` shows it as `budget_asked_bytes`, and what the extension could
      still commit from it as `budget_bytes`.
    - `host_free`: on the host backend, measure `host_free_bytes()` instead.
    - `margin_bytes`: kept free from a measured budget, instead of the flow's `max(1 GiB, 0.75 *
      transient peak)`.
    - `granularity`: the reservation's granule, a power of two (a power-of-two multiple of the
      device's; the device's by default).
    - `auto_resize`: an `AutoResize` policy (`True`: its defaults), or None: the cache keeps
      the extension's size until `resize`.
    - `pool`: a node pool (`extensible_kv.pool.Pool`, or its name) that every manager's
      cache joins while its generation loop runs (docs/design.md §11): the extension commits
      `min_blocks` (default 1), the cache grows through the pool up to `max_blocks` (default:
      what the extension measured as fitting), and lends its free top blocks to the pool's
      other engines. Not with `auto_resize` (the pool sizes the cache).
    - `min_bytes`, `max_bytes`: the pool's limits in bytes instead of blocks (a block's bytes
      differ from model to model; each limit one way, not both): the fewest data sectors that
      hold `min_bytes`, the most that fit in `max_bytes` (the two trash sectors below them are
      not counted, as the pool's ledger counts an engine's blocks).
    - `engine`: the engine's name in the pool (default `transformers-<pid>-<n>`, unique in
      the process); a name two live engines share is refused when the second joins.
    - `pool_via`: how a donor's memory moves, `"loan"` (its handles change owner) or
      `"driver"` (released, then created again by the needy engine, as kvcached does).
    - `pool_step_blocks`: the blocks the cache commits at a time, which are also the
      smallest unit it can lend (default: a sixteenth of `max_blocks`). It is not what the
      cache asks for: a burst asks for what its waiting requests need.
    - `pool_move`: asked to lend, the cache moves its live blocks down into free ones first
      (as `resize(..., move=True)` does, between the loop's steps), so that it lends every
      free block above its minimum, not only the free ones at its top.
    - `driver_rate`: bytes per second the cache creates (grows) and gives back (an
      `AutoResize` or `resize` shrink, a `suspend`) through the driver at most, one handle at
      a time (`ExtensibleTensor.driver_rate`); None (the default): unpaced. The driver's work
      on the device for that memory (its scrub) slows the steps of a decode loop that shares
      the GPU when gigabytes come at once; paced, it is spread thin, and a grow takes as long
      as its bytes at the rate (docs/benchmarks.md, "Pacing the releases"). A shrink still
      returns at once.
    """

    budget_bytes: int | None = None
    host_free: bool = False
    margin_bytes: int | None = None
    granularity: int | None = None
    auto_resize: AutoResize | None = None
    pool: Pool | str | None = None
    min_blocks: int | None = None
    max_blocks: int | None = None
    engine: str | None = None
    pool_via: str = "loan"
    pool_step_blocks: int | None = None
    pool_move: bool = False
    driver_rate: int | None = None
    min_bytes: int | None = None
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        for name, least in (
            ("budget_bytes", 0),
            ("margin_bytes", 0),
            ("granularity", 1),
            ("driver_rate", 1),
        ):
            value = _args.optional_size(getattr(self, name), name, minimum=least)
            object.__setattr__(self, name, value)
        object.__setattr__(self, "host_free", _args.flag(self.host_free, "host_free"))
        auto: object = self.auto_resize
        if auto is True:
            object.__setattr__(self, "auto_resize", AutoResize())
        elif auto is not None and not isinstance(auto, AutoResize):
            raise TypeError(
                f"auto_resize must be an AutoResize, True or None, not {type(auto).__name__}"
            )
        granularity = self.granularity
        if granularity is not None and granularity & (granularity - 1):
            raise ValueError(
                f"granularity {granularity} must be a power of two (a power-of-two multiple "
                "of the device's granule: 2 MiB on CUDA, the page size on the host)"
            )
        self._check_pool_options()

    def _check_pool_options(self) -> None:
        object.__setattr__(self, "pool_move", _args.flag(self.pool_move, "pool_move"))
        for name in ("min_blocks", "max_blocks", "pool_step_blocks", "min_bytes", "max_bytes"):
            value = _args.optional_size(getattr(self, name), name, minimum=1)
            object.__setattr__(self, name, value)
        if self.pool is None:
            self._refuse_pool_options_without_pool()
            return
        pool = self.pool
        if not isinstance(pool, str | Pool):
            raise TypeError(f"pool must be a pool's name or a Pool, not {type(pool).__name__}")
        if isinstance(pool, str) and not ENGINE_NAME.match(pool):
            raise ValueError(
                f"pool {pool!r}: 1 to 64 letters, digits, '.', '_' or '-', starting with a "
                "letter or digit"
            )
        if self.auto_resize is not None:
            raise ValueError(
                "pool and auto_resize both size the cache: give one (the pool grows it on "
                "demand, through the other engines, and takes back what they give back)"
            )
        if self.engine is not None and (
            not isinstance(self.engine, str) or not ENGINE_NAME.match(self.engine)
        ):
            raise ValueError(
                f"engine {self.engine!r}: 1 to 64 letters, digits, '.', '_' or '-', starting "
                "with a letter or digit"
            )
        if self.pool_via not in VIAS:
            raise ValueError(
                f"pool_via must be one of {', '.join(map(repr, VIAS))}, not {self.pool_via!r}"
            )
        self._check_limits()

    def _refuse_pool_options_without_pool(self) -> None:
        given = [name for name in _POOL_ONLY if getattr(self, name) is not None]
        if self.pool_via != "loan":
            given.append("pool_via")
        if self.pool_move:
            given.append("pool_move")
        if given:
            raise ValueError(
                f"{', '.join(given)} without pool: they size a cache in a node pool; give "
                "pool='name' too (or auto_resize=AutoResize(...) for a cache of its own)"
            )

    def _check_limits(self) -> None:
        """Each limit one way (blocks or bytes), and the maximum not below the minimum where
        both are in the same unit (blocks and bytes compare once the block's bytes are known:
        `pooled.PooledSizer.within`)."""
        for what in ("min", "max"):
            blocks, num_bytes = getattr(self, f"{what}_blocks"), getattr(self, f"{what}_bytes")
            if blocks is not None and num_bytes is not None:
                raise ValueError(f"give {what}_blocks or {what}_bytes, not both")
        for unit in ("blocks", "bytes"):
            low, high = getattr(self, f"min_{unit}"), getattr(self, f"max_{unit}")
            if low is not None and high is not None and high < low:
                raise ValueError(f"max_{unit} {high} is below min_{unit} {low}")


# The options in force: set by `enable`, read by every cache built while it is on.
_current: Options | None = None


def current() -> Options | None:
    """The options of the last `enable`, or None while disabled."""
    return _current


def put(options: Options) -> None:
    """`options` are the ones in force from now on."""
    global _current
    _current = options


def clear() -> None:
    """No options are in force (disabled)."""
    global _current
    _current = None
