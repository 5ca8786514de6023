"""The timer service: event- and processing-time timers fired under their keys, ordered with
each key's records, through checkpoints and rescaling, on the heap and RocksDB."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shared_functions import LOOP_NAMES, Boom, run_on_loop, slow_examples

import asyncstate as ast
from asyncstate.serde import canonical_key

BACKENDS = {
    "heap": lambda path: ast.HeapBackend(),
    "rocksdb": lambda path: ast.RocksDBBackend(path),
    "rocksdb-heap-timers": lambda path: ast.RocksDBBackend(path, timers="heap"),
    "remote0": lambda path: ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0),
}


@pytest.fixture(params=sorted(BACKENDS))
def timer_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    counter = iter(range(1000))
    return lambda: BACKENDS[request.param](tmp_path / f"db{next(counter)}")


def key(record: Any) -> Any:
    return record[0]


def timestamp(record: Any) -> Any:
    return record[1]


def operator(fn: ast.KeyedProcessFunction, backend: Any, **kwargs: Any) -> ast.KeyedOperator:
    return ast.KeyedOperator(fn, key_selector=kwargs.pop("key_selector", key),
                             timestamp_selector=kwargs.pop("timestamp_selector", timestamp),
                             backend=backend, **kwargs)


class EventTimers(ast.KeyedProcessFunction):
    """Each record (key, ts, [timer timestamps]) registers those event-time timers; on_timer
    emits ("timer", key, ts) after reading and bumping a per-key state."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.fired = ctx.get_state(ast.ValueStateDescriptor("fired"))

    def process_element(self, record: Any, ctx: ast.RecordContext) -> None:
        for ts in record[2] if len(record) > 2 else ():
            ctx.timer_service.register_event_time_timer(ts)
        ctx.emit(("record", ctx.current_key, ctx.timestamp))

    async def on_timer(self, ts: int, ctx: ast.RecordContext) -> None:
        n = (await self.fired.value() or 0) + 1
        await self.fired.update(n)
        assert ctx.time_domain is ast.TimeDomain.EVENT_TIME and ctx.timestamp == ts
        ctx.emit(("timer", ctx.current_key, ts))


async def test_flink_scenario_51_watermark_fires_one_key_s_timers_in_order(timer_backend):
    class Fn(ast.KeyedProcessFunction):
        def process_element(self, record: Any, ctx: ast.RecordContext) -> None:
            ctx.timer_service.register_event_time_timer(int(record[1]))

        def on_timer(self, ts: int, ctx: ast.RecordContext) -> None:
            ctx.emit(f"EventTimer-{ctx.current_key}-{ts}")

    async with operator(Fn(), timer_backend(), timestamp_selector=None) as op:
        for value in ("1", "3", "6", "9"):
            await op.process((1, value))
        await op.advance_watermark(10)
        assert op.outputs() == ["EventTimer-1-1", "EventTimer-1-3", "EventTimer-1-6",
                                "EventTimer-1-9"]
        assert op.current_watermark() == 10


async def test_timers_fire_in_order_with_the_key_s_records_around_a_watermark(timer_backend):
    async with operator(EventTimers(), timer_backend()) as op:
        await op.process(("k", 1, [5, 20]))
        advance = asyncio.create_task(op.advance_watermark(10))
        await asyncio.sleep(0)  # the advance is queued: records after it wait for its timers
        await op.process(("k", 11, []))
        await op.process(("j", 12, [12]))
        await asyncio.wait_for(advance, 30)
        await op.advance_watermark(30)
        assert op.outputs() == [("record", "k", 1), ("timer", "k", 5), ("record", "k", 11),
                                ("record", "j", 12), ("timer", "j", 12), ("timer", "k", 20)]


