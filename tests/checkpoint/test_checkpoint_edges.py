"""Edges of the checkpoint format, operator state, serde and key groups.

Each test pins one behaviour no other test covers: a validation that must refuse, a
translation to the documented error type, a cleanup that must happen.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import msgpack
import pytest
from test_format import edit_manifest

import asyncstate as ast
from asyncstate.backends.heap import HeapBackend
from asyncstate.checkpoint.format import (
    MANIFEST_NAME,
    checkpoint_path,
    open_checkpoint,
    write_part,
)
from asyncstate.checkpoint.operator_state import read_operator_extras
from asyncstate.checkpoint.snapshot import restore_snapshot
from asyncstate.errors import CheckpointError
from asyncstate.keygroups import KeyGroupRange
from asyncstate.serde import canonical_key, check_value_bytes

MAX_P = 8
TOO_DEEP = b"\x91" * 1024 + b"\x90"  # 1025 nested arrays: packs, but msgpack reads 1024 only


def _entry(key: str, value_bytes: bytes, state: str = "v") -> list[object]:
    return [state, canonical_key(key), canonical_key(None), value_bytes]


def _write_one_part(chk: str, key_groups: list, extra: dict | None = None) -> None:
    write_part(chk, parallelism=1, operator_index=0, max_parallelism=MAX_P,
               states={"v": "value"}, key_groups=key_groups, extra=extra)


def _backend(kind: str, tmp_path: Any) -> Any:
    return HeapBackend() if kind == "heap" else ast.RocksDBBackend(str(tmp_path / "db"))


# -- key groups ----------------------------------------------------------------------------


@pytest.mark.parametrize(("start", "end"), [(5, 4), (1, 0)])
def test_key_group_range_with_end_before_start_is_refused(start, end):
    with pytest.raises(ValueError, match=r"^end must be") as info:
        ast.KeyGroupRange(start, end)
    assert isinstance(info.value, ast.AsyncStateError)


@pytest.mark.parametrize("other", [True, False, 1.0, 2.5, "1", None, [1]])
def test_key_group_range_contains_only_ints(other):
    rng = ast.KeyGroupRange(0, 3)
    assert other not in rng
    assert 1 in rng


# -- check_value_bytes: every refusal is a ValueError --------------------------------------


def test_check_value_bytes_refuses_bytes_nested_too_deep_with_value_error():
    with pytest.raises(ValueError, match=r"nested more than 1024 levels"):
        check_value_bytes(TOO_DEEP)


@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
def test_state_entry_nested_too_deep_fails_the_restore_with_checkpoint_error(tmp_path, kind):
    chk = checkpoint_path(tmp_path, 1)
    kg = ast.assign_to_key_group("k", MAX_P)
    _write_one_part(chk, [(kg, [[0, 1], _entry("k", TOO_DEEP)])])
    cp = open_checkpoint(chk)
    backend = _backend(kind, tmp_path)
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
    backend = _backend(kind, tmp_path)
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
    backend = _backend(kind, tmp_path)
    try:
        restore_snapshot(backend, open_checkpoint(chk), KeyGroupRange(0, MAX_P - 1), MAX_P)
        held = backend.snapshot_key_group(kg, MAX_P) if kind == "heap" \
            else backend.snapshot_key_group(kg)
        assert [list(e) for e in held] == [["l", key, ns, [two]]]
    finally:
        backend.close()


def test_operator_state_element_nested_too_deep_is_a_checkpoint_error(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    _write_one_part(chk, [], extra={"operator_state": {
        "offsets": {"mode": "split", "items": [msgpack.packb(1), TOO_DEEP]}}})
    with pytest.raises(CheckpointError, match=r"operator state 'offsets' whose element 1"):
        read_operator_extras(open_checkpoint(chk))


# -- operator list state -------------------------------------------------------------------


class Declares(ast.KeyedProcessFunction):
    """Declares the operator list states named in `split` and `union` (None: not at all)."""

    def __init__(self, split: str | None = "offsets", union: str | None = "seen") -> None:
        self.split_name, self.union_name = split, union
        self.split: Any = None
        self.union: Any = None

    def open(self, ctx: ast.RuntimeContext) -> None:
        if self.split_name:
            self.split = ctx.get_operator_list_state(self.split_name)
        if self.union_name:
            self.union = ctx.get_union_list_state(self.union_name)

    async def process_element(self, value: Any, ctx: ast.RecordContext) -> None:
        ctx.emit(value)


def _operator(fn: ast.KeyedProcessFunction, restore_from: str | None = None,
              parallelism: int = 1, index: int = 0) -> ast.KeyedOperator:
    return ast.KeyedOperator(fn, key_selector=lambda r: r, backend=ast.HeapBackend(),
                             config=ast.AsyncStateConfig(max_parallelism=MAX_P),
                             parallelism=parallelism, operator_index=index,
                             restore_from=restore_from)


@pytest.mark.timeout(60)
async def test_operator_list_update_validates_and_copies_its_values(tmp_path):
    fn = Declares()
    async with _operator(fn) as op:
        inner = [1, 2]
        await fn.split.update([inner, "x"])
        inner.append(3)  # the state holds a copy taken at update()
        assert await (await fn.split.get()).to_list() == [[1, 2], "x"]
        with pytest.raises(ast.SerializationError, match=r"'offsets'"):
            await fn.split.update(["ok", object()])
        assert await (await fn.split.get()).to_list() == [[1, 2], "x"]
        path = await op.snapshot(str(tmp_path), 1)
    fn2 = Declares()
    async with _operator(fn2, restore_from=path):
        assert await (await fn2.split.get()).to_list() == [[1, 2], "x"]


def _modes(path: str) -> list[dict[str, str]]:
    return [{name: entry["mode"] for name, entry in extra["operator_state"].items()}
            for extra in open_checkpoint(path).extras]


@pytest.mark.timeout(60)
async def test_checkpoint_records_each_operator_state_mode_and_carries_it(tmp_path):
    fn = Declares()
    async with _operator(fn) as op:
        await fn.split.add("s")
        await fn.union.add("u")
        p1 = await op.snapshot(str(tmp_path), 1)
    assert _modes(p1) == [{"offsets": "split", "seen": "union"}]
    assert read_operator_extras(open_checkpoint(p1)).operator_modes == {
        "offsets": "split", "seen": "union"}
    # A run that declares neither carries both, with their modes, into its checkpoints.
    paths = set()
    for index in range(2):
        async with _operator(Declares(None, None), p1, 2, index) as op:
            paths.add(await op.snapshot(str(tmp_path), 2))
    (p2,) = paths
    assert _modes(p2) == [{"offsets": "split", "seen": "union"}] * 2


def test_restored_list_sequence_is_the_largest_of_all_parts(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    for index, seq in enumerate([7, 3, 0]):
        write_part(chk, parallelism=3, operator_index=index, max_parallelism=MAX_P,
                   states={}, key_groups=[], extra={"list_sequence": seq})
    assert read_operator_extras(open_checkpoint(chk)).list_sequence == 7


@pytest.mark.parametrize("name", [5, b"offsets", None])
def test_operator_state_whose_name_is_not_a_str_is_a_checkpoint_error(tmp_path, name):
    chk = checkpoint_path(tmp_path, 1)
    _write_one_part(chk, [], extra={"operator_state": {name: {"mode": "split", "items": []}}})
    with pytest.raises(CheckpointError, match=r"without a list of items") as info:
        read_operator_extras(open_checkpoint(chk))
    assert info.value.path.endswith(".bin")


@pytest.mark.parametrize("mode", ["broadcast", "SPLIT", None, 1])
def test_operator_state_with_an_unknown_mode_is_a_checkpoint_error(tmp_path, mode):
    chk = checkpoint_path(tmp_path, 1)
    _write_one_part(chk, [], extra={"operator_state": {"offsets": {"mode": mode, "items": []}}})
    with pytest.raises(CheckpointError, match=r"operator state 'offsets' with an unknown mode"):
        read_operator_extras(open_checkpoint(chk))


def test_parts_that_disagree_on_an_operator_state_mode_are_a_checkpoint_error(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    for index, mode in enumerate(["union", "union", "split"]):
        write_part(chk, parallelism=3, operator_index=index, max_parallelism=MAX_P,
                   states={}, key_groups=[],
                   extra={"operator_state": {"offsets": {"mode": mode, "items": []},
                                             "seen": {"mode": "split", "items": []}}})
    with pytest.raises(CheckpointError, match=r"operator state 'offsets' in mode 'split', "
                                              r"where an earlier part has it in mode 'union'"
                       ) as info:
        read_operator_extras(open_checkpoint(chk))
    assert "part-3-2" in info.value.path


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("elements", "middle"), [(4, 3), (5, 4), (7, 3), (2, 3)])
async def test_carried_operator_state_keeps_every_element_once(tmp_path, elements, middle):
    items = [f"e{i}" for i in range(elements)]
    fn = Declares()
    async with _operator(fn) as op:
        await fn.split.add_all(items)
        await fn.union.add_all(items)
        p1 = await op.snapshot(str(tmp_path), 1)
    paths = set()
    for index in range(middle):  # never declares the states: carries them
        async with _operator(Declares(None, None), p1, middle, index) as op:
            paths.add(await op.snapshot(str(tmp_path), 2))
    (p2,) = paths
    fn = Declares()
    async with _operator(fn, restore_from=p2):
        # split: each carrying instance wrote the share declaring would have given it
        # (element j to instance j % middle); union: contiguous slices, order kept.
        shares = [items[index::middle] for index in range(middle)]
        assert await (await fn.split.get()).to_list() == [x for s in shares for x in s]
        assert await (await fn.union.get()).to_list() == items


# -- reader: symlinks to siblings whose names extend the checkpoint's -----------------------


def _write_simple(chk: str) -> None:
    kg = ast.assign_to_key_group("k", MAX_P)
    _write_one_part(chk, [(kg, [[0, 1], _entry("k", msgpack.packb(1))])])


def _simple_part(tmp_path: Any) -> tuple[str, Any]:
    """A checkpoint of one part holding one entry, and that part as the reader sees it."""
    chk = checkpoint_path(tmp_path, 1)
    _write_simple(chk)
    return chk, open_checkpoint(chk).parts[0]


# -- reader: manifests that contradict themselves -------------------------------------------


def test_manifest_listing_one_key_group_twice_identically_is_refused(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    _write_simple(chk)
    kg = ast.assign_to_key_group("k", MAX_P)
    edit_manifest(chk, "part-1-0", lambda m: m["key_groups"].append(dict(m["key_groups"][0])))
    with pytest.raises(CheckpointError, match=rf"lists key group {kg} twice"):
        open_checkpoint(chk)


def test_part_whose_operator_index_equals_its_parallelism_is_a_checkpoint_error(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    for index in range(2):
        write_part(chk, parallelism=2, operator_index=index, max_parallelism=MAX_P,
                   states={}, key_groups=[])
    shutil.copytree(os.path.join(chk, "part-2-1"), os.path.join(chk, "part-2-2"))
    edit_manifest(chk, "part-2-2", operator_index=2)
    with pytest.raises(CheckpointError, match=r"which do not match its directory part-2-2"):
        open_checkpoint(chk)


def test_data_file_longer_than_its_manifest_says_is_refused(tmp_path):
    chk, part = _simple_part(tmp_path)
    with open(part.data_path, "ab") as f:
        f.write(b"\x00")
    with pytest.raises(CheckpointError, match=rf"has {part.data_size + 1} bytes but its "
                                              rf"manifest expects {part.data_size}"):
        open_checkpoint(chk)


# -- writer: arguments -----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [True, False, -1, float("inf"), float("nan"), "1"])
def test_write_part_refuses_a_bad_stale_after_s_and_writes_nothing(tmp_path, bad):
    chk = checkpoint_path(tmp_path, 1)
    with pytest.raises(ast.ConfigError, match=r"stale_after_s"):
        write_part(chk, parallelism=1, operator_index=0, max_parallelism=MAX_P, states={},
                   key_groups=[], stale_after_s=bad)
    assert not os.path.exists(chk)


# -- writer: records and the replaced manifest ----------------------------------------------


@pytest.mark.parametrize("bad", [2**64, -(2**63) - 1])
def test_record_with_an_int_msgpack_cannot_hold_is_a_checkpoint_error(tmp_path, bad):
    chk = checkpoint_path(tmp_path, 1)
    _write_simple(chk)
    with pytest.raises(CheckpointError, match=r"a record of key group 3 in checkpoint part "
                                              r"part-1-0 cannot be encoded with msgpack"):
        _write_one_part(chk, [(3, [[1, 2], [bad]])])
    cp = open_checkpoint(chk)  # the previous part is intact, and nothing is left over
    assert sorted(os.listdir(cp.parts[0].path)) == sorted([MANIFEST_NAME, cp.parts[0].data_file])


@pytest.mark.parametrize("name", ["../victim.bin", "../../victim.bin", "victim.bin"])
def test_rewrite_never_deletes_a_file_a_damaged_manifest_names_outside_the_pattern(
        tmp_path, name):
    chk = checkpoint_path(tmp_path, 1)
    _write_simple(chk)
    part_dir = os.path.join(chk, "part-1-0")
    victim = os.path.normpath(os.path.join(part_dir, name))
    with open(victim, "wb") as f:
        f.write(b"keep me")
    edit_manifest(chk, "part-1-0", data_file=name)
    _write_simple(chk)  # replaces the damaged manifest
    with open(victim, "rb") as f:
        assert f.read() == b"keep me"
    open_checkpoint(chk).verify()


# -- restore: section headers ------------------------------------------------------------------


@pytest.mark.parametrize("tag", [0, 7])
def test_section_header_counting_one_record_more_than_the_stream_holds_is_refused(
        tmp_path, tag):
    chk = checkpoint_path(tmp_path, 1)
    kg = ast.assign_to_key_group("k", MAX_P)
    _write_one_part(chk, [(kg, [[tag, 2], _entry("k", msgpack.packb(1))])])
    seen: list[Any] = []
    with pytest.raises(CheckpointError, match=rf"key group {kg} of data file .*malformed "
                                              r"section header"):
        restore_snapshot(HeapBackend(), open_checkpoint(chk), KeyGroupRange(0, MAX_P - 1),
                         MAX_P, section_handlers={7: lambda k, records: seen.append(records)})
    assert seen == []
