"""The heap backend's side of TTL states: reads, checkpoint data, migration and incremental
cleanup over entries stored as `TtlValue`s.

A TTL state's table holds `TtlValue`s where a plain state holds stored forms: one per key
(value, reducing, aggregating), one per element (a list of them), one per map entry (a dict
of them). Reads carry a `TtlRead` and follow `asyncstate.state.ttl.layout.outcome`: an expired
entry found is removed (cleanup on read) and returned only with RETURN_EXPIRED_IF_NOT_CLEANED_UP;
a fresh one is refreshed in place with ON_READ_AND_WRITE. An iteration longer than a chunk
(`TtlWalk`) applies this to the entries of each chunk as the chunk is loaded, as RocksDB does.

Everything here is internal to `asyncstate.backends.heap`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Final

from asyncstate.serde import NONE_BYTES, from_stored
from asyncstate.state.ttl.layout import (
    EXPIRED_HIDDEN,
    EXPIRED_RETURNED,
    FRESH,
    HEADER_SIZE,
    TtlRead,
    TtlValue,
    expiration,
    outcome,
    timestamp_of,
    to_bytes,
)
from asyncstate.state.ttl.tracker import CleanupPass, TtlTracker

__all__: list[str] = []

_FRESH: Final = FRESH  # compiled: Final alias
_HIDDEN: Final = EXPIRED_HIDDEN  # compiled: Final alias
_RETURNED: Final = EXPIRED_RETURNED  # compiled: Final alias
_HEADER_SIZE: Final = HEADER_SIZE  # compiled: Final alias
_NONE_BYTES: Final = NONE_BYTES  # compiled: Final alias

# What a table entry of a state holds (the kind, as the functions below need it).
SCALAR: Final = 0  # value, reducing, aggregating: one TtlValue
LIST: Final = 1  # a list of TtlValues
MAP: Final = 2  # a dict of user key bytes to TtlValues


def _found(read: TtlRead, entry: TtlValue) -> int:
    """`outcome` of `read` for `entry`, refreshing a fresh entry when the read does."""
    found = outcome(read, entry.ts)
    if found == _FRESH and read.policy.update_on_read:
        entry.ts = read.access
    return found


# -- reads ----------------------------------------------------------------------------------

def value_get(table: dict[Any, Any], k: Any, read: TtlRead) -> Any:
    """The value a TTL read of a value-kind entry returns."""
    entry: TtlValue | None = table.get(k)  # compiled: typed local
    if entry is None:
        return None
    policy = read.policy
    found = outcome(read, entry.ts)  # `_found`, inlined: it runs for every read
    if found == _FRESH:
        if policy.update_on_read:
            entry.ts = read.access
        return from_stored(entry.stored)
    if policy.cleanup_on_read:
        del table[k]
    return from_stored(entry.stored) if found == _RETURNED else None


def _map_entry(table: dict[Any, Any], k: Any, read: TtlRead) -> TtlValue | None:
    """The entry of user key `read.arg` a read returns (removing an expired one found)."""
    entries: dict[bytes, TtlValue] | None = table.get(k)  # compiled: typed local
    if entries is None:
        return None
    user_key = read.arg
    entry = entries.get(user_key)
    if entry is None:
        return None
    found = _found(read, entry)
    if found == _FRESH:
        return entry
    if read.policy.cleanup_on_read:
        del entries[user_key]
        if not entries:
            del table[k]
    return entry if found == _RETURNED else None


def map_get(table: dict[Any, Any], k: Any, read: TtlRead) -> Any:
    """The value a TTL read of one map entry returns."""
    entry = _map_entry(table, k, read)
    return None if entry is None else from_stored(entry.stored)


def map_contains(table: dict[Any, Any], k: Any, read: TtlRead) -> bool:
    """Whether a TTL read of one map entry finds it."""
    return _map_entry(table, k, read) is not None


def map_is_empty(table: dict[Any, Any], k: Any, read: TtlRead) -> bool:
    """True when the map holds no entry a read would return. Expired entries met before the
    first such entry are removed (not that entry, expired or not: no read returned it)."""
    entries: dict[bytes, TtlValue] | None = table.get(k)  # compiled: typed local
    if not entries:
        return True
    expired: list[bytes] = []
    empty = True
    for user_key, entry in entries.items():
        if outcome(read, entry.ts) != _HIDDEN:
            empty = False
            break
        expired.append(user_key)
    if expired and read.policy.cleanup_on_read:
        for user_key in expired:
            del entries[user_key]
        if not entries:
            del table[k]
    return empty


def list_visible(table: dict[Any, Any], k: Any, items: list[TtlValue],
                 read: TtlRead) -> list[Any]:
    """The stored forms of the elements a TTL read of the list `items` (stored under `k`)
    returns, in order (the list is refreshed and rid of expired elements as the read
    says)."""
    policy = read.policy
    refresh = policy.update_on_read
    cleanup = policy.cleanup_on_read
    access = read.access
    visible: list[Any] = []
    kept: list[TtlValue] = []
    dropped = False
    for entry in items:
        found = outcome(read, entry.ts)
        if found == _FRESH:
            if refresh:
                entry.ts = access
            kept.append(entry)
            visible.append(entry.stored)
            continue
        dropped = True
        if found == _RETURNED:
            visible.append(entry.stored)
        if not cleanup:
            kept.append(entry)
    if dropped and cleanup:
        if kept:
            table[k] = kept
        else:
            del table[k]
    return visible


def map_visible(table: dict[Any, Any], k: Any, entries: dict[bytes, TtlValue],
                read: TtlRead) -> list[tuple[bytes, Any]]:
    """The (user key bytes, stored form) of the entries a TTL read of the map `entries`
    (stored under `k`) returns."""
    cleanup = read.policy.cleanup_on_read
    visible: list[tuple[bytes, Any]] = []
    expired: list[bytes] = []
    for user_key, entry in entries.items():
        found = _found(read, entry)
        if found == _FRESH:
            visible.append((user_key, entry.stored))
            continue
        expired.append(user_key)
        if found == _RETURNED:
            visible.append((user_key, entry.stored))
    if expired and cleanup:
        for user_key in expired:
            del entries[user_key]
        if not entries:
            del table[k]
    return visible


class TtlWalk:
    """A TTL read of a list or map longer than one chunk: the table entry `k` of `table`
    it reads, its entries as they were when it began (a list's `TtlValue`s, or a map's
    (user key bytes, `TtlValue`) pairs) and the read. Each chunk (`walk_chunk`) refreshes
    what it returns and removes the expired entries it goes over, and nothing else: an
    iteration left early leaves the rest as it found it, as on RocksDB."""

    __slots__ = ("entries", "k", "live", "read", "removed", "shape", "table")

    def __init__(self, shape: int, table: dict[Any, Any], k: Any, entries: list[Any],
                 read: TtlRead) -> None:
        self.shape = shape
        self.table = table
        self.k = k
        self.entries = entries
        self.read = read
        # A list's stored list when the walk began, and how many entries the walk removed
        # from it: while the table holds that list, entry i of the walk sits at i - removed
        # (an append made since leaves the positions before it as they were).
        self.live: list[Any] | None = table.get(k) if shape == LIST else None
        self.removed = 0

    def __repr__(self) -> str:
        return f"<TtlWalk {len(self.entries)} entries {self.read!r}>"


def walk_chunk(walk: TtlWalk, start: int, limit: int) -> tuple[list[Any], int]:
    """The next chunk of `walk` from entry `start` on: up to `limit` items the read returns
    (a list's stored forms, or a map's (user key bytes, stored form) pairs), and where the
    next chunk starts (len(walk.entries): there is none). The chunk goes over the entries up
    to its last item, and past it over the expired entries the read hides, up to the next
    one it returns (which starts the next chunk)."""
    read = walk.read
    policy = read.policy
    refresh = policy.update_on_read
    access = read.access
    is_map = walk.shape == MAP
    entries = walk.entries
    n = len(entries)
    visible: list[Any] = []
    gone: list[Any] = []
    pos = start
    while pos < n:
        item = entries[pos]
        entry: TtlValue = item[1] if is_map else item  # compiled: typed local
        found = outcome(read, entry.ts)
        if found != _HIDDEN and len(visible) == limit:
            break
        pos += 1
        if found == _FRESH:
            if refresh:
                entry.ts = access
        else:
            gone.append(item)
            if found == _HIDDEN:
                continue
        visible.append((item[0], entry.stored) if is_map else entry.stored)
    if gone and policy.cleanup_on_read:
        _remove(walk, gone, start, pos)
    return visible, pos


def _remove(walk: TtlWalk, gone: list[Any], start: int, end: int) -> None:
    """Remove the expired entries `gone` of `walk` from its table entry, those still stored
    (later writes may have replaced or removed them since the walk began)."""
    table = walk.table
    k = walk.k
    if walk.shape == MAP:
        entries: dict[bytes, TtlValue] | None = table.get(k)  # compiled: typed local
        if entries is None:
            return
        for user_key, entry in gone:
            if entries.get(user_key) is entry:
                del entries[user_key]
        if not entries:
            del table[k]
        return
    items: list[TtlValue] | None = table.get(k)  # compiled: typed local
    if items is None:
        return
    ids = {id(e) for e in gone}  # identity: the list may hold equal entries written since
    lo = start - walk.removed
    hi = end - walk.removed
    live = walk.live
    walked = walk.entries
    if live is not None and live is items and hi <= len(live) \
            and all(live[lo + i] is walked[start + i] for i in range(end - start)):
        # The chunk's entries are where the walk left them: cut them out of that stretch
        # alone (a whole pass per chunk would make a long walk quadratic).
        live[lo:hi] = [e for e in live[lo:hi] if id(e) not in ids]
        walk.removed += len(gone)
        if not live:
            del table[k]
        return
    kept = [e for e in items if id(e) not in ids]
    walk.live = None  # the positions no longer hold
    if not kept:
        del table[k]
    elif len(kept) != len(items):
        table[k] = kept


# -- checkpoints ----------------------------------------------------------------------------

def snapshot_data(shape: int, stored: Any, ttl_ms: int, now: int | None) -> Any:
    """The checkpoint data of one table entry of a TTL state: timestamped bytes, a list of
    them (list) or of (user key, timestamped bytes) pairs (map). With `now` (full snapshot
    cleanup), entries expired at `now` are left out; None when nothing is left."""
    if shape == SCALAR:
        entry: TtlValue = stored  # compiled: typed local
        if now is not None and expiration(entry.ts, ttl_ms) <= now:
            return None
        return to_bytes(entry)
    if shape == LIST:
        elements: list[TtlValue] = stored  # compiled: typed local
        out = [to_bytes(e) for e in elements
               if now is None or expiration(e.ts, ttl_ms) > now]
        return out if out else None
    entries: dict[bytes, TtlValue] = stored  # compiled: typed local
    pairs = [(uk, to_bytes(e)) for uk, e in entries.items()
             if now is None or expiration(e.ts, ttl_ms) > now]
    return pairs if pairs else None


def restored(data: bytes, from_bytes: Callable[[bytes], Any]) -> TtlValue:
    """The entry of timestamped checkpoint bytes (ValueError when they are not timestamped);
    `from_bytes` turns the value's bytes into its stored form."""
    return TtlValue(timestamp_of(data), from_bytes(data[_HEADER_SIZE:]))


