"""foreach_batch: state across the micro-batches of a Structured Streaming query, exactly once
through a failed batch and a restart of the query; event-time timers driven by a watermark
that follows the stream."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from pyspark.errors import StreamingQueryException
from spark_functions import (
    SPARK_TEST_TIMEOUT_S,
    KeyCounter,
    SessionTimers,
    key_of,
    model_counts,
    read_counts,
    records,
    timestamp_of,
)

import asyncstate.spark as aspark

# A JVM on a busy 2-core machine can take minutes where it usually takes seconds.
pytestmark = [pytest.mark.spark, pytest.mark.timeout(SPARK_TEST_TIMEOUT_S)]

FILES = 3
PER_FILE = 2_000
KEYS = 300


def run_query(spark: Any, tmp_path: Path, schema: str, writer: Any) -> None:
    """Run the query over the files of tmp_path/source, one file per micro-batch, until
    they are all processed, with its checkpoint in tmp_path/query (a rerun resumes)."""
    query = (spark.readStream.schema(schema).option("maxFilesPerTrigger", 1)
             .json(str(tmp_path / "source")).writeStream.foreachBatch(writer)
             .option("checkpointLocation", str(tmp_path / "query"))
             .trigger(availableNow=True).start())
    query.awaitTermination()


def test_foreach_batch_counts_every_record_once_across_a_failed_batch(
        spark: Any, tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    batches = [records(PER_FILE, KEYS, start=i * PER_FILE) for i in range(FILES)]
    for i, batch in enumerate(batches):
        (source / f"part-{i}.json").write_text(
            "".join(json.dumps({"key": k, "id": r}) + "\n" for k, r in batch))
    state = tmp_path / "state"
    outputs: dict[int, list[Any]] = {}  # by batch id: a replayed batch replaces its entry
    failed: list[int] = []

    def sink(out: Any, batch_id: int) -> None:
        outputs[batch_id] = out.collect()
        if batch_id == 1 and not failed:
            # After the batch's checkpoint is written, before Spark commits the batch.
            failed.append(batch_id)
            raise RuntimeError("the sink fails once")

    writer = aspark.foreach_batch(KeyCounter, key_selector=key_of, num_partitions=3,
                                  checkpoint_dir=state, sink=sink, backend="rocksdb")

    with pytest.raises(StreamingQueryException, match="the sink fails once"):
        run_query(spark, tmp_path, "key long, id long", writer)
    assert failed == [1] and sorted(outputs) == [0, 1]
    # Restarts from the query's checkpoint: batch 1 again, then batch 2.
    run_query(spark, tmp_path, "key long, id long", writer)
    assert sorted(outputs) == list(range(FILES))

    counts: dict[Any, list[int]] = {}
    for batch_id in sorted(outputs):
        for key, n, _, _ in outputs[batch_id]:
            counts.setdefault(key, []).append(n)
    model = model_counts(batches)
    assert {k: len(v) for k, v in counts.items()} == dict(model)
    for key, ns in counts.items():
        assert ns == list(range(1, len(ns) + 1)), key
    # The checkpoints of the last two batches are kept, older ones deleted.
    assert sorted(os.listdir(state)) == ["chk-1", "chk-2"]
    assert read_counts(str(state / "chk-2"), model) == dict(model)


def test_foreach_batch_watermark_follows_the_event_times_of_earlier_batches(
        spark: Any, tmp_path: Path) -> None:
    # File i holds one record per key k < 200 at event time base_i + k; each record counts
    # its key and registers a timer at its time + 100. With a delay of 50, batch i starts at
    # watermark (the largest event time of batches 0..i-1) - 50, so the timers due by then
    # fire first. Batch 2's times are below batch 1's: the largest so far stays batch 1's.
    keys, delay, bases = 200, 50, (0, 1_000, 500, 3_000)
    source = tmp_path / "source"
    source.mkdir()
    for i, base in enumerate(bases):
        path = source / f"part-{i}.json"
        path.write_text("".join(
            json.dumps({"key": k, "ts": base + k}) + "\n" for k in range(keys)))
        os.utime(path, (1_700_000_000 + i, 1_700_000_000 + i))  # the source's file order
    state = tmp_path / "state"
    fired: dict[int, list[tuple[int, int, int]]] = {}
    failed: list[int] = []

    def sink(out: Any, batch_id: int) -> None:
        if batch_id in fired:
            return  # an idempotent sink: a batch written already is skipped, unevaluated
        fired[batch_id] = sorted((k, ts, count) for _, k, ts, count, _ in out.collect())
        if batch_id == 1 and not failed:
            failed.append(batch_id)
            raise RuntimeError("the sink fails once")

    writer = aspark.foreach_batch(SessionTimers, key_selector=key_of, num_partitions=3,
                                  checkpoint_dir=state, sink=sink, backend="rocksdb",
                                  timestamp_selector=timestamp_of, watermark_delay_ms=delay)
    with pytest.raises(StreamingQueryException, match="the sink fails once"):
        run_query(spark, tmp_path, "key long, ts long", writer)
    # Batch 1 again: restored from checkpoint 0 and checked, but its sink evaluates nothing,
    # so no partition runs: the largest event time of its parts comes from what the parts
    # of its first run recorded. Then batches 2 and 3.
    run_query(spark, tmp_path, "key long, ts long", writer)
    assert sorted(fired) == [0, 1, 2, 3]
    assert fired[0] == []  # no watermark before the first batch's event times are known
    # Batch 1 starts at 199 - 50 = 149: the timers of batch 0 at 100..149, count still 1.
    assert fired[1] == [(k, k + 100, 1) for k in range(keys) if k + 100 <= 149]
    # Batch 2 starts at 1,199 - 50 = 1,149: batch 0's other timers and batch 1's up to 1,149.
    assert fired[2] == sorted(
        [(k, k + 100, 2) for k in range(keys) if k + 100 > 149]
        + [(k, 1_100 + k, 2) for k in range(keys) if 1_100 + k <= 1_149])
    # Batch 3 starts at 1,149 again (batch 2 came earlier in event time): batch 2's timers,
    # registered behind the watermark, fire; batch 1's later ones stay pending.
    assert fired[3] == [(k, 600 + k, 3) for k in range(keys)]
