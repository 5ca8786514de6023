"""`write_part`: write and commit one operator's part of a checkpoint.

Commit protocol of `write_part` (why: a writer may be killed at any instant, and a retried
writer must replace, never duplicate):

1. Write the data file under a fresh, attempt-unique name; flush and fsync it; fsync the part
   directory.
2. Write the manifest to ``_MANIFEST.json.tmp-<attempt>``, fsync it, `os.replace` it onto
   ``_MANIFEST.json``, fsync the part directory. The rename is the commit point: before it
   the previous manifest (if any) and its data file are untouched; after it the new ones are.
3. Delete the data file the replaced manifest named, and leftovers of dead attempts older
   than `stale_after_s` (younger ones may belong to a concurrent attempt still writing).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import math
import os
import shutil
import time
import uuid
import zlib
from collections.abc import Iterable, Mapping
from typing import Any, BinaryIO, NamedTuple

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
from asyncstate.config import MAX_MAX_PARALLELISM, check_int
from asyncstate.errors import CheckpointError, ConfigError
from asyncstate.keygroups import compute_key_group_range_for_operator_index
from asyncstate.runtime.requests import StateKind

__all__ = ["DEFAULT_STALE_AFTER_S", "PackedRecords", "remove_superseded_parts", "write_part"]

DEFAULT_STALE_AFTER_S = 600.0

_TMP_PREFIX = MANIFEST_NAME + ".tmp-"
_KINDS = frozenset(kind.value for kind in StateKind)
_CHUNK_RECORDS = 8192  # records packed per write call: bounds memory within a key group
_WRITE_BUFFER = 1 << 20


class PackedRecords(NamedTuple):
    """A key group's records already msgpack-encoded back to back: `num_records` objects in
    `data`.

    Lets a producer that encodes while it walks its storage skip a decode/encode round trip;
    the count is checked when the key group is read back.
    """

    num_records: int
    data: bytes


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _makedirs_durable(path: str, resync: int = 0) -> None:
    """Create `path` and missing parents, fsyncing each parent whose entries changed. The
    parents of the `resync` innermost levels are fsynced even when those levels exist: a
    writer killed between a mkdir and its parent's fsync leaves an entry never made
    durable, which the next writer finds in place."""
    exists = os.path.isdir(path)
    if exists and resync <= 0:
        return
    parent = os.path.dirname(os.path.abspath(path))
    _makedirs_durable(parent, resync - 1)
    if not exists:
        with contextlib.suppress(FileExistsError):  # a concurrent writer made it
            os.mkdir(path)
    _fsync_dir(parent)


class _Unencodable(Exception):
    """msgpack refused a record (its error is the cause)."""


def _io_error(pname: str, path: str, exc: OSError) -> CheckpointError:
    return CheckpointError(f"checkpoint part {pname} cannot be written: {path!r}: {exc}",
                           path=path)


class _DataSink:
    """The data file being written. Its OSErrors become CheckpointError naming the file; a
    record source's own errors (raised while its records are read) pass through unchanged."""

    __slots__ = ("_f", "path", "pname")

    def __init__(self, path: str, pname: str) -> None:
        self.path = path
        self.pname = pname
        try:
            # closed by finish() or discard()
            self._f: BinaryIO | None = open(path, "xb", buffering=_WRITE_BUFFER)  # noqa: SIM115
        except OSError as exc:
            raise _io_error(pname, path, exc) from exc

    def write(self, data: bytes) -> None:
        try:
            self._f.write(data)  # type: ignore[union-attr]
        except OSError as exc:
            raise _io_error(self.pname, self.path, exc) from exc

    def finish(self) -> None:
        """Flush, fsync and close the file."""
        f = self._f
        assert f is not None
        try:
            f.flush()
            os.fsync(f.fileno())
            self._f = None
            f.close()
        except OSError as exc:
            raise _io_error(self.pname, self.path, exc) from exc

    def discard(self) -> None:
        """Close the file after a failure, ignoring further I/O errors."""
        f, self._f = self._f, None
        if f is not None:
            with contextlib.suppress(OSError):
                f.close()


