"""Adversarial tests of batching (AsyncExecutionController + StateRequestBuffer) and of
SimulatedRemoteBackend: batch size bounds, per-key order across batches, the buffer timeout,
I/O parallelism, failure injection, closing, back-pressure through `fully_loaded()`, and
executors that break the delivery contract."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import defaultdict
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from runtime_harness import GET, UPDATE, FakeState

import asyncstate as ast
from asyncstate.backends.base import ExecutorBinding
from asyncstate.backends.heap import HeapBackend
from asyncstate.backends.remote import SimulatedRemoteBackend
from asyncstate.errors import InjectedFailure, InvalidStateError
from asyncstate.runtime.requests import StateKind, StateRequest, StateRequestType
from asyncstate.testing import ManualScheduler

LOADING = StateRequestType.ITERATOR_LOADING


class Boom(Exception):
    pass


class Exit(Exception):
    """Raised at the end of an `async with` body to close the operator without draining."""


def remote_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("asyncstate-remote")]


async def wait_for_condition(predicate: Any, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.002)
    return predicate()


# -- instrumented backends -------------------------------------------------------------------


class RecordingRemote(SimulatedRemoteBackend):
    """Logs every batch it is given (on the loop thread) and counts the simulated calls that
    are under way on the I/O threads at once."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.batches: list[list[tuple[Any, Any, StateRequestType]]] = []
        self.sleeping = 0
        self.sleeping_peak = 0
        self.calls_peak = 0
        self.sleep_threads: set[str] = set()
        self._count_lock = threading.Lock()

    def execute_batch(self, batch: list[StateRequest]) -> None:
        self.batches.append([(r.context.key, r.context.record, r.request_type) for r in batch])
        super().execute_batch(batch)
        self.calls_peak = max(self.calls_peak, self._calls_in_progress)

    def _sleep(self, call: Any) -> None:
        with self._count_lock:
            self.sleeping += 1
            self.sleeping_peak = max(self.sleeping_peak, self.sleeping)
            self.sleep_threads.add(threading.current_thread().name)
        try:
            super()._sleep(call)
        finally:
            with self._count_lock:
                self.sleeping -= 1


class BrokenExecutor:
    """A batched executor over a heap that breaks the delivery contract in one way:

    - "ok": delivers each batch once on the next loop iteration (the control case);
    - "raise": `execute_batch` raises synchronously;
    - "copy": delivers a copy of the batch list (a batch it was never given);
    - "twice": delivers each batch twice;
    - "short": delivers one result too few.
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.inner = HeapBackend()
        self.given: list[list[StateRequest]] = []
        self.closed = False
        self._binding: ExecutorBinding | None = None

    def open(self, binding: ExecutorBinding) -> None:
        self._binding = binding
        self.inner.open(ExecutorBinding(loop=binding.loop, deliver=self._inner_done,
                                        iterator_chunk_size=binding.iterator_chunk_size,
                                        max_parallelism=binding.max_parallelism))

    def register_state(self, name: str, kind: StateKind) -> Any:
        return self.inner.register_state(name, kind)

    def execute_batch(self, batch: list[StateRequest]) -> None:
        self.given.append(batch)
        if self.mode == "raise":
            raise Boom("execute_batch failed synchronously")
        self.inner.execute_batch(batch)

    def _inner_done(self, batch: list[StateRequest], results: Any, error: Any) -> None:
        assert self._binding is not None
        loop, deliver = self._binding.loop, self._binding.deliver
        if loop is None:  # no loop (single-stepped tests): deliver inline
            deliver(batch, results, error)
        elif self.mode == "copy":
            loop.call_soon(deliver, list(batch), results, error)
        elif self.mode == "twice":
            loop.call_soon(deliver, batch, results, error)
            loop.call_soon(deliver, batch, results, error)
        elif self.mode == "short":
            loop.call_soon(deliver, batch, results[:-1], error)
        else:
            loop.call_soon(deliver, batch, results, error)

    def fully_loaded(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True


class ReorderingInner:
    """An inner backend that applies batches at once but delivers them only when told,
    in any order (as a store with parallel reads may)."""

    def __init__(self) -> None:
        self.heap = HeapBackend()
        self.pending: list[tuple[list[StateRequest], Any, Any]] = []
        self._deliver: Any = None

    def open(self, binding: ExecutorBinding) -> None:
        self._deliver = binding.deliver
        self.heap.open(ExecutorBinding(loop=binding.loop, deliver=self._held,
                                       iterator_chunk_size=binding.iterator_chunk_size,
                                       max_parallelism=binding.max_parallelism))

    def register_state(self, name: str, kind: StateKind) -> Any:
        return self.heap.register_state(name, kind)

    def _held(self, batch: list[StateRequest], results: Any, error: Any) -> None:
        self.pending.append((batch, results, error))

    def execute_batch(self, batch: list[StateRequest]) -> None:
        self.heap.execute_batch(batch)

    def deliver(self, index: int) -> None:
        self._deliver(*self.pending.pop(index))

    def fully_loaded(self) -> bool:
        return False

    def close(self) -> None:
        pass


# -- user functions --------------------------------------------------------------------------


class Counter(ast.KeyedProcessFunction):
    """record (key, tag): read, increment, write, emit (key, n, tag)."""

    def open(self, ctx: Any) -> None:
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

    async def process_element(self, value: Any, ctx: Any) -> None:
        key, tag = value
        n = (await self.v.value() or 0) + 1
        await self.v.update(n)
        ctx.emit((key, n, tag))


def counter_operator(backend: Any, batch_size: int,
                     buffer_timeout_ms: int = 0) -> ast.KeyedOperator:
    """The Counter over `backend`, keyed by the record's first item."""
    return ast.KeyedOperator(Counter(), key_selector=lambda r: r[0], backend=backend,
                             config=ast.AsyncStateConfig(batch_size=batch_size,
                                                         buffer_timeout_ms=buffer_timeout_ms))


