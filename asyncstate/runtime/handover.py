"""Handover: a record's suspended coroutine, handed to an asyncio Task.

When a record's coroutine awaits something other than state (I/O, `asyncio.sleep`), the
driver moves it into a real Task (`asyncstate.runtime.driver`). The coroutine has already
run: it waits on what it last yielded, and a cancellation may have been asked of it since.
A Task's first step sends None, or, if the Task was cancelled before that step, throws the
cancellation in. `Handover` answers the first step as the suspended coroutine would: the
send yields again what the coroutine waits on (or throws in the cancellation asked before the
move), and a throw reaches the coroutine where it waits, so its `except` and `finally`
blocks, `asyncio.timeout` among them, see it; a cancellation cancels the asyncio future it
waits on instead, as `Task.cancel` does. Every later step goes straight to the coroutine.

Not compiled: a Task drives it through `send` and `throw`, and this path runs only for
records that await something other than state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any

__all__ = ["Handover"]


class Handover(Coroutine[Any, Any, Any]):
    """`coro`, suspended on `first`, with `pending` (or None) to throw in at its first step."""

    __slots__ = ("_coro", "_first", "_pending", "_started")

    def __init__(self, coro: Coroutine[Any, Any, Any], first: Any,
                 pending: BaseException | None) -> None:
        self._coro = coro
        self._first = first
        self._pending = pending
        self._started = False

    def __repr__(self) -> str:
        return f"<Handover of {self._coro!r}>"

    def send(self, value: Any) -> Any:
        if self._started:
            return self._coro.send(value)
        self._started = True
        pending, self._pending = self._pending, None
        first, self._first = self._first, None
        if pending is not None:
            return self._deliver(pending, first)
        if first is None:
            return self._coro.send(value)
        return first  # the coroutine waits on it: the Task waits for it first

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        # Also at the first step: a Task cancelled before it started throws the
        # cancellation here, and it belongs where the coroutine waits.
        if not self._started and val is None and tb is None:
            self._started = True
            self._pending = None
            first, self._first = self._first, None
            return self._deliver(typ, first)
        self._started = True
        if val is None and tb is None:
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)

    def _deliver(self, exc: BaseException, first: Any) -> Any:
        """Deliver `exc` at the first step to the coroutine waiting on `first`. A
        cancellation cancels an asyncio future it waits on, as `Task.cancel` does: the Task
        then waits for it (a `gather` cancels its children first) and the coroutine meets
        the future's cancellation when it resumes."""
        if isinstance(exc, asyncio.CancelledError) and isinstance(first, asyncio.Future) \
                and first.cancel(exc.args[0] if exc.args else None):
            return first
        return self._coro.throw(exc)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, Any, Any]:
        to_send: Any = None
        to_throw: BaseException | None = None
        while True:
            try:
                if to_throw is not None:
                    exc, to_throw = to_throw, None
                    yielded = self.throw(exc)
                else:
                    yielded = self.send(to_send)
            except StopIteration as stop:
                return stop.value
            try:
                to_send = yield yielded
            except BaseException as exc:  # noqa: BLE001 - thrown in by the awaiting code
                to_throw = exc

