"""A timer queue cut into one queue per key group, joined by a heap of their heads (Flink's
`KeyGroupPartitionedPriorityQueue`).

Each key group of the operator's range has its own queue set, built by a factory (heap sets
in memory, `RocksDBPriorityQueueSet`s on RocksDB). A second heap orders those queues by their
heads, so the global head is the head of the first queue: `peek` is O(1) and `poll` costs
the queue's poll plus O(log k) for k key groups, never a scan of the key groups. An add or
remove touches that second heap only when it changed the head of its key group's queue.

Each queue's head is cached beside it (`_Partition.head`), refreshed after every change that
may move it, so ordering the queues compares timers, not calls to `peek`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import cast

from asyncstate.keygroups import KeyGroupRange
from asyncstate.timers.base import InternalPriorityQueue
from asyncstate.timers.heap import NOT_CONTAINED, HeapPriorityQueue, HeapPriorityQueueElement
from asyncstate.timers.heap_set import _check_key_groups, _outside
from asyncstate.timers.timer import InternalTimer

__all__ = ["KeyGroupPartitionedPriorityQueue", "KeyGroupQueueFactory"]

KeyGroupQueueFactory = Callable[[int], InternalPriorityQueue[InternalTimer]]
"""Builds the (empty, or restored) queue set of one key group, given the key group."""


class _Partition(HeapPriorityQueueElement):
    """One key group's queue in the heap of heads, with its head cached (None: empty, which
    orders after every timer)."""

    __slots__ = ("queue", "head", "key_group")

    def __init__(self, queue: InternalPriorityQueue[InternalTimer], key_group: int) -> None:
        self.heap_index = NOT_CONTAINED
        self.queue = queue
        self.key_group = key_group
        self.head: InternalTimer | None = queue.peek()

    def priority_less_than(self, other: HeapPriorityQueueElement) -> bool:
        head = self.head
        other_head = cast(_Partition, other).head
        if head is None:
            return False
        if other_head is None:
            return True
        return head.priority_less_than(other_head)


class KeyGroupPartitionedPriorityQueue(InternalPriorityQueue[InternalTimer]):
    """A priority queue of InternalTimers with one queue set per key group of
    `key_group_range` (out of `max_parallelism`), each built by `factory(key_group)`.

    Set semantics come from the queues the factory builds. A timer of a key group outside
    the range raises KeyGroupError naming it."""

    __slots__ = ("_heads", "_partitions", "_first", "_range")

    def __init__(self, factory: KeyGroupQueueFactory, key_group_range: KeyGroupRange,
                 max_parallelism: int) -> None:
        _check_key_groups(key_group_range, max_parallelism)
        self._range = key_group_range
        self._first = key_group_range.start
        self._partitions = [_Partition(factory(key_group), key_group)
                            for key_group in key_group_range]
        self._heads: HeapPriorityQueue[_Partition] = HeapPriorityQueue()
        self._heads.add_all(self._partitions)

    def __repr__(self) -> str:
        return (f"<KeyGroupPartitionedPriorityQueue key_groups={self._range.start}.."
                f"{self._range.end} head={self.peek()!r}>")

    def _partition_for(self, key_group: int) -> _Partition:
        index = key_group - self._first
        partitions = self._partitions
        if index < 0 or index >= len(partitions):
            raise _outside(key_group, self._range)
        return partitions[index]

    def peek(self) -> InternalTimer | None:
        return cast(_Partition, self._heads.peek()).head

    def poll(self) -> InternalTimer | None:
        heads = self._heads
        partition = cast(_Partition, heads.peek())
        if partition.head is None:
            return None
        queue = partition.queue
        timer = queue.poll()
        partition.head = queue.peek()
        heads.adjust_modified_element(partition)
        return timer

    def add(self, element: InternalTimer) -> bool:
        """Add `element` to its key group's queue; True if it is the new head."""
        partition = self._partition_for(element.key_group)
        queue = partition.queue
        if not queue.add(element):
            return False
        partition.head = queue.peek()
        heads = self._heads
        heads.adjust_modified_element(partition)
        return heads.peek() is partition

    def remove(self, element: InternalTimer) -> bool:
        """Remove the timer equal to `element`; True if it was the head."""
        partition = self._partition_for(element.key_group)
        heads = self._heads
        was_head = heads.peek() is partition
        queue = partition.queue
        if not queue.remove(element):
            return False
        partition.head = queue.peek()
        heads.adjust_modified_element(partition)
        return was_head

    def add_all(self, elements: Iterable[InternalTimer]) -> None:
        for timer in elements:
            self.add(timer)

    def is_empty(self) -> bool:
        return self.peek() is None

    def __len__(self) -> int:
        return sum([len(partition.queue) for partition in self._partitions])

    def __iter__(self) -> Iterator[InternalTimer]:
        timers: list[InternalTimer] = []
        for partition in self._partitions:
            timers.extend(partition.queue)
        return iter(timers)

    def clear(self) -> None:
        for partition in self._partitions:
            partition.queue.clear()
            partition.head = None

    def get_subset_for_key_group(self, key_group: int) -> set[InternalTimer]:
        """A new set of the timers of `key_group`."""
        return set(self._partition_for(key_group).queue)
