"""A heap of timers with set semantics and one de-duplication dict per key group (Flink's
`HeapPriorityQueueSet`).

The heap orders the timers; the dicts map each timer to the instance stored in the heap, so
that adding an equal timer twice keeps one, and `remove` finds the stored instance (whose
index the heap needs) from any equal timer. One dict per key group makes the timers of a key
group a cheap query, as a snapshot per key group needs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

from asyncstate.config import MAX_MAX_PARALLELISM, check_int
from asyncstate.errors import KeyGroupError
from asyncstate.keygroups import KeyGroupRange
from asyncstate.timers.heap import NOT_CONTAINED, HeapPriorityQueue, _already_contained
from asyncstate.timers.timer import InternalTimer

__all__ = ["HeapPriorityQueueSet"]


class _DedupHeap(HeapPriorityQueue[InternalTimer]):
    """A heap of timers kept free of equal timers by dicts; subclasses say which dict holds
    the timers of a key group (`_map_for`)."""

    __slots__ = ()

    def _map_for(self, key_group: int) -> dict[InternalTimer, InternalTimer]:
        raise NotImplementedError

    def add(self, element: InternalTimer) -> bool:
        """Add `element` unless an equal timer is in the set; True if it is the new head."""
        dedup = self._map_for(element.key_group)
        size = len(dedup)
        dedup.setdefault(element, element)
        if len(dedup) == size:  # an equal timer (or this one) is already in the set
            return False
        if element.heap_index != NOT_CONTAINED:
            del dedup[element]
            raise _already_contained(element)
        return self._push(element)

    def remove(self, element: InternalTimer) -> bool:
        """Remove the timer equal to `element`; True if it was the head."""
        stored = self._map_for(element.key_group).pop(element, None)
        if stored is None:
            return False
        return super().remove(stored)

    def poll(self) -> InternalTimer | None:
        timer = super().poll()
        if timer is not None:
            del self._map_for(timer.key_group)[timer]
        return timer

    def add_all(self, elements: Iterable[InternalTimer]) -> None:
        """Add every timer that no equal timer in the set (or earlier in `elements`)
        precedes."""
        fresh: list[InternalTimer] = []
        try:
            for timer in elements:
                dedup = self._map_for(timer.key_group)
                size = len(dedup)
                dedup.setdefault(timer, timer)
                if len(dedup) != size:
                    fresh.append(timer)
            super().add_all(fresh)
        except BaseException:
            for timer in fresh:
                del self._map_for(timer.key_group)[timer]
            raise


class HeapPriorityQueueSet(_DedupHeap):
    """A priority queue of InternalTimers with set semantics, for the key groups of
    `key_group_range` (out of `max_parallelism`).

    Adding a timer equal to one in the set (same timestamp, key and namespace) changes
    nothing and returns False; `remove` takes any equal timer. A timer of a key group outside
    the range raises KeyGroupError naming it."""

    __slots__ = ("_maps", "_first", "_range")

    def __init__(self, key_group_range: KeyGroupRange, max_parallelism: int) -> None:
        super().__init__()
        _check_key_groups(key_group_range, max_parallelism)
        self._range = key_group_range
        self._first = key_group_range.start
        self._maps: list[dict[InternalTimer, InternalTimer]] = [
            {} for _ in range(len(key_group_range))]

    def __repr__(self) -> str:
        return (f"<HeapPriorityQueueSet key_groups={self._range.start}..{self._range.end} "
                f"size={len(self)} head={self.peek()!r}>")

    def _map_for(self, key_group: int) -> dict[InternalTimer, InternalTimer]:
        index = key_group - self._first
        maps = self._maps
        if index < 0 or index >= len(maps):
            raise _outside(key_group, self._range)
        return maps[index]

    def get_subset_for_key_group(self, key_group: int) -> set[InternalTimer]:
        """A new set of the timers of `key_group`."""
        return set(self._map_for(key_group))

    def clear(self) -> None:
        super().clear()
        for dedup in self._maps:
            dedup.clear()


def _outside(key_group: int, key_groups: KeyGroupRange) -> KeyGroupError:
    return KeyGroupError(
        f"timer of key group {key_group} is outside this queue's key groups "
        f"{key_groups.start}..{key_groups.end}: a timer belongs to the operator that owns "
        "its key's key group", key_group=key_group)


def _check_key_groups(key_group_range: object, max_parallelism: object) -> None:
    """Raise unless `key_group_range` is a KeyGroupRange inside `max_parallelism` groups."""
    check_int("max_parallelism", max_parallelism, 1, MAX_MAX_PARALLELISM)
    if not isinstance(key_group_range, KeyGroupRange):
        raise TypeError(f"key_group_range must be a KeyGroupRange, got "
                        f"{type(key_group_range).__name__}")
    if key_group_range.end >= cast(int, max_parallelism):
        raise KeyGroupError(
            f"key group range {key_group_range.start}..{key_group_range.end} goes beyond "
            f"max_parallelism {max_parallelism} (key groups 0..{cast(int, max_parallelism) - 1})",
            key_group=key_group_range.end)
