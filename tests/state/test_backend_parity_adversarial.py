"""Adversarial parity tests: every state operation must give identical results on HeapBackend
and RocksDBBackend (and both behind SimulatedRemoteBackend).

Tests taking `sh` run once per backend of `SUPPORTED_BACKENDS` (tests/state/conftest.py) and
compare with an expected value. Tests named ``test_parity_*`` run every backend themselves and
compare the backends with each other (and with a sequential dict model for the property
test).
"""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shared_functions import slow_examples

import asyncstate as ast
from asyncstate.runtime.requests import StateKind

V = ast.ValueStateDescriptor
L = ast.ListStateDescriptor
M = ast.MapStateDescriptor
R = ast.ReducingStateDescriptor
A = ast.AggregatingStateDescriptor


def canon(key: Any) -> bytes:
    """The canonical bytes of a key (what every backend identifies keys by)."""
    return msgpack.packb(key, use_bin_type=True)


def strict_eq(a: Any, b: Any) -> bool:
    """Equality that also compares types exactly (list vs tuple, int vs bool vs float) and
    floats by their bits (so -0.0 != 0.0 and NaN == NaN)."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return canon(a) == canon(b)
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(strict_eq(x, y) for x, y in zip(a, b, strict=True))
    if type(a) is dict:
        if len(a) != len(b):
            return False
        bk = {canon(k): (k, v) for k, v in b.items()}
        for k, v in a.items():
            other = bk.get(canon(k))
            if other is None or not strict_eq(k, other[0]) or not strict_eq(v, other[1]):
                return False
        return True
    return a == b


def by_key_bytes(entries: list[Any], key=lambda e: e[0]) -> list[Any]:
    """Map entries sorted by the canonical bytes of their user key (order is unspecified)."""
    return sorted(entries, key=lambda e: canon(key(e)))


async def to_list(fut: Any) -> list[Any]:
    return await (await fut).to_list()


def _factories(state_helpers: Any) -> dict[str, Any]:
    return dict(state_helpers.factories)


def run_on_every_backend(state_helpers: Any, make_fn: Any, records: list[Any],
                         **config: Any) -> dict[str, Any]:
    """Run a fresh function from `make_fn()` over `records` on every backend; outputs (or the
    failure's type and message) by backend id. Each RocksDB gets its own fresh directory."""
    results: dict[str, Any] = {}
    for backend_id, factory in _factories(state_helpers).items():
        with tempfile.TemporaryDirectory(prefix="asyncstate-parity-") as tmp:
            try:
                results[backend_id] = ast.run(
                    make_fn(), records, key_selector=lambda r: r[0],
                    backend=factory(Path(tmp)), config=ast.AsyncStateConfig(**config))
            except Exception as exc:  # noqa: BLE001 - compared between backends
                results[backend_id] = ("raised", type(exc).__name__, str(exc))
    return results


# -- record keys of unusual types -----------------------------------------------------------

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
        assert strict_eq(out[canon(k)], expected), (k, out[canon(k)])


async def test_list_key_and_tuple_key_share_state_but_nested_containers_differ(sh):
    async def step(s, ctx):
        n = (await s.v.value() or 0) + 1
        await s.v.update(n)
        ctx.emit((ctx.record[2], n))

    records = [([1, [2]], step, "a"), ((1, (2,)), step, "a"), ([1, (2,)], step, "a"),
               ([[1, 2]], step, "b"), ([(1, 2)], step, "b"), ([1, 2], step, "c")]
    out = await sh.run(sh.AsyncScript(v=V("v")), records)
    assert sorted(out) == [("a", 1), ("a", 2), ("a", 3), ("b", 1), ("b", 2), ("c", 1)]


# -- map user keys ------------------------------------------------------------------------

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
    assert strict_eq(by_key_bytes(ents), by_key_bytes(expected))
    assert strict_eq(by_key_bytes(keys, key=lambda k: k), [k for k, _ in by_key_bytes(expected)])
    assert strict_eq(sorted(values, key=canon), sorted((v for _, v in expected), key=canon))
    assert (empty, it_empty) == (False, False)
    assert strict_eq(got, [v for _, v in expected])
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


# -- values -------------------------------------------------------------------------------

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
        assert strict_eq(got, (n, [n, n], n, n)), (value, got)
    assert strict_eq(ents, [(i, sh.normalize(v)) for i, v in enumerate(TUPLE_VALUES)])


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
        assert strict_eq(got, (v, v)), (v, got)
    assert strict_eq(listed, EDGE_SCALARS)


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


# -- ListState: empty inputs, None, generators ----------------------------------------------

async def test_list_empty_inputs_none_items_and_iterables(sh):
    async def step(s, ctx):
        await s.l.add_all([])
        ctx.emit(("empty add_all", (await s.l.get()).is_empty()))
        await s.l.update([])
        ctx.emit(("empty update", (await s.l.get()).is_empty()))
        await s.l.add(None)
        await s.l.add_all([None, None])
        ctx.emit(("nones", await to_list(s.l.get())))
        await s.l.update(x for x in (1, 2))
        await s.l.add_all(range(3, 5))
        await s.l.add_all((5, (6,)))
        ctx.emit(("iterables", await to_list(s.l.get())))
        for bad in (None, "ab", b"ab", {"a": 1}, 3):
            for call in (s.l.add_all, s.l.update):
                try:
                    call(bad)
                except TypeError:
                    ctx.emit(("TypeError", type(bad).__name__))
        await s.l.add_all([])
        ctx.emit(("after", await to_list(s.l.get())))
        await s.l.update([])
        ctx.emit(("cleared", await to_list(s.l.get()), (await s.l.get()).is_empty()))

    out = await sh.run(sh.AsyncScript(l=L("l")), [("k", step)], iterator_chunk_size=2)
    assert out == [
        ("empty add_all", True), ("empty update", True), ("nones", [None, None, None]),
        ("iterables", [1, 2, 3, 4, 5, [6]]),
        *[("TypeError", t) for t in ("NoneType", "str", "bytes", "dict", "int") for _ in "ab"],
        ("after", [1, 2, 3, 4, 5, [6]]), ("cleared", [], True),
    ]


async def test_clear_then_add_without_awaiting_across_records(sh):
    """clear() followed by writes, none of them awaited, within one record and across
    records of the same key (and another key in between)."""

    def fill(s, ctx):
        s.l.add_all(range(5))
        s.m.put_all({i: i for i in range(5)})
        s.v.update("old")
        return None

    def step(s, ctx):
        s.l.clear()
        s.l.add("a")
        s.l.add_all(["b", "c"])
        s.m.clear()
        s.m.put(9, "nine")
        s.v.clear()
        f1 = s.v.value()
        s.v.update("new")
        return ast.combine_all([
            s.l.get().then_compose(lambda it: it.to_list()),
            s.m.entries().then_compose(lambda it: it.to_list()),
            s.m.get(0), s.m.contains(9), f1, s.v.value(), s.m.is_empty(),
        ]).then_accept(lambda got: ctx.emit(("step", got)))

    def again(s, ctx):
        s.l.update([])
        s.l.add("z")
        s.m.remove(9)
        return ast.combine_all([
            s.l.get().then_compose(lambda it: it.to_list()), s.m.is_empty(),
            s.m.keys().then_apply(lambda it: it.is_empty()), s.v.value(),
        ]).then_accept(lambda got: ctx.emit(("again", got)))

    records = [("k", fill), ("other", fill), ("k", step), ("other", step), ("k", again)]
    out = await sh.run(sh.Script(v=V("v"), l=L("l"), m=M("m")), records,
                       iterator_chunk_size=2, batch_size=3)
    step_out = ["step", [["a", "b", "c"], [(9, "nine")], None, True, None, "new", False]]
    assert sorted(out, key=repr) == sorted(
        [tuple(step_out), tuple(step_out), ("again", [["z"], True, True, "new"])], key=repr)


# -- iteration: chunk boundaries, writes during iteration ---------------------------------

CHUNK = 4


@pytest.mark.parametrize("n", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 3 * CHUNK + 1])
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
                       iterator_chunk_size=CHUNK)
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


