"""Records through a KeyedOperator: one key's records run one at a time in arrival order,
different keys overlap, whatever the records await and however many requests they issue."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from typing import Any

import pytest
from operator_helpers import (
    check_counts,
)
from shared_functions import (
    Step,
    cfg,
    keyed_operator,
    op_of,
)

import asyncstate as ast


@pytest.mark.timeout(30)
@pytest.mark.backends("heap", "remote0", "remote1", "rocksdb")
@pytest.mark.parametrize("style", ["plain", "async"])
async def test_function_that_never_touches_state(make_backend: Any, style: str) -> None:
    class PlainNoState(ast.KeyedProcessFunction):
        def process_element(self, value: Any, ctx: Any) -> None:
            ctx.emit(value)

    class AsyncNoState(ast.KeyedProcessFunction):
        async def process_element(self, value: Any, ctx: Any) -> None:
            ctx.emit(value)

    fn = PlainNoState() if style == "plain" else AsyncNoState()
    records = [(i % 3, i) for i in range(50)]
    async with op_of(fn, make_backend(), config=cfg(max_in_flight=2, batch_size=1)) as op:
        for r in records:
            await op.process(r)
        await op.advance_watermark(10)
        await op.drain()
        assert op.outputs() == records
        m = op.metrics
        assert m["records_in"] == m["records_done"] == 50
        assert m["in_flight"] == 0
        assert m["requests"] == 0
        assert op.controller.occupied_key_num == 0


@pytest.mark.timeout(30)
@pytest.mark.backends("heap", "remote0", "remote1", "rocksdb")
@pytest.mark.parametrize("batch_size,max_in_flight", [(1, 1), (1, 3), (7, 2), (1000, 6000)])
async def test_many_requests_per_record(make_backend: Any, batch_size: int,
                                        max_in_flight: int) -> None:
    class Many(ast.KeyedProcessFunction):
        def open(self, ctx: Any) -> None:
            self.lst = ctx.get_list_state(ast.ListStateDescriptor("l"))
            self.m = ctx.get_map_state(ast.MapStateDescriptor("m"))

        async def process_element(self, value: Any, ctx: Any) -> None:
            key, tag = value
            futs = [self.lst.add((tag, i)) for i in range(30)]  # not awaited one by one
            for i in range(10):
                await self.m.put(i, (tag, i))
            await asyncio.gather(*futs)
            items = await (await self.lst.get()).to_list()
            ctx.emit((key, tag, len(items), items[-1]))

    records = [(i % 4, i) for i in range(24)]
    async with op_of(Many(), make_backend(),
                     config=cfg(batch_size=batch_size, max_in_flight=max_in_flight,
                                iterator_chunk_size=7)) as op:
        for r in records:
            await op.process(r)
        await op.drain()
        out = op.outputs()
        assert op.metrics["max_batch_size"] <= batch_size
        assert op.metrics["in_flight_peak"] <= max_in_flight
    per_key: dict[Any, int] = defaultdict(int)
    assert len(out) == len(records)
    for key, tag, n, last in sorted(out, key=lambda o: o[1]):
        per_key[key] += 30
        assert n == per_key[key]
        assert last == [tag, 29]


@pytest.mark.timeout(30)
@pytest.mark.backends("heap", "remote0", "remote1", "rocksdb")
async def test_asyncio_sleep_inside_process_element_keeps_per_key_order(
        make_backend: Any) -> None:
    import random
    rng = random.Random(7)
    delays = [rng.random() * 0.003 for _ in range(60)]

    class Sleepy(ast.KeyedProcessFunction):
        def open(self, ctx: Any) -> None:
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

        async def process_element(self, value: Any, ctx: Any) -> None:
            key, tag = value
            await asyncio.sleep(delays[tag])
            n = (await self.v.value() or 0) + 1
            await asyncio.sleep(delays[-tag])
            await self.v.update(n)
            await asyncio.sleep(0)
            ctx.emit((key, n, tag))

    records = [(i % 5, i) for i in range(60)]
    async with op_of(Sleepy(), make_backend(), config=cfg(max_in_flight=8, batch_size=3)) as op:
        for r in records:
            await op.process(r)
        await op.drain()
        out = op.outputs()
    expected: dict[Any, list[Any]] = defaultdict(list)
    for k, t in records:
        expected[k].append(t)
    check_counts(out, expected)


async def test_same_key_records_run_in_arrival_order(make_backend):
    rng = random.Random(7)
    running: set[Any] = set()
    overlaps = []

    async def step(fn, ctx):
        key = ctx.current_key
        if key in running:
            overlaps.append(key)
        running.add(key)
        n = (await fn.v.value() or 0) + 1
        await asyncio.sleep(rng.random() * 0.002)
        await fn.v.update(n)
        ctx.emit((key, n))
        running.discard(key)

    keys = ["a", "b", "c"] * 10
    async with keyed_operator(Step(), make_backend()) as op:
        for k in keys:
            await op.process((k, step))
        await op.drain()
        out = op.outputs()
    assert overlaps == []
    for key in "abc":
        assert [n for k, n in out if k == key] == list(range(1, 11))


@pytest.mark.timeout(10)
async def test_different_keys_overlap(make_backend):
    """Each of two keys waits for an event the other sets: deadlocks if keys are serialized."""
    events = {"a": asyncio.Event(), "b": asyncio.Event()}
    other = {"a": "b", "b": "a"}

    async def step(fn, ctx):
        await fn.v.value()
        events[ctx.current_key].set()
        await events[other[ctx.current_key]].wait()
        await fn.v.update(1)
        ctx.emit(ctx.current_key)

    async with keyed_operator(Step(), make_backend()) as op:
        await op.process(("a", step))
        await op.process(("b", step))
        async with asyncio.timeout(3):
            await op.drain()
        assert sorted(op.outputs()) == ["a", "b"]
