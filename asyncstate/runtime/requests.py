"""State requests: what a state call asks of the backend, and the request types."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from asyncstate.runtime.context import RecordContext
    from asyncstate.runtime.future import StateFuture

__all__ = ["IteratorChunk", "RequestState", "StateKind", "StateRequest", "StateRequestType"]


class StateKind(enum.Enum):
    """The kind of a state, which decides how a backend stores it."""

    VALUE = "value"
    LIST = "list"
    MAP = "map"
    REDUCING = "reducing"
    AGGREGATING = "aggregating"


class StateRequestType(enum.IntEnum):
    """What a request asks; payloads are in stored form (see `asyncstate.serde`)."""

    SYNC_POINT = 0  # ordering only; never reaches a backend
    CLEAR = 1  # State.clear(): remove everything of (state, key, namespace)
    VALUE_GET = 2  # ValueState.value() -> value or None
    VALUE_UPDATE = 3  # ValueState.update(v); payload None removes
    LIST_GET = 4  # ListState.get() -> IteratorChunk of values
    LIST_ADD = 5  # ListState.add(v)
    LIST_UPDATE = 6  # ListState.update(vs); payload is a list, empty clears
    LIST_ADD_ALL = 7  # ListState.add_all(vs); payload is a list, empty changes nothing
    MAP_GET = 8  # MapState.get(k) -> value or None; payload is the user key's bytes
    MAP_CONTAINS = 9  # MapState.contains(k) -> bool
    MAP_PUT = 10  # MapState.put(k, v); payload (user key bytes, stored value or None)
    MAP_PUT_ALL = 11  # MapState.put_all(m); payload list of (user key bytes, stored value)
    MAP_ITER = 12  # MapState.entries() -> IteratorChunk of (key, value) tuples
    MAP_ITER_KEY = 13  # MapState.keys() -> IteratorChunk of keys
    MAP_ITER_VALUE = 14  # MapState.values() -> IteratorChunk of values
    MAP_REMOVE = 15  # MapState.remove(k)
    MAP_IS_EMPTY = 16  # MapState.is_empty() -> bool
    ITERATOR_LOADING = 17  # next chunk; payload (original request type, continuation)
    REDUCING_GET = 18  # ReducingState.get() -> value or None
    REDUCING_ADD = 19  # ReducingState.add(): stores the new reduced value (a put)
    AGGREGATING_GET = 20  # AggregatingState.get(): the accumulator or None
    AGGREGATING_ADD = 21  # AggregatingState.add(): stores the new accumulator (a put)


class IteratorChunk:
    """One loaded chunk of an iteration: its items, and the continuation for the next chunk
    (None when this chunk is the last). Backends choose what a continuation holds."""

    __slots__ = ("items", "continuation")

    def __init__(self, items: list[Any], continuation: Any = None) -> None:
        self.items = items
        self.continuation = continuation

    def __repr__(self) -> str:
        more = "more" if self.continuation is not None else "last"
        return f"<IteratorChunk {len(self.items)} items, {more}>"


class RequestState(Protocol):
    """What an executor reads from the state of a request (a state object's public side)."""

    name: str
    kind: StateKind
    handle: Any  # what the executor's register_state returned for this state


class StateRequest:
    """One state request: state, type, payload, the namespace bytes captured when it was
    issued, the record context it belongs to, and the future it completes."""

    __slots__ = ("state", "request_type", "payload", "namespace", "context", "future")

    def __init__(self, state: RequestState | None, request_type: StateRequestType,
                 payload: Any, namespace: bytes, context: RecordContext,
                 future: StateFuture[Any]) -> None:
        self.state = state
        self.request_type = request_type
        self.payload = payload
        self.namespace = namespace
        self.context = context
        self.future = future

    @property
    def key_bytes(self) -> bytes:
        """Canonical bytes of the record's key."""
        return self.context.key_bytes

    @property
    def key_group(self) -> int:
        """Key group of the record's key."""
        return self.context.key_group

    def __repr__(self) -> str:
        name = self.state.name if self.state is not None else None
        return f"<StateRequest {self.request_type.name} state={name!r} key={self.context.key!r}>"
