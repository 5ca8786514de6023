"""`foreach_batch`: keyed async state across the micro-batches of a Structured Streaming query,
exactly once.

For micro-batch N the writer restores from the latest checkpoint before N (that of batch
N-1, written when it ran) and commits checkpoint N; then it checks on the driver that
checkpoint N is complete. A micro-batch that fails, or whose query stops before Spark commits
it, is run again by Spark with the same id and the same input: it restores from the same
checkpoint and writes checkpoint N again (each part replaced atomically), so every record
counts once in the state, however often a batch or a task runs.

Event time, as Structured Streaming's own watermark: with a timestamp selector each partition
records the largest event time of its records beside its part, and the driver records,
beside checkpoint N, the largest event time of every batch up to N
(`asyncstate.spark.eventtime`); with a watermark
delay, batch N starts each partition at watermark (that largest time up to batch N-1) -
delay, so event-time timers and TTL move with the stream. A replayed batch restores the same
record and starts at the same watermark.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from typing import Any

from asyncstate.checkpoint.format import checkpoint_path
from asyncstate.config import AsyncStateConfig, check_int
from asyncstate.errors import CheckpointError, ConfigError
from asyncstate.function import KeyedProcessFunction
from asyncstate.log import get_logger
from asyncstate.operator.arguments import check_selector
from asyncstate.operator.progress import MIN_WATERMARK
from asyncstate.spark import eventtime
from asyncstate.spark.keyed import absolute_path, check_job, process_keyed
from asyncstate.spark.partition import BackendSpec
from asyncstate.spark.report import RunReport, verify_checkpoint

__all__ = ["KeyedBatchWriter", "foreach_batch", "previous_checkpoint"]

log = get_logger("asyncstate.spark")

_CHK_RE = re.compile(r"chk-(0|[1-9][0-9]*)")
_MIN_RETAIN = 2  # the checkpoint just written and the one a replay of it restores from


def _checkpoint_ids(checkpoint_dir: str) -> list[int]:
    try:
        names = os.listdir(checkpoint_dir)
    except FileNotFoundError:
        return []
    return sorted(int(m[1]) for m in map(_CHK_RE.fullmatch, names) if m is not None)


def previous_checkpoint(checkpoint_dir: str | os.PathLike[str], batch_id: int) -> str | None:
    """Path of the checkpoint micro-batch `batch_id` restores from: that of micro-batch
    `batch_id - 1` (None for batch 0, which starts empty).

    Spark runs batch N only once batch N-1 has committed, and a writer commits checkpoint N-1
    before that: a missing one, or a checkpoint of a later batch, means the state and the
    query's own checkpoint no longer belong together, and restoring anything else would lose
    or repeat records. Both raise CheckpointError."""
    check_int("batch_id", batch_id, 0)
    directory = absolute_path("checkpoint_dir", checkpoint_dir)
    if directory is None:
        raise ConfigError("checkpoint_dir", None, "a directory every executor and the driver see")
    ids = _checkpoint_ids(directory)
    later = [i for i in ids if i > batch_id]
    if later:
        raise CheckpointError(
            f"micro-batch {batch_id} runs, but {directory!r} holds the checkpoint of "
            f"micro-batch {later[-1]}: the query's checkpointLocation is older than its "
            "state. Restart the query from the checkpointLocation that goes with this "
            "state, or give a query started afresh a new checkpoint_dir", path=directory)
    if batch_id == 0:
        return None
    if batch_id - 1 not in ids:
        found = f"its latest is that of micro-batch {ids[-1]}" if ids else \
            "it holds no checkpoint"
        raise CheckpointError(
            f"micro-batch {batch_id} restores from the checkpoint of micro-batch "
            f"{batch_id - 1}, which {directory!r} does not hold ({found}): was the "
            "directory deleted, emptied or changed? Restore it, or start the query "
            "afresh (a new checkpointLocation and a new checkpoint_dir)", path=directory)
    return checkpoint_path(directory, batch_id - 1)


def _consume(out: Any) -> None:
    """Evaluate every partition of `out` (an RDD or DataFrame), keeping nothing."""
    from pyspark.sql import DataFrame

    if isinstance(out, DataFrame):
        out.write.format("noop").mode("overwrite").save()
    else:
        out.foreachPartition(_drain)


def _drain(values: Any) -> None:
    for _ in values:
        pass


class KeyedBatchWriter:
    """The function `foreach_batch` returns: pass it to `writeStream.foreachBatch`."""

    def __init__(self, function_factory: Callable[[], KeyedProcessFunction], *,
                 key_selector: Callable[[Any], Any], num_partitions: int,
                 checkpoint_dir: str | os.PathLike[str],
                 sink: Callable[[Any, int], None] | None, backend: BackendSpec,
                 config: AsyncStateConfig | None, output_schema: Any, retain: int,
                 log_level: str | None,
                 timestamp_selector: Callable[[Any], int | None] | None = None,
                 watermark_delay_ms: int | None = None) -> None:
        check_int("retain", retain, _MIN_RETAIN)
        check_job(function_factory, num_partitions, backend, config, output_schema)
        directory = absolute_path("checkpoint_dir", checkpoint_dir)
        if directory is None:
            raise ConfigError("checkpoint_dir", None,
                              "a directory every executor and the driver see")
        check_selector("key_selector", key_selector)
        check_selector("timestamp_selector", timestamp_selector, optional=True)
        if watermark_delay_ms is not None:
            check_int("watermark_delay_ms", watermark_delay_ms, 0)
            if timestamp_selector is None:
                raise ConfigError("watermark_delay_ms", watermark_delay_ms,
                                  "None without a timestamp_selector (the watermark follows "
                                  "the records' event times)")
        if sink is not None and not callable(sink):
            raise TypeError(f"sink must be a function of (outputs, batch_id), got "
                            f"{type(sink).__name__}")
        self.function_factory = function_factory
        self.key_selector = key_selector
        self.num_partitions = num_partitions
        self.checkpoint_dir = directory
        self.sink = sink
        self.backend = backend
        self.config = config
        self.output_schema = output_schema
        self.retain = retain
        self.log_level = log_level
        self.timestamp_selector = timestamp_selector
        self.watermark_delay_ms = watermark_delay_ms
        # One report for every batch: an accumulator stays registered as long as its
        # SparkContext, so one per batch would pile up over a long-running query.
        self._report: RunReport | None = None

    def __call__(self, batch: Any, batch_id: int) -> None:
        restore = previous_checkpoint(self.checkpoint_dir, batch_id)
        report = self._report
        if report is None:
            report = self._report = RunReport(batch.sparkSession.sparkContext)
        report.clear()
        event_time = eventtime.read_record(restore)
        watermark = None
        if self.watermark_delay_ms is not None and event_time is not None:
            watermark = max(MIN_WATERMARK, event_time - self.watermark_delay_ms)
        out = process_keyed(
            batch, self.function_factory, key_selector=self.key_selector,
            num_partitions=self.num_partitions, checkpoint_dir=self.checkpoint_dir,
            checkpoint_id=batch_id, restore_from=restore, backend=self.backend,
            config=self.config, output_schema=self.output_schema, report=report,
            log_level=self.log_level, timestamp_selector=self.timestamp_selector,
            initial_watermark=watermark)
        if self.sink is not None:
            self.sink(out, batch_id)
        else:
            _consume(out)
        path = verify_checkpoint(self.checkpoint_dir, batch_id, report)
        # From the records of the committed parts, whichever run of this batch committed
        # them (a replay whose sink skips the outputs runs no partition); without a selector
        # the record restored from is carried on.
        latest = eventtime.read_batch_max(path) if self.timestamp_selector is not None \
            else None
        if latest is not None and (event_time is None or latest > event_time):
            event_time = latest
        if event_time is not None:
            eventtime.write_record(path, event_time)
        self._expire(batch_id)
        log.info("spark.batch.done", batch_id=batch_id, restored_from=restore,
                 partitions=len(report.partitions), watermark=watermark,
                 max_timestamp=event_time)

    def _expire(self, batch_id: int) -> None:
        """Delete checkpoints older than the `retain` latest up to `batch_id` (never a later
        one: it may belong to a batch Spark has not committed yet)."""
        kept = [i for i in _checkpoint_ids(self.checkpoint_dir) if i <= batch_id]
        for old in kept[:-self.retain]:
            shutil.rmtree(checkpoint_path(self.checkpoint_dir, old), ignore_errors=True)


def foreach_batch(function_factory: Callable[[], KeyedProcessFunction], *,
                  key_selector: Callable[[Any], Any], num_partitions: int,
                  checkpoint_dir: str | os.PathLike[str],
                  sink: Callable[[Any, int], None] | None = None,
                  backend: BackendSpec = "rocksdb", config: AsyncStateConfig | None = None,
                  output_schema: Any = None, retain: int = _MIN_RETAIN,
                  log_level: str | None = None,
                  timestamp_selector: Callable[[Any], int | None] | None = None,
                  watermark_delay_ms: int | None = None) -> KeyedBatchWriter:
    """A `writeStream.foreachBatch` function running `process_keyed` on each micro-batch with
    the batch id as checkpoint id and the previous checkpoint as `restore_from`.

    `sink(outputs, batch_id)` receives the emitted values (an RDD, or a DataFrame with
    `output_schema`) and must evaluate them (write them; make the write idempotent per batch
    id, since Spark runs a failed batch again); without a sink the outputs are evaluated and
    dropped. Afterwards the driver checks the checkpoint is complete, and deletes all but the
    `retain` latest checkpoints.

    `timestamp_selector` gives records their event time. With `watermark_delay_ms`, each
    partition of batch N starts at the watermark (largest event time of batches 0..N-1) -
    `watermark_delay_ms`, as Structured Streaming's `withWatermark` computes it: the event-time
    timers due by then fire first, and event-time TTL expires by it. Without it the watermark
    stays at its minimum (no event-time timer fires, nothing expires by event time).
    """
    return KeyedBatchWriter(
        function_factory, key_selector=key_selector, num_partitions=num_partitions,
        checkpoint_dir=checkpoint_dir, sink=sink, backend=backend, config=config,
        output_schema=output_schema, retain=retain, log_level=log_level,
        timestamp_selector=timestamp_selector, watermark_delay_ms=watermark_delay_ms)
