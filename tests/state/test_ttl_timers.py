"""Cleanup with timers (strategy 5): entries removed when their cleanup timer fires, on the
heap and on RocksDB, in processing and event time; refreshes, user timers beside cleanup
timers, the bound on pending timers, checkpoints and rescaling, a model. Every count is of
what the backend stores, not of what reads return."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shared_functions import LOOP_NAMES, Boom, Sum, run_on_loop, slow_examples
from ttl_harness import NOTHING, At, Steps, advance, play, stored_entries
from ttl_harness import operator as make_operator

import asyncstate as ast

TTL = 100
BACKENDS = pytest.mark.parametrize("backend", ["heap", "rocksdb"], indirect=True)
TIME = pytest.mark.parametrize("event_time", [False, True], ids=["processing", "event"])


def _config(*, event_time: bool = False, refresh: bool = False,
            granularity: int | None = 1, timers: bool = True) -> ast.StateTtlConfig:
    builder = ast.StateTtlConfig.new_builder(TTL).disable_cleanup_in_background()
    if event_time:
        builder.use_event_time()
    if refresh:
        builder.update_ttl_on_read_and_write()
    if timers:
        builder.cleanup_with_timers(granularity)
    return builder.build()


def _function(config: ast.StateTtlConfig) -> Steps:
    return Steps(v=ast.ValueStateDescriptor("v", ttl=config),
                 l=ast.ListStateDescriptor("l", ttl=config),
                 m=ast.MapStateDescriptor("m", ttl=config),
                 r=ast.ReducingStateDescriptor("r", lambda a, b: a + b, ttl=config))


def _count(backend: Any, names: str = "vlmr") -> int:
    return sum(stored_entries(backend, name) for name in names)


async def _fill(s: Any, ctx: Any) -> Any:
    await s.v.update(ctx.current_key)
    await s.l.add(1)
    await s.m.put(ctx.record[2], 1)  # a map entry per write time
    await s.r.add(1)
    return NOTHING


async def _add(s: Any, ctx: Any) -> Any:
    await s.l.add(2)
    await s.m.put(ctx.record[2], 2)
    return NOTHING


async def _rewrite(s: Any, ctx: Any) -> Any:
    await s.v.update("again")
    return NOTHING


async def _read(s: Any, ctx: Any) -> Any:
    return await s.v.value()


# -- the config ----------------------------------------------------------------------------------

def test_cleanup_with_timers_is_opt_in_checked_and_part_of_a_frozen_config():
    plain = ast.StateTtlConfig.new_builder(5).build()
    assert plain.timer_cleanup is None and plain.effective_timer_cleanup() is None
    config = ast.StateTtlConfig.new_builder(5).cleanup_with_timers().build()
    assert config.effective_timer_cleanup().granularity_ms == 1  # ttl_ms // 16, at least 1
    assert config == ast.StateTtlConfig.new_builder(5).cleanup_with_timers().build()
    assert hash(config) != hash(plain)
    # Named, it runs with cleanup in background off too.
    off = ast.StateTtlConfig.new_builder(5).disable_cleanup_in_background() \
        .cleanup_with_timers(3).build()
    assert off.effective_timer_cleanup().granularity_ms == 3
    for bad in (0, -1, 1.5, True, "1"):
        with pytest.raises(ast.ConfigError, match=r"^granularity_ms"):
            ast.StateTtlConfig.new_builder(5).cleanup_with_timers(bad)


# -- removal at expiry, with only time moving -------------------------------------------------

@BACKENDS
@TIME
async def test_entries_go_at_expiry_with_only_time_advancing(backend, event_time):
    fn = _function(_config(event_time=event_time))
    async with make_operator(fn, backend, event_time=event_time) as op:
        await play(op, [At(0, _fill, key=k) for k in range(6)], event_time=event_time)
        # Two more elements of key 0's list and map, written later: they expire later.
        await play(op, [At(40, _add, key=0)], event_time=event_time)
        assert _count(backend) == 4 * 6 + 2
        await advance(op, 99, event_time)
        assert _count(backend) == 4 * 6 + 2
        await advance(op, 100, event_time)
        # Elements and map entries expire one by one: key 0's of time 40 are left.
        assert (_count(backend), stored_entries(backend, "l"),
                stored_entries(backend, "m")) == (2, 1, 1)
        await advance(op, 140, event_time)
        assert _count(backend) == 0
        assert op.outputs() == []


@BACKENDS
@TIME
async def test_each_element_goes_at_its_own_expiry_not_at_an_earlier_ones_timer(
        backend, event_time):
    fn = _function(_config(event_time=event_time))
    async with make_operator(fn, backend, event_time=event_time) as op:
        await play(op, [At(0, _add), At(2, _add)], event_time=event_time)
        await advance(op, 100, event_time)  # the timer of the element of 0 fires
        assert _count(backend, "lm") == 2
        await advance(op, 101, event_time)
        assert _count(backend, "lm") == 2
        await advance(op, 102, event_time)
        assert _count(backend, "lm") == 0


@pytest.mark.parametrize("backend", ["heap", "rocksdb", "remote1", "rocksdb-cache"],
                         indirect=True)
async def test_a_firing_reads_a_list_and_a_map_to_their_end_chunk_by_chunk(backend):
    # Event time, records out of order: elements (and map entries) of timestamps 50 and 0
    # alternate, 3 to a chunk, so expired ones sit in every chunk. A firing at a real round
    # trip per batch (remote1) is waited for by the advance too.
    fn = _function(_config(event_time=True))

    async def add(s: Any, ctx: Any) -> Any:
        i = ctx.record[3]
        await s.l.add(i)
        await s.m.put(f"{i:02}-{ctx.timestamp}", i)
        return NOTHING

    async def iterate(s: Any, ctx: Any) -> Any:
        return (await (await s.l.get()).to_list(), len(await (await s.m.keys()).to_list()))

    async with make_operator(fn, backend, event_time=True,
                             config=ast.AsyncStateConfig(iterator_chunk_size=3)) as op:
        await advance(op, 0, True)
        for i in range(20):
            await op.process(("k", add, 50 if i % 2 == 0 else 0, i))
        await op.drain()
        assert _count(backend, "lm") == 40
        await advance(op, 100, True)
        assert _count(backend, "lm") == 20
        assert await play(op, [At(100, iterate)], event_time=True) == \
            [(list(range(0, 20, 2)), 10)]
        await advance(op, 150, True)
        assert _count(backend, "lm") == 0


@BACKENDS
async def test_removal_is_late_by_less_than_the_granularity(backend):
    # ttl 100, granularity 16: an entry written at 5 expires at 105, its timer is at 112.
    fn = _function(_config(granularity=16))
    async with make_operator(fn, backend) as op:
        await play(op, [At(5, _fill, key="a")])
        await advance(op, 111, False)
        assert _count(backend) == 4  # expired, hidden from reads, still stored
        assert await play(op, [At(111, _read, key="b")]) == [None]
        await advance(op, 112, False)
        assert _count(backend) == 0


@BACKENDS
async def test_the_default_granularity_is_a_sixteenth_of_the_ttl(backend):
    config = ast.StateTtlConfig.new_builder(1600).disable_cleanup_in_background() \
        .cleanup_with_timers().build()
    assert config.effective_timer_cleanup() == ast.StateTtlConfig.new_builder(1600) \
        .cleanup_with_timers(100).build().timer_cleanup
    fn = Steps(v=ast.ValueStateDescriptor("v", ttl=config))

    async def write(s: Any, ctx: Any) -> Any:
        await s.v.update(1)
        return NOTHING

    async with make_operator(fn, backend) as op:
        await play(op, [At(1, write)])  # expires at 1601, timer at 1700
        await advance(op, 1699, False)
        assert stored_entries(backend, "v") == 1
        await advance(op, 1700, False)
        assert stored_entries(backend, "v") == 0


@pytest.mark.parametrize("backend", ["heap", "rocksdb", "remote0"], indirect=True)
@TIME
async def test_an_add_registers_its_cleanup_timer_in_the_namespace_it_was_called_in(
        backend, event_time):
    # A reducing or aggregating add writes once its own read is answered; the record has
    # moved to another namespace by then, and the timer must still cover the namespace the
    # add was called in (as the write itself does).
    config = _config(event_time=event_time)
    fn = Steps(r=ast.ReducingStateDescriptor("r", lambda a, b: a + b, ttl=config),
               a=ast.AggregatingStateDescriptor("a", Sum(), ttl=config))

    async def add(s: Any, ctx: Any) -> Any:
        for state in (s.r, s.a):
            state.set_current_namespace("window-1")
        # The second add of r waits for the first.
        pending = [s.r.add(1), s.a.add(1), s.r.add(2)]
        for state in (s.r, s.a):
            state.set_current_namespace(None)
        for fut in pending:
            await fut
        return NOTHING

    async with make_operator(fn, backend, event_time=event_time) as op:
        await play(op, [At(0, add)], event_time=event_time)
        assert _count(backend, "ra") == 2
        await advance(op, 100, event_time)
        assert _count(backend, "ra") == 0


# -- refreshed entries -------------------------------------------------------------------------

@BACKENDS
@TIME
@pytest.mark.parametrize("how", ["read", "rewrite"])
async def test_a_refreshed_entry_outlives_its_first_timer_and_goes_at_its_new_expiry(
        backend, event_time, how):
    fn = _function(_config(event_time=event_time, refresh=how == "read"))
    refresh = _read if how == "read" else _rewrite
    async with make_operator(fn, backend, event_time=event_time) as op:
        await play(op, [At(0, _fill, key="k")], event_time=event_time)
        out = await play(op, [At(60, refresh, key="k")], event_time=event_time)
        assert out == (["k"] if how == "read" else [])
        await advance(op, 100, event_time)  # the first timer fires: v stays
        assert stored_entries(backend, "v") == 1
        assert _count(backend, "lmr") == 0  # not refreshed: gone
        await advance(op, 159, event_time)
        assert stored_entries(backend, "v") == 1
        await advance(op, 160, event_time)
        assert stored_entries(backend, "v") == 0


# -- the operator's own timers beside the user's -----------------------------------------------

class WithTimers(ast.KeyedProcessFunction):
    """Writes a TTL value and registers a user timer at the same time as its cleanup timer
    (processing time) and one in a namespace; records every on_timer call."""

    def __init__(self, config: ast.StateTtlConfig) -> None:
        self.config = config
        self.fired: list[Any] = []

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.v = ctx.get_state(ast.ValueStateDescriptor("v", ttl=self.config))

    async def process_element(self, record: Any, ctx: ast.RecordContext) -> None:
        await self.v.update(record[1])
        now = ctx.timer_service.current_processing_time()
        ctx.timer_service.register_processing_time_timer(now + TTL)
        ctx.timer_service.register_processing_time_timer(now + TTL, "ttl")

    async def on_timer(self, timestamp: int, ctx: ast.RecordContext) -> None:
        self.fired.append((ctx.current_key, timestamp, ctx.timer_namespace,
                           await self.v.value()))


@BACKENDS
async def test_cleanup_timers_never_call_on_timer_and_user_timers_still_fire(backend):
    fn = WithTimers(_config())
    async with make_operator(fn, backend) as op:
        for key in ("a", "b"):
            await op.process((key, 1))
        await op.drain()
        await op.advance_processing_time(100)
        assert stored_entries(backend, "v") == 0
    # Only the user's timers, each once: the cleanup timers at 100 went to TTL.
    assert sorted(fn.fired, key=repr) == [("a", 100, "ttl", None), ("a", 100, None, None),
                                          ("b", 100, "ttl", None), ("b", 100, None, None)]


@BACKENDS
async def test_a_function_without_on_timer_can_use_cleanup_with_timers(backend):
    fn = Steps(v=ast.ValueStateDescriptor("v", ttl=_config()))
    assert not hasattr(fn, "on_timer")

    async def write(s: Any, ctx: Any) -> Any:
        await s.v.update(1)
        return NOTHING

    async with make_operator(fn, backend) as op:
        await play(op, [At(0, write, key=k) for k in range(3)])
        await advance(op, 100, False)
        assert stored_entries(backend, "v") == 0


# -- bounded timers ------------------------------------------------------------------------------

def _pending(op: ast.KeyedOperator) -> int:
    service = op._timers
    assert service is not None
    return len(service._processing) + len(service._event)


@BACKENDS
@pytest.mark.parametrize("granularity", [1, 10, None])
async def test_a_key_written_every_millisecond_holds_a_bounded_number_of_timers(
        backend, granularity):
    fn = Steps(v=ast.ValueStateDescriptor("v", ttl=_config(granularity=granularity)))
    step = granularity or TTL // 16

    async def write(s: Any, ctx: Any) -> Any:
        await s.v.update(ctx.record[2])
        return NOTHING

    async with make_operator(fn, backend) as op:
        most = 0
        for t in range(0, 400):
            await play(op, [At(t, write)])
            most = max(most, _pending(op))
        assert most <= TTL // step + 2
        await advance(op, 399 + TTL + step, False)
        assert _pending(op) == 0 and stored_entries(backend, "v") == 0


# -- checkpoints, rescaling, and restores without cleanup timers --------------------------------

async def _write(s: Any, ctx: Any) -> Any:
    await s.v.update(ctx.current_key)
    await s.l.add(ctx.current_key)
    return NOTHING


KEYS = range(24)


def _backend(kind: str, directory: Path) -> Any:
    if kind == "heap":
        return ast.HeapBackend()
    directory.mkdir(parents=True, exist_ok=True)
    return ast.RocksDBBackend(str(directory / f"db-{len(list(directory.iterdir()))}"))


def _operators(kind: str, tmp_path: Path, config: ast.StateTtlConfig, parallelism: int,
               start: int, event_time: bool, restore_from: str | None = None
               ) -> list[ast.KeyedOperator]:
    return [ast.KeyedOperator(
        Steps(v=ast.ValueStateDescriptor("v", ttl=config),
              l=ast.ListStateDescriptor("l", ttl=config)),
        key_selector=lambda r: r[0], backend=_backend(kind, tmp_path / "dbs"),
        timestamp_selector=(lambda r: r[2]) if event_time else None,
        clock=ast.ManualClock(start), parallelism=parallelism, operator_index=i,
        restore_from=restore_from) for i in range(parallelism)]


def _owned(op: ast.KeyedOperator, keys: range) -> list[int]:
    return [k for k in keys if ast.assign_to_key_group(k, 128) in op.key_group_range]


@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
@TIME
async def test_cleanup_timers_survive_a_checkpoint_and_a_rescale_from_two_to_three(
        kind, tmp_path, event_time):
    config = _config(event_time=event_time)
    path = ""
    for op in _operators(kind, tmp_path, config, 2, 0, event_time):
        async with op:
            await play(op, [At(0, _write, key=k) for k in _owned(op, KEYS)],
                       event_time=event_time)
            await advance(op, 10, event_time)
            path = await op.snapshot(tmp_path / "chk", 1)
    counts = []
    for op in _operators(kind, tmp_path, config, 3, 10, event_time, path):
        async with op:
            owned = _owned(op, KEYS)
            assert owned
            await advance(op, 99, event_time)
            before = _count(op.backend, "vl")
            await advance(op, 100, event_time)
            counts.append((before, _count(op.backend, "vl"), len(owned)))
    assert [(before, after) for before, after, _ in counts] == \
        [(2 * n, 0) for _, _, n in counts]


@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
async def test_after_a_restore_without_cleanup_timers_entries_get_one_when_written_again(
        kind, tmp_path):
    # The checkpoint was written without strategy 5: its entries have no cleanup timer.
    ops = _operators(kind, tmp_path, _config(timers=False), 1, 0, False)
    async with ops[0] as op:
        await play(op, [At(0, _write, key=k) for k in range(4)])
        path = await op.snapshot(tmp_path / "chk", 1)
    ops = _operators(kind, tmp_path, _config(), 1, 0, False, path)
    async with ops[0] as op:
        await play(op, [At(20, _write, key=k) for k in (0, 1)])  # timers at 120
        await advance(op, 120, False)
        # The keys written again are gone; the two others are kept until something else
        # (here a read: cleanup on read) removes them.
        assert _count(op.backend, "vl") == 4
        assert await play(op, [At(120, _read, key=k) for k in (2, 3)]) == [None, None]
        assert _count(op.backend, "vl") == 2  # the reads removed the values, not the lists


@BACKENDS
async def test_timers_of_a_state_declared_without_cleanup_timers_after_a_restore_do_nothing(
        backend, tmp_path):
    async with make_operator(_function(_config()), ast.HeapBackend()) as op:
        await play(op, [At(0, _fill, key=k) for k in range(3)])
        path = await op.snapshot(tmp_path / "chk", 1)
    fn = _function(_config(timers=False))
    async with make_operator(fn, backend, restore_from=path) as op:
        await advance(op, 200, False)  # the restored cleanup timers fire, and do nothing
        assert _count(backend) == 12
        assert _pending(op) == 0


# -- against a model -----------------------------------------------------------------------------

KEYS_M = [0, 1, 2]
MAX_TIME = 2**63 - 1
_op = st.one_of(
    st.one_of(
        st.tuples(st.just("set"), st.sampled_from(KEYS_M)),
        st.tuples(st.just("add"), st.sampled_from(KEYS_M)),
        st.tuples(st.just("put"), st.sampled_from(KEYS_M), st.sampled_from("ab")),
        st.tuples(st.just("read"), st.sampled_from(KEYS_M)),
    ),
    # Time moves as often as records come. Small steps too: entries of one key expiring a
    # few milliseconds apart. And to one millisecond before, at or after a boundary still
    # ahead (the `i`-th of them, wrapping around): when something stored expires or its
    # cleanup timer is due, where a timer one step early or late shows.
    st.one_of(
        st.tuples(st.just("advance"), st.one_of(st.integers(1, 4), st.integers(1, 70))),
        st.tuples(st.just("boundary"), st.integers(0, 2), st.sampled_from([0, -1, 0, 1])),
    ),
)


def _due(access: int, granularity: int) -> int:
    """When the cleanup timer of an entry stamped `access` fires (docs/ttl.md, cleanup with
    timers): its expiration, access + ttl clamped to 2**63 - 1, rounded up to a multiple of
    the granularity, clamped again."""
    expires = min(access + TTL, MAX_TIME)
    return min((expires + granularity - 1) // granularity * granularity, MAX_TIME)


def _moved(now: int, op: tuple[Any, ...], stored: dict[Any, int], granularity: int) -> int:
    """The time an "advance" or "boundary" op moves time to (never backwards)."""
    if op[0] == "advance":
        return now + op[1]
    _, i, offset = op
    ahead = sorted({b + offset for t in stored.values() for b in (t + TTL, _due(t, granularity))
                    if b + offset > now})
    return ahead[i % len(ahead)] if ahead else now


async def _model_step(s: Any, ctx: Any) -> Any:
    op = ctx.record[3]
    if op[0] == "set":
        await s.v.update(1)
    elif op[0] == "add":
        await s.l.add(1)
    elif op[0] == "put":
        await s.m.put(op[2], 1)
    else:
        await s.v.value()
        await (await s.l.get()).to_list()
        await (await s.m.entries()).to_list()
    return NOTHING


async def _failing_step(s: Any, ctx: Any) -> Any:
    await s.v.update(1)
    raise ctx.record[3]


async def _play_model(backend: Any, ops: list[tuple[Any, ...]], event_time: bool,
                      refresh: bool, granularity: int | None, fail: bool) -> None:
    config = _config(event_time=event_time, refresh=refresh, granularity=granularity)
    step = granularity or max(TTL // 16, 1)  # the default granularity (docs/ttl.md)
    fn = Steps(v=ast.ValueStateDescriptor("v", ttl=config),
               l=ast.ListStateDescriptor("l", ttl=config),
               m=ast.MapStateDescriptor("m", ttl=config))
    now = 0
    # (state, key, element) -> access time of what is stored
    stored: dict[tuple[Any, ...], int] = {}
    lists = 0
    failure = Boom("the last record fails")
    try:
        async with make_operator(fn, backend, event_time=event_time) as op:
            await advance(op, 0, event_time)
            for op_ in ops:
                kind, key = op_[0], op_[1]
                if kind in ("advance", "boundary"):
                    now = _moved(now, op_, stored, step)
                    await advance(op, now, event_time)
                    stored = {k: t for k, t in stored.items() if _due(t, step) > now}
                    assert _count(backend, "vlm") == len(stored), (op_, stored)
                    continue
                await op.process((key, _model_step, now, op_))
                await op.drain()
                if kind == "set":
                    stored["v", key] = now
                elif kind == "add":
                    lists += 1
                    stored["l", key, lists] = now
                elif kind == "put":
                    stored["m", key, op_[2]] = now
                else:  # every read removes what has expired, refreshes the rest with refresh
                    for slot, t in list(stored.items()):
                        if slot[1] != key:
                            continue
                        if t + TTL <= now:
                            del stored[slot]
                        elif refresh:
                            stored[slot] = now
            if fail:
                # The run ends with a record that writes and then fails, and an advance far
                # past every cleanup timer asked for before that record ran: the advance
                # raises that record's exception, and no cleanup firing starts after it.
                await op.process((0, _failing_step, now, failure))
                with pytest.raises(Boom) as raised:
                    if event_time:
                        await op.advance_watermark(now + 2 * TTL)
                    else:
                        await op.advance_processing_time(now + 2 * TTL)
                assert raised.value is failure
                stored["v", 0] = now  # what the failing record wrote before it raised
                assert _count(backend, "vlm") == len(stored), stored
    except Boom as exc:
        assert fail and exc is failure  # the exit of `async with` raises it once more
    else:
        assert not fail, "the exit of the failed run raised nothing"


def _check(backend_factory: Any, ops: list[tuple[Any, ...]], modes: tuple[bool, bool, bool],
           granularity: int | None, loop: str) -> None:
    event_time, refresh, fail = modes
    with tempfile.TemporaryDirectory(prefix="asyncstate-ttl-timers-") as tmp:
        run_on_loop(loop, _play_model(backend_factory(Path(tmp)), list(ops), event_time,
                                      refresh, granularity, fail))


# (event time, refresh on read, the run ends with a failing record)
_modes = st.tuples(st.booleans(), st.booleans(), st.booleans())
_granularity = st.sampled_from([1, 7, None])
# Each example runs on an event loop it draws: both loops, at the cost of one.
_loops = st.sampled_from(LOOP_NAMES)
# Lists of at least 6 ops: hypothesis' lists average 5 items when none is required, too few
# for time to reach what the records stored.


@settings(max_examples=slow_examples(40))
@given(ops=st.lists(_op, min_size=6, max_size=40), modes=_modes, granularity=_granularity,
       loop=_loops)
def test_heap_stores_what_the_model_has_not_cleaned_up(ops, modes, granularity, loop):
    _check(lambda path: ast.HeapBackend(), ops, modes, granularity, loop)


@settings(max_examples=slow_examples(15))
@given(ops=st.lists(_op, min_size=6, max_size=30), modes=_modes, granularity=_granularity,
       loop=_loops)
def test_rocksdb_stores_what_the_model_has_not_cleaned_up(ops, modes, granularity, loop):
    _check(lambda path: ast.RocksDBBackend(str(path / "db")), ops, modes, granularity, loop)
