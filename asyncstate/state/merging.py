"""ReducingState and AggregatingState: read-modify-write states.

`add(v)` reads the stored value, folds `v` (as it was at the call) in and writes the result
back. Calls of one record on one such state run one after another (a later `add`, `clear` or
`get` waits for a pending `add` or `clear`, whether that one succeeds or fails), so adds
issued without awaiting are never lost and `get` sees them; a failing add fails only its own
future.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from asyncstate.errors import SerializationError
from asyncstate.runtime.future import StateFuture
from asyncstate.runtime.requests import StateRequestType
from asyncstate.serde import from_stored, to_stored
from asyncstate.state.base import InternalState

if TYPE_CHECKING:
    from asyncstate.runtime.context import RecordContext
    from asyncstate.runtime.controller import AsyncExecutionController
    from asyncstate.state.descriptors import (
        AggregatingStateDescriptor,
        ReducingStateDescriptor,
    )

__all__ = ["AggregatingState", "MergingTtl", "ReducingState"]

T = TypeVar("T")
IN = TypeVar("IN")
OUT = TypeVar("OUT")
_T = StateRequestType


class MergingTtl(Protocol):
    """The TTL side of a reducing or aggregating state (`asyncstate.state.ttl.states`)."""

    def read(self, ctx: RecordContext, arg: Any) -> Any:
        """The payload of a read by get()."""

    def merge_read(self, ctx: RecordContext) -> Any:
        """The payload of the read inside add(), made when add() is called; it also takes
        the time the add's write stamps, and tells the state's cleanup of that write."""

    def merge_stamp(self, read: Any, stored: Any) -> Any:
        """The entry add() writes for the stored form `stored`, stamped with the time its
        read `read` took."""

    def touch(self, ctx: RecordContext) -> None:
        """An access that neither reads nor stamps (clear)."""


class _MergingState(InternalState):
    __slots__ = ("_get_type", "_put_type", "_ttl")

    _get_type: StateRequestType
    _put_type: StateRequestType
    # The TTL side of a TTL state (asyncstate.state.ttl.states), else None.
    _ttl: MergingTtl | None

    def _serialized(self, ctx: RecordContext,
                    step: Callable[[bytes], StateFuture[Any]]) -> StateFuture[Any]:
        """Run step(namespace) once this record's pending add or clear on this state, if any,
        has finished, whether it succeeded or failed."""
        ns = self._controller.namespace_of(ctx, self)
        serial = ctx.serial
        gate = None if serial is None else serial.get(self)
        if gate is None or gate.done():
            return step(ns)
        return gate.then_compose(lambda _: step(ns))

    def _read(self, ctx: RecordContext, ns: bytes, payload: Any) -> StateFuture[Any]:
        return self._controller.handle_request(self, self._get_type, payload, ctx, ns)

    # What TTL changes: the payload of the read of get() and of the read inside add(), both
    # made when the call is issued, and the stored form of the value add() writes.

    def _get_payload(self, ctx: RecordContext) -> Any:
        return None if self._ttl is None else self._ttl.read(ctx, None)

    def _stored(self, fold_payload: Any, value: Any) -> Any:
        stored = to_stored(value, self.name)
        if self._ttl is None or stored is None:  # a fold that stores None clears the value
            return stored
        return self._ttl.merge_stamp(fold_payload, stored)

    def _write_serialized(self, ctx: RecordContext,
                          step: Callable[[bytes], StateFuture[Any]]) -> StateFuture[None]:
        fut = self._serialized(ctx, step)
        if not fut.done():
            # Later calls wait on a gate that opens when `fut` settles, never fails, and
            # leaves a failure of `fut` to whoever looks at it (else it fails the run).
            gate: StateFuture[None] = StateFuture(ctx)
            fut._add_settled_hook(lambda: gate._complete(None))
            if ctx.serial is None:
                ctx.serial = {}
            ctx.serial[self] = gate
        return fut

    def _add_with(self, fold: Callable[[Any], Any]) -> StateFuture[None]:
        ctx = self._controller.current(self)
        controller = self._controller
        # TTL reads the time (for the fold's expiry check and the stamp of the write) and
        # notes the write's expiration (cleanup timers: in the namespace current now) here,
        # at the call: the read may wait for an earlier add and the write for the read, while
        # the clock moves and the record changes namespace.
        payload = None if self._ttl is None else self._ttl.merge_read(ctx)

        def step(ns: bytes) -> StateFuture[None]:
            def write(old: Any) -> StateFuture[None]:
                return controller.handle_request(
                    self, self._put_type, self._stored(payload, fold(old)), ctx, ns)
            return self._read(ctx, ns, payload).then_compose(write)

        return self._write_serialized(ctx, step)

    def clear(self) -> StateFuture[None]:
        """Remove the value for the current key and namespace (after pending adds)."""
        ctx = self._controller.current(self)
        controller = self._controller
        if self._ttl is not None:
            self._ttl.touch(ctx)
        return self._write_serialized(
            ctx, lambda ns: controller.handle_request(self, _T.CLEAR, None, ctx, ns))


class ReducingState(_MergingState, Generic[T]):
    """Folds added values with the descriptor's reduce function."""

    __slots__ = ("_reduce",)

    def __init__(self, descriptor: ReducingStateDescriptor, controller: AsyncExecutionController,
                 handle: Any, ttl: MergingTtl | None = None) -> None:
        super().__init__(descriptor, controller, handle)
        self._ttl = ttl
        self._reduce = descriptor.reduce_fn
        self._get_type = _T.REDUCING_GET
        self._put_type = _T.REDUCING_ADD

    def get(self) -> StateFuture[T | None]:
        """A future of the reduced value, or None when nothing was added."""
        ctx = self._controller.current(self)
        payload = self._get_payload(ctx)  # TTL: the time of the call, not of a pending add's end
        return self._serialized(ctx, lambda ns: self._read(ctx, ns, payload))

    def add(self, value: T) -> StateFuture[None]:
        """Fold `value`, as it is at the call, into the stored value."""
        stored = to_stored(value, self.name)  # rejects unencodable input at the call
        reduce = self._reduce

        def fold(old: Any) -> Any:
            added = from_stored(stored)  # a copy: later changes to `value` do not count
            return added if old is None else reduce(old, added)
        return self._add_with(fold)


