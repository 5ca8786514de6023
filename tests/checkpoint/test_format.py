"""The on-disk format: records of every key group round-trip through write_part and
open_checkpoint, at every array header size, at msgpack's depth limit and at the largest
max_parallelism; checkpoint/format.py gathers each name from one module."""

from __future__ import annotations

import json
import os
import re

import msgpack
import pytest
from checkpoint_files import (
    STATES,
    committed,
    read_all,
    write_all,
)

from asyncstate.checkpoint import writer
from asyncstate.checkpoint.format import (
    DATA_MAGIC,
    MANIFEST_NAME,
    PackedRecords,
    checkpoint_path,
    open_checkpoint,
    part_name,
    write_part,
)
from asyncstate.errors import CheckpointError
from asyncstate.keygroups import KeyGroupRange

MAX_P = 16


def test_format_gathers_each_public_name_from_exactly_one_module():
    from asyncstate.checkpoint import format as fmt
    from asyncstate.checkpoint import layout, reader

    for name in fmt.__all__:
        homes = [m for m in (layout, writer, reader) if name in m.__all__]
        assert len(homes) == 1, name
        assert getattr(fmt, name) is getattr(homes[0], name), name


@pytest.mark.parametrize("parallelism", [1, 3, 16])
def test_roundtrip_every_key_group(tmp_path, parallelism):
    chk = checkpoint_path(tmp_path, 1)
    expected = write_all(chk, parallelism)
    assert read_all(chk) == expected
    cp = open_checkpoint(chk)
    assert cp.max_parallelism == MAX_P
    assert cp.parallelism == parallelism
    assert cp.states == STATES
    assert cp.extras == [{"index": i} for i in range(parallelism)]
    assert [p.name for p in cp.parts] == [part_name(parallelism, i) for i in range(parallelism)]
    cp.verify()


def test_read_key_groups_reads_exactly_the_range(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    expected = write_all(chk, 3)
    got = read_all(chk, KeyGroupRange(4, 9))
    assert got == {kg: recs for kg, recs in expected.items() if 4 <= kg <= 9}
    assert list(got) == sorted(got)


def test_read_outside_max_parallelism_is_rejected(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    write_all(chk, 1)
    with pytest.raises(CheckpointError, match=r"key groups 10\.\.16 lie outside checkpoint"):
        read_all(chk, KeyGroupRange(10, 16))


def test_extra_may_hold_bytes_and_nested_values(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    extra = {"seq": 12, "ops": {"offsets": [b"\x01\x02", 3, "x"]}, "none": None}
    write_all(chk, 2, extra_of=lambda i: extra)
    assert open_checkpoint(chk).extras == [extra, extra]


def test_packed_records_are_written_verbatim(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    recs = [[1, "a"], [2, b"b"], {"k": 3}]
    data = b"".join(msgpack.packb(r, use_bin_type=True) for r in recs)
    write_part(chk, parallelism=1, operator_index=0, max_parallelism=4, states={},
               key_groups=[(2, PackedRecords(3, data))])
    assert read_all(chk) == {2: recs}


def test_streamed_records_of_a_big_key_group(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    n = 50_000  # several write chunks
    write_part(chk, parallelism=1, operator_index=0, max_parallelism=2, states={},
               key_groups=[(1, ([i, "x" * (i % 7)] for i in range(n)))])
    got = read_all(chk)
    assert list(got) == [1] and len(got[1]) == n and got[1][-1] == [n - 1, "x" * ((n - 1) % 7)]


@pytest.mark.parametrize("n", [0, 1, 15, 16, 65_535, 65_536])
def test_key_groups_of_every_array_header_size_read_back(tmp_path, n):
    """Records are decoded as one array whose header the reader builds from the manifest's
    count: fixarray, array 16 and array 32 headers all give back exactly the records."""
    chk = checkpoint_path(tmp_path, 1)
    write_part(chk, parallelism=1, operator_index=0, max_parallelism=2, states={},
               key_groups=[(0, [[1, 2]]), (1, (i for i in range(n)))])
    got = read_all(chk)
    assert got == ({0: [[1, 2]], 1: list(range(n))} if n else {0: [[1, 2]]})


def test_record_at_msgpacks_depth_limit_reads_back(tmp_path):
    """A record nested as deep as msgpack decodes alone is one level too deep inside the
    one-array decode; the record-by-record decode reads it."""
    deep: object = None
    for _ in range(1024):
        deep = [deep]
    with pytest.raises(ValueError):  # the one-array decode of it fails ...
        msgpack.unpackb(b"\x91" + msgpack.packb(deep))
    chk = checkpoint_path(tmp_path, 1)
    write_part(chk, parallelism=1, operator_index=0, max_parallelism=2, states={},
               key_groups=[(1, [7, deep, "after"])])
    got = read_all(chk)  # ... and the record-by-record one reads it
    assert list(got) == [1] and len(got[1]) == 3  # (== on 1024 levels passes Python's limit)
    assert [msgpack.packb(r) for r in got[1]] == [msgpack.packb(r) for r in (7, deep, "after")]


def test_manifest_describes_the_part(tmp_path):
    chk = checkpoint_path(tmp_path, 3)
    write_all(chk, 2)
    part_dir = os.path.join(chk, "part-2-1")
    with open(os.path.join(part_dir, MANIFEST_NAME)) as f:
        m = json.load(f)
    assert m["format_version"] == 1
    assert (m["max_parallelism"], m["parallelism"], m["operator_index"]) == (MAX_P, 2, 1)
    assert m["key_group_range"] == [8, 15]
    assert m["states"] == STATES
    assert re.fullmatch(r"data-[0-9a-f]{32}\.bin", m["data_file"])
    assert sorted(os.listdir(part_dir)) == sorted([MANIFEST_NAME, m["data_file"]])
    assert [e["key_group"] for e in m["key_groups"]] == [9, 10, 12, 13, 15]
    assert all({"offset", "size", "records", "crc32"} <= set(e) for e in m["key_groups"])
    assert os.path.getsize(os.path.join(part_dir, m["data_file"])) == m["data_size"]
    with open(os.path.join(part_dir, m["data_file"]), "rb") as f:
        assert f.read(len(DATA_MAGIC)) == DATA_MAGIC


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
