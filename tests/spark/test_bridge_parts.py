"""The bridge's parts: the chunk feeder, attempt directories, exceptions carried to the
driver, the workers' interpreter and logging, the Arrow route's values."""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import subprocess
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from spark_functions import (
    SPARK_TEST_TIMEOUT_S,
    KeyCounter,
    LoggingProbe,
    UserBoom,
    key_of,
    records,
)

import asyncstate as ast
import asyncstate.spark as aspark
from asyncstate.spark import failures, session, workdir
from asyncstate.spark.feeder import ChunkFeeder
from asyncstate.spark.partition import PartitionSpec, TaskInfo, run_partition
from asyncstate.spark.routing import route_values

# -- ChunkFeeder ---------------------------------------------------------------------------

class Source:
    """Records 0..n-1 pulled by the feeder's thread; checks at every pull that the reader is
    never more than `max_chunks` + 1 chunks ahead of the chunks the loop released."""

    def __init__(self, n: int, chunk: int, max_chunks: int, fail_at: int | None = None):
        self.n, self.chunk, self.max_chunks, self.fail_at = n, chunk, max_chunks, fail_at
        self.released = 0
        self.violations: list[int] = []

    def __iter__(self) -> Iterator[int]:
        for i in range(self.n):
            if i == self.fail_at:
                raise UserBoom("the source fails", i)
            if i >= (self.released + self.max_chunks + 1) * self.chunk:
                self.violations.append(i)
            yield i


async def consume(feeder: ChunkFeeder, source: Source) -> list[int]:
    got: list[int] = []
    while (chunk := await feeder.next_chunk()) is not None:
        got.extend(chunk)
        await asyncio.sleep(0)  # let the reader run ahead as far as it may
        source.released += 1
        feeder.release()
    return got


@pytest.mark.parametrize("n", [0, 1, 999, 1000, 10_007])
async def test_feeder_hands_over_every_record_in_order_within_its_bound(n: int) -> None:
    source = Source(n, chunk=100, max_chunks=2)
    feeder = ChunkFeeder(source, asyncio.get_running_loop(), chunk_size=100, max_chunks=2)
    feeder.start()
    assert await consume(feeder, source) == list(range(n))
    assert await feeder.next_chunk() is None  # the end stays the end
    assert source.violations == []
    assert feeder.stop(5.0)


async def test_feeder_raises_what_the_source_raised() -> None:
    source = Source(1_000, chunk=100, max_chunks=2, fail_at=555)
    feeder = ChunkFeeder(source, asyncio.get_running_loop(), chunk_size=100, max_chunks=2)
    feeder.start()
    with pytest.raises(UserBoom, match="the source fails"):
        await consume(feeder, source)
    assert feeder.stop(5.0)


async def test_stop_ends_a_reader_waiting_for_a_free_slot() -> None:
    pulled = threading.Event()

    def endless() -> Iterator[int]:
        i = 0
        while True:
            if i == 29:
                pulled.set()  # the third chunk is read: the reader waits for a free slot
            yield i
            i += 1

    feeder = ChunkFeeder(endless(), asyncio.get_running_loop(), chunk_size=10, max_chunks=2)
    feeder.start()
    assert await asyncio.to_thread(pulled.wait, 30)
    assert feeder.stop(30.0)


# -- one partition outside Spark ------------------------------------------------------------

class ListReport:
    """Stands for a RunReport's accumulator."""

    def __init__(self) -> None:
        self.reports: list[dict[str, Any]] = []

    def add(self, reports: list[dict[str, Any]]) -> None:
        self.reports.extend(reports)


@pytest.mark.parametrize("backend", ["heap", "rocksdb"])
def test_a_partition_reports_its_records_phases_and_cpu_time(backend: str,
                                                             tmp_path: Path) -> None:
    report = ListReport()
    spec = PartitionSpec(function_factory=KeyCounter, key_selector=key_of, num_partitions=1,
                         backend=backend, config=ast.AsyncStateConfig(), report=report,
                         checkpoint_dir=str(tmp_path), checkpoint_id=1)
    outputs = [value for chunk in run_partition(spec, records(3_000, 50), TaskInfo(0))
               for value in chunk]
    assert len(outputs) == 3_000
    (entry,) = report.reports
    assert entry["records"] == entry["outputs"] == 3_000
    assert entry["part"] is not None
    phases = ("restore", "input_wait", "process", "drain", "commit", "output")
    assert entry["process"] > 0 and entry["commit"] > 0  # records ran, a part was written
    assert all(entry[name] >= 0 for name in phases)
    # The phases do not overlap (the reader thread's time does): together within the whole.
    assert sum(entry[name] for name in phases) <= entry["seconds"] + 1e-6
    assert 0 <= entry["read"] <= entry["seconds"]
    assert entry["cpu"] > 0


# -- attempt directories -------------------------------------------------------------------

