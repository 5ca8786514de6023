"""One run of one arm of `scripts/bench.py rocksdb`, for profilers: no rounds, no table.

    .venv/bin/python scripts/profile_arm.py rocksdb --records 500000
    perf record -F 999 --call-graph dwarf -- .venv/bin/python scripts/profile_arm.py rocksdb

Feeds the keyed counter (`CallbackCounter`, the benchmark's function and key order) through
one KeyedOperator and prints records/s, the loop thread's CPU time per record
(`time.thread_time()`; pool and RocksDB threads are not counted) and the share of the run the
loop thread was on a CPU. `--phases N` adds the same two figures for each Nth of the records
fed (chunk boundaries of `bench.feed`), to show how the cost moves as the state grows. The
answer is checked like the benchmark's: sampled keys read back after the drain
(`--skip-check` leaves that out of a profile). Arms:
`rocksdb` (RocksDBBackend, io_parallelism 2), `heap` (HeapBackend) and `heap-batched` (the
heap behind SimulatedRemoteBackend with no latency).

Single runs of this machine vary by 20 % and more: compare variants by alternating runs, and
quote ratios of one `bench.py` invocation, not these figures.
"""

from __future__ import annotations

import argparse
import itertools
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
    """The part of `bench.Bench` that `bench.feed` uses, without progress output. With
    `every` > 0 it notes (records, wall clock, loop-thread CPU) each time another `every`
    records have been fed."""

    def __init__(self, every: int = 0) -> None:
        self.every = every
        self.fed = 0
        self.marks: list[tuple[int, float, float]] = []

    def mark(self) -> None:
        self.marks.append((self.fed, time.perf_counter(), time.thread_time()))

    def tick(self, records: int) -> None:
        before = self.fed
        self.fed += records
        if self.every and self.fed // self.every > before // self.every:
            self.mark()


def _phases(marks: list[tuple[int, float, float]]) -> str:
    """Loop-thread CPU per record and records/s between consecutive marks."""
    parts = []
    for (a, wall_a, cpu_a), (b, wall_b, cpu_b) in itertools.pairwise(marks):
        if b > a:
            parts.append(f"{(cpu_b - cpu_a) / (b - a) * 1e6:.2f} us "
                         f"{(b - a) / (wall_b - wall_a) / 1e3:,.0f} K/s")
    return "phases (loop CPU per record, records/s): " + " | ".join(parts)


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
    parser.add_argument("--phases", type=int, default=0,
                        help="also report each Nth of the run (default: none)")
    parser.add_argument("--skip-check", action="store_true",
                        help="skip the untimed answer check, so that a profile of the whole "
                             "process holds only start-up and the timed run")
    args = parser.parse_args()
    keys = bench.overhead_keys(args.records, args.records, seed=args.seed)
    choose = bench.sample_chooser(keys, args.records, args.seed, bench.PROBE_PRESENT,
                                  bench.PROBE_ABSENT)
    config = ast.AsyncStateConfig(batch_size=args.batch_size, max_in_flight=args.max_in_flight)

    ticker = _Quiet(-(-args.records // args.phases) if args.phases > 0 else 0)

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
            ticker.mark()
            started, cpu = time.perf_counter(), time.thread_time()
            await bench.feed(ticker, op, keys)  # type: ignore[arg-type]
            seconds, cpu = time.perf_counter() - started, time.thread_time() - cpu
            if ticker.marks[-1][0] == ticker.fed:
                ticker.marks.pop()  # the last phase ends after the drain, as the run does
            ticker.mark()
            if args.skip_check:
                return seconds, cpu, None
            counts = await bench._probe(function, keys, choose)(op, len(keys))
        return seconds, cpu, counts

    with tempfile.TemporaryDirectory(prefix="asyncstate-profile-") as directory:
        seconds, cpu, counts = uvloop.run(run(directory))
    if counts is None:
        ok, answer = True, "not checked (--skip-check)"
    else:
        sample = set(choose(len(keys)))
        ok, detail = bench.check_counts(counts, Counter(k for k in keys if k in sample))
        answer = "ok" if ok else "WRONG: " + detail
    n = len(keys)
    print(f"{args.arm}: {n / seconds:,.0f} records/s, loop thread {cpu / n * 1e6:.2f} us CPU "
          f"per record, on a CPU {cpu / seconds:.0%} of the run; answer {answer}")
    if args.phases > 0:
        print(_phases(ticker.marks))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
