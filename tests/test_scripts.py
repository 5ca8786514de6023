"""The benchmark script's command line (the benchmarks themselves run outside the suite)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_help_lists_every_scenario():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--help"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    for scenario in ("overhead", "rocksdb", "ttl", "skew", "spark", "timers"):
        assert f"{scenario}:" in done.stdout
