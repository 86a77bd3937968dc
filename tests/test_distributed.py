"""Several ranks agree on the block count (docs/design.md §5, step 3): two CPU processes over gloo,
on loopback only, each with its own host budget; both must commit the smaller count."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from extensible_kv.flow import KVCacheFlow
from extensible_kv.kv_cache import AttentionLayerSpec, KVCacheTensorSpec
from support.ranks import join_group, run_ranks

WORLD_SIZE = 2
GRANULARITY = 4096
# 2 KiB per block and segment, 2 segments: each 4 KiB granule pair holds 2 more blocks. A
# budget is in all: the pair the reserve committed counts against it.
BUDGETS = (6 * 2 * GRANULARITY, 10 * 2 * GRANULARITY)
TIMEOUT_S = 60


def _spec() -> list[KVCacheTensorSpec]:
    layer = AttentionLayerSpec("FLASH_ATTN", 16, 2, 32, torch.bfloat16)
    return [KVCacheTensorSpec(2 * 16 * 2 * 32 * 2, {"attn": layer})]


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    """One rank: join the group, reserve, extend to its own budget with the group, write the
    report (and a solo fit without the group, for comparison)."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    join_group("gloo", rank, port, WORLD_SIZE, TIMEOUT_S)
    try:
        with KVCacheFlow.reserve(_spec(), 1000, "cpu", granularity=GRANULARITY) as flow:
            report = flow.extend_to_fit(budget_bytes=BUDGETS[rank], group=dist.group.WORLD)
            result = {
                "fit": report.fit_blocks,
                "after": report.blocks_after,
                "committed": flow.cache.committed_blocks,
            }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_commit_the_minimum(tmp_path: Path) -> None:
    run_ranks(_rank_main, WORLD_SIZE, TIMEOUT_S, str(tmp_path))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    fits = [r["fit"] for r in results]
    # Each budget alone fits a different count (1 block mapped: 2 + 2 per granule pair).
    assert fits == [12, 20]
    assert [r["after"] for r in results] == [12, 12]
    assert [r["committed"] for r in results] == [12, 12]
