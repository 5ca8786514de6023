"""The checkpoint reader (`open_checkpoint`): which parts make a checkpoint, the manifest's
fields and their checks, paths that lead outside the checkpoint, and records that must
never unpickle."""

from __future__ import annotations

import os
import pickle
import shutil
from typing import Any

import msgpack
import pytest
from checkpoint_files import (
    edit_manifest,
    entry,
    read_all,
    simple_part,
    write_all,
    write_one_part,
    write_simple,
)

import asyncstate as ast
from asyncstate.backends.heap import HeapBackend
from asyncstate.checkpoint.format import (
    MANIFEST_NAME,
    checkpoint_path,
    open_checkpoint,
    write_part,
)
from asyncstate.checkpoint.snapshot import restore_snapshot
from asyncstate.checkpoint.writer import remove_superseded_parts
from asyncstate.errors import CheckpointError
from asyncstate.keygroups import KeyGroupRange

MAX_P = 16


def test_manifest_listing_one_key_group_twice_identically_is_refused(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    write_simple(chk)
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
    chk, part = simple_part(tmp_path)
    with open(part.data_path, "ab") as f:
        f.write(b"\x00")
    with pytest.raises(CheckpointError, match=rf"has {part.data_size + 1} bytes but its "
                                              rf"manifest expects {part.data_size}"):
        open_checkpoint(chk)


@pytest.mark.parametrize("tag", [0, 7])
def test_section_header_counting_one_record_more_than_the_stream_holds_is_refused(
        tmp_path, tag):
    chk = checkpoint_path(tmp_path, 1)
    kg = ast.assign_to_key_group("k", MAX_P)
    write_one_part(chk, [(kg, [[tag, 2], entry("k", msgpack.packb(1))])])
    seen: list[Any] = []
    with pytest.raises(CheckpointError, match=rf"key group {kg} of data file .*malformed "
                                              r"section header"):
        restore_snapshot(HeapBackend(), open_checkpoint(chk), KeyGroupRange(0, MAX_P - 1),
                         MAX_P, section_handlers={7: lambda k, records: seen.append(records)})
    assert seen == []


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
    # No parallelism's parts are complete: part-2-1 and part-4-0 never committed.
    chk = checkpoint_path(tmp_path, 1)
    for parallelism, index in [(2, 0), (4, 1)]:
        write_part(chk, parallelism=parallelism, operator_index=index, max_parallelism=MAX_P,
                   states={}, key_groups=[])
    with pytest.raises(CheckpointError,
                       match=r"^checkpoint '.*chk-1' has overlapping parts: key groups 4\.\.7 "
                             r"are covered by both part-2-0 and part-4-1$"):
        open_checkpoint(chk)


def test_parts_of_two_parallelisms_that_cover_every_key_group_once_are_a_checkpoint(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    expected: dict[int, list[object]] = {}
    for parallelism, index in [(4, 2), (4, 3), (2, 0)]:
        kgs = ast.compute_key_group_range_for_operator_index(MAX_P, parallelism, index)
        groups = [(kg, [[parallelism, index, kg]]) for kg in kgs]
        expected.update(groups)
        write_part(chk, parallelism=parallelism, operator_index=index, max_parallelism=MAX_P,
                   states={"s": "value"}, key_groups=groups)
    checkpoint = open_checkpoint(chk)
    assert [p.name for p in checkpoint.parts] == ["part-2-0", "part-4-2", "part-4-3"]
    assert checkpoint.superseded == ()
    assert read_all(chk) == expected


def _commit_times(chk: str, clock: str, **seconds: int) -> None:
    """Set when parts (by name, "_" for "-") were committed: by the writer's clock in the
    manifest, or, for a manifest without it, by the manifest's mtime."""
    for name, at in seconds.items():
        part = name.replace("_", "-")
        if clock == "writer":
            edit_manifest(chk, part, written_at=at + 0.5)
        else:
            edit_manifest(chk, part, lambda m: m.pop("written_at", None))
            os.utime(os.path.join(chk, part, MANIFEST_NAME), (at, at))


@pytest.mark.parametrize("clock", ["writer", "mtime"])
def test_a_checkpoint_written_again_at_another_parallelism_is_the_newer_run(tmp_path, clock):
    chk = checkpoint_path(tmp_path, 1)
    old = write_all(chk, 2)
    new = {kg: [["new", kg]] for kg in range(MAX_P)}
    for index in range(4):
        kgs = ast.compute_key_group_range_for_operator_index(MAX_P, 4, index)
        write_part(chk, parallelism=4, operator_index=index, max_parallelism=MAX_P,
                   states={"count": "value"}, key_groups=[(kg, new[kg]) for kg in kgs])
    _commit_times(chk, clock, part_2_0=100, part_2_1=101, part_4_0=200, part_4_1=201,
                  part_4_2=202, part_4_3=203)
    checkpoint = open_checkpoint(chk)
    assert [p.name for p in checkpoint.parts] == [f"part-4-{i}" for i in range(4)]
    assert checkpoint.superseded == ("part-2-0", "part-2-1")
    assert read_all(chk) == new
    # The run at 2 written again, later: it is the checkpoint again (its newest part counts).
    _commit_times(chk, clock, part_2_0=150, part_2_1=300)
    assert [p.name for p in open_checkpoint(chk).parts] == ["part-2-0", "part-2-1"]
    assert read_all(chk) == old


def test_a_rewrite_at_another_parallelism_that_did_not_finish_leaves_the_checkpoint_before(
        tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    old = write_all(chk, 4)
    # The rewrite at 2 committed its first part, then crashed (or is still writing).
    write_part(chk, parallelism=2, operator_index=0, max_parallelism=MAX_P,
               states={"count": "value"}, key_groups=[(0, [["new"]])])
    os.makedirs(os.path.join(chk, "part-2-1"))  # never committed
    checkpoint = open_checkpoint(chk)
    assert [p.name for p in checkpoint.parts] == [f"part-4-{i}" for i in range(4)]
    assert checkpoint.superseded == ("part-2-0",)
    assert read_all(chk) == old


def test_remove_superseded_parts_keeps_the_runs_parallelism_and_removes_manifests_first(
        tmp_path, monkeypatch):
    chk = checkpoint_path(tmp_path, 1)
    write_all(chk, 2)
    new = write_all(chk, 3)
    removed_first: list[str] = []
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        # By the time a part directory goes, its manifest is gone: never committed.
        removed_first.append(os.path.basename(path))
        assert not os.path.exists(os.path.join(path, MANIFEST_NAME))
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    assert remove_superseded_parts(chk, 3) == ["part-2-0", "part-2-1"]
    assert removed_first == ["part-2-0", "part-2-1"]
    assert sorted(os.listdir(chk)) == ["part-3-0", "part-3-1", "part-3-2"]
    assert open_checkpoint(chk).superseded == ()
    assert read_all(chk) == new


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


def test_restore_of_crafted_ext_types_never_unpickles(tmp_path, monkeypatch):
    chk = checkpoint_path(tmp_path, 1)
    evil = pickle.dumps(os.system)  # what a pickle-based reader would turn into code
    ext = msgpack.ExtType(1, evil)
    write_part(chk, parallelism=1, operator_index=0, max_parallelism=MAX_P,
               states={"v": "value"}, key_groups=[(3, [ext, [ext, {"p": ext}]])],
               extra={"evil": ext, "raw": evil})

    def refuse(*args, **kwargs):
        raise AssertionError("pickle used during restore")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    cp = open_checkpoint(chk)
    cp.verify()
    assert cp.extras == [{"evil": ext, "raw": evil}]
    (got,) = list(cp.read_key_group_lists(KeyGroupRange(0, MAX_P - 1)))
    assert got == (3, [ext, [ext, {"p": ext}]])
    assert type(got[1][0]) is msgpack.ExtType


def test_a_part_copied_in_from_another_checkpoint_is_refused(tmp_path):
    for i in (1, 2):
        for index in range(2):
            write_part(checkpoint_path(tmp_path, i), parallelism=2, operator_index=index,
                       max_parallelism=MAX_P, states={}, key_groups=[])
    chk2 = checkpoint_path(tmp_path, 2)
    assert open_checkpoint(chk2)  # whole, and a renamed copy of it too
    shutil.copytree(chk2, tmp_path / "backup")
    assert open_checkpoint(tmp_path / "backup")
    shutil.rmtree(os.path.join(chk2, "part-2-0"))
    shutil.copytree(os.path.join(checkpoint_path(tmp_path, 1), "part-2-0"),
                    os.path.join(chk2, "part-2-0"))
    with pytest.raises(CheckpointError, match=r"holds parts written into different "
                                              r"checkpoints \(part-2-0 into 'chk-1', "
                                              r"part-2-1 into 'chk-2'\)"):
        open_checkpoint(chk2)


def test_a_manifest_without_the_checkpoint_field_is_read(tmp_path):
    # Parts written before manifests named their checkpoint directory.
    chk = checkpoint_path(tmp_path, 1)
    write_simple(chk)
    edit_manifest(chk, "part-1-0", lambda m: m.pop("checkpoint"))
    assert open_checkpoint(chk).parts[0].checkpoint is None


@pytest.mark.parametrize(("field", "value", "pattern"), [
    ("checksum", "sha256", r"uses checksum 'sha256'; this asyncstate reads 'crc32' only"),
    ("checkpoint", 5, r"has an invalid 'checkpoint': 5"),
])
def test_manifest_checksum_and_checkpoint_fields_are_checked(tmp_path, field, value, pattern):
    chk = checkpoint_path(tmp_path, 1)
    write_simple(chk)
    edit_manifest(chk, "part-1-0", **{field: value})
    with pytest.raises(CheckpointError, match=pattern):
        open_checkpoint(chk)
