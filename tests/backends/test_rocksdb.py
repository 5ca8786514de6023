"""RocksDBBackend's batches against a real RocksDB in tmp_path, compared with HeapBackend:
every request type, read-your-writes within and across unfinished batches, reads through
the I/O pool, and chunked iteration."""

from __future__ import annotations

import asyncio
import os
import tempfile
from typing import Any

import msgpack
import pytest
from backend_harness import (
    ITERATIONS,
    MAP_ITERATIONS,
    Harness,
    Op,
    drained,
    record_context,
)
from executor_doubles import RecordingRemote
from hypothesis import example, given, settings
from hypothesis import strategies as st
from shared_functions import (
    LOOP_NAMES,
    Script,
    Sum,
    keyed_operator,
    run_on_loop,
    slow_examples,
)

import asyncstate as ast
from asyncstate.backends.heap import HeapBackend
from asyncstate.backends.rocksdb import (
    _MIN_PART_KEYS,
    RocksDBBackend,
    RocksDBOptions,
)
from asyncstate.backends.rocksdb_layout import _prefix_end, _skip
from asyncstate.errors import InvalidStateError
from asyncstate.runtime.future import StateFuture
from asyncstate.runtime.requests import IteratorChunk, StateRequest, StateRequestType
from asyncstate.serde import canonical_key

T = StateRequestType

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
            assert chunks < 34, "more chunks than 100 items make"
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
       memtable_bloom_ratio=st.sampled_from([0, 0.02, 0.25]), loop=st.sampled_from(LOOP_NAMES))
def test_random_batches_match_heap(ops, cuts, chunked, inline, memtable_bloom_ratio, loop):
    """Concurrent examples read through the pool, so that a batch's reads can overtake an
    earlier batch's writes; chunked examples (chunk size 1) also try loop-thread reads.
    Every read is answered by a memtable, with its bloom filter off, default or largest.
    Pool reads come back through call_soon_threadsafe, which each loop schedules its way."""
    batches = _split(ops, cuts, cut_after_iterations=chunked)
    options = RocksDBOptions(memtable_bloom_ratio=memtable_bloom_ratio)
    with tempfile.TemporaryDirectory() as tmp:
        run_on_loop(loop, _compare(os.path.join(tmp, "db"), batches, chunked,
                                   inline if chunked else 0, options))


def test_key_helpers():
    assert _prefix_end(b"\x00\x01\xff\xff") == b"\x00\x02"
    assert _prefix_end(b"\x00\x01a") == b"\x00\x01b"
    for key in [0, -1, 2**64 - 1, -(2**63), 1.5, "", "x" * 40, "y" * 300, b"\x00" * 70000,
                None, True, [1, [2, "z"], b"q"], (), [None] * 20]:
        data = canonical_key(key) + b"\xc0tail"
        assert _skip(data, 0) == len(data) - 5, key
    assert _skip(msgpack.packb({"a": [1, 2]}) + b"!", 0) == len(msgpack.packb({"a": [1, 2]}))


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


# -- destructive requests on data of an earlier batch, then reads in the same batch ---------
#
# The plan answers a read that follows a write of its (key, namespace) from the batch's own
# overlay, and runs an iteration after the writes before it. These cases start from data an
# earlier batch left (in the memtable, or after a reopen in SST files), so a clear, a removal
# or a replacement has something to hide; every read after it must see the batch's view.

USER_KEYS_5 = ["u", "w", "x", "y", "z"]


def earlier_writes(key: Any, ns: Any) -> list[Op]:
    """A value of each value kind, a list of five elements and a map of five entries (more
    than one chunk at chunk size 2)."""
    return [("v", T.VALUE_UPDATE, "old", key, ns), ("r", T.REDUCING_ADD, 10, key, ns),
            ("a", T.AGGREGATING_ADD, [20], key, ns),
            ("l", T.LIST_ADD_ALL, [1, 2, 3, 4, 5], key, ns),
            ("m", T.MAP_PUT_ALL, [(u, i) for i, u in enumerate(USER_KEYS_5)], key, ns)]


