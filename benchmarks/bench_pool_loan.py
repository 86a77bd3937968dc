"""One large loan through the node pool: a bursting engine gets `--loan-gib` from an idle
donor that uses `--live-gib` of its cache (issue 37's second target: 60 GiB in <= 50 ms with at
most 10 GiB live), by loan and through the driver, in fresh processes each repetition.

    python3 benchmarks/bench_pool_loan.py --out DIR [--device cuda:0] [--reps 3]

**The engines.** Two processes (spawned), each a `PoolMember` of one pool over an
`ExtensibleKVCache` of one block-major buffer (FLASHINFER: one prefix, as transformers' cache
is one buffer) with 2 MiB blocks (512 tokens of 8 KV heads of 128, bf16: the bytes of 16 tokens
of an 8B model's 32 layers), on the device's granule. The donor commits `--live-gib` +
`--loan-gib` and writes a pattern into its lowest `--live-gib` (the live blocks), then idles:
it serves the pool every `--idle-serve-ms` (20 ms: an idle transformers engine's pace,
`extensible_kv.transformers.pooled.IDLE_SERVE_S`), as an engine with nothing to run does. The
needy engine starts at `--min-gib`. The pool's share of the device is what the two hold, so
the needy engine's memory can only come from the donor.

**What is timed.** The needy engine calls `PoolMember.grow(loan blocks)`; the time is from the
call to its return with every block committed (its own clock): the ask posted in the ledger,
the donor's next serve (up to one idle period later), its answer (lend: unmap the handles,
exported unless they were already, or `via="driver"`: shrink and wait for the release), the
needy engine's next serve (borrow: import, map, zero on its stream; or create through the
driver). `first`: the donor's first loan (its handles exported ahead at its idle serves while
the needy engine started, `PoolMember._export_ahead`; `unexported` in the JSON says how many
were not yet); `again`: after the needy engine gave the loan back (`settle`) and the donor
reclaimed it, the same grow. Each repetition checks that the donor's
live blocks kept their pattern and that the needy engine reads zeros in a sample of what it got.
Then (by loan) `kill -9` of the needy engine holding the loan: the time until the kernel has
ended it (`dead`: a CUDA process's teardown; nobody can see it dead before), to a consistent
ledger (the parent polls; every transaction reaps dead engines, the parent's or the donor's
serve, whichever comes first; `rules.check` finds nothing) and to the donor's cache being whole
again (its reclaim, at its next serve; it may come before the parent's poll sees the ledger).

Markdown on stdout, DIR/bench_pool_loan.json. On the host backend (`--device cpu`) the sizes
are MiB (`--live-mib` ...), for a smoke run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import GIB, MIB, environment, log, median

VIAS = ("loan", "driver")
TOKENS = 512  # a block: 512 tokens x 8 heads x 128 x bf16 x (K, V) = 2 MiB
SAMPLES = 4096


def _spec(host: bool) -> tuple[Any, int]:
    import torch
    from extensible_kv import AttentionLayerSpec, KVCacheTensorSpec

    tokens = 8 if host else TOKENS  # a 16 KiB block on the host: MiB sizes, many blocks
    layer = AttentionLayerSpec("FLASHINFER", tokens, 8, 128, torch.bfloat16)
    block_bytes = 2 * tokens * 8 * 128 * 2
    return (KVCacheTensorSpec(block_bytes, {"attn": layer}),), block_bytes


def _engine_main(conn: Any, role: str, config: dict[str, Any]) -> None:
    """An engine: its cache, its member, and commands from the parent between its serves."""
    try:
        import torch
        from extensible_kv import ExtensibleKVCache
        from extensible_kv.pool import Pool, PoolMember

        device, via = config["device"], config["via"]
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
            torch.zeros(1, device=device)
        spec, _ = _spec(not device.startswith("cuda"))
        blocks = config["blocks"]
        capacity = blocks["donor"] if role == "donor" else blocks["min"] + blocks["loan"]
        cache = ExtensibleKVCache(
            spec,
            capacity,
            device,
            granularity=config["granularity"],
            export_handle_types="posix_fd" if via == "loan" else 0,
        )
        view = cache.views["attn"]
        assert isinstance(view, torch.Tensor)
        live = blocks["live"] if role == "donor" else 0
        # A loan is whole handles: commit in steps (a handle each, per buffer), as a pool
        # engine does (`commit_step_blocks`).
        target = blocks["donor"] if role == "donor" else blocks["min"]
        while cache.committed_blocks < target:
            cache.commit(min(target, cache.committed_blocks + blocks["step"]))
        used = cache.committed_blocks if role == "needy" else live
        # The live blocks: a value everywhere, and a mark in a sample of them.
        every = max(1, live // SAMPLES)
        marks = torch.arange(len(range(0, live, every)), device=device, dtype=torch.bfloat16) % 200
        if live:
            view[:live].fill_(3.0)
            view[:live:every, 0, 0, 0, 0] = marks
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        full_at: list[float] = []  # when the cache last grew to its full size (a reclaim)

        def resized(committed: int) -> None:
            if committed >= capacity:
                full_at.append(time.monotonic())

        member = PoolMember(
            Pool(config["pool"], directory=config["directory"]),
            role,
            cache,
            min_blocks=blocks["min"] if role == "needy" else live,
            max_blocks=capacity,
            free_tail_blocks=lambda: cache.committed_blocks - used,
            answer_timeout_s=5.0,
            take_timeout_s=5.0,
            commit_step_blocks=blocks["step"],
            on_resize=resized,
            via=via,
        )
        member.join()
        conn.send(("ok", None))
        idle_s = config["idle_serve_ms"] / 1e3
        next_serve = time.monotonic() + idle_s
        while True:
            # Serves every idle period whatever the parent asks meanwhile.
            if not conn.poll(max(0.0, next_serve - time.monotonic())):
                member.serve(busy=False)
                next_serve = time.monotonic() + idle_s
                continue
            command, *args = conn.recv()
            if command == "stop":
                used = min(used, blocks["min"])  # what it borrowed goes back as it leaves
                member.leave(timeout_s=30.0)
                del view
                cache.close()
                conn.send(("ok", None))
                return
            if command == "grow":
                start = time.monotonic()
                got = member.grow(args[0], timeout_s=30.0)
                ms = (time.monotonic() - start) * 1e3
                used = cache.committed_blocks
                grown = view[blocks["min"] : got]
                step = max(1, len(grown) // SAMPLES)
                sample = grown[::step, :, -1, -1]  # a row of each sampled block's K and V
                zeros = bool((sample == 0).all().item()) if len(grown) else False
                del grown, sample
                conn.send(("ok", {"ms": ms, "committed": got, "zeros": zeros}))
            elif command == "settle":
                used = blocks["min"]
                member.settle(timeout_s=30.0)
                conn.send(("ok", cache.committed_blocks))
            elif command == "check":
                kept = bool(torch.equal(view[:live:every, 0, 0, 0, 0], marks))
                kept = kept and bool((view[:live:every, 1, -1, -1] == 3.0).all().item())
                full = full_at[-1] if full_at else None
                unexported = sum(t._export_ahead(0) for t in cache.buffers)
                conn.send(
                    (
                        "ok",
                        {
                            "kept": kept,
                            "committed": cache.committed_blocks,
                            "full_at": full,
                            "unexported": unexported,
                        },
                    )
                )
    except BaseException as error:  # the parent fails with the child's reason
        import traceback

        conn.send(("error", f"{role}: {error!r}\n{traceback.format_exc()}"))


class _Engine:
    def __init__(self, context: Any, role: str, config: dict[str, Any]) -> None:
        self.role = role
        self.conn, theirs = context.Pipe()
        self.process = context.Process(target=_engine_main, args=(theirs, role, config))
        self.process.start()

    def answer(self, timeout_s: float = 300.0) -> Any:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"{self.role} did not answer")
        status, result = self.conn.recv()
        if status != "ok":
            raise RuntimeError(result)
        return result

    def __call__(self, *command: Any) -> Any:
        self.conn.send(command)
        return self.answer()

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self("stop")
            except (OSError, EOFError, RuntimeError, TimeoutError) as error:
                log(f"{self.role} did not stop cleanly: {error}")
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()


def one_repetition(args: argparse.Namespace, via: str, blocks: dict[str, int]) -> dict[str, Any]:
    """The first grow and the grow again, in fresh processes and a fresh pool."""
    from extensible_kv.pool import Pool

    unit = GIB if args.device.startswith("cuda") else MIB
    with tempfile.TemporaryDirectory(prefix="ekv-pool-loan-") as directory:
        pool = Pool("bench-pool-loan", directory=directory)
        _, block_bytes = _spec(unit == MIB)
        pool.set_cap(args.device, (blocks["donor"] + blocks["min"]) * block_bytes)
        config = {
            "device": args.device,
            "via": via,
            "granularity": args.granularity,
            "blocks": blocks,
            "pool": "bench-pool-loan",
            "directory": directory,
            "idle_serve_ms": args.idle_serve_ms,
        }
        context = mp.get_context("spawn")
        donor = _Engine(context, "donor", config)
        needy: _Engine | None = None
        try:
            donor.answer()
            needy = _Engine(context, "needy", config)
            needy.answer()
            unexported = donor("check")["unexported"]
            first = needy("grow", blocks["loan"])
            first["unexported"] = unexported
            first["donor"] = donor("check")
            needy("settle")
            again = None
            if via == "loan":
                # The donor takes its loan back at its serves; then the same grow again.
                deadline = time.monotonic() + 30
                while donor("check")["committed"] < blocks["donor"]:
                    if time.monotonic() > deadline:
                        raise TimeoutError("the donor did not reclaim its loan in 30 s")
                    time.sleep(args.idle_serve_ms / 1e3)
                again = needy("grow", blocks["loan"])
                again["donor"] = donor("check")
                killed = kill_9(pool, donor, needy, blocks, args.idle_serve_ms)
                needy = None
        finally:
            if needy is not None:
                needy.stop()
            donor.stop()
    return {"first": first, "again": again, "kill_9": killed if via == "loan" else None}


def kill_9(
    pool: Any, donor: _Engine, needy: _Engine, blocks: dict[str, int], idle_ms: float
) -> Any:
    """`kill -9` of the needy engine while it holds the loan: the time to a consistent ledger
    (the next transaction reaps it: the parent's, polling), and to the donor's reclaim (at its
    next serve: its handles mapped again, zeroed)."""
    from extensible_kv.pool import rules

    killed = time.monotonic()
    needy.process.kill()
    dead = None
    while True:
        # The kernel ends the process (a CUDA context's teardown) before anyone can see it
        # dead: that first, then the ledger (whoever's transaction reaps it: this poll, or the
        # donor's serve).
        if dead is None and _ended(needy.process.pid):
            dead = time.monotonic()
        ledger = pool.snapshot()
        if "needy" not in ledger.engines:
            break
        if time.monotonic() - killed > 30:
            raise TimeoutError("the ledger did not reap the killed engine in 30 s")
    consistent = time.monotonic()
    while dead is None:  # the ledger saw it first (the donor's serve reaped it)
        if _ended(needy.process.pid):
            dead = time.monotonic()
    problems = rules.check(ledger)
    while (check := donor("check"))["committed"] < blocks["donor"]:
        if time.monotonic() - killed > 30:
            raise TimeoutError("the donor did not reclaim its loan in 30 s")
        time.sleep(idle_ms / 1e3)
    return {
        "dead_ms": (dead - killed) * 1e3,
        "ledger_ms": (consistent - killed) * 1e3,
        "ledger_problems": problems,
        "reclaimed_ms": (check["full_at"] - killed) * 1e3,
        "live_kept": check["kept"],
    }


def _ended(pid: int) -> bool:
    """Whether the kernel has ended process `pid` (a zombie, or gone): what the ledger's
    liveness check can see."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] in "ZX"
    except FileNotFoundError:
        return True


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_pool_loan"))
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--vias", nargs="+", default=list(VIAS), choices=VIAS)
    parser.add_argument("--loan-gib", type=float, default=60.0)
    parser.add_argument("--live-gib", type=float, default=10.0)
    parser.add_argument("--min-gib", type=float, default=1.0)
    parser.add_argument("--loan-mib", type=float, default=24.0)
    parser.add_argument("--live-mib", type=float, default=4.0)
    parser.add_argument("--min-mib", type=float, default=1.0)
    parser.add_argument("--step-gib", type=float, default=1.0, help="a commit step, a handle")
    parser.add_argument("--step-mib", type=float, default=1.0)
    parser.add_argument("--granularity", type=int, help="the caches' granule (the device's)")
    parser.add_argument("--idle-serve-ms", type=float, default=20.0)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    import torch

    gpu = args.device.startswith("cuda")
    unit, name = (GIB, "GiB") if gpu else (MIB, "MiB")
    if not gpu and args.granularity is None:
        args.granularity = 64 << 10
    _, block_bytes = _spec(not gpu)
    sizes = (
        (args.loan_gib, args.live_gib, args.min_gib, args.step_gib)
        if gpu
        else (args.loan_mib, args.live_mib, args.min_mib, args.step_mib)
    )
    loan, live, least, step = (int(s * unit) // block_bytes for s in sizes)
    blocks = {"loan": loan, "live": live, "min": least, "donor": live + loan, "step": step}
    results: dict[str, Any] = {
        "environment": environment(torch.device(args.device), reps=args.reps),
        "settings": {
            **{k: str(v) for k, v in vars(args).items()},
            "blocks": blocks,
            "block_bytes": block_bytes,
        },
        "vias": {},
    }
    print(
        f"\n### {loan * block_bytes / unit:.1f} {name} from an idle donor with "
        f"{live * block_bytes / unit:.1f} {name} live ({args.device}, donor serving every "
        f"{args.idle_serve_ms:g} ms, medians of {args.reps})"
    )
    print(
        "| via | grow ms (first loan) | not exported ahead | grow ms (again) | got all | zeros | "
        "live kept | kill -9: dead ms | kill -9: ledger ms | kill -9: reclaimed ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    ok = True
    for via in args.vias:
        runs = []
        for rep in range(args.reps):
            log(f"{via}: repetition {rep + 1} of {args.reps}")
            runs.append(one_repetition(args, via, blocks))
        rows = [r for run in runs for r in (run["first"], run["again"]) if r is not None]
        got = all(r["committed"] >= least + loan for r in rows)
        zeros = all(r["zeros"] for r in rows)
        kills = [run["kill_9"] for run in runs if run["kill_9"] is not None]
        kept = all(r["donor"]["kept"] for r in rows) and all(k["live_kept"] for k in kills)
        clean = all(not k["ledger_problems"] for k in kills)
        ok = ok and got and zeros and kept and clean
        summary = {
            "median_first_ms": median(run["first"]["ms"] for run in runs),
            "median_again_ms": (
                median(run["again"]["ms"] for run in runs) if runs[0]["again"] else None
            ),
            "got_all": got,
            "zeros": zeros,
            "live_kept": kept,
            "kill_9_dead_ms": max((k["dead_ms"] for k in kills), default=None),
            "kill_9_ledger_ms": max((k["ledger_ms"] for k in kills), default=None),
            "kill_9_reclaimed_ms": max((k["reclaimed_ms"] for k in kills), default=None),
            "kill_9_ledger_problems": [p for k in kills for p in k["ledger_problems"]],
            "runs": runs,
        }
        results["vias"][via] = summary
        again = summary["median_again_ms"]
        unexported = (
            f"{max(run['first']['unexported'] for run in runs)} handles" if via == "loan" else "n/a"
        )
        ledger_ms, reclaimed_ms = summary["kill_9_ledger_ms"], summary["kill_9_reclaimed_ms"]
        print(
            f"| {via} | {summary['median_first_ms']:.1f} | "
            f"{unexported} | {_ms(again)} | "
            f"{'yes' if got else 'NO'} | {'yes' if zeros else 'NO'} | "
            f"{'yes' if kept else 'NO'} | {_ms(summary['kill_9_dead_ms'])} | "
            f"{_ms(ledger_ms)}{'' if clean else ' (PROBLEMS)'} | "
            f"{_ms(reclaimed_ms)} |"
        )
    print(
        "\nkill -9 columns: the most of the repetitions, from the kill of the needy engine "
        "holding the loan (after `again`)"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_pool_loan.json").write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
