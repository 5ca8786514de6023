"""Running user code for a record: plain results, StateFuture chains and coroutines.

A user function may return None, a StateFuture, or a coroutine (`async def`). Coroutines are
stepped from loop callbacks, never inside another Task's step, in their record's contextvars
context. While a coroutine awaits only state futures it needs no asyncio Task: the driver
resumes it when the future completes. When it awaits anything else (a socket, a sleep, a
gather) it is handed to a real Task for the rest of its life, so `asyncio.current_task()`,
`asyncio.timeout` and cancellation behave as in any Task. Functions that need a Task from
their first line (they call `asyncio.timeout`/`current_task` before awaiting anything else)
get one from the start: see `needs_task`.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Callable, Coroutine, Generator
from typing import TYPE_CHECKING, Any

from asyncstate.runtime.future import _FAILED, _PENDING, StateFuture

if TYPE_CHECKING:
    from asyncstate.runtime.context import RecordContext

__all__ = ["UserCodeDriver", "needs_task"]

# Names whose use before the first non-state await requires a current asyncio Task.
_TASK_NAMES = frozenset({"timeout", "timeout_at", "current_task", "TaskGroup", "Timeout"})
_CoroutineType = types.CoroutineType


def needs_task(fn: Callable[..., Any]) -> bool:
    """True when an `async def` function's code refers to asyncio APIs that need a current
    Task (`asyncio.timeout`, `current_task`, `TaskGroup`), in itself or nested code."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    stack = [code] if code is not None else []
    while stack:
        c = stack.pop()
        if _TASK_NAMES.intersection(c.co_names):
            return True
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return False


@types.coroutine
def _continue(coro: Coroutine[Any, Any, Any], first: Any) -> Generator[Any, Any, Any]:
    """Hand a suspended coroutine to a Task: yield what it yielded, then keep forwarding."""
    yielded = first
    while True:
        try:
            yield yielded
        except BaseException as exc:  # noqa: BLE001 - thrown in by the Task (cancellation)
            try:
                yielded = coro.throw(exc)
            except StopIteration as stop:
                return stop.value
        else:
            try:
                yielded = coro.send(None)
            except StopIteration as stop:
                return stop.value


async def _task_body(coro: Coroutine[Any, Any, Any], first: Any) -> Any:
    return await _continue(coro, first)


class UserCodeDriver:
    """Runs a record's user code and keeps the record in flight until it is done."""

    __slots__ = ("_fail", "_loop", "_tasks", "always_task")

    def __init__(self, loop: asyncio.AbstractEventLoop, fail: Callable[[BaseException], None],
                 always_task: bool = False) -> None:
        self._loop = loop
        self._fail = fail
        self._tasks: set[asyncio.Task[Any]] = set()
        self.always_task = always_task

    def run(self, ctx: RecordContext, fn: Callable[..., Any], *args: Any) -> None:
        """Call fn(*args) for `ctx` and follow its result. The caller runs this inside the
        record's contextvars context and holds a reference on `ctx` meanwhile."""
        try:
            result = fn(*args)
        except Exception as exc:  # noqa: BLE001 - user code failure fails the run
            self._fail(exc)
            return
        if result is not None:
            self.follow(ctx, result, fn)

    def follow(self, ctx: RecordContext, result: Any, fn: Callable[..., Any]) -> None:
        """Follow what user code `fn` returned for `ctx`: a StateFuture (its failure fails
        the run) or a coroutine (stepped until done); anything else is a TypeError."""
        tp = type(result)
        if tp is StateFuture:
            # A returned chain that fails later without a consumer is an unobserved failure
            # of its record, which fails the run when the record finishes: no hook needed.
            if result._state == _FAILED:
                self._fail(result.exception())  # type: ignore[arg-type]
        elif tp is _CoroutineType:
            ctx.ref_count += 1  # the coroutine keeps its record in flight
            if self.always_task:
                self._to_task(ctx, result, None)
            else:
                self._step(ctx, result)
        else:
            result_name = getattr(fn, "__qualname__", repr(fn))
            self._fail(TypeError(
                f"{result_name} must return None or a StateFuture, or be an async def; "
                f"it returned {tp.__name__}"))

    def _step(self, ctx: RecordContext, coro: Coroutine[Any, Any, Any]) -> None:
        try:
            yielded = coro.send(None)
        except StopIteration:
            ctx.release()
            return
        except Exception as exc:  # noqa: BLE001 - user code failure fails the run
            _hint_needs_task(exc)
            self._fail(exc)
            ctx.release()
            return
        if type(yielded) is StateFuture and yielded._state == _PENDING:
            yielded._asyncio_future_blocking = False
            yielded._add_hook(lambda _: ctx.run(self._step, ctx, coro))
            return
        self._to_task(ctx, coro, yielded)

    def _to_task(self, ctx: RecordContext, coro: Coroutine[Any, Any, Any], yielded: Any) -> None:
        body = _task_body(coro, yielded) if yielded is not None or not self.always_task \
            else coro
        task = self._loop.create_task(body, context=ctx.vars)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._task_done(ctx, t))

    def _task_done(self, ctx: RecordContext, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        try:
            if task.cancelled():
                self._fail(asyncio.CancelledError(
                    f"the task running the record with key {ctx.key!r} was cancelled"))
            else:
                exc = task.exception()
                if exc is not None:
                    if isinstance(exc, Exception):
                        _hint_needs_task(exc)
                    self._fail(exc)
        finally:
            ctx.release()

    def cancel_all(self) -> None:
        """Cancel the Tasks of records still running (the operator is closing after a failure)."""
        for task in list(self._tasks):
            task.cancel()


def _hint_needs_task(exc: BaseException) -> None:
    if isinstance(exc, RuntimeError) and "inside a task" in str(exc):
        exc.add_note("asyncstate: this function needs a current asyncio Task from its first "
                     "line; set `needs_task = True` on the KeyedProcessFunction")
