"""The timers of one key group in RocksDB, with an ordered cache of the first ones in front
(Flink's `RocksDBCachingPriorityQueueSet`).

Each timer is a RocksDB key in its byte form (`asyncstate.timers.timer.encode_timer`: key
group, timestamp, key, namespace), with an empty value. That form sorts as the timers do, so
RocksDB's key order is the queue's order and the head is the first key of the key group.

In front of the store sits a sorted list of the byte forms of the first timers, at most
`cache_size` of them. Every add and remove writes through to RocksDB at once; reads come from
the cache, and the store is read only to refill the cache once it is empty. Invariants:

1. Every cached timer is in the store.
2. Unless `all_elements_in_cache`, every stored timer that is not cached sorts after the last
   cached one. So an add that sorts after the last cached timer goes to the store only, and
   one that sorts before it goes to the cache too (pushing the last cached timer out if the
   cache is full).
3. While the cache is empty, every stored timer sorts after the seek hint: the last timer
   that left the cache when it emptied (initially the key-group prefix). A refill reads
   from just after it, so it skips the deletions (tombstones) of the timers fired already
   instead of stepping over them on every refill. (While the cache holds timers, the first
   cached one is where the store's timers start: 1 and 2.)

Beside each cached byte form sits its timer, or None until it is needed (Flink's peek cache
of the decoded head, kept for every cached timer): a timer added through the cache comes
back out as the same instance, without a decoding, and one read from the store is decoded
once, when it becomes the head.

All reads and writes run on the caller's thread, as Flink's timer service does on the task
thread: a refill reads at most `cache_size` + 1 keys. Scans go through
`asyncstate.backends.rocksdb_scan`, so no iterator outlives a call. Each change writes to
the store before it changes the cache, so a write that fails (rocksdict raises it as is)
leaves the set as it was.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator
from typing import Any, Final

from asyncstate.backends.rocksdb_layout import _prefix_end
from asyncstate.backends.rocksdb_scan import _scan_items
from asyncstate.config import MAX_MAX_PARALLELISM, check_int
from asyncstate.errors import KeyGroupError
from asyncstate.timers.base import InternalPriorityQueue
from asyncstate.timers.timer import InternalTimer, decode_timer, encode_timer, key_group_prefix

__all__ = ["DEFAULT_CACHE_SIZE", "RocksDBPriorityQueueSet"]

DEFAULT_CACHE_SIZE: Final = 128  # Flink's state.backend.rocksdb.timer-service.cache-size
_SCAN_CHUNK: Final = 1000  # keys per scan when iterating or counting the whole set
_EMPTY: Final = b""


class RocksDBPriorityQueueSet(InternalPriorityQueue[InternalTimer]):
    """The timers of `key_group`, stored in `store` (a rocksdict database or column family
    opened with ``Options(raw_mode=True)``), with the first `cache_size` in memory.

    `write_options` (a rocksdict WriteOptions, or None for the defaults) applies to every
    write. Several sets (one per key group) may share one store: each keeps to the keys that
    start with its key group; two sets of one key group would share its keys, so two queues
    (event time and processing time) need a store each. A set built on a store that already
    holds timers of its key group (a reopened database) serves them."""

    __slots__ = ("_store", "_key_group", "_prefix", "_upper", "_cache", "_timers",
                 "_cache_size", "_seek_hint", "_all_in_cache", "_write_options")

    def __init__(self, store: Any, key_group: int, *, cache_size: int = DEFAULT_CACHE_SIZE,
                 write_options: Any = None) -> None:
        check_int("key_group", key_group, 0, MAX_MAX_PARALLELISM - 1)
        check_int("cache_size", cache_size, 1)
        self._store = store
        self._key_group = key_group
        self._prefix = key_group_prefix(key_group)
        self._upper = _prefix_end(self._prefix)
        self._cache_size = cache_size
        self._write_options = write_options
        self._cache: list[bytes] = []  # byte forms, ascending
        self._timers: list[InternalTimer | None] = []  # the timer of each, once decoded
        self._seek_hint = self._prefix
        self._all_in_cache = False  # unknown until the first refill

    def __repr__(self) -> str:
        return (f"<RocksDBPriorityQueueSet key_group={self._key_group} "
                f"cached={len(self._cache)}/{self._cache_size} "
                f"all_elements_in_cache={self._all_in_cache}>")

    @property
    def key_group(self) -> int:
        """The key group whose timers this set holds."""
        return self._key_group

    @property
    def all_elements_in_cache(self) -> bool:
        """True when the cache holds every timer of the set (the store has no others)."""
        return self._all_in_cache

    def _check(self, timer: InternalTimer) -> None:
        if timer.key_group != self._key_group:
            raise KeyGroupError(
                f"timer of key group {timer.key_group} given to the RocksDB timer set of key "
                f"group {self._key_group}", key_group=timer.key_group)

    def _refill(self) -> None:
        """Refill the empty cache from the store, unless the store holds nothing else."""
        if self._cache or self._all_in_cache:
            return
        size = self._cache_size
        items = _scan_items(self._store, self._seek_hint + b"\x00", self._upper, size + 1)
        self._cache = [key for key, _ in items[:size]]
        self._timers = [None] * len(self._cache)
        self._all_in_cache = len(items) <= size

    def peek(self) -> InternalTimer | None:
        self._refill()
        if not self._cache:
            return None
        timers = self._timers
        head = timers[0]
        if head is None:
            head = decode_timer(self._cache[0])
            timers[0] = head
        return head

    def poll(self) -> InternalTimer | None:
        self._refill()
        cache = self._cache
        if not cache:
            return None
        first = cache[0]
        self._store.delete(first, self._write_options)
        del cache[0]
        timer = self._timers.pop(0)
        if not cache:
            self._seek_hint = first
        return decode_timer(first) if timer is None else timer

    def add(self, element: InternalTimer) -> bool:
        """Add `element` unless an equal timer is in the set; True if it is the new head."""
        self._check(element)
        self._refill()
        data = encode_timer(element)
        cache = self._cache
        full = len(cache) >= self._cache_size
        if (not full and self._all_in_cache) or (cache and data < cache[-1]):
            index = bisect_left(cache, data)
            if index < len(cache) and cache[index] == data:
                return False  # already in the set (and so in the store)
            self._store.put(data, _EMPTY, self._write_options)
            if full:
                cache.pop()  # now only in the store
                self._timers.pop()
                self._all_in_cache = False
            cache.insert(index, data)
            self._timers.insert(index, element)
            return index == 0
        if cache and data == cache[-1]:
            return False
        # Sorts after every cached timer: the store alone holds it (it may already).
        self._store.put(data, _EMPTY, self._write_options)
        self._all_in_cache = False
        return False

    def remove(self, element: InternalTimer) -> bool:
        """Remove the timer equal to `element`; True if it was the head."""
        self._check(element)
        self._refill()
        cache = self._cache
        if not cache:
            return False
        data = encode_timer(element)
        index = bisect_left(cache, data)
        cached = index < len(cache) and cache[index] == data
        if not cached and (self._all_in_cache or index < len(cache)):
            return False  # sorts among the cached timers but is not one: not in the set
        self._store.delete(data, self._write_options)
        if cached:
            del cache[index]
            del self._timers[index]
        if not cache:
            self._seek_hint = data
        return index == 0

    def add_all(self, elements: Iterable[InternalTimer]) -> None:
        for timer in elements:
            self.add(timer)

    def is_empty(self) -> bool:
        self._refill()
        return not self._cache

    def _stored(self) -> Iterator[bytes]:
        """The byte forms in the store, in order, read in chunks."""
        cache = self._cache
        lower = cache[0] if cache else self._seek_hint + b"\x00"
        while True:
            items = _scan_items(self._store, lower, self._upper, _SCAN_CHUNK)
            for key, _ in items:
                yield key
            if len(items) < _SCAN_CHUNK:
                return
            lower = items[-1][0] + b"\x00"

    def __len__(self) -> int:
        """The number of timers; counting them reads the store unless
        `all_elements_in_cache`."""
        if self._all_in_cache:
            return len(self._cache)
        count = 0
        for _ in self._stored():
            count += 1
        return count

    def __iter__(self) -> Iterator[InternalTimer]:
        """The timers in priority order, decoded from the store (from the cache when it
        holds them all), as a list read up front."""
        if self._all_in_cache:
            return iter([decode_timer(key) if timer is None else timer
                         for key, timer in zip(self._cache, self._timers, strict=True)])
        return iter([decode_timer(key) for key in self._stored()])

    def clear(self) -> None:
        """Remove every timer of the key group from the store and the cache."""
        self._store.delete_range(self._prefix, self._upper, self._write_options)
        self._cache = []
        self._timers = []
        self._seek_hint = self._prefix
        self._all_in_cache = True
