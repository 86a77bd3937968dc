"""The node pool bench's engine processes (`bench_pool.py`), and the driver's handle on them.

Each engine is one process (spawned on a GPU: its own CUDA context; on the host, forks of one
server that imported torch and transformers once) with a model of its own
(`pool_models.ModelShape`, random weights), behind a pipe of its own: a `kill -9` of one
engine breaks only its pipe, never a queue the others write to. The engine streams each
request's first token and finish as they happen (`first`, `done`), so a killed engine's
requests are accounted for up to its death; the memory it sampled, its log records and its
asks (`PoolMember.asks`) come with its reply when a setup stops.
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import threading
import time
import traceback
from typing import Any

from common import GIB, log

SAMPLE_S = 0.01  # the memory sampler's period
MAX_LOG_RECORDS = 4000  # per engine and setup
MEMFD = "/memfd:extensible-kv:"  # extensible_kv.pool._proc.HOST_MEMFD


def memfds() -> int:
    """This process's open memfds of extensible-kv (the host backend's memory)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        count += target.startswith(MEMFD)
    return count


def mapped_bytes(pid: int) -> int:
    """The bytes of the host backend's memory process `pid` maps (`/proc/<pid>/maps`)."""
    from extensible_kv.pool._proc import mapped_host_bytes

    return mapped_host_bytes(pid)


def digest(tokens: list[int]) -> str:
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


class _Sampler:
    """The tensor's `physical_bytes` every `SAMPLE_S` on a thread; keeps the changes. Also
    keeps the cache's pool member once it joined (its asks are read as the setup stops)."""

    def __init__(self, manager: Any) -> None:
        self.state = manager.batch_processor.cache._ekv
        self.tensor = self.state.tensor
        self.member: Any = None
        self.t: list[float] = []
        self.bytes: list[int] = []
        self.samples = 0
        self.running = True
        self._sample()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        now, value = time.monotonic(), int(self.tensor.physical_bytes)
        self.samples += 1
        if self.member is None and self.state.pooled is not None:
            self.member = self.state.pooled.member
        if not self.bytes or value != self.bytes[-1]:
            self.t.append(now)
            self.bytes.append(value)

    def _loop(self) -> None:
        while self.running:
            time.sleep(SAMPLE_S)
            self._sample()

    def stop(self) -> dict[str, Any]:
        self.running = False
        self.thread.join()
        self._sample()
        self.t.append(time.monotonic())  # the level held to the end
        self.bytes.append(self.bytes[-1])
        self.tensor = self.state = None  # the cache's memory goes with the manager
        return {"t": self.t, "bytes": self.bytes, "samples": self.samples}


def asks_of(member: Any) -> list[dict[str, Any]]:
    """A pool member's asks (`PoolMember.asks`), as JSON."""
    if member is None:
        return []
    return [
        {
            "since": ask.since,
            "wait_ms": ask.wait_s * 1e3,
            "asked_bytes": ask.asked_bytes,
            "got_bytes": ask.got_bytes,
            "asked_blocks": ask.asked_blocks,
            "got_blocks": ask.got_blocks,
            "committed_blocks": ask.committed_blocks,
            "borrowed_blocks": ask.borrowed_blocks,
            "lenders": list(ask.lenders),
            "met": ask.met,
        }
        for ask in member.asks
    ]


class _Results:
    """Reads the manager's streamed results on a thread and sends each request's first token
    and finish to the driver as they come."""

    def __init__(self, manager: Any, send: Any, keep_tokens: set[str]) -> None:
        self.manager = manager
        self.send = send
        self.keep_tokens = keep_tokens
        self.first: set[str] = set()
        self.done: set[str] = set()
        self.running = True
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while self.running:
            result = self.manager.get_result(timeout=0.05)
            now = time.monotonic()
            if result is None:
                time.sleep(0.001)  # get_result returns at once once the loop has stopped
                continue
            rid = result.request_id
            if result.generated_tokens and rid not in self.first:
                self.first.add(rid)
                self.send("first", (rid, now))
            if result.is_finished() and rid not in self.done:
                self.done.add(rid)
                tokens = list(result.generated_tokens)
                row = {
                    "finish": now,
                    "n_tokens": len(tokens),
                    "sha": digest(tokens),
                    "error": None if result.error is None else str(result.error),
                    **({"tokens": tokens} if rid in self.keep_tokens else {}),
                }
                self.send("done", (rid, row))

    def stop(self) -> None:
        self.running = False
        self.thread.join()