# -- migration ------------------------------------------------------------------------------

def add_timestamps(shape: int, table: dict[Any, Any], stamp: int) -> None:
    """Turn every entry of a plain state's table into a `TtlValue` stamped `stamp`."""
    for k, stored in table.items():
        if shape == SCALAR:
            table[k] = TtlValue(stamp, stored)
        elif shape == LIST:
            table[k] = [TtlValue(stamp, s) for s in stored]
        else:
            table[k] = {uk: TtlValue(stamp, v) for uk, v in stored.items()}


def drop_timestamps(shape: int, table: dict[Any, Any]) -> None:
    """Turn every `TtlValue` of a TTL state's table back into its stored form."""
    for k, stored in table.items():
        if shape == SCALAR:
            table[k] = stored.stored
        elif shape == LIST:
            table[k] = [e.stored for e in stored]
        else:
            table[k] = {uk: e.stored for uk, e in stored.items()}


# -- incremental cleanup --------------------------------------------------------------------

class HeapCursor:
    """Where incremental cleanup of one state stands: the table keys of the pass under way
    (taken when it began: a dict cannot be iterated while it changes) and the next one."""

    __slots__ = ("keys", "pass_", "pos")

    def __init__(self) -> None:
        self.keys: list[Any] | None = None
        self.pos = 0
        self.pass_: CleanupPass | None = None


