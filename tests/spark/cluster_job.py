"""Driver of the standalone-cluster test, run in its own process (the test process already
has a local SparkContext, and a process has one): the rescale chain against the cluster at
argv[1], checkpoints under argv[2]. Prints one JSON line: the last checkpoint, the model's
counts and the working directories of the executors that ran partitions."""

from __future__ import annotations

import json
import os
import sys

import spark_functions
from pyspark import cloudpickle
from pyspark.sql import SparkSession

import asyncstate.spark as aspark


def main(master: str, checkpoint_dir: str) -> None:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    cloudpickle.register_pickle_by_value(spark_functions)
    builder = (SparkSession.builder.master(master).appName("asyncstate-cluster-test")
               .config("spark.executor.memory", "512m").config("spark.executor.cores", "1")
               .config("spark.cores.max", "2").config("spark.task.maxFailures", "2"))
    for key, value in aspark.quiet_conf().items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    try:
        sc = spark.sparkContext
        sc.setLogLevel("ERROR")
        report = aspark.RunReport(sc)
        last, model = spark_functions.run_rescale_chain(sc, checkpoint_dir, per_run=5_000,
                                                        keys=1_000, report=report)
        executors = sorted({r["cwd"] for r in report.partitions})
    finally:
        spark.stop()
    print(json.dumps({"last": last, "model": [[k, v] for k, v in model.items()],
                      "executors": executors}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
