"""The on-disk format: roundtrip, completeness check, damage detection, atomic replace."""

from __future__ import annotations

import json
import os
import re

import msgpack
import pytest

from asyncstate.checkpoint.format import (
    DATA_MAGIC,
    MANIFEST_NAME,
    PackedRecords,
    checkpoint_path,
    open_checkpoint,
    part_name,
    write_part,
)
from asyncstate.errors import CheckpointError, ConfigError
from asyncstate.keygroups import KeyGroupRange, compute_key_group_range_for_operator_index

MAX_P = 16
STATES = {"count": "value", "seen": "list"}


def records_for(kg: int, n: int = 3) -> list[object]:
    return [[kg, i, f"r{kg}-{i}", b"\x00\xff" * i, {1: [kg, None, 1.5]}, "é"] for i in range(n)]


def write_all(chk: str, parallelism: int, max_p: int = MAX_P, *, extra_of=None,
              states=STATES, **kwargs) -> dict[int, list[object]]:
    """Write every part of a checkpoint; key group kg gets records_for(kg) (kg % 3 == 2: none)."""
    expected: dict[int, list[object]] = {}
    for index in range(parallelism):
        kgs = compute_key_group_range_for_operator_index(max_p, parallelism, index)
        groups = [(kg, records_for(kg)) for kg in kgs if kg % 3 != 2]
        expected.update(groups)
        write_part(chk, parallelism=parallelism, operator_index=index, max_parallelism=max_p,
                   states=states, key_groups=groups,
                   extra=(extra_of(index) if extra_of else {"index": index}), **kwargs)
    return expected


def read_all(chk: str, kgs: KeyGroupRange | None = None) -> dict[int, list[object]]:
    cp = open_checkpoint(chk)
    rng = kgs or KeyGroupRange(0, cp.max_parallelism - 1)
    return {kg: list(records) for kg, records in cp.read_key_groups(rng)}


