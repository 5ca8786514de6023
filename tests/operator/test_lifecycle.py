"""The KeyedOperator's lifecycle: its arguments, `async with` (entry, a clean exit that
drains, an exit by exception or cancellation that does not), and calls at the wrong moment."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from operator_helpers import (
    RecordStep,
    run_script,
)
from shared_functions import (
    Boom,
    Counter,
    Reached,
    Step,
    keyed_operator,
    let_loop_run,
    new_backend,
    op_of,
    with_tag,
)

import asyncstate as ast


@pytest.mark.timeout(30)
@pytest.mark.backends("heap", "remote0", "remote1", "rocksdb")
async def test_process_after_exit_raises_invalid_state(make_backend: Any) -> None:
    op = op_of(Counter(output=with_tag), make_backend())
    async with op:
        await op.process(("a", 1))
    with pytest.raises(ast.InvalidStateError):
        await op.process(("a", 2))
    with pytest.raises(ast.InvalidStateError):
        await op.drain()
    with pytest.raises(ast.InvalidStateError):
        async with op:
            pass


@pytest.mark.timeout(30)
async def test_open_failure_reraises_and_closes_the_backend() -> None:
    err = Boom("open")
    closed = []

    class BadOpen(ast.KeyedProcessFunction):
        def open(self, ctx: Any) -> None:
            raise err

        def process_element(self, value: Any, ctx: Any) -> None:
            pass

        def close(self) -> None:
            closed.append("fn")

    backend = new_backend("remote1")
    op = op_of(BadOpen(), backend)
    with pytest.raises(Boom) as info:
        async with op:
            pytest.fail("body ran")
    assert info.value is err
    assert backend._closed


@pytest.mark.timeout(30)
async def test_exit_by_cancellation_closes_without_draining_and_reraises() -> None:
    gate = asyncio.Event()
    backend = new_backend("remote1")

    reached = Reached()

    async def slow(fn: Any, rec: Any, ctx: Any) -> None:
        reached.mark()  # started: its read waits for a batch no timeout sends
        await fn.v.value()
        await gate.wait()

    op = op_of(RecordStep(), backend)

    async def body() -> None:
        async with op:
            await op.process(("a", slow))
            await asyncio.Event().wait()  # until cancelled

    task = asyncio.ensure_future(body())
    await reached.at_least(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert backend._closed


class Logged(ast.KeyedProcessFunction):
    """record = (key, tag, gate or None, error or None)."""

    def __init__(self) -> None:
        self.log: list[Any] = []
        self.started = Reached()
        self.ended = Reached()

    def open(self, ctx: Any) -> None:
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

    async def process_element(self, rec: Any, ctx: Any) -> None:
        key, tag, gate, err = rec
        self.log.append(("start", key, tag))
        self.started.mark()
        try:
            await self.v.value()
            if gate is not None:
                await gate.wait()
            if err is not None:
                raise err
            ctx.emit(tag)
        finally:
            self.log.append(("end", key, tag))
            self.ended.mark()


def _starts(log: list[Any]) -> list[Any]:
    return [e[1:] for e in log if e[0] == "start"]


def _check_same_key_never_overlaps(log: list[Any]) -> None:
    running: dict[Any, Any] = {}
    for what, key, tag in log:
        if what == "start":
            assert key not in running, f"{tag} of key {key!r} started while {running[key]} ran"
            running[key] = tag
        else:
            running.pop(key, None)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("backend", ["heap", "remote1"])
async def test_exit_by_exception_does_not_start_records_waiting_for_their_key(
        backend: str) -> None:
    fn = Logged()
    gate = asyncio.Event()
    op = op_of(fn, new_backend(backend))
    with pytest.raises(KeyError):
        async with op:
            await op.process(("a", 1, gate, None))
            await op.process(("a", 2, None, None))
            await fn.started.at_least(1)  # record 1 holds the key, record 2 waits for it
            raise KeyError("body")
    await let_loop_run()  # a record started by the close would start now
    assert _starts(fn.log) == [("a", 1)]
    _check_same_key_never_overlaps(fn.log)


@pytest.mark.timeout(30)
async def test_exit_after_a_failure_does_not_start_records_waiting_for_their_key() -> None:
    fn = Logged()
    gate = asyncio.Event()
    err = Boom("b failed")
    op = op_of(fn, ast.HeapBackend())
    with pytest.raises(Boom) as info:
        async with op:
            await op.process(("a", 1, gate, None))
            await op.process(("a", 2, None, None))
            await op.process(("b", 3, None, err))
            await fn.ended.at_least(1)  # record 3 failed the run
    assert info.value is err
    await let_loop_run()
    _check_same_key_never_overlaps(fn.log)
    assert ("a", 2) not in _starts(fn.log)


async def test_process_outside_async_with_raises_invalid_state():
    op = keyed_operator(Counter(), ast.HeapBackend())
    with pytest.raises(ast.InvalidStateError):
        await op.process(("a", 1))
    async with op as entered:
        assert entered is op
        await op.process(("a", 1))
        await op.drain()
        assert op.outputs() == [("a", 1)]
    with pytest.raises(ast.InvalidStateError):
        await op.process(("a", 2))
    with pytest.raises(ast.InvalidStateError):
        await op.drain()


async def test_second_aenter_fails():
    op = keyed_operator(Counter(), ast.HeapBackend())
    async with op:
        with pytest.raises(ast.InvalidStateError):
            await op.__aenter__()
        await op.process(("a", 1))
    with pytest.raises(ast.InvalidStateError):
        async with op:
            pass


async def test_clean_exit_drains(make_backend):
    gate = asyncio.Event()
    seen = []

    async def wait(fn, ctx):
        await fn.v.value()
        await gate.wait()
        await fn.v.update(1)
        seen.append(ctx.current_key)

    asyncio.get_running_loop().call_later(0.05, gate.set)
    async with keyed_operator(Step(), make_backend()) as op:
        for k in range(5):
            await op.process((k, wait))
    assert sorted(seen) == list(range(5))


@pytest.mark.timeout(10)
async def test_exception_in_block_closes_without_draining_and_reraises(make_backend):
    never = asyncio.Event()
    reached = Reached()

    async def stuck(fn, ctx):
        await fn.v.value()
        reached.mark()
        await never.wait()

    with pytest.raises(KeyError, match="from the block"):  # not TimeoutError: no drain
        async with asyncio.timeout(5), keyed_operator(Step(), make_backend()) as op:
            await op.process(("a", stuck))
            await reached.at_least(1)
            raise KeyError("from the block")


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_exit_on_exception_with_a_record_awaiting_state_in_a_task_does_not_hang(loop):
    """`async with` closes without draining on an exception; a record whose Task awaits a state
    future must not keep the event loop from shutting down afterwards."""
    out = run_script(f"""
    import asyncio
    import uvloop
    import asyncstate as ast

    class Fn(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

        async def process_element(self, value, ctx):
            await asyncio.sleep(0)  # moves the record into a Task
            awaiting.set()
            await self.v.value()

    async def main():
        global awaiting
        awaiting = asyncio.Event()
        backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=50)
        try:
            async with ast.KeyedOperator(Fn(), key_selector=lambda r: r,
                                         backend=backend) as op:
                await op.process("a")
                await awaiting.wait()
                raise KeyError("the block failed")
        except KeyError:
            print("closed")

    {"uvloop.run" if loop == "uvloop" else "asyncio.run"}(main())
    print("loop shut down")
    """)
    assert out.split() == ["closed", "loop", "shut", "down"]


class SlowOpen(ast.KeyedProcessFunction):
    def __init__(self, gate: asyncio.Event) -> None:
        self.gate = gate

    async def open(self, ctx: ast.RuntimeContext) -> None:
        await self.gate.wait()
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    async def process_element(self, value: Any, ctx: Any) -> None:
        await self.count.update((await self.count.value() or 0) + 1)
        ctx.emit(await self.count.value())


async def test_calls_from_other_tasks_while_open_runs_are_refused(tmp_path: Any) -> None:
    gate = asyncio.Event()
    op = ast.KeyedOperator(SlowOpen(gate), key_selector=lambda r: r, backend=ast.HeapBackend())
    entering = asyncio.create_task(op.__aenter__())
    await asyncio.sleep(0)  # the operator is now awaiting open()
    for call in (lambda: op.process(1), lambda: op.snapshot(tmp_path, 1), op.drain):
        with pytest.raises(ast.InvalidStateError, match=r"is still opening"):
            await call()
    gate.set()
    assert await entering is op
    await op.process(1)
    await op.__aexit__(None, None, None)
    assert op.outputs() == [1]
    assert not (tmp_path / "chk-1").exists()


class _Noop(ast.KeyedProcessFunction):
    def process_element(self, value: Any, ctx: ast.RecordContext) -> None:
        return None


def _operator(**overrides: Any) -> ast.KeyedOperator:
    arguments: dict[str, Any] = {"key_selector": lambda r: r, "backend": ast.HeapBackend()}
    arguments.update(overrides)
    function = arguments.pop("function", _Noop())
    return ast.KeyedOperator(function, **arguments)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"function": object()},
     r"^function must be a KeyedProcessFunction with process_element\(\), got object$"),
    ({"key_selector": 5}, r"^key_selector must be callable, got int$"),
    ({"timestamp_selector": 3}, r"^timestamp_selector must be callable or None, got int$"),
    ({"backend": object()}, r"^backend must be a state backend \(HeapBackend, RocksDBBackend, "
                            r"\.\.\.\), got object without open\(\), execute_batch\(\), "
                            r"register_state\(\), fully_loaded\(\), close\(\)$"),
    ({"backend": ast.HeapBackend}, r"^backend must be a state backend instance, got the class "
                                   r"HeapBackend \(call it: HeapBackend\(\.\.\.\)\)$"),
    ({"config": {}}, r"^config must be an AsyncStateConfig, got dict$"),
    ({"clock": 5}, r"^clock must be a Clock with now_ms\(\) \(SystemClock, ManualClock\) or "
                   r"None, got int$"),
    ({"restore_from": 5}, r"^restore_from must be a checkpoint path \(str or os\.PathLike\) "
                          r"or None, got int$"),
], ids=["function", "key_selector", "timestamp_selector", "backend", "backend-class", "config",
        "clock", "restore_from"])
def test_keyed_operator_names_a_bad_argument(overrides, message):
    with pytest.raises(TypeError, match=message):
        _operator(**overrides)


async def test_restore_from_accepts_a_path_object(tmp_path):
    class Count(ast.KeyedProcessFunction):
        def open(self, ctx: ast.RuntimeContext) -> None:
            self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

        async def process_element(self, value: Any, ctx: ast.RecordContext) -> None:
            n = (await self.count.value() or 0) + 1
            self.count.update(n)
            ctx.emit((value, n))

    async with _operator(function=Count()) as op:
        for record in (1, 2, 1):
            await op.process(record)
        checkpoint = await op.snapshot(tmp_path, 1)
    restored = _operator(function=Count(), restore_from=Path(checkpoint))
    assert restored.restore_from == checkpoint
    async with restored:
        for record in (1, 2, 3):
            await restored.process(record)
        await restored.drain()
        assert restored.outputs() == [(1, 3), (2, 2), (3, 1)]


class _StopsAt(ast.KeyedProcessFunction):
    """Counts per key; record 50 raises `exc` while other keys' records wait on state."""

    def __init__(self, exc: type[BaseException]) -> None:
        self.exc = exc
        self.closed = False
        self.started = self.unwound = 0

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    async def process_element(self, value: int, ctx: Any) -> None:
        if value == 50:
            raise self.exc("stop")
        self.started += 1
        try:
            await self.count.update((await self.count.value() or 0) + 1)
        finally:
            self.unwound += 1

    def close(self) -> None:
        self.closed = True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("cache", [0, 4])
