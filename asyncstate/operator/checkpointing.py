"""Restore and snapshot of one operator's part of a checkpoint.

Restore checks everything it can before any state moves (the checkpoint is complete, its
operator state and the key groups this instance restores are intact), so a refused restore
leaves a backend's directory as it was; a `RestorableBackend` is marked while the restore
runs, so one failing midway leaves the directory refused rather than half restored.
A snapshot holds the admission gate, drains, and writes the backend's key groups of this
instance plus the operator state, so no record is half done in it.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from asyncstate.backends.base import BackendCapabilities
from asyncstate.checkpoint.layout import checkpoint_path
from asyncstate.checkpoint.operator_state import RestoredExtras, read_operator_extras
from asyncstate.checkpoint.reader import open_checkpoint
from asyncstate.checkpoint.snapshot import (
    SectionHandler,
    SectionSource,
    check_restorable,
    restore_snapshot,
    write_snapshot,
)
from asyncstate.keygroups import KeyGroupRange
from asyncstate.operator.admission import AdmissionGate

__all__ = ["restore", "snapshot", "write"]


def restore(capabilities: BackendCapabilities, path: str, key_groups: KeyGroupRange,
            max_parallelism: int,
            open_sections: Callable[[], Mapping[int, SectionHandler]]) -> RestoredExtras:
    """Restore `key_groups` of the checkpoint at `path` into the backend; returns what the
    runtime context needs of the checkpoint (operator state, state kinds).
    `open_sections()`, called once the backend's old state is gone, returns the handlers of
    the checkpoint's other sections (timers)."""
    checkpoint = open_checkpoint(path)  # checks the parts cover every key group
    extras = read_operator_extras(checkpoint)  # checked before any state moves
    check_restorable(checkpoint, key_groups, max_parallelism)
    store = capabilities.checkpoint_store(checkpoint.path)
    for cache in capabilities.caches:  # what they hold is about to be replaced
        cache.invalidate()
    restorable = capabilities.restorable
    if restorable is not None:
        restorable.mark_restoring(True)  # a restore failing from here leaves it refused
        restorable.discard_state()  # a directory used before: the checkpoint replaces it
    restore_snapshot(store, checkpoint, key_groups, max_parallelism,
                     section_handlers=open_sections())
    if restorable is not None:
        restorable.set_list_sequence(extras.list_sequence)
        restorable.mark_restoring(False)
    return extras


def write(capabilities: BackendCapabilities, path: str, *, parallelism: int,
          operator_index: int, max_parallelism: int,
          operator_state: dict[str, dict[str, Any]],
          extra_sections: SectionSource | None = None) -> None:
    """Write and commit this operator's part of the checkpoint at `path` (no record may be
    in flight); `extra_sections(key_group)` gives the other sections of a key group
    (timers)."""
    store = capabilities.checkpoint_store(path)
    extra: dict[str, Any] = {"operator_state": operator_state}
    if capabilities.restorable is not None:
        extra["list_sequence"] = capabilities.restorable.list_sequence()
    write_snapshot(store, path, parallelism=parallelism, operator_index=operator_index,
                   max_parallelism=max_parallelism, extra=extra, extra_sections=extra_sections)


async def snapshot(capabilities: BackendCapabilities, gate: AdmissionGate,
                   drain: Callable[[], Awaitable[None]],
                   directory: str | os.PathLike[str], checkpoint_id: object, *,
                   parallelism: int, operator_index: int, max_parallelism: int,
                   operator_state: Callable[[], dict[str, dict[str, Any]]],
                   extra_sections: SectionSource | None = None) -> str:
    """Hold `gate`, `drain()`, then `write` this operator's part of checkpoint
    `checkpoint_id` under `directory` (`operator_state()` is read once drained) and release
    the gate; returns the checkpoint's path. Records admitted meanwhile wait at the gate, as
    records behind a checkpoint barrier do."""
    path = checkpoint_path(directory, checkpoint_id)
    capabilities.checkpoint_store(path)  # refused before anything waits
    gate.hold()
    try:
        await drain()
        # No await between the drain and the write: the part holds no half-done record.
        write(capabilities, path, parallelism=parallelism, operator_index=operator_index,
              max_parallelism=max_parallelism, operator_state=operator_state(),
              extra_sections=extra_sections)
    finally:
        gate.release()
    return path
