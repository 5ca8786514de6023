"""Bad input gets a clear error naming what was wrong: SimulatedRemoteBackend options, state
descriptors, declaring states through the RuntimeContext, operator list state, and the
KeyedOperator's own arguments."""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from shared_functions import Sum

import asyncstate as ast
from asyncstate.state.operator_state import OperatorListState, RedistributionMode

# Not lists: str, bytes and mappings are iterable but rejected; 5 and None are not iterable
# at all (the compiled module once answered those with a type check of its own).
_NON_LISTS = ["abc", b"abc", {"a": 1}, 5, None]


def _config_error(option: str, value: Any, rule: str) -> str:
    """The anchored regex of ConfigError's message: ``<option> must be <rule>, got <value!r>``."""
    return rf"^{re.escape(option)} must be {re.escape(rule)}, got {re.escape(repr(value))}$"


# -- SimulatedRemoteBackend ---------------------------------------------------------------


class _NotABackend:
    execute_batch = None  # present but not callable


@pytest.mark.parametrize("inner", [None, "heap", {}, _NotABackend()],
                         ids=["None", "str", "dict", "non-callable-execute_batch"])
def test_remote_backend_rejects_an_inner_that_is_not_a_backend(inner):
    name = type(inner).__name__
    with pytest.raises(TypeError, match=rf"^inner must be a state backend, got {name}$"):
        ast.SimulatedRemoteBackend(inner, latency_ms=0)


def test_remote_backend_rejects_a_backend_class_rather_than_an_instance():
    with pytest.raises(TypeError,
                       match=r"^inner must be a state backend, got the class HeapBackend$"):
        ast.SimulatedRemoteBackend(ast.HeapBackend, latency_ms=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [True, False, "5", None, [1], -1, -0.5, float("nan"),
                                 float("-inf"), float("inf")], ids=repr)
def test_remote_backend_rejects_bad_latency_ms(bad):
    with pytest.raises(ast.ConfigError,
                       match=_config_error("latency_ms", bad, "a finite number >= 0")) as info:
        ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=bad)
    assert isinstance(info.value, ValueError)
    assert info.value.option == "latency_ms"


@pytest.mark.parametrize("bad", [0, -1, True, False, 1.0, 2.5, "2", None], ids=repr)
def test_remote_backend_rejects_bad_io_parallelism(bad):
    with pytest.raises(ast.ConfigError,
                       match=_config_error("io_parallelism", bad, "an int >= 1")) as info:
        ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0, io_parallelism=bad)
    assert info.value.option == "io_parallelism"


@pytest.mark.parametrize("bad", [-1, "0", None, 0.0, False, 1.5], ids=repr)
def test_remote_backend_rejects_bad_cache_entries(bad):
    with pytest.raises(ast.ConfigError,
                       match=_config_error("cache_entries", bad, "an int >= 0")) as info:
        ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0, cache_entries=bad)
    assert info.value.option == "cache_entries"


@pytest.mark.parametrize("cache_entries", [1, 1000])
def test_remote_backend_cache_entries_sizes_its_cache(cache_entries):
    backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0,
                                         cache_entries=cache_entries)
    assert backend.state_cache is not None and backend.state_cache.capacity == cache_entries


@pytest.mark.parametrize("bad", [-0.1, 1.5, 2, -1, True, False, float("nan"), float("inf"),
                                 "0.5", None], ids=repr)
def test_remote_backend_rejects_bad_failure_probability(bad):
    with pytest.raises(ast.ConfigError, match=_config_error(
            "failure_probability", bad, "in [0.0, 1.0]")) as info:
        ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0, failure_probability=bad)
    assert isinstance(info.value, ValueError)
    assert info.value.option == "failure_probability"


@pytest.mark.parametrize(("latency_ms", "io_parallelism", "failure_probability"), [
    (0, 1, 0.0),
    (0.0, 2, 0),
    (2.5, 8, 0.5),
    (3, 1, 1),
    (10**6, 64, 1.0),
])
def test_remote_backend_accepts_valid_options(latency_ms, io_parallelism, failure_probability):
    inner = ast.HeapBackend()
    backend = ast.SimulatedRemoteBackend(inner, latency_ms=latency_ms,
                                         io_parallelism=io_parallelism, cache_entries=0,
                                         failure_probability=failure_probability, seed=7)
    assert backend.inner is inner
    assert backend.latency_ms == float(latency_ms)
    assert type(backend.latency_ms) is float
    assert backend.io_parallelism == io_parallelism
    assert backend.failure_probability == float(failure_probability)


