"""RecordContext: one record (or timer firing) in flight, reference counted.

A context is created per record. It counts references: one per pending future of the
record, one while its processing function runs, one while its coroutine is alive. When the
count returns to zero and the context holds its key, the controller disposes it: the record
is done, its key is released and the next record of that key may start.

The same object is the `ctx` a user function receives: `current_key`, `timestamp`,
`emit(value)`, `timer_service`, valid until the record finishes.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, NoReturn, TypeVar

from asyncstate.errors import InvalidStateError

if TYPE_CHECKING:
    from asyncstate.runtime.epoch import Epoch
    from asyncstate.runtime.future import StateFuture

__all__ = ["RecordContext", "current_context", "set_current_context"]

R = TypeVar("R")

_CURRENT: Final[contextvars.ContextVar[RecordContext | None]] = contextvars.ContextVar(
    "asyncstate_current_record", default=None)

current_context: Final = _CURRENT.get  # compiled: Final alias
"""The RecordContext of the record whose code is running, or None."""


def set_current_context(ctx: RecordContext | None) -> None:
    """Make `ctx` the current record context in the running contextvars context."""
    _CURRENT.set(ctx)


class RecordContext:
    """A record in flight: its key (and canonical bytes), key group, references and epoch.

    Equality is identity. `retain()` / `release()` adjust the reference count; reaching zero
    while the key is held disposes the context through the controller.
    """

    __slots__ = ("_disposer", "_owner", "_timestamp", "blocked", "entered", "epoch",
                 "failures", "finished", "in_flight", "key", "key_bytes", "key_group",
                 "key_occupied", "namespaces", "priority", "record", "ref_count", "serial",
                 "started_at", "storage_key", "time_domain", "vars")

    def __init__(self, record: Any, key: Any, key_bytes: bytes, key_group: int,
                 disposer: Callable[[RecordContext], None] | None,
                 timestamp: int | None = None, priority: int = 0, *,
                 operator: Any = None) -> None:
        self.record = record
        self.key = key
        self.key_bytes = key_bytes
        self.key_group = key_group
        self.ref_count = 0
        self.key_occupied = False
        self.in_flight = False
        self.finished = False
        self.entered = False
        self.blocked = 0  # requests of this context waiting in a blocking queue
        # When it took its key (time.monotonic()), if its controller times records.
        self.started_at = 0.0
        self.epoch: Epoch | None = None
        self.namespaces: dict[Any, bytes] | None = None
        self.failures: list[StateFuture[Any]] | None = None
        # Last pending read-modify-write per state (reducing/aggregating add), so later
        # calls of the same record on that state wait for it.
        self.serial: dict[Any, StateFuture[Any]] | None = None
        self.vars: contextvars.Context | None = None
        # A byte-keyed backend's storage key for this key in the default namespace, built by
        # the record's first request and shared by the rest (see RocksDBBackend).
        self.storage_key: bytes | None = None
        self._timestamp = timestamp
        self.time_domain: Any = None
        self.priority = priority
        self._disposer = disposer
        self._owner = operator

    def __repr__(self) -> str:
        return (f"<RecordContext key={self.key!r} key_group={self.key_group} "
                f"ref_count={self.ref_count} occupied={self.key_occupied} "
                f"epoch={None if self.epoch is None else self.epoch.epoch_id}>")

    # -- reference counting ----------------------------------------------------------------

    def retain(self) -> int:
        """Add a reference; returns the new count."""
        self.ref_count += 1
        return self.ref_count

    def release(self) -> int:
        """Drop a reference; at zero a context holding its key is disposed."""
        count = self.ref_count - 1
        if count < 0:
            raise InvalidStateError(f"{self!r} released more often than retained")
        self.ref_count = count
        if count == 0 and self.key_occupied and self._disposer is not None:
            self._disposer(self)
        return count

    def release_to_zero(self) -> None:
        """The count just dropped to zero (by an inlined release): dispose if holding the key."""
        if self.key_occupied and self._disposer is not None:
            self._disposer(self)

    # -- contextvars ---------------------------------------------------------------------

    def run(self, fn: Callable[..., R], *args: Any) -> R:
        """Run fn(*args) inside this record's contextvars context (entering it if needed)."""
        if self.entered or self.vars is None:
            return fn(*args)
        self.entered = True
        try:
            return self.vars.run(fn, *args)
        finally:
            self.entered = False

    def note_failure(self, future: StateFuture[Any]) -> None:
        """Remember a failed future; unobserved at the end of the record, it fails the run."""
        if self.failures is None:
            self.failures = [future]
        else:
            self.failures.append(future)

    def unobserved_failure(self) -> BaseException | None:
        """The first noted failure nobody looked at, if any."""
        if self.failures:
            for fut in self.failures:
                if not fut._observed:
                    return fut._exception
        return None

    # -- the user-facing per-record context ----------------------------------------------

    @property
    def operator(self) -> Any:
        """The operator running this record (None for a context built by a bare controller)."""
        return self._owner

    def _check(self) -> Any:
        if self.finished:
            raise InvalidStateError(
                f"the context of the record with key {self.key!r} was used after that record "
                "finished; use ctx only inside its own process_element/on_timer")
        owner = self._owner
        if owner is None:
            raise InvalidStateError("this record context is not attached to an operator")
        return owner

    @property
    def current_key(self) -> Any:
        """The key of the record being processed."""
        if self.finished:
            self._check()
        return self.key

    @property
    def timestamp(self) -> int | None:
        """The record's event time in milliseconds, or None."""
        if self.finished:
            self._check()
        return self._timestamp

    def emit(self, value: Any) -> None:
        """Emit an output value."""
        self._check().emit(value)

    @property
    def timer_service(self) -> Any:
        """The timer service, for this record's key."""
        return self._check().timer_service_for(self)

    @property
    def timer_namespace(self) -> Any:
        """In on_timer: the namespace the firing timer was registered with (None: the
        default); None outside on_timer."""
        return self._check().timer_namespace_for(self)

    # States are declared once, in open(): a record's context cannot create them. These
    # name the place instead of failing with a bare AttributeError.

    def get_state(self, descriptor: Any) -> NoReturn:
        _declare_in_open("get_state", descriptor)

    def get_list_state(self, descriptor: Any) -> NoReturn:
        _declare_in_open("get_list_state", descriptor)

    def get_map_state(self, descriptor: Any) -> NoReturn:
        _declare_in_open("get_map_state", descriptor)

    def get_reducing_state(self, descriptor: Any) -> NoReturn:
        _declare_in_open("get_reducing_state", descriptor)

    def get_aggregating_state(self, descriptor: Any) -> NoReturn:
        _declare_in_open("get_aggregating_state", descriptor)

    def get_operator_list_state(self, name: Any) -> NoReturn:
        _declare_in_open("get_operator_list_state", name)

    def get_union_list_state(self, name: Any) -> NoReturn:
        _declare_in_open("get_union_list_state", name)


def _declare_in_open(method: str, descriptor: Any) -> NoReturn:
    """`descriptor`: a state descriptor, or an operator state's name."""
    name = descriptor if isinstance(descriptor, str) else getattr(descriptor, "name", None)
    state = f"state {name!r}" if isinstance(name, str) else "a state"
    raise InvalidStateError(
        f"ctx.{method}() was called on a record's context, for {state}: states are declared "
        f"in open(ctx), on the runtime context it receives (self.s = ctx.{method}(...)), "
        "and used from process_element and on_timer through that attribute")
