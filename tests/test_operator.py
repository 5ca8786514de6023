"""KeyedOperator and ast.run: lifecycle, ordering, back-pressure, progress calls, failures,
contextvars and real asyncio I/O inside records."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import random
import subprocess
import sys
import textwrap
from collections import Counter as Multiset
from collections.abc import Callable
from typing import Any

import pytest
from shared_functions import BaseBoom, Counter

import asyncstate as ast

BACKENDS = [
    pytest.param(lambda: ast.HeapBackend(), id="heap"),
    pytest.param(lambda: ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0),
                 id="remote0"),
    # A real I/O thread and a round trip per batch: results arrive from loop callbacks.
    pytest.param(lambda: ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=1),
                 id="remote1"),
]


@pytest.fixture(params=BACKENDS)
def make_backend(request: pytest.FixtureRequest) -> Callable[[], Any]:
    """A factory of fresh backends of one kind (a backend serves one operator)."""
    return request.param


def first(record: Any) -> Any:
    return record[0]


class Step(ast.KeyedProcessFunction):
    """async def process_element awaiting the record's own step: record = (key, step) and
    ``await step(self, ctx)``; a ValueState `v` and `w` are declared."""

    def open(self, ctx):
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))
        self.w = ctx.get_state(ast.ValueStateDescriptor("w"))

    async def process_element(self, record, ctx):
        await record[1](self, ctx)


def operator(fn, backend, **kwargs):
    """A KeyedOperator with the default config (buffer timeout 1 s: a test that waits for
    it, instead of for the partial-batch flush of drain/advance_*, is slow or times out)."""
    config = kwargs.pop("config", None)
    return ast.KeyedOperator(fn, key_selector=kwargs.pop("key_selector", first), backend=backend,
                             config=config, **kwargs)


# -- lifecycle ----------------------------------------------------------------------------


async def test_process_outside_async_with_raises_invalid_state():
    op = operator(Counter(), ast.HeapBackend())
    with pytest.raises(ast.InvalidStateError):
        await op.process(("a", 1))
    async with op as entered:
        assert entered is op
        await op.process(("a", 1))
        await op.drain()
        assert op.outputs() == [("a", 1)]
    with pytest.raises(ast.InvalidStateError):
        await op.process(("a", 2))
    with pytest.raises(ast.InvalidStateError):
        await op.drain()


async def test_second_aenter_fails():
    op = operator(Counter(), ast.HeapBackend())
    async with op:
        with pytest.raises(ast.InvalidStateError):
            await op.__aenter__()
        await op.process(("a", 1))
    with pytest.raises(ast.InvalidStateError):
        async with op:
            pass


async def test_clean_exit_drains(make_backend):
    gate = asyncio.Event()
    seen = []

    async def wait(fn, ctx):
        await fn.v.value()
        await gate.wait()
        await fn.v.update(1)
        seen.append(ctx.current_key)

    asyncio.get_running_loop().call_later(0.05, gate.set)
    async with operator(Step(), make_backend()) as op:
        for k in range(5):
            await op.process((k, wait))
    assert sorted(seen) == list(range(5))


@pytest.mark.timeout(10)
async def test_exception_in_block_closes_without_draining_and_reraises(make_backend):
    never = asyncio.Event()

    async def stuck(fn, ctx):
        await fn.v.value()
        await never.wait()

    with pytest.raises(KeyError, match="from the block"):  # not TimeoutError: no drain
        async with asyncio.timeout(5), operator(Step(), make_backend()) as op:
            await op.process(("a", stuck))
            await asyncio.sleep(0.01)
            raise KeyError("from the block")


# -- ast.run ------------------------------------------------------------------------------


class Emitting(ast.KeyedProcessFunction):
    """Counts per key and records every emission in `log` at the moment it is emitted."""

    def __init__(self):
        self.log = []

    def open(self, ctx):
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    async def process_element(self, value, ctx):
        n = (await self.count.value() or 0) + 1
        await self.count.update(n)
        for out in ((value[0], n, "first"), (value[0], n, "second")):
            self.log.append(out)
            ctx.emit(out)


@pytest.mark.parametrize("backend", [None, *BACKENDS])
def test_run_returns_outputs_in_emission_order(backend):
    fn = Emitting()
    records = [(k, i) for i, k in enumerate("abcabcaab" * 5)]
    out = ast.run(fn, records, key_selector=first,
                  backend=None if backend is None else backend(),
                  config=ast.AsyncStateConfig(batch_size=4))
    assert out == fn.log
    assert len(out) == 2 * len(records)
    for key in "abc":
        assert [n for k, n, _ in out if k == key] == [
            n for n in range(1, ("abcabcaab" * 5).count(key) + 1) for _ in (0, 1)]


def test_run_default_backend_is_fresh_per_call():
    records = [("a", 1), ("a", 2)]
    assert ast.run(Counter(), records, key_selector=first) == [("a", 1), ("a", 2)]
    assert ast.run(Counter(), records, key_selector=first) == [("a", 1), ("a", 2)]


def test_run_passes_timestamps():
    class Fn(ast.KeyedProcessFunction):
        def process_element(self, value, ctx):
            ctx.emit((value, ctx.timestamp))

    out = ast.run(Fn(), [1, 2, 3], key_selector=lambda r: r,
                  timestamp_selector=lambda r: None if r == 2 else r * 100)
    assert out == [(1, 100), (2, None), (3, 300)]


async def test_run_inside_a_running_loop_raises_a_clear_error():
    loop = asyncio.get_running_loop()
    with pytest.raises(Exception, match="KeyedOperator") as info:
        ast.run(Counter(), [("a", 1)], key_selector=first)
    assert isinstance(info.value, (RuntimeError, ast.AsyncStateError))
    assert asyncio.get_running_loop() is loop
    await asyncio.sleep(0)  # the loop is still usable


# -- ordering -----------------------------------------------------------------------------


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
    async with operator(Step(), make_backend()) as op:
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

    async with operator(Step(), make_backend()) as op:
        await op.process(("a", step))
        await op.process(("b", step))
        async with asyncio.timeout(3):
            await op.drain()
        assert sorted(op.outputs()) == ["a", "b"]


# -- key groups ---------------------------------------------------------------------------


def _key_of_operator(index, parallelism=2, max_parallelism=128):
    for i in range(10_000):
        kg = ast.assign_to_key_group(i, max_parallelism)
        if ast.compute_operator_index_for_key_group(max_parallelism, parallelism, kg) == index:
            return i, kg
    raise AssertionError("no key found")


async def test_key_outside_the_operators_key_groups_raises_key_group_error():
    foreign, foreign_kg = _key_of_operator(1)
    own, _ = _key_of_operator(0)
    async with operator(Counter(), ast.HeapBackend(), parallelism=2, operator_index=0) as op:
        with pytest.raises(ast.KeyGroupError) as info:
            await op.process((foreign, 1))
        assert info.value.key_group == foreign_kg
        assert str(foreign_kg) in str(info.value)
        await op.process((own, 1))
        await op.drain()
        assert op.outputs() == [(own, 1)]


async def test_operator_index_one_accepts_its_own_keys():
    own, _ = _key_of_operator(1)
    async with operator(Counter(), ast.HeapBackend(), parallelism=2, operator_index=1) as op:
        await op.process((own, 1))
        await op.drain()
        assert op.outputs() == [(own, 1)]


# -- metrics ------------------------------------------------------------------------------

METRIC_KEYS = {"records_in", "records_done", "in_flight", "in_flight_peak", "batches",
               "requests", "max_batch_size", "blocked_seconds"}


async def test_metrics_after_drain(make_backend):
    backend = make_backend()
    config = ast.AsyncStateConfig(batch_size=4, max_in_flight=8)
    async with operator(Counter(), backend, config=config) as op:
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
    assert m["blocked_seconds"] >= 0.0
    if isinstance(backend, ast.SimulatedRemoteBackend):
        assert m["batches"] > 0
        assert 1 <= m["max_batch_size"] <= 4


async def test_sync_points_are_not_counted_as_requests(make_backend):
    class NoState(ast.KeyedProcessFunction):
        def process_element(self, value, ctx):
            ctx.emit(value)

    async with operator(NoState(), make_backend()) as op:
        for i in range(10):
            await op.process((i % 2, i))
        await op.drain()
        assert op.metrics["requests"] == 0
        assert op.metrics["records_done"] == 10


async def test_in_flight_counts_running_records(make_backend):
    gate = asyncio.Event()

    async def wait(fn, ctx):
        await fn.v.value()
        await gate.wait()

    async with operator(Step(), make_backend()) as op:
        for k in range(3):
            await op.process((k, wait))
        await asyncio.sleep(0.02)
        assert op.metrics["in_flight"] == 3
        assert op.metrics["records_done"] == 0
        gate.set()
        await op.drain()
        assert op.metrics["in_flight"] == 0
        assert op.metrics["records_done"] == 3


# -- back-pressure ------------------------------------------------------------------------


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
    async with operator(Step(), backend, config=config) as op:
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

    async with operator(Step(), make_backend()) as op:
        async with asyncio.timeout(2):
            await op.process(("a", wait))
        assert done == []
        gate.set()
        await op.drain()
        assert done == ["a"]


# -- outputs, drain, watermarks, processing time -----------------------------------------


async def test_outputs_returns_and_clears(make_backend):
    async with operator(Counter(), make_backend()) as op:
        await op.process(("a", 1))
        await op.drain()
        assert op.outputs() == [("a", 1)]
        assert op.outputs() == []
        await op.process(("a", 2))
        await op.process(("b", 3))
        await op.drain()
        assert sorted(op.outputs()) == [("a", 2), ("b", 1)]
        assert op.outputs() == []


async def _assert_waits_for_records(make_backend, call, **kwargs):
    """`call(op)` must not return before the records started earlier have finished."""
    gate = asyncio.Event()

    async def wait(fn, ctx):
        await fn.v.value()
        await gate.wait()
        await fn.v.update(1)
        ctx.emit(ctx.current_key)

    async with operator(Step(), make_backend(), **kwargs) as op:
        for k in range(4):
            await op.process((k, wait))
        task = asyncio.ensure_future(call(op))
        await asyncio.sleep(0.05)
        assert not task.done()
        assert op.outputs() == []
        gate.set()
        async with asyncio.timeout(3):
            await task
        assert sorted(op.outputs()) == [0, 1, 2, 3]
        assert op.metrics["in_flight"] == 0


@pytest.mark.timeout(10)
async def test_drain_waits_for_every_record(make_backend):
    await _assert_waits_for_records(make_backend, lambda op: op.drain())


def _run_script(code: str, timeout: float = 3.0) -> str:
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


_AFTER_SLEEP = """
    import asyncio
    import asyncstate as ast

    class AfterSleep(ast.KeyedProcessFunction):
        # Awaits a non-state awaitable first: its state requests are issued from a Task.
        def open(self, ctx):
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

        async def process_element(self, value, ctx):
            await asyncio.sleep(0)
            ctx.emit((value, await self.v.value()))

    def backend():
        return ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0)

    config = ast.AsyncStateConfig(buffer_timeout_ms=BUFFER_TIMEOUT_MS)
