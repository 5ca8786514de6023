"""The TTL states: every write carries its access time, every read the time it was issued.

A TTL state is the plain state of its kind with two differences, both made when a call is
issued:

1. a write stores `TtlValue(access time, stored value)` (each element of a list, each entry
   of a map);
2. a read carries a `TtlRead` (the state's policy, "now" and the access time), which the
   backend applies when it executes the read: expired entries are hidden (or returned, with
   RETURN_EXPIRED_IF_NOT_CLEANED_UP) and removed, fresh ones refreshed with
   ON_READ_AND_WRITE. The refresh is thereby a write in the read's own place in the key's
   order, on every backend: `s.value(); s.update(5)` ends with 5 without awaiting.

`TtlSupport` reads the times (processing time: the operator's clock, for both; event time:
"now" is the watermark, the access time the record's or timer's timestamp), keeps the
state's `TtlTracker` bound current, triggers incremental cleanup and tells cleanup with
timers of every access time it stamps.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final, Generic, Protocol, TypeVar

from asyncstate.clock import SystemClock
from asyncstate.errors import InvalidStateError
from asyncstate.runtime.future import StateFuture
from asyncstate.runtime.requests import IteratorChunk, StateRequestType
from asyncstate.serde import to_stored
from asyncstate.state.iterator import StateIterator
from asyncstate.state.list import ListState, stored_list
from asyncstate.state.map import MapState
from asyncstate.state.merging import AggregatingState, ReducingState
from asyncstate.state.ttl.layout import TtlPolicy, TtlRead, TtlValue, expiration
from asyncstate.state.ttl.tracker import TtlTracker
from asyncstate.state.value import ValueState

if TYPE_CHECKING:
    from asyncstate.clock import Clock
    from asyncstate.runtime.context import RecordContext
    from asyncstate.runtime.controller import AsyncExecutionController
    from asyncstate.state.descriptors import (
        AggregatingStateDescriptor,
        ListStateDescriptor,
        MapStateDescriptor,
        ReducingStateDescriptor,
        ValueStateDescriptor,
    )

__all__ = [
    "CleanupTimers",
    "EventTime",
    "IncrementalCleaner",
    "ProcessingTime",
    "TtlAggregatingState",
    "TtlListState",
    "TtlMapState",
    "TtlReducingState",
    "TtlSupport",
    "TtlValueState",
    "WatermarkSource",
]

T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")
IN = TypeVar("IN")
OUT = TypeVar("OUT")

_CLEAR: Final = StateRequestType.CLEAR  # compiled: Final alias
_VALUE_GET: Final = StateRequestType.VALUE_GET  # compiled: Final alias
_VALUE_UPDATE: Final = StateRequestType.VALUE_UPDATE  # compiled: Final alias
_LIST_GET: Final = StateRequestType.LIST_GET  # compiled: Final alias
_LIST_ADD: Final = StateRequestType.LIST_ADD  # compiled: Final alias
_LIST_ADD_ALL: Final = StateRequestType.LIST_ADD_ALL  # compiled: Final alias
_LIST_UPDATE: Final = StateRequestType.LIST_UPDATE  # compiled: Final alias
_MAP_GET: Final = StateRequestType.MAP_GET  # compiled: Final alias
_MAP_CONTAINS: Final = StateRequestType.MAP_CONTAINS  # compiled: Final alias
_MAP_PUT: Final = StateRequestType.MAP_PUT  # compiled: Final alias
_MAP_PUT_ALL: Final = StateRequestType.MAP_PUT_ALL  # compiled: Final alias
_MAP_REMOVE: Final = StateRequestType.MAP_REMOVE  # compiled: Final alias
_MAP_IS_EMPTY: Final = StateRequestType.MAP_IS_EMPTY  # compiled: Final alias
_MAP_ITER: Final = StateRequestType.MAP_ITER  # compiled: Final alias
_MAP_ITER_KEY: Final = StateRequestType.MAP_ITER_KEY  # compiled: Final alias
_MAP_ITER_VALUE: Final = StateRequestType.MAP_ITER_VALUE  # compiled: Final alias
# The wall clock read directly: calling SystemClock.now_ms (an interpreted method) costs
# about as much as the rest of a TTL state's bookkeeping per request.
_time_ns: Final = time.time_ns  # compiled: Final alias


class WatermarkSource(Protocol):
    """What event-time TTL reads of its operator (a `KeyedOperator`)."""

    def current_watermark(self) -> int:
        """The current event-time watermark (-2**63 before the first)."""


class IncrementalCleaner(Protocol):
    """The backend side of incremental cleanup (`asyncstate.backends.base.TtlBackend`)."""

    def ttl_cleanup_step(self, name: str, budget: int, now: int) -> None:
        """Check up to `budget` entries of state `name` from its cursor on, at `now`."""


class CleanupTimers(Protocol):
    """Cleanup with timers of one state (`asyncstate.state.ttl.timers.StateCleanupTimers`)."""

    def wrote(self, ctx: RecordContext, access: int) -> None:
        """`ctx` issued a write (or refreshing read) of the state stamped `access`."""


class ProcessingTime:
    """The time of processing-time TTL: the operator's clock."""

    __slots__ = ("clock",)

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def now(self) -> int:
        return self.clock.now_ms()


