"""Errors raised by asyncstate.

The tree::

    AsyncStateError                       root of everything asyncstate raises
    +-- ConfigError (also ValueError)     an option has an invalid value
    +-- SerializationError                a key or value cannot be encoded
    +-- KeyGroupError                     a key belongs to another operator's key groups
    +-- CheckpointError                   a checkpoint is missing, incomplete or damaged
    +-- InvalidStateError (also RuntimeError)  an object is used at the wrong moment
    +-- RecordTimeoutError (also TimeoutError)  a record took longer than record_timeout_ms
    +-- BackendError                      a storage backend failed
        +-- InjectedFailure               a simulated backend failed on purpose

Every error keeps its context (state name, key group, path, option) as attributes, names it in
its message, and survives pickling, because Spark ships executor errors to the driver.
"""

from __future__ import annotations

import pickle
from typing import Any

__all__ = [
    "AsyncStateError",
    "BackendError",
    "CheckpointError",
    "ConfigError",
    "InjectedFailure",
    "InvalidStateError",
    "KeyGroupError",
    "RecordTimeoutError",
    "SerializationError",
]


class AsyncStateError(Exception):
    """Root of every error asyncstate raises."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, _picklable(self.__dict__)))

    def __str__(self) -> str:
        return self.message


def _picklable(attrs: dict[str, Any]) -> dict[str, Any]:
    """The error's attributes, each one that does not pickle (a rejected lambda, a lock)
    replaced by its repr, as the message shows it."""
    out: dict[str, Any] = {}
    for name, value in attrs.items():
        try:
            pickle.dumps(value)
        except Exception:  # noqa: BLE001 - whatever pickling raises, the repr travels
            value = repr(value)
        out[name] = value
    return out


def _rebuild(cls: type[AsyncStateError], message: str, attrs: dict[str, Any]) -> AsyncStateError:
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(attrs)
    return err


class ConfigError(AsyncStateError, ValueError):
    """Raised when a configuration option has an invalid value; names the option.
    `message`: the whole message, where "<option> must be <rule>, got <value>" reads badly
    (a declaration that clashes with an earlier one)."""

    def __init__(self, option: str, value: object, rule: str, *,
                 message: str | None = None) -> None:
        super().__init__(f"{option} must be {rule}, got {value!r}" if message is None
                         else message)
        self.option = option
        self.value = value
        self.rule = rule


class SerializationError(AsyncStateError):
    """Raised when a key, namespace or value cannot be encoded; names the state and the type."""

    def __init__(self, message: str, *, state_name: str | None = None,
                 type_name: str | None = None) -> None:
        super().__init__(message)
        self.state_name = state_name
        self.type_name = type_name


class KeyGroupError(AsyncStateError):
    """Raised when a key's key group lies outside the key groups this operator owns."""

    def __init__(self, message: str, *, key_group: int | None = None) -> None:
        super().__init__(message)
        self.key_group = key_group


class CheckpointError(AsyncStateError):
    """Raised when a checkpoint cannot be written or restored; names the file or part and,
    where one key group is at fault, the key group."""

    def __init__(self, message: str, *, path: str | None = None,
                 key_group: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.key_group = key_group


class InvalidStateError(AsyncStateError, RuntimeError):
    """Raised when an object is used at the wrong moment (a pending future's result, a
    record context after its record finished, state access outside any record)."""


class RecordTimeoutError(AsyncStateError, TimeoutError):
    """Raised when a record or timer firing runs longer than
    `AsyncStateConfig.record_timeout_ms`; names its key."""

    def __init__(self, key: object, timeout_ms: int, elapsed_ms: int, *,
                 finished: bool = False) -> None:
        super().__init__(
            f"the record with key {key!r} took {elapsed_ms} ms, longer than "
            f"record_timeout_ms={timeout_ms}; code that blocks the event loop (time.sleep, "
            "a synchronous call) holds up every record" if finished else
            f"the record with key {key!r} has been running for {elapsed_ms} ms, longer than "
            f"record_timeout_ms={timeout_ms}; it may await something that never completes")
        self.key = key
        self.timeout_ms = timeout_ms
        self.elapsed_ms = elapsed_ms
        self.finished = finished  # it had finished: overran without the watchdog seeing it


class BackendError(AsyncStateError):
    """Raised when a storage backend fails; names the backend and, where known, the path."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class InjectedFailure(BackendError):
    """Raised by a simulated backend's failure injection (`failure_probability`)."""
