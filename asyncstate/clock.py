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


# A time in milliseconds is a signed 64-bit integer, as Flink's (and the stored timestamps).
_MIN_MS = -(2**63)
_MAX_MS = 2**63 - 1
_IN_RANGE = "an int of milliseconds in [-2**63, 2**63 - 1]"


class ManualClock:
    """A clock that moves only when told to: `advance(ms)` and `set(ms)`, never backwards,
    never past 2**63 - 1."""

    __slots__ = ("_now",)

    def __init__(self, start_ms: int = 0) -> None:
        if type(start_ms) is not int or not _MIN_MS <= start_ms <= _MAX_MS:
            raise ConfigError("start_ms", start_ms, _IN_RANGE)
        self._now = start_ms

    def __repr__(self) -> str:
        return f"ManualClock(now_ms={self._now})"

    def now_ms(self) -> int:
        return self._now

    def advance(self, ms: int) -> None:
        """Move the clock forward by `ms` milliseconds (>= 0)."""
        if type(ms) is not int or ms < 0:
            raise ConfigError("ms", ms, "a non-negative int: the clock never goes backwards")
        if ms > _MAX_MS - self._now:
            raise ConfigError("ms", ms, f"at most {_MAX_MS - self._now}: the clock would pass "
                                        f"2**63 - 1 ms from {self._now}")
        self._now += ms

    def set(self, ms: int) -> None:
        """Set the clock to `ms`, which must not be earlier than now."""
        if type(ms) is not int or not _MIN_MS <= ms <= _MAX_MS:
            raise ConfigError("ms", ms, _IN_RANGE)
        if ms < self._now:
            raise ConfigError("ms", ms, f">= the current time {self._now}: the clock never "
                                        "goes backwards")
        self._now = ms