"""


# No buffer timeout, or one of an hour: waiting for it fails as a hang (_run_script).
_NO_OR_LONG_BUFFER_TIMEOUT = pytest.mark.parametrize("buffer_timeout_ms", [0, 3_600_000])


@_NO_OR_LONG_BUFFER_TIMEOUT
def test_drain_sends_partial_batches_at_once(buffer_timeout_ms):
    """drain() sends partial batches at once: requests issued while it waits (here from a
    record's Task) must not wait for the buffer timeout, nor hang when there is none (0)."""
    out = _run_script(_AFTER_SLEEP.replace("BUFFER_TIMEOUT_MS", str(buffer_timeout_ms)) + """
    async def main():
        async with ast.KeyedOperator(AfterSleep(), key_selector=lambda r: r, backend=backend(),
                                     config=config) as op:
            for k in ["a", "b"]:
                await op.process(k)
            await op.drain()
            print(sorted(op.outputs()))

    asyncio.run(main())
    """)
    assert out.strip() == "[('a', None), ('b', None)]"


@_NO_OR_LONG_BUFFER_TIMEOUT
def test_run_does_not_wait_for_the_buffer_timeout(buffer_timeout_ms):
    out = _run_script(_AFTER_SLEEP.replace("BUFFER_TIMEOUT_MS", str(buffer_timeout_ms)) + """
    out = ast.run(AfterSleep(), ["a", "b"], key_selector=lambda r: r, backend=backend(),
                  config=config)
    print(sorted(out))
    """)
    assert out.strip() == "[('a', None), ('b', None)]"


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_exit_on_exception_with_a_record_awaiting_state_in_a_task_does_not_hang(loop):
    """`async with` closes without draining on an exception; a record whose Task awaits a state
    future must not keep the event loop from shutting down afterwards."""
    out = _run_script(f"""
    import asyncio
    import uvloop
    import asyncstate as ast

    class Fn(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

        async def process_element(self, value, ctx):
            await asyncio.sleep(0)
            await self.v.value()

    async def main():
        backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=50)
        try:
            async with ast.KeyedOperator(Fn(), key_selector=lambda r: r,
                                         backend=backend) as op:
                await op.process("a")
                await asyncio.sleep(0.01)
                raise KeyError("the block failed")
        except KeyError:
            print("closed")

    {"uvloop.run" if loop == "uvloop" else "asyncio.run"}(main())
    print("loop shut down")
    """)
    assert out.split() == ["closed", "loop", "shut", "down"]


def test_run_failure_while_a_record_awaits_state_in_a_task_does_not_hang():
    """A failure ends ast.run, without hanging, even while another record's Task awaits a
    batch."""
    out = _run_script("""
    import asyncio
    import asyncstate as ast

    class Fn(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

        async def process_element(self, value, ctx):
            if value == "bad":
                await asyncio.sleep(0.01)
                raise ValueError("boom")
            await asyncio.sleep(0)
            await self.v.value()  # pending (200 ms batch) when "bad" fails the run

    try:
        ast.run(Fn(), ["a", "bad"], key_selector=lambda r: r,
                backend=ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=200))
    except ValueError as exc:
        print(repr(exc))
    """)
    assert out.split() == ["ValueError('boom')"]


@pytest.mark.timeout(10)
async def test_advance_watermark_returns_after_every_earlier_record(make_backend):
    await _assert_waits_for_records(make_backend, lambda op: op.advance_watermark(100))


@pytest.mark.timeout(10)
async def test_advance_processing_time_returns_after_every_earlier_record(make_backend):
    clock = ast.ManualClock()
    await _assert_waits_for_records(make_backend, lambda op: op.advance_processing_time(50),
                                    clock=clock)
    assert clock.now_ms() == 50


@pytest.mark.timeout(10)
async def test_advance_watermark_does_not_wait_for_later_records(make_backend):
    early, late = asyncio.Event(), asyncio.Event()

    async def wait_early(fn, ctx):
        await early.wait()

    async def wait_late(fn, ctx):
        await late.wait()

    async with operator(Step(), make_backend()) as op:
        await op.process(("a", wait_early))
        task = asyncio.ensure_future(op.advance_watermark(10))
        await asyncio.sleep(0.01)
        await op.process(("b", wait_late))
        await asyncio.sleep(0.01)
        assert not task.done()
        early.set()
        async with asyncio.timeout(3):
            await task
        late.set()
        await op.drain()


async def test_advance_processing_time_sets_the_manual_clock():
    clock = ast.ManualClock(start_ms=10)
    async with operator(Counter(), ast.HeapBackend(), clock=clock) as op:
        await op.advance_processing_time(20)
        assert clock.now_ms() == 20
        await op.advance_processing_time(20)  # not backwards: allowed
        with pytest.raises(ast.AsyncStateError):
            await op.advance_processing_time(19)
        assert clock.now_ms() == 20
        await op.process(("a", 1))
        await op.drain()
        assert op.outputs() == [("a", 1)]


async def test_advance_processing_time_needs_a_manual_clock():
    async with operator(Counter(), ast.HeapBackend()) as op:
        with pytest.raises(ast.AsyncStateError, match="ManualClock"):
            await op.advance_processing_time(1)


# -- using things at the wrong moment ----------------------------------------------------


async def test_ctx_used_after_its_record_finished_raises(make_backend):
    stash = []

    class Fn(ast.KeyedProcessFunction):
        def process_element(self, value, ctx):
            if value[1] == "stash":
                stash.append(ctx)
                ctx.emit("stashed")
            else:
                try:
                    stash[0].emit("through a dead ctx")
                except ast.InvalidStateError:
                    ctx.emit("rejected")

    async with operator(Fn(), make_backend()) as op:
        await op.process(("a", "stash"))
        await op.drain()
        with pytest.raises(ast.InvalidStateError):
            stash[0].emit("late")
        with pytest.raises(ast.InvalidStateError):
            _ = stash[0].current_key
        await op.process(("a", "use"))
        await op.drain()
        assert op.outputs() == ["stashed", "rejected"]


async def test_ctx_used_after_record_finished_from_user_code_fails_the_operator(make_backend):
    stash = []

    class Fn(ast.KeyedProcessFunction):
        def process_element(self, value, ctx):
            if value[1] == "stash":
                stash.append(ctx)
            else:
                stash[0].emit("through a dead ctx")

    with pytest.raises(ast.InvalidStateError):
        async with operator(Fn(), make_backend()) as op:
            await op.process(("a", "stash"))
            await op.drain()
            await op.process(("b", "use"))
            await op.drain()


async def test_state_access_in_open_raises():
    class Fn(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))
            self.v.value()

        def process_element(self, value, ctx):
            pass

    with pytest.raises(ast.InvalidStateError):
        async with operator(Fn(), ast.HeapBackend()):
            pass


