"""Running totals per user over a Spark DataFrame, rescaled from 4 partitions to 3 between
two runs: the second run restores the first run's checkpoint."""

import os
import sys
import tempfile

# Spark's workers run this interpreter; the driver binds to the loopback address.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

from pyspark.sql import SparkSession

import asyncstate as ast
import asyncstate.spark as aspark


class Clicks(ast.KeyedProcessFunction):
    def open(self, ctx):
        self.total = ctx.get_state(ast.ValueStateDescriptor("total"))

    async def process_element(self, row, ctx):  # row: a dict
        total = (await self.total.value() or 0) + row["clicks"]
        await self.total.update(total)
        ctx.emit((row["user"], row["day"], total))


builder = SparkSession.builder.master("local[2]").appName("clicks")
for key, value in aspark.quiet_conf().items():  # Spark's console output: errors only
    builder = builder.config(key, value)
spark = builder.getOrCreate()
spark.sparkContext.setLogLevel("ERROR")

schema = "user string, day int, clicks int"
days = {
    1: [("ann", 1, 3), ("bob", 1, 1), ("cid", 1, 4)],
    2: [("ann", 2, 2), ("bob", 2, 5), ("dan", 2, 1)],
}
with tempfile.TemporaryDirectory() as state:
    restore = None
    for day, partitions in ((1, 4), (2, 3)):
        totals = aspark.process_keyed(
            spark.createDataFrame(days[day], schema), Clicks,
            key_selector=lambda row: row["user"], num_partitions=partitions,
            checkpoint_dir=state, checkpoint_id=day, restore_from=restore,
            output_schema="user string, day int, total long")
        print(f"day {day} on {partitions} partitions:")
        for row in totals.orderBy("user").collect():
            print(f"  {row.user}: {row.total}")
        restore = aspark.verify_checkpoint(state, day)  # every partition committed its part
spark.stop()
