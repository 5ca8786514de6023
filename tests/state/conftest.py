"""State-semantics contract suite: one `backend` fixture over every supported backend.

`SUPPORTED_BACKENDS` lists one `pytest.param(factory, id=name)` per backend; a factory takes
the test's `tmp_path` and returns a fresh backend. Adding a backend is one line here, and
every state test then runs against it. A test may narrow the set with
``@pytest.mark.parametrize("backend", ["heap"], indirect=True)``.

The `sh` fixture carries the helpers of this package: `Script` / `AsyncScript` (functions
whose records carry the step to run), `run` (drive records through a real KeyedOperator on
the test's backend), `normalize` (what a value reads back as) and `factories` (backend id to
factory). `state_helpers` is the session-scoped part without a backend, for hypothesis.
"""

from __future__ import annotations

import tempfile
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
from shared_functions import normalize

import asyncstate as ast

BackendFactory = Callable[[Path], Any]

SUPPORTED_BACKENDS = [
    pytest.param(lambda tmp_path: ast.HeapBackend(), id="heap"),
    # The batched path: requests go through execute_batch, results come back per batch.
    pytest.param(lambda tmp_path: ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0),
                 id="remote0"),
    pytest.param(lambda tmp_path: ast.RocksDBBackend(
        tempfile.mkdtemp(prefix="asyncstate-") if tmp_path is None else str(tmp_path / "db")),
        id="rocksdb"),
    # An inner backend that delivers from its own threads, behind the simulated network.
    pytest.param(lambda tmp_path: ast.SimulatedRemoteBackend(ast.RocksDBBackend(
        tempfile.mkdtemp(prefix="asyncstate-") if tmp_path is None else str(tmp_path / "db")),
        latency_ms=0), id="remote0-rocksdb"),
]

BACKEND_FACTORIES: dict[str, BackendFactory] = {p.id: p.values[0] for p in SUPPORTED_BACKENDS}


@pytest.fixture(params=SUPPORTED_BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """A fresh backend of each supported kind (indirect: also accepts a backend id)."""
    param = request.param
    factory = BACKEND_FACTORIES[param] if isinstance(param, str) else param
    return factory(tmp_path)


_GETTERS: dict[type, str] = {
    ast.ValueStateDescriptor: "get_state",
    ast.ListStateDescriptor: "get_list_state",
    ast.MapStateDescriptor: "get_map_state",
    ast.ReducingStateDescriptor: "get_reducing_state",
    ast.AggregatingStateDescriptor: "get_aggregating_state",
}


def _declare(rc: ast.RuntimeContext, descriptors: dict[str, Any]) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        **{name: getattr(rc, _GETTERS[type(d)])(d) for name, d in descriptors.items()})


class Script(ast.KeyedProcessFunction):
    """Plain-def function: a record is ``(key, step)`` and ``step(states, ctx)`` runs as the
    body of process_element; its result (None or a StateFuture) is returned as is.

    `states` has one attribute per keyword descriptor given to the constructor.
    """

    def __init__(self, **descriptors: Any) -> None:
        self.descriptors = descriptors

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.s = _declare(ctx, self.descriptors)

    def process_element(self, record: Any, ctx: Any) -> Any:
        return record[1](self.s, ctx)


class AsyncScript(Script):
    """Like Script, but process_element is an ``async def`` awaiting ``step(states, ctx)``
    (an ``async def`` step)."""

    async def process_element(self, record: Any, ctx: Any) -> Any:  # type: ignore[override]
        await record[1](self.s, ctx)



def _first(record: Any) -> Any:
    return record[0]


@pytest.fixture(scope="session")
def state_helpers() -> types.SimpleNamespace:
    """The backend-independent helpers (usable from hypothesis tests)."""
    return types.SimpleNamespace(Script=Script, AsyncScript=AsyncScript, normalize=normalize,
                                 factories=BACKEND_FACTORIES)


@pytest.fixture
def sh(backend: Any, state_helpers: types.SimpleNamespace) -> types.SimpleNamespace:
    """`state_helpers` plus `backend` and `run`, bound to this test's backend."""

    async def run(fn: ast.KeyedProcessFunction, records: Iterable[Any], *,
                  key_selector: Callable[[Any], Any] = _first, **config: Any) -> list[Any]:
        """Process `records` through a KeyedOperator on `backend`; the outputs, in order."""
        async with ast.KeyedOperator(fn, key_selector=key_selector, backend=backend,
                                     config=ast.AsyncStateConfig(**config)) as op:
            for record in records:
                await op.process(record)
            await op.drain()
            return op.outputs()

    return types.SimpleNamespace(**vars(state_helpers), run=run, backend=backend)