def test_state_access_in_open_fails_run():
    class Fn(ast.KeyedProcessFunction):
        def open(self, ctx):
            ctx.get_list_state(ast.ListStateDescriptor("l")).add(1)

        def process_element(self, value, ctx):
            pass

    with pytest.raises(ast.InvalidStateError):
        ast.run(Fn(), [1], key_selector=lambda r: r)


ORPHAN = r"^state 'v' accessed for the record with key 'a' after that record finished"


async def test_state_access_from_a_task_that_outlived_its_record_fails_the_run(make_backend):
    tasks = []
    release = asyncio.Event()

    async def later(fn):
        await release.wait()
        return await fn.v.value()

    async def spawn(fn, ctx):
        await fn.v.update(1)
        tasks.append(asyncio.get_running_loop().create_task(later(fn)))

    with pytest.raises(ast.InvalidStateError, match=ORPHAN) as failed:
        async with operator(Step(), make_backend()) as op:
            await op.process(("a", spawn))
            await op.drain()
            release.set()
            with pytest.raises(ast.InvalidStateError, match=ORPHAN) as raised:
                await asyncio.wait_for(tasks[0], 10)
            # The task's error is the run's: the operator refuses further calls with it.
            with pytest.raises(ast.InvalidStateError, match=ORPHAN):
                await op.process(("b", spawn))
    assert failed.value is raised.value


