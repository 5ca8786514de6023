"""Inbox: admitted records and operator events, started in arrival order from the trampoline.

A record admitted by `process()` is not started there: it waits in the inbox, and one
trampoline job (posted once, however many entries arrive meanwhile) starts the entries in
order. An event (a watermark, a processing-time advance) goes through the same inbox, so it
takes effect after every record admitted before it has started, and its epoch after every
such record has finished.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

from asyncstate.runtime.context import RecordContext
from asyncstate.runtime.controller import AsyncExecutionController

__all__ = ["Inbox"]


class Inbox:
    """Records (their contexts, not yet started) and events (callables), in arrival order.

    `queued` counts the records waiting; each starts through the controller's
    `start_record` with `run_record`, in its own copy of `base_vars`.
    """

    __slots__ = ("_base_vars", "_controller", "_entries", "_posted", "_run_record", "queued")

    def __init__(self, controller: AsyncExecutionController, base_vars: contextvars.Context,
                 run_record: Callable[[RecordContext], None]) -> None:
        self._controller = controller
        self._base_vars = base_vars
        self._run_record = run_record
        # Drained from the front by index: entries appended meanwhile are drained too.
        self._entries: list[Any] = []
        self._posted = False
        self.queued = 0

    def __repr__(self) -> str:
        return f"<Inbox entries={len(self._entries)} records={self.queued}>"

    def post_record(self, ctx: RecordContext) -> None:
        """Queue a record to start after everything queued before it."""
        self.queued += 1
        self._entries.append(ctx)
        if not self._posted:
            self._post()

    def post_event(self, event: Callable[[], None]) -> None:
        """Run `event()` from the trampoline after every entry queued before it started."""
        self._entries.append(event)
        if not self._posted:
            self._post()

    def _post(self) -> None:
        self._posted = True
        self._controller.post(self._drain, None)

    def _drain(self, _: Any) -> None:
        entries = self._entries
        done = 0
        try:
            while done < len(entries):
                entry = entries[done]
                done += 1
                if type(entry) is RecordContext:
                    self._start(entry)
                else:
                    entry()
        finally:
            del entries[:done]
            self._posted = False
            if entries:  # an exception propagated (KeyboardInterrupt): the rest runs later
                self._post()

    def _start(self, ctx: RecordContext) -> None:
        self.queued -= 1
        controller = self._controller
        if controller.failure is not None:
            return
        ctx.vars = self._base_vars.copy()
        controller.start_record(ctx, self._run_record)