# -- descriptors --------------------------------------------------------------------------


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
                       match=_config_error("name", bad, "a non-empty str")) as info:
        make(bad)
    assert info.value.option == "name"
    assert info.value.value == bad


UNSTORABLE_NAMES = [
    pytest.param("a\x00b", "a str without NUL characters", id="nul"),
    pytest.param("\x00", "a str without NUL characters", id="only-nul"),
    pytest.param("count\ud800", "a str that encodes to UTF-8 (it holds a lone surrogate)",
                 id="lone-surrogate"),
]


@pytest.mark.parametrize("make", DESCRIPTOR_FACTORIES)
@pytest.mark.parametrize(("bad", "rule"), UNSTORABLE_NAMES)
def test_descriptor_rejects_a_name_no_backend_or_checkpoint_can_store(make, bad, rule):
    # RocksDB column families and checkpoints store names as UTF-8 without NUL: refused at
    # the declaration, on every backend, not later by one of them.
    with pytest.raises(ast.ConfigError, match=_config_error("name", bad, rule)) as info:
        make(bad)
    assert info.value.option == "name"


class _Names(enum.StrEnum):
    COUNT = "count"


@pytest.mark.parametrize("make", DESCRIPTOR_FACTORIES)
def test_descriptor_takes_a_str_enum_name_as_its_plain_str(make):
    descriptor = make(_Names.COUNT)
    assert descriptor.name == "count"
    assert type(descriptor.name) is str


@pytest.mark.parametrize("make", DESCRIPTOR_FACTORIES)
def test_descriptor_keeps_a_valid_name_and_starts_without_ttl(make):
    descriptor = make("count")
    assert descriptor.name == "count"
    assert descriptor.ttl_config is None


@pytest.mark.parametrize("bad", [None, 5, "max", [max]], ids=repr)
def test_reducing_descriptor_rejects_a_non_callable_reduce_fn(bad):
    with pytest.raises(ast.ConfigError, match=_config_error(
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
                       match=_config_error("aggregate_function", function, rule)) as info:
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
                       match=_config_error("ttl_config", None, "a StateTtlConfig")) as info:
        descriptor.enable_time_to_live(None)
    assert info.value.option == "ttl_config"
    assert descriptor.ttl_config is None
    ttl = object()
    descriptor.enable_time_to_live(ttl)
    assert descriptor.ttl_config is ttl


def test_descriptor_ttl_keyword_enables_time_to_live():
    ttl = object()
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


# -- RuntimeContext: declaring keyed state ------------------------------------------------


class _Declares(ast.KeyedProcessFunction):
    """A function whose open() runs `declare(ctx)` and keeps what it returned."""

    def __init__(self, declare: Callable[[ast.RuntimeContext], Any]) -> None:
        self.declare = declare
        self.declared: Any = None

    def open(self, ctx):
        self.declared = self.declare(ctx)

    def process_element(self, value, ctx):
        return None


async def _open(declare: Callable[[ast.RuntimeContext], Any]) -> Any:
    """Start and close a KeyedOperator (HeapBackend) whose open() runs `declare(ctx)`;
    return what it returned. Errors raised by `declare` escape `async with`."""
    fn = _Declares(declare)
    async with ast.KeyedOperator(fn, key_selector=lambda r: r, backend=ast.HeapBackend()):
        pass
    return fn.declared


@pytest.mark.parametrize(("method", "descriptor", "expected"), [
    ("get_state", ast.ListStateDescriptor("s"), "ValueStateDescriptor"),
    ("get_list_state", ast.ValueStateDescriptor("s"), "ListStateDescriptor"),
    ("get_map_state", ast.ListStateDescriptor("s"), "MapStateDescriptor"),
    ("get_reducing_state", ast.AggregatingStateDescriptor("s", Sum()),
     "ReducingStateDescriptor"),
    ("get_aggregating_state", ast.ReducingStateDescriptor("s", max),
     "AggregatingStateDescriptor"),
    ("get_state", "s", "ValueStateDescriptor"),
], ids=lambda v: v if isinstance(v, str) else type(v).__name__)
async def test_get_state_with_the_wrong_descriptor_type_names_both_types(method, descriptor,
                                                                         expected):
    got = type(descriptor).__name__
    with pytest.raises(TypeError, match=rf"^expected a {expected}, got {got}$"):
        await _open(lambda ctx: getattr(ctx, method)(descriptor))


