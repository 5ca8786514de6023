"""ListState: a list of values per key and namespace."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final, Generic, TypeVar

from asyncstate.runtime.future import StateFuture
from asyncstate.runtime.requests import IteratorChunk, StateRequestType
from asyncstate.serde import to_stored
from asyncstate.state.base import InternalState
from asyncstate.state.iterator import StateIterator

__all__ = ["ListState", "stored_list"]

T = TypeVar("T")
_GET: Final = StateRequestType.LIST_GET  # compiled: Final alias
_ADD: Final = StateRequestType.LIST_ADD  # compiled: Final alias
_UPDATE: Final = StateRequestType.LIST_UPDATE  # compiled: Final alias
_ADD_ALL: Final = StateRequestType.LIST_ADD_ALL  # compiled: Final alias


def stored_list(values: Any, state_name: str, what: str) -> list[Any]:
    """Stored forms of `values`; rejects str, bytes and mappings, which are not lists, and
    anything not iterable."""
    # compiled: typed as Any (the compiled module runs these checks, not a type check of its
    # own).
    if isinstance(values, (str, bytes, bytearray, dict)) or not isinstance(values, Iterable):
        raise TypeError(f"{what} of state {state_name!r} expects a list of values, "
                        f"got {type(values).__name__}")
    return [to_stored(v, state_name) for v in values]


class ListState(InternalState, Generic[T]):
    """A list of values per key; appends never read or rewrite the list."""

    __slots__ = ()

    def get(self) -> StateFuture[StateIterator[T]]:
        """A future of an iterator over the values (empty when unset)."""
        return self._controller.handle_request(self, _GET, None).then_apply(self._iterator)

    def _iterator(self, chunk: IteratorChunk) -> StateIterator[T]:
        return StateIterator(self, _GET, chunk)

    def add(self, value: T) -> StateFuture[None]:
        """Append a value."""
        return self._controller.handle_request(self, _ADD, to_stored(value, self.name))

    def add_all(self, values: Iterable[T]) -> StateFuture[None]:
        """Append values in order (an empty list changes nothing)."""
        stored = stored_list(values, self.name, "add_all()")
        return self._controller.handle_request(self, _ADD_ALL, stored)

    def update(self, values: Iterable[T]) -> StateFuture[None]:
        """Replace the list (an empty list clears it)."""
        stored = stored_list(values, self.name, "update()")
        return self._controller.handle_request(self, _UPDATE, stored)