async def test_many_unawaited_point_reads_and_writes_in_one_batch(sh):
    """More point reads than RocksDB reads inline and than one multi-get part holds, with
    writes of some keys in between: every read sees exactly the writes issued before it."""
    n = 5000

    def fill(s, ctx):
        return ast.combine_all([s.m.put_all({i: i * 2 for i in range(0, n, 2)}),
                                s.n.put_all({str(i): i for i in range(0, n, 3)})])

    def step(s, ctx):
        futs = []
        for i in range(n):
            futs.append(s.m.get(i))
            futs.append(s.n.contains(str(i)))
            if i % 500 == 0:
                s.m.put(i + 1, "new")
                s.m.remove(i)
                futs.append(s.m.get(i + 1))
                futs.append(s.m.contains(i))
        return ast.combine_all(futs).then_accept(ctx.emit)

    model = {i: i * 2 for i in range(0, n, 2)}
    expected = []
    for i in range(n):
        expected.append(model.get(i))
        expected.append(i % 3 == 0)
        if i % 500 == 0:
            model[i + 1] = "new"
            model.pop(i, None)
            expected += ["new", False]
    out = await sh.run(sh.Script(m=M("m"), n=M("n")), [("k", fill), ("k", step)],
                       batch_size=50_000)
    assert out == [expected]


