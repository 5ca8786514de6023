"""KeyAccountingUnit: which record currently holds each key."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from asyncstate.errors import InvalidStateError

__all__ = ["KeyAccountingUnit"]


class KeyAccountingUnit:
    """Maps a key's canonical bytes to the record holding it: at most one record per key."""

    __slots__ = ("_holders",)

    def __init__(self) -> None:
        self._holders: dict[bytes, Any] = {}

    def __repr__(self) -> str:
        return f"<KeyAccountingUnit occupied={len(self._holders)}>"

    def occupy(self, holder: Any, key: bytes) -> bool:
        """Let `holder` hold `key` if nobody does; True on success."""
        holders = self._holders
        if key in holders:
            return False
        holders[key] = holder
        return True

    def release(self, holder: Any, key: bytes) -> None:
        """Free `key`; raises InvalidStateError (after freeing it) if another holder had it."""
        current = self._holders.pop(key, None)
        if current is not holder:
            raise InvalidStateError(
                f"key {key!r} released by {holder!r} but held by {current!r}")

    def holders(self) -> Iterable[Any]:
        """Every current holder (a live view: do not occupy or release while iterating)."""
        return self._holders.values()

    def occupied_count(self) -> int:
        """Number of keys held."""
        return len(self._holders)
