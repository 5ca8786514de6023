"""`open_checkpoint` and `Checkpoint`: open a checkpoint, check it, and read its key groups.

`open_checkpoint` reads every part manifest, checks format version, max_parallelism, that the
parts cover every key group exactly once (or, after a rewrite of the checkpoint id at another
parallelism, which of the complete sets of parts is the checkpoint), and that no manifest
names a file outside its part directory. Reading a key group checks its size and checksum
before decoding anything. Restore decodes only JSON and msgpack (never pickle): a damaged or
hostile checkpoint can fail a restore with `CheckpointError`, not run code.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os
import zlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, BinaryIO, NoReturn

import msgpack

from asyncstate.checkpoint.layout import (
    _DATA_RE,
    _PART_RE,
    CHECKSUM_NAME,
    DATA_MAGIC,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    TTL_DOMAINS,
    KeyGroupEntry,
    PartManifest,
    _read_regular_file,
    part_name,
)
from asyncstate.config import MAX_MAX_PARALLELISM
from asyncstate.errors import CheckpointError
from asyncstate.keygroups import KeyGroupRange, compute_key_group_range_for_operator_index

__all__ = ["Checkpoint", "DataFileError", "open_checkpoint"]

_CRC_MAX = 2**32
_MAX_RECORDS = 2**32 - 1  # the most elements a msgpack array holds


def _ranges(key_groups: Iterable[int]) -> str:
    """Compact text for sorted key groups: ``0..3, 7, 9..12``."""
    runs: list[list[int]] = []
    for kg in key_groups:
        if runs and runs[-1][1] == kg - 1:
            runs[-1][1] = kg
        else:
            runs.append([kg, kg])
    return ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b in runs)


def _inside(path: str, root: str) -> bool:
    real = os.path.realpath(path)
    return real == root or real.startswith(root + os.sep)


class DataFileError(CheckpointError):
    """A committed part's data file does not match its manifest: missing, of another size,
    not a data file, or its extra section damaged (a damaged checkpoint, not an invalid
    one: its manifests are consistent)."""


class _ManifestReader:
    """Typed field access on one parsed manifest, raising CheckpointError naming the file."""

    def __init__(self, path: str, obj: object) -> None:
        self.path = path
        if not isinstance(obj, dict):
            self.fail("is not a JSON object")
        self.obj: dict[str, Any] = obj

    def fail(self, what: str) -> NoReturn:
        raise CheckpointError(f"checkpoint manifest {self.path!r} {what}", path=self.path)

    def get_int(self, obj: Mapping[str, Any], field: str, low: int = 0,
                high: int | None = None) -> int:
        value = obj.get(field)
        if type(value) is not int or value < low or (high is not None and value > high):
            self.fail(f"has an invalid {field!r}: {value!r}")
        return value

    def entry(self, obj: object, data_size: int, min_records: int = 1,
              max_records: int = _MAX_RECORDS) -> KeyGroupEntry:
        """An index entry: a non-empty byte range of the data file holding `records` whole
        msgpack objects (each at least one byte)."""
        if not isinstance(obj, dict):
            self.fail(f"has an invalid index entry: {obj!r}")
        offset = self.get_int(obj, "offset", len(DATA_MAGIC))
        size = self.get_int(obj, "size", 1, data_size - offset)
        records = self.get_int(obj, "records", min_records, min(size, max_records))
        return KeyGroupEntry(offset, size, records,
                             self.get_int(obj, "crc32", 0, _CRC_MAX - 1))

    def check_tiling(self, entries: list[KeyGroupEntry], data_size: int) -> None:
        """The entries must cover the data file after its magic exactly: every byte belongs
        to one key group or to the extra section, so no written records can be left out."""
        end = len(DATA_MAGIC)
        for e in sorted(entries):
            if e.offset != end:
                what = "overlap" if e.offset < end else "leave a gap"
                self.fail(f"has index entries that {what} at byte {min(e.offset, end)} of its "
                          "data file (the key groups and the extra section must cover it "
                          "exactly)")
            end = e.offset + e.size
        if end != data_size:
            self.fail(f"has index entries that end at byte {end}, but its data_size is "
                      f"{data_size} (the key groups and the extra section must cover the data "
                      "file exactly)")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a key given twice (`json` would keep the last silently)."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"the key {key!r} appears twice in one object")
        obj[key] = value
    return obj


def _read_manifest(root: str, part_dir: str, parallelism: int, operator_index: int) -> PartManifest:
    manifest_path = os.path.join(part_dir, MANIFEST_NAME)
    if not _inside(part_dir, root) or not _inside(manifest_path, root):
        raise CheckpointError(
            f"checkpoint part {part_dir!r} resolves outside the checkpoint directory; "
            "refusing to follow it", path=part_dir)
    try:
        raw = json.loads(_read_regular_file(manifest_path),
                         object_pairs_hook=_no_duplicate_keys)
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
        raise CheckpointError(
            f"checkpoint manifest {manifest_path!r} cannot be read: {exc}",
            path=manifest_path) from exc
    m = _ManifestReader(manifest_path, raw)
    obj = m.obj
    if obj.get("format") != FORMAT_NAME:
        m.fail(f"is not an asyncstate checkpoint manifest (format {obj.get('format')!r})")
    version = obj.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:
        m.fail(f"has format version {version!r}; this asyncstate reads version "
               f"{FORMAT_VERSION} only")
    max_p = m.get_int(obj, "max_parallelism", 1, MAX_MAX_PARALLELISM)
    named = (m.get_int(obj, "parallelism", 1), m.get_int(obj, "operator_index"))
    if named != (parallelism, operator_index) or not (
            operator_index < parallelism <= max_p):
        m.fail(f"describes parallelism {obj.get('parallelism')!r} and operator index "
               f"{obj.get('operator_index')!r}, which do not match its directory "
               f"{part_name(parallelism, operator_index)} (max_parallelism {max_p})")
    kg_range = compute_key_group_range_for_operator_index(max_p, parallelism, operator_index)
    claimed = obj.get("key_group_range")
    if not isinstance(claimed, list) or [type(x) for x in claimed] != [int, int] \
            or claimed != [kg_range.start, kg_range.end]:
        m.fail(f"claims key groups {obj.get('key_group_range')!r}, but operator "
               f"{operator_index} of {parallelism} owns {kg_range.start}..{kg_range.end}")
    states = obj.get("states")
    if not isinstance(states, dict) or not all(
            type(k) is str and k and type(v) is str for k, v in states.items()):
        m.fail(f"has invalid states: {states!r}")
    state_ttl = obj.get("state_ttl", {})
    if not isinstance(state_ttl, dict) or not all(
            k in states and v in TTL_DOMAINS for k, v in state_ttl.items()):
        m.fail(f"has invalid state_ttl (want states of 'states' mapped to one of "
               f"{sorted(TTL_DOMAINS)}): {state_ttl!r}")
    data_file = obj.get("data_file")
    if type(data_file) is not str or not _DATA_RE.fullmatch(data_file):
        m.fail(f"names data file {data_file!r}, which is not a plain file name inside its part "
               "directory; refusing to follow it")
    data_path = os.path.join(part_dir, str(data_file))
    if not _inside(data_path, os.path.realpath(part_dir)):
        m.fail(f"names data file {data_file!r}, which resolves outside its part directory; "
               "refusing to follow it")
    data_size = m.get_int(obj, "data_size", len(DATA_MAGIC))
    key_groups: dict[int, KeyGroupEntry] = {}
    raw_index = obj.get("key_groups")
    if not isinstance(raw_index, list):
        m.fail("has no key group index")
    for item in raw_index:
        entry = m.entry(item, data_size)
        kg = m.get_int(item, "key_group")
        if kg not in kg_range or kg in key_groups:
            m.fail(f"lists key group {kg} twice or outside its range "
                   f"{kg_range.start}..{kg_range.end}")
        key_groups[kg] = entry
    extra_entry = m.entry(obj.get("extra"), data_size, 1, 1)  # one msgpack map
    m.check_tiling([*key_groups.values(), extra_entry], data_size)
    attempt = obj.get("attempt")
    if type(attempt) is not str:
        m.fail(f"has an invalid 'attempt': {attempt!r}")
    checksum = obj.get("checksum", CHECKSUM_NAME)
    if checksum != CHECKSUM_NAME:
        m.fail(f"uses checksum {checksum!r}; this asyncstate reads {CHECKSUM_NAME!r} only")
    written_into = obj.get("checkpoint")
    if written_into is not None and (type(written_into) is not str or not written_into):
        m.fail(f"has an invalid 'checkpoint': {written_into!r}")
    written_at: float | None = None  # orders the parts of two runs (else their mtimes do)
    stamp = obj.get("written_at")
    if isinstance(stamp, (int, float)) and type(stamp) is not bool and math.isfinite(stamp):
        written_at = float(stamp)
    part = PartManifest(
        path=part_dir, format_version=FORMAT_VERSION, max_parallelism=max_p,
        parallelism=parallelism, operator_index=operator_index, key_group_range=kg_range,
        states=dict(states), data_file=str(data_file), data_size=data_size,
        key_groups=key_groups, extra_entry=extra_entry, extra={},
        attempt=attempt, state_ttl=dict(state_ttl), written_at=written_at,
        checkpoint=written_into)
    return dataclasses.replace(part, extra=_read_extra(part))


def _read_extra(part: PartManifest) -> dict[str, Any]:
    """Check the data file's size and magic, and decode the part's extra dict."""
    path = part.data_path
    try:
        actual = os.stat(path).st_size
    except OSError as exc:
        raise DataFileError(
            f"data file {path!r} of checkpoint part {part.name} is missing: {exc}",
            path=path) from exc
    if actual != part.data_size:
        damaged = [kg for kg, e in part.key_groups.items() if e.offset + e.size > actual]
        where = (f"key groups {_ranges(sorted(damaged))} are damaged" if damaged
                 else "its extra section is damaged")
        raise DataFileError(
            f"data file {path!r} of checkpoint part {part.name} has {actual} bytes but its "
            f"manifest expects {part.data_size} (truncated or overwritten); {where}", path=path)
    e = part.extra_entry
    with _open_data(path) as f:
        magic = f.read(len(DATA_MAGIC))
        f.seek(e.offset)
        blob = f.read(e.size)
    if magic != DATA_MAGIC:
        raise DataFileError(f"data file {path!r} is not an asyncstate checkpoint data file "
                              "(bad magic)", path=path)
    if len(blob) != e.size or zlib.crc32(blob) != e.crc32:
        raise DataFileError(
            f"checksum mismatch in the extra section of data file {path!r}: the file is damaged",
            path=path)
    try:
        extra = msgpack.unpackb(blob, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise DataFileError(f"extra section of data file {path!r} cannot be decoded: {exc}",
                              path=path) from exc
    if not isinstance(extra, dict):
        raise DataFileError(f"extra section of data file {path!r} is not a map", path=path)
    return extra


class Checkpoint:
    """A complete checkpoint, opened and validated by `open_checkpoint`.

    `parts` are ordered by key group (so by operator index); `states` is the union of every
    part's state kinds, `state_ttl` of their TTL time domains (the states stored with
    timestamps); `extras` lists each part's extra dict in the same order. `superseded`
    names the committed parts left out (of a run the checkpoint id was written again over).
    """

    __slots__ = ("_starts", "max_parallelism", "parts", "path", "state_ttl", "states",
                 "superseded")

    def __init__(self, path: str, max_parallelism: int, parts: list[PartManifest],
                 states: dict[str, str], state_ttl: dict[str, str] | None = None,
                 superseded: list[str] | None = None) -> None:
        self.path = path
        self.superseded = tuple(superseded or ())
        self.max_parallelism = max_parallelism
        self.parts = tuple(sorted(parts, key=lambda p: p.key_group_range.start))
        self.states = states
        self.state_ttl = {} if state_ttl is None else state_ttl
        self._starts = [p.key_group_range.start for p in self.parts]

    def __repr__(self) -> str:
        return (f"<Checkpoint {self.path!r} max_parallelism={self.max_parallelism} "
                f"parts={[p.name for p in self.parts]} states={sorted(self.states)}>")

    @property
    def parallelism(self) -> int:
        """Its number of parts: the parallelism it was written with (parts written at
        different parallelisms may also form a checkpoint, when they cover every key group
        once)."""
        return len(self.parts)

    @property
    def extras(self) -> list[dict[str, Any]]:
        """Each part's extra dict, in operator-index order."""
        return [p.extra for p in self.parts]

    def part_for_key_group(self, key_group: int) -> PartManifest:
        """The part holding `key_group`."""
        self._check_key_group(key_group, key_group)
        return self.parts[bisect.bisect_right(self._starts, key_group) - 1]

    def _check_key_group(self, start: int, end: int) -> None:
        if not (0 <= start <= end < self.max_parallelism):
            raise CheckpointError(
                f"key groups {start}..{end} lie outside checkpoint {self.path!r}, which has "
                f"max_parallelism {self.max_parallelism} "
                f"(key groups 0..{self.max_parallelism - 1})",
                path=self.path)

    def read_key_groups(self, key_group_range: KeyGroupRange
                        ) -> Iterator[tuple[int, Iterator[Any]]]:
        """Yield ``(key_group, records)`` for each non-empty key group of the range, ascending.

        Each key group's size and checksum are verified before any of its records is yielded;
        a damaged file raises CheckpointError naming the file and the key group.
        """
        for kg, records in self.read_key_group_lists(key_group_range):
            yield kg, iter(records)

    def read_key_group_lists(self, key_group_range: KeyGroupRange
                             ) -> Iterator[tuple[int, list[Any]]]:
        """Like `read_key_groups`, with each key group's records as a fresh list."""
        start, end = key_group_range.start, key_group_range.end
        self._check_key_group(start, end)
        for part in self.parts:
            r = part.key_group_range
            lo, hi = max(start, r.start), min(end, r.end)
            wanted = [kg for kg in range(lo, hi + 1) if kg in part.key_groups]
            if not wanted:
                continue
            path = part.data_path
            f = _open_data(path)
            try:
                for kg in wanted:
                    yield kg, _read_key_group(f, path, kg, part.key_groups[kg])
            finally:
                f.close()

    def verify(self, key_groups: KeyGroupRange | None = None) -> None:
        """Read every key group of every part (or those of `key_groups`) and check its size
        and checksum."""
        for part in self.parts:
            entries = [(kg, e) for kg, e in part.key_groups.items()
                       if key_groups is None or kg in key_groups]
            if not entries:
                continue
            with _open_data(part.data_path) as f:
                for kg, e in entries:
                    _read_checked(f, part.data_path, kg, e)


