"""Running user code for a record: plain results, StateFuture chains and coroutines.

A user function may return None, a StateFuture, or a coroutine (`async def`). Coroutines are
stepped from loop callbacks, never inside another Task's step, in their record's contextvars
context.

While a coroutine awaits only state futures it needs no asyncio Task (one per record would
cost more than the rest of the record): the driver resumes it when the future completes.
During those steps `asyncio.current_task()` returns the record's `RecordTask`, a stand-in
that implements the Task cancellation protocol, so `asyncio.timeout`, `TaskGroup` and
clients that look up the current task before their first await behave as in a Task. The
first time the coroutine awaits anything else (a socket, a sleep, a gather) it moves into a
real Task for the rest of its life; the stand-in forwards cancellation to it from then on.
A function whose code visibly uses such APIs (`needs_task` scans it) gets a real Task per
record from the start, so `current_task()` is the same object throughout the record;
`KeyedProcessFunction.needs_task` overrides the scan.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Final

from asyncstate.runtime.future import _FAILED, _PENDING, _RESUME, StateFuture, Waiter
from asyncstate.runtime.handover import Handover
from asyncstate.runtime.stepping import FINISHED, step

if TYPE_CHECKING:
    from asyncstate.runtime.context import RecordContext

__all__ = ["RecordTask", "UserCodeDriver", "needs_task"]

# Names whose use suggests code that looks up or cancels the current task.
_TASK_NAMES = frozenset({"timeout", "timeout_at", "current_task", "TaskGroup", "Timeout"})
_SCAN_LIMIT = 400  # code objects examined per function, at most

_CoroutineType: Final = types.CoroutineType  # compiled: Final alias
_current_task: Final = asyncio.current_task  # compiled: Final alias
_FINISHED: Final = FINISHED  # compiled: Final alias
_step_coroutine: Final = step  # compiled: Final alias
# asyncio registers the current task per loop; the stand-in only needs the lookups to work.
_enter_task: Final[Callable[[Any, Any], None]] = asyncio.tasks._enter_task  # compiled: Final alias
_leave_task: Final[Callable[[Any, Any], None]] = asyncio.tasks._leave_task  # compiled: Final alias


def needs_task(fn: Callable[..., Any]) -> bool:
    """True when a function's code refers to asyncio APIs that use the current task
    (`asyncio.timeout`, `current_task`, `TaskGroup`): in itself, its nested code, and the
    functions and methods it names (functions of its module, methods of its class),
    transitively. A false positive only costs speed (a Task per record)."""
    func = getattr(fn, "__func__", fn)
    owner = getattr(fn, "__self__", None)
    owner_type = type(owner) if owner is not None else None
    code = getattr(func, "__code__", None)
    namespace = getattr(func, "__globals__", {})
    stack = [code] if code is not None else []
    seen: set[types.CodeType] = set()
    while stack and len(seen) < _SCAN_LIMIT:
        c = stack.pop()
        if c in seen:
            continue
        seen.add(c)
        if _TASK_NAMES.intersection(c.co_names):
            return True
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
        for name in c.co_names:
            target = namespace.get(name)
            if owner_type is not None and target is None:
                target = getattr(owner_type, name, None)
            target = getattr(target, "__func__", target)
            if isinstance(target, types.FunctionType):
                stack.append(target.__code__)
    return False


class RecordTask(Waiter):
    """The current task of a record's coroutine while it runs without an asyncio Task.

    Implements what asyncio's own context managers use: `cancel`, `cancelling`,
    `uncancel`, `done`, `cancelled`, `get_loop`, `get_name`. A cancel requested while the
    coroutine waits for a state future is delivered as CancelledError at once, as a Task
    delivers it: the coroutine stops waiting, while the state future stays pending (its
    request is not recalled) and keeps the record in flight until the backend answers.
    """

    __slots__ = ("_cancel_message", "_cancels", "_coro", "_ctx", "_done", "_driver", "_loop",
                 "_must_cancel", "_waiting", "real")

    def __init__(self, loop: asyncio.AbstractEventLoop, ctx: RecordContext,
                 driver: UserCodeDriver, coro: Coroutine[Any, Any, Any]) -> None:
        self._loop = loop
        self._ctx = ctx
        self._driver = driver
        self._coro = coro
        self._cancels = 0
        self._must_cancel = False
        self._cancel_message: Any = None
        self._done = False
        self.real: asyncio.Task[Any] | None = None
        # The state future the coroutine waits for (None: it runs, or a cancel took it away)
        self._waiting: StateFuture[Any] | None = None

    def __repr__(self) -> str:
        return f"<RecordTask key={self._ctx.key!r} real={self.real!r}>"

    def resume_on(self, fut: StateFuture[Any]) -> None:
        """Step the coroutine again once the state future it awaited is done (unless a
        cancel stepped it on without that future)."""
        if fut is not self._waiting:
            return
        self._waiting = None
        ctx = self._ctx
        if ctx.entered or ctx.vars is None:
            # Completing the future entered the record's contextvars already (the usual
            # case): a direct call, without a bound method and an argument tuple per step.
            self._driver._step(ctx, self._coro, self)
        else:
            ctx.run(self._driver._step, ctx, self._coro, self)

    def _deliver_cancel(self) -> None:
        if not self._done and self.real is None and self._must_cancel:
            self._ctx.run(self._driver._step, self._ctx, self._coro, self)

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def get_name(self) -> str:
        return f"asyncstate-record-{self._ctx.key!r}"

    def get_coro(self) -> None:
        return None

    def done(self) -> bool:
        return self._done if self.real is None else self.real.done()

    def cancelled(self) -> bool:
        return False if self.real is None else self.real.cancelled()

    def cancel(self, msg: Any = None) -> bool:
        if self.real is not None:
            return self.real.cancel(msg)
        if self._done:
            return False
        self._cancels += 1
        self._must_cancel = True
        self._cancel_message = msg
        if self._waiting is not None:
            self._waiting = None
            self._loop.call_soon(self._deliver_cancel)
        return True

    def cancelling(self) -> int:
        return self._cancels + (self.real.cancelling() if self.real is not None else 0)

    def uncancel(self) -> int:
        if self._cancels > 0:
            self._cancels -= 1
            return self._cancels + (self.real.cancelling() if self.real is not None else 0)
        if self.real is not None:
            return self.real.uncancel()
        return 0


class UserCodeDriver:
    """Runs a record's user code and keeps the record in flight until it is done."""

    __slots__ = ("_closing", "_fail", "_loop", "_tasks", "always_task")

    def __init__(self, loop: asyncio.AbstractEventLoop, fail: Callable[[BaseException], None],
                 always_task: bool = False) -> None:
        self._loop = loop
        self._fail = fail
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        self.always_task = always_task

    def follow(self, ctx: RecordContext, result: Any, fn: Callable[..., Any]) -> None:
        """Follow what user code `fn` returned for `ctx`: a StateFuture (its failure fails
        the run) or a coroutine (stepped until done); anything else is a TypeError. The
        caller runs this inside the record's contextvars context with a reference held."""
        tp = type(result)
        if tp is StateFuture:
            # A returned chain that fails later without a consumer is an unobserved failure
            # of its record, which fails the run when the record finishes: no hook needed.
            fut: StateFuture[Any] = result  # compiled: typed local (a native attribute read)
            if fut._state == _FAILED:
                self._fail(fut.exception())  # type: ignore[arg-type]
        elif tp is _CoroutineType:
            ctx.ref_count += 1  # the coroutine keeps its record in flight
            if self.always_task:
                self._to_task(ctx, result, None, None)
            else:
                self._step(ctx, result, RecordTask(self._loop, ctx, self, result))
        else:
            result_name = getattr(fn, "__qualname__", repr(fn))
            self._fail(TypeError(
                f"{result_name} must return None or a StateFuture, or be an async def; "
                f"it returned {tp.__name__}"))

    def _step(self, ctx: RecordContext, coro: Coroutine[Any, Any, Any],
              task: RecordTask) -> None:
        loop = self._loop
        outer = None
        try:
            _enter_task(loop, task)
        except RuntimeError:  # inside another Task's step: never expected, handled anyway
            outer = _current_task(loop)
            _leave_task(loop, outer)
            _enter_task(loop, task)
        try:
            if task._must_cancel:
                task._must_cancel = False
                yielded = _step_coroutine(coro, asyncio.CancelledError(task._cancel_message))
            else:
                yielded = _step_coroutine(coro, None)
        except asyncio.CancelledError as exc:
            task._done = True
            self._fail(asyncio.CancelledError(
                f"the record with key {ctx.key!r} was cancelled: {exc}"))
            ctx.release()
            return
        except BaseException as exc:
            # Any exception ends the coroutine, as it ends a Task: the run fails with it and
            # the record is released. KeyboardInterrupt and SystemExit also propagate, as
            # they do out of a Task's step.
            task._done = True
            self._fail(exc)
            ctx.release()
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return
        finally:
            _leave_task(loop, task)
            if outer is not None:
                _enter_task(loop, outer)
        if yielded is _FINISHED:
            task._done = True
            if task._must_cancel and not self._closing:
                # Cancelled after its last await: a Task ends cancelled then, and so does this.
                self._fail(asyncio.CancelledError(
                    f"the task running the record with key {ctx.key!r} was cancelled"))
            ctx.release()
            return
        if type(yielded) is StateFuture and yielded._state == _PENDING:
            yielded._asyncio_future_blocking = False
            task._waiting = yielded
            yielded._add(_RESUME, None, task)
            return
        self._to_task(ctx, coro, yielded, task)

    def _to_task(self, ctx: RecordContext, coro: Coroutine[Any, Any, Any], yielded: Any,
                 stand_in: RecordTask | None) -> None:
        # A fresh coroutine, or one suspended at a bare `yield` (asyncio.sleep(0)), resumes
        # with send(None) as a Task's first step does; one that yielded a future must first
        # wait for it, so the Task starts by yielding that future again.
        # A cancel asked of the stand-in since its last step is delivered where the
        # coroutine waits, as a Task delivers it (the count stays on the stand-in).
        pending: BaseException | None = None
        if stand_in is not None and stand_in._must_cancel:
            stand_in._must_cancel = False
            message = stand_in._cancel_message
            pending = asyncio.CancelledError() if message is None \
                else asyncio.CancelledError(message)
        body = coro if yielded is None and pending is None \
            else Handover(coro, yielded, pending)
        task = self._loop.create_task(body, context=ctx.vars)
        if stand_in is not None:
            stand_in.real = task
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._task_done(ctx, t))

    def _task_done(self, ctx: RecordContext, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        try:
            if task.cancelled():
                if not self._closing:  # cancel_all's own cancellations fail nothing
                    self._fail(asyncio.CancelledError(
                        f"the task running the record with key {ctx.key!r} was cancelled"))
            else:
                exc = task.exception()
                if exc is not None:
                    self._fail(exc)
        finally:
            ctx.release()

    async def cancel_and_wait(self, timeout: float) -> None:
        """Cancel the Tasks of records still running and give them up to `timeout` seconds to
        finish (their `finally` blocks run before the operator closes the function)."""
        self.cancel_all()
        tasks = list(self._tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    def cancel_all(self) -> None:
        """Cancel the Tasks of records still running (the operator is closing after a failure)."""
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
