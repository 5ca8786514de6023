"""Values through states: round trips on every backend (tuples come back as lists, exact
types), and SerializationError at the call that wrote what msgpack cannot hold."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from samples import (
    Color,
    Point,
    Weight,
    keys,
    values,
)
from shared_functions import (
    by_key_bytes,
    normalize,
    run_steps,
    slow_examples,
    strict_eq,
    to_list,
)

import asyncstate as ast

V = ast.ValueStateDescriptor
L = ast.ListStateDescriptor
M = ast.MapStateDescriptor
R = ast.ReducingStateDescriptor

TUPLE_VALUES = [(1, 2), ((1, (2, (3,))),), [(1,), ((),)], {"a": (1, (2,))},
                {(1, 2): (3,), 5: [(6,)]}, {(1, (2, 3)): {"x": ((4,),)}}, (), ((), [])]


async def test_tuples_come_back_as_lists_in_every_state_kind(sh):
    async def step(s, ctx):
        for i, value in enumerate(TUPLE_VALUES):
            await s.v.update(value)
            await s.l.update([value, value])
            await s.m.put(i, value)
            await s.r.clear()
            await s.r.add(value)
            ctx.emit((await s.v.value(), await to_list(s.l.get()), await s.m.get(i),
                      await s.r.get()))
        ctx.emit(by_key_bytes(await to_list(s.m.entries())))

    descriptors = dict(v=V("v"), l=L("l"), m=M("m"), r=R("r", lambda a, b: b))
    out = await sh.run(sh.AsyncScript(**descriptors), [("k", step)], iterator_chunk_size=2)
    *per_value, ents = out
    for value, got in zip(TUPLE_VALUES, per_value, strict=True):
        n = sh.normalize(value)
        assert strict_eq(got, (n, [n, n], n, n), dict_order=False), (value, got)
    assert strict_eq(ents, [(i, sh.normalize(v)) for i, v in enumerate(TUPLE_VALUES)],
                     dict_order=False)


EDGE_SCALARS = [0, -1, 2**64 - 1, -(2**63), 2**63, 0.0, -0.0, math.inf, -math.inf, 1e-308,
                5e-324, "", b"", "\x00", b"\x00", "\U0001f600", True, False, [], {}, [None],
                {None: None}, {b"": ""}, {1.5: -0.0}]


async def test_edge_scalar_values_round_trip_with_exact_types(sh):
    async def step(s, ctx):
        for v in EDGE_SCALARS:
            await s.v.update(v)
            await s.m.put("x", v)
            ctx.emit((await s.v.value(), await s.m.get("x")))
        await s.l.add_all(EDGE_SCALARS)
        ctx.emit(await to_list(s.l.get()))

    out = await sh.run(sh.AsyncScript(v=V("v"), l=L("l"), m=M("m")), [("k", step)],
                       iterator_chunk_size=5)
    *pairs, listed = out
    for v, got in zip(EDGE_SCALARS, pairs, strict=True):
        assert strict_eq(got, (v, v), dict_order=False), (v, got)
    assert strict_eq(listed, EDGE_SCALARS, dict_order=False)


async def test_nan_value_and_nan_map_key(sh):
    async def step(s, ctx):
        await s.v.update(math.nan)
        await s.m.put(math.nan, [math.nan])
        ctx.emit((await s.v.value(), await s.m.get(math.nan), await s.m.contains(math.nan),
                  await to_list(s.m.entries())))

    [(v, got, has, ents)] = await sh.run(sh.AsyncScript(v=V("v"), m=M("m")), [("k", step)])
    assert math.isnan(v) and math.isnan(got[0]) and has is True
    assert len(ents) == 1 and math.isnan(ents[0][0]) and math.isnan(ents[0][1][0])


async def test_large_values_and_large_keys(sh):
    big = bytes(range(256)) * (4 * 4096)  # 4 MiB
    text = "\u00e9\u20ac" * 200_000
    long_key = "k" * 100_000

    async def write(s, ctx):
        await s.v.update(big)
        await s.m.put(long_key, text)
        await s.m.put(b"\xff" * 50_000, [big[:1000]] * 100)
        await s.l.add_all([text] * 3)

    async def read(s, ctx):
        v = await s.v.value()
        ctx.emit((v == big, await s.m.get(long_key) == text,
                  await s.m.get(b"\xff" * 50_000) == [big[:1000]] * 100,
                  await to_list(s.l.get()) == [text] * 3,
                  sorted(len(k) for k in await to_list(s.m.keys()))))

    out = await sh.run(sh.AsyncScript(v=V("v"), l=L("l"), m=M("m")),
                       [(long_key, write), (long_key, read)], iterator_chunk_size=1)
    assert out == [(True, True, True, True, [50_000, 100_000])]


async def test_mutating_values_after_the_call_does_not_change_state(sh):
    def step(s, ctx):
        v = [1]
        d = {"a": [1]}
        items = [[1]]
        s.v.update(v)
        s.m.put("k", d)
        s.l.add_all(items)
        s.l.add(v)
        v.append(2)
        d["a"].append(2)
        items[0].append(2)
        items.append("late")
        return ast.combine_all([s.v.value(), s.m.get("k"),
                                s.l.get().then_compose(lambda it: it.to_list())]
                               ).then_accept(ctx.emit)

    out = await sh.run(sh.Script(v=V("v"), l=L("l"), m=M("m")), [("k", step)])
    assert out == [[[1], {"a": [1]}, [[1], [1]]]]


class Unencodable:
    pass


BAD_WRITES = {
    "v.update object": ("v", "Unencodable", lambda s: s.v.update(Unencodable())),
    "v.update set": ("v", "set", lambda s: s.v.update({1})),
    "v.update big int": ("v", "int", lambda s: s.v.update(2**64)),
    "v.update small int": ("v", "int", lambda s: s.v.update(-(2**63) - 1)),
    "v.update surrogate": ("v", "str", lambda s: s.v.update("\ud800")),
    "l.add": ("l", "Unencodable", lambda s: s.l.add(Unencodable())),
    "l.add_all": ("l", "Unencodable", lambda s: s.l.add_all([1, Unencodable()])),
    "l.update": ("l", "Unencodable", lambda s: s.l.update([1, Unencodable()])),
    "l.update generator": ("l", "int", lambda s: s.l.update(x for x in (1, 2**64))),
    "m.put": ("m", "Unencodable", lambda s: s.m.put("a", Unencodable())),
    "m.put_all": ("m", "Unencodable", lambda s: s.m.put_all({"b": 1, "c": Unencodable()})),
    "m.put_all bad key": ("m", "dict", lambda s: s.m.put_all({"b": 1, (1, 2**64): 1})),
    "m.put float key big": ("m", "int", lambda s: s.m.put(-(2**63) - 1, 1)),
    "m.get surrogate key": ("m", "str", lambda s: s.m.get("\udfff")),
    "r.add": ("r", "Unencodable", lambda s: s.r.add(Unencodable())),
}


async def test_serialization_errors_name_state_and_leave_state_intact(sh):
    def step(s, ctx):
        s.v.update([1])
        s.l.add_all([1, 2])
        s.m.put("a", 1)
        s.r.add(5)
        for name, (_, _, call) in BAD_WRITES.items():
            try:
                call(s)
            except ast.SerializationError as exc:
                ctx.emit((name, exc.state_name, exc.type_name, repr(exc.state_name) in str(exc)))
            else:
                ctx.emit((name, "no error"))
        return ast.combine_all([
            s.v.value(), s.l.get().then_compose(lambda it: it.to_list()),
            s.m.entries().then_compose(lambda it: it.to_list()), s.r.get(),
        ]).then_accept(ctx.emit)

    def later(s, ctx):
        return ast.combine_all([
            s.v.value(), s.l.get().then_compose(lambda it: it.to_list()),
            s.m.entries().then_compose(lambda it: it.to_list()), s.r.get(),
        ]).then_accept(ctx.emit)

    descriptors = dict(v=V("v"), l=L("l"), m=M("m"), r=R("r", lambda a, b: a + b))
    out = await sh.run(sh.Script(**descriptors), [("k", step), ("k", later)])
    *errors, after, after_later = out
    got = {e[0]: e[1:] for e in errors}
    for name, (state, type_name, _) in BAD_WRITES.items():
        if name == "m.put_all bad key":  # the key's type is the tuple holding the big int
            assert got[name][0] == state and got[name][2] is True, got[name]
            continue
        assert got[name] == (state, type_name, True), (name, got[name])
    assert after == after_later == [[1], [1, 2], [("a", 1)], 5]


def test_deeply_nested_key_raises_serialization_error_not_a_crash():
    code = textwrap.dedent("""
        import asyncstate as ast

        key = 1
        for _ in range(100_000):
            key = [key]

        class Fn(ast.KeyedProcessFunction):
            def open(self, ctx):
                self.m = ctx.get_map_state(ast.MapStateDescriptor("m"))

            def process_element(self, record, ctx):
                try:
                    self.m.put(key, 1)
                except ast.SerializationError as exc:
                    ctx.emit(("SerializationError", exc.state_name))
                except RecursionError:
                    ctx.emit(("RecursionError", None))

        print(ast.run(Fn(), [("k",)], key_selector=lambda r: r[0]))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-500:])
    assert proc.stdout.strip() == "[('SerializationError', 'm')]"


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


