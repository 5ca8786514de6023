"""ManualClock: time moves only forward, and only when told."""

from __future__ import annotations

import pytest

import asyncstate as ast
from asyncstate.testing import ManualClock


def test_manual_clock():
    clock = ast.ManualClock()
    assert clock.now_ms() == 0
    clock.advance(5)
    clock.set(12)
    assert clock.now_ms() == 12
    with pytest.raises(ast.ConfigError, match="never goes backwards, got 11"):
        clock.set(11)
    with pytest.raises(ast.ConfigError, match="non-negative int"):
        clock.advance(-1)
    assert clock.now_ms() == 12
    assert ast.ManualClock(start_ms=100).now_ms() == 100


def test_manual_clock_moves_only_forward() -> None:
    clock = ManualClock(5)
    clock.advance(10)
    assert clock.now_ms() == 15
    clock.set(20)
    assert clock.now_ms() == 20
    with pytest.raises(ValueError, match="never goes backwards"):
        clock.set(19)
    with pytest.raises(ValueError, match="non-negative"):
        clock.advance(-1)


def test_manual_clock_stays_within_signed_64_bit_milliseconds() -> None:
    clock = ManualClock(2**63 - 2)
    clock.advance(1)
    assert clock.now_ms() == 2**63 - 1
    with pytest.raises(ast.ConfigError, match=r"^ms must be at most 0: the clock would pass "
                                              r"2\*\*63 - 1 ms from 9223372036854775807, got 1$"):
        clock.advance(1)
    assert clock.now_ms() == 2**63 - 1  # unchanged by the refused call
    for bad in (2**63, -(2**63) - 1):
        with pytest.raises(ast.ConfigError, match=r"^start_ms must be an int of milliseconds in "
                                                  r"\[-2\*\*63, 2\*\*63 - 1\]"):
            ManualClock(bad)
    with pytest.raises(ast.ConfigError, match=r"^ms must be an int of milliseconds in "):
        ManualClock(0).set(2**63)
    assert ManualClock(-(2**63)).now_ms() == -(2**63)