@pytest.mark.parametrize("remote", [False, True])
@pytest.mark.parametrize("keys", [5, 100])
def test_a_keyboard_interrupt_of_user_code_still_closes_everything(
        tmp_path: Path, exc: type[BaseException], cache: int, remote: bool, keys: int) -> None:
    # Failing the futures that records wait on resumes those records; one of them re-raising
    # the interrupt must not cut closing short: every waiting record is failed, and the
    # function's close(), the GC threshold and the database (reopened at once below) are
    # all released. With 5 keys the record raising waits for its key; with 100 it raises
    # at once and the interrupt fails the others.
    import gc

    def backend(path: Path) -> Any:
        if remote:
            return ast.SimulatedRemoteBackend(ast.RocksDBBackend(path), latency_ms=0.3,
                                              cache_entries=cache)
        return ast.RocksDBBackend(path, cache_entries=cache)

    function = _StopsAt(exc)
    threshold = gc.get_threshold()
    with pytest.raises(exc, match="stop"):
        ast.run(function, range(100), key_selector=lambda r: r % keys,
                backend=backend(tmp_path / "db"))
    assert function.closed
    assert function.unwound == function.started  # every waiting record was failed, not left
    assert gc.get_threshold() == threshold
    again = _StopsAt(RuntimeError)
    ast.run(again, [1, 2], key_selector=lambda r: r, backend=ast.RocksDBBackend(tmp_path / "db"))
    assert again.closed


