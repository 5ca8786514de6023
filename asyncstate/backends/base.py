"""The seam between the controller and storage: the `StateExecutor` protocol.

An executor receives batches of `StateRequest`s and reports their results back **on the loop
thread**, once per batch. The controller owns ordering: it hands a backend at most one record
per key at a time, and calls `execute_batch` in trigger order. The executor promises:

1. Requests of one batch take effect in issue (list) order, and batches touching a common
   (state, key, namespace) take effect in trigger order, so a record reads its own writes.
2. `deliver(batch, results, None)` is called exactly once per batch, on the loop thread, with
   the very list object `execute_batch` received and one result per request (None for
   writes); or `deliver(batch, None, error)` if the batch failed. It may be called inline
   from `execute_batch`; the controller copes. A batch delivered after the controller
   closed is ignored (its futures were already failed).
3. Key encoding and value decoding happen on the loop thread; only GIL-releasing storage
   calls run on pool threads.

Payloads and results follow `StateRequestType`: values arrive in stored form
(`asyncstate.serde.to_stored`) and results are returned as user values (decoded).

What else a backend can do is declared by the capability Protocols below, which an operator
checks once when it opens (`BackendCapabilities.of`), never by probing attributes later:

- `ImmediateExecutor`: no I/O to amortize (``completes_at_issue = True``): the controller
  calls `execute_one` at issue time for records that hold their key and completes the future
  at once; `immediate_ops`, when not None, is a list indexed by request type of functions
  ``op(state.handle, key_bytes, namespace, payload) -> result`` (None where `execute_one`
  must be used), which the controller calls directly on its hot path.
- `SnapshotBackend`: takes part in checkpoints, one key group at a time;
  `GroupedSnapshotBackend` also encodes every key group in one pass over its storage.
- `RestorableBackend`: its state outlives the operator (a directory): a restore discards
  it first, marks the directory while it runs, and carries the list sequence numbers.
- `WrappingBackend`: wraps another backend that holds the state (checkpoints go to it).
- `TimerStoreBackend`: keeps the operator's timers in its own storage (RocksDB column
  families) instead of in memory.
- `TtlBackend`: stores TTL states (timestamped entries, `asyncstate.state.ttl.layout`),
  records which states are timestamped, and runs their cleanup (incremental steps, full
  snapshot filtering); `TtlBackgroundCleaner` also cleans them up in the background.
- `CachingBackend`: may keep a `StateCache` (`asyncstate.backends.cache`) in front of its
  storage; a controller talking to it directly lets the cache answer at issue time, and a
  restore empties every cache on the way to the backend holding the state.
- `PacedExecutor`: its store works on `io_slots()` batches at once. An operator admits new
  records only while fewer requests than those slots' full batches plus one more are in
  the executor, waiting to be sent, or about to come from records admitted and not yet
  started: records beyond that would only wait, and cost CPU caches meanwhile.

`fully_loaded()` tells the controller that every I/O slot is busy: while it is True, partial
batches are kept back (they grow) instead of being sent early for a waiter; full batches are
always sent.

The owner (an operator) calls `open` once before the first request and `close` once at the
end; an executor serves one operator.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from asyncstate.errors import CheckpointError
from asyncstate.runtime.requests import (
    RequestState,
    StateKind,
    StateRequest,
    StateRequestType,
)

if TYPE_CHECKING:
    from asyncstate.backends.cache import StateCache
    from asyncstate.keygroups import KeyGroupRange
    from asyncstate.state.ttl.tracker import TtlTracker

__all__ = [
    "BackendCapabilities",
    "BatchDelivery",
    "CachingBackend",
    "ExecutorBinding",
    "GroupedSnapshotBackend",
    "ImmediateExecutor",
    "ImmediateOp",
    "PacedExecutor",
    "RestorableBackend",
    "SnapshotBackend",
    "StateExecutor",
    "TimerStoreBackend",
    "TtlBackend",
    "TtlBackgroundCleaner",
    "WrappingBackend",
]

BatchDelivery = Callable[[list[StateRequest], "list[Any] | None", "BaseException | None"], None]
"""`deliver(batch, results, error)`: report one batch's outcome, on the loop thread."""

