"""The interface every timer queue implements (Flink's `InternalPriorityQueue`).

`InternalPriorityQueue` is a native base class, not a Protocol, so that compiled code calls
the methods of whichever queue it holds (a heap set, a RocksDB set, a partitioned queue)
through a method table instead of an attribute lookup. `KeyGroupedInternalPriorityQueue` adds
the per-key-group view that checkpoints need; it is a Protocol, for typing only.

`add` and `remove` report whether the *head* changed (the smallest element is another one
afterwards, or may be): a timer service uses that to reschedule its next wake-up. They never
report whether the set itself changed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Generic, Protocol, TypeVar

__all__ = ["InternalPriorityQueue", "KeyGroupedInternalPriorityQueue"]

E = TypeVar("E")


class InternalPriorityQueue(Generic[E]):
    """A priority queue: the smallest element first (see each implementation for its order).

    Not thread-safe: every call comes from the thread that owns the operator (the loop
    thread)."""

    __slots__ = ()

    def peek(self) -> E | None:
        """The smallest element, left in the queue; None when empty."""
        raise NotImplementedError

    def poll(self) -> E | None:
        """Remove and return the smallest element; None when empty."""
        raise NotImplementedError

    def add(self, element: E) -> bool:
        """Add `element`; True if it is the new head (False: the head is unchanged)."""
        raise NotImplementedError

    def remove(self, element: E) -> bool:
        """Remove `element`; True if the head changed (it was the head)."""
        raise NotImplementedError

    def add_all(self, elements: Iterable[E]) -> None:
        """Add every element of `elements` (a restore)."""
        raise NotImplementedError

    def is_empty(self) -> bool:
        """True when the queue holds no element."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[E]:
        """The elements, in no particular order (a copy: the queue may change meanwhile)."""
        raise NotImplementedError

    def clear(self) -> None:
        """Remove every element."""
        raise NotImplementedError


class KeyGroupedInternalPriorityQueue(Protocol[E]):
    """A priority queue whose elements belong to key groups (Flink's
    `KeyGroupedInternalPriorityQueue`): what a timer service holds, and snapshots per key
    group."""

    def peek(self) -> E | None: ...
    def poll(self) -> E | None: ...
    def add(self, element: E) -> bool: ...
    def remove(self, element: E) -> bool: ...
    def add_all(self, elements: Iterable[E]) -> None: ...
    def is_empty(self) -> bool: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[E]: ...
    def clear(self) -> None: ...

    def get_subset_for_key_group(self, key_group: int) -> set[E]:
        """A new set of the elements of `key_group` (KeyGroupError outside the queue's key
        groups)."""
        ...
