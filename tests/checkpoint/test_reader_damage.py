"""Damaged checkpoints are refused, naming the file and the key group: bit flips and
truncations the checksums find, manifests that contradict their data file, and bytes that
pass the checksum but do not decode (through a real two-instance job's checkpoint)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import zlib
from typing import Any

import msgpack
import pytest
from checkpoint_files import (
    damage,
    read_all,
    write_all,
)
from shared_functions import new_backend

import asyncstate as ast
from asyncstate.checkpoint.format import (
    DATA_MAGIC,
    MANIFEST_NAME,
    checkpoint_path,
    open_checkpoint,
    write_part,
)
from asyncstate.checkpoint.snapshot import restore_snapshot
from asyncstate.errors import CheckpointError
from asyncstate.keygroups import KeyGroupRange

MAX_P = 16
PARALLELISM = 2
KEYS = 40
CONFIG = ast.AsyncStateConfig(max_parallelism=MAX_P)
DAMAGED = "part-2-1"  # the second part: the first one reads fine before the damage is met


class Tally(ast.KeyedProcessFunction):
    """Per key: records seen (ValueState) and their items (ListState); emits (key, n, items).
    One operator list state, so each part's extra holds operator state."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))
        self.items = ctx.get_list_state(ast.ListStateDescriptor("items"))
        self.offsets = ctx.get_operator_list_state("offsets")

    async def process_element(self, value: Any, ctx: ast.RecordContext) -> None:
        key, item = value
        n = (await self.count.value() or 0) + 1
        await self.count.update(n)
        await self.items.add(item)
        ctx.emit((key, n, await (await self.items.get()).to_list()))


def _owner(key: str) -> int:
    kg = ast.assign_to_key_group(key, MAX_P)
    return ast.compute_operator_index_for_key_group(MAX_P, PARALLELISM, kg)


async def _write_checkpoint(directory: str, kind: str) -> str:
    """Checkpoint 1 of a two-instance Tally job in which key k<i> saw items i and -i."""
    paths = set()
    for index in range(PARALLELISM):
        fn = Tally()
        backend = new_backend(kind, os.path.join(directory, f"db-{index}"))
        async with ast.KeyedOperator(fn, key_selector=lambda r: r[0], backend=backend,
                                     config=CONFIG, parallelism=PARALLELISM,
                                     operator_index=index) as op:
            await fn.offsets.add(f"offset-{index}")
            for i in range(KEYS):
                if _owner(f"k{i}") == index:
                    await op.process((f"k{i}", i))
                    await op.process((f"k{i}", -i))
            paths.add(await op.snapshot(directory, 1))
    (path,) = paths
    return path


