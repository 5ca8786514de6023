"""TTL state against a sequential model with explicit timestamps: random writes and reads of a
value, a list and a map (lists also read in part, chunk by chunk), clock or watermark
advances, and snapshots restored at another parallelism, on the heap and on RocksDB."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st
from shared_functions import LOOP_NAMES, run_on_loop, slow_examples
from ttl_harness import Steps

import asyncstate as ast

TTL = 50
MIN = -(2**63)
KEYS = [0, 1, 2]
USER_KEYS = ["a", "b"]


@dataclass
class Model:
    """What the states hold: (state, key[, user key]) -> [value, timestamp]; lists hold a
    list of [value, timestamp] per key."""

    refresh: bool
    return_expired: bool
    event_time: bool
    full_snapshot: bool
    chunk: int = 1000  # iterator_chunk_size
    clock: int = 0
    watermark: int = MIN
    values: dict[Any, list[Any]] = field(default_factory=dict)
    lists: dict[Any, list[list[Any]]] = field(default_factory=dict)

    def now(self) -> int:
        return self.watermark if self.event_time else self.clock

    def access(self, ts: int) -> int:
        return ts if self.event_time else self.clock

    def expired(self, stamp: int, now: int) -> bool:
        return stamp + TTL <= now

    def read(self, slot: Any, ts: int) -> Any:
        entry = self.values.get(slot)
        if entry is None:
            return None
        if self.expired(entry[1], self.now()):
            del self.values[slot]
            return entry[0] if self.return_expired else None
        if self.refresh:
            entry[1] = self.access(ts)
        return entry[0]

    def read_many(self, items: list[list[Any]], ts: int) -> tuple[list[Any], list[list[Any]]]:
        """What a read of a list (or of map entries) returns, and what it leaves stored."""
        now, out, kept = self.now(), [], []
        for item in items:
            if self.expired(item[-1], now):
                if self.return_expired:
                    out.append(item[:-1])
                continue
            if self.refresh:
                item[-1] = self.access(ts)
            out.append(item[:-1])
            kept.append(item)
        return out, kept

    def peek(self, key: Any, ts: int, n: int) -> list[Any]:
        """The first `n` elements of a read of a list left after them: its chunks up to the
        one holding the n-th refresh what they return and remove the expired elements they
        go over (up to the first element the read returns after them)."""
        now, out, kept = self.now(), [], []
        limit = -(-n // self.chunk) * self.chunk  # the elements those chunks return
        items = self.lists.get(key, [])
        for i, item in enumerate(items):
            expired = self.expired(item[1], now)
            if len(out) == limit and (self.return_expired or not expired):
                kept.extend(items[i:])
                break
            if expired:
                if self.return_expired:
                    out.append(item[0])
                continue
            if self.refresh:
                item[1] = self.access(ts)
            out.append(item[0])
            kept.append(item)
        if kept:
            self.lists[key] = kept
        else:
            self.lists.pop(key, None)
        return out[:n]

    def apply(self, op: tuple[Any, ...]) -> Any:
        kind, key, ts = op[0], op[1], op[2]
        if kind == "set":
            self.values["v", key] = [op[3], self.access(ts)]
            return None
        if kind == "get":
            return self.read(("v", key), ts)
        if kind == "add":
            self.lists.setdefault(key, []).append([op[3], self.access(ts)])
            return None
        if kind == "add_all":
            self.lists.setdefault(key, []).extend([v, self.access(ts)] for v in op[3])
            return None
        if kind == "list":
            out, kept = self.read_many(self.lists.get(key, []), ts)
            if kept:
                self.lists[key] = kept
            else:
                self.lists.pop(key, None)
            return [x[0] for x in out]
        if kind == "peek":
            return self.peek(key, ts, op[3])
        if kind == "put":
            self.values["m", key, op[3]] = [op[4], self.access(ts)]
            return None
        if kind == "mget":
            return self.read(("m", key, op[3]), ts)
        assert kind == "entries"
        items = [[slot[2], entry[0], entry[1]] for slot, entry in self.values.items()
                 if slot[0] == "m" and slot[1] == key]
        out, kept = self.read_many(items, ts)
        for item in items:
            if item not in kept:
                del self.values["m", key, item[0]]
            else:
                self.values["m", key, item[0]][1] = item[2]
        return sorted((x[0], x[1]) for x in out)

    def snapshot(self) -> None:
        if not self.full_snapshot:
            return
        now = self.now()
        self.values = {s: e for s, e in self.values.items() if not self.expired(e[1], now)}
        self.lists = {k: [x for x in v if not self.expired(x[1], now)]
                      for k, v in self.lists.items()}
        self.lists = {k: v for k, v in self.lists.items() if v}


def _config(model: Model) -> ast.StateTtlConfig:
    builder = ast.StateTtlConfig.new_builder(TTL).disable_cleanup_in_background()
    if model.refresh:
        builder.update_ttl_on_read_and_write()
    if model.return_expired:
        builder.return_expired_if_not_cleaned_up()
    if model.event_time:
        builder.set_ttl_time_characteristic(ast.TtlTimeCharacteristic.EVENT_TIME)
    if model.full_snapshot:
        builder.cleanup_full_snapshot()
    return builder.build()


async def _step(s: Any, ctx: Any) -> Any:
    op = ctx.record[3]
    kind = op[0]
    if kind == "set":
        await s.v.update(op[3])
    elif kind == "get":
        return await s.v.value()
    elif kind == "add":
        await s.l.add(op[3])
    elif kind == "add_all":
        await s.l.add_all(op[3])
    elif kind == "list":
        return await (await s.l.get()).to_list()
    elif kind == "peek":
        taken = []
        async for item in await s.l.get():
            taken.append(item)
            if len(taken) == op[3]:
                break
        return taken
    elif kind == "put":
        await s.m.put(op[3], op[4])
    elif kind == "mget":
        return await s.m.get(op[3])
    else:
        return sorted(await (await s.m.entries()).to_list())
    return None


_ts = st.integers(0, 300)
_op = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(KEYS), _ts, st.integers(0, 9)),
    st.tuples(st.just("get"), st.sampled_from(KEYS), _ts),
    st.tuples(st.just("add"), st.sampled_from(KEYS), _ts, st.integers(0, 9)),
    st.tuples(st.just("add_all"), st.sampled_from(KEYS), _ts,
              st.lists(st.integers(0, 9), min_size=1, max_size=4)),
    st.tuples(st.just("list"), st.sampled_from(KEYS), _ts),
    st.tuples(st.just("peek"), st.sampled_from(KEYS), _ts, st.integers(1, 4)),
    st.tuples(st.just("put"), st.sampled_from(KEYS), _ts, st.sampled_from(USER_KEYS),
              st.integers(0, 9)),
    st.tuples(st.just("mget"), st.sampled_from(KEYS), _ts, st.sampled_from(USER_KEYS)),
    st.tuples(st.just("entries"), st.sampled_from(KEYS), _ts),
    st.tuples(st.just("advance"), st.integers(1, 80)),
    st.tuples(st.just("restore"), st.integers(1, 3)),
)


async def _play(model: Model, ops: list[tuple[Any, ...]], backends: Any, tmp: Path) -> None:
    parallelism = 1
    restore_from: str | None = None
    checkpoint = 0
    while True:
        config = _config(model)
        operators = [ast.KeyedOperator(
            Steps(v=ast.ValueStateDescriptor("v", ttl=config),
                  l=ast.ListStateDescriptor("l", ttl=config),
                  m=ast.MapStateDescriptor("m", ttl=config)),
            key_selector=lambda r: r[0], timestamp_selector=lambda r: r[2],
            backend=backends(tmp / f"db-{checkpoint}-{i}"), clock=ast.ManualClock(model.clock),
            config=ast.AsyncStateConfig(iterator_chunk_size=model.chunk),
            parallelism=parallelism, operator_index=i, restore_from=restore_from)
            for i in range(parallelism)]
        for op in operators:
            await op.__aenter__()
        try:
            while ops:
                op_ = ops.pop(0)
                if op_[0] == "advance":
                    if model.event_time:
                        model.watermark = max(model.watermark, 0) + op_[1]
                    else:
                        model.clock += op_[1]
                    for operator in operators:
                        if model.event_time:
                            await operator.advance_watermark(model.watermark)
                        else:
                            await operator.advance_processing_time(model.clock)
                    continue
                if op_[0] == "restore":
                    checkpoint += 1
                    for operator in operators:
                        restore_from = await operator.snapshot(tmp / "chk", checkpoint)
                    model.snapshot()
                    model.watermark = MIN  # a new operator starts before the first watermark
                    parallelism = op_[1]
                    break
                key = op_[1]
                owner = next(o for o in operators
                             if ast.assign_to_key_group(key, 128) in o.key_group_range)
                await owner.process((key, _step, op_[2], op_))
                await owner.drain()
                got = owner.outputs()
                want = model.apply(op_)
                assert got == [want], (op_, got, want)
            else:
                return
        finally:
            for operator in operators:
                await operator.__aexit__(None, None, None)


_modes = st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans(),
                   st.sampled_from([1, 2, 1000]))


def _check(modes: tuple[bool, bool, bool, bool, int], ops: list[tuple[Any, ...]],
           backends: Any, loop: str) -> None:
    model = Model(*modes)
    with tempfile.TemporaryDirectory(prefix="asyncstate-ttl-model-") as tmp:
        run_on_loop(loop, _play(model, list(ops), backends, Path(tmp)))


# ON_READ_AND_WRITE, chunks of 1: a read left after its first element refreshes that one only.
_PARTIAL_READ = {"modes": (True, False, False, False, 1),
                 "ops": [("add_all", 0, 0, [1, 2, 3]), ("advance", 30), ("peek", 0, 0, 1),
                         ("advance", 30), ("list", 0, 0)], "loop": "uvloop"}
# Each example runs on an event loop it draws: both loops, at the cost of one.
_loops = st.sampled_from(LOOP_NAMES)


@settings(max_examples=slow_examples(40))
@given(modes=_modes, ops=st.lists(_op, max_size=30), loop=_loops)
@example(**_PARTIAL_READ)
def test_heap_matches_the_model(modes, ops, loop):
    _check(modes, ops, lambda path: ast.HeapBackend(), loop)


@settings(max_examples=slow_examples(15))
@given(modes=_modes, ops=st.lists(_op, max_size=25), loop=_loops)
@example(**_PARTIAL_READ)
def test_rocksdb_matches_the_model(modes, ops, loop):
    _check(modes, ops, lambda path: ast.RocksDBBackend(str(path)), loop)
