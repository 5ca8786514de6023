"""AsyncExecutionController, single-stepped against a ManualExecutor (Flink's AECTest style).

Without a running loop the controller runs everything inline, so `trig()` (force a batch,
complete it) runs every callback before it returns, as with Flink's SyncMailbox. Scenario
numbers refer to FLINK_AEC_REFERENCE.md §5, adapted to asyncstate's deliberate differences.
Reference counts follow future.py's invariant: every pending future bound to a context holds
one reference on it (Flink's U holds three: the read, the compose stage, the accept stage)."""

from __future__ import annotations

import sys
from typing import Any

import pytest
from runtime_harness import (
    GET,
    UPDATE,
    Harness,
    gauges,
    stack_depth,
)
from shared_functions import BaseBoom, Boom, FakeState

import asyncstate as ast
from asyncstate.backends.heap import HeapBackend
from asyncstate.runtime.context import current_context
from asyncstate.runtime.requests import StateKind
from asyncstate.serde import canonical_key
from asyncstate.testing import ManualExecutor

IDLE = gauges(in_flight=0, active=0, blocking=0, blocking_keys=0, occupied=0)


def scenario_1(h: Harness) -> None:
    r1 = h.new_record("key1-r1", "key1")
    h.u()
    assert h.gauges() == gauges(in_flight=1, active=1, blocking=0, blocking_keys=0, occupied=1)
    assert r1.ref_count == 3
    h.trig()  # the read completes; the update goes to the active queue
    assert h.gauges() == gauges(in_flight=1, active=1, blocking=0, blocking_keys=0, occupied=1)
    assert r1.ref_count == 4  # update + its compose stage + the outer compose + accept
    assert h.out == []
    h.trig()
    assert h.out == [1]
    assert r1.ref_count == 0
    assert h.gauges() == IDLE


def scenario_2(h: Harness) -> None:
    r2 = h.new_record("key1-r2", "key1")
    h.u()
    r3 = h.new_record("key1-r3", "key1")
    h.u()
    assert h.gauges() == gauges(in_flight=2, active=1, blocking=1, blocking_keys=1, occupied=1)
    assert r3.ref_count == 3  # its blocked read holds it like any pending future
    h.trig()
    assert h.gauges() == gauges(in_flight=2, active=1, blocking=1, blocking_keys=1, occupied=1)
    h.trig()  # r2 finishes; r3's read moves to the active queue
    assert h.out == [1, 2]
    assert r2.ref_count == 0
    assert h.gauges() == gauges(in_flight=1, active=1, blocking=0, blocking_keys=0, occupied=1)
    h.trig()
    assert h.gauges() == gauges(in_flight=1, active=1, blocking=0, blocking_keys=0, occupied=1)
    h.trig()
    assert h.out == [1, 2, 3]
    assert r3.ref_count == 0
    assert h.gauges() == IDLE


def test_flink_1_single_record_lifecycle() -> None:
    h = Harness()
    scenario_1(h)
    assert h.stored("key1") == 1
    assert h.aec.failure is None


def test_flink_2_same_key_records_run_in_arrival_order() -> None:
    h = Harness()
    scenario_1(h)
    scenario_2(h)
    assert h.stored("key1") == 3


def test_flink_3_other_key_afterwards() -> None:
    h = Harness()
    scenario_1(h)
    scenario_2(h)
    h.new_record("key3-r3", "key3")
    h.u()
    h.trig()
    h.trig()
    assert h.out == [1, 2, 3, 1]
    assert h.gauges() == IDLE
    assert (h.stored("key1"), h.stored("key3")) == (3, 1)


def test_flink_4_different_keys_interleave_same_key_waits() -> None:
    h = Harness()
    r1 = h.new_record("key1-r1", "key1")
    h.u()
    r2 = h.new_record("key2-r1", "key2")
    h.u()
    r3 = h.new_record("key1-r2", "key1")
    h.u()
    assert h.gauges() == gauges(in_flight=3, active=2, blocking=1, blocking_keys=1, occupied=2)
    h.trig()
    assert h.gauges() == gauges(in_flight=3, active=2, blocking=1, blocking_keys=1, occupied=2)
    h.trig()
    assert h.out == [1, 1]
    assert (r1.ref_count, r2.ref_count) == (0, 0)
    assert h.gauges() == gauges(in_flight=1, active=1, blocking=0, blocking_keys=0, occupied=1)
    h.trig()
    assert h.gauges() == gauges(in_flight=1, active=1, blocking=0, blocking_keys=0, occupied=1)
    h.trig()
    assert h.out == [1, 1, 2]
    assert r3.ref_count == 0
    assert h.gauges() == IDLE


