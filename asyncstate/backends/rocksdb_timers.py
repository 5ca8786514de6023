"""TimerStore: a RocksDB column family of timers, handed to the timer queues.

The timer queues (`asyncstate.timers.rocksdb_set`) write and scan their column family on the
loop thread. They get it through this wrapper, not as the column family object itself: a
column family object keeps RocksDB's LOCK even after the database closed, so the backend
must be able to take back every one it handed out (`release`), whoever still holds the
wrapper. Writes use the backend's write options.
"""

from __future__ import annotations

from typing import Any

from asyncstate.errors import InvalidStateError

__all__ = ["TimerStore"]


class TimerStore:
    """The column family `name` of the RocksDB database at `path`, until released."""

    __slots__ = ("_cf", "_write_options", "name", "path")

    def __init__(self, cf: Any, write_options: Any, name: str, path: str) -> None:
        self._cf = cf
        self._write_options = write_options
        self.name = name
        self.path = path

    def __repr__(self) -> str:
        state = "released" if self._cf is None else "open"
        return f"<TimerStore {self.name!r} of {self.path!r} {state}>"

    def _live(self) -> Any:
        cf = self._cf
        if cf is None:
            raise InvalidStateError(f"the timers {self.name!r} of RocksDB directory "
                                    f"{self.path!r} are no longer available (it closed, or a "
                                    "restore replaced them)")
        return cf

    def put(self, key: bytes, value: bytes, write_options: Any = None) -> None:
        """Store `key` (the backend's write options apply)."""
        self._live().put(key, value, self._write_options)

    def delete(self, key: bytes, write_options: Any = None) -> None:
        """Remove `key`."""
        self._live().delete(key, self._write_options)

    def delete_range(self, begin: bytes, end: bytes, write_options: Any = None) -> None:
        """Remove every key in [begin, end)."""
        self._live().delete_range(begin, end, self._write_options)

    def iter(self, read_options: Any) -> Any:
        """An iterator over the column family (see rocksdict.Rdict.iter)."""
        return self._live().iter(read_options)

    def items(self, from_key: bytes, read_opt: Any) -> Any:
        """(key, value) pairs from `from_key` (see rocksdict.Rdict.items)."""
        return self._live().items(from_key=from_key, read_opt=read_opt)

    def release(self) -> None:
        """Drop the column family object: the wrapper refuses every later call."""
        self._cf = None