# Each destructive request, as (state, type, payload).
DESTRUCTIVE: dict[str, tuple[str, StateRequestType, Any]] = {
    "clear-value": ("v", T.CLEAR, None),
    "value-update-none": ("v", T.VALUE_UPDATE, None),
    "clear-reducing": ("r", T.CLEAR, None),
    "reducing-add-none": ("r", T.REDUCING_ADD, None),
    "clear-aggregating": ("a", T.CLEAR, None),
    "aggregating-add-none": ("a", T.AGGREGATING_ADD, None),
    "clear-list": ("l", T.CLEAR, None),
    "list-update-empty": ("l", T.LIST_UPDATE, []),
    "list-update-replace": ("l", T.LIST_UPDATE, [9]),
    "clear-map": ("m", T.CLEAR, None),
    "map-remove": ("m", T.MAP_REMOVE, "u"),
    "map-put-none": ("m", T.MAP_PUT, ("w", None)),
    "map-put-all-none": ("m", T.MAP_PUT_ALL, [(u, None) for u in USER_KEYS_5]),
}

# Every request type, as what follows the destructive one on the same (key, namespace).
FOLLOWERS: dict[str, tuple[str, StateRequestType, Any]] = {
    "value-get": ("v", T.VALUE_GET, None),
    "value-update": ("v", T.VALUE_UPDATE, "new"),
    "clear-value": ("v", T.CLEAR, None),
    "reducing-get": ("r", T.REDUCING_GET, None),
    "reducing-add": ("r", T.REDUCING_ADD, 1),
    "aggregating-get": ("a", T.AGGREGATING_GET, None),
    "aggregating-add": ("a", T.AGGREGATING_ADD, [2]),
    "list-get": ("l", T.LIST_GET, None),
    "list-add": ("l", T.LIST_ADD, 6),
    "list-add-all": ("l", T.LIST_ADD_ALL, [7, 8]),
    "list-update": ("l", T.LIST_UPDATE, [0]),
    "clear-list": ("l", T.CLEAR, None),
    "map-get": ("m", T.MAP_GET, "u"),
    "map-contains": ("m", T.MAP_CONTAINS, "w"),
    "map-put": ("m", T.MAP_PUT, ("u", 7)),
    "map-put-all": ("m", T.MAP_PUT_ALL, [("w", 8), ("new", 9)]),
    "map-remove": ("m", T.MAP_REMOVE, "x"),
    "map-is-empty": ("m", T.MAP_IS_EMPTY, None),
    "map-iter": ("m", T.MAP_ITER, None),
    "map-iter-key": ("m", T.MAP_ITER_KEY, None),
    "map-iter-value": ("m", T.MAP_ITER_VALUE, None),
    "clear-map": ("m", T.CLEAR, None),
}


def reads(key: Any, ns: Any) -> list[Op]:
    """Every read of every state of (key, namespace), a list and a map iteration included
    (the map iterations of keys or values alone follow as FOLLOWERS)."""
    return [("v", T.VALUE_GET, None, key, ns), ("r", T.REDUCING_GET, None, key, ns),
            ("a", T.AGGREGATING_GET, None, key, ns), ("l", T.LIST_GET, None, key, ns),
            *(("m", T.MAP_GET, u, key, ns) for u in [*USER_KEYS_5, "new"]),
            *(("m", T.MAP_CONTAINS, u, key, ns) for u in [*USER_KEYS_5, "new"]),
            ("m", T.MAP_IS_EMPTY, None, key, ns), ("m", T.MAP_ITER, None, key, ns)]


def destroy_then(destructive: str, follower: str | None, key: Any, ns: Any) -> list[Op]:
    """The destructive request, the follower (if any), then every read: one segment of a
    batch, all on (key, namespace)."""
    ops: list[Op] = [(*DESTRUCTIVE[destructive], key, ns)]  # type: ignore[list-item]
    if follower is not None:
        ops.append((*FOLLOWERS[follower], key, ns))  # type: ignore[arg-type]
    return ops + reads(key, ns)


async def drained_at_once(harness: Harness, ops: list[Op], results: list[Any]) -> list[Any]:
    """`drained`, with the iterations loading their chunks side by side (reads only)."""
    out = list(results)
    chunks = [i for i, r in enumerate(results) if isinstance(r, IteratorChunk)]
    loaded = await asyncio.gather(*(harness.drain(ops[i], results[i]) for i in chunks))
    for i, items in zip(chunks, loaded, strict=True):
        out[i] = items
    return out