def test_flink_5_namespaces_are_per_state_per_context() -> None:
    h = Harness()

    def u_prime(record: str) -> None:
        h.aec.set_namespace(h.state, record)
        h.u()

    h.new_record("key1-r1", "key1")
    u_prime("key1-r1")
    h.trig()
    h.trig()
    assert h.out == [1]
    h.new_record("key1-r2", "key1")
    u_prime("key1-r2")
    h.new_record("key1-r1", "key1")
    u_prime("key1-r1")
    assert h.gauges() == gauges(in_flight=2, active=1, blocking=1, blocking_keys=1, occupied=1)
    h.trig()
    h.trig()
    assert h.out == [1, 1]  # a fresh namespace
    h.trig()
    h.trig()
    assert h.out == [1, 1, 2]  # the first record's namespace again
    assert h.gauges() == IDLE
    key1 = "key1"
    assert h.stored(key1) is None  # nothing in the default namespace
    assert h.stored(key1, canonical_key("key1-r1", "namespace")) == 2
    assert h.stored(key1, canonical_key("key1-r2", "namespace")) == 1


def test_flink_7_sync_point_on_a_free_key_runs_inline() -> None:
    h = Harness()
    ctx = h.new_record("record", "key")
    counter = 0

    def bump() -> int:
        nonlocal counter
        counter += 1
        return counter

    ctx.retain()
    result = h.aec.sync_point(bump)
    assert counter == 1
    assert result.result() == 1
    assert ctx.ref_count == 1
    assert h.gauges() == gauges(in_flight=1, active=0, blocking=0, blocking_keys=0, occupied=1)
    assert h.executor.executed_requests == []  # a sync point never reaches the executor
    ctx.release()
    assert h.gauges() == IDLE


def test_sync_point_on_a_busy_key_waits_for_the_holder() -> None:
    h = Harness()
    h.new_record("r1", "k")
    h.u()
    ran: list[Any] = []
    r2 = h.new_record("r2", "k")
    result = h.aec.sync_point(lambda: ran.append(current_context()) or "done")
    assert ran == []
    assert not result.done()
    assert h.gauges() == gauges(in_flight=2, active=1, blocking=1, blocking_keys=1, occupied=1)
    h.trig()
    assert ran == []
    h.trig()  # r1 finishes: r2's sync point gets the key and its callback runs
    assert ran == [r2]  # with its own record context current
    assert result.result() == "done"
    assert h.gauges() == IDLE


def test_ref_counts_of_a_pending_read_with_a_callback() -> None:
    h = Harness()
    ctx = h.new_record("r", "k")
    seen: list[Any] = []
    assert ctx.ref_count == 0
    ctx.retain()  # the operator holds the record while its code runs
    assert ctx.ref_count == 1
    read = h.get()
    assert ctx.ref_count == 2
    read.then_accept(seen.append)
    assert ctx.ref_count == 3
    ctx.release()
    assert ctx.ref_count == 2
    assert h.aec.in_flight_record_num == 1
    h.trig()
    assert seen == [None]
    assert ctx.ref_count == 0
    assert h.gauges() == IDLE


def test_in_flight_never_exceeds_max_in_flight_excess_contexts_park() -> None:
    h = Harness(max_in_flight=2)
    for i in range(5):
        h.new_record(f"r{i}", f"k{i}")
        h.u(lambda n, i=i: h.out.append((i, n)))
    assert h.gauges() == gauges(in_flight=2, active=2, blocking=0, blocking_keys=0, occupied=2)
    assert h.aec.parked_context_num == 3
    h.trig()  # the two reads
    assert h.aec.in_flight_record_num == 2
    h.trig()  # the two writes: r0 and r1 finish, r2 and r3 start
    assert h.out == [(0, 1), (1, 1)]
    assert h.gauges() == gauges(in_flight=2, active=2, blocking=0, blocking_keys=0, occupied=2)
    assert h.aec.parked_context_num == 1
    h.drive_to_completion()
    assert sorted(h.out) == [(i, 1) for i in range(5)]
    assert h.peak <= 2
    assert h.aec.in_flight_peak <= 2
    assert h.aec.parked_context_num == 0
    assert h.gauges() == IDLE


