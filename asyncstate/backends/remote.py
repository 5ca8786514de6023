"""SimulatedRemoteBackend: another backend behind a simulated network round trip.

Every executor call (one batch) costs `latency_ms`, slept on an I/O thread (loop timers
round to whole milliseconds under uvloop); at most `io_parallelism` calls are under way at
once and later batches queue. The inner backend applies each batch when it is triggered, in
trigger order, so results are exactly the inner backend's; only their delivery is delayed.
"""

from __future__ import annotations

import contextlib
import math
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asyncstate.backends.base import ExecutorBinding, StateExecutor
from asyncstate.errors import ConfigError, InjectedFailure, InvalidStateError
from asyncstate.runtime.requests import StateKind, StateRequest

__all__ = ["SimulatedRemoteBackend"]


class _Call:
    __slots__ = ("batch", "error", "inject", "inner_done", "latency_done", "results")

    def __init__(self, batch: list[StateRequest]) -> None:
        self.batch = batch
        self.inject = False
        self.results: list[Any] | None = None
        self.error: BaseException | None = None
        self.inner_done = False
        self.latency_done = False


class SimulatedRemoteBackend:
    """Wraps `inner`, adding `latency_ms` per batch with `io_parallelism` concurrent calls.

    `failure_probability` fails a batch with `InjectedFailure` at that rate (seeded by
    `seed`). `measured_latency_ms()` reports the latency actually slept.
    """

    def __init__(self, inner: StateExecutor, *, latency_ms: float, io_parallelism: int = 2,
                 cache_entries: int = 0, failure_probability: float = 0.0,
                 seed: int | None = None) -> None:
        if isinstance(inner, type) or not callable(getattr(inner, "execute_batch", None)):
            what = f"the class {inner.__name__}" if isinstance(inner, type) \
                else type(inner).__name__
            raise TypeError(f"inner must be a state backend, got {what}")
        if isinstance(latency_ms, bool) or not isinstance(latency_ms, (int, float)) \
                or not 0 <= latency_ms < math.inf:
            raise ConfigError("latency_ms", latency_ms, "a finite number >= 0")
        if type(io_parallelism) is not int or io_parallelism < 1:
            raise ConfigError("io_parallelism", io_parallelism, "an int >= 1")
        if type(cache_entries) is not int or cache_entries < 0:
            raise ConfigError("cache_entries", cache_entries, "an int >= 0")
        if cache_entries != 0:
            raise NotImplementedError("cache_entries is not available in this version")
        if isinstance(failure_probability, bool) or \
                not isinstance(failure_probability, (int, float)) or \
                not 0.0 <= failure_probability <= 1.0:
            raise ConfigError("failure_probability", failure_probability, "in [0.0, 1.0]")
        self.inner = inner
        self.latency_ms = float(latency_ms)
        self.io_parallelism = io_parallelism
        self.failure_probability = float(failure_probability)
        self._random = random.Random(seed)
        self._binding: ExecutorBinding | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._calls_in_progress = 0
        self._calls: dict[int, _Call] = {}
        self._slept_total = 0.0
        self._slept_count = 0
        self._lock = threading.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return (f"<SimulatedRemoteBackend latency_ms={self.latency_ms} "
                f"io_parallelism={self.io_parallelism} inner={self.inner!r}>")

    def open(self, binding: ExecutorBinding) -> None:
        if self._binding is not None:
            raise InvalidStateError("this SimulatedRemoteBackend is already bound to an "
                                    "operator; create one backend per operator")
        if binding.loop is None:
            raise InvalidStateError("SimulatedRemoteBackend needs a running event loop")
        self._binding = binding
        self.inner.open(ExecutorBinding(loop=binding.loop, deliver=self._inner_done,
                                        iterator_chunk_size=binding.iterator_chunk_size,
                                        max_parallelism=binding.max_parallelism))
        if self.latency_ms > 0:
            self._pool = ThreadPoolExecutor(self.io_parallelism,
                                            thread_name_prefix="asyncstate-remote")

    def register_state(self, name: str, kind: StateKind) -> Any:
        return self.inner.register_state(name, kind)

    @property
    def checkpoint_backend(self) -> StateExecutor:
        """The backend holding the state: checkpoints are written from and restored into
        `inner` (the operator drains first, so no batch is under way in this wrapper)."""
        return self.inner

    def execute_batch(self, batch: list[StateRequest]) -> None:
        binding = self._binding
        assert binding is not None and binding.loop is not None, "open() the backend first"
        call = _Call(batch)
        # Drawn here, in trigger order, so that a seed fails the same batches whatever order
        # the calls finish in.
        call.inject = self.failure_probability > 0.0 and \
            self._random.random() < self.failure_probability
        self._calls_in_progress += 1
        # The inner backend applies the batch now, in trigger order; its delivery comes
        # back through _inner_done (inline for the heap backend).
        self._calls[id(batch)] = call
        try:
            self.inner.execute_batch(batch)
        except BaseException:
            self._calls.pop(id(batch), None)  # the call never started: give its slot back
            self._calls_in_progress -= 1
            raise
        if self._pool is None:
            binding.loop.call_soon(self._latency_done, call)
        else:
            self._pool.submit(self._sleep, call)

    def _inner_done(self, batch: list[StateRequest], results: list[Any] | None,
                    error: BaseException | None) -> None:
        call = self._calls.pop(id(batch), None)
        if call is None or call.batch is not batch:
            if not self._closed and self._binding is not None:
                # Fails the run: the controller refuses a batch it has not sent.
                self._binding.deliver(batch, None, InvalidStateError(
                    "the inner backend delivered a batch it was not given (or delivered one "
                    "twice)"))
            return
        call.results = results
        call.error = error
        call.inner_done = True
        if call.latency_done:
            self._finish(call)

    def _sleep(self, call: _Call) -> None:
        started = time.perf_counter()
        time.sleep(self.latency_ms / 1000.0)
        slept = time.perf_counter() - started
        with self._lock:
            self._slept_total += slept
            self._slept_count += 1
        binding = self._binding
        if binding is not None and binding.loop is not None and not self._closed:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                binding.loop.call_soon_threadsafe(self._latency_done, call)

    def _latency_done(self, call: _Call) -> None:
        call.latency_done = True
        if call.inner_done:
            self._finish(call)

    def _finish(self, call: _Call) -> None:
        self._calls_in_progress -= 1
        if self._closed:
            return
        assert self._binding is not None
        error = call.error
        if error is None and call.inject:
            error = InjectedFailure(
                f"injected failure of a batch of {len(call.batch)} requests "
                f"(failure_probability={self.failure_probability})")
        if error is not None:
            self._binding.deliver(call.batch, None, error)
        else:
            self._binding.deliver(call.batch, call.results, None)

    def fully_loaded(self) -> bool:
        return self._calls_in_progress >= self.io_parallelism

    def measured_latency_ms(self) -> float:
        """Mean latency actually slept per call, in milliseconds (0.0 before any call)."""
        with self._lock:
            return 1000.0 * self._slept_total / self._slept_count if self._slept_count else 0.0

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self.inner.close()
