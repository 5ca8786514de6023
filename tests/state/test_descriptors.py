"""State descriptors: names, functions and TTL settings are validated at construction, and
every backend refuses the same state names."""

from __future__ import annotations

from typing import Any

import pytest
from shared_functions import (
    UNSTORABLE_NAMES,
    StrNames,
    Sum,
    config_error_pattern,
)

import asyncstate as ast
from asyncstate.runtime.requests import StateKind


@pytest.mark.parametrize(("name", "error", "message"), [
    ("a\x00b", ast.ConfigError, r"^state name must be a str without NUL characters, got "),
    ("v\udc80", ast.ConfigError, r"^state name must be a str that encodes to UTF-8 "),
    ("", TypeError, r"^state name must be a non-empty str, got ''$"),
    (b"v", TypeError, r"^state name must be a non-empty str, got b'v'$"),
])
def test_every_backend_refuses_the_same_state_names_and_stays_usable(backend, name, error,
                                                                      message):
    try:
        with pytest.raises(error, match=message):
            backend.register_state(name, StateKind.VALUE)
        with pytest.raises(TypeError, match=r"^kind must be a StateKind, got 'value'$"):
            backend.register_state("v", "value")
        first = backend.register_state("v", StateKind.VALUE)
        assert backend.register_state("v", StateKind.VALUE) is first
        with pytest.raises(ValueError, match=r"^state 'v' is already registered as value "):
            backend.register_state("v", StateKind.LIST)
    finally:
        backend.close()


DESCRIPTOR_FACTORIES: list[Any] = [
    pytest.param(lambda name: ast.ValueStateDescriptor(name), id="value"),
    pytest.param(lambda name: ast.ListStateDescriptor(name), id="list"),
    pytest.param(lambda name: ast.MapStateDescriptor(name), id="map"),
    pytest.param(lambda name: ast.ReducingStateDescriptor(name, max), id="reducing"),
    pytest.param(lambda name: ast.AggregatingStateDescriptor(name, Sum()), id="aggregating"),
]


@pytest.mark.parametrize("make", DESCRIPTOR_FACTORIES)
@pytest.mark.parametrize("bad", ["", None, 5, b"count", ["count"]], ids=repr)
def test_descriptor_rejects_empty_or_non_str_names(make, bad):
    with pytest.raises(ast.ConfigError,
                       match=config_error_pattern("name", bad, "a non-empty str")) as info:
        make(bad)
    assert info.value.option == "name"
    assert info.value.value == bad


@pytest.mark.parametrize("make", DESCRIPTOR_FACTORIES)
@pytest.mark.parametrize(("bad", "rule"), UNSTORABLE_NAMES)
def test_descriptor_rejects_a_name_no_backend_or_checkpoint_can_store(make, bad, rule):
    # RocksDB column families and checkpoints store names as UTF-8 without NUL: refused at
    # the declaration, on every backend, not later by one of them.
    with pytest.raises(ast.ConfigError, match=config_error_pattern("name", bad, rule)) as info:
        make(bad)
    assert info.value.option == "name"


@pytest.mark.parametrize("make", DESCRIPTOR_FACTORIES)
def test_descriptor_takes_a_str_enum_name_as_its_plain_str(make):
    descriptor = make(StrNames.COUNT)
    assert descriptor.name == "count"
    assert type(descriptor.name) is str


@pytest.mark.parametrize("make", DESCRIPTOR_FACTORIES)
def test_descriptor_keeps_a_valid_name_and_starts_without_ttl(make):
    descriptor = make("count")
    assert descriptor.name == "count"
    assert descriptor.ttl_config is None


@pytest.mark.parametrize("bad", [None, 5, "max", [max]], ids=repr)
def test_reducing_descriptor_rejects_a_non_callable_reduce_fn(bad):
    with pytest.raises(ast.ConfigError, match=config_error_pattern(
            "reduce_fn", bad, "a callable taking two values")) as info:
        ast.ReducingStateDescriptor("r", bad)
    assert info.value.option == "reduce_fn"


def _aggregate_without(method: str) -> Any:
    """An object with the aggregate-function methods except `method`."""
    methods = {
        "create_accumulator": lambda self: 0,
        "add": lambda self, value, acc: acc + value,
        "get_result": lambda self, acc: acc,
    }
    del methods[method]
    return type(f"No_{method}", (), methods)()


@pytest.mark.parametrize("method", ["create_accumulator", "add", "get_result"])
def test_aggregating_descriptor_names_the_missing_method(method):
    function = _aggregate_without(method)
    rule = f"an object with {method}() (see ast.AggregateFunction)"
    with pytest.raises(ast.ConfigError,
                       match=config_error_pattern("aggregate_function", function, rule)) as info:
        ast.AggregatingStateDescriptor("a", function)
    assert info.value.option == "aggregate_function"
    assert info.value.value is function


def test_aggregating_descriptor_rejects_non_callable_methods_and_plain_values():
    class AddIsData:
        def create_accumulator(self):
            return 0

        add = 3

        def get_result(self, acc):
            return acc

    with pytest.raises(ast.ConfigError, match=r"^aggregate_function must be an object with "
                                              r"add\(\) \(see ast\.AggregateFunction\), got "):
        ast.AggregatingStateDescriptor("a", AddIsData())  # type: ignore[arg-type]
    with pytest.raises(ast.ConfigError, match=r"^aggregate_function must be an object with "
                                              r"create_accumulator\(\) .*, got None$"):
        ast.AggregatingStateDescriptor("a", None)  # type: ignore[arg-type]


@pytest.mark.parametrize("make", DESCRIPTOR_FACTORIES)
def test_enable_time_to_live_rejects_none_and_keeps_a_config(make):
    descriptor = make("s")
    with pytest.raises(ast.ConfigError,
                       match=config_error_pattern("ttl_config", None, "a StateTtlConfig")) as info:
        descriptor.enable_time_to_live(None)
    assert info.value.option == "ttl_config"
    assert descriptor.ttl_config is None
    ttl = ast.StateTtlConfig.new_builder(1000).build()
    descriptor.enable_time_to_live(ttl)
    assert descriptor.ttl_config is ttl


def test_descriptor_ttl_keyword_enables_time_to_live():
    ttl = ast.StateTtlConfig.new_builder(1000).build()
    assert ast.ValueStateDescriptor("v", ttl=ttl).ttl_config is ttl
    assert ast.ReducingStateDescriptor("r", max, ttl=ttl).ttl_config is ttl
    assert ast.AggregatingStateDescriptor("a", Sum(), ttl=ttl).ttl_config is ttl
    assert ast.ListStateDescriptor("l", ttl=None).ttl_config is None


class _OnlyAccumulator(ast.AggregateFunction):
    def create_accumulator(self):
        return 0


@pytest.mark.parametrize(("method", "args"), [
    ("create_accumulator", ()),
    ("add", (1, 0)),
    ("get_result", (0,)),
    ("merge", (0, 0)),
])
def test_aggregate_function_base_methods_name_the_subclass_and_method(method, args):
    with pytest.raises(NotImplementedError,
                       match=rf"^AggregateFunction must implement {method}\(\)$"):
        getattr(ast.AggregateFunction(), method)(*args)
    if method != "create_accumulator":
        with pytest.raises(NotImplementedError,
                           match=rf"^_OnlyAccumulator must implement {method}\(\)$"):
            getattr(_OnlyAccumulator(), method)(*args)
    else:
        assert _OnlyAccumulator().create_accumulator() == 0
