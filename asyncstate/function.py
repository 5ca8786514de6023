"""KeyedProcessFunction, the user's stateful function, and the contexts it sees."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, TypeVar, cast

from asyncstate.checkpoint.operator_state import (
    RestoredExtras,
    carried_share,
    redistribute_even_split,
    redistribute_union,
)
from asyncstate.config import check_state_name
from asyncstate.errors import CheckpointError, ConfigError
from asyncstate.runtime.requests import StateKind
from asyncstate.state.base import InternalState
from asyncstate.state.descriptors import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateDescriptor,
    ValueStateDescriptor,
)
from asyncstate.state.list import ListState
from asyncstate.state.map import MapState
from asyncstate.state.merging import AggregatingState, ReducingState
from asyncstate.state.operator_state import OperatorListState, RedistributionMode
from asyncstate.state.ttl.declare import TtlOperator, bind_layout
from asyncstate.state.value import ValueState

if TYPE_CHECKING:
    from asyncstate.runtime.context import RecordContext
    from asyncstate.runtime.controller import AsyncExecutionController

__all__ = ["KeyedProcessFunction", "RuntimeContext", "TimeDomain"]

S = TypeVar("S", bound=InternalState)
T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")
IN = TypeVar("IN")
OUT = TypeVar("OUT")


class TimeDomain(enum.Enum):
    """The time domain of a firing timer."""

    EVENT_TIME = "event_time"
    PROCESSING_TIME = "processing_time"


class KeyedProcessFunction:
    """Base class of stateful functions.

    `open(ctx)` declares states through the RuntimeContext; `process_element(value, ctx)`
    handles one record (plain def returning None or a StateFuture, or `async def`);
    `on_timer(timestamp, ctx)` and `close()` are optional.

    `needs_task`: None (default) scans `process_element` (and the helpers it names) for
    asyncio APIs that use the current task and, if found, gives every record a real asyncio
    Task from its first line; otherwise a record's coroutine runs without a Task until it
    awaits something other than a state future, with a stand-in current task meanwhile.
    True or False overrides the scan.
    """

    needs_task: bool | None = None

    def open(self, ctx: RuntimeContext) -> None:
        """Declare states; called once before the first record."""

    def process_element(self, value: Any, ctx: RecordContext) -> Any:
        """Process one record."""
        raise NotImplementedError(f"{type(self).__name__} must implement process_element()")

    def close(self) -> None:
        """Called once when the operator closes."""


_STATE_CLASSES: dict[StateKind, type[InternalState]] = {
    StateKind.VALUE: ValueState,
    StateKind.LIST: ListState,
    StateKind.MAP: MapState,
    StateKind.REDUCING: ReducingState,
    StateKind.AGGREGATING: AggregatingState,
}


class RuntimeContext:
    """What `open()` receives: declares keyed states bound to this operator.

    `operator` is the operator running the function: TTL states read its clock or watermark
    (see `asyncstate.state.ttl.declare.TtlOperator`); without one, TTL states are refused.
    """

    def __init__(self, controller: AsyncExecutionController, backend: Any, *,
                 parallelism: int = 1, operator_index: int = 0,
                 restored: RestoredExtras | None = None,
                 operator: TtlOperator | None = None) -> None:
        self._controller = controller
        self._backend = backend
        self._operator = operator
        self._states: dict[str, InternalState] = {}
        self._parallelism = parallelism
        self._operator_index = operator_index
        self._restored_from = restored
        self._restored = restored.operator_parts if restored is not None else {}
        self._operator_states: dict[str, OperatorListState[Any]] = {}

    def __repr__(self) -> str:
        return f"<RuntimeContext states={sorted(self._states)}>"

    def _get(self, descriptor: StateDescriptor, expected: type[StateDescriptor]) -> Any:
        if not isinstance(descriptor, expected):
            raise TypeError(f"expected a {expected.__name__}, got {type(descriptor).__name__}")
        existing = self._states.get(descriptor.name)
        if existing is not None:
            if existing.kind is not descriptor.kind:
                raise ConfigError(
                    "name", descriptor.name, f"the name of one state kind ({existing.kind.value})",
                    message=f"state {descriptor.name!r} is already declared as "
                            f"{existing.kind.value} state, cannot declare it again as "
                            f"{descriptor.kind.value} state")
            return existing
        restored = self._restored_from
        if restored is not None:
            kind = restored.states.get(descriptor.name, descriptor.kind.value)
            if kind != descriptor.kind.value:
                raise CheckpointError(
                    f"state {descriptor.name!r} is declared as {descriptor.kind.value} state, "
                    f"but checkpoint {restored.path!r} holds it as {kind} state; a state keeps "
                    "its kind for the life of the job (declare another name for the new kind)",
                    path=restored.path)
        handle = self._backend.register_state(descriptor.name, descriptor.kind)
        source = (f"checkpoint {restored.path!r}"
                  if restored is not None and descriptor.name in restored.states
                  else f"the {type(self._backend).__name__}")
        state = bind_layout(descriptor, self._controller, self._backend, handle,
                            _STATE_CLASSES[descriptor.kind], operator=self._operator,
                            source=source)
        self._states[descriptor.name] = state
        return state

    def get_state(self, descriptor: ValueStateDescriptor[T]) -> ValueState[T]:
        """The ValueState declared by `descriptor`."""
        return cast(ValueState[T], self._get(descriptor, ValueStateDescriptor))

    def get_list_state(self, descriptor: ListStateDescriptor[T]) -> ListState[T]:
        """The ListState declared by `descriptor`."""
        return cast(ListState[T], self._get(descriptor, ListStateDescriptor))

    def get_map_state(self, descriptor: MapStateDescriptor[K, V]) -> MapState[K, V]:
        """The MapState declared by `descriptor`."""
        return cast(MapState[K, V], self._get(descriptor, MapStateDescriptor))

    def get_reducing_state(self, descriptor: ReducingStateDescriptor[T]) -> ReducingState[T]:
        """The ReducingState declared by `descriptor`."""
        return cast(ReducingState[T], self._get(descriptor, ReducingStateDescriptor))

    def get_aggregating_state(
        self, descriptor: AggregatingStateDescriptor[IN, OUT]
    ) -> AggregatingState[IN, OUT]:
        """The AggregatingState declared by `descriptor`."""
        return cast(AggregatingState[IN, OUT],
                    self._get(descriptor, AggregatingStateDescriptor))

    @property
    def states(self) -> dict[str, InternalState]:
        """States declared so far, by name."""
        return dict(self._states)

    def _operator_state(self, name: str, mode: RedistributionMode) -> OperatorListState[Any]:
        name = check_state_name(name)
        existing = self._operator_states.get(name)
        if existing is not None:
            if existing.mode is not mode:
                raise ConfigError(
                    "name", name, f"the name of one redistribution mode ({existing.mode.value})",
                    message=f"operator state {name!r} is already declared with "
                            f"{existing.mode.value} redistribution, not {mode.value}")
            return existing
        restored = self._restored_from
        if restored is not None:
            restored_mode = restored.operator_modes.get(name)
            if restored_mode is not None and restored_mode != mode.value:
                # As in Flink: a restored operator state keeps its redistribution mode. An
                # instance that does not declare it carries it in that mode, so a checkpoint
                # holding it in two modes could not be restored.
                raise ConfigError(
                    "name", name, f"declared with its restored mode ({restored_mode})",
                    message=f"operator state {name!r} was restored with {restored_mode} "
                            f"redistribution from {restored.path!r} and cannot be declared "
                            f"with {mode.value} redistribution; declare it as before, or use "
                            "another name")
        parts = self._restored.get(name, [])
        if mode is RedistributionMode.UNION:
            items = redistribute_union(parts, self._parallelism, self._operator_index)
        else:
            items = redistribute_even_split(parts, self._parallelism, self._operator_index)
        state: OperatorListState[Any] = OperatorListState(name, mode, items)
        self._operator_states[name] = state
        return state

    def get_operator_list_state(self, name: str) -> OperatorListState[Any]:
        """Non-keyed list state of this instance; split evenly over instances on rescale."""
        return self._operator_state(name, RedistributionMode.SPLIT)

    def get_union_list_state(self, name: str) -> OperatorListState[Any]:
        """Non-keyed list state whose elements every instance receives on restore."""
        return self._operator_state(name, RedistributionMode.UNION)

    def operator_state_snapshot(self) -> dict[str, dict[str, Any]]:
        """Checkpoint form of every operator list state (internal), restored ones this run
        never declared included: they are carried into the checkpoint unchanged."""
        snapshot = {name: state.snapshot() for name, state in self._operator_states.items()}
        restored = self._restored_from
        if restored is not None:
            for name, parts in restored.operator_parts.items():
                if name not in snapshot:
                    mode = restored.operator_modes[name]
                    snapshot[name] = {"mode": mode, "items": carried_share(
                        parts, mode, self._parallelism, self._operator_index)}
        return snapshot