class _LogRecords:
    """The `extensible_kv` loggers' records (the pool's decisions and asks, the resizes)."""

    def __init__(self) -> None:
        import logging

        self.records: list[list[Any]] = []
        self.dropped = 0

        class Handler(logging.Handler):
            def emit(inner, record: logging.LogRecord) -> None:
                if len(self.records) < MAX_LOG_RECORDS:
                    self.records.append([time.monotonic(), record.name, record.getMessage()])
                else:
                    self.dropped += 1

        self.handler = Handler(logging.INFO)
        self.logger = logging.getLogger("extensible_kv")
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self.handler)

    def close(self) -> list[list[Any]]:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)
        return self.records


def enable_setup(kind: str, sizes: dict[str, Any], mine: dict[str, Any], engine: str) -> None:
    """Enables setup `kind` in this engine process, named `engine` in the pool: the one place
    that calls `extensible_kv.transformers.enable`. `sizes`: the setup's; `mine`: this
    engine's (its blocks). Static and oracle engines have no pool: a budget of their own (an
    equal share of the bytes, or all of them)."""
    import extensible_kv.transformers as ekt

    granularity = {"granularity": sizes["granularity"]} if sizes["granularity"] else {}
    if kind in ("static", "oracle"):
        budget = sizes["static_bytes"] if kind == "static" else sizes["total_bytes"]
        ekt.enable(budget_bytes=budget, **granularity)
        return
    # The host backend has no free-memory figure: the most this engine may hold is its budget.
    budget = {} if sizes["gpu"] else {"budget_bytes": mine["max_blocks"] * mine["block_bytes"]}
    step = {"pool_step_blocks": sizes["step_blocks"]} if sizes["step_blocks"] else {}
    ekt.enable(
        pool=sizes["pool"],
        engine=engine,
        min_blocks=mine["min_blocks"],
        max_blocks=mine["max_blocks"],
        pool_via=sizes["via"],
        pool_move=kind == "move",
        **budget,
        **granularity,
        **step,
    )


