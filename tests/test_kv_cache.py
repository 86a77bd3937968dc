"""`ExtensibleKVCache` on every preset and standard layout, hybrid models, the legacy mode, and
two real-looking models (docs/design.md §4-§6).

Only blocks below the committed count are touched: on the host backend anything else is a
SIGSEGV, so a passing write is proof that the block's bytes were committed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from extensible_kv import ClosedError
from extensible_kv.kv_cache import (
    AttentionLayerSpec,
    ExtensibleKVCache,
    KVCacheTensorSpec,
    LayerSpec,
    MambaLayerSpec,
    StandardLayerSpec,
)
from extensible_kv.mamba import MambaStateSpec, gated_delta_net_state_spec, mamba2_state_spec
from support.kv_helpers import (
    MakeCache,
    blocks,
    byte_sum,
    committed_byte_sum,
    layer_views,
    pattern,
)

N, H, D = 16, 2, 32  # tokens per block, KV heads, head size
BF16 = torch.bfloat16
PAGE = 2 * N * H * D * 2  # K and V of one block, bf16: 4096 bytes
CAPACITY = 8


@dataclass(frozen=True)
class Case:
    """One buffer in one layout, and the segment count docs/design.md's table gives it."""

    name: str
    spec: tuple[KVCacheTensorSpec, ...]
    num_segments: int


def _preset(name: str, segments: int) -> Case:
    layer: LayerSpec = AttentionLayerSpec(name, N, H, D, BF16)
    page = PAGE
    if name == "MLA":
        layer, page = AttentionLayerSpec(name, N, 1, 576, BF16), N * 576 * 2
    if name == "FLASHMLA_SPARSE":
        layer = AttentionLayerSpec(name, N, 1, 576, torch.uint8, "fp8_ds_mla")
        page = N * 656
    return Case(name, (KVCacheTensorSpec(page, {"attn": layer}),), segments)


def _standard(name: str, segments: int, num_layers: int = 3) -> Case:
    layers = {
        f"layer.{i}": StandardLayerSpec(name, num_layers, i, N, H, D, BF16)
        for i in range(num_layers)
    }
    return Case(name, (KVCacheTensorSpec(num_layers * PAGE, layers),), segments)


CASES = [
    _preset("FLASH_ATTN", 2),
    _preset("FLASH_ATTN_HND", 2),
    _preset("FLEX_ATTENTION", 2),
    _preset("FLASHINFER", 1),
    _preset("FLASHINFER_HND", 1),
    _preset("TRITON_ATTN", 1),
    _preset("TRITON_ATTN_HND", 1),
    _preset("MLA", 1),
    _preset("FLASHMLA_SPARSE", 1),
    _preset("KV_SPLIT_BLOCK_MAJOR", 1),
    _standard("LBHNC", 3),
    _standard("LBNHC", 3),
    _standard("LHBNC", 3 * H),
    _standard("BLHNC", 1),
    _standard("BLNHC", 1),
    _standard("BHLNC", 1),
]


@pytest.fixture(params=CASES, ids=[c.name for c in CASES])
def case(request: pytest.FixtureRequest) -> Case:
    case: Case = request.param
    return case


def write_blocks(cache: ExtensibleKVCache, first: int, count: int, seed: int = 0) -> int:
    """Writes a pattern, different per view, into blocks `[first, first + count)` of every
    view; returns the sum of the bytes written."""
    written = 0
    for index, (_, block_dim, view) in enumerate(layer_views(cache)):
        target = blocks(view, block_dim, first, count)
        data = pattern(tuple(target.shape), view.dtype, seed + index, view.device)
        target.copy_(data)
        written += byte_sum(data)
    return written


def check_blocks(cache: ExtensibleKVCache, first: int, count: int, seed: int = 0) -> None:
    for index, (name, block_dim, view) in enumerate(layer_views(cache)):
        target = blocks(view, block_dim, first, count)
        expected = pattern(tuple(target.shape), view.dtype, seed + index, view.device)
        assert torch.equal(target, expected), f"layer {name} lost blocks [{first}, +{count})"


