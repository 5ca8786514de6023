"""RocksDBBackend failure paths and edge branches, against a real RocksDB in tmp_path: storage
corruption found by a read, argument and lifecycle checks, and restores larger than one
write batch."""

from __future__ import annotations

import asyncio
import json
import random
import re
from pathlib import Path
from typing import Any

import msgpack
import pytest
import rocksdict
from test_rocksdb import MAX_PARALLELISM, Harness, Op, drained, record_context

import asyncstate as ast
from asyncstate.backends.base import ExecutorBinding
from asyncstate.backends.rocksdb import (
    _MIN_PART_KEYS,
    _RESTORE_BATCH_ENTRIES,
    RocksDBBackend,
)
from asyncstate.backends.rocksdb_layout import _KIND_PREFIX, _MAX_P_KEY, _RESTORING_KEY, _SEQ_KEY
from asyncstate.checkpoint.format import checkpoint_path, open_checkpoint, write_part
from asyncstate.errors import BackendError, InvalidStateError
from asyncstate.runtime.requests import StateKind, StateRequestType
from asyncstate.serde import canonical_key

T = StateRequestType

# -- a database with corrupted data blocks --------------------------------------------------

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


def assert_reopens_while_held(path: Path, error: BaseException) -> None:
    """`error` and its traceback (with every frame in it, and the exceptions it chains) are
    still alive here: nothing in them may hold a database or column family object, which
    would keep the directory locked."""
    assert isinstance(error, BaseException)
    RocksDBBackend(path).close()


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


# -- failures that do not come from storage, held by the caller ----------------------------


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


class ValueJob(ast.KeyedProcessFunction):
    def open(self, ctx: ast.RuntimeContext) -> None:
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

    async def process_element(self, value: Any, ctx: Any) -> None:
        await self.v.update(value)


@pytest.mark.parametrize("case", ["damaged-value", "other-kind"])
async def test_a_failed_restore_leaves_the_directory_free(tmp_path, case):
    chk = checkpoint_path(tmp_path, 1)
    kg = ast.assign_to_key_group("k", MAX_PARALLELISM)
    # "v" holds one value: b"\x91" (a list header without its element) does not decode.
    value = b"\x91" if case == "damaged-value" else msgpack.packb(1)
    kind = "value" if case == "damaged-value" else "list"
    write_part(chk, parallelism=1, operator_index=0, max_parallelism=MAX_PARALLELISM,
               states={"v": kind}, key_groups=[(kg, [[0, 1], ["v", canonical_key("k"),
                                                                  msgpack.packb(None), value]])])
    path = tmp_path / "db"
    with pytest.raises(ast.CheckpointError) as info:
        async with ast.KeyedOperator(ValueJob(), key_selector=lambda r: r,
                                     backend=RocksDBBackend(path), restore_from=chk,
                                     config=ast.AsyncStateConfig(
                                         max_parallelism=MAX_PARALLELISM)):
            pass  # pragma: no cover
    assert ("malformed state entries" if case == "damaged-value" else "list") in str(info.value)
    assert_reopens_while_held(path, info.value)


# -- state cut by another max_parallelism -------------------------------------------------


