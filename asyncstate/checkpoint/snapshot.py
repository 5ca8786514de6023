"""Glue between backends and the checkpoint format: write and restore keyed state.

A key group's record stream is a sequence of *sections*: a header record ``[tag, count]``
followed by `count` records of that tag's type. Tag 0 (`SECTION_STATE_ENTRIES`) holds state
entries ``[state_name, key_bytes, namespace_bytes, data]``, where data is the value's msgpack
bytes (value, reducing, aggregating state), a list of element bytes (list state) or a list of
``[user_key_bytes, value_bytes]`` pairs (map state). Other tags (timers, ...) are written by
`write_snapshot`'s `extra_sections` and read back by `restore_snapshot`'s `section_handlers`;
an unknown tag fails the restore rather than being dropped silently. Sections let state
entries go from the decoder to the backend without being copied.

A backend taking part implements `asyncstate.backends.base.SnapshotBackend`; a
`GroupedSnapshotBackend` encodes all of its entries by key group in one pass, which
`write_snapshot` then prefers (the heap backend does).
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import msgpack

from asyncstate.backends.base import (
    GroupedSnapshotBackend,
    RestorableBackend,
    SnapshotBackend,
    TtlBackend,
)
from asyncstate.checkpoint.layout import PartManifest
from asyncstate.checkpoint.reader import Checkpoint
from asyncstate.checkpoint.writer import PackedRecords, write_part
from asyncstate.config import check_state_name
from asyncstate.errors import CheckpointError, KeyGroupError
from asyncstate.keygroups import (
    KeyGroupRange,
    compute_key_group_range_for_operator_index,
    key_group_of_bytes,
)
from asyncstate.log import get_logger
from asyncstate.runtime.requests import StateKind

__all__ = [
    "SECTION_STATE_ENTRIES",
    "SectionHandler",
    "SectionSource",
    "check_restorable",
    "restore_snapshot",
    "write_snapshot",
]

SECTION_STATE_ENTRIES = 0

log = get_logger("asyncstate.checkpoint")

SectionSource = Callable[[int], Iterable[tuple[int, Sequence[Any]]]]
"""``extra_sections(key_group)`` → ``(tag, records)`` pairs to write after the state entries."""
SectionHandler = Callable[[int, list[Any]], None]
"""``handler(key_group, records)`` restores one section of its tag."""


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    # Building or loading millions of small containers triggers repeated full collections
    # that scan the whole (growing) heap: pausing the collector here removes most of the
    # cost. Nothing in this code creates reference cycles.
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _packed_key_groups(backend: SnapshotBackend, kg_range: KeyGroupRange,
                       max_parallelism: int, extra_sections: SectionSource | None
                       ) -> Iterator[tuple[int, PackedRecords]]:
    """Each non-empty key group's sections, encoded."""
    pack = msgpack.Packer(use_bin_type=True).pack
    if isinstance(backend, GroupedSnapshotBackend):
        # Fast path: the backend encodes entries in one pass over its storage.
        encoded = backend.snapshot_key_groups(kg_range, max_parallelism)
    else:
        found = backend.key_group_outside(kg_range) \
            if isinstance(backend, RestorableBackend) else None
        if found is not None:  # the grouped path refuses such entries the same way
            name, kg = found
            raise KeyGroupError(
                f"{type(backend).__name__} holds state {name!r} of key group {kg}, outside the "
                f"key groups {kg_range.start}..{kg_range.end} being snapshotted", key_group=kg)
        encoded = {}
        for kg in kg_range:
            entries = [pack(e) for e in backend.snapshot_key_group(kg)]
            if entries:
                encoded[kg] = (len(entries), b"".join(entries))
    if extra_sections is not None:
        outside = sorted(kg for kg in encoded if kg not in kg_range)
        if outside:  # without extra sections the writer refuses them the same way
            raise CheckpointError(
                f"key group {outside[0]} is outside the key groups {kg_range.start}.."
                f"{kg_range.end} this snapshot covers (max_parallelism {max_parallelism})")
    kgs = kg_range if extra_sections is not None else sorted(encoded)
    for kg in kgs:
        count, chunks = 0, []
        state = encoded.pop(kg, None)
        if state is not None:
            chunks += [pack((SECTION_STATE_ENTRIES, state[0])), state[1]]
            count += 1 + state[0]
        if extra_sections is not None:
            for tag, records in extra_sections(kg):
                if tag == SECTION_STATE_ENTRIES:
                    raise ValueError(f"section tag {SECTION_STATE_ENTRIES} is reserved for "
                                     "state entries")
                if records:
                    chunks.append(pack((tag, len(records))))
                    chunks += map(pack, records)
                    count += 1 + len(records)
        if count:
            yield kg, PackedRecords(count, b"".join(chunks))


