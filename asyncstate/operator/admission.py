"""AdmissionGate: back-pressure in front of the inbox.

A record is admitted while fewer than `max_in_flight` records are waiting in the inbox or in
flight, while the store is not backlogged (a `PacedExecutor` whose I/O slots have their full
batches and one more: `AsyncExecutionController.store_backlogged`), and while no snapshot
holds the gate; otherwise the producer waits. `process()` and `run()` pass every record
through the same gate. The gate counts what it admitted, the peak of records waiting or in
flight, and the time producers waited.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from asyncstate.operator.inbox import Inbox
from asyncstate.runtime.context import RecordContext
from asyncstate.runtime.controller import AsyncExecutionController
from asyncstate.runtime.occupancy import Occupancy

__all__ = ["AdmissionGate"]


class AdmissionGate:
    """Admits records into an inbox, at most `limit` waiting or in flight (see module doc).

    `ready()` is called after every wait: it raises when the operator may no longer take
    records from outside (it failed or closed meanwhile, or its clean exit began).
    """

    __slots__ = ("_blocked_lock", "_blocked_since", "_blocked_total", "_controller", "_holds",
                 "_inbox", "_limit", "_ready", "_released", "_waiting", "occupancy", "peak",
                 "records_in")

    def __init__(self, controller: AsyncExecutionController, inbox: Inbox, limit: int,
                 ready: Callable[[], object]) -> None:
        self._controller = controller
        self._inbox = inbox
        self._limit = limit
        self._ready = ready
        self._holds = 0
        self._released: list[asyncio.Future[None]] = []
        self.records_in = 0
        self.peak = 0
        # Time during which at least one producer waited: `_waiting` producers wait now,
        # the first of them since `_blocked_since`. The lock keeps a reading from another
        # thread (a metrics scrape) consistent with a wait ending meanwhile, so that the
        # figure never goes back.
        self._blocked_total = 0.0
        self._waiting = 0
        self._blocked_since = 0.0
        self._blocked_lock = threading.Lock()
        # When measured (KeyedOperator.measure_occupancy): stepped up per admitted record.
        self.occupancy: Occupancy | None = None

    def __repr__(self) -> str:
        return (f"<AdmissionGate in_flight={self.in_flight}/{self._limit} "
                f"holds={self._holds}>")

    @property
    def blocked_seconds(self) -> float:
        """Wall time during which at least one producer waited for room (or for a snapshot),
        the wait under way included: producers waiting together count once."""
        with self._blocked_lock:
            if self._waiting:
                return self._blocked_total + (time.perf_counter() - self._blocked_since)
            return self._blocked_total

    @property
    def in_flight(self) -> int:
        """Records admitted and not finished: waiting in the inbox or in flight."""
        return self._inbox.queued + self._controller.in_flight_record_num

    def try_admit(self, ctx: RecordContext) -> bool:
        """Admit `ctx` now if there is room; False (nothing done) otherwise."""
        if self._holds or not self.has_room():
            return False
        self._admit(ctx)
        return True

    async def admit(self, ctx: RecordContext, *, overdraft: bool = False) -> None:
        """Admit `ctx`, waiting while there is no room. With `overdraft` it is admitted at
        once, beyond the limit and past a snapshot (a record of this operator feeding it:
        waiting could wait for that record itself)."""
        # A loop: producers woken together re-check, so only as many as fit are admitted,
        # and none while a snapshot is under way (one may start while this one waits).
        while not overdraft and not self.try_admit(ctx):
            with self._blocked_lock:
                if not self._waiting:
                    self._blocked_since = time.perf_counter()
                self._waiting += 1
            try:
                if self._holds:
                    await self._wait_released()
                else:
                    await self._controller.wait_until(self.has_room)
                # The operator may no longer take records (it failed, closed, or its clean
                # exit began while this producer waited).
                self._ready()
            finally:
                with self._blocked_lock:
                    self._waiting -= 1
                    if not self._waiting:
                        self._blocked_total += time.perf_counter() - self._blocked_since
        if overdraft:
            self._admit(ctx)

    def has_room(self) -> bool:
        """True while a record would be admitted now, snapshots aside: fewer than the limit
        waiting or in flight, and the store not backlogged."""
        queued = self._inbox.queued
        controller = self._controller
        return queued + controller.in_flight_record_num < self._limit \
            and not controller.store_backlogged(queued)

    def _admit(self, ctx: RecordContext) -> None:
        self.records_in += 1
        occupancy = self.occupancy
        if occupancy is not None:
            occupancy.step(1)
        inbox = self._inbox
        inbox.post_record(ctx)
        in_flight = inbox.queued + self._controller.in_flight_record_num
        if in_flight > self.peak:
            self.peak = in_flight

    # -- holding the gate (snapshots) -----------------------------------------------------

    def hold(self) -> None:
        """Admit nothing until every hold is released."""
        self._holds += 1

    def release(self) -> None:
        """Release one hold; the last one wakes the waiting producers."""
        self._holds -= 1
        if not self._holds:
            waiting, self._released = self._released, []
            for fut in waiting:
                if not fut.done():
                    fut.set_result(None)

    async def _wait_released(self) -> None:
        while self._holds:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._released.append(fut)
            await fut
