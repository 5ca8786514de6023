"""Adversarial tests of ordering, failure handling, back-pressure, drain and lifecycle.

Each test asserts a promise of ARCHITECTURE.md / API.md / docs/api.md.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections import defaultdict
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shared_functions import BaseBoom, slow_examples

import asyncstate as ast

pytestmark = pytest.mark.timeout(30)


class Boom(Exception):
    """A user failure; identity is checked (the original object must come back)."""


def first(record: Any) -> Any:
    return record[0]


def heap() -> Any:
    return ast.HeapBackend()


def remote(latency_ms: float = 1, **kw: Any) -> Any:
    return ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=latency_ms, **kw)


def remote0() -> Any:
    return ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0)


BACKENDS = {"heap": heap, "remote0": remote0, "remote1": remote}


@pytest.fixture(params=["heap", "remote0", "remote1", "rocksdb"])
def make_backend(request: pytest.FixtureRequest, tmp_path: Any) -> Any:
    if request.param == "rocksdb":
        counter = [0]

        def make() -> Any:
            counter[0] += 1
            return ast.RocksDBBackend(str(tmp_path / f"db{counter[0]}"))
        return make
    return BACKENDS[request.param]


def cfg(**kw: Any) -> ast.AsyncStateConfig:
    kw.setdefault("buffer_timeout_ms", 0)
    return ast.AsyncStateConfig(**kw)


class Step(ast.KeyedProcessFunction):
    """record = (key, step, ...): ``await step(self, record, ctx)``."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))
        self.w = ctx.get_state(ast.ValueStateDescriptor("w"))

    async def process_element(self, record: Any, ctx: ast.RecordContext) -> None:
        await record[1](self, record, ctx)


class PlainStep(ast.KeyedProcessFunction):
    """record = (key, fn): plain def returning fn(self, record, ctx)."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

    def process_element(self, record: Any, ctx: ast.RecordContext) -> Any:
        return record[1](self, record, ctx)


class Counter(ast.KeyedProcessFunction):
    """async read-increment-write, emits (key, n, record tag)."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    async def process_element(self, record: Any, ctx: ast.RecordContext) -> None:
        n = (await self.count.value() or 0) + 1
        await self.count.update(n)
        ctx.emit((ctx.current_key, n, record[1]))


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


def op_of(fn: Any, backend: Any, **kw: Any) -> ast.KeyedOperator:
    config = kw.pop("config", None) or cfg()
    return ast.KeyedOperator(fn, key_selector=kw.pop("key_selector", first), backend=backend,
                             config=config, **kw)


def check_counts(outputs: list[Any], expected_per_key: dict[Any, list[Any]]) -> None:
    """Every key's outputs are 1, 2, 3, ... with the records' tags in arrival order."""
    by_key: dict[Any, list[Any]] = defaultdict(list)
    for key, n, tag in outputs:
        by_key[key].append((n, tag))
    for key, tags in expected_per_key.items():
        assert by_key[key] == [(i + 1, t) for i, t in enumerate(tags)], key
    assert set(by_key) <= set(expected_per_key)


# -- failures in user code ----------------------------------------------------------------


async def _raises_same(exc: BaseException, awaitable: Any) -> None:
    with pytest.raises(type(exc)) as info:
        await awaitable
    assert info.value is exc


@pytest.mark.parametrize("style", ["async_after_state", "async_before_state", "chain_callback",
                                   "plain_raise", "fire_and_forget_callback",
                                   "async_after_sleep"])
async def test_user_failure_fails_drain_exit_and_later_calls_with_the_original_exception(
        make_backend: Any, style: str) -> None:
    err = Boom("original")

    async def async_after_state(fn: Any, rec: Any, ctx: Any) -> None:
        await fn.v.value()
        raise err

    async def async_before_state(fn: Any, rec: Any, ctx: Any) -> None:
        raise err

    async def async_after_sleep(fn: Any, rec: Any, ctx: Any) -> None:
        await fn.v.update(1)
        await asyncio.sleep(0.001)
        raise err

    def chain_callback(fn: Any, rec: Any, ctx: Any) -> Any:
        def cb(v: Any) -> None:
            raise err
        return fn.v.value().then_apply(cb).then_accept(lambda _: ctx.emit("never"))

    def plain_raise(fn: Any, rec: Any, ctx: Any) -> Any:
        raise err

    def fire_and_forget_callback(fn: Any, rec: Any, ctx: Any) -> None:
        def cb(v: Any) -> None:
            raise err
        fn.v.value().then_accept(cb)
        return None

    bad = {"async_after_state": async_after_state, "async_before_state": async_before_state,
           "async_after_sleep": async_after_sleep, "chain_callback": chain_callback,
           "plain_raise": plain_raise,
           "fire_and_forget_callback": fire_and_forget_callback}[style]
    is_async = style.startswith("async")
    fn = Step() if is_async else PlainStep()
    op = op_of(fn, make_backend())
    with pytest.raises(Boom) as info:
        async with op:
            await op.process(("k", bad))
            await op.drain()
            pytest.fail("drain returned after a failure")
    assert info.value is err
    assert op.controller.failure is err
    assert op.outputs() == []