def test_max_in_flight_one_serialises_everything() -> None:
    h = Harness(max_in_flight=1, batch_size=10)
    for i in range(6):
        h.new_record(f"r{i}", f"k{i % 2}")
        h.u(lambda n, i=i: h.out.append((i, n)))
    assert h.aec.in_flight_record_num == 1
    h.drive_to_completion()
    assert h.out == [(0, 1), (1, 1), (2, 2), (3, 2), (4, 3), (5, 3)]
    assert h.aec.in_flight_peak == 1


def test_parked_same_key_record_runs_after_the_blocked_one() -> None:
    h = Harness(max_in_flight=2)
    for i, key in enumerate(["k", "k", "k", "j", "k"]):
        h.new_record(f"r{i}", key)
        h.u(lambda n, i=i, key=key: h.out.append((key, i, n)))
    assert h.gauges() == gauges(in_flight=2, active=1, blocking=1, blocking_keys=1, occupied=1)
    assert h.aec.parked_context_num == 3
    h.drive_to_completion()
    assert [o for o in h.out if o[0] == "k"] == [("k", 0, 1), ("k", 1, 2), ("k", 2, 3),
                                                 ("k", 4, 4)]
    assert ("j", 3, 1) in h.out
    assert h.peak <= 2
    assert h.gauges() == IDLE


def test_parked_context_keeps_the_order_of_its_requests() -> None:
    h = Harness(max_in_flight=1)
    h.new_record("r0", "a")
    h.get()
    h.new_record("r1", "b")
    first = h.aec.handle_request(h.state, UPDATE, 10)
    second = h.get()
    assert h.aec.parked_context_num == 1
    h.drive_to_completion()
    assert first.done()
    assert second.result() == 10  # the write was applied before the read
    assert h.gauges() == IDLE


def test_parked_context_belongs_to_the_epoch_of_its_first_request() -> None:
    # r2 issued its first request before the event, while capacity was full: the event must
    # wait for it like for any earlier record.
    h = Harness(max_in_flight=1)
    order: list[str] = []
    h.new_record("r1", "k1")
    h.u(lambda n: order.append("r1"))
    h.new_record("r2", "k2")
    h.u(lambda n: order.append("r2"))
    assert h.aec.parked_context_num == 1
    h.aec.epoch_manager.on_non_record(None, lambda: order.append("event"))
    h.drive_to_completion()
    assert order == ["r1", "r2", "event"]
    assert h.gauges() == IDLE


def test_new_context_does_not_overtake_a_parked_context_of_its_key() -> None:
    # r2 (key k) is parked for capacity. In the batch that finishes r1, r0's callback starts
    # r3 (key k) after r1's slot freed up: r3 arrived after r2 and must run after it.
    h = Harness(max_in_flight=2)
    order: list[str] = []

    def start_r3(_n: int) -> None:
        r3 = h.aec.build_context("r3", "k")
        r3.run(h.u, lambda n: order.append(f"r3 {n}"))

    h.new_record("r1", "k1")
    h.u(lambda n: order.append("r1"))
    h.new_record("r0", "k0")
    h.u(start_r3)
    h.new_record("r2", "k")
    h.u(lambda n: order.append(f"r2 {n}"))
    assert h.aec.parked_context_num == 1
    h.trig()  # both reads
    h.trig()  # both writes: r1 finishes first, then r0's callback starts r3
    h.drive_to_completion()
    assert [o for o in order if o.startswith(("r2", "r3"))] == ["r2 1", "r3 2"]
    assert h.peak <= 2
    assert h.gauges() == IDLE


