"""RocksDBBackend when storage is damaged: corrupted data blocks and metadata found by a
read, an iteration or a snapshot fail with a BackendError instead of answering wrongly."""

from __future__ import annotations

import asyncio
import random
import re
from pathlib import Path
from typing import Any

import pytest
import rocksdict
from backend_harness import (
    MAX_PARALLELISM,
    Harness,
    assert_reopens_while_held,
    damage_metadata,
)

import asyncstate as ast
from asyncstate.backends.rocksdb import (
    _MIN_PART_KEYS,
    RocksDBBackend,
)
from asyncstate.backends.rocksdb_layout import _KIND_PREFIX, _MAX_P_KEY, _SEQ_KEY
from asyncstate.checkpoint.format import open_checkpoint
from asyncstate.errors import BackendError
from asyncstate.runtime.requests import StateKind, StateRequestType

T = StateRequestType

# Enough keys for a pool read split over two I/O slots. Seeded random bytes do not compress,
# so the data blocks and their offsets, and so the flipped bytes, are the same on every run
# (only the block checksums differ: RocksDB salts them per file).
KEYS = range(2 * _MIN_PART_KEYS + 100)
_rng = random.Random(20261121)
VALUES = {k: _rng.randbytes(100) for k in KEYS}
FLIP_STEP = 512  # a data block is ~4 KiB: each one gets several flipped bytes