class CountJob(ast.KeyedProcessFunction):
    """Counts records per key and emits (key, count)."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    async def process_element(self, value: Any, ctx: Any) -> None:
        n = (await self.count.value() or 0) + 1
        await self.count.update(n)
        ctx.emit((value, n))


class Stateless(ast.KeyedProcessFunction):
    def process_element(self, value: Any, ctx: Any) -> None:
        ctx.emit(value)


async def count(path: Path, max_p: int, keys: list[str],
                restore_from: str | None = None) -> list[Any]:
    async with ast.KeyedOperator(CountJob(), key_selector=lambda r: r,
                                 backend=RocksDBBackend(path), restore_from=restore_from,
                                 config=ast.AsyncStateConfig(max_parallelism=max_p)) as op:
        for key in keys:
            await op.process(key)
    return sorted(op.outputs())


def mismatch(path: Path, stored: int, used: int) -> str:
    return (rf"^RocksDB directory {re.escape(repr(str(path)))} holds state cut into {stored} "
            rf"key groups \(max_parallelism {stored}\), and this operator uses "
            rf"max_parallelism {used}: key groups are fixed for the life of the state")


async def test_a_directory_reopened_with_another_max_parallelism_is_refused(tmp_path):
    """Its keys carry key groups of the first max_parallelism: read with another, the state
    would look empty and a snapshot would file it under the wrong key groups."""
    path = tmp_path / "db"
    keys = ["a", "b", "c", "d"]
    assert await count(path, 128, keys) == [(k, 1) for k in keys]
    with pytest.raises(BackendError, match=mismatch(path, 128, 256)) as info:
        await count(path, 256, keys)
    assert info.value.path == str(path)
    # A function that declares no state cannot snapshot it either.
    with pytest.raises(BackendError, match=mismatch(path, 128, 64)):
        async with ast.KeyedOperator(Stateless(), key_selector=lambda r: r,
                                     backend=RocksDBBackend(path),
                                     config=ast.AsyncStateConfig(max_parallelism=64)) as op:
            await op.snapshot(tmp_path / "chk", 1)
    assert not (tmp_path / "chk" / "chk-1" / "part-1-0" / "_MANIFEST.json").exists()
    # Nothing was lost or rewritten: the first max_parallelism goes on counting.
    assert await count(path, 128, keys) == [(k, 2) for k in keys]


async def test_a_restore_replaces_state_cut_by_another_max_parallelism(tmp_path):
    path = tmp_path / "db"
    assert await count(path, 128, ["a", "b"]) == [("a", 1), ("b", 1)]
    async with ast.KeyedOperator(CountJob(), key_selector=lambda r: r,
                                 backend=ast.HeapBackend(),
                                 config=ast.AsyncStateConfig(max_parallelism=256)) as op:
        for key in ["b", "c", "c"]:
            await op.process(key)
        checkpoint = await op.snapshot(tmp_path / "chk", 1)
    assert await count(path, 256, ["a", "b", "c"], checkpoint) == [("a", 1), ("b", 2),
                                                                  ("c", 3)]
    assert await count(path, 256, ["c"]) == [("c", 4)]
    with pytest.raises(BackendError, match=mismatch(path, 256, 128)):
        await count(path, 128, ["c"])


async def test_a_directory_without_a_recorded_max_parallelism_records_the_first_one(tmp_path):
    """A directory written before the entry existed is taken as it is, then held to the
    max_parallelism it is opened with."""
    path = tmp_path / "db"
    assert await count(path, 128, ["a"]) == [("a", 1)]
    families = {name: rocksdict.Options(raw_mode=True)
                for name in rocksdict.Rdict.list_cf(str(path)) if name != "default"}
    db = rocksdict.Rdict(str(path), rocksdict.Options(raw_mode=True), column_families=families)
    del db[_MAX_P_KEY]
    db.close()
    del db
    assert await count(path, 128, ["a"]) == [("a", 2)]
    with pytest.raises(BackendError, match=mismatch(path, 128, 16)):
        await count(path, 16, ["a"])


async def test_a_snapshot_refuses_state_outside_the_operators_key_groups(tmp_path):
    """A directory written by one instance of 1, reopened (not restored) as instance 0 of 2:
    a snapshot of instance 0's key groups would leave the other key groups' state out, so it
    is refused, as the heap refuses it."""
    path = tmp_path / "db"
    keys = [f"k{i}" for i in range(40)]
    assert len(await count(path, 128, keys)) == 40
    config = ast.AsyncStateConfig(max_parallelism=128)
    with pytest.raises(ast.KeyGroupError, match=r"^RocksDBBackend holds state 'count' of key "
                                                r"group \d+, outside the key groups 0\.\.63 "
                                                r"being snapshotted$") as info:
        async with ast.KeyedOperator(CountJob(), key_selector=lambda r: r,
                                     backend=RocksDBBackend(path), config=config,
                                     parallelism=2, operator_index=0) as op:
            await op.snapshot(tmp_path / "chk", 1)
    assert info.value.key_group is not None and info.value.key_group >= 64
    assert not (tmp_path / "chk" / "chk-1" / "part-2-0" / "_MANIFEST.json").exists()


async def checkpoint_of(tmp_path: Path, max_p: int, keys: list[str]) -> str:
    async with ast.KeyedOperator(CountJob(), key_selector=lambda r: r,
                                 backend=ast.HeapBackend(),
                                 config=ast.AsyncStateConfig(max_parallelism=max_p)) as op:
        for key in keys:
            await op.process(key)
        return await op.snapshot(tmp_path / f"chk-of-{max_p}", 1)


@pytest.mark.parametrize("refusal", ["max-parallelism", "checksum", "state-name"])
async def test_a_refused_restore_leaves_the_directory_as_it_was(tmp_path, refusal):
    """What can be checked before the directory's state is discarded is checked first."""
    path = tmp_path / "db"
    keys = [f"k{i}" for i in range(10)]
    assert await count(path, 128, keys) == [(k, 1) for k in keys]
    if refusal == "max-parallelism":
        checkpoint = await checkpoint_of(tmp_path, 64, ["x"])
        pattern = r"was written with max_parallelism 64, cannot restore it with "
    else:
        checkpoint = await checkpoint_of(tmp_path, 128, keys)
        part = open_checkpoint(checkpoint).parts[0]
        data = bytearray(Path(part.data_path).read_bytes())
        last = part.key_groups[max(part.key_groups)]
        data[last.offset] ^= 0xFF  # the last key group: read after all the others
        Path(part.data_path).write_bytes(bytes(data))
        pattern = r"checksum"
    if refusal == "state-name":  # a name no backend takes (written by another program)
        checkpoint = await checkpoint_of(tmp_path, 128, keys)
        [manifest] = Path(checkpoint).glob("part-*/_MANIFEST.json")
        obj = json.loads(manifest.read_text())
        obj["states"] = {"co\x00unt": obj["states"]["count"]}
        manifest.write_text(json.dumps(obj))
        pattern = r"holds state 'co\\x00unt' of kind 'value', which cannot be restored"
    with pytest.raises(ast.CheckpointError, match=pattern):
        await count(path, 128, keys, checkpoint)
    assert await count(path, 128, keys) == [(k, 2) for k in keys]


