"""Adversarial tests of the checkpoint writer (`write_part`, `write_snapshot`).

Concurrent writers of one part (threads and processes) with a reader in the loop, stale
leftovers, edge ids and paths, failures midway, and the fields the manifest records.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import msgpack
import pytest

from asyncstate.checkpoint import writer
from asyncstate.checkpoint.format import (
    MANIFEST_NAME,
    PackedRecords,
    checkpoint_path,
    open_checkpoint,
    write_part,
)
from asyncstate.checkpoint.snapshot import restore_snapshot, write_snapshot
from asyncstate.errors import CheckpointError, ConfigError
from asyncstate.keygroups import KeyGroupRange
from asyncstate.runtime.requests import StateKind

MAX_P = 8
HOUR = 3600.0


def attempt_records(writer: int, n: int, kg: int) -> list[list[int]]:
    return [[writer, n, kg, j] for j in range(1 + (n + kg) % 5)]


def write_attempt(chk: str, writer: int, n: int, **kwargs) -> None:
    write_part(chk, parallelism=1, operator_index=0, max_parallelism=MAX_P,
               states={"s": "value"},
               key_groups=[(kg, attempt_records(writer, n, kg)) for kg in range(MAX_P)],
               extra={"writer": writer, "n": n}, **kwargs)


def read_consistent(chk: str) -> tuple[int, int]:
    """Open, verify and read the checkpoint; assert every record belongs to the attempt its
    extra names. Returns (writer, n)."""
    cp = open_checkpoint(chk)
    cp.verify()
    (extra,) = cp.extras
    w, n = extra["writer"], extra["n"]
    got = {kg: list(recs) for kg, recs in cp.read_key_groups(KeyGroupRange(0, MAX_P - 1))}
    assert got == {kg: attempt_records(w, n, kg) for kg in range(MAX_P)}, (w, n)
    return w, n


def part_files(part_dir: str) -> list[str]:
    return sorted(os.listdir(part_dir))


def committed(part_dir: str) -> dict:
    with open(os.path.join(part_dir, MANIFEST_NAME), "rb") as f:
        return json.loads(f.read())


def assert_one_complete_attempt(chk: str) -> None:
    part_dir = os.path.join(chk, "part-1-0")
    names = part_files(part_dir)
    live = committed(part_dir)["data_file"]
    assert live in names
    # Every other file is a data file of a finished attempt (orphaned by the race, young,
    # so kept by the grace period): no temp manifest survives a finished writer.
    assert all(re.fullmatch(r"data-[0-9a-f]{32}\.bin", n) for n in names if n != MANIFEST_NAME)
    read_consistent(chk)


# -- concurrent writers -------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_two_threads_writing_the_same_new_part_with_a_reader_in_the_loop(tmp_path):
    chk = checkpoint_path(tmp_path, 3)
    rounds = 40
    barrier = threading.Barrier(3)
    errors: list[BaseException] = []
    done = threading.Event()
    outcomes = {"ok": 0, "refused": 0}

    def writer(w: int) -> None:
        try:
            barrier.wait()
            for n in range(rounds):
                write_attempt(chk, w, n)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def reader() -> None:
        barrier.wait()
        while not done.is_set():
            try:
                read_consistent(chk)
                outcomes["ok"] += 1
            except CheckpointError:
                outcomes["refused"] += 1
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
                return

    threads = [threading.Thread(target=writer, args=(w,)) for w in (1, 2)]
    rt = threading.Thread(target=reader)
    for t in [*threads, rt]:
        t.start()
    for t in threads:
        t.join(50)
    done.set()
    rt.join(10)
    assert not errors, errors
    assert outcomes["ok"] > 0, outcomes
    assert_one_complete_attempt(chk)


CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[4])
    from test_writer_adversarial import write_attempt
    chk, writer, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    for n in range(rounds):
        write_attempt(chk, writer, n)
""")