# ---------------------------------------------------------------------------------------------
# every preset and standard layout


def test_segment_count_is_the_tables(case: Case, make_cache: MakeCache) -> None:
    cache = make_cache(case.spec, CAPACITY)
    assert cache.num_segments == (case.num_segments,)
    (buffer,) = cache.buffers
    assert buffer.num_segments == case.num_segments
    assert buffer.capacity_bytes == CAPACITY * case.spec[0].block_bytes
    assert cache.physical_bytes == cache.committed_blocks == 0


def test_last_committed_block_lands_in_committed_memory(case: Case, make_cache: MakeCache) -> None:
    cache = make_cache(case.spec, CAPACITY)
    cache.commit(3)
    per_segment = 3 * case.spec[0].block_bytes // case.num_segments
    assert cache.buffers[0].segment_bytes == (per_segment,) * case.num_segments
    written = write_blocks(cache, 2, 1)
    check_blocks(cache, 2, 1)
    # Read back through views of exactly the committed bytes: every written byte is there.
    assert committed_byte_sum(cache) == written


def test_data_survives_growth_and_new_blocks_read_zero(case: Case, make_cache: MakeCache) -> None:
    cache = make_cache(case.spec, CAPACITY)
    cache.commit(2)
    write_blocks(cache, 0, 2, seed=5)
    ptrs = {name: view.data_ptr() for name, _, view in layer_views(cache)}
    cache.commit(CAPACITY)
    assert {name: view.data_ptr() for name, _, view in layer_views(cache)} == ptrs
    check_blocks(cache, 0, 2, seed=5)
    for _, block_dim, view in layer_views(cache):
        assert not blocks(view, block_dim, 2, CAPACITY - 2).any()
    write_blocks(cache, CAPACITY - 1, 1, seed=9)
    check_blocks(cache, CAPACITY - 1, 1, seed=9)


@pytest.mark.parametrize("exact", [False, True], ids=["plain", "exact"])
def test_shrink_keeps_the_kept_blocks_and_regrown_ones_read_zero(
    case: Case, make_cache: MakeCache, exact: bool
) -> None:
    cache = make_cache(case.spec, CAPACITY)
    cache.commit(CAPACITY)
    write_blocks(cache, 0, 3, seed=3)
    write_blocks(cache, 3, CAPACITY - 3, seed=4)
    ptrs = {name: view.data_ptr() for name, _, view in layer_views(cache)}
    before = cache.physical_bytes
    cache.shrink_to(3, exact=exact)
    assert cache.committed_blocks == 3
    # An exact shrink keeps only the granules of 3 blocks, as a fresh commit of 3 maps; a plain
    # one may keep a handle that straddles block 3 whole. (On CUDA's 2 MiB granules all the
    # blocks may share one granule: then nothing is released.)
    fresh = make_cache(case.spec, CAPACITY)
    fresh.commit(3)
    if exact:
        assert cache.physical_bytes == fresh.physical_bytes
    else:
        assert fresh.physical_bytes <= cache.physical_bytes <= before
    check_blocks(cache, 0, 3, seed=3)
    cache.consolidate()
    check_blocks(cache, 0, 3, seed=3)
    cache.commit(CAPACITY)
    assert {name: view.data_ptr() for name, _, view in layer_views(cache)} == ptrs
    check_blocks(cache, 0, 3, seed=3)
    for _, block_dim, view in layer_views(cache):
        assert not blocks(view, block_dim, 3, CAPACITY - 3).any()
    cache.shrink_to(CAPACITY)  # at or above the count: nothing to do
    assert cache.committed_blocks == CAPACITY