async def test_a_restore_failing_midway_leaves_the_directory_refused_until_one_completes(
        tmp_path):
    """Value bytes that pass the checksum but do not decode fail the restore after the
    directory's state was discarded and some key groups restored: the directory holds
    neither state, so its next use is refused until a restore into it completes."""
    path = tmp_path / "db"
    keys = [f"k{i}" for i in range(10)]
    assert await count(path, 128, keys) == [(k, 1) for k in keys]
    chk = checkpoint_path(tmp_path / "bad", 1)
    groups = sorted({ast.assign_to_key_group(k, 128): k for k in keys}.items())
    write_part(chk, parallelism=1, operator_index=0, max_parallelism=128,
               states={"count": "value"},
               key_groups=[(kg, [[0, 1], ["count", canonical_key(k), msgpack.packb(None),
                                          msgpack.packb(5) if i < len(groups) - 1
                                          else b"\x91"]])
                           for i, (kg, k) in enumerate(groups)])
    with pytest.raises(ast.CheckpointError, match=r"malformed state entries"):
        await count(path, 128, keys, chk)
    refused = (rf"^RocksDB directory {re.escape(repr(str(path)))} holds a restore that did "
               r"not complete \(it failed or was interrupted\)")
    with pytest.raises(BackendError, match=refused):
        await count(path, 128, keys)
    with pytest.raises(BackendError, match=refused):  # still refused: nothing changed
        async with ast.KeyedOperator(Stateless(), key_selector=lambda r: r,
                                     backend=RocksDBBackend(path),
                                     config=ast.AsyncStateConfig(max_parallelism=128)) as op:
            await op.snapshot(tmp_path / "chk", 1)
    good = await checkpoint_of(tmp_path, 128, ["k0", "k0"])
    assert await count(path, 128, ["k0", "k1"], good) == [("k0", 3), ("k1", 1)]
    assert await count(path, 128, ["k0"]) == [("k0", 4)]


async def test_a_restore_into_a_marked_directory_with_nothing_to_drop_completes(tmp_path):
    """A restore killed between its mark and its first write leaves the mark in a directory
    with no state at all: the next restore must still make it usable."""
    path = tmp_path / "db"
    with RocksDBBackend(path):
        pass
    damage_metadata(path, _RESTORING_KEY, b"")
    refused = r"holds a restore that did not complete"
    with pytest.raises(BackendError, match=refused):
        await count(path, 128, ["a"])
    good = await checkpoint_of(tmp_path, 128, ["a", "b"])
    assert await count(path, 128, ["a"], good) == [("a", 2)]
    assert await count(path, 128, ["a"]) == [("a", 3)]


# -- argument and lifecycle checks ----------------------------------------------------------

def binding(loop: asyncio.AbstractEventLoop | None) -> ExecutorBinding:
    return ExecutorBinding(loop=loop, deliver=lambda batch, results, error: None,
                           iterator_chunk_size=10, max_parallelism=MAX_PARALLELISM)


class NamedStr(str):
    pass


@pytest.mark.parametrize(("name", "shown"), [("", "''"), (NamedStr("v"), "'v'")])
def test_register_state_rejects_an_empty_name_or_a_str_subclass(tmp_path, name, shown):
    with RocksDBBackend(tmp_path / "db") as backend:
        with pytest.raises(TypeError, match=rf"^state name must be a non-empty str, got "
                                            rf"{re.escape(shown)}$"):
            backend.register_state(name, StateKind.VALUE)
        assert backend.registered_states() == {}
    with RocksDBBackend(tmp_path / "db") as backend:  # nothing was stored either
        assert backend.registered_states() == {}


