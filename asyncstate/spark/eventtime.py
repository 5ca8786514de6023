"""The event-time records `foreach_batch` keeps in a checkpoint directory, beside its parts.

- Each partition with a timestamp selector writes, before it commits its part, the largest
  event time among its records: ``_EVENT_TIME/part-<parallelism>-<index>.json``. A part that
  is committed therefore has its record (an attempt run again over the same input writes
  the same one), whichever run of a micro-batch committed it.
- After checkpoint N is complete the driver writes ``_EVENT_TIME.json``: the largest event
  time of every batch up to N (that of the checkpoint restored from and of N's parts).

Checkpoint readers look only at ``part-*`` directories; these files do not disturb them.
"""

from __future__ import annotations

import json
import os

from asyncstate.checkpoint.layout import part_name
from asyncstate.checkpoint.reader import open_checkpoint
from asyncstate.errors import CheckpointError, ConfigError
from asyncstate.operator.arguments import check_timestamp

__all__ = ["read_batch_max", "read_record", "write_part_max", "write_record"]

_RECORD = "_EVENT_TIME.json"
_PARTS = "_EVENT_TIME"


def _write_json(path: str, value: int | None) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"max_timestamp": value}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_json(path: str) -> int | None:
    """The timestamp in `path`; None when there is no such file (or it holds none)."""
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read())["max_timestamp"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise CheckpointError(f"the event-time record {path!r} cannot be read: {exc!r}",
                              path=path) from exc
    if value is None:
        return None
    try:
        return check_timestamp("max_timestamp", value)
    except ConfigError as exc:
        raise CheckpointError(f"the event-time record {path!r} is damaged: {exc}",
                              path=path) from exc


def write_part_max(checkpoint: str, parallelism: int, index: int, value: int | None) -> None:
    """Record the largest event time of part `index` of `parallelism` (before it commits)."""
    directory = os.path.join(checkpoint, _PARTS)
    os.makedirs(directory, exist_ok=True)
    _write_json(os.path.join(directory, part_name(parallelism, index) + ".json"), value)


def read_batch_max(checkpoint: str) -> int | None:
    """The largest event time recorded by the committed parts of `checkpoint` (None: none
    recorded)."""
    directory = os.path.join(checkpoint, _PARTS)
    latest: int | None = None
    for part in open_checkpoint(checkpoint).parts:
        value = _read_json(os.path.join(directory, part.name + ".json"))
        if value is not None and (latest is None or value > latest):
            latest = value
    return latest


def read_record(checkpoint: str | None) -> int | None:
    """The largest event time of the batches up to `checkpoint` (None: none recorded)."""
    return None if checkpoint is None else _read_json(os.path.join(checkpoint, _RECORD))


def write_record(checkpoint: str, value: int | None) -> None:
    """Record the largest event time of the batches up to `checkpoint`."""
    _write_json(os.path.join(checkpoint, _RECORD), value)
