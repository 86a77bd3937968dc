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
from pathlib import Path
from typing import Any

import extensible_kv
import pytest
import torch
from support.ranks import join_group, run_ranks

WORLD_SIZE = 2
EXTRA_GIB_ON_RANK_1 = 16
TIMEOUT_S = 240
GIB = 1 << 30


pytestmark = [pytest.mark.multigpu, pytest.mark.gpu(devices=WORLD_SIZE)]


def _spec() -> list[extensible_kv.KVCacheTensorSpec]:
    # 8 layers of a 70B-like TP8 slice: 1 KV head x 128, 16 tokens a block, bf16, K/V split.
    layer = extensible_kv.AttentionLayerSpec("FLASH_ATTN", 16, 1, 128, torch.bfloat16)
    page = 2 * 16 * 1 * 128 * 2
    return [extensible_kv.KVCacheTensorSpec(page, {f"layers.{i}": layer}) for i in range(8)]


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
    join_group("nccl", rank, port, WORLD_SIZE, TIMEOUT_S, device_id=torch.device(device))
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
    run_ranks(_rank_main, WORLD_SIZE, TIMEOUT_S, str(tmp_path))
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


def _peer_main(rank: int, port: int, out_dir: str) -> None:
    """Rank 0 owns an exportable cache on GPU 0; rank 1 maps it on GPU 1 (peer access) through
    `from_shared`, reads and writes it with kernels on its own GPU, follows a grow with
    `refresh`, and times a peer read against a plain cross-GPU copy of the same bytes."""
    import pickle
    import time as clock

    import torch.distributed as dist
    from extensible_kv import ExtensibleTensor

    torch.cuda.set_device(rank)
    join_group("gloo", rank, port, WORLD_SIZE, TIMEOUT_S)
    path = Path(out_dir, "description.pickle")
    per_segment = 4 * GIB
    try:
        if rank == 0:
            owner = ExtensibleTensor(
                2 * 2 * per_segment, 2, "cuda:0", export_handle_types="posix_fd"
            )
            owner.resize_per_segment_(per_segment)
            owner.segment_view(0)[:4096].fill_(7)
            torch.cuda.synchronize()
            path.write_bytes(pickle.dumps(owner.share()))
            dist.barrier()  # 1: rank 1 imports
            dist.barrier()  # 2: rank 1 wrote
            wrote_back = int(owner.segment_view(1)[0].item())
            owner.resize_per_segment_(2 * per_segment)
            owner.segment_view(0)[per_segment : per_segment + 16].fill_(9)
            torch.cuda.synchronize()
            path.write_bytes(pickle.dumps(owner.share()))
            dist.barrier()  # 3: rank 1 refreshes
            dist.barrier()  # 4: rank 1 is done
            Path(out_dir, "rank0.json").write_text(json.dumps({"wrote_back": wrote_back}))
            owner.close()
        else:
            dist.barrier()
            imported = ExtensibleTensor.from_shared(pickle.loads(path.read_bytes()), "cuda:1")
            seen = int(imported.segment_view(0)[:4096].sum().item())  # a kernel on GPU 1
            imported.segment_view(1)[:1].fill_(5)
            torch.cuda.synchronize(1)
            dist.barrier()
            dist.barrier()
            imported.refresh(pickle.loads(path.read_bytes()))
            grown = imported.segment_view(0)[per_segment : per_segment + 16].tolist()
            region = imported.segment_view(0)[:per_segment]
            local = torch.empty(per_segment, dtype=torch.uint8, device="cuda:1")
            remote = torch.empty(per_segment, dtype=torch.uint8, device="cuda:0")

            def best_gbps(fn: Any) -> float:
                fn()
                torch.cuda.synchronize(0)
                torch.cuda.synchronize(1)
                times = []
                for _ in range(5):
                    start = clock.perf_counter()
                    fn()
                    torch.cuda.synchronize(0)
                    torch.cuda.synchronize(1)
                    times.append(clock.perf_counter() - start)
                return per_segment / min(times) / 1e9

            peer = best_gbps(lambda: local.copy_(region))  # a GPU-1 kernel reads GPU-0 memory
            plain = best_gbps(lambda: local.copy_(remote))  # torch's own cross-GPU copy
            result = {
                "seen": seen,
                "grown": grown,
                "peer_read_gbps": peer,
                "plain_copy_gbps": plain,
            }
            del region, local, remote
            imported.close()
            Path(out_dir, "rank1.json").write_text(json.dumps(result))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_rank_maps_another_gpus_kv_memory_and_follows_it(tmp_path: Path) -> None:
    run_ranks(_peer_main, WORLD_SIZE, TIMEOUT_S, str(tmp_path))
    owner = json.loads((tmp_path / "rank0.json").read_text())
    importer = json.loads((tmp_path / "rank1.json").read_text())
    print(json.dumps({"owner": owner, "importer": importer}, indent=1))
    assert importer["seen"] == 7 * 4096  # GPU 1 read what GPU 0 wrote
    assert owner["wrote_back"] == 5  # and GPU 0 reads what GPU 1 wrote
    assert importer["grown"] == [9] * 16  # refresh followed the grow
    assert importer["peer_read_gbps"] > 0 and importer["plain_copy_gbps"] > 0
