"""The grid of an experiment: one knob swept at a time around a base point, and running it.

Every knob has a list of values; the first is its base. A *sweep* varies one knob over its
values while every other knob stays at its base, for the arms that sweep compares:

| sweep | arms | input |
| --- | --- | --- |
| latency_ms | every arm (RocksDB ones when rocksdict is installed) | closed loop |
| max_in_flight, batch_size, io_parallelism, keys, distribution | the two asyncstate arms | closed |
| cache_entries | asyncstate+cache | closed loop |
| buffer_timeout_ms | asyncstate | open loop at the base rate |
| rate | asyncstate, asyncstate+cache | open loop, buffer timeout `open_buffer_timeout_ms` |

The latency sweep always runs; another runs when its knob has more than one value. A run
that several sweeps share (the base point) runs once. Every run is bounded by `seconds`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from asyncstate.experiments import keys as key_streams
from asyncstate.experiments.arms import ARMS, Point, rocksdb_available
from asyncstate.experiments.driver import RunResult, run

__all__ = ["QUICK", "STANDARD", "Grid", "Run", "plan", "run_grid"]

_ASYNC = ("asyncstate", "asyncstate+cache")
_ALL = ("sync baseline", "asyncstate", "asyncstate+cache")
_ROCKSDB = ("asyncstate (rocksdb)", "asyncstate+cache (rocksdb)")
_RECORDS_PER_SECOND = 400_000  # key stream length per second of run (cycled beyond)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Grid:
    """The values of every knob (the first of each is its base) and the run settings."""

    workload: str = "counter"
    latency_ms: tuple[float, ...] = (1.5, 0.0, 0.2, 5.0, 23.0)
    latency_p99_ms: float | None = None
    batch_size: tuple[int, ...] = (1000, 100, 3000)
    buffer_timeout_ms: tuple[int, ...] = (1000, 1, 5, 20, 100)
    max_in_flight: tuple[int, ...] = (6000, 100, 300, 1000, 3000, 12000)
    io_parallelism: tuple[int, ...] = (2, 1, 4)
    keys: tuple[int, ...] = (100_000, 1_000, 1_000_000)
    distribution: tuple[str, ...] = ("uniform", "zipf")
    zipf_theta: float = 0.99
    cache_entries: tuple[int, ...] = (0, 1_000, 100_000)
    cache_write_back: bool = False
    rate: tuple[float, ...] = (20_000.0, 5_000.0, 50_000.0, 100_000.0, 200_000.0)
    open_buffer_timeout_ms: int = 5
    seconds: float = 3.0
    rocksdb: bool = True
    sample_every: int = 8
    seed: int = 1

    def base(self) -> Point:
        return Point(workload=self.workload, latency_ms=self.latency_ms[0],
                     latency_p99_ms=self.latency_p99_ms, batch_size=self.batch_size[0],
                     buffer_timeout_ms=self.buffer_timeout_ms[0],
                     max_in_flight=self.max_in_flight[0],
                     io_parallelism=self.io_parallelism[0], keys=self.keys[0],
                     distribution=self.distribution[0], zipf_theta=self.zipf_theta,
                     cache_entries=self.cache_entries[0],
                     cache_write_back=self.cache_write_back)


STANDARD = Grid()
QUICK = Grid(latency_ms=(1.5, 0.0, 23.0), batch_size=(1000,), buffer_timeout_ms=(1000, 2, 20),
             max_in_flight=(6000, 500), io_parallelism=(2,), keys=(100_000,),
             distribution=("uniform", "zipf"), cache_entries=(0,),
             rate=(20_000.0, 100_000.0), seconds=0.8)


@dataclasses.dataclass
class Run:
    """One run of the plan: an arm at a point, the sweeps it belongs to (with the value of
    each sweep's knob), and its result once run."""

    arm: str
    point: Point
    sweeps: list[tuple[str, Any]]
    result: RunResult | None = None
    error: str | None = None


def plan(grid: Grid) -> list[Run]:
    """The runs of `grid`, each once, in the order they run (see the module docstring)."""
    base = grid.base()
    rocksdb = grid.rocksdb and rocksdb_available()
    runs: dict[tuple[str, Point], Run] = {}

    def add(sweep: str, value: Any, arms: Sequence[str], **changes: Any) -> None:
        point = dataclasses.replace(base, **changes)
        for arm in arms:
            found = runs.get((arm, point))
            if found is None:
                found = runs[(arm, point)] = Run(arm, point, [])
            found.sweeps.append((sweep, value))

    for latency in grid.latency_ms:
        add("latency_ms", latency, _ALL + (_ROCKSDB if rocksdb else ()), latency_ms=latency)
    sweeps: list[tuple[str, Sequence[Any], Sequence[str], dict[str, Any]]] = [
        ("max_in_flight", grid.max_in_flight, _ASYNC, {}),
        ("batch_size", grid.batch_size, _ASYNC, {}),
        ("io_parallelism", grid.io_parallelism, _ASYNC, {}),
        ("keys", grid.keys, _ASYNC, {}),
        ("distribution", grid.distribution, _ASYNC, {}),
        ("cache_entries", grid.cache_entries, ("asyncstate+cache",), {}),
        ("buffer_timeout_ms", grid.buffer_timeout_ms, ("asyncstate",), {"rate": grid.rate[0]}),
    ]
    for knob, values, arms, extra in sweeps:
        if len(values) > 1:
            for value in values:
                add(knob, value, arms, **{knob: value, **extra})
    if len(grid.rate) > 1:
        for rate in grid.rate:
            add("rate", rate, _ASYNC, rate=rate,
                buffer_timeout_ms=grid.open_buffer_timeout_ms)
    return list(runs.values())


def run_grid(grid: Grid, runs: list[Run], *,
             starting: Callable[[int, Run], None] | None = None,
             progress: Callable[[int, float], None] | None = None) -> None:
    """Run every run of `runs` (filling in `result`, or `error` when it crashed). Key streams
    are drawn once per (distribution, keys). `starting(i, run)` is called before each."""
    streams: dict[tuple[str, int], tuple[list[int], float]] = {}
    for i, item in enumerate(runs):
        if starting is not None:
            starting(i, item)
        p = item.point
        stream = streams.get((p.distribution, p.keys))
        if stream is None:
            n = max(int(_RECORDS_PER_SECOND * grid.seconds), 10_000)
            stream = streams[(p.distribution, p.keys)] = (
                key_streams.key_stream(p.distribution, p.keys, n, theta=p.zipf_theta,
                                       seed=grid.seed),
                key_streams.hottest_share(p.distribution, p.keys, p.zipf_theta))
        try:
            item.result = run(ARMS[item.arm], p, stream[0], stream[1], seconds=grid.seconds,
                              seed=grid.seed, sample_every=grid.sample_every,
                              progress=progress)
        except Exception as exc:  # noqa: BLE001 - reported in the table; the others run on
            item.error = f"{type(exc).__name__}: {exc}"
