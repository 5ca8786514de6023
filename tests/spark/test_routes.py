"""What the two routes of a DataFrame job give, compared: the rows a function receives,
outputs checked against `output_schema`, errors of the key selector; and a result that
Spark evaluates inside other partitions (`coalesce`, `union`)."""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
from spark_functions import (
    SPARK_TEST_TIMEOUT_S,
    CountOnly,
    DescribeRow,
    EmitGiven,
    key_of,
    key_of_missing_column,
    read_counts,
)

import asyncstate.spark as aspark

pytestmark = [pytest.mark.spark, pytest.mark.timeout(SPARK_TEST_TIMEOUT_S)]

ROUTES = ["rdd", "arrow"]


def _counts_continue(rows: list[Any], before: Counter[Any], batch: list[Any]) -> None:
    """Each key's counts of a run, in output order, continue from `before`, one per record."""
    by_key: dict[Any, list[int]] = defaultdict(list)
    for key, n in rows:
        by_key[key].append(n)
    assert Counter({k: len(v) for k, v in by_key.items()}) == Counter(k for k, _ in batch)
    for key, counts in by_key.items():
        start = before[key]
        assert counts == list(range(start + 1, start + len(counts) + 1)), key


@pytest.mark.parametrize("routing", ROUTES)
def test_a_result_evaluated_inside_other_partitions_keeps_each_partitions_key_groups(
        spark: Any, tmp_path: Path, routing: str) -> None:
    # coalesce(1) and union make Spark compute the bridge's partitions inside tasks whose
    # partition id is another's; the second run's keys all belong to one partition, so two
    # of its three partitions get no records yet must restore and commit their key groups.
    first = [(k % 60, i) for i, k in enumerate(range(3_000))]
    second = [(7, i) for i in range(3_000, 3_200)]
    schema = "key long, id long"
    checkpoints = str(tmp_path)
    out = aspark.process_keyed(
        spark.createDataFrame(first, schema), CountOnly, key_selector=key_of,
        num_partitions=3, backend="rocksdb", checkpoint_dir=checkpoints, checkpoint_id=1,
        output_schema="key long, n long", routing=routing)
    rows = [tuple(r) for r in out.coalesce(1).collect()]
    _counts_continue(rows, Counter(), first)
    restore = aspark.verify_checkpoint(checkpoints, 1)
    other = spark.createDataFrame([(-1, -1)], "key long, n long")
    out = aspark.process_keyed(
        spark.createDataFrame(second, schema), CountOnly, key_selector=key_of,
        num_partitions=3, backend="heap", checkpoint_dir=checkpoints, checkpoint_id=2,
        restore_from=restore, output_schema="key long, n long", routing=routing)
    rows = [tuple(r) for r in other.union(out).collect()]
    assert rows.count((-1, -1)) == 1
    rows.remove((-1, -1))
    before = Counter(k for k, _ in first)
    _counts_continue(rows, before, second)
    last = aspark.verify_checkpoint(checkpoints, 2)  # every partition committed its part
    assert read_counts(last, range(60)) == dict(before + Counter(k for k, _ in second))


def test_an_rdd_result_evaluated_inside_other_partitions_keeps_its_key_groups(
        sc: Any) -> None:
    data = [(k % 50, i) for i, k in enumerate(range(2_000))]
    out = aspark.process_keyed(sc.parallelize(data, 2), CountOnly, key_selector=key_of,
                               num_partitions=3, backend="heap")
    _counts_continue(out.coalesce(1).collect(), Counter(), data)
    rows = sc.parallelize([(-1, -1)], 1).union(out).collect()
    rows.remove((-1, -1))
    _counts_continue(rows, Counter(), data)


def test_rows_reach_the_function_alike_on_both_routes(spark: Any) -> None:
    df = spark.sql("""
        SELECT id AS key,
               map('country', 'fr', 'lang', CAST(id AS STRING)) AS attrs,
               TIMESTAMP '2024-01-01 12:30:00' + make_interval(0, 0, 0, 0, CAST(id AS INT))
                   AS seen,
               CAST('ab' AS BINARY) AS blob,
               array(map('k', id)) AS nested,
               named_struct('at', TIMESTAMP '2024-02-03 04:05:06', 'tags', array('x'),
                            'm', map(1, 'one')) AS info,
               DATE '2024-03-04' AS day,
               CAST(id AS DECIMAL(10, 2)) AS amount,
               CAST(NULL AS MAP<STRING, INT>) AS empty
        FROM range(6)""")
    seen = {}
    for routing in ROUTES:
        out = aspark.process_keyed(df, DescribeRow, key_selector=key_of, num_partitions=2,
                                   backend="heap", output_schema="key long, row string",
                                   routing=routing)
        seen[routing] = sorted(tuple(r) for r in out.collect())
    assert seen["arrow"] == seen["rdd"]
    described = dict(seen["rdd"])[3]
    assert "('dict', [(\"'country'\", ('str', \"'fr'\"))" in described  # a map is a dict
    assert "('datetime', 'datetime.datetime(2024, 1, 1, 15, 30)')" in described  # naive
    assert "('bytes', \"b'ab'\")" in described


