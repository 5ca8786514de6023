"""Shared harness for controller tests: a ManualExecutor-driven controller and Flink's "U".

Mirrors the vocabulary of FLINK_AEC_REFERENCE.md §5: `new_record(r, k)` builds a context and
makes it current, `u()` is the standard user code (read a counter, write n = v + 1, output
n), `trig()` force-triggers one batch and completes it.
"""

from __future__ import annotations

import asyncio
import random
import sys
from collections.abc import Callable
from typing import Any

from shared_functions import FakeState

from asyncstate import AsyncExecutionController, StateRequestType, completed_future
from asyncstate.backends.heap import _table_key
from asyncstate.runtime.buffer import TimeoutScheduler
from asyncstate.runtime.context import RecordContext
from asyncstate.runtime.future import StateFuture
from asyncstate.serde import NONE_BYTES, canonical_key
from asyncstate.testing import ManualExecutor

GET = StateRequestType.VALUE_GET
UPDATE = StateRequestType.VALUE_UPDATE


class Harness:
    """A controller over a ManualExecutor with one value state, and an output list."""

    def __init__(self, *, batch_size: int = 100, max_in_flight: int = 1000,
                 buffer_timeout_ms: int = 0, timeout_scheduler: TimeoutScheduler | None = None,
                 rng: random.Random | None = None, max_parallelism: int = 128) -> None:
        self.executor = ManualExecutor(rng)
        self.aec = AsyncExecutionController(
            self.executor, batch_size=batch_size, buffer_timeout_ms=buffer_timeout_ms,
            max_in_flight=max_in_flight, max_parallelism=max_parallelism,
            timeout_scheduler=timeout_scheduler)
        self.state = FakeState.register(self.executor, "value")
        self.out: list[Any] = []
        self.peak = 0

    def new_record(self, record: Any, key: Any) -> RecordContext:
        ctx = self.aec.build_context(record, key)
        self.aec.set_current_context(ctx)
        return ctx

    def get(self) -> StateFuture[Any]:
        return self.aec.handle_request(self.state, GET, None)

    def u(self, on_output: Callable[[int], Any] | None = None) -> StateFuture[None]:
        """Flink's U: read v, write n = (1 if v is None else v + 1), then output n."""
        aec, state = self.aec, self.state
        emit = self.out.append if on_output is None else on_output

        def increment(v: int | None) -> StateFuture[int]:
            n = 1 if v is None else v + 1
            return aec.handle_request(state, UPDATE, n).then_compose(
                lambda _: completed_future(n))

        return aec.handle_request(state, GET, None).then_compose(increment).then_accept(emit)

    def trig(self) -> None:
        """Force-trigger one batch and complete it (Flink's trig with a SyncExecutor)."""
        assert self.aec.trigger_if_needed(True), "nothing to trigger"
        assert self.executor.pending_batch_num == 1
        self.executor.complete_next_batch()
        self.sample()

    def sample(self) -> None:
        """Track the in-flight peak as the test goes."""
        self.peak = max(self.peak, self.aec.in_flight_record_num)

    def gauges(self) -> dict[str, int]:
        aec = self.aec
        return {
            "in_flight": aec.in_flight_record_num,
            "active": aec.active_queue_size,
            "blocking": aec.blocking_queue_size,
            "blocking_keys": aec.blocking_key_num,
            "occupied": aec.occupied_key_num,
        }

    def stored(self, key: Any, namespace: bytes = NONE_BYTES) -> Any:
        """The value the store holds for `key` (default namespace)."""
        return self.state.handle.get(_table_key(canonical_key(key), namespace))

    def drive_to_completion(self, limit: int = 100_000) -> None:
        """Complete pending batches and flush the active queue until nothing is left."""
        for _ in range(limit):
            self.sample()
            if self.executor.pending_batch_num:
                self.executor.complete_next_batch()
            elif not self.aec.trigger_if_needed(True):
                return
        raise AssertionError("the controller did not quiesce")


def gauges(in_flight: int, active: int, blocking: int, blocking_keys: int,
           occupied: int) -> dict[str, int]:
    return {"in_flight": in_flight, "active": active, "blocking": blocking,
            "blocking_keys": blocking_keys, "occupied": occupied}


def stack_depth() -> int:
    """Frames on the current stack (cheap, unlike inspect.stack())."""
    depth = 0
    frame: Any = sys._getframe()
    while frame is not None:
        depth += 1
        frame = frame.f_back
    return depth


async def settle(h: Harness | None = None, *, quiet_rounds: int = 3,
                 max_rounds: int = 10_000) -> None:
    """Let the loop run until nothing observable changes for a few rounds."""
    def signature() -> tuple[Any, ...]:
        if h is None:
            return ()
        aec, ex = h.aec, h.executor
        return (aec.in_flight_record_num, aec.active_queue_size, aec.blocking_queue_size,
                aec.occupied_key_num, ex.pending_batch_num, ex.delivered_batches,
                len(ex.executed_requests), len(h.out))

    last = signature()
    quiet = 0
    for _ in range(max_rounds):
        await asyncio.sleep(0)
        if h is not None:
            h.sample()
        now = signature()
        if now == last:
            quiet += 1
            if quiet >= quiet_rounds:
                return
        else:
            quiet = 0
            last = now
    raise AssertionError("the loop did not settle")
