"""KeyGroupPartitionedPriorityQueue over heap sets and over RocksDB sets, against a
sorted-set model: the global head across key groups, and the per-key-group views."""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
import rocksdict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shared_functions import slow_examples
from timers_model import (
    MAX_PARALLELISM,
    drain,
    identity,
    new_timer,
    op_lists,
    run_against_model,
    timer_ops,
)

from asyncstate.errors import KeyGroupError
from asyncstate.keygroups import KeyGroupRange
from asyncstate.timers.base import InternalPriorityQueue
from asyncstate.timers.heap_set import HeapPriorityQueueSet
from asyncstate.timers.partitioned import KeyGroupPartitionedPriorityQueue
from asyncstate.timers.rocksdb_set import RocksDBPriorityQueueSet
from asyncstate.timers.timer import InternalTimer

FULL = KeyGroupRange(0, MAX_PARALLELISM - 1)


def heap_sets(key_group: int) -> InternalPriorityQueue[InternalTimer]:
    return HeapPriorityQueueSet(KeyGroupRange(key_group, key_group), MAX_PARALLELISM)


def rocksdb_sets(db: rocksdict.Rdict, cache_size: int
                 ) -> Callable[[int], InternalPriorityQueue[InternalTimer]]:
    return lambda key_group: RocksDBPriorityQueueSet(db, key_group, cache_size=cache_size)


def check_subsets(queue: KeyGroupPartitionedPriorityQueue, model: set[Any]) -> None:
    seen: set[Any] = set()
    for key_group in range(MAX_PARALLELISM):
        subset = queue.get_subset_for_key_group(key_group)
        assert all(t.key_group == key_group for t in subset)
        seen |= {identity(t) for t in subset}
    assert seen == model


@given(ops=op_lists)
def test_over_heap_sets_random_operations_match_a_sorted_set_model(ops: list[Any]) -> None:
    queue = KeyGroupPartitionedPriorityQueue(heap_sets, FULL, MAX_PARALLELISM)
    model, queue = run_against_model(queue, ops)
    check_subsets(queue, model)
    assert drain(queue) == sorted(model)


@settings(max_examples=slow_examples(20), suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.one_of(timer_ops, st.just(("reopen",))), max_size=60),
       cache_size=st.integers(1, 3))
def test_over_rocksdb_sets_random_operations_match_a_sorted_set_model(
        ops: list[Any], cache_size: int) -> None:
    with tempfile.TemporaryDirectory() as directory:
        dbs = [rocksdict.Rdict(directory, rocksdict.Options(raw_mode=True))]

        def reopen(queue: Any, op: Any) -> KeyGroupPartitionedPriorityQueue:
            dbs[-1].close()
            dbs.append(rocksdict.Rdict(directory, rocksdict.Options(raw_mode=True)))
            return KeyGroupPartitionedPriorityQueue(rocksdb_sets(dbs[-1], cache_size), FULL,
                                                    MAX_PARALLELISM)

        try:
            queue = KeyGroupPartitionedPriorityQueue(rocksdb_sets(dbs[0], cache_size), FULL,
                                                     MAX_PARALLELISM)
            model, queue = run_against_model(queue, ops, reopen)
            check_subsets(queue, model)
            assert drain(queue) == sorted(model)
        finally:
            dbs[-1].close()


@given(timers=st.lists(st.tuples(st.integers(-5, 5), st.integers(0, 40)), max_size=40))
def test_add_all_and_clear(timers: list[Any]) -> None:
    queue = KeyGroupPartitionedPriorityQueue(heap_sets, FULL, MAX_PARALLELISM)
    queue.add_all([new_timer(ts, key, None) for ts, key in timers])
    expected = sorted({identity(new_timer(ts, key, None)) for ts, key in timers})
    assert len(queue) == len(expected)
    assert sorted(identity(t) for t in queue) == expected
    queue.clear()
    assert queue.is_empty() and queue.peek() is None and queue.poll() is None
    queue.add_all([new_timer(ts, key, None) for ts, key in timers])
    assert drain(queue) == expected


def test_a_part_of_the_key_groups_refuses_the_others() -> None:
    queue = KeyGroupPartitionedPriorityQueue(heap_sets, KeyGroupRange(2, 4), MAX_PARALLELISM)
    outside = next(new_timer(1, k, None) for k in range(100)
                   if new_timer(1, k, None).key_group == 5)
    message = re.escape("timer of key group 5 is outside this queue's key groups 2..4")
    for call in (queue.add, queue.remove, lambda t: queue.get_subset_for_key_group(5)):
        with pytest.raises(KeyGroupError, match=f"^{message}"):
            call(outside)
    with pytest.raises(KeyGroupError, match=r"^key group range 2\.\.8 goes beyond"):
        KeyGroupPartitionedPriorityQueue(heap_sets, KeyGroupRange(2, 8), MAX_PARALLELISM)


def test_the_factory_is_called_once_per_key_group_of_the_range() -> None:
    asked: list[int] = []

    def factory(key_group: int) -> InternalPriorityQueue[InternalTimer]:
        asked.append(key_group)
        return heap_sets(key_group)

    KeyGroupPartitionedPriorityQueue(factory, KeyGroupRange(3, 6), MAX_PARALLELISM)
    assert asked == [3, 4, 5, 6]


def test_queues_restored_before_construction_are_ordered_by_their_heads() -> None:
    # A factory may hand out queues that already hold timers (a restore).
    def factory(key_group: int) -> InternalPriorityQueue[InternalTimer]:
        queue = heap_sets(key_group)
        for key in range(60):
            timer = new_timer(100 - key, key, None)
            if timer.key_group == key_group:
                queue.add(timer)
        return queue

    queue = KeyGroupPartitionedPriorityQueue(factory, FULL, MAX_PARALLELISM)
    assert [t[0] for t in drain(queue)] == list(range(41, 101))


def test_repr_shows_the_key_groups_and_the_head() -> None:
    queue = KeyGroupPartitionedPriorityQueue(heap_sets, FULL, MAX_PARALLELISM)
    assert repr(queue) == "<KeyGroupPartitionedPriorityQueue key_groups=0..7 head=None>"
