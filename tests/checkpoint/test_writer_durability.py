"""The writer's durability: a writer killed mid-write (SIGKILL) leaves the previous
checkpoint intact, and the data file, the part directory and the manifest reach the
disk before the manifest is renamed into place."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from checkpoint_files import (
    committed,
    read_consistent,
    write_attempt,
)

from asyncstate.checkpoint import writer
from asyncstate.checkpoint.format import (
    MANIFEST_NAME,
    checkpoint_path,
    open_checkpoint,
)
from asyncstate.checkpoint.snapshot import restore_snapshot, write_snapshot
from asyncstate.errors import CheckpointError
from asyncstate.keygroups import compute_key_group_range_for_operator_index

MAX_P = 16
PARALLELISM = 2

CHILD = textwrap.dedent("""
    import os, sys, time
    from asyncstate.checkpoint.writer import write_part

    chk, marker, phase = sys.argv[1], sys.argv[2], sys.argv[3]

    def touch():
        with open(marker, "w"):
            pass

    if phase == "rename":
        real_replace = os.replace

        def replace(src, dst):
            if dst.endswith("_MANIFEST.json"):
                touch()
                time.sleep(120)  # killed here: manifest written and fsynced, not renamed
            real_replace(src, dst)

        os.replace = replace

    def records(kg):
        for i in range(20_000):  # ~2 MB per key group: the write buffer spills to disk
            yield [0, "v_new", b"\\xa1k", b"\\xc0", b"x" * 90]

    def key_groups():
        for kg in range(0, 8):
            if phase == "data" and kg == 2:
                touch()  # two key groups are on disk, more are coming
            if phase == "data" and kg >= 2:
                time.sleep(2)
            yield kg, records(kg)

    write_part(chk, parallelism=2, operator_index=0, max_parallelism=16,
               states={"v_new": "value"}, key_groups=key_groups(), extra={"child": True})
    print("finished without being killed", file=sys.stderr)
""")


def model() -> dict[tuple[str, object, object], object]:
    m: dict[tuple[str, object, object], object] = {}
    for i in range(300):
        m[("v_count", f"user-{i}", None)] = i
        m[("l_events", i, "ns")] = [i, str(i), b"\x00"]
        m[("m_attrs", (i, "t"), None)] = {"a": i, 2: [i]}
    return m


def write_complete_checkpoint(ck, chk, m):
    heaps = [ck.Heap() for _ in range(PARALLELISM)]
    for (name, key, ns), value in m.items():
        kg = ck.key_group(key, MAX_P)
        index = 0 if kg < MAX_P // PARALLELISM else 1
        heaps[index].put(name, key, ns, value)
    for i, heap in enumerate(heaps):
        write_snapshot(heap.backend, chk, parallelism=PARALLELISM, operator_index=i,
                       max_parallelism=MAX_P, extra={"op": i})


def assert_restores(ck, chk, m):
    cp = open_checkpoint(chk)
    cp.verify()
    heap = ck.Heap()
    info = restore_snapshot(heap.backend, cp, compute_key_group_range_for_operator_index(
        MAX_P, 1, 0), MAX_P)
    assert info["extras"] == [{"op": 0}, {"op": 1}]
    assert info["records"] == len(m)
    for (name, key, ns), value in m.items():
        assert heap.get(name, key, ns) == ck.normalize(value)


def kill_mid_write(tmp_path, chk: str, phase: str) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    marker = tmp_path / f"marker-{phase}"
    proc = subprocess.Popen([sys.executable, str(script), chk, str(marker), phase],
                            stderr=subprocess.PIPE, cwd=os.getcwd())
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            if proc.poll() is not None:
                pytest.fail(f"writer exited early: {proc.stderr.read().decode()}")
            if time.monotonic() > deadline:
                pytest.fail("writer never reached the kill point")
            time.sleep(0.01)
        time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def leftovers(part_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(part_dir) if n != MANIFEST_NAME)


@pytest.mark.skipif(sys.platform == "win32", reason="needs SIGKILL")
@pytest.mark.parametrize("phase", ["data", "rename"])
def test_killed_writer_of_a_new_checkpoint_leaves_the_previous_one_intact(ck, tmp_path, phase):
    m = model()
    previous = checkpoint_path(tmp_path, 1)
    write_complete_checkpoint(ck, previous, m)
    new = checkpoint_path(tmp_path, 2)
    kill_mid_write(tmp_path, new, phase)
    assert_restores(ck, previous, m)
    # The killed checkpoint is refused as a whole, naming what is missing.
    with pytest.raises(CheckpointError, match=r"has no committed part .*part-2-0 never "
                                              r"committed"):
        open_checkpoint(new)
    part_dir = os.path.join(new, "part-2-0")
    names = leftovers(part_dir)
    assert any(n.startswith("data-") for n in names)
    if phase == "rename":
        assert any(n.startswith(MANIFEST_NAME + ".tmp-") for n in names)
        data = next(n for n in names if n.startswith("data-"))
        assert os.path.getsize(os.path.join(part_dir, data)) > 8 * 1_000_000  # all written


@pytest.mark.skipif(sys.platform == "win32", reason="needs SIGKILL")
@pytest.mark.parametrize("phase", ["data", "rename"])
def test_killed_rewrite_of_an_existing_checkpoint_keeps_the_old_version(ck, tmp_path, phase):
    m = model()
    chk = checkpoint_path(tmp_path, 1)
    write_complete_checkpoint(ck, chk, m)
    part_dir = os.path.join(chk, "part-2-0")
    committed = open_checkpoint(chk).parts[0].data_file
    kill_mid_write(tmp_path, chk, phase)
    assert_restores(ck, chk, m)
    assert open_checkpoint(chk).parts[0].data_file == committed
    dead = [n for n in leftovers(part_dir) if n != committed]
    assert dead  # the dead attempt's files, never referenced by a manifest

    # A retried writer then replaces the part and removes what the dead attempt left.
    m2 = {k: (v if k[0] != "v_count" else -1) for k, v in m.items()}
    heap = ck.Heap()
    for (name, key, ns), value in m2.items():
        if ck.key_group(key, MAX_P) < MAX_P // PARALLELISM:
            heap.put(name, key, ns, value)
    write_snapshot(heap.backend, chk, parallelism=PARALLELISM, operator_index=0,
                   max_parallelism=MAX_P, extra={"op": 0}, stale_after_s=0)
    assert len(leftovers(part_dir)) == 1
    expected = dict(m)
    half = MAX_P // PARALLELISM
    expected.update({k: v for k, v in m2.items() if ck.key_group(k[1], MAX_P) < half})
    assert_restores(ck, chk, expected)


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

