"""Adversarial tests of the user-code driver (runtime/driver.py, runtime/stepping.py).

Each record runs the coroutine function it carries (`_Dynamic`), which the code scan cannot
see: `_Dynamic` records are stepped without a Task until they await something that is not a
state future; `_DynamicTask` records (`needs_task = True`) get a real Task from the start.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import uvloop
from shared_functions import BaseBoom, Dynamic

import asyncstate as ast
from asyncstate.runtime.driver import RecordTask

_VAR: contextvars.ContextVar[str] = contextvars.ContextVar("_VAR", default="unset")


_Dynamic = Dynamic


class _DynamicTask(_Dynamic):
    needs_task = True


def _slow(ms: float = 60) -> ast.SimulatedRemoteBackend:
    return ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=ms)


async def _run(fn: ast.KeyedProcessFunction, records: list[Any], backend: Any = None,
               config: ast.AsyncStateConfig | None = None) -> list[Any]:
    async with ast.KeyedOperator(fn, key_selector=lambda r: r[0],
                                 backend=backend or ast.HeapBackend(), config=config) as op:
        for r in records:
            await op.process(r)
        async with asyncio.timeout(20):
            await op.drain()
        return op.outputs()


_BOTH = pytest.mark.parametrize("cls", [_Dynamic, _DynamicTask], ids=["stepped", "task"])


# -- contextvars ----------------------------------------------------------------------------


@_BOTH
@pytest.mark.timeout(30)
async def test_contextvars_survive_every_kind_of_await_and_stay_in_their_record(
        cls: type[_Dynamic]) -> None:
    async def step(fn: _Dynamic, ctx: ast.RecordContext) -> None:
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
    out = await _run(cls(), [(k, step) for k in "abcab"], _slow(5))
    assert sorted(out) == sorted(
        (k, "outer", f"rec-{k}", f"rec-{k}", f"rec-{k}") for k in "abcab")
    assert _VAR.get() == "outer"


# -- current task ---------------------------------------------------------------------------


@pytest.mark.timeout(30)
async def test_current_task_is_one_stand_in_until_the_move_then_one_real_task() -> None:
    async def step(fn: _Dynamic, ctx: ast.RecordContext) -> None:
        t1 = asyncio.current_task()
        await fn.v.value()
        t2 = asyncio.current_task()
        await asyncio.sleep(0.001)
        t3 = asyncio.current_task()
        await fn.v.value()
        t4 = asyncio.current_task()
        ctx.emit((isinstance(t1, RecordTask), t1 is t2, t3 is t4, isinstance(t3, asyncio.Task),
                  getattr(t1, "real", None) is t3))

    assert await _run(_Dynamic(), [("a", step)], _slow(5)) == [
        (True, True, True, True, True)]


@pytest.mark.timeout(30)
async def test_needs_task_true_gives_one_real_task_for_the_whole_record() -> None:
    async def step(fn: _Dynamic, ctx: ast.RecordContext) -> None:
        t1 = asyncio.current_task()
        await fn.v.value()
        await asyncio.sleep(0)
        ctx.emit((isinstance(t1, asyncio.Task), t1 is asyncio.current_task()))

    assert await _run(_DynamicTask(), [("a", step)], _slow(5)) == [(True, True)]


class _NoTaskOverride(ast.KeyedProcessFunction):
    needs_task = False  # overrides the scan, which sees asyncio.timeout below

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

    async def process_element(self, value: Any, ctx: ast.RecordContext) -> None:
        ctx.emit(type(asyncio.current_task()).__name__)
        try:
            async with asyncio.timeout(0.005):
                await self.v.value()  # 60 ms round trip
            ctx.emit("no timeout")
        except TimeoutError:
            ctx.emit("timed out")


@pytest.mark.timeout(30)
async def test_needs_task_false_override_keeps_timeouts_working_through_the_stand_in() -> None:
    assert await _run(_NoTaskOverride(), [("a", 1)], _slow()) == ["RecordTask", "timed out"]


# -- timeouts and cancellation --------------------------------------------------------------


@_BOTH
@pytest.mark.timeout(30)
async def test_timeout_at_a_state_await_keeps_the_write_and_the_key_order(
        cls: type[_Dynamic]) -> None:
    async def timed(fn: _Dynamic, ctx: ast.RecordContext) -> None:
        try:
            async with asyncio.timeout(0.005):
                await fn.v.update("written")  # 60 ms: outlives the deadline
            ctx.emit("no timeout")
        except TimeoutError:
            ctx.emit(("timed out", asyncio.current_task().cancelling()))

    async def reader(fn: _Dynamic, ctx: ast.RecordContext) -> None:
        ctx.emit(("read", ctx.current_key, await fn.v.value()))

    out = await _run(cls(), [("a", timed), ("a", reader), ("a", reader)], _slow())
    assert out == [("timed out", 0), ("read", "a", "written"), ("read", "a", "written")]


@_BOTH
@pytest.mark.timeout(30)
async def test_timeout_entered_before_the_move_expires_after_it(cls: type[_Dynamic]) -> None:
    async def step(fn: _Dynamic, ctx: ast.RecordContext) -> None:
        try:
            async with asyncio.timeout(0.03):
                await fn.v.value()
                await asyncio.sleep(5)
        except TimeoutError:
            ctx.emit(("timed out", asyncio.current_task().cancelling()))

    assert await _run(cls(), [("a", step)], _slow(5)) == [("timed out", 0)]


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="documented 3.11 behaviour")
@_BOTH
@pytest.mark.timeout(30)
async def test_wait_for_a_state_future_returns_its_result_on_python_311(
        cls: type[_Dynamic]) -> None:
    async def step(fn: _Dynamic, ctx: ast.RecordContext) -> None:
        await fn.v.update(7)
        ctx.emit(await asyncio.wait_for(fn.v.value(), 0.001))

    assert await _run(cls(), [("a", step)], _slow(30)) == [7]


@_BOTH
@pytest.mark.timeout(30)
async def test_swallowed_cancellation_at_a_state_await_lets_the_record_go_on(
        cls: type[_Dynamic]) -> None:
    async def step(fn: _Dynamic, ctx: ast.RecordContext) -> None:
        task = asyncio.current_task()
        asyncio.get_running_loop().call_later(0.005, task.cancel, "stop")
        try:
            await fn.v.update(1)
        except asyncio.CancelledError as exc:
            ctx.emit(("cancelled", exc.args, task.uncancel()))
        await asyncio.sleep(0.001)
        ctx.emit(("after", await fn.v.value()))

    assert await _run(cls(), [("a", step)], _slow()) == [
        ("cancelled", ("stop",), 0), ("after", 1)]


@pytest.mark.timeout(30)
async def test_self_cancel_before_the_first_non_state_await_is_delivered() -> None:
    async def step(fn: _Dynamic, ctx: ast.RecordContext) -> None:
        asyncio.current_task().cancel()
        try:
            await asyncio.sleep(0.001)  # a Task raises CancelledError here
            ctx.emit("not cancelled")
        except asyncio.CancelledError:
            ctx.emit("cancelled")

    assert await _run(_DynamicTask(), [("a", step)]) == ["cancelled"]  # the reference
    assert await _run(_Dynamic(), [("a", step)]) == ["cancelled"]


@_BOTH
@pytest.mark.timeout(30)
async def test_a_cancel_after_the_last_await_ends_the_record_cancelled(
        cls: type[_Dynamic]) -> None:
    """As a Task that is cancelled and then returns without awaiting again ends cancelled,
    a stepped record does too: the run fails with the cancellation."""
    async def step(fn: _Dynamic, ctx: ast.RecordContext) -> None:
        asyncio.current_task().cancel()
        ctx.emit("returned")

    with pytest.raises(asyncio.CancelledError, match=r"the task running the record with key "
                                                       r"'a' was cancelled"):
        await _run(cls(), [("a", step)])


@pytest.mark.timeout(30)
async def test_a_self_cancel_before_a_bare_yield_lands_there_with_its_message() -> None:
    async def step(fn: _Dynamic, ctx: ast.RecordContext) -> None:
        asyncio.current_task().cancel("stop")
        try:
            await asyncio.sleep(0)  # a bare yield: moves into a Task, the cancel lands here
        except asyncio.CancelledError as exc:
            ctx.emit(("caught", exc.args))
        await asyncio.sleep(0.001)  # the record goes on in its Task
        ctx.emit("after")

    assert await _run(_Dynamic(), [("a", step)]) == [("caught", ("stop",)), "after"]


# -- asyncio helpers inside records ---------------------------------------------------------


@_BOTH
@pytest.mark.timeout(30)
async def test_task_group_in_a_runtime_helper_reports_the_child_failure(
        cls: type[_Dynamic]) -> None:
    async def step(fn: _Dynamic, ctx: ast.RecordContext) -> None:
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

    assert await _run(cls(), [("a", step)], _slow(20)) == [["child"]]


@_BOTH
@pytest.mark.timeout(30)
async def test_gather_and_shield_of_state_futures_and_sleeps(cls: type[_Dynamic]) -> None:
    async def step(fn: _Dynamic, ctx: ast.RecordContext) -> None:
        await fn.v.update(5)
        got = await asyncio.gather(fn.v.value(), asyncio.sleep(0.001, "s"), fn.v.value())
        shielded = await asyncio.shield(fn.v.value())
        ctx.emit((got, shielded))

    assert await _run(cls(), [("a", step)], _slow(5)) == [([5, "s", 5], 5)]


@_BOTH
@pytest.mark.timeout(30)
async def test_async_generators_and_async_with_inside_a_record(cls: type[_Dynamic]) -> None:
    async def step(fn: _Dynamic, ctx: ast.RecordContext) -> None:
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

    assert await _run(cls(), [("a", step)], _slow(5)) == [([None, 0, 1], 2), "exit"]


_SHARED: dict[str, Any] = {}


@_BOTH
@pytest.mark.timeout(30)
async def test_awaiting_a_future_twice_and_another_records_future(cls: type[_Dynamic]) -> None:
    async def producer(fn: _Dynamic, ctx: ast.RecordContext) -> None:
        fn.v.update("p")  # not awaited: the read below still sees it
        fut = fn.v.value()
        _SHARED["f"] = fut
        ctx.emit(("producer", await fut, await fut))

    async def consumer(fn: _Dynamic, ctx: ast.RecordContext) -> None:
        ctx.emit(("consumer", await _SHARED["f"], ctx.current_key, await fn.v.value()))

    out = await _run(cls(), [("a", producer), ("b", consumer)], _slow(20))
    assert sorted(out) == [("consumer", "p", "b", None), ("producer", "p", "p")]


# -- failure and close ----------------------------------------------------------------------


class _LoggedClose(_Dynamic):
    """Appends "close" to `log` when the function closes."""

    def __init__(self, log: list[Any]) -> None:
        super().__init__()
        self._log = log

    def close(self) -> None:
        self._log.append("close")


async def _fail_soon(fn: _Dynamic, ctx: ast.RecordContext) -> None:
    await asyncio.sleep(0.01)
    raise ValueError("boom")


@pytest.mark.timeout(30)
async def test_stepped_record_finally_runs_before_close_when_the_run_fails() -> None:
    log: list[Any] = []

    async def waiter(fn: _Dynamic, ctx: ast.RecordContext) -> None:
        try:
            await fn.v.value()  # 200 ms: still waiting when the run fails
        finally:
            log.append("finally")

    with pytest.raises(ValueError, match="boom"):
        await _run(_LoggedClose(log), [("a", waiter), ("c", _fail_soon)], _slow(200))
    assert log == ["finally", "close"]


async def _sleep_long(fn: _LoggedClose, ctx: ast.RecordContext) -> None:
    """Sleeps in a Task until cancelled; appends "finally" to the function's log."""
    try:
        await asyncio.sleep(5)
    finally:
        fn._log.append("finally")


