"""API.md, read as a user would: names, signatures, defaults and behaviour of the contract.

The typing tests run mypy --strict on small user programs (in a temporary cache directory,
so the repo's cache is left alone).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import mmh3
import msgpack
import pytest

import asyncstate as ast
from asyncstate.runtime.context import RecordContext

REPO = Path(__file__).resolve().parent.parent


# -- helpers ---------------------------------------------------------------------------------


def _run(fn: ast.KeyedProcessFunction, records: list[Any], **kw: Any) -> list[Any]:
    return ast.run(fn, records, key_selector=lambda r: r if not isinstance(r, tuple) else r[0],
                   **kw)


class _Collect(ast.KeyedProcessFunction):
    """Runs `body(self, value, ctx)` (a coroutine function) per record."""

    def __init__(self, body: Any, open_fn: Any = None) -> None:
        self.body = body
        self.open_fn = open_fn

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))
        self.l = ctx.get_list_state(ast.ListStateDescriptor("l"))
        self.m = ctx.get_map_state(ast.MapStateDescriptor("m"))
        self.r = ctx.get_reducing_state(ast.ReducingStateDescriptor("r", lambda a, b: a + b))
        self.a = ctx.get_aggregating_state(ast.AggregatingStateDescriptor("a", _Avg()))
        self.ops = ctx.get_operator_list_state("ops")
        if self.open_fn is not None:
            self.open_fn(self, ctx)

    async def process_element(self, value: Any, ctx: ast.RecordContext) -> None:
        await self.body(self, value, ctx)


class _Avg(ast.AggregateFunction[int, list[int], float]):
    def create_accumulator(self) -> list[int]:
        return [0, 0]

    def add(self, value: int, accumulator: list[int]) -> list[int]:
        return [accumulator[0] + value, accumulator[1] + 1]

    def get_result(self, accumulator: list[int]) -> float:
        return accumulator[0] / accumulator[1]

    def merge(self, a: list[int], b: list[int]) -> list[int]:
        return [a[0] + b[0], a[1] + b[1]]


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mypy_cache")


def _mypy(source: str, tmp_path: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    prog = tmp_path / "user_prog.py"
    prog.write_text(textwrap.dedent(source))
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(cache),
         "--config-file", str(REPO / "pyproject.toml"), str(prog)],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False)


# -- names and signatures ----------------------------------------------------------------------


def test_errors_hierarchy_context_and_pickling() -> None:
    for cls in (ast.SerializationError, ast.CheckpointError, ast.KeyGroupError,
                ast.InvalidStateError, ast.InjectedFailure, ast.ConfigError):
        assert issubclass(cls, ast.AsyncStateError)
    errors = [ast.ConfigError("batch_size", 0, ">= 1"),
              ast.SerializationError("m", state_name="s", type_name="X"),
              ast.KeyGroupError("m", key_group=4), ast.CheckpointError("m", path="/p"),
              ast.InjectedFailure("m", path="/q"), ast.InvalidStateError("m")]
    for err in errors:
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and back.__dict__ == err.__dict__ and str(back) == str(err)
    with pytest.raises(ValueError) as info:
        ast.AsyncStateConfig(batch_size=0)
    assert isinstance(info.value, ast.AsyncStateError) and "batch_size" in str(info.value)


def test_signatures_and_defaults() -> None:
    def params(fn: Any) -> dict[str, Any]:
        return {n: (p.kind, p.default) for n, p in inspect.signature(fn).parameters.items()}

    kw, empty = inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.empty
    run = params(ast.run)
    assert list(run)[:2] == ["function", "records"]
    assert run["key_selector"] == (kw, empty)
    for name in ("timestamp_selector", "backend", "config", "clock"):
        assert run[name] == (kw, None)
    op = params(ast.KeyedOperator)
    assert op["key_selector"] == (kw, empty) and op["backend"] == (kw, empty)
    assert op["parallelism"] == (kw, 1) and op["operator_index"] == (kw, 0)
    for name in ("config", "clock", "timestamp_selector", "restore_from"):
        assert op[name] == (kw, None)
    remote = params(ast.SimulatedRemoteBackend)
    assert remote["latency_ms"] == (kw, empty) and remote["io_parallelism"] == (kw, 2)
    assert remote["cache_entries"] == (kw, 0) and remote["failure_probability"] == (kw, 0.0)
    assert params(ast.ManualClock)["start_ms"][1] == 0
    cfg = ast.AsyncStateConfig()
    assert (cfg.batch_size, cfg.buffer_timeout_ms, cfg.max_in_flight, cfg.max_parallelism) == (
        1000, 1000, 6000, 128)
    assert dataclasses.is_dataclass(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.batch_size = 3  # type: ignore[misc]
    for name in ("then_apply", "then_accept", "then_compose", "then_combine",
                 "then_conditionally_apply", "then_conditionally_accept",
                 "then_conditionally_compose", "done", "result", "exception"):
        assert callable(getattr(ast.StateFuture, name))
    for name in ("then_conditionally_apply", "then_conditionally_accept",
                 "then_conditionally_compose"):
        assert params(getattr(ast.StateFuture, name))["if_false"][1] is None


def test_config_validation() -> None:
    for bad in (dict(batch_size=0), dict(max_in_flight=0), dict(iterator_chunk_size=0),
                dict(max_parallelism=0), dict(max_parallelism=32769),
                dict(buffer_timeout_ms=-1)):
        with pytest.raises(ast.ConfigError):
            ast.AsyncStateConfig(**bad)
    ast.AsyncStateConfig(max_parallelism=32768, buffer_timeout_ms=0)


def test_state_request_type_members() -> None:
    assert [m.name for m in ast.StateRequestType] == [
        "SYNC_POINT", "CLEAR", "VALUE_GET", "VALUE_UPDATE", "LIST_GET", "LIST_ADD",
        "LIST_UPDATE", "LIST_ADD_ALL", "MAP_GET", "MAP_CONTAINS", "MAP_PUT", "MAP_PUT_ALL",
        "MAP_ITER", "MAP_ITER_KEY", "MAP_ITER_VALUE", "MAP_REMOVE", "MAP_IS_EMPTY",
        "ITERATOR_LOADING", "REDUCING_GET", "REDUCING_ADD", "AGGREGATING_GET",
        "AGGREGATING_ADD"]
    assert {ast.TimeDomain.EVENT_TIME, ast.TimeDomain.PROCESSING_TIME}


# -- futures -----------------------------------------------------------------------------------


def test_future_combinators_without_a_loop() -> None:
    f = ast.completed_future(2)
    assert f.then_apply(lambda x: x + 1).result() == 3
    assert f.then_accept(lambda x: None).result() is None
    assert f.then_compose(lambda x: ast.completed_future(x * 5)).result() == 10
    assert f.then_combine(ast.completed_future(3), lambda a, b: a * b).result() == 6
    assert f.then_conditionally_apply(lambda x: x > 1, str).result() == (True, "2")
    assert f.then_conditionally_apply(lambda x: x > 5, str).result() == (False, None)
    assert f.then_conditionally_apply(lambda x: x > 5, str, lambda x: -x).result() == (False, -2)
    assert f.then_conditionally_accept(lambda x: x > 1, print).result() is True
    assert f.then_conditionally_compose(
        lambda x: x > 1, lambda x: ast.completed_future("t")).result() == (True, "t")
    assert f.then_conditionally_compose(
        lambda x: x > 5, lambda x: ast.completed_future("t")).result() == (False, None)
    assert ast.combine_all([f, ast.completed_void_future(), ast.completed_future("z")]
                           ).result() == [2, None, "z"]
    ran: list[int] = []
    f.then_accept(ran.append)
    assert ran == [2]  # on a completed future, before the registering call returns


def test_future_failures_and_inspection() -> None:
    def not_a_future(x: int) -> Any:
        return x

    bad = ast.completed_future(1).then_compose(not_a_future)
    assert isinstance(bad.exception(), TypeError) and "not_a_future" in str(bad.exception())
    failed = ast.completed_future(1).then_apply(lambda x: 1 // 0)
    skipped = failed.then_apply(lambda x: pytest.fail("skipped callback ran"))
    assert skipped.exception() is failed.exception()
    assert isinstance(failed.exception(), ZeroDivisionError)
    with pytest.raises(ZeroDivisionError):
        skipped.result()

    def interrupt(x: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ast.completed_future(1).then_apply(interrupt)
    pending: ast.StateFuture[int] = ast.StateFuture()
    assert not pending.done()
    with pytest.raises(ast.InvalidStateError):
        pending.result()


async def test_future_asyncio_interop() -> None:
    assert await ast.completed_future(7) == 7
    assert await asyncio.gather(ast.completed_future(1), ast.completed_future(2)) == [1, 2]  # type: ignore[comparison-overlap]
    assert await asyncio.wait_for(ast.completed_future(3), 1) == 3
    fut: ast.StateFuture[int] = ast.StateFuture()
    asyncio.get_running_loop().call_later(0.01, fut._complete, 9)

    async def in_task() -> int:
        return await fut

    assert await asyncio.create_task(in_task()) == 9
    checked: object = fut
    assert asyncio.isfuture(checked)


# -- state -------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["heap", "rocksdb", "remote"])
def test_state_methods_on_every_backend(backend: str, tmp_path: Path) -> None:
    async def body(s: _Collect, value: Any, ctx: ast.RecordContext) -> None:
        out: dict[str, Any] = {"v0": await s.v.value()}
        await s.v.update((1, 2))
        out["v1"] = await s.v.value()
        await s.v.update(None)
        out["v2"] = await s.v.value()
        out["l0"] = (await s.l.get()).is_empty()
        await s.l.add(1)
        await s.l.add_all([2, 3])
        out["l1"] = await (await s.l.get()).to_list()
        await s.l.update([9])
        out["l2"] = [x async for x in await s.l.get()]
        await s.l.clear()
        out["l3"] = (await s.l.get()).is_empty()
        for k, v in ((1, "i"), (1.0, "f"), (True, "b"), ((1, 2), "t")):
            await s.m.put(k, v)
        out["m"] = [await s.m.get(k) for k in (1, 1.0, True, [1, 2])]
        out["entries"] = sorted(map(repr, await (await s.m.entries()).to_list()))
        await s.m.remove(True)
        out["keys"] = len(await (await s.m.keys()).to_list())
        out["contains"] = (await s.m.contains(True), await s.m.contains(1))
        out["on_next"] = await (await s.m.values()).on_next(
            lambda x: None if x == "i" else ast.completed_future(x.upper()))
        await s.m.clear()
        out["empty"] = await s.m.is_empty()
        s.r.add(1)
        s.r.add(2)
        s.a.add(1)
        s.a.add(3)
        out["ra"] = (await s.r.get(), await s.a.get())
        await s.r.clear()
        await s.a.clear()
        out["ra2"] = (await s.r.get(), await s.a.get())
        ctx.emit(out)

    be: Any = {"heap": lambda: None,
               "rocksdb": lambda: ast.RocksDBBackend(str(tmp_path / "db")),
               "remote": lambda: ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=1),
               }[backend]()
    (out,) = _run(_Collect(body), [1], backend=be, config=ast.AsyncStateConfig(
        iterator_chunk_size=2))
    assert out["v0"] is None and out["v1"] == [1, 2] and out["v2"] is None
    assert out["l0"] and out["l1"] == [1, 2, 3] and out["l2"] == [9] and out["l3"]
    assert out["m"] == ["i", "f", "b", "t"]  # 1, 1.0, True are three keys; list == tuple
    assert out["entries"] == sorted(["(1, 'i')", "(1.0, 'f')", "(True, 'b')", "([1, 2], 't')"])
    assert out["keys"] == 3 and out["contains"] == (False, True)
    assert sorted(out["on_next"]) == ["F", "T"] and out["empty"]
    assert out["ra"] == (3, 2.0) and out["ra2"] == (None, None)


def test_serialization_errors_at_the_writing_call() -> None:
    class X:
        pass

    async def body(s: _Collect, value: Any, ctx: ast.RecordContext) -> None:
        for call, type_name in ((lambda: s.v.update(X()), "X"),
                                (lambda: s.v.update(2**64), "int"),
                                (lambda: s.m.put({"a": 1}, 1), "dict"),
                                (lambda: s.l.add_all([1, X()]), "X")):
            with pytest.raises(ast.SerializationError) as info:
                call()
            assert info.value.type_name == type_name and info.value.state_name is not None
            assert info.value.state_name in str(info.value)
        await s.v.update({1: "a", (1, 2): "b"})  # dicts with int or tuple keys are values
        ctx.emit("ok")

    assert _run(_Collect(body), [1]) == ["ok"]
    with pytest.raises(ast.SerializationError):
        _run(_Collect(body), [{"dict": "key"}])


def test_key_groups() -> None:
    for key in ("k", 1, 1.0, True, None, b"x", (1, "a"), [1, "a"]):
        expected = mmh3.hash(msgpack.packb(key, use_bin_type=True), 0, signed=False) % 128
        assert ast.assign_to_key_group(key, 128) == expected
    rng = ast.KeyGroupRange(2, 5)
    assert rng.contains(2) and 5 in rng and 6 not in rng and len(rng) == 4
    assert list(rng) == [2, 3, 4, 5]
    for mp, p in ((128, 3), (10, 4), (7, 7)):
        q, r = divmod(mp, p)
        for i in range(p):
            kr = ast.compute_key_group_range_for_operator_index(mp, p, i)
            assert kr.start == i * q + min(i, r) and len(kr) == q + (1 if i < r else 0)
            assert ast.compute_operator_index_for_key_group(mp, p, kr.end) == i
    for args in ((128, 0, 0), (128, 129, 0), (128, 2, 2)):
        with pytest.raises(ast.ConfigError):
            ast.compute_key_group_range_for_operator_index(*args)


# -- functions, contexts and the operator ------------------------------------------------------


def test_invalid_state_error_outside_a_record() -> None:
    saved: list[ast.RecordContext] = []

    def open_fn(s: _Collect, ctx: ast.RuntimeContext) -> None:
        with pytest.raises(ast.InvalidStateError):
            s.v.value()

    async def body(s: _Collect, value: Any, ctx: ast.RecordContext) -> None:
        saved.append(ctx)

    _run(_Collect(body, open_fn), [1])
    with pytest.raises(ast.InvalidStateError):
        saved[0].current_key  # noqa: B018
    with pytest.raises(ast.InvalidStateError):
        saved[0].emit(1)


def test_ctx_timestamp_after_record_finished_raises() -> None:
    saved: list[ast.RecordContext] = []

    async def body(s: _Collect, value: Any, ctx: ast.RecordContext) -> None:
        saved.append(ctx)

    _run(_Collect(body), [(1, 5)], timestamp_selector=lambda r: r[1])
    with pytest.raises(ast.InvalidStateError):
        saved[0].timestamp  # noqa: B018


def test_run_failures_and_contract_errors() -> None:
    class NotReturned(ast.KeyedProcessFunction):
        def open(self, ctx: ast.RuntimeContext) -> None:
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

        def process_element(self, value: Any, ctx: ast.RecordContext) -> None:
            self.v.value().then_apply(lambda x: 1 // 0)

    with pytest.raises(ZeroDivisionError):
        _run(NotReturned(), [1])

    class BadReturn(ast.KeyedProcessFunction):
        def process_element(self, value: Any, ctx: ast.RecordContext) -> Any:
            return 5

    with pytest.raises(TypeError, match="must return None or a StateFuture"):
        _run(BadReturn(), [1])

    async def inside_loop() -> None:
        with pytest.raises(ast.InvalidStateError):
            _run(BadReturn(), [1])

    asyncio.run(inside_loop())


def test_documented_not_yet_features() -> None:
    class T(ast.KeyedProcessFunction):
        def process_element(self, value: Any, ctx: ast.RecordContext) -> None:
            ctx.emit(value)

    assert _run(T(), [1]) == [1]


async def test_keyed_operator_lifecycle_checkpoint_and_metrics(tmp_path: Path) -> None:
    async def body(s: _Collect, value: Any, ctx: ast.RecordContext) -> None:
        n = (await s.v.value() or 0) + 1
        await s.v.update(n)
        s.ops.add(value)
        ctx.emit((ctx.current_key, n))

    cfg = ast.AsyncStateConfig(max_parallelism=8, batch_size=4, max_in_flight=2)
    path = ""
    for i in range(2):
        op = ast.KeyedOperator(_Collect(body), key_selector=lambda r: r, config=cfg,
                               backend=ast.SimulatedRemoteBackend(ast.HeapBackend(),
                                                                  latency_ms=1),
                               clock=ast.ManualClock(), parallelism=2, operator_index=i)
        with pytest.raises(ast.InvalidStateError):
            await op.process(0)  # outside `async with`
        async with op:
            assert op.current_watermark() == -2**63
            for k in range(12):
                if ast.assign_to_key_group(k, 8) in op.key_group_range:
                    await op.process(k)
                else:
                    with pytest.raises(ast.KeyGroupError):
                        await op.process(k)
            await op.advance_watermark(10)
            await op.advance_processing_time(5)
            with pytest.raises(ast.ConfigError):
                await op.advance_processing_time(3)
            path = await op.snapshot(tmp_path, 1)
            assert path == ast.checkpoint_path(tmp_path, 1)
            metrics = op.metrics
            assert {"records_in", "records_done", "in_flight", "in_flight_peak", "batches",
                    "requests", "max_batch_size", "blocked_seconds"} <= set(metrics)
            assert metrics["in_flight"] == 0 and metrics["in_flight_peak"] <= 2
            assert metrics["max_batch_size"] <= 4
            assert op.outputs() and op.outputs() == []
    assert sorted(os.listdir(path)) == ["part-2-0", "part-2-1"]
    assert "_MANIFEST.json" in os.listdir(os.path.join(path, "part-2-0"))

    fn = _Collect(body)
    async with ast.KeyedOperator(fn, key_selector=lambda r: r, backend=ast.HeapBackend(),
                                 config=cfg, restore_from=path) as op:
        for k in range(12):
            await op.process(k)
        await op.drain()
        assert sorted(op.outputs()) == [(k, 2) for k in range(12)]
        assert len(fn.ops.get().result().to_list().result()) == 24
        with pytest.raises(ast.InvalidStateError):
            await op.advance_processing_time(1)  # default clock is not a ManualClock

    import shutil
    shutil.rmtree(os.path.join(path, "part-2-1"))
    with pytest.raises(ast.CheckpointError):
        async with ast.KeyedOperator(_Collect(body), key_selector=lambda r: r, config=cfg,
                                     backend=ast.HeapBackend(), restore_from=path):
            pass


async def test_failure_is_sticky() -> None:
    class Boom(ast.KeyedProcessFunction):
        async def process_element(self, value: Any, ctx: ast.RecordContext) -> None:
            raise KeyError(value)

    op = ast.KeyedOperator(Boom(), key_selector=lambda r: r, backend=ast.HeapBackend())
    with pytest.raises(KeyError):
        async with op:
            await op.process(1)
            for call in (op.drain, lambda: op.process(2), lambda: op.advance_watermark(1)):
                with pytest.raises(KeyError):
                    await call()


async def test_controller_surface() -> None:
    ctl = ast.AsyncExecutionController(ast.HeapBackend(), batch_size=4, buffer_timeout_ms=0,
                                       max_in_flight=4)
    ctx = ctl.build_context("rec", "k")
    assert isinstance(ctx, RecordContext) and ctx.record == "rec" and ctx.key == "k"
    assert ctx.key_group == ast.assign_to_key_group("k", 128) and ctx.ref_count == 0
    assert ctx != ctl.build_context("rec", "k")  # identity equality
    assert ctx.retain() == 1 and ctx.release() == 0
    ctl.set_current_context(ctx)
    assert ctl.sync_point(lambda: 42).result() == 42
    assert ctl.trigger_if_needed(True) is False
    await ctl.drain_inflight_records(0)
    assert (ctl.in_flight_record_num, ctl.active_queue_size, ctl.blocking_queue_size,
            ctl.blocking_key_num, ctl.occupied_key_num) == (0, 0, 0, 0, 0)


def test_manual_clock_and_injected_failure() -> None:
    clock = ast.ManualClock()
    clock.advance(5)
    clock.set(10)
    assert clock.now_ms() == 10
    with pytest.raises(ast.ConfigError):
        clock.set(3)

    async def body(s: _Collect, value: Any, ctx: ast.RecordContext) -> None:
        await s.v.update(value)

    with pytest.raises(ast.InjectedFailure):
        _run(_Collect(body), list(range(10)), backend=ast.SimulatedRemoteBackend(
            ast.HeapBackend(), latency_ms=1, failure_probability=1.0))


# -- typing, from a user's view --------------------------------------------------------------


USER_PROGRAM = """
from __future__ import annotations
from typing import Any
import asyncstate as ast