# -- namespaces -----------------------------------------------------------------------------

NAMESPACES = [None, b"", "", 0, False, 0.0, -0.0, [], [None], -1, b"\xff", (1, "a"),
              2**64 - 1]


async def test_unusual_namespaces_are_isolated(sh):
    def write(s, ctx):
        for i, ns in enumerate(NAMESPACES):
            for st_ in (s.v, s.l, s.m, s.r):
                st_.set_current_namespace(ns)
            s.v.update(i)
            s.l.add_all([i, i])
            s.m.put(ns, i)
            s.r.add(i)
            s.r.add(1)
        return None

    def read(s, ctx):
        futs = []
        for ns in NAMESPACES:
            for st_ in (s.v, s.l, s.m, s.r):
                st_.set_current_namespace(ns)
            futs += [s.v.value(), s.l.get().then_compose(lambda it: it.to_list()),
                     s.m.entries().then_compose(lambda it: it.to_list()), s.r.get()]
        return ast.combine_all(futs).then_accept(ctx.emit)

    def clear_some(s, ctx):
        for idx in (0, 3, 7):
            for st_ in (s.v, s.l, s.m, s.r):
                st_.set_current_namespace(NAMESPACES[idx])
                st_.clear()
        return None

    descriptors = dict(v=V("v"), l=L("l"), m=M("m"), r=R("r", lambda a, b: a + b))
    out = await sh.run(sh.Script(**descriptors),
                       [("k", write), ("k", read), ("k", clear_some), ("k", read)],
                       iterator_chunk_size=1)
    first, second = out
    expected = []
    for i, ns in enumerate(NAMESPACES):
        expected += [i, [i, i], [(sh.normalize(ns), i)], i + 1]
    assert strict_eq(first, expected)
    for idx in (0, 3, 7):
        expected[4 * idx:4 * idx + 4] = [None, [], [], None]
    assert strict_eq(second, expected)


# -- ReducingState / AggregatingState edge cases ------------------------------------------

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


# -- serialization errors -------------------------------------------------------------------

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


# -- cross-backend checkpoints with unusual keys --------------------------------------------

def _ckpt_fn():
    return _StateFn(v=V("v"), l=L("l"), m=M("m"), r=R("r", lambda a, b: a + b))


class _StateFn(ast.KeyedProcessFunction):
    def __init__(self, **descriptors):
        self.descriptors = descriptors

    def open(self, ctx):
        getters = {V: ctx.get_state, L: ctx.get_list_state, M: ctx.get_map_state,
                   R: ctx.get_reducing_state}
        for name, d in self.descriptors.items():
            setattr(self, name, getters[type(d)](d))

    def process_element(self, record, ctx):
        if record[1] == "w":
            self.v.update(("v", record[0]))
            self.l.add_all([record[0], -0.0, (1,)])
            self.m.put_all({0: 0, b"": "", (1, (2,)): {(1, 2): (3,)}})
            self.m.put(0.0, -0.0)
            self.r.add(2**63)
            self.m.set_current_namespace(b"\xff")
            self.m.put(-1, "ns")
            return None
        self.m.set_current_namespace(b"\xff")
        in_ns = self.m.entries().then_compose(lambda it: it.to_list())
        self.m.set_current_namespace(None)
        return ast.combine_all([
            self.v.value(), self.l.get().then_compose(lambda it: it.to_list()),
            self.m.entries().then_compose(lambda it: it.to_list()).then_apply(by_key_bytes),
            self.r.get(), in_ns,
        ]).then_accept(lambda got: ctx.emit((canon(record[0]), got)))


CKPT_KEYS = [b"k", "k", -1, 2**64 - 1, -0.0, 0.0, None, True, "", [], [[1], b"\xff"]]


