"""RocksDBOptions: the tuning of a RocksDBBackend's database, and its conversion to rocksdict.

Defaults are the module constants below. Every backend in the process that asks for a block
cache of the same capacity shares one cache, created on first use.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import rocksdict

from asyncstate.config import check_int
from asyncstate.errors import BackendError, ConfigError

__all__ = [
    "DEFAULT_BLOCK_CACHE_BYTES",
    "DEFAULT_BLOOM_FILTER_BITS",
    "DEFAULT_MEMTABLE_BLOOM_RATIO",
    "DEFAULT_WRITE_BUFFER_BYTES",
    "RocksDBOptions",
]

DEFAULT_BLOCK_CACHE_BYTES = 64 * 1024 * 1024
DEFAULT_BLOOM_FILTER_BITS = 10
DEFAULT_WRITE_BUFFER_BYTES = 64 * 1024 * 1024
# RocksDB's own choice for point lookups (ColumnFamilyOptions::OptimizeForPointLookup).
DEFAULT_MEMTABLE_BLOOM_RATIO = 0.02
_MIN_WRITE_BUFFER_BYTES = 64 * 1024
_MAX_BYTES = 2**63 - 1
_MAX_WRITE_BUFFER_BYTES = 64 * 2**30  # RocksDB clamps a larger memtable to this
_MAX_MEMTABLE_BLOOM_RATIO = 0.25  # RocksDB clamps larger ratios to this

_caches: dict[int, rocksdict.Cache] = {}
_caches_lock = threading.Lock()
# A database was opened in this process (or before a fork, in an ancestor): RocksDB's
# background threads, which run every flush and compaction, have started.
_opened = False
# In a process forked after a database was opened: the parent's pid.
_forked_from: int | None = None
# What a forked process inherited and must never destroy: a destructor could wait on a lock
# that a thread of the parent held at the fork.
_inherited: list[object] = []


def _shared_block_cache(capacity: int) -> rocksdict.Cache:
    """The process's block cache of `capacity` bytes, created on first use in this process:
    a forked worker builds its own."""
    with _caches_lock:
        cache = _caches.get(capacity)
        if cache is None:
            cache = _caches[capacity] = rocksdict.Cache(capacity)
        return cache


def _note_opened() -> None:
    """A RocksDB database was opened in this process (see `_check_not_forked`)."""
    global _opened
    _opened = True


def _check_not_forked(path: str) -> None:
    """BackendError in a process forked after its parent had opened a RocksDB database.
    RocksDB's background threads do not survive a fork, so a database opened here would wait
    forever for its first flush (at the latest when it closes)."""
    if _forked_from is not None:
        raise BackendError(
            f"cannot open RocksDB directory {path!r}: this process was forked from process "
            f"{_forked_from} after that one had opened a RocksDB database, and RocksDB's "
            "background threads (flushes, compactions) do not survive a fork, so every "
            "flush here would wait forever. Open RocksDB only in processes that did not "
            "inherit it: start workers with the 'spawn' or 'forkserver' method, or fork "
            "before the first RocksDBBackend is created", path=path)


def _after_fork_in_child() -> None:
    global _caches, _caches_lock, _forked_from
    _inherited.append(_caches)
    _caches = {}
    _caches_lock = threading.Lock()  # a thread of the parent may have held the old one
    if _opened and _forked_from is None:
        _forked_from = os.getppid()


os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RocksDBOptions:
    """Tuning of a RocksDBBackend's database. Invalid values raise ConfigError.

    block_cache_bytes: capacity of the LRU block cache. Every backend in the process with the
        same capacity shares one cache. 0 disables the block cache.
    bloom_filter_bits: bits per key of the full bloom filter, which lets a point read skip
        SST files that do not hold the key. 0 disables it. Allowed range 0..64.
    write_buffer_bytes: memtable size per column family (64 KiB to 64 GiB).
    memtable_bloom_ratio: share of `write_buffer_bytes` given to a bloom filter over each
        memtable's keys (0.02: ~8 bits per key of a small value state). A point read of a key
        that a memtable does not hold then skips that memtable's skiplist search. 0 disables
        it. Allowed range 0..0.25.
    disable_wal: skip RocksDB's write-ahead log (default True). Checkpoints, not the WAL, are
        what makes state durable: after a crash, a run restarts from its last checkpoint and
        discards the local database. A WAL would write every batch twice to protect state
        that is never reused. A clean `close()` still flushes the memtables, so reopening
        the same directory sees everything written.
    inplace_updates: let a write replace the value of a key the active memtable holds in
        place, when the new value is no larger, instead of adding a version (RocksDB's
        `inplace_update_support`), in the column families of value, reducing and
        aggregating states (default True). A key written again and again then takes one
        memtable entry, not one per write: an update-heavy job (a counter) reads and
        writes a memtable many times smaller. A write of a key the memtable does not hold
        searches the memtable twice, so a job that writes each key once runs slower with
        it. RocksDB does not support in-place updates together with range deletions or
        snapshot reads: list and map states, which clear by range, and timers keep the
        plain memtable, and the backend takes no snapshots.
    """

    block_cache_bytes: int = DEFAULT_BLOCK_CACHE_BYTES
    bloom_filter_bits: int = DEFAULT_BLOOM_FILTER_BITS
    write_buffer_bytes: int = DEFAULT_WRITE_BUFFER_BYTES
    memtable_bloom_ratio: float = DEFAULT_MEMTABLE_BLOOM_RATIO
    disable_wal: bool = True
    inplace_updates: bool = True

    def __post_init__(self) -> None:
        # RocksDB takes sizes as 64-bit integers.
        check_int("block_cache_bytes", self.block_cache_bytes, 0, _MAX_BYTES)
        check_int("bloom_filter_bits", self.bloom_filter_bits, 0, 64)
        check_int("write_buffer_bytes", self.write_buffer_bytes, _MIN_WRITE_BUFFER_BYTES,
                  _MAX_WRITE_BUFFER_BYTES)
        ratio = self.memtable_bloom_ratio
        if type(ratio) not in (int, float) or not 0 <= ratio <= _MAX_MEMTABLE_BLOOM_RATIO:
            raise ConfigError("memtable_bloom_ratio", ratio,
                              f"a number in [0, {_MAX_MEMTABLE_BLOOM_RATIO}]")
        if type(self.disable_wal) is not bool:
            raise ConfigError("disable_wal", self.disable_wal, "a bool")
        if type(self.inplace_updates) is not bool:
            raise ConfigError("inplace_updates", self.inplace_updates, "a bool")

    def to_rocksdict(self) -> tuple[rocksdict.Options, rocksdict.WriteOptions]:
        """Native options for the database and each column family (raw mode), and the
        write options used for every write."""
        options = rocksdict.Options(raw_mode=True)
        options.create_if_missing(True)
        options.create_missing_column_families(True)
        options.set_write_buffer_size(self.write_buffer_bytes)
        table = rocksdict.BlockBasedOptions()
        if self.block_cache_bytes:
            table.set_block_cache(_shared_block_cache(self.block_cache_bytes))
        else:
            table.disable_cache()
        if self.bloom_filter_bits:
            table.set_bloom_filter(self.bloom_filter_bits, False)  # full filter, not per block
        options.set_block_based_table_factory(table)
        if self.memtable_bloom_ratio:
            # Whole keys, not prefixes: point reads look up whole keys, and iterations seek
            # by bounds, which a memtable bloom filter never serves.
            options.set_memtable_prefix_bloom_ratio(float(self.memtable_bloom_ratio))
            options.set_memtable_whole_key_filtering(True)
        # One writer (the loop thread) writes each memtable, so RocksDB's concurrent
        # memtable writes buy nothing; they exclude in-place updates.
        options.set_allow_concurrent_memtable_write(False)
        write = rocksdict.WriteOptions()
        # The stub declares disable_wal as a method, but at runtime it is a property.
        write.disable_wal = self.disable_wal  # type: ignore[method-assign,assignment]
        return options, write

    def family_options(self, in_place: bool) -> rocksdict.Options:
        """Native options of a state's column family: with `in_place` (and
        `inplace_updates`), a write may replace a value in the memtable in place. Only for
        a family that never takes a range deletion: RocksDB would hide a key written in
        place after a range deletion that covers its older version."""
        options = self.to_rocksdict()[0]
        if in_place and self.inplace_updates:
            options.set_inplace_update_support(True)
        return options

