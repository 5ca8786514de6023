"""asyncstate: asynchronous keyed state for Python, in the style of Flink 2.0.

State calls return futures; a controller keeps each key's records in arrival order while
the state requests of many keys go to the backend together in batches.
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING

from asyncstate._compiled import select as _select_implementation

# Compiled modules or their Python sources: decided before the first of them is imported.
_select_implementation()

# `asyncstate.logging.configure(...)` works after `import asyncstate`.
import asyncstate.logging as logging  # noqa: F401 - a submodule, not in __all__
from asyncstate.backends.heap import HeapBackend as HeapBackend
from asyncstate.backends.remote import SimulatedRemoteBackend as SimulatedRemoteBackend
from asyncstate.checkpoint.format import checkpoint_path as checkpoint_path
from asyncstate.clock import ManualClock as ManualClock
from asyncstate.config import AsyncStateConfig as AsyncStateConfig
from asyncstate.errors import AsyncStateError as AsyncStateError
from asyncstate.errors import BackendError as BackendError
from asyncstate.errors import CheckpointError as CheckpointError
from asyncstate.errors import ConfigError as ConfigError
from asyncstate.errors import InjectedFailure as InjectedFailure
from asyncstate.errors import InvalidStateError as InvalidStateError
from asyncstate.errors import KeyGroupError as KeyGroupError
from asyncstate.errors import RecordTimeoutError as RecordTimeoutError
from asyncstate.errors import SerializationError as SerializationError
from asyncstate.function import KeyedProcessFunction as KeyedProcessFunction
from asyncstate.function import RuntimeContext as RuntimeContext
from asyncstate.function import TimeDomain as TimeDomain
from asyncstate.keygroups import KeyGroupRange as KeyGroupRange
from asyncstate.keygroups import assign_to_key_group as assign_to_key_group
from asyncstate.keygroups import (
    compute_key_group_range_for_operator_index as compute_key_group_range_for_operator_index,
)
from asyncstate.keygroups import (
    compute_operator_index_for_key_group as compute_operator_index_for_key_group,
)
from asyncstate.keygroups import operator_index_for_key as operator_index_for_key
from asyncstate.operator import KeyedOperator as KeyedOperator
from asyncstate.operator import run as run
from asyncstate.runtime.context import RecordContext as RecordContext
from asyncstate.runtime.controller import AsyncExecutionController as AsyncExecutionController
from asyncstate.runtime.future import StateFuture as StateFuture
from asyncstate.runtime.future import combine_all as combine_all
from asyncstate.runtime.future import completed_future as completed_future
from asyncstate.runtime.future import completed_void_future as completed_void_future
from asyncstate.runtime.requests import StateRequestType as StateRequestType
from asyncstate.state.descriptors import AggregateFunction as AggregateFunction
from asyncstate.state.descriptors import AggregatingStateDescriptor as AggregatingStateDescriptor
from asyncstate.state.descriptors import ListStateDescriptor as ListStateDescriptor
from asyncstate.state.descriptors import MapStateDescriptor as MapStateDescriptor
from asyncstate.state.descriptors import ReducingStateDescriptor as ReducingStateDescriptor
from asyncstate.state.descriptors import ValueStateDescriptor as ValueStateDescriptor
from asyncstate.state.iterator import StateIterator as StateIterator
from asyncstate.state.list import ListState as ListState
from asyncstate.state.map import MapState as MapState
from asyncstate.state.merging import AggregatingState as AggregatingState
from asyncstate.state.merging import ReducingState as ReducingState
from asyncstate.state.operator_state import OperatorListState as OperatorListState
from asyncstate.state.ttl.config import StateTtlConfig as StateTtlConfig
from asyncstate.state.ttl.config import StateVisibility as StateVisibility
from asyncstate.state.ttl.config import TtlTimeCharacteristic as TtlTimeCharacteristic
from asyncstate.state.ttl.config import UpdateType as UpdateType
from asyncstate.state.value import ValueState as ValueState

if _TYPE_CHECKING:
    from asyncstate.backends.rocksdb import RocksDBBackend as RocksDBBackend
    from asyncstate.backends.rocksdb import RocksDBOptions as RocksDBOptions

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # The RocksDB backend needs the optional `rocksdict` package (extra "rocksdb"): import
    # it on first use so that `import asyncstate` works without it.
    if name in ("RocksDBBackend", "RocksDBOptions"):
        try:
            from asyncstate.backends import rocksdb
        except ImportError as exc:
            raise ImportError(
                f"ast.{name} needs the rocksdict package: pip install 'asyncstate[rocksdb]'"
            ) from exc
        return getattr(rocksdb, name)
    raise AttributeError(f"module 'asyncstate' has no attribute {name!r}")


__all__ = [
    "AggregateFunction",
    "AggregatingState",
    "AggregatingStateDescriptor",
    "AsyncExecutionController",
    "AsyncStateConfig",
    "AsyncStateError",
    "BackendError",
    "CheckpointError",
    "ConfigError",
    "HeapBackend",
    "InjectedFailure",
    "InvalidStateError",
    "KeyGroupError",
    "KeyGroupRange",
    "KeyedOperator",
    "KeyedProcessFunction",
    "ListState",
    "ListStateDescriptor",
    "ManualClock",
    "MapState",
    "MapStateDescriptor",
    "OperatorListState",
    "RecordContext",
    "RecordTimeoutError",
    "ReducingState",
    "ReducingStateDescriptor",
    "RocksDBBackend",
    "RocksDBOptions",
    "RuntimeContext",
    "SerializationError",
    "SimulatedRemoteBackend",
    "StateFuture",
    "StateIterator",
    "StateRequestType",
    "StateTtlConfig",
    "StateVisibility",
    "TimeDomain",
    "TtlTimeCharacteristic",
    "UpdateType",
    "ValueState",
    "ValueStateDescriptor",
    "assign_to_key_group",
    "checkpoint_path",
    "combine_all",
    "completed_future",
    "completed_void_future",
    "compute_key_group_range_for_operator_index",
    "compute_operator_index_for_key_group",
    "operator_index_for_key",
    "run",
]