def _write_key_group(f: _DataSink, packer: msgpack.Packer,
                     records: Iterable[Any]) -> tuple[int, int, int]:
    """Pack and write one key group's records; return (size, count, crc32)."""
    if type(records) is PackedRecords:
        f.write(records.data)
        return len(records.data), records.num_records, zlib.crc32(records.data)
    size = count = crc = 0
    pack = packer.pack
    it = iter(records)
    while True:
        # islice + map keep the per-record loop in C.
        chunk = list(itertools.islice(it, _CHUNK_RECORDS))
        if not chunk:
            break
        try:
            collections.deque(map(pack, chunk), 0)
        except (TypeError, ValueError, OverflowError) as exc:  # not the source's own errors
            raise _Unencodable(exc) from exc
        data = packer.bytes()
        packer.reset()
        crc = zlib.crc32(data, crc)
        size += len(data)
        count += len(chunk)
        f.write(data)
        if len(chunk) < _CHUNK_RECORDS:
            break
    return size, count, crc


def write_part(
    checkpoint_dir: str | os.PathLike[str],
    *,
    parallelism: int,
    operator_index: int,
    max_parallelism: int,
    states: Mapping[str, str],
    key_groups: Iterable[tuple[int, Iterable[Any]]],
    extra: Mapping[str, Any] | None = None,
    stale_after_s: float = DEFAULT_STALE_AFTER_S,
    state_ttl: Mapping[str, str] | None = None,
) -> PartManifest:
    """Write and commit operator `operator_index`'s part of the checkpoint at `checkpoint_dir`.

    `key_groups` yields ``(key_group, records)`` for key groups of this operator's range, each
    at most once, in any order; records are msgpack-encodable objects, streamed, or a
    `PackedRecords`. `states` maps
    state names to kinds; `extra` is any msgpack-encodable dict (operator state, sequence
    numbers); `state_ttl` maps the states stored with TTL timestamps to their time domain.
    Writing a part that already exists replaces it atomically (see the module
    docstring). Raises CheckpointError naming the part and key group for a record that cannot
    be encoded or a key group outside the range; the previous part, if any, stays intact.
    """
    check_int("max_parallelism", max_parallelism, 1, MAX_MAX_PARALLELISM)
    check_int("parallelism", parallelism, 1, max_parallelism)
    check_int("operator_index", operator_index, 0, parallelism - 1)
    kg_range = compute_key_group_range_for_operator_index(
        max_parallelism, parallelism, operator_index)
    state_kinds = dict(states)
    for name, kind in state_kinds.items():
        if type(name) is not str or not name or type(kind) is not str:
            raise TypeError(f"states must map non-empty str names to str kinds, got "
                            f"{name!r}: {kind!r}")
        if kind not in _KINDS:
            raise ValueError(f"state {name!r} has the unknown kind {kind!r} (want one of "
                             f"{', '.join(sorted(_KINDS))})")
    ttl = dict(state_ttl or {})
    for name, domain in ttl.items():
        if name not in state_kinds or domain not in TTL_DOMAINS:
            raise ValueError(f"state_ttl names state {name!r} with time domain {domain!r}: "
                             f"want a state of `states` and one of {sorted(TTL_DOMAINS)}")
    part_dir = os.path.join(os.fspath(checkpoint_dir), part_name(parallelism, operator_index))
    pname = part_name(parallelism, operator_index)
    # Recorded in the manifest: the parts of one checkpoint name the same directory, so a
    # part copied in from another checkpoint is refused.
    checkpoint_name = os.path.basename(os.path.abspath(os.fspath(checkpoint_dir)))
    if isinstance(stale_after_s, bool) or not isinstance(stale_after_s, (int, float)) \
            or not 0 <= stale_after_s < math.inf:
        raise ConfigError("stale_after_s", stale_after_s, "a finite number of seconds >= 0")
    try:
        extra_bytes = msgpack.packb(dict(extra or {}), use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise CheckpointError(
            f"extra of checkpoint part {part_dir!r} cannot be encoded with msgpack: {exc}",
            path=part_dir) from exc
    try:  # as the reader decodes it: a dict with tuple keys, say, packs but does not read back
        msgpack.unpackb(extra_bytes, raw=False, strict_map_key=False)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"extra of checkpoint part {part_dir!r} is encoded by msgpack but does not read "
            f"back: {exc}", path=part_dir) from exc

    try:
        _makedirs_durable(part_dir, resync=2)  # the part and checkpoint directories
    except OSError as exc:
        raise _io_error(pname, part_dir, exc) from exc
    attempt = uuid.uuid4().hex
    data_file = f"data-{attempt}.bin"
    data_path = os.path.join(part_dir, data_file)
    tmp_path = os.path.join(part_dir, _TMP_PREFIX + attempt)
    manifest_path = os.path.join(part_dir, MANIFEST_NAME)
    index: dict[int, KeyGroupEntry] = {}
    committed = False
    sink: _DataSink | None = None
    try:
        sink = f = _DataSink(data_path, pname)
        f.write(DATA_MAGIC)
        offset = len(DATA_MAGIC)
        packer = msgpack.Packer(use_bin_type=True, autoreset=False)
        for kg, records in key_groups:
            if type(kg) is not int or kg not in kg_range:
                raise CheckpointError(
                    f"key group {kg!r} is outside the key groups "
                    f"{kg_range.start}..{kg_range.end} of checkpoint part {pname} "
                    f"(max_parallelism {max_parallelism})", path=part_dir)
            if kg in index:
                raise CheckpointError(
                    f"key group {kg} given twice while writing checkpoint part {pname}",
                    path=part_dir)
            if type(records) is PackedRecords and not (
                    (1 if records.data else 0) <= records.num_records <= len(records.data)):
                # Each msgpack object takes at least one byte.
                raise CheckpointError(
                    f"key group {kg} of checkpoint part {pname}: PackedRecords of "
                    f"{len(records.data)} bytes claims {records.num_records} records",
                    path=part_dir)
            try:
                size, count, crc = _write_key_group(f, packer, records)
            except _Unencodable as exc:
                cause = exc.__cause__
                raise CheckpointError(
                    f"a record of key group {kg} in checkpoint part {pname} cannot be "
                    f"encoded with msgpack: {cause}", path=part_dir) from cause
            if count:
                index[kg] = KeyGroupEntry(offset, size, count, crc)
                offset += size
        extra_entry = KeyGroupEntry(offset, len(extra_bytes), 1, zlib.crc32(extra_bytes))
        f.write(extra_bytes)
        data_size = offset + len(extra_bytes)
        f.finish()
        manifest = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "max_parallelism": max_parallelism,
            "parallelism": parallelism,
            "operator_index": operator_index,
            "key_group_range": [kg_range.start, kg_range.end],
            "states": dict(sorted(state_kinds.items())),
            **({"state_ttl": dict(sorted(ttl.items()))} if ttl else {}),
            "attempt": attempt,
            "written_at": time.time(),
            **({"checkpoint": checkpoint_name} if checkpoint_name else {}),
            "checksum": CHECKSUM_NAME,
            "data_file": data_file,
            "data_size": data_size,
            "extra": extra_entry._asdict(),
            "key_groups": [
                {"key_group": kg, **index[kg]._asdict()} for kg in sorted(index)],
        }
        previous = _commit(part_dir, pname, data_path, tmp_path, manifest_path,
                           json.dumps(manifest, indent=1).encode())
        committed = True
        with contextlib.suppress(OSError):  # committed: the rename is durable at the next sync
            _fsync_dir(part_dir)
    finally:
        if sink is not None:
            sink.discard()
        # An interruption (KeyboardInterrupt, say) right after the rename leaves `committed`
        # False, with the new manifest in place: its data file must stay.
        if not committed and _committed_data_file(manifest_path) != data_file:
            for leftover in (data_path, tmp_path):
                with contextlib.suppress(OSError):
                    os.unlink(leftover)
    if previous is not None and previous != data_file:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(part_dir, previous))
    _remove_stale(part_dir, data_file, stale_after_s)
    return PartManifest(
        path=part_dir, format_version=FORMAT_VERSION, max_parallelism=max_parallelism,
        parallelism=parallelism, operator_index=operator_index, key_group_range=kg_range,
        states=state_kinds, data_file=data_file, data_size=data_size, key_groups=index,
        extra_entry=extra_entry, extra=dict(extra or {}), attempt=attempt, state_ttl=ttl)