class Rounds(ast.KeyedProcessFunction):
    """record (key, tag): `ROUNDS` sequential read-modify-write round trips."""

    ROUNDS = 4

    def open(self, ctx: Any) -> None:
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

    async def process_element(self, value: Any, ctx: Any) -> None:
        key, tag = value
        for _ in range(self.ROUNDS):
            n = (await self.v.value() or 0) + 1
            await self.v.update(n)
        ctx.emit((key, n, tag))


class SumAgg(ast.AggregateFunction):
    def create_accumulator(self) -> Any:
        return 0

    def add(self, value: Any, accumulator: Any) -> Any:
        return accumulator + value

    def get_result(self, accumulator: Any) -> Any:
        return accumulator

    def merge(self, a: Any, b: Any) -> Any:
        return a + b


KINDS = ["count", "chain", "list", "map", "reduce", "agg", "forget"]


class Mixed(ast.KeyedProcessFunction):
    """record (key, kind, tag). Exercises value, list and map iteration (with continuation
    loads when the iterator chunk is small), reducing and aggregating adds issued without
    awaiting, callback chains and fire-and-forget writes."""

    def open(self, ctx: Any) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))
        self.lst = ctx.get_list_state(ast.ListStateDescriptor("lst"))
        self.map = ctx.get_map_state(ast.MapStateDescriptor("map"))
        self.red = ctx.get_reducing_state(ast.ReducingStateDescriptor("red", lambda a, b: a + b))
        self.agg = ctx.get_aggregating_state(ast.AggregatingStateDescriptor("agg", SumAgg()))

    def process_element(self, record: Any, ctx: Any) -> Any:
        key, kind, tag = record
        if kind == "chain":
            def write(v: Any) -> Any:
                n = (v or 0) + 1
                return self.count.update(n).then_accept(lambda _: ctx.emit((key, "count", n)))
            return self.count.value().then_compose(write)
        if kind == "forget":
            def write2(v: Any) -> None:
                n = (v or 0) + 1
                self.count.update(n)  # neither awaited nor returned
                ctx.emit((key, "count", n))
            self.count.value().then_accept(write2)
            return None
        return self._async(key, kind, tag, ctx)

    async def _async(self, key: Any, kind: str, tag: int, ctx: Any) -> None:
        if kind == "count":
            n = (await self.count.value() or 0) + 1
            await self.count.update(n)
            ctx.emit((key, "count", n))
        elif kind == "list":
            self.lst.add(tag)  # not awaited: read-your-writes through batch order
            items = await (await self.lst.get()).to_list()
            ctx.emit((key, "list", items))
        elif kind == "map":
            self.map.put(tag % 3, tag)
            entries = await (await self.map.entries()).to_list()
            ctx.emit((key, "map", sorted(entries)))
        elif kind == "reduce":
            self.red.add(tag)
            self.red.add(1)
            ctx.emit((key, "reduce", await self.red.get()))
        elif kind == "agg":
            self.agg.add(tag)
            ctx.emit((key, "agg", await self.agg.get()))


