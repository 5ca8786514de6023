"""ReducingState and AggregatingState: read-modify-write states.

`add(v)` reads the stored value, folds `v` in and writes the result back. Calls of one
record on one such state run one after another (a later `add` or `get` waits for a pending
`add`), so adds issued without awaiting are never lost and `get` sees them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from asyncstate.runtime.future import StateFuture
from asyncstate.runtime.requests import StateRequestType
from asyncstate.serde import to_stored
from asyncstate.state.base import InternalState

if TYPE_CHECKING:
    from asyncstate.runtime.context import RecordContext
    from asyncstate.runtime.controller import AsyncExecutionController
    from asyncstate.state.descriptors import (
        AggregatingStateDescriptor,
        ReducingStateDescriptor,
    )

__all__ = ["AggregatingState", "ReducingState"]

T = TypeVar("T")
IN = TypeVar("IN")
OUT = TypeVar("OUT")
_T = StateRequestType


class _MergingState(InternalState):
    __slots__ = ("_get_type", "_put_type")

    _get_type: StateRequestType
    _put_type: StateRequestType

    def _serialized(self, ctx: RecordContext,
                    step: Callable[[bytes], StateFuture[Any]]) -> StateFuture[Any]:
        """Run step(namespace) after this record's pending add on this state, if any."""
        ns = self._controller.namespace_of(ctx, self)
        serial = ctx.serial
        prev = None if serial is None else serial.get(self)
        if prev is None or prev.done():
            return step(ns)
        return prev.then_compose(lambda _: step(ns))

    def _read(self, ctx: RecordContext, ns: bytes) -> StateFuture[Any]:
        return self._controller.handle_request(self, self._get_type, None, ctx, ns)

    def _write_serialized(self, ctx: RecordContext,
                          step: Callable[[bytes], StateFuture[Any]]) -> StateFuture[None]:
        fut = self._serialized(ctx, step)
        if not fut.done():
            if ctx.serial is None:
                ctx.serial = {}
            ctx.serial[self] = fut
        return fut

    def _add_with(self, fold: Callable[[Any], Any]) -> StateFuture[None]:
        ctx = self._controller.current()
        controller = self._controller

        def step(ns: bytes) -> StateFuture[None]:
            def write(old: Any) -> StateFuture[None]:
                return controller.handle_request(
                    self, self._put_type, to_stored(fold(old), self.name), ctx, ns)
            return self._read(ctx, ns).then_compose(write)

        return self._write_serialized(ctx, step)

    def clear(self) -> StateFuture[None]:
        """Remove the value for the current key and namespace (after pending adds)."""
        ctx = self._controller.current()
        controller = self._controller
        return self._write_serialized(
            ctx, lambda ns: controller.handle_request(self, _T.CLEAR, None, ctx, ns))


class ReducingState(_MergingState, Generic[T]):
    """Folds added values with the descriptor's reduce function."""

    __slots__ = ("_reduce",)

    def __init__(self, descriptor: ReducingStateDescriptor, controller: AsyncExecutionController,
                 handle: Any) -> None:
        super().__init__(descriptor, controller, handle)
        self._reduce = descriptor.reduce_fn
        self._get_type = _T.REDUCING_GET
        self._put_type = _T.REDUCING_ADD

    def get(self) -> StateFuture[T | None]:
        """A future of the reduced value, or None when nothing was added."""
        ctx = self._controller.current()
        return self._serialized(ctx, lambda ns: self._read(ctx, ns))

    def add(self, value: T) -> StateFuture[None]:
        """Fold `value` into the stored value."""
        to_stored(value, self.name)  # reject unencodable input at the call
        reduce = self._reduce
        return self._add_with(lambda old: value if old is None else reduce(old, value))


class AggregatingState(_MergingState, Generic[IN, OUT]):
    """Adds values to an accumulator with the descriptor's AggregateFunction."""

    __slots__ = ("_agg",)

    def __init__(self, descriptor: AggregatingStateDescriptor,
                 controller: AsyncExecutionController, handle: Any) -> None:
        super().__init__(descriptor, controller, handle)
        self._agg = descriptor.aggregate_function
        self._get_type = _T.AGGREGATING_GET
        self._put_type = _T.AGGREGATING_ADD

    def get(self) -> StateFuture[OUT | None]:
        """A future of get_result(accumulator), or None when nothing was added."""
        ctx = self._controller.current()
        agg = self._agg
        return self._serialized(ctx, lambda ns: self._read(ctx, ns)).then_apply(
            lambda acc: None if acc is None else agg.get_result(acc))

    def add(self, value: IN) -> StateFuture[None]:
        """Add `value` to the accumulator."""
        agg = self._agg
        return self._add_with(
            lambda acc: agg.add(value, agg.create_accumulator() if acc is None else acc))
