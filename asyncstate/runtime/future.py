"""StateFuture: the result of a state call.

State machine::

    PENDING --_complete(v)--> DONE
    PENDING --_fail(exc)----> FAILED

A future completes once. Invariants:

- A pending future bound to a `RecordContext` holds one reference on it until it completes,
  so a record stays in flight while any of its futures is pending.
- Callbacks registered on a pending future run when it completes, on the loop thread, in
  registration order, inside their record's contextvars context (so `ctx` and the record's
  current key are in force). Callbacks registered on a completed future run before the
  registering call returns.
- A chain of callbacks of any length completes in bounded stack: past `_MAX_DEPTH` links,
  the outermost completion settles the rest (`_complete_at`, `_run_deferred`); a deferred
  future stays pending until then, so a future that looks done has run its callbacks.
  Likewise `then_compose` on completed futures nested `_MAX_DEPTH` calls deep (a recursive
  loop over state calls that complete at once) runs its function from a loop callback.
- An exception raised by a callback completes the returned future exceptionally; a failure
  skips the callbacks down a chain and travels to its end. `BaseException`s that are not
  `Exception`s propagate and are never captured.
- A failure nobody looked at (no callback, no `result()`/`exception()`, not awaited) by the
  time its record finishes fails the operator.

Differences from `asyncio.Future`: callbacks registered with the `then_*` combinators run
inline (no loop hop); awaiting a completed future returns at once; no running loop is needed
for completed futures and their combinators. `cancel()` (what `asyncio.wait_for`,
`asyncio.timeout` and a cancelled Task call) cancels a pending future that only asyncio
waits on: it is done at once, cancelled, and its asyncio callbacks run; the request it stands
for is not recalled (a write still applies), and the record stays in flight until the
backend answered it, so the key's order holds. A future that `then_*` callbacks or the
record's own machinery wait on refuses (`cancel()` returns False). The asyncio protocol
(`add_done_callback`, `get_loop`, `_asyncio_future_blocking`, ...) is implemented so a
StateFuture can be awaited inside any Task and passed to `asyncio.gather` /
`asyncio.wait_for`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Generator, Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

from asyncstate.errors import InvalidStateError
from asyncstate.runtime.context import current_context

if TYPE_CHECKING:
    from asyncstate.runtime.context import RecordContext

__all__ = [
    "StateFuture",
    "combine_all",
    "completed_future",
    "completed_void_future",
    "failed_future",
]

T = TypeVar("T")
U = TypeVar("U")
V = TypeVar("V")

_PENDING: Final = 0
_DONE: Final = 1
_FAILED: Final = 2

# Callback kinds: a callback entry is (kind, fn, target).
_APPLY: Final = 0  # target <- fn(value)
_ACCEPT: Final = 1  # fn(value); target <- None
_COMPOSE: Final = 2  # target <- result of the future fn(value) returns
_FORWARD: Final = 3  # target <- this future's outcome
_CALL: Final = 4  # fn(future) (internal hooks: record starts, iteration, then_combine)
_ASYNCIO: Final = 5  # loop.call_soon(fn, future, context=target[1]) with target = (loop, context)
_SETTLED: Final = 6  # fn(), without counting as looking at a failure (internal ordering gates)
_GATHER: Final = 7  # target.one_done(future): one input of combine_all (target: a _Gather)
_RESUME: Final = 8  # target.resume_on(future): a record's coroutine waits (target: a Waiter)

# Links a completion runs down a chain of callbacks before it defers the rest to the
# outermost completion (`StateFuture._complete_at`): each link takes a few interpreter frames
# (Python build) or C frames (compiled build), so a chain of any length completes without
# RecursionError or a C stack overflow.
_MAX_DEPTH: Final = 32

_get_running_loop: Final = asyncio.get_running_loop  # compiled: Final alias


class _Nesting:
    """How many `then_compose` calls on completed futures are running inside each other."""

    __slots__ = ("depth",)

    def __init__(self) -> None:
        self.depth = 0


_NESTING: Final = _Nesting()


class Waiter:
    """What waits on a pending future through a `_RESUME` callback: the coroutine driver's
    stand-in task (`asyncstate.runtime.driver.RecordTask`). A compiled build calls
    `resume_on` natively, where a hook would be a bound method allocated per await."""

    __slots__ = ()

    def resume_on(self, fut: StateFuture[Any]) -> None:
        """`fut`, which this waiter waits on, completed."""
        raise NotImplementedError


class StateFuture(Generic[T]):
    """The future result of a state call; see the module docstring for its semantics."""

    # Class-level defaults keep construction to the minimum, as asyncio.Future does: a
    # completed future sets two attributes, a pending one at most two.
    _state = _PENDING
    _result: Any = None
    _exception: BaseException | None = None
    _exception_tb: TracebackType | None = None
    # The first callback lives in three attributes (most futures have exactly one, and no
    # object is allocated for it); `_more` holds any further ones as (kind, fn, target).
    _cb_kind: int | None = None  # the first callback's kind; None: no callback
    _cb_fn: Any = None
    _cb_target: Any = None
    _more: list[tuple[int, Any, Any]] | None = None
    _asyncio_future_blocking = False
    _observed = False
    # _DONE or _FAILED while a completion deferred at `_MAX_DEPTH` waits to settle (the
    # future still looks pending); 0 otherwise.
    _settling = 0
    _ctx: RecordContext | None = None
    # Cancelled through the asyncio protocol while pending: it looks failed with a
    # CancelledError, and still holds its record reference until the backend completes it.
    _cancelled = False

    def __init__(self, ctx: RecordContext | None = None) -> None:
        if ctx is not None:
            self._ctx = ctx
            ctx.ref_count += 1

    def __repr__(self) -> str:
        state = ("pending", "done", "failed")[self._state]
        extra = f" result={self._result!r}" if self._state == _DONE else (
            f" exception={self._exception!r}" if self._state == _FAILED else "")
        return f"<StateFuture {state}{extra}>"

    # -- completion (controller side) -----------------------------------------------------

    def _complete(self, value: Any) -> None:
        if self._state != _PENDING or self._settling:
            if self._cancelled:
                self._answered_after_cancel()
                return
            raise InvalidStateError(f"{self!r} is already completed")
        self._result = value
        self._state = _DONE
        deferred = self._finish_at(0)
        if deferred is not None:
            _run_deferred(deferred)

    def _fail(self, exc: BaseException) -> None:
        deferred = self._fail_at(exc, 0)
        if deferred is not None:
            _run_deferred(deferred)

    def _complete_at(self, value: Any, depth: int) -> list[StateFuture[Any]] | None:
        """`_complete` inside a completion `depth` links deep. At `_MAX_DEPTH`, a future with
        callbacks is not completed yet: it stays pending, holding its outcome, and is
        returned (in a list, with any others deferred further down) for the outermost
        completion to settle (`_run_deferred`), so that a chain of any length completes in
        bounded stack, and a future never looks done before its callbacks have run."""
        if self._state != _PENDING or self._settling:
            if self._cancelled:
                self._answered_after_cancel()
                return None
            raise InvalidStateError(f"{self!r} is already completed")
        self._result = value
        if depth >= _MAX_DEPTH and self._cb_kind is not None:
            self._settling = _DONE
            return [self]
        self._state = _DONE
        return self._finish_at(depth)

    def _fail_at(self, exc: BaseException, depth: int) -> list[StateFuture[Any]] | None:
        if self._state != _PENDING or self._settling:
            if self._cancelled:
                self._answered_after_cancel()
                return None
            raise InvalidStateError(f"{self!r} is already completed")
        self._exception = exc
        self._exception_tb = exc.__traceback__
        if depth >= _MAX_DEPTH and self._cb_kind is not None:
            self._settling = _FAILED
            return [self]
        self._state = _FAILED
        if self._cb_kind is None and self._ctx is not None:
            self._ctx.note_failure(self)
        return self._finish_at(depth)

    def _settle(self) -> list[StateFuture[Any]] | None:
        """Complete a future whose completion was deferred (see `_complete_at`), one link
        deep; returns what its callbacks deferred in turn."""
        state = self._settling
        self._settling = 0
        self._state = state
        if state == _FAILED and self._cb_kind is None and self._ctx is not None:
            self._ctx.note_failure(self)  # its callbacks were removed meanwhile
        return self._finish_at(1)

    def _finish_at(self, depth: int) -> list[StateFuture[Any]] | None:
        """Run the callbacks and drop the record reference of a future just completed by a
        completion `depth` links deep; returns the futures whose completion was deferred."""
        ctx = self._ctx
        deferred: list[StateFuture[Any]] | None = None
        kind = self._cb_kind
        if kind is not None:
            # The record whose contextvars the callbacks must enter (None: none to enter).
            record = ctx if ctx is not None and not ctx.entered and ctx.vars is not None \
                else None
            if record is not None and kind == _FORWARD and self._more is None:
                # A lone forward runs no user code, and a target of the same record enters
                # its contextvars itself if it has callbacks (one Context.run less per
                # record whose function returns a composed chain).
                target: StateFuture[Any] = self._cb_target
                if target._ctx is record:
                    record = None
            try:
                if record is None:
                    deferred = self._run_callbacks(depth)
                else:
                    # RecordContext.run, inlined: callbacks run in the record's contextvars.
                    record.entered = True
                    try:
                        deferred = record.vars.run(  # type: ignore[union-attr]
                            _RUN_CALLBACKS, self, depth)
                    finally:
                        record.entered = False
            except BaseException:
                # A callback let a BaseException through (its other callbacks ran): this
                # future is done all the same, so its reference on the record goes too.
                if ctx is not None:
                    self._ctx = None
                    ctx.release()
                raise
        if ctx is not None:
            self._ctx = None
            count = ctx.ref_count - 1
            ctx.ref_count = count
            if count == 0:
                ctx.release_to_zero()
        return deferred

    def _run_callbacks(self, depth: int) -> list[StateFuture[Any]] | None:
        kind = self._cb_kind
        self._cb_kind = None
        assert kind is not None
        fn, target, more = self._cb_fn, self._cb_target, self._more
        self._cb_fn = self._cb_target = self._more = None
        if more is None:
            return self._dispatch(kind, fn, target, depth)
        deferred: list[StateFuture[Any]] | None = None
        escaped: BaseException | None = None
        for entry in [(kind, fn, target), *more]:
            try:
                further = self._dispatch(entry[0], entry[1], entry[2], depth)
            except BaseException as exc:  # noqa: BLE001 - raised below, after the others ran
                # A callback let a BaseException through: the other callbacks still run, so
                # no future waiting on this one is left pending; the first such exception
                # propagates once they have.
                if escaped is None:
                    escaped = exc
                continue
            if further is not None:
                if deferred is None:
                    deferred = further
                else:
                    deferred.extend(further)
        if escaped is not None:
            if deferred is not None:
                _run_deferred(deferred)
            raise escaped
        return deferred

    def _dispatch(self, kind: int, fn: Any, target: Any,
                  depth: int) -> list[StateFuture[Any]] | None:
        if kind == _ASYNCIO:
            target[0].call_soon(fn, self, context=target[1])
            return None
        if kind == _CALL:
            if self._state == _FAILED:
                self._observed = True
            fn(self)
            return None
        if kind == _RESUME:
            if self._state == _FAILED:
                self._observed = True
            waiter: Waiter = target
            waiter.resume_on(self)
            return None
        if kind == _SETTLED:
            # `_fail` skipped noting the failure because this callback exists; note it here,
            # so that it still fails the run unless someone else looks at it.
            ctx = self._ctx
            if self._state == _FAILED and ctx is not None:
                ctx.note_failure(self)
            fn()
            return None
        if kind == _GATHER:
            if self._state == _FAILED:
                self._observed = True
            gather: _Gather = target
            return gather.one_done(self, depth + 1)
        # compiled: typed local (a compiled build calls it directly). Every other kind
        # completes a StateFuture.
        chained: StateFuture[Any] = target
        if self._state == _FAILED:
            self._observed = True
            return chained._fail_at(self._exception, depth + 1)  # type: ignore[arg-type]
        value = self._result
        if kind == _FORWARD:
            return chained._complete_at(value, depth + 1)
        composed: StateFuture[Any] | None = None
        try:
            if kind == _APPLY:
                result = fn(value)
            elif kind == _ACCEPT:
                fn(value)
                result = None
            else:  # _COMPOSE
                inner: object = fn(value)
                if type(inner) is not StateFuture:
                    raise _not_a_future(fn, inner)
                composed = inner
        except Exception as exc:  # noqa: BLE001 - a callback failure fails the chain
            return chained._fail_at(exc, depth + 1)
        # Outside the try: an error while completing `chained` is not the callback's.
        if composed is not None:
            return composed._forward_to(chained, depth + 1)
        return chained._complete_at(result, depth + 1)

    def _forward_to(self, target: StateFuture[Any],
                    depth: int = 0) -> list[StateFuture[Any]] | None:
        """Complete `target` like this future, now or once this one completes. Inside a
        completion (`depth` > 0) returns what `_complete_at` deferred; at depth 0 runs it."""
        state = self._state
        if state == _PENDING:
            self._add(_FORWARD, None, target)
            return None
        if state == _DONE:
            deferred = target._complete_at(self._result, depth)
        else:
            self._observed = True
            deferred = target._fail_at(self._exception, depth)  # type: ignore[arg-type]
        if depth == 0 and deferred is not None:
            _run_deferred(deferred)
            return None
        return deferred

    def _add(self, kind: int, fn: Any, target: Any) -> None:
        if self._cb_kind is None:
            self._cb_kind = kind
            self._cb_fn = fn
            self._cb_target = target
        elif self._more is None:
            self._more = [(kind, fn, target)]
        else:
            self._more.append((kind, fn, target))

    def _add_settled_hook(self, fn: Callable[[], None]) -> None:
        """Run fn() once done, whatever the outcome, without counting as looking at a
        failure: an unobserved failure still fails the run (internal use). Inline when
        already done."""
        if self._state == _PENDING:
            self._add(_SETTLED, fn, None)
        else:
            fn()

    def _add_hook(self, fn: Callable[[StateFuture[T]], None]) -> None:
        """Run fn(self) once done: inline when already done (internal use)."""
        if self._state == _PENDING:
            self._add(_CALL, fn, None)
        else:
            if self._state == _FAILED:
                self._observed = True
            fn(self)

    # -- inspection ----------------------------------------------------------------------

    def done(self) -> bool:
        """True once the future has a result or an exception."""
        return self._state != _PENDING

    def result(self) -> T:
        """The result; raises the failure, or InvalidStateError while pending."""
        state = self._state
        if state == _DONE:
            return self._result  # type: ignore[no-any-return]
        if state == _FAILED:
            self._observed = True
            exc = self._exception
            assert exc is not None
            # The traceback it failed with, so that raising it again does not add frames.
            raise exc.with_traceback(self._exception_tb)
        raise InvalidStateError("StateFuture.result() called before the future completed")

    def exception(self) -> BaseException | None:
        """The failure (the original exception object) or None; InvalidStateError while pending."""
        if self._state == _PENDING:
            raise InvalidStateError("StateFuture.exception() called before the future completed")
        self._observed = True
        return self._exception

    # -- combinators ---------------------------------------------------------------------

    def _chain(self, kind: int, fn: Any) -> StateFuture[Any]:
        target: StateFuture[Any] = StateFuture(self._ctx)
        self._add(kind, fn, target)
        return target

    def then_apply(self, fn: Callable[[T], U]) -> StateFuture[U]:
        """A future of fn(result)."""
        state = self._state
        if state == _DONE:
            try:
                return completed_future(fn(self._result))
            except Exception as exc:  # noqa: BLE001
                return failed_future(exc)
        if state == _FAILED:
            self._observed = True
            return failed_future(self._exception)  # type: ignore[arg-type]
        return self._chain(_APPLY, fn)

    def then_accept(self, fn: Callable[[T], Any]) -> StateFuture[None]:
        """Run fn(result); a future of None once it ran."""
        state = self._state
        if state == _DONE:
            try:
                fn(self._result)
            except Exception as exc:  # noqa: BLE001
                return failed_future(exc)
            return _VOID
        if state == _FAILED:
            self._observed = True
            return failed_future(self._exception)  # type: ignore[arg-type]
        return self._chain(_ACCEPT, fn)

    def then_compose(self, fn: Callable[[T], StateFuture[U]]) -> StateFuture[U]:
        """A future of the result of the StateFuture fn(result) returns."""
        state = self._state
        if state == _DONE:
            nesting = _NESTING
            if nesting.depth >= _MAX_DEPTH:
                deferred = self._compose_later(fn)
                if deferred is not None:
                    return deferred
            nesting.depth += 1
            try:
                # compiled: typed as object (a compiled build checks the result here, naming
                # fn, rather than at the call).
                call: Callable[[T], object] = fn
                inner = call(self._result)
            except Exception as exc:  # noqa: BLE001
                nesting.depth -= 1
                return failed_future(exc)
            except BaseException:
                nesting.depth -= 1
                raise
            nesting.depth -= 1
            if type(inner) is not StateFuture:
                return failed_future(_not_a_future(fn, inner))
            return inner
        if state == _FAILED:
            self._observed = True
            return failed_future(self._exception)  # type: ignore[arg-type]
        return self._chain(_COMPOSE, fn)

    def _compose_later(self, fn: Callable[[T], StateFuture[U]]) -> StateFuture[U] | None:
        """`then_compose` of a completed future nested `_MAX_DEPTH` calls deep (a loop
        written as recursive `then_compose` over state calls that complete at once): `fn`
        runs from a loop callback, at the bottom of the stack, in the current record's
        contextvars; the record stays in flight meanwhile. None without a running loop."""
        try:
            loop = _get_running_loop()
        except RuntimeError:
            return None
        relay: StateFuture[T] = StateFuture(current_context())
        target: StateFuture[U] = relay._chain(_COMPOSE, fn)
        loop.call_soon(relay._complete, self._result)
        return target

    def then_combine(self, other: StateFuture[U], fn: Callable[[T, U], V]) -> StateFuture[V]:
        """A future of fn(result, other's result), once both are done."""
        checked: object = other
        if not isinstance(checked, StateFuture):  # (the compiled build refuses it earlier)
            raise TypeError(
                f"then_combine() expects a StateFuture as other, got {type(other).__name__}")
        # The result stands for both inputs: a failure of `other` that the result does not
        # carry (because this one failed first) counts as looked at through it.
        other._add_hook(_ignore)
        return self.then_compose(lambda a: other.then_apply(lambda b: fn(a, b)))

    def then_conditionally_apply(
        self, condition: Callable[[T], bool], if_true: Callable[[T], U],
        if_false: Callable[[T], V] | None = None,
    ) -> StateFuture[tuple[bool, U | V | None]]:
        """A future of (condition(result), if_true(result) or if_false(result) or None)."""
        def apply(value: T) -> tuple[bool, U | V | None]:
            if condition(value):
                return (True, if_true(value))
            return (False, None if if_false is None else if_false(value))
        return self.then_apply(apply)

    def then_conditionally_accept(
        self, condition: Callable[[T], bool], if_true: Callable[[T], Any],
        if_false: Callable[[T], Any] | None = None,
    ) -> StateFuture[bool]:
        """Run if_true or if_false on the result; a future of condition(result)."""
        def accept(value: T) -> bool:
            if condition(value):
                if_true(value)
                return True
            if if_false is not None:
                if_false(value)
            return False
        return self.then_apply(accept)

    def then_conditionally_compose(
        self, condition: Callable[[T], bool], if_true: Callable[[T], StateFuture[U]],
        if_false: Callable[[T], StateFuture[V]] | None = None,
    ) -> StateFuture[tuple[bool, U | V | None]]:
        """A future of (condition(result), result of the chosen branch's future or None)."""
        def compose(value: T) -> StateFuture[tuple[bool, U | V | None]]:
            if condition(value):
                branch: Callable[[T], object] = if_true  # checked below, naming branch
                flag = True
            elif if_false is not None:
                branch, flag = if_false, False
            else:
                return completed_future((False, None))
            inner = branch(value)
            if type(inner) is not StateFuture:
                raise _not_a_future(branch, inner)
            return inner.then_apply(lambda result: (flag, result))
        return self.then_compose(compose)

    # -- asyncio future protocol -----------------------------------------------------------

    def get_loop(self) -> asyncio.AbstractEventLoop:
        """The running loop (a StateFuture belongs to the loop it is awaited on)."""
        return _get_running_loop()

    def add_done_callback(self, fn: Callable[[StateFuture[T]], Any], *,
                          context: Any = None) -> None:
        """asyncio protocol: schedule fn(self) on the running loop once done."""
        loop = _get_running_loop()
        if self._state == _PENDING:
            self._add(_ASYNCIO, fn, (loop, context))
        else:
            loop.call_soon(fn, self, context=context)

    def remove_done_callback(self, fn: Callable[[StateFuture[T]], Any]) -> int:
        """asyncio protocol: remove fn scheduled by add_done_callback; return the count."""
        if self._cb_kind is None:
            return 0
        entries = [(self._cb_kind, self._cb_fn, self._cb_target), *(self._more or ())]
        kept = [c for c in entries if not (c[0] == _ASYNCIO and c[1] == fn)]
        self._cb_kind = self._cb_fn = self._cb_target = self._more = None
        for entry in kept:
            self._add(*entry)
        return len(entries) - len(kept)

    def cancel(self, msg: Any = None) -> bool:
        """asyncio protocol: cancel a pending future that only asyncio callbacks wait on
        (see the module docstring); False when it is done or something else waits on it."""
        if self._state != _PENDING or self._settling:
            return False
        kind = self._cb_kind
        if kind is not None and (kind != _ASYNCIO or any(
                entry[0] != _ASYNCIO for entry in self._more or ())):
            return False
        self._cancelled = True
        self._observed = True  # a cancellation never fails the run as an unobserved failure
        self._exception = asyncio.CancelledError() if msg is None \
            else asyncio.CancelledError(msg)
        self._state = _FAILED
        if kind is not None:
            entries = [(kind, self._cb_fn, self._cb_target), *(self._more or ())]
            self._cb_kind = self._cb_fn = self._cb_target = self._more = None
            for _kind, fn, target in entries:
                target[0].call_soon(fn, self, context=target[1])
        return True

    def cancelled(self) -> bool:
        """asyncio protocol: True once `cancel()` cancelled it."""
        return self._cancelled

    def _answered_after_cancel(self) -> None:
        """The backend completed a cancelled future: its answer goes nowhere, and its
        reference on the record goes."""
        ctx = self._ctx
        if ctx is not None:
            self._ctx = None
            ctx.release()

    def __await__(self) -> Generator[Any, None, T]:
        if self._state == _PENDING:
            self._asyncio_future_blocking = True
            try:
                yield self
            except BaseException as exc:
                # A Task waiting on this future throws its failure in: raise it with the
                # traceback it failed with (a compiled generator would drop it).
                if exc is self._exception and self._state == _FAILED:
                    return self.result()
                raise
            if self._state == _PENDING:
                raise InvalidStateError("StateFuture awaited again before it completed")
        if self._state == _DONE:
            return self._result  # type: ignore[no-any-return]
        return self.result()

    def __iter__(self) -> Generator[Any, None, T]:
        return self.__await__()


# Passed to Context.run as a plain function: no bound method per completion.
_RUN_CALLBACKS: Final = StateFuture._run_callbacks  # compiled: Final alias


def _run_deferred(deferred: list[StateFuture[Any]]) -> None:
    """Settle the futures a completion deferred, and those they defer in turn, in order, one
    link deep each: the outermost completion's loop that keeps the stack bounded. If one of
    them lets a BaseException through, the rest still settle before it propagates."""
    queue = deque(deferred)
    try:
        while queue:
            further = queue.popleft()._settle()
            if further is not None:
                queue.extend(further)
    finally:
        if queue:
            _run_deferred(list(queue))


def _not_a_future(fn: Any, got: object) -> TypeError:
    name = getattr(fn, "__qualname__", repr(fn))
    return TypeError(f"then_compose() callback {name} must return a StateFuture, "
                     f"got {type(got).__name__}")


def completed_future(value: T) -> StateFuture[T]:
    """A future already completed with `value`."""
    fut: StateFuture[T] = StateFuture()
    fut._state = _DONE
    fut._result = value
    return fut


def failed_future(exc: BaseException) -> StateFuture[Any]:
    """A future already failed with `exc`.

    Inside a record, the failure is noted on the record: if nothing looks at it before the
    record finishes, it fails the operator (a failing chain that was not returned).
    """
    fut: StateFuture[Any] = StateFuture()
    fut._state = _FAILED
    fut._exception = exc
    fut._exception_tb = exc.__traceback__
    ctx = current_context()
    if ctx is not None:
        ctx.note_failure(fut)
    return fut


_VOID: StateFuture[None] = completed_future(None)


def completed_void_future() -> StateFuture[None]:
    """A future already completed with None."""
    return _VOID


def _ignore(_: StateFuture[Any]) -> None:
    """A hook that only marks a failure as looked at."""


def combine_all(futures: Iterable[StateFuture[T]]) -> StateFuture[list[T]]:
    """A future of the list of results, in input order; fails with the first failure."""
    items = list(futures)
    for f in items:
        if not isinstance(f, StateFuture):
            raise TypeError(f"combine_all() expects StateFutures, got {type(f).__name__}")
    # The combined future stands for all its inputs: whoever looks at it looks at every
    # input's failure (the first one in input order is its own).
    first_failed: StateFuture[Any] | None = None
    for f in items:
        if f._state == _FAILED:
            f._observed = True
            if first_failed is None:
                first_failed = f
    pending = [f for f in items if f._state == _PENDING]
    if not pending:
        if first_failed is not None:
            return failed_future(first_failed._exception)  # type: ignore[arg-type]
        return completed_future([f._result for f in items])
    result: StateFuture[list[Any]] = StateFuture(pending[0]._ctx)
    gather = _Gather(items, len(pending), result)
    for f in pending:  # also after a failure: their own failures are looked at too
        f._add(_GATHER, None, gather)
    if first_failed is not None:
        result._fail(first_failed._exception)  # type: ignore[arg-type]
    return result


class _Gather:
    """The state of one `combine_all`: its inputs, how many are pending, and its result."""

    __slots__ = ("items", "remaining", "result")

    def __init__(self, items: list[StateFuture[Any]], remaining: int,
                 result: StateFuture[list[Any]]) -> None:
        self.items = items
        self.remaining = remaining
        self.result = result

    def one_done(self, fut: StateFuture[Any], depth: int) -> list[StateFuture[Any]] | None:
        """Input `fut` completed, inside a completion `depth` links deep (see _finish_at)."""
        result = self.result
        if result._state != _PENDING or result._settling:
            return None  # an earlier input failed it (its completion may still be deferred)
        if fut._state == _FAILED:
            return result._fail_at(fut._exception, depth)  # type: ignore[arg-type]
        self.remaining -= 1
        if self.remaining == 0:
            return result._complete_at([f._result for f in self.items], depth)
        return None
