"""MapState through a real KeyedOperator: every method, user-key rules, put(k, None)."""

from __future__ import annotations

import math
from collections.abc import Hashable

import pytest
from shared_functions import (
    by_key_bytes,
    canon,
    strict_eq,
    to_list,
)

import asyncstate as ast

M = ast.MapStateDescriptor

MIXED_USER_KEYS = [0, 1, 1.0, True, False, None, "", b"", "a", b"a", (1,), -1, 2**63,
                   2**64 - 1, -(2**63), -0.0, 0.0, math.nan, math.inf, [], [None, [b"z"]],
                   "\u00e9", "x" * 300, b"\xff\xff", [[]], ((), [None]), 0.5]


@pytest.mark.parametrize("chunk", [1, 3, len(MIXED_USER_KEYS), 1000])
async def test_map_with_mixed_user_keys_and_chunked_iteration(sh, chunk):
    async def step(s, ctx):
        for i, k in enumerate(MIXED_USER_KEYS):
            s.m.put(k, (i, k))
        ents = await to_list(s.m.entries())
        keys = await to_list(s.m.keys())
        values = await to_list(s.m.values())
        it = await s.m.entries()
        ctx.emit((ents, keys, values, await s.m.is_empty(), it.is_empty()))
        got = [await s.m.get(k) for k in MIXED_USER_KEYS]
        has = [await s.m.contains(k) for k in MIXED_USER_KEYS]
        ctx.emit((got, has))

    out = await sh.run(sh.AsyncScript(m=M("m")), [("k", step)], iterator_chunk_size=chunk)
    (ents, keys, values, empty, it_empty), (got, has) = out
    expected = [(sh.normalize(k), [i, sh.normalize(k)]) for i, k in enumerate(MIXED_USER_KEYS)]
    assert len({canon(k) for k in MIXED_USER_KEYS}) == len(MIXED_USER_KEYS)
    assert all(type(e) is tuple for e in ents)
    assert strict_eq(by_key_bytes(ents), by_key_bytes(expected), dict_order=False)
    assert strict_eq(by_key_bytes(keys, key=lambda k: k), [k for k, _ in by_key_bytes(expected)],
                     dict_order=False)
    assert strict_eq(sorted(values, key=canon), sorted((v for _, v in expected), key=canon),
                     dict_order=False)
    assert (empty, it_empty) == (False, False)
    assert strict_eq(got, [v for _, v in expected], dict_order=False)
    assert has == [True] * len(MIXED_USER_KEYS)


async def test_map_user_keys_distinguish_int_float_bool_and_signed_zero(sh):
    async def step(s, ctx):
        await s.m.put_all({0: "int"})
        await s.m.put(-0.0, "negzero")
        await s.m.put(0.0, "float")
        await s.m.put(False, "bool")
        ctx.emit([await s.m.get(k) for k in (0, 0.0, -0.0, False, None)])
        ctx.emit(len(await to_list(s.m.keys())))
        await s.m.remove(0.0)
        ctx.emit([await s.m.contains(k) for k in (0, 0.0, -0.0, False)])

    out = await sh.run(sh.AsyncScript(m=M("m")), [("k", step)])
    assert out == [["int", "float", "negzero", "bool", None], 4, [True, False, True, True]]


async def entries(state):
    return await (await state.entries()).to_list()


async def test_get_put_contains_remove(sh):
    async def step(s, ctx):
        ctx.emit(("missing", await s.m.get("a"), await s.m.contains("a")))
        await s.m.put("a", 1)
        await s.m.put("b", [2])
        ctx.emit(("put", await s.m.get("a"), await s.m.get("b"), await s.m.contains("a")))
        await s.m.put("a", 10)
        await s.m.remove("b")
        await s.m.remove("never there")
        ctx.emit(("after", await s.m.get("a"), await s.m.get("b"), await s.m.contains("b")))

    out = await sh.run(sh.AsyncScript(m=M("m")), [("k", step)])
    assert out == [("missing", None, False), ("put", 1, [2], True), ("after", 10, None, False)]


