"""The user-code driver (runtime/driver.py): records stepped without a Task until they await
something else, the stand-in current task, promotion to a Task, cancellation, and user code
that raises BaseExceptions."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import uvloop
from driver_helpers import BOTH_DRIVERS, DynamicTask, run_dynamic, slow_backend
from shared_functions import BaseBoom, Dynamic, keyed_operator

import asyncstate as ast
from asyncstate.runtime.driver import RecordTask, needs_task


@pytest.mark.timeout(10)
async def test_current_task_without_a_task_is_the_records_stand_in() -> None:
    test_task = asyncio.current_task()

    async def step(fn: Dynamic, ctx: ast.RecordContext) -> None:
        task = asyncio.current_task()
        ctx.emit((type(task).__name__, task is test_task, task.get_loop() is
                  asyncio.get_running_loop()))

    assert await run_dynamic(Dynamic(), [("a", step)]) == [("RecordTask", False, True)]


@pytest.mark.timeout(10)
async def test_stand_in_forwards_cancellation_to_the_task_after_promotion() -> None:
    async def step(fn: Dynamic, ctx: ast.RecordContext) -> None:
        stand_in = asyncio.current_task()
        await asyncio.sleep(0)  # moves the record into a real Task
        assert isinstance(stand_in, RecordTask) and stand_in.real is asyncio.current_task()
        try:
            async with asyncio.timeout(0.005):  # the real Task is current now
                await asyncio.sleep(1)
        except TimeoutError:
            ctx.emit("timed out in task")
        loop = asyncio.get_running_loop()
        loop.call_later(0.005, stand_in.cancel)
        try:
            await asyncio.sleep(1)
        except asyncio.CancelledError:
            stand_in.uncancel()
            ctx.emit("cancelled through the stand-in")

    assert await run_dynamic(Dynamic(), [("a", step)]) == [
        "timed out in task", "cancelled through the stand-in"]


@pytest.mark.timeout(10)
async def test_cancel_through_the_stand_in_is_delivered_when_the_state_await_completes() -> None:
    async def step(fn: Dynamic, ctx: ast.RecordContext) -> None:
        asyncio.get_running_loop().call_later(0.005, asyncio.current_task().cancel)
        try:
            await fn.v.value()
        except asyncio.CancelledError:
            ctx.emit("cancelled")

    assert await run_dynamic(Dynamic(), [("a", step)], slow_backend()) == ["cancelled"]


def test_code_scan_finds_task_apis_in_helpers() -> None:
    async def helper() -> None:
        async with asyncio.timeout(1):
            pass

    class Direct(ast.KeyedProcessFunction):
        async def process_element(self, value: Any, ctx: Any) -> None:
            async with asyncio.timeout(1):
                pass

    class ViaMethod(ast.KeyedProcessFunction):
        async def process_element(self, value: Any, ctx: Any) -> None:
            await self.fetch()

        async def fetch(self) -> None:
            print(asyncio.current_task())

    class Plain(ast.KeyedProcessFunction):
        async def process_element(self, value: Any, ctx: Any) -> None:
            await asyncio.sleep(0)

    assert needs_task(Direct().process_element)
    assert needs_task(ViaMethod().process_element)
    assert not needs_task(Plain().process_element)
    assert needs_task(helper)


@pytest.mark.timeout(30)
async def test_current_task_is_one_stand_in_until_the_move_then_one_real_task() -> None:
    async def step(fn: Dynamic, ctx: ast.RecordContext) -> None:
        t1 = asyncio.current_task()
        await fn.v.value()
        t2 = asyncio.current_task()
        await asyncio.sleep(0.001)
        t3 = asyncio.current_task()
        await fn.v.value()
        t4 = asyncio.current_task()
        ctx.emit((isinstance(t1, RecordTask), t1 is t2, t3 is t4, isinstance(t3, asyncio.Task),
                  getattr(t1, "real", None) is t3))

    assert await run_dynamic(Dynamic(), [("a", step)], slow_backend(5)) == [
        (True, True, True, True, True)]


@pytest.mark.timeout(30)
async def test_needs_task_true_gives_one_real_task_for_the_whole_record() -> None:
    async def step(fn: Dynamic, ctx: ast.RecordContext) -> None:
        t1 = asyncio.current_task()
        await fn.v.value()
        await asyncio.sleep(0)
        ctx.emit((isinstance(t1, asyncio.Task), t1 is asyncio.current_task()))

    assert await run_dynamic(DynamicTask(), [("a", step)], slow_backend(5)) == [(True, True)]


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
    out = await run_dynamic(_NoTaskOverride(), [("a", 1)], slow_backend())
    assert out == ["RecordTask", "timed out"]


@BOTH_DRIVERS
@pytest.mark.timeout(30)
async def test_swallowed_cancellation_at_a_state_await_lets_the_record_go_on(
        cls: type[Dynamic]) -> None:
    async def step(fn: Dynamic, ctx: ast.RecordContext) -> None:
        task = asyncio.current_task()
        asyncio.get_running_loop().call_soon(task.cancel, "stop")  # lands in the await below
        try:
            await fn.v.update(1)
        except asyncio.CancelledError as exc:
            ctx.emit(("cancelled", exc.args, task.uncancel()))
        await asyncio.sleep(0.001)
        ctx.emit(("after", await fn.v.value()))

    assert await run_dynamic(cls(), [("a", step)], slow_backend()) == [
        ("cancelled", ("stop",), 0), ("after", 1)]


@pytest.mark.timeout(30)
async def test_self_cancel_before_the_first_non_state_await_is_delivered() -> None:
    async def step(fn: Dynamic, ctx: ast.RecordContext) -> None:
        asyncio.current_task().cancel()
        try:
            await asyncio.sleep(0.001)  # a Task raises CancelledError here
            ctx.emit("not cancelled")
        except asyncio.CancelledError:
            ctx.emit("cancelled")

    assert await run_dynamic(DynamicTask(), [("a", step)]) == ["cancelled"]  # the reference
    assert await run_dynamic(Dynamic(), [("a", step)]) == ["cancelled"]


@BOTH_DRIVERS
@pytest.mark.timeout(30)
async def test_a_cancel_after_the_last_await_ends_the_record_cancelled(
        cls: type[Dynamic]) -> None:
    """As a Task that is cancelled and then returns without awaiting again ends cancelled,
    a stepped record does too: the run fails with the cancellation."""
    async def step(fn: Dynamic, ctx: ast.RecordContext) -> None:
        asyncio.current_task().cancel()
        ctx.emit("returned")

    with pytest.raises(asyncio.CancelledError, match=r"the task running the record with key "
                                                       r"'a' was cancelled"):
        await run_dynamic(cls(), [("a", step)])


@pytest.mark.timeout(30)
async def test_a_self_cancel_before_a_bare_yield_lands_there_with_its_message() -> None:
    async def step(fn: Dynamic, ctx: ast.RecordContext) -> None:
        asyncio.current_task().cancel("stop")
        try:
            await asyncio.sleep(0)  # a bare yield: moves into a Task, the cancel lands here
        except asyncio.CancelledError as exc:
            ctx.emit(("caught", exc.args))
        await asyncio.sleep(0.001)  # the record goes on in its Task
        ctx.emit("after")

    assert await run_dynamic(Dynamic(), [("a", step)]) == [("caught", ("stop",)), "after"]


_SHARED: dict[str, Any] = {}


@BOTH_DRIVERS
@pytest.mark.timeout(30)
async def test_awaiting_a_future_twice_and_another_records_future(cls: type[Dynamic]) -> None:
    async def producer(fn: Dynamic, ctx: ast.RecordContext) -> None:
        fn.v.update("p")  # not awaited: the read below still sees it
        fut = fn.v.value()
        _SHARED["f"] = fut
        ctx.emit(("producer", await fut, await fut))

    async def consumer(fn: Dynamic, ctx: ast.RecordContext) -> None:
        ctx.emit(("consumer", await _SHARED["f"], ctx.current_key, await fn.v.value()))

    out = await run_dynamic(cls(), [("a", producer), ("b", consumer)], slow_backend(20))
    assert sorted(out) == [("consumer", "p", "b", None), ("producer", "p", "p")]


class _LoggedClose(Dynamic):
    """Appends "close" to `log` when the function closes; `waiting` is set by a record that
    waits for something when another record fails the run."""

    def __init__(self, log: list[Any]) -> None:
        super().__init__()
        self._log = log
        self.waiting = asyncio.Event()

    def close(self) -> None:
        self._log.append("close")


async def _fail_soon(fn: _LoggedClose, ctx: ast.RecordContext) -> None:
    await fn.waiting.wait()  # the other record waits now
    raise ValueError("boom")


@pytest.mark.timeout(30)
async def test_stepped_record_finally_runs_before_close_when_the_run_fails() -> None:
    log: list[Any] = []

    async def waiter(fn: _LoggedClose, ctx: ast.RecordContext) -> None:
        try:
            fn.waiting.set()
            await fn.v.value()  # 200 ms: still waiting when the run fails
        finally:
            log.append("finally")

    with pytest.raises(ValueError, match="boom"):
        await run_dynamic(_LoggedClose(log), [("a", waiter), ("c", _fail_soon)], slow_backend(200))
    assert log == ["finally", "close"]


async def _sleep_long(fn: _LoggedClose, ctx: ast.RecordContext) -> None:
    """Sleeps in a Task until cancelled; appends "finally" to the function's log."""
    try:
        fn.waiting.set()
        await asyncio.sleep(5)
    finally:
        fn._log.append("finally")