async def test_state_access_from_a_callback_that_outlived_its_record_fails_the_run(
        make_backend):
    results = []

    def later(fn):
        try:
            fn.v.update(2)
        except ast.InvalidStateError as exc:
            results.append(exc)

    class Fn(Step):
        def process_element(self, record, ctx):
            # What a callback scheduled now (call_later, a client's hook) would run in.
            self.scheduled = contextvars.copy_context()
            return self.v.update(1)

    fn = Fn()
    with pytest.raises(ast.InvalidStateError, match=ORPHAN) as failed:
        async with operator(fn, make_backend()) as op:
            await op.process(("a", None))
            await op.drain()
            fn.scheduled.run(later, fn)  # the record is over when the callback runs
    assert results == [failed.value]


def test_run_waits_for_a_task_a_record_left_running_and_fails_on_its_state_call():
    class Fn(Step):
        async def process_element(self, record, ctx):
            await self.v.update(1)

            async def later():
                await asyncio.sleep(0)
                await self.v.update(2)  # the record is over: this must not be lost silently

            asyncio.get_running_loop().create_task(later())

    with pytest.raises(ast.InvalidStateError, match=ORPHAN):
        ast.run(Fn(), [("a", None)], key_selector=first)


def test_run_fails_with_the_exception_of_a_task_a_record_left_running():
    class Fn(Step):
        async def process_element(self, record, ctx):
            async def later():
                await asyncio.sleep(0)
                raise Boom("late")

            asyncio.get_running_loop().create_task(later())

    with pytest.raises(Boom, match=r"^late$"):
        ast.run(Fn(), [("a", None)], key_selector=first)


