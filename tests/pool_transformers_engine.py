"""A transformers engine process for the pool's tests: a tiny random-weight Llama
(`support.transformers_models.build_model`) behind a running continuous-batching manager,
created while `extensible_kv.transformers.enable(pool=...)` is on, driven by commands over a
pipe.

Its generation loop serves the pool on its own thread, as a real engine's does; the commands
arrive on the process's main thread: `burst` runs the test prompts through the manager and
returns their greedy tokens, `numbers` what its cache holds (and its member's asks), `stop`
stops the manager (which leaves the pool).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from typing import Any

from pool_engine import Proc

PAGE_BYTES = 8192  # a sector of the tiny Llama: one block of 16 tokens, 2 layers, fp32
GRANULE = 4096
TIMEOUT_S = 120


def _main(conn: Any, directory: str, pool_name: str, name: str, options: dict[str, Any]) -> None:
    import transformers as tf
    from extensible_kv import transformers as ekt
    from extensible_kv.pool import Pool
    from support import transformers_models as tt

    try:
        model = tt.build_model(tf, "llama", "sdpa", "cpu")
        ekt.enable(
            pool=Pool(pool_name, directory=directory),
            engine=name,
            granularity=GRANULE,
            **options,
        )
        manager = model.init_continuous_batching(
            generation_config=tt.gen_config(tf),
            continuous_batching_config=tt.cb_config(tf, "cpu"),
        )
        manager.warmup()
        manager.start()
        while manager.batch_processor is None or tt.state(manager).sizer.joined is None:
            if not manager.is_running():
                raise RuntimeError("the generation loop ended before its cache joined the pool")
            time.sleep(0.005)
        cache = manager.batch_processor.cache
        state = tt.state(cache)
        conn.send(("ok", os.getpid()))
        while True:
            command, *rest = conn.recv()
            result: Any = None
            if command == "burst":
                prompts = tt.prompts()[: rest[0]] if rest else tt.prompts()
                ids = manager.add_requests(prompts, max_new_tokens=tt.MAX_NEW_TOKENS)
                result = tt.collect(manager, ids)
            elif command == "stop":
                manager.stop(block=True, timeout=60)
                conn.send(("ok", None, {}))
                return
            joined = state.sizer.joined
            numbers = {
                "committed_blocks": state.committed_sectors,
                "physical_bytes": state.tensor.physical_bytes,
                "lent_bytes": state.tensor.lent_bytes,
                "borrowed_bytes": state.tensor.borrowed_bytes,
                "pool_sectors": cache.pool.num_sectors,
                # (asked, got) in its sectors, oldest first
                "asks": []
                if joined is None
                else [(ask.asked_blocks, ask.got_blocks) for ask in joined.member.asks],
            }
            conn.send(("ok", result, numbers))
    except BaseException as error:  # report, so the parent fails with the child's reason
        conn.send(("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


def context() -> Any:
    """A fork server that imported torch, transformers and the library once: each engine
    starts without importing them again."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "transformers", "extensible_kv.transformers", "support.transformers_models"]
    )
    return ctx


def start(ctx: Any, directory: str, pool: str, name: str, **options: Any) -> Proc:
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_main, args=(child, directory, pool, name, options), daemon=True)
    process.start()
    return Proc(name, process, parent, timeout_s=TIMEOUT_S, stop_s=TIMEOUT_S)
