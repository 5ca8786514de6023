"""State edges on every backend: list writes refuse a bytearray, put_all refuses a
non-mapping, an aggregating state takes inputs msgpack cannot encode, and
`RuntimeContext.states` is a copy that cannot change the declared states."""

from __future__ import annotations

import pytest

import asyncstate as ast

L = ast.ListStateDescriptor
M = ast.MapStateDescriptor


async def to_list(fut):
    return await (await fut).to_list()


@pytest.mark.timeout(30)
async def test_list_writes_refuse_a_bytearray_and_keep_the_list(sh):
    async def step(s, ctx):
        await s.l.add_all([1, 2])
        for call in (s.l.add_all, s.l.update):
            try:
                call(bytearray(b"ab"))
            except TypeError as exc:
                ctx.emit(str(exc))
        ctx.emit(await to_list(s.l.get()))

    out = await sh.run(sh.AsyncScript(l=L("l")), [("k", step)])
    assert out == [
        "add_all() of state 'l' expects a list of values, got bytearray",
        "update() of state 'l' expects a list of values, got bytearray",
        [1, 2],
    ]


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


class ClearsStates(ast.KeyedProcessFunction):
    """Empties and changes the dict `RuntimeContext.states` returns, then declares again."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        first = ctx.get_state(ast.ValueStateDescriptor("v"))
        states = ctx.states
        states.clear()
        states["other"] = first
        self.same = ctx.get_state(ast.ValueStateDescriptor("v")) is first
        with pytest.raises(ValueError, match=r"^state 'v' is already declared as value state"):
            ctx.get_list_state(ast.ListStateDescriptor("v"))
        self.names = sorted(ctx.states)
        self.v = first

    async def process_element(self, value, ctx):
        await self.v.update(value)
        ctx.emit(await self.v.value())


@pytest.mark.parametrize("backend", ["heap", "rocksdb"], indirect=True)
async def test_runtime_context_states_is_a_copy(sh):
    fn = ClearsStates()
    out = await sh.run(fn, [1, 2], key_selector=lambda r: "k")
    assert fn.same
    assert fn.names == ["v"]
    assert out == [1, 2]
