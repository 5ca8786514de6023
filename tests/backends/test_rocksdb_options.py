"""RocksDBOptions and the backend's numeric arguments: validation, conversion, and what
reaches RocksDB's column families."""

from __future__ import annotations

import re

import pytest
from backend_harness import (
    run_operator,
)
from shared_functions import Counter

import asyncstate as ast
from asyncstate.backends.rocksdb import (
    RocksDBBackend,
    RocksDBOptions,
)
from asyncstate.errors import ConfigError
from asyncstate.runtime.requests import StateKind


def test_options_are_validated_and_converted(tmp_path):
    with pytest.raises(ConfigError, match=r"^bloom_filter_bits must be in \[0, 64\], got -1$"):
        RocksDBOptions(bloom_filter_bits=-1)
    with pytest.raises(ConfigError, match=r"^write_buffer_bytes must be in \[65536, "
                                          r"68719476736\], got 10$"):
        RocksDBOptions(write_buffer_bytes=10)
    with pytest.raises(ConfigError, match=r"^write_buffer_bytes must be in \[65536, "
                                          r"68719476736\], got 68719476737$"):
        RocksDBOptions(write_buffer_bytes=64 * 2**30 + 1)  # RocksDB would clamp it
    with pytest.raises(ConfigError, match=r"^disable_wal must be a bool, got 'yes'$"):
        RocksDBOptions(disable_wal="yes")  # type: ignore[arg-type]
    for ratio in (-0.01, 0.3, float("nan"), True, "0.1"):
        with pytest.raises(ConfigError, match=r"^memtable_bloom_ratio must be a number in "
                                              r"\[0, 0\.25\], got "):
            RocksDBOptions(memtable_bloom_ratio=ratio)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^io_parallelism must be in \[1, 64\], got 0$"):
        RocksDBBackend(tmp_path / "x", io_parallelism=0)
    with pytest.raises(ConfigError, match=r"^inline_read_keys must be >= 0, got -1$"):
        RocksDBBackend(tmp_path / "x", inline_read_keys=-1)
    assert not (tmp_path / "x").exists()  # validated before anything is created
    with pytest.raises(ast.ConfigError, match=r"^options must be a RocksDBOptions, got \{\}$"):
        RocksDBBackend(tmp_path / "x", options={})  # type: ignore[arg-type]
    options = RocksDBOptions(block_cache_bytes=0, bloom_filter_bits=0, disable_wal=False)
    with RocksDBBackend(tmp_path / "db", options=options) as backend:
        backend.register_state("v", StateKind.VALUE)


@pytest.mark.parametrize(("ratio", "expected"), [(None, ("0.020000", "true")),
                                                 (0.25, ("0.250000", "true")),
                                                 (0, ("0.000000", "false"))])
def test_memtable_bloom_reaches_every_column_family(tmp_path, ratio, expected):
    """RocksDB records the options each column family runs with in its OPTIONS file."""
    options = RocksDBOptions() if ratio is None else RocksDBOptions(memtable_bloom_ratio=ratio)
    with RocksDBBackend(tmp_path / "db", options=options) as backend:
        backend.register_state("v", StateKind.VALUE)
        backend.register_state("m", StateKind.MAP)
    latest = max((tmp_path / "db").glob("OPTIONS-*"), key=lambda p: int(p.name[8:]))
    sections = re.split(r"^\[", latest.read_text(), flags=re.MULTILINE)
    families = {s.split("]", 1)[0]: s for s in sections if s.startswith("CFOptions")}
    assert len(families) == 3, sorted(families)  # the default family holds metadata
    for name, text in families.items():
        settings = dict(re.findall(r"^\s*(memtable_\w+)=(\S+)$", text, flags=re.MULTILINE))
        got = (settings["memtable_prefix_bloom_size_ratio"],
               settings["memtable_whole_key_filtering"])
        assert got == expected, name


def test_rocksdb_module_re_exports_the_options():
    from asyncstate.backends import rocksdb, rocksdb_options

    for name in rocksdb_options.__all__:
        assert name in rocksdb.__all__, name
        assert getattr(rocksdb, name) is getattr(rocksdb_options, name), name


@pytest.mark.timeout(60)
async def test_reopening_with_different_options_keeps_the_state(tmp_path):
    path = tmp_path / "db"
    variants = [RocksDBOptions(),
                RocksDBOptions(block_cache_bytes=0, bloom_filter_bits=0,
                               memtable_bloom_ratio=0, write_buffer_bytes=64 * 1024),
                RocksDBOptions(disable_wal=False, bloom_filter_bits=64,
                               memtable_bloom_ratio=0.25, block_cache_bytes=1 << 20)]
    records = [k for k in range(300)]
    for run, options in enumerate(variants * 2):
        got = await run_operator(Counter(), RocksDBBackend(path, options=options), records)
        assert sorted(got) == [(k, run + 1) for k in records]