SerializationError = ast.SerializationError
BACKENDS = ["heap", "rocksdb", "remote0-rocksdb"]


@pytest.mark.parametrize("backend_name", BACKENDS)
@settings(max_examples=slow_examples(10), suppress_health_check=[HealthCheck.too_slow])
@given(v=values, user_key=keys)
def test_values_and_map_keys_round_trip_through_backends(backend_name, v, user_key):
    async def step(s, ctx):
        await s.v.update(v)
        await s.l.add(v)
        await s.m.put(user_key, v)
        ctx.emit((await s.v.value(), await (await s.l.get()).to_list(),
                  await (await s.m.entries()).to_list(), await s.m.get(normalize(user_key))))

    assume(v is not None)
    (val, lst, ents, got), = run_steps(backend_name, 1000, [("k", step)])
    exp = normalize(v)
    assert strict_eq(val, exp) and len(lst) == 1 and strict_eq(lst[0], exp)
    assert len(ents) == 1 and strict_eq(ents[0][0], normalize(user_key))
    assert strict_eq(ents[0][1], exp) and strict_eq(got, exp)


@pytest.mark.parametrize("backend_name", ["heap", "rocksdb"])
def test_state_calls_refuse_bad_input_at_the_call_naming_the_state(backend_name):
    cases = [
        ("v", "update", (2**64,), "int"),
        ("v", "update", ({"a": {"\udc80": 1}},), "dict"),
        ("l", "add", ([2**64],), "list"),
        ("l", "add_all", ([1, {1, 2}],), "set"),
        ("m", "put", ({"a": 1}, 1), "dict"),
        ("m", "put", ("\udc80", 1), "str"),
        ("m", "put", ((1, 2**64), 1), "int"),
        ("m", "put", (Color.RED, 1), "Color"),
        ("m", "put", ("ok", {"k": -(2**63) - 1}), "dict"),
        ("m", "get", (bytearray(b"x"),), "bytearray"),
        ("m", "put_all", ({Point(1, 2): 1},), "Point"),
        ("m", "contains", (Weight(1.0),), "Weight"),
    ]

    def step(s, ctx):
        for attr, method, args, type_name in cases:
            try:
                getattr(getattr(s, attr), method)(*args)
            except SerializationError as exc:
                ctx.emit((attr, exc.state_name, exc.type_name == type_name,
                          attr in str(exc)))
            else:
                ctx.emit((attr, "no error"))
        try:
            s.m.set_current_namespace({"ns": 1})
        except SerializationError as exc:
            ctx.emit(("ns", exc.state_name, exc.type_name == "dict", "namespace" in str(exc)))

    out = run_steps(backend_name, 1000, [("k", step)])
    assert out == [(a, a, True, True) for a, *_ in cases] + [("ns", "m", True, True)]