ImmediateOp = Callable[[Any, bytes, bytes, Any], Any]
"""``op(state.handle, key_bytes, namespace, payload) -> result`` of an `ImmediateExecutor`."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ExecutorBinding:
    """What an executor learns when its operator opens it."""

    loop: asyncio.AbstractEventLoop | None
    deliver: BatchDelivery
    iterator_chunk_size: int
    max_parallelism: int


@runtime_checkable
class StateExecutor(Protocol):
    """Executes batches of state requests (see the module docstring for the contract)."""

    def open(self, binding: ExecutorBinding) -> None:
        """Bind to the operator's loop and delivery callback; called once, on the loop thread."""

    def register_state(self, name: str, kind: StateKind) -> Any:
        """Declare a state before its first request and return the backend's handle for it,
        which requests reach as `request.state.handle`. Registering a name again with the
        same kind returns the same handle; another kind raises `ValueError`."""

    def execute_batch(self, batch: list[StateRequest]) -> None:
        """Start executing a batch; its results arrive through `deliver`."""

    def fully_loaded(self) -> bool:
        """True while the executor is saturated (all I/O slots busy)."""

    def close(self) -> None:
        """Release threads and storage handles; pending batches are abandoned."""


@runtime_checkable
class ImmediateExecutor(StateExecutor, Protocol):
    """An executor that completes requests at issue time (see the module docstring)."""

    completes_at_issue: bool
    immediate_ops: Sequence[ImmediateOp | None] | None

    def execute_one(self, state: RequestState, request_type: StateRequestType, payload: Any,
                    key_bytes: bytes, namespace: bytes) -> Any:
        """Apply one request now and return its result (raises on failure)."""


@runtime_checkable
class SnapshotBackend(Protocol):
    """A backend that takes part in checkpoints. An entry is ``(state name, key bytes,
    namespace bytes, data)`` (see `asyncstate.checkpoint.snapshot`)."""

    def registered_states(self) -> dict[str, StateKind]:
        """Every registered state and its kind."""

    def register_state(self, name: str, kind: StateKind) -> Any:
        """Declare a state (a restore declares every state of the checkpoint)."""

    def snapshot_key_group(self, key_group: int) -> Iterable[Sequence[Any]]:
        """The state entries of one key group."""

    def restore_key_group(self, key_group: int, entries: Iterable[Sequence[Any]]) -> None:
        """Store the state entries of one key group, replacing what the backend holds for
        each (state, key, namespace) they name."""


@runtime_checkable
class GroupedSnapshotBackend(SnapshotBackend, Protocol):
    """A `SnapshotBackend` that encodes all of its entries by key group in one pass."""

    def snapshot_key_groups(self, key_groups: KeyGroupRange,
                            max_parallelism: int) -> dict[int, tuple[int, bytes]]:
        """For each non-empty key group: (number of entries, the entries msgpack-encoded back
        to back); raises KeyGroupError for an entry outside `key_groups`."""


@runtime_checkable
class RestorableBackend(SnapshotBackend, Protocol):
    """A `SnapshotBackend` whose state outlives the operator (a directory reopened later)."""

    def mark_restoring(self, restoring: bool) -> None:
        """Record that a restore is under way (True) or has completed (False): a directory
        left marked refuses its state until a restore into it completes."""

    def discard_state(self) -> list[str]:
        """Drop every state the backend holds (a restore replaces it); the names dropped."""

    def list_sequence(self) -> int:
        """The next list element sequence number (carried by checkpoints)."""

    def set_list_sequence(self, value: int) -> None:
        """Raise the list sequence counter to at least `value`."""

    def key_group_outside(self, key_groups: KeyGroupRange) -> tuple[str, int] | None:
        """(state name, key group) of an entry stored outside `key_groups`, or None: a
        snapshot of `key_groups` would leave it out."""


@runtime_checkable
class WrappingBackend(Protocol):
    """A backend in front of another one that holds the state."""

    @property
    def checkpoint_backend(self) -> StateExecutor:
        """The backend holding the state: checkpoints are written from and restored into it."""


@runtime_checkable
class TimerStoreBackend(Protocol):
    """A backend that can hold the operator's timers."""

    def timer_store(self, name: str) -> Any:
        """The store of the timers named `name` (for `asyncstate.timers.rocksdb_set`), or
        None when this backend keeps timers in memory. Called after any restore's discard."""


