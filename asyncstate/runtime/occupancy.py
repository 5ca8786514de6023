"""Occupancy: a count integrated over time, exactly, at every change (record-seconds).

An operator measuring its occupancy (`KeyedOperator.measure_occupancy`) steps it up when it
admits a record and down when a record finishes (timer firings are not counted), so `mean()` is the
time-weighted mean number of records admitted and not finished: by Little's law, that mean
equals throughput x mean latency, which is how experiments check their latency figures. It
costs two clock readings per record, so it is off unless asked for.
"""

from __future__ import annotations

import time
from typing import Final

__all__ = ["Occupancy"]

_perf_counter: Final = time.perf_counter  # compiled: Final alias


class Occupancy:
    """The integral of a count over time since `started` (a perf_counter value)."""

    __slots__ = ("area", "count", "last", "started")

    def __init__(self, count: int = 0) -> None:
        self.count = count
        self.started = self.last = _perf_counter()
        self.area = 0.0

    def __repr__(self) -> str:
        return f"<Occupancy count={self.count} mean={self.mean():.1f}>"

    def step(self, delta: int) -> None:
        """The count changes by `delta` now."""
        now = _perf_counter()
        self.area += self.count * (now - self.last)
        self.last = now
        self.count += delta

    def restart(self) -> None:
        """Integrate from now on (the count stays)."""
        self.started = self.last = _perf_counter()
        self.area = 0.0

    def mean(self) -> float:
        """The time-weighted mean count since `started` (the current count at first)."""
        now = _perf_counter()
        span = now - self.started
        if span <= 0:
            return float(self.count)
        return (self.area + self.count * (now - self.last)) / span
