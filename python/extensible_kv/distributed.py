"""Agreement across ranks (docs/design.md §5, step 3).

Tensor-parallel ranks each hold a slice of every layer's KV cache and must hand out the same
block ids, so they must commit the same block count: the minimum of what each rank's memory
fits. One `all_reduce(MIN)` of one integer, on a tensor where the group's backend can reduce
it: on the host for gloo (and mpi), on the rank's GPU for nccl.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from extensible_kv import _torch

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

__all__ = ["min_over_group", "reduce_device"]


def reduce_device(group: ProcessGroup | None, device: str | torch.device) -> torch.device:
    """Where a tensor reduced over `group` must live: the host unless the group's backend
    reduces only on GPUs (nccl), then `device` or, for a host cache, the current GPU."""
    _torch.require("reduce_device")
    import torch
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend or "nccl" not in backend:
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        return device
    return torch.device("cuda", torch.cuda.current_device())


def min_over_group(
    value: int, group: ProcessGroup | None, device: str | torch.device = "cpu"
) -> int:
    """The minimum of `value` over the ranks of `group` (the default group if `None`); every
    rank must call it. `device` is this rank's cache device (used by nccl groups)."""
    _torch.require("min_over_group")
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.int64, device=reduce_device(group, device))
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return int(tensor.item())
