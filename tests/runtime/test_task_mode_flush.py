"""Requests issued from a record's asyncio Task are sent at once while someone waits."""

from __future__ import annotations

import asyncio

import pytest

import asyncstate as ast


class _SleepsThenReads(ast.KeyedProcessFunction):
    def open(self, ctx: ast.RuntimeContext) -> None:
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

    async def process_element(self, value: object, ctx: ast.RecordContext) -> None:
        await asyncio.sleep(0)  # moves the record into a Task
        await self.v.update(value)
        ctx.emit(await self.v.value())


@pytest.mark.timeout(10)
@pytest.mark.parametrize("timeout_ms", [0, 3_600_000])
async def test_drain_sends_requests_issued_inside_a_task_at_once(timeout_ms: int) -> None:
    backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=1)
    config = ast.AsyncStateConfig(buffer_timeout_ms=timeout_ms)
    async with ast.KeyedOperator(_SleepsThenReads(), key_selector=lambda r: r,
                                 backend=backend, config=config) as op:
        for r in (1, 2, 3):
            await op.process(r)
        # Without the flush the drain waits for the buffer timeout (an hour) or forever (0).
        await asyncio.wait_for(op.drain(), 5)
        assert sorted(op.outputs()) == [1, 2, 3]
