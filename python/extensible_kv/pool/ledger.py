"""The pool's ledger: what it records, and its file format (docs/design.md §11).

The ledger is one JSON document behind a header line that carries a magic word, the format
version, the body's length and its SHA-256:

    EKVPOOL 2 <length> <sha256 hex>\\n<JSON body>

Another process wrote it, maybe one that died half-way through something (though never half-way
through the file: writes go to a new file renamed over the old one), or something else entirely
did. So `decode` checks everything: the header, the checksum, then every field's type and range
and the references between records. Anything wrong is a `LedgerCorruptError` naming the field,
never a crash further on.

**Format 2** counts in bytes across engines: engines of different models (different block
bytes, segments, buffers) share a device, so what the pool holds, its cap per device, what a
loan moves and what a request asks for are bytes; each engine's own numbers (its limits, what
it committed, where a loan lies in its cache) stay in its own blocks, beside them. An engine's
entry carries its cache's shape (`extensible_kv.shape.CacheShape`: device, granularity, and
per buffer its segments and their block bytes), from which its block bytes follow; a loan's
memory is its `Loan`s in their JSON form (`Loan.to_json`). A ledger of format 1 (an older
library's) is refused with a `LedgerVersionError` that says to `pool reset` it: its
engines' layouts cannot be read as shapes, and the engines that wrote it cannot read format 2.

Times are `time.monotonic()` seconds: CLOCK_MONOTONIC is one clock for every process of the
machine since boot, and the ledger lives in memory that a reboot clears.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

from extensible_kv.ipc import Loan
from extensible_kv.shape import CacheShape

__all__ = [
    "DEVICE",
    "ENGINE_NAME",
    "LOAN_STATES",
    "MAX_INT",
    "MAX_REASON",
    "MAX_TIME",
    "VERSION",
    "Engine",
    "Event",
    "Ledger",
    "LedgerCorruptError",
    "LedgerVersionError",
    "LoanState",
    "PoolLoan",
    "check_device",
    "check_name",
    "concerns",
    "decode",
    "encode",
    "refusal",
]

MAGIC = "EKVPOOL"
VERSION = 2
MAX_LEDGER_BYTES = 1 << 24  # a ledger of thousands of loans is well under a MiB
MAX_EVENTS = 64
MAX_BUFFERS = 4096  # of an engine's shape: a cache of a buffer a layer is far below it
ENGINE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
DEVICE = re.compile(r"^(cpu|cuda:\d{1,3})$")
MAX_INT = 2**128  # every integer read is below it: tensor ids are 128 bits, nothing else comes near
MAX_TIME = 1e12  # every time read is below it (seconds of CLOCK_MONOTONIC: ~31,700 years)
MAX_REASON = 1024  # characters of a loan's reason


class LoanState(enum.StrEnum):
    """A loan's state, and what holds while a loan is in it. `rules.py` opens with the table
    of the transitions between them, each made by one function there.

    - `ASKED`: the borrower asked the lender for `blocks` of its own blocks (`asked_bytes`).
      No memory moved: `loans` is empty and `num_bytes` 0. The lender answers by `deadline`,
      else the request expires.
    - `OFFERED`: the lender lent the whole handles past its block `kept_blocks`
      (`lent_blocks` of its blocks, `num_bytes`), which `loans` describe; they give the
      borrower `blocks` of its blocks. Unmapped by the lender, mapped by no one: the memory
      is the lender's process's, counted in the pool. The borrower takes it by `deadline`,
      else the lender takes it back.
    - `BORROWED`: the borrower maps it from its block `start_block`; only the borrower ends
      it (a give-back, or its death). An empty `lender`: the lender died, and giving the loan
      back frees the memory (an orphan).
    - `RETURNED`: the borrower gave it back, could not take it, or died (an empty `borrower`
      then): mapped by no one, the lender's to reclaim, and the entry goes with the reclaim.
    - `REFUSED`: the lender said no (`reason`). No memory moved; the borrower reads it and
      withdraws it.
    - `EXPIRED`: the lender did not answer by the deadline, and is `stuck` until its next
      heartbeat. No memory moved; the borrower withdraws it.
    - `RELEASED`: the lender answered through the driver (`via="driver"`): it gave
      `lent_blocks` of its blocks back to the device for the borrower to commit. No memory
      changes owner; the borrower reads it and withdraws it.

    The lender's memory is out (`memory_out`: lent and not reclaimed) exactly while offered,
    borrowed or returned; the request has ended with no memory (`ended`) when refused,
    expired or released."""

    ASKED = "asked"
    OFFERED = "offered"
    BORROWED = "borrowed"
    RETURNED = "returned"
    REFUSED = "refused"
    EXPIRED = "expired"
    RELEASED = "released"

    @property
    def memory_out(self) -> bool:
        """The lender's memory is out: lent, and not reclaimed yet."""
        return self in _MEMORY_OUT

    @property
    def ended(self) -> bool:
        """A request answered with no memory (refused, expired, released): the borrower's to
        read and withdraw."""
        return self in _ENDED


