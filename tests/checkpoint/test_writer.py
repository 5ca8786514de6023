"""The checkpoint writer (`write_part`): what it refuses before committing, failures midway
that keep the previous part, rewrites and the cleanup of dead attempts, and the fields the
manifest records."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import msgpack
import pytest
from checkpoint_files import (
    committed,
    edit_manifest,
    part_files,
    read_all,
    read_consistent,
    write_all,
    write_attempt,
    write_one_part,
    write_simple,
)

import asyncstate as ast
from asyncstate.checkpoint.format import (
    MANIFEST_NAME,
    PackedRecords,
    checkpoint_path,
    open_checkpoint,
    write_part,
)
from asyncstate.checkpoint.writer import _CHUNK_RECORDS
from asyncstate.errors import CheckpointError, ConfigError
from asyncstate.keygroups import KeyGroupRange
from asyncstate.runtime.requests import StateKind

MAX_P = 16


@pytest.mark.parametrize("bad", [True, False, -1, float("inf"), float("nan"), "1"])
def test_write_part_refuses_a_bad_stale_after_s_and_writes_nothing(tmp_path, bad):
    chk = checkpoint_path(tmp_path, 1)
    with pytest.raises(ast.ConfigError, match=r"stale_after_s"):
        write_part(chk, parallelism=1, operator_index=0, max_parallelism=MAX_P, states={},
                   key_groups=[], stale_after_s=bad)
    assert not os.path.exists(chk)


@pytest.mark.parametrize("bad", [2**64, -(2**63) - 1])
def test_record_with_an_int_msgpack_cannot_hold_is_a_checkpoint_error(tmp_path, bad):
    chk = checkpoint_path(tmp_path, 1)
    write_simple(chk)
    with pytest.raises(CheckpointError, match=r"a record of key group 3 in checkpoint part "
                                              r"part-1-0 cannot be encoded with msgpack"):
        write_one_part(chk, [(3, [[1, 2], [bad]])])
    cp = open_checkpoint(chk)  # the previous part is intact, and nothing is left over
    assert sorted(os.listdir(cp.parts[0].path)) == sorted([MANIFEST_NAME, cp.parts[0].data_file])


@pytest.mark.parametrize("name", ["../victim.bin", "../../victim.bin", "victim.bin"])
def test_rewrite_never_deletes_a_file_a_damaged_manifest_names_outside_the_pattern(
        tmp_path, name):
    chk = checkpoint_path(tmp_path, 1)
    write_simple(chk)
    part_dir = os.path.join(chk, "part-1-0")
    victim = os.path.normpath(os.path.join(part_dir, name))
    with open(victim, "wb") as f:
        f.write(b"keep me")
    edit_manifest(chk, "part-1-0", data_file=name)
    write_simple(chk)  # replaces the damaged manifest
    with open(victim, "rb") as f:
        assert f.read() == b"keep me"
    open_checkpoint(chk).verify()


def test_writer_skips_empty_key_groups_and_ends_one_on_a_chunk_boundary(tmp_path: Any) -> None:
    path = checkpoint_path(tmp_path, 1)
    written = write_part(path, parallelism=1, operator_index=0, max_parallelism=4, states={},
                         key_groups=[(0, []), (1, iter(())), (2, range(_CHUNK_RECORDS)),
                                     (3, range(2 * _CHUNK_RECORDS))])
    assert sorted(written.key_groups) == [2, 3]
    cp = open_checkpoint(path)
    got = {kg: list(records) for kg, records in cp.read_key_groups(KeyGroupRange(0, 3))}
    assert got == {2: list(range(_CHUNK_RECORDS)), 3: list(range(2 * _CHUNK_RECORDS))}


@pytest.mark.parametrize(("name", "kind"), [("count", StateKind.VALUE), (1, "value"),
                                            ("count", None), ("", "value")])
def test_states_not_mapping_str_to_str_are_a_type_error_and_write_nothing(
        tmp_path: Any, name: Any, kind: Any) -> None:
    path = checkpoint_path(tmp_path, 1)
    with pytest.raises(TypeError, match=rf"^states must map non-empty str names to str kinds, "
                                        rf"got {re.escape(repr(name))}: "
                                        rf"{re.escape(repr(kind))}$"):
        write_part(path, parallelism=1, operator_index=0, max_parallelism=4,
                   states={name: kind}, key_groups=[])
    assert not os.path.exists(path)


def test_a_state_of_an_unknown_kind_is_refused_before_commit(tmp_path: Any) -> None:
    """The reader would refuse the part at restore: the writer refuses it first, and the
    part in place stays."""
    path = checkpoint_path(tmp_path, 1)
    write_part(path, parallelism=1, operator_index=0, max_parallelism=4,
               states={"count": "value"}, key_groups=[])
    with pytest.raises(ValueError, match=r"^state 'count' has the unknown kind 'bogus' \(want "
                                         r"one of aggregating, list, map, reducing, value\)$"):
        write_part(path, parallelism=1, operator_index=0, max_parallelism=4,
                   states={"count": "bogus"}, key_groups=[])
    assert open_checkpoint(path).states == {"count": "value"}


def test_cleanup_that_cannot_list_the_part_directory_still_commits(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path = checkpoint_path(tmp_path, 1)
    part_dir = os.path.join(path, "part-1-0")
    write_part(path, parallelism=1, operator_index=0, max_parallelism=4, states={},
               key_groups=[], extra={"v": 1})
    leftover = os.path.join(part_dir, "data-dead.bin")
    with open(leftover, "wb") as f:
        f.write(b"partial")
    listdir = os.listdir

    def unlistable(p: Any = ".") -> list[str]:
        if os.fspath(p) == part_dir:
            raise PermissionError(13, "Permission denied", part_dir)
        return listdir(p)

    with monkeypatch.context() as patch:
        patch.setattr(os, "listdir", unlistable)
        written = write_part(path, parallelism=1, operator_index=0, max_parallelism=4,
                             states={}, key_groups=[(1, ["x"])], extra={"v": 2},
                             stale_after_s=0)
    cp = open_checkpoint(path)  # the rename committed; only the cleanup was skipped
    assert cp.extras == [{"v": 2}]
    assert cp.parts[0].data_file == written.data_file
    assert os.path.exists(leftover)


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


HOUR = 3600.0


def age(path: str, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_stale_leftovers_go_young_ones_and_foreign_files_stay(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    write_attempt(chk, 0, 0)
    part_dir = os.path.join(chk, "part-1-0")
    live_before = committed(part_dir)["data_file"]
    files = {
        "old_data": "data-0123abcd.bin", "old_tmp": MANIFEST_NAME + ".tmp-0123abcd",
        "young_data": "data-feedface.bin", "young_tmp": MANIFEST_NAME + ".tmp-feedface",
        "foreign": "notes.txt", "near_miss": "data-x.bin.bak", "bad_name": "data-a.b.bin",
    }
    for name in files.values():
        with open(os.path.join(part_dir, name), "wb") as f:
            f.write(b"partial")
    for key in ("old_data", "old_tmp", "foreign", "near_miss", "bad_name"):
        age(os.path.join(part_dir, files[key]), HOUR)
    age(os.path.join(part_dir, live_before), HOUR)  # an old live file is still replaced only
    write_attempt(chk, 0, 1)
    live = committed(part_dir)["data_file"]
    assert part_files(part_dir) == sorted([
        MANIFEST_NAME, live, files["young_data"], files["young_tmp"], files["foreign"],
        files["near_miss"], files["bad_name"]])
    assert read_consistent(chk) == (0, 1)


def test_failed_write_deletes_only_its_own_files(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    write_attempt(chk, 0, 0)
    part_dir = os.path.join(chk, "part-1-0")
    dead = os.path.join(part_dir, "data-0123abcd.bin")
    with open(dead, "wb") as f:
        f.write(b"partial")
    age(dead, HOUR)
    age(os.path.join(part_dir, committed(part_dir)["data_file"]), HOUR)
    before = part_files(part_dir)
    with pytest.raises(CheckpointError):
        write_part(chk, parallelism=1, operator_index=0, max_parallelism=MAX_P, states={},
                   key_groups=[(0, [1]), (MAX_P, [2])], stale_after_s=0)
    assert part_files(part_dir) == before
    assert read_consistent(chk) == (0, 0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage", ["fifo", "nested", "directory-data-file"])
def test_a_damaged_manifest_in_place_is_replaced_by_the_next_write(tmp_path, damage):
    """The writer reads the manifest it replaces (to delete its data file afterwards): a
    FIFO there must not block it, and no damage may keep the part from being rewritten."""
    chk = checkpoint_path(tmp_path, 1)
    write_attempt(chk, 0, 0)
    manifest = os.path.join(chk, "part-1-0", MANIFEST_NAME)
    os.unlink(manifest)
    if damage == "fifo":
        os.mkfifo(manifest)
    elif damage == "nested":
        with open(manifest, "w") as f:
            f.write("[" * 100_000 + "]" * 100_000)
    else:
        with open(manifest, "w") as f:
            json.dump({"data_file": "../../x"}, f)
    errors: list[BaseException] = []

    def write() -> None:
        try:
            write_attempt(chk, 1, 1)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    thread.join(HOUR if damage != "fifo" else 30)
    if thread.is_alive():  # blocked opening the FIFO: give it a writer, then fail
        os.close(os.open(manifest, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(HOUR)
        pytest.fail("write_part blocked on a FIFO in place of the manifest")
    assert errors == []
    assert read_consistent(chk) == (1, 1)


def test_rewriting_one_part_leaves_the_files_of_other_parts_alone(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    for i in range(2):
        write_part(chk, parallelism=2, operator_index=i, max_parallelism=MAX_P, states={},
                   key_groups=[], extra={"i": i})
    other = os.path.join(chk, "part-2-1")
    for name in os.listdir(other):
        age(os.path.join(other, name), HOUR)
    before = part_files(other)
    write_part(chk, parallelism=2, operator_index=0, max_parallelism=MAX_P, states={},
               key_groups=[], extra={"i": 0}, stale_after_s=0)
    assert part_files(other) == before
    assert open_checkpoint(chk).extras == [{"i": 0}, {"i": 1}]


def test_checkpoint_directory_that_is_a_file_fails_without_touching_it(tmp_path):
    chk = tmp_path / "chk-1"
    chk.write_bytes(b"not a directory")
    with pytest.raises(CheckpointError, match=r"^checkpoint part part-1-0 cannot be written: "
                       ) as exc:
        write_attempt(str(chk), 0, 0)
    assert isinstance(exc.value.__cause__, NotADirectoryError)
    assert exc.value.path == os.path.join(str(chk), "part-1-0")
    assert chk.read_bytes() == b"not a directory"
    with pytest.raises(CheckpointError, match="does not exist or is not a directory"):
        open_checkpoint(chk)


def test_part_directory_that_is_a_file_fails_without_touching_it(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    os.makedirs(chk)
    part = os.path.join(chk, "part-1-0")
    with open(part, "wb") as f:
        f.write(b"x")
    with pytest.raises(CheckpointError, match=r"^checkpoint part part-1-0 cannot be written: "
                       ) as exc:
        write_attempt(chk, 0, 0)
    assert isinstance(exc.value.__cause__, NotADirectoryError)
    with open(part, "rb") as f:
        assert f.read() == b"x"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root bypasses directory permissions")
def test_checkpoint_directory_without_write_permission(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    write_attempt(chk, 0, 0)
    part_dir = os.path.join(chk, "part-1-0")
    os.chmod(part_dir, 0o555)
    try:
        with pytest.raises(CheckpointError, match="cannot be written") as exc:
            write_attempt(chk, 0, 1)
        assert isinstance(exc.value.__cause__, PermissionError)
    finally:
        os.chmod(part_dir, 0o755)
    assert read_consistent(chk) == (0, 0)


def test_part_directory_refusing_new_files_keeps_the_previous_part(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above with the refusal injected, so that it also runs as root."""
    from asyncstate.checkpoint import writer

    chk = checkpoint_path(tmp_path, 1)
    write_attempt(chk, 0, 0)
    part_dir = os.path.join(chk, "part-1-0")
    before = sorted(os.listdir(part_dir))

    def refusing_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if "x" in mode and os.path.dirname(os.fspath(path)) == part_dir:
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(writer, "open", refusing_open, raising=False)
    with pytest.raises(CheckpointError, match="cannot be written") as exc:
        write_attempt(chk, 0, 1)
    assert isinstance(exc.value.__cause__, PermissionError)
    monkeypatch.undo()
    assert read_consistent(chk) == (0, 0)
    assert sorted(os.listdir(part_dir)) == before  # nothing left behind


