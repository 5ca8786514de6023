"""Keyed functions and helpers several test modules use (importable because tests/ holds
conftest.py)."""

from __future__ import annotations

import os
from typing import Any

import asyncstate as ast

SOAK_FACTOR = 20


def slow_examples(n: int) -> int:
    """max_examples for a test whose examples are slow (a RocksDB or a checkpoint each): `n`,
    or SOAK_FACTOR times that under the soak hypothesis profile (docs/testing.md)."""
    return n * SOAK_FACTOR if os.environ.get("ASYNCSTATE_HYPOTHESIS_PROFILE") == "soak" else n


class BaseBoom(BaseException):
    """A failure of user code that is neither an Exception nor KeyboardInterrupt, SystemExit
    or CancelledError (as pytest's own outcomes are): it fails the run like any other."""


class Counter(ast.KeyedProcessFunction):
    """async def style: read, increment, write, emit (key, count)."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    async def process_element(self, value: Any, ctx: ast.RecordContext) -> None:
        n = (await self.count.value() or 0) + 1
        await self.count.update(n)
        ctx.emit((ctx.current_key, n))


class Sum(ast.AggregateFunction):
    """Sums numbers; the accumulator is the running total."""

    def create_accumulator(self) -> int:
        return 0

    def add(self, value: int, acc: int) -> int:
        return acc + value

    def get_result(self, acc: int) -> int:
        return acc

    def merge(self, a: int, b: int) -> int:
        return a + b


def normalize(value: Any) -> Any:
    """What a value reads back as: tuples become lists (dict keys excepted)."""
    if isinstance(value, (list, tuple)):
        return [normalize(v) for v in value]
    if isinstance(value, dict):
        return {k: normalize(v) for k, v in value.items()}
    return value


class Dynamic(ast.KeyedProcessFunction):
    """Runs the coroutine function a record carries, ``(key, step)``, as ``await step(self,
    ctx)``: the driver's code scan cannot see it. One ValueState, `v`."""

    needs_task = None

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

    async def process_element(self, value: Any, ctx: ast.RecordContext) -> None:
        await value[1](self, ctx)
