"""transformers' engines in a node pool as the tests drive them, written once: the engines'
options, engine processes (`pool_transformers_engine.py`) and managers of one process, and
what the tests wait for and check in the ledger.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from support import transformers_models as tm

POOL = "tp"
STEP = 4  # sectors a commit (the unit an engine lends in)
SECTOR = 8192  # a sector of the tiny Llama: one block of 16 tokens, 2 layers, fp32
ENGINE_OPTIONS: dict[str, Any] = {
    "min_blocks": 2,
    "max_blocks": 40,
    "pool_step_blocks": STEP,
    "budget_bytes": 42 * SECTOR,
}


def engines(tmp_path: Path, procs: list[Any], names: list[str], **options: Any) -> list[Any]:
    """Engine processes `names` in the pool under `tmp_path`, started and joined."""
    import pool_transformers_engine as pte
    from pool_engine import joined

    ctx = pte.context()
    new = [
        pte.start(ctx, str(tmp_path), POOL, name, **{**ENGINE_OPTIONS, **options}) for name in names
    ]
    procs.extend(new)
    return [joined(proc) for proc in new]


def wait_for(what: str, condition: Callable[[], bool], seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"waited {seconds} s for {what}"
        time.sleep(0.01)


def check_consistent(pool: Any, procs: dict[str, Any]) -> Any:
    """The ledger now: consistent, and each live engine's entry what its process maps."""
    from extensible_kv.pool import rules
    from pool_engine import mapped_bytes

    ledger = pool.snapshot()
    assert rules.check(ledger) == [], [e.text for e in ledger.events]
    assert set(ledger.engines) == set(procs)
    for name, proc in procs.items():
        # The loop serves on its own thread: its heartbeat posts what it maps, and the entry
        # may lag by one serve.
        wait_for(
            f"{name}'s entry to match its mapping",
            lambda n=name, p=proc: pool.snapshot().engines[n].physical_bytes == mapped_bytes(p.pid),
        )
    return pool.snapshot()


def settled(pool: Any) -> Any:
    """The ledger once a recall is over: a loan was reclaimed, and every loan left is
    borrowed and not recalled."""

    def over() -> bool:
        ledger = pool.snapshot()
        reclaimed = any(" reclaimed " in event.text for event in ledger.events)
        return reclaimed and all(
            loan.state == "borrowed" and not loan.recall for loan in ledger.loans.values()
        )

    wait_for("a recall to be over", over)
    return pool.snapshot()


def events(pool: Any) -> list[str]:
    return [event.text for event in pool.snapshot().events]


def hold_nothing_free(pool: Any, device: str = "cpu") -> None:
    """The pool's share is what its engines hold now: a burst must borrow."""
    from extensible_kv.pool import rules

    pool.set_cap(device, rules.used_bytes(pool.snapshot(), device))


def burst_sectors(new_tokens: int = tm.MAX_NEW_TOKENS, tokens_per_sector: int = tm.PAGE) -> int:
    """The data sectors the test prompts need to finish on the tiny Llama (a block of a page a
    sector): each prompt plus its new tokens, in whole pages."""
    return sum(-(-(n + new_tokens) // tokens_per_sector) for n in tm.PROMPT_LENGTHS)


def granule_model(tf: Any, device: str) -> Any:
    """On the host, the tiny Llama (a sector of 8 KiB, two 4 KiB granules). On CUDA, a
    Qwen3 whose sector (16 tokens of 16 layers x 8 KV heads x 128 x float32, K and V) is one
    2 MiB granule, so that a burst of the test prompts needs more than a granule. float32:
    a random model's logits nearly tie, and in bf16 a batch scheduled otherwise than on
    transformers' own cache (which never waits for memory) flipped a token within 48 (H100)."""
    import torch

    if device == "cpu":
        return tm.build_model(tf, "llama", "sdpa", "cpu")
    config = tf.Qwen3Config(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(
        config, attn_implementation="sdpa", dtype=torch.float32
    )
    return model.to(device).eval()


def pooled_options(tmp_path: Path, **options: Any) -> dict[str, Any]:
    """`enable`'s options for managers of one process in the pool under `tmp_path`, on the
    host (a budget, granules of 4 KiB)."""
    from extensible_kv.pool import Pool

    return {
        "pool": Pool(POOL, directory=tmp_path),
        "granularity": 4096,
        **ENGINE_OPTIONS,
        **options,
    }


def in_process_options(pool: Any, device: str, tmp_path: Path, **options: Any) -> dict[str, Any]:
    """`enable`'s options for managers of one process in `pool`: on the host a budget's
    (`pooled_options`); on CUDA measured, not a budget, in granules of the device's."""
    if device == "cpu":
        return pooled_options(tmp_path, **options)
    return {"pool": pool, "min_blocks": 2, "max_blocks": 64, "pool_step_blocks": STEP, **options}


def burst_tokens(device: str) -> int:
    """The tokens a burst generates. On CUDA the warm-up's graph capture commits about ten
    sectors an engine: there the burst generates longer (about 25 blocks live at once), or it
    would fit in them."""
    return tm.MAX_NEW_TOKENS if device == "cpu" else 48


def member_of(manager: Any) -> Any:
    """The `PoolMember` of a running manager, once its loop has joined the pool (on the
    loop's own thread, as it starts)."""
    sizer = tm.state(manager).sizer
    wait_for("the loop to join the pool", lambda: sizer.joined is not None)
    return sizer.joined.member
