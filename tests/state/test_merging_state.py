"""ReducingState and AggregatingState: get / add / clear, un-awaited adds are never lost, and
a failing reduce or aggregate fails only its own call."""

from __future__ import annotations

import operator
from typing import Any

import pytest
from shared_functions import (
    run_on_every_backend,
)

import asyncstate as ast

V = ast.ValueStateDescriptor
R = ast.ReducingStateDescriptor
A = ast.AggregatingStateDescriptor


class ListAgg(ast.AggregateFunction):
    """Accumulator is a tuple (stored, so it comes back as a list)."""

    def create_accumulator(self):
        return (0, ())

    def add(self, value, acc):
        assert type(acc) in (tuple, list)
        return (acc[0] + 1, (*acc[1], value))

    def get_result(self, acc):
        return ("count", acc[0], acc[1])

    def merge(self, a, b):
        return (a[0] + b[0], (*a[1], *b[1]))


async def test_merging_state_edge_cases(sh):
    async def step(s, ctx):
        ctx.emit(("empty", await s.r.get(), await s.a.get()))
        await s.r.add(None)  # first add stores the value itself: None stores nothing
        ctx.emit(("add None", await s.r.get()))
        await s.r.add(0)
        await s.r.add(0)
        ctx.emit(("falsy", await s.r.get()))
        await s.r.clear()
        await s.r.add((1, 2))
        ctx.emit(("tuple", await s.r.get()))
        s.r.clear()
        s.r.add([3])
        s.r.add([4])
        ctx.emit(("clear then adds", await s.r.get()))
        await s.a.add("x")
        s.a.add((1,))
        ctx.emit(("agg", await s.a.get()))
        s.a.clear()
        ctx.emit(("agg cleared", await s.a.get()))
        await s.a.add(None)
        ctx.emit(("agg None", await s.a.get()))

    descriptors = dict(r=R("r", lambda a, b: a + b), a=A("a", ListAgg()))
    out = await sh.run(sh.AsyncScript(**descriptors), [("k", step), ("k2", step)])
    per_key = [("empty", None, None), ("add None", None), ("falsy", 0), ("tuple", [1, 2]),
               ("clear then adds", [3, 4]), ("agg", ("count", 2, ["x", [1]])),
               ("agg cleared", None), ("agg None", ("count", 1, [None]))]
    assert sorted(out, key=repr) == sorted(per_key * 2, key=repr)


async def test_reducing_sum_overflowing_int64_range_raises_serialization_error(sh):
    async def step(s, ctx):
        await s.r.add(2**63)
        try:
            await s.r.add(2**63)  # sum 2**64 cannot be stored
        except ast.SerializationError as exc:
            ctx.emit(("error", exc.state_name, exc.type_name))
        ctx.emit(await s.r.get())

    out = await sh.run(sh.AsyncScript(r=R("r", lambda a, b: a + b)), [("k", step)])
    assert out == [("error", "r", "int"), 2**63]


async def test_state_after_exception_caught_in_user_code(sh):
    """A reduce function or an aggregate that raises fails only that call; the state keeps
    its value and later calls work."""

    class Agg(ListAgg):
        def add(self, value, acc):
            if value == "boom":
                raise ZeroDivisionError("boom")
            if value == "unencodable":
                return (object(),)
            return super().add(value, acc)

    async def step(s, ctx):
        await s.r.add(1)
        await s.a.add(1)
        for call in (lambda: s.r.add("x"), lambda: s.a.add("boom"),
                     lambda: s.a.add("unencodable"),
                     lambda: s.v.value().then_apply(lambda v: 1 / 0)):
            try:
                await call()
            except (TypeError, ZeroDivisionError, ast.SerializationError) as exc:
                ctx.emit(type(exc).__name__)
        await s.r.add(2)
        await s.a.add(2)
        ctx.emit((await s.r.get(), await s.a.get()))

    descriptors = dict(r=R("r", lambda a, b: a + b), a=A("a", Agg()), v=V("v"))
    out = await sh.run(sh.AsyncScript(**descriptors), [("k", step), ("k", step)])
    errors = ["TypeError", "ZeroDivisionError", "SerializationError", "ZeroDivisionError"]
    assert out == [*errors, (3, ("count", 2, [1, 2])), *errors, (6, ("count", 4, [1, 2, 1, 2]))]


