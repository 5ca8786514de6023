"""One bridge partition: a KeyedOperator on its own event loop inside a Spark task.

`run_partition(spec, records)` is a generator of output chunks. Spark's thread drives it:

1. Inside the partition (workers are forked and reused: nothing at import time): configure
   logging, create the attempt's directory, the backend, the function and the operator
   (restoring this partition's key groups), and a fresh event loop (uvloop when installed,
   through `asyncio.Runner`: the global event-loop policy is never touched).
2. A `ChunkFeeder` reads Spark's iterator on a thread; the operator's main task takes its
   chunks, feeds the operator and collects outputs.
3. Spark's thread runs the loop until a chunk of outputs is ready (or the input is done),
   then yields it with the loop stopped: outputs are buffered up to about one chunk per
   pending chunk of input, never a whole partition.
   When an initial watermark is given, the operator advances to it after restoring, before
   the first record (event-time timers due by then fire first).
4. At the end of input: drain, advance the watermark when a final one is given (its
   event-time timers fire), write this partition's checkpoint part (the commit point, after
   every output was produced), report.
5. On every path (end, failure, an abandoned generator as with `take()`): stop the reader,
   cancel and close the operator (closing its backend), close the loop, remove the
   directory. A worker killed outright runs none of this; nothing depends on it: the next
   attempt uses a fresh directory, and a part is committed only by its manifest's rename.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from asyncstate.backends.base import StateExecutor
from asyncstate.backends.heap import HeapBackend
from asyncstate.checkpoint.layout import checkpoint_path
from asyncstate.config import AsyncStateConfig
from asyncstate.function import KeyedProcessFunction
from asyncstate.log import get_logger
from asyncstate.operator import KeyedOperator
from asyncstate.operator.run import feed
from asyncstate.spark.eventtime import write_part_max
from asyncstate.spark.failures import PartitionFailure, carry
from asyncstate.spark.feeder import DEFAULT_CHUNK_SIZE, DEFAULT_MAX_CHUNKS, ChunkFeeder
from asyncstate.spark.session import configure_worker_logging
from asyncstate.spark.workdir import make_attempt_directory, remove_attempt_directory

__all__ = ["BackendSpec", "PartitionSpec", "TaskInfo", "run_partition"]

log = get_logger("asyncstate.spark")

# "heap", "rocksdb", or a factory called inside the partition with the attempt's directory.
BackendSpec = str | Callable[[str], StateExecutor]
_READER_STOP_S = 5.0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PartitionSpec:
    """Everything a partition needs, shipped from the driver (plain, picklable values)."""

    function_factory: Callable[[], KeyedProcessFunction]
    key_selector: Callable[[Any], Any]
    num_partitions: int
    backend: BackendSpec = "rocksdb"
    config: AsyncStateConfig | None = None
    checkpoint_dir: str | None = None
    checkpoint_id: int | None = None
    restore_from: str | None = None
    timestamp_selector: Callable[[Any], int | None] | None = None
    initial_watermark: int | None = None  # advanced to after restoring, before any record
    final_watermark: int | None = None  # advanced to after the input ends (timers fire)
    log_level: str = "warning"
    report: Any = None  # a RunReport's accumulator, or None
    chunk_size: int = DEFAULT_CHUNK_SIZE
    max_chunks: int = DEFAULT_MAX_CHUNKS


@dataclasses.dataclass(frozen=True, slots=True)
class TaskInfo:
    """Where a partition runs: Spark's TaskContext, or given by hand outside Spark."""

    partition: int
    attempt: int = 0
    stage: int = 0

    @classmethod
    def current(cls, partition: int | None = None) -> TaskInfo:
        """The running task's; `partition`: the index of the partition it computes, when
        known (Spark's partition id is that of the stage's last RDD, another partition's
        under `coalesce` or `union`)."""
        from pyspark import TaskContext

        tc = TaskContext.get()
        if tc is None:
            raise RuntimeError("no Spark task is running in this thread: a bridge partition "
                               "runs inside rdd.mapPartitions or foreachPartition")
        return cls(tc.partitionId() if partition is None else partition, tc.attemptNumber(),
                   tc.stageId())


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where it installs
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def _make_backend(spec: BackendSpec, directory: str | None) -> StateExecutor:
    if spec == "heap":
        return HeapBackend()
    if spec == "rocksdb":
        from asyncstate.backends.rocksdb import RocksDBBackend

        assert directory is not None
        return RocksDBBackend(directory)
    assert callable(spec) and directory is not None
    return spec(directory)


