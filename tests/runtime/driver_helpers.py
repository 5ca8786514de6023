"""Run records through a KeyedOperator whose function runs the coroutine function each record
carries (`Dynamic`: stepped without a Task until it awaits something that is not a state
future; `DynamicTask`: a real Task from the start)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from shared_functions import Dynamic, first

import asyncstate as ast


class DynamicTask(Dynamic):
    needs_task = True


# Every driver test that takes `cls` runs once stepped and once in a Task.
BOTH_DRIVERS = pytest.mark.parametrize("cls", [Dynamic, DynamicTask], ids=["stepped", "task"])


def slow_backend(ms: float = 60) -> ast.SimulatedRemoteBackend:
    return ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=ms)


async def run_dynamic(fn: ast.KeyedProcessFunction, records: list[Any], backend: Any = None,
                      config: ast.AsyncStateConfig | None = None) -> list[Any]:
    """The outputs of `records`; the drain is bounded, so a record that never ends fails."""
    async with ast.KeyedOperator(fn, key_selector=first, backend=backend or ast.HeapBackend(),
                                 config=config) as op:
        for r in records:
            await op.process(r)
        async with asyncio.timeout(20):
            await op.drain()
        return op.outputs()
