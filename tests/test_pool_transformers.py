"""transformers' continuous-batching engines in a node pool (`extensible_kv.transformers.enable(
pool=..., min_blocks=..., max_blocks=...)`, docs/design.md §11), on the host backend.

The engines are tiny random-weight Llamas (`test_transformers.build_model`), one process each
(`pool_transformers_engine.py`), whose generation loops serve the pool on their own threads
while the test sends them bursts of requests. The device's share of the pool is set so that a
burst finds no free memory: it must borrow from an idle engine, which lends its free top
sectors. Checked: the burst's greedy tokens equal the same prompts' run alone on transformers'
own cache; the ledger is consistent and says what each process maps (`/proc/<pid>/maps`); the
donor gets its memory back when it bursts in turn; a `kill -9` of either engine leaves the
ledger consistent and the other serving; limits changed at run time; and `via="driver"` (the
donor releases to the driver, the needy engine commits). In one process: the adapter's
geometry (the trash sectors below block 0, lends at sector boundaries past them, every change
mirrored in transformers' pool), the options' checks, and the hooks gone when a manager stops.

Skipped, with the reason, where transformers >=5.18,<5.26 is absent; CI sets
EKV_REQUIRE_TRANSFORMERS=1, which turns the skip into a failure.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import transformers_fixtures
from support import transformers_models as tm
from support.transformers_pool import (
    ENGINE_OPTIONS,
    POOL,
    SECTOR,
    STEP,
    burst_sectors,
    burst_tokens,
    check_consistent,
    engines,
    events,
    granule_model,
    hold_nothing_free,
    in_process_options,
    member_of,
    pooled_options,
    settled,
    wait_for,
)

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.transformers

# The fixtures every transformers test module shares (`support.transformers_fixtures`).
disabled_after = transformers_fixtures.disabled_after
tf = transformers_fixtures.tf


@pytest.fixture(scope="module")
def own(tf: Any) -> list[list[int]]:
    """The prompts' greedy tokens on transformers' own cache, alone."""
    return tm.generate(tf, tm.build_model(tf, "llama", "sdpa", "cpu"), "cpu")


@pytest.fixture
def procs() -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for proc in started:
        proc.stop()


def burst_on_an_idle_donor(tmp_path: Path, procs: list[Any], own: Any, **options: Any) -> Any:
    """Engines a and b: b bursts first (it commits free memory), then the pool holds nothing
    free and a bursts, taking b's free top sectors. Returns the pool, a and b."""
    from extensible_kv.pool import Pool

    pool = Pool(POOL, directory=tmp_path)
    pool.set_cap("cpu", 64 * SECTOR)
    a, b = engines(tmp_path, procs, ["a", "b"], **options)
    tokens, numbers = b("burst")
    assert tokens == own
    assert numbers["committed_blocks"] >= 2 + STEP  # it grew for the burst
    wait_for("b to say it is idle", lambda: not pool.snapshot().engines["b"].busy)
    hold_nothing_free(pool)
    check_consistent(pool, {"a": a, "b": b})
    b_before = pool.snapshot().engines["b"].committed_blocks
    tokens, numbers = a("burst")
    assert tokens == own, "the burst's tokens differ from the same prompts run alone"
    assert numbers["committed_blocks"] > ENGINE_OPTIONS["min_blocks"]
    # The burst asked for what its queue needs, not a step: its first ask covers the prompts
    # and their new tokens past what a held.
    asked, _ = numbers["asks"][0]
    assert asked >= burst_sectors() - ENGINE_OPTIONS["min_blocks"] > STEP, numbers["asks"]
    ledger = check_consistent(pool, {"a": a, "b": b})
    assert ledger.engines["b"].committed_blocks < b_before, "b gave nothing"
    return pool, a, b


