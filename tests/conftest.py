"""Suite-wide pytest configuration: event-loop matrix and hypothesis profiles."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping

import pytest
import uvloop
from hypothesis import HealthCheck, settings

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
settings.load_profile(os.environ.get("ASYNCSTATE_HYPOTHESIS_PROFILE")
                      or ("ci" if os.environ.get("CI") else "dev"))

_LOOP_FACTORIES: Mapping[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Run every async test once per event loop (pytest-asyncio >= 1.x hook).

    Test ids gain a ``[asyncio]`` / ``[uvloop]`` suffix. A test may narrow the set with
    ``@pytest.mark.asyncio(loop_factories=["uvloop"])``.
    """
    return _LOOP_FACTORIES

# The `manual_clock` and `manual_executor` fixtures come from asyncstate's pytest plugin
# (asyncstate/pytest_plugin.py, registered as a pytest11 entry point).
