"""RocksDBBackend against a real RocksDB in tmp_path, compared with HeapBackend."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import threading
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shared_functions import slow_examples

from asyncstate.backends.base import ExecutorBinding, StateExecutor
from asyncstate.backends.heap import HeapBackend
from asyncstate.backends.rocksdb import (
    _MIN_PART_KEYS,
    RocksDBBackend,
    RocksDBOptions,
    _translate_error,
)
from asyncstate.backends.rocksdb_layout import _prefix_end, _skip
from asyncstate.errors import BackendError, ConfigError, InvalidStateError
from asyncstate.keygroups import key_group_of_bytes
from asyncstate.runtime.context import RecordContext
from asyncstate.runtime.future import StateFuture
from asyncstate.runtime.requests import IteratorChunk, StateKind, StateRequest, StateRequestType
from asyncstate.serde import canonical_key, to_stored

T = StateRequestType
MAX_PARALLELISM = 128
STATES = {
    "v": StateKind.VALUE,
    "l": StateKind.LIST,
    "m": StateKind.MAP,
    "r": StateKind.REDUCING,
    "a": StateKind.AGGREGATING,
}
MAP_ITERATIONS = (T.MAP_ITER, T.MAP_ITER_KEY, T.MAP_ITER_VALUE)
ITERATIONS = (T.LIST_GET, *MAP_ITERATIONS)


class FakeState:
    __slots__ = ("handle", "kind", "name")

    def __init__(self, name: str, kind: StateKind, handle: Any) -> None:
        self.name = name
        self.kind = kind
        self.handle = handle


def record_context(key: Any) -> RecordContext:
    """A real record context for `key`, outside any controller (the backend reads only its
    key bytes and key group)."""
    key_bytes = canonical_key(key)
    return RecordContext(None, key, key_bytes, key_group_of_bytes(key_bytes, MAX_PARALLELISM),
                         None)


# An operation in backend-neutral form: (state name, request type, user-level payload, key,
# namespace). `Harness.request` turns it into a StateRequest for one backend.
Op = tuple[str, StateRequestType, Any, Any, Any]


def stored_payload(name: str, t: StateRequestType, payload: Any) -> Any:
    if t in (T.VALUE_UPDATE, T.REDUCING_ADD, T.AGGREGATING_ADD, T.LIST_ADD):
        return None if payload is None else to_stored(payload, name)
    if t in (T.LIST_ADD_ALL, T.LIST_UPDATE):
        return [to_stored(v, name) for v in payload]
    if t in (T.MAP_GET, T.MAP_CONTAINS, T.MAP_REMOVE):
        return canonical_key(payload)
    if t is T.MAP_PUT:
        user_key, value = payload
        return (canonical_key(user_key), None if value is None else to_stored(value, name))
    if t is T.MAP_PUT_ALL:
        return [(canonical_key(k), None if v is None else to_stored(v, name)) for k, v in payload]
    return None


class Harness:
    """Drives one backend directly: registers states, sends batches, collects deliveries."""

    def __init__(self, backend: StateExecutor, loop: asyncio.AbstractEventLoop,
                 chunk_size: int = 1000) -> None:
        self.backend = backend
        self.loop = loop
        self.waiting: dict[int, asyncio.Future[list[Any]]] = {}
        self.delivery_order: list[int] = []
        backend.open(ExecutorBinding(loop=loop, deliver=self._deliver,
                                     iterator_chunk_size=chunk_size,
                                     max_parallelism=MAX_PARALLELISM))
        self.states = {name: FakeState(name, kind, backend.register_state(name, kind))
                       for name, kind in STATES.items()}

    def _deliver(self, batch: list[StateRequest], results: list[Any] | None,
                 error: BaseException | None) -> None:
        assert self.loop.is_running()
        self.delivery_order.append(id(batch))
        future = self.waiting.pop(id(batch))
        if error is not None:
            future.set_exception(error)
        else:
            assert results is not None and len(results) == len(batch)
            future.set_result(results)

    def request(self, op: Op) -> StateRequest:
        name, t, payload, key, ns = op
        return StateRequest(self.states[name], t, stored_payload(name, t, payload),  # type: ignore[arg-type]
                            canonical_key(ns), record_context(key), StateFuture())

    def submit(self, batch: list[StateRequest]) -> asyncio.Future[list[Any]]:
        future = self.loop.create_future()
        self.waiting[id(batch)] = future
        self.backend.execute_batch(batch)
        return future

    async def run(self, ops: list[Op]) -> list[Any]:
        return await self.submit([self.request(op) for op in ops])

    async def run_all(self, batches: list[list[Op]]) -> list[list[Any]]:
        """Trigger every batch before any completes, like a controller under load."""
        futures = [self.submit([self.request(op) for op in ops]) for ops in batches]
        return list(await asyncio.gather(*futures))

    async def drain(self, op: Op, result: Any) -> Any:
        """The whole iteration as a list (map items sorted: their order is unspecified)."""
        if not isinstance(result, IteratorChunk):
            return result
        name, t, _payload, key, ns = op
        items = list(result.items)
        continuation = result.continuation
        loads = 0
        while continuation is not None:
            loads += 1
            assert loads <= 10_000, "the iteration does not end"
            loading = StateRequest(self.states[name], T.ITERATOR_LOADING,  # type: ignore[arg-type]
                                   (t, continuation), canonical_key(ns), record_context(key),
                                   StateFuture())
            [chunk] = await self.submit([loading])
            items.extend(chunk.items)
            continuation = chunk.continuation
        if t in MAP_ITERATIONS:
            items.sort(key=msgpack.packb)
        return items


async def drained(harness: Harness, ops: list[Op], results: list[Any]) -> list[Any]:
    return [await harness.drain(op, r) for op, r in zip(ops, results, strict=True)]


@pytest.fixture(params=[0, 16], ids=["pool-reads", "inline-reads"])
def rocks(tmp_path, request):
    """A RocksDBBackend that sends every read to the pool, and one that reads small batches
    on the loop thread."""
    backend = RocksDBBackend(tmp_path / "db", inline_read_keys=request.param)
    yield backend
    backend.close()


# -- every request type, read-your-writes ---------------------------------------------------

EVERY_TYPE: list[Op] = [
    ("v", T.VALUE_GET, None, 1, None),
    ("v", T.VALUE_UPDATE, {"a": [1, 2]}, 1, None),
    ("v", T.VALUE_GET, None, 1, None),
    ("v", T.VALUE_UPDATE, 7, 1, "ns"),
    ("v", T.VALUE_GET, None, 1, "ns"),
    ("v", T.VALUE_UPDATE, None, 1, None),
    ("v", T.VALUE_GET, None, 1, None),
    ("v", T.VALUE_GET, None, 1, "ns"),
    ("r", T.REDUCING_ADD, 3.5, "k", None),
    ("r", T.REDUCING_GET, None, "k", None),
    ("a", T.AGGREGATING_ADD, [1, (2, 3)], "k", None),
    ("a", T.AGGREGATING_GET, None, "k", None),
    ("a", T.CLEAR, None, "k", None),
    ("a", T.AGGREGATING_GET, None, "k", None),
    ("l", T.LIST_GET, None, 2, None),
    ("l", T.LIST_ADD, "x", 2, None),
    ("l", T.LIST_ADD_ALL, [b"y", 3], 2, None),
    ("l", T.LIST_ADD_ALL, [], 2, None),
    ("l", T.LIST_GET, None, 2, None),
    ("l", T.LIST_UPDATE, [9, 8], 2, None),
    ("l", T.LIST_GET, None, 2, None),
    ("l", T.LIST_ADD, True, 2, None),
    ("l", T.LIST_GET, None, 2, None),
    ("l", T.LIST_UPDATE, [], 2, None),
    ("l", T.LIST_GET, None, 2, None),
    ("l", T.LIST_ADD, -1, 2, None),
    ("l", T.CLEAR, None, 2, None),
    ("l", T.LIST_GET, None, 2, None),
    ("m", T.MAP_IS_EMPTY, None, 3, None),
    ("m", T.MAP_PUT, ("u", 1), 3, None),
    ("m", T.MAP_IS_EMPTY, None, 3, None),
    ("m", T.MAP_PUT_ALL, [((1, "t"), [1]), (2, "two"), ("gone", None)], 3, None),
    ("m", T.MAP_GET, "u", 3, None),
    ("m", T.MAP_GET, (1, "t"), 3, None),
    ("m", T.MAP_GET, "nope", 3, None),
    ("m", T.MAP_CONTAINS, 2, 3, None),
    ("m", T.MAP_CONTAINS, "gone", 3, None),
    ("m", T.MAP_ITER, None, 3, None),
    ("m", T.MAP_ITER_KEY, None, 3, None),
    ("m", T.MAP_ITER_VALUE, None, 3, None),
    ("m", T.MAP_REMOVE, "u", 3, None),
    ("m", T.MAP_PUT, (2, None), 3, None),
    ("m", T.MAP_CONTAINS, "u", 3, None),
    ("m", T.MAP_ITER, None, 3, None),
    ("m", T.CLEAR, None, 3, None),
    ("m", T.MAP_CONTAINS, (1, "t"), 3, None),
    ("m", T.MAP_IS_EMPTY, None, 3, None),
    ("m", T.MAP_PUT, ("after", "clear"), 3, None),
    ("m", T.MAP_ITER, None, 3, None),
    ("v", T.CLEAR, None, 1, "ns"),
    ("v", T.VALUE_GET, None, 1, "ns"),
]


async def test_every_request_type_in_one_batch_matches_heap(rocks):
    loop = asyncio.get_running_loop()
    heap = Harness(HeapBackend(), loop)
    rdb = Harness(rocks, loop)
    expected = await drained(heap, EVERY_TYPE, await heap.run(EVERY_TYPE))
    got = await drained(rdb, EVERY_TYPE, await rdb.run(EVERY_TYPE))
    assert got == expected
    # spot checks, so a shared mistake cannot hide
    assert got[2] == {"a": [1, 2]} and got[6] is None and got[7] == 7
    assert got[18] == ["x", b"y", 3] and got[20] == [9, 8] and got[24] == []
    assert got[35] is True and got[36] is False and got[45] is False


async def test_every_request_type_one_per_batch_matches_heap(rocks):
    loop = asyncio.get_running_loop()
    heap = Harness(HeapBackend(), loop)
    rdb = Harness(rocks, loop)
    batches = [[op] for op in EVERY_TYPE]
    expected = [await heap.drain(b[0], r[0]) for b, r in zip(batches, await heap.run_all(batches),
                                                             strict=True)]
    got = [await rdb.drain(b[0], r[0]) for b, r in zip(batches, await rdb.run_all(batches),
                                                       strict=True)]
    assert got == expected


async def test_later_batch_reads_writes_of_an_earlier_unfinished_batch(rocks):
    rdb = Harness(rocks, asyncio.get_running_loop())
    batches: list[list[Op]] = [
        [("v", T.VALUE_UPDATE, 1, "k", None), ("m", T.MAP_PUT, ("u", "x"), "k", None)],
        [("v", T.VALUE_GET, None, "k", None), ("m", T.MAP_GET, "u", "k", None),
         ("v", T.VALUE_UPDATE, 2, "k", None), ("l", T.LIST_ADD, "e", "k", None)],
        [("v", T.VALUE_GET, None, "k", None), ("l", T.LIST_GET, None, "k", None),
         ("m", T.CLEAR, None, "k", None)],
        [("m", T.MAP_CONTAINS, "u", "k", None), ("v", T.VALUE_GET, None, "other", None)],
    ]
    requests = [[rdb.request(op) for op in ops] for ops in batches]
    ids = [id(batch) for batch in requests]
    submitted = [rdb.submit(batch) for batch in requests]
    results = await asyncio.gather(*submitted)
    assert results[1][:2] == [1, "x"]
    assert results[2][0] == 2 and results[2][1].items == ["e"]
    assert results[3] == [False, None]
    assert rdb.delivery_order == ids  # delivered in trigger order


async def test_later_batch_reads_value_kind_writes_and_clears_of_an_earlier_batch(rocks):
    """Value-kind writes (update, clear, reducing and aggregating adds) of an unapplied batch
    hold back a later batch's multi-get of the same (state, key, namespace), and only it."""
    rdb = Harness(rocks, asyncio.get_running_loop())
    await rdb.run([("v", T.VALUE_UPDATE, 1, "k", None), ("v", T.VALUE_UPDATE, 2, "j", None),
                   ("r", T.REDUCING_ADD, 5, "k", None), ("a", T.AGGREGATING_ADD, 6, "k", None)])
    batches: list[list[Op]] = [
        [("v", T.VALUE_GET, None, "other", None)],  # reads ahead of the writes below
        [("v", T.CLEAR, None, "k", None), ("r", T.REDUCING_ADD, 7, "k", None),
         ("a", T.AGGREGATING_ADD, 8, "k", "ns")],
        [("v", T.VALUE_GET, None, "k", None), ("r", T.REDUCING_GET, None, "k", None),
         ("a", T.AGGREGATING_GET, None, "k", None), ("a", T.AGGREGATING_GET, None, "k", "ns"),
         ("v", T.VALUE_GET, None, "j", None)],
    ]
    results = await rdb.run_all(batches)
    assert results[0] == [None]
    assert results[2] == [None, 7, 6, 8, 2]