def test_attempt_directories_are_fresh_and_a_dead_workers_are_removed(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    root = tmp_path / workdir.ROOT_NAME
    root.mkdir()
    left = root / f"stage1-part0-attempt0-pid{dead_pid}-0123abcd"
    (left / "db").mkdir(parents=True)
    (left / "db" / "LOCK").write_bytes(b"")
    live = root / f"stage1-part1-attempt0-pid{os.getpid()}-0123abcd"
    live.mkdir()
    first = workdir.make_attempt_directory(2, 0, 1, base=str(tmp_path))
    second = workdir.make_attempt_directory(2, 0, 1, base=str(tmp_path))
    assert first != second
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [live.name, Path(first).name, Path(second).name])
    assert Path(first).name.startswith(f"stage2-part0-attempt1-pid{os.getpid()}-")
    workdir.remove_attempt_directory(first)
    assert not Path(first).exists() and Path(second).exists()


# -- exceptions carried to the driver ------------------------------------------------------

def test_a_carried_exception_is_rebuilt_with_its_type_attributes_and_a_note() -> None:
    try:
        raise UserBoom("bad record", (3, 4))
    except UserBoom as exc:
        carried = failures.carry(exc, partition=2, attempt=1, stage=9)
    text = str(carried)
    assert text.splitlines()[0].startswith("UserBoom: bad record (raised in Spark partition 2 "
                                           "(attempt 1, stage 9)")
    # The driver sees it inside Spark's error text, after the worker's traceback.
    rebuilt = failures.rebuild(RuntimeError(f"Traceback ...\n{text}\n\tat org.apache..."))
    assert type(rebuilt) is UserBoom and str(rebuilt) == "bad record"
    assert rebuilt.record == (3, 4)
    assert 'raise UserBoom("bad record", (3, 4))' in rebuilt.__notes__[0]
    assert failures.rebuild(RuntimeError("a failure of something else")) is None


def test_an_exception_whose_class_the_driver_lacks_becomes_an_asyncstate_error() -> None:
    module = types.ModuleType("vanishing_module")
    sys.modules["vanishing_module"] = module

    class Vanishing(Exception):
        pass

    Vanishing.__module__ = "vanishing_module"
    Vanishing.__qualname__ = "Vanishing"
    module.Vanishing = Vanishing  # type: ignore[attr-defined]
    carried = failures.carry(Vanishing("gone"), partition=0, attempt=0, stage=None)
    del sys.modules["vanishing_module"]
    rebuilt = failures.rebuild(RuntimeError(str(carried)))
    assert type(rebuilt) is ast.AsyncStateError
    assert "Vanishing: gone" in str(rebuilt) and "make its class importable" in str(rebuilt)


def test_partition_failures_pickle_as_spark_ships_them() -> None:
    carried = failures.carry(ValueError("x"), partition=0, attempt=0, stage=0)
    assert str(pickle.loads(pickle.dumps(carried))) == str(carried)


# -- session: the workers' interpreter, quiet logs, logging in workers ---------------------

def test_quiet_conf_points_spark_at_the_shipped_log4j2_file() -> None:
    conf = aspark.quiet_conf()
    path = aspark.log4j2_properties()
    assert conf["spark.driver.extraJavaOptions"] == f"-Dlog4j.configurationFile=file:{path}"
    assert conf["spark.executor.extraJavaOptions"] == conf["spark.driver.extraJavaOptions"]
    assert conf["spark.ui.showConsoleProgress"] == "false"
    assert "rootLogger.level = error" in Path(path).read_text()


