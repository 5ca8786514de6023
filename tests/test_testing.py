"""asyncstate.testing: the test doubles behave as documented."""

from __future__ import annotations

import random
from typing import Any

import pytest

import asyncstate as ast
import asyncstate.testing as testing
from asyncstate.backends.base import StateExecutor
from asyncstate.runtime.requests import StateKind, StateRequestType
from asyncstate.testing import ManualClock, ManualExecutor, ManualScheduler

GET = StateRequestType.VALUE_GET
UPDATE = StateRequestType.VALUE_UPDATE


class _State:
    def __init__(self, name: str, handle: Any) -> None:
        self.name = name
        self.handle = handle


def _controller(executor: ManualExecutor, batch_size: int = 100) -> ast.AsyncExecutionController:
    return ast.AsyncExecutionController(executor, batch_size=batch_size, buffer_timeout_ms=0,
                                        max_in_flight=100)


def test_public_surface() -> None:
    assert sorted(testing.__all__) == testing.__all__
    for name in testing.__all__:
        assert getattr(testing, name) is not None
    assert testing.ManualClock is ast.ManualClock
    assert isinstance(ManualExecutor(), StateExecutor)


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


def test_manual_executor_holds_batches_until_completed() -> None:
    executor = ManualExecutor()
    aec = _controller(executor)
    state = _State("v", executor.register_state("v", StateKind.VALUE))
    ctx = aec.build_context("r", "k")
    aec.set_current_context(ctx)
    write = aec.handle_request(state, UPDATE, 7)
    read = aec.handle_request(state, GET, None)
    assert aec.trigger_if_needed(True)
    assert [[r.request_type for r in b] for b in executor.pending_batches] == [[UPDATE, GET]]
    assert executor.executed_requests[1].future is read  # applied at trigger
    assert not read.done()
    done = executor.complete_next_batch()
    assert [r.future for r in done] == [write, read]
    assert read.result() == 7
    assert executor.pending_batches == []
    assert executor.delivered_batches == 1
    with pytest.raises(ast.InvalidStateError, match="no batch is pending"):
        executor.complete_next_batch()
    aec.set_current_context(None)


def test_manual_executor_results_are_right_in_any_completion_order() -> None:
    executor = ManualExecutor(random.Random(3))
    aec = _controller(executor, batch_size=1)
    state = _State("v", executor.register_state("v", StateKind.VALUE))
    ctx = aec.build_context("r", "k")
    aec.set_current_context(ctx)
    futures = []
    for i in range(5):
        futures.append(aec.handle_request(state, UPDATE, i))
        futures.append(aec.handle_request(state, GET, None))
    assert executor.pending_batch_num == 10
    executor.complete_batch(-1)
    assert futures[-1].result() == 4
    while executor.pending_batch_num:
        executor.complete_random_batch()
    assert [futures[2 * i + 1].result() for i in range(5)] == [0, 1, 2, 3, 4]
    aec.set_current_context(None)


def test_manual_executor_fail_and_complete_all() -> None:
    executor = ManualExecutor()
    aec = _controller(executor, batch_size=1)
    state = _State("v", executor.register_state("v", StateKind.VALUE))
    for key in "abc":
        aec.set_current_context(aec.build_context(key, key))
        aec.handle_request(state, UPDATE, key)
    err = ast.InjectedFailure("x")
    failed = executor.fail_next_batch(err)
    assert failed[0].future.exception() is err
    assert executor.complete_all() == 2
    assert aec.failure is err
    assert executor.pending_batch_num == 0
    aec.set_current_context(None)


def test_manual_executor_binds_once() -> None:
    executor = ManualExecutor()
    _controller(executor)
    with pytest.raises(ast.InvalidStateError, match="already bound"):
        _controller(executor)
    with pytest.raises(ast.InvalidStateError, match="not bound"):
        ManualExecutor().complete_next_batch()
    assert executor.fully_loaded() is False


def test_manual_scheduler_runs_due_calls_in_time_order() -> None:
    scheduler = ManualScheduler()
    ran: list[str] = []
    scheduler.call_later(0.3, ran.append, "c")
    scheduler.call_later(0.1, ran.append, "a1")
    scheduler.call_later(0.1, ran.append, "a2")
    cancelled = scheduler.call_later(0.2, ran.append, "b")
    cancelled.cancel()
    assert scheduler.pending_num == 3
    assert scheduler.next_deadline() == pytest.approx(0.1)
    assert scheduler.fire_due() == 0
    assert scheduler.advance(0.25) == 2
    assert ran == ["a1", "a2"]
    assert scheduler.time() == pytest.approx(0.25)
    assert scheduler.advance(1) == 1
    assert ran == ["a1", "a2", "c"]
    assert scheduler.pending_num == 0
    assert scheduler.next_deadline() is None
    with pytest.raises(ValueError, match="backwards"):
        scheduler.advance(-1)


def test_manual_scheduler_runs_calls_scheduled_by_calls_when_due() -> None:
    scheduler = ManualScheduler()
    ran: list[float] = []

    def tick() -> None:
        ran.append(scheduler.time())
        if len(ran) < 3:
            scheduler.call_later(0.1, tick)

    scheduler.call_later(0.1, tick)
    scheduler.advance(0.25)
    assert ran == pytest.approx([0.1, 0.2])
    scheduler.fire_due()
    assert len(ran) == 2
    scheduler.advance(0.1)
    assert ran == pytest.approx([0.1, 0.2, 0.3])


def test_fixtures(manual_clock: ManualClock, manual_executor: ManualExecutor) -> None:
    assert manual_clock.now_ms() == 0
    assert manual_executor.pending_batches == []
