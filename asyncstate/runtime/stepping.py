"""One step of a record's coroutine, kept out of the compiled modules on purpose.

compiled: interpreted module.

A compiled function records a traceback entry (a code object, a frame) for every exception
raised inside it, even one it catches itself, and every coroutine ends by raising
StopIteration, which made that a noticeable part of an `async def` record (see
docs/performance.md). Interpreted, catching it is cheap. `asyncstate/_compiled.py` must not
list this module.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, Final

__all__ = ["FINISHED", "step"]

FINISHED: Final = object()  # what `step` returns when the coroutine returned


def step(coro: Coroutine[Any, Any, Any], exc: BaseException | None) -> Any:
    """Resume `coro` with None, or throw `exc` into it; returns what it yielded, or
    FINISHED once it returned. Any other exception propagates."""
    try:
        if exc is None:
            return coro.send(None)
        return coro.throw(exc)
    except StopIteration:
        return FINISHED