async def test_a_read_before_a_write_in_the_same_batch_sees_the_old_value(rocks):
    rdb = Harness(rocks, asyncio.get_running_loop())
    await rdb.run([("v", T.VALUE_UPDATE, "old", 5, None)])
    got = await rdb.run([("v", T.VALUE_GET, None, 5, None), ("v", T.VALUE_UPDATE, "new", 5, None),
                         ("v", T.VALUE_GET, None, 5, None)])
    assert got == ["old", None, "new"]


async def test_large_multi_get_split_over_io_slots_keeps_every_result(rocks):
    rdb = Harness(rocks, asyncio.get_running_loop())
    n = 2 * _MIN_PART_KEYS + 300  # two parts per column family
    keys = range(n)
    await rdb.run([("v", T.VALUE_UPDATE, k * 2, k, None) for k in keys])
    ops: list[Op] = [("v", T.VALUE_GET, None, k, None) for k in keys]
    ops += [("m", T.MAP_CONTAINS, k, k % 7, None) for k in keys]
    got = await rdb.run(ops)
    assert got == [k * 2 for k in keys] + [False] * n


@pytest.mark.parametrize("io_parallelism", [1, 2])
async def test_many_batches_read_through_the_pool_and_free_every_read_slot(tmp_path,
                                                                          io_parallelism):
    # More batches than I/O threads: the first ones hand the GIL to an idle thread, the
    # others queue; every result arrives, in trigger order, and the slot count returns to 0.
    with RocksDBBackend(tmp_path / "db", io_parallelism=io_parallelism,
                        inline_read_keys=0) as backend:
        rdb = Harness(backend, asyncio.get_running_loop())
        await rdb.run([("v", T.VALUE_UPDATE, k * 3, k, None) for k in range(40)])
        batches = [[rdb.request(("v", T.VALUE_GET, None, k, None)),
                    rdb.request(("v", T.VALUE_GET, None, k + 20, None))] for k in range(20)]
        pending = [rdb.submit(batch) for batch in batches]
        assert [await p for p in pending] == [[k * 3, (k + 20) * 3] for k in range(20)]
        assert rdb.delivery_order[-20:] == [id(batch) for batch in batches]
        assert backend._parts_in_pool == 0


