"""The timer queue for sorted batch input (Flink's `BatchExecutionInternalPriorityQueueSet`).

Batch input arrives sorted by key, so an operator holds the timers of one key at a time and
fires them when the key changes; the queue needs no key groups: one de-duplication dict
serves every timer, and there is no per-key-group view (nothing is snapshotted in batch
mode).
"""

from __future__ import annotations

from asyncstate.errors import InvalidStateError
from asyncstate.timers.heap_set import _DedupHeap
from asyncstate.timers.timer import InternalTimer

__all__ = ["BatchExecutionPriorityQueueSet"]


class BatchExecutionPriorityQueueSet(_DedupHeap):
    """A priority queue of InternalTimers with set semantics and a single de-duplication
    dict, whatever the timers' key groups."""

    __slots__ = ("_dedup",)

    def __init__(self) -> None:
        super().__init__()
        self._dedup: dict[InternalTimer, InternalTimer] = {}

    def _map_for(self, key_group: int) -> dict[InternalTimer, InternalTimer]:
        return self._dedup

    def get_subset_for_key_group(self, key_group: int) -> set[InternalTimer]:
        """Not supported: raises InvalidStateError."""
        raise InvalidStateError(
            f"BatchExecutionPriorityQueueSet keeps no key groups (batch input is sorted by "
            f"key), so it cannot list the timers of key group {key_group}; use "
            "HeapPriorityQueueSet or KeyGroupPartitionedPriorityQueue where timers are "
            "snapshotted or rescaled per key group")

    def clear(self) -> None:
        super().clear()
        self._dedup.clear()
