"""Configuration of the asynchronous execution: one frozen, validated object."""

from __future__ import annotations

import dataclasses
from typing import Literal

from asyncstate.errors import ConfigError
from asyncstate.runtime.requests import StateKind

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_BUFFER_TIMEOUT_MS",
    "DEFAULT_GC_THRESHOLD",
    "DEFAULT_ITERATOR_CHUNK_SIZE",
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_MAX_PARALLELISM",
    "GC_THRESHOLD_PER_RECORD",
    "MAX_ITERATOR_CHUNK_SIZE",
    "MAX_MAX_PARALLELISM",
    "MIN_AUTO_GC_THRESHOLD",
    "AsyncStateConfig",
    "check_backend_state",
    "check_state_name",
]

DEFAULT_BATCH_SIZE = 1000
DEFAULT_BUFFER_TIMEOUT_MS = 1000
DEFAULT_MAX_IN_FLIGHT = 6000
DEFAULT_MAX_PARALLELISM = 128
DEFAULT_ITERATOR_CHUNK_SIZE = 1000
# Elements one iteration step may load at most (a step's slice is taken with C-sized ints).
MAX_ITERATOR_CHUNK_SIZE = 2**31 - 1
# First threshold of the cyclic GC while an operator runs (see asyncstate/runtime/gc_threshold.py).
# "auto": GC_THRESHOLD_PER_RECORD allocations per record allowed in flight, at least
# MIN_AUTO_GC_THRESHOLD. A record in flight keeps about ten tracked objects alive, and every
# young collection walks all of them: 64 allocations per record keep that walk small beside
# the work between two collections.
DEFAULT_GC_THRESHOLD: Literal["auto"] = "auto"
GC_THRESHOLD_PER_RECORD = 64
MAX_GC_THRESHOLD = 2**31 - 1  # gc.set_threshold takes a C int
MIN_AUTO_GC_THRESHOLD = 50_000
MAX_MAX_PARALLELISM = 32768  # Flink's upper bound: key groups fit in two bytes.


def check_int(option: str, value: object, low: int, high: int | None = None) -> int:
    """Return `value` if it is an int (not a bool) within [low, high], else raise ConfigError."""
    if type(value) is not int:
        raise ConfigError(option, value, "an int" if high is None else f"an int in [{low}, {high}]")
    if value < low or (high is not None and value > high):
        rule = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigError(option, value, rule)
    return value


def check_state_name(name: object, option: str = "name") -> str:
    """Return `name` as a plain str if it can name a state on every backend and in
    checkpoints: a non-empty str without NUL characters that encodes to UTF-8 (no lone
    surrogates). Else ConfigError. A str subclass (a StrEnum member) gives its plain str."""
    if not isinstance(name, str) or not name:
        raise ConfigError(option, name, "a non-empty str")
    if type(name) is not str:
        name = str.__str__(name)
    if "\x00" in name:
        raise ConfigError(option, name, "a str without NUL characters")
    try:
        name.encode()
    except UnicodeEncodeError:
        raise ConfigError(option, name,
                          "a str that encodes to UTF-8 (it holds a lone surrogate)") from None
    return name


def check_backend_state(name: object, kind: object) -> tuple[str, StateKind]:
    """The check of a backend's `register_state(name, kind)`: TypeError unless `name` is a
    non-empty plain str (descriptors hand over plain strs) and `kind` a StateKind,
    ConfigError as `check_state_name`."""
    if type(name) is not str or not name:
        raise TypeError(f"state name must be a non-empty str, got {name!r}")
    checked = check_state_name(name, "state name")
    if not isinstance(kind, StateKind):
        raise TypeError(f"kind must be a StateKind, got {kind!r}")
    return checked, kind


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AsyncStateConfig:
    """Limits of the asynchronous execution controller.

    batch_size: state requests sent to the backend in one executor call (>= 1).
    buffer_timeout_ms: longest time a partial batch waits for more requests while input keeps
        arriving; 0 disables the timeout.
    max_in_flight: most records admitted and not yet finished; admission waits beyond it.
    max_parallelism: number of key groups, 1..32768; fixed for the life of the state.
    iterator_chunk_size: elements loaded per step when iterating list or map state,
        1..2**31 - 1.
    record_timeout_ms: a record (or timer firing) that runs longer than this, from the moment
        it holds its key until it finishes, fails the operator with RecordTimeoutError naming
        its key; None (the default) sets no limit.
    gc_threshold: while the operator is open, the cyclic garbage collector's first threshold
        is at least this many allocations (restored when the last operator closes), so that
        records in flight are not walked and promoted by frequent collections. "auto" (the
        default) scales it with max_in_flight (`resolved_gc_threshold`); None leaves the
        collector's settings alone.
    """

    batch_size: int = DEFAULT_BATCH_SIZE
    buffer_timeout_ms: int = DEFAULT_BUFFER_TIMEOUT_MS
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    max_parallelism: int = DEFAULT_MAX_PARALLELISM
    iterator_chunk_size: int = DEFAULT_ITERATOR_CHUNK_SIZE
    record_timeout_ms: int | None = None
    gc_threshold: int | Literal["auto"] | None = DEFAULT_GC_THRESHOLD

    def __post_init__(self) -> None:
        check_int("batch_size", self.batch_size, 1)
        check_int("buffer_timeout_ms", self.buffer_timeout_ms, 0)
        check_int("max_in_flight", self.max_in_flight, 1)
        check_int("max_parallelism", self.max_parallelism, 1, MAX_MAX_PARALLELISM)
        check_int("iterator_chunk_size", self.iterator_chunk_size, 1, MAX_ITERATOR_CHUNK_SIZE)
        if self.record_timeout_ms is not None:
            check_int("record_timeout_ms", self.record_timeout_ms, 1)
        threshold = self.gc_threshold
        if threshold is not None and threshold != "auto" and (
                type(threshold) is not int or not 1 <= threshold <= MAX_GC_THRESHOLD):
            raise ConfigError("gc_threshold", threshold,
                              f'an int in [1, {MAX_GC_THRESHOLD}], "auto" or None')

    def resolved_gc_threshold(self) -> int | None:
        """The first GC threshold an operator with this config holds while open: the int
        given, None, or for "auto" max(MIN_AUTO_GC_THRESHOLD, GC_THRESHOLD_PER_RECORD *
        max_in_flight) (384,000 with the default max_in_flight), at most MAX_GC_THRESHOLD."""
        if self.gc_threshold == "auto":
            return min(MAX_GC_THRESHOLD,
                       max(MIN_AUTO_GC_THRESHOLD, GC_THRESHOLD_PER_RECORD * self.max_in_flight))
        return self.gc_threshold
