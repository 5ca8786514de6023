"""asyncio inside records: contextvars, timeouts, TaskGroups, gather and shield, async
generators, real TCP I/O, and the current task."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import pytest
from driver_helpers import BOTH_DRIVERS, run_dynamic, slow_backend
from shared_functions import (
    Dynamic,
    Step,
    first,
    keyed_operator,
)

import asyncstate as ast
from asyncstate.testing import ManualExecutor


@pytest.mark.timeout(10)
async def test_timeout_expiring_during_a_state_await_raises_timeout_error() -> None:
    async def step(fn: Dynamic, ctx: ast.RecordContext) -> None:
        try:
            async with asyncio.timeout(0.005):
                await fn.v.value()  # the 60 ms round trip outlives the timeout
            ctx.emit("no timeout")
        except TimeoutError:
            ctx.emit("timed out")
        ctx.emit(asyncio.current_task().cancelling())

    assert await run_dynamic(Dynamic(), [("a", step)], slow_backend()) == ["timed out", 0]


_VAR: contextvars.ContextVar[str] = contextvars.ContextVar("_VAR", default="unset")


@BOTH_DRIVERS
@pytest.mark.timeout(30)
async def test_contextvars_survive_every_kind_of_await_and_stay_in_their_record(
        cls: type[Dynamic]) -> None:
    async def step(fn: Dynamic, ctx: ast.RecordContext) -> None:
        before = _VAR.get()
        _VAR.set(f"rec-{ctx.current_key}")
        await fn.v.value()                 # state await (stepped)
        a = _VAR.get()
        await asyncio.sleep(0)             # bare yield: moves into a Task
        b = _VAR.get()
        await fn.v.update(1)               # state await inside the Task
        await asyncio.sleep(0.001)         # a real future
        c = _VAR.get()
        ctx.emit((ctx.current_key, before, a, b, c))

    _VAR.set("outer")
    out = await run_dynamic(cls(), [(k, step) for k in "abcab"], slow_backend(5))
    assert sorted(out) == sorted(
        (k, "outer", f"rec-{k}", f"rec-{k}", f"rec-{k}") for k in "abcab")
    assert _VAR.get() == "outer"


@BOTH_DRIVERS
@pytest.mark.timeout(30)
async def test_timeout_at_a_state_await_keeps_the_write_and_the_key_order(
        cls: type[Dynamic]) -> None:
    async def timed(fn: Dynamic, ctx: ast.RecordContext) -> None:
        try:
            async with asyncio.timeout(0.005):
                await fn.v.update("written")  # 60 ms: outlives the deadline
            ctx.emit("no timeout")
        except TimeoutError:
            ctx.emit(("timed out", asyncio.current_task().cancelling()))

    async def reader(fn: Dynamic, ctx: ast.RecordContext) -> None:
        ctx.emit(("read", ctx.current_key, await fn.v.value()))

    out = await run_dynamic(cls(), [("a", timed), ("a", reader), ("a", reader)], slow_backend())
    assert out == [("timed out", 0), ("read", "a", "written"), ("read", "a", "written")]


@BOTH_DRIVERS
@pytest.mark.timeout(30)
async def test_timeout_entered_before_the_move_expires_after_it(cls: type[Dynamic]) -> None:
    async def step(fn: Dynamic, ctx: ast.RecordContext) -> None:
        try:
            async with asyncio.timeout(0.03):
                await fn.v.value()
                await asyncio.sleep(5)
        except TimeoutError:
            ctx.emit(("timed out", asyncio.current_task().cancelling()))

    assert await run_dynamic(cls(), [("a", step)], slow_backend(5)) == [("timed out", 0)]


@BOTH_DRIVERS
@pytest.mark.timeout(30)
@pytest.mark.parametrize("deadline", ["wait_for", "timeout", "timeout from a helper"])
async def test_a_deadline_around_a_state_call_fires_while_the_request_is_pending(
        cls: type[Dynamic], deadline: str) -> None:
    # The backend answers only when the test says so: the TimeoutError must come first. The
    # request is not recalled: its write applies, and the key's next record starts only once
    # the backend answered it.
    executor = ManualExecutor()
    # Looked up at run time, so no scan of the function's code sees asyncio.timeout.
    helper = getattr(asyncio, "time" + "out")

    async def step(fn: Dynamic, ctx: ast.RecordContext) -> None:
        try:
            if deadline == "wait_for":
                await asyncio.wait_for(fn.v.update(7), 0.001)
            elif deadline == "timeout":
                async with asyncio.timeout(0.001):
                    await fn.v.update(7)
            else:
                async with helper(0.001):
                    await fn.v.update(7)
            ctx.emit("no timeout")
        except TimeoutError:
            ctx.emit(("timed out", executor.delivered_batches))

    async def read(fn: Dynamic, ctx: ast.RecordContext) -> None:
        ctx.emit(("read", await fn.v.value()))

    fn = cls()
    out: list[Any] = []
    config = ast.AsyncStateConfig(buffer_timeout_ms=0)  # sent at once, answered when told
    async with ast.KeyedOperator(fn, key_selector=first, backend=executor,
                                 config=config) as op:
        await op.process(("a", step))
        await op.process(("a", read))
        for _ in range(10_000):  # bounded: the deadline is 1 ms away
            out += op.outputs()
            if out:
                break
            await asyncio.sleep(0.001)
        assert out == [("timed out", 0)]  # the backend has not answered the write
        assert op.controller.in_flight_record_num == 2  # both records wait for it
        drain = asyncio.ensure_future(op.drain())  # sends what waits
        async with asyncio.timeout(20):
            while not drain.done():
                executor.complete_all()
                await asyncio.sleep(0)
        await drain
        assert out + op.outputs() == [("timed out", 0), ("read", 7)]


@BOTH_DRIVERS
@pytest.mark.timeout(30)
async def test_task_group_in_a_runtime_helper_reports_the_child_failure(
        cls: type[Dynamic]) -> None:
    async def step(fn: Dynamic, ctx: ast.RecordContext) -> None:
        async def bad() -> None:
            await asyncio.sleep(0.001)
            raise ValueError("child")

        async def slow_child() -> None:
            await asyncio.sleep(5)

        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(bad())
                tg.create_task(slow_child())
                await fn.v.value()
                await fn.v.value()
        except* ValueError as eg:
            ctx.emit([str(e) for e in eg.exceptions])

    assert await run_dynamic(cls(), [("a", step)], slow_backend(20)) == [["child"]]


@BOTH_DRIVERS
@pytest.mark.timeout(30)
async def test_gather_and_shield_of_state_futures_and_sleeps(cls: type[Dynamic]) -> None:
    async def step(fn: Dynamic, ctx: ast.RecordContext) -> None:
        await fn.v.update(5)
        got = await asyncio.gather(fn.v.value(), asyncio.sleep(0.001, "s"), fn.v.value())
        shielded = await asyncio.shield(fn.v.value())
        ctx.emit((got, shielded))

    assert await run_dynamic(cls(), [("a", step)], slow_backend(5)) == [([5, "s", 5], 5)]


@BOTH_DRIVERS
@pytest.mark.timeout(30)
async def test_async_generators_and_async_with_inside_a_record(cls: type[Dynamic]) -> None:
    async def step(fn: Dynamic, ctx: ast.RecordContext) -> None:
        async def values() -> Any:
            for i in range(3):
                yield await fn.v.value()
                await fn.v.update(i)

        class Guard:
            async def __aenter__(self) -> Any:
                return await fn.v.value()

            async def __aexit__(self, *exc: Any) -> None:
                await fn.v.update("exit")

        seen = [x async for x in values()]
        async with Guard() as inside:
            ctx.emit((seen, inside))
        ctx.emit(await fn.v.value())

    assert await run_dynamic(cls(), [("a", step)], slow_backend(5)) == [([None, 0, 1], 2), "exit"]


VAR: contextvars.ContextVar[str] = contextvars.ContextVar("asyncstate_test_var", default="unset")


async def test_contextvar_set_in_one_record_is_not_visible_in_the_next(make_backend):
    async def step(fn, ctx):
        before = VAR.get()
        VAR.set(f"set by {ctx.current_key}")
        await fn.v.value()
        await asyncio.sleep(0)
        ctx.emit((ctx.current_key, before, VAR.get()))

    async with keyed_operator(Step(), make_backend()) as op:
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

    async with keyed_operator(Fn(), make_backend(), key_selector=lambda r: r % 3) as op:
        for i in range(9):
            await op.process(i)
        await op.drain()
        assert sorted(op.outputs()) == [(i, f"record {i}") for i in range(9)]


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

    async with server, keyed_operator(Fn(), make_backend(), key_selector=lambda r: r) as op:
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

    async with server, keyed_operator(Fn(), make_backend(), key_selector=lambda r: r) as op:
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

    async with keyed_operator(Fn(), make_backend(), key_selector=lambda r: r) as op:
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
    async with keyed_operator(Step(), make_backend()) as op:
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

    async with keyed_operator(Step(), make_backend()) as op:
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

    async with keyed_operator(Fn(), make_backend(), key_selector=lambda r: r) as op:
        for k in ["a", "b", "a"]:
            await op.process(k)
        async with asyncio.timeout(3):
            await op.drain()
        assert sorted(op.outputs()) == [("a", 1), ("a", 2), ("b", 1)]