def _open_data(path: str) -> BinaryIO:
    try:
        return open(path, "rb")
    except OSError as exc:
        raise CheckpointError(f"data file {path!r} cannot be opened: {exc}",
                              path=path) from exc


def _read_checked(f: Any, path: str, kg: int, e: KeyGroupEntry) -> bytes:
    f.seek(e.offset)
    data: bytes = f.read(e.size)
    if len(data) != e.size:
        raise CheckpointError(
            f"data file {path!r} is truncated at key group {kg}: expected {e.size} bytes at "
            f"offset {e.offset}, found {len(data)}", path=path, key_group=kg)
    if zlib.crc32(data) != e.crc32:
        raise CheckpointError(
            f"checksum mismatch in data file {path!r}, key group {kg}: the file is damaged",
            path=path, key_group=kg)
    return data


def _read_key_group(f: Any, path: str, kg: int, e: KeyGroupEntry) -> list[Any]:
    """Decode a checked key group: exactly `e.records` whole msgpack records, nothing after.

    The records are decoded as one array whose header says `e.records`, so a count mismatch,
    trailing bytes or an incomplete last record all fail the decode; only then does
    `_decode_stream` walk the records one by one to say which it was.
    """
    data = _read_checked(f, path, kg, e)
    try:
        records: list[Any] = msgpack.unpackb(
            _array_header(e.records) + data, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException):
        return _decode_stream(data, path, kg, e.records)
    return records


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 2**16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def _decode_stream(data: bytes, path: str, kg: int, expected: int) -> list[Any]:
    """Decode `data` record by record; raise the CheckpointError saying why it is not
    `expected` whole records (the records themselves when it is, which the one-array decode
    refuses only for a record nested one level short of msgpack's depth limit)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False,
                                max_buffer_size=max(len(data), 1))
    unpacker.feed(data)
    records: list[Any] = []
    end = 0
    try:
        for record in unpacker:
            records.append(record)
            end = unpacker.tell()
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise CheckpointError(f"key group {kg} of data file {path!r} cannot be decoded: {exc}",
                              path=path, key_group=kg) from exc
    if end != len(data):
        raise CheckpointError(
            f"key group {kg} of data file {path!r} cannot be decoded: it ends in an incomplete "
            f"record ({len(data) - end} bytes after record {len(records)})", path=path,
            key_group=kg)
    if len(records) != expected:
        raise CheckpointError(
            f"key group {kg} of data file {path!r} holds {len(records)} records, its manifest "
            f"says {expected}", path=path, key_group=kg)
    return records


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Open the checkpoint at `path` and check that it is complete and consistent.

    Raises CheckpointError naming the missing part or key groups, overlapping parts, a
    max_parallelism mismatch, a missing or truncated data file, or a manifest that points
    outside the checkpoint.
    """
    root = os.fspath(path)
    if not os.path.isdir(root):
        raise CheckpointError(f"checkpoint {root!r} does not exist or is not a directory",
                              path=root)
    real_root = os.path.realpath(root)
    parts: list[PartManifest] = []
    committed_at: dict[str, float] = {}  # part name -> its manifest's mtime (s)
    uncommitted: list[str] = []
    try:
        names = sorted(os.listdir(root))
    except OSError as exc:
        raise CheckpointError(f"checkpoint {root!r} cannot be listed: {exc}",
                              path=root) from exc
    for name in names:
        match = _PART_RE.fullmatch(name)
        part_dir = os.path.join(root, name)
        if match is None or not os.path.isdir(part_dir):
            continue
        manifest_path = os.path.join(part_dir, MANIFEST_NAME)
        try:
            committed_at[name] = os.lstat(manifest_path).st_mtime
        except FileNotFoundError:
            uncommitted.append(name)
            continue
        except OSError as exc:  # say, a part directory that cannot be searched
            raise CheckpointError(f"checkpoint manifest {manifest_path!r} cannot be read: "
                                  f"{exc}", path=manifest_path) from exc
        parts.append(_read_manifest(real_root, part_dir, int(match[1]), int(match[2])))
    if not parts:
        hint = (f" ({', '.join(uncommitted)} never committed: its writer did not finish)"
                if uncommitted else "")
        raise CheckpointError(
            f"checkpoint {root!r} has no committed part (no part-*/{MANIFEST_NAME}){hint}",
            path=root)
    parts, superseded = _choose_parts(root, parts, committed_at, uncommitted)
    origins = {p.checkpoint for p in parts if p.checkpoint is not None}
    if len(origins) > 1:
        written = ", ".join(f"{p.name} into {p.checkpoint!r}" for p in parts
                            if p.checkpoint is not None)
        raise CheckpointError(
            f"checkpoint {root!r} holds parts written into different checkpoints ({written}): "
            "a part was copied in from another checkpoint; restoring would mix their states",
            path=root)
    max_p = parts[0].max_parallelism
    states: dict[str, str] = {}
    for p in parts:
        for state, kind in p.states.items():
            if states.setdefault(state, kind) != kind:
                raise CheckpointError(
                    f"checkpoint {root!r} has state {state!r} as {states[state]} state in one "
                    f"part and as {kind} state in {p.name}", path=root)
    # A state's values are timestamped in every part that holds it, or in none.
    state_ttl: dict[str, str] = {}
    for state in states:
        layouts = {p.state_ttl.get(state) for p in parts if state in p.states}
        if len(layouts) > 1:
            described = ", ".join(f"{p.name}: {p.state_ttl.get(state) or 'no timestamps'}"
                                  for p in parts if state in p.states)
            raise CheckpointError(
                f"checkpoint {root!r} stores state {state!r} with TTL timestamps in some parts "
                f"and not in others ({described}); it cannot be read as one state", path=root)
        layout = layouts.pop() if layouts else None
        if layout is not None:
            state_ttl[state] = layout
    return Checkpoint(root, max_p, parts, states, state_ttl, superseded)


