"""TTL reads on RocksDB whose multi-gets run ahead of the lane. A kept-back refresh (ON_READ_AND_
WRITE) written out by an unrelated batch must stay visible to the batches whose multi-gets
read the key before it was written; a removal by TTL cleanup (an incremental step, the
background cleaner) must stay visible to the batches whose multi-gets read the key before it
was applied, and must never remove a value written again. The loop is stepped by hand, and
the pool has one thread, so the test decides exactly when each batch's completed multi-get
reaches the lane."""

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
from asyncstate.backends.rocksdb_cleaner import Slice, scan
from asyncstate.runtime.future import StateFuture
from asyncstate.runtime.requests import StateKind, StateRequest, StateRequestType
from asyncstate.serde import canonical_key, to_stored
from asyncstate.state.ttl.layout import MAX_TIMESTAMP, TtlPolicy, TtlRead, TtlValue
from asyncstate.state.ttl.tracker import TtlTracker

T = StateRequestType
TTL = 100
POLICY = TtlPolicy(TTL, update_on_read=True, return_expired=False, cleanup_on_read=True)
# RETURN_EXPIRED_IF_NOT_CLEANED_UP, no refresh; and the read inside a reducing or aggregating
# add(), which the add's write depends on (it neither refreshes nor removes).
RETURNING = TtlPolicy(TTL, update_on_read=False, return_expired=True, cleanup_on_read=True)
MERGING = TtlPolicy(TTL, update_on_read=False, return_expired=False, cleanup_on_read=False)


class Time:
    """The time source of the trackers: what the background cleaner's scan reads."""

    def __init__(self) -> None:
        self.ms = 0

    def now(self) -> int:
        return self.ms


class Lane:
    """A RocksDBBackend whose every read goes to its one pool thread, bound to a loop that
    only runs when `step()` lets the finished multi-gets reach the lane."""

    def __init__(self, path: Path) -> None:
        self.backend = RocksDBBackend(path, io_parallelism=1, inline_read_keys=0)
        self.loop = asyncio.new_event_loop()
        self.results: dict[int, list[Any] | BaseException] = {}
        self.backend.open(ExecutorBinding(loop=self.loop, deliver=self._deliver,
                                          iterator_chunk_size=1000,
                                          max_parallelism=MAX_PARALLELISM))
        self.v = FakeState.register(self.backend, "v", StateKind.VALUE)
        self.m = FakeState.register(self.backend, "m", StateKind.MAP)
        self.l = FakeState.register(self.backend, "l", StateKind.LIST)
        for name in ("v", "m", "l"):
            self.backend.set_ttl_layout(name, "processing_time", None)
        self.other = FakeState.register(self.backend, "other", StateKind.VALUE)
        self.time = Time()
        self.trackers: dict[str, TtlTracker] = {}

    def _deliver(self, batch: list[StateRequest], results: list[Any] | None,
                 error: BaseException | None) -> None:
        # A failure is kept as the batch's result (the assertion on it shows it): raised
        # here, it would stop the lane.
        self.results[id(batch)] = results if error is None else error

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

    def settle(self) -> None:
        """`step()` until every job is applied (a batch whose multi-get waited for an earlier
        batch's writes starts it during a step, and finishes it at the next)."""
        for _ in range(10):
            self.step()
            if not self.backend._lane:
                return
        raise AssertionError(f"the lane does not drain: {self.backend!r}")

    def hold(self) -> StateRequest:
        """A read of another state: its batch heads the lane until the next `step()`, so
        the jobs queued behind it wait (their multi-gets do not)."""
        return self.submit(request(self.other, T.VALUE_GET, None, "hold"))[0]

    def clean(self, cleanup: str, name: str, now: int) -> Slice | None:
        """Let TTL cleanup of state `name` find what has expired at `now`: the background
        cleaner scans a slice here (on the test's thread, as its own thread would) and
        `remove()` queues the removal; an incremental step scans when its job runs (None)."""
        if name not in self.trackers:
            # The bound never drops (nothing here calls `wrote`): the cleaner starts no pass
            # of its own, every slice is scanned by the test.
            self.trackers[name] = TtlTracker(
                name, TTL, "processing_time", self.time, full_snapshot=False,
                background_every=1 if cleanup == "cleaner" else 0, bound=MAX_TIMESTAMP)
            self.backend.track_ttl(name, self.trackers[name])
        if cleanup == "incremental":
            return None
        self.time.ms = now
        return scan(Slice(name, self.backend._handles[name], self.trackers[name], b""))

    def remove(self, cleanup: str, name: str, now: int, piece: Slice | None) -> None:
        """Queue the cleanup job in the lane: the cleaner's removal of what `piece` found, or
        an incremental step of `name` at `now`."""
        if piece is None:
            self.backend.ttl_cleanup_step(name, 1000, now)
        else:
            self.backend._cleaner.submit(piece)  # type: ignore[union-attr]

    def stored(self, key: Any) -> list[tuple[str, bytes, bytes, Any]]:
        """Every entry stored under `key` (deferred refreshes written first)."""
        return list(self.backend.snapshot_key_group(record_context(key).key_group))

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


