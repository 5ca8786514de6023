"""Bounded scans (asyncstate/backends/rocksdb_scan.py): bounds, limits, and the rule that
keeps rocksdict's iteration bounds alive while an iterator reads through them."""

from __future__ import annotations

import ast as pyast
import gc
from pathlib import Path

import pytest
import rocksdict

import asyncstate
from asyncstate._compiled import COMPILED_MODULES
from asyncstate.backends.rocksdb_scan import _scan_is_empty, _scan_items

ROOT = Path(asyncstate.__file__).parent.parent


@pytest.fixture
def cf(tmp_path):
    db = rocksdict.Rdict(str(tmp_path / "db"), rocksdict.Options(raw_mode=True))
    for first in (b"a", b"b", b"c"):
        for i in range(50):
            db[first + bytes([i])] = first * 2
    yield db
    db.close()
    del db
    gc.collect()


def fresh(data: bytes) -> bytes:
    """A new bytes object nobody else refers to (not a constant of this module)."""
    return bytes(bytearray(data))


def test_scan_items_stays_inside_its_bounds_and_limit(cf):
    assert _scan_items(cf, fresh(b"b"), fresh(b"c")) == [
        (b"b" + bytes([i]), b"bb") for i in range(50)]
    assert _scan_items(cf, fresh(b"b\x0a"), fresh(b"b\x0d")) == [
        (b"b\x0a", b"bb"), (b"b\x0b", b"bb"), (b"b\x0c", b"bb")]
    assert _scan_items(cf, fresh(b"a"), fresh(b"d"), 3) == [
        (b"a\x00", b"aa"), (b"a\x01", b"aa"), (b"a\x02", b"aa")]
    assert _scan_items(cf, fresh(b"a\xff"), fresh(b"b")) == []


def test_scan_is_empty_sees_only_its_range(cf):
    assert not _scan_is_empty(cf, fresh(b"c"), fresh(b"d"))
    assert _scan_is_empty(cf, fresh(b"c\xff"), fresh(b"d"))
    assert _scan_is_empty(cf, fresh(b"0"), fresh(b"a"))


def test_bounds_survive_the_caller_dropping_its_references(cf):
    # The caller keeps nothing: only the scan's own frame holds the bounds while the
    # iterator reads. Allocations in between would reuse freed bound memory.
    for _ in range(200):
        got = _scan_items(cf, fresh(b"b\x10"), fresh(b"b\x20"))
        junk = [fresh(b"\x00" * 11) for _ in range(50)]
        assert [k for k, _v in got] == [b"b" + bytes([i]) for i in range(0x10, 0x20)]
        del junk


def _calls_read_options(path: Path) -> list[int]:
    tree = pyast.parse(path.read_text(encoding="utf-8"))
    return [node.lineno for node in pyast.walk(tree)
            if isinstance(node, pyast.Attribute) and node.attr == "ReadOptions"]


@pytest.mark.parametrize("module", COMPILED_MODULES)
def test_compiled_modules_build_no_read_options(module):
    # Compiled code frees a local after its last use, which would free rocksdict read
    # options (and the bounds only they hold) under a live iterator: every bounded scan
    # goes through rocksdb_scan, which is not compiled.
    path = ROOT / (module.replace(".", "/") + ".py")
    assert _calls_read_options(path) == [], f"{module} builds rocksdict.ReadOptions"


def test_the_scan_module_is_interpreted():
    assert "asyncstate.backends.rocksdb_scan" not in COMPILED_MODULES
    assert _calls_read_options(ROOT / "asyncstate/backends/rocksdb_scan.py")
