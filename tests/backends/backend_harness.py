"""Helpers of the backend tests.

`Harness` drives a backend directly, without a controller: it registers the states "v", "l",
"m", "r" and "a" (value, list, map, reducing, aggregating), sends batches of requests written
in a backend-neutral form (`Op`) and collects their deliveries, so that a RocksDBBackend can
be compared with a HeapBackend request by request. The keyed functions and `run_operator`
drive a backend through a real KeyedOperator."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgpack
import rocksdict
from shared_functions import FakeState, run_records

import asyncstate as ast
from asyncstate.backends.base import ExecutorBinding, StateExecutor
from asyncstate.backends.rocksdb import RocksDBBackend
from asyncstate.keygroups import key_group_of_bytes
from asyncstate.runtime.context import RecordContext
from asyncstate.runtime.future import StateFuture
from asyncstate.runtime.requests import IteratorChunk, StateKind, StateRequest, StateRequestType
from asyncstate.serde import canonical_key, to_stored

T = StateRequestType
MAX_PARALLELISM = 128
STATES = {
    "v": StateKind.VALUE,
    "l": StateKind.LIST,
    "m": StateKind.MAP,
    "r": StateKind.REDUCING,
    "a": StateKind.AGGREGATING,
}
MAP_ITERATIONS = (T.MAP_ITER, T.MAP_ITER_KEY, T.MAP_ITER_VALUE)
ITERATIONS = (T.LIST_GET, *MAP_ITERATIONS)


def record_context(key: Any) -> RecordContext:
    """A real record context for `key`, outside any controller (the backend reads only its
    key bytes and key group)."""
    key_bytes = canonical_key(key)
    return RecordContext(None, key, key_bytes, key_group_of_bytes(key_bytes, MAX_PARALLELISM),
                         None)


# An operation in backend-neutral form: (state name, request type, user-level payload, key,
# namespace). `Harness.request` turns it into a StateRequest for one backend.
Op = tuple[str, StateRequestType, Any, Any, Any]


def stored_payload(name: str, t: StateRequestType, payload: Any) -> Any:
    if t in (T.VALUE_UPDATE, T.REDUCING_ADD, T.AGGREGATING_ADD, T.LIST_ADD):
        return None if payload is None else to_stored(payload, name)
    if t in (T.LIST_ADD_ALL, T.LIST_UPDATE):
        return [to_stored(v, name) for v in payload]
    if t in (T.MAP_GET, T.MAP_CONTAINS, T.MAP_REMOVE):
        return canonical_key(payload)
    if t is T.MAP_PUT:
        user_key, value = payload
        return (canonical_key(user_key), None if value is None else to_stored(value, name))
    if t is T.MAP_PUT_ALL:
        return [(canonical_key(k), None if v is None else to_stored(v, name)) for k, v in payload]
    return None


class Harness:
    """Drives one backend directly: registers states, sends batches, collects deliveries."""

    def __init__(self, backend: StateExecutor, loop: asyncio.AbstractEventLoop,
                 chunk_size: int = 1000) -> None:
        self.backend = backend
        self.loop = loop
        self.waiting: dict[int, asyncio.Future[list[Any]]] = {}
        self.delivery_order: list[int] = []
        backend.open(ExecutorBinding(loop=loop, deliver=self._deliver,
                                     iterator_chunk_size=chunk_size,
                                     max_parallelism=MAX_PARALLELISM))
        self.states = {name: FakeState(name, kind, backend.register_state(name, kind))
                       for name, kind in STATES.items()}

    def _deliver(self, batch: list[StateRequest], results: list[Any] | None,
                 error: BaseException | None) -> None:
        assert self.loop.is_running()
        self.delivery_order.append(id(batch))
        future = self.waiting.pop(id(batch))
        if error is not None:
            future.set_exception(error)
        else:
            assert results is not None and len(results) == len(batch)
            future.set_result(results)

    def request(self, op: Op) -> StateRequest:
        name, t, payload, key, ns = op
        return StateRequest(self.states[name], t, stored_payload(name, t, payload),  # type: ignore[arg-type]
                            canonical_key(ns), record_context(key), StateFuture())

    def submit(self, batch: list[StateRequest]) -> asyncio.Future[list[Any]]:
        future = self.loop.create_future()
        self.waiting[id(batch)] = future
        self.backend.execute_batch(batch)
        return future

    async def run(self, ops: list[Op]) -> list[Any]:
        return await self.submit([self.request(op) for op in ops])

    async def run_all(self, batches: list[list[Op]]) -> list[list[Any]]:
        """Trigger every batch before any completes, like a controller under load."""
        futures = [self.submit([self.request(op) for op in ops]) for ops in batches]
        return list(await asyncio.gather(*futures))

    async def drain(self, op: Op, result: Any) -> Any:
        """The whole iteration as a list (map items sorted: their order is unspecified)."""
        if not isinstance(result, IteratorChunk):
            return result
        name, t, _payload, key, ns = op
        items = list(result.items)
        continuation = result.continuation
        loads = 0
        while continuation is not None:
            loads += 1
            assert loads <= 10_000, "the iteration does not end"
            loading = StateRequest(self.states[name], T.ITERATOR_LOADING,  # type: ignore[arg-type]
                                   (t, continuation), canonical_key(ns), record_context(key),
                                   StateFuture())
            [chunk] = await self.submit([loading])
            items.extend(chunk.items)
            continuation = chunk.continuation
        if t in MAP_ITERATIONS:
            items.sort(key=msgpack.packb)
        return items


async def drained(harness: Harness, ops: list[Op], results: list[Any]) -> list[Any]:
    return [await harness.drain(op, r) for op, r in zip(ops, results, strict=True)]


class ManyStates(ast.KeyedProcessFunction):
    """One value state per name; each record writes `value[1]` into every one of them and
    emits what every state held before."""

    def __init__(self, names: list[str]) -> None:
        self.names = names

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.states = [ctx.get_state(ast.ValueStateDescriptor(n)) for n in self.names]

    async def process_element(self, value: Any, ctx: Any) -> None:
        before = [await s.value() for s in self.states]
        for s in self.states:
            await s.update(value[1])
        ctx.emit((ctx.current_key, before))


class ReadOnly(ast.KeyedProcessFunction):
    """Emits (key, value of value state "count") without writing."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    async def process_element(self, value: Any, ctx: Any) -> None:
        ctx.emit((ctx.current_key, await self.count.value()))