class _LatestTimestamp:
    """The timestamp selector, noting the largest event time it gave (reported to the
    driver: `foreach_batch` derives the next micro-batch's watermark from it)."""

    __slots__ = ("selector", "value")

    def __init__(self, selector: Callable[[Any], int | None]) -> None:
        self.selector = selector
        self.value: int | None = None

    def __call__(self, record: Any) -> int | None:
        ts = self.selector(record)
        # Anything but an int is left to the operator, which names what is wrong with it.
        if type(ts) is int and (self.value is None or ts > self.value):
            self.value = ts
        return ts


class _Run:
    """The state of one partition's run shared by Spark's thread and the loop."""

    def __init__(self, spec: PartitionSpec, task: TaskInfo,
                 latest: _LatestTimestamp | None = None) -> None:
        self.spec = spec
        self.task = task
        self.latest = latest  # the largest event time of the records, with a selector
        self.ready: list[Any] = []  # outputs not yet handed to Spark
        self.wake: asyncio.Future[None] | None = None
        self.records = 0
        self.outputs = 0
        self.phases = {"restore": 0.0, "input_wait": 0.0, "process": 0.0, "drain": 0.0,
                       "commit": 0.0}

    def publish(self, out: list[Any]) -> None:
        if out:
            self.ready.extend(out)
            self.outputs += len(out)
            if len(self.ready) >= self.spec.chunk_size:
                self._wake()

    def _wake(self) -> None:
        wake = self.wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def main(self, op: KeyedOperator, feeder: ChunkFeeder) -> str | None:
        spec = self.spec
        clock = time.perf_counter
        started = clock()
        path: str | None = None
        try:
            async with op:
                self.phases["restore"] = clock() - started
                if spec.initial_watermark is not None:
                    await op.advance_watermark(spec.initial_watermark)
                    self.publish(op.outputs())
                while True:
                    # Waiting with nothing in flight is waiting for Spark's input; waiting
                    # with records in flight overlaps their processing.
                    idle = op.metrics["in_flight"] == 0
                    mark = clock()
                    chunk = await feeder.next_chunk()
                    if idle:
                        self.phases["input_wait"] += clock() - mark
                    if chunk is None:
                        break
                    await feed(op, chunk)
                    feeder.release()
                    self.records += len(chunk)
                    self.publish(op.outputs())
                mark = clock()
                await op.drain()
                if spec.final_watermark is not None:
                    await op.advance_watermark(spec.final_watermark)
                self.publish(op.outputs())
                self.phases["drain"] = clock() - mark
                if spec.checkpoint_dir is not None:
                    mark = clock()
                    assert spec.checkpoint_id is not None
                    if self.latest is not None:  # recorded before the part commits
                        write_part_max(checkpoint_path(spec.checkpoint_dir, spec.checkpoint_id),
                                       spec.num_partitions, self.task.partition,
                                       self.latest.value)
                    path = await op.snapshot(spec.checkpoint_dir, spec.checkpoint_id)
                    self.phases["commit"] = clock() - mark
        finally:
            self._wake()
            phases = self.phases
            phases["process"] = max(0.0, clock() - started - sum(
                phases[name] for name in ("restore", "input_wait", "drain", "commit")))
        return path

    async def until_ready(self, main: asyncio.Task[str | None]) -> None:
        """Run the loop until a chunk of outputs is ready or the main task is done."""
        if len(self.ready) >= self.spec.chunk_size or main.done():
            return
        loop = asyncio.get_running_loop()
        self.wake = loop.create_future()
        await asyncio.wait((main, self.wake), return_when=asyncio.FIRST_COMPLETED)

    def take(self) -> list[Any]:
        out, self.ready = self.ready, []
        return out


