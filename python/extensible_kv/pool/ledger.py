"""The pool's ledger: what it records, and its file format (docs/design.md §11).

The ledger is one JSON document behind a header line that carries a magic word, the format
version, the body's length and its SHA-256:

    EKVPOOL 1 <length> <sha256 hex>\\n<JSON body>

Another process wrote it, maybe one that died half-way through something (though never half-way
through the file: writes go to a new file renamed over the old one), or something else entirely
did. So `decode` checks everything: the header, the checksum, then every field's type and range
and the references between records. Anything wrong is a `LedgerCorruptError` naming the field,
never a crash further on.

Times are `time.monotonic()` seconds: CLOCK_MONOTONIC is one clock for every process of the
machine since boot, and the ledger lives in memory that a reboot clears.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DEVICE",
    "ENGINE_NAME",
    "LOAN_STATES",
    "MAX_INT",
    "MAX_LAYOUT",
    "MAX_REASON",
    "MAX_TIME",
    "Engine",
    "Event",
    "Ledger",
    "LedgerCorruptError",
    "LoanEntry",
    "check_device",
    "check_name",
    "decode",
    "encode",
    "refusal",
]

MAGIC = "EKVPOOL"
VERSION = 1
MAX_LEDGER_BYTES = 1 << 24  # a ledger of thousands of loans is well under a MiB
MAX_EVENTS = 64
ENGINE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
DEVICE = re.compile(r"^(cpu|cuda:\d{1,3})$")
MAX_INT = 2**128  # every integer read is below it: tensor ids are 128 bits, nothing else comes near
MAX_TIME = 1e12  # every time read is below it (seconds of CLOCK_MONOTONIC: ~31,700 years)
MAX_REASON = 1024  # characters of a loan's reason
MAX_LAYOUT = 256  # characters of an engine's layout
# asked: the borrower asked the lender for `blocks`; the lender answers by `deadline`.
# offered: the lender lent what lay past its block `kept_blocks`; `loans` describe the
# memory; the borrower takes it by `deadline`.
# borrowed: the borrower maps it, from its block `start_block`.
# returned: the borrower gave it back, or died: the lender reclaims it, then removes the entry.
# refused / expired: the lender said no (`reason`) / did not answer in time; the borrower
# removes the entry once it has read it.
LOAN_STATES = ("asked", "offered", "borrowed", "returned", "refused", "expired")
_LOAN_FIELDS = 8  # of an `extensible_kv.ipc.Loan`'s native tuple


def check_name(value: object, what: str) -> str:
    """`value` if it is a name the ledger reads (an engine's or a pool's: 1 to 64 letters,
    digits, `.`, `_` or `-`, starting with a letter or digit); else a `TypeError` or
    `ValueError` naming `what`."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, not {type(value).__name__}")
    if not ENGINE_NAME.match(value):
        raise ValueError(
            f"{what} {value[:80]!r}: 1 to 64 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit"
        )
    return value


