"""Keys and values: canonical-bytes key identity, value round trips, SerializationError."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shared_functions import slow_examples

import asyncstate as ast

V = ast.ValueStateDescriptor
L = ast.ListStateDescriptor
M = ast.MapStateDescriptor


class Counter(ast.KeyedProcessFunction):
    def open(self, ctx):
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    async def process_element(self, value, ctx):
        n = (await self.count.value() or 0) + 1
        await self.count.update(n)
        ctx.emit((value[1], n))


# -- keys ---------------------------------------------------------------------------------


async def test_one_one_point_zero_and_true_are_three_keys(sh):
    records = [(1, "int"), (1.0, "float"), (True, "bool"), (1, "int"), (True, "bool")]
    out = await sh.run(Counter(), records)
    assert sorted(out) == sorted([("int", 1), ("float", 1), ("bool", 1), ("int", 2),
                                  ("bool", 2)])


async def test_list_and_tuple_with_equal_items_are_the_same_key(sh):
    records = [([1, "a"], "list"), ((1, "a"), "tuple"), ([1, "a"], "list"),
               (((1, 2), [3]), "nested-t"), ([[1, 2], (3,)], "nested-l")]
    out = await sh.run(Counter(), records)
    assert sorted(n for tag, n in out if tag in ("list", "tuple")) == [1, 2, 3]
    assert sorted(n for tag, n in out if tag.startswith("nested")) == [1, 2]


async def test_other_scalar_keys_are_distinct(sh):
    keys = [None, 0, 0.0, False, "", b"", "0", b"0", -1, 2**64 - 1, -(2**63), [], [None]]
    records = [(k, repr(k)) for k in keys] * 2
    out = await sh.run(Counter(), records)
    assert sorted(out) == sorted([(repr(k), n) for k in keys for n in (1, 2)])


@pytest.mark.parametrize(("bad_key", "type_name"), [
    pytest.param({"a": 1}, "dict", id="dict"),
    pytest.param([1, {"a": 1}], "dict", id="list-with-dict"),
    pytest.param({1}, "set", id="set"),
    pytest.param(object(), "object", id="object"),
    pytest.param(2**64, "int", id="int-2**64"),
    pytest.param(-(2**63) - 1, "int", id="int-below-min"),
    pytest.param("\ud800", "str", id="lone-surrogate"),
])
async def test_invalid_key_raises_serialization_error_at_process(sh, bad_key, type_name):
    class Fn(ast.KeyedProcessFunction):
        def process_element(self, value, ctx):
            ctx.emit(ctx.current_key)

    async with ast.KeyedOperator(Fn(), key_selector=lambda r: r[0],
                                 backend=sh.backend) as op:
        with pytest.raises(ast.SerializationError) as info:
            await op.process((bad_key, "x"))
        assert info.value.type_name == type_name
        assert type_name in str(info.value)
        # The operator is still usable: a rejected record is not a failure of the run.
        await op.process(("fine", "y"))
        await op.drain()
        assert op.outputs() == ["fine"]


def test_dict_as_key_error_names_dicts():
    class Fn(ast.KeyedProcessFunction):
        def process_element(self, value, ctx):
            pass

    with pytest.raises(ast.SerializationError, match=r"(?i)dict"):
        ast.run(Fn(), [{"a": 1}], key_selector=lambda r: r)


async def test_current_key_is_the_selected_key(sh):
    class Fn(ast.KeyedProcessFunction):
        def process_element(self, value, ctx):
            ctx.emit((value, ctx.current_key))

    records = ["a", 1, 1.0, True, None, b"x", (1, 2)]
    async with ast.KeyedOperator(Fn(), key_selector=lambda r: r, backend=sh.backend) as op:
        for r in records:
            await op.process(r)
        await op.drain()
        out = op.outputs()
    assert sorted(map(repr, out)) == sorted(repr((r, r)) for r in records)
    assert all(type(k) is type(v) for v, k in out)


# -- values -------------------------------------------------------------------------------


ROUND_TRIPS = [
    None, True, False, 0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 1.5, float("inf"), "", "héllo ✓",
    b"\x00\xff", [], [1, [2, [3]]], (1, 2), ((1, (2,)), [3]), {}, {"a": {"b": [1, (2, 3)]}},
    {1: "int key", 2: [3]}, {(1, 2): "tuple key", ("a", ("b",)): 1}, {1: "x", (2, 3): "y"},
    {b"k": b"v", None: 0, 1.5: True},
]


@pytest.mark.parametrize("value", ROUND_TRIPS, ids=[repr(v)[:30] for v in ROUND_TRIPS])
async def test_value_round_trip(sh, value):
    async def step(s, ctx):
        await s.v.update(value)
        await s.l.add(value)
        await s.m.put("k", value)

    async def read(s, ctx):
        got = [await s.v.value(), (await (await s.l.get()).to_list())[0], await s.m.get("k")]
        ctx.emit(got)

    out = await sh.run(sh.AsyncScript(v=V("v"), l=L("l"), m=M("m")), [("k", step), ("k", read)])
    expected = sh.normalize(value)
    if value is None:  # a None value clears value state and map entries
        assert out == [[None, None, None]]
    else:
        assert out == [[expected, expected, expected]]
        assert [type(x) for x in out[0]] == [type(expected)] * 3


async def test_tuples_come_back_as_lists(sh):
    async def step(s, ctx):
        await s.v.update((1, (2, 3), [4, (5,)]))
        got = await s.v.value()
        ctx.emit((got, type(got), type(got[1]), type(got[2][1])))

    out = await sh.run(sh.AsyncScript(v=V("v")), [("k", step)])
    assert out == [([1, [2, 3], [4, [5]]], list, list, list)]


async def test_dict_with_int_and_tuple_keys_round_trips(sh):
    value = {1: "a", (1, 2): "b", "s": {(3,): [(4, 5)]}}

    async def step(s, ctx):
        await s.v.update(value)
        ctx.emit(await s.v.value())

    out = await sh.run(sh.AsyncScript(v=V("v")), [("k", step)])
    assert out == [{1: "a", (1, 2): "b", "s": {(3,): [[4, 5]]}}]
    assert set(out[0]) == {1, (1, 2), "s"}


# -- unencodable values -------------------------------------------------------------------

def _nested_too_deep() -> list:
    """1025 nested lists, the innermost empty: msgpack packs it but reads 1024 levels."""
    v: list = []
    for _ in range(1024):
        v = [v]
    return v


class _HashableDict(dict):
    """Packs as a msgpack map, which no decoder can make a dict key."""

    def __hash__(self):
        return 0


BAD_VALUES = [object(), 2**64, -(2**63) - 1, "\ud800", {1, 2}, [1, object()],
              {"k": {1, 2}}, frozenset({1}), _nested_too_deep(), {_HashableDict(a=1): "x"}]
BAD_IDS = ["object", "int-2**64", "int-below-min", "lone-surrogate", "set", "list-with-object",
           "dict-with-set", "frozenset", "nested-one-level-too-deep", "dict-as-dict-key"]


def _write_calls(s, bad):
    return {
        "v": lambda: s.v.update(bad),
        "l.add": lambda: s.l.add(bad),
        "l.add_all": lambda: s.l.add_all([1, bad]),
        "l.update": lambda: s.l.update([bad]),
        "m.put": lambda: s.m.put("k", bad),
        "m.put_all": lambda: s.m.put_all({"a": 1, "k": bad}),
        "r": lambda: s.r.add(bad),
    }


def _state_of(call_name):
    return call_name.split(".")[0]


def _outer_type(bad):
    """The type a SerializationError names: the value's own (outermost) type."""
    return type(bad).__name__