async def test_exit_of_async_with_raises_the_failure_without_an_explicit_drain() -> None:
    err = Boom("x")

    async def bad(fn: Any, rec: Any, ctx: Any) -> None:
        await fn.v.value()
        raise err

    op = op_of(Step(), remote())
    with pytest.raises(Boom) as info:
        async with op:
            await op.process(("k", bad))
    assert info.value is err


async def test_every_later_call_raises_the_original_failure() -> None:
    err = Boom("x")

    async def bad(fn: Any, rec: Any, ctx: Any) -> None:
        await fn.v.value()
        raise err

    async def good(fn: Any, rec: Any, ctx: Any) -> None:
        await fn.v.update(1)

    op = op_of(Step(), remote(), clock=ast.ManualClock())
    with pytest.raises(Boom):
        async with op:
            await op.process(("k", bad))
            await _raises_same(err, op.drain())
            await _raises_same(err, op.process(("j", good)))
            await _raises_same(err, op.drain())
            await _raises_same(err, op.advance_watermark(5))
            await _raises_same(err, op.advance_processing_time(5))
            await _raises_same(err, op.snapshot("/nonexistent-dir-never-written", 1))
    assert op.outputs() == []


async def test_body_exception_wins_over_a_run_failure_on_exit() -> None:
    err = Boom("run")

    async def bad(fn: Any, rec: Any, ctx: Any) -> None:
        raise err

    op = op_of(Step(), heap())
    with pytest.raises(KeyError):
        async with op:
            await op.process(("k", bad))
            await asyncio.sleep(0)
            raise KeyError("body")
    assert op.controller.failure is err


async def test_failure_of_one_key_does_not_hang_records_of_other_keys(make_backend: Any) -> None:
    err = Boom("x")
    gate = asyncio.Event()

    async def bad(fn: Any, rec: Any, ctx: Any) -> None:
        await fn.v.value()
        await gate.wait()
        raise err

    async def good(fn: Any, rec: Any, ctx: Any) -> None:
        n = (await fn.v.value() or 0) + 1
        await fn.v.update(n)

    op = op_of(Step(), make_backend(), config=cfg(max_in_flight=4, batch_size=2))
    with pytest.raises(Boom) as info:
        async with op:
            await op.process(("bad", bad))
            for i in range(20):
                await op.process((i % 3, good))
            gate.set()
            for i in range(20):
                await op.process((i % 3, good))
            await op.drain()
    assert info.value is err


async def test_caught_state_failure_inside_user_code_does_not_fail_the_run(
        make_backend: Any) -> None:
    """A failed chain that the user looked at does not fail the run (API.md)."""
    async def step(fn: Any, rec: Any, ctx: Any) -> None:
        def cb(v: Any) -> None:
            raise Boom("handled")
        try:
            await fn.v.value().then_accept(cb)
        except Boom:
            ctx.emit("caught")
        await fn.v.update(1)

    async with op_of(Step(), make_backend()) as op:
        await op.process(("k", step))
        await op.drain()
        assert op.outputs() == ["caught"]


@pytest.mark.parametrize("style", ["async", "plain"])
async def test_serialization_error_caught_by_user_code_does_not_fail_the_run(
        make_backend: Any, style: str) -> None:
    """SerializationError is raised at the call that wrote the value; user code that
    catches it continues and the run does not fail."""
    async def step(fn: Any, rec: Any, ctx: Any) -> None:
        try:
            await fn.v.update(object())
        except ast.SerializationError:
            ctx.emit("caught")
        await fn.v.update(2)
        ctx.emit(await fn.v.value())

    def plain(fn: Any, rec: Any, ctx: Any) -> Any:
        try:
            fn.v.update(object())
        except ast.SerializationError:
            ctx.emit("caught")
        return fn.v.update(2).then_compose(lambda _: fn.v.value()).then_accept(ctx.emit)

    fn = Step() if style == "async" else PlainStep()
    async with op_of(fn, make_backend()) as op:
        await op.process(("k", step if style == "async" else plain))
        await op.drain()
        assert op.outputs() == ["caught", 2]


async def test_serialization_error_not_caught_fails_the_run_with_it(make_backend: Any) -> None:
    async def step(fn: Any, rec: Any, ctx: Any) -> None:
        await fn.v.update(object())

    op = op_of(Step(), make_backend())
    with pytest.raises(ast.SerializationError):
        async with op:
            await op.process(("k", step))
            await op.drain()


async def test_returning_a_wrong_type_fails_the_run_with_type_error() -> None:
    op = op_of(PlainStep(), heap())
    with pytest.raises(TypeError, match="must return None or a StateFuture"):
        async with op:
            await op.process(("k", lambda fn, rec, ctx: 42))
            await op.drain()