_MEMORY_OUT = frozenset({LoanState.OFFERED, LoanState.BORROWED, LoanState.RETURNED})
_ENDED = frozenset({LoanState.REFUSED, LoanState.EXPIRED, LoanState.RELEASED})
LOAN_STATES = tuple(state.value for state in LoanState)


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


class LedgerVersionError(LedgerCorruptError):
    """The ledger is of another format version (an older or newer library's): this library
    cannot read it, and the engines that wrote it cannot read this one's. The message says
    which; once those engines are gone, `python -m extensible_kv pool reset` starts a new
    one."""


@dataclass
class Engine:
    """One engine of the pool. `pid` and `start_time` (the process's start, in clock ticks
    after boot, from `/proc/<pid>/stat`) identify its process even after the pid is reused.
    `shape` is its cache's (the device, the granularity, the buffers' segments and block
    bytes): a loan moves between engines of one device and granularity, whatever their
    shapes. Its limits and holdings in blocks are its own blocks, of `block_bytes` (all of
    its cache's buffers); the bytes are the pool's common unit."""

    name: str
    pid: int
    start_time: int
    shape: CacheShape
    min_blocks: int
    max_blocks: int
    capacity_blocks: int = 0  # its cache's: no limit goes past it
    committed_blocks: int = 0
    physical_bytes: int = 0
    lent_bytes: int = 0
    borrowed_bytes: int = 0
    lendable_blocks: int = 0  # what it could lend at once, as of its last heartbeat
    # What could go (back) at once: its free tail, or moving live blocks down, its free blocks.
    spare_blocks: int = 0
    heartbeat: float = 0.0
    busy: bool = False
    stuck: bool = False  # a request to it expired since its last heartbeat

    @property
    def device(self) -> str:
        return self.shape.device

    @property
    def block_bytes(self) -> int:
        """The bytes of one of its blocks, in every buffer together."""
        return self.shape.block_bytes()

    @property
    def committed_bytes(self) -> int:
        return self.committed_blocks * self.block_bytes

    @property
    def min_bytes(self) -> int:
        return self.min_blocks * self.block_bytes

    @property
    def max_bytes(self) -> int:
        return self.max_blocks * self.block_bytes

    @property
    def lendable_bytes(self) -> int:
        return self.lendable_blocks * self.block_bytes

    def to_json(self) -> dict[str, Any]:
        raw = dict(vars(self))
        raw["shape"] = self.shape.to_json()
        return raw