@pytest.mark.timeout(300)
def test_a_burst_borrows_from_an_idle_engine_which_gets_it_back(
    tf: Any, own: Any, tmp_path: Path, procs: list[Any]
) -> None:
    pool, a, b = burst_on_an_idle_donor(tmp_path, procs, own)
    # a may have asked once more as its burst ended: that ask is answered (a loan) or lapses.
    wait_for(
        "a's last ask to be answered or to lapse",
        lambda: all(loan.state == "borrowed" for loan in pool.snapshot().loans.values()),
    )
    ledger = pool.snapshot()
    loans = list(ledger.loans.values())
    assert loans and all(
        (loan.lender, loan.borrower, loan.state) == ("b", "a", "borrowed") for loan in loans
    )
    lent = sum(loan.num_bytes for loan in loans)
    assert ledger.engines["a"].borrowed_bytes == ledger.engines["b"].lent_bytes == lent
    # Whole handles of b's (each commit its own), whole sectors of a's: nothing stranded.
    assert all(loan.num_bytes == loan.mapped_bytes == loan.blocks * SECTOR for loan in loans)
    assert any(e.startswith("loan ") and "a borrowed" in e for e in events(pool))
    # b bursts in turn: it recalls what it needs (newest first), a (idle) gives it back, b
    # reclaims it; what b did not need stays lent.
    tokens, _ = b("burst")
    assert tokens == own
    ledger = settled(pool)
    assert any("b recalls it" in e for e in events(pool))
    assert len(ledger.loans) < len(loans)
    check_consistent(pool, {"a": a, "b": b})
    # a bursts again: it borrows again, and the tokens are still its own.
    tokens, _ = a("burst")
    assert tokens == own
    check_consistent(pool, {"a": a, "b": b})
    # a stops first: it gives back every loan as it leaves, and b, serving, reclaims them.
    a("stop")
    wait_for("b to reclaim every loan", lambda: pool.snapshot().loans == {})
    ledger = check_consistent(pool, {"b": b})
    assert ledger.engines["b"].lent_bytes == 0
    b("stop")
    assert pool.snapshot().engines == {}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim", ["lender", "borrower"])
def test_kill_9_of_an_engine_leaves_the_ledger_consistent_and_the_other_serving(
    tf: Any, own: Any, tmp_path: Path, procs: list[Any], victim: str
) -> None:
    """a holds b's loans when one of them is killed. The lender killed: a keeps the memory
    (the loans are lender-less), serves on, and frees it as it gives them back. The borrower
    killed: its loans return to b, which reclaims them and serves on."""
    pool, a, b = burst_on_an_idle_donor(tmp_path, procs, own)
    assert pool.snapshot().loans
    dead, alive = (b, a) if victim == "lender" else (a, b)
    os.kill(dead.pid, signal.SIGKILL)
    killed = time.monotonic()
    # Whoever takes the lock next recovers the ledger, once the kernel has ended the process.
    ledger = pool.snapshot()
    while dead.name in ledger.engines:
        assert time.monotonic() - killed < 0.1, "not recovered within 100 ms"
        ledger = pool.snapshot()
    dead.process.join(timeout=10)
    check_consistent(pool, {alive.name: alive})
    if victim == "lender":
        assert all(loan.lender == "" for loan in ledger.loans.values())
    tokens, _ = alive("burst")
    assert tokens == own
    # Whatever the dead engine left is settled: the survivor gives back the orphans (freed)
    # or reclaims what the dead borrower held.
    wait_for("the dead engine's loans to end", lambda: pool.snapshot().loans == {})
    ledger = check_consistent(pool, {alive.name: alive})
    entry = ledger.engines[alive.name]
    assert entry.lent_bytes == entry.borrowed_bytes == 0
    assert any(f"{dead.name} (pid {dead.pid}) died" in e for e in events(pool))
    alive("stop")
    assert pool.snapshot().engines == {}