async def test_then_compose_returning_a_non_future_fails_the_run_with_type_error(
        make_backend: Any) -> None:
    def step(fn: Any, rec: Any, ctx: Any) -> Any:
        return fn.v.value().then_compose(lambda v: 5)

    op = op_of(PlainStep(), make_backend())
    with pytest.raises(TypeError):
        async with op:
            await op.process(("k", step))
            await op.drain()


# -- selectors ----------------------------------------------------------------------------


async def test_key_selector_exception_propagates_from_process_unchanged() -> None:
    err = Boom("selector")

    def selector(record: Any) -> Any:
        if record == "bad":
            raise err
        return record

    class Emit(ast.KeyedProcessFunction):
        def process_element(self, value: Any, ctx: Any) -> None:
            ctx.emit(value)

    async with ast.KeyedOperator(Emit(), key_selector=selector, backend=heap(),
                                 config=cfg()) as op:
        await op.process("a")
        await _raises_same(err, op.process("bad"))
        assert op.metrics["records_in"] == 1
        await op.process("b")
        await op.drain()
        assert op.outputs() == ["a", "b"]
        assert op.metrics["records_done"] == 2


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
                                 backend=heap(), config=cfg()) as op:
        await op.process(("a", 5))
        await _raises_same(err, op.process(("a", "raise")))
        with pytest.raises(ast.ConfigError):
            await op.process(("a", 2**63))
        with pytest.raises(ast.ConfigError):
            await op.process(("a", -(2**63) - 1))
        await op.process(("a", None))
        await op.drain()
        assert op.outputs() == [("a", 5), ("a", None)]
        assert op.metrics["records_in"] == op.metrics["records_done"] == 2


def test_run_raises_the_key_selector_exception() -> None:
    err = Boom("sel")

    def selector(record: Any) -> Any:
        if record == 3:
            raise err
        return record

    with pytest.raises(Boom) as info:
        ast.run(Counter(), [1, 2, 3, 4], key_selector=selector)
    assert info.value is err


# -- functions with no state, or very many requests ---------------------------------------


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


# -- awaiting non-state awaitables ---------------------------------------------------------


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


# -- back-pressure and cancellation ---------------------------------------------------------


async def test_cancelling_a_process_blocked_on_back_pressure_admits_nothing(
        make_backend: Any) -> None:
    gate = asyncio.Event()

    async def slow(fn: Any, rec: Any, ctx: Any) -> None:
        await fn.v.value()
        await gate.wait()
        n = (await fn.w.value() or 0) + 1
        await fn.w.update(n)
        ctx.emit((rec[0], rec[2]))

    async with op_of(Step(), make_backend(), config=cfg(max_in_flight=2)) as op:
        await op.process(("a", slow, 0))
        await op.process(("b", slow, 1))
        blocked = asyncio.ensure_future(op.process(("c", slow, 2)))
        await asyncio.sleep(0.02)
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


async def test_back_pressure_same_key_max_in_flight_1_batch_1(make_backend: Any) -> None:
    records = [("k", i) for i in range(40)] + [("j", i) for i in range(5)]
    for fn in (Counter(), ChainCounter()):
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


async def test_cancelling_drain_leaves_the_operator_usable(make_backend: Any) -> None:
    gate = asyncio.Event()

    async def slow(fn: Any, rec: Any, ctx: Any) -> None:
        await fn.v.value()
        await gate.wait()
        ctx.emit(rec[0])

    async with op_of(Step(), make_backend()) as op:
        await op.process(("a", slow))
        d = asyncio.ensure_future(op.drain())
        await asyncio.sleep(0.01)
        d.cancel()
        with pytest.raises(asyncio.CancelledError):
            await d
        gate.set()
        await op.drain()
        assert op.outputs() == ["a"]


async def test_concurrent_drains_all_return(make_backend: Any) -> None:
    async with op_of(Counter(), make_backend()) as op:
        for i in range(30):
            await op.process((i % 4, i))
        await asyncio.wait_for(asyncio.gather(op.drain(), op.drain(), op.drain(),
                                              op.advance_watermark(3)), 10)
        assert len(op.outputs()) == 30


# -- lifecycle ---------------------------------------------------------------------------


async def test_process_after_exit_raises_invalid_state(make_backend: Any) -> None:
    op = op_of(Counter(), make_backend())
    async with op:
        await op.process(("a", 1))
    with pytest.raises(ast.InvalidStateError):
        await op.process(("a", 2))
    with pytest.raises(ast.InvalidStateError):
        await op.drain()
    with pytest.raises(ast.InvalidStateError):
        async with op:
            pass


async def test_open_failure_reraises_and_closes_the_backend() -> None:
    err = Boom("open")
    closed = []

    class BadOpen(ast.KeyedProcessFunction):
        def open(self, ctx: Any) -> None:
            raise err

        def process_element(self, value: Any, ctx: Any) -> None:
            pass

        def close(self) -> None:
            closed.append("fn")

    backend = remote()
    op = op_of(BadOpen(), backend)
    with pytest.raises(Boom) as info:
        async with op:
            pytest.fail("body ran")
    assert info.value is err
    assert backend._closed


