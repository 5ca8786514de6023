"""The state cache (asyncstate/backends/cache.py): never stale, bounded, emptied by a restore.

Random programs over every request type run on a cached backend and on the heap backend
(the reference, no cache); what each key read must be identical. Small caches force
evictions, random latencies deliver batches out of order, and small iterator chunks make
iterations continue from the cache's own cursors.
"""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shared_functions import Counter, slow_examples
from state_programs import PROGRAMS, run_program

import asyncstate as ast
from asyncstate.backends.base import ExecutorBinding
from asyncstate.backends.cache import BUFFERED, MISS, StateCache
from asyncstate.runtime.context import RecordContext
from asyncstate.runtime.future import StateFuture
from asyncstate.runtime.requests import StateKind, StateRequest, StateRequestType
from asyncstate.serde import NONE_BYTES, canonical_key, to_stored

_T = StateRequestType


def _remote_cached(cache_entries: int, latency_ms: float, seed: int,
                   write_back: bool = False) -> Any:
    # The controller talks to the caching backend itself: the cache answers at issue time.
    return ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=latency_ms,
                                      latency_p99_ms=4 * latency_ms if latency_ms else None,
                                      cache_entries=cache_entries, seed=seed,
                                      cache_write_back=write_back)


def _remote_cached_wrapped(cache_entries: int, latency_ms: float, seed: int,
                           write_back: bool = False) -> Any:
    # A wrapper in front of the caching backend: the cache answers at trigger time, inside
    # execute_batch, and sends the rest of each batch on (a write-back cache writes through).
    inner = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0,
                                       cache_entries=cache_entries,
                                       cache_write_back=write_back)
    return ast.SimulatedRemoteBackend(inner, latency_ms=latency_ms, io_parallelism=3,
                                      latency_p99_ms=4 * latency_ms if latency_ms else None,
                                      seed=seed)


@settings(max_examples=60)
@given(program=PROGRAMS, cache_entries=st.integers(1, 6),
       latency_ms=st.sampled_from([0, 0.2, 0.5]), seed=st.integers(0, 2**16),
       batch_size=st.integers(1, 5), max_in_flight=st.integers(1, 8),
       wrapped=st.booleans(), write_back=st.booleans())
def test_cached_remote_answers_as_the_uncached_heap(program, cache_entries, latency_ms, seed,
                                                     batch_size, max_in_flight, wrapped,
                                                     write_back):
    # A write-back cache's final reads run on a restore of the checkpoint the run ends
    # with: they see what the store got, so a write held back and never handed on shows.
    make = _remote_cached_wrapped if wrapped else _remote_cached
    backend = make(cache_entries, latency_ms, seed, write_back)
    with tempfile.TemporaryDirectory(prefix="asyncstate-cache-") as tmp:
        got = run_program(program, backend, batch_size=batch_size, max_in_flight=max_in_flight,
                          checkpoint_dir=tmp if write_back else None)
    want = run_program(program, ast.HeapBackend(), batch_size=batch_size,
                       max_in_flight=max_in_flight)
    assert got == want


@settings(max_examples=slow_examples(15))
@given(program=PROGRAMS, cache_entries=st.integers(1, 6), batch_size=st.integers(1, 5),
       max_in_flight=st.integers(1, 8), write_back=st.booleans())
