"""What RocksDBBackend's plan (phase 1, on the loop thread) costs per request.

Plans the keyed counter's batches alone, without running them: batches of 1000 value reads
(`VALUE_GET`), then batches of 1000 writes of an int to the same keys (`VALUE_UPDATE`, with
an earlier batch still unapplied, as in the benchmark), each over 1000 distinct random keys.
Prints ns per request for each, best of three passes over 200 batches.

    .venv/bin/python scripts/probe_rocksdb_plan.py

To compare two builds, run each tree's copy from outside both trees, with the tree first on
the import path (each built in place with `python setup.py build_ext --inplace`):

    cd /tmp && PYTHONPATH=<tree> <tree>/.venv/bin/python <tree>/scripts/probe_rocksdb_plan.py

The first line says which implementation ran (compiled or python). It takes a few seconds.
"""

from __future__ import annotations

import os
import random
import tempfile
import time

import msgpack

import asyncstate as ast
from asyncstate import _compiled
from asyncstate.backends import rocksdb_batch
from asyncstate.runtime.context import RecordContext
from asyncstate.runtime.future import StateFuture
from asyncstate.runtime.requests import StateKind, StateRequest, StateRequestType
from asyncstate.serde import NONE_BYTES

BATCH = 1000
BATCHES = 200
PASSES = 3
MAX_PARALLELISM = 128


class _State:
    """The part of a state object that a request carries to the backend."""

    kind = StateKind.VALUE

    def __init__(self, name: str, handle: object) -> None:
        self.name = name
        self.handle = handle


def _batches(state: _State, rng: random.Random) -> list[tuple[list[StateRequest],
                                                               list[StateRequest]]]:
    batches = []
    for _ in range(BATCHES):
        contexts = []
        for _ in range(BATCH):
            key = rng.randrange(10**9)
            contexts.append(RecordContext(key, key, msgpack.packb(key), key % MAX_PARALLELISM,
                                          None))
        reads = [StateRequest(state, StateRequestType.VALUE_GET, None, NONE_BYTES, ctx,
                              StateFuture()) for ctx in contexts]
        writes = [StateRequest(state, StateRequestType.VALUE_UPDATE, 1, NONE_BYTES, ctx,
                               StateFuture()) for ctx in contexts]
        batches.append((reads, writes))
    return batches


def main() -> None:
    kg_prefix = [kg.to_bytes(2, "big") for kg in range(MAX_PARALLELISM)]
    with tempfile.TemporaryDirectory(prefix="asyncstate-probe-") as tmp:
        backend = ast.RocksDBBackend(os.path.join(tmp, "db"))
        try:
            state = _State("count", backend.register_state("count", StateKind.VALUE))
            batches = _batches(state, random.Random(1))
            best_read = best_write = float("inf")
            for _ in range(PASSES):
                read_seconds = write_seconds = 0.0
                for reads, writes in batches:
                    for request in reads:  # the plan caches it on the record; start afresh
                        request.context.storage_key = None
                    began = time.perf_counter()
                    rocksdb_batch._plan(rocksdb_batch._Job(reads, 0), kg_prefix, False)
                    middle = time.perf_counter()
                    rocksdb_batch._plan(rocksdb_batch._Job(writes, 0), kg_prefix, True)
                    read_seconds += middle - began
                    write_seconds += time.perf_counter() - middle
                best_read = min(best_read, read_seconds)
                best_write = min(best_write, write_seconds)
        finally:
            backend.close()
    requests = BATCHES * BATCH
    print(f"asyncstate {_compiled.mode()}")
    print(f"plan of VALUE_GET:    {best_read / requests * 1e9:5.0f} ns per request")
    print(f"plan of VALUE_UPDATE: {best_write / requests * 1e9:5.0f} ns per request")


if __name__ == "__main__":
    main()