async def test_buffer_timeout_sends_a_partial_batch_without_drain() -> None:
    async with op_of(Counter(), remote(latency_ms=1),
                     config=ast.AsyncStateConfig(buffer_timeout_ms=20)) as op:
        await op.process(("a", 0))
        for _ in range(100):
            await asyncio.sleep(0.01)
            if op.metrics["records_done"] == 1:
                break
        assert op.outputs() == [("a", 1, 0)]


async def test_buffer_timeout_zero_means_no_timeout_but_drain_still_flushes() -> None:
    async with op_of(Counter(), remote(latency_ms=1),
                     config=ast.AsyncStateConfig(buffer_timeout_ms=0)) as op:
        await op.process(("a", 0))
        await asyncio.sleep(0.1)
        assert op.outputs() == []
        await asyncio.wait_for(op.drain(), 5)
        assert op.outputs() == [("a", 1, 0)]


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


# -- random interleavings against a sequential per-key model --------------------------------

KINDS = ["async", "chain", "sleep", "fire_and_forget", "gather", "reduce", "nostate"]


class Mixed(ast.KeyedProcessFunction):
    """record = (key, kind, tag). Every kind but "reduce"/"nostate" bumps the key's counter
    by one and emits ("c", key, n, tag); "reduce" adds 1 twice without awaiting and emits
    ("r", key, total, tag); "nostate" emits ("n", key, None, tag)."""

    def open(self, ctx: Any) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))
        self.red = ctx.get_reducing_state(
            ast.ReducingStateDescriptor("red", lambda a, b: a + b))

    def process_element(self, record: Any, ctx: Any) -> Any:
        key, kind, tag = record
        if kind == "async":
            return self._async(key, tag, ctx, False)
        if kind == "sleep":
            return self._async(key, tag, ctx, True)
        if kind == "chain":
            def write(v: Any) -> Any:
                n = (v or 0) + 1
                return self.count.update(n).then_accept(lambda _: ctx.emit(("c", key, n, tag)))
            return self.count.value().then_compose(write)
        if kind == "fire_and_forget":
            def write2(v: Any) -> None:
                n = (v or 0) + 1
                self.count.update(n)  # not awaited nor returned: still part of the record
                ctx.emit(("c", key, n, tag))
            self.count.value().then_accept(write2)
            return None
        if kind == "gather":
            return self._gather(key, tag, ctx)
        if kind == "reduce":
            self.red.add(1)
            self.red.add(1)
            return self.red.get().then_accept(lambda t: ctx.emit(("r", key, t, tag)))
        ctx.emit(("n", key, None, tag))
        return None

    async def _async(self, key: Any, tag: int, ctx: Any, sleep: bool) -> None:
        v = await self.count.value()
        if sleep:
            await asyncio.sleep(0.0005 * (tag % 3))
        n = (v or 0) + 1
        await self.count.update(n)
        ctx.emit(("c", key, n, tag))

    async def _gather(self, key: Any, tag: int, ctx: Any) -> None:
        a, b = await asyncio.gather(self.count.value(), self.count.value())
        assert a == b
        n = (a or 0) + 1
        w = self.count.update(n)
        c = await self.count.value()  # reads its own write, without awaiting it first
        assert c == n, (c, n)
        await w
        ctx.emit(("c", key, n, tag))


def sequential_model(records: list[tuple[Any, str, int]]) -> dict[Any, list[Any]]:
    count: dict[Any, int] = defaultdict(int)
    red: dict[Any, int] = defaultdict(int)
    per_key: dict[Any, list[Any]] = defaultdict(list)
    for key, kind, tag in records:
        if kind == "reduce":
            red[key] += 2
            per_key[key].append(("r", key, red[key], tag))
        elif kind == "nostate":
            per_key[key].append(("n", key, None, tag))
        else:
            count[key] += 1
            per_key[key].append(("c", key, count[key], tag))
    return per_key


def split_by_key(outputs: list[Any]) -> dict[Any, list[Any]]:
    per_key: dict[Any, list[Any]] = defaultdict(list)
    for out in outputs:
        per_key[out[1]].append(out)
    return per_key


scenario = st.fixed_dictionaries({
    "records": st.lists(st.tuples(st.sampled_from([0, 1, 2, "x", (1, 2)]),
                                  st.sampled_from(KINDS)), min_size=1, max_size=40),
    "pauses": st.lists(st.integers(0, 3), min_size=40, max_size=40),
    "batch_size": st.sampled_from([1, 2, 3, 8, 1000]),
    "max_in_flight": st.sampled_from([1, 2, 3, 5, 100]),
    "drain_every": st.sampled_from([0, 3, 7]),
    "buffer_timeout_ms": st.sampled_from([0, 1, 50]),
})