async def test_fully_loaded_while_every_io_slot_is_busy(tmp_path):
    with RocksDBBackend(tmp_path / "db", io_parallelism=1, inline_read_keys=0) as backend:
        rdb = Harness(backend, asyncio.get_running_loop())
        write = rdb.submit([rdb.request(("v", T.VALUE_UPDATE, 1, 1, None))])
        assert not backend.fully_loaded()  # no reads: applied at once
        read = rdb.submit([rdb.request(("v", T.VALUE_GET, None, 1, None))])
        assert backend.fully_loaded()
        assert await write == [None] and await read == [1]
        assert not backend.fully_loaded()


async def test_failures_are_delivered_not_raised(rocks):
    rdb = Harness(rocks, asyncio.get_running_loop())
    sync_point = StateRequest(None, T.SYNC_POINT, None, b"\xc0", record_context(1),
                              StateFuture())
    with pytest.raises(ValueError, match=r"^RocksDBBackend cannot execute SYNC_POINT$"):
        await rdb.submit([sync_point])
    rocks.close()
    with pytest.raises(InvalidStateError, match=r"is closed$"):
        await rdb.run([("v", T.VALUE_GET, None, 1, None)])


# -- iteration ------------------------------------------------------------------------------

async def test_chunked_iteration_size_3_over_100_items(rocks):
    loop = asyncio.get_running_loop()
    heap = Harness(HeapBackend(), loop, chunk_size=3)
    rdb = Harness(rocks, loop, chunk_size=3)
    writes: list[Op] = [("l", T.LIST_ADD_ALL, list(range(100)), "k", None),
                        ("m", T.MAP_PUT_ALL, [(i, str(i)) for i in range(100)], "k", None)]
    for harness in (heap, rdb):
        await harness.run(writes)
    for t in ITERATIONS:
        op: Op = ("l" if t is T.LIST_GET else "m", t, None, "k", None)
        [first] = await rdb.run([op])
        assert len(first.items) == 3 and first.continuation is not None
        chunks, continuation = 1, first.continuation
        while continuation is not None:
            name, _t, _p, key, ns = op
            loading = StateRequest(rdb.states[name], T.ITERATOR_LOADING, (t, continuation),  # type: ignore[arg-type]
                                   canonical_key(ns), record_context(key), StateFuture())
            [chunk] = await rdb.submit([loading])
            assert 1 <= len(chunk.items) <= 3
            chunks += 1
            continuation = chunk.continuation
        assert chunks == 34
        [heap_first] = await heap.run([op])
        assert await rdb.drain(op, first) == await heap.drain(op, heap_first)
    [first] = await rdb.run([("l", T.LIST_GET, None, "k", None)])
    assert await rdb.drain(("l", T.LIST_GET, None, "k", None), first) == list(range(100))


