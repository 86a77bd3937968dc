"""Sharing a KV cache between two processes on one GPU: what exporting and importing cost.

    python3 benchmarks/bench_ipc.py --out DIR [--gib 120]

The owner commits `--gib` GiB (default handle policy, POSIX fd export asked at creation) in
two segments and times `share()` twice: the first exports every handle (cuMemExportTo-
ShareableHandle, once per handle), the second reuses the exports. A spawned child times
`ExtensibleTensor.from_shared()` (pidfd_getfd + import + map + access per handle) and a
`refresh()` after the owner grew by 1 GiB a segment, checks a byte the owner wrote, and
reports how much free memory its import took (it should take none: the memory is the
owner's). Prints a markdown table and writes DIR/bench_ipc.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any

from common import GIB

DEVICE = "cuda:0"


def _child(conn: Any) -> None:
    import torch
    from extensible_kv import ExtensibleTensor

    torch.zeros(1, device=DEVICE)
    description = conn.recv()
    free_before = torch.cuda.mem_get_info()[0]
    start = time.perf_counter()
    imported = ExtensibleTensor.from_shared(description)
    import_ms = (time.perf_counter() - start) * 1e3
    free_taken = free_before - torch.cuda.mem_get_info()[0]
    first = int(imported.full_view()[0].item())
    conn.send((import_ms, free_taken, first, imported.num_handles))
    grown = conn.recv()
    start = time.perf_counter()
    imported.refresh(grown)
    refresh_ms = (time.perf_counter() - start) * 1e3
    conn.send((refresh_ms, imported.num_handles))
    conn.recv()
    imported.close()
    conn.send("closed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_ipc"))
    parser.add_argument("--gib", type=float, default=120.0)
    args = parser.parse_args(argv)

    import torch
    from extensible_kv import ExtensibleTensor, vmm_unavailable_reason

    if (reason := vmm_unavailable_reason(DEVICE)) is not None:
        print(f"no CUDA VMM device: {reason}", file=sys.stderr)
        return 2
    per_segment = int(args.gib / 2 * GIB) // (2 << 20) * (2 << 20)
    owner = ExtensibleTensor(2 * (per_segment + 2 * GIB), 2, DEVICE, export_handle_types="posix_fd")
    start = time.perf_counter()
    owner.resize_per_segment_(per_segment)
    torch.cuda.synchronize()
    grow_ms = (time.perf_counter() - start) * 1e3
    owner.full_view()[0] = 42
    torch.cuda.synchronize()
    start = time.perf_counter()
    description = owner.share()
    first_share_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    owner.share()
    again_share_ms = (time.perf_counter() - start) * 1e3
    handles = len(description.handles)

    context = mp.get_context("spawn")
    conn, child_conn = context.Pipe()
    child = context.Process(target=_child, args=(child_conn,))
    child.start()
    conn.send(description)
    import_ms, free_taken, first, child_handles = conn.recv()
    owner.resize_per_segment_(per_segment + GIB)
    torch.cuda.synchronize()
    start = time.perf_counter()
    grown = owner.share()
    grown_share_ms = (time.perf_counter() - start) * 1e3
    conn.send(grown)
    refresh_ms, refreshed_handles = conn.recv()
    conn.send("close")
    conn.recv()
    child.join(timeout=30)
    owner.close()

    res = {
        "committed_bytes": 2 * per_segment,
        "handles": handles,
        "grow_ms": grow_ms,
        "first_share_ms": first_share_ms,
        "export_ms_per_handle": first_share_ms / handles,
        "again_share_ms": again_share_ms,
        "from_shared_ms": import_ms,
        "import_ms_per_handle": import_ms / handles,
        "free_taken_by_import_bytes": free_taken,
        "byte_seen_by_child": first,
        "child_handles": child_handles,
        "grown_share_ms": grown_share_ms,
        "refresh_ms": refresh_ms,
        "handles_after_refresh": refreshed_handles,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_ipc.json").write_text(json.dumps(res, indent=2))
    print(
        f"### Sharing {2 * per_segment / GIB:.0f} GiB ({handles} handles) with a second process\n"
    )
    print("| step | ms | per handle |")
    print("|---|---|---|")
    print(f"| grow (owner, zeroed) | {grow_ms:.1f} | |")
    print(f"| first share() (exports) | {first_share_ms:.1f} | {first_share_ms / handles:.3f} ms |")
    print(f"| share() again (cached exports) | {again_share_ms:.2f} | |")
    print(f"| from_shared() in the child | {import_ms:.1f} | {import_ms / handles:.3f} ms |")
    print(f"| share() after +2 GiB, then refresh() | {grown_share_ms:.1f} + {refresh_ms:.1f} | |")
    print(
        f"\nThe child read {first} (the owner wrote 42); its import took "
        f"{free_taken / GIB:.2f} GiB of free memory (the memory is counted once); handles: "
        f"{child_handles} -> {refreshed_handles} after the refresh."
    )
    print(f"\nJSON: {args.out / 'bench_ipc.json'}")
    return 0 if first == 42 and free_taken < GIB else 1


if __name__ == "__main__":
    sys.exit(main())