@runtime_checkable
class TtlBackend(Protocol):
    """A backend that stores TTL states: their writes carry `TtlValue`s and their reads a
    `TtlRead` (`asyncstate.state.ttl.layout`), which it executes as that module says. It
    records which states are stored with timestamps (in checkpoints too) and cleans them up
    as their `TtlTracker` asks. Call these on the loop thread, between requests."""

    def ttl_layouts(self) -> dict[str, str]:
        """The time domain ("processing_time" or "event_time") of the timestamps of every
        state stored with timestamps."""

    def set_ttl_layout(self, name: str, domain: str | None, stamp: int | None) -> None:
        """Store state `name` with timestamps of `domain` from now on (None: without). Its
        entries stored the other way are rewritten: timestamps are added (all `stamp`;
        ValueError when `stamp` is None and there are entries) or dropped."""

    def has_entries(self, name: str) -> bool:
        """True when state `name` stores any entry."""

    def track_ttl(self, name: str, tracker: TtlTracker | None) -> None:
        """Clean state `name` up as `tracker` asks (full snapshot filtering, background
        cleanup, the bound incremental steps keep), or, None, no longer."""

    def ttl_cleanup_step(self, name: str, budget: int, now: int) -> None:
        """Incremental cleanup: check up to `budget` entries of state `name` from where its
        cursor stands, removing those expired at `now`, in order with the requests issued
        before (the cursor survives batches)."""


@runtime_checkable
class TtlBackgroundCleaner(Protocol):
    """A `TtlBackend` that also removes expired entries in the background (RocksDB)."""

    async def wait_ttl_cleaner_idle(self) -> None:
        """Wait until the background cleaner has nothing to do (for tests and shutdown)."""


@runtime_checkable
class CachingBackend(Protocol):
    """A backend that may keep a state cache in front of its storage."""

    @property
    def state_cache(self) -> StateCache | None:
        """The cache, or None when this backend runs without one."""


@runtime_checkable
class PacedExecutor(Protocol):
    """An executor whose store works on a fixed number of batches at once (see the module
    docstring): the operator paces admission by it."""

    def io_slots(self) -> int:
        """How many batches the store works on at once (>= 1)."""


_SNAPSHOT_METHODS = ("registered_states", "register_state", "snapshot_key_group",
                     "restore_key_group")
_MAX_WRAPPERS = 16


@dataclasses.dataclass(frozen=True, slots=True)
class BackendCapabilities:
    """What a backend can do, resolved once when its operator opens.

    `immediate`: the backend as an `ImmediateExecutor` when it completes requests at issue
    time, else None. `store`: the backend holding the state for checkpoints (the backend
    itself, or the one a `WrappingBackend` wraps), None when it is no `SnapshotBackend`
    (`missing` then names the methods it lacks). `grouped`, `restorable` and `timers`: the
    backend holding the state as those Protocols, or None. `ttl` and `ttl_cleaner`: `store`
    as `TtlBackend` and `TtlBackgroundCleaner`, or None. `caches`: the state cache of the
    backend and of every backend it wraps, outermost first.
    """

    backend: StateExecutor
    immediate: ImmediateExecutor | None
    store: SnapshotBackend | None
    grouped: GroupedSnapshotBackend | None
    restorable: RestorableBackend | None
    timers: TimerStoreBackend | None
    missing: tuple[str, ...]
    ttl: TtlBackend | None = None
    ttl_cleaner: TtlBackgroundCleaner | None = None
    caches: tuple[StateCache, ...] = ()

    @classmethod
    def of(cls, backend: StateExecutor) -> BackendCapabilities:
        """Resolve the capabilities of `backend`."""
        immediate = backend if isinstance(backend, ImmediateExecutor) \
            and backend.completes_at_issue else None
        held: object = backend
        caches: list[StateCache] = []
        for _ in range(_MAX_WRAPPERS):  # wrappers of wrappers, never a cycle
            cache = held.state_cache if isinstance(held, CachingBackend) else None
            if cache is not None:
                caches.append(cache)
            if not isinstance(held, WrappingBackend):
                break
            held = held.checkpoint_backend
        timers = held if isinstance(held, TimerStoreBackend) else None
        if isinstance(held, SnapshotBackend):
            ttl = held if isinstance(held, TtlBackend) else None
            return cls(backend, immediate, held,
                       held if isinstance(held, GroupedSnapshotBackend) else None,
                       held if isinstance(held, RestorableBackend) else None, timers, (),
                       ttl, held if ttl is not None
                       and isinstance(held, TtlBackgroundCleaner) else None, tuple(caches))
        missing = tuple(m for m in _SNAPSHOT_METHODS if not callable(getattr(held, m, None)))
        return cls(backend, immediate, None, None, None, timers, missing, caches=tuple(caches))

    def checkpoint_store(self, path: str) -> SnapshotBackend:
        """`store`, or CheckpointError naming the checkpoint at `path` and what is missing."""
        if self.store is None:
            raise CheckpointError(
                f"{type(self.backend).__name__} cannot take part in checkpoint {path!r}: it "
                f"has no {', '.join(self.missing)} (see SnapshotBackend)", path=path)
        return self.store