@pytest.mark.parametrize(("first", "second", "first_kind", "second_kind"), [
    (lambda ctx: ctx.get_state(ast.ValueStateDescriptor("x")),
     lambda ctx: ctx.get_list_state(ast.ListStateDescriptor("x")), "value", "list"),
    (lambda ctx: ctx.get_map_state(ast.MapStateDescriptor("x")),
     lambda ctx: ctx.get_state(ast.ValueStateDescriptor("x")), "map", "value"),
    (lambda ctx: ctx.get_reducing_state(ast.ReducingStateDescriptor("x", max)),
     lambda ctx: ctx.get_aggregating_state(ast.AggregatingStateDescriptor("x", Sum())),
     "reducing", "aggregating"),
], ids=["value-then-list", "map-then-value", "reducing-then-aggregating"])
async def test_redeclaring_a_state_as_another_kind_names_it_and_both_kinds(
        first, second, first_kind, second_kind):
    def declare(ctx):
        first(ctx)
        second(ctx)

    with pytest.raises(ValueError, match=rf"^state 'x' is already declared as {first_kind} "
                                         rf"state, cannot declare it again as {second_kind} "
                                         rf"state$"):
        await _open(declare)


async def test_redeclaring_a_state_with_the_same_kind_returns_the_same_state():
    def declare(ctx):
        v1 = ctx.get_state(ast.ValueStateDescriptor("v"))
        v2 = ctx.get_state(ast.ValueStateDescriptor("v"))
        descriptor = ast.ListStateDescriptor("l")
        l1 = ctx.get_list_state(descriptor)
        l2 = ctx.get_list_state(descriptor)
        return v1, v2, l1, l2, ctx.states

    v1, v2, l1, l2, states = await _open(declare)
    assert v1 is v2
    assert l1 is l2
    assert v1 is not l1
    assert states == {"v": v1, "l": l1}


@pytest.mark.parametrize("declare", [
    lambda ctx: ctx.get_state(ast.ValueStateDescriptor("ttl_state", ttl=object())),
    lambda ctx: ctx.get_map_state(ast.MapStateDescriptor("ttl_state", ttl=object())),
    lambda ctx: ctx.get_aggregating_state(
        ast.AggregatingStateDescriptor("ttl_state", Sum(), ttl=object())),
], ids=["value", "map", "aggregating"])
async def test_state_with_ttl_is_not_implemented_and_names_the_state(declare):
    with pytest.raises(NotImplementedError, match=r"^state 'ttl_state' has a TTL config, but "
                                                  r"state TTL is not available in this version "
                                                  r"of asyncstate$"):
        await _open(declare)


async def test_state_with_ttl_from_enable_time_to_live_is_not_declared():
    def declare(ctx):
        descriptor = ast.ListStateDescriptor("expiring")
        descriptor.enable_time_to_live(object())
        with pytest.raises(NotImplementedError, match=r"^state 'expiring' has a TTL config"):
            ctx.get_list_state(descriptor)
        return ctx.states

    assert await _open(declare) == {}


# -- RuntimeContext: declaring operator state ---------------------------------------------


@pytest.mark.parametrize("method", ["get_operator_list_state", "get_union_list_state"])
@pytest.mark.parametrize("bad", ["", None, 3, b"offsets"], ids=repr)
async def test_operator_state_rejects_empty_or_non_str_names(method, bad):
    with pytest.raises(ast.ConfigError,
                       match=_config_error("name", bad, "a non-empty str")) as info:
        await _open(lambda ctx: getattr(ctx, method)(bad))
    assert info.value.option == "name"