@pytest.mark.parametrize("source", ["heap", "rocksdb"])
def test_parity_checkpoint_moves_between_backends(state_helpers, tmp_path, source):
    factories = _factories(state_helpers)
    config = ast.AsyncStateConfig(max_parallelism=8)

    async def snapshot():
        async with ast.KeyedOperator(_ckpt_fn(), key_selector=lambda r: r[0],
                                     backend=factories[source](tmp_path / "src"),
                                     config=config) as op:
            for k in CKPT_KEYS:
                await op.process((k, "w"))
            return await op.snapshot(str(tmp_path / "chk"), 1)

    async def restore(target):
        async with ast.KeyedOperator(_ckpt_fn(), key_selector=lambda r: r[0],
                                     backend=factories[target](tmp_path / f"dst-{target}"),
                                     config=config, restore_from=path) as op:
            for k in CKPT_KEYS:
                await op.process((k, "r"))
            await op.drain()
            return dict(op.outputs())

    (tmp_path / "src").mkdir()
    path = asyncio.run(snapshot())
    for target in ("heap", "rocksdb"):
        (tmp_path / f"dst-{target}").mkdir()
        out = asyncio.run(restore(target))
        assert len(out) == len(CKPT_KEYS)
        for k in CKPT_KEYS:
            n = state_helpers.normalize(k)
            expected = [["v", n], [n, -0.0, [1]],
                        by_key_bytes([(0, 0), (0.0, -0.0), (b"", ""), ([1, [2]], {(1, 2): [3]})]),
                        2**63, [(-1, "ns")]]
            assert strict_eq(out[canon(k)], expected), (target, k, out[canon(k)])


# -- property: random programs against a sequential dict model ------------------------------

_scalar_keys = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
                | st.floats(allow_nan=False) | st.text(max_size=5) | st.binary(max_size=5))
_keys = st.recursive(_scalar_keys, lambda inner: st.lists(inner, max_size=2)
                     | st.tuples(inner, inner), max_leaves=3)
_hashable = st.recursive(_scalar_keys, lambda inner: st.tuples(inner, inner), max_leaves=3)
_vals = st.recursive(_scalar_keys, lambda inner: st.lists(inner, max_size=3)
                     | st.tuples(inner, inner) | st.dictionaries(_hashable, inner, max_size=2),
                     max_leaves=6)
_nss = st.sampled_from([None, "ns", 0, -0.0, b""])

_ops = st.one_of(
    st.tuples(st.just("v.update"), _vals),
    st.tuples(st.just("v.value")),
    st.tuples(st.just("v.clear")),
    st.tuples(st.just("l.add"), _vals),
    st.tuples(st.just("l.add_all"), st.lists(_vals, max_size=6)),
    st.tuples(st.just("l.update"), st.lists(_vals, max_size=6)),
    st.tuples(st.just("l.get")),
    st.tuples(st.just("l.clear")),
    st.tuples(st.just("m.put"), _keys, _vals),
    st.tuples(st.just("m.put_all"), st.dictionaries(_hashable, _vals, max_size=4)),
    st.tuples(st.just("m.get"), _keys),
    st.tuples(st.just("m.contains"), _keys),
    st.tuples(st.just("m.remove"), _keys),
    st.tuples(st.just("m.entries")),
    st.tuples(st.just("m.keys")),
    st.tuples(st.just("m.values")),
    st.tuples(st.just("m.is_empty")),
    st.tuples(st.just("m.clear")),
    st.tuples(st.just("r.add"), st.integers(-1000, 1000)),
    st.tuples(st.just("r.get")),
    st.tuples(st.just("r.clear")),
    st.tuples(st.just("ns"), _nss),
)
_programs = st.lists(st.tuples(st.sampled_from(["a", b"a", 1, (1,)]),
                               st.lists(_ops, min_size=1, max_size=12)), min_size=1, max_size=5)


def _norm(v: Any) -> Any:
    """What a stored value reads back as (tuples to lists, dict keys kept)."""
    if type(v) in (list, tuple):
        return [_norm(x) for x in v]
    if type(v) is dict:
        return {k: _norm(x) for k, x in v.items()}
    return v


