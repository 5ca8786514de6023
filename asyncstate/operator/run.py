"""`ast.run`: a job over an iterable of records, on a fresh event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from asyncstate.backends.base import StateExecutor
from asyncstate.backends.heap import HeapBackend
from asyncstate.clock import Clock
from asyncstate.config import AsyncStateConfig
from asyncstate.errors import InvalidStateError
from asyncstate.function import KeyedProcessFunction
from asyncstate.operator.keyed import KeyedOperator
from asyncstate.operator.progress import MAX_WATERMARK

__all__ = ["new_event_loop", "run"]


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new uvloop loop where uvloop is installed, else a new asyncio loop (the global
    event loop policy is left alone)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where it installs
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(function: KeyedProcessFunction, records: Iterable[Any], *,
        key_selector: Callable[[Any], Any],
        timestamp_selector: Callable[[Any], int | None] | None = None,
        backend: StateExecutor | None = None, config: AsyncStateConfig | None = None,
        clock: Clock | None = None) -> list[Any]:
    """Run `function` over `records` on a fresh event loop; the emitted values in order.

    At the end of input it drains, then advances the watermark to the maximum.
    """
    if asyncio._get_running_loop() is not None:
        raise InvalidStateError(
            "ast.run() cannot be called from a running event loop; inside async code use "
            "`async with ast.KeyedOperator(...) as op: await op.process(record)`")
    operator = KeyedOperator(function, key_selector=key_selector,
                             backend=backend if backend is not None else HeapBackend(),
                             config=config, clock=clock, timestamp_selector=timestamp_selector)
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(_run(operator, records))


async def _run(operator: KeyedOperator, records: Iterable[Any]) -> list[Any]:
    async with operator:
        controller = operator.controller
        prepare = operator.records.prepare
        gate = operator.admission
        for record in records:
            failure = controller.failure
            if failure is not None:
                raise failure
            ctx = prepare(record)
            if not gate.try_admit(ctx):
                await gate.admit(ctx)
        await operator.drain()
        await operator.advance_watermark(MAX_WATERMARK)
    return operator.outputs()