def write_snapshot(
    backend: SnapshotBackend,
    checkpoint_dir: str | os.PathLike[str],
    *,
    parallelism: int,
    operator_index: int,
    max_parallelism: int,
    extra: Mapping[str, Any] | None = None,
    extra_sections: SectionSource | None = None,
    stale_after_s: float | None = None,
) -> PartManifest:
    """Write and commit this operator's part of the checkpoint at `checkpoint_dir` (a path
    from `checkpoint_path`) from `backend`'s state, plus `extra` (operator state and other
    per-part data) and the records `extra_sections(key_group)` returns as ``(tag, records)``
    pairs. Call it with no record in flight. Returns the committed manifest."""
    kg_range = compute_key_group_range_for_operator_index(
        max_parallelism, parallelism, operator_index)
    states = {name: kind.value for name, kind in backend.registered_states().items()}
    kwargs: dict[str, Any] = {} if stale_after_s is None else {"stale_after_s": stale_after_s}
    if isinstance(backend, TtlBackend):
        kwargs["state_ttl"] = backend.ttl_layouts()
    started = time.perf_counter()
    with _gc_paused():
        manifest = write_part(
            checkpoint_dir, parallelism=parallelism, operator_index=operator_index,
            max_parallelism=max_parallelism, states=states,
            key_groups=_packed_key_groups(backend, kg_range, max_parallelism, extra_sections),
            extra=extra, **kwargs)
    log.info("checkpoint.part_written", path=manifest.path, data_file=manifest.data_file,
             key_groups=len(manifest.key_groups), bytes=manifest.data_size,
             seconds=round(time.perf_counter() - started, 3))
    return manifest


def _check_max_parallelism(checkpoint: Checkpoint, max_parallelism: int) -> None:
    if checkpoint.max_parallelism != max_parallelism:
        path = checkpoint.path
        raise CheckpointError(
            f"checkpoint {path!r} was written with max_parallelism "
            f"{checkpoint.max_parallelism}, cannot restore it with max_parallelism "
            f"{max_parallelism}: key groups are fixed for the life of the state", path=path)


def check_restorable(checkpoint: Checkpoint, key_group_range: KeyGroupRange,
                     max_parallelism: int) -> None:
    """What can be checked of a restore before any state is replaced: the max_parallelism,
    the state names and kinds, and the size and checksum of every key group of
    `key_group_range` (CheckpointError naming the file and key group)."""
    _check_max_parallelism(checkpoint, max_parallelism)
    for name, kind in checkpoint.states.items():
        try:
            check_state_name(name)
            StateKind(kind)
        except ValueError as exc:
            raise CheckpointError(
                f"checkpoint {checkpoint.path!r} holds state {name!r} of kind {kind!r}, which "
                f"cannot be restored: {exc}", path=checkpoint.path) from exc
    checkpoint.verify(key_group_range)


