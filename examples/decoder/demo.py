"""The seed's main job, now an example (`python -m decoder` from `examples/`): the extensible
flow end to end, checked.

A small decoder-only transformer (`decoder.model`, seeded random weights, paged
attention in plain torch) greedy-decodes a few sequences twice, with the same inputs:

1. on an extensible cache: reserve a capacity from an estimate, commit one block, warm up and
   capture the decode step in a CUDA graph (GPU; eager on the host backend), extend to fit
   (GPU: the free memory the driver reports, less the margin; host: a given budget), then
   decode by replaying the graph, into blocks that were not committed when it was captured;
2. on a legacy cache of the same spec, allocated in full up front (the blocks this decode
   needs), with the same recipe: warm-up, capture, replay.

Blocks are handed out spread over the whole committed range, the last committed block
included, so the first decode writes and reads memory that the extension mapped after the
capture (on the host backend, touching anything unmapped would be a SIGSEGV). The token ids
must be identical, and the first run must have used such blocks. It prints a short report
ending in `identical: yes`, or `identical: no` (exit status 1).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from extensible_kv import sizing, vmm_unavailable_reason
from extensible_kv.flow import ExtendReport, KVCacheFlow
from extensible_kv.kv_cache import KVCacheTensorSpec

from decoder.config import ModelConfig
from decoder.model import DecodeInputs, DecoderModel, LayerCache

__all__ = [
    "DemoOptions",
    "DemoResult",
    "PathResult",
    "failure_reason",
    "format_report",
    "pick_device",
    "run",
]

GIB = 1 << 30
MIB = 1 << 20
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
HOST_ESTIMATE_BYTES = GIB  # the host's first estimate: address space only, nothing committed


@dataclass(frozen=True)
class DemoOptions:
    """What to run. `None` picks per device: cuda:0 when usable; bf16 on a GPU, fp32 on the
    host; a capacity estimate of the device's memory (GPU) or 1 GiB (host). `budget_mib` is the
    host backend's budget, in all; `None` measures it as the flow does on a GPU, from
    `host_free_bytes()` (the figure the host backend checks commits against) less the margin.
    `max_blocks` caps the commit (default: commit the fit). `model` is the decoder's shape and
    seed."""

    device: str | None = None
    layout: str = "FLASH_ATTN"
    model: ModelConfig = field(default_factory=ModelConfig)
    num_seqs: int = 4
    prompt_len: int = 8
    steps: int = 40
    dtype: str | None = None
    budget_mib: int | None = 64
    max_blocks: int | None = None
    capacity_gib: float | None = None
    granularity: int | None = None

    def updated(self, **changes: Any) -> DemoOptions:
        """These options with `changes`, flat as the command line gives them: a name of a
        `ModelConfig` field changes the model, any other an option."""
        names = {f.name for f in fields(ModelConfig)}
        model = {k: v for k, v in changes.items() if k in names}
        rest = {k: v for k, v in changes.items() if k not in names}
        return replace(self, model=replace(self.model, **model), **rest)


@dataclass(frozen=True)
class PathResult:
    """One decode: its tokens and how its cache was sized."""

    tokens: list[list[int]]
    report: ExtendReport
    capacity_blocks: int
    num_segments: tuple[int, ...]
    backend: str
    granularity: int | None
    graph_captured: bool
    replays: int
    blocks_used: tuple[int, ...]  # every block the decode wrote, null block aside
    blocks_mapped_at_reserve: int  # blocks whose bytes the initial commit's granules held

    @property
    def blocks_in_new_memory(self) -> int:
        """Blocks the decode used whose memory was mapped by the extension."""
        return sum(block >= self.blocks_mapped_at_reserve for block in self.blocks_used)


@dataclass(frozen=True)
class DemoResult:
    options: DemoOptions
    device: str
    dtype: torch.dtype
    block_size: int
    blocks_needed: int
    estimate_bytes: int
    block_bytes: int
    extensible: PathResult
    legacy: PathResult
    cuda_note: str | None = None

    @property
    def identical(self) -> bool:
        return self.extensible.tokens == self.legacy.tokens

    @property
    def used_new_blocks(self) -> bool:
        """Whether the decode wrote blocks whose memory the extension mapped, after the step
        was captured."""
        return self.extensible.blocks_in_new_memory > 0

    @property
    def ok(self) -> bool:
        return self.identical and self.used_new_blocks


@dataclass(frozen=True)
class _Workload:
    prompts: list[list[int]]
    total_len: int
    block_size: int
    hybrid: bool

    @property
    def max_blocks_per_seq(self) -> int:
        return math.ceil((self.total_len - 1) / self.block_size)  # the last token is not fed

    @property
    def blocks_needed(self) -> int:
        """The null block, every sequence's blocks, and a state slot each if hybrid."""
        per_seq = self.max_blocks_per_seq + (1 if self.hybrid else 0)
        return 1 + len(self.prompts) * per_seq


