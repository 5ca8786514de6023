"""Adversarial tests: watermark / processing-time / epoch semantics of KeyedOperator, and
state namespaces on every backend (including snapshot, restore and rescale).

Documented behaviour these tests hold the implementation to (docs/api.md):
- `advance_watermark(ts)` returns after every record admitted before it has finished; the
  watermark never goes down; it starts at -2**63; timestamps must be ints in
  [-2**63, 2**63) (else ConfigError).
- `advance_processing_time(ts)` sets the ManualClock and returns after every earlier record
  finished; InvalidStateError without a ManualClock, ConfigError when going back.
- `state.set_current_namespace(ns)`: later calls of the current record on that state use
  `ns`; None is the default; namespaces are per record and per state; they follow the key
  rules (canonical msgpack bytes: list == tuple, 1 != 1.0 != True).
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable, Iterable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shared_functions import Sum

import asyncstate as ast

V = ast.ValueStateDescriptor
L = ast.ListStateDescriptor
M = ast.MapStateDescriptor
R = ast.ReducingStateDescriptor
A = ast.AggregatingStateDescriptor

MIN_WM = -(2**63)
MAX_WM = 2**63 - 1




_GETTERS: dict[type, str] = {
    V: "get_state", L: "get_list_state", M: "get_map_state", R: "get_reducing_state",
    A: "get_aggregating_state",
}


def all_kinds() -> dict[str, Any]:
    return {"v": V("v"), "l": L("l"), "m": M("m"), "r": R("r", lambda a, b: a + b),
            "a": A("a", Sum())}


class Script(ast.KeyedProcessFunction):
    """A record is (key, step); step(states, ctx) is the body (plain def)."""

    def __init__(self, **descriptors: Any) -> None:
        self.descriptors = descriptors

    def open(self, ctx: ast.RuntimeContext) -> None:
        import types
        self.s = types.SimpleNamespace(**{n: getattr(ctx, _GETTERS[type(d)])(d)
                                          for n, d in self.descriptors.items()})

    def process_element(self, record: Any, ctx: Any) -> Any:
        return record[1](self.s, ctx)


class AsyncScript(Script):
    async def process_element(self, record: Any, ctx: Any) -> Any:  # type: ignore[override]
        await record[1](self.s, ctx)


def _first(record: Any) -> Any:
    return record[0]


_TMP_DIRS: list[str] = []


def _tmpdir() -> str:
    path = tempfile.mkdtemp(prefix="asyncstate-wm-")
    _TMP_DIRS.append(path)
    return path


@pytest.fixture(autouse=True, scope="module")
def _remove_tmp_dirs() -> Any:
    yield
    import shutil
    for path in _TMP_DIRS:
        shutil.rmtree(path, ignore_errors=True)


BACKENDS: dict[str, Callable[[], Any]] = {
    "heap": lambda: ast.HeapBackend(),
    "remote0": lambda: ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0),
    "remote5": lambda: ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=5),
    "rocksdb": lambda: ast.RocksDBBackend(_tmpdir()),
    "remote0-rocksdb": lambda: ast.SimulatedRemoteBackend(
        ast.RocksDBBackend(_tmpdir()), latency_ms=0),
}
BACKENDS["remote2-p1"] = lambda: ast.SimulatedRemoteBackend(
    ast.HeapBackend(), latency_ms=2, io_parallelism=1)
BACKENDS["rocksdb-p1"] = lambda: ast.RocksDBBackend(
    _tmpdir(), io_parallelism=1, inline_read_keys=0)
STORAGE_BACKENDS = ["heap", "remote0", "rocksdb", "remote0-rocksdb"]


async def run_records(fn: ast.KeyedProcessFunction, records: Iterable[Any], backend: Any,
                      **config: Any) -> list[Any]:
    async with ast.KeyedOperator(fn, key_selector=_first, backend=backend,
                                 config=ast.AsyncStateConfig(**config)) as op:
        for record in records:
            await op.process(record)
        await op.drain()
        return op.outputs()


def norm(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [norm(v) for v in value]
    if isinstance(value, dict):
        return {k: norm(v) for k, v in value.items()}
    return value


# =========================================================================================
# (1) watermarks, processing time, epochs
# =========================================================================================


class Tracker(ast.KeyedProcessFunction):
    """Records (key, rid, spec); marks `finished` at the very end of each record."""

    def __init__(self, spec_runner: Callable[..., Any] | None = None) -> None:
        self.finished: list[Any] = []
        self.started: list[Any] = []
        self.seen_wm: dict[Any, tuple[int, int]] = {}
        self.op: ast.KeyedOperator | None = None

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.v = ctx.get_state(V("v"))
        self.l = ctx.get_list_state(L("l"))

    async def process_element(self, record: Any, ctx: Any) -> None:
        _key, rid, steps = record
        self.started.append(rid)
        wm_start = self.op.current_watermark() if self.op is not None else None
        for step in steps:
            if step == "v":
                n = (await self.v.value() or 0) + 1
                await self.v.update(n)
            elif step == "l":
                await self.l.add(rid)
            elif step == "sleep":
                await asyncio.sleep(0.001)
            elif step == "yield":
                await asyncio.sleep(0)
            elif isinstance(step, asyncio.Event):
                await step.wait()
        wm_end = self.op.current_watermark() if self.op is not None else None
        self.seen_wm[rid] = (wm_start, wm_end)
        self.finished.append(rid)
        ctx.emit(rid)


async def _open(fn: Any, backend_name: str = "heap", **kw: Any) -> ast.KeyedOperator:
    config = kw.pop("config", None)
    op = ast.KeyedOperator(fn, key_selector=_first, backend=BACKENDS[backend_name](),
                           config=config, **kw)
    if isinstance(fn, Tracker):
        fn.op = op
    return op


@pytest.mark.timeout(30)
@pytest.mark.parametrize("backend_name", ["heap", "remote0", "remote5", "rocksdb"])
async def test_watermark_waits_for_records_blocked_behind_same_key(backend_name):
    fn = Tracker()
    op = await _open(fn, backend_name, config=ast.AsyncStateConfig(batch_size=3))
    async with op:
        for i in range(30):
            await op.process(("hot", i, ["v", "l", "v"]))
        for i in range(30, 40):
            await op.process((f"k{i % 4}", i, ["v", "sleep", "l"]))
        await op.advance_watermark(7)
        assert sorted(fn.finished) == list(range(40))
        assert op.current_watermark() == 7
        assert op.metrics["in_flight"] == 0
        assert op.metrics["records_done"] == op.metrics["records_in"] == 40
        # Per-key order held.
        assert [r for r in fn.finished if r < 30] == list(range(30))


@pytest.mark.timeout(30)
async def test_watermark_waits_for_record_awaiting_non_state_awaitable():
    fn = Tracker()
    op = await _open(fn)
    async with op:
        await op.process(("a", 0, ["sleep", "sleep", "v", "sleep"]))
        await op.process(("b", 1, ["yield", "v", "yield", "l"]))
        await op.advance_watermark(1)
        assert sorted(fn.finished) == [0, 1]
        assert op.outputs() == [1, 0] or sorted(op.outputs()) == [0, 1]


class LongChain(ast.KeyedProcessFunction):
    """Plain def: a then_compose chain of `n` read-modify-writes; emits at its end."""

    def __init__(self) -> None:
        self.finished: list[Any] = []

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.v = ctx.get_state(V("v"))

    def process_element(self, record: Any, ctx: Any) -> Any:
        _key, rid, n = record

        def step(i: int) -> Any:
            if i == n:
                def end(_: Any) -> None:
                    self.finished.append(rid)
                    ctx.emit(rid)
                return self.v.value().then_accept(end)
            return self.v.value().then_compose(
                lambda old: self.v.update((old or 0) + 1)).then_compose(lambda _: step(i + 1))
        return step(0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("backend_name", ["heap", "remote0", "remote5", "rocksdb"])
async def test_watermark_waits_for_long_callback_chains(backend_name):
    fn = LongChain()
    op = ast.KeyedOperator(fn, key_selector=_first, backend=BACKENDS[backend_name](),
                           config=ast.AsyncStateConfig(batch_size=4))
    async with op:
        for i in range(6):
            await op.process((i % 2, i, 25))
        await op.advance_watermark(3)
        assert sorted(fn.finished) == list(range(6))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("backend_name", ["heap", "remote5"])
async def test_records_admitted_after_the_watermark_are_not_waited_for(backend_name):
    fn = Tracker()
    op = await _open(fn, backend_name)
    gate = asyncio.Event()
    async with op:
        await op.process(("a", 0, ["v", "l"]))
        wm = asyncio.create_task(op.advance_watermark(5))
        await asyncio.sleep(0)  # the watermark call has posted its event
        await op.process(("a", 1, ["v", gate]))  # same key, after the watermark
        await op.process(("b", 2, [gate]))  # other key, after the watermark
        await asyncio.wait_for(wm, 10)
        assert fn.finished == [0]
        assert op.current_watermark() == 5
        gate.set()
        await op.drain()
        assert sorted(fn.finished) == [0, 1, 2]


@pytest.mark.timeout(30)
async def test_record_admitted_before_a_watermark_never_sees_it():
    """The watermark takes effect only after every earlier record finished: a record
    admitted before advance_watermark(ts) reads the old watermark throughout."""
    fn = Tracker()
    op = await _open(fn, "remote5")
    gate = asyncio.Event()
    async with op:
        await op.process(("a", 0, ["v", gate, "v"]))
        wm = asyncio.create_task(op.advance_watermark(100))
        await asyncio.sleep(0.02)
        assert not wm.done()
        assert op.current_watermark() == MIN_WM  # not yet in effect
        # A record admitted after the watermark, running before it takes effect.
        await op.process(("b", 1, ["v"]))
        await asyncio.sleep(0.02)
        gate.set()
        await asyncio.wait_for(wm, 10)
        assert op.current_watermark() == 100
        assert fn.seen_wm[0] == (MIN_WM, MIN_WM)
        await op.drain()


@pytest.mark.timeout(30)
async def test_watermark_never_goes_down_even_concurrently():
    fn = Tracker()
    op = await _open(fn, "remote5")
    async with op:
        await op.process(("a", 0, ["v", "sleep"]))
        t1 = asyncio.create_task(op.advance_watermark(50))
        await asyncio.sleep(0)
        await op.process(("a", 1, ["v"]))
        t2 = asyncio.create_task(op.advance_watermark(10))
        await asyncio.sleep(0)
        t3 = asyncio.create_task(op.advance_watermark(MIN_WM))
        await asyncio.wait_for(asyncio.gather(t1, t2, t3), 10)
        assert op.current_watermark() == 50
        await op.advance_watermark(49)
        assert op.current_watermark() == 50
        await op.advance_watermark(50)
        assert op.current_watermark() == 50


@pytest.mark.timeout(30)
async def test_many_concurrent_watermarks_finish_in_order_after_their_records():
    fn = Tracker()
    op = await _open(fn, "remote5", config=ast.AsyncStateConfig(batch_size=2))
    returned: list[tuple[int, list[Any], int]] = []
    admitted: list[int] = []

    async def advance(ts: int) -> None:
        before = list(admitted)
        await op.advance_watermark(ts)
        returned.append((ts, before, op.current_watermark()))
        # Every record admitted before the call has finished.
        assert set(before) <= set(fn.finished)

    async with op:
        tasks = []
        for i in range(20):
            await op.process((i % 3, i, ["v", "sleep", "l"] if i % 2 else ["v"]))
            admitted.append(i)
            tasks.append(asyncio.create_task(advance(i * 10)))
            await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.gather(*tasks), 20)
        assert op.current_watermark() == 190
        for ts, _before, seen in returned:
            assert seen >= ts


@pytest.mark.timeout(30)
async def test_watermark_extremes_and_validation():
    fn = Tracker()
    op = await _open(fn)
    async with op:
        assert op.current_watermark() == MIN_WM
        await op.advance_watermark(MIN_WM)
        assert op.current_watermark() == MIN_WM
        with pytest.raises(ast.ConfigError):
            await op.advance_watermark(MIN_WM - 1)
        with pytest.raises(ast.ConfigError):
            await op.advance_watermark(2**63)
        with pytest.raises((ast.ConfigError, TypeError)):
            await op.advance_watermark(1.5)  # type: ignore[arg-type]
        await op.process(("a", 0, ["v"]))
        await op.advance_watermark(MAX_WM)
        assert op.current_watermark() == MAX_WM
        assert fn.finished == [0]
        # The run continues normally at the maximum.
        await op.process(("a", 1, ["v"]))
        await op.advance_watermark(MAX_WM)
        assert fn.finished == [0, 1]
        assert op.current_watermark() == MAX_WM


@pytest.mark.timeout(30)
async def test_watermark_while_producer_is_blocked_by_back_pressure():
    fn = Tracker()
    op = await _open(fn, "heap", config=ast.AsyncStateConfig(max_in_flight=1))
    first, second = asyncio.Event(), asyncio.Event()
    async with op:
        await op.process(("a", 0, ["v", first]))
        producer = asyncio.create_task(op.process(("b", 1, ["v", second])))
        await asyncio.sleep(0.01)
        assert not producer.done()  # back-pressure
        wm = asyncio.create_task(op.advance_watermark(9))
        await asyncio.sleep(0.01)
        assert not wm.done()
        first.set()
        # The watermark does not wait for the record admitted after it (which now runs
        # and blocks on `second`).
        await asyncio.wait_for(wm, 10)
        await asyncio.wait_for(producer, 10)
        assert fn.finished == [0]
        assert op.current_watermark() == 9
        assert op.metrics["in_flight"] <= 1
        second.set()
        await op.drain()
        assert fn.finished == [0, 1]


@pytest.mark.timeout(30)
async def test_drain_snapshot_and_watermarks_interleave(tmp_path):
    fn = Tracker()
    op = await _open(fn, "remote5")
    async with op:
        for i in range(10):
            await op.process((i % 3, i, ["v", "l"]))
        wm = asyncio.create_task(op.advance_watermark(4))
        snap = asyncio.create_task(op.snapshot(tmp_path, 1))
        drain = asyncio.create_task(op.drain())
        await asyncio.wait_for(asyncio.gather(wm, snap, drain), 10)
        assert sorted(fn.finished) == list(range(10))
        assert op.current_watermark() == 4
    # The watermark is not part of keyed state: a restored operator starts at the minimum.
    fn2 = Tracker()
    op2 = ast.KeyedOperator(fn2, key_selector=_first, backend=ast.HeapBackend(),
                            restore_from=ast.checkpoint_path(tmp_path, 1))
    async with op2:
        assert op2.current_watermark() == MIN_WM


@pytest.mark.timeout(30)
async def test_advance_watermark_raises_the_run_failure():
    class Boom(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.v = ctx.get_state(V("v"))

        async def process_element(self, value, ctx):
            await self.v.value()
            raise ZeroDivisionError("boom")

    op = ast.KeyedOperator(Boom(), key_selector=_first,
                           backend=ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=2))
    with pytest.raises(ZeroDivisionError):
        async with op:
            await op.process(("a",))
            with pytest.raises(ZeroDivisionError):
                await asyncio.wait_for(op.advance_watermark(1), 10)
            # Later calls raise the same failure instead of waiting.
            with pytest.raises(ZeroDivisionError):
                await asyncio.wait_for(op.advance_watermark(2), 10)
            with pytest.raises(ZeroDivisionError):
                await asyncio.wait_for(op.process(("b",)), 10)


@pytest.mark.timeout(30)
async def test_advance_watermark_from_inside_a_record_raises():
    seen: list[Any] = []

    class Inside(ast.KeyedProcessFunction):
        op: Any = None

        async def process_element(self, value, ctx):
            try:
                await self.op.advance_watermark(5)
            except ast.InvalidStateError as exc:
                seen.append(exc)

    fn = Inside()
    op = ast.KeyedOperator(fn, key_selector=_first, backend=ast.HeapBackend())
    fn.op = op
    async with op:
        await op.process(("a",))
        await asyncio.wait_for(op.drain(), 10)
    assert len(seen) == 1
    assert op.current_watermark() == MIN_WM


class FireAndForget(ast.KeyedProcessFunction):
    """Chains that are neither returned nor awaited keep their record in flight."""

    def __init__(self, use_async: bool) -> None:
        self.use_async = use_async

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.v = ctx.get_state(V("v"))

    def process_element(self, record: Any, ctx: Any) -> Any:
        if self.use_async:
            return self._async(record, ctx)
        self.v.update(record[1]).then_compose(lambda _: self.v.value()).then_accept(
            lambda x: ctx.emit((record[1], x)))
        return None

    async def _async(self, record: Any, ctx: Any) -> None:
        await self.v.update(record[1])
        self.v.value().then_compose(lambda x: self.v.update(x + 1)).then_compose(
            lambda _: self.v.value()).then_accept(lambda x: ctx.emit((record[1], x)))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("backend_name", ["heap", "remote5", "rocksdb"])
async def test_watermark_waits_for_chains_not_returned_by_the_record(use_async, backend_name):
    op = ast.KeyedOperator(FireAndForget(use_async), key_selector=_first,
                           backend=BACKENDS[backend_name]())
    async with op:
        for i in range(6):
            await op.process((i % 2, i))
        await op.advance_watermark(1)
        bump = 1 if use_async else 0
        assert sorted(op.outputs()) == [(i, i + bump) for i in range(6)]
        assert op.metrics["in_flight"] == 0


@pytest.mark.timeout(30)
async def test_pending_watermark_is_not_cancelled_when_the_operator_closes_on_error():
    class Gate(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.v = ctx.get_state(V("v"))

        async def process_element(self, record, ctx):
            await self.v.value()
            await record[1].wait()  # a real Task: awaits a non-state awaitable

    op = ast.KeyedOperator(Gate(), key_selector=_first, backend=ast.HeapBackend())
    gate = asyncio.Event()
    with pytest.raises(KeyError):
        async with op:
            await op.process(("a", gate))
            wm = asyncio.create_task(op.advance_watermark(5))
            await asyncio.sleep(0.01)
            raise KeyError("body failed")
    done, _ = await asyncio.wait([wm], timeout=5)
    assert done, "advance_watermark hangs after close"
    assert not wm.cancelled(), "nobody cancelled the advance_watermark task"
    assert isinstance(wm.exception(), ast.InvalidStateError)
    assert str(wm.exception()) == "the operator closed before this call returned"


# -- processing time ---------------------------------------------------------------------


@pytest.mark.timeout(30)
async def test_advance_processing_time_rules():
    clock = ast.ManualClock(100)
    fn = Tracker()
    op = await _open(fn, "remote5", clock=clock)
    gate = asyncio.Event()
    async with op:
        await op.process(("a", 0, ["v", gate]))
        pt = asyncio.create_task(op.advance_processing_time(200))
        await asyncio.sleep(0.02)
        assert not pt.done()  # waits for the earlier record
        gate.set()
        await asyncio.wait_for(pt, 10)
        assert fn.finished == [0]
        assert clock.now_ms() == 200
        await op.advance_processing_time(200)  # equal: fine
        with pytest.raises(ast.ConfigError):
            await op.advance_processing_time(199)
        assert clock.now_ms() == 200
        with pytest.raises(ast.ConfigError):
            await op.advance_processing_time(2**63)
        assert clock.now_ms() == 200
        await op.advance_processing_time(MAX_WM)
        assert clock.now_ms() == MAX_WM
        # Processing time does not move the watermark.
        assert op.current_watermark() == MIN_WM


@pytest.mark.timeout(30)
async def test_advance_processing_time_needs_manual_clock():
    op = ast.KeyedOperator(Tracker(), key_selector=_first, backend=ast.HeapBackend())
    async with op:
        with pytest.raises(ast.InvalidStateError):
            await op.advance_processing_time(10)


@pytest.mark.timeout(30)
async def test_processing_time_and_watermarks_interleave_in_order():
    clock = ast.ManualClock(0)
    fn = Tracker()
    op = await _open(fn, "remote5", clock=clock)
    order: list[str] = []

    async def wm(ts: int) -> None:
        await op.advance_watermark(ts)
        order.append(f"wm{ts}")

    async def pt(ts: int) -> None:
        await op.advance_processing_time(ts)
        order.append(f"pt{ts}")

    async with op:
        await op.process(("a", 0, ["v", "sleep", "v"]))
        t1 = asyncio.create_task(wm(1))
        await asyncio.sleep(0)
        t2 = asyncio.create_task(pt(10))
        await asyncio.sleep(0)
        t3 = asyncio.create_task(wm(2))
        await asyncio.wait_for(asyncio.gather(t1, t2, t3), 10)
        assert fn.finished == [0]
        assert order.index("wm1") < order.index("wm2")
        assert op.current_watermark() == 2


# -- a model of which records must have finished when each advance returns ---------------


@st.composite
def interleavings(draw: Any) -> list[tuple[Any, ...]]:
    ops: list[tuple[Any, ...]] = []
    n = draw(st.integers(1, 25))
    for i in range(n):
        kind = draw(st.sampled_from(["rec", "rec", "rec", "wm", "pt", "yield"]))
        if kind == "rec":
            steps = draw(st.lists(st.sampled_from(["v", "l", "yield", "sleep"]), max_size=4))
            ops.append(("rec", draw(st.integers(0, 3)), i, steps))
        elif kind == "wm":
            ops.append(("wm", draw(st.integers(-5, 50))))
        elif kind == "pt":
            ops.append(("pt", draw(st.integers(0, 5))))
        else:
            ops.append(("yield",))
    return ops


@pytest.mark.timeout(120)
@settings(max_examples=int(__import__("os").environ.get("WMNS_EXAMPLES", "40")), deadline=None)
@given(ops=interleavings(),
       backend_name=st.sampled_from(["heap", "remote0", "remote5", "remote2-p1", "rocksdb-p1"]),
       max_in_flight=st.sampled_from([1, 2, 100]), batch_size=st.sampled_from([1, 3, 1000]),
       buffer_timeout_ms=st.sampled_from([0, 1, 1000]))
def test_model_every_advance_waits_for_exactly_the_earlier_records(
        ops, backend_name, max_in_flight, batch_size, buffer_timeout_ms):
    async def main() -> None:
        clock = ast.ManualClock(0)
        fn = Tracker()
        op = await _open(fn, backend_name, clock=clock,
                         config=ast.AsyncStateConfig(max_in_flight=max_in_flight,
                                                     batch_size=batch_size,
                                                     buffer_timeout_ms=buffer_timeout_ms))
        admitted: list[int] = []
        issued_wms: list[int] = []
        admitted_wm_bound: dict[int, int] = {}
        problems: list[str] = []
        pt_now = [0]

        async def advance(kind: str, ts: int, before: list[int], wms_before: list[int]) -> None:
            if kind == "wm":
                await op.advance_watermark(ts)
            else:
                await op.advance_processing_time(ts)
            missing = set(before) - set(fn.finished)
            if missing:
                problems.append(f"{kind}({ts}) returned before records {sorted(missing)}")
            if kind == "wm" and op.current_watermark() < max([*wms_before, ts, MIN_WM]):
                problems.append(f"wm({ts}) returned with watermark {op.current_watermark()}")

        async with op:
            tasks = []
            for entry in ops:
                if entry[0] == "rec":
                    _, key, rid, steps = entry
                    admitted_wm_bound[rid] = max(issued_wms, default=MIN_WM)
                    await op.process((key, rid, steps))
                    admitted.append(rid)
                elif entry[0] == "wm":
                    issued_wms.append(entry[1])
                    tasks.append(asyncio.create_task(
                        advance("wm", entry[1], list(admitted), list(issued_wms[:-1]))))
                    await asyncio.sleep(0)
                elif entry[0] == "pt":
                    pt_now[0] += entry[1]
                    tasks.append(asyncio.create_task(
                        advance("pt", pt_now[0], list(admitted), [])))
                    await asyncio.sleep(0)
                else:
                    await asyncio.sleep(0)
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
            await asyncio.wait_for(op.drain(), 30)
            assert not problems, problems
            assert sorted(fn.finished) == sorted(admitted)
            assert op.current_watermark() == max(issued_wms, default=MIN_WM)
            # No record ever saw a watermark issued after it was admitted.
            for rid, (start, end) in fn.seen_wm.items():
                assert start <= end
                assert end <= admitted_wm_bound[rid], (rid, start, end)

    asyncio.run(main())


# =========================================================================================
# (2) namespaces
# =========================================================================================

NAMESPACES: list[Any] = [None, "w1", ("t", 1), -1, b"\xff\xff", 0, [], ""]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend_name", STORAGE_BACKENDS)
async def test_every_state_kind_keeps_namespaces_apart(backend_name):
    async def write(s, ctx):
        for i, ns in enumerate(NAMESPACES):
            for st_ in (s.v, s.l, s.m, s.r, s.a):
                st_.set_current_namespace(ns)
            await s.v.update(f"v{i}")
            await s.l.add_all([i, i + 100])
            await s.m.put_all({f"k{i}": i, "shared": i})
            s.r.add(i)
            s.r.add(1)
            s.a.add(i)
            await s.a.add(2)

    async def read(s, ctx):
        got = []
        for ns in [*NAMESPACES, "never"]:
            for st_ in (s.v, s.l, s.m, s.r, s.a):
                st_.set_current_namespace(ns)
            lst = await (await s.l.get()).to_list()
            entries = sorted(await (await s.m.entries()).to_list())
            got.append((await s.v.value(), lst, entries, await s.m.is_empty(),
                        await s.r.get(), await s.a.get()))
        ctx.emit(got)

    out = await run_records(AsyncScript(**all_kinds()), [("k", write), ("k", read)],
                            BACKENDS[backend_name](), iterator_chunk_size=1)
    expected = [(f"v{i}", [i, i + 100], sorted([(f"k{i}", i), ("shared", i)]), False,
                 i + 1, i + 2)
                for i in range(len(NAMESPACES))]
    expected.append((None, [], [], True, None, None))
    assert norm(out[0]) == norm(expected)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend_name", STORAGE_BACKENDS)
async def test_clear_in_one_namespace_keeps_the_others_for_every_kind(backend_name):
    async def write(s, ctx):
        for ns in ("x", "y", None):
            for st_ in (s.v, s.l, s.m, s.r, s.a):
                st_.set_current_namespace(ns)
            await s.v.update(ns or "d")
            await s.l.add(ns or "d")
            await s.m.put("k", ns or "d")
            await s.r.add(5)
            await s.a.add(7)

    async def clear_y(s, ctx):
        for st_ in (s.v, s.l, s.m, s.r, s.a):
            st_.set_current_namespace("y")
            st_.clear()  # not awaited: issued in order

    async def read(s, ctx):
        got = {}
        for ns in ("x", "y", None):
            for st_ in (s.v, s.l, s.m, s.r, s.a):
                st_.set_current_namespace(ns)
            got[ns] = (await s.v.value(), await (await s.l.get()).to_list(),
                       await s.m.get("k"), await s.r.get(), await s.a.get())
        ctx.emit(got)

    out = await run_records(AsyncScript(**all_kinds()),
                            [("k", write), ("k", clear_y), ("k", read)],
                            BACKENDS[backend_name]())

    assert norm(out[0]) == {"x": ["x", ["x"], "x", 5, 7], "y": [None, [], None, None, None],
                            None: ["d", ["d"], "d", 5, 7]}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend_name", STORAGE_BACKENDS)
async def test_namespace_identity_follows_canonical_bytes(backend_name):
    """A list and a tuple with equal items are the same namespace; 1, 1.0 and True are
    three namespaces; None is the default namespace."""

    async def write(s, ctx):
        for ns, val in ((1, "int"), (1.0, "float"), (True, "bool"), ((1, "a"), "tuple"),
                        (None, "default")):
            s.v.set_current_namespace(ns)
            await s.v.update(val)

    async def read(s, ctx):
        got = []
        for ns in (1, 1.0, True, [1, "a"], (1, "a"), None, False, 0):
            s.v.set_current_namespace(ns)
            got.append(await s.v.value())
        s.v.set_current_namespace("x")
        s.v.set_current_namespace(None)  # back to the default
        got.append(await s.v.value())
        ctx.emit(got)

    out = await run_records(AsyncScript(v=V("v")), [("k", write), ("k", read)],
                            BACKENDS[backend_name]())
    assert out == [["int", "float", "bool", "tuple", "tuple", "default", None, None,
                    "default"]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend_name", STORAGE_BACKENDS)
async def test_namespace_does_not_leak_into_next_record_or_other_states(backend_name):
    def set_and_leave(s, ctx):
        s.v.set_current_namespace("leak")
        s.l.set_current_namespace("leak")
        s.v.update("in leak")
        return s.l.add("in leak")

    def read(s, ctx):
        # A new record of the same key starts in the default namespace for every state.
        f1 = s.v.value()
        f2 = s.l.get().then_compose(lambda it: it.to_list())
        s.v.set_current_namespace("leak")  # affects only s.v
        f3 = s.v.value()
        f4 = s.m.is_empty()
        return ast.combine_all([f1, f2, f3, f4]).then_accept(
            lambda got: ctx.emit((ctx.current_key, got)))

    records = [("k", set_and_leave), ("k", read), ("k2", read)]
    # max_in_flight=1 makes records reuse everything the previous one left behind.
    for mif in (1, 100):
        out = await run_records(Script(v=V("v"), l=L("l"), m=M("m")), records,
                                BACKENDS[backend_name](), max_in_flight=mif)
        assert sorted(out) == [("k", [None, [], "in leak", True]),
                               ("k2", [None, [], None, True])]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend_name", STORAGE_BACKENDS)
async def test_iterator_keeps_its_namespace_when_the_namespace_changes(backend_name):
    """An iterator created in namespace "a" loads its later chunks from "a", even after
    the record switched the state to another namespace."""

    async def write(s, ctx):
        for ns, n in (("a", 7), ("b", 3)):
            s.l.set_current_namespace(ns)
            s.m.set_current_namespace(ns)
            await s.l.add_all([f"{ns}{i}" for i in range(n)])
            await s.m.put_all({f"{ns}{i}": i for i in range(n)})

    async def read(s, ctx):
        s.l.set_current_namespace("a")
        s.m.set_current_namespace("a")
        it_l = await s.l.get()
        it_m = await s.m.keys()
        s.l.set_current_namespace("b")
        s.m.set_current_namespace("b")
        ctx.emit(await it_l.to_list())
        ctx.emit(sorted(await it_m.to_list()))

    out = await run_records(AsyncScript(l=L("l"), m=M("m")), [("k", write), ("k", read)],
                            BACKENDS[backend_name](), iterator_chunk_size=2)
    assert out == [[f"a{i}" for i in range(7)], sorted(f"a{i}" for i in range(7))]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend_name", STORAGE_BACKENDS)
async def test_merging_adds_capture_namespace_at_call(backend_name):
    def step(s, ctx):
        s.r.set_current_namespace("x")
        s.r.add(1)
        s.a.set_current_namespace("x")
        s.a.add(10)
        s.r.set_current_namespace("y")
        s.r.add(2)
        s.a.set_current_namespace("y")
        s.a.add(20)
        s.r.set_current_namespace("x")
        s.r.add(100)
        s.r.clear()  # clears "x" only, after the pending adds
        s.r.add(3)
        s.a.set_current_namespace(None)
        fa = s.a.get()
        s.r.set_current_namespace("y")
        fy = s.r.get()
        s.r.set_current_namespace("x")
        fx = s.r.get()
        s.a.set_current_namespace("x")
        fax = s.a.get()
        return ast.combine_all([fx, fy, fa, fax]).then_accept(ctx.emit)

    out = await run_records(Script(r=R("r", lambda a, b: a + b), a=A("a", Sum())),
                            [("k", step)], BACKENDS[backend_name]())
    assert out == [[3, 2, None, 10]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend_name", STORAGE_BACKENDS)
async def test_namespace_neighbours_in_byte_order_do_not_bleed(backend_name):
    """Namespaces whose canonical bytes are prefixes/neighbours of each other stay apart
    for iteration and clear (map and list prefixes in an ordered store)."""
    namespaces = [-1, -2, -32, -33, 127, 128, 255, 256, b"", b"\x00", b"\xff", "a", "a\x00",
                  "ab", [], [[]], [None], ["a"], ["a", "b"], 2**64 - 1, -(2**63)]

    async def write(s, ctx):
        for i, ns in enumerate(namespaces):
            s.m.set_current_namespace(ns)
            s.l.set_current_namespace(ns)
            await s.m.put_all({i: i, -1: i, b"\xff": i})
            await s.l.add(i)

    async def clear_some(s, ctx):
        for i, ns in enumerate(namespaces):
            if i % 3 == 0:
                s.m.set_current_namespace(ns)
                s.l.set_current_namespace(ns)
                s.m.clear()
                await s.l.clear()

    async def read(s, ctx):
        got = []
        for ns in namespaces:
            s.m.set_current_namespace(ns)
            s.l.set_current_namespace(ns)
            got.append((sorted(await (await s.m.values()).to_list()),
                        await (await s.l.get()).to_list()))
        ctx.emit(got)

    for key in ("k", -1, b"\xff"):
        out = await run_records(AsyncScript(m=M("m"), l=L("l")),
                                [(key, write), (key, clear_some), (key, read)],
                                BACKENDS[backend_name](), iterator_chunk_size=2)
        expected = [([], []) if i % 3 == 0 else ([i, i, i], [i])
                    for i in range(len(namespaces))]
        assert norm(out[0]) == norm(expected)


# -- snapshot / restore / rescale ---------------------------------------------------------

SNAP_NS: list[Any] = [None, "w", (1, 2), -1, b"\xff"]


async def _write_all(s: Any, ctx: Any) -> None:
    key = ctx.current_key
    for i, ns in enumerate(SNAP_NS):
        for st_ in (s.v, s.l, s.m, s.r, s.a):
            st_.set_current_namespace(ns)
        await s.v.update([key, i])
        await s.l.add_all([i, key])
        await s.m.put_all({i: key, "n": i})
        await s.r.add(i + 1)
        await s.a.add(i + 2)


async def _read_all(s: Any, ctx: Any) -> None:
    got = []
    for ns in [*SNAP_NS, "absent"]:
        for st_ in (s.v, s.l, s.m, s.r, s.a):
            st_.set_current_namespace(ns)
        got.append((await s.v.value(), await (await s.l.get()).to_list(),
                    sorted(await (await s.m.entries()).to_list(), key=repr),
                    await s.r.get(), await s.a.get()))
    ctx.emit((ctx.current_key, got))


def _expected_read(key: Any) -> Any:
    rows = []
    for i, _ns in enumerate(SNAP_NS):
        rows.append(([key, i], [i, key], sorted([(i, key), ("n", i)], key=repr), i + 1, i + 2))
    rows.append((None, [], [], None, None))
    return norm((key, rows))


KEYS = [f"k{i}" for i in range(12)] + [7, -1, (1, "x")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("write_backend", ["heap", "rocksdb"])
@pytest.mark.parametrize("read_backend", ["heap", "rocksdb"])
async def test_namespaces_survive_snapshot_restore_and_rescale(tmp_path, write_backend,
                                                                 read_backend):
    fn = AsyncScript(**all_kinds())
    async with ast.KeyedOperator(fn, key_selector=_first,
                                 backend=BACKENDS[write_backend]()) as op:
        for k in KEYS:
            await op.process((k, _write_all))
        path = await op.snapshot(tmp_path / "chk", 1)

    for parallelism in (1, 3):
        outs: list[Any] = []
        for index in range(parallelism):
            fn2 = AsyncScript(**all_kinds())
            op2 = ast.KeyedOperator(fn2, key_selector=_first,
                                    backend=BACKENDS[read_backend](), restore_from=path,
                                    parallelism=parallelism, operator_index=index)
            async with op2:
                for k in KEYS:
                    kg = ast.assign_to_key_group(k, 128)
                    if op2.key_group_range.contains(kg):
                        await op2.process((k, _read_all))
                await op2.drain()
                outs.extend(op2.outputs())
        assert sorted((norm(o) for o in outs), key=repr) == \
            sorted((_expected_read(k) for k in KEYS), key=repr)


# -- model-based: random operations on every kind in random namespaces --------------------

import msgpack  # noqa: E402

MODEL_NS: list[Any] = [None, "a", ("a",), ["a"], 1, 1.0, True, -1, b"\xff", (), ""]


def _canon(x: Any) -> bytes:
    return msgpack.packb(x, use_bin_type=True)


@st.composite
def ns_programs(draw: Any) -> list[tuple[Any, list[tuple[Any, ...]]]]:
    records = []
    for _ in range(draw(st.integers(1, 6))):
        key = draw(st.sampled_from(["k1", "k2"]))
        ops = []
        for _ in range(draw(st.integers(1, 8))):
            kind = draw(st.sampled_from("vlmra"))
            ns = draw(st.sampled_from(MODEL_NS))
            x = draw(st.integers(0, 9))
            uk = draw(st.sampled_from([0, 1, "z", -1]))
            if kind == "v":
                op = draw(st.sampled_from(["update", "get", "clear"]))
            elif kind == "l":
                op = draw(st.sampled_from(["add", "add_all", "update", "get", "clear"]))
            elif kind == "m":
                op = draw(st.sampled_from(["put", "remove", "entries", "is_empty", "contains",
                                           "get", "clear", "put_all", "keys"]))
            else:
                op = draw(st.sampled_from(["add", "get", "clear"]))
            ops.append((kind, ns, op, x, uk))
        records.append((key, ops))
    return records


def _model_run(records: list[tuple[Any, list[tuple[Any, ...]]]]) -> list[Any]:
    store: dict[tuple[str, str, bytes], Any] = {}
    outs = []
    for key, ops in records:
        got = []
        for kind, ns, op, x, uk in ops:
            slot = (kind, key, _canon(ns))
            cur = store.get(slot)
            if op == "clear":
                store.pop(slot, None)
            elif kind == "v":
                if op == "update":
                    store[slot] = x
                else:
                    got.append(cur)
            elif kind == "l":
                if op == "add":
                    store[slot] = (cur or []) + [x]
                elif op == "add_all":
                    store[slot] = (cur or []) + [x, x + 1]
                elif op == "update":
                    store[slot] = [x]
                else:
                    got.append(list(cur or []))
            elif kind == "m":
                m = dict(cur or {})
                if op == "put":
                    m[_canon(uk)] = (uk, x)
                elif op == "put_all":
                    m[_canon(uk)] = (uk, x)
                    m[_canon("pa")] = ("pa", x)
                elif op == "remove":
                    m.pop(_canon(uk), None)
                elif op == "entries":
                    got.append(sorted(([k, v] for k, v in m.values()), key=repr))
                elif op == "keys":
                    got.append(sorted((k for k, _v in m.values()), key=repr))
                elif op == "is_empty":
                    got.append(not m)
                elif op == "contains":
                    got.append(_canon(uk) in m)
                elif op == "get":
                    got.append(m.get(_canon(uk), (None, None))[1])
                if m:
                    store[slot] = m
                else:
                    store.pop(slot, None)
            elif kind == "r":
                if op == "add":
                    store[slot] = x if cur is None else cur + x
                else:
                    got.append(cur)
            else:
                if op == "add":
                    store[slot] = (cur or 0) + x
                else:
                    got.append(cur)
        outs.append((key, got))
    return outs


def _issue(s: Any, kind: str, ns: Any, op: str, x: int, uk: Any) -> Any:
    state = getattr(s, kind)
    state.set_current_namespace(ns)
    if op == "clear":
        state.clear()
        return None
    if kind == "v":
        if op == "update":
            state.update(x)
            return None
        return state.value()
    if kind == "l":
        if op == "add":
            state.add(x)
        elif op == "add_all":
            state.add_all([x, x + 1])
        elif op == "update":
            state.update([x])
        else:
            return state.get().then_compose(lambda it: it.to_list())
        return None
    if kind == "m":
        if op == "put":
            state.put(uk, x)
        elif op == "put_all":
            state.put_all({uk: x, "pa": x})
        elif op == "remove":
            state.remove(uk)
        elif op == "entries":
            return state.entries().then_compose(lambda it: it.to_list()).then_apply(
                lambda es: sorted(([k, v] for k, v in es), key=repr))
        elif op == "keys":
            return state.keys().then_compose(lambda it: it.to_list()).then_apply(
                lambda ks: sorted(ks, key=repr))
        elif op == "is_empty":
            return state.is_empty()
        elif op == "contains":
            return state.contains(uk)
        else:
            return state.get(uk)
        return None
    if op == "add":
        state.add(x)
        return None
    return state.get()


class NsProgram(ast.KeyedProcessFunction):
    """A record is (key, ops): every op issued without awaiting, reads combined."""

    def __init__(self, awaited: bool) -> None:
        self.awaited = awaited

    def open(self, ctx: ast.RuntimeContext) -> None:
        import types
        self.s = types.SimpleNamespace(**{n: getattr(ctx, _GETTERS[type(d)])(d)
                                          for n, d in all_kinds().items()})

    def process_element(self, record: Any, ctx: Any) -> Any:
        if self.awaited:
            return self._awaited(record, ctx)
        key, ops = record
        reads = [f for f in (_issue(self.s, *op) for op in ops) if f is not None]
        return ast.combine_all(reads).then_accept(lambda got: ctx.emit((key, got)))

    async def _awaited(self, record: Any, ctx: Any) -> None:
        key, ops = record
        got = []
        for op in ops:
            f = _issue(self.s, *op)
            if f is not None:
                got.append(await f)
        ctx.emit((key, got))


@pytest.mark.timeout(300)
@settings(max_examples=int(__import__("os").environ.get("WMNS_EXAMPLES", "40")), deadline=None)
@given(records=ns_programs(), backend_a=st.sampled_from([*STORAGE_BACKENDS, "rocksdb-p1"]),
       backend_b=st.sampled_from([*STORAGE_BACKENDS, "rocksdb-p1", "remote2-p1"]),
       cut=st.integers(0, 6),
       awaited=st.booleans(), chunk=st.sampled_from([1, 2, 1000]))
def test_model_namespaces_every_kind_across_snapshot_restore(records, backend_a, backend_b,
                                                               cut, awaited, chunk):
    expected = _model_run(records)
    cut = min(cut, len(records))
    config = ast.AsyncStateConfig(iterator_chunk_size=chunk, batch_size=3)

    async def main() -> list[Any]:
        with tempfile.TemporaryDirectory() as tmp:
            async with ast.KeyedOperator(NsProgram(awaited), key_selector=_first,
                                         backend=BACKENDS[backend_a](), config=config) as op:
                for r in records[:cut]:
                    await op.process(r)
                path = await op.snapshot(tmp, 1)
                first = op.outputs()
            async with ast.KeyedOperator(NsProgram(awaited), key_selector=_first,
                                         backend=BACKENDS[backend_b](), config=config,
                                         restore_from=path) as op2:
                for r in records[cut:]:
                    await op2.process(r)
                await op2.drain()
                return first + op2.outputs()

    out = asyncio.run(main())

    def per_key(rows: list[Any]) -> dict[str, list[Any]]:
        d: dict[str, list[Any]] = {}
        for k, got in rows:
            d.setdefault(k, []).append(norm(got))
        return d

    assert per_key(out) == per_key([(k, norm(g)) for k, g in expected])
