"""Event time and processing time of an operator, and the seam where due timers fire.

Advancing the watermark (or a ManualClock's processing time) is a barrier in the inbox: it
closes the open epoch after every record admitted before it; its action runs once every
earlier record has finished; the timers it starts (each a sync point under its key) join the
finishing epoch, so the advance returns only after they and their state work have finished
too, and records admitted after it start only then.

`open_timers` builds the timer service those advances fire and connects it to the parts
that use it: the record runner starts its firings, the TTL cleanup timers register in it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final, Protocol

from asyncstate.backends.base import TimerStoreBackend
from asyncstate.clock import Clock, ManualClock
from asyncstate.errors import ConfigError, InvalidStateError
from asyncstate.keygroups import KeyGroupRange
from asyncstate.operator.arguments import check_timestamp
from asyncstate.operator.inbox import Inbox
from asyncstate.operator.records import RecordRunner
from asyncstate.runtime.controller import AsyncExecutionController
from asyncstate.state.ttl.timers import TtlTimers
from asyncstate.timers.service import TimerService, timer_queue

__all__ = ["MAX_WATERMARK", "MIN_WATERMARK", "DueTimers", "TimeProgress", "open_timers"]

MIN_WATERMARK: Final = -(2**63)
MAX_WATERMARK: Final = 2**63 - 1


class DueTimers(Protocol):
    """What fires timers when time advances (the timer service)."""

    def fire_event_time(self, watermark: int) -> None:
        """Start every event-time timer due at `watermark`, in timestamp order."""

    def fire_processing_time(self, now: int) -> None:
        """Start every processing-time timer due at `now`, in timestamp order."""


class TimeProgress:
    """The watermark and processing-time advances of one operator."""

    __slots__ = ("_clock", "_controller", "_inbox", "_processing_time", "timers", "watermark")

    def __init__(self, controller: AsyncExecutionController, inbox: Inbox,
                 clock: Clock) -> None:
        self._controller = controller
        self._inbox = inbox
        self._clock = clock
        self._processing_time = MIN_WATERMARK  # the latest advance asked for
        self.watermark = MIN_WATERMARK
        self.timers: DueTimers | None = None

    def __repr__(self) -> str:
        return f"<TimeProgress watermark={self.watermark}>"

    async def advance_watermark(self, timestamp: object) -> None:
        """Advance event time to `timestamp` (a lower one changes nothing) once every
        earlier record has finished; returns after the timers it fired have finished."""
        watermark = check_timestamp("watermark", timestamp)

        def action() -> None:
            if watermark > self.watermark:
                self.watermark = watermark
            # Also timers that records registered behind the watermark since the last
            # advance: they fire at the next one, whatever its timestamp.
            if self.timers is not None:
                self.timers.fire_event_time(self.watermark)

        await self._advance(action)

    async def advance_processing_time(self, now: object) -> None:
        """Once every earlier record has finished, set the ManualClock to `now` and fire the
        processing-time timers due; returns after they finished. Records admitted before the
        call see the earlier time, records admitted after it the new one."""
        clock = self._clock
        if not isinstance(clock, ManualClock):
            raise InvalidStateError(
                "advance_processing_time() needs the operator to run on an ast.ManualClock "
                f"(clock=ast.ManualClock()), not {type(clock).__name__}")
        time = check_timestamp("processing time", now)
        if time < max(clock.now_ms(), self._processing_time):
            raise ConfigError("processing time", time,
                              f">= {max(clock.now_ms(), self._processing_time)}: the clock "
                              "never goes backwards")
        self._processing_time = time

        def action() -> None:
            clock.set(max(time, clock.now_ms()))
            if self.timers is not None:
                self.timers.fire_processing_time(clock.now_ms())

        await self._advance(action)

    async def _advance(self, action: Callable[[], None]) -> None:
        done = [False]
        epochs = self._controller.epoch_manager

        def start(release: Callable[[], None]) -> None:
            def finished() -> None:
                done[0] = True
                release()

            epochs.on_non_record(action, finished)

        self._inbox.post_barrier(start)
        await self._controller.wait_until(lambda: done[0])


def open_timers(progress: TimeProgress, records: RecordRunner, ttl_timers: TtlTimers, *,
                place: TimerStoreBackend | None, key_groups: KeyGroupRange,
                max_parallelism: int, clock: Clock, function: object) -> TimerService:
    """Build an operator's timer service on the running loop, its queues in `place` (in
    memory when None), and connect it to `progress`, `records` and `ttl_timers`; the
    service refuses the timers of a `function` without on_timer. Called once the backend
    holds no old state (after a restore discarded it)."""
    timers = TimerService(
        timer_queue(None if place is None else place.timer_store("event"),
                    key_groups, max_parallelism),
        timer_queue(None if place is None else place.timer_store("processing"),
                    key_groups, max_parallelism),
        make_context=records.timer_context, start=records.start_timer,
        watermark=lambda: progress.watermark, clock=clock, loop=asyncio.get_running_loop(),
        owner=None if callable(getattr(function, "on_timer", None))
        else type(function).__name__)
    progress.timers = timers
    records.timers = timers
    ttl_timers.attach(timers)
    return timers
