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


class FailOnce(KeyCounter):
    """KeyCounter whose first attempt of partition `fail_partition` fails after `after`
    records: by raising, or (kill=True) by ending the worker process at once."""

    fail_partition = 1
    after = 500
    kill = False

    def open(self, ctx: ast.RuntimeContext) -> None:
        super().open(ctx)
        self.partition, self.attempt = _task()
        self.seen = 0

    async def process_element(self, value: Any, ctx: Any) -> None:
        self.seen += 1
        if self.partition == self.fail_partition and self.attempt == 0 \
                and self.seen == self.after:
            if self.kill:
                os._exit(17)  # no finally, no close: as a SIGKILL would
            raise UserBoom(f"first attempt fails at record {self.seen}", value)
        await super().process_element(value, ctx)


class KilledOnce(FailOnce):
    fail_partition = 0
    kill = True


class RaisesOnRecord(ast.KeyedProcessFunction):
    """Raises UserBoom for the record whose id is `bad_id`, after an await."""

    bad_id = 42

    async def process_element(self, value: Any, ctx: Any) -> None:
        await asyncio.sleep(0)
        if _record_id(value) == self.bad_id:
            raise UserBoom(f"bad record {self.bad_id}", value)
        ctx.emit(value)


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