@pytest.mark.timeout(30)
async def test_record_task_finally_runs_before_close_when_the_run_fails() -> None:
    log: list[Any] = []
    with pytest.raises(ValueError, match="boom"):
        await run_dynamic(_LoggedClose(log), [("b", _sleep_long), ("c", _fail_soon)])
    assert log == ["finally", "close"]


async def _base_before_await(fn: Dynamic, ctx: ast.RecordContext) -> None:
    raise BaseBoom("before any await")


async def _base_after_state_await(fn: Dynamic, ctx: ast.RecordContext) -> None:
    await fn.v.update(1)
    raise BaseBoom("after a state await")


async def _base_after_real_await(fn: Dynamic, ctx: ast.RecordContext) -> None:
    await fn.v.update(1)
    await asyncio.sleep(0.001)
    raise BaseBoom("after a real await")


_BASE_RAISERS = pytest.mark.parametrize(
    ("raiser", "message"), [(_base_before_await, "before any await"),
                            (_base_after_state_await, "after a state await"),
                            (_base_after_real_await, "after a real await")],
    ids=["before-await", "after-state-await", "after-real-await"])


@BOTH_DRIVERS
@_BASE_RAISERS
@pytest.mark.parametrize("latency_ms", [0, 5], ids=["heap", "remote"])
@pytest.mark.timeout(30)
async def test_a_base_exception_from_a_record_fails_the_run_with_it(
        cls: type[Dynamic], raiser: Any, message: str, latency_ms: int) -> None:
    """A BaseException user code raises ends its record and fails the run, as it ends a
    Task: drain raises it, the records still running are cancelled and finish before the
    function closes."""
    log: list[Any] = []

    class Fn(_LoggedClose, cls):  # type: ignore[valid-type,misc]
        pass

    backend = slow_backend(latency_ms) if latency_ms else ast.HeapBackend()
    with pytest.raises(BaseBoom, match=f"^{message}$"):
        await run_dynamic(Fn(log), [("w", _sleep_long), ("a", raiser), ("a", raiser)], backend)
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
    op = ast.KeyedOperator(cls(log), key_selector=lambda r: r[0], backend=slow_backend(1))

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


