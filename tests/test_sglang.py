"""SGLang 0.5.23's own KV pools on extensible-kv's owner, through SGLang's own plugin loader.

The pools are built with post-capture backing active, the way SGLang builds them under
`SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1`, on the host backend (device "cpu") and, where a GPU is
present, on cuda:0. K/V are written through plain tensor ops: `set_kv_buffer` reaches kernels.
SGLang comes from `sglang_env` (installed by scripts/setup, or vendored); without it the tests
skip, or fail where EKV_REQUIRE_SGLANG is set (CI).
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import extensible_kv
import pytest
from extensible_kv import ExtensibleTensor, OutOfMemoryError
from extensible_kv.sglang import owner as owner_module
from extensible_kv.sglang import plugin
from extensible_kv.sglang.owner import KvSuspendedError, KvVmmBufferOwner
from support import bench_scripts, sglang_env, stack_env

pytestmark = pytest.mark.sglang

PAGE = 16
HEADS = 2
K_DIM, V_DIM = 128, 64  # K and V rows differ: unequal segments
LOGGER = "sglang.extensible_kv"


@pytest.fixture(scope="session")
def sglang() -> Any:
    """SGLang 0.5.23 (installed or vendored); skips with the reason where absent, fails instead
    where EKV_REQUIRE_SGLANG is set."""
    stack_env.skip_or_fail(sglang_env.load(), "EKV_REQUIRE_SGLANG")
    import sglang

    return sglang


def _load_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's own loader, as every SGLang process runs it, limited to our entry point."""
    import sglang.srt.plugins as plugins

    plugin.unregister()
    monkeypatch.setenv("SGLANG_PLUGINS", "extensible_kv")
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    plugins.load_plugins()


@pytest.fixture(scope="session")
def plugged(sglang: Any) -> Iterator[Any]:
    """SGLang's loader has run our `sglang.srt.plugins` entry point: its pools build our owner."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.delenv(plugin.ENV_VAR, raising=False)
        _load_plugins(monkeypatch)
    import sglang.srt.mem_cache.memory_pool as memory_pool

    assert memory_pool.KvVmmBufferOwner is KvVmmBufferOwner, (
        "the sglang.srt.plugins entry point did not install extensible_kv.sglang "
        f"(SGLang from {sglang_env.source()}; is extensible-kv installed with its metadata?)"
    )
    yield memory_pool
    plugin.unregister()


@pytest.fixture
def pool_device(device: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The device string SGLang's pools get. SGLang's `_alloc_post_capture_buffers` asks
    `torch.cuda.current_device()` for the index of an index-less device: on a machine without
    CUDA that raises, so the test gives it device 0 (which the host backend ignores)."""
    if device == "cpu":
        return _cpu(monkeypatch)
    return "cuda:0"


def _cpu(monkeypatch: pytest.MonkeyPatch) -> str:
    import torch

    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return "cpu"


@pytest.fixture(params=[False, True], ids=["no-zero", "zero"])
def zeroing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setenv(owner_module.ZERO_ENV_VAR, "1" if request.param else "0")
    return bool(request.param)


def _mha(memory_pool: Any, device: str, size: int, layers: int = 2) -> Any:
    import torch

    return memory_pool.MHATokenToKVPool(
        size=size,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=HEADS,
        head_dim=K_DIM,
        v_head_dim=V_DIM,
        layer_num=layers,
        device=device,
        enable_memory_saver=False,
        post_capture_active=True,
    )


