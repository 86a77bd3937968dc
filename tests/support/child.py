"""A process of its own for the tests that need another process (sharing, lending, loans of
another layout, kill -9): `Child(main, *args)` spawns `main(conn, *args)`, a small command loop
that answers each command tuple with `("ok", *results)`, or `("error", text)` so that the
parent fails with the child's reason, and ends on `("stop",)`."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

# How long the parent waits for an answer: generous (a first CUDA context, a spawn's imports).
TIMEOUT_S = 120


class Child:
    """The child process running `main(conn, *args)` (spawned: nothing of this process's
    CUDA context or threads is inherited). `child(*command)` sends a command and returns its
    results (a list). Use as a context manager, or `stop()` it."""

    def __init__(self, main: Callable[..., None], *args: Any, timeout_s: float = TIMEOUT_S):
        context = mp.get_context("spawn")
        self.conn, child_conn = context.Pipe()
        self.timeout_s = timeout_s
        self.process = context.Process(target=main, args=(child_conn, *args))
        self.process.start()

    def __call__(self, *command: Any) -> list[Any]:
        self.conn.send(command)
        if not self.conn.poll(self.timeout_s):
            raise TimeoutError(f"the child did not answer {command[0]!r}")
        status, *result = self.conn.recv()
        assert status == "ok", result[0]
        return list(result)

    def kill(self) -> float:
        """kill -9, without reaping it: returns when the signal was sent."""
        assert self.process.pid is not None
        os.kill(self.process.pid, signal.SIGKILL)
        return time.monotonic()

    def stop(self) -> None:
        """Asks the loop to end, and kills the process if it does not within 10 s."""
        if self.process.is_alive():
            try:
                self.conn.send(("stop",))
            except OSError:
                pass
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def __enter__(self) -> Child:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
