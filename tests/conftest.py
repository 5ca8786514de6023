"""Suite-wide pytest configuration: event-loop matrix, hypothesis profiles, the backend
fixtures and the state-test helpers.

Backends: a test taking `backend` (a fresh backend) or `make_backend` (a factory of fresh
backends of one kind) runs once per kind of `shared_functions.BACKEND_FACTORIES`:
``STORAGE_BACKENDS`` for `backend`, ``OPERATOR_BACKENDS`` for `make_backend`, or the kinds a
``@pytest.mark.backends("heap", "rocksdb")`` mark names. Test ids carry the kind
(``[asyncio-heap]``).
"""

from __future__ import annotations

import asyncio
import os
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from shared_functions import (
    BACKEND_FACTORIES,
    LOOP_FACTORIES,
    OPERATOR_BACKENDS,
    STORAGE_BACKENDS,
    AsyncScript,
    Script,
    first,
    normalize,
    remove_temporary_directories,
    run_records,
)

import asyncstate as ast
from asyncstate.runtime.context import set_current_context

# Hypothesis: building a loop or a RocksDB per example is slow on a busy 2-core machine, so no
# deadline anywhere; CI runs a fixed, derandomized sample.
settings.register_profile(
    "ci",
    deadline=None,
    max_examples=60,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=100)
# A long search for rare interleavings: ASYNCSTATE_HYPOTHESIS_PROFILE=soak (tests with slow
# examples scale their own max_examples with shared_functions.slow_examples).
settings.register_profile("soak", deadline=None, max_examples=2000,
                          suppress_health_check=[HealthCheck.too_slow])
_PROFILE = os.environ.get("ASYNCSTATE_HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI")
                                                                 else "dev")
settings.load_profile(_PROFILE)
# Under the soak profile a property test runs many times longer than its timeout mark
# allows: each gets an hour instead.
SOAK_TIMEOUT_S = 3600


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Run every async test once per event loop (pytest-asyncio >= 1.x hook).

    Test ids gain a ``[asyncio]`` / ``[uvloop]`` suffix. A test may narrow the set with
    ``@pytest.mark.asyncio(loop_factories=["uvloop"])``.
    """
    return LOOP_FACTORIES

# The `manual_clock` and `manual_executor` fixtures come from asyncstate's pytest plugin
# (asyncstate/pytest_plugin.py, registered as a pytest11 entry point).


# -- backends --------------------------------------------------------------------------------

_DEFAULT_KINDS = {"backend": STORAGE_BACKENDS, "make_backend": OPERATOR_BACKENDS}


@pytest.hookimpl(trylast=True)  # after hypothesis marks its tests
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _PROFILE == "soak":
        for item in items:
            if item.get_closest_marker("hypothesis") is not None:
                item.add_marker(pytest.mark.timeout(SOAK_TIMEOUT_S), append=False)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "backends(*kinds): the backend kinds (keys of "
        "shared_functions.BACKEND_FACTORIES) the `backend` and `make_backend` fixtures run on")


def _parametrized(metafunc: pytest.Metafunc, name: str) -> bool:
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0]
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",")]
        if name in names:
            return True
    return False


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    mark = metafunc.definition.get_closest_marker("backends")
    for name, default in _DEFAULT_KINDS.items():
        if name in metafunc.fixturenames and not _parametrized(metafunc, name):
            kinds = default if mark is None else mark.args
            unknown = set(kinds) - set(BACKEND_FACTORIES)
            assert not unknown, f"unknown backend kinds {sorted(unknown)}"
            metafunc.parametrize(name, list(kinds), indirect=True)


@pytest.fixture
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """A fresh backend of the kind the test runs on."""
    return BACKEND_FACTORIES[request.param](tmp_path)


@pytest.fixture
def make_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Any]:
    """A factory of fresh backends of the kind the test runs on (a backend serves one
    operator)."""
    factory = BACKEND_FACTORIES[request.param]
    return lambda: factory(tmp_path)


@pytest.fixture(autouse=True, scope="session")
def _remove_temporary_directories() -> Iterator[None]:
    yield
    remove_temporary_directories()


@pytest.fixture(autouse=True)
def _no_current_record_context() -> Iterator[None]:
    # Synchronous tests make contexts current in the thread's own contextvars context.
    set_current_context(None)
    yield
    set_current_context(None)


# -- state-semantics helpers -----------------------------------------------------------------


@pytest.fixture(scope="session")
def state_helpers() -> types.SimpleNamespace:
    """The backend-independent helpers of the state tests (usable from hypothesis tests):
    `Script` / `AsyncScript` (functions whose records carry the step to run), `normalize`
    (what a value reads back as) and `factories` (the factory of each kind of storage)."""
    factories = {kind: BACKEND_FACTORIES[kind] for kind in STORAGE_BACKENDS}
    return types.SimpleNamespace(Script=Script, AsyncScript=AsyncScript, normalize=normalize,
                                 factories=factories)


@pytest.fixture
def sh(backend: Any, state_helpers: types.SimpleNamespace) -> types.SimpleNamespace:
    """`state_helpers` plus `backend` and `run` (drive records through a real KeyedOperator
    on the test's backend; the outputs, in order)."""

    async def run(fn: ast.KeyedProcessFunction, records: Iterable[Any], *,
                  key_selector: Callable[[Any], Any] = first, **config: Any) -> list[Any]:
        return await run_records(fn, records, backend, key_selector=key_selector, **config)

    return types.SimpleNamespace(**vars(state_helpers), run=run, backend=backend)
