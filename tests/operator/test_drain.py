"""`KeyedOperator.drain`: it waits for every record, sends partial batches at once, can be
cancelled or called concurrently, and is refused (like every call that waits for records)
from inside a record."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from operator_helpers import (
    RecordStep,
    assert_waits_for_records,
    run_script,
)
from shared_functions import (
    Counter,
    cfg,
    first,
    let_loop_run,
    op_of,
    with_tag,
)

import asyncstate as ast


@pytest.mark.timeout(30)
@pytest.mark.backends("heap", "remote0", "remote1", "rocksdb")
async def test_cancelling_drain_leaves_the_operator_usable(make_backend: Any) -> None:
    gate = asyncio.Event()

    async def slow(fn: Any, rec: Any, ctx: Any) -> None:
        await fn.v.value()
        await gate.wait()
        ctx.emit(rec[0])

    async with op_of(RecordStep(), make_backend()) as op:
        await op.process(("a", slow))
        d = asyncio.ensure_future(op.drain())
        await let_loop_run()  # the drain waits for record "a"
        assert not d.done()
        d.cancel()
        with pytest.raises(asyncio.CancelledError):
            await d
        gate.set()
        await op.drain()
        assert op.outputs() == ["a"]


@pytest.mark.timeout(30)
@pytest.mark.backends("heap", "remote0", "remote1", "rocksdb")
async def test_concurrent_drains_all_return(make_backend: Any) -> None:
    async with op_of(Counter(output=with_tag), make_backend()) as op:
        for i in range(30):
            await op.process((i % 4, i))
        await asyncio.wait_for(asyncio.gather(op.drain(), op.drain(), op.drain(),
                                              op.advance_watermark(3)), 10)
        assert len(op.outputs()) == 30


@pytest.mark.timeout(30)
async def test_drain_inside_process_element_raises_instead_of_hanging() -> None:
    class DrainsItself(ast.KeyedProcessFunction):
        def open(self, ctx: Any) -> None:
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

        async def process_element(self, value: Any, ctx: Any) -> None:
            await self.v.value()
            try:
                await asyncio.wait_for(op.drain(), 0.5)
                ctx.emit("drained")
            except ast.InvalidStateError:
                ctx.emit("refused")
            except TimeoutError:
                ctx.emit("hung")

    op = op_of(DrainsItself(), ast.HeapBackend())
    async with op:
        await op.process(("a",))
        await asyncio.wait_for(op.drain(), 5)
        assert op.outputs() == ["refused"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("call", ["drain", "advance_watermark", "advance_processing_time",
                                  "snapshot"])
async def test_calls_that_wait_for_records_are_refused_inside_a_record(
        call: str, tmp_path: Any) -> None:
    class CallsIn(ast.KeyedProcessFunction):
        async def process_element(self, value: Any, ctx: Any) -> None:
            args = {"drain": (), "advance_watermark": (5,), "advance_processing_time": (5,),
                    "snapshot": (str(tmp_path), 1)}[call]
            with pytest.raises(ast.InvalidStateError,
                               match=rf"^{call}\(\) called from inside a record of this "
                                     r"operator \(key 'a'\): it waits for every earlier "
                                     r"record to finish"):
                await getattr(op, call)(*args)
            ctx.emit("refused")

    op = ast.KeyedOperator(CallsIn(), key_selector=first, backend=ast.HeapBackend(), config=cfg(),
                           clock=ast.ManualClock())
    async with op:
        await op.process(("a",))
        await asyncio.wait_for(op.drain(), 5)  # from outside: fine
        assert op.outputs() == ["refused"]
        outside = {"drain": (), "advance_watermark": (7,), "advance_processing_time": (7,),
                   "snapshot": (str(tmp_path), 2)}[call]
        await asyncio.wait_for(getattr(op, call)(*outside), 5)  # the same call from outside


class _SleepsThenReads(ast.KeyedProcessFunction):
    def open(self, ctx: ast.RuntimeContext) -> None:
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

    async def process_element(self, value: object, ctx: ast.RecordContext) -> None:
        await asyncio.sleep(0)  # moves the record into a Task
        await self.v.update(value)
        ctx.emit(await self.v.value())


@pytest.mark.timeout(10)
@pytest.mark.parametrize("timeout_ms", [0, 3_600_000])
async def test_drain_sends_requests_issued_inside_a_task_at_once(timeout_ms: int) -> None:
    backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=1)
    config = ast.AsyncStateConfig(buffer_timeout_ms=timeout_ms)
    async with ast.KeyedOperator(_SleepsThenReads(), key_selector=lambda r: r,
                                 backend=backend, config=config) as op:
        for r in (1, 2, 3):
            await op.process(r)
        # Without the flush the drain waits for the buffer timeout (an hour) or forever (0).
        await asyncio.wait_for(op.drain(), 5)
        assert sorted(op.outputs()) == [1, 2, 3]


@pytest.mark.timeout(10)
async def test_drain_waits_for_every_record(make_backend):
    await assert_waits_for_records(make_backend, lambda op: op.drain())


_AFTER_SLEEP = """
    import asyncio
    import asyncstate as ast

    class AfterSleep(ast.KeyedProcessFunction):
        # Awaits a non-state awaitable first: its state requests are issued from a Task.
        def open(self, ctx):
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

        async def process_element(self, value, ctx):
            await asyncio.sleep(0)
            ctx.emit((value, await self.v.value()))

    def backend():
        return ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0)

    config = ast.AsyncStateConfig(buffer_timeout_ms=BUFFER_TIMEOUT_MS)
"""

# No buffer timeout, or one of an hour: waiting for it fails as a hang (_run_script).
_NO_OR_LONG_BUFFER_TIMEOUT = pytest.mark.parametrize("buffer_timeout_ms", [0, 3_600_000])


@_NO_OR_LONG_BUFFER_TIMEOUT
def test_drain_sends_partial_batches_at_once(buffer_timeout_ms):
    """drain() sends partial batches at once: requests issued while it waits (here from a
    record's Task) must not wait for the buffer timeout, nor hang when there is none (0)."""
    out = run_script(_AFTER_SLEEP.replace("BUFFER_TIMEOUT_MS", str(buffer_timeout_ms)) + """
    async def main():
        async with ast.KeyedOperator(AfterSleep(), key_selector=lambda r: r, backend=backend(),
                                     config=config) as op:
            for k in ["a", "b"]:
                await op.process(k)
            await op.drain()
            print(sorted(op.outputs()))

    asyncio.run(main())
    """)
    assert out.strip() == "[('a', None), ('b', None)]"


@_NO_OR_LONG_BUFFER_TIMEOUT
def test_run_does_not_wait_for_the_buffer_timeout(buffer_timeout_ms):
    out = run_script(_AFTER_SLEEP.replace("BUFFER_TIMEOUT_MS", str(buffer_timeout_ms)) + """
    out = ast.run(AfterSleep(), ["a", "b"], key_selector=lambda r: r, backend=backend(),
                  config=config)
    print(sorted(out))
    """)
    assert out.strip() == "[('a', None), ('b', None)]"
