"""StateIterator: on_next, is_empty, async for, to_list, and chunked loading."""

from __future__ import annotations

import asyncio
import re

import pytest

import asyncstate as ast

L = ast.ListStateDescriptor
M = ast.MapStateDescriptor
V = ast.ValueStateDescriptor


async def test_on_next_collects_results_in_order_and_skips_none(sh):
    def step(s, ctx):
        s.l.add_all([1, 2, 3, 4, 5, 6])
        return (s.l.get()
                .then_compose(lambda it: it.on_next(lambda v: v * 10 if v % 2 else None))
                .then_accept(ctx.emit))

    assert await sh.run(sh.Script(l=L("l")), [("k", step)]) == [[10, 30, 50]]


async def test_on_next_calls_fn_on_every_item_even_when_results_are_none(sh):
    seen = []

    def step(s, ctx):
        s.l.add_all(["a", "b", "c"])
        return (s.l.get().then_compose(lambda it: it.on_next(seen.append))
                .then_accept(ctx.emit))

    assert await sh.run(sh.Script(l=L("l")), [("k", step)]) == [[]]
    assert seen == ["a", "b", "c"]


async def test_on_next_fn_returning_a_state_future_contributes_its_value(sh):
    """fn may return a StateFuture (a state read, a completed future): its value is collected;
    plain results are collected as they are and None results are skipped."""

    def step(s, ctx):
        s.v.update(100)
        s.l.add_all([1, 2, 3, 4])

        def fn(item):
            if item == 1:
                return ast.completed_future("one")
            if item == 2:
                return s.v.value().then_apply(lambda v: v + item)
            if item == 3:
                return None
            return item

        return s.l.get().then_compose(lambda it: it.on_next(fn)).then_accept(ctx.emit)

    out = await sh.run(sh.Script(l=L("l"), v=V("v")), [("k", step)])
    assert out == [["one", 102, 4]]


async def test_on_next_on_empty_iterator(sh):
    def step(s, ctx):
        return (s.l.get()
                .then_compose(lambda it: it.on_next(lambda v: v))
                .then_accept(ctx.emit))

    assert await sh.run(sh.Script(l=L("l")), [("k", step)]) == [[]]


async def test_is_empty(sh):
    async def step(s, ctx):
        ctx.emit((await s.l.get()).is_empty())
        await s.l.add(None)  # a None item is still an item
        ctx.emit((await s.l.get()).is_empty())
        ctx.emit((await s.m.entries()).is_empty())
        await s.m.put("k", 1)
        ctx.emit([(await it).is_empty() for it in (s.m.entries(), s.m.keys(), s.m.values())])

    out = await sh.run(sh.AsyncScript(l=L("l"), m=M("m")), [("k", step)])
    assert out == [True, False, True, [False, False, False]]


async def test_async_for(sh):
    async def step(s, ctx):
        await s.l.add_all(["x", "y", "z"])
        got = []
        async for item in await s.l.get():
            got.append(item)
        ctx.emit(got)
        await s.m.put_all({1: "one", 2: "two"})
        got = []
        async for entry in await s.m.entries():
            got.append(entry)
        ctx.emit(sorted(got))

    out = await sh.run(sh.AsyncScript(l=L("l"), m=M("m")), [("k", step)])
    assert out == [["x", "y", "z"], [(1, "one"), (2, "two")]]


async def test_to_list(sh):
    def step(s, ctx):
        s.l.update([3, 1, 2])
        return s.l.get().then_compose(lambda it: it.to_list()).then_accept(ctx.emit)

    assert await sh.run(sh.Script(l=L("l")), [("k", step)]) == [[3, 1, 2]]


# -- chunked loading ----------------------------------------------------------------------

CHUNK = 3
N = 100


async def test_chunked_list_to_list_keeps_order(sh):
    async def step(s, ctx):
        await s.l.add_all(range(N))
        it = await s.l.get()
        ctx.emit((it.is_empty(), await it.to_list()))

    out = await sh.run(sh.AsyncScript(l=L("l")), [("k", step)], iterator_chunk_size=CHUNK)
    assert out == [(False, list(range(N)))]


async def test_chunked_list_async_for_keeps_order(sh):
    async def step(s, ctx):
        for i in range(N):
            s.l.add(i)  # not awaited: each add lands before the get
        got = []
        async for item in await s.l.get():
            got.append(item)
        ctx.emit(got)

    out = await sh.run(sh.AsyncScript(l=L("l")), [("k", step)], iterator_chunk_size=CHUNK)
    assert out == [list(range(N))]


async def test_chunked_on_next_keeps_order_and_collects_futures(sh):
    def step(s, ctx):
        s.v.update(1000)
        s.l.add_all(range(N))

        def fn(item):
            if item % 2:
                return None
            if item % 4 == 0:
                return s.v.value().then_apply(lambda base: base + item)
            return item

        return s.l.get().then_compose(lambda it: it.on_next(fn)).then_accept(ctx.emit)

    out = await sh.run(sh.Script(l=L("l"), v=V("v")), [("k", step)], iterator_chunk_size=CHUNK)
    assert out == [[1000 + i if i % 4 == 0 else i for i in range(0, N, 2)]]


async def test_chunked_map_iterations_see_every_entry_once(sh):
    content = {i: f"v{i}" for i in range(N)}

    async def step(s, ctx):
        await s.m.put_all(content)
        ents = await (await s.m.entries()).to_list()
        keys = []
        async for k in await s.m.keys():
            keys.append(k)
        values = await (await s.m.values()).on_next(lambda v: v)
        ctx.emit((ents, keys, values))

    out = await sh.run(sh.AsyncScript(m=M("m")), [("k", step)], iterator_chunk_size=CHUNK)
    ents, keys, values = out[0]
    assert len(ents) == len(keys) == len(values) == N
    assert dict(ents) == content
    assert all(type(e) is tuple for e in ents)
    assert sorted(keys) == sorted(content)
    assert sorted(values) == sorted(content.values())


