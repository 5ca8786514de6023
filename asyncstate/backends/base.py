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

An executor that has no I/O to amortize may also be an `ImmediateExecutor` (it sets the class
attribute ``completes_at_issue = True`` and has `execute_one`): the controller then calls
`execute_one` at issue time, for records that hold their key, and completes the future at once.

An immediate executor may also expose `immediate_ops`: a list indexed by request type of
functions ``op(state.handle, key_bytes, namespace, payload) -> result`` (None where
`execute_one` must be used); the controller then calls them directly on its hot path.

`fully_loaded()` tells the controller that every I/O slot is busy: while it is True, partial
batches are kept back (they grow) instead of being sent early for a waiter; full batches are
always sent.

The owner (an operator) calls `open` once before the first request and `close` once at the
end; an executor serves one operator.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from asyncstate.runtime.requests import (
    RequestState,
    StateKind,
    StateRequest,
    StateRequestType,
)

__all__ = [
    "BatchDelivery",
    "ExecutorBinding",
    "ImmediateExecutor",
    "StateExecutor",
]

BatchDelivery = Callable[[list[StateRequest], "list[Any] | None", "BaseException | None"], None]
"""`deliver(batch, results, error)`: report one batch's outcome, on the loop thread."""


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
    """An executor that can complete a request at issue time."""

    def execute_one(self, state: RequestState, request_type: StateRequestType, payload: Any,
                    key_bytes: bytes, namespace: bytes) -> Any:
        """Apply one request now and return its result (raises on failure)."""
