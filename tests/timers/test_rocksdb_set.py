"""RocksDBPriorityQueueSet on a real RocksDB: against a sorted-set model across cache sizes
and reopenings, and its cache: write-through, refills only when empty, from the seek hint."""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import rocksdict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shared_functions import slow_examples
from timers_model import drain, identity, new_timer, op_lists, run_against_model, timer_ops

from asyncstate.errors import ConfigError, KeyGroupError, SerializationError
from asyncstate.timers.rocksdb_set import RocksDBPriorityQueueSet
from asyncstate.timers.timer import InternalTimer, encode_timer, key_group_prefix


def open_db(path: Path | str) -> rocksdict.Rdict:
    return rocksdict.Rdict(str(path), rocksdict.Options(raw_mode=True))


@pytest.fixture
def db(tmp_path: Path) -> Iterator[rocksdict.Rdict]:
    store = open_db(tmp_path / "db")
    yield store
    store.close()


class DiskFullError(Exception):
    """A failing write (rocksdict raises RocksDB's failures as plain Exceptions)."""


class CountingStore:
    """A real RocksDB database in front of which the set's calls are recorded."""

    def __init__(self, db: rocksdict.Rdict) -> None:
        self.db = db
        self.scans: list[bytes] = []  # where each scan started
        self.puts = 0
        self.deletes = 0
        self.write_options: list[Any] = []  # the write options of every write
        self.failing = False  # writes raise, as rocksdict does when RocksDB fails

    def _maybe_fail(self) -> None:
        if self.failing:
            raise DiskFullError("IO error: No space left on device")

    def items(self, from_key: bytes, read_opt: Any) -> Any:
        self.scans.append(from_key)
        return self.db.items(from_key=from_key, read_opt=read_opt)

    def iter(self, read_opt: Any) -> Any:
        return self.db.iter(read_opt)

    def put(self, key: bytes, value: bytes, write_opt: Any = None) -> None:
        self._maybe_fail()
        self.puts += 1
        self.write_options.append(write_opt)
        self.db.put(key, value, write_opt)

    def delete(self, key: bytes, write_opt: Any = None) -> None:
        self._maybe_fail()
        self.deletes += 1
        self.write_options.append(write_opt)
        self.db.delete(key, write_opt)

    def delete_range(self, begin: bytes, end: bytes, write_opt: Any = None) -> None:
        self.write_options.append(write_opt)
        self.db.delete_range(begin, end, write_opt)


def one_group_timer(ts: int, key: Any = "k", namespace: Any = None) -> InternalTimer:
    """A timer of key group 0 (max_parallelism 1: every key is in key group 0)."""
    return new_timer(ts, key, namespace, 1)


ops_with_reopen = st.lists(st.one_of(timer_ops, st.just(("reopen",))), max_size=60)


@settings(max_examples=slow_examples(25), suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops_with_reopen, cache_size=st.integers(1, 4))
def test_random_operations_match_a_sorted_set_model(ops: list[Any], cache_size: int) -> None:
    with tempfile.TemporaryDirectory() as directory:
        dbs = [open_db(directory)]

        def reopen(queue: Any, op: tuple[Any, ...]) -> RocksDBPriorityQueueSet:
            dbs[-1].close()
            dbs.append(open_db(directory))
            return RocksDBPriorityQueueSet(dbs[-1], 0, cache_size=cache_size)

        try:
            queue = RocksDBPriorityQueueSet(dbs[0], 0, cache_size=cache_size)
            model, queue = run_against_model(queue, ops, reopen, max_parallelism=1)
            queue = reopen(queue, ("reopen",))
            assert len(queue) == len(model)
            assert drain(queue) == sorted(model)
            assert list(dbs[-1].keys()) == []  # every fired timer left the store
        finally:
            dbs[-1].close()


@given(timestamps=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40),
       cache_size=st.integers(1, 5))
@settings(max_examples=slow_examples(20), suppress_health_check=[HealthCheck.too_slow])
def test_the_store_orders_timers_as_they_fire(timestamps: list[int], cache_size: int) -> None:
    with tempfile.TemporaryDirectory() as directory:
        db = open_db(directory)
        try:
            queue = RocksDBPriorityQueueSet(db, 0, cache_size=cache_size)
            timers = [one_group_timer(ts, key) for ts in timestamps for key in (1, "a")]
            queue.add_all(timers)
            stored = list(db.keys())
            assert stored == sorted(encode_timer(t) for t in set(timers))
            assert [identity(t) for t in queue] == sorted({identity(t) for t in timers})
            assert drain(queue) == sorted({identity(t) for t in timers})
        finally:
            db.close()