class EventTime:
    """The "now" of event-time TTL: the operator's current watermark."""

    __slots__ = ("operator",)

    def __init__(self, operator: WatermarkSource) -> None:
        self.operator = operator

    def now(self) -> int:
        return self.operator.current_watermark()


class TtlSupport:
    """The TTL side of one state: its policies, times, tracker and incremental cleanup.

    `event_time`: "now" is the `operator`'s watermark and the access time the record's
    timestamp (else both are the `clock`'s time). `incremental` is the cleanup size of
    incremental cleanup (0: off); `cleaner` runs it. `timers` is told of every access time
    a write or refreshing read stamps (None: no cleanup with timers).
    Reads use `policy`; `is_empty()` uses `peek_policy` (it refreshes nothing); the read inside
    a reducing or aggregating `add()` uses `merge_policy` (it neither refreshes nor removes:
    the add writes the entry anyway).
    """

    __slots__ = ("_clock", "_event", "_incremental", "_operator", "_wall", "cleaner",
                 "merge_policy", "name", "peek_policy", "policy", "timers", "tracker",
                 "ttl_ms")

    def __init__(self, name: str, policy: TtlPolicy, tracker: TtlTracker, *,
                 event_time: bool, clock: Clock, operator: WatermarkSource,
                 incremental: int, cleaner: IncrementalCleaner,
                 timers: CleanupTimers | None = None) -> None:
        self.name = name
        self.policy = policy
        self.peek_policy = TtlPolicy(policy.ttl_ms, False, policy.return_expired, True)
        self.merge_policy = TtlPolicy(policy.ttl_ms, False, policy.return_expired, False)
        self.ttl_ms = policy.ttl_ms
        self.tracker = tracker
        self._event = event_time
        self._clock = clock
        self._wall = type(clock) is SystemClock
        self._operator = operator
        self._incremental = incremental
        self.cleaner = cleaner
        self.timers = timers

    def __repr__(self) -> str:
        time = "event time" if self._event else "processing time"
        return f"<TtlSupport {self.name!r} ttl_ms={self.ttl_ms} {time}>"

    def _now(self) -> int:
        if self._event:
            return self._operator.current_watermark()
        if self._wall:
            return _time_ns() // 1_000_000
        return self._clock.now_ms()

    def _access(self, ctx: RecordContext) -> int:
        ts = ctx.timestamp
        if ts is None:
            raise InvalidStateError(
                f"state {self.name!r} has event-time TTL, which stamps each write (and each "
                f"refreshing read) with the record's timestamp, but the record with key "
                f"{ctx.key!r} has none: give the operator a timestamp_selector that returns "
                "one, or use processing-time TTL")
        return ts

    def _accessed(self, now: int) -> None:
        if self._incremental and now >= self.tracker.bound:
            self.cleaner.ttl_cleanup_step(self.name, self._incremental, now)

    def record_started(self) -> None:
        """A record (or timer firing) starts: incremental cleanup with
        run_cleanup_for_every_record."""
        self._accessed(self._now())

    def touch(self, ctx: RecordContext) -> None:
        """An access that neither reads nor stamps an entry (clear, remove)."""
        if self._incremental:
            self._accessed(self._now())

    def _make_read(self, ctx: RecordContext, arg: Any, policy: TtlPolicy) -> TtlRead:
        # Runs for every read, so `_now` and `_accessed` are inlined (as in `write_time`).
        refresh = policy.update_on_read
        now: int
        access: int
        if self._event:
            now = self._operator.current_watermark()
            access = self._access(ctx) if refresh else now
        elif self._wall:
            now = access = _time_ns() // 1_000_000
        else:
            now = access = self._clock.now_ms()
        tracker = self.tracker
        if refresh:
            # The refresh is a write of `access`: keep the tracker's bound (the call is
            # skipped in the common case, a bound already below).
            if access + self.ttl_ms < tracker.bound or tracker.passing:
                tracker.wrote(expiration(access, self.ttl_ms))
            timers = self.timers
            if timers is not None:
                timers.wrote(ctx, access)
        if self._incremental and now >= tracker.bound:
            self.cleaner.ttl_cleanup_step(self.name, self._incremental, now)
        return TtlRead(policy, now, access, arg)

    def read(self, ctx: RecordContext, arg: Any) -> TtlRead:
        """The payload of a read of the state (`arg`: the request's own payload)."""
        return self._make_read(ctx, arg, self.policy)

    def peek(self, ctx: RecordContext) -> TtlRead:
        """The payload of `is_empty()`."""
        return self._make_read(ctx, None, self.peek_policy)

    def merge_read(self, ctx: RecordContext) -> TtlRead:
        """The payload of the read inside a reducing or aggregating `add()`, made when the
        add is called. Its access time is the one the add's write stamps (`merge_stamp`;
        the read itself refreshes nothing), and the write is noted as `write_time` notes
        one (the tracker, cleanup with timers, incremental cleanup)."""
        access = self.write_time(ctx)
        now = self._operator.current_watermark() if self._event else access
        return TtlRead(self.merge_policy, now, access, None)

    def merge_stamp(self, read: TtlRead, stored: Any) -> TtlValue:
        """The entry a reducing or aggregating `add()` whose read is `read` writes."""
        return TtlValue(read.access, stored)

    def write_time(self, ctx: RecordContext) -> int:
        """The access time of a write issued now."""
        # Runs for every write, so `_now` and `_accessed` are inlined (as in `_make_read`).
        now: int
        access: int
        if self._event:
            access = self._access(ctx)
            now = self._operator.current_watermark()
        elif self._wall:
            now = access = _time_ns() // 1_000_000
        else:
            now = access = self._clock.now_ms()
        tracker = self.tracker
        # Keep the tracker's bound (the call is skipped in the common case, a bound already
        # below).
        if access + self.ttl_ms < tracker.bound or tracker.passing:
            tracker.wrote(expiration(access, self.ttl_ms))
        timers = self.timers
        if timers is not None:
            timers.wrote(ctx, access)
        if self._incremental and now >= tracker.bound:
            self.cleaner.ttl_cleanup_step(self.name, self._incremental, now)
        return access

    def stamp(self, ctx: RecordContext, stored: Any) -> TtlValue:
        """The entry a write of `stored` (a stored form) issued now stores."""
        return TtlValue(self.write_time(ctx), stored)


