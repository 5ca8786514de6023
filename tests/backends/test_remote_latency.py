"""SimulatedRemoteBackend (asyncstate/backends/remote.py): results exactly the inner
backend's whatever the latencies, the latency distribution it draws, per-key cost, and
failure injection that fails the run promptly with the injected error."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shared_functions import LOOP_NAMES, Counter, slow_examples
from state_programs import PROGRAMS, run_program

import asyncstate as ast


@settings(max_examples=40)
@given(program=PROGRAMS, latency_ms=st.sampled_from([0, 0.1, 0.3]),
       spread=st.sampled_from([1.0, 3.0, 10.0]), per_key_ms=st.sampled_from([0.0, 0.05]),
       io_parallelism=st.integers(1, 4), seed=st.integers(0, 2**16),
       batch_size=st.integers(1, 6), max_in_flight=st.integers(1, 10),
       loop=st.sampled_from(LOOP_NAMES))
def test_results_are_exactly_the_inner_backends(program, latency_ms, spread, per_key_ms,
                                                io_parallelism, seed, batch_size,
                                                max_in_flight, loop):
    backend = ast.SimulatedRemoteBackend(
        ast.HeapBackend(), latency_ms=latency_ms, io_parallelism=io_parallelism, seed=seed,
        latency_p99_ms=latency_ms * spread if latency_ms else None, per_key_ms=per_key_ms)
    got = run_program(program, backend, batch_size=batch_size, max_in_flight=max_in_flight,
                      loop=loop)
    want = run_program(program, ast.HeapBackend(), batch_size=batch_size,
                       max_in_flight=max_in_flight)
    assert got == want


@settings(max_examples=slow_examples(8))
@given(program=PROGRAMS, seed=st.integers(0, 2**16), batch_size=st.integers(1, 6),
       loop=st.sampled_from(LOOP_NAMES))
def test_results_are_exactly_rocksdbs_behind_random_latencies(program, seed, batch_size, loop):
    with tempfile.TemporaryDirectory(prefix="asyncstate-remote-") as tmp:
        backend = ast.SimulatedRemoteBackend(
            ast.RocksDBBackend(Path(tmp) / "db"), latency_ms=0.2, latency_p99_ms=2,
            io_parallelism=3, seed=seed)
        got = run_program(program, backend, batch_size=batch_size, max_in_flight=8,
                          loop=loop)
    want = run_program(program, ast.HeapBackend(), batch_size=batch_size, max_in_flight=8)
    assert got == want


def _one_call_per_record(backend: Any, n: int) -> None:
    ast.run(Counter(), [i % 50 for i in range(n)], key_selector=lambda r: r, backend=backend,
            config=ast.AsyncStateConfig(batch_size=1, max_in_flight=50))


def test_lognormal_latency_has_the_median_and_p99_asked_for():
    backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0.05,
                                         latency_p99_ms=0.2, io_parallelism=8, seed=7)
    _one_call_per_record(backend, 1500)  # two calls per record: read, then write
    drawn = backend.drawn_latency_stats()
    assert drawn["count"] == backend.calls == 3000
    assert drawn["p50"] == pytest.approx(0.05, rel=0.1)
    assert drawn["p99"] == pytest.approx(0.2, rel=0.25)
    assert drawn["min"] < 0.05 < drawn["max"]
    assert backend.latency_stats()["count"] == 3000  # slept, and measured, per call


def test_fixed_latency_draws_the_same_latency_for_every_call():
    backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0.05)
    _one_call_per_record(backend, 100)
    drawn = backend.drawn_latency_stats()
    assert drawn["min"] == drawn["max"] == 0.05


def test_per_key_cost_adds_to_each_call_by_its_distinct_keys():
    backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0.01, per_key_ms=0.02)
    # Batches of five requests: reads of five distinct keys, then their writes.
    ast.run(Counter(), list(range(5)), key_selector=lambda r: r, backend=backend,
            config=ast.AsyncStateConfig(batch_size=5, max_in_flight=5))
    drawn = backend.drawn_latency_stats()
    assert backend.calls == 2
    assert drawn["min"] == drawn["max"] == pytest.approx(0.01 + 5 * 0.02)


@pytest.mark.parametrize("k", [1, 3])
def test_fail_on_call_fails_the_run_promptly_with_the_injected_error(k):
    backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0.2, fail_on_call=k)
    with pytest.raises(ast.InjectedFailure,
                       match=rf"^injected failure of remote call {k}, a batch of 10 requests "
                             rf"\(fail_on_call={k}\)$"):
        ast.run(Counter(), list(range(100_000)), key_selector=lambda r: r, backend=backend,
                config=ast.AsyncStateConfig(batch_size=10, max_in_flight=20))
    # The run stopped at the failure: it did not go on through 20,000 calls.
    assert backend.calls <= k + 4


def test_failure_probability_fails_with_a_reproducible_call():
    def failing_call(seed: int) -> str:
        backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0,
                                             failure_probability=0.05, seed=seed)
        with pytest.raises(ast.InjectedFailure) as info:
            ast.run(Counter(), list(range(10_000)), key_selector=lambda r: r, backend=backend,
                    config=ast.AsyncStateConfig(batch_size=10))
        return re.sub(r", a batch of \d+ requests", "", str(info.value))

    first = failing_call(11)
    assert re.fullmatch(r"injected failure of remote call \d+ \(failure_probability=0\.05\)",
                        first)
    assert failing_call(11) == first


@pytest.mark.parametrize("bad", [0.5, -1, "2"])
def test_latency_p99_below_the_median_is_refused(bad):
    with pytest.raises(ast.ConfigError, match=r"latency_p99_ms"):
        ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=1, latency_p99_ms=bad)


@pytest.mark.parametrize("option, bad", [("per_key_ms", -0.1), ("fail_on_call", 0),
                                         ("fail_on_call", True)])
def test_bad_per_key_cost_and_fail_on_call_are_refused(option, bad):
    with pytest.raises(ast.ConfigError, match=rf"{option}"):
        ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=1, **{option: bad})