class Engine:
    """One engine's process: its model, and a manager per setup."""

    def __init__(self, index: int, config: dict[str, Any], conn: Any) -> None:
        import torch
        from extensible_kv._demo import serve
        from pool_models import ModelShape, build_model

        self.index, self.config, self.conn = index, config, conn
        self.lock = threading.Lock()
        self.device = torch.device(config["device"])
        if self.device.type == "cpu":
            torch.set_num_threads(1)  # the engines share the host's cores
        self.shape = ModelShape(**{**config["model"], "sliding": tuple(config["model"]["sliding"])})
        self.options = serve.DemoOptions(
            device=config["device"],
            new_tokens=config["new_tokens"],
            max_batch_tokens=config["max_batch_tokens"],
            num_blocks=config["num_blocks"],
            progress=False,
        ).resolved()
        start = time.perf_counter()
        self.model = build_model(
            self.shape, config["device"], getattr(torch, config["dtype"]), config["seed"]
        )
        self.model_s = time.perf_counter() - start
        self.model_allocated = self._torch_memory()["allocated"]
        self.tensor: Any = None  # the running setup's cache tensor

    def send(self, kind: str, payload: Any) -> None:
        with self.lock:
            self.conn.send((kind, self.index, payload))

    def info(self) -> dict[str, Any]:
        import torch
        import transformers
        from extensible_kv._demo import serve

        cb_config = serve._cb_config(self.options, self.device)
        info = {
            "pid": os.getpid(),
            "model_s": self.model_s,
            "model": self.shape.name,
            "vocab": self.model.config.vocab_size,
            "page_size": cb_config.page_size,
            "block_bytes": self.shape.block_bytes(self.model.dtype.itemsize, cb_config.page_size),
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "shape": self.shape.describe(),
            "weight_bytes": self.model_allocated,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        }
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            info.update(device=props.name, total_memory_gib=props.total_memory / GIB)
        return info

    def _torch_memory(self) -> dict[str, int]:
        """What torch's allocator holds in this process (0 on the host)."""
        import torch

        if self.device.type != "cuda":
            return {"allocated": 0, "reserved": 0}
        return {
            "allocated": int(torch.cuda.memory_allocated(self.device)),
            "reserved": int(torch.cuda.memory_reserved(self.device)),
        }

    def free_bytes(self, empty: bool = True) -> int | None:
        import gc

        import torch

        if self.device.type != "cuda":
            return None
        if empty:
            gc.collect()
            torch.cuda.empty_cache()
        return int(torch.cuda.mem_get_info(self.device)[0])

    def probe(self) -> dict[str, Any]:
        """What this process holds now: its cache's `physical_bytes`, the host backend's memory
        it maps (`/proc/self/maps`), torch's allocator, and on a GPU the device's free memory
        (`torch.cuda.mem_get_info`, torch's cache not emptied: what it reserves is counted)."""
        tensor = self.tensor
        return {
            "pid": os.getpid(),
            "t": time.monotonic(),
            "physical_bytes": 0 if tensor is None else int(tensor.physical_bytes),
            "mapped_bytes": mapped_bytes(os.getpid()) if self.device.type == "cpu" else None,
            "torch": self._torch_memory(),
            "free": self.free_bytes(empty=False),
            "total": self.total_bytes(),
        }

    def total_bytes(self) -> int | None:
        import torch

        if self.device.type != "cuda":
            return None
        return int(torch.cuda.mem_get_info(self.device)[1])

    def _new_manager(self, hints: tuple[int, int], num_blocks: int | None = None) -> Any:
        """`num_blocks` caps the engine's cache, and so what transformers sizes from it:
        without one, each engine's transformers sizes its reads per batch (`max_tokens_read`:
        the masks, and the warm-up's and every padded batch's attention scores) for ~90% of
        the free memory it sees, as if alone on the device (an H200 crawled so, 36 of 398
        requests done)."""
        import dataclasses

        from extensible_kv._demo import serve

        options = self.options
        if num_blocks is not None and options.num_blocks is None:
            options = dataclasses.replace(options, num_blocks=num_blocks)
        # transformers' workload hints (the longest prompt, the number of requests), the same
        # in every setup and in the alone run: the batch limits, and so the graphs and the
        # numerics, do not depend on the setup.
        longest, count = hints
        return serve.new_manager(self.model, options, [[1] * longest] * count)

    def setup(
        self, name: str, sizes: dict[str, Any], hints: tuple[int, int], keep: set[str]
    ) -> None:
        """Starts a manager for setup `name`, serves what arrives until `stop`, replies."""
        import extensible_kv.transformers as ekt
        from extensible_kv._demo import serve

        manager = sampler = results = None
        mine = sizes["engines"][self.index]
        logs = _LogRecords()
        reply: dict[str, Any] = {"error": None}
        try:
            enable_setup(sizes["kind"], sizes, mine, f"engine{self.index}")
            manager = self._new_manager(hints, mine["cap_blocks"])
            row = serve.Contender(name)
            serve._start_up(manager, row, self.device, extensible=True)
            manager.start()
            sampler = _Sampler(manager)
            self.tensor = sampler.tensor
            reply["startup"] = {
                "blocks": row.blocks,
                "physical_bytes": sampler.bytes[0] if sampler.bytes else None,
                "startup_ms": row.startup_ms,
                "extend_ms": row.extend_ms,
            }
            results = _Results(manager, self.send, keep)
            self.free_bytes()  # the warm-up's transient memory, for the next engine's start
            self.send("ready", reply["startup"])
        except BaseException:
            reply["error"] = traceback.format_exc()
            self.send("failed", reply["error"])
        received = 0
        refused: dict[str, str] = {}
        while True:
            command, *rest = self.conn.recv()
            if command == "stop":
                break
            if command == "probe":
                self.send("probe", self.probe())
            elif command == "req" and manager is not None:
                rid, prompt, new_tokens = rest
                received += 1
                try:
                    manager.add_request(
                        prompt, request_id=rid, max_new_tokens=new_tokens, streaming=True
                    )
                except Exception as error:  # the manager's loop died: the request is lost
                    refused[rid] = f"add_request: {error!r}"
                    self.send("done", (rid, {"finish": None, "error": refused[rid]}))
        drained = results is not None and len(results.done) + len(refused) == received
        try:
            if results is not None:
                results.stop()
            if sampler is not None:
                reply["memory"] = sampler.stop()
            if manager is not None:
                _stop(manager, hard=not drained)
            reply["asks"] = asks_of(sampler.member if sampler is not None else None)
        except BaseException:
            reply["error"] = (reply["error"] or "") + traceback.format_exc()
        finally:
            self.tensor = None
            ekt.disable()
            reply["log"] = logs.close()
            reply["log_dropped"] = logs.dropped
            del manager, sampler, results
            self.free_bytes()  # empties torch's cache on a GPU
            reply["memfds_after"] = memfds()
            held = self._torch_memory()
            reply["torch_after"] = {
                "allocated_over_model": held["allocated"] - self.model_allocated,
                "reserved": held["reserved"],
            }
            self.send("result", reply)

    def alone(
        self,
        hints: tuple[int, int],
        requests: list[tuple[str, list[int], int]],
        num_blocks: int | None,
        candidates: dict[str, dict[str, list[int]]],
        score: int,
    ) -> None:
        """Each request alone on a manager with transformers' own KV cache: the reference;
        then every setup's tokens for the first `score` of them (`candidates`), and the
        reference's, scored by the model itself (`score`)."""
        import extensible_kv.transformers as ekt
        from extensible_kv._demo import serve

        ekt.disable()
        reply: dict[str, Any] = {"error": None, "tokens": {}}
        manager = None
        try:
            manager = self._new_manager(hints, num_blocks)
            serve._start_up(manager, serve.Contender("alone"), self.device, extensible=False)
            manager.start()
            for rid, prompt, new_tokens in requests:
                manager.add_request(prompt, request_id=rid, max_new_tokens=new_tokens)
                while True:
                    result = manager.get_result(timeout=120)
                    if result is None:
                        raise RuntimeError(f"no result for {rid} in 120 s")
                    if result.request_id == rid and result.is_finished():
                        break
                if result.error is not None:
                    raise RuntimeError(f"{rid} failed: {result.error}")
                reply["tokens"][rid] = list(result.generated_tokens)
        except BaseException:
            reply["error"] = traceback.format_exc()
        finally:
            if manager is not None:
                _stop(manager, hard=False)
        if reply["error"] is None and score:
            try:
                scored = {**candidates, "alone": reply["tokens"]}
                prompts = {rid: p for rid, p, _ in requests[:score]}
                reply["scores"] = self.score(prompts, scored)
            except BaseException:
                reply["error"] = traceback.format_exc()
        self.send("alone", reply)

    def score(
        self, prompts: dict[str, list[int]], candidates: dict[str, dict[str, list[int]]]
    ) -> dict[str, dict[str, Any]]:
        """Teacher forcing: one plain forward of the model (no KV cache) over each request's
        prompt and the tokens a setup generated for it; each token ranked among the logits
        for its own prefix (rank 0: the argmax) and its gap to the top logit taken. bf16
        matmuls are not batch-invariant, so greedy tokens of differently batched runs of a
        random-weight model part early (near ties); but a token that came from wrong KV is
        not near the top for its true prefix. `control`: the reference's tokens of each
        request scored after the next request's prompt, what a request reading another's
        blocks would have written. Per name: tokens, the share of argmax and of top 5, the
        largest gap (logits) and rank; and the sums, so that engines add up."""
        import torch

        rids = sorted(prompts)
        named = dict(candidates)
        alone = candidates.get("alone", {})
        named["control"] = {rid: alone[rid] for rid in rids if rid in alone and len(rids) > 1}
        out: dict[str, dict[str, Any]] = {}
        with torch.no_grad():
            for name, tokens in named.items():
                ranks: list[int] = []
                gaps: list[float] = []
                for i, rid in enumerate(rids):
                    if rid not in tokens or not tokens[rid]:
                        continue
                    prompt = prompts[rids[(i + 1) % len(rids)] if name == "control" else rid]
                    generated = tokens[rid]
                    ids = torch.tensor([prompt + generated[:-1]], device=self.device)
                    logits = self.model(input_ids=ids).logits[0, len(prompt) - 1 :].float()
                    chosen = torch.tensor(generated, device=self.device).unsqueeze(1)
                    picked = logits.gather(1, chosen)
                    ranks += (logits > picked).sum(dim=1).tolist()
                    gaps += (logits.max(dim=1).values - picked.squeeze(1)).tolist()
                    del logits
                out[name] = {
                    "tokens": len(ranks),
                    "argmax_n": sum(r == 0 for r in ranks),
                    "top5_n": sum(r < 5 for r in ranks),
                    "max_gap": max(gaps, default=None),
                    "max_rank": max(ranks, default=None),
                }
        return out


