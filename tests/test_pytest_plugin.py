"""The fixtures asyncstate's pytest plugin provides to any project that installs it."""

from __future__ import annotations

import asyncstate as ast
from asyncstate.runtime.requests import StateKind, StateRequestType
from asyncstate.testing import ManualClock, ManualExecutor


def test_manual_clock_fixture_starts_at_zero(manual_clock: ManualClock) -> None:
    assert manual_clock.now_ms() == 0
    manual_clock.advance(5)
    assert manual_clock.now_ms() == 5


def test_manual_executor_fixture_holds_batches_until_completed(
        manual_executor: ManualExecutor) -> None:
    handle = manual_executor.register_state("v", StateKind.VALUE)

    class State:
        name = "v"

    State.handle = handle  # type: ignore[attr-defined]
    aec = ast.AsyncExecutionController(manual_executor, batch_size=10, buffer_timeout_ms=0,
                                       max_in_flight=10)
    ctx = aec.build_context("r", "k")
    aec.set_current_context(ctx)
    aec.handle_request(State, StateRequestType.VALUE_UPDATE, 3)
    read = aec.handle_request(State, StateRequestType.VALUE_GET, None)
    assert aec.trigger_if_needed(True)
    assert manual_executor.pending_batch_num == 1 and not read.done()
    manual_executor.complete_next_batch()
    assert read.result() == 3
