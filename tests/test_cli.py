"""The `asyncstate` command line, run for real: `python -m asyncstate` and the console script,
`asyncstate checkpoint inspect` on checkpoints written by KeyedOperator (heap and RocksDB),
damaged and incomplete ones, and the exit status and stream conventions."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import asyncstate as ast

ROOT = Path(__file__).resolve().parent.parent
MAX_PARALLELISM = 128
KEYS = [f"k{i}" for i in range(120)]
RECORDS_PER_KEY = 3


def asyncstate_cmd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`python -m asyncstate ARGS` in a fresh interpreter."""
    return subprocess.run([sys.executable, "-W", "error", "-m", "asyncstate", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, check=False)


class Job(ast.KeyedProcessFunction):
    """A value, a list and a map state per key, and an operator list state."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))
        self.events = ctx.get_list_state(ast.ListStateDescriptor("events"))
        self.last = ctx.get_map_state(ast.MapStateDescriptor("last_by_slot"))
        self.offsets = ctx.get_operator_list_state("offsets")

    async def process_element(self, value: Any, ctx: ast.RecordContext) -> None:
        _, n = value
        count = (await self.count.value() or 0) + 1
        self.count.update(count)
        self.events.add(n)
        self.last.put(n % RECORDS_PER_KEY, count)
        if n % 50 == 0:
            self.offsets.add(n)


def records() -> list[tuple[str, int]]:
    return [(key, i * RECORDS_PER_KEY + j) for i, key in enumerate(KEYS)
            for j in range(RECORDS_PER_KEY)]


async def write_checkpoint(directory: Path, parallelism: int, backend: str) -> Path:
    """Run Job over records() at `parallelism`, each operator fed its own keys, and snapshot
    checkpoint 1 under `directory`."""
    path = ""
    for index in range(parallelism):
        owned = ast.compute_key_group_range_for_operator_index(
            MAX_PARALLELISM, parallelism, index)
        store = ast.HeapBackend() if backend == "heap" else \
            ast.RocksDBBackend(directory / f"db-{index}")
        async with ast.KeyedOperator(Job(), key_selector=lambda r: r[0], backend=store,
                                     parallelism=parallelism, operator_index=index) as op:
            for record in records():
                if owned.contains(ast.assign_to_key_group(record[0], MAX_PARALLELISM)):
                    await op.process(record)
            path = await op.snapshot(directory / "checkpoints", 1)
    return Path(path)


@pytest.fixture(scope="module", params=["heap", "rocksdb"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete checkpoint written at parallelism 2 by the heap or RocksDB backend."""
    directory = tmp_path_factory.mktemp(f"ckpt-{request.param}")
    return asyncio.run(write_checkpoint(directory, 2, request.param))


@pytest.fixture
def copy(checkpoint: Path, tmp_path: Path) -> Path:
    """A copy of the checkpoint that a test may damage."""
    target = tmp_path / checkpoint.name
    shutil.copytree(checkpoint, target)
    return target


def expected_states() -> dict[str, dict[str, Any]]:
    """What the job wrote, counted from the records alone."""
    key_groups = len({ast.assign_to_key_group(k, MAX_PARALLELISM) for k in KEYS})
    per_key = {"key_groups": key_groups, "entries": len(KEYS)}
    return {
        "count": {"kind": "value", **per_key, "elements": None},
        "events": {"kind": "list", **per_key, "elements": len(KEYS) * RECORDS_PER_KEY},
        "last_by_slot": {"kind": "map", **per_key, "elements": len(KEYS) * RECORDS_PER_KEY},
    }


def inspect_json(path: Path) -> tuple[int, dict[str, Any], str]:
    proc = asyncstate_cmd("checkpoint", "inspect", str(path), "--json")
    return proc.returncode, json.loads(proc.stdout), proc.stderr


def data_file(part_dir: Path) -> Path:
    [data] = part_dir.glob("data-*.bin")
    return data


# -- a complete checkpoint ----------------------------------------------------------------


def test_inspect_json_reports_parts_states_and_operator_state(checkpoint: Path) -> None:
    status, report, err = inspect_json(checkpoint)
    assert status == 0, err
    assert report["status"] == "complete"
    assert report["problem"] is None
    assert report["checksums_verified"] is True
    assert (report["max_parallelism"], report["parallelism"]) == (MAX_PARALLELISM, 2)
    # The parts tile the key groups, each as KeyedOperator's split assigns them.
    parts = report["parts"]
    assert [p["name"] for p in parts] == ["part-2-0", "part-2-1"]
    for index, part in enumerate(parts):
        owned = ast.compute_key_group_range_for_operator_index(MAX_PARALLELISM, 2, index)
        assert part["key_groups"] == [owned.start, owned.end]
        assert part["operator_index"] == index
        keys = [k for k in KEYS if owned.contains(ast.assign_to_key_group(k, MAX_PARALLELISM))]
        assert part["non_empty_key_groups"] == len(
            {ast.assign_to_key_group(k, MAX_PARALLELISM) for k in keys})
        data = data_file(checkpoint / part["name"])
        assert part["data_file"] == data.name
        assert part["data_bytes"] == data.stat().st_size
    states = report["states"]
    sizes = {name: s.pop("bytes") for name, s in states.items()}
    assert states == expected_states()
    # Entry sizes: positive, and together less than the data files (which also hold
    # section headers, the operator state and a magic number).
    assert all(size > 0 for size in sizes.values())
    assert sum(sizes.values()) < sum(p["data_bytes"] for p in parts)
    # The list state holds three ints per key where the value state holds one.
    assert sizes["events"] > sizes["count"]
    offsets = sum(1 for _, n in records() if n % 50 == 0)
    assert report["operator_state"] == {"offsets": {"mode": "split", "elements": offsets}}
    # Progress went to stderr, the report alone to stdout (it parsed as JSON).
    assert "inspect: reading part-2-1 (2/2)" in err


def test_heap_and_rocksdb_checkpoints_hold_the_same_states(
        tmp_path: Path) -> None:
    heap = asyncio.run(write_checkpoint(tmp_path / "heap", 2, "heap"))
    rocks = asyncio.run(write_checkpoint(tmp_path / "rocks", 2, "rocksdb"))
    _, heap_report, _ = inspect_json(heap)
    _, rocks_report, _ = inspect_json(rocks)
    assert heap_report["states"] == rocks_report["states"]  # the format is backend-neutral


def test_inspect_text_report(checkpoint: Path) -> None:
    proc = asyncstate_cmd("checkpoint", "inspect", str(checkpoint))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith(f"checkpoint {checkpoint}: complete, checksums verified\n")
    assert "restorable at any parallelism from 1 to 128" in out
    assert re.search(r"^  part-2-0 +0\.\.63 ", out, re.MULTILINE), out
    assert re.search(r"^  part-2-1 +64\.\.127 ", out, re.MULTILINE), out
    expected = expected_states()
    for name, s in expected.items():
        elements = "-" if s["elements"] is None else f"{s['elements']:,}"
        assert re.search(rf"^  {name} +{s['kind']} +{s['key_groups']:,} +{s['entries']:,} "
                         rf"+{elements} +[\d,]+$", out, re.MULTILINE), out
    assert re.search(r"^  offsets +split +\d+$", out, re.MULTILINE), out
    assert "inspect:" not in out  # progress stays on stderr
    assert "inspect: opening" in proc.stderr


def test_console_script_runs_the_same_command(checkpoint: Path) -> None:
    script = Path(sys.executable).parent / "asyncstate"
    assert script.exists(), "the console script `asyncstate` is not installed"
    proc = subprocess.run([str(script), "checkpoint", "inspect", str(checkpoint), "--json"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["status"] == "complete"


# -- damaged, incomplete, missing ---------------------------------------------------------


def test_flipped_byte_is_reported_as_damaged(copy: Path) -> None:
    data = data_file(copy / "part-2-1")
    blob = bytearray(data.read_bytes())
    blob[20] ^= 0xFF  # inside the first key group's records
    data.write_bytes(bytes(blob))
    status, report, _ = inspect_json(copy)
    assert status == 1
    assert report["status"] == "damaged"
    assert report["checksums_verified"] is False
    assert report["problem"].startswith(f"checksum mismatch in data file {str(data)!r}")
    proc = asyncstate_cmd("checkpoint", "inspect", str(copy))
    assert proc.returncode == 1
    assert proc.stdout.startswith(f"checkpoint {copy}: DAMAGED, cannot be restored\n"
                                  f"  checksum mismatch in data file {str(data)!r}, key group ")


def test_truncated_data_file_is_reported_as_damaged(copy: Path) -> None:
    data = data_file(copy / "part-2-0")
    data.write_bytes(data.read_bytes()[:-5])
    status, report, _ = inspect_json(copy)
    assert status == 1
    assert report["status"] == "damaged"  # the data file no longer matches its manifest
    assert "truncated or overwritten" in report["problem"]
    proc = asyncstate_cmd("checkpoint", "inspect", str(copy))
    assert proc.returncode == 1
    assert proc.stdout.startswith(f"checkpoint {copy}: DAMAGED, cannot be restored\n"
                                  f"  data file {str(data)!r} of checkpoint part part-2-0 has ")


@pytest.mark.parametrize("damage", ["missing", "bad magic"])
def test_missing_or_foreign_data_file_is_reported_as_damaged(copy: Path, damage: str) -> None:
    data = data_file(copy / "part-2-1")
    if damage == "missing":
        data.unlink()
    else:
        blob = data.read_bytes()
        data.write_bytes(b"X" * 4 + blob[4:])  # same size, not a data file
    status, report, _ = inspect_json(copy)
    assert status == 1
    assert report["status"] == "damaged"
    assert str(data) in report["problem"]
    assert ("is missing" if damage == "missing" else "bad magic") in report["problem"]


def test_uncommitted_part_is_reported_as_incomplete(copy: Path) -> None:
    (copy / "part-2-1" / "_MANIFEST.json").unlink()
    status, report, _ = inspect_json(copy)
    assert status == 1
    assert report["status"] == "invalid"
    assert "is incomplete: key groups 64..127 are not covered by any committed part; " \
           "missing part part-2-1" in report["problem"]
    assert report["parts_on_disk"] == [{"name": "part-2-0", "committed": True},
                                       {"name": "part-2-1", "committed": False}]
    proc = asyncstate_cmd("checkpoint", "inspect", str(copy))
    assert proc.returncode == 1
    assert proc.stdout.startswith(f"checkpoint {copy}: INVALID, cannot be restored\n")
    assert "  parts on disk: part-2-0 (committed), part-2-1 (never committed)" in proc.stdout


def test_parts_of_an_unfinished_rewrite_at_another_parallelism_are_reported_left_out(
        copy: Path) -> None:
    from asyncstate.checkpoint.writer import write_part
    write_part(str(copy), parallelism=4, operator_index=0, max_parallelism=128, states={},
               key_groups=[])
    status, report, _ = inspect_json(copy)
    assert status == 0
    assert [p["name"] for p in report["parts"]] == ["part-2-0", "part-2-1"]
    assert report["superseded_parts"] == ["part-4-0"]
    assert {name: {k: v for k, v in s.items() if k != "bytes"}
            for name, s in report["states"].items()} == expected_states()
    proc = asyncstate_cmd("checkpoint", "inspect", str(copy))
    assert proc.returncode == 0, proc.stderr
    assert "  left out: part-4-0 (of a run the checkpoint id was written again over, at " \
           "another parallelism)\n" in proc.stdout


def test_missing_part_directory_is_reported(copy: Path) -> None:
    shutil.rmtree(copy / "part-2-0")
    status, report, _ = inspect_json(copy)
    assert status == 1
    assert "key groups 0..63 are not covered" in report["problem"]
    assert "missing part part-2-0" in report["problem"]


def test_unreadable_manifest_is_reported(copy: Path) -> None:
    manifest = copy / "part-2-0" / "_MANIFEST.json"
    manifest.write_text(manifest.read_text()[:40])
    status, report, _ = inspect_json(copy)
    assert status == 1
    assert report["problem"].startswith(f"checkpoint manifest {str(manifest)!r} cannot be read")


def test_checkpoint_directory_instead_of_a_checkpoint_names_what_it_holds(
        checkpoint: Path) -> None:
    status, report, _ = inspect_json(checkpoint.parent)
    assert status == 1
    assert report["problem"].endswith("this directory holds checkpoints chk-1: inspect one "
                                      "of them")


def test_missing_path(tmp_path: Path) -> None:
    status, report, _ = inspect_json(tmp_path / "nowhere")
    assert status == 1
    assert report["problem"] == f"checkpoint {str(tmp_path / 'nowhere')!r} does not exist or " \
                                "is not a directory"


# -- command line conventions -------------------------------------------------------------


def test_no_command_prints_usage_and_exits_2() -> None:
    proc = asyncstate_cmd()
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.startswith("usage: python -m asyncstate [-h] COMMAND ...")
    assert "demo" in proc.stderr and "checkpoint" in proc.stderr


def test_checkpoint_without_action_exits_2() -> None:
    proc = asyncstate_cmd("checkpoint")
    assert proc.returncode == 2
    assert "inspect" in proc.stderr


def test_inspect_without_path_exits_2() -> None:
    proc = asyncstate_cmd("checkpoint", "inspect")
    assert proc.returncode == 2
    assert "error: the following arguments are required: PATH" in proc.stderr


def test_demo_subcommand_runs_the_demo() -> None:
    proc = asyncstate_cmd("demo", "--records", "500", "--users", "20", "--backend", "heap")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("asyncstate demo: 500 clicks of ")
    assert proc.stderr == "running on HeapBackend ...\n"  # progress only


def test_demo_subcommand_rejects_bad_options_with_status_2() -> None:
    proc = asyncstate_cmd("demo", "--backend", "disk")
    assert proc.returncode == 2
    assert re.search(r"^usage: python -m asyncstate demo .*\n.*error: argument --backend: "
                     r"invalid choice: 'disk'", proc.stderr, re.MULTILINE | re.DOTALL)


@pytest.mark.timeout(60)
def test_closed_stdout_ends_quietly_with_sigpipe_status() -> None:
    # The reader is gone before the demo prints: `asyncstate demo | head -0`.
    with subprocess.Popen(
            [sys.executable, "-m", "asyncstate", "demo", "--records", "300", "--users", "10",
             "--backend", "heap"], cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        err = proc.stderr.read().decode()
        status = proc.wait(timeout=60)
    assert status == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert err == "running on HeapBackend ...\n"
