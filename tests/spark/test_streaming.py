"""foreach_batch: state across the micro-batches of a Structured Streaming query, exactly once
through a failed batch and a restart of the query."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from spark_functions import (
    SPARK_TEST_TIMEOUT_S,
    KeyCounter,
    key_of,
    model_counts,
    read_counts,
    records,
)

import asyncstate.spark as aspark

# A JVM on a busy 2-core machine can take minutes where it usually takes seconds.
pytestmark = [pytest.mark.spark, pytest.mark.timeout(SPARK_TEST_TIMEOUT_S)]

FILES = 3
PER_FILE = 2_000
KEYS = 300


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

    def run_query() -> None:
        query = (spark.readStream.schema("key long, id long").option("maxFilesPerTrigger", 1)
                 .json(str(source)).writeStream.foreachBatch(writer)
                 .option("checkpointLocation", str(tmp_path / "query"))
                 .trigger(availableNow=True).start())
        query.awaitTermination()

    from pyspark.errors import StreamingQueryException

    with pytest.raises(StreamingQueryException, match="the sink fails once"):
        run_query()
    assert failed == [1] and sorted(outputs) == [0, 1]
    run_query()  # restarts from the query's checkpoint: batch 1 again, then batch 2
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