class Avg(ast.AggregateFunction[int, list[int], float]):
    def create_accumulator(self) -> list[int]: return [0, 0]
    def add(self, value: int, accumulator: list[int]) -> list[int]:
        return [accumulator[0] + value, accumulator[1] + 1]
    def get_result(self, accumulator: list[int]) -> float:
        return accumulator[0] / accumulator[1]
    def merge(self, a: list[int], b: list[int]) -> list[int]: return [a[0] + b[0], a[1] + b[1]]

def add_ints(a: int, b: int) -> int: return a + b

class F(ast.KeyedProcessFunction):
    count: ast.ValueState[int]
    hist: ast.ListState[int]
    seen: ast.MapState[str, int]
    total: ast.ReducingState[int]
    avg: ast.AggregatingState[int, float]

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))
        self.hist = ctx.get_list_state(ast.ListStateDescriptor("hist"))
        self.seen = ctx.get_map_state(ast.MapStateDescriptor("seen"))
        self.total = ctx.get_reducing_state(ast.ReducingStateDescriptor("total", add_ints))
        self.avg = ctx.get_aggregating_state(ast.AggregatingStateDescriptor("avg", Avg()))

    async def process_element(self, value: tuple[str, int], ctx: ast.RecordContext) -> None:
        n: int = (await self.count.value() or 0) + 1
        await self.count.update(n)
        it: ast.StateIterator[int] = await self.hist.get()
        items: list[int] = [x async for x in it]
        entries: list[tuple[str, int]] = await (await self.seen.entries()).to_list()
        total: int | None = await self.total.get()
        avg: float | None = await self.avg.get()
        f: ast.StateFuture[int] = self.count.value().then_apply(lambda c: (c or 0) + 1)
        g: ast.StateFuture[int] = f.then_compose(
            lambda c: self.count.update(c).then_apply(lambda _: c))
        h: ast.StateFuture[None] = g.then_accept(lambda c: ctx.emit(c))
        await h
        ts: int | None = ctx.timestamp
        ctx.emit((n, items, entries, total, avg, ts))

