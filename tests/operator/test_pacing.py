"""Pacing: an operator over a store with I/O slots (`PacedExecutor`) admits a new record
only while fewer requests than the slots' full batches and one more are in the store,
waiting to be sent, or about to come from records not yet started. Records waiting for
their key, and `max_in_flight`, are unaffected."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from typing import Any

import pytest
from executor_doubles import HeldStore, PacedHeldStore
from hypothesis import given, settings
from hypothesis import strategies as st
from shared_functions import Counter, cfg, let_loop_run, op_of, run_on_loop, with_tag

import asyncstate as ast
from asyncstate.backends.base import PacedExecutor
from asyncstate.errors import ConfigError


async def feed(op: ast.KeyedOperator, records: list[Any]) -> None:
    for record in records:
        await op.process(record)


async def releasing(store: HeldStore, work: Any, *, pick: Any = None,
                    rounds: int = 20_000) -> None:
    """Await `work` (a coroutine) while delivering the store's held batches, the oldest or
    `pick(len(pending))`; fails if it is still running after `rounds` loop iterations."""
    running = asyncio.ensure_future(work)
    for _ in range(rounds):
        if running.done():
            return await running
        if store.pending:
            store.deliver(0 if pick is None else pick(len(store.pending)))
        await asyncio.sleep(0)
    running.cancel()
    raise AssertionError(f"still running after {rounds} rounds")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("slots", [1, 2])
async def test_admission_waits_while_the_slots_have_full_batches_and_one_more(slots):
    store = PacedHeldStore(slots)
    records = [(k, k) for k in range(40)]
    async with op_of(Counter(output=with_tag), store,
                     config=cfg(batch_size=4, max_in_flight=100)) as op:
        producer = asyncio.ensure_future(feed(op, records))
        await let_loop_run()
        # Nothing delivered: (slots + 1) batches of 4 requests, one per record, and the
        # next record waits although max_in_flight allows 100.
        assert not producer.done()
        assert op.metrics["records_in"] == (slots + 1) * 4
        assert store.held() + op.metrics["active_buffer_size"] == (slots + 1) * 4
        await releasing(store, producer)
        await releasing(store, op.drain())
        assert sorted(op.outputs()) == [(k, 1, k) for k in range(40)]
        assert op.metrics["blocked_seconds"] > 0
    assert store.held_peak <= (slots + 1) * 4


@pytest.mark.timeout(30)
async def test_without_io_slots_only_max_in_flight_bounds_admission():
    # The control case: the same store without io_slots() takes every record at once.
    store = HeldStore()
    async with op_of(Counter(output=with_tag), store,
                     config=cfg(batch_size=4, max_in_flight=100)) as op:
        await feed(op, [(k, k) for k in range(40)])
        await let_loop_run()
        assert store.held() == 40
        await releasing(store, op.drain())
        assert sorted(op.outputs()) == [(k, 1, k) for k in range(40)]


@pytest.mark.timeout(30)
async def test_records_waiting_for_their_key_are_not_paced():
    # One key: the first record's read is held, the others wait for the key and issue no
    # request, so all of them are admitted up to max_in_flight.
    store = PacedHeldStore(1)
    async with op_of(Counter(output=with_tag), store,
                     config=cfg(batch_size=4, max_in_flight=30)) as op:
        producer = asyncio.ensure_future(feed(op, [("k", i) for i in range(30)]))
        await let_loop_run()
        assert producer.done()
        assert store.held() == 1
        assert op.metrics["num_in_flight_records"] == 30
        await releasing(store, op.drain())
        assert op.outputs() == [("k", n, n - 1) for n in range(1, 31)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("slots", [0, -1, 1.5, None])
async def test_io_slots_must_be_a_positive_int(slots):
    with pytest.raises(ConfigError, match=r"io_slots"):
        async with op_of(Counter(), PacedHeldStore(slots), config=cfg()):
            pass


@settings(max_examples=60, deadline=None)
@given(slots=st.integers(1, 3), batch_size=st.integers(1, 5),
       max_in_flight=st.integers(1, 40),
       keys=st.one_of(st.lists(st.integers(0, 12), min_size=1, max_size=80),
                      st.lists(st.integers(0, 999), min_size=1, max_size=80, unique=True)),
       seed=st.integers(0, 2**32 - 1))
def test_paced_runs_match_the_sequential_model(slots, batch_size, max_in_flight, keys, seed):
    """Random keys, limits and delivery orders: every key counts its records 1..n in order,
    nothing waits forever, and with distinct keys (no record waits for its key, each has
    one request at a time) the store never holds more than the slots' full batches and one
    more."""
    records = [(k, i) for i, k in enumerate(keys)]
    # Delivery order from a seed: a Random that hypothesis draws from lazily would raise
    # its StopTest inside the event loop.
    picks = random.Random(seed)

    async def main() -> tuple[list[Any], int]:
        store = PacedHeldStore(slots)
        config = cfg(batch_size=batch_size, max_in_flight=max_in_flight)
        async with op_of(Counter(output=with_tag), store, config=config) as op:
            await releasing(store, feed(op, records), pick=picks.randrange)
            await releasing(store, op.drain(), pick=picks.randrange)
            assert op.metrics["in_flight_peak"] <= max_in_flight
            return op.outputs(), store.held_peak

    outputs, held_peak = run_on_loop("uvloop", main())
    expected: dict[Any, list[Any]] = defaultdict(list)
    for key, tag in records:
        expected[key].append((key, len(expected[key]) + 1, tag))
    got: dict[Any, list[Any]] = defaultdict(list)
    for out in outputs:
        got[out[0]].append(out)
    assert got == expected
    if len(set(keys)) == len(keys):
        assert held_peak <= (slots + 1) * batch_size


def test_the_batched_backends_declare_their_io_parallelism_as_slots(tmp_path):
    with ast.RocksDBBackend(tmp_path / "db", io_parallelism=3) as rocks:
        assert isinstance(rocks, PacedExecutor) and rocks.io_slots() == 3
    remote = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0, io_parallelism=4)
    assert isinstance(remote, PacedExecutor) and remote.io_slots() == 4
    remote.close()
    assert not isinstance(ast.HeapBackend(), PacedExecutor)  # completes requests at issue