def pick_device(requested: str | None) -> str:
    if requested:
        return requested
    usable = vmm_unavailable_reason("cuda:0") is None and torch.cuda.is_available()
    return "cuda:0" if usable else "cpu"


def run(options: DemoOptions | None = None) -> DemoResult:
    """Both decodes, as the module doc describes; raises if the cache holds too few blocks."""
    options = options or DemoOptions()
    device = torch.device(pick_device(options.device))
    dtype = DTYPES[options.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    model = DecoderModel(options.model, device, dtype)
    spec = model.kv_cache_spec(options.layout)
    work = _workload(options, model.block_size, model.config.max_positions)
    granularity = options.granularity if device.type == "cpu" else None
    estimate = _estimate_bytes(options, device)
    capacity = sizing.capacity_blocks_for(
        estimate, spec, sizing.device_granularity(device, granularity)
    )
    extensible = _run_path(model, spec, capacity, options, work, legacy=False)
    legacy = _run_path(model, spec, work.blocks_needed, options, work, legacy=True)
    note = vmm_unavailable_reason("cuda:0") if device.type == "cpu" else None
    return DemoResult(
        options=options,
        device=str(device),
        dtype=dtype,
        block_size=model.block_size,
        blocks_needed=work.blocks_needed,
        estimate_bytes=estimate,
        block_bytes=sum(t.block_bytes for t in spec),
        extensible=extensible,
        legacy=legacy,
        cuda_note=note,
    )


def _workload(options: DemoOptions, block_size: int, max_positions: int) -> _Workload:
    if min(options.num_seqs, options.prompt_len, options.steps) < 1:
        raise ValueError("sequences, prompt length and steps must be positive")
    if options.prompt_len + options.steps + block_size > max_positions:
        raise ValueError(f"sequences must stay under {max_positions - block_size} tokens")
    config = options.model
    generator = torch.Generator().manual_seed(config.seed + 1)
    prompts = torch.randint(
        config.vocab_size, (options.num_seqs, options.prompt_len), generator=generator
    )
    total_len = options.prompt_len + options.steps
    return _Workload(prompts.tolist(), total_len, block_size, config.hybrid)


def _estimate_bytes(options: DemoOptions, device: torch.device) -> int:
    """The first estimate of KV memory: an upper bound that sets the capacity."""
    if options.capacity_gib is not None:
        return int(options.capacity_gib * GIB)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])  # the whole device: nothing more fits
    return HOST_ESTIMATE_BYTES


def _run_path(
    model: DecoderModel,
    spec: list[KVCacheTensorSpec],
    capacity: int,
    options: DemoOptions,
    work: _Workload,
    *,
    legacy: bool,
) -> PathResult:
    granularity = options.granularity if model.device.type == "cpu" else None
    flow = KVCacheFlow.reserve(spec, capacity, model.device, legacy=legacy, granularity=granularity)
    try:
        result = _decode(flow, model, options, work)
    except BaseException:
        # Views the traceback holds release their memory when it dies.
        with contextlib.suppress(BufferError):
            flow.close()
        raise
    flow.close()
    return result


def _decode(
    flow: KVCacheFlow, model: DecoderModel, options: DemoOptions, work: _Workload
) -> PathResult:
    """Warm up and capture with one block committed, extend to fit, decode by replaying."""
    kv = model.bind(flow.cache)
    inputs = DecodeInputs.warm_up(len(work.prompts), work.max_blocks_per_seq, model.device)
    step, captured = _capture(model, kv, inputs)
    model.clear_null_block(kv)
    mapped_at_reserve = sizing.blocks_within(0, flow.cache)  # legacy: all of them
    if model.device.type == "cuda":
        report = flow.extend_to_fit(max_blocks=options.max_blocks)
    elif options.budget_mib is None:
        report = flow.extend_to_fit(host_free=True, max_blocks=options.max_blocks)
    else:
        report = flow.extend_to_fit(
            budget_bytes=options.budget_mib * MIB, max_blocks=options.max_blocks
        )
    tokens, blocks_used = _generate(model, kv, inputs, step, work, report.blocks_after)
    buffers = flow.cache.buffers
    return PathResult(
        tokens=tokens,
        report=report,
        capacity_blocks=flow.cache.capacity_blocks,
        num_segments=flow.cache.num_segments,
        backend=buffers[0].backend if buffers else "torch",
        granularity=buffers[0].granularity if buffers else None,
        graph_captured=captured,
        replays=work.total_len - 1,
        blocks_used=tuple(sorted(blocks_used)),
        blocks_mapped_at_reserve=mapped_at_reserve,
    )


