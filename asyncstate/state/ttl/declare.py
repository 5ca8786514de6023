"""Declaring a state on an operator when TTL may be involved: which class serves it, what
happens to entries stored with or without timestamps, and which cleanup runs.

It runs once per declared state, in `open()`.

The stored layout of a state (timestamped or not, and the time domain of its timestamps) is
recorded by the backend and by every checkpoint. When a declaration disagrees with it:

- declared without TTL (or with `UpdateType.DISABLED`), stored with timestamps: the
  timestamps are dropped, every value is kept;
- declared with processing-time TTL, stored without timestamps: every entry is stamped with
  the operator clock's time at the declaration (the restore time);
- declared with event-time TTL, stored without timestamps: refused with CheckpointError
  (before the first watermark there is no event time to stamp them with);
- stored with timestamps of the other time characteristic: refused with CheckpointError.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from asyncstate.backends.base import BackendCapabilities, StateExecutor, TtlBackend
from asyncstate.clock import Clock
from asyncstate.errors import CheckpointError, ConfigError, InvalidStateError
from asyncstate.runtime.controller import AsyncExecutionController
from asyncstate.runtime.requests import StateKind
from asyncstate.state.base import InternalState
from asyncstate.state.descriptors import StateDescriptor
from asyncstate.state.ttl.config import StateTtlConfig, StateVisibility, UpdateType
from asyncstate.state.ttl.layout import MAX_TIMESTAMP, MIN_TIMESTAMP, TtlPolicy
from asyncstate.state.ttl.states import (
    EventTime,
    ProcessingTime,
    TtlAggregatingState,
    TtlListState,
    TtlMapState,
    TtlReducingState,
    TtlSupport,
    TtlValueState,
)
from asyncstate.state.ttl.tracker import TimeSource, TtlTracker

if TYPE_CHECKING:
    from asyncstate.state.ttl.timers import TtlTimers

__all__ = ["RecordHooks", "TtlOperator", "bind_layout"]

_TTL_CLASSES: dict[StateKind, type[InternalState]] = {
    StateKind.VALUE: TtlValueState,
    StateKind.LIST: TtlListState,
    StateKind.MAP: TtlMapState,
    StateKind.REDUCING: TtlReducingState,
    StateKind.AGGREGATING: TtlAggregatingState,
}


class RecordHooks(Protocol):
    """Callbacks run when each record starts (`RecordRunner.record_hooks`)."""

    record_hooks: list[Any]


class TtlOperator(Protocol):
    """What TTL needs of the operator declaring the state (a `KeyedOperator`): its clock
    (processing time), its current watermark (event time), the hooks run when each
    record starts (incremental cleanup with run_cleanup_for_every_record) and its cleanup
    timers (cleanup with timers)."""

    clock: Clock

    def current_watermark(self) -> int:
        """The current event-time watermark."""

    @property
    def records(self) -> RecordHooks:
        """The operator's record runner."""

    @property
    def ttl_timers(self) -> TtlTimers:
        """The cleanup timers of the operator's states."""


def bind_layout(descriptor: StateDescriptor, controller: AsyncExecutionController,
                backend: StateExecutor, handle: Any, plain: type[InternalState], *,
                operator: TtlOperator | None, source: str) -> InternalState:
    """The state object serving `descriptor` (registered in `backend` as `handle`): `plain`
    without TTL, a TTL state with it. Reconciles the stored layout first (see the module
    docstring); `source` names where the stored entries came from, for errors."""
    config: StateTtlConfig | None = descriptor.ttl_config
    enabled = config is not None and config.is_enabled
    capabilities = BackendCapabilities.of(backend)
    store = capabilities.ttl
    name = descriptor.name
    if store is None:
        if enabled:
            raise ConfigError(
                "ttl_config", config,
                f"None for state {name!r}: {type(backend).__name__} cannot store TTL state "
                "(it is no TtlBackend; use HeapBackend or RocksDBBackend)")
        return plain(descriptor, controller, handle)
    stored = store.ttl_layouts().get(name)
    if not enabled:
        if stored is not None:
            store.set_ttl_layout(name, None, None)  # drop the timestamps, keep the values
        store.track_ttl(name, None)
        return plain(descriptor, controller, handle)
    assert config is not None
    if operator is None:
        raise InvalidStateError(
            f"state {name!r} has a TTL config, but this RuntimeContext belongs to no operator "
            "(TTL reads the operator's clock or watermark): declare it in the open() of a "
            "function run by ast.KeyedOperator or ast.run")
    for cache in capabilities.caches:  # expiry is decided by the store, at its time
        cache.bypass(name)
    domain = config.ttl_time_characteristic.value
    had_entries = store.has_entries(name)
    _reconcile(store, name, stored, domain, had_entries, operator, source)
    event_time = domain == "event_time"
    time: TimeSource = EventTime(operator) if event_time else ProcessingTime(operator.clock)
    has_cleaner = capabilities.ttl_cleaner is not None
    background = config.effective_compact_filter_cleanup(has_cleaner)
    incremental = config.effective_incremental_cleanup(has_cleaner)
    tracker = TtlTracker(
        name, config.ttl_ms, domain, time, full_snapshot=config.cleanup_full_snapshot,
        background_every=0 if background is None else background.query_time_after_num_entries,
        bound=MIN_TIMESTAMP if had_entries else MAX_TIMESTAMP)
    store.track_ttl(name, tracker)
    policy = TtlPolicy(
        config.ttl_ms, config.update_type is UpdateType.ON_READ_AND_WRITE,
        config.state_visibility is StateVisibility.RETURN_EXPIRED_IF_NOT_CLEANED_UP, True)
    timer_cleanup = config.effective_timer_cleanup()
    timers = None
    if timer_cleanup is not None:
        assert timer_cleanup.granularity_ms is not None
        timers = operator.ttl_timers.declare(name, config.ttl_ms, timer_cleanup.granularity_ms,
                                             event_time=event_time)
    support = TtlSupport(
        name, policy, tracker, event_time=event_time, clock=operator.clock, operator=operator,
        incremental=0 if incremental is None else incremental.cleanup_size, cleaner=store,
        timers=timers)
    if incremental is not None and incremental.run_cleanup_for_every_record:
        operator.records.record_hooks.append(support.record_started)
    state = _TTL_CLASSES[descriptor.kind](  # type: ignore[call-arg]
        descriptor, controller, handle, support)
    if timers is not None:
        timers.bind(state)
    return state


def _reconcile(store: TtlBackend, name: str, stored: str | None, domain: str,
               had_entries: bool, operator: TtlOperator, source: str) -> None:
    """Make the stored layout of state `name` timestamped in `domain` (module docstring)."""
    if stored == domain:
        return
    if stored is not None:
        raise CheckpointError(
            f"state {name!r} of {source} is stored with {stored} timestamps and cannot be "
            f"declared with {domain} TTL: timestamps of one time characteristic mean nothing "
            f"in the other. Declare it with TtlTimeCharacteristic.{stored.upper()}, or "
            "without TTL (which drops the timestamps and keeps the values)")
    stamp = None
    if had_entries:
        if domain == "event_time":
            raise CheckpointError(
                f"state {name!r} of {source} is stored without timestamps, and event-time TTL "
                "has no time to stamp its entries with (before the first watermark there is "
                "no event time): declare it without TTL, or with processing-time TTL (its "
                "entries are then stamped with the restore time)")
        stamp = operator.clock.now_ms()
    store.set_ttl_layout(name, domain, stamp)
