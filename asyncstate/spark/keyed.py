"""`process_keyed` and `partition_runner`: a KeyedProcessFunction over Spark data.

`process_keyed` routes records by key group (`asyncstate.spark.routing`) so partition i of
`num_partitions` holds exactly the key groups of operator i, runs one KeyedOperator per
partition (`asyncstate.spark.partition`), and returns the emitted values as an RDD, or as a
DataFrame when `output_schema` is given. It is lazy like any transformation: the partitions
run (and commit their checkpoint parts) when an action evaluates the result.
"""

from __future__ import annotations

import inspect
import itertools
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from asyncstate.checkpoint.format import checkpoint_path
from asyncstate.checkpoint.reader import open_checkpoint
from asyncstate.config import AsyncStateConfig, check_int
from asyncstate.errors import CheckpointError, ConfigError
from asyncstate.function import KeyedProcessFunction
from asyncstate.operator.arguments import check_selector, check_timestamp
from asyncstate.spark.failures import carry, install_driver_hook
from asyncstate.spark.partition import BackendSpec, PartitionSpec, TaskInfo, run_partition
from asyncstate.spark.report import RunReport
from asyncstate.spark.routing import (
    Router,
    arrow_available,
    partition_index,
    route_dataframe_arrow,
    route_rdd,
    routed_rows,
)
from asyncstate.spark.rows import ArrowOutput, OutputCheck, input_converter
from asyncstate.spark.session import driver_log_level, use_driver_python

__all__ = ["BATCH_ID_PROPERTY", "absolute_path", "check_job", "partition_runner",
           "process_keyed"]

# The local property Structured Streaming sets on the driver thread (and so on every task)
# of a micro-batch.
BATCH_ID_PROPERTY = "streaming.sql.batchId"
_ROUTINGS = ("auto", "rdd", "arrow")


class _RunRecords:
    """Function over plain records (`partition_runner`): for `mapPartitions` (the partition
    index is the task's) or `mapPartitionsWithIndex` (the index Spark gives). With `check`,
    outputs are checked against `output_schema` here, where a failure is carried to the
    driver as itself."""

    def __init__(self, spec: PartitionSpec, check: OutputCheck | None = None) -> None:
        self.spec = spec
        self.check = check

    def __call__(self, *args: Any) -> Iterator[Any]:
        index, records = (None, args[0]) if len(args) == 1 else args
        return self._run(index, records)

    def _run(self, index: int | None, records: Iterable[Any]) -> Iterator[Any]:
        task = TaskInfo.current(index)
        check = self.check
        for chunk in run_partition(self.spec, records, task):
            if check is not None:
                try:
                    check(chunk)
                except Exception as exc:
                    raise _output_failure(exc, task) from exc
            yield from chunk


class _RunPairs(_RunRecords):
    """mapPartitionsWithIndex function over the ``(index, record)`` pairs of the RDD route."""

    def __call__(self, *args: Any) -> Iterator[Any]:
        index, pairs = args
        return self._run(index, (record for _, record in pairs))


def _output_failure(exc: Exception, task: TaskInfo) -> Exception:
    """An emitted value that `output_schema` refuses, carried to the driver as itself."""
    return carry(exc, partition=task.partition, attempt=task.attempt, stage=task.stage,
                 doing="while checking outputs against output_schema")


class _RunArrow:
    """mapInArrow function over routed Arrow batches; yields Arrow batches of the outputs.
    The partition's index comes from its rows' route column (every routed partition holds
    a marker row at least)."""

    def __init__(self, spec: PartitionSpec, input_schema: Any, output: ArrowOutput) -> None:
        self.spec = spec
        self.input_schema = input_schema  # the Spark schema of the rows (without routing)
        self.output = output

    def __call__(self, batches: Iterable[Any]) -> Iterator[Any]:
        spec = self.spec
        batches = iter(batches)
        first = next((b for b in batches if b.num_rows), None)
        if first is None:
            raise RuntimeError("a routed partition received no rows, not even its marker "
                               "row: it cannot tell which key groups it holds")
        task = TaskInfo.current(partition_index(first, spec.num_partitions))
        convert = input_converter(self.input_schema)

        def rows() -> Iterator[Any]:
            for batch in itertools.chain((first,), batches):
                part = routed_rows(batch).to_pylist()
                yield from part if convert is None else map(convert, part)

        output = self.output
        for chunk in run_partition(spec, rows(), task):
            try:
                batch = output.batch(chunk)
            except Exception as exc:
                raise _output_failure(exc, task) from exc
            yield batch