async def _drive(op: ast.KeyedOperator, sc: dict[str, Any],
                 records: list[tuple[Any, str, int]]) -> None:
    for i, rec in enumerate(records):
        await op.process(rec)
        for _ in range(sc["pauses"][i]):
            await asyncio.sleep(0)
        if sc["drain_every"] and i % sc["drain_every"] == sc["drain_every"] - 1:
            if i % 2:
                await op.drain()
            else:
                await op.advance_watermark(i)
    await op.drain()


def _scenario_setup(loop_name: str, sc: dict[str, Any], **config: Any) -> tuple[
        list[tuple[Any, str, int]], ast.AsyncStateConfig, Any]:
    """A scenario's tagged records, its operator config and the event loop factory."""
    import uvloop
    records = [(k, kind, i) for i, (k, kind) in enumerate(sc["records"])]
    op_config = ast.AsyncStateConfig(
        batch_size=sc["batch_size"], max_in_flight=sc["max_in_flight"],
        buffer_timeout_ms=sc["buffer_timeout_ms"], **config)
    factory = uvloop.new_event_loop if loop_name == "uvloop" else asyncio.new_event_loop
    return records, op_config, factory


def _run_scenario(loop_name: str, sc: dict[str, Any], make: Any) -> tuple[list[Any], Any]:
    records, config, factory = _scenario_setup(loop_name, sc, iterator_chunk_size=2)

    async def main() -> tuple[list[Any], Any]:
        op = ast.KeyedOperator(Mixed(), key_selector=first, backend=make(), config=config)
        async with op:
            await asyncio.wait_for(_drive(op, sc, records), 20)
            m = op.metrics
            assert m["records_in"] == m["records_done"] == len(records)
            assert m["in_flight"] == 0
            assert m["in_flight_peak"] <= sc["max_in_flight"]
            assert m["max_batch_size"] <= sc["batch_size"]
            return op.outputs(), records

    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main())


def _check_model(outputs: list[Any], records: list[Any]) -> None:
    expected = sequential_model(records)
    actual = split_by_key(outputs)
    assert len(outputs) == len(records)
    for key in expected:
        assert actual[key] == expected[key], key


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
@pytest.mark.parametrize("backend", ["heap", "remote0", "remote_latency"])
@settings(max_examples=slow_examples(25), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(sc=scenario, latency=st.sampled_from([0.2, 1.0]), io=st.integers(1, 3))
@pytest.mark.timeout(120)
def test_random_interleavings_match_the_sequential_model(loop_name: str, backend: str,
                                                         sc: dict[str, Any], latency: float,
                                                         io: int) -> None:
    def make() -> Any:
        if backend == "heap":
            return ast.HeapBackend()
        if backend == "remote0":
            return ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0,
                                              io_parallelism=io)
        return ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=latency,
                                          io_parallelism=io)
    outputs, records = _run_scenario(loop_name, sc, make)
    _check_model(outputs, records)


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
@settings(max_examples=slow_examples(15), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(sc=scenario, io=st.integers(1, 2), inline=st.sampled_from([0, 16]))
@pytest.mark.timeout(120)
def test_random_interleavings_on_rocksdb_match_the_sequential_model(
        loop_name: str, tmp_path_factory: Any, sc: dict[str, Any], io: int,
        inline: int) -> None:
    path = tmp_path_factory.mktemp("rocks")

    def make() -> Any:
        return ast.RocksDBBackend(str(path / "db"), io_parallelism=io, inline_read_keys=inline)
    outputs, records = _run_scenario(loop_name, sc, make)
    _check_model(outputs, records)


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
@settings(max_examples=slow_examples(20), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenario, latency=st.sampled_from([0, 0.3]), io=st.integers(1, 3),
       p=st.sampled_from([0.05, 0.3, 1.0]), seed=st.integers(0, 1000))
@pytest.mark.timeout(120)
def test_injected_backend_failures_fail_the_run_with_the_original_error_and_keep_key_order(
        loop_name: str, sc: dict[str, Any], latency: float, io: int, p: float,
        seed: int) -> None:
    records, config, factory = _scenario_setup(loop_name, sc)
    seen: dict[str, Any] = {}

    async def main() -> None:
        backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=latency,
                                             io_parallelism=io, failure_probability=p,
                                             seed=seed)
        op = ast.KeyedOperator(Mixed(), key_selector=first, backend=backend, config=config)
        seen["op"] = op
        try:
            async with op:
                await asyncio.wait_for(_drive(op, sc, records), 20)
        except ast.InjectedFailure as exc:
            seen["exc"] = exc
        seen["outputs"] = op.outputs()
        seen["backend"] = backend

    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())
    op = seen["op"]
    failure = op.controller.failure
    if "exc" in seen:
        assert seen["exc"] is failure
    else:
        assert failure is None
        _check_model(seen["outputs"], records)
    if p == 1.0 and any(kind not in ("nostate",) for _, kind, _ in records):
        assert "exc" in seen
    # Whatever was emitted keeps every key's arrival order and never skips back.
    for key, outs in split_by_key(seen["outputs"]).items():
        tags = [o[3] for o in outs]
        assert tags == sorted(tags), key
        counts = [o[2] for o in outs if o[0] == "c"]
        assert counts == sorted(set(counts)), key
    assert seen["backend"]._closed


