"""Operator (non-keyed) list state: one list per operator instance.

`RuntimeContext.get_operator_list_state(name)` gives a list that is redistributed evenly
when a checkpoint is restored with another parallelism (element j of the old instances'
lists, joined in instance order, goes to instance j % new parallelism);
`get_union_list_state(name)` gives every new instance all elements. Both have the ListState
interface; their futures are always already completed, and they may be used in `open()`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any, Generic, TypeVar

from asyncstate.runtime.future import StateFuture, completed_future, completed_void_future
from asyncstate.runtime.requests import IteratorChunk, StateKind, StateRequestType
from asyncstate.serde import Packed, from_stored, stored_to_bytes, to_stored
from asyncstate.state.iterator import StateIterator
from asyncstate.state.list import stored_list

__all__ = ["OperatorListState", "RedistributionMode"]

T = TypeVar("T")


class RedistributionMode(enum.Enum):
    """How an operator list state is spread over instances on restore."""

    SPLIT = "split"
    UNION = "union"


class OperatorListState(Generic[T]):
    """A list held by one operator instance, snapshotted with the keyed state."""

    kind = StateKind.LIST

    def __init__(self, name: str, mode: RedistributionMode, items: Iterable[bytes] = ()) -> None:
        self.name = name
        self.mode = mode
        self._items: list[Any] = [Packed(b) for b in items]

    def __repr__(self) -> str:
        return f"<OperatorListState {self.name!r} {self.mode.value} items={len(self._items)}>"

    def get(self) -> StateFuture[StateIterator[T]]:
        """A future of an iterator over the elements."""
        chunk = IteratorChunk([from_stored(x) for x in self._items], None)
        return completed_future(StateIterator(self, StateRequestType.LIST_GET, chunk))  # type: ignore[arg-type]

    def add(self, value: T) -> StateFuture[None]:
        """Append an element."""
        self._items.append(to_stored(value, self.name))
        return completed_void_future()

    def add_all(self, values: Iterable[T]) -> StateFuture[None]:
        """Append elements in order."""
        self._items.extend(stored_list(values, self.name, "add_all()"))
        return completed_void_future()

    def update(self, values: Iterable[T]) -> StateFuture[None]:
        """Replace the elements."""
        self._items = stored_list(values, self.name, "update()")
        return completed_void_future()

    def clear(self) -> StateFuture[None]:
        """Remove every element."""
        self._items = []
        return completed_void_future()

    def snapshot(self) -> dict[str, Any]:
        """The checkpoint form: mode and msgpack bytes of each element."""
        return {"mode": self.mode.value, "items": [stored_to_bytes(x) for x in self._items]}