def cleanup_step(shape: int, table: dict[Any, Any], cursor: HeapCursor, tracker: TtlTracker,
                 budget: int, now: int) -> None:
    """Check up to `budget` table entries from the cursor on (a list or map counts as one),
    removing what expired at `now`. A pass that reaches the end tells the tracker."""
    keys = cursor.keys
    if keys is None or cursor.pass_ is None:
        keys = cursor.keys = list(table)
        cursor.pos = 0
        cursor.pass_ = tracker.start_pass()
    p = cursor.pass_
    ttl = tracker.ttl_ms
    pos = cursor.pos
    n = len(keys)
    visited = 0
    while visited < budget and pos < n:
        k = keys[pos]
        pos += 1
        visited += 1
        stored = table.get(k)
        if stored is None:
            continue
        if shape == SCALAR:
            entry: TtlValue = stored  # compiled: typed local
            exp = expiration(entry.ts, ttl)
            if exp <= now:
                del table[k]
            else:
                p.keep(exp)
        elif shape == LIST:
            elements: list[TtlValue] = stored  # compiled: typed local
            kept = []
            for e in elements:
                exp = expiration(e.ts, ttl)
                if exp > now:
                    kept.append(e)
                    p.keep(exp)
            if not kept:
                del table[k]
            elif len(kept) != len(elements):
                table[k] = kept
        else:
            entries: dict[bytes, TtlValue] = stored  # compiled: typed local
            gone = []
            for uk, e in entries.items():
                exp = expiration(e.ts, ttl)
                if exp <= now:
                    gone.append(uk)
                else:
                    p.keep(exp)
            for uk in gone:
                del entries[uk]
            if not entries:
                del table[k]
    cursor.pos = pos
    if pos >= n:
        tracker.end_pass(p)
        cursor.keys = None
        cursor.pass_ = None


