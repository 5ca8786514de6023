"""TTL reads on RocksDB whose multi-gets run ahead of the lane: a kept-back refresh (ON_READ_AND_
WRITE) written out by an unrelated batch must stay visible to the batches whose multi-gets
read the key before it was written. The loop is stepped by hand, and the pool has one thread,
so the test decides exactly when each batch's completed multi-get reaches the lane."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from backend_harness import MAX_PARALLELISM, record_context
from shared_functions import FakeState

from asyncstate.backends.base import ExecutorBinding
from asyncstate.backends.rocksdb import RocksDBBackend
from asyncstate.runtime.future import StateFuture
from asyncstate.runtime.requests import StateKind, StateRequest, StateRequestType
from asyncstate.serde import canonical_key, to_stored
from asyncstate.state.ttl.layout import TtlPolicy, TtlRead, TtlValue

T = StateRequestType
TTL = 100
POLICY = TtlPolicy(TTL, update_on_read=True, return_expired=False, cleanup_on_read=True)


class Lane:
    """A RocksDBBackend whose every read goes to its one pool thread, bound to a loop that
    only runs when `step()` lets the finished multi-gets reach the lane."""

    def __init__(self, path: Path) -> None:
        self.backend = RocksDBBackend(path, io_parallelism=1, inline_read_keys=0)
        self.loop = asyncio.new_event_loop()
        self.results: dict[int, list[Any]] = {}
        self.backend.open(ExecutorBinding(loop=self.loop, deliver=self._deliver,
                                          iterator_chunk_size=1000,
                                          max_parallelism=MAX_PARALLELISM))
        self.v = FakeState.register(self.backend, "v", StateKind.VALUE)
        self.m = FakeState.register(self.backend, "m", StateKind.MAP)
        for name in ("v", "m"):
            self.backend.set_ttl_layout(name, "processing_time", None)
        self.other = FakeState.register(self.backend, "other", StateKind.VALUE)

    def _deliver(self, batch: list[StateRequest], results: list[Any] | None,
                 error: BaseException | None) -> None:
        assert error is None, error
        assert results is not None
        self.results[id(batch)] = results

    def submit(self, *requests: StateRequest) -> list[StateRequest]:
        batch = list(requests)
        self.backend.execute_batch(batch)
        return batch

    def step(self) -> None:
        """Let every multi-get submitted so far finish, then apply what the lane can."""
        # One pool thread runs its tasks in order: once this one ran, every multi-get
        # submitted before it has finished and scheduled its wake-up on the loop.
        self.backend._pool.submit(lambda: None).result(timeout=30)
        self.loop.call_soon(self.loop.stop)
        self.loop.run_forever()

    def close(self) -> None:
        self.backend.close()
        self.loop.close()


@pytest.fixture
def lane(tmp_path: Path) -> Iterator[Lane]:
    lane = Lane(tmp_path / "db")
    yield lane
    lane.close()


def request(state: FakeState, t: StateRequestType, payload: Any, key: Any) -> StateRequest:
    return StateRequest(state, t, payload, canonical_key(None),  # type: ignore[arg-type]
                        record_context(key), StateFuture())


# The entry read, per read type: a value, or the entry "e" of a map; and what a read of it
# returns while it lives.
ENTRY = canonical_key("e")
FOUND = {T.VALUE_GET: "x", T.MAP_GET: "x", T.MAP_CONTAINS: True}


def write(lane: Lane, t: StateRequestType, key: Any) -> StateRequest:
    if t is T.VALUE_GET:
        return request(lane.v, T.VALUE_UPDATE, TtlValue(0, to_stored("x", "v")), key)
    return request(lane.m, T.MAP_PUT, (ENTRY, TtlValue(0, to_stored("x", "m"))), key)


def read(lane: Lane, t: StateRequestType, key: Any, now: int) -> StateRequest:
    if t is T.VALUE_GET:
        return request(lane.v, t, TtlRead(POLICY, now, now, None), key)
    return request(lane.m, t, TtlRead(POLICY, now, now, ENTRY), key)


@pytest.mark.parametrize("t", list(FOUND), ids=lambda t: t.name)
def test_a_refresh_written_out_while_a_later_multi_get_of_its_key_runs_stays_visible(lane, t):
    found = FOUND[t]
    # 1. "k" is written at 0 and read at 90: the read refreshes it to 90 (it lives until
    #    190), and that refresh is kept back.
    lane.submit(write(lane, t, "k"))
    a = lane.submit(read(lane, t, "k", 90))
    lane.step()
    assert lane.results[id(a)] == [found]
    # 2. Batches of other keys join the lane, their multi-gets queued on the pool, and then
    #    a read of "k" at 150: its multi-get starts at once (nothing ahead of it writes
    #    "k") and reads the bytes stored at 0, as the refresh is still kept back.
    others = [lane.submit(request(lane.other, T.VALUE_GET, None, i)) for i in range(4)]
    b = lane.submit(read(lane, t, "k", 150))
    # 3. The lane applies the other batches, which write the kept-back refresh out as it
    #    grows old, and then the read of "k": it must find "k" as refreshed at 90, alive.
    lane.step()
    assert all(lane.results[id(o)] == [None] for o in others)
    assert lane.results[id(b)] == [found]
    # Nothing was removed: "k" lives until 150 + 100 (the read at 150 refreshed it).
    c = lane.submit(read(lane, t, "k", 245))
    lane.step()
    assert lane.results[id(c)] == [found]
    # Refreshes written out are not kept on the handle for long: a few batches later, once
    # the batches under way when they were written are applied, the database alone has them.
    for i in range(6):
        lane.submit(request(lane.other, T.VALUE_GET, None, i))
        lane.step()
    assert not lane.backend._handles[c[0].state.name].refreshes
    d = lane.submit(read(lane, t, "k", 344))
    lane.step()
    assert lane.results[id(d)] == [found]