async def heap_and_rocksdb_answers(path: str, earlier: list[Op], later: list[Op], *,
                                   chunk: int, inline: int, reopen: bool,
                                   concurrent: bool) -> tuple[list[Any], list[Any]]:
    """`earlier` in one batch, then `later` in one batch, on a HeapBackend and on a
    RocksDBBackend; each side's answers to `later`, iterations drained chunk by chunk.
    `reopen`: the earlier batch's data is flushed to SST files by closing the database
    before the later batch. `concurrent`: both batches are handed over before either
    completes (the later one is planned while the earlier one may be unapplied)."""
    loop = asyncio.get_running_loop()
    heap = Harness(HeapBackend(), loop, chunk_size=chunk)
    [_, expected] = await heap.run_all([earlier, later])
    expected = await drained_at_once(heap, later, expected)
    if reopen:
        with RocksDBBackend(path) as backend:
            await Harness(backend, loop).run(earlier)
    with RocksDBBackend(path, inline_read_keys=inline) as backend:
        rdb = Harness(backend, loop, chunk_size=chunk)
        if reopen:
            got = await rdb.run(later)
        elif concurrent:
            [_, got] = await rdb.run_all([earlier, later])
        else:
            await rdb.run(earlier)
            got = await rdb.run(later)
        got = await drained_at_once(rdb, later, got)
        # What the later batch left behind, read in a batch of its own.
        after = [op for op in later if op[1] in READ_TYPES]
        left = await drained_at_once(rdb, after, await rdb.run(after))
        assert left == await drained_at_once(heap, after, await heap.run(after))
    return expected, got


READ_TYPES = frozenset({T.VALUE_GET, T.REDUCING_GET, T.AGGREGATING_GET, T.LIST_GET,
                        T.MAP_GET, T.MAP_CONTAINS, T.MAP_IS_EMPTY, *MAP_ITERATIONS})


@pytest.mark.parametrize(("where", "inline"), [
    ("memtable", 0), ("memtable", 16), ("sst", 0), ("unapplied", 0)],
    ids=["memtable-pool-reads", "memtable-inline-reads", "sst", "unapplied"])
async def test_every_request_after_every_destructive_one_in_one_batch_matches_heap(
        tmp_path: Any, inline: int, where: str) -> None:
    """Every (destructive request, request type) pair, each on a (key, namespace) of its
    own that an earlier batch filled, all in one batch, each pair followed by every read
    (iterations in chunks of two)."""
    pairs = [(d, f) for d in DESTRUCTIVE for f in [None, *FOLLOWERS]]
    keys = {pair: (i, "ns" if i % 2 else None) for i, pair in enumerate(pairs)}
    earlier = [op for key, ns in keys.values() for op in earlier_writes(key, ns)]
    later = [op for (d, f), (key, ns) in keys.items() for op in destroy_then(d, f, key, ns)]
    expected, got = await heap_and_rocksdb_answers(
        str(tmp_path / "db"), earlier, later, chunk=2, inline=inline,
        reopen=where == "sst", concurrent=where == "unapplied")
    for op, want, answer in zip(later, expected, got, strict=True):
        assert answer == want, op
    # Spot checks against the model itself, so that a mistake the heap shares cannot hide.
    answers = {(op[3], op[1], op[2]): answer for op, answer in zip(later, got, strict=True)
               if op[1] in READ_TYPES}
    k = keys[("clear-map", None)][0]
    assert answers[(k, T.MAP_CONTAINS, "u")] is False and answers[(k, T.MAP_ITER, None)] == []
    assert answers[(k, T.MAP_IS_EMPTY, None)] is True
    k = keys[("list-update-empty", "list-add-all")][0]
    assert answers[(k, T.LIST_GET, None)] == [7, 8]
    k = keys[("map-remove", "map-iter-key")][0]
    assert answers[(k, T.MAP_ITER_KEY, None)] == ["w", "x", "y", "z"]
    k = keys[("value-update-none", None)][0]
    assert answers[(k, T.VALUE_GET, None)] is None
    k = keys[("clear-reducing", "reducing-add")][0]
    assert answers[(k, T.REDUCING_GET, None)] == 1


DESTROY = st.one_of(
    _op("v", T.CLEAR), _op("v", T.VALUE_UPDATE, st.none()), _op("r", T.CLEAR),
    _op("a", T.CLEAR), _op("l", T.CLEAR), _op("l", T.LIST_UPDATE, st.lists(VALUES, max_size=1)),
    _op("m", T.CLEAR), _op("m", T.MAP_REMOVE, USER_KEYS),
    _op("m", T.MAP_PUT, st.tuples(USER_KEYS, st.none())),
    _op("m", T.MAP_PUT_ALL, st.lists(st.tuples(USER_KEYS, st.none()), min_size=1, max_size=3)))