async def test_exactly_one_full_chunk_has_no_continuation(tmp_path):
    with RocksDBBackend(tmp_path / "db") as backend:
        rdb = Harness(backend, asyncio.get_running_loop(), chunk_size=3)
        [_, chunk] = await rdb.run([("l", T.LIST_ADD_ALL, [1, 2, 3], 0, None),
                                    ("l", T.LIST_GET, None, 0, None)])
        assert chunk.items == [1, 2, 3] and chunk.continuation is None


async def test_list_iteration_never_reaches_elements_added_after_it_started(tmp_path):
    with RocksDBBackend(tmp_path / "db") as backend:
        rdb = Harness(backend, asyncio.get_running_loop(), chunk_size=2)
        [_, first, _] = await rdb.run([("l", T.LIST_ADD_ALL, [1, 2, 3, 4], 0, None),
                                       ("l", T.LIST_GET, None, 0, None),
                                       ("l", T.LIST_ADD, 5, 0, None)])
        assert await rdb.drain(("l", T.LIST_GET, None, 0, None), first) == [1, 2, 3, 4]


async def test_iteration_sees_earlier_writes_of_its_batch_but_not_later_ones(rocks):
    rdb = Harness(rocks, asyncio.get_running_loop())
    got = await rdb.run([("m", T.MAP_PUT, ("a", 1), 0, None), ("m", T.MAP_ITER_KEY, None, 0, None),
                         ("m", T.MAP_PUT, ("b", 2), 0, None), ("m", T.MAP_IS_EMPTY, None, 1, None),
                         ("m", T.MAP_PUT, ("c", 3), 1, None), ("m", T.MAP_ITER_KEY, None, 0, None)])
    assert got[1].items == ["a"] and got[3] is True and sorted(got[5].items) == ["a", "b"]


# -- randomized comparison with HeapBackend -------------------------------------------------

# Few keys, namespaces and user keys, so that requests of a batch often meet on one key.
KEYS = st.sampled_from([0, "k"])
NAMESPACES = st.sampled_from([None, "ns"])
USER_KEYS = st.sampled_from([0, "u", (1, "x")])
VALUES = st.one_of(
    st.integers(-(2**63), 2**64 - 1), st.text(max_size=3), st.binary(max_size=3),
    st.booleans(), st.floats(allow_nan=False), st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(-3, 3), max_size=2))


def _op(name: str, t: StateRequestType, payload: st.SearchStrategy[Any] | None = None
        ) -> st.SearchStrategy[Op]:
    return st.tuples(st.just(name), st.just(t), st.none() if payload is None else payload,
                     KEYS, NAMESPACES)


STATE_OPS = {
    "v": st.one_of(_op("v", T.VALUE_GET), _op("v", T.VALUE_UPDATE, st.one_of(st.none(), VALUES)),
                   _op("v", T.CLEAR)),
    "r": st.one_of(_op("r", T.REDUCING_GET), _op("r", T.REDUCING_ADD, VALUES)),
    "a": st.one_of(_op("a", T.AGGREGATING_GET), _op("a", T.AGGREGATING_ADD, VALUES),
                   _op("a", T.CLEAR)),
    "l": st.one_of(_op("l", T.LIST_GET), _op("l", T.LIST_ADD, VALUES),
                   _op("l", T.LIST_ADD_ALL, st.lists(VALUES, max_size=3)),
                   _op("l", T.LIST_UPDATE, st.lists(VALUES, max_size=3)), _op("l", T.CLEAR)),
    "m": st.one_of(_op("m", T.MAP_GET, USER_KEYS), _op("m", T.MAP_CONTAINS, USER_KEYS),
                   _op("m", T.MAP_PUT, st.tuples(USER_KEYS, st.one_of(st.none(), VALUES))),
                   _op("m", T.MAP_PUT_ALL, st.lists(st.tuples(USER_KEYS, VALUES), max_size=3)),
                   _op("m", T.MAP_REMOVE, USER_KEYS), _op("m", T.MAP_IS_EMPTY),
                   _op("m", T.CLEAR),
                   st.sampled_from(MAP_ITERATIONS).flatmap(lambda t: _op("m", t))),
}
# One or two states per example, so that its requests pile up on a few (key, namespace)s.
OP_LISTS = st.sets(st.sampled_from(sorted(STATE_OPS)), min_size=1, max_size=2).flatmap(
    lambda names: st.lists(st.one_of(*(STATE_OPS[n] for n in sorted(names))),
                           min_size=20, max_size=60))


def _split(ops: list[Op], cuts: list[int], cut_after_iterations: bool) -> list[list[Op]]:
    cut_set = {c % len(ops) for c in cuts}
    batches: list[list[Op]] = [[]]
    for i, op in enumerate(ops):
        batches[-1].append(op)
        cut = i + 1 in cut_set or (cut_after_iterations and op[1] in ITERATIONS)
        if cut and i + 1 < len(ops):
            batches.append([])
    return batches


async def _compare(path: str, batches: list[list[Op]], chunked: bool, inline: int,
                   options: RocksDBOptions | None = None) -> None:
    loop = asyncio.get_running_loop()
    chunk = 1 if chunked else 1000
    heap = Harness(HeapBackend(), loop, chunk_size=chunk)
    with RocksDBBackend(path, inline_read_keys=inline, options=options) as backend:
        rdb = Harness(backend, loop, chunk_size=chunk)
        if chunked:
            # One batch at a time, each iteration drained before the next batch: the heap
            # iterates a copy, RocksDB the live column family, so no write may intervene.
            for ops in batches:
                expected = await drained(heap, ops, await heap.run(ops))
                got = await drained(rdb, ops, await rdb.run(ops))
                assert got == expected, ops
        else:
            expected_all = await heap.run_all(batches)
            got_all = await rdb.run_all(batches)  # every batch in the lane at once
            for ops, expected, got in zip(batches, expected_all, got_all, strict=True):
                assert await drained(rdb, ops, got) == await drained(heap, ops, expected), ops


@settings(max_examples=slow_examples(30), deadline=None)
@given(ops=OP_LISTS, cuts=st.lists(st.integers(0, 60), max_size=10),
       chunked=st.booleans(), inline=st.sampled_from([0, 4]),
       memtable_bloom_ratio=st.sampled_from([0, 0.02, 0.25]))
