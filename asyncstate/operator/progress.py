"""Event time and processing time of an operator, and the seam where due timers fire.

Advancing the watermark (or a ManualClock's processing time) is an event that goes through
the inbox, after every record admitted before it, and closes the open epoch: its action runs
once every earlier record has finished; the timers it starts (each a sync point under its
key) join the finishing epoch, so the advance returns only after they and their state work
have finished too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, Protocol

from asyncstate.clock import Clock, ManualClock
from asyncstate.errors import InvalidStateError
from asyncstate.operator.arguments import check_timestamp
from asyncstate.operator.inbox import Inbox
from asyncstate.runtime.controller import AsyncExecutionController

__all__ = ["MAX_WATERMARK", "MIN_WATERMARK", "DueTimers", "TimeProgress"]

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

    __slots__ = ("_clock", "_controller", "_inbox", "timers", "watermark")

    def __init__(self, controller: AsyncExecutionController, inbox: Inbox,
                 clock: Clock) -> None:
        self._controller = controller
        self._inbox = inbox
        self._clock = clock
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
                if self.timers is not None:
                    self.timers.fire_event_time(watermark)

        await self._advance(action)

    async def advance_processing_time(self, now: object) -> None:
        """Set the ManualClock to `now`, then fire the processing-time timers due at `now`
        once every earlier record has finished; returns after they finished."""
        clock = self._clock
        if not isinstance(clock, ManualClock):
            raise InvalidStateError(
                "advance_processing_time() needs the operator to run on an ast.ManualClock "
                f"(clock=ast.ManualClock()), not {type(clock).__name__}")
        time = check_timestamp("processing time", now)
        clock.set(time)

        def action() -> None:
            if self.timers is not None:
                self.timers.fire_processing_time(time)

        await self._advance(action)

    async def _advance(self, action: Callable[[], None]) -> None:
        done = [False]

        def finished() -> None:
            done[0] = True

        epochs = self._controller.epoch_manager
        self._inbox.post_event(lambda: epochs.on_non_record(action, finished))
        await self._controller.wait_until(lambda: done[0])