async def test_put_none_removes(sh):
    async def step(s, ctx):
        await s.m.put("a", 1)
        await s.m.put("b", 2)
        await s.m.put("a", None)
        await s.m.put("never there", None)
        ctx.emit((await s.m.contains("a"), await s.m.get("a"), sorted(await entries(s.m))))
        await s.m.put("b", None)
        ctx.emit(await s.m.is_empty())

    out = await sh.run(sh.AsyncScript(m=M("m")), [("k", step)])
    assert out == [(False, None, [("b", 2)]), True]


async def test_put_all(sh):
    async def step(s, ctx):
        await s.m.put("keep", 0)
        await s.m.put_all({"a": 1, "b": [2], 3: "three"})
        await s.m.put_all({})
        ctx.emit(sorted(await entries(s.m), key=repr))

    out = await sh.run(sh.AsyncScript(m=M("m")), [("k", step)])
    assert out == [sorted([("keep", 0), ("a", 1), ("b", [2]), (3, "three")], key=repr)]


async def test_entries_are_tuples_keys_and_values(sh):
    content = {"a": 1, "b": {"x": 2}, 7: [3], b"raw": "v"}

    async def step(s, ctx):
        await s.m.put_all(content)
        ents = await entries(s.m)
        ctx.emit(("types", all(type(e) is tuple and len(e) == 2 for e in ents)))
        ctx.emit(("entries", sorted(ents, key=repr)))
        keys_it = await s.m.keys()
        values_it = await s.m.values()
        ctx.emit(("keys", sorted(await keys_it.to_list(), key=repr)))
        ctx.emit(("values", sorted(await values_it.to_list(), key=repr)))

    out = dict(await sh.run(sh.AsyncScript(m=M("m")), [("k", step)]))
    assert out["types"] is True
    assert out["entries"] == sorted(content.items(), key=repr)
    assert out["keys"] == sorted(content, key=repr)
    assert out["values"] == sorted(content.values(), key=repr)


async def test_is_empty_and_clear(sh):
    async def step(s, ctx):
        ctx.emit(await s.m.is_empty())
        await s.m.put(1, 1)
        ctx.emit(await s.m.is_empty())
        await s.m.clear()
        ctx.emit(await s.m.is_empty())
        ctx.emit((await s.m.get(1), await entries(s.m)))
        it = await s.m.keys()
        ctx.emit(it.is_empty())
        await s.m.put(2, 2)

    async def read(s, ctx):
        ctx.emit(await entries(s.m))

    out = await sh.run(sh.AsyncScript(m=M("m")), [("k", step), ("k", read)])
    assert out == [True, False, True, (None, []), True, [(2, 2)]]


async def test_remove_last_entry_makes_map_empty(sh):
    async def step(s, ctx):
        await s.m.put("only", 1)
        await s.m.remove("only")
        ctx.emit((await s.m.is_empty(), await entries(s.m)))

    assert await sh.run(sh.AsyncScript(m=M("m")), [("k", step)]) == [(True, [])]


async def test_user_keys_follow_canonical_bytes(sh):
    """1, 1.0 and True are three user keys; a list and a tuple with equal items are one."""

    async def step(s, ctx):
        await s.m.put(1, "int")
        await s.m.put(1.0, "float")
        await s.m.put(True, "bool")
        await s.m.put((1, "x"), "tuple")
        await s.m.put([1, "x"], "list")
        await s.m.put("1", "str")
        await s.m.put(b"1", "bytes")
        await s.m.put(None, "none")
        ctx.emit([await s.m.get(k) for k in (1, 1.0, True, (1, "x"), [1, "x"], "1", b"1", None)])
        ents = await entries(s.m)
        ctx.emit(sorted(((type(k).__name__, repr(k)), v) for k, v in ents))

    out = await sh.run(sh.AsyncScript(m=M("m")), [("k", step)])
    assert out[0] == ["int", "float", "bool", "list", "list", "str", "bytes", "none"]
    # Seven distinct user keys; a tuple user key comes back as a list.
    assert out[1] == sorted([
        (("int", "1"), "int"), (("float", "1.0"), "float"), (("bool", "True"), "bool"),
        (("list", "[1, 'x']"), "list"), (("str", "'1'"), "str"), (("bytes", "b'1'"), "bytes"),
        (("NoneType", "None"), "none"),
    ])