class TtlValueState(ValueState[T], Generic[T]):
    """A ValueState whose value expires (see the module docstring)."""

    __slots__ = ("_ttl",)

    def __init__(self, descriptor: ValueStateDescriptor[T],
                 controller: AsyncExecutionController, handle: Any, ttl: TtlSupport) -> None:
        super().__init__(descriptor, controller, handle)
        self._ttl = ttl

    def value(self) -> StateFuture[T | None]:
        """A future of the value, or None when unset (or expired: see the visibility)."""
        controller = self._controller
        ctx = controller.current(self)
        ttl = self._ttl
        return controller.handle_request(
            self, _VALUE_GET, ttl._make_read(ctx, None, ttl.policy), ctx)

    def update(self, value: T | None) -> StateFuture[None]:
        """Set the value, stamped with the access time; None clears it."""
        controller = self._controller
        ctx = controller.current(self)
        if value is None:
            self._ttl.touch(ctx)
            return controller.handle_request(self, _VALUE_UPDATE, None, ctx)
        stored = to_stored(value, self.name)
        entry = TtlValue(self._ttl.write_time(ctx), stored)
        return controller.handle_request(self, _VALUE_UPDATE, entry, ctx)

    def clear(self) -> StateFuture[None]:
        """Remove the value for the current key and namespace."""
        ctx = self._controller.current(self)
        self._ttl.touch(ctx)
        return self._controller.handle_request(self, _CLEAR, None, ctx)


