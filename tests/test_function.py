"""KeyedProcessFunction and RuntimeContext: open() and close() around a run (also when they
fail or are async), declaring states, what process_element may return, and a function
shared by operators."""

from __future__ import annotations

import asyncio
import gc
import warnings
from collections.abc import Callable
from typing import Any

import pytest
from shared_functions import (
    Boom,
    Counter,
    Sum,
    ident,
    keyed_operator,
    new_backend,
    open_declaring,
)

import asyncstate as ast


@pytest.mark.timeout(30)
def test_open_raising_after_declaring_state_closes_backend_and_releases_rocksdb_dir(tmp_path):
    path = str(tmp_path / "db")

    class OpenRaises(Counter):
        def open(self, ctx):
            super().open(ctx)
            raise Boom("open failed")

    fn = OpenRaises()
    with pytest.raises(Boom, match="open failed"):
        ast.run(fn, [1, 2], key_selector=ident, backend=ast.RocksDBBackend(path))
    assert fn.calls == ["open", "close"]  # close() is called once, as in Flink's cleanup
    # The directory was released: a new backend on it works.
    assert ast.run(Counter(), [1], key_selector=ident,
                   backend=ast.RocksDBBackend(path)) == [(1, 1)]


@pytest.mark.timeout(30)
def test_open_error_is_not_masked_by_close_error():
    class NeedsOpen(ast.KeyedProcessFunction):
        def open(self, ctx):
            raise Boom("open failed")

        def process_element(self, value, ctx):
            return None

        def close(self):
            self.resource.close()  # set by a successful open() only

    with pytest.raises(Boom, match="open failed"):
        ast.run(NeedsOpen(), [1], key_selector=ident)


@pytest.mark.timeout(30)
async def test_restore_error_is_not_masked_by_close(tmp_path):
    class NeedsOpen(Counter):
        def close(self):
            super().close()
            self.count.value  # noqa: B018 - only declared by open()

    op = ast.KeyedOperator(NeedsOpen(), key_selector=ident, backend=ast.HeapBackend(),
                           restore_from=str(tmp_path / "missing"))
    with pytest.raises(ast.CheckpointError):
        async with op:
            pass


@pytest.mark.timeout(30)
def test_async_open_is_awaited_or_refused():
    class AsyncOpen(ast.KeyedProcessFunction):
        async def open(self, ctx):
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

        def process_element(self, value, ctx):
            ctx.emit(value)
            return self.v.update(value)

    try:
        with warnings.catch_warnings():  # the never-awaited coroutine's RuntimeWarning
            warnings.simplefilter("ignore", RuntimeWarning)
            try:
                out = ast.run(AsyncOpen(), [1, 2], key_selector=ident)
            finally:
                gc.collect()
    except TypeError as exc:
        assert "open" in str(exc)
    else:
        assert out == [1, 2]


@pytest.mark.timeout(30)
def test_async_close_is_awaited_or_refused():
    ran: list[bool] = []

    class AsyncClose(ast.KeyedProcessFunction):
        def process_element(self, value, ctx):
            ctx.emit(value)

        async def close(self):
            ran.append(True)

    try:
        with warnings.catch_warnings():  # the never-awaited coroutine's RuntimeWarning
            warnings.simplefilter("ignore", RuntimeWarning)
            try:
                out = ast.run(AsyncClose(), [1], key_selector=ident)
            finally:
                gc.collect()
    except TypeError as exc:
        assert "close" in str(exc)
    else:
        assert out == [1]
        assert ran == [True]


@pytest.mark.timeout(30)
def test_close_raising_after_clean_run_propagates_and_backend_is_closed(tmp_path):
    path = str(tmp_path / "db")

    class CloseRaises(Counter):
        def close(self):
            super().close()
            raise Boom("close failed")

    fn = CloseRaises()
    with pytest.raises(Boom, match="close failed"):
        ast.run(fn, [1, 2], key_selector=ident, backend=ast.RocksDBBackend(path))
    assert fn.calls == ["open", "close"]
    assert ast.run(Counter(), [1], key_selector=ident,
                   backend=ast.RocksDBBackend(path)) == [(1, 2)]  # state was written


@pytest.mark.timeout(30)
def test_run_failure_wins_over_close_error():
    class Both(ast.KeyedProcessFunction):
        def process_element(self, value, ctx):
            raise Boom("process failed")

        def close(self):
            raise RuntimeError("close failed")

    with pytest.raises(Boom, match="process failed"):
        ast.run(Both(), [1], key_selector=ident)


@pytest.mark.timeout(30)
async def test_body_exception_wins_over_close_error():
    class CloseRaises(Counter):
        def close(self):
            raise RuntimeError("close failed")

    with pytest.raises(Boom, match="body"):
        async with ast.KeyedOperator(CloseRaises(), key_selector=ident,
                                     backend=ast.HeapBackend()):
            raise Boom("body")


