"""AsyncStateConfig.record_timeout_ms: a record that runs too long fails the run, naming its key."""

from __future__ import annotations

import asyncio
import pickle
import time
from typing import Any

import pytest

import asyncstate as ast
from asyncstate.runtime.requests import StateKind, StateRequestType
from asyncstate.testing import ManualExecutor

GET = StateRequestType.VALUE_GET


class FakeState:
    """The least a state needs for the controller and executor: a name and a handle."""

    def __init__(self, name: str, handle: Any) -> None:
        self.name = name
        self.handle = handle


class Hangs(ast.KeyedProcessFunction):
    """Records with key "stuck" await a future nobody completes; others count."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

    async def process_element(self, record: Any, ctx: ast.RecordContext) -> None:
        await self.v.update(1)
        if record == "stuck":
            await asyncio.get_running_loop().create_future()
        ctx.emit(record)


def _key(record: Any) -> Any:
    return record


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["heap", "remote0"])
def test_run_fails_with_a_timeout_naming_the_key_of_a_hung_record(backend: str) -> None:
    made = ast.HeapBackend() if backend == "heap" else ast.SimulatedRemoteBackend(
        ast.HeapBackend(), latency_ms=0)
    config = ast.AsyncStateConfig(record_timeout_ms=50)
    with pytest.raises(ast.RecordTimeoutError, match=r"^the record with key 'stuck' has been "
                       r"running for \d+ ms, longer than record_timeout_ms=50") as raised:
        ast.run(Hangs(), ["a", "stuck", "b"], key_selector=_key, backend=made, config=config)
    err = raised.value
    assert isinstance(err, TimeoutError) and isinstance(err, ast.AsyncStateError)
    assert (err.key, err.timeout_ms) == ("stuck", 50)
    assert err.elapsed_ms >= 50
    copy = pickle.loads(pickle.dumps(err))
    assert (type(copy), str(copy), copy.key) == (ast.RecordTimeoutError, str(err), "stuck")


@pytest.mark.timeout(60)
async def test_operator_fails_with_the_timeout_and_later_calls_raise_it() -> None:
    config = ast.AsyncStateConfig(record_timeout_ms=40)
    op = ast.KeyedOperator(Hangs(), key_selector=_key, backend=ast.HeapBackend(), config=config)
    with pytest.raises(ast.RecordTimeoutError) as on_exit:
        async with op:
            await op.process("stuck")
            with pytest.raises(ast.RecordTimeoutError) as on_drain:
                await asyncio.wait_for(op.drain(), 30)
            with pytest.raises(ast.RecordTimeoutError) as on_process:
                await op.process("other")
    assert on_exit.value is on_drain.value is on_process.value
    assert on_exit.value.key == "stuck"


def test_a_record_s_time_starts_when_it_takes_its_key() -> None:
    executor = ManualExecutor()
    aec = ast.AsyncExecutionController(executor, batch_size=10, buffer_timeout_ms=0,
                                       max_in_flight=10, time_records=True)
    state = FakeState("v", executor.register_state("v", StateKind.VALUE))
    before = time.monotonic()
    first = aec.build_context("first", "k")
    second = aec.build_context("second", "k")
    for ctx in (first, second):
        aec.start_record(ctx, lambda c: aec.handle_request(state, GET, None))
    after_start = time.monotonic()
    assert aec.occupied_key_num == 1 and aec.blocking_key_num == 1  # second waits for "k"
    assert aec.overdue_context(before) is None
    assert aec.overdue_context(after_start) is first  # the waiting record is never overdue
    aec.trigger_if_needed(True)
    before_handover = time.monotonic()
    executor.complete_next_batch()  # first finishes, second takes the key
    assert first.finished and second.key_occupied
    assert aec.overdue_context(before_handover) is None  # its time began at the handover
    assert aec.overdue_context(time.monotonic()) is second


def test_record_timeout_is_checked_at_construction() -> None:
    for bad in (0, -1, 1.5, "10", True):
        with pytest.raises(ast.ConfigError, match=r"^record_timeout_ms must be"):
            ast.AsyncStateConfig(record_timeout_ms=bad)  # type: ignore[arg-type]
    assert ast.AsyncStateConfig().record_timeout_ms is None


class Blocks(ast.KeyedProcessFunction):
    """Records with key "slow" block the event loop (a synchronous call) past the timeout,
    then finish normally; others count."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

    async def process_element(self, record: Any, ctx: ast.RecordContext) -> None:
        await self.v.update(1)
        if record == "slow":
            deadline = time.monotonic() + 0.3
            while time.monotonic() < deadline:  # bounded: 0.3 s of blocking, no sleep
                pass
        ctx.emit(record)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("records", [["slow"], ["a", "slow", "b"]])
def test_a_record_that_blocks_the_loop_past_the_timeout_fails_the_run_naming_its_key(
        records: list[str]) -> None:
    # The watchdog cannot run while the loop is blocked, and the record has finished when
    # the loop runs again: the controller reports it as it finishes.
    config = ast.AsyncStateConfig(record_timeout_ms=100)
    with pytest.raises(ast.RecordTimeoutError, match=r"^the record with key 'slow' took \d+ ms, "
                       r"longer than record_timeout_ms=100; code that blocks the event loop "
                       r"\(time\.sleep, a synchronous call\) holds up every record$") as raised:
        ast.run(Blocks(), records, key_selector=_key, config=config)
    err = raised.value
    assert (err.key, err.timeout_ms, err.finished) == ("slow", 100, True)
    assert err.elapsed_ms >= 300
    copy = pickle.loads(pickle.dumps(err))
    assert (str(copy), copy.finished) == (str(err), True)


def test_records_within_the_timeout_run_through() -> None:
    config = ast.AsyncStateConfig(record_timeout_ms=10_000)
    assert ast.run(Blocks(), ["a", "slow", "b"], key_selector=_key, config=config) == \
        ["a", "slow", "b"]
