"""Concurrent writers of one checkpoint part (threads and processes) with a reader in the
loop: every read sees one complete attempt, and no writer deletes the data file of the
manifest in place."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
from checkpoint_files import (
    assert_one_complete_attempt,
    committed,
    read_consistent,
    write_attempt,
)

from asyncstate.checkpoint import writer
from asyncstate.checkpoint.format import (
    MANIFEST_NAME,
    checkpoint_path,
)
from asyncstate.errors import CheckpointError


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
    from checkpoint_files import write_attempt
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
    deadline = time.monotonic() + 50
    try:
        while any(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, "the writer processes did not finish"
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