# The later batch's writes come before its iterations: a write between two chunk loads of
# an iteration may show up on RocksDB and not on the heap (docs/backends.md).
WRITE_OPS = st.one_of(
    _op("v", T.VALUE_UPDATE, st.one_of(st.none(), VALUES)), _op("v", T.CLEAR),
    _op("r", T.REDUCING_ADD, VALUES), _op("a", T.AGGREGATING_ADD, VALUES), _op("a", T.CLEAR),
    _op("l", T.LIST_ADD, VALUES), _op("l", T.LIST_ADD_ALL, st.lists(VALUES, max_size=3)),
    _op("l", T.LIST_UPDATE, st.lists(VALUES, max_size=3)), _op("l", T.CLEAR),
    _op("m", T.MAP_PUT, st.tuples(USER_KEYS, st.one_of(st.none(), VALUES))),
    _op("m", T.MAP_PUT_ALL, st.lists(st.tuples(USER_KEYS, VALUES), max_size=3)),
    _op("m", T.MAP_REMOVE, USER_KEYS), _op("m", T.CLEAR))
READ_OPS = st.one_of(
    _op("v", T.VALUE_GET), _op("r", T.REDUCING_GET), _op("a", T.AGGREGATING_GET),
    _op("l", T.LIST_GET), _op("m", T.MAP_GET, USER_KEYS), _op("m", T.MAP_CONTAINS, USER_KEYS),
    _op("m", T.MAP_IS_EMPTY), st.sampled_from(MAP_ITERATIONS).flatmap(lambda t: _op("m", t)))
LATER_WRITES = st.lists(WRITE_OPS, max_size=6)
LATER_READS = st.lists(READ_OPS, min_size=1, max_size=8)
BASE = [op for key in (0, "k") for ns in (None, "ns") for op in earlier_writes(key, ns)]


@settings(max_examples=slow_examples(10), deadline=None)
@given(earlier=st.lists(WRITE_OPS, max_size=15),
       destroy=DESTROY, writes=LATER_WRITES, reads=LATER_READS,
       chunk=st.sampled_from([1, 2, 1000]), where=st.sampled_from(["memtable", "sst",
                                                                 "unapplied"]),
       inline=st.sampled_from([0, 4]), loop=st.sampled_from(LOOP_NAMES))
@example(earlier=[], destroy=("m", T.CLEAR, None, "k", None), writes=[],
         reads=[("m", T.MAP_CONTAINS, "u", "k", None), ("m", T.MAP_ITER, None, "k", None)],
         chunk=2, where="memtable", inline=0, loop="asyncio")
@example(earlier=[], destroy=("l", T.LIST_UPDATE, [], 0, "ns"),
         writes=[("l", T.LIST_ADD, "x", 0, "ns")], reads=[("l", T.LIST_GET, None, 0, "ns")],
         chunk=1, where="sst", inline=0, loop="uvloop")
@example(earlier=[], destroy=("m", T.MAP_REMOVE, "u", "k", "ns"), writes=[],
         reads=[("m", T.MAP_ITER_KEY, None, "k", "ns"), ("m", T.MAP_GET, "u", "k", "ns")],
         chunk=1, where="unapplied", inline=0, loop="asyncio")
@example(earlier=[], destroy=("v", T.VALUE_UPDATE, None, 0, None), writes=[],
         reads=[("v", T.VALUE_GET, None, 0, None)], chunk=1000, where="sst", inline=4,
         loop="uvloop")
@example(earlier=[], destroy=("m", T.MAP_PUT_ALL, [(u, None) for u in USER_KEYS_5], 0, None),
         writes=[], reads=[("m", T.MAP_IS_EMPTY, None, 0, None),
                           ("m", T.MAP_ITER_VALUE, None, 0, None)],
         chunk=2, where="memtable", inline=4, loop="asyncio")
@example(earlier=[], destroy=("l", T.CLEAR, None, "k", None), writes=[],
         reads=[("l", T.LIST_GET, None, "k", None)], chunk=2, where="unapplied", inline=0,
         loop="uvloop")
@example(earlier=[], destroy=("m", T.MAP_PUT, ("w", None), 0, "ns"),
         writes=[("m", T.MAP_PUT, ("u", 5), 0, "ns")],
         reads=[("m", T.MAP_GET, "w", 0, "ns"), ("m", T.MAP_CONTAINS, "w", 0, "ns"),
                ("m", T.MAP_ITER, None, 0, "ns")], chunk=1, where="sst", inline=0, loop="asyncio")