def test_refills_happen_only_when_the_cache_empties_and_start_after_the_seek_hint(
        db: rocksdict.Rdict) -> None:
    store = CountingStore(db)
    queue = RocksDBPriorityQueueSet(store, 0, cache_size=3)
    timers = [one_group_timer(ts) for ts in range(10)]
    for timer in timers:
        queue.add(timer)
    assert store.scans == [key_group_prefix(0) + b"\x00"]  # the first add found an empty store
    assert store.puts == 10 and not queue.all_elements_in_cache
    polled = [queue.poll() for _ in range(11)]
    assert [t.timestamp for t in polled if t is not None] == list(range(10))
    assert polled[-1] is None
    # One refill each time the cache emptied, each from just after the last timer polled:
    # the ones before it are deleted, and their tombstones are not stepped over again.
    assert store.scans[1:] == [encode_timer(timers[i]) + b"\x00" for i in (2, 5, 8)]
    assert store.deletes == 10 and queue.all_elements_in_cache


def test_a_failed_write_leaves_the_set_as_it_was(db: rocksdict.Rdict) -> None:
    store = CountingStore(db)
    queue = RocksDBPriorityQueueSet(store, 0, cache_size=2)
    for ts in (2, 4, 6):
        queue.add(one_group_timer(ts))
    store.failing = True
    for call in (lambda: queue.add(one_group_timer(1)), lambda: queue.add(one_group_timer(3)),
                 lambda: queue.add(one_group_timer(9)), queue.poll,
                 lambda: queue.remove(one_group_timer(2)),
                 lambda: queue.remove(one_group_timer(6))):
        with pytest.raises(DiskFullError):
            call()
        assert queue.peek() == one_group_timer(2)
    store.failing = False
    assert [t[0] for t in drain(queue)] == [2, 4, 6]


def test_all_elements_in_cache_spares_reads_and_counts_from_the_cache(
        db: rocksdict.Rdict) -> None:
    store = CountingStore(db)
    queue = RocksDBPriorityQueueSet(store, 0, cache_size=4)
    for ts in (3, 1, 2):
        queue.add(one_group_timer(ts))
    assert queue.all_elements_in_cache
    scans = len(store.scans)
    assert len(queue) == 3 and [t.timestamp for t in queue] == [1, 2, 3]
    for _ in range(3):
        queue.poll()
    assert queue.poll() is None and queue.is_empty()
    assert len(store.scans) == scans  # all of it answered from the cache


def test_a_timer_sorting_after_a_full_cache_goes_to_the_store_only(db: rocksdict.Rdict) -> None:
    queue = RocksDBPriorityQueueSet(db, 0, cache_size=2)
    assert queue.add(one_group_timer(5)) is True
    assert queue.add(one_group_timer(7)) is False
    assert queue.add(one_group_timer(9)) is False
    assert not queue.all_elements_in_cache
    assert queue.add(one_group_timer(9)) is False  # again: already stored
    assert queue.add(one_group_timer(1)) is True  # pushes 7 out of the cache, into the store
    assert len(queue) == 4
    assert [t.timestamp for t in queue] == [1, 5, 7, 9]
    assert [queue.poll().timestamp for _ in range(4)] == [1, 5, 7, 9]  # type: ignore[union-attr]


def test_removing_an_absent_timer_that_sorts_among_the_cached_ones_writes_nothing(
        db: rocksdict.Rdict) -> None:
    store = CountingStore(db)
    queue = RocksDBPriorityQueueSet(store, 0, cache_size=2)
    for ts in (1, 3, 5, 7):
        queue.add(one_group_timer(ts))
    assert queue.remove(one_group_timer(2)) is False
    assert store.deletes == 0
    assert queue.remove(one_group_timer(6)) is False  # may be stored: deleted to be sure
    assert queue.remove(one_group_timer(5)) is False  # stored, not cached
    assert queue.remove(one_group_timer(1)) is True  # the head
    assert queue.remove(one_group_timer(3)) is True  # the head, and the cache empties
    assert queue.peek() == one_group_timer(7)
    assert drain(queue) == [identity(one_group_timer(7))]


def test_length_and_iteration_include_timers_cached_before_the_seek_hint(
        db: rocksdict.Rdict) -> None:
    # The seek hint moves forward when the cache empties; timers added afterwards may sort
    # before it. Counting and iterating must still see them, from the store.
    queue = RocksDBPriorityQueueSet(db, 0, cache_size=2)
    queue.add(one_group_timer(10))
    assert queue.poll() == one_group_timer(10)  # the seek hint is now timer 10
    for ts in (1, 2, 3, 20):
        queue.add(one_group_timer(ts))
    assert not queue.all_elements_in_cache
    assert len(queue) == 4
    assert [t.timestamp for t in queue] == [1, 2, 3, 20]
    assert [t[0] for t in drain(queue)] == [1, 2, 3, 20]