ABSENT = {T.VALUE_GET: None, T.MAP_GET: None, T.MAP_CONTAINS: False}


def name_of(t: StateRequestType) -> str:
    return "v" if t is T.VALUE_GET else "m"


def write(lane: Lane, t: StateRequestType, key: Any, value: Any = "x",
          ts: int = 0) -> StateRequest:
    if t is T.VALUE_GET:
        return request(lane.v, T.VALUE_UPDATE, TtlValue(ts, to_stored(value, "v")), key)
    return request(lane.m, T.MAP_PUT, (ENTRY, TtlValue(ts, to_stored(value, "m"))), key)


def clear(lane: Lane, t: StateRequestType, key: Any) -> StateRequest:
    return request(lane.v if t is T.VALUE_GET else lane.m, T.CLEAR, None, key)


def read(lane: Lane, t: StateRequestType, key: Any, now: int,
         policy: TtlPolicy = POLICY) -> StateRequest:
    if t is T.VALUE_GET:
        return request(lane.v, t, TtlRead(policy, now, now, None), key)
    return request(lane.m, t, TtlRead(policy, now, now, ENTRY), key)


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


@pytest.mark.parametrize("case", list(
    ["refreshing-read-issued-at-90", "merge-read-issued-at-90", "return-expired-read-at-150"]))
@pytest.mark.parametrize("t", list(FOUND), ids=lambda t: t.name)
def test_a_read_queued_behind_a_read_that_removed_its_entry_finds_it_removed(lane, t, case):
    """Later batches do not wait for a batch's TTL point reads, so a read of "k" queued behind
    a read that found it expired at 150 and removed it (cleanup on read) has its multi-get run
    first, reading the entry's bytes. It must find nothing all the same: fails if the removal
    were not shown to the batches behind it (the read issued at 90, as by a wall clock that
    stepped back, returns the removed value and stores it again with its refresh; the one
    that may return expired entries returns it), or shown only to the first one (here one of
    another key)."""
    policy, now = {"refreshing-read-issued-at-90": (POLICY, 90),
                   "merge-read-issued-at-90": (MERGING, 90),
                   "return-expired-read-at-150": (RETURNING, 150)}[case]
    lane.submit(write(lane, t, "k"))  # expires at 100
    lane.step()
    lane.hold()
    a = lane.submit(read(lane, t, "k", 150))
    lane.submit(request(lane.other, T.VALUE_GET, None, "between"))
    b = lane.submit(read(lane, t, "k", now, policy))
    lane.settle()
    assert lane.results[id(a)] == [ABSENT[t]]
    assert lane.results[id(b)] == [ABSENT[t]]
    c = lane.submit(read(lane, t, "k", 180))
    lane.settle()
    assert lane.results[id(c)] == [ABSENT[t]]
    assert lane.stored("k") == []
    # The removal is shown to later reads only while the jobs queued behind it run.
    assert not lane.backend._handles[name_of(t)].refreshes


