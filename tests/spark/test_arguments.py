"""process_keyed refuses wrong arguments on the driver, before any task runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from spark_functions import SPARK_TEST_TIMEOUT_S, KeyCounter, key_of, records

import asyncstate as ast
import asyncstate.spark as aspark

# A JVM on a busy 2-core machine can take minutes where it usually takes seconds.
pytestmark = [pytest.mark.spark, pytest.mark.timeout(SPARK_TEST_TIMEOUT_S)]


@pytest.fixture
def rdd(sc: Any) -> Any:
    return sc.parallelize(records(10, 5), 1)


def keyed(rdd: Any, **overrides: Any) -> Any:
    arguments: dict[str, Any] = {"key_selector": key_of, "num_partitions": 2,
                                 "backend": "heap"} | overrides
    factory = arguments.pop("function_factory", KeyCounter)
    return aspark.process_keyed(rdd, factory, **arguments)


def test_an_instance_instead_of_a_factory_is_refused(rdd: Any) -> None:
    with pytest.raises(TypeError, match=r"^function_factory must be a callable returning a new "
                                        r"KeyedProcessFunction .*pass KeyCounter, not an "
                                        r"instance"):
        keyed(rdd, function_factory=KeyCounter())


@pytest.mark.parametrize(("overrides", "pattern"), [
    ({"num_partitions": 0}, r"^num_partitions must be in \[1, 128\], got 0"),
    ({"num_partitions": 129}, r"^num_partitions must be in \[1, 128\], got 129"),
    ({"backend": "rocks"}, r"^backend must be \"rocksdb\", \"heap\", or a function"),
    ({"backend": ast.HeapBackend}, r"^backend must be"),
    ({"checkpoint_id": 3}, r"^checkpoint_dir must be a directory every executor sees"),
    ({"checkpoint_dir": "x"}, r"^checkpoint_id must be an int >= 0 when checkpoint_dir"),
    ({"routing": "fast"}, r"^routing must be one of auto, rdd, arrow"),
    ({"routing": "arrow"}, r"^routing must be \"arrow\" only for a DataFrame"),
])
def test_wrong_arguments_raise_config_errors(rdd: Any, overrides: dict[str, Any],
                                            pattern: str) -> None:
    with pytest.raises(ast.ConfigError, match=pattern):
        keyed(rdd, **overrides)


def test_restore_from_another_max_parallelism_is_refused_on_the_driver(
        rdd: Any, tmp_path: Path) -> None:
    keyed(rdd, checkpoint_dir=tmp_path, checkpoint_id=1,
          config=ast.AsyncStateConfig(max_parallelism=64)).count()
    with pytest.raises(ast.CheckpointError, match=r"max_parallelism 64, but "
                                                  r"config.max_parallelism is 128"):
        keyed(rdd, restore_from=tmp_path / "chk-1")


def test_data_must_be_an_rdd_or_a_dataframe() -> None:
    with pytest.raises(TypeError, match=r"^data must be a pyspark RDD or DataFrame, got list"):
        aspark.process_keyed([1, 2], KeyCounter, key_selector=key_of, num_partitions=1)


@pytest.mark.parametrize("overrides", [
    {"initial_watermark": 1.5}, {"initial_watermark": 2**63}, {"final_watermark": "1"}])
def test_watermarks_must_be_int_timestamps(rdd: Any, overrides: dict[str, Any]) -> None:
    (name, value), = overrides.items()
    with pytest.raises(ast.ConfigError, match=rf"^{name} must be an int of milliseconds in "
                                              rf"\[-2\*\*63, 2\*\*63\), got {value!r}"):
        keyed(rdd, **overrides)


@pytest.mark.parametrize(("overrides", "error", "pattern"), [
    ({"watermark_delay_ms": 10}, ast.ConfigError,
     r"^watermark_delay_ms must be None without a timestamp_selector"),
    ({"watermark_delay_ms": -1, "timestamp_selector": key_of}, ast.ConfigError,
     r"^watermark_delay_ms must be"),
    ({"watermark_delay_ms": True, "timestamp_selector": key_of}, ast.ConfigError,
     r"^watermark_delay_ms must be"),
    ({"timestamp_selector": "ts"}, TypeError,
     r"^timestamp_selector must be callable or None, got str"),
    ({"key_selector": "key"}, TypeError, r"^key_selector must be callable, got str"),
])
def test_foreach_batch_refuses_wrong_event_time_arguments_when_built(
        tmp_path: Path, overrides: dict[str, Any], error: type[Exception], pattern: str
        ) -> None:
    arguments: dict[str, Any] = {"key_selector": key_of, "num_partitions": 2,
                                 "checkpoint_dir": tmp_path} | overrides
    with pytest.raises(error, match=pattern):
        aspark.foreach_batch(KeyCounter, **arguments)


@pytest.mark.parametrize(("overrides", "error", "pattern"), [
    ({"num_partitions": 0}, ast.ConfigError, r"^num_partitions must be in \[1, 128\], got 0"),
    ({"num_partitions": 1000}, ast.ConfigError, r"^num_partitions must be in \[1, 128\]"),
    ({"num_partitions": 200, "config": ast.AsyncStateConfig(max_parallelism=256)}, None, ""),
    ({"backend": "rocks"}, ast.ConfigError, r"^backend must be \"rocksdb\", \"heap\""),
    ({"config": {}}, TypeError, r"^config must be an AsyncStateConfig, got dict"),
    ({"output_schema": 42}, TypeError, r"^output_schema must be a StructType or a DDL string"),
    ({"function_factory": KeyCounter()}, TypeError, r"^function_factory must be a callable"),
    ({"checkpoint_dir": ""}, ast.ConfigError, r"^checkpoint_dir must be a non-empty path"),
    ({"checkpoint_dir": None}, ast.ConfigError, r"^checkpoint_dir must be a directory every"),
    ({"checkpoint_dir": 5}, TypeError, r"^checkpoint_dir must be a path \(str or os.PathLike"),
])
def test_foreach_batch_checks_the_job_when_built(
        tmp_path: Path, overrides: dict[str, Any], error: type[Exception] | None,
        pattern: str) -> None:
    # No Spark needed: a query would otherwise start and fail at its first micro-batch.
    arguments: dict[str, Any] = {"key_selector": key_of, "num_partitions": 2,
                                 "checkpoint_dir": tmp_path} | overrides
    factory = arguments.pop("function_factory", KeyCounter)
    if error is None:
        aspark.foreach_batch(factory, **arguments)
        return
    with pytest.raises(error, match=pattern):
        aspark.foreach_batch(factory, **arguments)


def test_process_keyed_refuses_an_empty_checkpoint_dir(rdd: Any) -> None:
    with pytest.raises(ast.ConfigError, match=r"^checkpoint_dir must be a non-empty path"):
        keyed(rdd, checkpoint_dir="", checkpoint_id=1)
    with pytest.raises(TypeError, match=r"^restore_from must be a path \(str or os.PathLike"):
        keyed(rdd, restore_from=5)


@pytest.mark.parametrize(("present", "batch_id", "pattern"), [
    ([], 3, r"micro-batch 3 restores from the checkpoint of micro-batch 2, which .* does not "
            r"hold \(it holds no checkpoint\): was the directory deleted"),
    ([0, 1], 3, r"does not hold \(its latest is that of micro-batch 1\)"),
    ([0, 1, 2, 3], 1, r"micro-batch 1 runs, but .* holds the checkpoint of micro-batch 3: "
                      r"the query's checkpointLocation is older than its state"),
])
def test_foreach_batch_refuses_a_batch_its_state_does_not_match(
        spark: Any, tmp_path: Path, present: list[int], batch_id: int, pattern: str) -> None:
    # The checkpoints a query would have written so far (only their names count here).
    for i in present:
        (tmp_path / f"chk-{i}").mkdir()
    writer = aspark.foreach_batch(KeyCounter, key_selector=key_of, num_partitions=2,
                                  checkpoint_dir=tmp_path, backend="heap")
    batch = spark.createDataFrame([(1, 1)], "key long, id long")
    with pytest.raises(ast.CheckpointError, match=pattern):
        writer(batch, batch_id)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"chk-{i}" for i in present]


def test_previous_checkpoint_is_that_of_the_batch_before(tmp_path: Path) -> None:
    assert aspark.previous_checkpoint(tmp_path, 0) is None
    for i in range(3):
        (tmp_path / f"chk-{i}").mkdir()
    assert aspark.previous_checkpoint(tmp_path, 3) == str(tmp_path / "chk-2")
    assert aspark.previous_checkpoint(tmp_path, 2) == str(tmp_path / "chk-1")  # a replay
    with pytest.raises(ast.CheckpointError, match=r"holds the checkpoint of micro-batch 2"):
        aspark.previous_checkpoint(tmp_path, 1)
    with pytest.raises(ast.CheckpointError, match=r"its latest is that of micro-batch 2"):
        aspark.previous_checkpoint(tmp_path, 5)
    with pytest.raises(ast.ConfigError, match=r"^batch_id must be"):
        aspark.previous_checkpoint(tmp_path, -1)
