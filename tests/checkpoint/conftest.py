"""Helpers for checkpoint tests: a tiny state object and a model-driven HeapBackend filler."""

from __future__ import annotations

import types
from typing import Any, ClassVar

import pytest
from shared_functions import FakeState, normalize

from asyncstate.backends.heap import HeapBackend
from asyncstate.keygroups import key_group_of_bytes
from asyncstate.runtime.requests import StateKind
from asyncstate.runtime.requests import StateRequestType as T
from asyncstate.serde import canonical_key, to_stored


class Heap:
    """A HeapBackend driven through `execute_one`, with readers for comparing against a model.

    The model maps (state name, key, namespace) to a value (value kinds), a list (list
    state) or a dict (map state).
    """

    KINDS: ClassVar[dict[str, StateKind]] = {
        "v": StateKind.VALUE, "l": StateKind.LIST, "m": StateKind.MAP,
        "r": StateKind.REDUCING, "a": StateKind.AGGREGATING}

    def __init__(self, backend: HeapBackend | None = None) -> None:
        self.backend = backend if backend is not None else HeapBackend()
        self.states: dict[str, FakeState] = {}

    def state(self, name: str) -> Any:  # a FakeState standing in for an InternalState
        st = self.states.get(name)
        if st is None:
            kind = self.KINDS[name[0]]
            st = FakeState(name, kind, self.backend.register_state(name, kind))
            self.states[name] = st
        return st

    def put(self, name: str, key: Any, ns: Any, value: Any) -> None:
        st = self.state(name)
        kb, nb = canonical_key(key), canonical_key(ns)
        run = self.backend.execute_one
        if st.kind is StateKind.LIST:
            run(st, T.LIST_UPDATE, [to_stored(v, name) for v in value], kb, nb)
        elif st.kind is StateKind.MAP:
            run(st, T.CLEAR, None, kb, nb)
            run(st, T.MAP_PUT_ALL, [(canonical_key(k), to_stored(v, name))
                                    for k, v in value.items()], kb, nb)
        else:
            run(st, T.VALUE_UPDATE, to_stored(value, name), kb, nb)

    def get(self, name: str, key: Any, ns: Any) -> Any:
        st = self.state(name)
        kb, nb = canonical_key(key), canonical_key(ns)
        run = self.backend.execute_one
        if st.kind is StateKind.LIST:
            items = _all_items(run, st, T.LIST_GET, kb, nb)
            return items or None
        if st.kind is StateKind.MAP:
            items = _all_items(run, st, T.MAP_ITER, kb, nb)
            return {_hashable(k): v for k, v in items} or None
        return run(st, T.VALUE_GET, None, kb, nb)

    def count_entries(self, max_parallelism: int) -> dict[int, int]:
        """Entries per key group (through the public per-key-group snapshot)."""
        counts = {}
        for kg in range(max_parallelism):
            n = sum(1 for _ in self.backend.snapshot_key_group(kg, max_parallelism))
            if n:
                counts[kg] = n
        return counts


def _all_items(run: Any, st: Any, request_type: T, kb: bytes, nb: bytes) -> list[Any]:
    """Every item of an iteration, chunk by chunk (bounded: an iteration that never ends
    fails here)."""
    chunk = run(st, request_type, None, kb, nb)
    items = list(chunk.items)
    for _ in range(100_000):
        if chunk.continuation is None:
            return items
        chunk = run(st, T.ITERATOR_LOADING, (request_type, chunk.continuation), kb, nb)
        items += chunk.items
    raise AssertionError("the iteration does not end")


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, list) else k


def key_group(key: Any, max_parallelism: int) -> int:
    return int(key_group_of_bytes(canonical_key(key), max_parallelism))


@pytest.fixture(scope="session")
def ck() -> types.SimpleNamespace:
    """The helpers of this module: `Heap`, `FakeState`, `key_group`, `normalize`."""
    return types.SimpleNamespace(Heap=Heap, FakeState=FakeState, key_group=key_group,
                                 normalize=normalize)