def _capture(
    model: DecoderModel, kv: list[LayerCache], inputs: DecodeInputs
) -> tuple[Callable[[], None], bool]:
    """The decode step as a callable: a CUDA graph's replay on a GPU (warmed up on a side
    stream, as torch's recipe asks), the eager step on the host (after one warm-up call).
    The warm-up inputs address block 0 only: the one committed block."""

    def step() -> None:
        model.decode_step(kv, inputs)

    device = model.device
    if device.type != "cuda":
        step()
        return step, False
    torch.cuda.reset_peak_memory_stats(device)  # the margin follows the warm-up's peak
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize(device)
    return graph.replay, True


def _spread(count: int, committed_blocks: int) -> list[int]:
    """`count` block ids spread evenly from 1 to the last committed block (block 0 is the null
    block): the decode touches memory from the first granule to the last one the extension
    mapped. On a legacy cache of exactly the blocks needed, that is every block."""
    available = committed_blocks - 1
    if count > available:
        raise RuntimeError(
            f"the cache holds {committed_blocks} blocks; this decode needs {count + 1}: raise "
            "the budget or lower --steps/--num-seqs"
        )
    if count == 1:
        return [available]
    return [1 + k * (available - 1) // (count - 1) for k in range(count)]


def _generate(
    model: DecoderModel,
    kv: list[LayerCache],
    inputs: DecodeInputs,
    step: Callable[[], None],
    work: _Workload,
    committed_blocks: int,
) -> tuple[list[list[int]], list[int]]:
    """Greedy decode, prompts fed one token per step; blocks handed out in turn across
    sequences as they fill. Returns the tokens and the blocks used."""
    free = iter(_spread(work.blocks_needed - 1, committed_blocks))
    num_seqs, prompt_len = len(work.prompts), len(work.prompts[0])
    states = [next(free) for _ in range(num_seqs)] if work.hybrid else [0] * num_seqs
    model.clear_states(kv, states)
    tables: list[list[int]] = [[] for _ in range(num_seqs)]
    tokens = [list(prompt) for prompt in work.prompts]
    for position in range(work.total_len - 1):
        if position % work.block_size == 0:
            for table in tables:
                table.append(next(free))
        current = [seq[position] for seq in tokens]
        inputs.load(current, [position] * num_seqs, tables, states, work.block_size)
        step()
        if position + 1 >= prompt_len:  # past the prompt: the model's choice is the next token
            for seq, token in zip(tokens, inputs.next_tokens.tolist(), strict=True):
                seq.append(int(token))
    used = [block for table in tables for block in table] + (states if work.hybrid else [])
    return tokens, used


# ---------------------------------------------------------------------------------------------
# the report


_HYBRID_NOTE = " (block-major: each buffer shares its blocks with a Mamba-like layer's states)"


def _size(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.3f} GiB" if num_bytes >= GIB else f"{num_bytes / MIB:.1f} MiB"


def format_report(result: DemoResult) -> str:
    o, ext, legacy = result.options, result.extensible, result.legacy
    m, r = o.model, ext.report
    kinds = "attention + Mamba-like" if m.hybrid else "attention"
    segments = ", ".join(str(n) for n in ext.num_segments)
    reserved = ext.capacity_blocks * result.block_bytes
    lines = [
        "extensible-kv demo: paged decode on an extensible KV cache vs a legacy one",
        f"device:    {_device_line(result)}",
        f"model:     {m.num_layers} layers ({kinds}), hidden {m.hidden_size}, {m.num_heads} "
        f"heads / {m.num_kv_heads} KV heads, vocab {m.vocab_size}, "
        f"{str(result.dtype).removeprefix('torch.')}, seed {m.seed}",
        f"layout:    {o.layout}{_HYBRID_NOTE if m.hybrid else ''}, {len(ext.num_segments)} "
        f"buffer(s), segments per buffer: {segments}, block size {result.block_size}",
        f"capacity:  {ext.capacity_blocks} blocks ({_size(reserved)} reserved) from an "
        f"estimate of {_size(result.estimate_bytes)}",
        f"graph:     {_graph_line(ext)}",
        f"extend:    {r.blocks_before} -> {r.blocks_after} blocks, {_size(r.bytes_before)} -> "
        f"{_size(r.bytes_after)} committed in {r.commit_ms:.2f} ms "
        f"({r.handles_before} -> {r.handles_after} handles); {_budget(r, o)}",
        f"decode:    {o.num_seqs} sequences x {o.prompt_len + o.steps} tokens "
        f"({o.prompt_len} prompt + {o.steps} generated) in {len(ext.blocks_used)} blocks "
        f"spread over 1..{ext.blocks_used[-1]}; {ext.blocks_in_new_memory} of them in memory "
        f"the extension mapped (beyond block {ext.blocks_mapped_at_reserve - 1})",
        f"legacy:    {legacy.report.blocks_after} blocks allocated up front "
        f"({_size(legacy.report.bytes_after)}), blocks 1..{legacy.blocks_used[-1]}, same spec "
        "and recipe" + (", graph replayed" if legacy.graph_captured else ""),
        f"tokens:    seq 0 generated {ext.tokens[0][o.prompt_len : o.prompt_len + 12]} ...",
        f"identical: {'yes' if result.identical else 'no'}",
    ]
    return "\n".join(lines)


def failure_reason(result: DemoResult) -> str | None:
    """Why the run is not a success (`result.ok` false), in words a user can act on; `None`
    when it is one."""
    reasons = []
    if not result.identical:
        pairs = zip(result.extensible.tokens, result.legacy.tokens, strict=True)
        seq = next(i for i, (ext, legacy) in enumerate(pairs) if ext != legacy)
        reasons.append(
            f"the extensible cache's tokens differ from the legacy cache's (sequence {seq} "
            "first): the extended blocks do not hold what the decode wrote"
        )
    if not result.used_new_blocks:
        reasons.append(_nothing_mapped(result))
    return "; ".join(reasons) or None


def _nothing_mapped(result: DemoResult) -> str:
    """Why the decode used no block in memory the extension mapped: it mapped none."""
    ext, options = result.extensible, result.options
    report, mapped = ext.report, ext.blocks_mapped_at_reserve
    held = f"the {mapped} blocks whose memory the first commit already mapped"
    prefix = "the decode used no memory the extension mapped, which is what the demo checks: "
    if ext.capacity_blocks <= mapped:
        estimate = (
            f"--capacity-gib {options.capacity_gib:g}"
            if options.capacity_gib is not None
            else "the default estimate"
        )
        return (
            f"{prefix}the capacity of {ext.capacity_blocks} blocks (from {estimate}) ends "
            f"within {held}, so there is nothing to extend; raise --capacity-gib"
        )
    if options.max_blocks is not None and options.max_blocks <= mapped:
        return (
            f"{prefix}--max-blocks {options.max_blocks} stops the commit within {held}; "
            f"raise --max-blocks above {mapped}"
        )
    if report.budget_source == "given":
        granule = ext.granularity or 0
        next_granules = sum(ext.num_segments) * granule
        return (
            f"{prefix}the budget of --budget-mib {options.budget_mib} fits {report.fit_blocks} "
            f"blocks, within {held}; raise --budget-mib (each of the {sum(ext.num_segments)} "
            f"segments grows by whole {_size(granule)} granules: at least "
            f"{math.ceil(next_granules / MIB)} MiB maps the next one of each)"
        )
    return (
        f"{prefix}the free memory ({_size(report.free_bytes or 0)}) less the margin "
        f"({_size(report.margin_bytes)}) fits {report.fit_blocks} blocks, within {held}; free "
        "memory on the device"
    )


def _device_line(result: DemoResult) -> str:
    ext = result.extensible
    line = f"{result.device} ({ext.backend} backend"
    if ext.granularity is not None:
        line += f", granularity {_size(ext.granularity)}"
    return line + (f"; CUDA unavailable: {result.cuda_note})" if result.cuda_note else ")")


def _graph_line(path: PathResult) -> str:
    if not path.graph_captured:
        return f"none: eager on the host, {path.replays} steps"
    return (
        f"CUDA graph of the decode step captured with {path.report.blocks_before} block(s) "
        f"committed, replayed {path.replays} times after the extension"
    )


def _budget(report: ExtendReport, options: DemoOptions) -> str:
    if report.budget_source == "given":
        asked = report.budget_asked_bytes or 0
        text = (
            f"host budget {_size(asked)} (--budget-mib) in all, {_size(report.budget_bytes)} "
            f"of it left after the {_size(report.bytes_before)} committed before"
        )
    else:
        text = (
            f"the fit: free {_size(report.free_bytes or 0)} ({report.budget_source}) - margin "
            f"{_size(report.margin_bytes)}"
        )
        if report.non_kv_used_bytes is not None:
            text += f"; non-KV use since reserve {_size(report.non_kv_used_bytes)}"
    if options.max_blocks is not None:
        text += f", capped at --max-blocks {options.max_blocks}"
    return text