def test_cached_rocksdb_answers_as_the_uncached_heap(program, cache_entries, batch_size,
                                                     max_in_flight, write_back):
    with tempfile.TemporaryDirectory(prefix="asyncstate-cache-") as tmp:
        backend = ast.RocksDBBackend(Path(tmp) / "db", cache_entries=cache_entries,
                                     inline_read_keys=0, cache_write_back=write_back)
        got = run_program(program, backend, batch_size=batch_size, max_in_flight=max_in_flight,
                          checkpoint_dir=str(Path(tmp) / "checkpoints") if write_back else None)
    want = run_program(program, ast.HeapBackend(), batch_size=batch_size,
                       max_in_flight=max_in_flight)
    assert got == want


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_read_between_two_writes_of_one_batch_sees_the_first(wrapped):
    # One batch: a = 1 (buffered), b = 2 (evicts a from a one-entry cache), then one record
    # reads a (a miss) and writes a = 3 without waiting for the read. Only a write with no
    # read between it and a later write of the same entry may be left out of the batch.
    program = [("a", ("vset", 1)), ("b", ("vset", 2)), ("a", ("vget_set", 3))]
    make = _remote_cached_wrapped if wrapped else _remote_cached
    got = run_program(program, make(1, 0, 0), batch_size=10, max_in_flight=10)
    assert got["a"][0] == (2, "vget_set", "1")
    assert got == run_program(program, ast.HeapBackend(), batch_size=10, max_in_flight=10)


def test_hot_keys_are_answered_by_the_cache():
    backend = _remote_cached(cache_entries=10, latency_ms=0, seed=0)
    records = [i % 5 for i in range(500)]
    outputs = ast.run(Counter(), records, key_selector=lambda r: r, backend=backend)
    assert max(n for k, n in outputs if k == 3) == 100
    cache = backend.state_cache
    # Each key's first read misses; every later read of its count is a hit.
    assert (cache.misses, cache.hits) == (5, 495)
    assert backend.calls < 500  # the writes only: reads made no remote call


def test_capacity_bounds_entries_least_recently_used_first_out():
    cache = StateCache(3)

    class S:
        name, kind, handle = "v", StateKind.VALUE, None

    def put(key: bytes, value: int) -> None:
        assert cache.answer(S, _T.VALUE_UPDATE, value, key, b"\xc0", 0) is BUFFERED

    def get(key: bytes) -> Any:
        return cache.answer(S, _T.VALUE_GET, None, key, b"\xc0", 0)

    for i in range(3):
        put(bytes([i]), i)
    assert get(b"\x00") == 0  # now the most recently used
    put(b"\x03", 3)  # a new key's first write: the full cache does not admit it
    assert cache.size == 3 and cache.evictions == 0 and cache.refused == 1
    put(b"\x03", 4)  # its second: admitted, evicting b"\x01", the least recently used
    assert cache.size == 3 and cache.evictions == 1 and cache.refused == 1
    assert get(b"\x01") is MISS
    assert [get(k) for k in (b"\x00", b"\x02", b"\x03")] == [0, 2, 4]


def test_keys_that_come_once_do_not_push_hot_keys_out():
    # Five hot keys, then 1,000 keys counted once each, then the hot keys again, through a
    # cache of 10 entries. Least recently used first out alone, the once-only keys would
    # have pushed the hot ones out: each would miss again at its return.
    backend = _remote_cached(cache_entries=10, latency_ms=0, seed=0)
    hot = [i % 5 for i in range(50)]
    records = hot + list(range(100, 1100)) + hot
    outputs = ast.run(Counter(), records, key_selector=lambda r: r, backend=backend)
    assert [n for k, n in outputs if k == 3] == list(range(1, 21))
    assert all(n == 1 for k, n in outputs if k >= 100)
    cache = backend.state_cache
    assert (cache.misses, cache.hits) == (5 + 1000, 45 + 50)
    assert cache.evictions == 0
    # The five first once-only keys filled the cache; each later one was turned away twice,
    # its read's answer and its write.
    assert cache.refused == 2 * 995


def test_a_key_read_again_is_admitted_into_the_full_cache():
    backend = _remote_cached(cache_entries=2, latency_ms=0, seed=0)
    outputs = ast.run(Counter(), ["a", "b", "c", "c", "c"], key_selector=lambda r: r,
                      backend=backend)
    assert [n for k, n in outputs if k == "c"] == [1, 2, 3]
    cache = backend.state_cache
    # c's first read and write were turned away; its second read missed again and was
    # admitted, pushing "a" out; its third read was a hit.
    assert (cache.refused, cache.evictions) == (2, 1)
    assert (cache.misses, cache.hits) == (4, 1)


