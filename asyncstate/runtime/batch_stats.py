"""BatchStats: what a controller's batches looked like, measured once per batch.

The controller reports each batch when it sends it (`sent`) and when its executor delivers
it (`delivered`, or `dropped` when it failed or the controller closed). Kept: a histogram of
batch sizes, a histogram of the time each request spent in the executor (its batch's round
trip, counted once per request, in microseconds), and a `controller.slow_batch` warning for
a round trip of at least `slow_batch_seconds` (`asyncstate.logging.configure`).
"""

from __future__ import annotations

import time
from typing import Any, Final

from asyncstate.histogram import Histogram
from asyncstate.log import get_logger, slow_batch_seconds

__all__ = ["BatchStats"]

log = get_logger("asyncstate.controller")

_perf_counter: Final = time.perf_counter  # compiled: Final alias


class BatchStats:
    """Batch sizes and round trips of one controller (see the module docstring)."""

    __slots__ = ("_sent_at", "_slow_s", "batch_sizes", "request_latency_us", "slow_batches")

    def __init__(self) -> None:
        self.batch_sizes = Histogram()
        self.request_latency_us = Histogram()
        self.slow_batches = 0
        self._sent_at: dict[int, float] = {}
        self._slow_s = slow_batch_seconds()

    def __repr__(self) -> str:
        return (f"<BatchStats batches={self.batch_sizes.count} "
                f"under_way={len(self._sent_at)} slow={self.slow_batches}>")

    def sent(self, batch: list[Any]) -> None:
        """`batch` goes to the executor now."""
        self.batch_sizes.record(len(batch))
        self._sent_at[id(batch)] = _perf_counter()

    def delivered(self, batch: list[Any]) -> None:
        """The executor delivered `batch`'s results."""
        sent = self._sent_at.pop(id(batch), None)
        if sent is None:
            return
        seconds = _perf_counter() - sent
        n = len(batch)
        self.request_latency_us.record(int(seconds * 1e6), n)
        if seconds >= self._slow_s:
            self.slow_batches += 1
            log.warning("controller.slow_batch", requests=n, seconds=round(seconds, 6),
                        threshold_seconds=self._slow_s)

    def dropped(self, batch: list[Any]) -> None:
        """`batch` failed, or will never be delivered."""
        self._sent_at.pop(id(batch), None)

    def clear(self) -> None:
        """Forget the batches under way (the controller closed)."""
        self._sent_at.clear()
