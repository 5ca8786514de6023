"""Record keys: identity by canonical bytes (1, 1.0 and True differ; lists equal tuples), the
keys refused at process(), and the selected key as the record sees it."""

from __future__ import annotations

import math

import pytest
from shared_functions import (
    Counter,
    canon,
    strict_eq,
    tag_only,
)

import asyncstate as ast

V = ast.ValueStateDescriptor
L = ast.ListStateDescriptor
M = ast.MapStateDescriptor

UNUSUAL_KEYS = [b"k", "k", 2**64 - 1, -(2**63), -1, 0, 0.0, -0.0, math.inf, -math.inf,
                (1, "a"), None, True, False, 1, 1.0, "", b"", (), [[1, [2, b"x"]], None],
                "\u00fc\u20ac", "x" * 1000, b"\xff" * 3, [-1, -1]]


async def test_unusual_record_keys_have_separate_state(sh):
    """Every key (by canonical bytes) has its own value, list and map; reads return what
    the key's own records wrote."""

    def write(s, ctx):
        k = ctx.current_key
        s.v.update(("v", k))
        s.l.add_all([k, (1, 2)])
        s.m.put(k, {"k": (1,)})
        return None

    def read(s, ctx):
        return ast.combine_all([
            s.v.value(), s.l.get().then_compose(lambda it: it.to_list()),
            s.m.entries().then_compose(lambda it: it.to_list()), s.m.is_empty(),
        ]).then_accept(lambda got: ctx.emit((canon(ctx.current_key), got)))

    records = [(k, write) for k in UNUSUAL_KEYS] + [(k, read) for k in UNUSUAL_KEYS]
    out = dict(await sh.run(sh.Script(v=V("v"), l=L("l"), m=M("m")), records))
    assert len(out) == len(UNUSUAL_KEYS)
    for k in UNUSUAL_KEYS:
        n = sh.normalize(k)
        expected = [["v", n], [n, [1, 2]], [(n, {"k": [1]})], False]
        assert strict_eq(out[canon(k)], expected, dict_order=False), (k, out[canon(k)])


async def test_list_key_and_tuple_key_share_state_but_nested_containers_differ(sh):
    async def step(s, ctx):
        n = (await s.v.value() or 0) + 1
        await s.v.update(n)
        ctx.emit((ctx.record[2], n))

    records = [([1, [2]], step, "a"), ((1, (2,)), step, "a"), ([1, (2,)], step, "a"),
               ([[1, 2]], step, "b"), ([(1, 2)], step, "b"), ([1, 2], step, "c")]
    out = await sh.run(sh.AsyncScript(v=V("v")), records)
    assert sorted(out) == [("a", 1), ("a", 2), ("a", 3), ("b", 1), ("b", 2), ("c", 1)]


async def test_one_one_point_zero_and_true_are_three_keys(sh):
    records = [(1, "int"), (1.0, "float"), (True, "bool"), (1, "int"), (True, "bool")]
    out = await sh.run(Counter(output=tag_only), records)
    assert sorted(out) == sorted([("int", 1), ("float", 1), ("bool", 1), ("int", 2),
                                  ("bool", 2)])


async def test_list_and_tuple_with_equal_items_are_the_same_key(sh):
    records = [([1, "a"], "list"), ((1, "a"), "tuple"), ([1, "a"], "list"),
               (((1, 2), [3]), "nested-t"), ([[1, 2], (3,)], "nested-l")]
    out = await sh.run(Counter(output=tag_only), records)
    assert sorted(n for tag, n in out if tag in ("list", "tuple")) == [1, 2, 3]
    assert sorted(n for tag, n in out if tag.startswith("nested")) == [1, 2]


async def test_other_scalar_keys_are_distinct(sh):
    keys = [None, 0, 0.0, False, "", b"", "0", b"0", -1, 2**64 - 1, -(2**63), [], [None]]
    records = [(k, repr(k)) for k in keys] * 2
    out = await sh.run(Counter(output=tag_only), records)
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