def _arrow_schema(to_arrow_schema: Callable[..., Any], schema: Any) -> Any:
    """PySpark's Arrow schema of `schema`: timestamps in UTC, as PySpark's own workers send
    them (versions whose `to_arrow_schema` takes a time zone require one for timestamps)."""
    if "timezone" in inspect.signature(to_arrow_schema).parameters:
        return to_arrow_schema(schema, timezone="UTC")
    return to_arrow_schema(schema)


def _as_dict(row: Any) -> dict[str, Any]:
    result: dict[str, Any] = row.asDict(recursive=True)
    return result


def _check_factory(function_factory: object) -> Callable[[], KeyedProcessFunction]:
    if isinstance(function_factory, KeyedProcessFunction) or not callable(function_factory):
        raise TypeError(
            "function_factory must be a callable returning a new KeyedProcessFunction (the "
            "class itself, or a function), called once inside each partition; got "
            f"{type(function_factory).__name__} (pass {type(function_factory).__name__}, "
            "not an instance of it)")
    return function_factory


def _check_backend(backend: object) -> BackendSpec:
    if backend in ("rocksdb", "heap") or (callable(backend) and not isinstance(backend, type)):
        return backend
    raise ConfigError("backend", backend, '"rocksdb", "heap", or a function of the attempt\'s '
                      "directory returning a state backend (called inside the partition)")


def absolute_path(name: str, path: object) -> str | None:
    """`path` (or None) as an absolute path; TypeError or ConfigError naming `name`."""
    if path is None:
        return None
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (str or os.PathLike), got "
                        f"{type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str path, got {type(text).__name__}")
    if not text:
        raise ConfigError(name, path, "a non-empty path (a directory every executor sees)")
    return os.path.abspath(text)


def check_job(function_factory: object, num_partitions: object, backend: object,
              config: object, output_schema: object) -> AsyncStateConfig:
    """Check what a keyed job is made of before Spark runs anything (also where no
    SparkContext is at hand yet): the config, with AsyncStateConfig() for None."""
    _check_factory(function_factory)
    if config is None:
        config = AsyncStateConfig()
    elif not isinstance(config, AsyncStateConfig):
        raise TypeError(f"config must be an AsyncStateConfig, got {type(config).__name__}")
    check_int("num_partitions", num_partitions, 1, config.max_parallelism)
    _check_backend(backend)
    from pyspark.sql.types import StructType

    if output_schema is not None and not isinstance(output_schema, (str, StructType)):
        raise TypeError(f"output_schema must be a StructType or a DDL string, got "
                        f"{type(output_schema).__name__}")
    return config


