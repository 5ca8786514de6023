"""Timers and TTL state through the Spark bridge: pending timers travel in checkpoints and
fire after a rescale."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from spark_functions import SPARK_TEST_TIMEOUT_S, SessionTimers, key_of, timestamp_of

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