@pytest.mark.parametrize("method", ["get_operator_list_state", "get_union_list_state"])
@pytest.mark.parametrize(("bad", "rule"), UNSTORABLE_NAMES)
async def test_operator_state_rejects_a_name_a_checkpoint_cannot_store(method, bad, rule):
    with pytest.raises(ast.ConfigError, match=_config_error("name", bad, rule)):
        await _open(lambda ctx: getattr(ctx, method)(bad))


async def test_operator_state_takes_a_str_enum_name_as_its_plain_str():
    state = await _open(lambda ctx: ctx.get_operator_list_state(_Names.COUNT))
    assert type(state.name) is str and state.name == "count"


@pytest.mark.parametrize(("first", "second", "first_mode", "second_mode"), [
    ("get_operator_list_state", "get_union_list_state", "split", "union"),
    ("get_union_list_state", "get_operator_list_state", "union", "split"),
])
async def test_operator_state_redeclared_with_the_other_mode_names_both_modes(
        first, second, first_mode, second_mode):
    def declare(ctx):
        getattr(ctx, first)("offsets")
        getattr(ctx, second)("offsets")

    with pytest.raises(ValueError, match=rf"^operator state 'offsets' is already declared "
                                         rf"with {first_mode} redistribution, not "
                                         rf"{second_mode}$"):
        await _open(declare)


async def test_operator_state_redeclared_with_the_same_mode_is_the_same_state():
    def declare(ctx):
        return (ctx.get_operator_list_state("a"), ctx.get_operator_list_state("a"),
                ctx.get_union_list_state("b"), ctx.get_union_list_state("b"))

    a1, a2, b1, b2 = await _open(declare)
    assert a1 is a2 and b1 is b2 and a1 is not b1
    assert (a1.mode, b1.mode) == (RedistributionMode.SPLIT, RedistributionMode.UNION)


# -- OperatorListState operations ---------------------------------------------------------


async def _items(state: OperatorListState[Any]) -> list[Any]:
    return await (await state.get()).to_list()


@pytest.mark.parametrize("method", ["get_operator_list_state", "get_union_list_state"])
async def test_operator_list_state_get_add_add_all_update_clear(method):
    state = await _open(lambda ctx: getattr(ctx, method)("offsets"))
    assert isinstance(state, OperatorListState)
    assert await _items(state) == []
    assert (await state.get()).is_empty()

    futures = [state.add(1), state.add_all([(2, "x"), {"k": 3}]), state.add_all([])]
    assert all(f.done() and f.result() is None for f in futures)
    # tuples read back as lists, as on every backend
    assert await _items(state) == [1, [2, "x"], {"k": 3}]

    read = await state.get()
    await state.add("later")
    assert await read.to_list() == [1, [2, "x"], {"k": 3}]  # an iterator is a snapshot

    await state.update(iter(["a", "b"]))
    assert await _items(state) == ["a", "b"]
    await state.update([])
    assert await _items(state) == []
    await state.add_all(x * 2 for x in range(3))
    assert await _items(state) == [0, 2, 4]

    await state.clear()
    assert await _items(state) == []
    assert (await state.get()).is_empty()


async def test_operator_list_state_is_usable_in_open():
    def declare(ctx):
        state = ctx.get_operator_list_state("offsets")
        state.add(1).result()
        state.add_all([2, 3]).result()
        return state.get().result().to_list().result()

    assert await _open(declare) == [1, 2, 3]


@pytest.mark.parametrize("call", ["add_all", "update"])
@pytest.mark.parametrize("bad", _NON_LISTS, ids=repr)
async def test_operator_list_state_rejects_non_lists(call, bad):
    state = await _open(lambda ctx: ctx.get_operator_list_state("offsets"))
    await state.add("kept")
    with pytest.raises(TypeError, match=rf"^{call}\(\) of state 'offsets' expects a list of "
                                        rf"values, got {type(bad).__name__}$"):
        getattr(state, call)(bad)
    assert await _items(state) == ["kept"]


@pytest.mark.parametrize("call", [
    pytest.param(lambda s, v: s.add(v), id="add"),
    pytest.param(lambda s, v: s.add_all([1, v]), id="add_all"),
    pytest.param(lambda s, v: s.update([1, v]), id="update"),
])
@pytest.mark.parametrize(("bad", "type_name"), [({1, 2}, "set"), (object(), "object"),
                                                (2**64, "int")], ids=["set", "object", "int"])