def _choose_parts(root: str, parts: list[PartManifest], committed_at: dict[str, float],
                  uncommitted: list[str]) -> tuple[list[PartManifest], list[str]]:
    """The committed parts that form the checkpoint, and the names of those left out.

    Every part, when they share one max_parallelism and cover every key group exactly once
    (at one parallelism, or at several). Otherwise, when the parts of one parallelism (and
    max_parallelism) do, those: the checkpoint id was written again at another parallelism
    and the parts of the other run are superseded, or the rewrite has not finished (or
    crashed) and the parts it committed so far are not a checkpoint yet. When several sets
    are complete, the one whose last part was committed last (by the writer's clock, which
    its manifest records, else by the manifest's mtime). Otherwise CheckpointError naming
    what is missing or overlapping."""
    max_ps = {p.max_parallelism for p in parts}
    if len(max_ps) == 1 and _coverage_problem(root, parts, max_ps.pop(), uncommitted) is None:
        return parts, []
    runs: dict[tuple[int, int], list[PartManifest]] = {}
    for p in parts:
        runs.setdefault((p.max_parallelism, p.parallelism), []).append(p)
    complete = [run for (max_p, _n), run in runs.items()
                if _coverage_problem(root, run, max_p, []) is None]
    if complete:
        def last_commit(run: list[PartManifest]) -> float:
            return max(committed_at[p.name] if p.written_at is None else p.written_at
                       for p in run)

        chosen = max(complete, key=last_commit)
        names = {p.name for p in chosen}
        return chosen, sorted(p.name for p in parts if p.name not in names)
    if len(max_ps) > 1:
        described = ", ".join(f"{p.name}: {p.max_parallelism}" for p in parts)
        raise CheckpointError(
            f"checkpoint {root!r} mixes parts written with different max_parallelism "
            f"({described})", path=root)
    problem = _coverage_problem(root, parts, parts[0].max_parallelism, uncommitted)
    assert problem is not None
    raise problem