def test_random_batches_match_heap(ops, cuts, chunked, inline, memtable_bloom_ratio):
    """Concurrent examples read through the pool, so that a batch's reads can overtake an
    earlier batch's writes; chunked examples (chunk size 1) also try loop-thread reads.
    Every read is answered by a memtable, with its bloom filter off, default or largest."""
    batches = _split(ops, cuts, cut_after_iterations=chunked)
    options = RocksDBOptions(memtable_bloom_ratio=memtable_bloom_ratio)
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(_compare(os.path.join(tmp, "db"), batches, chunked,
                             inline if chunked else 0, options))


# -- opening, locking, reopening, closing ---------------------------------------------------

def test_translate_error_recognises_lock_failures():
    same = Exception("IO error: lock hold by current process, acquire time 1795251702 acquiring "
                     "thread 1399: /data/db/LOCK: No locks available")
    other = Exception("IO error: While lock file: /data/db/LOCK: Resource temporarily unavailable")
    for exc in (same, other):
        err = _translate_error(exc, "/data/db")
        assert isinstance(err, BackendError) and err.path == "/data/db"
        assert re.match(r"^RocksDB directory '/data/db' is already in use \(by this process or "
                        r"another\); close the RocksDBBackend", str(err))
    err = _translate_error(Exception("Corruption: bad block"), "/data/db")
    assert str(err) == "RocksDB failed on '/data/db': Corruption: bad block"
    # Failing to open the LOCK file is not contention.
    denied = Exception("IO error: while open a file for lock: /data/db/LOCK: Permission denied")
    assert str(_translate_error(denied, "/data/db")) == f"RocksDB failed on '/data/db': {denied}"


def test_a_lock_path_that_cannot_be_opened_is_not_reported_as_in_use(tmp_path):
    path = tmp_path / "db"
    os.makedirs(path / "LOCK")  # nothing holds a lock: the LOCK file cannot be opened
    with pytest.raises(BackendError, match=r"^RocksDB failed on .*LOCK: Is a directory") as info:
        RocksDBBackend(path)
    assert info.value.path == str(path)


def test_opening_a_directory_twice_in_one_process_names_the_path(tmp_path):
    path = str(tmp_path / "db")
    with RocksDBBackend(path):
        with pytest.raises(BackendError, match=rf"^RocksDB directory {re.escape(repr(path))} is "
                                               r"already in use") as info:
            RocksDBBackend(path)
        assert info.value.path == path


@pytest.mark.parametrize("spelling", ["symlink", "dot", "trailing-slash", "proc-root"])
def test_opening_a_directory_twice_under_another_spelling_is_refused(tmp_path, spelling):
    """RocksDB refuses a second open in one process by path: the backend opens the real
    path, so a symlink or another spelling of the directory is refused too (two backends
    on one directory lose each other's state)."""
    path = tmp_path / "db"
    real = os.path.realpath(path)
    if spelling == "symlink":
        os.symlink(path, tmp_path / "link", target_is_directory=True)
        other = str(tmp_path / "link")
    elif spelling == "dot":
        other = os.path.join(str(tmp_path), ".", "db")
    elif spelling == "trailing-slash":
        other = str(path) + "/"
    else:
        other = "/proc/self/root" + real
    with RocksDBBackend(path) as first:
        first.register_state("v", StateKind.VALUE)
        if spelling == "symlink":
            assert first.path == real
        with pytest.raises(BackendError, match=rf"^RocksDB directory {re.escape(repr(real))} is "
                                               r"already in use") as info:
            RocksDBBackend(other)
        assert info.value.path == real
        assert first.registered_states() == {"v": StateKind.VALUE}


def test_opening_a_directory_used_by_another_process_names_the_path(tmp_path):
    path = str(tmp_path / "db")
    script = textwrap.dedent(f"""
        from asyncstate.backends.rocksdb import RocksDBBackend
        from asyncstate.errors import BackendError
        try:
            RocksDBBackend({path!r})
        except BackendError as exc:
            print(exc.path, exc)
    """)
    with RocksDBBackend(path):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             check=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.stdout.startswith(f"{path} RocksDB directory {path!r} is already in use")


_FORK_AFTER_OPEN = textwrap.dedent("""
    import os, sys, asyncstate as ast
    from asyncstate.backends import rocksdb_options
    from asyncstate.errors import BackendError
    from asyncstate.runtime.requests import StateKind
    root, opened_first = sys.argv[1], sys.argv[2] == "1"
    if opened_first:  # RocksDB's background threads start with the first database
        ast.RocksDBBackend(os.path.join(root, "parent")).close()
    parent_caches = dict(rocksdb_options._caches)
    pid = os.fork()
    if pid == 0:
        try:
            backend = ast.RocksDBBackend(os.path.join(root, "child"))
            backend.register_state("v", StateKind.VALUE)
            backend.close()  # the first flush: it would wait forever in a broken child
            print("child opened and closed", flush=True)
        except BackendError as exc:
            print("child refused:", exc, flush=True)
        own = rocksdb_options._shared_block_cache(64 * 1024 * 1024)
        print("child cache is the parent's:", any(own is c for c in parent_caches.values()),
              flush=True)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print("child status", status, flush=True)
""")