def run_partition(spec: PartitionSpec, records: Iterable[Any],
                  task: TaskInfo | None = None) -> Iterator[list[Any]]:
    """Process one partition's records; yields the emitted values in chunks, in emission
    order. `task` defaults to the running Spark task's partition and attempt."""
    if task is None:
        task = TaskInfo.current()
    configure_worker_logging(spec.log_level)
    directory: str | None = None
    runner: asyncio.Runner | None = None
    feeder: ChunkFeeder | None = None
    backend: StateExecutor | None = None
    started = time.perf_counter()
    # One task at a time runs in a Python worker: the process's CPU time is the partition's
    # (its loop, its reader thread, its backend's threads).
    cpu_started = time.process_time()
    output_seconds = 0.0
    latest = None if spec.timestamp_selector is None else _LatestTimestamp(
        spec.timestamp_selector)
    run = _Run(spec, task, latest)
    try:
        if spec.backend != "heap":
            directory = make_attempt_directory(task.stage, task.partition, task.attempt)
        backend = _make_backend(spec.backend, directory)
        op = KeyedOperator(spec.function_factory(), key_selector=spec.key_selector,
                           timestamp_selector=latest,
                           backend=backend, config=spec.config,
                           parallelism=spec.num_partitions, operator_index=task.partition,
                           restore_from=spec.restore_from)
        groups = op.key_group_range
        log.info("spark.partition.start", partition=task.partition, attempt=task.attempt,
                 stage=task.stage, key_groups=f"{groups.start}..{groups.end}",
                 restore_from=spec.restore_from, directory=directory)
        runner = asyncio.Runner(loop_factory=_new_loop)
        loop = runner.get_loop()
        feeder = ChunkFeeder(records, loop, chunk_size=spec.chunk_size,
                             max_chunks=spec.max_chunks)
        main = loop.create_task(run.main(op, feeder))
        feeder.start()
        while True:
            runner.run(run.until_ready(main))
            out = run.take()
            if out:
                mark = time.perf_counter()
                yield out
                output_seconds += time.perf_counter() - mark
            elif main.done():
                break
        part = main.result()
    except Exception as exc:
        if isinstance(exc, PartitionFailure):
            raise
        log.warning("spark.partition.failed", partition=task.partition, attempt=task.attempt,
                    error=repr(exc))
        raise carry(exc, partition=task.partition, attempt=task.attempt,
                    stage=task.stage) from exc
    finally:
        if feeder is not None and not feeder.stop(_READER_STOP_S):
            log.warning("spark.reader_still_running", partition=task.partition,
                        attempt=task.attempt)
        if runner is not None:
            runner.close()  # cancels the main task: the operator closes its backend
        if backend is not None:
            backend.close()  # again (a no-op) unless the operator never started
        if directory is not None:
            remove_attempt_directory(directory)
    seconds = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    report = {
        "partition": task.partition, "attempt": task.attempt, "stage": task.stage,
        "host": os.uname().nodename, "pid": os.getpid(), "cwd": os.getcwd(),
        "records": run.records,
        "outputs": run.outputs, "part": part, "seconds": seconds, "cpu": cpu,
        "read": feeder.read_seconds if feeder is not None else 0.0,
        "output": output_seconds, **run.phases,
        "max_timestamp": latest.value if latest is not None else None,
    }
    log.info("spark.partition.done", **report)
    if spec.report is not None:
        spec.report.add([report])