def _footprint(owner: KvVmmBufferOwner) -> int:
    """Bytes of the granules that hold a committed byte of some buffer (a shared one once)."""
    buffer = owner.buffer
    assert buffer is not None
    g = buffer.granularity
    granules: set[int] = set()
    for offset, size in zip(buffer.segment_offsets, buffer.segment_bytes, strict=True):
        if size:
            granules.update(range(offset // g, (offset + size - 1) // g + 1))
    return len(granules) * g


def _spans(owner: KvVmmBufferOwner, num_tokens: int, *, final: bool) -> list[int]:
    span = "final_span_bytes" if final else "prefix_span_bytes"
    return [getattr(d, span)(num_tokens, owner.page_size) for d in owner._descs]


def _fill(pool: Any, slots: Any, value: float) -> None:
    for layer in range(pool.layer_num):
        k, v = pool.k_buffer[layer], pool.v_buffer[layer]
        k[slots] = value + layer
        v[slots] = -(value + layer)


def _uniform(tensor: Any) -> float | tuple[float, float]:
    """The one value every element holds, or (min, max) where they differ. Exact: a mean of
    equal floats is not (a CUDA reduction returned 3.0000002 for a slot of 3.0s)."""
    low, high = float(tensor.float().amin()), float(tensor.float().amax())
    return low if low == high else (low, high)


def _values(pool: Any, slots: Any) -> list[tuple[Any, Any]]:
    return [
        (_uniform(pool.k_buffer[i][slots]), _uniform(pool.v_buffer[i][slots]))
        for i in range(pool.layer_num)
    ]


def _expected(pool: Any, value: float) -> list[tuple[float, float]]:
    return [(value + i, -(value + i)) for i in range(pool.layer_num)]


# ---- the plugin: entry point, SGLang's loader, switches, version gate


def test_sglangs_loader_replaces_every_binding_and_logs_one_line(
    plugged: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import sglang.srt.mem_cache.kv_vmm_backing as backing
    import sglang.srt.mem_cache.unified_memory_pool as unified

    original = plugin._originals[plugin._OWNER_TARGET]
    assert original.__module__ == "sglang.srt.mem_cache.kv_vmm_backing"
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _load_plugins(monkeypatch)
    for module in (backing, plugged, unified):
        assert module.KvVmmBufferOwner is KvVmmBufferOwner, module.__name__
    ours = [r for r in caplog.records if r.name == LOGGER]
    assert len(ours) == 1 and ours[0].levelno == logging.INFO
    assert "SGLang 0.5.23" in ours[0].getMessage()


def test_switched_off_leaves_sglang_untouched(
    plugged: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import sglang.srt.mem_cache.kv_vmm_backing as backing
    import sglang.srt.utils.torch_memory_saver_adapter as adapter
    from sglang.srt.plugins.hook_registry import HookRegistry

    original = plugin._originals[plugin._OWNER_TARGET]
    monkeypatch.setenv(plugin.ENV_VAR, "0")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _load_plugins(monkeypatch)
    try:
        assert backing.KvVmmBufferOwner is original
        assert plugged.KvVmmBufferOwner is original
        assert not hasattr(adapter._TorchMemorySaverAdapterReal.pause, "__wrapped__")
        assert not any(t.startswith(plugin._OWNER_TARGET) for t in HookRegistry._hooks)
        assert "EXTENSIBLE_KV_SGLANG=0" in caplog.text
    finally:
        monkeypatch.delenv(plugin.ENV_VAR)
        _load_plugins(monkeypatch)
    assert plugged.KvVmmBufferOwner is KvVmmBufferOwner


def test_the_automatic_policy_is_hooked_around_the_scheduler_only_when_asked(
    plugged: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `EXTENSIBLE_KV_SGLANG_AUTO` the plugin asks SGLang's registry for AROUND hooks on
    the scheduler's `get_next_batch_to_run` and `on_idle` (SGLang's loader applies them where
    its scheduler module imports: not with this machine's light dependencies, which the
    registry logs), and unregister withdraws them; a value it cannot read names the
    variable. The hooks run the policy before the batch is planned and after the idle
    housekeeping, one policy per scheduler, and a scheduler whose pool it cannot resize runs
    as it was."""
    from extensible_kv.sglang.auto import Hooks
    from sglang.srt.plugins.hook_registry import HookRegistry

    targets = [f"{plugin._SCHEDULER_CLASS}.{n}" for n in ("get_next_batch_to_run", "on_idle")]
    assert not any(t in HookRegistry._hooks for t in targets)
    monkeypatch.setenv(plugin.AUTO_ENV_VAR, "min_tokens=1024")
    try:
        _load_plugins(monkeypatch)
        for target in targets:
            hooks = [entry[1] for entry in HookRegistry._hooks[target]]
            assert hooks == [plugin._registered[target]]
        monkeypatch.setenv(plugin.AUTO_ENV_VAR, "min_tokens=lots")
        plugin.unregister()
        with pytest.raises(ValueError, match="EXTENSIBLE_KV_SGLANG_AUTO='min_tokens=lots'"):
            plugin.register()  # SGLang's loader logs what its plugins raise
    finally:
        monkeypatch.delenv(plugin.AUTO_ENV_VAR)
        _load_plugins(monkeypatch)
    assert not any(t in plugin._registered or t in HookRegistry._hooks for t in targets)
    assert plugged.KvVmmBufferOwner is KvVmmBufferOwner
    # The hooks themselves, around a scheduler whose allocator is not one `resize` handles.
    from extensible_kv.sglang.auto import AutoSettings

    hooks = Hooks(AutoSettings())
    calls: list[str] = []

    class Scheduler:  # weakly referenced, as SGLang's is
        token_to_kv_pool_allocator = SimpleNamespace()

    scheduler = Scheduler()
    assert (
        hooks.get_next_batch_to_run(lambda s, **kw: calls.append("plan") or "batch", scheduler)
        == "batch"
    )
    assert hooks.on_idle(lambda s: calls.append("idle"), scheduler) is None
    assert calls == ["plan", "idle"] and hooks.policy_of(scheduler) is None


@pytest.mark.parametrize("case", ["old-version", "other-constructor"])
def test_unrecognised_sglang_is_left_alone(
    plugged: Any, case: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import sglang
    import sglang.srt.mem_cache.kv_vmm_backing as backing

    original = plugin._originals[plugin._OWNER_TARGET]
    plugin.unregister()
    if case == "old-version":
        monkeypatch.setattr(sglang, "__version__", "0.5.15")
    else:

        class Other:
            def __init__(self, *, device: str, num_tokens: int) -> None: ...

        monkeypatch.setattr(backing, "KvVmmBufferOwner", Other)
    try:
        with caplog.at_level(logging.INFO, logger=LOGGER):
            assert plugin.register() is False
        (record,) = [r for r in caplog.records if r.name == LOGGER]
        assert record.levelno == logging.WARNING
        assert sglang.__version__ in record.getMessage()
        assert not plugin._registered
    finally:
        monkeypatch.undo()
        _load_plugins(monkeypatch)
    assert backing.KvVmmBufferOwner is KvVmmBufferOwner
    assert original is plugin._originals[plugin._OWNER_TARGET]


def _unhook(target: str, original: Any, hook: Any) -> None:
    """Take another plugin's `hook` off `target` again, putting SGLang's `original` back
    wherever the registry put its chain (what a test that stacks a hook must undo)."""
    import pkgutil

    from sglang.srt.plugins.hook_registry import HookRegistry

    entries = HookRegistry._hooks.get(target, [])
    entries[:] = [entry for entry in entries if entry[1] is not hook]
    if not entries:
        HookRegistry._hooks.pop(target, None)
    HookRegistry._patched.discard(target)
    path, name = target.rsplit(".", 1)
    parent = pkgutil.resolve_name(path)
    chain = getattr(parent, name)
    setattr(parent, name, original)
    for module in list(sys.modules.values()):
        for attr, value in list(vars(module).items()):
            if value is chain and module is not parent:
                setattr(module, attr, original)


@pytest.mark.parametrize("order", ["ours-first", "theirs-first"])
def test_unregister_removes_exactly_our_layer_under_another_plugins_hook(
    plugged: Any, order: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another plugin's AROUND hooks on the targets we hook (the adapter's `pause`, the gate):
    wherever our layer sits in the chain, `unregister` removes it and keeps theirs applied."""
    import sglang.srt.arg_groups.overrides as overrides
    import sglang.srt.utils.torch_memory_saver_adapter as adapter_module
    from sglang.srt.model_executor.model_runner_components import kv_pool_runtime
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    pause_target = f"{plugin._ADAPTER_CLASS}.pause"
    real = adapter_module._TorchMemorySaverAdapterReal
    plugin.unregister()
    sglangs_pause, sglangs_gate = real.pause, overrides.post_capture_kv_sizing_planned
    assert not hasattr(sglangs_pause, "__wrapped__") and not hasattr(sglangs_gate, "__wrapped__")
    calls: list[str] = []

    def their_pause(original: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append("their pause")
        return original(*args, **kwargs)

    def their_gate(original: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append("their gate")
        return original(*args, **kwargs)

    theirs = {pause_target: their_pause, plugin._GATE_TARGET: their_gate}
    monkeypatch.setattr(owner_module, "suspend_all", lambda: calls.append("our suspend"))
    monkeypatch.setattr(adapter_module, "_memory_saver", _FakeSaver(), raising=False)
    try:
        if order == "theirs-first":
            for target, hook in theirs.items():
                HookRegistry.register(target, hook, HookType.AROUND)
        assert plugin.register()
        if order == "ours-first":
            for target, hook in theirs.items():
                HookRegistry.register(target, hook, HookType.AROUND)
        HookRegistry.apply_hooks()
        real().pause("kv_cache")
        assert sorted(calls) == ["our suspend", "their pause"]
        calls.clear()

        plugin.unregister()
        real().pause("kv_cache")
        assert calls == ["their pause"]  # ours is gone, theirs stays
        assert real.pause.__wrapped__ is sglangs_pause
        gate = overrides.post_capture_kv_sizing_planned
        assert gate.__wrapped__ is sglangs_gate
        assert kv_pool_runtime.post_capture_kv_sizing_planned is gate  # rebound as at apply
        calls.clear()
        gate(_record())
        assert calls == ["their gate"]
        for target, hook in theirs.items():  # the registry's record matches what is applied
            assert [entry[1] for entry in HookRegistry._hooks[target]] == [hook]
            assert target in HookRegistry._patched
    finally:
        plugin.unregister()
        _unhook(pause_target, sglangs_pause, their_pause)
        _unhook(plugin._GATE_TARGET, sglangs_gate, their_gate)
        _load_plugins(monkeypatch)
    assert plugged.KvVmmBufferOwner is KvVmmBufferOwner


def test_unregister_puts_back_only_what_sglangs_registry_rebound(
    plugged: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's own names for our owner (a module's, `__main__`'s) stay ours; a module's
    copy of SGLang's class, which the registry rebound, gets SGLang's back. This test module is
    a user's module too: its global `KvVmmBufferOwner` must stay ours."""
    import sglang.srt.mem_cache.kv_vmm_backing as backing

    ours = KvVmmBufferOwner  # a local: no walk of sys.modules can rebind it
    original = plugin._originals[plugin._OWNER_TARGET]
    assert original is not ours
    plugin.unregister()
    users = types.ModuleType("ekv_test_user_app")
    users.KvVmmBufferOwner = KvVmmBufferOwner  # type: ignore[attr-defined]
    users.ours_by_another_name = KvVmmBufferOwner  # type: ignore[attr-defined]
    copies = types.ModuleType("ekv_test_sglang_copy")
    copies.KvVmmBufferOwner = original  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, users.__name__, users)
    monkeypatch.setitem(sys.modules, copies.__name__, copies)
    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "KvVmmBufferOwner", KvVmmBufferOwner, raising=False)
    late = types.ModuleType("sglang.srt.ekv_test_imported_after_the_apply")
    monkeypatch.setitem(sys.modules, late.__name__, late)
    try:
        _load_plugins(monkeypatch)
        assert copies.KvVmmBufferOwner is KvVmmBufferOwner  # type: ignore[attr-defined]
        late.KvVmmBufferOwner = backing.KvVmmBufferOwner  # type: ignore[attr-defined]
        plugin.unregister()
        assert late.KvVmmBufferOwner is original  # type: ignore[attr-defined]
        assert backing.KvVmmBufferOwner is original and plugged.KvVmmBufferOwner is original
        assert copies.KvVmmBufferOwner is original  # type: ignore[attr-defined]
        assert users.KvVmmBufferOwner is ours  # type: ignore[attr-defined]
        assert users.ours_by_another_name is ours  # type: ignore[attr-defined]
        assert main.KvVmmBufferOwner is ours
        assert sys.modules[__name__].KvVmmBufferOwner is ours
    finally:
        _load_plugins(monkeypatch)
    assert plugged.KvVmmBufferOwner is KvVmmBufferOwner


def _record(**overrides: Any) -> SimpleNamespace:
    """What SGLang 0.5.23's `post_capture_kv_sizing_planned` reads of a resolved record, for a
    dense non-MLA model whose every condition allows post-capture sizing."""
    from sglang.srt.configs.model_config import AttentionArch
    from sglang.srt.model_executor.cuda_graph_config import Backend

    enabled = Backend.FULL
    fields: dict[str, Any] = {
        "enable_kv_cache_sharding": False,
        "device": "cuda",
        "dcp_size": 1,
        "prefill_only_disable_kv_cache": False,
        "enable_memory_saver": False,
        "disaggregation_transfer_backend": "mooncake",
        "disaggregation_mode": "null",
        "enable_unified_memory": False,
        "cuda_graph_config": SimpleNamespace(
            decode=SimpleNamespace(backend=enabled),
            prefill=SimpleNamespace(backend=enabled, bs=(8192,)),
        ),
        "chunked_prefill_size": 8192,
        "enable_dynamic_chunking": False,
        "pp_size": 1,
        "max_prefill_tokens": 16384,
        "model_path": "dummy",
        "_model_config": SimpleNamespace(
            attention_arch=AttentionArch.MHA,
            is_hybrid_swa=False,
            hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"]),
        ),
    }
    fields.update(overrides)
    return SimpleNamespace(**fields)


def test_memory_saver_alone_no_longer_turns_post_capture_sizing_off(
    plugged: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sglang.srt.arg_groups.overrides as overrides
    from sglang.srt.configs.model_config import AttentionArch
    from sglang.srt.model_executor.model_runner_components import kv_pool_runtime

    monkeypatch.setenv("SGLANG_ENABLE_POST_CAPTURE_KV_SIZING", "1")
    gate = overrides.post_capture_kv_sizing_planned
    sglangs = gate.__wrapped__
    assert kv_pool_runtime.post_capture_kv_sizing_planned is gate  # the registry rebound it
    saver = _record(enable_memory_saver=True)
    assert sglangs(_record()) and not sglangs(saver)
    assert gate(saver) is True
    assert saver._resolved_overrides is None or saver._resolved_overrides == []
    # Every other reason still says no, with or without the memory saver.
    mla = SimpleNamespace(attention_arch=AttentionArch.MLA, is_hybrid_swa=False)
    for record in (_record(enable_memory_saver=True, _model_config=mla), _record(dcp_size=2)):
        assert gate(record) is False
    monkeypatch.setenv("SGLANG_ENABLE_POST_CAPTURE_KV_SIZING", "0")
    assert gate(_record(enable_memory_saver=True)) is False


# ---- SGLang's pools on our owner


def test_mha_pool_grows_keeps_low_slots_and_backs_the_footprint(
    plugged: Any, pool_device: str, zeroing: bool
) -> None:
    import torch

    reserved, final = 8192, 6000
    pool = _mha(plugged, pool_device, reserved)
    owner = pool._post_capture_owner
    assert isinstance(owner, KvVmmBufferOwner)
    buffer = owner.buffer
    assert buffer is not None and buffer.num_segments == 2 * pool.layer_num
    assert len(set(buffer.segment_capacities)) == 2  # K and V rows differ
    for tensor, offset in zip(owner.tensors, buffer.segment_offsets, strict=True):
        assert tensor.data_ptr() == buffer.base_ptr + offset
    assert list(buffer.segment_bytes) == _spans(owner, PAGE, final=False)
    assert pool.post_capture_backed_bytes == _footprint(owner)
    pointers = [t.data_ptr() for t in (*pool.k_buffer, *pool.v_buffer)]

    low = torch.arange(1, PAGE)
    _fill(pool, low, 3.0)
    pool.finalize_backing(SimpleNamespace(max_total_num_tokens=final))
    assert pool.size == final and owner.final_num_tokens == final
    assert list(buffer.segment_bytes) == _spans(owner, final, final=True)
    assert pool.post_capture_backed_bytes == _footprint(owner)
    assert [t.data_ptr() for t in (*pool.k_buffer, *pool.v_buffer)] == pointers
    assert _values(pool, low) == _expected(pool, 3.0)
    high = torch.tensor([final - 1, final + PAGE - 1])  # the padded page is backed too
    if zeroing:
        assert _values(pool, high) == [(0.0, 0.0)] * pool.layer_num
    _fill(pool, high, 5.0)
    assert _values(pool, high) == _expected(pool, 5.0)
    pool._clear_buffers()
    assert owner.backed_bytes == 0


@pytest.mark.parametrize("cap_granules", [2, None], ids=["capped", "whole-runs"])
def test_a_grow_maps_one_handle_per_buffer_run_up_to_the_cap(
    plugged: Any, pool_device: str, monkeypatch: pytest.MonkeyPatch, cap_granules: int | None
) -> None:
    """As SGLang's arena (one handle per buffer per extension): the granules a finalize adds
    form one run per buffer, each mapped from its start in handles of the cap, the last one
    shorter; runs shorter than the cap (every run of a real pool) are one handle each."""
    granularity = extensible_kv.ExtensibleTensor(1, device=pool_device.split(":")[0]).granularity
    cap = (cap_granules or 1 << 20) * granularity
    monkeypatch.setattr(owner_module, "HANDLE_BYTES", cap)
    reserved = 2 * 4 * granularity // (HEADS * V_DIM * 2)  # V: 8 granules, K: 16
    pool = _mha(plugged, pool_device, reserved, layers=2)
    buffer = pool._post_capture_owner.buffer
    before = set(buffer.handle_runs())
    pool.finalize_backing(SimpleNamespace(max_total_num_tokens=reserved // 2))
    added = sorted(set(buffer.handle_runs()) - before)
    new = sorted(g for first, n in added for g in range(first, first + n))
    runs: list[list[int]] = []
    for granule in new:
        if runs and granule == runs[-1][-1] + 1:
            runs[-1].append(granule)
        else:
            runs.append([granule])
    assert len(runs) == 2 * pool.layer_num  # the buffers' prefixes do not touch here
    step = cap // granularity
    expected = [
        (run[0] + i, min(step, len(run) - i)) for run in runs for i in range(0, len(run), step)
    ]
    assert added == expected
    assert (len(added) > len(runs)) == (cap_granules is not None)  # capped: runs were cut
    pool._clear_buffers()


def test_a_smaller_finalize_shrinks_in_place_keeping_the_kept_tokens(
    plugged: Any, pool_device: str
) -> None:
    import torch

    pool = _mha(plugged, pool_device, 16384)
    owner = pool._post_capture_owner
    pool.finalize_backing(SimpleNamespace(max_total_num_tokens=16000))
    big = owner.backed_bytes
    kept = torch.tensor([1, 2000, 2999])
    _fill(pool, kept, 7.0)
    pool.finalize_backing(SimpleNamespace(max_total_num_tokens=3000))
    assert owner.backed_bytes == _footprint(owner) < big
    assert list(owner.buffer.segment_bytes) == _spans(owner, 3000, final=True)
    assert _values(pool, kept) == _expected(pool, 7.0)
    pool.finalize_backing(SimpleNamespace(max_total_num_tokens=12000))  # and grows again
    assert _values(pool, kept) == _expected(pool, 7.0)
    _fill(pool, torch.tensor([11999]), 1.0)
    pool._clear_buffers()


def _allocator(pool: Any, size: int, paged: bool) -> Any:
    import torch
    from sglang.srt.mem_cache.allocator import paged as paged_module
    from sglang.srt.mem_cache.allocator import token as token_module

    if paged:
        return paged_module.PagedTokenToKVPoolAllocator(
            size, PAGE, torch.bfloat16, pool.device, pool, need_sort=True
        )
    return token_module.TokenToKVPoolAllocator(size, torch.bfloat16, pool.device, pool, True)


@pytest.mark.parametrize("paged", [False, True], ids=["token", "paged"])
def test_resize_a_live_pool_through_its_allocator(
    plugged: Any, pool_device: str, paged: bool
) -> None:
    """`extensible_kv.sglang.resize`: a grow backs new slots and the allocator hands them
    out; a shrink past held pages refuses and changes nothing; once they are freed it gives
    the memory back, keeping the tokens below, and the allocator never hands out a slot past
    the new size."""
    from extensible_kv.sglang import resize

    pool = _mha(plugged, pool_device, 8192)
    pool.finalize_backing(SimpleNamespace(max_total_num_tokens=2048))
    allocator = _allocator(pool, 2048, paged)
    owner = pool._post_capture_owner
    low = allocator.alloc(1024)  # held through every resize
    _fill(pool, low, 2.0)
    scheduler = SimpleNamespace(max_total_num_tokens=2048)
    backed = resize(allocator, 8192, scheduler=scheduler)
    assert backed == owner.backed_bytes > 0 and pool.size == 8192 == allocator.size
    assert scheduler.max_total_num_tokens == 8192
    # Slot ids run to the size; a paged allocator's last page ends PAGE - 1 past it.
    last = PAGE - 1 if paged else 0
    assert allocator.available_size() == 8192 - 1024
    high = allocator.alloc(allocator.available_size())  # every slot, the new ones included
    assert high is not None and int(high.max()) == 8192 + last
    _fill(pool, high, 4.0)
    before = (owner.backed_bytes, allocator.size, allocator.available_size())
    with pytest.raises(RuntimeError, match="pages past it are held"):
        resize(allocator, 2048)
    assert (owner.backed_bytes, allocator.size, allocator.available_size()) == before
    allocator.free(high)
    assert resize(allocator, 2048, scheduler=scheduler) < before[0]
    assert pool.size == allocator.size == scheduler.max_total_num_tokens == 2048
    assert allocator.available_size() == 2048 - 1024
    rest = allocator.alloc(allocator.available_size())
    assert rest is not None and int(rest.max()) == 2048 + last
    assert _values(pool, low) == _expected(pool, 2.0)
    with pytest.raises(ValueError, match="to the 8192 tokens reserved"):
        resize(allocator, 8192 + PAGE)
    if paged:
        with pytest.raises(ValueError, match="multiple of the page size"):
            resize(allocator, 2048 + 1)
    pool._clear_buffers()


@pytest.mark.parametrize("paged", [False, True], ids=["token", "paged"])
def test_the_automatic_policy_grows_for_waiting_requests_and_shrinks_after_idle(
    plugged: Any, pool_device: str, paged: bool
) -> None:
    """`extensible_kv.sglang.auto` on SGLang's own allocator and pool: before a batch is
    planned, waiting requests that do not fit grow the pool by their need (at least a step,
    doubling, up to the most); fully idle for `idle_s`, it shrinks to its least keeping the
    tokens below; pages still held leave the size as it is."""
    from extensible_kv.sglang.auto import AutoPolicy, AutoSettings

    pool = _mha(plugged, pool_device, 8192)
    pool.finalize_backing(SimpleNamespace(max_total_num_tokens=2048))
    allocator = _allocator(pool, 2048, paged)
    low = allocator.alloc(512)
    _fill(pool, low, 2.0)
    now = [0.0]
    scheduler = SimpleNamespace(
        token_to_kv_pool_allocator=allocator,
        waiting_queue=[],
        running_batch=SimpleNamespace(is_empty=lambda: True),
        tree_cache=None,
        max_total_num_tokens=2048,
    )
    scheduler.is_fully_idle = lambda: not scheduler.waiting_queue
    settings = AutoSettings(min_tokens=1024, max_tokens=8192, step_tokens=1024, idle_s=5.0)
    policy = AutoPolicy(scheduler, settings, clock=lambda: now[0])

    def request(tokens: int) -> Any:
        return SimpleNamespace(
            origin_input_ids=[1] * tokens, sampling_params=SimpleNamespace(max_new_tokens=128)
        )

    policy.before_batch()
    assert allocator.size == 2048
    scheduler.waiting_queue = [request(1000) for _ in range(3)]  # 3384 needed, 1536 free
    policy.before_batch()
    assert allocator.size == pool.size == scheduler.max_total_num_tokens == 4096  # doubled
    scheduler.waiting_queue = [request(4000) for _ in range(3)]
    policy.before_batch()
    assert allocator.size == 8192  # the most
    scheduler.waiting_queue = []
    now[0] += 4.9
    policy.idle()
    assert allocator.size == 8192
    high = allocator.alloc(4096)  # held past the least
    now[0] += 0.2
    policy.idle()
    assert allocator.size == 8192  # kept, nothing changed
    allocator.free(high)
    now[0] += 5.1
    policy.idle()
    assert allocator.size == pool.size == scheduler.max_total_num_tokens == 1024
    assert allocator.available_size() == 1024 - 512
    assert _values(pool, low) == _expected(pool, 2.0)
    for bad, match in (("min_tokens=x", "not a number"), ("size=1", "key=value pairs")):
        with pytest.raises(ValueError, match=match):
            AutoSettings.parse(bad)
    assert AutoSettings.parse("0") is None and AutoSettings.parse("1") == AutoSettings()
    pool._clear_buffers()


def test_suspend_and_resume_keep_the_addresses(plugged: Any, pool_device: str) -> None:
    import torch

    pool = _mha(plugged, pool_device, 8192)
    owner = pool._post_capture_owner
    pool.finalize_backing(SimpleNamespace(max_total_num_tokens=5000))
    backed, sizes = owner.backed_bytes, owner.buffer.segment_bytes
    pointers = [t.data_ptr() for t in (*pool.k_buffer, *pool.v_buffer)]
    owner.suspend()
    assert owner.suspended and owner.backed_bytes == 0
    with pytest.raises(KvSuspendedError):
        owner.ensure_prefix(100)
    owner.resume()
    assert not owner.suspended and owner.backed_bytes == backed
    assert owner.buffer.segment_bytes == sizes
    assert [t.data_ptr() for t in (*pool.k_buffer, *pool.v_buffer)] == pointers
    slots = torch.tensor([0, 4999])
    _fill(pool, slots, 2.0)
    assert _values(pool, slots) == _expected(pool, 2.0)
    pool._clear_buffers()


class _FakeSaver:
    """torch_memory_saver's singleton as SGLang's adapter calls it (it is not installed here)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def pause(self, tag: str) -> None:
        self.calls.append(("pause", tag))

    def resume(self, tag: str) -> None:
        self.calls.append(("resume", tag))


def test_the_memory_savers_kv_cache_tag_suspends_and_resumes_our_memory(
    plugged: Any, pool_device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sglang.srt.utils.torch_memory_saver_adapter as adapter_module
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE, GPU_MEMORY_TYPE_WEIGHTS

    saver = _FakeSaver()
    monkeypatch.setattr(adapter_module, "_memory_saver", saver, raising=False)
    adapter = adapter_module._TorchMemorySaverAdapterReal()
    pool = _mha(plugged, pool_device, 8192)
    owner = pool._post_capture_owner
    pool.finalize_backing(SimpleNamespace(max_total_num_tokens=4000))
    backed = owner.backed_bytes
    adapter.pause(GPU_MEMORY_TYPE_WEIGHTS)
    assert owner.backed_bytes == backed  # other tags are torch_memory_saver's alone
    adapter.pause(GPU_MEMORY_TYPE_KV_CACHE)
    assert owner.suspended and owner.backed_bytes == 0
    adapter.resume(tag=GPU_MEMORY_TYPE_KV_CACHE)
    assert not owner.suspended and owner.backed_bytes == backed
    assert saver.calls == [
        ("pause", GPU_MEMORY_TYPE_WEIGHTS),
        ("pause", GPU_MEMORY_TYPE_KV_CACHE),
        ("resume", GPU_MEMORY_TYPE_KV_CACHE),
    ]
    pool._clear_buffers()


def test_swa_pool_finalizes_each_sub_pool_to_its_own_count(plugged: Any, pool_device: str) -> None:
    import sglang.srt.mem_cache.swa_memory_pool as swa
    import torch

    pool = swa.SWAKVPool(
        size=8192,
        size_swa=4096,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=HEADS,
        head_dim=K_DIM,
        swa_attention_layer_ids=[0, 2],
        full_attention_layer_ids=[1, 3],
        device=pool_device,
        post_capture_active=True,
    )
    full, window = pool.full_kv_pool._post_capture_owner, pool.swa_kv_pool._post_capture_owner
    assert isinstance(full, KvVmmBufferOwner) and isinstance(window, KvVmmBufferOwner)
    _fill(pool.full_kv_pool, torch.tensor([3]), 1.0)
    _fill(pool.swa_kv_pool, torch.tensor([3]), 2.0)
    config = SimpleNamespace(full_max_total_num_tokens=7000, swa_max_total_num_tokens=3000)
    pool.finalize_backing(config)
    assert (pool.size, pool.size_swa) == (7000, 3000)
    assert list(full.buffer.segment_bytes) == _spans(full, 7000, final=True)
    assert list(window.buffer.segment_bytes) == _spans(window, 3000, final=True)
    assert pool.post_capture_backed_bytes == _footprint(full) + _footprint(window)
    assert _values(pool.full_kv_pool, torch.tensor([3])) == _expected(pool.full_kv_pool, 1.0)
    assert _values(pool.swa_kv_pool, torch.tensor([3])) == _expected(pool.swa_kv_pool, 2.0)
    pool.full_kv_pool._clear_buffers()
    pool.swa_kv_pool._clear_buffers()


def test_hybrid_linear_pool_grows_its_attention_pool(plugged: Any, pool_device: str) -> None:
    import torch

    # The Mamba state lives in its own pool, sized before capture: not the owner's business.
    pool = plugged.HybridLinearKVPool(
        size=8192,
        dtype=torch.bfloat16,
        page_size=PAGE,
        head_num=HEADS,
        head_dim=K_DIM,
        full_attention_layer_ids=[3, 7],
        device=pool_device,
        mamba_pool=None,
        post_capture_active=True,
    )
    attention = pool.full_kv_pool
    owner = attention._post_capture_owner
    assert isinstance(owner, KvVmmBufferOwner) and pool.post_capture_active
    _fill(attention, torch.tensor([5]), 4.0)
    pool.finalize_backing(SimpleNamespace(max_total_num_tokens=6000))
    assert list(owner.buffer.segment_bytes) == _spans(owner, 6000, final=True)
    assert pool.post_capture_backed_bytes == _footprint(owner)
    assert _values(attention, torch.tensor([5])) == _expected(attention, 4.0)
    attention._clear_buffers()


def test_unified_pool_backs_byte_prefixes(
    plugged: Any, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sglang.srt.mem_cache.unified_memory_pool as unified
    import torch

    if device == "cpu":
        # SGLang's unified pool refuses a non-CUDA device before it builds the owner: it is
        # told cuda:0, and the owner's memory goes to the host backend.
        monkeypatch.setattr(owner_module, "_backing_device", lambda device, index: "cpu")
    specs = [
        unified.MHASubPoolSpec(
            name=name,
            layer_num=2,
            grow_direction=direction,
            head_num=HEADS,
            head_dim=K_DIM,
            store_dtype=torch.bfloat16,
        )
        for name, direction in (("full", "up"), ("swa", "down"))
    ]
    total, final = 32 << 20, 12 << 20
    pool = unified.UnifiedKVPool(
        total_bytes=total,
        sub_pool_specs=specs,
        device="cuda:0",
        enable_memory_saver=False,
        page_size=PAGE,
        post_capture_active=True,
    )
    owner = pool._post_capture_owner
    assert isinstance(owner, KvVmmBufferOwner) and owner.tensors[0] is pool._raw
    floor = pool.active_allocation_bytes
    assert owner.buffer.segment_bytes == (floor,)
    pool._raw[:floor] = 9
    pool.finalize_backing(SimpleNamespace(unified_memory_pool_bytes=final))
    assert owner.buffer.segment_bytes == (final,)
    assert pool.post_capture_backed_bytes == _footprint(owner)
    assert int(pool._raw[final - 1]) == 0  # SGLang zeroes the new bytes itself
    pool._raw[final - 1] = 1
    owner.close()


# ---- the owner's contract: typed errors, all or nothing, close


def test_bad_counts_are_value_errors_and_change_nothing(plugged: Any, pool_device: str) -> None:
    pool = _mha(plugged, pool_device, 4096)
    owner = pool._post_capture_owner
    owner.finalize(2000)
    sizes, backed = owner.buffer.segment_bytes, owner.backed_bytes
    for bad in (0, PAGE - 1, 4096 + 1):
        with pytest.raises(ValueError, match="final_num_tokens"):
            owner.finalize(bad)
    with pytest.raises(ValueError, match="outside"):
        owner.ensure_prefix(10**9)
    assert owner.buffer.segment_bytes == sizes and owner.backed_bytes == backed
    assert owner.final_num_tokens == 2000
    pool._clear_buffers()


def test_counts_are_integers_as_the_core_takes_them(plugged: Any, pool_device: str) -> None:
    """A negative count never reaches SGLang's span arithmetic; a float or a bool is a
    TypeError naming it (`int()` truncated 1.5 and took True); numpy integers are counts."""
    import numpy as np

    pool = _mha(plugged, pool_device, 4096)
    owner = pool._post_capture_owner
    owner.finalize(2000)
    sizes = owner.buffer.segment_bytes
    with pytest.raises(ValueError, match="num_tokens must be at least 0, got -1"):
        owner.ensure_prefix(-1)
    for bad in (1500.5, True, "2000"):
        with pytest.raises(TypeError, match="final_num_tokens"):
            owner.finalize(bad)
        with pytest.raises(TypeError, match="num_tokens"):
            owner.ensure_prefix(bad)
    assert owner.buffer.segment_bytes == sizes and owner.final_num_tokens == 2000
    owner.finalize(np.int64(1000))
    assert owner.final_num_tokens == 1000
    pool._clear_buffers()


def test_a_failed_grow_changes_nothing(plugged: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = _cpu(monkeypatch)
    pool = _mha(plugged, cpu, 16384, layers=4)  # 8 buffers: a finalize makes several handles
    made = pool._post_capture_owner.buffer.num_handles
    pool._clear_buffers()
    faulty = functools.partial(ExtensibleTensor, _fault=("create", made + 3, "oom"))
    monkeypatch.setattr(owner_module, "ExtensibleTensor", faulty)
    pool = _mha(plugged, cpu, 16384, layers=4)
    owner = pool._post_capture_owner
    sizes, backed = owner.buffer.segment_bytes, owner.backed_bytes
    with pytest.raises(OutOfMemoryError):
        pool.finalize_backing(SimpleNamespace(max_total_num_tokens=16000))
    assert owner.buffer.segment_bytes == sizes and owner.backed_bytes == backed
    assert owner.final_num_tokens is None
    owner.buffer._check_invariants()
    pool._clear_buffers()


def test_close_gives_the_memory_back_even_with_views_alive(plugged: Any, pool_device: str) -> None:
    pool = _mha(plugged, pool_device, 4096)
    owner = pool._post_capture_owner
    buffer = owner.buffer
    pool.finalize_backing(SimpleNamespace(max_total_num_tokens=4000))
    kept = pool.k_buffer[0]  # a view someone still holds
    pool._clear_buffers()
    assert owner.backed_bytes == 0 and buffer.physical_bytes == 0 and not buffer.closed
    with pytest.raises(RuntimeError, match="closed"):
        owner.ensure_prefix(PAGE)
    owner.close()  # idempotent
    del kept


def test_a_pool_without_layers_needs_no_reservation(plugged: Any) -> None:
    import torch

    owner = KvVmmBufferOwner(
        device="cpu",
        device_id=0,
        store_dtype=torch.bfloat16,
        page_size=PAGE,
        reserved_num_tokens=1024,
        buffer_descs=[],
    )
    owner.finalize(512)
    assert owner.tensors == [] and owner.backed_bytes == 0
    owner.close()


# ---- GPU: a graph captured before finalize_backing writes where only the grow made memory


@pytest.mark.gpu
def test_a_graph_captured_before_finalize_writes_where_the_grow_committed(plugged: Any) -> None:
    import torch

    reserved, final = 1 << 20, 600_000
    pool = _mha(plugged, "cuda:0", reserved)
    owner = pool._post_capture_owner
    loc = torch.zeros(1, dtype=torch.int64, device="cuda:0")
    row_k = torch.ones(HEADS, K_DIM, dtype=torch.bfloat16, device="cuda:0")
    row_v = torch.ones(HEADS, V_DIM, dtype=torch.bfloat16, device="cuda:0")
    k, v = pool.k_buffer[0], pool.v_buffer[0]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # slot 0 only is backed: capture writes there
        scale = (loc + 1).to(torch.bfloat16).view(1, 1, 1)
        k.index_copy_(0, loc, row_k.unsqueeze(0) * scale)
        v.index_copy_(0, loc, row_v.unsqueeze(0) * scale)
    pool.finalize_backing(SimpleNamespace(max_total_num_tokens=final))
    assert owner.backed_bytes == _footprint(owner)
    slot = final - 1000
    loc.fill_(slot)
    graph.replay()
    torch.cuda.synchronize()
    # (loc + 1) in bf16 rounds: compare with the same arithmetic.
    expected = float(torch.tensor(slot + 1, dtype=torch.bfloat16))
    assert (_uniform(k[slot]), _uniform(v[slot])) == (expected, expected)
    del graph
    pool._clear_buffers()


def test_bench_sglang_smoke(
    sglang: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """benchmarks/bench_sglang.py runs end to end on the host backend (ours alone): it cannot
    rot between GPU runs. Nothing here is timed."""
    bench = bench_scripts.load("bench_sglang")
    assert bench.main(["--out", str(tmp_path), "--device", "cpu", "--quick"]) == 0
    results = json.loads((tmp_path / "bench_sglang.json").read_text())
    per = results["shapes"]["8b"]
    assert set(per) == {"ours", "ours_zero"}
    for entry in per.values():
        (run,) = entry["runs"]
        assert run["tokens"] >= bench.WARMUP_TOKENS and run["backed_gib"] > 0
        assert all(run[step] > 0 for step in bench.STEPS)
    assert "| ours (no zeroing, like for like) |" in capsys.readouterr().out
