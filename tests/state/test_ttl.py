"""State TTL semantics: every state type x update type x visibility x time characteristic on
the heap, a slice of it on RocksDB and the batched heap, and the rules around them (the
expiry boundary, elements and entries expiring one by one, event time, request order)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from shared_functions import Sum, new_backend
from ttl_harness import NOTHING, At, Steps, advance, play, run, stored_entries, ttl
from ttl_harness import operator as make_operator

import asyncstate as ast
from asyncstate.checkpoint.reader import open_checkpoint
from asyncstate.testing import ManualExecutor

U = ast.UpdateType
VIS = ast.StateVisibility
ON_CREATE, ON_READ, DISABLED = U.ON_CREATE_AND_WRITE, U.ON_READ_AND_WRITE, U.DISABLED
NEVER, RETURN = VIS.NEVER_RETURN_EXPIRED, VIS.RETURN_EXPIRED_IF_NOT_CLEANED_UP


async def _to_list(fut: Any) -> list[Any]:
    return list(await (await fut).to_list())


# Each kind: a descriptor factory, a write, a read, and what the read returns when the entry
# is there and when it is not.
KINDS: dict[str, tuple[Any, Any, Any, Any, Any]] = {
    "value": (lambda c: ast.ValueStateDescriptor("s", ttl=c),
              lambda s: s.update("a"), lambda s: s.value(), "a", None),
    "list": (lambda c: ast.ListStateDescriptor("s", ttl=c),
             lambda s: s.add("a"), lambda s: _to_list(s.get()), ["a"], []),
    "map": (lambda c: ast.MapStateDescriptor("s", ttl=c),
            lambda s: s.put("k", "a"), lambda s: s.get("k"), "a", None),
    "reducing": (lambda c: ast.ReducingStateDescriptor("s", lambda a, b: a + b, ttl=c),
                 lambda s: s.add(1), lambda s: s.get(), 1, None),
    "aggregating": (lambda c: ast.AggregatingStateDescriptor("s", Sum(), ttl=c),
                    lambda s: s.add(1), lambda s: s.get(), 1, None),
}

# Reads after a write at 0 with ttl 100: (time, whether the read returns the entry) for each
# (update type, visibility). A read at 120 finds the entry written at 0 expired unless a read
# at 60 refreshed it; RETURN_EXPIRED_IF_NOT_CLEANED_UP returns it once, and that read removes
# it. Refreshed at 120 and 130 (ON_READ_AND_WRITE), it has expired again at 300.
READ_TIMES = (60, 120, 130, 300, 301)
EXPECTED = {
    (ON_CREATE, NEVER): (True, False, False, False, False),
    (ON_CREATE, RETURN): (True, True, False, False, False),
    (ON_READ, NEVER): (True, True, True, False, False),
    (ON_READ, RETURN): (True, True, True, True, False),
    (DISABLED, NEVER): (True,) * 5,
    (DISABLED, RETURN): (True,) * 5,
}
MATRIX = list(itertools.product(KINDS, [ON_CREATE, ON_READ, DISABLED], [NEVER, RETURN],
                                [False, True]))


def _case_id(case: tuple[str, U, VIS, bool]) -> str:
    kind, update, visibility, event_time = case
    return (f"{kind}-{update.name.lower()}-{visibility.name.split('_')[0].lower()}-"
            f"{'event' if event_time else 'processing'}")


async def _check_case(backend: Any, kind: str, update: U, visibility: VIS,
                      event_time: bool) -> None:
    make, write, read, present, absent = KINDS[kind]
    config = ttl(100, update=update, visibility=visibility, event_time=event_time)

    async def do_write(s: Any, ctx: Any) -> Any:
        await write(s.s)
        return NOTHING

    async def do_read(s: Any, ctx: Any) -> Any:
        return await read(s.s)

    plan = [At(0, do_write)] + [At(t, do_read) for t in READ_TIMES]
    out, counts = await run(Steps(s=make(config)), backend, plan, event_time=event_time,
                            counts=["s"])
    assert out == [present if seen else absent for seen in EXPECTED[update, visibility]]
    # Cleanup on read: what a read found expired is gone from storage, not only hidden.
    assert counts["s"] == (1 if update is DISABLED else 0)


@pytest.mark.parametrize("backend", ["heap"], indirect=True)
@pytest.mark.parametrize("case", MATRIX, ids=_case_id)
async def test_matrix_on_the_heap(backend, case):
    await _check_case(backend, *case)


ROCKSDB_SLICE = [
    ("value", ON_CREATE, NEVER, False), ("value", ON_READ, RETURN, True),
    ("list", ON_READ, NEVER, False), ("list", ON_CREATE, RETURN, True),
    ("map", ON_CREATE, RETURN, False), ("map", ON_READ, NEVER, True),
    ("reducing", ON_READ, NEVER, False), ("aggregating", ON_CREATE, RETURN, True),
    ("value", DISABLED, NEVER, False),
]


@pytest.mark.parametrize("backend", ["rocksdb", "remote0"], indirect=True)
@pytest.mark.parametrize("case", ROCKSDB_SLICE, ids=_case_id)
async def test_matrix_slice_on_rocksdb_and_the_batched_heap(backend, case):
    await _check_case(backend, *case)


@pytest.mark.parametrize("backend", ["remote0-cache", "rocksdb-cache"], indirect=True)
@pytest.mark.parametrize("case", ROCKSDB_SLICE, ids=_case_id)
async def test_matrix_slice_behind_a_state_cache(backend, case):
    # A cache would answer a read from what it saw written, blind to expiry: TTL states
    # pass by it; with UpdateType.DISABLED the state is a plain one, and cached.
    await _check_case(backend, *case)
    assert backend.state_cache.size == (1 if case[1] is DISABLED else 0)


# -- the rule and its boundary --------------------------------------------------------------

async def _value_plan(backend: Any, config: ast.StateTtlConfig, plan_times: list[tuple[int, str]],
                      *, event_time: bool = False, start: int = 0) -> list[Any]:
    async def write(s: Any, ctx: Any) -> Any:
        await s.v.update(ctx.timestamp if event_time else "w")
        return NOTHING

    async def read(s: Any, ctx: Any) -> Any:
        return await s.v.value()

    plan = [At(t, write if op == "w" else read) for t, op in plan_times]
    out, _ = await run(Steps(v=ast.ValueStateDescriptor("v", ttl=config)), backend, plan,
                       event_time=event_time, start=start)
    return out


async def test_an_entry_expires_when_last_access_plus_ttl_reaches_now(backend):
    out = await _value_plan(backend, ttl(100), [(5, "w"), (104, "r"), (105, "r")], start=5)
    assert out == ["w", None]


async def test_the_expiration_is_clamped_so_the_largest_ttl_never_expires(backend):
    config = ttl(2**63 - 1)
    out = await _value_plan(backend, config, [(10, "w"), (2**62, "r")])
    assert out == ["w"]


async def test_before_the_first_watermark_nothing_expires(backend):
    config = ttl(1, event_time=True)
    fn = Steps(v=ast.ValueStateDescriptor("v", ttl=config))

    async def write(s: Any, ctx: Any) -> Any:
        await s.v.update("x")
        return NOTHING

    async def read(s: Any, ctx: Any) -> Any:
        return await s.v.value()

    async with make_operator(fn, backend, event_time=True) as op:
        for ts, step in ((-(2**63), write), (-(2**63) + 5, read), (-10, read)):
            await op.process(("k", step, ts))
            await op.drain()
        assert op.current_watermark() == -(2**63)
        assert op.outputs() == ["x", "x"]


async def test_event_time_stamps_the_record_timestamp_and_expires_by_the_watermark(backend):
    # Written by a record stamped 50 while the watermark is 0: it lives until watermark 150.
    config = ttl(100, event_time=True)
    fn = Steps(v=ast.ValueStateDescriptor("v", ttl=config))

    async def write(s: Any, ctx: Any) -> Any:
        await s.v.update(ctx.timestamp)
        return NOTHING

    async def read(s: Any, ctx: Any) -> Any:
        return await s.v.value()

    async with make_operator(fn, backend, event_time=True) as op:
        await op.process(("k", write, 50))
        for watermark in (149, 150):
            await op.drain()
            await op.advance_watermark(watermark)
            await op.process(("k", read, 0))
        await op.drain()
        assert op.outputs() == [50, None]


async def test_event_time_refresh_uses_the_reading_record_timestamp(backend):
    config = ttl(100, event_time=True, update=ON_READ)
    fn = Steps(v=ast.ValueStateDescriptor("v", ttl=config))

    async def write(s: Any, ctx: Any) -> Any:
        await s.v.update("x")
        return NOTHING

    async def read(s: Any, ctx: Any) -> Any:
        return await s.v.value()

    async with make_operator(fn, backend, event_time=True) as op:
        await op.process(("k", write, 0))
        await op.process(("k", read, 90))  # refreshed to 90: lives until watermark 190
        await op.drain()
        await op.advance_watermark(180)
        await op.process(("k", read, 0))
        await op.drain()
        await op.advance_watermark(190)
        await op.process(("k", read, 0))
        await op.drain()
        assert op.outputs() == ["x", "x", None]


@pytest.mark.parametrize("backend", ["heap", "rocksdb"], indirect=True)
async def test_event_time_write_without_a_timestamp_fails_naming_the_state(backend):
    config = ttl(100, event_time=True)
    fn = Steps(v=ast.ValueStateDescriptor("expiring", ttl=config))

    async def write(s: Any, ctx: Any) -> Any:
        await s.v.update(1)
        return NOTHING

    async def read(s: Any, ctx: Any) -> Any:
        return await s.v.value()  # reading needs no access time (no refresh)

    op = ast.KeyedOperator(fn, key_selector=lambda r: r[0], backend=backend,
                           clock=ast.ManualClock())
    with pytest.raises(ast.InvalidStateError,
                       match=r"^state 'expiring' has event-time TTL, .* the record with key "
                             r"'k' has none: give the operator a timestamp_selector"):
        async with op:
            await op.process(("k", read))
            await op.drain()
            assert op.outputs() == [None]
            await op.process(("k", write))
            await op.drain()


@pytest.mark.parametrize("backend", ["heap", "rocksdb", "rocksdb-cache"], indirect=True)
@pytest.mark.parametrize("expired_first", [True, False])
async def test_an_expired_state_read_with_a_fresh_state_of_the_same_key_leaves_it_alone(
        backend, expired_first: bool) -> None:
    # Two states of one key and namespace store under the same key bytes, each in its own
    # column family on RocksDB: removing the expired one on read must not hide the other,
    # in the same batch or after it.
    config = ttl(10)
    fn = Steps(old=ast.ValueStateDescriptor("old", ttl=config),
               fresh=ast.ReducingStateDescriptor("fresh", lambda a, b: a + b, ttl=config))

    async def write_old(s: Any, ctx: Any) -> Any:
        await s.old.update("B")
        return NOTHING

    async def add_10(s: Any, ctx: Any) -> Any:
        await s.fresh.add(10)
        return NOTHING

    async def together(s: Any, ctx: Any) -> Any:
        # Issued together, so they share a batch: "old" has expired, "fresh" has not.
        reads = [s.old.value(), s.fresh.get(), s.fresh.add(5)]
        if not expired_first:
            reads = [reads[1], reads[0], reads[2]]
        return await ast.combine_all(reads)

    async def total(s: Any, ctx: Any) -> Any:
        return await s.fresh.get()

    async with make_operator(fn, backend) as op:
        await op.process(("k", write_old))
        await op.advance_processing_time(5)
        await op.process(("k", add_10))  # expires at 15
        await op.advance_processing_time(12)  # "old" expired at 10
        await op.process(("k", together))
        await op.process(("k", total))
        await op.drain()
        first = [None, 10, None] if expired_first else [10, None, None]
        assert op.outputs() == [first, 15]


# -- lists and maps: one by one -------------------------------------------------------------

async def test_list_elements_expire_one_by_one(backend):
    config = ttl(100)
    fn = Steps(l=ast.ListStateDescriptor("l", ttl=config))

    def add(v: Any) -> Any:
        async def step(s: Any, ctx: Any) -> Any:
            await s.l.add(v)
            return NOTHING
        return step

    async def add_all(s: Any, ctx: Any) -> Any:
        await s.l.add_all(["c", "d"])
        return NOTHING

    async def read(s: Any, ctx: Any) -> Any:
        return await (await s.l.get()).to_list()

    plan = [At(0, add("a")), At(40, add("b")), At(80, add_all), At(100, read),
            At(140, read), At(180, read)]
    out, counts = await run(fn, backend, plan, counts=["l"])
    assert out == [["b", "c", "d"], ["c", "d"], []]
    assert counts == {"l": 0}


async def test_list_update_stamps_every_element_and_refresh_rewrites_them_in_order(backend):
    config = ttl(100, update=ON_READ)
    fn = Steps(l=ast.ListStateDescriptor("l", ttl=config))

    async def update(s: Any, ctx: Any) -> Any:
        await s.l.update([3, 1, 2])
        return NOTHING

    async def read(s: Any, ctx: Any) -> Any:
        return await (await s.l.get()).to_list()

    out, _ = await run(fn, backend, [At(0, update), At(90, read), At(180, read),
                                     At(280, read)])
    assert out == [[3, 1, 2], [3, 1, 2], []]


async def test_map_entries_expire_one_by_one_in_every_read(backend):
    config = ttl(100)
    fn = Steps(m=ast.MapStateDescriptor("m", ttl=config))

    def put(k: str) -> Any:
        async def step(s: Any, ctx: Any) -> Any:
            await s.m.put(k, k.upper())
            return NOTHING
        return step

    async def put_all(s: Any, ctx: Any) -> Any:
        await s.m.put_all({"c": "C", "d": "D"})
        return NOTHING

    async def look(s: Any, ctx: Any) -> Any:
        return (sorted(await (await s.m.entries()).to_list()),
                sorted(await (await s.m.keys()).to_list()),
                sorted(await (await s.m.values()).to_list()),
                await s.m.get("a"), await s.m.contains("b"), await s.m.is_empty())

    plan = [At(0, put("a")), At(50, put("b")), At(60, put_all), At(100, look),
            At(155, look), At(160, look)]
    out, counts = await run(fn, backend, plan, counts=["m"])
    assert out == [
        ([("b", "B"), ("c", "C"), ("d", "D")], ["b", "c", "d"], ["B", "C", "D"], None, True,
         False),
        ([("c", "C"), ("d", "D")], ["c", "d"], ["C", "D"], None, False, False),
        ([], [], [], None, False, True),
    ]
    assert counts == {"m": 0}


async def test_map_is_empty_with_return_expired_counts_an_expired_entry_and_leaves_it(
        backend):
    # is_empty removes only the expired entries it meets before the one it counts: with
    # RETURN_EXPIRED_IF_NOT_CLEANED_UP that is the expired entry itself, which a read then
    # returns (once: that read removes it).
    config = ttl(100, visibility=RETURN)
    fn = Steps(m=ast.MapStateDescriptor("m", ttl=config))

    async def put(s: Any, ctx: Any) -> Any:
        await s.m.put("a", 1)
        return NOTHING

    async def empty(s: Any, ctx: Any) -> Any:
        return await s.m.is_empty()

    async def get(s: Any, ctx: Any) -> Any:
        return await s.m.get("a")

    out, counts = await run(fn, backend, [At(0, put), At(200, empty), At(200, empty),
                                          At(200, get), At(200, empty), At(200, get)],
                            counts=["m"])
    assert out == [False, False, 1, True, None]
    assert counts == {"m": 0}


async def test_long_list_and_map_iterations_load_in_chunks_without_expired_items(backend):
    # Chunks of 3: expired items between the visible ones never end a chunk early, and the
    # next chunk starts after the last item returned.
    config = ttl(100)
    fn = Steps(l=ast.ListStateDescriptor("l", ttl=config),
               m=ast.MapStateDescriptor("m", ttl=config))

    def fill(start: int) -> Any:
        async def step(s: Any, ctx: Any) -> Any:
            for i in range(start, 20, 2):
                await s.l.add(i)
                await s.m.put(i, i)
            return NOTHING
        return step

    async def read(s: Any, ctx: Any) -> Any:
        return (await (await s.l.get()).to_list(),
                sorted(await (await s.m.keys()).to_list()))

    plan = [At(0, fill(0)), At(50, fill(1)), At(120, read)]
    out, _ = await run(fn, backend, plan, config=ast.AsyncStateConfig(iterator_chunk_size=3))
    odd = list(range(1, 20, 2))
    assert out == [(odd, odd)]


async def test_a_partly_iterated_list_or_map_refreshes_only_the_chunks_it_loaded(backend):
    # ON_READ_AND_WRITE, chunks of 2: an iteration left after its third item has loaded
    # two chunks, and refreshed their four items only (a read stamps what it returns).
    config = ttl(100, update=ON_READ)
    fn = Steps(l=ast.ListStateDescriptor("l", ttl=config),
               m=ast.MapStateDescriptor("m", ttl=config))

    async def fill(s: Any, ctx: Any) -> Any:
        await s.l.add_all(list(range(5)))
        await s.m.put_all({i: i for i in range(5)})
        return NOTHING

    async def three(iterator: Any) -> list[Any]:
        taken = []
        async for item in iterator:
            taken.append(item)
            if len(taken) == 3:
                break
        return taken

    async def peek(s: Any, ctx: Any) -> Any:
        return (await three(await s.l.get()), await three(await s.m.keys()))

    async def read(s: Any, ctx: Any) -> Any:
        return (await (await s.l.get()).to_list(),
                sorted(await (await s.m.keys()).to_list()))

    out, counts = await run(fn, backend, [At(0, fill), At(50, peek), At(120, read)],
                            counts=["l", "m"], config=ast.AsyncStateConfig(iterator_chunk_size=2))
    assert out == [([0, 1, 2], [0, 1, 2]), ([0, 1, 2, 3], [0, 1, 2, 3])]
    assert counts == {"l": 4, "m": 4}


async def test_a_chunk_removes_the_expired_entries_it_read_not_those_written_since(backend):
    # Chunks of 2, event time (records out of order put an expired element and entry in the
    # middle): the record writes between two chunk loads of its iteration, and the second
    # chunk removes the expired element and entry it passes, nothing written since.
    fn = Steps(l=ast.ListStateDescriptor("l", ttl=ttl(100, event_time=True)),
               m=ast.MapStateDescriptor("m", ttl=ttl(100, event_time=True)))

    def write(elements: list[str], entries: dict[int, Any]) -> Any:
        async def step(s: Any, ctx: Any) -> Any:
            await s.l.add_all(elements)
            await s.m.put_all(entries)
            return NOTHING
        return step

    async def interleaved(s: Any, ctx: Any) -> Any:
        elements, keys = await s.l.get(), await s.m.keys()  # a first chunk each
        await s.l.add("e")
        await s.m.put(3, "new")
        read = await elements.to_list()
        await keys.to_list()
        return (read, await (await s.l.get()).to_list(), await s.m.get(3))

    plan = [At(50, write(["a", "b", "x"], {0: 0, 1: 1, 2: 2})),
            At(0, write(["c"], {3: "old"})),  # expires at 100
            At(50, write(["d"], {4: 4})),
            At(120, interleaved)]
    async with make_operator(fn, backend, event_time=True,
                             config=ast.AsyncStateConfig(iterator_chunk_size=2)) as op:
        out = await play(op, plan, event_time=True)
        assert out == [(["a", "b", "x", "d"], ["a", "b", "x", "d", "e"], "new")]
        assert (stored_entries(backend, "l"), stored_entries(backend, "m")) == (5, 5)


# -- reducing and aggregating ---------------------------------------------------------------

@pytest.mark.parametrize("visibility", [NEVER, RETURN], ids=["never", "return"])
async def test_add_folds_into_an_expired_value_only_when_expired_values_are_returned(
        backend, visibility):
    config = ttl(100, visibility=visibility)
    fn = Steps(r=ast.ReducingStateDescriptor("r", lambda a, b: a + b, ttl=config),
               a=ast.AggregatingStateDescriptor("a", Sum(), ttl=config))

    async def add(s: Any, ctx: Any) -> Any:
        await s.r.add(5)
        await s.a.add(5)
        return NOTHING

    async def read(s: Any, ctx: Any) -> Any:
        return (await s.r.get(), await s.a.get())

    out, _ = await run(fn, backend, [At(0, add), At(150, add), At(150, read),
                                     At(240, read)])
    # As in Flink: the add's own read treats an expired value as visibility says, and the
    # add stamps the result with its own time.
    expected = 10 if visibility is RETURN else 5
    assert out == [(expected, expected), (expected, expected)]


@pytest.mark.parametrize("kind", ["reducing", "aggregating"])
async def test_add_reads_the_time_when_it_is_called_not_when_its_batch_runs(backend, kind):
    # The clock moves while the adds are in flight (as the wall clock does during a slow
    # batch): an add stamps the time it was called, and a second add of the record checks
    # the value it folds into at its own call, not once the first add is done.
    # RETURN_EXPIRED_IF_NOT_CLEANED_UP: a read returns an expired value once, removing it.
    fn = Steps(s=KINDS[kind][0](ttl(100, visibility=RETURN)))

    async def read(s: Any, ctx: Any) -> Any:
        return await s.s.get()

    async with make_operator(fn, backend) as op:
        async def add_then_wait(s: Any, ctx: Any) -> Any:
            pending = s.s.add(5)
            op.clock.set(60)
            await pending
            return NOTHING

        async def two_adds_then_wait(s: Any, ctx: Any) -> Any:
            first, second = s.s.add(1), s.s.add(2)
            op.clock.set(250)
            await first
            await second
            return NOTHING

        out = await play(op, [At(0, add_then_wait, key="a"), At(100, read, key="a"),
                              At(100, read, key="a"), At(100, two_adds_then_wait, key="b"),
                              At(250, read, key="b"), At(250, read, key="b")])
    # "a" expired at 100 (stamped 0, not 60); "b" holds 1 + 2, stamped 100 and expired at
    # 200 (not 1 then, the second add having checked at 250, a fresh 2).
    assert out == [5, None, 3, None]


@pytest.mark.parametrize("kind", ["reducing", "aggregating"])
async def test_a_get_behind_a_pending_add_reads_the_time_when_it_is_called(backend, kind):
    # A get waits for an add of its record (of any namespace) while the clock moves past the
    # expiration and the record changes namespace: it checks expiry, refreshes
    # (ON_READ_AND_WRITE) and registers the cleanup timer of its refresh at its own call.
    config = ast.StateTtlConfig.new_builder(100).disable_cleanup_in_background() \
        .update_ttl_on_read_and_write().cleanup_with_timers(1).build()
    fn = Steps(s=KINDS[kind][0](config))

    async def add(s: Any, ctx: Any) -> Any:
        s.s.set_current_namespace("window-1")
        await s.s.add(1)
        return NOTHING

    async with make_operator(fn, backend) as op:
        async def add_then_get(s: Any, ctx: Any) -> Any:
            s.s.set_current_namespace(None)
            added = s.s.add(5)
            s.s.set_current_namespace("window-1")
            got = s.s.get()  # waits for the add
            s.s.set_current_namespace(None)
            op.clock.set(120)
            await added
            return await got

        # window-1, stamped 0, is refreshed at 60: both entries expire at 160.
        assert await play(op, [At(0, add), At(60, add_then_get)]) == [1]
        await advance(op, 159, False)
        assert stored_entries(backend, "s") == 2
        await advance(op, 160, False)
        assert stored_entries(backend, "s") == 0


# -- order on the batched path --------------------------------------------------------------

async def test_a_refreshing_read_then_an_update_without_awaiting_ends_with_the_update(backend):
    config = ttl(100, update=ON_READ)
    fn = Steps(v=ast.ValueStateDescriptor("v", ttl=config))

    async def write(s: Any, ctx: Any) -> Any:
        await s.v.update(1)
        return NOTHING

    async def read_then_update(s: Any, ctx: Any) -> Any:
        first = s.v.value()
        s.v.update(5)
        second = s.v.value()  # answered after the update, in issue order
        return (await first, await second)

    async def read(s: Any, ctx: Any) -> Any:
        return await s.v.value()

    out, _ = await run(fn, backend, [At(0, write), At(50, read_then_update), At(140, read)])
    assert out == [(1, 5), 5]


async def test_writes_then_reads_of_one_map_without_awaiting_see_each_other(backend):
    config = ttl(100, update=ON_READ)
    fn = Steps(m=ast.MapStateDescriptor("m", ttl=config))

    async def steps(s: Any, ctx: Any) -> Any:
        s.m.put("a", 1)
        entries = s.m.entries()
        got = s.m.get("a")
        s.m.remove("a")
        gone = s.m.contains("a")
        s.m.put("b", 2)
        empty = s.m.is_empty()
        return (await (await entries).to_list(), await got, await gone, await empty)

    out, counts = await run(fn, backend, [At(0, steps)], counts=["m"])
    assert out == [([("a", 1)], 1, False, False)]
    assert counts == {"m": 1}


@pytest.mark.parametrize("backend", ["rocksdb"], indirect=True)
async def test_two_refreshing_reads_of_one_key_in_one_batch_see_the_first_refresh(backend):
    # Both reads go to one multi-get; the second one (issued at 150) must find the entry as
    # the first one (at 90) left it, refreshed until 190, not as the multi-get read it.
    config = ttl(100, update=ON_READ)
    fn = Steps(v=ast.ValueStateDescriptor("v", ttl=config))

    async def write(s: Any, ctx: Any) -> Any:
        await s.v.update("x")
        return NOTHING

    async with make_operator(fn, backend, config=ast.AsyncStateConfig(batch_size=10)) as op:
        await play(op, [At(0, write)])
        await op.advance_processing_time(90)

        async def two_reads(s: Any, ctx: Any) -> Any:
            first = s.v.value()
            op.clock.set(150)
            second = s.v.value()
            return (await first, await second)

        await op.process(("k", two_reads, 0))
        await op.drain()
        assert op.outputs() == [("x", "x")]
        assert stored_entries(backend, "v") == 1


# -- disabled, and the config ---------------------------------------------------------------

async def test_update_type_disabled_stores_plain_values(backend, tmp_path):
    config = ttl(1, update=DISABLED)
    fn = Steps(v=ast.ValueStateDescriptor("v", ttl=config))

    async def write(s: Any, ctx: Any) -> Any:
        await s.v.update("x")
        return NOTHING

    async with make_operator(fn, backend) as op:
        await play(op, [At(0, write)])
        path = await op.snapshot(tmp_path / "chk", 1)
        assert type(fn.s.v) is ast.ValueState
    assert open_checkpoint(path).state_ttl == {}


def test_builder_defaults_and_setters_follow_flink():
    config = ast.StateTtlConfig.new_builder(1000).build()
    assert (config.ttl_ms, config.update_type, config.state_visibility,
            config.ttl_time_characteristic, config.cleanup_full_snapshot,
            config.incremental_cleanup, config.compact_filter_cleanup,
            config.cleanup_in_background) == (
        1000, ON_CREATE, NEVER, ast.TtlTimeCharacteristic.PROCESSING_TIME, False, None,
        None, True)
    built = (ast.StateTtlConfig.new_builder(5).set_update_type(ON_READ)
             .set_state_visibility(RETURN)
             .set_ttl_time_characteristic(ast.TtlTimeCharacteristic.EVENT_TIME)
             .cleanup_full_snapshot().cleanup_incrementally(7, True)
             .cleanup_in_rocksdb_compact_filter(50).disable_cleanup_in_background()
             .set_ttl(6).build())
    assert (built.ttl_ms, built.update_type, built.state_visibility,
            built.ttl_time_characteristic, built.cleanup_full_snapshot,
            built.incremental_cleanup.cleanup_size,
            built.incremental_cleanup.run_cleanup_for_every_record,
            built.compact_filter_cleanup.query_time_after_num_entries,
            built.cleanup_in_background) == (
        6, ON_READ, RETURN, ast.TtlTimeCharacteristic.EVENT_TIME, True, 7, True, 50, False)
    # The defaults a backend runs when cleanup in background is on and nothing is named.
    assert config.effective_incremental_cleanup(background_cleaner=False).cleanup_size == 5
    assert config.effective_incremental_cleanup(background_cleaner=True) is None
    assert config.effective_compact_filter_cleanup(
        background_cleaner=True).query_time_after_num_entries == 1000
    assert built.effective_compact_filter_cleanup(background_cleaner=False) is None


@pytest.mark.parametrize(("call", "message"), [
    (lambda: ast.StateTtlConfig.new_builder(0),
     r"^ttl_ms must be in \[1, 9223372036854775807\], got 0$"),
    (lambda: ast.StateTtlConfig.new_builder(True), r"^ttl_ms must be an int in \[1, "),
    (lambda: ast.StateTtlConfig.new_builder(2**63), r"^ttl_ms must be in \[1, "),
    (lambda: ast.StateTtlConfig.new_builder(1).set_update_type("on_read_and_write"),
     r"^update_type must be one of ast\.UpdateType\.DISABLED, "),
    (lambda: ast.StateTtlConfig.new_builder(1).set_state_visibility(None),
     r"^state_visibility must be one of ast\.StateVisibility\."),
    (lambda: ast.StateTtlConfig.new_builder(1).set_ttl_time_characteristic(1),
     r"^ttl_time_characteristic must be one of ast\.TtlTimeCharacteristic\."),
    (lambda: ast.StateTtlConfig.new_builder(1).cleanup_incrementally(0, False),
     r"^cleanup_size must be >= 1, got 0$"),
    (lambda: ast.StateTtlConfig.new_builder(1).cleanup_incrementally(5, 1),
     r"^run_cleanup_for_every_record must be a bool, got 1$"),
    (lambda: ast.StateTtlConfig.new_builder(1).cleanup_in_rocksdb_compact_filter(0),
     r"^query_time_after_num_entries must be >= 1, got 0$"),
    (lambda: ast.ValueStateDescriptor("v", ttl=ast.StateTtlConfig.new_builder(1)),
     r"^ttl_config must be a StateTtlConfig \(call \.build\(\) on the builder\), got "),
])
def test_invalid_configs_name_the_option(call, message):
    with pytest.raises(ast.ConfigError, match=message):
        call()


async def test_a_backend_without_ttl_support_refuses_a_ttl_state_naming_it():
    fn = Steps(v=ast.ValueStateDescriptor("v", ttl=ttl(10)))
    executor = ManualExecutor()
    with pytest.raises(ast.ConfigError, match=r"^ttl_config must be None for state 'v': "
                                              r"ManualExecutor cannot store TTL state"):
        async with ast.KeyedOperator(fn, key_selector=lambda r: r[0], backend=executor):
            pass


@pytest.mark.parametrize("backend", ["heap", "rocksdb"], indirect=True)
async def test_ttl_states_are_the_state_classes_of_their_kind(backend):
    config = ttl(10)
    fn = Steps(value=ast.ValueStateDescriptor("value", ttl=config),
               list=ast.ListStateDescriptor("list", ttl=config),
               map=ast.MapStateDescriptor("map", ttl=config),
               reducing=ast.ReducingStateDescriptor("reducing", max, ttl=config),
               aggregating=ast.AggregatingStateDescriptor("aggregating", Sum(), ttl=config))
    async with make_operator(fn, backend):
        s = fn.s
        assert isinstance(s.value, ast.ValueState)
        assert isinstance(s.list, ast.ListState)
        assert isinstance(s.map, ast.MapState)
        assert isinstance(s.reducing, ast.ReducingState)
        assert isinstance(s.aggregating, ast.AggregatingState)


@pytest.mark.parametrize("backend", ["rocksdb"], indirect=True)
async def test_refreshes_kept_back_on_rocksdb_are_written_or_overwritten_in_order(backend):
    # A refresh found by a point read is written a few batches later unless a write of the
    # key overwrites it meanwhile: neither may bring back what a later write removed, and a
    # refresh left alone must last (also across closing the directory).
    config = ttl(100, update=ON_READ)
    fn = Steps(v=ast.ValueStateDescriptor("v", ttl=config),
               m=ast.MapStateDescriptor("m", ttl=config),
               other=ast.ValueStateDescriptor("other"))

    async def write(s: Any, ctx: Any) -> Any:
        await s.v.update("x")
        await s.m.put("a", 1)
        return NOTHING

    async def read(s: Any, ctx: Any) -> Any:
        return (await s.v.value(), await s.m.get("a"))

    async def remove(s: Any, ctx: Any) -> Any:
        await s.v.clear()
        await s.m.clear()
        return NOTHING

    async def other(s: Any, ctx: Any) -> Any:
        await s.other.update(1)
        return NOTHING

    idle = [At(90, other, key=i) for i in range(8)]  # batches that age the refreshes
    async with make_operator(fn, backend) as op:
        out = await play(op, [At(0, write, key="kept"), At(0, write, key="removed"),
                              At(90, read, key="kept"), At(90, read, key="removed"),
                              At(90, remove, key="removed"), *idle,
                              At(180, read, key="kept"), At(180, read, key="removed")])
        assert out == [("x", 1), ("x", 1), ("x", 1), (None, None)]
        await play(op, [At(185, read, key="kept")])  # refreshed to 185, kept back
    directory = backend.path
    out, _ = await run(fn, ast.RocksDBBackend(directory),
                       [At(280, read, key="kept"), At(290, read, key="removed")], start=280)
    assert out == [("x", 1), (None, None)]


class _Counter(ast.KeyedProcessFunction):
    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count", ttl=ttl(100,
                                                                             update=ON_READ)))

    def process_element(self, value: Any, ctx: ast.RecordContext) -> Any:
        return self.count.value().then_compose(
            lambda c: self.count.update((c or 0) + 1).then_apply(
                lambda _: ctx.emit((value, (c or 0) + 1))))


@pytest.mark.parametrize("batches_in_flight", [1, 2, 6])
async def test_rocksdb_writes_no_refresh_that_the_records_own_write_overwrites(
        tmp_path, batches_in_flight):
    # A counter's read refreshes its key (ON_READ_AND_WRITE) and the record's write of the
    # key comes in a batch triggered after the read was delivered, behind every batch under
    # way by then: the refresh is overwritten, never written, so RocksDB stores one version
    # of the key per record however many batches were under way. (The memtable counts the
    # writes only with in-place updates off: in place, a write adds no entry.)
    keys, rounds = 60, 3
    backend = ast.RocksDBBackend(tmp_path / "db", inline_read_keys=0,
                                 options=ast.RocksDBOptions(inplace_updates=False))
    config = ast.AsyncStateConfig(batch_size=10, max_in_flight=10 * batches_in_flight)
    async with ast.KeyedOperator(_Counter(), key_selector=lambda r: r, backend=backend,
                                 clock=ast.ManualClock(0), config=config) as op:
        for r in range(rounds):
            await advance(op, 10 * r, event_time=False)  # each round refreshes the last
            for key in range(keys):
                await op.process(key)
            await op.drain()
        assert sorted(op.outputs()) == sorted((k, r + 1) for k in range(keys)
                                              for r in range(rounds))
        cf = backend._handles["count"].cf
        assert cf.property_int_value("rocksdb.num-entries-active-mem-table") == keys * rounds


@pytest.mark.parametrize("ts", [0, 1, 2**40, 2**62 - 1, 2**62, 2**63 - 1, -1, -(2**63)])
def test_timestamped_bytes_carry_any_int64_timestamp_and_are_one_msgpack_value(ts):
    from asyncstate.serde import decode_value
    from asyncstate.state.ttl.layout import HEADER_SIZE, encode, timestamp_of

    data = encode(ts, b"\xa1x")
    assert timestamp_of(data) == ts
    assert data[HEADER_SIZE:] == b"\xa1x"
    assert decode_value(data) == [ts, "x"]  # checkpoints read it as the pair
    with pytest.raises(ValueError, match=r"^stored bytes b'\\x92\\x05x' are not a "):
        timestamp_of(b"\x92\x05x")


class _GetIterPut(ast.KeyedProcessFunction):
    """A record of kind "read" calls get(a), entries() and put(a) without awaiting between."""

    def __init__(self, config: ast.StateTtlConfig) -> None:
        self.config = config

    def open(self, ctx: Any) -> None:
        self.m = ctx.get_map_state(ast.MapStateDescriptor("m", ttl=self.config))

    async def process_element(self, record: Any, ctx: Any) -> None:
        if record[2] == "put":
            await self.m.put("a", "x")
            return
        got = self.m.get("a")
        entries = self.m.entries()
        put = self.m.put("a", "y")
        ctx.emit((await got, sorted(await (await entries).to_list())))
        await put


@pytest.mark.parametrize("backend", ["heap", "rocksdb", "remote0-rocksdb"])
async def test_an_iteration_between_a_read_and_a_write_judges_by_the_reads_refresh(
        backend: str, tmp_path: Any) -> None:
    """Event time, a late record: "a" was written at 50; at watermark 140 a record of time
    30 reads it (alive until 150) and so refreshes it to 30, which makes it expired (130 <=
    140) for the entries() that follows, before the record's put."""
    config = (ast.StateTtlConfig.new_builder(100).update_ttl_on_read_and_write()
              .set_ttl_time_characteristic(ast.TtlTimeCharacteristic.EVENT_TIME)
              .disable_cleanup_in_background().build())
    async with ast.KeyedOperator(_GetIterPut(config), key_selector=lambda r: r[0],
                                 timestamp_selector=lambda r: r[1],
                                 backend=new_backend(backend, tmp_path),
                                 config=ast.AsyncStateConfig(batch_size=8)) as op:
        await op.advance_watermark(0)
        await op.process(("k", 50, "put"))
        await op.drain()
        await op.advance_watermark(140)
        await op.process(("k", 30, "read"))
        await op.drain()
        assert op.outputs() == [("x", [])]
