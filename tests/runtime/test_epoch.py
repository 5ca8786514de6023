"""EpochManager alone (Flink scenarios 18-20) and trigger/final action ordering."""

from __future__ import annotations

from typing import Any

from runtime_harness import Harness

from asyncstate.runtime.epoch import EpochManager, EpochStatus


def test_flink_scenario_18_basic() -> None:
    manager = EpochManager()
    out = 0

    def action() -> None:
        nonlocal out
        out += 1

    e1 = manager.on_record()
    e2 = manager.on_record()
    assert e1 is e2
    assert e1.ongoing_record_count == 2
    manager.on_non_record(None, action)
    e3 = manager.on_record()
    assert e3 is not e1
    assert len(manager.output_queue) == 1
    assert manager.output_queue[0].status is EpochStatus.CLOSED
    assert out == 0
    manager.complete_one_record(e1)
    assert out == 0
    manager.complete_one_record(e2)
    assert out == 1
    assert e1.status is EpochStatus.FINISHED
    manager.complete_one_record(e3)
    assert out == 1
    assert not manager.output_queue
    assert manager.active_epoch is e3
    assert manager.active_epoch.ongoing_record_count == 0
    assert manager.active_epoch.status is EpochStatus.OPEN


def test_flink_scenario_19_empty_epoch_fires_during_the_call() -> None:
    manager = EpochManager()
    order: list[str] = []
    before = manager.active_epoch.epoch_id
    manager.on_non_record(lambda: order.append("t"), lambda: order.append("f"))
    assert order == ["t", "f"]
    assert not manager.output_queue
    assert manager.active_epoch.epoch_id == before + 1
    assert manager.active_epoch.status is EpochStatus.OPEN


def test_flink_scenario_20_epochs_finish_in_order() -> None:
    manager = EpochManager()
    order: list[str] = []
    a = manager.on_record()
    manager.on_non_record(lambda: order.append("N0.t"), lambda: order.append("N0.f"))
    b = manager.on_record()
    manager.on_non_record(lambda: order.append("N1.t"), lambda: order.append("N1.f"))
    assert a is not b
    manager.complete_one_record(b)
    assert order == []  # epoch 0 is still the head
    manager.complete_one_record(a)
    assert order == ["N0.t", "N0.f", "N1.t", "N1.f"]
    assert not manager.output_queue


def test_empty_epoch_behind_a_busy_one_waits() -> None:
    manager = EpochManager()
    order: list[str] = []
    a = manager.on_record()
    manager.on_non_record(None, lambda: order.append("N0"))
    manager.on_non_record(None, lambda: order.append("N1"))  # epoch 1 has no records
    assert order == []
    assert len(manager.output_queue) == 2
    manager.complete_one_record(a)
    assert order == ["N0", "N1"]


def test_work_spawned_by_the_trigger_joins_the_finishing_epoch() -> None:
    manager = EpochManager()
    order: list[str] = []
    spawned = []

    def trigger() -> None:
        order.append("trigger")
        spawned.append(manager.on_record())  # e.g. a timer fired by a watermark

    a = manager.on_record()
    manager.on_non_record(trigger, lambda: order.append("final"))
    later = manager.on_record()  # a record after the watermark: the next epoch
    manager.complete_one_record(a)
    assert order == ["trigger"]
    assert spawned[0] is a  # joined the finishing epoch, not the open one
    assert later is manager.active_epoch
    assert spawned[0].status is EpochStatus.FINISHING
    manager.complete_one_record(later)
    assert order == ["trigger"]
    manager.complete_one_record(spawned[0])
    assert order == ["trigger", "final"]
    assert not manager.output_queue


def test_trigger_spawning_work_in_an_empty_epoch() -> None:
    manager = EpochManager()
    order: list[str] = []
    spawned = []

    def trigger() -> None:
        order.append("trigger")
        spawned.append(manager.on_record())

    manager.on_non_record(trigger, lambda: order.append("final"))
    assert order == ["trigger"]
    assert len(manager.output_queue) == 1
    manager.complete_one_record(spawned[0])
    assert order == ["trigger", "final"]
    assert not manager.output_queue


def test_later_epoch_waits_for_work_spawned_by_an_earlier_trigger() -> None:
    manager = EpochManager()
    order: list[str] = []
    spawned = []

    def trigger0() -> None:
        order.append("N0.t")
        spawned.append(manager.on_record())

    a = manager.on_record()
    manager.on_non_record(trigger0, lambda: order.append("N0.f"))
    manager.on_non_record(lambda: order.append("N1.t"), lambda: order.append("N1.f"))
    manager.complete_one_record(a)
    assert order == ["N0.t"]
    manager.complete_one_record(spawned[0])
    assert order == ["N0.t", "N0.f", "N1.t", "N1.f"]


def test_actions_may_close_another_epoch_without_reentering() -> None:
    manager = EpochManager()
    order: list[str] = []

    def final0() -> None:
        order.append("N0.f")
        manager.on_non_record(None, lambda: order.append("N-nested.f"))

    a = manager.on_record()
    manager.on_non_record(None, final0)
    manager.complete_one_record(a)
    assert order == ["N0.f", "N-nested.f"]
    assert not manager.output_queue


def test_work_a_final_action_starts_joins_the_open_epoch() -> None:
    # A final action that starts records (the records a watermark held back) and closes
    # another epoch (the next watermark): those records belong to the next epoch, which
    # waits for them, not to the finished one.
    manager = EpochManager()
    order: list[str] = []
    late: list[Any] = []

    def final0() -> None:
        order.append("N0.f")
        late.append(manager.on_record())
        manager.on_non_record(None, lambda: order.append("N1.f"))

    a = manager.on_record()
    manager.on_non_record(None, final0)
    manager.complete_one_record(a)
    assert order == ["N0.f"]
    assert late[0] is not a and late[0].ongoing_record_count == 1
    manager.complete_one_record(late[0])
    assert order == ["N0.f", "N1.f"]


def test_a_record_started_by_an_epoch_trigger_delays_that_epoch_final_action() -> None:
    h = Harness()
    aec = h.aec
    events: list[str] = []

    def run(ctx: Any) -> None:
        h.get().then_accept(lambda _: events.append("record done"))

    def trigger() -> None:
        aec.start_record(aec.build_context("timer", "k"), run)

    aec.epoch_manager.on_non_record(trigger, lambda: events.append("final"))
    assert events == []
    h.trig()
    assert events == ["record done", "final"]
