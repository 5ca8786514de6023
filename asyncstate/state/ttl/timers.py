"""Exact cleanup with timers (strategy 5): expired entries go when their cleanup timer fires,
even if their key is never read again.

1. Every write of a state with `cleanup_with_timers()` (and every read that refreshes, with
   ON_READ_AND_WRITE) tells `StateCleanupTimers.wrote` the access time it stamps, when the
   call is issued. The entry's expiration, rounded up to a multiple of the granularity, is
   the time of a cleanup timer for the record's key, in an internal namespace naming the
   state and the state's namespace: a processing-time timer for processing-time TTL, an
   event-time timer for event-time TTL.
2. A (key, namespace) remembers the latest timer registered for it while that timer is
   pending, so a key written again and again within one granularity step registers once; a
   later expiration registers a later timer and leaves the earlier one pending. A
   (state, key, namespace) therefore holds at most ttl_ms / granularity + 2 pending timers,
   and the memory is bounded by the entries (and by the (key, namespace)s cleared since).
3. A firing runs under its key, in order with the key's records, as any timer does. It
   reads the whole entry (every element of a list, every entry of a map) with a read that
   neither refreshes nor returns anything expired and removes everything it finds expired at
   the timer's time (not at the time the firing runs, which may be later: each entry goes
   when its own timer fires, whatever the other timers of its key do). An entry refreshed
   since the timer was registered is fresh and stays: its refresh registered the timer of
   its new expiration (step 1), so the firing registers nothing.

The timers are the operator's own (`TimerService.register_internal`): they never call
`on_timer`, need none, go into checkpoints with the user's timers and follow their keys on
rescaling. A firing for a state that is not declared with cleanup with timers (any more)
does nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import msgpack

from asyncstate.function import TimeDomain
from asyncstate.runtime.requests import StateKind, StateRequestType
from asyncstate.serde import NONE_BYTES
from asyncstate.state.iterator import StateIterator
from asyncstate.state.ttl.layout import MAX_TIMESTAMP, TtlPolicy, TtlRead, expiration
from asyncstate.timers.service import is_internal_namespace

if TYPE_CHECKING:
    from asyncstate.runtime.context import RecordContext
    from asyncstate.runtime.controller import AsyncExecutionController
    from asyncstate.runtime.future import StateFuture
    from asyncstate.state.base import InternalState
    from asyncstate.timers.service import TimerService

__all__ = ["StateCleanupTimers", "TtlTimers", "cleanup_namespace", "due_time"]

# The tag of a cleanup timer's namespace: {"ttl": [state name, state namespace bytes]}.
_TAG: Final = "ttl"
_T = StateRequestType
# A read by a firing: no refresh, nothing expired returned, the expired entries removed.
_SINGLE_READS: Final = {StateKind.VALUE: _T.VALUE_GET, StateKind.REDUCING: _T.REDUCING_GET,
                        StateKind.AGGREGATING: _T.AGGREGATING_GET}
_WALKS: Final = {StateKind.LIST: _T.LIST_GET, StateKind.MAP: _T.MAP_ITER_KEY}


def cleanup_namespace(state_name: str, namespace_bytes: bytes) -> bytes:
    """The internal timer namespace of the cleanup timers of `state_name` in a namespace."""
    data: bytes = msgpack.packb({_TAG: [state_name, namespace_bytes]}, use_bin_type=True)
    return data


def due_time(access: int, ttl_ms: int, granularity_ms: int) -> int:
    """The time of the cleanup timer of an entry stamped `access`: its expiration rounded up
    to a multiple of `granularity_ms` (clamped to 2**63 - 1)."""
    exp = expiration(access, ttl_ms)
    due = -(-exp // granularity_ms) * granularity_ms
    return due if due <= MAX_TIMESTAMP else MAX_TIMESTAMP


def _ignore(item: Any) -> None:
    return None


class StateCleanupTimers:
    """Cleanup with timers of one state (see the module docstring)."""

    __slots__ = ("_controller", "_covered", "_namespaces", "_read_policy", "domain",
                 "granularity_ms", "name", "owner", "state", "ttl_ms")

    def __init__(self, owner: TtlTimers, name: str, ttl_ms: int, granularity_ms: int,
                 domain: TimeDomain, controller: AsyncExecutionController) -> None:
        self.owner = owner
        self.name = name
        self.ttl_ms = ttl_ms
        self.granularity_ms = granularity_ms
        self.domain = domain
        self._controller = controller
        self.state: InternalState | None = None  # bound once the state object exists
        self._read_policy = TtlPolicy(ttl_ms, False, False, True)
        # (key bytes, namespace bytes) -> the latest cleanup timer registered while pending.
        self._covered: dict[tuple[bytes, bytes], int] = {}
        self._namespaces = {NONE_BYTES: cleanup_namespace(name, NONE_BYTES)}

    def __repr__(self) -> str:
        return (f"<StateCleanupTimers {self.name!r} ttl_ms={self.ttl_ms} "
                f"granularity_ms={self.granularity_ms} pending_keys={len(self._covered)}>")

    def bind(self, state: InternalState) -> None:
        """The state object whose writes this serves."""
        self.state = state

    def wrote(self, ctx: RecordContext, access: int) -> None:
        """`ctx` issued a write (or refreshing read) stamped `access`: make sure a cleanup
        timer covers its expiration."""
        due = due_time(access, self.ttl_ms, self.granularity_ms)
        ns = self._controller.namespace_of(ctx, self.state)
        slot = (ctx.key_bytes, ns)
        covered = self._covered.get(slot)
        if covered == due:
            return
        if covered is None or due > covered:
            self._covered[slot] = due
        timer_ns = self._namespaces.get(ns)
        if timer_ns is None:
            timer_ns = cleanup_namespace(self.name, ns)
            if len(self._namespaces) < 1024:  # user namespaces may be unbounded
                self._namespaces[ns] = timer_ns
        self.owner.service().register_internal(ctx, self.domain, due, timer_ns)

    def fire(self, ctx: RecordContext, ns: bytes, timestamp: int) -> Any:
        """Run the firing of the cleanup timer of (`ctx`'s key, `ns`) at `timestamp`: remove
        what has expired (a future or coroutine of the work, or None)."""
        slot = (ctx.key_bytes, ns)
        covered = self._covered.get(slot)
        if covered is not None and covered <= timestamp:
            del self._covered[slot]
        state = self.state
        if state is None:
            return None
        if ctx.namespaces is None:
            ctx.namespaces = {}
        ctx.namespaces[state] = ns  # later chunks of a walk read this namespace too
        # Expiry is checked at the timer's time, not at the (maybe later) time it runs: an
        # entry goes exactly when its own timer fires, whatever other timers of its key do.
        read = TtlRead(self._read_policy, timestamp, timestamp, None)
        single = _SINGLE_READS.get(state.kind)
        if single is not None:
            return self._controller.handle_request(state, single, read, ctx, ns)
        return self._walk(state, _WALKS[state.kind], read, ctx, ns)

    async def _walk(self, state: InternalState, request_type: StateRequestType,
                    read: TtlRead, ctx: RecordContext, ns: bytes) -> None:
        first: StateFuture[Any] = self._controller.handle_request(
            state, request_type, read, ctx, ns)
        chunk = await first
        # Every chunk is read: the expired elements or entries of each go as it is read.
        await StateIterator(state, request_type, chunk).on_next(_ignore)


class TtlTimers:
    """The cleanup timers of one operator's states: `declare` one state's, `fire` runs a
    firing of any of them (`RecordRunner.internal_timers`)."""

    __slots__ = ("_controller", "_service", "_states")

    def __init__(self, controller: AsyncExecutionController) -> None:
        self._controller = controller
        self._service: TimerService | None = None
        self._states: dict[str, StateCleanupTimers] = {}

    def __repr__(self) -> str:
        return f"<TtlTimers states={sorted(self._states)}>"

    def attach(self, service: TimerService) -> None:
        """The operator's timer service (built before any state is declared)."""
        self._service = service

    def service(self) -> TimerService:
        """The operator's timer service."""
        assert self._service is not None, "the timer service is built before open()"
        return self._service

    def declare(self, name: str, ttl_ms: int, granularity_ms: int, *,
                event_time: bool) -> StateCleanupTimers:
        """Cleanup with timers for state `name` (bind the state object to the result)."""
        timers = StateCleanupTimers(
            self, name, ttl_ms, granularity_ms,
            TimeDomain.EVENT_TIME if event_time else TimeDomain.PROCESSING_TIME,
            self._controller)
        self._states[name] = timers
        return timers

    def fire(self, timestamp: int, ctx: RecordContext) -> Any:
        """The firing of one cleanup timer (`ctx.record`), under its key."""
        ns_bytes: bytes = ctx.record.namespace_bytes
        assert is_internal_namespace(ns_bytes)
        tagged = msgpack.unpackb(ns_bytes, raw=False, strict_map_key=False)
        parts = tagged.get(_TAG) if isinstance(tagged, dict) else None
        if not (isinstance(parts, list) and len(parts) == 2):
            return None  # an internal timer of another kind: none exists yet
        timers = self._states.get(parts[0])
        if timers is None or timers.domain is not ctx.time_domain:
            return None  # the state is not (any more) cleaned up with timers
        return timers.fire(ctx, parts[1], timestamp)