async def test_one_key_s_timers_run_one_after_another_while_keys_overlap(timer_backend):
    gate = asyncio.Event()
    events: list[str] = []

    class Fn(ast.KeyedProcessFunction):
        def process_element(self, record: Any, ctx: ast.RecordContext) -> None:
            for ts in record[2]:
                ctx.timer_service.register_event_time_timer(ts)

        async def on_timer(self, ts: int, ctx: ast.RecordContext) -> None:
            events.append(f"start {ctx.current_key}{ts}")
            if ts == 3:
                await gate.wait()
            events.append(f"end {ctx.current_key}{ts}")
            if ts == 4:
                gate.set()  # key j's timer ran while key k's first timer was still waiting

    async with operator(Fn(), timer_backend()) as op:
        await op.process(("k", 0, [3, 5]))
        await op.process(("j", 0, [4]))
        await asyncio.wait_for(op.advance_watermark(10), 30)
    assert events.index("end k3") < events.index("start k5")
    assert events.index("start j4") < events.index("end k3")


async def test_on_timer_deletes_and_registers_timers_of_its_key(timer_backend):
    class Fn(EventTimers):
        async def on_timer(self, ts: int, ctx: ast.RecordContext) -> None:
            if ts == 5:
                ctx.timer_service.delete_event_time_timer(7)  # pending: never fires
                ctx.timer_service.delete_event_time_timer(8)  # never registered: a no-op
                ctx.timer_service.register_event_time_timer(6)  # covered: fires in this advance
                ctx.timer_service.register_event_time_timer(15)  # fires at the next advance
            await super().on_timer(ts, ctx)

    async with operator(Fn(), timer_backend()) as op:
        await op.process(("k", 0, [5, 7, 7]))  # registering 7 twice keeps one
        await op.advance_watermark(10)
        assert op.outputs() == [("record", "k", 0), ("timer", "k", 5), ("timer", "k", 6)]
        await op.advance_watermark(20)
        assert op.outputs() == [("timer", "k", 15)]


@pytest.mark.parametrize("domain", ["event", "processing"])
async def test_a_due_timer_whose_firing_waits_for_its_key_is_still_pending_to_its_key(
        timer_backend, domain: str) -> None:
    # on_timer(5) awaits state first, so the firings of 7 and 9 are taken off the queue and
    # wait for the key meanwhile. To on_timer(5) they are still pending, as in a timer
    # service that takes a timer off only to fire it: registering 7 again keeps one, and
    # deleting 9 means it never fires. Registering 5 again, once its firing began, is a new
    # timer, for a time the advance covers: it fires within the advance, which waits for it.
    class Fn(EventTimers):
        def process_element(self, record: Any, ctx: ast.RecordContext) -> None:
            service = ctx.timer_service
            register = service.register_event_time_timer if domain == "event" \
                else service.register_processing_time_timer
            for ts in (5, 7, 9):
                register(ts)

        async def on_timer(self, ts: int, ctx: ast.RecordContext) -> None:
            n = await self.fired.value()
            await self.fired.update((n or 0) + 1)
            ctx.emit(("timer", ctx.current_key, ts))
            service = ctx.timer_service
            if ts == 5 and n is None:
                if domain == "event":
                    service.register_event_time_timer(7)
                    service.delete_event_time_timer(9)
                    service.register_event_time_timer(5)
                else:
                    service.register_processing_time_timer(7)
                    service.delete_processing_time_timer(9)
                    service.register_processing_time_timer(5)

    clock = ast.ManualClock(0)
    async with operator(Fn(), timer_backend(), clock=clock) as op:
        await op.process(("k", 0))
        if domain == "event":
            await op.advance_watermark(10)
        else:
            await op.advance_processing_time(10)
        fired = [ts for kind, _key, ts in op.outputs() if kind == "timer"]
        assert fired[0] == 5 and sorted(fired) == [5, 5, 7]
        await op.advance_watermark(20)
        await op.advance_processing_time(20)
        assert op.outputs() == []  # nothing else was pending: 9 is gone


async def test_a_record_s_timer_behind_the_watermark_fires_at_the_next_advance(timer_backend):
    async with operator(EventTimers(), timer_backend()) as op:
        await op.advance_watermark(100)
        await op.process(("k", 1, [50]))
        await op.drain()
        assert op.outputs() == [("record", "k", 1)]
        await op.advance_watermark(90)  # behind the watermark: it does not move, timers fire
        assert op.outputs() == [("timer", "k", 50)]
        assert op.current_watermark() == 100