class FailingMixed(Mixed):
    """Mixed, except that the record tagged `bad_tag` raises `exc` before writing anything:
    from the plain body ("sync"), from a callback ("callback"), or from an async def after
    a state await ("state-await") or after a real sleep ("sleep-await", inside a Task)."""

    def __init__(self, bad_tag: int, where: str, exc: BaseException) -> None:
        self.bad_tag, self.where, self.exc = bad_tag, where, exc

    def process_element(self, record: Any, ctx: Any) -> Any:
        if record[2] != self.bad_tag:
            return super().process_element(record, ctx)
        if self.where == "sync":
            raise self.exc
        if self.where == "callback":
            def fail(_v: Any) -> None:
                raise self.exc
            return self.count.value().then_accept(fail)
        return self._fail_async()

    async def _fail_async(self) -> None:
        await self.count.value()
        if self.where == "sleep-await":
            await asyncio.sleep(0.0005)
        raise self.exc


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
@settings(max_examples=slow_examples(30), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenario, data=st.data(),
       where=st.sampled_from(["sync", "callback", "state-await", "sleep-await"]),
       exc_type=st.sampled_from([Boom, BaseBoom, asyncio.CancelledError]),
       backend_name=st.sampled_from(["heap", "remote0", "remote0.3", "rocksdb"]))
@pytest.mark.timeout(120)
def test_a_failing_record_fails_the_run_with_its_exception_and_the_rest_match_the_model(
        loop_name: str, sc: dict[str, Any], data: Any, where: str,
        exc_type: type[BaseException], backend_name: str) -> None:
    """Whatever record fails, wherever and with whatever exception: the run fails with it
    (it does not hang), and every output emitted matches the sequential model of the run
    without that record (records of its key behind it may still run)."""
    records, config, factory = _scenario_setup(loop_name, sc)
    bad_tag = data.draw(st.integers(0, len(records) - 1), label="bad_tag")
    raised = exc_type("user failure")
    seen: dict[str, Any] = {}

    async def main(directory: str) -> None:
        if backend_name == "heap":
            backend: Any = heap()
        elif backend_name == "rocksdb":
            backend = ast.RocksDBBackend(directory)
        else:
            backend = remote(float(backend_name.removeprefix("remote")))
        op = ast.KeyedOperator(FailingMixed(bad_tag, where, raised), key_selector=first,
                               backend=backend, config=config)
        seen["op"], seen["backend"] = op, backend
        try:
            async with op:
                await asyncio.wait_for(_drive(op, sc, records), 20)
        except TimeoutError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the run's failure, checked below
            seen["exc"] = exc
        seen["outputs"] = op.outputs()

    with tempfile.TemporaryDirectory(prefix="asyncstate-test-") as directory, \
            asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main(directory))
    failure = seen["op"].controller.failure
    assert seen["exc"] is failure
    if exc_type is asyncio.CancelledError:
        # An async def record's cancellation is reported with the record's key.
        assert isinstance(failure, asyncio.CancelledError)
    else:
        assert failure is raised
    expected = {out[3]: out for outs in sequential_model(
        [r for r in records if r[2] != bad_tag]).values() for out in outs}
    for out in seen["outputs"]:
        assert out == expected[out[3]]
    assert seen["backend"]._closed


# -- failures observed by user code in a real Task -----------------------------------------


@pytest.mark.parametrize("how", ["await", "gather_return_exceptions", "wait_for"])
async def test_failed_chain_handled_in_a_task_does_not_fail_the_run(make_backend: Any,
                                                                    how: str) -> None:
    async def step(fn: Any, rec: Any, ctx: Any) -> None:
        await asyncio.sleep(0)  # moves the record into a real Task

        def cb(v: Any) -> None:
            raise Boom("handled")
        bad = fn.v.value().then_accept(cb)
        if how == "await":
            with pytest.raises(Boom):
                await bad
        elif how == "wait_for":
            with pytest.raises(Boom):
                await asyncio.wait_for(bad, 5)
        else:
            res = await asyncio.gather(bad, fn.v.value(), return_exceptions=True)
            assert isinstance(res[0], Boom)
        await fn.v.update(1)
        ctx.emit("ok")

    async with op_of(Step(), make_backend()) as op:
        await op.process(("k", step))
        await op.process(("k", step))
        await op.drain()
        assert op.outputs() == ["ok", "ok"]


