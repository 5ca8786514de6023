"""KeyedOperator: one instance of a keyed operator, its lifecycle and the wiring of its parts.

Entering `async with op:` builds the parts around a controller (see the package docstring),
restores the operator's key groups when asked to, and opens the function. Records pass the
admission gate into the inbox, start from the controller's trampoline once their key is free,
and run through the record runner; watermarks and processing time advance through the same
inbox; snapshots hold the gate, drain and write this operator's part of a checkpoint.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
from collections.abc import Callable
from typing import Any, TypeVar

from asyncstate.backends.base import BackendCapabilities, StateExecutor
from asyncstate.checkpoint.snapshot import SectionHandler
from asyncstate.clock import Clock, SystemClock
from asyncstate.config import AsyncStateConfig
from asyncstate.errors import InvalidStateError
from asyncstate.function import KeyedProcessFunction, RuntimeContext
from asyncstate.keygroups import compute_key_group_range_for_operator_index
from asyncstate.log import get_logger
from asyncstate.operator import arguments, checkpointing, closing, functions
from asyncstate.operator.admission import AdmissionGate
from asyncstate.operator.inbox import Inbox
from asyncstate.operator.metrics import measure_occupancy, operator_metrics
from asyncstate.operator.progress import MIN_WATERMARK, TimeProgress, open_timers
from asyncstate.operator.records import RecordRunner
from asyncstate.operator.watchdog import RecordWatchdog
from asyncstate.runtime import gc_threshold
from asyncstate.runtime.context import RecordContext, current_context
from asyncstate.runtime.controller import AsyncExecutionController
from asyncstate.runtime.driver import UserCodeDriver, needs_task
from asyncstate.runtime.occupancy import Occupancy
from asyncstate.state.ttl.timers import TtlTimers
from asyncstate.timers.service import TimerService, TimerServiceView, timer_namespace

__all__ = ["KeyedOperator"]

log = get_logger("asyncstate.operator")

_P = TypeVar("_P")


class KeyedOperator:
    """Runs a KeyedProcessFunction on one operator instance; use as `async with op:`."""

    def __init__(self, function: KeyedProcessFunction, *, key_selector: Callable[[Any], Any],
                 backend: StateExecutor, config: AsyncStateConfig | None = None,
                 clock: Clock | None = None,
                 timestamp_selector: Callable[[Any], int | None] | None = None,
                 parallelism: object = 1, operator_index: object = 0,
                 restore_from: str | os.PathLike[str] | None = None,
                 output_list: object = None) -> None:
        # compiled: typed as object (parallelism, operator_index: ints; output_list: a list
        # or None), so both builds raise the errors of `arguments`.
        arguments.check_function(function)
        arguments.check_selector("key_selector", key_selector)
        arguments.check_selector("timestamp_selector", timestamp_selector, optional=True)
        self.backend = arguments.check_backend(backend)
        arguments.check_clock(clock)
        self.restore_from = arguments.check_restore_from(restore_from)
        self.config = config = arguments.check_config(config)
        self.parallelism, self.operator_index = arguments.check_operator_index(
            parallelism, operator_index, config.max_parallelism)
        self.key_group_range = compute_key_group_range_for_operator_index(
            config.max_parallelism, self.parallelism, self.operator_index)
        self.function = function
        self.clock: Clock = clock if clock is not None else SystemClock()
        self._key_selector = key_selector
        self._timestamp_selector = timestamp_selector
        self._state = "new"  # new -> opening -> open -> closed
        # A clean exit of `async with` has begun: records from outside are refused, since
        # the exit's drain might not wait for them.
        self._exiting = False
        self._function_opened = False
        self._gc_threshold: int | None = None  # the GC threshold held while open
        # Emitted values; several operators may share one list (ast.run at parallelism > 1).
        self._outputs: list[Any] = arguments.check_output_list(output_list)
        # The parts, built when the operator starts (they need the running loop).
        self._controller: AsyncExecutionController | None = None
        self._capabilities: BackendCapabilities | None = None
        self._driver: UserCodeDriver | None = None
        self._records: RecordRunner | None = None
        self._gate: AdmissionGate | None = None
        self._progress: TimeProgress | None = None
        self._timers: TimerService | None = None
        self._ttl_timers: TtlTimers | None = None
        self._watchdog: RecordWatchdog | None = None

    def __repr__(self) -> str:
        return (f"<KeyedOperator {type(self.function).__name__} {self._state} "
                f"index={self.operator_index}/{self.parallelism} "
                f"key_groups={self.key_group_range.start}..{self.key_group_range.end} "
                f"controller={self._controller!r}>")

    # -- lifecycle -------------------------------------------------------------------------

    def _wire(self) -> None:
        """Build the parts around a new controller on the running loop."""
        config, function, loop = self.config, self.function, asyncio.get_running_loop()
        record_timeout_ms = config.record_timeout_ms
        controller = self._controller = AsyncExecutionController(
            self.backend, batch_size=config.batch_size,
            buffer_timeout_ms=config.buffer_timeout_ms, max_in_flight=config.max_in_flight,
            max_parallelism=config.max_parallelism,
            iterator_chunk_size=config.iterator_chunk_size,
            record_timeout_ms=record_timeout_ms)
        controller.add_failure_listener(self._log_failure)
        if record_timeout_ms is not None:
            self._watchdog = RecordWatchdog(loop, controller, record_timeout_ms)
        self._capabilities = BackendCapabilities.of(self.backend)
        process_element = function.process_element
        always_task = getattr(function, "needs_task", None)  # a duck-typed function too
        driver = self._driver = UserCodeDriver(
            loop, controller.fail,
            needs_task(process_element) if always_task is None else always_task)
        on_timer = getattr(function, "on_timer", None)
        records = self._records = RecordRunner(
            self, process_element, on_timer if callable(on_timer) else None,
            self._key_selector, self._timestamp_selector, controller, driver,
            contextvars.copy_context(), self.key_group_range, config.max_parallelism,
            self.parallelism, self.operator_index)
        self._ttl_timers = TtlTimers(controller)
        records.internal_timers = self._ttl_timers.fire
        inbox = Inbox(controller, records)
        self._gate = AdmissionGate(controller, inbox, config.max_in_flight,
                                   self._ready_to_admit)
        self._progress = TimeProgress(controller, inbox, self.clock)

    def _open_timers(self) -> dict[int, SectionHandler]:
        """Build the timer service (after a restore discarded the backend's old state; the
        handlers returned restore the timer sections of a checkpoint)."""
        self._timers = open_timers(
            self._started(self._progress), self._started(self._records),
            self._started(self._ttl_timers), place=self._started(self._capabilities).timers,
            key_groups=self.key_group_range, max_parallelism=self.config.max_parallelism,
            clock=self.clock, function=self.function)
        return self._timers.section_handlers()

    async def __aenter__(self) -> KeyedOperator:
        if self._state != "new":
            raise InvalidStateError(f"{self!r} was already started; create a new operator")
        self._wire()
        self._state = "opening"  # records and snapshots are refused until open() is done
        self._gc_threshold = self.config.resolved_gc_threshold()
        if self._gc_threshold is not None:
            gc_threshold.hold(self._gc_threshold)
        try:
            functions.bind(self.function, self)  # before anything is restored
            if self.restore_from is None:
                restored = None
                self._open_timers()
            else:
                restored = checkpointing.restore(
                    self._started(self._capabilities), self.restore_from, self.key_group_range,
                    self.config.max_parallelism, self._open_timers)
            self.runtime_context = RuntimeContext(
                self.controller, self.backend, parallelism=self.parallelism,
                operator_index=self.operator_index, restored=restored, operator=self)
            self._function_opened = True  # a failing open() still gets its close(), as in Flink
            await functions.call_open(self.function, self.runtime_context)
        except BaseException as exc:
            await closing.close_after(self._close, exc)
            raise
        self._state = "open"
        if self._watchdog is not None:
            self._watchdog.start()
        log.debug("operator.open", function=type(self.function).__name__,
                  index=self.operator_index, parallelism=self.parallelism,
                  backend=type(self.backend).__name__,
                  restored_from=None if self.restore_from is None else str(self.restore_from))
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        primary: BaseException | None = exc
        if exc is None:
            self._exiting = True  # from now on records from outside are refused
            try:
                await self.drain()
            except BaseException as drain_exc:  # noqa: BLE001 - the run failure or a cancel
                primary = drain_exc
        if primary is None and self._controller is not None:
            primary = self._controller.failure
        if primary is None:
            await self._close()  # a clean exit: a failing close() is the error
            return
        await closing.close_after(self._close, primary)
        if exc is None:
            raise primary

    async def _close(self) -> None:
        """Close once: the parts, then the function and the backend (`closing.close`)."""
        if self._state == "closed":
            return
        opened, self._state = self._state != "new", "closed"
        function_opened, self._function_opened = self._function_opened, False
        if opened:
            metrics = self.metrics
            log.debug("operator.closed", function=type(self.function).__name__,
                      index=self.operator_index, records=metrics["records_done"],
                      batches=metrics["batches"], requests=metrics["requests"],
                      blocked_seconds=round(metrics["blocked_seconds"], 6),
                      failed=self._controller is not None
                      and self._controller.failure is not None)
        await closing.close(
            self.function, self, self.backend, opened=opened, function_opened=function_opened,
            controller=self._controller, driver=self._driver, watchdog=self._watchdog,
            timers=self._timers, held_gc_threshold=self._gc_threshold)

    def _log_failure(self, exc: BaseException) -> None:
        log.info("operator.failed", function=type(self.function).__name__,
                 index=self.operator_index, error=repr(exc))

    def _ready(self) -> AsyncExecutionController:
        """The controller, if the operator takes calls now; else the reason it does not."""
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

    def _ready_to_admit(self) -> None:
        """As `_ready`; a record from outside the operator's records is refused too once a
        clean exit of `async with` has begun (its drain might not wait for the record)."""
        self._ready()
        if self._exiting and self._own_record() is None:
            raise InvalidStateError(
                f"{self!r} is closing: its `async with` block has ended, and a record given "
                "now would not be processed; feed records inside the block")

    def _own_record(self) -> RecordContext | None:
        """The record of this operator whose code is running, if any."""
        ctx = current_context()
        return ctx if ctx is not None and ctx.operator is self and not ctx.finished else None

    def _ready_to_wait(self, call: str) -> AsyncExecutionController:
        """`_ready()`, for a call that waits for records to finish: from inside one of this
        operator's records it would wait for that record itself, so it raises instead."""
        controller = self._ready()
        ctx = self._own_record()
        if ctx is not None:
            raise InvalidStateError(
                f"{call} called from inside a record of this operator (key {ctx.key!r}): it "
                "waits for every earlier record to finish, this one included, so it would "
                "never return; call it from the code that feeds the operator")
        return controller

    # -- records ---------------------------------------------------------------------------

    async def process(self, record: Any) -> None:
        """Admit one record, waiting while `max_in_flight` records are in flight, or while
        a store with I/O slots has its slots' full batches and one more to work on.

        Returns once the record is admitted, not once it is processed. Called from inside
        one of this operator's records, it admits at once, even beyond `max_in_flight`:
        waiting there could wait for the calling record itself.
        """
        self._ready_to_admit()
        gate = self._gate
        assert self._records is not None and gate is not None
        ctx = self._records.prepare(record)
        if not gate.try_admit(ctx):
            await gate.admit(ctx, overdraft=self._own_record() is not None)

    def emit(self, value: Any) -> None:
        """Collect an emitted value (called through a record's ctx)."""
        self._outputs.append(value)

    def timer_service_for(self, ctx: RecordContext) -> TimerServiceView:
        """The timer service of `ctx`'s key (what `ctx.timer_service` returns)."""
        return TimerServiceView(self._started(self._timers), ctx)

    def timer_namespace_for(self, ctx: RecordContext) -> Any:
        """The namespace of the timer `ctx` fires (what `ctx.timer_namespace` returns)."""
        return timer_namespace(ctx)

    def outputs(self) -> list[Any]:
        """Return and clear the values emitted so far, in emission order."""
        out = self._outputs[:]
        self._outputs.clear()
        return out

    # -- progress --------------------------------------------------------------------------

    async def drain(self) -> None:
        """Wait until no record is in flight and the store has applied every write, those
        a write-back state cache held back included (partial batches are sent at once)."""
        controller = self._ready_to_wait("drain()")
        gate = self._gate
        assert gate is not None
        await controller.wait_until(lambda: gate.in_flight == 0 and controller.writes_applied())

    async def advance_watermark(self, timestamp: object) -> None:
        """Advance event time; returns after every earlier record has finished and every
        timer it fired has completed."""
        self._ready_to_wait("advance_watermark()")
        await self._started(self._progress).advance_watermark(timestamp)

    async def advance_processing_time(self, timestamp: object) -> None:
        """Set the ManualClock to `timestamp`; returns after every earlier record finished
        and every timer it fired has completed."""
        self._ready_to_wait("advance_processing_time()")
        await self._started(self._progress).advance_processing_time(timestamp)

    def current_watermark(self) -> int:
        """The current event-time watermark (-2**63 before the first)."""
        return self._progress.watermark if self._progress is not None else MIN_WATERMARK

    # -- checkpoints -----------------------------------------------------------------------

    async def snapshot(self, directory: str | os.PathLike[str], checkpoint_id: object) -> str:
        """Drain, then write this operator's part of checkpoint `checkpoint_id` under
        `directory`; returns the checkpoint's path (the same for every operator).

        Records that other tasks feed meanwhile wait in `process()` until the part is
        written, as records behind a checkpoint barrier do: the drain ends even under
        steady input, and the part holds exactly the records admitted before the call."""
        self._ready_to_wait("snapshot()")
        return await checkpointing.snapshot(
            self._started(self._capabilities), self._started(self._gate), self.drain,
            directory, checkpoint_id, parallelism=self.parallelism,
            operator_index=self.operator_index, max_parallelism=self.config.max_parallelism,
            operator_state=self.runtime_context.operator_state_snapshot,
            extra_sections=self._started(self._timers).snapshot_sections)

    # -- introspection ---------------------------------------------------------------------

    @property
    def metrics(self) -> dict[str, Any]:
        """Counters, gauges and histograms of this operator (`asyncstate.operator.metrics`
        lists them; docs/metrics.md explains them)."""
        caches = self._capabilities.caches if self._capabilities is not None else ()
        return operator_metrics(self._controller, self._gate, caches)

    def measure_occupancy(self) -> Occupancy:
        """Start integrating the records admitted and not finished over time (while running;
        two clock readings per record from now on): `mean()` of the result is their
        time-weighted mean, for Little's law (see `asyncstate.runtime.occupancy`)."""
        return measure_occupancy(self._started(self._gate), self._started(self._controller))

    def _started(self, part: _P | None) -> _P:
        if part is None:
            raise InvalidStateError(f"{self!r} has not been started")
        return part

    @property
    def controller(self) -> AsyncExecutionController:
        """The operator's controller (while running)."""
        return self._started(self._controller)

    @property
    def ttl_timers(self) -> TtlTimers:
        """The cleanup timers of the operator's TTL states (while running)."""
        return self._started(self._ttl_timers)

    @property
    def admission(self) -> AdmissionGate:
        """The operator's admission gate (while running)."""
        return self._started(self._gate)

    @property
    def records(self) -> RecordRunner:
        """The operator's record runner (while running)."""
        return self._started(self._records)