class AggregatingState(_MergingState, Generic[IN, OUT]):
    """Adds values to an accumulator with the descriptor's AggregateFunction."""

    __slots__ = ("_agg",)

    def __init__(self, descriptor: AggregatingStateDescriptor,
                 controller: AsyncExecutionController, handle: Any,
                 ttl: MergingTtl | None = None) -> None:
        super().__init__(descriptor, controller, handle)
        self._ttl = ttl
        self._agg = descriptor.aggregate_function
        self._get_type = _T.AGGREGATING_GET
        self._put_type = _T.AGGREGATING_ADD

    def get(self) -> StateFuture[OUT | None]:
        """A future of get_result(accumulator), or None when nothing was added."""
        ctx = self._controller.current(self)
        agg = self._agg
        payload = self._get_payload(ctx)  # TTL: the time of the call, not of a pending add's end
        return self._serialized(ctx, lambda ns: self._read(ctx, ns, payload)).then_apply(
            lambda acc: None if acc is None else agg.get_result(acc))

    def add(self, value: IN) -> StateFuture[None]:
        """Add `value`, as it is at the call, to the accumulator. An input msgpack can
        encode is copied at the call; any other input is passed to the aggregate function
        as it is when the add runs (inputs are not stored, so they need not be encodable)."""
        agg = self._agg
        try:
            stored: Any = to_stored(value, self.name)
            copied = True
        except SerializationError:
            stored, copied = None, False

        def fold(acc: Any) -> Any:
            added = from_stored(stored) if copied else value
            return agg.add(added, agg.create_accumulator() if acc is None else acc)
        return self._add_with(fold)