@pytest.mark.parametrize("bad_key", [{"a": 1}, [1, {"a": 1}], {1, 2}, object(), (1, object()),
                                     frozenset({1}), 2**64],
                         ids=["dict", "list-with-dict", "set", "object", "tuple-with-object",
                              "frozenset", "int-too-big"])
async def test_invalid_user_key_raises_serialization_error_at_the_call(sh, bad_key):
    calls = {"put": lambda m: m.put(bad_key, 1), "get": lambda m: m.get(bad_key),
             "contains": lambda m: m.contains(bad_key), "remove": lambda m: m.remove(bad_key)}
    if isinstance(bad_key, Hashable):
        calls["put_all"] = lambda m: m.put_all({"fine": 0, bad_key: 1})

    def step(s, ctx):
        for name, call in calls.items():
            try:
                call(s.m)
            except ast.SerializationError as exc:
                ctx.emit((name, exc.state_name, "'m'" in str(exc)))
            else:
                ctx.emit((name, "no error"))
        return s.m.is_empty().then_accept(lambda empty: ctx.emit(("empty", empty)))

    out = await sh.run(sh.Script(m=M("m")), [("k", step)])
    assert out == [(name, "m", True) for name in calls] + [("empty", True)]


async def test_writes_without_awaiting_then_reads(sh):
    def step(s, ctx):
        s.m.put("a", 1)
        s.m.put_all({"b": 2, "c": 3})
        s.m.remove("b")
        s.m.put("c", None)
        s.m.put("d", 4)
        return ast.combine_all([s.m.contains("a"), s.m.contains("b"), s.m.get("d"),
                                s.m.is_empty()]).then_accept(ctx.emit)

    out = await sh.run(sh.Script(m=M("m")), [("k", step)])
    assert out == [[True, False, 4, False]]


async def test_mutating_a_value_after_put_does_not_change_state(sh):
    async def step(s, ctx):
        v = [1]
        await s.m.put("a", v)
        v.append(2)
        mapping = {"b": [1]}
        await s.m.put_all(mapping)
        mapping["b"].append(2)
        ctx.emit((await s.m.get("a"), await s.m.get("b")))

    assert await sh.run(sh.AsyncScript(m=M("m")), [("k", step)]) == [([1], [1])]


async def test_maps_of_different_keys_and_states_are_separate(sh):
    async def step(s, ctx):
        await s.m.put("who", ctx.current_key)
        await s.n.put("who", "n")

    async def read(s, ctx):
        ctx.emit((ctx.current_key, await s.m.get("who"), await s.n.get("who")))

    records = [("a", step), ("b", step), ("a", read), ("b", read), ("c", read)]
    out = await sh.run(sh.AsyncScript(m=M("m"), n=M("n")), records)
    assert sorted(out, key=repr) == sorted([("a", "a", "n"), ("b", "b", "n"),
                                            ("c", None, None)], key=repr)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", [[("a", 1)], (("a", 1),), None, "ab"], ids=repr)
async def test_put_all_refuses_a_non_mapping_and_keeps_the_map(sh, bad):
    async def step(s, ctx):
        await s.m.put("keep", 0)
        try:
            s.m.put_all(bad)
        except Exception as exc:  # noqa: BLE001 - the type is part of the expected output
            ctx.emit((type(exc).__name__, str(exc)))
        ctx.emit(await to_list(s.m.entries()))

    out = await sh.run(sh.AsyncScript(m=M("m")), [("k", step)])
    assert out == [
        ("TypeError", f"put_all() of state 'm' expects a mapping, got {type(bad).__name__}"),
        [("keep", 0)],
    ]
