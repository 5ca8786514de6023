"""Edges of the runtime, the operator and the state classes: each test pins one behaviour no
other test covers (validation, capacity and parking order, the buffer timeout after a
failure, batch accounting, close, failures on the immediate path and of returned futures,
epoch triggers)."""

from __future__ import annotations

from typing import Any

import pytest
from runtime_harness import Harness

import asyncstate as ast
from asyncstate.testing import ManualExecutor, ManualScheduler


def test_controller_validates_iterator_chunk_size() -> None:
    args: dict[str, Any] = {"batch_size": 1, "buffer_timeout_ms": 0, "max_in_flight": 1}
    with pytest.raises(ValueError, match="iterator_chunk_size") as info:
        ast.AsyncExecutionController(ManualExecutor(), iterator_chunk_size=0, **args)
    assert isinstance(info.value, ast.AsyncStateError)


def test_request_after_the_controller_closed_raises_even_for_a_live_record() -> None:
    h = Harness()
    ctx = h.new_record("r", "k")
    h.aec.close()
    assert not ctx.finished
    with pytest.raises(ast.InvalidStateError, match="after the operator closed"):
        h.get()
    assert h.aec.requests == 0
    assert h.aec.active_queue_size == 0


def test_start_record_beyond_max_in_flight_waits_for_capacity() -> None:
    h = Harness(max_in_flight=1)
    started: list[str] = []

    def run(ctx: Any) -> None:
        started.append(ctx.record)
        h.get()

    for record, key in (("r1", "k1"), ("r2", "k2")):
        h.aec.start_record(h.aec.build_context(record, key), run)
    assert started == ["r1"]
    assert h.aec.in_flight_record_num == 1
    assert h.aec.parked_context_num == 1
    h.trig()  # r1 finishes: r2 takes its place
    assert started == ["r1", "r2"]
    h.drive_to_completion()
    assert h.aec.in_flight_peak == 1
    assert h.aec.in_flight_record_num == 0


def test_a_record_arriving_as_a_slot_frees_does_not_overtake_parked_records() -> None:
    h = Harness(max_in_flight=1)
    aec = h.aec
    started: list[str] = []

    def run(ctx: Any) -> None:
        started.append(ctx.record)
        fut = h.get()
        if ctx.record == "r1":
            # r3 arrives from the trampoline while r1's read completes, just before r1 ends
            # and frees the slot that parked r2 waits for.
            r3 = aec.build_context("r3", "k3")
            fut.then_accept(lambda _: aec.post(lambda _: aec.start_record(r3, run), None))

    aec.start_record(aec.build_context("r1", "k1"), run)
    aec.start_record(aec.build_context("r2", "k2"), run)
    assert started == ["r1"]
    h.trig()
    assert started == ["r1", "r2"]
    assert aec.parked_context_num == 1
    h.drive_to_completion()
    assert started == ["r1", "r2", "r3"]
    assert aec.in_flight_peak == 1


def test_buffer_timeout_sends_nothing_once_the_run_failed() -> None:
    scheduler = ManualScheduler()
    h = Harness(batch_size=10, buffer_timeout_ms=100, timeout_scheduler=scheduler)
    h.new_record("r", "k")
    h.get()
    h.aec.fail(RuntimeError("boom"))
    scheduler.advance(0.2)
    assert h.executor.pending_batch_num == 0
    assert h.aec.active_queue_size == 1


def test_batches_in_executor_counts_only_batches_not_yet_delivered() -> None:
    h = Harness(batch_size=1)
    h.new_record("r1", "k1")
    h.get()
    h.new_record("r2", "k2")
    h.get()
    assert h.aec.batches_in_executor == 2
    h.executor.complete_next_batch()
    assert h.aec.batches_in_executor == 1
    h.executor.complete_next_batch()
    assert h.aec.batches_in_executor == 0
    assert h.aec.batches == 2


def test_close_fails_outstanding_requests_with_the_run_failure() -> None:
    h = Harness()
    h.new_record("r1", "k1")
    queued = h.get()
    h.new_record("r2", "k1")
    blocked = h.get()
    boom = RuntimeError("boom")
    h.aec.fail(boom)
    h.aec.close()
    assert queued.exception() is boom
    assert blocked.exception() is boom


class _HeapFailingUpdates:
    """An immediate executor (docs/api.md, "Executors") around a HeapBackend whose value
    updates fail, as a broken store would. It has no operation table, so every request goes
    through execute_one; everything else is the heap's."""

    completes_at_issue = True
    immediate_ops = None

    def __init__(self) -> None:
        self._heap = ast.HeapBackend()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._heap, name)

    def execute_one(self, state: Any, request_type: ast.StateRequestType, payload: Any,
                    key_bytes: bytes, namespace: bytes) -> Any:
        if request_type is ast.StateRequestType.VALUE_UPDATE:
            raise OSError("the store is gone")
        return self._heap.execute_one(state, request_type, payload, key_bytes, namespace)


class _CatchUpdateFailure(ast.KeyedProcessFunction):
    def open(self, ctx):
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

    async def process_element(self, record, ctx):
        try:
            await self.v.update(record)
        except OSError:
            ctx.emit("caught")


@pytest.mark.timeout(30)
async def test_backend_failure_on_the_immediate_path_fails_the_run_even_if_handled() -> None:
    op = ast.KeyedOperator(_CatchUpdateFailure(), key_selector=lambda r: r,
                           backend=_HeapFailingUpdates())  # type: ignore[arg-type]
    with pytest.raises(OSError, match="the store is gone"):
        async with op:
            await op.process(1)
            await op.drain()


def test_a_record_started_by_an_epoch_trigger_delays_that_epoch_final_action() -> None:
    h = Harness()
    aec = h.aec
    events: list[str] = []

    def run(ctx: Any) -> None:
        h.get().then_accept(lambda _: events.append("record done"))

    def trigger() -> None:
        aec.start_record(aec.build_context("timer", "k"), run)

    aec.epoch_manager.on_non_record(trigger, lambda: events.append("final"))
    assert events == []
    h.trig()
    assert events == ["record done", "final"]


class _ReturnsAFailedFuture(ast.KeyedProcessFunction):
    """A plain process_element returning a chain that already failed, after looking at it."""

    def open(self, ctx):
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

    def process_element(self, record, ctx):
        fut = self.v.value().then_apply(lambda _: 1 // 0)
        assert isinstance(fut.exception(), ZeroDivisionError)
        return fut


@pytest.mark.timeout(30)
async def test_returning_a_failed_future_fails_the_run_even_if_it_was_looked_at() -> None:
    op = ast.KeyedOperator(_ReturnsAFailedFuture(), key_selector=lambda r: r,
                           backend=ast.HeapBackend())
    with pytest.raises(ZeroDivisionError):
        async with op:
            await op.process(1)
            await op.drain()


class _CombineTwoFailures(ast.KeyedProcessFunction):
    def open(self, ctx):
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

    async def process_element(self, record, ctx):
        first = self.v.value().then_apply(lambda _: 1 // 0)
        second = self.v.value().then_apply(lambda _: [][0])
        try:
            await first.then_combine(second, lambda a, b: (a, b))
        except ZeroDivisionError:
            ctx.emit("caught")


@pytest.mark.timeout(30)
async def test_then_combine_result_stands_for_the_failure_of_its_other_input() -> None:
    op = ast.KeyedOperator(_CombineTwoFailures(), key_selector=lambda r: r,
                           backend=ast.HeapBackend())
    async with op:
        await op.process(1)
        await op.drain()
    assert op.outputs() == ["caught"]
