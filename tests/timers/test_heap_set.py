"""HeapPriorityQueueSet and BatchExecutionPriorityQueueSet against a sorted-set model, and
their key-group views."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from timers_model import (
    MAX_PARALLELISM,
    drain,
    identity,
    keys,
    namespaces,
    new_timer,
    op_lists,
    run_against_model,
    timestamps,
)

from asyncstate.errors import ConfigError, InvalidStateError, KeyGroupError
from asyncstate.keygroups import KeyGroupRange
from asyncstate.timers.batch import BatchExecutionPriorityQueueSet
from asyncstate.timers.heap import NOT_CONTAINED
from asyncstate.timers.heap_set import HeapPriorityQueueSet


def full_set() -> HeapPriorityQueueSet:
    return HeapPriorityQueueSet(KeyGroupRange(0, MAX_PARALLELISM - 1), MAX_PARALLELISM)


@pytest.mark.parametrize("make", [full_set, BatchExecutionPriorityQueueSet],
                         ids=["heap_set", "batch"])
@given(ops=op_lists)
def test_random_operations_match_a_sorted_set_model(make: Any, ops: list[Any]) -> None:
    queue = make()
    model, queue = run_against_model(queue, ops)
    assert drain(queue) == sorted(model)


@given(ops=op_lists)
def test_subsets_per_key_group_hold_exactly_that_key_groups_timers(ops: list[Any]) -> None:
    queue = full_set()
    model, queue = run_against_model(queue, ops)
    timers = list(queue)
    for key_group in range(MAX_PARALLELISM):
        subset = queue.get_subset_for_key_group(key_group)
        assert isinstance(subset, set)
        assert {identity(t) for t in subset} == \
            {identity(t) for t in timers if t.key_group == key_group}
        assert all(t.key_group == key_group for t in subset)
    assert sum(len(queue.get_subset_for_key_group(kg)) for kg in range(MAX_PARALLELISM)) \
        == len(model)


@pytest.mark.parametrize("make", [full_set, BatchExecutionPriorityQueueSet],
                         ids=["heap_set", "batch"])
@given(first=st.lists(st.tuples(timestamps, keys, namespaces), max_size=25),
       second=st.lists(st.tuples(timestamps, keys, namespaces), max_size=25))
def test_add_all_keeps_one_of_equal_timers(make: Any, first: list[Any],
                                           second: list[Any]) -> None:
    queue = make()
    queue.add_all([new_timer(*t) for t in first])
    queue.add_all([new_timer(*t) for t in second])
    expected = sorted({identity(new_timer(*t)) for t in first + second})
    assert len(queue) == len(expected)
    assert drain(queue) == expected


def test_the_stored_instance_stays_and_an_equal_one_removes_it() -> None:
    queue = full_set()
    stored = new_timer(5, "k", "w")
    assert queue.add(stored) is True
    assert queue.add(new_timer(5, "k", "w")) is False
    assert queue.add(stored) is False  # the very same instance again
    assert len(queue) == 1 and queue.peek() is stored
    assert queue.remove(new_timer(5, "k", "w")) is True
    assert stored.heap_index == NOT_CONTAINED and queue.is_empty()
    assert queue.remove(new_timer(5, "k", "w")) is False
    assert queue.add(stored) is True  # it may come back


def test_an_equal_timer_is_refused_while_in_another_heap_and_the_set_stays_whole() -> None:
    first, second = full_set(), full_set()
    timer = new_timer(1, "k", None)
    first.add(timer)
    with pytest.raises(InvalidStateError, match=r"is already in a heap"):
        second.add(timer)
    assert second.is_empty() and second.get_subset_for_key_group(timer.key_group) == set()
    assert second.add(new_timer(1, "k", None)) is True


def test_timers_outside_the_key_group_range_are_refused_naming_the_key_group() -> None:
    queue = HeapPriorityQueueSet(KeyGroupRange(2, 4), MAX_PARALLELISM)
    inside = next(new_timer(1, k, None) for k in range(100)
                  if 2 <= new_timer(1, k, None).key_group <= 4)
    outside = next(new_timer(1, k, None) for k in range(100)
                   if new_timer(1, k, None).key_group == 6)
    queue.add(inside)
    message = re.escape("timer of key group 6 is outside this queue's key groups 2..4")
    for call in (queue.add, queue.remove):
        with pytest.raises(KeyGroupError, match=f"^{message}") as info:
            call(outside)
        assert info.value.key_group == 6
    with pytest.raises(KeyGroupError, match=r"^timer of key group 1 is outside"):
        queue.get_subset_for_key_group(1)
    with pytest.raises(KeyGroupError, match=r"^timer of key group 6 is outside"):
        queue.add_all([new_timer(2, inside.key, None), outside])
    assert [identity(t) for t in queue] == [identity(inside)]  # the failed add_all left nothing
    assert queue.get_subset_for_key_group(inside.key_group) == {inside}


def test_construction_checks_range_and_max_parallelism() -> None:
    with pytest.raises(KeyGroupError, match=r"^key group range 0\.\.8 goes beyond "
                                            r"max_parallelism 8 \(key groups 0\.\.7\)$"):
        HeapPriorityQueueSet(KeyGroupRange(0, 8), 8)
    with pytest.raises(ConfigError, match=r"^max_parallelism must be in \[1, 32768\], got 0$"):
        HeapPriorityQueueSet(KeyGroupRange(0, 0), 0)
    with pytest.raises(TypeError, match=r"^key_group_range must be a KeyGroupRange, got range$"):
        HeapPriorityQueueSet(range(0, 4), 8)  # type: ignore[arg-type]


def test_clear_empties_the_heap_and_the_dicts() -> None:
    queue = full_set()
    timers = [new_timer(ts, k, None) for ts in range(3) for k in "abc"]
    queue.add_all(timers)
    queue.clear()
    assert queue.is_empty() and list(queue) == []
    assert all(not queue.get_subset_for_key_group(kg) for kg in range(MAX_PARALLELISM))
    queue.add_all(timers)  # released instances may come back
    assert len(queue) == 9


def test_the_batch_set_has_no_key_group_view() -> None:
    queue = BatchExecutionPriorityQueueSet()
    queue.add(new_timer(1, "k", None))
    with pytest.raises(InvalidStateError,
                       match=r"^BatchExecutionPriorityQueueSet keeps no key groups .* key group "
                             r"3; use HeapPriorityQueueSet or KeyGroupPartitionedPriorityQueue"):
        queue.get_subset_for_key_group(3)
    queue.clear()
    assert queue.is_empty() and queue.add(new_timer(1, "k", None)) is True


def test_repr_shows_the_key_groups() -> None:
    queue = HeapPriorityQueueSet(KeyGroupRange(0, 3), 4)
    assert repr(queue) == "<HeapPriorityQueueSet key_groups=0..3 size=0 head=None>"