@pytest.mark.timeout(300)
def test_limits_changed_at_run_time(tf: Any, own: Any, tmp_path: Path, procs: list[Any]) -> None:
    """A lowered maximum takes effect as the idle engine serves: it gives back its free top
    sectors past it (at a handle boundary); a raised one lets it grow again."""
    from extensible_kv.pool import Pool

    pool = Pool(POOL, directory=tmp_path)
    (b,) = engines(tmp_path, procs, ["b"])
    tokens, numbers = b("burst")
    assert tokens == own and numbers["committed_blocks"] > 8

    def limit(*args: str) -> None:
        where = ["--pool", POOL, "--dir", str(tmp_path)]
        result = subprocess.run(
            [sys.executable, "-m", "extensible_kv", "pool", *where, "limit", "b", *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr

    limit("--max", "6")
    # 6 sectors: the handle boundary at or above it is the warm-up's 2 plus a step.
    wait_for("b to shrink to 6", lambda: pool.snapshot().engines["b"].committed_blocks == 6)
    _, numbers = b("numbers")
    assert numbers["committed_blocks"] == numbers["pool_sectors"] == 6
    check_consistent(pool, {"b": b})
    tokens, numbers = b("burst")  # six sectors serve the prompts, a few at a time
    assert tokens == own and numbers["committed_blocks"] == 6
    limit("--max", "40")
    tokens, numbers = b("burst")
    assert tokens == own and numbers["committed_blocks"] > 6
    check_consistent(pool, {"b": b})


@pytest.mark.timeout(300)
def test_via_the_driver_the_donor_releases_and_the_burst_commits(
    tf: Any, own: Any, tmp_path: Path, procs: list[Any]
) -> None:
    """`pool_via="driver"`, the benchmark's kvcached-like baseline: the idle donor gives its
    free top sectors back to the driver instead of lending them, and the bursting engine
    commits them from the device's free memory. No loan is ever made."""
    pool, a, b = burst_on_an_idle_donor(tmp_path, procs, own, pool_via="driver")
    texts = events(pool)
    assert any("b released" in e and "to the driver for a" in e for e in texts)
    assert not any("offers" in e or "borrowed" in e for e in texts)
    ledger = pool.snapshot()
    assert ledger.loans == {}
    assert all(e.lent_bytes == e.borrowed_bytes == 0 for e in ledger.engines.values())
    tokens, _ = b("burst")  # b gets memory back the same way
    assert tokens == own
    check_consistent(pool, {"a": a, "b": b})
    assert not any("offers" in e for e in events(pool))


# ---------------------------------------------------------------------------------------------
# in one process


def test_the_adapter_lends_borrows_and_cuts_past_the_trash_sectors(tf: Any, tmp_path: Path) -> None:
    """`SectorCache` is transformers' cache as a `PoolMember` drives it: one segment whose
    block 0 is the first sector past the two trash sectors. Lend points, lends, borrows,
    give-backs and reclaims fall on sector boundaries past the trash, and transformers' pool
    follows each (its free sectors, its size); sectors a request holds are never lent."""
    from extensible_kv import transformers as ekt
    from extensible_kv.pool.caches import lend_points
    from extensible_kv.transformers.sector_cache import SectorCache
    from extensible_kv.transformers.state import TRASH_SECTORS

    with ekt.enabled(**pooled_options(tmp_path)):
        lender = tm.warmed_up(tf, tm.build_model(tf, "llama", "sdpa", "cpu"))
        borrower = tm.warmed_up(tf, tm.build_model(tf, "llama", "sdpa", "cpu"))
    caches = [m.batch_processor.cache for m in (lender, borrower)]
    a, b = (SectorCache(cache) for cache in caches)
    state = tm.state(caches[0])
    sector = state.bytes_per_sector
    assert sector == SECTOR and state.tensor.export_handle_types & 1
    assert state.sizer.min_sectors == 2 and state.committed_sectors == 2  # min_blocks
    assert a.footprint().leading_blocks == TRASH_SECTORS == 2
    assert (a.num_segments, a.segment_block_bytes, a.capacity_blocks) == ((1,), (sector,), 48)
    assert a.shape().to_json() == {
        "device": "cpu",
        "granularity": 4096,
        "buffers": [[1, sector]],
        "leading_blocks": TRASH_SECTORS,
    }
    a.commit(6)
    a.commit(10)
    pool = caches[0].pool
    assert sorted(pool.free_sectors) == list(range(2, 12)) and pool.num_sectors == 10
    # Handles begin at the trash's end and at each commit's: blocks 0, 2 and 6.
    assert lend_points(a) == {0, 2, 6}
    assert a.free_tail_blocks() == 10
    # A request holding sector 8 (block 6): only the 3 sectors above it are free at the top.
    allocator = next(iter(caches[0].cache_allocators.values()))
    allocator.block_table["held"] = [8 * allocator.blocks_per_sector]
    assert a.free_tail_blocks() == 3
    with pytest.raises(ValueError, match="requests hold sectors past it"):
        a.lend(6)
    assert a.committed_blocks == 10 and len(pool.free_sectors) == 10  # nothing changed
    del allocator.block_table["held"]
    (loan,) = a.lend(6)
    assert loan.num_bytes == 4 * sector
    assert state.tensor.bytes_per_segment == (TRASH_SECTORS + 6) * sector
    assert (a.committed_blocks, pool.num_sectors, caches[0].num_blocks) == (6, 6, 6)
    assert sorted(pool.free_sectors) == list(range(2, 8))
    # The borrower maps it past its own 2 sectors: its sectors 2 to 5 (tensor sectors 4 to 7).
    assert b.borrow([loan], zero=True) == 4
    other = caches[1].pool
    assert b.committed_blocks == other.num_sectors == 6
    assert sorted(other.free_sectors) == list(range(2, 8))
    assert tm.state(caches[1]).tensor.borrowed_bytes == 4 * sector
    with pytest.raises(ValueError, match="2 loans, one of them listed twice"):
        b.give_back([loan, loan])
    b.give_back([loan])
    assert b.committed_blocks == other.num_sectors == 2
    assert sorted(other.free_sectors) == [2, 3]
    a.reclaim([loan], timeout=5)
    assert a.committed_blocks == pool.num_sectors == 10
    assert sorted(pool.free_sectors) == list(range(2, 12))
    a.shrink_to(2)
    assert a.wait_released(5)
    assert state.tensor.bytes_per_segment == 4 * sector and pool.num_sectors == 2


def test_the_adapter_moves_held_sectors_down_between_steps_only(tf: Any, tmp_path: Path) -> None:
    """`SectorCache` as a `MovingCache`: outside the loop's steps (inside transformers'
    scheduler, where the member serves too) it offers only its free top sectors and refuses
    to move; between steps it counts every free sector and moves a held one below the cut,
    bytes and block table with it."""
    from extensible_kv import transformers as ekt
    from extensible_kv.transformers.sector_cache import SectorCache

    with ekt.enabled(**pooled_options(tmp_path)):
        manager = tm.warmed_up(tf, tm.build_model(tf, "llama", "sdpa", "cpu"))
    cache = manager.batch_processor.cache
    a = SectorCache(cache)
    a.commit(10)  # tensor sectors 2 to 11
    allocator = next(iter(cache.cache_allocators.values()))
    per = allocator.blocks_per_sector
    held = list(range(8 * per, 9 * per))  # tensor sector 8, block 6
    allocator.block_table["held"] = held
    cache.pool.free_sectors.remove(8)
    for block in held:
        allocator._copy_view[block].fill_(3)
    assert a.free_blocks() == a.free_tail_blocks() == 3
    with pytest.raises(RuntimeError, match="between the generation loop's steps"):
        a.move_below(2)
    a.between_steps = True
    assert a.free_blocks() == 9
    a.move_below(2)  # below tensor sector 4: into sector 2, the lowest free
    assert allocator.block_table["held"] == list(range(2 * per, 3 * per))
    assert all(bool(allocator._copy_view[b].eq(3).all()) for b in range(2 * per, 3 * per))
    assert a.free_tail_blocks() == 9 and 8 in cache.pool.free_sectors
    assert 2 not in cache.pool.free_sectors


@pytest.mark.timeout(300)
def test_two_managers_in_one_process_lend_and_take_back(
    tf: Any, device: str, tmp_path: Path
) -> None:
    """Two managers of one process in one pool, each serving from its own loop thread: the
    burst on one borrows the idle one's free top sectors, with the tokens of the same prompts
    run alone on transformers' own cache, and the donor takes them back when it bursts. On
    CUDA the extension measures, the model's sector is one 2 MiB granule, and the decode
    steps replay CUDA graphs into borrowed memory."""
    from extensible_kv import transformers as ekt
    from extensible_kv.pool import Pool, rules

    donor_model, needy_model = (granule_model(tf, device) for _ in range(2))
    new_tokens = burst_tokens(device)
    own = tm.generate(tf, needy_model, device, new_tokens)
    pool = Pool(POOL, directory=tmp_path)
    options = in_process_options(pool, device, tmp_path)
    with contextlib.ExitStack() as stack:
        stack.enter_context(ekt.enabled(**options))
        donor, needy = (
            stack.enter_context(
                model.continuous_batching_context_manager(
                    generation_config=tm.gen_config(tf),
                    continuous_batching_config=tm.cb_config(tf, device),
                )
            )
            for model in (donor_model, needy_model)
        )
        assert tm.run(donor, new_tokens) == own
        wait_for(
            "the donor to be idle",
            lambda: not any(e.busy for e in pool.snapshot().engines.values()),
        )
        hold_nothing_free(pool, device)
        assert tm.run(needy, new_tokens) == own
        ledger = pool.snapshot()
        assert rules.check(ledger) == []
        borrowed = [loan for loan in ledger.loans.values() if loan.state == "borrowed"]
        assert borrowed, [e.text for e in ledger.events]
        sector = tm.state(needy).bytes_per_sector
        # Whole handles of the donor's, whole sectors of the needy one's: nothing stranded.
        assert all(loan.num_bytes == loan.mapped_bytes == loan.blocks * sector for loan in borrowed)
        assert tm.run(donor, new_tokens) == own  # it recalls what it needs of what it lent
        ledger = settled(pool)
        assert len(ledger.loans) < len(borrowed)
        assert rules.check(ledger) == []
        assert tm.run(needy, new_tokens) == own
        assert rules.check(pool.snapshot()) == []
    # The needy engine left first, giving back what it held; the donor reclaimed it.
    assert pool.snapshot().engines == {} and pool.snapshot().loans == {}


@pytest.mark.timeout(300)
def test_a_busy_donor_with_pool_move_moves_its_live_sectors_down_and_lends(
    tf: Any, device: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`pool_move=True`: the donor's requests hold its top sectors, so it has no free top to
    lend; asked by a burst on the other manager, it moves them down between its steps and
    lends the free sectors above. Its requests' tokens are those of the same requests on an
    unmoved cache, and the burst's those of transformers' own cache. On CUDA the blocks move
    with transformers' `copy_blocks` on the device, between steps that replay CUDA graphs."""
    from extensible_kv import transformers as ekt
    from extensible_kv.pool import Pool, rules
    from extensible_kv.transformers import sectors

    donor_model, needy_model = (granule_model(tf, device) for _ in range(2))
    new_tokens = burst_tokens(device)
    own = tm.generate(tf, needy_model, device, new_tokens)
    pool = Pool(POOL, directory=tmp_path)
    options = in_process_options(pool, device, tmp_path, pool_move=True)
    if device == "cpu":
        pool.set_cap("cpu", 64 * 8192)
    caplog.set_level(logging.INFO, logger="extensible_kv")
    long = tm.prompts()[:3]
    with contextlib.ExitStack() as stack:
        stack.enter_context(ekt.enabled(**options))
        donor, needy = (
            stack.enter_context(
                model.continuous_batching_context_manager(
                    generation_config=tm.gen_config(tf),
                    continuous_batching_config=tm.cb_config(tf, device),
                )
            )
            for model in (donor_model, needy_model)
        )
        reference = tm.collect(donor, donor.add_requests(long, max_new_tokens=120))
        ids, _ = tm.add_on_top_sectors(donor, long, 120)
        assert sectors.busy_requests(donor.batch_processor.cache)
        hold_nothing_free(pool, device)
        assert tm.run(needy, new_tokens) == own
        assert tm.collect(donor, ids) == reference
        ledger = pool.snapshot()
        assert rules.check(ledger) == []
        said = [r.getMessage() for r in caplog.records]
        assert any("move down first" in m and ": lend " in m for m in said), said
        assert any(m.startswith("Moved ") for m in said)
        assert any(" borrowed " in e.text for e in ledger.events), [e.text for e in ledger.events]
    assert pool.snapshot().engines == {} and pool.snapshot().loans == {}


def test_counts_keep_the_committed_end_on_a_granule_boundary(
    tf: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With granules of two sectors, a borrow needs the committed end (past the two trash
    sectors) on an even sector: the plan's least is rounded up to one, and its step to whole
    granules, so each step's handles are whole sectors. The config's 48 blocks are more than
    the pool's maximum of 40: a warning says that transformers' reads are sized past it."""
    from extensible_kv import transformers as ekt

    caplog.set_level(logging.WARNING, logger="extensible_kv")
    options = pooled_options(tmp_path, granularity=16384, min_blocks=1, pool_step_blocks=3)
    with ekt.enabled(**options):
        manager = tm.warmed_up(tf, tm.build_model(tf, "llama", "sdpa", "cpu"))
    sizer = tm.state(manager).sizer
    assert (sizer.min_sectors, sizer.step_sectors, sizer.max_sectors) == (2, 4, 40)
    assert sizer.engine.startswith("transformers-") and sizer.via == "loan"
    assert any(
        "sized for 48 blocks, more than this pooled cache's max_blocks=40" in r.getMessage()
        and "ContinuousBatchingConfig(num_blocks=40)" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]


@pytest.mark.timeout(120)
def test_a_pooled_manager_joins_while_its_loop_runs_and_leaves_nothing_behind(
    tf: Any, own: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The cache joins as the loop starts and leaves as it ends; meanwhile the manager's
    serving hooks are its own (instance attributes), and resize / suspend (and `release`, its
    deprecated name), which would change its size behind the pool's back, are refused. After
    it stops, nothing of the pool is left on the manager or in the ledger."""
    from extensible_kv import transformers as ekt
    from extensible_kv.pool import Pool

    caplog.set_level(logging.INFO, logger="extensible_kv")
    model = tm.build_model(tf, "llama", "sdpa", "cpu")
    pool = Pool(POOL, directory=tmp_path)
    with (
        ekt.enabled(**pooled_options(tmp_path, engine="solo")),
        model.continuous_batching_context_manager(
            generation_config=tm.gen_config(tf), continuous_batching_config=tm.cb_config(tf, "cpu")
        ) as manager,
    ):
        assert tm.run(manager) == own
        (entry,) = pool.snapshot().engines.values()
        assert entry.name == "solo" and entry.committed_blocks > 2  # it grew for the burst
        assert "_generation_loop_body" in vars(manager)
        assert type(manager._wake_up_loop) is not threading.Event
        with pytest.raises(RuntimeError, match="sized by the node pool"):
            ekt.resize(manager, 4)
        with pytest.raises(RuntimeError, match=r"cannot suspend on its own.*pool limit solo"):
            ekt.suspend(manager)
        with (
            pytest.warns(DeprecationWarning, match="call extensible_kv.transformers.suspend"),
            pytest.raises(RuntimeError, match="pool limit solo"),
        ):
            ekt.release(manager)
        cache = manager.batch_processor.cache
    assert pool.snapshot().engines == {}
    assert "_generation_loop_body" not in vars(manager)
    assert type(manager._wake_up_loop) is threading.Event
    assert tm.state(cache).sizer.joined is None
    messages = [r.getMessage() for r in caplog.records if r.name == "extensible_kv"]
    assert any(m.startswith("KV cache joined pool tp as solo") for m in messages)
    assert any(m.startswith("Grew KV cache through the pool") for m in messages)
    assert any(m.startswith("KV cache left pool tp (solo)") for m in messages)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_pool_options_are_checked(tf: Any, tmp_path: Path) -> None:
    from extensible_kv import transformers as ekt
    from extensible_kv.pool import Pool

    with pytest.raises(ValueError, match="pool and auto_resize both size the cache"):
        ekt.enable(pool="p", auto_resize=True, budget_bytes=1 << 20)
    with pytest.raises(ValueError, match="min_blocks, max_blocks without pool"):
        ekt.enable(min_blocks=2, max_blocks=4)
    with pytest.raises(ValueError, match="pool_via without pool"):
        ekt.enable(pool_via="driver")
    with pytest.raises(ValueError, match="pool_via must be one of 'loan', 'driver'"):
        ekt.enable(pool="p", pool_via="dma")
    with pytest.raises(ValueError, match="pool_move without pool"):
        ekt.enable(pool_move=True)
    with pytest.raises(TypeError, match="pool_move"):
        ekt.enable(pool="p", pool_move="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_blocks 2 is below min_blocks 4"):
        ekt.enable(pool="p", min_blocks=4, max_blocks=2)
    with pytest.raises(ValueError, match="min_blocks must be at least 1"):
        ekt.enable(pool="p", min_blocks=0)
    with pytest.raises(TypeError, match="pool must be a pool's name or a Pool"):
        ekt.enable(pool=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="engine 'a b'"):
        ekt.enable(pool="p", engine="a b")
    with pytest.raises(ValueError, match=r"pool '\.\./x'"):
        ekt.enable(pool="../x")
    assert not ekt.is_enabled()
    ekt.enable(pool=Pool("p", directory=tmp_path), min_blocks=2, engine="e", pool_via="driver")
    options = ekt.patch.current_options()
    assert options is not None and (options.min_blocks, options.pool_via) == (2, "driver")
    with pytest.raises(ValueError, match="min_bytes, max_bytes without pool"):
        ekt.enable(min_bytes=1 << 20, max_bytes=2 << 20)
    with pytest.raises(ValueError, match="give min_blocks or min_bytes, not both"):
        ekt.enable(pool="p", min_blocks=2, min_bytes=1 << 20)
    with pytest.raises(ValueError, match="give max_blocks or max_bytes, not both"):
        ekt.enable(pool="p", max_blocks=2, max_bytes=1 << 20)
    with pytest.raises(ValueError, match="max_bytes 4096 is below min_bytes 8192"):
        ekt.enable(pool="p", min_bytes=8192, max_bytes=4096)
    with pytest.raises(ValueError, match="min_bytes must be at least 1"):
        ekt.enable(pool="p", min_bytes=0)
    with pytest.raises(TypeError, match="max_bytes must be an int"):
        ekt.enable(pool="p", max_bytes=1.5e9)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="min_bytes must be an int"):
        ekt.enable(pool="p", min_bytes=True)
    assert ekt.patch.current_options() is not None  # the last good enable stays in force
    ekt.enable(pool="p", min_blocks=2, max_bytes=np_int(1 << 20))
    options = ekt.patch.current_options()
    assert options is not None and (options.min_blocks, options.max_bytes) == (2, 1 << 20)
    assert type(options.max_bytes) is int


def np_int(value: int) -> Any:
    import numpy as np

    return np.int64(value)


@pytest.mark.parametrize(
    ("limits", "expected"),
    [
        # Sectors of 8,192 bytes: the fewest that hold min_bytes, the most that fit in max_bytes.
        ({"min_bytes": 3 * SECTOR + 1, "max_bytes": 20 * SECTOR - 1}, (4, 19)),
        ({"min_bytes": 1, "max_blocks": 12}, (1, 12)),
        ({"min_blocks": 2, "max_bytes": 10 * SECTOR}, (2, 10)),
    ],
    ids=["bytes", "min_bytes", "max_bytes"],
)
def test_limits_in_bytes_become_the_models_sectors(
    tf: Any, tmp_path: Path, limits: dict[str, int], expected: tuple[int, int]
) -> None:
    """`enable(pool=..., min_bytes=..., max_bytes=...)`: a block's bytes differ from model to
    model, so the limits may be bytes; the cache's limits in the pool are then the fewest of
    its sectors that hold `min_bytes` and the most that fit in `max_bytes` (data sectors: the
    trash is not counted), which the ledger shows, and the extension starts at the least."""
    from extensible_kv import transformers as ekt
    from extensible_kv.pool import Pool

    options = {**pooled_options(tmp_path), "min_blocks": None, "max_blocks": None, **limits}
    model = tm.build_model(tf, "llama", "sdpa", "cpu")
    pool = Pool(POOL, directory=tmp_path)
    with (
        ekt.enabled(**options),
        model.continuous_batching_context_manager(
            generation_config=tm.gen_config(tf), continuous_batching_config=tm.cb_config(tf, "cpu")
        ) as manager,
    ):
        state = tm.state(manager)
        assert (state.sizer.min_sectors, state.sizer.max_sectors) == expected
        assert state.committed_sectors == expected[0]
        member_of(manager)  # joined
        (entry,) = pool.snapshot().engines.values()
        assert (entry.min_blocks, entry.max_blocks) == expected
        assert entry.block_bytes == SECTOR


@pytest.mark.timeout(120)
def test_a_burst_asks_once_for_what_its_queue_needs(
    tf: Any, own: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Five requests arrive at once on an engine of 2 sectors. transformers' scheduler finds
    too few free sectors for the second, and the cache asks the pool once, for what every
    request needs to finish (its prompt plus its new tokens, less what the first took), not
    for a step: the ask covers the burst, is met at once from free memory, and no further ask
    follows; its wait runs from the first request's arrival. The tokens are transformers' own
    cache's."""
    from extensible_kv import transformers as ekt

    caplog.set_level(logging.INFO, logger="extensible_kv.pool")
    model = tm.build_model(tf, "llama", "sdpa", "cpu")
    step = 2  # what the cache asked for before: at least a step, which is far less
    with (
        ekt.enabled(**pooled_options(tmp_path, pool_step_blocks=step)),
        model.continuous_batching_context_manager(
            generation_config=tm.gen_config(tf), continuous_batching_config=tm.cb_config(tf, "cpu")
        ) as manager,
    ):
        state = tm.state(manager)
        member = member_of(manager)
        before = state.committed_sectors
        assert before == ENGINE_OPTIONS["min_blocks"] and member.asks == []
        with manager.pause():  # the burst reaches the scheduler's queue at once
            started = time.monotonic()
            ids = manager.add_requests(tm.prompts(), max_new_tokens=tm.MAX_NEW_TOKENS)
        assert tm.collect(manager, ids) == own
        (ask,) = member.asks
        need = burst_sectors() - before
        assert need > step
        assert ask.asked_blocks >= need, ask
        assert ask.asked_bytes == ask.asked_blocks * SECTOR
        assert ask.met and ask.got_blocks >= need and ask.committed_blocks == ask.got_blocks
        assert state.committed_sectors >= burst_sectors()
        assert ask.since >= started - 1 and 0 <= ask.wait_s < 30
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pool ask:")]
    assert len(said) == 1 and f"asked_blocks={ask.asked_blocks}" in said[0], said
