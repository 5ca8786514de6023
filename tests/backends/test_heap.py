"""HeapBackend on its own: what its restore stores (the behaviour it shares with RocksDB is
tested against it as the model in the test_rocksdb* modules)."""

from __future__ import annotations

import asyncio

import msgpack
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
