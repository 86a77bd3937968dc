"""A post that fails after memory moved is repaired (issue 51, item 4).

A member moves memory outside the pool's lock and posts the outcome in the next transaction.
Here each post of each memory move fails, three ways: the lock held by another holder past
the member's lock timeout, `ENOSPC` from the store's write, and a corrupt ledger (garbage
written over it, the old bytes put back after). The fault is injected right after the move
(the cache's own method wrapped) and lifted once the member's call is over; then the members
serve on, and:

- the ledger is consistent (`rules.check`), and each member's entry says what its cache holds,
  after every serve;
- nothing is lost: every loan ends, the lender grows back to its size, the borrower to its
  own, the pool holds what the caches hold;
- a failure inside `serve()` is logged (once), never raised into the engine's loop; one in
  an explicit call (`grow`, `request`, `leave`) is raised, and its move posted later all the
  same.

In one process here (pids and the clock real); across processes, with each process's
`/proc/<pid>/maps`, at the end.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from extensible_kv import ExtensibleKVCache
from extensible_kv.pool import LedgerCorruptError, Pool, PoolLockTimeout, PoolMember, rules
from extensible_kv.pool import store as store_module
from support.pool_members import BLOCK_BYTES, cache, check_holdings, member

SHARE_BLOCKS = 48

# ---------------------------------------------------------------------------------------------
# the faults


@dataclass
class Fault:
    """A failure of the pool's store, on between `start()` and `stop()`."""

    kind: str
    pool: Pool
    monkeypatch: pytest.MonkeyPatch
    fired: int = 0
    _lock_fd: int | None = None
    _saved: bytes | None = None

    @property
    def error(self) -> type[BaseException]:
        return {"lock": PoolLockTimeout, "enospc": OSError, "corrupt": LedgerCorruptError}[
            self.kind
        ]

    def start(self) -> None:
        self.fired += 1
        if self.kind == "lock":  # another holder: a descriptor of its own, a flock of its own
            self._lock_fd = os.open(self.pool.lock_path, os.O_RDONLY)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        elif self.kind == "enospc":

            def full(fd: int, data: bytes) -> None:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            self.monkeypatch.setattr(store_module, "_write_all", full)
        else:
            path = Path(self.pool.path)
            self._saved = path.read_bytes()
            path.write_bytes(b"EKVPOOL 1 5 0000\ngarbage written by a test")

    def stop(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        self.monkeypatch.setattr(store_module, "_write_all", ORIGINAL_WRITE)
        if self._saved is not None:
            Path(self.pool.path).write_bytes(self._saved)
            self._saved = None


ORIGINAL_WRITE = store_module._write_all
FAULTS = ["lock", "enospc", "corrupt"]


def arm(fault: Fault, c: ExtensibleKVCache, method: str) -> None:
    """The fault starts right after `c.method` next moves memory (once)."""
    original = getattr(c, method)

    def moved_then_fault(*args: Any, **kw: Any) -> Any:
        result = original(*args, **kw)
        if not fault.fired:
            fault.start()
        return result

    setattr(c, method, moved_then_fault)


# ---------------------------------------------------------------------------------------------
# the members


@dataclass
class World:
    pool: Pool
    caches: dict[str, ExtensibleKVCache]
    members: dict[str, PoolMember]
    used: dict[str, int]
    warnings: list[str] = field(default_factory=list)

    def check(self, *names: str) -> None:
        """The ledger is consistent, and says what the caches of `names` (all by default)
        hold: a member whose post failed is in line once it ran a transaction since."""
        ledger = self.pool.snapshot()
        check_holdings(ledger, {n: self.members[n] for n in names or self.members})

    def serve(self, *names: str) -> None:
        """Serves each member (all by default), checking the ledger after each serve."""
        for name in names or tuple(self.members):
            self.members[name].serve()
            self.check(name)


@pytest.fixture
def world(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> Iterator[Callable[..., World]]:
    made: list[ExtensibleKVCache] = []

    def make(via: str = "loan") -> World:
        pool = Pool("test", directory=tmp_path, lock_timeout_s=0.05)
        pool.set_cap("cpu", SHARE_BLOCKS * BLOCK_BYTES)
        caches = {"a": cache(), "b": cache()}
        made.extend(caches.values())
        used = {"a": 0, "b": 0}
        members = {n: member(pool, n, c, used, via=via) for n, c in caches.items()}
        for m in members.values():
            m.join()
        return World(pool, caches, members, used)

    caplog.set_level(logging.INFO, logger="extensible_kv")
    yield make
    for c in made:
        c.close()


def store_failures(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "could not use the ledger" in r.getMessage()
    ]


def lend_to_b(w: World) -> None:
    """a at 32 blocks (10 used), b asks for 40: commits the share's rest, asks a for 20."""
    a, b = w.members["a"], w.members["b"]
    assert a.grow(32) == 32
    w.used["a"] = 10
    w.caches["a"].views["attn"][:, :10].fill_(3)  # type: ignore[call-overload]
    assert ("ask", "a") in [(d.action, d.peer) for d in b.request(40)]


def home(w: World) -> None:
    """Every loan ends: a recalls, b gives back, a reclaims; a is back at its 32 blocks with
    its bytes, nothing lent or borrowed, and the pool holds what the caches hold."""
    a, b = w.members["a"], w.members["b"]
    for _ in range(20):
        ledger = w.pool.snapshot()
        if not ledger.loans and w.caches["a"].committed_blocks >= 32:
            break
        if any(x.lender == "a" and not x.recall for x in ledger.loans.values()):
            a.request(8)  # recalls what it lent
        w.serve("b", "a")
    ledger = w.pool.snapshot()
    assert ledger.loans == {}, ledger.loans
    ca, cb = w.caches["a"], w.caches["b"]
    assert ca.committed_blocks == 32, "the lender lost blocks for good"
    assert sum(t.lent_bytes for t in ca.buffers) == sum(t.borrowed_bytes for t in cb.buffers) == 0
    assert bool(ca.views["attn"][:, :10].eq(3).all())  # type: ignore[call-overload]
    check_holdings(ledger, w.members)
    assert rules.used_bytes(ledger, "cpu") == ca.physical_bytes + cb.physical_bytes
    b.leave()
    a.leave()
    assert w.pool.snapshot().engines == {}


# ---------------------------------------------------------------------------------------------
# each post of each memory move, each fault


def explicitly(fault: Fault, call: Callable[[], Any]) -> None:
    """An explicit call whose post fails: it raises the store's error."""
    with pytest.raises(fault.error):
        call()


@pytest.mark.parametrize("kind", FAULTS)
def test_the_offer_of_a_lend_posted_late(
    world: Callable[..., World], kind: str, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """a lends and cannot post the offer: before, the lent blocks were lost for good (the
    request expired, nothing described the memory, a never reclaimed it)."""
    w = world()
    lend_to_b(w)
    fault = Fault(kind, w.pool, monkeypatch)
    arm(fault, w.caches["a"], "lend")
    w.members["a"].serve()  # lends; the post fails: logged, not raised
    assert fault.fired and w.caches["a"].committed_blocks == 12
    fault.stop()
    assert len(store_failures(caplog)) == 1
    w.serve("a", "b")  # a's next transaction offers it; b borrows it
    assert w.caches["b"].committed_blocks == 36
    home(w)


@pytest.mark.parametrize("kind", FAULTS)
def test_a_lend_whose_request_ended_meanwhile_is_taken_back(
    world: Callable[..., World], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The offer could not be posted, and by the next transaction the request had ended (b
    withdrew it): no borrower can have the memory, so a takes it back at once."""
    w = world()
    lend_to_b(w)
    fault = Fault(kind, w.pool, monkeypatch)
    arm(fault, w.caches["a"], "lend")
    w.members["a"].serve()
    fault.stop()
    with w.pool.transaction() as ledger:
        (request,) = ledger.loans.values()
        assert request.state == "asked"
        rules.withdraw(ledger, request.loan_id, "b gave up", w.pool.clock())
    w.serve("a")  # posted as returned, then reclaimed
    assert w.caches["a"].committed_blocks == 32
    home(w)


@pytest.mark.parametrize("kind", FAULTS)
def test_a_borrow_posted_late(
    world: Callable[..., World], kind: str, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """b borrows and cannot post it: before, the lender's serve found the offer past its
    deadline, could not reclaim it, and b, serving again, borrowed it a second time or posted
    it returned while it still mapped it."""
    w = world()
    lend_to_b(w)
    w.serve("a")
    fault = Fault(kind, w.pool, monkeypatch)
    arm(fault, w.caches["b"], "borrow")
    w.members["b"].serve()
    assert fault.fired and w.caches["b"].committed_blocks == 36
    fault.stop()
    assert len(store_failures(caplog)) == 1
    w.serve("a", "b", "a")
    (loan,) = w.pool.snapshot().loans.values()
    assert (loan.state, loan.start_block) == ("borrowed", 16)
    home(w)


@pytest.mark.parametrize("kind", FAULTS)
@pytest.mark.parametrize("how", ["serve", "leave"])
def test_a_give_back_posted_late(
    world: Callable[..., World], kind: str, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """b gives the loan back and cannot post it (recalled, at its serve; or as it leaves,
    which raises): before, the ledger said b still borrowed it, so a could never reclaim it,
    and b's next give-back of it failed."""
    w = world()
    lend_to_b(w)
    w.serve("a", "b")
    assert [d.action for d in w.members["a"].request(8)] == ["recall"]
    fault = Fault(kind, w.pool, monkeypatch)
    arm(fault, w.caches["b"], "give_back")
    if how == "serve":
        w.members["b"].serve()
    else:
        explicitly(fault, lambda: w.members["b"].leave(timeout_s=5.0))
    assert fault.fired and w.caches["b"].committed_blocks == 16
    fault.stop()
    w.serve("b", "a")
    assert w.caches["a"].committed_blocks == 32
    home(w)


@pytest.mark.parametrize("kind", FAULTS)
def test_a_reclaim_posted_late(
    world: Callable[..., World], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """a reclaims and cannot post it: before, its next serve reclaimed the loan again and
    failed ('not outstanding'), for ever."""
    w = world()
    lend_to_b(w)
    w.serve("a", "b")
    w.members["a"].request(8)
    w.serve("b")
    fault = Fault(kind, w.pool, monkeypatch)
    arm(fault, w.caches["a"], "reclaim")
    w.members["a"].serve()
    assert fault.fired and w.caches["a"].committed_blocks == 32
    fault.stop()
    w.serve("a", "b", "a")
    home(w)


@pytest.mark.parametrize("kind", FAULTS)
def test_a_commit_posted_late(
    world: Callable[..., World], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """a commits the blocks counted ahead and cannot post what it committed: `grow` raises,
    the engine learned its new size all the same, and the next transaction posts it."""
    w = world()
    sizes: list[int] = []
    w.members["a"].hooks.on_resize = sizes.append
    fault = Fault(kind, w.pool, monkeypatch)
    arm(fault, w.caches["a"], "commit")
    explicitly(fault, lambda: w.members["a"].grow(32))
    assert fault.fired and w.caches["a"].committed_blocks == 32 and sizes[-1] == 32
    fault.stop()
    w.serve()
    w.used["a"] = 10
    w.caches["a"].views["attn"][:, :10].fill_(3)  # type: ignore[call-overload]
    w.members["b"].request(40)
    w.serve("a", "b")
    home(w)


@pytest.mark.parametrize("kind", FAULTS)
def test_a_release_to_the_driver_posted_late(
    world: Callable[..., World], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the driver: a shrinks for b's request and cannot post it. Before, the request
    stayed asked: a answered it again, or it expired and a was marked stuck."""
    w = world(via="driver")
    lend_to_b(w)
    fault = Fault(kind, w.pool, monkeypatch)
    arm(fault, w.caches["a"], "shrink_to")
    w.members["a"].serve()
    assert fault.fired and w.caches["a"].committed_blocks == 12
    fault.stop()
    w.serve("a")
    ledger = w.pool.snapshot()
    assert [x.state for x in ledger.loans.values()] == ["released"]  # for b to read
    assert not ledger.engines["a"].stuck
    assert any("released 20 blocks to the driver" in e.text for e in ledger.events)
    w.members["b"].grow(20)  # commits what a released
    assert w.caches["b"].committed_blocks == 36
    w.members["b"].leave()
    assert w.members["a"].grow(20) == 32  # back to its size, from the device's free memory
    w.check("a")
    w.members["a"].leave()


@pytest.mark.parametrize("kind", FAULTS)
def test_a_shrink_past_a_lowered_maximum_posted_late(
    world: Callable[..., World], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = world()
    assert w.members["a"].grow(32) == 32
    w.used["a"] = 10
    w.pool.set_limits("a", min_blocks=None, max_blocks=16)
    fault = Fault(kind, w.pool, monkeypatch)
    arm(fault, w.caches["a"], "shrink_to")
    w.members["a"].serve()
    assert fault.fired and w.caches["a"].committed_blocks == 16
    fault.stop()
    w.serve()
    assert w.pool.snapshot().engines["a"].committed_blocks == 16
    for m in w.members.values():
        m.leave()


def test_a_reclaim_already_done_is_never_tried_again(
    world: Callable[..., World], monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """However often the reclaimed post fails, the loan is reclaimed once: each serve while the
    store fails is logged at most once, and none raises 'not outstanding'."""
    w = world()
    lend_to_b(w)
    w.serve("a", "b")
    w.members["a"].request(8)
    w.serve("b")
    fault = Fault("enospc", w.pool, monkeypatch)
    arm(fault, w.caches["a"], "reclaim")
    reclaims = []
    reclaim = w.caches["a"].reclaim
    monkeypatch.setattr(w.caches["a"], "reclaim", lambda *a, **k: reclaims.append(reclaim(*a, **k)))
    for _ in range(5):
        w.members["a"].serve()
    assert len(reclaims) == 1
    fault.stop()
    assert len(store_failures(caplog)) == 1
    w.serve("a")
    assert len(reclaims) == 1
    assert any("reaches the ledger again" in r.getMessage() for r in caplog.records)
    home(w)


# ---------------------------------------------------------------------------------------------
# across processes: each engine its own process, the maps of each checked


@pytest.fixture
def procs() -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for proc in started:
        proc.stop()


# The command that makes the move whose post fails, after the schedule up to it.
POSTS = {
    "lend": ("a", "lend", ["offer"]),
    "take": ("b", "borrow", ["offer", "a serve"]),
    "give_back": ("b", "give_back", ["offer", "a serve", "b serve", "recall"]),
    "reclaim": ("a", "reclaim", ["offer", "a serve", "b serve", "recall", "b serve"]),
    "commit": ("a", "commit", []),
}


@pytest.mark.parametrize("kind", FAULTS)
@pytest.mark.parametrize("post", sorted(POSTS))
def test_across_processes_every_failed_post_is_repaired(
    tmp_path: Path, procs: list[Any], post: str, kind: str
) -> None:
    """Two engine processes (`pool_engine`): a lends to b, b gives back, a reclaims. The post
    of one move fails in the engine that made it; then both serve on. After recovery, and at
    the end, the ledger says what each process holds and maps (`/proc/<pid>/maps`), nothing
    is lost (a is back at its size, with its bytes), and no process maps another's memory."""
    from pool_engine import context, joined, start
    from test_pool_processes import check_consistent, check_settled, other_fds

    ctx = context()
    share = SHARE_BLOCKS * BLOCK_BYTES
    pool = Pool("t", directory=tmp_path)
    pool.set_cap("cpu", share)
    a, b = (start(ctx, str(tmp_path), "t", n, i, lock_timeout_s=0.1) for i, n in enumerate("ab"))
    procs.extend([a, b])
    live = {"a": joined(a), "b": joined(b)}
    numbers: dict[str, dict[str, int]] = {}
    fds_after_join = {n: other_fds(p.pid) for n, p in live.items()}
    engine, method, before = POSTS[post]
    steps = {
        "offer": lambda: (a("grow", 32, 5.0), a("use", 10), b("request", 40)),
        "a serve": lambda: a("serve"),
        "b serve": lambda: b("serve"),
        "recall": lambda: a("request", 8),
    }
    if post != "commit":
        for step in before:
            steps[step]()
    live[engine]("arm", method, kind)
    command = {"lend": ("serve",), "commit": ("grow", 32, 5.0)}.get(post, ("serve",))
    result, numbers[engine] = live[engine](*command)
    if post == "commit":
        assert str(result).startswith("failed:"), result  # an explicit call raises
        a("use", 10)
        b("request", 40)
    # Both serve on: the failed post lands at the engine's next transaction.
    for _ in range(3):
        for name, proc in live.items():
            _, numbers[name] = proc("serve")
        check_consistent(pool, live, numbers, share)
    # Home: a recalls what it lent, b gives it back, a reclaims it.
    for _ in range(10):
        ledger = pool.snapshot()
        if not ledger.loans and numbers["a"]["committed_blocks"] >= 32:
            break
        if any(x.lender == "a" and not x.recall for x in ledger.loans.values()):
            _, numbers["a"] = a("request", 8)
        for name in ("b", "a"):
            _, numbers[name] = live[name]("serve")
        check_consistent(pool, live, numbers, share)
    assert numbers["a"]["committed_blocks"] == 32, "the lender lost blocks for good"
    assert numbers["a"]["lent_bytes"] == numbers["b"]["borrowed_bytes"] == 0
    check_settled(pool, live, numbers, fds_after_join)
    for proc in live.values():
        proc("leave", 10.0)
    assert pool.snapshot().engines == {}


# ---------------------------------------------------------------------------------------------
# a cache whose own step after the move fails (transformers' pooled cache has such steps:
# a synchronize, its pool's size): the memory moved all the same, and is noted so


@pytest.mark.parametrize(
    ("who", "method", "before"),
    [
        ("b", "borrow", ["a"]),
        ("b", "give_back", ["a", "b", "recall"]),
        ("a", "reclaim", ["a", "b", "recall", "b"]),
    ],
)
def test_a_cache_that_fails_after_moving_memory_is_taken_at_its_word(
    world: Callable[..., World], who: str, method: str, before: list[str]
) -> None:
    """The cache's method moved the memory, then raised: the member tells by the cache's own
    bytes lent or borrowed that it moved, notes it, and posts it at its next transaction; a
    reclaim is not tried again ('not outstanding'), a loan borrowed is not taken twice."""
    w = world()
    lend_to_b(w)
    for step in before:
        if step == "recall":
            assert [d.action for d in w.members["a"].request(8)] == ["recall"]
        else:
            w.members[step].serve()
    c = w.caches[who]
    original = getattr(c, method)

    def moved_then_failed(*args: Any, **kw: Any) -> Any:
        original(*args, **kw)
        setattr(c, method, original)
        raise RuntimeError("the cache's own step after the move failed")

    setattr(c, method, moved_then_failed)
    with pytest.raises(RuntimeError, match="own step after the move"):
        w.members[who].serve()
    w.serve(who)  # in line at its next transaction
    home(w)