@pytest.mark.timeout(30)
def test_close_called_exactly_once_on_failed_run(make_backend):
    class Fails(Counter):
        async def process_element(self, value, ctx):
            await self.count.value()
            if value == 3:
                raise Boom(value)

    fn = Fails()
    with pytest.raises(Boom):
        ast.run(fn, range(10), key_selector=ident, backend=make_backend())
    assert fn.calls == ["open", "close"]


@pytest.mark.timeout(30)
def test_function_reused_sequentially_gets_fresh_state_each_run(make_backend):
    fn = Counter()
    assert ast.run(fn, ["a", "a"], key_selector=ident, backend=make_backend()) == \
        [("a", 1), ("a", 2)]
    assert ast.run(fn, ["a"], key_selector=ident, backend=make_backend()) == [("a", 1)]
    assert fn.calls == ["open", "close", "open", "close"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("backend", ["heap", "remote0"])
async def test_function_shared_by_two_live_operators_is_refused_and_the_first_runs_on(
        backend: str) -> None:
    """A function's states are bound to the operator that opened it: a second live operator
    is refused on entry (its own backend closed), and the first keeps working alone."""
    fn = Counter()

    def make() -> Any:
        return new_backend(backend)

    async with ast.KeyedOperator(fn, key_selector=ident, backend=make()) as op1:
        second = ast.KeyedOperator(fn, key_selector=ident, backend=make())
        with pytest.raises(ast.InvalidStateError,
                           match=r"^this Counter object is already running in <KeyedOperator "):
            async with second:
                pass  # pragma: no cover
        for _ in range(3):
            await op1.process("a")
        await asyncio.wait_for(op1.drain(), 5)
        assert op1.outputs() == [("a", 1), ("a", 2), ("a", 3)]
    assert fn.calls == ["open", "close"]  # the refused operator never opened it
    # Once the first operator closed, the function may run again.
    async with ast.KeyedOperator(fn, key_selector=ident, backend=make()) as op3:
        await op3.process("a")
        await op3.drain()
        assert op3.outputs() == [("a", 1)]


@pytest.mark.timeout(30)
def test_duck_typed_function_is_refused_or_runs_without_leaking_backend(tmp_path):
    path = str(tmp_path / "db")

    class Duck:
        def process_element(self, value, ctx):
            ctx.emit(value)

    unclear: list[BaseException] = []
    try:
        assert ast.run(Duck(), [1], key_selector=ident,
                       backend=ast.RocksDBBackend(path)) == [1]
    except TypeError:
        pass  # refused clearly
    except AttributeError as exc:  # what happens now: no clear refusal
        unclear.append(exc)
    # Either way the backend must not stay open: the directory is free again.
    assert ast.run(Counter(), [1], key_selector=ident,
                   backend=ast.RocksDBBackend(path)) == [(1, 1)]
    assert unclear == []


class Returns(ast.KeyedProcessFunction):
    def __init__(self, make: Callable[..., Any]) -> None:
        self.make = make

    def open(self, ctx):
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

    def process_element(self, value, ctx):
        return self.make(self, value, ctx)


def _asyncio_future(fn, value, ctx):
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(None)
    return fut


def _generator(fn, value, ctx):
    yield value


@pytest.mark.timeout(30)
@pytest.mark.parametrize("make, name", [
    (lambda fn, v, c: [v], "list"),
    (lambda fn, v, c: 0, "int"),
    (lambda fn, v, c: False, "bool"),
    (_asyncio_future, "Future"),
    (_generator, "generator"),
])
def test_process_element_returning_odd_values_fails_with_type_error(make, name, make_backend):
    with pytest.raises(TypeError, match=rf"must return None or a StateFuture.*{name}"):
        ast.run(Returns(make), [1, 2], key_selector=ident, backend=make_backend())


@pytest.mark.timeout(30)
def test_plain_def_returning_a_coroutine_is_run(make_backend):
    async def body(fn, value, ctx):
        await fn.v.update(value)
        ctx.emit(await fn.v.value())

    assert ast.run(Returns(body), [1, 2, 3], key_selector=ident,
                   backend=make_backend()) == [1, 2, 3]


@pytest.mark.timeout(30)
def test_plain_def_returning_a_pending_chain_that_fails_fails_the_run(make_backend):
    def chain(fn, value, ctx):
        return fn.v.value().then_apply(lambda _: 1 / 0)

    with pytest.raises(ZeroDivisionError):
        ast.run(Returns(chain), [1, 2], key_selector=ident, backend=make_backend())


@pytest.mark.timeout(30)
def test_plain_def_chain_keeps_record_in_flight_until_its_callbacks_ran(make_backend):
    def chain(fn, value, ctx):
        return ast.combine_all([fn.v.value(), fn.v.value()]).then_compose(
            lambda ab: fn.v.update((ab[0] or 0) + 1).then_accept(
                lambda _: ctx.emit((ctx.current_key, (ab[0] or 0) + 1))))

    out = ast.run(Returns(chain), [k % 3 for k in range(9)], key_selector=ident,
                  backend=make_backend(), config=ast.AsyncStateConfig(batch_size=2))
    assert sorted(out) == sorted((k, n) for k in range(3) for n in (1, 2, 3))
    for k in range(3):
        assert [n for key, n in out if key == k] == [1, 2, 3]


async def test_plain_function_writes_without_waiting_land(make_backend):
    class Fn(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))
            self.l = ctx.get_list_state(ast.ListStateDescriptor("l"))

        def process_element(self, value, ctx):
            if value[1] == "write":
                self.v.update(value[0] * 10)
                self.l.add(value[0])
                return None
            return ast.combine_all([self.v.value(), self.l.get().then_compose(
                lambda it: it.to_list())]).then_accept(lambda r: ctx.emit((value[0], r)))

    records = [(k, "write") for k in range(10)] + [(k, "read") for k in range(10)]
    async with keyed_operator(Fn(), make_backend()) as op:
        for r in records:
            await op.process(r)
        await op.drain()
        assert sorted(op.outputs()) == [(k, [k * 10, [k]]) for k in range(10)]


