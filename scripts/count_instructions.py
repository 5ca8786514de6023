"""Instructions per record of the keyed counter, counted by valgrind's callgrind.

Timings on a busy machine move by tens of percent from run to run; instruction counts do
not. This script runs each arm twice under `valgrind --tool=callgrind` (with `--records`
and twice that many records) and prints the difference per record, which leaves start-up
and import costs out. Use it to compare two builds (two checkouts, or before and after a
change) on a machine that is too noisy for `scripts/bench.py`; confirm with bench.py on a
quiet one. It counts instructions, not cache misses or waits: a change that only moves work
off the loop thread, or that changes memory access patterns, shows here as no change.

    python scripts/count_instructions.py [--records N] [--arms heap-callback,heap-async,...]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence

ARMS = ("heap-callback", "heap-async", "heap-ttl", "batched-callback", "batched-async",
        "rocksdb-async", "rocksdb-ttl", "ttl-rocksdb-off", "ttl-rocksdb-on")

_CHILD = r"""
import random, shutil, sys, tempfile
import asyncstate as ast

arm, n = sys.argv[1], int(sys.argv[2])

class CallbackCounter(ast.KeyedProcessFunction):
    def open(self, ctx):
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))
    def process_element(self, value, ctx):
        state = self.count
        return state.value().then_compose(lambda c: state.update((c or 0) + 1))

class AsyncCounter(ast.KeyedProcessFunction):
    def __init__(self, ttl=None):
        self.ttl = ttl
    def open(self, ctx):
        self.count = ctx.get_state(ast.ValueStateDescriptor("count", ttl=self.ttl))
    async def process_element(self, value, ctx):
        await self.count.update((await self.count.value() or 0) + 1)

# heap-ttl, rocksdb-ttl: the async counter with the TTL of `bench.py ttl` (an hour,
# refreshed on read, incremental cleanup of 5 entries), processing time on the system clock.
ttl = (ast.StateTtlConfig.new_builder(3_600_000)
       .set_update_type(ast.UpdateType.ON_READ_AND_WRITE)
       .cleanup_incrementally(5, False).build()) if arm.endswith(("ttl", "on")) else None
config = None
records = [i % 10_000 for i in range(n)]
if arm.startswith("ttl-"):
    # ttl-rocksdb-off/-on: the RocksDB arms of `bench.py ttl` (callback counter, batch 1000,
    # max_in_flight 2000, 4 MiB write buffer, keys in a shuffled round-robin) over 20,000 keys.
    class TtlCounter(CallbackCounter):
        def open(self, ctx):
            self.count = ctx.get_state(ast.ValueStateDescriptor("count", ttl=ttl))
    fn = TtlCounter()
    backend = ast.RocksDBBackend(tempfile.mkdtemp(prefix="asyncstate-count-"),
                                 options=ast.RocksDBOptions(write_buffer_bytes=4 * 2**20))
    config = ast.AsyncStateConfig(batch_size=1000, max_in_flight=2000)
    order = list(range(20_000))
    random.Random(1).shuffle(order)
    records = [order[i % 20_000] for i in range(n)]
elif arm.endswith("callback"):
    fn = CallbackCounter()
else:
    fn = AsyncCounter(ttl)
if arm.startswith("heap"):
    backend = ast.HeapBackend()
elif arm.startswith("batched"):
    backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0)
elif arm.startswith("rocksdb"):
    backend = ast.RocksDBBackend(tempfile.mkdtemp(prefix="asyncstate-count-"))
try:
    ast.run(fn, records, key_selector=lambda r: r, backend=backend, config=config)
finally:
    if hasattr(backend, "path"):
        shutil.rmtree(backend.path, ignore_errors=True)
"""


def count(python: str, arm: str, records: int) -> int:
    """Instructions of one run of `arm` over `records` records."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        env = dict(os.environ, PYTHONHASHSEED="0")
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                        python, "-c", _CHILD, arm, str(records)],
                       check=True, env=env, capture_output=True)
        with open(out, encoding="utf-8") as f:
            text = f.read()
    match = re.search(r"^summary:\s+(\d+)", text, re.MULTILINE) or \
        re.search(r"^totals:\s+(\d+)", text, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"no instruction total in the callgrind output of {arm}")
    return int(match.group(1))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=20_000,
                        help="records of the smaller run (the larger has twice as many)")
    parser.add_argument("--arms", default=",".join(ARMS),
                        help=f"comma-separated arms (default: all of {', '.join(ARMS)})")
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter whose asyncstate is measured (default: this one)")
    args = parser.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        parser.error(f"unknown arms: {', '.join(unknown)} (choose from {', '.join(ARMS)})")
    n = args.records
    print(f"{'arm':<18} {'instructions/record':>20}")
    for arm in arms:
        per_record = (count(args.python, arm, 2 * n) - count(args.python, arm, n)) / n
        print(f"{arm:<18} {per_record:>20,.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
