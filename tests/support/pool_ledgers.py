"""Ledgers by hand for the pool's tests (`tests/test_pool_*.py`): a test's clock, made-up
processes (`World`), engines of a given shape, loans with memory, and a sample ledger.

Pids here are made up and the clock is the test's (`Pool(clock=..., alive=...)`); the engines'
processes are real in `test_pool_processes.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extensible_kv.ipc import Loan, LoanHandle
from extensible_kv.pool import Engine, Ledger, LoanState, Pool, PoolLoan
from extensible_kv.shape import BufferShape, CacheShape

BB = 8192  # bytes a block
GRANULE = 4096
NOW = 100.0


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


@dataclass
class World:
    """Made-up processes: `dead` pids are gone."""

    clock: Clock = field(default_factory=Clock)
    dead: set[int] = field(default_factory=set)

    def alive(self, pid: int, start_time: int) -> bool:
        return pid not in self.dead

    def pool(self, directory: Path, **kw: Any) -> Pool:
        return Pool("test", directory=directory, clock=self.clock, alive=self.alive, **kw)


def shape(
    block_bytes: int = BB,
    *,
    segments: int = 1,
    buffers: int = 1,
    device: str = "cpu",
    granularity: int = GRANULE,
) -> CacheShape:
    """A cache's shape: `buffers` buffers of `segments` segments each, `block_bytes` a block in
    all."""
    per_segment = block_bytes // (segments * buffers)
    buffer = BufferShape(segments, per_segment)
    return CacheShape(device, granularity, (buffer,) * buffers)


def engine(
    name: str,
    pid: int,
    committed: int = 0,
    *,
    lo: int = 0,
    hi: int = 64,
    lendable: int | None = None,
    busy: bool = False,
    block_bytes: int = BB,
    of: CacheShape | None = None,
) -> Engine:
    """An engine of `block_bytes` a block (or of shape `of`), `committed` blocks, limits
    `lo..hi` of a capacity of 128, lending all above its minimum unless `lendable` says."""
    the_shape = of or shape(block_bytes)
    return Engine(
        name,
        pid,
        1000 + pid,
        the_shape,
        lo,
        hi,
        capacity_blocks=128,
        committed_blocks=committed,
        physical_bytes=committed * the_shape.block_bytes(),
        busy=busy,
        heartbeat=NOW,
        lendable_blocks=committed - lo if lendable is None else lendable,
    )


def memory(num_bytes: int = 2 * GRANULE, *, tensor_id: int = 5) -> tuple[Loan, ...]:
    """A loan's memory as the ledger keeps it: one `Loan` of `num_bytes` (whole granules)."""
    handle = LoanHandle(10, num_bytes // GRANULE, 1, 12)
    return (Loan("cpu", GRANULE, 1, tensor_id, 1, 7, 9, (handle,)),)


def loan(
    loan_id: int,
    lender: str,
    borrower: str,
    blocks: int,
    state: str,
    deadline: float = NOW + 1,
    *,
    num_bytes: int | None = None,
    start_block: int = 0,
    kept_blocks: int = 0,
    recall: bool = False,
    lent_blocks: int | None = None,
) -> PoolLoan:
    """A loan in `state`; with memory where the state has some (`num_bytes`, by default its
    `blocks` of `BB`)."""
    state = LoanState(state)
    has = state.memory_out
    size = blocks * BB if num_bytes is None else num_bytes
    return PoolLoan(
        loan_id,
        lender,
        borrower,
        blocks,
        state,
        deadline,
        size if has else 0,
        start_block,
        kept_blocks,
        recall,
        loans=memory(size) if has else (),
        asked_bytes=blocks * BB,
        lent_blocks=(blocks if lent_blocks is None else lent_blocks) if has else 0,
        mapped_bytes=size if state == LoanState.BORROWED else 0,
    )


def sample_ledger() -> Ledger:
    ledger = Ledger(next_loan_id=4, caps={"cpu": 1 << 20})
    ledger.engines = {"a": engine("a", 11, 20), "b": engine("b", 12, 8)}
    ledger.engines["a"].lent_bytes = 4 * BB
    ledger.engines["b"].borrowed_bytes = 3 * BB
    ledger.loans = {
        1: loan(1, "a", "b", 4, "borrowed", start_block=8, kept_blocks=16),
        3: loan(3, "b", "a", 2, "asked"),
    }
    ledger.loans[1].loans = memory(4 * BB, tensor_id=2**100)
    ledger.loans[1].mapped_bytes = 3 * BB  # a handle it could not use went back
    ledger.log(NOW, "hello")
    return ledger


def own_start() -> int:
    from extensible_kv.pool import _proc

    return _proc.own_start_time()