@dataclass
class PoolLoan:
    """A loan of the pool, from the request to the reclaim (its `state`: see `LoanState`).
    `lender` is empty once the lender died while the borrower held the memory: the
    borrower's give-back then returns it to the driver. `borrower` is empty once a returned
    loan's borrower is gone.

    In the borrower's blocks: `blocks` (asked for, then what the loan gives it) and
    `start_block` (where it lies in the borrower). In the lender's: `lent_blocks` (lent, or
    released to the driver) and `kept_blocks` (what it kept below the loan). In bytes:
    `asked_bytes` (the request), `num_bytes` (the memory lent) and `mapped_bytes` (what the
    borrower maps of it while it is borrowed: handles its layout cannot use go back to the
    lender at once, unmapped, and stay the lender's until the reclaim). `loans` are the
    lender's `Loan`s, one per buffer of its cache."""

    loan_id: int
    lender: str
    borrower: str
    blocks: int
    state: LoanState
    deadline: float
    num_bytes: int = 0
    start_block: int = 0
    kept_blocks: int = 0
    recall: bool = False
    reason: str = ""
    loans: tuple[Loan, ...] = ()
    asked_bytes: int = 0
    lent_blocks: int = 0
    mapped_bytes: int = 0

    @property
    def memory_out(self) -> bool:
        """The lender's memory is out (offered, borrowed or returned: `LoanState`)."""
        return LoanState(self.state).memory_out

    def to_json(self) -> dict[str, Any]:
        raw = dict(vars(self))
        raw["state"] = str(self.state)
        raw["loans"] = [loan.to_json() for loan in self.loans]
        return raw


@dataclass
class Event:
    time: float
    text: str


@dataclass
class Ledger:
    """The whole ledger. `caps` caps, per device, the bytes the pool's engines may hold in all
    (a device without one is capped by its free memory alone). `stale_after_s`: an engine
    whose heartbeat is older is unresponsive and not asked for memory."""

    generation: int = 0
    next_loan_id: int = 1
    stale_after_s: float = 5.0
    caps: dict[str, int] = field(default_factory=dict)
    engines: dict[str, Engine] = field(default_factory=dict)
    loans: dict[int, PoolLoan] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)

    @property
    def shares(self) -> dict[str, int]:
        """Deprecated: `caps`."""
        warnings.warn("Ledger.shares is deprecated: use Ledger.caps", DeprecationWarning, 2)
        return self.caps

    def log(self, now: float, text: str) -> None:
        """Keeps the last `MAX_EVENTS` events, for `pool status`."""
        self.events.append(Event(now, text))
        del self.events[:-MAX_EVENTS]

    def loans_of(self, name: str) -> list[PoolLoan]:
        return [loan for loan in self.loans.values() if name in (loan.lender, loan.borrower)]

    def to_json(self) -> dict[str, Any]:
        """The body of the ledger's file."""
        return {
            "generation": self.generation,
            "next_loan_id": self.next_loan_id,
            "stale_after_s": self.stale_after_s,
            "caps": self.caps,
            "engines": [e.to_json() for e in self.engines.values()],
            "loans": [loan.to_json() for loan in self.loans.values()],
            "events": [vars(e) for e in self.events],
        }


def deprecated_name(module: str, name: str, stacklevel: int = 3) -> Any:
    """What a deprecated name of `module` stands for, with a `DeprecationWarning` to the code
    that used it; an `AttributeError` for any other name."""
    if name == "LoanEntry":  # the name of format 1's days
        warnings.warn(
            f"{module}.LoanEntry is deprecated: it is PoolLoan", DeprecationWarning, stacklevel
        )
        return PoolLoan
    raise AttributeError(f"module {module!r} has no attribute {name!r}")


def __getattr__(name: str) -> Any:
    return deprecated_name(__name__, name)


def encode(ledger: Ledger) -> bytes:
    body = json.dumps(ledger.to_json(), separators=(",", ":")).encode()
    digest = hashlib.sha256(body).hexdigest()
    return f"{MAGIC} {VERSION} {len(body)} {digest}\n".encode() + body


