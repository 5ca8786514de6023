"""HeapBackend on its own: what its restore stores (the behaviour it shares with RocksDB is
tested against it as the model in the test_rocksdb* modules)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import pytest
from backend_harness import Harness, Op, drained, record_context

from asyncstate.backends.heap import HeapBackend
from asyncstate.runtime.requests import StateRequestType
from asyncstate.serde import canonical_key

T = StateRequestType
NS = canonical_key(None)


async def test_heap_restore_into_the_default_namespace_compares_bytes_by_value():
    """Namespace bytes equal to the default namespace's, but another bytes object, land in
    the default namespace."""
    heap = HeapBackend()
    harness = Harness(heap, asyncio.get_running_loop())
    ns = bytes(bytearray(NS))
    assert ns == NS and ns is not NS
    heap.restore_key_group(record_context("k").key_group, [
        ("v", canonical_key("k"), ns, msgpack.packb(5)),
        ("l", canonical_key("k"), ns, [msgpack.packb(6)])])
    ops: list[Op] = [("v", T.VALUE_GET, None, "k", None), ("l", T.LIST_GET, None, "k", None)]
    assert await drained(harness, ops, await harness.run(ops)) == [5, [6]]


@pytest.mark.parametrize("between", ["nothing", "append", "replace"])
def test_a_ttl_list_walk_removes_each_chunks_expired_elements_in_place(between: str) -> None:
    # 10,000 elements, every third expired, read in chunks of 100 with cleanup on read: each
    # chunk cuts its own expired elements out of the stored list (one pass over the list
    # per chunk would make long walks quadratic); an append between two chunks stays, and
    # after the list was replaced each chunk removes its expired elements by identity.
    from asyncstate.backends.heap_ttl import LIST, TtlWalk, walk_chunk
    from asyncstate.state.ttl.layout import TtlPolicy, TtlRead, TtlValue

    read = TtlRead(TtlPolicy(100, False, False, True), 1000, 1000, None)
    items = [TtlValue(0 if i % 3 == 0 else 950, i) for i in range(10_000)]
    table: dict[Any, Any] = {b"k": items}
    walk = TtlWalk(LIST, table, b"k", list(items), read)
    pos, seen, chunks = 0, [], 0
    while pos < len(walk.entries):
        got, pos = walk_chunk(walk, pos, 100)
        seen += got
        chunks += 1
        if chunks == 3 and between == "append":
            table[b"k"].append(TtlValue(990, "appended"))
        if chunks == 3 and between == "replace":
            table[b"k"] = list(table[b"k"])
    expected = [i for i in range(10_000) if i % 3]
    assert seen == expected
    stored = [e.stored for e in table[b"k"]]
    assert stored == expected + (["appended"] if between == "append" else [])
    assert (table[b"k"] is items) == (between != "replace")  # cut in place while it could