def test_a_list_longer_than_the_cache_is_not_kept():
    cache = StateCache(4)

    class S:
        name, kind, handle = "l", StateKind.LIST, None

    assert cache.answer(S, _T.LIST_UPDATE, [1, 2, 3], b"\x01", b"\xc0", 0) is BUFFERED
    assert cache.answer(S, _T.LIST_GET, None, b"\x01", b"\xc0", 0).items == [1, 2, 3]
    assert cache.answer(S, _T.LIST_ADD, 4, b"\x01", b"\xc0", 0) is BUFFERED  # 1 + 4 > 4
    assert cache.size == 0
    assert cache.answer(S, _T.LIST_GET, None, b"\x01", b"\xc0", 0) is MISS


class _Seed(ast.KeyedProcessFunction):
    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    def process_element(self, value: Any, ctx: ast.RecordContext) -> Any:
        return self.count.update(value[1])


class _Read(ast.KeyedProcessFunction):
    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    def process_element(self, value: Any, ctx: ast.RecordContext) -> Any:
        return self.count.value().then_accept(lambda v: ctx.emit((value[0], v)))


@pytest.mark.parametrize("kind", ["remote", "rocksdb"])
def test_a_restore_empties_the_cache(kind, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    ast.run(_Seed(), [("k", 7)], key_selector=lambda r: r[0], checkpoint_dir=checkpoints,
            checkpoint_id=1)
    if kind == "remote":
        backend = _remote_cached(cache_entries=8, latency_ms=0, seed=0)
    else:
        backend = ast.RocksDBBackend(tmp_path / "db", cache_entries=8)

    class Count:  # what the state `count` looks like to the cache
        name, kind, handle = "count", StateKind.VALUE, None

    # The cache holds something else for key "k" before the restore replaces the state.
    backend.state_cache.answer(Count, _T.VALUE_UPDATE, 99, canonical_key("k"), NONE_BYTES, 0)
    outputs = ast.run(_Read(), [("k", None)], key_selector=lambda r: r[0], backend=backend,
                      restore_from=ast.checkpoint_path(checkpoints, 1))
    assert outputs == [("k", 7)]


# -- the cache alone, against the heap backend as a sequential model -------------------------
#
# Each step is one request of a random type on one of two keys of four states. The heap
# backend applies it at its position (write-through: the store sees every request in order)
# and answers reads there; the cache answers, or sends the read on. Reads sent on come back
# later, in any order, each as a batch of its own, and fill the cache then: a cache that
# filled an answer overtaken by a later write would be stale at the next hit.

_STATES = {"v": StateKind.VALUE, "l": StateKind.LIST, "m": StateKind.MAP,
           "r": StateKind.REDUCING}
_CHUNK = 2
_READ_TYPES = {_T.VALUE_GET, _T.REDUCING_GET, _T.LIST_GET, _T.MAP_GET, _T.MAP_CONTAINS,
               _T.MAP_ITER, _T.MAP_ITER_KEY, _T.MAP_ITER_VALUE, _T.MAP_IS_EMPTY}
_ITERATIONS = {_T.LIST_GET, _T.MAP_ITER, _T.MAP_ITER_KEY, _T.MAP_ITER_VALUE}

_stored = st.one_of(st.integers(0, 9), st.lists(st.integers(0, 9), max_size=2).map(
    lambda v: to_stored(v, "s")))
_TYPES = {
    "v": [_T.VALUE_GET, _T.VALUE_UPDATE, _T.CLEAR],
    "r": [_T.REDUCING_GET, _T.REDUCING_ADD, _T.CLEAR],
    "l": [_T.LIST_GET, _T.LIST_ADD, _T.LIST_UPDATE, _T.LIST_ADD_ALL, _T.CLEAR],
    "m": [_T.MAP_GET, _T.MAP_CONTAINS, _T.MAP_PUT, _T.MAP_PUT_ALL, _T.MAP_REMOVE, _T.MAP_ITER,
          _T.MAP_ITER_KEY, _T.MAP_ITER_VALUE, _T.MAP_IS_EMPTY, _T.CLEAR],
}


def _payload(draw: st.DrawFn, t: StateRequestType, user_keys: list[bytes]) -> Any:
    uk = st.sampled_from(user_keys)
    maybe = st.one_of(st.none(), _stored)
    if t in (_T.VALUE_UPDATE,):
        return draw(maybe)
    if t in (_T.REDUCING_ADD, _T.LIST_ADD):
        return draw(_stored)
    if t in (_T.LIST_UPDATE, _T.LIST_ADD_ALL):
        return draw(st.lists(_stored, max_size=3))
    if t in (_T.MAP_GET, _T.MAP_CONTAINS, _T.MAP_REMOVE):
        return draw(uk)
    if t is _T.MAP_PUT:
        return (draw(uk), draw(maybe))
    if t is _T.MAP_PUT_ALL:
        return draw(st.lists(st.tuples(uk, maybe), max_size=3))
    return None


@st.composite
def _steps(draw: st.DrawFn) -> list[Any]:
    """Requests on few entries (one state kind, one or two keys, one to three user keys)
    so that they revisit each other; now and then a delivery or an invalidation."""
    names = draw(st.sampled_from([["v"], ["l"], ["m"], ["m"], ["r"], list(_STATES)]))
    keys = [b"\x01", b"\x02"][:draw(st.integers(1, 2))]
    user_keys = [canonical_key(k) for k in (1, "x", (2, "y"))][:draw(st.integers(1, 3))]
    steps = []
    for _ in range(draw(st.integers(1, 60))):
        name = draw(st.sampled_from(names))
        t = draw(st.sampled_from(_TYPES[name]))
        action = draw(st.sampled_from(["request"] * 6 + ["deliver", "invalidate"]))
        steps.append((name, draw(st.sampled_from(keys)), t, _payload(draw, t, user_keys),
                      action, draw(st.integers(0, 7))))
    return steps


def _ctx(key_bytes: bytes) -> RecordContext:
    return RecordContext(None, None, key_bytes, 0, None)


class _State:
    def __init__(self, name: str, kind: StateKind, handle: Any) -> None:
        self.name, self.kind, self.handle = name, kind, handle


def _all_items(first: Any, load: Any, t: Any) -> list[Any]:
    """Every item of an iteration whose first chunk is `first`."""
    items, chunk = list(first.items), first
    while chunk.continuation is not None:
        chunk = load((t, chunk.continuation))
        items += chunk.items
    return sorted(items, key=repr) if t is not _T.LIST_GET else items


class _Driver:
    """A cache answering at issue time in front of a heap backend that applies every
    request at its position; reads the cache sends on wait in `pending` for `deliver`."""

    def __init__(self, capacity: int) -> None:
        self.heap = ast.HeapBackend()
        self.heap.open(ExecutorBinding(loop=None, deliver=lambda *a: None,
                                       iterator_chunk_size=_CHUNK, max_parallelism=128))
        self.cache = StateCache(capacity)
        self.sent: list[list[Any]] = []
        self.delivered: list[Any] = []
        self.up = self.cache.open(
            ExecutorBinding(loop=None, deliver=lambda *a: self.delivered.append(a),
                            iterator_chunk_size=_CHUNK, max_parallelism=128),
            self.sent.append)
        self.cache.serve_at_issue()
        self.states = {n: _State(n, k, self.heap.register_state(n, k))
                       for n, k in _STATES.items()}
        self.pending: list[tuple[list[Any], Any]] = []

    def request(self, name: str, key: bytes, t: StateRequestType, payload: Any) -> None:
        """Issue one request to both; a read the cache answers must match the heap's."""
        state = self.states[name]
        want = self.heap.execute_one(state, t, payload, key, NONE_BYTES)
        got = self.cache.answer(state, t, payload, key, NONE_BYTES, 0)
        self.check_bound()
        if t not in _READ_TYPES:
            assert got is BUFFERED  # write-through
            return
        if got is MISS:
            batch = [StateRequest(state, t, payload, NONE_BYTES, _ctx(key), StateFuture())]
            self.cache.execute_batch(batch)
            assert self.sent[-1] is batch
            self.pending.append((batch, want))
            return
        if t in _ITERATIONS:
            def heap_load(p: Any) -> Any:
                return self.heap.execute_one(state, _T.ITERATOR_LOADING, p, key, NONE_BYTES)

            def cache_load(p: Any) -> Any:
                return self.cache.answer(state, _T.ITERATOR_LOADING, p, key, NONE_BYTES, 0)
            assert _all_items(got, cache_load, t) == _all_items(want, heap_load, t)
        else:
            assert got == want

    def check_bound(self) -> None:
        """The entries cached weigh what the cache counts, within its capacity (an entry
        cached or replaced without being counted would let it grow without bound), and the
        most recently used entry is the one the cache remembers as such."""
        cache = self.cache
        weights = sum(cache._weight_of(e) for e in cache._entries.values())
        assert cache._weight == weights <= cache.capacity
        # The key the cache takes for the most recently used one is that (it skips moves).
        assert not cache._mru or next(reversed(cache._entries)) == cache._mru

    def deliver(self, index: int = 0) -> None:
        """The backend answers the `index`-th read still on its way."""
        batch, result = self.pending.pop(index)
        self.up.deliver(batch, [result], None)
        self.check_bound()

    def deliver_all(self) -> None:
        while self.pending:
            self.deliver()
        assert all(results is not None and error is None
                   for _b, results, error in self.delivered)


@settings(max_examples=150)
@given(steps=_steps(), capacity=st.integers(1, 8))
def test_the_cache_never_answers_other_than_the_store(steps, capacity):
    driver = _Driver(capacity)
    for name, key, t, payload, action, pick in steps:
        if action == "deliver" and driver.pending:
            driver.deliver(pick % len(driver.pending))
            continue
        if action == "invalidate":
            driver.cache.invalidate()
        driver.request(name, key, t, payload)
    driver.deliver_all()


# Every sequence of four requests on one entry, from a small vocabulary per state kind; each
# read the cache sends on is answered after the next request (so a write can overtake it),
# then every read is checked once more. Rare combinations (a map known whole, then a removal,
# then a read) are certain to be covered here, however the random programs above fall.
_A, _B = canonical_key(1), canonical_key("x")
_PACKED = to_stored([7], "s")
_VOCABULARY = {
    "v": [(_T.VALUE_GET, None), (_T.VALUE_UPDATE, 1), (_T.VALUE_UPDATE, None),
          (_T.VALUE_UPDATE, _PACKED), (_T.CLEAR, None)],
    "l": [(_T.LIST_GET, None), (_T.LIST_ADD, 1), (_T.LIST_ADD, _PACKED), (_T.LIST_UPDATE, []),
          (_T.LIST_UPDATE, [2, 3, 4]), (_T.LIST_ADD_ALL, [5, _PACKED]), (_T.CLEAR, None)],
    "m": [(_T.MAP_GET, _A), (_T.MAP_CONTAINS, _A), (_T.MAP_PUT, (_A, 1)),
          (_T.MAP_PUT, (_A, None)), (_T.MAP_PUT, (_B, _PACKED)), (_T.MAP_REMOVE, _A),
          (_T.MAP_PUT_ALL, [(_A, 2), (_B, None)]), (_T.MAP_ITER, None),
          (_T.MAP_IS_EMPTY, None), (_T.CLEAR, None)],
}
_CHECKS = {
    "v": [(_T.VALUE_GET, None)],
    "l": [(_T.LIST_GET, None)],
    "m": [(_T.MAP_GET, _A), (_T.MAP_GET, _B), (_T.MAP_CONTAINS, _A), (_T.MAP_CONTAINS, _B),
          (_T.MAP_ITER, None), (_T.MAP_ITER_KEY, None), (_T.MAP_ITER_VALUE, None),
          (_T.MAP_IS_EMPTY, None)],
}


@pytest.mark.parametrize("capacity", [2, 8])
@pytest.mark.parametrize("name", ["v", "l", "m"])
def test_every_short_sequence_on_one_entry(name, capacity):
    for sequence in itertools.product(_VOCABULARY[name], repeat=4):
        driver = _Driver(capacity)
        for t, payload in sequence:
            driver.request(name, b"\x01", t, payload)
            if len(driver.pending) > 1:
                driver.deliver()
        driver.deliver_all()
        for t, payload in _CHECKS[name]:
            driver.request(name, b"\x01", t, payload)
            driver.deliver_all()


# -- writes completed at issue time ----------------------------------------------------------


def test_a_snapshot_holds_every_buffered_write(tmp_path):
    # Reads hit and writes complete at once: records finish long before the slow store has
    # applied their writes. The snapshot drains first, so it holds every one of them.
    backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=2, io_parallelism=1,
                                         cache_entries=100)
    records = [i % 7 for i in range(700)]
    ast.run(Counter(), records, key_selector=lambda r: r, backend=backend,
            checkpoint_dir=tmp_path, checkpoint_id=1,
            config=ast.AsyncStateConfig(batch_size=50, max_in_flight=200))
    assert backend.state_cache.hits == 700 - 7
    outputs = ast.run(_Read(), [(k, None) for k in range(7)], key_selector=lambda r: r[0],
                      restore_from=ast.checkpoint_path(tmp_path, 1))
    assert sorted(outputs) == [(k, 100) for k in range(7)]