# -- failures -----------------------------------------------------------------------------


class Boom(Exception):
    pass


class Failing(ast.KeyedProcessFunction):
    """Plain def: fails in the way named by the record ``(key, how)``; "ok" writes state."""

    def open(self, ctx):
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

    def process_element(self, value, ctx):
        how = value[1]
        if how == "ok":
            return self.v.update(1)
        if how == "sync":
            raise Boom("sync part of process_element")
        if how == "unreturned-chain":
            self.v.value().then_apply(lambda v: _raise(Boom("then_apply callback")))
            return None
        if how == "unserializable-call":
            self.v.update({1, 2})
            return None
        if how == "sync-cancelled":  # CancelledError is a BaseException, raised by user code
            raise asyncio.CancelledError("plain process_element")
        if how == "callback-cancelled":
            return self.v.value().then_accept(
                lambda v: _raise(asyncio.CancelledError("then_accept callback")))
        if how == "sync-base":
            raise BaseBoom("plain process_element")
        if how == "callback-base":
            return self.v.value().then_accept(lambda v: _raise(BaseBoom("then_accept callback")))
        if how == "unreturned-chain-base":
            self.v.value().then_apply(lambda v: _raise(BaseBoom("then_apply callback")))
            return None
        raise AssertionError(f"not a plain failure kind: {how}")


def _raise(exc):
    raise exc


class FailingAsync(Failing):
    """async def: the async failure kinds, "ok" and "stuck" records; the plain kinds run as
    the synchronous start of the coroutine."""

    def __init__(self, stuck: asyncio.Event | None = None):
        self.stuck = stuck

    async def process_element(self, value, ctx):
        how = value[1]
        if how == "ok":
            await self.v.update(1)
            return
        if how == "stuck":
            await self.stuck.wait()
            return
        if FAILURES[how][0] is Failing:
            Failing.process_element(self, value, ctx)
            return
        if how == "async-before-await":
            raise Boom("async def before any await")
        if how == "async-base-before-await":
            raise BaseBoom("async def before any await")
        await self.v.value()
        if how == "after-state-await":
            raise Boom("after awaiting state")
        if how == "base-after-state-await":
            raise BaseBoom("after awaiting state")
        await asyncio.sleep(0)
        if how == "after-real-await":
            raise Boom("after awaiting asyncio.sleep")
        if how == "base-after-real-await":
            raise BaseBoom("after awaiting asyncio.sleep")
        if how == "unserializable-await":
            await self.v.update(object())
        raise AssertionError(f"not an async failure kind: {how}")