def check_device(value: object, what: str = "device") -> str:
    """`value` if it is a device the ledger reads (`cpu`, `cuda:N`); else a `TypeError` or
    `ValueError` naming `what`."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, not {type(value).__name__}")
    if not DEVICE.match(value):
        raise ValueError(f"{what} {value[:40]!r}: cpu or cuda:N")
    return value


class LedgerCorruptError(ValueError):
    """The ledger file is not one this library wrote, or was damaged: the message says what is
    wrong and where; `python -m extensible_kv pool reset` starts a new one."""


@dataclass
class Engine:
    """One engine of the pool. `pid` and `start_time` (the process's start, in clock ticks
    after boot, from `/proc/<pid>/stat`) identify its process even after the pid is reused.
    Limits and holdings are in blocks of `block_bytes` (all of its cache's buffers). Engines
    lend only to engines of the same `layout` (a loan is whole blocks of one geometry) on the
    same `device`."""

    name: str
    pid: int
    start_time: int
    device: str
    layout: str
    block_bytes: int
    min_blocks: int
    max_blocks: int
    capacity_blocks: int = 0  # its cache's: no limit goes past it
    committed_blocks: int = 0
    physical_bytes: int = 0
    lent_bytes: int = 0
    borrowed_bytes: int = 0
    lendable_blocks: int = 0  # what it could lend at once, as of its last heartbeat
    free_top_blocks: int = 0  # its top blocks no request uses: what could go (back) at once
    heartbeat: float = 0.0
    busy: bool = False
    stuck: bool = False  # a request to it expired since its last heartbeat


@dataclass
class LoanEntry:
    """A loan in flight, from the request to the reclaim (see `LOAN_STATES`). `lender` is
    empty once the lender died while the borrower held the memory: the borrower's give-back
    then returns it to the driver. `borrower` is empty once a returned loan's borrower is
    gone. `loans` are the native tuples of the `Loan`s, one per
    buffer of the lender's cache."""

    loan_id: int
    lender: str
    borrower: str
    blocks: int
    state: str
    deadline: float
    num_bytes: int = 0
    start_block: int = 0
    kept_blocks: int = 0
    recall: bool = False
    reason: str = ""
    loans: list[list[Any]] = field(default_factory=list)


@dataclass
class Event:
    time: float
    text: str


@dataclass
class Ledger:
    """The whole ledger. `shares` caps, per device, the bytes the pool's engines may hold in
    all (a device without one is capped by its free memory alone). `stale_after_s`: an engine
    whose heartbeat is older is unresponsive and not asked for memory."""

    generation: int = 0
    next_loan_id: int = 1
    stale_after_s: float = 5.0
    shares: dict[str, int] = field(default_factory=dict)
    engines: dict[str, Engine] = field(default_factory=dict)
    loans: dict[int, LoanEntry] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)

    def log(self, now: float, text: str) -> None:
        """Keeps the last `MAX_EVENTS` events, for `pool status`."""
        self.events.append(Event(now, text))
        del self.events[:-MAX_EVENTS]

    def loans_of(self, name: str) -> list[LoanEntry]:
        return [loan for loan in self.loans.values() if name in (loan.lender, loan.borrower)]


def encode(ledger: Ledger) -> bytes:
    body = json.dumps(
        {
            "generation": ledger.generation,
            "next_loan_id": ledger.next_loan_id,
            "stale_after_s": ledger.stale_after_s,
            "shares": ledger.shares,
            # vars, not dataclasses.asdict: the fields are flat, and asdict's deep copy made
            # encoding most of a transaction's time.
            "engines": [vars(e) for e in ledger.engines.values()],
            "loans": [vars(loan) for loan in ledger.loans.values()],
            "events": [vars(e) for e in ledger.events],
        },
        separators=(",", ":"),
    ).encode()
    digest = hashlib.sha256(body).hexdigest()
    return f"{MAGIC} {VERSION} {len(body)} {digest}\n".encode() + body


def decode(data: bytes, where: str = "the ledger") -> Ledger:
    """The ledger `data` holds, every field checked; else a `LedgerCorruptError`."""
    try:
        return _decode(data)
    except _Bad as bad:
        raise LedgerCorruptError(
            f"{where} is corrupt: {bad}; if no engine uses the pool any more, "
            "`python -m extensible_kv pool reset` starts a new one"
        ) from None


def refusal(data: bytes) -> str | None:
    """Why `decode` would refuse `data` (None: it reads it). A writer asks before it writes,
    so that the ledger never holds a value its readers refuse."""
    try:
        _decode(data)
    except _Bad as bad:
        return str(bad)
    return None


class _Bad(Exception):
    pass