def _model_run(program: list[Any]) -> list[Any]:
    store: dict[tuple[bytes, str, bytes], Any] = {}
    out = []
    for index, (key, ops) in enumerate(program):
        kb = canon(key)
        ns = canon(None)
        results = []
        for op in ops:
            name = op[0]
            state = name[0]
            slot = (kb, state, ns)
            if name == "ns":
                ns = canon(op[1])
                r = None
            elif name == "v.update":
                if op[1] is None:
                    store.pop(slot, None)
                else:
                    store[slot] = _norm(op[1])
                r = None
            elif name in ("v.value", "r.get"):
                r = store.get(slot)
            elif name.endswith(".clear"):
                store.pop(slot, None)
                r = None
            elif name == "l.add":
                store.setdefault(slot, []).append(_norm(op[1]))
                r = None
            elif name == "l.add_all":
                if op[1]:
                    store.setdefault(slot, []).extend(_norm(x) for x in op[1])
                r = None
            elif name == "l.update":
                if op[1]:
                    store[slot] = [_norm(x) for x in op[1]]
                else:
                    store.pop(slot, None)
                r = None
            elif name == "l.get":
                r = list(store.get(slot, []))
            elif name in ("m.put", "m.put_all"):
                items = [(op[1], op[2])] if name == "m.put" else list(op[1].items())
                m = store.setdefault(slot, {})
                for k, v in items:
                    if v is None:
                        m.pop(canon(k), None)
                    else:
                        m[canon(k)] = (_norm(k), _norm(v))
                if not m:
                    del store[slot]
                r = None
            elif name == "m.remove":
                m = store.get(slot, {})
                m.pop(canon(op[1]), None)
                if not m:
                    store.pop(slot, None)
                r = None
            elif name == "m.get":
                r = store.get(slot, {}).get(canon(op[1]), (None, None))[1]
            elif name == "m.contains":
                r = canon(op[1]) in store.get(slot, {})
            elif name == "m.entries":
                r = [store[slot][k] for k in sorted(store.get(slot, {}))]
            elif name == "m.keys":
                r = [store[slot][k][0] for k in sorted(store.get(slot, {}))]
            elif name == "m.values":
                r = sorted((v for _, v in store.get(slot, {}).values()), key=canon)
            elif name == "m.is_empty":
                r = not store.get(slot)
            elif name == "r.add":
                old = store.get(slot)
                store[slot] = op[1] if old is None else old + op[1]
                r = None
            else:  # pragma: no cover
                raise AssertionError(name)
            results.append(r)
        out.append((index, results))
    return out


class _Program(ast.KeyedProcessFunction):
    def open(self, ctx):
        self.v = ctx.get_state(V("v"))
        self.l = ctx.get_list_state(L("l"))
        self.m = ctx.get_map_state(M("m"))
        self.r = ctx.get_reducing_state(R("r", lambda a, b: a + b))

    async def process_element(self, record, ctx):
        _, index, ops = record
        results = []
        for op in ops:
            name = op[0]
            if name == "ns":
                for s in (self.v, self.l, self.m, self.r):
                    s.set_current_namespace(op[1])
                r = None
            else:
                state, method = name.split(".")
                call = getattr(getattr(self, state), method)
                r = await call(*op[1:])
                if isinstance(r, object) and type(r).__name__ == "StateIterator":
                    items = await r.to_list()
                    assert r.is_empty() == (not items)
                    if method == "entries":
                        assert all(type(e) is tuple for e in items)
                        r = [tuple(e) for e in by_key_bytes(items)]
                    elif method == "keys":
                        r = by_key_bytes(items, key=lambda k: k)
                    elif method == "values":
                        r = sorted(items, key=canon)
                    else:
                        r = items
            results.append(r)
        ctx.emit((index, results))


@settings(max_examples=slow_examples(40))
@given(program=_programs, chunk=st.sampled_from([1, 2, 1000]))
def test_parity_random_programs_match_a_sequential_dict_model(state_helpers, program, chunk):
    expected = _model_run(program)
    records = [(key, i, ops) for i, (key, ops) in enumerate(program)]
    results = run_on_every_backend(state_helpers, _Program, records,
                                   iterator_chunk_size=chunk, batch_size=7)
    for backend_id, out in results.items():
        assert not (isinstance(out, tuple) and out[:1] == ("raised",)), (backend_id, out)
        assert strict_eq(sorted(out, key=lambda e: e[0]), expected), backend_id


# -- bugs -----------------------------------------------------------------------------------

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


@pytest.mark.parametrize(("name", "error", "message"), [
    ("a\x00b", ast.ConfigError, r"^state name must be a str without NUL characters, got "),
    ("v\udc80", ast.ConfigError, r"^state name must be a str that encodes to UTF-8 "),
    ("", TypeError, r"^state name must be a non-empty str, got ''$"),
    (b"v", TypeError, r"^state name must be a non-empty str, got b'v'$"),
])
def test_every_backend_refuses_the_same_state_names_and_stays_usable(backend, name, error,
                                                                      message):
    try:
        with pytest.raises(error, match=message):
            backend.register_state(name, StateKind.VALUE)
        with pytest.raises(TypeError, match=r"^kind must be a StateKind, got 'value'$"):
            backend.register_state("v", "value")
        first = backend.register_state("v", StateKind.VALUE)
        assert backend.register_state("v", StateKind.VALUE) is first
        with pytest.raises(ValueError, match=r"^state 'v' is already registered as value "):
            backend.register_state("v", StateKind.LIST)
    finally:
        backend.close()