def _commit(part_dir: str, pname: str, data_path: str, tmp_path: str, manifest_path: str,
            manifest: bytes) -> str | None:
    """Make the data file durable, write the manifest beside it and rename it into place
    (the commit point). Returns the data file the replaced manifest named, if any."""
    path = part_dir
    try:
        _fsync_dir(part_dir)
        path = tmp_path
        with open(tmp_path, "xb") as f:
            f.write(manifest)
            f.flush()
            os.fsync(f.fileno())
        previous = _committed_data_file(manifest_path)
        # Another attempt's cleanup may have taken the data file (see _remove_stale): never
        # commit a manifest naming a file that is gone.
        path = data_path
        os.stat(data_path)
        path = manifest_path
        os.replace(tmp_path, manifest_path)
    except OSError as exc:
        raise _io_error(pname, path, exc) from exc
    return previous


def _committed_data_file(manifest_path: str) -> str | None:
    """The data file named by the currently committed manifest, if it is readable and sane
    (a damaged manifest, even a FIFO or one nested too deeply, names none)."""
    try:
        name = json.loads(_read_regular_file(manifest_path)).get("data_file")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return name if isinstance(name, str) and _DATA_RE.fullmatch(name) else None


def _remove_stale(part_dir: str, keep: str, stale_after_s: float) -> None:
    """Delete data and temp files of dead attempts (never `keep` or the file of the manifest
    now in place, which a concurrent attempt may have committed; never young files)."""
    now = time.time()
    current = _committed_data_file(os.path.join(part_dir, MANIFEST_NAME))
    try:
        names = os.listdir(part_dir)
    except OSError:
        return
    for name in names:
        ours = _DATA_RE.fullmatch(name) or name.startswith(_TMP_PREFIX)
        if name in (keep, current) or not ours:
            continue
        path = os.path.join(part_dir, name)
        with contextlib.suppress(OSError):
            if now - os.stat(path).st_mtime >= stale_after_s:
                os.unlink(path)


def remove_superseded_parts(checkpoint: str, parallelism: int) -> list[str]:
    """Once every part of a run at `parallelism` is committed: remove the parts of checkpoint
    directory `checkpoint` written at other parallelisms (a run the checkpoint id was written
    over), which the reader leaves out anyway. Returns the names removed. Each part's manifest
    goes first, so a removal cut short leaves an uncommitted directory, never a committed part
    without its data file."""
    removed: list[str] = []
    try:
        names = sorted(os.listdir(checkpoint))
    except OSError:
        return removed
    for name in names:
        match = _PART_RE.fullmatch(name)
        if match is None or int(match[1]) == parallelism:
            continue
        part_dir = os.path.join(checkpoint, name)
        try:
            os.remove(os.path.join(part_dir, MANIFEST_NAME))
        except FileNotFoundError:
            pass
        except OSError:
            continue  # left in place: the reader still leaves it out
        shutil.rmtree(part_dir, ignore_errors=True)
        removed.append(name)
    return removed