@example(earlier=[], destroy=("a", T.CLEAR, None, "k", "ns"),
         writes=[("a", T.AGGREGATING_ADD, [1], "k", "ns")],
         reads=[("a", T.AGGREGATING_GET, None, "k", "ns")], chunk=1000, where="memtable",
         inline=0, loop="uvloop")
def test_destructive_requests_then_anything_in_one_batch_match_heap(
        earlier: list[Op], destroy: Op, writes: list[Op], reads: list[Op], chunk: int,
        where: str, inline: int, loop: str) -> None:
    """An earlier batch fills every state of a few (key, namespace)s; a later batch starts
    with a destructive request and goes on with writes, then reads and iterations."""
    with tempfile.TemporaryDirectory() as tmp:
        expected, got = run_on_loop(loop, heap_and_rocksdb_answers(
            os.path.join(tmp, "db"), [*BASE, *earlier], [destroy, *writes, *reads],
            chunk=chunk, inline=inline, reopen=where == "sst", concurrent=where == "unapplied"))
    assert got == expected


async def test_a_record_that_destroys_then_reads_without_awaiting_shares_one_batch(
        tmp_path: Any) -> None:
    """Through the controller: each record issues a destructive request of its own kind and
    then every read without awaiting (a plain def), all in one batch of a RocksDB behind a
    recording wrapper; the answers are the heap's."""
    kinds = sorted(k for k in DESTRUCTIVE if not k.endswith("-add-none"))  # API-level kinds
    descriptors = dict(v=ast.ValueStateDescriptor("v"), l=ast.ListStateDescriptor("l"),
                       m=ast.MapStateDescriptor("m"),
                       r=ast.ReducingStateDescriptor("r", lambda a, b: a + b),
                       a=ast.AggregatingStateDescriptor("a", Sum()))

    def fill(s: Any, ctx: Any) -> Any:
        return ast.combine_all([s.v.update("old"), s.r.add(10), s.a.add(20),
                                s.l.add_all([1, 2, 3, 4, 5]),
                                s.m.put_all({u: i for i, u in enumerate(USER_KEYS_5)})])

    def destroy_and_read(s: Any, ctx: Any) -> Any:
        name, t, payload = DESTRUCTIVE[kinds[ctx.current_key]]
        state = getattr(s, name)
        if t is T.CLEAR:
            state.clear()
        elif t is T.MAP_REMOVE:
            state.remove(payload)
        elif t is T.MAP_PUT:
            state.put(*payload)
        elif t is T.MAP_PUT_ALL:
            state.put_all(dict(payload))
        else:  # LIST_UPDATE, VALUE_UPDATE
            state.update(payload)
        reads = [s.v.value(), s.r.get(), s.a.get(),
                 s.l.get().then_compose(lambda it: it.to_list()),
                 *(s.m.get(u) for u in USER_KEYS_5), *(s.m.contains(u) for u in USER_KEYS_5),
                 s.m.is_empty(), s.m.entries().then_compose(lambda it: it.to_list())]
        return ast.combine_all(reads).then_accept(lambda got: ctx.emit((ctx.current_key, got)))

    async def run(backend: Any) -> list[Any]:
        config = ast.AsyncStateConfig(batch_size=10_000, buffer_timeout_ms=0,
                                      iterator_chunk_size=2)
        async with keyed_operator(Script(**descriptors), backend, config=config) as op:
            for k in range(len(kinds)):
                await op.process((k, fill))
            await op.drain()
            for k in range(len(kinds)):
                await op.process((k, destroy_and_read))
            await op.drain()
            return sorted(op.outputs(), key=lambda out: out[0])

    recording = RecordingRemote(ast.RocksDBBackend(str(tmp_path / "db")), latency_ms=0)
    got = await run(recording)
    assert got == await run(ast.HeapBackend())
    # The destructive requests and the first round of reads of every record were one batch.
    # (A merging state's get after a write of that state waits for the write, so it is
    # issued into the next batch; every other request the records issued did share one.)
    issued = [(i, r) for i, batch in enumerate(recording.batches) for r in batch
              if r[1][1] is destroy_and_read and r[2] not in (
                  T.ITERATOR_LOADING, T.REDUCING_GET, T.AGGREGATING_GET)]
    assert {i for i, _ in issued} == {issued[0][0]}
    assert {key for _, (key, _, _) in issued} == set(range(len(kinds)))
    assert len(issued) == len(kinds) * (1 + 14)  # the destructive request and 14 reads
