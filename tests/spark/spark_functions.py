"""Functions the Spark tests run inside partitions, and the model they are checked against.

conftest.py registers this module to be pickled by value, so executors that cannot import
it (a standalone cluster's, whose working directory is elsewhere) still get its code.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import asyncstate as ast

SPARK_TEST_TIMEOUT_S = 240  # per test (pytest-timeout), instead of the suite's 120 s


class UserBoom(Exception):
    """An exception type of the user's own, raised inside a partition."""

    def __init__(self, message: str, record: Any) -> None:
        super().__init__(message)
        self.record = record

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.record))


def _task() -> tuple[int, int]:
    from pyspark import TaskContext

    tc = TaskContext.get()
    return (tc.partitionId(), tc.attemptNumber()) if tc is not None else (-1, -1)


class KeyCounter(ast.KeyedProcessFunction):
    """Counts records per key; emits (key, count, record id, partition)."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))
        self.partition = _task()[0]

    async def process_element(self, value: Any, ctx: Any) -> None:
        n = (await self.count.value() or 0) + 1
        await self.count.update(n)
        ctx.emit((ctx.current_key, n, _record_id(value), self.partition))


def _record_id(value: Any) -> Any:
    return value["id"] if isinstance(value, dict) else value[1]


def key_of(record: Any) -> Any:
    return record["key"] if isinstance(record, dict) else record[0]


class FailsOnce(KeyCounter):
    """KeyCounter whose first attempts fail midway: partition `raise_partition` raises after
    `after` records, partition `kill_partition` ends its worker process at once (as a SIGKILL
    would: no `finally`, no close), with its RocksDB open."""

    raise_partition = 1
    kill_partition = 0
    after = 500

    def open(self, ctx: ast.RuntimeContext) -> None:
        super().open(ctx)
        self.partition, self.attempt = _task()
        self.seen = 0

    async def process_element(self, value: Any, ctx: Any) -> None:
        self.seen += 1
        if self.attempt == 0 and self.seen == self.after:
            if self.partition == self.kill_partition:
                os._exit(17)
            if self.partition == self.raise_partition:
                raise UserBoom(f"first attempt fails at record {self.seen}", value)
        await super().process_element(value, ctx)


class RaisesOnRecord(ast.KeyedProcessFunction):
    """Raises UserBoom for the record whose id is `bad_id`, after an await."""

    bad_id = 42

    async def process_element(self, value: Any, ctx: Any) -> None:
        await asyncio.sleep(0)
        if _record_id(value) == self.bad_id:
            raise UserBoom(f"bad record {self.bad_id}", value)
        ctx.emit(value)


class LoggingProbe(ast.KeyedProcessFunction):
    """Emits, once per partition, asyncstate's log level in the worker and the level of its
    `asyncstate` logger."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.sent = False

    def process_element(self, value: Any, ctx: Any) -> None:
        import logging

        from asyncstate.log import get_level

        if not self.sent:
            self.sent = True
            ctx.emit((_task()[0], get_level(), logging.getLogger("asyncstate").level))


class Probe(ast.KeyedProcessFunction):
    """Emits (key, count) of each key it gets, changing nothing."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    async def process_element(self, value: Any, ctx: Any) -> None:
        ctx.emit((value, await self.count.value()))


def records(n: int, keys: int, start: int = 0) -> list[tuple[int, int]]:
    """(key, id) records: ids start..start+n-1, keys spread by a fixed permutation."""
    return [((i * 7919) % keys, i) for i in range(start, start + n)]


def model_counts(batches: Iterable[Iterable[tuple[int, int]]]) -> Counter[Any]:
    return Counter(key for batch in batches for key, _ in batch)


def read_counts(checkpoint: str, keys: Iterable[Any]) -> dict[Any, int]:
    """The counts a checkpoint holds for `keys`, restored in this process in one operator
    (on the heap, whatever backend wrote it)."""

    async def main() -> dict[Any, int]:
        op = ast.KeyedOperator(Probe(), key_selector=lambda k: k, backend=ast.HeapBackend(),
                               restore_from=checkpoint)
        async with op:
            for key in keys:
                await op.process(key)
            await op.drain()
            return {k: v for k, v in op.outputs() if v is not None}

    return asyncio.run(main())


def attempt_directories(root: Path) -> list[Path]:
    """Attempt directories that bridge partitions left under Spark's local directories."""
    from asyncstate.spark.workdir import ROOT_NAME

    return [p for base in root.rglob(ROOT_NAME) for p in base.iterdir()]


