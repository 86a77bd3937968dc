"""Tensor parallel on several GPUs of one host (docs/design.md §5, step 3): one process per GPU,
torch.distributed over NCCL. Each rank reserves its KV cache, captures a CUDA graph that writes
a block, extends to fit with `group=`, and replays the graph into a block that did not exist
at capture. Rank 1 starts with less free memory (it holds an extra allocation), so the ranks'
own fits differ; both must commit the smaller, log the same line and report the same blocks.

Marked `multigpu`: skipped (with the reason) unless two CUDA devices with VMM support are
visible; `scripts/gpu-check multi` runs it on the 2-GPU machine.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import extensible_kv
import pytest
import torch

WORLD_SIZE = 2
EXTRA_GIB_ON_RANK_1 = 16
TIMEOUT_S = 240
GIB = 1 << 30


def _skip_reason() -> str | None:
    if torch.cuda.device_count() < WORLD_SIZE:
        return f"needs {WORLD_SIZE} CUDA devices, {torch.cuda.device_count()} visible"
    for rank in range(WORLD_SIZE):
        reason = extensible_kv.vmm_unavailable_reason(f"cuda:{rank}")
        if reason is not None:
            return reason
    return None


pytestmark = [
    pytest.mark.multigpu,
    pytest.mark.gpu,
    pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or ""),
]


def _spec() -> list[extensible_kv.KVCacheTensorSpec]:
    # 8 layers of a 70B-like TP8 slice: 1 KV head x 128, 16 tokens a block, bf16, K/V split.
    layer = extensible_kv.AttentionLayerSpec("FLASH_ATTN", 16, 1, 128, torch.bfloat16)
    page = 2 * 16 * 1 * 128 * 2
    return [extensible_kv.KVCacheTensorSpec(page, {f"layers.{i}": layer}) for i in range(8)]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from extensible_kv import KVCacheFlow, capacity_blocks_for

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on shared hosts
    torch.cuda.set_device(rank)
    device = f"cuda:{rank}"
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=TIMEOUT_S),
        device_id=torch.device(device),
    )
    lines = _Lines()
    logging.getLogger("extensible_kv").addHandler(lines)
    logging.getLogger("extensible_kv").setLevel(logging.INFO)
    extra = None
    try:
        if rank == 1:
            extra = torch.empty(EXTRA_GIB_ON_RANK_1 * GIB, dtype=torch.uint8, device=device)
        total = torch.cuda.mem_get_info(device)[1]
        spec = _spec()
        capacity = capacity_blocks_for(total, spec, granularity=2 << 20)
        with KVCacheFlow.reserve(spec, capacity, device) as flow:
            kv = flow.cache.views["layers.0"]
            assert isinstance(kv, torch.Tensor)
            block = torch.zeros(1, dtype=torch.int64, device=device)
            value = torch.full((1,), 7.0, dtype=torch.bfloat16, device=device)
            # Warm up, then capture a write of K and V of one block into the capacity view.
            stream = torch.cuda.Stream(device)
            with torch.cuda.stream(stream):
                kv[:, block].fill_(0)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    kv.index_fill_(1, block, value)
            torch.cuda.synchronize(device)
            report = flow.extend_to_fit(group=dist.group.WORLD)
            last = report.blocks_after - 1
            block.fill_(last)
            graph.replay()
            torch.cuda.synchronize(device)
            landed = bool(kv[:, last].eq(7).all())
            untouched = not bool(kv[:, last - 1].any())
            result = {
                "fit": report.fit_blocks,
                "after": report.blocks_after,
                "committed": flow.cache.committed_blocks,
                "bytes_after": report.bytes_after,
                "handles_after": report.handles_after,
                "commit_ms": report.commit_ms,
                "free_bytes": report.free_bytes,
                "lines": lines.lines,
                "graph_wrote_the_new_block": landed,
                "neighbour_untouched": untouched,
            }
            del kv, graph
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        del extra
        dist.destroy_process_group()


def test_two_nccl_ranks_commit_the_minimum_and_replay_their_graphs(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    context = mp.start_processes(
        _rank_main,
        args=(_free_port(), str(tmp_path)),
        nprocs=WORLD_SIZE,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=1):
            assert time.monotonic() < deadline, "the ranks did not finish in time"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    print(json.dumps(results, indent=1))
    fits = [r["fit"] for r in results]
    # Rank 1's extra allocation leaves it room for fewer blocks.
    assert fits[1] < fits[0]
    assert [r["after"] for r in results] == [min(fits)] * WORLD_SIZE
    assert [r["committed"] for r in results] == [min(fits)] * WORLD_SIZE
    assert results[0]["lines"] == results[1]["lines"]
    assert results[0]["lines"][-1].startswith(f"Extended KV cache to {min(fits)} blocks")
    assert all(r["graph_wrote_the_new_block"] and r["neighbour_untouched"] for r in results)
