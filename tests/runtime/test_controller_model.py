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


class Driven:
    """Completes the batches of `h` in the random order of its executor's rng."""

    h: Harness
    max_in_flight: int

    def step(self) -> None:
        ex = self.h.executor
        if ex.pending_batch_num:
            ex.complete_random_batch()
        else:
            self.h.aec.trigger_if_needed(True)
        self.h.sample()

    def finish(self) -> None:
        """Complete batches until nothing is left (bounded), never above max_in_flight."""
        ex, aec = self.h.executor, self.h.aec
        for _ in range(100_000):
            self.h.sample()
            assert aec.in_flight_record_num <= self.max_in_flight
            if ex.pending_batch_num:
                ex.complete_random_batch()
            elif not aec.trigger_if_needed(True):
                return
        raise AssertionError("did not quiesce")


class Model(Driven):
    """Drives one scenario through a Harness and checks it against the sequential model."""

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.max_in_flight = sc.max_in_flight
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


# -- through start_record, the path KeyedOperator starts its records on ----------------------

START_KINDS = ("rmw", "read_then_rmw", "idle")


@dataclasses.dataclass
class StartScenario:
    records: list[tuple[int, str]]  # (key, kind) in arrival order
    steps: list[int]  # batch completions attempted after each arrival
    batch_size: int
    max_in_flight: int
    arrive_first: bool  # every record arrives before any batch completes
    seed: int


@st.composite
def start_scenarios(draw: st.DrawFn) -> StartScenario:
    n_keys = draw(st.integers(1, 6))
    records = draw(st.lists(st.tuples(st.integers(0, n_keys - 1), st.sampled_from(START_KINDS)),
                            min_size=1, max_size=40))
    steps = draw(st.lists(st.integers(0, 3), min_size=len(records), max_size=len(records)))
    return StartScenario(records, steps, draw(st.integers(1, 8)), draw(st.integers(1, 12)),
                         draw(st.booleans()), draw(st.integers(0, 2**32 - 1)))


def in_flight_without_completions(records: list[tuple[int, str]],
                                  limit: int) -> tuple[list[int], int, int]:
    """The sequential model of admission while no batch completes: records in flight after
    each arrival, the peak, and how many records wait parked. A record is admitted while
    fewer than `limit` are in flight and none is parked (parked records go first come, first
    served); an admitted record stays in flight (it waits for its requests, or for its key),
    except a record without state on a free key, which starts and finishes at once."""
    in_flight = peak = parked = 0
    held: set[int] = set()
    after = []
    for key, kind in records:
        if parked or in_flight >= limit:
            parked += 1
        else:
            in_flight += 1
            peak = max(peak, in_flight)
            if kind == "idle" and key not in held:
                in_flight -= 1
            else:
                held.add(key)
        after.append(in_flight)
    return after, peak, parked