@pytest.mark.parametrize("bad", BAD_VALUES, ids=BAD_IDS)
async def test_unencodable_value_raises_at_the_call_naming_state_and_type(sh, bad):
    def step(s, ctx):
        for name, call in _write_calls(s, bad).items():
            try:
                call()
            except ast.SerializationError as exc:
                ctx.emit((name, exc.state_name, exc.type_name, str(exc)))
            else:
                ctx.emit((name, "no error"))
        # Nothing was written by the rejected calls.
        return ast.combine_all([
            s.v.value(), s.l.get().then_compose(lambda it: it.to_list()), s.m.is_empty(),
            s.r.get()]).then_accept(ctx.emit)

    descriptors = dict(v=V("v"), l=L("l"), m=M("m"),
                       r=ast.ReducingStateDescriptor("r", lambda a, b: b))
    out = await sh.run(sh.Script(**descriptors), [("k", step)])
    *errors, after = out
    assert after == [None, [], True, None]
    assert [e[0] for e in errors] == list(_write_calls(None, bad))
    for name, state_name, type_name, message in errors:
        assert state_name == _state_of(name), (name, state_name)
        assert f"'{state_name}'" in message, message
        assert type_name in message
        if type(bad) is not list and type(bad) is not dict:
            assert type_name == _outer_type(bad)