def mixed_model(records: list[tuple[Any, str, int]]) -> dict[Any, list[Any]]:
    """What each key emits when its records run one after another."""
    state: dict[Any, dict[str, Any]] = defaultdict(
        lambda: {"count": 0, "list": [], "map": {}, "red": None, "agg": None})
    out: dict[Any, list[Any]] = defaultdict(list)
    for key, kind, tag in records:
        s = state[key]
        if kind in ("count", "chain", "forget"):
            s["count"] += 1
            out[key].append((key, "count", s["count"]))
        elif kind == "list":
            s["list"].append(tag)
            out[key].append((key, "list", list(s["list"])))
        elif kind == "map":
            s["map"][tag % 3] = tag
            out[key].append((key, "map", sorted([k, v] for k, v in s["map"].items())))
        elif kind == "reduce":
            s["red"] = (tag if s["red"] is None else s["red"] + tag) + 1
            out[key].append((key, "reduce", s["red"]))
        elif kind == "agg":
            s["agg"] = (0 if s["agg"] is None else s["agg"]) + tag
            out[key].append((key, "agg", s["agg"]))
    return out


def by_key(outputs: list[Any]) -> dict[Any, list[Any]]:
    out: dict[Any, list[Any]] = defaultdict(list)
    for item in outputs:
        key, kind, value = item
        if kind == "map":
            value = sorted(list(e) for e in value)
        out[key].append((key, kind, value))
    return out


def check_per_key_order(batches: list[list[tuple[Any, Any, Any]]]) -> None:
    """Requests of one key reach the executor grouped by record, records in arrival order
    (tags grow with arrival), never interleaved with a later record's."""
    last: dict[Any, int] = {}
    for batch in batches:
        for key, record, _ in batch:
            tag = record[-1] if isinstance(record, tuple) else record
            assert tag >= last.get(key, -1), f"key {key!r}: record {tag} after {last[key]}"
            last[key] = tag


# -- random workloads against a sequential model ----------------------------------------------


@pytest.mark.timeout(120)
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    records=st.lists(st.tuples(st.sampled_from(["a", "b", "c", 1]), st.sampled_from(KINDS)),
                     min_size=1, max_size=25),
    batch_size=st.integers(1, 6),
    max_in_flight=st.integers(1, 8),
    buffer_timeout_ms=st.sampled_from([0, 1]),
    io_parallelism=st.integers(1, 3),
    latency_ms=st.sampled_from([0, 0.5]),
    chunk=st.integers(1, 3),
)
def test_random_workloads_match_the_sequential_model_and_respect_batch_size(
        records: list[tuple[Any, str]], batch_size: int, max_in_flight: int,
        buffer_timeout_ms: int, io_parallelism: int, latency_ms: float, chunk: int) -> None:
    recs = [(key, kind, tag) for tag, (key, kind) in enumerate(records)]
    backend = RecordingRemote(HeapBackend(), latency_ms=latency_ms,
                              io_parallelism=io_parallelism)
    config = ast.AsyncStateConfig(batch_size=batch_size, max_in_flight=max_in_flight,
                                  buffer_timeout_ms=buffer_timeout_ms,
                                  iterator_chunk_size=chunk)
    outputs = ast.run(Mixed(), recs, key_selector=lambda r: r[0], backend=backend,
                      config=config)
    assert by_key(outputs) == mixed_model(recs)
    sizes = [len(b) for b in backend.batches]
    assert all(1 <= s <= batch_size for s in sizes), sizes
    check_per_key_order(backend.batches)
    assert sum(sizes) > 0
    assert backend.sleeping_peak <= io_parallelism
    if latency_ms == 0:
        assert backend.sleep_threads == set()