class StartModel(Driven):
    """Starts each record with `AsyncExecutionController.start_record` and logs when its code
    starts ("enter") and when its last callback ran ("exit")."""

    def __init__(self, sc: StartScenario) -> None:
        self.sc = sc
        self.max_in_flight = sc.max_in_flight
        self.h = Harness(batch_size=sc.batch_size, max_in_flight=sc.max_in_flight,
                         rng=random.Random(sc.seed))
        self.log: list[tuple[str, int, int]] = []
        self.running: dict[int, int] = {}  # key -> the record whose code runs
        self.overlaps: list[tuple[int, int, int]] = []
        self.emitted: list[tuple[int, int, int]] = []  # (key, record, n)
        self.first_reads: dict[int, Any] = {}
        self.in_flight_after: list[int] = []
        self.parked_after: list[int] = []

    def enter(self, key: int, i: int) -> None:
        if key in self.running:
            self.overlaps.append((key, self.running[key], i))
        self.running[key] = i
        self.log.append(("enter", key, i))

    def exit(self, key: int, i: int) -> None:
        assert self.running.get(key) == i, (key, i, self.running)
        del self.running[key]
        self.log.append(("exit", key, i))

    def arrive(self, i: int) -> None:
        key, kind = self.sc.records[i]
        h = self.h

        def run(ctx: Any) -> None:
            self.enter(key, i)
            if kind == "idle":
                self.exit(key, i)
                return
            if kind == "read_then_rmw":
                h.get().then_accept(lambda v: self.first_reads.__setitem__(i, v))
            h.u(lambda n: self.emitted.append((key, i, n))).then_accept(
                lambda _: self.exit(key, i))

        h.aec.start_record(h.aec.build_context(i, key), run)
        h.sample()
        self.in_flight_after.append(h.aec.in_flight_record_num)
        self.parked_after.append(h.aec.parked_context_num)

    def check(self) -> None:
        sc, h = self.sc, self.h
        where = f"seed={sc.seed} {h.aec!r}"
        assert h.aec.failure is None, where
        assert self.overlaps == [], f"records of one key ran at once: {self.overlaps} {where}"
        # Every record ran, and the records of a key ran in their arrival order.
        entered: dict[int, list[int]] = {}
        for what, key, i in self.log:
            if what == "enter":
                entered.setdefault(key, []).append(i)
        arrived: dict[int, list[int]] = {}
        for i, (key, _) in enumerate(sc.records):
            arrived.setdefault(key, []).append(i)
        assert entered == arrived, where
        assert len(self.log) == 2 * len(sc.records) and self.running == {}, where
        # Each read-modify-write saw the one before it.
        counts: dict[int, int] = {}
        expected = []
        for i, (key, kind) in enumerate(sc.records):
            if kind != "idle":
                counts[key] = counts.get(key, 0) + 1
                expected.append((key, i, counts[key]))
        assert sorted(self.emitted, key=lambda e: e[1]) == expected, where
        for i, v in self.first_reads.items():
            n = next(n for _, j, n in self.emitted if j == i)
            assert v == (None if n == 1 else n - 1), f"record {i} read {v}: {where}"
        # Never more than max_in_flight records in flight, and nothing left behind.
        assert h.peak <= sc.max_in_flight, where
        assert h.aec.in_flight_peak <= sc.max_in_flight, where
        assert h.gauges() == IDLE and h.aec.parked_context_num == 0, where


def run_start_scenario(sc: StartScenario) -> StartModel:
    model = StartModel(sc)
    for i, steps in enumerate(sc.steps):
        model.arrive(i)
        if not sc.arrive_first:
            for _ in range(steps):
                model.step()
    if sc.arrive_first:
        # Exactly what the model admits: the in-flight peak is max_in_flight, or every
        # record that can be in flight at once when fewer arrive.
        after, peak, parked = in_flight_without_completions(sc.records, sc.max_in_flight)
        _, unlimited, _ = in_flight_without_completions(sc.records, len(sc.records))
        assert model.in_flight_after == after
        assert model.parked_after[-1] == parked
        assert model.h.aec.in_flight_peak == peak == min(sc.max_in_flight, unlimited)
    model.finish()
    model.check()
    if sc.arrive_first:
        assert model.h.aec.in_flight_peak == peak  # the parked ones never raised it
    return model


@given(start_scenarios())
def test_records_started_by_start_record_match_the_model(sc: StartScenario) -> None:
    note(f"scenario: {sc}")
    run_start_scenario(sc)


@pytest.mark.parametrize("limit", [1, 2, 5])
def test_start_record_admits_exactly_max_in_flight_and_parks_the_rest(limit: int) -> None:
    """Twelve records of three keys, every one waiting for a batch: exactly `limit` are in
    flight, the rest park, and none of a key starts while another of that key runs."""
    records = [(i % 3, "rmw") for i in range(12)]
    model = run_start_scenario(StartScenario(records, [0] * 12, 100, limit, True, 0))
    assert model.in_flight_after == [min(i + 1, limit) for i in range(12)]
    assert model.parked_after == [max(0, i + 1 - limit) for i in range(12)]