@pytest.mark.timeout(60)
async def test_many_records_of_one_key_behind_a_slow_one_do_not_grow_the_stack() -> None:
    gate = asyncio.Event()

    async def first(fn: Dynamic, ctx: ast.RecordContext) -> None:
        await gate.wait()  # every other record queues behind this one
        ctx.emit(0)

    async def quick(fn: Dynamic, ctx: ast.RecordContext) -> None:
        ctx.emit(1)

    n = 5000
    async with keyed_operator(Dynamic(), ast.HeapBackend(),
                              config=ast.AsyncStateConfig(max_in_flight=n + 10)) as op:
        for record in [("a", first)] + [("a", quick)] * n:
            await op.process(record)
        gate.set()
        async with asyncio.timeout(20):
            await op.drain()
        assert op.outputs() == [0] + [1] * n


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


class _DeadlineFromOutside(ast.KeyedProcessFunction):
    """Enters `asyncio.timeout_at` through a context manager chosen at run time (the code scan
    cannot see it), with a deadline already passed, then awaits I/O."""

    needs_task = False

    def __init__(self, deadline_cm: Any) -> None:
        self.deadline_cm = deadline_cm

    async def process_element(self, rec: Any, ctx: ast.RecordContext) -> None:
        try:
            async with self.deadline_cm(asyncio.get_running_loop().time() + rec[1]):
                await asyncio.sleep(1)
            ctx.emit("no timeout")
        except TimeoutError:
            ctx.emit("TimeoutError")


@pytest.mark.timeout(30)
async def test_a_timeout_that_expires_before_the_record_s_task_first_runs_reaches_its_code(
        ) -> None:
    # The deadline passes before the Task the record moved into first runs: the cancellation
    # must still reach the record's `async with`, which turns it into TimeoutError.
    async with keyed_operator(_DeadlineFromOutside(asyncio.timeout_at), ast.HeapBackend(),
                              key_selector=lambda r: r[0]) as op:
        for i in range(5):
            await op.process((i, 0.0))
        await op.drain()
        assert op.outputs() == ["TimeoutError"] * 5


@pytest.mark.timeout(30)
async def test_a_failed_run_cancels_the_tasks_a_record_awaits_through_gather() -> None:
    # A and B read in one batch. B fails as its read completes; A, resumed by the same
    # delivery, awaits gather(child()) and moves into a Task that the failure cancels
    # before its first step: the cancellation must reach the gather, and so the child,
    # before the operator closes.
    events: list[str] = []
    children: list[asyncio.Task[Any]] = []

    async def child() -> None:
        task = asyncio.current_task()
        assert task is not None
        children.append(task)
        await asyncio.sleep(5)
        events.append("child ran to its end")

    class GatherThenFail(ast.KeyedProcessFunction):
        def open(self, ctx: Any) -> None:
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

        async def process_element(self, rec: Any, ctx: ast.RecordContext) -> None:
            await self.v.value()
            if rec == "B":
                raise ValueError("record B fails")
            try:
                await asyncio.gather(child())
            except asyncio.CancelledError:
                events.append("record cancelled")
                raise

    backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=2)
    with pytest.raises(ValueError, match="record B fails"):
        async with keyed_operator(GatherThenFail(), backend, key_selector=lambda r: r) as op:
            await op.process("B")
            await op.process("A")
            await op.drain()
    assert events == ["record cancelled"]
    assert all(task.done() for task in children)  # none left running after close