def _spec(sc: Any, function_factory: Any, *, key_selector: Any, num_partitions: int,
          checkpoint_dir: Any, checkpoint_id: int | None, restore_from: Any, backend: Any,
          config: AsyncStateConfig | None, report: RunReport | None,
          log_level: str | None, timestamp_selector: Any = None,
          initial_watermark: Any = None, final_watermark: Any = None) -> PartitionSpec:
    """Validate the arguments on the driver; prepare the driver (workers' interpreter, the
    failure hook); the PartitionSpec the partitions receive."""
    config = check_job(function_factory, num_partitions, backend, config, None)
    factory = _check_factory(function_factory)
    check_selector("key_selector", key_selector)
    check_selector("timestamp_selector", timestamp_selector, optional=True)
    for name, watermark in (("initial_watermark", initial_watermark),
                            ("final_watermark", final_watermark)):
        if watermark is not None:
            check_timestamp(name, watermark)
    max_p = config.max_parallelism
    checkpoint_dir = absolute_path("checkpoint_dir", checkpoint_dir)
    if checkpoint_dir is not None and checkpoint_id is None:
        checkpoint_id = _batch_id(sc)
        if checkpoint_id is None:
            raise ConfigError("checkpoint_id", None,
                              "an int >= 0 when checkpoint_dir is given (outside a Structured "
                              "Streaming micro-batch, whose batch id it defaults to)")
    if checkpoint_id is not None:
        if checkpoint_dir is None:
            raise ConfigError("checkpoint_dir", None,
                              "a directory every executor sees when checkpoint_id is given")
        checkpoint_path(checkpoint_dir, checkpoint_id)  # validates the id
    restore = absolute_path("restore_from", restore_from)
    if restore is not None:
        _check_restorable(restore, max_p)
    if report is not None and not isinstance(report, RunReport):
        raise TypeError(f"report must be an asyncstate.spark.RunReport, got "
                        f"{type(report).__name__}")
    use_driver_python(sc)
    install_driver_hook()
    return PartitionSpec(
        function_factory=factory, key_selector=key_selector, num_partitions=num_partitions,
        backend=_check_backend(backend), config=config,
        checkpoint_dir=checkpoint_dir, checkpoint_id=checkpoint_id,
        restore_from=restore, log_level=log_level or driver_log_level(),
        report=report.accumulator if report is not None else None,
        timestamp_selector=timestamp_selector, initial_watermark=initial_watermark,
        final_watermark=final_watermark)


def _batch_id(sc: Any) -> int | None:
    """The id of the Structured Streaming micro-batch this thread runs, if any."""
    value = sc.getLocalProperty(BATCH_ID_PROPERTY)
    return int(value) if value is not None else None


def _check_restorable(path: str, max_parallelism: int) -> None:
    """Open the checkpoint on the driver (it must be complete) before any task starts."""
    try:
        checkpoint = open_checkpoint(path)
    except CheckpointError as exc:
        raise CheckpointError(
            f"restore_from: {exc}. The driver checks the checkpoint before the job starts; "
            "checkpoint_dir must be a path every executor and the driver share",
            path=path) from exc
    if checkpoint.max_parallelism != max_parallelism:
        raise CheckpointError(
            f"restore_from: checkpoint {path!r} was written with max_parallelism "
            f"{checkpoint.max_parallelism}, but config.max_parallelism is {max_parallelism}; "
            f"use AsyncStateConfig(max_parallelism={checkpoint.max_parallelism})", path=path)