def damage(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


# -- paths --------------------------------------------------------------------------------


def test_format_gathers_each_public_name_from_exactly_one_module():
    from asyncstate.checkpoint import format as fmt
    from asyncstate.checkpoint import layout, reader, writer

    for name in fmt.__all__:
        homes = [m for m in (layout, writer, reader) if name in m.__all__]
        assert len(homes) == 1, name
        assert getattr(fmt, name) is getattr(homes[0], name), name


def test_checkpoint_path_is_chk_id_under_directory(tmp_path):
    assert checkpoint_path(tmp_path, 7) == os.path.join(str(tmp_path), "chk-7")
    assert checkpoint_path(str(tmp_path), 0).endswith("chk-0")


@pytest.mark.parametrize("bad", [-1, True, "3", 1.0, None])
def test_checkpoint_path_rejects_bad_ids(tmp_path, bad):
    with pytest.raises(ConfigError, match=r"^checkpoint_id must be"):
        checkpoint_path(tmp_path, bad)
    with pytest.raises(ValueError):
        checkpoint_path(tmp_path, bad)


# -- roundtrip ----------------------------------------------------------------------------


@pytest.mark.parametrize("parallelism", [1, 3, 16])
def test_roundtrip_every_key_group(tmp_path, parallelism):
    chk = checkpoint_path(tmp_path, 1)
    expected = write_all(chk, parallelism)
    assert read_all(chk) == expected
    cp = open_checkpoint(chk)
    assert cp.max_parallelism == MAX_P
    assert cp.parallelism == parallelism
    assert cp.states == STATES
    assert cp.extras == [{"index": i} for i in range(parallelism)]
    assert [p.name for p in cp.parts] == [part_name(parallelism, i) for i in range(parallelism)]
    cp.verify()


def test_read_key_groups_reads_exactly_the_range(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    expected = write_all(chk, 3)
    got = read_all(chk, KeyGroupRange(4, 9))
    assert got == {kg: recs for kg, recs in expected.items() if 4 <= kg <= 9}
    assert list(got) == sorted(got)


def test_read_outside_max_parallelism_is_rejected(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    write_all(chk, 1)
    with pytest.raises(CheckpointError, match=r"key groups 10\.\.16 lie outside checkpoint"):
        read_all(chk, KeyGroupRange(10, 16))


def test_extra_may_hold_bytes_and_nested_values(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    extra = {"seq": 12, "ops": {"offsets": [b"\x01\x02", 3, "x"]}, "none": None}
    write_all(chk, 2, extra_of=lambda i: extra)
    assert open_checkpoint(chk).extras == [extra, extra]


def test_packed_records_are_written_verbatim(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    recs = [[1, "a"], [2, b"b"], {"k": 3}]
    data = b"".join(msgpack.packb(r, use_bin_type=True) for r in recs)
    write_part(chk, parallelism=1, operator_index=0, max_parallelism=4, states={},
               key_groups=[(2, PackedRecords(3, data))])
    assert read_all(chk) == {2: recs}


def test_streamed_records_of_a_big_key_group(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    n = 50_000  # several write chunks
    write_part(chk, parallelism=1, operator_index=0, max_parallelism=2, states={},
               key_groups=[(1, ([i, "x" * (i % 7)] for i in range(n)))])
    got = read_all(chk)
    assert list(got) == [1] and len(got[1]) == n and got[1][-1] == [n - 1, "x" * ((n - 1) % 7)]


@pytest.mark.parametrize("n", [0, 1, 15, 16, 65_535, 65_536])
def test_key_groups_of_every_array_header_size_read_back(tmp_path, n):
    """Records are decoded as one array whose header the reader builds from the manifest's
    count: fixarray, array 16 and array 32 headers all give back exactly the records."""
    chk = checkpoint_path(tmp_path, 1)
    write_part(chk, parallelism=1, operator_index=0, max_parallelism=2, states={},
               key_groups=[(0, [[1, 2]]), (1, (i for i in range(n)))])
    got = read_all(chk)
    assert got == ({0: [[1, 2]], 1: list(range(n))} if n else {0: [[1, 2]]})


def test_record_at_msgpacks_depth_limit_reads_back(tmp_path):
    """A record nested as deep as msgpack decodes alone is one level too deep inside the
    one-array decode; the record-by-record decode reads it."""
    deep: object = None
    for _ in range(1024):
        deep = [deep]
    with pytest.raises(ValueError):  # the one-array decode of it fails ...
        msgpack.unpackb(b"\x91" + msgpack.packb(deep))
    chk = checkpoint_path(tmp_path, 1)
    write_part(chk, parallelism=1, operator_index=0, max_parallelism=2, states={},
               key_groups=[(1, [7, deep, "after"])])
    got = read_all(chk)  # ... and the record-by-record one reads it
    assert list(got) == [1] and len(got[1]) == 3  # (== on 1024 levels passes Python's limit)
    assert [msgpack.packb(r) for r in got[1]] == [msgpack.packb(r) for r in (7, deep, "after")]


def test_manifest_describes_the_part(tmp_path):
    chk = checkpoint_path(tmp_path, 3)
    write_all(chk, 2)
    part_dir = os.path.join(chk, "part-2-1")
    with open(os.path.join(part_dir, MANIFEST_NAME)) as f:
        m = json.load(f)
    assert m["format_version"] == 1
    assert (m["max_parallelism"], m["parallelism"], m["operator_index"]) == (MAX_P, 2, 1)
    assert m["key_group_range"] == [8, 15]
    assert m["states"] == STATES
    assert re.fullmatch(r"data-[0-9a-f]{32}\.bin", m["data_file"])
    assert sorted(os.listdir(part_dir)) == sorted([MANIFEST_NAME, m["data_file"]])
    assert [e["key_group"] for e in m["key_groups"]] == [9, 10, 12, 13, 15]
    assert all({"offset", "size", "records", "crc32"} <= set(e) for e in m["key_groups"])
    assert os.path.getsize(os.path.join(part_dir, m["data_file"])) == m["data_size"]
    with open(os.path.join(part_dir, m["data_file"]), "rb") as f:
        assert f.read(len(DATA_MAGIC)) == DATA_MAGIC


# -- writer validation ----------------------------------------------------------------------


def test_key_group_outside_the_part_is_rejected_and_nothing_is_left(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    with pytest.raises(CheckpointError,
                       match=r"^key group 9 is outside the key groups 0\.\.7 of checkpoint "
                             r"part part-2-0"):
        write_part(chk, parallelism=2, operator_index=0, max_parallelism=MAX_P, states={},
                   key_groups=[(1, [1]), (9, [2])])
    assert os.listdir(os.path.join(chk, "part-2-0")) == []


def test_duplicate_key_group_is_rejected(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    with pytest.raises(CheckpointError, match=r"^key group 1 given twice"):
        write_part(chk, parallelism=1, operator_index=0, max_parallelism=MAX_P, states={},
                   key_groups=[(1, [1]), (1, [2])])


def test_unencodable_record_names_the_key_group_and_keeps_the_old_part(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    expected = write_all(chk, 1)
    with pytest.raises(CheckpointError,
                       match=r"^a record of key group 4 in checkpoint part part-1-0 cannot be "
                             r"encoded"):
        write_part(chk, parallelism=1, operator_index=0, max_parallelism=MAX_P, states={},
                   key_groups=[(3, [1]), (4, [object()])])
    assert read_all(chk) == expected
    assert len(os.listdir(os.path.join(chk, "part-1-0"))) == 2


def test_failing_record_source_keeps_the_old_part(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    expected = write_all(chk, 1)

    def boom():
        yield [1]
        raise RuntimeError("backend died")

    with pytest.raises(RuntimeError, match="backend died"):
        write_part(chk, parallelism=1, operator_index=0, max_parallelism=MAX_P, states={},
                   key_groups=[(0, boom())])
    assert read_all(chk) == expected
    assert len(os.listdir(os.path.join(chk, "part-1-0"))) == 2


@pytest.mark.parametrize(("kwargs", "option"), [
    ({"parallelism": 0, "operator_index": 0, "max_parallelism": 4}, "parallelism"),
    ({"parallelism": 5, "operator_index": 0, "max_parallelism": 4}, "parallelism"),
    ({"parallelism": 2, "operator_index": 2, "max_parallelism": 4}, "operator_index"),
    ({"parallelism": 1, "operator_index": 0, "max_parallelism": 0}, "max_parallelism"),
])
def test_bad_part_coordinates_are_config_errors(tmp_path, kwargs, option):
    with pytest.raises(ConfigError, match=rf"^{option} must be"):
        write_part(tmp_path / "chk", states={}, key_groups=[], **kwargs)


# -- atomic replace -------------------------------------------------------------------------


def test_rewrite_replaces_the_part_and_removes_the_old_data_file(tmp_path):
    chk = checkpoint_path(tmp_path, 5)
    write_all(chk, 2)
    part_dir = os.path.join(chk, "part-2-0")
    old = open_checkpoint(chk).parts[0].data_file
    new = write_part(chk, parallelism=2, operator_index=0, max_parallelism=MAX_P,
                     states={"count": "value"}, key_groups=[(3, ["again"])], extra={"v": 2})
    assert new.data_file != old
    assert sorted(os.listdir(part_dir)) == sorted([MANIFEST_NAME, new.data_file])
    cp = open_checkpoint(chk)
    assert cp.parts[0].data_file == new.data_file
    assert cp.extras[0] == {"v": 2}
    got = read_all(chk)
    assert {kg: v for kg, v in got.items() if kg < 8} == {3: ["again"]}
    assert {kg for kg in got if kg >= 8} == {9, 10, 12, 13, 15}  # part 1 untouched


def test_rewrite_removes_leftovers_of_dead_attempts_once_stale(tmp_path):
    chk = checkpoint_path(tmp_path, 5)
    write_all(chk, 1)
    part_dir = os.path.join(chk, "part-1-0")
    dead = [os.path.join(part_dir, "data-deadbeef.bin"),
            os.path.join(part_dir, MANIFEST_NAME + ".tmp-deadbeef")]
    for path in dead:
        with open(path, "wb") as f:
            f.write(b"partial")
    write_all(chk, 1)  # default grace period: a young leftover may be a live attempt
    assert all(os.path.exists(p) for p in dead)
    m = write_part(chk, parallelism=1, operator_index=0, max_parallelism=MAX_P, states={},
                   key_groups=[], stale_after_s=0)
    assert sorted(os.listdir(part_dir)) == sorted([MANIFEST_NAME, m.data_file])
    assert read_all(chk) == {}


# -- completeness ---------------------------------------------------------------------------


def test_missing_part_is_named(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    write_part(chk, parallelism=3, operator_index=0, max_parallelism=MAX_P, states={},
               key_groups=[])
    write_part(chk, parallelism=3, operator_index=2, max_parallelism=MAX_P, states={},
               key_groups=[])
    with pytest.raises(CheckpointError,
                       match=r"^checkpoint '.*chk-1' is incomplete: key groups 6\.\.10 are not "
                             r"covered by any committed part; missing part part-3-1$") as exc:
        open_checkpoint(chk)
    assert exc.value.path == chk


def test_uncommitted_part_is_reported(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    write_part(chk, parallelism=2, operator_index=0, max_parallelism=MAX_P, states={},
               key_groups=[])
    os.makedirs(os.path.join(chk, "part-2-1"))
    with pytest.raises(CheckpointError,
                       match=r"key groups 8\.\.15 are not covered by any committed part; "
                             r"missing part part-2-1 \(part-2-1 never committed"):
        open_checkpoint(chk)


def test_empty_checkpoint_directory_is_rejected(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    os.makedirs(chk)
    with pytest.raises(CheckpointError, match=r"^checkpoint '.*chk-1' has no committed part"):
        open_checkpoint(chk)
    with pytest.raises(CheckpointError, match=r"^checkpoint '.*chk-9' does not exist"):
        open_checkpoint(checkpoint_path(tmp_path, 9))


def test_overlapping_parts_are_named(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    write_all(chk, 2)
    write_part(chk, parallelism=4, operator_index=1, max_parallelism=MAX_P, states={},
               key_groups=[])
    with pytest.raises(CheckpointError,
                       match=r"^checkpoint '.*chk-1' has overlapping parts: key groups 4\.\.7 "
                             r"are covered by both part-2-0 and part-4-1$"):
        open_checkpoint(chk)


def test_parts_of_two_parallelisms_that_tile_the_key_groups_are_rejected(tmp_path):
    # A run at 4 committed its last two parts and crashed; a rerun of the same id at 2
    # committed its first part only. Together they cover every key group once.
    chk = checkpoint_path(tmp_path, 1)
    for parallelism, index in [(4, 2), (4, 3), (2, 0)]:
        write_part(chk, parallelism=parallelism, operator_index=index, max_parallelism=MAX_P,
                   states={}, key_groups=[])
    with pytest.raises(CheckpointError,
                       match=r"^checkpoint '.*chk-1' mixes parts written at different "
                             r"parallelisms \(part-2-0, part-4-2, part-4-3\)") as exc:
        open_checkpoint(chk)
    assert exc.value.path == chk


@pytest.mark.parametrize("what", ["checkpoint", "manifest"])
def test_a_checkpoint_that_cannot_be_listed_or_searched_is_a_checkpoint_error(
        tmp_path, monkeypatch, what):
    """As a directory without read (list) or execute (search) permission gives: the reader
    names the path instead of letting the OSError out, and a part whose manifest cannot be
    looked at is not reported as never committed."""
    chk = checkpoint_path(tmp_path, 1)
    write_all(chk, 1)
    manifest = os.path.join(chk, "part-1-0", MANIFEST_NAME)
    real_listdir, real_lstat = os.listdir, os.lstat

    def listdir(path):
        if what == "checkpoint" and os.fspath(path) == chk:
            raise PermissionError(13, "Permission denied", path)
        return real_listdir(path)

    def lstat(path, *args, **kwargs):
        if what == "manifest" and os.fspath(path) == manifest:
            raise PermissionError(13, "Permission denied", path)
        return real_lstat(path, *args, **kwargs)

    monkeypatch.setattr(os, "listdir", listdir)
    monkeypatch.setattr(os, "lstat", lstat)
    pattern = (r"^checkpoint '.*chk-1' cannot be listed: .*Permission denied"
               if what == "checkpoint" else
               r"^checkpoint manifest '.*_MANIFEST\.json' cannot be read: .*Permission denied")
    with pytest.raises(CheckpointError, match=pattern) as exc:
        open_checkpoint(chk)
    assert exc.value.path == (chk if what == "checkpoint" else manifest)


def test_parts_with_different_max_parallelism_are_rejected(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    write_part(chk, parallelism=2, operator_index=0, max_parallelism=16, states={},
               key_groups=[])
    write_part(chk, parallelism=2, operator_index=1, max_parallelism=32, states={},
               key_groups=[])
    with pytest.raises(CheckpointError,
                       match=r"mixes parts written with different max_parallelism "
                             r"\(part-2-0: 16, part-2-1: 32\)"):
        open_checkpoint(chk)


def test_conflicting_state_kinds_across_parts_are_rejected(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    write_part(chk, parallelism=2, operator_index=0, max_parallelism=MAX_P,
               states={"s": "value"}, key_groups=[])
    write_part(chk, parallelism=2, operator_index=1, max_parallelism=MAX_P,
               states={"s": "map"}, key_groups=[])
    with pytest.raises(CheckpointError,
                       match=r"has state 's' as value state in one part and as map state in "
                             r"part-2-1"):
        open_checkpoint(chk)


def test_states_are_the_union_across_parts(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    write_part(chk, parallelism=2, operator_index=0, max_parallelism=MAX_P,
               states={"a": "value"}, key_groups=[])
    write_part(chk, parallelism=2, operator_index=1, max_parallelism=MAX_P,
               states={"a": "value", "b": "list"}, key_groups=[])
    assert open_checkpoint(chk).states == {"a": "value", "b": "list"}


# -- damage ---------------------------------------------------------------------------------


def test_bit_flip_is_detected_naming_file_and_key_group(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    write_all(chk, 2)
    part = open_checkpoint(chk).parts[1]
    entry = part.key_groups[12]
    damage(part.data_path, entry.offset + entry.size // 2)
    cp = open_checkpoint(chk)  # sizes are intact: opening succeeds
    assert read_all(chk, KeyGroupRange(0, 7))  # other key groups still read
    pattern = rf"^checksum mismatch in data file '{re.escape(part.data_path)}', key group 12"
    with pytest.raises(CheckpointError, match=pattern) as exc:
        read_all(chk, KeyGroupRange(8, 15))
    assert exc.value.path == part.data_path
    with pytest.raises(CheckpointError, match=pattern):
        cp.verify()


def test_bit_flip_in_extra_is_detected(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    write_all(chk, 1)
    part = open_checkpoint(chk).parts[0]
    damage(part.data_path, part.extra_entry.offset)
    with pytest.raises(CheckpointError, match=r"^checksum mismatch in the extra section of data "
                                              r"file '.*data-[0-9a-f]+\.bin'"):
        open_checkpoint(chk)


def test_truncated_file_is_detected_at_open_naming_file_and_key_groups(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    write_all(chk, 1)
    part = open_checkpoint(chk).parts[0]
    entry = part.key_groups[10]
    os.truncate(part.data_path, entry.offset + 3)
    with pytest.raises(CheckpointError,
                       match=rf"^data file '{re.escape(part.data_path)}' of checkpoint part "
                             rf"part-1-0 has {entry.offset + 3} bytes but its manifest expects "
                             rf"{part.data_size} .*; key groups 10, 12\.\.13, 15 are damaged$"):
        open_checkpoint(chk)


def test_truncation_after_open_is_detected_on_read(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    write_all(chk, 1)
    cp = open_checkpoint(chk)
    part = cp.parts[0]
    os.truncate(part.data_path, part.key_groups[4].offset + 1)
    with pytest.raises(CheckpointError,
                       match=rf"^data file '{re.escape(part.data_path)}' is truncated at key "
                             r"group 4"):
        list(cp.read_key_groups(KeyGroupRange(0, 15)))


def test_missing_data_file_is_named(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    write_all(chk, 1)
    part = open_checkpoint(chk).parts[0]
    os.unlink(part.data_path)
    with pytest.raises(CheckpointError,
                       match=rf"^data file '{re.escape(part.data_path)}' of checkpoint part "
                             r"part-1-0 is missing"):
        open_checkpoint(chk)


def edit_manifest(chk: str, part: str, edit=None, **changes) -> None:
    """Rewrite a part's manifest with `changes`, then `edit(manifest)` if given."""
    path = os.path.join(chk, part, MANIFEST_NAME)
    with open(path) as f:
        m = json.load(f)
    m.update(changes)
    if edit is not None:
        edit(m)
    with open(path, "w") as f:
        json.dump(m, f)


@pytest.mark.parametrize("name", ["../../evil.bin", "/etc/passwd", "..", "sub/data-x.bin",
                                  "data-x.bin/..", "", 7])
def test_manifest_naming_a_file_outside_the_part_is_rejected(tmp_path, name):
    chk = checkpoint_path(tmp_path, 1)
    write_all(chk, 1)
    edit_manifest(chk, "part-1-0", data_file=name)
    with pytest.raises(CheckpointError, match=r"names data file .*refusing to follow it$"):
        open_checkpoint(chk)


@pytest.mark.parametrize("sibling", [False, True], ids=["outside", "longer-named-sibling"])
def test_symlinked_data_file_leading_outside_is_rejected(tmp_path, sibling):
    chk = checkpoint_path(tmp_path, 1)
    write_all(chk, 1)
    part = open_checkpoint(chk).parts[0]
    if sibling:  # "part-1-0-x" starts with "part-1-0"
        os.makedirs(part.path + "-x")
        outside = os.path.join(part.path + "-x", part.data_file)
    else:
        outside = str(tmp_path / "outside.bin")
    os.replace(part.data_path, outside)
    os.symlink(outside, part.data_path)
    with pytest.raises(CheckpointError, match=r"resolves outside its part directory"):
        open_checkpoint(chk)


@pytest.mark.parametrize("sibling", [False, True], ids=["outside", "longer-named-sibling"])
def test_symlinked_part_directory_leading_outside_is_rejected(tmp_path, sibling):
    chk = checkpoint_path(tmp_path, 1)
    write_all(chk, 1)
    if sibling:  # "chk-10" starts with "chk-1"
        os.makedirs(checkpoint_path(tmp_path, 10))
        elsewhere = os.path.join(checkpoint_path(tmp_path, 10), "part-1-0")
    else:
        elsewhere = str(tmp_path / "elsewhere")
    os.replace(os.path.join(chk, "part-1-0"), elsewhere)
    os.symlink(elsewhere, os.path.join(chk, "part-1-0"))
    with pytest.raises(CheckpointError, match=r"resolves outside the checkpoint directory"):
        open_checkpoint(chk)


@pytest.mark.parametrize(("changes", "pattern"), [
    ({"format_version": 2}, r"has format version 2; this asyncstate reads version 1 only"),
    ({"format": "pickle"}, r"is not an asyncstate checkpoint manifest"),
    ({"operator_index": 1}, r"describes parallelism 1 and operator index 1, which do not match "
                            r"its directory part-1-0"),
    ({"key_group_range": [0, 3]}, r"claims key groups \[0, 3\], but operator 0 of 1 owns "
                                  r"0\.\.15"),
    ({"key_groups": [{"key_group": 99, "offset": 8, "size": 1, "records": 1, "crc32": 0}]},
     r"lists key group 99 twice or outside its range"),
    ({"key_groups": [{"key_group": 1, "offset": 8, "size": 10**9, "records": 1, "crc32": 0}]},
     r"has an invalid 'size'"),
    ({"states": ["x"]}, r"has invalid states"),
    ({"states": {"": "value"}}, r"has invalid states: \{'': 'value'\}"),
    ({"states": {"v": 1}}, r"has invalid states"),
])
def test_invalid_manifest_fields_are_rejected(tmp_path, changes, pattern):
    chk = checkpoint_path(tmp_path, 1)
    write_all(chk, 1)
    edit_manifest(chk, "part-1-0", **changes)
    with pytest.raises(CheckpointError, match=r"^checkpoint manifest '.*_MANIFEST\.json' "
                                              + pattern):
        open_checkpoint(chk)


def test_unparsable_manifest_is_rejected(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    write_all(chk, 1)
    with open(os.path.join(chk, "part-1-0", MANIFEST_NAME), "w") as f:
        f.write('{"format": ')
    with pytest.raises(CheckpointError, match=r"^checkpoint manifest .* cannot be read"):
        open_checkpoint(chk)


def test_restore_never_unpickles(tmp_path):
    """Records and extra are msgpack: an ext type (where a pickle could hide) stays opaque."""
    chk = checkpoint_path(tmp_path, 1)
    payload = msgpack.ExtType(42, b"cos\nsystem\n(S'echo pwned'\ntR.")
    write_part(chk, parallelism=1, operator_index=0, max_parallelism=2, states={},
               key_groups=[(0, [payload])], extra={"x": payload})
    assert read_all(chk) == {0: [payload]}
    assert open_checkpoint(chk).extras == [{"x": payload}]