def _coverage_problem(root: str, parts: list[PartManifest], max_p: int,
                      uncommitted: list[str]) -> CheckpointError | None:
    """The error saying how `parts` fail to cover every key group exactly once, or None."""
    owner: list[PartManifest | None] = [None] * max_p
    overlaps: dict[tuple[str, str], list[int]] = {}
    for p in parts:
        for kg in p.key_group_range:
            other = owner[kg]
            if other is not None:
                overlaps.setdefault((other.name, p.name), []).append(kg)
            else:
                owner[kg] = p
    if overlaps:
        (a, b), kgs = next(iter(overlaps.items()))
        return CheckpointError(
            f"checkpoint {root!r} has overlapping parts: key groups {_ranges(kgs)} are covered "
            f"by both {a} and {b}", path=root)
    missing = [kg for kg, p in enumerate(owner) if p is None]
    if missing:
        parallelisms = {p.parallelism for p in parts}
        hint = ""
        if len(parallelisms) == 1:
            par = parallelisms.pop()
            present = {p.operator_index for p in parts}
            names = [part_name(par, i) for i in range(par) if i not in present]
            hint = f"; missing part {', '.join(names)}"
        if uncommitted:
            hint += f" ({', '.join(uncommitted)} never committed: its writer did not finish)"
        return CheckpointError(
            f"checkpoint {root!r} is incomplete: key groups {_ranges(missing)} are not covered "
            f"by any committed part{hint}", path=root)
    return None
