"""StateRequestBuffer: the active queue, the per-key blocking queues and the buffer timeout.

Active requests belong to records that hold their key and may go out in the next batch.
Blocked requests wait, per key and in order, for the key to be released. A buffer timeout
sends a partial batch when requests linger: each batch generation has a sequence number, and
a timeout fires only if its generation is still the current one, so a stale timeout never
cuts the next batch short.
"""

from __future__ import annotations

from asyncio import _get_running_loop
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from asyncstate.runtime.requests import StateRequest

__all__ = ["StateRequestBuffer", "TimeoutHandle", "TimeoutScheduler"]


class TimeoutHandle(Protocol):
    """A scheduled call that can be cancelled."""

    def cancel(self) -> None:
        """Cancel the call if it has not run yet."""


class TimeoutScheduler(Protocol):
    """Schedules a call after a delay; an asyncio event loop is one. Called on the loop
    thread only; the callback must run on that thread too."""

    def call_later(self, delay: float, callback: Callable[..., Any], *args: Any) -> TimeoutHandle:
        """Run callback(*args) after `delay` seconds."""


class StateRequestBuffer:
    """Active FIFO, blocking per-key FIFOs (with priorities) and the timeout generation."""

    __slots__ = ("_active", "_blocking", "_blocking_size", "_handle", "_on_timeout",
                 "_scheduled_seq", "_scheduler", "_timeout_on", "_timeout_s", "current_seq")

    def __init__(self, buffer_timeout_ms: int, on_timeout: Callable[[int], None],
                 scheduler: TimeoutScheduler | None) -> None:
        # A list, not a deque: compiled code appends to a list natively, and a batch that
        # takes every active request takes the list itself.
        self._active: list[StateRequest] = []
        self._blocking: dict[bytes, deque[StateRequest]] = {}
        self._blocking_size = 0
        self.current_seq = 0
        self._scheduled_seq = -1
        self._timeout_s = buffer_timeout_ms / 1000.0
        self._on_timeout = on_timeout
        # Without an explicit scheduler, timeouts go to the loop running when one is armed;
        # with no loop running there is nothing that could fire it, and none is armed.
        self._scheduler = scheduler
        self._timeout_on = buffer_timeout_ms > 0
        self._handle: TimeoutHandle | None = None

    def __repr__(self) -> str:
        return (f"<StateRequestBuffer active={len(self._active)} blocking={self._blocking_size} "
                f"blocked_keys={len(self._blocking)} seq={self.current_seq}>")

    # -- active queue ------------------------------------------------------------------------

    def enqueue_to_active(self, request: StateRequest) -> int:
        """Append a request whose record holds its key; arm the timeout for this generation
        (unless armed already). Returns the number of active requests."""
        active = self._active
        active.append(request)
        if self._timeout_on and self._scheduled_seq < self.current_seq:
            self._arm()
        return len(active)

    def _arm(self) -> None:
        scheduler = self._scheduler if self._scheduler is not None else _get_running_loop()
        if scheduler is None:
            return
        if self._handle is not None:
            self._handle.cancel()
        seq = self._scheduled_seq = self.current_seq
        self._handle = scheduler.call_later(self._timeout_s, self._fire, seq)

    def _fire(self, seq: int) -> None:
        self._handle = None
        if seq == self.current_seq:
            self._on_timeout(seq)

    def pop_active(self, n: int) -> list[StateRequest]:
        """Remove and return up to `n` active requests, oldest first."""
        active = self._active
        if len(active) <= n:
            self._active = []
            return active
        batch = active[:n]
        del active[:n]
        return batch

    def advance_seq(self) -> None:
        """Start a new batch generation (after a batch was sent)."""
        self.current_seq += 1
        if self._active and self._timeout_on:
            self._arm()  # leftovers get a deadline of their own

    # -- blocking queues ---------------------------------------------------------------------

    def enqueue_to_blocking(self, request: StateRequest) -> None:
        """Park a request until its key is free; higher priority goes first, FIFO otherwise."""
        key = request.context.key_bytes
        request.context.blocked += 1
        queue = self._blocking.get(key)
        if queue is None:
            self._blocking[key] = deque((request,))
        else:
            priority = request.context.priority
            if priority == 0 or not queue:
                queue.append(request)
            else:
                for i, other in enumerate(queue):
                    if other.context.priority < priority:
                        queue.insert(i, request)
                        break
                else:
                    queue.append(request)
        self._blocking_size += 1

    def unblock_all_of(self, key: bytes, context: Any) -> list[StateRequest]:
        """Remove and return every blocked request of `key` issued by `context`, in order
        (other contexts' requests keep their order)."""
        queue = self._blocking.get(key)
        if queue is None:
            return []
        mine = []
        # Usually all of them lead the queue: pop those without scanning the rest.
        while queue and queue[0].context is context:
            mine.append(queue.popleft())
        if context.blocked > len(mine):
            mine.extend(r for r in queue if r.context is context)
            rest = deque(r for r in queue if r.context is not context)
            queue.clear()
            queue.extend(rest)
        if not queue:
            del self._blocking[key]
        self._blocking_size -= len(mine)
        context.blocked -= len(mine)
        return mine

    def drain_active(self) -> list[StateRequest]:
        """Remove and return every active request (closing)."""
        requests = self._active
        self._active = []
        return requests

    def drain_blocked(self) -> list[StateRequest]:
        """Remove and return every blocked request (closing)."""
        requests = [r for queue in self._blocking.values() for r in queue]
        for r in requests:
            r.context.blocked = 0
        self._blocking.clear()
        self._blocking_size = 0
        return requests

    def peek_blocked(self, key: bytes) -> StateRequest | None:
        """The first blocked request of `key` without removing it, or None."""
        queue = self._blocking.get(key)
        return queue[0] if queue else None

    @property
    def active_size(self) -> int:
        """Requests in the active queue."""
        return len(self._active)

    @property
    def blocking_size(self) -> int:
        """Requests waiting for their key."""
        return self._blocking_size

    @property
    def blocking_key_num(self) -> int:
        """Keys with waiting requests."""
        return len(self._blocking)

    def close(self) -> None:
        """Cancel the pending timeout."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._timeout_on = False
