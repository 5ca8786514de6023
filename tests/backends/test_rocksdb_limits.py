"""RocksDBBackend at the edges of size and naming: odd and many state names, large batches,
megabyte values, tiny iterator chunks and every key group of the largest max_parallelism."""

from __future__ import annotations

from typing import Any

import pytest
from backend_harness import ManyStates, ReadOnly, key_of, per_key, run_operator
from shared_functions import Counter

import asyncstate as ast
from asyncstate.backends.heap import HeapBackend
from asyncstate.backends.rocksdb import RocksDBBackend, RocksDBOptions
from asyncstate.errors import ConfigError
from asyncstate.keygroups import key_group_of_bytes
from asyncstate.runtime.requests import StateKind
from asyncstate.serde import canonical_key

ODD_NAMES = ["ü€🙂", "a/b", "a:b", ":", "state:x", " ", ".", "..", "x" * 10_000, "LOCK",
             "default"]


@pytest.mark.timeout(60)
async def test_odd_state_names_store_and_reopen_like_the_heap(tmp_path):
    path = tmp_path / "db"
    records = [(k, i) for i in range(3) for k in range(5)]
    got = await run_operator(ManyStates(ODD_NAMES), RocksDBBackend(path), records)
    expected = await run_operator(ManyStates(ODD_NAMES), HeapBackend(), records)
    assert per_key(got) == per_key(expected)
    with RocksDBBackend(path) as backend:
        assert backend.registered_states() == {n: StateKind.VALUE for n in ODD_NAMES}
    got = await run_operator(ManyStates(ODD_NAMES[::-1]), RocksDBBackend(path), [(0, "z")])
    assert got == [(0, [2] * len(ODD_NAMES))]


@pytest.mark.parametrize(("name", "rule"), [
    ("a\x00b", "without NUL characters"), ("\ud800", "that encodes to UTF-8")],
    ids=["nul", "lone-surrogate"])
def test_a_state_name_rocksdb_cannot_store_fails_and_leaves_the_backend_usable(tmp_path, name,
                                                                               rule):
    path = tmp_path / "db"
    with RocksDBBackend(path) as backend:
        with pytest.raises(ConfigError, match=rf"^state name must be a str {rule}"):
            backend.register_state(name, StateKind.VALUE)
        assert backend.registered_states() == {}
        backend.register_state("ok", StateKind.VALUE)
    with RocksDBBackend(path) as backend:
        assert backend.registered_states() == {"ok": StateKind.VALUE}


@pytest.mark.timeout(60)
async def test_one_hundred_states_round_trip_through_a_reopen(tmp_path):
    path = tmp_path / "db"
    names = [f"s{i:03d}" for i in range(100)]
    options = RocksDBOptions(write_buffer_bytes=256 * 1024)
    got = await run_operator(ManyStates(names), RocksDBBackend(path, options=options),
                             [(k, k * 10) for k in range(4)])
    assert got == [(k, [None] * 100) for k in range(4)]
    got = await run_operator(ManyStates(names[::-1]), RocksDBBackend(path, options=options),
                             [(k, -k) for k in range(4)])
    assert got == [(k, [k * 10] * 100) for k in range(4)]
    with RocksDBBackend(path, options=options) as backend:
        assert backend.registered_states() == {n: StateKind.VALUE for n in names}


@pytest.mark.timeout(60)
async def test_a_batch_of_10000_requests_matches_the_heap(tmp_path):
    config = ast.AsyncStateConfig(batch_size=10_000, max_in_flight=20_000,
                                  buffer_timeout_ms=60_000)
    records = [k % 12_000 for k in range(15_000)]
    backend = RocksDBBackend(tmp_path / "db", inline_read_keys=0)
    op = ast.KeyedOperator(Counter(), key_selector=key_of, backend=backend, config=config)
    async with op:
        for r in records:
            await op.process(r)
        await op.drain()
        got = op.outputs()
        assert op.metrics["max_batch_size"] == 10_000  # read in parts over both I/O slots
    assert per_key(got) == per_key(await run_operator(Counter(), HeapBackend(), records))