async def test_operator_list_state_rejects_unserializable_values_and_keeps_its_elements(
        call, bad, type_name):
    state = await _open(lambda ctx: ctx.get_union_list_state("seen"))
    await state.add_all(["a", "b"])
    with pytest.raises(ast.SerializationError, match=rf"^value of state 'seen' cannot be "
                                                     rf"encoded with msgpack \({type_name}\)"
                       ) as info:
        call(state, bad)
    assert (info.value.state_name, info.value.type_name) == ("seen", type_name)
    assert await _items(state) == ["a", "b"]


class _ListAll(ast.KeyedProcessFunction):
    """Calls `<call>(bad)` on a keyed ListState; record = (call, bad)."""

    def open(self, ctx):
        self.items = ctx.get_list_state(ast.ListStateDescriptor("items"))

    def process_element(self, value, ctx):
        call, bad = value
        return getattr(self.items, call)(bad)


@pytest.mark.parametrize("call", ["add_all", "update"])
@pytest.mark.parametrize("bad", _NON_LISTS, ids=repr)
def test_keyed_list_state_rejects_non_lists_naming_the_call_and_state(call, bad):
    # The keyed ListState shares stored_list() with OperatorListState.
    with pytest.raises(TypeError, match=rf"^{call}\(\) of state 'items' expects a list of "
                                        rf"values, got {type(bad).__name__}$"):
        ast.run(_ListAll(), [(call, bad)], key_selector=lambda r: r[0])


# -- KeyedOperator arguments --------------------------------------------------------------


class _Noop(ast.KeyedProcessFunction):
    def process_element(self, value: Any, ctx: ast.RecordContext) -> None:
        return None


def _operator(**overrides: Any) -> ast.KeyedOperator:
    arguments: dict[str, Any] = {"key_selector": lambda r: r, "backend": ast.HeapBackend()}
    arguments.update(overrides)
    function = arguments.pop("function", _Noop())
    return ast.KeyedOperator(function, **arguments)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"function": object()},
     r"^function must be a KeyedProcessFunction with process_element\(\), got object$"),
    ({"key_selector": 5}, r"^key_selector must be callable, got int$"),
    ({"timestamp_selector": 3}, r"^timestamp_selector must be callable or None, got int$"),
    ({"backend": object()}, r"^backend must be a state backend \(HeapBackend, RocksDBBackend, "
                            r"\.\.\.\), got object without open\(\), execute_batch\(\), "
                            r"register_state\(\), fully_loaded\(\), close\(\)$"),
    ({"backend": ast.HeapBackend}, r"^backend must be a state backend instance, got the class "
                                   r"HeapBackend \(call it: HeapBackend\(\.\.\.\)\)$"),
    ({"config": {}}, r"^config must be an AsyncStateConfig, got dict$"),
    ({"clock": 5}, r"^clock must be a Clock with now_ms\(\) \(SystemClock, ManualClock\) or "
                   r"None, got int$"),
    ({"restore_from": 5}, r"^restore_from must be a checkpoint path \(str or os\.PathLike\) "
                          r"or None, got int$"),
], ids=["function", "key_selector", "timestamp_selector", "backend", "backend-class", "config",
        "clock", "restore_from"])
def test_keyed_operator_names_a_bad_argument(overrides, message):
    with pytest.raises(TypeError, match=message):
        _operator(**overrides)


async def test_restore_from_accepts_a_path_object(tmp_path):
    class Count(ast.KeyedProcessFunction):
        def open(self, ctx: ast.RuntimeContext) -> None:
            self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

        async def process_element(self, value: Any, ctx: ast.RecordContext) -> None:
            n = (await self.count.value() or 0) + 1
            self.count.update(n)
            ctx.emit((value, n))

    async with _operator(function=Count()) as op:
        for record in (1, 2, 1):
            await op.process(record)
        checkpoint = await op.snapshot(tmp_path, 1)
    restored = _operator(function=Count(), restore_from=Path(checkpoint))
    assert restored.restore_from == checkpoint
    async with restored:
        for record in (1, 2, 3):
            await restored.process(record)
        await restored.drain()
        assert restored.outputs() == [(1, 3), (2, 2), (3, 1)]
