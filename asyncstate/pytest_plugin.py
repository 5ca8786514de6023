"""pytest fixtures for testing code built on asyncstate.

Installed with the package as a pytest plugin (entry point ``pytest11``), so any project
that has asyncstate installed gets the fixtures without importing anything:

- `manual_clock`: an `asyncstate.testing.ManualClock` starting at 0 ms;
- `manual_executor`: an `asyncstate.testing.ManualExecutor` with a fixed-seed rng.
"""

from __future__ import annotations

import random

import pytest

from asyncstate.testing import ManualClock, ManualExecutor

__all__ = ["manual_clock", "manual_executor"]


@pytest.fixture
def manual_clock() -> ManualClock:
    """A ManualClock starting at 0 ms."""
    return ManualClock()


@pytest.fixture
def manual_executor() -> ManualExecutor:
    """A ManualExecutor with a fixed-seed rng, so completion order is deterministic."""
    return ManualExecutor(random.Random(0))
