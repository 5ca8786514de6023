"""Concrete claims of README.md and docs/{quickstart,concepts,backends,checkpoints}.md that no
other test checks."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import asyncstate as ast
import asyncstate.log as aslog
from asyncstate import serde
from asyncstate.checkpoint import format as ckfmt
from asyncstate.checkpoint import snapshot as cksnap
from asyncstate.checkpoint.operator_state import read_operator_extras
from asyncstate.runtime.requests import StateKind

ROOT = Path(__file__).resolve().parent.parent


class _Value(ast.KeyedProcessFunction):
    def open(self, ctx: Any) -> None:
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

    async def process_element(self, value: Any, ctx: Any) -> None:
        await self.v.update(value)


def _two_keys_of_one_group(max_parallelism: int = 128) -> tuple[str, str, int]:
    kg = ast.assign_to_key_group("a", max_parallelism)
    other = next(k for k in (f"k{i}" for i in range(100_000))
                 if ast.assign_to_key_group(k, max_parallelism) == kg)
    return "a", other, kg


# -- README.md -----------------------------------------------------------------------------

def test_readme_example_prints_what_its_comment_says() -> None:
    # README.md:27-44: the example prints [('a', 1), ('a', 2), ('b', 1)].
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## Example\n\n```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert block is not None
    code = block[1]
    expected = re.search(r"print\(sorted\(out\)\)  # (\[.*?\])", code)
    assert expected is not None
    proc = subprocess.run([sys.executable, "-W", "error", "-c", code], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected[1] + "\n"


# -- quickstart.md -------------------------------------------------------------------------

def test_run_uses_uvloop() -> None:
    # quickstart.md:36-37 and 94-95: `ast.run` builds its own loop, uvloop when installed.
    class LoopType(ast.KeyedProcessFunction):
        async def process_element(self, value: Any, ctx: Any) -> None:
            ctx.emit(type(asyncio.get_running_loop()).__module__)

    assert ast.run(LoopType(), [1], key_selector=lambda r: r) == ["uvloop"]


# -- backends.md ---------------------------------------------------------------------------

def test_rocksdb_map_iteration_is_in_user_key_byte_order(tmp_path: Path) -> None:
    # backends.md:108: on RocksDB, map iteration order is user-key byte order.
    keys = ["b", "a", 10, 1, "c", -1, b"x"]

    class Keys(ast.KeyedProcessFunction):
        def open(self, ctx: Any) -> None:
            self.m = ctx.get_map_state(ast.MapStateDescriptor("m"))

        async def process_element(self, value: Any, ctx: Any) -> None:
            for k in keys:
                await self.m.put(k, 0)
            ctx.emit(await (await self.m.keys()).to_list())

    out = ast.run(Keys(), [0], key_selector=lambda r: r,
                  backend=ast.RocksDBBackend(tmp_path / "db"),
                  config=ast.AsyncStateConfig(iterator_chunk_size=2))
    assert out == [sorted(keys, key=serde.canonical_key)]


def test_rocksdb_block_cache_is_not_created_at_import() -> None:
    # backends.md:170: the shared block cache is created on first use, never at import.
    code = ("import asyncstate as ast, asyncstate.backends.rocksdb_options as o\n"
            "ast.RocksDBBackend\nprint(len(o._caches))")
    proc = subprocess.run([sys.executable, "-W", "error", "-c", code], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "0\n"


# -- checkpoints.md ------------------------------------------------------------------------

def test_manifest_has_the_documented_fields(tmp_path: Path) -> None:
    # checkpoints.md:16-34: chk-<id>/part-<p>-<i>/{data-<attempt>.bin,_MANIFEST.json}, the
    # manifest fields, the magic, and key groups listed only when non-empty.
    chk = ast.checkpoint_path(tmp_path, 4)
    ckfmt.write_part(chk, parallelism=2, operator_index=1, max_parallelism=8,
                     states={"v": "value"}, key_groups=[(5, ["r1", "r2"])], extra={"x": 1})
    part = Path(chk) / "part-2-1"
    assert chk == str(tmp_path / "chk-4")
    manifest = json.loads((part / "_MANIFEST.json").read_text())
    assert {"format", "format_version", "max_parallelism", "parallelism", "operator_index",
            "key_group_range", "states", "data_file", "data_size", "attempt", "written_at",
            "checksum", "extra", "key_groups"} <= manifest.keys()
    assert manifest["format_version"] == 1
    assert manifest["key_group_range"] == [4, 7]
    assert manifest["checksum"] == "crc32"
    assert manifest["data_file"] == f"data-{manifest['attempt']}.bin"
    assert {"offset", "size", "crc32"} <= manifest["extra"].keys()
    assert [kg["key_group"] for kg in manifest["key_groups"]] == [5]
    assert {"offset", "size", "records", "crc32"} <= manifest["key_groups"][0].keys()
    assert manifest["key_groups"][0]["records"] == 2
    data = (part / manifest["data_file"]).read_bytes()
    assert data[:8] == b"ASCKPT\x00\x01"
    assert len(data) == manifest["data_size"]
    assert sorted(p.name for p in part.iterdir()) == sorted(
        [manifest["data_file"], "_MANIFEST.json"])


def test_snapshot_and_restore_log_their_events(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # checkpoints.md:196-198: write_snapshot logs checkpoint.part_written (path, data file,
    # key groups, bytes, seconds), restore_snapshot logs checkpoint.restored (path, key group
    # range, key groups, records, seconds), both at info level through asyncstate.log.
    backend = ast.HeapBackend()
    backend.register_state("v", StateKind.VALUE)
    kg = ast.assign_to_key_group("a", 128)
    backend.restore_key_group(kg, [("v", serde.canonical_key("a"), serde.NONE_BYTES, b"\x01")])
    saved = aslog._threshold
    aslog.set_level("info")
    try:
        cksnap.write_snapshot(backend, ast.checkpoint_path(tmp_path, 1), parallelism=1,
                              operator_index=0, max_parallelism=128)
        cksnap.restore_snapshot(ast.HeapBackend(),
                                ckfmt.open_checkpoint(ast.checkpoint_path(tmp_path, 1)),
                                ast.KeyGroupRange(0, 127), 128)
    finally:
        aslog._threshold = saved
    by_event = {r.asyncstate_event: r for r in caplog.records}
    assert by_event["checkpoint.part_written"].levelname == "INFO"
    assert by_event["checkpoint.restored"].levelname == "INFO"
    written = by_event["checkpoint.part_written"].asyncstate_fields
    assert {"path", "data_file", "key_groups", "bytes", "seconds"} <= written.keys()
    assert written["key_groups"] == 1
    restored = by_event["checkpoint.restored"].asyncstate_fields
    assert {"path", "first_key_group", "last_key_group", "key_groups", "records",
            "seconds"} <= restored.keys()
    assert (restored["first_key_group"], restored["last_key_group"]) == (0, 127)
    assert (restored["key_groups"], restored["records"]) == (1, 1)


def test_heap_restore_key_group_leaves_other_keys_of_the_group_alone() -> None:
    # checkpoints.md:115-116: restore_key_group replaces the entries it is given and leaves
    # other keys alone (the heap half of the sentence).
    a, other, kg = _two_keys_of_one_group()
    backend = ast.HeapBackend()
    backend.register_state("v", StateKind.VALUE)
    backend.restore_key_group(kg, [("v", serde.canonical_key(a), serde.NONE_BYTES, b"\x01")])
    backend.restore_key_group(kg, [("v", serde.canonical_key(other), serde.NONE_BYTES, b"\x02")])
    assert sorted(e[1] for e in backend.snapshot_key_group(kg, 128)) == sorted(
        [serde.canonical_key(a), serde.canonical_key(other)])


def test_rocksdb_restore_key_group_leaves_other_keys_of_the_group_alone(tmp_path: Path) -> None:
    """checkpoints.md: restore_key_group replaces what it is given on both backends."""
    a, other, kg = _two_keys_of_one_group()
    with ast.RocksDBBackend(tmp_path / "db") as backend:
        backend.register_state("v", StateKind.VALUE)
        backend.restore_key_group(kg, [("v", serde.canonical_key(a), serde.NONE_BYTES, b"\x01")])
        backend.restore_key_group(
            kg, [("v", serde.canonical_key(other), serde.NONE_BYTES, b"\x02")])
        keys = [e[1] for e in backend.snapshot_key_group(kg)]
    assert sorted(keys) == sorted([serde.canonical_key(a), serde.canonical_key(other)])


def test_operator_state_without_mode_or_sequence_reads_as_split_and_zero(tmp_path: Path) -> None:
    """checkpoints.md: an absent `mode` is "split" and an absent `list_sequence` is 0."""
    chk = ast.checkpoint_path(tmp_path, 1)
    ckfmt.write_part(chk, parallelism=1, operator_index=0, max_parallelism=128, states={},
                     key_groups=[],
                     extra={"operator_state": {"ops": {"items": [serde.canonical_key(1)]}}})
    extras = read_operator_extras(ckfmt.open_checkpoint(chk))
    assert extras.operator_modes == {"ops": "split"}
    assert extras.list_sequence == 0
    assert extras.operator_parts == {"ops": [[serde.canonical_key(1)]]}


# -- docs/api.md ---------------------------------------------------------------------------

@pytest.mark.parametrize("module", ["asyncstate", "asyncstate.spark", "asyncstate.testing",
                                    "asyncstate.logging"])
def test_api_reference_documents_every_public_name(module: str) -> None:
    import importlib

    mod = importlib.import_module(module)
    doc = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    # A name counts as documented where it stands in code: a code block, or code quotes
    # (`name`, `name(...)`, `ast.name`, `module.name`).
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", doc, flags=re.S | re.M)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", doc, flags=re.S | re.M)
    quoted = " ".join(blocks + re.findall(r"`([^`]+)`", prose))
    missing = [name for name in mod.__all__
               if not re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", quoted)]
    assert missing == [], f"docs/api.md does not document {module}.{missing}"