async def test_equal_timestamps_of_many_keys_all_fire_in_one_order_on_every_backend(
        timer_backend):
    class Fn(ast.KeyedProcessFunction):
        def process_element(self, record: Any, ctx: ast.RecordContext) -> None:
            ctx.timer_service.register_event_time_timer(7)

        def on_timer(self, ts: int, ctx: ast.RecordContext) -> None:
            ctx.emit(ctx.current_key)

    keys = ["b", 3, "a", b"x", 1.5, ("t", 1), None]
    async with operator(Fn(), timer_backend(), timestamp_selector=None) as op:
        for k in keys:
            await op.process((k,))
        await op.advance_watermark(7)
        fired = op.outputs()
    assert fired == sorted(keys, key=canonical_key)


async def test_processing_time_timers_fire_on_advance_with_a_manual_clock(timer_backend):
    class Fn(ast.KeyedProcessFunction):
        def process_element(self, record: Any, ctx: ast.RecordContext) -> None:
            service = ctx.timer_service
            assert service.current_processing_time() == 1_000
            service.register_processing_time_timer(record[1], namespace=record[2])

        def on_timer(self, ts: int, ctx: ast.RecordContext) -> None:
            assert ctx.time_domain is ast.TimeDomain.PROCESSING_TIME
            ctx.emit((ctx.current_key, ts, ctx.timer_namespace))

    clock = ast.ManualClock(1_000)
    async with operator(Fn(), timer_backend(), clock=clock, timestamp_selector=None) as op:
        await op.process(("a", 1_500, None))
        await op.process(("b", 1_200, "w"))
        await op.process(("a", 1_500, "w"))
        await op.advance_processing_time(1_100)
        assert op.outputs() == []
        await op.advance_processing_time(1_500)
        # Equal timestamps of one key fire in the order of their namespaces' canonical bytes.
        assert op.outputs() == [("b", 1_200, "w"), ("a", 1_500, "w"), ("a", 1_500, None)]


@pytest.mark.timeout(60)
async def test_processing_time_timers_fire_from_the_wall_clock(timer_backend):
    fired = asyncio.Event()

    class Fn(ast.KeyedProcessFunction):
        def process_element(self, record: Any, ctx: ast.RecordContext) -> None:
            service = ctx.timer_service
            self.near = service.current_processing_time() + 30
            service.register_processing_time_timer(self.near)
            service.register_processing_time_timer(self.near + 10**9)

        def on_timer(self, ts: int, ctx: ast.RecordContext) -> None:
            ctx.emit((ctx.current_key, ts))
            fired.set()

    fn = Fn()
    async with operator(fn, timer_backend(), timestamp_selector=None) as op:
        await op.process(("k",))
        await asyncio.wait_for(fired.wait(), 30)
        assert op.outputs() == [("k", fn.near)]  # the far one is still pending


@pytest.mark.timeout(60)
async def test_a_wall_clock_timer_due_while_its_key_is_busy_waits_for_the_record(timer_backend):
    gate = asyncio.Event()
    events: list[str] = []

    class Fn(ast.KeyedProcessFunction):
        async def process_element(self, record: Any, ctx: ast.RecordContext) -> None:
            events.append("record start")
            service = ctx.timer_service
            service.register_processing_time_timer(service.current_processing_time())
            await gate.wait()  # the timer comes due while this record holds the key
            events.append("record end")

        def on_timer(self, ts: int, ctx: ast.RecordContext) -> None:
            events.append("timer")

    async with operator(Fn(), timer_backend(), timestamp_selector=None) as op:
        await op.process(("k",))
        controller = op.controller
        for _ in range(10_000):  # until the due timer waits for its key
            if controller.blocking_key_num == 1:
                break
            await asyncio.sleep(0.001)
        else:
            raise AssertionError("the due timer never asked for its key")
        assert events == ["record start"]
        gate.set()
        await asyncio.wait_for(op.drain(), 30)
    assert events == ["record start", "record end", "timer"]


@pytest.mark.parametrize("method", ["register_event_time_timer",
                                    "register_processing_time_timer",
                                    "delete_event_time_timer", "delete_processing_time_timer"])
