"""An engine process for the pool's tests: a `PoolMember` over a small host-backend
`ExtensibleKVCache`, driven by commands over a pipe, and the checks that look into it from
outside (`/proc/<pid>/fd` and `/proc/<pid>/maps`).

The engine "uses" its lowest blocks: each used block holds a pattern of its engine's seed and
its index (a byte, in every segment of every buffer), written when it is first used and
checked after every command, so a loan that touched a live block fails the test at once. Its
free top blocks are what it does not use.

Its cache is one of three tiny models' (`LAYOUTS`, issue 52): `kv2` (a K/V split: 2 segments
of 4,096 bytes a block, 8,192 in all), `flat` (one block-major segment of 12,288 bytes a block,
as transformers' flat cache), `layers6` (6 layers, a segment each, 4,096 bytes a block each,
24,576 in all). Block bytes and segment counts differ, so a loan between two of them is memory
dealt to the borrower's own segments (`extensible_kv.shape`), and what a borrower's layout
cannot use stays with the lender. A segment's block is whole granules in each, so that a
commit of any block count maps exactly what the pool counts (a block that ends inside a
granule maps the rest of it too, past the pool's cap: `test_pool_models.py`'s xfail).

`arm` makes the store fail (`Fault`: its lock held by another descriptor, `ENOSPC` on its
writes, or garbage over the ledger) right after the cache's next memory move of a kind, until
the command that made the move is over: its post fails, and what the command raised of it is
the command's result, not the engine's end.
"""

from __future__ import annotations

import errno
import fcntl
import multiprocessing as mp
import os
import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from extensible_kv import (
    AttentionLayerSpec,
    ExtensibleKVCache,
    KVCacheTensorSpec,
    PtraceRefusedError,
    StandardLayerSpec,
)
from extensible_kv.pool import LedgerCorruptError, Pool, PoolLockTimeout, PoolMember, _proc
from extensible_kv.pool import store as store_module

GRANULE = 4096
# FLASH_ATTN: 2 segments (K, V) of 32 tokens x 2 heads x 32 bf16 = one granule a block.
SPEC = (
    KVCacheTensorSpec(
        2 * GRANULE, {"attn": AttentionLayerSpec("FLASH_ATTN", 32, 2, 32, torch.bfloat16)}
    ),
)
BLOCK_BYTES = 2 * GRANULE
# The three tiny models' caches: spec and block bytes (every segment's block bytes summed).
LAYOUTS: dict[str, tuple[tuple[KVCacheTensorSpec, ...], int]] = {
    "kv2": (SPEC, BLOCK_BYTES),
    # FLASHINFER is block-major: one segment of 16 tokens x 6 heads x 32 x K/V x bf16.
    "flat": (
        (
            KVCacheTensorSpec(
                3 * GRANULE, {"attn": AttentionLayerSpec("FLASHINFER", 16, 6, 32, torch.bfloat16)}
            ),
        ),
        3 * GRANULE,
    ),
    # [L, B, H, N, C]: a segment per layer, 16 tokens x 2 heads x 32 x K/V x bf16 each.
    "layers6": (
        (
            KVCacheTensorSpec(
                6 * GRANULE,
                {
                    f"l{i}": StandardLayerSpec("LBHNC", 6, i, 16, 2, 32, torch.bfloat16)
                    for i in range(6)
                },
            ),
        ),
        6 * GRANULE,
    ),
}
CAPACITY = 96
STEP = 4  # blocks a commit step: the unit a donor lends in (whole granules in every layout)
TIMEOUT_S = 60
MEMFD = _proc.HOST_MEMFD
BOARD = "/memfd:extensible-kv-loan:"


def block_value(seed: int, block: int) -> int:
    return (seed * 31 + block * 7) % 200 + 1  # a byte, never 0 (what a zeroed block holds)


