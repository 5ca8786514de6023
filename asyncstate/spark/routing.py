"""Routing records to partitions by key group, exactly: partition i of n receives exactly the
key groups of operator i of n (`ast.compute_key_group_range_for_operator_index`).

Two paths, both exact:

- RDD: each record's operator index is computed in Python and used as the shuffle key of
  `rdd.partitionBy(n, partitionFunc)` with the identity as partition function; PySpark
  places a record in partition ``partitionFunc(key) % n``, the index itself.
- DataFrame, with pyarrow: the operator index is computed in Arrow batches (`mapInArrow`) and
  replaced by a *route value* whose Spark hash lands in that partition:
  `df.repartition(n, col)` places a row in ``pmod(murmur3_x86_32(value, seed 42), n)``, and
  for each index the route value is the smallest int whose hash gives it. The placement is
  computed, not hoped for. Rows stay in the JVM through the shuffle (no pickling); the
  partition then reads them as Arrow batches.

The Arrow path needs pyarrow and pandas (not in asyncstate's core install nor in pyspark's);
without them DataFrames take the RDD path (`Row.asDict(recursive=True)` per row).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from typing import Any

import mmh3

from asyncstate.keygroups import (
    assign_to_key_group,
    compute_operator_index_for_key_group,
)

__all__ = [
    "MARKER_COLUMN",
    "ROUTE_COLUMN",
    "Router",
    "arrow_available",
    "exact_partition",
    "partition_index",
    "route_dataframe_arrow",
    "route_rdd",
    "route_values",
    "routed_rows",
    "spark_hash_int",
]

ROUTE_COLUMN = "__asyncstate_route"
MARKER_COLUMN = "__asyncstate_marker"  # set on the one marker row each partition receives
_SPARK_HASH_SEED = 42  # the seed of Spark's `hash()` and of HashPartitioning
_INT = struct.Struct("<i")


class Router:
    """A record's operator index of `num_partitions`: picklable, a table lookup per record."""

    __slots__ = ("key_selector", "max_parallelism", "owner")

    def __init__(self, key_selector: Callable[[Any], Any], max_parallelism: int,
                 num_partitions: int) -> None:
        self.key_selector = key_selector
        self.max_parallelism = max_parallelism
        self.owner = [compute_operator_index_for_key_group(max_parallelism, num_partitions, kg)
                      for kg in range(max_parallelism)]

    def __call__(self, record: Any) -> int:
        return self.owner[assign_to_key_group(self.key_selector(record), self.max_parallelism)]

    def keyed(self, records: Iterator[Any]) -> Iterator[tuple[int, Any]]:
        """``(operator index, record)`` pairs, for `partitionBy`."""
        from asyncstate.spark.failures import carry_from_task

        owner, select, max_p = self.owner, self.key_selector, self.max_parallelism
        for record in records:
            try:
                index = owner[assign_to_key_group(select(record), max_p)]
            except Exception as exc:  # the key selector's: carried to the driver as itself
                raise carry_from_task(exc, "while routing records by key") from exc
            yield index, record


def exact_partition(index: int) -> int:
    """The partition function of the RDD path: the shuffle key is the partition index."""
    return index


def route_rdd(rdd: Any, router: Router, num_partitions: int) -> Any:
    """`rdd` shuffled so partition i holds exactly the records of operator i; the result
    holds ``(index, record)`` pairs (the runner drops the index)."""
    keyed = rdd.mapPartitions(router.keyed)
    return keyed.partitionBy(num_partitions, exact_partition)


# -- the Arrow path ------------------------------------------------------------------------

def spark_hash_int(value: int) -> int:
    """Spark's `hash()` of an IntegerType value: murmur3 x86 32-bit of its 4 little-endian
    bytes, seed 42, signed."""
    return int(mmh3.hash(_INT.pack(value), _SPARK_HASH_SEED, True))


def route_values(num_partitions: int) -> list[int]:
    """For each partition index i, the smallest int v >= 0 that `repartition(n, col)` places in
    partition i (``spark_hash_int(v) mod n == i``)."""
    found: dict[int, int] = {}
    value = 0
    while len(found) < num_partitions:
        found.setdefault(spark_hash_int(value) % num_partitions, value)
        value += 1
    return [found[i] for i in range(num_partitions)]


