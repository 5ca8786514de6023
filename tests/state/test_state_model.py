"""Every state kind against a sequential dict model: random programs of unawaited calls, and
many unawaited reads and writes in one batch."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from shared_functions import (
    LOOP_NAMES,
    by_key_bytes,
    canon,
    normalize,
    run_on_every_backend,
    slow_examples,
    strict_eq,
)

import asyncstate as ast

V = ast.ValueStateDescriptor
L = ast.ListStateDescriptor
M = ast.MapStateDescriptor
R = ast.ReducingStateDescriptor


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
                    store[slot] = normalize(op[1])
                r = None
            elif name in ("v.value", "r.get"):
                r = store.get(slot)
            elif name.endswith(".clear"):
                store.pop(slot, None)
                r = None
            elif name == "l.add":
                store.setdefault(slot, []).append(normalize(op[1]))
                r = None
            elif name == "l.add_all":
                if op[1]:
                    store.setdefault(slot, []).extend(normalize(x) for x in op[1])
                r = None
            elif name == "l.update":
                if op[1]:
                    store[slot] = [normalize(x) for x in op[1]]
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
                        m[canon(k)] = (normalize(k), normalize(v))
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
@given(program=_programs, chunk=st.sampled_from([1, 2, 1000]), loop=st.sampled_from(LOOP_NAMES))
def test_parity_random_programs_match_a_sequential_dict_model(state_helpers, program, chunk,
                                                              loop):
    expected = _model_run(program)
    records = [(key, i, ops) for i, (key, ops) in enumerate(program)]
    results = run_on_every_backend(state_helpers, _Program, records, loop=loop,
                                   iterator_chunk_size=chunk, batch_size=7)
    for backend_id, out in results.items():
        assert not (isinstance(out, tuple) and out[:1] == ("raised",)), (backend_id, out)
        assert strict_eq(sorted(out, key=lambda e: e[0]), expected, dict_order=False), backend_id
