"""SimulatedRemoteBackend: its options, the latency and I/O parallelism it simulates, failure
injection (seeded, repeatable), closing with calls under way, and which error it reports."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from backend_harness import Harness
from executor_doubles import (
    BrokenExecutor,
    RecordingRemote,
    ReorderingInner,
    build,
    counter_operator,
    issue,
    remote_threads,
    wait_for_condition,
)
from shared_functions import (
    Boom,
    Counter,
    config_error_pattern,
    first,
    with_tag,
)

import asyncstate as ast
from asyncstate.backends.heap import HeapBackend
from asyncstate.backends.remote import SimulatedRemoteBackend
from asyncstate.errors import (
    InjectedFailure,
    InvalidStateError,
)
from asyncstate.runtime.requests import StateRequestType

T = StateRequestType


async def test_remote_backend_reports_the_inner_error_rather_than_an_injected_one():
    """A batch the inner backend fails reports the inner backend's error, even when failure
    injection also picked it."""
    remote = SimulatedRemoteBackend(HeapBackend(), latency_ms=0, failure_probability=1.0,
                                    seed=1)
    harness = Harness(remote, asyncio.get_running_loop())
    with pytest.raises(ValueError, match=r"^HeapBackend cannot execute SYNC_POINT$"):
        await harness.run([("v", T.SYNC_POINT, None, "k", None)])
    with pytest.raises(InjectedFailure):
        await harness.run([("v", T.VALUE_GET, None, "k", None)])
    remote.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("io_parallelism", [1, 2, 3])
async def test_at_most_io_parallelism_calls_sleep_at_once(io_parallelism: int) -> None:
    backend = RecordingRemote(HeapBackend(), latency_ms=10, io_parallelism=io_parallelism)
    aec, state = build(backend)
    futs = [issue(aec, state, k) for k in range(30)]  # 30 one-request batches at once
    assert backend.calls_peak == 30  # full batches always go out
    assert backend.fully_loaded()
    await aec.drain_inflight_records(0)
    assert all(f.done() and f.result() is None for f in futs)
    assert backend.sleeping_peak == io_parallelism  # 30 queued calls: every slot was used
    assert len(backend.sleep_threads) <= io_parallelism
    assert not backend.fully_loaded()
    aec.close()
    backend.close()


@pytest.mark.timeout(30)
async def test_measured_latency_is_close_to_latency_ms() -> None:
    backend = SimulatedRemoteBackend(HeapBackend(), latency_ms=4, io_parallelism=2)
    assert backend.measured_latency_ms() == 0.0
    aec, state = build(backend)
    started = time.perf_counter()
    for k in range(6):
        issue(aec, state, k)
    await aec.drain_inflight_records(0)
    elapsed_ms = 1000 * (time.perf_counter() - started)
    measured = backend.measured_latency_ms()
    assert 4 * 0.95 <= measured < 4 + 500
    assert elapsed_ms >= 3 * 4 * 0.95  # 6 calls over 2 slots take at least 3 latencies
    aec.close()
    backend.close()


@pytest.mark.timeout(30)
async def test_latency_zero_never_uses_threads_and_delivers_on_a_later_iteration() -> None:
    before = {t.ident for t in threading.enumerate()}
    backend = RecordingRemote(HeapBackend(), latency_ms=0, io_parallelism=2)
    aec, state = build(backend)
    fut = issue(aec, state, "k", StateRequestType.VALUE_UPDATE, 5)
    assert not fut.done()  # delivered on the next loop iteration, not inline
    await aec.drain_inflight_records(0)
    assert fut.done()
    assert issue(aec, state, "k").done() is False
    await aec.drain_inflight_records(0)
    assert backend.sleep_threads == set()
    assert backend.measured_latency_ms() == 0.0
    assert {t.ident for t in threading.enumerate()} <= before
    aec.close()
    backend.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("latency_ms", [0, 2])
def test_failure_probability_one_fails_the_first_batch(latency_ms: float) -> None:
    backend = RecordingRemote(HeapBackend(), latency_ms=latency_ms, failure_probability=1.0)
    with pytest.raises(InjectedFailure, match=r"failure_probability=1\.0"):
        ast.run(Counter(output=with_tag), [(i, i) for i in range(20)], key_selector=lambda r: r[0],
                backend=backend, config=ast.AsyncStateConfig(batch_size=4))
    assert backend._closed


@pytest.mark.timeout(30)
async def test_failure_probability_one_fails_the_futures_of_the_first_batch() -> None:
    backend = SimulatedRemoteBackend(HeapBackend(), latency_ms=1, failure_probability=1.0)
    aec, state = build(backend, batch_size=3)
    futs = [issue(aec, state, k) for k in range(3)]
    with pytest.raises(InjectedFailure):
        await asyncio.wait_for(aec.drain_inflight_records(0), 10)
    assert all(isinstance(f.exception(), InjectedFailure) for f in futs)
    assert isinstance(aec.failure, InjectedFailure)
    aec.close()
    backend.close()


def _seeded_run(seed: int, io_parallelism: int) -> tuple[str, list[Any], int]:
    async def go() -> tuple[str, list[Any], int]:
        backend = SimulatedRemoteBackend(HeapBackend(), latency_ms=0,
                                         io_parallelism=io_parallelism,
                                         failure_probability=0.15, seed=seed)
        op = ast.KeyedOperator(Counter(output=with_tag), key_selector=first, backend=backend,
                               config=ast.AsyncStateConfig(batch_size=3, buffer_timeout_ms=0,
                                                           max_in_flight=6))
        try:
            async with op:
                for i in range(60):
                    await op.process((i % 7, i))
                await op.drain()
        except InjectedFailure as exc:
            return str(exc), sorted(op.outputs()), op.metrics["batches"]
        return "no failure", sorted(op.outputs()), op.metrics["batches"]
    return asyncio.run(go())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("io_parallelism", [1, 3])
def test_seed_makes_a_failing_run_repeat(io_parallelism: int) -> None:
    """Without thread timing in play (latency 0), the same seed fails the same batch."""
    first = _seeded_run(3, io_parallelism)
    assert first[0] != "no failure"
    assert _seeded_run(3, io_parallelism) == first
    assert _seeded_run(3, io_parallelism) == first


@pytest.mark.timeout(30)
async def test_close_with_calls_under_way_releases_threads_and_drops_queued_calls() -> None:
    backend = RecordingRemote(HeapBackend(), latency_ms=400, io_parallelism=2)
    aec, state = build(backend)
    futs = [issue(aec, state, k) for k in range(10)]
    assert await wait_for_condition(lambda: backend.sleeping == 2)  # both I/O slots busy
    aec.close()
    backend.close()
    assert all(isinstance(f.exception(), InvalidStateError) for f in futs)
    assert await wait_for_condition(lambda: not any(t.is_alive() for t in remote_threads()))
    assert backend._slept_count <= 2  # the queued calls were cancelled, not slept
    assert aec.failure is None  # nothing was delivered into the closed controller


@pytest.mark.timeout(30)
async def test_remote_inner_delivering_an_unknown_batch_fails_the_run() -> None:
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, _context: None)
    backend = SimulatedRemoteBackend(BrokenExecutor("copy"), latency_ms=0.5)
    op = counter_operator(backend, 1)
    with pytest.raises(InvalidStateError, match="not given"):
        async with op:
            await op.process(("a", 0))
            await asyncio.wait_for(op.drain(), 2)


@pytest.mark.timeout(30)
async def test_remote_inner_raising_does_not_leak_an_io_slot() -> None:
    backend = SimulatedRemoteBackend(BrokenExecutor("raise"), latency_ms=0, io_parallelism=1)
    aec, state = build(backend, batch_size=1)
    fut = issue(aec, state, "k")  # the controller turns the raise into the run's failure
    assert isinstance(fut.exception(), Boom)
    assert aec.failure is fut.exception()
    assert not backend.fully_loaded()  # the call that never started gave its slot back
    aec.close()
    backend.close()


@pytest.mark.timeout(30)
async def test_seeded_failure_picks_the_same_batch_whatever_the_completion_order() -> None:
    # seed 1 draws 0.134 then 0.847: with failure_probability 0.5 exactly one of two fails
    failed = []
    for order in ([0, 0], [1, 0]):  # complete batch 0 first / batch 1 first
        inner = ReorderingInner()
        backend = SimulatedRemoteBackend(inner, latency_ms=0, io_parallelism=2,
                                         failure_probability=0.5, seed=1)
        aec, state = build(backend)
        futs = [issue(aec, state, k) for k in ("x", "y")]
        await asyncio.sleep(0)
        for i in order:
            inner.deliver(i)
        await asyncio.sleep(0)
        failed.append([isinstance(f.exception(), InjectedFailure) for f in futs])
        aec.close()
        backend.close()
    assert failed[0] == failed[1]


class _NotABackend:
    execute_batch = None  # present but not callable


@pytest.mark.parametrize("inner", [None, "heap", {}, _NotABackend()],
                         ids=["None", "str", "dict", "non-callable-execute_batch"])
def test_remote_backend_rejects_an_inner_that_is_not_a_backend(inner):
    name = type(inner).__name__
    with pytest.raises(TypeError, match=rf"^inner must be a state backend, got {name}$"):
        ast.SimulatedRemoteBackend(inner, latency_ms=0)


def test_remote_backend_rejects_a_backend_class_rather_than_an_instance():
    with pytest.raises(TypeError,
                       match=r"^inner must be a state backend, got the class HeapBackend$"):
        ast.SimulatedRemoteBackend(ast.HeapBackend, latency_ms=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [True, False, "5", None, [1], -1, -0.5, float("nan"),
                                 float("-inf"), float("inf")], ids=repr)
def test_remote_backend_rejects_bad_latency_ms(bad):
    with pytest.raises(ast.ConfigError, match=config_error_pattern(
            "latency_ms", bad, "a finite number >= 0")) as info:
        ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=bad)
    assert isinstance(info.value, ValueError)
    assert info.value.option == "latency_ms"


@pytest.mark.parametrize("bad", [0, -1, True, False, 1.0, 2.5, "2", None], ids=repr)
def test_remote_backend_rejects_bad_io_parallelism(bad):
    with pytest.raises(ast.ConfigError,
                       match=config_error_pattern("io_parallelism", bad, "an int >= 1")) as info:
        ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0, io_parallelism=bad)
    assert info.value.option == "io_parallelism"


@pytest.mark.parametrize("bad", [-1, "0", None, 0.0, False, 1.5], ids=repr)
def test_remote_backend_rejects_bad_cache_entries(bad):
    with pytest.raises(ast.ConfigError,
                       match=config_error_pattern("cache_entries", bad, "an int >= 0")) as info:
        ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0, cache_entries=bad)
    assert info.value.option == "cache_entries"


@pytest.mark.parametrize("cache_entries", [1, 1000])
def test_remote_backend_cache_entries_sizes_its_cache(cache_entries):
    backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0,
                                         cache_entries=cache_entries)
    assert backend.state_cache is not None and backend.state_cache.capacity == cache_entries


@pytest.mark.parametrize("bad", [-0.1, 1.5, 2, -1, True, False, float("nan"), float("inf"),
                                 "0.5", None], ids=repr)
def test_remote_backend_rejects_bad_failure_probability(bad):
    with pytest.raises(ast.ConfigError, match=config_error_pattern(
            "failure_probability", bad, "in [0.0, 1.0]")) as info:
        ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0, failure_probability=bad)
    assert isinstance(info.value, ValueError)
    assert info.value.option == "failure_probability"


@pytest.mark.parametrize(("latency_ms", "io_parallelism", "failure_probability"), [
    (0, 1, 0.0),
    (0.0, 2, 0),
    (2.5, 8, 0.5),
    (3, 1, 1),
    (10**6, 64, 1.0),
])
def test_remote_backend_accepts_valid_options(latency_ms, io_parallelism, failure_probability):
    inner = ast.HeapBackend()
    backend = ast.SimulatedRemoteBackend(inner, latency_ms=latency_ms,
                                         io_parallelism=io_parallelism, cache_entries=0,
                                         failure_probability=failure_probability, seed=7)
    assert backend.inner is inner
    assert backend.latency_ms == float(latency_ms)
    assert type(backend.latency_ms) is float
    assert backend.io_parallelism == io_parallelism
    assert backend.failure_probability == float(failure_probability)