class BigValues(ast.KeyedProcessFunction):
    """Stores value[1] in value state "v", appends it to list "l" and puts it in map "m";
    emits the sizes of what each held before."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))
        self.l = ctx.get_list_state(ast.ListStateDescriptor("l"))
        self.m = ctx.get_map_state(ast.MapStateDescriptor("m"))

    async def process_element(self, value: Any, ctx: Any) -> None:
        key, payload = value
        old = await self.v.value()
        await self.v.update(payload)
        await self.l.add(payload)
        await self.m.put(len(payload) % 7, payload)
        items = [len(x) async for x in await self.l.get()]
        entries = sorted([(k, len(x)) async for k, x in await self.m.entries()])
        ctx.emit((key, None if old is None else (len(old), old[:1]), items, entries))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("write_buffer_bytes", [64 * 1024, 64 * 1024 * 1024],
                         ids=["values-larger-than-the-memtable", "default-memtable"])
async def test_one_megabyte_values_match_the_heap_and_survive_a_reopen(tmp_path,
                                                                       write_buffer_bytes):
    path = tmp_path / "db"
    options = RocksDBOptions(write_buffer_bytes=write_buffer_bytes)
    records = [(k % 4, bytes([k]) * (1024 * 1024 + k)) for k in range(24)]
    config = ast.AsyncStateConfig(iterator_chunk_size=2)
    got = await run_operator(BigValues(), RocksDBBackend(path, options=options), records[:12],
                             config)
    got += await run_operator(BigValues(), RocksDBBackend(path, options=options),
                              records[12:], config)
    heap = HeapBackend()
    op = ast.KeyedOperator(BigValues(), key_selector=key_of, backend=heap, config=config)
    async with op:
        for r in records:
            await op.process(r)
        await op.drain()
        expected = op.outputs()
    assert per_key(got) == per_key(expected)


class IterateAll(ast.KeyedProcessFunction):
    """Fills list "l" and map "m" with `value[1]` elements, then emits both iterations."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.l = ctx.get_list_state(ast.ListStateDescriptor("l"))
        self.m = ctx.get_map_state(ast.MapStateDescriptor("m"))

    async def process_element(self, value: Any, ctx: Any) -> None:
        key, n = value
        await self.l.add_all(list(range(n)))
        await self.m.put_all({i: -i for i in range(n)})
        items = [x async for x in await self.l.get()]
        keys = sorted([k async for k in await self.m.keys()])
        values = sorted([v async for v in await self.m.values()])
        ctx.emit((key, items, keys, values, await self.m.is_empty()))


@pytest.mark.timeout(60)
async def test_iterator_chunk_size_one_over_thousands_of_elements_matches_the_heap(tmp_path):
    config = ast.AsyncStateConfig(iterator_chunk_size=1)
    records = [(1, 1500), (2, 1), (1, 3), (3, 0)]
    got = await run_operator(IterateAll(), RocksDBBackend(tmp_path / "db"), records, config)
    expected = await run_operator(IterateAll(), HeapBackend(), records, config)
    assert per_key(got) == per_key(expected)
    assert len(per_key(got)[1][1][1]) == 1503


def one_key_per_key_group(max_parallelism: int) -> dict[int, int]:
    keys: dict[int, int] = {}
    for k in range(100 * max_parallelism):  # bounded: skewed key groups fail, not hang
        keys.setdefault(key_group_of_bytes(canonical_key(k), max_parallelism), k)
        if len(keys) == max_parallelism:
            return keys
    raise AssertionError(f"keys cover only {len(keys)} of {max_parallelism} key groups")


@pytest.mark.timeout(60)
async def test_every_one_of_32768_key_groups_snapshot_and_restore_split_in_two(tmp_path):
    mp = 32_768
    config = ast.AsyncStateConfig(max_parallelism=mp)
    keys = one_key_per_key_group(mp)
    records = [keys[kg] for kg in range(mp)] + [keys[0], keys[mp - 1], keys[mp // 2]]
    op = ast.KeyedOperator(Counter(), key_selector=key_of,
                           backend=RocksDBBackend(tmp_path / "db"), config=config)
    async with op:
        for r in records:
            await op.process(r)
        await op.drain()
        got = op.outputs()
        checkpoint = await op.snapshot(tmp_path / "chk", 1)
    heap = await run_operator(Counter(), HeapBackend(), records, config)
    assert per_key(got) == per_key(heap)
    # Restore into two RocksDB instances, each with half of the key groups, then read back.
    counts: dict[int, int] = {}
    for index in range(2):
        restored = ast.KeyedOperator(ReadOnly(), key_selector=key_of,
                                     backend=RocksDBBackend(tmp_path / f"db{index}"),
                                     config=config, parallelism=2, operator_index=index,
                                     restore_from=checkpoint)
        async with restored:
            start, end = restored.key_group_range.start, restored.key_group_range.end
            for kg in range(start, end + 1):
                await restored.process(keys[kg])
            await restored.drain()
            counts.update(restored.outputs())
    assert counts == {keys[kg]: 2 if kg in (0, mp // 2, mp - 1) else 1 for kg in range(mp)}