# failure kind -> (function class, expected exception)
FAILURES = {
    "sync": (Failing, Boom),
    "unreturned-chain": (Failing, Boom),
    "unserializable-call": (Failing, ast.SerializationError),
    "sync-cancelled": (Failing, asyncio.CancelledError),
    "callback-cancelled": (Failing, asyncio.CancelledError),
    "async-before-await": (FailingAsync, Boom),
    "after-state-await": (FailingAsync, Boom),
    "after-real-await": (FailingAsync, Boom),
    "unserializable-await": (FailingAsync, ast.SerializationError),
    "sync-base": (Failing, BaseBoom),
    "callback-base": (Failing, BaseBoom),
    "unreturned-chain-base": (Failing, BaseBoom),
    "async-base-before-await": (FailingAsync, BaseBoom),
    "base-after-state-await": (FailingAsync, BaseBoom),
    "base-after-real-await": (FailingAsync, BaseBoom),
}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("how", list(FAILURES))
def test_run_raises_user_failures_promptly(how, make_backend):
    """The run raises the failure without waiting for the other records: an async function
    also has a record in flight that never finishes (waiting for it would hang)."""
    function, expected = FAILURES[how]
    if function is Failing:
        fn, stuck = Failing(), []
    else:
        fn, stuck = FailingAsync(stuck=asyncio.Event()), [("s", "stuck")]
    records = ([(i, "ok") for i in range(20)] + stuck + [("bad", how)]
               + [(i, "ok") for i in range(20)])
    with pytest.raises(expected):
        ast.run(fn, records, key_selector=first, backend=make_backend())


@pytest.mark.timeout(10)
@pytest.mark.parametrize("how", list(FAILURES))
async def test_drain_raises_user_failures_promptly_even_with_stuck_records(how, make_backend):
    _, expected = FAILURES[how]
    fn = FailingAsync(stuck=asyncio.Event())  # plain kinds run in the sync part of its body
    with pytest.raises(expected):  # not TimeoutError: the stuck record is not waited for
        async with asyncio.timeout(5), operator(fn, make_backend()) as op:
            await op.process(("s", "stuck"))
            for i in range(10):
                await op.process((i, "ok"))
            await op.process(("bad", how))
            await op.drain()


@pytest.mark.timeout(10)
def test_failing_backend_batch_fails_the_run():
    backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0,
                                         failure_probability=1.0)
    with pytest.raises(ast.InjectedFailure):
        ast.run(Counter(), [(i, i) for i in range(10)], key_selector=first, backend=backend)


@pytest.mark.timeout(10)
async def test_failing_backend_batch_fails_drain():
    backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0,
                                         failure_probability=1.0)
    seen = []

    class Fn(Counter):
        async def process_element(self, value, ctx):
            try:
                await self.count.value()
            except ast.InjectedFailure as exc:
                seen.append(exc)
                raise

    with pytest.raises(ast.InjectedFailure) as info:
        async with asyncio.timeout(5), operator(Fn(), backend) as op:
            for i in range(10):
                await op.process((i, i))
            await op.drain()
    assert seen and all(isinstance(e, ast.InjectedFailure) for e in seen)
    assert isinstance(info.value, ast.AsyncStateError)


async def test_failure_is_sticky_and_the_same_object_everywhere(make_backend):
    op = operator(Failing(), make_backend(), clock=ast.ManualClock())
    calls = {
        "process": lambda: op.process(("c", "ok")),
        "drain": op.drain,
        "advance_watermark": lambda: op.advance_watermark(5),
        "advance_processing_time": lambda: op.advance_processing_time(5),
    }
    with pytest.raises(Boom) as exit_info:
        async with op:
            await op.process(("a", "ok"))
            await op.process(("b", "sync"))
            with pytest.raises(Boom) as first_info:
                await op.drain()
            failure = first_info.value
            for name, call in calls.items():
                with pytest.raises(Boom) as again:
                    await call()
                assert again.value is failure, name
    assert exit_info.value is failure


# -- contextvars --------------------------------------------------------------------------

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("asyncstate_test_var", default="unset")


async def test_contextvar_set_in_one_record_is_not_visible_in_the_next(make_backend):
    async def step(fn, ctx):
        before = VAR.get()
        VAR.set(f"set by {ctx.current_key}")
        await fn.v.value()
        await asyncio.sleep(0)
        ctx.emit((ctx.current_key, before, VAR.get()))

    async with operator(Step(), make_backend()) as op:
        for k in ["a", "a", "b", "a"]:
            await op.process((k, step))
        await op.drain()
        out = op.outputs()
    assert sorted(out) == [("a", "unset", "set by a")] * 3 + [("b", "unset", "set by b")]
    assert VAR.get() == "unset"


