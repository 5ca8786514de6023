"""RocksDB's background cleaner of TTL states: what a compaction filter does in Flink.

rocksdict exposes no compaction filter (its only TTL option is a whole-database wall-clock
TTL), so expired entries are found by scanning instead. The cleaner goes over each state
with background cleanup in passes, one bounded slice at a time:

1. A slice is scanned on the cleaner's own thread (at most `SLICE_ENTRIES` keys from a
   remembered key, through `asyncstate.backends.rocksdb_scan`, so no iterator outlives the
   slice), and their values are read by key (a point read, unlike an iterator, takes the
   lock of a write in place). The state's time is read at the start and again after every
   `query_time_after_num_entries` entries. Entries expired at that time are candidates.
2. The candidates' removal is a job of the backend's own in the lane: it runs on the loop
   thread in trigger order with the batches, reads each candidate again and removes it only
   if what is stored then is still expired at the time the scan used. A value rewritten
   after the scan (a fresh timestamp) survives. The batches behind it in the lane are shown
   the removals (`RocksTtl.show_removals`): their multi-gets did not wait for it.
3. When a pass ends, the state's tracker learns the smallest expiration it kept; while
   nothing can have expired (`TtlTracker.due`), the state is skipped.

The cleaner starts a slice when it is idle and the backend applies a batch (or a test waits
for it, `wait_idle`); a pass under way then continues slice after slice until it ends, with
or without batches. Unlike a compaction filter, which drops entries while RocksDB rewrites
files anyway, the cleaner reads what it checks and writes a delete for each removal (the
space is reclaimed by the next compaction).

It runs once per slice (not per request), and its thread hands results to the loop with
`call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import rocksdict

from asyncstate.backends.rocksdb_batch import _StateHandle
from asyncstate.backends.rocksdb_scan import _scan_keys
from asyncstate.backends.rocksdb_ttl import _current, _forget, _open_cf, _timestamp
from asyncstate.log import get_logger
from asyncstate.state.ttl.layout import MAX_TIMESTAMP, expiration
from asyncstate.state.ttl.tracker import CleanupPass, TtlTracker

__all__ = ["SLICE_ENTRIES", "BackgroundCleaner", "Slice", "scan"]

log = get_logger("asyncstate.backends.rocksdb")

SLICE_ENTRIES = 1000
_ALL_UPPER = b"\xff\xff\xff"


class _Position:
    """Where the cleaner stands in one state: the key to scan after (None: the start) and
    the pass under way."""

    __slots__ = ("after", "pass_")

    def __init__(self) -> None:
        self.after: bytes | None = None
        self.pass_: CleanupPass | None = None


class Slice:
    """One scanned slice of one state: its removal candidates (key, the time it was judged
    expired at), the smallest expiration it kept, and where the next slice starts."""

    __slots__ = ("candidates", "end", "error", "handle", "kept", "last", "lower", "name",
                 "tracker")

    def __init__(self, name: str, handle: _StateHandle, tracker: TtlTracker,
                 lower: bytes) -> None:
        self.name = name
        self.handle = handle
        self.tracker = tracker
        self.lower = lower
        self.candidates: list[tuple[bytes, int]] = []
        self.kept = MAX_TIMESTAMP
        self.last: bytes | None = None
        self.end = False
        self.error: BaseException | None = None

    def __repr__(self) -> str:
        return f"<Slice {self.name!r} candidates={len(self.candidates)} end={self.end}>"


def scan(piece: Slice, limit: int = SLICE_ENTRIES) -> Slice:
    """Step 1 for `piece` (any thread): fill in its candidates, kept bound and end."""
    tracker = piece.tracker
    every = max(1, tracker.background_every)
    ttl = tracker.ttl_ms
    keys = _slice_keys(piece.handle, piece.lower, limit)
    values = _values_of(piece.handle, keys)
    now = tracker.now()
    for i, key in enumerate(keys):
        if i and i % every == 0:
            now = tracker.now()
        value = values[i]
        if value is None:  # removed since the scan
            continue
        exp = expiration(_timestamp(value, piece.name), ttl)
        if exp <= now:
            piece.candidates.append((key, now))
        elif exp < piece.kept:
            piece.kept = exp
    piece.end = len(keys) < limit
    piece.last = keys[-1] if keys else None
    return piece


# The loop thread may write a value in place in the memtable (`RocksDBOptions.
# inplace_updates`) while this thread scans. An iterator reads values without the lock such a
# write holds, and could see a torn one; a point read takes it. So a slice scans keys, then
# reads their values by key. No local holds the column family (see `RocksDBBackend._release`:
# a stored error's traceback would keep it alive).

def _slice_keys(handle: _StateHandle, lower: bytes, limit: int) -> list[bytes]:
    return _scan_keys(_open_cf(handle), lower, _ALL_UPPER, limit)


def _values_of(handle: _StateHandle, keys: list[bytes]) -> list[bytes | None]:
    found: Any = _open_cf(handle).get(keys)  # type: ignore[arg-type]
    return list(found)


class BackgroundCleaner:
    """The background cleaner of one RocksDB backend (see the module docstring).

    `handles` and `trackers` are the backend's live maps of state handles and TTL trackers;
    `enqueue(fn)` runs fn() as a job of the backend's own in its lane; `write(wb, removed)`
    writes a WriteBatch of removals, `removed` the (handle, key) of each, to be shown to the
    batches behind in the lane; `loop` is the operator's event loop.
    """

    def __init__(self, handles: dict[str, _StateHandle], trackers: dict[str, TtlTracker],
                 enqueue: Callable[[Callable[[], None]], None],
                 write: Callable[[rocksdict.WriteBatch, list[tuple[_StateHandle, bytes]]],
                                 None],
                 loop: asyncio.AbstractEventLoop) -> None:
        self._handles = handles
        self._trackers = trackers
        self._enqueue = enqueue
        self._write = write
        self._loop = loop
        self._pool: ThreadPoolExecutor | None = None
        self._positions: dict[str, _Position] = {}
        self._turn = 0
        self._busy = False
        self._closed = False
        self._waiters: list[asyncio.Future[None]] = []

    def __repr__(self) -> str:
        return f"<BackgroundCleaner busy={self._busy} states={sorted(self._positions)}>"

    @property
    def busy(self) -> bool:
        """True while a slice is being scanned or its removals wait in the lane."""
        return self._busy

    def kick(self) -> None:
        """Start the next slice of a state that may hold expired entries, if idle (loop
        thread); with nothing to do, wake those waiting for the cleaner to be idle."""
        if self._busy or self._closed:
            return
        names = [name for name, tracker in self._trackers.items()
                 if tracker.background_every > 0 and name in self._handles]
        for offset in range(len(names)):
            name = names[(self._turn + offset) % len(names)]
            piece = self.next_slice(name)
            if piece is None:
                continue
            self._turn = (self._turn + offset + 1) % len(names)
            self._start(piece)
            return
        self._wake()

    def next_slice(self, name: str) -> Slice | None:
        """The next slice of state `name` to scan (a pass begins if none is under way), or
        None when nothing in it can have expired."""
        tracker = self._trackers[name]
        position = self._positions.get(name)
        if position is None:
            position = self._positions[name] = _Position()
        if position.pass_ is None:
            if not tracker.due(tracker.now()):
                return None
            position.pass_ = tracker.start_pass()
            position.after = None
        lower = b"" if position.after is None else position.after + b"\x00"
        return Slice(name, self._handles[name], tracker, lower)

    def _start(self, piece: Slice) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="asyncstate-ttl-cleaner")
        self._busy = True
        try:
            self._pool.submit(self._scan_on_thread, piece)
        except RuntimeError:  # shut down by close() meanwhile
            self._busy = False

    def _scan_on_thread(self, piece: Slice) -> None:
        try:
            scan(piece)
        except Exception as exc:  # noqa: BLE001 - reported on the loop thread
            piece.error = exc
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
            self._loop.call_soon_threadsafe(self._scanned, piece)

    def _scanned(self, piece: Slice) -> None:
        if not self._closed:
            self.submit(piece)

    def submit(self, piece: Slice) -> None:
        """Step 2 for a scanned slice (loop thread): queue the removal of its candidates in
        the lane, or move on when there are none."""
        if piece.error is not None:
            # Left for the next kick; a broken database fails the batches anyway.
            log.warning("rocksdb.ttl_cleaner_failed", state=piece.name, error=repr(piece.error))
            self._abandon(piece.name)
            self._busy = False
            self._wake()
            return
        if piece.candidates:
            self._enqueue(lambda: self._remove(piece))
        else:
            self._finish(piece)

    def _remove(self, piece: Slice) -> None:
        """Step 2, at the candidates' place in the lane: remove those still expired."""
        try:
            handle = piece.handle
            keys = [key for key, _ in piece.candidates]
            if handle.cf is None:
                return
            raws: list[bytes | None] = handle.cf.get(keys)  # type: ignore[arg-type,assignment]
            ttl = piece.tracker.ttl_ms
            wb: rocksdict.WriteBatch | None = None
            removed: list[tuple[_StateHandle, bytes]] = []
            for (key, now), stored in zip(piece.candidates, raws, strict=True):
                raw = _current(handle, key, stored)  # a deferred refresh counts
                if raw is not None and expiration(_timestamp(raw, piece.name), ttl) <= now:
                    if wb is None:
                        wb = rocksdict.WriteBatch(raw_mode=True)
                    wb.delete(key, handle.cf_handle)
                    _forget(handle, key)
                    removed.append((handle, key))
            if wb is not None:
                self._write(wb, removed)
        except BaseException:
            self._abandon(piece.name)
            self._busy = False
            raise
        self._finish(piece)

    def _finish(self, piece: Slice) -> None:
        """Step 3: move the state's position on, end its pass at the end."""
        position = self._positions.get(piece.name)
        p = None if position is None else position.pass_
        if position is not None and p is not None:
            p.keep(piece.kept)
            if piece.end:
                piece.tracker.end_pass(p)
                position.pass_ = None
                position.after = None
            else:
                position.after = piece.last
        self._busy = False
        self.kick()

    def _abandon(self, name: str) -> None:
        position = self._positions.pop(name, None)
        tracker = self._trackers.get(name)
        if position is not None and position.pass_ is not None and tracker is not None:
            tracker.end_pass(position.pass_, complete=False)

    def forget(self, name: str) -> None:
        """State `name` is no longer cleaned (or was replaced): drop its position."""
        self._abandon(name)

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait_idle(self) -> None:
        """Return once the cleaner has nothing to do (it starts if it can)."""
        self.kick()
        if not self._busy:
            return
        fut: asyncio.Future[None] = self._loop.create_future()
        self._waiters.append(fut)
        await fut

    def close(self) -> None:
        """Stop: wait for a scan under way, drop the rest (any thread)."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._wake)
