"""KeyedOperator against a sequential per-key model under random interleavings of record
kinds, pauses, drains and watermarks, with and without injected failures."""

from __future__ import annotations

import asyncio
import tempfile
from collections import defaultdict
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from shared_functions import (
    LOOP_FACTORIES,
    BaseBoom,
    Boom,
    first,
    keyed_operator,
    new_backend,
    run_on_loop,
    slow_examples,
)

import asyncstate as ast

KINDS = ["async", "chain", "sleep", "fire_and_forget", "gather", "reduce", "nostate"]


class Mixed(ast.KeyedProcessFunction):
    """record = (key, kind, tag). Every kind but "reduce"/"nostate" bumps the key's counter
    by one and emits ("c", key, n, tag); "reduce" adds 1 twice without awaiting and emits
    ("r", key, total, tag); "nostate" emits ("n", key, None, tag). `started` lists the tags
    of the records as they start."""

    def open(self, ctx: Any) -> None:
        self.started: list[int] = []
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))
        self.red = ctx.get_reducing_state(
            ast.ReducingStateDescriptor("red", lambda a, b: a + b))

    def process_element(self, record: Any, ctx: Any) -> Any:
        key, kind, tag = record
        self.started.append(tag)
        if kind == "async":
            return self._async(key, tag, ctx, False)
        if kind == "sleep":
            return self._async(key, tag, ctx, True)
        if kind == "chain":
            def write(v: Any) -> Any:
                n = (v or 0) + 1
                return self.count.update(n).then_accept(lambda _: ctx.emit(("c", key, n, tag)))
            return self.count.value().then_compose(write)
        if kind == "fire_and_forget":
            def write2(v: Any) -> None:
                n = (v or 0) + 1
                self.count.update(n)  # not awaited nor returned: still part of the record
                ctx.emit(("c", key, n, tag))
            self.count.value().then_accept(write2)
            return None
        if kind == "gather":
            return self._gather(key, tag, ctx)
        if kind == "reduce":
            self.red.add(1)
            self.red.add(1)
            return self.red.get().then_accept(lambda t: ctx.emit(("r", key, t, tag)))
        ctx.emit(("n", key, None, tag))
        return None

    async def _async(self, key: Any, tag: int, ctx: Any, sleep: bool) -> None:
        v = await self.count.value()
        if sleep:
            await asyncio.sleep(0.0005 * (tag % 3))
        n = (v or 0) + 1
        await self.count.update(n)
        ctx.emit(("c", key, n, tag))

    async def _gather(self, key: Any, tag: int, ctx: Any) -> None:
        a, b = await asyncio.gather(self.count.value(), self.count.value())
        assert a == b
        n = (a or 0) + 1
        w = self.count.update(n)
        c = await self.count.value()  # reads its own write, without awaiting it first
        assert c == n, (c, n)
        await w
        ctx.emit(("c", key, n, tag))


def sequential_model(records: list[tuple[Any, str, int]]) -> dict[Any, list[Any]]:
    count: dict[Any, int] = defaultdict(int)
    red: dict[Any, int] = defaultdict(int)
    per_key: dict[Any, list[Any]] = defaultdict(list)
    for key, kind, tag in records:
        if kind == "reduce":
            red[key] += 2
            per_key[key].append(("r", key, red[key], tag))
        elif kind == "nostate":
            per_key[key].append(("n", key, None, tag))
        else:
            count[key] += 1
            per_key[key].append(("c", key, count[key], tag))
    return per_key


def split_by_key(outputs: list[Any]) -> dict[Any, list[Any]]:
    per_key: dict[Any, list[Any]] = defaultdict(list)
    for out in outputs:
        per_key[out[1]].append(out)
    return per_key


scenario = st.fixed_dictionaries({
    "records": st.lists(st.tuples(st.sampled_from([0, 1, 2, "x", (1, 2)]),
                                  st.sampled_from(KINDS)), min_size=1, max_size=40),
    "pauses": st.lists(st.integers(0, 3), min_size=40, max_size=40),
    "batch_size": st.sampled_from([1, 2, 3, 8, 1000]),
    "max_in_flight": st.sampled_from([1, 2, 3, 5, 100]),
    "drain_every": st.sampled_from([0, 3, 7]),
    "buffer_timeout_ms": st.sampled_from([0, 1, 50]),
})


async def _drive(op: ast.KeyedOperator, sc: dict[str, Any],
                 records: list[tuple[Any, str, int]]) -> None:
    for i, rec in enumerate(records):
        await op.process(rec)
        for _ in range(sc["pauses"][i]):
            await asyncio.sleep(0)
        if sc["drain_every"] and i % sc["drain_every"] == sc["drain_every"] - 1:
            if i % 2:
                await op.drain()
            else:
                await op.advance_watermark(i)
    await op.drain()


