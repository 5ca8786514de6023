"""One run of one arm of `scripts/bench.py rocksdb`, for profilers: no rounds, no table.

    .venv/bin/python scripts/profile_arm.py rocksdb --records 500000
    perf record -F 999 --call-graph dwarf -- .venv/bin/python scripts/profile_arm.py rocksdb

Feeds the keyed counter (`CallbackCounter`, the benchmark's function and key order) through
one KeyedOperator and prints records/s, the loop thread's CPU time per record
(`time.thread_time()`; pool and RocksDB threads are not counted) and the share of the run the
loop thread was on a CPU. The answer is checked like the benchmark's: sampled keys read back
after the drain. Arms: `rocksdb` (RocksDBBackend, io_parallelism 2), `heap` (HeapBackend) and
`heap-batched` (the heap behind SimulatedRemoteBackend with no latency).

Single runs of this machine vary by 20 % and more: compare variants by alternating runs, and
quote ratios of one `bench.py` invocation, not these figures.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter
from typing import Any

import uvloop

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench  # the benchmark's function, keys and checks

import asyncstate as ast

ARMS = ("rocksdb", "heap", "heap-batched")


class _Quiet:
    """The part of `bench.Bench` that `bench.feed` uses, without progress output."""

    def tick(self, records: int) -> None:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arm", choices=ARMS)
    parser.add_argument("--records", type=int, default=500_000,
                        help="records, each of its own key (default 500,000)")
    parser.add_argument("--batch-size", type=int, default=bench.ROCKSDB_BATCH_SIZE)
    parser.add_argument("--max-in-flight", type=int, default=bench.ROCKSDB_MAX_IN_FLIGHT)
    parser.add_argument("--write-buffer-bytes", type=int,
                        default=bench.ROCKSDB_WRITE_BUFFER_BYTES)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    keys = bench.overhead_keys(args.records, args.records, seed=args.seed)
    choose = bench.sample_chooser(keys, args.records, args.seed, bench.PROBE_PRESENT,
                                  bench.PROBE_ABSENT)
    config = ast.AsyncStateConfig(batch_size=args.batch_size, max_in_flight=args.max_in_flight)

    async def run(directory: str) -> tuple[float, float, Any]:
        backend: Any = ast.HeapBackend()
        if args.arm == "heap-batched":
            backend = ast.SimulatedRemoteBackend(backend, latency_ms=0)
        elif args.arm == "rocksdb":
            backend = ast.RocksDBBackend(
                os.path.join(directory, "db"), io_parallelism=bench.ROCKSDB_IO_PARALLELISM,
                options=ast.RocksDBOptions(write_buffer_bytes=args.write_buffer_bytes))
        function = bench.CallbackCounter()
        op = ast.KeyedOperator(function, key_selector=bench._identity, backend=backend,
                               config=config)
        async with op:
            started, cpu = time.perf_counter(), time.thread_time()
            await bench.feed(_Quiet(), op, keys)  # type: ignore[arg-type]
            seconds, cpu = time.perf_counter() - started, time.thread_time() - cpu
            counts = await bench._probe(function, keys, choose)(op, len(keys))
        return seconds, cpu, counts

    with tempfile.TemporaryDirectory(prefix="asyncstate-profile-") as directory:
        seconds, cpu, counts = uvloop.run(run(directory))
    sample = set(choose(len(keys)))
    ok, detail = bench.check_counts(counts, Counter(k for k in keys if k in sample))
    n = len(keys)
    print(f"{args.arm}: {n / seconds:,.0f} records/s, loop thread {cpu / n * 1e6:.2f} us CPU "
          f"per record, on a CPU {cpu / seconds:.0%} of the run; answer "
          f"{'ok' if ok else 'WRONG: ' + detail}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