def test_context_issuing_two_requests_while_blocked_gets_both_activated() -> None:
    h = Harness()
    h.new_record("r1", "k")
    h.get()
    r2 = h.new_record("r2", "k")
    a = h.aec.handle_request(h.state, UPDATE, 5)
    b = h.get()
    assert h.gauges() == gauges(in_flight=2, active=1, blocking=2, blocking_keys=1, occupied=1)
    h.trig()  # r1 finishes: both of r2's requests become active, not only the first
    assert h.gauges() == gauges(in_flight=1, active=2, blocking=0, blocking_keys=0, occupied=1)
    h.trig()
    assert a.done()
    assert b.result() == 5
    assert r2.ref_count == 0
    assert h.gauges() == IDLE


def test_blocked_context_gets_all_its_requests_even_when_another_context_queued_between() -> None:
    # r2 and r3 wait for r1's key; r2 issues a second request after r3 queued one. When r2
    # gets the key, its later request must not stay parked behind r3 (r3 cannot start
    # before r2 finishes, and r2 cannot finish before its request runs): nothing may hang.
    h = Harness()
    h.new_record("r1", "k")
    h.get()
    r2 = h.new_record("r2", "k")
    a = h.aec.handle_request(h.state, UPDATE, 2)
    r3 = h.new_record("r3", "k")
    x = h.get()
    h.aec.set_current_context(r2)
    b = h.get()
    assert h.aec.blocking_queue_size == 3
    h.drive_to_completion()
    assert a.done()
    assert b.done()
    assert b.result() == 2
    assert x.done(), f"r3's request never ran: {h.aec!r}"
    assert x.result() == 2
    assert (r2.ref_count, r3.ref_count) == (0, 0)
    assert h.gauges() == IDLE


def test_same_key_is_decided_by_canonical_bytes() -> None:
    h = Harness()
    h.new_record("list", [1, 2])
    h.get()
    h.new_record("tuple", (1, 2))
    h.get()
    assert h.aec.blocking_queue_size == 1  # a list and a tuple with equal items: one key
    h.new_record("int", 1)
    h.get()
    h.new_record("float", 1.0)
    h.get()
    h.new_record("bool", True)
    h.get()
    assert h.aec.occupied_key_num == 4  # 1, 1.0 and True are three keys
    h.drive_to_completion()
    assert h.gauges() == IDLE


def test_context_key_group_matches_assign_to_key_group() -> None:
    h = Harness(max_parallelism=64)
    for key in ["a", 17, (1, "x"), b"raw"]:
        ctx = h.aec.build_context(None, key)
        assert ctx.key_group == ast.assign_to_key_group(key, 64)
        assert ctx.key == key


def test_contexts_that_never_touch_state_do_not_block_an_epoch() -> None:
    h = Harness()
    fired: list[str] = []
    h.new_record("idle", "k0")  # built, never issues a request
    h.aec.epoch_manager.on_non_record(None, lambda: fired.append("wm1"))
    assert fired == ["wm1"]
    h.new_record("busy", "k1")
    h.u()
    late = h.aec.build_context("late", "k2")  # built before wm2, first request after it
    h.aec.epoch_manager.on_non_record(None, lambda: fired.append("wm2"))
    assert fired == ["wm1"]
    h.aec.set_current_context(late)
    late_read = h.get()
    h.aec.trigger_if_needed(True)
    h.executor.complete_batch(0)  # busy's read and late's read
    assert fired == ["wm1"]
    h.trig()  # busy's write: busy finishes
    assert fired == ["wm1", "wm2"]  # late joined the next epoch at its first request
    assert late_read.done()
    assert h.gauges() == IDLE


def test_non_record_event_waits_for_earlier_records_and_work_its_trigger_spawned() -> None:
    h = Harness()
    order: list[str] = []

    def trigger() -> None:
        order.append("trigger")
        timer = h.aec.build_context("timer", "k1")
        timer.run(h.u, lambda n: order.append(f"timer {n}"))

    h.new_record("r1", "k1")
    h.u(lambda n: order.append(f"r1 {n}"))
    h.aec.epoch_manager.on_non_record(trigger, lambda: order.append("final"))
    h.new_record("r2", "k2")  # after the event: its own epoch, does not delay it
    h.u(lambda n: order.append(f"r2 {n}"))
    h.trig()
    h.trig()  # r1 and r2 finish; epoch 0 starts finishing: its trigger spawns the timer
    assert sorted(order) == ["r1 1", "r2 1", "trigger"]
    assert order.index("r1 1") < order.index("trigger")
    h.trig()
    assert "final" not in order  # the timer's work belongs to the finishing epoch
    h.trig()
    assert order[-2:] == ["timer 2", "final"]
    assert h.gauges() == IDLE


