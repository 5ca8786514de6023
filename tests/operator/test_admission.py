"""Admitting records (`KeyedOperator.process`): back-pressure at max_in_flight, cancellation
while blocked, concurrent producers, process() from inside a record, and the records refused
before admission (bad keys, keys of other operators, selector failures, bad timestamps)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from operator_helpers import (
    EmitTs,
    RecordStep,
    check_counts,
    raises_same,
)
from shared_functions import (
    Boom,
    Counter,
    Step,
    cfg,
    first,
    keyed_operator,
    let_loop_run,
    new_backend,
    op_of,
    with_tag,
)

import asyncstate as ast


class ChainCounter(ast.KeyedProcessFunction):
    """Callback style read-increment-write, emits (key, n, record tag)."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    def process_element(self, record: Any, ctx: ast.RecordContext) -> Any:
        def write(v: Any) -> Any:
            n = (v or 0) + 1
            return self.count.update(n).then_accept(
                lambda _: ctx.emit((ctx.current_key, n, record[1])))
        return self.count.value().then_compose(write)


@pytest.mark.timeout(30)
async def test_key_selector_exception_propagates_from_process_unchanged() -> None:
    err = Boom("selector")

    def selector(record: Any) -> Any:
        if record == "bad":
            raise err
        return record

    class Emit(ast.KeyedProcessFunction):
        def process_element(self, value: Any, ctx: Any) -> None:
            ctx.emit(value)

    async with ast.KeyedOperator(Emit(), key_selector=selector, backend=ast.HeapBackend(),
                                 config=cfg()) as op:
        await op.process("a")
        await raises_same(err, op.process("bad"))
        assert op.metrics["records_in"] == 1
        await op.process("b")
        await op.drain()
        assert op.outputs() == ["a", "b"]
        assert op.metrics["records_done"] == 2


@pytest.mark.timeout(30)
async def test_timestamp_selector_exception_and_bad_timestamps() -> None:
    err = Boom("ts")

    def ts(record: Any) -> Any:
        if record[1] == "raise":
            raise err
        return record[1]

    class Emit(ast.KeyedProcessFunction):
        def process_element(self, value: Any, ctx: Any) -> None:
            ctx.emit((value[0], ctx.timestamp))

    async with ast.KeyedOperator(Emit(), key_selector=first, timestamp_selector=ts,
                                 backend=ast.HeapBackend(), config=cfg()) as op:
        await op.process(("a", 5))
        await raises_same(err, op.process(("a", "raise")))
        with pytest.raises(ast.ConfigError):
            await op.process(("a", 2**63))
        with pytest.raises(ast.ConfigError):
            await op.process(("a", -(2**63) - 1))
        await op.process(("a", None))
        await op.drain()
        assert op.outputs() == [("a", 5), ("a", None)]
        assert op.metrics["records_in"] == op.metrics["records_done"] == 2


@pytest.mark.timeout(30)
@pytest.mark.backends("heap", "remote0", "remote1", "rocksdb")
async def test_cancelling_a_process_blocked_on_back_pressure_admits_nothing(
        make_backend: Any) -> None:
    gate = asyncio.Event()

    async def slow(fn: Any, rec: Any, ctx: Any) -> None:
        await fn.v.value()
        await gate.wait()
        n = (await fn.w.value() or 0) + 1
        await fn.w.update(n)
        ctx.emit((rec[0], rec[2]))

    async with op_of(RecordStep(), make_backend(), config=cfg(max_in_flight=2)) as op:
        await op.process(("a", slow, 0))
        await op.process(("b", slow, 1))
        blocked = asyncio.ensure_future(op.process(("c", slow, 2)))
        await let_loop_run()
        assert not blocked.done()
        blocked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await blocked
        assert op.metrics["records_in"] == 2
        gate.set()
        await op.process(("d", slow, 3))
        await op.drain()
        assert sorted(op.outputs()) == [("a", 0), ("b", 1), ("d", 3)]
        m = op.metrics
        assert m["records_in"] == m["records_done"] == 3
        assert m["in_flight"] == 0
        assert m["blocked_seconds"] > 0


@pytest.mark.timeout(30)
@pytest.mark.backends("heap", "remote0", "remote1", "rocksdb")
async def test_back_pressure_same_key_max_in_flight_1_batch_1(make_backend: Any) -> None:
    records = [("k", i) for i in range(40)] + [("j", i) for i in range(5)]
    for fn in (Counter(output=with_tag), ChainCounter()):
        async with op_of(fn, make_backend(), config=cfg(max_in_flight=1, batch_size=1)) as op:
            for r in records:
                await op.process(r)
                assert op.metrics["in_flight"] <= 1
            await op.drain()
            out = op.outputs()
            assert op.metrics["in_flight_peak"] == 1
            assert op.metrics["max_batch_size"] <= 1
        check_counts(out, {"k": list(range(40)), "j": list(range(5))})
        assert out == [(k, t + 1, t) for k, t in records]