# -- TTL cleanup in the lane ------------------------------------------------------------------
#
# An incremental cleanup step, and the background cleaner's removal of the expired entries a
# slice found, run as jobs of the backend's own in the lane. Nothing they remove is known
# when later batches start their multi-gets, so those do not wait for them: a batch queued
# behind a cleanup job may read an entry's bytes before the job removes it. Here the entry
# "k" is written at 0 (it expires at 100) and a cleanup at 150 removes it.

CLEANUPS = ["incremental", "cleaner"]
# (policy, "now" of the read): a read issued before the entry expired (buffered until after
# the cleanup found it expired), with refresh (ON_READ_AND_WRITE) and as the read of an add();
# one issued after, that may return expired entries; and one that may not.
STALE_READS = {
    "refreshing-read-issued-at-90": (POLICY, 90),
    "merge-read-issued-at-90": (MERGING, 90),
    "return-expired-read-at-150": (RETURNING, 150),
    "never-return-expired-read-at-150": (POLICY, 150),
}


@pytest.mark.parametrize("case", list(STALE_READS))
@pytest.mark.parametrize("t", list(FOUND), ids=lambda t: t.name)
@pytest.mark.parametrize("cleanup", CLEANUPS)
def test_a_read_queued_behind_a_cleanup_removal_finds_the_entry_removed(lane, cleanup, t, case):
    """The read is behind the removal in the lane, so it finds nothing, even though its
    multi-get read the entry's bytes before the removal was applied. Fails if later batches
    answered such reads from the bytes read before the removal: the read returns the removed
    value (and a write of an add() folds it into what it writes), and, with ON_READ_AND_WRITE,
    its refresh stores the removed entry again. Fails too if the removal were shown only to
    the first batch behind it (here one of another key)."""
    policy, now = STALE_READS[case]
    name = name_of(t)
    lane.submit(write(lane, t, "k"))
    lane.step()
    piece = lane.clean(cleanup, name, 150)
    lane.hold()
    lane.remove(cleanup, name, 150, piece)  # queued behind the held batch
    lane.submit(request(lane.other, T.VALUE_GET, None, "between"))
    # Nothing ahead of it writes "k": its multi-get runs at once, before the removal.
    b = lane.submit(read(lane, t, "k", now, policy))
    lane.step()
    assert lane.results[id(b)] == [ABSENT[t]]
    # Nothing brought it back: a refresh at 90 would have it live until 190.
    c = lane.submit(read(lane, t, "k", 180))
    lane.step()
    assert lane.results[id(c)] == [ABSENT[t]]
    assert lane.stored("k") == []
    # The removal is shown to later reads only while the jobs queued behind it run.
    assert not lane.backend._handles[name].refreshes


@pytest.mark.parametrize("cleanup", CLEANUPS)
@pytest.mark.parametrize("t", [T.LIST_GET, T.MAP_ITER], ids=lambda t: t.name)
def test_an_iteration_queued_behind_a_cleanup_removal_finds_the_elements_gone(lane, cleanup,
                                                                               t):
    """Iterations read when the lane applies them, after the removal: the expired element is
    gone, the live one refreshed. Fails if an iteration read the column family before the
    removal was applied (the read at 90 would find the expired element fresh and refresh
    it back to life)."""
    if t is T.LIST_GET:
        state, name = lane.l, "l"
        lane.submit(request(state, T.LIST_ADD, TtlValue(0, to_stored("x", name)), "k"),
                    request(state, T.LIST_ADD, TtlValue(60, to_stored("y", name)), "k"))
        live: list[Any] = ["y"]
    else:
        state, name = lane.m, "m"
        lane.submit(request(state, T.MAP_PUT, (ENTRY, TtlValue(0, to_stored("x", name))), "k"),
                    request(state, T.MAP_PUT, (canonical_key("f"),
                                               TtlValue(60, to_stored("y", name))), "k"))
        live = [("f", "y")]
    lane.step()
    piece = lane.clean(cleanup, name, 150)
    lane.hold()
    lane.remove(cleanup, name, 150, piece)
    b = lane.submit(request(state, t, TtlRead(POLICY, 90, 90, None), "k"))
    lane.step()
    assert lane.results[id(b)][0].items == live
    c = lane.submit(request(state, t, TtlRead(POLICY, 180, 180, None), "k"))
    lane.step()
    assert lane.results[id(c)][0].items == live  # refreshed at 90: lives until 190


