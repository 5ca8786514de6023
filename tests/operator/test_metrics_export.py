"""Operator metrics (asyncstate/operator/metrics.py) and their Prometheus export
(asyncstate/prometheus.py): Flink's controller gauges, batch and latency histograms, cache
figures, all consistent with what the run did."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from shared_functions import Counter

import asyncstate as ast
from asyncstate.operator.metrics import METRIC_NAMES
from asyncstate.prometheus import OperatorCollector
from asyncstate.testing import ManualExecutor


async def _settle(op: ast.KeyedOperator, executor: ManualExecutor) -> None:
    """Deliver batches until no record is in flight (bounded)."""
    for _ in range(1000):
        if op.metrics["in_flight"] == 0:
            return
        op.controller.trigger_if_needed(True)
        executor.complete_all()
        await asyncio.sleep(0)
    raise AssertionError(f"records still in flight: {op.metrics}")


async def test_flink_gauges_follow_the_controller():
    executor = ManualExecutor()
    op = ast.KeyedOperator(Counter(), key_selector=lambda r: r[0], backend=executor,
                           config=ast.AsyncStateConfig(batch_size=100, buffer_timeout_ms=0,
                                                       max_in_flight=10))
    async with op:
        for record in [("a", 1), ("a", 2), ("a", 3), ("b", 1), ("b", 2)]:
            await op.process(record)
        for _ in range(3):  # the records start from a loop callback
            await asyncio.sleep(0)
        m = op.metrics
        # a#1 and b#1 hold their keys and wait for their reads; the others wait for the key.
        assert (m["num_in_flight_records"], m["active_buffer_size"],
                m["blocking_buffer_size"], m["num_blocking_keys"]) == (5, 2, 3, 2)
        assert (m["batches"], m["batches_in_executor"], m["requests"]) == (0, 0, 2)
        assert op.controller.trigger_if_needed(True)
        m = op.metrics
        assert (m["active_buffer_size"], m["batches"], m["batches_in_executor"]) == (0, 1, 1)
        assert m["batch_size"]["count"] == 1 and m["batch_size"]["max"] == 2
        await _settle(op, executor)
        m = op.metrics
    assert set(METRIC_NAMES) <= set(m)
    assert (m["records_done"], m["requests"], m["num_in_flight_records"],
            m["blocking_buffer_size"], m["num_blocking_keys"]) == (5, 10, 0, 0, 0)
    sizes, latency = m["batch_size"], m["request_latency_ms"]
    assert sizes["count"] == m["batches"] and round(sizes["mean"] * sizes["count"]) == 10
    assert latency["count"] == 10  # one figure per request sent to the executor
    assert m["cache_hits"] == m["cache_misses"] == m["cache_entries"] == m["cache_refused"] == 0


def test_every_request_is_answered_by_the_cache_or_sent_in_a_batch():
    backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0, cache_entries=20)
    metrics: dict[str, Any] = {}

    async def go() -> None:
        op = ast.KeyedOperator(Counter(), key_selector=lambda r: r, backend=backend,
                               config=ast.AsyncStateConfig(batch_size=8, max_in_flight=16))
        async with op:
            for i in range(400):  # ten hot keys among 40, 20 cached: hits and misses
                await op.process(i % 10 if i % 2 else i % 40)
            await op.drain()
            metrics.update(op.metrics)

    asyncio.run(go())
    cache = backend.state_cache
    assert (metrics["cache_hits"], metrics["cache_misses"]) == (cache.hits, cache.misses)
    assert metrics["cache_hits"] > 0 and metrics["cache_misses"] > 40
    assert metrics["cache_hit_rate"] == pytest.approx(
        cache.hits / (cache.hits + cache.misses))
    assert metrics["cache_entries"] == cache.size <= 20
    # More keys than entries: the full cache turns some of them away.
    assert metrics["cache_refused"] == cache.refused > 0
    sent = round(metrics["batch_size"]["mean"] * metrics["batch_size"]["count"])
    assert metrics["requests"] == 800 == metrics["cache_hits"] + sent
    assert metrics["request_latency_ms"]["count"] == sent


def _scrape(registry: CollectorRegistry) -> dict[str, dict[str, float]]:
    """{sample name: {label text: value}} of a scrape."""
    samples: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples.setdefault(sample.name, {})[labels] = sample.value
    return samples


def test_prometheus_export_reads_the_operators_counters():
    registry = CollectorRegistry()
    collector = OperatorCollector(registry)
    backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0, cache_entries=5)
    scraped: dict[str, Any] = {}

    async def go() -> None:
        op = ast.KeyedOperator(Counter(), key_selector=lambda r: r, backend=backend,
                               config=ast.AsyncStateConfig(batch_size=4))
        collector.add(op, job="test")  # before it starts: no histogram yet, zeros
        scraped["before"] = _scrape(registry)
        async with op:
            for i in range(100):
                await op.process(i % 10)
            await op.drain()
            scraped["metrics"] = op.metrics
            scraped["after"] = _scrape(registry)
        collector.remove(op)
        scraped["removed"] = _scrape(registry)

    asyncio.run(go())
    labels = "index=0,job=test,operator=Counter"
    before, after, m = scraped["before"], scraped["after"], scraped["metrics"]
    assert before["asyncstate_records_done_total"] == {labels: 0.0}
    assert "asyncstate_batch_size_count" not in before
    assert after["asyncstate_records_done_total"] == {labels: 100.0}
    assert after["asyncstate_requests_total"] == {labels: float(m["requests"])}
    assert after["asyncstate_cache_hits_total"] == {labels: float(m["cache_hits"])}
    assert m["cache_refused"] > 0  # ten keys through five entries
    assert after["asyncstate_cache_refused_total"] == {labels: float(m["cache_refused"])}
    assert after["asyncstate_num_in_flight_records"] == {labels: 0.0}
    assert after["asyncstate_batch_size_count"] == {labels: float(m["batches"])}
    sent = m["requests"] - m["cache_hits"]
    assert after["asyncstate_batch_size_sum"] == {labels: float(sent)}
    buckets = after["asyncstate_request_latency_seconds_bucket"]
    assert buckets["index=0,job=test,le=+Inf,operator=Counter"] == float(sent)
    counts = [buckets[f"index=0,job=test,le={le},operator=Counter"]
              for le in ("0.0001", "0.001", "0.01", "+Inf")]
    assert counts == sorted(counts)  # cumulative
    assert "asyncstate_records_done_total" not in scraped["removed"]


def test_prometheus_module_names_the_extra_when_prometheus_client_is_missing():
    code = textwrap.dedent("""
        import sys
        sys.modules["prometheus_client"] = None
        try:
            import asyncstate.prometheus
        except ImportError as exc:
            print(exc)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    assert proc.stdout.strip() == ("asyncstate.prometheus needs the prometheus_client "
                                   "package: pip install 'asyncstate[metrics]'")