async def test_failure_while_process_is_blocked_on_back_pressure_raises_it() -> None:
    err = Boom("x")
    gate = asyncio.Event()

    async def bad(fn: Any, rec: Any, ctx: Any) -> None:
        await fn.v.value()
        await gate.wait()
        raise err

    op = op_of(Step(), remote(), config=cfg(max_in_flight=1))
    with pytest.raises(Boom) as info:
        async with op:
            await op.process(("a", bad))
            blocked = asyncio.ensure_future(op.process(("b", bad)))
            await asyncio.sleep(0.01)
            assert not blocked.done()
            gate.set()
            await _raises_same(err, asyncio.wait_for(blocked, 5))
    assert info.value is err
    assert op.metrics["records_in"] == 1


def test_run_raises_the_original_user_failure() -> None:
    err = Boom("x")

    class Fails(ast.KeyedProcessFunction):
        def open(self, ctx: Any) -> None:
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

        async def process_element(self, value: Any, ctx: Any) -> None:
            await self.v.update(value)
            if value == 7:
                raise err

    for backend in (ast.HeapBackend(), remote()):
        with pytest.raises(Boom) as info:
            ast.run(Fails(), range(20), key_selector=lambda r: r % 3, backend=backend,
                    config=cfg(max_in_flight=4))
        assert info.value is err


async def test_exit_by_cancellation_closes_without_draining_and_reraises() -> None:
    gate = asyncio.Event()
    backend = remote()

    async def slow(fn: Any, rec: Any, ctx: Any) -> None:
        await fn.v.value()
        await gate.wait()

    op = op_of(Step(), backend)

    async def body() -> None:
        async with op:
            await op.process(("a", slow))
            await asyncio.sleep(10)

    task = asyncio.ensure_future(body())
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert backend._closed


# -- concurrent producers and back-pressure ---------------------------------------------------


async def test_concurrent_producers_never_run_more_than_max_in_flight_records() -> None:
    running = [0, 0]

    async def step(fn: Any, rec: Any, ctx: Any) -> None:
        running[0] += 1
        running[1] = max(running)
        n = (await fn.v.value() or 0) + 1
        await fn.v.update(n)
        running[0] -= 1
        ctx.emit(rec[2])

    async with op_of(Step(), remote(latency_ms=2), config=cfg(max_in_flight=2)) as op:
        async def producer(p: int) -> None:
            for i in range(8):
                await op.process((p * 100 + i, step, p * 100 + i))
        await asyncio.gather(*(producer(p) for p in range(4)))
        await op.drain()
        assert len(op.outputs()) == 32
    assert running[1] <= 2


async def test_concurrent_producers_never_admit_more_than_max_in_flight_records() -> None:
    async def step(fn: Any, rec: Any, ctx: Any) -> None:
        n = (await fn.v.value() or 0) + 1
        await fn.v.update(n)

    seen = []
    async with op_of(Step(), remote(latency_ms=2), config=cfg(max_in_flight=2)) as op:
        async def producer(p: int) -> None:
            for i in range(8):
                await op.process((p * 100 + i, step))
                seen.append(op.metrics["in_flight"])
        await asyncio.gather(*(producer(p) for p in range(4)))
        await op.drain()
        peak = op.metrics["in_flight_peak"]
    assert max(seen) <= 2
    assert peak <= 2


# -- timestamps: "anything else raises ast.ConfigError" (docs/api.md, KeyedOperator) -------

class EmitTs(ast.KeyedProcessFunction):
    def process_element(self, value: Any, ctx: Any) -> None:
        ctx.emit((value[0], ctx.timestamp))


@pytest.mark.parametrize("bad", [1.5, "3", True])
async def test_timestamp_selector_result_that_is_not_an_int_raises_config_error(
        bad: Any) -> None:
    async with ast.KeyedOperator(EmitTs(), key_selector=first, timestamp_selector=lambda r: r[1],
                                 backend=heap(), config=cfg()) as op:
        with pytest.raises(ast.ConfigError):
            await op.process(("a", bad))
        await op.drain()
        assert op.outputs() == []


async def test_bool_watermark_and_processing_time_are_refused_on_both_builds() -> None:
    async with ast.KeyedOperator(EmitTs(), key_selector=first, backend=heap(), config=cfg(),
                                 clock=ast.ManualClock()) as op:
        with pytest.raises(ast.ConfigError, match=r"^watermark must be an int"):
            await op.advance_watermark(True)
        assert op.current_watermark() == -(2**63)
        with pytest.raises(ast.ConfigError, match=r"^processing time must be an int"):
            await op.advance_processing_time(True)
        assert op.clock.now_ms() == 0


# -- closing must not start records that wait for their key ---------------------------------


class Logged(ast.KeyedProcessFunction):
    """record = (key, tag, gate or None, error or None)."""

    def __init__(self) -> None:
        self.log: list[Any] = []

    def open(self, ctx: Any) -> None:
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

    async def process_element(self, rec: Any, ctx: Any) -> None:
        key, tag, gate, err = rec
        self.log.append(("start", key, tag))
        try:
            await self.v.value()
            if gate is not None:
                await gate.wait()
            if err is not None:
                raise err
            ctx.emit(tag)
        finally:
            self.log.append(("end", key, tag))