@pytest.mark.timeout(30)
async def test_record_task_finally_runs_before_close_when_the_run_fails() -> None:
    log: list[Any] = []
    with pytest.raises(ValueError, match="boom"):
        await _run(_LoggedClose(log), [("b", _sleep_long), ("c", _fail_soon)])
    exited = list(log)
    await asyncio.sleep(0.05)  # let the cancelled Task run its finally
    assert exited == ["finally", "close"]


async def _base_before_await(fn: _Dynamic, ctx: ast.RecordContext) -> None:
    raise BaseBoom("before any await")


async def _base_after_state_await(fn: _Dynamic, ctx: ast.RecordContext) -> None:
    await fn.v.update(1)
    raise BaseBoom("after a state await")


async def _base_after_real_await(fn: _Dynamic, ctx: ast.RecordContext) -> None:
    await fn.v.update(1)
    await asyncio.sleep(0.001)
    raise BaseBoom("after a real await")


_BASE_RAISERS = pytest.mark.parametrize(
    ("raiser", "message"), [(_base_before_await, "before any await"),
                            (_base_after_state_await, "after a state await"),
                            (_base_after_real_await, "after a real await")],
    ids=["before-await", "after-state-await", "after-real-await"])


@_BOTH
@_BASE_RAISERS
@pytest.mark.parametrize("latency_ms", [0, 5], ids=["heap", "remote"])
@pytest.mark.timeout(30)
async def test_a_base_exception_from_a_record_fails_the_run_with_it(
        cls: type[_Dynamic], raiser: Any, message: str, latency_ms: int) -> None:
    """A BaseException user code raises ends its record and fails the run, as it ends a
    Task: drain raises it, the records still running are cancelled and finish before the
    function closes."""
    log: list[Any] = []

    class Fn(_LoggedClose, cls):  # type: ignore[valid-type,misc]
        pass

    backend = _slow(latency_ms) if latency_ms else ast.HeapBackend()
    with pytest.raises(BaseBoom, match=f"^{message}$"):
        await _run(Fn(log), [("w", _sleep_long), ("a", raiser), ("a", raiser)], backend)
    assert log == ["finally", "close"]