@pytest.mark.parametrize("bad", [True, "5", 1.5])
def test_a_timer_timestamp_of_another_type_is_refused_naming_it(method: str, bad: Any) -> None:
    class Registers(ast.KeyedProcessFunction):
        def process_element(self, value: Any, ctx: Any) -> None:
            getattr(ctx.timer_service, method)(bad)

        def on_timer(self, timestamp: int, ctx: Any) -> None:
            ctx.emit(("fired", timestamp))  # pragma: no cover - never registered

    with pytest.raises(TypeError, match=rf"^timer timestamp must be an int \(milliseconds\), "
                                        rf"got {type(bad).__name__} {re.escape(repr(bad))}$"):
        ast.run(Registers(), [1], key_selector=lambda v: v)


def test_run_fires_every_event_time_timer_and_not_the_pending_processing_time_ones() -> None:
    class Fn(EventTimers):
        def process_element(self, record: Any, ctx: ast.RecordContext) -> None:
            ctx.timer_service.register_processing_time_timer(10**15)
            super().process_element(record, ctx)

    out = ast.run(Fn(), [("a", 1, [2**63 - 1, 5]), ("b", 2, [3])], key_selector=key,
                  timestamp_selector=timestamp)
    assert out == [("record", "a", 1), ("record", "b", 2), ("timer", "b", 3),
                   ("timer", "a", 5), ("timer", "a", 2**63 - 1)]


def test_processing_time_timers_pending_at_the_end_of_run_fire_after_a_restore(
        tmp_path: Any) -> None:
    class Later(ast.KeyedProcessFunction):
        def process_element(self, record: Any, ctx: ast.RecordContext) -> None:
            ctx.timer_service.register_processing_time_timer(record[1])

        def on_timer(self, timestamp: int, ctx: Any) -> None:
            ctx.emit(("fired", ctx.current_key, timestamp, ctx.time_domain.name))

    # The first run's clock never reaches the timers: none fires, the checkpoint keeps them.
    assert ast.run(Later(), [("a", 5), ("b", 7), ("c", 9)], key_selector=key,
                   clock=ast.ManualClock(0), parallelism=2, checkpoint_dir=tmp_path,
                   checkpoint_id=1) == []
    # Restored at another parallelism on the wall clock, far past them: each fires once.
    out = ast.run(Later(), [], key_selector=key, parallelism=3,
                  restore_from=ast.checkpoint_path(tmp_path, 1))
    assert sorted(out) == [("fired", "a", 5, "PROCESSING_TIME"),
                           ("fired", "b", 7, "PROCESSING_TIME"),
                           ("fired", "c", 9, "PROCESSING_TIME")]


async def test_timer_service_outside_its_record_and_without_on_timer_raise(timer_backend):
    kept: list[Any] = []

    class NoOnTimer(ast.KeyedProcessFunction):
        def process_element(self, record: Any, ctx: ast.RecordContext) -> None:
            kept.append(ctx)
            assert ctx.timer_service.current_watermark() == -(2**63)
            with pytest.raises(ast.InvalidStateError,
                               match=r"^NoOnTimer registers a timer but has no on_timer"):
                ctx.timer_service.register_event_time_timer(5)

    async with operator(NoOnTimer(), timer_backend(), timestamp_selector=None) as op:
        await op.process(("k",))
        await op.drain()
        with pytest.raises(ast.InvalidStateError, match="after that record finished"):
            kept[0].timer_service  # noqa: B018


async def test_a_failing_on_timer_fails_the_run(timer_backend):
    class Fn(EventTimers):
        def on_timer(self, ts: int, ctx: ast.RecordContext) -> None:
            raise ValueError(f"timer {ts}")

    with pytest.raises(ValueError, match=r"^timer 5$"):
        async with operator(Fn(), timer_backend()) as op:
            await op.process(("k", 0, [5]))
            await op.advance_watermark(10)


@pytest.mark.parametrize(("first", "second"), [("heap", "rocksdb"), ("rocksdb", "heap"),
                                                ("rocksdb", "rocksdb-heap-timers")])
