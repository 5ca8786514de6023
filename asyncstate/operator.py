"""KeyedOperator drives a KeyedProcessFunction over a stream; `run` does it for a list.

The operator admits records (waiting while `max_in_flight` records are in flight), starts
each one from the controller's trampoline once its key is free, collects emitted values,
and turns watermarks into epochs: `advance_watermark` returns after every earlier record is
done.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import os
import time
from collections.abc import Callable, Iterable
from typing import Any, Final

import mmh3

from asyncstate.backends.base import StateExecutor
from asyncstate.backends.heap import HeapBackend
from asyncstate.checkpoint.layout import checkpoint_path
from asyncstate.checkpoint.operator_state import RestoredExtras, read_operator_extras
from asyncstate.checkpoint.reader import open_checkpoint
from asyncstate.checkpoint.snapshot import (
    check_restorable,
    checkpoint_store,
    restore_snapshot,
    write_snapshot,
)
from asyncstate.clock import Clock, ManualClock, SystemClock
from asyncstate.config import AsyncStateConfig
from asyncstate.errors import ConfigError, InvalidStateError, KeyGroupError
from asyncstate.function import KeyedProcessFunction, RuntimeContext
from asyncstate.keygroups import (
    KeyGroupRange,
    compute_key_group_range_for_operator_index,
)
from asyncstate.log import get_logger
from asyncstate.runtime import gc_threshold
from asyncstate.runtime.context import RecordContext, current_context
from asyncstate.runtime.controller import AsyncExecutionController
from asyncstate.runtime.driver import UserCodeDriver, needs_task
from asyncstate.runtime.future import _DONE, StateFuture
from asyncstate.serde import canonical_key

_murmur3: Final = mmh3.hash  # Final: the compiled module reads it without a dict lookup

__all__ = ["MAX_WATERMARK", "MIN_WATERMARK", "KeyedOperator", "run"]

log = get_logger("asyncstate.operator")

MIN_WATERMARK = -(2**63)
MAX_WATERMARK = 2**63 - 1


# Functions opened by a running operator, by id: a function's states are bound to the
# operator that opened it, so a second operator must not open it meanwhile.
_LIVE_FUNCTIONS: Final[dict[int, KeyedOperator]] = {}
# How long closing waits for cancelled record Tasks to finish.
_RECORD_TASKS_GRACE_S: Final = 1.0


async def _settle(result: object) -> None:
    """Await what open() or close() returned when it is awaitable (an `async def`)."""
    if inspect.isawaitable(result):
        await result


def _check_timestamp(what: str, ts: object) -> int:
    if type(ts) is not int or not (MIN_WATERMARK <= ts <= MAX_WATERMARK):
        raise ConfigError(what, ts, "an int of milliseconds in [-2**63, 2**63)")
    return ts


class KeyedOperator:
    """Runs a KeyedProcessFunction on one operator instance; use as `async with op:`."""

    def __init__(self, function: KeyedProcessFunction, *, key_selector: Callable[[Any], Any],
                 backend: StateExecutor, config: AsyncStateConfig | None = None,
                 clock: Clock | None = None,
                 timestamp_selector: Callable[[Any], int | None] | None = None,
                 parallelism: int = 1, operator_index: int = 0,
                 restore_from: str | os.PathLike[str] | None = None) -> None:
        if not callable(getattr(function, "process_element", None)):
            raise TypeError(f"function must be a KeyedProcessFunction with process_element(), "
                            f"got {type(function).__name__}")
        if not callable(key_selector):
            raise TypeError(f"key_selector must be callable, got {type(key_selector).__name__}")
        if timestamp_selector is not None and not callable(timestamp_selector):
            raise TypeError("timestamp_selector must be callable or None, got "
                            f"{type(timestamp_selector).__name__}")
        if isinstance(backend, type):
            raise TypeError(f"backend must be a state backend instance, got the class "
                            f"{backend.__name__} (call it: {backend.__name__}(...))")
        for method in ("open", "execute_batch", "register_state", "close"):
            if not callable(getattr(backend, method, None)):
                raise TypeError(f"backend must be a state backend (HeapBackend, RocksDBBackend, "
                                f"...), got {type(backend).__name__} without {method}()")
        if clock is not None and not callable(getattr(clock, "now_ms", None)):
            raise TypeError(f"clock must be a Clock with now_ms() (SystemClock, ManualClock) or "
                            f"None, got {type(clock).__name__}")
        if restore_from is not None and not isinstance(restore_from, (str, os.PathLike)):
            raise TypeError(f"restore_from must be a checkpoint path (str or os.PathLike) or "
                            f"None, got {type(restore_from).__name__}")
        if config is None:
            config = AsyncStateConfig()
        elif not isinstance(config, AsyncStateConfig):
            raise TypeError(f"config must be an AsyncStateConfig, got {type(config).__name__}")
        self.config = config
        self.key_group_range: KeyGroupRange = compute_key_group_range_for_operator_index(
            config.max_parallelism, parallelism, operator_index)
        self.parallelism = parallelism
        self.operator_index = operator_index
        self.function = function
        self.backend = backend
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.restore_from: str | None = None if restore_from is None \
            else os.fspath(restore_from)
        self._key_selector = key_selector
        # Typed to return object: a compiled build would otherwise check the result against
        # `int | None` itself (and turn a bool into an int) before `_check_timestamp` runs.
        self._timestamp_selector: Callable[[Any], object] | None = timestamp_selector
        self._controller: AsyncExecutionController | None = None
        self._driver: UserCodeDriver | None = None
        self._base_vars: contextvars.Context | None = None
        self._gc_threshold: int | None = None  # the GC threshold held while open
        self._outputs: list[Any] = []
        # Records (their contexts, not yet started) and events (callables), drained from the
        # front by index.
        self._inbox: list[Any] = []
        self._inbox_posted = False
        self._queued = 0
        self._state = "new"  # new -> opening -> open -> closed
        # Snapshots under way, and the producers they hold back (see snapshot).
        self._snapshots = 0
        self._after_snapshots: list[asyncio.Future[None]] = []
        self._watermark = MIN_WATERMARK
        self._records_in = 0
        self._peak = 0
        self._blocked_seconds = 0.0
        self._process_element = function.process_element
        self._run_record_fn = self._run_record  # one bound method, not one per record
        self._dispose_fn: Callable[[RecordContext], None] | None = None  # the controller's
        self._max_parallelism = config.max_parallelism
        self._kg_start = self.key_group_range.start
        self._kg_end = self.key_group_range.end
        self._function_opened = False

    def __repr__(self) -> str:
        return (f"<KeyedOperator {type(self.function).__name__} {self._state} "
                f"index={self.operator_index}/{self.parallelism} "
                f"key_groups={self.key_group_range.start}..{self.key_group_range.end} "
                f"controller={self._controller!r}>")

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> KeyedOperator:
        if self._state != "new":
            raise InvalidStateError(f"{self!r} was already started; create a new operator")
        loop = asyncio.get_running_loop()
        config = self.config
        controller = AsyncExecutionController(
            self.backend, batch_size=config.batch_size,
            buffer_timeout_ms=config.buffer_timeout_ms, max_in_flight=config.max_in_flight,
            max_parallelism=config.max_parallelism,
            iterator_chunk_size=config.iterator_chunk_size)
        self._controller = controller
        self._dispose_fn = controller._dispose
        always_task = getattr(self.function, "needs_task", None)  # a duck-typed function too
        if always_task is None:
            always_task = needs_task(self._process_element)
        self._driver = UserCodeDriver(loop, controller.fail, always_task)
        self._base_vars = contextvars.copy_context()
        self._state = "opening"  # records and snapshots are refused until open() is done
        self._gc_threshold = config.resolved_gc_threshold()
        if self._gc_threshold is not None:
            gc_threshold.hold(self._gc_threshold)
        try:
            other = _LIVE_FUNCTIONS.get(id(self.function))
            if other is not None:
                raise InvalidStateError(
                    f"this {type(self.function).__name__} object is already running in "
                    f"{other!r}: its states are bound to that operator; create one function "
                    "object per operator")
            restored = self._restore() if self.restore_from is not None else None
            self.runtime_context = RuntimeContext(
                controller, self.backend, parallelism=self.parallelism,
                operator_index=self.operator_index, restored=restored)
            _LIVE_FUNCTIONS[id(self.function)] = self
            self._function_opened = True  # a failing open() still gets its close(), as in Flink
            opener = getattr(self.function, "open", None)
            if opener is not None:
                await _settle(opener(self.runtime_context))
        except BaseException as exc:
            await self._close_after(exc)
            raise
        self._state = "open"
        log.debug("operator.open", function=type(self.function).__name__,
                  index=self.operator_index, parallelism=self.parallelism)
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        primary: BaseException | None = exc
        if exc is None:
            try:
                await self.drain()
            except BaseException as drain_exc:  # noqa: BLE001 - the run failure or a cancel
                primary = drain_exc
        if primary is None and self._controller is not None:
            primary = self._controller.failure
        if primary is None:
            await self._close_operator()  # a clean exit: a failing close() is the error
            return
        await self._close_after(primary)
        if exc is None:
            raise primary

    async def _close_after(self, primary: BaseException) -> None:
        """Close while `primary` is the error being raised: a failure of the function's
        close() (or the backend's) is logged and noted on `primary`, never raised instead."""
        try:
            await self._close_operator()
        except Exception as exc:  # noqa: BLE001 - reported on the primary error
            log.warning("operator.close_failed", error=repr(exc), while_raising=repr(primary))
            primary.add_note(f"closing the operator after this error failed too: {exc!r}")

    async def _close_operator(self) -> None:
        if self._state in ("open", "opening"):
            # Records still running in Tasks first: fail their outstanding requests and
            # cancel them, so that their `finally` blocks run before the function closes.
            assert self._controller is not None and self._driver is not None
            self._controller.close()
            await self._driver.cancel_and_wait(_RECORD_TASKS_GRACE_S)
        await _settle(self._close())

    def _close(self) -> Any:
        """Close the function (if its open() ran) and the backend, once the controller is
        closed; returns what the function's close() returned (awaited by the caller when
        awaitable)."""
        if self._state == "closed":
            return None
        opened = self._state in ("open", "opening")
        self._state = "closed"
        closed: Any = None
        try:
            if self._function_opened:
                self._function_opened = False
                if _LIVE_FUNCTIONS.get(id(self.function)) is self:
                    del _LIVE_FUNCTIONS[id(self.function)]
                closer = getattr(self.function, "close", None)
                if closer is not None:
                    closed = closer()
        finally:
            if opened and self._gc_threshold is not None:
                gc_threshold.release(self._gc_threshold)
            self.backend.close()
        return closed

    def _ready(self) -> AsyncExecutionController:
        controller = self._controller
        if controller is None or self._state != "open":
            if self._state == "opening":
                raise InvalidStateError(
                    f"{self!r} is still opening (restoring, or in the function's open()); "
                    "use it once `async with operator:` has entered")
            raise InvalidStateError(
                f"{self!r} is not running; use it inside `async with operator:`")
        if controller.failure is not None:
            raise controller.failure
        return controller

    # -- checkpoints -----------------------------------------------------------------------

    def _restore(self) -> RestoredExtras:
        """Restore this instance's key groups; returns what the runtime context needs of the
        checkpoint (operator state, state kinds)."""
        assert self.restore_from is not None
        checkpoint = open_checkpoint(self.restore_from)  # checks the parts cover every group
        extras = read_operator_extras(checkpoint)  # checked before any state moves
        # So is what can be of the key groups: a refused restore leaves a directory as it was.
        check_restorable(checkpoint, self.key_group_range, self.config.max_parallelism)
        store = checkpoint_store(self.backend, checkpoint.path)
        mark = getattr(store, "mark_restoring", None)
        if mark is not None:  # a restore failing from here leaves a directory refused
            mark(True)
        discard = getattr(store, "discard_state", None)
        if discard is not None:  # a directory used before: the checkpoint replaces its state
            discard()
        restore_snapshot(store, checkpoint, self.key_group_range, self.config.max_parallelism)
        set_sequence = getattr(store, "set_list_sequence", None)
        if set_sequence is not None:
            set_sequence(extras.list_sequence)
        if mark is not None:
            mark(False)
        return extras

    async def snapshot(self, directory: str | os.PathLike[str], checkpoint_id: int) -> str:
        """Drain, then write this operator's part of checkpoint `checkpoint_id` under
        `directory`; returns the checkpoint's path (the same for every operator).

        Records that other tasks feed meanwhile wait in `process()` until the part is
        written, as records behind a checkpoint barrier do: the drain ends even under
        steady input, and the part holds exactly the records admitted before the call."""
        self._ready_to_wait("snapshot()")
        path = checkpoint_path(directory, checkpoint_id)
        store = checkpoint_store(self.backend, path)
        self._snapshots += 1
        try:
            await self.drain()
            # No await between the drain and the write: the part holds no half-done record.
            extra: dict[str, Any] = {
                "operator_state": self.runtime_context.operator_state_snapshot()}
            list_sequence = getattr(store, "list_sequence", None)
            if list_sequence is not None:
                extra["list_sequence"] = list_sequence()
            write_snapshot(store, path, parallelism=self.parallelism,
                           operator_index=self.operator_index,
                           max_parallelism=self.config.max_parallelism, extra=extra)
        finally:
            self._snapshots -= 1
            if not self._snapshots:
                waiting, self._after_snapshots = self._after_snapshots, []
                for fut in waiting:
                    if not fut.done():
                        fut.set_result(None)
        return path

    # -- records ---------------------------------------------------------------------------

    def _prepare(self, record: Any) -> RecordContext:
        """The record's context, not yet started; raises for a foreign key or a bad
        timestamp before the record is admitted."""
        key = self._key_selector(record)
        key_bytes = canonical_key(key)
        # keygroups.key_group_of_bytes, inlined: one call less per record.
        key_group = _murmur3(key_bytes, 0, False) % self._max_parallelism
        if not (self._kg_start <= key_group <= self._kg_end):
            raise self._foreign_key(key, key_group)
        ts: int | None = None
        if self._timestamp_selector is not None:
            selected = self._timestamp_selector(record)
            if selected is not None:
                ts = _check_timestamp("timestamp", selected)
        ctx = RecordContext(record, key, key_bytes, key_group, self._dispose_fn, ts)
        ctx._owner = self
        return ctx

    def _foreign_key(self, key: Any, key_group: int) -> KeyGroupError:
        kg_range = self.key_group_range
        return KeyGroupError(
            f"key {key!r} belongs to key group {key_group}, outside this operator's key "
            f"groups {kg_range.start}..{kg_range.end} (operator {self.operator_index} of "
            f"{self.parallelism}); route records by key group before processing",
            key_group=key_group)

    async def process(self, record: Any) -> None:
        """Admit one record, waiting while `max_in_flight` records are in flight.

        Returns once the record is admitted, not once it is processed. Called from inside
        one of this operator's records, it admits at once, even beyond `max_in_flight`:
        waiting there could wait for the calling record itself.
        """
        controller = self._ready()
        ctx = self._prepare(record)
        limit = self.config.max_in_flight
        # A loop: producers woken together re-check, so only as many as fit are admitted,
        # and none while a snapshot is under way (one may start while this one waits).
        while self._snapshots or self._queued + controller._in_flight >= limit:
            if self._inside_own_record():
                break
            if self._snapshots:
                await self._wait_snapshots()
                controller = self._ready()  # the run may have failed or closed meanwhile
            else:
                await self._wait_capacity(controller)
        self._admit(controller, ctx)

    def _admit(self, controller: AsyncExecutionController, ctx: RecordContext) -> None:
        self._queued += 1
        self._records_in += 1
        in_flight = self._queued + controller._in_flight
        if in_flight > self._peak:
            self._peak = in_flight
        # Records wait in the inbox and start from one trampoline job, in arrival order;
        # events that must follow them (watermarks) go through the inbox too.
        self._inbox.append(ctx)
        if not self._inbox_posted:
            self._inbox_posted = True
            controller.post(self._drain_inbox, None)

    def _drain_inbox(self, _: Any) -> None:
        inbox = self._inbox
        done = 0
        try:
            while done < len(inbox):  # entries appended meanwhile are drained too
                entry = inbox[done]
                done += 1
                if type(entry) is RecordContext:  # a record
                    self._start(entry)
                else:  # an event: a callable
                    entry()
        finally:
            del inbox[:done]
            self._inbox_posted = False
            if inbox:  # an exception propagated (KeyboardInterrupt): the rest runs later
                self._inbox_posted = True
                self._controller.post(self._drain_inbox, None)  # type: ignore[union-attr]

    def _post_event(self, fn: Callable[[Any], None], arg: Any) -> None:
        assert self._controller is not None
        self._inbox.append(functools.partial(fn, arg))
        if not self._inbox_posted:
            self._inbox_posted = True
            self._controller.post(self._drain_inbox, None)

    def _inside_own_record(self) -> bool:
        current = current_context()
        return current is not None and current._owner is self and not current.finished

    async def _wait_snapshots(self) -> None:
        """Wait until no snapshot is under way (a record fed now would run before the
        snapshot's part is written, or keep its drain from ending)."""
        started = time.perf_counter()
        try:
            while self._snapshots:
                fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                self._after_snapshots.append(fut)
                await fut
        finally:
            self._blocked_seconds += time.perf_counter() - started

    async def _wait_capacity(self, controller: AsyncExecutionController) -> None:
        limit = self.config.max_in_flight
        started = time.perf_counter()
        try:
            await controller.wait_until(lambda: self._queued + controller._in_flight < limit)
        finally:
            self._blocked_seconds += time.perf_counter() - started

    def _start(self, ctx: RecordContext) -> None:
        self._queued -= 1
        controller = self._controller
        assert controller is not None
        if controller._failure is not None:
            return
        ctx.vars = self._base_vars.copy()  # type: ignore[union-attr]
        controller.start_record(ctx, self._run_record_fn)

    def _run_record(self, ctx: RecordContext) -> None:
        # Runs inside the record's contextvars context with a reference held on ctx.
        try:
            result = self._process_element(ctx.record, ctx)
        except BaseException as exc:
            # Any exception of a plain function (or a callback it ran), CancelledError
            # included, is user code's: it fails the run as it does from an async def.
            # KeyboardInterrupt and SystemExit also propagate.
            self._controller.fail(exc)  # type: ignore[union-attr]
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return
        if result is not None and not (type(result) is StateFuture and result._state == _DONE):
            driver = self._driver
            assert driver is not None  # narrowed: a compiled build calls follow directly
            driver.follow(ctx, result, self._process_element)

    def emit(self, value: Any) -> None:
        """Collect an emitted value (called through a record's ctx)."""
        self._outputs.append(value)

    def timer_service_for(self, ctx: RecordContext) -> Any:
        """Timers are not available in this version."""
        raise NotImplementedError("timers are not available in this version of asyncstate")

    def outputs(self) -> list[Any]:
        """Return and clear the values emitted so far, in emission order."""
        out = self._outputs
        self._outputs = []
        return out

    # -- progress --------------------------------------------------------------------------

    def _ready_to_wait(self, call: str) -> AsyncExecutionController:
        """`_ready()`, for a call that waits for records to finish: from inside one of this
        operator's records it would wait for that record itself, so it raises instead."""
        controller = self._ready()
        ctx = current_context()
        if ctx is not None and ctx._owner is self and not ctx.finished:
            raise InvalidStateError(
                f"{call} called from inside a record of this operator (key {ctx.key!r}): it "
                "waits for every earlier record to finish, this one included, so it would "
                "never return; call it from the code that feeds the operator")
        return controller

    async def drain(self) -> None:
        """Wait until no record is in flight (partial batches are sent at once)."""
        controller = self._ready_to_wait("drain()")
        await controller.wait_until(lambda: self._queued == 0 and controller._in_flight == 0)

    async def advance_watermark(self, timestamp: int) -> None:
        """Advance event time; returns after every earlier record has finished."""
        controller = self._ready_to_wait("advance_watermark()")
        _check_timestamp("watermark", timestamp)
        done = [False]
        self._post_event(self._on_watermark, (timestamp, done))
        await controller.wait_until(lambda: done[0])

    def _on_watermark(self, arg: tuple[int, list[bool]]) -> None:
        timestamp, done = arg
        assert self._controller is not None

        def trigger() -> None:
            if timestamp > self._watermark:
                self._watermark = timestamp

        def final() -> None:
            done[0] = True

        self._controller.epoch_manager.on_non_record(trigger, final)

    async def advance_processing_time(self, timestamp: int) -> None:
        """Set the ManualClock to `timestamp`; returns after every earlier record finished."""
        controller = self._ready_to_wait("advance_processing_time()")
        if not isinstance(self.clock, ManualClock):
            raise InvalidStateError(
                "advance_processing_time() needs the operator to run on an ast.ManualClock "
                f"(clock=ast.ManualClock()), not {type(self.clock).__name__}")
        _check_timestamp("processing time", timestamp)
        self.clock.set(timestamp)
        done = [False]

        def event(_: Any) -> None:
            assert self._controller is not None
            self._controller.epoch_manager.on_non_record(None, lambda: done.__setitem__(0, True))

        self._post_event(event, None)
        await controller.wait_until(lambda: done[0])

    def current_watermark(self) -> int:
        """The current event-time watermark (-2**63 before the first)."""
        return self._watermark

    @property
    def metrics(self) -> dict[str, Any]:
        """Counters of this operator (see docs/api.md)."""
        c = self._controller
        in_flight = self._queued + (c._in_flight if c is not None else 0)
        return {
            "records_in": self._records_in,
            "records_done": c.records_done if c is not None else 0,
            "in_flight": in_flight,
            "in_flight_peak": max(self._peak, c.in_flight_peak if c is not None else 0),
            "batches": c.batches if c is not None else 0,
            "requests": c.requests if c is not None else 0,
            "max_batch_size": c.max_batch_size if c is not None else 0,
            "blocked_seconds": self._blocked_seconds,
        }

    @property
    def controller(self) -> AsyncExecutionController:
        """The operator's controller (while running)."""
        if self._controller is None:
            raise InvalidStateError(f"{self!r} has not been started")
        return self._controller


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where it installs
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(function: KeyedProcessFunction, records: Iterable[Any], *,
        key_selector: Callable[[Any], Any],
        timestamp_selector: Callable[[Any], int | None] | None = None,
        backend: StateExecutor | None = None, config: AsyncStateConfig | None = None,
        clock: Clock | None = None) -> list[Any]:
    """Run `function` over `records` on a fresh event loop; the emitted values in order.

    At the end of input it drains, then advances the watermark to the maximum.
    """
    if asyncio._get_running_loop() is not None:
        raise InvalidStateError(
            "ast.run() cannot be called from a running event loop; inside async code use "
            "`async with ast.KeyedOperator(...) as op: await op.process(record)`")
    operator = KeyedOperator(function, key_selector=key_selector,
                             backend=backend if backend is not None else HeapBackend(),
                             config=config, clock=clock, timestamp_selector=timestamp_selector)
    with asyncio.Runner(loop_factory=_new_loop) as runner:
        return runner.run(_run(operator, records))


async def _run(operator: KeyedOperator, records: Iterable[Any]) -> list[Any]:
    async with operator:
        controller = operator.controller
        limit = operator.config.max_in_flight
        prepare = operator._prepare
        admit = operator._admit
        for record in records:
            if controller._failure is not None:
                raise controller._failure
            ctx = prepare(record)
            while operator._queued + controller._in_flight >= limit:
                await operator._wait_capacity(controller)
            admit(controller, ctx)
        await operator.drain()
        await operator.advance_watermark(MAX_WATERMARK)
    return operator.outputs()
