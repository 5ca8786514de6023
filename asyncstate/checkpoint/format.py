"""The backend-neutral on-disk checkpoint format: its public names, in one import.

The format lives in three modules:

- `asyncstate.checkpoint.layout`: where a checkpoint's files lie, what a data file and a
  manifest hold, and the names and manifest types that writer and reader share.
- `asyncstate.checkpoint.writer`: `write_part` and its commit protocol.
- `asyncstate.checkpoint.reader`: `open_checkpoint`, `Checkpoint` and the checks made while
  reading.

This module gathers their public names for callers that want the format as a whole.
"""

from __future__ import annotations

from asyncstate.checkpoint.layout import DATA_MAGIC as DATA_MAGIC
from asyncstate.checkpoint.layout import FORMAT_NAME as FORMAT_NAME
from asyncstate.checkpoint.layout import FORMAT_VERSION as FORMAT_VERSION
from asyncstate.checkpoint.layout import MANIFEST_NAME as MANIFEST_NAME
from asyncstate.checkpoint.layout import KeyGroupEntry as KeyGroupEntry
from asyncstate.checkpoint.layout import PartManifest as PartManifest
from asyncstate.checkpoint.layout import checkpoint_path as checkpoint_path
from asyncstate.checkpoint.layout import part_name as part_name
from asyncstate.checkpoint.reader import Checkpoint as Checkpoint
from asyncstate.checkpoint.reader import open_checkpoint as open_checkpoint
from asyncstate.checkpoint.writer import DEFAULT_STALE_AFTER_S as DEFAULT_STALE_AFTER_S
from asyncstate.checkpoint.writer import PackedRecords as PackedRecords
from asyncstate.checkpoint.writer import write_part as write_part

__all__ = [
    "DATA_MAGIC",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "Checkpoint",
    "KeyGroupEntry",
    "PackedRecords",
    "PartManifest",
    "checkpoint_path",
    "open_checkpoint",
    "part_name",
    "write_part",
]
