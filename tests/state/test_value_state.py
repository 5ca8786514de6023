"""ValueState through a real KeyedOperator: value / update / clear in all three styles."""

from __future__ import annotations

import copy

from shared_functions import Counter

import asyncstate as ast

V = ast.ValueStateDescriptor


class ChainCounter(ast.KeyedProcessFunction):
    """Callback style: returns the StateFuture chain, never awaits."""

    def open(self, ctx):
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    def process_element(self, value, ctx):
        def write(old):
            n = (old or 0) + value[1]
            return self.count.update(n).then_accept(lambda _: ctx.emit((ctx.current_key, n)))

        return self.count.value().then_compose(write)


async def test_value_is_none_when_unset(sh):
    async def step(s, ctx):
        ctx.emit(await s.v.value())

    assert await sh.run(sh.AsyncScript(v=V("v")), [("a", step), ("b", step)]) == [None, None]


async def test_async_def_counter_counts_per_key_in_arrival_order(sh):
    records = [(k, i) for i, k in enumerate("abacbba")]
    out = await sh.run(Counter(), records)
    for key in "abc":
        assert [n for k, n in out if k == key] == list(range(1, "abacbba".count(key) + 1))
    assert len(out) == 7


async def test_callback_chain_counter(sh):
    records = [("a", 1), ("b", 10), ("a", 2), ("a", 3), ("b", 20)]
    out = await sh.run(ChainCounter(), records)
    assert [n for k, n in out if k == "a"] == [1, 3, 6]
    assert [n for k, n in out if k == "b"] == [10, 30]


async def test_update_then_value_and_overwrite(sh):
    async def write(s, ctx):
        await s.v.update({"x": [1, 2]})
        ctx.emit(await s.v.value())
        await s.v.update("second")
        ctx.emit(await s.v.value())

    async def read(s, ctx):
        ctx.emit(await s.v.value())

    out = await sh.run(sh.AsyncScript(v=V("v")), [("k", write), ("k", read)])
    assert out == [{"x": [1, 2]}, "second", "second"]


async def test_update_none_clears(sh):
    async def step(s, ctx):
        await s.v.update(5)
        assert await s.v.value() == 5
        await s.v.update(None)
        ctx.emit(await s.v.value())

    async def read(s, ctx):
        ctx.emit(await s.v.value())

    out = await sh.run(sh.AsyncScript(v=V("v")), [("k", step), ("k", read)])
    assert out == [None, None]


async def test_clear(sh):
    async def step(s, ctx):
        await s.v.update([1])
        await s.v.clear()
        ctx.emit(await s.v.value())
        await s.v.update(7)

    async def clear_only(s, ctx):
        await s.v.clear()

    async def read(s, ctx):
        ctx.emit(await s.v.value())

    out = await sh.run(sh.AsyncScript(v=V("v")),
                       [("k", step), ("k", read), ("k", clear_only), ("k", read)])
    assert out == [None, 7, None]


async def test_falsy_values_are_not_unset(sh):
    values = [0, 0.0, False, "", b"", [], {}]

    async def step(s, ctx):
        for v in values:
            await s.v.update(v)
            got = await s.v.value()
            ctx.emit((got, type(got)))

    out = await sh.run(sh.AsyncScript(v=V("v")), [("k", step)])
    assert out == [(v, type(v)) for v in values]


async def test_read_your_writes_without_awaiting_the_write(sh):
    """Plain def: update() and value() issued back to back in one record, nothing awaited."""

    def step(s, ctx):
        s.v.update(41)
        s.v.update(42)
        return s.v.value().then_accept(ctx.emit)

    out = await sh.run(sh.Script(v=V("v")), [("k", step), ("k", step)])
    assert out == [42, 42]


async def test_plain_def_returning_none_writes_land(sh):
    """Plain def issuing writes and returning None: the writes are not lost."""

    def write(s, ctx):
        s.v.update(("written", ctx.current_key))
        s.w.update(1)
        s.w.update(None)

    def read(s, ctx):
        return ast.combine_all([s.v.value(), s.w.value()]).then_accept(ctx.emit)

    records = [(k, write) for k in range(20)] + [(k, read) for k in range(20)]
    out = await sh.run(sh.Script(v=V("v"), w=V("w")), records)
    assert sorted(out) == sorted([["written", k], None] for k in range(20))


async def test_mutating_a_list_after_update_does_not_change_state(sh):
    async def step(s, ctx):
        value = [1, [2, 3], {"a": [4]}]
        await s.v.update(value)
        value.append(99)
        value[1].append(99)
        value[2]["a"].append(99)
        got = await s.v.value()
        ctx.emit(copy.deepcopy(got))
        got.append("mutated after read")  # a read value is the caller's own copy

    async def read(s, ctx):
        ctx.emit(await s.v.value())

    out = await sh.run(sh.AsyncScript(v=V("v")), [("k", step), ("k", read)])
    assert out[0] == [1, [2, 3], {"a": [4]}]
    assert out[1] == [1, [2, 3], {"a": [4]}]


async def test_mutating_without_awaiting_the_update(sh):
    """The value is captured at the call, even when the write is still in flight."""

    def step(s, ctx):
        value = [1, 2]
        s.v.update(value)
        value.append(3)
        return s.v.value().then_accept(ctx.emit)

    assert await sh.run(sh.Script(v=V("v")), [("k", step)]) == [[1, 2]]


async def test_two_value_states_are_independent(sh):
    async def step(s, ctx):
        await s.a.update("A")
        ctx.emit((await s.a.value(), await s.b.value()))
        await s.b.update("B")
        await s.a.clear()
        ctx.emit((await s.a.value(), await s.b.value()))

    out = await sh.run(sh.AsyncScript(a=V("a"), b=V("b")), [("k", step)])
    assert out == [("A", None), (None, "B")]


async def test_every_call_returns_a_state_future(sh):
    def step(s, ctx):
        futures = [s.v.update(1), s.v.value(), s.v.clear()]
        ctx.emit([type(f) is ast.StateFuture for f in futures])
        return ast.combine_all(futures)

    assert await sh.run(sh.Script(v=V("v")), [("k", step)]) == [[True, True, True]]


async def test_many_keys_interleaved(sh):
    records = [(k % 17, None) for k in range(200)]
    out = await sh.run(Counter(), records, batch_size=7)
    counts: dict[int, list[int]] = {}
    for k, n in out:
        counts.setdefault(k, []).append(n)
    assert counts == {k: list(range(1, len(v) + 1)) for k, v in counts.items()}
    assert sum(len(v) for v in counts.values()) == 200