async def test_buffered_writes_stay_within_max_in_flight():
    backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=1, io_parallelism=1,
                                         cache_entries=100)
    op = ast.KeyedOperator(Counter(), key_selector=lambda r: r, backend=backend,
                           config=ast.AsyncStateConfig(batch_size=10, max_in_flight=30))
    peak = 0
    async with op:
        for i in range(600):
            await op.process(i % 5)
            peak = max(peak, op.controller.buffered_writes)
        await op.drain()
        assert op.controller.buffered_writes == 0
        assert op.metrics["records_done"] == 600
    assert 0 < peak <= 30


# -- write-back ------------------------------------------------------------------------------


def _write_back_remote(cache_entries: int, latency_ms: float = 0, **options: Any) -> Any:
    return ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=latency_ms,
                                      cache_entries=cache_entries, cache_write_back=True,
                                      **options)


def _restored_counts(path: Any, keys: Any) -> list[Any]:
    return sorted(ast.run(_Read(), [(k, None) for k in keys], key_selector=lambda r: r[0],
                          restore_from=path))


async def _restored_counts_async(path: Any, keys: Any) -> list[Any]:
    async with ast.KeyedOperator(_Read(), key_selector=lambda r: r[0],
                                 backend=ast.HeapBackend(), restore_from=path) as op:
        for k in keys:
            await op.process((k, None))
        await op.drain()
        return sorted(op.outputs())


