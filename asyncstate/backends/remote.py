"""SimulatedRemoteBackend: another backend behind a simulated network round trip.

Every remote call (one batch, or the part of it the cache did not answer) takes a latency
drawn when the call starts: `latency_ms` fixed, or lognormal with median `latency_ms` and
99th percentile `latency_p99_ms`, plus `per_key_ms` for each distinct key in the call. The
latency is slept on an I/O thread (loop timers round to whole milliseconds under uvloop) and
measured (`latency_stats()`); at most `io_parallelism` calls are under way at once and later
ones queue. The inner backend applies each batch when it is triggered, in trigger order, so
results are exactly the inner backend's; only their delivery is delayed.

With `cache_entries > 0` a `StateCache` sits in front: hits are answered without a remote
call, writes go through it to the remote store. Failure injection (`failure_probability`,
or `fail_on_call=k` for the k-th call) fails a call with `InjectedFailure`.
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
from asyncstate.backends.cache import StateCache, backend_cache
from asyncstate.errors import ConfigError, InjectedFailure, InvalidStateError
from asyncstate.histogram import Histogram
from asyncstate.runtime.requests import StateKind, StateRequest

__all__ = ["SimulatedRemoteBackend"]

_Z99 = 2.3263478740408408  # the standard normal's 99th percentile


class _Call:
    __slots__ = ("batch", "error", "inject", "inner_done", "latency_done", "latency_s",
                 "number", "results")

    def __init__(self, batch: list[StateRequest], number: int) -> None:
        self.batch = batch
        self.number = number
        self.inject = False
        self.latency_s = 0.0
        self.results: list[Any] | None = None
        self.error: BaseException | None = None
        self.inner_done = False
        self.latency_done = False


def _number(option: str, value: object, rule: str, *, low: float = 0.0,
            allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not low <= value < math.inf:
        raise ConfigError(option, value, rule)
    return float(value)


class SimulatedRemoteBackend:
    """Wraps `inner` behind a simulated remote store (see the module docstring).

    `failure_probability` fails a call with `InjectedFailure` at that rate and
    `fail_on_call=k` fails the k-th call (1 for the first); draws are seeded by `seed`.
    `measured_latency_ms()` and `latency_stats()` report the latency actually slept,
    `drawn_latency_stats()` the latency drawn;
    `state_cache` is the cache (None without `cache_entries`).
    """

    def __init__(self, inner: StateExecutor, *, latency_ms: float, io_parallelism: int = 2,
                 cache_entries: int = 0, cache_write_back: bool = False,
                 failure_probability: float = 0.0,
                 seed: int | None = None, latency_p99_ms: float | None = None,
                 per_key_ms: float = 0.0, fail_on_call: int | None = None) -> None:
        if isinstance(inner, type) or not callable(getattr(inner, "execute_batch", None)):
            what = f"the class {inner.__name__}" if isinstance(inner, type) \
                else type(inner).__name__
            raise TypeError(f"inner must be a state backend, got {what}")
        latency = _number("latency_ms", latency_ms, "a finite number >= 0")
        assert latency is not None
        if type(io_parallelism) is not int or io_parallelism < 1:
            raise ConfigError("io_parallelism", io_parallelism, "an int >= 1")
        if type(cache_entries) is not int or cache_entries < 0:
            raise ConfigError("cache_entries", cache_entries, "an int >= 0")
        cache = backend_cache(cache_entries, cache_write_back)
        if isinstance(failure_probability, bool) or \
                not isinstance(failure_probability, (int, float)) or \
                not 0.0 <= failure_probability <= 1.0:
            raise ConfigError("failure_probability", failure_probability, "in [0.0, 1.0]")
        p99 = _number("latency_p99_ms", latency_p99_ms,
                      f"None or a finite number >= latency_ms ({latency:g})", low=latency,
                      allow_none=True)
        if p99 is not None and latency <= 0:
            raise ConfigError("latency_p99_ms", latency_p99_ms,
                              "None when latency_ms is 0 (a lognormal needs a median > 0)")
        per_key = _number("per_key_ms", per_key_ms, "a finite number >= 0")
        if fail_on_call is not None and (type(fail_on_call) is not int or fail_on_call < 1):
            raise ConfigError("fail_on_call", fail_on_call, "None or an int >= 1")
        self.inner = inner
        self.latency_ms = latency
        self.latency_p99_ms = p99
        self.per_key_ms = per_key if per_key is not None else 0.0
        self.io_parallelism = io_parallelism
        self.cache_entries = cache_entries
        self.failure_probability = float(failure_probability)
        self.fail_on_call = fail_on_call
        # A lognormal with median m and 99th percentile p: exp(N(ln m, sigma)) with
        # sigma = ln(p / m) / z99.
        self._sigma = math.log(p99 / latency) / _Z99 if p99 is not None else 0.0
        self._random = random.Random(seed)
        self.cache_write_back = cache_write_back
        self._cache: StateCache | None = cache
        self._binding: ExecutorBinding | None = None
        self._deliver_up: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._calls_started = 0
        self._calls_in_progress = 0
        self._calls: dict[int, _Call] = {}
        self._drawn = Histogram()  # microseconds drawn per call
        self._slept = Histogram()  # microseconds actually slept per call
        self._lock = threading.Lock()
        self._closed = False

    def __repr__(self) -> str:
        latency = f"{self.latency_ms:g}" + (f" (p99 {self.latency_p99_ms:g})"
                                            if self.latency_p99_ms is not None else "")
        cache = f" cache={self._cache!r}" if self._cache is not None else ""
        return (f"<SimulatedRemoteBackend latency_ms={latency} "
                f"io_parallelism={self.io_parallelism}{cache} inner={self.inner!r}>")

    @property
    def _sleeps(self) -> bool:
        return self.latency_ms > 0 or self.per_key_ms > 0

    def open(self, binding: ExecutorBinding) -> None:
        if self._binding is not None:
            raise InvalidStateError("this SimulatedRemoteBackend is already bound to an "
                                    "operator; create one backend per operator")
        if binding.loop is None:
            raise InvalidStateError("SimulatedRemoteBackend needs a running event loop")
        if self._cache is not None:
            binding = self._cache.open(binding, self._call)
        self._binding = binding
        self._deliver_up = binding.deliver
        self.inner.open(ExecutorBinding(loop=binding.loop, deliver=self._inner_done,
                                        iterator_chunk_size=binding.iterator_chunk_size,
                                        max_parallelism=binding.max_parallelism))
        if self._sleeps:
            self._pool = ThreadPoolExecutor(self.io_parallelism,
                                            thread_name_prefix="asyncstate-remote")

    def register_state(self, name: str, kind: StateKind) -> Any:
        return self.inner.register_state(name, kind)

    @property
    def checkpoint_backend(self) -> StateExecutor:
        """The backend holding the state: checkpoints are written from and restored into
        `inner` (the operator drains first, so no batch is under way in this wrapper)."""
        return self.inner

    @property
    def state_cache(self) -> StateCache | None:
        """The cache in front of the remote store, or None (`cache_entries=0`)."""
        return self._cache

    def execute_batch(self, batch: list[StateRequest]) -> None:
        if self._cache is not None:
            self._cache.execute_batch(batch)
        else:
            self._call(batch)

    def _draw_latency(self, batch: list[StateRequest]) -> float:
        """Seconds the next call takes (drawn in trigger order, so a seed repeats)."""
        ms = self.latency_ms
        if self._sigma > 0.0:
            ms = math.exp(self._random.gauss(math.log(ms), self._sigma))
        if self.per_key_ms > 0.0:
            ms += self.per_key_ms * len({r.context.key_bytes for r in batch})
        return ms / 1000.0

    def _call(self, batch: list[StateRequest]) -> None:
        """One remote call: the inner backend applies `batch` now, its delivery waits for
        the call's latency."""
        binding = self._binding
        assert binding is not None and binding.loop is not None, "open() the backend first"
        self._calls_started += 1
        call = _Call(batch, self._calls_started)
        # Drawn here, in trigger order, so that a seed fails the same calls whatever order
        # they finish in.
        call.inject = call.number == self.fail_on_call or (
            self.failure_probability > 0.0
            and self._random.random() < self.failure_probability)
        if self._pool is not None:
            call.latency_s = self._draw_latency(batch)
            self._drawn.record_seconds(call.latency_s)
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
                self._deliver_up(batch, None, InvalidStateError(
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
        time.sleep(call.latency_s)
        slept = time.perf_counter() - started
        with self._lock:
            self._slept.record_seconds(slept)
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
        error = call.error
        if error is None and call.inject:
            why = f"fail_on_call={self.fail_on_call}" if call.number == self.fail_on_call \
                else f"failure_probability={self.failure_probability}"
            error = InjectedFailure(
                f"injected failure of remote call {call.number}, a batch of "
                f"{len(call.batch)} requests ({why})")
        if error is not None:
            self._deliver_up(call.batch, None, error)
        else:
            self._deliver_up(call.batch, call.results, None)

    def fully_loaded(self) -> bool:
        return self._calls_in_progress >= self.io_parallelism

    def io_slots(self) -> int:
        """Calls under way at once: `io_parallelism` (the operator paces admission by it)."""
        return self.io_parallelism

    @property
    def calls(self) -> int:
        """Remote calls started so far (cache hits make none)."""
        return self._calls_started

    @property
    def _slept_count(self) -> int:
        """Calls whose latency was slept so far."""
        with self._lock:
            return self._slept.count

    def measured_latency_ms(self) -> float:
        """Mean latency actually slept per call, in milliseconds (0.0 before any call)."""
        with self._lock:
            return self._slept.mean / 1000.0

    def latency_stats(self) -> dict[str, Any]:
        """The latency actually slept per call, in milliseconds: count, mean, min, p50,
        p90, p99, p99_9 and max (zeros before any call)."""
        with self._lock:
            return self._slept.summary(scale=0.001)

    def drawn_latency_stats(self) -> dict[str, Any]:
        """The latency drawn per call (what `_sleep` was asked to sleep), in milliseconds,
        summarized as `latency_stats()` is: the distribution itself, free of timer noise."""
        return self._drawn.summary(scale=0.001)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self.inner.close()