@pytest.mark.timeout(60)
def test_two_processes_rewriting_one_part_while_a_reader_opens_it(tmp_path):
    chk = checkpoint_path(tmp_path, 4)
    write_attempt(chk, 0, 0)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    here = os.path.dirname(os.path.abspath(__file__))
    procs = [subprocess.Popen([sys.executable, str(script), chk, str(w), "60", here],
                              stderr=subprocess.PIPE, cwd=os.getcwd()) for w in (1, 2)]
    seen: set[tuple[int, int]] = set()
    refused = 0
    try:
        while any(p.poll() is None for p in procs):
            try:
                seen.add(read_consistent(chk))
            except CheckpointError:
                refused += 1  # the part was replaced between two reads: a clean refusal
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(30)
    for p in procs:
        err = p.stderr.read().decode()
        p.stderr.close()
        assert p.returncode == 0, err
    assert len(seen) >= 2, (seen, refused)  # the reader saw several committed attempts
    assert_one_complete_attempt(chk)
    w, _n = read_consistent(chk)
    assert w in (1, 2)


@pytest.mark.timeout(60)
def test_concurrent_writers_never_delete_the_file_of_the_manifest_in_place(tmp_path):
    """After every write by either thread, the manifest in place names an existing file."""
    chk = checkpoint_path(tmp_path, 5)
    write_attempt(chk, 0, 0)
    part_dir = os.path.join(chk, "part-1-0")
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            barrier.wait()
            for n in range(40):
                write_attempt(chk, w, n)
                live = committed(part_dir)["data_file"]
                # a later commit may have replaced it meanwhile; then the new one must exist
                assert (os.path.exists(os.path.join(part_dir, live))
                        or committed(part_dir)["data_file"] != live)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    assert not errors, errors
    assert_one_complete_attempt(chk)


# -- stale leftovers -------------------------------------------------------------------------


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


def test_an_interruption_just_after_the_commit_rename_keeps_the_new_part(tmp_path,
                                                                       monkeypatch):
    """A KeyboardInterrupt in the directory fsync that follows the rename (or anywhere
    after it) must not delete the data file the manifest now in place names."""
    chk = checkpoint_path(tmp_path, 1)
    write_attempt(chk, 0, 0)
    part_dir = os.path.join(chk, "part-1-0")
    first = committed(part_dir)["data_file"]
    real_fsync_dir = writer._fsync_dir

    def fsync_dir(path: str) -> None:
        real_fsync_dir(path)
        if path == part_dir and committed(part_dir)["data_file"] != first:  # renamed
            raise KeyboardInterrupt

    monkeypatch.setattr(writer, "_fsync_dir", fsync_dir)
    with pytest.raises(KeyboardInterrupt):
        write_attempt(chk, 1, 1)
    monkeypatch.undo()
    assert read_consistent(chk) == (1, 1)


def test_a_data_file_taken_by_another_attempts_cleanup_is_never_committed(tmp_path,
                                                                         monkeypatch):
    """With stale_after_s=0 a concurrent attempt's cleanup may delete a data file that is
    still being written: the write fails instead of committing a manifest naming it."""
    chk = checkpoint_path(tmp_path, 1)
    write_attempt(chk, 0, 0)
    part_dir = os.path.join(chk, "part-1-0")
    real_commit = writer._commit

    def commit(part_dir_: str, pname: str, data_path: str, *args: Any) -> Any:
        os.unlink(data_path)  # what the other attempt's _remove_stale does
        return real_commit(part_dir_, pname, data_path, *args)

    monkeypatch.setattr(writer, "_commit", commit)
    with pytest.raises(CheckpointError, match=r"^checkpoint part part-1-0 cannot be written: "
                                              r"'.*data-[0-9a-f]+\.bin': .*No such file"):
        write_attempt(chk, 1, 1)
    monkeypatch.undo()
    assert read_consistent(chk) == (0, 0)
    assert [n for n in os.listdir(part_dir) if n.startswith(MANIFEST_NAME + ".tmp")] == []


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


