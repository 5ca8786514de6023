"""StateIterator: on_next, is_empty, async for, to_list, chunked loading, and the items an
iteration sees while the state changes."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from samples import (
    keys,
    same_key,
    short_text,
)
from shared_functions import (
    Boom,
    StepFn,
    items_of,
    new_backend,
    normalize,
    run_steps,
    slow_examples,
    strict_eq,
    to_list,
)

import asyncstate as ast
from asyncstate import serde

L = ast.ListStateDescriptor
M = ast.MapStateDescriptor
BOUNDARY_CHUNK = 4


@pytest.mark.parametrize("n", [0, 1, BOUNDARY_CHUNK - 1, BOUNDARY_CHUNK, BOUNDARY_CHUNK + 1,
                               2 * BOUNDARY_CHUNK, 3 * BOUNDARY_CHUNK + 1])
async def test_iteration_at_chunk_boundaries(sh, n):
    async def step(s, ctx):
        if n:
            await s.l.add_all(range(n))
            await s.m.put_all({f"k{i:03}": i for i in range(n)})
        lit = await s.l.get()
        items = []
        async for x in lit:
            items.append(x)
        on_next = await (await s.l.get()).on_next(lambda x: x * 2)
        ctx.emit((lit.is_empty(), items, on_next))
        for it_fut in (s.m.entries(), s.m.keys(), s.m.values()):
            it = await it_fut
            ctx.emit((it.is_empty(), sorted(await it.to_list())))
        ctx.emit(await s.m.is_empty())

    out = await sh.run(sh.AsyncScript(l=L("l"), m=M("m")), [("k", step)],
                       iterator_chunk_size=BOUNDARY_CHUNK)
    keys = [f"k{i:03}" for i in range(n)]
    assert out == [(n == 0, list(range(n)), [2 * i for i in range(n)]),
                   (n == 0, list(zip(keys, range(n), strict=True))), (n == 0, keys),
                   (n == 0, list(range(n))), n == 0]


async def test_list_appends_during_chunked_iteration_are_not_visited(sh):
    """The iteration reads the list as it was when it started (heap: a copy; RocksDB: an
    upper bound at the sequence counter), also when the record appends between chunks."""

    async def step(s, ctx):
        await s.l.add_all(range(10))
        seen = []
        async for x in await s.l.get():
            seen.append(x)
            await s.l.add(100 + x)
        ctx.emit(seen)
        ctx.emit(await to_list(s.l.get()))

    out = await sh.run(sh.AsyncScript(l=L("l")), [("k", step)], iterator_chunk_size=3)
    assert out == [list(range(10)), list(range(10)) + [100 + i for i in range(10)]]


async def test_list_appends_from_on_next_callbacks_are_not_visited(sh):
    def chained(s, ctx):
        return s.l.get().then_compose(
            lambda it: it.on_next(lambda x: s.l.add(-x).then_apply(lambda _: x))
        ).then_compose(lambda seen: s.l.get().then_compose(lambda it: it.to_list())
                       .then_apply(lambda after: (seen, after))).then_accept(ctx.emit)

    out = await sh.run(sh.Script(l=L("l")), [("k", lambda s, c: s.l.add_all(range(7))),
                                              ("k", chained)], iterator_chunk_size=2)
    assert out == [(list(range(7)), list(range(7)) + [-i for i in range(7)])]


async def test_overwriting_visited_map_entries_during_chunked_iteration(sh):
    async def step(s, ctx):
        await s.m.put_all({i: i for i in range(10)})
        seen = []
        async for k, v in await s.m.entries():
            seen.append((k, v))
            await s.m.put(k, v * 10)
        ctx.emit(sorted(seen))
        ctx.emit(sorted(await to_list(s.m.entries())))

    out = await sh.run(sh.AsyncScript(m=M("m")), [("k", step)], iterator_chunk_size=3)
    assert out == [[(i, i) for i in range(10)], [(i, i * 10) for i in range(10)]]


async def test_single_chunk_iteration_not_awaited_sees_writes_in_issue_order(sh):
    """Without awaiting, an iteration (one chunk) sees exactly the writes issued before it."""

    def step(s, ctx):
        s.m.put("a", 1)
        first = s.m.entries().then_compose(lambda it: it.to_list())
        s.m.put("b", 2)
        s.m.remove("a")
        empty1 = s.m.is_empty()
        second = s.m.keys().then_compose(lambda it: it.to_list())
        s.l.add(1)
        l1 = s.l.get().then_compose(lambda it: it.to_list())
        s.l.update([7, 8])
        l2 = s.l.get().then_compose(lambda it: it.to_list())
        s.l.clear()
        l3 = s.l.get().then_compose(lambda it: it.to_list())
        s.m.clear()
        empty2 = s.m.is_empty()
        return ast.combine_all([first, empty1, second, l1, l2, l3, empty2]).then_accept(ctx.emit)

    out = await sh.run(sh.Script(l=L("l"), m=M("m")), [("k", step)], iterator_chunk_size=100)
    assert out == [[[("a", 1)], False, ["b"], [1], [7, 8], [], True]]


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
        ctx.emit(await items_of(await s.l.get(), N))

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
        keys = await items_of(await s.m.keys(), N)
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


_NOT_ITS_RECORD = (r"^an iterator of state 'l' can load its further items only within the "
                   r"record that created it \(the record with key 'a'\); collect the items "
                   r"there, with to_list\(\), and pass the list on$")


async def _consume(it, how):
    if how == "to_list":
        return await it.to_list()
    if how == "on_next":
        return await it.on_next(lambda v: v)
    return await items_of(it, N + 1)


@pytest.mark.parametrize("later_key", ["a", "b"])
@pytest.mark.parametrize("how", ["to_list", "on_next", "async for"])
async def test_an_iterator_kept_past_its_record_refuses_to_load_more_in_a_later_one(
        sh, later_key, how):
    """A later chunk is read under the creating record's key. Another record (of the same key
    or not) that resumes a kept iterator gets InvalidStateError instead of items read
    outside its own key's order; the chunk already loaded stays readable, and the run goes
    on."""
    kept = []
    made = asyncio.Event()

    async def make(s, ctx):
        await s.l.add_all(range(N))
        kept.append(await s.l.get())  # first chunk loaded; the rest is not
        made.set()

    async def resume(s, ctx):
        await made.wait()  # another key's record may start first
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
    made = asyncio.Event()

    async def make(s, ctx):
        await s.l.add_all(range(CHUNK))
        kept.append(await s.l.get())
        made.set()

    async def read(s, ctx):
        await made.wait()  # another key's record may start first
        ctx.emit(await kept[0].to_list())
        ctx.emit(await items_of(kept[0], CHUNK))

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


BACKENDS = ["heap", "rocksdb", "remote0-rocksdb"]
CHUNKS = [1, 2, 3, 1000]


async def consume_all_ways(it: ast.StateIterator, s: StepFn, tag: str) -> dict[str, Any]:
    """Every way of consuming one iterator; each result is the items seen, in order."""
    out: dict[str, Any] = {"is_empty": it.is_empty()}
    out["to_list"] = await it.to_list()
    out["to_list_again"] = await it.to_list()
    seen: list[Any] = []
    out["async_for"] = await items_of(it, 10_000)
    out["on_next_plain"] = await it.on_next(lambda x: (seen.append(x), (tag, x))[1])
    out["on_next_calls"] = list(seen)
    out["on_next_completed"] = await it.on_next(lambda x: ast.completed_future((tag, x)))
    out["on_next_state_future"] = await it.on_next(
        lambda x: s.v.value().then_apply(lambda _v: (tag, x)))
    flags = iter(range(10**9))
    out["on_next_some_none"] = await it.on_next(
        lambda x: (tag, x) if next(flags) % 2 else None)
    return out


def check_ways(out: dict[str, Any], expected: list[Any], tag: str, ordered: bool) -> None:
    def canon(xs):
        return xs if ordered else sorted(xs, key=lambda e: serde.canonical_key(
            e[1] if type(e) is tuple and len(e) == 2 and e[0] == tag else e))

    assert out["is_empty"] == (not expected)
    for way in ("to_list", "to_list_again", "async_for", "on_next_calls"):
        assert len(out[way]) == len(expected), way
        assert all(strict_eq(a, b)
                   for a, b in zip(canon(out[way]), canon(expected), strict=True)), way
    # The three ways that wrap each item see the same order as to_list.
    for way in ("on_next_plain", "on_next_completed", "on_next_state_future"):
        assert [x for _t, x in out[way]] == out["to_list"] or all(
            strict_eq(a, b) for (_t, a), b in zip(out[way], out["to_list"], strict=True)), way
        assert len(out[way]) == len(expected), way
    assert [x for _t, x in out["on_next_some_none"]] == out["to_list"][1::2] or all(
        strict_eq(a, b)
        for (_t, a), b in zip(out["on_next_some_none"], out["to_list"][1::2], strict=True))


_list_items = st.lists(st.one_of(st.integers(-5, 5), short_text, st.lists(st.integers(0, 3),
                                                                       max_size=2)), max_size=12)

_map_ops = st.lists(
    st.tuples(keys, st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1), short_text)),
    max_size=12)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("backend_name", BACKENDS)
@settings(max_examples=slow_examples(12), suppress_health_check=[HealthCheck.too_slow])
@given(items=_list_items, ops=_map_ops)
def test_every_way_of_consuming_sees_every_item_once(backend_name, chunk, items, ops):
    model: dict[bytes, tuple[Any, Any]] = {}
    for k, v in ops:
        ck = serde.canonical_key(k)
        if v is None:
            model.pop(ck, None)
        else:
            model[ck] = (serde.decode_key(ck), v)

    async def step(s, ctx):
        await s.v.update(7)
        await s.l.update(items)
        for k, v in ops:
            s.m.put(k, v)  # not awaited: they apply in issue order
        ctx.emit(("list", await consume_all_ways(await s.l.get(), s, "list")))
        ctx.emit(("entries", await consume_all_ways(await s.m.entries(), s, "entries")))
        ctx.emit(("keys", await consume_all_ways(await s.m.keys(), s, "keys")))
        ctx.emit(("values", await consume_all_ways(await s.m.values(), s, "values")))
        ctx.emit(("map_empty", await s.m.is_empty()))

    out = dict(run_steps(backend_name, chunk, [("k", step)]))
    check_ways(out["list"], [normalize(x) for x in items], "list", ordered=True)
    exp_entries = [(k, v) for k, v in model.values()]
    check_ways(out["entries"], exp_entries, "entries", ordered=False)
    assert all(type(e) is tuple for e in out["entries"]["to_list"])
    check_ways(out["keys"], [k for k, _v in model.values()], "keys", ordered=False)
    assert sorted(map(repr, out["values"]["to_list"])) == sorted(
        repr(v) for _k, v in model.values())
    assert out["map_empty"] == (not model)
    # keys()/values() walk the same order as entries()
    ents = out["entries"]["to_list"]
    assert all(same_key(a, b) for a, (b, _v) in zip(out["keys"]["to_list"], ents, strict=True))


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_callback_style_chain_sees_every_item_once(backend_name, chunk):
    n = 25

    def step(s, ctx):
        s.v.update(1000)
        s.l.add_all(range(n))
        calls: list[int] = []

        def fn(x):
            calls.append(x)
            if x % 3 == 0:
                return s.v.value().then_apply(lambda base: base + x)
            if x % 3 == 1:
                return None
            return ast.completed_future(-x)

        return (s.l.get()
                .then_compose(lambda it: it.on_next(fn).then_combine(
                    it.to_list(), lambda a, b: (a, b)))
                .then_accept(lambda ab: ctx.emit((ab[0], ab[1], calls))))

    (got, all_items, calls), = run_steps(backend_name, chunk, [("k", step)])
    assert calls == list(range(n)) and all_items == list(range(n))
    assert got == [1000 + x if x % 3 == 0 else -x for x in range(n) if x % 3 != 1]


@pytest.mark.parametrize("fail_at", [0, 1, 2, 4])
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_on_next_callback_failure_surfaces_the_original_exception(backend_name, chunk, fail_at):
    boom = Boom("item", fail_at)

    async def step(s, ctx):
        await s.l.update(list(range(5)))
        calls: list[int] = []

        def fn(x):
            calls.append(x)
            if x == fail_at:
                raise boom
            return x

        it = await s.l.get()
        try:
            await it.on_next(fn)
        except Boom as exc:
            ctx.emit((exc is boom, list(calls)))
        # the iterator is still usable afterwards
        ctx.emit(await it.to_list())

    out = run_steps(backend_name, chunk, [("k", step)])
    assert out == [(True, list(range(fail_at + 1))), list(range(5))]


@pytest.mark.parametrize("chunk", [1, 2, 1000])
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_on_next_callback_failure_in_plain_chain_fails_run_with_it(backend_name, chunk):
    boom = Boom("chain")

    def step(s, ctx):
        s.l.update(list(range(5)))

        def fn(x):
            if x == 3:
                raise boom
            return x

        return s.l.get().then_compose(lambda it: it.on_next(fn)).then_accept(ctx.emit)

    with pytest.raises(Boom) as info:
        run_steps(backend_name, chunk, [("k", step)])
    assert info.value is boom


@pytest.mark.parametrize("chunk", [1, 3, 1000])
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_on_next_returning_a_failed_future_fails_with_its_exception(backend_name, chunk):
    boom = Boom("future")

    async def step(s, ctx):
        await s.l.update(list(range(6)))
        it = await s.l.get()
        def fail_on_4(y):
            if y == 4:
                raise boom
            return y

        caught: Any = None
        try:
            await it.on_next(lambda x: ast.completed_future(x).then_apply(fail_on_4))
        except Boom as exc:
            caught = exc
        ctx.emit(caught is boom)

    assert run_steps(backend_name, chunk, [("k", step)]) == [True]


@pytest.mark.parametrize("chunk", [1, 2, 1000])
@pytest.mark.parametrize("backend_name", BACKENDS)
async def test_iterator_used_outside_its_record(backend_name, chunk, tmp_path):
    """Documented: chunks load within the record; state access outside a record raises
    InvalidStateError. An iterator whose items are all loaded needs no access."""

    def fill(s, ctx):
        s.l.update(list(range(5)))
        return s.l.get().then_accept(s.saved.append)

    fn = StepFn()
    async with ast.KeyedOperator(fn, key_selector=lambda r: r[0],
                                 backend=new_backend(backend_name, tmp_path),
                                 config=ast.AsyncStateConfig(iterator_chunk_size=chunk)) as op:
        await op.process(("k", fill))
        await op.drain()
        it = fn.saved[0]
        assert it.is_empty() is False
        if chunk >= 5:
            assert it.to_list().result() == list(range(5))
            assert it.on_next(lambda x: x * 2).result() == [0, 2, 4, 6, 8]
            assert await items_of(it, 5) == list(range(5))
        else:
            with pytest.raises(ast.InvalidStateError):
                it.to_list()
            with pytest.raises(ast.InvalidStateError):
                it.on_next(lambda x: x)
            with pytest.raises(ast.InvalidStateError):
                await items_of(it, 5)


@pytest.mark.parametrize("chunk", [1, 2, 1000])
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_list_iteration_ignores_later_appends(backend_name, chunk):
    """docs/backends.md: a list iteration never visits elements appended after it started
    (the heap reads a copy, RocksDB bounds the scan by the sequence counter)."""

    async def step(s, ctx):
        await s.l.update([0, 1, 2, 3])
        it = await s.l.get()
        await s.l.add(99)
        ctx.emit(await it.to_list())
        ctx.emit(await (await s.l.get()).to_list())

    assert run_steps(backend_name, chunk, [("k", step)]) == [[0, 1, 2, 3], [0, 1, 2, 3, 99]]


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_items_read_are_fresh_copies(backend_name):
    async def step(s, ctx):
        src = [[1, 2], {"a": [3]}]
        await s.l.add_all(src)
        await s.m.put("k", src)
        await s.v.update(src)
        src[0].append("mutated")
        src[1]["a"].append("mutated")
        first = await (await s.l.get()).to_list()
        first[0].append("x")
        v = await s.v.value()
        v[1]["a"].append("y")
        mv = await s.m.get("k")
        mv.append("z")
        ctx.emit((await (await s.l.get()).to_list(), await s.v.value(), await s.m.get("k")))

    expected = [[1, 2], {"a": [3]}]
    assert run_steps(backend_name, 2, [("k", step)]) == [(expected, expected, expected)]


_LONG_ITERATION_SCRIPT = textwrap.dedent("""
    import sys
    import asyncstate as ast

    N = int(sys.argv[1])

    class F(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.l = ctx.get_list_state(ast.ListStateDescriptor("l"))

        async def process_element(self, record, ctx):
            await self.l.update(list(range(N)))
            it = await self.l.get()
            ctx.emit(len(await it.to_list()))
            ctx.emit(len(await it.on_next(lambda x: x)))

    out = ast.run(F(), ["k"], key_selector=lambda r: r,
                  backend=ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0),
                  config=ast.AsyncStateConfig(iterator_chunk_size=1))
    assert out == [N, N], out
    print("ok")
""")


def _run_long_iteration(n: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _LONG_ITERATION_SCRIPT, str(n)],
                          capture_output=True, text=True, timeout=300, check=False)


def test_long_chunked_iteration_in_async_for_is_flat():
    """async for walks any number of chunks; to_list/on_next are fine for a few hundred."""
    async def step(s, ctx):
        await s.l.update(list(range(150)))
        it = await s.l.get()
        ctx.emit((await items_of(it, 150), await it.to_list(), await it.on_next(lambda x: x)))

    (a, b, c), = run_steps("remote0", 1, [("k", step)])
    assert a == b == c == list(range(150))


def test_to_list_over_many_asynchronously_loaded_chunks():
    proc = _run_long_iteration(50_000)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (
        proc.returncode, proc.stderr[-1500:])