def check_counts_continue(outputs: list[Any], before: dict[Any, int],
                          batch: list[tuple[int, int]]) -> dict[Any, int]:
    """Each key's outputs of a run, in output order, continue its count from `before`; every
    record of `batch` counted once. Returns the counts after the run."""
    by_key: dict[Any, list[int]] = {}
    for key, n, _, _ in outputs:
        by_key.setdefault(key, []).append(n)
    assert sorted(record_id for _, _, record_id, _ in outputs) == sorted(i for _, i in batch)
    after = dict(before)
    for key, counts in by_key.items():
        start = before.get(key, 0)
        assert counts == list(range(start + 1, start + len(counts) + 1)), key
        after[key] = start + len(counts)
    return after


RESCALE_STEPS = ((4, "rocksdb"), (3, "heap"), (6, "rocksdb"))


def run_rescale_chain(sc: Any, checkpoint_dir: str, *, per_run: int = 20_000,
                      keys: int = 2_000, steps: Any = RESCALE_STEPS,
                      report: Any = None) -> tuple[str, Counter[Any]]:
    """Runs of the counter, each restoring the previous run's checkpoint with another
    partition count (and backend); checks every run's outputs. Returns the last checkpoint
    and the model's counts."""
    import asyncstate.spark as aspark

    counts: dict[Any, int] = {}
    batches: list[list[tuple[int, int]]] = []
    restore = None
    for run, (partitions, backend) in enumerate(steps, start=1):
        batch = records(per_run, keys, start=run * per_run)
        batches.append(batch)
        out = aspark.process_keyed(
            sc.parallelize(batch, 2), KeyCounter, key_selector=key_of,
            num_partitions=partitions, backend=backend, checkpoint_dir=checkpoint_dir,
            checkpoint_id=run, restore_from=restore, report=report)
        counts = check_counts_continue(out.collect(), counts, batch)
        restore = aspark.verify_checkpoint(checkpoint_dir, run)
    assert restore is not None
    return restore, model_counts(batches)


class SessionTimers(ast.KeyedProcessFunction):
    """Event time: a record (key, ts) registers a timer at ts + 100 and counts its key; the
    timer emits ("fired", key, timer ts, count, partition)."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    async def process_element(self, value: Any, ctx: Any) -> None:
        await self.count.update((await self.count.value() or 0) + 1)
        ctx.timer_service.register_event_time_timer(ctx.timestamp + 100)

    async def on_timer(self, timestamp: int, ctx: Any) -> None:
        ctx.emit(("fired", ctx.current_key, timestamp, await self.count.value(), _task()[0]))


def timestamp_of(record: Any) -> Any:
    return record["ts"] if isinstance(record, dict) else record[1]


class ExpiringCount(ast.KeyedProcessFunction):
    """Event-time TTL of 100 ms on a count, left out of checkpoints once expired: a record
    (key, ts) emits ("read", key, the count it found, partition), then counts itself."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        ttl = (ast.StateTtlConfig.new_builder(100)
               .set_ttl_time_characteristic(ast.TtlTimeCharacteristic.EVENT_TIME)
               .cleanup_full_snapshot().build())
        self.count = ctx.get_state(ast.ValueStateDescriptor("count", ttl=ttl))

    async def process_element(self, value: Any, ctx: Any) -> None:
        found = await self.count.value()
        ctx.emit(("read", ctx.current_key, found, _task()[0]))
        await self.count.update((found or 0) + 1)


class CountOnly(ast.KeyedProcessFunction):
    """Counts records per key; emits (key, count): nothing about where it ran."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    async def process_element(self, value: Any, ctx: Any) -> None:
        n = (await self.count.value() or 0) + 1
        await self.count.update(n)
        ctx.emit((ctx.current_key, n))


def _described(value: Any) -> Any:
    """A value with the type of every part spelled out (dicts sorted): what a function
    sees, comparable across routes."""
    if isinstance(value, dict):
        return ("dict", sorted((repr(k), _described(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_described(v) for v in value])
    return (type(value).__name__, repr(value))


class DescribeRow(ast.KeyedProcessFunction):
    """Emits (key, the row as the function received it, spelled out)."""

    async def process_element(self, value: Any, ctx: Any) -> None:
        ctx.emit((ctx.current_key, repr(_described(value))))


class EmitGiven(ast.KeyedProcessFunction):
    """Emits what the row's "emit" column names: ("tuple", a, b), ("dict", a, b) or
    ("stamp", a, None), the last with a naive datetime."""

    async def process_element(self, value: Any, ctx: Any) -> None:
        import datetime

        how, a, b = value["how"], value["a"], value["b"]
        if how == "dict":
            ctx.emit({"b": b, "a": a})  # by name, in another order
        elif how == "float":
            ctx.emit((a, 1.9))
        elif how == "null":
            ctx.emit((None, b))
        elif how == "stamp":
            ctx.emit((a, datetime.datetime(2024, 1, 1, 12, 30)))
        else:
            ctx.emit((a, b))


def key_of_missing_column(record: Any) -> Any:
    return record["no_such_column"]
