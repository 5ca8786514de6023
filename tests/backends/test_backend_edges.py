"""Backend edges: restore's checks of the entries it stores, the list sequence a restore or
set_list_sequence leaves on disk, what a snapshot holds after a value or collection is
emptied, refusals while batches are under way, and which error the remote wrapper reports.
Real components throughout (RocksDB in tmp_path)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import pytest
import rocksdict
from test_rocksdb import Harness, Op, drained, record_context

from asyncstate.backends.heap import HeapBackend
from asyncstate.backends.remote import SimulatedRemoteBackend
from asyncstate.backends.rocksdb import RocksDBBackend, _translate_error
from asyncstate.errors import (
    BackendError,
    CheckpointError,
    InjectedFailure,
    InvalidStateError,
)
from asyncstate.runtime.requests import StateKind, StateRequestType
from asyncstate.serde import canonical_key

T = StateRequestType
NS = canonical_key(None)


# -- error translation ----------------------------------------------------------------------

def test_translate_error_says_a_closed_database_is_closed():
    err = _translate_error(rocksdict.DbClosedError("DB instance already closed"), "/data/db")
    assert isinstance(err, BackendError) and err.path == "/data/db"
    assert str(err) == "RocksDB database '/data/db' is closed"


# -- restore checks what it stores ----------------------------------------------------------

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


# -- the list sequence a restore leaves behind ----------------------------------------------

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


# -- a value set to None is gone -------------------------------------------------------------

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


# -- refusals while batches are under way ---------------------------------------------------

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


# -- HeapBackend: the default namespace, and emptied collections -------------------------

async def test_heap_restore_into_the_default_namespace_compares_bytes_by_value():
    """Namespace bytes equal to the default namespace's, but another bytes object, land in
    the default namespace."""
    heap = HeapBackend()
    harness = Harness(heap, asyncio.get_running_loop())
    ns = bytes(bytearray(NS))
    assert ns == NS and ns is not NS
    heap.restore_key_group(record_context("k").key_group, [
        ("v", canonical_key("k"), ns, msgpack.packb(5)),
        ("l", canonical_key("k"), ns, [msgpack.packb(6)])])
    ops: list[Op] = [("v", T.VALUE_GET, None, "k", None), ("l", T.LIST_GET, None, "k", None)]
    assert await drained(harness, ops, await harness.run(ops)) == [5, [6]]


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


# -- SimulatedRemoteBackend ---------------------------------------------------------------

async def test_remote_backend_reports_the_inner_error_rather_than_an_injected_one():
    """A batch the inner backend fails reports the inner backend's error, even when failure
    injection also picked it."""
    remote = SimulatedRemoteBackend(HeapBackend(), latency_ms=0, failure_probability=1.0,
                                    seed=1)
    harness = Harness(remote, asyncio.get_running_loop())
    with pytest.raises(ValueError, match=r"^HeapBackend cannot execute SYNC_POINT$"):
        await harness.run([("v", T.SYNC_POINT, None, "k", None)])
    with pytest.raises(InjectedFailure):
        await harness.run([("v", T.VALUE_GET, None, "k", None)])
    remote.close()
