"""KeyAccountingUnit (Flink scenario 24) and RecordContext reference counting (scenario 25)."""

from __future__ import annotations

import pytest

import asyncstate as ast
from asyncstate.runtime.context import RecordContext
from asyncstate.runtime.key_accounting import KeyAccountingUnit
from asyncstate.serde import canonical_key

K1 = canonical_key(1)
K2 = canonical_key(2)


def test_flink_scenario_24_occupy_and_release() -> None:
    kau = KeyAccountingUnit()
    record1, record2 = "record1", "record2"
    assert kau.occupy(record1, K1)
    assert kau.occupied_count() == 1
    assert not kau.occupy(record1, K1)  # same holder, same key: still refused
    assert kau.occupy(record2, K2)
    assert kau.occupied_count() == 2
    kau.release(record1, K1)
    assert kau.occupied_count() == 1
    assert kau.occupy(record2, K1)
    assert not kau.occupy(record1, K1)  # record2 holds it now
    with pytest.raises(ast.InvalidStateError, match="released by"):
        kau.release(record1, K1)
    # derived: the wrong-holder release frees the key before raising
    assert kau.occupied_count() == 1
    assert kau.occupy(record1, K1)


def test_holder_identity_not_equality() -> None:
    kau = KeyAccountingUnit()
    holder = ["same"]
    equal_but_other = ["same"]
    assert kau.occupy(holder, K1)
    with pytest.raises(ast.InvalidStateError):
        kau.release(equal_but_other, K1)


def test_release_of_a_free_key_raises() -> None:
    kau = KeyAccountingUnit()
    with pytest.raises(ast.InvalidStateError):
        kau.release("nobody", K1)
    assert kau.occupied_count() == 0


def test_keys_are_compared_by_canonical_bytes() -> None:
    kau = KeyAccountingUnit()
    assert kau.occupy("a", canonical_key([1, 2]))
    assert not kau.occupy("b", canonical_key((1, 2)))  # a list and a tuple: one key
    assert kau.occupy("c", canonical_key(1.0))  # 1 and 1.0 are different keys
    assert kau.occupy("d", canonical_key(True))
    assert kau.occupy("e", K1)
    assert kau.occupied_count() == 4


def _context(disposed: list[RecordContext]) -> RecordContext:
    return RecordContext("record", "key", canonical_key("key"), 0, disposed.append)


def test_flink_scenario_25_retain_release_disposes_at_zero_when_key_held() -> None:
    disposed: list[RecordContext] = []
    ctx = _context(disposed)
    ctx.key_occupied = True
    assert ctx.retain() == 1
    assert ctx.ref_count == 1
    assert disposed == []
    assert ctx.release() == 0
    assert ctx.ref_count == 0
    assert disposed == [ctx]


def test_release_to_zero_without_the_key_does_not_dispose() -> None:
    disposed: list[RecordContext] = []
    ctx = _context(disposed)
    ctx.retain()
    ctx.retain()
    assert ctx.release() == 1
    assert ctx.release() == 0
    assert disposed == []


def test_release_below_zero_raises() -> None:
    ctx = _context([])
    with pytest.raises(ast.InvalidStateError, match="released more often than retained"):
        ctx.release()
    assert ctx.ref_count == 0


def test_record_contexts_compare_by_identity() -> None:
    a, b = _context([]), _context([])
    assert a != b
    assert len({a, b}) == 2
