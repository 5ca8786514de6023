"""StateRequestBuffer: active FIFO, per-key blocking queues with priorities, timeout generations."""

from __future__ import annotations

from typing import Any

import pytest

from asyncstate.runtime.buffer import StateRequestBuffer
from asyncstate.runtime.context import RecordContext
from asyncstate.runtime.future import StateFuture
from asyncstate.runtime.requests import StateRequest, StateRequestType
from asyncstate.serde import NONE_BYTES, canonical_key
from asyncstate.testing import ManualScheduler

TIMEOUT_MS = 100
TIMEOUT_S = TIMEOUT_MS / 1000


def request(key: Any, name: str = "r", priority: int = 0) -> StateRequest:
    ctx = RecordContext(name, key, canonical_key(key), 0, None, priority=priority)
    return StateRequest(None, StateRequestType.VALUE_GET, name, NONE_BYTES, ctx,
                        StateFuture())


def names(requests: list[StateRequest]) -> list[Any]:
    return [r.payload for r in requests]


def unblock_in_order(buf: StateRequestBuffer, key: bytes) -> list[Any]:
    """Hand `key` to its blocked contexts one after another, as disposal does; the payloads
    in the order they were handed out."""
    out: list[Any] = []
    for _ in range(100):
        first = buf.peek_blocked(key)
        if first is None:
            return out
        out += names(buf.unblock_all_of(key, first.context))
    raise AssertionError("the blocking queue never emptied")


class Timeouts:
    def __init__(self) -> None:
        self.fired: list[int] = []

    def __call__(self, seq: int) -> None:
        self.fired.append(seq)


def make(timeout_ms: int = 0) -> tuple[StateRequestBuffer, ManualScheduler, Timeouts]:
    scheduler = ManualScheduler()
    timeouts = Timeouts()
    return StateRequestBuffer(timeout_ms, timeouts, scheduler), scheduler, timeouts


# -- active queue ------------------------------------------------------------------------------


def test_active_queue_is_fifo() -> None:
    buf, _, _ = make()
    for i in range(5):
        buf.enqueue_to_active(request(i, f"a{i}"))
    assert buf.active_size == 5
    assert names(buf.pop_active(2)) == ["a0", "a1"]
    assert buf.active_size == 3
    assert names(buf.pop_active(10)) == ["a2", "a3", "a4"]
    assert buf.active_size == 0
    assert buf.pop_active(3) == []


def test_pop_active_exactly_the_queue_length() -> None:
    buf, _, _ = make()
    for i in range(3):
        buf.enqueue_to_active(request(i, f"a{i}"))
    assert names(buf.pop_active(3)) == ["a0", "a1", "a2"]
    assert buf.active_size == 0


# -- blocking queues ---------------------------------------------------------------------------


def test_blocking_queues_are_per_key_and_fifo() -> None:
    buf, _, _ = make()
    reqs = {name: request(key, name)
            for name, key in [("x1", "x"), ("y1", "y"), ("x2", "x"), ("x3", "x"), ("y2", "y")]}
    for r in reqs.values():
        buf.enqueue_to_blocking(r)
    assert buf.blocking_size == 5
    assert buf.blocking_key_num == 2
    kx, ky = canonical_key("x"), canonical_key("y")
    assert buf.peek_blocked(kx).payload == "x1"  # type: ignore[union-attr]
    out = [r for name in ("x1", "x2", "x3")
           for r in buf.unblock_all_of(kx, reqs[name].context)]
    assert names(out) == ["x1", "x2", "x3"]
    assert buf.blocking_key_num == 1  # x's queue is gone once empty
    assert buf.blocking_size == 2
    assert buf.unblock_all_of(kx, reqs["x1"].context) == []
    assert buf.peek_blocked(kx) is None
    assert buf.peek_blocked(ky).payload == "y1"  # type: ignore[union-attr]
    assert names(buf.unblock_all_of(ky, reqs["y1"].context)) == ["y1"]
    assert names(buf.unblock_all_of(ky, reqs["y2"].context)) == ["y2"]
    assert (buf.blocking_size, buf.blocking_key_num) == (0, 0)


def test_blocking_queue_priorities() -> None:
    buf, _, _ = make()
    # (name, priority) in arrival order
    arrivals = [("p0a", 0), ("p1a", 1), ("p0b", 0), ("p2a", 2), ("p1b", 1), ("p2b", 2),
                ("p0c", 0)]
    for name, prio in arrivals:
        buf.enqueue_to_blocking(request("k", name, prio))
    k = canonical_key("k")
    order = unblock_in_order(buf, k)
    # higher priority first (inserted before the first strictly lower one), FIFO within a
    # priority; priority 0 always appends
    assert order == ["p2a", "p2b", "p1a", "p1b", "p0a", "p0b", "p0c"]


