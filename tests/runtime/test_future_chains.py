"""Long and deep StateFuture chains: completions run iteratively with a flat stack, in order,
and random graphs of combinators complete like a model."""

from __future__ import annotations

import asyncio
import operator
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from runtime_harness import stack_depth
from shared_functions import BaseBoom, run_python

import asyncstate as ast
from asyncstate import _compiled
from asyncstate.runtime import future as future_module
from asyncstate.runtime.context import RecordContext
from asyncstate.runtime.future import StateFuture

N = 20_000


class Limited:
    """Run a completion with the recursion limit a few hundred frames above the caller's
    (Python build: a chain that recursed per link would raise RecursionError)."""

    def __enter__(self) -> Limited:
        self.old = sys.getrecursionlimit()
        sys.setrecursionlimit(stack_depth() + 300)
        return self

    def __exit__(self, *exc_info: object) -> None:
        sys.setrecursionlimit(self.old)


def test_a_long_then_apply_chain_completes_in_order_with_a_flat_stack() -> None:
    head: StateFuture[int] = StateFuture()
    seen: list[int] = []
    depths: list[int] = []

    def step(v: int) -> int:
        seen.append(v)
        depths.append(stack_depth())
        return v + 1

    fut: StateFuture[int] = head
    for _ in range(N):
        fut = fut.then_apply(step)
    base = stack_depth()
    with Limited():
        head._complete(0)
    assert fut.result() == N
    assert seen == list(range(N))
    assert max(depths) - base < 250