async def test_unencodable_value_errors_are_identical_on_every_backend(sh):
    """The same call fails with the same error type, message and attributes everywhere."""

    def step(s, ctx):
        for bad in BAD_VALUES:
            for name, call in _write_calls(s, bad).items():
                try:
                    call()
                except ast.SerializationError as exc:
                    ctx.emit((name, type(exc).__name__, exc.state_name, exc.type_name, str(exc)))

    descriptors = dict(v=V("v"), l=L("l"), m=M("m"),
                       r=ast.ReducingStateDescriptor("r", lambda a, b: b))
    results = {}
    for backend_id, factory in sh.factories.items():
        async with ast.KeyedOperator(sh.Script(**descriptors), key_selector=lambda r: r[0],
                                     backend=factory(None)) as op:
            await op.process(("k", step))
            await op.drain()
            results[backend_id] = op.outputs()
    first, *others = results.values()
    assert len(first) == len(BAD_VALUES) * 7
    for other in others:
        assert other == first


@pytest.mark.timeout(10)
async def test_uncaught_unencodable_value_fails_the_operator_promptly(sh):
    class Fn(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

        async def process_element(self, value, ctx):
            await self.v.value()
            await self.v.update(value[1])

    op = ast.KeyedOperator(Fn(), key_selector=lambda r: r[0], backend=sh.backend)
    with pytest.raises(ast.SerializationError) as info:
        async with op:
            for i in range(20):
                await op.process((i, i))
            await op.process(("bad", {1, 2}))
            await asyncio.wait_for(op.drain(), 5)
    assert info.value.state_name == "v"
    assert info.value.type_name == "set"


# -- property: every encodable value round-trips, identically on every backend ------------

_key_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
                | st.floats(allow_nan=False) | st.text() | st.binary())
_hashable_keys = st.recursive(_key_scalars, lambda inner: st.tuples(inner, inner), max_leaves=4)
_values = st.recursive(
    _key_scalars,
    lambda inner: (st.lists(inner, max_size=4) | st.tuples(inner, inner)
                   | st.dictionaries(_hashable_keys, inner, max_size=4)),
    max_leaves=12)


class _Roundtrip(ast.KeyedProcessFunction):
    def open(self, ctx):
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))
        self.m = ctx.get_map_state(ast.MapStateDescriptor("m"))

    def process_element(self, record, ctx):
        _, value, map_key = record
        self.v.update(value)
        self.m.put(map_key, [value])
        return ast.combine_all([self.v.value(), self.m.get(map_key),
                                self.m.keys().then_compose(lambda it: it.to_list())]
                               ).then_accept(ctx.emit)


@settings(max_examples=slow_examples(40))
@given(value=_values, map_key=_hashable_keys)
def test_property_values_and_map_keys_round_trip_on_every_backend(state_helpers, value,
                                                                  map_key):
    normalize = state_helpers.normalize
    expected = [None if value is None else normalize(value), [normalize(value)],
                [normalize(map_key)]]
    for factory in state_helpers.factories.values():
        out = ast.run(_Roundtrip(), [("k", value, map_key)], key_selector=lambda r: r[0],
                      backend=factory(None))
        assert out == [expected]