def _scenario_setup(loop_name: str, sc: dict[str, Any], **config: Any) -> tuple[
        list[tuple[Any, str, int]], ast.AsyncStateConfig, Any]:
    """A scenario's tagged records, its operator config and the event loop factory."""
    records = [(k, kind, i) for i, (k, kind) in enumerate(sc["records"])]
    op_config = ast.AsyncStateConfig(
        batch_size=sc["batch_size"], max_in_flight=sc["max_in_flight"],
        buffer_timeout_ms=sc["buffer_timeout_ms"], **config)
    return records, op_config, LOOP_FACTORIES[loop_name]


def _run_scenario(loop_name: str, sc: dict[str, Any], make: Any) -> tuple[list[Any], Any]:
    records, config, factory = _scenario_setup(loop_name, sc, iterator_chunk_size=2)

    async def main() -> tuple[list[Any], Any]:
        op = ast.KeyedOperator(Mixed(), key_selector=first, backend=make(), config=config)
        async with op:
            await asyncio.wait_for(_drive(op, sc, records), 20)
            m = op.metrics
            assert m["records_in"] == m["records_done"] == len(records)
            assert m["in_flight"] == 0
            assert m["in_flight_peak"] <= sc["max_in_flight"]
            assert m["max_batch_size"] <= sc["batch_size"]
            return op.outputs(), records

    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main())


def _check_model(outputs: list[Any], records: list[Any]) -> None:
    expected = sequential_model(records)
    actual = split_by_key(outputs)
    assert len(outputs) == len(records)
    for key in expected:
        assert actual[key] == expected[key], key


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
@pytest.mark.parametrize("backend", ["heap", "remote0", "remote_latency"])
@settings(max_examples=slow_examples(25), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(sc=scenario, latency=st.sampled_from([0.2, 1.0]), io=st.integers(1, 3))
@pytest.mark.timeout(120)
def test_random_interleavings_match_the_sequential_model(loop_name: str, backend: str,
                                                         sc: dict[str, Any], latency: float,
                                                         io: int) -> None:
    def make() -> Any:
        if backend == "heap":
            return ast.HeapBackend()
        if backend == "remote0":
            return ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0,
                                              io_parallelism=io)
        return ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=latency,
                                          io_parallelism=io)
    outputs, records = _run_scenario(loop_name, sc, make)
    _check_model(outputs, records)


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
@settings(max_examples=slow_examples(15), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(sc=scenario, io=st.integers(1, 2), inline=st.sampled_from([0, 16]))
@pytest.mark.timeout(120)
def test_random_interleavings_on_rocksdb_match_the_sequential_model(
        loop_name: str, tmp_path_factory: Any, sc: dict[str, Any], io: int,
        inline: int) -> None:
    path = tmp_path_factory.mktemp("rocks")

    def make() -> Any:
        return ast.RocksDBBackend(str(path / "db"), io_parallelism=io, inline_read_keys=inline)
    outputs, records = _run_scenario(loop_name, sc, make)
    _check_model(outputs, records)


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
@settings(max_examples=slow_examples(20), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenario, latency=st.sampled_from([0, 0.3]), io=st.integers(1, 3),
       p=st.sampled_from([0.05, 0.3, 1.0]), seed=st.integers(0, 1000))
# The only record's two adds lose their reads, so nothing is stored, and its read succeeds:
# it emits a total of None.
@example(sc={"records": [(0, "reduce")], "pauses": [0] * 40, "batch_size": 1,
             "max_in_flight": 1, "drain_every": 0, "buffer_timeout_ms": 0},
         latency=0, io=1, p=0.3, seed=4)
@pytest.mark.timeout(120)
def test_injected_backend_failures_fail_the_run_with_the_original_error_and_keep_key_order(
        loop_name: str, sc: dict[str, Any], latency: float, io: int, p: float,
        seed: int) -> None:
    records, config, factory = _scenario_setup(loop_name, sc)
    seen: dict[str, Any] = {}

    async def main() -> None:
        backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=latency,
                                             io_parallelism=io, failure_probability=p,
                                             seed=seed)
        fn = Mixed()
        op = ast.KeyedOperator(fn, key_selector=first, backend=backend, config=config)
        seen["op"], seen["fn"] = op, fn
        try:
            async with op:
                op.controller.add_failure_listener(
                    lambda _: seen.setdefault("started_at_failure", len(fn.started)))
                await asyncio.wait_for(_drive(op, sc, records), 20)
        except ast.InjectedFailure as exc:
            seen["exc"] = exc
        seen["outputs"] = op.outputs()
        seen["backend"] = backend

    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())
    op = seen["op"]
    failure = op.controller.failure
    if "exc" in seen:
        assert seen["exc"] is failure
    else:
        assert failure is None
        _check_model(seen["outputs"], records)
    if p == 1.0 and any(kind not in ("nostate",) for _, kind, _ in records):
        assert "exc" in seen
    # What a failed run emitted is exactly what the sequential model says, for each key the
    # outputs of its first records: a failed call's writes are applied (its reply is lost),
    # and a record of the key that had not started when the run failed never starts. Only
    # the key's last output may come from a record the failure hit: a "reduce" record whose
    # own add lost its read (so never wrote) emits a total below the model's (None when
    # nothing was ever stored).
    expected = sequential_model(records)
    for key, outs in split_by_key(seen["outputs"]).items():
        model = expected[key][:len(outs)]
        last, want = outs[-1], model[-1]
        if last[0] == "r" and last != want:
            total = 0 if last[2] is None else last[2]
            assert last[3] == want[3] and want[2] - 2 <= total < want[2], (key, last, want)
            outs, model = outs[:-1], model[:-1]
        assert outs == model, key
    started = seen["fn"].started
    late = started[seen.get("started_at_failure", len(started)):]
    assert late == [], f"records {late} started after the run failed"
    assert seen["backend"]._closed


