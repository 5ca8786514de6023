"""StateIterator: iteration over list or map state, loaded chunk by chunk."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from asyncstate.errors import InvalidStateError
from asyncstate.runtime.context import current_context
from asyncstate.runtime.future import StateFuture, combine_all, completed_future, failed_future
from asyncstate.runtime.requests import IteratorChunk, StateRequestType

if TYPE_CHECKING:
    from asyncstate.runtime.context import RecordContext
    from asyncstate.state.base import InternalState

__all__ = ["StateIterator"]

T = TypeVar("T")
_LOADING = StateRequestType.ITERATOR_LOADING


class StateIterator(Generic[T]):
    """Items of a list or map state. The first chunk is loaded with the request; later
    chunks (of `AsyncStateConfig.iterator_chunk_size` items) load on demand, within the
    record that created the iterator: loading them anywhere else raises InvalidStateError."""

    __slots__ = ("_continuation", "_ctx", "_items", "_request_type", "_state")

    def __init__(self, state: InternalState, request_type: StateRequestType,
                 chunk: IteratorChunk) -> None:
        self._state = state
        self._request_type = request_type
        self._items: list[Any] = chunk.items
        self._continuation = chunk.continuation
        # The record whose state this is: a later chunk is read under that record's key,
        # which no other code is sure to hold while it runs.
        self._ctx: RecordContext | None = current_context()

    def __repr__(self) -> str:
        more = ", more to load" if self._continuation is not None else ""
        return f"<StateIterator {self._state.name!r} {len(self._items)} loaded{more}>"

    def is_empty(self) -> bool:
        """True when there are no items at all."""
        return not self._items and self._continuation is None

    def _load_next(self) -> StateFuture[StateIterator[T]]:
        state = self._state
        if current_context() is not self._ctx:
            owner = (f"the record with key {self._ctx.key!r}" if self._ctx is not None
                     else "code outside any record")
            raise InvalidStateError(
                f"an iterator of state {state.name!r} can load its further items only within "
                f"the record that created it ({owner}); collect the items there, with "
                f"to_list(), and pass the list on")
        return state._controller.handle_request(
            state, _LOADING, (self._request_type, self._continuation)).then_apply(self._wrap)

    def _wrap(self, chunk: IteratorChunk) -> StateIterator[T]:
        return StateIterator(self._state, self._request_type, chunk)

    def on_next(self, fn: Callable[[T], Any]) -> StateFuture[list[Any]]:
        """Call fn on every item in order; a future of the list of fn's non-None results
        (a StateFuture returned by fn contributes its value)."""
        return self._walk(fn, [], False)

    def to_list(self) -> StateFuture[list[T]]:
        """A future of all items, loading every chunk."""
        return self._walk(None, [], True)

    def _walk(self, fn: Callable[[T], Any] | None, results: list[Any],
              keep_all: bool) -> StateFuture[list[Any]]:
        it: StateIterator[T] = self
        while True:
            try:
                _collect(it._items, fn, results, keep_all)
            except Exception as exc:  # noqa: BLE001 - fn's failure fails the returned future
                return failed_future(exc)
            if it._continuation is None:
                return _gather(results)
            nxt = it._load_next()
            if not nxt.done():
                return _walk_async(nxt, fn, results, keep_all)
            it = nxt.result()

    def __aiter__(self) -> AsyncIterator[T]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[T]:
        it: StateIterator[T] = self
        while True:
            for item in it._items:
                yield item
            if it._continuation is None:
                return
            it = await it._load_next()


def _collect(items: list[Any], fn: Callable[[Any], Any] | None, results: list[Any],
             keep_all: bool) -> None:
    """Add one chunk's items (or fn's results for them) to `results`."""
    if fn is None:
        results.extend(items)
        return
    for item in items:
        r = fn(item)
        if r is not None or keep_all:
            results.append(r)


def _walk_async(pending: StateFuture[StateIterator[Any]], fn: Callable[[Any], Any] | None,
                results: list[Any], keep_all: bool) -> StateFuture[list[Any]]:
    """The rest of `_walk` from a chunk still loading: one result future, completed once at
    the end, and a hook per chunk that loads later. Chaining one future per chunk instead
    would complete them all recursively at the end, one stack frame per chunk."""
    done: StateFuture[list[Any]] = StateFuture(pending._ctx)

    def resume(loaded: StateFuture[StateIterator[Any]]) -> None:
        try:
            it = loaded.result()
            while True:
                _collect(it._items, fn, results, keep_all)
                if it._continuation is None:
                    _gather(results)._forward_to(done)
                    return
                nxt = it._load_next()
                if not nxt.done():
                    nxt._add_hook(resume)
                    return
                it = nxt.result()
        except Exception as exc:  # noqa: BLE001 - a load or callback failure fails the walk
            done._fail(exc)

    pending._add_hook(resume)
    return done


def _gather(results: list[Any]) -> StateFuture[list[Any]]:
    if not any(type(r) is StateFuture for r in results):
        return completed_future(results)
    return combine_all([r if type(r) is StateFuture else completed_future(r) for r in results])
