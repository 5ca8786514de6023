"""ReducingState and AggregatingState: get / add / clear, un-awaited adds are never lost."""

from __future__ import annotations

import operator

import pytest

import asyncstate as ast


class Average(ast.AggregateFunction):
    """Accumulator [sum, count] (stored, so a list); result sum / count."""

    def create_accumulator(self):
        return [0, 0]

    def add(self, value, acc):
        return [acc[0] + value, acc[1] + 1]

    def get_result(self, acc):
        return acc[0] / acc[1]

    def merge(self, a, b):
        return [a[0] + b[0], a[1] + b[1]]


class Collect(ast.AggregateFunction):
    """Accumulator: the added values in order; result: a tuple of them."""

    def create_accumulator(self):
        return []

    def add(self, value, acc):
        return [*acc, value]

    def get_result(self, acc):
        return tuple(acc)

    def merge(self, a, b):
        return a + b


def reducing(fn=operator.add):
    return ast.ReducingStateDescriptor("r", fn)


def aggregating(fn=None):
    return ast.AggregatingStateDescriptor("a", fn if fn is not None else Average())


# -- ReducingState ------------------------------------------------------------------------


async def test_reducing_get_is_none_when_empty_and_add_folds(sh):
    async def step(s, ctx):
        ctx.emit(await s.r.get())
        await s.r.add(5)
        ctx.emit(await s.r.get())
        await s.r.add(7)
        ctx.emit(await s.r.get())

    async def more(s, ctx):
        await s.r.add(100)
        ctx.emit(await s.r.get())

    out = await sh.run(sh.AsyncScript(r=reducing()), [("k", step), ("k", more)])
    assert out == [None, 5, 12, 112]


async def test_reducing_first_add_stores_value_without_calling_reduce(sh):
    calls = []

    def reduce_fn(a, b):
        calls.append((a, b))
        return [*a, *b]

    async def step(s, ctx):
        await s.r.add(["x"])
        await s.r.add(["y"])
        ctx.emit(await s.r.get())

    out = await sh.run(sh.AsyncScript(r=reducing(reduce_fn)), [("k", step)])
    assert out == [["x", "y"]]
    assert calls == [(["x"], ["y"])]


async def test_reducing_adds_without_awaiting_are_all_applied(sh):
    """Several add() calls in one record, none awaited, then get(): nothing is lost."""

    def step(s, ctx):
        for v in ctx.record[2]:
            s.r.add(v)
        return s.r.get().then_accept(ctx.emit)

    records = [("k", step, [1, 2, 3, 4]), ("j", step, [10, 20]), ("k", step, [100])]
    out = await sh.run(sh.Script(r=reducing()), records)
    assert sorted(out) == [10, 30, 110]
    assert [o for o in out if o != 30] == [10, 110]


async def test_reducing_order_of_unawaited_adds_is_issue_order(sh):
    def step(s, ctx):
        s.r.add("a")
        s.r.add("b")
        s.r.add("c")
        return s.r.get().then_accept(ctx.emit)

    out = await sh.run(sh.Script(r=reducing()), [("k", step), ("k", step)])
    assert out == ["abc", "abcabc"]


async def test_reducing_plain_def_adds_land_when_nothing_is_returned(sh):
    def add(s, ctx):
        s.r.add(1)
        s.r.add(2)

    def read(s, ctx):
        return s.r.get().then_accept(lambda v: ctx.emit((ctx.current_key, v)))

    records = [(k, add) for k in range(5)] * 2 + [(k, read) for k in range(5)]
    out = await sh.run(sh.Script(r=reducing()), records)
    assert sorted(out) == [(k, 6) for k in range(5)]


async def test_reducing_clear(sh):
    async def step(s, ctx):
        await s.r.add(1)
        await s.r.clear()
        ctx.emit(await s.r.get())
        await s.r.add(40)

    async def read(s, ctx):
        ctx.emit(await s.r.get())

    async def clear_only(s, ctx):
        await s.r.clear()

    records = [("k", step), ("k", read), ("k", clear_only), ("k", read)]
    out = await sh.run(sh.AsyncScript(r=reducing()), records)
    assert out == [None, 40, None]


