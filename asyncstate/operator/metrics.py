"""The metrics of an operator (`KeyedOperator.metrics`), gathered from its parts.

Counters (since the operator started): `records_in`, `records_done`, `batches` (executor
calls), `requests` (state requests, sync points not counted), `slow_batches`, `cache_hits`,
`cache_misses`, `cache_evictions`, `cache_refused` (new entries the full cache did not
admit). Gauges (now): `in_flight` (records admitted and not finished: in the inbox or in
flight), and Flink's `asyncStateProcessing` gauges under
snake_case names: `num_in_flight_records` (records in flight in the controller),
`active_buffer_size` (requests waiting for the next batch), `blocking_buffer_size`
(requests waiting for their key), `num_blocking_keys`; `batches_in_executor`,
`buffered_writes` (writes completed at issue time, not yet applied by the store: with a
state cache), `cache_entries`. Peaks and sums: `in_flight_peak`, `max_batch_size`,
`blocked_seconds` (time
`process` waited for capacity), `cache_hit_rate` (hits over reads that reached the cache).
Histograms, as {count, mean, min, p50, p90, p99, p99_9, max}: `batch_size` (requests per
executor call) and `request_latency_ms` (each request's time in the executor: its batch's
trigger to delivery). Nothing here costs anything per record: the parts keep plain counters
and this function reads them when asked.

`measure_occupancy` starts the one measurement that does cost per record (two clock readings):
the records admitted and not finished, integrated over time (`KeyedOperator.measure_occupancy`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncstate.backends.cache import StateCache
from asyncstate.histogram import Histogram
from asyncstate.operator.admission import AdmissionGate
from asyncstate.runtime.controller import AsyncExecutionController
from asyncstate.runtime.occupancy import Occupancy

__all__ = ["METRIC_NAMES", "measure_occupancy", "operator_metrics"]

METRIC_NAMES = (
    "records_in", "records_done", "in_flight", "in_flight_peak", "batches", "requests",
    "max_batch_size", "blocked_seconds", "num_in_flight_records", "active_buffer_size",
    "blocking_buffer_size", "num_blocking_keys", "batches_in_executor", "buffered_writes",
    "slow_batches",
    "batch_size", "request_latency_ms", "cache_entries", "cache_hits", "cache_misses",
    "cache_evictions", "cache_refused", "cache_hit_rate",
)

_EMPTY = Histogram()


def operator_metrics(controller: AsyncExecutionController | None,
                     gate: AdmissionGate | None,
                     caches: Sequence[StateCache] = ()) -> dict[str, Any]:
    """Every metric of `METRIC_NAMES` (zeros before the operator started); `caches` are
    the state caches of its backend."""
    hits = sum(c.hits for c in caches)
    misses = sum(c.misses for c in caches)
    cache = {"cache_entries": sum(c.size for c in caches), "cache_hits": hits,
             "cache_misses": misses, "cache_evictions": sum(c.evictions for c in caches),
             "cache_refused": sum(c.refused for c in caches),
             "cache_hit_rate": hits / (hits + misses) if hits + misses else 0.0}
    if controller is None or gate is None:
        return {"records_in": 0, "records_done": 0, "in_flight": 0, "in_flight_peak": 0,
                "batches": 0, "requests": 0, "max_batch_size": 0, "blocked_seconds": 0.0,
                "num_in_flight_records": 0, "active_buffer_size": 0,
                "blocking_buffer_size": 0, "num_blocking_keys": 0, "batches_in_executor": 0,
                "buffered_writes": 0, "slow_batches": 0, "batch_size": _EMPTY.summary(),
                "request_latency_ms": _EMPTY.summary(), **cache}
    stats = controller.batch_stats
    return {
        "records_in": gate.records_in,
        "records_done": controller.records_done,
        "in_flight": gate.in_flight,
        "in_flight_peak": max(gate.peak, controller.in_flight_peak),
        "batches": controller.batches,
        "requests": controller.requests,
        "max_batch_size": controller.max_batch_size,
        "blocked_seconds": gate.blocked_seconds,
        "num_in_flight_records": controller.in_flight_record_num,
        "active_buffer_size": controller.active_queue_size,
        "blocking_buffer_size": controller.blocking_queue_size,
        "num_blocking_keys": controller.blocking_key_num,
        "batches_in_executor": controller.batches_in_executor,
        "buffered_writes": controller.buffered_writes,
        "slow_batches": stats.slow_batches,
        "batch_size": stats.batch_sizes.summary(),
        "request_latency_ms": stats.request_latency_us.summary(scale=0.001),
        **cache,
    }


def measure_occupancy(gate: AdmissionGate, controller: AsyncExecutionController) -> Occupancy:
    """Start integrating the records `gate` admitted and `controller` has not finished over
    time: `gate` steps the result up per admitted record, `controller` down per finished one."""
    occupancy = Occupancy(gate.records_in - controller.records_done)  # records, not firings
    gate.occupancy = controller.occupancy = occupancy
    return occupancy
