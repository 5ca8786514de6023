"""The TTL cleanup strategies: on read (in test_ttl.py's matrix), full snapshot, incremental
(heap and RocksDB), RocksDB's background cleaner and cleanup with timers (more of it in
test_ttl_timers.py). Every count here is of what the backend
stores, not of what reads return."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from ttl_harness import NOTHING, At, Steps, advance, play, stored_entries
from ttl_harness import operator as make_operator

import asyncstate as ast
from asyncstate.backends.rocksdb_cleaner import scan
from asyncstate.checkpoint.reader import open_checkpoint

KEYS = 24


def _config(**options: Any) -> ast.StateTtlConfig:
    builder = ast.StateTtlConfig.new_builder(100).disable_cleanup_in_background()
    if "incremental" in options:
        builder.cleanup_incrementally(*options["incremental"])
    if "compact" in options:
        builder.cleanup_in_rocksdb_compact_filter(options["compact"])
    if options.get("snapshot"):
        builder.cleanup_full_snapshot()
    if "timers" in options:
        builder.cleanup_with_timers(options["timers"])
    if options.get("event_time"):
        builder.use_event_time()
    if options.get("background"):
        builder = ast.StateTtlConfig.new_builder(100)  # the defaults: cleanup in background
    return builder.build()


def _fill(s: Any, ctx: Any) -> Any:
    async def go() -> Any:
        # One key's value, a list of two and a map of two: five stored entries.
        await s.v.update(ctx.current_key)
        await s.l.add_all([1, 2])
        await s.m.put_all({"a": 1, "b": 2})
        return NOTHING
    return go()


def _function(config: ast.StateTtlConfig) -> Steps:
    return Steps(v=ast.ValueStateDescriptor("v", ttl=config),
                 l=ast.ListStateDescriptor("l", ttl=config),
                 m=ast.MapStateDescriptor("m", ttl=config),
                 other=ast.ValueStateDescriptor("other"))


def _counts(backend: Any) -> int:
    return sum(stored_entries(backend, name) for name in ("v", "l", "m"))


async def _fill_keys(op: ast.KeyedOperator, time: int, keys: range) -> None:
    await advance(op, time, False)
    for key in keys:
        await op.process((key, _fill, time))
    await op.drain()


async def _touch_other(s: Any, ctx: Any) -> Any:
    await s.other.update(1)  # a record that never touches the TTL states
    return NOTHING


# -- incremental ----------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["heap", "rocksdb", "remote0-rocksdb"], indirect=True)
async def test_incremental_cleanup_per_record_drives_never_read_keys_to_zero(backend):
    fn = _function(_config(incremental=(3, True)))
    async with make_operator(fn, backend) as op:
        await _fill_keys(op, 0, range(KEYS))
        await _fill_keys(op, 50, range(KEYS, KEYS + 2))  # not expired at 120
        assert _counts(backend) == 5 * (KEYS + 2)
        await advance(op, 120, False)
        seen = [_counts(backend)]
        for _ in range(200):  # bounded: each record checks 3 entries of each state
            await op.process(("other", _touch_other, 120))
            await op.drain()
            seen.append(_counts(backend))
            if seen[-1] == 10:
                break
        assert seen[-1] == 10  # only the two keys written at 50 are left
        assert seen == sorted(seen, reverse=True)
        # Steps of 3 entries: never everything at once (the cursor moves on across records).
        assert len(seen) > 3


@pytest.mark.parametrize("backend", ["heap", "rocksdb"], indirect=True)
async def test_incremental_cleanup_per_access_removes_at_most_the_cleanup_size(backend):
    config = _config(incremental=(2, False))
    fn = Steps(v=ast.ValueStateDescriptor("v", ttl=config))

    async def write(s: Any, ctx: Any) -> Any:
        await s.v.update(1)
        return NOTHING

    async def read(s: Any, ctx: Any) -> Any:
        return await s.v.value()

    async with make_operator(fn, backend) as op:
        await play(op, [At(0, write, key=k) for k in range(10)])
        await play(op, [At(500, write, key="fresh")])  # an access too: two of ten go
        seen = [stored_entries(backend, "v")]
        for _ in range(20):  # bounded
            # A read of the fresh key: one access, a step over two entries.
            assert await play(op, [At(500, read, key="fresh")]) == [1]
            seen.append(stored_entries(backend, "v"))
            if seen[-1] == 1:
                break
        assert seen[0] == 9 and seen[-1] == 1
        assert all(0 <= a - b <= 2 for a, b in itertools.pairwise(seen))


@pytest.mark.parametrize("backend", ["heap", "rocksdb"], indirect=True)
async def test_incremental_cleanup_leaves_entries_that_have_not_expired(backend):
    fn = _function(_config(incremental=(50, True)))
    async with make_operator(fn, backend) as op:
        await _fill_keys(op, 0, range(5))
        await advance(op, 99, False)
        for _ in range(5):
            await op.process(("other", _touch_other, 99))
        await op.drain()
        assert _counts(backend) == 25


@pytest.mark.parametrize("backend", ["rocksdb"], indirect=True)
async def test_incremental_cleanup_leaves_the_directory_free_when_closed(backend, tmp_path):
    # Its cursor is a remembered key: no iterator is left open to keep RocksDB's lock.
    fn = _function(_config(incremental=(2, True)))
    async with make_operator(fn, backend) as op:
        await _fill_keys(op, 0, range(6))
        await advance(op, 200, False)
        await op.process(("other", _touch_other, 200))
        await op.drain()
        assert 0 < _counts(backend) < 30
    again = ast.RocksDBBackend(backend.path)
    again.close()


# -- RocksDB's background cleaner ----------------------------------------------------------

@pytest.mark.parametrize("backend", ["rocksdb", "remote0-rocksdb"], indirect=True)
@pytest.mark.parametrize("config", [_config(compact=7), _config(background=True)],
                         ids=["compact-filter", "default-background"])
async def test_background_cleaner_drives_never_read_keys_to_zero(backend, config):
    fn = _function(config)
    store = backend.inner if isinstance(backend, ast.SimulatedRemoteBackend) else backend
    async with make_operator(fn, backend) as op:
        await _fill_keys(op, 0, range(KEYS))
        await _fill_keys(op, 60, range(KEYS, KEYS + 3))
        await store.wait_ttl_cleaner_idle()
        assert _counts(backend) == 5 * (KEYS + 3)  # nothing had expired
        await advance(op, 120, False)
        # A batch starts the cleaner; it goes on by itself until nothing more can expire.
        await op.process(("other", _touch_other, 120))
        await op.drain()
        await store.wait_ttl_cleaner_idle()
        assert _counts(backend) == 15
        await advance(op, 200, False)
        await store.wait_ttl_cleaner_idle()
        assert _counts(backend) == 0


@pytest.mark.parametrize("backend", ["rocksdb"], indirect=True)
async def test_background_cleaner_goes_over_a_state_in_several_slices(backend):
    config = _config(compact=100)
    fn = Steps(v=ast.ValueStateDescriptor("v", ttl=config))

    async def fill(s: Any, ctx: Any) -> Any:
        await s.v.update(1)
        return NOTHING

    async with make_operator(fn, backend) as op:
        for key in range(2_500):  # more than two slices of 1000 entries
            await op.process((key, fill, 0))
        await op.drain()
        await advance(op, 100, False)
        await backend.wait_ttl_cleaner_idle()
        assert stored_entries(backend, "v") == 0


@pytest.mark.parametrize("backend", ["rocksdb"], indirect=True)
async def test_a_value_rewritten_while_the_cleaners_removal_is_in_flight_survives(backend):
    # The cleaner scans a slice and finds two expired keys; one of them is written again
    # before the removal reaches the lane. The removal reads each key again: the rewritten
    # one has a fresh timestamp and stays, the other goes.
    config = _config(compact=1)
    fn = Steps(v=ast.ValueStateDescriptor("v", ttl=config))

    def write(value: Any) -> Any:
        async def step(s: Any, ctx: Any) -> Any:
            await s.v.update(value)
            return NOTHING
        return step

    async def read(s: Any, ctx: Any) -> Any:
        return await s.v.value()

    async with make_operator(fn, backend) as op:
        await play(op, [At(0, write("old"), key="rewritten"), At(0, write("old"), key="idle")])
        await op.advance_processing_time(150)
        cleaner = backend._cleaner
        piece = cleaner.next_slice("v")
        assert piece is not None
        scan(piece)  # what the cleaner's thread does
        assert len(piece.candidates) == 2
        assert await play(op, [At(150, write("new"), key="rewritten")]) == []
        cleaner.submit(piece)  # the removal, in the lane after the rewrite
        await backend.wait_ttl_cleaner_idle()
        assert stored_entries(backend, "v") == 1
        assert await play(op, [At(240, read, key="rewritten"), At(240, read, key="idle")]) \
            == ["new", None]


@pytest.mark.parametrize("backend", ["rocksdb"], indirect=True)
async def test_background_cleaner_keeps_the_bound_and_stops_while_nothing_can_expire(backend):
    config = _config(compact=1)
    fn = Steps(v=ast.ValueStateDescriptor("v", ttl=config))

    async def write(s: Any, ctx: Any) -> Any:
        await s.v.update(1)
        return NOTHING

    async with make_operator(fn, backend) as op:
        await play(op, [At(0, write, key=k) for k in range(5)])
        await advance(op, 50, False)
        await backend.wait_ttl_cleaner_idle()
        # Written at 0 with ttl 100: nothing can expire before 100, so no slice is due.
        assert backend._cleaner.next_slice("v") is None
        await advance(op, 100, False)
        assert backend._cleaner.next_slice("v") is not None


# -- cleanup with timers ----------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["heap", "rocksdb", "remote0-rocksdb"], indirect=True)
@pytest.mark.parametrize("event_time", [False, True], ids=["processing", "event"])
async def test_cleanup_with_timers_drives_never_read_keys_to_zero(backend, event_time):
    # Only time moves after the writes: no record, no read, no other strategy.
    fn = _function(_config(timers=10, event_time=event_time))
    async with make_operator(fn, backend, event_time=event_time) as op:
        await play(op, [At(0, _fill, key=k) for k in range(KEYS)], event_time=event_time)
        await play(op, [At(50, _fill, key=k) for k in range(KEYS, KEYS + 2)],
                   event_time=event_time)
        assert _counts(backend) == 5 * (KEYS + 2)
        await advance(op, 99, event_time)
        assert _counts(backend) == 5 * (KEYS + 2)
        await advance(op, 100, event_time)  # expirations at 100, a multiple of 10
        assert _counts(backend) == 10
        await advance(op, 150, event_time)
        assert _counts(backend) == 0


# -- full snapshot ---------------------------------------------------------------------------

def _checkpoint_entries(path: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    checkpoint = open_checkpoint(path)
    for _kg, records in checkpoint.read_key_group_lists(
            ast.KeyGroupRange(0, checkpoint.max_parallelism - 1)):
        for record in records:
            if isinstance(record, list) and len(record) == 4:
                data = record[3]
                counts[record[0]] = counts.get(record[0], 0) + \
                    (len(data) if isinstance(data, list) else 1)
    return counts


@pytest.mark.parametrize("backend", ["heap", "rocksdb"], indirect=True)
@pytest.mark.parametrize("full_snapshot", [True, False], ids=["filtered", "unfiltered"])
async def test_full_snapshot_cleanup_leaves_expired_entries_out_of_the_checkpoint(
        backend, tmp_path, full_snapshot):
    fn = _function(_config(snapshot=full_snapshot))
    async with make_operator(fn, backend) as op:
        await _fill_keys(op, 0, range(4))
        await _fill_keys(op, 60, range(4, 6))
        await advance(op, 120, False)
        path = await op.snapshot(tmp_path / "chk", 1)
        assert _counts(backend) == 30  # the backend keeps them: only the checkpoint is filtered
    expected = {"v": 2, "l": 4, "m": 4} if full_snapshot else {"v": 6, "l": 12, "m": 12}
    assert _checkpoint_entries(path) == expected
    assert open_checkpoint(path).state_ttl == {name: "processing_time" for name in "vlm"}
