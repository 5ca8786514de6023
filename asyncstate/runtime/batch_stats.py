"""BatchStats: what a controller's batches looked like, measured once per batch.

The controller reports each batch when it sends it (`sent`) and when its executor delivers
it (`delivered`, or `dropped` when it failed or the controller closed). Kept: a histogram of
batch sizes, a histogram of the time each request spent in the executor (its batch's round
trip, counted once per request, in microseconds), and a `controller.slow_batch` warning for
a round trip of at least `slow_batch_seconds` (`asyncstate.logging.configure`).

A batch still under way when its round trip reaches the threshold is reported then, by a
loop timer armed for the oldest batch not yet reported (one timer at a time), so that a store
call that never returns is reported too; it is counted once, and its delivery is logged at
info level with the whole round trip.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any, Final

from asyncstate.histogram import Histogram
from asyncstate.log import get_logger, slow_batch_seconds

__all__ = ["BatchStats"]

log = get_logger("asyncstate.controller")

_perf_counter: Final = time.perf_counter  # compiled: Final alias
_POW2_BUCKETS: Final = 32  # the last counts every batch of more than 2**30 requests


class BatchStats:
    """Batch sizes and round trips of one controller (see the module docstring)."""

    __slots__ = ("_loop", "_reported", "_sent_at", "_slow_s", "_watch", "batch_sizes",
                 "batch_sizes_pow2", "request_latency_us", "slow_batches")

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.batch_sizes = Histogram()
        # Exact counts for power-of-two bounds (Prometheus buckets): index i counts the
        # batches of 2**(i-1) + 1 .. 2**i requests (index 0: one request).
        self.batch_sizes_pow2 = [0] * _POW2_BUCKETS
        self.request_latency_us = Histogram()
        self.slow_batches = 0
        # Batches under way, in the order they were sent: id -> (perf_counter at sending,
        # number of requests).
        self._sent_at: dict[int, tuple[float, int]] = {}
        self._slow_s = slow_batch_seconds()
        # The loop that reports batches still under way (None: only at delivery; so with a
        # threshold of 0, which every delivered batch reaches, or none).
        slow = self._slow_s
        self._loop = loop if 0 < slow < math.inf else None
        self._watch: asyncio.TimerHandle | None = None
        self._reported: set[int] = set()  # batches reported while under way

    def __repr__(self) -> str:
        return (f"<BatchStats batches={self.batch_sizes.count} "
                f"under_way={len(self._sent_at)} slow={self.slow_batches}>")

    def sent(self, batch: list[Any]) -> None:
        """`batch` goes to the executor now."""
        n = len(batch)
        self.batch_sizes.record(n)
        i = (n - 1).bit_length()
        self.batch_sizes_pow2[i if i < _POW2_BUCKETS else _POW2_BUCKETS - 1] += 1
        self._sent_at[id(batch)] = (_perf_counter(), n)
        if self._watch is None and self._loop is not None:
            self._watch = self._loop.call_later(self._slow_s, self._check_under_way)

    def _check_under_way(self) -> None:
        """Report the batches under way whose round trip reached the threshold, and arm the
        timer for the next one to reach it."""
        self._watch = None
        now = _perf_counter()
        slow = self._slow_s
        reported = self._reported
        for key, (sent, n) in self._sent_at.items():
            if key in reported:
                continue
            waited = now - sent
            if waited < slow:
                loop = self._loop
                if loop is not None:
                    self._watch = loop.call_later(slow - waited, self._check_under_way)
                return
            reported.add(key)
            self.slow_batches += 1
            log.warning("controller.slow_batch", requests=n, seconds=round(waited, 6),
                        threshold_seconds=slow, under_way=True)

    def delivered(self, batch: list[Any]) -> None:
        """The executor delivered `batch`'s results."""
        under_way = self._sent_at.pop(id(batch), None)
        if under_way is None:
            return
        seconds = _perf_counter() - under_way[0]
        n = len(batch)
        self.request_latency_us.record(int(seconds * 1e6), n)
        if self._reported and id(batch) in self._reported:
            self._reported.discard(id(batch))
            log.info("controller.slow_batch_delivered", requests=n,
                     seconds=round(seconds, 6))
        elif seconds >= self._slow_s:
            self.slow_batches += 1
            log.warning("controller.slow_batch", requests=n, seconds=round(seconds, 6),
                        threshold_seconds=self._slow_s)

    def dropped(self, batch: list[Any]) -> None:
        """`batch` failed, or will never be delivered."""
        self._sent_at.pop(id(batch), None)
        self._reported.discard(id(batch))

    def clear(self) -> None:
        """Forget the batches under way (the controller closed)."""
        self._sent_at.clear()
        self._reported.clear()
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
