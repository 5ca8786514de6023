"""Shared pieces of the timer queue tests: hypothesis strategies for timers and operation
sequences, and a runner that checks any timer queue set against a sorted-set model."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import strategies as st

from asyncstate.serde import canonical_key
from asyncstate.timers.timer import MAX_TIMESTAMP, MIN_TIMESTAMP, InternalTimer, make_timer

MAX_PARALLELISM = 8

# Keys of several types; a few of each so that timers of one key repeat.
keys = st.one_of(
    st.integers(-3, 3), st.sampled_from([2**63 - 1, -(2**63), 2**64 - 1, 255, 256, -33]),
    st.sampled_from(["", "a", "b", "ключ"]), st.sampled_from([b"", b"a", b"\xff"]),
    st.sampled_from([None, True, False, 1.5, -0.0]),
    st.sampled_from([(1, 2), (1,), ("a", None), ()]),
)
namespaces = st.sampled_from([None, None, "w1", 7, ("w", 2)])
# Few timestamps (duplicates and ties), plus the extremes.
timestamps = st.one_of(st.integers(-3, 3),
                       st.sampled_from([MIN_TIMESTAMP, MIN_TIMESTAMP + 1, MAX_TIMESTAMP - 1,
                                        MAX_TIMESTAMP, -(2**32), 2**32]))
any_timestamps = st.integers(MIN_TIMESTAMP, MAX_TIMESTAMP)

ADD, REMOVE, POLL, PEEK = "add", "remove", "poll", "peek"
timer_ops = st.one_of(
    st.tuples(st.just(ADD), timestamps, keys, namespaces),
    st.tuples(st.just(REMOVE), timestamps, keys, namespaces),
    st.tuples(st.just(POLL)),
    st.tuples(st.just(PEEK)),
)
op_lists = st.lists(timer_ops, max_size=80)

Identity = tuple[int, bytes, bytes]


def identity(timer: InternalTimer) -> Identity:
    """What a timer is compared and ordered by: (timestamp, key bytes, namespace bytes)."""
    return (timer.timestamp, timer.key_bytes, timer.namespace_bytes)


def new_timer(timestamp: int, key: Any, namespace: Any,
              max_parallelism: int = MAX_PARALLELISM) -> InternalTimer:
    return make_timer(timestamp, key, max_parallelism, namespace)


def run_against_model(queue: Any, ops: Sequence[tuple[Any, ...]],
                      other: Callable[[Any, tuple[Any, ...]], Any] | None = None,
                      max_parallelism: int = MAX_PARALLELISM) -> tuple[set[Identity], Any]:
    """Apply `ops` to `queue` (any timer queue set) and to a set of identities, checking
    every answer: add/remove report a changed head exactly when the model's head changed
    to/from that timer, peek and poll give the model's smallest timer, and len follows.
    An op of another kind goes to `other(queue, op)`, which returns the queue to go on with
    (a reopened one). Timers are cut into `max_parallelism` key groups. Returns the model
    and the queue at the end."""
    model: set[Identity] = set()
    for op in ops:
        if op[0] == ADD:
            timer = new_timer(*op[1:], max_parallelism)
            ident = identity(timer)
            old_head = min(model) if model else None
            new = ident not in model
            model.add(ident)
            assert queue.add(timer) is (new and (old_head is None or ident < old_head)), op
        elif op[0] == REMOVE:
            timer = new_timer(*op[1:], max_parallelism)
            ident = identity(timer)
            was_head = bool(model) and ident == min(model)
            model.discard(ident)
            assert queue.remove(timer) is was_head, op
        elif op[0] == POLL:
            polled = queue.poll()
            if model:
                head = min(model)
                model.remove(head)
                assert polled is not None and identity(polled) == head
                check_fields(polled, max_parallelism)
            else:
                assert polled is None
        elif op[0] == PEEK:
            peeked = queue.peek()
            if model:
                assert peeked is not None and identity(peeked) == min(model)
                check_fields(peeked, max_parallelism)
            else:
                assert peeked is None
        else:
            assert other is not None, op
            queue = other(queue, op)
        assert len(queue) == len(model)
        assert queue.is_empty() is (not model)
    assert sorted(identity(t) for t in queue) == sorted(model)
    return model, queue


def check_fields(timer: InternalTimer, max_parallelism: int = MAX_PARALLELISM) -> None:
    """The key, its bytes and its key group agree (a decoded timer included)."""
    assert canonical_key(timer.key) == timer.key_bytes
    assert timer.key_group == new_timer(0, timer.key, None, max_parallelism).key_group


def drain(queue: Any) -> list[Identity]:
    """Poll `queue` empty; the identities in the order they came out."""
    out = []
    for _ in range(10_000):
        timer = queue.poll()
        if timer is None:
            return out
        out.append(identity(timer))
    raise AssertionError("the queue did not empty within 10,000 polls")