def _decode(data: bytes) -> Ledger:
    if len(data) > MAX_LEDGER_BYTES:
        raise _Bad(f"{len(data)} bytes, more than a ledger can hold ({MAX_LEDGER_BYTES})")
    header, newline, body = data.partition(b"\n")
    parts = header.split(b" ")
    if not newline or len(parts) != 4 or parts[0] != MAGIC.encode():
        raise _Bad("no EKVPOOL header line")
    if parts[1] != str(VERSION).encode():
        raise _Bad(f"format version {parts[1][:16]!r}, this library reads {VERSION}")
    if parts[2] != str(len(body)).encode():
        raise _Bad(f"the header says {parts[2][:24]!r} bytes of body, the file has {len(body)}")
    if parts[3] != hashlib.sha256(body).hexdigest().encode():
        raise _Bad("the body's checksum does not match the header's")
    try:
        raw = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise _Bad(f"the body is not JSON ({error})") from None
    top = _obj(raw, "the body", _TOP)
    ledger = Ledger(
        generation=_int(top["generation"], "generation"),
        next_loan_id=_int(top["next_loan_id"], "next_loan_id", minimum=1),
        stale_after_s=_float(top["stale_after_s"], "stale_after_s"),
    )
    shares = top["shares"]
    if not isinstance(shares, dict):
        raise _Bad("shares is not an object")
    for device, num_bytes in shares.items():
        ledger.shares[_device(device, "a share's device")] = _int(num_bytes, f"shares[{device}]")
    for i, item in enumerate(_list(top["engines"], "engines")):
        engine = _engine(item, f"engines[{i}]")
        if engine.name in ledger.engines:
            raise _Bad(f"engine {engine.name!r} is listed twice")
        ledger.engines[engine.name] = engine
    for i, item in enumerate(_list(top["loans"], "loans")):
        loan = _loan(item, f"loans[{i}]", ledger)
        if loan.loan_id in ledger.loans:
            raise _Bad(f"loan {loan.loan_id} is listed twice")
        ledger.loans[loan.loan_id] = loan
    for i, item in enumerate(_list(top["events"], "events")):
        event = _obj(item, f"events[{i}]", {"time": float, "text": str})
        ledger.events.append(Event(_float(event["time"], "an event's time"), event["text"]))
    return ledger


_TOP = {
    "generation": int,
    "next_loan_id": int,
    "stale_after_s": float,
    "shares": dict,
    "engines": list,
    "loans": list,
    "events": list,
}
_ENGINE = {
    "name": str,
    "pid": int,
    "start_time": int,
    "device": str,
    "layout": str,
    "block_bytes": int,
    "min_blocks": int,
    "max_blocks": int,
    "capacity_blocks": int,
    "committed_blocks": int,
    "physical_bytes": int,
    "lent_bytes": int,
    "borrowed_bytes": int,
    "lendable_blocks": int,
    "free_top_blocks": int,
    "heartbeat": float,
    "busy": bool,
    "stuck": bool,
}
_LOAN = {
    "loan_id": int,
    "lender": str,
    "borrower": str,
    "blocks": int,
    "state": str,
    "deadline": float,
    "num_bytes": int,
    "start_block": int,
    "kept_blocks": int,
    "recall": bool,
    "reason": str,
    "loans": list,
}


def _obj(raw: object, where: str, spec: dict[str, type]) -> dict[str, Any]:
    """`raw` as an object with exactly the keys of `spec`, each of its type (an int passes
    for a float: JSON writes 1.0 as 1.0, but a hand-edited file may not)."""
    if not isinstance(raw, dict):
        raise _Bad(f"{where} is not an object")
    if set(raw) != set(spec):
        missing, extra = sorted(set(spec) - set(raw)), sorted(set(raw) - set(spec))
        raise _Bad(f"{where} has missing keys {missing} / unknown keys {extra}")
    for key, kind in spec.items():
        value = raw[key]
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
        if kind is float:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok:
            raise _Bad(f"{where}.{key} is a {type(value).__name__}, not a {kind.__name__}")
    return raw


def _list(raw: object, where: str) -> list[Any]:
    if not isinstance(raw, list):
        raise _Bad(f"{where} is not a list")
    return raw