class FailingMixed(Mixed):
    """Mixed, except that the record tagged `bad_tag` raises `exc` before writing anything:
    from the plain body ("sync"), from a callback ("callback"), or from an async def after
    a state await ("state-await") or after a real sleep ("sleep-await", inside a Task)."""

    def __init__(self, bad_tag: int, where: str, exc: BaseException) -> None:
        self.bad_tag, self.where, self.exc = bad_tag, where, exc

    def process_element(self, record: Any, ctx: Any) -> Any:
        if record[2] != self.bad_tag:
            return super().process_element(record, ctx)
        if self.where == "sync":
            raise self.exc
        if self.where == "callback":
            def fail(_v: Any) -> None:
                raise self.exc
            return self.count.value().then_accept(fail)
        return self._fail_async()

    async def _fail_async(self) -> None:
        await self.count.value()
        if self.where == "sleep-await":
            await asyncio.sleep(0.0005)
        raise self.exc


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
@settings(max_examples=slow_examples(30), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenario, data=st.data(),
       where=st.sampled_from(["sync", "callback", "state-await", "sleep-await"]),
       exc_type=st.sampled_from([Boom, BaseBoom, asyncio.CancelledError]),
       backend_name=st.sampled_from(["heap", "remote0", "remote0.3", "rocksdb"]))
@pytest.mark.timeout(120)
def test_a_failing_record_fails_the_run_with_its_exception_and_the_rest_match_the_model(
        loop_name: str, sc: dict[str, Any], data: Any, where: str,
        exc_type: type[BaseException], backend_name: str) -> None:
    """Whatever record fails, wherever and with whatever exception: the run fails with it
    (it does not hang), and every output emitted matches the sequential model of the run
    without that record (records of its key behind it may still run)."""
    records, config, factory = _scenario_setup(loop_name, sc)
    bad_tag = data.draw(st.integers(0, len(records) - 1), label="bad_tag")
    raised = exc_type("user failure")
    seen: dict[str, Any] = {}

    async def main(directory: str) -> None:
        if backend_name == "heap":
            backend: Any = ast.HeapBackend()
        elif backend_name == "rocksdb":
            backend = ast.RocksDBBackend(directory)
        else:
            backend = ast.SimulatedRemoteBackend(
                ast.HeapBackend(), latency_ms=float(backend_name.removeprefix("remote")))
        op = ast.KeyedOperator(FailingMixed(bad_tag, where, raised), key_selector=first,
                               backend=backend, config=config)
        seen["op"], seen["backend"] = op, backend
        try:
            async with op:
                await asyncio.wait_for(_drive(op, sc, records), 20)
        except TimeoutError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the run's failure, checked below
            seen["exc"] = exc
        seen["outputs"] = op.outputs()

    with tempfile.TemporaryDirectory(prefix="asyncstate-test-") as directory, \
            asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main(directory))
    failure = seen["op"].controller.failure
    assert seen["exc"] is failure
    if exc_type is asyncio.CancelledError:
        # An async def record's cancellation is reported with the record's key.
        assert isinstance(failure, asyncio.CancelledError)
    else:
        assert failure is raised
    expected = {out[3]: out for outs in sequential_model(
        [r for r in records if r[2] != bad_tag]).values() for out in outs}
    for out in seen["outputs"]:
        assert out == expected[out[3]]
    assert seen["backend"]._closed


