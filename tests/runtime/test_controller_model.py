"""The controller against a sequential per-key model, under random interleavings.

Hypothesis chooses the records (keys and what each does), batch size, in-flight limit, how
many batches complete after each arrival, the seed of the ManualExecutor's random
completion order, and an injected failure, if any: a batch that fails, or a record whose
output callback raises. Every record does a read-modify-write of a per-key counter with
then_compose chains; a sequential model says what each record must see. The seed is part of
the falsifying example Hypothesis prints, and is noted with the scenario.

A failed run (docs/concepts.md, "Failures") fails with the injected exception object, starts
no record after it failed (a sync point or a start waiting for its key or for capacity
fails instead), and leaves nothing pending; every record that ran saw exactly what the
sequential model of the records that completed says, where a write the failed batch
carried counts as applied (the ManualExecutor applies a batch when it is triggered).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
from hypothesis import event, given, note
from hypothesis import strategies as st
from runtime_harness import UPDATE, Harness, gauges, settle
from shared_functions import Boom

from asyncstate.runtime.requests import StateRequest

IDLE = gauges(in_flight=0, active=0, blocking=0, blocking_keys=0, occupied=0)
KINDS = ("rmw", "sync_rmw", "read_then_rmw", "idle")


@dataclasses.dataclass
class Failure:
    """An injected failure. "batch": the oldest pending batch fails at the first batch
    completion from the `at`-th on; "callback": the output callback of record `at` raises
    (after its write), which fails the run when that record finishes."""

    kind: str
    at: int
    arrive_after: bool  # records keep arriving after the run failed (else arrivals stop)


@st.composite
def failures(draw: st.DrawFn, records: list[tuple[int, str]]) -> Failure | None:
    """No failure, a batch failing at one of the first completions, or a record with state
    whose output callback raises (each about as often)."""
    with_state = [i for i, (_, kind) in enumerate(records) if kind != "idle"]
    kind = draw(st.sampled_from(["batch", None, "callback"] if with_state else ["batch", None]))
    if kind is None:
        return None
    at = draw(st.integers(0, 4) if kind == "batch" else st.sampled_from(with_state))
    return Failure(kind, at, draw(st.booleans()))


@dataclasses.dataclass
class Scenario:
    records: list[tuple[int, str]]  # (key, kind) in arrival order
    steps: list[int]  # batch completions attempted after each arrival
    batch_size: int
    max_in_flight: int
    retain: bool  # hold each record while its arrival code runs, as the operator does
    seed: int
    failure: Failure | None = None


def scenarios(max_keys: int) -> st.SearchStrategy[Scenario]:
    @st.composite
    def build(draw: st.DrawFn) -> Scenario:
        n_keys = draw(st.integers(1, max_keys))
        records = draw(st.lists(st.tuples(st.integers(0, n_keys - 1), st.sampled_from(KINDS)),
                                min_size=1, max_size=40))
        steps = draw(st.lists(st.integers(0, 3), min_size=len(records),
                              max_size=len(records)))
        return Scenario(records, steps, draw(st.integers(1, 8)), draw(st.integers(1, 12)),
                        draw(st.booleans()), draw(st.integers(0, 2**32 - 1)),
                        draw(failures(records)))
    return build()


class Driven:
    """Completes the batches of `h` in the random order of its executor's rng, failing one
    if the scenario injects a failed batch, and checks a run against the sequential model."""

    h: Harness
    max_in_flight: int
    records: list[tuple[int, str]]

    def init_run(self, failure: Failure | None) -> None:
        self.failure = failure
        self.exc = Boom("injected")
        self.arrived = 0
        self.completions = 0
        self.failed_requests: list[StateRequest] = []
        self.emitted: list[tuple[int, int, int]] = []  # (key, record, n)
        self.silent: dict[int, int] = {}  # record -> n it wrote without an output
        self.first_reads: dict[int, Any] = {}  # record -> the future of its first read
        self.starts: list[int] = []  # records, as their code started
        self.starts_at_failure: int | None = None
        self.h.aec.add_failure_listener(
            lambda _: setattr(self, "starts_at_failure", len(self.starts)))

    @property
    def stopped(self) -> bool:
        """Arrivals stop once the run failed, as KeyedOperator.process refuses records then,
        unless the scenario goes on starting records anyway."""
        return self.h.aec.failure is not None and not (
            self.failure is not None and self.failure.arrive_after)

    def output(self, key: int, i: int, n: int) -> None:
        if self.failure is not None and self.failure.kind == "callback" \
                and self.failure.at == i:
            self.silent[i] = n
            raise self.exc
        self.emitted.append((key, i, n))

    def complete_one(self) -> None:
        ex, failure = self.h.executor, self.failure
        if failure is not None and failure.kind == "batch" and not self.failed_requests \
                and self.completions >= failure.at:
            self.failed_requests = ex.fail_next_batch(self.exc)
            for request in self.failed_requests:
                if request.request_type is UPDATE:  # applied, its reply lost
                    self.silent[request.context.record] = request.payload
        else:
            ex.complete_random_batch()
        self.completions += 1

    def step(self) -> None:
        if self.h.executor.pending_batch_num:
            self.complete_one()
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
                self.complete_one()
            elif not aec.trigger_if_needed(True):
                return
        raise AssertionError("did not quiesce")

    def check_against_model(self, started: set[int], where: str) -> None:
        """The run failed with the injected exception exactly when one was injected, no
        record started after it failed, and every record that started matches the
        sequential model of the records that completed: one that emitted n, or wrote n
        without an output (its update in the failed batch, or its output callback raised),
        saw n - 1; any other had a request in the failed batch and wrote nothing."""
        h = self.h
        injected = bool(self.failed_requests) or self.silent
        assert h.aec.failure is (self.exc if injected else None), where
        if self.starts_at_failure is not None:
            late = self.starts[self.starts_at_failure:]
            assert late == [], f"records {late} started after the run failed: {where}"
        failed = {request.context.record for request in self.failed_requests}
        emitted = {i: n for _, i, n in self.emitted}
        assert len(emitted) == len(self.emitted), f"a record emitted twice: {where}"
        assert all(self.records[i][0] == key for key, i, _ in self.emitted), where
        count: dict[int, int] = {}
        for i, (key, kind) in enumerate(self.records[:self.arrived]):
            if kind == "idle" or i not in started:
                assert i not in emitted and i not in self.silent, f"record {i}: {where}"
                continue
            seen = count.get(key, 0)
            first = self.first_reads.get(i)
            if first is not None:
                assert first.done(), f"record {i}'s first read never completed: {where}"
                if first.exception() is not None:
                    assert first.exception() is self.exc and i in failed, where
                else:
                    assert first.result() == (seen or None), f"record {i} read: {where}"
            n = emitted.get(i, self.silent.get(i))
            if n is None:
                assert i in failed, f"record {i} neither completed nor failed: {where}"
                continue
            assert n == seen + 1, f"record {i} of key {key} wrote {n} after {seen}: {where}"
            count[key] = n
        for key in {k for k, _ in self.records}:
            assert h.stored(key) == count.get(key), f"key {key}: {where}"
        assert h.peak <= self.max_in_flight, where
        assert h.aec.in_flight_peak <= self.max_in_flight, where
        # Nothing hangs: every record finished, nothing waits, no batch is pending.
        assert h.gauges() == IDLE, where
        assert h.aec.parked_context_num == 0, where
        assert h.executor.pending_batch_num == 0, where


class Model(Driven):
    """Drives one scenario through a Harness and checks it against the sequential model."""

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.records = sc.records
        self.max_in_flight = sc.max_in_flight
        self.h = Harness(batch_size=sc.batch_size, max_in_flight=sc.max_in_flight,
                         rng=random.Random(sc.seed))
        self.init_run(sc.failure)
        self.futures: list[Any] = []
        self.over_limit: list[int] = []

    def emit(self, key: int, i: int, n: int) -> None:
        in_flight = self.h.aec.in_flight_record_num
        if in_flight > self.sc.max_in_flight:
            self.over_limit.append(in_flight)
        self.output(key, i, n)

    def arrive(self, i: int) -> None:
        key, kind = self.sc.records[i]
        h = self.h
        self.arrived = i + 1
        ctx = h.new_record(i, key)
        if self.sc.retain:
            ctx.retain()

        def u() -> Any:
            return h.u(lambda n: self.emit(key, i, n))

        def sync_u() -> Any:
            self.starts.append(i)
            return u()

        if kind == "rmw":
            self.futures.append(u())
        elif kind == "sync_rmw":
            self.futures.append(h.aec.sync_point(sync_u))
        elif kind == "read_then_rmw":
            first = self.first_reads[i] = h.get()
            self.futures.extend([first, u()])
        if self.sc.retain:
            ctx.release()
        h.sample()

    def check(self) -> None:
        sc, h = self.sc, self.h
        where = f"seed={sc.seed} {h.aec!r}"
        # A sync_rmw record starts at its sync point; the others when they arrive.
        started = {i for i, (_, kind) in enumerate(sc.records[:self.arrived])
                   if kind != "sync_rmw"} | set(self.starts)
        self.check_against_model(started, where)
        if h.aec.failure is None:
            expected: dict[int, list[tuple[int, int]]] = {}
            for i, (key, kind) in enumerate(sc.records):
                if kind != "idle":
                    runs = expected.setdefault(key, [])
                    runs.append((i, len(runs) + 1))
            actual: dict[int, list[tuple[int, int]]] = {}
            for key, i, n in self.emitted:
                actual.setdefault(key, []).append((i, n))
            assert actual == expected, where
        assert all(f.done() for f in self.futures), where
        assert self.over_limit == [], where


def run_sync(sc: Scenario) -> None:
    note(f"scenario: {sc}")
    event(f"failure drawn: {sc.failure and sc.failure.kind}")
    model = Model(sc)
    for i, steps in enumerate(sc.steps):
        if model.stopped:
            break
        model.arrive(i)
        for _ in range(steps):
            model.step()
    model.finish()
    model.check()
    event(f"run failed: {model.h.aec.failure is not None}")


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
    failure: Failure | None = None


@st.composite
def start_scenarios(draw: st.DrawFn) -> StartScenario:
    n_keys = draw(st.integers(1, 6))
    records = draw(st.lists(st.tuples(st.integers(0, n_keys - 1), st.sampled_from(START_KINDS)),
                            min_size=1, max_size=40))
    steps = draw(st.lists(st.integers(0, 3), min_size=len(records), max_size=len(records)))
    return StartScenario(records, steps, draw(st.integers(1, 8)), draw(st.integers(1, 12)),
                         draw(st.booleans()), draw(st.integers(0, 2**32 - 1)),
                         draw(failures(records)))


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
        self.records = sc.records
        self.max_in_flight = sc.max_in_flight
        self.h = Harness(batch_size=sc.batch_size, max_in_flight=sc.max_in_flight,
                         rng=random.Random(sc.seed))
        self.init_run(sc.failure)
        self.log: list[tuple[str, int, int]] = []
        self.running: dict[int, int] = {}  # key -> the record whose code runs
        self.overlaps: list[tuple[int, int, int]] = []
        self.in_flight_after: list[int] = []
        self.parked_after: list[int] = []

    def enter(self, key: int, i: int) -> None:
        if key in self.running:
            self.overlaps.append((key, self.running[key], i))
        self.running[key] = i
        self.starts.append(i)
        self.log.append(("enter", key, i))

    def exit(self, key: int, i: int) -> None:
        assert self.running.get(key) == i, (key, i, self.running)
        del self.running[key]
        self.log.append(("exit", key, i))

    def arrive(self, i: int) -> None:
        key, kind = self.sc.records[i]
        h = self.h
        self.arrived = i + 1

        def run(ctx: Any) -> None:
            self.enter(key, i)
            if kind == "idle":
                self.exit(key, i)
                return
            if kind == "read_then_rmw":
                self.first_reads[i] = h.get()
            h.u(lambda n: self.output(key, i, n)).then_accept(lambda _: self.exit(key, i))

        h.aec.start_record(h.aec.build_context(i, key), run)
        h.sample()
        self.in_flight_after.append(h.aec.in_flight_record_num)
        self.parked_after.append(h.aec.parked_context_num)

    def check(self) -> None:
        sc, h = self.sc, self.h
        where = f"seed={sc.seed} {h.aec!r}"
        self.check_against_model(set(self.starts), where)
        assert self.overlaps == [], f"records of one key ran at once: {self.overlaps} {where}"
        # The records of a key started in their arrival order: all of them, or, once the run
        # failed, those before the first one that had not started by then.
        entered: dict[int, list[int]] = {}
        for what, key, i in self.log:
            if what == "enter":
                entered.setdefault(key, []).append(i)
        arrived: dict[int, list[int]] = {}
        for i, (key, _) in enumerate(sc.records[:self.arrived]):
            arrived.setdefault(key, []).append(i)
        if h.aec.failure is None:
            assert self.arrived == len(sc.records) and entered == arrived, where
        for key, records in entered.items():
            assert records == arrived[key][:len(records)], f"key {key}: {where}"
        # Every record that started finished, but those its failure ended.
        unfinished = {i for i in self.running.values() if i not in self.silent}
        assert unfinished <= {r.context.record for r in self.failed_requests}, where


def run_start_scenario(sc: StartScenario) -> StartModel:
    model = StartModel(sc)
    for i, steps in enumerate(sc.steps):
        if model.stopped:
            break
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
    event(f"failure drawn: {sc.failure and sc.failure.kind}")
    model = run_start_scenario(sc)
    event(f"run failed: {model.h.aec.failure is not None}")


@pytest.mark.parametrize("limit", [1, 2, 5])
def test_start_record_admits_exactly_max_in_flight_and_parks_the_rest(limit: int) -> None:
    """Twelve records of three keys, every one waiting for a batch: exactly `limit` are in
    flight, the rest park, and none of a key starts while another of that key runs."""
    records = [(i % 3, "rmw") for i in range(12)]
    model = run_start_scenario(StartScenario(records, [0] * 12, 100, limit, True, 0))
    assert model.in_flight_after == [min(i + 1, limit) for i in range(12)]
    assert model.parked_after == [max(0, i + 1 - limit) for i in range(12)]
