"""RocksDBOptions and the backend's numeric arguments: validation, conversion, and what
reaches RocksDB's column families."""

from __future__ import annotations

import re

import pytest
from backend_harness import (
    run_operator,
)
from shared_functions import Counter

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
                                          r"9223372036854775807\], got 10$"):
        RocksDBOptions(write_buffer_bytes=10)
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
    with pytest.raises(TypeError, match=r"^options must be a RocksDBOptions, got dict$"):
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