class TtlListState(ListState[T], Generic[T]):
    """A ListState whose elements expire one by one."""

    __slots__ = ("_ttl",)

    def __init__(self, descriptor: ListStateDescriptor[T],
                 controller: AsyncExecutionController, handle: Any, ttl: TtlSupport) -> None:
        super().__init__(descriptor, controller, handle)
        self._ttl = ttl

    def get(self) -> StateFuture[StateIterator[T]]:
        """A future of an iterator over the elements that have not expired."""
        controller = self._controller
        ctx = controller.current(self)
        return controller.handle_request(
            self, _LIST_GET, self._ttl.read(ctx, None), ctx).then_apply(self._iterator)

    def add(self, value: T) -> StateFuture[None]:
        """Append a value, stamped with the access time."""
        controller = self._controller
        ctx = controller.current(self)
        stored = to_stored(value, self.name)
        return controller.handle_request(self, _LIST_ADD, self._ttl.stamp(ctx, stored), ctx)

    def _stamped(self, ctx: RecordContext, values: Any, what: str) -> list[TtlValue]:
        stored = stored_list(values, self.name, what)
        ts = self._ttl.write_time(ctx)
        return [TtlValue(ts, s) for s in stored]

    def add_all(self, values: Iterable[T]) -> StateFuture[None]:
        """Append values in order, each stamped with the access time."""
        controller = self._controller
        ctx = controller.current(self)
        return controller.handle_request(
            self, _LIST_ADD_ALL, self._stamped(ctx, values, "add_all()"), ctx)

    def update(self, values: Iterable[T]) -> StateFuture[None]:
        """Replace the list (an empty list clears it); every element gets the access time."""
        controller = self._controller
        ctx = controller.current(self)
        return controller.handle_request(
            self, _LIST_UPDATE, self._stamped(ctx, values, "update()"), ctx)

    def clear(self) -> StateFuture[None]:
        """Remove the list for the current key and namespace."""
        ctx = self._controller.current(self)
        self._ttl.touch(ctx)
        return self._controller.handle_request(self, _CLEAR, None, ctx)


