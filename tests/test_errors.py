"""The exception classes (`src/python/errors.rs`): where they live, and that they survive pickling,
as a serving stack's worker processes send them to the engine with their fields."""

from __future__ import annotations

import multiprocessing
import pickle
from concurrent.futures import ProcessPoolExecutor

import extensible_kv
import pytest
from extensible_kv import (
    ClosedError,
    DriverError,
    ExtensibleTensor,
    OutOfMemoryError,
    UnsupportedError,
    _native,
)

G = 4096
CLASSES = [OutOfMemoryError, DriverError, UnsupportedError, ClosedError]
FIELDS = {
    OutOfMemoryError: ("op", "code", "requested_bytes", "free_bytes"),
    DriverError: ("op", "code"),
    UnsupportedError: (),
    ClosedError: (),
}


def _raise(kind: str) -> None:
    """Raises a real error of the library of `kind`."""
    if kind == "oom":
        t = ExtensibleTensor(8 * G, device="cpu", granularity=G, _fault=("create", 1, "oom"))
        t.resize_(4 * G)
    elif kind == "driver":
        t = ExtensibleTensor(8 * G, device="cpu", granularity=G, _fault=("map", 1, "driver"))
        t.resize_(G)
    elif kind == "unsupported":
        ExtensibleTensor(8 * G, device="cuda:4096")
    elif kind == "closed":
        t = ExtensibleTensor(8 * G, device="cpu", granularity=G)
        t.close()
        t.resize_(G)
    raise AssertionError(f"{kind} did not raise")


KINDS = {
    "oom": OutOfMemoryError,
    "driver": DriverError,
    "unsupported": UnsupportedError,
    "closed": ClosedError,
}


def _caught(kind: str) -> BaseException:
    with pytest.raises(KINDS[kind]) as info:
        _raise(kind)
    return info.value


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_classes_live_in_the_native_module_and_the_package(cls: type[BaseException]) -> None:
    assert cls.__module__ == "extensible_kv._native"
    assert getattr(_native, cls.__name__) is cls
    assert getattr(extensible_kv, cls.__name__) is cls
    assert cls.__name__ in extensible_kv.__all__


@pytest.mark.parametrize("kind", KINDS)
def test_errors_round_trip_through_pickle_with_their_fields(kind: str) -> None:
    error = _caught(kind)
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        copy = pickle.loads(pickle.dumps(error, protocol=protocol))
        assert type(copy) is type(error) and str(copy) == str(error)
        for field in FIELDS[type(error)]:
            assert getattr(copy, field) == getattr(error, field), field
    if kind == "oom":
        assert (error.op, error.code, error.requested_bytes) == ("create", "INJECTED_OOM", 4 * G)
    if kind == "driver":
        assert (error.op, error.code) == ("map", "INJECTED_FAULT")


def _fail_in_worker(kind: str) -> None:
    _raise(kind)


def test_errors_cross_process_boundaries() -> None:
    """A worker process's error reaches the parent with its type and fields."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        futures = {kind: pool.submit(_fail_in_worker, kind) for kind in KINDS}
        for kind, future in futures.items():
            error = future.exception(timeout=120)
            local = _caught(kind)
            assert type(error) is type(local), (kind, error)
            assert str(error) == str(local)
            for field in FIELDS[type(local)]:
                assert getattr(error, field) == getattr(local, field), (kind, field)
