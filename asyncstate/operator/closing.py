"""Closing an operator: the sequence that ends its run, after a clean exit or a failure.

`close` fails what is outstanding first: the watchdog and the timers stop, the controller
fails what it still holds and the record Tasks are cancelled (their `finally` blocks run
before the function closes, within `RECORD_TASKS_GRACE_S`). Then the function's close() runs
if its open() ran (a failing open() still gets its close(), as in Flink), and whatever
close() does, the GC threshold is released and the backend closed.
`close_after` closes while another error is being raised: a failure of closing is logged and
noted on that error, never raised instead of it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Final

from asyncstate.backends.base import StateExecutor
from asyncstate.log import get_logger
from asyncstate.operator import functions
from asyncstate.operator.watchdog import RecordWatchdog
from asyncstate.runtime import gc_threshold
from asyncstate.runtime.controller import AsyncExecutionController
from asyncstate.runtime.driver import UserCodeDriver
from asyncstate.timers.service import TimerService

__all__ = ["RECORD_TASKS_GRACE_S", "close", "close_after"]

log = get_logger("asyncstate.operator")

# How long closing waits for cancelled record Tasks to finish.
RECORD_TASKS_GRACE_S: Final = 1.0


async def close(function: object, operator: object, backend: StateExecutor, *, opened: bool,
                function_opened: bool, controller: AsyncExecutionController | None,
                driver: UserCodeDriver | None, watchdog: RecordWatchdog | None,
                timers: TimerService | None, held_gc_threshold: int | None) -> None:
    """Close `operator`'s parts, `function` and `backend` (see the module docstring).
    `opened`: the operator got past wiring (its controller and driver exist);
    `function_opened`: the function's open() was called; `held_gc_threshold`: the GC
    threshold the operator holds, if any."""
    if watchdog is not None:
        watchdog.stop()
    if timers is not None:
        timers.close()
    # Failing the outstanding futures resumes the records waiting on them: one that raises a
    # KeyboardInterrupt or SystemExit raises it out of here (as asyncio's Tasks do). It is
    # raised once everything is closed, never instead of closing.
    raised: BaseException | None = None
    if opened:
        assert controller is not None and driver is not None
        try:
            controller.close()
        except BaseException as exc:  # noqa: BLE001 - raised below
            raised = exc
        try:
            await driver.cancel_and_wait(RECORD_TASKS_GRACE_S)
        except BaseException as exc:  # noqa: BLE001 - raised below
            raised = raised or exc
    closed: Any = None
    try:
        functions.unbind(function, operator)
        if function_opened:
            closer = getattr(function, "close", None)
            if closer is not None:
                closed = closer()
    finally:
        if opened and held_gc_threshold is not None:
            gc_threshold.release(held_gc_threshold)
        backend.close()
    await functions.settle(closed)
    if raised is not None:
        raise raised


async def close_after(close: Callable[[], Awaitable[None]], primary: BaseException) -> None:
    """Run `close()` while `primary` is the error being raised: a failure of the function's
    close() (or the backend's) is logged and noted on `primary`, never raised instead."""
    try:
        await close()
    except Exception as exc:  # noqa: BLE001 - reported on the primary error
        log.warning("operator.close_failed", error=repr(exc), while_raising=repr(primary))
        primary.add_note(f"closing the operator after this error failed too: {exc!r}")