class _PlainRaiser(_LoggedClose):
    """Plain def: writes state, then raises the exception the record carries."""

    def process_element(self, value: Any, ctx: ast.RecordContext) -> None:  # type: ignore[override]
        self.v.update(1)
        raise value[1]


class _SteppedRaiser(_LoggedClose):
    async def process_element(self, value: Any, ctx: ast.RecordContext) -> None:
        await self.v.update(1)
        raise value[1]


class _TaskRaiser(_SteppedRaiser):
    needs_task = True


@pytest.mark.parametrize("cls", [_PlainRaiser, _SteppedRaiser, _TaskRaiser],
                         ids=["plain", "stepped", "task"])
@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
@pytest.mark.timeout(30)
def test_keyboard_interrupt_from_a_record_propagates_and_fails_the_run(
        cls: type[_LoggedClose], exc_type: type[BaseException], loop_name: str) -> None:
    """KeyboardInterrupt and SystemExit leave the loop, as they leave a Task's step; the
    record is over (its code ended), so if the loop goes on the run has failed with the
    same exception instead of hanging or losing the record."""
    raised = exc_type("stop")
    log: list[Any] = []
    loop = asyncio.new_event_loop() if loop_name == "asyncio" else uvloop.new_event_loop()
    op = ast.KeyedOperator(cls(log), key_selector=lambda r: r[0], backend=_slow(1))

    async def body() -> None:
        async with op:
            await op.process(("a", raised))
            await op.drain()

    try:
        task = loop.create_task(body())
        with pytest.raises(exc_type) as first:
            loop.run_until_complete(task)
        assert first.value is raised
        # The loop goes on: drain raises the run's failure, and the task ends with it (as
        # a Task does, its step re-raises it out of the loop; uvloop may have finished the
        # task in the same pass already). run_until_complete would wait forever on a task
        # that ended so, by asyncio's design: the loop runs in slices instead.
        for _ in range(100):
            if task.done():
                break
            loop.call_later(0.01, loop.stop)
            try:
                loop.run_forever()
            except exc_type as again:
                assert again is raised
        assert task.done() and task.exception() is raised
        assert op._controller is not None and op._controller.failure is raised
        assert op._controller.in_flight_record_num == 0  # the record was released
        assert log == ["close"]
    finally:
        loop.close()


