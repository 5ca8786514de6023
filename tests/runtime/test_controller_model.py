"""The controller against a sequential per-key model, under random interleavings.

Hypothesis chooses the records (keys and what each does), batch size, in-flight limit, how
many batches complete after each arrival, and the seed of the ManualExecutor's random
completion order. Every record does a read-modify-write of a per-key counter with
then_compose chains; a sequential model says what each record must see. The seed is part of
the falsifying example Hypothesis prints, and is noted with the scenario.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
from hypothesis import given, note
from hypothesis import strategies as st
from runtime_harness import Harness, gauges, settle

IDLE = gauges(in_flight=0, active=0, blocking=0, blocking_keys=0, occupied=0)
KINDS = ("rmw", "sync_rmw", "read_then_rmw", "idle")


@dataclasses.dataclass
class Scenario:
    records: list[tuple[int, str]]  # (key, kind) in arrival order
    steps: list[int]  # batch completions attempted after each arrival
    batch_size: int
    max_in_flight: int
    retain: bool  # hold each record while its arrival code runs, as the operator does
    seed: int


def scenarios(max_keys: int) -> st.SearchStrategy[Scenario]:
    @st.composite
    def build(draw: st.DrawFn) -> Scenario:
        n_keys = draw(st.integers(1, max_keys))
        records = draw(st.lists(st.tuples(st.integers(0, n_keys - 1), st.sampled_from(KINDS)),
                                min_size=1, max_size=40))
        steps = draw(st.lists(st.integers(0, 3), min_size=len(records),
                              max_size=len(records)))
        return Scenario(records, steps, draw(st.integers(1, 8)), draw(st.integers(1, 12)),
                        draw(st.booleans()), draw(st.integers(0, 2**32 - 1)))
    return build()


class Model:
    """Drives one scenario through a Harness and checks it against the sequential model."""

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.h = Harness(batch_size=sc.batch_size, max_in_flight=sc.max_in_flight,
                         rng=random.Random(sc.seed))
        self.emitted: list[tuple[int, int, int]] = []  # (key, record, n)
        self.first_reads: dict[int, Any] = {}
        self.futures: list[Any] = []
        self.over_limit: list[int] = []

    def emit(self, key: int, i: int, n: int) -> None:
        in_flight = self.h.aec.in_flight_record_num
        if in_flight > self.sc.max_in_flight:
            self.over_limit.append(in_flight)
        self.emitted.append((key, i, n))

    def arrive(self, i: int) -> None:
        key, kind = self.sc.records[i]
        h = self.h
        ctx = h.new_record(i, key)
        if self.sc.retain:
            ctx.retain()

        def u() -> Any:
            return h.u(lambda n: self.emit(key, i, n))

        if kind == "rmw":
            self.futures.append(u())
        elif kind == "sync_rmw":
            self.futures.append(h.aec.sync_point(u))
        elif kind == "read_then_rmw":
            first = h.get()
            first.then_accept(lambda v: self.first_reads.__setitem__(i, v))
            self.futures.extend([first, u()])
        if self.sc.retain:
            ctx.release()
        h.sample()

    def step(self) -> None:
        ex = self.h.executor
        if ex.pending_batch_num:
            ex.complete_random_batch()
        else:
            self.h.aec.trigger_if_needed(True)
        self.h.sample()

    def finish(self) -> None:
        ex, aec = self.h.executor, self.h.aec
        for _ in range(100_000):
            self.h.sample()
            if ex.pending_batch_num:
                ex.complete_random_batch()
            elif not aec.trigger_if_needed(True):
                return
        raise AssertionError("did not quiesce")

    def check(self) -> None:
        sc, h = self.sc, self.h
        where = f"seed={sc.seed} {h.aec!r}"
        assert h.aec.failure is None, where
        expected: dict[int, list[tuple[int, int]]] = {}
        for i, (key, kind) in enumerate(sc.records):
            if kind != "idle":
                runs = expected.setdefault(key, [])
                runs.append((i, len(runs) + 1))
        actual: dict[int, list[tuple[int, int]]] = {}
        for key, i, n in self.emitted:
            actual.setdefault(key, []).append((i, n))
        assert actual == expected, where
        for key, runs in expected.items():
            assert h.stored(key) == len(runs), where
        for i, v in self.first_reads.items():
            n = dict(actual[sc.records[i][0]])[i]
            assert v == (None if n == 1 else n - 1), f"record {i} read {v}: {where}"
        assert len(self.first_reads) == sum(k == "read_then_rmw" for _, k in sc.records)
        assert all(f.done() for f in self.futures), where
        assert self.over_limit == [], where
        assert h.peak <= sc.max_in_flight, where
        assert h.aec.in_flight_peak <= sc.max_in_flight, where
        assert h.gauges() == IDLE, where
        assert h.aec.parked_context_num == 0, where
        assert h.executor.pending_batch_num == 0, where


def run_sync(sc: Scenario) -> None:
    note(f"scenario: {sc}")
    model = Model(sc)
    for i, steps in enumerate(sc.steps):
        model.arrive(i)
        for _ in range(steps):
            model.step()
    model.finish()
    model.check()


@given(scenarios(max_keys=3))
def test_model_few_keys(sc: Scenario) -> None:
    run_sync(sc)


@given(scenarios(max_keys=50))
def test_model_many_keys(sc: Scenario) -> None:
    run_sync(sc)


def random_scenario(seed: int) -> Scenario:
    rng = random.Random(seed)
    n_keys = rng.choice([1, 3, 30])
    n = rng.randint(20, 60)
    records = [(rng.randrange(n_keys), rng.choice(KINDS)) for _ in range(n)]
    return Scenario(records, [rng.randint(0, 3) for _ in range(n)], rng.randint(1, 8),
                    rng.randint(1, 12), rng.random() < 0.5, seed)


@pytest.mark.parametrize("seed", range(6))
async def test_model_with_a_running_loop(seed: int) -> None:
    # Work posted from the test's Task runs from loop callbacks; let it run between steps.
    sc = random_scenario(seed)
    model = Model(sc)
    for i, steps in enumerate(sc.steps):
        model.arrive(i)
        for _ in range(steps):
            model.step()
            await settle(model.h, quiet_rounds=1)
    for _ in range(10_000):
        await settle(model.h)
        if model.h.executor.pending_batch_num:
            model.h.executor.complete_random_batch()
        elif not model.h.aec.trigger_if_needed(True):
            break
    await settle(model.h)
    model.check()
