"""Watermarks and processing time: `advance_watermark` and `advance_processing_time` return
after every record admitted before them and never wait for later ones; the watermark only
goes up; timestamps are validated."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from operator_helpers import (
    EmitTs,
    assert_waits_for_records,
)
from shared_functions import (
    Counter,
    Reached,
    Step,
    cfg,
    first,
    keyed_operator,
    let_loop_run,
    new_backend,
    slow_examples,
)

import asyncstate as ast


@pytest.mark.timeout(30)
async def test_bool_watermark_and_processing_time_are_refused_on_both_builds() -> None:
    async with ast.KeyedOperator(EmitTs(), key_selector=first, backend=ast.HeapBackend(),
                                 config=cfg(), clock=ast.ManualClock()) as op:
        with pytest.raises(ast.ConfigError, match=r"^watermark must be an int"):
            await op.advance_watermark(True)
        assert op.current_watermark() == -(2**63)
        with pytest.raises(ast.ConfigError, match=r"^processing time must be an int"):
            await op.advance_processing_time(True)
        assert op.clock.now_ms() == 0


V = ast.ValueStateDescriptor
L = ast.ListStateDescriptor
MIN_WM = -(2**63)
MAX_WM = 2**63 - 1


class Tracker(ast.KeyedProcessFunction):
    """Records (key, rid, spec); marks `finished` at the very end of each record."""

    def __init__(self, spec_runner: Callable[..., Any] | None = None) -> None:
        self.finished: list[Any] = []
        self.started: list[Any] = []
        self.seen_wm: dict[Any, tuple[int, int]] = {}
        self.op: ast.KeyedOperator | None = None
        self.at_gate = Reached()  # records that reached an Event step
        self.done = Reached()  # records that finished

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
                self.at_gate.mark()
                await step.wait()
        wm_end = self.op.current_watermark() if self.op is not None else None
        self.seen_wm[rid] = (wm_start, wm_end)
        self.finished.append(rid)
        self.done.mark()
        ctx.emit(rid)


async def _open(fn: Any, backend_name: str = "heap", **kw: Any) -> ast.KeyedOperator:
    config = kw.pop("config", None)
    op = ast.KeyedOperator(fn, key_selector=first, backend=new_backend(backend_name),
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
    op = ast.KeyedOperator(fn, key_selector=first, backend=new_backend(backend_name),
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
async def test_a_watermark_is_a_barrier_between_the_records_before_and_after_it():
    """The watermark takes effect only after every earlier record finished (a record admitted
    before advance_watermark(ts) reads the old watermark throughout), and records admitted
    after it start only once it took effect (they read the new one)."""
    fn = Tracker()
    op = await _open(fn, "remote5")
    gate = asyncio.Event()
    async with op:
        await op.process(("a", 0, ["v", gate, "v"]))
        wm = asyncio.create_task(op.advance_watermark(100))
        await fn.at_gate.at_least(1)
        await let_loop_run()
        assert not wm.done()
        assert op.current_watermark() == MIN_WM  # not yet in effect
        await op.process(("b", 1, ["v"]))  # admitted after the watermark: it waits
        await let_loop_run()
        assert fn.started == [0]
        gate.set()
        await asyncio.wait_for(wm, 10)
        assert op.current_watermark() == 100
        await asyncio.wait_for(op.drain(), 10)
        assert fn.finished == [0, 1]
        assert fn.seen_wm == {0: (MIN_WM, MIN_WM), 1: (100, 100)}


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
        # The compiled build's call boundary refuses a float where an int is declared.
        with pytest.raises(ast.ConfigError):
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
        await fn.at_gate.at_least(1)
        await let_loop_run()
        assert not producer.done()  # back-pressure
        wm = asyncio.create_task(op.advance_watermark(9))
        await let_loop_run()
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
    op2 = ast.KeyedOperator(fn2, key_selector=first, backend=ast.HeapBackend(),
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

    op = ast.KeyedOperator(Boom(), key_selector=first,
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
    op = ast.KeyedOperator(fn, key_selector=first, backend=ast.HeapBackend())
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
    op = ast.KeyedOperator(FireAndForget(use_async), key_selector=first,
                           backend=new_backend(backend_name))
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

    op = ast.KeyedOperator(Gate(), key_selector=first, backend=ast.HeapBackend())
    gate = asyncio.Event()
    with pytest.raises(KeyError):
        async with op:
            await op.process(("a", gate))
            wm = asyncio.create_task(op.advance_watermark(5))
            await let_loop_run()  # the watermark call waits for record "a"
            raise KeyError("body failed")
    done, _ = await asyncio.wait([wm], timeout=5)
    assert done, "advance_watermark hangs after close"
    assert not wm.cancelled(), "nobody cancelled the advance_watermark task"
    assert isinstance(wm.exception(), ast.InvalidStateError)
    assert str(wm.exception()) == "the operator closed before this call returned"


@pytest.mark.timeout(30)
async def test_advance_processing_time_rules():
    clock = ast.ManualClock(100)
    fn = Tracker()
    op = await _open(fn, "remote5", clock=clock)
    gate = asyncio.Event()
    async with op:
        await op.process(("a", 0, ["v", gate]))
        pt = asyncio.create_task(op.advance_processing_time(200))
        await fn.at_gate.at_least(1)
        await let_loop_run()
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
    op = ast.KeyedOperator(Tracker(), key_selector=first, backend=ast.HeapBackend())
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
@settings(max_examples=slow_examples(40), deadline=None)
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


@pytest.mark.timeout(10)
async def test_advance_watermark_returns_after_every_earlier_record(make_backend):
    await assert_waits_for_records(make_backend, lambda op: op.advance_watermark(100))


@pytest.mark.timeout(10)
async def test_advance_processing_time_returns_after_every_earlier_record(make_backend):
    clock = ast.ManualClock()
    await assert_waits_for_records(make_backend, lambda op: op.advance_processing_time(50),
                                    clock=clock)
    assert clock.now_ms() == 50


@pytest.mark.timeout(10)
async def test_advance_watermark_does_not_wait_for_later_records(make_backend):
    early, late = asyncio.Event(), asyncio.Event()

    async def wait_early(fn, ctx):
        await early.wait()

    async def wait_late(fn, ctx):
        await late.wait()

    async with keyed_operator(Step(), make_backend()) as op:
        await op.process(("a", wait_early))
        task = asyncio.ensure_future(op.advance_watermark(10))
        await let_loop_run()
        await op.process(("b", wait_late))
        await let_loop_run()
        assert not task.done()
        early.set()
        async with asyncio.timeout(3):
            await task
        late.set()
        await op.drain()


async def test_advance_processing_time_sets_the_manual_clock():
    clock = ast.ManualClock(start_ms=10)
    async with keyed_operator(Counter(), ast.HeapBackend(), clock=clock) as op:
        await op.advance_processing_time(20)
        assert clock.now_ms() == 20
        await op.advance_processing_time(20)  # not backwards: allowed
        with pytest.raises(ast.ConfigError, match="never goes backwards, got 19"):
            await op.advance_processing_time(19)
        assert clock.now_ms() == 20
        await op.process(("a", 1))
        await op.drain()
        assert op.outputs() == [("a", 1)]


async def test_advance_processing_time_needs_a_manual_clock():
    async with keyed_operator(Counter(), ast.HeapBackend()) as op:
        with pytest.raises(ast.AsyncStateError, match="ManualClock"):
            await op.advance_processing_time(1)
