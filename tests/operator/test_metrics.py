"""`KeyedOperator.metrics` (exact counts per backend, peaks, blocked time, after failures)
and `outputs()`."""

from __future__ import annotations

import asyncio

import pytest
from shared_functions import (
    Boom,
    Counter,
    Reached,
    Step,
    Sum,
    first,
    ident,
    keyed_operator,
    new_backend,
)

import asyncstate as ast


class Mixed(ast.KeyedProcessFunction):
    """Per record: agg add (2 requests), 5 map puts (5), entries of 5 items in chunks of 2
    (3), agg get (1): 11 requests; operator list state and sync points are not counted."""

    def open(self, ctx):
        self.m = ctx.get_map_state(ast.MapStateDescriptor("m"))
        self.a = ctx.get_aggregating_state(ast.AggregatingStateDescriptor("a", Sum()))
        self.ol = ctx.get_operator_list_state("ol")

    async def process_element(self, value, ctx):
        await self.ol.add(value[1])
        await self.a.add(1)
        for i in range(5):
            await self.m.put(i, i)
        items = await (await self.m.entries()).to_list()
        ctx.emit((await self.a.get(), len(items)))


METRIC_BACKENDS = ["heap", "remote0", "remote5", "rocksdb"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", METRIC_BACKENDS)
@pytest.mark.parametrize("fn_cls, per_record", [(Counter, 2), (Mixed, 11)])
async def test_metrics_exact_for_distinct_keys(name, fn_cls, per_record, tmp_path):
    config = ast.AsyncStateConfig(batch_size=3, max_in_flight=100, iterator_chunk_size=2)
    async with ast.KeyedOperator(fn_cls(), key_selector=first, backend=new_backend(name, tmp_path),
                                 config=config) as op:
        assert op.metrics["requests"] == 0
        for k in range(6):
            await op.process((k, k))
        await op.drain()
        m = op.metrics
    assert m["records_in"] == 6
    assert m["records_done"] == 6
    assert m["in_flight"] == 0
    assert m["requests"] == 6 * per_record
    assert 1 <= m["in_flight_peak"] <= 6
    if name == "heap":
        assert m["batches"] == 0
        assert m["max_batch_size"] == 0
    elif name == "remote5":
        assert 1 <= m["max_batch_size"] <= 3
        assert m["batches"] >= 2 * per_record
    else:
        # Six records in lock step, each wave of 6 requests splits into two full batches.
        assert m["batches"] == 2 * per_record
        assert m["max_batch_size"] == 3
    assert op.metrics == m  # unchanged after close


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", METRIC_BACKENDS)
async def test_metrics_same_key_reducing_state(name, tmp_path):
    class Red(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.r = ctx.get_reducing_state(
                ast.ReducingStateDescriptor("r", lambda a, b: a + b))

        def process_element(self, value, ctx):
            return self.r.add(1)

    config = ast.AsyncStateConfig(batch_size=3, max_in_flight=4)
    async with ast.KeyedOperator(Red(), key_selector=first, backend=new_backend(name, tmp_path),
                                 config=config) as op:
        for i in range(5):
            await op.process((0, i))
        await op.drain()
        m = op.metrics
    assert m["requests"] == 10  # add counts two
    assert m["records_done"] == m["records_in"] == 5
    assert m["in_flight_peak"] <= 4
    if name == "heap":
        assert m["batches"] == 0
    else:
        # one key: every request waits for the previous one; one request per batch
        assert m["batches"] == 10
        assert m["max_batch_size"] == 1


@pytest.mark.timeout(30)
async def test_in_flight_peak_reaches_but_never_exceeds_max_in_flight():
    config = ast.AsyncStateConfig(batch_size=2, max_in_flight=3)
    async with ast.KeyedOperator(Counter(), key_selector=first, backend=new_backend("remote1"),
                                 config=config) as op:
        for k in range(20):
            await op.process((k % 7, k))
            assert op.metrics["in_flight"] <= 3
        await op.drain()
        m = op.metrics
    assert m["in_flight_peak"] == 3
    assert m["max_batch_size"] <= 2
    assert m["blocked_seconds"] > 0.0


@pytest.mark.timeout(30)
async def test_blocked_seconds_lower_bound_with_latency():
    config = ast.AsyncStateConfig(max_in_flight=1)
    backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=10)
    async with ast.KeyedOperator(Counter(), key_selector=first, backend=backend,
                                 config=config) as op:
        for k in range(4):
            await op.process((k, k))
        await op.drain()
        m = op.metrics
    # records 2..4 each waited for the previous record's two round trips (>= 20 ms each)
    assert m["blocked_seconds"] >= 0.05
    assert m["in_flight_peak"] == 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["heap", "remote0", "remote1"])