def _stop(manager: Any, hard: bool) -> None:
    """Stops and destroys the manager; `hard` fails what it still has (a drain that ran out)."""
    import inspect

    kwargs = (
        {"hard_stop": True}
        if hard and "hard_stop" in inspect.signature(manager.stop).parameters
        else {}
    )
    manager.stop(block=True, **kwargs)
    manager.destroy()


def engine_main(index: int, config: dict[str, Any], conn: Any) -> None:
    """An engine process: loads its model, then runs the driver's commands until `quit`.
    SIGUSR1 prints every thread's stack to stderr (the driver sends it to an engine that
    does not answer in time)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    engine = None
    try:
        engine = Engine(index, config, conn)
        engine.send("loaded", engine.info())
        while True:
            command, *rest = conn.recv()
            if command == "quit":
                return
            if command == "setup":
                engine.setup(*rest)
            elif command == "alone":
                engine.alone(*rest)
            elif command == "probe":
                engine.send("probe", engine.probe())
            elif command == "free":
                engine.send("free", engine.free_bytes())
            elif command == "stop":  # a setup this engine never started
                engine.send("result", {"error": "not set up"})
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return
    except BaseException:
        try:
            conn.send(("crashed", index, traceback.format_exc()))
        except OSError:
            pass


# ---------------------------------------------------------------------------------------------
# the driver's side


class Engines:
    """The engine processes, a pipe to each, and what they answered. `first` and `done`
    collect every request's streamed first token and finish (the engines' monotonic times);
    an engine may be killed (`kill`) and started again (`restart`), with a new pipe."""

    def __init__(self, configs: list[dict[str, Any]]) -> None:
        if configs[0]["device"].startswith("cuda"):
            # Spawned: the child of a fork server whose imports initialized CUDA (transformers'
            # may ask torch for devices) could not use it.
            self.ctx = mp.get_context("spawn")
        else:  # forks of one server that imported torch and transformers once: seconds saved
            self.ctx = mp.get_context("forkserver")
            self.ctx.set_forkserver_preload(
                ["torch", "transformers", "extensible_kv.transformers", "pool_models"]
            )
        self.configs = configs
        self.lock = threading.Condition()
        self.answers: dict[tuple[str, int], Any] = {}
        self.first: dict[str, float] = {}
        self.done: dict[str, dict[str, Any]] = {}
        self.crashed: dict[int, str] = {}
        self.conns: list[Any] = [None] * len(configs)
        self.processes: list[Any] = [None] * len(configs)
        self.send_locks = [threading.Lock() for _ in configs]
        self.down: set[int] = set()  # killed, not started again yet
        self.sent: dict[str, int] = {}  # each request sent, to its engine
        self.pending: dict[int, list[tuple[Any, ...]]] = {}  # held while an engine is down
        self.running = True
        for index in range(len(configs)):
            self._start(index)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def __len__(self) -> int:
        return len(self.configs)

    def _start(self, index: int) -> None:
        ours, theirs = self.ctx.Pipe()
        process = self.ctx.Process(
            target=engine_main,
            args=(index, self.configs[index], theirs),
            name=f"bench_pool engine {index}",
            daemon=True,
        )
        process.start()
        theirs.close()
        with self.lock:
            self.conns[index] = ours
            self.processes[index] = process
            self.crashed.pop(index, None)

    def pid(self, index: int) -> int:
        return int(self.processes[index].pid)

    def _read(self) -> None:
        while self.running:
            with self.lock:
                conns = {conn: i for i, conn in enumerate(self.conns) if conn is not None}
            ready = multiprocessing.connection.wait(list(conns), timeout=0.05)
            for conn in ready:
                index = conns[conn]
                try:
                    kind, _, payload = conn.recv()
                except (EOFError, OSError):
                    with self.lock:
                        if self.conns[index] is conn:
                            self.conns[index] = None
                            self.crashed.setdefault(index, "its pipe closed")
                        self.lock.notify_all()
                    continue
                with self.lock:
                    if kind == "first":
                        rid, t = payload
                        self.first.setdefault(rid, t)
                    elif kind == "done":
                        rid, row = payload
                        self.done.setdefault(rid, {**row, "engine": index})
                    elif kind == "crashed":
                        self.crashed[index] = payload
                    else:
                        self.answers[(kind, index)] = payload
                    self.lock.notify_all()

    def send(self, index: int, *message: Any) -> bool:
        """Sends `message` to engine `index`; False where its pipe is gone."""
        conn = self.conns[index]
        if conn is None:
            return False
        try:
            with self.send_locks[index]:
                conn.send(message)
        except (OSError, ValueError):
            return False
        return True

    def send_request(self, index: int, rid: str, prompt: list[int], new_tokens: int) -> None:
        """Sends a request to engine `index`, or holds it while the engine is down."""
        with self.lock:
            self.sent[rid] = index
            if index in self.down:
                self.pending.setdefault(index, []).append(("req", rid, prompt, new_tokens))
                return
        if not self.send(index, "req", rid, prompt, new_tokens):
            with self.lock:  # its pipe closed: it died; the request is lost
                self.done.setdefault(rid, {"finish": None, "error": "engine down", "engine": index})

    def up(self, index: int) -> int:
        """Engine `index` serves again: the requests held for it go; how many."""
        with self.lock:
            self.down.discard(index)
            held = self.pending.pop(index, [])
        for message in held:
            self.send(index, *message)
        return len(held)

    def wait(self, kinds: tuple[str, ...], indices: list[int], timeout_s: float) -> dict[int, Any]:
        """Each engine's first answer of one of `kinds` (taken off), within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        got: dict[int, Any] = {}
        with self.lock:
            while True:
                for index in indices:
                    for kind in kinds:
                        if index not in got and (kind, index) in self.answers:
                            got[index] = (kind, self.answers.pop((kind, index)))
                if len(got) == len(indices):
                    return got
                dead = [
                    i
                    for i in indices
                    if i not in got and (i in self.crashed or not self.processes[i].is_alive())
                ]
                if dead:
                    why = "; ".join(self.crashed.get(i, "exited")[-2000:] for i in dead)
                    raise RuntimeError(f"engine(s) {dead} died: {why}")
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [i for i in indices if i not in got]
                    for i in missing:  # where they are stuck, on stderr
                        if self.processes[i].is_alive():
                            log(f"engine {i} (pid {self.pid(i)}) did not answer: its stacks")
                            os.kill(self.pid(i), signal.SIGUSR1)
                    time.sleep(1.0)
                    raise TimeoutError(f"engines {missing} did not answer {kinds} in {timeout_s} s")
                self.lock.wait(min(left, 0.5))

    def kill(self, index: int) -> float:
        """`kill -9` of engine `index`: its time. Not reaped here (a zombie is dead to the
        pool); `restart` reaps it."""
        with self.lock:
            self.down.add(index)
        killed = time.monotonic()
        os.kill(self.pid(index), signal.SIGKILL)
        return killed

    def restart(self, index: int, timeout_s: float) -> dict[str, Any]:
        """Starts engine `index` again (its model loaded anew): what it says when loaded."""
        old = self.processes[index]
        old.join(10)
        with self.lock:
            conn, self.conns[index] = self.conns[index], None
            self.answers = {k: v for k, v in self.answers.items() if k[1] != index}
        if conn is not None:
            conn.close()
        self._start(index)  # its requests wait for `up`
        info = self.wait(("loaded",), [index], timeout_s)[index][1]
        return dict(info)

    def close(self) -> None:
        for i, process in enumerate(self.processes):
            if process is not None and process.is_alive():
                self.send(i, "quit")
        for process in self.processes:
            if process is None:
                continue
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join()
        self.running = False
        self.reader.join(10)
        for conn in self.conns:
            if conn is not None:
                conn.close()