class TtlMapState(MapState[K, V], Generic[K, V]):
    """A MapState whose entries expire one by one."""

    __slots__ = ("_ttl",)

    def __init__(self, descriptor: MapStateDescriptor[K, V],
                 controller: AsyncExecutionController, handle: Any, ttl: TtlSupport) -> None:
        super().__init__(descriptor, controller, handle)
        self._ttl = ttl

    def get(self, key: K) -> StateFuture[V | None]:
        """A future of the value of `key`, or None (absent, or expired: see the visibility)."""
        user_key = self._user_key(key)
        controller = self._controller
        ctx = controller.current(self)
        return controller.handle_request(self, _MAP_GET, self._ttl.read(ctx, user_key), ctx)

    def put(self, key: K, value: V | None) -> StateFuture[None]:
        """Set `key` to `value`, stamped with the access time (None removes it)."""
        user_key = self._user_key(key)
        controller = self._controller
        ctx = controller.current(self)
        if value is None:
            self._ttl.touch(ctx)
            return controller.handle_request(self, _MAP_PUT, (user_key, None), ctx)
        stored = to_stored(value, self.name)
        return controller.handle_request(
            self, _MAP_PUT, (user_key, self._ttl.stamp(ctx, stored)), ctx)

    def put_all(self, mapping: Mapping[K, V]) -> StateFuture[None]:
        """Set every key of `mapping`, all stamped with one access time."""
        if not isinstance(mapping, Mapping):
            raise TypeError(f"put_all() of state {self.name!r} expects a mapping, "
                            f"got {type(mapping).__name__}")
        items = [(self._user_key(k), None if v is None else to_stored(v, self.name))
                 for k, v in mapping.items()]
        controller = self._controller
        ctx = controller.current(self)
        ts = self._ttl.write_time(ctx)
        payload = [(uk, None if stored is None else TtlValue(ts, stored))
                   for uk, stored in items]
        return controller.handle_request(self, _MAP_PUT_ALL, payload, ctx)

    def remove(self, key: K) -> StateFuture[None]:
        """Remove `key`."""
        user_key = self._user_key(key)
        controller = self._controller
        ctx = controller.current(self)
        self._ttl.touch(ctx)
        return controller.handle_request(self, _MAP_REMOVE, user_key, ctx)

    def contains(self, key: K) -> StateFuture[bool]:
        """A future of whether `key` is present (expired entries: see the visibility)."""
        user_key = self._user_key(key)
        controller = self._controller
        ctx = controller.current(self)
        return controller.handle_request(
            self, _MAP_CONTAINS, self._ttl.read(ctx, user_key), ctx)

    def is_empty(self) -> StateFuture[bool]:
        """A future of whether the map has no entry a read would return."""
        controller = self._controller
        ctx = controller.current(self)
        return controller.handle_request(self, _MAP_IS_EMPTY, self._ttl.peek(ctx), ctx)

    def _iteration(self, request_type: StateRequestType) -> StateFuture[IteratorChunk]:
        controller = self._controller
        ctx = controller.current(self)
        return controller.handle_request(self, request_type, self._ttl.read(ctx, None), ctx)

    def entries(self) -> StateFuture[StateIterator[tuple[K, V]]]:
        """A future of an iterator over the (key, value) tuples that have not expired."""
        return self._iteration(_MAP_ITER).then_apply(self._entries)

    def keys(self) -> StateFuture[StateIterator[K]]:
        """A future of an iterator over the keys of entries that have not expired."""
        return self._iteration(_MAP_ITER_KEY).then_apply(self._keys)

    def values(self) -> StateFuture[StateIterator[V]]:
        """A future of an iterator over the values of entries that have not expired."""
        return self._iteration(_MAP_ITER_VALUE).then_apply(self._values)

    def clear(self) -> StateFuture[None]:
        """Remove every entry for the current key and namespace."""
        ctx = self._controller.current(self)
        self._ttl.touch(ctx)
        return self._controller.handle_request(self, _CLEAR, None, ctx)


class TtlReducingState(ReducingState[T], Generic[T]):
    """A ReducingState whose value expires as a whole. `add()` folds into an expired value
    only with RETURN_EXPIRED_IF_NOT_CLEANED_UP (otherwise it starts afresh), as in Flink."""

    __slots__ = ()

    def __init__(self, descriptor: ReducingStateDescriptor[T],
                 controller: AsyncExecutionController, handle: Any, ttl: TtlSupport) -> None:
        super().__init__(descriptor, controller, handle, ttl)


class TtlAggregatingState(AggregatingState[IN, OUT], Generic[IN, OUT]):
    """An AggregatingState whose accumulator expires as a whole (see TtlReducingState)."""

    __slots__ = ()

    def __init__(self, descriptor: AggregatingStateDescriptor[IN, OUT],
                 controller: AsyncExecutionController, handle: Any, ttl: TtlSupport) -> None:
        super().__init__(descriptor, controller, handle, ttl)
