"""Snapshot and restore through the checkpoint format (checkpoint/snapshot.py): every state
kind, rescaling by key groups, extra sections, and checkpoints moving between backends."""

from __future__ import annotations

import asyncio
import gc
import os

import msgpack
import pytest
from checkpoint_files import (
    committed,
    entry,
    write_one_part,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from shared_functions import (
    by_key_bytes,
    canon,
    new_backend,
    slow_examples,
    strict_eq,
)

import asyncstate as ast
from asyncstate.backends.heap import HeapBackend
from asyncstate.checkpoint.format import (
    checkpoint_path,
    open_checkpoint,
    write_part,
)
from asyncstate.checkpoint.snapshot import (
    SECTION_STATE_ENTRIES,
    SnapshotBackend,
    restore_snapshot,
    write_snapshot,
)
from asyncstate.errors import CheckpointError, KeyGroupError
from asyncstate.keygroups import KeyGroupRange, compute_key_group_range_for_operator_index
from asyncstate.runtime.requests import StateKind
from asyncstate.serde import Packed, canonical_key

MAX_P = 32
TOO_DEEP = b"\x91" * 1024 + b"\x90"  # 1025 nested arrays: packs, but msgpack reads 1024 only


@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
def test_state_entry_nested_too_deep_fails_the_restore_with_checkpoint_error(tmp_path, kind):
    chk = checkpoint_path(tmp_path, 1)
    kg = ast.assign_to_key_group("k", MAX_P)
    write_one_part(chk, [(kg, [[0, 1], entry("k", TOO_DEEP)])], max_parallelism=MAX_P)
    cp = open_checkpoint(chk)
    backend = new_backend(kind, tmp_path)
    try:
        with pytest.raises(CheckpointError, match=rf"key group {kg} of data file .*malformed"):
            restore_snapshot(backend, cp, KeyGroupRange(0, MAX_P - 1), MAX_P)
    finally:
        backend.close()


@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
@pytest.mark.parametrize(("user_key", "shown"), [
    (b"\xc1", r"stored key bytes b'\\xc1' are not the msgpack bytes of one key"),
    (b"\x01\x02", r"stored key bytes b'\\x01\\x02' are not the msgpack bytes of one key"),
    ("a", r"stored key bytes must be bytes, got str"),
])
def test_map_entry_whose_user_key_does_not_decode_fails_the_restore(tmp_path, kind, user_key,
                                                                    shown):
    """A user key is checked as a value is, so the damage names the file at restore
    instead of failing the first read of the map's keys."""
    chk = checkpoint_path(tmp_path, 1)
    kg = ast.assign_to_key_group("k", MAX_P)
    entry = ["m", canonical_key("k"), canonical_key(None),
             [[canonical_key("ok"), msgpack.packb(1)], [user_key, msgpack.packb(2)]]]
    write_part(chk, parallelism=1, operator_index=0, max_parallelism=MAX_P,
               states={"m": "map"}, key_groups=[(kg, [[0, 1], entry])])
    backend = new_backend(kind, tmp_path)
    try:
        with pytest.raises(CheckpointError, match=rf"^key group {kg} of data file .*: "
                                                  rf"malformed state entries .*{shown}"):
            restore_snapshot(backend, open_checkpoint(chk), KeyGroupRange(0, MAX_P - 1), MAX_P)
    finally:
        backend.close()


@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
def test_a_later_entry_of_the_same_list_or_map_replaces_an_earlier_one(tmp_path, kind):
    """restore_key_group replaces what is held for each (state, key, namespace), also an
    entry given earlier in the same call, and an empty list or map is no entry: both
    backends hold the same afterwards (asyncstate's own snapshots never repeat an entry)."""
    chk = checkpoint_path(tmp_path, 1)
    kg = ast.assign_to_key_group("b", MAX_P)
    key, ns = canonical_key("b"), canonical_key(None)
    one, two = msgpack.packb(1), msgpack.packb(2)
    entries = [["l", key, ns, [one]], ["l", key, ns, [two]],
               ["m", key, ns, [[canonical_key("x"), one]]], ["m", key, ns, []]]
    write_part(chk, parallelism=1, operator_index=0, max_parallelism=MAX_P,
               states={"l": "list", "m": "map"},
               key_groups=[(kg, [[0, len(entries)], *entries])])
    backend = new_backend(kind, tmp_path)
    try:
        restore_snapshot(backend, open_checkpoint(chk), KeyGroupRange(0, MAX_P - 1), MAX_P)
        held = backend.snapshot_key_group(kg, MAX_P) if kind == "heap" \
            else backend.snapshot_key_group(kg)
        assert [list(e) for e in held] == [["l", key, ns, [two]]]
    finally:
        backend.close()


def sample_model() -> dict[tuple[str, object, object], object]:
    """(state, key, namespace) -> value, list or dict; state names start with their kind."""
    model: dict[tuple[str, object, object], object] = {}
    # (1, 1.0 and True are distinct keys, but equal as model dict keys: see the test below.)
    keys = [None, True, 7, 2.5, -(2**63), 2**64 - 1, "k", "ключ", b"\x00b", (1, "a"), (2, (3,))]
    for i, key in enumerate(keys):
        model[("v_count", key, None)] = i
        model[("v_blob", key, "ns1")] = {"i": i, 7: [1.5, None, b"x"], "t": ["tuple", i]}
        model[("l_seen", key, None)] = [i, "é", b"\x01", [i, i], {"d": i}]
        model[("m_attrs", key, None)] = {"a": i, 2: "two", (1, "b"): [i], b"k": b"v"}
        model[("r_sum", key, ("w", i))] = float(i) / 3
        model[("a_avg", key, None)] = [i, i + 1]
    model[("v_big", "huge", None)] = "x" * 100_000
    model[("l_long", "long", None)] = list(range(2500))  # several iterator chunks
    return model


def fill(ck, model, parallelism=1):
    """Heaps of `parallelism` instances, each holding the model entries of its key groups."""
    heaps = [ck.Heap() for _ in range(parallelism)]
    for (name, key, ns), value in model.items():
        kg = ck.key_group(key, MAX_P)
        for i, heap in enumerate(heaps):
            if kg in compute_key_group_range_for_operator_index(MAX_P, parallelism, i):
                heap.put(name, key, ns, value)
    return heaps


def check(ck, heaps, model, parallelism):
    """Each instance holds exactly the model entries of its key groups."""
    for i, heap in enumerate(heaps):
        rng = compute_key_group_range_for_operator_index(MAX_P, parallelism, i)
        mine = {k: v for k, v in model.items() if ck.key_group(k[1], MAX_P) in rng}
        for (name, key, ns), value in mine.items():
            assert heap.get(name, key, ns) == ck.normalize(value), (name, key, ns)
        assert sum(heap.count_entries(MAX_P).values()) == len(mine)
        assert set(heap.count_entries(MAX_P)) <= set(rng)


def snapshot_all(heaps, chk, parallelism, **kwargs):
    for i, heap in enumerate(heaps):
        write_snapshot(heap.backend, chk, parallelism=parallelism, operator_index=i,
                       max_parallelism=MAX_P, extra={"op": i}, **kwargs)


def restore_all(ck, chk, parallelism):
    cp = open_checkpoint(chk)
    heaps, infos = [], []
    for i in range(parallelism):
        heap = ck.Heap()
        rng = compute_key_group_range_for_operator_index(MAX_P, parallelism, i)
        infos.append(restore_snapshot(heap.backend, cp, rng, MAX_P))
        heaps.append(heap)
    return heaps, infos


def test_heap_roundtrip_of_every_state_kind(ck, tmp_path):
    model = sample_model()
    (heap,) = fill(ck, model)
    chk = checkpoint_path(tmp_path, 1)
    manifest = write_snapshot(heap.backend, chk, parallelism=1, operator_index=0,
                              max_parallelism=MAX_P, extra={"seq": 3})
    assert manifest.states == {"v_count": "value", "v_blob": "value", "l_seen": "list",
                               "m_attrs": "map", "r_sum": "reducing", "a_avg": "aggregating",
                               "v_big": "value", "l_long": "list"}
    (restored,), (info,) = restore_all(ck, chk, 1)
    check(ck, [restored], model, 1)
    assert restored.backend.registered_states() == heap.backend.registered_states()
    assert info["extras"] == [{"seq": 3}]
    assert info["records"] == len(model)
    assert info["key_groups"] == len({ck.key_group(k[1], MAX_P) for k in model})


def test_one_one_point_zero_and_true_stay_three_keys(ck, tmp_path):
    heap = ck.Heap()
    for key, value in ((1, "int"), (1.0, "float"), (True, "bool"), ((1,), "tuple")):
        heap.put("v_x", key, None, value)
    chk = checkpoint_path(tmp_path, 1)
    write_snapshot(heap.backend, chk, parallelism=1, operator_index=0, max_parallelism=MAX_P)
    (restored,), (info,) = restore_all(ck, chk, 1)
    assert info["records"] == 4
    reads: list[tuple[object, str]] = [(1, "int"), (1.0, "float"), (True, "bool"),
                                       ([1], "tuple")]
    for read_key, value in reads:
        assert restored.get("v_x", read_key, None) == value


def test_restored_state_is_registered_before_the_function_registers_it(ck, tmp_path):
    (heap,) = fill(ck, {("v_x", "k", None): 5})
    chk = checkpoint_path(tmp_path, 1)
    write_snapshot(heap.backend, chk, parallelism=1, operator_index=0, max_parallelism=MAX_P)
    backend = HeapBackend()
    restore_snapshot(backend, open_checkpoint(chk), KeyGroupRange(0, MAX_P - 1), MAX_P)
    # The function's open() registers the same state: it gets the restored table.
    assert ck.Heap(backend).get("v_x", "k", None) == 5
    with pytest.raises(ValueError, match="already registered as value state"):
        backend.register_state("v_x", StateKind.LIST)


def test_restored_scalars_are_plain_and_containers_stay_packed(ck, tmp_path):
    model = {("v_a", "k1", None): 5, ("v_a", "k2", None): "s", ("v_a", "k3", None): [1],
             ("v_a", "k4", None): {"x": 1}, ("v_a", "k5", None): b"b", ("v_a", "k6", None): 2.5}
    (heap,) = fill(ck, model)
    chk = checkpoint_path(tmp_path, 1)
    write_snapshot(heap.backend, chk, parallelism=1, operator_index=0, max_parallelism=MAX_P)
    backend = HeapBackend()
    restore_snapshot(backend, open_checkpoint(chk), KeyGroupRange(0, MAX_P - 1), MAX_P)
    table = backend.register_state("v_a", StateKind.VALUE)
    kinds = {type(v) for v in table.values()}
    assert kinds == {int, str, Packed, bytes, float}


def test_restore_replaces_existing_entries_and_keeps_others(ck, tmp_path):
    (heap,) = fill(ck, {("v_x", "a", None): 1, ("l_y", "a", None): [1, 2]})
    chk = checkpoint_path(tmp_path, 1)
    write_snapshot(heap.backend, chk, parallelism=1, operator_index=0, max_parallelism=MAX_P)
    target = ck.Heap()
    target.put("v_x", "a", None, 99)
    target.put("l_y", "a", None, [7, 8, 9])
    target.put("v_x", "other", None, 3)
    restore_snapshot(target.backend, open_checkpoint(chk), KeyGroupRange(0, MAX_P - 1), MAX_P)
    assert target.get("v_x", "a", None) == 1
    assert target.get("l_y", "a", None) == [1, 2]
    assert target.get("v_x", "other", None) == 3


@pytest.mark.parametrize(("old", "new"), [(1, 1), (1, 2), (2, 3), (2, 1), (3, 5), (5, 2),
                                          (1, MAX_P), (MAX_P, 3)])
def test_rescale_restores_exactly_the_new_key_groups(ck, tmp_path, old, new):
    model = sample_model()
    heaps = fill(ck, model, parallelism=old)
    chk = checkpoint_path(tmp_path, 1)
    snapshot_all(heaps, chk, old)
    restored, infos = restore_all(ck, chk, new)
    check(ck, restored, model, new)
    assert all(info["extras"] == [{"op": i} for i in range(old)] for info in infos)
    assert sum(info["records"] for info in infos) == len(model)


def test_rescale_chain_1_2_3_1_through_checkpoints(ck, tmp_path):
    """Parallelism 1 filled via execute_one, snapshot as 2 parts, restore at 3 and at 1."""
    model = sample_model()
    (single,) = fill(ck, model, parallelism=1)
    two = fill(ck, model, parallelism=2)  # two backends, each holding its key group range
    check(ck, two, model, 2)
    chk = checkpoint_path(tmp_path, 1)
    snapshot_all(two, chk, 2)
    three, _ = restore_all(ck, chk, 3)
    check(ck, three, model, 3)
    chk2 = checkpoint_path(tmp_path, 2)
    snapshot_all(three, chk2, 3)
    (one,), _ = restore_all(ck, chk2, 1)
    check(ck, [one], model, 1)
    for kg in range(MAX_P):
        assert sorted(one.backend.snapshot_key_group(kg, MAX_P)) == sorted(
            single.backend.snapshot_key_group(kg, MAX_P))


keys = st.one_of(st.integers(-(2**63), 2**64 - 1), st.text(max_size=8), st.binary(max_size=8),
                 st.booleans(), st.none(),
                 st.tuples(st.integers(0, 9), st.text(max_size=3)))

small_ints = st.integers(-(2**31), 2**31)

values = st.one_of(st.integers(-(2**63), 2**64 - 1), st.text(max_size=8),
                   st.floats(allow_nan=False), st.lists(small_ints, max_size=3),
                   st.dictionaries(st.text(max_size=3), small_ints, max_size=3))


@settings(deadline=None, max_examples=slow_examples(25))
@given(entries=st.dictionaries(keys, st.tuples(values, st.lists(values, min_size=1, max_size=3)),
                               max_size=40),
       old=st.integers(1, 6), new=st.integers(1, 6))
def test_rescale_random_key_sets(ck, tmp_path_factory, entries, old, new):
    model: dict[tuple[str, object, object], object] = {}
    for key, (value, items) in entries.items():
        model[("v_x", key, None)] = value
        model[("l_y", key, "ns")] = items
    heaps = fill(ck, model, parallelism=old)
    chk = checkpoint_path(tmp_path_factory.mktemp("chk"), 1)
    snapshot_all(heaps, chk, old)
    restored, _ = restore_all(ck, chk, new)
    check(ck, restored, model, new)


class PerKeyGroupBackend:
    """A backend offering only the per-key-group protocol (as RocksDBBackend does)."""

    def __init__(self, inner: HeapBackend) -> None:
        self.inner = inner
        self.asked: list[int] = []

    def registered_states(self):
        return self.inner.registered_states()

    def register_state(self, name, kind):
        return self.inner.register_state(name, kind)

    def snapshot_key_group(self, key_group):
        self.asked.append(key_group)
        return self.inner.snapshot_key_group(key_group, MAX_P)

    def restore_key_group(self, key_group, entries):
        self.inner.restore_key_group(key_group, entries)


def test_per_key_group_backends_write_the_same_checkpoint(ck, tmp_path):
    model = sample_model()
    heaps = fill(ck, model, parallelism=2)
    chk = checkpoint_path(tmp_path, 1)
    for i, heap in enumerate(heaps):
        backend = PerKeyGroupBackend(heap.backend)
        assert isinstance(backend, SnapshotBackend)
        write_snapshot(backend, chk, parallelism=2, operator_index=i, max_parallelism=MAX_P)
        assert backend.asked == list(compute_key_group_range_for_operator_index(MAX_P, 2, i))
    restored, _ = restore_all(ck, chk, 3)
    check(ck, restored, model, 3)


def test_snapshot_rejects_entries_outside_the_operator_key_groups(ck, tmp_path):
    model = {("v_x", k, None): k for k in range(50)}
    (heap,) = fill(ck, model, parallelism=1)
    with pytest.raises(KeyGroupError, match=r"^HeapBackend holds state 'v_x' of key group \d+, "
                                            r"outside the key groups 0\.\.15"):
        write_snapshot(heap.backend, checkpoint_path(tmp_path, 1), parallelism=2,
                       operator_index=0, max_parallelism=MAX_P)
    assert os.listdir(os.path.join(checkpoint_path(tmp_path, 1), "part-2-0")) == []


def test_extra_sections_roundtrip_through_handlers(ck, tmp_path):
    model = {("v_x", k, None): k for k in range(20)}
    (heap,) = fill(ck, model)
    chk = checkpoint_path(tmp_path, 1)

    def timers(kg):
        return [(1, [[kg, 100 + kg], [kg, 200 + kg]])] if kg % 4 == 0 else []

    write_snapshot(heap.backend, chk, parallelism=1, operator_index=0, max_parallelism=MAX_P,
                   extra_sections=timers)
    got: dict[int, list[object]] = {}
    restored = ck.Heap()
    restore_snapshot(restored.backend, open_checkpoint(chk), KeyGroupRange(0, MAX_P - 1),
                     MAX_P, section_handlers={1: lambda kg, recs: got.setdefault(kg, recs)})
    assert got == {kg: [[kg, 100 + kg], [kg, 200 + kg]] for kg in range(0, MAX_P, 4)}
    check(ck, [restored], model, 1)
    with pytest.raises(CheckpointError, match=r"^key group 0 of data file .*: unknown section "
                                              r"tag 1"):
        restore_snapshot(HeapBackend(), open_checkpoint(chk), KeyGroupRange(0, MAX_P - 1),
                         MAX_P)


def test_reserved_section_tag_is_refused(ck, tmp_path):
    (heap,) = fill(ck, {("v_x", 1, None): 1})
    with pytest.raises(ValueError, match="reserved for state entries"):
        write_snapshot(heap.backend, checkpoint_path(tmp_path, 1), parallelism=1,
                       operator_index=0, max_parallelism=MAX_P,
                       extra_sections=lambda kg: [(SECTION_STATE_ENTRIES, [1])])


def test_restore_with_another_max_parallelism_is_refused(ck, tmp_path):
    (heap,) = fill(ck, {("v_x", 1, None): 1})
    chk = checkpoint_path(tmp_path, 1)
    write_snapshot(heap.backend, chk, parallelism=1, operator_index=0, max_parallelism=MAX_P)
    with pytest.raises(CheckpointError, match=r"written with max_parallelism 32, cannot restore "
                                              r"it with max_parallelism 64"):
        restore_snapshot(HeapBackend(), open_checkpoint(chk), KeyGroupRange(0, 63), 64)


def test_restore_into_a_backend_with_another_state_kind_is_refused(ck, tmp_path):
    (heap,) = fill(ck, {("v_x", 1, None): 1})
    chk = checkpoint_path(tmp_path, 1)
    write_snapshot(heap.backend, chk, parallelism=1, operator_index=0, max_parallelism=MAX_P)
    backend = HeapBackend()
    backend.register_state("v_x", StateKind.MAP)
    with pytest.raises(CheckpointError, match=r"^state 'v_x' of checkpoint .* is value state: "
                                              r"state 'v_x' is already registered as map"):
        restore_snapshot(backend, open_checkpoint(chk), KeyGroupRange(0, MAX_P - 1), MAX_P)


def test_entries_in_the_wrong_key_group_are_detected(ck, tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    from asyncstate.serde import canonical_key
    kb = canonical_key("k")
    wrong = (ck.key_group("k", MAX_P) + 1) % MAX_P
    write_part(chk, parallelism=1, operator_index=0, max_parallelism=MAX_P,
               states={"v": "value"},
               key_groups=[(wrong, [[SECTION_STATE_ENTRIES, 1], ["v", kb, b"\xc0", b"\x01"]])])
    with pytest.raises(CheckpointError, match=rf"^key group {wrong} of data file .*: its entries "
                                              r"belong to key group"):
        restore_snapshot(HeapBackend(), open_checkpoint(chk), KeyGroupRange(0, MAX_P - 1),
                         MAX_P)


@pytest.mark.parametrize("stream", [
    [[SECTION_STATE_ENTRIES, 5], ["v", b"\xa1k", b"\xc0", b"\x01"]],
    [["not", "a header"]],
    [[SECTION_STATE_ENTRIES, 1], ["unknown_state", b"\xa1k", b"\xc0", b"\x01"]],
    [[SECTION_STATE_ENTRIES, 1], ["v", b"\xa1k"]],
])
def test_malformed_streams_fail_the_restore_naming_the_file(ck, tmp_path, stream):
    chk = checkpoint_path(tmp_path, 1)
    kg = ck.key_group("k", MAX_P)
    write_part(chk, parallelism=1, operator_index=0, max_parallelism=MAX_P,
               states={"v": "value"}, key_groups=[(kg, stream)])
    with pytest.raises(CheckpointError, match=rf"^key group {kg} of data file '.*\.bin': "
                                              r"malformed"):
        restore_snapshot(HeapBackend(), open_checkpoint(chk), KeyGroupRange(0, MAX_P - 1),
                         MAX_P)


def test_garbage_collector_is_left_as_found(ck, tmp_path):
    (heap,) = fill(ck, {("v_x", 1, None): 1})
    chk = checkpoint_path(tmp_path, 1)
    assert gc.isenabled()
    write_snapshot(heap.backend, chk, parallelism=1, operator_index=0, max_parallelism=MAX_P)
    restore_snapshot(HeapBackend(), open_checkpoint(chk), KeyGroupRange(0, MAX_P - 1), MAX_P)
    assert gc.isenabled()
    gc.disable()
    try:
        write_snapshot(heap.backend, chk, parallelism=1, operator_index=0,
                       max_parallelism=MAX_P)
        assert not gc.isenabled()
    finally:
        gc.enable()


async def test_heap_and_rocksdb_read_each_others_checkpoints(ck, tmp_path):
    """heap -> checkpoint -> RocksDB (per-key-group path) -> checkpoint at 3 parts -> heap."""
    pytest.importorskip("rocksdict")
    import asyncio

    from asyncstate.backends.base import ExecutorBinding
    from asyncstate.backends.rocksdb import RocksDBBackend

    model = sample_model()
    (heap,) = fill(ck, model)
    first = checkpoint_path(tmp_path, 1)
    write_snapshot(heap.backend, first, parallelism=1, operator_index=0, max_parallelism=MAX_P)
    second = checkpoint_path(tmp_path, 2)
    for i in range(3):
        rocks = RocksDBBackend(tmp_path / f"db{i}")
        try:
            rocks.open(ExecutorBinding(loop=asyncio.get_running_loop(),
                                       deliver=lambda *args: None, iterator_chunk_size=100,
                                       max_parallelism=MAX_P))
            rng = compute_key_group_range_for_operator_index(MAX_P, 3, i)
            restore_snapshot(rocks, open_checkpoint(first), rng, MAX_P)
            write_snapshot(rocks, second, parallelism=3, operator_index=i, max_parallelism=MAX_P)
        finally:
            rocks.close()
    (restored,), (info,) = restore_all(ck, second, 1)
    assert info["records"] == len(model)
    check(ck, [restored], model, 1)


class TinyBackend:
    """A SnapshotBackend with a `snapshot_key_groups` fast path returning fixed groups."""

    def __init__(self, groups: dict[int, list[list]]) -> None:
        self.groups = groups
        self.restored: dict[int, list] = {}

    def registered_states(self):
        return {"v": StateKind.VALUE}

    def register_state(self, name, kind):
        return name

    def snapshot_key_group(self, kg):
        return self.groups.get(kg, [])

    def snapshot_key_groups(self, rng, max_parallelism):
        return {kg: (len(es), b"".join(msgpack.packb(e) for e in es))
                for kg, es in self.groups.items()}

    def restore_key_group(self, kg, entries):
        self.restored[kg] = list(entries)


def test_write_snapshot_of_a_backend_with_zero_states(ck, tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    heap = ck.Heap()
    m = write_snapshot(heap.backend, chk, parallelism=1, operator_index=0,
                       max_parallelism=MAX_P, extra={"op": 0})
    assert m.states == {} and m.key_groups == {}
    manifest = committed(os.path.join(chk, "part-1-0"))
    assert manifest["states"] == {} and manifest["key_groups"] == []
    cp = open_checkpoint(chk)
    target = ck.Heap()
    info = restore_snapshot(target.backend, cp, KeyGroupRange(0, MAX_P - 1), MAX_P)
    assert info == {"extras": [{"op": 0}], "states": {}, "key_groups": 0, "records": 0}


def test_backend_entries_outside_the_range_are_refused_without_extra_sections(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    backend = TinyBackend({0: [["v", b"k", b"n", b"d"]], 7: [["v", b"k", b"n", b"d"]]})
    with pytest.raises(CheckpointError, match="key group 7 is outside"):
        write_snapshot(backend, chk, parallelism=2, operator_index=0, max_parallelism=8)


def test_backend_entries_outside_the_range_are_refused_with_extra_sections(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    backend = TinyBackend({0: [["v", b"k", b"n", b"d"]], 7: [["v", b"k", b"n", b"d"]]})
    with pytest.raises(CheckpointError, match="key group 7"):
        write_snapshot(backend, chk, parallelism=2, operator_index=0, max_parallelism=8,
                       extra_sections=lambda kg: [])


V = ast.ValueStateDescriptor
L = ast.ListStateDescriptor
M = ast.MapStateDescriptor
R = ast.ReducingStateDescriptor


def _ckpt_fn():
    return _StateFn(v=V("v"), l=L("l"), m=M("m"), r=R("r", lambda a, b: a + b))


class _StateFn(ast.KeyedProcessFunction):
    def __init__(self, **descriptors):
        self.descriptors = descriptors

    def open(self, ctx):
        getters = {V: ctx.get_state, L: ctx.get_list_state, M: ctx.get_map_state,
                   R: ctx.get_reducing_state}
        for name, d in self.descriptors.items():
            setattr(self, name, getters[type(d)](d))

    def process_element(self, record, ctx):
        if record[1] == "w":
            self.v.update(("v", record[0]))
            self.l.add_all([record[0], -0.0, (1,)])
            self.m.put_all({0: 0, b"": "", (1, (2,)): {(1, 2): (3,)}})
            self.m.put(0.0, -0.0)
            self.r.add(2**63)
            self.m.set_current_namespace(b"\xff")
            self.m.put(-1, "ns")
            return None
        self.m.set_current_namespace(b"\xff")
        in_ns = self.m.entries().then_compose(lambda it: it.to_list())
        self.m.set_current_namespace(None)
        return ast.combine_all([
            self.v.value(), self.l.get().then_compose(lambda it: it.to_list()),
            self.m.entries().then_compose(lambda it: it.to_list()).then_apply(by_key_bytes),
            self.r.get(), in_ns,
        ]).then_accept(lambda got: ctx.emit((canon(record[0]), got)))


CKPT_KEYS = [b"k", "k", -1, 2**64 - 1, -0.0, 0.0, None, True, "", [], [[1], b"\xff"]]


@pytest.mark.parametrize("source", ["heap", "rocksdb"])
def test_parity_checkpoint_moves_between_backends(state_helpers, tmp_path, source):
    factories = state_helpers.factories
    config = ast.AsyncStateConfig(max_parallelism=8)

    async def snapshot():
        async with ast.KeyedOperator(_ckpt_fn(), key_selector=lambda r: r[0],
                                     backend=factories[source](tmp_path / "src"),
                                     config=config) as op:
            for k in CKPT_KEYS:
                await op.process((k, "w"))
            return await op.snapshot(str(tmp_path / "chk"), 1)

    async def restore(target):
        async with ast.KeyedOperator(_ckpt_fn(), key_selector=lambda r: r[0],
                                     backend=factories[target](tmp_path / f"dst-{target}"),
                                     config=config, restore_from=path) as op:
            for k in CKPT_KEYS:
                await op.process((k, "r"))
            await op.drain()
            return dict(op.outputs())

    (tmp_path / "src").mkdir()
    path = asyncio.run(snapshot())
    for target in ("heap", "rocksdb"):
        (tmp_path / f"dst-{target}").mkdir()
        out = asyncio.run(restore(target))
        assert len(out) == len(CKPT_KEYS)
        for k in CKPT_KEYS:
            n = state_helpers.normalize(k)
            expected = [["v", n], [n, -0.0, [1]],
                        by_key_bytes([(0, 0), (0.0, -0.0), (b"", ""), ([1, [2]], {(1, 2): [3]})]),
                        2**63, [(-1, "ns")]]
            assert strict_eq(out[canon(k)], expected, dict_order=False), (target, k, out[canon(k)])
