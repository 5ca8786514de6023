"""The keyed jobs of experiments, each timing its records and able to read its state back.

A record is ``(key, stamp)``: `stamp` is the `time.perf_counter()` value a record's latency is
measured from (its admission, or its intended arrival in an open loop), -1.0 for a record
that is not timed (only a sample is: see `driver`), or `PROBE` to read the key's count back
after the run. Every workload keeps one count per key, so the run's answer can be checked
against the keys fed.

- `counter`: ValueState read, then write (two sequential round trips per record);
- `list`: ListState append (one write; the count is the list's length);
- `map`: MapState get, then put of one of eight fields (two round trips; the field is fixed
  per key, so its value is the key's count).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, ClassVar

import asyncstate as ast
from asyncstate.histogram import Histogram

__all__ = ["PROBE", "WORKLOADS", "LatencyRecorder", "Workload", "make_workload"]

PROBE = -2.0


class LatencyRecorder:
    """Records, in microseconds, the time from a record's stamp to its completion; also
    apart for the records stamped before and after `split` (a perf_counter value)."""

    __slots__ = ("halves", "histogram", "split")

    def __init__(self) -> None:
        self.histogram = Histogram()
        self.halves = (Histogram(), Histogram())
        self.split = float("inf")

    def done(self, stamp: float) -> None:
        micros = int((time.perf_counter() - stamp) * 1e6)
        self.histogram.record(micros)
        self.halves[stamp >= self.split].record(micros)


class Workload(ast.KeyedProcessFunction):
    """A workload: `round_trips` sequential store round trips per record without a cache,
    `writes` writes per record."""

    name: ClassVar[str]
    round_trips: ClassVar[int]
    writes: ClassVar[int] = 1

    def __init__(self, recorder: LatencyRecorder) -> None:
        self.recorder = recorder

    def _timed(self, fut: ast.StateFuture[Any], stamp: float) -> ast.StateFuture[Any]:
        if stamp < 0:
            return fut
        done = self.recorder.done
        return fut.then_accept(lambda _: done(stamp))


class CounterWorkload(Workload):
    name = "counter"
    round_trips = 2

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    def _increment(self, n: Any) -> ast.StateFuture[None]:
        return self.count.update((n or 0) + 1)

    def process_element(self, record: Any, ctx: ast.RecordContext) -> Any:
        stamp = record[1]
        if stamp == PROBE:
            return self.count.value().then_accept(lambda n: ctx.emit((record[0], n or 0)))
        return self._timed(self.count.value().then_compose(self._increment), stamp)


class ListWorkload(Workload):
    name = "list"
    round_trips = 1

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.items = ctx.get_list_state(ast.ListStateDescriptor("items"))

    def process_element(self, record: Any, ctx: ast.RecordContext) -> Any:
        stamp = record[1]
        if stamp == PROBE:
            return self.items.get().then_compose(lambda it: it.to_list()).then_accept(
                lambda items: ctx.emit((record[0], len(items))))
        return self._timed(self.items.add(1), stamp)


class MapWorkload(Workload):
    name = "map"
    round_trips = 2

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.fields = ctx.get_map_state(ast.MapStateDescriptor("fields"))

    def process_element(self, record: Any, ctx: ast.RecordContext) -> Any:
        key, stamp = record
        field = key & 7
        if stamp == PROBE:
            return self.fields.get(field).then_accept(lambda n: ctx.emit((key, n or 0)))
        fields = self.fields
        return self._timed(fields.get(field).then_compose(
            lambda n: fields.put(field, (n or 0) + 1)), stamp)


WORKLOADS: dict[str, type[Workload]] = {
    w.name: w for w in (CounterWorkload, ListWorkload, MapWorkload)}


def make_workload(name: str, recorder: LatencyRecorder) -> Workload:
    """A fresh workload function `name` reporting to `recorder`."""
    factory: Callable[[LatencyRecorder], Workload] = WORKLOADS[name]
    return factory(recorder)