async def test_pending_timers_survive_a_rescale_from_2_to_3(tmp_path: Path, first: str,
                                                           second: str) -> None:
    records = [(f"k{i}", i, [100 + i, 200 + i]) for i in range(40)]
    max_p = 128
    for index in range(2):
        async with operator(EventTimers(), BACKENDS[first](tmp_path / f"a{index}"),
                            parallelism=2, operator_index=index) as op:
            for record in records:
                if ast.operator_index_for_key(record[0], max_p, 2) == index:
                    await op.process(record)
            await op.advance_watermark(150)  # the 100s fire, the 200s stay pending
            await op.snapshot(tmp_path / "chk", 1)
    fired: dict[str, list[int]] = {}
    for index in range(3):
        async with operator(EventTimers(), BACKENDS[second](tmp_path / f"b{index}"),
                            parallelism=3, operator_index=index,
                            restore_from=ast.checkpoint_path(tmp_path / "chk", 1)) as op:
            await op.advance_watermark(1_000)
            for _, k, ts in op.outputs():
                assert ast.operator_index_for_key(k, max_p, 3) == index
                fired.setdefault(k, []).append(ts)
    assert fired == {f"k{i}": [200 + i] for i in range(40)}


# -- a sequential model ----------------------------------------------------------------------

KEYS = ["a", "b", "c"]
steps = st.lists(st.one_of(
    st.tuples(st.just("record"), st.sampled_from(KEYS),
              st.lists(st.tuples(st.sampled_from(["add", "delete"]), st.integers(0, 12)),
                       max_size=3)),
    st.tuples(st.just("watermark"), st.integers(0, 14)),
), max_size=14)


class Scripted(ast.KeyedProcessFunction):
    """A record ("record", key, [(op, ts)]) emits ("record", key) and adds/deletes event
    timers; on_timer emits the firing and, for an odd timestamp, registers ts + 1 (fired in
    the same advance when the watermark covers it). Call number `fail_at` of either does
    that and then raises `failure`."""

    def __init__(self, fail_at: int | None) -> None:
        self.fail_at = fail_at
        self.calls = 0
        self.failure = Boom(f"call {fail_at} fails")

    def _called(self) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise self.failure

    def process_element(self, record: Any, ctx: ast.RecordContext) -> None:
        ctx.emit(("record", ctx.current_key))
        service = ctx.timer_service
        for op, ts in record[2]:
            if op == "add":
                service.register_event_time_timer(ts)
            else:
                service.delete_event_time_timer(ts)
        self._called()

    def on_timer(self, ts: int, ctx: ast.RecordContext) -> None:
        ctx.emit((ctx.current_key, ts))
        if ts % 2:
            ctx.timer_service.register_event_time_timer(ts + 1)
        self._called()


def model(script: list[Any], fail_at: int | None) -> tuple[list[Any], bool]:
    """What Scripted(fail_at) emits, in order, with ("advanced", ts) once each advance has
    returned; and whether the run fails. Call number `fail_at` fails the run once it has
    emitted, and nothing starts after it: no record, no timer, not even those it registered
    (docs/api.md: a failed run never starts a record still waiting, and every later call
    raises the failure)."""
    timers: set[tuple[str, int]] = set()
    watermark = -(2**63)
    emitted: list[Any] = []
    calls = 0
    for step in script:
        if step[0] == "record":
            emitted.append(("record", step[1]))
            calls += 1
            if calls == fail_at:
                return emitted, True
            for op, ts in step[2]:
                (timers.add if op == "add" else timers.discard)((step[1], ts))
            continue
        watermark = max(watermark, step[1])
        while True:
            due = sorted((ts, canonical_key(k), k) for k, ts in timers if ts <= watermark)
            if not due:
                break
            ts, _, k = due[0]
            timers.discard((k, ts))
            emitted.append((k, ts))
            calls += 1
            if calls == fail_at:
                return emitted, True
            if ts % 2:
                timers.add((k, ts + 1))
        emitted.append(("advanced", step[1]))
    return emitted, False


def _firing_follows(events: list[Any], i: int) -> bool:
    """Whether a timer fires after events[i] before the advance returns."""
    for event in events[i + 1:]:
        if event[0] == "advanced":
            return False
        if event[0] != "record":
            return True
    return False


