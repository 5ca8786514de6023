"""Fixtures of the backend tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncstate.backends.rocksdb import RocksDBBackend


@pytest.fixture(params=[0, 16], ids=["pool-reads", "inline-reads"])
def rocks(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[RocksDBBackend]:
    """A RocksDBBackend that sends every read to the pool, and one that reads small batches
    on the loop thread."""
    backend = RocksDBBackend(tmp_path / "db", inline_read_keys=request.param)
    yield backend
    backend.close()