async def corrupt_value_state(path: Path) -> Path:
    """Write VALUES into state "v" of a new database at `path`, flush them into one SST
    file, close the database, then flip one byte every FLIP_STEP bytes of that file's data
    blocks (never its index, filter or footer, so the database still opens). Returns the
    SST file.

    Nothing reads the file before it is damaged: RocksDB's block cache keys survive a
    reopen and the cache is shared by the process, so a block read earlier would be served
    from memory and the damage would go unnoticed."""
    with RocksDBBackend(path) as backend:
        harness = Harness(backend, asyncio.get_running_loop())
        await harness.run([("v", T.VALUE_UPDATE, VALUES[k], k, None) for k in KEYS])
        cf = harness.states["v"].handle.cf
        cf.flush()
        properties = cf.property_value("rocksdb.aggregated-table-properties")
        del cf  # a live column family object would keep the directory locked
        [sst] = path.glob("*.sst")  # close() flushes the metadata family into another one
    data_size = int(re.search(r"; data block size=(\d+);", properties).group(1))
    data = bytearray(sst.read_bytes())
    assert FLIP_STEP * 20 < data_size < len(data)
    for offset in range(FLIP_STEP // 2, data_size, FLIP_STEP):
        data[offset] ^= 0xFF
    sst.write_bytes(bytes(data))
    return sst


def corruption_message(path: Path, sst: Path) -> str:
    """Anchored pattern of the BackendError a read of a damaged block raises."""
    return (rf"^RocksDB failed on {re.escape(repr(str(path)))}: Corruption: block checksum "
            rf"mismatch: .* in {re.escape(str(sst))} offset \d+ size \d+$")


async def assert_still_serves_new_batches(harness: Harness) -> None:
    """After a failed batch the backend still applies and reads (from the memtable)."""
    await harness.run([("v", T.VALUE_UPDATE, "fresh", -1, None)])
    assert await harness.run([("v", T.VALUE_GET, None, -1, None)]) == ["fresh"]
    assert not harness.backend.fully_loaded()


@pytest.mark.timeout(60)
async def test_corrupted_block_fails_an_inline_read_with_a_backend_error(tmp_path):
    path = tmp_path / "db"
    sst = await corrupt_value_state(path)
    with RocksDBBackend(path, inline_read_keys=16) as backend:
        harness = Harness(backend, asyncio.get_running_loop())
        reads = [harness.request(("v", T.VALUE_GET, None, k, None)) for k in KEYS[:16]]
        failed = harness.submit(reads)
        assert failed.done()  # read on the loop thread: delivered from execute_batch itself
        with pytest.raises(BackendError, match=corruption_message(path, sst)) as info:
            await failed
        assert info.value.path == str(path)
        await assert_still_serves_new_batches(harness)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("io_parallelism", [1, 2], ids=["one-part", "two-parts"])
async def test_corrupted_block_fails_a_pool_read_and_later_batches_follow_in_order(
        tmp_path, io_parallelism):
    # Every key in one batch: with two I/O slots the multi-get is split in two parts, and
    # both fail. A write batch triggered behind it waits for it in the lane, then runs.
    path = tmp_path / "db"
    sst = await corrupt_value_state(path)
    with RocksDBBackend(path, io_parallelism=io_parallelism, inline_read_keys=0) as backend:
        harness = Harness(backend, asyncio.get_running_loop())
        reads = [harness.request(("v", T.VALUE_GET, None, k, None)) for k in KEYS]
        behind = [harness.request(("v", T.VALUE_UPDATE, "after", 0, "ns")),
                  harness.request(("v", T.VALUE_GET, None, 0, "ns"))]
        failed = harness.submit(reads)
        assert not failed.done()  # sent to the pool
        assert backend.fully_loaded() is (io_parallelism == 1)
        later = harness.submit(behind)
        with pytest.raises(BackendError, match=corruption_message(path, sst)) as info:
            await failed
        assert info.value.path == str(path)
        assert await later == [None, "after"]
        assert harness.delivery_order == [id(reads), id(behind)]  # each batch exactly once
        await assert_still_serves_new_batches(harness)


class ReadValue(ast.KeyedProcessFunction):
    """Emits (key, value of state "v")."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

    async def process_element(self, value: Any, ctx: Any) -> None:
        ctx.emit((ctx.current_key, await self.v.value()))


@pytest.mark.timeout(60)
async def test_corrupted_block_fails_the_operator_run_promptly(tmp_path):
    path = tmp_path / "db"
    sst = await corrupt_value_state(path)
    op = ast.KeyedOperator(ReadValue(), key_selector=lambda record: record,
                           backend=ast.RocksDBBackend(path),
                           config=ast.AsyncStateConfig(max_parallelism=MAX_PARALLELISM))
    with pytest.raises(ast.BackendError) as exit_info:
        async with op:
            with pytest.raises(ast.BackendError, match=corruption_message(path, sst)) as first:
                for k in KEYS[:100]:
                    await op.process(k)
                await op.drain()
            with pytest.raises(ast.BackendError) as again:
                await op.process(KEYS[0])
            assert again.value is first.value
    assert exit_info.value is first.value
    assert first.value.path == str(path)
    # The error (and its traceback) is still alive here: it must not hold the directory.
    with RocksDBBackend(path) as reopened:
        assert reopened.registered_states()["v"] is StateKind.VALUE


class FillCollections(ast.KeyedProcessFunction):
    """Per key: 3,000 list elements and 3,000 map entries of seeded, incompressible bytes."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.items = ctx.get_list_state(ast.ListStateDescriptor("items"))
        self.tags = ctx.get_map_state(ast.MapStateDescriptor("tags"))

    async def process_element(self, value: Any, ctx: Any) -> None:
        rng = random.Random(value)
        await self.items.add_all([rng.randbytes(200) for _ in range(3000)])
        await self.tags.put_all({i: rng.randbytes(200) for i in range(3000)})


class ReadCollections(FillCollections):
    """Emits what record (key, how) reads: the whole list, the map's keys, or is_empty."""

    async def process_element(self, value: Any, ctx: Any) -> None:
        how = value[1]
        if how == "list":
            ctx.emit(len(await (await self.items.get()).to_list()))
        elif how == "map-keys":
            ctx.emit(len(await (await self.tags.keys()).to_list()))
        else:
            ctx.emit(await self.tags.is_empty())


async def corrupt_collections(path: Path, keys: range) -> None:
    """FillCollections for `keys` in a new database at `path` (closing it flushes the data
    into SST files, which nothing has read), then one byte flipped every FLIP_STEP bytes of
    the first half of every SST file of 100 KB or more: data blocks, never the index or
    footer, so the database still opens."""
    config = ast.AsyncStateConfig(max_parallelism=MAX_PARALLELISM)
    async with ast.KeyedOperator(FillCollections(), key_selector=lambda r: r,
                                 backend=RocksDBBackend(path), config=config) as op:
        for key in keys:
            await op.process(key)
    damaged = 0
    for sst in path.glob("*.sst"):
        data = bytearray(sst.read_bytes())
        if len(data) < 100_000:
            continue
        for offset in range(FLIP_STEP, len(data) // 2, FLIP_STEP):
            data[offset] ^= 0xFF
        sst.write_bytes(bytes(data))
        damaged += 1
    assert damaged


def damage_message(path: Path) -> str:
    return rf"^RocksDB failed on {re.escape(repr(str(path)))}: Corruption: block checksum "


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunk", [7, 1000])
@pytest.mark.parametrize("how", ["list", "map-keys", "map-is-empty"])
async def test_corrupted_blocks_fail_an_iteration_instead_of_ending_it_early(
        tmp_path, chunk, how):
    """An iterator that meets a damaged block stops as if the range ended; the backend asks
    for its status, so the read fails the run instead of returning fewer entries (or none,
    or "empty")."""
    path = tmp_path / "db"
    await corrupt_collections(path, range(1))
    config = ast.AsyncStateConfig(max_parallelism=MAX_PARALLELISM, iterator_chunk_size=chunk)
    with pytest.raises(ast.BackendError, match=damage_message(path)) as info:
        async with ast.KeyedOperator(ReadCollections(), key_selector=lambda r: r[0],
                                     backend=RocksDBBackend(path), config=config) as op:
            await op.process((0, how))
            await op.drain()
    assert info.value.path == str(path)
    assert_reopens_while_held(path, info.value)


@pytest.mark.timeout(60)
async def test_corrupted_blocks_fail_a_snapshot_instead_of_leaving_state_out(tmp_path):
    path = tmp_path / "db"
    await corrupt_collections(path, range(5))
    config = ast.AsyncStateConfig(max_parallelism=MAX_PARALLELISM)
    with pytest.raises(ast.BackendError, match=damage_message(path)) as info:
        async with ast.KeyedOperator(ReadCollections(), key_selector=lambda r: r[0],
                                     backend=RocksDBBackend(path), config=config) as op:
            await op.snapshot(tmp_path / "checkpoints", 1)
    assert_reopens_while_held(path, info.value)
    with pytest.raises(ast.CheckpointError, match="no committed part"):
        open_checkpoint(tmp_path / "checkpoints" / "chk-1")


class ListJob(ast.KeyedProcessFunction):
    """("w", key) appends 1 to the key's list; ("r", key) emits the list."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.items = ctx.get_list_state(ast.ListStateDescriptor("items"))

    async def process_element(self, value: Any, ctx: Any) -> None:
        if value[0] == "w":
            await self.items.add(1)
        else:
            ctx.emit(await (await self.items.get()).to_list())


async def test_an_unreadable_stored_element_fails_the_read_and_leaves_the_directory_free(
        tmp_path):
    path = tmp_path / "db"
    config = ast.AsyncStateConfig(max_parallelism=MAX_PARALLELISM)
    async with ast.KeyedOperator(ListJob(), key_selector=lambda r: r[1],
                                 backend=RocksDBBackend(path), config=config) as op:
        await op.process(("w", "k"))
    # Another program overwrites the element with msgpack nested deeper than 1024 levels.
    families = {name: rocksdict.Options(raw_mode=True) for name in rocksdict.Rdict.list_cf(
        str(path)) if name != "default"}
    db = rocksdict.Rdict(str(path), rocksdict.Options(raw_mode=True), column_families=families)
    cf = db.get_column_family("state:items")
    [(key, _)] = list(cf.items())
    cf[key] = b"\x91" * 1100 + b"\x01"
    del cf
    db.close()
    del db
    with pytest.raises(ast.SerializationError, match=r"nested more than 1024 levels") as info:
        async with ast.KeyedOperator(ListJob(), key_selector=lambda r: r[1],
                                     backend=RocksDBBackend(path), config=config) as op:
            await op.process(("r", "k"))
            await op.drain()
    assert_reopens_while_held(path, info.value)


@pytest.mark.parametrize(("key", "value", "message"), [
    (_KIND_PREFIX + b"v", b"bogus",
     r"has a damaged state entry b'state-kind:v' = b'bogus' \(want a state name and one of "
     r"value, list, map, reducing, aggregating\)$"),
    (_KIND_PREFIX + b"\xff", b"value", r"has a damaged state entry b'state-kind:\\xff'"),
    (_SEQ_KEY, b"\x01", r"has a damaged list sequence entry .* \(want 8 bytes\)$"),
    (_MAX_P_KEY, b"\x01", r"has a damaged max_parallelism entry .* \(want 2 bytes, "
                          r"1\.\.32768\)$"),
    (_MAX_P_KEY, b"\x00\x00", r"has a damaged max_parallelism entry b'max-parallelism' = "
                              r"b'\\x00\\x00'"),
], ids=["unknown-kind", "name-not-utf8", "short-sequence", "short-max-parallelism",
        "zero-max-parallelism"])
def test_damaged_metadata_fails_the_open_and_leaves_the_directory_free(tmp_path, key, value,
                                                                       message):
    path = tmp_path / "db"
    with RocksDBBackend(path) as backend:
        backend.register_state("v", StateKind.VALUE)
    damage_metadata(path, key, value)
    pattern = rf"^RocksDB directory {re.escape(repr(str(path)))} {message}"
    with pytest.raises(BackendError, match=pattern) as first:
        RocksDBBackend(path)
    assert first.value.path == str(path)
    # Still holding the first error: a second open fails the same way, not "in use".
    with pytest.raises(BackendError, match=pattern):
        RocksDBBackend(path)