def _emit(spark: Any, how: str, routing: str, schema: str) -> list[Any]:
    df = spark.createDataFrame([(how, "ann", 1)], "how string, a string, b int")
    out = aspark.process_keyed(df, EmitGiven, key_selector=lambda r: r["a"],
                               num_partitions=1, backend="heap", output_schema=schema,
                               routing=routing)
    return [tuple(r) for r in out.collect()]


@pytest.mark.parametrize("routing", ROUTES)
@pytest.mark.parametrize(("how", "error", "says"), [
    ("float", TypeError, r"field b: IntegerType\(\) can not accept object 1\.9"),
    ("null", ValueError, r"field a: This field is not nullable, but got None"),
])
def test_an_output_that_does_not_fit_the_schema_fails_naming_the_field(
        spark: Any, routing: str, how: str, error: type[Exception], says: str) -> None:
    with pytest.raises(error, match=says):
        _emit(spark, how, routing, "a string not null, b int")


@pytest.mark.parametrize("routing", ROUTES)
def test_outputs_become_rows_by_name_or_by_position_alike(spark: Any, routing: str) -> None:
    assert _emit(spark, "dict", routing, "a string, b int") == [("ann", 1)]
    assert _emit(spark, "tuple", routing, "a string, b int") == [("ann", 1)]
    import datetime
    assert _emit(spark, "stamp", routing, "a string, at timestamp") == [
        ("ann", datetime.datetime(2024, 1, 1, 12, 30))]


def test_a_chunk_mixing_tuples_and_dicts_becomes_rows_by_position_and_by_name(
        spark: Any) -> None:
    df = spark.createDataFrame([("tuple", "ann", 1), ("dict", "bob", 2)],
                               "how string, a string, b int").coalesce(1)
    rows = {}
    for routing in ROUTES:
        out = aspark.process_keyed(df, EmitGiven, key_selector=lambda r: 0,
                                   num_partitions=1, backend="heap",
                                   output_schema="a string, b int", routing=routing)
        rows[routing] = sorted(tuple(r) for r in out.collect())
    assert rows["arrow"] == rows["rdd"] == [("ann", 1), ("bob", 2)]


@pytest.mark.parametrize("routing", ROUTES)
def test_an_exception_of_the_key_selector_reaches_the_driver_as_itself(
        spark: Any, routing: str) -> None:
    df = spark.createDataFrame([(1, 2)], "key long, id long")
    with pytest.raises(KeyError, match="no_such_column") as raised:
        aspark.process_keyed(df, CountOnly, key_selector=key_of_missing_column,
                             num_partitions=2, backend="heap",
                             output_schema="key long, n long", routing=routing).collect()
    assert any("while routing records by key" in note for note in raised.value.__notes__)


def test_partition_runner_under_map_partitions_with_index_survives_coalesce(sc: Any) -> None:
    import asyncstate as ast

    data = [(k % 40, i) for i, k in enumerate(range(1_000))]
    parts: list[list[tuple[int, int]]] = [[] for _ in range(3)]
    for record in data:
        parts[ast.compute_operator_index_for_key_group(
            128, 3, ast.assign_to_key_group(key_of(record), 128))].append(record)
    rdd = sc.parallelize(range(3), 3).flatMap(lambda i: parts[i])
    run = aspark.partition_runner(CountOnly, key_selector=key_of, num_partitions=3,
                                  backend="heap")
    _counts_continue(rdd.mapPartitionsWithIndex(run).coalesce(1).collect(), Counter(), data)
    # Under mapPartitions the index is the task's: coalesced, every partition claims 0.
    with pytest.raises(ast.KeyGroupError, match="outside this operator's key groups"):
        rdd.mapPartitions(run).coalesce(1).collect()