def main(path: str) -> list[Any]:
    out: list[Any] = ast.run(F(), [("a", 1)], key_selector=lambda r: r[0],
                             backend=ast.RocksDBBackend(path, io_parallelism=2),
                             config=ast.AsyncStateConfig(batch_size=10))
    return out
"""


def test_typed_user_program_passes_mypy(tmp_path: Path, mypy_cache: Path) -> None:
    result = _mypy(USER_PROGRAM, tmp_path, mypy_cache)
    assert result.returncode == 0, result.stdout


def test_typing_operator_list_state_has_a_public_type(tmp_path: Path, mypy_cache: Path) -> None:
    result = _mypy("""
        import asyncstate as ast
        class F(ast.KeyedProcessFunction):
            buf: ast.OperatorListState[int]
            everyone: ast.OperatorListState[str]
            def open(self, ctx: ast.RuntimeContext) -> None:
                self.buf = ctx.get_operator_list_state("buf")
                self.everyone = ctx.get_union_list_state("everyone")
                self.buf.add(1)
        """, tmp_path, mypy_cache)
    assert result.returncode == 0, result.stdout


def test_typing_descriptor_type_parameters_reach_the_declared_state(
        tmp_path: Path, mypy_cache: Path) -> None:
    result = _mypy("""
        import asyncstate as ast

        class Avg:
            def create_accumulator(self) -> list[int]: return [0, 0]
            def add(self, value: int, accumulator: list[int]) -> list[int]:
                return [accumulator[0] + value, accumulator[1] + 1]
            def get_result(self, accumulator: list[int]) -> float:
                return accumulator[0] / accumulator[1]
            def merge(self, a: list[int], b: list[int]) -> list[int]: return a

        def add_ints(a: int, b: int) -> int: return a + b

        class F(ast.KeyedProcessFunction):
            def open(self, ctx: ast.RuntimeContext) -> None:
                self.count = ctx.get_state(ast.ValueStateDescriptor[int]("count"))
                self.hist = ctx.get_list_state(ast.ListStateDescriptor[str]("hist"))
                self.seen = ctx.get_map_state(ast.MapStateDescriptor[str, float]("seen"))
                self.total = ctx.get_reducing_state(
                    ast.ReducingStateDescriptor("total", add_ints))
                self.avg = ctx.get_aggregating_state(
                    ast.AggregatingStateDescriptor("avg", Avg()))
                self.loose = ctx.get_state(ast.ValueStateDescriptor("loose"))
                reveal_type(self.count)
                reveal_type(self.hist)
                reveal_type(self.seen)
                reveal_type(self.total)
                reveal_type(self.avg)
                reveal_type(self.loose)
                self.count.update("not an int")
                self.seen.put("k", "not a float")
        """, tmp_path, mypy_cache)
    revealed = [line.split('Revealed type is "')[1].rstrip('"').replace("builtins.", "")
                for line in result.stdout.splitlines() if "Revealed type is" in line]
    assert revealed == [
        "asyncstate.state.value.ValueState[int]",
        "asyncstate.state.list.ListState[str]",
        "asyncstate.state.map.MapState[str, float]",
        "asyncstate.state.merging.ReducingState[int]",
        "asyncstate.state.merging.AggregatingState[int, float]",
        "asyncstate.state.value.ValueState[Any]",
    ], result.stdout
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 2 and all("[arg-type]" in e for e in errors), result.stdout


def test_typing_duck_typed_aggregate_function(tmp_path: Path, mypy_cache: Path) -> None:
    result = _mypy("""
        import asyncstate as ast
        class Sum:
            def create_accumulator(self) -> int: return 0
            def add(self, value: int, accumulator: int) -> int: return accumulator + value
            def get_result(self, accumulator: int) -> int: return accumulator
            def merge(self, a: int, b: int) -> int: return a + b
        d = ast.AggregatingStateDescriptor("sum", Sum())
        """, tmp_path, mypy_cache)
    assert result.returncode == 0, result.stdout


def test_typing_conditionally_compose_keeps_result_type(tmp_path: Path,
                                                        mypy_cache: Path) -> None:
    result = _mypy("""
        import asyncstate as ast
        f = ast.completed_future(1).then_conditionally_compose(
            lambda n: n > 0, lambda n: ast.completed_future(n * 2))
        wrong: ast.StateFuture[tuple[bool, bytes]] = f
        """, tmp_path, mypy_cache)
    assert result.returncode == 1 and "[assignment]" in result.stdout, result.stdout


def test_typing_combine_all_keeps_item_type(tmp_path: Path, mypy_cache: Path) -> None:
    result = _mypy("""
        import asyncstate as ast
        ints = ast.combine_all([ast.completed_future(1), ast.completed_future(2)])
        reveal_type(ints)
        wrong: ast.StateFuture[list[str]] = ints
        """, tmp_path, mypy_cache)
    assert "StateFuture[builtins.list[builtins.int]]" in result.stdout or (
        "StateFuture[list[int]]" in result.stdout), result.stdout
    assert result.returncode == 1 and "[assignment]" in result.stdout, result.stdout
