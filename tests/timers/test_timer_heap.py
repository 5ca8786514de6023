"""HeapPriorityQueue: the indexed binary heap, against a list model (identity removal, equal
elements allowed), and its element bookkeeping."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from timers_model import identity, keys, new_timer, timestamps

from asyncstate.errors import InvalidStateError
from asyncstate.timers.heap import NOT_CONTAINED, HeapPriorityQueue
from asyncstate.timers.timer import InternalTimer

elements = st.tuples(timestamps, keys)
heap_ops = st.lists(st.one_of(
    st.tuples(st.just("add"), elements),
    st.tuples(st.just("add_all"), st.lists(elements, max_size=12)),
    st.tuples(st.just("remove"), st.integers(0, 50)),
    st.tuples(st.just("remove_foreign"), elements),
    st.tuples(st.just("adjust"), st.integers(0, 50), timestamps),
    st.tuples(st.just("poll")),
    st.tuples(st.just("peek")),
), max_size=80)


def check_heap(heap: HeapPriorityQueue[InternalTimer], live: list[InternalTimer]) -> None:
    """The heap holds exactly `live` (by identity), each knowing its index, in heap order."""
    array = heap.to_list()
    assert len(heap) == len(live) == len(array)
    assert sorted(map(id, array)) == sorted(map(id, live))
    for position, element in enumerate(array, start=1):
        assert element.heap_index == position
        if position > 1:
            assert not element.priority_less_than(array[position // 2 - 1])


@given(ops=heap_ops)
def test_random_operations_match_a_list_model(ops: list[tuple[Any, ...]]) -> None:
    heap: HeapPriorityQueue[InternalTimer] = HeapPriorityQueue()
    live: list[InternalTimer] = []
    for op in ops:
        kind = op[0]
        if kind == "add":
            timer = new_timer(*op[1], None)
            expected = not live or identity(timer) < min(map(identity, live))
            assert heap.add(timer) is expected
            live.append(timer)
        elif kind == "add_all":
            batch = [new_timer(ts, key, None) for ts, key in op[1]]
            heap.add_all(batch)
            live.extend(batch)
        elif kind == "remove" and live:
            victim = live.pop(op[1] % len(live))
            was_head = heap.peek() is victim
            assert heap.remove(victim) is was_head
            assert victim.heap_index == NOT_CONTAINED
        elif kind == "remove_foreign":
            assert heap.remove(new_timer(*op[1], None)) is False  # equal is not enough
        elif kind == "adjust" and live:
            target = live[op[1] % len(live)]
            target.timestamp = op[2]  # a priority that changes in place
            heap.adjust_modified_element(target)
        elif kind == "poll":
            polled = heap.poll()
            if live:
                assert polled is not None
                assert identity(polled) == min(map(identity, live))
                del live[next(i for i, t in enumerate(live) if t is polled)]
                assert polled.heap_index == NOT_CONTAINED
            else:
                assert polled is None
        elif kind == "peek":
            peeked = heap.peek()
            assert (peeked is None) if not live else \
                identity(peeked) == min(map(identity, live))  # type: ignore[arg-type]
        check_heap(heap, live)
    ordered = []
    while (timer := heap.poll()) is not None:
        ordered.append(identity(timer))
    assert ordered == sorted(map(identity, live))


@given(before=st.lists(elements, max_size=30), added=st.lists(elements, max_size=30))
def test_add_all_orders_large_and_small_additions(before: list[Any], added: list[Any]) -> None:
    # An addition at least as large as the heap is ordered bottom-up, a smaller one by
    # sift-ups: both must leave a heap.
    heap: HeapPriorityQueue[InternalTimer] = HeapPriorityQueue()
    first = [new_timer(ts, key, None) for ts, key in before]
    heap.add_all(first)
    second = [new_timer(ts, key, None) for ts, key in added]
    heap.add_all(second)
    check_heap(heap, first + second)


def test_an_element_in_a_heap_cannot_be_added_again() -> None:
    heap: HeapPriorityQueue[InternalTimer] = HeapPriorityQueue()
    other: HeapPriorityQueue[InternalTimer] = HeapPriorityQueue()
    timer = new_timer(1, "k", None)
    heap.add(timer)
    message = re.escape(f"{timer!r} is already in a heap (heap_index 1)")
    with pytest.raises(InvalidStateError, match=f"^{message}"):
        heap.add(timer)
    with pytest.raises(InvalidStateError, match=f"^{message}"):
        other.add(timer)
    assert len(heap) == 1 and other.is_empty()
    assert heap.poll() is timer
    assert other.add(timer) is True  # out of the first heap, it may join another


def test_add_all_with_an_element_twice_changes_nothing() -> None:
    heap: HeapPriorityQueue[InternalTimer] = HeapPriorityQueue()
    kept = new_timer(5, "a", None)
    heap.add(kept)
    a, b = new_timer(1, "b", None), new_timer(2, "c", None)
    with pytest.raises(InvalidStateError, match=r"is already in a heap"):
        heap.add_all([a, b, a])
    assert heap.to_list() == [kept]
    assert a.heap_index == b.heap_index == NOT_CONTAINED
    heap.add_all([a, b])
    assert [heap.poll(), heap.poll(), heap.poll()] == [a, b, kept]


def test_clear_releases_every_element() -> None:
    heap: HeapPriorityQueue[InternalTimer] = HeapPriorityQueue()
    timers = [new_timer(ts, "k", None) for ts in (3, 1, 2)]
    heap.add_all(timers)
    heap.clear()
    assert heap.is_empty() and len(heap) == 0 and heap.peek() is None and heap.poll() is None
    assert all(t.heap_index == NOT_CONTAINED for t in timers)
    heap.add_all(timers)
    assert [t.timestamp for t in (heap.poll(), heap.poll(), heap.poll())] == [1, 2, 3]


def test_iteration_is_a_copy_in_no_particular_order() -> None:
    heap: HeapPriorityQueue[InternalTimer] = HeapPriorityQueue()
    timers = [new_timer(ts, "k", None) for ts in (5, 4, 3, 2, 1)]
    heap.add_all(timers)
    seen = []
    for timer in heap:
        seen.append(timer)
        heap.remove(timer)  # changing the heap meanwhile does not disturb the iteration
    assert sorted(map(id, seen)) == sorted(map(id, timers))
    assert heap.is_empty()


def test_adjust_ignores_an_element_of_another_heap() -> None:
    heap: HeapPriorityQueue[InternalTimer] = HeapPriorityQueue()
    other: HeapPriorityQueue[InternalTimer] = HeapPriorityQueue()
    inside, outside = new_timer(1, "a", None), new_timer(2, "b", None)
    heap.add(inside)
    other.add(outside)
    outside.timestamp = 0
    heap.adjust_modified_element(outside)
    assert heap.to_list() == [inside] and outside.heap_index == 1


def test_repr_shows_size_and_head() -> None:
    heap: HeapPriorityQueue[InternalTimer] = HeapPriorityQueue()
    heap.add(new_timer(7, "k", None))
    assert re.fullmatch(r"<HeapPriorityQueue size=1 head=InternalTimer\(timestamp=7, key='k', "
                        r"key_group=\d+\)>", repr(heap))