def test_an_existing_part_directory_is_made_durable_again(tmp_path, monkeypatch):
    """A writer killed between creating the part directory and fsyncing its parent leaves an
    entry that was never made durable: the next writer fsyncs the part's parent and the
    checkpoint's parent even though both directories exist."""
    chk = checkpoint_path(tmp_path, 1)
    os.makedirs(os.path.join(chk, "part-1-0"))  # as a killed writer left it
    synced: list[str] = []
    real_fsync_dir = writer._fsync_dir

    def fsync_dir(path: str) -> None:
        synced.append(os.path.abspath(path))
        real_fsync_dir(path)

    monkeypatch.setattr(writer, "_fsync_dir", fsync_dir)
    write_attempt(chk, 0, 0)
    assert synced[:2] == [str(tmp_path), os.path.abspath(chk)]
    assert read_consistent(chk) == (0, 0)


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


# -- ids and paths ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, True, False, "1", 1.0, None, 2**63 * -1])
def test_checkpoint_ids_that_are_not_non_negative_ints_are_refused(tmp_path, bad):
    with pytest.raises(ConfigError, match=r"^checkpoint_id must be"):
        checkpoint_path(tmp_path, bad)


@pytest.mark.parametrize("good", [0, 2**63, 10**40])
def test_edge_checkpoint_ids_round_trip(tmp_path, good):
    chk = checkpoint_path(tmp_path, good)
    assert os.path.basename(chk) == f"chk-{good}"
    write_attempt(chk, 0, good % 7)
    assert read_consistent(chk) == (0, good % 7)


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


# -- extreme key group counts -------------------------------------------------------------


@pytest.mark.timeout(60)
def test_max_parallelism_32768_with_few_non_empty_key_groups(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    max_p = 32768
    kgs = [0, 1, 16383, 16384, 32767]
    m = write_part(chk, parallelism=1, operator_index=0, max_parallelism=max_p, states={},
                   key_groups=[(kg, [kg, "x"]) for kg in reversed(kgs)])
    assert sorted(m.key_groups) == kgs
    manifest = committed(os.path.join(chk, "part-1-0"))
    assert [e["key_group"] for e in manifest["key_groups"]] == kgs
    cp = open_checkpoint(chk)
    cp.verify()
    got = {kg: list(r) for kg, r in cp.read_key_groups(KeyGroupRange(0, max_p - 1))}
    assert got == {kg: [kg, "x"] for kg in kgs}
    with pytest.raises(CheckpointError, match=r"key group 32768 is outside"):
        write_part(checkpoint_path(tmp_path, 2), parallelism=1, operator_index=0,
                   max_parallelism=max_p, states={}, key_groups=[(max_p, [1])])


def test_last_of_32768_single_key_group_parts(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    m = write_part(chk, parallelism=32768, operator_index=32767, max_parallelism=32768,
                   states={}, key_groups=[(32767, ["last"])])
    assert m.key_group_range == KeyGroupRange(32767, 32767)
    with pytest.raises(CheckpointError, match=r"incomplete: key groups 0\.\.32766"):
        open_checkpoint(chk)


# -- failures midway --------------------------------------------------------------------------


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
    with pytest.raises((TypeError, ValueError)):
        write_attempt(chk, 0, 1, stale_after_s=None)
    assert read_consistent(chk) == (0, 0)  # a refused write must not have committed


# -- write_snapshot -----------------------------------------------------------------------


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
        write_snapshot(backend, chk, parallelism=2, operator_index=0, max_parallelism=MAX_P)


def test_backend_entries_outside_the_range_are_refused_with_extra_sections(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    backend = TinyBackend({0: [["v", b"k", b"n", b"d"]], 7: [["v", b"k", b"n", b"d"]]})
    with pytest.raises(CheckpointError, match="key group 7"):
        write_snapshot(backend, chk, parallelism=2, operator_index=0, max_parallelism=MAX_P,
                       extra_sections=lambda kg: [])


# -- manifest fields -----------------------------------------------------------------------


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


# -- never unpickles -----------------------------------------------------------------------


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