@settings(max_examples=slow_examples(25))
@given(steps, st.sampled_from(sorted(BACKENDS)), st.sampled_from(LOOP_NAMES), st.data())
def test_random_registers_deletes_records_watermarks_and_failures_match_the_model(
        tmp_path_factory: pytest.TempPathFactory, script: list[Any], backend: str,
        loop: str, data: st.DataObject) -> None:
    # Most examples fail, at one of the calls the script makes (records' process_element and
    # on_timer together, counted from 1 in the order the model runs them); often at a call
    # with a firing due after it in the same advance, which must then never start.
    events = model(script, None)[0]
    calls = [i for i, event in enumerate(events) if event[0] != "advanced"]
    firing_after = [n for n, i in enumerate(calls, 1) if _firing_follows(events, i)]
    fail_at = data.draw(st.one_of(st.none(), *(st.sampled_from(c) for c in
                                               (range(1, len(calls) + 1), firing_after) if c)),
                        label="fail_at")
    path = tmp_path_factory.mktemp("timers")
    fn = Scripted(fail_at)
    emitted: list[Any] = []

    async def main() -> None:
        op = operator(fn, BACKENDS[backend](path / "db"), key_selector=lambda r: r[1],
                      timestamp_selector=None)
        try:
            async with op:
                for step in script:
                    if step[0] == "record":
                        await op.process(step)  # queued: records start from the loop
                    else:
                        await op.advance_watermark(step[1])
                        emitted.extend(op.outputs())
                        emitted.append(("advanced", step[1]))
        finally:
            emitted.extend(op.outputs())  # also what a failed run emitted before failing

    # A plain on_timer runs as soon as its firing starts (its key is free: records and
    # firings hold a key only while they run), so every backend fires in the model's order,
    # a synchronous timer service's: timestamp, then key bytes, covered timers included.
    want, fails = model(script, fail_at)
    if fails:
        with pytest.raises(Boom) as raised:
            run_on_loop(loop, main())  # on the loop the example drew
        assert raised.value is fn.failure  # the call's own exception, not another
    else:
        run_on_loop(loop, main())
    assert emitted == want


def test_timers_work_where_rocksdict_is_not_installed() -> None:
    # rocksdict is an optional dependency: the timer service must not need it on the heap.
    code = textwrap.dedent("""
        import sys
        sys.modules["rocksdict"] = None  # an import of it now fails, as when not installed
        import asyncstate as ast

        class Fn(ast.KeyedProcessFunction):
            def process_element(self, record, ctx):
                ctx.timer_service.register_event_time_timer(record)

            def on_timer(self, ts, ctx):
                ctx.emit(ts)

        print(ast.run(Fn(), [3, 1, 2], key_selector=lambda r: r))
    """)
    done = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[1, 2, 3]\n"


class _TupleKeyTimers(ast.KeyedProcessFunction):
    """Registers timers 0 .. n-1 in namespace ("w", 1); each firing emits the key and
    namespace it sees."""

    def process_element(self, record: Any, ctx: ast.RecordContext) -> None:
        for ts in range(record[1]):
            ctx.timer_service.register_event_time_timer(ts, ("w", 1))

    def on_timer(self, ts: int, ctx: ast.RecordContext) -> None:
        ctx.emit((ts, ctx.current_key, ctx.timer_namespace))


async def test_a_tuple_key_and_namespace_reach_on_timer_as_tuples(timer_backend,
                                                                  tmp_path: Path) -> None:
    # 300 timers of one key: on RocksDB the key group's timer cache refills from the
    # database; and a checkpoint restores the rest.
    fn_key = ("user", 7)
    async with operator(_TupleKeyTimers(), timer_backend(), timestamp_selector=None) as op:
        await op.process((fn_key, 300))
        await op.advance_watermark(149)
        path = await op.snapshot(tmp_path / "chk", 1)
        fired = op.outputs()
    async with operator(_TupleKeyTimers(), timer_backend(), timestamp_selector=None,
                        restore_from=path) as op:
        await op.advance_watermark(10**6)
        fired += op.outputs()
    assert [ts for ts, _k, _ns in fired] == list(range(300))
    assert all(type(k) is tuple and k == fn_key for _ts, k, _ns in fired)
    assert all(type(ns) is tuple and ns == ("w", 1) for _ts, _k, ns in fired)
    assert len({k for _ts, k, _ns in fired}) == 1  # usable as a dict key
