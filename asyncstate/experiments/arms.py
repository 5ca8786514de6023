"""What an experiment compares, and the bounds each run is held to.

A `Point` is one configuration of every knob; an `Arm` is a way to run the job at it:

- ``sync baseline``: one request at a time (batch_size 1, max_in_flight 1), as a
  synchronous state backend would be used;
- ``asyncstate``: asynchronous state, batches, many records in flight;
- ``asyncstate+cache``: the same with the state cache in front of the remote store.

Each runs against `SimulatedRemoteBackend`, whose inner store is the heap, or RocksDB for the
arms named ``(rocksdb)``.

The Little's-law bound of a closed loop: at most min(N, R*B) requests are at the store at
once (N records in flight with one request outstanding each, R I/O slots of batches of B),
each takes the measured latency L, and a record needs k requests at the store one after
another, so throughput <= min(N, R*B) / (k*L). Without a cache k is the workload's round
trips (2 for the counter); with it, k counts the requests that still reach the store (its
writes, and its reads times the miss rate). The hot-key bound: the records of the hottest
key (share p) run one after another, each waiting for its k round trips, so throughput <=
1 / (p * k * L); with a cache there is none: the hottest key stays cached, and its writes
complete at once.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path
from typing import Any

import asyncstate as ast
from asyncstate.experiments.workloads import WORKLOADS

__all__ = ["ARMS", "Arm", "Point", "bounds", "default_cache_entries", "rocksdb_available"]

MIN_CACHE_ENTRIES = 10_000


def default_cache_entries(n_keys: int) -> int:
    """1 % of the keys or 10,000 entries, whichever is larger."""
    return max(n_keys // 100, MIN_CACHE_ENTRIES)


def rocksdb_available() -> bool:
    """Whether the RocksDB arms can run (rocksdict is installed)."""
    return importlib.util.find_spec("rocksdict") is not None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Point:
    """One configuration: the workload, the input and every knob of the store and the
    controller. `cache_entries` 0 means `default_cache_entries(keys)`; `cache_write_back`
    makes the cache of the +cache arms write back; `rate` is the offered rate of an open loop
    (records/s), None for a closed loop."""

    workload: str = "counter"
    rate: float | None = None
    latency_ms: float = 1.5
    latency_p99_ms: float | None = None
    batch_size: int = 1000
    buffer_timeout_ms: int = 1000
    max_in_flight: int = 6000
    io_parallelism: int = 2
    keys: int = 100_000
    distribution: str = "uniform"
    zipf_theta: float = 0.99
    cache_entries: int = 0
    cache_write_back: bool = False

    @property
    def mode(self) -> str:
        """"open" (a fixed offered rate) or "closed" (as fast as admitted)."""
        return "closed" if self.rate is None else "open"

    @property
    def cache_size(self) -> int:
        return self.cache_entries or default_cache_entries(self.keys)


@dataclasses.dataclass(frozen=True)
class Arm:
    """A way to run the job: synchronous or not, with a cache or not, on the heap or RocksDB."""

    name: str
    sync: bool
    cache: bool
    store: str  # "heap" or "rocksdb"

    def config(self, point: Point) -> ast.AsyncStateConfig:
        if self.sync:
            return ast.AsyncStateConfig(batch_size=1, buffer_timeout_ms=0, max_in_flight=1)
        return ast.AsyncStateConfig(batch_size=point.batch_size,
                                    buffer_timeout_ms=point.buffer_timeout_ms,
                                    max_in_flight=point.max_in_flight)

    def backend(self, point: Point, directory: Path, seed: int) -> ast.SimulatedRemoteBackend:
        """A fresh backend for one run (`directory` holds a RocksDB store)."""
        inner: Any = ast.HeapBackend() if self.store == "heap" \
            else ast.RocksDBBackend(directory / "db")
        # A latency of 0 has no distribution: the p99 applies to the other latencies.
        p99 = point.latency_p99_ms if point.latency_ms > 0 else None
        return ast.SimulatedRemoteBackend(
            inner, latency_ms=point.latency_ms, latency_p99_ms=p99,
            io_parallelism=point.io_parallelism,
            cache_entries=point.cache_size if self.cache else 0,
            cache_write_back=point.cache_write_back and self.cache, seed=seed)


ARMS: dict[str, Arm] = {arm.name: arm for arm in (
    Arm("sync baseline", sync=True, cache=False, store="heap"),
    Arm("asyncstate", sync=False, cache=False, store="heap"),
    Arm("asyncstate+cache", sync=False, cache=True, store="heap"),
    Arm("sync baseline (rocksdb)", sync=True, cache=False, store="rocksdb"),
    Arm("asyncstate (rocksdb)", sync=False, cache=False, store="rocksdb"),
    Arm("asyncstate+cache (rocksdb)", sync=False, cache=True, store="rocksdb"),
)}


def bounds(arm: Arm, point: Point, *, latency_s: float, hit_rate: float,
           hottest_share: float) -> dict[str, float]:
    """The Little's-law bound and the hot-key bound of a run (records/s; inf when the
    latency is 0 or no request need wait), with the k each used."""
    workload = WORKLOADS[point.workload]
    reads = workload.round_trips - workload.writes
    config = arm.config(point)
    if arm.cache:
        k = workload.writes + reads * (1.0 - hit_rate)
        k_wait = 0.0  # the hottest key stays cached, and writes complete at once (buffered)
    else:
        k = k_wait = float(workload.round_trips)
    slots = min(config.max_in_flight, point.io_parallelism * config.batch_size)
    bound = slots / (k * latency_s) if k > 0 and latency_s > 0 else math.inf
    hot = 1.0 / (hottest_share * k_wait * latency_s) if k_wait > 0 and latency_s > 0 \
        else math.inf
    return {"k": k, "k_wait": k_wait, "bound": bound, "hot_key_bound": hot}
