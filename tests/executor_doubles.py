"""Executors and backends that misbehave or report on purpose: a SimulatedRemoteBackend that
logs its batches and counts its calls under way, an executor that breaks the delivery
contract in one chosen way, and an inner backend that delivers only when told."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from shared_functions import Boom, Counter, FakeState, with_tag

import asyncstate as ast
from asyncstate.backends.base import ExecutorBinding
from asyncstate.backends.heap import HeapBackend
from asyncstate.backends.remote import SimulatedRemoteBackend
from asyncstate.runtime.requests import StateKind, StateRequest, StateRequestType

GET = StateRequestType.VALUE_GET


def remote_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("asyncstate-remote")]


async def wait_for_condition(predicate: Any, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.002)
    return predicate()


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


def counter_operator(backend: Any, batch_size: int,
                     buffer_timeout_ms: int = 0) -> ast.KeyedOperator:
    """The Counter over `backend`, keyed by the record's first item."""
    return ast.KeyedOperator(Counter(output=with_tag), key_selector=lambda r: r[0], backend=backend,
                             config=ast.AsyncStateConfig(batch_size=batch_size,
                                                         buffer_timeout_ms=buffer_timeout_ms))


def build(backend: Any, **kw: Any) -> tuple[ast.AsyncExecutionController, FakeState]:
    kw.setdefault("batch_size", 1)
    kw.setdefault("buffer_timeout_ms", 0)
    kw.setdefault("max_in_flight", 1000)
    aec = ast.AsyncExecutionController(backend, **kw)
    return aec, FakeState.register(backend, "v")


def issue(aec: ast.AsyncExecutionController, state: FakeState, key: Any,
          rtype: StateRequestType = GET, payload: Any = None) -> Any:
    aec.set_current_context(aec.build_context(key, key))
    fut = aec.handle_request(state, rtype, payload)
    aec.set_current_context(None)
    return fut


class HeldStore(ReorderingInner):
    """An executor that applies each batch when given and delivers it only when told (in any
    order): a store whose calls finish when the test says. It declares no I/O slots, so the
    operator does not pace admission by it. `held_peak`: the most requests held at once."""

    def __init__(self) -> None:
        super().__init__()
        self.held_peak = 0

    def held(self) -> int:
        """Requests given and not yet delivered."""
        return sum(len(batch) for batch, _, _ in self.pending)

    def _held(self, batch: list[StateRequest], results: Any, error: Any) -> None:
        super()._held(batch, results, error)
        self.held_peak = max(self.held_peak, self.held())


class PacedHeldStore(HeldStore):
    """A `HeldStore` whose store works on `slots` batches at once (a `PacedExecutor`)."""

    def __init__(self, slots: Any) -> None:
        super().__init__()
        self.slots = slots

    def io_slots(self) -> Any:
        return self.slots

    def fully_loaded(self) -> bool:
        return len(self.pending) >= self.slots
