"""Where a checkpoint's files lie, and the names and manifest types writer and reader share.

Layout::

    <directory>/chk-<id>/                     checkpoint_path(directory, id)
        part-<parallelism>-<index>/           one per operator instance
            data-<attempt>.bin                key-group streams, then the `extra` blob
            _MANIFEST.json                    written last: the part's commit point

A data file starts with the 8-byte magic ``ASCKPT\\x00\\x01``; then, for each non-empty key
group of the part in ascending order, a stream of msgpack records (opaque to this module);
then the part's `extra` dict, msgpack-encoded. The manifest (JSON) records the format
version, max_parallelism, parallelism, operator index, key group range, state names and kinds,
the data file's name and size, and for each non-empty key group its offset, size, record count
and CRC-32, and the same for the extra blob. `state_ttl` (present when some state is stored
with TTL timestamps) maps those states to the time domain of their timestamps
("processing_time" or "event_time"); their values are timestamped
(`asyncstate.state.ttl.layout`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
from typing import Any, NamedTuple

from asyncstate.config import check_int
from asyncstate.keygroups import KeyGroupRange

__all__ = [
    "CHECKSUM_NAME",
    "DATA_MAGIC",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "TTL_DOMAINS",
    "KeyGroupEntry",
    "PartManifest",
    "checkpoint_path",
    "part_name",
]

FORMAT_VERSION = 1
FORMAT_NAME = "asyncstate-checkpoint"
CHECKSUM_NAME = "crc32"  # of every key group's bytes and of the extra blob
MANIFEST_NAME = "_MANIFEST.json"
DATA_MAGIC = b"ASCKPT\x00\x01"
_MAX_MANIFEST_BYTES = 64 << 20
TTL_DOMAINS = frozenset({"processing_time", "event_time"})  # values of `state_ttl`


def _read_regular_file(path: str, limit: int = _MAX_MANIFEST_BYTES) -> bytes:
    """The bytes of `path`, which must be a regular file of at most `limit` bytes (a FIFO or
    device would block or never end). OSError otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path!r} is not a regular file")
        if st.st_size > limit:
            raise OSError(f"{path!r} has {st.st_size} bytes, more than a manifest has "
                          f"({limit})")
        return f.read(limit + 1)

# Canonical part names only (no leading zeros), so one part has one directory name.
_PART_RE = re.compile(r"part-(0|[1-9][0-9]{0,4})-(0|[1-9][0-9]{0,4})")
# Data file names are plain names inside the part directory: no separators, no "..".
_DATA_RE = re.compile(r"data-[0-9A-Za-z_-]{1,128}\.bin")


def checkpoint_path(directory: str | os.PathLike[str], checkpoint_id: object) -> str:
    """Path of checkpoint `checkpoint_id` (an int >= 0) under `directory`:
    ``<directory>/chk-<id>``."""
    checked = check_int("checkpoint_id", checkpoint_id, 0)
    return os.path.join(os.fspath(directory), f"chk-{checked}")


def part_name(parallelism: int, operator_index: int) -> str:
    """Directory name of one operator's part: ``part-<parallelism>-<index>``."""
    return f"part-{parallelism}-{operator_index}"


class KeyGroupEntry(NamedTuple):
    """Where one key group's records lie in a data file."""

    offset: int
    size: int
    records: int
    crc32: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PartManifest:
    """One committed part: what its `_MANIFEST.json` says, plus its decoded `extra` dict."""

    path: str  # the part directory
    format_version: int
    max_parallelism: int
    parallelism: int
    operator_index: int
    key_group_range: KeyGroupRange
    states: dict[str, str]
    data_file: str
    data_size: int
    key_groups: dict[int, KeyGroupEntry]  # non-empty key groups only
    extra_entry: KeyGroupEntry
    extra: dict[str, Any]
    attempt: str
    state_ttl: dict[str, str] = dataclasses.field(default_factory=dict)
    written_at: float | None = None  # the writer's clock (s) just before its commit
    # The name of the checkpoint directory it was written into (None: not recorded)
    checkpoint: str | None = None

    @property
    def name(self) -> str:
        """The part directory's name, ``part-<parallelism>-<index>``."""
        return part_name(self.parallelism, self.operator_index)

    @property
    def data_path(self) -> str:
        """Path of the part's data file."""
        return os.path.join(self.path, self.data_file)

    @property
    def records(self) -> int:
        """Total number of records in the part."""
        return sum(e.records for e in self.key_groups.values())
