"""The ledger's rules (`extensible_kv.pool.rules`): the one author of the ledger.

- The transition table at the head of `rules.py` is what the code does: every rule, driven from
  every state, makes exactly the table's moves, each by its one function; and no other module
  of the pool (or of transformers' join) writes a field of the ledger.
- A dead engine's loans follow the rules; a request not answered in time expires.
- Is a process alive: `_proc` reads `/proc/<pid>/stat` by the core's rules.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from extensible_kv.pool import Ledger, LoanState, _proc, rules
from support.pool_ledgers import NOW, World, engine, loan, memory

ROOT = Path(__file__).resolve().parent.parent
POOL = ROOT / "python" / "extensible_kv" / "pool"

# ---------------------------------------------------------------------------------------------
# the transition table

# A loan's starting points: no entry, each state, and a borrowed orphan (its lender died).
STARTS: list[str | None] = [None, *(s.value for s in LoanState), "orphan"]


def ledger_with(start: str | None) -> Ledger:
    """Engines a (lender) and b (borrower), and loan 1 of a to b as `start` says."""
    ledger = Ledger(next_loan_id=2)
    ledger.engines = {"a": engine("a", 1, 20), "b": engine("b", 2, 8)}
    if start == "orphan":
        ledger.loans[1] = loan(1, "a", "b", 2, "borrowed")
        ledger.loans[1].lender = ""
    elif start is not None:
        ledger.loans[1] = loan(1, "a", "b", 2, start)
    return ledger


def offered_entry() -> Any:
    return loan(1, "a", "b", 2, "offered")


# Each rule that moves a state, as called on loan 1 (`ask` makes loan 2).
RULES: dict[str, Callable[[Ledger], Any]] = {
    "ask": lambda L: rules.ask(L, "b", "a", 2, NOW + 1, NOW, "t"),
    "lent": lambda L: rules.lent(
        L,
        1,
        "a",
        kept_blocks=18,
        lent_blocks=2,
        blocks=2,
        loans=memory(),
        deadline=NOW + 1,
        now=NOW,
    ),
    "refuse": lambda L: rules.refuse(L, 1, "no", NOW),
    "expire": lambda L: rules.expire(L, 1, NOW),
    "released": lambda L: rules.released(L, 1, 2, NOW),
    "withdraw": lambda L: rules.withdraw(L, 1, "w", NOW),
    "took": lambda L: rules.took(L, offered_entry(), 8, NOW),
    "returned": lambda L: rules.returned(L, 1, "r", NOW),
    "reclaimed": lambda L: rules.reclaimed(L, 1, NOW),
}
# Rules that move states through the ones above: the engines that are gone.
COMPOSITES: dict[str, Callable[[Ledger], Any]] = {
    "drop lender": lambda L: rules.drop(L, "a", NOW, "a died"),
    "drop borrower": lambda L: rules.drop(L, "b", NOW, "b died"),
    "leave lender": lambda L: rules.leave(L, "a", NOW, force=True),
    "reap": lambda L: rules.reap(L, NOW + 10, lambda pid, start: pid != 2),
}

Move = tuple[LoanState | None, LoanState | None, str]


def moves_of(call: Callable[[Ledger], Any], start: str | None, monkeypatch: Any) -> set[Move]:
    made: set[Move] = set()
    check = rules._check

    def record(before: LoanState | None, after: LoanState | None, by: str) -> None:
        check(before, after, by)  # a move off the table fails here
        made.add((before, after, by))

    monkeypatch.setattr(rules, "_check", record)
    ledger = ledger_with(start)
    call(ledger)
    monkeypatch.undo()
    return made


def test_every_rule_makes_exactly_the_tables_moves_each_by_its_one_function(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: set[Move] = set()
    for name, call in RULES.items():
        for start in STARTS:
            moves = moves_of(call, start, monkeypatch)
            assert {by for _, _, by in moves} <= {name}, (name, start, moves)
            made |= moves
    table = {(before, after, by) for (before, after), by in rules.TRANSITIONS.items()}
    assert made == table, (sorted(map(str, table - made)), sorted(map(str, made - table)))
    for name, call in COMPOSITES.items():
        for start in STARTS:
            assert moves_of(call, start, monkeypatch) <= table, (name, start)


def test_the_table_in_the_docstring_is_the_table_the_code_checks() -> None:
    """pager.c's style: `from -> to [function]`, one line each, read back from the module's
    docstring."""
    assert rules.__doc__ is not None
    lines = re.findall(r"^\s+(\(none\)|\w+)\s+->\s+(\(none\)|\w+)\s+\[(\w+)\]", rules.__doc__, re.M)

    def state(text: str) -> LoanState | None:
        return None if text == "(none)" else LoanState(text)

    from_doc = {(state(a), state(b)): by for a, b, by in lines}
    assert len(lines) == len(from_doc) == len(rules.TRANSITIONS)
    assert from_doc == rules.TRANSITIONS
    assert all(callable(getattr(rules, by)) for by in from_doc.values())


def test_a_move_off_the_table_is_refused() -> None:
    ledger = ledger_with("returned")
    with pytest.raises(AssertionError, match="took moved a loan returned -> borrowed"):
        rules._set(ledger.loans[1], LoanState.BORROWED, "took")
    ledger = ledger_with("asked")
    with pytest.raises(AssertionError, match="which the table gives to refuse"):
        rules._set(ledger.loans[1], LoanState.REFUSED, "withdraw")


def test_memory_is_out_exactly_while_offered_borrowed_or_returned() -> None:
    out = {s for s in LoanState if s.memory_out}
    assert out == {LoanState.OFFERED, LoanState.BORROWED, LoanState.RETURNED}
    ended = {s for s in LoanState if s.ended}
    assert ended == {LoanState.REFUSED, LoanState.EXPIRED, LoanState.RELEASED}
    for state in LoanState:
        assert loan(1, "a", "b", 2, state).memory_out == state.memory_out
        assert state == state.value and f"{state}" == state.value  # a str, as JSON writes it


# The ledger's fields: what only `rules` (and `ledger`, which reads the file) may write.
FIELDS = {
    field.name
    for cls in ("Engine", "PoolLoan", "Ledger")
    for field in dataclasses.fields(
        getattr(__import__("extensible_kv.pool.ledger").pool.ledger, cls)
    )
} - {"name", "pid"}
AUTHORS = {"rules.py", "ledger.py"}
# The store bumps the generation of what it writes: the file's counter, not a record's.
ALLOWED = {("store.py", "generation")}


def writes(tree: ast.AST) -> list[tuple[int, str]]:
    """Assignments, augmented assignments and deletions of a field of the ledger (or an item
    of its `loans`, `engines` or `caps`) on anything but `self`."""
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        while targets:
            target = targets.pop()
            if isinstance(target, ast.Tuple | ast.List):
                targets.extend(target.elts)
                continue
            root = target
            while isinstance(root, ast.Attribute | ast.Subscript):
                root = root.value
            if isinstance(root, ast.Name) and root.id in ("self", "cls"):
                continue
            if isinstance(target, ast.Attribute) and target.attr in FIELDS:
                found.append((node.lineno, target.attr))
            elif isinstance(target, ast.Subscript):
                inner = target.value
                if isinstance(inner, ast.Attribute) and inner.attr in ("loans", "engines", "caps"):
                    found.append((node.lineno, inner.attr))
    return found


def test_no_module_but_the_rules_writes_the_ledger() -> None:
    """The member, its sides, the store, the command line and transformers' join change the
    ledger only by calling a rule."""
    files = [p for p in POOL.glob("*.py") if p.name not in AUTHORS]
    files += list((ROOT / "python" / "extensible_kv" / "transformers").glob("*.py"))
    found = []
    for path in files:
        if not re.search(r"^from extensible_kv\.pool", path.read_text(), re.M):
            continue  # holds no ledger to write
        for line, field in writes(ast.parse(path.read_text())):
            if (path.name, field) not in ALLOWED:
                found.append(f"{path.relative_to(ROOT)}:{line}: {field}")
    assert found == []
    # The check finds what it looks for.
    code = "loan.state = 'x'\ndel ledger.loans[1]\ne.busy += 1\na, x.caps[d] = 1, 2\n"
    code += "self.busy = True\nnotes[loan.loan_id] = 1\n"
    assert writes(ast.parse(code)) == [(1, "state"), (2, "loans"), (3, "busy"), (4, "caps")]


# ---------------------------------------------------------------------------------------------
# the rules for a dead engine's loans


@pytest.mark.parametrize(
    ("state", "dies", "after"),
    [
        ("asked", "lender", None),
        ("offered", "lender", None),  # the kernel freed the lender's memory
        ("borrowed", "lender", ("borrowed", "", "b")),  # the borrower holds it: an orphan
        ("returned", "lender", None),
        ("refused", "lender", None),
        ("released", "lender", None),
        ("asked", "borrower", None),
        ("offered", "borrower", ("returned", "a", "")),  # the lender reclaims it
        ("borrowed", "borrower", ("returned", "a", "")),
        ("returned", "borrower", ("returned", "a", "")),
        ("expired", "borrower", None),
        ("released", "borrower", None),
    ],
)
def test_a_dead_engines_loans_follow_the_rules(
    tmp_path: Path, state: str, dies: str, after: tuple[str, str, str] | None
) -> None:
    world = World()
    pool = world.pool(tmp_path)
    with pool.transaction() as ledger:
        rules.join(ledger, engine("a", 1, 8), NOW)
        rules.join(ledger, engine("b", 2, 8), NOW)
        ledger.loans[1] = loan(1, "a", "b", 2, state, NOW + 5)
        ledger.next_loan_id = 2
    world.dead.add(1 if dies == "lender" else 2)
    ledger = pool.snapshot()
    assert ("a" if dies == "lender" else "b") not in ledger.engines
    entry = ledger.loans.get(1)
    assert (None if entry is None else (entry.state, entry.lender, entry.borrower)) == after
    assert any("died: its entry goes" in e.text for e in ledger.events)


def test_a_request_not_answered_in_time_expires_and_marks_the_lender_stuck(
    tmp_path: Path,
) -> None:
    world = World()
    pool = world.pool(tmp_path)
    with pool.transaction() as ledger:
        rules.join(ledger, engine("a", 1, 8), NOW)
        rules.join(ledger, engine("b", 2, 8), NOW)
        loan_id = rules.ask(ledger, "b", "a", 2, NOW + 0.5, NOW, "test")
    world.clock.now = NOW + 0.4
    assert pool.snapshot().loans[loan_id].state == "asked"
    world.clock.now = NOW + 0.6
    ledger = pool.snapshot()
    assert ledger.loans[loan_id].state == "expired"
    assert ledger.loans[loan_id].reason == "a did not answer within the bound"
    assert ledger.engines["a"].stuck
    with pool.transaction() as ledger:  # a late answer finds it expired: the lender reclaims
        state = rules.lent(
            ledger,
            loan_id,
            "a",
            kept_blocks=6,
            lent_blocks=2,
            blocks=2,
            loans=memory(),
            deadline=NOW + 2,
            now=NOW,
        )
        assert (state, ledger.loans[loan_id].borrower) == ("returned", "")
        rules.record(ledger, "a", NOW, {"lent_bytes": 2 * 4096})
    ledger = pool.snapshot()
    assert not ledger.engines["a"].stuck and rules.check(ledger) == []
    with pool.transaction() as ledger:
        rules.reclaimed(ledger, loan_id, NOW)
        rules.record(ledger, "a", NOW, {"lent_bytes": 0})
    assert pool.snapshot().loans == {}


def test_the_rules_post_a_move_once_however_often_it_is_posted() -> None:
    """A member whose post failed posts again from its notes: each posting rule is
    idempotent."""
    ledger = ledger_with("asked")
    RULES["lent"](ledger)
    once = copy.deepcopy(ledger.loans)
    RULES["lent"](ledger)
    assert ledger.loans == once
    RULES["took"](ledger)
    once = copy.deepcopy(ledger.loans)
    RULES["took"](ledger)
    assert ledger.loans == once and ledger.loans[1].state == "borrowed"
    RULES["returned"](ledger)
    once = copy.deepcopy(ledger.loans)
    RULES["returned"](ledger)
    assert ledger.loans == once and ledger.loans[1].state == "returned"
    RULES["reclaimed"](ledger)
    RULES["reclaimed"](ledger)
    assert ledger.loans == {}


# ---------------------------------------------------------------------------------------------
# is a process alive: one parser, the core's rules


@pytest.mark.parametrize(
    ("line", "start"),
    [
        (b"42 (python3) S 1 42 42 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 12345 9 9", 12345),
        (b"42 (a) b) c) R 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 777 1", 777),
        (b"42 (\xff\xfe name) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 9 1", 9),
        (b"42 (zombie) Z 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 777 1", None),
        (b"42 (dead) X 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 777 1", None),
        (b"42 (old) x 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 777 1", 777),
        (b"42 (traced) t 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 777 1", 777),
        (b"42 (idle) I 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 +5 1", 5),
        (b"42 (short) S 1 2 3", None),
        (b"42 no parenthesis S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20", None),
        (b"42 (neg) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 -5 1", None),
        (b"42 (big) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 18446744073709551616", None),
        (b"42 (u) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 1_000 1", None),
        (b"", None),
    ],
)
def test_a_stat_line_is_read_by_the_cores_rules(line: bytes, start: int | None) -> None:
    """`_proc` asks the core's parser (`ipc::parse_start_time` in src/ipc.rs, through
    `_native`): the fields after the last `)`; state `Z` or `X` dead, every other alive (`x`
    too: it never appears since Linux 3.14); field 22 a u64 (digits after an optional `+`); a
    command name that is not UTF-8 read (the line is bytes). tests/test_ipc.py reads the
    lines src/ipc.rs's tests read."""
    assert _proc.parse_start_time(line) == start


def test_a_zombie_is_dead_and_a_live_process_is_itself() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        while True:  # exited, not reaped: a zombie
            with open(f"/proc/{child.pid}/stat", "rb") as stat:
                if stat.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    break
        assert _proc.start_time(child.pid) is None
    finally:
        child.wait()
    assert _proc.start_time(child.pid) is None  # reaped: gone
    started = _proc.own_start_time()
    assert _proc.alive(os.getpid(), started) and not _proc.alive(os.getpid(), started + 1)
