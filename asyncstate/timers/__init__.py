"""Timers: the priority-queue sets that hold registered timers (Flink's timer queues).

- `timer`: `InternalTimer` (timestamp, key, namespace, key group), its order and byte form.
- `base`: `InternalPriorityQueue`, the interface of every queue.
- `heap`: `HeapPriorityQueue`, a binary heap whose elements know their index.
- `heap_set`: `HeapPriorityQueueSet`, the heap with one de-duplication dict per key group.
- `batch`: `BatchExecutionPriorityQueueSet`, one dict for sorted batch input.
- `partitioned`: `KeyGroupPartitionedPriorityQueue`, one queue set per key group joined by
  a heap of their heads.
- `rocksdb_set`: `RocksDBPriorityQueueSet`, one key group's timers in RocksDB behind an
  ordered cache.

Every queue fires equal timestamps in one order (key bytes, then namespace bytes), so a job
fires its timers in the same order on every backend.
"""