async def test_callbacks_run_in_their_records_context(make_backend):
    class Fn(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

        def process_element(self, value, ctx):
            VAR.set(f"record {value}")
            return (self.v.value()
                    .then_compose(lambda _: self.v.update(value))
                    .then_accept(lambda _: ctx.emit((value, VAR.get()))))

    async with operator(Fn(), make_backend(), key_selector=lambda r: r % 3) as op:
        for i in range(9):
            await op.process(i)
        await op.drain()
        assert sorted(op.outputs()) == [(i, f"record {i}") for i in range(9)]


# -- real asyncio I/O inside records ------------------------------------------------------


async def _echo_upper(reader, writer):
    line = await reader.readline()
    writer.write(line.upper())
    await writer.drain()
    writer.close()
    await writer.wait_closed()


@pytest.mark.timeout(10)
async def test_async_def_awaits_a_real_tcp_client(make_backend):
    server = await asyncio.start_server(_echo_upper, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    class Fn(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

        async def process_element(self, value, ctx):
            n = (await self.count.value() or 0) + 1
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"{value}-{n}\n".encode())
            await writer.drain()
            line = await reader.readline()
            writer.close()
            await writer.wait_closed()
            await self.count.update(n)
            ctx.emit(line.decode().strip())

    async with server, operator(Fn(), make_backend(), key_selector=lambda r: r) as op:
        for k in ["a", "b", "a", "c", "a"]:
            await op.process(k)
        await op.drain()
        out = op.outputs()
    assert sorted(out) == ["A-1", "A-2", "A-3", "B-1", "C-1"]
    assert [o for o in out if o.startswith("A")] == ["A-1", "A-2", "A-3"]


@pytest.mark.timeout(10)
async def test_async_def_that_needs_a_current_task(make_backend):
    server = await asyncio.start_server(_echo_upper, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    test_task = asyncio.current_task()
    tasks = []

    class Fn(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

        async def process_element(self, value, ctx):
            task = asyncio.current_task()
            assert task is not None
            async with asyncio.timeout(2):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(f"{value}\n".encode())
                await writer.drain()
                line = await reader.readline()
                writer.close()
                await writer.wait_closed()
            async with asyncio.timeout(2):
                n = (await self.count.value() or 0) + 1
                await self.count.update(n)
            assert asyncio.current_task() is task
            tasks.append(task)
            ctx.emit((line.decode().strip(), n))

    async with server, operator(Fn(), make_backend(), key_selector=lambda r: r) as op:
        for k in ["x", "y", "x"]:
            await op.process(k)
        await op.drain()
        out = op.outputs()
    assert sorted(out) == [("X", 1), ("X", 2), ("Y", 1)]
    assert len(tasks) == 3
    assert all(t is not test_task for t in tasks)


@pytest.mark.timeout(10)
async def test_timeout_inside_a_record_cancels_only_the_records_await(make_backend):
    class Fn(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

        async def process_element(self, value, ctx):
            try:
                async with asyncio.timeout(0.01):
                    await asyncio.sleep(5)
            except TimeoutError:
                await self.v.update("timed out")
            ctx.emit(await self.v.value())

    async with operator(Fn(), make_backend(), key_selector=lambda r: r) as op:
        await op.process("a")
        async with asyncio.timeout(3):
            await op.drain()
        assert op.outputs() == ["timed out"]


async def _gather(fn, ctx):
    await fn.v.update(1)
    await fn.w.update(2)
    a, b = await asyncio.gather(fn.v.value(), fn.w.value())
    ctx.emit((a, b))


async def _wait_for(fn, ctx):
    fn.v.update(1)
    fn.w.update(2)
    a = await asyncio.wait_for(fn.v.value(), 1)
    b = await asyncio.wait_for(fn.w.value(), 1)
    ctx.emit((a, b))


@pytest.mark.timeout(10)
@pytest.mark.parametrize("step", [_gather, _wait_for], ids=["gather", "wait_for"])
async def test_state_futures_work_with_asyncio_helpers(make_backend, step):
    async with operator(Step(), make_backend()) as op:
        for k in range(4):
            await op.process((k, step))
        async with asyncio.timeout(3):
            await op.drain()
        assert op.outputs() == [(1, 2)] * 4


async def _read_with_timeout(state):
    async with asyncio.timeout(1):
        return await state.value()


@pytest.mark.timeout(10)
async def test_asyncio_timeout_in_a_helper_coroutine(make_backend):
    """API: async def functions may use asyncio.timeout, also from a coroutine they await."""

    async def step(fn, ctx):
        await fn.v.update(7)
        ctx.emit(await _read_with_timeout(fn.v))

    async with operator(Step(), make_backend()) as op:
        await op.process(("a", step))
        async with asyncio.timeout(3):
            await op.drain()
        assert op.outputs() == [7]


@pytest.mark.timeout(10)
async def test_asyncio_timeout_around_state_awaits(make_backend):
    class Fn(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

        async def process_element(self, value, ctx):
            async with asyncio.timeout(1):
                n = (await self.v.value() or 0) + 1
                await self.v.update(n)
            async with asyncio.timeout(1):
                ctx.emit((value, await self.v.value()))

    async with operator(Fn(), make_backend(), key_selector=lambda r: r) as op:
        for k in ["a", "b", "a"]:
            await op.process(k)
        async with asyncio.timeout(3):
            await op.drain()
        assert sorted(op.outputs()) == [("a", 1), ("a", 2), ("b", 1)]


async def test_plain_function_writes_without_waiting_land(make_backend):
    class Fn(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))
            self.l = ctx.get_list_state(ast.ListStateDescriptor("l"))

        def process_element(self, value, ctx):
            if value[1] == "write":
                self.v.update(value[0] * 10)
                self.l.add(value[0])
                return None
            return ast.combine_all([self.v.value(), self.l.get().then_compose(
                lambda it: it.to_list())]).then_accept(lambda r: ctx.emit((value[0], r)))

    records = [(k, "write") for k in range(10)] + [(k, "read") for k in range(10)]
    async with operator(Fn(), make_backend()) as op:
        for r in records:
            await op.process(r)
        await op.drain()
        assert sorted(op.outputs()) == [(k, [k * 10, [k]]) for k in range(10)]


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
    async with operator(fn, make_backend(), config=config) as op:
        fn.op = op
        for key in (0, 10):
            await op.process((key, 0))
        await op.drain()
        out = op.outputs()
        assert sorted(out) == sorted(
            [(k + d, d, 1) for k in (0, 10) for d in range(4)])
        assert op.metrics["records_in"] == op.metrics["records_done"] == 8


# -- snapshots under steady input, and calls while the operator is opening -----------------


class SlowCounter(ast.KeyedProcessFunction):
    """Counts per key, with a real sleep between the read and the write."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    async def process_element(self, value: Any, ctx: Any) -> None:
        n = await self.count.value() or 0
        await asyncio.sleep(0.002)
        await self.count.update(n + 1)


class ReadCount(SlowCounter):
    async def process_element(self, value: Any, ctx: Any) -> None:
        ctx.emit((value, await self.count.value()))


@pytest.mark.timeout(120)
async def test_a_snapshot_under_steady_input_holds_exactly_the_records_admitted_before_it(
        tmp_path: Any) -> None:
    """Another task keeps feeding records that each take 2 ms, so records are always in
    flight: the snapshot holds later records back instead of draining forever, and the
    part holds exactly the records whose process() returned before the call."""
    admitted = 0
    keys = 10

    async def feed(op: ast.KeyedOperator) -> None:
        nonlocal admitted
        i = 0
        while True:
            await op.process(i % keys)
            admitted += 1
            i += 1
            await asyncio.sleep(0.0005)

    op = ast.KeyedOperator(SlowCounter(), key_selector=lambda r: r, backend=ast.HeapBackend(),
                           config=ast.AsyncStateConfig(max_in_flight=100))
    async with op:
        producer = asyncio.create_task(feed(op))
        try:
            paths = []
            for checkpoint_id in (1, 2):
                while admitted < 50 * checkpoint_id:
                    await asyncio.sleep(0.001)
                before = admitted
                async with asyncio.timeout(60):  # without the barrier: never returns
                    paths.append((await op.snapshot(tmp_path, checkpoint_id), before))
            async with asyncio.timeout(60):  # the producer goes on after the snapshots
                while admitted < before + 10:
                    await asyncio.sleep(0.001)
        finally:
            producer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await producer
    for path, before in paths:
        reader = ast.KeyedOperator(ReadCount(), key_selector=lambda r: r,
                                   backend=ast.HeapBackend(), restore_from=path)
        async with reader:
            for key in range(keys):
                await reader.process(key)
        expected = Multiset(i % keys for i in range(before))
        assert sorted(reader.outputs()) == [(k, expected[k] or None) for k in range(keys)]


class SlowOpen(ast.KeyedProcessFunction):
    def __init__(self, gate: asyncio.Event) -> None:
        self.gate = gate

    async def open(self, ctx: ast.RuntimeContext) -> None:
        await self.gate.wait()
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    async def process_element(self, value: Any, ctx: Any) -> None:
        await self.count.update((await self.count.value() or 0) + 1)
        ctx.emit(await self.count.value())


async def test_calls_from_other_tasks_while_open_runs_are_refused(tmp_path: Any) -> None:
    gate = asyncio.Event()
    op = ast.KeyedOperator(SlowOpen(gate), key_selector=lambda r: r, backend=ast.HeapBackend())
    entering = asyncio.create_task(op.__aenter__())
    await asyncio.sleep(0)  # the operator is now awaiting open()
    for call in (lambda: op.process(1), lambda: op.snapshot(tmp_path, 1), op.drain):
        with pytest.raises(ast.InvalidStateError, match=r"is still opening"):
            await call()
    gate.set()
    assert await entering is op
    await op.process(1)
    await op.__aexit__(None, None, None)
    assert op.outputs() == [1]
    assert not (tmp_path / "chk-1").exists()
