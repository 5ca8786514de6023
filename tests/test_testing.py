"""asyncstate.testing: ManualExecutor and ManualScheduler behave as documented."""

from __future__ import annotations

import random
from typing import Any

import pytest
from shared_functions import Boom

import asyncstate as ast
import asyncstate.testing as testing
from asyncstate.backends.base import StateExecutor
from asyncstate.runtime.requests import StateKind, StateRequestType
from asyncstate.testing import ManualExecutor, ManualScheduler, ManualTimerHandle

GET = StateRequestType.VALUE_GET
UPDATE = StateRequestType.VALUE_UPDATE


def _bound_executor() -> tuple[ManualExecutor, ast.AsyncExecutionController, Any]:
    executor = ManualExecutor()
    aec = ast.AsyncExecutionController(executor, batch_size=100, buffer_timeout_ms=0,
                                       max_in_flight=100)

    class _State:
        def __init__(self, handle: Any) -> None:
            self.name = "v"
            self.handle = handle

    return executor, aec, _State(executor.register_state("v", StateKind.VALUE))


def test_manual_executor_unbound_and_empty_errors_are_clear() -> None:
    executor = ManualExecutor()
    with pytest.raises(ast.InvalidStateError, match="not bound"):
        executor.complete_next_batch()
    with pytest.raises(ast.InvalidStateError, match="not bound"):
        executor.fail_next_batch(Boom())
    with pytest.raises(ast.InvalidStateError, match="no batch"):
        executor.complete_random_batch()
    assert executor.complete_all() == 0
    bound, _, _ = _bound_executor()
    with pytest.raises(ast.InvalidStateError, match="no batch is pending"):
        bound.complete_next_batch()


def test_manual_executor_batch_index_range_and_negative_index() -> None:
    executor, aec, state = _bound_executor()
    for key in ("a", "b"):
        ctx = aec.build_context(key, key)
        aec.set_current_context(ctx)
        aec.handle_request(state, UPDATE, key)
        aec.trigger_if_needed(True)
    assert executor.pending_batch_num == 2
    with pytest.raises(IndexError, match="2 batches are pending"):
        executor.complete_batch(2)
    with pytest.raises(IndexError):
        executor.complete_batch(-3)
    assert executor.pending_batch_num == 2
    newest = executor.complete_batch(-1)
    assert [r.payload for r in newest] == ["b"]
    assert executor.delivered_batches == 1
    assert "pending_batches=1" in repr(executor)


def test_manual_executor_fail_next_batch_fails_its_futures_with_the_exception() -> None:
    executor, aec, state = _bound_executor()
    ctx = aec.build_context("r", "k")
    aec.set_current_context(ctx)
    read = aec.handle_request(state, GET, None)
    aec.trigger_if_needed(True)
    exc = Boom("lost reply")
    executor.fail_next_batch(exc)
    assert read.done()
    assert read.exception() is exc


def test_manual_executor_close_abandons_batches_and_refuses_new_ones() -> None:
    executor, aec, state = _bound_executor()
    ctx = aec.build_context("r", "k")
    aec.set_current_context(ctx)
    aec.handle_request(state, GET, None)
    aec.trigger_if_needed(True)
    executor.close()
    assert executor.closed
    assert executor.pending_batch_num == 0
    with pytest.raises(ast.InvalidStateError, match="closed"):
        executor.execute_batch([])


def test_manual_scheduler_refuses_negative_times_and_orders_ties() -> None:
    sched = ManualScheduler(start=10)
    with pytest.raises(ValueError, match="delay"):
        sched.call_later(-0.1, print)
    with pytest.raises(ValueError, match="backwards"):
        sched.advance(-1)
    ran: list[str] = []
    h1 = sched.call_later(1, ran.append, "a")
    sched.call_later(1, ran.append, "b")
    sched.call_later(0.5, ran.append, "c")
    cancelled = sched.call_later(0.1, ran.append, "x")
    cancelled.cancel()
    assert isinstance(h1, ManualTimerHandle)
    assert sched.pending_num == 3
    assert sched.next_deadline() == 10.5
    assert sched.advance(1) == 3
    assert ran == ["c", "a", "b"]
    assert sched.time() == 11
    assert sched.next_deadline() is None
    h1.cancel()  # no effect once it ran
    assert "cancelled" in repr(h1)


def test_manual_scheduler_refuses_a_nan_delay() -> None:
    sched = ManualScheduler()
    ran: list[str] = []
    with pytest.raises(ValueError, match="delay must be >= 0 seconds, got nan"):
        sched.call_later(float("nan"), ran.append, "nan")
    assert sched.next_deadline() is None  # nothing was scheduled
    sched.call_later(1, ran.append, "one")
    sched.advance(2)
    assert ran == ["one"]


def test_manual_scheduler_advance_nan_is_refused() -> None:
    sched = ManualScheduler()
    with pytest.raises(ValueError):
        sched.advance(float("nan"))
    assert sched.time() == 0.0


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
    for _ in range(10):  # 9 batches are pending; delivering triggers no new one
        if not executor.pending_batch_num:
            break
        executor.complete_random_batch()
    assert executor.pending_batch_num == 0
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


def test_manual_executor_fail_next_batch_refuses_what_is_not_an_exception() -> None:
    executor = testing.ManualExecutor()
    with pytest.raises(TypeError, match=r"^fail_next_batch\(\) takes an exception instance, "
                                        r"got str 'boom'$"):
        executor.fail_next_batch("boom")  # type: ignore[arg-type]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("factory", [False, True])
def test_run_refuses_a_manual_executor_whose_batches_nothing_would_complete(
        factory: bool) -> None:
    class Reads(ast.KeyedProcessFunction):
        def open(self, ctx: Any) -> None:
            self.seen = ctx.get_state(ast.ValueStateDescriptor("seen"))

        async def process_element(self, value: Any, ctx: Any) -> None:
            await self.seen.value()

    backend: Any = (lambda i: testing.ManualExecutor()) if factory else testing.ManualExecutor()
    name = r"backend\(0\)" if factory else "backend"
    with pytest.raises(ast.ConfigError, match=rf"^{name} must be a backend that completes its "
                                              r"batches by itself: a ManualExecutor's"):
        ast.run(Reads(), [1], key_selector=lambda v: v, backend=backend)
