"""RecordWatchdog: fails the operator when a record runs longer than record_timeout_ms.

A record's time runs from the moment it holds its key (the controller notes it) until it
finishes; records waiting for their key or for capacity have not started. The watchdog
looks at the records holding keys every quarter of the timeout (at most once a second), so
an overdue record is reported between 1x and 1.25x the timeout after it started.
"""

from __future__ import annotations

import asyncio
import time

from asyncstate.errors import RecordTimeoutError
from asyncstate.runtime.controller import AsyncExecutionController

__all__ = ["RecordWatchdog"]

_MAX_PERIOD_S = 1.0


class RecordWatchdog:
    """Checks the records of `controller` for overrunning `timeout_ms` until stopped."""

    __slots__ = ("_controller", "_handle", "_loop", "_period", "_timeout_ms")

    def __init__(self, loop: asyncio.AbstractEventLoop, controller: AsyncExecutionController,
                 timeout_ms: int) -> None:
        self._loop = loop
        self._controller = controller
        self._timeout_ms = timeout_ms
        self._period = min(timeout_ms / 4000.0, _MAX_PERIOD_S)
        self._handle: asyncio.TimerHandle | None = None

    def __repr__(self) -> str:
        return f"<RecordWatchdog timeout_ms={self._timeout_ms}>"

    def start(self) -> None:
        """Begin checking."""
        self._handle = self._loop.call_later(self._period, self._check)

    def stop(self) -> None:
        """Stop checking."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _check(self) -> None:
        controller = self._controller
        if controller.failure is not None:
            self._handle = None
            return
        now = time.monotonic()
        ctx = controller.overdue_context(now - self._timeout_ms / 1000.0)
        if ctx is not None:
            self._handle = None
            controller.fail(RecordTimeoutError(
                ctx.key, self._timeout_ms, round((now - ctx.started_at) * 1000)))
            return
        self._handle = self._loop.call_later(self._period, self._check)