# When "k" is written again relative to the cleanup that finds it expired at 150.
REWRITES = ["before-the-removal", "after-the-removal", "cleared-and-written-after-the-removal",
            "refreshed-before-the-removal"]


@pytest.mark.parametrize("when", REWRITES)
@pytest.mark.parametrize("t", list(FOUND), ids=lambda t: t.name)
@pytest.mark.parametrize("cleanup", CLEANUPS)
def test_a_value_written_again_around_a_cleanup_removal_survives(lane, cleanup, t, when):
    """No live value is lost to cleanup.

    - before-the-removal: the cleaner's scan found "k" expired, then a batch queued ahead of
      the removal writes it again (still unapplied when the removal is queued). Fails if
      the cleaner's removal did not read its candidates again when the lane applies it.
    - after-the-removal: "k" is written again by a batch queued behind the removal, after a
      read whose multi-get ran before the removal, and is read by a batch queued behind that
      write. Fails if a removal were applied out of the lane's order, or if the removal
      shown to the reads queued behind it hid the later write.
    - cleared-and-written-after-the-removal: the same with a clear before the write. Fails
      too if the clear tried to write out the removals shown under its key.
    - refreshed-before-the-removal: a read at 90 refreshed "k", and that refresh is still
      kept back, not in the database, when the removal runs. Fails if the cleanup judged
      what the database holds without the kept-back refreshes.
    """
    name = name_of(t)
    lane.submit(write(lane, t, "k"))
    lane.step()
    expect = "y"
    if when == "refreshed-before-the-removal":
        a = lane.submit(read(lane, t, "k", 90))  # "k" lives until 190
        lane.step()
        assert lane.results[id(a)] == [FOUND[t]]
        assert lane.backend._handles[name].refreshes  # kept back
        expect = "x"
    piece = lane.clean(cleanup, name, 150)
    lane.hold()
    if when == "before-the-removal":
        lane.submit(write(lane, t, "k", "y", 140))  # lives until 240
    lane.remove(cleanup, name, 150, piece)
    if when.endswith("after-the-removal"):
        b = lane.submit(read(lane, t, "k", 150))
        rewrite = write(lane, t, "k", "y", 150)  # lives until 250
        if when.startswith("cleared"):
            lane.submit(clear(lane, t, "k"), rewrite)
        else:
            lane.submit(rewrite)
    c = lane.submit(read(lane, t, "k", 180))
    lane.settle()
    if when.endswith("after-the-removal"):
        assert lane.results[id(b)] == [ABSENT[t]]
    assert lane.results[id(c)] == [FOUND[t] if t is T.MAP_CONTAINS else expect]
    d = lane.submit(read(lane, t, "k", 270))  # refreshed at 180 by c
    lane.settle()
    assert lane.results[id(d)] == [FOUND[t] if t is T.MAP_CONTAINS else expect]


# -- a job's iteration between its point read and its write; a job failing in its reads --------