@pytest.mark.parametrize("batch_size", [1, 2, 3, 64, 128, 129, 256, 1000])
def test_prometheus_batch_size_buckets_are_exact_at_their_bounds(batch_size):
    registry = CollectorRegistry()
    collector = OperatorCollector(registry)
    backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0)
    scraped: dict[str, Any] = {}

    class Reads(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

        def process_element(self, value, ctx):
            return self.v.value()

    async def go() -> None:
        # Every record reads once and admission holds them back until a batch is full:
        # two batches of exactly batch_size reads.
        op = ast.KeyedOperator(Reads(), key_selector=lambda r: r, backend=backend,
                               config=ast.AsyncStateConfig(batch_size=batch_size,
                                                           buffer_timeout_ms=0,
                                                           max_in_flight=batch_size))
        collector.add(op)
        async with op:
            for i in range(2 * batch_size):
                await op.process(i)
            await op.drain()
            scraped["sizes"] = op.metrics["batch_size"]
            scraped["after"] = _scrape(registry)

    asyncio.run(go())
    assert scraped["sizes"]["count"] == 2 and scraped["sizes"]["max"] == batch_size
    buckets = {k.split("le=")[1].split(",")[0]: v
               for k, v in scraped["after"]["asyncstate_batch_size_bucket"].items()}
    for le, count in buckets.items():
        bound = float("inf") if le == "+Inf" else float(le)
        assert count == (2.0 if batch_size <= bound else 0.0), (le, buckets)


def test_prometheus_collector_refuses_duplicates_and_bad_labels():
    registry = CollectorRegistry()
    collector = OperatorCollector(registry)
    with pytest.raises(ValueError, match="Duplicated"):
        OperatorCollector(registry)  # the same names twice would break every scrape
    op = ast.KeyedOperator(Counter(), key_selector=lambda r: r, backend=ast.HeapBackend())
    with pytest.raises(TypeError, match="label shard's value must be a str, got int 3"):
        collector.add(op, shard=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'bad-name' is not a Prometheus label name"):
        collector.add(op, **{"bad-name": "x"})
    with pytest.raises(ValueError, match="not a Prometheus label name"):
        collector.add(op, __reserved="x")
    collector.add(op, shard="3")
    with pytest.raises(ValueError, match="exported by this collector already"):
        collector.add(op, shard="4")
    samples = _scrape(registry)["asyncstate_records_in_total"]
    assert samples == {"index=0,operator=Counter,shard=3": 0.0}
