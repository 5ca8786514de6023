"""The Spark test session: one local SparkSession for the whole run, quiet, on 127.0.0.1.

`local[2,2]`: two cores, and a failed task is tried once more (plain `local[2]` never
retries). Workers run this interpreter (PYSPARK_PYTHON is read only when the context is
created). Spark's scratch space (`spark.local.dir`) is a temporary directory of the run, so
tests can look at what partitions leave there.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pyspark = pytest.importorskip("pyspark")

import spark_functions  # noqa: E402 - after the skip
from pyspark import cloudpickle  # noqa: E402

import asyncstate.spark as aspark  # noqa: E402

# Executors of a standalone cluster cannot import the tests' modules: ship them by value.
cloudpickle.register_pickle_by_value(spark_functions)


@pytest.fixture(scope="session")
def spark_local_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("spark-local")


@pytest.fixture(scope="session")
def spark(spark_local_dir: Path) -> Iterator[object]:
    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    builder = SparkSession.builder.master("local[2,2]").appName("asyncstate-tests")
    for key, value in {
        **aspark.quiet_conf(),
        "spark.local.dir": str(spark_local_dir),
        "spark.sql.shuffle.partitions": "4",
        "spark.default.parallelism": "4",
    }.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture
def sc(spark: object) -> object:
    return spark.sparkContext  # type: ignore[attr-defined]

