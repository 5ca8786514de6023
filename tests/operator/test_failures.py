"""How a run fails: a failure of user code, a callback or the backend fails drain, exit and
every later call with the original exception, promptly; failures user code looked at do not."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from operator_helpers import (
    PlainRecordStep,
    RecordStep,
    raises_same,
)
from shared_functions import (
    BaseBoom,
    Boom,
    Counter,
    cfg,
    first,
    keyed_operator,
    new_backend,
    op_of,
)

import asyncstate as ast


@pytest.mark.timeout(30)
@pytest.mark.backends("heap", "remote0", "remote1", "rocksdb")
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
    fn = RecordStep() if is_async else PlainRecordStep()
    op = op_of(fn, make_backend())
    with pytest.raises(Boom) as info:
        async with op:
            await op.process(("k", bad))
            await op.drain()
            pytest.fail("drain returned after a failure")
    assert info.value is err
    assert op.controller.failure is err
    assert op.outputs() == []


@pytest.mark.timeout(30)
async def test_exit_of_async_with_raises_the_failure_without_an_explicit_drain() -> None:
    err = Boom("x")

    async def bad(fn: Any, rec: Any, ctx: Any) -> None:
        await fn.v.value()
        raise err

    op = op_of(RecordStep(), new_backend("remote1"))
    with pytest.raises(Boom) as info:
        async with op:
            await op.process(("k", bad))
    assert info.value is err


@pytest.mark.timeout(30)
async def test_every_later_call_raises_the_original_failure() -> None:
    err = Boom("x")

    async def bad(fn: Any, rec: Any, ctx: Any) -> None:
        await fn.v.value()
        raise err

    async def good(fn: Any, rec: Any, ctx: Any) -> None:
        await fn.v.update(1)

    op = op_of(RecordStep(), new_backend("remote1"), clock=ast.ManualClock())
    with pytest.raises(Boom):
        async with op:
            await op.process(("k", bad))
            await raises_same(err, op.drain())
            await raises_same(err, op.process(("j", good)))
            await raises_same(err, op.drain())
            await raises_same(err, op.advance_watermark(5))
            await raises_same(err, op.advance_processing_time(5))
            await raises_same(err, op.snapshot("/nonexistent-dir-never-written", 1))
    assert op.outputs() == []


@pytest.mark.timeout(30)
async def test_body_exception_wins_over_a_run_failure_on_exit() -> None:
    err = Boom("run")

    async def bad(fn: Any, rec: Any, ctx: Any) -> None:
        raise err

    op = op_of(RecordStep(), ast.HeapBackend())
    with pytest.raises(KeyError):
        async with op:
            await op.process(("k", bad))
            await asyncio.sleep(0)
            raise KeyError("body")
    assert op.controller.failure is err


@pytest.mark.timeout(30)
@pytest.mark.backends("heap", "remote0", "remote1", "rocksdb")
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

    op = op_of(RecordStep(), make_backend(), config=cfg(max_in_flight=4, batch_size=2))
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


@pytest.mark.timeout(30)
@pytest.mark.backends("heap", "remote0", "remote1", "rocksdb")
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

    async with op_of(RecordStep(), make_backend()) as op:
        await op.process(("k", step))
        await op.drain()
        assert op.outputs() == ["caught"]


@pytest.mark.timeout(30)
@pytest.mark.backends("heap", "remote0", "remote1", "rocksdb")
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

    fn = RecordStep() if style == "async" else PlainRecordStep()
    async with op_of(fn, make_backend()) as op:
        await op.process(("k", step if style == "async" else plain))
        await op.drain()
        assert op.outputs() == ["caught", 2]


@pytest.mark.timeout(30)
@pytest.mark.backends("heap", "remote0", "remote1", "rocksdb")
async def test_serialization_error_not_caught_fails_the_run_with_it(make_backend: Any) -> None:
    async def step(fn: Any, rec: Any, ctx: Any) -> None:
        await fn.v.update(object())

    op = op_of(RecordStep(), make_backend())
    with pytest.raises(ast.SerializationError):
        async with op:
            await op.process(("k", step))
            await op.drain()


@pytest.mark.timeout(30)
async def test_returning_a_wrong_type_fails_the_run_with_type_error() -> None:
    op = op_of(PlainRecordStep(), ast.HeapBackend())
    with pytest.raises(TypeError, match="must return None or a StateFuture"):
        async with op:
            await op.process(("k", lambda fn, rec, ctx: 42))
            await op.drain()


@pytest.mark.timeout(30)
@pytest.mark.backends("heap", "remote0", "remote1", "rocksdb")
async def test_then_compose_returning_a_non_future_fails_the_run_with_type_error(
        make_backend: Any) -> None:
    def step(fn: Any, rec: Any, ctx: Any) -> Any:
        return fn.v.value().then_compose(lambda v: 5)

    op = op_of(PlainRecordStep(), make_backend())
    with pytest.raises(TypeError, match=r"then_compose\(\) callback .* must return a StateFuture, "
                                        "got int"):
        async with op:
            await op.process(("k", step))
            await op.drain()


@pytest.mark.timeout(30)
@pytest.mark.backends("heap", "remote0", "remote1", "rocksdb")
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

    async with op_of(RecordStep(), make_backend()) as op:
        await op.process(("k", step))
        await op.process(("k", step))
        await op.drain()
        assert op.outputs() == ["ok", "ok"]


@pytest.mark.timeout(30)
@pytest.mark.backends("heap", "remote0", "remote1", "rocksdb")
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


class _ReturnsAFailedFuture(ast.KeyedProcessFunction):
    """A plain process_element returning a chain that already failed, after looking at it."""

    def open(self, ctx):
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

    def process_element(self, record, ctx):
        fut = self.v.value().then_apply(lambda _: 1 // 0)
        assert isinstance(fut.exception(), ZeroDivisionError)
        return fut


@pytest.mark.timeout(30)
async def test_returning_a_failed_future_fails_the_run_even_if_it_was_looked_at() -> None:
    op = ast.KeyedOperator(_ReturnsAFailedFuture(), key_selector=lambda r: r,
                           backend=ast.HeapBackend())
    with pytest.raises(ZeroDivisionError):
        async with op:
            await op.process(1)
            await op.drain()


class _CombineTwoFailures(ast.KeyedProcessFunction):
    def open(self, ctx):
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

    async def process_element(self, record, ctx):
        first = self.v.value().then_apply(lambda _: 1 // 0)
        second = self.v.value().then_apply(lambda _: [][0])
        try:
            await first.then_combine(second, lambda a, b: (a, b))
        except ZeroDivisionError:
            ctx.emit("caught")


@pytest.mark.timeout(30)
async def test_then_combine_result_stands_for_the_failure_of_its_other_input() -> None:
    op = ast.KeyedOperator(_CombineTwoFailures(), key_selector=lambda r: r,
                           backend=ast.HeapBackend())
    async with op:
        await op.process(1)
        await op.drain()
    assert op.outputs() == ["caught"]


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
        async with asyncio.timeout(5), keyed_operator(fn, make_backend()) as op:
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
        async with asyncio.timeout(5), keyed_operator(Fn(), backend) as op:
            for i in range(10):
                await op.process((i, i))
            await op.drain()
    assert seen and all(isinstance(e, ast.InjectedFailure) for e in seen)
    assert isinstance(info.value, ast.AsyncStateError)


async def test_failure_is_sticky_and_the_same_object_everywhere(make_backend):
    op = keyed_operator(Failing(), make_backend(), clock=ast.ManualClock())
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


def _fails_in_callback(value: Any) -> Any:
    raise KeyError("the user's line")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["sync", "async", "callback in a task", "gather in a task"])
@pytest.mark.backends("heap", "remote1")
async def test_a_failure_keeps_the_traceback_down_to_the_users_line(
        make_backend: Any, kind: str) -> None:
    import traceback

    async def helper() -> None:
        await asyncio.sleep(0)
        raise KeyError("the user's line")

    class Fails(ast.KeyedProcessFunction):
        # The record runs in a Task of its own: a pending future it awaits fails there.
        needs_task = kind.endswith("in a task")

        def open(self, ctx: Any) -> None:
            self.seen = ctx.get_state(ast.ValueStateDescriptor("seen"))

        def process_element(self, value: Any, ctx: Any) -> Any:
            if kind == "sync":
                raise KeyError("the user's line")
            return self._later(value)

        async def _later(self, value: Any) -> None:
            if kind == "callback in a task":
                await self.seen.value().then_apply(_fails_in_callback)
            if kind == "gather in a task":
                await asyncio.gather(helper())
            await self.seen.update(value)
            raise KeyError("the user's line")

    op = ast.KeyedOperator(Fails(), key_selector=lambda v: v, backend=make_backend())
    with pytest.raises(KeyError, match="the user's line") as raised:
        async with op:
            await op.process(1)
    frames = traceback.extract_tb(raised.value.__traceback__)
    assert frames[-1].name == {"sync": "process_element", "async": "_later",
                               "callback in a task": "_fails_in_callback",
                               "gather in a task": "helper"}[kind], frames
    assert frames[-1].filename == __file__
    assert frames[-1].line == 'raise KeyError("the user\'s line")'


@pytest.mark.timeout(30)
@pytest.mark.backends("heap", "remote0", "rocksdb")
@pytest.mark.parametrize("wait", ["sleep", "state"])
async def test_no_record_starts_after_the_run_failed(make_backend: Any, wait: str) -> None:
    # Records 1..5 share record 0's key and wait for it; others wait for capacity. Record 0
    # fails after an await: none of the others may run user code (side effects) after it.
    started: list[int] = []

    class FailsFirst(ast.KeyedProcessFunction):
        def open(self, ctx: Any) -> None:
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

        async def process_element(self, rec: Any, ctx: Any) -> None:
            started.append(rec[1])
            if rec[1] == 0:
                if wait == "sleep":
                    await asyncio.sleep(0.01)
                else:
                    await self.v.value()
                raise Boom("record 0")
            await self.v.update(rec[1])

    op = ast.KeyedOperator(FailsFirst(), key_selector=first, backend=make_backend(),
                           config=cfg(max_in_flight=8))
    with pytest.raises(Boom, match="record 0"):
        async with op:
            for i in range(6):
                await op.process(("k", i))
            for i in range(6, 12):
                await op.process((f"other{i}", i))
            await op.drain()
    assert 0 in started and not any(0 < i < 6 for i in started)


@pytest.mark.timeout(30)
@pytest.mark.backends("remote0", "rocksdb")
async def test_a_record_whose_key_was_handed_over_before_the_failure_does_not_start(
        make_backend: Any) -> None:
    # ("k", 0) finishes and hands its key to ("k", 1) in the same delivery in which ("c", 2),
    # whose read shared ("k", 0)'s batch, fails: ("k", 1) must not start.
    started: list[Any] = []

    class FailsOnC(ast.KeyedProcessFunction):
        def open(self, ctx: Any) -> None:
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

        async def process_element(self, rec: Any, ctx: Any) -> None:
            started.append(rec)
            await self.v.value()
            if rec[0] == "c":
                raise Boom("c fails")

    with pytest.raises(Boom, match="c fails"):
        async with keyed_operator(FailsOnC(), make_backend()) as op:
            for rec in [("k", 0), ("k", 1), ("c", 2)]:
                await op.process(rec)
            await op.drain()
    assert started == [("k", 0), ("c", 2)]


@pytest.mark.timeout(30)
@pytest.mark.backends("heap", "remote0", "rocksdb")
async def test_no_timer_fires_after_the_run_failed(make_backend: Any) -> None:
    fired: list[Any] = []

    class TimerFails(ast.KeyedProcessFunction):
        def process_element(self, rec: Any, ctx: Any) -> None:
            ctx.timer_service.register_event_time_timer(10)

        def on_timer(self, ts: int, ctx: Any) -> None:
            fired.append(ctx.current_key)
            if ctx.current_key == "a":
                raise Boom("timer a fails")

    with pytest.raises(Boom, match="timer a fails"):
        async with keyed_operator(TimerFails(), make_backend(),
                                  key_selector=lambda r: r) as op:
            for key in ["a", "b", "c"]:
                await op.process(key)
            await op.advance_watermark(100)
    assert fired == ["a"]
