"""One experiment run: feed an operator for a bounded time, closed or open loop, and measure.

Input:
- closed loop: the next record goes in as soon as there is room (`max_in_flight`); its
  latency is measured from its admission, and the time the source waited for room is
  `blocked_seconds`;
- open loop: record i is due at t0 + i/rate; the source sends what is due (waiting for room
  when there is none) and sleeps until the next is due. Latency is measured from the
  intended arrival time, so time spent waiting in the source's backlog counts (no
  coordinated omission). The rate was sustainable when the source's backlog at the end was
  at most 20 ms of input and the latency stayed bounded: the median latency of the records
  due in the second half of the run at most twice that of the first half, plus 1 ms.

Latency is recorded for a sample of the records (every `sample_every`-th; every record when
max_in_flight is at most 64 or an open loop offers at most 50,000 records/s) into an
HDR-style histogram in microseconds (no self-check with fewer than 100 timed); the other
records carry no timestamp and cost nothing extra. For the Little's-law self-check the
operator integrates the records admitted and not finished over time, exactly, at every
admission and completion (`KeyedOperator.measure_occupancy`), and an open loop adds the time
each record waited in the source: over the run, which starts and ends empty, that
time-weighted mean number in the system must equal throughput x mean latency (within 5 %).
The two sides are measured apart: one by the operator's counts, the other by the sampled
records' timestamps. The resident set size is sampled every 256 records.

After the timed part the operator drains, for at most max(1 s, the run's time): a run whose
drain takes longer (a hot key's records queued behind each other) is cut there, its
throughput counts the records finished, and neither the self-check nor the answer is made.
Otherwise the run reads back the count of up to 200 keys it fed and compares them with the
records fed, so that a fast wrong run cannot pass.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import os
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import asyncstate as ast
from asyncstate.experiments.arms import Arm, Point, bounds
from asyncstate.experiments.workloads import PROBE, LatencyRecorder, make_workload

__all__ = ["LITTLE_TOLERANCE", "Progress", "RunResult", "run"]

LITTLE_TOLERANCE = 0.05
_CHECK_EVERY = 256  # records between two deadline checks (and progress reports)
_SAMPLE_ALL_UP_TO = 64  # max_in_flight at or below which every record is timed ...
_SAMPLE_ALL_BELOW_RATE = 50_000  # ... and open-loop rates at or below which
_MIN_SAMPLES = 100  # fewer timed records make no self-check
_PROBE_KEYS = 200
_MIN_DRAIN_S = 1.0  # the drain after the timed part takes at most max(this, seconds)
_BACKLOG_S = 0.02  # sustainable: the backlog at the end is at most this much input ...
_LATENCY_SLACK_US = 1000  # ... and the median latency did not grow more than 2x + this

Progress = Callable[[int, float], None]
"""``progress(records fed, seconds so far)``, called now and then from inside a run."""


@dataclasses.dataclass
class RunResult:
    """What one run measured (times in seconds unless named otherwise)."""

    arm: str
    point: Point
    config: ast.AsyncStateConfig  # the controller's knobs the arm ran with (sync: 1, 1)
    records: int
    seconds: float
    throughput: float
    latency_ms: dict[str, float]  # count, mean, min, p50, p90, p99, p99_9, max
    measured_store_latency_ms: float  # the mean latency the store slept per call
    in_flight_peak: int
    mean_in_flight: float  # time-weighted mean of the records admitted and not finished
    mean_in_system: float  # the same plus the open loop's backlog: Little's-law side
    blocked_seconds: float
    batches: int
    batch_size: dict[str, float]
    batch_size_buckets: list[tuple[int, int, int]]
    cache_hit_rate: float | None
    k: float
    bound: float
    hot_key_bound: float
    hottest_share: float
    littles_law_error: float | None  # None: the drain was cut short
    sustainable: bool | None
    backlog_end: int
    backlog_max: int
    rss_start_mb: float
    rss_peak_mb: float
    answer_ok: bool | None  # None: not checked (the drain was cut short)
    answer_detail: str

    @property
    def ratio_to_bound(self) -> float | None:
        return self.throughput / self.bound if math.isfinite(self.bound) else None

    @property
    def littles_law_ok(self) -> bool | None:
        if self.littles_law_error is None:
            return None
        return self.littles_law_error <= LITTLE_TOLERANCE

    def row(self) -> dict[str, Any]:
        """The run as one flat row (the CSV's columns; the JSON holds this and more)."""
        p = self.point
        c = self.config
        lat = self.latency_ms
        return {
            "arm": self.arm, "workload": p.workload, "mode": p.mode,
            "offered_rate": p.rate, "latency_ms": p.latency_ms,
            "latency_p99_ms": p.latency_p99_ms if p.latency_ms > 0 else None,
            "measured_store_latency_ms": self.measured_store_latency_ms,
            "batch_size": c.batch_size, "buffer_timeout_ms": c.buffer_timeout_ms,
            "max_in_flight": c.max_in_flight, "io_parallelism": p.io_parallelism,
            "keys": p.keys, "distribution": p.distribution, "zipf_theta": p.zipf_theta,
            "cache_entries": p.cache_size if "cache" in self.arm else 0,
            "cache_write_back": p.cache_write_back and "cache" in self.arm,
            "records": self.records, "seconds": self.seconds, "throughput": self.throughput,
            "latency_p50_ms": lat["p50"], "latency_p99_ms_measured": lat["p99"],
            "latency_p99_9_ms": lat["p99_9"], "latency_mean_ms": lat["mean"],
            "latency_max_ms": lat["max"], "latency_samples": lat["count"],
            "in_flight_peak": self.in_flight_peak, "mean_in_flight": self.mean_in_flight,
            "mean_in_system": self.mean_in_system,
            "blocked_seconds": self.blocked_seconds, "batches": self.batches,
            "mean_batch_size": self.batch_size["mean"],
            "p99_batch_size": self.batch_size["p99"],
            "cache_hit_rate": self.cache_hit_rate, "k": self.k, "bound": self.bound,
            "ratio_to_bound": self.ratio_to_bound, "hot_key_bound": self.hot_key_bound,
            "littles_law_error": self.littles_law_error,
            "littles_law_ok": self.littles_law_ok, "sustainable": self.sustainable,
            "backlog_end": self.backlog_end, "backlog_max": self.backlog_max,
            "rss_start_mb": self.rss_start_mb, "rss_peak_mb": self.rss_peak_mb,
            "answer_ok": self.answer_ok,
        }


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


class _Feed:
    """The source: feeds records to an open operator until a deadline."""

    def __init__(self, op: ast.KeyedOperator, keys: Sequence[int], sample_every: int,
                 progress: Progress | None) -> None:
        self.op = op
        self.keys = keys
        self.every = sample_every
        self.progress = progress
        self.fed = 0
        self.blocked = 0.0
        self.backlog_end = 0
        self.backlog_max = 0
        self.started = 0.0
        self.waited = 0.0  # open loop: seconds records waited in the source, summed
        self.rss_peak = _rss_mb()
        # Room as the operator's gate sees it (max_in_flight and the store's pacing), so
        # that `process` admits at once and a sampled record's latency starts at admission.
        self._has_room = op.admission.has_room
        self._controller = op.controller

    async def _room(self) -> None:
        began = time.perf_counter()
        await self._controller.wait_until(self._has_room)
        self.blocked += time.perf_counter() - began

    def _past(self, fed: int, deadline: float) -> bool:
        """Every `_CHECK_EVERY` records: report progress, sample the RSS, and say whether
        the deadline has passed."""
        self.fed = fed
        self.rss_peak = max(self.rss_peak, _rss_mb())
        now = time.perf_counter()
        if self.progress is not None:
            self.progress(fed, now - self.started)
        return now >= deadline

    async def closed(self, deadline: float) -> None:
        keys, n, every, process = self.keys, len(self.keys), self.every, self.op.process
        clock = time.perf_counter
        self.started = clock()
        i = 0
        while True:
            if not self._has_room():
                await self._room()
                if clock() >= deadline:
                    break
            await process((keys[i % n], clock() if i % every == 0 else -1.0))
            i += 1
            if i % _CHECK_EVERY == 0 and self._past(i, deadline):
                break
        self.fed = i

    async def open(self, deadline: float, rate: float) -> None:
        keys, n, every, process = self.keys, len(self.keys), self.every, self.op.process
        clock = time.perf_counter
        t0 = self.started = clock()
        waited = 0.0
        i = 0
        while True:
            now = clock()
            if now >= deadline:
                break
            due = int((now - t0) * rate) + 1
            if i >= due:
                await asyncio.sleep(t0 + i / rate - now)
                continue
            self.backlog_max = max(self.backlog_max, due - i)
            while i < due:
                if not self._has_room():
                    await self._room()
                intended = t0 + i / rate
                waited += clock() - intended
                await process((keys[i % n], intended if i % every == 0 else -1.0))
                i += 1
                if i % _CHECK_EVERY == 0 and self._past(i, deadline):
                    break
        self.fed = i
        self.waited = waited
        self.backlog_end = max(0, int((clock() - t0) * rate) + 1 - i)


async def _probe(op: ast.KeyedOperator, keys: Sequence[int], fed: int,
                 seed: int) -> tuple[bool, str]:
    """Read back the count of up to `_PROBE_KEYS` keys fed; compare with the records fed."""
    n = len(keys)
    counts = collections.Counter(keys[i % n] for i in range(fed))
    chosen = random.Random(seed).sample(sorted(counts), min(_PROBE_KEYS, len(counts)))
    op.outputs()
    for key in chosen:
        await op.process((key, PROBE))
    await op.drain()
    got = dict(op.outputs())
    wrong = [k for k in chosen if got.get(k) != counts[k]]
    if wrong:
        k = wrong[0]
        return False, (f"{len(wrong)} of {len(chosen)} keys read back wrong (key {k}: "
                       f"{got.get(k)}, want {counts[k]})")
    return True, f"{len(chosen)} keys read back: counts match {fed:,} records"


async def _run(arm: Arm, point: Point, keys: Sequence[int], hottest_share: float, *,
               seconds: float, seed: int, sample_every: int, directory: Path,
               progress: Progress | None) -> RunResult:
    drain_limit = max(_MIN_DRAIN_S, seconds)
    recorder = LatencyRecorder()
    backend = arm.backend(point, directory, seed)
    config = arm.config(point)
    slow = config.max_in_flight <= _SAMPLE_ALL_UP_TO or (
        point.rate is not None and point.rate <= _SAMPLE_ALL_BELOW_RATE)
    every = 1 if slow else sample_every
    op = ast.KeyedOperator(make_workload(point.workload, recorder), key_selector=_key,
                           backend=backend, config=config)
    rss_start = _rss_mb()
    drained = True
    answer_ok: bool | None = None
    detail = f"not checked: the drain was cut short after {drain_limit:g} s"
    try:
        async with op:
            feed = _Feed(op, keys, every, progress)
            occupancy = op.measure_occupancy()
            now = time.perf_counter()
            deadline = now + seconds
            recorder.split = now + seconds / 2
            if point.rate is None:
                await feed.closed(deadline)
            else:
                await feed.open(deadline, point.rate)
            try:
                await asyncio.wait_for(op.drain(), drain_limit)
            except TimeoutError:
                drained = False
            elapsed = time.perf_counter() - feed.started
            in_flight = occupancy.mean()
            in_system = in_flight + feed.waited / elapsed
            feed.rss_peak = max(feed.rss_peak, _rss_mb())
            metrics = op.metrics
            if not drained:
                raise _DrainCut
            answer_ok, detail = await _probe(op, keys, feed.fed, seed)
    except _DrainCut:
        pass  # the operator closed without draining: the records left are abandoned
    cache = backend.state_cache
    hit_rate = cache.hit_rate if cache is not None else None
    store_latency = backend.latency_stats()["mean"]
    figures = bounds(arm, point, latency_s=store_latency / 1000.0,
                     hit_rate=hit_rate or 0.0, hottest_share=hottest_share)
    done = feed.fed if drained else metrics["records_done"]
    throughput = done / elapsed if elapsed > 0 else 0.0
    latency = recorder.histogram.summary(scale=0.001)
    little = throughput * latency["mean"] / 1000.0
    error: float | None = None
    if drained and latency["count"] >= _MIN_SAMPLES:
        # Over a period that starts and ends empty, the identity is exact.
        error = abs(in_system - little) / max(in_system, little) \
            if max(in_system, little) > 0 else 0.0
    sustainable = None
    if point.rate is not None:
        first, last = recorder.halves
        sustainable = feed.backlog_end <= max(1, int(point.rate * _BACKLOG_S)) and (
            not first.count or not last.count
            or last.percentile(50) <= 2 * first.percentile(50) + _LATENCY_SLACK_US)
    stats = op.controller.batch_stats
    return RunResult(
        arm=arm.name, point=point, config=config, records=done, seconds=elapsed,
        throughput=throughput,
        latency_ms=latency, measured_store_latency_ms=store_latency,
        in_flight_peak=metrics["in_flight_peak"], mean_in_flight=in_flight,
        mean_in_system=in_system,
        blocked_seconds=feed.blocked, batches=metrics["batches"],
        batch_size=metrics["batch_size"], batch_size_buckets=stats.batch_sizes.buckets(),
        cache_hit_rate=hit_rate, k=figures["k"], bound=figures["bound"],
        hot_key_bound=figures["hot_key_bound"], hottest_share=hottest_share,
        littles_law_error=error, sustainable=sustainable, backlog_end=feed.backlog_end,
        backlog_max=feed.backlog_max, rss_start_mb=rss_start,
        rss_peak_mb=feed.rss_peak, answer_ok=answer_ok, answer_detail=detail)


class _DrainCut(Exception):
    """Leaves the operator without draining it (the drain took too long)."""


def _key(record: Any) -> Any:
    return record[0]


def run(arm: Arm, point: Point, keys: Sequence[int], hottest_share: float, *,
        seconds: float, seed: int = 1, sample_every: int = 8,
        progress: Progress | None = None) -> RunResult:
    """Run `arm` at `point` for `seconds` over `keys` (cycled), on a fresh uvloop (asyncio
    where uvloop is missing) and a fresh store; returns its figures."""
    with tempfile.TemporaryDirectory(prefix="asyncstate-experiment-") as tmp:
        coro = _run(arm, point, keys, hottest_share, seconds=seconds, seed=seed,
                    sample_every=sample_every, directory=Path(tmp), progress=progress)
        try:
            import uvloop
        except ImportError:
            return asyncio.run(coro)
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)

