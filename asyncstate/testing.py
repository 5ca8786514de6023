"""Test doubles for code built on asyncstate: a manual clock, executor and timeout scheduler.

Everything here is deterministic and moves only when the test says so:

- `ManualClock`: processing time that advances on `advance(ms)` / `set(ms)`.
- `ManualExecutor`: a `StateExecutor` that holds every batch until the test completes it
  (`complete_next_batch()`, `complete_batch(i)`, `complete_random_batch()`,
  `complete_all()`) or fails it (`fail_next_batch(exc)`). It applies each batch to an
  in-memory `HeapBackend` when the batch is *triggered*, in trigger order, and only delays
  the delivery of the results, so batches may be completed in any order without breaking
  read-your-writes for a key (the same promise every real executor makes).
- `ManualScheduler`: a timeout scheduler (the `call_later` seam of the controller) whose
  callbacks run only on `advance(seconds)` / `fire_due()`.

Without a running event loop the controller runs all work inline, so completing a batch runs
its callbacks before `complete_next_batch()` returns. Inside a running loop, work posted from
a Task runs from a loop callback: let the loop run (``await asyncio.sleep(0)``) afterwards.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from asyncstate.backends.base import ExecutorBinding
from asyncstate.backends.heap import HeapBackend
from asyncstate.clock import ManualClock
from asyncstate.errors import InvalidStateError
from asyncstate.runtime.requests import StateKind, StateRequest

if TYPE_CHECKING:
    from asyncstate.runtime.buffer import TimeoutScheduler

__all__ = ["ManualClock", "ManualExecutor", "ManualScheduler", "ManualTimerHandle"]


class _Batch:
    """One triggered batch: its requests and what the heap answered at trigger time."""

    __slots__ = ("error", "requests", "results")

    def __init__(self, requests: list[StateRequest], results: list[Any] | None,
                 error: Exception | None) -> None:
        self.requests = requests
        self.results = results
        self.error = error


class ManualExecutor:
    """A `StateExecutor` whose batches complete only when the test says so.

    Each batch is applied to an internal `HeapBackend` when the controller triggers it
    (requests in issue order, batches in trigger order) and kept in `pending_batches` until
    the test delivers it. Delivery calls the controller's `deliver(batch, results, error)`
    from the calling thread. `rng` picks the batch for `complete_random_batch()` (default:
    `random.Random(0)`, so a test without a seed is still deterministic).

    A request the heap cannot execute makes its whole batch fail when delivered. A batch
    failed with `fail_next_batch` keeps its effects on the store: like a remote store that
    applied the writes and lost the reply.
    """

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng if rng is not None else random.Random(0)
        self.store = HeapBackend()
        """The in-memory store batches are applied to (inspect it in assertions)."""
        self.executed_requests: list[StateRequest] = []
        """Every request applied so far, in trigger (and issue) order."""
        self.delivered_batches = 0
        """Number of batches delivered (completed or failed)."""
        self.closed = False
        self._batches: list[_Batch] = []
        self._binding: ExecutorBinding | None = None

    def __repr__(self) -> str:
        return (f"<ManualExecutor pending_batches={len(self._batches)} "
                f"executed_requests={len(self.executed_requests)} "
                f"delivered_batches={self.delivered_batches}>")

    # -- StateExecutor -------------------------------------------------------------------

    def open(self, binding: ExecutorBinding) -> None:
        """Bind to a controller (called by its constructor)."""
        if self._binding is not None:
            raise InvalidStateError(
                "this ManualExecutor is already bound to a controller; create one per controller")
        self.store.open(binding)
        self._binding = binding

    def register_state(self, name: str, kind: StateKind) -> Any:
        """Declare a state; returns the handle requests must carry as `state.handle`."""
        return self.store.register_state(name, kind)

    def execute_batch(self, batch: list[StateRequest]) -> None:
        """Apply the batch to the store now; hold its results until the test delivers them."""
        if self.closed:
            raise InvalidStateError("execute_batch() called on a closed ManualExecutor")
        requests = batch  # delivered as the very list received (the protocol's rule)
        results: list[Any] | None = []
        error: Exception | None = None
        execute = self.store.execute_one
        for request in requests:
            self.executed_requests.append(request)
            try:
                results.append(execute(request.state,  # type: ignore[arg-type, union-attr]
                                       request.request_type, request.payload,
                                       request.context.key_bytes, request.namespace))
            except Exception as exc:  # noqa: BLE001 - reported when the batch is delivered
                results, error = None, exc
                break
        self._batches.append(_Batch(requests, results, error))

    def fully_loaded(self) -> bool:
        """Never saturated."""
        return False

    def close(self) -> None:
        """Mark the executor closed; pending batches are abandoned."""
        self.closed = True
        self._batches.clear()
        self.store.close()

    # -- driving it from a test ----------------------------------------------------------

    @property
    def pending_batches(self) -> list[list[StateRequest]]:
        """The requests of each triggered, undelivered batch, oldest batch first (a copy)."""
        return [list(b.requests) for b in self._batches]

    @property
    def pending_batch_num(self) -> int:
        """Number of triggered, undelivered batches."""
        return len(self._batches)

    def complete_next_batch(self) -> list[StateRequest]:
        """Deliver the oldest pending batch; returns its requests."""
        return self.complete_batch(0)

    def complete_batch(self, index: int) -> list[StateRequest]:
        """Deliver the pending batch at `index` (0 = oldest); returns its requests."""
        batch = self._take(index)
        self._deliver(batch.requests, batch.results, batch.error)
        return batch.requests

    def complete_random_batch(self) -> list[StateRequest]:
        """Deliver a pending batch chosen by `rng`; returns its requests."""
        if not self._batches:
            raise InvalidStateError("complete_random_batch(): no batch is pending")
        return self.complete_batch(self.rng.randrange(len(self._batches)))

    def complete_all(self) -> int:
        """Deliver pending batches oldest first until none is left, including batches
        triggered while delivering; returns how many were delivered."""
        count = 0
        while self._batches:
            self.complete_next_batch()
            count += 1
        return count

    def fail_next_batch(self, exc: BaseException) -> list[StateRequest]:
        """Deliver the oldest pending batch as failed with `exc`; returns its requests."""
        if not isinstance(exc, BaseException):
            raise TypeError(f"fail_next_batch() takes an exception instance, got "
                            f"{type(exc).__name__} {exc!r}")
        batch = self._take(0)
        self._deliver(batch.requests, None, exc)
        return batch.requests

    def _take(self, index: int) -> _Batch:
        if self._binding is None:
            raise InvalidStateError("the ManualExecutor is not bound to a controller yet")
        if not self._batches:
            raise InvalidStateError("no batch is pending")
        if not -len(self._batches) <= index < len(self._batches):
            raise IndexError(f"batch index {index} out of range: "
                             f"{len(self._batches)} batches are pending")
        return self._batches.pop(index)

    def _deliver(self, requests: list[StateRequest], results: list[Any] | None,
                 error: BaseException | None) -> None:
        assert self._binding is not None
        self.delivered_batches += 1
        self._binding.deliver(requests, results, error)


class ManualTimerHandle:
    """A call scheduled on a `ManualScheduler`; `cancel()` stops it from running."""

    __slots__ = ("args", "callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.when = when
        self.callback = callback
        self.args = args
        self.cancelled = False

    def __repr__(self) -> str:
        state = " cancelled" if self.cancelled else ""
        return f"<ManualTimerHandle when={self.when}{state}>"

    def cancel(self) -> None:
        """Do not run the call (no effect once it ran)."""
        self.cancelled = True


class ManualScheduler:
    """A timeout scheduler with manual time in seconds: calls run on `advance` / `fire_due`.

    Due calls run in time order, calls due at the same time in scheduling order; a call
    scheduled by a running call runs in the same `advance` if it falls due within it.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)
        self._heap: list[tuple[float, int, ManualTimerHandle]] = []
        self._seq = itertools.count()

    def __repr__(self) -> str:
        return f"<ManualScheduler now={self._now} pending={self.pending_num}>"

    def time(self) -> float:
        """The scheduler's current time in seconds."""
        return self._now

    def call_later(self, delay: float, callback: Callable[..., Any],
                   *args: Any) -> ManualTimerHandle:
        """Schedule callback(*args) `delay` seconds from now."""
        if not delay >= 0:  # also refuses NaN, which would stall every later call
            raise ValueError(f"delay must be >= 0 seconds, got {delay!r}")
        handle = ManualTimerHandle(self._now + delay, callback, args)
        heapq.heappush(self._heap, (handle.when, next(self._seq), handle))
        return handle

    @property
    def pending_num(self) -> int:
        """Scheduled calls that have neither run nor been cancelled."""
        return sum(1 for _, _, h in self._heap if not h.cancelled)

    def next_deadline(self) -> float | None:
        """When the earliest pending call is due, or None."""
        for when, _, handle in sorted(self._heap):
            if not handle.cancelled:
                return when
        return None

    def advance(self, seconds: float) -> int:
        """Move time forward by `seconds` (>= 0), running calls as they fall due; returns
        how many ran."""
        if not seconds >= 0:  # also refuses NaN, which would stop time for good
            raise ValueError(f"seconds must be >= 0: time never goes backwards, got {seconds!r}")
        target = self._now + seconds
        ran = 0
        heap = self._heap
        while heap and heap[0][0] <= target:
            when, _, handle = heapq.heappop(heap)
            self._now = max(self._now, when)
            if not handle.cancelled:
                handle.callback(*handle.args)
                ran += 1
        self._now = target
        return ran

    def fire_due(self) -> int:
        """Run the calls due now; returns how many ran."""
        return self.advance(0)


if TYPE_CHECKING:
    _scheduler_check: TimeoutScheduler = ManualScheduler()