def _int(value: object, where: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Bad(f"{where} is not an integer")
    if not minimum <= value < MAX_INT:
        raise _Bad(f"{where} is {value}, out of range")
    return value


def _float(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Bad(f"{where} is not a number")
    number = float(value)
    if not 0.0 <= number < MAX_TIME:  # also refuses NaN and infinities
        raise _Bad(f"{where} is {number}, out of range")
    return number


def _name(value: object, where: str) -> str:
    if not isinstance(value, str) or not ENGINE_NAME.match(value):
        raise _Bad(f"{where} is not an engine name")
    return value


def _device(value: object, where: str) -> str:
    if not isinstance(value, str) or not DEVICE.match(value):
        raise _Bad(f"{where} ({str(value)[:32]!r}) is not a device (cpu, cuda:N)")
    return value


def _engine(raw: object, where: str) -> Engine:
    fields_ = _obj(raw, where, _ENGINE)
    engine = Engine(**fields_)
    _name(engine.name, f"{where}.name")
    _int(engine.pid, f"{where}.pid", minimum=1)
    _device(engine.device, f"{where}.device")
    if len(engine.layout) > MAX_LAYOUT:
        raise _Bad(f"{where}.layout is too long")
    for key in ("start_time", "committed_blocks", "physical_bytes", "lent_bytes"):
        _int(getattr(engine, key), f"{where}.{key}")
    _int(engine.borrowed_bytes, f"{where}.borrowed_bytes")
    _int(engine.lendable_blocks, f"{where}.lendable_blocks")
    _int(engine.free_top_blocks, f"{where}.free_top_blocks")
    _int(engine.block_bytes, f"{where}.block_bytes", minimum=1)
    _int(engine.min_blocks, f"{where}.min_blocks")
    _int(engine.max_blocks, f"{where}.max_blocks")
    if engine.min_blocks > engine.max_blocks:
        raise _Bad(f"{where}: min_blocks {engine.min_blocks} > max_blocks {engine.max_blocks}")
    if engine.max_blocks > _int(engine.capacity_blocks, f"{where}.capacity_blocks"):
        raise _Bad(f"{where}: max_blocks {engine.max_blocks} > capacity {engine.capacity_blocks}")
    engine.heartbeat = _float(engine.heartbeat, f"{where}.heartbeat")
    return engine


def _loan(raw: object, where: str, ledger: Ledger) -> LoanEntry:
    loan = LoanEntry(**_obj(raw, where, _LOAN))
    _int(loan.loan_id, f"{where}.loan_id", minimum=1)
    if loan.loan_id >= ledger.next_loan_id:
        raise _Bad(f"{where}.loan_id {loan.loan_id} was never handed out")
    if loan.state not in LOAN_STATES:
        raise _Bad(f"{where}.state {loan.state[:32]!r} is not one of {LOAN_STATES}")
    for role in ("lender", "borrower"):
        name = getattr(loan, role)
        if name == "" and loan.state == ("borrowed" if role == "lender" else "returned"):
            continue  # the lender died while the borrower held it; or the borrower is gone
        if _name(name, f"{where}.{role}") not in ledger.engines:
            raise _Bad(f"{where}.{role} {name!r} is not an engine of the pool")
    if loan.lender == loan.borrower:
        raise _Bad(f"{where} lends from {loan.lender!r} to itself")
    _int(loan.blocks, f"{where}.blocks", minimum=1)
    _int(loan.num_bytes, f"{where}.num_bytes")
    _int(loan.start_block, f"{where}.start_block")
    _int(loan.kept_blocks, f"{where}.kept_blocks")
    loan.deadline = _float(loan.deadline, f"{where}.deadline")
    if len(loan.reason) > MAX_REASON:
        raise _Bad(f"{where}.reason is too long")
    has_memory = loan.state in ("offered", "borrowed", "returned")
    if has_memory != bool(loan.loans) or has_memory != bool(loan.num_bytes):
        raise _Bad(f"{where}: a loan {loan.state} must describe memory exactly when it has some")
    for i, native in enumerate(loan.loans):
        _native_loan(native, f"{where}.loans[{i}]")
    return loan


def _native_loan(raw: object, where: str) -> None:
    """The shape of a `Loan`'s native tuple; the core checks the values again, against the
    lender's loan board, before anything is mapped."""
    fields_ = _list(raw, where)
    if len(fields_) != _LOAN_FIELDS:
        raise _Bad(f"{where} has {len(fields_)} fields, not {_LOAN_FIELDS}")
    if not isinstance(fields_[0], str) or len(fields_[0]) > 32:
        raise _Bad(f"{where}: the device is not a short string")
    for i in range(1, _LOAN_FIELDS - 1):
        _int(fields_[i], f"{where}[{i}]")
    for j, handle in enumerate(_list(fields_[-1], f"{where}.handles")):
        if not isinstance(handle, list) or len(handle) != 4:
            raise _Bad(f"{where}.handles[{j}] is not 4 integers")
        for value in handle:
            _int(value, f"{where}.handles[{j}]")
