"""An array-backed binary min-heap whose elements know their index (Flink's
`HeapPriorityQueue`).

The heap lives in a list, 1-based: the head is at index 1, the parent of `i` at ``i >> 1``,
its children at ``2i`` and ``2i + 1``; index 0 holds a placeholder that is never read. Each
element stores its current index (`HeapPriorityQueueElement.heap_index`, 0 while it is in no
heap), so `remove(element)` and `adjust_modified_element(element)` find it without a search:
O(log n), where a plain `heapq` list needs O(n).

An element can be in one heap at a time (the index is the heap's bookkeeping): `add` refuses
an element whose index says it is already in one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Final, TypeVar, cast

from asyncstate.errors import InvalidStateError
from asyncstate.timers.base import InternalPriorityQueue

__all__ = ["NOT_CONTAINED", "HeapPriorityQueue", "HeapPriorityQueueElement"]

NOT_CONTAINED: Final = 0  # heap_index of an element that is in no heap
_HEAD: Final = 1


class HeapPriorityQueueElement:
    """What a HeapPriorityQueue holds: an element with a priority and a slot for its index.

    Subclasses implement `priority_less_than` and set ``heap_index = NOT_CONTAINED`` in their
    `__init__`. Only the heap that holds the element writes `heap_index`."""

    __slots__ = ("heap_index",)

    def __init__(self) -> None:
        self.heap_index = NOT_CONTAINED

    def priority_less_than(self, other: HeapPriorityQueueElement) -> bool:
        """True if this element comes strictly before `other` (a strict weak order)."""
        raise NotImplementedError(f"{type(self).__name__} does not define priority_less_than")


E = TypeVar("E", bound=HeapPriorityQueueElement)

# Index 0 of every heap list: never read, so one shared placeholder does.
_PLACEHOLDER: Final = HeapPriorityQueueElement()


class HeapPriorityQueue(InternalPriorityQueue[E]):
    """A binary min-heap of HeapPriorityQueueElements with O(log n) removal by element.

    `add`, `poll`, `remove` and `adjust_modified_element` are O(log n); `peek`, `len` and
    `is_empty` O(1). Removal is by identity (the element's stored index), not by equality.
    Elements that compare equal come out in no particular order."""

    __slots__ = ("_queue",)

    def __init__(self) -> None:
        self._queue: list[E] = [cast(E, _PLACEHOLDER)]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} size={len(self)} head={self.peek()!r}>"

    def __len__(self) -> int:
        return len(self._queue) - 1

    def is_empty(self) -> bool:
        return len(self._queue) == 1

    def peek(self) -> E | None:
        queue = self._queue
        return queue[_HEAD] if len(queue) > 1 else None

    def poll(self) -> E | None:
        if len(self._queue) == 1:
            return None
        return self._remove_at(_HEAD)

    def add(self, element: E) -> bool:
        """Add `element` (which must be in no heap); True if it is the new head."""
        if element.heap_index != NOT_CONTAINED:
            raise _already_contained(element)
        return self._push(element)

    def remove(self, element: E) -> bool:
        """Remove this very `element` (identity, not equality); True if it was the head.
        False, and nothing changes, when it is not in this heap."""
        index = element.heap_index
        queue = self._queue
        if index <= NOT_CONTAINED or index >= len(queue) or queue[index] is not element:
            return False
        self._remove_at(index)
        return index == _HEAD

    def adjust_modified_element(self, element: E) -> None:
        """Restore the heap order after the priority of `element`, which is in this heap,
        changed (a no-op if it is not in this heap)."""
        index = element.heap_index
        queue = self._queue
        if NOT_CONTAINED < index < len(queue) and queue[index] is element:
            self._adjust_at(element, index)

    def add_all(self, elements: Iterable[E]) -> None:
        """Add every element (each in no heap, none twice): the list grows once, and a
        large addition is ordered bottom-up in O(n) instead of n sift-ups."""
        queue = self._queue
        start = len(queue)
        added = list(elements)
        for element in added:
            if element.heap_index != NOT_CONTAINED:
                # Also catches an element listed twice: the first copy was marked below.
                for marked in queue[start:]:
                    marked.heap_index = NOT_CONTAINED
                del queue[start:]
                raise _already_contained(element)
            element.heap_index = len(queue)
            queue.append(element)
        size = len(queue) - 1
        if len(added) >= start - 1:
            for index in range(size >> 1, 0, -1):
                self._sift_down(queue[index], index)
        else:
            for index in range(start, size + 1):
                self._sift_up(queue[index], index)

    def __iter__(self) -> Iterator[E]:
        return iter(self._queue[1:])

    def to_list(self) -> list[E]:
        """The elements in heap-array order (no particular priority order), as a new list."""
        return self._queue[1:]

    def clear(self) -> None:
        queue = self._queue
        for element in queue[1:]:
            element.heap_index = NOT_CONTAINED
        del queue[1:]

    # -- the heap operations -----------------------------------------------------------------

    def _push(self, element: E) -> bool:
        queue = self._queue
        queue.append(element)
        return self._sift_up(element, len(queue) - 1) == _HEAD

    def _remove_at(self, index: int) -> E:
        queue = self._queue
        removed = queue[index]
        last = queue.pop()
        if index < len(queue):  # `removed` was not the last element: `last` fills its slot
            self._adjust_at(last, index)
        removed.heap_index = NOT_CONTAINED
        return removed

    def _adjust_at(self, element: E, index: int) -> None:
        """Place `element`, which fills the slot `index`, where the heap order wants it."""
        if index > _HEAD and element.priority_less_than(self._queue[index >> 1]):
            self._sift_up(element, index)
        else:
            self._sift_down(element, index)

    def _sift_up(self, element: E, index: int, top: int = _HEAD) -> int:
        """Move `element` from `index` towards the head, no higher than `top`; returns where
        it ends."""
        queue = self._queue
        while index > top:
            parent_index = index >> 1
            parent = queue[parent_index]
            if not element.priority_less_than(parent):
                break
            queue[index] = parent
            parent.heap_index = index
            index = parent_index
        queue[index] = element
        element.heap_index = index
        return index

    def _sift_down(self, element: E, index: int) -> None:
        """Move `element` from `index` towards the leaves (within the subtree of `index`).

        Floyd's bottom-up variant, as `heapq` does: the hole at `index` moves down along the
        smaller children to a leaf (one comparison per level instead of two), then `element`
        sifts up from there, no higher than `index`. Elements placed from the bottom (a
        poll's replacement, a partition whose head grew) rarely climb far."""
        top = index
        queue = self._queue
        size = len(queue) - 1
        child_index = index << 1
        while child_index <= size:
            child = queue[child_index]
            if child_index < size:
                right = queue[child_index + 1]
                if right.priority_less_than(child):
                    child_index += 1
                    child = right
            queue[index] = child
            child.heap_index = index
            index = child_index
            child_index = index << 1
        self._sift_up(element, index, top)


def _already_contained(element: HeapPriorityQueueElement) -> InvalidStateError:
    return InvalidStateError(
        f"{element!r} is already in a heap (heap_index {element.heap_index}): an element can "
        "be in one heap at a time; add an equal, new element instead")