def key_of(record: Any) -> Any:
    """Key selector: the first item of a tuple record, or the record itself."""
    return record[0] if isinstance(record, tuple) else record


async def run_operator(function: ast.KeyedProcessFunction, backend: Any, records: list[Any],
                       config: ast.AsyncStateConfig | None = None) -> list[Any]:
    return await run_records(function, records, backend, key_selector=key_of, config=config)


def per_key(outputs: list[Any]) -> dict[Any, list[Any]]:
    """Outputs grouped by key (the first element), in emission order: records of one key
    finish in order, records of different keys may interleave differently per backend."""
    grouped: dict[Any, list[Any]] = {}
    for out in outputs:
        grouped.setdefault(out[0], []).append(out)
    return grouped


def assert_reopens_while_held(path: Path, error: BaseException) -> None:
    """`error` and its traceback (with every frame in it, and the exceptions it chains) are
    still alive here: nothing in them may hold a database or column family object, which
    would keep the directory locked."""
    assert isinstance(error, BaseException)
    RocksDBBackend(path).close()


def damage_metadata(path: Path, key: bytes, value: bytes) -> None:
    """Overwrite one metadata entry (default column family) of a closed database."""
    families = {name: rocksdict.Options(raw_mode=True)
                for name in rocksdict.Rdict.list_cf(str(path)) if name != "default"}
    db = rocksdict.Rdict(str(path), rocksdict.Options(raw_mode=True), column_families=families)
    db[key] = value
    db.close()
    del db
