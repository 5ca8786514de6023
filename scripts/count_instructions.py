"""Instructions per record of the keyed counter, counted by valgrind's callgrind.

Timings on a busy machine move by tens of percent from run to run; instruction counts do
not. This script runs each arm twice under `valgrind --tool=callgrind` (with `--records`
and twice that many records) and prints the difference per record, which leaves start-up
and import costs out. Use it to compare two builds (two checkouts, or before and after a
change) on a machine that is too noisy for `scripts/bench.py`; confirm with bench.py on a
quiet one. It counts instructions, not cache misses or waits: a change that only moves work
off the loop thread, or that changes memory access patterns, shows here as no change
(`--cache-sim` adds valgrind's simulated L1 cache misses per record, instruction and data).

    python scripts/count_instructions.py [--records N] [--keys N] [--keep DIR] [--cache-sim]
        [--arms heap-callback,heap-async,...]

With `--keys` K of the ttl- and cache- arms, `--records` K or more leaves the first visit of each
key (a read that finds nothing) in both runs: the difference is K..2K later visits.
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
        "rocksdb-async", "rocksdb-ttl", "ttl-rocksdb-off", "ttl-rocksdb-on", "cache-heap",
        "cache-wb")

_CHILD = r"""
import random, shutil, sys, tempfile
import asyncstate as ast

arm, n, n_keys = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

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
    # max_in_flight 2000, 4 MiB write buffer, keys in a shuffled round-robin, seed 1) over
    # `--keys` keys (the bench: 100,000).
    class TtlCounter(CallbackCounter):
        def open(self, ctx):
            self.count = ctx.get_state(ast.ValueStateDescriptor("count", ttl=ttl))
    fn = TtlCounter()
    backend = ast.RocksDBBackend(tempfile.mkdtemp(prefix="asyncstate-count-"),
                                 options=ast.RocksDBOptions(write_buffer_bytes=4 * 2**20))
    config = ast.AsyncStateConfig(batch_size=1000, max_in_flight=2000)
    order = list(range(n_keys))
    random.Random(1).shuffle(order)
    records = [order[i % n_keys] for i in range(n)]
elif arm.startswith("cache-"):
    # cache-heap/-wb: the callback counter over `--keys` keys in a shuffled round-robin, on
    # the heap, and through a write-back state cache holding every key (a quarter to
    # spare) in front of a heap store at no latency: what a cache of a partition's keys costs.
    fn = CallbackCounter()
    order = list(range(n_keys))
    random.Random(1).shuffle(order)
    records = [order[i % n_keys] for i in range(n)]
    if arm == "cache-wb":
        backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0,
                                             cache_entries=n_keys * 5 // 4,
                                             cache_write_back=True)
elif arm.endswith("callback"):
    fn = CallbackCounter()
else:
    fn = AsyncCounter(ttl)
if arm.startswith("heap") or arm == "cache-heap":
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


def count(python: str, arm: str, records: int, keys: int, keep: str | None = None,
          cache_sim: bool = False) -> dict[str, int]:
    """Events of one run of `arm` over `records` records (`keys` keys for the ttl- arms):
    instructions ("Ir"), with `cache_sim` also the simulated cache misses (I1mr, D1mr,
    D1mw, ...); with `keep`, its callgrind file is kept in that directory."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(keep or tmp, f"callgrind.out.{arm}.{records}")
        env = dict(os.environ, PYTHONHASHSEED="0")
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                        *(["--cache-sim=yes"] if cache_sim else []),
                        python, "-c", _CHILD, arm, str(records), str(keys)],
                       check=True, env=env, capture_output=True)
        with open(out, encoding="utf-8") as f:
            text = f.read()
    events = re.search(r"^events:\s+(.+)$", text, re.MULTILINE)
    match = re.search(r"^summary:\s+([\d ]+)$", text, re.MULTILINE) or \
        re.search(r"^totals:\s+([\d ]+)$", text, re.MULTILINE)
    if events is None or match is None:
        raise RuntimeError(f"no event totals in the callgrind output of {arm}")
    return dict(zip(events.group(1).split(), map(int, match.group(1).split()), strict=False))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=20_000,
                        help="records of the smaller run (the larger has twice as many)")
    parser.add_argument("--arms", default=",".join(ARMS),
                        help=f"comma-separated arms (default: all of {', '.join(ARMS)})")
    parser.add_argument("--keys", type=int, default=20_000,
                        help="keys of the ttl- and cache- arms (bench.py ttl: 100,000); the other "
                             "arms have 10,000")
    parser.add_argument("--keep", default=None, metavar="DIR",
                        help="keep each run's callgrind file in DIR (for callgrind_annotate)")
    parser.add_argument("--cache-sim", action="store_true",
                        help="also simulate the caches: instruction (I1mr) and data (D1mr, "
                             "D1mw) cache misses per record (slower)")
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter whose asyncstate is measured (default: this one)")
    args = parser.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        parser.error(f"unknown arms: {', '.join(unknown)} (choose from {', '.join(ARMS)})")
    n = args.records
    shown = ("Ir", "I1mr", "D1mr", "D1mw") if args.cache_sim else ("Ir",)
    print(f"{'arm':<18} {'instructions/record':>20}"
          + "".join(f" {e + '/record':>14}" for e in shown[1:]))
    for arm in arms:
        small = count(args.python, arm, n, args.keys, args.keep, args.cache_sim)
        large = count(args.python, arm, 2 * n, args.keys, args.keep, args.cache_sim)
        per_record = [(large[e] - small[e]) / n for e in shown]
        print(f"{arm:<18} {per_record[0]:>20,.0f}"
              + "".join(f" {v:>14,.1f}" for v in per_record[1:]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