class Engine:
    """The engine in its process: its cache, its member and the blocks it uses."""

    def __init__(
        self,
        directory: str,
        pool: str,
        name: str,
        seed: int,
        limits: tuple[int, int],
        answer_timeout_s: float,
        refuse_by_pid: bool,
        lock_timeout_s: float = 5.0,
        layout: str = "kv2",
    ) -> None:
        self.seed = seed
        self.layout = layout
        self.fault: Fault | None = None
        self.used = 0
        self.over_socket = 0  # loans borrowed with fds the lender sent on its socket
        spec, block_bytes = LAYOUTS[layout]
        self.cache = ExtensibleKVCache(
            spec, CAPACITY, "cpu", granularity=GRANULE, export_handle_types="posix_fd"
        )
        assert self.cache_block_bytes() == block_bytes, (layout, self.cache_block_bytes())
        self.refuse_by_pid = refuse_by_pid
        if refuse_by_pid:
            self.cache.borrow = self.borrow_refused_by_pid  # type: ignore[method-assign]
        self.member = PoolMember(
            Pool(pool, directory=directory, lock_timeout_s=lock_timeout_s),
            name,
            self.cache,
            min_blocks=limits[0],
            max_blocks=limits[1],
            free_tail_blocks=lambda: self.cache.committed_blocks - self.used,
            on_resize=self.resized,
            answer_timeout_s=answer_timeout_s,
            take_timeout_s=2.0,
            commit_step_blocks=STEP,
        )
        self.member.join()

    def arm(self, method: str, kind: str) -> None:
        """The store fails (`kind`) right after the cache's next `method` moved memory."""
        fault = Fault(kind, self.member.pool)
        original = getattr(self.cache, method)

        def moved_then_fault(*args: Any, **kw: Any) -> Any:
            result = original(*args, **kw)
            setattr(self.cache, method, original)  # once
            fault.start()
            return result

        setattr(self.cache, method, moved_then_fault)
        self.fault = fault

    def borrow_refused_by_pid(self, loans: Any, **kw: Any) -> int:
        """The cache's borrow where this process may not take other processes' fds by pid
        (pidfd_getfd's EPERM under Yama's ptrace_scope, stood in for): only fds the lender
        sent on its socket are taken."""
        if any(loan.received_fds is None for loan in loans):
            raise refused_by_pid()
        blocks = ExtensibleKVCache.borrow(self.cache, loans, **kw)
        self.over_socket += 1
        return blocks

    def idle(self, conn: Any) -> None:
        """Between commands: as a lender's loop does between its steps, answers borrowers
        that ask on its socket (which changes nothing in the ledger or in its numbers)."""
        while not conn.poll(0.002):
            self.member._send_fds()

    def resized(self, committed: int) -> None:
        assert committed >= self.used, f"the cache shrank to {committed} under {self.used} used"

    def cache_block_bytes(self) -> int:
        """A block's bytes over every segment of every buffer."""
        return sum(
            tensor.num_segments * sbb
            for tensor, sbb in zip(self.cache.buffers, self.cache.segment_block_bytes, strict=True)
        )

    def _segments(self, blocks: int) -> list[torch.Tensor]:
        """Blocks `[0, blocks)` of every segment of every buffer, a row of bytes per block."""
        rows = []
        for tensor, sbb in zip(self.cache.buffers, self.cache.segment_block_bytes, strict=True):
            for s in range(tensor.num_segments):
                rows.append(tensor.segment_view(s)[: blocks * sbb].view(blocks, sbb))
        return rows

    def use(self, blocks: int) -> None:
        """Uses the lowest `blocks` blocks (at most what is committed): new ones get their
        pattern, the ones given up are free."""
        blocks = min(blocks, self.cache.committed_blocks)
        if blocks > self.used:
            for rows in self._segments(blocks):
                for block in range(self.used, blocks):
                    rows[block].fill_(block_value(self.seed, block))
        self.used = blocks

    def check(self) -> None:
        """The committed blocks are backed, and every used block still holds its pattern."""
        cache = self.cache
        for tensor, block_bytes in zip(cache.buffers, cache.segment_block_bytes, strict=True):
            backed = min(tensor.segment_bytes)
            assert backed >= cache.committed_blocks * block_bytes, (
                f"{cache.committed_blocks} blocks committed, {backed} bytes backed"
            )
        if self.used:
            expected = torch.tensor(
                [block_value(self.seed, b) for b in range(self.used)], dtype=torch.uint8
            )
            for rows in self._segments(self.used):
                assert torch.equal(rows.min(dim=1).values, expected), "a used block lost its bytes"
                assert torch.equal(rows.max(dim=1).values, expected), "a used block lost its bytes"

    def numbers(self) -> dict[str, int]:
        cache = self.cache
        return {
            "committed_blocks": cache.committed_blocks,
            "physical_bytes": cache.physical_bytes,
            "lent_bytes": sum(t.lent_bytes for t in cache.buffers),
            "borrowed_bytes": sum(t.borrowed_bytes for t in cache.buffers),
            "used": self.used,
            "over_socket": self.over_socket,
        }

    def settle(self, timeout_s: float) -> None:
        """Gives back what it borrowed (giving up the blocks from the lowest loan up) and
        serves until none of its loans is in flight."""
        with self.member.pool.transaction() as ledger:
            starts = [
                loan.start_block
                for loan in ledger.loans_of(self.member.name)
                if loan.borrower == self.member.name and loan.state == "borrowed"
            ]
        self.use(min([self.used, *starts]))
        self.member.settle(timeout_s)