async def test_metrics_after_failure_are_consistent(kind):
    class Fails(Counter):
        async def process_element(self, value, ctx):
            await self.count.value()
            if value[1] == 3:
                raise Boom(value)
            await self.count.update(1)

    op = ast.KeyedOperator(Fails(), key_selector=first, backend=new_backend(kind),
                           config=ast.AsyncStateConfig(batch_size=3, max_in_flight=4))
    with pytest.raises(Boom):
        async with op:
            for i in range(8):
                await op.process((i % 2, i))
            await op.drain()
    m = op.metrics
    assert 4 <= m["records_in"] <= 8
    assert m["records_done"] + m["in_flight"] == m["records_in"]
    assert m["in_flight_peak"] <= 4
    assert m["max_batch_size"] <= 3
    with pytest.raises(ast.InvalidStateError):
        await op.process((0, 99))
    assert op.metrics["records_in"] == m["records_in"]


def test_metrics_before_start_are_zero():
    op = ast.KeyedOperator(Counter(), key_selector=ident, backend=ast.HeapBackend())
    metrics = op.metrics
    assert {k: metrics[k] for k in ("records_in", "records_done", "in_flight",
                                    "in_flight_peak", "batches", "requests",
                                    "max_batch_size", "blocked_seconds")} == {
        "records_in": 0, "records_done": 0, "in_flight": 0, "in_flight_peak": 0,
        "batches": 0, "requests": 0, "max_batch_size": 0, "blocked_seconds": 0.0}
    assert all(v == 0 or v["count"] == 0 for v in metrics.values())  # the rest, too


METRIC_KEYS = {"records_in", "records_done", "in_flight", "in_flight_peak", "batches",
               "requests", "max_batch_size", "blocked_seconds"}


async def test_metrics_after_drain(make_backend):
    backend = make_backend()
    config = ast.AsyncStateConfig(batch_size=4, max_in_flight=8)
    async with keyed_operator(Counter(), backend, config=config) as op:
        assert set(op.metrics) >= METRIC_KEYS
        for i in range(40):
            await op.process((i % 10, i))
        await op.drain()
        m = op.metrics
    assert m["records_in"] == 40
    assert m["records_done"] == 40
    assert m["in_flight"] == 0
    assert 1 <= m["in_flight_peak"] <= 8
    assert m["requests"] == 80  # one value() and one update() per record
    if isinstance(backend, ast.SimulatedRemoteBackend):
        assert m["batches"] > 0
        assert 1 <= m["max_batch_size"] <= 4


async def test_sync_points_are_not_counted_as_requests(make_backend):
    class NoState(ast.KeyedProcessFunction):
        def process_element(self, value, ctx):
            ctx.emit(value)

    async with keyed_operator(NoState(), make_backend()) as op:
        for i in range(10):
            await op.process((i % 2, i))
        await op.drain()
        assert op.metrics["requests"] == 0
        assert op.metrics["records_done"] == 10


async def test_in_flight_counts_running_records(make_backend):
    gate = asyncio.Event()
    reached = Reached()

    async def wait(fn, ctx):
        await fn.v.value()
        reached.mark()
        await gate.wait()

    async with keyed_operator(Step(), make_backend()) as op:
        for k in range(3):
            await op.process((k, wait))
        await reached.at_least(3)
        assert op.metrics["in_flight"] == 3
        assert op.metrics["records_done"] == 0
        gate.set()
        await op.drain()
        assert op.metrics["in_flight"] == 0
        assert op.metrics["records_done"] == 3