async def test_reducing_clear_without_awaiting_applies_in_issue_order(sh):
    """add, add, clear, add, get issued back to back: the clear wipes the first two adds."""

    def step(s, ctx):
        s.r.add(1)
        s.r.add(2)
        s.r.clear()
        s.r.add(40)
        return s.r.get().then_accept(ctx.emit)

    out = await sh.run(sh.Script(r=reducing()), [("k", step)])
    assert out == [40]


async def test_reducing_reduce_fn_failure_fails_the_operator(sh):
    def boom(a, b):
        raise ZeroDivisionError("reduce failed")

    def step(s, ctx):
        s.r.add(1)
        s.r.add(2)

    with pytest.raises(ZeroDivisionError, match="reduce failed"):
        await sh.run(sh.Script(r=reducing(boom)), [("k", step)])


# -- AggregatingState ---------------------------------------------------------------------


async def test_aggregating_get_is_none_when_empty_and_add_aggregates(sh):
    async def step(s, ctx):
        ctx.emit(await s.a.get())
        await s.a.add(2)
        await s.a.add(4)
        ctx.emit(await s.a.get())

    async def more(s, ctx):
        await s.a.add(9)
        ctx.emit(await s.a.get())

    out = await sh.run(sh.AsyncScript(a=aggregating()), [("k", step), ("k", more)])
    assert out == [None, 3.0, 5.0]


async def test_aggregating_adds_without_awaiting_are_all_applied(sh):
    def step(s, ctx):
        for v in ctx.record[2]:
            s.a.add(v)
        return s.a.get().then_accept(ctx.emit)

    records = [("k", step, ["a", "b", "c"]), ("k", step, ["d"])]
    out = await sh.run(sh.Script(a=aggregating(Collect())), records)
    assert out == [("a", "b", "c"), ("a", "b", "c", "d")]


async def test_aggregating_get_after_unawaited_add_sees_it(sh):
    def step(s, ctx):
        s.a.add(10)
        first = s.a.get()
        s.a.add(20)
        second = s.a.get()
        return ast.combine_all([first, second]).then_accept(ctx.emit)

    out = await sh.run(sh.Script(a=aggregating()), [("k", step)])
    assert out == [[10.0, 15.0]]


async def test_aggregating_clear(sh):
    async def step(s, ctx):
        await s.a.add(1)
        await s.a.clear()
        ctx.emit(await s.a.get())
        await s.a.add(3)
        ctx.emit(await s.a.get())

    out = await sh.run(sh.AsyncScript(a=aggregating()), [("k", step)])
    assert out == [None, 3.0]


async def test_aggregating_clear_without_awaiting_applies_in_issue_order(sh):
    def step(s, ctx):
        s.a.add("x")
        s.a.clear()
        s.a.add("y")
        return s.a.get().then_accept(ctx.emit)

    out = await sh.run(sh.Script(a=aggregating(Collect())), [("k", step)])
    assert out == [("y",)]


async def test_aggregating_per_key_isolation(sh):
    def add(s, ctx):
        s.a.add(ctx.record[2])

    def read(s, ctx):
        return s.a.get().then_accept(lambda v: ctx.emit((ctx.current_key, v)))

    records = [("x", add, 1), ("y", add, 10), ("x", add, 3), ("y", add, 30),
               ("x", read, None), ("y", read, None), ("z", read, None)]
    out = await sh.run(sh.Script(a=aggregating()), records)
    assert sorted(out, key=repr) == sorted([("x", 2.0), ("y", 20.0), ("z", None)], key=repr)


async def test_reducing_add_of_unencodable_value_raises_at_the_call(sh):
    def step(s, ctx):
        try:
            s.r.add(object())
        except ast.SerializationError as exc:
            ctx.emit((exc.state_name, exc.type_name))
        return s.r.get().then_accept(ctx.emit)

    out = await sh.run(sh.Script(r=reducing()), [("k", step)])
    assert out == [("r", "object"), None]
