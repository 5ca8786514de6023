"""The fixtures asyncstate's pytest plugin provides to any project that installs it."""

from __future__ import annotations

import random

import pytest

import asyncstate as ast
from asyncstate.runtime.requests import StateKind, StateRequestType
from asyncstate.testing import ManualClock, ManualExecutor

_seen_executors: list[ManualExecutor] = []


@pytest.mark.parametrize("round_", [0, 1])
def test_plugin_fixtures_are_fresh_per_test(manual_executor: ManualExecutor,
                                            manual_clock: ast.ManualClock, round_: int) -> None:
    assert manual_clock.now_ms() == 0
    manual_clock.advance(5)
    assert manual_executor.pending_batch_num == 0
    assert manual_executor.delivered_batches == 0
    assert manual_executor.rng.random() == random.Random(0).random()  # the documented default
    assert all(e is not manual_executor for e in _seen_executors)
    _seen_executors.append(manual_executor)


def test_plugin_is_registered_as_pytest11_entry_point() -> None:
    from importlib.metadata import entry_points

    names = {ep.value for ep in entry_points(group="pytest11")}
    assert "asyncstate.pytest_plugin" in names


def test_manual_clock_fixture_starts_at_zero(manual_clock: ManualClock) -> None:
    assert manual_clock.now_ms() == 0
    manual_clock.advance(5)
    assert manual_clock.now_ms() == 5


def test_manual_executor_fixture_holds_batches_until_completed(
        manual_executor: ManualExecutor) -> None:
    handle = manual_executor.register_state("v", StateKind.VALUE)

    class State:
        name = "v"

    State.handle = handle  # type: ignore[attr-defined]
    aec = ast.AsyncExecutionController(manual_executor, batch_size=10, buffer_timeout_ms=0,
                                       max_in_flight=10)
    ctx = aec.build_context("r", "k")
    aec.set_current_context(ctx)
    aec.handle_request(State, StateRequestType.VALUE_UPDATE, 3)
    read = aec.handle_request(State, StateRequestType.VALUE_GET, None)
    assert aec.trigger_if_needed(True)
    assert manual_executor.pending_batch_num == 1 and not read.done()
    manual_executor.complete_next_batch()
    assert read.result() == 3


def test_fixtures(manual_clock: ManualClock, manual_executor: ManualExecutor) -> None:
    assert manual_clock.now_ms() == 0
    assert manual_executor.pending_batches == []
