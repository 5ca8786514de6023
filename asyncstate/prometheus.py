"""Prometheus export of operator metrics (needs `prometheus_client`: extra ``metrics``).

`OperatorCollector` is a `prometheus_client` collector: nothing is counted twice and nothing
costs anything per record, because each scrape reads the operators' own counters
(`KeyedOperator.metrics`). Every sample carries the labels `operator` (the function's class
name), `index` (the operator index) and any given to `add`::

    from prometheus_client import start_http_server
    from asyncstate.prometheus import OperatorCollector

    collector = OperatorCollector()          # registered with prometheus_client's REGISTRY
    async with ast.KeyedOperator(...) as op:
        collector.add(op, job="sessions")
        start_http_server(9108)
        ...

Names: counters ``asyncstate_<name>_total`` (records_in, records_done, batches, requests,
slow_batches, cache_hits, cache_misses, cache_evictions, cache_refused, and
blocked_seconds), gauges ``asyncstate_<name>`` (in_flight, in_flight_peak,
num_in_flight_records, active_buffer_size, blocking_buffer_size, num_blocking_keys,
batches_in_executor, buffered_writes, max_batch_size, cache_entries, cache_hit_rate),
histograms ``asyncstate_batch_size`` (requests per executor
call) and ``asyncstate_request_latency_seconds`` (a request's time in the executor).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

try:
    from prometheus_client import REGISTRY, CollectorRegistry
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("asyncstate.prometheus needs the prometheus_client package: "
                      "pip install 'asyncstate[metrics]'") from exc

from asyncstate.errors import InvalidStateError
from asyncstate.histogram import Histogram

if TYPE_CHECKING:
    from asyncstate.operator.keyed import KeyedOperator

__all__ = ["OperatorCollector"]

_PREFIX = "asyncstate_"
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_COUNTERS = {
    "records_in": "Records admitted.",
    "records_done": "Records finished.",
    "batches": "Executor calls (batches of state requests).",
    "requests": "State requests issued (sync points not counted).",
    "slow_batches": "Batches whose round trip reached the slow-batch threshold.",
    "cache_hits": "Reads the state cache answered.",
    "cache_misses": "Reads the state cache sent to the backend.",
    "cache_evictions": "Entries the state cache dropped to stay within its bound.",
    "cache_refused": "New entries the full state cache did not admit (their keys came once).",
    "blocked_seconds": "Seconds process() waited for capacity (back-pressure).",
}
_GAUGES = {
    "in_flight": "Records admitted and not finished.",
    "in_flight_peak": "Most records admitted and not finished at once.",
    "num_in_flight_records": "Records in flight in the controller (Flink numInFlightRecords).",
    "active_buffer_size": "Requests waiting for the next batch (Flink activeBufferSize).",
    "blocking_buffer_size": "Requests waiting for their key (Flink blockingBufferSize).",
    "num_blocking_keys": "Keys with requests waiting (Flink numBlockingKeys).",
    "batches_in_executor": "Batches sent and not yet delivered.",
    "buffered_writes": "Writes completed at issue time that the store has not applied yet.",
    "max_batch_size": "Most requests in one executor call.",
    "cache_entries": "Entries in the state cache.",
    "cache_hit_rate": "Cache hits over reads that reached the cache.",
}
# Bucket bounds: requests per batch (2**0 .. 2**13, counted exactly), and seconds in the
# executor.
_BATCH_BOUNDS = tuple(2**i for i in range(14))
_LATENCY_BOUNDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _cumulative(histogram: Histogram, bounds: tuple[float, ...],
                scale: float) -> list[tuple[str, float]]:
    """Prometheus buckets (cumulative counts per upper bound `le`) of a histogram whose
    values times `scale` are in the bounds' unit; each of its buckets counts towards the
    first bound that its smallest value does not exceed (a bucket holds values within 1.6 %
    of each other, so a value at most that far above a bound may count towards it)."""
    counts = [0] * (len(bounds) + 1)
    for lower, _upper, count in histogram.buckets():
        value = lower * scale
        for i, bound in enumerate(bounds):
            if value <= bound:
                counts[i] += count
                break
        else:
            counts[-1] += count
    return _running(bounds, counts)


def _pow2_cumulative(pow2: list[int]) -> list[tuple[str, float]]:
    """Prometheus buckets of `BatchStats.batch_sizes_pow2` for `_BATCH_BOUNDS`: exact."""
    n = len(_BATCH_BOUNDS)
    return _running(_BATCH_BOUNDS, [*pow2[:n], sum(pow2[n:])])


def _running(bounds: tuple[float, ...], counts: list[int]) -> list[tuple[str, float]]:
    """Cumulative (le, count) pairs of per-bound `counts`, the last one for +Inf."""
    result: list[tuple[str, float]] = []
    running = 0
    for bound, count in zip((*bounds, float("inf")), counts, strict=True):
        running += count
        result.append(("+Inf" if bound == float("inf") else repr(bound), running))
    return result


class OperatorCollector:
    """Exports the metrics of the operators added to it (see the module docstring)."""

    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        self._operators: list[tuple[KeyedOperator, dict[str, str]]] = []
        self._lock = threading.Lock()
        if registry is not None:
            registry.register(self)

    def add(self, operator: KeyedOperator, **labels: str) -> None:
        """Export `operator`'s metrics, with `labels` (str values) besides `operator` and
        `index`. An operator is added once."""
        for name, value in labels.items():
            if not _LABEL_NAME.fullmatch(name) or name.startswith("__"):
                raise ValueError(f"label name {name!r} is not a Prometheus label name "
                                 f"([a-zA-Z_][a-zA-Z0-9_]*, not starting with __)")
            if type(value) is not str:
                raise TypeError(f"label {name}'s value must be a str, got "
                                f"{type(value).__name__} {value!r}")
        base = {"operator": type(operator.function).__name__,
                "index": str(operator.operator_index)}
        with self._lock:
            if any(op is operator for op, _labels in self._operators):
                raise ValueError(f"{operator!r} is exported by this collector already")
            self._operators.append((operator, {**base, **labels}))

    def remove(self, operator: KeyedOperator) -> None:
        """Stop exporting `operator`."""
        with self._lock:
            self._operators = [(op, lb) for op, lb in self._operators if op is not operator]

    def describe(self) -> list[Metric]:
        """The metric families without samples: a registry refuses a second collector
        exporting the same names."""
        families, batch, latency = _families([])
        return [*families.values(), batch, latency]

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            operators = list(self._operators)
        names = sorted({k for _op, labels in operators for k in labels})
        families, batch, latency = _families(names)
        for op, labels in operators:
            values = [labels.get(n, "") for n in names]
            metrics = op.metrics
            for name, family in families.items():
                family.add_metric(values, float(metrics[name]))
            try:
                stats = op.controller.batch_stats
            except InvalidStateError:  # not started yet
                continue
            batch.add_metric(values, _pow2_cumulative(stats.batch_sizes_pow2),
                             float(stats.batch_sizes.total))
            latency.add_metric(values, _cumulative(stats.request_latency_us,
                                                   _LATENCY_BOUNDS, 1e-6),
                               stats.request_latency_us.total * 1e-6)
        yield from families.values()
        yield batch
        yield latency


def _families(names: list[str]) -> tuple[dict[str, Any], Any, Any]:
    """Empty metric families with label names `names`: counters and gauges by metric name,
    then the two histograms."""
    families: dict[str, Any] = {}
    for name, doc in _COUNTERS.items():
        families[name] = CounterMetricFamily(_PREFIX + name, doc, labels=names)
    for name, doc in _GAUGES.items():
        families[name] = GaugeMetricFamily(_PREFIX + name, doc, labels=names)
    batch = HistogramMetricFamily(_PREFIX + "batch_size", "Requests per executor call.",
                                  labels=names)
    latency = HistogramMetricFamily(
        _PREFIX + "request_latency_seconds",
        "Time a state request spent in the executor (its batch's round trip).", labels=names)
    return families, batch, latency