def test_failed_batch_fails_futures_skips_callbacks_and_fails_the_run() -> None:
    h = Harness()
    listener: list[BaseException] = []
    h.aec.add_failure_listener(listener.append)
    calls: list[Any] = []
    r1 = h.new_record("r1", "k1")
    read1 = h.get()
    chain1 = read1.then_apply(calls.append)
    h.new_record("r2", "k2")
    chain2 = h.u()
    h.aec.trigger_if_needed(True)
    err = ast.InjectedFailure("lost the reply")
    h.executor.fail_next_batch(err)
    assert read1.exception() is err
    assert chain1.exception() is err
    assert chain2.exception() is err
    assert calls == []
    assert h.out == []
    assert h.aec.failure is err
    assert listener == [err]
    assert r1.ref_count == 0
    assert h.gauges() == IDLE


def test_failing_chain_that_nobody_looked_at_fails_the_run() -> None:
    h = Harness()
    err = Boom("callback")
    h.new_record("r", "k")

    def bad(_v: Any) -> None:
        raise err

    h.get().then_accept(bad)
    h.trig()
    assert h.aec.failure is err
    assert h.gauges() == IDLE


def test_failing_chain_that_was_looked_at_does_not_fail_the_run() -> None:
    h = Harness()
    err = Boom("callback")
    ctx = h.new_record("r", "k")
    ctx.retain()

    def bad(_v: Any) -> None:
        raise err

    chain = h.get().then_accept(bad)
    h.trig()
    assert chain.exception() is err  # handled by the record's code
    ctx.release()
    assert h.aec.failure is None
    assert h.gauges() == IDLE


def test_base_exception_from_a_callback_propagates_out_of_the_delivery() -> None:
    h = Harness()
    h.new_record("r", "k")

    def stop(_v: Any) -> None:
        raise KeyboardInterrupt

    h.get().then_accept(stop)
    h.aec.trigger_if_needed(True)
    with pytest.raises(KeyboardInterrupt) as info:
        h.executor.complete_next_batch()
    # Never captured into the future; the run fails with it, so that nobody waits for the
    # record it interrupted if the loop goes on.
    assert h.aec.failure is info.value


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, BaseBoom])
def test_a_base_exception_from_a_callback_still_completes_the_rest_of_the_batch(
        exc_type: type[BaseException]) -> None:
    """The other futures of the batch complete before the exception goes on, so their
    records finish. The run fails with the exception, as with an Exception of user code;
    KeyboardInterrupt also leaves the delivery."""
    h = Harness()
    raised = exc_type("stop")

    def stop(_v: Any) -> None:
        raise raised

    h.new_record("r1", "k1")
    h.get().then_accept(stop)
    h.new_record("r2", "k2")
    second = h.get()
    got: list[Any] = []
    second.then_accept(got.append)
    h.aec.trigger_if_needed(True)
    if exc_type is KeyboardInterrupt:
        with pytest.raises(KeyboardInterrupt) as info:
            h.executor.complete_next_batch()
        assert info.value is raised
    else:
        h.executor.complete_next_batch()
    assert h.aec.failure is raised
    assert second.done() and got == [None]
    assert h.aec.in_flight_record_num == 1  # r1: its callback's future never completes


def test_executor_error_on_a_request_fails_its_batch() -> None:
    h = Harness()
    broken = FakeState("broken", StateKind.VALUE, None)  # no handle: the store cannot execute it
    h.new_record("r", "k")
    fut = h.aec.handle_request(broken, GET, None)
    h.aec.trigger_if_needed(True)
    h.executor.complete_next_batch()
    assert isinstance(fut.exception(), Exception)
    assert h.aec.failure is fut.exception()


def test_request_outside_a_record_or_after_it_finished_raises() -> None:
    h = Harness()
    with pytest.raises(ast.InvalidStateError, match="outside a record"):
        h.get()
    with pytest.raises(ast.InvalidStateError, match="outside a record"):
        h.aec.sync_point(lambda: None)
    ctx = h.new_record("r", "k")
    h.get()
    h.trig()
    assert ctx.finished
    with pytest.raises(ast.InvalidStateError, match="after that record finished"):
        h.get()


