"""Which rocksdict calls let other Python threads run, and what a memtable insert costs.

1. GIL: a second thread counts loop iterations while the main thread (a) sleeps, (b) applies
   prebuilt WriteBatches with `Rdict.write`, (c) runs multi-gets with `Rdict.get(list)`. A
   call that releases the GIL leaves the counter near its rate during the sleep; a call that
   holds it slows the counter to what the interpreter's switch interval lets through. The
   write buffer holds every key here, so no flush or compaction competes for the CPU.
2. Cost: the same WriteBatches applied alone into a database shaped like `scripts/bench.py
   rocksdb` (RocksDBOptions with a 4 MiB write buffer), so the memtable fills and flushes
   as in that benchmark.

    .venv/bin/python scripts/probe_rocksdict_gil.py

Keys are 8 bytes in random order, 500 puts per WriteBatch (the puts of a 1000-request batch
of the keyed counter). Run it on a quiet machine; it takes ~10 s.
"""

from __future__ import annotations

import random
import tempfile
import threading
import time
from collections.abc import Callable

import rocksdict

from asyncstate import RocksDBOptions

PUTS_PER_BATCH = 500
BATCHES = 2000
BENCH_WRITE_BUFFER_BYTES = 4 * 2**20  # scripts/bench.py rocksdb
NO_FLUSH_WRITE_BUFFER_BYTES = 512 * 2**20


def spin_rate(work: Callable[[], float]) -> tuple[float, float]:
    """(iterations per second of a spinning thread while work() runs, seconds of work)."""
    running = [True]
    counted = [0]

    def spin() -> None:
        n = 0
        while running[0]:
            n += 1
        counted[0] = n

    thread = threading.Thread(target=spin)
    thread.start()
    time.sleep(0.05)  # let the thread start spinning
    seconds = work()
    running[0] = False
    thread.join()
    return counted[0] / (seconds + 0.05), seconds


class Database:
    """A fresh database with one column family, opened with `RocksDBOptions`."""

    def __init__(self, path: str, write_buffer_bytes: int) -> None:
        options, self.write_options = RocksDBOptions(
            write_buffer_bytes=write_buffer_bytes).to_rocksdict()
        self.db = rocksdict.Rdict(path, options)
        self.cf = self.db.create_column_family("state", options)
        self.handle = self.db.get_column_family_handle("state")

    def batches(self, keys: list[bytes]) -> list[rocksdict.WriteBatch]:
        batches = []
        for start in range(0, len(keys), PUTS_PER_BATCH):
            batch = rocksdict.WriteBatch(raw_mode=True)
            for key in keys[start:start + PUTS_PER_BATCH]:
                batch.put(key, b"\x05", self.handle)
            batches.append(batch)
        return batches

    def write(self, batches: list[rocksdict.WriteBatch]) -> float:
        began = time.perf_counter()
        for batch in batches:
            self.db.write(batch, self.write_options)
        return time.perf_counter() - began

    def multi_get(self, keys: list[bytes]) -> float:
        began = time.perf_counter()
        for start in range(0, len(keys), PUTS_PER_BATCH):
            self.cf.get(keys[start:start + PUTS_PER_BATCH])  # type: ignore[arg-type]
        return time.perf_counter() - began


def main() -> None:
    rng = random.Random(1)
    keys = [rng.randrange(2**64).to_bytes(8, "big") for _ in range(PUTS_PER_BATCH * BATCHES)]
    with tempfile.TemporaryDirectory(prefix="asyncstate-probe-") as tmp:
        db = Database(f"{tmp}/no-flush", NO_FLUSH_WRITE_BUFFER_BYTES)
        batches = db.batches(keys)

        def sleep() -> float:
            time.sleep(1.0)
            return 1.0

        idle, _ = spin_rate(sleep)
        print(f"spinning thread while the main thread sleeps: {idle / 1e6:.1f} M/s")
        for name, work in (("Rdict.write(WriteBatch)", lambda: db.write(batches)),
                           ("Rdict.get(list)", lambda: db.multi_get(keys))):
            rate, seconds = spin_rate(work)
            # Not a cost figure: the main thread also waits for the spinner to hand back the GIL.
            print(f"spinning thread during {name}: {rate / 1e6:.1f} M/s "
                  f"({rate / idle:.0%} of idle; {seconds:.1f} s)")
        db.db.close()
        bench = Database(f"{tmp}/bench", BENCH_WRITE_BUFFER_BYTES)
        seconds = bench.write(bench.batches(keys))
        print(f"Rdict.write alone, {BENCH_WRITE_BUFFER_BYTES >> 20} MiB write buffer: "
              f"{seconds / len(keys) * 1e9:.0f} ns per put")
        bench.db.close()


if __name__ == "__main__":
    main()
