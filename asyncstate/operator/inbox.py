"""Inbox: admitted records and operator events, started in arrival order from the trampoline.

A record admitted by `process()` is not started there: it waits in the inbox, and one
trampoline job (posted once, however many entries arrive meanwhile) starts the entries in
order. An event (a watermark, a processing-time advance) goes through the same inbox as a
*barrier*: it starts after every record admitted before it has started, and records admitted
after it start only once it releases the inbox, when its epoch has finished (every earlier
record and every timer it fired are done). So each key's records and timers run in the
order their records and events arrived, as in Flink's serial epochs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncstate.operator.records import RecordRunner
from asyncstate.runtime.context import RecordContext
from asyncstate.runtime.controller import AsyncExecutionController

__all__ = ["Barrier", "Inbox"]

Release = Callable[[], None]


class Barrier:
    """An event in the inbox: `start(release)` runs once every entry before it started;
    the entries after it wait until `release()` is called."""

    __slots__ = ("start",)

    def __init__(self, start: Callable[[Release], None]) -> None:
        self.start = start

    def __repr__(self) -> str:
        return f"<Barrier {self.start!r}>"


class Inbox:
    """Records (their contexts, not yet started) and barriers, in arrival order.

    `queued` counts the records waiting; each starts through `records.start`.
    """

    __slots__ = ("_controller", "_entries", "_held", "_posted", "_records", "_release",
                 "queued")

    def __init__(self, controller: AsyncExecutionController, records: RecordRunner) -> None:
        self._controller = controller
        self._records = records
        # Drained from the front by index: entries appended meanwhile are drained too.
        self._entries: list[Any] = []
        self._posted = False
        self._held = False  # a barrier started and has not released the inbox yet
        self._release = self.release  # one bound method, handed to every barrier
        self.queued = 0

    def __repr__(self) -> str:
        held = " held" if self._held else ""
        return f"<Inbox entries={len(self._entries)} records={self.queued}{held}>"

    def post_record(self, ctx: RecordContext) -> None:
        """Queue a record to start after everything queued before it."""
        self.queued += 1
        self._entries.append(ctx)
        if not self._posted and not self._held:
            self._post()

    def post_barrier(self, start: Callable[[Release], None]) -> None:
        """Queue an event: `start(release)` runs from the trampoline after every entry queued
        before it started; the entries queued after it wait for `release()`."""
        self._entries.append(Barrier(start))
        if not self._posted and not self._held:
            self._post()

    def release(self) -> None:
        """Let the entries behind the running barrier start."""
        self._held = False
        if self._entries and not self._posted:
            self._post()

    def _post(self) -> None:
        self._posted = True
        self._controller.post(self._drain, None)

    def _drain(self, _: Any) -> None:
        # `_posted` stays True while draining: entries queued or a release meanwhile are
        # picked up by this loop, not by another drain.
        entries = self._entries
        done = 0
        try:
            while done < len(entries) and not self._held:
                entry = entries[done]
                done += 1
                if type(entry) is RecordContext:
                    self._start(entry)
                else:
                    self._held = True
                    entry.start(self._release)  # may release at once (nothing in flight)
        finally:
            del entries[:done]
            self._posted = False
            if entries and not self._held:
                # An exception propagated (KeyboardInterrupt): the rest runs later.
                self._post()

    def _start(self, ctx: RecordContext) -> None:
        self.queued -= 1
        if self._controller.failure is None:
            self._records.start(ctx)