def arrow_available() -> bool:
    """Whether this interpreter can run PySpark's Arrow UDFs (pyarrow and pandas in the
    versions PySpark requires)."""
    try:
        from pyspark.sql.pandas.utils import (
            require_minimum_pandas_version,
            require_minimum_pyarrow_version,
        )

        require_minimum_pandas_version()
        require_minimum_pyarrow_version()
    except ImportError:
        return False
    except Exception:  # noqa: BLE001 - PySpark's PackageNotInstalled and version errors
        return False
    return True


class _AddRoute:
    """mapInArrow function: appends the route column to each batch, computed from the rows
    as the function will see them (`asyncstate.spark.rows`). A marker row goes to the
    partition its marker column names."""

    def __init__(self, router: Router, num_partitions: int, schema: Any) -> None:
        self.router = router
        self.values = route_values(num_partitions)
        self.schema = schema  # the DataFrame's Spark schema, for the rows' conversion

    def __call__(self, batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        from asyncstate.spark.failures import carry_from_task
        from asyncstate.spark.rows import input_converter

        router, values = self.router, self.values
        convert = input_converter(self.schema)
        for batch in batches:
            markers = batch.column(MARKER_COLUMN)
            rows = batch.drop_columns([MARKER_COLUMN]).to_pylist()
            if convert is not None:
                rows = [convert(row) for row in rows]
            try:
                if markers.null_count == len(rows):
                    route = [values[router(row)] for row in rows]
                else:
                    route = [values[router(row)] if m is None else values[m]
                             for row, m in zip(rows, markers.to_pylist(), strict=True)]
            except Exception as exc:  # the key selector's: carried to the driver as itself
                raise carry_from_task(exc, "while routing records by key") from exc
            yield batch.append_column(ROUTE_COLUMN, pa.array(route, pa.int32()))


def route_dataframe_arrow(df: Any, router: Router, num_partitions: int) -> Any:
    """`df` with a route column, repartitioned so partition i holds exactly the rows of
    operator i, and one marker row more (its other columns null), so that no partition is
    empty: a partition learns its index from its rows (`partition_index`), never from the
    Spark task, whose partition id is another under `coalesce` or `union` of the result."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import IntegerType, StructField, StructType

    fields = df.schema.fields
    marked = df.withColumn(MARKER_COLUMN, F.lit(None).cast(IntegerType()))
    markers = df.sparkSession.range(num_partitions).select(
        *[F.lit(None).cast(f.dataType).alias(f.name) for f in fields],
        F.col("id").cast(IntegerType()).alias(MARKER_COLUMN))
    schema = StructType([*(StructField(f.name, f.dataType, True, f.metadata) for f in fields),
                         StructField(MARKER_COLUMN, IntegerType(), True),
                         StructField(ROUTE_COLUMN, IntegerType(), False)])
    with_route = marked.union(markers).mapInArrow(
        _AddRoute(router, num_partitions, df.schema), schema)
    return with_route.repartition(num_partitions, ROUTE_COLUMN)


def partition_index(batch: Any, num_partitions: int) -> int:
    """The partition a routed Arrow batch (with rows) belongs to, from its route column;
    RuntimeError when its rows disagree (the shuffle did not place them as computed)."""
    import pyarrow.compute as pc

    route = batch.column(ROUTE_COLUMN)
    bounds = pc.min_max(route).as_py()
    values = route_values(num_partitions)
    if bounds["min"] != bounds["max"] or bounds["min"] not in values:
        raise RuntimeError(f"a routed partition holds rows of route values {bounds['min']} to "
                           f"{bounds['max']}, not of one of {values}: Spark's hash "
                           "partitioning did not place them as computed")
    return values.index(bounds["min"])


def routed_rows(batch: Any) -> Any:
    """A routed Arrow batch without its marker rows and the routing columns."""
    import pyarrow.compute as pc

    markers = batch.column(MARKER_COLUMN)
    if markers.null_count != batch.num_rows:
        batch = batch.filter(pc.is_null(markers))
    return batch.drop_columns([MARKER_COLUMN, ROUTE_COLUMN])
