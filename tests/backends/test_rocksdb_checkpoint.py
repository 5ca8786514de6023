"""RocksDBBackend and checkpoints: snapshot and restore per key group, what a restore checks
and leaves behind (the list sequence, the restoring mark, the recorded max_parallelism),
discarding state, and what a snapshot holds after values and collections are emptied."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import msgpack
import pytest
import rocksdict
from backend_harness import (
    MAX_PARALLELISM,
    Harness,
    Op,
    assert_reopens_while_held,
    damage_metadata,
    drained,
    record_context,
)
from shared_functions import Counter

import asyncstate as ast
from asyncstate.backends.heap import HeapBackend
from asyncstate.backends.rocksdb import (
    _RESTORE_BATCH_ENTRIES,
    RocksDBBackend,
)
from asyncstate.backends.rocksdb_layout import (
    _MAX_P_KEY,
    _RESTORING_KEY,
)
from asyncstate.checkpoint.format import checkpoint_path, open_checkpoint, write_part
from asyncstate.errors import (
    BackendError,
    CheckpointError,
    InvalidStateError,
)
from asyncstate.runtime.requests import StateKind, StateRequestType
from asyncstate.serde import canonical_key

T = StateRequestType
NS = canonical_key(None)


@pytest.mark.parametrize(("name", "data", "want"), [
    ("l", b"\x01\x02", "list of entries, got bytes"),
    ("m", 7, "list of entries, got int"),
    ("v", [b"\x01"], "msgpack bytes, got list"),
    ("r", "text", "msgpack bytes, got str"),
])
def test_restore_refuses_data_of_the_wrong_shape_with_a_checkpoint_error(tmp_path, name, data,
                                                                        want):
    with RocksDBBackend(tmp_path / "db") as backend:
        kinds = {"l": StateKind.LIST, "m": StateKind.MAP, "v": StateKind.VALUE,
                 "r": StateKind.REDUCING}
        backend.register_state(name, kinds[name])
        with pytest.raises(CheckpointError, match=rf"^state '{name}' \(\w+\) of key group 5 "
                                                  rf"needs (a )?{want}$"):
            backend.restore_key_group(5, [(name, canonical_key("k"), NS, data)])
        assert list(backend.snapshot_key_group(5)) == []  # nothing was written


async def test_a_restored_list_survives_a_reopen_and_a_later_append(tmp_path):
    """The restore stores the list sequence it advanced: after a reopen, an append takes a
    fresh sequence number instead of overwriting a restored element."""
    path = tmp_path / "db"
    kg = record_context("k").key_group
    loop = asyncio.get_running_loop()
    with RocksDBBackend(path) as backend:
        backend.register_state("l", StateKind.LIST)
        backend.restore_key_group(kg, [("l", canonical_key("k"), NS,
                                        [msgpack.packb(v) for v in ("a", "b", "c")])])
        assert backend.list_sequence() == 3
    with RocksDBBackend(path) as backend:
        assert backend.list_sequence() == 3
        harness = Harness(backend, loop)
        ops: list[Op] = [("l", T.LIST_ADD, "d", "k", None), ("l", T.LIST_GET, None, "k", None)]
        got = await drained(harness, ops, await harness.run(ops))
        assert got[1] == ["a", "b", "c", "d"]


def test_set_list_sequence_is_durable(tmp_path):
    path = tmp_path / "db"
    with RocksDBBackend(path) as backend:
        backend.set_list_sequence(50)
        assert backend.list_sequence() == 50
    with RocksDBBackend(path) as backend:
        assert backend.list_sequence() == 50


@pytest.mark.parametrize("name", ["v", "r", "a"])
async def test_a_value_updated_to_none_leaves_nothing_in_the_snapshot(tmp_path, name):
    """Updating a value-kind state to None removes it, as on the heap: the snapshot holds no
    entry for it (not a stored nil)."""
    kind_op = {"v": T.VALUE_UPDATE, "r": T.REDUCING_ADD, "a": T.AGGREGATING_ADD}[name]
    kg = record_context("k").key_group
    with RocksDBBackend(tmp_path / "db") as backend:
        harness = Harness(backend, asyncio.get_running_loop())
        await harness.run([(name, kind_op, 1, "k", None)])
        assert len(list(backend.snapshot_key_group(kg))) == 1
        await harness.run([(name, kind_op, None, "k", None)])
        assert list(backend.snapshot_key_group(kg)) == []
        # also when the write and its removal share a batch
        await harness.run([(name, kind_op, 2, "k", "ns"), (name, kind_op, None, "k", "ns")])
        assert list(backend.snapshot_key_group(kg)) == []


@pytest.mark.timeout(60)
async def test_discard_state_refuses_while_a_batch_is_under_way(tmp_path):
    with RocksDBBackend(tmp_path / "db", inline_read_keys=0) as backend:
        harness = Harness(backend, asyncio.get_running_loop())
        await harness.run([("v", T.VALUE_UPDATE, 1, "k", None)])
        pending = harness.submit([harness.request(("v", T.VALUE_GET, None, "k", None))])
        with pytest.raises(InvalidStateError, match=r"has batches under way; its state can "
                                                    r"only be discarded while no batch"):
            backend.discard_state()
        assert await pending == [1]  # the batch completes, the state is still there
        assert backend.registered_states()["v"] is StateKind.VALUE


@pytest.mark.parametrize("ops", [
    [("l", T.LIST_ADD, 1, "k", None), ("l", T.LIST_UPDATE, [], "k", None)],
    [("l", T.LIST_UPDATE, [], "k", None)],
    [("m", T.MAP_PUT, ("u", 1), "k", None), ("m", T.MAP_PUT, ("u", None), "k", None)],
    [("m", T.MAP_PUT, ("u", 1), "k", None), ("m", T.MAP_PUT_ALL, [("u", None)], "k", None)],
    [("m", T.MAP_PUT, ("u", 1), "k", None), ("m", T.MAP_REMOVE, "u", "k", None)],
], ids=["list-update-empty", "list-update-empty-fresh", "map-put-none", "map-put-all-none",
        "map-remove-last"])
@pytest.mark.parametrize("backend_kind", ["heap", "rocksdb"])
async def test_emptied_collections_leave_nothing_in_the_snapshot(tmp_path, ops, backend_kind):
    """A list or map emptied by its last update, put or remove is gone, on every backend: the
    snapshot holds no entry with an empty list of elements."""
    backend: Any = HeapBackend() if backend_kind == "heap" else RocksDBBackend(tmp_path / "db")
    try:
        harness = Harness(backend, asyncio.get_running_loop())
        for op in ops:
            await harness.run([op])
        kg = record_context("k").key_group
        assert list(backend.snapshot_key_group(kg)) == []
    finally:
        backend.close()


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


class Stateless(ast.KeyedProcessFunction):
    def process_element(self, value: Any, ctx: Any) -> None:
        ctx.emit(value)


async def count(path: Path, max_p: int, keys: list[str],
                restore_from: str | None = None) -> list[Any]:
    async with ast.KeyedOperator(Counter(), key_selector=lambda r: r,
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
    async with ast.KeyedOperator(Counter(), key_selector=lambda r: r,
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
        async with ast.KeyedOperator(Counter(), key_selector=lambda r: r,
                                     backend=RocksDBBackend(path), config=config,
                                     parallelism=2, operator_index=0) as op:
            await op.snapshot(tmp_path / "chk", 1)
    assert info.value.key_group is not None and info.value.key_group >= 64
    assert not (tmp_path / "chk" / "chk-1" / "part-2-0" / "_MANIFEST.json").exists()


async def checkpoint_of(tmp_path: Path, max_p: int, keys: list[str]) -> str:
    async with ast.KeyedOperator(Counter(), key_selector=lambda r: r,
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