def test_a_failure_travels_down_a_long_chain_skipping_every_callback() -> None:
    head: StateFuture[int] = StateFuture()
    called: list[int] = []
    fut = head.then_apply(lambda v: 1 // v)
    for _ in range(N):
        fut = fut.then_apply(lambda v: called.append(v) or v)
    with Limited():
        head._complete(0)
    assert called == []
    assert isinstance(fut.exception(), ZeroDivisionError)


def test_nested_then_compose_forwards_a_long_way_back() -> None:
    # A loop written as recursion: each level composes the next one onto a future that is
    # still pending, so the last completion forwards back through every level.
    heads: list[StateFuture[int]] = [StateFuture() for _ in range(N)]

    def level(i: int) -> StateFuture[int]:
        if i == N - 1:
            return heads[i].then_apply(lambda v: v * 2)
        return heads[i].then_compose(lambda _: level(i + 1))

    top = level(0)
    with Limited():
        for i, h in enumerate(heads):
            h._complete(i)
    assert top.result() == 2 * (N - 1)


def test_nested_combine_all_and_then_combine_complete_a_long_way() -> None:
    head: StateFuture[int] = StateFuture()
    fut: StateFuture[Any] = head
    for _ in range(N // 2):
        fut = ast.combine_all([fut]).then_apply(lambda xs: xs[0] + 1)
        fut = fut.then_combine(ast.completed_future(1), operator.add)
    with Limited():
        head._complete(0)
    assert fut.result() == N


def test_callbacks_of_one_future_run_in_registration_order_around_a_deep_chain() -> None:
    # The head's second callback runs before the tail of its first one's chain (which is
    # past the deferral depth); each future's own callbacks still run in the order they
    # were registered, and the whole chain is done when the completing call returns.
    head: StateFuture[int] = StateFuture()
    order: list[str] = []
    deep: StateFuture[int] = head
    for _ in range(200):
        deep = deep.then_apply(lambda v: v + 1)
    deep.then_accept(lambda v: order.append(f"deep end {v}"))
    deep.then_accept(lambda v: order.append("deep end, second"))
    head.then_accept(lambda v: order.append("head second"))
    head._complete(0)
    assert order == ["head second", "deep end 200", "deep end, second"]
    assert deep.done()


@pytest.mark.parametrize("links", range(28, 38))
def test_a_future_that_looks_done_has_run_its_callbacks(links: int) -> None:
    # Around the deferral depth: a callback of the head registers on the end of a chain;
    # it must run after the callback registered there first, and whenever the end looks
    # done, its first callback must already have run.
    head: StateFuture[int] = StateFuture()
    order: list[str] = []
    end: StateFuture[int] = head
    for _ in range(links):
        end = end.then_apply(lambda v: v + 1)
    end.then_accept(lambda v: order.append("first"))

    def look(_: int) -> None:
        if end.done():
            assert order == ["first"], "the end looks done before its callbacks ran"
        end.then_accept(lambda v: order.append("second"))

    head.then_accept(look)
    head._complete(0)
    assert order == ["first", "second"]
    assert end.result() == links


@pytest.mark.parametrize("links", range(28, 36))
def test_combine_all_of_two_failing_deep_chains_fails_once_with_the_first(links: int) -> None:
    # At one length, the first failure reaches the combined future exactly at the deferral
    # depth, so its completion waits while the second failure arrives.
    head: StateFuture[int] = StateFuture()

    def failing_chain(tag: str) -> StateFuture[int]:
        def boom(v: int) -> int:
            raise ValueError(tag)
        fut = head.then_apply(boom)
        for _ in range(links - 1):
            fut = fut.then_apply(lambda v: v)
        return fut

    first, second = failing_chain("first"), failing_chain("second")
    combined = ast.combine_all([first, second]).then_apply(lambda xs: xs)
    head._complete(0)
    exc = combined.exception()
    assert isinstance(exc, ValueError) and str(exc) == "first"


@pytest.mark.parametrize("links", [31, 32, 33])
async def test_a_read_awaited_after_a_chained_write_sees_it(links: int) -> None:
    # The write is chained to the end of a long chain on the first read; the record then
    # awaits that end and reads again: the read must come after the write.
    class ReadAfterChainedWrite(ast.KeyedProcessFunction):
        def open(self, ctx: ast.RuntimeContext) -> None:
            self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

        async def process_element(self, value: Any, ctx: ast.Context) -> None:
            first = self.count.value()
            end = first
            for _ in range(links):
                end = end.then_apply(lambda c: c)
            written = end.then_compose(lambda c: self.count.update((c or 0) + 1))
            await first
            await end
            ctx.emit(await self.count.value())
            await written

    out = await ast.KeyedOperator(
        ReadAfterChainedWrite(), key_selector=lambda r: r,
        backend=ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0)).__aenter__()
    try:
        await out.process("k")
        await out.process("k")
        async with asyncio.timeout(20):
            await out.drain()
        assert out.outputs() == [1, 2]
    finally:
        await out.__aexit__(None, None, None)


@pytest.mark.parametrize("links", [10, 40, 100])
def test_a_base_exception_from_a_later_callback_still_settles_the_deep_chain(
        links: int) -> None:
    head: StateFuture[int] = StateFuture()
    end: StateFuture[int] = head
    for _ in range(links):
        end = end.then_apply(lambda v: v + 1)

    def stop(_: int) -> None:
        raise SystemExit("stop")

    head.then_accept(stop)
    with pytest.raises(SystemExit):
        head._complete(0)
    assert end.result() == links


@pytest.mark.parametrize("links", [10, 40, 100])
def test_a_base_exception_leaves_no_deferred_future_holding_the_record(links: int) -> None:
    # Deferred futures hold their record's reference until they settle. After a callback
    # of the head lets a BaseException through, every future of the chain has settled and
    # let go, the head too (it is done): only the future of the raising callback, which
    # never completes, still holds one.
    ctx = RecordContext("record", "k", b"k", 0, None)
    head: StateFuture[int] = StateFuture(ctx)
    end: StateFuture[int] = head
    for _ in range(links):
        end = end.then_apply(lambda v: v + 1)
    assert ctx.ref_count == links + 1

    def stop(_: int) -> None:
        raise KeyboardInterrupt

    head.then_accept(stop)
    with pytest.raises(KeyboardInterrupt):
        head._complete(0)
    assert end.result() == links
    assert head.done()
    assert ctx.ref_count == 1  # the then_accept future that never completed


class DeepCounter(ast.KeyedProcessFunction):
    """A record is (key, links): the count goes through `links` then_apply steps on the
    pending read before it is written and emitted."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    def process_element(self, value: Any, ctx: ast.Context) -> Any:
        _key, links = value
        fut = self.count.value().then_apply(lambda c: c or 0)
        for _ in range(links):
            fut = fut.then_apply(lambda c: c + 1)
        return fut.then_compose(
            lambda c: self.count.update(c).then_apply(lambda _: c)).then_accept(
            lambda c: ctx.emit((ctx.current_key, c)))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["remote0", "rocksdb"])
async def test_records_with_long_chains_keep_key_order_and_finish(backend: str,
                                                                  tmp_path: Any) -> None:
    store: Any = (ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0)
                  if backend == "remote0" else ast.RocksDBBackend(tmp_path / "db"))
    records = [("a", N), ("b", 3), ("a", N), ("b", N), ("a", 1)]
    async with ast.KeyedOperator(DeepCounter(), key_selector=lambda r: r[0],
                                 backend=store) as op:
        for r in records:
            await op.process(r)
        async with asyncio.timeout(40):
            await op.drain()
        out = op.outputs()
        assert op.metrics["in_flight"] == 0
    assert [o for o in out if o[0] == "a"] == [("a", N), ("a", 2 * N), ("a", 2 * N + 1)]
    assert [o for o in out if o[0] == "b"] == [("b", 3), ("b", N + 3)]


class DeepFailure(ast.KeyedProcessFunction):
    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    def process_element(self, value: Any, ctx: ast.Context) -> Any:
        fut = self.count.value().then_apply(lambda c: {}["missing"])
        for _ in range(N):
            fut = fut.then_apply(lambda c: c)
        return fut


@pytest.mark.timeout(60)
async def test_a_failure_at_the_head_of_a_long_chain_fails_the_run_with_its_own_error() -> None:
    op = ast.KeyedOperator(DeepFailure(), key_selector=lambda r: r,
                           backend=ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0))
    with pytest.raises(KeyError, match="missing"):
        async with op:
            await op.process("k")
            async with asyncio.timeout(40):
                await op.drain()


_LONG_CHAINS = textwrap.dedent("""
    import operator, sys
    import asyncstate as ast
    from asyncstate.runtime.future import StateFuture

    n = int(sys.argv[1])
    results = []

    head = StateFuture()
    fut = head
    for _ in range(n):
        fut = fut.then_apply(lambda v: v + 1)
    head._complete(0)
    results.append(fut.result() == n)

    head = StateFuture()
    fut = head.then_apply(lambda v: 1 // v)
    for _ in range(n):
        fut = fut.then_accept(lambda v: None)
    head._complete(0)
    results.append(isinstance(fut.exception(), ZeroDivisionError))

    heads = [StateFuture() for _ in range(n)]
    def level(i):
        if i == n - 1:
            return heads[i].then_apply(lambda v: v)
        return heads[i].then_compose(lambda _: level(i + 1))
    top = level(0)
    for i, h in enumerate(heads):
        h._complete(i)
    results.append(top.result() == n - 1)

    head = StateFuture()
    fut = head
    for _ in range(n // 2):
        fut = ast.combine_all([fut]).then_apply(lambda xs: xs[0] + 1)
        fut = fut.then_combine(ast.completed_future(1), operator.add)
    head._complete(0)
    results.append(fut.result() == n)
    print(results)
""")


@pytest.mark.timeout(120)
def test_chains_of_200000_links_complete_in_both_builds() -> None:
    # The compiled build once overflowed the C stack here (a segfault, returncode -11).
    proc = subprocess.run([sys.executable, "-c", _LONG_CHAINS, "200000"], capture_output=True,
                          text=True, timeout=110, env=dict(os.environ))
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.strip() == "[True, True, True, True]"


class Fail(Exception):
    def __init__(self, node: int) -> None:
        super().__init__(node)
        self.node = node


@pytest.mark.timeout(600)  # room for hypothesis to shrink a failure to a small graph
@settings(deadline=None)
@given(st.data())
def test_random_graphs_of_futures_complete_like_a_model(data: st.DataObject) -> None:
    """Futures built on one pending head by random combinators, usually on the newest one so
    that chains grow far past the depth where completion defers; inner futures of
    then_compose complete later, in a random order. Each future's outcome must equal the
    model's: the value, or a failure raised by one of the nodes the model allows; and no
    future may keep its record referenced."""
    _check_random_graph(data, 150)


@pytest.mark.skipif(_compiled.mode() != "python",
                    reason="the compiled build inlines the depth limit")
@pytest.mark.timeout(600)
@settings(deadline=None)
@given(st.data())
def test_random_graphs_of_futures_with_a_tiny_depth_limit(data: st.DataObject) -> None:
    """The same with completions deferred after 1-4 links (the Python build reads the
    limit at each completion), so that deferral meets every combinator, failures and
    combine_all inputs arriving while a result waits to settle."""
    limit = data.draw(st.integers(1, 4), label="depth limit")
    saved = future_module._MAX_DEPTH
    future_module._MAX_DEPTH = limit  # type: ignore[misc]
    try:
        _check_random_graph(data, 60)
    finally:
        future_module._MAX_DEPTH = saved  # type: ignore[misc]


def _check_random_graph(data: st.DataObject, max_nodes: int) -> None:
    n = data.draw(st.integers(1, max_nodes), label="nodes")
    record = RecordContext("record", "k", b"k", 0, None)
    futures: list[StateFuture[Any]] = [StateFuture(record)]
    # model: ("ok", value) or ("fail", nodes whose failure it may carry)
    model: list[tuple[str, Any]] = [("ok", 0)]
    inners: list[tuple[StateFuture[int], int]] = []  # pending inner futures and their values
    calls: dict[int, int] = {}

    def ran(i: int) -> None:
        calls[i] = calls.get(i, 0) + 1

    def fails(*parents: int) -> tuple[str, Any] | None:
        failed = [model[p] for p in parents if model[p][0] == "fail"]
        if not failed:
            return None
        return ("fail", frozenset().union(*(m[1] for m in failed)))

    for i in range(1, n + 1):
        newest = data.draw(st.booleans(), label="on newest")
        parent = i - 1 if newest else data.draw(st.integers(0, i - 1), label="parent")
        op = data.draw(st.sampled_from(
            ["apply", "raise", "compose_done", "compose_pending", "combine_all",
             "then_combine", "accept"]), label="op")
        base = futures[parent]
        k = i
        if op == "combine_all":
            others = data.draw(st.lists(st.integers(0, i - 1), max_size=3), label="others")
            inputs = [parent, *others]
            fut: StateFuture[Any] = ast.combine_all([futures[j] for j in inputs]).then_apply(
                lambda xs, i=i: ran(i) or sum(xs))
            failed = fails(*inputs)
            model.append(failed if failed is not None else (
                "ok", sum(model[j][1] for j in inputs)))
        elif op == "then_combine":
            other = data.draw(st.integers(0, i - 1), label="other")
            fut = base.then_combine(futures[other], lambda a, b, i=i: ran(i) or a + b)
            first = fails(parent)
            model.append(first if first is not None else fails(other) or (
                "ok", model[parent][1] + model[other][1]))
        else:
            if op == "apply":
                fut = base.then_apply(lambda v, k=k, i=i: ran(i) or v + k)
            elif op == "accept":
                fut = base.then_accept(lambda v, i=i: ran(i)).then_apply(lambda _: 0)
            elif op == "raise":
                def boom(v: int, i: int = i) -> int:
                    ran(i)
                    raise Fail(i)
                fut = base.then_apply(boom)
            elif op == "compose_done":
                fut = base.then_compose(
                    lambda v, k=k, i=i: ran(i) or ast.completed_future(v + k))
            else:
                def compose(v: int, k: int = k, i: int = i) -> StateFuture[int]:
                    ran(i)
                    inner: StateFuture[int] = StateFuture()
                    inners.append((inner, v + k))
                    return inner
                fut = base.then_compose(compose)
            failed = fails(parent)
            if failed is not None:
                model.append(failed)
            elif op == "raise":
                model.append(("fail", frozenset({i})))
            elif op == "accept":
                model.append(("ok", 0))
            else:
                model.append(("ok", model[parent][1] + k))
        futures.append(fut)

    futures[0]._complete(0)
    while inners:
        index = data.draw(st.integers(0, len(inners) - 1), label="inner to complete")
        inner, value = inners.pop(index)
        inner._complete(value)

    for i, (fut, expected) in enumerate(zip(futures, model, strict=True)):
        assert fut.done(), f"node {i} never completed"
        if expected[0] == "ok":
            assert fut.exception() is None, (i, fut.exception())
            assert fut.result() == expected[1], (i, fut.result(), expected)
        else:
            exc = fut.exception()
            assert isinstance(exc, Fail) and exc.node in expected[1], (i, exc, expected)
    assert all(count == 1 for count in calls.values()), calls
    # every future bound to the record (the head and what was chained to it while it was
    # pending) settled and let go of it
    assert record.ref_count == 0


def test_chain_of_200_then_apply_on_pending_future() -> None:
    fut: StateFuture[int] = StateFuture()
    end = fut
    for _ in range(200):
        end = end.then_apply(lambda v: v + 1)
    fut._complete(0)
    assert end.result() == 200


_DEEP_APPLY = """
from asyncstate.runtime.future import StateFuture
fut = StateFuture()
end = fut
for _ in range({n}):
    end = end.then_apply(lambda v: v + 1)
fut._complete(0)
print("RESULT", end.result())
"""

_DEEP_COMPOSE = """
from asyncstate.runtime.future import StateFuture, completed_future
N = {n}
pend = [StateFuture() for _ in range(N)]
def step(i):
    if i == N:
        return completed_future(i)
    return pend[i].then_compose(lambda v: step(i + 1))
top = step(0)
for p in pend:
    p._complete(None)
print("RESULT", top.result())
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("template", "n", "pure"), [
    pytest.param(_DEEP_APPLY, 150, True, id="apply-150-pure"),
    pytest.param(_DEEP_COMPOSE, 100, True, id="compose-100-pure"),
    pytest.param(_DEEP_APPLY, 10_000, False, id="apply-10k-compiled"),
    pytest.param(_DEEP_COMPOSE, 10_000, False, id="compose-10k-compiled"),
])
def test_chains_within_the_documented_depth_complete(template: str, n: int, pure: bool) -> None:
    """docs/api.md: callbacks on one pending future complete recursively, a few hundred
    links deep in the Python build and tens of thousands in the compiled one."""
    if not pure:
        mode = run_python("import asyncstate._compiled as c, asyncstate; print(c.mode())",
                           pure=False)
        if mode.stdout.strip() != "compiled":
            pytest.skip("the compiled modules are not built here")
    proc = run_python(template.format(n=n), pure=pure, timeout=100)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert f"RESULT {n}" in proc.stdout


class RecursiveLoop(ast.KeyedProcessFunction):
    """A loop written as recursive then_compose: read the count, add one, go round again
    `value[1]` times; emits the key and the final count."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    def process_element(self, value: Any, ctx: ast.Context) -> Any:
        def step(n: int) -> Any:
            return self.count.value().then_compose(
                lambda c: self.count.update((c or 0) + 1).then_compose(
                    lambda _: ast.completed_future(None) if n == 1 else step(n - 1)))
        return step(value[1]).then_compose(lambda _: self.count.value()).then_accept(
            lambda c: ctx.emit((ctx.current_key, c)))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["heap", "rocksdb-cache", "remote0"])
async def test_a_loop_written_as_recursive_then_compose_completes_on_every_backend(
        backend: str, tmp_path: Any) -> None:
    # On the heap (and on cache hits) every state call completes at once, so the loop
    # recurses through then_compose itself: 3,000 rounds would overflow the stack.
    store: Any = {"heap": lambda: ast.HeapBackend(),
                  "rocksdb-cache": lambda: ast.RocksDBBackend(tmp_path / "db",
                                                              cache_entries=100),
                  "remote0": lambda: ast.SimulatedRemoteBackend(ast.HeapBackend(),
                                                                latency_ms=0)}[backend]()
    async with ast.KeyedOperator(RecursiveLoop(), key_selector=lambda r: r[0],
                                 backend=store) as op:
        for record in [("a", 3000), ("b", 5), ("a", 2)]:
            await op.process(record)
        async with asyncio.timeout(40):
            await op.drain()
        out = op.outputs()
    assert [o for o in out if o[0] == "a"] == [("a", 3000), ("a", 3002)]
    assert [o for o in out if o[0] == "b"] == [("b", 5)]


async def test_then_compose_on_a_completed_future_stays_inline_after_base_exceptions() -> None:
    # A BaseException leaving fn must not leave the nesting count raised: after 50 of them
    # a then_compose on a completed future still runs fn before it returns.
    def boom(_: Any) -> Any:
        raise BaseBoom("out of fn")

    for _ in range(50):
        with pytest.raises(BaseBoom):
            ast.completed_future(1).then_compose(boom)
    out = ast.completed_future(1).then_compose(lambda v: ast.completed_future(v + 1))
    assert out.done() and out.result() == 2
