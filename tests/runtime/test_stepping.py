"""One step of a record's coroutine (runtime/stepping.py)."""

from __future__ import annotations

import types
from collections.abc import Generator
from typing import Any

import pytest

from asyncstate.runtime.stepping import FINISHED, step


@types.coroutine
def suspend(value: Any) -> Generator[Any, Any, Any]:
    return (yield value)


async def two_steps(log: list[str]) -> str:
    log.append("start")
    await suspend("first")
    log.append("resumed")
    return "done"


def test_step_returns_what_the_coroutine_yields_then_finished() -> None:
    log: list[str] = []
    coro = two_steps(log)
    assert step(coro, None) == "first"
    assert log == ["start"]
    assert step(coro, None) is FINISHED
    assert log == ["start", "resumed"]


def test_step_throws_into_the_coroutine_and_lets_other_exceptions_through() -> None:
    async def catches() -> None:
        try:
            await suspend("waiting")
        except KeyError:
            await suspend("caught")

    coro = catches()
    assert step(coro, None) == "waiting"
    assert step(coro, KeyError("k")) == "caught"
    with pytest.raises(ValueError, match="boom"):
        step(coro, ValueError("boom"))


def test_a_coroutine_that_raises_propagates_from_step() -> None:
    async def fails() -> None:
        raise RuntimeError("user code failed")

    with pytest.raises(RuntimeError, match="user code failed"):
        step(fails(), None)