@pytest.mark.spark
@pytest.mark.timeout(SPARK_TEST_TIMEOUT_S)
def test_a_default_worker_python_of_another_environment_becomes_the_drivers(
        sc: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    other = tmp_path / "bin"
    other.mkdir()
    (other / "python3").write_text("#!/bin/sh\n")
    (other / "python3").chmod(0o755)
    monkeypatch.delenv("PYSPARK_PYTHON")
    monkeypatch.setenv("PATH", f"{other}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(sc, "pythonExec", session.DEFAULT_WORKER_PYTHON)
    assert session.use_driver_python(sc)
    assert sc.pythonExec == sys.executable
    monkeypatch.setattr(sc, "pythonExec", "/opt/chosen/python")  # chosen by hand: kept
    assert not session.use_driver_python(sc)
    assert sc.pythonExec == "/opt/chosen/python"


@pytest.mark.spark
@pytest.mark.timeout(SPARK_TEST_TIMEOUT_S)
def test_partitions_configure_logging_in_the_worker(sc: Any) -> None:
    # The worker processes get the asyncstate level asked for: the driver's setting does not
    # reach them.
    out = aspark.process_keyed(sc.parallelize(records(100, 10), 2), LoggingProbe,
                               key_selector=key_of, num_partitions=2, backend="heap",
                               log_level="info").collect()
    assert sorted(out) == [(0, "info", logging.INFO), (1, "info", logging.INFO)]


# -- the Arrow route's values --------------------------------------------------------------

@pytest.mark.spark
@pytest.mark.timeout(SPARK_TEST_TIMEOUT_S)
def test_route_values_land_where_spark_hashes_them(spark: Any) -> None:
    cases = [(n, i, v) for n in range(1, 9) for i, v in enumerate(route_values(n))]
    rows = spark.createDataFrame(cases, "n int, index int, value int").selectExpr(
        "n", "index", "pmod(hash(value), n) AS placed").collect()
    assert len(rows) == len(cases)
    assert [r for r in rows if r["index"] != r["placed"]] == []


# -- rows between Arrow and Python, in a time zone with daylight saving time ---------------

@pytest.fixture
def new_york(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    import time

    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_arrow_timestamps_reach_the_function_as_the_rdd_route_gives_them(
        new_york: None) -> None:

    import pyarrow as pa
    from pyspark.sql.types import (
        MapType,
        StringType,
        StructField,
        StructType,
        TimestampType,
    )

    from asyncstate.spark.rows import input_converter

    # 05:30Z and 06:30Z are both 01:30 in New York (the repeated hour: fold 0 and 1); 07:30Z
    # on the day clocks go forward.
    micros = [1_730_611_800_000_000, 1_730_615_400_000_000, 1_710_055_800_000_000]
    key = StructType([StructField("k", StringType())])
    schema = StructType([StructField("t", TimestampType()),
                         StructField("m", MapType(key, TimestampType()))])
    batch = pa.RecordBatch.from_pylist(
        [{"t": m, "m": [({"k": "a"}, m)]} for m in micros],
        schema=pa.schema([("t", pa.timestamp("us", tz="UTC")),
                          ("m", pa.map_(pa.struct([("k", pa.string())]),
                                        pa.timestamp("us", tz="UTC")))]))
    convert = input_converter(schema)
    assert convert is not None
    rows = [convert(row) for row in batch.to_pylist()]
    expected = [TimestampType().fromInternal(m) for m in micros]  # what Row gives
    assert [repr(r["t"]) for r in rows] == [repr(e) for e in expected]  # fold included
    assert rows[1]["t"].fold == 1 and rows[1]["t"].hour == 1
    from pyspark.sql import Row
    assert [r["m"] for r in rows] == [{Row(k="a"): e} for e in expected]  # keys hashable
    assert input_converter(StructType([StructField("s", StringType())])) is None


def test_arrow_outputs_read_timestamps_as_create_dataframe_does(new_york: None) -> None:
    import datetime

    import pyarrow as pa
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import (
        ArrayType,
        StructField,
        StructType,
        TimestampNTZType,
        TimestampType,
    )

    from asyncstate.spark.rows import ArrowOutput

    schema = StructType([
        StructField("t", TimestampType()), StructField("ntz", TimestampNTZType()),
        StructField("nested", ArrayType(StructType([StructField("at", TimestampType())])))])
    naive = datetime.datetime(2024, 7, 1, 12, 30)  # local time: 16:30Z
    aware = datetime.datetime(2024, 7, 1, 12, 30, tzinfo=datetime.timezone(
        datetime.timedelta(hours=2)))  # 10:30Z; as timestamp_ntz, the wall clock 12:30
    output = pickle.loads(pickle.dumps(ArrowOutput(
        schema, to_arrow_schema(schema, timezone="UTC"))))
    batch = output.batch([(naive, aware, [{"at": naive}]), {"t": aware, "ntz": naive}])
    as_micros = [batch.column(i).cast(pa.int64()).to_pylist() for i in (0, 1)]
    ts, ntz = TimestampType(), TimestampNTZType()
    assert as_micros == [[ts.toInternal(naive), ts.toInternal(aware)],
                         [ntz.toInternal(aware), ntz.toInternal(naive)]]
    assert ts.toInternal(naive) - ts.toInternal(aware) == 6 * 3600 * 10**6  # not read as UTC
    nested = batch.column(2).to_pylist()
    assert nested[0][0]["at"] == datetime.datetime(2024, 7, 1, 16, 30,
                                                   tzinfo=datetime.UTC)
    assert nested[1] is None


def test_an_exception_that_does_not_unpickle_travels_as_its_builtin_class() -> None:
    class Unpicklable(UnicodeDecodeError):
        def __reduce__(self) -> Any:
            raise TypeError("no reduce")

    class Broken(ValueError):
        def __init__(self, *, field: str) -> None:  # pickling passes args, not field=
            super().__init__(f"bad field {field}")

    for exc, kind, text in [
            (Broken(field="total"), ValueError, "bad field total"),
            (Unpicklable("utf-8", b"\xff", 0, 1, "bad"), UnicodeDecodeError, "bad"),
            (ValueError(threading.Lock()), ValueError, "unlocked"),
            (KeyError("ab"), KeyError, "'ab'")]:
        rebuilt = failures.rebuild(failures.carry(exc, partition=1, attempt=0, stage=2))
        assert type(rebuilt) is kind, exc
        assert text in str(rebuilt), (exc, str(rebuilt))
