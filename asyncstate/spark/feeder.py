"""`ChunkFeeder`: Spark's synchronous record iterator, read on a thread, handed to the event
loop in chunks through a bounded queue.

Spark's iterator blocks while it waits for its input (a shuffle read, the JVM's socket) and
may run upstream user code: pulling it on the loop thread would stall every state request in
flight meanwhile. A cross-thread hand-off costs 40-60 us, so records cross in chunks of about
a thousand (one `call_soon_threadsafe` per chunk). At most `max_chunks` chunks are read ahead
of the operator; the reader waits for a free slot, so memory stays bounded however fast the
input is.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

__all__ = ["DEFAULT_CHUNK_SIZE", "DEFAULT_MAX_CHUNKS", "ChunkFeeder"]

DEFAULT_CHUNK_SIZE = 1000
DEFAULT_MAX_CHUNKS = 4


class _End:
    __slots__ = ()


class _Failed:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_END = _End()


class ChunkFeeder:
    """Reads `records` on a daemon thread and hands them to `loop` in chunks.

    The loop side calls `next_chunk()` (None at the end of input; an exception the iterator
    raised is raised there) and `release()` once it is done with a chunk, which frees a slot
    for the reader. `stop()` ends the reader from any thread.
    """

    def __init__(self, records: Iterable[Any], loop: asyncio.AbstractEventLoop, *,
                 chunk_size: int = DEFAULT_CHUNK_SIZE,
                 max_chunks: int = DEFAULT_MAX_CHUNKS) -> None:
        self._records = records
        self._loop = loop
        self._chunk_size = chunk_size
        self._slots = threading.Semaphore(max_chunks)
        self._stopped = False
        self._pending: deque[Any] = deque()  # loop thread only
        self._waiter: asyncio.Future[None] | None = None
        self.read_seconds = 0.0  # the reader's time inside the iterator (input and upstream)
        self._thread = threading.Thread(target=self._read, name="asyncstate-spark-reader",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- reader thread ---------------------------------------------------------------------

    def _read(self) -> None:
        clock = time.perf_counter
        try:
            it = iter(self._records)
            size = self._chunk_size
            while True:
                started = clock()
                chunk = list(itertools.islice(it, size))
                self.read_seconds += clock() - started
                if not chunk or self._stopped:
                    break
                if not self._acquire_slot():
                    return
                self._post(chunk)
            self._post(_END)
        except BaseException as exc:  # noqa: BLE001 - handed to the loop side, raised there
            self._post(_Failed(exc))

    def _acquire_slot(self) -> bool:
        """Wait for a free slot; False when stopped meanwhile."""
        self._slots.acquire()
        return not self._stopped

    def _post(self, item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._deliver, item)
        except RuntimeError:  # the loop is closed: the partition was abandoned
            self._stopped = True

    # -- loop thread -----------------------------------------------------------------------

    def _deliver(self, item: Any) -> None:
        self._pending.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next_chunk(self) -> list[Any] | None:
        """The next chunk of records, or None at the end of input."""
        while not self._pending:
            self._waiter = self._loop.create_future()
            await self._waiter
        self._waiter = None
        item = self._pending.popleft()
        if item is _END:
            self._pending.appendleft(item)  # stays the answer
            return None
        if type(item) is _Failed:
            raise item.exc
        chunk: list[Any] = item
        return chunk

    def release(self) -> None:
        """Free the slot of a chunk the loop side is done with."""
        self._slots.release()

    def stop(self, timeout: float) -> bool:
        """Tell the reader to stop and wait up to `timeout` seconds; returns whether it has
        stopped (a reader blocked inside the iterator stops at its next record)."""
        self._stopped = True
        self._slots.release()  # a reader waiting for a slot wakes and sees the flag
        if self._thread.ident is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()