@pytest.mark.timeout(30)
@pytest.mark.backends("heap", "remote0", "remote1", "rocksdb")
async def test_reentrant_process_from_inside_process_element(make_backend: Any) -> None:
    """process() called by a record (capacity available) admits a record that runs after
    the current one for the same key."""
    class Reentrant(ast.KeyedProcessFunction):
        def open(self, ctx: Any) -> None:
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

        async def process_element(self, value: Any, ctx: Any) -> None:
            key, tag = value
            n = (await self.v.value() or 0) + 1
            if tag < 3:
                await op.process((key, tag + 1))
            await self.v.update(n)
            ctx.emit((key, n, tag))

    op = op_of(Reentrant(), make_backend(), config=cfg(max_in_flight=10))
    async with op:
        await op.process(("a", 0))
        await op.drain()
        assert op.outputs() == [("a", 1, 0), ("a", 2, 1), ("a", 3, 2), ("a", 4, 3)]


@pytest.mark.timeout(30)
async def test_failure_while_process_is_blocked_on_back_pressure_raises_it() -> None:
    err = Boom("x")
    gate = asyncio.Event()

    async def bad(fn: Any, rec: Any, ctx: Any) -> None:
        await fn.v.value()
        await gate.wait()
        raise err

    op = op_of(RecordStep(), new_backend("remote1"), config=cfg(max_in_flight=1))
    with pytest.raises(Boom) as info:
        async with op:
            await op.process(("a", bad))
            blocked = asyncio.ensure_future(op.process(("b", bad)))
            await let_loop_run()
            assert not blocked.done()
            gate.set()
            await raises_same(err, asyncio.wait_for(blocked, 5))
    assert info.value is err
    assert op.metrics["records_in"] == 1


@pytest.mark.timeout(30)
async def test_concurrent_producers_never_run_more_than_max_in_flight_records() -> None:
    running = [0, 0]

    async def step(fn: Any, rec: Any, ctx: Any) -> None:
        running[0] += 1
        running[1] = max(running)
        n = (await fn.v.value() or 0) + 1
        await fn.v.update(n)
        running[0] -= 1
        ctx.emit(rec[2])

    backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=2)
    async with op_of(RecordStep(), backend, config=cfg(max_in_flight=2)) as op:
        async def producer(p: int) -> None:
            for i in range(8):
                await op.process((p * 100 + i, step, p * 100 + i))
        await asyncio.gather(*(producer(p) for p in range(4)))
        await op.drain()
        assert len(op.outputs()) == 32
    assert running[1] <= 2


@pytest.mark.timeout(30)
async def test_concurrent_producers_never_admit_more_than_max_in_flight_records() -> None:
    async def step(fn: Any, rec: Any, ctx: Any) -> None:
        n = (await fn.v.value() or 0) + 1
        await fn.v.update(n)

    seen = []
    backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=2)
    async with op_of(RecordStep(), backend, config=cfg(max_in_flight=2)) as op:
        async def producer(p: int) -> None:
            for i in range(8):
                await op.process((p * 100 + i, step))
                seen.append(op.metrics["in_flight"])
        await asyncio.gather(*(producer(p) for p in range(4)))
        await op.drain()
        peak = op.metrics["in_flight_peak"]
    assert max(seen) <= 2
    assert peak <= 2


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", [1.5, "3", True])
async def test_timestamp_selector_result_that_is_not_an_int_raises_config_error(
        bad: Any) -> None:
    async with ast.KeyedOperator(EmitTs(), key_selector=first, timestamp_selector=lambda r: r[1],
                                 backend=ast.HeapBackend(), config=cfg()) as op:
        with pytest.raises(ast.ConfigError):
            await op.process(("a", bad))
        await op.drain()
        assert op.outputs() == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad_key", [{"a": 1}, object(), 2**64, -(2**63) - 1])
async def test_operator_bad_key_is_refused_before_admission_and_operator_stays_usable(
        bad_key, make_backend):
    async with ast.KeyedOperator(Counter(), key_selector=lambda r: r[0],
                                 backend=make_backend()) as op:
        await op.process(("a", 1))
        with pytest.raises(ast.SerializationError):
            await op.process((bad_key, 2))
        await op.process(("a", 4))
        await op.drain()
        m = op.metrics
        assert m["records_in"] == 2
        assert m["records_done"] == 2
        assert m["in_flight"] == 0
        assert op.outputs() == [("a", 1), ("a", 2)]