def test_write_back_hands_each_hot_key_on_once_at_the_end(tmp_path):
    backend = _write_back_remote(10)
    records = [i % 5 for i in range(500)]
    outputs = ast.run(Counter(), records, key_selector=lambda r: r, backend=backend,
                      checkpoint_dir=tmp_path, checkpoint_id=1)
    assert max(n for k, n in outputs if k == 3) == 100
    cache = backend.state_cache
    assert (cache.misses, cache.hits) == (5, 495)
    # No write reached the store while the run went on: one per key, at the final drain.
    assert cache.write_backs == 5 and cache.dirty == 0
    assert _restored_counts(ast.checkpoint_path(tmp_path, 1), range(5)) == \
        [(k, 100) for k in range(5)]


@pytest.mark.parametrize("latency_ms", [0, 0.3])
def test_an_evicted_dirty_entry_is_read_back_from_the_store(latency_ms):
    # A one-entry cache: each record of one key evicts the other key's dirty count, whose
    # write must reach the store before that key's next read does.
    backend = _write_back_remote(1, latency_ms)
    outputs = ast.run(Counter(), ["a", "b"] * 50, key_selector=lambda r: r, backend=backend,
                      config=ast.AsyncStateConfig(batch_size=3, max_in_flight=4))
    assert [n for k, n in outputs if k == "a"] == list(range(1, 51))
    assert [n for k, n in outputs if k == "b"] == list(range(1, 51))
    cache = backend.state_cache
    # Reads went to the store after the other key evicted their entry, and found the count
    # the eviction handed on (or written through, when the full cache turned a key away).
    assert cache.misses > 10 and cache.write_backs > 10