def test_controller_validates_its_limits() -> None:
    for kwargs, option in [({"batch_size": 0}, "batch_size"),
                           ({"max_in_flight": 0}, "max_in_flight"),
                           ({"buffer_timeout_ms": -1}, "buffer_timeout_ms"),
                           ({"max_parallelism": 32769}, "max_parallelism")]:
        args: dict[str, Any] = {"batch_size": 1, "buffer_timeout_ms": 0, "max_in_flight": 1}
        args.update(kwargs)
        with pytest.raises(ValueError, match=option) as info:
            ast.AsyncExecutionController(ManualExecutor(), **args)
        assert isinstance(info.value, ast.AsyncStateError)


N_QUEUED = 10_000


@pytest.mark.parametrize("max_in_flight", [N_QUEUED + 1, 100], ids=["all-blocked", "parked"])
def test_completing_a_slow_record_runs_10000_blocked_records_without_growing_the_stack(
        max_in_flight: int) -> None:
    h = Harness(batch_size=1, max_in_flight=max_in_flight)
    h.new_record("slow", "k")
    slow_read = h.get()
    assert h.executor.pending_batch_num == 1  # batch_size 1: sent at once
    depths: list[int] = []
    order: list[int] = []

    def work(i: int) -> None:
        depths.append(stack_depth())
        order.append(i)

    for i in range(N_QUEUED):
        h.new_record(i, "k")
        h.aec.sync_point(lambda i=i: work(i))
    assert h.aec.blocking_queue_size == max_in_flight - 1
    assert h.aec.parked_context_num == N_QUEUED + 1 - max_in_flight
    assert order == []
    base = stack_depth()
    old_limit = sys.getrecursionlimit()
    sys.setrecursionlimit(base + 300)
    try:
        h.executor.complete_next_batch()
    finally:
        sys.setrecursionlimit(old_limit)
    assert slow_read.done()
    assert h.aec.failure is None
    assert order == list(range(N_QUEUED))
    assert max(depths) - base < 100, f"stack grew to {max(depths) - base} frames"
    assert max(depths) - min(depths) < 10
    assert h.gauges() == IDLE


def test_immediate_backend_cascade_of_10000_same_key_records_keeps_the_stack_flat() -> None:
    backend = HeapBackend()
    aec = ast.AsyncExecutionController(backend, batch_size=1, buffer_timeout_ms=0,
                                       max_in_flight=N_QUEUED + 10)
    state = FakeState.register(backend, "count")
    outputs: list[int] = []
    depths: list[int] = []

    def u() -> ast.StateFuture[None]:
        def increment(v: int | None) -> ast.StateFuture[int]:
            n = 1 if v is None else v + 1
            depths.append(stack_depth())
            return aec.handle_request(state, UPDATE, n).then_apply(lambda _: n)

        return aec.handle_request(state, GET, None).then_compose(increment).then_accept(
            outputs.append)

    holder = aec.build_context("holder", "k")
    aec.set_current_context(holder)
    holder.retain()
    aec.sync_point(lambda: None)  # holds the key until released
    for i in range(N_QUEUED):
        aec.set_current_context(aec.build_context(i, "k"))
        aec.sync_point(u)
    assert outputs == []
    base = stack_depth()
    old_limit = sys.getrecursionlimit()
    sys.setrecursionlimit(base + 300)
    try:
        holder.release()
    finally:
        sys.setrecursionlimit(old_limit)
    assert aec.failure is None
    assert outputs == list(range(1, N_QUEUED + 1))
    assert max(depths) - base < 100, f"stack grew to {max(depths) - base} frames"
    assert aec.in_flight_record_num == 0
    assert aec.occupied_key_num == 0


def test_controller_validates_iterator_chunk_size() -> None:
    args: dict[str, Any] = {"batch_size": 1, "buffer_timeout_ms": 0, "max_in_flight": 1}
    with pytest.raises(ValueError, match="iterator_chunk_size") as info:
        ast.AsyncExecutionController(ManualExecutor(), iterator_chunk_size=0, **args)
    assert isinstance(info.value, ast.AsyncStateError)


