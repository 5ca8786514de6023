"""Helpers of the TTL tests: a function whose records carry the step to run, a driver that
moves time (processing or event time) before each record, and a count of what a backend
stores for a state (elements and map entries one by one)."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import asyncstate as ast
from asyncstate.backends.rocksdb_scan import _scan_items

_GETTERS: dict[type, str] = {
    ast.ValueStateDescriptor: "get_state",
    ast.ListStateDescriptor: "get_list_state",
    ast.MapStateDescriptor: "get_map_state",
    ast.ReducingStateDescriptor: "get_reducing_state",
    ast.AggregatingStateDescriptor: "get_aggregating_state",
}

Step = Callable[[types.SimpleNamespace, ast.RecordContext], Awaitable[Any]]
NOTHING = object()  # a step that returns this emits nothing


class Steps(ast.KeyedProcessFunction):
    """A record is ``(key, step, timestamp)``; ``await step(states, ctx)`` runs and its result
    is emitted (unless it is NOTHING). `states` has one attribute per descriptor."""

    def __init__(self, **descriptors: Any) -> None:
        self.descriptors = descriptors

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.s = types.SimpleNamespace(**{
            name: getattr(ctx, _GETTERS[type(d)])(d) for name, d in self.descriptors.items()})

    async def process_element(self, record: Any, ctx: ast.RecordContext) -> None:
        result = await record[1](self.s, ctx)
        if result is not NOTHING:
            ctx.emit(result)


@dataclasses.dataclass
class At:
    """Run `step` for `key` once time is `time` (the clock, or the watermark and the
    record's timestamp with event time)."""

    time: int
    step: Step
    key: Any = "k"


def ttl(ttl_ms: int = 100, *, update: ast.UpdateType = ast.UpdateType.ON_CREATE_AND_WRITE,
        visibility: ast.StateVisibility = ast.StateVisibility.NEVER_RETURN_EXPIRED,
        event_time: bool = False, background: bool = False) -> ast.StateTtlConfig:
    """A config; cleanup in background is off unless asked for (only cleanup on read)."""
    builder = ast.StateTtlConfig.new_builder(ttl_ms).set_update_type(update) \
        .set_state_visibility(visibility).set_ttl_time_characteristic(
            ast.TtlTimeCharacteristic.EVENT_TIME if event_time
            else ast.TtlTimeCharacteristic.PROCESSING_TIME)
    if not background:
        builder.disable_cleanup_in_background()
    return builder.build()


async def advance(op: ast.KeyedOperator, time: int, event_time: bool) -> None:
    """Move the operator's time to `time` (never backwards) with nothing in flight."""
    await op.drain()
    if event_time:
        if time > op.current_watermark():
            await op.advance_watermark(time)
    elif time > op.clock.now_ms():
        await op.advance_processing_time(time)


async def play(op: ast.KeyedOperator, plan: Sequence[At], *, event_time: bool = False
               ) -> list[Any]:
    """Run `plan` on the open operator `op`, one record at a time; the outputs."""
    for at in plan:
        await advance(op, at.time, event_time)
        await op.process((at.key, at.step, at.time))
        await op.drain()
    return op.outputs()


def operator(fn: ast.KeyedProcessFunction, backend: Any, *, start: int = 0,
             event_time: bool = False, **kwargs: Any) -> ast.KeyedOperator:
    """An operator on a ManualClock at `start`, records keyed by their first item (and
    timestamped by their third with event time)."""
    return ast.KeyedOperator(
        fn, key_selector=lambda r: r[0], backend=backend, clock=ast.ManualClock(start),
        timestamp_selector=(lambda r: r[2]) if event_time else None, **kwargs)


async def run(fn: ast.KeyedProcessFunction, backend: Any, plan: Sequence[At], *,
              event_time: bool = False, counts: Sequence[str] = (), **kwargs: Any
              ) -> tuple[list[Any], dict[str, int]]:
    """Play `plan` on a fresh operator; the outputs and the entries the backend then stores
    for each state named in `counts`."""
    async with operator(fn, backend, event_time=event_time, **kwargs) as op:
        out = await play(op, plan, event_time=event_time)
        return out, {name: stored_entries(backend, name) for name in counts}


def _store(backend: Any) -> Any:
    return backend.inner if isinstance(backend, ast.SimulatedRemoteBackend) else backend


def stored_entries(backend: Any, name: str) -> int:
    """How many entries `backend` stores for state `name`: a value, each list element, each
    map entry (what it holds, not what reads return)."""
    store = _store(backend)
    if isinstance(store, ast.HeapBackend):
        return sum(len(v) if isinstance(v, (list, dict)) else 1
                   for v in store._tables.get(name, {}).values())
    handle = store._handles[name]
    return len(_scan_items(handle.cf, b"", b"\xff\xff\xff"))


