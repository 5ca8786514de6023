"""Timers and TTL state through the Spark bridge: pending timers travel in checkpoints and
fire after a rescale; event-time TTL expires by the watermark, across a checkpoint and a
rescale."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from spark_functions import (
    SPARK_TEST_TIMEOUT_S,
    ExpiringCount,
    SessionTimers,
    key_of,
    timestamp_of,
)

import asyncstate as ast
import asyncstate.spark as aspark

pytestmark = [pytest.mark.spark, pytest.mark.timeout(SPARK_TEST_TIMEOUT_S)]


def test_pending_timers_fire_after_a_rescale(sc: Any, tmp_path: Path) -> None:
    # Key k gets records at 10k and 10k + 5 (k < 200): timers at 10k + 100 and 10k + 105.
    data = [(k, 10 * k + d) for k in range(200) for d in (0, 5)]
    chk = tmp_path / "chk"
    first = aspark.process_keyed(sc.parallelize(data, 3), SessionTimers, key_selector=key_of,
                                 timestamp_selector=timestamp_of, num_partitions=4,
                                 backend="rocksdb", checkpoint_dir=chk, checkpoint_id=1,
                                 final_watermark=1_000).collect()
    fired = {(k, ts) for _, k, ts, _, _ in first}
    assert fired == {(k, 10 * k + d + 100) for k in range(200) for d in (0, 5)
                     if 10 * k + d + 100 <= 1_000}
    # The rest is pending in the checkpoint: restored at 3 partitions, it fires at the end.
    second = aspark.process_keyed(sc.parallelize([], 2), SessionTimers, key_selector=key_of,
                                  timestamp_selector=timestamp_of, num_partitions=3,
                                  backend="heap", restore_from=ast.checkpoint_path(chk, 1),
                                  final_watermark=2**63 - 1).collect()
    later = {(k, ts) for _, k, ts, _, _ in second}
    assert later == {(k, 10 * k + d + 100) for k in range(200) for d in (0, 5)} - fired
    assert all(count == 2 for _, _, _, count, _ in first + second)
    for _, k, _, _, partition in second:
        assert partition == ast.operator_index_for_key(k, 128, 3)


def test_event_time_ttl_expires_across_a_checkpoint_and_a_rescale(sc: Any, tmp_path: Path
                                                                  ) -> None:
    # Key k counts twice at 10k (k < 200): its count, stamped 10k, expires once the watermark
    # reaches 10k + 100. The final watermark 1,000 expires keys 0-90; the checkpoint taken
    # after it leaves them out (full-snapshot cleanup), keeping the others' timestamps.
    data = [(k, 10 * k) for k in range(200) for _ in range(2)]
    chk = tmp_path / "chk"
    first = aspark.process_keyed(sc.parallelize(data, 3), ExpiringCount, key_selector=key_of,
                                 timestamp_selector=timestamp_of, num_partitions=4,
                                 backend="rocksdb", checkpoint_dir=chk, checkpoint_id=1,
                                 final_watermark=1_000).collect()
    # Nothing expires before the first watermark: each key's second record finds 1.
    assert Counter(found for _, _, found, _ in first) == {None: 200, 1: 200}
    # Restored at 3 partitions on the heap: keys 0-90 start again, the others find 2.
    again = [(k, 5_000) for k in range(200)]
    second = aspark.process_keyed(sc.parallelize(again, 2), ExpiringCount, key_selector=key_of,
                                  timestamp_selector=timestamp_of, num_partitions=3,
                                  backend="heap", restore_from=ast.checkpoint_path(chk, 1)
                                  ).collect()
    assert {k: found for _, k, found, _ in second} == {
        k: None if 10 * k + 100 <= 1_000 else 2 for k in range(200)}
    for _, k, _, partition in second:
        assert partition == ast.operator_index_for_key(k, 128, 3)


def test_an_initial_watermark_fires_restored_timers_before_the_first_record(
        sc: Any, tmp_path: Path) -> None:
    # Key k (k < 200) counts once at 10k: its timer at 10k + 100 stays pending in checkpoint 1.
    chk = tmp_path / "chk"
    first = aspark.process_keyed(sc.parallelize([(k, 10 * k) for k in range(200)], 3),
                                 SessionTimers, key_selector=key_of,
                                 timestamp_selector=timestamp_of, num_partitions=4,
                                 backend="rocksdb", checkpoint_dir=chk, checkpoint_id=1)
    assert first.collect() == []
    # Restored at 3 partitions with watermark 1,000: the timers of keys 0-90 fire before the
    # partition's records, so they see count 1; each key's record then counts a second time,
    # and the timers it registers (at 5,100) and those of keys 91-199 stay pending.
    report = aspark.RunReport(sc)
    again = [(k, 5_000 - k) for k in range(200)]
    second = aspark.process_keyed(sc.parallelize(again, 2), SessionTimers, key_selector=key_of,
                                  timestamp_selector=timestamp_of, num_partitions=3,
                                  backend="heap", restore_from=ast.checkpoint_path(chk, 1),
                                  initial_watermark=1_000, report=report).collect()
    assert sorted((k, ts, count) for _, k, ts, count, _ in second) == [
        (k, 10 * k + 100, 1) for k in range(91)]
    # Each partition reports the largest event time among its records.
    by_partition: dict[int, list[int]] = {}
    for k, ts in again:
        by_partition.setdefault(ast.operator_index_for_key(k, 128, 3), []).append(ts)
    assert {r["partition"]: r["max_timestamp"] for r in report.partitions} == {
        p: max(times) for p, times in by_partition.items()}