def test_state_survives_reopening_the_database(tmp_path: Path) -> None:
    db = open_db(tmp_path)
    queue = RocksDBPriorityQueueSet(db, 5, cache_size=2)
    timers = [new_timer(ts, key, "w", 128) for ts in (4, -1, 2**62) for key in ("a", 7)]
    timers = [InternalTimer(t.timestamp, t.key, t.key_bytes, t.namespace_bytes, 5)
              for t in timers]
    queue.add_all(timers)
    queue.poll()
    db.close()
    db = open_db(tmp_path)
    try:
        reopened = RocksDBPriorityQueueSet(db, 5, cache_size=2)
        assert len(reopened) == 5
        assert drain(reopened) == sorted(identity(t) for t in timers)[1:]
    finally:
        db.close()


def test_sets_of_other_key_groups_share_a_column_family_without_seeing_each_other(
        db: rocksdict.Rdict) -> None:
    family = db.create_column_family("timers", rocksdict.Options(raw_mode=True))
    sets = {kg: RocksDBPriorityQueueSet(family, kg, cache_size=1) for kg in (0, 1, 255, 256)}
    for kg, queue in sets.items():
        for ts in range(3):
            queue.add(InternalTimer(ts, kg, new_timer(0, kg, None).key_bytes, b"\xc0", kg))
    sets[1].clear()
    assert sets[1].is_empty() and len(sets[1]) == 0
    for kg in (0, 255, 256):
        assert [(t.key, t.key_group) for t in sets[kg]] == [(kg, kg)] * 3
        assert [t[0] for t in drain(sets[kg])] == [0, 1, 2]
    sets[1].add(InternalTimer(9, 1, b"\x01", b"\xc0", 1))
    assert sets[1].poll() == InternalTimer(9, 1, b"\x01", b"\xc0", 1)


def test_timers_of_another_key_group_are_refused(db: rocksdict.Rdict) -> None:
    queue = RocksDBPriorityQueueSet(db, 3)
    stranger = InternalTimer(1, "k", b"\xa1k", b"\xc0", 4)
    message = re.escape("timer of key group 4 given to the RocksDB timer set of key group 3")
    for call in (queue.add, queue.remove):
        with pytest.raises(KeyGroupError, match=f"^{message}$") as info:
            call(stranger)
        assert info.value.key_group == 4
    assert list(db.keys()) == []


def test_construction_checks_key_group_and_cache_size(db: rocksdict.Rdict) -> None:
    with pytest.raises(ConfigError, match=r"^key_group must be in \[0, 32767\], got 32768$"):
        RocksDBPriorityQueueSet(db, 32768)
    with pytest.raises(ConfigError, match=r"^cache_size must be >= 1, got 0$"):
        RocksDBPriorityQueueSet(db, 0, cache_size=0)


def test_a_damaged_stored_timer_raises_naming_its_bytes(db: rocksdict.Rdict) -> None:
    db.put(key_group_prefix(2) + b"\x80" + b"\x00" * 7 + b"\xc1\xc0", b"")
    queue = RocksDBPriorityQueueSet(db, 2)
    with pytest.raises(SerializationError, match=r"^encoded timer b'\\x00\\x02\\x80.* is "
                                                 r"damaged"):
        queue.peek()


def test_write_options_apply_to_every_write(db: rocksdict.Rdict) -> None:
    store = CountingStore(db)
    options = rocksdict.WriteOptions()
    options.disable_wal = True
    queue = RocksDBPriorityQueueSet(store, 0, write_options=options)
    queue.add(one_group_timer(1))
    queue.add(one_group_timer(2))
    queue.poll()
    assert queue.remove(one_group_timer(2)) is True
    queue.add(one_group_timer(3))
    queue.clear()
    assert queue.is_empty() and list(db.keys()) == []
    assert len(store.write_options) == 6
    assert all(used is options for used in store.write_options)


def test_repr_shows_the_cache() -> None:
    with tempfile.TemporaryDirectory() as directory:
        db = open_db(directory)
        try:
            queue = RocksDBPriorityQueueSet(db, 7, cache_size=4)
            queue.add(InternalTimer(1, "k", b"\xa1k", b"\xc0", 7))
            assert repr(queue) == ("<RocksDBPriorityQueueSet key_group=7 cached=1/4 "
                                   "all_elements_in_cache=True>")
        finally:
            db.close()


@settings(max_examples=slow_examples(20), suppress_health_check=[HealthCheck.too_slow])
@given(ops=op_lists)
def test_a_large_cache_behaves_like_a_small_one(ops: list[Any]) -> None:
    with tempfile.TemporaryDirectory() as directory:
        db = open_db(directory)
        try:
            queue = RocksDBPriorityQueueSet(db, 0, cache_size=1000)
            model, queue = run_against_model(queue, ops, max_parallelism=1)
            assert drain(queue) == sorted(model)
        finally:
            db.close()