def test_committed_views_have_exactly_committed_storage(case: Case, make_cache: MakeCache) -> None:
    cache = make_cache(case.spec, CAPACITY)
    cache.commit(3)
    written = write_blocks(cache, 0, 3)
    (buffer,) = cache.buffers
    segments = [
        (buffer.base_ptr + offset, buffer.base_ptr + offset + num_bytes)
        for offset, num_bytes in zip(buffer.segment_offsets, buffer.segment_bytes, strict=True)
    ]
    total = 0
    for name, views in cache.committed_views().items():
        parts = views if isinstance(views, list) else [views]
        # One tensor per segment the layer spans (2 for K/V split, H for LHBNC).
        assert len(parts) == max(1, case.num_segments // len(case.spec[0].layers))
        assert isinstance(views, torch.Tensor) == (len(parts) == 1)
        for part in parts:
            start = part.untyped_storage().data_ptr()
            end = start + part.untyped_storage().nbytes()
            assert any(lo <= start and end <= hi for lo, hi in segments), name
            total += byte_sum(part)
        if isinstance(views, torch.Tensor):
            full = cache.views[name]
            assert isinstance(full, torch.Tensor)
            assert torch.equal(views, blocks(full, cache.block_dims[name], 0, 3))
            assert views.stride() == full.stride()
    # Per-layer views of one buffer are disjoint here, so together they hold every byte.
    assert total == written


# ---------------------------------------------------------------------------------------------
# K/V split vs block-major


def _one_layer(backend: str, page: int = PAGE) -> list[KVCacheTensorSpec]:
    return [KVCacheTensorSpec(page, {"attn": AttentionLayerSpec(backend, N, H, D, BF16)})]


def test_kv_split_grows_both_halves(make_cache: MakeCache) -> None:
    cache = make_cache(_one_layer("FLASH_ATTN"), CAPACITY)
    (buffer,) = cache.buffers
    cache.commit(1)
    cache.commit(3)
    assert buffer.segment_bytes == (3 * PAGE // 2, 3 * PAGE // 2)
    kv = cache.views["attn"]
    assert isinstance(kv, torch.Tensor)
    kv[0, 2].fill_(1)  # K of block 2: the end of segment 0's prefix
    assert byte_sum(buffer.segment_view(0)) == byte_sum(kv[0, 2]) > 0
    assert byte_sum(buffer.segment_view(1)) == 0
    kv[1, 2].fill_(2)  # V of block 2: the end of segment 1's prefix
    assert byte_sum(buffer.segment_view(1)) == byte_sum(kv[1, 2])
    k, v = cache.committed_views()["attn"]
    assert torch.equal(k, kv[0, :3]) and torch.equal(v, kv[1, :3])


@pytest.mark.parametrize("attention", ["FLASHINFER", "KV_SPLIT_BLOCK_MAJOR"])
def test_block_major_grows_one_prefix(attention: str, make_cache: MakeCache) -> None:
    cache = make_cache(_one_layer(attention), CAPACITY)
    cache.commit(3)
    assert cache.buffers[0].segment_bytes == (3 * PAGE,)
    # One prefix of 3 pages, in whole granules: 3 of 4 KiB on cpu, 1 of 2 MiB on cuda.
    g = cache.buffers[0].granularity
    assert cache.physical_bytes == -(-3 * PAGE // g) * g
    view = cache.views["attn"]
    assert isinstance(view, torch.Tensor)
    kv_block_2 = view[:, 2] if attention == "KV_SPLIT_BLOCK_MAJOR" else view[2]
    kv_block_2.fill_(1)
    assert committed_byte_sum(cache) == byte_sum(kv_block_2)


def test_commit_is_monotonic_and_bounded(make_cache: MakeCache) -> None:
    cache = make_cache(_one_layer("FLASH_ATTN"), CAPACITY)
    assert cache.commit(4) is None
    before = (cache.buffers[0].segment_bytes, cache.physical_bytes)
    cache.commit(4)
    cache.commit(1)
    cache.commit(0)
    assert cache.committed_blocks == 4
    assert (cache.buffers[0].segment_bytes, cache.physical_bytes) == before
    with pytest.raises(ValueError, match="cannot commit 9 blocks: capacity is 8 blocks"):
        cache.commit(CAPACITY + 1)
    with pytest.raises(ValueError, match="cannot commit -1 blocks"):
        cache.commit(-1)
    cache.commit(CAPACITY)
    assert cache.committed_blocks == CAPACITY
    assert cache.buffers[0].segment_bytes == (CAPACITY * PAGE // 2,) * 2


# ---------------------------------------------------------------------------------------------
# hybrid attention + Mamba


def _small_mamba(page_size_padded: int | None = PAGE) -> MambaStateSpec:
    return mamba2_state_spec(
        conv_kernel=4,
        conv_dim=16,
        num_heads=2,
        head_dim=4,
        d_state=16,
        conv_dtype=BF16,
        ssm_dtype=torch.float32,
        page_size_padded=page_size_padded,
    )


def _hybrid_model() -> list[KVCacheTensorSpec]:
    """A buffer shared by a FlashAttention layer and a Mamba layer, and a FlexAttention one
    of its own: both K/V split, so both re-strided."""
    shared = {
        "attn.0": AttentionLayerSpec("FLASH_ATTN_HND", N, H, D, BF16),
        "mamba.1": MambaLayerSpec(_small_mamba()),
    }
    own = {"attn.2": AttentionLayerSpec("FLEX_ATTENTION", N, H, D, BF16)}
    return [KVCacheTensorSpec(PAGE, shared), KVCacheTensorSpec(PAGE, own)]


def test_hybrid_restrides_kv_split_and_both_grow(make_cache: MakeCache) -> None:
    cache = make_cache(_hybrid_model(), CAPACITY)
    hidden = N * H * D
    assert cache.num_segments == (1, 1)
    views = cache.views
    for name, inner in (("attn.0", (D, N * D, 1)), ("attn.2", (H * D, D, 1))):
        view = views[name]
        assert isinstance(view, torch.Tensor)
        assert view.shape == (2, CAPACITY, N, H, D)  # still the backend's logical shape
        assert view.stride() == (hidden, 2 * hidden, *inner)
    mamba = views["mamba.1"]
    assert isinstance(mamba, list) and [s.stride(0) * s.element_size() for s in mamba] == [PAGE] * 2
    cache.commit(4)
    assert [b.segment_bytes for b in cache.buffers] == [(4 * PAGE,)] * 2
    # Blocks of a shared buffer go to one layer or the other: attention 2, Mamba 3.
    attn = views["attn.0"]
    assert isinstance(attn, torch.Tensor)
    attn[:, 2].copy_(pattern((2, N, H, D), BF16, 1, attn.device))
    for seed, state in enumerate(mamba):
        state[3].copy_(pattern(tuple(state.shape[1:]), state.dtype, seed, state.device))
    assert torch.equal(attn[:, 2], pattern((2, N, H, D), BF16, 1, attn.device))
    for seed, state in enumerate(mamba):
        expected = pattern(tuple(state.shape[1:]), state.dtype, seed, state.device)
        assert torch.equal(state[3], expected)
    # K and V of block 2 are one contiguous page, right after block 1's.
    assert attn[0, 2].data_ptr() == cache.buffers[0].base_ptr + 2 * PAGE
    assert attn[1, 2].data_ptr() == attn[0, 2].data_ptr() + PAGE // 2


def test_hybrid_rejects_multi_segment_standard_layout(make_cache: MakeCache) -> None:
    spec = [
        _standard("LBHNC", 3, num_layers=2).spec[0],
        KVCacheTensorSpec(PAGE, {"mamba": MambaLayerSpec(_small_mamba())}),
    ]
    with pytest.raises(ValueError, match=r"layer 'layer\.0': layout LBHNC has 2 segments"):
        make_cache(spec, CAPACITY)


# ---------------------------------------------------------------------------------------------
# legacy mode


def _mixed_model() -> list[KVCacheTensorSpec]:
    return [
        *_one_layer("FLASH_ATTN"),
        KVCacheTensorSpec(PAGE, {"hnd": AttentionLayerSpec("FLASHINFER_HND", N, H, D, BF16)}),
        *_standard("LHBNC", 2 * H, num_layers=2).spec,
    ]


@pytest.mark.parametrize("model", [_mixed_model, _hybrid_model])
def test_legacy_matches_extensible(
    model: Callable[[], list[KVCacheTensorSpec]], make_cache: MakeCache
) -> None:
    caches = [make_cache(model(), CAPACITY, legacy=legacy) for legacy in (False, True)]
    for cache in caches:
        cache.commit(2)
        write_blocks(cache, 0, 2, seed=3)
        cache.commit(6)
        write_blocks(cache, 5, 1, seed=4)
    extensible, legacy = caches
    assert legacy.legacy and not legacy.buffers
    assert legacy.buffer_physical_bytes == tuple(CAPACITY * t.block_bytes for t in model())
    # 6 of CAPACITY blocks committed, in whole granules per segment.
    committed = sum(
        -(-6 * t.block_bytes // segments // b.granularity) * b.granularity * segments
        for t, b, segments in zip(model(), extensible.buffers, extensible.num_segments, strict=True)
    )
    assert extensible.physical_bytes <= committed
    pairs = zip(layer_views(extensible), layer_views(legacy), strict=True)
    for (name, block_dim, a), (_, _, b) in pairs:
        assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype), name
        assert torch.equal(blocks(a, block_dim, 0, 6), blocks(b, block_dim, 0, 6)), name
    committed = [c.committed_views() for c in caches]
    for name, a_views in committed[0].items():
        b_views = committed[1][name]
        a_list = a_views if isinstance(a_views, list) else [a_views]
        b_list = b_views if isinstance(b_views, list) else [b_views]
        for a, b in zip(a_list, b_list, strict=True):
            assert (a.shape, a.stride()) == (b.shape, b.stride()) and torch.equal(a, b), name


# ---------------------------------------------------------------------------------------------
# errors name the layer and the numbers


def _attn(block_size: int = N, backend: str = "FLASHINFER") -> AttentionLayerSpec:
    return AttentionLayerSpec(backend, block_size, H, D, BF16)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (
            [KVCacheTensorSpec(PAGE, {"a": _attn(backend="FLASH_ATTN"), "b": _attn()})],
            r"tensor 0: layers 'a' \(2 segments\) and 'b' \(1 segments\) cannot share",
        ),
        (
            [KVCacheTensorSpec(PAGE, {"a": _attn(), "b": _attn(block_size=2 * N)})],
            r"layers 'a' \(block stride 4096 bytes\) and 'b' \(block stride 8192 bytes\)",
        ),
        (
            [KVCacheTensorSpec(2 * PAGE, {"a": _attn()})],
            "layer 'a': a block takes 4096 bytes, but KV cache tensor 0 has 8192 bytes",
        ),
        (
            [KVCacheTensorSpec(PAGE, {"m": MambaLayerSpec(_small_mamba(None))})],
            "layer 'm': a block takes 608 bytes, but KV cache tensor 0 has 4096 bytes",
        ),
        (
            [KVCacheTensorSpec(PAGE, {"a": _attn()}), KVCacheTensorSpec(PAGE, {"a": _attn()})],
            r"layers \['a'\] appear twice",
        ),
        ([KVCacheTensorSpec(PAGE, {})], "tensor 0 needs layers .* got 0 layers and 4096 bytes"),
    ],
)
def test_spec_errors(spec: list[KVCacheTensorSpec], match: str, device: str) -> None:
    with pytest.raises(ValueError, match=match):
        ExtensibleKVCache(spec, CAPACITY, device)


class _NotABackend:
    pass


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda: AttentionLayerSpec("FLASH", N, H, D, BF16),
            r"unknown attention backend 'FLASH'; known: FLASH_ATTN, .*FLASHINFER, ",
        ),
        (
            lambda: AttentionLayerSpec(_NotABackend, N, H, D, BF16),
            "attention backend _NotABackend has no get_kv_cache_shape",
        ),
        (lambda: AttentionLayerSpec("FLASH_ATTN", 0, H, D, BF16), "block_size 0 must be"),
        (lambda: AttentionLayerSpec("FLASH_ATTN", N, -1, D, BF16), "num_kv_heads -1 must be"),
        (
            lambda: StandardLayerSpec("LBXNC", 1, 0, N, H, D, BF16),
            "unknown layout name 'LBXNC'; known: LBHNC, ",
        ),
        (lambda: StandardLayerSpec("LBHNC", 2, 2, N, H, D, BF16), "layer_index 2 must be in"),
    ],
    ids=["unknown-name", "not-a-backend", "block-size", "heads", "standard-name", "index"],
)
def test_layer_specs_are_checked_at_construction(make: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_capacity_must_be_positive(device: str) -> None:
    with pytest.raises(ValueError, match="capacity_blocks 0 must be positive"):
        ExtensibleKVCache(_one_layer("FLASH_ATTN"), 0, device)


def test_close_refuses_while_views_live_then_releases(make_cache: MakeCache) -> None:
    spec = [
        *_one_layer("FLASH_ATTN"),
        KVCacheTensorSpec(PAGE, {"other": AttentionLayerSpec("FLASHINFER", N, H, D, BF16)}),
    ]
    cache = make_cache(spec, CAPACITY)
    cache.commit(2)
    k, v = cache.committed_views()["attn"]
    with pytest.raises(BufferError):
        cache.close()
    # The buffer without live views is released anyway; the other waits for its views.
    assert [b.closed for b in cache.buffers] == [False, True]
    assert not cache.closed and cache.views == {}
    del k, v
    cache.close()
    assert cache.closed and all(b.closed for b in cache.buffers)
    with pytest.raises(ClosedError, match="closed"):
        cache.commit(3)


def test_leaving_with_on_an_exception_never_hides_it(device: str) -> None:
    """An exception raised in `with` while views are alive comes out unchanged, noted with
    the close that could not run; the views keep their memory until they die."""

    class Boom(Exception):
        pass

    with pytest.raises(Boom) as info:
        with ExtensibleKVCache(_one_layer("FLASH_ATTN"), CAPACITY, device) as cache:
            cache.commit(2)
            k = cache.committed_views()["attn"][0]
            raise Boom
    assert any("BufferError" in note for note in info.value.__notes__)
    assert not cache.closed
    k.fill_(1)
    del k, info
    cache.close()
    assert cache.closed


# ---------------------------------------------------------------------------------------------
# real-looking models


def _check_physical(cache: ExtensibleKVCache, spec: list[KVCacheTensorSpec]) -> None:
    """Every buffer holds its committed blocks, plus less than a granule per segment."""
    for buffer, tensor_spec, physical in zip(
        cache.buffers, spec, cache.buffer_physical_bytes, strict=True
    ):
        nominal = cache.committed_blocks * tensor_spec.block_bytes
        assert nominal <= physical <= nominal + buffer.num_segments * buffer.granularity
    assert cache.physical_bytes == sum(cache.buffer_physical_bytes)


def test_dense_model_28_layers(make_cache: MakeCache) -> None:
    # 28 layers, 8 KV heads, head size 128, block size 16, bf16, FlashAttention: 64 KiB pages
    # in 2 segments, one buffer per layer; 160 blocks reserve 280 MiB.
    page = 2 * 16 * 8 * 128 * 2
    layer = AttentionLayerSpec("FLASH_ATTN", 16, 8, 128, BF16)
    spec = [KVCacheTensorSpec(page, {f"model.layers.{i}.attn": layer}) for i in range(28)]
    cache = make_cache(spec, 160)
    assert cache.num_segments == (2,) * 28
    cache.commit(1)
    _check_physical(cache, spec)
    cache.commit(37)
    _check_physical(cache, spec)
    written = write_blocks(cache, 36, 1)
    assert committed_byte_sum(cache) == written


def test_hybrid_model_3_attention_to_1_mamba(make_cache: MakeCache) -> None:
    # Qwen3-Next-like: 8 layers, GatedDeltaNet at every 4th. As vLLM does, attention's block
    # size is raised (to a multiple of 16) until its page holds the Mamba state, and the
    # Mamba page is padded to match; each buffer is shared by one layer of each of the 4
    # groups (3 attention, 1 Mamba), whose blocks never overlap.
    token_bytes = 2 * 2 * 256 * 2  # K and V, 2 KV heads of 256, bf16
    unpadded = gated_delta_net_state_spec().block_bytes
    block_size = -(-unpadded // (16 * token_bytes)) * 16
    page = block_size * token_bytes
    gdn = MambaLayerSpec(gated_delta_net_state_spec(page_size_padded=page))
    attn = AttentionLayerSpec("FLASH_ATTN", block_size, 2, 256, BF16)
    spec = []
    for i in range(2):
        layers: dict[str, LayerSpec] = {f"layers.{i + 2 * g}": attn for g in range(3)}
        layers[f"layers.{i + 6}"] = gdn
        spec.append(KVCacheTensorSpec(page, layers))
    cache = make_cache(spec, 24)
    assert (block_size, page, cache.num_segments) == (544, 1114112, (1, 1))
    cache.commit(1)
    cache.commit(5)
    _check_physical(cache, spec)
    # One block per layer, distinct within a buffer: 3 attention blocks, then the Mamba one.
    targets = [
        blocks(view, block_dim, int(name.split(".")[1]) // 2 + 1)
        for name, block_dim, view in layer_views(cache)
    ]
    for target in targets:
        target.fill_(1)
    assert all(bool(target.eq(1).all()) for target in targets)
    assert committed_byte_sum(cache) == sum(byte_sum(target) for target in targets)


# ---------------------------------------------------------------------------------------------
# lending whole blocks to another cache (the core's lend/borrow runs on both backends in
# test_lend.py; these check the cache's block arithmetic on the host backend's small granules)


def _lending_pair(case: Case) -> tuple[ExtensibleKVCache, ExtensibleKVCache]:
    """A lender with blocks [0, 32) committed in two grows (so whole handles lie past block 8)
    and a pattern written, and a borrower of the same spec with 8 blocks committed."""
    make = lambda: ExtensibleKVCache(  # noqa: E731
        case.spec, 64, "cpu", granularity=4096, export_handle_types="posix_fd"
    )
    lender, borrower = make(), make()
    lender.commit(8)
    lender.commit(32)
    write_blocks(lender, 0, 8, seed=1)  # kept
    write_blocks(lender, 8, 24, seed=2)  # lent
    borrower.commit(8)
    return lender, borrower


@pytest.mark.parametrize("zero", [False, True], ids=["kept", "zeroed"])
def test_a_cache_lends_memory_and_takes_it_back(case: Case, zero: bool) -> None:
    lender, borrower = _lending_pair(case)
    # Where the lent memory begins: block 8 in every layout but FLASHMLA_SPARSE, whose 656-byte
    # rows put block 8's start inside a granule. The lender keeps that granule (a handle that
    # straddles the cut stays), the borrower holds its own there (slack past its 8 blocks, as
    # the same spec), and the loan is the memory from block 9's granule on: a loan is memory,
    # not the lender's blocks.
    lent = 9 if case.name == "FLASHMLA_SPARSE" else 8
    with lender, borrower:
        physical = lender.physical_bytes
        before = copies(lender, lent, 32 - lent)
        loans = lender.lend(8)
        assert lender.committed_blocks == 8 and lender.physical_bytes < physical
        check_blocks(lender, 0, 8, seed=1)
        assert borrower.borrow(loans, zero=zero) == 24
        assert borrower.committed_blocks == 32
        assert borrowed(borrower) == sum(loan.num_bytes for loan in loans)
        if zero:
            assert blocks_sum(borrower, 8, 24) == 0
        else:
            assert copies(borrower, lent, 32 - lent) == before  # the lender's bytes, as lent
        write_blocks(borrower, lent, 32 - lent, seed=7)
        borrower.give_back(loans)
        assert borrower.committed_blocks == 8 and borrowed(borrower) == 0
        lender.reclaim(loans, zero=zero)
        assert lender.committed_blocks == 32 and lender.physical_bytes == physical
        check_blocks(lender, 0, 8, seed=1)
        if zero:
            assert blocks_sum(lender, lent, 32 - lent) == 0
        else:
            check_blocks(lender, lent, 32 - lent, seed=7)  # what the borrower left, as it left it


def test_a_cache_refuses_what_it_cannot_borrow() -> None:
    case = CASES[0]  # FLASH_ATTN: 2 segments, 2 KiB a block per segment
    lender, borrower = _lending_pair(case)
    with lender, borrower:
        with pytest.raises(ValueError, match="cannot keep 32 blocks"):
            lender.lend(32)
        loans = lender.lend(8)
        with pytest.raises(ValueError, match="listed twice"):
            borrower.borrow([*loans, *loans])
        with pytest.raises(ValueError, match="own loan"):
            lender.borrow(loans)
        full = ExtensibleKVCache(
            case.spec, 9, "cpu", granularity=4096, export_handle_types="posix_fd"
        )
        with full:
            full.commit(9)
            with pytest.raises(ValueError, match="hold no block of this cache"):
                full.borrow(loans)
            assert full.committed_blocks == 9 and borrowed(full) == 0
        coarse = ExtensibleKVCache(case.spec, 64, "cpu", granularity=8192)
        with coarse, pytest.raises(ValueError, match="granularity must be the same"):
            coarse.borrow(loans)
        # 9 blocks of 2 KiB end inside a 4 KiB granule: its other half is slack, counted, and
        # the loan's memory begins after it (block 10), where a give-back cuts.
        borrower.commit(9)
        assert borrower.borrow(loans) == 25
        assert borrower.committed_blocks == 34
        borrower.give_back(loans)
        assert borrower.committed_blocks == 10
        with pytest.raises(ValueError, match="holds no handle of those loans"):
            borrower.give_back(loans)
        lender.reclaim(loans)
    legacy = ExtensibleKVCache(case.spec, 8, "cpu", legacy=True)
    with legacy, pytest.raises(ValueError, match="legacy cache"):
        legacy.lend(0)


def copies(cache: ExtensibleKVCache, first: int, count: int) -> list[bytes]:
    """The bytes of blocks `[first, first + count)` of every view."""
    return [
        blocks(view, block_dim, first, count).contiguous().view(torch.uint8).cpu().numpy().tobytes()
        for _, block_dim, view in layer_views(cache)
    ]


def borrowed(cache: ExtensibleKVCache) -> int:
    return sum(t.borrowed_bytes for t in cache.buffers)


def blocks_sum(cache: ExtensibleKVCache, first: int, count: int) -> int:
    """The sum of the bytes of blocks `[first, first + count)` of every view."""
    return sum(
        byte_sum(blocks(view, block_dim, first, count)) for _, block_dim, view in layer_views(cache)
    )