@pytest.mark.timeout(30)
async def test_iterator_continuations_and_merging_adds_never_overflow_a_batch() -> None:
    """Many continuation loads (chunk of 1 over long lists) and read-then-write adds from
    many keys at once: every batch stays within batch_size and metrics agree."""
    backend = RecordingRemote(HeapBackend(), latency_ms=0.5, io_parallelism=2)
    config = ast.AsyncStateConfig(batch_size=3, max_in_flight=50, buffer_timeout_ms=0,
                                  iterator_chunk_size=1)
    recs = [(k, kind, i) for i, (k, kind) in enumerate(
        (k, kind) for _ in range(6) for kind in ("list", "reduce", "map", "agg")
        for k in range(7))]
    op = ast.KeyedOperator(Mixed(), key_selector=lambda r: r[0], backend=backend,
                           config=config)
    async with op:
        for r in recs:
            await op.process(r)
        await op.drain()
        metrics = op.metrics
        outputs = op.outputs()
    assert by_key(outputs) == mixed_model(recs)
    loads = sum(1 for b in backend.batches for (_, _, t) in b if t is LOADING)
    assert loads > 50  # the workload really exercised continuation loads
    sizes = [len(b) for b in backend.batches]
    assert max(sizes) <= 3
    assert metrics["max_batch_size"] == max(sizes)
    assert metrics["batches"] == len(backend.batches)
    assert metrics["requests"] == sum(sizes)
    check_per_key_order(backend.batches)