@pytest.mark.parametrize(("name", "kind", "message"), [
    (5, StateKind.VALUE, r"^state name must be a non-empty str, got 5$"),
    (None, StateKind.VALUE, r"^state name must be a non-empty str, got None$"),
    ("v", "value", r"^kind must be a StateKind, got 'value'$"),
])
def test_register_state_names_a_bad_type(tmp_path, name, kind, message):
    with RocksDBBackend(tmp_path / "db") as backend:
        with pytest.raises(TypeError, match=message):
            backend.register_state(name, kind)
        assert backend.registered_states() == {}


def damage_metadata(path: Path, key: bytes, value: bytes) -> None:
    """Overwrite one metadata entry (default column family) of a closed database."""
    families = {name: rocksdict.Options(raw_mode=True)
                for name in rocksdict.Rdict.list_cf(str(path)) if name != "default"}
    db = rocksdict.Rdict(str(path), rocksdict.Options(raw_mode=True), column_families=families)
    db[key] = value
    db.close()
    del db


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


async def test_open_binds_once(tmp_path):
    loop = asyncio.get_running_loop()
    with RocksDBBackend(tmp_path / "db") as backend:
        backend.open(binding(loop))
        with pytest.raises(InvalidStateError, match=r"^this RocksDBBackend is already bound to "
                                                    r"an operator; create one backend per "
                                                    r"operator$"):
            backend.open(binding(loop))


def test_open_needs_an_event_loop(tmp_path):
    with RocksDBBackend(tmp_path / "db") as backend:
        with pytest.raises(InvalidStateError, match=r"^RocksDBBackend needs the operator's "
                                                    r"event loop \(loop=None\)$"):
            backend.open(binding(None))
        with pytest.raises(InvalidStateError, match=r"^open\(\) the RocksDBBackend before "
                                                    r"executing batches$"):
            backend.execute_batch([])  # the failed open bound nothing


def test_open_and_register_after_close_raise(tmp_path):
    path = tmp_path / "db"
    backend = RocksDBBackend(path)
    backend.close()
    closed = rf"^RocksDBBackend {re.escape(repr(str(path)))} is closed$"
    with pytest.raises(InvalidStateError, match=closed):
        backend.open(binding(None))  # the closed check comes first
    with pytest.raises(InvalidStateError, match=closed):
        backend.register_state("v", StateKind.VALUE)


# -- restore through more than one write batch ----------------------------------------------

async def test_restore_larger_than_one_write_batch_reads_back_every_entry(tmp_path):
    # Two entries cross the write-batch bound together; the entries after them go into the
    # next batch, and list sequence numbers continue across the two.
    kg = record_context(0).key_group
    keys = [k for k in range(5000) if record_context(k).key_group == kg][:5]
    assert len(keys) == 5
    half = _RESTORE_BATCH_ENTRIES // 2 + 1
    ns = canonical_key(None)
    entries: list[tuple[str, bytes, bytes, Any]] = [
        ("l", canonical_key(keys[0]), ns, [msgpack.packb(i) for i in range(half)]),
        ("m", canonical_key(keys[1]), ns,
         [(canonical_key(i), msgpack.packb(-i)) for i in range(half)]),
        ("l", canonical_key(keys[2]), ns, [msgpack.packb(s) for s in ("x", "y", "z")]),
        ("v", canonical_key(keys[3]), ns, msgpack.packb({"after": "the bound"})),
        ("m", canonical_key(keys[4]), ns, [(canonical_key("k"), msgpack.packb([1]))]),
    ]
    assert sum(len(e[3]) for e in entries[:2]) >= _RESTORE_BATCH_ENTRIES
    with RocksDBBackend(tmp_path / "db") as backend:
        harness = Harness(backend, asyncio.get_running_loop(), chunk_size=2 * half)
        backend.restore_key_group(kg, iter(entries))
        assert backend.list_sequence() == half + 3
        assert list(backend.snapshot_key_group(kg)) == sorted(entries,
                                                               key=lambda e: (e[0], e[1]))
        reads: list[Op] = [("l", T.LIST_GET, None, keys[0], None),
                           ("m", T.MAP_ITER, None, keys[1], None),
                           ("l", T.LIST_GET, None, keys[2], None),
                           ("v", T.VALUE_GET, None, keys[3], None),
                           ("m", T.MAP_GET, "k", keys[4], None)]
        got = await drained(harness, reads, await harness.run(reads))
        assert got[0] == list(range(half))
        assert sorted(got[1]) == [(i, -i) for i in range(half)]
        assert got[2:] == [["x", "y", "z"], {"after": "the bound"}, [1]]