@pytest.mark.parametrize(("method", "descriptor", "expected"), [
    ("get_state", ast.ListStateDescriptor("s"), "ValueStateDescriptor"),
    ("get_list_state", ast.ValueStateDescriptor("s"), "ListStateDescriptor"),
    ("get_map_state", ast.ListStateDescriptor("s"), "MapStateDescriptor"),
    ("get_reducing_state", ast.AggregatingStateDescriptor("s", Sum()),
     "ReducingStateDescriptor"),
    ("get_aggregating_state", ast.ReducingStateDescriptor("s", max),
     "AggregatingStateDescriptor"),
    ("get_state", "s", "ValueStateDescriptor"),
], ids=lambda v: v if isinstance(v, str) else type(v).__name__)
async def test_get_state_with_the_wrong_descriptor_type_names_both_types(method, descriptor,
                                                                         expected):
    got = type(descriptor).__name__
    with pytest.raises(TypeError, match=rf"^expected a {expected}, got {got}$"):
        await open_declaring(lambda ctx: getattr(ctx, method)(descriptor))


@pytest.mark.parametrize("method", ["get_state", "get_list_state", "get_map_state",
                                    "get_reducing_state", "get_aggregating_state",
                                    "get_operator_list_state", "get_union_list_state"])
def test_declaring_a_state_on_a_records_context_names_the_state_and_open(method):
    operator_state = method in ("get_operator_list_state", "get_union_list_state")

    class DeclaresPerRecord(ast.KeyedProcessFunction):
        def process_element(self, value, ctx):
            getattr(ctx, method)("seen" if operator_state else ast.ValueStateDescriptor("seen"))

    with pytest.raises(ast.InvalidStateError,
                       match=rf"^ctx\.{method}\(\) was called on a record's context, for "
                             r"state 'seen': states are declared in open\(ctx\)"):
        ast.run(DeclaresPerRecord(), [1, 2], key_selector=lambda v: v)


@pytest.mark.parametrize(("first", "second", "first_kind", "second_kind"), [
    (lambda ctx: ctx.get_state(ast.ValueStateDescriptor("x")),
     lambda ctx: ctx.get_list_state(ast.ListStateDescriptor("x")), "value", "list"),
    (lambda ctx: ctx.get_map_state(ast.MapStateDescriptor("x")),
     lambda ctx: ctx.get_state(ast.ValueStateDescriptor("x")), "map", "value"),
    (lambda ctx: ctx.get_reducing_state(ast.ReducingStateDescriptor("x", max)),
     lambda ctx: ctx.get_aggregating_state(ast.AggregatingStateDescriptor("x", Sum())),
     "reducing", "aggregating"),
], ids=["value-then-list", "map-then-value", "reducing-then-aggregating"])
async def test_redeclaring_a_state_as_another_kind_names_it_and_both_kinds(
        first, second, first_kind, second_kind):
    def declare(ctx):
        first(ctx)
        second(ctx)

    with pytest.raises(ast.ConfigError, match=rf"^state 'x' is already declared as "
                                              rf"{first_kind} state, cannot declare it again "
                                              rf"as {second_kind} state$"):
        await open_declaring(declare)


async def test_redeclaring_a_state_with_the_same_kind_returns_the_same_state():
    def declare(ctx):
        v1 = ctx.get_state(ast.ValueStateDescriptor("v"))
        v2 = ctx.get_state(ast.ValueStateDescriptor("v"))
        descriptor = ast.ListStateDescriptor("l")
        l1 = ctx.get_list_state(descriptor)
        l2 = ctx.get_list_state(descriptor)
        return v1, v2, l1, l2, ctx.states

    v1, v2, l1, l2, states = await open_declaring(declare)
    assert v1 is v2
    assert l1 is l2
    assert v1 is not l1
    assert states == {"v": v1, "l": l1}


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
