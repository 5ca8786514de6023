"""The Spark bridge: keyed asynchronous state inside Spark partitions.

`process_keyed` runs a KeyedProcessFunction over an RDD or DataFrame, one event loop per
partition, with records routed so partition i holds exactly the key groups of operator i;
`partition_runner` does it for an RDD already partitioned that way; `foreach_batch` carries
the state across the micro-batches of a Structured Streaming query. Checkpoints are written
per partition, by key group, so a job can restart with another number of partitions.
See docs/spark.md. Needs pyspark (`pip install 'asyncstate[spark]'`).
"""

from __future__ import annotations

try:
    import pyspark as _pyspark  # noqa: F401 - fail here, with the install command
except ImportError as _exc:
    raise ImportError(
        "asyncstate.spark needs pyspark: pip install 'asyncstate[spark]'") from _exc

from asyncstate.spark.failures import PartitionFailure as PartitionFailure
from asyncstate.spark.keyed import partition_runner as partition_runner
from asyncstate.spark.keyed import process_keyed as process_keyed
from asyncstate.spark.report import RunReport as RunReport
from asyncstate.spark.report import verify_checkpoint as verify_checkpoint
from asyncstate.spark.session import log4j2_properties as log4j2_properties
from asyncstate.spark.session import quiet_conf as quiet_conf
from asyncstate.spark.streaming import KeyedBatchWriter as KeyedBatchWriter
from asyncstate.spark.streaming import foreach_batch as foreach_batch
from asyncstate.spark.streaming import previous_checkpoint as previous_checkpoint

__all__ = [
    "KeyedBatchWriter",
    "PartitionFailure",
    "RunReport",
    "foreach_batch",
    "log4j2_properties",
    "partition_runner",
    "previous_checkpoint",
    "process_keyed",
    "quiet_conf",
    "verify_checkpoint",
]