def test_request_after_the_controller_closed_raises_even_for_a_live_record() -> None:
    h = Harness()
    ctx = h.new_record("r", "k")
    h.aec.close()
    assert not ctx.finished
    with pytest.raises(ast.InvalidStateError, match="after the operator closed"):
        h.get()
    assert h.aec.requests == 0
    assert h.aec.active_queue_size == 0


def test_start_record_beyond_max_in_flight_waits_for_capacity() -> None:
    h = Harness(max_in_flight=1)
    started: list[str] = []

    def run(ctx: Any) -> None:
        started.append(ctx.record)
        h.get()

    for record, key in (("r1", "k1"), ("r2", "k2")):
        h.aec.start_record(h.aec.build_context(record, key), run)
    assert started == ["r1"]
    assert h.aec.in_flight_record_num == 1
    assert h.aec.parked_context_num == 1
    h.trig()  # r1 finishes: r2 takes its place
    assert started == ["r1", "r2"]
    h.drive_to_completion()
    assert h.aec.in_flight_peak == 1
    assert h.aec.in_flight_record_num == 0


def test_a_record_arriving_as_a_slot_frees_does_not_overtake_parked_records() -> None:
    h = Harness(max_in_flight=1)
    aec = h.aec
    started: list[str] = []

    def run(ctx: Any) -> None:
        started.append(ctx.record)
        fut = h.get()
        if ctx.record == "r1":
            # r3 arrives from the trampoline while r1's read completes, just before r1 ends
            # and frees the slot that parked r2 waits for.
            r3 = aec.build_context("r3", "k3")
            fut.then_accept(lambda _: aec.post(lambda _: aec.start_record(r3, run), None))

    aec.start_record(aec.build_context("r1", "k1"), run)
    aec.start_record(aec.build_context("r2", "k2"), run)
    assert started == ["r1"]
    h.trig()
    assert started == ["r1", "r2"]
    assert aec.parked_context_num == 1
    h.drive_to_completion()
    assert started == ["r1", "r2", "r3"]
    assert aec.in_flight_peak == 1


def test_batches_in_executor_counts_only_batches_not_yet_delivered() -> None:
    h = Harness(batch_size=1)
    h.new_record("r1", "k1")
    h.get()
    h.new_record("r2", "k2")
    h.get()
    assert h.aec.batches_in_executor == 2
    h.executor.complete_next_batch()
    assert h.aec.batches_in_executor == 1
    h.executor.complete_next_batch()
    assert h.aec.batches_in_executor == 0
    assert h.aec.batches == 2


def test_close_fails_outstanding_requests_with_the_run_failure() -> None:
    h = Harness()
    h.new_record("r1", "k1")
    queued = h.get()
    h.new_record("r2", "k1")
    blocked = h.get()
    boom = RuntimeError("boom")
    h.aec.fail(boom)
    h.aec.close()
    assert queued.exception() is boom
    assert blocked.exception() is boom


class _HeapFailingUpdates:
    """An immediate executor (docs/api.md, "Executors") around a HeapBackend whose value
    updates fail, as a broken store would. It has no operation table, so every request goes
    through execute_one; everything else is the heap's."""

    completes_at_issue = True
    immediate_ops = None

    def __init__(self) -> None:
        self._heap = ast.HeapBackend()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._heap, name)

    def execute_one(self, state: Any, request_type: ast.StateRequestType, payload: Any,
                    key_bytes: bytes, namespace: bytes) -> Any:
        if request_type is ast.StateRequestType.VALUE_UPDATE:
            raise OSError("the store is gone")
        return self._heap.execute_one(state, request_type, payload, key_bytes, namespace)


class _CatchUpdateFailure(ast.KeyedProcessFunction):
    def open(self, ctx):
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

    async def process_element(self, record, ctx):
        try:
            await self.v.update(record)
        except OSError:
            ctx.emit("caught")


@pytest.mark.timeout(30)
async def test_backend_failure_on_the_immediate_path_fails_the_run_even_if_handled() -> None:
    op = ast.KeyedOperator(_CatchUpdateFailure(), key_selector=lambda r: r,
                           backend=_HeapFailingUpdates())  # type: ignore[arg-type]
    with pytest.raises(OSError, match="the store is gone"):
        async with op:
            await op.process(1)
            await op.drain()
