"""RecordRunner: from an input record to a record context, and the user function run on it.

`prepare` selects the key and timestamp and checks that the key's group belongs to the
operator, before the record is admitted; `start` hands the context to the controller, which
runs `process_element` inside the record's contextvars copy once the record holds its key;
what it returned (a StateFuture or a coroutine) goes to the user-code driver. Timer firings
start the same way (`start_timer`), with overdraft, and run `on_timer`; the firings of the
operator's own timers (TTL cleanup) run `internal_timers` instead.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

from asyncstate.errors import InvalidStateError, KeyGroupError
from asyncstate.keygroups import KeyGroupRange
from asyncstate.operator.arguments import check_timestamp
from asyncstate.runtime.context import RecordContext
from asyncstate.runtime.controller import AsyncExecutionController
from asyncstate.runtime.driver import UserCodeDriver
from asyncstate.runtime.future import _DONE, StateFuture
from asyncstate.serde import canonical_key, key_group_of_bytes
from asyncstate.timers.service import TimerService, is_internal_namespace

__all__ = ["RecordRunner"]


class RecordRunner:
    """Prepares and runs the records of one operator (`operator` is what `ctx.emit` and
    `ctx.timer_service` reach)."""

    __slots__ = ("_base_vars", "_controller", "_dispose", "_driver", "_key_selector", "_kg_end",
                 "_kg_start", "_max_parallelism", "_on_timer", "_operator", "_parallelism",
                 "_index", "_process_element", "_run", "_run_timer", "_timestamp_selector",
                 "internal_timers", "record_hooks", "timers")

    def __init__(self, operator: Any, process_element: Callable[[Any, Any], Any],
                 on_timer: Callable[[int, Any], Any] | None,
                 key_selector: Callable[[Any], Any],
                 timestamp_selector: Callable[[Any], object] | None,
                 controller: AsyncExecutionController, driver: UserCodeDriver,
                 base_vars: contextvars.Context, key_groups: KeyGroupRange,
                 max_parallelism: int, parallelism: int, index: int) -> None:
        self._operator = operator
        self._process_element = process_element
        self._on_timer = on_timer
        self._key_selector = key_selector
        # compiled: typed as object (a compiled build would otherwise check the result against
        # `int | None` itself, and turn a bool into an int, before `check_timestamp` runs).
        self._timestamp_selector = timestamp_selector
        self._controller = controller
        self._driver = driver
        self._base_vars = base_vars
        self._kg_start = key_groups.start
        self._kg_end = key_groups.end
        self._max_parallelism = max_parallelism
        self._parallelism = parallelism
        self._index = index
        # Called with no arguments as each record starts, inside its context (incremental TTL
        # cleanup with run_cleanup_for_every_record registers here).
        self.record_hooks: list[Callable[[], None]] = []
        # Runs the firings of the operator's own timers, as on_timer(timestamp, ctx) would
        # (None: they are dropped).
        self.internal_timers: Callable[[int, Any], Any] | None = None
        self.timers: TimerService | None = None  # set once the operator's service is built
        # One bound method each, not one per record.
        self._dispose = controller.dispose_context
        self._run = self.run_record
        self._run_timer = self.run_timer

    def prepare(self, record: Any) -> RecordContext:
        """The record's context, not yet started; raises for a key of another operator or a
        bad timestamp, before the record is admitted."""
        key = self._key_selector(record)
        key_bytes = canonical_key(key)
        key_group = key_group_of_bytes(key_bytes, self._max_parallelism)
        if not (self._kg_start <= key_group <= self._kg_end):
            raise self._foreign_key(key, key_group)
        ts: int | None = None
        if self._timestamp_selector is not None:
            selected = self._timestamp_selector(record)
            if selected is not None:
                ts = check_timestamp("timestamp", selected)
        return RecordContext(record, key, key_bytes, key_group,
                             self._dispose, ts, operator=self._operator)

    def _foreign_key(self, key: Any, key_group: int) -> KeyGroupError:
        return KeyGroupError(
            f"key {key!r} belongs to key group {key_group}, outside this operator's key "
            f"groups {self._kg_start}..{self._kg_end} (operator {self._index} of "
            f"{self._parallelism}); route records by key group before processing",
            key_group=key_group)

    def timer_context(self, timer: Any, domain: Any) -> RecordContext:
        """The context of a timer firing: the timer's key and timestamp, `time_domain`, the
        timer as its record; it goes ahead of records waiting for the key (priority 1)."""
        ctx = RecordContext(timer, timer.key, timer.key_bytes, timer.key_group,
                            self._dispose, timer.timestamp, 1,
                            operator=self._operator)
        ctx.time_domain = domain
        return ctx

    def start(self, ctx: RecordContext) -> None:
        """Start a prepared record: it runs once it holds its key and there is capacity."""
        ctx.vars = self._base_vars.copy()
        self._controller.start_record(ctx, self._run)

    def start_timer(self, ctx: RecordContext) -> None:
        """Start a timer firing under its key, beyond max_in_flight if need be (a firing
        waiting for capacity could wait for the records it is ordered behind)."""
        ctx.vars = self._base_vars.copy()
        self._controller.start_record(ctx, self._run_timer, allow_overdraft=True)

    def run_record(self, ctx: RecordContext) -> None:
        """Run process_element for a started record (inside its context, key held)."""
        if self.record_hooks:
            try:
                for hook in self.record_hooks:
                    hook()
            except BaseException as exc:
                self._controller.fail(exc)
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                return
        self._invoke(self._process_element, ctx.record, ctx)

    def run_timer(self, ctx: RecordContext) -> None:
        """Run on_timer for a started timer firing (inside its context, key held); the
        operator's own timers run `internal_timers`, never on_timer. A timer deleted after
        it was taken off its queue runs nothing."""
        timers = self.timers
        if timers is not None and not timers.claim(ctx.record, ctx.time_domain):
            return
        if is_internal_namespace(ctx.record.namespace_bytes):
            internal = self.internal_timers
            if internal is not None:
                self._invoke(internal, ctx.timestamp, ctx)
            return
        on_timer = self._on_timer
        if on_timer is None:
            self._controller.fail(InvalidStateError(
                f"a timer of key {ctx.key!r} fired, but {type(self._operator.function).__name__}"
                " has no on_timer(timestamp, ctx)"))
            return
        self._invoke(on_timer, ctx.timestamp, ctx)

    def _invoke(self, fn: Callable[[Any, Any], Any], arg: Any, ctx: RecordContext) -> None:
        # Runs inside the record's contextvars context with a reference held on ctx.
        try:
            result = fn(arg, ctx)
        except BaseException as exc:
            # Any exception of a plain function (or a callback it ran), CancelledError
            # included, is user code's: it fails the run as it does from an async def.
            # KeyboardInterrupt and SystemExit also propagate.
            self._controller.fail(exc)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return
        if result is not None and not (type(result) is StateFuture and result._state == _DONE):
            self._driver.follow(ctx, result, fn)
