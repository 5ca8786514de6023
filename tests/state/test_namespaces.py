"""Namespaces: `state.set_current_namespace(ns)` isolates values per namespace."""

from __future__ import annotations

import pytest
from shared_functions import Sum

import asyncstate as ast

V = ast.ValueStateDescriptor
L = ast.ListStateDescriptor
M = ast.MapStateDescriptor


async def test_value_state_namespaces_are_isolated(sh):
    async def write(s, ctx):
        for ns in ("a", "b", None):
            s.v.set_current_namespace(ns)
            await s.v.update(f"in {ns}")
        s.v.set_current_namespace("c")
        await s.v.update("in c")
        await s.v.clear()

    async def read(s, ctx):
        got = {}
        for ns in ("a", "b", "c", None, "never"):
            s.v.set_current_namespace(ns)
            got[ns] = await s.v.value()
        ctx.emit(got)

    out = await sh.run(sh.AsyncScript(v=V("v")), [("k", write), ("k", read)])
    assert out == [{"a": "in a", "b": "in b", "c": None, None: "in None", "never": None}]


async def test_namespace_applies_to_later_calls_only_and_per_record(sh):
    """The default namespace is None; a namespace set in one record does not carry over."""

    def write(s, ctx):
        s.v.update("default")
        s.v.set_current_namespace("w")
        s.v.update("window")  # not awaited: captured its namespace at the call

    def read(s, ctx):
        first = s.v.value()  # a new record starts in the default namespace
        s.v.set_current_namespace("w")
        return ast.combine_all([first, s.v.value()]).then_accept(ctx.emit)

    out = await sh.run(sh.Script(v=V("v")), [("k", write), ("k", read)])
    assert out == [["default", "window"]]


async def test_namespace_is_per_state(sh):
    async def step(s, ctx):
        s.a.set_current_namespace("x")
        await s.a.update("a in x")
        await s.b.update("b in default")
        s.b.set_current_namespace("x")
        ctx.emit(await s.b.value())
        s.a.set_current_namespace(None)
        ctx.emit(await s.a.value())

    async def read(s, ctx):
        s.a.set_current_namespace("x")
        ctx.emit((await s.a.value(), await s.b.value()))

    out = await sh.run(sh.AsyncScript(a=V("a"), b=V("b")), [("k", step), ("k", read)])
    assert out == [None, None, ("a in x", "b in default")]


async def test_namespaces_of_different_keys_are_separate(sh):
    async def write(s, ctx):
        s.v.set_current_namespace("w")
        await s.v.update(ctx.current_key)

    async def read(s, ctx):
        s.v.set_current_namespace("w")
        ctx.emit((ctx.current_key, await s.v.value()))

    records = [("a", write), ("b", write), ("a", read), ("b", read), ("c", read)]
    out = await sh.run(sh.AsyncScript(v=V("v")), records)
    assert sorted(out, key=repr) == sorted([("a", "a"), ("b", "b"), ("c", None)], key=repr)


async def test_namespaces_follow_key_rules(sh):
    """1, 1.0 and True are three namespaces; a list and a tuple with equal items are one."""

    async def step(s, ctx):
        for ns, v in ((1, "int"), (1.0, "float"), (True, "bool"), ((1, "w"), "tuple"),
                      ([1, "w"], "list"), (b"1", "bytes"), ("1", "str")):
            s.v.set_current_namespace(ns)
            await s.v.update(v)
        got = []
        for ns in (1, 1.0, True, (1, "w"), [1, "w"], b"1", "1"):
            s.v.set_current_namespace(ns)
            got.append(await s.v.value())
        ctx.emit(got)

    out = await sh.run(sh.AsyncScript(v=V("v")), [("k", step)])
    assert out == [["int", "float", "bool", "list", "list", "bytes", "str"]]


async def test_list_map_and_merging_states_use_namespaces(sh):
    descriptors = dict(l=L("l"), m=M("m"), r=ast.ReducingStateDescriptor("r", lambda a, b: a + b),
                       a=ast.AggregatingStateDescriptor("a", Sum()))

    def write(s, ctx):
        for ns, n in (("x", 1), ("y", 10)):
            for state in (s.l, s.m, s.r, s.a):
                state.set_current_namespace(ns)
            s.l.add(n)
            s.m.put("k", n)
            s.r.add(n)
            s.r.add(n)
            s.a.add(n)

    def read(s, ctx):
        futures = []
        for ns in ("x", "y", None):
            for state in (s.l, s.m, s.r, s.a):
                state.set_current_namespace(ns)
            futures += [s.l.get().then_compose(lambda it: it.to_list()), s.m.get("k"),
                        s.r.get(), s.a.get()]
        return ast.combine_all(futures).then_accept(ctx.emit)

    out = await sh.run(sh.Script(**descriptors), [("k", write), ("k", read)])
    assert out == [[[1], 1, 2, 1, [10], 10, 20, 10, [], None, None, None]]


async def test_clear_in_one_namespace_keeps_the_others(sh):
    async def step(s, ctx):
        for ns in ("x", "y"):
            s.m.set_current_namespace(ns)
            await s.m.put_all({"a": ns, "b": ns})
        s.m.set_current_namespace("x")
        await s.m.clear()
        ctx.emit(await s.m.is_empty())
        s.m.set_current_namespace("y")
        ctx.emit(sorted(await (await s.m.entries()).to_list()))

    out = await sh.run(sh.AsyncScript(m=M("m")), [("k", step)])
    assert out == [True, [("a", "y"), ("b", "y")]]


@pytest.mark.parametrize("bad_ns", [{"a": 1}, {1}, object()], ids=["dict", "set", "object"])
async def test_invalid_namespace_raises_serialization_error(sh, bad_ns):
    def step(s, ctx):
        try:
            s.v.set_current_namespace(bad_ns)
        except ast.SerializationError as exc:
            ctx.emit(("rejected", exc.type_name))

    out = await sh.run(sh.Script(v=V("v")), [("k", step)])
    assert out == [("rejected", type(bad_ns).__name__)]


async def test_set_current_namespace_outside_a_record_raises(sh):
    class Fn(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))
            self.v.set_current_namespace("ns")

        def process_element(self, value, ctx):
            pass

    with pytest.raises(ast.InvalidStateError):
        async with ast.KeyedOperator(Fn(), key_selector=lambda r: r, backend=sh.backend):
            pass