@pytest.mark.parametrize(("field", "value"), [
    ("block_cache_bytes", -1), ("block_cache_bytes", 1.5), ("block_cache_bytes", True),
    ("bloom_filter_bits", 65), ("bloom_filter_bits", -1), ("bloom_filter_bits", "10"),
    ("write_buffer_bytes", 64 * 1024 - 1), ("write_buffer_bytes", None),
    ("memtable_bloom_ratio", 0.26), ("memtable_bloom_ratio", -0.01),
    ("memtable_bloom_ratio", float("nan")), ("memtable_bloom_ratio", float("inf")),
    ("memtable_bloom_ratio", True), ("memtable_bloom_ratio", "0.1"),
    ("disable_wal", 0), ("disable_wal", "yes"), ("disable_wal", None),
])
def test_bad_options_raise_config_error_naming_the_option(field, value):
    with pytest.raises(ConfigError) as info:
        RocksDBOptions(**{field: value})
    assert info.value.option == field
    assert str(info.value).startswith(f"{field} must be ")


@pytest.mark.parametrize(("argument", "value"), [
    ("io_parallelism", 0), ("io_parallelism", 65), ("inline_read_keys", -1)])
def test_bad_backend_arguments_raise_config_error_and_create_nothing(tmp_path, argument,
                                                                     value):
    with pytest.raises(ConfigError) as info:
        RocksDBBackend(tmp_path / "db", **{argument: value})
    assert info.value.option == argument
    assert not (tmp_path / "db").exists()


@pytest.mark.parametrize("field", ["block_cache_bytes", "write_buffer_bytes"])
def test_sizes_beyond_64_bits_raise_config_error(tmp_path, field):
    with pytest.raises(ConfigError) as info:
        RocksDBBackend(tmp_path / "db", options=RocksDBOptions(**{field: 2**64})).close()
    assert info.value.option == field


def _family_settings(path, pattern: str) -> dict[str, dict[str, str]]:
    """Per section of the newest OPTIONS file RocksDB wrote in `path`, the settings whose
    names match `pattern`."""
    latest = max(path.glob("OPTIONS-*"), key=lambda p: int(p.name[8:]))
    sections = re.split(r"^\[", latest.read_text(), flags=re.MULTILINE)
    return {s.split("]", 1)[0]: dict(re.findall(rf"^\s*({pattern})=(\S+)$", s,
                                                flags=re.MULTILINE))
            for s in sections if s.startswith(("CFOptions", "DBOptions"))}


@pytest.mark.parametrize("in_place", [True, False])
def test_in_place_updates_reach_the_value_families_only(tmp_path, in_place):
    """Value, reducing and aggregating states update in place; list and map states (which
    clear by range deletion, which RocksDB's in-place updates do not support), timers and
    the metadata family never do."""
    options = RocksDBOptions(inplace_updates=in_place)
    value_states = ("v", "r", "a", ":t")  # ":t": its family name ends as the timers' does
    with RocksDBBackend(tmp_path / "db", options=options) as backend:
        for name, kind in (("v", StateKind.VALUE), ("r", StateKind.REDUCING),
                           ("a", StateKind.AGGREGATING), (":t", StateKind.VALUE),
                           ("l", StateKind.LIST), ("m", StateKind.MAP)):
            backend.register_state(name, kind)
        backend.timer_store("t")
    for reopened in (False, True):
        if reopened:  # a reopened directory gives each existing family its options again
            RocksDBBackend(tmp_path / "db", options=options).close()
        settings = _family_settings(tmp_path / "db",
                                    "inplace_update_support|allow_concurrent_memtable_write")
        assert settings.pop("DBOptions")["allow_concurrent_memtable_write"] == "false"
        # RocksDB escapes the ':' of a family name in the file
        got = {name.split('"')[1].replace("\\:", ":"): s["inplace_update_support"]
               for name, s in settings.items()}
        assert len(got) == 8, got  # the default family, six states, the timers
        assert {name for name, value in got.items() if value == "true"} == (
            {f"state:{n}" for n in value_states} if in_place else set()), (reopened, got)


class _RewriteAfterClear(ast.KeyedProcessFunction):
    """Per key: step 0 writes a long value, map entry and list element; step 1 clears all
    three; step 2 writes shorter ones under the same keys; step 3 emits what it reads."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.value = ctx.get_state(ast.ValueStateDescriptor("v"))
        self.map = ctx.get_map_state(ast.MapStateDescriptor("m"))
        self.list = ctx.get_list_state(ast.ListStateDescriptor("l"))

    async def process_element(self, record, ctx):
        key, step = record
        if step == 0:
            await self.value.update("long " * 8)
            await self.map.put("entry", "long " * 8)
            await self.list.add("long " * 8)
        elif step == 1:
            await self.value.clear()
            await self.map.clear()
            await self.list.clear()
        elif step == 2:
            await self.value.update("short")
            await self.map.put("entry", "short")
            await self.list.update(["short"])
        else:
            ctx.emit((key, await self.value.value(), await self.map.get("entry"),
                      [x async for x in await self.list.get()]))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("in_place", [True, False])
async def test_a_shorter_value_written_after_a_clear_is_read_back(tmp_path, in_place):
    """The older versions stay in the memtable under the clears (a point deletion for the
    value, range deletions for the map and the list). The map's entry is written again
    under the same key: written in place over the old version, it would be hidden by the
    range deletion (it is, when map families get in-place updates). The value (after a
    point deletion RocksDB adds a version) and the list (new element keys) check that the
    other clears read back too."""
    records = [(k, step) for step in range(4) for k in range(50)]
    backend = RocksDBBackend(tmp_path / "db", options=RocksDBOptions(inplace_updates=in_place))
    got = await run_operator(_RewriteAfterClear(), backend, records)
    assert sorted(got) == [(k, "short", "short", ["short"]) for k in range(50)]
