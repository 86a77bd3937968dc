"""10,000 random steps of the ledger's rules against a model kept apart: after each, the
ledger is consistent, says what the model says of every engine and loan, and the pool holds
exactly what its engines own (plus what a dead lender left with its borrowers)."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
from extensible_kv.pool import Ledger, rules
from extensible_kv.pool.ledger import MAX_EVENTS
from support.pool_ledgers import BB, World, engine, memory


@dataclass
class MEngine:
    pid: int
    committed: int = 0
    own: int = 0  # bytes it created and still owns, mapped or lent
    physical: int = 0
    lent: int = 0
    borrowed: int = 0
    stuck: bool = False


@dataclass
class MLoan:
    lender: str
    borrower: str
    state: str
    blocks: int
    deadline: float
    num_bytes: int = 0


class Model:
    """What the ledger must say, kept independently: engines, loans, and the bytes each
    engine owns (which only its own commits and shrinks change)."""

    def __init__(self) -> None:
        self.engines: dict[str, MEngine] = {}
        self.loans: dict[int, MLoan] = {}
        self.orphan_bytes = 0

    def recover(self, now: float, dead: set[int]) -> None:
        for name, e in list(self.engines.items()):
            if e.pid in dead:
                self.drop(name)
        for loan in self.loans.values():
            if loan.state == "asked" and loan.deadline < now:
                loan.state = "expired"
                self.engines[loan.lender].stuck = True

    def drop(self, name: str) -> None:
        for loan_id, loan in list(self.loans.items()):
            if loan.lender == name:
                if loan.state == "borrowed":
                    loan.lender = ""
                    self.orphan_bytes += loan.num_bytes
                else:
                    del self.loans[loan_id]
            elif loan.borrower == name:
                if loan.state in ("offered", "borrowed", "returned") and loan.lender:
                    loan.state, loan.borrower = "returned", ""
                else:
                    if not loan.lender:  # an orphan: the kernel freed it with its borrower
                        self.orphan_bytes -= loan.num_bytes
                    del self.loans[loan_id]
        del self.engines[name]

    def compare(self, ledger: Ledger) -> None:
        assert rules.check(ledger) == []
        assert set(ledger.engines) == set(self.engines)
        for name, e in self.engines.items():
            got = ledger.engines[name]
            assert (
                got.committed_blocks,
                got.physical_bytes,
                got.lent_bytes,
                got.borrowed_bytes,
                got.stuck,
            ) == (e.committed, e.physical, e.lent, e.borrowed, e.stuck), name
        assert {i: (x.lender, x.borrower, x.state, x.blocks) for i, x in ledger.loans.items()} == {
            i: (x.lender, x.borrower, x.state, x.blocks) for i, x in self.loans.items()
        }
        # Nothing lost or counted twice: the pool holds what its engines own, plus what a dead
        # lender left with its borrowers.
        own = sum(e.own for e in self.engines.values())
        assert rules.used_bytes(ledger, "cpu") == own + self.orphan_bytes


def test_ten_thousand_random_steps_against_a_model(tmp_path: Path) -> None:
    rng = random.Random(2024)
    world = World()
    pool = world.pool(tmp_path)
    model = Model()
    fds = len(os.listdir("/proc/self/fd"))
    serial = 0
    counts: dict[str, int] = {}

    def post(ledger: Ledger, name: str) -> None:
        e = model.engines[name]
        rules.record(
            ledger,
            name,
            world.clock.now,
            {
                "committed_blocks": e.committed,
                "physical_bytes": e.physical,
                "lent_bytes": e.lent,
                "borrowed_bytes": e.borrowed,
            },
        )
        e.stuck = False

    def of(states: tuple[str, ...], live_lender: bool = False) -> list[int]:
        return [
            i
            for i, x in model.loans.items()
            if x.state in states and (x.lender in model.engines or not live_lender)
        ]

    for _ in range(10_000):
        with pool.transaction() as ledger:
            model.recover(world.clock.now, world.dead)
            model.compare(ledger)
            now = world.clock.now
            names = sorted(model.engines)
            ops = ["tick", "join"] if len(names) < 6 else ["tick"]
            if names:
                ops += ["commit", "limits", "die", "ask", "leave"]
            ops += ["offer", "refuse"] * bool(of(("asked",)))
            ops += ["take"] * bool(of(("offered",))) + ["recall"] * bool(of(("borrowed",)))
            ops += ["give_back"] * bool(of(("borrowed",)))
            ops += ["reclaim"] * bool(of(("returned",), live_lender=True))
            ops += ["forget"] * bool(of(("refused", "expired")))
            op = rng.choice(ops)
            counts[op] = counts.get(op, 0) + 1
            if op == "tick":
                world.clock.now += rng.uniform(0, 0.3)
            elif op == "join":
                serial += 1
                name = f"e{serial}"
                committed = rng.randint(0, 40)
                model.engines[name] = MEngine(serial, committed, committed * BB, committed * BB)
                new = engine(name, serial, committed)
                rules.join(ledger, new, now)
            elif op == "die":
                world.dead.add(model.engines[rng.choice(names)].pid)
            elif op == "leave":
                name = rng.choice(names)
                busy = [
                    x
                    for x in model.loans.values()
                    if name in (x.lender, x.borrower) and x.state not in ("refused", "expired")
                ]
                if busy:
                    with pytest.raises(ValueError, match="loans in flight"):
                        rules.leave(ledger, name, now)
                else:
                    rules.leave(ledger, name, now)
                    model.drop(name)
            elif op == "commit":  # its own memory grows or shrinks (never below what it lent)
                name = rng.choice(names)
                e = model.engines[name]
                delta = rng.randint(-e.committed + e.borrowed // BB, 8)
                e.committed += delta
                e.physical += delta * BB
                e.own += delta * BB
                post(ledger, name)
            elif op == "limits":
                lo = rng.randint(0, 8)
                rules.set_limits(ledger, rng.choice(names), now, lo, lo + rng.randint(0, 64))
            elif op == "ask":
                borrower, lender = rng.choice(names), rng.choice(names)
                if borrower != lender:
                    blocks = rng.randint(1, 8)
                    deadline = now + rng.uniform(0.1, 1.0)
                    loan_id = rules.ask(ledger, borrower, lender, blocks, deadline, now, "t")
                    model.loans[loan_id] = MLoan(lender, borrower, "asked", blocks, deadline)
            elif op == "offer":
                loan_id = rng.choice(of(("asked",)))
                loan = model.loans[loan_id]
                e = model.engines[loan.lender]
                blocks = min(loan.blocks, e.committed - e.borrowed // BB)
                if blocks > 0:
                    e.committed -= blocks
                    e.physical -= blocks * BB
                    e.lent += blocks * BB
                    state = rules.lent(
                        ledger,
                        loan_id,
                        loan.lender,
                        kept_blocks=e.committed,
                        lent_blocks=blocks,
                        blocks=blocks,
                        loans=memory(blocks * BB),
                        deadline=now + 1,
                        now=now,
                    )
                    assert state == "offered"
                    loan.state, loan.blocks, loan.num_bytes = "offered", blocks, blocks * BB
                    post(ledger, loan.lender)
            elif op == "refuse":
                loan_id = rng.choice(of(("asked",)))
                rules.refuse(ledger, loan_id, "no", now)
                model.loans[loan_id].state = "refused"
            elif op == "take":
                loan_id = rng.choice(of(("offered",)))
                loan = model.loans[loan_id]
                e = model.engines[loan.borrower]
                rules.took(ledger, ledger.loans[loan_id], e.committed, now)
                e.committed += loan.blocks
                e.physical += loan.num_bytes
                e.borrowed += loan.num_bytes
                loan.state = "borrowed"
                post(ledger, loan.borrower)
            elif op == "recall":
                rules.recall(ledger, rng.choice(of(("borrowed",))), "r", now)
            elif op == "give_back":
                loan_id = rng.choice(of(("borrowed",)))
                loan = model.loans[loan_id]
                e = model.engines[loan.borrower]
                e.committed -= loan.blocks
                e.physical -= loan.num_bytes
                e.borrowed -= loan.num_bytes
                rules.returned(ledger, loan_id, "done", now)
                if loan.lender:
                    loan.state = "returned"
                else:
                    del model.loans[loan_id]
                    model.orphan_bytes -= loan.num_bytes
                post(ledger, loan.borrower)
            elif op == "reclaim":
                loan_id = rng.choice(of(("returned",), live_lender=True))
                loan = model.loans.pop(loan_id)
                e = model.engines[loan.lender]
                e.committed += loan.blocks
                e.physical += loan.num_bytes
                e.lent -= loan.num_bytes
                rules.reclaimed(ledger, loan_id, now)
                post(ledger, loan.lender)
            elif op == "forget":
                loan_id = rng.choice(of(("refused", "expired")))
                rules.withdraw(ledger, loan_id, "", now)
                del model.loans[loan_id]
            model.compare(ledger)
            assert len(ledger.events) <= MAX_EVENTS
    model.recover(world.clock.now, world.dead)
    model.compare(pool.snapshot())
    assert len(os.listdir("/proc/self/fd")) == fds, "the ledger leaked an fd"
    with open("/proc/self/maps") as maps:
        assert "extensible_kv-pool" not in maps.read()
    assert min(counts.values()) >= 50, counts  # every kind of step ran, many times