@pytest.mark.parametrize("kind", ["reducing", "aggregating"])
def test_parity_merging_add_uses_the_value_as_it_was_at_the_call(state_helpers, kind):
    class Concat(ast.AggregateFunction):
        def create_accumulator(self):
            return []

        def add(self, value, acc):
            return acc + value

        def get_result(self, acc):
            return acc

        def merge(self, a, b):
            return a + b

    descriptor = (R("s", lambda a, b: a + b) if kind == "reducing" else A("s", Concat()))

    def step(s, ctx):
        value = [1]
        s.s.add(value)
        value.append(2)  # after the call: must not reach the state
        return s.s.get().then_accept(ctx.emit)

    results = run_on_every_backend(state_helpers, lambda: state_helpers.Script(s=descriptor),
                                   [("k", step)])
    assert results == {backend_id: [[1]] for backend_id in results}


def test_parity_failed_merging_add_does_not_drop_later_calls(state_helpers):
    async def step(s, ctx):
        await s.r.add(1)
        futures = [s.r.add("x"), s.r.add(2), s.r.get()]  # "x": 1 + "x" raises TypeError
        outcome = []
        for fut in futures:
            try:
                outcome.append(("ok", await fut))
            except TypeError:
                outcome.append("TypeError")
        ctx.emit((outcome, await s.r.get()))

    results = run_on_every_backend(
        state_helpers, lambda: state_helpers.AsyncScript(r=R("r", lambda a, b: a + b)),
        [("k", step)])
    expected = [(["TypeError", ("ok", None), ("ok", 3)], 3)]
    assert results == {backend_id: expected for backend_id in results}


@pytest.mark.parametrize("looked_at", [False, True])
def test_parity_failed_unawaited_merging_add_still_fails_the_run_unless_looked_at(
        state_helpers, looked_at):
    """Later calls wait for a failed add without looking at its failure: nobody looking at
    it fails the run with it, on every backend; looking at it keeps the run going."""
    def step(s, ctx):
        s.r.add(1)
        bad = s.r.add("x")  # 1 + "x" raises TypeError
        s.r.add(2)
        if looked_at:  # the get runs after the adds, so `bad` is done by then
            return s.r.get().then_accept(
                lambda v: ctx.emit((v, type(bad.exception()).__name__)))
        return s.r.get().then_accept(lambda v: ctx.emit(v))

    results = run_on_every_backend(
        state_helpers, lambda: state_helpers.Script(r=R("r", lambda a, b: a + b)),
        [("k", step)])
    expected: Any = [(3, "TypeError")] if looked_at else (
        "raised", "TypeError", 'unsupported operand type(s) for +: \'int\' and \'str\'')
    assert results == {backend_id: expected for backend_id in results}


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


class Box:
    """An input msgpack cannot encode."""

    def __init__(self, n: int) -> None:
        self.n = n


class SumOfBoxes(ast.AggregateFunction):
    def create_accumulator(self):
        return 0

    def add(self, value, acc):
        return acc + value.n

    def get_result(self, acc):
        return acc

    def merge(self, a, b):
        return a + b


@pytest.mark.timeout(30)
async def test_aggregating_add_takes_an_input_msgpack_cannot_encode(sh):
    async def step(s, ctx):
        s.a.add(Box(2))  # not awaited: the next add still sees it
        await s.a.add(Box(3))
        ctx.emit(await s.a.get())

    fn = sh.AsyncScript(a=ast.AggregatingStateDescriptor("a", SumOfBoxes()))
    out = await sh.run(fn, [("k", step), ("k", step)])
    assert out == [5, 10]
