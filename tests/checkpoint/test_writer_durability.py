"""The writer's durability: a writer killed mid-write (SIGKILL) leaves the previous
checkpoint intact, and the data file, the part directory and the manifest reach the
disk before the manifest is renamed into place."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
from checkpoint_files import (
    committed,
    read_consistent,
    write_attempt,
)
from shared_functions import Counter, keyed_operator

import asyncstate as ast
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
    import os, sys
    from asyncstate.checkpoint.writer import write_part

    chk, marker, phase = sys.argv[1], sys.argv[2], sys.argv[3]

    def touch_and_wait():
        with open(marker, "w"):
            pass
        sys.stdin.read()  # the parent kills us here; it never closes our stdin first

    if phase == "rename":
        real_replace = os.replace

        def replace(src, dst):
            if dst.endswith("_MANIFEST.json"):
                touch_and_wait()  # killed here: manifest written and fsynced, not renamed
            real_replace(src, dst)

        os.replace = replace

    def records(kg):
        for i in range(20_000):  # ~2 MB per key group: the write buffer spills to disk
            yield [0, "v_new", b"\\xa1k", b"\\xc0", b"x" * 90]

    def key_groups():
        for kg in range(0, 8):
            if phase == "data" and kg == 2:
                touch_and_wait()  # two key groups are on disk, more are coming
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
                            stdin=subprocess.PIPE, stderr=subprocess.PIPE, cwd=os.getcwd())
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            if proc.poll() is not None:
                pytest.fail(f"writer exited early: {proc.stderr.read().decode()}")
            if time.monotonic() > deadline:
                pytest.fail("writer never reached the kill point")
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdin.close()
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


# -- the order in which a part reaches the disk ---------------------------------------------


class DiskCalls:
    """Records, calling through, the calls that make a part durable: each `os.fsync` as the
    file it synced (device and inode, whether a directory, its size at that moment) and each
    `os.replace`. A file keeps its inode across a rename, so the temporary manifest's fsync is
    matched to the manifest it becomes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[Any, ...]] = []
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(fd: int) -> None:
            st = os.fstat(fd)
            self.calls.append(("fsync", (st.st_dev, st.st_ino), stat.S_ISDIR(st.st_mode),
                               st.st_size))
            real_fsync(fd)

        def replace(src: Any, dst: Any, **kwargs: Any) -> None:
            self.calls.append(("replace", os.fspath(src), os.fspath(dst)))
            real_replace(src, dst, **kwargs)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)

    def named(self, paths: dict[str, str]) -> list[str]:
        """The calls in order, each file named by the key of `paths` it is (a directory
        fsync as "dir <name>"), each rename as "rename <source> -> <destination>"."""
        names = {}
        for name, path in paths.items():
            st = os.stat(path)
            names[(st.st_dev, st.st_ino)] = name
        out = []
        for call in self.calls:
            if call[0] == "fsync":
                name = names.get(call[1], "unknown")
                out.append(f"fsync dir {name}" if call[2] else f"fsync {name}")
            else:
                src, dst = (os.path.basename(p) for p in call[1:])
                src = "temporary manifest" if src.startswith(MANIFEST_NAME + ".tmp-") else src
                out.append(f"rename {src} -> {dst}")
        return out

    def size_at_fsync(self, path: str) -> int:
        st = os.stat(path)
        [size] = [c[3] for c in self.calls if c[0] == "fsync" and c[1] == (st.st_dev, st.st_ino)]
        return int(size)


# What must reach the disk, in this order: the data file (all of it), the part directory's
# entry for it, the temporary manifest (all of it), then the rename that commits the part,
# then the part directory again so the rename itself survives a crash. The checkpoint
# directory and its parent are synced first (they may have just been created).
DURABLE_ORDER = [
    "fsync dir parent", "fsync dir checkpoint",
    "fsync data file", "fsync dir part", "fsync manifest",
    f"rename temporary manifest -> {MANIFEST_NAME}", "fsync dir part",
]


@pytest.mark.parametrize("rewrite", [False, True], ids=["new-part", "rewrite"])
def test_the_data_file_and_the_manifest_are_durable_before_the_manifest_is_renamed(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, rewrite: bool) -> None:
    chk = checkpoint_path(tmp_path, 1)
    part_dir = os.path.join(chk, "part-1-0")
    if rewrite:
        write_attempt(chk, 0, 0)
    disk = DiskCalls(monkeypatch)
    write_attempt(chk, 1, 1)
    monkeypatch.undo()
    manifest = committed(part_dir)
    data_path = os.path.join(part_dir, manifest["data_file"])
    manifest_path = os.path.join(part_dir, MANIFEST_NAME)
    assert disk.named({"parent": str(tmp_path), "checkpoint": chk, "part": part_dir,
                       "data file": data_path, "manifest": manifest_path}) == DURABLE_ORDER
    # Each file was synced once it held all it holds: a sync before the last write (or the
    # flush of the write buffer) would leave the tail in the page cache.
    assert disk.size_at_fsync(data_path) == manifest["data_size"] == os.path.getsize(data_path)
    assert disk.size_at_fsync(manifest_path) == os.path.getsize(manifest_path)
    assert read_consistent(chk) == (1, 1)


async def test_a_snapshot_of_an_operator_makes_its_part_durable_in_the_same_order(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    op = keyed_operator(Counter(), ast.HeapBackend())
    async with op:
        for i in range(20):
            await op.process((i % 5, i))
        disk = DiskCalls(monkeypatch)
        path = await op.snapshot(str(tmp_path), 7)
        monkeypatch.undo()
    part_dir = os.path.join(path, "part-1-0")
    manifest = committed(part_dir)
    data_path = os.path.join(part_dir, manifest["data_file"])
    assert disk.named({"parent": str(tmp_path), "checkpoint": path, "part": part_dir,
                       "data file": data_path,
                       "manifest": os.path.join(part_dir, MANIFEST_NAME)}) == DURABLE_ORDER
    assert disk.size_at_fsync(data_path) == manifest["data_size"]
