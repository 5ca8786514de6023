"""process_keyed over an RDD and a DataFrame: exact routing, per-key order, the model."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
from spark_functions import SPARK_TEST_TIMEOUT_S, KeyCounter, key_of, model_counts, records

import asyncstate as ast
import asyncstate.spark as aspark

# A JVM on a busy 2-core machine can take minutes where it usually takes seconds.
pytestmark = [pytest.mark.spark, pytest.mark.timeout(SPARK_TEST_TIMEOUT_S)]

N_RECORDS = 100_000
N_KEYS = 1_000
PARTITIONS = 4


def check_counter_outputs(outputs: list[Any], data: list[tuple[int, int]],
                          partitions: int) -> None:
    """Each key's outputs, in output order, count 1..n; every record is counted exactly once;
    every record ran in the partition that owns its key group."""
    by_key: dict[Any, list[int]] = defaultdict(list)
    ids: list[int] = []
    for key, n, record_id, partition in outputs:
        by_key[key].append(n)
        ids.append(record_id)
        assert partition == ast.compute_operator_index_for_key_group(
            128, partitions, ast.assign_to_key_group(key, 128)), (key, partition)
    assert sorted(ids) == sorted(i for _, i in data)
    model = model_counts([data])
    assert {k: len(v) for k, v in by_key.items()} == dict(model)
    for key, counts in by_key.items():
        assert counts == list(range(1, len(counts) + 1)), key


@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
def test_counter_over_an_rdd_matches_the_model(sc: Any, backend: str) -> None:
    data = records(N_RECORDS, N_KEYS)
    out = aspark.process_keyed(sc.parallelize(data, 3), KeyCounter, key_selector=key_of,
                               num_partitions=PARTITIONS, backend=backend)
    assert out.getNumPartitions() == PARTITIONS
    check_counter_outputs(out.collect(), data, PARTITIONS)


@pytest.mark.parametrize("routing", ["rdd", "arrow"])
def test_counter_over_a_dataframe_returns_a_dataframe(spark: Any, routing: str) -> None:
    data = records(N_RECORDS, N_KEYS)
    # Built in the JVM (the same records as `data`): nothing to ship from the driver.
    df = spark.range(N_RECORDS).selectExpr(f"(id * 7919) % {N_KEYS} AS key", "id")
    out = aspark.process_keyed(df, KeyCounter, key_selector=key_of, num_partitions=PARTITIONS,
                               backend="heap", routing=routing,
                               output_schema="key long, n long, id long, partition int")
    assert out.columns == ["key", "n", "id", "partition"]
    rows = out.collect()
    check_counter_outputs([tuple(r) for r in rows], data, PARTITIONS)


def test_partition_runner_keeps_each_keys_delivery_order(sc: Any) -> None:
    # Partitions built by hand, exactly by key group, so the delivery order is known.
    data = records(20_000, 300)
    parts: list[list[tuple[int, int]]] = [[] for _ in range(PARTITIONS)]
    for record in data:
        parts[ast.compute_operator_index_for_key_group(
            128, PARTITIONS, ast.assign_to_key_group(key_of(record), 128))].append(record)
    rdd = sc.parallelize(range(PARTITIONS), PARTITIONS).flatMap(lambda i: parts[i])
    run = aspark.partition_runner(KeyCounter, key_selector=key_of, num_partitions=PARTITIONS,
                                  backend="rocksdb")
    outputs = rdd.mapPartitions(run).collect()
    check_counter_outputs(outputs, data, PARTITIONS)
    delivered = {record_id: i for part in parts for i, (_, record_id) in enumerate(part)}
    by_key: dict[Any, list[int]] = defaultdict(list)
    for key, _, record_id, _ in outputs:
        by_key[key].append(delivered[record_id])
    for key, positions in by_key.items():
        assert positions == sorted(positions), key


def test_partition_runner_refuses_a_key_of_another_partition(sc: Any) -> None:
    # Two keys owned by operator 0 of 2; the second partition gets one of them.
    keys = [k for k in range(200) if ast.compute_operator_index_for_key_group(
        128, 2, ast.assign_to_key_group(k, 128)) == 0][:2]
    rdd = sc.parallelize([(keys[0], 0), (keys[1], 1)], 2)
    run = aspark.partition_runner(KeyCounter, key_selector=key_of, num_partitions=2,
                                  backend="heap")
    with pytest.raises(ast.KeyGroupError, match=r"outside this operator's key groups"):
        rdd.mapPartitions(run).collect()