class Fault:
    """A failure of the pool's store in this process, from `start()` to `stop()`: `lock` (its
    lock held through another descriptor: this process's transactions time out), `enospc`
    (its writes fail), `corrupt` (garbage over the ledger, put back as it was after)."""

    def __init__(self, kind: str, pool: Pool) -> None:
        self.kind, self.pool = kind, pool
        self.fired = False
        self._lock_fd: int | None = None
        self._saved: bytes | None = None
        self._write = store_module._write_all

    def start(self) -> None:
        self.fired = True
        if self.kind == "lock":
            self._lock_fd = os.open(self.pool.lock_path, os.O_RDONLY)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        elif self.kind == "enospc":

            def full(fd: int, data: bytes) -> None:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            store_module._write_all = full  # type: ignore[assignment]
        else:
            path = Path(self.pool.path)
            self._saved = path.read_bytes()
            path.write_bytes(b"EKVPOOL 1 5 0000\ngarbage written by a test")

    def stop(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        store_module._write_all = self._write  # type: ignore[assignment]
        if self._saved is not None:
            Path(self.pool.path).write_bytes(self._saved)
            self._saved = None


# What a command's post raises while a fault is on: the command's result, not the engine's end.
STORE_FAILURES = (PoolLockTimeout, LedgerCorruptError, OSError)


def refused_by_pid() -> PtraceRefusedError:
    """What a borrow raises where this process may not take the lender's fds by pid
    (pidfd_getfd's EPERM under Yama's ptrace_scope; src/ipc.rs's hint), stood in for."""
    return PtraceRefusedError(
        "stale or foreign loan: cannot take fd 7 of process 1: Import failed: EPERM "
        "(pidfd_getfd: fd 7 of process 1; this process may not trace the owner (Yama "
        "ptrace_scope ...)"
    )


def _main(conn: Any, args: tuple[Any, ...]) -> None:
    engine: Engine | None = None
    try:
        engine = Engine(*args)
        conn.send(("ok", os.getpid()))
        while True:
            if engine.refuse_by_pid:
                engine.idle(conn)
            command, *rest = conn.recv()
            if command == "stop":
                conn.send(("ok",))
                return
            result: Any = None
            try:
                result = _command(engine, command, rest)
            except STORE_FAILURES as error:
                if engine.fault is None or not engine.fault.fired:
                    raise
                result = f"failed: {type(error).__name__}: {error}"
            finally:
                if engine.fault is not None and engine.fault.fired:
                    engine.fault.stop()
                    engine.fault = None
            engine.check()
            conn.send(("ok", result, engine.numbers()))
    except BaseException as error:  # report, so the parent fails with the child's reason
        conn.send(("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


def _command(engine: Engine, command: str, rest: list[Any]) -> Any:
    """Runs one command of the parent's; its result."""
    result: Any = None
    if command == "request":
        result = [(d.action, d.peer, d.blocks) for d in engine.member.request(rest[0])]
    elif command == "grow":
        result = engine.member.grow(rest[0], timeout_s=rest[1])
    elif command == "serve":
        engine.member.serve(busy=engine.used > 0)
    elif command == "serve_for":
        deadline = time.monotonic() + rest[0]
        while time.monotonic() < deadline:
            engine.member.serve(busy=engine.used > 0)
            time.sleep(0.002)
    elif command == "use":
        engine.use(rest[0])
    elif command == "settle":
        engine.settle(rest[0])
    elif command == "leave":
        engine.member.leave(rest[0])
    elif command == "arm":
        engine.arm(rest[0], rest[1])
    return result


@dataclass
class Proc:
    """The parent's handle on an engine process (this module's, or
    `pool_transformers_engine`'s, whose commands take longer: `timeout_s` and `stop_s`)."""

    name: str
    process: Any
    conn: Any
    pid: int = 0
    timeout_s: float = TIMEOUT_S
    stop_s: float = 10.0

    def send(self, *command: Any) -> None:
        self.conn.send(command)

    def reply(self) -> tuple[Any, dict[str, int]]:
        if not self.conn.poll(self.timeout_s):
            raise TimeoutError(f"{self.name} did not answer")
        status, *result = self.conn.recv()
        assert status == "ok", f"{self.name}: {result[0]}"
        return result[0], result[1]

    def __call__(self, *command: Any) -> tuple[Any, dict[str, int]]:
        self.send(*command)
        return self.reply()

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def stop(self) -> None:
        """Asks the engine to stop, waits `stop_s` for it, then kills it."""
        if self.process.is_alive():
            try:
                self.conn.send(("stop",))
            except OSError:
                pass
        self.process.join(timeout=self.stop_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def context() -> Any:
    """A fork server that imported torch and the library once: each engine starts in
    milliseconds, not in a second torch import."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "extensible_kv", "pool_engine"])
    return ctx


def start(
    ctx: Any,
    directory: str,
    pool: str,
    name: str,
    seed: int,
    limits: tuple[int, int] = (4, CAPACITY),
    answer_timeout_s: float = 1.0,
    refuse_by_pid: bool = False,
    lock_timeout_s: float = 5.0,
    layout: str = "kv2",
) -> Proc:
    """Starts engine `name` over a cache of `layout` (`LAYOUTS`); `joined` waits for it to be
    in the pool. With `refuse_by_pid`, the engine may not take others' fds by pid and borrows
    over their sockets."""
    parent, child = ctx.Pipe()
    args = (
        directory,
        pool,
        name,
        seed,
        limits,
        answer_timeout_s,
        refuse_by_pid,
        lock_timeout_s,
        layout,
    )
    process = ctx.Process(target=_main, args=(child, args), daemon=True)
    process.start()
    return Proc(name, process, parent)


def joined(proc: Proc) -> Proc:
    """Waits until `proc` started (and, for a transformers engine, its cache is in the pool)."""
    if not proc.conn.poll(proc.timeout_s):
        raise TimeoutError(f"{proc.name} did not start")
    status, *result = proc.conn.recv()
    assert status == "ok", f"{proc.name}: {result[0]}"
    proc.pid = result[0]
    return proc


# ---------------------------------------------------------------------------------------------
# looking into a process from outside


def memfds(pid: int) -> dict[str, set[int]]:
    """The memfd inodes process `pid` holds: `mapped` (the host backend's memory it maps),
    `held` (fds of its memory), `boards` (fds of loan boards)."""
    mapped: set[int] = set()
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(MEMFD):
                mapped.add(int(parts[4]))
    held: set[int] = set()
    boards: set[int] = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            inode = os.stat(f"/proc/{pid}/fd/{fd}").st_ino
        except OSError:
            continue  # closed meanwhile
        if target.startswith(MEMFD):
            held.add(inode)
        elif target.startswith(BOARD):
            boards.add(inode)
    return {"mapped": mapped, "held": held, "boards": boards}


def mapped_bytes(pid: int) -> int:
    """The bytes of the host backend's memory process `pid` maps (`_proc.mapped_host_bytes`)."""
    return _proc.mapped_host_bytes(pid)