@pytest.mark.parametrize("opened_first", [True, False])
def test_a_process_forked_after_rocksdb_was_opened_refuses_it_clearly(tmp_path,
                                                                      opened_first):
    """RocksDB's background threads do not survive a fork: a database opened in such a child
    would hang at its first flush, so it is refused with an error saying why. A child forked
    before any database was opened uses RocksDB normally, and builds its own block cache."""
    out = subprocess.run([sys.executable, "-c", _FORK_AFTER_OPEN, str(tmp_path),
                          "1" if opened_first else "0"], capture_output=True, text=True,
                         check=True, timeout=120,  # the hang this guards against
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    lines = out.stdout.splitlines()
    if opened_first:
        assert re.match(r"^child refused: cannot open RocksDB directory '.*child': this process "
                        r"was forked from process \d+ after that one had opened a RocksDB "
                        r"database", lines[0]), out.stdout + out.stderr
    else:
        assert lines[0] == "child opened and closed", out.stdout + out.stderr
    assert lines[1] == "child cache is the parent's: False"


async def test_close_releases_the_directory_even_with_live_handles_and_cursors(tmp_path):
    path = tmp_path / "db"
    backend = RocksDBBackend(path)
    rdb = Harness(backend, asyncio.get_running_loop(), chunk_size=3)
    [_, chunk] = await rdb.run([("l", T.LIST_ADD_ALL, list(range(10)), 0, None),
                                ("l", T.LIST_GET, None, 0, None)])
    assert chunk.continuation is not None
    backend.close()
    backend.close()  # idempotent
    RocksDBBackend(path).close()  # the LOCK is free although `rdb` and `chunk` are alive
    assert "closed" in repr(rdb.states["l"].handle)


async def test_reopen_keeps_data_kinds_and_list_sequence(tmp_path):
    path = tmp_path / "db"
    loop = asyncio.get_running_loop()
    with RocksDBBackend(path) as backend:
        rdb = Harness(backend, loop)
        await rdb.run([("v", T.VALUE_UPDATE, {"x": 1}, 1, None),
                       ("l", T.LIST_ADD_ALL, ["a", "b"], 1, "ns"),
                       ("m", T.MAP_PUT, ("u", 2), 1, None)])
        sequence = backend.list_sequence()
        assert sequence == 2
    with RocksDBBackend(path) as backend:
        assert backend.list_sequence() == sequence
        assert backend.registered_states() == dict(sorted(STATES.items()))
        with pytest.raises(ValueError, match=r"^state 'v' is already registered as value state"):
            backend.register_state("v", StateKind.LIST)
        rdb = Harness(backend, loop)
        await rdb.run([("l", T.LIST_ADD, "c", 1, "ns")])
        got = await rdb.run([("v", T.VALUE_GET, None, 1, None), ("l", T.LIST_GET, None, 1, "ns"),
                             ("m", T.MAP_GET, "u", 1, None)])
        assert got[0] == {"x": 1} and got[1].items == ["a", "b", "c"] and got[2] == 2
        assert backend.list_sequence() == sequence + 1


def test_register_state_with_another_kind_raises_value_error(rocks):
    handle = rocks.register_state("s", StateKind.MAP)
    assert rocks.register_state("s", StateKind.MAP) is handle
    with pytest.raises(ValueError, match=r"^state 's' is already registered as map state \(in "):
        rocks.register_state("s", StateKind.VALUE)


def test_discard_state_leaves_a_fresh_database_that_stays_fresh_on_reopen(tmp_path):
    path = tmp_path / "db"
    key = canonical_key("k")
    with RocksDBBackend(path) as backend:
        assert backend.discard_state() == []  # a fresh database: nothing to drop
        backend.register_state("v", StateKind.VALUE)
        backend.register_state("l", StateKind.LIST)
        kg = 3
        backend.restore_key_group(kg, [["v", key, b"\xc0", msgpack.packb(7)],
                                       ["l", key, b"\xc0", [msgpack.packb(1), msgpack.packb(2)]]])
        backend.set_list_sequence(50)
        assert backend.list_sequence() == 50
        assert backend.discard_state() == ["l", "v"]
        assert backend.registered_states() == {} and backend.list_sequence() == 0
        assert list(backend.snapshot_key_group(kg)) == []
        # A name comes back with any kind, empty.
        backend.register_state("v", StateKind.MAP)
        assert list(backend.snapshot_key_group(kg)) == []
    with RocksDBBackend(path) as backend:  # the drop is durable
        assert backend.registered_states() == {"v": StateKind.MAP}
        assert backend.list_sequence() == 0
        assert list(backend.snapshot_key_group(3)) == []
        assert backend.discard_state() == ["v"]
    with RocksDBBackend(path) as backend:
        assert backend.registered_states() == {}


def test_options_are_validated_and_converted(tmp_path):
    with pytest.raises(ConfigError, match=r"^bloom_filter_bits must be in \[0, 64\], got -1$"):
        RocksDBOptions(bloom_filter_bits=-1)
    with pytest.raises(ConfigError, match=r"^write_buffer_bytes must be in \[65536, "
                                          r"9223372036854775807\], got 10$"):
        RocksDBOptions(write_buffer_bytes=10)
    with pytest.raises(ConfigError, match=r"^disable_wal must be a bool, got 'yes'$"):
        RocksDBOptions(disable_wal="yes")  # type: ignore[arg-type]
    for ratio in (-0.01, 0.3, float("nan"), True, "0.1"):
        with pytest.raises(ConfigError, match=r"^memtable_bloom_ratio must be a number in "
                                              r"\[0, 0\.25\], got "):
            RocksDBOptions(memtable_bloom_ratio=ratio)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^io_parallelism must be in \[1, 64\], got 0$"):
        RocksDBBackend(tmp_path / "x", io_parallelism=0)
    with pytest.raises(ConfigError, match=r"^inline_read_keys must be >= 0, got -1$"):
        RocksDBBackend(tmp_path / "x", inline_read_keys=-1)
    assert not (tmp_path / "x").exists()  # validated before anything is created
    with pytest.raises(TypeError, match=r"^options must be a RocksDBOptions, got dict$"):
        RocksDBBackend(tmp_path / "x", options={})  # type: ignore[arg-type]
    options = RocksDBOptions(block_cache_bytes=0, bloom_filter_bits=0, disable_wal=False)
    with RocksDBBackend(tmp_path / "db", options=options) as backend:
        backend.register_state("v", StateKind.VALUE)


@pytest.mark.parametrize("path", ["", b"db", 5, None, [], b""], ids=repr)
def test_path_that_is_not_a_non_empty_str_is_refused_before_anything_is_created(
        tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)  # "" would otherwise open the current directory as a database
    with pytest.raises(ConfigError, match=r"^path must be a non-empty str or "
                                          r"os\.PathLike\[str\] naming the database directory, "
                                          rf"got {re.escape(repr(path))}$"):
        RocksDBBackend(path)  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(("ratio", "expected"), [(None, ("0.020000", "true")),
                                                 (0.25, ("0.250000", "true")),
                                                 (0, ("0.000000", "false"))])
def test_memtable_bloom_reaches_every_column_family(tmp_path, ratio, expected):
    """RocksDB records the options each column family runs with in its OPTIONS file."""
    options = RocksDBOptions() if ratio is None else RocksDBOptions(memtable_bloom_ratio=ratio)
    with RocksDBBackend(tmp_path / "db", options=options) as backend:
        backend.register_state("v", StateKind.VALUE)
        backend.register_state("m", StateKind.MAP)
    latest = max((tmp_path / "db").glob("OPTIONS-*"), key=lambda p: int(p.name[8:]))
    sections = re.split(r"^\[", latest.read_text(), flags=re.MULTILINE)
    families = {s.split("]", 1)[0]: s for s in sections if s.startswith("CFOptions")}
    assert len(families) == 3, sorted(families)  # the default family holds metadata
    for name, text in families.items():
        settings = dict(re.findall(r"^\s*(memtable_\w+)=(\S+)$", text, flags=re.MULTILINE))
        got = (settings["memtable_prefix_bloom_size_ratio"],
               settings["memtable_whole_key_filtering"])
        assert got == expected, name


def test_rocksdb_module_re_exports_the_options():
    from asyncstate.backends import rocksdb, rocksdb_options

    for name in rocksdb_options.__all__:
        assert name in rocksdb.__all__, name
        assert getattr(rocksdb, name) is getattr(rocksdb_options, name), name


def test_key_helpers():
    assert _prefix_end(b"\x00\x01\xff\xff") == b"\x00\x02"
    assert _prefix_end(b"\x00\x01a") == b"\x00\x01b"
    for key in [0, -1, 2**64 - 1, -(2**63), 1.5, "", "x" * 40, "y" * 300, b"\x00" * 70000,
                None, True, [1, [2, "z"], b"q"], (), [None] * 20]:
        data = canonical_key(key) + b"\xc0tail"
        assert _skip(data, 0) == len(data) - 5, key
    assert _skip(msgpack.packb({"a": [1, 2]}) + b"!", 0) == len(msgpack.packb({"a": [1, 2]}))


# -- snapshot and restore -------------------------------------------------------------------

def _snapshot(backend: RocksDBBackend) -> dict[int, list[tuple[str, bytes, bytes, Any]]]:
    return {kg: list(backend.snapshot_key_group(kg)) for kg in range(MAX_PARALLELISM)}


async def test_snapshot_restore_roundtrip_between_two_instances(tmp_path):
    loop = asyncio.get_running_loop()
    ops: list[Op] = []
    for k in range(60):
        key = k if k % 3 else f"key-{k}"
        ns = None if k % 2 else ("w", k % 5)
        ops += [("v", T.VALUE_UPDATE, {"n": k}, key, ns), ("r", T.REDUCING_ADD, k * 1.5, key, ns),
                ("l", T.LIST_ADD_ALL, [k, str(k), [k]], key, ns),
                ("m", T.MAP_PUT_ALL, [(u, k + u) for u in range(k % 4 + 1)], key, ns)]
    reads: list[Op] = [(name, t, p, k, n) for (name, _t, _p, k, n) in ops[::4]
                       for name, t, p in (("v", T.VALUE_GET, None), ("l", T.LIST_GET, None),
                                          ("m", T.MAP_ITER, None), ("r", T.REDUCING_GET, None))]
    with RocksDBBackend(tmp_path / "a") as source, RocksDBBackend(tmp_path / "b") as target:
        src = Harness(source, loop)
        await src.run(ops)
        snapshot = _snapshot(source)
        assert sum(len(e) for e in snapshot.values()) == 4 * 60
        for entries in snapshot.values():  # grouped per (state, key, namespace)
            groups = [(name, kb, ns) for name, kb, ns, _data in entries]
            assert len(groups) == len(set(groups))
        for name, kind in source.registered_states().items():
            target.register_state(name, kind)
        for _ in range(2):  # restoring twice replaces, never duplicates
            for kg, entries in snapshot.items():
                target.restore_key_group(kg, iter(entries))
        assert _snapshot(target) == snapshot
        target.set_list_sequence(source.list_sequence())
        assert target.list_sequence() >= source.list_sequence()
        target.set_list_sequence(0)  # never lowers the counter
        assert target.list_sequence() >= source.list_sequence()
        dst = Harness(target, loop)
        assert await drained(dst, reads, await dst.run(reads)) == \
            await drained(src, reads, await src.run(reads))


def test_restore_needs_registered_states(rocks):
    with pytest.raises(KeyError, match=r"state 'x' of key group 3 is not registered"):
        rocks.restore_key_group(3, [("x", b"\x01", b"\xc0", b"\x01")])


async def test_restore_replaces_each_named_key_and_namespace_like_the_heap(tmp_path):
    loop = asyncio.get_running_loop()
    heap_backend = HeapBackend()
    with RocksDBBackend(tmp_path / "db") as backend:
        harnesses = [Harness(heap_backend, loop), Harness(backend, loop)]
        setup: list[Op] = [("l", T.LIST_ADD_ALL, [1, 2], "a", None),
                           ("l", T.LIST_ADD_ALL, [3], "a", "other"),
                           ("m", T.MAP_PUT_ALL, [("x", 1), ("y", 2)], "a", None)]
        kg = record_context("a").key_group
        entries = [["l", canonical_key("a"), canonical_key(None), [msgpack.packb(9)]],
                   ["m", canonical_key("a"), canonical_key(None), [[canonical_key("z"), b"\x03"]]]]
        reads: list[Op] = [("l", T.LIST_GET, None, "a", None),
                           ("l", T.LIST_GET, None, "a", "other"),
                           ("m", T.MAP_ITER, None, "a", None)]
        got = []
        for harness in harnesses:
            await harness.run(setup)
            harness.backend.restore_key_group(kg, entries)  # type: ignore[attr-defined]
            got.append(await drained(harness, reads, await harness.run(reads)))
        assert got[1] == got[0] == [[9], [3], [("z", 3)]]


async def test_checkpoint_glue_moves_state_between_rocksdb_and_heap(tmp_path):
    from asyncstate.checkpoint.layout import checkpoint_path
    from asyncstate.checkpoint.reader import open_checkpoint
    from asyncstate.checkpoint.snapshot import restore_snapshot, write_snapshot
    from asyncstate.keygroups import KeyGroupRange

    loop = asyncio.get_running_loop()
    everything = KeyGroupRange(0, MAX_PARALLELISM - 1)
    ops: list[Op] = [op for k in range(40) for op in (
        ("v", T.VALUE_UPDATE, [k], k, None), ("l", T.LIST_ADD_ALL, [k, -k], k, "ns"),
        ("m", T.MAP_PUT, (k % 3, str(k)), k, None), ("a", T.AGGREGATING_ADD, k, k, None))]
    reads: list[Op] = [(name, t, None, k, ns) for k in range(40) for name, t, ns in (
        ("v", T.VALUE_GET, None), ("l", T.LIST_GET, "ns"), ("m", T.MAP_ITER, None),
        ("a", T.AGGREGATING_GET, None))]
    with RocksDBBackend(tmp_path / "a") as first, RocksDBBackend(tmp_path / "b") as last:
        source = Harness(first, loop)
        await source.run(ops)
        expected = await drained(source, reads, await source.run(reads))
        write_snapshot(first, checkpoint_path(tmp_path, 1), parallelism=1, operator_index=0,
                       max_parallelism=MAX_PARALLELISM)
        heap_backend = HeapBackend()
        restore_snapshot(heap_backend, open_checkpoint(checkpoint_path(tmp_path, 1)), everything,
                         MAX_PARALLELISM)
        heap = Harness(heap_backend, loop)
        assert await drained(heap, reads, await heap.run(reads)) == expected
        write_snapshot(heap_backend, checkpoint_path(tmp_path, 2), parallelism=1,
                       operator_index=0, max_parallelism=MAX_PARALLELISM)
        restore_snapshot(last, open_checkpoint(checkpoint_path(tmp_path, 2)), everything,
                         MAX_PARALLELISM)
        target = Harness(last, loop)
        assert await drained(target, reads, await target.run(reads)) == expected


@pytest.mark.timeout(60)
async def test_close_from_another_thread_fails_the_batches_under_way(tmp_path):
    """close() on another thread (a shutdown hook) while batches wait for reads: each is
    delivered once, failed, on the loop thread, so nothing waits for them forever."""
    backend = RocksDBBackend(tmp_path / "db", io_parallelism=1, inline_read_keys=0)
    harness = Harness(backend, asyncio.get_running_loop())
    gate = threading.Event()
    backend._pool.submit(gate.wait, 30)  # the one I/O thread is busy: the reads queue behind
    pending = [harness.submit([harness.request(("v", T.VALUE_GET, None, k, None))])
               for k in range(5)]
    assert not any(f.done() for f in pending)
    closer = threading.Thread(target=backend.close)
    closer.start()
    gate.set()
    closer.join(30)  # the loop thread waits here: nothing is delivered before the close ends
    assert not closer.is_alive()
    for fut in pending:
        with pytest.raises(InvalidStateError, match=r"was closed while this batch was under "
                                                    r"way$"):
            await asyncio.wait_for(fut, 10)
    assert sorted(harness.delivery_order) == sorted(set(harness.delivery_order))
    assert len(harness.delivery_order) == 5


_CLOSE_WITH_A_FULL_DISK = textwrap.dedent("""
    import os, resource, signal, sys
    from asyncstate.backends.rocksdb import RocksDBBackend
    from asyncstate.errors import BackendError
    from asyncstate.runtime.requests import StateKind
    path = sys.argv[1]
    backend = RocksDBBackend(path)  # the WAL is off: close() flushes the memtable
    handle = backend.register_state("v", StateKind.VALUE)
    handle.cf[b"\\x00\\x00k"] = os.urandom(100_000)
    del handle
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    for attempt in range(3):
        try:
            backend.close()
            print("closed")
        except BackendError as exc:
            print("failed", exc.path)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
    RocksDBBackend(path).close()
    print("reopened")
""")


def test_close_that_failed_is_not_retried_and_releases_the_directory(tmp_path):
    """A close whose flush fails (the file size limit stands in for a full disk) raises
    BackendError once; later closes do nothing (close() is idempotent) and the directory
    can be opened again."""
    path = str(tmp_path / "db")
    out = subprocess.run([sys.executable, "-c", _CLOSE_WITH_A_FULL_DISK, path],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.splitlines() == [f"failed {path}", "closed", "closed", "reopened"]


def test_discard_state_detaches_the_handles_it_handed_out(tmp_path):
    path = tmp_path / "db"
    backend = RocksDBBackend(path)
    handle = backend.register_state("v", StateKind.VALUE)
    assert backend.discard_state() == ["v"]
    assert (handle.cf, handle.cf_handle) == (None, None)  # never a dropped column family
    backend.close()
    with RocksDBBackend(path) as reopened:  # the live handle does not hold the directory
        assert reopened.registered_states() == {}
    del handle


async def test_a_list_iterated_after_an_append_in_one_batch_gets_the_counter_with_it(
        tmp_path):
    """The batch's writes are split before the iteration; each part carries the list
    sequence, so a failure of the iteration leaves no element above the stored counter."""
    with RocksDBBackend(tmp_path / "db") as backend:
        harness = Harness(backend, asyncio.get_running_loop())
        requests = [harness.request(op) for op in [("l", T.LIST_ADD, "a", 1, None),
                                                   ("l", T.LIST_GET, None, 1, None),
                                                   ("l", T.LIST_ADD, "b", 1, None)]]
        job = backend._plan(requests)
        first, (index, _cursor), last = job.steps
        assert index == 1
        assert (len(first), len(last)) == (2, 2)  # one element and the counter each
        # The same requests through the backend: the iteration sees the first append only.
        ops = [("l", T.LIST_ADD, "a", 2, None), ("l", T.LIST_GET, None, 2, None),
               ("l", T.LIST_ADD, "b", 2, None)]
        added, chunk, added_too = await harness.run(ops)
        assert (added, chunk.items, chunk.continuation, added_too) == (None, ["a"], None, None)