def _starts(log: list[Any]) -> list[Any]:
    return [e[1:] for e in log if e[0] == "start"]


def _check_same_key_never_overlaps(log: list[Any]) -> None:
    running: dict[Any, Any] = {}
    for what, key, tag in log:
        if what == "start":
            assert key not in running, f"{tag} of key {key!r} started while {running[key]} ran"
            running[key] = tag
        else:
            running.pop(key, None)


@pytest.mark.parametrize("backend", ["heap", "remote1"])
async def test_exit_by_exception_does_not_start_records_waiting_for_their_key(
        backend: str) -> None:
    fn = Logged()
    gate = asyncio.Event()
    op = op_of(fn, BACKENDS[backend]())
    with pytest.raises(KeyError):
        async with op:
            await op.process(("a", 1, gate, None))
            await op.process(("a", 2, None, None))
            await asyncio.sleep(0.02)
            raise KeyError("body")
    await asyncio.sleep(0.02)
    assert _starts(fn.log) == [("a", 1)]
    _check_same_key_never_overlaps(fn.log)


async def test_exit_after_a_failure_does_not_start_records_waiting_for_their_key() -> None:
    fn = Logged()
    gate = asyncio.Event()
    err = Boom("b failed")
    op = op_of(fn, heap())
    with pytest.raises(Boom) as info:
        async with op:
            await op.process(("a", 1, gate, None))
            await op.process(("a", 2, None, None))
            await op.process(("b", 3, None, err))
            await asyncio.sleep(0.02)
    assert info.value is err
    await asyncio.sleep(0.02)
    _check_same_key_never_overlaps(fn.log)
    assert ("a", 2) not in _starts(fn.log)


# -- waiting on the operator from inside a record ------------------------------------------


async def test_drain_inside_process_element_raises_instead_of_hanging() -> None:
    class DrainsItself(ast.KeyedProcessFunction):
        def open(self, ctx: Any) -> None:
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

        async def process_element(self, value: Any, ctx: Any) -> None:
            await self.v.value()
            try:
                await asyncio.wait_for(op.drain(), 0.5)
                ctx.emit("drained")
            except ast.InvalidStateError:
                ctx.emit("refused")
            except TimeoutError:
                ctx.emit("hung")

    op = op_of(DrainsItself(), heap())
    async with op:
        await op.process(("a",))
        await asyncio.wait_for(op.drain(), 5)
        assert op.outputs() == ["refused"]


@pytest.mark.parametrize("call", ["drain", "advance_watermark", "advance_processing_time",
                                  "snapshot"])
async def test_calls_that_wait_for_records_are_refused_inside_a_record(
        call: str, tmp_path: Any) -> None:
    class CallsIn(ast.KeyedProcessFunction):
        async def process_element(self, value: Any, ctx: Any) -> None:
            args = {"drain": (), "advance_watermark": (5,), "advance_processing_time": (5,),
                    "snapshot": (str(tmp_path), 1)}[call]
            with pytest.raises(ast.InvalidStateError,
                               match=rf"^{call}\(\) called from inside a record of this "
                                     r"operator \(key 'a'\): it waits for every earlier "
                                     r"record to finish"):
                await getattr(op, call)(*args)
            ctx.emit("refused")

    op = ast.KeyedOperator(CallsIn(), key_selector=first, backend=heap(), config=cfg(),
                           clock=ast.ManualClock())
    async with op:
        await op.process(("a",))
        await asyncio.wait_for(op.drain(), 5)  # from outside: fine
        assert op.outputs() == ["refused"]
        outside = {"drain": (), "advance_watermark": (7,), "advance_processing_time": (7,),
                   "snapshot": (str(tmp_path), 2)}[call]
        await asyncio.wait_for(getattr(op, call)(*outside), 5)  # the same call from outside


async def test_on_next_failure_mid_iteration_fails_the_run_with_it(make_backend: Any) -> None:
    err = Boom("on_next")

    class Iter(ast.KeyedProcessFunction):
        def open(self, ctx: Any) -> None:
            self.lst = ctx.get_list_state(ast.ListStateDescriptor("l"))

        def process_element(self, value: Any, ctx: Any) -> Any:
            def visit(item: Any) -> Any:
                if item == 5:
                    raise err
                return item
            if value[1] == "fill":
                return self.lst.add_all(list(range(10)))
            return self.lst.get().then_compose(lambda it: it.on_next(visit)).then_accept(
                ctx.emit)

    op = op_of(Iter(), make_backend(), config=cfg(iterator_chunk_size=2))
    with pytest.raises(Boom) as info:
        async with op:
            await op.process(("a", "fill"))
            await op.process(("a", "iter"))
            await op.drain()
    assert info.value is err
    assert op.outputs() == []