def process_keyed(data: Any, function_factory: Callable[[], KeyedProcessFunction], *,
                  key_selector: Callable[[Any], Any], num_partitions: int,
                  checkpoint_dir: str | os.PathLike[str] | None = None,
                  checkpoint_id: int | None = None,
                  restore_from: str | os.PathLike[str] | None = None,
                  backend: BackendSpec = "rocksdb", config: AsyncStateConfig | None = None,
                  output_schema: Any = None, report: RunReport | None = None,
                  log_level: str | None = None, routing: str = "auto",
                  timestamp_selector: Callable[[Any], int | None] | None = None,
                  initial_watermark: int | None = None,
                  final_watermark: int | None = None) -> Any:
    """Run a KeyedProcessFunction over `data` (an RDD, or a DataFrame whose rows reach the
    function as dicts) in `num_partitions` partitions; the emitted values as an RDD, or as a
    DataFrame of `output_schema` (a StructType or DDL string).

    `function_factory()` is called inside each partition. With `checkpoint_dir` each partition
    commits its key groups as its part of checkpoint `checkpoint_id` (inside a Structured
    Streaming micro-batch, the batch id by default); `restore_from` restores from a complete
    checkpoint of any partition count. `backend`: "rocksdb" (a directory per task attempt
    under Spark's local directories), "heap", or a function of that directory returning a
    backend. `report`: a RunReport collecting per-partition figures. `routing`: "auto" (Arrow
    for a DataFrame with `output_schema` when pyarrow is installed), "rdd" or "arrow".
    `timestamp_selector` gives records their event time; `initial_watermark`, when given, is
    advanced to in each partition after restoring, before its first record (the restored
    event-time timers due by then fire first); `final_watermark`, when given, is advanced to
    in each partition after its input ended (its event-time timers fire; later ones stay
    pending in the checkpoint).
    """
    from pyspark.rdd import RDD
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

    if routing not in _ROUTINGS:
        raise ConfigError("routing", routing, f"one of {', '.join(_ROUTINGS)}")
    if isinstance(data, DataFrame):
        sc = data.sparkSession.sparkContext
    elif isinstance(data, RDD):
        sc = data.context
    else:
        raise TypeError(f"data must be a pyspark RDD or DataFrame, got {type(data).__name__}")
    spec = _spec(sc, function_factory, key_selector=key_selector,
                 num_partitions=num_partitions, checkpoint_dir=checkpoint_dir,
                 checkpoint_id=checkpoint_id, restore_from=restore_from, backend=backend,
                 config=config, report=report, log_level=log_level,
                 timestamp_selector=timestamp_selector, initial_watermark=initial_watermark,
                 final_watermark=final_watermark)
    schema: Any = None
    if output_schema is not None:
        schema = StructType.fromDDL(output_schema) if isinstance(output_schema, str) \
            else output_schema
        if not isinstance(schema, StructType):
            raise TypeError(f"output_schema must be a StructType or a DDL string, got "
                            f"{type(output_schema).__name__}")
    router = Router(spec.key_selector, spec.config.max_parallelism,  # type: ignore[union-attr]
                    num_partitions)
    if isinstance(data, DataFrame):
        use_arrow = schema is not None and (
            routing == "arrow" or (routing == "auto" and arrow_available()))
        if use_arrow:
            from pyspark.sql.pandas.types import to_arrow_schema

            routed = route_dataframe_arrow(data, router, num_partitions)
            output = ArrowOutput(schema, _arrow_schema(to_arrow_schema, schema))
            return routed.mapInArrow(_RunArrow(spec, data.schema, output), schema)
        if routing == "arrow":
            raise ConfigError("routing", routing, '"arrow" only for a DataFrame with an '
                              "output_schema")
        data = data.rdd.map(_as_dict)
    elif routing == "arrow":
        raise ConfigError("routing", routing, '"arrow" only for a DataFrame with an '
                          "output_schema")
    out = route_rdd(data, router, num_partitions).mapPartitionsWithIndex(
        _RunPairs(spec, None if schema is None else OutputCheck(schema)),
        preservesPartitioning=True)
    if schema is None:
        return out
    spark = SparkSession.getActiveSession() or SparkSession(sc)
    return spark.createDataFrame(out, schema=schema, verifySchema=False)  # checked above


def partition_runner(function_factory: Callable[[], KeyedProcessFunction], *,
                     key_selector: Callable[[Any], Any], num_partitions: int,
                     checkpoint_dir: str | os.PathLike[str] | None = None,
                     checkpoint_id: int | None = None,
                     restore_from: str | os.PathLike[str] | None = None,
                     backend: BackendSpec = "rocksdb", config: AsyncStateConfig | None = None,
                     report: RunReport | None = None, log_level: str | None = None,
                     spark_context: Any = None,
                     timestamp_selector: Callable[[Any], int | None] | None = None,
                     initial_watermark: int | None = None,
                     final_watermark: int | None = None
                     ) -> Callable[[Iterable[Any]], Iterator[Any]]:
    """A function for `rdd.mapPartitions` (or `foreachPartition`) that runs the function over
    one partition as `process_keyed` does, for an RDD already partitioned by key group:
    partition i must hold only keys of operator i of `num_partitions` (others raise
    KeyGroupError). Called on the driver; `spark_context` defaults to the active one."""
    from pyspark import SparkContext

    sc = spark_context if spark_context is not None else SparkContext._active_spark_context
    if sc is None:
        raise RuntimeError("partition_runner() needs a running SparkContext: create the "
                           "SparkSession first, or pass spark_context=")
    spec = _spec(sc, function_factory, key_selector=key_selector,
                 num_partitions=num_partitions, checkpoint_dir=checkpoint_dir,
                 checkpoint_id=checkpoint_id, restore_from=restore_from, backend=backend,
                 config=config, report=report, log_level=log_level,
                 timestamp_selector=timestamp_selector, initial_watermark=initial_watermark,
                 final_watermark=final_watermark)
    return _RunRecords(spec)
