"""Clocks: processing time in milliseconds (wall time, or manual for tests)."""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable

from asyncstate.errors import ConfigError

__all__ = ["Clock", "ManualClock", "SystemClock"]


@runtime_checkable
class Clock(Protocol):
    """Processing time source; TTL and processing-time timers read it."""

    def now_ms(self) -> int:
        """Current processing time in milliseconds."""


class SystemClock:
    """Wall-clock time in milliseconds (the default)."""

    __slots__ = ()

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def __repr__(self) -> str:
        return "SystemClock()"


class ManualClock:
    """A clock that moves only when told to: `advance(ms)` and `set(ms)`, never backwards."""

    __slots__ = ("_now",)

    def __init__(self, start_ms: int = 0) -> None:
        if type(start_ms) is not int:
            raise ConfigError("start_ms", start_ms, "an int (milliseconds)")
        self._now = start_ms

    def __repr__(self) -> str:
        return f"ManualClock(now_ms={self._now})"

    def now_ms(self) -> int:
        return self._now

    def advance(self, ms: int) -> None:
        """Move the clock forward by `ms` milliseconds (>= 0)."""
        if type(ms) is not int or ms < 0:
            raise ConfigError("ms", ms, "a non-negative int: the clock never goes backwards")
        self._now += ms

    def set(self, ms: int) -> None:
        """Set the clock to `ms`, which must not be earlier than now."""
        if type(ms) is not int:
            raise ConfigError("ms", ms, "an int (milliseconds)")
        if ms < self._now:
            raise ConfigError("ms", ms, f">= the current time {self._now}: the clock never "
                                        "goes backwards")
        self._now = ms