# -- exclusivity, order and the in-flight peak, each asserted directly ------------------------


class Gated(ast.KeyedProcessFunction):
    """record (key, i): logs ("enter", key, i) as its code starts, reads the key's counter,
    waits for gate i, writes n = counter + 1, then logs ("exit", key, i) and emits
    (key, i, n). A record that starts while
    another of its key runs fails the run at once (AssertionError)."""

    def __init__(self, gates: list[asyncio.Event]) -> None:
        self.gates = gates
        self.log: list[tuple[str, Any, int]] = []
        self.running: dict[Any, int] = {}

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    async def process_element(self, record: Any, ctx: Any) -> None:
        key, i = record
        assert key not in self.running, f"record {i} started while {self.running[key]} ran"
        self.running[key] = i
        self.log.append(("enter", key, i))
        n = (await self.count.value() or 0) + 1
        await self.gates[i].wait()
        await self.count.update(n)
        del self.running[key]
        self.log.append(("exit", key, i))
        ctx.emit((key, i, n))


async def until(op: ast.KeyedOperator, predicate: Any, what: str) -> None:
    """Let the loop run until `predicate()` holds; raise the run's failure as soon as there
    is one (bounded: a regression fails here, not at the suite's timeout)."""
    for _ in range(10_000):
        if op.controller.failure is not None:
            raise op.controller.failure
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


async def run_gated(keys: list[int], limit: int, kind: str, batch_size: int,
                    seed: int) -> None:
    import random

    n = len(keys)
    gates = [asyncio.Event() for _ in range(n)]
    fn = Gated(gates)
    config = ast.AsyncStateConfig(max_in_flight=limit, batch_size=batch_size,
                                  buffer_timeout_ms=1)
    async with asyncio.timeout(10), \
            keyed_operator(fn, new_backend(kind), config=config) as op:
        async def produce() -> None:
            for i, key in enumerate(keys):
                await op.process((key, i))

        producer = asyncio.create_task(produce())
        try:
            # Nothing finishes before a gate opens: exactly min(limit, n) records get in.
            await until(op, lambda: op.metrics["records_in"] == min(limit, n), "admission")
            assert op.metrics["in_flight"] == min(limit, n)
            assert producer.done() == (n <= limit)
            rng = random.Random(seed)
            released: set[int] = set()

            def waiting() -> list[int]:
                return [i for what, _, i in fn.log if what == "enter" and i not in released]

            while len(released) < n:
                # A record of a freed key, or one admitted as capacity frees, starts soon.
                await until(op, lambda: waiting(), "a record starts")
                i = rng.choice(waiting())
                released.add(i)
                gates[i].set()
                assert op.metrics["in_flight"] <= limit
            await producer
        finally:
            producer.cancel()  # when the test failed: a producer may wait for capacity
        await op.drain()
        outputs = op.outputs()
        metrics = op.metrics
    assert metrics["in_flight_peak"] == min(limit, n)
    arrived: dict[int, list[int]] = {}
    for i, key in enumerate(keys):
        arrived.setdefault(key, []).append(i)
    entered: dict[int, list[int]] = {}
    for what, key, i in fn.log:
        if what == "enter":
            entered.setdefault(key, []).append(i)
    assert entered == arrived  # each key's records started in arrival order
    assert sorted(outputs, key=lambda o: o[1]) == [
        (key, i, arrived[key].index(i) + 1) for i, key in enumerate(keys)]


@settings(max_examples=slow_examples(15), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(keys=st.lists(st.integers(0, 4), min_size=1, max_size=20), limit=st.integers(1, 8),
       kind=st.sampled_from(["heap", "remote0"]), batch_size=st.sampled_from([1, 3, 100]),
       seed=st.integers(0, 2**32 - 1))
@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
def test_records_of_one_key_never_overlap_and_the_peak_is_exact(
        loop_name: str, keys: list[int], limit: int, kind: str, batch_size: int,
        seed: int) -> None:
    """Each record holds a gate the test opens in random order, so the test knows how many
    records can be in flight: min(max_in_flight, records), never more; a record of a busy
    key starts only after the one before it finished, in arrival order."""
    run_on_loop(loop_name, run_gated(keys, limit, kind, batch_size, seed))
