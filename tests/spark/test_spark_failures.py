"""Exceptions of user code inside partitions reach the driver as themselves."""

from __future__ import annotations

import traceback
from typing import Any

import pytest
from spark_functions import SPARK_TEST_TIMEOUT_S, RaisesOnRecord, UserBoom, key_of, records

import asyncstate.spark as aspark

# A JVM on a busy 2-core machine can take minutes where it usually takes seconds.
pytestmark = [pytest.mark.spark, pytest.mark.timeout(SPARK_TEST_TIMEOUT_S)]


def test_user_exception_reaches_the_driver_with_its_type_and_message(sc: Any) -> None:
    data = records(2_000, 100)
    out = aspark.process_keyed(sc.parallelize(data, 2), RaisesOnRecord, key_selector=key_of,
                               num_partitions=2, backend="rocksdb")
    with pytest.raises(UserBoom, match=r"^bad record 42\n") as info:
        out.collect()
    exc = info.value
    assert exc.record == [data[42][0], 42] or exc.record == data[42]  # msgpack-free: a tuple
    notes = "\n".join(getattr(exc, "__notes__", []))
    assert "raised in Spark partition" in notes
    # The traceback in the worker (the user's own frame shows on the Python sources; the
    # compiled runtime's frames hide it).
    assert "traceback in the worker:\nTraceback (most recent call last):" in notes
    assert notes.endswith("UserBoom: bad record 42")
    shown = "".join(traceback.format_exception(exc))
    assert shown.splitlines()[0] == "Traceback (most recent call last):"
    assert "UserBoom: bad record 42" in shown
    assert "org.apache.spark" not in shown  # no Java stack in what the user reads


def test_user_exception_of_a_dataframe_job_reaches_the_driver(spark: Any) -> None:
    df = spark.range(2_000).selectExpr("id % 100 AS key", "id")
    out = aspark.process_keyed(df, RaisesOnRecord, key_selector=key_of, num_partitions=2,
                               backend="heap", output_schema="key long, id long")
    with pytest.raises(UserBoom, match=r"^bad record 42\n"):
        out.collect()


def test_a_failure_outside_the_bridge_is_left_alone(sc: Any) -> None:
    from pyspark.errors import PythonException

    def boom(_: Any) -> Any:
        raise ValueError("not the bridge's")

    aspark.process_keyed(sc.parallelize(records(10, 5), 1), RaisesOnRecord,
                         key_selector=key_of, num_partitions=1, backend="heap").count()
    with pytest.raises(PythonException, match="not the bridge's"):
        sc.parallelize([1], 1).map(boom).collect()
