"""The error classes: one hierarchy, the context each error names, pickling."""

from __future__ import annotations

import asyncio
import pickle

import pytest

import asyncstate as ast

ERRORS = ["SerializationError", "CheckpointError", "KeyGroupError", "InvalidStateError",
          "InjectedFailure", "ConfigError"]


@pytest.mark.parametrize("name", ERRORS)
def test_errors_derive_from_async_state_error(name):
    cls = getattr(ast, name)
    assert issubclass(cls, ast.AsyncStateError)
    assert issubclass(ast.AsyncStateError, Exception)


def test_config_error_is_also_a_value_error():
    assert issubclass(ast.ConfigError, ValueError)
    with pytest.raises(ValueError):
        ast.AsyncStateConfig(batch_size=0)


def _real_errors():
    """One error of each kind, raised by the library itself where it can be provoked."""
    errors = {}
    try:
        ast.AsyncStateConfig(max_in_flight=0)
    except ast.ConfigError as exc:
        errors["config"] = exc

    class Fn(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.v = ctx.get_state(ast.ValueStateDescriptor("the_state"))

        def process_element(self, value, ctx):
            self.v.update({1, 2})

    try:
        ast.run(Fn(), [1], key_selector=lambda r: r)
    except ast.SerializationError as exc:
        errors["serialization"] = exc

    class Counter(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

        def process_element(self, value, ctx):
            return self.v.value()

    try:
        ast.run(Counter(), [1], key_selector=lambda r: r,
                backend=ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0,
                                                   failure_probability=1.0))
    except ast.InjectedFailure as exc:
        errors["injected"] = exc
    try:
        ast.StateFuture().result()  # a pending future's result()
    except ast.InvalidStateError as exc:
        errors["invalid_state"] = exc
    foreign = next(k for k in range(1000) if ast.compute_operator_index_for_key_group(
        128, 2, ast.assign_to_key_group(k, 128)) == 1)

    async def key_group_error():
        async with ast.KeyedOperator(Counter(), key_selector=lambda r: r,
                                     backend=ast.HeapBackend(), parallelism=2,
                                     operator_index=0) as op:
            await op.process(foreign)

    try:
        asyncio.run(key_group_error())
    except ast.KeyGroupError as exc:
        errors["key_group"] = exc
    errors["checkpoint"] = ast.CheckpointError("checkpoint 3 is missing part-2-1",
                                               path="/ckpt/chk-3/part-2-1")
    return errors


def test_errors_carry_context_and_name_it():
    errors = _real_errors()
    assert set(errors) == {"config", "serialization", "injected", "invalid_state", "key_group",
                           "checkpoint"}
    config = errors["config"]
    assert config.option == "max_in_flight"
    assert "max_in_flight" in str(config)
    ser = errors["serialization"]
    assert (ser.state_name, ser.type_name) == ("the_state", "set")
    assert "the_state" in str(ser) and "set" in str(ser)
    kg = errors["key_group"]
    assert isinstance(kg.key_group, int)
    assert str(kg.key_group) in str(kg)
    assert errors["checkpoint"].path == "/ckpt/chk-3/part-2-1"


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_errors_survive_pickling_with_their_attributes(protocol):
    for kind, exc in _real_errors().items():
        clone = pickle.loads(pickle.dumps(exc, protocol=protocol))
        assert type(clone) is type(exc), kind
        assert str(clone) == str(exc), kind
        assert clone.args == exc.args, kind
        for attr in ("option", "state_name", "type_name", "key_group", "path"):
            if hasattr(exc, attr):
                assert getattr(clone, attr) == getattr(exc, attr), (kind, attr)


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_an_error_holding_a_value_that_does_not_pickle_travels_with_its_repr(protocol):
    # The value a ConfigError rejected can be anything, a lambda among them.
    with pytest.raises(ast.ConfigError) as caught:
        ast.ValueStateDescriptor("v").enable_time_to_live(lambda: 10)  # type: ignore[arg-type]
    exc = caught.value
    clone = pickle.loads(pickle.dumps(exc, protocol=protocol))
    assert type(clone) is ast.ConfigError
    assert str(clone) == str(exc)
    assert (clone.option, clone.rule) == (exc.option, exc.rule)
    assert clone.value == repr(exc.value)
    assert isinstance(clone, ValueError)

