"""Keyed functions and helpers of the operator tests."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections import defaultdict
from typing import Any

import pytest
from shared_functions import Reached, Step, keyed_operator, let_loop_run

import asyncstate as ast


class RecordStep(ast.KeyedProcessFunction):
    """record = (key, step, ...): ``await step(self, record, ctx)``."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))
        self.w = ctx.get_state(ast.ValueStateDescriptor("w"))

    async def process_element(self, record: Any, ctx: ast.RecordContext) -> None:
        await record[1](self, record, ctx)


class PlainRecordStep(ast.KeyedProcessFunction):
    """record = (key, fn): plain def returning fn(self, record, ctx)."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

    def process_element(self, record: Any, ctx: ast.RecordContext) -> Any:
        return record[1](self, record, ctx)


class EmitTs(ast.KeyedProcessFunction):
    def process_element(self, value: Any, ctx: Any) -> None:
        ctx.emit((value[0], ctx.timestamp))


def check_counts(outputs: list[Any], expected_per_key: dict[Any, list[Any]]) -> None:
    """Every key's outputs are 1, 2, 3, ... with the records' tags in arrival order."""
    by_key: dict[Any, list[Any]] = defaultdict(list)
    for key, n, tag in outputs:
        by_key[key].append((n, tag))
    for key, tags in expected_per_key.items():
        assert by_key[key] == [(i + 1, t) for i, t in enumerate(tags)], key
    assert set(by_key) <= set(expected_per_key)


async def raises_same(exc: BaseException, awaitable: Any) -> None:
    with pytest.raises(type(exc)) as info:
        await awaitable
    assert info.value is exc


async def assert_waits_for_records(make_backend, call, **kwargs):
    """`call(op)` must not return before the records started earlier have finished."""
    gate = asyncio.Event()
    reached = Reached()

    async def wait(fn, ctx):
        await fn.v.value()
        reached.mark()
        await gate.wait()
        await fn.v.update(1)
        ctx.emit(ctx.current_key)

    async with keyed_operator(Step(), make_backend(), **kwargs) as op:
        for k in range(4):
            await op.process((k, wait))
        await reached.at_least(4)  # every record waits at the gate: nothing is left to do
        task = asyncio.ensure_future(call(op))
        # Returning at once, or once the loop is idle, would be returning early.
        returned_with_gate: list[bool] = []
        task.add_done_callback(lambda _: returned_with_gate.append(gate.is_set()))
        await let_loop_run()
        assert not task.done()
        assert op.outputs() == []
        gate.set()
        async with asyncio.timeout(3):
            await task
        assert returned_with_gate == [True]
        assert sorted(op.outputs()) == [0, 1, 2, 3]
        assert op.metrics["in_flight"] == 0


def run_script(code: str, timeout: float = 3.0) -> str:
    """Run `code` in a fresh interpreter; its stdout. Scenarios that could hang the event loop
    (a stuck drain, a loop that cannot shut down) run here, so a hang fails one test instead
    of stalling the suite."""
    try:
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                              text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        hung = exc
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout
    pytest.fail(f"hung: no exit within {timeout} s; stdout so far: {hung.stdout!r}")
