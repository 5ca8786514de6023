"""The user-code driver: coroutines without a Task, the stand-in current task, promotion."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from shared_functions import Dynamic

import asyncstate as ast
from asyncstate.runtime.driver import RecordTask, needs_task

_Dynamic = Dynamic


def _slow_backend() -> ast.SimulatedRemoteBackend:
    return ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=60)


async def _run(fn: ast.KeyedProcessFunction, records: list[Any],
               backend: Any = None) -> list[Any]:
    async with ast.KeyedOperator(fn, key_selector=lambda r: r[0],
                                 backend=backend or ast.HeapBackend()) as op:
        for r in records:
            await op.process(r)
        async with asyncio.timeout(5):
            await op.drain()
        return op.outputs()


@pytest.mark.timeout(10)
async def test_current_task_without_a_task_is_the_records_stand_in() -> None:
    test_task = asyncio.current_task()

    async def step(fn: _Dynamic, ctx: ast.RecordContext) -> None:
        task = asyncio.current_task()
        ctx.emit((type(task).__name__, task is test_task, task.get_loop() is
                  asyncio.get_running_loop()))

    assert await _run(_Dynamic(), [("a", step)]) == [("RecordTask", False, True)]


@pytest.mark.timeout(10)
async def test_timeout_expiring_during_a_state_await_raises_timeout_error() -> None:
    async def step(fn: _Dynamic, ctx: ast.RecordContext) -> None:
        try:
            async with asyncio.timeout(0.005):
                await fn.v.value()  # the 60 ms round trip outlives the timeout
            ctx.emit("no timeout")
        except TimeoutError:
            ctx.emit("timed out")
        ctx.emit(asyncio.current_task().cancelling())

    assert await _run(_Dynamic(), [("a", step)], _slow_backend()) == ["timed out", 0]


@pytest.mark.timeout(10)
async def test_stand_in_forwards_cancellation_to_the_task_after_promotion() -> None:
    async def step(fn: _Dynamic, ctx: ast.RecordContext) -> None:
        stand_in = asyncio.current_task()
        await asyncio.sleep(0)  # moves the record into a real Task
        assert isinstance(stand_in, RecordTask) and stand_in.real is asyncio.current_task()
        try:
            async with asyncio.timeout(0.005):  # the real Task is current now
                await asyncio.sleep(1)
        except TimeoutError:
            ctx.emit("timed out in task")
        loop = asyncio.get_running_loop()
        loop.call_later(0.005, stand_in.cancel)
        try:
            await asyncio.sleep(1)
        except asyncio.CancelledError:
            stand_in.uncancel()
            ctx.emit("cancelled through the stand-in")

    assert await _run(_Dynamic(), [("a", step)]) == [
        "timed out in task", "cancelled through the stand-in"]


@pytest.mark.timeout(10)
async def test_cancel_through_the_stand_in_is_delivered_when_the_state_await_completes() -> None:
    async def step(fn: _Dynamic, ctx: ast.RecordContext) -> None:
        asyncio.get_running_loop().call_later(0.005, asyncio.current_task().cancel)
        try:
            await fn.v.value()
        except asyncio.CancelledError:
            ctx.emit("cancelled")

    assert await _run(_Dynamic(), [("a", step)], _slow_backend()) == ["cancelled"]


def test_code_scan_finds_task_apis_in_helpers() -> None:
    async def helper() -> None:
        async with asyncio.timeout(1):
            pass

    class Direct(ast.KeyedProcessFunction):
        async def process_element(self, value: Any, ctx: Any) -> None:
            async with asyncio.timeout(1):
                pass

    class ViaMethod(ast.KeyedProcessFunction):
        async def process_element(self, value: Any, ctx: Any) -> None:
            await self.fetch()

        async def fetch(self) -> None:
            print(asyncio.current_task())

    class Plain(ast.KeyedProcessFunction):
        async def process_element(self, value: Any, ctx: Any) -> None:
            await asyncio.sleep(0)

    assert needs_task(Direct().process_element)
    assert needs_task(ViaMethod().process_element)
    assert not needs_task(Plain().process_element)
    assert needs_task(helper)