@pytest.fixture(scope="module", params=["heap", "rocksdb"])
def pristine(request: pytest.FixtureRequest,
             tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(backend kind, path) of an undamaged checkpoint, written once per module and kind."""
    directory = str(tmp_path_factory.mktemp(f"pristine-{request.param}"))
    return request.param, asyncio.run(_write_checkpoint(directory, request.param))


class Copy:
    """A private copy of the pristine checkpoint, with the means to damage and restore it."""

    def __init__(self, kind: str, pristine_path: str, tmp: str) -> None:
        self.kind = kind
        self.tmp = tmp
        self.path = checkpoint_path(tmp, 1)
        shutil.copytree(pristine_path, self.path)

    def manifest_path(self, part: str = DAMAGED) -> str:
        return os.path.join(self.path, part, MANIFEST_NAME)

    def manifest(self, part: str = DAMAGED) -> dict[str, Any]:
        with open(self.manifest_path(part), "rb") as f:
            manifest: dict[str, Any] = json.loads(f.read())
        return manifest

    def save_manifest(self, manifest: dict[str, Any], part: str = DAMAGED) -> None:
        with open(self.manifest_path(part), "wb") as f:
            f.write(json.dumps(manifest, indent=1).encode())

    def write_manifest_text(self, text: str, part: str = DAMAGED) -> None:
        with open(self.manifest_path(part), "w") as f:
            f.write(text)

    def data_path(self, part: str = DAMAGED) -> str:
        return os.path.join(self.path, part, self.manifest(part)["data_file"])

    def first_key_group(self, part: str = DAMAGED) -> tuple[int, int]:
        """(key group, records) of the part's first non-empty key group."""
        entry = self.manifest(part)["key_groups"][0]
        return entry["key_group"], entry["records"]

    def payloads(self, part: str = DAMAGED) -> tuple[dict[int, bytes], bytes]:
        """Each listed key group's bytes, and the extra blob's."""
        m = self.manifest(part)
        with open(self.data_path(part), "rb") as f:
            data = f.read()
        groups = {e["key_group"]: data[e["offset"]:e["offset"] + e["size"]]
                  for e in m["key_groups"]}
        extra = m["extra"]
        return groups, data[extra["offset"]:extra["offset"] + extra["size"]]

    def rewrite(self, part: str = DAMAGED, *, key_groups: dict[int, bytes] | None = None,
                extra: bytes | None = None) -> None:
        """Replace key group payloads and/or the extra blob; lay the file out and checksum
        it as `write_part` does, so only the content is wrong, never a size or a CRC."""
        m = self.manifest(part)
        groups, extra_blob = self.payloads(part)
        groups.update(key_groups or {})
        extra_blob = extra_blob if extra is None else extra
        out = bytearray(DATA_MAGIC)
        for entry in m["key_groups"]:
            blob = groups[entry["key_group"]]
            entry.update(offset=len(out), size=len(blob), crc32=zlib.crc32(blob))
            out += blob
        m["extra"] = {"offset": len(out), "size": len(extra_blob), "records": 1,
                      "crc32": zlib.crc32(extra_blob)}
        out += extra_blob
        m["data_size"] = len(out)
        with open(self.data_path(part), "wb") as f:
            f.write(out)
        self.save_manifest(m, part)

    async def restore(self) -> dict[str, tuple[int, list[int]]]:
        """Restore all key groups into one Tally instance, send each key the item 100, and
        return what it emitted per key."""
        fn = Tally()
        backend = new_backend(self.kind, os.path.join(self.tmp, "restored-db"))
        async with ast.KeyedOperator(fn, key_selector=lambda r: r[0], backend=backend,
                                     config=CONFIG, restore_from=self.path) as op:
            for i in range(KEYS):
                await op.process((f"k{i}", 100))
            await op.drain()
            return {key: (n, items) for key, n, items in op.outputs()}


@pytest.fixture
def chk(pristine: tuple[str, str], tmp_path: Any) -> Copy:
    kind, path = pristine
    return Copy(kind, path, str(tmp_path))


def q(path: str) -> str:
    """A path as the messages quote it (repr), escaped for a regex."""
    return re.escape(repr(path))


async def assert_restore_refused(chk: Copy, pattern: str, path: str) -> None:
    with pytest.raises(CheckpointError, match=pattern) as exc:
        await chk.restore()
    assert exc.value.path == path


def _packed(*objs: Any) -> bytes:
    return b"".join(msgpack.packb(o, use_bin_type=True) for o in objs)


def _records(blob: bytes) -> list[Any]:
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(blob)
    return list(unpacker)


async def test_undamaged_copy_restores_every_key(chk: Copy) -> None:
    # The baseline: each test below fails because of its damage, not because of the copy.
    assert await chk.restore() == {f"k{i}": (3, [i, -i, 100]) for i in range(KEYS)}


def test_checkpoint_repr_names_path_max_parallelism_parts_and_states(
        pristine: tuple[str, str]) -> None:
    _, path = pristine
    assert repr(open_checkpoint(path)) == (
        f"<Checkpoint {path!r} max_parallelism={MAX_P} parts=['part-2-0', 'part-2-1'] "
        "states=['count', 'items']>")


@pytest.mark.parametrize("document", ["[]", "null", '"_MANIFEST"', "42", "[{\"format\": 1}]"])
async def test_manifest_that_is_json_but_not_an_object_is_refused(chk: Copy,
                                                                  document: str) -> None:
    chk.write_manifest_text(document)
    path = chk.manifest_path()
    await assert_restore_refused(chk, rf"^checkpoint manifest {q(path)} is not a JSON object$",
                                 path)


@pytest.mark.parametrize("entry", [7, None, "k8", [8, 8, 1, 0]])
async def test_key_group_index_entry_that_is_not_an_object_is_refused(chk: Copy,
                                                                      entry: Any) -> None:
    m = chk.manifest()
    m["key_groups"][1] = entry
    chk.save_manifest(m)
    path = chk.manifest_path()
    await assert_restore_refused(
        chk, rf"^checkpoint manifest {q(path)} has an invalid index entry: "
             rf"{re.escape(repr(entry))}$", path)


@pytest.mark.parametrize("extra", ["missing", None, [8, 0, 1, 0]])
async def test_extra_entry_that_is_not_an_object_is_refused(chk: Copy, extra: Any) -> None:
    m = chk.manifest()
    if extra == "missing":
        del m["extra"]
    else:
        m["extra"] = extra
    chk.save_manifest(m)
    path = chk.manifest_path()
    await assert_restore_refused(chk, rf"^checkpoint manifest {q(path)} has an invalid ", path)


@pytest.mark.parametrize("index", ["missing", None, {}, "8..15"])
async def test_manifest_without_a_key_group_index_list_is_refused(chk: Copy,
                                                                  index: Any) -> None:
    m = chk.manifest()
    if index == "missing":
        del m["key_groups"]
    else:
        m["key_groups"] = index
    chk.save_manifest(m)
    path = chk.manifest_path()
    await assert_restore_refused(chk, rf"^checkpoint manifest {q(path)} has no key group index$",
                                 path)


@pytest.mark.parametrize("change", ["drop-first", "drop-last", "drop-extra-end", "shift-one",
                                    "grow-one", "swap-offsets-of-two"])
async def test_index_that_does_not_cover_the_data_file_exactly_is_refused(
        chk: Copy, change: str) -> None:
    """Every byte after the magic belongs to one key group or to the extra section, so a
    manifest that leaves out written records (which would restore as silently lost state)
    or lets two entries share bytes is refused when the checkpoint is opened."""
    m = chk.manifest()
    assert len(m["key_groups"]) >= 2
    if change == "drop-first":
        del m["key_groups"][0]
    elif change == "drop-last":
        del m["key_groups"][-1]
    elif change == "drop-extra-end":
        m["data_size"] += 1  # the file is then one byte short too: refused either way
    elif change == "shift-one":
        m["key_groups"][1]["offset"] += 1
        m["key_groups"][1]["size"] -= 1
    elif change == "grow-one":
        m["key_groups"][0]["size"] += 1
    else:
        a, b = m["key_groups"][0], m["key_groups"][1]
        a["offset"], b["offset"] = b["offset"], a["offset"]
    chk.save_manifest(m)
    path = chk.manifest_path()
    await assert_restore_refused(chk, rf"^checkpoint manifest {q(path)} has index entries "
                                      r"that (overlap|leave a gap|end at byte)", path)


async def test_index_covering_the_data_file_exactly_in_any_order_restores(chk: Copy) -> None:
    # write_part writes key groups in the order it is given them: file order need not be
    # key group order.
    m = chk.manifest()
    m["key_groups"].reverse()
    chk.save_manifest(m)
    assert await chk.restore() == {f"k{i}": (3, [i, -i, 100]) for i in range(KEYS)}


@pytest.mark.parametrize("field, value", [
    ("size", 0), ("records", 0), ("records", "size+1"), ("records", 2**32),
    ("records", 2**40), ("records", True), ("offset", 7.0 + 1), ("crc32", 2**32)])
async def test_index_entry_with_an_impossible_number_is_refused(chk: Copy, field: str,
                                                                value: Any) -> None:
    m = chk.manifest()
    entry = m["key_groups"][0]
    entry[field] = entry["size"] + 1 if value == "size+1" else value
    chk.save_manifest(m)
    path = chk.manifest_path()
    await assert_restore_refused(
        chk, rf"^checkpoint manifest {q(path)} has an invalid {field!r}: ", path)


@pytest.mark.parametrize("records", [0, 2])
async def test_extra_entry_holding_other_than_one_map_is_refused(chk: Copy,
                                                                 records: int) -> None:
    m = chk.manifest()
    m["extra"]["records"] = records
    chk.save_manifest(m)
    path = chk.manifest_path()
    await assert_restore_refused(
        chk, rf"^checkpoint manifest {q(path)} has an invalid 'records': {records}$", path)


async def test_empty_extra_section_is_refused(chk: Copy) -> None:
    chk.rewrite(extra=b"")
    path = chk.manifest_path()
    await assert_restore_refused(
        chk, rf"^checkpoint manifest {q(path)} has an invalid 'size': 0$", path)


@pytest.mark.parametrize("key", ["key_groups", "states", "data_file", "offset"])
async def test_manifest_giving_a_key_twice_is_refused(chk: Copy, key: str) -> None:
    """JSON parsers keep the last of two equal keys; a manifest is refused instead, since a
    second "key_groups": [] would otherwise drop every key group silently."""
    text = json.dumps(chk.manifest(), indent=1)
    needle = f'"{key}": '
    assert needle in text
    text = text.replace(needle, f'"{key}": null, {needle}', 1)
    chk.write_manifest_text(text)
    path = chk.manifest_path()
    await assert_restore_refused(
        chk, rf"^checkpoint manifest {q(path)} cannot be read: the key {key!r} appears "
             r"twice in one object$", path)


@pytest.mark.parametrize("field, value", [
    ("format_version", True), ("format_version", 1.0), ("key_group_range", "floats"),
    ("attempt", 5), ("attempt", None)])
async def test_manifest_field_of_the_wrong_json_type_is_refused(chk: Copy, field: str,
                                                                value: Any) -> None:
    m = chk.manifest()
    m[field] = [float(x) for x in m[field]] if value == "floats" else value
    chk.save_manifest(m)
    path = chk.manifest_path()
    await assert_restore_refused(chk, rf"^checkpoint manifest {q(path)} ", path)


@pytest.mark.timeout(30)
async def test_manifest_that_is_a_fifo_is_refused_without_blocking(chk: Copy) -> None:
    path = chk.manifest_path()
    os.unlink(path)
    os.mkfifo(path)  # opening it for reading would wait for a writer forever
    await assert_restore_refused(
        chk, rf"^checkpoint manifest {q(path)} cannot be read: {q(path)} is not a regular "
             r"file$", path)


async def test_copy_of_a_part_under_a_non_canonical_name_is_not_a_part(chk: Copy) -> None:
    """`part-02-1` is not the name `write_part` gives operator 1 of 2, so it is not read as
    a second copy of that part (which would be refused as overlapping)."""
    part = os.path.dirname(chk.manifest_path())
    shutil.copytree(part, os.path.join(os.path.dirname(part), "part-02-1"))
    assert await chk.restore() == {f"k{i}": (3, [i, -i, 100]) for i in range(KEYS)}


@pytest.mark.parametrize("magic", [b"ASCKPT\x00\x02", bytes(8), b"PK\x03\x04\x14\x00\x00\x00"])
async def test_data_file_with_bad_magic_is_refused(chk: Copy, magic: bytes) -> None:
    path = chk.data_path()
    with open(path, "r+b") as f:
        f.write(magic)  # same size: only the magic check can notice
    await assert_restore_refused(
        chk, rf"^data file {q(path)} is not an asyncstate checkpoint data file \(bad magic\)$",
        path)


@pytest.mark.parametrize("blob", [
    pytest.param(b"\xc1", id="reserved-byte"),
    pytest.param(b"\x82\xa1a\x01", id="incomplete"),
    pytest.param(_packed({}, {}), id="two-maps"),
    pytest.param(b"\x81\x91\x01\x02", id="list-as-map-key"),
    pytest.param(b"\x91" * 2000 + b"\xc0", id="nested-too-deep"),
])
async def test_extra_section_that_cannot_be_decoded_is_refused(chk: Copy, blob: bytes) -> None:
    chk.rewrite(extra=blob)
    path = chk.data_path()
    await assert_restore_refused(
        chk, rf"^extra section of data file {q(path)} cannot be decoded: ", path)


@pytest.mark.parametrize("value", [[1, 2], None, "operator_state", 7, b"\x80"])
async def test_extra_section_that_is_not_a_map_is_refused(chk: Copy, value: Any) -> None:
    chk.rewrite(extra=_packed(value))
    path = chk.data_path()
    await assert_restore_refused(chk, rf"^extra section of data file {q(path)} is not a map$",
                                 path)


def _vanish(path: str, how: str) -> None:
    os.unlink(path)
    if how == "directory":
        os.mkdir(path)


@pytest.mark.parametrize("how", ["deleted", "directory"])
def test_data_file_that_vanishes_after_open_is_refused_on_read(chk: Copy, how: str) -> None:
    cp = open_checkpoint(chk.path)  # the file is still there and whole
    path = chk.data_path()
    _vanish(path, how)
    pattern = rf"^data file {q(path)} cannot be opened: "
    reader = cp.read_key_groups(KeyGroupRange(0, MAX_P - 1))
    with pytest.raises(CheckpointError, match=pattern) as exc:
        for _ in reader:
            pass
    assert exc.value.path == path
    with pytest.raises(CheckpointError, match=pattern) as exc:
        restore_snapshot(ast.HeapBackend(), cp, KeyGroupRange(0, MAX_P - 1), MAX_P)
    assert exc.value.path == path


@pytest.mark.parametrize("how", ["deleted", "directory"])
def test_verify_of_a_data_file_that_vanished_after_open_is_refused(chk: Copy, how: str) -> None:
    cp = open_checkpoint(chk.path)
    path = chk.data_path()
    _vanish(path, how)
    with pytest.raises(CheckpointError, match=rf"^data file {q(path)} cannot be opened: "):
        cp.verify()


@pytest.mark.parametrize("damage", [
    pytest.param(lambda blob: b"\xc1" * len(blob), id="reserved-bytes"),
    pytest.param(lambda blob: blob + b"\xc1", id="reserved-byte-after-the-records"),
    pytest.param(lambda blob: b"\x81\x91\x01\x02" + blob, id="list-as-map-key"),
    pytest.param(lambda blob: b"\x91" * 2000 + b"\xc0" + blob, id="nested-too-deep"),
])
async def test_key_group_that_passes_its_checksum_but_cannot_be_decoded_is_refused(
        chk: Copy, damage: Any) -> None:
    kg, _ = chk.first_key_group()
    groups, _ = chk.payloads()
    chk.rewrite(key_groups={kg: damage(groups[kg])})
    open_checkpoint(chk.path).verify()  # sizes and checksums are all right
    path = chk.data_path()
    await assert_restore_refused(
        chk, rf"^key group {kg} of data file {q(path)} cannot be decoded: ", path)


@pytest.mark.parametrize("bad", [
    pytest.param(b"\xc1", id="reserved-byte"),
    pytest.param(b"\x01\x02", id="two-ints"),
    pytest.param(b"\xa2\xff\xfe", id="str-not-utf8"),
    pytest.param(b"\x92\x01", id="incomplete-array"),
    pytest.param(b"\x91\x01\xc1", id="array-then-junk"),
    pytest.param(b"\x81\x80\x01", id="map-as-map-key"),
])
@pytest.mark.parametrize("state", ["count", "items"])
async def test_value_bytes_that_pass_the_checksum_but_do_not_decode_are_refused(
        chk: Copy, state: str, bad: bytes) -> None:
    """Both backends check every value at restore (RocksDB stores them undecoded, the heap
    keeps containers packed), so the damage names the file instead of failing a later
    read."""
    kg, _ = chk.first_key_group()
    groups, _ = chk.payloads()
    records = _records(groups[kg])
    for i, record in enumerate(records):
        if type(record) is list and len(record) == 4 and record[0] == state:
            name, key, ns, data = record
            records[i] = [name, key, ns, bad if state == "count" else [*data, bad]]
            break
    else:
        raise AssertionError(f"no entry of {state!r} in key group {kg}")
    chk.rewrite(key_groups={kg: _packed(*records)})
    open_checkpoint(chk.path).verify()
    path = chk.data_path()
    await assert_restore_refused(
        chk, rf"^key group {kg} of data file {q(path)}: malformed state entries \(ValueError: "
             rf"stored value bytes {re.escape(repr(bad))} are not the msgpack bytes of one "
             r"value \(", path)


@pytest.mark.parametrize("change", ["drop-last", "add-one", "manifest-says-one-more"])
async def test_key_group_holding_another_number_of_records_than_its_manifest_is_refused(
        chk: Copy, change: str) -> None:
    kg, n = chk.first_key_group()
    groups, _ = chk.payloads()
    records = _records(groups[kg])
    assert len(records) == n
    if change == "drop-last":
        chk.rewrite(key_groups={kg: _packed(*records[:-1])})
        held, said = n - 1, n
    elif change == "add-one":
        chk.rewrite(key_groups={kg: _packed(*records, None)})
        held, said = n + 1, n
    else:  # PackedRecords with a wrong num_records: the bytes and CRC stay right
        m = chk.manifest()
        m["key_groups"][0]["records"] = n + 1
        chk.save_manifest(m)
        held, said = n, n + 1
    open_checkpoint(chk.path).verify()
    path = chk.data_path()
    await assert_restore_refused(
        chk, rf"^key group {kg} of data file {q(path)} holds {held} records, its manifest "
             rf"says {said}$", path)


@pytest.mark.parametrize("tail", [b"\x92\x01", b"\xdb\xff\xff\xff\xff"],
                         ids=["array-of-2-with-1", "str-of-4-gib"])
async def test_key_group_ending_in_an_incomplete_record_is_refused(chk: Copy,
                                                                   tail: bytes) -> None:
    kg, _ = chk.first_key_group()
    groups, _ = chk.payloads()
    chk.rewrite(key_groups={kg: groups[kg] + tail})  # record count still right
    path = chk.data_path()
    await assert_restore_refused(chk, rf"^key group {kg} of data file {q(path)} ", path)


async def test_manifest_nested_too_deeply_is_refused(chk: Copy) -> None:
    chk.write_manifest_text("[" * 10_000 + "]" * 10_000)
    path = chk.manifest_path()
    await assert_restore_refused(chk, rf"^checkpoint manifest {q(path)} cannot be read: ", path)


async def test_data_file_that_cannot_be_opened_at_open_is_refused(chk: Copy) -> None:
    path = chk.data_path()
    os.unlink(path)
    os.mkdir(path)  # as root, the one way to make stat succeed and open fail
    size = os.stat(path).st_size
    if size < len(DATA_MAGIC):
        pytest.skip(f"directories on this file system have st_size {size}")
    m = chk.manifest()
    m.update(data_size=size, key_groups=[],
             extra={"offset": len(DATA_MAGIC), "size": size - len(DATA_MAGIC), "records": 1,
                    "crc32": 0})
    chk.save_manifest(m)
    await assert_restore_refused(chk, rf"^data file {q(path)} ", path)


@pytest.mark.parametrize("extra", [
    pytest.param({"operator_state": 5}, id="operator-state-not-a-map"),
    pytest.param({"operator_state": {"offsets": {"items": 5}}}, id="items-not-a-list"),
    pytest.param({"list_sequence": "thirty-six"}, id="list-sequence-not-an-int"),
    pytest.param({"list_sequence": -1}, id="list-sequence-negative"),
])
async def test_extra_map_of_the_wrong_shape_is_refused(chk: Copy, extra: Any) -> None:
    chk.rewrite(extra=_packed(extra))
    path = chk.data_path()
    await assert_restore_refused(chk, rf"^extra section of data file {q(path)} ", path)


_SELF: list[Any] = []

_SELF.append(_SELF)


@pytest.mark.parametrize("value", [
    pytest.param(object(), id="object"),
    pytest.param(2**64, id="int-too-big"),
    pytest.param(_SELF, id="self-containing-list"),
])
async def test_extra_msgpack_cannot_encode_is_refused_and_keeps_the_old_part(
        chk: Copy, value: Any) -> None:
    part_dir = os.path.join(chk.path, DAMAGED)
    before = sorted(os.listdir(part_dir))
    with pytest.raises(CheckpointError, match=rf"^extra of checkpoint part {q(part_dir)} "
                                              r"cannot be encoded with msgpack: ") as exc:
        write_part(chk.path, parallelism=PARALLELISM, operator_index=1, max_parallelism=MAX_P,
                   states={}, key_groups=[], extra={"x": value})
    assert exc.value.path == part_dir
    assert sorted(os.listdir(part_dir)) == before
    assert await chk.restore() == {f"k{i}": (3, [i, -i, 100]) for i in range(KEYS)}


def test_bit_flip_is_detected_naming_file_and_key_group(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    write_all(chk, 2)
    part = open_checkpoint(chk).parts[1]
    entry = part.key_groups[12]
    damage(part.data_path, entry.offset + entry.size // 2)
    cp = open_checkpoint(chk)  # sizes are intact: opening succeeds
    assert read_all(chk, KeyGroupRange(0, 7))  # other key groups still read
    pattern = rf"^checksum mismatch in data file '{re.escape(part.data_path)}', key group 12"
    with pytest.raises(CheckpointError, match=pattern) as exc:
        read_all(chk, KeyGroupRange(8, 15))
    assert exc.value.path == part.data_path
    with pytest.raises(CheckpointError, match=pattern):
        cp.verify()


def test_bit_flip_in_extra_is_detected(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    write_all(chk, 1)
    part = open_checkpoint(chk).parts[0]
    damage(part.data_path, part.extra_entry.offset)
    with pytest.raises(CheckpointError, match=r"^checksum mismatch in the extra section of data "
                                              r"file '.*data-[0-9a-f]+\.bin'"):
        open_checkpoint(chk)


def test_truncated_file_is_detected_at_open_naming_file_and_key_groups(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    write_all(chk, 1)
    part = open_checkpoint(chk).parts[0]
    entry = part.key_groups[10]
    os.truncate(part.data_path, entry.offset + 3)
    with pytest.raises(CheckpointError,
                       match=rf"^data file '{re.escape(part.data_path)}' of checkpoint part "
                             rf"part-1-0 has {entry.offset + 3} bytes but its manifest expects "
                             rf"{part.data_size} .*; key groups 10, 12\.\.13, 15 are damaged$"):
        open_checkpoint(chk)


def test_truncation_after_open_is_detected_on_read(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    write_all(chk, 1)
    cp = open_checkpoint(chk)
    part = cp.parts[0]
    os.truncate(part.data_path, part.key_groups[4].offset + 1)
    with pytest.raises(CheckpointError,
                       match=rf"^data file '{re.escape(part.data_path)}' is truncated at key "
                             r"group 4"):
        list(cp.read_key_groups(KeyGroupRange(0, 15)))


def test_missing_data_file_is_named(tmp_path):
    chk = checkpoint_path(tmp_path, 1)
    write_all(chk, 1)
    part = open_checkpoint(chk).parts[0]
    os.unlink(part.data_path)
    with pytest.raises(CheckpointError,
                       match=rf"^data file '{re.escape(part.data_path)}' of checkpoint part "
                             r"part-1-0 is missing"):
        open_checkpoint(chk)


# -- damage that still decodes: only the checksum can tell ----------------------------------


def _overwrite(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_a_changed_character_inside_a_string_is_refused_by_the_checksum(tmp_path: Any) -> None:
    """One letter of a msgpack string changed in place: the key group still decodes, into
    other records, and only its CRC says that the file is not what was written."""
    chk = checkpoint_path(tmp_path, 1)
    write_all(chk, 2)
    part = open_checkpoint(chk).parts[1]
    kg = 12
    entry = part.key_groups[kg]
    with open(part.data_path, "rb") as f:
        f.seek(entry.offset)
        blob = f.read(entry.size)
    at = blob.index(b"r12-1")  # inside the str record field f"r{kg}-{i}"
    changed = blob[:at] + b"s" + blob[at + 1:]
    original, decoded = _records(blob), _records(changed)
    assert len(decoded) == len(original) and decoded != original  # it decodes, to other data
    _overwrite(part.data_path, entry.offset + at, b"s")

    cp = open_checkpoint(chk)  # the sizes are intact
    message = (rf"^checksum mismatch in data file {q(part.data_path)}, key group {kg}: "
               r"the file is damaged$")
    with pytest.raises(CheckpointError, match=message) as exc:
        read_all(chk, KeyGroupRange(8, 15))
    assert exc.value.path == part.data_path
    with pytest.raises(CheckpointError, match=message) as exc:
        cp.verify()
    assert exc.value.path == part.data_path
    assert read_all(chk, KeyGroupRange(0, 7))  # the other part reads fine


async def test_a_changed_value_that_still_decodes_is_refused_at_restore(chk: Copy) -> None:
    """A stored count (msgpack int 2) becomes 3, in place and of the same size: the record,
    its value bytes and the manifest are all well-formed, so without the CRC the restore would
    quietly hand the job a wrong count."""
    kg, _ = chk.first_key_group()
    groups, _ = chk.payloads()
    blob = groups[kg]
    records = _records(blob)
    assert _packed(*records) == blob  # the writer's encoding, reproduced byte for byte
    for i, record in enumerate(records):
        if record[0] == "count":
            assert record[3] == msgpack.packb(2)
            records[i] = [*record[:3], msgpack.packb(3)]
            break
    else:
        raise AssertionError(f"no count in key group {kg}")
    changed = _packed(*records)
    assert len(changed) == len(blob) and _records(changed) == records
    entry = next(e for e in chk.manifest()["key_groups"] if e["key_group"] == kg)
    _overwrite(chk.data_path(), entry["offset"], changed)

    path = chk.data_path()
    await assert_restore_refused(
        chk, rf"^checksum mismatch in data file {q(path)}, key group {kg}: the file is "
             r"damaged$", path)


def test_a_checksum_error_gives_the_key_group_as_an_attribute(tmp_path: Any) -> None:
    chk = checkpoint_path(tmp_path, 1)
    write_all(chk, 1)
    part = open_checkpoint(chk).parts[0]
    entry = part.key_groups[12]
    damage(part.data_path, entry.offset + entry.size // 2)
    with pytest.raises(CheckpointError) as exc:
        read_all(chk)
    assert exc.value.path == part.data_path
    assert exc.value.key_group == 12
