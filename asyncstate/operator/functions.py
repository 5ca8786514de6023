"""The user function's side of an operator's lifecycle.

A function object's states are bound to the operator that opened it, so one function object
runs in one operator at a time: `bind` refuses a second one while the first is open.
`open()` and `close()` may be plain or `async def`; `call_open` calls the former and `settle`
awaits what they returned.
"""

from __future__ import annotations

import inspect
from typing import Any, Final

from asyncstate.errors import InvalidStateError

__all__ = ["bind", "call_open", "settle", "unbind"]

# Function objects opened by a running operator, by id.
_BOUND: Final[dict[int, Any]] = {}


def bind(function: object, operator: object) -> None:
    """Record that `operator` runs `function`; InvalidStateError if another one does."""
    other = _BOUND.get(id(function))
    if other is not None and other is not operator:
        raise InvalidStateError(
            f"this {type(function).__name__} object is already running in {other!r}: its "
            "states are bound to that operator; create one function object per operator")
    _BOUND[id(function)] = operator


def unbind(function: object, operator: object) -> None:
    """Forget that `operator` runs `function` (if it does)."""
    if _BOUND.get(id(function)) is operator:
        del _BOUND[id(function)]


async def settle(result: object) -> None:
    """Await what open() or close() returned when it is awaitable (an `async def`)."""
    if inspect.isawaitable(result):
        await result


async def call_open(function: object, runtime_context: object) -> None:
    """Call the function's open(runtime_context), if it has one, and await it if async."""
    opener = getattr(function, "open", None)
    if opener is not None:
        await settle(opener(runtime_context))
