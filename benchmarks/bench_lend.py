"""Moving committed memory from process A to process B: the hand-off (lend / borrow) against
the driver's path and a plain release-then-create.

    python3 benchmarks/bench_lend.py --out DIR [--device cuda:0] [--sizes-gib 100 64] [--reps 3]

For each size, in fresh processes A and B for every repetition (medians of `--reps`, ≥ 3
for a report), five ways, each timed from A's first call to B's last (CLOCK_MONOTONIC is one
clock for both processes):
- `handoff_first`: A `lend(0)`s all its memory (exports every handle: the first loan), the
  loan goes to B over a pipe (pickled; fds by pidfd_getfd), B `borrow(zero=False)`s it;
- `handoff_cached`: the same after B gave back and A reclaimed (exports cached);
- `handoff_zeroed`: the cached hand-off with `borrow(zero=True)`;
- `driver_path`: A shrinks to 0 (unmap + release), then B grows (create + map + access);
- `release_create`: torch in A: `del` + `empty_cache()`, then `torch.empty` in B.
And, on CUDA, `handoff_under_load`: the cached hand-off while A replays a CUDA graph in a
loop on its own stream in another thread, lending on that stream (on the host backend this
is skipped, with a message). Reported per way: wall, A's and B's own times, free memory
before and after (B's view), and whether B read A's bytes (a checksum of a sample of
them). Markdown on stdout, DIR/bench_lend.json. On the host backend (`--device cpu`) sizes
are in MiB (`--sizes-mib`, small defaults), for a quick end-to-end run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import threading
import time
from pathlib import Path
from typing import Any

from common import GIB, MIB, environment, log, median

WAYS = ["handoff_first", "handoff_cached", "handoff_zeroed", "driver_path", "release_create"]
SAMPLES = 4096


def _free(device: str) -> int:
    import torch
    from extensible_kv import host_free_bytes

    if device.startswith("cuda"):
        return int(torch.cuda.mem_get_info(device)[0])
    return int(host_free_bytes())


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _checksum(view: Any) -> int:
    """The sum of `SAMPLES` int32 words spread over `view` (a 1-D int32 tensor)."""
    step = max(1, view.numel() // SAMPLES)
    return int(view[::step].sum().item())


class _DecodeLoop:
    """A CUDA graph of a few small matmuls, replayed in a loop on its own stream by a thread:
    a device that is never idle."""

    def __init__(self, device: str) -> None:
        import torch

        self.stream = torch.cuda.Stream(device)
        self.x = torch.randn(1024, 1024, device=device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.stream):
            for _ in range(3):
                self.x @ self.x  # warm-up outside the capture
            self.stream.synchronize()
            with torch.cuda.graph(self.graph, stream=self.stream):
                y = self.x
                for _ in range(8):
                    y = y @ self.x
        self.running = True
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        import torch

        with torch.cuda.stream(self.stream):
            while self.running:
                self.graph.replay()
                self.stream.synchronize()

    def stop(self) -> None:
        self.running = False
        self.thread.join()


def _a_main(conn: Any, device: str, num_bytes: int) -> None:
    """Process A: commands from the parent; each answer carries A's own times."""
    import torch
    from extensible_kv import ExtensibleTensor

    if device.startswith("cuda"):
        torch.zeros(1, device=device)
    tensor: Any = None
    plain: Any = None
    loan: Any = None
    decode: _DecodeLoop | None = None
    while True:
        command, *args = conn.recv()
        if command == "commit":
            tensor = ExtensibleTensor(num_bytes, 1, device, export_handle_types="posix_fd")
            tensor.resize_(num_bytes, zero_new=False)
            view = tensor.full_view(torch.int32)
            view.fill_(7)
            view[:: max(1, view.numel() // SAMPLES)].copy_(
                torch.arange(len(view[:: max(1, view.numel() // SAMPLES)]), dtype=torch.int32)
            )
            _sync(device)
            conn.send((_checksum(view), _free(device)))
            del view
        elif command == "lend":
            stream = None
            if args[0] == "load":
                decode = _DecodeLoop(device)
                time.sleep(0.2)
                stream = decode.stream.cuda_stream
            start = time.monotonic()
            loan = tensor.lend(0, stream=stream)
            conn.send((start, (time.monotonic() - start) * 1e3, loan))
        elif command == "reclaim":
            tensor.reclaim(loan, zero=False, timeout=60)
            if decode is not None:
                decode.stop()
                decode = None
            conn.send(None)
        elif command == "shrink":
            start = time.monotonic()
            tensor.shrink_(0)
            tensor.wait_released()  # the driver's path: the memory is back when B creates
            _sync(device)
            conn.send((start, (time.monotonic() - start) * 1e3))
        elif command == "plain":
            plain = torch.empty(num_bytes, dtype=torch.uint8, device=device)
            plain.fill_(7)
            _sync(device)
            conn.send(_free(device))
        elif command == "release":
            start = time.monotonic()
            plain = None
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            conn.send((start, (time.monotonic() - start) * 1e3))
        elif command == "stop":
            conn.send(None)
            return


def _b_main(conn: Any, device: str, num_bytes: int) -> None:
    """Process B: borrows, grows or creates; answers with its end time and its own ms."""
    import torch
    from extensible_kv import ExtensibleTensor

    if device.startswith("cuda"):
        torch.zeros(1, device=device)
    tensor = ExtensibleTensor(num_bytes, 1, device, export_handle_types="posix_fd")
    loan: Any = None
    while True:
        command, *args = conn.recv()
        if command == "free":
            conn.send(_free(device))
        elif command == "borrow":
            loan, zero = args
            start = time.monotonic()
            tensor.borrow(loan, zero=zero)
            _sync(device)
            end = time.monotonic()
            checksum = _checksum(tensor.full_view(torch.int32))
            conn.send((end, (end - start) * 1e3, checksum, _free(device)))
        elif command == "give_back":
            tensor.give_back(loan)
            _sync(device)
            conn.send(None)
        elif command == "grow":
            start = time.monotonic()
            tensor.resize_(num_bytes, zero_new=False)
            _sync(device)
            end = time.monotonic()
            conn.send((end, (end - start) * 1e3, _free(device)))
            tensor.shrink_(0)
            tensor.wait_released()
        elif command == "create":
            start = time.monotonic()
            created = torch.empty(num_bytes, dtype=torch.uint8, device=device)
            _sync(device)
            end = time.monotonic()
            conn.send((end, (end - start) * 1e3, _free(device)))
            del created
        elif command == "stop":
            tensor.close()
            conn.send(None)
            return


class _Proc:
    def __init__(self, target: Any, device: str, num_bytes: int) -> None:
        context = mp.get_context("spawn")
        self.conn, theirs = context.Pipe()
        self.process = context.Process(target=target, args=(theirs, device, num_bytes))
        self.process.start()

    def __call__(self, *command: Any) -> Any:
        self.conn.send(command)
        if not self.conn.poll(600):
            raise TimeoutError(f"no answer to {command[0]!r}")
        return self.conn.recv()

    def stop(self) -> None:
        self("stop")
        self.process.join(timeout=30)


def _handoff(a: _Proc, b: _Proc, expected: int, *, zero: bool, load: bool) -> dict[str, Any]:
    free_before = b("free")
    start, lend_ms, loan = a("lend", "load" if load else "")
    end, borrow_ms, checksum, free_after = b("borrow", loan, zero)
    b("give_back")
    a("reclaim")
    return {
        "wall_ms": (end - start) * 1e3,
        "a_ms": lend_ms,
        "b_ms": borrow_ms,
        "free_before": free_before,
        "free_after": free_after,
        "checksum_ok": checksum == (0 if zero else expected),
    }


def one_repetition(device: str, num_bytes: int, under_load: bool) -> dict[str, Any]:
    """Every way once, in a fresh pair of processes (a fresh one for the plain path too)."""
    a, b = _Proc(_a_main, device, num_bytes), _Proc(_b_main, device, num_bytes)
    try:
        expected, _ = a("commit")
        res: dict[str, Any] = {}
        res["handoff_first"] = _handoff(a, b, expected, zero=False, load=False)
        res["handoff_cached"] = _handoff(a, b, expected, zero=False, load=False)
        if under_load:
            res["handoff_under_load"] = _handoff(a, b, expected, zero=False, load=True)
        # Last of the hand-offs: B zeroes the memory it borrows, so A reclaims zeros.
        res["handoff_zeroed"] = _handoff(a, b, expected, zero=True, load=False)
        free_before = b("free")
        start, shrink_ms = a("shrink")
        end, grow_ms, free_after = b("grow")
        res["driver_path"] = {
            "wall_ms": (end - start) * 1e3,
            "a_ms": shrink_ms,
            "b_ms": grow_ms,
            "free_before": free_before,
            "free_after": free_after,
            "checksum_ok": None,  # fresh memory: nothing of A's to read
        }
    finally:
        a.stop()
        b.stop()
    a, b = _Proc(_a_main, device, num_bytes), _Proc(_b_main, device, num_bytes)
    try:
        free_before = a("plain")
        start, release_ms = a("release")
        end, create_ms, free_after = b("create")
        res["release_create"] = {
            "wall_ms": (end - start) * 1e3,
            "a_ms": release_ms,
            "b_ms": create_ms,
            "free_before": free_before,
            "free_after": free_after,
            "checksum_ok": None,
        }
    finally:
        a.stop()
        b.stop()
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_lend"))
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--sizes-gib", type=float, nargs="+", default=[100.0, 64.0])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[16.0, 8.0])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)

    on_gpu = args.device.startswith("cuda")
    sizes = (
        [int(s * GIB) for s in args.sizes_gib] if on_gpu else [int(s * MIB) for s in args.sizes_mib]
    )
    if not on_gpu:
        log("host backend: the hand-off under a decode loop needs CUDA graphs; skipped")
    import torch

    results: dict[str, Any] = {
        "environment": environment(torch.device(args.device), reps=args.reps),
        "sizes": {},
    }
    for num_bytes in sizes:
        runs = []
        for rep in range(args.reps):
            log(f"{num_bytes / GIB:.3f} GiB, repetition {rep + 1} of {args.reps}")
            runs.append(one_repetition(args.device, num_bytes, under_load=on_gpu))
        ways = [w for w in [*WAYS, "handoff_under_load"] if w in runs[0]]
        summary = {
            way: {
                "median_wall_ms": median(r[way]["wall_ms"] for r in runs),
                "median_a_ms": median(r[way]["a_ms"] for r in runs),
                "median_b_ms": median(r[way]["b_ms"] for r in runs),
                "checksum_ok": [r[way]["checksum_ok"] for r in runs],
                "runs": [r[way] for r in runs],
            }
            for way in ways
        }
        results["sizes"][str(num_bytes)] = summary
        title = f"{num_bytes / GIB:.3f} GiB from A to B ({args.device}, medians of {args.reps})"
        print(f"\n### {title}")
        print("| way | wall ms | A ms | B ms | B read A's bytes |")
        print("|---|---|---|---|---|")
        for way, row in summary.items():
            ok = row["checksum_ok"]
            read = "n/a" if ok[0] is None else ("yes" if all(ok) else f"NO {ok}")
            print(
                f"| {way} | {row['median_wall_ms']:.2f} | {row['median_a_ms']:.2f} | "
                f"{row['median_b_ms']:.2f} | {read} |"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_lend.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
