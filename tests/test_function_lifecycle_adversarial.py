"""Adversarial tests of the function lifecycle (open/close), `ast.run`, odd return values of
process_element, key selectors, and the operator's metrics."""

from __future__ import annotations

import asyncio
import gc
import warnings
from collections.abc import Callable
from typing import Any

import pytest

import asyncstate as ast

# -- helpers ------------------------------------------------------------------------------


def ident(record: Any) -> Any:
    return record


def first(record: Any) -> Any:
    return record[0]


class Counter(ast.KeyedProcessFunction):
    """Counts per key; emits (key, n). Records open/close calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def open(self, ctx):
        self.calls.append("open")
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

    async def process_element(self, value, ctx):
        n = (await self.v.value() or 0) + 1
        await self.v.update(n)
        ctx.emit((ctx.current_key, n))

    def close(self):
        self.calls.append("close")


class Boom(Exception):
    pass


def heap() -> Any:
    return ast.HeapBackend()


def remote0() -> Any:
    return ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0)


def remote1() -> Any:
    return ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=1)


BACKENDS = [pytest.param(heap, id="heap"), pytest.param(remote0, id="remote0"),
            pytest.param(remote1, id="remote1")]


@pytest.fixture(params=BACKENDS)
def make_backend(request: pytest.FixtureRequest) -> Callable[[], Any]:
    return request.param


def rocks_available() -> bool:
    try:
        ast.RocksDBBackend  # noqa: B018 - imported on first use
    except (ImportError, AttributeError):
        return False
    return True


needs_rocks = pytest.mark.skipif(not rocks_available(), reason="rocksdict not installed")


# -- open() -------------------------------------------------------------------------------


@needs_rocks
@pytest.mark.timeout(30)
def test_open_raising_after_declaring_state_closes_backend_and_releases_rocksdb_dir(tmp_path):
    path = str(tmp_path / "db")

    class OpenRaises(Counter):
        def open(self, ctx):
            super().open(ctx)
            raise Boom("open failed")

    fn = OpenRaises()
    with pytest.raises(Boom, match="open failed"):
        ast.run(fn, [1, 2], key_selector=ident, backend=ast.RocksDBBackend(path))
    assert fn.calls == ["open", "close"]  # close() is called once, as in Flink's cleanup
    # The directory was released: a new backend on it works.
    assert ast.run(Counter(), [1], key_selector=ident,
                   backend=ast.RocksDBBackend(path)) == [(1, 1)]


@pytest.mark.timeout(30)
def test_open_raising_restores_gc_threshold():
    before = gc.get_threshold()

    class OpenRaises(Counter):
        def open(self, ctx):
            raise Boom("x")

    with pytest.raises(Boom):
        ast.run(OpenRaises(), [1], key_selector=ident,
                config=ast.AsyncStateConfig(gc_threshold=123_456))
    assert gc.get_threshold() == before


@pytest.mark.timeout(30)
def test_failed_run_restores_gc_threshold():
    before = gc.get_threshold()

    class Fails(Counter):
        async def process_element(self, value, ctx):
            await self.v.value()
            raise Boom(value)

    with pytest.raises(Boom):
        ast.run(Fails(), [1, 2, 3], key_selector=ident, backend=remote0(),
                config=ast.AsyncStateConfig(gc_threshold=123_456))
    assert gc.get_threshold() == before


@pytest.mark.timeout(30)
def test_open_error_is_not_masked_by_close_error():
    class NeedsOpen(ast.KeyedProcessFunction):
        def open(self, ctx):
            raise Boom("open failed")

        def process_element(self, value, ctx):
            return None

        def close(self):
            self.resource.close()  # set by a successful open() only

    with pytest.raises(Boom, match="open failed"):
        ast.run(NeedsOpen(), [1], key_selector=ident)


@pytest.mark.timeout(30)
async def test_restore_error_is_not_masked_by_close(tmp_path):
    class NeedsOpen(Counter):
        def close(self):
            super().close()
            self.v.value  # noqa: B018 - only declared by open()

    op = ast.KeyedOperator(NeedsOpen(), key_selector=ident, backend=ast.HeapBackend(),
                           restore_from=str(tmp_path / "missing"))
    with pytest.raises(ast.CheckpointError):
        async with op:
            pass


@pytest.mark.timeout(30)
def test_async_open_is_awaited_or_refused():
    class AsyncOpen(ast.KeyedProcessFunction):
        async def open(self, ctx):
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

        def process_element(self, value, ctx):
            ctx.emit(value)
            return self.v.update(value)

    try:
        with warnings.catch_warnings():  # the never-awaited coroutine's RuntimeWarning
            warnings.simplefilter("ignore", RuntimeWarning)
            try:
                out = ast.run(AsyncOpen(), [1, 2], key_selector=ident)
            finally:
                gc.collect()
    except TypeError as exc:
        assert "open" in str(exc)
    else:
        assert out == [1, 2]


@pytest.mark.timeout(30)
def test_async_close_is_awaited_or_refused():
    ran: list[bool] = []

    class AsyncClose(ast.KeyedProcessFunction):
        def process_element(self, value, ctx):
            ctx.emit(value)

        async def close(self):
            ran.append(True)

    try:
        with warnings.catch_warnings():  # the never-awaited coroutine's RuntimeWarning
            warnings.simplefilter("ignore", RuntimeWarning)
            try:
                out = ast.run(AsyncClose(), [1], key_selector=ident)
            finally:
                gc.collect()
    except TypeError as exc:
        assert "close" in str(exc)
    else:
        assert out == [1]
        assert ran == [True]


# -- close() ------------------------------------------------------------------------------


@needs_rocks
@pytest.mark.timeout(30)
def test_close_raising_after_clean_run_propagates_and_backend_is_closed(tmp_path):
    path = str(tmp_path / "db")

    class CloseRaises(Counter):
        def close(self):
            super().close()
            raise Boom("close failed")

    fn = CloseRaises()
    with pytest.raises(Boom, match="close failed"):
        ast.run(fn, [1, 2], key_selector=ident, backend=ast.RocksDBBackend(path))
    assert fn.calls == ["open", "close"]
    assert ast.run(Counter(), [1], key_selector=ident,
                   backend=ast.RocksDBBackend(path)) == [(1, 2)]  # state was written


@pytest.mark.timeout(30)
def test_run_failure_wins_over_close_error():
    class Both(ast.KeyedProcessFunction):
        def process_element(self, value, ctx):
            raise Boom("process failed")

        def close(self):
            raise RuntimeError("close failed")

    with pytest.raises(Boom, match="process failed"):
        ast.run(Both(), [1], key_selector=ident)


@pytest.mark.timeout(30)
async def test_body_exception_wins_over_close_error():
    class CloseRaises(Counter):
        def close(self):
            raise RuntimeError("close failed")

    with pytest.raises(Boom, match="body"):
        async with ast.KeyedOperator(CloseRaises(), key_selector=ident,
                                     backend=ast.HeapBackend()):
            raise Boom("body")


@pytest.mark.timeout(30)
def test_close_called_exactly_once_on_failed_run(make_backend):
    class Fails(Counter):
        async def process_element(self, value, ctx):
            await self.v.value()
            if value == 3:
                raise Boom(value)

    fn = Fails()
    with pytest.raises(Boom):
        ast.run(fn, range(10), key_selector=ident, backend=make_backend())
    assert fn.calls == ["open", "close"]


# -- function reuse -----------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_function_reused_sequentially_gets_fresh_state_each_run(make_backend):
    fn = Counter()
    assert ast.run(fn, ["a", "a"], key_selector=ident, backend=make_backend()) == \
        [("a", 1), ("a", 2)]
    assert ast.run(fn, ["a"], key_selector=ident, backend=make_backend()) == [("a", 1)]
    assert fn.calls == ["open", "close", "open", "close"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("backend", ["heap", "remote0"])
async def test_function_shared_by_two_live_operators_is_refused_and_the_first_runs_on(
        backend: str) -> None:
    """A function's states are bound to the operator that opened it: a second live operator
    is refused on entry (its own backend closed), and the first keeps working alone."""
    fn = Counter()

    def make() -> Any:
        return ast.HeapBackend() if backend == "heap" else remote0()

    async with ast.KeyedOperator(fn, key_selector=ident, backend=make()) as op1:
        second = ast.KeyedOperator(fn, key_selector=ident, backend=make())
        with pytest.raises(ast.InvalidStateError,
                           match=r"^this Counter object is already running in <KeyedOperator "):
            async with second:
                pass  # pragma: no cover
        for _ in range(3):
            await op1.process("a")
        await asyncio.wait_for(op1.drain(), 5)
        assert op1.outputs() == [("a", 1), ("a", 2), ("a", 3)]
    assert fn.calls == ["open", "close"]  # the refused operator never opened it
    # Once the first operator closed, the function may run again.
    async with ast.KeyedOperator(fn, key_selector=ident, backend=make()) as op3:
        await op3.process("a")
        await op3.drain()
        assert op3.outputs() == [("a", 1)]


@needs_rocks
@pytest.mark.timeout(30)
def test_duck_typed_function_is_refused_or_runs_without_leaking_backend(tmp_path):
    path = str(tmp_path / "db")

    class Duck:
        def process_element(self, value, ctx):
            ctx.emit(value)

    unclear: list[BaseException] = []
    try:
        assert ast.run(Duck(), [1], key_selector=ident,
                       backend=ast.RocksDBBackend(path)) == [1]
    except TypeError:
        pass  # refused clearly
    except AttributeError as exc:  # what happens now: no clear refusal
        unclear.append(exc)
    # Either way the backend must not stay open: the directory is free again.
    assert ast.run(Counter(), [1], key_selector=ident,
                   backend=ast.RocksDBBackend(path)) == [(1, 1)]
    assert unclear == []


# -- process_element return values --------------------------------------------------------


class Returns(ast.KeyedProcessFunction):
    def __init__(self, make: Callable[..., Any]) -> None:
        self.make = make

    def open(self, ctx):
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

    def process_element(self, value, ctx):
        return self.make(self, value, ctx)


def _asyncio_future(fn, value, ctx):
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(None)
    return fut


def _generator(fn, value, ctx):
    yield value


@pytest.mark.timeout(30)
@pytest.mark.parametrize("make, name", [
    (lambda fn, v, c: [v], "list"),
    (lambda fn, v, c: 0, "int"),
    (lambda fn, v, c: False, "bool"),
    (_asyncio_future, "Future"),
    (_generator, "generator"),
])
def test_process_element_returning_odd_values_fails_with_type_error(make, name, make_backend):
    with pytest.raises(TypeError, match=rf"must return None or a StateFuture.*{name}"):
        ast.run(Returns(make), [1, 2], key_selector=ident, backend=make_backend())


@pytest.mark.timeout(30)
def test_plain_def_returning_a_coroutine_is_run(make_backend):
    async def body(fn, value, ctx):
        await fn.v.update(value)
        ctx.emit(await fn.v.value())

    assert ast.run(Returns(body), [1, 2, 3], key_selector=ident,
                   backend=make_backend()) == [1, 2, 3]


@pytest.mark.timeout(30)
def test_plain_def_returning_a_pending_chain_that_fails_fails_the_run(make_backend):
    def chain(fn, value, ctx):
        return fn.v.value().then_apply(lambda _: 1 / 0)

    with pytest.raises(ZeroDivisionError):
        ast.run(Returns(chain), [1, 2], key_selector=ident, backend=make_backend())


@pytest.mark.timeout(30)
def test_plain_def_chain_keeps_record_in_flight_until_its_callbacks_ran(make_backend):
    def chain(fn, value, ctx):
        return ast.combine_all([fn.v.value(), fn.v.value()]).then_compose(
            lambda ab: fn.v.update((ab[0] or 0) + 1).then_accept(
                lambda _: ctx.emit((ctx.current_key, (ab[0] or 0) + 1))))

    out = ast.run(Returns(chain), [k % 3 for k in range(9)], key_selector=ident,
                  backend=make_backend(), config=ast.AsyncStateConfig(batch_size=2))
    assert sorted(out) == sorted((k, n) for k in range(3) for n in (1, 2, 3))
    for k in range(3):
        assert [n for key, n in out if key == k] == [1, 2, 3]


# -- ast.run: records and selectors -------------------------------------------------------


@pytest.mark.timeout(30)
def test_run_empty_iterable_opens_and_closes_once():
    fn = Counter()
    assert ast.run(fn, [], key_selector=ident) == []
    assert ast.run(fn, iter(()), key_selector=ident) == []
    assert fn.calls == ["open", "close"] * 2


@pytest.mark.timeout(30)
def test_run_single_record_and_config_none_equals_default(make_backend):
    assert ast.run(Counter(), ["x"], key_selector=ident, backend=make_backend(),
                   config=None) == [("x", 1)]
    records = [i % 4 for i in range(20)]
    a = ast.run(Counter(), records, key_selector=ident, backend=make_backend(), config=None)
    b = ast.run(Counter(), records, key_selector=ident, backend=make_backend(),
                config=ast.AsyncStateConfig())
    assert sorted(a) == sorted(b)


@pytest.mark.timeout(30)
def test_run_generator_raising_midway_propagates_and_closes_backend(make_backend):
    consumed: list[int] = []

    def records():
        for i in range(3):
            consumed.append(i)
            yield i
        raise OSError("source broke")

    fn = Counter()
    with pytest.raises(OSError, match="source broke"):
        ast.run(fn, records(), key_selector=ident, backend=make_backend())
    assert consumed == [0, 1, 2]
    assert fn.calls == ["open", "close"]


@needs_rocks
@pytest.mark.timeout(30)
def test_run_generator_raising_midway_releases_rocksdb(tmp_path):
    path = str(tmp_path / "db")

    def records():
        yield 1
        raise OSError("source broke")

    with pytest.raises(OSError):
        ast.run(Counter(), records(), key_selector=ident, backend=ast.RocksDBBackend(path))
    ast.run(Counter(), [1], key_selector=ident, backend=ast.RocksDBBackend(path))


@pytest.mark.timeout(30)
def test_run_stops_pulling_an_infinite_source_after_a_failure():
    pulled = [0]

    def forever():
        while True:
            pulled[0] += 1
            yield pulled[0]

    class Fails(Counter):
        async def process_element(self, value, ctx):
            await self.v.value()
            if value == 5:
                raise Boom(value)

    with pytest.raises(Boom):
        ast.run(Fails(), forever(), key_selector=lambda r: r % 3, backend=remote1(),
                config=ast.AsyncStateConfig(max_in_flight=4))
    assert pulled[0] < 1000


@pytest.mark.timeout(30)
def test_run_accepts_none_and_unhashable_records():
    class Echo(ast.KeyedProcessFunction):
        def process_element(self, value, ctx):
            ctx.emit(value)

    recs = [None, [1, 2], {"a": [1]}, {1, 2}]
    assert ast.run(Echo(), recs, key_selector=lambda r: 0) == recs


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad_key", [{"a": 1}, object(), 2**64, -(2**63) - 1, {1}, 1j])
def test_run_bad_key_raises_serialization_error_and_closes(bad_key):
    fn = Counter()
    with pytest.raises(ast.SerializationError):
        ast.run(fn, [1], key_selector=lambda r: bad_key)
    assert fn.calls == ["open", "close"]


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


@pytest.mark.timeout(30)
async def test_run_from_running_loop_raises_without_touching_function_or_backend():
    fn = Counter()
    backend = ast.HeapBackend()
    with pytest.raises(ast.InvalidStateError, match="running event loop"):
        ast.run(fn, [1], key_selector=ident, backend=backend)
    assert fn.calls == []
    # The backend was not opened: it can still serve an operator.
    async with ast.KeyedOperator(fn, key_selector=ident, backend=backend) as op:
        await op.process(1)
    assert op.outputs() == [(1, 1)]


# -- metrics ------------------------------------------------------------------------------


class Agg(ast.AggregateFunction):
    def create_accumulator(self):
        return 0

    def add(self, value, acc):
        return acc + value

    def get_result(self, acc):
        return acc

    def merge(self, a, b):
        return a + b


class Mixed(ast.KeyedProcessFunction):
    """Per record: agg add (2 requests), 5 map puts (5), entries of 5 items in chunks of 2
    (3), agg get (1): 11 requests; operator list state and sync points are not counted."""

    def open(self, ctx):
        self.m = ctx.get_map_state(ast.MapStateDescriptor("m"))
        self.a = ctx.get_aggregating_state(ast.AggregatingStateDescriptor("a", Agg()))
        self.ol = ctx.get_operator_list_state("ol")

    async def process_element(self, value, ctx):
        await self.ol.add(value[1])
        await self.a.add(1)
        for i in range(5):
            await self.m.put(i, i)
        items = await (await self.m.entries()).to_list()
        ctx.emit((await self.a.get(), len(items)))


def _backend(name: str, tmp_path) -> Any:
    if name == "heap":
        return heap()
    if name == "remote0":
        return remote0()
    if name == "remote5":
        return ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=5)
    return ast.RocksDBBackend(str(tmp_path / "db"))


METRIC_BACKENDS = ["heap", "remote0", "remote5",
                   pytest.param("rocksdb", marks=needs_rocks)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", METRIC_BACKENDS)
@pytest.mark.parametrize("fn_cls, per_record", [(Counter, 2), (Mixed, 11)])
async def test_metrics_exact_for_distinct_keys(name, fn_cls, per_record, tmp_path):
    config = ast.AsyncStateConfig(batch_size=3, max_in_flight=100, iterator_chunk_size=2)
    async with ast.KeyedOperator(fn_cls(), key_selector=first, backend=_backend(name, tmp_path),
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
    async with ast.KeyedOperator(Red(), key_selector=first, backend=_backend(name, tmp_path),
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
    async with ast.KeyedOperator(Counter(), key_selector=first, backend=remote1(),
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
@pytest.mark.parametrize("mk", [heap, remote0, remote1])
async def test_metrics_after_failure_are_consistent(mk):
    class Fails(Counter):
        async def process_element(self, value, ctx):
            await self.v.value()
            if value[1] == 3:
                raise Boom(value)
            await self.v.update(1)

    op = ast.KeyedOperator(Fails(), key_selector=first, backend=mk(),
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

