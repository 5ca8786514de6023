"""ValueState: one value per key and namespace."""

from __future__ import annotations

from typing import Final, Generic, TypeVar

from asyncstate.runtime.future import StateFuture
from asyncstate.runtime.requests import StateRequestType
from asyncstate.serde import to_stored
from asyncstate.state.base import InternalState

__all__ = ["ValueState"]

T = TypeVar("T")
_GET: Final = StateRequestType.VALUE_GET  # compiled: Final alias
_UPDATE: Final = StateRequestType.VALUE_UPDATE  # compiled: Final alias


class ValueState(InternalState, Generic[T]):
    """A single value per key; None when unset."""

    __slots__ = ()

    def value(self) -> StateFuture[T | None]:
        """A future of the value, or None when unset."""
        return self._controller.handle_request(self, _GET, None)

    def update(self, value: T | None) -> StateFuture[None]:
        """Set the value; None clears it."""
        stored = None if value is None else to_stored(value, self.name)
        return self._controller.handle_request(self, _UPDATE, stored)