# -- the heap backend's TTL bookkeeping -----------------------------------------------------

class HeapTtl:
    """Which states of a heap backend are timestamped (and in which time domain), their
    trackers and incremental cleanup cursors; the TtlBackend side of `HeapBackend`."""

    __slots__ = ("cursors", "layouts", "trackers")

    def __init__(self) -> None:
        self.layouts: dict[str, str] = {}
        self.trackers: dict[str, TtlTracker] = {}
        self.cursors: dict[str, HeapCursor] = {}

    def __repr__(self) -> str:
        return f"<HeapTtl layouts={self.layouts}>"

    def group(self, name: str, shape: int, table: dict[Any, Any],
              place: Callable[[bytes], int], packb: Callable[[Any], bytes],
              buckets: list[list[bytes]]) -> None:
        """Encode state `name`'s entries into `buckets` (index `place(key bytes)`, -1: leave
        out), timestamped; expired ones left out when its tracker asks for full snapshot
        cleanup."""
        tracker = self.trackers.get(name)
        ttl_ms = 0
        now: int | None = None
        if tracker is not None and tracker.full_snapshot:
            ttl_ms, now = tracker.ttl_ms, tracker.now()
        for k, stored in table.items():
            key_bytes, ns = k if isinstance(k, tuple) else (k, _NONE_BYTES)
            i = place(key_bytes)
            if i < 0:
                continue
            data = snapshot_data(shape, stored, ttl_ms, now)
            if data is not None:
                buckets[i].append(packb((name, key_bytes, ns, data)))

    def restore(self, name: str, shape: int, table: dict[Any, Any], run: Iterable[Any],
                from_bytes: Callable[[bytes], Any],
                check_user_key: Callable[[object], Any]) -> None:
        """Store checkpoint entries of TTL state `name`: timestamped bytes become `TtlValue`s
        (ValueError for bytes that are not timestamped). An empty list or map stores
        nothing."""
        for _, key_bytes, ns, data in run:
            key = key_bytes if ns == _NONE_BYTES else (key_bytes, ns)
            if shape == SCALAR:
                table[key] = restored(data, from_bytes)
                continue
            container: Any = [restored(x, from_bytes) for x in data] if shape == LIST \
                else {check_user_key(uk): restored(v, from_bytes) for uk, v in data}
            if container:
                table[key] = container
            else:
                table.pop(key, None)
        tracker = self.trackers.get(name)
        if tracker is not None:
            tracker.forget()  # entries of unknown age: anything may have expired

    def set_layout(self, name: str, shape: int, table: dict[Any, Any], domain: str | None,
                   stamp: int | None) -> None:
        """`TtlBackend.set_ttl_layout` for state `name`."""
        timestamped = name in self.layouts
        if domain is not None and not timestamped and table:
            if stamp is None:
                raise ValueError(f"state {name!r} holds entries without timestamps, and no "
                                 "timestamp to give them was named")
            add_timestamps(shape, table, stamp)
        elif domain is None and timestamped:
            drop_timestamps(shape, table)
        if domain is None:
            self.layouts.pop(name, None)
        else:
            self.layouts[name] = domain

    def track(self, name: str, tracker: TtlTracker | None) -> None:
        """`TtlBackend.track_ttl`."""
        self.cursors.pop(name, None)
        if tracker is None:
            self.trackers.pop(name, None)
        else:
            self.trackers[name] = tracker

    def step(self, name: str, shape: int, table: dict[Any, Any], budget: int,
             now: int) -> None:
        """`TtlBackend.ttl_cleanup_step`, run at once."""
        tracker = self.trackers.get(name)
        if tracker is None:
            return
        cursor = self.cursors.get(name)
        if cursor is None:
            cursor = self.cursors[name] = HeapCursor()
        cleanup_step(shape, table, cursor, tracker, budget, now)
