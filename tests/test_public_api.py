"""The public surface promised by API.md: names and `__all__`."""

from __future__ import annotations

import enum
import types

import pytest
from shared_functions import Sum

import asyncstate as ast

# Every name the API contract promises from `asyncstate` (asyncstate.spark: test_spark_api).
PROMISED = [
    # errors
    "AsyncStateError", "SerializationError", "CheckpointError", "KeyGroupError",
    "InvalidStateError", "InjectedFailure", "ConfigError",
    # futures
    "StateFuture", "completed_future", "completed_void_future", "combine_all",
    # descriptors and states
    "ValueStateDescriptor", "ListStateDescriptor", "MapStateDescriptor",
    "ReducingStateDescriptor", "AggregatingStateDescriptor", "AggregateFunction",
    "ValueState", "ListState", "MapState", "ReducingState", "AggregatingState", "StateIterator",
    # functions and running
    "KeyedProcessFunction", "RuntimeContext", "TimeDomain", "AsyncStateConfig", "run",
    "KeyedOperator", "ManualClock",
    # backends
    "HeapBackend", "SimulatedRemoteBackend", "RocksDBBackend", "checkpoint_path",
    # controller
    "AsyncExecutionController", "RecordContext", "StateRequestType",
    # key groups
    "assign_to_key_group", "KeyGroupRange", "compute_key_group_range_for_operator_index",
    "compute_operator_index_for_key_group",
    # TTL
    "StateTtlConfig", "UpdateType", "StateVisibility", "TtlTimeCharacteristic",
]

# FLINK_AEC_REFERENCE.md §4: StateRequestType in Flink 2.0's declaration order.
FLINK_REQUEST_TYPES = [
    "SYNC_POINT", "CLEAR", "VALUE_GET", "VALUE_UPDATE", "LIST_GET", "LIST_ADD", "LIST_UPDATE",
    "LIST_ADD_ALL", "MAP_GET", "MAP_CONTAINS", "MAP_PUT", "MAP_PUT_ALL", "MAP_ITER",
    "MAP_ITER_KEY", "MAP_ITER_VALUE", "MAP_REMOVE", "MAP_IS_EMPTY", "ITERATOR_LOADING",
    "REDUCING_GET", "REDUCING_ADD", "AGGREGATING_GET", "AGGREGATING_ADD",
]


@pytest.mark.parametrize("name", PROMISED)
def test_promised_name_is_importable_and_exported(name):
    namespace: dict[str, object] = {}
    exec(f"from asyncstate import {name}", namespace)
    assert namespace[name] is getattr(ast, name)
    assert name in ast.__all__


def test_all_is_sorted_and_lists_exactly_the_public_names():
    # RocksDB names load on first use (optional dependency), so they join after a lookup.
    lazy = {"RocksDBBackend", "RocksDBOptions"}
    public = {name for name, value in vars(ast).items()
              if not name.startswith("_") and not isinstance(value, types.ModuleType)} | lazy
    assert ast.__all__ == sorted(ast.__all__)
    assert len(ast.__all__) == len(set(ast.__all__))
    assert set(ast.__all__) == public
    for name in ast.__all__:
        assert getattr(ast, name) is not None


def test_state_request_type_has_flinks_members_in_flinks_order():
    assert issubclass(ast.StateRequestType, enum.Enum)
    assert [m.name for m in ast.StateRequestType] == FLINK_REQUEST_TYPES


def test_time_domain_members():
    assert {m.name for m in ast.TimeDomain} == {"EVENT_TIME", "PROCESSING_TIME"}
    assert ast.TimeDomain.EVENT_TIME is not ast.TimeDomain.PROCESSING_TIME


def test_future_helpers_work_without_a_loop():
    assert ast.completed_future(5).result() == 5
    assert ast.completed_void_future().result() is None
    combined = ast.combine_all([ast.completed_future(1), ast.completed_future("b")])
    assert combined.done() and combined.result() == [1, "b"]
    assert ast.completed_future(2).then_apply(lambda v: v * 3).result() == 6
    assert isinstance(ast.completed_future(1), ast.StateFuture)


def test_descriptors_and_aggregate_function_base():
    descriptors = [ast.ValueStateDescriptor("v"), ast.ListStateDescriptor("l"),
                   ast.MapStateDescriptor("m"), ast.ReducingStateDescriptor("r", max),
                   ast.AggregatingStateDescriptor("a", Sum())]
    assert [d.name for d in descriptors] == ["v", "l", "m", "r", "a"]
    for d in descriptors:
        assert callable(d.enable_time_to_live)
