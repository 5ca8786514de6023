"""Checkpoints through Spark: rescaling between runs, retried and killed task attempts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from spark_functions import (
    SPARK_TEST_TIMEOUT_S,
    FailsOnce,
    KeyCounter,
    attempt_directories,
    check_counts_continue,
    key_of,
    model_counts,
    read_counts,
    records,
    run_rescale_chain,
)

import asyncstate as ast
import asyncstate.spark as aspark

# A JVM on a busy 2-core machine can take minutes where it usually takes seconds.
pytestmark = [pytest.mark.spark, pytest.mark.timeout(SPARK_TEST_TIMEOUT_S)]


def test_rescale_across_runs_4_then_3_then_6(sc: Any, tmp_path: Path) -> None:
    # RocksDB writes the first checkpoint, the heap restores it at 3 and writes the second,
    # RocksDB restores that at 6: both backends restore and write across partition counts.
    last, model = run_rescale_chain(sc, str(tmp_path / "chk"))
    assert read_counts(last, model) == dict(model)


def test_failed_and_killed_attempts_are_retried_exactly(sc: Any, tmp_path: Path,
                                                         spark_local_dir: Path) -> None:
    data = records(20_000, 1_000)
    report = aspark.RunReport(sc)
    out = aspark.process_keyed(sc.parallelize(data, 2), FailsOnce, key_selector=key_of,
                               num_partitions=4, backend="rocksdb",
                               checkpoint_dir=tmp_path / "chk", checkpoint_id=1, report=report)
    check_counts_continue(out.collect(), {}, data)
    attempts = {r["partition"]: r["attempt"] for r in report.partitions}
    assert attempts == {0: 1, 1: 1, 2: 0, 3: 0}  # only the retries of 0 and 1 committed
    path = aspark.verify_checkpoint(tmp_path / "chk", 1, report)
    model = model_counts([data])
    assert read_counts(path, model) == dict(model)
    # Neither the failed attempt (closed on its way out) nor the killed one (removed by a
    # later attempt on the same executor) left its directory behind.
    assert attempt_directories(spark_local_dir) == []


def test_running_a_result_twice_replaces_its_parts(sc: Any, tmp_path: Path) -> None:
    # A lazy result evaluated twice (no cache) runs every partition twice: the parts are
    # replaced, never added to; the state counts each record once.
    data = records(5_000, 300)
    out = aspark.process_keyed(sc.parallelize(data, 2), KeyCounter, key_selector=key_of,
                               num_partitions=2, backend="heap", checkpoint_dir=tmp_path,
                               checkpoint_id=5)
    assert out.count() == len(data)
    first = aspark.verify_checkpoint(tmp_path, 5)
    check_counts_continue(out.collect(), {}, data)
    path = aspark.verify_checkpoint(tmp_path, 5)
    assert path == first
    assert sorted(os.listdir(path)) == ["part-2-0", "part-2-1"]
    model = model_counts([data])
    assert read_counts(path, model) == dict(model)


def test_a_checkpoint_id_written_again_with_other_partitions_replaces_the_first_run(
        sc: Any, tmp_path: Path) -> None:
    first, second = records(2_000, 100), records(500, 100)
    for data, partitions in ((first, 2), (second, 3)):
        out = aspark.process_keyed(sc.parallelize(data, 2), KeyCounter, key_selector=key_of,
                                   num_partitions=partitions, backend="heap",
                                   checkpoint_dir=tmp_path, checkpoint_id=5)
        assert out.count() == len(data)
        path = aspark.verify_checkpoint(tmp_path, 5)
    # The parts of the run at 2 partitions are gone; the state is the second run's.
    assert sorted(os.listdir(path)) == ["part-3-0", "part-3-1", "part-3-2"]
    model = model_counts([second])
    assert read_counts(path, model) == dict(model)


def test_a_checkpoint_part_missing_on_the_driver_is_named(sc: Any, tmp_path: Path) -> None:
    # A part committed on an executor that the driver does not see (checkpoint_dir not
    # shared), simulated by removing it after the job.
    data = records(2_000, 100)
    report = aspark.RunReport(sc)
    aspark.process_keyed(sc.parallelize(data, 2), KeyCounter, key_selector=key_of,
                         num_partitions=3, backend="heap", checkpoint_dir=tmp_path,
                         checkpoint_id=2, report=report).count()
    part = tmp_path / "chk-2" / "part-3-1"
    for f in part.iterdir():
        f.unlink()
    part.rmdir()
    with pytest.raises(ast.CheckpointError,
                       match=r"missing part part-3-1.*committed their parts .*partition 1 on "
                             r".*must be a path every executor and the driver share"):
        aspark.verify_checkpoint(tmp_path, 2, report)
    with pytest.raises(ast.CheckpointError, match=r"restore_from: .*missing part part-3-1"):
        aspark.process_keyed(sc.parallelize(data, 2), KeyCounter, key_selector=key_of,
                             num_partitions=3, backend="heap",
                             restore_from=tmp_path / "chk-2")


def test_checkpoint_id_defaults_to_the_streaming_batch_id(sc: Any, tmp_path: Path) -> None:
    # Structured Streaming sets this local property on the thread running a micro-batch.
    data = records(1_000, 50)
    sc.setLocalProperty("streaming.sql.batchId", "7")
    try:
        aspark.process_keyed(sc.parallelize(data, 2), KeyCounter, key_selector=key_of,
                             num_partitions=2, backend="heap", checkpoint_dir=tmp_path).count()
    finally:
        sc.setLocalProperty("streaming.sql.batchId", None)
    assert os.listdir(tmp_path) == ["chk-7"]
    aspark.verify_checkpoint(tmp_path, 7)


def test_take_abandons_partitions_cleanly_and_commits_nothing(
        sc: Any, tmp_path: Path, spark_local_dir: Path) -> None:
    # take() stops reading a partition early: the partition closes its operator and
    # RocksDB without draining, removes its directory and commits no part.
    data = records(20_000, 1_000)
    out = aspark.process_keyed(sc.parallelize(data, 2), KeyCounter, key_selector=key_of,
                               num_partitions=2, backend="rocksdb", checkpoint_dir=tmp_path,
                               checkpoint_id=1)
    taken = out.take(5)
    assert len(taken) == 5 and {partition for *_, partition in taken} == {0}
    with pytest.raises(ast.CheckpointError, match=r"did not run every partition to its end"):
        aspark.verify_checkpoint(tmp_path, 1)
    assert attempt_directories(spark_local_dir) == []


def test_partitions_without_records_carry_their_state_forward(sc: Any, tmp_path: Path) -> None:
    # Run 2 has records for two keys only: the other partitions get none, and must still
    # restore and commit their key groups, or their state would be lost.
    first = records(2_000, 200)
    aspark.process_keyed(sc.parallelize(first, 2), KeyCounter, key_selector=key_of,
                         num_partitions=2, backend="heap", checkpoint_dir=tmp_path,
                         checkpoint_id=1).count()
    second = [(first[0][0], 10_000), (first[1][0], 10_001)]
    out = aspark.process_keyed(sc.parallelize(second, 1), KeyCounter, key_selector=key_of,
                               num_partitions=5, backend="rocksdb", checkpoint_dir=tmp_path,
                               checkpoint_id=2, restore_from=tmp_path / "chk-1").collect()
    model = model_counts([first, second])
    assert sorted((key, n) for key, n, _, _ in out) == sorted(
        (key, model[key]) for key, _ in second)
    path = aspark.verify_checkpoint(tmp_path, 2)
    assert sorted(os.listdir(path)) == [f"part-5-{i}" for i in range(5)]
    assert read_counts(path, model) == dict(model)