async def test_outputs_returns_and_clears(make_backend):
    async with keyed_operator(Counter(), make_backend()) as op:
        await op.process(("a", 1))
        await op.drain()
        assert op.outputs() == [("a", 1)]
        assert op.outputs() == []
        await op.process(("a", 2))
        await op.process(("b", 3))
        await op.drain()
        assert sorted(op.outputs()) == [("a", 2), ("b", 1)]
        assert op.outputs() == []


class _TimerPerRecord(ast.KeyedProcessFunction):
    """Registers an event-time timer at the record's value; the timer reads the key's state."""

    def open(self, ctx):
        self.seen = ctx.get_state(ast.ValueStateDescriptor("seen"))

    async def process_element(self, value, ctx):
        await self.seen.update(value[1])
        ctx.timer_service.register_event_time_timer(value[1])

    async def on_timer(self, timestamp, ctx):
        ctx.emit((ctx.current_key, await self.seen.value()))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["heap", "remote0"])
async def test_timer_firings_are_not_counted_as_records(name):
    async with ast.KeyedOperator(_TimerPerRecord(), key_selector=first,
                                 backend=new_backend(name)) as op:
        occupancy = op.measure_occupancy()
        for k in range(5):
            await op.process((k, 10 + k))
        await op.advance_watermark(100)  # fires the five timers
        m = op.metrics
        assert (m["records_in"], m["records_done"], m["in_flight"]) == (5, 5, 0)
        assert occupancy.count == 0
        for k in range(3):
            await op.process((k, 200))
        await op.drain()
        m = op.metrics
        outputs = sorted(op.outputs())
    assert (m["records_in"], m["records_done"]) == (8, 8)
    assert outputs == [(k, 10 + k) for k in range(5)]
    # The eight records were in flight for a while (the firings were not counted).
    assert occupancy.count == 0 and occupancy.mean() > 0


@pytest.mark.timeout(30)
async def test_blocked_seconds_counts_producers_waiting_together_once():
    # max_in_flight 1 and a 20 ms store: eight producers wait side by side for room.
    config = ast.AsyncStateConfig(max_in_flight=1)
    backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=20)
    loop = asyncio.get_running_loop()
    async with ast.KeyedOperator(Counter(), key_selector=first, backend=backend,
                                 config=config) as op:
        started = loop.time()
        await asyncio.gather(*(op.process((k, k)) for k in range(8)))
        await op.drain()
        elapsed = loop.time() - started
        m = op.metrics
    # Seven records waited for the ones before them: each waited at least one record's two
    # round trips, together seven such waits one after the other.
    assert m["blocked_seconds"] >= 7 * 0.04 * 0.9
    # Summed per producer, the waits would come to about 28 records' worth (1 + 2 + ... + 7).
    assert m["blocked_seconds"] <= elapsed


@pytest.mark.timeout(30)
async def test_occupancy_measured_while_a_timer_fires_counts_records_only():
    from asyncstate.testing import ManualExecutor

    executor = ManualExecutor()
    async with ast.KeyedOperator(_TimerPerRecord(), key_selector=first,
                                 backend=executor) as op:
        await op.process((1, 10))
        for _ in range(100):  # deliver the record's write (bounded)
            if op.metrics["records_done"] == 1:
                break
            op.controller.trigger_if_needed(True)
            executor.complete_all()
            await asyncio.sleep(0)
        assert op.metrics["records_done"] == 1, "the record did not finish"
        advance = asyncio.ensure_future(op.advance_watermark(100))
        for _ in range(100):  # until the firing waits for its read
            if op.metrics["batches_in_executor"] or op.controller.active_queue_size:
                break
            await asyncio.sleep(0)
        else:
            raise AssertionError("the timer's firing never issued its read")
        assert op.metrics["num_in_flight_records"] == 1  # the firing, not a record
        occupancy = op.measure_occupancy()
        assert occupancy.count == 0
        for _ in range(100):
            if advance.done():
                break
            op.controller.trigger_if_needed(True)
            executor.complete_all()
            await asyncio.sleep(0)
        assert advance.done(), "the advance did not finish within 100 deliveries"
        await advance
        assert occupancy.count == 0 and op.outputs() == [(1, 10)]