def big_records(kg: int, bad_at: int | None = None):
    for j in range(20_000):  # spans several packer chunks and spills the write buffer
        yield object() if j == bad_at else [kg, j, b"y" * 64]


def test_unencodable_record_deep_in_a_big_key_group_keeps_the_previous_part(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    write_attempt(chk, 0, 0)
    part_dir = os.path.join(chk, "part-1-0")
    before = part_files(part_dir)
    with pytest.raises(CheckpointError, match=r"key group 5 in checkpoint part part-1-0 "
                                              r"cannot be encoded"):
        write_part(chk, parallelism=1, operator_index=0, max_parallelism=MAX_P, states={},
                   key_groups=[(4, big_records(4)), (5, big_records(5, bad_at=17_000))])
    assert part_files(part_dir) == before
    assert read_consistent(chk) == (0, 0)


@pytest.mark.parametrize("exc", [RuntimeError("backend died"), KeyboardInterrupt(),
                                 OSError(28, "No space left on device")])
def test_exception_from_the_key_group_source_keeps_the_previous_part(tmp_path, exc):
    chk = checkpoint_path(tmp_path, 1)
    write_attempt(chk, 0, 0)
    part_dir = os.path.join(chk, "part-1-0")
    before = part_files(part_dir)

    def groups():
        yield 0, big_records(0)
        yield 1, [1]
        raise exc

    with pytest.raises(type(exc)):
        write_part(chk, parallelism=1, operator_index=0, max_parallelism=MAX_P, states={},
                   key_groups=groups())
    assert part_files(part_dir) == before
    assert read_consistent(chk) == (0, 0)


_FILE_TOO_LARGE = textwrap.dedent("""
    import os, resource, signal, sys
    from asyncstate.checkpoint.format import write_part
    from asyncstate.errors import CheckpointError
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, resource.RLIM_INFINITY))
    try:
        write_part(sys.argv[1], parallelism=1, operator_index=0, max_parallelism=8,
                   states={}, key_groups=[(kg, [b"y" * 1000] * 100) for kg in range(8)],
                   stale_after_s=0)
    except CheckpointError as exc:
        print(type(exc.__cause__).__name__, exc.__cause__.errno, exc.path)
        print(exc)
""")


def test_write_failing_midway_is_a_checkpoint_error_naming_the_data_file(tmp_path):
    """A data file that cannot grow (the file size limit stands in for a full disk): the
    OSError becomes a CheckpointError naming the file, the previous part stays and the
    failed attempt's file is removed."""
    chk = checkpoint_path(tmp_path, 1)
    write_attempt(chk, 0, 0)
    part_dir = os.path.join(chk, "part-1-0")
    before = part_files(part_dir)
    out = subprocess.run([sys.executable, "-c", _FILE_TOO_LARGE, chk],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    first, message = out.splitlines()
    cause, errno_, path = first.split(" ")
    assert (cause, int(errno_)) == ("OSError", 27)  # EFBIG
    assert os.path.dirname(path) == part_dir
    assert re.fullmatch(r"data-[0-9a-f]{32}\.bin", os.path.basename(path))
    assert message.startswith(f"checkpoint part part-1-0 cannot be written: {path!r}: ")
    assert part_files(part_dir) == before
    assert read_consistent(chk) == (0, 0)


def test_exception_from_a_record_iterator_of_a_new_part_leaves_no_file(tmp_path):
    chk = checkpoint_path(tmp_path, 1)

    def records():
        yield from big_records(2)
        raise RuntimeError("gone")

    with pytest.raises(RuntimeError, match="gone"):
        write_part(chk, parallelism=1, operator_index=0, max_parallelism=MAX_P, states={},
                   key_groups=[(2, records())])
    assert part_files(os.path.join(chk, "part-1-0")) == []
    with pytest.raises(CheckpointError, match="never committed"):
        open_checkpoint(chk)


def test_unencodable_extra_fails_before_any_file_is_created(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    with pytest.raises(CheckpointError, match=r"extra of checkpoint part .* cannot be encoded"):
        write_part(chk, parallelism=1, operator_index=0, max_parallelism=MAX_P, states={},
                   key_groups=[], extra={"x": {1, 2}})
    assert not os.path.exists(chk)


def test_extra_that_cannot_be_read_back_is_refused_before_commit(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    write_attempt(chk, 0, 0)
    with pytest.raises(CheckpointError):
        write_part(chk, parallelism=1, operator_index=0, max_parallelism=MAX_P, states={},
                   key_groups=[], extra={"offsets": {(0, "topic"): 5}})
    assert read_consistent(chk) == (0, 0)


def test_inconsistent_packed_records_do_not_replace_a_good_part(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    write_attempt(chk, 0, 0)
    packed = msgpack.packb([1, 2])
    try:
        write_part(chk, parallelism=1, operator_index=0, max_parallelism=MAX_P, states={},
                   key_groups=[(0, PackedRecords(0, packed)), (1, [["kg1"]])])
    except CheckpointError:
        assert read_consistent(chk) == (0, 0)  # refused: the previous part must be intact
    else:  # accepted: then what was committed must read back
        cp = open_checkpoint(chk)
        cp.verify()
        assert dict(cp.read_key_group_lists(KeyGroupRange(1, 1))) == {1: [["kg1"]]}


def test_value_error_from_the_record_source_is_not_reported_as_an_encoding_failure(tmp_path):
    chk = checkpoint_path(tmp_path, 1)

    def records():
        yield [1]
        raise ValueError("I/O operation on closed database")

    with pytest.raises(ValueError, match="closed database") as info:
        write_part(chk, parallelism=1, operator_index=0, max_parallelism=MAX_P, states={},
                   key_groups=[(0, records())])
    assert "cannot be encoded" not in str(info.value)


def test_bad_stale_after_s_is_refused_before_commit(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    write_attempt(chk, 0, 0)
    part_dir = os.path.join(chk, "part-1-0")
    with open(os.path.join(part_dir, "data-0123abcd.bin"), "wb") as f:
        f.write(b"leftover")
    with pytest.raises(ast.ConfigError, match=r"^stale_after_s must be a finite number of "
                                              r"seconds >= 0, got None$"):
        write_attempt(chk, 0, 1, stale_after_s=None)
    assert read_consistent(chk) == (0, 0)  # a refused write must not have committed


def test_attempt_and_written_at_fields(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    part_dir = os.path.join(chk, "part-1-0")
    seen = []
    for n in range(3):
        before = time.time()
        m = write_part(chk, parallelism=1, operator_index=0, max_parallelism=MAX_P, states={},
                       key_groups=[(n, [n])])
        after = time.time()
        manifest = committed(part_dir)
        assert re.fullmatch(r"[0-9a-f]{32}", manifest["attempt"])
        assert manifest["attempt"] == m.attempt
        assert manifest["data_file"] == m.data_file == f"data-{m.attempt}.bin"
        assert type(manifest["written_at"]) is float
        assert before <= manifest["written_at"] <= after
        assert open_checkpoint(chk).parts[0].attempt == m.attempt
        seen.append((manifest["attempt"], manifest["written_at"]))
    assert len({a for a, _ in seen}) == 3
    assert [t for _, t in seen] == sorted(t for _, t in seen)