def decode(data: bytes, where: str = "the ledger") -> Ledger:
    """The ledger `data` holds, every field checked; else a `LedgerCorruptError` (a
    `LedgerVersionError` for a ledger of another format)."""
    try:
        return _decode(data)
    except _OtherVersion as other:
        raise LedgerVersionError(
            f"{where} is of format {other}, and this library reads format {VERSION} (a ledger "
            "counted in bytes across models): an engine of another version of extensible_kv "
            "wrote it; once no such engine uses the pool, `python -m extensible_kv pool "
            "reset` starts a new one"
        ) from None
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
    except (_Bad, _OtherVersion) as bad:
        return str(bad)
    return None


def concerns(data: bytes, name: str) -> dict[str, Any] | None:
    """What in ledger `data` engine `name` must act on, equal (`==`) between two ledgers
    exactly when that is unchanged (None: `data` is no ledger): its limits and its
    stuck flag, the caps, and every loan it lends or borrows. Not checked as `decode`
    checks: a member compares it with what its last transaction left, to skip one that
    would find nothing to do (`MemberBase._quiet`); anything it acts on, it reads in a
    transaction."""
    try:
        top = json.loads(data.partition(b"\n")[2])
        engines = [e for e in top["engines"] if e.get("name") == name]
        mine = [
            {k: e.get(k) for k in ("pid", "start_time", "min_blocks", "max_blocks", "stuck")}
            for e in engines
        ]
        loans = [
            loan for loan in top["loans"] if name in (loan.get("lender"), loan.get("borrower"))
        ]
        return {"engine": mine, "caps": top["caps"], "loans": loans}
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return None


class _Bad(Exception):
    pass


class _OtherVersion(Exception):
    pass


