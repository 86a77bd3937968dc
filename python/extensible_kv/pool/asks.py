"""A needy engine's asks, and what each got: the record of "a burst gets what its queue needs
in one move".

An engine asks for what its waiting requests need (`PoolMember.request`, `grow`,
`request_bytes`: prompt plus new tokens, in its own blocks), saying since when the first of
them waits (`since`, a `time.monotonic()` time; else the ask's own). The ask stays open while
memory for it is on its way (requests to donors asked or offered, loans recalled to come
back, releases to the driver), and further asks while it is open join it (the larger need,
the earliest wait). It closes when the engine has what it asked for, or when nothing more is
on its way; then it is an `Ask`: asked and got, in bytes and in the engine's blocks, and the
wait from the first waiting request to the last of its memory mapped. Each is logged on the
`extensible_kv.pool` logger as one structured line (`pool ask: engine=... asked_bytes=...
got_bytes=... wait_ms=...`, the `Ask` itself as the record's `ask` attribute) and kept in
`PoolMember.asks` (the newest `ASKS_KEPT`).
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

logger = logging.getLogger("extensible_kv.pool")

__all__ = ["ASKS_KEPT", "Ask", "AskLog"]

ASKS_KEPT = 4096


@dataclass(frozen=True)
class Ask:
    """One ask of engine `engine` and its answer. `asked_blocks` (its blocks, up to its
    maximum; `asked_bytes`) it asked for; it got `got_blocks` (`got_bytes`), of which
    `committed_blocks` from the device's free memory and `borrowed_blocks` as loans from
    `lenders`, the rest its own loans coming back. `wait_s` runs from `since` (the first
    waiting request, or the ask) to the last of that memory mapped, or to the ask's end if
    none came."""

    engine: str
    asked_blocks: int
    asked_bytes: int
    got_blocks: int
    got_bytes: int
    wait_s: float
    since: float
    committed_blocks: int = 0
    borrowed_blocks: int = 0
    lenders: tuple[str, ...] = ()

    @property
    def met(self) -> bool:
        return self.got_blocks >= self.asked_blocks


@dataclass
class _Open:
    since: float
    start_blocks: int
    target_blocks: int
    last_mapped: float | None = None
    committed_blocks: int = 0
    borrowed_blocks: int = 0
    lenders: tuple[str, ...] = ()


class AskLog:
    """The open ask of engine `engine` (blocks of `block_bytes`), and the closed ones."""

    def __init__(self, engine: str, block_bytes: int) -> None:
        self.engine = engine
        self.block_bytes = block_bytes
        self.closed: collections.deque[Ask] = collections.deque(maxlen=ASKS_KEPT)
        self._open: _Open | None = None

    @property
    def open(self) -> bool:
        return self._open is not None

    def wanted(self, committed_blocks: int) -> int:
        """The blocks the open ask still waits for (0: none open, or met)."""
        ask = self._open
        return 0 if ask is None else max(0, ask.target_blocks - committed_blocks)

    @property
    def since(self) -> float | None:
        return None if self._open is None else self._open.since

    def asked(self, committed_blocks: int, target_blocks: int, since: float) -> None:
        """An ask for the blocks up to `target_blocks` (the cache has `committed_blocks`), for
        requests waiting since `since`: opens one, or joins the open one."""
        ask = self._open
        if ask is None:
            if target_blocks > committed_blocks:
                self._open = _Open(since, committed_blocks, target_blocks)
            return
        ask.target_blocks = max(ask.target_blocks, target_blocks)
        ask.since = min(ask.since, since)

    def mapped(
        self,
        now: float,
        *,
        committed: int = 0,
        borrowed: int = 0,
        lender: str = "",
    ) -> None:
        """Memory reached the cache for the open ask: `committed` blocks of free memory,
        `borrowed` blocks of a loan from `lender`, or (neither) its own loans back."""
        ask = self._open
        if ask is None:
            return
        ask.last_mapped = now
        ask.committed_blocks += committed
        ask.borrowed_blocks += borrowed
        if lender and lender not in ask.lenders:
            ask.lenders += (lender,)

    def settle(self, committed_blocks: int, in_flight: bool, now: float) -> Ask | None:
        """Closes the open ask if the cache has what it asked for, or nothing more is on its
        way (`in_flight` false): logged, kept, and returned."""
        ask = self._open
        if ask is None or (committed_blocks < ask.target_blocks and in_flight):
            return None
        self._open = None
        got = max(0, committed_blocks - ask.start_blocks)
        asked = ask.target_blocks - ask.start_blocks
        end = ask.last_mapped if ask.last_mapped is not None else now
        closed = Ask(
            engine=self.engine,
            asked_blocks=asked,
            asked_bytes=asked * self.block_bytes,
            got_blocks=got,
            got_bytes=got * self.block_bytes,
            wait_s=max(0.0, end - ask.since),
            since=ask.since,
            committed_blocks=ask.committed_blocks,
            borrowed_blocks=ask.borrowed_blocks,
            lenders=ask.lenders,
        )
        self.closed.append(closed)
        logger.info(
            "pool ask: engine=%s asked_bytes=%d got_bytes=%d asked_blocks=%d got_blocks=%d "
            "committed_blocks=%d borrowed_blocks=%d lenders=%s wait_ms=%.3f met=%s",
            closed.engine,
            closed.asked_bytes,
            closed.got_bytes,
            closed.asked_blocks,
            closed.got_blocks,
            closed.committed_blocks,
            closed.borrowed_blocks,
            ",".join(closed.lenders) or "-",
            closed.wait_s * 1e3,
            closed.met,
            extra={"ask": closed},
        )
        return closed
