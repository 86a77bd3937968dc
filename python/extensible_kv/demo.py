"""The main job: a segmented tensor growing in lockstep.

Reserves address space for two K/V-style segments, commits a little, writes a marker, commits
much more, and shows that the marker survived, the new bytes read zero, the addresses never
moved, and how many physical handles the commit cost. Runs on the GPU when CUDA VMM works, on
the host backend otherwise.
"""

from __future__ import annotations

import time

from extensible_kv import ExtensibleTensor, vmm_unavailable_reason

GIB = 1 << 30
MIB = 1 << 20


def pick_device(requested: str | None) -> str:
    if requested:
        return requested
    return "cuda:0" if vmm_unavailable_reason("cuda:0") is None else "cpu"


def _fmt(num_bytes: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if num_bytes >= size:
            return f"{num_bytes / size:.4g} {unit}"
    return f"{num_bytes} B"


def run(
    device: str | None = None, capacity_bytes: int = 2 * GIB, grow_bytes: int = 256 * MIB
) -> int:
    import torch

    device = pick_device(device)
    reason = vmm_unavailable_reason("cuda:0")
    print(f"device: {device}" + (f"  (CUDA unavailable: {reason})" if device == "cpu" else ""))
    with ExtensibleTensor(capacity_bytes, num_segments=2, device=device) as tensor:
        print(
            f"reserved {_fmt(tensor.capacity_bytes)} at {tensor.base_ptr:#x} in "
            f"{tensor.num_segments} segments of {_fmt(tensor.segment_capacity_bytes)}, "
            f"backend {tensor.backend}, granularity {_fmt(tensor.granularity)}"
        )
        block_bytes = 16 * 8 * 128 * 2  # one 16-token bf16 block of 8 heads x 128
        tensor.resize_per_segment_(block_bytes)
        views = [tensor.segment_view(i) for i in range(tensor.num_segments)]
        for i, view in enumerate(views):
            view.fill_(0x11 * (i + 1))
        capacity_view = tensor.full_view()
        base = capacity_view.data_ptr()
        print(_state("committed one block", tensor))

        start = time.perf_counter()
        tensor.resize_per_segment_(grow_bytes)
        if device != "cpu":
            torch.cuda.synchronize(device)
        elapsed_ms = (time.perf_counter() - start) * 1e3
        print(_state(f"grew to {_fmt(grow_bytes)} per segment in {elapsed_ms:.2f} ms", tensor))

        ok = capacity_view.data_ptr() == base
        for i, marker in enumerate(views):
            grown = tensor.segment_view(i)
            kept = bool((grown[:block_bytes] == 0x11 * (i + 1)).all())
            zeroed = bool((grown[block_bytes:] == 0).all())
            ok &= kept and zeroed and marker.data_ptr() == grown.data_ptr()
            print(f"segment {i}: first block kept={kept}, new bytes zero={zeroed}")
        print(f"addresses unchanged: {'yes' if capacity_view.data_ptr() == base else 'no'}")
        del views, view, capacity_view, marker, grown  # close() refuses while views live
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


def _state(what: str, tensor: ExtensibleTensor) -> str:
    return (
        f"{what}: {_fmt(tensor.bytes_per_segment)} per segment, "
        f"{_fmt(tensor.physical_bytes)} mapped in {tensor.num_handles} handle(s)"
    )