@pytest.mark.timeout(30)
def test_batch_size_one_sends_every_request_alone() -> None:
    backend = RecordingRemote(HeapBackend(), latency_ms=0, io_parallelism=2)
    recs = [(i % 4, i) for i in range(40)]
    out = ast.run(Counter(), recs, key_selector=lambda r: r[0], backend=backend,
                  config=ast.AsyncStateConfig(batch_size=1, buffer_timeout_ms=0,
                                              max_in_flight=10))
    assert sorted(out) == sorted((k, i // 4 + 1, i) for i, (k, _) in enumerate(recs))
    assert [len(b) for b in backend.batches] == [1] * 80


@pytest.mark.timeout(30)
@pytest.mark.parametrize("max_in_flight", [1, 2, 7])
def test_max_in_flight_below_batch_size_does_not_wait_for_full_batches(
        max_in_flight: int) -> None:
    """With no buffer timeout and max_in_flight < batch_size a full batch can never form:
    back-pressure must send partial batches, not hang."""
    backend = RecordingRemote(HeapBackend(), latency_ms=0.5, io_parallelism=2)
    recs = [(i % 5, i) for i in range(60)]
    out = ast.run(Rounds(), recs, key_selector=lambda r: r[0], backend=backend,
                  config=ast.AsyncStateConfig(batch_size=50, buffer_timeout_ms=0,
                                              max_in_flight=max_in_flight))
    assert sorted(out) == sorted((k, (i // 5 + 1) * Rounds.ROUNDS, i)
                                 for i, (k, _) in enumerate(recs))
    assert max(len(b) for b in backend.batches) <= max_in_flight
    check_per_key_order(backend.batches)


# -- buffer timeout ---------------------------------------------------------------------------


@pytest.mark.timeout(30)
async def test_buffer_timeout_sends_every_round_of_stalled_input_without_drain() -> None:
    """Input stops with requests far below batch_size; each of the records' sequential
    round trips must go out on its own timeout (re-armed for every generation)."""
    backend = RecordingRemote(HeapBackend(), latency_ms=0.5, io_parallelism=2)
    op = ast.KeyedOperator(Rounds(), key_selector=lambda r: r[0], backend=backend,
                           config=ast.AsyncStateConfig(batch_size=1000, buffer_timeout_ms=5))
    try:
        async with op:
            for i in range(3):
                await op.process((i, i))
            assert await wait_for_condition(lambda: op.metrics["records_done"] == 3)
            assert sorted(op.outputs()) == [(i, Rounds.ROUNDS, i) for i in range(3)]
            assert op.metrics["batches"] >= 2 * Rounds.ROUNDS  # a read and a write per round
            raise Exit
    except Exit:
        pass


@pytest.mark.timeout(30)
async def test_buffer_timeout_sends_leftover_of_a_size_triggered_batch() -> None:
    """5 requests with batch_size 3: 3 go out by size, the other 2 by the timeout."""
    backend = RecordingRemote(HeapBackend(), latency_ms=0.5, io_parallelism=2)
    op = counter_operator(backend, 3, 5)
    try:
        async with op:
            for i in range(5):
                await op.process((i, i))
            assert await wait_for_condition(lambda: op.metrics["records_done"] == 5)
            assert all(len(b) <= 3 for b in backend.batches)
            raise Exit
    except Exit:
        pass


def test_buffer_timeout_does_not_fire_after_close() -> None:
    scheduler = ManualScheduler()
    backend = BrokenExecutor("ok")
    aec = ast.AsyncExecutionController(backend, batch_size=10, buffer_timeout_ms=50,
                                       max_in_flight=10, timeout_scheduler=scheduler)
    state = FakeState("v", backend.register_state("v", StateKind.VALUE))
    ctx = aec.build_context("r", "k")
    aec.set_current_context(ctx)
    fut = aec.handle_request(state, GET, None)
    aec.close()
    scheduler.advance(10.0)
    assert backend.given == []
    assert fut.done() and isinstance(fut.exception(), InvalidStateError)


def test_stale_timeout_handle_that_ignores_cancel_does_not_send_after_close() -> None:
    """A scheduler whose handles cannot be cancelled: the late firing must still not send."""
    fired: list[Any] = []

    class Handle:
        def cancel(self) -> None:
            pass

    class Sticky:
        def call_later(self, delay: float, callback: Any, *args: Any) -> Handle:
            fired.append((callback, args))
            return Handle()

    backend = BrokenExecutor("ok")
    aec = ast.AsyncExecutionController(backend, batch_size=10, buffer_timeout_ms=50,
                                       max_in_flight=10, timeout_scheduler=Sticky())
    state = FakeState("v", backend.register_state("v", StateKind.VALUE))
    aec.set_current_context(aec.build_context("r", "k"))
    aec.handle_request(state, GET, None)
    aec.close()
    for callback, args in fired:
        callback(*args)
    assert backend.given == []


def test_buffer_timeout_zero_never_arms_and_keeps_a_partial_batch() -> None:
    scheduler = ManualScheduler()
    backend = BrokenExecutor("ok")
    aec = ast.AsyncExecutionController(backend, batch_size=10, buffer_timeout_ms=0,
                                       max_in_flight=10, timeout_scheduler=scheduler)
    state = FakeState("v", backend.register_state("v", StateKind.VALUE))
    for i in range(3):
        aec.set_current_context(aec.build_context(i, i))
        aec.handle_request(state, UPDATE, i)
    scheduler.advance(3600.0)
    assert backend.given == []
    assert aec.active_queue_size == 3
    assert aec.trigger_if_needed(True)
    assert [len(b) for b in backend.given] == [3]
    aec.close()


# -- SimulatedRemoteBackend ------------------------------------------------------------------


def build(backend: Any, **kw: Any) -> tuple[ast.AsyncExecutionController, FakeState]:
    kw.setdefault("batch_size", 1)
    kw.setdefault("buffer_timeout_ms", 0)
    kw.setdefault("max_in_flight", 1000)
    aec = ast.AsyncExecutionController(backend, **kw)
    return aec, FakeState("v", backend.register_state("v", StateKind.VALUE))


def issue(aec: ast.AsyncExecutionController, state: FakeState, key: Any,
          rtype: StateRequestType = GET, payload: Any = None) -> Any:
    aec.set_current_context(aec.build_context(key, key))
    fut = aec.handle_request(state, rtype, payload)
    aec.set_current_context(None)
    return fut


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
    fut = issue(aec, state, "k", UPDATE, 5)
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
        ast.run(Counter(), [(i, i) for i in range(20)], key_selector=lambda r: r[0],
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
        op = ast.KeyedOperator(Counter(), key_selector=lambda r: r[0], backend=backend,
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
    await asyncio.sleep(0.005)
    aec.close()
    backend.close()
    assert all(isinstance(f.exception(), InvalidStateError) for f in futs)
    assert await wait_for_condition(lambda: not any(t.is_alive() for t in remote_threads()))
    await asyncio.sleep(0.01)
    assert backend._slept_count <= 2  # the queued calls were cancelled, not slept
    assert aec.failure is None  # nothing was delivered into the closed controller


@pytest.mark.timeout(30)
async def test_fully_loaded_keeps_partial_batches_back_until_a_slot_frees() -> None:
    """The inner store delivers only when told, so the single I/O slot stays busy exactly
    as long as the test says."""
    inner = ReorderingInner()
    backend = RecordingRemote(inner, latency_ms=0, io_parallelism=1)
    aec, state = build(backend, batch_size=3)

    async def spin() -> None:
        for _ in range(5):
            await asyncio.sleep(0)

    first = [issue(aec, state, k) for k in range(3)]  # a full batch: sent
    assert len(backend.batches) == 1 and backend.fully_loaded()
    more = [issue(aec, state, k) for k in range(3, 5)]  # a partial batch
    waiter = asyncio.ensure_future(aec.drain_inflight_records(0))
    await spin()
    assert len(backend.batches) == 1  # kept back while the only slot is busy
    assert aec.active_queue_size == 2
    more.append(issue(aec, state, 5))  # it grows to a full batch: sent although loaded
    assert [len(b) for b in backend.batches] == [3, 3]
    more += [issue(aec, state, k) for k in range(6, 8)]
    inner.deliver(0)
    await spin()
    assert all(f.done() for f in first)
    assert [len(b) for b in backend.batches] == [3, 3]  # batch 2 still holds the slot
    inner.deliver(0)
    await spin()
    assert [len(b) for b in backend.batches] == [3, 3, 2]  # the slot freed: partial sent
    assert not waiter.done()
    inner.deliver(0)
    await asyncio.wait_for(waiter, 10)
    assert all(f.done() for f in more)
    aec.close()
    backend.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("io_parallelism", "batch_size", "max_in_flight"),
                         [(1, 4, 20), (2, 3, 30), (3, 1, 12)])
def test_back_pressure_bounds_the_calls_queued_in_the_backend(
        io_parallelism: int, batch_size: int, max_in_flight: int) -> None:
    """Partial batches wait while every slot is busy, and admission stops at max_in_flight:
    calls under way never exceed the slots plus the full batches the records can fill."""
    backend = RecordingRemote(HeapBackend(), latency_ms=1, io_parallelism=io_parallelism)
    recs = [(i % 37, i) for i in range(200)]
    out = ast.run(Counter(), recs, key_selector=lambda r: r[0], backend=backend,
                  config=ast.AsyncStateConfig(batch_size=batch_size, buffer_timeout_ms=0,
                                              max_in_flight=max_in_flight))
    assert len(out) == 200
    assert backend.calls_peak <= io_parallelism + math.ceil(max_in_flight / batch_size)
    assert backend.sleeping_peak <= io_parallelism


# -- executors that break the contract -------------------------------------------------------


@pytest.mark.timeout(30)
async def test_executor_raising_on_a_full_batch_fails_the_run() -> None:
    """execute_batch raising while user code issues the request that fills the batch."""
    op = counter_operator(BrokenExecutor("raise"), 1)
    with pytest.raises(Boom):
        async with op:
            await op.process(("a", 0))
            await asyncio.wait_for(op.drain(), 10)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", ["timeout", "drain"])
async def test_executor_raising_synchronously_fails_the_run(path: str) -> None:
    loop = asyncio.get_running_loop()
    loop_errors: list[Any] = []
    loop.set_exception_handler(lambda _loop, context: loop_errors.append(context))
    op = counter_operator(BrokenExecutor("raise"), 100, 5 if path == "timeout" else 0)
    try:
        async with op:
            await op.process(("a", 0))
            if path == "timeout":
                await asyncio.sleep(0.2)
            for _ in range(2):  # the error, promptly, every time; never a hang
                with pytest.raises(Boom):
                    await asyncio.wait_for(op.drain(), 2)
            assert isinstance(op.controller.failure, Boom)
            raise Exit
    except Exit:
        pass


@pytest.mark.timeout(30)
async def test_delivery_of_a_batch_never_given_fails_the_run() -> None:
    op = counter_operator(BrokenExecutor("copy"), 1)
    with pytest.raises(InvalidStateError):
        async with op:
            await op.process(("a", 0))
            await asyncio.wait_for(op.drain(), 2)


@pytest.mark.timeout(30)
async def test_delivering_a_batch_twice_fails_the_run() -> None:
    op = counter_operator(BrokenExecutor("twice"), 1)
    with pytest.raises(InvalidStateError):
        async with op:
            await op.process(("a", 0))
            await asyncio.wait_for(op.drain(), 2)


@pytest.mark.timeout(30)
async def test_too_few_results_fail_the_run_with_a_clear_error() -> None:
    op = counter_operator(BrokenExecutor("short"), 2)
    with pytest.raises(InvalidStateError, match="delivered 1 results for a batch of 2"):
        async with op:
            await op.process(("a", 0))
            await op.process(("b", 1))
            await asyncio.wait_for(op.drain(), 10)


@pytest.mark.timeout(30)
async def test_too_few_results_still_fail_the_futures_of_the_batch() -> None:
    backend = BrokenExecutor("short")
    aec, state = build(backend, batch_size=2)
    futs = [issue(aec, state, k) for k in range(2)]
    with pytest.raises(InvalidStateError):
        await asyncio.wait_for(aec.drain_inflight_records(0), 10)
    aec.close()
    assert all(f.done() for f in futs)


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