async def test_chunked_iteration_across_keys_in_one_batch(sh):
    """Many keys iterate chunked lists at once; each sees its own items, in order."""

    def fill(s, ctx):
        s.l.add_all([(ctx.current_key, i) for i in range(10)])

    def read(s, ctx):
        return (s.l.get().then_compose(lambda it: it.to_list())
                .then_accept(lambda xs: ctx.emit((ctx.current_key, xs))))

    keys = range(8)
    records = [(k, fill) for k in keys] + [(k, read) for k in keys]
    out = await sh.run(sh.Script(l=L("l")), records, iterator_chunk_size=CHUNK, batch_size=5)
    assert sorted(out) == [(k, [[k, i] for i in range(10)]) for k in keys]


async def test_chunk_size_one_and_exact_multiples(sh):
    async def step(s, ctx):
        for n in (1, 2, 3, 4, 6):
            await s.l.update(list(range(n)))
            ctx.emit(await (await s.l.get()).to_list())

    out = await sh.run(sh.AsyncScript(l=L("l")), [("k", step)], iterator_chunk_size=1)
    assert out == [list(range(n)) for n in (1, 2, 3, 4, 6)]


class Boom(Exception):
    pass


@pytest.mark.parametrize("fail_at", [0, CHUNK - 1, CHUNK, 2 * CHUNK + 1, N - 1])
async def test_on_next_fn_raising_fails_the_returned_future_never_the_call(sh, fail_at):
    """Wherever fn raises (first chunk, a chunk loaded later, the last item), on_next
    returns a future failed with that exception, on every backend and chunk size; the
    items after it are not visited."""
    seen = []

    async def step(s, ctx):
        def fn(item):
            seen.append(item)
            if item == fail_at:
                raise Boom(item)
            return item

        await s.l.add_all(range(N))
        it = await s.l.get()
        try:
            fut = it.on_next(fn)
        except Boom:
            ctx.emit("raised from on_next()")
            return
        try:
            await fut
        except Boom as exc:
            ctx.emit(("failed", type(exc).__name__, exc.args))

    out = await sh.run(sh.AsyncScript(l=L("l")), [("k", step)], iterator_chunk_size=CHUNK)
    assert out == [("failed", "Boom", (fail_at,))]
    assert seen == list(range(fail_at + 1))


# -- an iterator belongs to the record that created it ----------------------------------------

_NOT_ITS_RECORD = (r"^an iterator of state 'l' can load its further items only within the "
                   r"record that created it \(the record with key 'a'\); collect the items "
                   r"there, with to_list\(\), and pass the list on$")


async def _consume(it, how):
    if how == "to_list":
        return await it.to_list()
    if how == "on_next":
        return await it.on_next(lambda v: v)
    return [item async for item in it]


@pytest.mark.parametrize("later_key", ["a", "b"])
@pytest.mark.parametrize("how", ["to_list", "on_next", "async for"])
async def test_an_iterator_kept_past_its_record_refuses_to_load_more_in_a_later_one(
        sh, later_key, how):
    """A later chunk is read under the creating record's key. Another record (of the same key
    or not) that resumes a kept iterator gets InvalidStateError instead of items read
    outside its own key's order; the chunk already loaded stays readable, and the run goes
    on."""
    kept = []

    async def make(s, ctx):
        await s.l.add_all(range(N))
        kept.append(await s.l.get())  # first chunk loaded; the rest is not

    async def resume(s, ctx):
        while not kept:  # another key's record may start first
            await asyncio.sleep(0)
        it = kept[0]
        try:
            await _consume(it, how)
        except ast.InvalidStateError as exc:
            ctx.emit(("refused", str(exc), it.is_empty()))
        await s.l.add(-1)  # the record's own state calls still work
        ctx.emit(await (await s.l.get()).to_list())

    out = await sh.run(sh.AsyncScript(l=L("l")), [("a", make), (later_key, resume)],
                       iterator_chunk_size=CHUNK)
    refused, message, empty = out[0]
    assert (refused, empty) == ("refused", False)
    assert re.fullmatch(_NOT_ITS_RECORD, message)
    assert out[1] == ([*range(N), -1] if later_key == "a" else [-1])


async def test_an_iterator_whose_items_are_all_loaded_can_be_read_anywhere(sh):
    """Nothing is left to load, so a later record reads the kept items without a request."""
    kept = []

    async def make(s, ctx):
        await s.l.add_all(range(CHUNK))
        kept.append(await s.l.get())

    async def read(s, ctx):
        while not kept:  # another key's record may start first
            await asyncio.sleep(0)
        ctx.emit(await kept[0].to_list())
        ctx.emit([item async for item in kept[0]])

    out = await sh.run(sh.AsyncScript(l=L("l")), [("a", make), ("b", read)],
                       iterator_chunk_size=CHUNK)
    assert out == [list(range(CHUNK)), list(range(CHUNK))]


async def test_an_iterator_used_outside_any_record_refuses_to_load_more(sh):
    kept = []

    async def make(s, ctx):
        await s.l.add_all(range(N))
        kept.append(await s.l.get())

    await sh.run(sh.AsyncScript(l=L("l")), [("a", make)], iterator_chunk_size=CHUNK)
    with pytest.raises(ast.InvalidStateError, match=_NOT_ITS_RECORD):
        kept[0].to_list()