@pytest.mark.parametrize("case", ["event-time-late-record", "wall-clock-moves"])
def test_iteration_between_a_point_read_and_a_write_sees_the_refresh(tmp_path: Path,
                                                                      case: str) -> None:
    """One record's calls, not awaited: get(e), entries(), put(e). The iteration comes
    before the write, so it judges e by the refresh of the get (kept back), not by the stored
    timestamp. Event time, a late record: e stored at 50, the get at watermark 140 with access
    30 refreshes it to 30, so the iteration finds it expired (130 <= 140). Wall clock: the
    get at 99 refreshes e stored at 0, so the iteration at 101 still finds it."""
    stored_ts, get_now, get_access, it_now, it_access, want = {
        "event-time-late-record": (50, 140, 30, 140, 30, []),
        "wall-clock-moves": (0, 99, 99, 101, 101, [("e", "x")]),
    }[case]
    lane = Lane(tmp_path / "db")
    try:
        lane.submit(request(lane.m, T.MAP_PUT, (ENTRY, TtlValue(stored_ts, to_stored("x", "m"))),
                            "k"))
        lane.settle()
        batch = lane.submit(
            request(lane.m, T.MAP_GET, TtlRead(POLICY, get_now, get_access, ENTRY), "k"),
            request(lane.m, T.MAP_ITER, TtlRead(POLICY, it_now, it_access, None), "k"),
            request(lane.m, T.MAP_PUT, (ENTRY, TtlValue(it_access, to_stored("y", "m"))), "k"))
        lane.settle()
        got = lane.results[id(batch)]
        assert got[0] == "x"
        assert got[1].items == want
    finally:
        lane.close()


def test_iteration_before_a_write_sees_a_refresh_an_earlier_batch_kept_back(
        tmp_path: Path) -> None:
    lane = Lane(tmp_path / "db")
    try:
        lane.submit(request(lane.m, T.MAP_PUT, (ENTRY, TtlValue(0, to_stored("x", "m"))), "k"))
        lane.settle()
        a = lane.submit(request(lane.m, T.MAP_GET, TtlRead(POLICY, 99, 99, ENTRY), "k"))
        lane.settle()
        assert lane.results[id(a)] == ["x"]
        assert lane.backend._handles["m"].refreshes  # kept back
        b = lane.submit(
            request(lane.m, T.MAP_ITER, TtlRead(POLICY, 101, 101, None), "k"),
            request(lane.m, T.MAP_PUT, (ENTRY, TtlValue(101, to_stored("y", "m"))), "k"))
        lane.settle()
        assert lane.results[id(b)][0].items == [("e", "x")]  # refreshed at 99: lives to 199
    finally:
        lane.close()


def _damage(lane: Lane, key: str) -> tuple[Any, bytes]:
    """Store bytes without a TTL header under `key` of state "v": a read of them fails."""
    handle = lane.backend._handles["v"]
    ctx = record_context(key)
    stored = lane.backend._kg_prefix[ctx.key_group] + ctx.key_bytes + canonical_key(None)
    handle.cf.put(stored, b"garbage-not-timestamped")
    return handle, stored


def test_a_job_failing_in_its_point_reads_shows_no_removal(tmp_path: Path) -> None:
    """The job's first read finds k expired (cleanup on read removes it), its second read
    fails: the job's effects are never written, so k is still stored and must not be shown
    removed to later reads."""
    lane = Lane(tmp_path / "db")
    try:
        lane.submit(write(lane, T.VALUE_GET, "k"))  # at 0: expires at 100
        lane.settle()
        handle, stored = _damage(lane, "k2")
        batch = lane.submit(read(lane, T.VALUE_GET, "k", 150), read(lane, T.VALUE_GET, "k2", 150))
        lane.settle()
        assert isinstance(lane.results[id(batch)], Exception)
        assert not lane.backend._ttl.shown
        assert not handle.refreshes
        handle.cf.delete(stored)
        # k, written at 0, is stored: an incremental cleanup step at 50 passes it over (it
        # read it as removed before), and a read at 60 finds it alive.
        lane.clean("incremental", "v", 0)
        lane.remove("incremental", "v", 50, None)
        lane.settle()
        lane.hold()
        c = lane.submit(read(lane, T.VALUE_GET, "k", 60, POLICY))
        lane.settle()
        assert lane.results[id(c)] == ["x"]
    finally:
        lane.close()