def test_a_rocksdb_write_back_cache_is_handed_on_before_close(tmp_path):
    # Reopening the directory after a clean close finds every write the cache held back.
    backend = ast.RocksDBBackend(tmp_path / "db", cache_entries=100, cache_write_back=True)
    ast.run(Counter(), [i % 7 for i in range(700)], key_selector=lambda r: r, backend=backend)
    assert backend.state_cache.write_backs == 7
    outputs = ast.run(_Read(), [(k, None) for k in range(7)], key_selector=lambda r: r[0],
                      backend=ast.RocksDBBackend(tmp_path / "db"))
    assert sorted(outputs) == [(k, 100) for k in range(7)]


async def test_a_snapshot_holds_the_writes_held_back(tmp_path):
    backend = _write_back_remote(100, latency_ms=0.2)
    op = ast.KeyedOperator(Counter(), key_selector=lambda r: r, backend=backend)
    async with op:
        for i in range(100):
            await op.process(i % 5)
        path = await op.snapshot(tmp_path, 1)
        assert backend.state_cache.dirty == 0  # handed on, still cached
        for i in range(50):
            await op.process(i % 5)
    assert await _restored_counts_async(path, range(5)) == [(k, 20) for k in range(5)]


class _BlindSet(ast.KeyedProcessFunction):
    """Writes each record's value without reading: every write completes in the cache."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    def process_element(self, value: Any, ctx: ast.RecordContext) -> Any:
        return self.count.update(value[1])


async def test_write_backs_of_evicted_entries_stay_within_max_in_flight(tmp_path):
    # Blind writes to 600 keys, two per key, through a 4-entry cache: a key's first write is
    # turned away (written through), its second is admitted and evicts a dirty entry. Each
    # record finishes at once, faster than the slow store applies the writes.
    backend = _write_back_remote(4, latency_ms=1, io_parallelism=1)
    op = ast.KeyedOperator(_BlindSet(), key_selector=lambda r: r[0], backend=backend,
                           config=ast.AsyncStateConfig(batch_size=10, max_in_flight=30))
    peak = 0
    async with op:
        for i in range(600):
            for value in (i * 10 - 1, i * 10):
                await op.process((i, value))
                peak = max(peak, op.controller.buffered_writes)
        path = await op.snapshot(tmp_path, 1)
    assert 0 < peak <= 30
    assert backend.state_cache.write_backs == 600
    assert await _restored_counts_async(path, range(600)) == [(k, k * 10) for k in range(600)]


@pytest.mark.parametrize("make", [
    lambda v: ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0, cache_entries=1,
                                         cache_write_back=v),
    lambda v: ast.RocksDBBackend("unused", cache_entries=1, cache_write_back=v)])
def test_cache_write_back_must_be_a_bool(make):
    with pytest.raises(ast.ConfigError, match="cache_write_back"):
        make("yes")


@pytest.mark.parametrize("make", [
    lambda: ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0, cache_write_back=True),
    lambda: ast.RocksDBBackend("unused", cache_entries=0, cache_write_back=True)])
def test_write_back_without_a_cache_is_refused(make):
    # Without the error the backend would run with no cache at all, writes not held back.
    with pytest.raises(ast.ConfigError, match=r"^cache_write_back must be False when "
                       r"cache_entries is 0 \(write-back is a mode of the state cache: give "
                       r"cache_entries > 0 too\), got True$") as info:
        make()
    assert info.value.option == "cache_write_back"


class _MapFlags(ast.KeyedProcessFunction):
    """("put", v) stores v under "flag"; a read emits get("flag") and contains("flag")."""

    def open(self, ctx: Any) -> None:
        self.m = ctx.get_map_state(ast.MapStateDescriptor("m"))

    async def process_element(self, x: Any, ctx: Any) -> None:
        if x[1] == "put":
            await self.m.put("flag", x[2])
        else:
            ctx.emit((await self.m.get("flag"), await self.m.contains("flag")))


@pytest.mark.parametrize("value", [False, 0, "", True])
def test_a_falsy_map_value_read_after_a_miss_is_a_value(value: Any) -> None:
    # A full cache of 4: key 1's put is written through, its reads miss and are admitted.
    recs = [(2, "put", 1), (3, "put", 1), (1, "put", value)] + [(1, "read")] * 4
    expected = ast.run(_MapFlags(), recs, key_selector=lambda r: r[0])
    assert expected == [(value, True)] * 4
    cached = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0, cache_entries=4)
    assert ast.run(_MapFlags(), recs, key_selector=lambda r: r[0], backend=cached) == expected


def test_a_falsy_map_value_read_from_rocksdb_through_the_cache_is_a_value(tmp_path: Path) -> None:
    path = tmp_path / "db"
    ast.run(_MapFlags(), [(1, "put", False)], key_selector=lambda r: r[0],
            backend=ast.RocksDBBackend(path))
    reads = [(1, "read")] * 3
    assert ast.run(_MapFlags(), reads, key_selector=lambda r: r[0],
                   backend=ast.RocksDBBackend(path, cache_entries=100)) == [(False, True)] * 3


def test_every_chunk_the_store_loads_counts_as_a_miss() -> None:
    class Lists(ast.KeyedProcessFunction):
        ttl: Any = None

        def open(self, ctx: Any) -> None:
            self.items = ctx.get_list_state(ast.ListStateDescriptor("l", ttl=self.ttl))

        async def process_element(self, x: Any, ctx: Any) -> None:
            if x[1] == "fill":
                await self.items.add_all(list(range(10)))
            else:
                ctx.emit(len(await (await self.items.get()).to_list()))

    config = ast.AsyncStateConfig(iterator_chunk_size=3)  # 10 elements: 4 chunks a read
    recs = [(1, "fill")] + [(1, "read")] * 6

    def metrics_of(capacity: int) -> dict[str, Any]:
        import asyncio

        backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0,
                                             cache_entries=capacity)
        out: dict[str, Any] = {}

        async def go() -> None:
            async with ast.KeyedOperator(Lists(), key_selector=lambda r: r[0],
                                         backend=backend, config=config) as op:
                for r in recs:
                    await op.process(r)
                await op.drain()
                out.update(op.metrics, outputs=op.outputs())

        asyncio.run(go())
        return out

    m = metrics_of(1)  # the list never fits: the store answers every chunk
    assert m["outputs"] == [10] * 6
    # 6 reads of 4 chunks, each sent to the store: 24 misses (the first chunks alone: 6).
    assert (m["cache_hits"], m["cache_misses"]) == (0, 24)
    # A state the cache never serves (TTL) counts neither, chunk after chunk.
    Lists.ttl = ast.StateTtlConfig.new_builder(3_600_000).build()
    m = metrics_of(100)
    assert m["outputs"] == [10] * 6
    assert (m["cache_hits"], m["cache_misses"]) == (0, 0)