# -- stack depth ----------------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_many_records_of_one_key_behind_a_slow_one_do_not_grow_the_stack() -> None:
    async def first(fn: _Dynamic, ctx: ast.RecordContext) -> None:
        await asyncio.sleep(0.02)
        ctx.emit(0)

    async def quick(fn: _Dynamic, ctx: ast.RecordContext) -> None:
        ctx.emit(1)

    n = 5000
    out = await _run(_Dynamic(), [("a", first)] + [("a", quick)] * n, ast.HeapBackend(),
                     ast.AsyncStateConfig(max_in_flight=n + 10))
    assert out == [0] + [1] * n


_NESTED = textwrap.dedent("""
    import asyncio, sys
    import asyncstate as ast

    class F(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))
        async def process_element(self, value, ctx):
            await nest(self, value[1])
            ctx.emit("ok")

    async def nest(fn, n):
        if n == 0:
            return await fn.v.value()
        return await nest(fn, n - 1)

    async def main(depth):
        backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=2)
        async with ast.KeyedOperator(F(), key_selector=lambda r: r[0], backend=backend) as op:
            await op.process(("a", depth))
            await op.drain()
            return op.outputs()

    try:
        print(asyncio.run(main(int(sys.argv[1]))))
    except RecursionError:
        print("RecursionError")
""")


@pytest.mark.parametrize(("depth", "expected"), [(500, "['ok']"), (5000, "RecursionError")])
@pytest.mark.timeout(60)
def test_deeply_nested_helper_awaits_in_stepped_mode(depth: int, expected: str) -> None:
    proc = subprocess.run([sys.executable, "-c", _NESTED, str(depth)], capture_output=True,
                          text=True, timeout=50, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == expected
