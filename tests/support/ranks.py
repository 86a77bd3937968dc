"""Running a test's ranks: one spawned process each, on loopback, within a deadline."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    """A free TCP port on loopback, for a process group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def join_group(
    backend: str, rank: int, port: int, world_size: int, timeout_s: float, **kw: Any
) -> None:
    """Joins the default process group of `world_size` ranks rendezvousing on loopback `port`
    (`kw`: e.g. `device_id` for NCCL)."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        **kw,
    )


def run_ranks(main: Callable[..., None], world_size: int, timeout_s: float, *args: Any) -> None:
    """Runs `main(rank, port, *args)` in `world_size` spawned processes and waits for them all
    (a rank that raises fails the caller); whatever still runs at the deadline is killed."""
    import torch.multiprocessing as mp

    context = mp.start_processes(
        main,
        args=(free_port(), *args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1):
            assert time.monotonic() < deadline, "the ranks did not finish in time"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
