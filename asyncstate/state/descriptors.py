"""State descriptors: a state's name, kind and functions, declared in `open()`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from asyncstate.config import check_state_name
from asyncstate.errors import ConfigError
from asyncstate.runtime.requests import StateKind
from asyncstate.state.ttl.config import StateTtlConfig, StateTtlConfigBuilder

__all__ = [
    "AggregateFunction",
    "AggregatingStateDescriptor",
    "ListStateDescriptor",
    "MapStateDescriptor",
    "ReducingStateDescriptor",
    "StateDescriptor",
    "ValueStateDescriptor",
]

IN = TypeVar("IN")
ACC = TypeVar("ACC")
OUT = TypeVar("OUT")
IN_contra = TypeVar("IN_contra", contravariant=True)
OUT_co = TypeVar("OUT_co", covariant=True)

# The type parameters of the descriptors default to Any (PEP 696), so that an unparametrized
# `ValueStateDescriptor("count")` declares a `ValueState[Any]`, while
# `ValueStateDescriptor[int]("count")` declares a `ValueState[int]`. Type checkers read the
# defaults; at runtime (Python 3.11's TypeVar has no `default`) plain TypeVars serve.
if TYPE_CHECKING:
    from typing_extensions import TypeVar as _TypeVarWithDefault

    T = _TypeVarWithDefault("T", default=Any)
    K = _TypeVarWithDefault("K", default=Any)
    V = _TypeVarWithDefault("V", default=Any)
    IN_ = _TypeVarWithDefault("IN_", default=Any)
    OUT_ = _TypeVarWithDefault("OUT_", default=Any)
else:
    T = TypeVar("T")
    K = TypeVar("K")
    V = TypeVar("V")
    IN_ = TypeVar("IN_")
    OUT_ = TypeVar("OUT_")


class AggregateFunction(Generic[IN, ACC, OUT]):
    """Incremental aggregation: `create_accumulator`, `add(value, acc)` returning the new
    accumulator, `get_result(acc)` and `merge(a, b)`. Accumulators are stored, so they must
    be msgpack-encodable."""

    def create_accumulator(self) -> ACC:
        """A fresh, empty accumulator."""
        raise NotImplementedError(f"{type(self).__name__} must implement create_accumulator()")

    def add(self, value: IN, accumulator: ACC) -> ACC:
        """Add `value` to `accumulator`; return the new accumulator."""
        raise NotImplementedError(f"{type(self).__name__} must implement add()")

    def get_result(self, accumulator: ACC) -> OUT:
        """The result of an accumulator."""
        raise NotImplementedError(f"{type(self).__name__} must implement get_result()")

    def merge(self, a: ACC, b: ACC) -> ACC:
        """Merge two accumulators."""
        raise NotImplementedError(f"{type(self).__name__} must implement merge()")


class AggregateFunctionLike(Protocol[IN_contra, ACC, OUT_co]):
    """What an AggregatingStateDescriptor needs: the methods of `AggregateFunction`, which
    any object may provide without subclassing it."""

    def create_accumulator(self) -> ACC: ...

    def add(self, value: IN_contra, accumulator: ACC, /) -> ACC: ...

    def get_result(self, accumulator: ACC, /) -> OUT_co: ...

    def merge(self, a: ACC, b: ACC, /) -> ACC: ...


class StateDescriptor:
    """Base of all descriptors: the state's unique name, its kind and TTL config."""

    kind: StateKind

    def __init__(self, name: str, *, ttl: StateTtlConfig | None = None) -> None:
        self.name = check_state_name(name)
        self.ttl_config: StateTtlConfig | None = None
        if ttl is not None:
            self.enable_time_to_live(ttl)

    def enable_time_to_live(self, ttl_config: StateTtlConfig) -> None:
        """Let entries of this state expire according to `ttl_config` (a StateTtlConfig,
        see docs/ttl.md)."""
        given: object = ttl_config
        if isinstance(given, StateTtlConfigBuilder):
            raise ConfigError("ttl_config", given,
                              "a StateTtlConfig (call .build() on the builder)")
        if not isinstance(given, StateTtlConfig):
            raise ConfigError("ttl_config", given, "a StateTtlConfig")
        self.ttl_config = given

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class ValueStateDescriptor(StateDescriptor, Generic[T]):
    """Declares a ValueState: one value per key and namespace. `ValueStateDescriptor[int]`
    declares a `ValueState[int]` for type checkers."""

    kind = StateKind.VALUE


class ListStateDescriptor(StateDescriptor, Generic[T]):
    """Declares a ListState: a list of values per key and namespace (`ListStateDescriptor[T]`:
    a `ListState[T]`)."""

    kind = StateKind.LIST


class MapStateDescriptor(StateDescriptor, Generic[K, V]):
    """Declares a MapState: a map of user keys to values per key and namespace
    (`MapStateDescriptor[K, V]`: a `MapState[K, V]`)."""

    kind = StateKind.MAP


class ReducingStateDescriptor(StateDescriptor, Generic[T]):
    """Declares a ReducingState folding added values with `reduce_fn(a, b)`; its value type
    is that of `reduce_fn`."""

    kind = StateKind.REDUCING

    def __init__(self, name: str, reduce_fn: Callable[[T, T], T], *,
                 ttl: StateTtlConfig | None = None) -> None:
        if not callable(reduce_fn):
            raise ConfigError("reduce_fn", reduce_fn, "a callable taking two values")
        super().__init__(name, ttl=ttl)
        self.reduce_fn = reduce_fn


class AggregatingStateDescriptor(StateDescriptor, Generic[IN_, OUT_]):
    """Declares an AggregatingState driven by an AggregateFunction; its input and result
    types are those of the function."""

    kind = StateKind.AGGREGATING

    def __init__(self, name: str, aggregate_function: AggregateFunctionLike[IN_, Any, OUT_], *,
                 ttl: StateTtlConfig | None = None) -> None:
        for method in ("create_accumulator", "add", "get_result"):
            if not callable(getattr(aggregate_function, method, None)):
                raise ConfigError("aggregate_function", aggregate_function,
                                  f"an object with {method}() (see ast.AggregateFunction)")
        super().__init__(name, ttl=ttl)
        self.aggregate_function = aggregate_function