@pytest.mark.timeout(30)
async def test_operator_key_selector_raising_leaves_operator_usable(make_backend):
    def selector(record):
        if record == "bad":
            raise Boom("selector")
        return record

    def timestamp(record):
        return "soon" if record == "late" else None

    async with ast.KeyedOperator(Counter(), key_selector=selector, timestamp_selector=timestamp,
                                 backend=make_backend()) as op:
        with pytest.raises(Boom):
            await op.process("bad")
        await op.process("k")
        with pytest.raises(ast.ConfigError):
            await op.process("late")
        await op.process("k")
        await op.drain()
        assert op.outputs() == [("k", 1), ("k", 2)]
        assert op.metrics["records_in"] == 2


def _key_of_operator(index, parallelism=2, max_parallelism=128):
    for i in range(10_000):
        kg = ast.assign_to_key_group(i, max_parallelism)
        if ast.compute_operator_index_for_key_group(max_parallelism, parallelism, kg) == index:
            return i, kg
    raise AssertionError("no key found")


async def test_key_outside_the_operators_key_groups_raises_key_group_error():
    foreign, foreign_kg = _key_of_operator(1)
    own, _ = _key_of_operator(0)
    async with keyed_operator(Counter(), ast.HeapBackend(), parallelism=2, operator_index=0) as op:
        with pytest.raises(ast.KeyGroupError) as info:
            await op.process((foreign, 1))
        assert info.value.key_group == foreign_kg
        assert str(foreign_kg) in str(info.value)
        await op.process((own, 1))
        await op.drain()
        assert op.outputs() == [(own, 1)]


async def test_operator_index_one_accepts_its_own_keys():
    own, _ = _key_of_operator(1)
    async with keyed_operator(Counter(), ast.HeapBackend(), parallelism=2, operator_index=1) as op:
        await op.process((own, 1))
        await op.drain()
        assert op.outputs() == [(own, 1)]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("limit", [1, 4])
async def test_back_pressure_blocks_process_at_max_in_flight(limit):
    backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=5, io_parallelism=1)
    running = [0, 0]  # now, peak

    async def step(fn, ctx):
        running[0] += 1
        running[1] = max(running)
        await fn.v.value()
        await fn.v.update(1)
        running[0] -= 1

    config = ast.AsyncStateConfig(max_in_flight=limit)
    seen_in_flight = []
    async with keyed_operator(Step(), backend, config=config) as op:
        for k in range(6 * limit):
            await op.process((k, step))
            seen_in_flight.append(op.metrics["in_flight"])
        await op.drain()
        m = op.metrics
    assert m["blocked_seconds"] > 0
    assert m["in_flight_peak"] == limit
    assert max(seen_in_flight) <= limit
    assert running[1] <= limit
    assert m["records_done"] == 6 * limit


async def test_process_returns_once_admitted_not_once_processed(make_backend):
    gate = asyncio.Event()
    done = []

    async def wait(fn, ctx):
        await gate.wait()
        done.append(ctx.current_key)

    async with keyed_operator(Step(), make_backend()) as op:
        async with asyncio.timeout(2):
            await op.process(("a", wait))
        assert done == []
        gate.set()
        await op.drain()
        assert done == ["a"]


class Spawner(ast.KeyedProcessFunction):
    """Record (key, depth): counts the key, and below depth 3 feeds (key + 1, depth + 1)
    back into its own operator from inside the record, before awaiting more state."""

    def __init__(self):
        self.op = None

    def open(self, ctx):
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

    async def process_element(self, value, ctx):
        key, depth = value
        if depth < 3:
            await self.op.process((key + 1, depth + 1))
        n = (await self.v.value() or 0) + 1
        await self.v.update(n)
        ctx.emit((key, depth, n))


@pytest.mark.timeout(10)
@pytest.mark.parametrize("max_in_flight", [1, 2, 6])
async def test_process_from_inside_a_record_admits_at_once_even_at_capacity(
        make_backend, max_in_flight):
    """Waiting for capacity inside a record could wait for that record itself (with
    max_in_flight=1 it always would): such a call admits at once instead."""
    fn = Spawner()
    config = ast.AsyncStateConfig(max_in_flight=max_in_flight)
    async with keyed_operator(fn, make_backend(), config=config) as op:
        fn.op = op
        for key in (0, 10):
            await op.process((key, 0))
        await op.drain()
        out = op.outputs()
        assert sorted(out) == sorted(
            [(k + d, d, 1) for k in (0, 10) for d in range(4)])
        assert op.metrics["records_in"] == op.metrics["records_done"] == 8