def restore_snapshot(
    backend: SnapshotBackend,
    checkpoint: Checkpoint,
    key_group_range: KeyGroupRange,
    max_parallelism: int,
    *,
    section_handlers: Mapping[int, SectionHandler] | None = None,
) -> dict[str, Any]:
    """Restore the key groups `key_group_range` of `checkpoint` into `backend`.

    Declares every state of the checkpoint in the backend first, with its TTL layout
    (timestamped or not: a backend that cannot store TTL states refuses a checkpoint holding
    one). Returns
    ``{"extras": [each old part's extra dict, in operator order], "states": {name: kind},
    "key_groups": restored non-empty key groups, "records": restored state entries}``.
    Raises CheckpointError for a max_parallelism mismatch, a state registered with another
    kind, an unknown section tag, or damaged data (naming the file and key group).
    """
    path = checkpoint.path
    _check_max_parallelism(checkpoint, max_parallelism)
    for name, kind in checkpoint.states.items():
        try:
            backend.register_state(name, StateKind(kind))
        except ValueError as exc:
            raise CheckpointError(
                f"state {name!r} of checkpoint {path!r} is {kind} state: {exc}",
                path=path) from exc
        _set_layout(backend, checkpoint, name)
    handlers = section_handlers or {}
    key_groups = records = 0
    started = time.perf_counter()
    with _gc_paused():
        for kg, stream in checkpoint.read_key_group_lists(key_group_range):
            key_groups += 1
            records += _restore_key_group(backend, checkpoint, kg, stream, max_parallelism,
                                          handlers)
    log.info("checkpoint.restored", path=path, first_key_group=key_group_range.start,
             last_key_group=key_group_range.end, key_groups=key_groups, records=records,
             seconds=round(time.perf_counter() - started, 3))
    return {"extras": checkpoint.extras, "states": dict(checkpoint.states),
            "key_groups": key_groups, "records": records}


def _set_layout(backend: SnapshotBackend, checkpoint: Checkpoint, name: str) -> None:
    """Store state `name` the way the checkpoint does: with TTL timestamps or without."""
    domain = checkpoint.state_ttl.get(name)
    if isinstance(backend, TtlBackend):
        try:
            backend.set_ttl_layout(name, domain, None)
        except ValueError as exc:
            raise CheckpointError(
                f"state {name!r} of checkpoint {checkpoint.path!r} cannot be restored into "
                f"{type(backend).__name__}: {exc}", path=checkpoint.path) from exc
    elif domain is not None:
        raise CheckpointError(
            f"checkpoint {checkpoint.path!r} stores state {name!r} with TTL timestamps, and "
            f"{type(backend).__name__} cannot store TTL state (it is no TtlBackend): restore "
            "it into a HeapBackend or RocksDBBackend", path=checkpoint.path)


def _restore_key_group(backend: SnapshotBackend, checkpoint: Checkpoint, kg: int,
                       stream: list[Any], max_parallelism: int,
                       handlers: Mapping[int, SectionHandler]) -> int:
    data_path = checkpoint.part_for_key_group(kg).data_path

    def damaged(what: str) -> CheckpointError:
        return CheckpointError(f"key group {kg} of data file {data_path!r}: {what}",
                               path=data_path, key_group=kg)

    restored = 0
    i, n = 0, len(stream)
    while i < n:
        header = stream[i]
        if (type(header) is not list or len(header) != 2 or type(header[0]) is not int
                or type(header[1]) is not int or not 0 <= header[1] <= n - i - 1):
            raise damaged(f"malformed section header {header!r}")
        tag, count = header
        section = stream[i + 1:i + 1 + count]
        i += 1 + count
        if tag == SECTION_STATE_ENTRIES:
            # One entry's hash catches a checkpoint written with another key hashing.
            first = section[0] if section else None
            if (type(first) is list and len(first) == 4 and type(first[1]) is bytes
                    and key_group_of_bytes(first[1], max_parallelism) != kg):
                raise damaged("its entries belong to key group "
                              f"{key_group_of_bytes(first[1], max_parallelism)}")
            try:
                backend.restore_key_group(kg, section)
            except (TypeError, ValueError, KeyError, IndexError) as exc:
                raise damaged(f"malformed state entries ({type(exc).__name__}: {exc})") from exc
            restored += count
        else:
            handler = handlers.get(tag)
            if handler is None:
                raise damaged(f"unknown section tag {tag} (written by a newer asyncstate?)")
            handler(kg, section)
    return restored