class _Emits(ast.KeyedProcessFunction):
    def open(self, ctx: Any) -> None:
        self.c = ctx.get_state(ast.ValueStateDescriptor("c"))

    async def process_element(self, v: Any, ctx: Any) -> None:
        await self.c.update(v)
        ctx.emit(v)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("latency_ms", [0, 5])
async def test_a_record_offered_while_the_block_exits_is_refused(latency_ms: float) -> None:
    # Another task paces itself on drain() and feeds one more record as the `async with`
    # block exits cleanly: process() raises; the record is never admitted and dropped.
    backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=latency_ms)
    op = ast.KeyedOperator(_Emits(), key_selector=lambda r: r, backend=backend)

    async def late_producer() -> None:
        await op.drain()
        await op.process(99)

    async with op:
        await op.process(1)
        late = asyncio.create_task(late_producer())
        await asyncio.sleep(0)  # it waits in drain() now
    [refused] = await asyncio.gather(late, return_exceptions=True)
    assert isinstance(refused, ast.InvalidStateError) and "is closing" in str(refused)
    assert op.outputs() == [1]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("latency_ms", [0, 2, 5])
async def test_producers_waiting_for_room_as_the_block_exits_are_processed_or_refused(
        latency_ms: float) -> None:
    # max_in_flight 1: two producer tasks wait for room beside the block's own last record.
    # Each record whose process() returned is processed; the others are refused.
    backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=latency_ms)
    op = ast.KeyedOperator(_Emits(), key_selector=lambda r: r, backend=backend,
                           config=ast.AsyncStateConfig(max_in_flight=1))
    admitted: list[int] = []

    async def producer(x: int) -> None:
        await asyncio.sleep(0)
        await op.process(x)
        admitted.append(x)

    async with op:
        await op.process(0)
        tasks = [asyncio.create_task(producer(x)) for x in (10, 11)]
        await op.process(1)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    refused = [r for r in results if r is not None]
    assert all(isinstance(r, ast.InvalidStateError) for r in refused), results
    assert sorted(op.outputs()) == sorted([0, 1, *admitted])
    assert len(admitted) + len(refused) == 2