def _decode(data: bytes) -> Ledger:
    if len(data) > MAX_LEDGER_BYTES:
        raise _Bad(f"{len(data)} bytes, more than a ledger can hold ({MAX_LEDGER_BYTES})")
    header, newline, body = data.partition(b"\n")
    parts = header.split(b" ")
    if not newline or len(parts) != 4 or parts[0] != MAGIC.encode():
        raise _Bad("no EKVPOOL header line")
    if parts[1] != str(VERSION).encode():
        if re.fullmatch(rb"[0-9]{1,6}", parts[1]):
            raise _OtherVersion(parts[1].decode())
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
    caps = top["caps"]
    if not isinstance(caps, dict):
        raise _Bad("caps is not an object")
    for device, num_bytes in caps.items():
        ledger.caps[_device(device, "a cap's device")] = _int(num_bytes, f"caps[{device}]")
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
    "caps": dict,
    "engines": list,
    "loans": list,
    "events": list,
}
_ENGINE = {
    "name": str,
    "pid": int,
    "start_time": int,
    "shape": dict,
    "min_blocks": int,
    "max_blocks": int,
    "capacity_blocks": int,
    "committed_blocks": int,
    "physical_bytes": int,
    "lent_bytes": int,
    "borrowed_bytes": int,
    "lendable_blocks": int,
    "spare_blocks": int,
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
    "asked_bytes": int,
    "lent_blocks": int,
    "mapped_bytes": int,
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


def _shape(raw: dict[str, Any], where: str) -> CacheShape:
    """The engine's cache shape, as `CacheShape.from_json` reads it, within the ledger's
    ranges."""
    try:
        shape = CacheShape.from_json(raw)
    except (ValueError, TypeError, KeyError) as error:
        raise _Bad(f"{where} is not a cache shape ({str(error)[:200]})") from None
    _device(shape.device, f"{where}.device")
    _int(shape.granularity, f"{where}.granularity", minimum=1)
    _int(shape.leading_blocks, f"{where}.leading_blocks")
    if not 0 < len(shape.buffers) <= MAX_BUFFERS:
        raise _Bad(f"{where} has {len(shape.buffers)} buffers, not 1 to {MAX_BUFFERS}")
    for i, buffer in enumerate(shape.buffers):
        _int(buffer.num_segments, f"{where}.buffers[{i}].num_segments", minimum=1)
        _int(buffer.segment_block_bytes, f"{where}.buffers[{i}].segment_block_bytes", minimum=1)
    _int(shape.block_bytes(), f"{where}'s block bytes", minimum=1)
    return shape


def _engine(raw: object, where: str) -> Engine:
    fields_ = dict(_obj(raw, where, _ENGINE))
    fields_["shape"] = _shape(fields_["shape"], f"{where}.shape")
    engine = Engine(**fields_)
    _name(engine.name, f"{where}.name")
    _int(engine.pid, f"{where}.pid", minimum=1)
    for key in (
        "start_time",
        "committed_blocks",
        "physical_bytes",
        "lent_bytes",
        "borrowed_bytes",
        "lendable_blocks",
        "spare_blocks",
        "min_blocks",
        "max_blocks",
    ):
        _int(getattr(engine, key), f"{where}.{key}")
    if engine.min_blocks > engine.max_blocks:
        raise _Bad(f"{where}: min_blocks {engine.min_blocks} > max_blocks {engine.max_blocks}")
    if engine.max_blocks > _int(engine.capacity_blocks, f"{where}.capacity_blocks"):
        raise _Bad(f"{where}: max_blocks {engine.max_blocks} > capacity {engine.capacity_blocks}")
    engine.heartbeat = _float(engine.heartbeat, f"{where}.heartbeat")
    return engine


def _loan(raw: object, where: str, ledger: Ledger) -> PoolLoan:
    fields_ = dict(_obj(raw, where, _LOAN))
    try:
        fields_["state"] = LoanState(fields_["state"])
    except ValueError:
        raise _Bad(f"{where}.state {fields_['state'][:32]!r} is not one of {LOAN_STATES}") from None
    loans = []
    for i, item in enumerate(fields_["loans"]):
        try:
            loans.append(Loan.from_json(item))
        except ValueError as error:
            raise _Bad(f"{where}.loans[{i}]: {error}") from None
    fields_["loans"] = tuple(loans)
    loan = PoolLoan(**fields_)
    _int(loan.loan_id, f"{where}.loan_id", minimum=1)
    if loan.loan_id >= ledger.next_loan_id:
        raise _Bad(f"{where}.loan_id {loan.loan_id} was never handed out")
    for role in ("lender", "borrower"):
        name = getattr(loan, role)
        if name == "" and loan.state == ("borrowed" if role == "lender" else "returned"):
            continue  # the lender died while the borrower held it; or the borrower is gone
        if _name(name, f"{where}.{role}") not in ledger.engines:
            raise _Bad(f"{where}.{role} {name!r} is not an engine of the pool")
    if loan.lender == loan.borrower:
        raise _Bad(f"{where} lends from {loan.lender!r} to itself")
    _int(loan.blocks, f"{where}.blocks", minimum=1)
    for key in (
        "num_bytes",
        "start_block",
        "kept_blocks",
        "asked_bytes",
        "lent_blocks",
        "mapped_bytes",
    ):
        _int(getattr(loan, key), f"{where}.{key}")
    loan.deadline = _float(loan.deadline, f"{where}.deadline")
    if len(loan.reason) > MAX_REASON:
        raise _Bad(f"{where}.reason is too long")
    if loan.memory_out != bool(loan.loans) or loan.memory_out != bool(loan.num_bytes):
        raise _Bad(f"{where}: a loan {loan.state} must describe memory exactly when it has some")
    if loan.num_bytes != sum(x.num_bytes for x in loan.loans):
        raise _Bad(f"{where}.num_bytes {loan.num_bytes} is not what its loans describe")
    mapped = loan.state == LoanState.BORROWED
    if mapped != bool(loan.mapped_bytes) or loan.mapped_bytes > loan.num_bytes:
        raise _Bad(
            f"{where}.mapped_bytes {loan.mapped_bytes}: a loan {loan.state} maps some of its "
            f"{loan.num_bytes} B exactly when borrowed"
        )
    return loan
