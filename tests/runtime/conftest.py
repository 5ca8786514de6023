"""Runtime tests: no record context leaks from one synchronous test into the next."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from asyncstate.runtime.context import set_current_context


@pytest.fixture(autouse=True)
def _no_current_record_context() -> Iterator[None]:
    # Synchronous tests make contexts current in the thread's own contextvars context.
    set_current_context(None)
    yield
    set_current_context(None)
