"""MapState: a map from user keys to values per key and namespace."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Generic, TypeVar

from asyncstate.runtime.future import StateFuture
from asyncstate.runtime.requests import IteratorChunk, StateRequestType
from asyncstate.serde import canonical_key, to_stored
from asyncstate.state.base import InternalState
from asyncstate.state.iterator import StateIterator

__all__ = ["MapState"]

K = TypeVar("K")
V = TypeVar("V")
_T = StateRequestType


class MapState(InternalState, Generic[K, V]):
    """User keys (key-like values, compared by canonical bytes) to values. `put(k, None)`
    removes `k`. Iteration order is unspecified."""

    __slots__ = ()

    def _user_key(self, key: K) -> bytes:
        return canonical_key(key, "map key", self.name)

    def get(self, key: K) -> StateFuture[V | None]:
        """A future of the value of `key`, or None."""
        return self._controller.handle_request(self, _T.MAP_GET, self._user_key(key))

    def put(self, key: K, value: V | None) -> StateFuture[None]:
        """Set `key` to `value` (None removes it)."""
        stored = None if value is None else to_stored(value, self.name)
        return self._controller.handle_request(self, _T.MAP_PUT, (self._user_key(key), stored))

    def put_all(self, mapping: Mapping[K, V]) -> StateFuture[None]:
        """Set every key of `mapping`."""
        if not isinstance(mapping, Mapping):
            raise TypeError(f"put_all() of state {self.name!r} expects a mapping, "
                            f"got {type(mapping).__name__}")
        payload = [(self._user_key(k), None if v is None else to_stored(v, self.name))
                   for k, v in mapping.items()]
        return self._controller.handle_request(self, _T.MAP_PUT_ALL, payload)

    def remove(self, key: K) -> StateFuture[None]:
        """Remove `key`."""
        return self._controller.handle_request(self, _T.MAP_REMOVE, self._user_key(key))

    def contains(self, key: K) -> StateFuture[bool]:
        """A future of whether `key` is present."""
        return self._controller.handle_request(self, _T.MAP_CONTAINS, self._user_key(key))

    def is_empty(self) -> StateFuture[bool]:
        """A future of whether the map has no entries."""
        return self._controller.handle_request(self, _T.MAP_IS_EMPTY, None)

    def entries(self) -> StateFuture[StateIterator[tuple[K, V]]]:
        """A future of an iterator over (key, value) tuples."""
        return self._controller.handle_request(self, _T.MAP_ITER, None).then_apply(self._entries)

    def keys(self) -> StateFuture[StateIterator[K]]:
        """A future of an iterator over the keys."""
        return self._controller.handle_request(self, _T.MAP_ITER_KEY, None).then_apply(self._keys)

    def values(self) -> StateFuture[StateIterator[V]]:
        """A future of an iterator over the values."""
        return self._controller.handle_request(self, _T.MAP_ITER_VALUE, None).then_apply(
            self._values)

    def _entries(self, chunk: IteratorChunk) -> StateIterator[tuple[K, V]]:
        return StateIterator(self, _T.MAP_ITER, chunk)

    def _keys(self, chunk: IteratorChunk) -> StateIterator[K]:
        return StateIterator(self, _T.MAP_ITER_KEY, chunk)

    def _values(self, chunk: IteratorChunk) -> StateIterator[V]:
        return StateIterator(self, _T.MAP_ITER_VALUE, chunk)