def test_priority_request_goes_before_lower_but_after_equal() -> None:
    buf, _, _ = make()
    buf.enqueue_to_blocking(request("k", "high", 3))
    buf.enqueue_to_blocking(request("k", "low", 1))
    buf.enqueue_to_blocking(request("k", "mid", 2))
    buf.enqueue_to_blocking(request("k", "high2", 3))
    k = canonical_key("k")
    assert unblock_in_order(buf, k) == ["high", "high2", "mid", "low"]


# -- timeout and sequence numbers -------------------------------------------------------------


def test_no_timeout_scheduled_when_disabled() -> None:
    buf, scheduler, timeouts = make(timeout_ms=0)
    buf.enqueue_to_active(request(1))
    assert scheduler.pending_num == 0
    scheduler.advance(10)
    assert timeouts.fired == []


def test_first_request_of_a_generation_arms_the_timeout() -> None:
    buf, scheduler, timeouts = make(TIMEOUT_MS)
    buf.enqueue_to_active(request(1))
    assert scheduler.pending_num == 1
    scheduler.advance(TIMEOUT_S / 2)
    buf.enqueue_to_active(request(2))  # does not push the deadline
    assert scheduler.pending_num == 1
    scheduler.advance(TIMEOUT_S / 2 - 0.001)
    assert timeouts.fired == []
    scheduler.advance(0.002)
    assert timeouts.fired == [0]


def test_stale_timeout_does_not_fire_for_a_later_generation() -> None:
    buf, scheduler, timeouts = make(TIMEOUT_MS)
    buf.enqueue_to_active(request(1))  # arms generation 0, due at 0.1
    buf.pop_active(10)
    buf.advance_seq()  # generation 0 went out by size
    assert buf.current_seq == 1
    scheduler.advance(TIMEOUT_S * 0.6)  # t = 0.06
    buf.enqueue_to_active(request(2))  # generation 1, due at 0.16
    scheduler.advance(TIMEOUT_S * 0.6)  # t = 0.12: generation 0's deadline has passed
    assert timeouts.fired == []
    assert buf.active_size == 1
    scheduler.advance(TIMEOUT_S * 0.5)  # t = 0.17
    assert timeouts.fired == [1]


def test_stale_timeout_without_a_new_generation_is_ignored() -> None:
    buf, scheduler, timeouts = make(TIMEOUT_MS)
    buf.enqueue_to_active(request(1))
    buf.pop_active(10)
    buf.advance_seq()
    scheduler.advance(TIMEOUT_S * 3)
    assert timeouts.fired == []


def test_leftovers_after_a_partial_pop_get_their_own_deadline() -> None:
    buf, scheduler, timeouts = make(TIMEOUT_MS)
    for i in range(3):
        buf.enqueue_to_active(request(i))
    scheduler.advance(TIMEOUT_S / 2)
    buf.pop_active(2)
    buf.advance_seq()  # one request is left behind in generation 1
    scheduler.advance(TIMEOUT_S / 2)  # generation 0's deadline
    assert timeouts.fired == []
    scheduler.advance(TIMEOUT_S / 2)  # generation 1's deadline
    assert timeouts.fired == [1]


def test_timeout_fires_once_per_generation() -> None:
    buf, scheduler, timeouts = make(TIMEOUT_MS)
    buf.enqueue_to_active(request(1))
    scheduler.advance(TIMEOUT_S)
    assert timeouts.fired == [0]
    buf.enqueue_to_active(request(2))  # same generation (nothing was sent): no new timer
    scheduler.advance(TIMEOUT_S * 2)
    assert timeouts.fired == [0]


def test_close_cancels_the_pending_timeout() -> None:
    buf, scheduler, timeouts = make(TIMEOUT_MS)
    buf.enqueue_to_active(request(1))
    buf.close()
    assert scheduler.pending_num == 0
    scheduler.advance(TIMEOUT_S * 2)
    assert timeouts.fired == []
    buf.enqueue_to_active(request(2))  # closed: never armed again
    assert scheduler.pending_num == 0


@pytest.mark.parametrize("n", [1, 7])
def test_repr_names_sizes_and_sequence(n: int) -> None:
    buf, _, _ = make()
    for i in range(n):
        buf.enqueue_to_active(request(i))
    buf.enqueue_to_blocking(request("k"))
    text = repr(buf)
    assert f"active={n}" in text
    assert "blocking=1" in text
    assert "seq=0" in text
